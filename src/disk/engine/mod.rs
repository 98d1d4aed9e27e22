//! The storage engines behind two small interfaces: [`Storage`] (one store directory:
//! open a keyspace, list keyspaces, flush, size) and [`Backend`] (one stream's keyspace:
//! atomic batch, point get, ordered range scan, clear). Everything above this module
//! (writer, reader, indexes, hot cache) is engine-agnostic.
//!
//! redb is the default engine for new stores, always built; sled 0.34 is the other, built
//! with the `sled` feature (a build without it recognises a sled store and refuses it). A
//! store directory records which engine wrote it in its `engine` file, and is
//! reopened with that engine unless the caller asks for another one.

mod files;
mod held;
mod open_reads;
mod redb;
#[cfg(feature = "sled")]
mod sled;

pub(crate) use files::{Contents, refuse_foreign};
pub(crate) use held::wait_released;
pub(crate) use open_reads::{OpenReads, ReadGuard};

use files::{ENGINE_FILE, ENGINE_FILE_NEW, REDB_FILE, SLED_REQUIRED};

use std::path::Path;
use std::sync::Arc;

use super::DbConfig;
use crate::model::{Engine, Error, Result};

/// One key/value pair read from the engine.
pub(crate) type Entry = (Vec<u8>, Vec<u8>);

/// A set of puts and deletes applied atomically: after a crash either all or none are visible.
#[derive(Default)]
pub(crate) struct WriteBatch {
    ops: Vec<(Vec<u8>, Option<Vec<u8>>)>,
}

impl WriteBatch {
    pub(crate) fn put(&mut self, key: Vec<u8>, value: Vec<u8>) {
        debug_assert!(!key.is_empty(), "a put without a key");
        self.ops.push((key, Some(value)));
    }

    pub(crate) fn delete(&mut self, key: Vec<u8>) {
        debug_assert!(!key.is_empty(), "a delete without a key");
        self.ops.push((key, None));
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    pub(crate) fn len(&self) -> usize {
        self.ops.len()
    }

    /// Bytes of the keys and values this batch writes (a deletion: its key).
    pub(crate) fn bytes(&self) -> usize {
        self.ops
            .iter()
            .map(|(k, v)| k.len() + v.as_ref().map_or(0, Vec::len))
            .sum()
    }

    /// The keys this batch writes or deletes.
    pub(crate) fn keys(&self) -> impl Iterator<Item = &[u8]> {
        self.ops.iter().map(|(k, _)| k.as_slice())
    }
}

/// What the store needs from a storage engine, for one stream's keyspace.
pub(crate) trait Backend: Send + Sync + 'static {
    /// Point lookup.
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>>;
    /// Point lookups of `keys`: `found(i, value)` for each `keys[i]` that exists, in
    /// order. Engines override it to read all of them in one read transaction.
    fn get_each(
        &self,
        keys: &[&[u8]],
        found: &mut dyn FnMut(usize, &[u8]) -> Result<()>,
    ) -> Result<()> {
        for (i, key) in keys.iter().enumerate() {
            if let Some(v) = self.get(key)? {
                found(i, &v)?;
            }
        }
        Ok(())
    }
    /// Apply all operations of `batch` atomically.
    fn apply(&self, batch: WriteBatch) -> Result<()>;
    /// Ordered scan of keys in `[start, end)`, lazily, without collecting.
    fn range(&self, start: &[u8], end: &[u8]) -> Box<dyn Iterator<Item = Result<Entry>> + Send>;
    /// The engine this keyspace is kept in (read by the `metrics` feature).
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    fn engine(&self) -> Engine;
    /// The scans open on this keyspace's directory (shared by its keyspaces; their age is
    /// read by the `metrics` feature).
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    fn open_reads(&self) -> Arc<OpenReads>;
    /// Remove every key of this keyspace.
    fn clear(&self) -> Result<()>;
    /// Bytes this keyspace occupies: for redb the table's stored, metadata and fragmented
    /// bytes; for sled (which keeps no per-tree figure) its keys and values, counted by a
    /// scan, before sled's own overhead.
    fn disk_bytes(&self) -> Result<u64>;
}

/// Keyspaces of streams are named `stream/<name>` in the engine.
pub(crate) const STREAMS: &str = "stream/";
/// Keyspaces of controllers' reconcile state are named `controller/<name>`.
pub(crate) const CONTROLLERS: &str = "controller/";

