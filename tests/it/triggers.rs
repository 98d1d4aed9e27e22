//! No trigger lost, no record forgotten: the controller where kube-runtime's scheduler
//! merges requests, the startup pass of a durable controller while objects come and go,
//! and read-your-writes on a server with opaque resourceVersions (issue 32, items 1-3).
//!
//! Each test reproduces a finding against the testkit over real HTTP, on redb on disk:
//! - a request that must run (`reconcile_on`) merged into a pending early requeue, then
//!   into its object's own handled update (whose reason the scheduler keeps), with the
//!   concurrency limit reached, is reconciled, not skipped as "already reconciled";
//! - a request dropped by the scheduler because a same-generation update of the object
//!   (the reconciler's own write) is pending is reconciled, not lost;
//! - the startup pass keeps the record of an object created and reconciled while it runs;
//! - `wait_for_resource_version` on opaque versions resolves on the awaited version, not
//!   on an older one the store applied meanwhile.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::{self, Fixture};
use futures::StreamExt;
use futures::channel::mpsc::{UnboundedSender, unbounded};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube_persist::Db;
use kube_persist::controller::{Config, Controller};
use kube_persist_testkit::{ResourceType, ServerHandle, ServerOptions, TestServer, Verb};
use tokio::sync::watch;

const HOUR: Duration = Duration::from_secs(3600);
/// A requeue inside the controller's requeue window (5 minutes): it waits in kube-runtime's
/// scheduler, where requests for its object merge into it.
const MINUTE: Duration = Duration::from_secs(60);
/// How long a trigger may take to be reconciled here: far less than [`MINUTE`].
const PROMPT: Duration = Duration::from_secs(20);

#[derive(Debug, thiserror::Error)]
#[error("never fails")]
pub(crate) struct Never;

/// A store that retries fast (the tests' servers fail on purpose).
pub(crate) fn store_cfg() -> kube_persist::StreamConfig {
    kube_persist::StreamConfig::default()
        .backoff(Duration::from_millis(20), Duration::from_millis(200))
        .relist_jitter(Duration::from_millis(10))
}

pub(crate) fn name_of(pod: &Pod) -> String {
    pod.metadata.name.clone().unwrap_or_default()
}

/// When each object's reconciles started and how many finished, and a gate that holds the
/// reconciles a test chooses until it is opened.
struct Book {
    started: Mutex<HashMap<String, Vec<Instant>>>,
    finished: Mutex<HashMap<String, usize>>,
    gate: watch::Sender<bool>,
}

impl Book {
    fn new() -> Arc<Self> {
        Arc::new(Book {
            started: Mutex::default(),
            finished: Mutex::default(),
            gate: watch::Sender::new(false),
        })
    }

    fn start(&self, name: &str) -> usize {
        let mut started = self.started.lock().unwrap();
        let times = started.entry(name.to_string()).or_default();
        times.push(Instant::now());
        times.len()
    }

    fn finish(&self, name: &str) {
        *self
            .finished
            .lock()
            .unwrap()
            .entry(name.to_string())
            .or_default() += 1;
    }

    fn started(&self, name: &str) -> usize {
        self.started.lock().unwrap().get(name).map_or(0, Vec::len)
    }

    fn finished(&self, name: &str) -> usize {
        self.finished
            .lock()
            .unwrap()
            .get(name)
            .copied()
            .unwrap_or(0)
    }

    async fn held(&self) {
        let mut rx = self.gate.subscribe();
        let _ = rx.wait_for(|open| *open).await;
    }

    fn open(&self) {
        self.gate.send_replace(true);
    }
}

fn pod_ref(ns: &str, name: &str) -> ObjectRef<Pod> {
    ObjectRef::new(name).within(ns)
}

/// Runs a controller's results on a task; errors are printed (a reconcile of a deleted
/// object is one, and expected).
fn spawn_run<S, T, E>(s: S) -> tokio::task::JoinHandle<()>
where
    S: futures::Stream<Item = Result<T, E>> + Send + 'static,
    E: std::fmt::Display,
{
    tokio::spawn(s.for_each(|r| {
        if let Err(e) = r {
            eprintln!("controller: {e}");
        }
        async {}
    }))
}

