//! The `metrics` feature: after a sync and churn, a scrape of the prometheus-client
//! registry finds every stream's counters with the values the store counted.

use std::collections::BTreeMap;

use crate::common::*;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube_persist::{Db, DbConfig, StreamConfig, metrics::Metrics};
use kube_persist_testkit::{ResourceType, Verb};
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
    metrics.add(&all);
    metrics.add(&ns0);
    // The first LIST of the collection is refused once: an error of kind `refused`.
    h.faults().fail_next(Verb::List, 403, 1);
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
        !before.contains_key("kube_persist_last_watch_activity_timestamp_seconds{stream=\"pods\"}"),
        "no watch activity yet"
    );
    assert_eq!(before["kube_persist_caught_up{stream=\"pods\"}"], 0.0);
    assert!(
        !before.contains_key("kube_persist_resource_versions_behind{stream=\"pods\"}"),
        "no server resourceVersion read yet"
    );

    // The pods stream meets the refused LIST (alone: ns-0 starts after it).
    let w_all = drive(w_all);
    eventually("the pods stream meets the refused LIST", || {
        all.stats().errors == 1
    })
    .await;
    let w_ns0 = drive(w_ns0);
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
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let last = get("last_watch_activity_timestamp_seconds");
        assert!(
            (now - 60.0..=now + 1.0).contains(&last),
            "{stream}: {last} at {now}"
        );
        // Errors by kind and status, summing to the stream's count.
        let prefix = format!("kube_persist_errors_total{{stream=\"{stream}\",");
        let errors: f64 = m
            .iter()
            .filter(|(k, _)| k.starts_with(&prefix))
            .map(|(_, v)| v)
            .sum();
        assert_eq!(errors, stats.errors as f64, "{stream}");
        // One observation of the commit histogram per batch; bytes written.
        assert_eq!(
            get("commit_duration_seconds_count"),
            stats.batches as f64,
            "{stream}"
        );
        assert_eq!(get("batch_bytes_count"), stats.batches as f64, "{stream}");
        assert!(get("batch_bytes_sum") > 0.0, "{stream}");
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
    assert_eq!(
        m["kube_persist_errors_total{stream=\"pods\",kind=\"refused\",code=\"403\"}"], 1.0,
        "the refused LIST, by kind and status"
    );
    // The directory's figures once, not once per stream; its volume beside them.
    let dir = format!("{{dir=\"{}\"}}", tmp.path().join("cache").display());
    let per_dir = |metric: &str| {
        let series: Vec<_> = m
            .keys()
            .filter(|k| k.starts_with(&format!("kube_persist_{metric}{{")))
            .collect();
        assert_eq!(
            series.len(),
            1,
            "{metric}: one series per directory: {series:?}"
        );
        m[&format!("kube_persist_{metric}{dir}")]
    };
    assert!(per_dir("store_disk_bytes") > 0.0);
    let (size, free) = (per_dir("volume_size_bytes"), per_dir("volume_free_bytes"));
    assert!(size > 0.0 && free <= size, "{free} of {size}");
    assert_eq!(per_dir("oldest_read_seconds"), 0.0, "no scan open");
    let build = format!(
        "kube_persist_build_info{{version=\"{}\",engine=\"{}\",format=\"5\"}}",
        env!("CARGO_PKG_VERSION"),
        engine.name()
    );
    assert_eq!(m.get(&build), Some(&1.0), "{build} in {m:?}");
    // A scan held open is seen, and its age grows until it is dropped.
    let mut open = all.iter();
    let _first = open.next();
    let oldest = format!("kube_persist_oldest_read_seconds{dir}");
    eventually("the open scan is at least 50 ms old", || {
        scrape(&registry)[&oldest] >= 0.05
    })
    .await;
    drop(open);
    assert_eq!(scrape(&registry)[&oldest], 0.0, "the scan is closed");
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
    // The error policy's retry and the reconciler's requeue were added to the queue; the
    // retry counted as one.
    assert_eq!(get("queue_retries_total", ""), c.failed as f64);
    assert!(get("queue_adds_total", "") >= 2.0, "{m:?}");
    // A change is queued, waits, and is dispatched: its wait is observed.
    let waits = get("queue_wait_seconds_count", "");
    fx.h.churn(1, 0, 0, 11);
    eventually("the changed Pod's wait in the queue is observed", || {
        let c = stats.get();
        c.queue_wait_buckets.last().map(|b| b.1) > Some(waits as u64)
    })
    .await;
    let m = scrape(&registry);
    let waited = m["kube_persist_controller_queue_wait_seconds_count{controller=\"labeler\"}"];
    assert!(waited > waits, "{waited} after {waits}");
    run.abort();
    let _ = run.await;
    eventually("a dropped controller leaves its gauges at 0", || {
        let c = stats.get();
        c.queue_depth == 0 && c.pending_requeues == 0 && c.active == 0
    })
    .await;
}

