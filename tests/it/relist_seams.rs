//! The seams between features (issue 23): a stream reopened in the same `Db` right after
//! its watcher was dropped, streaming lists that keep being cut, relist storms, lists
//! slower than their continue tokens, the prune of a narrowed shard, keys-only deletions
//! of a strict type, and counters published before the status that announces them. Each
//! runs on both engines against the testkit server.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::common::{self, Ev, Fixture, assert_matches, drive, eventually, try_open_db};
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{Api, ObjectMeta};
use kube::core::NamespaceResourceScope;
use kube_persist::{Engine, Shard, ShardKey, StreamConfig};
use kube_persist_testkit::{ResourceType, TestServer};
use serde_json::json;

fn cfg() -> StreamConfig {
    StreamConfig::default()
        .backoff(Duration::from_millis(20), Duration::from_millis(200))
        .relist_jitter(Duration::from_millis(10))
}

/// Sync a Pod store with `config` in a fresh directory (the watcher runs on a task), then
/// check it equals the server; `what` says what reaching ready proves.
async fn sync_within(
    engine: Engine,
    server: &TestServer,
    config: StreamConfig,
    limit: Duration,
    what: &str,
) {
    let dir = tempfile::tempdir().unwrap();
    let db = try_open_db(engine, dir.path()).unwrap();
    let (reader, watcher) = db
        .store("pods", Api::<Pod>::all(server.client()), config)
        .unwrap();
    let task = tokio::spawn(watcher.run());
    tokio::time::timeout(limit, reader.wait_until_ready())
        .await
        .expect(what)
        .unwrap();
    assert_matches(&reader, &server.handle(), &ResourceType::pods());
    task.abort();
}

