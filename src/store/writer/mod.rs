//! The single writer of one stream: turns list pages, watch bursts and sweeps into
//! atomic batches that always carry the new [`State`] (the checkpoint) with the data.
//!
//! [`Writer`]'s methods are all here, each a step of the stream's cycle; the work of each
//! concept is in a file of its own: one batch built op by op (`batch.rs`, [`Batch`]), the
//! keyspace as the writer reads it (`keyspace.rs`, [`Keyspace`]), the delta relist's fetch
//! window (`window.rs`, [`FetchWindow`]), index upkeep (`index.rs`), the sweep at the end of
//! a relist (`sweep.rs`) and the prune of a narrowed shard (`prune.rs`).

mod batch;
mod index;
mod keyspace;
mod prune;
mod sweep;
mod window;
pub(crate) use index::IndexEntries;

use std::path::PathBuf;
use std::sync::Arc;

use super::StatusTx;
use super::cache::HotCache;
use crate::disk::Cipher;
use crate::disk::keys::{OBJECT, STATE_KEY};
use crate::disk::record;
use crate::disk::{Backend, WriteBatch};
use crate::model::Counters;
use crate::model::{Error, Result, Shard};
use crate::store::{Compression, StreamLease};
use crate::store::{Phase, State};
use batch::Batch;
use keyspace::Keyspace;
use window::FetchWindow;

/// An object as received from the server, reduced to what the store needs.
#[derive(Debug)]
pub(crate) struct Incoming {
    pub(crate) suffix: Vec<u8>,
    pub(crate) uid: String,
    pub(crate) resource_version: String,
    pub(crate) body: Vec<u8>,
    /// Secondary index entries (index name, value).
    pub(crate) index: Vec<(String, String)>,
    /// The body as decoded into the stream's type by the validation decode, kept for the
    /// hot cache (write-through) for watch events; `None` otherwise.
    pub(crate) decoded: Option<std::sync::Arc<dyn std::any::Any + Send + Sync>>,
    /// The body already compressed with the store's compression (watch events, on the CPU
    /// threads that parse them, so that the disk thread only writes); `None`: the writer
    /// compresses it, if it writes it (list pages: a relist skips most objects unchanged).
    pub(crate) packed: Option<crate::disk::record::Packed>,
}

/// One write to apply.
#[derive(Debug)]
pub(crate) enum Op {
    /// Create or update (skipped when the stored resourceVersion is the same).
    Put(Incoming),
    /// Remove; `body` is the last state as the server sent it, `resource_version` that of
    /// the deletion (a watch event's), when the server gave one.
    Delete {
        suffix: Vec<u8>,
        body: Vec<u8>,
        resource_version: Option<String>,
        /// The deleted object's uid, when the server gave one: a deletion of the stored
        /// object (the same uid) is never skipped as older than it.
        uid: Option<String>,
    },
    /// A delta relist saw the object at this resourceVersion in a metadata-only page: keep
    /// it (mark it seen in this epoch) when the stored version is the same; otherwise
    /// nothing (its body is fetched and written as a `Put`, or it is swept).
    Seen {
        suffix: Vec<u8>,
        resource_version: String,
    },
    /// The server has a newer version that the store refused (see `Stats::bad_objects`):
    /// remove the stored one, which is no longer current. No `Delete` event. Skipped, as a
    /// `Put` is, when older than the stored version while a delta relist's fetched bodies
    /// are being replayed (see [`FetchWindow`]).
    Reject {
        suffix: Vec<u8>,
        resource_version: Option<String>,
    },
}

impl Op {
    /// The object's key suffix.
    fn suffix(&self) -> &[u8] {
        match self {
            Op::Put(o) => &o.suffix,
            Op::Delete { suffix, .. } | Op::Reject { suffix, .. } | Op::Seen { suffix, .. } => {
                suffix
            }
        }
    }

