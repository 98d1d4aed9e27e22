//! Options of a store directory: [`DbConfig`], with [`Durability`] and [`Compression`].

use std::time::Duration;

use crate::disk::EncryptionKey;
use crate::model::Engine;

/// How stored object bodies are compressed ([`DbConfig::compression_codec`]).
///
/// ```
/// use kube_persist::{Compression, DbConfig};
/// // Half the disk of LZ4 for Pod-sized objects on redb, at about twice the CPU per write.
/// let config = DbConfig::default().compression_codec(Compression::Zstd);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Compression {
    /// Bodies as the server sent them.
    Off,
    /// LZ4 (the default): the fastest to write and read; Pod JSON shrinks about 1.9x.
    #[default]
    Lz4,
    /// zstd level 1: Pod JSON shrinks about 2.6x, for 2.3x the compression time and 5x the
    /// decompression time of LZ4
    /// ([BENCHMARKS.md, *Lookups, iteration and apply*](https://github.com/kube-persist/kube-persist/blob/main/BENCHMARKS.md#lookups-iteration-and-apply),
    /// the body codec table). With redb's 4 KiB pages two such
    /// records of a ~5 KB Pod share a page: earlier zstd runs measured about 2.9 KB per
    /// Pod on disk, against 4.2 KB with LZ4 at 1M Pods.
    Zstd,
}

/// How durable each committed batch is.
///
/// Atomicity does not depend on this: after a crash the store is always at some committed
/// batch boundary, with its checkpoint. Durability only decides how recent that boundary is.
///
/// The default is `Periodic(500 ms)`, chosen by measurement: on a cold sync of 100,000 Pods
/// and 50,000 watch events applied from a resume (the lookup bench's `--apply-only`, three
/// alternating runs of each at commit 7d5e9bd, redb 4.6), `EveryBatch` synced as fast
/// (11.60, 12.20, 26.30 s periodic against 12.52, 9.46, 21.31 s: noise either way) but
/// applied 21% to 34% fewer events per second (12,910, 10,713, 3,827/s against 8,560,
/// 8,397, 3,027/s), above the 5% at which it would have been the default
/// ([BENCHMARKS.md, *Durability and the tool beside the operator*](https://github.com/kube-persist/kube-persist/blob/main/BENCHMARKS.md#durability-and-the-tool-beside-the-operator)).
/// Choose `EveryBatch` for a redb store that the `kube-persist` tool is to read while its
/// controller runs: redb lets read-only processes follow only durable commits.
///
/// ```
/// # fn main() -> Result<(), kube_persist::Error> {
/// use kube_persist::{Db, DbConfig, Durability};
/// let dir = tempfile::tempdir().unwrap();
/// // fsync every batch: nothing acknowledged is lost, and the tool can read the store
/// // while it runs, for a lower apply rate (above).
/// let db = Db::open_with(dir.path(), DbConfig::default().durability(Durability::EveryBatch))?;
/// # drop(db);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Durability {
    /// Flush to disk in the background at this interval (sled's `flush_every_ms`; for redb,
    /// non-durable commits made durable at this interval). A crash loses at most this
    /// window, which the watch replays from the older checkpoint.
    Periodic(Duration),
    /// fsync after every batch: nothing acknowledged is ever lost, and other processes may
    /// read a redb store while it is written ([`DbConfig::read_only`]). Costs write
    /// throughput where fsyncs are slow: 21% to 34% of the apply rate in the runs above.
    EveryBatch,
}

