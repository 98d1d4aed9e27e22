//! The on-disk side: one database per directory (redb by default, or sled; see [`Engine`]),
//! one keyspace per watched stream, an atomic [`writer`] and a concurrent [`Reader`].
//!
//! The store layer: one stream's keyspace (open with its identity check and cache reset,
//! the writer, the hot cache, the reader, inspection). It never makes an HTTP request.
//!
//! May import: `model`, `exec`, `disk`.

mod cache;
mod fresh;
mod inspect;
mod reader;
mod writer;

pub(crate) use cache::DECODED_PER_JSON_BYTE;
pub use fresh::{CatchUpRule, Freshness};
pub use inspect::{RawObjects, StreamInfo};
#[cfg(feature = "metrics")]
pub(crate) use reader::MetricsSource;
pub use reader::{ByIndex, Iter, Reader};
pub(crate) use writer::{Body, Change, Incoming, IndexEntries, ListProgress, Op, Writer};

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::disk::record::{self, Identity, Phase, State};
use crate::disk::{
    Backend, Cipher, Compression, DbConfig, EncryptionKey, Leases, Storage, StreamLease,
    WriteBatch, keys, perms,
};
use crate::exec::DiskWorker;
use crate::model::{Engine, Error, Result, Shard};
use cache::HotCache;

/// A store directory: one database (see [`Engine`]) holding any number of named streams.
///
/// Only one process may open a directory at a time; a second gets [`Error::Locked`].
///
/// ```
/// # fn main() -> Result<(), kube_persist::Error> {
/// let dir = tempfile::tempdir().unwrap();
/// let db = kube_persist::Db::open(dir.path().join("cache"))?;
/// assert!(db.path().ends_with("cache"));
/// assert_eq!(db.engine(), kube_persist::Engine::Redb);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Db {
    inner: Arc<DbInner>,
}

struct DbInner {
    storage: Arc<dyn Storage>,
    /// The engine `storage` is kept in.
    engine: Engine,
    path: PathBuf,
    config: DbConfig,
    cipher: Option<Arc<Cipher>>,
    /// The keyspaces held by a writer in this process.
    leases: Arc<Leases>,
    /// Each stream's hot cache, shared by every `Reader` and writer of the stream in this
    /// process, across reopens, so that no reader keeps a cache nothing invalidates.
    caches: Mutex<HashMap<String, std::sync::Weak<HotCache>>>,
    /// The thread that runs every write of this directory's streams.
    worker: DiskWorker,
}

/// Store directories whose last `Db` handle in this process was dropped recently. sled
/// releases its file lock only when deferred destructors run, a moment after the drop (and
/// redb's background flush may hold the database a moment longer).
static RECENTLY_CLOSED: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

impl Drop for DbInner {
    fn drop(&mut self) {
        let mut closed = RECENTLY_CLOSED.lock().unwrap_or_else(|p| p.into_inner());
        if !closed.contains(&self.path) {
            closed.push(self.path.clone());
        }
    }
}

/// Run `open`; if the store is locked and this process closed it (or failed to open it) a
/// moment ago, retry for up to two seconds while the engine finishes releasing it. A lock
/// held by another process (or by a live handle in this one) is reported at once.
fn open_after_close<T>(path: &Path, open: impl Fn() -> Result<T>) -> Result<T> {
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    loop {
        let res = open();
        let recently_closed = || {
            RECENTLY_CLOSED
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .any(|p| p == path)
        };
        match res {
            Err(Error::Locked { .. })
                if recently_closed() && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(10));
            }
            other => {
                let mut closed = RECENTLY_CLOSED.lock().unwrap_or_else(|p| p.into_inner());
                match &other {
                    Ok(_) => closed.retain(|p| p != path),
                    // The engine may have opened (and locked) the files before it failed,
                    // e.g. on a corrupt store: it releases them like a closed store.
                    Err(Error::Locked { .. }) => {}
                    Err(_) => {
                        if !closed.iter().any(|p| p == path) {
                            closed.push(path.to_path_buf());
                        }
                    }
                }
                return other;
            }
        }
    }
}

