//! [`Db`]: every public method of a store directory in one place, each a short delegation
//! to the layer that does the work (`store/` opens and inspects, `sync/` pairs a stream with
//! its watcher and verifies it, `controller/` reads durable reconcile state). The type itself
//! lives in `store/`, whose handle it is.

use std::path::Path;

use futures::Stream;
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::watcher as kube_watcher;
use kube::{Client, Resource};
use serde::de::DeserializeOwned;

use crate::controller::keyspace::{self, ControllerStateInfo, ReconcileStates};
use crate::disk::{self, DbConfig};
use crate::model::{Engine, Result};
use crate::store::{Db, Dir, RawObjects, Reader, Removed, StreamInfo};
use crate::sync::StreamConfig;
use crate::sync::{self, Pair, Verification, Watcher};

impl Db {
    /// Open (or create) the store directory at `path` with default options: an existing
    /// store with the engine recorded in it, a new one with [`Engine::Redb`].
    ///
    /// The directory is the store's alone: a new one, an existing empty one, or a store. One
    /// that holds anything else (someone's files, a volume's `lost+found`) is refused with
    /// [`Error::NotAStore`](crate::Error::NotAStore), naming what it holds, before anything in
    /// it is created, opened or changed (see [`Db::open_with`]).
    ///
    /// Blocking, like [`Db::open_with`] (in async code use [`Db::open_async`]): a redb
    /// store that read-only handles hold (the `kube-persist` tool's reading commands) is
    /// waited for, up to 30 s ([`DbConfig::wait_for_readers`]), before it is
    /// [`Error::Locked`](crate::Error::Locked).
    ///
    /// ```
    /// # fn main() -> Result<(), kube_persist::Error> {
    /// use kube_persist::{Db, Engine};
    /// let dir = tempfile::tempdir().unwrap();
    /// let db = Db::open(dir.path().join("cache"))?; // created, mode 0700
    /// assert_eq!(db.engine(), Engine::Redb);
    /// assert!(db.streams()?.is_empty());
    /// # Ok(()) }
    /// ```
    pub fn open(path: impl AsRef<Path>) -> Result<Db> {
        Db::open_with(path, DbConfig::default())
    }

    /// [`Db::open`] on tokio's blocking pool, for async code (`#[tokio::main]`, a controller's
    /// startup): opening the engine (redb checks its file, sled replays its log) or waiting
    /// for read-only handles to close never blocks the runtime's worker.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), kube_persist::Error> {
    /// let dir = tempfile::tempdir().unwrap();
    /// let db = kube_persist::Db::open_async(dir.path().join("cache")).await?;
    /// assert!(db.streams()?.is_empty());
    /// # Ok(()) }
    /// ```
    pub async fn open_async(path: impl AsRef<Path>) -> Result<Db> {
        Db::open_with_async(path, DbConfig::default()).await
    }

    /// [`Db::open_with`] on tokio's blocking pool (see [`Db::open_async`]).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), kube_persist::Error> {
    /// use kube_persist::{Db, DbConfig};
    /// let dir = tempfile::tempdir().unwrap();
    /// let db = Db::open_with_async(dir.path(), DbConfig::default().compression(false)).await?;
    /// assert_eq!(db.path(), dir.path());
    /// # Ok(()) }
    /// ```
    pub async fn open_with_async(path: impl AsRef<Path>, config: DbConfig) -> Result<Db> {
        let path = path.as_ref().to_path_buf();
        match tokio::task::spawn_blocking(move || Db::open_with(path, config)).await {
            Ok(opened) => opened,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => Err(crate::Error::ReadCancelled {
                detail: format!("the open was cancelled: {e}"),
            }),
        }
    }

