//! The `metrics` feature: after a sync and churn, a scrape of the prometheus-client
//! registry finds every stream's counters with the values the store counted.

use std::collections::BTreeMap;

use crate::common::*;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube_persist::{Db, DbConfig, StreamConfig, metrics::Metrics};
use kube_persist_testkit::ResourceType;
use prometheus_client::{encoding::text::encode, registry::Registry};

/// Every sample of an OpenMetrics text, as `name{labels}` → value.
fn scrape(registry: &Registry) -> BTreeMap<String, f64> {
    let mut text = String::new();
    encode(&mut text, registry).unwrap();
    assert!(text.ends_with("# EOF\n"), "{text}");
    let mut families = std::collections::HashSet::new();
    text.lines()
        .filter(|l| {
            if let Some(rest) = l.strip_prefix("# TYPE ") {
                let family = rest.split(' ').next().unwrap().to_string();
                assert!(
                    families.insert(family.clone()),
                    "family {family} twice:\n{text}"
                );
            }
            !l.starts_with('#')
        })
        .map(|l| {
            let (name, value) = l.rsplit_once(' ').unwrap();
            (name.to_string(), value.parse().unwrap())
        })
        .collect()
}

async fn scrape_after_sync_has_the_store_counters(engine: Engine) {
    let fx = Fixture::with_pods(600, 3).await;
    let h = &fx.h;
    let tmp = tempfile::tempdir().unwrap();
    let db = Db::open_with(tmp.path().join("cache"), DbConfig::default().engine(engine)).unwrap();
    let mut registry = Registry::default();
    let metrics = Metrics::register(&mut registry);

    let (all, w_all) = db
        .store("pods", fx.pods(), StreamConfig::default().page_size(250))
        .unwrap();
    let (ns0, w_ns0) = db
        .store(
            "ns-0",
            Api::<Pod>::namespaced(fx.server.client(), "ns-0"),
            StreamConfig::default(),
        )
        .unwrap();
    metrics.add("pods", &all);
    metrics.add("ns-0", &ns0);
    let before = scrape(&registry);
    assert_eq!(
        before["kube_persist_sync_phase{stream=\"pods\",phase=\"Empty\"}"],
        1.0
    );
    assert_eq!(
        before["kube_persist_objects_written_total{stream=\"pods\"}"],
        0.0
    );
    assert!(
        !before.contains_key("kube_persist_seconds_since_watch_activity{stream=\"pods\"}"),
        "no watch activity yet"
    );
    assert_eq!(before["kube_persist_caught_up{stream=\"pods\"}"], 0.0);
    assert!(
        !before.contains_key("kube_persist_resource_versions_behind{stream=\"pods\"}"),
        "no server resourceVersion read yet"
    );

    let (w_all, w_ns0) = (drive(w_all), drive(w_ns0));
    converge(&all, h, &ResourceType::pods()).await;
    h.churn(40, 10, 5, 7);
    converge(&all, h, &ResourceType::pods()).await;
    let server_objects = h.resource_versions(&ResourceType::pods()).len();
    eventually("the ns-0 stream has the namespace's objects", || {
        ns0.len()
            == h.resource_versions(&ResourceType::pods())
                .keys()
                .filter(|(ns, _)| ns == "ns-0")
                .count()
    })
    .await;
    all.wait_until_caught_up().await.unwrap();
    let live = scrape(&registry);
    assert_eq!(live["kube_persist_caught_up{stream=\"pods\"}"], 1.0);
    assert_eq!(
        live["kube_persist_resource_versions_behind{stream=\"pods\"}"],
        0.0
    );
    w_all.stop().await;
    w_ns0.stop().await;
    let stopped = scrape(&registry);
    assert_eq!(
        stopped["kube_persist_caught_up{stream=\"pods\"}"], 0.0,
        "a stopped watcher's store is no longer caught up"
    );

    let m = scrape(&registry);
    for (stream, reader) in [("pods", &all), ("ns-0", &ns0)] {
        let stats = reader.stats();
        let get = |metric: &str| {
            let key = format!("kube_persist_{metric}{{stream=\"{stream}\"}}");
            *m.get(&key).unwrap_or_else(|| panic!("no sample {key}"))
        };
        for (metric, value) in [
            ("objects_written_total", stats.objects_written),
            ("objects_unchanged_total", stats.objects_unchanged),
            ("objects_deleted_total", stats.objects_deleted),
            ("list_pages_total", stats.list_pages),
            ("batches_total", stats.batches),
            ("watch_events_total", stats.watch_events),
            ("bookmarks_total", stats.bookmarks),
            ("relists_total", stats.relists),
            ("resumes_total", stats.resumes),
            ("bad_objects_total", stats.bad_objects),
            ("errors_total", stats.errors),
            ("identity_resets_total", stats.identity_resets),
            ("hot_cache_hits_total", stats.hot_cache_hits),
            ("hot_cache_misses_total", stats.hot_cache_misses),
            ("shard_client_filtered_total", stats.shard_client_filtered),
            ("server_version_reads_total", stats.server_version_reads),
            ("decodes_total", stats.decodes),
            ("objects", reader.len() as u64),
        ] {
            assert_eq!(get(metric), value as f64, "{stream}: {metric}");
        }
        assert_eq!(get("ready"), 1.0, "{stream}");
        let quiet = get("seconds_since_watch_activity");
        assert!((0.0..60.0).contains(&quiet), "{stream}: {quiet}");
        assert!(get("store_disk_bytes") > 0.0, "{stream}");
        let phase =
            |p: &str| m[&format!("kube_persist_sync_phase{{stream=\"{stream}\",phase=\"{p}\"}}")];
        assert_eq!(
            (
                phase("Empty"),
                phase("Listing"),
                phase("Sweeping"),
                phase("Synced")
            ),
            (0.0, 0.0, 0.0, 1.0),
            "{stream}"
        );
    }
    // The values themselves, not only their agreement with Stats: the whole collection
    // was listed in pages of 250, every object written, the churn applied as events.
    let all_metric = |metric: &str| m[&format!("kube_persist_{metric}{{stream=\"pods\"}}")];
    assert_eq!(all_metric("objects"), server_objects as f64);
    assert_eq!(all_metric("list_pages_total"), 3.0);
    assert!(all_metric("objects_written_total") >= 600.0 + 10.0);
    // The churn made 55 changes after the store had converged: each is a watch event.
    assert!(all_metric("watch_events_total") >= 55.0);
    assert!(all_metric("objects_deleted_total") >= 5.0);
    assert_eq!(all_metric("errors_total"), 0.0);
    assert!(m["kube_persist_objects{stream=\"ns-0\"}"] < all_metric("objects"));
}

