//! A bounded cache of decoded objects for `Reader::get`, kept coherent with the writer.
//!
//! The writer removes the keys of a batch from the cache and marks a write in progress
//! *before* the batch reaches disk, and ends the mark after. A reader may insert what it
//! decoded only if no write started or ended since it began its disk read. So a reader never
//! gets an object older than one it (or anyone) could already read from disk.

use std::any::Any;
use std::sync::{Arc, Mutex};

use lru::LruCache;

type Entry = (Arc<dyn Any + Send + Sync>, usize);

pub(crate) struct HotCache {
    max_bytes: usize,
    inner: Mutex<Inner>,
}

struct Inner {
    map: LruCache<Vec<u8>, Entry>,
    bytes: usize,
    /// Bumped when a write starts and when it ends: odd while a write is in progress.
    generation: u64,
}

/// Decoded objects cost far more heap than their JSON; this factor turns the JSON size
/// into an estimate of the decoded size (measured: a ~5 KB Pod decodes into 35-70 KiB).
const DECODED_PER_JSON_BYTE: usize = 10;

impl HotCache {
    pub(crate) fn new(max_bytes: usize) -> Self {
        HotCache {
            max_bytes,
            inner: Mutex::new(Inner {
                map: LruCache::unbounded(),
                bytes: 0,
                generation: 0,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn enabled(&self) -> bool {
        self.max_bytes > 0
    }

    /// A cached object, and the generation to pass to [`HotCache::insert`] on a miss.
    pub(crate) fn get(&self, key: &[u8]) -> Result<Arc<dyn Any + Send + Sync>, u64> {
        let mut inner = self.lock();
        match inner.map.get(key) {
            Some((v, _)) => Ok(v.clone()),
            None => Err(inner.generation),
        }
    }

    /// Cache an object read from disk, unless a write started or ended since `generation`.
    pub(crate) fn insert(
        &self,
        key: Vec<u8>,
        value: Arc<dyn Any + Send + Sync>,
        json_len: usize,
        generation: u64,
    ) {
        let cost = json_len.saturating_mul(DECODED_PER_JSON_BYTE);
        if cost > self.max_bytes {
            return;
        }
        let mut inner = self.lock();
        if inner.generation != generation || generation % 2 == 1 {
            return;
        }
        if let Some((_, old)) = inner.map.put(key, (value, cost)) {
            inner.bytes -= old;
        }
        inner.bytes += cost;
        while inner.bytes > self.max_bytes {
            match inner.map.pop_lru() {
                Some((_, (_, c))) => inner.bytes -= c,
                None => break,
            }
        }
    }

    /// Before a batch is applied: drop its keys and mark a write in progress.
    pub(crate) fn begin_write<'a>(&self, keys: impl Iterator<Item = &'a [u8]>) {
        if !self.enabled() {
            return;
        }
        let mut inner = self.lock();
        inner.generation += 1;
        for k in keys {
            if let Some((_, c)) = inner.map.pop(k) {
                inner.bytes -= c;
            }
        }
    }

    /// After the batch is applied (or failed).
    pub(crate) fn end_write(&self) {
        if !self.enabled() {
            return;
        }
        self.lock().generation += 1;
    }
}

impl std::fmt::Debug for HotCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.lock();
        f.debug_struct("HotCache")
            .field("max_bytes", &self.max_bytes)
            .field("bytes", &inner.bytes)
            .field("entries", &inner.map.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inserts_are_refused_across_a_write_and_bounded_by_bytes() {
        let c = HotCache::new(1000);
        let Err(g) = c.get(b"a") else {
            panic!("empty cache hit")
        };
        c.begin_write([b"a".as_slice()].into_iter());
        // A reader that started before the write must not populate the cache.
        c.insert(b"a".to_vec(), Arc::new(1u32), 10, g);
        assert!(c.get(b"a").is_err());
        c.end_write();
        let Err(g) = c.get(b"a") else { panic!() };
        c.insert(b"a".to_vec(), Arc::new(2u32), 10, g);
        assert_eq!(*c.get(b"a").unwrap().downcast::<u32>().unwrap(), 2);
        // 10 entries of 100 bytes fit; the 11th evicts the least recently used.
        for i in 0..11u8 {
            let Err(g) = c.get(&[i, i]) else { panic!() };
            c.insert(vec![i, i], Arc::new(i), 10, g);
        }
        assert!(c.get(b"a").is_err(), "oldest entry evicted");
        assert!(c.get(&[10, 10]).is_ok());
    }
}
