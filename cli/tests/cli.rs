//! The `kube-persist` tool as operators run it: a child process over a store on disk, and
//! for `verify` a testkit API server reached through a kubeconfig.

#[path = "../../tests/common/mod.rs"]
mod common;

use std::path::Path;
use std::process::{Command, Stdio};

use common::*;
use kube_persist::{Db, DbConfig, EncryptionKey};
use kube_persist_testkit::{ResourceType, TestServer};

fn key(b: u8) -> EncryptionKey {
    EncryptionKey::from_bytes([b; 32])
}

/// Exit status, stdout and stderr of the tool.
struct Run {
    code: Option<i32>,
    out: String,
    err: String,
}

impl Run {
    fn last_line(&self) -> &str {
        self.out.lines().last().unwrap_or("")
    }
}

fn tool(args: &[&str], env: &[(&str, &str)], stdin: Option<&str>) -> Run {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kube-persist"));
    cmd.args(args)
        .env_remove("KUBE_PERSIST_KEY")
        .env_remove("KUBECONFIG")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let mut input = child.stdin.take().unwrap();
    if let Some(text) = stdin {
        use std::io::Write;
        input.write_all(text.as_bytes()).unwrap();
    }
    drop(input);
    let out = child.wait_with_output().unwrap();
    Run {
        code: out.status.code(),
        out: String::from_utf8_lossy(&out.stdout).into_owned(),
        err: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A kubeconfig whose context `testkit` points at `server` (plain HTTP, no credentials).
fn kubeconfig(dir: &Path, server: &TestServer) -> String {
    let path = dir.join("kubeconfig");
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: testkit\n  cluster:\n    server: {}\n\
             contexts:\n- name: testkit\n  context:\n    cluster: testkit\n    user: nobody\n\
             users:\n- name: nobody\n  user: {{}}\ncurrent-context: other\n",
            server.url()
        ),
    )
    .unwrap();
    path.to_str().unwrap().to_string()
}

/// Sync `pods` into a new store at `dir` and return its checkpoint.
async fn synced_store(engine: Engine, server: &TestServer, dir: &Path) -> String {
    let db = Db::open_with(dir, DbConfig::default().engine(engine)).unwrap();
    sync_pods(server, &db).await;
    db.flush().unwrap();
    let info = db.streams().unwrap().remove(0);
    assert_eq!(
        info.objects as usize,
        server
            .handle()
            .resource_versions(&ResourceType::pods())
            .len()
    );
    drop(db);
    wait_unlocked(dir);
    info.checkpoint.expect("a synced store has a checkpoint")
}

