//! Which store directories this process still holds open in an engine.
//!
//! Dropping the last `Db` handle does not close the engine's files at once: a write queued on
//! the disk thread, a read on a blocking thread, a scan a caller still iterates and redb's
//! final flush (an fsync, seconds on a loaded disk) each hold the engine until they end. A
//! [`Held`] mark lives as long as the engine does (it is the last field the engine drops), so
//! a reopen in this process can wait for that moment ([`wait_released`]) instead of guessing
//! how long it takes.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Open engines per directory (canonical path), and the signal that one closed.
static HELD: Mutex<Option<HashMap<PathBuf, usize>>> = Mutex::new(None);
static RELEASED: Condvar = Condvar::new();

fn held() -> MutexGuard<'static, Option<HashMap<PathBuf, usize>>> {
    HELD.lock().unwrap_or_else(|p| p.into_inner())
}

/// The canonical form of `dir` where it resolves (it does while the store exists), so that
/// `./cache` and `/abs/cache` name one directory.
fn canonical(dir: &Path) -> PathBuf {
    std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf())
}

/// Marks `dir` as held open by an engine of this process until dropped.
#[derive(Debug)]
pub(crate) struct Held {
    dir: PathBuf,
}

impl Held {
    /// Mark `dir` (the store directory) as open. Blocking: resolves the path on disk.
    pub(crate) fn new(dir: &Path) -> Held {
        let dir = canonical(dir);
        *held()
            .get_or_insert_with(HashMap::new)
            .entry(dir.clone())
            .or_default() += 1;
        Held { dir }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut held = held();
        if let Some(map) = held.as_mut()
            && let Some(n) = map.get_mut(&self.dir)
        {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.dir);
            }
        }
        drop(held);
        RELEASED.notify_all();
    }
}

/// Wait, up to `within`, until no engine of this process holds `dir` open. Returns whether
/// one did when called (the caller's grace period for the engine's own deferred release
/// then starts now), or `None` if one still does after `within`. Blocks the calling thread.
pub(crate) fn wait_released(dir: &Path, within: Duration) -> Option<bool> {
    let dir = canonical(dir);
    let deadline = Instant::now() + within;
    let mut held = held();
    let mut waited = false;
    while held.as_ref().is_some_and(|m| m.contains_key(&dir)) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        if !waited {
            tracing::debug!(path = %dir.display(), "waiting for this process's last handles on the store to close");
        }
        waited = true;
        held = RELEASED
            .wait_timeout(held, left)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
    Some(waited)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_ends_when_the_last_mark_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(wait_released(dir.path(), Duration::ZERO), Some(false));
        let (a, b) = (Held::new(dir.path()), Held::new(dir.path()));
        drop(a);
        assert_eq!(
            wait_released(dir.path(), Duration::ZERO),
            None,
            "b holds it"
        );
        let releaser = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            drop(b);
        });
        assert_eq!(
            wait_released(dir.path(), Duration::from_secs(60)),
            Some(true)
        );
        releaser.join().unwrap();
    }
}
