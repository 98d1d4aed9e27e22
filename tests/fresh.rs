//! Fresh, not just ready (issue 25): a warm-started store reports when it has caught up with
//! the server, and a reader can wait for its own writes. Every scenario runs on both engines
//! against the testkit API server over HTTP.
//!
//! Right after each "caught up" a reader samples the whole store and compares it with the
//! server, which is quiescent then: each object missing, extra or at another resourceVersion
//! is a stale read. Read-your-writes scenarios count a read after `wait_for_write` that does
//! not show the write (or a newer version) as stale too. The last line is exactly
//! `fresh: <N> scenarios, <S> stale reads after caught-up`, and the target fails unless S is 0.
//!
//! `KP_FRESH_ONLY=<name>` runs one scenario. `KP_FRESH_NO_WAIT=1` turns off the startup
//! pass's wait for caught-up (`catch_up_before_startup(None)`), to see the stale reconciles
//! the wait prevents.

mod common;

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::PostParams;
use kube::runtime::controller::Action;
use kube_persist::controller::{self, Controller, StartupMode};
use kube_persist::resource_version::compare;
use kube_persist::{CatchUpRule, Db, Engine, Reader, Watcher};
use kube_persist_testkit::{ResourceType, ServerHandle, ServerOptions, TestServer};
use serde_json::json;

use common::{WAIT, server_versions, store_versions};

type Scenario = fn(Engine) -> BoxFuture<'static, u64>;

const SCENARIOS: &[(&str, Scenario)] = &[
    ("churn-while-down", |e| Box::pin(churn_while_down(e))),
    ("compacted-with-deletions", |e| {
        Box::pin(compacted_with_deletions(e))
    }),
    ("quiet-collection", |e| Box::pin(quiet_collection(e))),
    ("read-your-writes-under-churn", |e| {
        Box::pin(read_your_writes_under_churn(e))
    }),
    ("opaque-versions", |e| Box::pin(opaque_versions(e))),
    ("opaque-delete-then-recreate", |e| {
        Box::pin(opaque_delete_then_recreate(e))
    }),
    ("controller-startup-waits", |e| {
        Box::pin(controller_startup_waits(e))
    }),
];

fn main() {
    if std::env::var_os("RUST_LOG").is_some() {
        common::init_tracing(); // logs only when asked: the summary lines stay readable
    }
    let only = std::env::var("KP_FRESH_ONLY").ok();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (mut scenarios, mut stale) = (0u64, 0u64);
    for engine in [Engine::Redb, Engine::Sled] {
        for (name, scenario) in SCENARIOS {
            if only.as_deref().is_some_and(|o| o != *name) {
                continue;
            }
            let started = Instant::now();
            let s = rt.block_on(scenario(engine));
            println!(
                "fresh {engine} {name}: {s} stale reads ({:.2} s)",
                started.elapsed().as_secs_f64()
            );
            scenarios += 1;
            stale += s;
        }
    }
    println!("fresh: {scenarios} scenarios, {stale} stale reads after caught-up");
    if stale > 0 || scenarios == 0 {
        std::process::exit(1);
    }
}

fn pods_api(server: &TestServer) -> Api<Pod> {
    Api::all(server.client())
}

/// Open stream `pods` (again) in `db`.
fn open(db: &Db, server: &TestServer) -> (Reader<Pod>, Watcher<Pod>) {
    db.store(
        "pods",
        pods_api(server),
        kube_persist::StreamConfig::default(),
    )
    .unwrap()
}

/// How many objects differ between the store and the server (missing, extra, or at
/// another resourceVersion).
fn differences(store: &BTreeMap<String, String>, server: &BTreeMap<String, String>) -> u64 {
    let missing_or_stale = server
        .iter()
        .filter(|(k, v)| store.get(*k) != Some(*v))
        .count();
    let extra = store.keys().filter(|k| !server.contains_key(*k)).count();
    (missing_or_stale + extra) as u64
}

