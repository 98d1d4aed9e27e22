//! The run loop: triggers → the change queue and the passes → reconciles, one object at a
//! time.
//!
//! kube-runtime's own runner is private, so this is a small one around its public
//! [`Scheduler`](kube::runtime::scheduler::Scheduler) (`queue.rs`): `hold_unless` keeps a
//! message pending while its object is being reconciled (never two reconciles of one
//! object at once), and nothing is taken while the concurrency limit is reached or the
//! stores are not ready yet. The scheduler does the deduplication, the debounce and the
//! timed requeues. Changes go first; pass work (`passes.rs`) gets one dispatch in
//! [`PASS_SHARE`](queue::PASS_SHARE) while both wait.

use std::collections::{HashMap, HashSet, VecDeque};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, SelectAll};
use futures::{FutureExt, Stream, StreamExt};
use kube::Resource;
use kube::runtime::controller::{Action, ReconcileReason, ReconcileRequest};
use kube::runtime::reflector::ObjectRef;
use serde::de::DeserializeOwned;
use tokio::time::Instant;
use tracing::Instrument;

mod object_read;
mod passes;
mod progress;
mod queue;

use object_read::{ObjectRead, PendingRead};
use passes::{Heard, Slot};
use queue::{ChangeQueue, Share, Turn};

use super::Config;
use super::action::requeue_after;
use super::controller_error::ControllerError;
use super::controller_stats::ControllerStats;
use super::owed;
use super::predicate::{Filter, PredicateFn};
use super::scan::{self, PassMode, PassRecord, suffix_ref};
use super::state::{Durable, instant_at, now_ms};
use super::triggers::{Trigger, TriggerStream};
use crate::controller::keyspace::{Outcome, ReconcileRecord, StateOp};
use crate::disk::keys::object_suffix;
use crate::store::Reader;

/// What one `run` stream yields.
pub(crate) type RunItem<K, E> = Result<(ObjectRef<K>, Action), ControllerError<E>>;

/// A type-erased reconciler.
pub(crate) type ReconcileFn<K, Ctx, E> =
    Box<dyn FnMut(Arc<K>, Arc<Ctx>) -> BoxFuture<'static, Result<Action, E>> + Send>;
/// A type-erased error policy.
pub(crate) type ErrorPolicyFn<K, Ctx, E> = Box<dyn Fn(Arc<K>, &E, Arc<Ctx>) -> Action + Send>;

/// Most trigger items taken in one go, and most loop turns in one poll, before yielding.
const BUDGET: usize = 256;
const TURNS: usize = 64;
/// Farther requeues are clamped (kube-runtime's scheduler clamps to about six months too).
const MAX_REQUEUE: Duration = Duration::from_secs(86_400 * 180);

/// A running reconcile's task, aborted when the controller drops it (a stopped controller
/// does not leave reconciles running behind it).
struct Reconciling<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for Reconciling<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

struct Done<K: Resource, E> {
    request: ReconcileRequest<K>,
    obj: Arc<K>,
    result: Result<Action, E>,
    /// How long the reconcile ran.
    took: Duration,
}

/// The parts a [`Runner`] starts from.
pub(crate) struct Parts<K: Resource, Ctx, E> {
    pub reader: Reader<K>,
    pub dyntype: K::DynamicType,
    pub config: Config,
    pub triggers: Vec<TriggerStream<K>>,
    pub ready: BoxFuture<'static, ()>,
    pub shutdown: Option<BoxFuture<'static, ()>>,
    pub reconcile: ReconcileFn<K, Ctx, E>,
    pub error_policy: ErrorPolicyFn<K, Ctx, E>,
    pub ctx: Arc<Ctx>,
    pub durable: Option<Durable>,
    /// The controller's span: entered at every poll, so that its lines (and its
    /// reconciles' spans) name the controller, its stream and its directory.
    pub span: tracing::Span,
    /// [`Controller::predicate_filter`](super::Controller::predicate_filter).
    pub predicate: Option<Filter<K>>,
    pub stats: ControllerStats,
}

