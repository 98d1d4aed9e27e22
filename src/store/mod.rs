//! The on-disk side: one database per directory (redb by default, or sled; see [`Engine`]),
//! one keyspace per watched stream, an atomic [`writer`] and a concurrent [`Reader`].
//!
//! The store layer: one stream's keyspace (open with its identity check and cache reset,
//! the writer, the hot cache, the reader, inspection). It never makes an HTTP request.
//!
//! May import: `model`, `exec`, `disk`.

mod cache;
mod caught_up;
mod inspect;
mod open;
mod reader;
mod status;
mod stream_state;
mod writer;

pub(crate) use cache::DECODED_PER_JSON_BYTE;
pub use caught_up::{CatchUpRule, Freshness};
pub(crate) use inspect::StoredVersions;
pub use inspect::{RawObjects, StreamInfo};
#[cfg(feature = "metrics")]
pub(crate) use reader::MetricsSource;
pub(crate) use reader::StoredHead;
pub use reader::{ByIndex, Iter, Reader};
pub use status::SyncPhase;
pub(crate) use status::{Status, StatusTx};
#[cfg(any(fuzzing, test))]
pub(crate) use stream_state::fuzz_decode;
pub(crate) use stream_state::{Identity, Phase, State};
pub(crate) use writer::{Body, Change, Incoming, IndexEntries, ListProgress, Op, Writer};

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::disk::{
    self, Backend, Cipher, Compression, DbConfig, EncryptionKey, Leases, Refused, Storage,
    StoreKey, StreamLease, keys, record,
};
use crate::exec::DiskWorker;
use crate::model::{Engine, Error, Result, Shard};
use cache::HotCache;

/// What [`Db::destroy`](crate::Db::destroy) removed.
///
/// ```
/// # fn main() -> Result<(), kube_persist::Error> {
/// use kube_persist::{Db, Removed};
/// let dir = tempfile::tempdir().unwrap();
/// let (real, link) = (dir.path().join("real"), dir.path().join("link"));
/// drop(Db::open(&real)?);
/// std::os::unix::fs::symlink(&real, &link).unwrap();
/// // Through a link: the store's files in its target; the link and the directory stay.
/// assert!(matches!(Db::destroy(&link)?, Removed::Target { .. }));
/// assert!(link.exists() && std::fs::read_dir(&real).unwrap().next().is_none());
/// drop(Db::open(&link)?); // a new store, in the same place
/// assert_eq!(Db::destroy(&real)?, Removed::Directory);
/// assert_eq!(Db::destroy(&real)?, Removed::Nothing);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Removed {
    /// Nothing was there to remove.
    Nothing,
    /// The store directory and everything in it.
    Directory,
    /// The path was a symbolic link: the store's files in the directory it points to were
    /// removed; the link and that directory, now empty, were kept.
    Target {
        /// The directory the link points to (resolved).
        target: PathBuf,
    },
}

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
    /// The store layer's handle; every public method of `Db` (in `db.rs`) delegates to it
    /// or to the layer above that does the work, passing it down.
    pub(crate) dir: Dir,
}

/// The store layer's handle on a store directory: what `sync/` and `controller/` hold and
/// pass down. Cheap to clone (one `Arc`).
#[derive(Clone)]
pub(crate) struct Dir {
    inner: Arc<DirInner>,
}

struct DirInner {
    storage: Arc<dyn Storage>,
    /// The engine `storage` is kept in.
    engine: Engine,
    path: PathBuf,
    config: DbConfig,
    /// The configured key, from which each encrypted stream's keys are derived.
    key: Option<Arc<StoreKey>>,
    /// The keyspaces held by a writer in this process.
    leases: Arc<Leases>,
    /// Each stream's hot cache, shared by every `Reader` and writer of the stream in this
    /// process, across reopens, so that no reader keeps a cache nothing invalidates.
    caches: Mutex<HashMap<String, std::sync::Weak<HotCache>>>,
    /// The thread that runs every write of this directory's streams.
    worker: DiskWorker,
}