    /// Open (or create) the store directory at `path`.
    ///
    /// The directory is created with mode 0700: cached objects are cluster data. Only the
    /// store's own entries are ever made private: the directory, its `engine` file and the
    /// engine's files (redb's `data.redb`; sled's `conf`, `db`, `blobs/`, `snap.*`). A
    /// directory that holds anything else is not a store's, and every open refuses it (read
    /// only too) with [`Error::NotAStore`](crate::Error::NotAStore), changing nothing in it:
    ///
    /// ```
    /// use kube_persist::{Db, DbConfig, Error};
    /// let dir = tempfile::tempdir().unwrap();
    /// std::fs::write(dir.path().join("notes.txt"), "keep me").unwrap();
    /// match Db::open_with(dir.path(), DbConfig::default()) {
    ///     Err(Error::NotAStore { path, found, .. }) => {
    ///         assert_eq!((path.as_path(), found), (dir.path(), vec![dir.path().join("notes.txt")]));
    ///     }
    ///     other => panic!("expected NotAStore, got {other:?}"),
    /// }
    /// ```
    ///
    /// A `path` that is a symbolic link is the directory it points to: it is resolved (with
    /// a warning), and that real folder is checked, made private and opened ([`Db::path`]
    /// is then the target); with [`DbConfig::strict_permissions`] a link is refused
    /// ([`Error::SymlinkedStore`](crate::Error::SymlinkedStore)). A directory owned by
    /// another user than the process's is logged at warn, and refused with strict
    /// permissions ([`Error::NotOwner`](crate::Error::NotOwner)):
    ///
    /// ```
    /// use kube_persist::{Db, DbConfig, Error};
    /// let dir = tempfile::tempdir().unwrap();
    /// let (real, link) = (dir.path().join("real"), dir.path().join("link"));
    /// std::fs::create_dir(&real).unwrap();
    /// std::os::unix::fs::symlink(&real, &link).unwrap();
    /// let strict = DbConfig::default().strict_permissions(true);
    /// assert!(matches!(Db::open_with(&link, strict), Err(Error::SymlinkedStore { .. })));
    /// let db = Db::open(&link).unwrap();
    /// assert_eq!(db.path(), real.canonicalize().unwrap());
    /// ```
    ///
    /// An existing
    /// store is opened with the engine recorded in it unless `config` chose another one
    /// ([`Error::EngineMismatch`](crate::Error::EngineMismatch)); see [`DbConfig::engine`].
    ///
    /// Blocking: it opens the engine (redb checks its file; sled replays its log, seconds
    /// for a large store), so from async code call [`Db::open_with_async`]. A store open
    /// elsewhere for writing is [`Error::Locked`](crate::Error::Locked), at once. A redb store
    /// held only by read-only handles ([`DbConfig::read_only`]: the `kube-persist` tool's
    /// reading commands, in this or another process) is waited for when this open needs it
    /// to itself ([`Durability::Periodic`](crate::Durability::Periodic), the default): the
    /// open blocks until they close, up to [`DbConfig::wait_for_readers`] (default 30 s),
    /// and is `Locked` past that. A store whose last `Db`
    /// this process dropped a moment ago may still be held by its last handles (a queued
    /// write, a running scan, redb's final flush): the open waits for them to close (up to
    /// 30 s; a `Reader` kept past its `Db` holds the files too) and then opens it.
    ///
    /// ```
    /// # fn main() -> Result<(), kube_persist::Error> {
    /// use kube_persist::{Db, DbConfig};
    /// let dir = tempfile::tempdir().unwrap();
    /// let config = DbConfig::default().cache_capacity(32 << 20).compression(false);
    /// let db = Db::open_with(dir.path(), config)?;
    /// assert_eq!(db.path(), dir.path());
    /// # Ok(()) }
    /// ```
    pub fn open_with(path: impl AsRef<Path>, config: DbConfig) -> Result<Db> {
        Ok(Db {
            dir: Dir::open(path, config)?,
        })
    }