/// The controller's stream of reconcile results.
pub(crate) struct Runner<K: Resource, Ctx, E: 'static> {
    p: Parts<K, Ctx, E>,
    triggers: Option<SelectAll<TriggerStream<K>>>,
    /// Changes, retries and requeues, in kube-runtime's scheduler.
    queue: ChangeQueue<K>,
    /// Whose turn the next dispatch is: changes or pass work.
    share: Share,
    reading: FuturesUnordered<PendingRead<K>>,
    running: FuturesUnordered<BoxFuture<'static, Done<K, E>>>,
    /// Objects being read or reconciled: never two reconciles of one object at once.
    running_refs: HashSet<ObjectRef<K>>,
    /// The pass over every stored object (`reconcile_all_on`, a lag of a related kind, a
    /// start without durable state). A pass under way is never replaced: asks that come
    /// meanwhile are coalesced into one more pass after it.
    ticks: Option<Slot<K>>,
    /// The merge pass of a durable controller (its startup pass, a lag of its main
    /// subscriber), beside `ticks`: neither replaces the other.
    merge: Option<Slot<K>>,
    /// A lag came while the merge ran: one more merge follows it.
    merge_again: bool,
    /// The mode of the merge that follows the one under way (the rest of a pass a previous
    /// run left is merged first, then this start's own pass).
    merge_then: Option<PassMode>,
    /// Where the last merge stopped: the next one starts there.
    merge_done: Option<Vec<u8>>,
    /// The merge a previous run left (its mode is owed by the startup pass).
    left_merge: Option<PassRecord>,
    /// The ticks' pass owed once the stores are ready: the one a previous run left under
    /// way, or one a tick asked for before they were ready (recorded on disk at once by a
    /// durable controller, so that a restart owes it too).
    left_ticks: Option<PassRecord>,
    /// A durable startup pass that reconciles changed objects is asked for and has not
    /// started: the main kind's changes are left to it.
    startup_pending: bool,
    /// Objects whose last reads failed, with how many failed in a row (the retry backoff).
    read_failures: HashMap<ObjectRef<K>, u32>,
    /// The reconcile state, for a durable controller.
    durable: Option<Durable>,
    ready: bool,
    /// A startup pass (`cold` or not) waiting until the main store has caught up (true)
    /// or the wait timed out (false).
    catching_up: Option<(bool, BoxFuture<'static, bool>)>,
    shutting_down: bool,
    out: VecDeque<RunItem<K, E>>,
}

/// A stopped controller leaves nothing in its gauges: what waited in its scheduler and the
/// reconciles it aborts are taken out.
impl<K: Resource, Ctx, E: 'static> Drop for Runner<K, Ctx, E> {
    fn drop(&mut self) {
        self.queue.clear_gauges(&self.p.stats);
        for _ in 0..self.running.len() {
            self.p.stats.aborted();
        }
        self.p.stats.pass_ended();
    }
}

// Nothing is pinned structurally: the scheduler is boxed and pinned on its own.
impl<K: Resource, Ctx, E: 'static> Unpin for Runner<K, Ctx, E> {}

