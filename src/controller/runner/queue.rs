//! The change queue: kube-runtime's scheduler, fed so that it never holds more than one
//! request per object, and the rule that shares the concurrency between changes and passes.
//!
//! Reconciles owed to a change (of the object, of a related object, an error retry, a due
//! requeue, a changed object a durable startup pass found) wait here, in kube-runtime's
//! scheduler (deduplication, debounce, timed requeues). Requests are held back in `unsent`
//! (at most one per object, merged by the scheduler's own rule) and handed to the
//! scheduler only when the runner is about to take from it: while the stores are not ready
//! or the concurrency limit is reached, a burst of requests (a cold start's related kinds,
//! a debounce window of a hot object) costs one entry per object, not one per request.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::StreamExt;
use futures::channel::mpsc::{UnboundedReceiver, UnboundedSender, unbounded};
use kube::Resource;
use kube::runtime::controller::{ReconcileReason, ReconcileRequest};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::scheduler::{ScheduleRequest, Scheduler, debounced_scheduler};
use tokio::time::Instant;

use super::super::controller_stats::{ControllerStats, Waiting};
use super::super::owed;
use super::super::scan::DUE;

type Requests<K> = UnboundedReceiver<ScheduleRequest<ReconcileRequest<K>>>;

/// Of every this many dispatches while both changes and pass work wait, one is pass work.
pub(crate) const PASS_SHARE: u32 = 4;

/// Which queue the next dispatch takes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Turn {
    /// A change, if one is due (else pass work, if any).
    Change,
    /// Pass work: its share is owed.
    Pass,
}

/// Changes first, with a guaranteed share for pass work: of `PASS_SHARE` dispatches in a
/// row while pass work waits, at least one is pass work.
#[derive(Debug, Default)]
pub(crate) struct Share {
    /// Changes dispatched in a row while pass work waited.
    changes_in_a_row: u32,
}

impl Share {
    /// Whose turn the next dispatch is, with `pass_waiting` pass work waiting.
    pub(crate) fn turn(&self, pass_waiting: bool) -> Turn {
        if pass_waiting && self.changes_in_a_row + 1 >= PASS_SHARE {
            Turn::Pass
        } else {
            Turn::Change
        }
    }

    /// A change was dispatched.
    pub(crate) fn took_change(&mut self, pass_waiting: bool) {
        if pass_waiting {
            self.changes_in_a_row += 1;
        }
    }

    /// Pass work was dispatched.
    pub(crate) fn took_pass(&mut self) {
        self.changes_in_a_row = 0;
    }
}

/// The scheduler and what the runner knows of it.
pub(crate) struct ChangeQueue<K: Resource> {
    tx: UnboundedSender<ScheduleRequest<ReconcileRequest<K>>>,
    scheduler: Pin<Box<Scheduler<ReconcileRequest<K>, Requests<K>>>>,
    debounce: Duration,
    /// Requests not handed to the scheduler yet: one per object.
    unsent: HashMap<ObjectRef<K>, ScheduleRequest<ReconcileRequest<K>>>,
    /// What waits (in `unsent` or the scheduler, which keeps one request per object): when
    /// it runs and which gauge it counts in, mirroring the scheduler's merge rule (an
    /// earlier request replaces a later one) for the controller's queue metrics.
    waiting: HashMap<ObjectRef<K>, (Instant, Waiting)>,
    /// Objects that received a request that must not be skipped (a related change, a user
    /// request, a pass of every object) since their last dispatch. kube-runtime's
    /// scheduler merges a request into one already queued or pending for the same object
    /// and keeps one of their reasons, so the reason that comes out cannot be trusted: the
    /// next dispatch of these objects always reconciles.
    forced: HashSet<ObjectRef<K>>,
    /// Requests handed to the scheduler, ever.
    sent: u64,
}

impl<K: Resource> ChangeQueue<K> {
    /// Takes every waiting request out of the gauges (the controller stops).
    pub(crate) fn clear_gauges(&mut self, stats: &ControllerStats) {
        for (_, (_, kind)) in self.waiting.drain() {
            stats.dequeued(kind);
        }
    }
}

