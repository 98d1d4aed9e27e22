//! Reading ahead of an iterator's caller: stored entries are read in key order in chunks
//! and mapped (decoded) on the process's CPU threads ([`exec::cpu`]) while the caller
//! consumes earlier chunks, then handed out in key order. Memory is bounded: at most
//! [`PERMITS_PER_WORKER`] chunks per job allowed at once are read and not yet handed out.
//!
//! The first few chunks are small and mapped on the calling thread, so a caller that takes
//! a few objects neither queues jobs nor decodes more than it needs. No thread is started
//! per iterator: a hundred iterations at once share the same CPU threads. Jobs never wait
//! for the caller (a chunk is mapped and handed over, then the job ends), so an iterator
//! that is not consumed holds no thread; a caller on an async worker is blocking it anyway
//! (reads are blocking calls).

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, mpsc};

use crate::disk::Entry;
use crate::exec::{self, Threads};
use crate::model::{Error, Result};

/// Scan per chunk once read ahead.
const CHUNK: usize = 64;
/// Chunks mapped on the calling thread before the workers start: 8, 16, 32, then 64.
const INLINE_CHUNKS: usize = 4;
const FIRST_CHUNK: usize = 8;
/// Chunks per job allowed at once that may be read and not taken by the caller yet.
const PERMITS_PER_WORKER: usize = 2;

/// Maps one stored entry to what the iterator hands out.
pub(super) type MapFn<T> = Arc<dyn Fn(Entry) -> T + Send + Sync>;
type Scan = Box<dyn Iterator<Item = Result<Entry>> + Send>;

/// The mapped entries of a range, in key order.
pub(super) struct ReadAhead<T> {
    supply: Supply<T>,
    ready: VecDeque<T>,
    map: MapFn<T>,
    /// An error in the place of an entry (a failed read).
    failed: fn(Error) -> T,
    path: Arc<PathBuf>,
    chunk: usize,
    inline_chunks: usize,
    /// Chunks mapped at once on the CPU threads; 1: everything on the calling thread.
    threads: usize,
}

/// Where the next entries come from: read and mapped on the calling thread, or handed
/// over by the CPU threads' pipe.
enum Supply<T> {
    Inline(Scan),
    Piped(Pipe<T>),
    Done,
}

