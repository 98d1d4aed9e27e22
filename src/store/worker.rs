//! The disk worker: one dedicated OS thread per [`Db`](super::Db) that runs every write
//! (engine commits, fsyncs, compression, encryption) and the CPU-heavy parsing of pages and
//! watch bursts, so that none of it runs on a tokio worker thread.
//!
//! Async callers hand it a closure and await a oneshot answer. This works the same under a
//! multi-threaded runtime, a `current_thread` runtime and a `LocalSet` (where
//! `block_in_place` would panic). Jobs of all streams of one directory run one after the
//! other: they share one disk.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use crate::error::{Error, Result};

type Job = Box<dyn FnOnce() + Send>;

/// A handle to the disk thread of one store directory. Cheap to clone; the thread ends
/// when the last handle is dropped.
#[derive(Clone, Debug)]
pub(crate) struct DiskWorker {
    tx: mpsc::Sender<Job>,
    path: PathBuf,
}

impl DiskWorker {
    /// Start the disk thread of the store at `path`.
    pub(crate) fn spawn(path: &Path) -> Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("kube-persist-disk".into())
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    // A panicking job drops its answer channel; the caller gets an error.
                    let _ = catch_unwind(AssertUnwindSafe(job));
                }
            })
            .map_err(|source| Error::Io {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(DiskWorker {
            tx,
            path: path.to_path_buf(),
        })
    }

    /// Queue `job` on the disk thread now (jobs run in the order they are queued); the
    /// returned future, which borrows nothing, yields its result without blocking the
    /// caller's thread. If the caller stops waiting, the job still runs to completion.
    pub(crate) fn submit<R: Send + 'static>(
        &self,
        job: impl FnOnce() -> Result<R> + Send + 'static,
    ) -> impl std::future::Future<Output = Result<R>> + Send + 'static {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let sent = self
            .tx
            .send(Box::new(move || {
                let _ = tx.send(job());
            }))
            .is_ok();
        let path = self.path.clone();
        async move {
            let lost = || Error::Storage {
                path,
                detail: "the disk worker thread stopped (a storage operation panicked)".into(),
            };
            if !sent {
                return Err(lost());
            }
            rx.await.map_err(|_| lost())?
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_jobs_off_the_runtime_and_survives_panics() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let worker = DiskWorker::spawn(Path::new("/tmp/x")).unwrap();
        let caller = std::thread::current().id();
        let ran_on = rt
            .block_on(worker.submit(|| Ok(std::thread::current().id())))
            .unwrap();
        assert_ne!(ran_on, caller);
        let err = rt
            .block_on(worker.submit(|| -> Result<()> { panic!("boom") }))
            .unwrap_err();
        assert!(matches!(err, Error::Storage { .. }), "{err}");
        assert_eq!(rt.block_on(worker.submit(|| Ok(7))).unwrap(), 7);
    }
}
