//! Durable reconcile state: what the runner writes after each reconcile, and the requeues
//! it reads back from disk when they come due.
//!
//! - Each finished reconcile becomes a [`StateOp`]; ops are batched in memory for at most
//!   [`FLUSH_AFTER`] (or [`FLUSH_OPS`] ops) and written in one batch on the store's disk
//!   thread. The state of an object is written only after its reconcile returned, so a
//!   crash before the write reconciles it again (at least once, never skipped).
//! - Ops not yet committed are kept by object until their batch commits, so that the
//!   runner's decisions (skip a change already reconciled) see them.
//! - Requeues due before `loaded_until` are in kube-runtime's scheduler; later ones stay on
//!   disk. Every half window a scan on the disk thread (after the ops batched so far) reads
//!   the requeues due in `[loaded_until, now + window)` and hands them to the scheduler.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use tokio::time::{Instant, Sleep};

use super::scan::PassRecord;
use crate::controller::keyspace::{
    ControllerIdentity, ControllerKeyspace, MERGE_PASS_KEY, ReconcileRecord, StateOp,
    TICKS_PASS_KEY, unix_ms,
};
use crate::exec::DiskWorker;

/// Most ops batched before a write is submitted.
const FLUSH_OPS: usize = 512;
/// Longest an op waits in memory before its batch is submitted.
const FLUSH_AFTER: Duration = Duration::from_millis(20);

/// Wall-clock now, unix ms.
pub(crate) fn now_ms() -> u64 {
    unix_ms(SystemTime::now())
}

/// The tokio instant of a wall-clock due time (now if it is past).
pub(crate) fn instant_at(due_ms: u64) -> Instant {
    let now = now_ms();
    Instant::now() + Duration::from_millis(due_ms.saturating_sub(now))
}

/// A due-time scan on the disk thread: (object suffix, due ms) of the requeues it found.
type DueScan = BoxFuture<'static, crate::model::Result<Vec<(Vec<u8>, u64)>>>;

/// A test hook, in builds with debug assertions only (the test command's: see the
/// workspace's Cargo.toml): `KUBE_PERSIST_TEST_STATE_INIT_DELAY_MS` holds the identity
/// check that many milliseconds on the disk thread, so that a test can pin what a runner
/// does when its stores are ready before its durable state is read (a warm store is ready
/// at once). Read once per process.
#[cfg(debug_assertions)]
fn delay_init_for_tests() {
    static DELAY: std::sync::OnceLock<Option<Duration>> = std::sync::OnceLock::new();
    let delay = DELAY.get_or_init(|| {
        let ms = std::env::var("KUBE_PERSIST_TEST_STATE_INIT_DELAY_MS").ok()?;
        Some(Duration::from_millis(ms.trim().parse().ok()?))
    });
    if let Some(delay) = delay {
        std::thread::sleep(*delay);
    }
}

/// The passes a previous run left under way: the ticks' pass and the merge pass.
#[derive(Debug, Default)]
pub(crate) struct Resumed {
    pub(crate) ticks: Option<PassRecord>,
    pub(crate) merge: Option<PassRecord>,
}

/// What the identity check found: whether the state held objects, and its passes.
type Init = crate::model::Result<(bool, Resumed)>;

/// The durable side of one controller run.
pub(crate) struct Durable {
    ks: Arc<ControllerKeyspace>,
    /// Dropped with the controller: a controller of the same name opened next waits for
    /// the batches this one left queued on the disk thread.
    _closer: crate::disk::LeaseCloser,
    worker: DiskWorker,
    window: Duration,
    init: Option<BoxFuture<'static, Init>>,
    /// Whether the state held objects at start (known once `init` finished).
    existed: Option<bool>,
    /// The passes the previous run left, until the runner takes them.
    resumed: Option<Resumed>,
    pending: Vec<StateOp>,
    /// Passes' records to write with the next batch, the latest of each.
    pending_passes: HashMap<&'static [u8], PassRecord>,
    flush_timer: Option<Pin<Box<Sleep>>>,
    seq: u64,
    writes: FuturesUnordered<BoxFuture<'static, (u64, crate::model::Result<()>)>>,
    /// Ops not committed yet, by object suffix, with the sequence number of their batch.
    uncommitted: HashMap<Vec<u8>, Vec<(u64, StateOp)>>,
    /// Requeues due before this (unix ms) are in the scheduler; `0`: no startup pass yet.
    loaded_until: u64,
    tick: Option<Pin<Box<Sleep>>>,
    scan: Option<DueScan>,
}