/// Waits until the store says it caught up, then samples it at once against the (quiescent)
/// server: the number of stale reads. Prints how long catching up took.
async fn sample_at_caught_up(what: &str, reader: &Reader<Pod>, h: &ServerHandle) -> u64 {
    let started = Instant::now();
    tokio::time::timeout(WAIT, reader.wait_until_caught_up())
        .await
        .unwrap_or_else(|_| panic!("{what}: never caught up ({:?})", reader.freshness()))
        .unwrap();
    let store = store_versions(reader);
    let server = server_versions(h, &ResourceType::pods());
    let stale = differences(&store, &server);
    if stale > 0 {
        eprintln!(
            "{what}: stale right after caught-up: {}",
            common::diff("store", &store, &server)
        );
    }
    println!(
        "fresh {what}: caught up in {:.1} ms by {}",
        started.elapsed().as_secs_f64() * 1e3,
        reader.freshness().rule
    );
    stale
}

/// A store synced once, then stopped: the server, its database and the directory.
async fn synced_then_stopped(
    server: TestServer,
    engine: Engine,
) -> (TestServer, Db, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let db = common::try_open_db(engine, dir.path()).unwrap();
    common::sync_pods(&server, &db).await;
    (server, db, dir)
}

/// Reopen after changes made while down: ready at once on the old data, not caught up,
/// and the old data differs from the server (else the scenario tests nothing).
fn reopen_stale(db: &Db, server: &TestServer, what: &str) -> (Reader<Pod>, Watcher<Pod>) {
    let (reader, watcher) = open(db, server);
    assert!(reader.is_ready(), "{what}: a warm open is ready at once");
    assert!(
        !reader.is_caught_up(),
        "{what}: not caught up before the watch ran"
    );
    let before = differences(
        &store_versions(&reader),
        &server_versions(&server.handle(), &ResourceType::pods()),
    );
    assert!(
        before > 0,
        "{what}: the changes while down must make the store stale"
    );
    (reader, watcher)
}

/// Reopens the stale store, runs its watcher and samples it right after caught-up: the
/// reader, the watcher's task and the stale reads.
async fn restart_and_sample(
    db: &Db,
    server: &TestServer,
    what: &str,
) -> (Reader<Pod>, tokio::task::JoinHandle<()>, u64) {
    let (reader, watcher) = reopen_stale(db, server, what);
    let task = tokio::spawn(watcher.run());
    let stale = sample_at_caught_up(what, &reader, &server.handle()).await;
    (reader, task, stale)
}

/// Warm restart with churn while down: caught up only once the replay is applied.
async fn churn_while_down(engine: Engine) -> u64 {
    let what = format!("{engine} churn-while-down");
    let (server, db, _dir) = synced_then_stopped(common::pod_server(400).await, engine).await;
    let h = server.handle();
    h.churn(150, 40, 40, 7);
    let (reader, task, stale) = restart_and_sample(&db, &server, &what).await;
    let fresh = reader.freshness();
    assert_eq!(
        fresh.rule,
        CatchUpRule::ComparableResourceVersions,
        "{what}"
    );
    assert_eq!(fresh.behind, Some(0), "{what}");
    assert_eq!(
        reader.stats().list_pages,
        0,
        "{what}: resumed without a LIST page"
    );
    task.abort();
    stale
}

/// Warm restart after compaction with deletions: the watch answers 410 and the store
/// relists; caught up only after the relist's sweep (no deleted object visible after it).
async fn compacted_with_deletions(engine: Engine) -> u64 {
    let what = format!("{engine} compacted-with-deletions");
    let (server, db, _dir) = synced_then_stopped(common::pod_server(400).await, engine).await;
    let h = server.handle();
    h.churn(50, 0, 60, 11);
    h.compact();
    // Live (connected) comes before caught up here: the 410 and the relist follow.
    let (reader, task, stale) = restart_and_sample(&db, &server, &what).await;
    assert_eq!(reader.freshness().rule, CatchUpRule::List, "{what}");
    assert!(reader.stats().relists >= 1, "{what}: relisted");
    task.abort();
    stale
}

