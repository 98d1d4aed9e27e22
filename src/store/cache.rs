//! A bounded cache of decoded objects for `Reader::get`, kept coherent with the writer.
//!
//! The writer removes the keys of a batch from the cache and marks them in flight *before*
//! the batch reaches disk; when the batch is applied they are remembered with the write
//! sequence number at which they were applied. A reader takes the current sequence number
//! before its disk read and may insert what it decoded only if its key was neither in
//! flight nor applied since. So a reader never gets an object older than one it (or anyone)
//! could already read from disk, and a write to one object does not stop the caching of
//! others.
//!
//! A miss is admitted (its decoded object inserted) only for a key that missed recently
//! before: a doorkeeper as in TinyLFU, so that objects read once (a scan, uniformly random
//! reads over a large store) neither evict objects that are read again nor pay for an
//! insert and an eviction on every read.
//!
//! Entries are charged their JSON size times [`DECODED_PER_JSON_BYTE`], an estimate of
//! what the decoded object holds on the heap (the JSON size is known exactly, the decoded
//! size is not observable without a counting allocator).

use std::any::Any;
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use lru::LruCache;

use crate::model::{Counters, Stats};

type Entry = (Arc<dyn Any + Send + Sync>, usize);

/// How many recently written keys are remembered one by one; older ones are summarised by
/// one sequence number (inserts that began before it are refused for every key).
const RECENT_KEYS: usize = 16_384;

/// Bits of the doorkeeper (8 KiB); it is cleared when half of them are set, so a key is
/// admitted if it missed again within about the last `DOOR_BITS / 2` distinct misses.
const DOOR_BITS: usize = 1 << 16;

/// A cache miss: what the reader needs to insert what it decodes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Miss {
    /// The write sequence number before the reader's disk read.
    pub(crate) token: u64,
    /// Whether the key missed recently before (see the module doc).
    pub(crate) admit: bool,
}

pub(crate) struct HotCache {
    max_bytes: AtomicUsize,
    inner: Mutex<Inner>,
    hits: AtomicU64,
    misses: AtomicU64,
}

struct Inner {
    map: LruCache<Vec<u8>, Entry>,
    bytes: usize,
    /// Bumped at the start and at the end of every write.
    seq: u64,
    /// The doorkeeper: one bit per key hash that missed since the last clear.
    door: Vec<u64>,
    door_set: usize,
    /// Keys of the batch being applied.
    in_flight: HashSet<Vec<u8>>,
    /// Recently written keys and the sequence number at which their write ended.
    recent: LruCache<Vec<u8>, u64>,
    /// The newest sequence number of a key evicted from `recent`.
    forgotten: u64,
}

/// Decoded objects cost far more heap than their JSON; this factor turns the JSON size
/// into an estimate of the decoded size (measured: a ~5 KB Pod decodes into 35-70 KiB).
pub(crate) const DECODED_PER_JSON_BYTE: usize = 10;

