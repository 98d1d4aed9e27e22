//! The single writer of one stream: turns list pages, watch bursts and sweeps into
//! atomic batches that always carry the new [`State`] (the checkpoint) with the data.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::sync::watch;

use super::Status;
use super::cache::HotCache;
use super::engine::{Backend, WriteBatch};
use super::keys::{self, ENTRIES, INDEXES_KEY, OBJECT, SEEN, STATE_KEY};
use super::record::{self, Phase, Record, State};
use crate::crypto::Cipher;
use crate::error::{Error, Result};
use crate::stats::Counters;

/// An object as received from the server, reduced to what the store needs.
#[derive(Debug)]
pub(crate) struct Incoming {
    pub(crate) suffix: Vec<u8>,
    pub(crate) uid: String,
    pub(crate) resource_version: String,
    pub(crate) body: Vec<u8>,
    /// Secondary index entries (index name, value).
    pub(crate) index: Vec<(String, String)>,
}

/// One write to apply.
#[derive(Debug)]
pub(crate) enum Op {
    /// Create or update (skipped when the stored resourceVersion is the same).
    Put(Incoming),
    /// Remove; `body` is the last state as the server sent it.
    Delete { suffix: Vec<u8>, body: Vec<u8> },
}

/// What a committed batch changed, with the JSON body, for the event stream.
#[derive(Debug)]
pub(crate) enum Change {
    Created(Vec<u8>),
    Updated(Vec<u8>),
    Deleted(Vec<u8>),
}

/// How far a list has got after a page.
pub(crate) enum ListProgress {
    /// More pages follow; the token (if any) continues the list.
    More(Option<String>),
    /// The list is complete at this resourceVersion.
    Done(String),
}

pub(crate) struct Writer {
    backend: Arc<dyn Backend>,
    path: PathBuf,
    state: State,
    status: watch::Sender<Status>,
    stats: Arc<Counters>,
    cache: Arc<HotCache>,
    cipher: Option<Arc<Cipher>>,
    /// Whether index entries are maintained (some index is configured).
    indexed: bool,
    /// Whether bodies are zstd-compressed.
    compress: bool,
    /// Keys-only mode: no bodies stored; (apiVersion, kind) to describe swept objects.
    keys_only: Option<(String, String)>,
}

/// Index entries of one object: (index name, value).
type Entries = Vec<(String, String)>;

impl Writer {
    pub(crate) fn new(
        backend: Arc<dyn Backend>,
        path: PathBuf,
        state: State,
        status: watch::Sender<Status>,
        stats: Arc<Counters>,
        cache: Arc<HotCache>,
        cipher: Option<Arc<Cipher>>,
    ) -> Self {
        Writer {
            backend,
            path,
            state,
            status,
            stats,
            cache,
            cipher,
            indexed: false,
            compress: true,
            keys_only: None,
        }
    }

    /// Store no bodies from now on; swept objects are described with this (apiVersion, kind).
    pub(crate) fn set_keys_only(&mut self, type_meta: Option<(String, String)>) {
        self.keys_only = type_meta;
    }

    /// Compress bodies written from now on (or not).
    pub(crate) fn set_compress(&mut self, compress: bool) {
        self.compress = compress;
    }

    /// Maintain index entries on every write from now on.
    pub(crate) fn set_indexed(&mut self, indexed: bool) {
        self.indexed = indexed;
    }

    pub(crate) fn state(&self) -> &State {
        &self.state
    }

    /// Mark the watch as connected (or not), for `Reader::wait_until_live`.
    pub(crate) fn set_live(&self, live: bool) {
        self.status
            .send_if_modified(|s| std::mem::replace(&mut s.live, live) != live);
    }

    /// Start a (re)list with a new epoch. Objects not seen in it are swept at the end.
    pub(crate) fn begin_list(&mut self) -> Result<()> {
        let mut next = self.state.clone();
        next.epoch += 1;
        next.phase = Phase::Listing {
            continue_token: None,
            sweep: self.state.count > 0,
        };
        if self.state.last_synced.is_some() {
            Counters::add(&self.stats.relists, 1);
        }
        tracing::info!(
            epoch = next.epoch,
            sweep = self.state.count > 0,
            "list started"
        );
        self.commit(Vec::new(), next, false).map(|_| ())
    }

