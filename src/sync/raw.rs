//! The write path's view of server responses: raw JSON, never a decoded page.
//!
//! A LIST page is parsed into borrowed `RawValue` slices of one response buffer; each item
//! is reduced to the few fields the store needs and its JSON bytes. Decoding into `K`
//! (optional validation) happens one object at a time.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use serde::Deserialize;
use serde_json::value::RawValue;

use super::config::StreamConfig;
use super::indexers::{Decode, Inspector};
use crate::disk::keys::object_suffix;
use crate::model::{describe, unnamed};
use crate::store::Incoming;

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
    /// Set by a server that filtered the list by `shardSelector` (the selector, echoed).
    #[serde(rename = "shardInfo", default)]
    pub(crate) shard_info: Option<ShardInfo>,
}

/// `ListMeta.shardInfo`.
#[derive(Deserialize, Default)]
pub(crate) struct ShardInfo {
    #[serde(default)]
    pub(crate) selector: Option<String>,
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
    #[serde(default)]
    pub(crate) details: Option<StatusDetails>,
}

/// `Status.details`, for its causes.
#[derive(Deserialize, Debug, Default)]
pub(crate) struct StatusDetails {
    #[serde(default)]
    pub(crate) causes: Vec<StatusCause>,
}

/// One `Status.details.causes` entry.
#[derive(Deserialize, Debug, Default)]
pub(crate) struct StatusCause {
    #[serde(default)]
    pub(crate) reason: String,
}

impl StatusBody {
    /// 504 with cause `ResourceVersionTooLarge`, as kube-apiserver's watch cache sends it
    /// in an `ERROR` event when the requested resourceVersion is newer than it has seen.
    pub(crate) fn is_too_large(&self) -> bool {
        let causes = self.details.iter().flat_map(|d| &d.causes);
        too_large(self.code, &self.message, causes.map(|c| c.reason.as_str()))
    }

    /// What this status (of an `ERROR` event) asks of the watcher.
    pub(crate) fn kind(&self) -> StatusKind {
        StatusKind::of(self.code, self.is_too_large())
    }
}

/// What an API server's `Status` asks of a list or watch, whether it came as a failed
/// request or as an `ERROR` event: the one classification of statuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StatusKind {
    /// 410 Gone: the resourceVersion (or continue token) is compacted; list again.
    Gone,
    /// The resourceVersion is newer than the server has seen ([`too_large`]): wait for it.
    TooLarge,
    /// 400 or 422: the request itself is refused (a selector, a parameter).
    Invalid,
    /// 401, 403, 405, 406 or 415: the client may not make this request (a verb its
    /// credentials are not granted), or the server does not serve it in this method or
    /// representation. Retrying the same request cannot help.
    Refused,
    /// Anything else: retried with backoff.
    Other,
}

impl StatusKind {
    /// The kind of a status with `code`; `too_large`: it says so ([`too_large`]).
    pub(crate) fn of(code: u16, too_large: bool) -> StatusKind {
        match (code, too_large) {
            (410, _) => StatusKind::Gone,
            (_, true) => StatusKind::TooLarge,
            (400 | 422, _) => StatusKind::Invalid,
            (401 | 403 | 405 | 406 | 415, _) => StatusKind::Refused,
            _ => StatusKind::Other,
        }
    }
}

/// The one "resourceVersion too large" rule, for a `Status` however it was decoded: cause
/// `ResourceVersionTooLarge`, or kube-apiserver's 504 "Too large resource version" message
/// (`NewTooLargeResourceVersionError`).
pub(crate) fn too_large<'a>(
    code: u16,
    message: &str,
    mut causes: impl Iterator<Item = &'a str>,
) -> bool {
    causes.any(|reason| reason == "ResourceVersionTooLarge")
        || (code == 504 && message.contains("Too large resource version"))
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
    /// Its `namespace/name`, or its length when it has none: never its content.
    pub(crate) what: String,
    pub(crate) why: String,
    /// The object's key suffix, when its name (and namespace) could be read: the stored
    /// version of that object must then be removed, not kept as current.
    pub(crate) key: Option<Vec<u8>>,
    /// The rejected version, when it could be read.
    pub(crate) resource_version: Option<String>,
}

impl BadObject {
    /// A bad object that cannot be identified.
    pub(crate) fn anonymous(what: String, why: String) -> Self {
        BadObject {
            what,
            why,
            key: None,
            resource_version: None,
        }
    }
}

