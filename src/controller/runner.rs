//! The run loop: triggers → kube-runtime's scheduler → reconciles, one object at a time.
//!
//! kube-runtime's own runner is private, so this is a small one around its public
//! [`Scheduler`]: `hold_unless` keeps a message pending while its object is being
//! reconciled (never two reconciles of one object at once), and `hold` keeps everything
//! pending while the concurrency limit is reached or the stores are not ready yet. The
//! scheduler itself does the deduplication, the debounce and the timed requeues.

use std::collections::{HashSet, VecDeque};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::channel::mpsc::{UnboundedReceiver, UnboundedSender, unbounded};
use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, SelectAll};
use futures::{FutureExt, Stream, StreamExt};
use kube::Resource;
use kube::runtime::controller::{Action, ReconcileReason, ReconcileRequest};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::scheduler::{ScheduleRequest, Scheduler, debounced_scheduler};
use serde::de::DeserializeOwned;
use tokio::time::Instant;
use tracing::Instrument;

use super::Config;
use super::action::requeue_after;
use super::error::ControllerError;
use super::sweep::Sweep;
use super::triggers::{Trigger, TriggerStream};
use crate::Reader;

/// What one `run` stream yields.
pub(crate) type RunItem<K, E> = Result<(ObjectRef<K>, Action), ControllerError<E>>;

/// A type-erased reconciler.
pub(crate) type ReconcileFn<K, Ctx, E> =
    Box<dyn FnMut(Arc<K>, Arc<Ctx>) -> BoxFuture<'static, Result<Action, E>> + Send>;
/// A type-erased error policy.
pub(crate) type ErrorPolicyFn<K, Ctx, E> = Box<dyn Fn(Arc<K>, &E, Arc<Ctx>) -> Action + Send>;

type Requests<K> = UnboundedReceiver<ScheduleRequest<ReconcileRequest<K>>>;

/// Most trigger items taken in one go, and most loop turns in one poll, before yielding.
const BUDGET: usize = 256;
const TURNS: usize = 64;
/// Farther requeues are clamped (kube-runtime's scheduler clamps to about six months too).
const MAX_REQUEUE: Duration = Duration::from_secs(86_400 * 180);

struct Done<K: Resource, E> {
    request: ReconcileRequest<K>,
    obj: Arc<K>,
    result: Result<Action, E>,
}

/// A scheduled object being read from disk (on the blocking pool, not in `poll_next`).
type Fetch<K> = BoxFuture<'static, (ReconcileRequest<K>, crate::Result<Option<Arc<K>>>)>;

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
}