    /// Write one list page (or one batch of streaming-list events) in one atomic batch.
    pub(crate) fn list_page(
        &mut self,
        objects: Vec<Incoming>,
        progress: ListProgress,
        emit: bool,
    ) -> Result<Vec<Change>> {
        let sweep = match &self.state.phase {
            Phase::Listing { sweep, .. } => *sweep,
            other => {
                return Err(Error::Storage {
                    path: self.path.clone(),
                    detail: format!("list page written outside a list (phase {other:?})"),
                });
            }
        };
        let mut next = self.state.clone();
        next.phase = match progress {
            ListProgress::More(continue_token) => Phase::Listing {
                continue_token,
                sweep,
            },
            ListProgress::Done(resource_version) if sweep => Phase::Sweeping {
                resource_version,
                after: None,
            },
            ListProgress::Done(resource_version) => {
                next.last_synced = Some(resource_version.clone());
                Phase::Synced { resource_version }
            }
        };
        let ops = objects.into_iter().map(Op::Put).collect();
        self.commit(ops, next, emit)
    }

    /// Apply a burst of watch events and move the checkpoint to `resource_version`.
    pub(crate) fn watch_burst(
        &mut self,
        ops: Vec<Op>,
        resource_version: String,
        emit: bool,
    ) -> Result<Vec<Change>> {
        let mut next = self.state.clone();
        next.last_synced = Some(resource_version.clone());
        next.phase = Phase::Synced { resource_version };
        self.commit(ops, next, emit)
    }

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
        let (start, end) = keys::range(OBJECT, None);
        let from = match after {
            Some(mut c) => {
                c.push(0); // first key after the cursor
                c
            }
            None => start,
        };
        let mut batch = WriteBatch::default();
        let mut changes = Vec::new();
        let mut deleted = 0u64;
        let mut scanned = 0usize;
        let mut last = None;
        for entry in self.backend.range(&from, &end).take(limit) {
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
                    let body = rec.open(&key, self.cipher.as_deref()).map_err(|detail| {
                        Error::Corrupt {
                            path: self.path.clone(),
                            detail: format!("record {}: {detail}", keys::display(suffix)),
                        }
                    })?;
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
        Counters::add(&self.stats.objects_deleted, deleted);
        self.write(batch, next)?;
        Ok((changes, done))
    }

    fn decode_record(&self, key: &[u8], value: &[u8]) -> Result<Record> {
        record::decode(value).map_err(|detail| Error::Corrupt {
            path: self.path.clone(),
            detail: format!("record {}: {detail}", keys::display(&key[1..])),
        })
    }

    /// Apply `ops` and the next state in ONE atomic batch.
    fn commit(&mut self, ops: Vec<Op>, mut next: State, emit: bool) -> Result<Vec<Change>> {
        // Unchanged objects of an older epoch get a mark so the sweep keeps them.
        let mark_unchanged = matches!(self.state.phase, Phase::Listing { sweep: true, .. });
        let epoch = next.epoch;
        let mut batch = WriteBatch::default();
        let mut changes = Vec::new();
        // Versions written earlier in this batch (a burst may touch one object twice).
        let mut pending: HashMap<Vec<u8>, Option<(String, u64)>> = HashMap::new();
        let mut pending_entries: HashMap<Vec<u8>, Entries> = HashMap::new();
        let (mut written, mut unchanged, mut removed) = (0u64, 0u64, 0u64);
        for op in ops {
            let suffix = match &op {
                Op::Put(o) => &o.suffix,
                Op::Delete { suffix, .. } => suffix,
            };
            let key = keys::tagged(OBJECT, suffix);
            let existing = match pending.get(suffix) {
                Some(p) => p.clone(),
                None => match self.backend.get(&key)? {
                    Some(v) => {
                        let r = record::decode_head(&v).map_err(|detail| Error::Corrupt {
                            path: self.path.clone(),
                            detail: format!("record {}: {detail}", keys::display(suffix)),
                        })?;
                        Some((r.resource_version, r.epoch))
                    }
                    None => None,
                },
            };
            match op {
                Op::Put(o) => {
                    if let Some((rv, rec_epoch)) = &existing {
                        if *rv == o.resource_version {
                            unchanged += 1;
                            if mark_unchanged && *rec_epoch != epoch {
                                batch.put(
                                    keys::tagged(SEEN, &o.suffix),
                                    epoch.to_be_bytes().to_vec(),
                                );
                            }
                            continue;
                        }
                    } else {
                        next.count += 1;
                    }
                    written += 1;
                    pending.insert(o.suffix.clone(), Some((o.resource_version.clone(), epoch)));
                    if self.indexed {
                        let old = self.entries(&o.suffix, &pending_entries)?;
                        let new = o.index;
                        self.reindex(&mut batch, &o.suffix, &old, &new);
                        pending_entries.insert(o.suffix.clone(), new);
                    }
                    let rec = Record::sealed(
                        &key,
                        o.resource_version,
                        o.uid,
                        epoch,
                        if self.keys_only.is_some() {
                            &[]
                        } else {
                            &o.body
                        },
                        self.cipher.as_deref(),
                        self.compress,
                    );
                    batch.put(key, record::encode(&rec));
                    if emit {
                        changes.push(if existing.is_some() {
                            Change::Updated(o.body)
                        } else {
                            Change::Created(o.body)
                        });
                    }
                }
                Op::Delete { suffix, body } => {
                    if existing.is_none() {
                        continue; // replayed deletion: already gone
                    }
                    next.count = next.count.saturating_sub(1);
                    removed += 1;
                    batch.delete(keys::tagged(SEEN, &suffix));
                    batch.delete(key);
                    let old = self.entries(&suffix, &pending_entries)?;
                    self.reindex(&mut batch, &suffix, &old, &[]);
                    pending_entries.insert(suffix.clone(), Vec::new());
                    pending.insert(suffix, None);
                    if emit {
                        changes.push(Change::Deleted(body));
                    }
                }
            }
        }
        self.write(batch, next)?;
        Counters::add(&self.stats.objects_written, written);
        Counters::add(&self.stats.objects_unchanged, unchanged);
        Counters::add(&self.stats.objects_deleted, removed);
        Ok(changes)
    }

