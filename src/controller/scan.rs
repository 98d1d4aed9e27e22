//! Passes: reading what to reconcile from disk, one chunk at a time.
//!
//! A pass walks the stored objects' keys as a circle: the keys after its start, then,
//! wrapping, those up to it. Each chunk is read by one job on tokio's blocking pool that
//! returns its thread when the chunk is read (a pass never holds a blocking thread while
//! the runner dispatches: with a small blocking pool, the pass, the dispatch and an object
//! read would wait on each other). The runner asks for the next chunk only once half of
//! the previous one has started, so a pass never holds more than about three chunks,
//! whatever the size of the collection.
//!
//! - [`PassMode::Every`]: every stored object (a `reconcile_all_on` tick, a lag of a related
//!   kind, the start of a controller without durable state).
//! - [`PassMode::Changed`] and [`PassMode::DueOnly`]: a durable controller's merge of the
//!   objects (key order) with their reconcile records (same order): objects never
//!   reconciled or changed since (a resourceVersion other than the one last handled) now,
//!   requeues due before `loaded_until` at their due time (now if past), and the records
//!   of objects that no longer exist forgotten. [`PassMode::All`] reconciles every object
//!   in that merge ([`StartupMode::ReconcileAll`](super::StartupMode::ReconcileAll)).
//!
//! A pass's [`Position`] is what a durable controller records after each reconcile (see
//! `runner/progress.rs`): a restart resumes the circle there, so the objects a pass has not
//! reached yet, which have waited longest, come first.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::FutureExt;
use kube::Resource;
use kube::runtime::controller::ReconcileReason;
use kube::runtime::reflector::ObjectRef;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;

use super::controller_stats::ControllerStats;
use super::owed;
use crate::controller::keyspace::{ControllerKeyspace, ReconcileRecord};
use crate::store::{Reader, StoredHead};

/// Reason of a startup-pass reconcile of an object changed (or never reconciled).
pub(crate) const CHANGED: &str = "changed since its last reconcile (startup pass)";
/// Why the startup pass of [`StartupMode::ReconcileAll`](super::StartupMode::ReconcileAll)
/// reconciles an object: every one, never skipped as already reconciled.
pub(crate) const ALL: &str = "every stored object on start (startup pass)";
/// Reason of a requeue read back from disk.
pub(crate) const DUE: &str = "requeue due (durable state)";

/// What a pass reconciles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub(crate) enum PassMode {
    /// Nothing but due requeues (`StartupMode::Nothing` on a warm restart).
    DueOnly,
    /// Objects changed or never reconciled, and due requeues.
    Changed,
    /// Every object, in the merge with the records (`StartupMode::ReconcileAll`).
    All,
    /// Every object, from the store alone (no records read).
    Every,
}

/// Where a pass is in its circle: the last key it visited (`None`: none yet) and whether it
/// has wrapped past the end of the key space.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Position {
    pub(crate) after: Option<Vec<u8>>,
    pub(crate) wrapped: bool,
}

impl Position {
    /// Whether `self` is `other` or further along the circle: a lap before wrapping, then
    /// the keys from the first one up to the start (no key, `None`, comes first in each).
    pub(crate) fn at_or_after(&self, other: &Position) -> bool {
        (self.wrapped, self.after.as_deref()) >= (other.wrapped, other.after.as_deref())
    }
}

/// A pass as a durable controller records it (`controller/<name>` keyspace, `mpass-*`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct PassRecord {
    pub(crate) mode: PassMode,
    /// Where the circle began: it ends after the key `start` (the whole key space if none).
    pub(crate) start: Option<Vec<u8>>,
    /// Every key of the circle up to here was handled.
    pub(crate) done: Position,
    /// The pass has not ended.
    pub(crate) active: bool,
    /// One more pass is owed after this one (ticks that came while it ran).
    pub(crate) again: bool,
}

impl PassRecord {
    /// A new pass of `mode` over the circle that starts after `start`.
    pub(crate) fn new(mode: PassMode, start: Option<Vec<u8>>) -> Self {
        PassRecord {
            mode,
            done: Position {
                after: start.clone(),
                wrapped: false,
            },
            start,
            active: true,
            again: false,
        }
    }
}

