//! How the async forms of the reads run (the [`Reader`] methods are in `reader/mod.rs`):
//! the same reads, on tokio's blocking pool, so that a reconciler or an event loop never
//! reads the disk or decodes on an async worker.
//!
//! A point read ([`Reader::get_async`]) that the hot cache answers is answered on the
//! calling task (a lookup, no disk read, no decode); one that misses is one job on
//! kube-persist's CPU threads (see [`point`]). A scan
//! ([`Reader::iter_stream`], [`Reader::select_stream`], [`Reader::by_index_stream`]) reads
//! the range in order, one blocking task per chunk of [`CHUNK`] objects: each task takes
//! the scan's iterator, reads one chunk and hands both back, so the scan runs at most one
//! chunk ahead of the consumer and holds no blocking-pool thread between chunks. A stream
//! that is kept but not polled (or dropped) costs its thread at most the one chunk read
//! under way, not the life of the stream, so many idle scans cannot exhaust the pool and
//! starve other blocking reads (`tests/it/nonblocking.rs`). The streams are boxed (`Unpin`):
//! `next()` needs no pinning.

use futures::StreamExt;
use futures::stream::BoxStream;

#[cfg(doc)]
use super::Reader;
use crate::model::{Error, Result};

/// Objects per chunk handed from a scan's blocking task to its stream.
pub(crate) const CHUNK: usize = 256;

/// Runs a point read (a get the hot cache missed) on kube-persist's CPU threads (one per
/// core, see `exec`), or on tokio's blocking pool if they could not be started.
///
/// Not on the blocking pool: every thread has its own allocator arena (glibc), and a read
/// on a thread of its own fills a new arena with the engine's cache pages and the hot
/// cache's objects, while the arenas of the threads that parsed the list hold that list's
/// freed memory unused. On the CPU threads the reads reuse it: after a cold sync of 100,000
/// Pods, 10,000 random gets raised the peak RSS by 19 MiB on the blocking pool and by 10 MiB
/// here (BENCHMARKS.md, *Cold sync against kube-apiserver*). A point read takes tens of µs;
/// during a list it may wait for a page's parse on a busy thread.
pub(super) async fn point<T: Send + 'static>(
    read: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    let caught = move || std::panic::catch_unwind(std::panic::AssertUnwindSafe(read));
    match crate::exec::compute(caught).await {
        Some(Ok(result)) => result,
        Some(Err(panic)) => std::panic::resume_unwind(panic),
        None => Err(Error::ReadCancelled {
            detail: "kube-persist's CPU threads stopped".into(),
        }),
    }
}

/// A scan on tokio's blocking pool, started at the stream's first poll (so that the stream
/// may be made outside a runtime), handed over in chunks of [`CHUNK`].
///
/// Each chunk is one blocking task that takes the iterator, reads up to [`CHUNK`] items and
/// hands the iterator back with them: the thread is returned between chunks. The next
/// chunk is read while the consumer takes this one (one chunk ahead), so a stream that is
/// kept but not polled holds a blocking-pool thread only until that one read ends, never
/// while it waits for its consumer.
pub(super) fn scan<T, I>(
    open: impl FnOnce() -> Result<I> + Send + 'static,
) -> BoxStream<'static, Result<T>>
where
    T: Send + 'static,
    I: Iterator<Item = Result<T>> + Send + 'static,
{
    type Read<T, I> = tokio::task::JoinHandle<(Option<I>, Vec<Result<T>>)>;
    /// Up to [`CHUNK`] items, and the iterator if it may have more.
    fn read_chunk<T, I: Iterator<Item = Result<T>>>(mut items: I) -> (Option<I>, Vec<Result<T>>) {
        let chunk: Vec<Result<T>> = items.by_ref().take(CHUNK).collect();
        let more = chunk.len() == CHUNK;
        (more.then_some(items), chunk)
    }
    fn next_read<T, I>(items: Option<I>) -> Option<Read<T, I>>
    where
        T: Send + 'static,
        I: Iterator<Item = Result<T>> + Send + 'static,
    {
        items.map(|items| tokio::task::spawn_blocking(move || read_chunk(items)))
    }
    futures::stream::once(async move {
        let first: Read<T, I> = tokio::task::spawn_blocking(move || match open() {
            Ok(items) => read_chunk(items),
            Err(e) => (None, vec![Err(e)]),
        });
        futures::stream::unfold(Some(first), |read| async move {
            let (rest, chunk) = match read?.await {
                Ok(read) => read,
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                Err(e) => (
                    None,
                    vec![Err(Error::ReadCancelled {
                        detail: e.to_string(),
                    })],
                ),
            };
            // Read the next chunk while this one is consumed.
            Some((futures::stream::iter(chunk), next_read(rest)))
        })
        .flatten()
    })
    .flatten()
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A point read that panics panics its caller (as a blocking-pool task's would), and
    /// the CPU threads live on for the next read.
    #[tokio::test]
    async fn a_point_read_that_panics_panics_its_caller() {
        let caught = tokio::spawn(point(|| -> Result<u8> { panic!("the read failed") })).await;
        let panic = caught.expect_err("the caller panicked").into_panic();
        assert_eq!(panic.downcast_ref::<&str>(), Some(&"the read failed"));
        assert_eq!(point(|| Ok(7u8)).await.unwrap(), 7);
    }
}
