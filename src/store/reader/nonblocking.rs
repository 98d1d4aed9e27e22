//! The async forms of the reads: the same reads, run on tokio's blocking pool, so that a
//! reconciler or an event loop never reads the disk or decodes on an async worker.
//!
//! A point read ([`Reader::get_async`]) is one blocking task. A scan
//! ([`Reader::iter_stream`], [`Reader::select_stream`], [`Reader::by_index_stream`]) reads
//! the range in order, one blocking task per chunk of [`CHUNK`] objects: each task takes
//! the scan's iterator, reads one chunk and hands both back, so the scan runs at most one
//! chunk ahead of the consumer and holds no blocking-pool thread between chunks. A stream
//! that is kept but not polled (or dropped) costs its thread at most the one chunk read
//! under way, not the life of the stream, so many idle scans cannot exhaust the pool and
//! starve other blocking reads (`tests/it/nonblocking.rs`). The streams are boxed (`Unpin`):
//! `next()` needs no pinning.

use std::sync::Arc;

use futures::StreamExt;
use futures::stream::BoxStream;
use kube::Resource;
use kube::core::Selector;
use kube::runtime::reflector::ObjectRef;
use serde::de::DeserializeOwned;

use super::Reader;
use crate::model::{Error, Result};

/// Objects per chunk handed from a scan's blocking task to its stream.
pub(crate) const CHUNK: usize = 256;

impl<K> Reader<K>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Send + Sync,
{
    /// [`Reader::get`] on tokio's blocking pool: never blocks the calling task's worker.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(server.client());
    /// # let (reader, watcher) = db.store("pods", api, Default::default())?;
    /// # tokio::spawn(watcher.run());
    /// use kube::runtime::reflector::ObjectRef;
    /// reader.wait_until_ready().await?;
    /// let pod = reader.get_async(&ObjectRef::new("web-0").within("default")).await?;
    /// assert_eq!(pod.unwrap().spec.as_ref().unwrap().node_name.as_deref(), Some("node-1"));
    /// # Ok(()) }
    /// ```
    pub async fn get_async(&self, obj_ref: &ObjectRef<K>) -> Result<Option<Arc<K>>>
    where
        K::DynamicType: Clone,
    {
        let (reader, obj_ref) = (self.clone(), obj_ref.clone());
        blocking(move || reader.get(&obj_ref)).await
    }

    /// [`Reader::get_named`] on tokio's blocking pool.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(server.client());
    /// # let (reader, watcher) = db.store("pods", api, Default::default())?;
    /// # tokio::spawn(watcher.run());
    /// reader.wait_until_ready().await?;
    /// assert!(reader.get_named_async(Some("default"), "web-1").await?.is_some());
    /// # Ok(()) }
    /// ```
    pub async fn get_named_async(
        &self,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<Arc<K>>> {
        let (reader, namespace, name) = (
            self.clone(),
            namespace.map(str::to_string),
            name.to_string(),
        );
        blocking(move || reader.get_named(namespace.as_deref(), &name)).await
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
    /// # let (reader, watcher) = db.store("pods", api, Default::default())?;
    /// # tokio::spawn(watcher.run());
    /// use futures::TryStreamExt;
    /// reader.wait_until_ready().await?;
    /// let pods: Vec<_> = reader.iter_stream().try_collect().await?;
    /// assert_eq!(pods.len(), 2);
    /// # Ok(()) }
    /// ```
    pub fn iter_stream(&self) -> BoxStream<'static, Result<Arc<K>>> {
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
    /// # let (reader, watcher) = db.store("pods", api, Default::default())?;
    /// # tokio::spawn(watcher.run());
    /// use futures::StreamExt;
    /// reader.wait_until_ready().await?;
    /// assert_eq!(reader.iter_namespace_stream("default").count().await, 2);
    /// # Ok(()) }
    /// ```
    pub fn iter_namespace_stream(&self, namespace: &str) -> BoxStream<'static, Result<Arc<K>>> {
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
    /// # let (reader, watcher) = db.store("pods", api, Default::default())?;
    /// # tokio::spawn(watcher.run());
    /// use futures::TryStreamExt;
    /// use kube::core::{Expression, Selector};
    /// reader.wait_until_ready().await?;
    /// let web: Selector = Expression::Equal("app".into(), "web".into()).into();
    /// let pods: Vec<_> = reader.select_stream(&web).try_collect().await?;
    /// assert_eq!(pods.len(), 2);
    /// # Ok(()) }
    /// ```
    pub fn select_stream(&self, selector: &Selector) -> BoxStream<'static, Result<Arc<K>>> {
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
    pub fn by_index_stream(&self, index: &str, value: &str) -> BoxStream<'static, Result<Arc<K>>> {
        let (reader, index, value) = (self.clone(), index.to_string(), value.to_string());
        scan(move || reader.by_index(&index, &value))
    }
}

/// Runs a blocking read on tokio's blocking pool.
async fn blocking<T: Send + 'static>(
    read: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    match tokio::task::spawn_blocking(read).await {
        Ok(result) => result,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => Err(Error::Config(format!("a read was cancelled: {e}"))),
    }
}

/// A scan on tokio's blocking pool, started at the stream's first poll (so that the stream
/// may be made outside a runtime), handed over in chunks of [`CHUNK`].
///
/// Each chunk is one blocking task that takes the iterator, reads up to [`CHUNK`] items and
/// hands the iterator back with them: the thread is returned between chunks. The next
/// chunk is read while the consumer takes this one (one chunk ahead), so a stream that is
/// kept but not polled holds a blocking-pool thread only until that one read ends, never
/// while it waits for its consumer.
fn scan<T, I>(open: impl FnOnce() -> Result<I> + Send + 'static) -> BoxStream<'static, Result<T>>
where
    T: Send + 'static,
    I: Iterator<Item = Result<T>> + Send + 'static,
{
    type Read<T, I> = tokio::task::JoinHandle<(Option<I>, Vec<Result<T>>)>;
    /// Up to [`CHUNK`] items, and the iterator if it may have more.
    fn read_chunk<T, I: Iterator<Item = Result<T>>>(mut items: I) -> (Option<I>, Vec<Result<T>>) {
        let chunk: Vec<Result<T>> = items.by_ref().take(CHUNK).collect();
        let more = chunk.len() == CHUNK;
        (more.then_some(items), chunk)
    }
    fn next_read<T, I>(items: Option<I>) -> Option<Read<T, I>>
    where
        T: Send + 'static,
        I: Iterator<Item = Result<T>> + Send + 'static,
    {
        items.map(|items| tokio::task::spawn_blocking(move || read_chunk(items)))
    }
    futures::stream::once(async move {
        let first: Read<T, I> = tokio::task::spawn_blocking(move || match open() {
            Ok(items) => read_chunk(items),
            Err(e) => (None, vec![Err(e)]),
        });
        futures::stream::unfold(Some(first), |read| async move {
            let (rest, chunk) = match read?.await {
                Ok(read) => read,
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                Err(e) => (
                    None,
                    vec![Err(Error::Config(format!("a read was cancelled: {e}")))],
                ),
            };
            // Read the next chunk while this one is consumed.
            Some((futures::stream::iter(chunk), next_read(rest)))
        })
        .flatten()
    })
    .flatten()
    .boxed()
}