/// One thing a pass asks of the runner.
pub(crate) enum Plan<K: Resource> {
    /// Reconcile `obj_ref`, now (`at_ms: None`) or when this wall-clock time comes. `at`:
    /// its place in the pass.
    Reconcile {
        obj_ref: ObjectRef<K>,
        reason: ReconcileReason,
        at_ms: Option<u64>,
        at: Position,
    },
    /// Forget the reconcile record of an object that no longer exists, if the record is
    /// still `seen` when the forget is written.
    Forget {
        suffix: Vec<u8>,
        seen: ReconcileRecord,
    },
}

/// One chunk of a pass: its plans, how far it read, and whether the circle is complete.
pub(crate) struct Chunk<K: Resource> {
    pub(crate) plans: Vec<Plan<K>>,
    pub(crate) through: Position,
    pub(crate) end: bool,
}

/// Options of a merge pass.
pub(crate) struct MergeOptions<K> {
    /// Requeues due before this (unix ms) are scheduled; later ones (and all, with `0`)
    /// stay on disk.
    pub(crate) loaded_until: u64,
    /// Skip objects whose predicate value equals the last successful reconcile's
    /// ([`Controller::predicate_filter`](super::Controller::predicate_filter)).
    pub(crate) predicate: Option<super::predicate::PredicateFn<K>>,
}

/// The namespace (`None` for cluster-scoped objects) and name of a key suffix
/// (`namespace \0 name`).
fn suffix_parts(suffix: &[u8]) -> (Option<Cow<'_, str>>, Cow<'_, str>) {
    let (ns, name) = crate::disk::keys::split_suffix(suffix);
    ((!ns.is_empty()).then_some(ns), name)
}

/// The reference of a key suffix (`namespace \0 name`).
pub(crate) fn suffix_ref<K: Resource>(suffix: &[u8], dyntype: K::DynamicType) -> ObjectRef<K> {
    let (ns, name) = suffix_parts(suffix);
    let r = ObjectRef::new_with(&name, dyntype);
    match ns {
        Some(ns) => r.within(&ns),
        None => r,
    }
}

/// The read of one chunk, on the blocking pool: the walk comes back with the chunk.
type Reading<K> = JoinHandle<(Box<Walk<K>>, crate::model::Result<Chunk<K>>)>;

/// A running pass; dropping it stops it after the chunk being read, if any.
pub(crate) struct Pass<K: Resource> {
    walk: Option<Box<Walk<K>>>,
    reading: Option<Reading<K>>,
}

impl<K> Pass<K>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Clone + Send + 'static,
{
    /// A pass as `record` says (from where it is done), over `reader`'s objects (and, but
    /// for [`PassMode::Every`], `ks`'s records), reading `chunk` keys at a time.
    pub(crate) fn new(
        reader: Reader<K>,
        ks: Option<Arc<ControllerKeyspace>>,
        dyntype: K::DynamicType,
        chunk: usize,
        record: &PassRecord,
        options: MergeOptions<K>,
        stats: ControllerStats,
    ) -> Self {
        let walk = Walk {
            reader,
            ks: ks.filter(|_| record.mode != PassMode::Every),
            dyntype,
            chunk: chunk.max(1),
            mode: record.mode,
            options,
            now: super::state::now_ms(),
            start: record.start.clone(),
            objects: Paged::new(record.done.after.clone()),
            records: Paged::new(record.done.after.clone()),
            wrapped: record.done.wrapped,
            counts: Counts::default(),
            stats,
        };
        Pass {
            walk: Some(Box::new(walk)),
            reading: None,
        }
    }

    /// The next chunk (read on the blocking pool); `Ready(None)` once the circle is done.
    /// After an error the pass ends: what it did not reach is owed by the next one.
    pub(crate) fn poll_chunk(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<crate::model::Result<Chunk<K>>>> {
        if self.reading.is_none() {
            let Some(mut walk) = self.walk.take() else {
                return Poll::Ready(None);
            };
            self.reading = Some(tokio::task::spawn_blocking(move || {
                let chunk = walk.next_chunk();
                (walk, chunk)
            }));
        }
        let reading = self.reading.as_mut().expect("set above");
        let done = futures::ready!(reading.poll_unpin(cx));
        self.reading = None;
        let (walk, chunk) = match done {
            Ok(done) => done,
            Err(e) => {
                return Poll::Ready(Some(Err(crate::model::Error::Storage {
                    path: Default::default(),
                    detail: format!("a pass's read task failed: {e}"),
                })));
            }
        };
        if let Ok(chunk) = &chunk {
            if chunk.end {
                walk.finished();
            } else {
                self.walk = Some(walk);
            }
        }
        Poll::Ready(Some(chunk))
    }
}

/// A paged, ordered source of (suffix, value) within one lap of the circle.
struct Paged<T> {
    buf: VecDeque<(Vec<u8>, T)>,
    cursor: Option<Vec<u8>>,
    done: bool,
}

impl<T> Paged<T> {
    fn new(cursor: Option<Vec<u8>>) -> Self {
        Paged {
            buf: VecDeque::new(),
            cursor,
            done: false,
        }
    }

