//! Whether the store has caught up with the server, as the watcher learns it.
//!
//! Connected is not caught up: after a warm restart the watch replays what the store
//! missed, or answers `410 Gone` and relists. [`CatchUp`] is the state machine the watcher
//! keeps; it publishes [`Freshness`] in the readers' status.
//!
//! - Before a watch connects while not caught up, the server's current resourceVersion is
//!   read with a consistent `LIST limit=1` (kube-apiserver serves it from its watch cache).
//!   When it and the checkpoint compare (KEP-5504), the store is caught up once the
//!   checkpoint is at or past it (events and bookmarks move the checkpoint).
//! - Otherwise (opaque versions, or that read failed) the first bookmark after connecting
//!   counts, a weaker signal.
//! - A server may send a watch no bookmarks at all (kube-apiserver with its watch cache
//!   off for the resource: its etcd watcher asks etcd for progress notifications only for
//!   the watch cache's own watch). If the collection did not change, no event moves the
//!   checkpoint either. A watch opened while behind has a short server-side deadline; when
//!   it ends there without an error, having delivered no bookmark and nothing in its last
//!   seconds, it delivered every change the server had when it connected (a watch sends
//!   the changes after its resourceVersion in order, those already made first): caught up.
//! - A list that began in this process is a consistent read: its end (after its sweep) is
//!   caught up. A list continued from an earlier process's continue token is not (its
//!   snapshot predates the restart): the next watch connect checks.
//! - A watch failure or a relist loses it; the routine reconnect after a watch's
//!   server-side timeout keeps it.

use std::time::Duration;

use kube::core::Request;

use super::config::StreamConfig;
use super::params;
use crate::model::Counters;
use crate::model::resource_version;
use crate::model::{Error, RequestKind, Result};
use crate::store::StatusTx;
use crate::store::{CatchUpRule, Freshness};

/// The server-side timeout of a watch opened while the store catches up: kube-apiserver's
/// watch cache sends a bookmark 2 s before a watch's deadline, so a quiet collection (no
/// event to move the checkpoint past the target) is caught up within about 3 s instead of
/// at the next periodic bookmark (about a minute). The watch then reconnects as usual.
pub(crate) const CATCH_UP_WATCH_TIMEOUT: u32 = 5;

/// How long the read of the server's resourceVersion may take before the weaker rule is used.
const TARGET_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a catch-up watch must have read nothing before its deadline to count as having
/// delivered everything (at most half its timeout): the changes a watch replays are sent
/// at once, one after the other.
const QUIET_BEFORE_DEADLINE: Duration = Duration::from_secs(2);

/// Where the watcher is in catching up.
#[derive(Debug, Clone, PartialEq, Eq)]
enum CatchUpState {
    /// Not caught up, nothing to compare with: the next watch connect reads a target.
    Unknown,
    /// Caught up once the checkpoint is at `target` or past it.
    Target(String),
    /// Caught up at the first bookmark after the watch connected.
    Bookmark,
    /// Caught up (by `rule`).
    CaughtUp,
}

/// The watcher's view of freshness, and the channel it publishes it on.
pub(crate) struct CatchUp {
    state: CatchUpState,
    /// A list began in this process and has not completed yet.
    list_began: bool,
    status: StatusTx,
    url: String,
    /// The rule last logged, so that a change of rule is said once.
    logged_rule: CatchUpRule,
    /// The server-side timeout of the current watch, when it was opened while behind.
    catch_up_deadline: Option<Duration>,
    /// Bookmarks the current watch delivered.
    watch_bookmarks: u64,
}

impl CatchUp {
    pub(crate) fn new(status: StatusTx, url: &str) -> Self {
        CatchUp {
            state: CatchUpState::Unknown,
            list_began: false,
            status,
            url: url.to_string(),
            logged_rule: CatchUpRule::Pending,
            catch_up_deadline: None,
            watch_bookmarks: 0,
        }
    }

    pub(crate) fn caught_up(&self) -> bool {
        self.state == CatchUpState::CaughtUp
    }

    /// The store can no longer claim to be caught up (a watch failure, a relist).
    pub(crate) fn lost(&mut self, why: &str) {
        if self.state != CatchUpState::Unknown {
            tracing::debug!(url = %self.url, reason = why, "no longer caught up with the server");
        }
        self.state = CatchUpState::Unknown;
        self.publish(|f| {
            f.caught_up = false;
            f.behind = None;
        });
    }

    /// A list (a new epoch) began in this process.
    pub(crate) fn list_began(&mut self) {
        self.lost("a list began");
        self.list_began = true;
    }

