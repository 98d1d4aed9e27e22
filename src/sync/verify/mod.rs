//! Compare a stored stream with the collection on the server: [`Db::verify`](crate::Db::verify).
//!
//! The store claims to equal the server's collection at its checkpoint. To check that
//! claim the collection is listed (paginated, metadata only, with the stream's own
//! selectors) and compared object by object by key and resourceVersion. When the store
//! differs from the server's current state, the collection is listed again at the
//! checkpoint itself (`resourceVersionMatch=Exact`): a store that equals that list is
//! behind (the differences are changes newer than its checkpoint), not wrong.
//!
//! Memory: one page of the list at a time, plus a 16-byte digest per listed key (to find
//! stored objects the server no longer has), never the objects.
//!
//! [`Db::verify_at`](crate::Db::verify_at) opens the store only for each read (one page's
//! lookups, the final scan) and closes it during the LISTs, so that a writer that needs the
//! store to itself is not kept from opening it.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kube::api::{ApiResource, DynamicObject};
use kube::{Api, Client};
use sha2::{Digest, Sha256};

use super::list;
use super::raw::StatusKind;
use crate::disk::DbConfig;
use crate::disk::keys;
use crate::model::Shard;
use crate::model::{Error, Result};
use crate::store::{Dir, StoredVersions, StreamInfo, SyncPhase};

/// Objects requested per LIST page.
const PAGE: u32 = 500;

/// How often a list of the current state is started again when its continue token expires.
const LIST_ATTEMPTS: u32 = 3;
/// Verifications of a store that its writer changed meanwhile, before giving up.
const MOVING_ATTEMPTS: u32 = 5;

/// How one object differs between the store and the server.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
/// # let dir = tempfile::tempdir()?;
/// # let db = kube_persist::Db::open(dir.path())?;
/// # let client = server.client();
/// # let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(client.clone());
/// # let (reader, watcher) = db.store("pods", api, kube_persist::StreamConfig::default())?;
/// # let watching = tokio::spawn(watcher.run());
/// # reader.wait_until_ready().await?;
/// # watching.abort(); // verify a store nothing writes to
/// use kube_persist::Difference;
/// // The store is synced, then web-1 is deleted on the server while no watcher runs.
/// server.handle().delete(&kube_persist_testkit::ResourceType::pods(), Some("default"), "web-1");
/// let report = db.verify("pods", client, 10).await?;
/// match &report.differences[..] {
///     [Difference::Extra { key, .. }] => assert_eq!(key, "default/web-1"),
///     other => panic!("expected one extra object, got {other:?}"),
/// }
/// println!("{}", report.differences[0]); // "extra default/web-1: stored at ..., not on the server"
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Difference {
    /// The server has the object; the store does not.
    Missing {
        /// `namespace/name` (or `name` for cluster-scoped objects).
        key: String,
        /// The server's resourceVersion of it.
        server: String,
    },
    /// The store has the object; the server does not.
    Extra {
        /// `namespace/name`.
        key: String,
        /// The stored resourceVersion.
        stored: String,
    },
    /// Both have it, at different resourceVersions.
    Version {
        /// `namespace/name`.
        key: String,
        /// The stored resourceVersion.
        stored: String,
        /// The server's.
        server: String,
    },
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Difference::Missing { key, server } => {
                write!(f, "missing {key}: on the server at {server}, not stored")
            }
            Difference::Extra { key, stored } => {
                write!(f, "extra {key}: stored at {stored}, not on the server")
            }
            Difference::Version {
                key,
                stored,
                server,
            } => write!(f, "version {key}: stored {stored}, server {server}"),
        }
    }
}

/// What [`Db::verify`](crate::Db::verify) concluded.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
/// # let dir = tempfile::tempdir()?;
/// # let db = kube_persist::Db::open(dir.path())?;
/// # let client = server.client();
/// # let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(client.clone());
/// # let (reader, watcher) = db.store("pods", api, kube_persist::StreamConfig::default())?;
/// # let watching = tokio::spawn(watcher.run());
/// # reader.wait_until_ready().await?;
/// # watching.abort(); // verify a store nothing writes to
/// use kube_persist::Verdict;
/// assert_eq!(db.verify("pods", client.clone(), 10).await?.verdict, Verdict::Equal);
/// // A change on the server that the store has not seen yet: behind, not wrong.
/// server.handle().delete(&kube_persist_testkit::ResourceType::pods(), Some("default"), "web-0");
/// let report = db.verify("pods", client, 10).await?;
/// assert!(matches!(report.verdict, Verdict::Behind { .. }));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verdict {
    /// The store equals the server's current collection, object by object.
    Equal,
    /// The store equals the collection at its checkpoint; the server has changed objects
    /// since (all of them newer than the checkpoint). Its watcher catches up when it runs.
    Behind {
        /// The resourceVersion of the server's current list.
        server_resource_version: String,
    },
    /// The store differs from the collection at its own checkpoint: it is wrong.
    Differs,
    /// The store differs from the server's current collection, and the server no longer
    /// serves the collection at the store's checkpoint (`410 Gone`: compacted), so whether
    /// the differences are newer than the checkpoint cannot be told.
    Undecided {
        /// The resourceVersion of the server's current list.
        server_resource_version: String,
    },
}

