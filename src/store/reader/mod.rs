//! Concurrent, disk-backed reads of one stream: every method of [`Reader`].
//!
//! Longer than 600 lines because it is the whole of the reader's public surface, each
//! method with its doc example (most of the file), in one place; each method is short and
//! the work of each concept is in a file of its own: the iterators in `reader/iter.rs`,
//! read-ahead in `reader/read_ahead.rs`, the blocking pool's scans in
//! `reader/nonblocking.rs`, the catch-up rules and the read-your-writes wait in
//! `store/caught_up.rs`.

use std::marker::PhantomData;
use std::path::PathBuf;
use std::sync::Arc;

use kube::Resource;
use kube::core::{Expression, Selector, SelectorExt};
use kube::runtime::reflector::ObjectRef;
use serde::de::DeserializeOwned;
use tokio::sync::watch;

mod iter;
mod nonblocking;
mod read_ahead;

pub use iter::{ByIndex, Iter};

use std::time::Duration;

use futures::stream::BoxStream;
use nonblocking::{point, scan};

use super::cache::HotCache;
use super::caught_up::{self, Freshness};
use super::{Status, SyncPhase};
use crate::disk::Backend;
use crate::disk::Cipher;
use crate::disk::keys::{self, OBJECT};
use crate::disk::record;
use crate::model::{Counters, Stats};
use crate::model::{Error, Result};

/// What a stored record says of its object without its body: what a controller's pass
/// compares with its reconcile records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoredHead {
    /// The stored `metadata.resourceVersion`.
    pub(crate) resource_version: String,
    /// The stored `metadata.uid` (empty if the object had none).
    pub(crate) uid: String,
}

/// Read access to one persistent stream, from any number of tasks while the watcher writes.
///
/// Reads go to disk (through the engine's page cache) and decode the stored JSON into `K`;
/// nothing holds the whole collection in memory. Disk or decode failures are errors,
/// never a silent `None`.
///
/// Readers see each committed batch whole: during a relist, every object is either its
/// old or its new version; the store is never emptied.
///
/// ```no_run
/// # async fn demo(reader: kube_persist::Reader<k8s_openapi::api::core::v1::Pod>) -> Result<(), kube_persist::Error> {
/// use kube::runtime::reflector::ObjectRef;
/// reader.wait_until_ready().await?;
/// if let Some(pod) = reader.get(&ObjectRef::new("web-0").within("default"))? {
///     println!("{:?}", pod.spec.as_ref().and_then(|s| s.node_name.as_ref()));
/// }
/// for pod in reader.iter_namespace("default") {
///     let pod = pod?;
///     println!("{}", pod.metadata.name.clone().unwrap_or_default());
/// }
/// # Ok(()) }
/// ```
pub struct Reader<K> {
    backend: Arc<dyn Backend>,
    path: Arc<PathBuf>,
    /// The stream's name (errors name it).
    stream: Arc<str>,
    status: watch::Receiver<Status>,
    stats: Arc<Counters>,
    cache: Arc<HotCache>,
    cipher: Option<Arc<Cipher>>,
    keys_only: bool,
    /// Chunks of an iteration decoded ahead at once on the CPU threads (0: one per core;
    /// 1, the default: none, all on the calling thread).
    read_threads: usize,
    _k: PhantomData<fn() -> K>,
}

impl<K> Clone for Reader<K> {
    fn clone(&self) -> Self {
        Reader {
            backend: self.backend.clone(),
            path: self.path.clone(),
            stream: self.stream.clone(),
            status: self.status.clone(),
            stats: self.stats.clone(),
            cache: self.cache.clone(),
            cipher: self.cipher.clone(),
            keys_only: self.keys_only,
            read_threads: self.read_threads,
            _k: PhantomData,
        }
    }
}

impl<K> std::fmt::Debug for Reader<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reader")
            .field("path", &self.path)
            .field("status", &*self.status.borrow())
            .finish()
    }
}

impl<K> Reader<K>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
{
    pub(crate) fn new(
        backend: Arc<dyn Backend>,
        path: PathBuf,
        stream: &str,
        status: watch::Receiver<Status>,
        stats: Arc<Counters>,
        cache: Arc<HotCache>,
        cipher: Option<Arc<Cipher>>,
    ) -> Self {
        Reader {
            backend,
            path: Arc::new(path),
            stream: stream.into(),
            status,
            stats,
            cache,
            cipher,
            keys_only: false,
            read_threads: 1,
            _k: PhantomData,
        }
    }

    /// This reader's stream stores no bodies ([`StreamConfig::keys_only`](crate::StreamConfig::keys_only)).
    pub(crate) fn keys_only(mut self) -> Self {
        self.keys_only = true;
        self
    }

    /// `Err(Error::KeysOnly)` on a keys-only stream, which can read no bodies.
    pub(crate) fn bodies(&self) -> Result<()> {
        if self.keys_only {
            return Err(Error::KeysOnly {
                path: self.path.to_path_buf(),
                stream: self.stream.to_string(),
            });
        }
        Ok(())
    }

    pub(super) fn status(&self) -> &watch::Receiver<Status> {
        &self.status
    }

    /// The name of the stream this reader reads (its keyspace in the store directory).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let client = kube::Client::try_from(kube::Config::new("http://127.0.0.1:1".parse()?))?;
    /// # let dir = tempfile::tempdir()?;
    /// let db = kube_persist::Db::open(dir.path())?;
    /// let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(client);
    /// let (reader, _watcher) = db.store("pods", api, kube_persist::StreamConfig::default())?;
    /// assert_eq!(reader.stream_name(), "pods");
    /// # Ok(()) }
    /// ```
    pub fn stream_name(&self) -> &str {
        &self.stream
    }

