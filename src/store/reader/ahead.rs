//! Reading ahead of an iterator's caller: stored entries are read in key order in chunks
//! and mapped (decoded) on worker threads while the caller consumes earlier chunks, then
//! handed out in key order. Memory is bounded: at most [`PERMITS_PER_WORKER`] chunks per
//! worker are read and not yet handed out.
//!
//! The first few chunks are small and mapped on the calling thread, so a caller that takes
//! a few objects neither starts threads nor decodes more than it needs. The workers live as
//! long as the iterator (they are joined when it is dropped); they never run async tasks,
//! and a caller on an async worker is blocking it anyway (reads are blocking calls).

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, OnceLock, mpsc};

use crate::error::{Error, Result};
use crate::store::engine::Entry;

/// Entries per chunk once read ahead.
const CHUNK: usize = 64;
/// Chunks mapped on the calling thread before the workers start: 8, 16, 32, then 64.
const INLINE_CHUNKS: usize = 4;
const FIRST_CHUNK: usize = 8;
/// Chunks a worker may have read that the caller has not taken yet.
const PERMITS_PER_WORKER: usize = 2;

/// Maps one stored entry to what the iterator hands out.
pub(super) type MapFn<T> = Arc<dyn Fn(Entry) -> T + Send + Sync>;
type Entries = Box<dyn Iterator<Item = Result<Entry>> + Send>;

/// The threads that map chunks when not chosen (the calling thread consumes).
fn default_threads() -> usize {
    static N: OnceLock<usize> = OnceLock::new();
    *N.get_or_init(|| {
        std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(8)
    })
}

/// The mapped entries of a range, in key order.
pub(super) struct Ahead<T> {
    state: State<T>,
    ready: VecDeque<T>,
    map: MapFn<T>,
    /// An error in the place of an entry (a failed read).
    failed: fn(Error) -> T,
    path: Arc<PathBuf>,
    chunk: usize,
    inline_chunks: usize,
    /// Worker threads; 1: everything on the calling thread.
    threads: usize,
}

enum State<T> {
    Inline(Entries),
    Piped(Pipe<T>),
    Done,
}

impl<T: Send + 'static> Ahead<T> {
    /// `threads`: 0 for one per core, 1 for none (all on the calling thread).
    pub(super) fn new(
        entries: Entries,
        map: MapFn<T>,
        failed: fn(Error) -> T,
        path: Arc<PathBuf>,
        threads: usize,
    ) -> Self {
        Ahead {
            state: State::Inline(entries),
            ready: VecDeque::new(),
            map,
            failed,
            path,
            chunk: FIRST_CHUNK,
            inline_chunks: 0,
            threads: if threads == 0 {
                default_threads()
            } else {
                threads
            },
        }
    }

    pub(super) fn next(&mut self) -> Option<T> {
        loop {
            if let Some(item) = self.ready.pop_front() {
                return Some(item);
            }
            match std::mem::replace(&mut self.state, State::Done) {
                State::Done => return None,
                State::Piped(mut pipe) => {
                    let chunk = pipe.next_chunk(self.failed)?;
                    self.ready.extend(chunk);
                    self.state = State::Piped(pipe);
                }
                State::Inline(mut entries) => {
                    if self.inline_chunks >= INLINE_CHUNKS && self.threads > 1 {
                        let (map, path) = (&self.map, &self.path);
                        match Pipe::start(entries, map, self.failed, path, self.threads) {
                            Ok(pipe) => self.state = State::Piped(pipe),
                            // No thread could be started: go on here.
                            Err(back) => {
                                self.inline_chunks = 0;
                                self.state = State::Inline(back);
                            }
                        }
                        continue;
                    }
                    let (read, ended) = read_chunk(&mut entries, self.chunk, self.failed);
                    self.inline_chunks += 1;
                    self.chunk = (self.chunk * 2).min(CHUNK);
                    for r in read {
                        self.ready.push_back(match r {
                            Ok(entry) => (self.map)(entry),
                            Err(item) => item,
                        });
                    }
                    if !ended {
                        self.state = State::Inline(entries);
                    }
                }
            }
        }
    }
}

/// Up to `n` entries (a failed read ends the chunk, as an item in its place) and whether
/// the range ended.
fn read_chunk<T>(
    entries: &mut Entries,
    n: usize,
    failed: fn(Error) -> T,
) -> (Vec<std::result::Result<Entry, T>>, bool) {
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        match entries.next() {
            Some(Ok(e)) => out.push(Ok(e)),
            Some(Err(e)) => {
                out.push(Err(failed(e)));
                return (out, false);
            }
            None => return (out, true),
        }
    }
    (out, false)
}

/// The workers and the chunks they mapped, reordered by sequence number.
struct Pipe<T> {
    rx: Option<mpsc::Receiver<(u64, Vec<T>)>>,
    shared: Arc<Shared>,
    map: MapFn<T>,
    path: Arc<PathBuf>,
    workers: Vec<std::thread::JoinHandle<()>>,
    pending: BTreeMap<u64, Vec<T>>,
    next: u64,
}

struct Shared {
    source: Mutex<Source>,
    wake: Condvar,
}

