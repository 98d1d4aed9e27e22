//! Passes: reading what to reconcile from disk, chunk by chunk.
//!
//! A blocking task reads the store (and, for a durable controller, its reconcile state)
//! and hands chunks of [`Plan`]s to the runner over a channel of capacity one. The runner
//! takes the next chunk only once half of the previous one has started, so a pass never
//! holds more than about three chunks, whatever the size of the collection.
//!
//! - [`Pass::all`]: every stored object, now (cold start, `reconcile_all_on`, and warm
//!   restarts without durable state).
//! - [`Pass::startup`]: the startup pass of a durable controller, a merge of the objects
//!   (key order) with their reconcile records (same order): objects never reconciled or
//!   changed since (a resourceVersion other than the one last handled) now, requeues due
//!   before `loaded_until` at their due time (now if past), and the records of objects
//!   that no longer exist forgotten.

use std::borrow::Cow;
use std::sync::Arc;
use std::task::{Context, Poll};

use kube::Resource;
use kube::runtime::controller::ReconcileReason;
use kube::runtime::reflector::ObjectRef;
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

use super::controller_stats::ControllerStats;
use super::owed;
use super::triggers::bare_ref;
use crate::controller::keyspace::{ControllerKeyspace, ReconcileRecord};
use crate::store::Reader;

/// Reason of a startup-pass reconcile of an object changed (or never reconciled).
pub(crate) const CHANGED: &str = "changed since its last reconcile (startup pass)";
/// Why the startup pass of [`StartupMode::ReconcileAll`](super::StartupMode::ReconcileAll)
/// reconciles an object: every one, never skipped as already reconciled.
pub(crate) const ALL: &str = "every stored object on start (startup pass)";
/// Reason of a requeue read back from disk.
pub(crate) const DUE: &str = "requeue due (durable state)";

/// One thing a pass asks of the runner.
pub(crate) enum Plan<K: Resource> {
    /// Reconcile `obj_ref`, now (`at_ms: None`) or when this wall-clock time comes.
    Reconcile {
        obj_ref: ObjectRef<K>,
        reason: ReconcileReason,
        at_ms: Option<u64>,
    },
    /// Forget the reconcile record of an object that no longer exists, if the record is
    /// still `seen` when the forget is written.
    Forget {
        suffix: Vec<u8>,
        seen: ReconcileRecord,
    },
}

/// A chunk of plans, or a read error (the pass goes on, or ends after a state error).
pub(crate) type Chunk<K> = crate::model::Result<Vec<Plan<K>>>;

/// What the startup pass reconciles besides due requeues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PassMode {
    /// Every object (`StartupMode::ReconcileAll`).
    All,
    /// Objects changed or never reconciled.
    Changed,
    /// Nothing but due requeues (`StartupMode::Nothing` on a warm restart).
    DueOnly,
}

/// Options of a startup pass.
pub(crate) struct StartupOptions {
    pub(crate) mode: PassMode,
    /// Requeues due before this (unix ms) are scheduled; later ones stay on disk.
    pub(crate) loaded_until: u64,
    /// Skip objects whose `metadata.generation` equals the last successful one's.
    pub(crate) generation_filter: bool,
}

/// A running pass; dropping it stops the reading task.
pub(crate) struct Pass<K: Resource> {
    rx: mpsc::Receiver<Chunk<K>>,
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

impl<K> Pass<K>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Clone + Send + 'static,
{
    /// Start reading every object of `reader`, in chunks of `chunk` references.
    pub(crate) fn all(reader: Reader<K>, dyntype: K::DynamicType, chunk: usize) -> Self {
        let (tx, rx) = mpsc::channel(1);
        tokio::task::spawn_blocking(move || {
            let mut buf = Vec::with_capacity(chunk);
            let mut total = 0usize;
            for item in reader.iter() {
                let sent = match item {
                    Ok(obj) => {
                        buf.push(Plan::Reconcile {
                            obj_ref: bare_ref(&*obj, dyntype.clone()),
                            reason: ReconcileReason::BulkReconcile,
                            at_ms: None,
                        });
                        total += 1;
                        if buf.len() < chunk {
                            continue;
                        }
                        tx.blocking_send(Ok(std::mem::replace(&mut buf, Vec::with_capacity(chunk))))
                    }
                    Err(e) => tx.blocking_send(Err(e)),
                };
                if sent.is_err() {
                    tracing::debug!(
                        total,
                        "pass abandoned (controller stopped or a new pass began)"
                    );
                    return;
                }
            }
            if !buf.is_empty() {
                let _ = tx.blocking_send(Ok(buf));
            }
            tracing::debug!(total, "pass read every stored object");
        });
        Pass { rx }
    }

