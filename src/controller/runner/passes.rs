//! The runner's passes, each in a [`Slot`]:
//!
//! - the ticks' pass over every stored object (`reconcile_all_on`, a lag of a related kind,
//!   the start of a controller without durable state);
//! - the merge pass of a durable controller (its startup pass, which waits until the main
//!   store has caught up, and the pass after a lag of its main subscriber): the objects it
//!   finds changed (every object with `StartupMode::ReconcileAll`) are pass work too, in its
//!   order, before the ticks' pass; the requeues it finds due wait with the changes.
//!
//! Pass work gets its share of the concurrency after changes (`queue.rs`). A durable
//! controller records each pass's position (`progress.rs`) and its owed ticks:
//! a restart resumes the ticks' pass where it stopped, and starts the merge where the last
//! one stopped, so what has waited longest comes first whatever the rhythm of restarts.

use std::collections::VecDeque;
use std::task::{Context, Poll};

use futures::FutureExt;
use kube::Resource;
use kube::runtime::controller::{ReconcileReason, ReconcileRequest};
use kube::runtime::reflector::ObjectRef;
use serde::de::DeserializeOwned;
use tokio::time::Instant;

use super::super::StartupMode;
use super::super::controller_error::ControllerError;
use super::super::controller_stats::{ControllerStats, Waiting};
use super::super::scan::{MergeOptions, Pass, PassMode, PassRecord, Plan};
use super::super::state::{instant_at, now_ms};
use super::Runner;
use super::progress::Progress;
use crate::controller::keyspace::{MERGE_PASS_KEY, StateOp, TICKS_PASS_KEY};

/// One pass under way and what it still owes.
pub(super) struct Slot<K: Resource> {
    /// Where a durable controller records it.
    key: &'static [u8],
    record: PassRecord,
    /// `None` once it read its whole circle (or stops).
    pass: Option<Pass<K>>,
    pub(super) progress: Progress<ObjectRef<K>>,
    /// Pass work not dispatched yet, in pass order.
    work: Work<K>,
    /// Pass work whose object was being reconciled when its turn came (by a request that
    /// came before the pass asked): it goes back to the front of `work` when that
    /// reconcile ends, so that a hot object is reconciled for the pass too, not put off by
    /// the debounce its changes keep pushing. At most one per running reconcile.
    parked: Vec<(ObjectRef<K>, ReconcileReason)>,
}

/// Most chunks of entries a pass keeps owed: beyond that it reads no further chunk until
/// the oldest are done, so that its bookkeeping (and the reconciles a crash repeats) is
/// bounded by chunks, not by the pass, behind a reconcile that runs long.
const CHUNKS_OWED: usize = 4;

/// Pass work read and not dispatched yet, counted in the controller's queue depth.
struct Work<K: Resource> {
    queue: VecDeque<(ObjectRef<K>, ReconcileReason)>,
    stats: ControllerStats,
}

impl<K: Resource> Work<K> {
    fn push_back(&mut self, item: (ObjectRef<K>, ReconcileReason)) {
        self.stats.enqueued(Waiting::Queued);
        self.queue.push_back(item);
    }

    fn push_front(&mut self, item: (ObjectRef<K>, ReconcileReason)) {
        self.stats.enqueued(Waiting::Queued);
        self.queue.push_front(item);
    }

    fn pop_front(&mut self) -> Option<(ObjectRef<K>, ReconcileReason)> {
        let item = self.queue.pop_front()?;
        self.stats.dequeued(Waiting::Queued);
        Some(item)
    }

    fn front(&self) -> Option<&(ObjectRef<K>, ReconcileReason)> {
        self.queue.front()
    }

    fn clear(&mut self) {
        while self.pop_front().is_some() {}
    }
}

impl<K: Resource> Drop for Work<K> {
    fn drop(&mut self) {
        self.clear();
    }
}

impl<K: Resource> Slot<K>
where
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    /// Whether `obj_ref` is owed a reconcile that must run (pass work not dispatched).
    pub(super) fn owes_forced(&self, obj_ref: &ObjectRef<K>) -> bool {
        matches!(self.record.mode, PassMode::All | PassMode::Every) && self.progress.owes(obj_ref)
    }
}

