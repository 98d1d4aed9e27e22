//! The threads that do kube-persist's blocking and CPU-heavy work, so that none of it runs
//! on a tokio worker thread, in a number that does not grow with the number of streams:
//!
//! - the **disk worker**: one dedicated OS thread per [`Db`](super::Db) that runs every
//!   write (engine commits, fsyncs, compression, encryption). Jobs of all streams of one
//!   directory run one after the other: they share one disk.
//! - the **CPU threads** ([`cpu`]): one per core (at most 8), started on first use and
//!   shared by every store in the process. They parse list pages and watch bursts and
//!   decode ahead of iterations. A process with twenty streams starting at once has the
//!   same threads as with one.
//!
//! Async callers hand a closure over and await a oneshot answer. This works the same under
//! a multi-threaded runtime, a `current_thread` runtime and a `LocalSet` (where
//! `block_in_place` would panic). A job that panics is caught: its caller gets an error,
//! and the thread goes on with the next job.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, mpsc};

use crate::error::{Error, Result};

type Job = Box<dyn FnOnce() + Send>;

/// A fixed set of threads taking jobs from one queue, in the order they were queued. Cheap
/// to clone; the threads end when the last handle is dropped and the queue is drained.
#[derive(Clone, Debug)]
pub(crate) struct Threads {
    tx: mpsc::Sender<Job>,
}

impl Threads {
    /// Start `n` threads named `name` (at least one: fewer are kept if the system refuses
    /// more, with a debug log; an error only if none could start).
    pub(crate) fn start(name: &str, n: usize) -> std::io::Result<Threads> {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..n.max(1) {
            let rx = rx.clone();
            let spawned = std::thread::Builder::new()
                .name(name.into())
                .spawn(move || {
                    loop {
                        // One thread waits in `recv`, the others for the lock.
                        let job = rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                        let Ok(job) = job else { return };
                        // A panicking job drops its answer channel; the caller gets an error.
                        let _ = catch_unwind(AssertUnwindSafe(job));
                    }
                });
            match spawned {
                Ok(_) => {}
                Err(e) if i == 0 => return Err(e),
                Err(e) => {
                    tracing::debug!(threads = i, error = %e, "{name}: fewer threads than asked");
                    break;
                }
            }
        }
        Ok(Threads { tx })
    }

    /// Queue `job`; false if the threads are gone (it then never runs).
    pub(crate) fn spawn(&self, job: impl FnOnce() + Send + 'static) -> bool {
        self.tx.send(Box::new(job)).is_ok()
    }

    /// Queue `job` now; the returned future, which borrows nothing, yields its result
    /// without blocking the caller's thread, or `None` if the job panicked or could not be
    /// queued. If the caller stops waiting, the job still runs to completion.
    pub(crate) fn submit<R: Send + 'static>(
        &self,
        job: impl FnOnce() -> R + Send + 'static,
    ) -> impl std::future::Future<Output = Option<R>> + Send + 'static {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let sent = self.spawn(move || {
            let _ = tx.send(job());
        });
        async move {
            if !sent {
                return None;
            }
            rx.await.ok()
        }
    }
}

/// The process's CPU threads (see the module docs), started on first use; `None` if no
/// thread could be started (callers then fall back to tokio's blocking pool or to the
/// calling thread).
pub(crate) fn cpu() -> Option<&'static Threads> {
    static CPU: OnceLock<Option<Threads>> = OnceLock::new();
    CPU.get_or_init(|| {
        let n = cpu_threads();
        match Threads::start("kube-persist-cpu", n) {
            Ok(t) => {
                tracing::debug!(threads = n, "CPU threads started");
                Some(t)
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot start kube-persist's CPU threads; parsing on tokio's blocking pool");
                None
            }
        }
    })
    .as_ref()
}

/// How many CPU threads: one per core, at most 8.
pub(crate) fn cpu_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(8)
}

/// Run `job` (CPU only, no disk) off the async workers: on the CPU threads, or on tokio's
/// blocking pool if they could not be started. `None` if it panicked.
pub(crate) async fn compute<R: Send + 'static>(
    job: impl FnOnce() -> R + Send + 'static,
) -> Option<R> {
    match cpu() {
        Some(threads) => threads.submit(job).await,
        None => tokio::task::spawn_blocking(job).await.ok(),
    }
}