fn relabel(h: &ServerHandle, ns: &str, name: &str, value: &str) -> String {
    let rt = ResourceType::pods();
    let mut o = h.get(&rt, Some(ns), name).expect("pod exists");
    o["metadata"]["labels"]["touched"] = value.into();
    let written = h.apply(&rt, o);
    written["metadata"]["resourceVersion"]
        .as_str()
        .expect("written with a resourceVersion")
        .to_string()
}

/// Item 1a, made to fail without the runner's must-run mark (issue 50 item 8). A
/// `reconcile_on` request for an object with a pending `requeue(60 s)` is merged by
/// kube-runtime's scheduler into that requeue; then, within the debounce, the object's own
/// change of metadata (a label: the generation stays, so the `generation` predicate shows
/// it handled) is merged after it. kube-runtime 5.0's scheduler keeps the reason of the
/// request merged last (`schedule_message` replaces the key when the new request runs no
/// later than the waiting one, as every request within the debounce does), so the
/// `reconcile_on` request comes out as a handled `ObjectUpdated`. It must be reconciled
/// when the slot frees (the runner's mark, `forced`), not skipped as "already reconciled"
/// until the requeue. The concurrency limit is reached meanwhile (pod-1 holds the only
/// slot): the runner leaves the scheduler alone, and both requests wait for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_merged_into_a_pending_requeue_is_reconciled() {
    // Far more than the label's way from the server to the scheduler (milliseconds): the
    // update comes within the debounce of the request, and is merged after it.
    const DEBOUNCE: Duration = Duration::from_secs(1);
    let fx = Fixture::with_pods(2, 1).await; // ns-0/pod-0, ns-0/pod-1
    let db = Db::open(fx.path()).unwrap();
    let (tx, rx) = unbounded::<ObjectRef<Pod>>();
    let book = Book::new();
    let controller = db
        .store("pods", fx.pods(), store_cfg())
        .map(|pair| {
            Controller::for_store(pair)
                .with_config(Config::default().concurrency(1).debounce(DEBOUNCE))
                .predicate_filter(kube::runtime::predicates::generation, Default::default())
        })
        .unwrap()
        .durable_state("merged-requeue")
        .unwrap()
        .reconcile_on(rx);
    let (reader, stats) = (controller.store(), controller.stats());
    let run = controller.run(
        |pod: Arc<Pod>, book: Arc<Book>| async move {
            let name = name_of(&pod);
            // pod-1's second reconcile keeps the only slot until the test opens the gate.
            if book.start(&name) == 2 && name == "pod-1" {
                book.held().await;
            }
            book.finish(&name);
            Ok::<_, Never>(Action::requeue(MINUTE))
        },
        |_, _, _| Action::requeue(MINUTE),
        book.clone(),
    );
    let task = spawn_run(run);
    common::eventually(
        "both pods reconciled once, each with its requeue waiting",
        || {
            book.finished("pod-0") == 1 && book.finished("pod-1") == 1 && {
                let s = stats.get();
                (s.pending_requeues, s.queue_depth) == (2, 0)
            }
        },
    )
    .await;
    send(&tx, pod_ref("ns-0", "pod-1"));
    common::eventually("pod-1 reconciled again", || book.started("pod-1") == 2).await;
    // pod-1 holds the slot: this request is merged into pod-0's pending requeue (the queue
    // gauges show the runner took it) and waits.
    send(&tx, pod_ref("ns-0", "pod-0"));
    common::eventually("the request replaced pod-0's requeue", || {
        let s = stats.get();
        (s.pending_requeues, s.queue_depth) == (0, 1)
    })
    .await;
    let requested = Instant::now();
    // pod-0's own update, handled by its generation, merged after the request.
    let rv = relabel(&fx.h, "ns-0", "pod-0", "after-the-request");
    reader
        .wait_for_resource_version(Some("ns-0"), "pod-0", &rv, common::WAIT)
        .await
        .unwrap();
    assert!(
        requested.elapsed() < DEBOUNCE / 2,
        "the update must come within the request's debounce; it took {:?}",
        requested.elapsed()
    );
    assert_eq!(book.started("pod-0"), 1, "nothing of pod-0 ran meanwhile");
    let freed = Instant::now();
    book.open();
    // The requeue is a minute away: a reconcile within the debounce (and slack) is the
    // request's. A skip ends the wait at once.
    within(
        DEBOUNCE + Duration::from_secs(4),
        "pod-0 reconciled after its reconcile_on request",
        || book.started("pod-0") == 2 || stats.get().skipped > 0,
    )
    .await;
    assert_eq!(
        (book.started("pod-0"), stats.get().skipped),
        (2, 0),
        "the reconcile_on request (merged into a requeue, then into pod-0's handled update) \
         was skipped as already reconciled, not run"
    );
    eprintln!(
        "pod-0 reconciled {:?} after pod-1 freed the slot",
        book.started.lock().unwrap()["pod-0"][1] - freed
    );
    task.abort();
}