impl<K, Ctx, E> Runner<K, Ctx, E>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Clone + Eq + std::hash::Hash + Send + Sync + 'static,
    Ctx: Send + Sync + 'static,
    E: Send + 'static,
{
    pub(crate) fn new(mut p: Parts<K, Ctx, E>) -> Self {
        let queue = ChangeQueue::new(p.config.debounce);
        let triggers = std::mem::take(&mut p.triggers);
        let durable = p.durable.take();
        Runner {
            durable,
            p,
            triggers: Some(futures::stream::select_all(triggers)),
            queue,
            share: Share::default(),
            reading: FuturesUnordered::new(),
            running: FuturesUnordered::new(),
            running_refs: HashSet::new(),
            ticks: None,
            merge: None,
            merge_again: false,
            merge_then: None,
            merge_done: None,
            left_merge: None,
            left_ticks: None,
            startup_pending: false,
            read_failures: HashMap::new(),
            ready: false,
            catching_up: None,
            shutting_down: false,
            out: VecDeque::new(),
        }
    }

    fn schedule(&mut self, obj_ref: ObjectRef<K>, reason: ReconcileReason, run_at: Instant) {
        self.queue.schedule(obj_ref, reason, run_at, &self.p.stats);
    }

    fn begin_shutdown(&mut self) {
        if !self.shutting_down {
            tracing::debug!(
                running = self.running.len(),
                "controller shutting down gracefully"
            );
            self.shutting_down = true;
            // Stops the watchers (releasing their streams) and any pass; running
            // reconciles finish, nothing new starts.
            self.triggers = None;
            self.stop_passes();
            // Objects still being read are not reconciled.
            self.reading = FuturesUnordered::new();
        }
    }

    /// Takes trigger items; true if anything happened. A durable controller takes none
    /// before its state's identity is checked.
    fn poll_triggers(&mut self, cx: &mut Context<'_>) -> bool {
        if let Some(d) = self.durable.as_mut() {
            match d.poll_init(cx) {
                Poll::Pending => return false,
                Poll::Ready(Err(e)) => self.out.push_back(Err(ControllerError::Store(e))),
                Poll::Ready(Ok(_)) => {}
            }
            if let Some(left) = d.take_resumed() {
                self.merge_done = left.merge.as_ref().and_then(|m| m.done.after.clone());
                self.left_merge = left.merge;
                self.left_ticks = left.ticks;
            }
        }
        let Some(mut triggers) = self.triggers.take() else {
            return false;
        };
        for _ in 0..BUDGET {
            match triggers.poll_next_unpin(cx) {
                Poll::Ready(Some(Ok(Trigger::Request(req))))
                    if self.startup_pending
                        && matches!(req.reason, ReconcileReason::ObjectUpdated)
                        && !self.running_refs.contains(&req.obj_ref) =>
                {
                    // Stored before the startup pass reads its key: the pass reconciles it,
                    // in its order (longest owed first), not in the order of the replay.
                    // Not so for an object being read or reconciled (a resumed ticks' pass,
                    // a related trigger): the record that reconcile writes when it ends
                    // would outlive a delete the pass has already seen, so the change is
                    // scheduled, and runs after it (a read that finds no object forgets).
                    tracing::trace!(object = %req.obj_ref, "change left to the startup pass");
                }
                Poll::Ready(Some(Ok(Trigger::Request(req)))) => {
                    self.schedule(req.obj_ref, req.reason, Instant::now())
                }
                Poll::Ready(Some(Ok(Trigger::Lagged))) => self.lagged(),
                Poll::Ready(Some(Ok(Trigger::ReconcileAll))) if self.ready => self.pass_all(),
                Poll::Ready(Some(Ok(Trigger::ReconcileAll))) => self.tick_before_ready(),
                Poll::Ready(Some(Ok(Trigger::Startup { cold }))) => self.request_startup(cold),
                Poll::Ready(Some(Err(e))) => self.out.push_back(Err(e.into())),
                Poll::Ready(None) => {
                    tracing::debug!("every trigger stream ended");
                    self.begin_shutdown();
                    return true;
                }
                Poll::Pending => {
                    self.triggers = Some(triggers);
                    return false;
                }
            }
        }
        self.triggers = Some(triggers);
        true
    }

    /// Writes, batching and due-time scans of the reconcile state; true if anything
    /// happened.
    fn poll_durable(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(d) = self.durable.as_mut() else {
            return false;
        };
        let mut errors = Vec::new();
        let due = d.poll(cx, &mut errors);
        let progressed = !due.is_empty() || !errors.is_empty();
        for e in errors {
            self.out.push_back(Err(ControllerError::Store(e)));
        }
        for (suffix, due_ms) in due {
            let obj_ref = suffix_ref::<K>(&suffix, self.p.dyntype.clone());
            self.schedule(obj_ref, custom(scan::DUE), instant_at(due_ms));
        }
        progressed
    }

    /// Whether a request need not run: a change (or a requeue read back from disk) the
    /// reconcile state shows was already handled. Its pending requeue, which a merge in the
    /// scheduler may have replaced with this request, is scheduled again.
    fn skip(&mut self, request: &ReconcileRequest<K>, obj: &K, rec: &ReconcileRecord) -> bool {
        let meta = obj.meta();
        let handled = owed::handled(
            rec,
            meta.uid.as_deref(),
            meta.resource_version.as_deref(),
            self.p.predicate.is_some(),
            || self.p.predicate.as_ref().and_then(|f| f.value(obj)),
        );
        let skip = owed::may_skip(&request.reason, handled, rec.due_ms, now_ms());
        if skip
            && let (Some(due), Some(d)) = (rec.due_ms, self.durable.as_ref())
            && d.in_window(due)
        {
            let reason = if rec.failed_rv.is_some() {
                ReconcileReason::ErrorPolicyRequestedRetry
            } else {
                ReconcileReason::ReconcilerRequestedRetry
            };
            self.schedule(request.obj_ref.clone(), reason, instant_at(due));
        }
        skip
    }

    /// Starts the reconcile of one object read from disk.
    fn start(&mut self, read: ObjectRead<K>) {
        let ObjectRead {
            request,
            forced,
            object: read,
            record,
        } = read;
        if read.is_ok() {
            self.read_failures.remove(&request.obj_ref);
        }
        let obj = match read {
            Ok(Some(obj)) => obj,
            Ok(None) => {
                self.running_refs.remove(&request.obj_ref);
                if let Some(f) = self.p.predicate.as_mut() {
                    f.forget(&request.obj_ref);
                }
                self.passes_heard(&request.obj_ref, Heard::Finished);
                // Deleted objects leave the reconcile state with them.
                if let Some(d) = self.durable.as_mut() {
                    d.push(StateOp::Forget {
                        suffix: suffix_of(&request.obj_ref),
                        only_if: None,
                    });
                }
                self.out
                    .push_back(Err(ControllerError::ObjectNotFound(Box::new(
                        request.obj_ref.erase(),
                    ))));
                return;
            }
            Err(e) => {
                self.running_refs.remove(&request.obj_ref);
                let erased = Box::new(request.obj_ref.clone().erase());
                self.retry_read(request, forced);
                self.out
                    .push_back(Err(ControllerError::ReadFailed(e, erased)));
                return;
            }
        };
        let skip = match record {
            Some(rec) => self.skip(&request, &obj, &rec),
            // In memory (no durable state): a change the predicate shows handled.
            None => {
                self.durable.is_none()
                    && matches!(request.reason, ReconcileReason::ObjectUpdated)
                    && self
                        .p
                        .predicate
                        .as_mut()
                        .is_some_and(|f| f.unchanged(&request.obj_ref, &obj))
            }
        };
        if skip {
            tracing::trace!(object = %request.obj_ref, reason = %request.reason, "already reconciled at this version, skipped");
            self.running_refs.remove(&request.obj_ref);
            self.passes_heard(&request.obj_ref, Heard::Finished);
            self.p.stats.skipped();
            return;
        }
        let span = tracing::info_span!(
            "reconciling object",
            "object.ref" = %request.obj_ref,
            object.reason = %request.reason
        );
        let fut = span.in_scope(|| (self.p.reconcile)(obj.clone(), self.p.ctx.clone()));
        // Each reconcile is a task of its own: one that blocks (a long scan of a store) or
        // runs long holds its own worker, not the controller's task, which keeps driving
        // the scheduler, the triggers and the watch. Dropping the controller aborts it.
        let mut task = Reconciling(tokio::spawn(fut.instrument(span)));
        let started = Instant::now();
        self.p.stats.started();
        self.running.push(
            async move {
                let result = match (&mut task.0).await {
                    Ok(result) => result,
                    // The reconciler panicked: as if it had been polled here.
                    Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                    // Cancelled: only by the runtime shutting down, which drops this too.
                    Err(_) => futures::future::pending().await,
                };
                Done {
                    request,
                    obj,
                    result,
                    took: started.elapsed(),
                }
            }
            .boxed(),
        );
    }

    /// The next request to dispatch: a due change, unless pass work is owed its share.
    fn next_request(&mut self, cx: &mut Context<'_>) -> Option<ReconcileRequest<K>> {
        let pass_waiting = self.pass_waiting();
        if self.share.turn(pass_waiting) == Turn::Pass
            && let Some(request) = self.take_pass_work()
        {
            self.share.took_pass();
            return Some(request);
        }
        let running = &self.running_refs;
        if let Poll::Ready(Some(request)) = self.queue.poll_due(cx, |r| running.contains(r)) {
            self.share.took_change(pass_waiting);
            return Some(request);
        }
        let request = self.take_pass_work()?;
        self.share.took_pass();
        Some(request)
    }

    /// Applies the outcome of a finished reconcile: requeue, error policy, result item.
    fn finish(&mut self, done: Done<K, E>) -> RunItem<K, E> {
        let (finished_at, wall) = (Instant::now(), now_ms());
        let obj_ref = done.request.obj_ref;
        self.running_refs.remove(&obj_ref);
        self.passes_heard(&obj_ref, Heard::Finished);
        let meta = done.obj.meta();
        let rv = meta.resource_version.clone().unwrap_or_default();
        let uid = meta.uid.clone();
        let predicate = self.p.predicate.as_mut();
        let outcome = match (&done.result, predicate) {
            (Ok(_), Some(f)) => {
                f.reconciled(&obj_ref, &done.obj, true);
                Outcome::Ok {
                    predicate: f.value(&done.obj),
                }
            }
            (Ok(_), None) => Outcome::Ok { predicate: None },
            (Err(_), f) => {
                if let Some(f) = f {
                    f.reconciled(&obj_ref, &done.obj, false);
                }
                Outcome::Failed
            }
        };
        let (action, reason, item) = match done.result {
            Ok(action) => (
                action.clone(),
                ReconcileReason::ReconcilerRequestedRetry,
                Ok((obj_ref.clone(), action)),
            ),
            Err(e) => {
                let action = (self.p.error_policy)(done.obj, &e, self.p.ctx.clone());
                let erased = Box::new(obj_ref.clone().erase());
                (
                    action,
                    ReconcileReason::ErrorPolicyRequestedRetry,
                    Err(ControllerError::ReconcilerFailed(e, erased)),
                )
            }
        };
        let after = requeue_after(&action).map(|a| a.min(MAX_REQUEUE));
        let requeue = item.is_ok() && after.is_some();
        self.p.stats.finished(done.took, item.is_ok(), requeue);
        let due_ms = after.map(|a| wall.saturating_add(a.as_millis() as u64));
        let in_memory = match (self.durable.as_mut(), due_ms) {
            (Some(d), due) => {
                d.push(StateOp::Done {
                    suffix: suffix_of(&obj_ref),
                    uid,
                    rv,
                    outcome,
                    due_ms: due,
                });
                due.is_some_and(|due| d.in_window(due))
            }
            (None, due) => due.is_some(),
        };
        if let Some(after) = after.filter(|_| in_memory && !self.shutting_down) {
            let run_at = finished_at.checked_add(after).unwrap_or(finished_at);
            self.schedule(obj_ref, reason, run_at);
        }
        item
    }
}

