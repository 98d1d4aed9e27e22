//! The persistent watcher a store is paired with: its [`Event`]s, and the [`Watcher`] that
//! drives the driver (`machine/`) step by step and decodes what it produces.

use std::marker::PhantomData;
use std::sync::Arc;

use futures::Stream;
use kube::Resource;
use serde::de::DeserializeOwned;

use super::machine::{Driver, RawEvent};
use crate::disk::LeaseCloser;
use crate::model::Counters;
use crate::model::Result;
use crate::store::{Dir, Reader};

/// What happened to the store, like `kube::runtime::watcher::Event`, plus [`Event::Resumed`].
///
/// Events report exact changes of the store: a relist after `410 Gone` yields `Apply` only
/// for objects that changed and `Delete` for objects that disappeared, not a flood of re-adds.
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
/// use futures::StreamExt;
/// use kube_persist::Event;
/// let mut events = std::pin::pin!(watcher.stream());
/// let mut seen = Vec::new();
/// while let Some(event) = events.next().await {
///     match event? {
///         Event::Init => seen.push("init".to_string()),
///         Event::InitApply(pod) => seen.push(pod.metadata.name.clone().unwrap_or_default()),
///         Event::InitDone => break,
///         other => panic!("unexpected {other:?}"),
///     }
/// }
/// assert_eq!(seen, ["init", "web-0", "web-1"]); // a restart would yield `Resumed` instead
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Event<K> {
    /// The start signal of a store that was synced before: given once per watcher, when
    /// the store is consistent. Reopened synced, that is at once (after the prune of a
    /// narrowed shard and the build of new indexes, if any), and the watch resumes from the
    /// checkpoint with no paginated LIST (one `LIST limit=1` reads the server's
    /// resourceVersion, to know when the store has caught up); reopened in the middle of a
    /// relist or its sweep (a crash or a stop during a relist), it is when that relist
    /// completes (its changes come first, as `Apply`/`Delete`). The stored objects are the
    /// state at `resource_version`; changes since then follow. Consistent is not caught
    /// up: the events missed while the process was down (or a relist after `410 Gone`) may
    /// still come; [`Reader::wait_until_caught_up`](crate::Reader::wait_until_caught_up)
    /// waits for them.
    #[non_exhaustive]
    Resumed {
        /// The checkpoint the store is consistent at.
        resource_version: String,
    },
    /// The first list of an empty store started.
    Init,
    /// An object of the first list.
    InitApply(K),
    /// The first list is complete and on disk.
    InitDone,
    /// An object was created or changed (watch event, or a change found by a relist).
    Apply(K),
    /// An object was deleted (watch event, or absent from a relist).
    Delete(K),
    /// An object was deleted, but its last state does not decode into `K`: a relist's
    /// deletion on a [keys-only](super::StreamConfig::keys_only) stream (which stores no bodies), or a
    /// deleted object whose schema no longer fits the type. Carries its key.
    DeleteKey(DeletedKey),
}

/// The key of a deleted object whose last state does not decode (see [`Event::DeleteKey`]).
///
/// ```
/// let key = kube_persist::DeletedKey::new(Some("default"), "web-0");
/// assert_eq!(key.to_string(), "default/web-0");
/// assert_eq!((key.uid, key.resource_version), (None, None));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct DeletedKey {
    /// Its namespace (`None` for a cluster-scoped object).
    #[serde(default)]
    pub namespace: Option<String>,
    /// Its name.
    pub name: String,
    /// Its uid, when known.
    #[serde(default)]
    pub uid: Option<String>,
    /// Its last resourceVersion, when known.
    #[serde(default)]
    pub resource_version: Option<String>,
}