/// `verify` against the server: equal, stale (behind by newer changes), stale past a
/// compaction (undecidable), and changed on disk (wrong).
async fn verify_equal_stale_compacted_and_damaged_stores(engine: Engine) {
    init_tracing();
    let server = TestServer::start().await;
    let h = server.handle();
    h.seed_pods(300, 3);
    let tmp = tempfile::tempdir().unwrap();
    let config = kubeconfig(tmp.path(), &server);
    let env = [("KUBECONFIG", config.as_str())];
    let dir = tmp.path().join("a");
    let d = dir.to_str().unwrap();
    let cp = synced_store(engine, &server, &dir).await;

    // Equal. The kubeconfig's current context is elsewhere: --context chooses.
    let run = tool(&["verify", d, "pods", "--context", "testkit"], &env, None);
    assert_eq!(run.code, Some(0), "{}{}", run.out, run.err);
    assert_eq!(
        run.last_line(),
        format!("verify ok: 300 objects equal at resourceVersion {cp}")
    );
    let run = tool(
        &["verify", d, "pods", "--context", "testkit", "-o", "json"],
        &env,
        None,
    );
    assert_eq!(run.code, Some(0), "{}{}", run.out, run.err);
    let doc: serde_json::Value = serde_json::from_str(&run.out).unwrap();
    assert_eq!(
        (&doc["ok"], &doc["verdict"], &doc["checkpoint"]),
        (&true.into(), &"equal".into(), &cp.clone().into())
    );
    assert_eq!(doc["stored_objects"], 300);

    // Stale: the server moves on while the store is closed. Every change is newer than
    // the checkpoint, so the store is behind, not wrong.
    let before = h.resource_versions(&ResourceType::pods());
    h.churn(7, 2, 1, 41);
    let after = h.resource_versions(&ResourceType::pods());
    let changed = before
        .keys()
        .chain(after.keys())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .filter(|k| before.get(k) != after.get(k))
        .count();
    assert!(changed >= 3, "the churn changed {changed} objects");
    let run = tool(&["verify", d, "pods", "--context", "testkit"], &env, None);
    assert_eq!(run.code, Some(0), "{}{}", run.out, run.err);
    assert_eq!(
        run.last_line(),
        format!(
            "verify ok: 300 objects equal at resourceVersion {cp}; the store is behind the \
             server only by {changed} changes newer than it"
        )
    );
    assert!(
        run.out
            .contains(&format!("the server changed {changed} objects after")),
        "{}",
        run.out
    );

    // After a compaction the server cannot list at the checkpoint: not provable either
    // way, which has its own exit status (3), apart from "differs" (1).
    h.compact();
    let run = tool(&["verify", d, "pods", "--context", "testkit"], &env, None);
    assert_eq!(run.code, Some(3), "{}{}", run.out, run.err);
    assert!(run.last_line().contains("compacted"), "{}", run.out);
    let verify_help = tool(&["verify", "--help"], &[], None).out;
    assert_eq!(run.code, Some(documented_status(&verify_help, "undecided")));
    let run = tool(
        &["verify", d, "pods", "--context", "testkit", "-o", "json"],
        &env,
        None,
    );
    assert_eq!(run.code, Some(3), "{}{}", run.out, run.err);
    let doc: serde_json::Value = serde_json::from_str(&run.out).unwrap();
    assert_eq!(
        (&doc["ok"], &doc["verdict"], &doc["checkpoint"]),
        (&false.into(), &"undecided".into(), &cp.clone().into())
    );

    // Damaged on disk: one object removed, one copied under a name the server lacks.
    let dir = tmp.path().join("b");
    let d = dir.to_str().unwrap();
    let cp = synced_store(engine, &server, &dir).await;
    let (ns, name) = after.keys().next().unwrap().clone();
    let key = format!("o{ns}\0{name}").into_bytes();
    let mut record = None;
    raw_edit(engine, &dir, "stream/pods", &key, |v| {
        record = v;
        None
    });
    let extra = format!("o{ns}\0zz-not-on-server").into_bytes();
    raw_edit(engine, &dir, "stream/pods", &extra, |_| record);
    let run = tool(
        &[
            "verify",
            d,
            "pods",
            "--context",
            "testkit",
            "--max-differences",
            "1",
        ],
        &env,
        None,
    );
    assert_eq!(run.code, Some(1), "{}{}", run.out, run.err);
    assert!(
        run.out
            .contains("2 differences from the server's collection at the store's checkpoint"),
        "{}",
        run.out
    );
    assert!(
        run.out
            .contains(&format!("missing {ns}/{name}: on the server at "))
            && run.out.contains("... and 1 more"),
        "{}",
        run.out
    );
    assert_eq!(
        run.last_line(),
        format!("verify failed: the store differs from the server at resourceVersion {cp}")
    );
    let run = tool(&["verify", d, "pods", "--context", "testkit"], &env, None);
    assert!(
        run.out
            .contains(&format!("extra {ns}/zz-not-on-server: stored at ")),
        "{}",
        run.out
    );

    // Errors name what is wrong and exit 2.
    let run = tool(&["verify", d, "nope", "--context", "testkit"], &env, None);
    assert_eq!(run.code, Some(2));
    assert!(run.err.contains("no stream \"nope\""), "{}", run.err);
}

/// `stats`, as text and as JSON.
async fn stats_text_and_json(engine: Engine) {
    let server = TestServer::start().await;
    server.handle().seed_pods(120, 2);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let d = dir.to_str().unwrap();
    let cp = synced_store(engine, &server, &dir).await;
    let run = tool(&["stats", d], &[], None);
    assert_eq!(run.code, Some(0), "{}", run.err);
    for line in [
        "stream pods".to_string(),
        "  objects:     120".into(),
        format!("  checkpoint:  {cp}"),
        "  phase:       Synced".into(),
        format!("  engine:      {}", engine.name()),
        "  kind:        v1 Pod".into(),
        "  url:         /api/v1/pods".into(),
        "  stores:      whole objects".into(),
        "  encrypted:   no".into(),
    ] {
        assert!(
            run.out.lines().any(|l| l == line),
            "no line {line:?} in\n{}",
            run.out
        );
    }
    let run = tool(&["stats", d, "-o", "json"], &[], None);
    assert_eq!(run.code, Some(0), "{}", run.err);
    let doc: serde_json::Value = serde_json::from_str(&run.out).unwrap();
    assert_eq!(doc["engine"], engine.name());
    let s = &doc["streams"][0];
    assert_eq!(s["name"], "pods");
    assert_eq!(s["objects"], 120);
    assert_eq!(s["checkpoint"], cp.as_str());
    assert_eq!(s["phase"], "Synced");
    assert_eq!(s["identity"]["kind"], "Pod");
    assert_eq!(s["identity"]["shard_selector"], serde_json::Value::Null);
    let bytes = s["disk_bytes"].as_u64().unwrap();
    assert!(bytes > 120 * 500, "120 Pods in {bytes} bytes");
    assert!(doc["disk_bytes"].as_u64().unwrap() >= bytes);
}

