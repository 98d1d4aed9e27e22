//! The redb engine: one redb file per store directory, one table per stream.
//!
//! Every batch is one write transaction. With [`Durability::EveryBatch`] each commit is
//! durable (fsync); with [`Durability::Periodic`] commits are non-durable and a background
//! thread makes them durable at the interval (redb then rolls back to the last durable
//! commit after a crash: still a batch boundary, with its checkpoint). Quick repair is on,
//! so a reopen after a crash does not walk the whole file.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak, mpsc};
use std::time::{Duration, Instant};

use redb::{ReadableDatabase, ReadableTableMetadata, TableDefinition, TableHandle};

use super::held::Held;
use super::{
    Backend, Engine, Entry, Guarded, OpenReads, Storage, WriteBatch, catch_open, catch_panic,
};
use crate::disk::{DbConfig, Durability};
use crate::model::{Error, Result};

/// Entries a range scan reads per read transaction: scans never pin an old snapshot for long.
const SCAN_CHUNK: usize = 256;

type Table<'a> = TableDefinition<'a, &'static [u8], &'static [u8]>;

/// How processes share a store's database. A writer whose every commit is durable
/// ([`Durability::EveryBatch`]) opens in redb's single-writer mode: any number of read-only
/// handles, in this process or others, follow its commits (the `kube-persist` tool on a live
/// store). redb refuses non-durable commits in that mode, so a writer with
/// [`Durability::Periodic`] (the default) excludes every other handle: it waits for readers
/// to close ([`DbConfig::wait_for_readers`]). Read-only handles always open in single-writer
/// mode: beside such a writer, or with no writer at all.
fn mode(config: &DbConfig) -> redb::ConcurrencyMode {
    if config.read_only || config.durability == Durability::EveryBatch {
        redb::ConcurrencyMode::SingleWriter
    } else {
        redb::ConcurrencyMode::ExclusiveWriter
    }
}

/// A handle on the database: the writer, or a reader ([`DbConfig::read_only`]).
enum Handle {
    Write(redb::Database),
    Read(redb::ReadOnlyDatabase),
}

impl Handle {
    fn begin_read(&self) -> std::result::Result<redb::ReadTransaction, redb::TransactionError> {
        match self {
            Handle::Write(db) => db.begin_read(),
            Handle::Read(db) => db.begin_read(),
        }
    }
}

/// The database and what every keyspace needs of it.
struct Shared {
    db: Handle,
    /// The redb file.
    path: PathBuf,
    /// The store directory, which errors name.
    dir: PathBuf,
    /// Dropped with the database: tells the flusher thread to exit at once.
    _stop: Option<mpsc::Sender<()>>,
    every_batch: bool,
    /// Commits since the last durable one.
    dirty: AtomicBool,
    /// Held across a durable commit: a flush that finds nothing dirty because another one
    /// (the background flusher's) took the flag waits until that commit is durable, instead
    /// of returning before it is.
    flushing: std::sync::Mutex<()>,
    /// A write failed for lack of space. redb then answers `PreviousIo` until reopened,
    /// which is reported as the disk-full error it stands for.
    disk_full: AtomicBool,
    /// The scans open on the directory.
    reads: Arc<OpenReads>,
    /// Dropped last, after `db` has closed the file.
    _held: Held,
}

/// One redb database.
pub(super) struct RedbStorage {
    shared: Arc<Shared>,
}