/// A store directory's storage: one keyspace per stream, and one per durable controller.
pub(crate) trait Storage: Send + Sync + 'static {
    /// Open (creating if needed) the keyspace `<group><name>` (`group`: [`STREAMS`] or
    /// [`CONTROLLERS`]).
    fn keyspace_of(&self, group: &str, name: &str) -> Result<Arc<dyn Backend>>;
    /// Names (without the prefix) of the keyspaces of `group`, in any order.
    fn keyspaces_of(&self, group: &str) -> Result<Vec<String>>;
    /// Remove keyspace `name` of `group` and everything in it, durably; false if there was
    /// none. The caller makes sure nothing holds it open.
    fn drop_keyspace(&self, group: &str, name: &str) -> Result<bool>;
    /// Open (creating if needed) the keyspace of stream `stream`.
    fn keyspace(&self, stream: &str) -> Result<Arc<dyn Backend>> {
        self.keyspace_of(STREAMS, stream)
    }
    /// Names of the streams that have a keyspace, in any order.
    fn keyspaces(&self) -> Result<Vec<String>> {
        self.keyspaces_of(STREAMS)
    }
    /// Make everything applied so far durable.
    fn flush(&self) -> Result<()>;
    /// Bytes the engine's files occupy on disk.
    fn size_on_disk(&self) -> Result<u64>;
    /// The engine this storage is kept in.
    fn engine(&self) -> Engine;
}

/// What only the disk knows of an engine: which one wrote a store directory, by its files.
impl Engine {
    /// Which engine wrote the store at `path`, or `None` if there is no store there yet.
    ///
    /// A store without an `engine` file (written before it existed) is told by its files.
    ///
    /// ```
    /// # fn main() -> Result<(), kube_persist::Error> {
    /// use kube_persist::{Db, Engine};
    /// let dir = tempfile::tempdir().unwrap();
    /// assert_eq!(Engine::of_store(dir.path())?, None);
    /// drop(Db::open(dir.path())?);
    /// assert_eq!(Engine::of_store(dir.path())?, Some(Engine::Redb));
    /// # Ok(()) }
    /// ```
    pub fn of_store(path: impl AsRef<Path>) -> Result<Option<Engine>> {
        let path = path.as_ref();
        let bytes = match std::fs::read(path.join(ENGINE_FILE)) {
            Ok(bytes) => bytes,
            // No engine file: a store from before it existed (sled), or one whose engine
            // file was lost: tell by the engine's files.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Engine::by_files(path));
            }
            Err(e) => return Err(Error::from_io(path.to_path_buf(), e)),
        };
        if bytes.iter().all(u8::is_ascii_whitespace) {
            // Created but never written (a crash at that moment): as if missing.
            return Ok(Engine::by_files(path));
        }
        std::str::from_utf8(&bytes)
            .ok()
            .and_then(|text| text.trim().parse().ok())
            .map(Some)
            .ok_or_else(|| Error::Corrupt {
                path: path.to_path_buf(),
                detail: format!(
                    "its {ENGINE_FILE} file does not name a storage engine: {:?}",
                    String::from_utf8_lossy(&bytes[..bytes.len().min(32)])
                ),
            })
    }

    /// The engine whose files `path` holds, ignoring the `engine` file.
    fn by_files(path: &Path) -> Option<Engine> {
        if SLED_REQUIRED.iter().all(|f| path.join(f).is_file()) {
            Some(Engine::Sled)
        } else {
            path.join(REDB_FILE).is_file().then_some(Engine::Redb)
        }
    }
}

/// The error of a build without the `sled` feature asked to open a sled store.
#[cfg(not(feature = "sled"))]
fn no_sled(path: &Path) -> Error {
    Error::FeatureNotBuilt {
        feature: "sled",
        detail: format!("{} is a sled store (or sled was asked for)", path.display()),
    }
}

/// Open the storage of the store directory at `path` (which exists, with private
/// permissions). An existing store is opened with the engine recorded in it; a new one with
/// the configured engine, or [`Engine::default`] if none was chosen, which is recorded.
/// Only an engine chosen explicitly ([`DbConfig::engine`]) that differs from the recorded
/// one is [`Error::EngineMismatch`].
pub(crate) fn open(path: &Path, config: &DbConfig) -> Result<Arc<dyn Storage>> {
    let requested = config.engine;
    #[cfg(not(feature = "sled"))]
    if requested == Some(Engine::Sled) {
        return Err(no_sled(path));
    }
    let stored = match Engine::of_store(path)? {
        Some(stored) => stored,
        None if config.read_only => {
            return Err(Error::NoStore {
                path: path.to_path_buf(),
                detail: "nothing to open read-only".into(),
            });
        }
        None => record_engine(path, requested.unwrap_or_default())?,
    };
    if config.read_only && stored == Engine::Sled {
        return Err(Error::ReadOnlyUnavailable {
            path: path.to_path_buf(),
            detail: "it is a sled store, and sled has no read-only mode".into(),
        });
    }
    match requested {
        Some(requested) if requested != stored => {
            return Err(Error::EngineMismatch {
                path: path.to_path_buf(),
                stored,
                requested,
            });
        }
        _ => {}
    }
    match stored {
        #[cfg(feature = "sled")]
        Engine::Sled => Ok(Arc::new(sled::SledStorage::open(path, config)?)),
        #[cfg(not(feature = "sled"))]
        Engine::Sled => Err(no_sled(path)),
        Engine::Redb => Ok(Arc::new(redb::RedbStorage::open(
            path.join(REDB_FILE),
            config,
        )?)),
    }
}