impl Durable {
    pub(crate) fn new(
        ks: ControllerKeyspace,
        worker: DiskWorker,
        identity: ControllerIdentity,
        window: Duration,
    ) -> Self {
        let closer = ks.closer();
        let ks = Arc::new(ks);
        let check = ks.clone();
        let init = worker
            .submit(move || {
                #[cfg(debug_assertions)]
                delay_init_for_tests();
                let existed = check.check_identity(&identity)?;
                let resumed = Resumed {
                    ticks: check.pass(TICKS_PASS_KEY)?,
                    merge: check.pass(MERGE_PASS_KEY)?,
                };
                Ok((existed, resumed))
            })
            .boxed();
        Durable {
            ks,
            _closer: closer,
            worker,
            window,
            init: Some(init),
            existed: None,
            resumed: None,
            pending: Vec::new(),
            pending_passes: HashMap::new(),
            flush_timer: None,
            seq: 0,
            writes: FuturesUnordered::new(),
            uncommitted: HashMap::new(),
            loaded_until: 0,
            tick: None,
            scan: None,
        }
    }

    pub(crate) fn keyspace(&self) -> Arc<ControllerKeyspace> {
        self.ks.clone()
    }

    /// `Some(existed)` once the identity check is done.
    pub(crate) fn poll_init(&mut self, cx: &mut Context<'_>) -> Poll<crate::model::Result<bool>> {
        if let Some(existed) = self.existed {
            return Poll::Ready(Ok(existed));
        }
        let Some(init) = self.init.as_mut() else {
            return Poll::Ready(Ok(false));
        };
        let res = futures::ready!(init.poll_unpin(cx));
        self.init = None;
        let existed = match res {
            Ok((e, resumed)) => {
                self.resumed = Some(resumed);
                e
            }
            Err(e) => {
                // Without a readable state, every object counts as never reconciled.
                self.existed = Some(false);
                return Poll::Ready(Err(e));
            }
        };
        self.existed = Some(existed);
        Poll::Ready(Ok(existed))
    }

    /// Whether the identity check is done (and the passes the previous run left are known).
    pub(crate) fn initialized(&self) -> bool {
        self.existed.is_some()
    }

    /// Requeues due from now on are read from disk up to `now + window`; the startup pass
    /// handles everything due before that.
    pub(crate) fn start_window(&mut self) -> u64 {
        self.loaded_until = now_ms() + self.window.as_millis() as u64;
        self.tick = Some(Box::pin(tokio::time::sleep(self.window / 2)));
        self.loaded_until
    }

    /// Whether a requeue due at `due_ms` belongs in the scheduler now (else it stays on
    /// disk until the scan that reaches it).
    pub(crate) fn in_window(&self, due_ms: u64) -> bool {
        self.loaded_until == 0 || due_ms < self.loaded_until
    }

    /// The passes the previous run left under way (once, after the identity check).
    pub(crate) fn take_resumed(&mut self) -> Option<Resumed> {
        self.resumed.take()
    }

    /// Records how far a pass is, with the next batch.
    pub(crate) fn set_pass(&mut self, key: &'static [u8], record: PassRecord) {
        self.pending_passes.insert(key, record);
        self.arm_flush();
    }

