//! JSON decoding for the hot paths (validating incoming objects, reading stored ones):
//! simd-json with this thread's reused working buffers, and serde_json only to report (or,
//! should simd-json ever refuse valid JSON, to decode) what simd-json did not accept.
//! Both decode every Kubernetes type identically (a unit test in `store/reader/mod.rs` checks).

use std::cell::RefCell;

use serde::de::DeserializeOwned;

thread_local! {
    /// simd-json's working buffers (tape, strings, padded input), reused by every decode on
    /// this thread instead of allocated per object.
    static SIMD_BUFFERS: RefCell<simd_json::Buffers> =
        RefCell::new(simd_json::Buffers::new(16 << 10));
    /// A scratch copy of the input for [`decode_copy`] (simd-json rewrites its input).
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Decode `buf` with simd-json, which rewrites it in place. On an error, the caller decodes
/// the original bytes with serde_json for an error message users know.
pub(crate) fn decode_in_place<T: DeserializeOwned>(
    buf: &mut [u8],
) -> std::result::Result<T, simd_json::Error> {
    SIMD_BUFFERS.with(|b| simd_json::serde::from_slice_with_buffers::<T>(buf, &mut b.borrow_mut()))
}

/// Decode `json` into `T` without touching it: simd-json on a reused scratch copy, then
/// serde_json on the original when simd-json refuses (for its error message).
pub(crate) fn decode_copy<T: DeserializeOwned>(json: &[u8]) -> Result<T, serde_json::Error> {
    decode_scratch(json, |json, s| {
        s.clear();
        s.extend_from_slice(json);
    })
}

/// Decode `json` into `T` to check it and read its metadata, not to keep it: as
/// [`decode_copy`], from a copy whose `metadata.managedFields[*].fieldsV1` values are `{}`
/// (see [`lean`](super::lean)), which `ObjectMeta` accepts exactly when it accepts the
/// original. Its managed fields are then empty maps.
pub(crate) fn decode_lean<T: DeserializeOwned>(json: &[u8]) -> Result<T, serde_json::Error> {
    decode_scratch(json, |json, s| {
        super::lean::without_fields_v1(json, s);
    })
}

/// Decode what `fill` copies of `json` into the thread's scratch buffer, with serde_json
/// on `json` itself when simd-json refuses the copy.
fn decode_scratch<T: DeserializeOwned>(
    json: &[u8],
    fill: impl FnOnce(&[u8], &mut Vec<u8>),
) -> Result<T, serde_json::Error> {
    let fast = SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        fill(json, &mut s);
        let t = decode_in_place::<T>(&mut s);
        // Do not keep a rare huge object's buffer alive for the thread's lifetime.
        if s.capacity() > 1 << 20 {
            *s = Vec::new();
        }
        t
    });
    match fast {
        Ok(t) => Ok(t),
        Err(simd) => {
            let t = serde_json::from_slice::<T>(json)?;
            // Its position only: simd-json's messages can quote the input.
            tracing::debug!(
                at = simd.index(),
                "simd-json refused JSON that serde_json accepts"
            );
            Ok(t)
        }
    }
}

/// A JSON error as logs and error messages may show it: what went wrong and where (line
/// and column), the fields and types the schema expects, never the input's content.
/// serde_json quotes what it refused (`invalid type: string "hunter2", expected u32`,
/// `unknown variant `x``, a custom message of a type's `Deserialize`), which for an object
/// of the cluster is its data.
pub(crate) fn describe(e: &serde_json::Error) -> String {
    use serde_json::error::Category;
    let msg = e.to_string();
    // serde_json appends the position itself; it is given once, below.
    let msg = match msg.rfind(" at line ") {
        Some(at) => &msg[..at],
        None => msg.as_str(),
    };
    let what = match e.classify() {
        // Syntax errors name the token expected, never the input.
        Category::Syntax | Category::Eof | Category::Io => msg.to_string(),
        Category::Data => {
            // A field of the schema (`missing field `spec``) names no content.
            if msg.starts_with("missing field `") || msg.starts_with("duplicate field `") {
                msg.to_string()
            } else {
                // `invalid type: string "…", expected …`: the kind of error, and what the
                // schema expects (the last ", expected", after any quoted content).
                let kind = msg.split([':', '`', '"']).next().unwrap_or("").trim();
                let kind = if kind.is_empty() || kind.len() > 40 {
                    "invalid data"
                } else {
                    kind
                };
                match msg.rfind(", expected ") {
                    Some(at) if !msg[at..].contains('"') => format!("{kind}{}", &msg[at..]),
                    _ => kind.to_string(),
                }
            }
        }
    };
    if e.line() == 0 {
        what
    } else {
        format!("{what} at line {} column {}", e.line(), e.column())
    }
}

/// A text of the cluster (an object, a line) named without its content: its length.
pub(crate) fn unnamed(text: &str) -> String {
    format!("an unnamed object of {} bytes", text.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 60 item 7: errors of objects never carry their content.
    #[test]
    fn json_errors_are_described_without_content() {
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct S {
            n: u32,
            e: Option<E>,
        }
        #[derive(Debug, serde::Deserialize)]
        enum E {
            A,
        }
        let secret = "hunter2-value";
        for (json, want) in [
            (r#"{"n": "hunter2-value"}"#, "invalid type, expected u32"),
            (
                r#"{"n": 1, "e": "hunter2-value"}"#,
                "unknown variant, expected `A`",
            ),
            (r#"{"e": null}"#, "missing field `n`"),
            (r#"{"n": 1, "hunter2-value"#, "EOF while parsing a string"),
        ] {
            let e = serde_json::from_str::<S>(json).unwrap_err();
            // serde_json's own message quotes the value where there is one.
            if want.starts_with("invalid type") || want.starts_with("unknown variant") {
                assert!(e.to_string().contains(secret), "{e}");
            }
            let described = describe(&e);
            assert!(!described.contains(secret), "{described}");
            let (what, at) = described.split_once(" at line 1 column ").unwrap();
            assert_eq!(what, want, "{json}");
            assert!(at.parse::<usize>().is_ok(), "{described}");
        }
        assert_eq!(
            unnamed(r#"{"data":"hunter2"}"#),
            "an unnamed object of 18 bytes"
        );
    }
}