    /// The next entry, reading a page of `chunk` after the cursor if none is buffered;
    /// entries past `upto` end the lap.
    fn peek(
        &mut self,
        chunk: usize,
        upto: Option<&[u8]>,
        read: impl Fn(Option<&[u8]>, usize) -> crate::model::Result<Vec<(Vec<u8>, T)>>,
    ) -> crate::model::Result<Option<&(Vec<u8>, T)>> {
        if self.buf.is_empty() && !self.done {
            let mut page = read(self.cursor.as_deref(), chunk)?;
            self.done = page.len() < chunk;
            if let Some((last, _)) = page.last() {
                self.cursor = Some(last.clone());
            }
            if let Some(upto) = upto
                && let Some(past) = page.iter().position(|(k, _)| k.as_slice() > upto)
            {
                page.truncate(past);
                self.done = true;
            }
            self.buf.extend(page);
        }
        Ok(self.buf.front())
    }
}

/// What a pass did, for its log line.
#[derive(Default)]
struct Counts {
    objects: u64,
    now: u64,
    later: u64,
    forgotten: u64,
}

/// A pass walking its circle: its state between chunks.
struct Walk<K: Resource> {
    reader: Reader<K>,
    /// The reconcile records, for a merge (`None`: every object, no records).
    ks: Option<Arc<ControllerKeyspace>>,
    dyntype: K::DynamicType,
    chunk: usize,
    mode: PassMode,
    options: MergeOptions<K>,
    now: u64,
    start: Option<Vec<u8>>,
    objects: Paged<StoredHead>,
    records: Paged<ReconcileRecord>,
    wrapped: bool,
    counts: Counts,
    /// The controller's counters: objects read, as they are.
    stats: ControllerStats,
}

impl<K> Walk<K>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Clone,
{
    fn finished(&self) {
        let c = &self.counts;
        tracing::info!(mode = ?self.mode, objects = c.objects, reconcile_now = c.now,
            requeues_scheduled = c.later, forgotten = c.forgotten, "pass done");
    }

    /// Where the pass is: after the last key taken from either source.
    fn position(&self, last: Option<Vec<u8>>) -> Position {
        Position {
            after: last,
            wrapped: self.wrapped,
        }
    }

    /// The last chunk of the circle: through its end, the start once wrapped (a circle
    /// that starts at the first key wraps at its end too). A pass recorded there, under way
    /// because the controller stopped before it ended, ends at once when resumed.
    fn end(&mut self, plans: Vec<Plan<K>>) -> Chunk<K> {
        self.wrapped = true;
        Chunk {
            plans,
            through: self.position(self.start.clone()),
            end: true,
        }
    }

