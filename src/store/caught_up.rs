//! Fresh, not just ready: whether the store has caught up with the server, and waits for a
//! resourceVersion (read your own writes).
//!
//! Three states of a store, from weakest to strongest:
//! - **ready** ([`Reader::is_ready`]): a consistent snapshot is on disk. At once after a warm
//!   open, even if the server has moved on since the process stopped.
//! - **live** ([`Reader::is_live`]): the watch is connected and applying events. The store
//!   may still be replaying what happened while it was down, or waiting for a relist.
//! - **caught up** ([`Reader::is_caught_up`]): the store has applied everything the server
//!   had when the watch (re)connected. See [`CatchUpRule`] for how that is known.

use std::time::Duration;

use kube::Resource;
use serde::de::DeserializeOwned;

use super::Status;
use super::reader::Reader;
use crate::model::resource_version;
use crate::model::{Error, Result};

/// How the store knows (or will know) that it has caught up with the server.
///
/// ```
/// use kube_persist::CatchUpRule;
/// let rule = CatchUpRule::ComparableResourceVersions;
/// assert_eq!(rule.to_string(), "checkpoint at or past the server's resourceVersion (KEP-5504)");
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum CatchUpRule {
    /// Not known yet: the store has not connected its watch (or finished its list) in this
    /// process.
    #[default]
    Pending,
    /// The server's current resourceVersion, read with a consistent `LIST limit=1` just
    /// before the watch (re)connected, compared with the checkpoint through
    /// [`resource_version::compare`]: caught up once the checkpoint is at it or past it. Exact.
    ComparableResourceVersions,
    /// The server's resourceVersions are not comparable (an older server, or an aggregated
    /// API with its own versions), or its current one could not be read: caught up at the
    /// first bookmark the watch delivers after it connected. Weaker: a server (or its watch
    /// cache) may send a bookmark before it has delivered everything it had.
    FirstBookmark,
    /// A list that began in this process completed (and its sweep): a list is a consistent
    /// read, so the store holds everything the server had when it started.
    List,
    /// The server sends this watch no bookmarks (kube-apiserver with its watch cache off
    /// for the resource: `--watch-cache-sizes=<resource>#0`), and no event moved the
    /// checkpoint to the server's resourceVersion (the collection did not change): a watch
    /// opened while catching up ran to its server-side deadline (`timeoutSeconds`), ended
    /// without an error, delivered no bookmark, and read nothing in its last 2 s (half its
    /// timeout, if shorter). A watch delivers the changes after its resourceVersion in
    /// order, those the server already had first, so it had delivered them all. Not used
    /// while bookmarks arrive: they say how far the server is.
    ///
    /// ```
    /// use kube_persist::CatchUpRule;
    /// let rule = CatchUpRule::QuietWatchDeadline;
    /// assert_eq!(rule.to_string(), "a watch ran to its deadline quiet, without bookmarks");
    /// ```
    QuietWatchDeadline,
}

impl std::fmt::Display for CatchUpRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CatchUpRule::Pending => "not known yet",
            CatchUpRule::ComparableResourceVersions => {
                "checkpoint at or past the server's resourceVersion (KEP-5504)"
            }
            CatchUpRule::FirstBookmark => {
                "first bookmark after connecting (resourceVersions not comparable)"
            }
            CatchUpRule::List => "a consistent list completed in this process",
            CatchUpRule::QuietWatchDeadline => {
                "a watch ran to its deadline quiet, without bookmarks"
            }
        })
    }
}

/// Whether the store has caught up with the server; see [`Reader::freshness`].
///
/// ```
/// let fresh = kube_persist::Freshness::default();
/// assert!(!fresh.caught_up); // nothing is known before the watcher ran
/// assert_eq!(fresh.rule, kube_persist::CatchUpRule::Pending);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Freshness {
    /// The store has applied everything the server had when the watch last (re)connected
    /// after a failure, a relist or the start. Lost on a watch failure and on a relist;
    /// kept across the routine reconnect after a watch's server-side timeout.
    pub caught_up: bool,
    /// How `caught_up` was (or will be) established.
    pub rule: CatchUpRule,
    /// The server's resourceVersion the store catches up with (the target), when one was
    /// read.
    pub server_resource_version: Option<String>,
    /// How many revisions the checkpoint is behind `server_resource_version` (0 once
    /// caught up); `None` when the two are not comparable or no target was read.
    pub behind: Option<u64>,
}