/// `destroy` asks first, and refuses what is not a store.
async fn destroy_confirms_and_refuses_non_stores(engine: Engine) {
    let server = TestServer::start().await;
    server.handle().seed_pods(10, 1);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let d = dir.to_str().unwrap();
    synced_store(engine, &server, &dir).await;
    let run = tool(&["destroy", d], &[], Some("no\n"));
    assert_eq!(run.code, Some(1), "{}", run.err);
    assert!(run.err.contains("Type 'yes' to confirm") && run.err.contains("nothing removed"));
    assert!(dir.exists());
    let run = tool(&["destroy", d], &[], Some("yes\n"));
    assert_eq!(run.code, Some(0), "{}", run.err);
    assert!(!dir.exists());

    synced_store(engine, &server, &dir).await;
    let run = tool(&["destroy", d, "--yes"], &[], None);
    assert_eq!(
        (run.code, run.out.trim()),
        (Some(0), format!("destroyed {d}").as_str())
    );
    assert!(!dir.exists());

    let notes = tmp.path().join("notes");
    std::fs::create_dir(&notes).unwrap();
    std::fs::write(notes.join("todo.txt"), "keep me").unwrap();
    let run = tool(&["destroy", notes.to_str().unwrap(), "--yes"], &[], None);
    assert_eq!(run.code, Some(2));
    assert!(run.err.contains("no kube-persist store"), "{}", run.err);
    assert!(notes.join("todo.txt").exists());
}
/// The `kube-persist` tool reads stores, and refuses to print an encrypted one without its key.
async fn cli_inspect_get_dump_with_and_without_key(engine: Engine) {
    let server = TestServer::start().await;
    server.handle().seed_pods(40, 2);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    {
        let db = Db::open_with(
            &dir,
            DbConfig::default().engine(engine).encryption_key(key(9)),
        )
        .unwrap();
        sync_pods(&server, &db).await;
        db.flush().unwrap();
    }
    wait_unlocked(&dir);
    let hex: String = std::iter::repeat_n("09", 32).collect();
    let cli = |args: &[&str], with_key: bool| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kube-persist"));
        cmd.args(args).env_remove("KUBE_PERSIST_KEY");
        if with_key {
            cmd.env("KUBE_PERSIST_KEY", &hex);
        }
        let out = cmd.output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let d = dir.to_str().unwrap();
    let (code, out, _) = cli(&["inspect", d], false);
    assert_eq!(code, Some(0));
    assert!(
        out.contains("stream pods")
            && out.contains("objects:    40")
            && out.contains("encrypted:  yes"),
        "{out}"
    );

    let (code, out, err) = cli(&["get", d, "pods", "ns-1/pod-1"], false);
    assert_eq!(code, Some(2), "{out}");
    assert!(err.contains("encrypted") && out.is_empty(), "{err}");
    // An empty KUBE_PERSIST_KEY is not taken as no key: an error naming the variable.
    let run = tool(
        &["get", d, "pods", "ns-1/pod-1"],
        &[("KUBE_PERSIST_KEY", "")],
        None,
    );
    assert_eq!(run.code, Some(2), "{}", run.out);
    assert!(
        run.err.contains("KUBE_PERSIST_KEY") && run.err.contains("empty") && run.out.is_empty(),
        "{}",
        run.err
    );
    let (code, out, _) = cli(&["get", d, "pods", "ns-1/pod-1"], true);
    assert_eq!(code, Some(0));
    let pod: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(pod["metadata"]["name"], "pod-1");

    let (code, _, err) = cli(&["dump", d, "pods"], false);
    assert_eq!(code, Some(2), "{err}");
    let (code, out, _) = cli(&["dump", d, "pods"], true);
    assert_eq!(code, Some(0));
    assert_eq!(out.lines().count(), 40);
    assert!(
        out.lines()
            .all(|l| serde_json::from_str::<serde_json::Value>(l).is_ok())
    );
    let (code, _, err) = cli(&["get", d, "nope", "x"], true);
    assert_eq!(code, Some(2));
    assert!(err.contains("no stream"), "{err}");

    // A reader that goes away (`| head`): the pipe is closed before the tool writes, so
    // every write fails with EPIPE. The tool exits 0 quietly, without a panic.
    for args in [
        &["inspect", d][..],
        &["get", d, "pods", "ns-1/pod-1"],
        &["dump", d, "pods"],
    ] {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kube-persist"))
            .args(args)
            .env("KUBE_PERSIST_KEY", &hex)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {err}");
        assert!(err.is_empty(), "{args:?} wrote to stderr: {err}");
    }
}