    /// Remove the store directory at `path` and everything in it, so that the next start
    /// lists from scratch. Use it after [`Error::Corrupt`](crate::Error::Corrupt): nothing is lost that the API
    /// server cannot give again.
    ///
    /// A path that does not exist is not an error (there is nothing to remove). To guard
    /// against a wrong path, it refuses a directory that does not look like a store: it must
    /// hold its engine's files ([`Error::NoStore`](crate::Error::NoStore) without them) and
    /// nothing else the store did not make ([`Error::NotAStore`](crate::Error::NotAStore), the
    /// same rule as [`Db::open_with`]'s: the `engine` file; for sled `conf`, `db`, `blobs/`,
    /// `snap.*`; for redb `data.redb`). It refuses
    /// (with [`Error::Locked`](crate::Error::Locked)) a store that is open, in this process or another one;
    /// checking that lock opens the store, which costs a recovery scan for a healthy sled
    /// store.
    ///
    /// A `path` that is a symbolic link is followed, and the answer says so: the store is
    /// its target (as for [`Db::open_with`]), which is checked the same way; the files the
    /// store made there are removed, and the link and the target directory, now empty, are
    /// kept, so that the next open through the link starts from scratch in the same place
    /// ([`Removed::Target`](crate::Removed::Target), logged at warn with both paths). A
    /// plain directory is removed whole ([`Removed::Directory`](crate::Removed::Directory)).
    ///
    /// ```
    /// # fn main() -> Result<(), kube_persist::Error> {
    /// let dir = tempfile::tempdir().unwrap();
    /// let path = dir.path().join("cache");
    /// drop(kube_persist::Db::open(&path)?);
    /// assert_eq!(kube_persist::Db::destroy(&path)?, kube_persist::Removed::Directory);
    /// assert!(!path.exists());
    /// // Not a store directory: refused.
    /// std::fs::write(dir.path().join("notes.txt"), "keep me").unwrap();
    /// assert!(kube_persist::Db::destroy(dir.path()).is_err());
    /// # Ok(()) }
    /// ```
    pub fn destroy(path: impl AsRef<Path>) -> Result<Removed> {
        Dir::destroy(path)
    }

