//! Reading many objects: the iterators of whole-store and per-namespace scans ([`Iter`])
//! and of index lookups ([`ByIndex`]), read from disk in chunks and decoded ahead of the
//! caller in parallel (`read_ahead.rs`), handed out in key order, with memory bounded by a
//! few chunks. The [`Reader`] methods that make them are in `reader/mod.rs`.

use std::sync::Arc;

use kube::Resource;
use serde::de::DeserializeOwned;

use super::read_ahead::{MapFn, ReadAhead};
use super::{Reader, decode_value};
use crate::disk::Entry;
use crate::disk::keys;
use crate::model::Counters;
use crate::model::{Error, Result};

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

impl<K> ByIndex<K>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
{
    /// The objects under `value` in `reader`'s index `index`; an error if the index is not
    /// built.
    pub(super) fn new(reader: &Reader<K>, index: &str, value: &str) -> Result<ByIndex<K>> {
        if !reader.status.borrow().indexes.iter().any(|n| n == index) {
            return Err(Error::IndexUnavailable {
                path: reader.path.to_path_buf(),
                stream: reader.stream.to_string(),
                index: index.to_string(),
            });
        }
        // An encrypted stream stores a keyed hash of each value: look that up.
        let prefix = match &reader.cipher {
            Some(c) => keys::index_prefix(index, &c.index_token(index, value)),
            None => keys::index_prefix(index, value),
        };
        let end = keys::prefix_end(&prefix);
        let (reader2, prefix_len) = (reader.clone(), prefix.len());
        let get: MapFn<Result<Option<Arc<K>>>> = Arc::new(move |(key, _)| {
            let (ns, name) = keys::split_suffix(&key[prefix_len..]);
            reader2.get_named((!ns.is_empty()).then_some(&*ns), &name)
        });
        let entries = reader.backend.range(&prefix, &end);
        Ok(ByIndex {
            ahead: ReadAhead::new(entries, get, Err, reader.path.clone(), reader.read_threads),
        })
    }
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

impl<T: DeserializeOwned + Send + Sync + 'static> Iter<T> {
    /// The objects of `reader`'s keys in `[start, end)`, decoded into `T`.
    pub(super) fn over<K>(reader: &Reader<K>, start: &[u8], end: &[u8]) -> Iter<T>
    where
        K: Resource + DeserializeOwned + Send + Sync + 'static,
    {
        let entries: Box<dyn Iterator<Item = Result<Entry>> + Send> = match reader.bodies() {
            Ok(()) => reader.backend.range(start, end),
            Err(e) => Box::new(std::iter::once(Err(e))),
        };
        let (path, stream, cipher, stats) = (
            reader.path.clone(),
            reader.stream.clone(),
            reader.cipher.clone(),
            reader.stats.clone(),
        );
        let decode: MapFn<Result<Arc<T>>> = Arc::new(move |(k, v)| {
            Counters::add(&stats.decodes, 1);
            decode_value::<T>(&path, &stream, &k, &v, cipher.as_deref()).map(|(t, _)| Arc::new(t))
        });
        Iter {
            ahead: ReadAhead::new(
                entries,
                decode,
                Err,
                reader.path.clone(),
                reader.read_threads,
            ),
        }
    }
}

impl<K: Send + Sync + 'static> Iterator for Iter<K> {
    type Item = Result<Arc<K>>;

    fn next(&mut self) -> Option<Self::Item> {
        self.ahead.next()
    }
}