impl DeletedKey {
    /// The key of object `name` in `namespace` (`None`: cluster-scoped), without uid or
    /// resourceVersion (set them with [`DeletedKey::with_uid`] and
    /// [`DeletedKey::with_resource_version`]): what a test of code that handles
    /// [`Event::DeleteKey`] builds.
    ///
    /// ```
    /// let key = kube_persist::DeletedKey::new(None, "node-1")
    ///     .with_uid("u-1")
    ///     .with_resource_version("42");
    /// assert_eq!(key.to_string(), "node-1");
    /// assert_eq!(key.uid.as_deref(), Some("u-1"));
    /// assert_eq!(key.resource_version.as_deref(), Some("42"));
    /// ```
    #[must_use]
    pub fn new(namespace: Option<&str>, name: &str) -> Self {
        DeletedKey {
            namespace: namespace.map(str::to_string),
            name: name.to_string(),
            uid: None,
            resource_version: None,
        }
    }

    /// With its uid.
    #[must_use]
    pub fn with_uid(mut self, uid: &str) -> Self {
        self.uid = Some(uid.to_string());
        self
    }

    /// With its last resourceVersion.
    #[must_use]
    pub fn with_resource_version(mut self, resource_version: &str) -> Self {
        self.resource_version = Some(resource_version.to_string());
        self
    }
}

impl std::fmt::Display for DeletedKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.namespace {
            Some(ns) => write!(f, "{ns}/{}", self.name),
            None => f.write_str(&self.name),
        }
    }
}

/// Just the metadata of an object, to carry the key of a deletion that does not decode.
#[derive(serde::Deserialize)]
struct KeyOnly {
    metadata: DeletedKey,
}

/// A stream's [`Reader`] and the [`Watcher`] that fills it.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let client = kube::Client::try_from(kube::Config::new("http://127.0.0.1:1".parse()?))?;
/// use k8s_openapi::api::core::v1::Pod;
/// let dir = tempfile::tempdir()?;
/// let db = kube_persist::Db::open(dir.path())?;
/// let pair: kube_persist::Pair<Pod> = db.store("pods", kube::Api::all(client), kube_persist::StreamConfig::default())?;
/// let (reader, _watcher) = pair;
/// assert!(reader.is_empty());
/// # Ok(()) }
/// ```
pub type Pair<K> = (Reader<K>, Watcher<K>);

/// Drives one persistent stream: lists, watches, relists and writes to disk.
///
/// Poll it as a [`Stream`] of [`Event`]s with [`Watcher::stream`], or let it run without
/// decoding events with [`Watcher::run`]. Either way, every page and every burst of watch
/// events is committed to disk in one atomic batch with the checkpoint.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
/// # let dir = tempfile::tempdir()?;
/// # let db = kube_persist::Db::open(dir.path())?;
/// # let client = server.client();
/// use k8s_openapi::api::core::v1::Pod;
/// let (reader, watcher) = db.store("pods", kube::Api::<Pod>::all(client), kube_persist::StreamConfig::default())?;
/// tokio::spawn(watcher.run()); // or poll `watcher.stream()` to react to changes
/// reader.wait_until_ready().await?;
/// assert_eq!(reader.len(), 2);
/// # Ok(()) }
/// ```
pub struct Watcher<K> {
    machine: Driver,
    /// Marks the stream closing when the watcher is dropped: a reopen then waits for the
    /// jobs this watcher left queued on the disk thread (they hold the lease).
    _closer: LeaseCloser,
    path: std::path::PathBuf,
    /// The store directory (a controller built on this watcher keeps its state there).
    dir: Dir,
    /// A reader of the stream, for [`Watcher::kube_events`]' replay of a resumed store.
    pub(super) reader: Reader<K>,
    /// The stream's counters (decodes of event objects).
    stats: Arc<Counters>,
    _k: PhantomData<fn() -> K>,
}