/// Options for [`Db::open_with`](crate::Db::open_with).
///
/// ```
/// use std::time::Duration;
/// use kube_persist::{DbConfig, Durability};
/// let cfg = DbConfig::default()
///     .cache_capacity(16 << 20)
///     .durability(Durability::Periodic(Duration::from_millis(200)));
/// assert_eq!(cfg.get_cache_capacity(), 16 << 20);
/// ```
#[derive(Debug, Clone)]
#[must_use = "a DbConfig does nothing until given to Db::open_with"]
pub struct DbConfig {
    pub(crate) cache_capacity: u64,
    pub(crate) durability: Durability,
    pub(crate) encryption: Option<EncryptionKey>,
    pub(crate) strict_permissions: bool,
    pub(crate) compression: Compression,
    /// The engine the caller chose; `None`: the store's own, or the default for a new one.
    pub(crate) engine: Option<Engine>,
    /// Open an existing store without writing to it ([`DbConfig::read_only`]).
    pub(crate) read_only: bool,
    /// How long a writer's open waits for read-only handles to close
    /// ([`DbConfig::wait_for_readers`]).
    pub(crate) reader_wait: Duration,
}

/// The default of [`DbConfig::wait_for_readers`].
const READER_WAIT: Duration = Duration::from_secs(30);

impl Default for DbConfig {
    fn default() -> Self {
        DbConfig {
            cache_capacity: 4 << 20,
            durability: Durability::Periodic(Duration::from_millis(500)),
            encryption: None,
            strict_permissions: false,
            compression: Compression::Lz4,
            engine: None,
            read_only: false,
            reader_wait: READER_WAIT,
        }
    }
}

impl DbConfig {
    /// Bytes of the engine's page cache (default 4 MiB). Larger speeds up reads, costs RSS:
    /// with glibc's allocator about twice its size once reads have filled it
    /// (BENCHMARKS.md, *Cold sync against kube-apiserver*).
    ///
    /// ```
    /// use kube_persist::DbConfig;
    /// assert_eq!(DbConfig::default().get_cache_capacity(), 4 << 20);
    /// let cfg = DbConfig::default().cache_capacity(64 << 20);
    /// assert_eq!(cfg.get_cache_capacity(), 64 << 20);
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn cache_capacity(mut self, bytes: u64) -> Self {
        self.cache_capacity = bytes;
        self
    }

    /// How durable each batch is (default: periodic flush every 500 ms).
    ///
    /// ```
    /// # fn main() -> Result<(), kube_persist::Error> {
    /// use std::time::Duration;
    /// use kube_persist::{DbConfig, Durability};
    /// // A crash loses at most the last 2 s, which the watch replays from the older checkpoint.
    /// let cfg = DbConfig::default().durability(Durability::Periodic(Duration::from_secs(2)));
    /// let dir = tempfile::tempdir().unwrap();
    /// let db = kube_persist::Db::open_with(dir.path(), cfg)?;
    /// db.flush()?; // durable now, whatever the setting
    /// # Ok(()) }
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn durability(mut self, durability: Durability) -> Self {
        self.durability = durability;
        self
    }

    /// Encrypt every stored object body with `key` (XChaCha20-Poly1305, fresh nonce per
    /// record). The key is never written to disk; streams record its fingerprint, and opening
    /// them with a missing or different key is [`Error::Encryption`](crate::Error::Encryption).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let client = kube::Client::try_from(kube::Config::new("http://127.0.0.1:1".parse()?))?;
    /// use k8s_openapi::api::core::v1::Pod;
    /// use kube_persist::{Db, DbConfig, EncryptionKey, Error, StreamConfig};
    /// let key = EncryptionKey::from_bytes([7; 32]);
    /// let dir = tempfile::tempdir()?;
    /// let db = Db::open_with(dir.path(), DbConfig::default().encryption_key(key.clone()))?;
    /// drop(db.store("pods", kube::Api::<Pod>::all(client.clone()), StreamConfig::default())?);
    /// assert_eq!(db.streams()?[0].key_fingerprint, Some(key.fingerprint()));
    /// drop(db);
    /// // Reopened without the key, the stream is refused instead of read or wiped.
    /// let db = Db::open(dir.path())?;
    /// let err = db.store("pods", kube::Api::<Pod>::all(client), StreamConfig::default()).unwrap_err();
    /// assert!(matches!(err, Error::Encryption { .. }));
    /// # Ok(()) }
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn encryption_key(mut self, key: EncryptionKey) -> Self {
        self.encryption = Some(key);
        self
    }

