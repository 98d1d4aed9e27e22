//! Label and field selectors, parsed from their query-string form.

use crate::status::ApiError;

/// One requirement of a label selector.
#[derive(Debug, Clone, PartialEq, Eq)]
enum LabelReq {
    Eq(String, String),
    NotEq(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

/// A parsed `labelSelector` (requirements are ANDed).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct LabelSelector(Vec<LabelReq>);

fn valid_key(k: &str) -> bool {
    !k.is_empty()
        && k.len() <= 317
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/'))
}

fn valid_value(v: &str) -> bool {
    v.len() <= 63
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// Splits on commas that are not inside parentheses.
fn split_top_level(s: &str) -> Result<Vec<&str>, ApiError> {
    let mut parts = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        if !(0..=1).contains(&depth) {
            return Err(ApiError::bad_request(format!(
                "unable to parse requirement: unbalanced parentheses in {s:?}"
            )));
        }
    }
    if depth != 0 {
        return Err(ApiError::bad_request(format!(
            "unable to parse requirement: unbalanced parentheses in {s:?}"
        )));
    }
    parts.push(&s[start..]);
    Ok(parts)
}

fn bad_label(term: &str, why: &str) -> ApiError {
    ApiError::bad_request(format!("unable to parse requirement: {why}: {term:?}"))
}

fn parse_set(term: &str, inner: &str) -> Result<Vec<String>, ApiError> {
    let mut values = Vec::new();
    for v in inner.split(',') {
        let v = v.trim();
        if !valid_value(v) {
            return Err(bad_label(term, "invalid label value"));
        }
        values.push(v.to_string());
    }
    Ok(values)
}

fn parse_label_term(term: &str) -> Result<LabelReq, ApiError> {
    if let Some(open) = term.find('(') {
        let close = term
            .strip_suffix(')')
            .ok_or_else(|| bad_label(term, "expected ')'"))?;
        let inner = &close[open + 1..];
        let head = term[..open].trim_end();
        let (key, negate) = if let Some(k) = head.strip_suffix("notin") {
            (k, true)
        } else if let Some(k) = head.strip_suffix("in") {
            (k, false)
        } else {
            return Err(bad_label(term, "expected 'in' or 'notin'"));
        };
        if !key.ends_with(char::is_whitespace) {
            return Err(bad_label(term, "expected whitespace before set operator"));
        }
        let key = key.trim();
        if !valid_key(key) {
            return Err(bad_label(term, "invalid label key"));
        }
        let set = parse_set(term, inner)?;
        return Ok(if negate {
            LabelReq::NotIn(key.into(), set)
        } else {
            LabelReq::In(key.into(), set)
        });
    }
    if let Some(key) = term.strip_prefix('!') {
        let key = key.trim();
        if !valid_key(key) {
            return Err(bad_label(term, "invalid label key"));
        }
        return Ok(LabelReq::NotExists(key.into()));
    }
    let (key, value, negate) = if let Some((k, v)) = term.split_once("!=") {
        (k, v, true)
    } else if let Some((k, v)) = term.split_once("==") {
        (k, v, false)
    } else if let Some((k, v)) = term.split_once('=') {
        (k, v, false)
    } else {
        let key = term.trim();
        if !valid_key(key) {
            return Err(bad_label(term, "invalid label key"));
        }
        return Ok(LabelReq::Exists(key.into()));
    };
    let (key, value) = (key.trim(), value.trim());
    if !valid_key(key) {
        return Err(bad_label(term, "invalid label key"));
    }
    if !valid_value(value) {
        return Err(bad_label(term, "invalid label value"));
    }
    Ok(if negate {
        LabelReq::NotEq(key.into(), value.into())
    } else {
        LabelReq::Eq(key.into(), value.into())
    })
}

impl LabelSelector {
    /// Parses a selector; an empty string selects everything.
    pub(crate) fn parse(s: &str) -> Result<Self, ApiError> {
        if s.trim().is_empty() {
            return Ok(Self::default());
        }
        let mut reqs = Vec::new();
        for term in split_top_level(s)? {
            let term = term.trim();
            if term.is_empty() {
                return Err(bad_label(s, "empty requirement"));
            }
            reqs.push(parse_label_term(term)?);
        }
        Ok(Self(reqs))
    }

    /// True if the selector selects everything.
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether an object with these labels matches.
    pub(crate) fn matches(&self, labels: &[(String, String)]) -> bool {
        let get = |k: &str| {
            labels
                .iter()
                .find(|(lk, _)| lk == k)
                .map(|(_, v)| v.as_str())
        };
        self.0.iter().all(|r| match r {
            LabelReq::Eq(k, v) => get(k) == Some(v.as_str()),
            LabelReq::NotEq(k, v) => get(k) != Some(v.as_str()),
            LabelReq::In(k, set) => get(k).is_some_and(|v| set.iter().any(|s| s == v)),
            LabelReq::NotIn(k, set) => get(k).is_none_or(|v| !set.iter().any(|s| s == v)),
            LabelReq::Exists(k) => get(k).is_some(),
            LabelReq::NotExists(k) => get(k).is_none(),
        })
    }
}

/// Which field a field-selector requirement tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Name,
    Namespace,
    /// A Pod's `spec.nodeName` (`""` when it is not scheduled), as kube-apiserver selects
    /// Pods by it (a per-node agent's stream); the only kind-specific field served.
    NodeName,
}

/// A parsed `fieldSelector` (supports `metadata.name`, `metadata.namespace` and, for Pods,
/// `spec.nodeName`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct FieldSelector(Vec<(Field, bool, String)>);

impl FieldSelector {
    /// Parses a selector; an empty string selects everything. As apimachinery's
    /// `fields.ParseSelector`: terms are split on unescaped commas, and a value may escape
    /// `\\`, `,` and `=` with a backslash (`fields.EscapeValue`); any other escape is refused.
    pub(crate) fn parse(s: &str) -> Result<Self, ApiError> {
        if s.trim().is_empty() {
            return Ok(Self::default());
        }
        let invalid = |term: &str| {
            ApiError::bad_request(format!(
                "invalid selector: '{s}'; can't understand '{term}'"
            ))
        };
        let mut reqs = Vec::new();
        for term in split_unescaped(s) {
            let term = term.trim();
            let (field, raw, negate) = split_operator(term).ok_or_else(|| invalid(term))?;
            let value = unescape_value(raw).map_err(|e| {
                ApiError::bad_request(format!("invalid field selector value {raw:?}: {e}"))
            })?;
            let field = match field.trim() {
                "metadata.name" => Field::Name,
                "metadata.namespace" => Field::Namespace,
                "spec.nodeName" => Field::NodeName,
                other => {
                    return Err(ApiError::bad_request(format!(
                        "field label not supported: {other}"
                    )));
                }
            };
            reqs.push((field, negate, value.trim().to_string()));
        }
        Ok(Self(reqs))
    }