/// Waits until `f` holds, at most `limit`.
async fn within(limit: Duration, what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !f() {
        assert!(Instant::now() < deadline, "not within {limit:?}: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn send(tx: &UnboundedSender<ObjectRef<Pod>>, r: ObjectRef<Pod>) {
    tx.unbounded_send(r).expect("the controller takes requests");
}

/// Item 1b. With the `generation` predicate, the reconciler's own write (a label: the
/// generation stays) queues an update of its object while the reconcile runs; a
/// `reconcile_on` request arriving meanwhile is dropped by kube-runtime's scheduler (the
/// object is already pending). The pending update must then not be skipped: the request
/// came after the reconcile began.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_beside_a_pending_same_generation_update_is_reconciled() {
    let fx = Fixture::with_pods(1, 1).await; // ns-0/pod-0
    let h = &fx.h;
    let db = Db::open(fx.path()).unwrap();
    let (tx, rx) = unbounded::<ObjectRef<Pod>>();
    let book = Book::new();
    let written: Arc<Mutex<Option<String>>> = Arc::default();
    let controller = db
        .store("pods", fx.pods(), store_cfg())
        .map(|pair| {
            Controller::for_store(pair)
                .with_config(Config::default())
                .predicate_filter(kube::runtime::predicates::generation, Default::default())
        })
        .unwrap()
        .durable_state("same-generation")
        .unwrap()
        .reconcile_on(rx);
    let reader = controller.store();
    let (hh, w) = (h.clone(), written.clone());
    let run = controller.run(
        move |pod: Arc<Pod>, book: Arc<Book>| {
            let (h, written) = (hh.clone(), w.clone());
            async move {
                let name = name_of(&pod);
                if book.start(&name) == 1 {
                    // A write that keeps the generation, then a long reconcile.
                    let rv = relabel(&h, "ns-0", &name, "by-reconcile");
                    *written.lock().unwrap() = Some(rv);
                    book.held().await;
                }
                book.finish(&name);
                Ok::<_, Never>(Action::await_change())
            }
        },
        |_, _, _| Action::await_change(),
        book.clone(),
    );
    let task = spawn_run(run);
    common::eventually("the first reconcile wrote its label", || {
        written.lock().unwrap().is_some()
    })
    .await;
    let rv = written.lock().unwrap().clone().unwrap();
    reader
        .wait_for_resource_version(Some("ns-0"), "pod-0", &rv, common::WAIT)
        .await
        .unwrap();
    // The update is in the scheduler, pending while its object is reconciled; the request
    // arrives beside it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    send(&tx, pod_ref("ns-0", "pod-0"));
    tokio::time::sleep(Duration::from_millis(300)).await;
    book.open();
    common::eventually("pod-0 reconciled after its reconcile_on request", || {
        book.finished("pod-0") == 2
    })
    .await;
    task.abort();
}

/// The names of the objects controller `name` has a reconcile record of.
fn recorded(db: &Db, name: &str) -> Vec<String> {
    db.reconcile_states(name)
        .unwrap()
        .map(|r| r.unwrap().name)
        .collect()
}

fn create_pod(h: &ServerHandle, ns: &str, name: &str) {
    h.create(
        &ResourceType::pods(),
        kube_persist_testkit::make_pod(ns, name, 7),
    )
    .expect("pod created");
}

/// Item 2. The startup pass merges object pages with record pages read separately: an
/// object created (and reconciled) after the object pages passed its key has a record and
/// no object in the merge. Its record must be kept, not forgotten with its requeue.
///
/// Records a, b1, b2, c, d with a one-hour requeue; b1, b2 and d are deleted while the
/// controller is down (the store applies that) and a is changed. On restart, a's update is
/// reconciled and held at a gate, so the pass's request for a stays queued and the pass
/// blocks on back-pressure after reading the object page past `b`; b5 is created and
/// recorded meanwhile; once a is released the pass reaches b5's record, then d's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_startup_pass_keeps_the_record_of_an_object_created_while_it_runs() {
    common::init_tracing();
    const NAME: &str = "pass";
    let fx = Fixture::new().await;
    let h = &fx.h;
    for name in ["a", "b1", "b2", "c", "d"] {
        create_pod(h, "t", name);
    }
    let db = Db::open(fx.path()).unwrap();
    let api = || fx.pods();
    let run_controller = |book: Arc<Book>, gated: Option<&'static str>, client: kube::Client| {
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let controller = db
            .store("pods", Api::<Pod>::all(client), store_cfg())
            .map(|pair| Controller::for_store(pair).with_config(Config::default().pass_chunk(1)))
            .unwrap()
            .durable_state(NAME)
            .unwrap();
        let reader = controller.store();
        let run = controller
            .graceful_shutdown_on(async move {
                let _ = stop_rx.await;
            })
            .run(
                move |pod: Arc<Pod>, book: Arc<Book>| async move {
                    let name = name_of(&pod);
                    book.start(&name);
                    if gated == Some(name.as_str()) {
                        book.held().await;
                    }
                    book.finish(&name);
                    Ok::<_, Never>(Action::requeue(HOUR))
                },
                |_, _, _| Action::requeue(HOUR),
                book,
            );
        (spawn_run(run), stop_tx, reader)
    };

    // First run: every object reconciled and recorded; a graceful stop writes the state.
    let book = Book::new();
    let (task, stop, _) = run_controller(book.clone(), None, fx.server.client());
    common::eventually("five objects reconciled", || {
        ["a", "b1", "b2", "c", "d"]
            .iter()
            .all(|n| book.finished(n) == 1)
    })
    .await;
    let _ = stop.send(());
    task.await.unwrap();
    assert_eq!(recorded(&db, NAME), ["a", "b1", "b2", "c", "d"]);

    // Down: b1, b2 and d deleted (the store applies it), then a changed.
    for name in ["b1", "b2", "d"] {
        h.delete(&ResourceType::pods(), Some("t"), name);
    }
    {
        let (reader, watcher) = db.store("pods", api(), store_cfg()).unwrap();
        let sync = tokio::spawn(watcher.run());
        common::eventually("the store applied the deletions", || reader.len() == 2).await;
        sync.abort();
        let _ = sync.await;
    }
    relabel(h, "t", "a", "while-down");

    // Restart: a's update is reconciled and held; the pass waits behind it. The store's
    // target read (`LIST limit=1`) fails, so it catches up at the first bookmark (a second
    // after connecting), long after a's update came: the pass, which waits for caught up,
    // finds a running. The client has no retry layer, so the store sees the 503.
    h.faults().fail_next(Verb::List, 503, 1);
    let client = kube_persist_testkit::client_for_opts(&fx.server.url(), None, false);
    let book = Book::new();
    let (task, stop, reader) = run_controller(book.clone(), Some("a"), client);
    common::eventually("a's update reconciled (held)", || book.started("a") == 1).await;
    common::eventually("the store caught up (the pass starts)", || {
        reader.is_caught_up()
    })
    .await;
    // Let the pass read its first pages and block behind a.
    tokio::time::sleep(Duration::from_millis(300)).await;
    create_pod(h, "t", "b5");
    common::eventually("b5 reconciled and recorded", || {
        recorded(&db, NAME).contains(&"b5".to_string())
    })
    .await;
    book.open();
    common::eventually("the pass forgot the deleted objects' records", || {
        let names = recorded(&db, NAME);
        !["b1", "b2", "d"]
            .iter()
            .any(|n| names.contains(&n.to_string()))
    })
    .await;
    let _ = stop.send(());
    task.await.unwrap();
    let records: Vec<_> = db
        .reconcile_states(NAME)
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let names: Vec<_> = records.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["a", "b5", "c"], "records after the startup pass");
    assert!(
        records.iter().all(|r| r.due.is_some()),
        "every record keeps its one-hour requeue: {records:?}"
    );
    let states = db.controller_states().unwrap();
    assert_eq!(states[0].objects, 3, "{states:?}");
}

