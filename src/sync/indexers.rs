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
    /// The decoded object itself (a `K`), for the hot cache's write-through.
    pub(crate) object: Option<Arc<dyn Any + Send + Sync>>,
}

/// Decodes an object's JSON into the stream's type (validating it) and computes its index
/// entries.
pub(crate) type Inspector =
    Arc<dyn Fn(&[u8]) -> std::result::Result<Inspected, serde_json::Error> + Send + Sync>;

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
    Ok(Some(Arc::new(move |body: &[u8]| {
        let obj: K = crate::model::decode_copy(body)?;
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
        Ok(Inspected {
            entries,
            name: meta.name.clone(),
            namespace: meta.namespace.clone(),
            uid: meta.uid.clone(),
            resource_version: meta.resource_version.clone(),
            object: Some(Arc::new(obj)),
        })
    })))
}
