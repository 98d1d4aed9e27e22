//! The stream's keyspace as its writer reads it: record heads, the index entries of an
//! object, the built indexes, the prune cursor; each read decoded, and a record that does
//! not decode reported as corrupt with its key.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use super::index::IndexEntries;
use crate::disk::keys::{self, ENTRIES, INDEXES_KEY, OBJECT, PRUNE_KEY};
use crate::disk::record::{self, Record};
use crate::disk::{Backend, Cipher};
use crate::model::Result;

/// What a batch needs of a stored (or earlier written) record.
#[derive(Debug, Clone)]
pub(super) struct Head {
    pub(super) resource_version: String,
    pub(super) epoch: u64,
    pub(super) uid: String,
}

/// One stream's keyspace, its path (for errors) and its cipher (encrypted stores).
pub(super) struct Keyspace {
    pub(super) backend: Arc<dyn Backend>,
    pub(super) path: PathBuf,
    /// The stream's name, for errors.
    pub(super) stream: String,
    pub(super) cipher: Option<Arc<Cipher>>,
}

impl Keyspace {
    /// A stored record, decoded.
    pub(super) fn decode_record(&self, key: &[u8], value: &[u8]) -> Result<Record> {
        record::decode(value).map_err(|d| record::corrupt(&self.path, &self.stream, key, d))
    }

    /// A stored record's plaintext JSON body (decrypted, decompressed).
    pub(super) fn open_body(&self, key: &[u8], rec: Record) -> Result<Vec<u8>> {
        rec.open(key, self.cipher.as_deref())
            .map_err(|detail| record::corrupt(&self.path, &self.stream, key, detail))
    }

    /// Whether any object record is stored.
    pub(super) fn holds_objects(&self) -> Result<bool> {
        let (start, end) = keys::range(OBJECT, None);
        Ok(self
            .backend
            .range(&start, &end)
            .next()
            .transpose()?
            .is_some())
    }

    /// The stored resourceVersion of each object of `suffixes` (`None`: not stored), read
    /// from the records' heads in one pass.
    pub(super) fn stored_versions(&self, suffixes: &[Vec<u8>]) -> Result<Vec<Option<String>>> {
        let keys: Vec<Vec<u8>> = suffixes.iter().map(|s| keys::tagged(OBJECT, s)).collect();
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        let mut out = vec![None; keys.len()];
        self.backend.get_each(&refs, &mut |i, value| {
            let r = record::decode_head(value)
                .map_err(|d| record::corrupt(&self.path, &self.stream, &keys[i], d))?;
            out[i] = Some(r.resource_version);
            Ok(())
        })?;
        Ok(out)
    }

    /// The stored head (resourceVersion, epoch, uid) of the objects of `suffixes`, read in
    /// one pass (one read transaction on redb) from the records' heads, without copying
    /// bodies. Always read, even when the count says the store is empty: what decides
    /// whether an object is new or a deletion already applied is the record, never the count.
    pub(super) fn stored_heads<'a>(
        &self,
        suffixes: impl Iterator<Item = &'a [u8]>,
    ) -> Result<HashMap<Vec<u8>, Head>> {
        let mut heads = HashMap::new();
        let keys: Vec<Vec<u8>> = suffixes.map(|s| keys::tagged(OBJECT, s)).collect();
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        self.backend.get_each(&refs, &mut |i, value| {
            let suffix = &keys[i][1..];
            let r = record::decode_head(value)
                .map_err(|d| record::corrupt(&self.path, &self.stream, &keys[i], d))?;
            heads.insert(
                suffix.to_vec(),
                Head {
                    resource_version: r.resource_version,
                    epoch: r.epoch,
                    uid: r.uid,
                },
            );
            Ok(())
        })?;
        Ok(heads)
    }

    /// The entries an object's index function returned, as they are stored: in an encrypted
    /// stream, each value replaced by its token (`Cipher::index_token`), which is what a
    /// lookup of that value looks for; else as they are.
    pub(super) fn stored_entries(&self, entries: IndexEntries) -> IndexEntries {
        match &self.cipher {
            None => entries,
            Some(c) => entries
                .into_iter()
                .map(|(index, value)| {
                    let token = c.index_token(&index, &value);
                    (index, token)
                })
                .collect(),
        }
    }

    /// The index entries stored for an object, as stored (or written earlier in this batch:
    /// `pending`).
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
            Some(v) => record::decode_sealed(&v, &key, self.cipher.as_deref())
                .map_err(|d| record::corrupt(&self.path, &self.stream, &key, d)),
            None => Ok(Vec::new()),
        }
    }

    /// The indexes built on disk.
    pub(super) fn built_indexes(&self) -> Result<Vec<String>> {
        match self.backend.get(INDEXES_KEY)? {
            Some(v) => record::decode(&v)
                .map_err(|d| record::corrupt(&self.path, &self.stream, INDEXES_KEY, d)),
            None => Ok(Vec::new()),
        }
    }

    /// Whether a prune is pending, and after which key it resumes.
    pub(super) fn prune_cursor(&self) -> Result<Option<Option<Vec<u8>>>> {
        match self.backend.get(PRUNE_KEY)? {
            None => Ok(None),
            Some(v) => record::decode::<Option<Vec<u8>>>(&v)
                .map(Some)
                .map_err(|detail| {
                    record::corrupt_named(
                        &self.path,
                        &format!("stream {:?}", self.stream),
                        "prune cursor",
                        detail,
                    )
                }),
        }
    }
}