impl HotCache {
    pub(crate) fn new(max_bytes: usize) -> Self {
        HotCache {
            max_bytes: AtomicUsize::new(max_bytes),
            inner: Mutex::new(Inner {
                map: LruCache::unbounded(),
                bytes: 0,
                seq: 0,
                door: vec![0; DOOR_BITS / 64],
                door_set: 0,
                in_flight: HashSet::new(),
                recent: LruCache::unbounded(),
                forgotten: 0,
            }),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn max_bytes(&self) -> usize {
        self.max_bytes.load(Relaxed)
    }

    /// Forget everything (a stream reopened: its keyspace may have been wiped without the
    /// cache seeing it) and take a new budget. Objects read from disk before this are not
    /// cached afterwards: their tokens are older than the reset.
    pub(crate) fn reset(&self, max_bytes: usize) {
        let mut inner = self.lock();
        self.max_bytes.store(max_bytes, Relaxed);
        inner.map.clear();
        inner.bytes = 0;
        inner.seq += 1;
        inner.forgotten = inner.seq;
        inner.recent.clear();
        inner.door.fill(0);
        inner.door_set = 0;
    }

    pub(crate) fn enabled(&self) -> bool {
        self.max_bytes() > 0
    }

    /// (hits, misses) since the cache was created.
    pub(crate) fn counts(&self) -> (u64, u64) {
        (self.hits.load(Relaxed), self.misses.load(Relaxed))
    }

    /// A cached object, or the [`Miss`] that says whether to [`HotCache::insert`] the
    /// object read from disk instead.
    pub(crate) fn get(&self, key: &[u8]) -> Result<Arc<dyn Any + Send + Sync>, Miss> {
        let mut inner = self.lock();
        if let Some((v, _)) = inner.map.get(key) {
            self.hits.fetch_add(1, Relaxed);
            return Ok(v.clone());
        }
        self.misses.fetch_add(1, Relaxed);
        let bit = door_bit(key);
        let (word, mask) = (bit / 64, 1u64 << (bit % 64));
        let admit = inner.door[word] & mask != 0;
        if !admit {
            inner.door[word] |= mask;
            inner.door_set += 1;
            if inner.door_set > DOOR_BITS / 2 {
                inner.door.fill(0);
                inner.door_set = 0;
            }
        }
        Err(Miss {
            token: inner.seq,
            admit,
        })
    }

    /// Cache an object read from disk after [`HotCache::get`] returned `token`, unless its
    /// key was written (or is being written) since.
    pub(crate) fn insert(
        &self,
        key: Vec<u8>,
        value: Arc<dyn Any + Send + Sync>,
        json_len: usize,
        token: u64,
    ) {
        let cost = json_len.saturating_mul(DECODED_PER_JSON_BYTE);
        let max_bytes = self.max_bytes();
        if cost > max_bytes {
            return;
        }
        let mut inner = self.lock();
        let written_since = inner.in_flight.contains(&key)
            || inner.forgotten > token
            || inner.recent.peek(&key).is_some_and(|&at| at > token);
        if written_since {
            return;
        }
        inner.put(key, value, cost);
        inner.evict(max_bytes);
    }

    /// A cached object, counted as a hit; a miss is not counted and admits nothing (the
    /// caller reads through [`HotCache::get`] then).
    pub(crate) fn peek(&self, key: &[u8]) -> Option<Arc<dyn Any + Send + Sync>> {
        let mut inner = self.lock();
        let (v, _) = inner.map.get(key)?;
        let v = v.clone();
        drop(inner);
        self.hits.fetch_add(1, Relaxed);
        Some(v)
    }

    /// Write-through: after a batch was applied, cache the objects it wrote, as the write
    /// path decoded them (the validation decode), so that reading an object just changed
    /// costs no disk read and no decode. Called by the stream's single writer after
    /// [`HotCache::end_write`] of that batch and before its next write, so each entry is
    /// the newest version of its key. Charged like [`HotCache::insert`]; the least recently
    /// used entries make room.
    pub(crate) fn put_fresh(&self, fresh: Vec<(Vec<u8>, Arc<dyn Any + Send + Sync>, usize)>) {
        let max_bytes = self.max_bytes();
        if max_bytes == 0 || fresh.is_empty() {
            return;
        }
        let mut inner = self.lock();
        debug_assert!(
            inner.in_flight.is_empty(),
            "write-through during a write: the cache could hold an object older than the disk"
        );
        for (key, value, json_len) in fresh {
            // The hot cache is never older than the disk: a fresh object is of the write
            // that just ended (no write began since), so it is the newest version of its key.
            debug_assert!(
                inner.written_by_last_write(&key),
                "write-through of {key:?}, which the last write did not write"
            );
            let cost = json_len.saturating_mul(DECODED_PER_JSON_BYTE);
            if cost > max_bytes {
                continue;
            }
            inner.put(key, value, cost);
        }
        inner.evict(max_bytes);
    }

    /// Whether `key` is cached, without touching its recency or the counters (tests).
    #[cfg(test)]
    pub(crate) fn contains(&self, key: &[u8]) -> bool {
        self.lock().map.contains(key)
    }

    /// Before a batch is applied: drop its keys and mark them in flight.
    pub(crate) fn begin_write<'a>(&self, keys: impl Iterator<Item = &'a [u8]>) {
        if !self.enabled() {
            return;
        }
        let mut inner = self.lock();
        debug_assert!(
            inner.in_flight.is_empty(),
            "two writes at once: a stream has a single writer"
        );
        inner.seq += 1;
        for k in keys {
            if let Some((_, c)) = inner.map.pop(k) {
                inner.bytes -= c;
            }
            inner.in_flight.insert(k.to_vec());
        }
    }

    /// After the batch is applied (or failed): its keys were written at this point.
    pub(crate) fn end_write(&self) {
        if !self.enabled() {
            return;
        }
        let mut inner = self.lock();
        inner.seq += 1;
        let at = inner.seq;
        for k in std::mem::take(&mut inner.in_flight) {
            inner.recent.put(k, at);
        }
        while inner.recent.len() > RECENT_KEYS {
            if let Some((_, s)) = inner.recent.pop_lru() {
                inner.forgotten = inner.forgotten.max(s);
            }
        }
    }
}

impl Inner {
    /// Whether `key` was written by the write that ended last, with no write begun since:
    /// remembered with the current sequence number, or forgotten by that same write.
    fn written_by_last_write(&self, key: &[u8]) -> bool {
        match self.recent.peek(key) {
            Some(&at) => at == self.seq,
            None => self.forgotten == self.seq,
        }
    }