impl<K> Reader<K>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
{
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
        self.status().borrow().catch_up.caught_up
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
        self.status().borrow().catch_up.clone()
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
    /// let (reader, watcher) = db.store("pods", Api::<Pod>::all(server.client()), Default::default())?;
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
        self.wait_for_version_of(namespace, name, resource_version, None, timeout)
            .await
    }

    /// [`Reader::wait_for_resource_version`]; with `uid` (the written object's), a deletion
    /// resolves the wait only if it is of that object.
    async fn wait_for_version_of(
        &self,
        namespace: Option<&str>,
        name: &str,
        resource_version: &str,
        uid: Option<&str>,
        timeout: Duration,
    ) -> Result<()> {
        let what = match namespace {
            Some(ns) => format!("{ns}/{name} at resourceVersion {resource_version:?}"),
            None => format!("{name} at resourceVersion {resource_version:?}"),
        };
        let comparable = resource_version::is_comparable(resource_version);
        let mut rx = self.status().clone();
        // A list begun after this moment holds the written version or a later state.
        let list_epoch = rx.borrow().list_epoch;
        // Whether the awaited object is stored now (any object of its name, without a uid),
        // for servers whose versions only compare for equality.
        let of_awaited = |stored_uid: &str| {
            uid.is_none_or(|uid| stored_uid.is_empty() || uid.is_empty() || stored_uid == uid)
        };
        let mut present = if comparable {
            None
        } else {
            let now = self.stored_version(namespace, name).await?;
            Some(now.is_some_and(|(_, u)| of_awaited(&u)))
        };
        let wait = async {
            loop {
                let (checkpoint, relisted) = {
                    let s = rx.borrow_and_update();
                    (s.checkpoint.clone(), s.listed_epoch > list_epoch)
                };
                let done = match present.as_mut() {
                    None => checkpoint
                        .as_deref()
                        .and_then(|c| resource_version::at_least(c, resource_version))
                        .unwrap_or(false),
                    // Another version says nothing: it may be older or newer than the
                    // awaited one. The awaited version itself, a list begun after the call,
                    // or the end of the awaited object after the wait saw it does: its
                    // deletion (or its replacement by an object of another uid) comes after
                    // every write of it. With a uid, the deletion of an earlier object of
                    // the same name (delete, then create the awaited one) does not.
                    Some(was_present) => {
                        let now = self.stored_version(namespace, name).await?;
                        let is_awaited = now.as_ref().is_some_and(|(_, u)| of_awaited(u));
                        let gone = *was_present && !is_awaited && (uid.is_some() || now.is_none());
                        if uid.is_some() {
                            *was_present = is_awaited;
                        } else {
                            *was_present |= now.is_some();
                        }
                        relisted
                            || gone
                            || now.as_ref().map(|(rv, _)| rv.as_str()) == Some(resource_version)
                    }
                };
                if done {
                    return Ok(());
                }
                if rx.changed().await.is_err() {
                    return Err(self.dropped());
                }
            }
        };
        match tokio::time::timeout(timeout, wait).await {
            Ok(res) => res,
            Err(_) => Err(Error::Timeout {
                what,
                path: self.path().to_path_buf(),
                checkpoint: self.checkpoint(),
                waited: timeout,
            }),
        }
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
    /// let (reader, watcher) = db.store("pods", Api::<Pod>::all(server.client()), Default::default())?;
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
            return Err(Error::Config(
                "wait_for_write needs an object with metadata.name and metadata.resourceVersion (as a write returns it)".into(),
            ));
        };
        self.wait_for_version_of(
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
        let mut rx = self.status().clone();
        rx.wait_for(|s| f(s))
            .await
            .map(|_| ())
            .map_err(|_| self.dropped())
    }

    fn dropped(&self) -> Error {
        Error::Config(format!(
            "the watcher of the store at {} was dropped before it got there",
            self.path().display()
        ))
    }

    /// The resourceVersion and uid of the stored object (`None` when absent), read on the
    /// blocking pool.
    async fn stored_version(
        &self,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<(String, String)>> {
        let (reader, ns, name) = (
            self.clone(),
            namespace.map(str::to_string),
            name.to_string(),
        );
        tokio::task::spawn_blocking(move || reader.stored_version_and_uid(ns.as_deref(), &name))
            .await
            .map_err(|e| Error::Config(format!("reading a stored version failed: {e}")))?
    }
}
