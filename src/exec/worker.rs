//! The threads that do kube-persist's blocking and CPU-heavy work, so that none of it runs
//! on a tokio worker thread, in a number that does not grow with the number of streams:
//!
//! - the **disk worker**: one dedicated OS thread per [`Db`](crate::Db) that runs every
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
use std::sync::{Arc, Mutex, OnceLock};

use crate::model::{Error, Result};

type Job = Box<dyn FnOnce() + Send>;

/// A fixed set of threads taking jobs from one queue, in the order they were queued. Cheap
/// to clone; the threads end when the last handle is dropped and the queue is drained.
#[derive(Clone, Debug)]
pub(crate) struct Threads {
    tx: crossbeam_channel::Sender<Job>,
}

impl Threads {
    /// Start `n` threads named `name` (at least one: fewer are kept if the system refuses
    /// more, with a debug log; an error only if none could start).
    pub(crate) fn start(name: &str, n: usize) -> std::io::Result<Threads> {
        // Every thread waits on the queue itself: a job wakes one of them, and only one.
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        for i in 0..n.max(1) {
            let rx = rx.clone();
            let spawned = std::thread::Builder::new()
                .name(name.into())
                .spawn(move || {
                    // Ends once every handle is dropped and the queue is drained.
                    while let Ok(job) = rx.recv() {
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
        // The job runs in the caller's span: a log line of a disk or CPU thread names the
        // stream (or controller) and directory its caller's does.
        let span = tracing::Span::current();
        self.tx.send(Box::new(move || span.in_scope(job))).is_ok()
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
    /// Single objects a delta relist fetches at once, over every stream of the directory
    /// (see [`DiskWorker::fetch_permit`]).
    fetches: Arc<tokio::sync::Semaphore>,
    /// Emptied list-page buffers, reused by the next pages while some stream of the
    /// directory lists (see [`Pool`]).
    buffers: Arc<Mutex<Pool>>,
}

/// Emptied list-page buffers: a buffer of a few MiB freed and allocated again for every
/// page leaves the allocator holding freed memory of every size in every thread's arena.
/// At most one per permit and [`KEPT_BUFFER_BYTES`] in all are kept, and only while a list
/// runs: pages grown up to 16x after expired continue tokens are not held for the life of
/// the `Db`.
#[derive(Debug, Default)]
struct Pool {
    buffers: Vec<Vec<u8>>,
    /// Streams of the directory whose persisted phase is a list ([`ListingGuard`]s).
    lists: usize,
}

/// The most bytes of emptied list-page buffers a directory keeps. A larger buffer is
/// freed at once: glibc maps allocations from 32 MiB up on their own and unmaps them on
/// free, so keeping those saves no fragmentation.
const KEPT_BUFFER_BYTES: usize = 64 << 20;

/// A stream of the directory is listing (see [`DiskWorker::listing`]); dropping the last
/// one frees the kept list-page buffers.
#[derive(Debug)]
pub(crate) struct ListingGuard {
    pool: Arc<Mutex<Pool>>,
}

impl Drop for ListingGuard {
    fn drop(&mut self) {
        let freed = {
            let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
            pool.lists = pool.lists.saturating_sub(1);
            if pool.lists == 0 {
                std::mem::take(&mut pool.buffers)
            } else {
                Vec::new()
            }
        };
        // Freed outside the lock.
        drop(freed);
    }
}

/// A list page's place in the budget of its store directory (see [`DiskWorker::page_permit`]).
pub(crate) type PagePermit = tokio::sync::OwnedSemaphorePermit;

/// List pages in flight per store directory (paginated LIST pages and streaming lists'
/// bursts of initial events alike): enough to keep each CPU thread parsing while the disk
/// thread commits one page and another is on the network. Streams started
/// together share them, so memory does not grow with their number (twenty streams starting
/// at once would otherwise hold forty pages, a few MiB each).
pub(crate) fn pages_in_flight() -> usize {
    cpu_threads() + 2
}

/// Single objects fetched at once per store directory, by the delta relists of all its
/// streams together (each stream also caps its own): twenty streams relisting after an API
/// server restart send at most this many requests at once, not twenty times a stream's.
pub(crate) const FETCHES_PER_DIRECTORY: usize = 32;

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
            fetches: Arc::new(tokio::sync::Semaphore::new(FETCHES_PER_DIRECTORY)),
            buffers: Arc::default(),
        })
    }

    /// An empty buffer for a list page's body, with room for `bytes` (one given back by an
    /// earlier page when there is one).
    pub(crate) fn page_buffer(&self, bytes: usize) -> Vec<u8> {
        let reused = self.pool().buffers.pop();
        let mut buffer = reused.unwrap_or_default();
        buffer.reserve(bytes);
        buffer
    }

    /// Give a list page's buffer back once the page is parsed: kept for the next page
    /// while a list runs and the pool has room for it, freed otherwise.
    pub(crate) fn give_page_buffer(&self, mut buffer: Vec<u8>) {
        buffer.clear();
        let mut pool = self.pool();
        let kept: usize = pool.buffers.iter().map(Vec::capacity).sum();
        if pool.lists > 0
            && pool.buffers.len() < pages_in_flight()
            && kept.saturating_add(buffer.capacity()) <= KEPT_BUFFER_BYTES
        {
            pool.buffers.push(buffer);
            return;
        }
        drop(pool);
        // Freed outside the lock.
        drop(buffer);
    }

    /// The store directory this worker writes.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Mark a stream of this directory as listing until the guard is dropped: list-page
    /// buffers are kept for reuse only while one is held.
    pub(crate) fn listing(&self) -> ListingGuard {
        self.pool().lists += 1;
        ListingGuard {
            pool: self.buffers.clone(),
        }
    }

    fn pool(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.buffers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The list-page buffers kept (how many, and their bytes).
    #[cfg(test)]
    pub(crate) fn kept_page_buffers(&self) -> (usize, usize) {
        let pool = self.pool();
        (
            pool.buffers.len(),
            pool.buffers.iter().map(Vec::capacity).sum(),
        )
    }

    /// Places left in the page budget.
    #[cfg(test)]
    pub(crate) fn free_page_permits(&self) -> usize {
        self.pages.available_permits()
    }

    /// Wait for a place for one more list page in flight in this directory; the page keeps
    /// the permit until it is committed (dropping it gives the place back). Never held
    /// across a watcher's steps, only by a page on its way (in a disk job once submitted),
    /// so that a watcher whose consumer stops polling does not keep its place.
    pub(crate) async fn page_permit(&self) -> PagePermit {
        // The semaphore is never closed.
        self.pages
            .clone()
            .acquire_owned()
            .await
            .expect("the page semaphore is never closed")
    }

    /// Wait for a place for one more single-object fetch in flight in this directory
    /// ([`FETCHES_PER_DIRECTORY`]); dropping the permit gives it back.
    pub(crate) async fn fetch_permit(&self) -> tokio::sync::OwnedSemaphorePermit {
        self.fetches
            .clone()
            .acquire_owned()
            .await
            .expect("the fetch semaphore is never closed")
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

    /// Emptied list-page buffers are kept only while a list runs, at most one per permit and
    /// `KEPT_BUFFER_BYTES` in all; the last list's end frees them.
    #[test]
    fn page_buffers_are_bounded_and_freed_when_no_list_runs() {
        let worker = DiskWorker::spawn(Path::new("/tmp/x")).unwrap();
        let mib = 1 << 20;
        // No list: nothing is kept.
        worker.give_page_buffer(Vec::with_capacity(mib));
        assert_eq!(worker.kept_page_buffers(), (0, 0));
        let (a, b) = (worker.listing(), worker.listing());
        for _ in 0..pages_in_flight() + 3 {
            worker.give_page_buffer(Vec::with_capacity(mib));
        }
        let (n, bytes) = worker.kept_page_buffers();
        assert_eq!(n, pages_in_flight());
        assert!(
            bytes >= n * mib && bytes < 2 * n * mib,
            "{bytes} bytes kept"
        );
        // Reused by the next page.
        let reused = worker.page_buffer(mib / 2);
        assert!(reused.capacity() >= mib && reused.is_empty());
        assert_eq!(worker.kept_page_buffers().0, n - 1);
        worker.give_page_buffer(reused);
        // Pages grown after expired continue tokens: never more than the byte bound.
        for _ in 0..pages_in_flight() {
            let grown = worker.page_buffer(KEPT_BUFFER_BYTES / 2);
            worker.give_page_buffer(grown);
            worker.give_page_buffer(Vec::with_capacity(KEPT_BUFFER_BYTES / 2));
        }
        worker.give_page_buffer(Vec::with_capacity(KEPT_BUFFER_BYTES + 1));
        let (n, bytes) = worker.kept_page_buffers();
        assert!(n <= pages_in_flight(), "{n} buffers kept");
        assert!(bytes <= KEPT_BUFFER_BYTES, "{bytes} bytes kept");
        // One list ends: the other still uses them. The last one ends: all freed.
        drop(a);
        assert_eq!(worker.kept_page_buffers().0, n);
        drop(b);
        assert_eq!(worker.kept_page_buffers(), (0, 0));
        worker.give_page_buffer(Vec::with_capacity(mib));
        assert_eq!(worker.kept_page_buffers(), (0, 0));
    }

    /// The threads run every job queued before the last handle is dropped, then end.
    #[test]
    fn threads_drain_their_queue_and_end_with_the_last_handle() {
        thread_local! {
            /// Dropped when the thread that set it ends.
            static ENDS: std::cell::RefCell<Option<std::sync::mpsc::Sender<()>>> =
                const { std::cell::RefCell::new(None) };
        }
        let threads = Threads::start("kube-persist-test", 2).unwrap();
        let ran = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (ended, ends) = std::sync::mpsc::channel::<()>();
        for _ in 0..200 {
            let (ran, ended) = (ran.clone(), ended.clone());
            assert!(threads.spawn(move || {
                ran.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                ENDS.with(|e| *e.borrow_mut() = Some(ended));
            }));
        }
        drop(ended);
        let clone = threads.clone();
        drop(threads);
        assert!(clone.spawn(|| {}), "a handle keeps the threads");
        drop(clone);
        // Every sender is gone once each thread that ran a job has ended.
        let waited = ends.recv_timeout(std::time::Duration::from_secs(30));
        assert_eq!(
            waited,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected),
            "the threads ended"
        );
        assert_eq!(ran.load(std::sync::atomic::Ordering::SeqCst), 200);
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
