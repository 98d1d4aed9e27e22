//! Shared streams: one watch feeding several consumers in one process (several
//! controllers, or a controller and the user's own event loop), each with its own queue.
//!
//! [`Watcher::shared`] turns a watcher into a [`SharedWatcher`]; each
//! [`SharedWatcher::subscribe`] is a [`Subscriber`], a stream of [`SharedEvent`]s with a
//! queue of its own. [`SharedWatcher::run`] drives the one watch and hands every event, once
//! it is on disk, to every subscriber.
//!
//! Back-pressure, bounded: a subscriber whose queue is full holds the watch for at most
//! [`SharedWatcher::max_stall`] (1 s by default). Then it is *lagged*: the events it cannot
//! take are dropped for it alone (the others go on), and once its queue has room it
//! receives [`SharedEvent::Lagged`], after every event it did get and before any later
//! one. Nothing is lost: every dropped event was on disk before it was dropped, so a
//! subscriber that reads the store again when it sees `Lagged` (a controller reconciles
//! every object) has all of it. A subscriber stalls the others at most `max_stall` per
//! lag, never longer; a dropped subscriber is forgotten.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::{Stream, StreamExt};
use kube::Resource;
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::{SendTimeoutError, TrySendError};

use super::{Event, Watcher};
use crate::model::{Error, Result};

/// What a [`Subscriber`] receives.
#[derive(Debug)]
pub enum SharedEvent<K> {
    /// An event of the shared watch, shared by every subscriber.
    Event(Arc<Event<K>>),
    /// This subscriber fell behind and missed events, all of them on disk: read the store
    /// again (a controller reconciles every object).
    Lagged,
}

impl<K> Clone for SharedEvent<K> {
    fn clone(&self) -> Self {
        match self {
            SharedEvent::Event(ev) => SharedEvent::Event(ev.clone()),
            SharedEvent::Lagged => SharedEvent::Lagged,
        }
    }
}

type Item<K> = Result<SharedEvent<K>>;

/// One subscriber, as the hub sees it.
struct Sub<K> {
    tx: mpsc::Sender<Item<K>>,
    /// Events were dropped for it; cleared when [`SharedEvent::Lagged`] is in its queue.
    lagged: bool,
    /// Set by the task that queued the `Lagged` marker.
    marked: Arc<AtomicBool>,
}

struct Hub<K> {
    subs: Mutex<Vec<Sub<K>>>,
    /// The start signal (`Resumed` or `InitDone`), replayed to late subscribers.
    start: Mutex<Option<Arc<Event<K>>>>,
    buffer: usize,
}

/// One watch, several consumers (from [`Watcher::shared`]). A subscriber whose queue is
/// full holds the watch at most [`SharedWatcher::max_stall`], then is lagged: it misses
/// events (all on disk) and gets [`SharedEvent::Lagged`] once its queue has room.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
/// # let dir = tempfile::tempdir()?;
/// # let db = kube_persist::Db::open(dir.path())?;
/// use futures::StreamExt;
/// use k8s_openapi::api::core::v1::Pod;
/// use kube_persist::{Event, SharedEvent};
/// let (reader, watcher) = db.store("pods", kube::Api::<Pod>::all(server.client()), Default::default())?;
/// let shared = watcher.shared(1024);
/// let (mut a, mut b) = (shared.subscribe(), shared.subscribe());
/// tokio::spawn(shared.run());
/// for sub in [&mut a, &mut b] {
///     // Both see the same first list, from one LIST and one WATCH.
///     let first = sub.next().await.unwrap()?;
///     assert!(matches!(first, SharedEvent::Event(ev) if matches!(*ev, Event::Init)));
/// }
/// # Ok(()) }
/// ```
pub struct SharedWatcher<K> {
    watcher: Watcher<K>,
    hub: Arc<Hub<K>>,
    max_stall: Duration,
}

impl<K> std::fmt::Debug for SharedWatcher<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedWatcher")
            .field("path", &self.watcher.path)
            .field("buffer", &self.hub.buffer)
            .field("max_stall", &self.max_stall)
            .finish_non_exhaustive()
    }
}

impl<K> Watcher<K>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
{
    /// Share this watcher's one watch with several consumers, each with a queue of
    /// `buffer` events (at least 1); see [`SharedWatcher`].
    ///
    /// ```
    /// # fn demo(watcher: kube_persist::Watcher<k8s_openapi::api::core::v1::Pod>) {
    /// let shared = watcher.shared(1024);
    /// let events = shared.subscribe();
    /// tokio::spawn(shared.run());
    /// # drop(events); }
    /// ```
    pub fn shared(self, buffer: usize) -> SharedWatcher<K> {
        SharedWatcher {
            watcher: self,
            hub: Arc::new(Hub {
                subs: Mutex::new(Vec::new()),
                start: Mutex::new(None),
                buffer: buffer.max(1),
            }),
            max_stall: Duration::from_secs(1),
        }
    }
}

impl<K> SharedWatcher<K>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
{
    /// How long a subscriber with a full queue may hold the watch (and so the other
    /// subscribers) before it is lagged (default 1 s).
    ///
    /// ```
    /// # fn demo(watcher: kube_persist::Watcher<k8s_openapi::api::core::v1::Pod>) {
    /// let shared = watcher.shared(256).max_stall(std::time::Duration::from_millis(100));
    /// # drop(shared); }
    /// ```
    #[must_use]
    pub fn max_stall(mut self, d: Duration) -> Self {
        self.max_stall = d;
        self
    }

