//! kube-rs' own examples, ported to kube-persist (`examples/pod_reflector.rs`,
//! `examples/configmapgen_controller.rs`): each is the upstream file with its construction
//! changed, and runs as its own process against the testkit, doing what the original does.
//!
//! The upstream files are those of kube-rs 4.2.0 (commit 526f1f2c, `examples/`; the
//! examples of the kube 5.0 line are the same). `ported/<name>.diff` is `diff upstream port`:
//! the test rebuilds the upstream file from the port and the diff, checks it against the
//! upstream file's FNV-1a hash, and counts the changed lines that are not `use` lines (the
//! port's promise in docs/controllers.md: at most two).

use std::process::Stdio;
use std::sync::{Arc, Mutex};

use crate::common::{eventually, kubeconfig};
use kube_persist_testkit::{ResourceType, ServerHandle, TestServer};
use serde_json::{Value, json};
use tokio::io::AsyncBufReadExt;

/// Changed lines allowed besides `use` lines.
const MAX_CHANGED: usize = 2;

/// FNV-1a 64 of the upstream files (kube-rs 4.2.0, `examples/<name>.rs`).
const UPSTREAM: [(&str, u64); 2] = [
    ("pod_reflector", 0xb35a_8704_090b_1a82),
    ("configmapgen_controller", 0xbc44_3bb9_f001_56b5),
];

fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// One hunk of a normal diff: upstream lines `from` (1-based, inclusive; empty for an
/// addition after `from.0`) became port lines `to`.
struct Hunk {
    from: (usize, usize),
    to: (usize, usize),
    removed: Vec<String>,
    added: Vec<String>,
}

fn range(s: &str) -> (usize, usize) {
    match s.split_once(',') {
        Some((a, b)) => (a.parse().unwrap(), b.parse().unwrap()),
        None => (s.parse().unwrap(), s.parse().unwrap()),
    }
}

/// The hunks of a normal diff (`diff old new`).
fn parse_diff(diff: &str) -> Vec<Hunk> {
    let mut hunks: Vec<Hunk> = Vec::new();
    for line in diff.lines() {
        if let Some(text) = line
            .strip_prefix("< ")
            .or(line.strip_prefix("<").filter(|r| r.is_empty()))
        {
            hunks.last_mut().unwrap().removed.push(text.to_string());
        } else if let Some(text) = line
            .strip_prefix("> ")
            .or(line.strip_prefix(">").filter(|r| r.is_empty()))
        {
            hunks.last_mut().unwrap().added.push(text.to_string());
        } else if line != "---" {
            let op = line.find(['a', 'c', 'd']).expect("a diff command");
            let (from, to) = (range(&line[..op]), range(&line[op + 1..]));
            let (from, to) = match &line[op..op + 1] {
                "a" => ((from.0 + 1, from.0), to),
                "d" => (from, (to.0 + 1, to.0)),
                _ => (from, to),
            };
            hunks.push(Hunk {
                from,
                to,
                removed: Vec::new(),
                added: Vec::new(),
            });
        }
    }
    hunks
}

/// The 1-based numbers of the lines in top-level `use` statements.
fn use_lines(lines: &[&str]) -> Vec<usize> {
    let mut out = Vec::new();
    let mut inside = false;
    for (i, line) in lines.iter().enumerate() {
        inside |= line.starts_with("use ");
        if inside {
            out.push(i + 1);
            inside = !line.trim_end().ends_with(';');
        }
    }
    out
}