    /// Whether the selector pins one object's name (`metadata.name=<name>`): a LIST of one
    /// object (kube-persist's delta relist fetches a changed body so).
    pub(crate) fn names_one(&self) -> bool {
        self.0
            .iter()
            .any(|(field, negate, _)| *field == Field::Name && !*negate)
    }

    /// True if the selector selects everything.
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The field this selector tests that not every kind has (`spec.nodeName`, Pods'
    /// only), if any: kube-apiserver refuses it on other kinds (`field label not
    /// supported`).
    pub(crate) fn kind_specific(&self) -> Option<&'static str> {
        self.uses_node_name().then_some("spec.nodeName")
    }

    /// Whether it tests a Pod's `spec.nodeName`.
    pub(crate) fn uses_node_name(&self) -> bool {
        self.0.iter().any(|(field, ..)| *field == Field::NodeName)
    }

    /// Whether an object with this namespace (`""` if cluster-scoped) and name matches
    /// (a selector on `spec.nodeName` sees `""`).
    pub(crate) fn matches(&self, namespace: &str, name: &str) -> bool {
        self.matches_on(namespace, name, "")
    }

    /// Whether an object with this namespace, name and `spec.nodeName` (`""` if it has
    /// none) matches.
    pub(crate) fn matches_on(&self, namespace: &str, name: &str, node_name: &str) -> bool {
        self.0.iter().all(|(field, negate, value)| {
            let actual = match field {
                Field::Name => name,
                Field::Namespace => namespace,
                Field::NodeName => node_name,
            };
            (actual == value) != *negate
        })
    }
}

/// Splits a field selector into terms at the commas that are not escaped.
fn split_unescaped(s: &str) -> Vec<&str> {
    let (mut terms, mut start, mut escaped) = (Vec::new(), 0, false);
    for (i, c) in s.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            ',' => {
                terms.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    terms.push(&s[start..]);
    terms
}

/// A term's field, raw value and whether it negates, split at its first unescaped
/// operator (`!=`, `==`, `=`).
fn split_operator(term: &str) -> Option<(&str, &str, bool)> {
    let bytes = term.as_bytes();
    let mut escaped = false;
    for (i, &b) in bytes.iter().enumerate() {
        if escaped {
            escaped = false;
            continue;
        }
        match b {
            b'\\' => escaped = true,
            b'!' if bytes.get(i + 1) == Some(&b'=') => {
                return Some((&term[..i], &term[i + 2..], true));
            }
            b'=' if bytes.get(i + 1) == Some(&b'=') => {
                return Some((&term[..i], &term[i + 2..], false));
            }
            b'=' => return Some((&term[..i], &term[i + 1..], false)),
            _ => {}
        }
    }
    None
}

/// apimachinery's `fields.UnescapeValue`: `\\`, `\,` and `\=` are the only escapes; an
/// unescaped `,` or `=` is refused.
fn unescape_value(raw: &str) -> Result<String, String> {
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some(e @ ('\\' | ',' | '=')) => out.push(e),
                Some(e) => return Err(format!("invalid escape sequence \\{e}")),
                None => return Err("a trailing backslash".into()),
            },
            ',' | '=' => return Err(format!("unescaped {c:?}")),
            c => out.push(c),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn label_operators() {
        let l = labels(&[("app", "web"), ("tier", "front")]);
        let ok = |s: &str| LabelSelector::parse(s).unwrap().matches(&l);
        assert!(ok(""));
        assert!(ok("app=web"));
        assert!(ok("app==web,tier"));
        assert!(!ok("app!=web"));
        assert!(ok("app in (web, db)"));
        assert!(!ok("app notin (web,db)"));
        assert!(ok("env notin (prod)"));
        assert!(ok("!env"));
        assert!(!ok("!app"));
        assert!(ok("app in (web),tier in (front)"));
        assert!(!ok("app=web,missing"));
    }

    #[test]
    fn label_errors() {
        for bad in [
            "app in (a",
            "=x",
            "a b c",
            "app in x)",
            ",",
            "a=b=c",
            "k in (v)x",
        ] {
            assert!(LabelSelector::parse(bad).is_err(), "{bad} should fail");
        }
    }

    #[test]
    fn field_selector() {
        let f = FieldSelector::parse("metadata.name=a,metadata.namespace!=kube-system").unwrap();
        assert!(f.matches("default", "a"));
        assert!(!f.matches("kube-system", "a"));
        assert!(!f.matches("default", "b"));
        let node = FieldSelector::parse("spec.nodeName=x,metadata.name=a").unwrap();
        assert!(node.matches_on("default", "a", "x"));
        assert!(!node.matches_on("default", "a", "y"));
        assert!(!node.matches("default", "a"), "not scheduled: \"\"");
        assert_eq!(node.kind_specific(), Some("spec.nodeName"));
        assert_eq!(f.kind_specific(), None);
        assert!(FieldSelector::parse("spec.host=x").is_err());
        assert!(FieldSelector::parse("metadata.name").is_err());
    }

    #[test]
    fn field_selector_values_unescape() {
        let f = FieldSelector::parse(r"metadata.name=a\,b\=c\\d,metadata.namespace=ns").unwrap();
        assert!(f.matches("ns", r"a,b=c\d"));
        assert!(f.names_one());
        assert!(
            !FieldSelector::parse("metadata.name!=x")
                .unwrap()
                .names_one()
        );
        let f = FieldSelector::parse("metadata.name=a?b #é").unwrap();
        assert!(f.matches("", "a?b #é"));
        assert!(FieldSelector::parse(r"metadata.name=a\x").is_err());
        assert!(FieldSelector::parse("metadata.name=a=b").is_err());
    }
}

/// One `shardRange(field, 'start', 'end')` term of a `shardSelector`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ShardRange {
    /// Hash the namespace (else the uid).
    namespace: bool,
    start: u64,
    /// Exclusive; may be 2^64.
    end: u128,
}