impl<K, Ctx, E> Stream for Runner<K, Ctx, E>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Clone + Eq + std::hash::Hash + Send + Sync + 'static,
    Ctx: Send + Sync + 'static,
    E: Send + 'static,
{
    type Item = RunItem<K, E>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let span = this.p.span.clone();
        let _entered = span.enter();
        for _ in 0..TURNS {
            if let Some(item) = this.out.pop_front() {
                return Poll::Ready(Some(item));
            }
            let stop = match this.p.shutdown.as_mut() {
                Some(shutdown) if !this.shutting_down => shutdown.poll_unpin(cx).is_ready(),
                _ => false,
            };
            if stop {
                this.p.shutdown = None;
                this.begin_shutdown();
            }
            if let Poll::Ready(Some(done)) = this.running.poll_next_unpin(cx) {
                return Poll::Ready(Some(this.finish(done)));
            }
            let mut progressed = false;
            if !this.shutting_down {
                while let Poll::Ready(Some(read)) = this.reading.poll_next_unpin(cx) {
                    this.start(read);
                    progressed = true;
                }
            }
            if this.shutting_down {
                if !this.running.is_empty() {
                    return Poll::Pending;
                }
                // The last results' state is written before the stream ends.
                let Some(d) = this.durable.as_mut() else {
                    return Poll::Ready(None);
                };
                d.flush();
                let _ = this.poll_durable(cx);
                if !this.out.is_empty() {
                    continue;
                }
                return match this.durable.as_ref().is_some_and(Durable::idle) {
                    true => Poll::Ready(None),
                    false => Poll::Pending,
                };
            }

            progressed |= this.poll_durable(cx);
            progressed |= this.poll_triggers(cx);
            progressed |= this.poll_catch_up(cx);
            progressed |= this.poll_passes(cx);
            // A durable controller starts once its state's identity is checked: only then
            // does it know the ticks' pass a previous run left (a warm store is ready at
            // the first poll, before the disk thread has read it).
            if !this.ready
                && this.durable.as_ref().is_none_or(Durable::initialized)
                && this.p.ready.poll_unpin(cx).is_ready()
            {
                tracing::debug!("stores ready, reconciles may start");
                this.ready = true;
                let left = this.left_ticks.take();
                this.resume_ticks(left);
            }
            let limit = this.p.config.concurrency as usize;
            let busy = this.running.len() + this.reading.len();
            if this.ready
                && (limit == 0 || busy < limit)
                && let Some(request) = this.next_request(cx)
            {
                this.dispatch(request);
                progressed = true;
            }
            // At the limit the scheduler is not polled at all: a poll would move every due
            // request into its set of held messages, which it serves in hash order, not by
            // due time, so that under a sustained load (ticks, passes) a due request could
            // wait forever behind newer ones. Left in its queue, due requests come out in
            // the order they fell due once a reconcile finishes (which wakes this task).
            // Requests meanwhile wait in the change queue, one per object (`queue.rs`).
            if !progressed && this.out.is_empty() {
                return Poll::Pending;
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

impl<K: Resource, Ctx, E> Runner<K, Ctx, E> {
    /// The predicate, for the merge passes' reads.
    fn predicate_fn(&self) -> Option<PredicateFn<K>> {
        self.p.predicate.as_ref().map(|f| f.predicate.clone())
    }
}

/// The state key suffix of an object.
fn suffix_of<K: Resource>(obj_ref: &ObjectRef<K>) -> Vec<u8> {
    object_suffix(obj_ref.namespace.as_deref(), &obj_ref.name)
}

fn custom(reason: &str) -> ReconcileReason {
    ReconcileReason::Custom {
        reason: reason.to_string(),
    }
}
