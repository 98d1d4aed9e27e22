//! Every log line at info and above names what it is about (issue 58, item 1): a process
//! with two streams of one directory, logging JSON at `info` as an operator's log pipeline
//! reads it, cold-syncs both, restarts them (a warm resume) and runs a controller on one;
//! every line of the watchers names its stream and directory, every line of the controller
//! its controller, and each stream has lines of its own.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::common;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube_persist::{Db, StreamConfig};
use serde_json::Value;

const DIR_ENV: &str = "KP_LOGS_CHILD_DIR";
const URL_ENV: &str = "KP_LOGS_CHILD_URL";

/// The child: two streams synced cold, then resumed, then a controller; JSON logs at info
/// on stdout, then `DONE`.
#[test]
#[ignore = "child process of every_line_names_its_stream_and_directory"]
fn logs_child() {
    let dir = std::env::var(DIR_ENV).expect("KP_LOGS_CHILD_DIR");
    let url = std::env::var(URL_ENV).expect("KP_LOGS_CHILD_URL");
    tracing_subscriber::fmt()
        .json()
        .with_writer(std::io::stdout)
        .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
        .init();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async move {
        let client = kube_persist_testkit::client_for(&url, None);
        let open = |db: &Db| {
            let all = db
                .store(
                    "pods",
                    Api::<Pod>::all(client.clone()),
                    StreamConfig::default().page_size(10),
                )
                .unwrap();
            let ns = db
                .store(
                    "pods-ns-0",
                    Api::<Pod>::namespaced(client.clone(), "ns-0"),
                    StreamConfig::default().page_size(10),
                )
                .unwrap();
            (all, ns)
        };
        for _ in 0..2 {
            let db = Db::open_async(&dir).await.unwrap();
            let ((all, w_all), (ns, w_ns)) = open(&db);
            let (w_all, w_ns) = (common::drive(w_all), common::drive(w_ns));
            all.wait_until_caught_up().await.unwrap();
            ns.wait_until_caught_up().await.unwrap();
            w_all.stop().await;
            w_ns.stop().await;
        }
        let db = Db::open_async(&dir).await.unwrap();
        let ((all, w_all), _) = open(&db);
        let controller = kube_persist::Controller::for_store((all.clone(), w_all))
            .durable_state("labeler")
            .unwrap();
        let stats = controller.stats();
        let run = tokio::spawn(futures::StreamExt::for_each(
            controller.run(
                |_: Arc<Pod>, _: Arc<()>| async {
                    Ok::<_, std::io::Error>(kube::runtime::controller::Action::await_change())
                },
                |_, _: &std::io::Error, _| kube::runtime::controller::Action::await_change(),
                Arc::new(()),
            ),
            |_| async {},
        ));
        while stats.get().reconciles() < all.len() as u64 {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        run.abort();
    });
    println!("DONE");
}

/// What a JSON log line names: its own fields, then its spans', innermost first.
fn named(line: &Value, key: &str) -> Option<String> {
    let own = line["fields"].get(key);
    let spans = line["spans"].as_array().into_iter().flatten().rev();
    own.into_iter()
        .chain(spans.filter_map(|s| s.get(key)))
        .find_map(|v| v.as_str().map(str::to_string))
}

#[test]
fn every_line_names_its_stream_and_directory() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let fx = rt.block_on(common::Fixture::with_pods(60, 3));
    let dir = fx.dir.path().join("store");
    let url = fx.server.url();
    let out = std::process::Command::new("/proc/self/exe")
        .args([
            "--ignored",
            "--exact",
            "logs::logs_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(DIR_ENV, &dir)
        .env(URL_ENV, &url)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the child failed: {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<String> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    assert!(
        lines.iter().any(|l| l == "DONE"),
        "the child did not finish: {lines:#?}"
    );
    let dir = dir.display().to_string();
    let mut per_stream: BTreeMap<String, usize> = BTreeMap::new();
    let mut controller_lines = 0;
    // The test harness's own lines are not JSON.
    for text in lines.iter().filter(|l| l.starts_with('{')) {
        let line: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
        let target = line["target"].as_str().unwrap_or_default();
        if !target.starts_with("kube_persist") {
            continue;
        }
        let at = named(&line, "dir").or_else(|| named(&line, "path"));
        assert_eq!(
            at.as_deref().map(|p| p.starts_with(&dir)),
            Some(true),
            "a line that does not name its directory: {text}"
        );
        if target.starts_with("kube_persist::controller") {
            assert_eq!(
                named(&line, "controller").as_deref(),
                Some("labeler"),
                "a controller line that does not name it: {text}"
            );
            controller_lines += 1;
        }
        let about_a_stream = ["kube_persist::sync", "kube_persist::store::writer"]
            .iter()
            .any(|t| target.starts_with(t));
        if about_a_stream {
            let stream = named(&line, "stream")
                .unwrap_or_else(|| panic!("a watcher line that does not name its stream: {text}"));
            *per_stream.entry(stream).or_default() += 1;
        }
    }
    // Both streams logged their list, sweep and resume; the controller its pass.
    assert!(
        per_stream.get("pods").is_some_and(|n| *n >= 4)
            && per_stream.get("pods-ns-0").is_some_and(|n| *n >= 4),
        "{per_stream:?}"
    );
    assert!(controller_lines >= 1, "no controller line at info");
    println!("logs: {per_stream:?}, {controller_lines} controller lines");
}
