//! One writer per keyspace in a process, held until its last disk job ran.
//!
//! A stream's (or a durable controller's) writer is shared with the jobs it queued on the
//! disk thread. When its watcher is dropped (an aborted task, a controller shutdown, a
//! lost leader election), those jobs still run, later. A new writer opened meanwhile
//! would read the keyspace's state from before them and resume from an older checkpoint;
//! so the lease is owned by the writer and released only when the last job holding the
//! writer is done, and opening a keyspace whose previous owner is closing waits for that
//! instead of failing.
//!
//! An owner whose task was aborted (`JoinHandle::abort`, not awaited) is not dropped yet
//! when `abort` returns: the runtime drops it when it next runs that task, usually on this
//! very worker thread. An open that finds a live owner waits for it a little
//! ([`ABORT_GRACE`]), inside `block_in_place` on a multi-thread runtime so that this
//! worker's queue (which holds the aborted task) moves to another thread meanwhile. On a
//! current-thread runtime nothing else runs while the open blocks: it fails at once, and
//! the caller awaits the aborted handle first.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::runtime::{Handle, RuntimeFlavor};

/// Why a lease was refused (the caller, which knows the store's path, makes the error:
/// [`Error::StreamInUse`](crate::Error::StreamInUse) and the like).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// A live owner holds it.
    Open,
    /// Its previous owner's last jobs were still queued after this wait.
    Closing(Duration),
}

/// How long an open waits for the previous owner's queued jobs before it gives up.
pub(crate) const CLOSING_WAIT: Duration = Duration::from_secs(60);

/// How long an open waits for a live owner to be dropped (its task just aborted) before
/// it reports the keyspace as already open.
pub(crate) const ABORT_GRACE: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hold {
    /// Held by a live owner (a watcher, a controller).
    Open(u64),
    /// The owner is gone; its last jobs may still be queued on the disk thread.
    Closing(u64),
}

/// The keyspaces held in one process for one store directory.
#[derive(Debug, Default)]
pub(crate) struct Leases {
    held: Mutex<HashMap<String, Hold>>,
    released: Condvar,
    next_id: Mutex<u64>,
}

impl Leases {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Hold>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Take `name` (a stream, or `controller/<name>`): an error if a live owner still
    /// holds it after [`ABORT_GRACE`] (at once on a current-thread runtime); if its
    /// previous owner is closing, wait (blocking, at most [`CLOSING_WAIT`]) until that
    /// owner's last queued job ran.
    /// The lease keeps `owner` (the database handle) alive.
    pub(crate) fn acquire(
        self: &Arc<Self>,
        name: &str,
        owner: Arc<dyn Any + Send + Sync>,
    ) -> Result<StreamLease, Refused> {
        self.acquire_within(name, owner, ABORT_GRACE)
    }

    fn acquire_within(
        self: &Arc<Self>,
        name: &str,
        owner: Arc<dyn Any + Send + Sync>,
        grace: Duration,
    ) -> Result<StreamLease, Refused> {
        let now = Instant::now();
        let (deadline, grace_deadline) = (now + CLOSING_WAIT, now + grace);
        let mut held = self.lock();
        loop {
            match held.get(name) {
                None => break,
                Some(Hold::Open(_)) => {
                    let left = grace_deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() || on_current_thread_runtime() {
                        return Err(Refused::Open);
                    }
                    tracing::debug!(name, "waiting for the open owner to be dropped (aborted)");
                    held = self.wait(held, left);
                }
                Some(Hold::Closing(_)) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(Refused::Closing(CLOSING_WAIT));
                    }
                    tracing::debug!(
                        name,
                        "waiting for the previous writer's queued disk jobs before reopening"
                    );
                    held = self.wait(held, left);
                }
            }
        }
        let id = {
            let mut n = self.next_id.lock().unwrap_or_else(|p| p.into_inner());
            *n += 1;
            *n
        };
        held.insert(name.to_string(), Hold::Open(id));
        Ok(StreamLease {
            leases: self.clone(),
            name: name.to_string(),
            id,
            _owner: owner,
        })
    }

    /// Wait (at most `left`) for a change of the leases. On a multi-thread tokio runtime,
    /// inside `block_in_place`: the runtime meanwhile runs this worker's queue on another
    /// thread, where an aborted owner's task is dropped.
    fn wait<'a>(
        &self,
        held: MutexGuard<'a, HashMap<String, Hold>>,
        left: Duration,
    ) -> MutexGuard<'a, HashMap<String, Hold>> {
        let wait = move || {
            self.released
                .wait_timeout(held, left)
                .unwrap_or_else(|p| p.into_inner())
                .0
        };
        match Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(wait),
            _ => wait(),
        }
    }
}

