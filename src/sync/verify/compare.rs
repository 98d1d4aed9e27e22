//! One comparison of a stored stream with one list of its collection (the current one, or
//! the one at the checkpoint): the list's pages looked up in the store as they come, then a
//! scan of the store for what the list lacked. Where the store is read ([`Source`]), and
//! the collection listed ([`VerifyTarget`]).

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;

use kube::Api;
use kube::api::{ApiResource, DynamicObject};
use sha2::{Digest, Sha256};

use super::Difference;
use super::window::{Now, Window};
use crate::disk::DbConfig;
use crate::disk::keys;
use crate::model::Shard;
use crate::model::{Error, RequestKind, Result};
use crate::store::{Dir, StoredVersions, StreamInfo};
use crate::sync::params;
use crate::sync::raw::StatusKind;

/// Objects requested per LIST page.
const PAGE: u32 = 500;

/// How often a list of the current state is started again when its continue token expires.
const LIST_ATTEMPTS: u32 = 3;

/// How a comparison treats a delta relist's window ([`Window`]).
#[derive(Debug, Clone)]
pub(super) enum WindowRole {
    /// No window is open: every difference counts.
    Closed,
    /// A window is open and this is the comparison with the current list: every
    /// difference is also kept by key digest, for the comparison at the checkpoint.
    Record,
    /// A window is open and this is the comparison with the list at the checkpoint: the
    /// differences the window explains do not count.
    Explain(Arc<Window>),
}

/// One comparison of the store with one list of the collection.
#[derive(Debug)]
pub(super) struct Comparison {
    /// The list's resourceVersion.
    pub(super) list_rv: String,
    pub(super) server_objects: u64,
    pub(super) stored_objects: u64,
    /// Differences that count.
    pub(super) count: u64,
    pub(super) differences: Vec<Difference>,
    /// Stored objects outside the stream's shard left for its prune (not differences).
    pub(super) awaiting_prune: u64,
    /// Differences a delta relist's window explains (not counted).
    pub(super) explained: u64,
    pub(super) role: WindowRole,
    /// With [`WindowRole::Record`]: every difference, by key digest.
    pub(super) recorded: HashMap<u128, Now>,
}

impl Comparison {
    pub(super) fn new(role: WindowRole) -> Comparison {
        Comparison {
            list_rv: String::new(),
            server_objects: 0,
            stored_objects: 0,
            count: 0,
            differences: Vec::new(),
            awaiting_prune: 0,
            explained: 0,
            role,
            recorded: HashMap::new(),
        }
    }

    /// Count a difference (keeping the first `max`).
    pub(super) fn note(&mut self, difference: Difference, max: usize) {
        self.count += 1;
        if self.differences.len() < max {
            self.differences.push(difference);
        }
    }

    /// A difference of the object with key digest `key` (`uid`: the listed object's), as
    /// the comparison's [`WindowRole`] treats it.
    fn differ(&mut self, key: u128, uid: Option<&str>, difference: Difference, max: usize) {
        match &self.role {
            WindowRole::Closed => {}
            WindowRole::Record => {
                self.recorded.insert(key, Now::of(&difference, uid));
            }
            WindowRole::Explain(window) => {
                if window.explains(key, uid, &difference) {
                    self.explained += 1;
                    return;
                }
            }
        }
        self.note(difference, max);
    }
}

/// Which state of the collection a comparison lists.
#[derive(Clone, Copy)]
pub(super) enum At<'a> {
    /// The current state (a consistent read).
    Now,
    /// The state at this resourceVersion exactly.
    Exactly(&'a str),
}

/// One listed object, as a comparison needs it.
struct Item {
    suffix: Vec<u8>,
    /// The digest of `suffix`.
    key: u128,
    version: String,
    uid: Option<String>,
}

/// What a stream needs to be listed again: where, with which selectors, which shard.
pub(super) struct VerifyTarget {
    pub(super) api: Api<DynamicObject>,
    pub(super) url: String,
    pub(super) labels: Option<String>,
    pub(super) fields: Option<String>,
    pub(super) shard: Option<Shard>,
    /// Whether the prune of a narrowed `shard` is under way: stored objects outside it are
    /// left for the prune, not differences.
    pub(super) pruning: bool,
    pub(super) source: Arc<Source>,
    pub(super) max: usize,
}

/// Where a verification reads the stored stream.
pub(super) enum Source {
    /// A store held for the whole verification.
    Held { dir: Dir, stream: String },
    /// The store at `path`, opened with `config` for each read and closed after it.
    Reopened {
        path: PathBuf,
        config: DbConfig,
        stream: String,
    },
}

impl Source {
    /// Run `f` on the store. Blocking: opens the store for a reopened source.
    fn with_dir<T>(&self, f: impl FnOnce(&Dir, &str) -> Result<T>) -> Result<T> {
        match self {
            Source::Held { dir, stream } => f(dir, stream),
            Source::Reopened {
                path,
                config,
                stream,
            } => f(&Dir::open(path, config.clone())?, stream),
        }
    }