/// Write the `engine` file of a new store: whole or not at all (a temporary file, synced,
/// then linked into place), and never over another opener's choice. Returns the engine the
/// store now records: if another process created the store at the same moment, its engine
/// wins (and [`open`] reports a different explicit choice here as [`Error::EngineMismatch`]).
fn record_engine(path: &Path, engine: Engine) -> Result<Engine> {
    use std::io::Write;
    let io = |e| Error::from_io(path.to_path_buf(), e);
    let tmp = path.join(format!("{ENGINE_FILE_NEW}{}", std::process::id()));
    let written = (|| {
        // An engine file created but never written (a crash at that moment) is replaced.
        let file = path.join(ENGINE_FILE);
        if std::fs::read(&file).is_ok_and(|b| b.iter().all(u8::is_ascii_whitespace)) {
            std::fs::remove_file(&file)?;
        }
        // Never through a link (one planted there would have its target truncated), never
        // over an existing file: a leftover of an earlier process with this pid, or a link,
        // is removed first (itself, not what it points to), then the file is created anew.
        match std::fs::remove_file(&tmp) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let mut f = new_private_file(&tmp)?;
        f.write_all(format!("{engine}\n").as_bytes())?;
        f.sync_all()?;
        match std::fs::hard_link(&tmp, path.join(ENGINE_FILE)) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
            _ => {}
        }
        std::fs::File::open(path)?.sync_all()
    })();
    let _ = std::fs::remove_file(&tmp);
    written.map_err(io)?;
    Ok(Engine::of_store(path)?.unwrap_or(engine))
}

/// Create the file at `path` for writing, mode 0600: a new file, never an existing one
/// (`O_EXCL`) and never through a symbolic link (`O_NOFOLLOW`; `O_EXCL` refuses a link
/// already, even a dangling one), so that nothing outside the store is ever written.
fn new_private_file(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .mode(0o600)
        .open(path)
}

/// Check that `path` looks like a store directory that is not open anywhere, before
/// [`Db::destroy`](crate::Db::destroy) removes it: it holds its engine's files and nothing
/// else the store did not make (else [`Error::NotAStore`]; see [`Contents`]). Any failure
/// other than a held lock (the corruption being wiped, say) does not prevent the removal.
pub(crate) fn check_removable(path: &Path) -> Result<()> {
    let refuse = |why: String| Error::NoStore {
        path: path.to_path_buf(),
        detail: format!("refusing to remove it: {why}"),
    };
    let contents = Contents::read(path)?
        .ok_or_else(|| Error::from_io(path.to_path_buf(), std::io::ErrorKind::NotFound.into()))?;
    contents.only_own(path)?;
    let Some(engine) = contents.engine else {
        return Err(refuse("it holds no engine file and no store files".into()));
    };
    for file in files::required(engine) {
        if !path.join(file).exists() {
            return Err(refuse(format!("it has no {engine} {file:?} file")));
        }
    }
    let probe = match engine {
        #[cfg(feature = "sled")]
        Engine::Sled => sled::probe_lock(path),
        #[cfg(not(feature = "sled"))]
        Engine::Sled => Err(no_sled(path)),
        Engine::Redb => redb::probe_lock(&path.join(REDB_FILE)),
    };
    match probe {
        Err(Error::Locked { path }) => Err(Error::Locked { path }),
        Ok(()) => Ok(()),
        // This build cannot tell whether the store is open elsewhere.
        Err(e @ Error::FeatureNotBuilt { .. }) => Err(e),
        Err(e) => {
            tracing::info!(path = %path.display(), error = %e, "removing a store that does not open");
            Ok(())
        }
    }
}