impl std::fmt::Debug for Db {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Db")
            .field("path", &self.inner.path)
            .field("engine", &self.inner.engine)
            .field("config", &self.inner.config)
            .finish()
    }
}

impl Db {
    /// The work of [`Db::open_with`](crate::Db::open_with).
    pub(crate) fn open_at(path: impl AsRef<Path>, config: DbConfig) -> Result<Db> {
        let path = path.as_ref().to_path_buf();
        let open = perms::too_open(&path);
        if !open.is_empty() {
            if config.strict_permissions {
                return Err(Error::Permissions { path, open });
            }
            tracing::warn!(path = %path.display(), entries = ?open,
                "store files are readable by group or others; tightening to 0700/0600");
        }
        perms::create_private_dir(&path)?;
        // Before the engine creates its files: a directory this process cannot make private
        // (not its owner, as a volume root seen through fsGroup) fails here, leaving nothing.
        perms::tighten(&path)?;
        let storage = open_after_close(&path, || crate::disk::open_storage(&path, &config))?;
        perms::tighten(&path)?;
        let engine = storage.engine();
        tracing::info!(path = %path.display(), %engine, "store opened");
        let worker = DiskWorker::spawn(&path)?;
        Ok(Db {
            inner: Arc::new(DbInner {
                storage,
                engine,
                path,
                cipher: config.encryption.as_ref().map(|k| Arc::new(k.cipher())),
                config,
                leases: Arc::default(),
                caches: Mutex::default(),
                worker,
            }),
        })
    }