/// Only other collections changed while down: the checkpoint is behind the server's
/// resourceVersion with no event of this collection to move it; a bookmark does.
async fn quiet_collection(engine: Engine) -> u64 {
    let what = format!("{engine} quiet-collection");
    let (server, db, _dir) = synced_then_stopped(common::pod_server(200).await, engine).await;
    let h = server.handle();
    let cms = ResourceType::configmaps();
    for i in 0..30 {
        h.create(
            &cms,
            json!({"apiVersion": "v1", "kind": "ConfigMap",
                   "metadata": {"name": format!("cm-{i}"), "namespace": "ns-0"}}),
        )
        .unwrap();
    }
    let (reader, watcher) = open(&db, &server);
    assert!(!reader.is_caught_up(), "{what}");
    let task = tokio::spawn(watcher.run());
    let stale = sample_at_caught_up(&what, &reader, &h).await;
    let fresh = reader.freshness();
    assert_eq!(
        fresh.rule,
        CatchUpRule::ComparableResourceVersions,
        "{what}"
    );
    let target = fresh.server_resource_version.expect("a target was read");
    let checkpoint = reader.checkpoint().unwrap();
    assert_ne!(
        compare(&checkpoint, &target).unwrap(),
        Ordering::Less,
        "{what}: caught up with checkpoint {checkpoint} behind the server's {target}"
    );
    task.abort();
    stale
}

/// Sets the flag when dropped: a background writer stops even when a scenario panics.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, AtomicOrdering::Relaxed);
    }
}

/// Writes a label on a Pod through the API (GET, then PUT; again on a conflict with the
/// churn): the object as the write returned it.
async fn write_label(server: &TestServer, ns: &str, name: &str, i: u64) -> Pod {
    let api = Api::<Pod>::namespaced(server.client(), ns);
    for _ in 0..50 {
        let mut pod = api.get(name).await.unwrap();
        pod.metadata
            .labels
            .get_or_insert_default()
            .insert("fresh/write".into(), i.to_string());
        match api.replace(name, &PostParams::default(), &pod).await {
            Ok(written) => return written,
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(e) => panic!("writing {ns}/{name}: {e}"),
        }
    }
    panic!("writing {ns}/{name}: 50 conflicts in a row");
}

/// Read your writes while other writes stream in: after `wait_for_write`, `get` shows the
/// written version or a newer one, every time.
async fn read_your_writes_under_churn(engine: Engine) -> u64 {
    let what = format!("{engine} read-your-writes-under-churn");
    let server = common::pod_server(300).await;
    let h = server.handle();
    let dir = tempfile::tempdir().unwrap();
    let db = common::try_open_db(engine, dir.path()).unwrap();
    let (reader, watcher) = open(&db, &server);
    let task = tokio::spawn(watcher.run());
    reader.wait_until_caught_up().await.unwrap();
    let stop = StopOnDrop(Arc::new(AtomicBool::new(false)));
    let churn = {
        let (h, stop) = (h.clone(), stop.0.clone());
        tokio::task::spawn_blocking(move || {
            let mut round = 0;
            while !stop.load(AtomicOrdering::Relaxed) {
                h.churn(5, 0, 0, round);
                round += 1;
                std::thread::sleep(Duration::from_millis(2));
            }
            round
        })
    };
    let mut stale = 0;
    for i in 0..100u64 {
        let j = (i * 7) % 300; // seed_pods puts pod-<j> in ns-<j % 10>
        let (ns, name) = (format!("ns-{}", j % 10), format!("pod-{j}"));
        let written = write_label(&server, &ns, &name, i).await;
        let rv = written.metadata.resource_version.clone().unwrap();
        reader
            .wait_for_write(&written, Duration::from_secs(10))
            .await
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        match reader.get_named(Some(&ns), &name).unwrap() {
            Some(pod) => {
                let stored = pod.metadata.resource_version.clone().unwrap_or_default();
                if compare(&stored, &rv).unwrap() == Ordering::Less {
                    eprintln!("{what}: {ns}/{name} read at {stored} after writing {rv}");
                    stale += 1;
                }
            }
            None => {
                eprintln!("{what}: {ns}/{name} missing after writing {rv}");
                stale += 1;
            }
        }
    }
    drop(stop);
    let rounds = churn.await.unwrap();
    assert!(rounds > 0, "{what}: the churn ran");
    // Caught up stays true while the watch is live (a live watch is always a few ms
    // behind): the store converges once the churn stopped.
    common::converge(&reader, &h, &ResourceType::pods()).await;
    task.abort();
    stale
}

