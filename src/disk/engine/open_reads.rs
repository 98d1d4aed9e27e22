//! The reads open on a store directory (range scans: iterations, sweeps, dumps), so that
//! the age of the oldest can be watched (`kube_persist_oldest_read_seconds`): a reader that
//! never finishes is a leak an operator wants to see. Both engines' scans re-open their
//! snapshot every few hundred entries (redb's read transactions), so a long read does not
//! pin old pages; its age is still worth knowing.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The open reads of one store directory, oldest first.
#[derive(Debug, Default)]
pub(crate) struct OpenReads {
    next: AtomicU64,
    /// By id (ids only grow, so the first is the oldest): when each began.
    open: Mutex<BTreeMap<u64, Instant>>,
}

/// An open read: counted until dropped.
#[derive(Debug)]
pub(crate) struct ReadGuard {
    reads: Arc<OpenReads>,
    id: u64,
}

impl OpenReads {
    /// A read begins now.
    pub(crate) fn begin(self: &Arc<Self>) -> ReadGuard {
        let id = self.next.fetch_add(1, Relaxed);
        self.lock().insert(id, Instant::now());
        ReadGuard {
            reads: self.clone(),
            id,
        }
    }

    /// How long the oldest open read has been open; `None` if none is.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(crate) fn oldest(&self) -> Option<Duration> {
        self.lock().values().next().map(Instant::elapsed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Instant>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for ReadGuard {
    fn drop(&mut self) {
        self.reads.lock().remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_open_read_is_the_first_still_held() {
        let reads = Arc::new(OpenReads::default());
        assert_eq!(reads.oldest(), None);
        let first = reads.begin();
        std::thread::sleep(Duration::from_millis(20));
        let second = reads.begin();
        assert!(reads.oldest().unwrap() >= Duration::from_millis(20));
        drop(first);
        assert!(reads.oldest().unwrap() < Duration::from_millis(20));
        drop(second);
        assert_eq!(reads.oldest(), None);
    }
}
