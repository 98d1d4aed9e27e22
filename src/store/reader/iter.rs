//! Reading many objects: whole-store and per-namespace iteration and index lookups,
//! read from disk in chunks and decoded in parallel, in key order, with memory bounded by
//! one chunk.

use std::collections::VecDeque;
use std::marker::PhantomData;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use kube::Resource;
use serde::de::DeserializeOwned;

use super::{Reader, decode_value};
use crate::crypto::Cipher;
use crate::error::{Error, Result};
use crate::stats::Counters;
use crate::store::engine::Entry;
use crate::store::keys::{self, OBJECT};

impl<K> Reader<K>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
{
    /// All stored objects, ordered by namespace then name, read lazily from disk
    /// in chunks, each decoded in parallel (on the calling thread and, for larger chunks,
    /// as many scoped threads as there are other cores); at most one chunk is held.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let client = server.client();
    /// # let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(client);
    /// # let (reader, watcher) = db.store("pods", api, kube_persist::Config::default())?;
    /// # tokio::spawn(watcher.run());
    /// reader.wait_until_ready().await?;
    /// let mut names = Vec::new();
    /// for pod in reader.iter() {
    ///     names.push(pod?.metadata.name.unwrap_or_default());
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
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let client = server.client();
    /// # let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(client);
    /// # let (reader, watcher) = db.store("pods", api, kube_persist::Config::default())?;
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
    /// # let (reader, watcher) = db.store("pods", api, kube_persist::Config::default())?;
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
    ///     .map(|p| p.map(|p| p.spec.and_then(|s| s.node_name)))
    ///     .collect::<Result<_, _>>()?;
    /// assert_eq!(nodes, [Some("node-1".to_string()), Some("node-2".to_string())]);
    /// # Ok(()) }
    /// ```
    pub fn iter_as<T: DeserializeOwned + Send>(&self) -> Iter<T> {
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
    /// # let (reader, watcher) = db.store("pods", api, kube_persist::Config::default())?;
    /// # tokio::spawn(watcher.run());
    /// use kube::core::PartialObjectMeta;
    /// use k8s_openapi::api::core::v1::Pod;
    /// reader.wait_until_ready().await?;
    /// let metas = reader.iter_namespace_as::<PartialObjectMeta<Pod>>("default");
    /// assert_eq!(metas.count(), 2);
    /// # Ok(()) }
    /// ```
    pub fn iter_namespace_as<T: DeserializeOwned + Send>(&self, namespace: &str) -> Iter<T> {
        let (start, end) = keys::range(OBJECT, Some(namespace));
        self.iter_range(&start, &end)
    }

    fn iter_range<T>(&self, start: &[u8], end: &[u8]) -> Iter<T> {
        let inner: Box<dyn Iterator<Item = Result<Entry>> + Send> = match self.bodies() {
            Ok(()) => self.backend.range(start, end),
            Err(e) => Box::new(std::iter::once(Err(e))),
        };
        Iter {
            inner,
            path: self.path.clone(),
            cipher: self.cipher.clone(),
            stats: self.stats.clone(),
            ahead: Ahead::default(),
            _t: PhantomData,
        }
    }

    /// The objects found under `value` in the secondary index `index` (see
    /// [`Config::index`](crate::Config::index)), read lazily from disk without a scan,
    /// in chunks read in parallel like [`Reader::iter`].
    /// Fails if the index is not configured or still being built.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let client = server.client();
    /// use k8s_openapi::api::core::v1::Pod;
    /// let config = kube_persist::Config::default().index("node", |p: &Pod| {
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
        Ok(ByIndex {
            inner: self.backend.range(&prefix, &end),
            prefix_len: prefix.len(),
            reader: self.clone(),
            ahead: Ahead::default(),
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
/// # let config = kube_persist::Config::default().index("node", |p: &k8s_openapi::api::core::v1::Pod| {
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
    inner: Box<dyn Iterator<Item = Result<Entry>> + Send>,
    prefix_len: usize,
    reader: Reader<K>,
    ahead: Ahead<Result<Option<Arc<K>>>>,
}

impl<K> Iterator for ByIndex<K>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
{
    type Item = Result<Arc<K>>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if self.ahead.ready.is_empty() {
                let reader = &self.reader;
                let prefix_len = self.prefix_len;
                self.ahead.fill(
                    &mut self.inner,
                    &|(key, _)| {
                        let suffix = &key[prefix_len..];
                        let text = String::from_utf8_lossy(suffix);
                        let (ns, name) = text.split_once('\0').unwrap_or(("", &text));
                        reader.get_named((!ns.is_empty()).then_some(ns), name)
                    },
                    Err,
                );
            }
            match self.ahead.ready.pop_front()? {
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
/// # let (reader, watcher) = db.store("pods", api, kube_persist::Config::default())?;
/// # tokio::spawn(watcher.run());
/// reader.wait_until_ready().await?;
/// let mut pods: kube_persist::Iter<_> = reader.iter();
/// let first = pods.next().expect("two pods")?;
/// assert_eq!(first.metadata.name.as_deref(), Some("web-0"));
/// assert_eq!(pods.count(), 1); // read lazily: one more
/// # Ok(()) }
/// ```
pub struct Iter<K> {
    inner: Box<dyn Iterator<Item = Result<Entry>> + Send>,
    path: Arc<PathBuf>,
    cipher: Option<Arc<Cipher>>,
    stats: Arc<Counters>,
    ahead: Ahead<Result<K>>,
    _t: PhantomData<fn() -> K>,
}

impl<K: DeserializeOwned + Send> Iterator for Iter<K> {
    type Item = Result<K>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.ahead.ready.is_empty() {
            let (path, cipher) = (&*self.path, self.cipher.as_deref());
            let n = self.ahead.fill(
                &mut self.inner,
                &|(k, v)| decode_value::<K>(path, &k, &v, cipher).map(|(t, _)| t),
                Err,
            );
            Counters::add(&self.stats.decodes, n as u64);
        }
        self.ahead.ready.pop_front()
    }
}

/// Entries read ahead of the caller and decoded together: the first chunk is small (a
/// caller that takes one object pays for a few), the next ones double up to this.
const MAX_CHUNK: usize = 256;
const FIRST_CHUNK: usize = 8;
/// Chunks smaller than this are decoded on the calling thread alone.
const PARALLEL_MIN: usize = 32;

/// The results of the chunk being handed out, in key order.
struct Ahead<T> {
    ready: VecDeque<T>,
    chunk: usize,
}

impl<T> Default for Ahead<T> {
    fn default() -> Self {
        Ahead {
            ready: VecDeque::new(),
            chunk: FIRST_CHUNK,
        }
    }
}

impl<T: Send> Ahead<T> {
    /// Read the next chunk of entries from `inner` and map them with `f` in parallel;
    /// a read error is handed out in its place, after what came before it. Returns how
    /// many entries were mapped.
    fn fill(
        &mut self,
        inner: &mut (dyn Iterator<Item = Result<Entry>> + Send),
        f: &(dyn Fn(Entry) -> T + Sync),
        failed_read: fn(Error) -> T,
    ) -> usize {
        let mut entries = Vec::with_capacity(self.chunk);
        let mut failed = None;
        while entries.len() < self.chunk {
            match inner.next() {
                Some(Ok(e)) => entries.push(e),
                Some(Err(e)) => {
                    failed = Some(e);
                    break;
                }
                None => break,
            }
        }
        self.chunk = (self.chunk * 2).min(MAX_CHUNK);
        let n = entries.len();
        self.ready.extend(par_map(entries, f));
        self.ready.extend(failed.map(failed_read));
        n
    }
}

/// How many threads decode a chunk (the caller's included).
fn decode_threads() -> usize {
    static N: OnceLock<usize> = OnceLock::new();
    *N.get_or_init(|| {
        std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(8)
    })
}

/// `items` mapped by `f`, in order: split in contiguous parts, the first mapped on this
/// thread and the others on scoped threads (decoding is CPU work; when called from an
/// async task, the caller is already blocking, and the helpers are never async workers).
/// A part whose thread cannot be started is mapped on this thread.
fn par_map<I: Send, O: Send>(mut items: Vec<I>, f: &(dyn Fn(I) -> O + Sync)) -> Vec<O> {
    let threads = decode_threads();
    if threads < 2 || items.len() < PARALLEL_MIN {
        return items.into_iter().map(f).collect();
    }
    let per = items.len().div_ceil(threads);
    let mut parts = Vec::with_capacity(threads);
    while items.len() > per {
        let rest = items.split_off(per);
        parts.push(Mutex::new(std::mem::replace(&mut items, rest)));
    }
    parts.push(Mutex::new(items));
    let take = |part: &Mutex<Vec<I>>| -> Vec<O> {
        let items = std::mem::take(&mut *part.lock().unwrap_or_else(|p| p.into_inner()));
        items.into_iter().map(f).collect()
    };
    std::thread::scope(|s| {
        let helpers: Vec<_> = parts[1..]
            .iter()
            .map(|part| {
                std::thread::Builder::new()
                    .name("kube-persist-decode".into())
                    .spawn_scoped(s, move || take(part))
                    .ok()
            })
            .collect();
        let mut out = take(&parts[0]);
        for (h, part) in helpers.into_iter().zip(&parts[1..]) {
            match h.map(|h| h.join()) {
                Some(Ok(mapped)) => out.extend(mapped),
                Some(Err(panic)) => std::panic::resume_unwind(panic),
                None => out.extend(take(part)),
            }
        }
        out
    })
}