impl<K> ChangeQueue<K>
where
    K: Resource + Send + Sync + 'static,
    K::DynamicType: Clone + Eq + std::hash::Hash + Send + Sync + 'static,
{
    pub(crate) fn new(debounce: Duration) -> Self {
        let (tx, rx) = unbounded();
        ChangeQueue {
            tx,
            scheduler: Box::pin(debounced_scheduler(rx, debounce)),
            debounce,
            unsent: HashMap::new(),
            waiting: HashMap::new(),
            forced: HashSet::new(),
            sent: 0,
        }
    }

    /// Asks for a reconcile of `obj_ref` at `run_at`.
    pub(crate) fn schedule(
        &mut self,
        obj_ref: ObjectRef<K>,
        reason: ReconcileReason,
        run_at: Instant,
        stats: &ControllerStats,
    ) {
        if !owed::skippable(&reason) {
            self.forced.insert(obj_ref.clone());
        }
        let kind = waiting_kind(&reason);
        if matches!(reason, ReconcileReason::ErrorPolicyRequestedRetry) {
            stats.retried();
        }
        let at = run_at.checked_add(self.debounce).unwrap_or(run_at);
        match self.waiting.entry(obj_ref.clone()) {
            Entry::Vacant(v) => {
                v.insert((at, kind));
                stats.enqueued(kind);
                stats.added();
            }
            Entry::Occupied(mut o) if o.get().0 >= run_at => {
                let (_, old) = o.insert((at, kind));
                stats.dequeued(old);
                stats.enqueued(kind);
            }
            // The scheduler keeps the earlier request and would drop this one.
            Entry::Occupied(_) => return,
        }
        // The latest request the scheduler would keep replaces an unsent one: the
        // scheduler applies the same rule again when it gets it.
        self.unsent.insert(
            obj_ref.clone(),
            ScheduleRequest {
                message: ReconcileRequest { obj_ref, reason },
                run_at,
            },
        );
    }

    /// The next due request whose object `busy` does not hold; requests kept back are
    /// handed to the scheduler first.
    pub(crate) fn poll_due(
        &mut self,
        cx: &mut Context<'_>,
        busy: impl Fn(&ObjectRef<K>) -> bool,
    ) -> Poll<Option<ReconcileRequest<K>>> {
        for (_, request) in self.unsent.drain() {
            self.sent += 1;
            // The receiver lives in `self.scheduler`: sending cannot fail while we exist.
            let _ = self.tx.unbounded_send(request);
        }
        self.scheduler
            .as_mut()
            .hold_unless(|req: &ReconcileRequest<K>| !busy(&req.obj_ref))
            .poll_next_unpin(cx)
    }

    /// `obj_ref` is dispatched: it no longer waits. Whether it had to run.
    pub(crate) fn take(&mut self, obj_ref: &ObjectRef<K>, stats: &ControllerStats) -> bool {
        if let Some((due, kind)) = self.waiting.remove(obj_ref) {
            stats.dequeued(kind);
            stats.waited(Instant::now().saturating_duration_since(due));
        }
        self.forced.remove(obj_ref)
    }

    /// Marks `obj_ref`'s next dispatch as one that must run.
    pub(crate) fn force(&mut self, obj_ref: ObjectRef<K>) {
        self.forced.insert(obj_ref);
    }

    /// Requests handed to the scheduler so far.
    #[cfg(test)]
    pub(crate) fn sent(&self) -> u64 {
        self.sent
    }
}

/// The gauge a waiting request counts in: requeues and retries (asked for by the reconciler,
/// the error policy, or read back from the durable state as due), or the rest.
fn waiting_kind(reason: &ReconcileReason) -> Waiting {
    match reason {
        ReconcileReason::ReconcilerRequestedRetry | ReconcileReason::ErrorPolicyRequestedRetry => {
            Waiting::Requeue
        }
        ReconcileReason::Custom { reason } if reason == DUE => Waiting::Requeue,
        _ => Waiting::Queued,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Pod;

    /// Issue 50, item 3: with a debounce, every request within the window used to be sent
    /// to the scheduler's channel, which is not drained while the runner holds back (stores
    /// not ready, concurrency reached): memory grew with requests, not objects.
    #[tokio::test]
    async fn schedules_of_one_object_send_at_most_one_request_until_polled() {
        let stats = ControllerStats::default();
        let mut q = ChangeQueue::<Pod>::new(Duration::from_secs(1));
        let obj = ObjectRef::<Pod>::new("web-0").within("default");
        let burst = |q: &mut ChangeQueue<Pod>| {
            for _ in 0..10_000 {
                q.schedule(
                    obj.clone(),
                    ReconcileReason::ObjectUpdated,
                    Instant::now(),
                    &stats,
                );
            }
        };
        burst(&mut q);
        assert_eq!(q.sent(), 0, "nothing is sent until the runner takes");
        assert_eq!(q.unsent.len(), 1);
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        let _ = q.poll_due(&mut cx, |_| false);
        burst(&mut q);
        let _ = q.poll_due(&mut cx, |_| false);
        assert!(q.sent() <= 2, "sent {} requests", q.sent());
        assert_eq!(stats.get().queue_depth, 1, "one object waits");
    }

    #[test]
    fn pass_work_gets_one_dispatch_in_four_while_changes_wait() {
        let mut share = Share::default();
        let mut turns = Vec::new();
        for _ in 0..8 {
            let t = share.turn(true);
            match t {
                Turn::Change => share.took_change(true),
                Turn::Pass => share.took_pass(),
            }
            turns.push(t);
        }
        use Turn::{Change as C, Pass as P};
        assert_eq!(turns, [C, C, C, P, C, C, C, P]);
        // With no pass work waiting, changes take every turn and owe nothing.
        let mut share = Share::default();
        for _ in 0..10 {
            assert_eq!(share.turn(false), C);
            share.took_change(false);
        }
        assert_eq!(share.turn(true), C);
    }
}