impl RedbStorage {
    pub(super) fn open(file: PathBuf, config: &DbConfig) -> Result<RedbStorage> {
        let dir = file.parent().unwrap_or(&file).to_path_buf();
        let db = wait_for_readers(&file, config, || open_handle(&file, &dir, config))?;
        // A reader has nothing to flush.
        let periodic = match config.durability {
            _ if config.read_only => None,
            Durability::Periodic(every) => Some(every.max(Duration::from_millis(1))),
            Durability::EveryBatch => None,
        };
        let (stop, stopped) = mpsc::channel();
        let held = Held::new(&dir);
        let shared = Arc::new(Shared {
            db,
            path: file,
            dir,
            _stop: periodic.is_some().then_some(stop),
            every_batch: config.durability == Durability::EveryBatch,
            dirty: AtomicBool::new(false),
            flushing: std::sync::Mutex::new(()),
            disk_full: AtomicBool::new(false),
            reads: Arc::default(),
            _held: held,
        });
        if let Some(every) = periodic {
            spawn_flusher(Arc::downgrade(&shared), stopped, every)?;
        }
        tracing::debug!(path = %shared.path.display(), "redb opened");
        Ok(RedbStorage { shared })
    }
}

/// Make non-durable commits durable every `every`, until the database is dropped (which
/// drops the sender of `stopped`).
fn spawn_flusher(shared: Weak<Shared>, stopped: mpsc::Receiver<()>, every: Duration) -> Result<()> {
    let dir = shared.upgrade().map(|s| s.dir.clone()).unwrap_or_default();
    std::thread::Builder::new()
        .name("kube-persist-redb-flush".into())
        .spawn(move || {
            // Warn once per run of failures (the writer reports them too).
            let mut failing = false;
            while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(every) {
                let Some(shared) = shared.upgrade() else { return };
                match shared.flush() {
                    Ok(()) => failing = false,
                    Err(e) if !failing => {
                        failing = true;
                        tracing::warn!(path = %shared.path.display(), error = %e, "periodic flush failed");
                    }
                    Err(e) => tracing::debug!(error = %e, "periodic flush failed again"),
                }
            }
        })
        .map(drop)
        // Not `from_io`: a thread limit (EAGAIN) is not a held lock.
        .map_err(|source| Error::Io { path: dir, source })
}

impl Shared {
    fn err(&self, e: impl Into<redb::Error>) -> Error {
        let e = e.into();
        if matches!(e, redb::Error::PreviousIo) && self.disk_full.load(Ordering::Acquire) {
            return Error::DiskFull {
                path: self.dir.clone(),
            };
        }
        let e = from_redb(&self.path, e);
        if matches!(e, Error::DiskFull { .. }) {
            self.disk_full.store(true, Ordering::Release);
        }
        e
    }

    /// Run `f` in one write transaction and commit it.
    fn write(&self, f: impl FnOnce(&redb::WriteTransaction) -> Result<()>) -> Result<()> {
        let Handle::Write(db) = &self.db else {
            return Err(read_only(&self.dir));
        };
        let mut txn = db.begin_write().map_err(|e| self.err(e))?;
        txn.set_quick_repair(true);
        let durable = self.every_batch;
        let durability = if durable {
            redb::Durability::Immediate
        } else {
            redb::Durability::None
        };
        txn.set_durability(durability).map_err(|e| self.err(e))?;
        f(&txn)?;
        txn.commit().map_err(|e| self.err(e))?;
        if !durable {
            self.dirty.store(true, Ordering::Release);
        }
        Ok(())
    }

    /// A durable commit, if anything was committed since the last one.
    fn flush(&self) -> Result<()> {
        let Handle::Write(db) = &self.db else {
            return Ok(()); // a reader never commits
        };
        let _durable = self.flushing.lock().unwrap_or_else(|p| p.into_inner());
        if !self.dirty.swap(false, Ordering::AcqRel) {
            return Ok(());
        }
        let res = (|| {
            let mut txn = db.begin_write().map_err(|e| self.err(e))?;
            txn.set_quick_repair(true);
            txn.set_durability(redb::Durability::Immediate)
                .map_err(|e| self.err(e))?;
            txn.commit().map_err(|e| self.err(e))
        })();
        if res.is_err() {
            self.dirty.store(true, Ordering::Release);
        }
        res
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        if let Err(e) = self.flush() {
            tracing::warn!(path = %self.path.display(), error = %e, "final flush failed");
        }
    }
}