/// Item 3. Opaque resourceVersions compare only for equality: a wait for version c must not
/// resolve because the store applied b (a change after the wait began, but older than c).
/// The store is held at b: the watch that delivers b fails after it, and the reconnect
/// after that gets a 503 (a client without kube's retry layer, so the store sees it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_your_writes_on_opaque_versions_waits_for_the_awaited_version() {
    common::init_tracing();
    let server = TestServer::start_with(ServerOptions {
        opaque_resource_versions: true,
        ..Default::default()
    })
    .await;
    let h = server.handle();
    h.seed_pods(1, 1);
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path()).unwrap();
    let client = kube_persist_testkit::client_for_opts(&server.url(), None, false);
    let cfg = kube_persist::StreamConfig::default()
        .backoff(Duration::from_millis(1500), Duration::from_secs(3))
        .relist_jitter(Duration::from_millis(10));
    let (reader, watcher) = db.store("pods", Api::<Pod>::all(client), cfg).unwrap();
    let task = tokio::spawn(watcher.run());
    reader.wait_until_caught_up().await.unwrap();
    // The open watch ends; its reconnect fails (a backoff of 1.5 s or more), the one
    // after delivers one event and fails, the next one (after another backoff) the rest.
    common::eventually("the watch is live", || reader.is_live()).await;
    let watches = h.counts().watch;
    h.faults().fail_next(Verb::Watch, 503, 1);
    h.faults().error_watch_after(1);
    h.faults().close_watches();
    // The reconnect got its 503: the store is backing off, at a.
    common::eventually("the reconnect refused", || h.counts().watch > watches).await;
    let _b = relabel(&h, "ns-0", "pod-0", "b");
    let c = relabel(&h, "ns-0", "pod-0", "c");
    let began = Instant::now();
    reader
        .wait_for_resource_version(Some("ns-0"), "pod-0", &c, common::WAIT)
        .await
        .unwrap();
    let stored = reader
        .get_named(Some("ns-0"), "pod-0")
        .unwrap()
        .and_then(|p| p.metadata.resource_version.clone());
    assert_eq!(
        stored.as_deref(),
        Some(c.as_str()),
        "the wait for c resolved after {:?} with the store at another version",
        began.elapsed()
    );
    task.abort();
}