    /// A minimal object for a key-only record: type, name, namespace, uid, resourceVersion.
    fn describe(&self, suffix: &[u8], rec: &Record) -> Vec<u8> {
        let (api_version, kind) = self.keys_only.clone().unwrap_or_default();
        let text = String::from_utf8_lossy(suffix);
        let (ns, name) = text.split_once('\0').unwrap_or(("", &text));
        let mut meta = serde_json::json!({
            "name": name,
            "uid": rec.uid,
            "resourceVersion": rec.resource_version,
        });
        if !ns.is_empty() {
            meta["namespace"] = ns.into();
        }
        serde_json::to_vec(
            &serde_json::json!({"apiVersion": api_version, "kind": kind, "metadata": meta}),
        )
        .unwrap_or_default()
    }

    /// The index entries stored for an object (or written earlier in this batch).
    fn entries(&self, suffix: &[u8], pending: &HashMap<Vec<u8>, Entries>) -> Result<Entries> {
        if let Some(e) = pending.get(suffix) {
            return Ok(e.clone());
        }
        let key = keys::tagged(ENTRIES, suffix);
        match self.backend.get(&key)? {
            Some(v) => record::decode(&v).map_err(|detail| Error::Corrupt {
                path: self.path.clone(),
                detail: format!("index entries of {}: {detail}", keys::display(suffix)),
            }),
            None => Ok(Vec::new()),
        }
    }

    /// Replace an object's index entries `old` by `new` in `batch`.
    fn reindex(
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
            Some(v) => record::decode(&v).map_err(|detail| Error::Corrupt {
                path: self.path.clone(),
                detail: format!("index list: {detail}"),
            }),
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
                if batch.len() == 0 {
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
        inspect: &dyn Fn(&[u8]) -> std::result::Result<Entries, serde_json::Error>,
    ) -> Result<Option<Vec<u8>>> {
        let (start, end) = keys::range(OBJECT, None);
        let from = match after {
            Some(mut c) => {
                c.push(0);
                c
            }
            None => start,
        };
        let mut batch = WriteBatch::default();
        let mut last = None;
        let mut n = 0;
        for entry in self.backend.range(&from, &end).take(limit) {
            let (key, value) = entry?;
            n += 1;
            let suffix = key[1..].to_vec();
            let rec = self.decode_record(&key, &value)?;
            let body = rec
                .open(&key, self.cipher.as_deref())
                .map_err(|detail| Error::Corrupt {
                    path: self.path.clone(),
                    detail: format!("record {}: {detail}", keys::display(&suffix)),
                })?;
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
        self.status.send_modify(|s| s.indexes = names);
        Ok(())
    }

    fn write(&mut self, mut batch: WriteBatch, next: State) -> Result<()> {
        batch.put(STATE_KEY.to_vec(), record::encode(&next));
        let ops = batch.len();
        // Readers must not keep (or re-insert) cached versions of what this batch changes.
        self.cache
            .begin_write(batch.keys().filter(|k| k.first() == Some(&OBJECT)));
        let applied = self.backend.apply(batch);
        self.cache.end_write();
        applied?;
        Counters::add(&self.stats.batches, 1);
        tracing::trace!(ops, phase = ?next.phase, "batch committed");
        self.state = next;
        self.publish();
        Ok(())
    }

    /// Tell readers about the current state.
    pub(crate) fn publish(&self) {
        let state = &self.state;
        self.status.send_modify(|s| {
            s.count = state.count;
            s.phase = (&state.phase).into();
            s.checkpoint = state.last_synced.clone();
            s.ready = state.last_synced.is_some();
        });
    }
}