/// Store directories whose last `Db` handle in this process was dropped recently. The
/// engine may hold the files a while longer: a queued write or a scan still running ends
/// first, redb flushes on close, and sled releases its file lock only when its deferred
/// destructors run, a moment after that.
static RECENTLY_CLOSED: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// How long a reopen waits for this process's remaining engine handles on a store it closed
/// (queued writes, running scans, the final flush): past it, the store is reported
/// [`Error::Locked`] (a `Reader` kept after its `Db` was dropped holds the files).
const RELEASE_WAIT: Duration = Duration::from_secs(30);
/// How long a reopen retries once those handles are gone, for the engine's deferred release.
const RELEASE_GRACE: Duration = Duration::from_secs(2);

impl Drop for DirInner {
    fn drop(&mut self) {
        let mut closed = RECENTLY_CLOSED.lock().unwrap_or_else(|p| p.into_inner());
        if !closed.contains(&self.path) {
            closed.push(self.path.clone());
        }
    }
}

/// Run `open`; if the store is locked and this process closed it (or failed to open it) a
/// moment ago, wait for this process's last engine handles on it to close (up to
/// [`RELEASE_WAIT`]), then retry for up to [`RELEASE_GRACE`] while the engine finishes
/// releasing it. A lock held by another process (or by a live `Db` in this one) is reported
/// at once. Blocks the calling thread while it waits.
fn open_after_close<T>(path: &Path, open: impl Fn() -> Result<T>) -> Result<T> {
    let mut grace = std::time::Instant::now() + RELEASE_GRACE;
    loop {
        let res = open();
        let recently_closed = || {
            RECENTLY_CLOSED
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .any(|p| p == path)
        };
        if matches!(res, Err(Error::Locked { .. })) && recently_closed() {
            match disk::wait_released(path, RELEASE_WAIT) {
                // Closed while we waited: the engine's own release may lag a moment.
                Some(true) => grace = std::time::Instant::now() + RELEASE_GRACE,
                Some(false) if std::time::Instant::now() < grace => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                // Still held by this process, or released and still locked past the grace.
                Some(false) | None => return res,
            }
            continue;
        }
        let mut closed = RECENTLY_CLOSED.lock().unwrap_or_else(|p| p.into_inner());
        match &res {
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
        return res;
    }
}

/// The configured key, if any ([`Error::FeatureNotBuilt`] in a build without encryption).
fn key_of(config: &DbConfig) -> Result<Option<Arc<StoreKey>>> {
    config
        .encryption
        .as_ref()
        .map(|key| key.store_key().map(Arc::new))
        .transpose()
}

impl std::fmt::Debug for Db {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.dir.fmt(f)
    }
}

impl std::fmt::Debug for Dir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Db")
            .field("path", &self.inner.path)
            .field("engine", &self.inner.engine)
            .field("config", &self.inner.config)
            .finish()
    }
}

impl Dir {
    /// The work of [`Db::open_with`](crate::Db::open_with). Blocking.
    pub(crate) fn open(path: impl AsRef<Path>, config: DbConfig) -> Result<Dir> {
        // A symbolic link is its target (refused with strict permissions): everything
        // below, the permission checks and the tightening included, is of the real folder.
        let path = disk::resolve_root(path.as_ref(), config.strict_permissions)?;
        // Before anything is created, changed or opened: a directory holding what the store
        // did not make (the user's files, a volume's `lost+found`) is not a store's.
        disk::refuse_foreign(&path)?;
        if config.read_only {
            return Dir::open_read_only(path, config);
        }
        disk::check_owner(&path, config.strict_permissions)?;
        let open = disk::too_open(&path)?;
        if !open.is_empty() {
            if config.strict_permissions {
                return Err(Error::Permissions { path, open });
            }
            tracing::warn!(path = %path.display(), entries = ?open,
                "store files are readable by group or others; tightening to 0700/0600");
        }
        disk::create_private_dir(&path)?;
        // Before the engine creates its files: a directory this process cannot make private
        // (not its owner, as a volume root seen through fsGroup) fails here, leaving nothing.
        disk::tighten(&path)?;
        let key = key_of(&config)?;
        let storage = open_after_close(&path, || crate::disk::open_storage(&path, &config))?;
        disk::tighten(&path)?;
        let engine = storage.engine();
        let encrypted = key.is_some();
        tracing::info!(path = %path.display(), %engine, encrypted, "store opened");
        if !encrypted {
            tracing::warn!(path = %path.display(), encrypted,
                "store is not encrypted: objects written to it are stored in clear (DbConfig::encryption_key to encrypt)");
        }
        let worker = DiskWorker::spawn(&path)?;
        Ok(Dir::from_parts(storage, engine, path, key, config, worker))
    }