impl<T: Send + 'static> ReadAhead<T> {
    /// `threads`: 0 for one per core, 1 for none (all on the calling thread).
    pub(super) fn new(
        entries: Scan,
        map: MapFn<T>,
        failed: fn(Error) -> T,
        path: Arc<PathBuf>,
        threads: usize,
    ) -> Self {
        ReadAhead {
            supply: Supply::Inline(entries),
            ready: VecDeque::new(),
            map,
            failed,
            path,
            chunk: FIRST_CHUNK,
            inline_chunks: 0,
            threads: if threads == 0 {
                exec::cpu_threads()
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
            match std::mem::replace(&mut self.supply, Supply::Done) {
                Supply::Done => return None,
                Supply::Piped(mut pipe) => {
                    let chunk = pipe.next_chunk()?;
                    self.ready.extend(chunk);
                    self.supply = Supply::Piped(pipe);
                }
                Supply::Inline(mut entries) => {
                    if self.inline_chunks >= INLINE_CHUNKS && self.threads > 1 {
                        let (map, path) = (&self.map, &self.path);
                        match Pipe::start(entries, map, self.failed, path, self.threads) {
                            Ok(pipe) => self.supply = Supply::Piped(pipe),
                            // No CPU threads: go on here.
                            Err(back) => {
                                self.inline_chunks = 0;
                                self.supply = Supply::Inline(back);
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
                        self.supply = Supply::Inline(entries);
                    }
                }
            }
        }
    }
}

/// Up to `n` entries (a failed read ends the chunk, as an item in its place) and whether
/// the range ended.
fn read_chunk<T>(
    entries: &mut Scan,
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

/// The chunks being mapped on the CPU threads, and those mapped, reordered by sequence
/// number. At most `jobs` chunks are being mapped at once, and at most
/// `jobs * PERMITS_PER_WORKER` are read and not yet handed out.
struct Pipe<T> {
    shared: Arc<Feed>,
    tx: mpsc::Sender<Mapped<T>>,
    rx: mpsc::Receiver<Mapped<T>>,
    map: MapFn<T>,
    failed: fn(Error) -> T,
    path: Arc<PathBuf>,
    threads: &'static Threads,
    /// Jobs queued or running whose answer has not been received.
    in_flight: usize,
    jobs: usize,
    pending: BTreeMap<u64, Vec<T>>,
    next: u64,
    /// No job will find another chunk (the range ended).
    ended: bool,
    /// A chunk was lost and the error in its place handed out: nothing follows it.
    broken: bool,
}

/// A job's answer.
enum Mapped<T> {
    /// A chunk with its sequence number.
    Chunk(u64, Vec<T>),
    /// The range had ended (or the iterator was dropped): nothing to take.
    Ended,
    /// Reading the next chunk panicked (the engine's iterator): which chunk is unknown.
    Lost,
}

struct Feed {
    source: Mutex<Cursor>,
}

struct Cursor {
    entries: Option<Scan>,
    seq: u64,
    ended: bool,
}

impl Feed {
    fn lock(&self) -> std::sync::MutexGuard<'_, Cursor> {
        self.source.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl<T: Send + 'static> Pipe<T> {
    /// Start mapping `entries` on the CPU threads; gives `entries` back if there are none.
    fn start(
        entries: Scan,
        map: &MapFn<T>,
        failed: fn(Error) -> T,
        path: &Arc<PathBuf>,
        jobs: usize,
    ) -> std::result::Result<Self, Scan> {
        let Some(threads) = exec::cpu() else {
            return Err(entries);
        };
        let (tx, rx) = mpsc::channel();
        let mut pipe = Pipe {
            shared: Arc::new(Feed {
                source: Mutex::new(Cursor {
                    entries: Some(entries),
                    seq: 0,
                    ended: false,
                }),
            }),
            tx,
            rx,
            map: map.clone(),
            failed,
            path: path.clone(),
            threads,
            in_flight: 0,
            jobs,
            pending: BTreeMap::new(),
            next: 0,
            ended: false,
            broken: false,
        };
        pipe.top_up();
        Ok(pipe)
    }

    /// Queue jobs while fewer than `jobs` run and fewer than the bound are read ahead.
    fn top_up(&mut self) {
        while !self.ended
            && self.in_flight < self.jobs
            && self.in_flight + self.pending.len() < self.jobs * PERMITS_PER_WORKER
        {
            let (shared, tx) = (self.shared.clone(), self.tx.clone());
            let (map, failed, path) = (self.map.clone(), self.failed, self.path.clone());
            let queued = self.threads.spawn(move || {
                let taken = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    take_chunk(&shared, failed)
                }));
                let _ = tx.send(match taken {
                    Ok(Some((seq, read))) => {
                        Mapped::Chunk(seq, map_chunk(read, &map, failed, &path))
                    }
                    Ok(None) => Mapped::Ended,
                    Err(_) => {
                        shared.lock().ended = true;
                        Mapped::Lost
                    }
                });
            });
            if !queued {
                // The CPU threads are gone: the calling thread maps what is left.
                return;
            }
            self.in_flight += 1;
        }
    }

    /// The next chunk in key order; `None` at the end. While it is not mapped yet, this
    /// thread maps the next chunk not taken rather than wait (on a busy machine the CPU
    /// threads may get no CPU at all: the caller then does the work, as without them).
    ///
    /// A lost chunk (reading it panicked) ends the iteration: an error in its place, then
    /// `None`, whatever the other jobs still send.
    fn next_chunk(&mut self) -> Option<Vec<T>> {
        if self.broken {
            return None;
        }
        loop {
            if let Some(chunk) = self.pending.remove(&self.next) {
                self.next += 1;
                self.top_up();
                return Some(chunk);
            }
            // Map a chunk here only while the read-ahead bound allows one more.
            let room = self.in_flight + self.pending.len() < self.jobs * PERMITS_PER_WORKER;
            let received = match self.rx.try_recv() {
                Ok(mapped) => Some(mapped),
                Err(_) if !room && self.in_flight > 0 => self.rx.recv().ok(),
                Err(_) => match take_chunk_caught(&self.shared, self.failed) {
                    Ok(Some((seq, read))) => {
                        let chunk = map_chunk(read, &self.map, self.failed, &self.path);
                        self.pending.insert(seq, chunk);
                        continue;
                    }
                    // Everything is taken: wait for the chunks being mapped.
                    Ok(None) if self.in_flight > 0 => {
                        // This pipe holds a sender: `recv` cannot fail while jobs run.
                        self.rx.recv().ok()
                    }
                    Ok(None) => None,
                    // Reading the chunk panicked here (no job's answer: `in_flight` stays).
                    Err(Panicked) => return Some(self.lost("reading ahead panicked")),
                },
            };
            match received {
                Some(Mapped::Chunk(seq, chunk)) => {
                    self.in_flight -= 1;
                    self.pending.insert(seq, chunk);
                }
                Some(Mapped::Ended) => {
                    self.in_flight -= 1;
                    self.ended = true;
                }
                Some(Mapped::Lost) => {
                    self.in_flight -= 1;
                    return Some(self.lost("reading ahead panicked"));
                }
                // Nothing in flight and nothing left to take: the range ended.
                None if self.pending.is_empty() => return None,
                None => return Some(self.lost("a read-ahead chunk was lost")),
            }
        }
    }

    /// End the iteration with an error in the lost chunk's place: the chunks after it, and
    /// those the jobs still running send later, are dropped.
    fn lost(&mut self, why: &str) -> Vec<T> {
        self.pending.clear();
        self.ended = true;
        self.broken = true;
        self.shared.lock().ended = true;
        vec![(self.failed)(Error::Storage {
            path: self.path.to_path_buf(),
            detail: why.into(),
        })]
    }
}

