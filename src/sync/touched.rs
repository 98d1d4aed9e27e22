//! The persistent watcher's object streams in kube-runtime's shapes: `applied_objects` and
//! `touched_objects` yield `Result<K, watcher::Error>`, so that kube-runtime's
//! `WatchStreamExt` helpers (`predicate_filter`, `modify`, ...) and its controller
//! machinery (`trigger_owners`, `Controller::owns_stream`) take them as they are.

use futures::{Stream, StreamExt};
use kube::Resource;
use kube::core::Status;
use kube::runtime::watcher;
use serde::de::DeserializeOwned;

use super::watcher::{Event, Watcher};
use crate::model::{Error, RequestKind};

impl<K> Watcher<K>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
{
    /// The objects created or changed, as kube-runtime's `WatchStreamExt::applied_objects`
    /// gives them: the objects of the first list and of every later change, each once it is
    /// on disk, with errors as kube-runtime's [`watcher::Error`] (mapped by
    /// [`to_watcher_error`](crate::controller::to_watcher_error)), so that kube-runtime's
    /// stream helpers compose with it: `.predicate_filter(predicates::generation, ..)`,
    /// `.modify(..)`. Deletions and the start signals are left out. Errors are
    /// informational: the watcher retries with its own backoff and the stream goes on. A
    /// warm restart yields nothing for the stored objects (they were yielded before the
    /// restart); [`Watcher::kube_events`] replays them.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let client = server.client();
    /// use futures::TryStreamExt;
    /// use k8s_openapi::api::core::v1::Pod;
    /// use kube::runtime::{WatchStreamExt, predicates};
    /// let (reader, watcher) = db.store("pods", kube::Api::<Pod>::all(client), kube_persist::StreamConfig::default())?;
    /// let pods = watcher
    ///     .applied_objects()
    ///     .predicate_filter(predicates::resource_version, Default::default());
    /// let mut pods = std::pin::pin!(pods);
    /// let first = pods.try_next().await?.expect("an object of the first list");
    /// assert!(first.metadata.name.as_deref().unwrap().starts_with("web-"));
    /// # Ok(()) }
    /// ```
    pub fn applied_objects(self) -> impl Stream<Item = Result<K, watcher::Error>> + Send {
        self.stream().filter_map(|ev| {
            futures::future::ready(match ev {
                Ok(Event::Apply(o) | Event::InitApply(o)) => Some(Ok(o)),
                Ok(_) => None,
                Err(e) => Some(Err(to_watcher_error(e))),
            })
        })
    }

    /// The objects this watcher touches (created, changed, listed or deleted), with errors
    /// as kube-runtime's [`watcher::Error`]: a trigger stream for kube-runtime's controller
    /// machinery, like `WatchStreamExt::touched_objects` on kube-runtime's watcher. Feed it
    /// to `trigger_owners` / `trigger_with` and kube-runtime's `applier` (below), or to
    /// `Controller::owns_stream` / `watches_stream` (kube 5.0 gates those behind its
    /// `unstable-runtime` feature).
    ///
    /// The watcher keeps its store on disk up to date as it goes; read it through the
    /// [`Reader`](crate::Reader) from your reconciler.
    ///
    /// What is (not) yielded:
    /// - `Apply`, `InitApply` and `Delete` events yield their object;
    /// - a warm restart ([`Event::Resumed`](crate::Event::Resumed)) yields nothing: the
    ///   in-memory main kind is listed again at start and reconciled in full anyway, and the
    ///   watch resumes from the checkpoint and yields every change made while the process
    ///   was down;
    /// - a relist after `410 Gone` yields only the objects that changed or disappeared.
    ///
    /// Errors are mapped by [`to_watcher_error`](crate::controller::to_watcher_error) (see there). They
    /// are informational: the persistent watcher retries with its own jittered backoff and
    /// the stream goes on (kube-runtime reports them as `controller::Error::QueueError`).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::{sync::Arc, time::Duration};
    /// use futures::{StreamExt, stream};
    /// use k8s_openapi::api::{apps::v1::ReplicaSet, core::v1::Pod};
    /// use kube::{Api, Client};
    /// use kube::runtime::{WatchStreamExt, applier, reflector, watcher};
    /// use kube::runtime::controller::{Action, Config, trigger_owners, trigger_self};
    ///
    /// let client = Client::try_default().await?;
    /// let db = kube_persist::Db::open("/var/lib/my-controller/cache")?;
    /// // The big kind on disk ...
    /// let (pods, pod_watcher) = db.store("pods", Api::<Pod>::all(client.clone()), kube_persist::StreamConfig::default())?;
    /// // ... the main kind in kube-runtime's in-memory store, as before.
    /// let (store, writer) = reflector::store::<ReplicaSet>();
    /// let replicasets = watcher(Api::<ReplicaSet>::all(client), watcher::Config::default()).default_backoff();
    /// let queue = stream::select(
    ///     trigger_self(reflector(writer, replicasets).applied_objects(), ()),
    ///     trigger_owners(pod_watcher.touched_objects(), (), ()),
    /// );
    /// applier(
    ///     |rs: Arc<ReplicaSet>, pods: Arc<kube_persist::Reader<Pod>>| Box::pin(async move {
    ///         let ns = rs.metadata.namespace.clone().unwrap_or_default();
    ///         // The async scan: the disk is read on the blocking pool, not in the applier.
    ///         println!("{} pods in {ns}", pods.iter_namespace_stream(&ns).count().await);
    ///         Ok::<_, kube_persist::Error>(Action::await_change())
    ///     }),
    ///     |_, _, _| Action::requeue(Duration::from_secs(5)),
    ///     Arc::new(pods),
    ///     store,
    ///     queue,
    ///     Config::default(),
    /// )
    /// .for_each(|_| async {})
    /// .await;
    /// # Ok(()) }
    /// ```
    pub fn touched_objects(self) -> impl Stream<Item = Result<K, watcher::Error>> + Send {
        self.stream().filter_map(|ev| {
            futures::future::ready(match ev {
                Ok(Event::Apply(o) | Event::InitApply(o) | Event::Delete(o)) => Some(Ok(o)),
                // No object to yield: a key without its body, and the markers.
                Ok(Event::Resumed { .. } | Event::Init | Event::InitDone | Event::DeleteKey(_)) => {
                    None
                }
                Err(e) => Some(Err(to_watcher_error(e))),
            })
        })
    }
}