    /// A new consumer of the shared watch. A subscriber made after the watch started gets
    /// the start signal first (`Resumed` or `InitDone`), then [`SharedEvent::Lagged`]: the
    /// events before it subscribed are in the store.
    ///
    /// ```
    /// # fn demo(watcher: kube_persist::Watcher<k8s_openapi::api::core::v1::Pod>) {
    /// let shared = watcher.shared(1024);
    /// let (controller_a, controller_b) = (shared.subscribe(), shared.subscribe());
    /// # drop((shared, controller_a, controller_b)); }
    /// ```
    pub fn subscribe(&self) -> Subscriber<K> {
        let (tx, rx) = mpsc::channel(self.hub.buffer);
        let start = lock(&self.hub.start).clone();
        let late = start.is_some();
        lock(&self.hub.subs).push(Sub {
            tx,
            lagged: late,
            marked: Arc::new(AtomicBool::new(late)),
        });
        let mut replay = Vec::new();
        if let Some(start) = start {
            replay.push(Ok(SharedEvent::Event(start)));
            replay.push(Ok(SharedEvent::Lagged));
        }
        Subscriber { replay, rx }
    }

    /// Drive the shared watch: every event goes to every subscriber, once it is on disk.
    /// Spawn it. Ends when the watcher ends (a configuration the server refuses).
    ///
    /// ```
    /// # fn demo(watcher: kube_persist::Watcher<k8s_openapi::api::core::v1::Pod>) {
    /// let shared = watcher.shared(1024);
    /// let events = shared.subscribe();
    /// tokio::spawn(shared.run());
    /// # drop(events); }
    /// ```
    pub async fn run(self) {
        let SharedWatcher {
            watcher,
            hub,
            max_stall,
        } = self;
        let mut events = std::pin::pin!(watcher.stream());
        while let Some(item) = events.next().await {
            let item: Item<K> = match item {
                Ok(ev) => {
                    let ev = Arc::new(ev);
                    if matches!(*ev, Event::Resumed { .. } | Event::InitDone) {
                        *lock(&hub.start) = Some(ev.clone());
                    }
                    Ok(SharedEvent::Event(ev))
                }
                Err(e) => Err(Error::Shared(Arc::new(e))),
            };
            // Taken out of the lock while sending (a send may wait up to `max_stall`).
            let mut subs = std::mem::take(&mut *lock(&hub.subs));
            for sub in &mut subs {
                deliver(sub, &item, max_stall).await;
            }
            subs.retain(|s| !s.tx.is_closed());
            // Subscribers added meanwhile are kept after these.
            let mut now = lock(&hub.subs);
            subs.append(&mut now);
            *now = subs;
        }
    }
}

/// Hands `item` to one subscriber, waiting at most `max_stall` for room in its queue.
async fn deliver<K: Send + Sync + 'static>(sub: &mut Sub<K>, item: &Item<K>, max_stall: Duration) {
    if sub.lagged {
        if !sub.marked.load(Ordering::Acquire) {
            return; // dropped for it: the `Lagged` marker is not in its queue yet
        }
        sub.lagged = false;
    }
    match sub.tx.try_send(clone_item(item)) {
        Ok(()) | Err(TrySendError::Closed(_)) => return,
        Err(TrySendError::Full(_)) => {}
    }
    match sub.tx.send_timeout(clone_item(item), max_stall).await {
        Ok(()) | Err(SendTimeoutError::Closed(_)) => {}
        Err(SendTimeoutError::Timeout(_)) => {
            tracing::warn!(
                stall_ms = max_stall.as_millis() as u64,
                "a subscriber of a shared stream is lagged: it will read the store again"
            );
            sub.lagged = true;
            sub.marked.store(false, Ordering::Release);
            let (tx, marked) = (sub.tx.clone(), sub.marked.clone());
            // Queues the marker when there is room, without holding the watch.
            tokio::spawn(async move {
                if tx.send(Ok(SharedEvent::Lagged)).await.is_ok() {
                    marked.store(true, Ordering::Release);
                }
            });
        }
    }
}

fn clone_item<K>(item: &Item<K>) -> Item<K> {
    match item {
        Ok(ev) => Ok(ev.clone()),
        Err(Error::Shared(e)) => Err(Error::Shared(e.clone())),
        Err(e) => Err(Error::Config(e.to_string())),
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One consumer of a [`SharedWatcher`]: a stream of [`SharedEvent`]s (errors of the watch
/// as [`Error::Shared`]), with its own queue. Dropping it unsubscribes.
///
/// ```
/// # fn demo(watcher: kube_persist::Watcher<k8s_openapi::api::core::v1::Pod>) {
/// use futures::StreamExt;
/// let shared = watcher.shared(1024);
/// let mut events = shared.subscribe();
/// tokio::spawn(shared.run());
/// tokio::spawn(async move {
///     while let Some(event) = events.next().await {
///         println!("{event:?}");
///     }
/// });
/// # }
/// ```
pub struct Subscriber<K> {
    replay: Vec<Item<K>>,
    rx: mpsc::Receiver<Item<K>>,
}

impl<K> std::fmt::Debug for Subscriber<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscriber")
            .field("queued", &self.rx.len())
            .finish_non_exhaustive()
    }
}

impl<K> Stream for Subscriber<K> {
    type Item = Result<SharedEvent<K>>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Self::Item>> {
        if !self.replay.is_empty() {
            return Poll::Ready(Some(self.replay.remove(0)));
        }
        self.rx.poll_recv(cx)
    }
}
