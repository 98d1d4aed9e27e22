//! Issue 50, item 3: the controller's memory grows with objects, not with requests. With a
//! debounce, every request for an object within its window used to be sent to
//! kube-runtime's scheduler channel, which the runner does not drain before the stores
//! are ready: a cold start with a large related kind queued one request per related object.
//!
//! A child process runs a controller of one Pod that watches 200,000 ConfigMaps, each
//! mapped to that Pod, once with `debounce(0)` and once with `debounce(1 s)`; each prints
//! its peak RSS once the related store is ready and the Pod reconciled. The two must differ
//! by less than 20 MiB (they differed by about 100 MiB before the fix).

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::Api;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube_persist::controller::{Config, Controller};
use kube_persist_testkit::{ResourceType, TestServer};
use serde_json::json;

use crate::common;

const RELATED: usize = 200_000;
const DIR_ENV: &str = "KP_DEBOUNCE_DIR";
const URL_ENV: &str = "KP_DEBOUNCE_URL";
const MS_ENV: &str = "KP_DEBOUNCE_MS";

#[derive(Debug, thiserror::Error)]
#[error("never fails")]
struct Never;

/// The child: one Pod, watching every ConfigMap of namespace `related`; prints its peak
/// RSS once the ConfigMaps are stored and the Pod was reconciled after them.
#[test]
#[ignore = "child process of the debounce memory test"]
fn debounce_child() {
    let dir = std::env::var(DIR_ENV).expect("KP_DEBOUNCE_DIR");
    let url = std::env::var(URL_ENV).expect("KP_DEBOUNCE_URL");
    let ms: u64 = std::env::var(MS_ENV)
        .expect("KP_DEBOUNCE_MS")
        .parse()
        .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async move {
        let client = kube_persist_testkit::client_for(&url, None);
        let db = kube_persist::Db::open(&dir).expect("child opens the store");
        let related = db
            .store(
                "related",
                Api::<ConfigMap>::namespaced(client.clone(), "related"),
                kube_persist::StreamConfig::default(),
            )
            .unwrap();
        let related_reader = related.0.clone();
        let controller = db
            .store(
                "pods",
                Api::<Pod>::all(client),
                kube_persist::StreamConfig::default(),
            )
            .map(|pair| {
                Controller::for_store(pair)
                    .with_config(Config::default().debounce(Duration::from_millis(ms)))
            })
            .unwrap()
            .watches_store(related, |_: ConfigMap| {
                Some(ObjectRef::<Pod>::new("pod-0").within("ns-0"))
            });
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let run = controller.run(
            move |pod: Arc<Pod>, _: Arc<()>| {
                let _ = tx.send(pod.metadata.name.clone());
                async { Ok::<_, Never>(Action::await_change()) }
            },
            |_, _: &Never, _| Action::await_change(),
            Arc::new(()),
        );
        let task = tokio::spawn(run.for_each(|_| async {}));
        related_reader.wait_until_ready().await.unwrap();
        // A reconcile that starts after the related store is ready: the requests of its
        // list have gone through the scheduler.
        while rx.try_recv().is_ok() {}
        rx.recv().await.expect("the Pod is reconciled");
        // libtest may have printed "test debounce_child ... " on this line.
        println!("\npeak_rss_kib={}", common::peak_rss_kib());
        task.abort();
    });
}

fn child_peak_kib(dir: &std::path::Path, url: &str, debounce_ms: u64) -> u64 {
    let mut child = common::spawn_self(
        "debounce::debounce_child",
        &[
            (DIR_ENV, dir.as_os_str()),
            (URL_ENV, url.as_ref()),
            (MS_ENV, debounce_ms.to_string().as_ref()),
        ],
    );
    let lines = common::collect_stdout(&mut child, |l| l.starts_with("peak_rss_kib="));
    let deadline = Instant::now() + Duration::from_secs(300);
    let peak = loop {
        if let Some(l) = lines.lock().unwrap().first() {
            break l["peak_rss_kib=".len()..].parse::<u64>().unwrap();
        }
        if let Ok(Some(status)) = child.try_wait() {
            // Its last line may still be on its way through the pipe.
            std::thread::sleep(Duration::from_millis(500));
            if let Some(l) = lines.lock().unwrap().first() {
                break l["peak_rss_kib=".len()..].parse::<u64>().unwrap();
            }
            panic!("the child (debounce {debounce_ms} ms) exited without a figure: {status}");
        }
        assert!(
            Instant::now() < deadline,
            "the child (debounce {debounce_ms} ms) took over 300 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = child.wait();
    peak
}

#[test]
fn a_debounce_costs_memory_per_object_not_per_request() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let server = rt.block_on(TestServer::start());
    let h = server.handle();
    h.seed_pods(1, 1);
    let cms = ResourceType::configmaps();
    for i in 0..RELATED {
        h.apply(
            &cms,
            json!({"apiVersion": "v1", "kind": "ConfigMap",
                   "metadata": {"name": format!("cm-{i}"), "namespace": "related"},
                   "data": {"k": "v"}}),
        );
    }
    let url = server.url();
    let mut peaks = Vec::new();
    for debounce_ms in [0, 1000] {
        let dir = tempfile::tempdir().unwrap();
        peaks.push(child_peak_kib(dir.path(), &url, debounce_ms));
    }
    let (undebounced, debounced) = (peaks[0], peaks[1]);
    eprintln!(
        "peak RSS with {RELATED} related objects: debounce 0 {} MiB, debounce 1 s {} MiB",
        undebounced / 1024,
        debounced / 1024
    );
    assert!(
        undebounced.abs_diff(debounced) < 20 * 1024,
        "debounce 1 s peaked at {debounced} KiB against {undebounced} KiB without: the requests \
         of a cold start's related list are kept one per request, not one per object"
    );
}