/// (upstream rebuilt from the port and its diff, changed lines that are not `use` lines).
fn rebuild(port: &str, diff: &str) -> (String, usize) {
    let port_lines: Vec<&str> = port.lines().collect();
    let hunks = parse_diff(diff);
    let mut upstream: Vec<String> = Vec::new();
    let mut next = 1; // the next port line to copy
    for h in &hunks {
        while next < h.to.0 {
            upstream.push(port_lines[next - 1].to_string());
            next += 1;
        }
        let ported: Vec<&str> = port_lines[h.to.0 - 1..h.to.1].to_vec();
        assert_eq!(ported, h.added, "the diff's added lines are the port's");
        upstream.extend(h.removed.iter().cloned());
        next = h.to.1 + 1;
    }
    upstream.extend(port_lines[next - 1..].iter().map(|l| l.to_string()));
    let text = upstream.join("\n") + "\n";
    let up_refs: Vec<&str> = upstream.iter().map(String::as_str).collect();
    let (up_uses, port_uses) = (use_lines(&up_refs), use_lines(&port_lines));
    let changed = hunks
        .iter()
        .map(|h| {
            let added = (h.to.0..=h.to.1).filter(|n| !port_uses.contains(n)).count();
            let removed = (h.from.0..=h.from.1)
                .filter(|n| !up_uses.contains(n))
                .count();
            added.max(removed)
        })
        .sum();
    (text, changed)
}

#[test]
fn ported_examples_change_at_most_two_lines_of_upstream() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    for (name, hash) in UPSTREAM {
        let port = std::fs::read_to_string(root.join(format!("examples/{name}.rs"))).unwrap();
        let diff =
            std::fs::read_to_string(root.join(format!("tests/it/ported/{name}.diff"))).unwrap();
        let (upstream, changed) = rebuild(&port, &diff);
        assert_eq!(
            fnv1a64(upstream.as_bytes()),
            hash,
            "{name}: the port and tests/it/ported/{name}.diff no longer rebuild kube-rs' file \
             (regenerate the diff with `diff upstream.rs examples/{name}.rs`)"
        );
        println!("ported: {name}: {changed} changed lines besides use lines");
        assert!(changed <= MAX_CHANGED, "{name}: {changed} changed lines");
    }
}

#[test]
fn the_diff_count_sees_every_changed_line() {
    let upstream = "use a;\nfn main() {\n    one();\n    two();\n}\n";
    let port = "use a;\nuse b;\nfn main() {\n    uno();\n    dos();\n    tres();\n}\n";
    let diff = "1a2\n> use b;\n3,4c4,6\n<     one();\n<     two();\n---\n>     uno();\n>     dos();\n>     tres();\n";
    let (rebuilt, changed) = rebuild(port, diff);
    assert_eq!(rebuilt, upstream);
    assert_eq!(changed, 3);
}

/// The example binary `name`, built beside this test binary by `cargo test`.
fn example(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let bin = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(name);
    assert!(
        bin.exists(),
        "{} is not built (cargo test builds the examples)",
        bin.display()
    );
    bin
}

