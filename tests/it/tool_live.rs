//! The `kube-persist` tool beside the running example operator, as an operator on call runs
//! it (`kubectl exec <pod> -- kube-persist stats|get|dump|verify|controller-states <dir>`):
//! the operator's `--cluster` mode as one process (what `deploy/` runs, with its default
//! `--durability every-batch`), the tool as others, on the same store. Every reading
//! command answers while the operator runs, and a reader never keeps the operator from
//! restarting: neither after SIGTERM nor after SIGKILL, with a reader holding the store
//! open and the tool in the middle of a dump.
//!
//! The tool is the workspace's `kube-persist` binary next to this test binary
//! (`target/<profile>/kube-persist`, built by `cargo test --workspace`); when it is missing
//! the test builds it. After changing the tool, run this module alone only after
//! `cargo build --release -p kube-persist-cli`.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use tokio::io::{AsyncBufReadExt, BufReader};

use crate::common;
use crate::operator;
use crate::sigterm::Operator;
use kube_persist::{Db, DbConfig};
use kube_persist_testkit::TestServer;

const PODS: usize = 1500;

/// `target/<profile>/kube-persist`, built if missing.
fn tool_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("this test's path");
    // target/<profile>/deps/it-<hash>
    let profile = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>");
    let bin = profile.join("kube-persist");
    if !bin.exists() {
        let mut cmd = std::process::Command::new(std::env::var("CARGO").unwrap_or("cargo".into()));
        cmd.args([
            "build",
            "-q",
            "-p",
            "kube-persist-cli",
            "--bin",
            "kube-persist",
        ]);
        if profile.ends_with("release") {
            cmd.arg("--release");
        }
        assert!(
            cmd.status().expect("cargo build").success(),
            "building the tool failed"
        );
    }
    bin
}

/// A kubeconfig whose current context points at `server` (plain HTTP, no credentials), for
/// `verify`.
fn kubeconfig(dir: &Path, server: &TestServer) -> PathBuf {
    let path = dir.join("kubeconfig");
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: testkit\n  cluster:\n    server: {}\n\
             contexts:\n- name: testkit\n  context:\n    cluster: testkit\n    user: nobody\n\
             users:\n- name: nobody\n  user: {{}}\ncurrent-context: testkit\n",
            server.url()
        ),
    )
    .unwrap();
    path
}