impl Storage for RedbStorage {
    fn keyspace_of(&self, group: &str, name: &str) -> Result<Arc<dyn Backend>> {
        Ok(Arc::new(RedbTable {
            shared: self.shared.clone(),
            name: Arc::from(format!("{group}{name}")),
        }))
    }

    fn keyspaces_of(&self, group: &str) -> Result<Vec<String>> {
        let s = &self.shared;
        let txn = s.db.begin_read().map_err(|e| s.err(e))?;
        let tables = txn.list_tables().map_err(|e| s.err(e))?;
        Ok(tables
            .filter_map(|t| t.name().strip_prefix(group).map(str::to_string))
            .collect())
    }

    fn drop_keyspace(&self, group: &str, name: &str) -> Result<bool> {
        let s = &self.shared;
        let table = format!("{group}{name}");
        let mut dropped = false;
        s.write(|txn| {
            dropped = txn.delete_table(Table::new(&table)).map_err(|e| s.err(e))?;
            Ok(())
        })?;
        // Made durable at once, whatever the store's durability.
        s.flush()?;
        Ok(dropped)
    }

    fn flush(&self) -> Result<()> {
        self.shared.flush()
    }

    fn engine(&self) -> Engine {
        Engine::Redb
    }

    fn size_on_disk(&self) -> Result<u64> {
        std::fs::metadata(&self.shared.path)
            .map(|m| m.len())
            .map_err(|e| Error::from_io(self.shared.dir.clone(), e))
    }
}

/// One redb table holding one stream.
struct RedbTable {
    shared: Arc<Shared>,
    name: Arc<str>,
}

impl RedbTable {
    fn def(&self) -> Table<'_> {
        TableDefinition::new(&self.name)
    }
}

/// Read up to `limit` entries of table `name` in `[start, end)` in one read transaction.
fn read_chunk(
    shared: &Shared,
    name: &str,
    start: &[u8],
    end: &[u8],
    limit: usize,
) -> Result<Vec<Entry>> {
    let txn = shared.db.begin_read().map_err(|e| shared.err(e))?;
    let table = match txn.open_table(Table::new(name)) {
        Ok(t) => t,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
        Err(e) => return Err(shared.err(e)),
    };
    let mut out = Vec::new();
    for entry in table.range(start..end).map_err(|e| shared.err(e))? {
        let (k, v) = entry.map_err(|e| shared.err(e))?;
        out.push((k.value().to_vec(), v.value().to_vec()));
        if out.len() == limit {
            break;
        }
    }
    Ok(out)
}

impl Backend for RedbTable {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        catch_panic(&self.shared.dir, "reading", || self.get_inner(key))
    }

    fn get_each(
        &self,
        keys: &[&[u8]],
        found: &mut dyn FnMut(usize, &[u8]) -> Result<()>,
    ) -> Result<()> {
        catch_panic(&self.shared.dir, "reading", || {
            let s = &self.shared;
            let txn = s.db.begin_read().map_err(|e| s.err(e))?;
            let table = match txn.open_table(self.def()) {
                Ok(t) => t,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(()),
                Err(e) => return Err(s.err(e)),
            };
            for (i, key) in keys.iter().enumerate() {
                if let Some(v) = table.get(*key).map_err(|e| s.err(e))? {
                    found(i, v.value())?;
                }
            }
            Ok(())
        })
    }

    fn apply(&self, batch: WriteBatch) -> Result<()> {
        catch_panic(&self.shared.dir, "writing", || self.apply_inner(batch))
    }

    fn range(&self, start: &[u8], end: &[u8]) -> Box<dyn Iterator<Item = Result<Entry>> + Send> {
        let chunks = ChunkedRange {
            shared: self.shared.clone(),
            name: self.name.clone(),
            next: Some(start.to_vec()),
            end: end.to_vec(),
            buf: VecDeque::new(),
        };
        Box::new(Guarded::new(
            chunks,
            &self.shared.dir,
            self.shared.reads.begin(),
        ))
    }

    fn engine(&self) -> Engine {
        Engine::Redb
    }

    fn open_reads(&self) -> Arc<OpenReads> {
        self.shared.reads.clone()
    }

    fn clear(&self) -> Result<()> {
        let s = &self.shared;
        catch_panic(&s.dir, "clearing a stream", || {
            s.write(|txn| txn.delete_table(self.def()).map(drop).map_err(|e| s.err(e)))
        })
    }

    fn disk_bytes(&self) -> Result<u64> {
        let s = &self.shared;
        catch_panic(&s.dir, "reading table statistics", || {
            let txn = s.db.begin_read().map_err(|e| s.err(e))?;
            let table = match txn.open_table(self.def()) {
                Ok(t) => t,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(0),
                Err(e) => return Err(s.err(e)),
            };
            let stats = table.stats().map_err(|e| s.err(e))?;
            Ok(stats.stored_bytes() + stats.metadata_bytes() + stats.fragmented_bytes())
        })
    }
}