/// The result of [`Db::verify`](crate::Db::verify).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
/// # let dir = tempfile::tempdir()?;
/// # let db = kube_persist::Db::open(dir.path())?;
/// # let client = server.client();
/// # let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(client.clone());
/// # let (reader, watcher) = db.store("pods", api, kube_persist::StreamConfig::default())?;
/// # let watching = tokio::spawn(watcher.run());
/// # reader.wait_until_ready().await?;
/// # watching.abort(); // verify a store nothing writes to
/// let report: kube_persist::Verification = db.verify("pods", client, 10).await?;
/// assert_eq!(report.stream, "pods");
/// assert_eq!(Some(report.checkpoint.clone()), reader.checkpoint());
/// assert_eq!((report.stored_objects, report.server_objects), (2, 2));
/// assert_eq!(report.difference_count, 0);
/// assert!(report.is_ok() && report.differences.is_empty());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Verification {
    /// The stream verified.
    pub stream: String,
    /// The store's checkpoint.
    pub checkpoint: String,
    /// Objects in the store (records on disk).
    pub stored_objects: u64,
    /// Objects the stream's state counts ([`Reader::len`](crate::Reader::len)). It must
    /// equal [`Verification::stored_objects`]: a count that drifted from the records
    /// makes relists skip their sweep and deletions look already applied, so a store
    /// whose count differs is not correct even when its objects are.
    pub counted_objects: u64,
    /// Objects in the list that decided the verdict (the current one, or the one at the
    /// checkpoint for [`Verdict::Behind`] and [`Verdict::Differs`]).
    pub server_objects: u64,
    /// The conclusion.
    pub verdict: Verdict,
    /// How many objects differ: from the current list for [`Verdict::Behind`] and
    /// [`Verdict::Undecided`] (the changes since the checkpoint), from the list at the
    /// checkpoint for [`Verdict::Differs`].
    pub difference_count: u64,
    /// The first of those differences, at most the number asked for.
    pub differences: Vec<Difference>,
}

impl Verification {
    /// Whether the store is correct: equal to the server, or behind it only by changes
    /// newer than its checkpoint.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let client = server.client();
    /// # let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(client.clone());
    /// # let (reader, watcher) = db.store("pods", api, kube_persist::StreamConfig::default())?;
    /// # let watching = tokio::spawn(watcher.run());
    /// # reader.wait_until_ready().await?;
    /// # watching.abort(); // verify a store nothing writes to
    /// server.handle().delete(&kube_persist_testkit::ResourceType::pods(), Some("default"), "web-1"); // after the checkpoint
    /// let report = db.verify("pods", client, 10).await?;
    /// assert_eq!(report.difference_count, 1);
    /// assert!(report.is_ok()); // behind by a newer change is correct
    /// # Ok(()) }
    /// ```
    pub fn is_ok(&self) -> bool {
        matches!(self.verdict, Verdict::Equal | Verdict::Behind { .. }) && self.count_consistent()
    }

    /// Whether the stream's object count equals the records on disk.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let client = server.client();
    /// # let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(client.clone());
    /// # let (reader, watcher) = db.store("pods", api, kube_persist::StreamConfig::default())?;
    /// # let watching = tokio::spawn(watcher.run());
    /// # reader.wait_until_ready().await?;
    /// # watching.abort();
    /// let report = db.verify("pods", client, 10).await?;
    /// assert!(report.count_consistent());
    /// assert_eq!(report.counted_objects, report.stored_objects);
    /// # Ok(()) }
    /// ```
    pub fn count_consistent(&self) -> bool {
        self.counted_objects == self.stored_objects
    }
}

/// One comparison of the store with one list of the collection.
struct Comparison {
    /// The list's resourceVersion.
    list_rv: String,
    server_objects: u64,
    stored_objects: u64,
    count: u64,
    differences: Vec<Difference>,
}

impl Comparison {
    fn note(&mut self, difference: Difference, max: usize) {
        self.count += 1;
        if self.differences.len() < max {
            self.differences.push(difference);
        }
    }
}

/// Which state of the collection a comparison lists.
#[derive(Clone, Copy)]
enum At<'a> {
    /// The current state (a consistent read).
    Now,
    /// The state at this resourceVersion exactly.
    Exactly(&'a str),
}