    /// The key and (for a server deletion) the last body of a removal.
    fn into_removal(self) -> Option<(Vec<u8>, Option<Vec<u8>>)> {
        match self {
            Op::Put(_) | Op::Seen { .. } => None,
            Op::Delete { suffix, body, .. } => Some((suffix, Some(body))),
            Op::Reject { suffix, .. } => Some((suffix, None)),
        }
    }
}

/// What a committed batch changed, with the JSON body, for the event stream.
#[derive(Debug)]
pub(crate) enum Change {
    Created(Body),
    Updated(Body),
    Deleted(Vec<u8>),
}

/// The JSON body of a created or updated object, and its decoded form when the write path
/// kept it ([`Incoming::decoded`]): what an event needs without decoding it again.
#[derive(Debug)]
pub(crate) struct Body {
    pub(crate) json: Vec<u8>,
    pub(crate) decoded: Option<std::sync::Arc<dyn std::any::Any + Send + Sync>>,
}

/// What a batch did to objects, added to the counters once it is committed and before
/// readers are told of the state it wrote: whoever sees the new status sees its counts.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Tally {
    pub(crate) written: u64,
    pub(crate) unchanged: u64,
    pub(crate) deleted: u64,
    /// Watch events skipped as older than the stored version.
    pub(crate) stale: u64,
}

/// How far a list has got after a page.
pub(crate) enum ListProgress {
    /// More pages follow; the token (if any) continues the list.
    More(Option<String>),
    /// The list is complete at this resourceVersion.
    Done(String),
}

/// What a writer is built on: the stream's keyspace and its stored state, the readers'
/// status, the stream's counters and hot cache, and the keyspace's lease.
pub(crate) struct WriterParts {
    pub(crate) backend: Arc<dyn Backend>,
    /// The store directory, for errors.
    pub(crate) path: PathBuf,
    /// The stream's name, for errors.
    pub(crate) stream: String,
    pub(crate) state: State,
    pub(crate) status: StatusTx,
    pub(crate) stats: Arc<Counters>,
    pub(crate) cache: Arc<HotCache>,
    pub(crate) cipher: Option<Arc<Cipher>>,
    pub(crate) lease: StreamLease,
}

pub(crate) struct Writer {
    ks: Keyspace,
    state: State,
    status: StatusTx,
    stats: Arc<Counters>,
    cache: Arc<HotCache>,
    /// Whether index entries are maintained (some index is configured).
    indexed: bool,
    /// How bodies are compressed.
    compress: Compression,
    /// Keys-only mode: no bodies stored; (apiVersion, kind) to describe swept objects.
    keys_only: Option<(String, String)>,
    /// What the last committed batch did (a delta relist's choice of its next page).
    last_tally: Tally,
    /// The delta relist's fetch window (`keys::FETCHED_KEY`, read when the stream is
    /// opened): while it is open the store may hold bodies newer than its checkpoint, and
    /// the watch skips replayed events older than the stored versions.
    window: FetchWindow,
    /// A narrowed shard's prune is pending: the store holds objects it no longer owns and
    /// is not reported ready until the prune completes.
    pruning: bool,
    /// The keyspace's lease: released when the last holder of this writer (the watcher,
    /// or a job it queued on the disk thread) is gone.
    _lease: StreamLease,
}

impl Writer {
    pub(crate) fn new(parts: WriterParts) -> Self {
        let WriterParts {
            backend,
            path,
            stream,
            state,
            status,
            stats,
            cache,
            cipher,
            lease,
        } = parts;
        Writer {
            ks: Keyspace {
                backend,
                path,
                stream,
                cipher,
            },
            state,
            status,
            stats,
            cache,
            indexed: false,
            compress: Compression::Lz4,
            keys_only: None,
            pruning: false,
            window: FetchWindow::default(),
            last_tally: Tally::default(),
            _lease: lease,
        }
    }

    /// Whether a prune is pending (read from disk when the stream is opened).
    pub(crate) fn set_pruning(&mut self, pruning: bool) {
        self.pruning = pruning;
    }