impl RedbTable {
    fn get_inner(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let s = &self.shared;
        let txn = s.db.begin_read().map_err(|e| s.err(e))?;
        let table = match txn.open_table(self.def()) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
            Err(e) => return Err(s.err(e)),
        };
        let value = table.get(key).map_err(|e| s.err(e))?;
        Ok(value.map(|v| v.value().to_vec()))
    }

    fn apply_inner(&self, batch: WriteBatch) -> Result<()> {
        let s = &self.shared;
        s.write(|txn| {
            let mut table = txn.open_table(self.def()).map_err(|e| s.err(e))?;
            for (k, v) in &batch.ops {
                match v {
                    Some(v) => table.insert(k.as_slice(), v.as_slice()).map(drop),
                    None => table.remove(k.as_slice()).map(drop),
                }
                .map_err(|e| s.err(e))?;
            }
            Ok(())
        })
    }
}

/// A lazy range scan reading [`SCAN_CHUNK`] entries per read transaction. Like sled's
/// iterators it is not a snapshot: entries written behind the cursor are not seen.
struct ChunkedRange {
    shared: Arc<Shared>,
    name: Arc<str>,
    /// Where the next chunk starts (inclusive); `None` once the range is exhausted.
    next: Option<Vec<u8>>,
    end: Vec<u8>,
    buf: VecDeque<Entry>,
}

impl Iterator for ChunkedRange {
    type Item = Result<Entry>;

    fn next(&mut self) -> Option<Result<Entry>> {
        if self.buf.is_empty() {
            let start = self.next.take()?;
            match read_chunk(&self.shared, &self.name, &start, &self.end, SCAN_CHUNK) {
                Ok(chunk) => {
                    if chunk.len() == SCAN_CHUNK {
                        // The smallest key after the last one read.
                        let mut after = chunk[chunk.len() - 1].0.clone();
                        after.push(0);
                        self.next = Some(after);
                    }
                    self.buf = chunk.into();
                }
                Err(e) => return Some(Err(e)),
            }
        }
        self.buf.pop_front().map(Ok)
    }
}

/// The error of a write through a read-only handle.
fn read_only(dir: &Path) -> Error {
    Error::ReadOnly {
        path: dir.to_path_buf(),
        detail: "a write".into(),
    }
}