/// A `reconcile_all_on` tick that comes before the store is ready (here: wiped by a new
/// selector, so it lists again) reconciles every object once the store is, even those the
/// durable state shows reconciled at their version (which the cold start's pass skips).
/// Found by the lifecycle model (a tick right after a restart that wiped the store).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tick_before_the_store_is_ready_reconciles_every_object() {
    common::init_tracing();
    const NAME: &str = "early-tick";
    let fx = Fixture::with_pods(3, 1).await;
    let db = Db::open(fx.path()).unwrap();
    let run = |book: Arc<Book>, cfg: kube_persist::StreamConfig, ticks| {
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let run = db
            .store("pods", fx.pods(), cfg)
            .map(|pair| Controller::for_store(pair).with_config(Config::default()))
            .unwrap()
            .durable_state(NAME)
            .unwrap()
            .reconcile_all_on(ticks)
            .graceful_shutdown_on(async move {
                let _ = stop_rx.await;
            })
            .run(
                |pod: Arc<Pod>, book: Arc<Book>| async move {
                    book.start(&name_of(&pod));
                    Ok::<_, Never>(Action::await_change())
                },
                |_, _, _| Action::await_change(),
                book,
            );
        (spawn_run(run), stop_tx)
    };
    let pods = ["pod-0", "pod-1", "pod-2"];
    let book = Book::new();
    let (task, stop) = run(
        book.clone(),
        store_cfg(),
        futures::stream::pending().boxed(),
    );
    common::eventually("every pod reconciled", || {
        pods.iter().all(|p| book.started(p) == 1)
    })
    .await;
    let _ = stop.send(());
    task.await.unwrap();

    // Another selector (matching the same pods) wipes the store: it lists again, and the
    // tick, sent before the controller even starts, comes before the store is ready.
    let (tx, ticks) = unbounded::<()>();
    tx.unbounded_send(()).unwrap();
    let book = Book::new();
    let (task, _stop) = run(book.clone(), store_cfg().labels("!absent"), ticks.boxed());
    within(PROMPT, "every pod reconciled after the tick", || {
        pods.iter().all(|p| book.started(p) >= 1)
    })
    .await;
    task.abort();
}