/// A running example: its process and every line it printed.
struct Running {
    child: tokio::process::Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Running {
    /// Starts example `name` in `dir` against `server` (its kubeconfig), logging at info.
    fn start(name: &str, dir: &std::path::Path, server: &TestServer) -> Running {
        let mut child = tokio::process::Command::new(example(name))
            .current_dir(dir)
            .env("KUBECONFIG", kubeconfig(dir, server))
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        let mut out = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        tokio::spawn(async move {
            while let Ok(Some(line)) = out.next_line().await {
                sink.lock().unwrap().push(line);
            }
        });
        Running { child, lines }
    }

    fn printed(&self, text: &str) -> bool {
        self.lines.lock().unwrap().iter().any(|l| l.contains(text))
    }

    /// Kills it (SIGKILL) and waits for it.
    async fn kill(mut self) {
        self.child.kill().await.unwrap();
    }
}

/// The streams of the store at `path`, opened after the example's process ended.
fn streams(path: &std::path::Path) -> Vec<(String, kube_persist::SyncPhase, u64)> {
    let db = kube_persist::Db::open(path).unwrap();
    let mut streams: Vec<_> = db
        .streams()
        .unwrap()
        .into_iter()
        .map(|s| (s.name, s.phase, s.objects))
        .collect();
    streams.sort_by(|a, b| a.0.cmp(&b.0));
    streams
}

/// The default durability (`Durability::Periodic(500 ms)`) makes commits durable in the
/// background every 500 ms, which nothing outside the writing process can observe (a
/// read-only handle is refused beside a periodic writer): a SIGKILL is sent this long
/// after the last change the test waited for, so that the store it leaves is the one the
/// example last wrote. (Not a wait for an absence: what is asserted after is read back.)
const FLUSHED: std::time::Duration = std::time::Duration::from_millis(2000);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_reflector_sees_the_pods_and_resumes_from_disk() {
    let server = TestServer::with_web_pods().await;
    let h = server.handle();
    let dir = tempfile::tempdir().unwrap();
    let run = Running::start("pod_reflector", dir.path(), &server);
    eventually("the reflector saw web-0 and web-1", || {
        run.printed("saw web-0") && run.printed("saw web-1")
    })
    .await;
    eventually("the watch after the list", || h.counts().watch >= 1).await;
    tokio::time::sleep(FLUSHED).await;
    run.kill().await;
    let store = dir.path().join("pod-reflector-store");
    let synced = kube_persist::SyncPhase::Synced;
    assert_eq!(streams(&store), [("pods@default".to_string(), synced, 2)]);
    let lists = h.counts().list;

    // Restarted: the stored Pods are replayed from disk (no LIST of the collection), and
    // the watch goes on from the checkpoint.
    let run = Running::start("pod_reflector", dir.path(), &server);
    eventually("the restarted reflector saw web-0 and web-1 again", || {
        run.printed("saw web-0") && run.printed("saw web-1")
    })
    .await;
    h.apply(
        &ResourceType::pods(),
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "web-2", "namespace": "default"},
            "spec": {"nodeName": "node-1"}
        }),
    );
    eventually("the restarted reflector saw web-2", || {
        run.printed("saw web-2")
    })
    .await;
    assert_eq!(
        h.counts().list,
        lists,
        "a restart resumes: no LIST of the collection"
    );
    run.kill().await;
    assert!(dir.path().join("pod-reflector-store").is_dir());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configmapgen_controller_owns_one_configmap_per_generator() {
    let server = TestServer::start().await;
    let h = server.handle();
    let cmg = ResourceType::new(
        "nullable.se",
        "v1",
        "configmapgenerators",
        "ConfigMapGenerator",
        true,
    );
    h.register(&cmg);
    let cms = ResourceType::configmaps();
    let generator = |content: &str| {
        json!({"apiVersion": "nullable.se/v1", "kind": "ConfigMapGenerator",
               "metadata": {"name": "gen-a", "namespace": "default"},
               "spec": {"content": content}})
    };
    h.apply(&cmg, generator("hello"));
    let uid = h.get(&cmg, Some("default"), "gen-a").unwrap()["metadata"]["uid"].clone();
    let content = |h: &ServerHandle| -> Option<Value> {
        let cm = h.get(&cms, Some("default"), "gen-a")?;
        (cm["metadata"]["ownerReferences"][0]["uid"] == uid).then(|| cm["data"]["content"].clone())
    };

    let dir = tempfile::tempdir().unwrap();
    let run = Running::start("configmapgen_controller", dir.path(), &server);
    eventually("the generator's ConfigMap, owned by it", || {
        content(&h) == Some(json!("hello"))
    })
    .await;
    // The generator changes: its ConfigMap follows.
    h.apply(&cmg, generator("bye"));
    eventually("the ConfigMap updated", || {
        content(&h) == Some(json!("bye"))
    })
    .await;
    // The owned ConfigMap is changed behind the controller's back: the change of an owned
    // object reconciles its owner, which writes it back.
    let mut cm = h.get(&cms, Some("default"), "gen-a").unwrap();
    cm["data"]["content"] = json!("tampered");
    h.apply(&cms, cm);
    eventually("the ConfigMap restored by its owner's reconcile", || {
        content(&h) == Some(json!("bye"))
    })
    .await;
    assert!(run.printed("reconciled"), "the run loop logs its results");
    // Both streams are on disk, named after what they watch.
    tokio::time::sleep(FLUSHED).await;
    run.kill().await;
    let streams = streams(&dir.path().join("cmg-store"));
    let names: Vec<&str> = streams.iter().map(|s| s.0.as_str()).collect();
    assert_eq!(names, ["configmapgenerators.nullable.se", "configmaps"]);
    assert!(
        streams
            .iter()
            .all(|s| s.1 == kube_persist::SyncPhase::Synced),
        "{streams:?}"
    );
}