/// `stats` shows a durable controller's state: objects tracked, pending requeues, the
/// oldest due time.
async fn stats_shows_controller_state(engine: Engine) {
    use futures::StreamExt;
    use k8s_openapi::api::core::v1::Pod;
    use kube::runtime::controller::Action;
    use kube_persist::controller::{self, Controller};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    let server = TestServer::start().await;
    server.handle().seed_pods(30, 2);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let before_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    {
        let db = Db::open_with(&dir, DbConfig::default().engine(engine)).unwrap();
        let done = Arc::new(AtomicUsize::new(0));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let tx = std::sync::Mutex::new(Some(tx));
        let controller = db
            .store(
                "pods",
                kube::Api::<Pod>::all(server.client()),
                kube_persist::StreamConfig::default(),
            )
            .map(|pair| Controller::for_store(pair).with_config(controller::Config::default()))
            .unwrap()
            .durable_state("labeler")
            .unwrap()
            .graceful_shutdown_on(async move {
                let _ = rx.await;
            });
        let count = done.clone();
        controller
            .run(
                move |_pod: Arc<Pod>, _ctx: Arc<()>| {
                    let count = count.clone();
                    async move {
                        count.fetch_add(1, Ordering::SeqCst);
                        Ok::<_, kube::Error>(Action::requeue(Duration::from_secs(3600)))
                    }
                },
                |_pod: Arc<Pod>, _err: &kube::Error, _ctx: Arc<()>| Action::await_change(),
                Arc::new(()),
            )
            .for_each(|_| {
                if done.load(Ordering::SeqCst) == 30
                    && let Some(tx) = tx.lock().unwrap().take()
                {
                    let _ = tx.send(());
                }
                async {}
            })
            .await;
        db.flush().unwrap();
    }
    wait_unlocked(&dir);
    let d = dir.to_str().unwrap();
    let run = tool(&["stats", d], &[], None);
    assert_eq!(run.code, Some(0), "{}", run.err);
    for line in [
        "controller labeler",
        "  kinds:             v1/Pod",
        "  objects tracked:   30",
        "  pending requeues:  30",
    ] {
        assert!(
            run.out.lines().any(|l| l == line),
            "no line {line:?} in\n{}",
            run.out
        );
    }
    let run = tool(&["stats", d, "-o", "json"], &[], None);
    let doc: serde_json::Value = serde_json::from_str(&run.out).unwrap();
    let c = &doc["controllers"][0];
    assert_eq!(
        (c["name"].as_str(), c["objects_tracked"].as_u64()),
        (Some("labeler"), Some(30))
    );
    assert_eq!(c["pending_requeues"], 30);
    let due = c["oldest_due_unix_ms"].as_u64().unwrap();
    assert!(
        due >= before_ms + 3_500_000,
        "due {due}, started {before_ms}"
    );

    // controller-states: the same, then the state removed (after confirmation).
    let run = tool(&["controller-states", d], &[], None);
    assert_eq!(run.code, Some(0), "{}", run.err);
    assert!(
        run.out.lines().any(|l| l == "  objects tracked:   30"),
        "{}",
        run.out
    );
    let run = tool(&["controller-states", d, "-o", "json"], &[], None);
    let doc: serde_json::Value = serde_json::from_str(&run.out).unwrap();
    assert_eq!(
        (doc[0]["name"].as_str(), doc[0]["pending_requeues"].as_u64()),
        (Some("labeler"), Some(30))
    );
    let run = tool(
        &["controller-states", d, "--drop", "labeler"],
        &[],
        Some("no\n"),
    );
    assert_eq!(run.code, Some(1), "not confirmed: the answer is no");
    assert!(run.err.contains("nothing removed"), "{}", run.err);
    let run = tool(&["controller-states", d, "-o", "json"], &[], None);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&run.out).unwrap()[0]["name"],
        "labeler"
    );
    let run = tool(
        &[
            "controller-states",
            d,
            "--drop",
            "labeler",
            "--yes",
            "-o",
            "json",
        ],
        &[],
        None,
    );
    assert_eq!(run.code, Some(0), "{}", run.err);
    let doc: serde_json::Value = serde_json::from_str(&run.out).unwrap();
    assert_eq!(doc["removed"]["controller_state"], "labeler");
    let run = tool(&["controller-states", d], &[], None);
    assert_eq!(run.out.trim(), format!("no controller states in {d}"));
    let run = tool(
        &["controller-states", d, "--drop", "labeler", "--yes"],
        &[],
        None,
    );
    assert_eq!(run.code, Some(2), "no such state: an error");
    assert!(
        run.err.contains("no controller state \"labeler\""),
        "{}",
        run.err
    );
    // The stream is untouched.
    let run = tool(&["stats", d, "-o", "json"], &[], None);
    let doc: serde_json::Value = serde_json::from_str(&run.out).unwrap();
    assert_eq!(doc["streams"][0]["objects"], 30);
}

/// `-o json` on the reading commands, exit status 1 for an object that is not there, and
/// `drop-stream` (confirmed, refused, and of a stream that is not there).
async fn json_output_exit_codes_and_drop_stream(engine: Engine) {
    let server = TestServer::start().await;
    server.handle().seed_pods(20, 2);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let cp = synced_store(engine, &server, &dir).await;
    let d = dir.to_str().unwrap();
    let run = tool(&["inspect", d, "-o", "json"], &[], None);
    assert_eq!(run.code, Some(0), "{}", run.err);
    let doc: serde_json::Value = serde_json::from_str(&run.out).unwrap();
    assert_eq!(doc["engine"], engine.name());
    assert_eq!(doc["streams"][0]["name"], "pods");
    assert_eq!(doc["streams"][0]["objects"], 20);
    assert_eq!(doc["streams"][0]["checkpoint"], cp);
    let run = tool(&["get", d, "pods", "ns-1/pod-1", "-o", "json"], &[], None);
    assert_eq!(run.code, Some(0), "{}", run.err);
    assert_eq!(run.out.lines().count(), 1, "one compact document");
    let pod: serde_json::Value = serde_json::from_str(&run.out).unwrap();
    assert_eq!(pod["metadata"]["name"], "pod-1");
    let run = tool(&["get", d, "pods", "ns-1/no-such-pod"], &[], None);
    assert_eq!(run.code, Some(1), "not found is the answer no: {}", run.err);
    assert!(run.out.is_empty() && run.err.contains("ns-1/no-such-pod is not in stream"));

    let run = tool(&["drop-stream", d, "pods"], &[], Some("nope\n"));
    assert_eq!(run.code, Some(1));
    let run = tool(&["inspect", d, "-o", "json"], &[], None);
    let doc: serde_json::Value = serde_json::from_str(&run.out).unwrap();
    assert_eq!(doc["streams"][0]["objects"], 20, "not confirmed: kept");
    let run = tool(&["drop-stream", d, "pods"], &[], Some("yes\n"));
    assert_eq!(run.code, Some(0), "{}", run.err);
    assert_eq!(run.last_line(), "dropped stream pods");
    let run = tool(&["inspect", d, "-o", "json"], &[], None);
    let doc: serde_json::Value = serde_json::from_str(&run.out).unwrap();
    assert_eq!(doc["streams"], serde_json::json!([]), "{doc}");
    let run = tool(
        &["drop-stream", d, "pods", "--yes", "-o", "json"],
        &[],
        None,
    );
    assert_eq!(run.code, Some(2), "no such stream: an error");
    assert!(run.err.contains("no stream \"pods\""), "{}", run.err);

    // The store still opens, and the stream lists from scratch when opened again.
    let db = Db::open(&dir).unwrap();
    sync_pods(&server, &db).await;
    assert_eq!(db.streams().unwrap()[0].objects, 20);
}