struct Source {
    entries: Option<Entries>,
    seq: u64,
    ended: bool,
    permits: usize,
    stop: bool,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Source> {
        self.source.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl<T: Send + 'static> Pipe<T> {
    /// Start the workers on `entries`; gives `entries` back if no thread could be started.
    fn start(
        entries: Entries,
        map: &MapFn<T>,
        failed: fn(Error) -> T,
        path: &Arc<PathBuf>,
        n: usize,
    ) -> std::result::Result<Self, Entries> {
        let shared = Arc::new(Shared {
            source: Mutex::new(Source {
                entries: Some(entries),
                seq: 0,
                ended: false,
                permits: n * PERMITS_PER_WORKER,
                stop: false,
            }),
            wake: Condvar::new(),
        });
        let (tx, rx) = mpsc::sync_channel(n * PERMITS_PER_WORKER);
        let mut handles = Vec::with_capacity(n);
        for _ in 0..n {
            let (shared, tx, map, path) = (shared.clone(), tx.clone(), map.clone(), path.clone());
            let spawned = std::thread::Builder::new()
                .name("kube-persist-read".into())
                .spawn(move || work(&shared, &tx, &map, failed, &path));
            match spawned {
                Ok(h) => handles.push(h),
                Err(e) => {
                    tracing::debug!(error = %e, "cannot start a read-ahead thread");
                    break;
                }
            }
        }
        if handles.is_empty() {
            let entries = shared.lock().entries.take();
            return Err(entries.unwrap_or_else(|| Box::new(std::iter::empty())));
        }
        Ok(Pipe {
            rx: Some(rx),
            shared,
            map: map.clone(),
            path: path.clone(),
            workers: handles,
            pending: BTreeMap::new(),
            next: 0,
        })
    }

    /// The next chunk in key order; `None` at the end. While it is not mapped yet, this
    /// thread maps the next chunk not taken rather than wait (on a busy machine the workers
    /// may get no CPU at all: the caller then does the work, as without them).
    fn next_chunk(&mut self, failed: fn(Error) -> T) -> Option<Vec<T>> {
        loop {
            if let Some(chunk) = self.pending.remove(&self.next) {
                self.next += 1;
                self.shared.lock().permits += 1;
                self.shared.wake.notify_one();
                return Some(chunk);
            }
            let rx = self.rx.as_ref()?;
            let received = match rx.try_recv() {
                Ok(sent) => Ok(sent),
                Err(mpsc::TryRecvError::Empty) => match take_chunk(&self.shared, false, failed) {
                    Some((seq, read)) => Ok((seq, map_chunk(read, &self.map, failed, &self.path))),
                    None => rx.recv().map_err(drop),
                },
                Err(mpsc::TryRecvError::Disconnected) => Err(()),
            };
            match received {
                Ok((seq, chunk)) => {
                    self.pending.insert(seq, chunk);
                }
                // Every worker is gone. With chunks still waiting, one never came.
                Err(()) if self.pending.is_empty() => return None,
                Err(()) => {
                    self.pending.clear();
                    self.rx = None;
                    return Some(vec![failed(Error::Storage {
                        path: self.path.to_path_buf(),
                        detail: "a read-ahead thread stopped before its chunk".into(),
                    })]);
                }
            }
        }
    }
}

impl<T> Drop for Pipe<T> {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        // Workers blocked on a full channel fail their send; waiting ones wake and stop.
        self.rx = None;
        self.shared.wake.notify_all();
        for h in self.workers.drain(..) {
            let _ = h.join();
        }
    }
}

/// The next chunk of entries to map, with its sequence number (taking a permit): waiting
/// for a permit if `wait`; `None` once the range ended or the iterator was dropped.
fn take_chunk<T>(
    shared: &Shared,
    wait: bool,
    failed: fn(Error) -> T,
) -> Option<(u64, Vec<std::result::Result<Entry, T>>)> {
    let mut s = shared.lock();
    while wait && s.permits == 0 && !s.stop && !s.ended {
        s = shared.wake.wait(s).unwrap_or_else(|p| p.into_inner());
    }
    if s.stop || s.ended || s.permits == 0 {
        return None;
    }
    s.permits -= 1;
    let seq = s.seq;
    s.seq += 1;
    let entries = s.entries.as_mut()?;
    let (read, ended) = read_chunk(entries, CHUNK, failed);
    if ended {
        s.ended = true;
        shared.wake.notify_all();
    }
    Some((seq, read))
}

/// Map a chunk; a panic becomes an error in its place.
fn map_chunk<T>(
    read: Vec<std::result::Result<Entry, T>>,
    map: &MapFn<T>,
    failed: fn(Error) -> T,
    path: &std::path::Path,
) -> Vec<T> {
    let mapped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        read.into_iter()
            .map(|r| match r {
                Ok(entry) => map(entry),
                Err(item) => item,
            })
            .collect::<Vec<T>>()
    }));
    mapped.unwrap_or_else(|_| {
        vec![failed(Error::Storage {
            path: path.to_path_buf(),
            detail: "reading an object panicked".into(),
        })]
    })
}

/// One worker: take the next chunk of entries, map it, send it; until the range ends or
/// the iterator is dropped.
fn work<T: Send>(
    shared: &Shared,
    tx: &mpsc::SyncSender<(u64, Vec<T>)>,
    map: &MapFn<T>,
    failed: fn(Error) -> T,
    path: &std::path::Path,
) {
    while let Some((seq, read)) = take_chunk(shared, true, failed) {
        if tx.send((seq, map_chunk(read, map, failed, path))).is_err() {
            return;
        }
    }
}