    /// Open an existing store for reading only: nothing is written, created or changed (no
    /// directory, no permission tightening, no engine recovery). A redb store can be read so
    /// while another process (its controller) writes it if that writer makes every batch
    /// durable ([`Durability::EveryBatch`]): redb then opens it in its multi-process mode, in
    /// which readers follow the writer's commits (it refuses non-durable commits in that
    /// mode, so a writer with the default [`Durability::Periodic`] keeps the store to itself:
    /// [`Error::Locked`](crate::Error::Locked)). Such a writer that opens while readers
    /// hold the store waits for them to close, up to [`DbConfig::wait_for_readers`]: hold a
    /// read-only handle only while reading. Opening a stream or a controller's state,
    /// and every other write, is [`Error::ReadOnly`](crate::Error::ReadOnly); a sled store
    /// (sled has no read-only mode) is
    /// [`Error::ReadOnlyUnavailable`](crate::Error::ReadOnlyUnavailable), a missing one
    /// [`Error::NoStore`](crate::Error::NoStore).
    ///
    /// ```
    /// # fn main() -> Result<(), kube_persist::Error> {
    /// use kube_persist::{Db, DbConfig, Durability, Error};
    /// let dir = tempfile::tempdir().unwrap();
    /// let writer = Db::open_with(dir.path(), DbConfig::default().durability(Durability::EveryBatch))?;
    /// // Another process would do this while the writer runs; here, the same process.
    /// let reader = Db::open_with(dir.path(), DbConfig::default().read_only())?;
    /// assert!(reader.streams()?.is_empty());
    /// assert!(reader.drop_stream("pods").is_err()); // no writes
    /// drop((reader, writer));
    /// // A writer with periodic durability keeps the store to itself.
    /// let writer = Db::open(dir.path())?;
    /// let refused = Db::open_with(dir.path(), DbConfig::default().read_only());
    /// assert!(matches!(refused, Err(Error::Locked { .. })));
    /// # drop(writer); Ok(()) }
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn read_only(mut self) -> Self {
        self.read_only = true;
        self
    }

    /// Refuse to open a store whose directory or files are accessible by group or others
    /// ([`Error::Permissions`](crate::Error::Permissions)) instead of logging a warning and tightening them.
    ///
    /// ```
    /// # fn main() -> Result<(), kube_persist::Error> {
    /// use std::os::unix::fs::PermissionsExt;
    /// use kube_persist::{Db, DbConfig, Error};
    /// let dir = tempfile::tempdir().unwrap();
    /// let path = dir.path().join("cache");
    /// std::fs::create_dir(&path).unwrap();
    /// std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    /// let strict = DbConfig::default().strict_permissions(true);
    /// assert!(matches!(Db::open_with(&path, strict), Err(Error::Permissions { .. })));
    /// // Without it, the directory is tightened to 0700 (and a warning logged).
    /// drop(Db::open(&path)?);
    /// assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o700);
    /// # Ok(()) }
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn strict_permissions(mut self, strict: bool) -> Self {
        self.strict_permissions = strict;
        self
    }

    /// Compress stored object bodies with LZ4 (default on: Pod JSON shrinks about 2x, and
    /// the engine keeps less in memory; see
    /// [BENCHMARKS.md](https://github.com/kube-persist/kube-persist/blob/main/BENCHMARKS.md#lookups-iteration-and-apply)). Each record says how its body
    /// is packed, so this can change between runs, and bodies written with zstd by format 2
    /// stores stay readable.
    ///
    /// ```
    /// let config = kube_persist::DbConfig::default().compression(false);
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn compression(mut self, on: bool) -> Self {
        self.compression = if on {
            Compression::Lz4
        } else {
            Compression::Off
        };
        self
    }

