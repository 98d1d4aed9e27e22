//! The `kube-persist` tool beside the running example operator, as an operator on call runs
//! it (`kubectl exec <pod> -- kube-persist stats|get|dump|verify|controller-states <dir>`):
//! the operator's `--cluster` mode as one process (what `deploy/` runs, with its default
//! `--durability every-batch`), the tool as others, on the same store. Every reading
//! command answers while the operator runs, and a reader never keeps the operator from
//! restarting: neither after SIGTERM nor after SIGKILL, with a reader holding the store
//! open and the tool in the middle of a dump. And a writer that needs the store to itself
//! (periodic durability) waits for a `dump` that holds it (`DbConfig::wait_for_readers`).
//!
//! The tool is the workspace's `kube-persist` binary next to this test binary
//! (`target/<profile>/kube-persist`, built by `cargo test --workspace`); when it is missing
//! the test builds it. After changing the tool, run this module alone only after
//! `cargo build --release -p kube-persist-cli`.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncBufReadExt, BufReader};

use crate::common;
use crate::operator;
use crate::sigterm::Operator;
use kube_persist::{Db, DbConfig};

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
    let config = crate::common::kubeconfig(tmp.path(), &server);
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
    // The operator labels Pods meanwhile (each a label patch, so a newer resourceVersion), so the
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
    let config = crate::common::kubeconfig(tmp.path(), &server);
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

/// Where redb's lock protocol keeps its bytes (redb 4.6, `db.rs`): far past any data.
const REDB_LOCK_BASE: i64 = 1 << 62;
/// Held shared by every read-only handle while it has the database open.
const REDB_SHARED_READER_BYTE: i64 = REDB_LOCK_BASE + 2;

/// Whether another process holds a lock on `file` that conflicts with a lock of `kind`
/// (`F_WRLCK`: any lock; `F_RDLCK`: an exclusive one) over `len` bytes from `start` (0: to
/// the end). Asks with `F_OFD_GETLK`, which takes nothing.
fn lock_conflicts(file: &Path, kind: libc::c_int, start: i64, len: i64) -> bool {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(file).expect("the store's file");
    // SAFETY: a zeroed `flock` is valid; fcntl gets a valid descriptor and a pointer to it.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = kind as _;
    lock.l_whence = libc::SEEK_SET as _;
    lock.l_start = start;
    lock.l_len = len;
    let rc = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_OFD_GETLK, &mut lock) };
    assert_eq!(rc, 0, "F_OFD_GETLK: {}", std::io::Error::last_os_error());
    i32::from(lock.l_type) != libc::F_UNLCK
}

/// A process's state letter in `/proc/<pid>/stat` (`T`: stopped), or `None` once reaped.
fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")?.1.chars().next()
}

fn signal(child: &std::process::Child, sig: libc::c_int) {
    // SAFETY: kill(2) on our own child, which is not reaped before we wait for it.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, sig) }, 0);
}

/// Stops `child` (SIGSTOP) and returns once it is stopped (or has exited): it runs no more
/// instructions until [`signal`] `SIGCONT`.
fn stop(child: &std::process::Child) {
    signal(child, libc::SIGSTOP);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !matches!(proc_state(child.id()), None | Some('T' | 't' | 'Z' | 'X')) {
        assert!(
            std::time::Instant::now() < deadline,
            "the tool never stopped"
        );
        std::thread::yield_now();
    }
}

/// Copies the store directory `from` (closed) to `to`, private like the original.
fn copy_dir(from: &Path, to: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir(to).unwrap();
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o700)).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// A child process killed (stopped or not) and reaped when the test ends, a failed one too.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The tool's output, read on a thread: (lines, bytes).
fn drain(out: impl std::io::Read + Send + 'static) -> std::thread::JoinHandle<(usize, usize)> {
    std::thread::spawn(move || {
        use std::io::BufRead;
        let (mut lines, mut bytes) = (0, 0);
        for line in std::io::BufReader::new(out).lines() {
            bytes += line.expect("the tool's output").len() + 1;
            lines += 1;
        }
        (lines, bytes)
    })
}

