//! No trigger lost, no record forgotten: the controller where kube-runtime's scheduler
//! merges requests, the startup pass of a durable controller while objects come and go,
//! and read-your-writes on a server with opaque resourceVersions (issue 32, items 1-3).
//!
//! Each test reproduces a finding against the testkit over real HTTP, on redb on disk:
//! - a request that must run (`reconcile_on`) merged into a pending early requeue, with the
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
struct Never;

fn store_cfg() -> kube_persist::StreamConfig {
    kube_persist::StreamConfig::default()
        .backoff(Duration::from_millis(20), Duration::from_millis(200))
        .relist_jitter(Duration::from_millis(10))
}

fn name_of(pod: &Pod) -> String {
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

/// Item 1a. With the concurrency limit reached (the runner holds the scheduler), a
/// `reconcile_on` request for an object with a pending `requeue(60 s)` is merged by
/// kube-runtime's scheduler into that requeue and comes out with its reason
/// (`ReconcilerRequestedRetry`) before its due time. It must be reconciled as soon as the
/// slot frees, not skipped as "already reconciled at this version" until the requeue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_merged_into_a_pending_requeue_is_reconciled() {
    let fx = Fixture::with_pods(2, 1).await; // ns-0/pod-0, ns-0/pod-1
    let db = Db::open(fx.path()).unwrap();
    let (tx, rx) = unbounded::<ObjectRef<Pod>>();
    let book = Book::new();
    let run = Controller::for_store(
        &db,
        "pods",
        fx.pods(),
        store_cfg(),
        Config::default().concurrency(1),
    )
    .unwrap()
    .durable_state(&db, "merged-requeue")
    .unwrap()
    .reconcile_on(rx)
    .run(
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
    common::eventually("both pods reconciled once", || {
        book.finished("pod-0") == 1 && book.finished("pod-1") == 1
    })
    .await;
    send(&tx, pod_ref("ns-0", "pod-1"));
    common::eventually("pod-1 reconciled again", || book.started("pod-1") == 2).await;
    // pod-1 holds the slot: this request waits in the scheduler, merged into pod-0's
    // pending one-hour requeue.
    send(&tx, pod_ref("ns-0", "pod-0"));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let freed = Instant::now();
    book.open();
    // The requeue is a minute away: a reconcile within PROMPT is the request's.
    within(
        PROMPT,
        "pod-0 reconciled after its reconcile_on request",
        || book.started("pod-0") == 2,
    )
    .await;
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

/// Item 1b. With `skip_unchanged_generation`, the reconciler's own write (a label: the
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
    let controller = Controller::for_store(
        &db,
        "pods",
        fx.pods(),
        store_cfg(),
        Config::default().skip_unchanged_generation(true),
    )
    .unwrap()
    .durable_state(&db, "same-generation")
    .unwrap()
    .reconcile_on(rx);
    let reader = controller.reader();
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
        let controller = Controller::for_store(
            &db,
            "pods",
            Api::<Pod>::all(client),
            store_cfg(),
            Config::default().pass_chunk(1),
        )
        .unwrap()
        .durable_state(&db, NAME)
        .unwrap();
        let reader = controller.reader();
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
        let run = Controller::for_store(&db, "pods", fx.pods(), cfg, Config::default())
            .unwrap()
            .durable_state(&db, NAME)
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
/// (40 Pods, one reconcile at a time of 50 ms each: a sweep takes about 2 s; a tick every
/// 500 ms) still reach every object: the sweep under way finishes and the ticks that came
/// meanwhile are coalesced into one more. Before, each tick restarted the sweep at the
/// first key, and the Pods late in key order were never reconciled after the first tick.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ticks_faster_than_a_sweep_reach_every_object() {
    common::init_tracing();
    const PODS: usize = 40;
    let fx = Fixture::with_pods(PODS, 1).await;
    let db = Db::open(fx.path()).unwrap();
    let (tick_tx, ticks) = unbounded::<()>();
    let book = Book::new();
    let run = Controller::for_store(
        &db,
        "pods",
        fx.pods(),
        store_cfg(),
        Config::default().concurrency(1).pass_chunk(4),
    )
    .unwrap()
    .reconcile_all_on(ticks)
    .run(
        |pod: Arc<Pod>, book: Arc<Book>| async move {
            book.start(&name_of(&pod));
            tokio::time::sleep(Duration::from_millis(50)).await;
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
    // Ticks every 500 ms from now on; every pod must see a reconcile that starts after the
    // first of them, within two sweeps (the one it joins, and the one it is coalesced into).
    let first_tick = Instant::now();
    let ticker = tokio::spawn(async move {
        loop {
            if tick_tx.unbounded_send(()).is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    });
    let reconciled_since = |book: &Book, since: Instant| {
        let started = book.started.lock().unwrap();
        names
            .iter()
            .filter(|p| {
                started
                    .get(p.as_str())
                    .is_some_and(|times| times.iter().any(|t| *t > since))
            })
            .count()
    };
    let deadline = first_tick + PROMPT;
    while reconciled_since(&book, first_tick) < PODS && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let reached = reconciled_since(&book, first_tick);
    let missing: Vec<(String, usize)> = {
        let started = book.started.lock().unwrap();
        names
            .iter()
            .filter(|p| {
                !started
                    .get(p.as_str())
                    .is_some_and(|times| times.iter().any(|t| *t > first_tick))
            })
            .map(|p| (p.clone(), started.get(p.as_str()).map_or(0, Vec::len)))
            .collect()
    };
    assert_eq!(
        reached,
        PODS,
        "{} of {PODS} pods not reconciled within {PROMPT:?} of the first tick: {missing:?}",
        PODS - reached
    );
    ticker.abort();
    task.abort();
}

/// Issue 39 item 6. A request whose object cannot be read from the store (here: its record
/// corrupted on disk, so decryption fails) is not consumed: the read is retried with
/// backoff, each failure reported, and the reconcile runs once the object can be read again
/// (its next version rewrites the record). Before, the first failed read ended the request,
/// and its "must run" mark with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_object_read_is_retried_not_consumed() {
    let fx = Fixture::with_pods(5, 1).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let config = || {
        kube_persist::DbConfig::default()
            .engine(kube_persist::Engine::Redb)
            .encryption_key(kube_persist::EncryptionKey::from_bytes([7; 32]))
    };
    {
        let db = Db::open_with(&dir, config()).unwrap();
        common::sync_pods(&fx.server, &db).await;
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
    let (tx, refs) = unbounded::<ObjectRef<Pod>>();
    let book = Book::new();
    let failed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let run = Controller::for_store(
        &db,
        "pods",
        fx.pods(),
        kube_persist::StreamConfig::default(),
        Config::default().startup(kube_persist::controller::StartupMode::Nothing),
    )
    .unwrap()
    .reconcile_on(refs)
    .run(
        |pod: Arc<Pod>, book: Arc<Book>| async move {
            book.start(&name_of(&pod));
            Ok::<_, Never>(Action::await_change())
        },
        |_, _, _| Action::await_change(),
        book.clone(),
    );
    let f = failed.clone();
    let task = tokio::spawn(run.for_each(move |r| {
        if let Err(kube_persist::controller::ControllerError::ReadFailed(e, obj)) = &r {
            eprintln!("controller: read of {obj} failed: {e}");
            f.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        async {}
    }));
    tx.unbounded_send(pod_ref("ns-0", "pod-3")).unwrap();
    common::eventually("the failed read is retried", || {
        failed.load(std::sync::atomic::Ordering::SeqCst) >= 2
    })
    .await;
    assert_eq!(book.started("pod-3"), 0, "not reconciled while unreadable");
    task.abort();
}