    /// Run `f` on the stream's stored versions. Blocking.
    fn read<T>(&self, f: impl FnOnce(&StoredVersions) -> Result<T>) -> Result<T> {
        self.with_dir(|dir, stream| f(&dir.stored_versions(stream)?))
    }

    /// The stream's info (its checkpoint) as stored now; an error names a stream that is
    /// not there. Blocking.
    pub(super) fn info(&self) -> Result<Option<StreamInfo>> {
        self.with_dir(|dir, stream| {
            let info = dir.streams()?.into_iter().find(|s| s.name == stream);
            drop(dir.stored_versions(stream)?);
            Ok(info)
        })
    }
}

impl VerifyTarget {
    /// Compare with the current state, listing again if a continue token expires.
    pub(super) async fn compare_now(&self, role: WindowRole) -> Result<Comparison> {
        for attempt in 1..=LIST_ATTEMPTS {
            if let Some(c) = self.compare(At::Now, role.clone()).await? {
                return Ok(c);
            }
            tracing::info!(attempt, "continue token expired; listing again");
        }
        Err(Error::Protocol {
            context: format!("listing {}", self.url),
            detail: format!("continue tokens expired {LIST_ATTEMPTS} times in a row"),
        })
    }

    /// Compare with one list of the collection; `None` when the server answers
    /// `410 Gone` (the resourceVersion is compacted, or a continue token expired).
    pub(super) async fn compare(&self, at: At<'_>, role: WindowRole) -> Result<Option<Comparison>> {
        let mut seen: HashSet<u128> = HashSet::new();
        let mut c = Comparison::new(role);
        let mut token: Option<String> = None;
        loop {
            let selectors = params::Selectors {
                labels: self.labels.as_deref(),
                fields: self.fields.as_deref(),
            };
            let from = match (&token, at) {
                (Some(t), _) => params::From::Continue(t),
                (None, At::Exactly(rv)) => params::From::Exactly(rv),
                (None, At::Now) => params::From::Now,
            };
            let lp = params::list(selectors, PAGE, from);
            let page = match self.api.list_metadata(&lp).await {
                Ok(page) => page,
                Err(kube::Error::Api(s)) if StatusKind::of(s.code, false) == StatusKind::Gone => {
                    return Ok(None);
                }
                Err(source) => {
                    return Err(Error::Kube {
                        request: RequestKind::List,
                        context: match at {
                            At::Now => format!("listing {} to verify it", self.url),
                            At::Exactly(rv) => {
                                format!("listing {} at resourceVersion {rv} to verify it", self.url)
                            }
                        },
                        source,
                    });
                }
            };
            if token.is_none() {
                c.list_rv = page.metadata.resource_version.clone().unwrap_or_default();
            }
            let listed: Vec<Item> = page
                .items
                .into_iter()
                .filter(|o| {
                    self.shard.as_ref().is_none_or(|s| {
                        s.contains(o.metadata.uid.as_deref(), o.metadata.namespace.as_deref())
                    })
                })
                .map(|o| {
                    let m = o.metadata;
                    let suffix = keys::object_suffix(
                        m.namespace.as_deref(),
                        m.name.as_deref().unwrap_or(""),
                    );
                    Item {
                        key: digest(&suffix),
                        suffix,
                        version: m.resource_version.unwrap_or_default(),
                        uid: m.uid,
                    }
                })
                .collect();
            seen.extend(listed.iter().map(|item| item.key));
            c.server_objects += listed.len() as u64;
            let (source, max) = (self.source.clone(), self.max);
            c = blocking(move || source.read(|v| compare_page(v, &listed, c, max))).await?;
            token = page.metadata.continue_.filter(|t| !t.is_empty());
            if token.is_none() {
                break;
            }
        }
        let (source, max) = (self.source.clone(), self.max);
        let pruned = self.shard.clone().filter(|_| self.pruning);
        blocking(move || source.read(|v| find_extra(v, &seen, pruned.as_ref(), c, max)))
            .await
            .map(Some)
    }
}

/// Look up one page of listed objects in the store.
fn compare_page(
    versions: &StoredVersions,
    listed: &[Item],
    mut c: Comparison,
    max: usize,
) -> Result<Comparison> {
    let suffixes: Vec<&[u8]> = listed.iter().map(|item| item.suffix.as_slice()).collect();
    let stored = versions.get(&suffixes)?;
    for (item, stored) in listed.iter().zip(stored) {
        let key = keys::display(&item.suffix);
        let server = item.version.clone();
        let difference = match stored {
            None => Difference::Missing { key, server },
            Some(stored) if stored != item.version => Difference::Version {
                key,
                stored,
                server,
            },
            Some(_) => continue,
        };
        c.differ(item.key, item.uid.as_deref(), difference, max);
    }
    Ok(c)
}