/// Remove the entries the store made in the directory at `path` (after
/// [`check_removable`]), leaving the directory itself, empty: `Db::destroy` through a
/// symbolic link. [`Error::NotAStore`], removing nothing, if it holds anything else.
pub(crate) fn remove_own_files(path: &Path) -> Result<()> {
    let io = |p: &Path, e| Error::from_io(p.to_path_buf(), e);
    let contents =
        Contents::read(path)?.ok_or_else(|| io(path, std::io::ErrorKind::NotFound.into()))?;
    contents.only_own(path)?;
    for p in contents.own.iter().filter(|p| p.as_path() != path) {
        let removed = match std::fs::symlink_metadata(p) {
            Ok(meta) if meta.is_dir() => std::fs::remove_dir_all(p),
            Ok(_) => std::fs::remove_file(p),
            Err(e) => Err(e),
        };
        match removed {
            // Below a directory removed before it (sled's `blobs/`).
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            other => other.map_err(|e| io(p, e))?,
        }
    }
    std::fs::File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(|e| io(path, e))
}

/// Run `op` (an engine call on the store at `path`), turning a panic inside the engine
/// into [`Error::Corrupt`] naming the path. Engines trust their files: a damaged page can
/// make them index out of bounds while opening or reading, and a damaged store must be an
/// error the caller can act on (`Db::destroy`), not a crashed watcher.
pub(crate) fn catch_panic<T>(path: &Path, what: &str, op: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(op)) {
        Ok(res) => res,
        Err(panic) => {
            let msg = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            tracing::error!(path = %path.display(), panic = %msg, "the storage engine panicked while {what}");
            Err(Error::Corrupt {
                path: path.to_path_buf(),
                detail: format!("the storage engine panicked while {what}: {msg}"),
            })
        }
    }
}

/// Like [`catch_panic`], for opening the store.
pub(crate) fn catch_open<T>(path: &Path, open: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_panic(path, "opening it", open)
}

/// An engine's range iterator with panics turned into [`Error::Corrupt`]; it ends after one.
/// It counts as an open read of its directory until dropped.
pub(crate) struct Guarded<I> {
    inner: Option<I>,
    path: std::path::PathBuf,
    _read: ReadGuard,
}

impl<I> Guarded<I> {
    pub(crate) fn new(inner: I, path: &Path, read: ReadGuard) -> Self {
        Guarded {
            inner: Some(inner),
            path: path.to_path_buf(),
            _read: read,
        }
    }
}

impl<I: Iterator<Item = Result<Entry>>> Iterator for Guarded<I> {
    type Item = Result<Entry>;

    fn next(&mut self) -> Option<Result<Entry>> {
        let inner = self.inner.as_mut()?;
        match catch_panic(&self.path, "reading a range", || Ok(inner.next())) {
            Ok(item) => item,
            Err(e) => {
                self.inner = None;
                Some(Err(e))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 60 item 5: a link planted where the `engine` file's temporary goes
    /// (`engine.new.<pid>`) is removed, never written through: its target keeps its
    /// bytes, and the `engine` file is written whole.
    #[test]
    fn a_planted_link_at_the_temporary_path_does_not_truncate_its_target() {
        let tmp = tempfile::tempdir().unwrap();
        let (store, victim) = (tmp.path().join("store"), tmp.path().join("victim"));
        std::fs::create_dir(&store).unwrap();
        std::fs::write(&victim, "keep me\n").unwrap();
        let planted = store.join(format!("{ENGINE_FILE_NEW}{}", std::process::id()));
        std::os::unix::fs::symlink(&victim, &planted).unwrap();
        assert_eq!(record_engine(&store, Engine::Redb).unwrap(), Engine::Redb);
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep me\n");
        assert!(
            std::fs::symlink_metadata(&planted).is_err(),
            "the link is gone"
        );
        let engine = std::fs::symlink_metadata(store.join(ENGINE_FILE)).unwrap();
        assert!(engine.is_file(), "the engine file is a file, not a link");
        assert_eq!(
            std::fs::read_to_string(store.join(ENGINE_FILE)).unwrap(),
            "redb\n"
        );
        // A file created anew is the store's own: mode 0600 whatever the umask.
        use std::os::unix::fs::PermissionsExt;
        let tmp_file = store.join("t");
        drop(new_private_file(&tmp_file).unwrap());
        assert_eq!(
            std::fs::metadata(&tmp_file).unwrap().permissions().mode() & 0o777,
            0o600
        );
        // Never over an existing file, nor through a dangling link.
        assert!(new_private_file(&tmp_file).is_err());
        let dangling = store.join("dangling");
        std::os::unix::fs::symlink(tmp.path().join("nowhere"), &dangling).unwrap();
        assert!(new_private_file(&dangling).is_err());
        assert!(!tmp.path().join("nowhere").exists());
    }
}
