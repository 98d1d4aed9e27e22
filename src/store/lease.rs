//! One writer per keyspace in a process, held until its last disk job ran.
//!
//! A stream's (or a durable controller's) writer is shared with the jobs it queued on the
//! disk thread. When its watcher is dropped (an aborted task, a controller shutdown, a
//! lost leader election), those jobs still run, later. A new writer opened meanwhile
//! would read the keyspace's state from before them and resume from an older checkpoint;
//! so the lease is owned by the writer and released only when the last job holding the
//! writer is done, and opening a keyspace whose previous owner is closing waits for that
//! instead of failing.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// How long an open waits for the previous owner's queued jobs before it gives up.
pub(crate) const CLOSING_WAIT: Duration = Duration::from_secs(60);

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

    /// Take `name` (a stream, or `controller/<name>`): an error if a live owner holds it;
    /// if its previous owner is closing, wait (blocking, at most [`CLOSING_WAIT`]) until
    /// that owner's last queued job ran.
    /// The lease keeps `owner` (the database handle) alive.
    pub(crate) fn acquire(
        self: &Arc<Self>,
        name: &str,
        what: &str,
        owner: Arc<dyn Any + Send + Sync>,
    ) -> Result<StreamLease> {
        let deadline = Instant::now() + CLOSING_WAIT;
        let mut held = self.lock();
        loop {
            match held.get(name) {
                None => break,
                Some(Hold::Open(_)) => {
                    return Err(Error::Config(format!(
                        "{what} {name:?} is already open in this process (one writer per {what})"
                    )));
                }
                Some(Hold::Closing(_)) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(Error::Config(format!(
                            "{what} {name:?} was closed, but its last writes were still queued \
                             on the disk thread after {} s",
                            CLOSING_WAIT.as_secs()
                        )));
                    }
                    tracing::debug!(
                        name,
                        "waiting for the previous writer's queued disk jobs before reopening"
                    );
                    held = self
                        .released
                        .wait_timeout(held, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
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
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_closing_keyspace_is_reopened_once_its_lease_is_released() {
        let leases = Arc::new(Leases::default());
        let lease = leases.acquire("pods", "stream", Arc::new(())).unwrap();
        let closer = lease.closer();
        // A live owner: refused at once.
        assert!(matches!(
            leases.acquire("pods", "stream", Arc::new(())),
            Err(Error::Config(_))
        ));
        drop(closer);
        // Closing: the open waits for the lease (held here by a "queued job" on a thread).
        let job = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            drop(lease);
        });
        let again = leases.acquire("pods", "stream", Arc::new(())).unwrap();
        job.join().unwrap();
        assert!(matches!(
            leases.acquire("pods", "stream", Arc::new(())),
            Err(Error::Config(_))
        ));
        drop(again);
        leases.acquire("pods", "stream", Arc::new(())).unwrap();
    }

    #[test]
    fn an_owner_dropped_without_queued_jobs_releases_at_once() {
        let leases = Arc::new(Leases::default());
        let lease = leases.acquire("pods", "stream", Arc::new(())).unwrap();
        let closer = lease.closer();
        drop(lease);
        drop(closer); // after the release: must not mark a new holder closing
        let second = leases.acquire("pods", "stream", Arc::new(())).unwrap();
        let _closer = second.closer();
        assert!(matches!(
            leases.acquire("pods", "stream", Arc::new(())),
            Err(Error::Config(_))
        ));
    }
}