    /// The store reached `Synced` at `checkpoint` from a list (and its sweep).
    pub(crate) fn list_done(&mut self, checkpoint: &str) {
        if !std::mem::take(&mut self.list_began) {
            // Continued from an earlier process: its snapshot may be old.
            return;
        }
        self.reached(CatchUpRule::List, checkpoint);
    }

    /// Before a watch connects from `checkpoint`: unless caught up (or a target is already
    /// set), read the server's current resourceVersion. Returns the server-side timeout to
    /// use for that watch when the store is behind (see [`CATCH_UP_WATCH_TIMEOUT`]).
    pub(crate) async fn before_connect(
        &mut self,
        client: &kube::Client,
        request: &Request,
        cfg: &StreamConfig,
        stats: &Counters,
        checkpoint: &str,
    ) -> Option<u32> {
        self.watch_bookmarks = 0;
        self.catch_up_deadline = None;
        let timeout = self
            .catch_up_timeout(client, request, cfg, stats, checkpoint)
            .await;
        self.catch_up_deadline = timeout.map(|t| Duration::from_secs(t.into()));
        timeout
    }

    async fn catch_up_timeout(
        &mut self,
        client: &kube::Client,
        request: &Request,
        cfg: &StreamConfig,
        stats: &Counters,
        checkpoint: &str,
    ) -> Option<u32> {
        match self.state {
            CatchUpState::CaughtUp => return None,
            CatchUpState::Target(_) | CatchUpState::Bookmark => {
                return Some(CATCH_UP_WATCH_TIMEOUT.min(cfg.timeout));
            }
            CatchUpState::Unknown => {}
        }
        Counters::add(&stats.server_version_reads, 1);
        let target = tokio::time::timeout(
            TARGET_READ_TIMEOUT,
            server_version(client, request, cfg, &self.url),
        )
        .await
        .unwrap_or_else(|_| {
            Err(Error::Protocol {
                context: format!("LIST {} (limit=1)", self.url),
                detail: format!("no answer within {} s", TARGET_READ_TIMEOUT.as_secs()),
            })
        });
        match target {
            Ok(target) if resource_version::compare(checkpoint, &target).is_ok() => {
                self.say_rule(CatchUpRule::ComparableResourceVersions, None);
                let behind = resource_version::distance(checkpoint, &target);
                self.publish(|f| {
                    f.rule = CatchUpRule::ComparableResourceVersions;
                    f.server_resource_version = Some(target.clone());
                    f.behind = behind;
                });
                tracing::debug!(url = %self.url, checkpoint, server_resource_version = %target,
                    behind, "catching up with the server");
                self.state = CatchUpState::Target(target);
                self.after_burst(checkpoint, 0);
            }
            Ok(target) => {
                let why = resource_version::compare(checkpoint, &target)
                    .err()
                    .map(|e| e.to_string());
                self.say_rule(CatchUpRule::FirstBookmark, why.as_deref());
                self.publish(|f| {
                    f.rule = CatchUpRule::FirstBookmark;
                    f.server_resource_version = Some(target.clone());
                    f.behind = None;
                });
                self.state = CatchUpState::Bookmark;
            }
            Err(e) => {
                tracing::warn!(url = %self.url, error = %e,
                    "cannot read the server's resourceVersion; caught up at the first bookmark instead");
                self.publish(|f| {
                    f.rule = CatchUpRule::FirstBookmark;
                    f.behind = None;
                });
                self.logged_rule = CatchUpRule::FirstBookmark;
                self.state = CatchUpState::Bookmark;
            }
        }
        (!self.caught_up()).then(|| CATCH_UP_WATCH_TIMEOUT.min(cfg.timeout))
    }

    /// A watch burst was committed: the checkpoint is now `checkpoint`, and the burst held
    /// `bookmarks` bookmarks.
    pub(crate) fn after_burst(&mut self, checkpoint: &str, bookmarks: u64) {
        self.watch_bookmarks += bookmarks;
        match &self.state {
            CatchUpState::Target(target) => {
                match resource_version::at_least(checkpoint, target) {
                    Some(true) => self.reached(CatchUpRule::ComparableResourceVersions, checkpoint),
                    Some(false) => {
                        let behind = resource_version::distance(checkpoint, target);
                        self.publish(|f| f.behind = behind);
                    }
                    // The checkpoint came from the server, compared before: cannot happen
                    // unless the server changed its format; the bookmark rule then.
                    None => self.state = CatchUpState::Bookmark,
                }
            }
            CatchUpState::Bookmark if bookmarks > 0 => {
                self.reached(CatchUpRule::FirstBookmark, checkpoint)
            }
            _ => {}
        }
    }