impl<K> Watcher<K> {
    /// The watcher of a store opened at `path`, driven by `machine`.
    pub(super) fn new(
        machine: Driver,
        closer: LeaseCloser,
        dir: Dir,
        reader: Reader<K>,
        stats: Arc<Counters>,
    ) -> Self {
        Watcher {
            machine,
            _closer: closer,
            path: dir.path().to_path_buf(),
            dir,
            reader,
            stats,
            _k: PhantomData,
        }
    }
}

impl<K> Watcher<K> {
    /// Run `f` on the writer before the watcher starts (configuration of a new stream).
    pub(super) fn configure_writer(&mut self, f: impl FnOnce(&mut crate::store::Writer)) {
        self.machine.configure_writer(f);
    }

    /// The store's directory.
    pub(super) fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// The store directory's handle.
    pub(crate) fn dir(&self) -> &Dir {
        &self.dir
    }

    /// The reader the watcher replays a resumed store from (keys-only when the stream is).
    pub(super) fn set_reader(&mut self, reader: Reader<K>) {
        self.reader = reader;
    }
}

impl<K> std::fmt::Debug for Watcher<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watcher")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl<K> Watcher<K>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
{
    /// The stream of events. Errors are yielded (and counted in [`crate::Stats::errors`]);
    /// the stream goes on after each, retrying with jittered exponential backoff, except
    /// after an [`Error::ShardRefused`](crate::Error::ShardRefused) (the API server refused
    /// the shard selector), an [`Error::InvalidArgument`](crate::Error::InvalidArgument) (a
    /// selector that does not fit in a request) or an
    /// [`Error::ReadOnly`](crate::Error::ReadOnly): retrying cannot fix them, so the stream
    /// ends after yielding it.
    ///
    /// An object the store refuses (it does not decode into `K`, exceeds
    /// [`StreamConfig::max_object_bytes`](super::StreamConfig::max_object_bytes), or the transform fails) is yielded as
    /// `Err(`[`Error::ObjectRejected`](crate::Error::ObjectRejected)`)` naming its key and
    /// resourceVersion, and counted in [`crate::Stats::bad_objects`]. Its previous version is
    /// removed from the store in the same batch (a store never serves, as current, a
    /// version older than its checkpoint), without a `Delete` event: the object still
    /// exists on the server. The stream goes on. This is input a tenant can trigger (any
    /// user who can write an object the API server accepts and `K` does not decode): do not
    /// take an object's absence from the store for its deletion; the warn log line names
    /// it and what is wrong (a field's type, a position), never its content
    /// (docs/configuration.md, `validate`).
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
    /// use futures::StreamExt;
    /// use kube_persist::Event;
    /// let mut events = std::pin::pin!(watcher.stream());
    /// while let Some(event) = events.next().await {
    ///     if matches!(event?, Event::InitDone) {
    ///         break;
    ///     }
    /// }
    /// // A change on the server: one event, once it is on disk.
    /// server.handle().delete(&kube_persist_testkit::ResourceType::pods(), Some("default"), "web-0");
    /// match events.next().await.transpose()? {
    ///     Some(Event::Delete(pod)) => assert_eq!(pod.metadata.name.as_deref(), Some("web-0")),
    ///     other => panic!("expected a deletion, got {other:?}"),
    /// }
    /// assert_eq!(reader.len(), 1);
    /// # Ok(()) }
    /// ```
    pub fn stream(self) -> impl Stream<Item = Result<Event<K>>> + Send {
        use futures::StreamExt;
        self.events(false).map(|item| match item {
            Ok(Touched::Event(ev)) => Ok(ev),
            // Only asked for with `refs`.
            Ok(Touched::Changed(obj)) => Err(crate::model::Error::Internal {
                detail: format!("unexpected shared object {:?}", obj.meta().name),
            }),
            Err(e) => Err(e),
        })
    }

