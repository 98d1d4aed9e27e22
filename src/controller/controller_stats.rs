//! A controller's live counters: reconciles by result and their durations, what waits in
//! the scheduler, and the startup pass's progress. The run loop updates them with relaxed
//! atomics; [`ControllerStats::get`] reads them (and the `metrics` feature exports them as
//! `kube_persist_controller_*`, named like controller-runtime's).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use crate::model::Histogram;

/// Upper bounds (seconds) of the reconcile duration histogram's buckets (and `+Inf`).
pub const RECONCILE_BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// Upper bounds (seconds) of the queue wait histogram's buckets (and `+Inf`): the time a
/// due request waits before its reconcile starts (controller-runtime's
/// `workqueue_queue_duration_seconds`).
pub const QUEUE_WAIT_BUCKETS: [f64; 14] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 30.0, 120.0, 600.0,
];

#[derive(Debug)]
struct Counters {
    ok: AtomicU64,
    requeued: AtomicU64,
    failed: AtomicU64,
    skipped: AtomicU64,
    /// Reconcile durations, in [`RECONCILE_BUCKETS`].
    durations: Histogram,
    /// Queue waits, in [`QUEUE_WAIT_BUCKETS`].
    waits: Histogram,
    adds: AtomicU64,
    retries: AtomicU64,
    active: AtomicU64,
    queued: AtomicU64,
    requeues: AtomicU64,
    pass_running: AtomicU64,
    pass_objects: AtomicU64,
    pass_read: AtomicU64,
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            ok: AtomicU64::default(),
            requeued: AtomicU64::default(),
            failed: AtomicU64::default(),
            skipped: AtomicU64::default(),
            durations: Histogram::new(&RECONCILE_BUCKETS, 1e6),
            waits: Histogram::new(&QUEUE_WAIT_BUCKETS, 1e6),
            adds: AtomicU64::default(),
            retries: AtomicU64::default(),
            active: AtomicU64::default(),
            queued: AtomicU64::default(),
            requeues: AtomicU64::default(),
            pass_running: AtomicU64::default(),
            pass_objects: AtomicU64::default(),
            pass_read: AtomicU64::default(),
        }
    }
}

/// A handle on a controller's live counters ([`Controller::stats`](crate::Controller::stats)),
/// cheap to clone; [`get`](ControllerStats::get) reads them.
///
/// ```
/// let stats = kube_persist::controller::ControllerStats::default();
/// let now = stats.get();
/// assert_eq!(now.reconciles(), 0);
/// assert_eq!(now.queue_depth, 0);
/// ```
#[derive(Debug, Clone, Default)]
pub struct ControllerStats {
    inner: Arc<Counters>,
}

/// What a controller has done so far, read by [`ControllerStats::get`].
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct ControllerCounts {
    /// Reconciles that returned `Ok` with no requeue (`Action::await_change`).
    pub reconciled: u64,
    /// Reconciles that returned `Ok` with a requeue (`Action::requeue`).
    pub requeued: u64,
    /// Reconciles that returned `Err` (the error policy then decided the requeue).
    pub failed: u64,
    /// Requests not run because the durable reconcile state showed the object's version
    /// handled already.
    pub skipped: u64,
    /// Cumulative reconcile counts per bucket: `(upper bound in seconds, reconciles that
    /// took at most that)`, ending with `f64::INFINITY`.
    pub duration_buckets: Vec<(f64, u64)>,
    /// Time spent in reconciles, summed.
    pub duration_sum: Duration,
    /// Reconciles running now.
    pub active: u64,
    /// Requests waiting in the scheduler that are not requeues: changes, related triggers,
    /// passes, the startup pass (each object at most once: the scheduler merges requests).
    pub queue_depth: u64,
    /// Requeues and retries waiting in the scheduler (those the reconciler or the error
    /// policy asked for, and those the durable state holds due within its window). A
    /// durable controller's requeues due later wait on disk, not here
    /// ([`Db::controller_states`](crate::Db::controller_states) counts those).
    pub pending_requeues: u64,
    /// Whether a startup pass (or the wait for the store to catch up before it) runs.
    pub startup_pass_running: bool,
    /// Objects in the store when the last startup pass began.
    pub startup_pass_objects: u64,
    /// Objects the startup passes have read so far (of `startup_pass_objects` each).
    pub startup_pass_read: u64,
    /// Requests added to the queue: a request for an object that had none waiting
    /// (controller-runtime's `workqueue_adds_total`).
    pub queue_adds: u64,
    /// Retries the error policy asked for (controller-runtime's `workqueue_retries_total`).
    pub queue_retries: u64,
    /// Cumulative queue wait counts per bucket: `(upper bound in seconds, requests that
    /// waited at most that)` from being due to their reconcile's start (or their skip),
    /// ending with `f64::INFINITY`.
    pub queue_wait_buckets: Vec<(f64, u64)>,
    /// Time requests waited in the queue once due, summed.
    pub queue_wait_sum: Duration,
}