/// A parsed `shardSelector` (KEP-5866, kube-apiserver 1.36 with `ShardedListAndWatch`):
/// `shardRange(object.metadata.uid|namespace, '0x<16 hex>', '0x<16 or 17 hex>')` terms
/// joined with `||`; an object matches when the 64-bit FNV-1a hash of the field is in any
/// `[start, end)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ShardSelector {
    /// The selector as sent (echoed in `metadata.shardInfo.selector`).
    pub text: String,
    ranges: Vec<ShardRange>,
}

/// 64-bit FNV-1a, written here independently of kube-persist's: the server side of the
/// hash is the oracle the store's own filtering is tested against.
fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// A `'0x…'` bound: `0x` and 16 hex digits (17 for the end of the space, 2^64).
fn shard_bound(s: &str, end: bool) -> Result<u128, String> {
    let inner = s
        .trim()
        .strip_prefix('\'')
        .and_then(|s| s.strip_suffix('\''))
        .ok_or_else(|| format!("bound {s:?} is not a single-quoted string"))?;
    let hex = inner
        .strip_prefix("0x")
        .ok_or_else(|| format!("bound {inner:?} does not start with 0x"))?;
    let ok_len = hex.len() == 16 || (end && hex == "10000000000000000");
    if !ok_len || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(format!(
            "bound {inner:?} must be 0x followed by 16 hex digits"
        ));
    }
    u128::from_str_radix(hex, 16).map_err(|e| format!("bound {inner:?}: {e}"))
}