    /// The watch ended without an error, `lasted` after its request was sent, its last line
    /// `quiet` before the end. A watch opened while behind that ran to its deadline, got
    /// no bookmark and was quiet at the end delivered everything the server had when it
    /// connected: caught up (the server sends this watch no bookmarks, see the module).
    pub(crate) fn watch_ended(&mut self, checkpoint: &str, lasted: Duration, quiet: Duration) {
        let Some(deadline) = self.catch_up_deadline.take() else {
            return;
        };
        let behind = matches!(self.state, CatchUpState::Target(_) | CatchUpState::Bookmark);
        let quiet_enough = quiet >= QUIET_BEFORE_DEADLINE.min(deadline / 2);
        if !behind || self.watch_bookmarks > 0 || lasted < deadline || !quiet_enough {
            return;
        }
        if self.logged_rule != CatchUpRule::QuietWatchDeadline {
            self.logged_rule = CatchUpRule::QuietWatchDeadline;
            tracing::info!(url = %self.url, lasted_ms = lasted.as_millis() as u64,
                quiet_ms = quiet.as_millis() as u64,
                "a watch ran to its deadline without a bookmark (the server sends none to this watch): caught up by the quiet watch");
        }
        self.reached(CatchUpRule::QuietWatchDeadline, checkpoint);
    }

    fn reached(&mut self, rule: CatchUpRule, checkpoint: &str) {
        if self.state == CatchUpState::CaughtUp {
            return;
        }
        self.state = CatchUpState::CaughtUp;
        let target = self
            .status
            .borrow()
            .catch_up
            .server_resource_version
            .clone();
        tracing::info!(url = %self.url, resource_version = checkpoint, rule = %rule,
            "store caught up with the server");
        self.publish(|f| {
            f.caught_up = true;
            f.rule = rule;
            if rule == CatchUpRule::List {
                f.server_resource_version = Some(checkpoint.to_string());
            }
            f.behind = match (rule, &target) {
                // The checkpoint did not move: nothing changed in the collection since it.
                (CatchUpRule::List | CatchUpRule::QuietWatchDeadline, _) => Some(0),
                (_, Some(t)) => resource_version::distance(checkpoint, t),
                (_, None) => None,
            };
        });
    }

    fn say_rule(&mut self, rule: CatchUpRule, why: Option<&str>) {
        if self.logged_rule == rule {
            return;
        }
        self.logged_rule = rule;
        match rule {
            CatchUpRule::FirstBookmark => {
                tracing::warn!(url = %self.url, reason = why.unwrap_or(""),
                "the server's resourceVersions are not comparable (KEP-5504): the store counts as caught up at the first bookmark after each (re)connect")
            }
            _ => tracing::info!(url = %self.url, rule = %rule, "how the store knows it caught up"),
        }
    }

    fn publish(&self, f: impl FnOnce(&mut Freshness)) {
        self.status.catch_up(f);
    }
}

/// The server's current resourceVersion: a consistent `LIST limit=1` of the collection's
/// metadata (no resourceVersion, so not served from a stale cache).
async fn server_version(
    client: &kube::Client,
    request: &Request,
    cfg: &StreamConfig,
    described: &str,
) -> Result<String> {
    #[derive(serde::Deserialize)]
    struct ListHead {
        metadata: ListMeta,
    }
    #[derive(serde::Deserialize)]
    struct ListMeta {
        #[serde(rename = "resourceVersion")]
        resource_version: Option<String>,
    }
    let lp = params::list(params::Selectors::of(cfg), 1, params::From::Now);
    let context = || format!("LIST {described} (limit=1, for the server's resourceVersion)");
    let req = request
        .list_metadata(&lp)
        .map_err(|e| Error::InvalidArgument {
            detail: format!("{}: {e}", context()),
        })?;
    let text = client
        .request_text(req)
        .await
        .map_err(|source| Error::Kube {
            request: RequestKind::List,
            context: context(),
            source,
        })?;
    let head: ListHead = serde_json::from_str(&text).map_err(|e| Error::Protocol {
        context: context(),
        detail: format!("the list does not decode: {}", crate::model::describe(&e)),
    })?;
    head.metadata
        .resource_version
        .filter(|rv| !rv.is_empty())
        .ok_or_else(|| Error::Protocol {
            context: context(),
            detail: "the list has no metadata.resourceVersion".into(),
        })
}