engine_tests! {
    async: scrape_after_sync_has_the_store_counters,
}

#[derive(Debug, thiserror::Error)]
#[error("refused")]
struct Refused;

/// A durable controller over 30 Pods with one worker: while the first reconcile is held,
/// one worker is active and the others wait in the queue; once released, every Pod is
/// reconciled (one fails, one asks for a requeue) and the two requeues wait in the
/// scheduler (due in 2 min: within the durable state's 5-min window). The scrape
/// shows the controller's counters (`kube_persist_controller_*`) as `ControllerStats` reads
/// them, with a reconcile duration histogram whose count is the number of reconciles.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_metrics_count_reconciles_queue_and_startup_pass() {
    use std::sync::Arc;
    use std::time::Duration;

    use futures::StreamExt;
    use kube_persist::controller::{Action, Config, Controller};

    let fx = Fixture::with_pods(30, 1).await;
    let tmp = tempfile::tempdir().unwrap();
    let db = Db::open(tmp.path()).unwrap();
    let (reader, watcher) = db
        .store("pods", fx.pods(), StreamConfig::default())
        .unwrap();
    let controller = Controller::for_store((reader, watcher))
        .with_config(Config::default().concurrency(1))
        .durable_state("labeler")
        .unwrap();
    let stats = controller.stats();
    let mut registry = Registry::default();
    Metrics::register(&mut registry).add_controller("labeler", &stats);
    // The first reconcile waits for a permit; the others pass once it is given.
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let first = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let reconcile = {
        let (gate, first) = (gate.clone(), first.clone());
        move |pod: Arc<Pod>, _: Arc<()>| {
            let (gate, first) = (gate.clone(), first.clone());
            async move {
                if first.swap(false, std::sync::atomic::Ordering::SeqCst) {
                    let _permit = gate.acquire().await.unwrap();
                }
                let name = pod.metadata.name.clone().unwrap_or_default();
                match name.rsplit('-').next() {
                    Some("7") => Err(Refused),
                    Some("8") => Ok(Action::requeue(Duration::from_secs(120))),
                    _ => Ok(Action::await_change()),
                }
            }
        }
    };
    let run = tokio::spawn(
        controller
            .run(
                reconcile,
                |_, _: &Refused, _| Action::requeue(Duration::from_secs(120)),
                Arc::new(()),
            )
            .for_each(|_| async {}),
    );
    eventually("one reconcile held, the other Pods queued", || {
        let c = stats.get();
        c.active == 1 && c.queue_depth >= 29
    })
    .await;
    let held = scrape(&registry);
    assert_eq!(
        held["kube_persist_controller_active_workers{controller=\"labeler\"}"],
        1.0
    );
    assert!(held["kube_persist_controller_queue_depth{controller=\"labeler\"}"] >= 29.0);
    gate.add_permits(1);
    eventually("every Pod reconciled, the two requeues waiting", || {
        let c = stats.get();
        c.active == 0
            && c.queue_depth == 0
            && c.pending_requeues == 2
            && !c.startup_pass_running
            && c.reconciles() >= 30
    })
    .await;
    let c = stats.get();
    assert!(
        c.reconciled >= 28 && c.requeued >= 1 && c.failed >= 1,
        "{c:?}"
    );
    assert_eq!(c.startup_pass_objects, 30, "{c:?}");
    assert_eq!(c.startup_pass_read, 30, "{c:?}");
    let m = scrape(&registry);
    let get = |metric: &str, labels: &str| {
        let key = format!("kube_persist_controller_{metric}{{controller=\"labeler\"{labels}}}");
        *m.get(&key)
            .unwrap_or_else(|| panic!("no sample {key} in {m:?}"))
    };
    for (result, n) in [
        ("success", c.reconciled),
        ("requeue_after", c.requeued),
        ("error", c.failed),
        ("skipped", c.skipped),
    ] {
        let labels = format!(",result=\"{result}\"");
        assert_eq!(get("reconcile_total", &labels), n as f64, "{result}");
    }
    assert_eq!(get("reconcile_errors_total", ""), c.failed as f64);
    assert_eq!(get("pending_requeues", ""), 2.0);
    assert_eq!(get("queue_depth", ""), 0.0);
    assert_eq!(get("active_workers", ""), 0.0);
    assert_eq!(get("startup_pass_running", ""), 0.0);
    assert_eq!(get("startup_pass_objects", ""), 30.0);
    assert_eq!(get("startup_pass_read_total", ""), 30.0);
    assert_eq!(
        get("reconcile_time_seconds_count", ""),
        c.reconciles() as f64
    );
    // The encoder puts `le` before the family's labels.
    let inf =
        "kube_persist_controller_reconcile_time_seconds_bucket{le=\"+Inf\",controller=\"labeler\"}";
    assert_eq!(m[inf], c.reconciles() as f64);
    assert!(get("reconcile_time_seconds_sum", "") > 0.0);
    run.abort();
    let _ = run.await;
    eventually("a dropped controller leaves its gauges at 0", || {
        let c = stats.get();
        c.queue_depth == 0 && c.pending_requeues == 0 && c.active == 0
    })
    .await;
}