impl ControllerCounts {
    /// Reconciles that ran to completion, whatever their result.
    pub fn reconciles(&self) -> u64 {
        self.reconciled + self.requeued + self.failed
    }
}

/// Which gauge of the scheduler a waiting request counts in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Waiting {
    /// A change, a related trigger, a pass or the startup pass.
    Queued,
    /// A requeue or retry.
    Requeue,
}

impl ControllerStats {
    /// The counters as of now.
    pub fn get(&self) -> ControllerCounts {
        let c = &*self.inner;
        let durations = c.durations.snapshot();
        let waits = c.waits.snapshot();
        ControllerCounts {
            reconciled: c.ok.load(Relaxed),
            requeued: c.requeued.load(Relaxed),
            failed: c.failed.load(Relaxed),
            skipped: c.skipped.load(Relaxed),
            duration_buckets: durations.buckets,
            duration_sum: Duration::from_secs_f64(durations.sum),
            active: c.active.load(Relaxed),
            queue_depth: c.queued.load(Relaxed),
            pending_requeues: c.requeues.load(Relaxed),
            startup_pass_running: c.pass_running.load(Relaxed) > 0,
            startup_pass_objects: c.pass_objects.load(Relaxed),
            startup_pass_read: c.pass_read.load(Relaxed),
            queue_adds: c.adds.load(Relaxed),
            queue_retries: c.retries.load(Relaxed),
            queue_wait_buckets: waits.buckets,
            queue_wait_sum: Duration::from_secs_f64(waits.sum),
        }
    }

    /// A reconcile started.
    pub(crate) fn started(&self) {
        self.inner.active.fetch_add(1, Relaxed);
    }

    /// A reconcile that took `took` finished: `Ok` with or without a requeue, or `Err`.
    pub(crate) fn finished(&self, took: Duration, ok: bool, requeue: bool) {
        let c = &*self.inner;
        c.active.fetch_sub(1, Relaxed);
        match (ok, requeue) {
            (true, false) => &c.ok,
            (true, true) => &c.requeued,
            (false, _) => &c.failed,
        }
        .fetch_add(1, Relaxed);
        c.durations.observe(took.as_secs_f64());
    }

    /// A request was added for an object that had none waiting.
    pub(crate) fn added(&self) {
        self.inner.adds.fetch_add(1, Relaxed);
    }

    /// The error policy asked for a retry.
    pub(crate) fn retried(&self) {
        self.inner.retries.fetch_add(1, Relaxed);
    }

    /// A due request waited `waited` before its dispatch.
    pub(crate) fn waited(&self, waited: Duration) {
        self.inner.waits.observe(waited.as_secs_f64());
    }

    /// A running reconcile was aborted (its controller was dropped).
    pub(crate) fn aborted(&self) {
        self.inner.active.fetch_sub(1, Relaxed);
    }

    pub(crate) fn skipped(&self) {
        self.inner.skipped.fetch_add(1, Relaxed);
    }

    fn gauge(&self, waiting: Waiting) -> &AtomicU64 {
        match waiting {
            Waiting::Queued => &self.inner.queued,
            Waiting::Requeue => &self.inner.requeues,
        }
    }

    /// A request began waiting in the scheduler.
    pub(crate) fn enqueued(&self, waiting: Waiting) {
        self.gauge(waiting).fetch_add(1, Relaxed);
    }

    /// A request left the scheduler.
    pub(crate) fn dequeued(&self, waiting: Waiting) {
        self.gauge(waiting).fetch_sub(1, Relaxed);
    }

    /// A startup pass over `objects` stored objects began (or its wait for the store did).
    pub(crate) fn pass_began(&self, objects: Option<u64>) {
        self.inner.pass_running.store(1, Relaxed);
        if let Some(n) = objects {
            self.inner.pass_objects.store(n, Relaxed);
        }
    }

    /// The startup pass read `n` more objects.
    pub(crate) fn pass_read(&self, n: u64) {
        self.inner.pass_read.fetch_add(n, Relaxed);
    }

    pub(crate) fn pass_ended(&self) {
        self.inner.pass_running.store(0, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_fall_in_cumulative_buckets() {
        let s = ControllerStats::default();
        let runs = [
            (1, true, false),
            (30, true, true),
            (2000, false, false),
            (1_000_000, true, false),
        ];
        for (ms, ok, requeue) in runs {
            s.started();
            s.finished(Duration::from_millis(ms), ok, requeue);
        }
        s.started(); // still running
        let c = s.get();
        assert_eq!((c.reconciled, c.requeued, c.failed), (2, 1, 1));
        assert_eq!(c.reconciles(), 4);
        assert_eq!(c.active, 1);
        let at = |bound: f64| c.duration_buckets.iter().find(|b| b.0 == bound).unwrap().1;
        assert_eq!(at(0.005), 1);
        assert_eq!(at(0.05), 2);
        assert_eq!(at(2.5), 3);
        assert_eq!(at(300.0), 3);
        assert_eq!(at(f64::INFINITY), 4);
        assert_eq!(
            c.duration_sum,
            Duration::from_millis(1 + 30 + 2000 + 1_000_000)
        );
    }
}