    fn arm_flush(&mut self) {
        if self.pending.len() >= FLUSH_OPS {
            self.flush();
        } else if self.flush_timer.is_none() {
            self.flush_timer = Some(Box::pin(tokio::time::sleep(FLUSH_AFTER)));
        }
    }

    pub(crate) fn push(&mut self, op: StateOp) {
        self.uncommitted
            .entry(op.suffix().to_vec())
            .or_default()
            .push((self.seq, op.clone()));
        self.pending.push(op);
        self.arm_flush();
    }

    /// Submit the batched ops to the disk thread.
    pub(crate) fn flush(&mut self) {
        self.flush_timer = None;
        if self.pending.is_empty() && self.pending_passes.is_empty() {
            return;
        }
        let ops = std::mem::take(&mut self.pending);
        let passes: Vec<_> = self.pending_passes.drain().collect();
        let ks = self.ks.clone();
        let seq = self.seq;
        self.seq += 1;
        let write = self.worker.submit(move || ks.apply(&ops, &passes));
        self.writes.push(async move { (seq, write.await) }.boxed());
    }

    /// The ops of `suffix` not committed yet, in order (to apply over the record on disk:
    /// applying an op again is harmless).
    pub(crate) fn uncommitted(&self, suffix: &[u8]) -> Vec<StateOp> {
        self.uncommitted
            .get(suffix)
            .map(|v| v.iter().map(|(_, op)| op.clone()).collect())
            .unwrap_or_default()
    }

    /// Whether nothing is left to write.
    pub(crate) fn idle(&self) -> bool {
        self.pending.is_empty() && self.pending_passes.is_empty() && self.writes.is_empty()
    }

    /// Drives the batching timer, the writes, and the due-time scans. Returns write or
    /// scan errors, and the requeues a scan found (object suffix, due ms).
    pub(crate) fn poll(
        &mut self,
        cx: &mut Context<'_>,
        errors: &mut Vec<crate::model::Error>,
    ) -> Vec<(Vec<u8>, u64)> {
        if let Some(t) = self.flush_timer.as_mut()
            && t.poll_unpin(cx).is_ready()
        {
            self.flush();
        }
        while let Poll::Ready(Some((seq, res))) = self.writes.poll_next_unpin(cx) {
            if let Err(e) = res {
                tracing::warn!(error = %e, "writing the reconcile state failed; those objects are reconciled again after a restart");
                errors.push(e);
            }
            self.uncommitted.retain(|_, ops| {
                ops.retain(|(s, _)| *s > seq);
                !ops.is_empty()
            });
        }
        if let Some(t) = self.tick.as_mut()
            && t.poll_unpin(cx).is_ready()
            && self.scan.is_none()
        {
            // Ops batched so far go first: the scan (on the same thread) sees them.
            self.flush();
            let from = self.loaded_until;
            let to = now_ms() + self.window.as_millis() as u64;
            self.loaded_until = to.max(from);
            let ks = self.ks.clone();
            self.scan = Some(self.worker.submit(move || ks.due_between(from, to)).boxed());
            self.tick = Some(Box::pin(tokio::time::sleep(self.window / 2)));
            if let Some(t) = self.tick.as_mut() {
                let _ = t.poll_unpin(cx);
            }
        }
        if let Some(scan) = self.scan.as_mut()
            && let Poll::Ready(res) = scan.poll_unpin(cx)
        {
            self.scan = None;
            match res {
                Ok(due) => return due,
                Err(e) => errors.push(e),
            }
        }
        Vec::new()
    }
}

/// The effective record of an object: the one on disk with the uncommitted ops applied.
pub(crate) fn effective(
    ks: &ControllerKeyspace,
    suffix: &[u8],
    uncommitted: &[StateOp],
) -> crate::model::Result<Option<ReconcileRecord>> {
    let mut rec = ks.get(suffix)?;
    for op in uncommitted {
        rec = op.apply_to(rec);
    }
    Ok(rec)
}
