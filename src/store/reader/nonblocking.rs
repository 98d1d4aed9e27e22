//! The async forms of the reads: the same reads, run on tokio's blocking pool, so that a
//! reconciler or an event loop never reads the disk or decodes on an async worker.
//!
//! A point read ([`Reader::get_async`]) is one blocking task. A scan
//! ([`Reader::iter_stream`], [`Reader::select_stream`], [`Reader::by_index_stream`]) is one
//! blocking task that reads the range in order and hands chunks of [`CHUNK`] objects
//! through a channel of two chunks: the scan runs at most two chunks ahead of the
//! consumer, and stops when the stream is dropped. The streams are boxed (`Unpin`): `next()`
//! needs no pinning.

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
fn scan<T, I>(open: impl FnOnce() -> Result<I> + Send + 'static) -> BoxStream<'static, Result<T>>
where
    T: Send + 'static,
    I: Iterator<Item = Result<T>>,
{
    futures::stream::once(async move {
        let (tx, rx) = tokio::sync::mpsc::channel::<Vec<Result<T>>>(2);
        tokio::task::spawn_blocking(move || {
            let items = match open() {
                Ok(items) => items,
                Err(e) => {
                    let _ = tx.blocking_send(vec![Err(e)]);
                    return;
                }
            };
            let mut chunk = Vec::with_capacity(CHUNK);
            for item in items {
                chunk.push(item);
                if chunk.len() == CHUNK
                    && tx
                        .blocking_send(std::mem::replace(&mut chunk, Vec::with_capacity(CHUNK)))
                        .is_err()
                {
                    return; // the stream was dropped
                }
            }
            if !chunk.is_empty() {
                let _ = tx.blocking_send(chunk);
            }
        });
        futures::stream::unfold(rx, |mut rx| async move {
            rx.recv()
                .await
                .map(|chunk| (futures::stream::iter(chunk), rx))
        })
        .flatten()
    })
    .flatten()
    .boxed()
}