    /// The delta relist window read from disk when the stream is opened (see
    /// [`FetchWindow`]).
    pub(crate) fn set_fetched_through(&mut self, fetched_through: Option<String>) {
        self.window = FetchWindow::new(fetched_through);
    }

    /// Store no bodies from now on; swept objects are described with this (apiVersion, kind).
    pub(crate) fn set_keys_only(&mut self, type_meta: Option<(String, String)>) {
        self.keys_only = type_meta;
    }

    /// Compress bodies written from now on (or not).
    pub(crate) fn set_compress(&mut self, compress: Compression) {
        self.compress = compress;
    }

    /// The compression of the bodies this writer writes.
    pub(crate) fn compression(&self) -> Compression {
        self.compress
    }

    /// Maintain index entries on every write from now on.
    pub(crate) fn set_indexed(&mut self, indexed: bool) {
        self.indexed = indexed;
    }

    pub(crate) fn state(&self) -> &State {
        &self.state
    }

    /// A handle on the readers' status, for the watcher to publish liveness without
    /// waiting for the writer.
    pub(crate) fn status_sender(&self) -> StatusTx {
        self.status.clone()
    }

    /// Start a (re)list with a new epoch. Objects not seen in it are swept at the end.
    pub(crate) fn begin_list(&mut self) -> Result<()> {
        let mut next = self.state.clone();
        next.epoch += 1;
        // Sweep whenever a record exists, whatever the count says.
        let sweep = self.state.count > 0 || self.ks.holds_objects()?;
        next.phase = Phase::Listing {
            continue_token: None,
            sweep,
        };
        // A retry of a list that has not completed is the same relist, not another one.
        let retry = matches!(self.state.phase, Phase::Listing { .. });
        let relist = self.state.last_synced.is_some() && !retry;
        tracing::info!(epoch = next.epoch, sweep, "list started");
        self.commit(Vec::new(), next, false)?;
        // Counted once its Listing phase is published: whoever sees the count sees a phase
        // at least as new (a reader never takes the old Synced phase for the relist's end).
        if relist {
            Counters::add(&self.stats.relists, 1);
        }
        Ok(())
    }

    /// Write one list page (or one batch of streaming-list events) in one atomic batch.
    pub(crate) fn list_page(
        &mut self,
        objects: Vec<Incoming>,
        progress: ListProgress,
        emit: bool,
    ) -> Result<Vec<Change>> {
        self.list_ops(
            objects.into_iter().map(Op::Put).collect(),
            progress,
            emit,
            None,
        )
    }