/// A server whose resourceVersions are opaque: the store says it cannot compare them and
/// falls back to the first bookmark after connecting; read-your-writes waits for the exact
/// version.
async fn opaque_versions(engine: Engine) -> u64 {
    let what = format!("{engine} opaque-versions");
    let server = TestServer::start_with(ServerOptions {
        history: 100_000,
        opaque_resource_versions: true,
        ..Default::default()
    })
    .await;
    server.handle().seed_pods(200, 10);
    let (server, db, _dir) = synced_then_stopped(server, engine).await;
    let h = server.handle();
    h.churn(60, 20, 20, 5);
    let (reader, task, mut stale) = restart_and_sample(&db, &server, &what).await;
    let fresh = reader.freshness();
    assert_eq!(fresh.rule, CatchUpRule::FirstBookmark, "{what}");
    assert_eq!(
        fresh.behind, None,
        "{what}: no distance between opaque versions"
    );
    for i in 0..30u64 {
        let name = format!("pod-{}", i * 3);
        let ns = match server_versions(&h, &ResourceType::pods())
            .keys()
            .find_map(|k| k.strip_suffix(&format!("/{name}")).map(str::to_string))
        {
            Some(ns) => ns,
            None => continue, // deleted by the churn
        };
        let written = write_label(&server, &ns, &name, i).await;
        reader
            .wait_for_write(&written, Duration::from_secs(10))
            .await
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let stored = reader
            .get_named(Some(&ns), &name)
            .unwrap()
            .and_then(|p| p.metadata.resource_version.clone());
        if stored != written.metadata.resource_version {
            eprintln!(
                "{what}: {ns}/{name} read at {stored:?} after writing {:?}",
                written.metadata.resource_version
            );
            stale += 1;
        }
    }
    task.abort();
    stale
}

/// Issue 39 item 4: with opaque resourceVersions, read-your-writes after a delete and a
/// create of the same name. The store applies the deletion of the earlier object in a burst
/// of its own (the watch delivers one event, fails, and backs off 1.5 s before the next
/// connection brings the create): `wait_for_write(&created)` must not resolve on that
/// deletion (the read would find no object), only on the created version. A read after the
/// wait that does not show the created object counts as stale.
async fn opaque_delete_then_recreate(engine: Engine) -> u64 {
    let what = format!("{engine} opaque-delete-then-recreate");
    let server = TestServer::start_with(ServerOptions {
        opaque_resource_versions: true,
        ..Default::default()
    })
    .await;
    let h = server.handle();
    let rt = ResourceType::pods();
    h.seed_pods(1, 1);
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open_with(dir.path(), kube_persist::DbConfig::default().engine(engine)).unwrap();
    // No retry layer: a refused watch is the store's own backoff.
    let client = kube_persist_testkit::client_for_opts(&server.url(), None, false);
    let cfg = kube_persist::StreamConfig::default()
        .backoff(Duration::from_millis(1500), Duration::from_secs(3))
        .relist_jitter(Duration::from_millis(10));
    let (reader, watcher) = db.store("pods", Api::<Pod>::all(client), cfg).unwrap();
    let task = tokio::spawn(watcher.run());
    reader.wait_until_caught_up().await.unwrap();
    common::eventually("the watch is live", || reader.is_live()).await;
    let earlier = reader
        .get_named(Some("ns-0"), "pod-0")
        .unwrap()
        .and_then(|p| p.metadata.uid.clone())
        .expect("the earlier pod-0 is stored");
    // The open watch ends; its reconnect is refused (a backoff of 1.5 s or more), the next
    // one delivers one event (the deletion) and fails, the one after the rest.
    let watches = h.counts().watch;
    h.faults()
        .fail_next(kube_persist_testkit::Verb::Watch, 503, 1);
    h.faults().error_watch_after(1);
    h.faults().close_watches();
    common::eventually("the reconnect refused", || h.counts().watch > watches).await;
    h.delete(&rt, Some("ns-0"), "pod-0").expect("pod-0 deleted");
    let created = h
        .create(&rt, kube_persist_testkit::make_pod("ns-0", "pod-0", 7))
        .expect("pod-0 created again");
    let created: Pod = serde_json::from_value(created).unwrap();
    assert_ne!(
        created.metadata.uid.as_deref(),
        Some(earlier.as_str()),
        "{what}"
    );
    let began = Instant::now();
    reader
        .wait_for_write(&created, common::WAIT)
        .await
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let stored = reader
        .get_named(Some("ns-0"), "pod-0")
        .unwrap()
        .and_then(|p| p.metadata.resource_version.clone());
    task.abort();
    if stored != created.metadata.resource_version {
        eprintln!(
            "{what}: the wait for the created {:?} resolved after {:?} with the store at {stored:?}",
            created.metadata.resource_version,
            began.elapsed()
        );
        return 1;
    }
    0
}