    pub(crate) fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// The resourceVersion in the stored record of an object (no body decoded). Blocking.
    pub(crate) fn stored_resource_version(
        &self,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<String>> {
        let key = keys::tagged(OBJECT, &keys::object_suffix(namespace, name));
        let Some(value) = self.backend.get(&key)? else {
            return Ok(None);
        };
        let head = record::decode_ref(&value)
            .map_err(|d| record::corrupt(&self.path, &self.stream, &key, d))?;
        Ok(Some(head.resource_version.to_string()))
    }

    /// The resourceVersion and uid in the stored record of an object (no body decoded).
    /// Blocking.
    pub(crate) fn stored_version_and_uid(
        &self,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<(String, String)>> {
        let key = keys::tagged(OBJECT, &keys::object_suffix(namespace, name));
        let Some(value) = self.backend.get(&key)? else {
            return Ok(None);
        };
        let head = record::decode_ref(&value)
            .map_err(|d| record::corrupt(&self.path, &self.stream, &key, d))?;
        Ok(Some((
            head.resource_version.to_string(),
            head.uid.to_string(),
        )))
    }

    /// The object from the hot cache, if it holds it (an object written by a recent watch
    /// event always is, within the cache's budget): no disk read, no decode. `None` means
    /// "not cached", not "absent": read it with [`Reader::get`] then. For callers on async
    /// workers that must not touch the disk (the controller runner's reconcile path).
    pub(crate) fn cached(&self, obj_ref: &ObjectRef<K>) -> Option<Arc<K>> {
        self.cached_named(obj_ref.namespace.as_deref(), &obj_ref.name)
    }

    /// [`Reader::cached`] by namespace and name: one lookup under the cache's lock, which
    /// the writer holds only to update a batch's keys (no disk read, no decode): what the
    /// async point reads answer on the calling worker.
    fn cached_named(&self, namespace: Option<&str>, name: &str) -> Option<Arc<K>> {
        if self.keys_only || !self.cache.enabled() {
            return None;
        }
        let suffix = keys::object_suffix(namespace, name);
        let hit = self.cache.peek(&keys::tagged(OBJECT, &suffix))?;
        hit.downcast::<K>().ok()
    }

    /// The stored object for `obj_ref`, if any.
    ///
    /// Blocking: a point read of the disk and a JSON decode on the calling thread, tens of
    /// µs for a Pod that misses the hot cache, under 1 µs for a hit
    /// ([BENCHMARKS.md, *Lookups, iteration and apply*](https://github.com/kube-persist/kube-persist/blob/main/BENCHMARKS.md#lookups-iteration-and-apply)). In async code use
    /// [`Reader::get_async`].
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(server.client());
    /// # let (reader, watcher) = db.store("pods", api, kube_persist::StreamConfig::default())?;
    /// # tokio::spawn(watcher.run());
    /// use kube::runtime::reflector::ObjectRef;
    /// reader.wait_until_ready().await?;
    /// let pod = reader.get(&ObjectRef::new("web-0").within("default"))?.expect("stored");
    /// assert_eq!(pod.spec.as_ref().unwrap().node_name.as_deref(), Some("node-1"));
    /// assert!(reader.get(&ObjectRef::new("web-9").within("default"))?.is_none());
    /// # Ok(()) }
    /// ```
    pub fn get(&self, obj_ref: &ObjectRef<K>) -> Result<Option<Arc<K>>> {
        self.get_named(obj_ref.namespace.as_deref(), &obj_ref.name)
    }

    /// The stored object with this namespace (`None` for cluster-scoped kinds) and name.
    ///
    /// Blocking: a point read of the disk and a JSON decode on the calling thread, tens of
    /// µs for a Pod that misses the hot cache, under 1 µs for a hit
    /// ([BENCHMARKS.md, *Lookups, iteration and apply*](https://github.com/kube-persist/kube-persist/blob/main/BENCHMARKS.md#lookups-iteration-and-apply)). In async code use
    /// [`Reader::get_named_async`].
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
    /// let pod = reader.get_named(Some("default"), "web-1")?.expect("stored");
    /// assert_eq!(pod.spec.as_ref().unwrap().node_name.as_deref(), Some("node-2"));
    /// assert!(reader.get_named(Some("kube-system"), "web-1")?.is_none());
    /// # Ok(()) }
    /// ```
    pub fn get_named(&self, namespace: Option<&str>, name: &str) -> Result<Option<Arc<K>>> {
        self.bodies()?;
        let key = keys::tagged(OBJECT, &keys::object_suffix(namespace, name));
        let generation = if self.cache.enabled() {
            match self.cache.get(&key) {
                Ok(hit) => {
                    if let Ok(obj) = hit.downcast::<K>() {
                        return Ok(Some(obj));
                    }
                    None
                }
                Err(miss) => miss.admit.then_some(miss.token),
            }
        } else {
            None
        };
        let Some(value) = self.backend.get(&key)? else {
            return Ok(None);
        };
        let (obj, json_len) = decode_value::<K>(
            &self.path,
            &self.stream,
            &key,
            &value,
            self.cipher.as_deref(),
        )?;
        Counters::add(&self.stats.decodes, 1);
        let obj = Arc::new(obj);
        if let Some(g) = generation {
            self.cache.insert(key, obj.clone(), json_len, g);
        }
        Ok(Some(obj))
    }

    /// The stored JSON of an object (decompressed and decrypted), without decoding it:
    /// for controllers that forward objects, hash them, or parse only what they need.
    ///
    /// ```no_run
    /// # fn demo(reader: kube_persist::Reader<k8s_openapi::api::core::v1::Pod>) -> Result<(), kube_persist::Error> {
    /// if let Some(json) = reader.get_raw(Some("default"), "web-0")? {
    ///     println!("{} bytes of JSON", json.len());
    /// }
    /// # Ok(()) }
    /// ```
    pub fn get_raw(&self, namespace: Option<&str>, name: &str) -> Result<Option<Vec<u8>>> {
        self.bodies()?;
        let key = keys::tagged(OBJECT, &keys::object_suffix(namespace, name));
        let Some(value) = self.backend.get(&key)? else {
            return Ok(None);
        };
        let body = open_body(
            &self.path,
            &self.stream,
            &key,
            &value,
            self.cipher.as_deref(),
        )?;
        Ok(Some(body.into_owned()))
    }

    /// The stored object decoded into another type `T`: a partial read for controllers that
    /// need a few fields (decoding fewer fields is faster and allocates less than `K`).
    /// Not cached.
    ///
    /// ```no_run
    /// # fn demo(reader: kube_persist::Reader<k8s_openapi::api::core::v1::Pod>) -> Result<(), kube_persist::Error> {
    /// #[derive(serde::Deserialize)]
    /// struct NodeOnly {
    ///     spec: Option<Spec>,
    /// }
    /// #[derive(serde::Deserialize)]
    /// #[serde(rename_all = "camelCase")]
    /// struct Spec {
    ///     node_name: Option<String>,
    /// }
    /// let pod: Option<NodeOnly> = reader.get_as(Some("default"), "web-0")?;
    /// let node = pod.and_then(|p| p.spec?.node_name);
    /// # let _ = node; Ok(()) }
    /// ```
    pub fn get_as<T: DeserializeOwned>(
        &self,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<T>> {
        self.bodies()?;
        let key = keys::tagged(OBJECT, &keys::object_suffix(namespace, name));
        match self.backend.get(&key)? {
            Some(value) => {
                Counters::add(&self.stats.decodes, 1);
                decode_value::<T>(
                    &self.path,
                    &self.stream,
                    &key,
                    &value,
                    self.cipher.as_deref(),
                )
                .map(|(t, _)| Some(t))
            }
            None => Ok(None),
        }
    }

    /// Up to `limit` stored objects after `cursor` (the last key suffix read), in key
    /// order: (key suffix, its [`StoredHead`]), read from the record heads without decoding
    /// bodies. Blocking: for the controller's startup pass on the blocking pool.
    pub(crate) fn versions_after(
        &self,
        cursor: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<(Vec<u8>, StoredHead)>> {
        let after = cursor.map(|c| keys::tagged(OBJECT, c));
        let mut out = Vec::with_capacity(limit.min(1024));
        for entry in keys::chunk(&*self.backend, OBJECT, after.as_deref(), limit) {
            let (k, v) = entry?;
            let head = record::decode_ref(&v)
                .map_err(|d| record::corrupt(&self.path, &self.stream, &k, d))?;
            let head = StoredHead {
                resource_version: head.resource_version.to_string(),
                uid: head.uid.to_string(),
            };
            out.push((k[1..].to_vec(), head));
        }
        Ok(out)
    }

    /// Number of stored objects (kept in the checkpoint record, no scan).
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
    /// assert_eq!(reader.len(), 2);
    /// # Ok(()) }
    /// ```
    pub fn len(&self) -> usize {
        usize::try_from(self.status.borrow().count).unwrap_or(usize::MAX)
    }

    /// Whether the store holds no object.
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
    /// assert!(reader.is_empty()); // nothing listed yet
    /// tokio::spawn(watcher.run());
    /// reader.wait_until_ready().await?;
    /// assert!(!reader.is_empty());
    /// # Ok(()) }
    /// ```
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The objects whose labels match `selector`, streamed from disk. Uses a label index
    /// ([`StreamConfig::label_index`](crate::StreamConfig::label_index)) for a `key=value` or
    /// `key in (..)` term when one exists; otherwise scans the store.
    ///
    /// Blocking: each `next()` reads and decodes on the calling thread (without a label
    /// index, every object, as [`Reader::iter`] does). In async code use
    /// [`Reader::select_stream`].
    ///
    /// ```no_run
    /// # fn demo(reader: kube_persist::Reader<k8s_openapi::api::core::v1::Pod>) -> Result<(), kube_persist::Error> {
    /// use kube::core::{Expression, Selector};
    /// let web: Selector = Expression::Equal("app".into(), "web".into()).into();
    /// for pod in reader.select(&web)? {
    ///     println!("{:?}", pod?.metadata.name);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn select(
        &self,
        selector: &Selector,
    ) -> Result<Box<dyn Iterator<Item = Result<Arc<K>>> + Send>> {
        let built = self.status.borrow().indexes.clone();
        let mut candidates: Option<Vec<String>> = None;
        let mut index = String::new();
        for expr in selector.clone() {
            let (key, values) = match expr {
                Expression::Equal(k, v) => (k, vec![v]),
                Expression::In(k, vs) => (k, vs.into_iter().collect()),
                _ => continue,
            };
            let name = format!("label:{key}");
            if built.contains(&name) {
                index = name;
                candidates = Some(values);
                break;
            }
        }
        let sel = selector.clone();
        let matches = move |o: &Result<Arc<K>>| match o {
            Ok(obj) => sel.matches(obj.meta().labels.as_ref().unwrap_or(&Default::default())),
            Err(_) => true,
        };
        match candidates {
            Some(values) => {
                let mut iters = Vec::new();
                for v in values {
                    iters.push(self.by_index(&index, &v)?);
                }
                Ok(Box::new(iters.into_iter().flatten().filter(matches)))
            }
            None => Ok(Box::new(self.iter().filter(matches))),
        }
    }

    /// The resourceVersion at which the store was last complete, if it ever was.
    ///
    /// Every object the server had at this resourceVersion is stored at that version or a
    /// newer one: after a delta relist ([`RelistMode`](crate::RelistMode)), until its watch
    /// has replayed past them, the objects it fetched are stored as the server had them
    /// when fetched (newer than the list), and those deleted before their fetch are gone.
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
    /// let rv = reader.checkpoint().expect("complete once");
    /// println!("the store equals the server at resourceVersion {rv}");
    /// # assert_eq!(rv, server.handle().resource_version());
    /// # Ok(()) }
    /// ```
    pub fn checkpoint(&self) -> Option<String> {
        self.status.borrow().checkpoint.clone()
    }

    /// Where the stream is in its list/watch cycle.
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
    /// use kube_persist::SyncPhase;
    /// reader.wait_until_ready().await?;
    /// assert_eq!(reader.phase(), SyncPhase::Synced);
    /// # Ok(()) }
    /// ```
    pub fn phase(&self) -> SyncPhase {
        self.status.borrow().phase
    }

    /// Whether a consistent snapshot is on disk (at once after a warm open; after the first
    /// complete list otherwise).
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
    /// if !reader.is_ready() {
    ///     reader.wait_until_ready().await?; // a cold start: the first list is running
    /// }
    /// assert!(reader.is_ready());
    /// # Ok(()) }
    /// ```
    pub fn is_ready(&self) -> bool {
        self.status.borrow().ready
    }

    /// When the watch last delivered an event or a bookmark in this process (`None`
    /// before the first). With bookmarks on (kube-apiserver sends one about every minute),
    /// a time far in the past means the watch is stuck.
    ///
    /// ```no_run
    /// # fn demo(reader: kube_persist::Reader<k8s_openapi::api::core::v1::Pod>) {
    /// let quiet = reader.last_watch_activity().and_then(|t| t.elapsed().ok());
    /// if quiet.is_some_and(|d| d.as_secs() > 300) {
    ///     eprintln!("no watch event or bookmark for 5 minutes");
    /// }
    /// # }
    /// ```
    pub fn last_watch_activity(&self) -> Option<std::time::SystemTime> {
        self.stats.last_watch_activity()
    }

    /// Whether the watch is currently connected and applying events. Connected is not
    /// caught up: right after a warm restart the watch may still be replaying what happened
    /// while the process was down, or be about to answer `410 Gone` and relist. See
    /// [`Reader::is_caught_up`] for "the store has applied what the server had".
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
    /// reader.wait_until_live().await?;
    /// assert!(reader.is_live());
    /// # Ok(()) }
    /// ```
    pub fn is_live(&self) -> bool {
        self.status.borrow().live
    }

    /// Resolves once a consistent snapshot is on disk: immediately after a warm open,
    /// after the first complete list otherwise. Fails if the watcher was dropped before.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let client = server.client();
    /// use k8s_openapi::api::core::v1::Pod;
    /// use kube::Api;
    /// use kube_persist::StreamConfig;
    /// let (reader, watcher) = db.store("pods", Api::<Pod>::all(client.clone()), StreamConfig::default())?;
    /// tokio::spawn(watcher.run());
    /// reader.wait_until_ready().await?;
    /// assert_eq!(reader.len(), 2);
    ///
    /// // Without a watcher the store never gets there: an error, not a hang.
    /// let (reader, watcher) = db.store("pods-unwatched", Api::<Pod>::all(client), StreamConfig::default())?;
    /// drop(watcher);
    /// assert!(reader.wait_until_ready().await.is_err());
    /// # Ok(()) }
    /// ```
    pub async fn wait_until_ready(&self) -> Result<()> {
        self.wait_status(|s| s.ready).await
    }

    /// Resolves once the watch is connected and applying events. It does not mean the store
    /// is up to date: after a restart the replay of missed events (or a relist) may still be
    /// running. Use [`Reader::wait_until_caught_up`] for that.
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
    /// tokio::spawn(watcher.run());
    /// reader.wait_until_live().await?;
    /// // Connected: changes on the server now reach the store as they happen.
    /// assert!(reader.is_live() && reader.is_ready());
    /// # Ok(()) }
    /// ```
    pub async fn wait_until_live(&self) -> Result<()> {
        self.wait_status(|s| s.live).await
    }

    /// Counters of the stream's watcher and writer.
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
    /// let stats = reader.stats();
    /// assert_eq!(stats.objects_written, 2);
    /// assert!(stats.list_pages >= 1);
    /// assert_eq!(stats.resumes, 0); // a new store lists; a reopened one resumes
    /// # Ok(()) }
    /// ```
    pub fn stats(&self) -> Stats {
        self.cache.stats(&self.stats)
    }

    // Many objects: the iterators are `reader/iter.rs`'s.

    /// This reader with its iterations ([`Reader::iter`] and the like, [`Reader::by_index`])
    /// decoded ahead on the process's CPU threads, `threads` chunks of 64 objects at once
    /// (the calling thread decodes too when it would wait); 0: one per core; 1 (the
    /// default): on the calling thread only, no read-ahead.
    ///
    /// Read-ahead is not the default because its gain depends on the allocator: the objects
    /// are allocated on a CPU thread and freed on the caller's, and glibc's malloc pays for
    /// every such free. On the project's 2-core machine with glibc, `iter()` over 100,000
    /// Pods was slower with read-ahead than without
    /// ([BENCHMARKS.md, *Lookups, iteration and apply*](https://github.com/kube-persist/kube-persist/blob/main/BENCHMARKS.md#lookups-iteration-and-apply), the `read_threads(0)` row;
    /// the `lookup_mimalloc` bench measures it with mimalloc). With an allocator whose
    /// cross-thread frees are cheap and more idle cores, ask for it.
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
    /// let ahead = reader.clone().read_threads(0); // one chunk per core at once
    /// assert_eq!(ahead.iter().count(), reader.iter().count());
    /// # Ok(()) }
    /// ```
    pub fn read_threads(mut self, threads: usize) -> Self {
        self.read_threads = threads;
        self
    }

    /// All stored objects, ordered by namespace then name, read lazily from disk in
    /// chunks and decoded on the calling thread (or ahead of it on the CPU threads, see
    /// [`Reader::read_threads`]), handed out in key order; memory is bounded by a few
    /// chunks of 64 objects.
    ///
    /// Blocking: each `next()` reads the disk and decodes on the calling thread: tens of
    /// thousands of Pods per second
    /// ([BENCHMARKS.md, *Lookups, iteration and apply*](https://github.com/kube-persist/kube-persist/blob/main/BENCHMARKS.md#lookups-iteration-and-apply)). In async code use
    /// [`Reader::iter_stream`].
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
    /// let mut names = Vec::new();
    /// for pod in reader.iter() {
    ///     names.push(pod?.metadata.name.clone().unwrap_or_default());
    /// }
    /// assert_eq!(names, ["web-0", "web-1"]);
    /// # Ok(()) }
    /// ```
    pub fn iter(&self) -> Iter<K> {
        let (start, end) = keys::range(OBJECT, None);
        Iter::over(self, &start, &end)
    }

    /// The stored objects of one namespace (one prefix scan), ordered by name.
    ///
    /// Blocking, like [`Reader::iter`]; in async code use [`Reader::iter_namespace_stream`].
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
    /// assert_eq!(reader.iter_namespace("default").count(), 2);
    /// assert_eq!(reader.iter_namespace("kube-system").count(), 0);
    /// # Ok(()) }
    /// ```
    pub fn iter_namespace(&self, namespace: &str) -> Iter<K> {
        let (start, end) = keys::range(OBJECT, Some(namespace));
        Iter::over(self, &start, &end)
    }

    /// All stored objects decoded into another type `T`, in key order: a partial scan for
    /// what needs a few fields (decoding fewer fields is faster and allocates less than
    /// `K`). Decoded in parallel like [`Reader::iter`].
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
    /// #[derive(serde::Deserialize)]
    /// struct NodeOnly {
    ///     spec: Option<Spec>,
    /// }
    /// #[derive(serde::Deserialize)]
    /// #[serde(rename_all = "camelCase")]
    /// struct Spec {
    ///     node_name: Option<String>,
    /// }
    /// reader.wait_until_ready().await?;
    /// let nodes: Vec<_> = reader
    ///     .iter_as::<NodeOnly>()
    ///     .map(|p| p.map(|p| p.spec.as_ref().and_then(|s| s.node_name.clone())))
    ///     .collect::<Result<_, _>>()?;
    /// assert_eq!(nodes, [Some("node-1".to_string()), Some("node-2".to_string())]);
    /// # Ok(()) }
    /// ```
    pub fn iter_as<T: DeserializeOwned + Send + Sync + 'static>(&self) -> Iter<T> {
        let (start, end) = keys::range(OBJECT, None);
        Iter::over(self, &start, &end)
    }

    /// The stored objects of one namespace decoded into another type `T`, ordered by
    /// name; see [`Reader::iter_as`].
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
    /// use kube::core::PartialObjectMeta;
    /// use k8s_openapi::api::core::v1::Pod;
    /// reader.wait_until_ready().await?;
    /// let metas = reader.iter_namespace_as::<PartialObjectMeta<Pod>>("default");
    /// assert_eq!(metas.count(), 2);
    /// # Ok(()) }
    /// ```
    pub fn iter_namespace_as<T: DeserializeOwned + Send + Sync + 'static>(
        &self,
        namespace: &str,
    ) -> Iter<T> {
        let (start, end) = keys::range(OBJECT, Some(namespace));
        Iter::over(self, &start, &end)
    }

    /// The objects found under `value` in the secondary index `index` (see
    /// [`StreamConfig::index`](crate::StreamConfig::index)), read lazily from disk without a scan,
    /// in chunks read in parallel like [`Reader::iter`].
    /// Fails if the index is not configured or still being built.
    ///
    /// Blocking: each `next()` reads and decodes on the calling thread (tens of thousands
    /// of Pods per second: [BENCHMARKS.md](https://github.com/kube-persist/kube-persist/blob/main/BENCHMARKS.md#lookups-iteration-and-apply)). In async code use
    /// [`Reader::by_index_stream`].
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let client = server.client();
    /// use k8s_openapi::api::core::v1::Pod;
    /// let config = kube_persist::StreamConfig::default().index("node", |p: &Pod| {
    ///     p.spec.as_ref().and_then(|s| s.node_name.clone()).into_iter().collect()
    /// });
    /// let (reader, watcher) = db.store("pods", kube::Api::<Pod>::all(client), config)?;
    /// tokio::spawn(watcher.run());
    /// reader.wait_until_ready().await?;
    /// let on_node_2: Vec<_> = reader.by_index("node", "node-2")?.collect::<Result<_, _>>()?;
    /// assert_eq!(on_node_2.len(), 1);
    /// assert_eq!(on_node_2[0].metadata.name.as_deref(), Some("web-1"));
    /// assert!(reader.by_index("zone", "a").is_err()); // not configured
    /// # Ok(()) }
    /// ```
    pub fn by_index(&self, index: &str, value: &str) -> Result<ByIndex<K>> {
        ByIndex::new(self, index, value)
    }

    // The async forms (`reader/nonblocking.rs`): scans on tokio's blocking pool, point reads
    // on kube-persist's CPU threads; a point read that the hot cache answers is answered at
    // once, on the calling task.

    /// [`Reader::get`] without blocking the calling task's worker: a hot-cache hit (an
    /// object written by a recent watch event, or read again) is answered at once on the
    /// calling task, with no disk read and no decode (well under 2 µs: [BENCHMARKS.md,
    /// *Lookups, iteration and apply*](https://github.com/kube-persist/kube-persist/blob/main/BENCHMARKS.md#lookups-iteration-and-apply));
    /// a miss reads and decodes on kube-persist's CPU threads (one per core, whose allocator
    /// arenas already hold the list's freed memory; during a list a miss may wait for a
    /// page's parse). The replacement for
    /// kube-runtime's `Store::get` in async code.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(server.client());
    /// # let (reader, watcher) = db.store("pods", api, kube_persist::StreamConfig::default())?;
    /// # tokio::spawn(watcher.run());
    /// use kube::runtime::reflector::ObjectRef;
    /// reader.wait_until_ready().await?;
    /// let pod = reader.get_async(&ObjectRef::new("web-0").within("default")).await?;
    /// assert_eq!(pod.unwrap().spec.as_ref().unwrap().node_name.as_deref(), Some("node-1"));
    /// # Ok(()) }
    /// ```
    pub async fn get_async(&self, obj_ref: &ObjectRef<K>) -> Result<Option<Arc<K>>>
    where
        K::DynamicType: Clone + Send + Sync,
    {
        if let Some(hit) = self.cached(obj_ref) {
            return Ok(Some(hit));
        }
        let (reader, obj_ref) = (self.clone(), obj_ref.clone());
        point(move || reader.get(&obj_ref)).await
    }

    /// [`Reader::get_named`] without blocking the calling task's worker: a hot-cache hit
    /// at once on the calling task, a miss on kube-persist's CPU threads (as
    /// [`Reader::get_async`]).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(server.client());
    /// # let (reader, watcher) = db.store("pods", api, kube_persist::StreamConfig::default())?;
    /// # tokio::spawn(watcher.run());
    /// reader.wait_until_ready().await?;
    /// assert!(reader.get_named_async(Some("default"), "web-1").await?.is_some());
    /// # Ok(()) }
    /// ```
    pub async fn get_named_async(
        &self,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<Arc<K>>>
    where
        K::DynamicType: Send + Sync,
    {
        if let Some(hit) = self.cached_named(namespace, name) {
            return Ok(Some(hit));
        }
        let (reader, namespace, name) = (
            self.clone(),
            namespace.map(str::to_string),
            name.to_string(),
        );
        point(move || reader.get_named(namespace.as_deref(), &name)).await
    }

    /// Every object, in key order, read on tokio's blocking pool: the async form of
    /// [`Reader::iter`], for reconcilers and event loops.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(server.client());
    /// # let (reader, watcher) = db.store("pods", api, kube_persist::StreamConfig::default())?;
    /// # tokio::spawn(watcher.run());
    /// use futures::TryStreamExt;
    /// reader.wait_until_ready().await?;
    /// let pods: Vec<_> = reader.iter_stream().try_collect().await?;
    /// assert_eq!(pods.len(), 2);
    /// # Ok(()) }
    /// ```
    pub fn iter_stream(&self) -> BoxStream<'static, Result<Arc<K>>>
    where
        K::DynamicType: Send + Sync,
    {
        let reader = self.clone();
        scan(move || Ok(reader.iter()))
    }

    /// The objects of one namespace, read on tokio's blocking pool: the async form of
    /// [`Reader::iter_namespace`].
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(server.client());
    /// # let (reader, watcher) = db.store("pods", api, kube_persist::StreamConfig::default())?;
    /// # tokio::spawn(watcher.run());
    /// use futures::StreamExt;
    /// reader.wait_until_ready().await?;
    /// assert_eq!(reader.iter_namespace_stream("default").count().await, 2);
    /// # Ok(()) }
    /// ```
    pub fn iter_namespace_stream(&self, namespace: &str) -> BoxStream<'static, Result<Arc<K>>>
    where
        K::DynamicType: Send + Sync,
    {
        let (reader, namespace) = (self.clone(), namespace.to_string());
        scan(move || Ok(reader.iter_namespace(&namespace)))
    }

    /// The objects matching `selector`, read on tokio's blocking pool: the async form of
    /// [`Reader::select`] (an error of the selection is the stream's first item).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(server.client());
    /// # let (reader, watcher) = db.store("pods", api, kube_persist::StreamConfig::default())?;
    /// # tokio::spawn(watcher.run());
    /// use futures::TryStreamExt;
    /// use kube::core::{Expression, Selector};
    /// reader.wait_until_ready().await?;
    /// let web: Selector = Expression::Equal("app".into(), "web".into()).into();
    /// let pods: Vec<_> = reader.select_stream(&web).try_collect().await?;
    /// assert_eq!(pods.len(), 2);
    /// # Ok(()) }
    /// ```
    pub fn select_stream(&self, selector: &Selector) -> BoxStream<'static, Result<Arc<K>>>
    where
        K::DynamicType: Send + Sync,
    {
        let (reader, selector) = (self.clone(), selector.clone());
        scan(move || reader.select(&selector))
    }

    /// The objects whose index `index` has `value`, read on tokio's blocking pool: the
    /// async form of [`Reader::by_index`] (an unknown index is the stream's first item).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(server.client());
    /// use futures::TryStreamExt;
    /// use k8s_openapi::api::core::v1::Pod;
    /// let config = kube_persist::StreamConfig::default().index("node", |p: &Pod| {
    ///     p.spec.as_ref().and_then(|s| s.node_name.clone()).into_iter().collect()
    /// });
    /// let (reader, watcher) = db.store("pods", api, config)?;
    /// tokio::spawn(watcher.run());
    /// reader.wait_until_ready().await?;
    /// let on_node_2: Vec<_> = reader.by_index_stream("node", "node-2").try_collect().await?;
    /// assert_eq!(on_node_2.len(), 1);
    /// # Ok(()) }
    /// ```
    pub fn by_index_stream(&self, index: &str, value: &str) -> BoxStream<'static, Result<Arc<K>>>
    where
        K::DynamicType: Send + Sync,
    {
        let (reader, index, value) = (self.clone(), index.to_string(), value.to_string());
        scan(move || reader.by_index(&index, &value))
    }

    // Caught up with the server, and read-your-writes waits (`store/caught_up.rs`).

    /// Whether the store has caught up with the server, not just connected; see
    /// [`Freshness::caught_up`].
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(server.client());
    /// # let (reader, watcher) = db.store("pods", api, kube_persist::StreamConfig::default())?;
    /// tokio::spawn(watcher.run());
    /// reader.wait_until_caught_up().await?;
    /// assert!(reader.is_caught_up() && reader.is_ready());
    /// # Ok(()) }
    /// ```
    pub fn is_caught_up(&self) -> bool {
        self.status.borrow().catch_up.caught_up
    }

    /// Whether the store has caught up, how that is known, and how far behind it is.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(server.client());
    /// # let (reader, watcher) = db.store("pods", api, kube_persist::StreamConfig::default())?;
    /// use kube_persist::CatchUpRule;
    /// tokio::spawn(watcher.run());
    /// reader.wait_until_caught_up().await?;
    /// let fresh = reader.freshness();
    /// // A new store lists first: the list is a consistent read.
    /// assert_eq!(fresh.rule, CatchUpRule::List);
    /// assert_eq!(fresh.behind, Some(0));
    /// # Ok(()) }
    /// ```
    pub fn freshness(&self) -> Freshness {
        self.status.borrow().catch_up.clone()
    }

    /// Resolves once the store has caught up with the server: after a warm restart, once
    /// the events missed while down are applied (or, after `410 Gone`, the relist and its
    /// sweep are done). Fails if the watcher was dropped before.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let api = || kube::Api::<k8s_openapi::api::core::v1::Pod>::all(server.client());
    /// # let (reader, watcher) = db.store("pods", api(), kube_persist::StreamConfig::default())?;
    /// # let task = tokio::spawn(watcher.run());
    /// # reader.wait_until_ready().await?;
    /// # task.abort(); let _ = task.await; drop(reader);
    /// # server.handle().delete(&kube_persist_testkit::ResourceType::pods(), Some("default"), "web-1");
    /// // A warm restart is ready at once, on the data of the last run ...
    /// let (reader, watcher) = db.store("pods", api(), kube_persist::StreamConfig::default())?;
    /// assert!(reader.is_ready());
    /// tokio::spawn(watcher.run());
    /// // ... and caught up once it has applied what it missed.
    /// reader.wait_until_caught_up().await?;
    /// assert_eq!(reader.len(), 1);
    /// # Ok(()) }
    /// ```
    pub async fn wait_until_caught_up(&self) -> Result<()> {
        self.wait_status(|s| s.catch_up.caught_up).await
    }

    /// Resolves once the store holds version `resource_version` of the object
    /// `namespace`/`name` or a newer state of it (a later version, or its deletion): what a
    /// controller needs after a write, to read it back (read your own writes). Fails with
    /// [`Error::Timeout`] after `timeout`.
    ///
    /// With comparable resourceVersions (KEP-5504) it waits until the store's checkpoint is
    /// at `resource_version` or past it, so it also resolves for an object the stream does
    /// not hold (outside its selectors or shard). Otherwise (opaque versions, which compare
    /// only for equality) it waits until the stored object has exactly that version, is
    /// deleted after the wait saw it, or a list begun after the call completes: another
    /// version could be older than the awaited one, so if the object changes again before
    /// the store applies the awaited version in a burst of its own, the wait ends with the
    /// next relist or the timeout. Knowing only the name, this wait cannot tell the
    /// deletion of an earlier object of that name (deleted, then created again) from one
    /// of the written object: [`Reader::wait_for_write`], which knows the written object's
    /// uid, resolves on a deletion only of that object.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// use std::time::Duration;
    /// use k8s_openapi::api::core::v1::Pod;
    /// use kube::api::{Api, PostParams};
    /// let pods = Api::<Pod>::namespaced(server.client(), "default");
    /// let (reader, watcher) = db.store("pods", Api::<Pod>::all(server.client()), kube_persist::StreamConfig::default())?;
    /// tokio::spawn(watcher.run());
    /// reader.wait_until_ready().await?;
    /// let mut pod = pods.get("web-0").await?;
    /// pod.metadata.labels.get_or_insert_default().insert("tier".into(), "front".into());
    /// let written = pods.replace("web-0", &PostParams::default(), &pod).await?;
    /// let rv = written.metadata.resource_version.as_deref().unwrap();
    /// reader.wait_for_resource_version(Some("default"), "web-0", rv, Duration::from_secs(10)).await?;
    /// let stored = reader.get_named(Some("default"), "web-0")?.unwrap();
    /// assert_eq!(stored.metadata.labels.as_ref().unwrap()["tier"], "front");
    /// # Ok(()) }
    /// ```
    pub async fn wait_for_resource_version(
        &self,
        namespace: Option<&str>,
        name: &str,
        resource_version: &str,
        timeout: Duration,
    ) -> Result<()> {
        caught_up::wait_for_version(self, namespace, name, resource_version, None, timeout).await
    }

    /// [`Reader::wait_for_resource_version`] for an object as a write returned it (its
    /// namespace, name and resourceVersion). With opaque resourceVersions its uid tells
    /// the written object from an earlier one of the same name: after a delete and a
    /// create, the earlier object's deletion does not end the wait, the created version
    /// (or a later end of the created object) does.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// use std::time::Duration;
    /// use k8s_openapi::api::core::v1::Pod;
    /// use kube::api::{Api, PostParams};
    /// let pods = Api::<Pod>::namespaced(server.client(), "default");
    /// let (reader, watcher) = db.store("pods", Api::<Pod>::all(server.client()), kube_persist::StreamConfig::default())?;
    /// tokio::spawn(watcher.run());
    /// let mut pod = Pod::default();
    /// pod.metadata.name = Some("web-2".into());
    /// let created = pods.create(&PostParams::default(), &pod).await?;
    /// reader.wait_for_write(&created, Duration::from_secs(10)).await?;
    /// assert!(reader.get_named(Some("default"), "web-2")?.is_some());
    /// # Ok(()) }
    /// ```
    pub async fn wait_for_write(&self, written: &K, timeout: Duration) -> Result<()> {
        let meta = written.meta();
        let (Some(name), Some(rv)) = (meta.name.as_deref(), meta.resource_version.as_deref())
        else {
            return Err(Error::InvalidArgument {
                detail: "wait_for_write needs an object with metadata.name and metadata.resourceVersion (as a write returns it)".into(),
            });
        };
        caught_up::wait_for_version(
            self,
            meta.namespace.as_deref(),
            name,
            rv,
            meta.uid.as_deref(),
            timeout,
        )
        .await
    }

    /// Waits until the status satisfies `f`; an error if the watcher was dropped first.
    pub(crate) async fn wait_status(&self, f: impl Fn(&Status) -> bool) -> Result<()> {
        let mut rx = self.status.clone();
        rx.wait_for(|s| f(s))
            .await
            .map(|_| ())
            .map_err(|_| self.dropped())
    }

    pub(crate) fn dropped(&self) -> Error {
        Error::WatcherDropped {
            path: self.path.to_path_buf(),
            stream: self.stream.to_string(),
        }
    }

    /// The resourceVersion and uid of the stored object (`None` when absent), read on
    /// kube-persist's CPU threads.
    pub(crate) async fn stored_version(
        &self,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<(String, String)>> {
        let (reader, ns, name) = (
            self.clone(),
            namespace.map(str::to_string),
            name.to_string(),
        );
        point(move || reader.stored_version_and_uid(ns.as_deref(), &name)).await
    }
}

/// A stored record's plaintext JSON body: borrowed when stored plain, else decompressed
/// (and decrypted).
fn open_body<'v>(
    path: &std::path::Path,
    stream: &str,
    key: &[u8],
    value: &'v [u8],
    cipher: Option<&Cipher>,
) -> Result<std::borrow::Cow<'v, [u8]>> {
    let corrupt = |detail: String| record::corrupt(path, stream, key, detail);
    record::decode_ref(value)
        .map_err(corrupt)?
        .open(key, cipher)
        .map_err(corrupt)
}

/// Decode a stored record's body into `T`, returning it and the JSON size. The body is
/// viewed in place, decompressed (LZ4, or zstd for format 2 records), and parsed with
/// simd-json from that (mutable) buffer; serde_json only reports what simd-json refused.
fn decode_value<T: DeserializeOwned>(
    path: &std::path::Path,
    stream: &str,
    key: &[u8],
    value: &[u8],
    cipher: Option<&Cipher>,
) -> Result<(T, usize)> {
    let mut buf = open_body(path, stream, key, value, cipher)?.into_owned();
    let len = buf.len();
    match crate::model::decode_in_place::<T>(&mut buf) {
        Ok(t) => Ok((t, len)),
        Err(simd) => {
            // simd-json rewrote the buffer in place: read the body again for the error.
            let body = open_body(path, stream, key, value, cipher)?;
            match serde_json::from_slice::<T>(&body) {
                Ok(t) => {
                    tracing::debug!(key = %keys::display(&key[1..]), error = %simd,
                        "simd-json refused a body serde_json accepts");
                    Ok((t, len))
                }
                Err(source) => Err(Error::Decode {
                    path: path.to_path_buf(),
                    key: keys::display(&key[1..]),
                    source,
                }),
            }
        }
    }
}

#[cfg(feature = "metrics")]
/// A stream's live counters and status, without its object type: what a scrape reads.
pub(crate) struct MetricsSource {
    /// The stream's name.
    pub(crate) stream: Arc<str>,
    pub(crate) path: Arc<PathBuf>,
    /// The engine of its directory, and the scans open on it.
    pub(crate) engine: crate::model::Engine,
    pub(crate) reads: Arc<crate::disk::OpenReads>,
    pub(crate) status: watch::Receiver<Status>,
    pub(crate) stats: Arc<Counters>,
    pub(crate) cache: Arc<HotCache>,
}

#[cfg(feature = "metrics")]
impl MetricsSource {
    /// The stream's counters now, with its hot cache's.
    pub(crate) fn stats(&self) -> Stats {
        self.cache.stats(&self.stats)
    }

