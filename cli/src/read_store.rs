//! How the reading commands open a store: never for writing.
//!
//! A redb store is opened read-only (`DbConfig::read_only`): nothing on disk changes, and a
//! controller may run on it meanwhile (with `Durability::EveryBatch`). sled has no
//! read-only mode: opening a sled store writes to it (its recovery, its flusher, the
//! store's permission tightening), so a reading command copies the store into a private
//! temporary directory (mode 0700, under `TMPDIR`, or `/tmp`), opens the copy, and removes
//! it when the command ends. The store's files are read once and left byte for byte as
//! they were. During the copy the command holds a shared lock on sled's `db` file, the
//! file sled locks exclusively while it has a store open: a store open in a controller is
//! refused ("locked", exit status 2), as opening it would be, and a sled writer that
//! starts during the copy is refused until the copy is done. The cost: the store's size on
//! disk again in the temporary directory, for as long as the command runs, and the time to
//! copy it (a sequential read and write of every file).

use std::fs::File;
use std::path::{Path, PathBuf};

use kube_persist::{Db, DbConfig, Engine};

use crate::Failure;

/// A store a reading command reads: its own files opened read-only (redb), or a private
/// copy of them (sled). Dereferences to the [`Db`]; [`ReadStore::path`] is the store's
/// own path, not the copy's.
pub(crate) struct ReadStore {
    /// Declared first: closed before the copy is removed.
    db: Db,
    /// The store's directory, as given.
    path: PathBuf,
    /// The copy `db` is opened on, for a sled store: removed on drop.
    copy: Option<PrivateCopy>,
}

/// The private copy of a sled store.
struct PrivateCopy {
    /// Removed with everything in it on drop.
    _dir: tempfile::TempDir,
    /// The store's own size on disk (its `db` file and blobs, as sled counts it), before
    /// the copy was opened.
    bytes: u64,
}

impl ReadStore {
    /// Open the store at `dir` for reading, without writing to it.
    pub(crate) fn open(dir: &Path, config: DbConfig) -> Result<ReadStore, Failure> {
        match Db::open_with(dir, config.clone().read_only()) {
            Ok(db) => Ok(ReadStore {
                db,
                path: dir.to_path_buf(),
                copy: None,
            }),
            // A sled store (the library checked the directory first: a store, of the
            // store's files only).
            Err(kube_persist::Error::ReadOnlyUnavailable { .. })
                if Engine::of_store(dir)? == Some(Engine::Sled) =>
            {
                ReadStore::copied(dir, config)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Copy the sled store at `dir` into a private temporary directory and open the copy.
    fn copied(dir: &Path, config: DbConfig) -> Result<ReadStore, Failure> {
        if !cfg!(feature = "sled") {
            return Err(format!(
                "{} is a sled store, and this kube-persist was built without sled \
                 (cargo install kube-persist-cli --features sled)",
                dir.display()
            )
            .into());
        }
        let source = std::fs::canonicalize(dir)
            .map_err(|e| format!("reading the store at {}: {e}", dir.display()))?;
        let tmp = tempfile::Builder::new()
            .prefix("kube-persist-read-")
            .tempdir()
            .map_err(|e| {
                format!(
                    "creating a temporary directory for a copy of the sled store at {} \
                     (sled has no read-only mode; TMPDIR chooses where): {e}",
                    dir.display()
                )
            })?;
        let target = tmp.path().join("store");
        let bytes = {
            let _lock = lock_shared(&source, dir)?;
            copy_dir(&source, &target).map_err(|e| {
                format!(
                    "copying the sled store at {} into {} (sled has no read-only mode; \
                     TMPDIR chooses where): {e}",
                    dir.display(),
                    tmp.path().display()
                )
            })?;
            sled_size(&source)
                .map_err(|e| format!("reading the store at {}: {e}", dir.display()))?
        };
        // Opening the copy writes to the copy only. Its log lines would be about the copy
        // (not encrypted, permissions tightened, sled recovered): not said.
        let db =
            tracing::subscriber::with_default(tracing::subscriber::NoSubscriber::default(), || {
                Db::open_with(&target, config)
            })
            .map_err(|e| {
                Failure::Error(
                    e.to_string()
                        .replace(&*target.to_string_lossy(), &dir.display().to_string()),
                )
            })?;
        Ok(ReadStore {
            db,
            path: dir.to_path_buf(),
            copy: Some(PrivateCopy { _dir: tmp, bytes }),
        })
    }

    /// The store's directory (not its copy's).
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The store's size on disk: its own, also when a copy is read.
    pub(crate) fn size_on_disk(&self) -> Result<u64, kube_persist::Error> {
        match &self.copy {
            Some(copy) => Ok(copy.bytes),
            None => self.db.size_on_disk(),
        }
    }
}

impl std::ops::Deref for ReadStore {
    type Target = Db;

    fn deref(&self) -> &Db {
        &self.db
    }
}

/// A shared lock on the sled store's `db` file, which sled locks exclusively while it has
/// the store open: refused while a process has it open, and keeps one from opening it
/// until dropped.
fn lock_shared(source: &Path, dir: &Path) -> Result<File, Failure> {
    let file = File::open(source.join("db"))
        .map_err(|e| format!("reading the sled store at {}: {e}", dir.display()))?;
    match file.try_lock_shared() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(format!(
            "the sled store at {} is locked by another process (sled has no read-only \
             mode: the reading commands copy a sled store, which must be closed \
             everywhere else)",
            dir.display()
        )
        .into()),
        Err(std::fs::TryLockError::Error(e)) => {
            Err(format!("locking the sled store at {}: {e}", dir.display()).into())
        }
    }
}

/// Copy the directory `from` to `to` (created, mode 0700): its files (with their modes)
/// and folders. The store's files only: anything else was refused by the library.
fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new().mode(0o700).create(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        let dest = to.join(entry.file_name());
        if kind.is_dir() {
            copy_dir(&entry.path(), &dest)?;
        } else if kind.is_file() {
            std::fs::copy(entry.path(), &dest)?;
        } else {
            return Err(std::io::Error::other(format!(
                "{} is neither a file nor a folder",
                entry.path().display()
            )));
        }
    }
    Ok(())
}

/// A sled store's size as sled counts it (`Db::size_on_disk`): its `db` file and its
/// blob files.
fn sled_size(dir: &Path) -> std::io::Result<u64> {
    let mut bytes = std::fs::metadata(dir.join("db"))?.len();
    match std::fs::read_dir(dir.join("blobs")) {
        Ok(blobs) => {
            for blob in blobs {
                bytes += blob?.metadata()?.len();
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    Ok(bytes)
}