/// What a stream needs to be listed again: where, with which selectors, which shard.
struct VerifyTarget {
    api: Api<DynamicObject>,
    url: String,
    labels: Option<String>,
    fields: Option<String>,
    shard: Option<Shard>,
    source: Arc<Source>,
    max: usize,
}

/// Where a verification reads the stored stream.
enum Source {
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
    fn info(&self) -> Result<Option<StreamInfo>> {
        self.with_dir(|dir, stream| {
            let info = dir.streams()?.into_iter().find(|s| s.name == stream);
            drop(dir.stored_versions(stream)?);
            Ok(info)
        })
    }
}

/// The work of [`Db::verify`](crate::Db::verify).
pub(crate) async fn verify(
    dir: &Dir,
    stream: &str,
    client: Client,
    max_differences: usize,
) -> Result<Verification> {
    let source = Source::Held {
        dir: dir.clone(),
        stream: stream.to_string(),
    };
    verify_with(source, stream, client, max_differences).await
}

/// The work of [`Db::verify_at`](crate::Db::verify_at).
pub(crate) async fn verify_at(
    path: &Path,
    config: DbConfig,
    stream: &str,
    client: Client,
    max_differences: usize,
) -> Result<Verification> {
    let source = Source::Reopened {
        path: path.to_path_buf(),
        config,
        stream: stream.to_string(),
    };
    verify_with(source, stream, client, max_differences).await
}

/// Verify `stream` from `source`. A store whose writer runs (a controller beside the
/// `kube-persist` tool) may change during the comparison, which then finds differences
/// that are only the store moving on: a [`Verdict::Differs`] stands only when the stream's
/// checkpoint is the same after the comparison as before it (every batch that changes
/// objects moves the checkpoint with them); otherwise the stream is verified again, up to
/// [`MOVING_ATTEMPTS`] times.
async fn verify_with(
    source: Source,
    stream: &str,
    client: Client,
    max_differences: usize,
) -> Result<Verification> {
    let not = |detail: String| Error::NotVerifiable {
        stream: stream.to_string(),
        detail,
    };
    let source = Arc::new(source);
    let info = |source: &Arc<Source>| {
        let source = source.clone();
        blocking(move || source.info())
    };
    for attempt in 1..=MOVING_ATTEMPTS {
        let stored = info(&source)
            .await?
            .ok_or_else(|| not("the store holds no such stream".into()))?;
        let report = verify_once(stored, source.clone(), stream, &client, max_differences).await?;
        if report.verdict != Verdict::Differs {
            return Ok(report);
        }
        let now = info(&source).await?.and_then(|i| i.checkpoint);
        if now.as_deref() == Some(report.checkpoint.as_str()) {
            return Ok(report);
        }
        tracing::info!(
            stream,
            attempt,
            checkpoint = %report.checkpoint,
            "the store changed during the verification (its writer runs); verifying again"
        );
    }
    Err(not(format!(
        "its writer changed it during each of {MOVING_ATTEMPTS} verifications in a row: \
         verify again when it is quieter, or with its writer stopped"
    )))
}

/// One verification of `stream` at the checkpoint `info` names.
async fn verify_once(
    info: StreamInfo,
    source: Arc<Source>,
    stream: &str,
    client: &Client,
    max_differences: usize,
) -> Result<Verification> {
    let not = |detail: String| Error::NotVerifiable {
        stream: stream.to_string(),
        detail,
    };
    let checkpoint = match (info.phase, info.checkpoint) {
        (SyncPhase::Synced, Some(cp)) => cp,
        (phase, _) => {
            return Err(not(format!(
                "it is {phase:?}, not synced: only a synced stream equals the server at \
                 a resourceVersion (run its watcher until it is ready)"
            )));
        }
    };
    let resource = api_resource(&info.url, &info.api_version, &info.kind)
        .ok_or_else(|| not(format!("its collection URL {:?} does not parse", info.url)))?;
    let api = match &resource.1 {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &resource.0),
        None => Api::all_with(client.clone(), &resource.0),
    };
    let target = VerifyTarget {
        api,
        url: info.url.clone(),
        labels: info.label_selector,
        fields: info.field_selector,
        shard: info.shard,
        source,
        max: max_differences,
    };
    tracing::info!(stream, checkpoint = %checkpoint, url = %target.url, "verifying");
    let now = target.compare_now().await?;
    tracing::info!(
        stream,
        differences = now.count,
        server_rv = %now.list_rv,
        "compared with the server's current state"
    );
    let (verdict, decided_by) = if now.count == 0 {
        (Verdict::Equal, now)
    } else {
        match target.compare(At::Exactly(&checkpoint)).await? {
            Some(at_cp) if at_cp.count == 0 => (
                Verdict::Behind {
                    server_resource_version: now.list_rv.clone(),
                },
                Comparison {
                    server_objects: at_cp.server_objects,
                    ..now
                },
            ),
            Some(at_cp) => (Verdict::Differs, at_cp),
            None => (
                Verdict::Undecided {
                    server_resource_version: now.list_rv.clone(),
                },
                now,
            ),
        }
    };
    Ok(Verification {
        stream: stream.to_string(),
        checkpoint,
        stored_objects: decided_by.stored_objects,
        counted_objects: info.objects,
        server_objects: decided_by.server_objects,
        verdict,
        difference_count: decided_by.count,
        differences: decided_by.differences,
    })
}

