//! An object's JSON as a decode that only validates it needs it: the same bytes with the
//! value of each `metadata.managedFields[*].fieldsV1` replaced by `{}`.
//!
//! The managed fields kube-apiserver keeps are about half of a typical object's bytes (3.7 KB
//! of a 7.5 KB Pod with two containers) and the costliest part of decoding it: `FieldsV1`
//! holds a `serde_json::Value`, a map per field path (222 maps, each key a `String`, in
//! that Pod). Its content is opaque JSON to `ObjectMeta`: any valid value decodes, so a
//! decode that only checks the object and reads its metadata gets the same answer from
//! `{}`, without building and freeing the trees.
//!
//! The scan is given valid JSON (serde_json has read the object as a `RawValue`), follows
//! the exact path (the top-level `metadata`, its `managedFields` array, each entry's
//! `fieldsV1`, keys compared as written), stops after the first `metadata`, and leaves the
//! bytes as they are wherever it meets anything it does not expect. Never a panic: any
//! input gives a copy that is the input, or the input with some of those values replaced.

/// Copy `json` into `out` (cleared first), each `metadata.managedFields[*].fieldsV1` value
/// replaced by `{}`. Returns how many values were replaced.
pub(crate) fn without_fields_v1(json: &[u8], out: &mut Vec<u8>) -> usize {
    out.clear();
    let mut spans = Vec::new();
    let mut scan = Scan { b: json, at: 0 };
    if scan.object(&mut spans).is_none() {
        spans.clear();
    }
    let mut last = 0;
    for &(start, end) in &spans {
        out.extend_from_slice(&json[last..start]);
        out.extend_from_slice(b"{}");
        last = end;
    }
    out.extend_from_slice(&json[last..]);
    spans.len()
}