/// The reading commands beside a running controller: on redb they open the store read-only
/// and see its commits while a writer with `Durability::EveryBatch` runs (one with periodic
/// durability keeps it locked; sled, without a read-only mode, is locked); on a closed store
/// they change nothing on disk (no permission tightening).
async fn reading_commands_on_a_live_store(engine: Engine) {
    use std::os::unix::fs::PermissionsExt;
    let server = TestServer::start().await;
    let h = server.handle();
    h.seed_pods(25, 2);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let d = dir.to_str().unwrap();
    // A writer with periodic durability (the default) keeps a redb store to itself.
    {
        let db = Db::open_with(&dir, DbConfig::default().engine(engine)).unwrap();
        let run = tool(&["stats", d], &[], None);
        assert_eq!(run.code, Some(2), "locked by the writer: {}", run.out);
        assert!(run.err.contains("locked"), "{}", run.err);
        drop(db);
        wait_unlocked(&dir);
    }
    // One that makes every batch durable lets readers in.
    let config = DbConfig::default()
        .engine(engine)
        .durability(kube_persist::Durability::EveryBatch);
    let db = Db::open_with(&dir, config).unwrap();
    let (reader, watcher) = db
        .store(
            "pods",
            kube::Api::<k8s_openapi::api::core::v1::Pod>::all(server.client()),
            kube_persist::StreamConfig::default(),
        )
        .unwrap();
    let w = drive(watcher);
    converge(&reader, &h, &ResourceType::pods()).await;
    let objects = |run: &Run| -> u64 {
        let doc: serde_json::Value = serde_json::from_str(&run.out)
            .unwrap_or_else(|e| panic!("{e}: {} {}", run.out, run.err));
        doc["streams"][0]["objects"].as_u64().unwrap()
    };
    let run = tool(&["stats", d, "-o", "json"], &[], None);
    match engine {
        Engine::Redb => {
            assert_eq!(run.code, Some(0), "{}", run.err);
            assert_eq!(objects(&run), 25);
            // The writer goes on; a new reader sees its commits.
            h.churn(0, 5, 0, 3);
            converge(&reader, &h, &ResourceType::pods()).await;
            let run = tool(&["inspect", d, "-o", "json"], &[], None);
            assert_eq!(objects(&run), 30, "{}", run.err);
            let run = tool(&["get", d, "pods", "ns-1/pod-1"], &[], None);
            assert_eq!(run.code, Some(0), "{}", run.err);
            // Removing needs the store for itself.
            let run = tool(&["drop-stream", d, "pods", "--yes"], &[], None);
            assert_eq!(run.code, Some(2));
            assert!(
                run.err.contains("locked") || run.err.contains("open"),
                "{}",
                run.err
            );
        }
        _ => {
            assert_eq!(
                run.code,
                Some(2),
                "sled: no read-only mode, and the store is held"
            );
            assert!(run.err.contains("locked"), "{}", run.err);
        }
    }
    w.stop().await;
    drop((reader, db));
    wait_unlocked(&dir);
    if engine == Engine::Redb {
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o750)).unwrap();
        let run = tool(&["stats", d], &[], None);
        assert_eq!(run.code, Some(0), "{}", run.err);
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o750, "a reading command changes no permission");
    }
}

/// Every file below `dir` by path: its permission bits and a hash of its bytes.
fn files_below(dir: &Path) -> std::collections::BTreeMap<std::path::PathBuf, (u32, u64)> {
    use std::hash::{DefaultHasher, Hash, Hasher};
    modes_below(dir)
        .into_iter()
        .map(|(path, mode)| {
            let mut hash = DefaultHasher::new();
            if path.is_file() {
                std::fs::read(&path).unwrap().hash(&mut hash);
            }
            (path, (mode, hash.finish()))
        })
        .collect()
}