impl VerifyTarget {
    /// Compare with the current state, listing again if a continue token expires.
    async fn compare_now(&self) -> Result<Comparison> {
        for attempt in 1..=LIST_ATTEMPTS {
            if let Some(c) = self.compare(At::Now).await? {
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
    async fn compare(&self, at: At<'_>) -> Result<Option<Comparison>> {
        let mut seen: HashSet<u128> = HashSet::new();
        let mut c = Comparison {
            list_rv: String::new(),
            server_objects: 0,
            stored_objects: 0,
            count: 0,
            differences: Vec::new(),
        };
        let mut token: Option<String> = None;
        loop {
            let selectors = list::Selectors {
                labels: self.labels.as_deref(),
                fields: self.fields.as_deref(),
            };
            let from = match (&token, at) {
                (Some(t), _) => list::From::Continue(t),
                (None, At::Exactly(rv)) => list::From::Exactly(rv),
                (None, At::Now) => list::From::Now,
            };
            let lp = list::params(selectors, PAGE, from);
            let page = match self.api.list_metadata(&lp).await {
                Ok(page) => page,
                Err(kube::Error::Api(s)) if StatusKind::of(s.code, false) == StatusKind::Gone => {
                    return Ok(None);
                }
                Err(source) => {
                    return Err(Error::Kube {
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
            let listed: Vec<(Vec<u8>, String)> = page
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
                    (suffix, m.resource_version.unwrap_or_default())
                })
                .collect();
            for (suffix, _) in &listed {
                seen.insert(digest(suffix));
            }
            c.server_objects += listed.len() as u64;
            let (source, max) = (self.source.clone(), self.max);
            c = blocking(move || source.read(|v| compare_page(v, &listed, c, max))).await?;
            token = page.metadata.continue_.filter(|t| !t.is_empty());
            if token.is_none() {
                break;
            }
        }
        let (source, max) = (self.source.clone(), self.max);
        blocking(move || source.read(|v| find_extra(v, &seen, c, max)))
            .await
            .map(Some)
    }
}

/// Look up one page of listed objects in the store.
fn compare_page(
    versions: &StoredVersions,
    listed: &[(Vec<u8>, String)],
    mut c: Comparison,
    max: usize,
) -> Result<Comparison> {
    let suffixes: Vec<&[u8]> = listed.iter().map(|(suffix, _)| suffix.as_slice()).collect();
    let stored = versions.get(&suffixes)?;
    for ((suffix, server), stored) in listed.iter().zip(stored) {
        let key = keys::display(suffix);
        match stored {
            None => c.note(
                Difference::Missing {
                    key,
                    server: server.clone(),
                },
                max,
            ),
            Some(stored) if stored != *server => c.note(
                Difference::Version {
                    key,
                    stored,
                    server: server.clone(),
                },
                max,
            ),
            Some(_) => {}
        }
    }
    Ok(c)
}

/// Scan the store for objects the list did not contain.
fn find_extra(
    versions: &StoredVersions,
    seen: &HashSet<u128>,
    mut c: Comparison,
    max: usize,
) -> Result<Comparison> {
    versions.each(|suffix, stored| {
        c.stored_objects += 1;
        if !seen.contains(&digest(suffix)) {
            let key = keys::display(suffix);
            c.note(Difference::Extra { key, stored }, max);
        }
    })?;
    Ok(c)
}

/// A 128-bit digest of an object key: collisions are out of reach (2^-64 at 10^9 keys).
fn digest(suffix: &[u8]) -> u128 {
    let d = Sha256::digest(suffix);
    u128::from_le_bytes(d[..16].try_into().unwrap_or_default())
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Protocol {
            context: "verifying a stream".into(),
            detail: format!("a disk task failed: {e}"),
        })?
}

/// The API resource and namespace of a collection URL (`/api/v1/namespaces/ns/pods`,
/// `/apis/apps/v1/deployments`).
fn api_resource(url: &str, api_version: &str, kind: &str) -> Option<(ApiResource, Option<String>)> {
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
        let mut c = Comparison {
            list_rv: "1".into(),
            server_objects: 0,
            stored_objects: 0,
            count: 0,
            differences: Vec::new(),
        };
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
}