    /// Reads the next chunk: at most `chunk` plans, and at most `chunk` keys of each source.
    fn next_chunk(&mut self) -> crate::model::Result<Chunk<K>> {
        if self.wrapped && self.start.is_none() {
            // A circle from the first key, recorded at its end.
            return Ok(self.end(Vec::new()));
        }
        let mut plans = Vec::new();
        let mut last = None;
        let (reader, ks) = (self.reader.clone(), self.ks.clone());
        // The lap ends after `start` once wrapped (the whole key space if there is none).
        let upto = if self.wrapped {
            self.start.clone()
        } else {
            None
        };
        for _ in 0..self.chunk {
            let obj = self
                .objects
                .peek(self.chunk, upto.as_deref(), |c, n| {
                    reader.versions_after(c, n)
                })?
                .map(|(s, _)| s.clone());
            let rec = match ks.as_ref() {
                Some(ks) => self
                    .records
                    .peek(self.chunk, upto.as_deref(), |c, n| ks.records_after(c, n))?
                    .map(|(s, _)| s.clone()),
                None => None,
            };
            let plan = match (obj, rec) {
                (None, None) => {
                    if self.wrapped || self.start.is_none() {
                        return Ok(self.end(plans));
                    }
                    // Wrap: the keys up to the start, from the first one.
                    self.wrapped = true;
                    self.objects = Paged::new(None);
                    self.records = Paged::new(None);
                    return Ok(Chunk {
                        plans,
                        through: self.position(None),
                        end: false,
                    });
                }
                (Some(o), Some(r)) if o == r => {
                    let (suffix, head) = self.objects.buf.pop_front().expect("peeked");
                    let (_, rec) = self.records.buf.pop_front().expect("peeked");
                    let plan = self.decide(&suffix, &head, Some(&rec));
                    last = Some(suffix);
                    plan
                }
                (Some(o), r) if r.as_ref().is_none_or(|r| o < *r) => {
                    let (suffix, head) = self.objects.buf.pop_front().expect("peeked");
                    let plan = self.decide(&suffix, &head, None);
                    last = Some(suffix);
                    plan
                }
                _ => {
                    let (suffix, seen) = self.records.buf.pop_front().expect("peeked");
                    let plan = self.forget(&suffix, seen)?;
                    last = Some(suffix);
                    plan
                }
            };
            plans.extend(plan);
        }
        Ok(Chunk {
            plans,
            through: self.position(last),
            end: false,
        })
    }

    /// A record with no object at its place in the merge. Objects and records are paged
    /// separately, so an object created (and reconciled) after the object pages passed its
    /// key has a record and no object in them: the store is read again before forgetting,
    /// and the forget is written only if the record is still the one read here (the object
    /// may come back before the forget is written, and record a new reconcile).
    fn forget(
        &mut self,
        suffix: &[u8],
        seen: ReconcileRecord,
    ) -> crate::model::Result<Option<Plan<K>>> {
        let (ns, name) = suffix_parts(suffix);
        if self
            .reader
            .stored_resource_version(ns.as_deref(), &name)?
            .is_some()
        {
            tracing::trace!(object = %name, "record of an object stored during the pass kept");
            return Ok(None);
        }
        self.counts.forgotten += 1;
        Ok(Some(Plan::Forget {
            suffix: suffix.to_vec(),
            seen,
        }))
    }

    /// What to do with one stored object and its record.
    fn decide(
        &mut self,
        suffix: &[u8],
        head: &StoredHead,
        rec: Option<&ReconcileRecord>,
    ) -> Option<Plan<K>> {
        self.counts.objects += 1;
        // `startup_pass_read` counts the merge's reads, as before the ticks' pass read here.
        if self.mode != PassMode::Every {
            self.stats.pass_read(1);
        }
        let obj_ref = suffix_ref::<K>(suffix, self.dyntype.clone());
        let at = self.position(Some(suffix.to_vec()));
        let reason = match self.mode {
            PassMode::Every => Some(ReconcileReason::BulkReconcile),
            PassMode::All => Some(custom(ALL)),
            PassMode::Changed
                if rec.is_none_or(|rec| {
                    !owed::handled(
                        rec,
                        Some(&head.uid),
                        Some(&head.resource_version),
                        self.options.predicate.is_some(),
                        || self.value_of(suffix),
                    )
                }) =>
            {
                Some(custom(CHANGED))
            }
            PassMode::Changed | PassMode::DueOnly => None,
        };
        if let Some(reason) = reason {
            self.counts.now += 1;
            return Some(Plan::Reconcile {
                obj_ref,
                reason,
                at_ms: None,
                at,
            });
        }
        let due = rec.and_then(|r| r.due_ms)?;
        if due >= self.options.loaded_until {
            return None; // read from disk when it comes near
        }
        if due <= self.now {
            self.counts.now += 1;
        } else {
            self.counts.later += 1;
        }
        Some(Plan::Reconcile {
            obj_ref,
            reason: custom(DUE),
            at_ms: Some(due),
            at,
        })
    }

    /// The predicate's value of the stored object (`None` if it has none or cannot be
    /// read: then it counts as changed).
    fn value_of(&self, suffix: &[u8]) -> Option<u64> {
        let predicate = self.options.predicate.as_ref()?;
        let (ns, name) = suffix_parts(suffix);
        match self.reader.get_named(ns.as_deref(), &name) {
            Ok(Some(obj)) => predicate(&obj),
            _ => None,
        }
    }
}

fn custom(reason: &str) -> ReconcileReason {
    ReconcileReason::Custom {
        reason: reason.to_string(),
    }
}
