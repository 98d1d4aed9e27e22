//! Narrowing a sharded store: when a store is reopened with a shard inside its stored one,
//! the objects outside the new shard are removed chunk by chunk, each chunk one atomic
//! batch with the prune cursor, so a crash resumes the prune where it stopped. The watch
//! resumes from the same checkpoint: no paginated LIST.

use std::collections::HashMap;

use super::{Tally, Writer};
use crate::disk::WriteBatch;
use crate::disk::keys::{self, OBJECT, PRUNE_KEY, SEEN};
use crate::disk::record;
use crate::model::Shard;
use crate::model::{Error, Result};

impl Writer {
    /// Whether a prune is pending, and after which key it resumes.
    pub(crate) fn prune_pending(&self) -> Result<Option<Option<Vec<u8>>>> {
        match self.backend.get(PRUNE_KEY)? {
            None => Ok(None),
            Some(v) => record::decode::<Option<Vec<u8>>>(&v)
                .map(Some)
                .map_err(|detail| Error::Corrupt {
                    path: self.path.clone(),
                    detail: format!("prune cursor: {detail}"),
                }),
        }
    }

    /// Remove up to `limit` scanned objects outside `shard` (no events: they still exist
    /// on the server, in another shard). Returns whether the prune is complete.
    pub(crate) fn prune_step(&mut self, shard: &Shard, limit: usize) -> Result<bool> {
        let Some(after) = self.prune_pending()? else {
            return Ok(true);
        };
        let mut batch = WriteBatch::default();
        let (mut scanned, mut pruned) = (0usize, 0u64);
        let mut last = None;
        for entry in keys::chunk(&*self.backend, OBJECT, after.as_deref(), limit) {
            let (key, value) = entry?;
            scanned += 1;
            let suffix = &key[1..];
            let head =
                record::decode_head(&value).map_err(|d| record::corrupt(&self.path, &key, d))?;
            if !shard.contains(Some(&head.uid), Some(&keys::suffix_namespace(suffix))) {
                batch.delete(keys::tagged(SEEN, suffix));
                let old = self.entries(suffix, &HashMap::new())?;
                self.reindex(&mut batch, suffix, &old, &[]);
                batch.delete(key.clone());
                pruned += 1;
            }
            last = Some(key);
        }
        let done = scanned < limit;
        if done {
            batch.delete(PRUNE_KEY.to_vec());
        } else {
            batch.put(PRUNE_KEY.to_vec(), record::encode(&last));
        }
        let mut next = self.state.clone();
        next.count = next.count.saturating_sub(pruned);
        if done {
            // Readers see the store ready again with the batch that completes the prune.
            self.pruning = false;
        }
        let tally = Tally {
            deleted: pruned,
            ..Tally::default()
        };
        let window = self.window_update(&mut batch, &next, None);
        self.write(batch, next, tally, window)?;
        tracing::debug!(pruned, done, "pruned objects outside the shard");
        Ok(done)
    }
}