/// Maps a kube-persist [`Error`] to kube-runtime's [`watcher::Error`], whose variants only
/// describe API calls. The mapping keeps every detail reachable:
///
/// | kube-persist | kube-runtime |
/// |---|---|
/// | [`Error::WatchStatus`] (an `ERROR` event on the watch) | `WatchError(Status)` with its code, reason and message |
/// | [`Error::Kube`] with [`RequestKind::List`] | `InitialListFailed(source)` (also for relists, continued lists and a delta relist's fetches) |
/// | [`Error::Kube`] with [`RequestKind::Watch`] | `WatchFailed(source)` (connecting and streaming are not told apart; a watch-list too) |
/// | anything else: the store (`Locked`, `Corrupt`, `DiskFull`, `Io`, `Storage`, `Decode`, ...), a malformed answer (`Protocol`), an invalid setting (`InvalidArgument`), a refused shard (`ShardRefused`), ... | `WatchFailed(kube::Error::Service(original))` |
///
/// In the last row the original error is the source of the `kube::Error`: downcast it to
/// get it back. kube-runtime's `NoResourceVersion` and `WatchStartFailed` are never used.
///
/// ```
/// use std::error::Error as _;
/// use kube::runtime::watcher;
/// use kube_persist::{Error, controller::to_watcher_error};
///
/// let unknown = "rocksdb".parse::<kube_persist::Engine>().unwrap_err();
/// let e = to_watcher_error(unknown);
/// let original = match &e {
///     watcher::Error::WatchFailed(kube::Error::Service(inner)) => inner.downcast_ref::<Error>(),
///     _ => None,
/// };
/// assert!(matches!(original, Some(Error::UnknownEngine { name, .. }) if name == "rocksdb"));
/// assert!(e.source().is_some());
/// ```
pub fn to_watcher_error(err: Error) -> watcher::Error {
    match err {
        Error::WatchStatus {
            code,
            reason,
            message,
            ..
        } => {
            let status = Status::failure(&message, &reason).with_code(code);
            watcher::Error::WatchError(Box::new(status))
        }
        Error::Kube {
            request: RequestKind::List,
            source,
            ..
        } => watcher::Error::InitialListFailed(source),
        Error::Kube { source, .. } => watcher::Error::WatchFailed(source),
        other => watcher::Error::WatchFailed(kube::Error::Service(Box::new(other))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_each_kind_of_error() {
        let e = to_watcher_error(Error::WatchStatus {
            url: "/api/v1/pods".into(),
            resource_version: "7".into(),
            code: 500,
            reason: "InternalError".into(),
            message: "etcd down".into(),
        });
        match e {
            watcher::Error::WatchError(s) => {
                assert_eq!(
                    (s.code, s.reason.as_str(), s.message.as_str()),
                    (500, "InternalError", "etcd down")
                );
            }
            other => panic!("{other:?}"),
        }
        let api = || kube::Error::Api(Box::new(Status::failure("no", "Forbidden").with_code(403)));
        let list = Error::Kube {
            request: RequestKind::List,
            context: "LIST /api/v1/pods (continue: false)".into(),
            source: api(),
        };
        assert!(
            matches!(to_watcher_error(list), watcher::Error::InitialListFailed(kube::Error::Api(s)) if s.code == 403)
        );
        let watch = Error::Kube {
            request: RequestKind::Watch,
            context: "WATCH /api/v1/pods from resourceVersion \"7\"".into(),
            source: api(),
        };
        assert!(
            matches!(to_watcher_error(watch), watcher::Error::WatchFailed(kube::Error::Api(s)) if s.code == 403)
        );
        // By the request's kind, not by the words of its context: a verification's LIST
        // ("listing ... to verify it") and a delta relist's fetch are LISTs too.
        let verify = Error::Kube {
            request: RequestKind::List,
            context: "listing /api/v1/pods to verify it".into(),
            source: api(),
        };
        assert!(matches!(
            to_watcher_error(verify),
            watcher::Error::InitialListFailed(_)
        ));
        let worded_like_a_list = Error::Kube {
            request: RequestKind::Watch,
            context: "LIST-shaped words of a WATCH".into(),
            source: api(),
        };
        assert!(matches!(
            to_watcher_error(worded_like_a_list),
            watcher::Error::WatchFailed(kube::Error::Api(_))
        ));
        let refused = to_watcher_error(Error::ShardRefused {
            message: "invalid shard selector: x".into(),
        });
        assert!(matches!(
            refused,
            watcher::Error::WatchFailed(kube::Error::Service(inner))
                if matches!(inner.downcast_ref::<Error>(), Some(Error::ShardRefused { .. }))
        ));
        let disk = to_watcher_error(Error::DiskFull { path: "/x".into() });
        match disk {
            watcher::Error::WatchFailed(kube::Error::Service(inner)) => {
                assert!(matches!(
                    inner.downcast_ref::<Error>(),
                    Some(Error::DiskFull { .. })
                ));
            }
            other => panic!("{other:?}"),
        }
    }
}
