//! Reads answered from the hot cache alone, for callers on async workers that must not
//! touch the disk (the controller runner's reconcile path).

use std::sync::Arc;

use kube::Resource;
use kube::runtime::reflector::ObjectRef;
use serde::de::DeserializeOwned;

use super::Reader;
use crate::disk::keys::{self, OBJECT};

impl<K> Reader<K>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
{
    /// The object from the hot cache, if it holds it (an object written by a recent watch
    /// event always is, within the cache's budget): no disk read, no decode. `None` means
    /// "not cached", not "absent": read it with [`Reader::get`] then.
    pub(crate) fn cached(&self, obj_ref: &ObjectRef<K>) -> Option<Arc<K>> {
        if self.keys_only || !self.cache.enabled() {
            return None;
        }
        let suffix = keys::object_suffix(obj_ref.namespace.as_deref(), &obj_ref.name);
        let hit = self.cache.peek(&keys::tagged(OBJECT, &suffix))?;
        hit.downcast::<K>().ok()
    }
}