    fn put(&mut self, key: Vec<u8>, value: Arc<dyn Any + Send + Sync>, cost: usize) {
        if let Some((_, old)) = self.map.put(key, (value, cost)) {
            self.bytes -= old;
        }
        self.bytes += cost;
    }

    /// Drop the least recently used entries until the cache fits `max_bytes`.
    fn evict(&mut self, max_bytes: usize) {
        while self.bytes > max_bytes {
            match self.map.pop_lru() {
                Some((_, (_, c))) => self.bytes -= c,
                None => break,
            }
        }
        debug_assert!(
            self.bytes <= max_bytes,
            "{} bytes cached over a budget of {max_bytes}",
            self.bytes
        );
    }
}

/// The doorkeeper bit of a key (FNV-1a: keys are short, and this runs under the lock).
fn door_bit(key: &[u8]) -> usize {
    (crate::model::fnv1a64(key) as usize) & (DOOR_BITS - 1)
}

impl std::fmt::Debug for HotCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.lock();
        f.debug_struct("HotCache")
            .field("max_bytes", &self.max_bytes())
            .field("bytes", &inner.bytes)
            .field("entries", &inner.map.len())
            .finish()
    }
}

impl HotCache {
    /// A stream's `counters` with this cache's hits and misses, as
    /// [`Reader::stats`](crate::Reader::stats) reports them (the counters, in `model/`, know
    /// nothing of the cache).
    pub(crate) fn stats(&self, counters: &Counters) -> Stats {
        let mut stats = counters.snapshot();
        (stats.hot_cache_hits, stats.hot_cache_misses) = self.counts();
        stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inserts_are_refused_across_a_write_and_bounded_by_bytes() {
        let c = HotCache::new(1000);
        let Err(Miss { token: g, .. }) = c.get(b"a") else {
            panic!("empty cache hit")
        };
        c.begin_write([b"a".as_slice()].into_iter());
        // A reader that started before the write must not populate the cache.
        c.insert(b"a".to_vec(), Arc::new(1u32), 10, g);
        assert!(c.get(b"a").is_err());
        // Another key read during the write is cached: the write does not concern it.
        c.insert(b"b".to_vec(), Arc::new(9u32), 10, g);
        assert_eq!(*c.get(b"b").unwrap().downcast::<u32>().unwrap(), 9);
        c.end_write();
        // Read before the write ended, inserted after: refused for the written key.
        c.insert(b"a".to_vec(), Arc::new(1u32), 10, g);
        assert!(c.get(b"a").is_err());
        let Err(Miss { token: g, .. }) = c.get(b"a") else {
            panic!()
        };
        c.insert(b"a".to_vec(), Arc::new(2u32), 10, g);
        assert_eq!(*c.get(b"a").unwrap().downcast::<u32>().unwrap(), 2);
        c.insert(b"b".to_vec(), Arc::new(9u32), 10, g);
        // 10 entries of 100 bytes fit; the next ones evict the least recently used.
        for i in 0..11u8 {
            let Err(Miss { token: g, .. }) = c.get(&[i, i]) else {
                panic!()
            };
            c.insert(vec![i, i], Arc::new(i), 10, g);
        }
        assert!(c.get(b"a").is_err(), "oldest entry evicted");
        assert!(c.get(&[10, 10]).is_ok());
    }

    #[test]
    fn fresh_objects_are_cached_after_their_write_and_replaced_by_the_next() {
        let c = HotCache::new(1000);
        c.begin_write([b"a".as_slice()].into_iter());
        c.end_write();
        c.put_fresh(vec![(b"a".to_vec(), Arc::new(1u32), 10)]);
        assert_eq!(*c.get(b"a").unwrap().downcast::<u32>().unwrap(), 1);
        // A reader that read the old version before the write cannot put it back.
        let Err(Miss { token: old, .. }) = c.get(b"b") else {
            panic!()
        };
        c.begin_write([b"a".as_slice()].into_iter());
        assert!(c.get(b"a").is_err(), "the next write drops the fresh entry");
        c.end_write();
        c.insert(b"a".to_vec(), Arc::new(0u32), 10, old);
        assert!(c.get(b"a").is_err());
        c.put_fresh(vec![(b"a".to_vec(), Arc::new(2u32), 10)]);
        assert_eq!(*c.get(b"a").unwrap().downcast::<u32>().unwrap(), 2);
        // Within the budget: 10 entries of 100 bytes; too large ones are not cached.
        let keys: Vec<Vec<u8>> = (0..12u8).map(|i| vec![i]).collect();
        c.begin_write(keys.iter().map(Vec::as_slice));
        c.end_write();
        c.put_fresh((0..12u8).map(|i| (vec![i], Arc::new(i) as _, 10)).collect());
        assert!(!c.contains(b"a") && !c.contains(&[0]) && c.contains(&[11]));
        c.begin_write([b"big".as_slice()].into_iter());
        c.end_write();
        c.put_fresh(vec![(b"big".to_vec(), Arc::new(0u8), 101)]);
        assert!(!c.contains(b"big"));
        c.reset(1000);
        assert!(!c.contains(&[11]), "a reopen forgets them");
    }

    /// The write-through invariant is asserted in the test command (debug assertions on
    /// for this workspace's packages in the release profile, `Cargo.toml`): caching an
    /// object the last write did not write panics there. Fails if the test command runs
    /// without debug assertions, or if `put_fresh` stops checking.
    #[test]
    fn a_write_through_of_an_unwritten_key_panics_in_the_test_command() {
        let c = HotCache::new(1000);
        c.begin_write([b"a".as_slice()].into_iter());
        c.end_write();
        c.put_fresh(vec![(b"a".to_vec(), Arc::new(1u32), 10)]);
        let stale = std::panic::catch_unwind(|| {
            c.put_fresh(vec![(b"b".to_vec(), Arc::new(2u32), 10)]);
        });
        assert!(
            stale.is_err(),
            "a write-through of a key the last write did not write was accepted: are debug \
             assertions off in the test command?"
        );
        // So is one during a write (before its end): the disk may not hold it yet.
        c.begin_write([b"a".as_slice()].into_iter());
        let early = std::panic::catch_unwind(|| {
            c.put_fresh(vec![(b"a".to_vec(), Arc::new(3u32), 10)]);
        });
        assert!(early.is_err(), "a write-through before the write ended");
    }

    #[test]
    fn admits_keys_that_missed_before() {
        let c = HotCache::new(1 << 20);
        let Err(first) = c.get(b"k") else { panic!() };
        assert!(!first.admit, "a first miss is not cached");
        let Err(second) = c.get(b"k") else { panic!() };
        assert!(second.admit, "a repeated miss is");
        c.insert(b"k".to_vec(), Arc::new(1u8), 10, second.token);
        assert!(c.get(b"k").is_ok());
        // The doorkeeper forgets: once cleared (after many distinct misses), a key that
        // missed before is new again.
        let Err(once) = c.get(b"x") else { panic!() };
        assert!(!once.admit);
        let mut i = 0u32;
        while c.lock().door_set != 0 {
            let _ = c.get(&i.to_be_bytes());
            i += 1;
        }
        assert!(i as usize <= DOOR_BITS, "cleared after {i} misses");
        let Err(again) = c.get(b"x") else { panic!() };
        assert!(!again.admit);
    }
}
