//! The persistent watcher as a stream of kube-runtime's own `watcher::Event`s, so that a
//! port keeps kube-runtime's stream code (`.default_backoff()`, `.modify(..)`,
//! `.reflect(writer)`, `.applied_objects()`, `.predicate_filter(..)`) and can keep a small
//! in-memory index (kube-runtime's `reflector::Store`) beside the store on disk.
//!
//! kube-runtime's watcher starts every (re)list with `Init`, the listed objects as
//! `InitApply` and `InitDone`, and a reflector rebuilds its store from them. The persistent
//! watcher's first list maps one to one. A warm restart has no list (the watch resumes from
//! the checkpoint): the stored objects are replayed from disk as `Init`, `InitApply`..,
//! `InitDone`, read in chunks on the blocking pool while the watch waits (so the replay is
//! the state at the checkpoint, and the changes since follow it). A relist after
//! `410 Gone` yields exact changes (`Apply`, `Delete`), which a reflector applies as they
//! are. A deletion whose object does not decode (`Event::DeleteKey`) carries no object for
//! `Delete`: the store is replayed instead, without it.

use std::sync::Arc;
use std::time::Duration;

use futures::stream::{self, BoxStream};
use futures::{Stream, StreamExt};
use kube::Resource;
use kube::runtime::watcher;
use serde::de::DeserializeOwned;

use super::to_watcher_error;
use super::watcher::{Event, Watcher};
use crate::store::Reader;

/// First and last wait before a replay that failed to read the store starts over.
const REPLAY_RETRY: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(30));

impl<K> Watcher<K>
where
    K: Resource + Clone + DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Send + Sync,
{
    /// The store's changes as kube-runtime's [`watcher::Event`]s, with errors as its
    /// [`watcher::Error`]: the persistent counterpart of `kube::runtime::watcher(api, wc)`,
    /// for kube-runtime's `WatchStreamExt` helpers as they are. The watcher keeps the store
    /// on disk up to date as it goes (each event is yielded once it is on disk).
    ///
    /// - The first list of an empty store: `Init`, `InitApply` for each object, `InitDone`.
    /// - A warm restart (the watch resumes from the checkpoint, no list): the stored objects
    ///   replayed from disk as `Init`, `InitApply`.., `InitDone`, so that a reflector fed by
    ///   this stream holds every object after a restart as after a list.
    /// - Changes: `Apply` and `Delete`; a relist after `410 Gone` yields only the changes it
    ///   found. A deletion whose last state does not decode (a keys-only stream, another
    ///   schema) replays the store instead.
    /// - Errors are informational: the watcher retries with its own jittered backoff, and
    ///   the stream goes on (`default_backoff()` may be added as with kube-runtime; it adds
    ///   its wait after each error).
    ///
    /// A keys-only stream has no bodies to replay: a warm restart yields one error instead.
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
    /// use kube::ResourceExt;
    /// use kube::runtime::{WatchStreamExt, reflector};
    /// let (_disk, watcher) = db.store("pods", kube::Api::<Pod>::all(client), kube_persist::StreamConfig::default())?;
    /// // A small in-memory index beside the store on disk: the names only.
    /// let (names, writer) = reflector::store::<Pod>();
    /// let stream = watcher
    ///     .kube_events()
    ///     .modify(|pod| pod.spec = None)
    ///     .reflect(writer)
    ///     .applied_objects();
    /// tokio::spawn(stream.try_for_each(|_| async { Ok(()) }));
    /// names.wait_until_ready().await?;
    /// assert_eq!(names.state().len(), 2);
    /// # Ok(()) }
    /// ```
    pub fn kube_events(
        self,
    ) -> impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send {
        let reader = self.reader.clone();
        self.stream().flat_map(move |ev| match ev {
            Ok(Event::Init) => one(Ok(watcher::Event::Init)),
            Ok(Event::InitApply(o)) => one(Ok(watcher::Event::InitApply(o))),
            Ok(Event::InitDone) => one(Ok(watcher::Event::InitDone)),
            Ok(Event::Apply(o)) => one(Ok(watcher::Event::Apply(o))),
            Ok(Event::Delete(o)) => one(Ok(watcher::Event::Delete(o))),
            Ok(Event::Resumed { .. } | Event::DeleteKey(_)) => replay(reader.clone()),
            Err(e) => one(Err(to_watcher_error(e))),
        })
    }
}

type Item<K> = Result<watcher::Event<K>, watcher::Error>;

fn one<K: Send + 'static>(item: Item<K>) -> BoxStream<'static, Item<K>> {
    stream::once(futures::future::ready(item)).boxed()
}

/// Where a replay is.
enum Replay<K> {
    /// About to start (again, after `wait`).
    Start {
        wait: Duration,
    },
    /// Reading the stored objects.
    Reading {
        objects: BoxStream<'static, crate::model::Result<Arc<K>>>,
        wait: Duration,
    },
    Done,
}

/// The stored objects as `Init`, `InitApply`.., `InitDone`. A failed read yields its error
/// and starts the replay over (after a growing wait): a reflector never gets `InitDone` for
/// a partial set.
fn replay<K>(reader: Reader<K>) -> BoxStream<'static, Item<K>>
where
    K: Resource + Clone + DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Send + Sync,
{
    if let Err(e) = reader.bodies() {
        // A keys-only stream stores no objects to replay.
        return one(Err(to_watcher_error(e)));
    }
    let first = Replay::Start {
        wait: Duration::ZERO,
    };
    stream::unfold((first, reader), |(state, reader)| async move {
        match state {
            Replay::Done => None,
            Replay::Start { wait } => {
                if !wait.is_zero() {
                    tokio::time::sleep(wait).await;
                }
                let objects = reader.iter_stream();
                Some((
                    Ok(watcher::Event::Init),
                    (Replay::Reading { objects, wait }, reader),
                ))
            }
            Replay::Reading { mut objects, wait } => match objects.next().await {
                Some(Ok(obj)) => Some((
                    Ok(watcher::Event::InitApply(Arc::unwrap_or_clone(obj))),
                    (Replay::Reading { objects, wait }, reader),
                )),
                None => Some((Ok(watcher::Event::InitDone), (Replay::Done, reader))),
                Some(Err(e)) => {
                    tracing::warn!(stream = %reader.stream_name(), dir = %reader.path().display(), error = %e,
                        "replay of the stored objects failed, starting it over");
                    let wait = (wait * 2).clamp(REPLAY_RETRY.0, REPLAY_RETRY.1);
                    Some((Err(to_watcher_error(e)), (Replay::Start { wait }, reader)))
                }
            },
        }
    })
    .boxed()
}