impl<K, Ctx, E> Runner<K, Ctx, E>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Clone + Eq + std::hash::Hash + Send + Sync + 'static,
    Ctx: Send + Sync + 'static,
    E: Send + 'static,
{
    fn slot(&self, record: PassRecord, key: &'static [u8], options: MergeOptions<K>) -> Slot<K> {
        let ks = self.durable.as_ref().map(|d| d.keyspace());
        let pass = Pass::new(
            self.p.reader.clone(),
            ks,
            self.p.dyntype.clone(),
            self.p.config.pass_chunk,
            &record,
            options,
            self.p.stats.clone(),
        );
        Slot {
            key,
            progress: Progress::new(record.done.clone()),
            record,
            pass: Some(pass),
            work: Work {
                queue: VecDeque::new(),
                stats: self.p.stats.clone(),
            },
            parked: Vec::new(),
        }
    }

    fn record(&mut self, key: &'static [u8], record: &PassRecord) {
        if let Some(d) = self.durable.as_mut() {
            d.set_pass(key, record.clone());
        }
    }

    /// Asks for a pass over every stored object: starts one, or, while one is under way,
    /// one more after it (asks that come meanwhile are coalesced into that one).
    pub(super) fn pass_all(&mut self) {
        if let Some(slot) = self.ticks.as_mut() {
            if !slot.record.again {
                tracing::debug!("a pass is under way: one more follows it");
                slot.record.again = true;
                let record = slot.record.clone();
                self.record(TICKS_PASS_KEY, &record);
            }
            return;
        }
        self.start_ticks(PassRecord::new(PassMode::Every, None));
    }

    fn start_ticks(&mut self, record: PassRecord) {
        tracing::debug!(resumed = ?record.done.after.as_deref().map(String::from_utf8_lossy),
            again = record.again, "reconciling every stored object (pass from disk)");
        self.p.stats.pass_began(None);
        self.record(TICKS_PASS_KEY, &record);
        let options = self.lag_options();
        self.ticks = Some(self.slot(record, TICKS_PASS_KEY, options));
    }

    /// A `reconcile_all_on` tick before the stores are ready: its pass runs once they are
    /// (a pass of a store still listing, or wiped, would miss objects the tick owes a
    /// reconcile, which a durable startup pass may then skip as unchanged). A durable
    /// controller records it at once, so that a restart before then owes it too: as one
    /// more pass after the one a previous run left, or as a new one.
    pub(super) fn tick_before_ready(&mut self) {
        tracing::debug!("reconcile_all_on tick before the stores are ready: passed once they are");
        let record = match self.left_ticks.take().filter(|r| r.active) {
            Some(left) if left.again => left,
            Some(mut left) => {
                left.again = true;
                left
            }
            None => PassRecord::new(PassMode::Every, None),
        };
        self.record(TICKS_PASS_KEY, &record);
        self.left_ticks = Some(record);
    }

    /// The stores are ready: the ticks' pass a previous run left under way (or a tick
    /// asked for before they were ready) goes on.
    pub(super) fn resume_ticks(&mut self, record: Option<PassRecord>) {
        let Some(record) = record.filter(|r| r.active) else {
            return;
        };
        if self.ticks.is_some() {
            return self.pass_all();
        }
        tracing::info!("resuming the pass over every object a previous run left under way");
        self.start_ticks(record);
    }

    /// The main subscriber lagged: a durable controller merges what changed (and forgets
    /// what is gone); one without durable state reconciles every object.
    pub(super) fn lagged(&mut self) {
        if self.durable.is_none() {
            return self.pass_all();
        }
        if self.startup_pending {
            tracing::debug!("lag before the startup pass: the startup pass covers it");
            return;
        }
        if self.merge.is_some() {
            self.merge_again = true;
            return;
        }
        tracing::info!("main subscriber lagged: merging what changed from disk");
        let start = self.merge_done.clone();
        let options = self.lag_options();
        self.start_merge(PassRecord::new(PassMode::Changed, start), options);
    }

    /// A lag's merge: no requeue scheduled (they are in the scheduler or on disk).
    fn lag_options(&self) -> MergeOptions<K> {
        MergeOptions {
            loaded_until: 0,
            predicate: self.predicate_fn(),
        }
    }

    fn start_merge(&mut self, record: PassRecord, options: MergeOptions<K>) {
        self.startup_pending = false;
        self.merge_again = false;
        self.p.stats.pass_began(Some(self.p.reader.len() as u64));
        self.record(MERGE_PASS_KEY, &record);
        self.merge = Some(self.slot(record, MERGE_PASS_KEY, options));
    }

    /// The main store is consistent: run the startup pass once it has caught up with the
    /// server too (see `Config::catch_up_before_startup`).
    pub(super) fn request_startup(&mut self, cold: bool) {
        // Until the merge starts, it covers the main kind's changes: they are not scheduled
        // one by one (in the order the watch replays them), see `poll_triggers`.
        self.startup_pending =
            self.durable.is_some() && self.startup_mode(cold) != PassMode::DueOnly;
        let Some(limit) = self.p.config.startup_catch_up else {
            return self.startup(cold);
        };
        if self.p.reader.is_caught_up() {
            return self.startup(cold);
        }
        tracing::info!(
            timeout_ms = limit.as_millis() as u64,
            "startup pass waits until the store has caught up with the server"
        );
        self.p.stats.pass_began(None);
        let reader = self.p.reader.clone();
        let wait = async move {
            matches!(
                tokio::time::timeout(limit, reader.wait_until_caught_up()).await,
                Ok(Ok(()))
            )
        };
        self.catching_up = Some((cold, wait.boxed()));
    }

    /// Runs the startup pass that waited for the store to catch up, once it has (or the
    /// wait gave up); true if it started.
    pub(super) fn poll_catch_up(&mut self, cx: &mut Context<'_>) -> bool {
        let Some((cold, wait)) = self.catching_up.as_mut() else {
            return false;
        };
        let Poll::Ready(caught_up) = wait.poll_unpin(cx) else {
            return false;
        };
        let cold = *cold;
        self.catching_up = None;
        if caught_up {
            tracing::debug!("store caught up: the startup pass starts");
        } else {
            tracing::warn!(
                checkpoint = ?self.p.reader.checkpoint(),
                "the store did not catch up with the server in time: the startup pass runs on the data it has"
            );
        }
        self.startup(cold);
        true
    }

    fn startup_mode(&self, cold: bool) -> PassMode {
        match (self.p.config.startup, cold) {
            (StartupMode::ReconcileAll, _) => PassMode::All,
            (StartupMode::Nothing, false) => PassMode::DueOnly,
            _ => PassMode::Changed,
        }
    }

    /// Reconcile what the startup mode says.
    pub(super) fn startup(&mut self, cold: bool) {
        let Some(d) = self.durable.as_mut() else {
            if cold || self.p.config.startup != StartupMode::Nothing {
                self.pass_all();
            }
            return;
        };
        let loaded_until = d.start_window();
        let mut mode = self.startup_mode(cold);
        // A lag's merge under way (or owed) before the startup pass is replaced by it: the
        // startup pass merges what changed too, whatever its mode (with
        // `StartupMode::Nothing` it would only schedule due requeues).
        if let Some(lag) = self.merge.as_ref() {
            mode = mode.max(lag.record.mode).max(PassMode::Changed);
        }
        if std::mem::take(&mut self.merge_again) {
            mode = mode.max(PassMode::Changed);
        }
        let options = MergeOptions {
            loaded_until,
            predicate: self.predicate_fn(),
        };
        // A merge a previous run left under way with a stronger mode (an interrupted
        // `StartupMode::ReconcileAll`) goes on where it stopped, for the rest of its circle
        // only; the merge of this start's own mode follows it over the whole circle.
        if let Some(left) = self.left_merge.take().filter(|r| r.active && r.mode > mode) {
            tracing::debug!(left = ?left.mode, then = ?mode, cold, "startup pass: the rest of the pass a previous run left, then this start's");
            let then = mode;
            self.start_merge(left, options);
            self.merge_then = Some(then);
            return;
        }
        tracing::debug!(?mode, cold, "startup pass over the reconcile state");
        let record = PassRecord::new(mode, self.merge_done.clone());
        self.start_merge(record, options);
    }

    /// Stops reading passes (the controller stops): their positions still move as the
    /// running reconciles finish.
    pub(super) fn stop_passes(&mut self) {
        self.catching_up = None;
        for slot in [self.ticks.as_mut(), self.merge.as_mut()]
            .into_iter()
            .flatten()
        {
            slot.pass = None;
            slot.work.clear();
            slot.parked.clear();
        }
        self.p.stats.pass_ended();
    }

    /// Whether pass work waits (dropping the front items nothing owes any more).
    pub(super) fn pass_waiting(&mut self) -> bool {
        let mut waiting = false;
        for slot in [self.merge.as_mut(), self.ticks.as_mut()]
            .into_iter()
            .flatten()
        {
            while let Some((obj_ref, _)) = slot.work.front() {
                if slot.progress.owes(obj_ref) {
                    waiting = true;
                    break;
                }
                slot.work.pop_front();
            }
        }
        waiting
    }

    /// The next pass work to dispatch. Work for an object being reconciled is parked in its
    /// pass until that reconcile ends.
    pub(super) fn take_pass_work(&mut self) -> Option<ReconcileRequest<K>> {
        for merge in [true, false] {
            loop {
                let slot = if merge {
                    &mut self.merge
                } else {
                    &mut self.ticks
                };
                let Some(slot) = slot.as_mut() else { break };
                let Some((obj_ref, reason)) = slot.work.pop_front() else {
                    break;
                };
                if !slot.progress.owes(&obj_ref) {
                    continue;
                }
                if self.running_refs.contains(&obj_ref) {
                    slot.parked.push((obj_ref, reason));
                    continue;
                }
                return Some(ReconcileRequest { obj_ref, reason });
            }
        }
        None
    }

    /// Feeds each pass's next chunk once half of its previous one has started, and ends
    /// the passes that are done.
    pub(super) fn poll_passes(&mut self, cx: &mut Context<'_>) -> bool {
        let mut progressed = false;
        for merge in [false, true] {
            let half = self.p.config.pass_chunk / 2;
            let slot = if merge {
                &mut self.merge
            } else {
                &mut self.ticks
            };
            let Some(s) = slot.as_mut() else { continue };
            if s.progress.waiting() <= half
                && s.progress.owed() <= CHUNKS_OWED * self.p.config.pass_chunk
                && let Some(pass) = s.pass.as_mut()
                && let Poll::Ready(chunk) = pass.poll_chunk(cx)
            {
                progressed = true;
                match chunk {
                    Some(Ok(chunk)) => {
                        if chunk.end {
                            s.pass = None;
                        }
                        let through = chunk.through;
                        self.plan(merge, chunk.plans);
                        let s = if merge {
                            &mut self.merge
                        } else {
                            &mut self.ticks
                        };
                        if let Some(s) = s.as_mut() {
                            s.progress.through(through);
                        }
                    }
                    // The pass stops here; its record stays under way for the next start.
                    Some(Err(e)) => {
                        *slot = None;
                        self.out.push_back(Err(ControllerError::Store(e)));
                        continue;
                    }
                    None => s.pass = None,
                }
            }
            progressed |= self.settle(merge);
        }
        progressed
    }

    /// Records how far a pass is done, and ends it once it is; true if one ended.
    fn settle(&mut self, merge: bool) -> bool {
        let slot = if merge {
            &mut self.merge
        } else {
            &mut self.ticks
        };
        let Some(s) = slot.as_mut() else {
            return false;
        };
        let moved = s.progress.moved();
        if let Some(done) = moved.clone() {
            s.record.done = done;
        }
        let ended = s.pass.is_none() && s.progress.settled() && !self.shutting_down;
        if ended {
            s.record.active = false;
        }
        let (key, record) = (s.key, s.record.clone());
        if moved.is_some() || ended {
            self.record(key, &record);
        }
        if !ended {
            return false;
        }
        if merge {
            self.merge = None;
        } else {
            self.ticks = None;
        }
        tracing::debug!(merge, again = record.again, "pass done");
        if merge {
            self.merge_done = record.done.after.clone();
            let then = self.merge_then.take();
            if std::mem::take(&mut self.merge_again) || then.is_some() {
                let start = self.merge_done.clone();
                let mode = then.unwrap_or(PassMode::Changed).max(PassMode::Changed);
                let options = self.lag_options();
                self.start_merge(PassRecord::new(mode, start), options);
            }
        } else if record.again {
            self.start_ticks(PassRecord::new(PassMode::Every, None));
        }
        if self.ticks.is_none() && self.merge.is_none() && self.catching_up.is_none() {
            self.p.stats.pass_ended();
        }
        true
    }

    /// A reconcile of `obj_ref` was dispatched, finished, or its read failed: the passes
    /// that owe it hear of it.
    pub(super) fn passes_heard(&mut self, obj_ref: &ObjectRef<K>, event: Heard) {
        for merge in [false, true] {
            let slot = if merge {
                &mut self.merge
            } else {
                &mut self.ticks
            };
            let Some(s) = slot.as_mut() else { continue };
            match event {
                Heard::Dispatched => s.progress.dispatched(obj_ref),
                // A read that failed counts for the pass as an attempt: the request keeps
                // its forced retry (`Runner::retry_read`), and one object that cannot be
                // read does not hold the pass (and every tick after it) open.
                Heard::Finished | Heard::ReadFailed => s.progress.finished(obj_ref),
            }
            if event != Heard::Dispatched
                && let Some(i) = s.parked.iter().position(|(r, _)| r == obj_ref)
            {
                let item = s.parked.swap_remove(i);
                s.work.push_front(item);
            }
            if event == Heard::Finished && self.shutting_down {
                let _ = self.settle(merge);
            }
        }
    }

    /// Whether a pass owes `obj_ref` a reconcile that must run.
    pub(super) fn pass_forces(&self, obj_ref: &ObjectRef<K>) -> bool {
        [self.merge.as_ref(), self.ticks.as_ref()]
            .into_iter()
            .flatten()
            .any(|s| s.owes_forced(obj_ref))
    }

    /// Schedules what a pass chunk asks for: the objects it reconciles as pass work, in its
    /// order; requeues with the changes.
    fn plan(&mut self, merge: bool, plans: Vec<Plan<K>>) {
        let (now, wall) = (Instant::now(), now_ms());
        for plan in plans {
            match plan {
                Plan::Reconcile {
                    obj_ref,
                    reason,
                    at_ms,
                    at,
                } => {
                    if let Some(at) = at_ms.filter(|&at| at > wall) {
                        // A requeue: it waits in the scheduler, and on disk until then.
                        self.queue
                            .schedule(obj_ref, reason, instant_at(at), &self.p.stats);
                        continue;
                    }
                    let slot = if merge {
                        &mut self.merge
                    } else {
                        &mut self.ticks
                    };
                    let Some(s) = slot.as_mut() else { return };
                    s.progress.push(obj_ref.clone(), at);
                    if at_ms.is_some() {
                        // A requeue that fell due is owed like a change.
                        self.queue.schedule(obj_ref, reason, now, &self.p.stats);
                    } else {
                        s.work.push_back((obj_ref, reason));
                    }
                }
                Plan::Forget { suffix, seen } => {
                    if let Some(d) = self.durable.as_mut() {
                        d.push(StateOp::Forget {
                            suffix,
                            only_if: Some(seen),
                        });
                    }
                }
            }
        }
    }
}

/// What a pass hears of one of its objects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Heard {
    Dispatched,
    Finished,
    ReadFailed,
}
