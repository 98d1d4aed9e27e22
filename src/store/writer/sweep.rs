//! The end of a relist: objects of older epochs that the new list did not mark are removed,
//! chunk by chunk ([`chunk`]), each chunk one atomic batch with the sweep cursor.

use std::collections::HashMap;

use super::index::reindex;
use super::{Change, Writer};
use crate::disk::WriteBatch;
use crate::disk::keys::{self, OBJECT, SEEN};
use crate::disk::record::Record;
use crate::model::Result;

/// One chunk of a sweep, read and not yet written.
pub(super) struct Swept {
    pub(super) writes: WriteBatch,
    pub(super) deleted: u64,
    pub(super) changes: Vec<Change>,
    /// The last key scanned: the sweep resumes after it.
    pub(super) last: Option<Vec<u8>>,
    /// The scan reached the end of the objects.
    pub(super) done: bool,
}

/// Up to `limit` objects after `after`: the removal of those neither written nor marked in
/// `epoch` (with their index entries and, with `emit`, their events), and of the marks read.
pub(super) fn chunk(
    w: &Writer,
    epoch: u64,
    after: Option<&[u8]>,
    limit: usize,
    emit: bool,
) -> Result<Swept> {
    let ks = &w.ks;
    let mut swept = Swept {
        writes: WriteBatch::default(),
        deleted: 0,
        changes: Vec::new(),
        last: None,
        done: false,
    };
    let mut scanned = 0usize;
    for entry in keys::chunk(&*ks.backend, OBJECT, after, limit) {
        let (key, value) = entry?;
        scanned += 1;
        let rec: Record = ks.decode_record(&key, &value)?;
        let suffix = &key[1..];
        let mark_key = keys::tagged(SEEN, suffix);
        let marked = match ks.backend.get(&mark_key)? {
            Some(m) => {
                swept.writes.delete(mark_key);
                m == epoch.to_be_bytes()
            }
            None => false,
        };
        if rec.epoch != epoch && !marked {
            tracing::debug!(object = %keys::display(suffix), "swept: absent from the new list");
            swept.writes.delete(key.clone());
            let old = ks.entries(suffix, &HashMap::new())?;
            reindex(&mut swept.writes, suffix, &old, &[], ks.cipher.as_deref());
            swept.deleted += 1;
            if emit && w.keys_only.is_some() {
                swept.changes.push(Change::Deleted(describe(
                    w.keys_only.as_ref(),
                    suffix,
                    &rec,
                )));
            } else if emit {
                let body = ks.open_body(&key, rec)?;
                swept.changes.push(Change::Deleted(body));
            }
        }
        swept.last = Some(key);
    }
    swept.done = scanned < limit;
    if swept.done {
        // Marks whose object vanished cannot exist (they are removed with it), but a
        // store written by an interrupted older version might hold some: clear them.
        let (ms, me) = keys::range(SEEN, None);
        for entry in ks.backend.range(&ms, &me) {
            swept.writes.delete(entry?.0);
        }
    }
    Ok(swept)
}

/// A minimal object for a key-only record: type, name, namespace, uid, resourceVersion.
fn describe(type_meta: Option<&(String, String)>, suffix: &[u8], rec: &Record) -> Vec<u8> {
    let (api_version, kind) = type_meta.cloned().unwrap_or_default();
    let (ns, name) = keys::split_suffix(suffix);
    let mut meta = serde_json::json!({
        "name": name,
        "uid": rec.uid,
        "resourceVersion": rec.resource_version,
    });
    if !ns.is_empty() {
        meta["namespace"] = ns.as_ref().into();
    }
    serde_json::to_vec(
        &serde_json::json!({"apiVersion": api_version, "kind": kind, "metadata": meta}),
    )
    .unwrap_or_default()
}