/// Issue 39 item 1. Ticks of `reconcile_all_on` that come faster than one sweep takes
/// (40 Pods, one reconcile at a time of at least 50 ms each: a sweep takes at least 2 s; a
/// tick every 500 ms) still reach every object: the sweep under way finishes and the ticks
/// that came meanwhile are coalesced into one more. Before, each tick restarted the sweep at
/// the first key, and the Pods late in key order were never reconciled after the first
/// tick.
///
/// Issue 50 item 8: the ticks stop after 1 s, while a sweep is surely under way (it cannot
/// have started 40 reconciles of 50 ms in that time), and every Pod must see a reconcile
/// that starts after the last tick within one sweep of it (and half a sweep of slack): the
/// sweep under way reaches the Pods past its position, and the one the ticks were coalesced
/// into follows it at once and reaches the Pods before that position by then. A tick lost
/// while a sweep runs leaves the Pods that sweep had passed unreconciled for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ticks_faster_than_a_sweep_reach_every_object() {
    common::init_tracing();
    const PODS: usize = 40;
    const CONCURRENCY: u16 = 1;
    const RECONCILE: Duration = Duration::from_millis(50);
    const TICK: Duration = Duration::from_millis(500);
    const TICKS: usize = 3; // at 0, 0.5 and 1 s: all within the sweep the first one starts
    // One sweep: each Pod's reconcile, CONCURRENCY at a time.
    let sweep = RECONCILE * (PODS as u32) / u32::from(CONCURRENCY);
    assert!(
        TICK * (TICKS as u32 - 1) < sweep,
        "the last tick comes during a sweep"
    );
    // The sweep under way at the last tick, at position p of PODS, ends (PODS - p)
    // reconciles later; the next reaches position p after p more: one sweep. With half a
    // sweep of slack (timer rounding, dispatch, the store's reads).
    let bound = sweep + sweep / 2;
    let fx = Fixture::with_pods(PODS, 1).await;
    let db = Db::open(fx.path()).unwrap();
    let (tick_tx, ticks) = unbounded::<()>();
    let book = Book::new();
    let run = db
        .store("pods", fx.pods(), store_cfg())
        .map(|pair| {
            Controller::for_store(pair)
                .with_config(Config::default().concurrency(CONCURRENCY).pass_chunk(4))
        })
        .unwrap()
        .reconcile_all_on(ticks)
        .run(
            |pod: Arc<Pod>, book: Arc<Book>| async move {
                book.start(&name_of(&pod));
                tokio::time::sleep(RECONCILE).await;
                Ok::<_, Never>(Action::await_change())
            },
            |_, _, _| Action::await_change(),
            book.clone(),
        );
    let task = spawn_run(run);
    let names: Vec<String> = (0..PODS).map(|i| format!("pod-{i}")).collect();
    common::eventually("the first sweep reconciles every pod", || {
        names.iter().all(|p| book.started(p) >= 1)
    })
    .await;
    let first_tick = Instant::now();
    let mut last_tick = first_tick;
    for i in 0..TICKS {
        if i > 0 {
            tokio::time::sleep(TICK).await;
        }
        last_tick = Instant::now();
        tick_tx.unbounded_send(()).unwrap();
    }
    let reconciled_since = |since: Instant| -> Vec<bool> {
        let started = book.started.lock().unwrap();
        names
            .iter()
            .map(|p| {
                started
                    .get(p.as_str())
                    .is_some_and(|times| times.iter().any(|t| *t > since))
            })
            .collect()
    };
    // The last tick came during the sweep the first one asked for: it had Pods left.
    assert!(
        reconciled_since(first_tick).contains(&false),
        "the ticks must come during one sweep"
    );
    let deadline = last_tick + bound;
    while reconciled_since(last_tick).contains(&false) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = last_tick.elapsed();
    let missing: Vec<(String, usize)> = {
        let after = reconciled_since(last_tick);
        names
            .iter()
            .zip(after)
            .filter(|(_, after)| !after)
            .map(|(p, _)| (p.clone(), book.started(p)))
            .collect()
    };
    assert!(
        missing.is_empty(),
        "{} of {PODS} pods not reconciled within {bound:?} of the last tick (a sweep: \
         {sweep:?}); (pod, reconciles): {missing:?}",
        missing.len()
    );
    eprintln!("every pod reconciled {took:?} after the last tick (bound {bound:?})");
    task.abort();
}