/// Issue 58 item 5: a reading command never writes to a store. After each reading command
/// every file of the store is byte for byte what it was, with its permissions, on either
/// engine: redb's are opened read-only, and sled's (no read-only mode) are copied into a
/// private temporary directory (under TMPDIR) that is gone when the command ends. The
/// output names the store, not its copy.
async fn reading_commands_leave_every_file_of_the_store_unchanged(engine: Engine) {
    let server = TestServer::start().await;
    server.handle().seed_pods(200, 3);
    let tmp = tempfile::tempdir().unwrap();
    let config = kubeconfig(tmp.path(), &server);
    let scratch = tmp.path().join("tmp");
    std::fs::create_dir(&scratch).unwrap();
    let env = [
        ("KUBECONFIG", config.as_str()),
        ("TMPDIR", scratch.to_str().unwrap()),
    ];
    let dir = tmp.path().join("cache");
    let d = dir.to_str().unwrap();
    synced_store(engine, &server, &dir).await;
    let before = files_below(&dir);
    assert!(before.len() > 2, "{before:?}");
    for args in [
        &["inspect", d][..],
        &["inspect", d, "-o", "json"],
        &["stats", d],
        &["stats", d, "-o", "json"],
        &["get", d, "pods", "ns-0/pod-0"],
        &["get", d, "pods", "ns-0/no-such-pod"],
        &["dump", d, "pods"],
        &["controller-states", d],
        &["verify", d, "pods", "--context", "testkit"],
    ] {
        let run = tool(args, &env, None);
        let want = if args.contains(&"ns-0/no-such-pod") {
            1
        } else {
            0
        };
        assert_eq!(run.code, Some(want), "{args:?}: {}{}", run.out, run.err);
        assert!(
            files_below(&dir) == before,
            "{args:?} changed the store's files"
        );
        assert_eq!(
            std::fs::read_dir(&scratch).unwrap().count(),
            0,
            "{args:?} left a copy behind"
        );
        if args[0] == "inspect" || args[0] == "stats" {
            assert!(run.out.contains(d), "{args:?} names the store: {}", run.out);
            assert!(
                !run.out.contains(scratch.to_str().unwrap()),
                "{args:?}: {}",
                run.out
            );
        }
    }
    let run = tool(&["dump", d, "pods"], &env, None);
    assert_eq!(run.out.lines().count(), 200);
}

/// Issue 56 item 6: a store directory that also holds a user's files (a script, a folder)
/// is refused by every command, reading or removing, on either engine (sled's reading
/// commands open it for writing), and nothing in it changes: no permission, no file.
async fn commands_refuse_a_store_beside_other_files_and_change_nothing(engine: Engine) {
    let server = TestServer::start().await;
    server.handle().seed_pods(10, 1);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let d = dir.to_str().unwrap();
    synced_store(engine, &server, &dir).await;
    wait_unlocked(&dir);
    add_user_files(&dir);
    let before = modes_below(&dir);
    for args in [
        &["stats", d][..],
        &["inspect", d],
        &["get", d, "pods", "ns-0/pod-0"],
        &["dump", d, "pods"],
        &["controller-states", d],
        &["drop-stream", d, "pods", "--yes"],
        &["destroy", d, "--yes"],
    ] {
        let run = tool(args, &[], None);
        assert_eq!(run.code, Some(2), "{args:?}: {}{}", run.out, run.err);
        assert!(
            run.err.contains("is not a kube-persist store directory")
                && run.err.contains("run.sh")
                && run.err.contains(d),
            "{args:?}: {}",
            run.err
        );
        assert_eq!(modes_below(&dir), before, "{args:?} changed the directory");
    }
}

/// Issue 39 item 3: `dump` into a reader that does not read (a pager left open) must not
/// keep a controller from starting. The tool reads a redb store in pieces and closes it
/// before it writes a piece, so while its stdout is blocked a writer with periodic
/// durability (the default) opens the store; the dump then ends at its next piece with
/// "locked" (exit status 2), after the objects it printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dump_into_a_blocked_pipe_does_not_keep_a_writer_out() {
    use std::io::Read;
    use std::os::fd::AsRawFd;
    let server = TestServer::start().await;
    // Far more than a pipe holds (64 KiB), and more than one piece (1000 objects).
    server.handle().seed_pods(1500, 5);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    synced_store(Engine::Redb, &server, &dir).await;
    let mut child = Command::new(env!("CARGO_BIN_EXE_kube-persist"))
        .args(["dump", dir.to_str().unwrap(), "pods"])
        .env_remove("KUBE_PERSIST_KEY")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    // The tool has opened the store and printed: output waits in the pipe, never read.
    let mut poll = libc::pollfd {
        fd: out.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for a descriptor `out` owns.
    let ready = unsafe { libc::poll(&mut poll, 1, 60_000) };
    assert_eq!(ready, 1, "the dump printed nothing within 60 s");
    let path = dir.clone();
    let opened = tokio::task::spawn_blocking(move || Db::open(&path))
        .await
        .unwrap();
    let db = opened.expect("a writer opens the store while the dump's stdout is blocked");
    assert!(
        child.try_wait().unwrap().is_none(),
        "the dump is still blocked on its stdout"
    );
    // Read now: the dump ends at its next piece, which the writer's store refuses.
    let mut printed = String::new();
    out.read_to_string(&mut printed).unwrap();
    let end = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&end.stderr);
    assert_eq!(end.status.code(), Some(2), "{err}");
    assert!(err.contains("locked"), "{err}");
    let lines = printed.lines().count();
    assert!(lines > 0 && lines < 1500, "{lines} objects printed");
    assert!(
        printed
            .lines()
            .all(|l| serde_json::from_str::<serde_json::Value>(l).is_ok())
    );
    drop(db);
}