    /// The work of [`Db::destroy`](crate::Db::destroy).
    pub(crate) fn destroy_at(path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let io = |e| Error::from_io(path.to_path_buf(), e);
        let entries = match std::fs::read_dir(path) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io(e)),
        };
        drop(entries);
        open_after_close(path, || crate::disk::check_removable(path))?;
        std::fs::remove_dir_all(path).map_err(io)?;
        tracing::warn!(path = %path.display(), "store removed; the next start lists from scratch");
        Ok(())
    }

    /// The work of [`Db::path`](crate::Db::path).
    pub(crate) fn dir(&self) -> &Path {
        &self.inner.path
    }

    /// The directory's storage: every keyspace, of streams and of controllers.
    pub(crate) fn storage(&self) -> &Arc<dyn Storage> {
        &self.inner.storage
    }

    pub(crate) fn compression(&self) -> Compression {
        self.inner.config.compression
    }

    pub(crate) fn worker(&self) -> DiskWorker {
        self.inner.worker.clone()
    }

    pub(crate) fn cipher(&self) -> Option<Arc<Cipher>> {
        self.inner.cipher.clone()
    }

    /// Fingerprint of the configured encryption key, if any.
    pub(crate) fn key_fingerprint(&self) -> Option<String> {
        self.inner
            .config
            .encryption
            .as_ref()
            .map(EncryptionKey::fingerprint)
    }

    /// The work of [`Db::engine`](crate::Db::engine).
    pub(crate) fn engine_kind(&self) -> Engine {
        self.inner.engine
    }

    /// The work of [`Db::flush`](crate::Db::flush).
    pub(crate) fn flush_all(&self) -> Result<()> {
        self.inner.storage.flush()
    }

    /// The work of [`Db::size_on_disk`](crate::Db::size_on_disk).
    pub(crate) fn bytes_on_disk(&self) -> Result<u64> {
        self.inner.storage.size_on_disk()
    }

    /// Hold `name` (a stream, or `controller/<name>`) as open in this process until the
    /// lease is dropped: one writer per keyspace. If its previous owner was just dropped,
    /// waits (blocking) until that owner's last queued disk job ran (see `lease.rs`).
    pub(crate) fn lease(&self, name: &str, what: &str) -> Result<StreamLease> {
        self.inner.leases.acquire(
            name,
            what,
            self.inner.clone() as Arc<dyn std::any::Any + Send + Sync>,
        )
    }

    /// The hot cache of stream `name`: the one its readers already share, emptied (what
    /// it held may predate a wipe on open) and resized, or a new one.
    pub(crate) fn hot_cache(&self, name: &str, max_bytes: usize) -> Arc<HotCache> {
        let mut caches = self.inner.caches.lock().unwrap_or_else(|p| p.into_inner());
        caches.retain(|_, c| c.strong_count() > 0);
        if let Some(cache) = caches.get(name).and_then(std::sync::Weak::upgrade) {
            cache.reset(max_bytes);
            return cache;
        }
        let cache = Arc::new(HotCache::new(max_bytes));
        caches.insert(name.to_string(), Arc::downgrade(&cache));
        cache
    }

    /// Open the keyspace of stream `name`, checking its identity. A stream stored with a
    /// different identity is wiped (and the reason logged): it must not be resumed.
    pub(crate) fn open_stream(
        &self,
        name: &str,
        identity: &Identity,
        shard: Option<&Shard>,
    ) -> Result<OpenStream> {
        if name.is_empty() {
            return Err(Error::Config("stream name must not be empty".into()));
        }
        let lease = self.lease(name, "stream")?;
        let path = &self.inner.path;
        let backend = self.inner.storage.keyspace(name)?;

        let corrupt = |key: &[u8], detail: String| {
            record::corrupt_in(path, &format!("stream {name:?}"), key, detail)
        };
        let stored_identity = match backend.get(keys::IDENTITY_KEY)? {
            Some(b) => {
                Some(record::decode::<Identity>(&b).map_err(|d| corrupt(keys::IDENTITY_KEY, d))?)
            }
            None => None,
        };
        if let Some(stored) = &stored_identity
            && stored.encryption.is_some()
            && stored.encryption != identity.encryption
        {
            return Err(Error::Encryption {
                path: path.clone(),
                detail: match &identity.encryption {
                    None => format!(
                        "stream {name:?} is encrypted; open the store with its key (DbConfig::encryption_key)"
                    ),
                    Some(_) => format!("stream {name:?} was encrypted with another key"),
                },
            });
        }
        let stored_shard = match backend.get(keys::SHARD_KEY)? {
            Some(b) => Some(record::decode::<Shard>(&b).map_err(|d| corrupt(keys::SHARD_KEY, d))?),
            None => None,
        };
        // A shard inside the stored one keeps the checkpoint: the objects outside it are
        // pruned (by the watcher, crash-safely) instead of listing again.
        let shard_change = match (&stored_shard, shard) {
            (a, b) if a.as_ref() == b => ShardChange::Same,
            (None, Some(_)) => ShardChange::Narrower,
            (Some(old), Some(new)) if old.covers(new) => ShardChange::Narrower,
            (old, new) => ShardChange::Other(format!(
                "shard: {:?} -> {:?}",
                old.as_ref().map(Shard::selector),
                new.map(Shard::selector)
            )),
        };
        let stored_state = match backend.get(keys::STATE_KEY)? {
            Some(b) => Some(record::decode::<State>(&b).map_err(|d| corrupt(keys::STATE_KEY, d))?),
            None => None,
        };
        let shard_change = match (shard_change, &stored_state) {
            // A continue token belongs to the query that started the list: narrow only a
            // store that is complete.
            (ShardChange::Narrower, Some(st)) if !matches!(st.phase, Phase::Synced { .. }) => {
                ShardChange::Other("shard narrowed while a list was in progress".into())
            }
            (change, _) => change,
        };
        let mut reset = None;
        let state = match stored_identity {
            Some(stored)
                if stored.resumes_as(identity)
                    && !matches!(shard_change, ShardChange::Other(_)) =>
            {
                if let (ShardChange::Narrower, Some(new)) = (&shard_change, shard) {
                    tracing::info!(stream = name, path = %path.display(), shard = %new.selector(),
                        "shard narrowed: pruning the objects outside it, resuming without LIST");
                    let mut b = WriteBatch::default();
                    b.put(keys::SHARD_KEY.to_vec(), record::encode(new));
                    b.put(keys::PRUNE_KEY.to_vec(), record::encode(&None::<Vec<u8>>));
                    backend.apply(b)?;
                }
                if stored.format_version != identity.format_version {
                    // Its records stay readable; new ones are written in this format, which
                    // older versions must not resume.
                    tracing::info!(stream = name, path = %path.display(),
                        from = stored.format_version, to = identity.format_version,
                        "store format upgraded in place");
                    let mut b = WriteBatch::default();
                    b.put(keys::IDENTITY_KEY.to_vec(), record::encode(identity));
                    backend.apply(b)?;
                }
                stored_state.unwrap_or_default()
            }
            other => {
                if let Some(stored) = other {
                    let why = match &shard_change {
                        ShardChange::Other(why) if stored.resumes_as(identity) => why.clone(),
                        _ => stored.difference(identity),
                    };
                    tracing::warn!(stream = name, path = %path.display(), changed = %why,
                        "store identity changed: starting clean instead of resuming");
                    reset = Some(why);
                }
                backend.clear()?;
                let state = State::default();
                let mut b = WriteBatch::default();
                b.put(keys::IDENTITY_KEY.to_vec(), record::encode(identity));
                b.put(keys::STATE_KEY.to_vec(), record::encode(&state));
                if let Some(shard) = shard {
                    b.put(keys::SHARD_KEY.to_vec(), record::encode(shard));
                }
                backend.apply(b)?;
                state
            }
        };
        Ok(OpenStream {
            backend,
            state,
            reset,
            lease,
        })
    }
}

