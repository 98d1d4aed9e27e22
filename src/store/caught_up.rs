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

/// [`Reader::wait_for_resource_version`] of `reader`; with `uid` (the written object's), a
/// deletion resolves the wait only if it is of that object.
pub(crate) async fn wait_for_version<K>(
    reader: &Reader<K>,
    namespace: Option<&str>,
    name: &str,
    resource_version: &str,
    uid: Option<&str>,
    timeout: Duration,
) -> Result<()>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
{
    let what = match namespace {
        Some(ns) => format!("{ns}/{name} at resourceVersion {resource_version:?}"),
        None => format!("{name} at resourceVersion {resource_version:?}"),
    };
    let comparable = resource_version::is_comparable(resource_version);
    let mut rx = reader.status().clone();
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
        let now = reader.stored_version(namespace, name).await?;
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
                    let now = reader.stored_version(namespace, name).await?;
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
                return Err(reader.dropped());
            }
        }
    };
    match tokio::time::timeout(timeout, wait).await {
        Ok(res) => res,
        Err(_) => Err(Error::Timeout {
            what,
            path: reader.path().to_path_buf(),
            checkpoint: reader.checkpoint(),
            waited: timeout,
        }),
    }
}
