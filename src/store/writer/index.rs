//! Secondary index upkeep: each object's entries are replaced in the same batch as the
//! object; indexes are built from disk in chunks and dropped when no longer configured.

use std::collections::HashMap;

use super::Writer;
use crate::disk::WriteBatch;
use crate::disk::keys::{self, ENTRIES, INDEXES_KEY, OBJECT};
use crate::disk::record;
use crate::model::Result;

/// Index entries of one object: (index name, value).
pub(crate) type IndexEntries = Vec<(String, String)>;

impl Writer {
    /// Compare the configured indexes with those built on disk: drop the ones no longer
    /// configured. Returns whether new ones must be built (page by page, from disk).
    pub(crate) fn prepare_indexes(&mut self, configured: &[String]) -> Result<bool> {
        let built = self.built_indexes()?;
        self.set_indexed(!configured.is_empty());
        let removed: Vec<String> = built
            .iter()
            .filter(|n| !configured.contains(n))
            .cloned()
            .collect();
        if !removed.is_empty() || (configured.is_empty() && !built.is_empty()) {
            tracing::info!(indexes = ?removed, "dropping indexes no longer configured");
            self.drop_indexes(&removed, configured.is_empty())?;
        }
        let kept: Vec<String> = built
            .into_iter()
            .filter(|n| configured.contains(n))
            .collect();
        self.set_built_indexes(&kept)?;
        if kept != configured {
            tracing::info!(indexes = ?configured, "building indexes from disk");
        }
        Ok(kept != configured)
    }

    /// The index entries stored for an object (or written earlier in this batch).
    pub(super) fn entries(
        &self,
        suffix: &[u8],
        pending: &HashMap<Vec<u8>, IndexEntries>,
    ) -> Result<IndexEntries> {
        if let Some(e) = pending.get(suffix) {
            return Ok(e.clone());
        }
        let key = keys::tagged(ENTRIES, suffix);
        match self.backend.get(&key)? {
            Some(v) => record::decode(&v).map_err(|d| record::corrupt(&self.path, &key, d)),
            None => Ok(Vec::new()),
        }
    }

    /// Replace an object's index entries `old` by `new` in `batch`.
    pub(super) fn reindex(
        &self,
        batch: &mut WriteBatch,
        suffix: &[u8],
        old: &[(String, String)],
        new: &[(String, String)],
    ) {
        if old == new {
            return;
        }
        for (name, value) in old.iter().filter(|e| !new.contains(e)) {
            let mut k = keys::index_prefix(name, value);
            k.extend_from_slice(suffix);
            batch.delete(k);
        }
        for (name, value) in new.iter().filter(|e| !old.contains(e)) {
            let mut k = keys::index_prefix(name, value);
            k.extend_from_slice(suffix);
            batch.put(k, Vec::new());
        }
        let key = keys::tagged(ENTRIES, suffix);
        if new.is_empty() {
            batch.delete(key);
        } else {
            batch.put(key, record::encode(&new.to_vec()));
        }
    }

    /// The indexes built on disk.
    pub(crate) fn built_indexes(&self) -> Result<Vec<String>> {
        match self.backend.get(INDEXES_KEY)? {
            Some(v) => record::decode(&v).map_err(|d| record::corrupt(&self.path, INDEXES_KEY, d)),
            None => Ok(Vec::new()),
        }
    }

    /// Remove every entry of the indexes in `names` (no longer configured), in chunks.
    pub(crate) fn drop_indexes(&mut self, names: &[String], drop_entry_lists: bool) -> Result<()> {
        let mut ranges: Vec<(Vec<u8>, Vec<u8>)> =
            names.iter().map(|n| keys::index_range(n)).collect();
        if drop_entry_lists {
            ranges.push(keys::range(ENTRIES, None));
        }
        for (start, end) in ranges {
            loop {
                let mut batch = WriteBatch::default();
                for entry in self.backend.range(&start, &end).take(10_000) {
                    batch.delete(entry?.0);
                }
                if batch.is_empty() {
                    break;
                }
                self.backend.apply(batch)?;
            }
        }
        Ok(())
    }

    /// Recompute the index entries of up to `limit` stored objects after `after`, with
    /// `inspect` (which decodes the JSON body). Returns the last key, or `None` when done.
    pub(crate) fn index_chunk(
        &mut self,
        after: Option<Vec<u8>>,
        limit: usize,
        inspect: &dyn Fn(&[u8]) -> std::result::Result<IndexEntries, serde_json::Error>,
    ) -> Result<Option<Vec<u8>>> {
        let mut batch = WriteBatch::default();
        let mut last = None;
        let mut n = 0;
        for entry in keys::chunk(&*self.backend, OBJECT, after.as_deref(), limit) {
            let (key, value) = entry?;
            n += 1;
            let suffix = key[1..].to_vec();
            let rec = self.decode_record(&key, &value)?;
            let body = rec
                .open(&key, self.cipher.as_deref())
                .map_err(|d| record::corrupt(&self.path, &key, d))?;
            match inspect(&body) {
                Ok(new) => {
                    let old = self.entries(&suffix, &HashMap::new())?;
                    self.reindex(&mut batch, &suffix, &old, &new);
                }
                Err(e) => {
                    tracing::warn!(object = %keys::display(&suffix), error = %e, "not indexed: does not decode")
                }
            }
            last = Some(key);
        }
        self.cache.begin_write(std::iter::empty());
        let applied = self.backend.apply(batch);
        self.cache.end_write();
        applied?;
        Ok(if n < limit { None } else { last })
    }

    /// Record that `names` are the built indexes.
    pub(crate) fn set_built_indexes(&mut self, names: &[String]) -> Result<()> {
        let mut batch = WriteBatch::default();
        batch.put(INDEXES_KEY.to_vec(), record::encode(&names.to_vec()));
        self.backend.apply(batch)?;
        let names = names.to_vec();
        self.status.indexes(names);
        Ok(())
    }
}