    /// Start the startup pass of a durable controller over `reader`'s objects and `ks`'s
    /// records, reading `chunk` of each at a time.
    pub(crate) fn startup(
        reader: Reader<K>,
        ks: Arc<ControllerKeyspace>,
        dyntype: K::DynamicType,
        chunk: usize,
        options: StartupOptions,
        stats: ControllerStats,
    ) -> Self {
        let (tx, rx) = mpsc::channel(1);
        tokio::task::spawn_blocking(move || {
            let mut merge = Merge {
                reader,
                ks,
                dyntype,
                chunk,
                options,
                now: super::state::now_ms(),
                counts: [0; 4],
                stats,
            };
            if let Err(e) = merge.run(&tx) {
                let _ = tx.blocking_send(Err(e));
            }
            let [now, later, forgotten, objects] = merge.counts;
            tracing::info!(
                objects,
                reconcile_now = now,
                requeues_scheduled = later,
                forgotten,
                "startup pass over the reconcile state done"
            );
        });
        Pass { rx }
    }

    /// The next chunk; `Ready(None)` once the whole store was read.
    pub(crate) fn poll_chunk(&mut self, cx: &mut Context<'_>) -> Poll<Option<Chunk<K>>> {
        self.rx.poll_recv(cx)
    }
}

/// The merge of objects and records behind [`Pass::startup`].
struct Merge<K: Resource> {
    reader: Reader<K>,
    ks: Arc<ControllerKeyspace>,
    dyntype: K::DynamicType,
    chunk: usize,
    options: StartupOptions,
    now: u64,
    /// Reconciles now, requeues scheduled later, records forgotten, objects read.
    counts: [u64; 4],
    /// The controller's counters: objects read, as they are.
    stats: ControllerStats,
}

/// A paged, ordered source of (suffix, value).
struct Paged<T> {
    buf: std::collections::VecDeque<(Vec<u8>, T)>,
    cursor: Option<Vec<u8>>,
    done: bool,
}

impl<T> Paged<T> {
    fn new() -> Self {
        Paged {
            buf: Default::default(),
            cursor: None,
            done: false,
        }
    }

