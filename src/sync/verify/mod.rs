//! Compare a stored stream with the collection on the server: [`Db::verify`](crate::Db::verify).
//!
//! The store claims to equal the server's collection at its checkpoint. To check that
//! claim the collection is listed (paginated, metadata only, with the stream's own
//! selectors) and compared object by object by key and resourceVersion. When the store
//! differs from the server's current state, the collection is listed again at the
//! checkpoint itself (`resourceVersionMatch=Exact`): a store that equals that list is
//! behind (the differences are changes newer than its checkpoint), not wrong.
//!
//! Two states of a correct store differ from the list at its checkpoint, and are not
//! reported as differences: the window of a delta relist, until its watch has replayed
//! past the bodies it fetched (`window.rs`), and a narrowed shard's prune under way (the
//! stored objects outside the shard, left for the prune). A store that moved during a
//! comparison (its writer runs) is verified again (`verify_with`).
//!
//! The files: this one, the report's types and the verification's steps; `compare.rs`, one
//! comparison with one list (where the store is read, how the collection is listed);
//! `window.rs`, what a delta relist's window explains.
//!
//! Memory: one page of the list at a time, plus a 16-byte digest per listed key (to find
//! stored objects the server no longer has), never the objects; while a delta relist's
//! window is open, also each difference from the current list.
//!
//! [`Db::verify_at`](crate::Db::verify_at) opens the store only for each read (one page's
//! lookups, the final scan) and closes it during the LISTs, so that a writer that needs the
//! store to itself is not kept from opening it.

mod compare;
mod window;

use std::path::Path;
use std::sync::Arc;

use kube::{Api, Client};

use crate::disk::DbConfig;
use crate::model::{Error, Result};
use crate::store::{Dir, StreamInfo, SyncPhase};
use compare::{At, Comparison, Source, VerifyTarget, WindowRole, api_resource, blocking};
use window::Window;

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
    /// (Equal but for what a delta relist's window explains,
    /// [`Verification::explained_by_delta_relist`].)
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
    /// Objects in the store (records on disk), those left for a prune
    /// ([`Verification::awaiting_prune`]) included.
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
    /// Stored objects outside the stream's shard that the prune of a narrowed shard (the
    /// stream reopened with a [`StreamConfig::shard`](crate::StreamConfig::shard) inside
    /// its stored one) has not removed yet. They are not differences: the prune removes
    /// them from disk without a LIST and the stream's readers are not ready until it is
    /// done. Counted in [`Verification::stored_objects`] and
    /// [`Verification::counted_objects`], not in [`Verification::server_objects`].
    pub awaiting_prune: u64,
    /// Objects that differ from the list at the checkpoint only as a delta relist
    /// ([`RelistMode`](crate::RelistMode)) leaves them until its watch has replayed past
    /// the bodies it fetched: stored newer than the checkpoint (but not newer than the
    /// server's current object), or deleted on the server between the relist's list and
    /// its fetch (and no longer there). Allowed only while the store marks that window
    /// open; not counted in [`Verification::difference_count`].
    pub explained_by_delta_relist: u64,
}

impl Verification {
    /// Whether the store is correct: equal to the server, or behind it only by changes
    /// newer than its checkpoint, with an object count equal to its records.
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
/// `kube-persist` tool) may change during the comparison, which then finds what is only
/// the store moving on: differences, or an object count (read before the comparison) that
/// is not the number of records (counted at its end). So a report that the store is wrong
/// ([`Verdict::Differs`], or a count unequal to the records) stands only when the stream's
/// state is the same after the comparison as before it: its checkpoint and count (every
/// batch that changes objects moves the checkpoint with them, a prune's batches the count),
/// its shard, whether a prune is under way and whether a delta relist's window is open.
/// Otherwise the stream is verified again, up to [`MOVING_ATTEMPTS`] times, and then
/// [`Error::NotVerifiable`].
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
        let before = info(&source)
            .await?
            .ok_or_else(|| not("the store holds no such stream".into()))?;
        let report = verify_once(
            before.clone(),
            source.clone(),
            stream,
            &client,
            max_differences,
        )
        .await?;
        if !says_wrong(&report) {
            return Ok(report);
        }
        let after = info(&source).await?;
        if after.as_ref() == Some(&before) {
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

/// Whether a report says the store is wrong: it differs from the server at its
/// checkpoint, or its object count is not the number of its records. (A store moving on
/// during the comparison shows both.)
fn says_wrong(report: &Verification) -> bool {
    report.verdict == Verdict::Differs || !report.count_consistent()
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
        pruning: info.pruning,
        source,
        max: max_differences,
    };
    let window = info.fetched_through.is_some();
    tracing::info!(stream, checkpoint = %checkpoint, url = %target.url, pruning = target.pruning,
        delta_relist_window = ?info.fetched_through, "verifying");
    let mut now = target
        .compare_now(if window {
            WindowRole::Record
        } else {
            WindowRole::Closed
        })
        .await?;
    tracing::info!(
        stream,
        differences = now.count,
        server_rv = %now.list_rv,
        "compared with the server's current state"
    );
    let (verdict, decided_by) = if now.count == 0 {
        (Verdict::Equal, now)
    } else {
        let role = if window {
            let recorded = std::mem::take(&mut now.recorded);
            let window = Window::new(checkpoint.clone(), now.list_rv.clone(), recorded);
            WindowRole::Explain(Arc::new(window))
        } else {
            WindowRole::Closed
        };
        match target.compare(At::Exactly(&checkpoint), role).await? {
            Some(at_cp) if at_cp.count == 0 => (
                Verdict::Behind {
                    server_resource_version: now.list_rv.clone(),
                },
                Comparison {
                    server_objects: at_cp.server_objects,
                    explained: at_cp.explained,
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
        awaiting_prune: decided_by.awaiting_prune,
        explained_by_delta_relist: decided_by.explained,
    })
}

#[cfg(test)]
mod tests;