    /// The events; with `refs` (the controller's main kind, which needs only which object
    /// changed): an applied object as [`Touched::Changed`], shared with the hot cache when
    /// the write path kept its decode, and the first list's objects not decoded at all.
    pub(crate) fn events(mut self, refs: bool) -> impl Stream<Item = Result<Touched<K>>> + Send {
        self.machine.set_emit(true);
        futures::stream::unfold(self, move |mut w| async move {
            loop {
                if let Some(raw) = w.machine.pop_event() {
                    if let Some(item) = w.decode(raw, refs) {
                        return Some((item, w));
                    }
                    continue;
                }
                if w.machine.fatal {
                    return None;
                }
                if let Err(e) = w.machine.step().await {
                    return Some((Err(e), w));
                }
            }
        })
    }

    /// Keep the store in sync without producing events. Errors are logged and retried with
    /// backoff; only a configuration the API server refuses (an invalid shard selector)
    /// ends it, logged as an error. Spawn it, and read through the [`Reader`].
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
    /// let task = tokio::spawn(watcher.run());
    /// reader.wait_until_ready().await?;
    /// assert_eq!(reader.len(), 2);
    /// task.abort(); // stop caching (a controller would keep it running)
    /// # Ok(()) }
    /// ```
    pub async fn run(mut self) {
        self.machine.set_emit(false);
        while !self.machine.fatal {
            // Errors are logged (with the backoff delay) inside `step`.
            let _ = self.machine.step().await;
        }
    }

    /// An event's object, counted in `Stats::decodes`.
    fn decode_counted(&self, body: &[u8]) -> std::result::Result<K, serde_json::Error> {
        Counters::add(&self.stats.decodes, 1);
        crate::model::decode_copy::<K>(body)
    }

    fn decode(&self, raw: RawEvent, refs: bool) -> Option<Result<Touched<K>>> {
        let obj = |body: &[u8]| match self.decode_counted(body) {
            Ok(k) => Some(k),
            Err(e) => {
                tracing::warn!(stream = %self.reader.stream_name(), dir = %self.path.display(), error = %e, "event object does not decode, skipped");
                None
            }
        };
        if refs {
            match raw {
                RawEvent::InitApply(_) => return None,
                RawEvent::Apply(b) => {
                    let shared = b.decoded.and_then(|d| d.downcast::<K>().ok());
                    let obj = match shared {
                        Some(obj) => obj,
                        None => Arc::new(obj(&b.json)?),
                    };
                    return Some(Ok(Touched::Changed(obj)));
                }
                other => return self.decode(other, false),
            }
        }
        Some(Ok(Touched::Event(match raw {
            RawEvent::Rejected(r) => {
                return Some(Err(crate::model::Error::ObjectRejected {
                    path: self.path.clone(),
                    key: r.key,
                    resource_version: r.resource_version,
                    reason: r.reason,
                }));
            }
            RawEvent::Resumed(resource_version) => Event::Resumed { resource_version },
            RawEvent::Init => Event::Init,
            RawEvent::InitDone => Event::InitDone,
            RawEvent::InitApply(b) => Event::InitApply(obj(&b.json)?),
            RawEvent::Apply(b) => Event::Apply(obj(&b.json)?),
            RawEvent::Delete(b) => match self.decode_counted(&b) {
                Ok(k) => Event::Delete(k),
                Err(e) => match serde_json::from_slice::<KeyOnly>(&b) {
                    Ok(k) => {
                        tracing::debug!(stream = %self.reader.stream_name(), dir = %self.path.display(), object = %k.metadata, error = %e,
                            "deleted object does not decode; its key is delivered");
                        Event::DeleteKey(k.metadata)
                    }
                    Err(_) => {
                        tracing::warn!(stream = %self.reader.stream_name(), dir = %self.path.display(), error = %e,
                            "deleted object has no readable metadata, skipped");
                        return None;
                    }
                },
            },
        })))
    }
}

/// An event as [`Watcher::events`] hands it out.
pub(crate) enum Touched<K> {
    Event(Event<K>),
    /// An applied object (created or changed by the watch), with `refs`.
    Changed(Arc<K>),
}