/// A handle to the disk thread of one store directory, and to its budget of list pages in
/// flight. Cheap to clone; the thread ends when the last handle is dropped.
#[derive(Clone, Debug)]
pub(crate) struct DiskWorker {
    thread: Threads,
    path: PathBuf,
    /// List pages fetched, parsed or queued for the disk thread, over every stream of the
    /// directory: a page holds a permit from before its GET until it is committed.
    pages: Arc<tokio::sync::Semaphore>,
    /// Emptied list-page buffers, reused by the next pages (at most one per permit): a
    /// buffer of a few MiB freed and allocated again for every page leaves the allocator
    /// holding freed memory of every size in every thread's arena.
    buffers: Arc<std::sync::Mutex<Vec<Vec<u8>>>>,
}

/// A list page's place in the budget of its store directory (see [`DiskWorker::page_permit`]).
pub(crate) type PagePermit = tokio::sync::OwnedSemaphorePermit;

/// List pages in flight per store directory: enough to keep each CPU thread parsing while
/// the disk thread commits one page and another is on the network. Streams started
/// together share them, so memory does not grow with their number (twenty streams starting
/// at once would otherwise hold forty pages, a few MiB each).
pub(crate) fn pages_in_flight() -> usize {
    cpu_threads() + 2
}

impl DiskWorker {
    /// Start the disk thread of the store at `path`.
    pub(crate) fn spawn(path: &Path) -> Result<Self> {
        let thread = Threads::start("kube-persist-disk", 1).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(DiskWorker {
            thread,
            path: path.to_path_buf(),
            pages: Arc::new(tokio::sync::Semaphore::new(pages_in_flight())),
            buffers: Arc::default(),
        })
    }

    /// An empty buffer for a list page's body, with room for `bytes` (one given back by an
    /// earlier page when there is one).
    pub(crate) fn page_buffer(&self, bytes: usize) -> Vec<u8> {
        let reused = self.buffers.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut buffer = reused.unwrap_or_default();
        buffer.reserve(bytes);
        buffer
    }

    /// Give a list page's buffer back once the page is parsed.
    pub(crate) fn give_page_buffer(&self, mut buffer: Vec<u8>) {
        buffer.clear();
        let mut buffers = self.buffers.lock().unwrap_or_else(|p| p.into_inner());
        if buffers.len() < pages_in_flight() {
            buffers.push(buffer);
        }
    }

    /// Wait for a place for one more list page in flight in this directory; the page keeps
    /// the permit until it is committed (dropping it gives the place back).
    pub(crate) async fn page_permit(&self) -> PagePermit {
        // The semaphore is never closed.
        self.pages
            .clone()
            .acquire_owned()
            .await
            .expect("the page semaphore is never closed")
    }

    /// Queue `job` on the disk thread now (jobs run in the order they are queued); the
    /// returned future, which borrows nothing, yields its result without blocking the
    /// caller's thread. If the caller stops waiting, the job still runs to completion.
    pub(crate) fn submit<R: Send + 'static>(
        &self,
        job: impl FnOnce() -> Result<R> + Send + 'static,
    ) -> impl std::future::Future<Output = Result<R>> + Send + 'static {
        let done = self.thread.submit(job);
        let path = self.path.clone();
        async move {
            done.await.unwrap_or_else(|| {
                Err(Error::Storage {
                    path,
                    detail: "the disk worker thread stopped (a storage operation panicked)".into(),
                })
            })
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

    #[test]
    fn cpu_threads_are_a_fixed_set_shared_by_all_jobs() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let ids: std::collections::HashSet<_> = rt
            .block_on(async {
                let jobs = (0..64).map(|_| compute(|| std::thread::current().id()));
                futures::future::join_all(jobs).await
            })
            .into_iter()
            .map(Option::unwrap)
            .collect();
        assert!(!ids.contains(&std::thread::current().id()));
        assert!(
            ids.len() <= cpu_threads(),
            "{} threads ran the jobs",
            ids.len()
        );
        assert_eq!(rt.block_on(compute(|| -> u8 { panic!("boom") })), None);
        assert_eq!(rt.block_on(compute(|| 7)), Some(7));
    }
}