/// Issue 58 item 5: a controller ships the commands in its own binary through the package's
/// library: `main_from_args` runs them in the calling process with the tool's exit
/// statuses, as often as it is called (the second call finds a log subscriber set).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_commands_run_embedded_in_a_controllers_binary() {
    use std::process::ExitCode;
    let server = TestServer::start().await;
    server.handle().seed_pods(20, 2);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    synced_store(Engine::Redb, &server, &dir).await;
    let d = dir.to_str().unwrap().to_string();
    let run = |args: Vec<String>| {
        tokio::task::spawn_blocking(move || kube_persist_cli::main_from_args(args))
    };
    let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    // As `my-operator kube-persist ...` passes them on: the tool's name first.
    let code = run(args(&[
        "kube-persist",
        "get",
        &d,
        "pods",
        "ns-0/pod-0",
        "-o",
        "json",
    ]));
    assert_eq!(code.await.unwrap(), ExitCode::SUCCESS);
    let code = run(args(&["kube-persist", "get", &d, "pods", "ns-0/nothing"]));
    assert_eq!(code.await.unwrap(), ExitCode::from(1));
    let missing = tmp.path().join("missing");
    let code = run(args(&["kube-persist", "stats", missing.to_str().unwrap()]));
    assert_eq!(code.await.unwrap(), ExitCode::from(2));
    let code = run(args(&["kube-persist", "stats", "--no-such-flag"]));
    assert_eq!(code.await.unwrap(), ExitCode::from(2));
}

#[test]
fn every_command_has_help() {
    for command in [
        "inspect",
        "stats",
        "get",
        "dump",
        "verify",
        "controller-states",
        "drop-stream",
        "destroy",
    ] {
        let run = tool(&[command, "--help"], &[], None);
        assert_eq!(run.code, Some(0), "{command}: {}", run.err);
        assert!(
            run.out.contains("Usage: kube-persist"),
            "{command}: {}",
            run.out
        );
    }
    let run = tool(&["frobnicate"], &[], None);
    assert_eq!(run.code, Some(2));
}

/// The status that the line containing `text` under the help's "Exit status:" gives (the
/// line's first word).
fn documented_status(help: &str, text: &str) -> i32 {
    let (_, statuses) = help
        .split_once("\nExit status:\n")
        .unwrap_or_else(|| panic!("no exit statuses in the help:\n{help}"));
    let line = statuses
        .lines()
        .find(|l| l.contains(text))
        .unwrap_or_else(|| panic!("no line with {text:?} in the help:\n{help}"));
    line.split_whitespace()
        .next()
        .and_then(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("{line:?} does not start with a status"))
}

/// `--help` (and `-h`) lists the exit statuses, and the tool exits with them: a usage error,
/// an error and a removal not confirmed each with the status the help gives it.
#[test]
fn help_lists_exit_statuses() {
    let help = tool(&["--help"], &[], None);
    assert_eq!(help.code, Some(0), "{}", help.err);
    let help = help.out;
    assert!(help.contains("\nExit status:\n"), "{help}");
    assert_eq!(documented_status(&help, "done, or the answer is yes"), 0);
    assert_eq!(documented_status(&help, "the answer is no:"), 1);
    assert_eq!(documented_status(&help, "a usage error (bad arguments)"), 2);
    assert!(tool(&["-h"], &[], None).out.contains("\nExit status:\n"));

    // A usage error: clap's status, as the help says.
    let run = tool(&["get", "--no-such-flag"], &[], None);
    let usage = documented_status(&help, "a usage error");
    assert_eq!(run.code, Some(usage), "{}", run.err);
    assert!(run.err.contains("Usage: kube-persist get"), "{}", run.err);

    // An error: a directory that is not a store.
    let tmp = tempfile::tempdir().unwrap();
    let notes = tmp.path().join("notes");
    std::fs::create_dir(&notes).unwrap();
    let run = tool(&["inspect", notes.to_str().unwrap()], &[], None);
    assert_eq!(run.code, Some(documented_status(&help, "an error")));
    assert!(run.err.contains("no kube-persist store"), "{}", run.err);

    // The answer no: a removal not confirmed, per the top-level help and `destroy`'s own.
    let dir = tmp.path().join("cache");
    drop(Db::open(&dir).unwrap());
    let d = dir.to_str().unwrap();
    let destroy_help = tool(&["destroy", "--help"], &[], None).out;
    let no = documented_status(&destroy_help, "not confirmed");
    assert_eq!(no, documented_status(&help, "the answer is no:"));
    let run = tool(&["destroy", d], &[], Some("no\n"));
    assert_eq!(run.code, Some(no), "{}", run.err);
    assert!(dir.exists());

    // The commands with their own meaning of 1 list it in their help.
    for (command, text) in [
        ("get", "the object is not in the stream"),
        ("verify", "the store differs from the server"),
        ("controller-states", "a removal (--drop) not confirmed"),
        ("drop-stream", "not confirmed"),
    ] {
        let run = tool(&[command, "--help"], &[], None);
        assert_eq!(
            documented_status(&run.out, text),
            1,
            "{command}: {}",
            run.out
        );
        assert_eq!(documented_status(&run.out, "an error"), 2, "{command}");
    }
}