/// Issue 39 item 6. A request whose object cannot be read from the store (here: its record
/// corrupted on disk, so decryption fails) is not consumed: the read is retried with
/// backoff, each failure reported, and the reconcile runs once the object can be read again
/// (its next version rewrites the record). Before, the first failed read ended the request,
/// and its "must run" mark with it.
///
/// Issue 50 item 8: the mark is what is checked, on a request whose reason may be skipped.
/// pod-3 was reconciled (durable state, the `generation` predicate), then changed in its
/// labels only (a handled version: skipped), then its record corrupted. On restart a
/// `reconcile_on` request for it comes first; the startup pass's request (pod-3's version is
/// not the one last reconciled, and its generation cannot be read) comes within the
/// debounce and is merged after it, so the request that comes out, and whose read fails, has
/// the pass's reason, which may be skipped: only the mark says it must run. After two failed
/// reads a change of pod-3's labels makes it readable; its `ObjectUpdated` request is merged
/// into the retry, and the durable state shows the new version handled (same generation).
/// pod-3 must be reconciled then, once, and nothing skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_object_read_is_retried_not_consumed() {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    const NAME: &str = "failed-read";
    // Far more than the startup pass takes to follow the request (milliseconds).
    const DEBOUNCE: Duration = Duration::from_millis(500);
    let fx = Fixture::with_pods(5, 1).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let config = || {
        kube_persist::DbConfig::default()
            .engine(kube_persist::Engine::Redb)
            .encryption_key(kube_persist::EncryptionKey::from_bytes([7; 32]))
    };
    let controller = |db: &Db, refs: futures::stream::BoxStream<'static, ObjectRef<Pod>>| {
        db.store("pods", fx.pods(), kube_persist::StreamConfig::default())
            .map(|pair| {
                Controller::for_store(pair)
                    .with_config(Config::default().debounce(DEBOUNCE))
                    .predicate_filter(kube::runtime::predicates::generation, Default::default())
            })
            .unwrap()
            .durable_state(NAME)
            .unwrap()
            .reconcile_on(refs)
    };
    let reconciler = |pod: Arc<Pod>, book: Arc<Book>| async move {
        book.start(&name_of(&pod));
        Ok::<_, Never>(Action::await_change())
    };
    let pods: Vec<String> = (0..5).map(|i| format!("pod-{i}")).collect();
    {
        // Every pod reconciled (and recorded) once; pod-3's label change skipped as handled.
        let db = Db::open_with(&dir, config()).unwrap();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let book = Book::new();
        let controller =
            controller(&db, futures::stream::pending().boxed()).graceful_shutdown_on(async move {
                let _ = stop_rx.await;
            });
        let (reader, stats) = (controller.store(), controller.stats());
        let task =
            spawn_run(controller.run(reconciler, |_, _, _| Action::await_change(), book.clone()));
        common::eventually("every pod reconciled", || {
            pods.iter().all(|p| book.started(p) >= 1)
        })
        .await;
        let rv = relabel(&fx.h, "ns-0", "pod-3", "handled");
        reader
            .wait_for_resource_version(Some("ns-0"), "pod-3", &rv, common::WAIT)
            .await
            .unwrap();
        common::eventually("pod-3's label change skipped", || stats.get().skipped == 1).await;
        assert_eq!(book.started("pod-3"), 1);
        let _ = stop_tx.send(());
        task.await.unwrap();
        db.flush().unwrap();
    }
    common::raw_edit(
        kube_persist::Engine::Redb,
        &dir,
        "stream/pods",
        b"ons-0\0pod-3",
        |v| {
            let mut v = v.expect("record present");
            let last = v.len() - 1;
            v[last] ^= 0x01;
            Some(v)
        },
    );
    let db = Db::open_with(&dir, config()).unwrap();
    // The request waits in the channel: the runner takes it before its startup pass runs.
    let (tx, refs) = unbounded::<ObjectRef<Pod>>();
    tx.unbounded_send(pod_ref("ns-0", "pod-3")).unwrap();
    let book = Book::new();
    let failed = Arc::new(AtomicUsize::new(0));
    let controller = controller(&db, refs.boxed());
    let (reader, stats) = (controller.store(), controller.stats());
    let run = controller.run(reconciler, |_, _, _| Action::await_change(), book.clone());
    let f = failed.clone();
    let task = tokio::spawn(run.for_each(move |r| {
        if let Err(kube_persist::controller::ControllerError::ReadFailed(e, obj)) = &r {
            eprintln!("controller: read of {obj} failed: {e}");
            f.fetch_add(1, SeqCst);
        }
        async {}
    }));
    // Retried 200 ms (and the debounce) after the first failure; the next retry is 400 ms
    // (and the debounce) after the second.
    common::eventually("the failed read is retried", || failed.load(SeqCst) >= 2).await;
    let second = Instant::now();
    assert_eq!(book.started("pod-3"), 0, "not reconciled while unreadable");
    // A label: the generation stays, so the durable state shows the new version handled.
    let rv = relabel(&fx.h, "ns-0", "pod-3", "readable-again");
    reader
        .wait_for_resource_version(Some("ns-0"), "pod-3", &rv, common::WAIT)
        .await
        .unwrap();
    assert!(
        second.elapsed() < Duration::from_millis(400),
        "the change must come before the retry (400 ms after the second failure); it took {:?}",
        second.elapsed()
    );
    within(
        DEBOUNCE + Duration::from_secs(4),
        "pod-3 reconciled once it can be read",
        || book.started("pod-3") > 0 || stats.get().skipped > 0,
    )
    .await;
    assert_eq!(
        (book.started("pod-3"), stats.get().skipped),
        (1, 0),
        "the reconcile_on request (merged into the startup pass's, its reads failed, then \
         merged into pod-3's handled change) was skipped as already reconciled, not run"
    );
    assert_eq!(failed.load(SeqCst), 2, "failed reads");
    assert!(
        pods.iter()
            .filter(|p| *p != "pod-3")
            .all(|p| book.started(p) == 0),
        "nothing else reconciled"
    );
    task.abort();
}
