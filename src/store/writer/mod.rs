//! The single writer of one stream: turns list pages, watch bursts and sweeps into
//! atomic batches that always carry the new [`State`] (the checkpoint) with the data.

mod batch;
mod index;
mod prune;
mod sweep;
pub(crate) use index::IndexEntries;

use std::path::PathBuf;
use std::sync::Arc;

use super::StatusTx;
use super::cache::HotCache;
use crate::disk::Cipher;
use crate::disk::keys::{self, OBJECT, STATE_KEY};
use crate::disk::record::{self, Record};
use crate::disk::{Backend, WriteBatch};
use crate::model::Counters;
use crate::model::{Error, Result};
use crate::store::{Compression, StreamLease};
use crate::store::{Phase, State};

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
    /// are being replayed (see [`Writer::fetched_through`]).
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

pub(crate) struct Writer {
    backend: Arc<dyn Backend>,
    path: PathBuf,
    state: State,
    status: StatusTx,
    stats: Arc<Counters>,
    cache: Arc<HotCache>,
    cipher: Option<Arc<Cipher>>,
    /// Whether index entries are maintained (some index is configured).
    indexed: bool,
    /// How bodies are compressed.
    compress: Compression,
    /// Keys-only mode: no bodies stored; (apiVersion, kind) to describe swept objects.
    keys_only: Option<(String, String)>,
    /// What the last committed batch did (a delta relist's choice of its next page).
    last_tally: Tally,
    /// The highest resourceVersion a delta relist's fetches answered at, while the watch
    /// has not replayed past it (`keys::FETCHED_KEY`, read when the stream is opened): the
    /// store may hold bodies newer than its checkpoint, and the watch skips replayed events
    /// older than the stored versions only while this is set.
    fetched_through: Option<String>,
    /// A narrowed shard's prune is pending: the store holds objects it no longer owns and
    /// is not reported ready until the prune completes.
    pruning: bool,
    /// The keyspace's lease: released when the last holder of this writer (the watcher,
    /// or a job it queued on the disk thread) is gone.
    _lease: StreamLease,
}

impl Writer {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        backend: Arc<dyn Backend>,
        path: PathBuf,
        state: State,
        status: StatusTx,
        stats: Arc<Counters>,
        cache: Arc<HotCache>,
        cipher: Option<Arc<Cipher>>,
        lease: StreamLease,
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
            compress: Compression::Lz4,
            keys_only: None,
            pruning: false,
            fetched_through: None,
            last_tally: Tally::default(),
            _lease: lease,
        }
    }

    /// Whether a prune is pending (read from disk when the stream is opened).
    pub(crate) fn set_pruning(&mut self, pruning: bool) {
        self.pruning = pruning;
    }

    /// The delta relist window read from disk when the stream is opened (see
    /// [`Writer::fetched_through`]).
    pub(crate) fn set_fetched_through(&mut self, fetched_through: Option<String>) {
        self.fetched_through = fetched_through;
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
        let sweep = self.state.count > 0 || self.holds_objects()?;
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

    /// Whether any object record is stored.
    fn holds_objects(&self) -> Result<bool> {
        let (start, end) = keys::range(OBJECT, None);
        Ok(self
            .backend
            .range(&start, &end)
            .next()
            .transpose()?
            .is_some())
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
    /// high of the delta relist window ([`Writer::fetched_through`]) to keep with them.
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
        self.commit_window(ops, next, emit, fetched)
    }

    /// Write one page of a delta relist in one atomic batch: `seen`, the objects of a
    /// metadata-only page whose stored version is current (marked), and `fetched`, the
    /// bodies fetched for the others (written whatever is stored: the server's current
    /// state is authoritative, as in a full list).
    ///
    /// `answered_at`: the highest resourceVersion the page's fetches were answered at (their
    /// bodies are no newer), kept with the page as the relist's window
    /// ([`Writer::fetched_through`]).
    pub(crate) fn delta_page(
        &mut self,
        seen: Vec<(Vec<u8>, String)>,
        fetched: Vec<Incoming>,
        mut answered_at: Option<String>,
        progress: ListProgress,
        emit: bool,
    ) -> Result<Vec<Change>> {
        if let Some(at) = &answered_at {
            let newer = self.fetched_through.as_deref().is_none_or(|high| {
                !matches!(
                    crate::model::resource_version::compare(at, high),
                    Ok(std::cmp::Ordering::Less | std::cmp::Ordering::Equal)
                )
            });
            if !newer {
                answered_at = None;
            }
        }
        let mut ops: Vec<Op> = seen
            .into_iter()
            .map(|(suffix, resource_version)| Op::Seen {
                suffix,
                resource_version,
            })
            .collect();
        ops.extend(fetched.into_iter().map(Op::Put));
        self.list_ops(ops, progress, emit, answered_at)
    }

    /// The stored resourceVersion of each object of `suffixes` (`None`: not stored), read
    /// from the records' heads in one pass.
    pub(crate) fn stored_versions(&self, suffixes: &[Vec<u8>]) -> Result<Vec<Option<String>>> {
        let keys: Vec<Vec<u8>> = suffixes.iter().map(|s| keys::tagged(OBJECT, s)).collect();
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        let mut out = vec![None; keys.len()];
        self.backend.get_each(&refs, &mut |i, value| {
            let r =
                record::decode_head(value).map_err(|d| record::corrupt(&self.path, &keys[i], d))?;
            out[i] = Some(r.resource_version);
            Ok(())
        })?;
        Ok(out)
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

    fn decode_record(&self, key: &[u8], value: &[u8]) -> Result<Record> {
        record::decode(value).map_err(|d| record::corrupt(&self.path, key, d))
    }

    fn write(
        &mut self,
        mut batch: WriteBatch,
        next: State,
        tally: Tally,
        window: Option<String>,
    ) -> Result<()> {
        debug_assert_eq!(
            self.state.violation(&next),
            None,
            "a batch of {} breaks an invariant of its state: {:?} after {:?}",
            self.path.display(),
            next,
            self.state
        );
        // The state is the batch's last write: the checkpoint goes to disk with the data
        // it covers, never in a batch of its own.
        batch.put(STATE_KEY.to_vec(), record::encode(&next));
        let ops = batch.len();
        // Readers must not keep (or re-insert) cached versions of what this batch changes.
        self.cache
            .begin_write(batch.keys().filter(|k| k.first() == Some(&OBJECT)));
        let applied = self.backend.apply(batch);
        self.cache.end_write();
        applied?;
        Counters::add(&self.stats.objects_written, tally.written);
        Counters::add(&self.stats.objects_unchanged, tally.unchanged);
        Counters::add(&self.stats.objects_deleted, tally.deleted);
        Counters::add(&self.stats.stale_events_skipped, tally.stale);
        Counters::add(&self.stats.batches, 1);
        tracing::trace!(ops, phase = ?next.phase, "batch committed");
        self.last_tally = tally;
        self.fetched_through = window;
        self.state = next;
        self.publish();
        Ok(())
    }

    /// Tell readers about the current state.
    pub(crate) fn publish(&self) {
        self.status.committed(&self.state, self.pruning);
    }
}
