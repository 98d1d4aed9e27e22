//! Reading many objects: whole-store and per-namespace iteration and index lookups,
//! read from disk in chunks and decoded ahead of the caller in parallel (`read_ahead.rs`),
//! handed out in key order, with memory bounded by a few chunks.

use std::sync::Arc;

use kube::Resource;
use serde::de::DeserializeOwned;

use super::read_ahead::{MapFn, ReadAhead};
use super::{Reader, decode_value};
use crate::disk::Entry;
use crate::disk::keys::{self, OBJECT};
use crate::model::Counters;
use crate::model::{Error, Result};

impl<K> Reader<K>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
{
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
        self.iter_range(&start, &end)
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
        self.iter_range(&start, &end)
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
        self.iter_range(&start, &end)
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
        self.iter_range(&start, &end)
    }

    fn iter_range<T: DeserializeOwned + Send + Sync + 'static>(
        &self,
        start: &[u8],
        end: &[u8],
    ) -> Iter<T> {
        let entries: Box<dyn Iterator<Item = Result<Entry>> + Send> = match self.bodies() {
            Ok(()) => self.backend.range(start, end),
            Err(e) => Box::new(std::iter::once(Err(e))),
        };
        let (path, cipher, stats) = (self.path.clone(), self.cipher.clone(), self.stats.clone());
        let decode: MapFn<Result<Arc<T>>> = Arc::new(move |(k, v)| {
            Counters::add(&stats.decodes, 1);
            decode_value::<T>(&path, &k, &v, cipher.as_deref()).map(|(t, _)| Arc::new(t))
        });
        Iter {
            ahead: ReadAhead::new(entries, decode, Err, self.path.clone(), self.read_threads),
        }
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
        if !self.status.borrow().indexes.iter().any(|n| n == index) {
            return Err(Error::Config(format!(
                "index {index:?} is not configured on this stream, or is still being built"
            )));
        }
        let prefix = keys::index_prefix(index, value);
        let end = keys::prefix_end(&prefix);
        let (reader, prefix_len) = (self.clone(), prefix.len());
        let get: MapFn<Result<Option<Arc<K>>>> = Arc::new(move |(key, _)| {
            let (ns, name) = keys::split_suffix(&key[prefix_len..]);
            reader.get_named((!ns.is_empty()).then_some(&*ns), &name)
        });
        let entries = self.backend.range(&prefix, &end);
        Ok(ByIndex {
            ahead: ReadAhead::new(entries, get, Err, self.path.clone(), self.read_threads),
        })
    }
}

/// Objects found through a secondary index; see [`Reader::by_index`].
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
/// # let dir = tempfile::tempdir()?;
/// # let db = kube_persist::Db::open(dir.path())?;
/// # let client = server.client();
/// # let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(client);
/// # let config = kube_persist::StreamConfig::default().index("node", |p: &k8s_openapi::api::core::v1::Pod| {
/// #     p.spec.as_ref().and_then(|s| s.node_name.clone()).into_iter().collect()
/// # });
/// # let (reader, watcher) = db.store("pods", api, config)?;
/// # tokio::spawn(watcher.run());
/// // The stream was opened with a "node" index (see `Reader::by_index`).
/// reader.wait_until_ready().await?;
/// let by_node: kube_persist::ByIndex<_> = reader.by_index("node", "node-1")?;
/// let pods: Vec<_> = by_node.collect::<Result<_, _>>()?;
/// let names: Vec<_> = pods.iter().map(|p| p.metadata.name.clone()).collect();
/// assert_eq!(names, [Some("web-0".to_string())]);
/// # Ok(()) }
/// ```
pub struct ByIndex<K> {
    ahead: ReadAhead<Result<Option<Arc<K>>>>,
}

impl<K> Iterator for ByIndex<K>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
{
    type Item = Result<Arc<K>>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            match self.ahead.next()? {
                Ok(Some(obj)) => return Some(Ok(obj)),
                // Deleted between the index read and the object read: skip it.
                Ok(None) => continue,
                Err(e) => return Some(Err(e)),
            }
        }
    }
}

/// Lazy iterator over stored objects; see [`Reader::iter`].
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
/// let mut pods: kube_persist::Iter<_> = reader.iter();
/// let first = pods.next().expect("two pods")?;
/// assert_eq!(first.metadata.name.as_deref(), Some("web-0"));
/// assert_eq!(pods.count(), 1); // read lazily: one more
/// # Ok(()) }
/// ```
pub struct Iter<K> {
    ahead: ReadAhead<Result<Arc<K>>>,
}

impl<K: Send + Sync + 'static> Iterator for Iter<K> {
    type Item = Result<Arc<K>>;

    fn next(&mut self) -> Option<Self::Item> {
        self.ahead.next()
    }
}