/// Runs the tool to its end: (exit code, stdout, stderr).
async fn tool(args: &[&str], kubeconfig: &Path) -> (i32, String, String) {
    let out = tokio::process::Command::new(tool_binary())
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .env("RUST_LOG", "warn")
        .output()
        .await
        .expect("run the tool");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Asserts that the tool answered 0 and returns its stdout.
async fn ok(args: &[&str], kubeconfig: &Path) -> String {
    let (code, out, err) = tool(args, kubeconfig).await;
    assert_eq!(
        code, 0,
        "kube-persist {args:?} beside the operator: {err}{out}"
    );
    out
}

/// `namespace/name` of every Pod in a dump's lines.
fn dumped(lines: &[String]) -> std::collections::BTreeSet<String> {
    lines
        .iter()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON object per line");
            let m = &v["metadata"];
            format!(
                "{}/{}",
                m["namespace"].as_str().unwrap(),
                m["name"].as_str().unwrap()
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tool_reads_the_running_operator_which_restarts_beside_its_readers() {
    common::init_tracing();
    let server = common::pod_server(PODS).await;
    let h = server.handle();
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let dir = store.to_str().unwrap();
    let config = kubeconfig(tmp.path(), &server);
    let pods = common::server_versions(&h, &kube_persist_testkit::ResourceType::pods());
    let first = pods.keys().next().unwrap().clone();

    let op = Operator::spawn(&store, &server.url());
    op.ready().await;

    // Every reading command, while the operator runs and writes.
    let stats = ok(&["stats", dir], &config).await;
    assert!(stats.contains("pods"), "stats names the stream: {stats}");
    let got = ok(&["get", dir, "pods", &first], &config).await;
    let got: serde_json::Value = serde_json::from_str(&got).expect("get prints the object");
    assert_eq!(
        format!(
            "{}/{}",
            got["metadata"]["namespace"].as_str().unwrap(),
            got["metadata"]["name"].as_str().unwrap()
        ),
        first
    );
    let dump = ok(&["dump", dir, "pods"], &config).await;
    let lines: Vec<String> = dump.lines().map(str::to_string).collect();
    assert_eq!(lines.len(), PODS, "dump prints every stored Pod once");
    assert_eq!(
        dumped(&lines),
        pods.keys().cloned().collect(),
        "dump prints the server's Pods"
    );
    // The operator labels Pods meanwhile (each a PUT, so a newer resourceVersion), so the
    // store changes under verify: it must never call that a difference (exit 1). It says
    // equal or behind (0), or, if the store changed during each of its attempts, that it
    // could not verify (2).
    let (code, out, err) = tool(&["verify", dir, "pods"], &config).await;
    assert!(
        code == 0 || (code == 2 && err.contains("verifications in a row")),
        "verify beside a busy writer: {code} {err}{out}"
    );
    common::eventually("the operator labels every Pod", || {
        let h = server.handle();
        h.list(&kube_persist_testkit::ResourceType::pods())
            .into_iter()
            .filter_map(|p| serde_json::from_value::<k8s_openapi::api::core::v1::Pod>(p).ok())
            .filter(operator::is_labeled)
            .count()
            == PODS
    })
    .await;
    // Once it is quiet: equal, or behind by the last labels.
    let verify = ok(&["verify", dir, "pods"], &config).await;
    assert!(!verify.is_empty(), "verify reports");
    let states = ok(&["controller-states", dir], &config).await;
    assert!(
        states.contains(operator::CONTROLLER_NAME),
        "controller-states lists the operator's: {states}"
    );

    // Readers at the restart: one holding the store open in this process (as the tool's
    // commands do while they read), and the tool in the middle of a dump (stdout not read).
    let held = Db::open_with(&store, DbConfig::default().read_only())
        .expect("a reader beside the operator");
    let mut dump = tokio::process::Command::new(tool_binary())
        .args(["dump", dir, "pods"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start a dump");
    let mut out = BufReader::new(dump.stdout.take().unwrap()).lines();
    let mut lines = vec![
        out.next_line()
            .await
            .unwrap()
            .expect("the dump's first line"),
    ];

    // A graceful restart (a rolling update, a re-shard) and a crash (SIGKILL: the store is
    // reopened with its repair) both start beside the readers.
    let (clean, _, stopped) = op.terminate();
    assert!(clean, "SIGTERM beside a reader: {stopped}");
    let op = Operator::spawn(&store, &server.url());
    op.ready().await;
    op.kill();
    let op = Operator::spawn(&store, &server.url());
    op.ready().await;

    // The restarted operator still works: a Pod whose label is removed on the server is
    // labeled again.
    let (ns, name) = first.split_once('/').unwrap();
    let rt = kube_persist_testkit::ResourceType::pods();
    let mut pod = h.get(&rt, Some(ns), name).expect("the Pod");
    pod["metadata"]["labels"]
        .as_object_mut()
        .expect("labels")
        .remove(operator::OWNER_LABEL);
    h.apply(&rt, pod);
    common::eventually("the restarted operator labels the Pod again", || {
        h.list(&kube_persist_testkit::ResourceType::pods())
            .into_iter()
            .filter_map(|p| serde_json::from_value::<k8s_openapi::api::core::v1::Pod>(p).ok())
            .any(|p| p.metadata.name.as_deref() == Some(name) && operator::is_labeled(&p))
    })
    .await;

    // The dump that was waiting on its reader finishes, whole and without error.
    while let Some(line) = out.next_line().await.unwrap() {
        lines.push(line);
    }
    let status = dump.wait().await.unwrap();
    assert!(status.success(), "the dump across two restarts: {status}");
    assert_eq!(
        lines.len(),
        PODS,
        "the dump across restarts prints every Pod once"
    );
    assert_eq!(dumped(&lines), pods.keys().cloned().collect());
    assert!(
        held.streams()
            .expect("the held reader still reads")
            .iter()
            .any(|s| s.name == "pods"),
        "the reader held across the restarts reads the stream"
    );
    drop(held);
    assert!(
        ok(&["stats", dir], &config).await.contains("pods"),
        "stats after the restarts"
    );
    let (clean, _, stopped) = op.terminate();
    assert!(clean, "{stopped}");
}

/// `kube-persist verify` beside a writer (in this process, every batch durable, as the
/// operator writes) under create/delete churn during its first comparison, ten times: it
/// never answers that the store differs or that its count drifted (exit 1). It says equal
/// or behind (0), or that the store changed during each of its attempts (2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tool_never_calls_a_store_beside_its_churning_writer_wrong() {
    common::init_tracing();
    let server = common::pod_server(200).await;
    let h = server.handle();
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let dir = store.to_str().unwrap().to_string();
    let config = kubeconfig(tmp.path(), &server);
    let db = Db::open_with(
        &store,
        DbConfig::default().durability(kube_persist::Durability::EveryBatch),
    )
    .unwrap();
    let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(server.client());
    let (reader, watcher) = db
        .store("pods", api, kube_persist::StreamConfig::default())
        .unwrap();
    let _writer = common::drive(watcher);
    reader.wait_until_ready().await.unwrap();
    let mut concluded = 0;
    for round in 0..10 {
        h.faults().page_delay(crate::verify::HOLD);
        let lists = h.counts().list;
        let verifying = tokio::spawn({
            let (dir, config) = (dir.clone(), config.clone());
            async move { tool(&["verify", &dir, "pods"], &config).await }
        });
        crate::verify::churn_during_the_first_list(&h, lists, round, || reader.checkpoint()).await;
        let (code, out, err) = verifying.await.unwrap();
        assert!(
            code == 0 || (code == 2 && err.contains("verifications in a row")),
            "round {round}: verify beside a churning writer: {code} {err}{out}"
        );
        if code == 0 {
            concluded += 1;
        }
    }
    assert!(concluded > 0, "no verification concluded in ten rounds");
}