/// The metrics a document lists: `(name, type, labels)` of each table row naming a
/// `kube_persist_` metric, the `<field>_total` row expanded with the counters of the
/// paragraph that starts with "The counters of".
fn documented(text: &str) -> BTreeMap<String, (String, Vec<String>)> {
    // A module's rustdoc as Markdown.
    let text: String = text
        .lines()
        .map(|l| {
            l.strip_prefix("//!")
                .map_or(l, |l| l.strip_prefix(' ').unwrap_or(l))
        })
        .map(|l| format!("{l}\n"))
        .collect();
    let text = text.as_str();
    let words = |s: &str| -> Vec<String> {
        s.split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect()
    };
    let counters: Vec<String> = {
        let at = text
            .find("The counters of")
            .expect("a list of the Stats counters");
        let para = &text[at..];
        let para = &para[..para.find("\n\n").unwrap_or(para.len())];
        words(para.split_once(':').expect("the list after a colon").1)
    };
    assert!(counters.len() >= 20, "{counters:?}");
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() < 5 || !cells[1].starts_with("`kube_persist_") {
            continue;
        }
        let name = cells[1].trim_matches('`');
        let row = (cells[2].to_string(), words(cells[3]));
        if name == "kube_persist_<field>_total" {
            for c in &counters {
                out.insert(format!("kube_persist_{c}_total"), row.clone());
            }
        } else {
            assert!(out.insert(name.to_string(), row).is_none(), "{name} twice");
        }
    }
    out
}

/// The metric tables of `src/metrics.rs` (the module's rustdoc) and of
/// docs/operations.md, *Metrics*, name the same metrics with the same types and labels, and
/// a scrape of a synced stream with an error, beside a controller that reconciled, returns
/// exactly those families, each with those labels.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metric_tables_and_a_scrape_name_the_same_metrics() {
    use futures::StreamExt;
    use kube_persist::controller::{Action, Controller};
    use std::sync::Arc;

    let root = env!("CARGO_MANIFEST_DIR");
    let rustdoc = documented(&std::fs::read_to_string(format!("{root}/src/metrics.rs")).unwrap());
    let ops = std::fs::read_to_string(format!("{root}/docs/operations.md")).unwrap();
    let section = &ops[ops
        .find("\n## Metrics")
        .expect("docs/operations.md: ## Metrics")..];
    let section = &section[..section[1..].find("\n## ").map_or(section.len(), |i| i + 1)];
    let doc = documented(section);
    assert_eq!(rustdoc, doc, "src/metrics.rs and docs/operations.md differ");

    let fx = Fixture::with_pods(20, 2).await;
    fx.h.faults().fail_next(Verb::List, 403, 1);
    let tmp = tempfile::tempdir().unwrap();
    let db = Db::open(tmp.path()).unwrap();
    let (reader, watcher) = db
        .store("pods", fx.pods(), StreamConfig::default())
        .unwrap();
    let mut registry = Registry::default();
    let metrics = Metrics::register(&mut registry);
    metrics.add(&reader);
    let controller = Controller::for_store((reader.clone(), watcher));
    metrics.add_controller("labeler", &controller.stats());
    let stats = controller.stats();
    let run = tokio::spawn(
        controller
            .run(
                |_: Arc<Pod>, _: Arc<()>| async { Ok::<_, std::io::Error>(Action::await_change()) },
                |_, _: &std::io::Error, _| Action::await_change(),
                Arc::new(()),
            )
            .for_each(|_| async {}),
    );
    eventually("20 reconciles", || stats.get().reconciles() >= 20).await;
    reader.wait_until_caught_up().await.unwrap();
    // Watch events: the stream's watch activity has a time.
    fx.h.churn(3, 0, 0, 5);
    eventually("three watch events", || reader.stats().watch_events >= 3).await;

    let mut text = String::new();
    encode(&mut text, &registry).unwrap();
    let mut scraped: BTreeMap<String, (String, std::collections::BTreeSet<String>)> =
        BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (family, kind) = rest.split_once(' ').unwrap();
            // OpenMetrics names a counter's family without `_total`.
            let name = match kind {
                "counter" => format!("{family}_total"),
                _ => family.to_string(),
            };
            scraped.insert(name, (kind.to_string(), Default::default()));
        } else if !line.starts_with('#') {
            let (series, _) = line.rsplit_once(' ').unwrap();
            let (name, labels) = series.split_once('{').unwrap_or((series, ""));
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .filter(|f| scraped.contains_key(*f))
                .unwrap_or(name);
            let entry = scraped
                .get_mut(family)
                .unwrap_or_else(|| panic!("a sample of no family: {line}"));
            for pair in labels
                .trim_end_matches('}')
                .split(',')
                .filter(|p| !p.is_empty())
            {
                let key = pair.split_once('=').unwrap().0;
                if key != "le" {
                    entry.1.insert(key.to_string());
                }
            }
        }
    }
    let scraped: BTreeMap<String, (String, Vec<String>)> = scraped
        .into_iter()
        .map(|(name, (kind, labels))| (name, (kind, labels.into_iter().collect())))
        .collect();
    let sorted = |m: &BTreeMap<String, (String, Vec<String>)>| {
        m.iter()
            .map(|(n, (k, l))| {
                let mut l = l.clone();
                l.sort();
                (n.clone(), (k.clone(), l))
            })
            .collect::<BTreeMap<_, _>>()
    };
    assert_eq!(
        sorted(&scraped),
        sorted(&doc),
        "a scrape and the documented metrics differ"
    );
    run.abort();
}
