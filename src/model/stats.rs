//! Counters a user can read to see what the store and its watcher did.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::error::Error;
use super::error_kind::ErrorKind;
use super::histogram::{BATCH_BYTES_BUCKETS, COMMIT_BUCKETS, Histogram};

/// A snapshot of a stream's counters since the process opened it.
///
/// ```
/// let stats = kube_persist::Stats::default();
/// assert_eq!(stats.objects_written, 0);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Objects written to disk (new or changed).
    pub objects_written: u64,
    /// Listed or replayed objects skipped because the stored resourceVersion was the same.
    pub objects_unchanged: u64,
    /// Objects removed from disk (watch deletions and relist sweeps).
    pub objects_deleted: u64,
    /// LIST requests that returned a page.
    pub list_pages: u64,
    /// Atomic batches committed.
    pub batches: u64,
    /// Watch events applied (bookmarks excluded).
    pub watch_events: u64,
    /// Bookmarks that moved the checkpoint.
    pub bookmarks: u64,
    /// Lists started after the store had been complete once (410 Gone, expired continue token).
    pub relists: u64,
    /// Starts that resumed from a stored checkpoint without listing the collection again
    /// (no paginated LIST; the catch-up read is [`Stats::server_version_reads`]).
    pub resumes: u64,
    /// Objects or events from the server that were skipped because they could not be decoded.
    pub bad_objects: u64,
    /// Errors seen (each followed by a retry with backoff). By kind and HTTP status: the
    /// metric `kube_persist_errors_total{kind,code}` ([`ErrorKind`](crate::ErrorKind)).
    pub errors: u64,
    /// Times the store was wiped because it was opened with a different identity.
    pub identity_resets: u64,
    /// Point reads (`Reader::get`, `get_async` and their `_named` forms) answered from the
    /// hot cache (all readers of the stream); an async one answered on the calling task.
    pub hot_cache_hits: u64,
    /// Point reads that read from disk while the hot cache was enabled (an async one on
    /// tokio's blocking pool).
    pub hot_cache_misses: u64,
    /// Objects of a sharded store ([`StreamConfig::shard`](crate::StreamConfig::shard)) that the
    /// server sent although they are outside the shard, dropped by the store: the server
    /// ignores `shardSelector` (no `ShardedListAndWatch`), which costs bandwidth.
    pub shard_client_filtered: u64,
    /// `LIST limit=1` requests that read the server's current resourceVersion, to know when
    /// the store has caught up (one before a watch connects while the store is not caught
    /// up; none on a cold start or a routine reconnect). Not counted in `list_pages`.
    pub server_version_reads: u64,
    /// Objects decoded from JSON by the store: once per incoming object when it is
    /// validated or indexed ([`StreamConfig::validate`](crate::StreamConfig::validate)), and once per
    /// read that decodes a stored body (a `get` that missed the hot cache, each object of
    /// an iteration, `get_as`). A watch event whose object is then read by `get` (or handed
    /// to a reconcile) from the hot cache costs one decode in all.
    pub decodes: u64,
    /// Metadata-only LIST pages of delta relists ([`RelistMode`](crate::RelistMode)).
    pub metadata_pages: u64,
    /// Object bodies a delta relist fetched (one LIST narrowed to the object each): the
    /// objects new or changed since the store last saw them.
    pub bodies_fetched: u64,
    /// A delta relist's fetches retried after a transient failure (429, 5xx, a timeout).
    pub fetch_retries: u64,
    /// Delta relists that listed in full from some page on because the server refused
    /// their metadata pages or fetches (401, 403, 405, 406, 415, 400, 422): a verb the
    /// store's credentials lack, or a request the server does not serve; or answered a
    /// fetch with 404 or with what it did not ask for (more than the one object, another
    /// object, an answer older than the page: a server that ignores the field selector or
    /// the resourceVersion). Each is logged once, as a warning naming the reason.
    pub delta_fallbacks: u64,
    /// Watch events skipped because the store already held a newer version of their
    /// object (the replay after a delta relist, which fetched bodies newer than the list).
    pub stale_events_skipped: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) objects_written: AtomicU64,
    pub(crate) objects_unchanged: AtomicU64,
    pub(crate) objects_deleted: AtomicU64,
    pub(crate) list_pages: AtomicU64,
    pub(crate) batches: AtomicU64,
    pub(crate) watch_events: AtomicU64,
    pub(crate) bookmarks: AtomicU64,
    pub(crate) relists: AtomicU64,
    pub(crate) resumes: AtomicU64,
    pub(crate) bad_objects: AtomicU64,
    pub(crate) errors: AtomicU64,
    pub(crate) identity_resets: AtomicU64,
    pub(crate) shard_client_filtered: AtomicU64,
    pub(crate) server_version_reads: AtomicU64,
    pub(crate) decodes: AtomicU64,
    pub(crate) metadata_pages: AtomicU64,
    pub(crate) bodies_fetched: AtomicU64,
    pub(crate) fetch_retries: AtomicU64,
    pub(crate) delta_fallbacks: AtomicU64,
    pub(crate) stale_events_skipped: AtomicU64,
    /// When the watch last delivered an event or bookmark: milliseconds since the Unix
    /// epoch, 0 for never.
    pub(crate) last_watch_activity_ms: AtomicU64,
    /// `errors` by kind and HTTP status (0: none).
    errors_by: Mutex<BTreeMap<(ErrorKind, u16), u64>>,
    /// The batches' commit times and sizes.
    pub(crate) writes: Writes,
}