/// Reduce one object to what the store needs, applying the transform and validation.
/// `keep`: keep the validation decode (the object decoded from the body as stored) in
/// [`Incoming::decoded`]. Every decode is counted in `decodes`.
pub(crate) fn incoming(
    raw: &RawValue,
    cfg: &StreamConfig,
    inspect: Option<&Inspector>,
    keep: bool,
    decodes: &AtomicU64,
) -> Result<Incoming, BadObject> {
    let check = |f: &Inspector, body: &[u8]| {
        decodes.fetch_add(1, Relaxed);
        f(body, if keep { Decode::Keep } else { Decode::Check })
    };
    let json = raw.get();
    // Validating decodes the object into the stream's type anyway: that one decode also
    // gives the metadata, when the body is stored as received (no transform).
    let decoded = match inspect {
        Some(f) if !cfg.transforms() && json.len() <= cfg.max_object_bytes => {
            check(f, json.as_bytes()).ok()
        }
        _ => None,
    };
    let (m, entries, mut object) = match decoded {
        Some(d) => (
            HeadMeta {
                name: d.name,
                namespace: d.namespace,
                uid: d.uid,
                resource_version: d.resource_version,
                annotations: None,
            },
            Some(d.entries),
            d.object,
        ),
        None => {
            let head: Head = serde_json::from_str(json).map_err(|e| {
                BadObject::anonymous(
                    unnamed(json),
                    format!("metadata does not decode: {}", describe(&e)),
                )
            })?;
            (head.metadata, None, None)
        }
    };
    let named = Named::of(m.name, m.namespace.as_deref(), m.resource_version, json)?;
    if json.len() > cfg.max_object_bytes {
        return Err(named.bad(format!(
            "{} bytes exceeds max_object_bytes {}",
            json.len(),
            cfg.max_object_bytes
        )));
    }
    let Some(resource_version) = named.resource_version.clone() else {
        return Err(named.bad("missing metadata.resourceVersion".into()));
    };
    let body = transformed(json, cfg).map_err(|why| named.bad(why))?;
    let index = match (entries, inspect) {
        (Some(entries), _) => entries,
        (None, Some(f)) => {
            let d = check(f, &body).map_err(|e| {
                named.bad(format!(
                    "does not decode into the store's type: {}",
                    describe(&e)
                ))
            })?;
            object = d.object;
            d.entries
        }
        (None, None) => Vec::new(),
    };
    Ok(Incoming {
        suffix: named.key,
        uid: m.uid.unwrap_or_default(),
        resource_version,
        body,
        index,
        decoded: object.filter(|_| keep),
        packed: None,
    })
}

/// An object identified by its metadata: its key, how logs name it, its resourceVersion.
struct Named {
    key: Vec<u8>,
    what: String,
    resource_version: Option<String>,
}

impl Named {
    /// The identity of an object with `name` and `namespace` (of `json`), if they are valid.
    fn of(
        name: Option<String>,
        namespace: Option<&str>,
        resource_version: Option<String>,
        json: &str,
    ) -> Result<Named, BadObject> {
        let name = match name {
            Some(n) if !n.is_empty() && !n.contains('\0') => n,
            _ => {
                return Err(BadObject::anonymous(
                    unnamed(json),
                    "missing or invalid metadata.name".into(),
                ));
            }
        };
        let what = match namespace {
            Some(ns) => format!("{ns}/{name}"),
            None => name.clone(),
        };
        if namespace.is_some_and(|ns| ns.contains('\0')) {
            return Err(BadObject::anonymous(
                what,
                "invalid metadata.namespace".into(),
            ));
        }
        Ok(Named {
            key: object_suffix(namespace, &name),
            what,
            resource_version: resource_version.filter(|rv| !rv.is_empty()),
        })
    }

    /// Why this object is refused.
    fn bad(&self, why: String) -> BadObject {
        BadObject {
            what: self.what.clone(),
            why,
            key: Some(self.key.clone()),
            resource_version: self.resource_version.clone(),
        }
    }
}

/// The body as stored: the JSON received, or the stream's transform's output.
fn transformed(json: &str, cfg: &StreamConfig) -> Result<Vec<u8>, String> {
    if !cfg.transforms() {
        return Ok(json.as_bytes().to_vec());
    }
    let mut v: serde_json::Value =
        serde_json::from_str(json).map_err(|e| format!("invalid JSON: {}", describe(&e)))?;
    cfg.apply_transforms(&mut v);
    serde_json::to_vec(&v).map_err(|e| format!("transform output: {}", describe(&e)))
}

/// An object of a metadata-only LIST page: what a delta relist compares with the store.
#[derive(Debug)]
pub(crate) struct Listed {
    pub(crate) suffix: Vec<u8>,
    pub(crate) namespace: Option<String>,
    pub(crate) name: String,
    pub(crate) uid: Option<String>,
    pub(crate) resource_version: String,
}