impl<T> Drop for Pipe<T> {
    fn drop(&mut self) {
        // Jobs still queued find nothing to take. The entries (and the read transaction
        // they hold) are dropped now, once a job reading a chunk has let go of them.
        let mut source = self.shared.lock();
        source.ended = true;
        source.entries = None;
    }
}

/// A chunk taken from the source: its sequence number and its entries (or a failed read
/// in the place of the last one).
type Taken<T> = (u64, Vec<std::result::Result<Entry, T>>);

/// The next chunk of entries to map, with its sequence number; `None` once the range ended
/// or the iterator was dropped.
fn take_chunk<T>(shared: &Feed, failed: fn(Error) -> T) -> Option<Taken<T>> {
    let mut s = shared.lock();
    if s.ended {
        return None;
    }
    let seq = s.seq;
    s.seq += 1;
    let entries = s.entries.as_mut()?;
    let (read, ended) = read_chunk(entries, CHUNK, failed);
    if ended {
        s.ended = true;
    }
    Some((seq, read))
}

/// A read that panicked (the engine's iterator), on the calling thread.
struct Panicked;

/// [`take_chunk`] on the calling thread, which must not unwind into the caller: a panic
/// is reported as on a CPU thread (the source is then ended).
fn take_chunk_caught<T>(
    shared: &Feed,
    failed: fn(Error) -> T,
) -> std::result::Result<Option<Taken<T>>, Panicked> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| take_chunk(shared, failed))).map_err(
        |_| {
            shared.lock().ended = true;
            Panicked
        },
    )
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Keys 0..n in order (4 big-endian bytes each). Reading key `at` or a later one
    /// panics: on a CPU thread only (`ahead_only`), or on any thread.
    fn breaking_entries(n: u32, at: u32, ahead_only: bool) -> Scan {
        Box::new((0..n).map(move |i| {
            let on_cpu = std::thread::current().name() == Some("kube-persist-cpu");
            if i >= at && (on_cpu || !ahead_only) {
                panic!("the engine's iterator broke at {i} (a test panic)");
            }
            Ok((i.to_be_bytes().to_vec(), Vec::new()))
        }))
    }

    /// Iterate on another thread; an error if it did not end within `limit` (a hang) or if
    /// `next()` panicked.
    fn collect_within(
        mut ahead: ReadAhead<Result<u32>>,
        limit: Duration,
    ) -> std::result::Result<Vec<Result<u32>>, &'static str> {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let mut out = Vec::new();
                // More items than keys would be a bug too: stop there, not loop forever.
                while let (Some(item), true) = (ahead.next(), out.len() <= 10_000) {
                    out.push(item);
                }
                out
            }));
            let _ = tx.send(out.map_err(|_| "next() panicked"));
        });
        rx.recv_timeout(limit)
            .unwrap_or(Err("the iteration hung after the error"))
    }

    /// A read ahead that panics (the engine's iterator, on a CPU thread or on the caller's)
    /// ends the iteration: the keys before it in order, one error, then the end; never a
    /// hang on the `next()` after the error, nor a later chunk of another job, nor a panic
    /// in the caller.
    #[test]
    fn a_panicking_read_ahead_ends_with_one_error() {
        let map: MapFn<Result<u32>> =
            Arc::new(|(k, _)| Ok(u32::from_be_bytes(k.as_slice().try_into().unwrap())));
        let path = Arc::new(PathBuf::from("/nowhere"));
        let n = 5000;
        for ahead_only in [true, false] {
            let mut errors = 0;
            // Past the chunks read inline (8 + 16 + 32 + 64), at and after a chunk boundary.
            for at in [120, 150, 400, 2000] {
                for threads in [2, 4] {
                    for round in 0..5 {
                        let entries = breaking_entries(n, at, ahead_only);
                        let ahead =
                            ReadAhead::new(entries, map.clone(), Err, path.clone(), threads);
                        let what = format!(
                            "break at {at} (read ahead only: {ahead_only}), {threads} jobs, round {round}"
                        );
                        let out = collect_within(ahead, Duration::from_secs(20))
                            .unwrap_or_else(|e| panic!("{what}: {e}"));
                        let keys = out.iter().take_while(|item| item.is_ok()).count();
                        for (i, item) in out[..keys].iter().enumerate() {
                            assert_eq!(*item.as_ref().unwrap(), i as u32, "{what}: out of order");
                        }
                        if keys == n as usize {
                            // The caller read every key from `at` on itself: nothing broke.
                            assert!(ahead_only, "{what}: no error");
                            continue;
                        }
                        // Read ahead only, the caller may have read keys from `at` on itself.
                        assert!(
                            ahead_only || keys <= at as usize,
                            "{what}: {keys} keys before the error"
                        );
                        match &out[keys..] {
                            [Err(Error::Storage { detail, .. })] => {
                                assert_eq!(detail, "reading ahead panicked", "{what}");
                                errors += 1;
                            }
                            rest => {
                                panic!("{what}: after {keys} keys, {} items: {rest:?}", rest.len())
                            }
                        }
                    }
                }
            }
            assert!(errors > 0, "read ahead only: {ahead_only}: never broke");
        }
    }
}