/// How a stream's requested shard relates to its stored one.
enum ShardChange {
    Same,
    /// Inside the stored one (or the stream was not sharded): prune, keep the checkpoint.
    Narrower,
    /// Wider or elsewhere: a new list (the reason).
    Other(String),
}

/// A stream's keyspace as opened, with its stored state.
pub(crate) struct OpenStream {
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) state: State,
    /// Why the store was wiped on open, if it was.
    pub(crate) reset: Option<String>,
    pub(crate) lease: StreamLease,
}

/// Where a stream is in its list/watch cycle, as seen by [`Reader::phase`](crate::Reader::phase).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let client = kube::Client::try_from(kube::Config::new("http://127.0.0.1:1".parse()?))?;
/// use kube_persist::SyncPhase;
/// assert_eq!(SyncPhase::default(), SyncPhase::Empty);
/// let dir = tempfile::tempdir()?;
/// let db = kube_persist::Db::open(dir.path())?;
/// let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(client);
/// let (reader, _watcher) = db.store("pods", api, kube_persist::StreamConfig::default())?;
/// assert_eq!(reader.phase(), SyncPhase::Empty); // the watcher has not run yet
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum SyncPhase {
    /// Nothing listed yet.
    #[default]
    Empty,
    /// A list or relist is writing pages (readers see old or new objects).
    Listing,
    /// A relist is complete and objects absent from it are being removed.
    Sweeping,
    /// The store equals the server at [`Reader::checkpoint`](crate::Reader::checkpoint).
    Synced,
}

impl From<&record::Phase> for SyncPhase {
    fn from(p: &record::Phase) -> Self {
        match p {
            record::Phase::Empty => SyncPhase::Empty,
            record::Phase::Listing { .. } => SyncPhase::Listing,
            record::Phase::Sweeping { .. } => SyncPhase::Sweeping,
            record::Phase::Synced { .. } => SyncPhase::Synced,
        }
    }
}

/// What readers can see of the writer's progress.
#[derive(Debug, Clone, Default)]
pub(crate) struct Status {
    pub(crate) phase: SyncPhase,
    pub(crate) ready: bool,
    pub(crate) live: bool,
    pub(crate) count: u64,
    pub(crate) checkpoint: Option<String>,
    /// Secondary indexes built on disk and ready for `Reader::by_index`.
    pub(crate) indexes: Vec<String>,
    /// Whether the store has caught up with the server (set by the watcher).
    pub(crate) fresh: fresh::Freshness,
    /// The epoch of the latest list begun (every list attempt is a new epoch).
    pub(crate) list_epoch: u64,
    /// The epoch of the latest list completed (with its sweep): `listed_epoch` greater
    /// than an earlier `list_epoch` proves a consistent list begun after that moment.
    pub(crate) listed_epoch: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::disk::record::{Codec, FORMAT_VERSION, Identity, Phase, Record, State};