/// The identity and resourceVersion of an object (of a `PartialObjectMetadataList`).
pub(crate) fn listed(raw: &RawValue) -> Result<Listed, BadObject> {
    let json = raw.get();
    let head: Head = serde_json::from_str(json).map_err(|e| {
        BadObject::anonymous(
            unnamed(json),
            format!("metadata does not decode: {}", describe(&e)),
        )
    })?;
    let m = head.metadata;
    let name = match m.name {
        Some(n) if !n.is_empty() && !n.contains('\0') && !n.contains('/') => n,
        _ => {
            return Err(BadObject::anonymous(
                unnamed(json),
                "missing or invalid metadata.name".into(),
            ));
        }
    };
    let namespace = m.namespace.filter(|ns| !ns.is_empty());
    if namespace
        .as_deref()
        .is_some_and(|ns| ns.contains('\0') || ns.contains('/'))
    {
        return Err(BadObject::anonymous(
            unnamed(json),
            "invalid metadata.namespace".into(),
        ));
    }
    let suffix = object_suffix(namespace.as_deref(), &name);
    let Some(resource_version) = m.resource_version.filter(|rv| !rv.is_empty()) else {
        return Err(BadObject {
            what: unnamed(json),
            why: "missing metadata.resourceVersion".into(),
            key: Some(suffix),
            resource_version: None,
        });
    };
    Ok(Listed {
        suffix,
        namespace,
        name,
        uid: m.uid,
        resource_version,
    })
}

/// The identity of a `DELETED` event's object: its key suffix, uid and the deletion's
/// resourceVersion (the body is not otherwise read).
pub(crate) fn deleted(raw: &RawValue) -> Result<Deleted, BadObject> {
    let json = raw.get();
    let head: Head = serde_json::from_str(json).map_err(|e| {
        BadObject::anonymous(
            unnamed(json),
            format!("metadata does not decode: {}", describe(&e)),
        )
    })?;
    let m = head.metadata;
    match m.name {
        Some(n) if !n.is_empty() => Ok(Deleted {
            suffix: object_suffix(m.namespace.as_deref(), &n),
            uid: m.uid.filter(|u| !u.is_empty()),
            resource_version: m.resource_version.filter(|rv| !rv.is_empty()),
        }),
        _ => Err(BadObject::anonymous(
            unnamed(json),
            "missing metadata.name".into(),
        )),
    }
}

/// The identity of a `DELETED` event's object (see [`deleted`]).
pub(crate) struct Deleted {
    pub(crate) suffix: Vec<u8>,
    pub(crate) uid: Option<String>,
    /// The deletion's resourceVersion, when the server gave one.
    pub(crate) resource_version: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one classification: 410 before all, "too large" before a refused request.
    #[test]
    fn statuses_are_classified_once() {
        assert_eq!(StatusKind::of(410, false), StatusKind::Gone);
        assert_eq!(StatusKind::of(410, true), StatusKind::Gone);
        assert_eq!(StatusKind::of(504, true), StatusKind::TooLarge);
        assert_eq!(StatusKind::of(504, false), StatusKind::Other);
        assert_eq!(StatusKind::of(400, false), StatusKind::Invalid);
        assert_eq!(StatusKind::of(422, false), StatusKind::Invalid);
        assert_eq!(StatusKind::of(500, false), StatusKind::Other);
        assert_eq!(StatusKind::of(429, false), StatusKind::Other);
        for code in [401, 403, 405, 406, 415] {
            assert_eq!(StatusKind::of(code, false), StatusKind::Refused);
        }
        let body: StatusBody = serde_json::from_str(
            r#"{"code":504,"reason":"Timeout","message":"Too large resource version: 9, current: 7","details":{"causes":[{"reason":"ResourceVersionTooLarge"}]}}"#,
        )
        .unwrap();
        assert_eq!(body.kind(), StatusKind::TooLarge);
    }

    fn raw(s: &str) -> Box<RawValue> {
        RawValue::from_string(s.to_string()).unwrap()
    }

    #[test]
    fn reduces_objects_and_rejects_bad_ones() {
        let cfg = StreamConfig::default();
        let ok = incoming(
            &raw(r#"{"metadata":{"name":"a","namespace":"n","uid":"u","resourceVersion":"7"}}"#),
            &cfg,
            None,
            false,
            &AtomicU64::new(0),
        )
        .unwrap();
        assert_eq!(ok.resource_version, "7");
        assert_eq!(ok.suffix, object_suffix(Some("n"), "a"));
        let err = incoming(
            &raw(r#"{"metadata":{"name":5,"resourceVersion":"7"}}"#),
            &cfg,
            None,
            false,
            &AtomicU64::new(0),
        )
        .unwrap_err();
        assert!(err.why.contains("metadata"), "{err:?}");
        let err = incoming(
            &raw(r#"{"metadata":{"name":"a"}}"#),
            &cfg,
            None,
            false,
            &AtomicU64::new(0),
        )
        .unwrap_err();
        assert_eq!(err.what, "a");
        assert_eq!(err.key, Some(object_suffix(None, "a")));
    }

    #[test]
    fn bookmarks_carry_the_initial_events_end() {
        let b = raw(
            r#"{"metadata":{"resourceVersion":"9","annotations":{"k8s.io/initial-events-end":"true"}}}"#,
        );
        assert_eq!(bookmark(&b), Some(("9".to_string(), true)));
    }
}