/// Scan the store for objects the list did not contain. With `pruned` (the shard of a
/// prune under way), a stored object outside it is left for the prune, not a difference.
fn find_extra(
    versions: &StoredVersions,
    seen: &HashSet<u128>,
    pruned: Option<&Shard>,
    mut c: Comparison,
    max: usize,
) -> Result<Comparison> {
    versions.each(|suffix, stored, uid| {
        c.stored_objects += 1;
        let key = digest(suffix);
        if seen.contains(&key) {
            return;
        }
        let namespace = keys::suffix_namespace(suffix);
        if pruned.is_some_and(|shard| !shard.contains(Some(uid), Some(namespace.as_ref()))) {
            c.awaiting_prune += 1;
            return;
        }
        let difference = Difference::Extra {
            key: keys::display(suffix),
            stored,
        };
        c.differ(key, None, difference, max);
    })?;
    Ok(c)
}

/// A 128-bit digest of an object key: collisions are out of reach (2^-64 at 10^9 keys).
fn digest(suffix: &[u8]) -> u128 {
    let d = Sha256::digest(suffix);
    u128::from_le_bytes(d[..16].try_into().unwrap_or_default())
}

/// Run blocking disk work on tokio's blocking pool.
pub(super) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Protocol {
            context: "verifying a stream".into(),
            detail: format!("a disk task failed: {e}"),
        })?
}

/// The API resource and namespace of a collection URL (`/api/v1/namespaces/ns/pods`,
/// `/apis/apps/v1/deployments`).
pub(super) fn api_resource(
    url: &str,
    api_version: &str,
    kind: &str,
) -> Option<(ApiResource, Option<String>)> {
    let parts: Vec<&str> = url.trim_matches('/').split('/').collect();
    let (group, version, rest) = match parts.as_slice() {
        ["api", version, rest @ ..] => ("", *version, rest),
        ["apis", group, version, rest @ ..] => (*group, *version, rest),
        _ => return None,
    };
    let (namespace, plural) = match rest {
        ["namespaces", ns, plural] => (Some(ns.to_string()), *plural),
        [plural] => (None, *plural),
        _ => return None,
    };
    if plural.is_empty() || version.is_empty() {
        return None;
    }
    Some((
        ApiResource {
            group: group.to_string(),
            version: version.to_string(),
            api_version: api_version.to_string(),
            kind: kind.to_string(),
            plural: plural.to_string(),
        },
        namespace,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collection_urls_parse_into_resources() {
        let (r, ns) = api_resource("/api/v1/namespaces/team-a/pods", "v1", "Pod").unwrap();
        assert_eq!((r.group.as_str(), r.version.as_str()), ("", "v1"));
        assert_eq!(r.plural, "pods");
        assert_eq!(ns.as_deref(), Some("team-a"));
        let (r, ns) = api_resource("/apis/apps/v1/deployments", "apps/v1", "Deployment").unwrap();
        assert_eq!(
            (r.group.as_str(), r.plural.as_str()),
            ("apps", "deployments")
        );
        assert_eq!(ns, None);
        for bad in [
            "",
            "/",
            "/api",
            "/apis/apps",
            "/api/v1/namespaces/x",
            "/x/v1/pods",
        ] {
            assert!(api_resource(bad, "v1", "Pod").is_none(), "{bad:?} parsed");
        }
    }

    #[test]
    fn differences_are_counted_beyond_the_ones_kept() {
        let mut c = Comparison::new(WindowRole::Closed);
        for i in 0..5 {
            c.note(
                Difference::Extra {
                    key: format!("ns/p{i}"),
                    stored: "7".into(),
                },
                2,
            );
        }
        assert_eq!(c.count, 5);
        assert_eq!(c.differences.len(), 2);
        assert_eq!(
            c.differences[1].to_string(),
            "extra ns/p1: stored at 7, not on the server"
        );
    }

    #[test]
    fn an_open_window_records_differences_from_the_current_list_and_explains_them_after() {
        let mut now = Comparison::new(WindowRole::Record);
        let version = Difference::Version {
            key: "ns/a".into(),
            stored: "150".into(),
            server: "180".into(),
        };
        now.differ(1, Some("u"), version.clone(), 10);
        assert_eq!((now.count, now.recorded.len()), (1, 1));
        let window = Window::new("100".into(), now.list_rv.clone(), now.recorded);
        let mut at_checkpoint = Comparison::new(WindowRole::Explain(Arc::new(window)));
        let at_cp = |stored: &str| Difference::Version {
            key: "ns/a".into(),
            stored: stored.into(),
            server: "90".into(),
        };
        at_checkpoint.differ(1, Some("u"), at_cp("150"), 10);
        assert_eq!((at_checkpoint.count, at_checkpoint.explained), (0, 1));
        at_checkpoint.differ(1, Some("u"), at_cp("190"), 10);
        assert_eq!((at_checkpoint.count, at_checkpoint.explained), (1, 1));
        assert_eq!(at_checkpoint.differences, [at_cp("190")]);
    }
}