    /// The stream's status now.
    pub(crate) fn status(&self) -> Status {
        self.status.borrow().clone()
    }
}

#[cfg(feature = "metrics")]
impl std::fmt::Debug for MetricsSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsSource")
            .field("path", &self.path)
            .finish()
    }
}

#[cfg(feature = "metrics")]
impl<K> Reader<K> {
    /// What the metrics collector reads of this stream at each scrape.
    pub(crate) fn metrics_source(&self) -> MetricsSource {
        MetricsSource {
            stream: self.stream.clone(),
            path: self.path.clone(),
            engine: self.backend.engine(),
            reads: self.backend.open_reads(),
            status: self.status.clone(),
            stats: self.stats.clone(),
            cache: self.cache.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Pod;
    use kube::api::DynamicObject;

    /// The read path parses with simd-json: it must give exactly what serde_json gives.
    #[test]
    fn simd_json_decodes_like_serde_json() {
        for i in 0..300u64 {
            let json = serde_json::to_vec(&kube_persist_testkit::make_pod(
                "ns-1",
                &format!("p-{i}"),
                i,
            ))
            .unwrap();
            let want: Pod = serde_json::from_slice(&json).unwrap();
            let got: Pod = simd_json::serde::from_slice(&mut json.clone()).unwrap();
            assert_eq!(got, want, "pod {i}");
            let want: DynamicObject = serde_json::from_slice(&json).unwrap();
            let got: DynamicObject = simd_json::serde::from_slice(&mut json.clone()).unwrap();
            assert_eq!(got, want, "pod {i} as DynamicObject");
        }
    }
}