/// What this thread logs, kept for the test to read.
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Log {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Log {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// Issue 50 item 8: `DbConfig::wait_for_readers` beside a real `kube-persist dump`. The tool
/// is stopped (SIGSTOP) while it holds a redb store open read-only, in the middle of its one
/// piece (600 Pods: under its 1000 objects and 4 MiB): a writer with periodic durability (the
/// default) that waits less than the tool holds the store is `Locked` once its wait has
/// passed; one that waits longer logs that it waits for the store's readers, has not opened
/// while the tool holds the store, and opens (no `Locked`) after the tool is let go and
/// closes it, while the tool's dump completes (every Pod, exit 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_waits_for_a_dump_that_holds_the_store() {
    use std::time::{Duration, Instant};
    const PODS: usize = 600;
    const SHORT: Duration = Duration::from_millis(300);
    common::init_tracing();
    let server = common::pod_server(PODS).await;
    let tmp = tempfile::tempdir().unwrap();
    let synced = tmp.path().join("synced");
    {
        let db = Db::open_with(
            &synced,
            DbConfig::default().engine(kube_persist::Engine::Redb),
        )
        .unwrap();
        common::sync_pods(&server, &db).await;
        db.flush().unwrap();
    }
    common::wait_unlocked(&synced);
    // A copy this process never opened: its opens then wait for no handle of its own (a
    // store it closed a moment ago is retried while `Locked`, whatever holds it).
    let store = tmp.path().join("store");
    copy_dir(&synced, &store);
    let file = store.join("data.redb");
    let tool = tool_binary();
    tokio::task::spawn_blocking(move || {
        let dir = store.to_str().unwrap();
        // Run the tool until it is stopped while it holds the store: a reader's byte locked
        // and nothing exclusive (a reader's open done, its read under way).
        let held = |f: &Path| {
            lock_conflicts(f, libc::F_WRLCK, REDB_SHARED_READER_BYTE, 1)
                && !lock_conflicts(f, libc::F_RDLCK, 0, 0)
        };
        let mut runs = 0;
        let (mut child, output) = 'caught: loop {
            runs += 1;
            assert!(
                runs <= 200,
                "the tool was never stopped while it held the store"
            );
            let mut child = Killed(
                std::process::Command::new(&tool)
                    .args(["dump", dir, "pods"])
                    .env("RUST_LOG", "warn")
                    .stdout(Stdio::piped())
                    .stderr(Stdio::inherit())
                    .spawn()
                    .expect("run the tool"),
            );
            let output = drain(child.0.stdout.take().unwrap());
            while child.0.try_wait().unwrap().is_none() {
                stop(&child.0);
                if held(&file) {
                    break 'caught (child, output);
                }
                signal(&child.0, libc::SIGCONT);
                std::thread::sleep(Duration::from_micros(200));
            }
            let status = child.0.wait().unwrap();
            assert!(status.success(), "kube-persist dump: {status}");
            assert_eq!(output.join().unwrap().0, PODS, "the dump's lines");
        };
        eprintln!("the tool stopped holding the store in run {runs}");

        // Waiting less than the tool holds the store: Locked, once the wait has passed.
        let t0 = Instant::now();
        match Db::open_with(&store, DbConfig::default().wait_for_readers(SHORT)) {
            Err(kube_persist::Error::Locked { path, .. }) => assert_eq!(path, store),
            other => panic!(
                "expected Locked after {SHORT:?}, got {:?}",
                other.map(|_| ())
            ),
        }
        assert!(
            t0.elapsed() >= SHORT,
            "Locked after {:?}, before the {SHORT:?} it was to wait for the tool",
            t0.elapsed()
        );

        // Waiting longer: it waits, and opens once the tool has closed the store.
        let log = Log::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer({
                let log = log.clone();
                move || log.clone()
            })
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .finish();
        let writer = std::thread::spawn({
            let store = store.clone();
            move || {
                tracing::subscriber::with_default(subscriber, || {
                    let db = Db::open_with(
                        &store,
                        DbConfig::default().wait_for_readers(Duration::from_secs(30)),
                    );
                    (db, Instant::now())
                })
            }
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        while !log.text().contains("waiting for its readers to close") {
            assert!(
                !writer.is_finished(),
                "the writer returned without waiting for the tool: {}",
                log.text()
            );
            assert!(Instant::now() < deadline, "the writer never said it waits");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(held(&file), "the tool still holds the store");
        assert!(!writer.is_finished(), "the writer opened beside the tool");
        let released = Instant::now();
        signal(&child.0, libc::SIGCONT);
        let status = child.0.wait().unwrap();
        assert!(
            status.success(),
            "kube-persist dump beside a waiting writer: {status}"
        );
        let (lines, bytes) = output.join().unwrap();
        assert_eq!(lines, PODS, "the dump's lines");
        assert!(bytes < 4 << 20, "one piece: {bytes} bytes");
        let (db, opened) = writer.join().unwrap();
        let db = db.unwrap_or_else(|e| panic!("the writer opened after the tool: {e}"));
        assert!(
            opened > released,
            "the writer opened before the tool was let go"
        );
        assert!(
            log.text().contains("the store's readers closed; opened it"),
            "{}",
            log.text()
        );
        eprintln!(
            "the writer opened {:?} after the tool was let go",
            opened - released
        );
        drop(db);
    })
    .await
    .unwrap();
}