/// Open the database once: [`Error::Locked`] if another handle excludes this one.
fn open_handle(file: &Path, dir: &Path, config: &DbConfig) -> Result<Handle> {
    let cache = usize::try_from(config.cache_capacity).unwrap_or(usize::MAX);
    catch_open(dir, || {
        let mut builder = redb::Database::builder();
        builder
            .set_cache_size(cache)
            .set_concurrency_mode(mode(config));
        if config.read_only {
            builder
                .open_read_only(file)
                .map(Handle::Read)
                .map_err(|e| match e {
                    redb::DatabaseError::RepairAborted => Error::ReadOnlyUnavailable {
                        path: dir.to_path_buf(),
                        detail: "it was not closed cleanly and cannot be read before its \
                                 recovery: open it for writing once (its controller does when \
                                 it starts)"
                            .into(),
                    },
                    e => from_redb(file, e.into()),
                })
        } else {
            builder
                .create(file)
                .map(Handle::Write)
                .map_err(|e| from_redb(file, e.into()))
        }
    })
}

/// Run `open` (a writer's open in redb's exclusive mode, [`Durability::Periodic`]) again
/// while only read-only handles hold the database, for up to
/// [`DbConfig::wait_for_readers`]: a reader (the `kube-persist` tool) never keeps a writer
/// from starting, it only delays it. A database held by another writer is [`Error::Locked`]
/// at once. Blocks the calling thread while it waits.
fn wait_for_readers<T>(file: &Path, config: &DbConfig, open: impl Fn() -> Result<T>) -> Result<T> {
    let exclusive = mode(config) == redb::ConcurrencyMode::ExclusiveWriter;
    let deadline = Instant::now() + config.reader_wait;
    let mut pause = Duration::from_millis(10);
    let mut waited = false;
    loop {
        let res = open();
        if !exclusive || !matches!(res, Err(Error::Locked { .. })) {
            if waited && res.is_ok() {
                tracing::info!(path = %file.display(), "the store's readers closed; opened it");
            }
            return res;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || !only_readers(file) {
            return res;
        }
        if !waited {
            tracing::info!(path = %file.display(), within = ?config.reader_wait,
                "the store is open read-only elsewhere (the kube-persist tool?); waiting for its readers to close");
            waited = true;
        }
        std::thread::sleep(pause.min(left));
        pause = (pause * 2).min(Duration::from_millis(200));
    }
}

/// Whether the database at `file` is held by read-only handles only: a writer in redb's
/// single-writer mode, which shares the database with readers but not with another writer,
/// opens (and is closed at once).
fn only_readers(file: &Path) -> bool {
    catch_open(file.parent().unwrap_or(file), || {
        redb::Database::builder()
            .set_cache_size(1 << 20)
            .set_concurrency_mode(redb::ConcurrencyMode::SingleWriter)
            .open(file)
            .map(drop)
            .map_err(|e| from_redb(file, e.into()))
    })
    .is_ok()
}

/// Open and close the redb file at `file`: [`Error::Locked`] if it is open elsewhere.
pub(super) fn probe_lock(file: &Path) -> Result<()> {
    catch_open(file.parent().unwrap_or(file), || {
        redb::Database::builder()
            .set_cache_size(1 << 20)
            .open(file)
            .map(drop)
            .map_err(|e| from_redb(file, e.into()))
    })
}

/// Map a redb error on `file` to a user-facing error naming the store directory (as the
/// sled engine does).
fn from_redb(file: &Path, err: redb::Error) -> Error {
    let path = file.parent().unwrap_or(file).to_path_buf();
    match err {
        redb::Error::DatabaseAlreadyOpen | redb::Error::LockProtocolMismatch => {
            Error::Locked { path }
        }
        redb::Error::Io(io) => Error::from_io(path, io),
        redb::Error::Corrupted(detail) => Error::Corrupt {
            path,
            detail: format!("engine detected corruption in {}: {detail}", file.display()),
        },
        redb::Error::UpgradeRequired(v) => Error::Corrupt {
            path,
            detail: format!(
                "{} is in redb file format {v}, which this redb does not open",
                file.display()
            ),
        },
        redb::Error::PreviousIo => Error::Storage {
            path,
            detail: "an earlier write failed (disk full?); reopen the store to recover".into(),
        },
        other => Error::Storage {
            path,
            detail: other.to_string(),
        },
    }
}