/// What the reconciler saw: (namespace/name, resourceVersion) per reconcile.
#[derive(Default)]
struct Seen(std::sync::Mutex<Vec<(String, String)>>);

#[derive(Debug, thiserror::Error)]
#[error("never")]
struct Never;

/// Runs a durable controller reconciling every stored object at start until it reconciled
/// every object the server holds at its current version, then stops it gracefully; returns
/// what it reconciled.
async fn run_controller(
    db: &Db,
    server: &TestServer,
    cfg: controller::Config,
) -> Vec<(String, String)> {
    let h = server.handle();
    let seen = Arc::new(Seen::default());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = db
        .store(
            "pods",
            pods_api(server),
            kube_persist::StreamConfig::default(),
        )
        .map(|pair| Controller::for_store(pair).with_config(cfg))
        .unwrap()
        .durable_state("fresh")
        .unwrap()
        .graceful_shutdown_on(async move {
            let _ = stop_rx.await;
        })
        .run(
            |pod: Arc<Pod>, seen: Arc<Seen>| async move {
                let rv = pod.metadata.resource_version.clone().unwrap_or_default();
                seen.0.lock().unwrap().push((common::key(pod.as_ref()), rv));
                Ok::<_, Never>(Action::await_change())
            },
            |_, _, _| Action::await_change(),
            seen.clone(),
        );
    let done = tokio::spawn(run.count());
    let deadline = Instant::now() + WAIT;
    loop {
        let got: std::collections::BTreeSet<_> = seen.0.lock().unwrap().iter().cloned().collect();
        let missing: Vec<_> = server_versions(&h, &ResourceType::pods())
            .into_iter()
            .filter(|kv| !got.contains(kv))
            .collect();
        if missing.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{} objects never reconciled at their current version, e.g. {:?}; {} reconciles",
            missing.len(),
            &missing[..missing.len().min(5)],
            got.len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop_tx.send(()).unwrap();
    tokio::time::timeout(WAIT, done).await.unwrap().unwrap();
    seen.0.lock().unwrap().clone()
}

/// The durable controller's startup pass waits until the store caught up: a restart after
/// deletions and compaction reconciles no deleted object and nothing at an old version.
async fn controller_startup_waits(engine: Engine) -> u64 {
    let what = format!("{engine} controller-startup-waits");
    let server = common::pod_server(300).await;
    let h = server.handle();
    let dir = tempfile::tempdir().unwrap();
    let db = common::try_open_db(engine, dir.path()).unwrap();
    let wait = match std::env::var("KP_FRESH_NO_WAIT").as_deref() {
        Ok("1") => None,
        _ => Some(Duration::from_secs(60)),
    };
    let cfg = || {
        controller::Config::default()
            .startup(StartupMode::ReconcileAll)
            .catch_up_before_startup(wait)
    };
    run_controller(&db, &server, cfg()).await;
    h.churn(40, 0, 40, 3);
    h.compact();
    let current = server_versions(&h, &ResourceType::pods());
    let reconciled = run_controller(&db, &server, cfg()).await;
    let stale: Vec<_> = reconciled
        .iter()
        .filter(|(k, rv)| current.get(k) != Some(rv))
        .collect();
    if !stale.is_empty() {
        eprintln!(
            "{what}: {} reconciles on data older than the server's at restart, e.g. {:?}",
            stale.len(),
            &stale[..stale.len().min(5)]
        );
    }
    stale.len() as u64
}