/// The histograms of a stream's batches.
#[derive(Debug)]
pub(crate) struct Writes {
    /// Seconds each batch's commit took (the engine's write, and its fsync when the
    /// durability makes every commit durable).
    pub(crate) commit_seconds: Histogram,
    /// Bytes of keys and values each batch wrote.
    pub(crate) batch_bytes: Histogram,
}

impl Default for Writes {
    fn default() -> Self {
        Writes {
            commit_seconds: Histogram::new(COMMIT_BUCKETS, 1e6),
            batch_bytes: Histogram::new(BATCH_BYTES_BUCKETS, 1.0),
        }
    }
}

impl Counters {
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
    }

    /// Count error `e` (in `errors`, and by its kind and status).
    pub(crate) fn error(&self, e: &Error) {
        self.errors.fetch_add(1, Relaxed);
        let key = (e.kind(), e.status_code().unwrap_or(0));
        *self
            .errors_by
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(key)
            .or_default() += 1;
    }

    /// The errors counted so far by kind and HTTP status (`None`: no status), for the
    /// `metrics` feature.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(crate) fn errors_by_kind(&self) -> Vec<(ErrorKind, Option<u16>, u64)> {
        self.errors_by
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(&(kind, code), &n)| (kind, (code != 0).then_some(code), n))
            .collect()
    }

    /// Note that the watch delivered something now.
    pub(crate) fn watch_activity(&self) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        self.last_watch_activity_ms.store(now, Relaxed);
    }

    /// When the watch last delivered an event or bookmark.
    pub(crate) fn last_watch_activity(&self) -> Option<std::time::SystemTime> {
        match self.last_watch_activity_ms.load(Relaxed) {
            0 => None,
            ms => Some(std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms)),
        }
    }

    pub(crate) fn snapshot(&self) -> Stats {
        Stats {
            objects_written: self.objects_written.load(Relaxed),
            objects_unchanged: self.objects_unchanged.load(Relaxed),
            objects_deleted: self.objects_deleted.load(Relaxed),
            list_pages: self.list_pages.load(Relaxed),
            batches: self.batches.load(Relaxed),
            watch_events: self.watch_events.load(Relaxed),
            bookmarks: self.bookmarks.load(Relaxed),
            relists: self.relists.load(Relaxed),
            resumes: self.resumes.load(Relaxed),
            bad_objects: self.bad_objects.load(Relaxed),
            errors: self.errors.load(Relaxed),
            identity_resets: self.identity_resets.load(Relaxed),
            hot_cache_hits: 0,
            hot_cache_misses: 0,
            shard_client_filtered: self.shard_client_filtered.load(Relaxed),
            server_version_reads: self.server_version_reads.load(Relaxed),
            decodes: self.decodes.load(Relaxed),
            metadata_pages: self.metadata_pages.load(Relaxed),
            bodies_fetched: self.bodies_fetched.load(Relaxed),
            fetch_retries: self.fetch_retries.load(Relaxed),
            delta_fallbacks: self.delta_fallbacks.load(Relaxed),
            stale_events_skipped: self.stale_events_skipped.load(Relaxed),
        }
    }
}
