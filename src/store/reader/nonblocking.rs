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
        // A runtime that is gone never runs the read: `blocking` reports it cancelled (not
        // a panic, not a lost result), and a retry on a running runtime can succeed.
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let handle = rt.handle().clone();
        drop(rt);
        let err = futures::executor::block_on(async {
            let _in = handle.enter();
            blocking(|| Ok(1u8)).await
        })
        .unwrap_err();
        assert!(matches!(err, Error::ReadCancelled { .. }), "{err:?}");
        assert!(err.is_transient(), "{err}");
    }
}
