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

/// Which metadata field a field-selector requirement tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Name,
    Namespace,
}

/// A parsed `fieldSelector` (supports `metadata.name` and `metadata.namespace`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct FieldSelector(Vec<(Field, bool, String)>);

impl FieldSelector {
    /// Parses a selector; an empty string selects everything.
    pub(crate) fn parse(s: &str) -> Result<Self, ApiError> {
        if s.trim().is_empty() {
            return Ok(Self::default());
        }
        let mut reqs = Vec::new();
        for term in s.split(',') {
            let term = term.trim();
            let (field, value, negate) = if let Some((f, v)) = term.split_once("!=") {
                (f, v, true)
            } else if let Some((f, v)) = term.split_once("==") {
                (f, v, false)
            } else if let Some((f, v)) = term.split_once('=') {
                (f, v, false)
            } else {
                return Err(ApiError::bad_request(format!(
                    "invalid selector: '{s}'; can't understand '{term}'"
                )));
            };
            let field = match field.trim() {
                "metadata.name" => Field::Name,
                "metadata.namespace" => Field::Namespace,
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

    /// True if the selector selects everything.
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether an object with this namespace (`""` if cluster-scoped) and name matches.
    pub(crate) fn matches(&self, namespace: &str, name: &str) -> bool {
        self.0.iter().all(|(field, negate, value)| {
            let actual = match field {
                Field::Name => name,
                Field::Namespace => namespace,
            };
            (actual == value) != *negate
        })
    }
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
        assert!(FieldSelector::parse("spec.nodeName=x").is_err());
        assert!(FieldSelector::parse("metadata.name").is_err());
    }
}