    /// Choose how bodies are compressed (default [`Compression::Lz4`]); see
    /// [`Compression`] for the trade-off. Can change between runs, like
    /// [`DbConfig::compression`].
    ///
    /// ```
    /// # fn main() -> Result<(), kube_persist::Error> {
    /// use kube_persist::{Compression, Db, DbConfig};
    /// assert_eq!(Compression::default(), Compression::Lz4);
    /// let dir = tempfile::tempdir().unwrap();
    /// // Smaller on disk than LZ4, for more CPU per write and read.
    /// let db = Db::open_with(dir.path(), DbConfig::default().compression_codec(Compression::Zstd))?;
    /// # drop(db);
    /// # Ok(()) }
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn compression_codec(mut self, codec: Compression) -> Self {
        self.compression = codec;
        self
    }

    /// Choose the storage engine. Without this call a new store directory gets
    /// [`Engine::Redb`] (see [`Engine`] for why) and an existing one is opened with the
    /// engine recorded in it. With it, a new store directory records `engine`, and an
    /// existing one written by the other engine is [`Error::EngineMismatch`](crate::Error::EngineMismatch) (never a silent
    /// wipe). [`Db::engine`](crate::Db::engine) tells which engine an opened store uses.
    ///
    /// ```
    /// # fn main() -> Result<(), kube_persist::Error> {
    /// use kube_persist::{Db, DbConfig, Engine, Error};
    /// let dir = tempfile::tempdir().unwrap();
    /// let db = Db::open_with(dir.path(), DbConfig::default().engine(Engine::Sled))?;
    /// assert_eq!(db.engine(), Engine::Sled);
    /// drop(db);
    /// // The store records its engine: asking for the other one is refused, not a wipe.
    /// let err = Db::open_with(dir.path(), DbConfig::default().engine(Engine::Redb)).unwrap_err();
    /// assert!(matches!(err, Error::EngineMismatch { stored: Engine::Sled, .. }));
    /// assert_eq!(Db::open(dir.path())?.engine(), Engine::Sled);
    /// # Ok(()) }
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn engine(mut self, engine: Engine) -> Self {
        self.engine = Some(engine);
        self
    }

    /// How long opening a redb store for writing with [`Durability::Periodic`] waits for
    /// read-only handles ([`DbConfig::read_only`], e.g. the `kube-persist` tool's reading
    /// commands, in this or another process) to close (default 30 s). Such a writer needs
    /// the store to itself, so a reader must never keep it from starting: the open retries
    /// while only readers hold the store, and is [`Error::Locked`](crate::Error::Locked)
    /// once this time has passed. A store held by another writer is `Locked` at once. A
    /// writer with [`Durability::EveryBatch`] opens beside readers and never waits; sled has
    /// no readers. [`Db::open_with`](crate::Db::open_with) blocks its thread while it waits.
    ///
    /// ```
    /// # fn main() -> Result<(), kube_persist::Error> {
    /// use std::time::Duration;
    /// use kube_persist::{Db, DbConfig};
    /// let dir = tempfile::tempdir().unwrap();
    /// // Give a `kube-persist dump` in progress up to 2 minutes to finish a chunk.
    /// let config = DbConfig::default().wait_for_readers(Duration::from_secs(120));
    /// let db = Db::open_with(dir.path(), config)?;
    /// # drop(db);
    /// # Ok(()) }
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn wait_for_readers(mut self, wait: Duration) -> Self {
        self.reader_wait = wait;
        self
    }

    /// The engine chosen with [`DbConfig::engine`], or `None` if none was: then a new store
    /// gets [`Engine::default`] (redb) and an existing one keeps the engine recorded in it.
    ///
    /// ```
    /// use kube_persist::{DbConfig, Engine};
    /// assert_eq!(DbConfig::default().get_engine(), None);
    /// assert_eq!(DbConfig::default().engine(Engine::Redb).get_engine(), Some(Engine::Redb));
    /// ```
    pub fn get_engine(&self) -> Option<Engine> {
        self.engine
    }

    /// The configured cache capacity in bytes.
    ///
    /// ```
    /// let cfg = kube_persist::DbConfig::default().cache_capacity(1 << 30);
    /// assert_eq!(cfg.get_cache_capacity(), 1 << 30);
    /// ```
    pub fn get_cache_capacity(&self) -> u64 {
        self.cache_capacity
    }
}
