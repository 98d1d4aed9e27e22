//! The end of a relist: objects of older epochs that the new list did not mark are removed,
//! chunk by chunk, each chunk one atomic batch with the sweep cursor.

use std::collections::HashMap;

use super::{Change, Tally, Writer};
use crate::disk::WriteBatch;
use crate::disk::keys::{self, OBJECT, SEEN};
use crate::disk::record::{self, Record};
use crate::model::Result;
use crate::store::Phase;

impl Writer {
    /// Remove up to `limit` objects not seen in the current epoch. Returns the deletions
    /// and whether the sweep is complete (then the store is synced at the list's version).
    pub(crate) fn sweep_step(&mut self, limit: usize, emit: bool) -> Result<(Vec<Change>, bool)> {
        let Phase::Sweeping {
            resource_version,
            after,
        } = self.state.phase.clone()
        else {
            return Ok((Vec::new(), true));
        };
        let epoch = self.state.epoch;
        let mut batch = WriteBatch::default();
        let mut changes = Vec::new();
        let mut deleted = 0u64;
        let mut scanned = 0usize;
        let mut last = None;
        for entry in keys::chunk(&*self.backend, OBJECT, after.as_deref(), limit) {
            let (key, value) = entry?;
            scanned += 1;
            let rec: Record = self.decode_record(&key, &value)?;
            let suffix = &key[1..];
            let mark_key = keys::tagged(SEEN, suffix);
            let marked = match self.backend.get(&mark_key)? {
                Some(m) => {
                    batch.delete(mark_key);
                    m == epoch.to_be_bytes()
                }
                None => false,
            };
            if rec.epoch != epoch && !marked {
                tracing::debug!(object = %keys::display(suffix), "swept: absent from the new list");
                batch.delete(key.clone());
                let old = self.entries(suffix, &HashMap::new())?;
                self.reindex(&mut batch, suffix, &old, &[]);
                deleted += 1;
                if emit && self.keys_only.is_some() {
                    changes.push(Change::Deleted(self.describe(suffix, &rec)));
                } else if emit {
                    let body = rec
                        .open(&key, self.cipher.as_deref())
                        .map_err(|detail| record::corrupt(&self.path, &key, detail))?;
                    changes.push(Change::Deleted(body));
                }
            }
            last = Some(key);
        }
        let done = scanned < limit;
        let mut next = self.state.clone();
        next.count = next.count.saturating_sub(deleted);
        if done {
            // Marks whose object vanished cannot exist (they are removed with it), but a
            // store written by an interrupted older version might hold some: clear them.
            let (ms, me) = keys::range(SEEN, None);
            for entry in self.backend.range(&ms, &me) {
                batch.delete(entry?.0);
            }
            tracing::info!(resource_version = %resource_version, "sweep complete, store synced");
            next.last_synced = Some(resource_version.clone());
            next.phase = Phase::Synced { resource_version };
        } else {
            next.phase = Phase::Sweeping {
                resource_version,
                after: last,
            };
        }
        let tally = Tally {
            deleted,
            ..Tally::default()
        };
        let window = self.window_update(&mut batch, &next, None);
        self.write(batch, next, tally, window)?;
        Ok((changes, done))
    }

    /// A minimal object for a key-only record: type, name, namespace, uid, resourceVersion.
    fn describe(&self, suffix: &[u8], rec: &Record) -> Vec<u8> {
        let (api_version, kind) = self.keys_only.clone().unwrap_or_default();
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
}
