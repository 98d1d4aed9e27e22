//! Shared streams: one watch feeding several consumers in one process (several
//! controllers, or a controller and the user's own event loop), each with its own queue.
//!
//! [`Watcher::shared`] turns a watcher into a [`SharedWatcher`]; each
//! [`SharedWatcher::subscribe`] is a [`Subscriber`], a stream of [`SharedEvent`]s with a
//! queue of its own. [`SharedWatcher::run`] drives the one watch and hands every event, once
//! it is on disk, to every subscriber.
//!
//! Back-pressure, bounded. Each event is offered to every subscriber at once, and waits for
//! the ones whose queue is full together, until one deadline: a subscriber's queue may stay
//! full for at most [`SharedWatcher::max_stall`] (1 s by default) in a row, across events,
//! before that subscriber is *lagged*. The events it cannot take are then dropped for it
//! alone (the others go on), and once it has taken everything queued for it, it receives
//! [`SharedEvent::Lagged`], after every event it did get and before any later one, then the
//! start signal (`InitDone` or `Resumed`) if that was among the dropped events: the start
//! signal always arrives. Nothing is lost: every dropped event was on disk before it was
//! dropped, so a subscriber that reads the store again when it sees `Lagged` (a controller
//! reconciles what changed, or every object) has all of it.
//!
//! The bound that holds: the watch waits at most `max_stall` per event, whatever the number
//! of subscribers; a subscriber holds it at most `max_stall` in a row, and after a lag is
//! not waited for again until its queue is empty. So a subscriber slower than the watch
//! costs it at most `max_stall` per `buffer` events that subscriber takes. A dropped
//! subscriber is forgotten.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::task::AtomicWaker;
use futures::{Stream, StreamExt};
use kube::Resource;
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TrySendError;
use tokio::time::Instant;
use tracing::Instrument;

use super::watcher::{Event, Watcher};
use crate::model::{Error, Result};

/// What a [`Subscriber`] receives.
#[derive(Debug)]
#[non_exhaustive]
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

/// Whether the hub hands a subscriber its events.
enum Delivery<K> {
    /// Every event goes into its queue.
    Live,
    /// Its queue stayed full too long: events are dropped for it until it has taken
    /// everything queued, then it is told ([`SharedEvent::Lagged`]) and is live again.
    Lagged {
        /// The start signal, if it came while lagged: delivered right after `Lagged`.
        start: Option<Arc<Event<K>>>,
    },
}

/// What the hub and one subscriber share: the delivery state (changed by the hub from live
/// to lagged, by the subscriber back to live), and the subscriber's waker, woken when it is
/// lagged (its queue may be empty already).
struct Link<K> {
    delivery: Mutex<Delivery<K>>,
    waker: AtomicWaker,
}

/// One subscriber, as the hub sees it.
struct Sub<K> {
    tx: mpsc::Sender<Item<K>>,
    link: Arc<Link<K>>,
    /// Since when its queue has been full, without a break, when events came for it.
    full_since: Option<Instant>,
}

impl<K> Sub<K> {
    /// Lags this subscriber: later events are dropped for it (the start signal kept).
    fn lag(&mut self, item: &Item<K>, max_stall: Duration) {
        tracing::warn!(
            stall_ms = max_stall.as_millis() as u64,
            "a subscriber of a shared stream is lagged: it will read the store again"
        );
        self.full_since = None;
        *lock(&self.link.delivery) = Delivery::Lagged {
            start: start_signal(item),
        };
        self.link.waker.wake();
    }
}

/// The event, if it is the start signal (`InitDone`, or `Resumed`).
fn start_signal<K>(item: &Item<K>) -> Option<Arc<Event<K>>> {
    match item {
        Ok(SharedEvent::Event(ev)) if matches!(**ev, Event::Resumed { .. } | Event::InitDone) => {
            Some(ev.clone())
        }
        _ => None,
    }
}

struct Hub<K> {
    subs: Mutex<Vec<Sub<K>>>,
    buffer: usize,
}