/// A cursor over JSON bytes. Every method returns `None` at anything it does not expect.
struct Scan<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Scan<'a> {
    /// The next byte that is not whitespace (the cursor moved onto it).
    fn peek(&mut self) -> Option<u8> {
        while let Some(&c) = self.b.get(self.at) {
            if !matches!(c, b' ' | b'\n' | b'\r' | b'\t') {
                return Some(c);
            }
            self.at += 1;
        }
        None
    }

    fn expect(&mut self, c: u8) -> Option<()> {
        (self.peek()? == c).then(|| self.at += 1)
    }

    /// A string at the cursor: its content as written (escapes kept), the cursor past it.
    fn string(&mut self) -> Option<&'a [u8]> {
        self.expect(b'"')?;
        let start = self.at;
        loop {
            self.at += memchr::memchr2(b'"', b'\\', self.b.get(self.at..)?)?;
            match self.b[self.at] {
                b'"' => break,
                _ => self.at += 2,
            }
        }
        let b = self.b;
        let s = b.get(start..self.at)?;
        self.at += 1;
        Some(s)
    }

    /// Skip one value; its span.
    fn value(&mut self) -> Option<(usize, usize)> {
        let start = match self.peek()? {
            b'"' => {
                let start = self.at;
                self.string()?;
                return Some((start, self.at));
            }
            b'{' | b'[' => self.at,
            _ => {
                let start = self.at;
                while self.b.get(self.at).is_some_and(|c| {
                    !matches!(c, b',' | b'}' | b']' | b' ' | b'\n' | b'\r' | b'\t')
                }) {
                    self.at += 1;
                }
                return (self.at > start).then_some((start, self.at));
            }
        };
        let mut depth = 0usize;
        loop {
            match *self.b.get(self.at)? {
                b'"' => {
                    self.string()?;
                    continue;
                }
                b'{' | b'[' => depth += 1,
                b'}' | b']' => {
                    depth -= 1;
                    if depth == 0 {
                        self.at += 1;
                        return Some((start, self.at));
                    }
                }
                _ => {}
            }
            self.at += 1;
        }
    }

    /// The members of the object at the cursor, each given to `member` with the cursor on
    /// its value (which `member` must move past); `Some(true)` from `member` stops early.
    fn members(&mut self, mut member: impl FnMut(&mut Self, &[u8]) -> Option<bool>) -> Option<()> {
        if self.open(b'{', b'}')? {
            return Some(());
        }
        loop {
            // The key's bytes as written, without its quotes.
            let key = self.string()?;
            self.expect(b':')?;
            if member(self, key)? || self.next(b'}')? {
                return Some(());
            }
        }
    }

    /// Past the opening `open` of an object or array: whether `close` follows at once.
    fn open(&mut self, open: u8, close: u8) -> Option<bool> {
        self.expect(open)?;
        Some(self.peek()? == close && self.expect(close).is_some())
    }

    /// Past what follows a member or element: a `,` (false: more follow) or `close` (true).
    fn next(&mut self, close: u8) -> Option<bool> {
        match self.peek()? {
            b',' => {
                self.at += 1;
                Some(false)
            }
            c if c == close => {
                self.at += 1;
                Some(true)
            }
            _ => None,
        }
    }

    /// The top-level object: its first `metadata` member, then stop.
    fn object(&mut self, spans: &mut Vec<(usize, usize)>) -> Option<()> {
        self.members(|s, key| {
            if key == b"metadata" && s.peek()? == b'{' {
                s.metadata(spans)?;
                return Some(true);
            }
            s.value().map(|_| false)
        })
    }

    fn metadata(&mut self, spans: &mut Vec<(usize, usize)>) -> Option<()> {
        self.members(|s, key| {
            if key == b"managedFields" && s.peek()? == b'[' {
                s.entries(spans)?;
            } else {
                s.value()?;
            }
            Some(false)
        })
    }

    /// The `managedFields` array: each entry's `fieldsV1` value.
    fn entries(&mut self, spans: &mut Vec<(usize, usize)>) -> Option<()> {
        if self.open(b'[', b']')? {
            return Some(());
        }
        loop {
            if self.peek()? == b'{' {
                self.members(|s, key| {
                    let span = s.value()?;
                    if key == b"fieldsV1" {
                        spans.push(span);
                    }
                    Some(false)
                })?;
            } else {
                self.value()?;
            }
            if self.next(b']')? {
                return Some(());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lean(json: &str) -> String {
        let mut out = Vec::new();
        without_fields_v1(json.as_bytes(), &mut out);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn each_managed_fields_entrys_fields_v1_is_replaced_and_nothing_else() {
        let pod = r#"{"kind":"Pod","metadata":{"name":"a","labels":{"fieldsV1":"x"},"managedFields":[{"manager":"m","fieldsV1":{"f:metadata":{"f:labels":{".":{},"f:a\"}":{}}}},"time":"t"},{"fieldsV1" : [1, {"}":"]"}] },{}],"uid":"u"},"spec":{"fieldsV1":{"a":1}}}"#;
        assert_eq!(
            lean(pod),
            r#"{"kind":"Pod","metadata":{"name":"a","labels":{"fieldsV1":"x"},"managedFields":[{"manager":"m","fieldsV1":{},"time":"t"},{"fieldsV1" : {} },{}],"uid":"u"},"spec":{"fieldsV1":{"a":1}}}"#
        );
        // Whitespace anywhere JSON allows it, and scalars of every kind.
        let spaced = "{ \"metadata\" :\n{ \"managedFields\" : [ { \"fieldsV1\" : null , \"n\" : -1.5e3 } ] } }";
        assert_eq!(
            lean(spaced),
            "{ \"metadata\" :\n{ \"managedFields\" : [ { \"fieldsV1\" : {} , \"n\" : -1.5e3 } ] } }"
        );
    }

    #[test]
    fn only_the_exact_path_is_followed() {
        for json in [
            // Not under metadata, or not under managedFields, or not an entry's member.
            r#"{"spec":{"managedFields":[{"fieldsV1":{"a":{}}}]}}"#,
            r#"{"metadata":{"annotations":{"managedFields":"[{\"fieldsV1\":{}}]"}}}"#,
            r#"{"metadata":{"managedFields":[[{"fieldsV1":{"a":{}}}]]}}"#,
            r#"{"metadata":{"managedFields":{"fieldsV1":{"a":{}}}}}"#,
            // A key written with an escape is another key as bytes: left as is.
            r#"{"metad\u0061ta":{"managedFields":[{"fieldsV1":{"a":{}}}]}}"#,
            // Only the first metadata.
            r#"{"metadata":{},"metadata":{"managedFields":[{"fieldsV1":{"a":{}}}]}}"#,
            r#"[{"metadata":{"managedFields":[{"fieldsV1":{"a":{}}}]}}]"#,
            "",
        ] {
            assert_eq!(lean(json), json);
        }
    }

    /// Bytes that are not JSON, cut anywhere: a copy, never a panic, and a replacement only
    /// of a span the scan found whole.
    #[test]
    fn any_prefix_and_any_damage_gives_a_copy_without_a_panic() {
        let pod = r#"{"metadata":{"managedFields":[{"fieldsV1":{"f:a":{"\\":{}}}}],"name":"n"}}"#;
        let whole = lean(pod);
        assert_eq!(
            whole,
            r#"{"metadata":{"managedFields":[{"fieldsV1":{}}],"name":"n"}}"#
        );
        // The scan stops after the metadata: only a prefix that holds all of it is changed.
        let metadata_end = pod.len() - 1;
        for cut in 0..=pod.len() {
            let mut out = Vec::new();
            let n = without_fields_v1(&pod.as_bytes()[..cut], &mut out);
            if cut < metadata_end {
                assert_eq!(
                    (n, out.as_slice()),
                    (0, &pod.as_bytes()[..cut]),
                    "cut {cut}"
                );
            } else {
                assert_eq!(n, 1, "cut {cut}");
                assert!(whole.as_bytes().starts_with(&out), "cut {cut}");
            }
        }
        for at in 0..pod.len() {
            for b in [b'"', b'\\', b'{', b'}', b']', b',', 0xFF] {
                let mut damaged = pod.as_bytes().to_vec();
                damaged[at] = b;
                let mut out = Vec::new();
                without_fields_v1(&damaged, &mut out);
            }
        }
    }
}