/// The controller's stream of reconcile results.
pub(crate) struct Runner<K: Resource, Ctx, E: 'static> {
    p: Parts<K, Ctx, E>,
    triggers: Option<SelectAll<TriggerStream<K>>>,
    schedule_tx: UnboundedSender<ScheduleRequest<ReconcileRequest<K>>>,
    scheduler: Pin<Box<Scheduler<ReconcileRequest<K>, Requests<K>>>>,
    fetching: FuturesUnordered<Fetch<K>>,
    running: FuturesUnordered<BoxFuture<'static, Done<K, E>>>,
    /// Objects being read or reconciled: never two reconciles of one object at once.
    running_refs: HashSet<ObjectRef<K>>,
    sweep: Option<Sweep<K>>,
    sweep_outstanding: HashSet<ObjectRef<K>>,
    ready: bool,
    shutting_down: bool,
    out: VecDeque<RunItem<K, E>>,
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
        let (schedule_tx, rx) = unbounded();
        let scheduler = Box::pin(debounced_scheduler(rx, p.config.debounce));
        let triggers = std::mem::take(&mut p.triggers);
        Runner {
            p,
            triggers: Some(futures::stream::select_all(triggers)),
            schedule_tx,
            scheduler,
            fetching: FuturesUnordered::new(),
            running: FuturesUnordered::new(),
            running_refs: HashSet::new(),
            sweep: None,
            sweep_outstanding: HashSet::new(),
            ready: false,
            shutting_down: false,
            out: VecDeque::new(),
        }
    }

    fn schedule(&self, obj_ref: ObjectRef<K>, reason: ReconcileReason, run_at: Instant) {
        // The receiver lives in `self.scheduler`: sending cannot fail while we exist.
        let _ = self.schedule_tx.unbounded_send(ScheduleRequest {
            message: ReconcileRequest { obj_ref, reason },
            run_at,
        });
    }

    fn begin_shutdown(&mut self) {
        if !self.shutting_down {
            tracing::debug!(
                running = self.running.len(),
                "controller shutting down gracefully"
            );
            self.shutting_down = true;
            // Stops the watchers (releasing their streams) and any sweep; running
            // reconciles finish, nothing new starts.
            self.triggers = None;
            self.sweep = None;
            // Objects still being read are not reconciled.
            self.fetching = FuturesUnordered::new();
        }
    }

    /// Takes trigger items; true if anything happened.
    fn poll_triggers(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(mut triggers) = self.triggers.take() else {
            return false;
        };
        for _ in 0..BUDGET {
            match triggers.poll_next_unpin(cx) {
                Poll::Ready(Some(Ok(Trigger::Request(req)))) => {
                    self.schedule(req.obj_ref, req.reason, Instant::now())
                }
                Poll::Ready(Some(Ok(Trigger::ReconcileAll))) => {
                    tracing::debug!("reconciling every stored object (sweep from disk)");
                    self.sweep_outstanding.clear();
                    self.sweep = Some(Sweep::start(
                        self.p.reader.clone(),
                        self.p.dyntype.clone(),
                        self.p.config.sweep_chunk,
                    ));
                }
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

    /// Feeds the next sweep chunk once half of the previous one has started.
    fn poll_sweep(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(sweep) = self.sweep.as_mut() else {
            return false;
        };
        if self.sweep_outstanding.len() > self.p.config.sweep_chunk / 2 {
            return false; // re-checked after each dispatch
        }
        match sweep.poll_chunk(cx) {
            Poll::Ready(Some(Ok(refs))) => {
                let now = Instant::now();
                for r in refs {
                    self.sweep_outstanding.insert(r.clone());
                    self.schedule(r, ReconcileReason::BulkReconcile, now);
                }
                true
            }
            Poll::Ready(Some(Err(e))) => {
                self.out.push_back(Err(ControllerError::Store(e)));
                true
            }
            Poll::Ready(None) => {
                self.sweep = None;
                true
            }
            Poll::Pending => false,
        }
    }

    /// Starts reading one scheduled object from disk, off the async worker (a read may
    /// block on disk); [`Runner::start`] follows when it is read.
    fn dispatch(&mut self, request: ReconcileRequest<K>) {
        self.sweep_outstanding.remove(&request.obj_ref);
        self.running_refs.insert(request.obj_ref.clone());
        let reader = self.p.reader.clone();
        self.fetching.push(
            async move {
                let obj_ref = request.obj_ref.clone();
                let read = tokio::task::spawn_blocking(move || reader.get(&obj_ref)).await;
                let res = read.unwrap_or_else(|e| {
                    Err(crate::Error::Storage {
                        path: Default::default(),
                        detail: format!("object read task failed: {e}"),
                    })
                });
                (request, res)
            }
            .boxed(),
        );
    }

    /// Starts the reconcile of one object read from disk.
    fn start(&mut self, request: ReconcileRequest<K>, read: crate::Result<Option<Arc<K>>>) {
        let obj = match read {
            Ok(Some(obj)) => obj,
            Ok(None) => {
                self.running_refs.remove(&request.obj_ref);
                self.out
                    .push_back(Err(ControllerError::ObjectNotFound(Box::new(
                        request.obj_ref.erase(),
                    ))));
                return;
            }
            Err(e) => {
                self.running_refs.remove(&request.obj_ref);
                self.out.push_back(Err(ControllerError::ReadFailed(
                    e,
                    Box::new(request.obj_ref.erase()),
                )));
                return;
            }
        };
        let span = tracing::info_span!(
            "reconciling object",
            "object.ref" = %request.obj_ref,
            object.reason = %request.reason
        );
        let fut = span.in_scope(|| (self.p.reconcile)(obj.clone(), self.p.ctx.clone()));
        self.running.push(
            async move {
                let result = fut.await;
                Done {
                    request,
                    obj,
                    result,
                }
            }
            .instrument(span)
            .boxed(),
        );
    }

    /// Applies the outcome of a finished reconcile: requeue, error policy, result item.
    fn finish(&mut self, done: Done<K, E>) -> RunItem<K, E> {
        let finished_at = Instant::now();
        let obj_ref = done.request.obj_ref;
        self.running_refs.remove(&obj_ref);
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
        if let Some(after) = requeue_after(&action).filter(|_| !self.shutting_down) {
            let run_at = finished_at
                .checked_add(after.min(MAX_REQUEUE))
                .unwrap_or(finished_at);
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
                while let Poll::Ready(Some((request, read))) = this.fetching.poll_next_unpin(cx) {
                    this.start(request, read);
                    progressed = true;
                }
            }
            if this.shutting_down {
                return if this.running.is_empty() {
                    Poll::Ready(None)
                } else {
                    Poll::Pending
                };
            }

            progressed |= this.poll_triggers(cx);
            progressed |= this.poll_sweep(cx);
            if !this.ready && this.p.ready.poll_unpin(cx).is_ready() {
                tracing::debug!("stores ready, reconciles may start");
                this.ready = true;
            }
            let limit = this.p.config.concurrency as usize;
            let busy = this.running.len() + this.fetching.len();
            if this.ready && (limit == 0 || busy < limit) {
                let running = &this.running_refs;
                let next = this
                    .scheduler
                    .as_mut()
                    .hold_unless(|req: &ReconcileRequest<K>| !running.contains(&req.obj_ref))
                    .poll_next_unpin(cx);
                if let Poll::Ready(Some(request)) = next {
                    this.dispatch(request);
                    progressed = true;
                }
            } else {
                // Keep taking requests (and arming the timers) without starting anything.
                let _ = this.scheduler.as_mut().hold().poll_next_unpin(cx);
            }
            if !progressed && this.out.is_empty() {
                return Poll::Pending;
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}