/// Whether this thread is in a current-thread runtime (where an aborted task cannot be
/// dropped while the thread blocks).
fn on_current_thread_runtime() -> bool {
    Handle::try_current().is_ok_and(|h| h.runtime_flavor() == RuntimeFlavor::CurrentThread)
}

/// Holds a keyspace for its writer; released when dropped (after the last job that
/// shares the writer). Give the owner a [`StreamLease::closer`].
pub(crate) struct StreamLease {
    leases: Arc<Leases>,
    name: String,
    id: u64,
    _owner: Arc<dyn Any + Send + Sync>,
}

impl StreamLease {
    /// The owner's handle: dropping it marks the keyspace closing, so that the next open
    /// waits for this lease instead of failing.
    pub(crate) fn closer(&self) -> LeaseCloser {
        LeaseCloser {
            leases: self.leases.clone(),
            name: self.name.clone(),
            id: self.id,
        }
    }
}

impl Drop for StreamLease {
    fn drop(&mut self) {
        let mut held = self.leases.lock();
        if matches!(held.get(&self.name), Some(Hold::Open(id) | Hold::Closing(id)) if *id == self.id)
        {
            held.remove(&self.name);
        }
        drop(held);
        self.leases.released.notify_all();
    }
}

/// See [`StreamLease::closer`].
pub(crate) struct LeaseCloser {
    leases: Arc<Leases>,
    name: String,
    id: u64,
}

impl Drop for LeaseCloser {
    fn drop(&mut self) {
        let mut held = self.leases.lock();
        if let Some(h) = held.get_mut(&self.name)
            && *h == Hold::Open(self.id)
        {
            *h = Hold::Closing(self.id);
        }
        drop(held);
        // An open waiting for a live owner (aborted) goes on to wait for its jobs.
        self.leases.released.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An open that does not wait for a live owner.
    fn refused(leases: &Arc<Leases>) -> bool {
        matches!(
            leases.acquire_within("pods", Arc::new(()), Duration::ZERO),
            Err(Refused::Open)
        )
    }

    #[test]
    fn a_closing_keyspace_is_reopened_once_its_lease_is_released() {
        let leases = Arc::new(Leases::default());
        let lease = leases.acquire("pods", Arc::new(())).unwrap();
        let closer = lease.closer();
        // A live owner: refused once the grace is over.
        assert!(refused(&leases));
        drop(closer);
        // Closing: the open waits for the lease (held here by a "queued job" on a thread).
        let job = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            drop(lease);
        });
        let again = leases.acquire("pods", Arc::new(())).unwrap();
        job.join().unwrap();
        assert!(refused(&leases));
        drop(again);
        leases.acquire("pods", Arc::new(())).unwrap();
    }

    #[test]
    fn an_owner_dropped_without_queued_jobs_releases_at_once() {
        let leases = Arc::new(Leases::default());
        let lease = leases.acquire("pods", Arc::new(())).unwrap();
        let closer = lease.closer();
        drop(lease);
        drop(closer); // after the release: must not mark a new holder closing
        let second = leases.acquire("pods", Arc::new(())).unwrap();
        let _closer = second.closer();
        assert!(refused(&leases));
    }

    /// An owner dropped during the grace (its task was aborted), with a job still queued:
    /// the open waits for the drop, then for the job.
    #[test]
    fn an_owner_dropped_during_the_grace_is_waited_for() {
        let leases = Arc::new(Leases::default());
        let lease = leases.acquire("pods", Arc::new(())).unwrap();
        let closer = lease.closer();
        let owner = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            drop(closer);
            std::thread::sleep(Duration::from_millis(50));
            drop(lease);
        });
        let again = leases.acquire_within("pods", Arc::new(()), Duration::from_secs(30));
        owner.join().unwrap();
        let _again = again.unwrap();
        assert!(refused(&leases));
    }

    /// On a current-thread runtime an aborted task is dropped only once the caller yields:
    /// the open fails at once instead of blocking the runtime for the grace.
    #[test]
    fn a_live_owner_on_a_current_thread_runtime_is_refused_at_once() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let leases = Arc::new(Leases::default());
        let lease = leases.acquire("pods", Arc::new(())).unwrap();
        let _closer = lease.closer();
        let started = Instant::now();
        let second = rt.block_on(async {
            leases.acquire_within("pods", Arc::new(()), Duration::from_secs(30))
        });
        assert!(matches!(second, Err(Refused::Open)));
        assert!(started.elapsed() < Duration::from_secs(30));
    }
}