/// A watcher dropped (a lost leader election) right after the server sent it a burst,
/// while another stream keeps the disk thread busy, and the stream reopened at once in the
/// same `Db`: the new watcher must start from the state after the dropped one's last
/// commit. Then every object is deleted on the server: the store ends empty, its count
/// equals its records, and a `Reader` of an earlier open does not serve a cached ghost.
async fn reopen_right_after_a_burst_resumes_from_the_latest_state(engine: Engine) {
    let fx = Fixture::with_pods(400, 4).await;
    let h = &fx.h;
    let cms = ResourceType::configmaps();
    let cm = |i: usize, v: u64| {
        json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": format!("cm-{i}"), "namespace": "busy"}, "data": {"v": v.to_string()}})
    };
    for i in 0..200 {
        h.apply(&cms, cm(i, 0));
    }
    let db = fx.open(engine);
    let (busy, busy_watcher) = db
        .store(
            "busy",
            Api::<ConfigMap>::all(fx.server.client()),
            cfg().page_size(10),
        )
        .unwrap();
    let busy_task = tokio::spawn(busy_watcher.run());
    busy.wait_until_ready().await.unwrap();
    // Keep the disk thread busy with the other stream's bursts for the whole test.
    let stop = Arc::new(AtomicBool::new(false));
    let churn = {
        let (h, stop) = (h.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut v = 0u64;
            while !stop.load(Ordering::Relaxed) {
                v += 1;
                h.apply(&cms, cm((v % 200) as usize, v));
                if v.is_multiple_of(20) {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        })
    };
    let pods = || fx.pods();
    let mut first_reader = None;
    for round in 0..12u64 {
        let (reader, watcher) = db.store("pods", pods(), cfg()).unwrap();
        let task = tokio::spawn(watcher.run());
        reader.wait_until_live().await.unwrap();
        let before = reader.last_watch_activity();
        h.churn(40, 4, 8, round);
        // The burst was read and parsed: its commit is queued behind the busy stream's.
        eventually("the burst reaches the watcher", || {
            reader.last_watch_activity() != before
        })
        .await;
        task.abort();
        let _ = task.await;
        first_reader.get_or_insert(reader);
    }
    let first_reader = first_reader.unwrap();
    let (reader, watcher) = db.store("pods", pods(), cfg()).unwrap();
    let task = tokio::spawn(watcher.run());
    reader.wait_until_live().await.unwrap();
    stop.store(true, Ordering::Relaxed);
    churn.join().unwrap();
    // Put one object in the first open's cache (admitted on its second miss).
    let rt = ResourceType::pods();
    let cached = h.list(&rt).into_iter().next().unwrap();
    let (ns, name) = (
        cached["metadata"]["namespace"]
            .as_str()
            .unwrap()
            .to_string(),
        cached["metadata"]["name"].as_str().unwrap().to_string(),
    );
    for _ in 0..3 {
        assert!(first_reader.get_named(Some(&ns), &name).unwrap().is_some());
    }
    for o in h.list(&rt) {
        let m = &o["metadata"];
        h.delete(&rt, m["namespace"].as_str(), m["name"].as_str().unwrap());
    }
    let last = h.resource_version();
    eventually("the store applied the last deletion", || {
        reader.checkpoint().as_deref() == Some(last.as_str())
    })
    .await;
    assert_eq!(
        (reader.len(), reader.iter().count()),
        (0, 0),
        "every object was deleted on the server"
    );
    assert!(
        first_reader.get_named(Some(&ns), &name).unwrap().is_none(),
        "a reader of an earlier open served a deleted object from its cache"
    );
    task.abort();
    let _ = task.await;
    busy_task.abort();
    let _ = busy_task.await;
    let report = db.verify("pods", fx.server.client(), 5).await.unwrap();
    assert!(report.count_consistent() && report.is_ok(), "{report:?}");
}

/// A watcher task aborted without awaiting it, and its stream reopened at once (issue 32,
/// item 8): `abort` only queues the task's drop, so the old watcher still holds the stream.
/// The reopen waits for that drop (and the writes it left queued) instead of answering
/// "already open", then resumes from the latest checkpoint. Done from a task on a worker
/// thread, where `abort` queued the aborted task on that very worker (it runs only once the
/// reopen lets the worker's queue go), and from the test's own thread.
async fn reopen_right_after_abort_waits_for_the_aborted_watcher(engine: Engine) {
    let fx = Fixture::with_pods(60, 3).await;
    let h = &fx.h;
    let db = fx.open(engine);
    let pods = || fx.pods();
    let (mut reader, watcher) = db.store("pods", pods(), cfg()).unwrap();
    let mut task = tokio::spawn(watcher.run());
    reader.wait_until_ready().await.unwrap();
    for round in 0..4u64 {
        h.churn(10, 2, 2, round);
        let last = h.resource_version();
        eventually("the store applied the churn", || {
            reader.checkpoint().as_deref() == Some(last.as_str())
        })
        .await;
        let (db2, api) = (db.clone(), pods());
        let reopened = if round % 2 == 0 {
            tokio::spawn(async move {
                task.abort();
                db2.store("pods", api, cfg())
            })
            .await
            .unwrap()
        } else {
            task.abort();
            db2.store("pods", api, cfg())
        };
        let (again, watcher) =
            reopened.unwrap_or_else(|e| panic!("round {round}: reopen right after abort: {e}"));
        assert_eq!(
            again.checkpoint().as_deref(),
            Some(last.as_str()),
            "round {round}: the reopened store starts from the latest checkpoint"
        );
        task = tokio::spawn(watcher.run());
        again.wait_until_live().await.unwrap();
        assert_eq!(
            again.stats().relists,
            0,
            "round {round}: resumed, not relisted"
        );
        reader = again;
    }
    h.churn(10, 2, 2, 99);
    let last = h.resource_version();
    eventually("the last open applied the churn", || {
        reader.checkpoint().as_deref() == Some(last.as_str())
    })
    .await;
    assert_matches(&reader, h, &ResourceType::pods());
    task.abort();
    let _ = task.await;
}

/// A streaming list cut before its end bookmark every time (a stream lifetime shorter than
/// the initial events take) backs off and, after a few attempts, falls back to paginated
/// LISTs: the store syncs, with a bounded number of WATCH requests.
async fn streaming_list_cut_every_time_falls_back_to_pages(engine: Engine) {
    let fx = Fixture::with_pods(1000, 2).await;
    let h = &fx.h;
    h.faults().cut_every_watch_after(Some(150));
    h.reset_counts();
    let config = cfg().streaming_lists().page_size(100);
    let what = "synced through the paginated fallback";
    sync_within(engine, &fx.server, config, Duration::from_secs(30), what).await;
    let counts = h.counts();
    assert!(counts.list >= 10, "paginated fallback: {counts:?}");
    assert!(
        counts.watch <= 5,
        "three cut streaming lists, then the watches after the LIST: {counts:?}"
    );
}

/// A server that answers `410` right after every sync: relists in a row wait the
/// exponential backoff (at least 100, 200 and 400 ms after the first: the fifth relist has
/// started once those were waited), instead of listing from scratch as fast as the jitter
/// allows.
async fn relists_in_a_row_back_off(engine: Engine) {
    let fx = Fixture::with_pods(50, 1).await;
    let h = &fx.h;
    h.faults().gone_every_watch(true);
    let db = fx.open(engine);
    let config = StreamConfig::default()
        .backoff(Duration::from_millis(100), Duration::from_millis(400))
        .relist_jitter(Duration::ZERO);
    let (reader, watcher) = db.store("pods", fx.pods(), config).unwrap();
    let started = Instant::now();
    let task = tokio::spawn(watcher.run());
    eventually("five relists", || reader.stats().relists >= 5).await;
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(700),
        "five relists in a row within {took:?}: no backoff between them"
    );
    task.abort();
}

