//! How the async forms of the reads run (the [`Reader`] methods are in `reader/mod.rs`):
//! the same reads, on tokio's blocking pool, so that a reconciler or an event loop never
//! reads the disk or decodes on an async worker.
//!
//! A point read ([`Reader::get_async`]) that the hot cache answers is answered on the
//! calling task (a lookup, no disk read, no decode); one that misses is one blocking task. A scan
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

/// Runs a blocking read on tokio's blocking pool.
pub(super) async fn blocking<T: Send + 'static>(
    read: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    match tokio::task::spawn_blocking(read).await {
        Ok(result) => result,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => Err(Error::ReadCancelled {
            detail: e.to_string(),
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

    /// A read still queued on the blocking pool when the runtime shuts down is cancelled:
    /// [`Error::ReadCancelled`], which a caller retries on a running runtime
    /// ([`Error::is_transient`]).
    #[test]
    fn a_read_cancelled_by_a_shutdown_is_transient() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .max_blocking_threads(1)
            .build()
            .unwrap();
        // Hold the only blocking thread, so that the read waits in the pool's queue.
        let (release, held) = std::sync::mpsc::channel::<()>();
        let (started_tx, started) = std::sync::mpsc::channel::<()>();
        rt.spawn_blocking(move || {
            started_tx.send(()).unwrap();
            let _ = held.recv();
        });
        started.recv().unwrap();
        let mut read = Box::pin(blocking(|| Ok(1u8)));
        let waker = futures::task::noop_waker();
        {
            // The first poll queues the read, in the runtime's context.
            let _in = rt.handle().enter();
            let polled = read
                .as_mut()
                .poll(&mut std::task::Context::from_waker(&waker));
            assert!(polled.is_pending());
        }
        rt.shutdown_background();
        // The held thread ends its task, sees the shutdown and cancels the queued read.
        release.send(()).unwrap();
        let err = futures::executor::block_on(read).unwrap_err();
        assert!(matches!(err, Error::ReadCancelled { .. }), "{err:?}");
        assert!(err.is_transient(), "{err}");
    }
}
