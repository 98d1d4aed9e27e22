//! The head of a LIST body: its `metadata` read from the first bytes, before the items
//! arrive, so that the next page's request can be sent while this page is still being
//! read, parsed and written.
//!
//! kube-apiserver writes a list as `{"kind":…,"apiVersion":…,"metadata":{…},"items":[…]}`:
//! the continue token is in the first few hundred bytes of a body of megabytes. The scan
//! walks the top-level object's members in order and stops at `metadata`; a body whose
//! `items` come first (another server's order) has no usable head, and its page is then
//! only read ahead of once it is parsed, as before.

use serde::de::IgnoredAny;

use super::raw::ListMeta;

/// What the first bytes of a LIST body say.
pub(crate) enum Head {
    /// Not enough bytes yet.
    More,
    /// The list's metadata, complete.
    Meta(ListMeta),
    /// The items (or the end of the object, or bytes that are not a list) come before any
    /// metadata: wait for the whole body.
    Unknown,
}

/// The list's metadata from a prefix of its body, if the prefix holds it.
pub(crate) fn head(prefix: &[u8]) -> Head {
    let mut at = skip_ws(prefix, 0);
    match prefix.get(at) {
        None => return Head::More,
        Some(b'{') => at += 1,
        Some(_) => return Head::Unknown,
    }
    loop {
        at = skip_ws(prefix, at);
        match prefix.get(at) {
            None => return Head::More,
            Some(b'"') => {}
            Some(_) => return Head::Unknown,
        }
        let key = match value::<String>(prefix, at) {
            Value::Got(key, end) => {
                at = end;
                key
            }
            Value::More => return Head::More,
            Value::Bad => return Head::Unknown,
        };
        at = skip_ws(prefix, at);
        match prefix.get(at) {
            None => return Head::More,
            Some(b':') => at += 1,
            Some(_) => return Head::Unknown,
        }
        match key.as_str() {
            "metadata" => {
                return match value::<ListMeta>(prefix, at) {
                    Value::Got(meta, _) => Head::Meta(meta),
                    Value::More => Head::More,
                    Value::Bad => Head::Unknown,
                };
            }
            "items" => return Head::Unknown,
            _ => match value::<IgnoredAny>(prefix, at) {
                Value::Got(_, end) => at = end,
                Value::More => return Head::More,
                Value::Bad => return Head::Unknown,
            },
        }
        at = skip_ws(prefix, at);
        match prefix.get(at) {
            None => return Head::More,
            Some(b',') => at += 1,
            Some(_) => return Head::Unknown,
        }
    }
}

enum Value<T> {
    /// The value and the offset just past it.
    Got(T, usize),
    More,
    Bad,
}

/// One JSON value at `at`.
fn value<T: serde::de::DeserializeOwned>(bytes: &[u8], at: usize) -> Value<T> {
    let mut values = serde_json::Deserializer::from_slice(&bytes[at..]).into_iter::<T>();
    match values.next() {
        Some(Ok(v)) => {
            let end = at + values.byte_offset();
            // A number or literal cut by the prefix's end parses as a shorter one: only a
            // value followed by something is known to be whole.
            if end >= bytes.len() {
                Value::More
            } else {
                Value::Got(v, end)
            }
        }
        Some(Err(e)) if e.is_eof() => Value::More,
        None => Value::More,
        Some(Err(_)) => Value::Bad,
    }
}

fn skip_ws(bytes: &[u8], mut at: usize) -> usize {
    while bytes
        .get(at)
        .is_some_and(|b| matches!(b, b' ' | b'\n' | b'\r' | b'\t'))
    {
        at += 1;
    }
    at
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = r#"{"kind":"PodList","apiVersion":"v1","metadata":{"resourceVersion":"42","continue":"eyJ2IjoibWV0YS5rOHMuaW8vdjEifQ","remainingItemCount":7},"items":[{"metadata":{"name":"a"}}]}"#;

    fn token(h: Head) -> Option<String> {
        match h {
            Head::Meta(m) => m.continue_token,
            _ => panic!("no metadata"),
        }
    }

    /// Every prefix that ends inside or before the metadata asks for more; every prefix
    /// that holds it gives the same token, whatever follows.
    #[test]
    fn the_metadata_is_read_from_any_prefix_that_holds_it() {
        let end = PAGE.find(r#","items""#).unwrap();
        for cut in 0..PAGE.len() {
            match head(&PAGE.as_bytes()[..cut]) {
                Head::More => assert!(cut <= end, "cut {cut}: still asks for more"),
                Head::Meta(m) => {
                    assert!(cut > end - 1, "cut {cut}: the metadata is not complete yet");
                    assert_eq!(m.resource_version.as_deref(), Some("42"));
                    assert_eq!(
                        m.continue_token.as_deref(),
                        Some("eyJ2IjoibWV0YS5rOHMuaW8vdjEifQ")
                    );
                }
                Head::Unknown => panic!("cut {cut}: unknown"),
            }
        }
    }

    #[test]
    fn items_first_bodies_and_other_bytes_have_no_head() {
        let items_first = r#"{"items":[],"metadata":{"continue":"x"}}"#;
        assert!(matches!(head(items_first.as_bytes()), Head::Unknown));
        assert!(matches!(head(b"[1,2]"), Head::Unknown));
        assert!(matches!(head(b"{\"kind\" 1}"), Head::Unknown));
        assert!(matches!(head(b"{}"), Head::Unknown));
        assert!(matches!(head(b"  "), Head::More));
        // A last page: metadata without a token.
        let last = r#"{ "kind" : "PodList" , "metadata" : {"resourceVersion":"9"} , "items":[]}"#;
        assert_eq!(token(head(last.as_bytes())), None);
        // Unknown members before the metadata are skipped, numbers too.
        let odd = r#"{"n":12345,"x":{"y":[1,"]"]},"metadata":{"continue":"t"},"items":[]}"#;
        assert_eq!(token(head(odd.as_bytes())).as_deref(), Some("t"));
        // A number cut by the prefix is not taken for a shorter one.
        assert!(matches!(head(br#"{"n":123"#), Head::More));
    }
}