    fn from_parts(
        storage: Arc<dyn Storage>,
        engine: Engine,
        path: PathBuf,
        key: Option<Arc<StoreKey>>,
        config: DbConfig,
        worker: DiskWorker,
    ) -> Dir {
        Dir {
            inner: Arc::new(DirInner {
                storage,
                engine,
                path,
                key,
                config,
                leases: Arc::default(),
                caches: Mutex::default(),
                worker,
            }),
        }
    }

    /// [`DbConfig::read_only`](crate::DbConfig::read_only): no directory created, no
    /// permission changed, no lease ever granted (every stream and controller open is
    /// refused, so nothing writes).
    fn open_read_only(path: PathBuf, config: DbConfig) -> Result<Dir> {
        let key = key_of(&config)?;
        let storage = disk::open_storage(&path, &config)?;
        let engine = storage.engine();
        tracing::debug!(path = %path.display(), %engine, encrypted = key.is_some(),
            "store opened read-only");
        let worker = DiskWorker::spawn(&path)?;
        Ok(Dir::from_parts(storage, engine, path, key, config, worker))
    }

    /// The work of [`Db::destroy`](crate::Db::destroy).
    pub(crate) fn destroy(path: impl AsRef<Path>) -> Result<Removed> {
        let path = path.as_ref();
        let io = |e| Error::from_io(path.to_path_buf(), e);
        let entries = match std::fs::read_dir(path) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Removed::Nothing),
            Err(e) => return Err(io(e)),
        };
        drop(entries);
        let linked = std::fs::symlink_metadata(path)
            .map_err(io)?
            .file_type()
            .is_symlink();
        if !linked {
            open_after_close(path, || crate::disk::check_removable(path))?;
            std::fs::remove_dir_all(path).map_err(io)?;
            tracing::warn!(path = %path.display(), "store removed; the next start lists from scratch");
            return Ok(Removed::Directory);
        }
        // A link: the store is its target. Its files go, the link and the directory stay
        // (the next open through the link starts from scratch there).
        let target = std::fs::canonicalize(path).map_err(io)?;
        open_after_close(&target, || crate::disk::check_removable(&target))?;
        crate::disk::remove_own_files(&target)?;
        tracing::warn!(path = %path.display(), target = %target.display(),
            "the store path is a symbolic link: removed the store's files in its target, kept the link and the (empty) directory; the next start lists from scratch");
        Ok(Removed::Target { target })
    }

    /// The work of [`Db::path`](crate::Db::path).
    pub(crate) fn path(&self) -> &Path {
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

    /// The cipher of stream `stream`, whose keyspace is `backend`: `None` without a key,
    /// else its keys derived from the configured key and the stream's id
    /// (`keys::STREAM_ID_KEY`). Call it only for a stream that is encrypted with this key (its
    /// identity checked); one without an id is [`Error::Corrupt`].
    // Without the `encryption` feature no key exists (`StoreKey` has no value).
    #[cfg_attr(not(feature = "encryption"), allow(unreachable_code))]
    pub(crate) fn stream_cipher(
        &self,
        backend: &dyn Backend,
        stream: &str,
    ) -> Result<Option<Arc<Cipher>>> {
        let Some(key) = &self.inner.key else {
            return Ok(None);
        };
        let Some(id) = self.read_meta::<Vec<u8>>(backend, stream, keys::STREAM_ID_KEY)? else {
            return Err(record::corrupt_in(
                &self.inner.path,
                &format!("stream {stream:?}"),
                keys::STREAM_ID_KEY,
                "an encrypted stream without its id: its records cannot be opened",
            ));
        };
        Ok(Some(Arc::new(key.stream_cipher(stream, &id))))
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
    pub(crate) fn engine(&self) -> Engine {
        self.inner.engine
    }

    /// The work of [`Db::flush`](crate::Db::flush).
    pub(crate) fn flush(&self) -> Result<()> {
        self.inner.storage.flush()
    }

    /// The work of [`Db::size_on_disk`](crate::Db::size_on_disk).
    pub(crate) fn size_on_disk(&self) -> Result<u64> {
        self.inner.storage.size_on_disk()
    }

    /// Hold `name` (a stream, or `controller/<name>`) as open in this process until the
    /// lease is dropped: one writer per keyspace. If its previous owner was just dropped,
    /// waits (blocking) until that owner's last queued disk job ran (see `disk/lease.rs`).
    /// `what` is `"stream"` for a stream (refused with [`Error::StreamInUse`]), anything
    /// else for a controller's state (`name` is then `controller/<name>`, refused with
    /// [`Error::ControllerInUse`]).
    pub(crate) fn lease(&self, name: &str, what: &str) -> Result<StreamLease> {
        let path = self.path().to_path_buf();
        if self.inner.config.read_only {
            return Err(Error::ReadOnly {
                path,
                detail: format!("{what} {name:?} cannot be opened"),
            });
        }
        self.inner
            .leases
            .acquire(
                name,
                self.inner.clone() as Arc<dyn std::any::Any + Send + Sync>,
            )
            .map_err(|refused| match refused {
                Refused::Closing(waited) => Error::StillClosing {
                    path,
                    name: name.to_string(),
                    waited,
                },
                Refused::Open if what == "stream" => Error::StreamInUse {
                    path,
                    stream: name.to_string(),
                },
                Refused::Open => Error::ControllerInUse {
                    path,
                    controller: name
                        .strip_prefix(disk::CONTROLLERS)
                        .unwrap_or(name)
                        .to_string(),
                },
            })
    }

    /// [`Error::NoSuchStream`] (group [`disk::STREAMS`]) or [`Error::NoSuchController`]
    /// unless keyspace `name` of `group` exists.
    pub(crate) fn require_keyspace(&self, group: &str, name: &str) -> Result<()> {
        if self
            .storage()
            .keyspaces_of(group)?
            .iter()
            .any(|n| n == name)
        {
            return Ok(());
        }
        let path = self.path().to_path_buf();
        Err(if group == disk::STREAMS {
            Error::NoSuchStream {
                path,
                stream: name.to_string(),
            }
        } else {
            Error::NoSuchController {
                path,
                controller: name.to_string(),
            }
        })
    }

    /// Remove keyspace `name` of `group` (a stream's, with [`disk::STREAMS`], or a durable
    /// controller's, with [`disk::CONTROLLERS`]): refused while it is open in this process
    /// ([`Error::StreamInUse`], [`Error::ControllerInUse`]), [`Error::NoSuchStream`] or
    /// [`Error::NoSuchController`] if there is none. Blocking: one durable
    /// commit (redb frees the pages, sled drops the tree).
    pub(crate) fn drop_keyspace(&self, group: &str, name: &str, what: &str) -> Result<()> {
        let lease_name = if group == disk::STREAMS {
            name.to_string()
        } else {
            format!("{group}{name}")
        };
        // Held while the keyspace goes: nothing in this process opens it meanwhile.
        let _lease = self.lease(&lease_name, what)?;
        self.require_keyspace(group, name)?;
        self.storage().drop_keyspace(group, name)?;
        if group == disk::STREAMS {
            let mut caches = self.inner.caches.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(cache) = caches.remove(name).and_then(|c| c.upgrade()) {
                cache.reset(0);
            }
        }
        tracing::warn!(path = %self.path().display(), what, name, "removed from the store");
        Ok(())
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

    /// The metadata record at `key` of stream `stream`'s keyspace, decoded.
    pub(super) fn read_meta<T: serde::de::DeserializeOwned>(
        &self,
        backend: &dyn Backend,
        stream: &str,
        key: &[u8],
    ) -> Result<Option<T>> {
        match backend.get(key)? {
            Some(b) => record::decode(&b).map(Some).map_err(|d| {
                record::corrupt_in(&self.inner.path, &format!("stream {stream:?}"), key, d)
            }),
            None => Ok(None),
        }
    }

    /// Open stream `name` and build its writer and reader (`open.rs`, [`open::stream_parts`]).
    pub(crate) fn open_stream_parts<K>(
        &self,
        name: &str,
        identity: &Identity,
        shard: Option<&Shard>,
        hot_cache_bytes: usize,
        index_names: &[String],
    ) -> Result<open::StreamParts<K>>
    where
        K: kube::Resource + serde::de::DeserializeOwned + Send + Sync + 'static,
    {
        open::stream_parts(self, name, identity, shard, hot_cache_bytes, index_names)
    }

    /// The work of [`Db::streams`](crate::Db::streams) (`inspect.rs`).
    pub(crate) fn streams(&self) -> Result<Vec<StreamInfo>> {
        inspect::streams(self)
    }

    /// The work of [`Db::stream_disk_bytes`](crate::Db::stream_disk_bytes) (`inspect.rs`).
    pub(crate) fn stream_disk_bytes(&self, stream: &str) -> Result<u64> {
        inspect::stream_disk_bytes(self, stream)
    }

    /// The work of [`Db::raw_get`](crate::Db::raw_get) (`inspect.rs`).
    pub(crate) fn raw_get(
        &self,
        stream: &str,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<Vec<u8>>> {
        inspect::raw_get(self, stream, namespace, name)
    }

    /// The work of [`Db::raw_objects`](crate::Db::raw_objects) and, with `after`,
    /// [`Db::raw_objects_after`](crate::Db::raw_objects_after) (`inspect.rs`).
    pub(crate) fn raw_objects(&self, stream: &str, after: Option<&str>) -> Result<RawObjects> {
        inspect::raw_objects(self, stream, after)
    }

    /// The resourceVersions of stream `stream`'s stored objects, read without their bodies
    /// (`inspect.rs`).
    pub(crate) fn stored_versions(&self, stream: &str) -> Result<StoredVersions> {
        inspect::stored_versions(self, stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// What a test's log events say, formatted as the `fmt` subscriber writes them.
    #[derive(Clone, Default)]
    struct Logs(Arc<Mutex<Vec<u8>>>);

    impl Write for Logs {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
        type Writer = Logs;

        fn make_writer(&'a self) -> Logs {
            self.clone()
        }
    }

    /// The log lines `f` emits on this thread.
    fn logged(f: impl FnOnce()) -> Vec<String> {
        let logs = Logs::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(logs.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::DEBUG)
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
        text.lines().map(str::to_string).collect()
    }

    /// Issue 60 item 2: every open line says whether the store is encrypted, and a writable
    /// open without a key warns that the store is not (read-only opens write nothing).
    #[test]
    fn the_open_line_says_whether_the_store_is_encrypted() {
        let line = |lines: &[String], what: &str| {
            lines
                .iter()
                .find(|l| l.contains(what))
                .unwrap_or_else(|| panic!("no {what:?} line in {lines:#?}"))
                .clone()
        };
        let not_encrypted = |lines: &[String]| {
            lines
                .iter()
                .any(|l| l.contains("WARN") && l.contains("store is not encrypted"))
        };
        for engine in [Engine::Redb, Engine::Sled] {
            let tmp = tempfile::tempdir().unwrap();
            let dir = tmp.path().join("plain");
            let config = DbConfig::default().engine(engine);
            let lines = logged(|| drop(Dir::open(&dir, config.clone()).unwrap()));
            assert!(
                line(&lines, "store opened").contains("encrypted=false"),
                "{engine}: {lines:#?}"
            );
            assert!(not_encrypted(&lines), "{engine}: {lines:#?}");
            // sled has no read-only mode.
            if engine == Engine::Redb {
                let lines = logged(|| drop(Dir::open(&dir, config.clone().read_only()).unwrap()));
                assert!(
                    line(&lines, "store opened read-only").contains("encrypted=false"),
                    "{engine}: {lines:#?}"
                );
            }
            #[cfg(feature = "encryption")]
            {
                let dir = tmp.path().join("sealed");
                let config = config.encryption_key(EncryptionKey::from_bytes([5; 32]));
                let lines = logged(|| drop(Dir::open(&dir, config.clone()).unwrap()));
                assert!(
                    line(&lines, "store opened").contains("encrypted=true"),
                    "{engine}: {lines:#?}"
                );
                assert!(!not_encrypted(&lines), "{engine}: {lines:#?}");
                if engine == Engine::Redb {
                    let lines = logged(|| drop(Dir::open(&dir, config.read_only()).unwrap()));
                    assert!(
                        line(&lines, "store opened read-only").contains("encrypted=true"),
                        "{engine}: {lines:#?}"
                    );
                }
            }
        }
    }
}
