//! Secondary indexes: named functions from an object to index values, registered on the
//! [`StreamConfig`](super::StreamConfig) and evaluated once per incoming object, on the write path.

use std::any::Any;
use std::sync::Arc;

use kube::Resource;
use serde::de::DeserializeOwned;

use crate::model::{Error, Result};
use crate::store::IndexEntries;

use super::config::IndexFn;

/// What one decode of an incoming object gives the write path: its index entries and the
/// metadata the store keys and compares by (so the JSON is not parsed a second time).
#[derive(Debug, Default)]
pub(crate) struct Inspected {
    pub(crate) entries: IndexEntries,
    pub(crate) name: Option<String>,
    pub(crate) namespace: Option<String>,
    pub(crate) uid: Option<String>,
    pub(crate) resource_version: Option<String>,
    /// The decoded object itself (a `K`), for the hot cache's write-through: only for a
    /// [`Decode::Keep`].
    pub(crate) object: Option<Arc<dyn Any + Send + Sync>>,
}

/// Decodes an object's JSON into the stream's type (validating it) and computes its index
/// entries.
pub(crate) type Inspector =
    Arc<dyn Fn(&[u8], Decode) -> std::result::Result<Inspected, serde_json::Error> + Send + Sync>;

/// What an inspector's decode is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decode {
    /// Check the object and read its metadata and index entries; the object is dropped.
    /// Without indexes (which may read any field), its managed fields' `fieldsV1` are not
    /// built (`crate::model::decode_lean`): they are half a typical object's bytes and most
    /// of its decoding, and any value of them decodes.
    Check,
    /// The same, and keep the decoded object ([`Inspected::object`]).
    Keep,
}

/// Build the inspector for `K` from the type-erased index functions of a `StreamConfig`.
/// `None` when there is nothing to check or index.
pub(crate) fn inspector<K>(
    validate: bool,
    indexes: &[(String, Arc<dyn Any + Send + Sync>)],
) -> Result<Option<Inspector>>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
{
    let mut fns: Vec<(String, IndexFn<K>)> = Vec::new();
    for (name, f) in indexes {
        if name.is_empty() || name.contains('\0') {
            return Err(Error::InvalidArgument {
                detail: format!("invalid index name {name:?}"),
            });
        }
        let f = f
            .downcast_ref::<IndexFn<K>>()
            .ok_or_else(|| Error::InvalidArgument {
                detail: format!(
                    "index {name:?} was registered for another object type than this stream's"
                ),
            })?;
        fns.push((name.clone(), f.clone()));
    }
    if !validate && fns.is_empty() {
        return Ok(None);
    }
    Ok(Some(Arc::new(move |body: &[u8], decode: Decode| {
        let obj: K = if decode == Decode::Check && fns.is_empty() {
            crate::model::decode_lean(body)?
        } else {
            crate::model::decode_copy(body)?
        };
        let mut entries = Vec::new();
        for (name, f) in &fns {
            for value in f(&obj) {
                if !value.contains('\0') {
                    entries.push((name.clone(), value));
                }
            }
        }
        entries.sort();
        entries.dedup();
        let meta = obj.meta();
        let mut inspected = Inspected {
            entries,
            name: meta.name.clone(),
            namespace: meta.namespace.clone(),
            uid: meta.uid.clone(),
            resource_version: meta.resource_version.clone(),
            object: None,
        };
        if decode == Decode::Keep {
            inspected.object = Some(Arc::new(obj));
        }
        Ok(inspected)
    })))
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Pod;
    use serde_json::json;

    use super::*;
    use crate::model::describe;

    /// A check decode (which does not build the managed fields' `fieldsV1` trees) accepts
    /// and refuses exactly what a whole decode does, with the same error, and reads the
    /// same metadata; only a kept decode keeps the object, whole.
    #[test]
    fn a_check_decode_answers_as_a_whole_one() {
        let inspect = inspector::<Pod>(true, &[]).unwrap().unwrap();
        let pod = kube_persist_testkit::make_pod("ns-1", "pod-1", 7);
        let mut cases = vec![pod.to_string()];
        for pointer in [
            "/metadata/managedFields/0/fieldsV1",
            "/metadata/managedFields/0/fieldsV1/f:metadata",
            "/metadata/managedFields/0/manager",
            "/metadata/managedFields/1/time",
            "/metadata/managedFields/1",
            "/metadata/managedFields",
            "/metadata/name",
            "/spec/containers",
        ] {
            for v in [
                json!(1),
                json!("x"),
                json!(null),
                json!([{}]),
                json!({"a": [1, {"b": "}\"]"}]}),
            ] {
                let mut p = pod.clone();
                *p.pointer_mut(pointer).unwrap() = v;
                cases.push(p.to_string());
            }
        }
        let (mut accepted, mut refused) = (0, 0);
        for json in &cases {
            match (
                inspect(json.as_bytes(), Decode::Check),
                inspect(json.as_bytes(), Decode::Keep),
            ) {
                (Ok(c), Ok(k)) => {
                    accepted += 1;
                    let meta = |i: &Inspected| {
                        let i = (&i.name, &i.namespace, &i.uid, &i.resource_version);
                        format!("{i:?}")
                    };
                    assert_eq!(meta(&c), meta(&k), "{json}");
                    assert!(c.object.is_none());
                    let kept = k.object.unwrap().downcast::<Pod>().unwrap();
                    let whole: Pod = serde_json::from_str(json).unwrap();
                    assert_eq!(*kept, whole, "the kept object is decoded whole");
                }
                (Err(c), Err(k)) => {
                    refused += 1;
                    assert_eq!(describe(&c), describe(&k), "{json}");
                }
                (c, k) => panic!("{json}: check {c:?}, keep {k:?}"),
            }
        }
        // Both answers are covered, and the pod's managed fields were left out of a check.
        assert!(accepted > 10 && refused > 10, "{accepted} {refused}");
        let mut lean = Vec::new();
        assert_eq!(
            crate::model::lean_fields_v1(cases[0].as_bytes(), &mut lean),
            2
        );
    }
}