impl ShardSelector {
    /// Parse a `shardSelector`; the error text follows kube-apiserver's
    /// `invalid shard selector: ...` (answered with HTTP 500).
    pub(crate) fn parse(s: &str) -> Result<Self, ApiError> {
        let invalid = |why: String| {
            ApiError::new(
                500,
                "InternalError",
                format!("invalid shard selector: {why}"),
            )
        };
        let mut ranges = Vec::new();
        for term in s.split("||") {
            let term = term.trim();
            let args = term
                .strip_prefix("shardRange(")
                .and_then(|t| t.strip_suffix(')'))
                .ok_or_else(|| {
                    invalid(format!("{term:?} is not shardRange(field, 'start', 'end')"))
                })?;
            let parts: Vec<&str> = args.split(',').collect();
            let [field, start, end] = parts.as_slice() else {
                return Err(invalid(format!("shardRange takes 3 arguments: {term:?}")));
            };
            let namespace = match field.trim() {
                "object.metadata.uid" => false,
                "object.metadata.namespace" => true,
                other => {
                    return Err(invalid(format!(
                        "unsupported field {other:?} (object.metadata.uid or object.metadata.namespace)"
                    )));
                }
            };
            let start = shard_bound(start, false).map_err(invalid)?;
            let end = shard_bound(end, true).map_err(invalid)?;
            if start >= end {
                return Err(invalid(format!("empty range {term:?}")));
            }
            ranges.push(ShardRange {
                namespace,
                start: start as u64,
                end,
            });
        }
        Ok(ShardSelector {
            text: s.to_string(),
            ranges,
        })
    }

    /// Whether an object with this uid and namespace is in the shard.
    pub(crate) fn matches(&self, uid: &str, namespace: &str) -> bool {
        self.ranges.iter().any(|r| {
            let h = u128::from(fnv1a64(
                if r.namespace { namespace } else { uid }.as_bytes(),
            ));
            u128::from(r.start) <= h && h < r.end
        })
    }
}

#[cfg(test)]
mod shard_tests {
    use super::*;

    #[test]
    fn parses_ranges_and_refuses_what_kube_apiserver_refuses() {
        let s = ShardSelector::parse(
            "shardRange(object.metadata.uid, '0x0000000000000000', '0x8000000000000000') || \
             shardRange(object.metadata.namespace, '0x8000000000000000', '0x10000000000000000')",
        )
        .unwrap();
        assert_eq!(s.ranges.len(), 2);
        // fnv1a64("a") = 0xaf63dc4c8601ec8c: above half, so matched by namespace "a" only.
        assert!(s.matches("a", "a"));
        assert!(
            !ShardSelector::parse(
                "shardRange(object.metadata.uid, '0x0000000000000000', '0x8000000000000000')"
            )
            .unwrap()
            .matches("a", "x")
        );
        for bad in [
            "shardRange(object.metadata.name, '0x0000000000000000', '0x8000000000000000')",
            "shardRange(object.metadata.uid, '0x00', '0x8000000000000000')",
            "shardRange(object.metadata.uid, 0x0000000000000000, '0x8000000000000000')",
            "shardRange(object.metadata.uid, '0x8000000000000000', '0x0000000000000000')",
            "shardRange(object.metadata.uid, '0x0000000000000000'",
            "",
        ] {
            let e = ShardSelector::parse(bad).unwrap_err();
            assert_eq!(e.code, 500, "{bad}");
            assert!(
                e.message.starts_with("invalid shard selector: "),
                "{}",
                e.message
            );
        }
    }
}