/// A watch that fails with the same `ERROR` (500) every time it resumes from the checkpoint
/// makes the watcher relist after a few attempts instead of resuming forever.
async fn watch_failing_the_same_way_relists(engine: Engine) {
    let fx = Fixture::with_pods(100, 2).await;
    let h = &fx.h;
    let db = fx.open(engine);
    let (reader, watcher) = db.store("pods", fx.pods(), cfg()).unwrap();
    let task = tokio::spawn(watcher.run());
    reader.wait_until_ready().await.unwrap();
    // Every watch fails at its first event, before delivering any.
    h.faults().error_every_watch_after(Some(0));
    h.faults().close_watches();
    let mut round = 0;
    tokio::time::timeout(Duration::from_secs(20), async {
        while reader.stats().relists == 0 {
            round += 1;
            h.churn(1, 0, 0, round);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("relisted after the same watch ERROR in a row");
    h.faults().error_every_watch_after(None);
    h.churn(10, 2, 2, 9);
    common::converge(&reader, h, &ResourceType::pods()).await;
    task.abort();
}

/// A paginated list slower than its continue tokens live: each expiry in a row doubles
/// the next attempt's page size, so the list completes instead of restarting forever.
async fn list_slower_than_its_continue_tokens_converges(engine: Engine) {
    let fx = Fixture::with_pods(3000, 3).await;
    let h = &fx.h;
    h.faults().page_delay(Duration::from_millis(30));
    h.faults().continue_ttl(Some(Duration::from_millis(400)));
    let what = "the list completed despite expiring continue tokens";
    sync_within(
        engine,
        &fx.server,
        cfg().page_size(100),
        Duration::from_secs(40),
        what,
    )
    .await;
}

/// A store reopened with a narrower shard is not ready, and gives no start signal, until
/// the objects outside the shard are pruned.
async fn narrowed_shard_is_ready_only_after_its_prune(engine: Engine) {
    let fx = Fixture::with_pods(2000, 10).await;
    let half = Shard::even(ShardKey::Uid, 0, 2).unwrap();
    let eighth = Shard::even(ShardKey::Uid, 0, 8).unwrap();
    let open = |shard: &Shard| {
        let db = fx.open(engine);
        let config = cfg().page_size(20).shard(shard.clone());
        let (reader, watcher) = db.store("pods", fx.pods(), config).unwrap();
        (db, reader, watcher)
    };
    {
        let (_db, reader, watcher) = open(&half);
        let mut w = drive(watcher);
        w.until(|e| *e == Ev::InitDone).await;
        assert!(reader.len() > 800);
        w.stop().await;
    }
    common::wait_unlocked(fx.path());
    let (_db, reader, watcher) = open(&eighth);
    assert!(
        !reader.is_ready(),
        "ready while objects of another shard are stored"
    );
    let mut w = drive(watcher);
    let evs = w.until(|e| matches!(e, Ev::Resumed(_))).await;
    assert!(matches!(evs[..], [Ev::Resumed(_)]), "{evs:?}");
    assert!(reader.is_ready());
    let outside = reader
        .iter()
        .map(|p| p.unwrap())
        .filter(|p| !eighth.contains(p.metadata.uid.as_deref(), p.metadata.namespace.as_deref()))
        .count();
    assert_eq!(
        outside, 0,
        "objects outside the shard when the store resumed"
    );
    w.stop().await;
}

/// A custom resource whose `spec` is required, as kube-derive makes it.
#[derive(Clone, Debug, serde::Deserialize, serde::Serialize)]
struct Widget {
    metadata: ObjectMeta,
    spec: WidgetSpec,
}

#[derive(Clone, Debug, serde::Deserialize, serde::Serialize)]
struct WidgetSpec {
    size: u64,
}

impl kube::Resource for Widget {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;
    fn kind(_: &()) -> std::borrow::Cow<'_, str> {
        "Widget".into()
    }
    fn group(_: &()) -> std::borrow::Cow<'_, str> {
        "example.kube-persist.dev".into()
    }
    fn version(_: &()) -> std::borrow::Cow<'_, str> {
        "v1".into()
    }
    fn plural(_: &()) -> std::borrow::Cow<'_, str> {
        "widgets".into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// On a keys-only stream, the deletions a relist finds carry no body that decodes into a
/// type with required fields: they are delivered as `Event::DeleteKey`.
async fn keys_only_relist_deletions_of_a_strict_type_are_delivered(engine: Engine) {
    let fx = Fixture::new().await;
    let h = &fx.h;
    let rt = ResourceType::widgets();
    let widget = |i: usize| {
        json!({"apiVersion": "example.kube-persist.dev/v1", "kind": "Widget",
        "metadata": {"name": format!("w-{i}"), "namespace": "ns"}, "spec": {"size": i}})
    };
    for i in 0..50 {
        h.apply(&rt, widget(i));
    }
    let open = || {
        let db = fx.open(engine);
        let (reader, watcher) = db
            .store(
                "widgets",
                Api::<Widget>::all(fx.server.client()),
                cfg().keys_only(),
            )
            .unwrap();
        (db, reader, watcher)
    };
    {
        let (_db, _reader, watcher) = open();
        let mut w = drive(watcher);
        w.until(|e| *e == Ev::InitDone).await;
        w.stop().await;
    }
    common::wait_unlocked(fx.path());
    let gone = ["ns/w-3", "ns/w-17", "ns/w-41"];
    for k in gone {
        h.delete(&rt, Some("ns"), k.split_once('/').unwrap().1);
    }
    h.compact(); // the resume answers 410: the relist's sweep finds the deletions
    let listed_at = h.resource_version();
    let (_db, reader, watcher) = open();
    let mut w = drive(watcher);
    // The checkpoint moves to the relist's version once its sweep is done.
    eventually("the relist and its sweep", || {
        reader.checkpoint().as_deref() == Some(listed_at.as_str())
    })
    .await;
    // Events are ordered: once the sentinel's Apply arrives, the sweep's deletions did.
    h.apply(&rt, widget(1000));
    let evs = w.until(|e| *e == Ev::Apply("ns/w-1000".into())).await;
    let mut want: Vec<String> = gone.iter().map(|k| k.to_string()).collect();
    want.sort_unstable();
    assert_eq!(
        common::deleted_keys(&evs),
        want,
        "{}",
        common::summary(&evs)
    );
    w.stop().await;
}

/// Whoever sees the status that makes the store ready sees the counters of the batch that
/// made it so: a thread spinning on `is_ready()` reads `stats()` at once.
fn counters_are_published_before_the_status(engine: Engine) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let _runtime = rt.enter();
    let server = rt.block_on(TestServer::start());
    server.handle().seed_pods(20, 2);
    for round in 0..40 {
        let dir = tempfile::tempdir().unwrap();
        let db = try_open_db(engine, dir.path()).unwrap();
        let (reader, watcher) = db
            .store(
                "pods",
                Api::<Pod>::all(server.client()),
                StreamConfig::default(),
            )
            .unwrap();
        let spinner = {
            let reader = reader.clone();
            std::thread::spawn(move || {
                while !reader.is_ready() {
                    std::hint::spin_loop();
                }
                reader.stats().objects_written
            })
        };
        let task = rt.spawn(watcher.run());
        let written = spinner.join().unwrap();
        assert_eq!(
            written, 20,
            "round {round}: the status came before its counters"
        );
        task.abort();
    }
}

engine_tests!(
    async:
    reopen_right_after_a_burst_resumes_from_the_latest_state,
    reopen_right_after_abort_waits_for_the_aborted_watcher,
    streaming_list_cut_every_time_falls_back_to_pages,
    relists_in_a_row_back_off,
    list_slower_than_its_continue_tokens_converges,
    watch_failing_the_same_way_relists,
    narrowed_shard_is_ready_only_after_its_prune,
    keys_only_relist_deletions_of_a_strict_type_are_delivered;
    sync:
    counters_are_published_before_the_status,
);