    fn identity(format_version: u32) -> Identity {
        Identity {
            format_version,
            api_version: "v1".into(),
            kind: "Pod".into(),
            url: "/api/v1/pods".into(),
            label_selector: None,
            field_selector: None,
            metadata_only: false,
            keys_only: false,
            transform: None,
            encryption: None,
        }
    }

    /// A format 2 store (zstd bodies) is resumed, not relisted, and its records still read;
    /// a store of an unreadable format is wiped and relisted.
    #[test]
    fn previous_format_stores_resume_and_unreadable_ones_start_clean() {
        let json = br#"{"metadata":{"name":"a","namespace":"n","resourceVersion":"7"},"spec":{"x":"yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy"}}"#;
        let key = keys::tagged(keys::OBJECT, &keys::object_suffix(Some("n"), "a"));
        let synced = State {
            phase: Phase::Synced {
                resource_version: "7".into(),
            },
            epoch: 1,
            count: 1,
            last_synced: Some("7".into()),
        };
        for engine in [Engine::Redb, Engine::Sled] {
            let dir = tempfile::tempdir().unwrap();
            let db = Db::open_with(dir.path(), DbConfig::default().engine(engine)).unwrap();
            {
                // What format 2 wrote: its identity, state, and a zstd-compressed record.
                let s = db.open_stream("pods", &identity(2), None).unwrap();
                let rec = Record {
                    resource_version: "7".into(),
                    uid: "u".into(),
                    epoch: 1,
                    codec: Codec::Zstd as u8,
                    body: zstd::bulk::compress(json, 1).unwrap(),
                };
                let mut b = WriteBatch::default();
                b.put(key.clone(), record::encode(&rec));
                b.put(keys::STATE_KEY.to_vec(), record::encode(&synced));
                s.backend.apply(b).unwrap();
            }
            let s = db
                .open_stream("pods", &identity(FORMAT_VERSION), None)
                .unwrap();
            assert_eq!(s.reset, None, "{engine}: format 2 is resumed");
            assert_eq!(s.state, synced, "{engine}: its checkpoint is kept");
            let stored = s.backend.get(&key).unwrap().expect("record kept");
            let body = record::decode_ref(&stored)
                .unwrap()
                .open(&key, None)
                .unwrap();
            assert_eq!(&*body, json, "{engine}: zstd body reads");
            let id = s.backend.get(keys::IDENTITY_KEY).unwrap().unwrap();
            assert_eq!(
                record::decode::<Identity>(&id).unwrap().format_version,
                FORMAT_VERSION,
                "{engine}: the identity now says the current format"
            );
            drop(s);

            // Format 1 is not readable: the stream starts clean (a relist).
            let s = db.open_stream("old", &identity(1), None).unwrap();
            let mut b = WriteBatch::default();
            b.put(
                key.clone(),
                record::encode(&Record::sealed(
                    &key,
                    "7".into(),
                    "u".into(),
                    1,
                    json,
                    None,
                    None,
                    Compression::Lz4,
                )),
            );
            b.put(keys::STATE_KEY.to_vec(), record::encode(&synced));
            s.backend.apply(b).unwrap();
            drop(s);
            let s = db
                .open_stream("old", &identity(FORMAT_VERSION), None)
                .unwrap();
            assert!(
                s.reset
                    .as_deref()
                    .is_some_and(|r| r.contains("format_version")),
                "{engine}: {:?}",
                s.reset
            );
            assert_eq!(s.state, State::default(), "{engine}: relisted from scratch");
            assert_eq!(
                s.backend.get(&key).unwrap(),
                None,
                "{engine}: old objects removed"
            );
        }
    }
}
