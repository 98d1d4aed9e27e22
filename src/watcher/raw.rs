//! The write path's view of server responses: raw JSON, never a decoded page.
//!
//! A LIST page is parsed into borrowed `RawValue` slices of one response buffer; each item
//! is reduced to the few fields the store needs and its JSON bytes. Decoding into `K`
//! (optional validation) happens one object at a time.

use serde::Deserialize;
use serde_json::value::RawValue;

use super::config::Config;
use super::index::Inspector;
use crate::store::object_suffix;
use crate::store::writer::Incoming;

#[derive(Deserialize)]
pub(crate) struct ListPage<'a> {
    #[serde(default)]
    pub(crate) metadata: ListMeta,
    #[serde(borrow, default)]
    pub(crate) items: Option<Vec<&'a RawValue>>,
}

#[derive(Deserialize, Default)]
pub(crate) struct ListMeta {
    #[serde(rename = "resourceVersion", default)]
    pub(crate) resource_version: Option<String>,
    #[serde(rename = "continue", default)]
    pub(crate) continue_token: Option<String>,
}

#[derive(Deserialize)]
pub(crate) struct WatchLine<'a> {
    #[serde(rename = "type")]
    pub(crate) kind: String,
    #[serde(borrow)]
    pub(crate) object: &'a RawValue,
}

#[derive(Deserialize)]
struct Head {
    metadata: HeadMeta,
}

#[derive(Deserialize)]
struct HeadMeta {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    #[serde(rename = "resourceVersion")]
    resource_version: Option<String>,
    #[serde(default)]
    annotations: Option<std::collections::BTreeMap<String, String>>,
}

/// The parts of an `ERROR` watch event's `Status`.
#[derive(Deserialize, Debug, Default)]
pub(crate) struct StatusBody {
    #[serde(default)]
    pub(crate) code: u16,
    #[serde(default)]
    pub(crate) reason: String,
    #[serde(default)]
    pub(crate) message: String,
}

/// A bookmark's resourceVersion and whether it ends a streaming list's initial events.
pub(crate) fn bookmark(object: &RawValue) -> Option<(String, bool)> {
    let head: Head = serde_json::from_str(object.get()).ok()?;
    let end = head
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("k8s.io/initial-events-end"))
        .is_some_and(|v| v == "true");
    Some((head.metadata.resource_version?, end))
}

/// Why an object from the server was not stored.
#[derive(Debug)]
pub(crate) struct BadObject {
    /// Best-effort `namespace/name` or a prefix of the JSON.
    pub(crate) what: String,
    pub(crate) why: String,
}

/// Reduce one object to what the store needs, applying the transform and validation.
pub(crate) fn incoming(
    raw: &RawValue,
    cfg: &Config,
    inspect: Option<&Inspector>,
) -> Result<Incoming, BadObject> {
    let json = raw.get();
    let bad = |why: String, what: Option<String>| BadObject {
        what: what.unwrap_or_else(|| snippet(json)),
        why,
    };
    if json.len() > cfg.max_object_bytes {
        return Err(bad(
            format!(
                "{} bytes exceeds max_object_bytes {}",
                json.len(),
                cfg.max_object_bytes
            ),
            None,
        ));
    }
    let head: Head = serde_json::from_str(json)
        .map_err(|e| bad(format!("metadata does not decode: {e}"), None))?;
    let m = head.metadata;
    let name = match m.name {
        Some(n) if !n.is_empty() && !n.contains('\0') => n,
        _ => return Err(bad("missing or invalid metadata.name".into(), None)),
    };
    let what = match &m.namespace {
        Some(ns) => format!("{ns}/{name}"),
        None => name.clone(),
    };
    if m.namespace.as_deref().is_some_and(|ns| ns.contains('\0')) {
        return Err(bad("invalid metadata.namespace".into(), Some(what)));
    }
    let Some(resource_version) = m.resource_version.filter(|rv| !rv.is_empty()) else {
        return Err(bad("missing metadata.resourceVersion".into(), Some(what)));
    };
    let body = match &cfg.transform {
        Some((_, f)) => {
            let mut v: serde_json::Value = serde_json::from_str(json)
                .map_err(|e| bad(format!("invalid JSON: {e}"), Some(what.clone())))?;
            f(&mut v);
            serde_json::to_vec(&v)
                .map_err(|e| bad(format!("transform output: {e}"), Some(what.clone())))?
        }
        None => json.as_bytes().to_vec(),
    };
    let index = match inspect {
        Some(check) => check(&body).map_err(|e| {
            bad(
                format!("does not decode into the store's type: {e}"),
                Some(what.clone()),
            )
        })?,
        None => Vec::new(),
    };
    Ok(Incoming {
        suffix: object_suffix(m.namespace.as_deref(), &name),
        uid: m.uid.unwrap_or_default(),
        resource_version,
        body,
        index,
    })
}

/// The key suffix of a deleted object (only name and namespace are needed).
pub(crate) fn deleted_suffix(raw: &RawValue) -> Result<Vec<u8>, BadObject> {
    let json = raw.get();
    let head: Head = serde_json::from_str(json).map_err(|e| BadObject {
        what: snippet(json),
        why: format!("metadata does not decode: {e}"),
    })?;
    match head.metadata.name {
        Some(n) if !n.is_empty() => Ok(object_suffix(head.metadata.namespace.as_deref(), &n)),
        _ => Err(BadObject {
            what: snippet(json),
            why: "missing metadata.name".into(),
        }),
    }
}

/// The first bytes of a JSON text, for log lines about objects without a usable name.
pub(crate) fn snippet(json: &str) -> String {
    let mut end = json.len().min(120);
    while !json.is_char_boundary(end) {
        end -= 1;
    }
    json[..end].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(s: &str) -> Box<RawValue> {
        RawValue::from_string(s.to_string()).unwrap()
    }

    #[test]
    fn reduces_objects_and_rejects_bad_ones() {
        let cfg = Config::default();
        let ok = incoming(
            &raw(r#"{"metadata":{"name":"a","namespace":"n","uid":"u","resourceVersion":"7"}}"#),
            &cfg,
            None,
        )
        .unwrap();
        assert_eq!(ok.resource_version, "7");
        assert_eq!(ok.suffix, object_suffix(Some("n"), "a"));
        let err = incoming(
            &raw(r#"{"metadata":{"name":5,"resourceVersion":"7"}}"#),
            &cfg,
            None,
        )
        .unwrap_err();
        assert!(err.why.contains("metadata"), "{err:?}");
        let err = incoming(&raw(r#"{"metadata":{"name":"a"}}"#), &cfg, None).unwrap_err();
        assert_eq!(err.what, "a");
    }

    #[test]
    fn bookmarks_carry_the_initial_events_end() {
        let b = raw(
            r#"{"metadata":{"resourceVersion":"9","annotations":{"k8s.io/initial-events-end":"true"}}}"#,
        );
        assert_eq!(bookmark(&b), Some(("9".to_string(), true)));
    }
}