/// One watch, several consumers (from [`Watcher::shared`]). A subscriber whose queue stays
/// full for [`SharedWatcher::max_stall`] (across events) is lagged: it misses events (all on
/// disk) and gets [`SharedEvent::Lagged`] once it has taken what was queued for it, then the
/// start signal if it missed it.
///
/// The bound: the watch waits at most `max_stall` per event, for all subscribers together;
/// a subscriber holds it at most `max_stall` in a row, and after a lag is not waited for
/// again until its queue is empty, so a subscriber slower than the watch costs it at most
/// `max_stall` per `buffer` events that subscriber takes.
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
/// let (reader, watcher) = db.store("pods", kube::Api::<Pod>::all(server.client()), kube_persist::StreamConfig::default())?;
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
            .field("path", &self.watcher.path())
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
    /// How long a subscriber's queue may stay full, across events, holding the watch (and
    /// so the other subscribers), before it is lagged (default 1 s). It is also the longest
    /// the watch waits for one event, whatever the number of subscribers.
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

    /// A new consumer of the shared watch; it receives every event from the start.
    ///
    /// ```
    /// # fn demo(watcher: kube_persist::Watcher<k8s_openapi::api::core::v1::Pod>) {
    /// let shared = watcher.shared(1024);
    /// let (controller_a, controller_b) = (shared.subscribe(), shared.subscribe());
    /// # drop((shared, controller_a, controller_b)); }
    /// ```
    pub fn subscribe(&self) -> Subscriber<K> {
        let (tx, rx) = mpsc::channel(self.hub.buffer);
        let link = Arc::new(Link {
            delivery: Mutex::new(Delivery::Live),
            waker: AtomicWaker::new(),
        });
        lock(&self.hub.subs).push(Sub {
            tx,
            link: link.clone(),
            full_since: None,
        });
        Subscriber {
            dir: self.watcher.dir().clone(),
            told: VecDeque::new(),
            rx,
            link,
        }
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
        // A lagged subscriber's warning names the stream and directory.
        let span = tracing::info_span!(
            "shared",
            stream = %watcher.reader.stream_name(),
            dir = %watcher.path().display()
        );
        let mut events = std::pin::pin!(watcher.stream());
        while let Some(item) = events.next().instrument(span.clone()).await {
            let item: Item<K> = match item {
                Ok(ev) => Ok(SharedEvent::Event(Arc::new(ev))),
                Err(e) => Err(Error::Shared(Arc::new(e))),
            };
            let mut subs = std::mem::take(&mut *lock(&hub.subs));
            deliver(&mut subs, &item, max_stall)
                .instrument(span.clone())
                .await;
            subs.retain(|s| !s.tx.is_closed());
            *lock(&hub.subs) = subs;
        }
    }
}

/// Hands `item` to every subscriber: at once where there is room, else waiting for the
/// full queues together until each one's deadline (its full streak's start + `max_stall`,
/// so never past `max_stall` from now), lagging those still full then.
async fn deliver<K: Send + Sync + 'static>(
    subs: &mut [Sub<K>],
    item: &Item<K>,
    max_stall: Duration,
) {
    let now = Instant::now();
    let mut full = Vec::new();
    for sub in subs.iter_mut() {
        if let Delivery::Lagged { start } = &mut *lock(&sub.link.delivery) {
            // Dropped for it; the start signal is kept for after its `Lagged`.
            if let Some(ev) = start_signal(item) {
                *start = Some(ev);
            }
            continue;
        }
        match sub.tx.try_send(clone_item(item)) {
            Ok(()) => sub.full_since = None,
            Err(TrySendError::Closed(_)) => {}
            Err(TrySendError::Full(_)) => full.push(sub),
        }
    }
    let waits = full.into_iter().map(|sub| async move {
        let deadline = *sub.full_since.get_or_insert(now) + max_stall;
        match tokio::time::timeout_at(deadline, sub.tx.send(clone_item(item))).await {
            // Taken, or gone: a queue full again at the next event continues the streak.
            Ok(_) => {}
            Err(_) => sub.lag(item, max_stall),
        }
    });
    futures::future::join_all(waits).await;
}

fn clone_item<K>(item: &Item<K>) -> Item<K> {
    match item {
        Ok(ev) => Ok(ev.clone()),
        Err(Error::Shared(e)) => Err(Error::Shared(e.clone())),
        // Never: each error is made shared before it is sent (`SharedWatcher::run`).
        Err(e) => Err(Error::Shared(Arc::new(Error::Internal {
            detail: format!("an error of a shared watch was not shared: {e}"),
        }))),
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
    /// The store directory (a controller on this subscriber keeps its state there).
    dir: crate::store::Dir,
    /// `Lagged` and the start signal, once told.
    told: VecDeque<Item<K>>,
    rx: mpsc::Receiver<Item<K>>,
    link: Arc<Link<K>>,
}

impl<K> Subscriber<K> {
    /// The store directory's handle.
    pub(crate) fn dir(&self) -> &crate::store::Dir {
        &self.dir
    }
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
        let this = &mut *self;
        if let Some(item) = this.told.pop_front() {
            return Poll::Ready(Some(item));
        }
        if let Poll::Ready(item) = this.rx.poll_recv(cx) {
            return Poll::Ready(item);
        }
        this.link.waker.register(cx.waker());
        let mut delivery = lock(&this.link.delivery);
        if matches!(*delivery, Delivery::Live) {
            return Poll::Pending;
        }
        // The hub sends nothing while this is lagged: what is queued came before the lag.
        if let Ok(item) = this.rx.try_recv() {
            return Poll::Ready(Some(item));
        }
        let Delivery::Lagged { start } = &mut *delivery else {
            return Poll::Pending;
        };
        if let Some(start) = start.take() {
            this.told.push_back(Ok(SharedEvent::Event(start)));
        }
        *delivery = Delivery::Live;
        drop(delivery);
        Poll::Ready(Some(Ok(SharedEvent::Lagged)))
    }
}