/// `KUBE_PERSIST_KEY` unset is no key: the tool reads an unencrypted store. Set but empty
/// or blank (a failed `$(openssl rand -hex 32)`) is an error naming the variable (issue 60
/// item 2: it was no key), as is any other value that is not 64 hex characters.
#[test]
fn empty_key_env_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    drop(Db::open(&dir).unwrap());
    let d = dir.to_str().unwrap();
    let run = tool(&["inspect", d], &[], None);
    assert_eq!(run.code, Some(0), "unset: {}", run.err);
    for value in ["", " \n", "0a0b"] {
        let run = tool(&["inspect", d], &[("KUBE_PERSIST_KEY", value)], None);
        assert_eq!(run.code, Some(2), "{value:?}: {}", run.out);
        assert!(
            run.err.contains("KUBE_PERSIST_KEY"),
            "{value:?}: {}",
            run.err
        );
    }
}

/// Issue 60 item 7: `get` and `dump` of a stream that keeps Secret values say so on
/// stderr before printing them (not a stream written with `drop_secret_data`), and no
/// control character of the store reaches the terminal: an annotation holding an OSC
/// (window title), a CSI (clear screen, as the C1 byte U+009B) and DEL is printed with
/// `\uXXXX` escapes, by `get` (text and JSON), `dump` and `inspect`'s JSON.
async fn secrets_are_announced_and_control_characters_escaped(engine: Engine) {
    use k8s_openapi::api::core::v1::Secret;
    let server = TestServer::start().await;
    let secrets = ResourceType::new("", "v1", "secrets", "Secret", true);
    server.handle().register(&secrets);
    let hostile = "\u{1b}]0;pwned\u{7}\u{9b}2J\u{7f}";
    server.handle().apply(
        &secrets,
        serde_json::json!({
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "evil", "namespace": "default", "annotations": {"note": hostile}},
            "data": {"password": "aHVudGVyMg=="},
        }),
    );
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    {
        let db = Db::open_with(&dir, DbConfig::default().engine(engine)).unwrap();
        for (name, cfg) in [
            (
                "secrets",
                kube_persist::StreamConfig::default().allow_sensitive_data(),
            ),
            (
                "dropped",
                kube_persist::StreamConfig::default().drop_secret_data(),
            ),
        ] {
            let (_r, w) = db
                .store(name, kube::Api::<Secret>::all(server.client()), cfg)
                .unwrap();
            let mut w = drive(w);
            w.until(|e| *e == Ev::InitDone).await;
            w.stop().await;
        }
        db.flush().unwrap();
    }
    wait_unlocked(&dir);
    let d = dir.to_str().unwrap();
    let clean = |run: &Run, what: &str| {
        for c in ['\u{1b}', '\u{7}', '\u{9b}', '\u{7f}'] {
            assert!(!run.out.contains(c), "{what}: {c:?} printed: {:?}", run.out);
        }
    };
    let warning = "warning: stream \"secrets\" holds Secret objects";
    for args in [
        &["get", d, "secrets", "default/evil"][..],
        &["get", d, "secrets", "default/evil", "-o", "json"],
        &["dump", d, "secrets"],
    ] {
        let run = tool(args, &[], None);
        assert_eq!(run.code, Some(0), "{args:?}: {}", run.err);
        assert!(run.err.contains(warning), "{args:?}: {}", run.err);
        clean(&run, &format!("{args:?}"));
        assert!(run.out.contains("\\u009b2J"), "{args:?}: {}", run.out);
        if args[0] == "dump" || args.len() > 4 {
            let line = run.out.lines().next().unwrap();
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            assert_eq!(
                v["metadata"]["annotations"]["note"], hostile,
                "the same JSON"
            );
        }
    }
    let run = tool(&["get", d, "dropped", "default/evil"], &[], None);
    assert_eq!(run.code, Some(0), "{}", run.err);
    assert!(!run.err.contains("warning"), "{}", run.err);
    clean(&run, "get of the dropped stream");
    let run = tool(&["inspect", d, "-o", "json"], &[], None);
    clean(&run, "inspect");
}

engine_tests! {
    async: verify_equal_stale_compacted_and_damaged_stores,
        commands_refuse_a_store_beside_other_files_and_change_nothing,
        reading_commands_leave_every_file_of_the_store_unchanged,
        stats_text_and_json,
        stats_shows_controller_state,
        destroy_confirms_and_refuses_non_stores,
        cli_inspect_get_dump_with_and_without_key,
        json_output_exit_codes_and_drop_stream,
        reading_commands_on_a_live_store,
        secrets_are_announced_and_control_characters_escaped,
}