    fn peek(
        &mut self,
        chunk: usize,
        read: impl Fn(Option<&[u8]>, usize) -> crate::model::Result<Vec<(Vec<u8>, T)>>,
    ) -> crate::model::Result<Option<&(Vec<u8>, T)>> {
        if self.buf.is_empty() && !self.done {
            let page = read(self.cursor.as_deref(), chunk)?;
            self.done = page.len() < chunk;
            if let Some((last, _)) = page.last() {
                self.cursor = Some(last.clone());
            }
            self.buf.extend(page);
        }
        Ok(self.buf.front())
    }
}

impl<K> Merge<K>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Clone,
{
    fn run(&mut self, tx: &mpsc::Sender<Chunk<K>>) -> crate::model::Result<()> {
        let mut objects = Paged::<String>::new();
        let mut records = Paged::<ReconcileRecord>::new();
        let mut out = Vec::with_capacity(self.chunk);
        let (reader, ks) = (self.reader.clone(), self.ks.clone());
        loop {
            let obj = objects
                .peek(self.chunk, |c, n| reader.versions_after(c, n))?
                .map(|(s, _)| s.clone());
            let rec = records
                .peek(self.chunk, |c, n| ks.records_after(c, n))?
                .map(|(s, _)| s.clone());
            let plan = match (obj, rec) {
                (None, None) => break,
                (Some(o), Some(r)) if o == r => {
                    let (suffix, rv) = objects.buf.pop_front().expect("peeked");
                    let (_, rec) = records.buf.pop_front().expect("peeked");
                    self.counts[3] += 1;
                    self.stats.pass_read(1);
                    self.decide(&suffix, &rv, Some(&rec))
                }
                (Some(o), r) if r.as_ref().is_none_or(|r| o < *r) => {
                    let (suffix, rv) = objects.buf.pop_front().expect("peeked");
                    self.counts[3] += 1;
                    self.stats.pass_read(1);
                    self.decide(&suffix, &rv, None)
                }
                _ => {
                    let (suffix, seen) = records.buf.pop_front().expect("peeked");
                    self.forget(suffix, seen)?
                }
            };
            if let Some(plan) = plan {
                out.push(plan);
                if out.len() >= self.chunk {
                    let full = std::mem::replace(&mut out, Vec::with_capacity(self.chunk));
                    if tx.blocking_send(Ok(full)).is_err() {
                        return Ok(()); // the controller stopped
                    }
                }
            }
        }
        if !out.is_empty() {
            let _ = tx.blocking_send(Ok(out));
        }
        Ok(())
    }

    /// A record with no object at its place in the merge. Objects and records are paged
    /// separately, so an object created (and reconciled) after the object pages passed its
    /// key has a record and no object in them: the store is read again before forgetting,
    /// and the forget is written only if the record is still the one read here (the object
    /// may come back before the forget is written, and record a new reconcile).
    fn forget(
        &mut self,
        suffix: Vec<u8>,
        seen: ReconcileRecord,
    ) -> crate::model::Result<Option<Plan<K>>> {
        let (ns, name) = suffix_parts(&suffix);
        if self
            .reader
            .stored_resource_version(ns.as_deref(), &name)?
            .is_some()
        {
            tracing::trace!(object = %name, "record of an object stored during the startup pass kept");
            return Ok(None);
        }
        self.counts[2] += 1;
        Ok(Some(Plan::Forget { suffix, seen }))
    }

    /// What to do with one stored object and its record.
    fn decide(
        &mut self,
        suffix: &[u8],
        rv: &str,
        rec: Option<&ReconcileRecord>,
    ) -> Option<Plan<K>> {
        let obj_ref = suffix_ref::<K>(suffix, self.dyntype.clone());
        let now = |reason: &str| {
            Some(Plan::Reconcile {
                obj_ref: obj_ref.clone(),
                reason: ReconcileReason::Custom {
                    reason: reason.to_string(),
                },
                at_ms: None,
            })
        };
        let changed = match rec {
            None => true,
            Some(rec) => !owed::handled(rec, Some(rv), self.options.generation_filter, || {
                self.generation_of(suffix)
            }),
        };
        if self.options.mode == PassMode::All {
            self.counts[0] += 1;
            return now(ALL);
        }
        if changed && self.options.mode == PassMode::Changed {
            self.counts[0] += 1;
            return now(CHANGED);
        }
        let due = rec.and_then(|r| r.due_ms)?;
        if due >= self.options.loaded_until {
            return None; // read from disk when it comes near
        }
        if due <= self.now {
            self.counts[0] += 1;
        } else {
            self.counts[1] += 1;
        }
        Some(Plan::Reconcile {
            obj_ref,
            reason: ReconcileReason::Custom {
                reason: DUE.to_string(),
            },
            at_ms: Some(due),
        })
    }

    /// The stored object's `metadata.generation` (`None` if it has none or cannot be read:
    /// then it counts as changed).
    fn generation_of(&self, suffix: &[u8]) -> Option<i64> {
        let (ns, name) = suffix_parts(suffix);
        match self.reader.get_named(ns.as_deref(), &name) {
            Ok(Some(obj)) => obj.meta().generation,
            _ => None,
        }
    }
}