    /// A list page's writes with the list's progress, in one atomic batch; `fetched`: a new
    /// high of the delta relist window ([`FetchWindow`]) to keep with them.
    fn list_ops(
        &mut self,
        ops: Vec<Op>,
        progress: ListProgress,
        emit: bool,
        fetched: Option<String>,
    ) -> Result<Vec<Change>> {
        let sweep = match &self.state.phase {
            Phase::Listing { sweep, .. } => *sweep,
            other => {
                return Err(Error::Storage {
                    path: self.ks.path.clone(),
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
        self.commit_window(ops, next, emit, fetched)
    }

    /// Write one page of a delta relist in one atomic batch: `seen`, the objects of a
    /// metadata-only page whose stored version is current (marked), and `fetched`, the
    /// bodies fetched for the others (written whatever is stored: the server's current
    /// state is authoritative, as in a full list).
    ///
    /// `answered_at`: the highest resourceVersion the page's fetches were answered at (their
    /// bodies are no newer), kept with the page as the relist's window ([`FetchWindow`]).
    pub(crate) fn delta_page(
        &mut self,
        seen: Vec<(Vec<u8>, String)>,
        fetched: Vec<Incoming>,
        answered_at: Option<String>,
        progress: ListProgress,
        emit: bool,
    ) -> Result<Vec<Change>> {
        let raised = self.window.raised_by(answered_at);
        let mut ops: Vec<Op> = seen
            .into_iter()
            .map(|(suffix, resource_version)| Op::Seen {
                suffix,
                resource_version,
            })
            .collect();
        ops.extend(fetched.into_iter().map(Op::Put));
        self.list_ops(ops, progress, emit, raised)
    }

    /// The stored resourceVersion of each object of `suffixes` (`None`: not stored), read
    /// from the records' heads in one pass.
    pub(crate) fn stored_versions(&self, suffixes: &[Vec<u8>]) -> Result<Vec<Option<String>>> {
        self.ks.stored_versions(suffixes)
    }

    /// What the last committed batch did to objects.
    pub(crate) fn last_tally(&self) -> Tally {
        self.last_tally
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

    /// Remove up to `limit` objects not seen in the current epoch (`sweep.rs`). Returns the
    /// deletions and whether the sweep is complete (then the store is synced at the list's
    /// version).
    pub(crate) fn sweep_step(&mut self, limit: usize, emit: bool) -> Result<(Vec<Change>, bool)> {
        let Phase::Sweeping {
            resource_version,
            after,
        } = self.state.phase.clone()
        else {
            return Ok((Vec::new(), true));
        };
        let swept = sweep::chunk(self, self.state.epoch, after.as_deref(), limit, emit)?;
        let mut next = self.state.clone();
        next.count = next.count.saturating_sub(swept.deleted);
        if swept.done {
            tracing::info!(resource_version = %resource_version, "sweep complete, store synced");
            next.last_synced = Some(resource_version.clone());
            next.phase = Phase::Synced { resource_version };
        } else {
            next.phase = Phase::Sweeping {
                resource_version,
                after: swept.last,
            };
        }
        let tally = Tally {
            deleted: swept.deleted,
            ..Tally::default()
        };
        self.write(swept.writes, next, tally, None)?;
        Ok((swept.changes, swept.done))
    }

    /// Whether a prune is pending, and after which key it resumes.
    pub(crate) fn prune_pending(&self) -> Result<Option<Option<Vec<u8>>>> {
        self.ks.prune_cursor()
    }

    /// Remove up to `limit` scanned objects outside `shard` (`prune.rs`; no events: they
    /// still exist on the server, in another shard). Returns whether the prune is complete.
    pub(crate) fn prune_step(&mut self, shard: &Shard, limit: usize) -> Result<bool> {
        let Some(after) = self.ks.prune_cursor()? else {
            return Ok(true);
        };
        let pruned = prune::chunk(&self.ks, shard, after.as_deref(), limit)?;
        let mut next = self.state.clone();
        next.count = next.count.saturating_sub(pruned.pruned);
        if pruned.done {
            // Readers see the store ready again with the batch that completes the prune.
            self.pruning = false;
        }
        let tally = Tally {
            deleted: pruned.pruned,
            ..Tally::default()
        };
        self.write(pruned.writes, next, tally, None)?;
        tracing::debug!(
            pruned = pruned.pruned,
            done = pruned.done,
            "pruned objects outside the shard"
        );
        Ok(pruned.done)
    }

    /// Compare the configured indexes with those built on disk (`index.rs`): drop the ones
    /// no longer configured. Returns whether new ones must be built (page by page, from disk).
    pub(crate) fn prepare_indexes(&mut self, configured: &[String]) -> Result<bool> {
        let plan = index::plan(self.ks.built_indexes()?, configured);
        self.set_indexed(!configured.is_empty());
        if !plan.removed.is_empty() || plan.drop_entry_lists {
            tracing::info!(indexes = ?plan.removed, "dropping indexes no longer configured");
            index::drop(&self.ks, &plan.removed, plan.drop_entry_lists)?;
        }
        self.set_built_indexes(&plan.kept)?;
        if plan.build {
            tracing::info!(indexes = ?configured, "building indexes from disk");
        }
        Ok(plan.build)
    }

    /// The indexes built on disk.
    pub(crate) fn built_indexes(&self) -> Result<Vec<String>> {
        self.ks.built_indexes()
    }

    /// Recompute the index entries of up to `limit` stored objects after `after`, with
    /// `inspect` (which decodes the JSON body). Returns the last key, or `None` when done.
    pub(crate) fn index_chunk(
        &mut self,
        after: Option<Vec<u8>>,
        limit: usize,
        inspect: &dyn Fn(&[u8]) -> std::result::Result<IndexEntries, serde_json::Error>,
    ) -> Result<Option<Vec<u8>>> {
        let (batch, last) = index::chunk(&self.ks, after, limit, inspect)?;
        self.cache.begin_write(std::iter::empty());
        let applied = self.ks.backend.apply(batch);
        self.cache.end_write();
        applied?;
        Ok(last)
    }

    /// Record that `names` are the built indexes, and tell the readers.
    pub(crate) fn set_built_indexes(&mut self, names: &[String]) -> Result<()> {
        index::record_built(&self.ks, names)?;
        self.status.indexes(names.to_vec());
        Ok(())
    }

    /// Apply `ops` and the next state in ONE atomic batch.
    fn commit(&mut self, ops: Vec<Op>, next: State, emit: bool) -> Result<Vec<Change>> {
        self.commit_window(ops, next, emit, None)
    }

    /// [`Writer::commit`], keeping `fetched` as the new high of the delta relist window
    /// ([`FetchWindow`]) in the same batch: the batch is built op by op (`batch.rs`),
    /// written with the state, and its objects' decoded forms cached once it is committed.
    fn commit_window(
        &mut self,
        ops: Vec<Op>,
        next: State,
        emit: bool,
        fetched: Option<String>,
    ) -> Result<Vec<Change>> {
        let mut batch = Batch::new(self, &ops, next, emit)?;
        for op in ops {
            batch.apply(op)?;
        }
        let built = batch.finish();
        self.write(built.writes, built.next, built.tally, fetched)?;
        // After the write's cache invalidation, before the next write: each is the newest.
        self.cache.put_fresh(built.fresh);
        Ok(built.changes)
    }

    /// Commit `batch` with the state `next` (and the fetch window's update, `fetched`
    /// raising it): one atomic batch, the cache kept coherent around it, the counters and
    /// the readers told once it is on disk.
    fn write(
        &mut self,
        mut batch: WriteBatch,
        next: State,
        tally: Tally,
        fetched: Option<String>,
    ) -> Result<()> {
        debug_assert_eq!(
            self.state.violation(&next),
            None,
            "a batch of {} breaks an invariant of its state: {:?} after {:?}",
            self.ks.path.display(),
            next,
            self.state
        );
        let window = self.window.update(&mut batch, &next, fetched);
        // The state is the batch's last write: the checkpoint goes to disk with the data
        // it covers, never in a batch of its own.
        batch.put(STATE_KEY.to_vec(), record::encode(&next));
        let ops = batch.len();
        let bytes = batch.bytes();
        // Readers must not keep (or re-insert) cached versions of what this batch changes.
        self.cache
            .begin_write(batch.keys().filter(|k| k.first() == Some(&OBJECT)));
        let began = std::time::Instant::now();
        let applied = self.ks.backend.apply(batch);
        let took = began.elapsed();
        self.cache.end_write();
        applied?;
        self.stats.writes.commit_seconds.observe(took.as_secs_f64());
        self.stats.writes.batch_bytes.observe(bytes as f64);
        Counters::add(&self.stats.objects_written, tally.written);
        Counters::add(&self.stats.objects_unchanged, tally.unchanged);
        Counters::add(&self.stats.objects_deleted, tally.deleted);
        Counters::add(&self.stats.stale_events_skipped, tally.stale);
        Counters::add(&self.stats.batches, 1);
        tracing::trace!(ops, phase = ?next.phase, "batch committed");
        self.last_tally = tally;
        self.window = window;
        self.state = next;
        self.publish();
        Ok(())
    }

    /// Tell readers about the current state.
    pub(crate) fn publish(&self) {
        self.status.committed(&self.state, self.pruning);
    }
}