    /// The store directory: the path given to [`Db::open_with`], or the directory it
    /// points to when it is a symbolic link.
    ///
    /// ```
    /// # fn main() -> Result<(), kube_persist::Error> {
    /// let dir = tempfile::tempdir().unwrap();
    /// let db = kube_persist::Db::open(dir.path().join("cache"))?;
    /// assert_eq!(db.path(), dir.path().join("cache"));
    /// # Ok(()) }
    /// ```
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The storage engine this store is kept in: the one recorded in its directory (for a
    /// new store, the one [`DbConfig::engine`] chose, or [`Engine::Redb`]).
    ///
    /// ```
    /// # fn main() -> Result<(), kube_persist::Error> {
    /// use kube_persist::{Db, DbConfig, Engine};
    /// let dir = tempfile::tempdir().unwrap();
    /// drop(Db::open_with(dir.path(), DbConfig::default().engine(Engine::Sled))?);
    /// // Reopened without a choice: the engine recorded in the directory.
    /// assert_eq!(Db::open(dir.path())?.engine(), Engine::Sled);
    /// # Ok(()) }
    /// ```
    pub fn engine(&self) -> Engine {
        self.dir.engine()
    }

    /// Flush everything written so far to disk.
    ///
    /// ```
    /// # fn main() -> Result<(), kube_persist::Error> {
    /// let dir = tempfile::tempdir().unwrap();
    /// let db = kube_persist::Db::open(dir.path())?;
    /// // E.g. before a planned shutdown, when the durability is periodic.
    /// db.flush()?;
    /// # Ok(()) }
    /// ```
    pub fn flush(&self) -> Result<()> {
        self.dir.flush()
    }

    /// Bytes the database occupies on disk.
    ///
    /// ```
    /// # fn main() -> Result<(), kube_persist::Error> {
    /// let dir = tempfile::tempdir().unwrap();
    /// let db = kube_persist::Db::open(dir.path())?;
    /// assert!(db.size_on_disk()? > 0); // even an empty database has its header
    /// # Ok(()) }
    /// ```
    pub fn size_on_disk(&self) -> Result<u64> {
        self.dir.size_on_disk()
    }

    /// The streams stored in this directory.
    ///
    /// ```
    /// # fn main() -> Result<(), kube_persist::Error> {
    /// let dir = tempfile::tempdir().unwrap();
    /// let db = kube_persist::Db::open(dir.path())?;
    /// assert!(db.streams()?.is_empty());
    /// # Ok(()) }
    /// ```
    pub fn streams(&self) -> Result<Vec<StreamInfo>> {
        self.dir.streams()
    }

    /// The bytes `stream` occupies in the store: for redb, its table's stored, metadata and
    /// fragmented bytes; for sled, which keeps no per-stream figure, its keys and values
    /// (counted by reading them all, before sled's own overhead).
    /// [`Db::size_on_disk`] is the whole directory's size.
    ///
    /// ```
    /// # fn main() -> Result<(), kube_persist::Error> {
    /// let dir = tempfile::tempdir().unwrap();
    /// let db = kube_persist::Db::open(dir.path())?;
    /// // Only streams the store holds can be measured.
    /// assert!(db.stream_disk_bytes("pods").is_err());
    /// # Ok(()) }
    /// ```
    pub fn stream_disk_bytes(&self, stream: &str) -> Result<u64> {
        self.dir.stream_disk_bytes(stream)
    }

    /// The stored JSON of one object of `stream`, decrypted if the store is encrypted.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let client = server.client();
    /// # let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(client);
    /// # let (reader, watcher) = db.store("pods", api, kube_persist::StreamConfig::default())?;
    /// # tokio::spawn(watcher.run());
    /// reader.wait_until_ready().await?;
    /// let json = db.raw_get("pods", Some("default"), "web-0")?.expect("stored");
    /// let pod: serde_json::Value = serde_json::from_slice(&json)?;
    /// assert_eq!(pod["spec"]["nodeName"], "node-1");
    /// assert_eq!(db.raw_get("pods", Some("default"), "web-9")?, None);
    /// assert!(db.raw_get("no-such-stream", None, "x").is_err());
    /// # Ok(()) }
    /// ```
    pub fn raw_get(
        &self,
        stream: &str,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<Vec<u8>>> {
        self.dir.raw_get(stream, namespace, name)
    }

    /// Every stored object of `stream` as (`namespace/name`, JSON), read lazily from disk.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let client = server.client();
    /// # let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(client);
    /// # let (reader, watcher) = db.store("pods", api, kube_persist::StreamConfig::default())?;
    /// # tokio::spawn(watcher.run());
    /// reader.wait_until_ready().await?;
    /// for object in db.raw_objects("pods")? {
    ///     let (key, json) = object?;
    ///     println!("{key}: {} bytes", json.len());
    /// }
    /// assert_eq!(db.raw_objects("pods")?.count(), 2);
    /// # Ok(()) }
    /// ```
    pub fn raw_objects(&self, stream: &str) -> Result<RawObjects> {
        self.dir.raw_objects(stream, None)
    }

    /// The objects of [`Db::raw_objects`] whose keys come after `after` (a key it gave), in
    /// the same order: a long read in bounded pieces, each on a store opened for it, so that
    /// nothing holds the store in between (the `kube-persist dump` tool, beside a
    /// controller that needs the store to itself; see [`DbConfig::wait_for_readers`]).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let client = server.client();
    /// # let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(client);
    /// # let (reader, watcher) = db.store("pods", api, kube_persist::StreamConfig::default())?;
    /// # tokio::spawn(watcher.run());
    /// reader.wait_until_ready().await?;
    /// let first = db.raw_objects("pods")?.next().unwrap()?.0;
    /// assert_eq!(first, "default/web-0");
    /// let rest: Vec<String> = db.raw_objects_after("pods", &first)?.map(|o| o.map(|(k, _)| k)).collect::<Result<_, _>>()?;
    /// assert_eq!(rest, ["default/web-1"]);
    /// # Ok(()) }
    /// ```
    // For the kube-persist tool, not covered by semver: hidden from the documentation.
    #[doc(hidden)]
    pub fn raw_objects_after(&self, stream: &str, after: &str) -> Result<RawObjects> {
        self.dir.raw_objects(stream, Some(after))
    }

    /// Open the persistent stream `name` for the collection of `api`, returning its
    /// [`Reader`] and the [`Watcher`] that fills it.
    ///
    /// If the stream was stored before with the same identity (kind, URL, selectors, shard,
    /// metadata-only and keys-only modes, transforms, format, encryption key), it resumes
    /// from its checkpoint; otherwise it is wiped and starts clean. Except: a shard inside
    /// the stored one of a synced stream is pruned and resumed; a stream of an older
    /// format this release reads is resumed; and an encrypted stream opened without its
    /// key or with another one is [`Error::Encryption`](crate::Error::Encryption), with
    /// nothing wiped.
    ///
    /// Opening reads the stream's metadata from disk on the calling thread. A stream is
    /// open once per process: while its `Watcher` lives, opening it again is
    /// [`Error::StreamInUse`](crate::Error::StreamInUse); right after the `Watcher` was dropped (an
    /// aborted task, a lost leader election), this call waits, blocking, until the writes
    /// that watcher left queued on the store's disk thread are done (usually milliseconds,
    /// at most 60 s, else [`Error::StillClosing`](crate::Error::StillClosing)), so the new
    /// watcher starts from the latest checkpoint. A task running
    /// the `Watcher` that was just aborted and not awaited still holds the stream until the
    /// runtime drops it: on a multi-thread runtime (or outside one) this call waits up to
    /// 2 s for that (in `block_in_place`); on a current-thread runtime nothing else runs
    /// while it blocks, so it fails at once: await the aborted `JoinHandle` first.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use futures::StreamExt;
    /// use k8s_openapi::api::core::v1::Pod;
    /// use kube::{Api, Client};
    ///
    /// let client = Client::try_default().await?;
    /// let db = kube_persist::Db::open("/var/lib/my-controller/cache")?;
    /// let (reader, watcher) = db.store("pods", Api::<Pod>::all(client), kube_persist::StreamConfig::default())?;
    /// tokio::spawn(watcher.run());
    /// reader.wait_until_ready().await?;
    /// println!("{} pods cached", reader.len());
    /// # Ok(()) }
    /// ```
    pub fn store<K>(
        &self,
        name: &str,
        api: Api<K>,
        config: impl Into<StreamConfig>,
    ) -> Result<(Reader<K>, Watcher<K>)>
    where
        K: Resource + DeserializeOwned + Send + Sync + 'static,
        K::DynamicType: Default,
    {
        sync::open_store(
            &self.dir,
            name,
            api,
            config.into(),
            &K::DynamicType::default(),
        )
    }

    /// Like [`Db::store`], for kinds with a runtime type (e.g. `DynamicObject` with its `ApiResource`).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let client = server.client();
    /// use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
    /// let gvk = GroupVersionKind::gvk("", "v1", "Pod");
    /// let resource = ApiResource::from_gvk(&gvk);
    /// let api = Api::<DynamicObject>::all_with(client, &resource);
    /// let (reader, watcher) = db.store_with("pods", api, kube_persist::StreamConfig::default(), &resource)?;
    /// tokio::spawn(watcher.run());
    /// reader.wait_until_ready().await?;
    /// let pod = reader.get_named(Some("default"), "web-0")?.unwrap();
    /// assert_eq!(pod.data["spec"]["nodeName"], "node-1");
    /// # Ok(()) }
    /// ```
    pub fn store_with<K>(
        &self,
        name: &str,
        api: Api<K>,
        config: impl Into<StreamConfig>,
        dyntype: &K::DynamicType,
    ) -> Result<(Reader<K>, Watcher<K>)>
    where
        K: Resource + DeserializeOwned + Send + Sync + 'static,
    {
        sync::open_store(&self.dir, name, api, config.into(), dyntype)
    }

    /// Open a metadata-only stream: stores `PartialObjectMeta<K>` (names, labels,
    /// annotations, owners, versions) instead of whole objects, like kube-runtime's
    /// `metadata_watcher`.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let client = server.client();
    /// use k8s_openapi::api::core::v1::Pod;
    /// let api = kube::Api::<Pod>::all(client);
    /// let (reader, watcher) = db.metadata_store("pods-meta", api, kube_persist::StreamConfig::default())?;
    /// tokio::spawn(watcher.run());
    /// reader.wait_until_ready().await?;
    /// let meta = reader.get_named(Some("default"), "web-0")?.unwrap();
    /// assert_eq!(meta.metadata.labels.as_ref().unwrap()["app"], "web");
    /// # Ok(()) }
    /// ```
    pub fn metadata_store<K>(
        &self,
        name: &str,
        api: Api<K>,
        config: impl Into<StreamConfig>,
    ) -> Result<Pair<PartialObjectMeta<K>>>
    where
        K: Resource + Send + Sync + 'static,
        K::DynamicType: Default,
    {
        sync::open_metadata_store(&self.dir, name, api, config.into())
    }

    /// Compare stream `stream` with the collection it caches on the server `client` talks
    /// to: list it (paginated, metadata only, with the stream's selectors and shard) and
    /// compare object by object by key and resourceVersion. At most `max_differences`
    /// differences are returned; all are counted.
    ///
    /// The stream must be synced (it equals the server at its checkpoint). Its watcher may
    /// run meanwhile: a store that moves on during the comparison is verified again, and a
    /// report that it is wrong ([`Verdict::Differs`](crate::Verdict::Differs), or a count
    /// unequal to its records) stands only if it stood still; after 5 attempts that it
    /// moved through, [`Error::NotVerifiable`](crate::Error::NotVerifiable). A delta
    /// relist's window and a narrowed shard's prune under way are not differences
    /// ([`Verification::explained_by_delta_relist`], [`Verification::awaiting_prune`]).
    /// (The `kube-persist verify` tool opens the store only while it reads, not to keep a
    /// controller from starting.)
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// let db = kube_persist::Db::open("/var/lib/my-controller/cache")?;
    /// let report = db.verify("pods", kube::Client::try_default().await?, 10).await?;
    /// if !report.is_ok() {
    ///     for d in &report.differences {
    ///         eprintln!("{d}");
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn verify(
        &self,
        stream: &str,
        client: Client,
        max_differences: usize,
    ) -> Result<Verification> {
        sync::verify(&self.dir, stream, client, max_differences).await
    }

    /// [`Db::verify`] of stream `stream` of the store at `path`, opened with `config` only
    /// while it reads (the stream's state, each listed page's lookups, the final scan) and
    /// closed during every LIST, so that a writer that needs the store to itself
    /// ([`DbConfig::wait_for_readers`]) is not kept from starting by a verification that
    /// waits on the API server. A writer that opens it meanwhile makes the next read
    /// [`Error::Locked`](crate::Error::Locked) (with [`DbConfig::read_only`] and a writer
    /// that makes every batch durable, the reads go on beside it). Each read opens the
    /// store on tokio's blocking pool: for redb, a read-only open costs about a millisecond;
    /// for sled, which replays its log on every open, hold a [`Db`] and use [`Db::verify`].
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use kube_persist::{Db, DbConfig};
    /// let config = DbConfig::default().read_only();
    /// let client = kube::Client::try_default().await?;
    /// let report = Db::verify_at("/var/lib/my-controller/cache", config, "pods", client, 10).await?;
    /// assert!(report.is_ok());
    /// # Ok(()) }
    /// ```
    // For the kube-persist tool, not covered by semver: hidden from the documentation.
    #[doc(hidden)]
    pub async fn verify_at(
        path: impl AsRef<Path>,
        config: DbConfig,
        stream: &str,
        client: Client,
        max_differences: usize,
    ) -> Result<Verification> {
        sync::verify_at(path.as_ref(), config, stream, client, max_differences).await
    }

    /// The durable controllers' reconcile states kept in this store: objects tracked,
    /// pending requeues, and the earliest due time. Read from disk (counts are kept with
    /// each batch, so this reads a few keys per controller).
    ///
    /// ```
    /// # fn main() -> Result<(), kube_persist::Error> {
    /// let dir = tempfile::tempdir().unwrap();
    /// let db = kube_persist::Db::open(dir.path())?;
    /// for c in db.controller_states()? {
    ///     println!("{} {:?}: {} objects, {} requeues pending, oldest due {:?}",
    ///         c.name, c.kinds, c.objects, c.pending_requeues, c.oldest_due);
    /// }
    /// assert!(db.controller_states()?.is_empty());
    /// # Ok(()) }
    /// ```
    pub fn controller_states(&self) -> Result<Vec<ControllerStateInfo>> {
        keyspace::controller_states(&self.dir)
    }

    /// Every object record of controller `name`'s reconcile state, in key order, read
    /// lazily from disk. An unknown controller is [`Error::NoSuchController`](crate::Error::NoSuchController).
    ///
    /// ```
    /// # fn main() -> Result<(), kube_persist::Error> {
    /// let dir = tempfile::tempdir().unwrap();
    /// let db = kube_persist::Db::open(dir.path())?;
    /// assert!(db.reconcile_states("pod-labeler").is_err()); // no such controller yet
    /// # Ok(()) }
    /// ```
    pub fn reconcile_states(&self, name: &str) -> Result<ReconcileStates> {
        keyspace::reconcile_states(&self.dir, name)
    }

    /// Remove stream `name` and everything stored for it (objects, indexes, checkpoint), so
    /// that a stream no longer used does not keep its space; a later [`Db::store`] of that
    /// name lists from scratch. Refused while the stream is open in this process
    /// ([`Error::StreamInUse`](crate::Error::StreamInUse)), or if there is no such stream
    /// ([`Error::NoSuchStream`](crate::Error::NoSuchStream)). Blocking: one durable
    /// commit.
    ///
    /// ```
    /// # fn main() -> Result<(), kube_persist::Error> {
    /// let dir = tempfile::tempdir().unwrap();
    /// let db = kube_persist::Db::open(dir.path())?;
    /// assert!(db.drop_stream("pods").is_err()); // no such stream
    /// # Ok(()) }
    /// ```
    pub fn drop_stream(&self, name: &str) -> Result<()> {
        self.dir.drop_keyspace(disk::STREAMS, name, "stream")
    }

    /// Remove durable controller `name`'s reconcile state (see
    /// [`Controller::durable_state`](crate::Controller::durable_state)): its next start is a
    /// cold one. Refused while the controller runs in this process
    /// ([`Error::ControllerInUse`](crate::Error::ControllerInUse)), or if there is no such
    /// state ([`Error::NoSuchController`](crate::Error::NoSuchController)). Blocking: one durable commit.
    ///
    /// ```
    /// # fn main() -> Result<(), kube_persist::Error> {
    /// let dir = tempfile::tempdir().unwrap();
    /// let db = kube_persist::Db::open(dir.path())?;
    /// assert!(db.drop_controller_state("pod-labeler").is_err()); // no such controller
    /// # Ok(()) }
    /// ```
    pub fn drop_controller_state(&self, name: &str) -> Result<()> {
        self.dir
            .drop_keyspace(disk::CONTROLLERS, name, "controller state")
    }
}

/// The persistent counterpart of kube-runtime's `watcher(api, wc)`, with one more argument,
/// the store directory: opens (or resumes) in `db` the stream of `api` with `config` (a `watcher::Config` as it is, or a
/// [`StreamConfig`]) and returns its events as kube-runtime's `watcher::Event`s
/// ([`Watcher::kube_events`]), for kube-runtime's `WatchStreamExt` helpers as they are.
/// The stream is named after what it watches (its resource and group, the namespace of
/// a namespaced `Api`, a hash of its selectors and shard: `pods@default`), so that two
/// collections never share a name; [`Db::store`] names it explicitly and returns its
/// [`Reader`] too. A restart resumes the watch from the checkpoint on disk and replays
/// the stored objects as `Init`/`InitApply`/`InitDone`, as a relist would.
///
/// Blocking like [`Db::store`] (it opens the stream's keyspace: milliseconds).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
/// # let dir = tempfile::tempdir()?;
/// # let client = server.client();
/// use futures::TryStreamExt;
/// use k8s_openapi::api::core::v1::Pod;
/// use kube::runtime::{WatchStreamExt, predicates, watcher};
/// use kube::{Api, ResourceExt};
///
/// let db = kube_persist::Db::open(dir.path())?;
/// let api: Api<Pod> = Api::default_namespaced(client);
/// // Was: watcher(api, watcher::Config::default())
/// let stream = kube_persist::watcher(&db, api, watcher::Config::default())?
///     .default_backoff()
///     .applied_objects()
///     .predicate_filter(predicates::resource_version, Default::default());
/// let mut stream = std::pin::pin!(stream);
/// let pod = stream.try_next().await?.unwrap();
/// assert!(pod.name_any().starts_with("web-"));
/// assert_eq!(db.streams()?[0].name, "pods@default");
/// # Ok(()) }
/// ```
pub fn watcher<K>(
    db: &Db,
    api: Api<K>,
    config: impl Into<StreamConfig>,
) -> Result<
    impl Stream<Item = std::result::Result<kube_watcher::Event<K>, kube_watcher::Error>> + Send,
>
where
    K: Resource + Clone + DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Default + Send + Sync,
{
    let dyntype = K::DynamicType::default();
    let (_, watcher) = sync::open_derived(&db.dir, api, config.into(), &dyntype)?;
    Ok(watcher.kube_events())
}
