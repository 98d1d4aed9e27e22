//! Graceful shutdown of the example operator's `--cluster` mode (issue 27, item 4), the mode
//! the `deploy/` manifests run: a child process runs `operator::cluster::run` against the
//! testkit API server, with its probe port. The test checks the probes (`/readyz`,
//! `/livez`, `/metrics` with the store's and the controller's series), SIGTERMs the
//! operator while it labels Pods, and checks that it exits 0 well within a
//! `terminationGracePeriodSeconds` of 30 s, that every Pod it labeled has its reconcile
//! state on disk (the last batch written on shutdown), and that the restart makes 0 LIST
//! calls and labels exactly the Pods left. And its liveness after a full disk (root: a
//! tmpfs): `/livez` asks for a restart once space is back, not before, and the restarted
//! operator recovers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::{common, operator};
use k8s_openapi::api::core::v1::Pod;
use kube_persist::Db;
use kube_persist_testkit::{ResourceType, ServerHandle};

const PODS: usize = 3000;
/// The test's bound on SIGTERM-to-exit: well under the manifests' 30 s grace period.
const EXIT_WITHIN: Duration = Duration::from_secs(10);
const DIR_ENV: &str = "KP_SIGTERM_DIR";
const URL_ENV: &str = "KP_SIGTERM_URL";

/// The child process: the example operator's `--cluster` mode on the testkit server.
#[test]
#[ignore = "child process of the tests below"]
fn cluster_child() {
    let dir = std::env::var(DIR_ENV).expect(DIR_ENV);
    let url = std::env::var(URL_ENV).expect(URL_ENV);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let code = rt.block_on(async move {
        let opts = operator::cluster::ClusterOpts {
            dir: dir.into(),
            listen: "127.0.0.1:0".parse().unwrap(),
            shard_index: None,
            shards: 1,
            shards_from: None,
            shards_poll: Duration::from_secs(10),
            labels: None,
            stale_after: Duration::from_secs(300),
            // What the deploy/ manifests run (the example's `--cluster` default).
            durability: kube_persist::Durability::EveryBatch,
        };
        operator::cluster::run(kube_persist_testkit::client_for(&url, None), opts).await
    });
    assert_eq!(code, std::process::ExitCode::SUCCESS, "the operator failed");
}

/// The example operator's `--cluster` mode as a child process (also `tool_live`'s).
pub(crate) struct Operator {
    child: std::process::Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Operator {
    pub(crate) fn spawn(dir: &std::path::Path, url: &str) -> Operator {
        Operator::spawn_with(dir, url, &[])
    }

    /// [`Operator::spawn`] with more environment variables.
    pub(crate) fn spawn_with(
        dir: &std::path::Path,
        url: &str,
        env: &[(&str, &std::ffi::OsStr)],
    ) -> Operator {
        let mut envs = vec![(DIR_ENV, dir.as_os_str()), (URL_ENV, url.as_ref())];
        envs.extend_from_slice(env);
        let mut child = common::spawn_self("sigterm::cluster_child", &envs);
        // libtest may print `test cluster_child ... ` in front of the first line.
        let lines = common::collect_stdout(&mut child, |l| {
            l.contains("operator listening on ") || l.contains("operator stopped: ")
        });
        Operator { child, lines }
    }

    /// The probe port, once the operator printed it (its signal handler is installed).
    pub(crate) async fn addr(&self) -> String {
        let mut addr = None;
        common::eventually("the operator's probe port", || {
            addr = self.lines.lock().unwrap().iter().find_map(|l| {
                let (_, rest) = l.split_once("operator listening on ")?;
                Some(rest.split_whitespace().next()?.to_string())
            });
            addr.is_some()
        })
        .await;
        addr.unwrap()
    }

    /// The lines it printed so far (`operator listening on ...`, `operator stopped: ...`).
    pub(crate) fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// The probe port once `/readyz` answers 200 (the store is synced and the watch is up).
    pub(crate) async fn ready(&self) -> String {
        let addr = self.addr().await;
        let deadline = Instant::now() + common::WAIT;
        loop {
            let (code, body) = common::http_get(&addr, "/readyz").await;
            if code == 200 {
                return addr;
            }
            assert!(
                Instant::now() < deadline,
                "the operator is not ready: {code} {body}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until the process exits by itself: (success, the lines it printed).
    pub(crate) fn wait(mut self) -> (bool, Vec<String>) {
        let status = self.child.wait().expect("wait for the operator");
        // The stdout thread has the last line once the pipe is closed.
        std::thread::sleep(Duration::from_millis(100));
        (status.success(), self.lines.lock().unwrap().clone())
    }

    /// SIGKILL (a crash, an OOM kill), then reaps the process.
    pub(crate) fn kill(mut self) {
        self.child.kill().expect("SIGKILL the operator");
        self.child.wait().expect("reap the operator");
    }

    /// SIGTERM, then waits for the exit: (success, time from the signal to the exit).
    pub(crate) fn terminate(mut self) -> (bool, Duration, String) {
        let sent = Instant::now();
        // SAFETY: kill(2) on the pid of a child this test spawned and has not reaped.
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        assert_eq!(rc, 0, "kill(SIGTERM)");
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                let took = sent.elapsed();
                // The stdout thread has the last line once the pipe is closed.
                let deadline = Instant::now() + Duration::from_secs(5);
                let stopped = loop {
                    let last = common::last_line(&self.lines);
                    if last.contains("operator stopped: ") || Instant::now() > deadline {
                        break last;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                };
                return (status.success(), took, stopped);
            }
            if sent.elapsed() > 3 * EXIT_WITHIN {
                let _ = self.child.kill();
                panic!(
                    "the operator did not exit within {:?} of SIGTERM",
                    3 * EXIT_WITHIN
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// A test that fails (panics) must not leave its operator running.
impl Drop for Operator {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// One HTTP/1.1 GET: (status code, body).
async fn get(addr: &str, path: &str) -> (u16, String) {
    let (code, body) = common::http_get(addr, path).await;
    assert_ne!(code, 0, "GET {path} from {addr} failed");
    (code, body)
}

fn pods(h: &ServerHandle) -> Vec<Pod> {
    h.list(&ResourceType::pods())
        .into_iter()
        .map(|p| serde_json::from_value(p).expect("a pod"))
        .collect()
}

fn labeled(h: &ServerHandle) -> Vec<String> {
    pods(h)
        .iter()
        .filter(|p| operator::is_labeled(p))
        .map(|p| {
            let m = &p.metadata;
            format!(
                "{}/{}",
                m.namespace.clone().unwrap_or_default(),
                m.name.clone().unwrap_or_default()
            )
        })
        .collect()
}

/// `namespace/name` -> (Ok resourceVersion, due) of the operator's stored reconcile state.
fn stored_state(dir: &std::path::Path) -> HashMap<String, (Option<String>, bool)> {
    let db = Db::open(dir).expect("open the stopped operator's store");
    db.reconcile_states(operator::CONTROLLER_NAME)
        .expect("the operator's reconcile state")
        .map(|r| r.expect("a record"))
        .map(|r| {
            let key = format!("{}/{}", r.namespace.unwrap_or_default(), r.name);
            (key, (r.resource_version, r.due.is_some()))
        })
        .collect()
}

/// Every Pod on the server that the operator labeled has an `Ok` record with its requeue.
fn assert_state_covers(dir: &std::path::Path, labeled: &[String]) {
    let state = stored_state(dir);
    let missing: Vec<&String> = labeled
        .iter()
        .filter(|k| !matches!(state.get(*k), Some((Some(_), true))))
        .collect();
    assert!(
        missing.is_empty(),
        "{} of {} labeled pods have no Ok reconcile state on disk, e.g. {:?}",
        missing.len(),
        labeled.len(),
        missing.iter().take(5).collect::<Vec<_>>()
    );
}

/// The value of the sample `series` (`name{labels}`) in an OpenMetrics text.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// `operator stopped: <W> pods labeled, ...` -> W.
fn writes(stopped: &str) -> usize {
    stopped
        .split_once("operator stopped: ")
        .and_then(|(_, r)| r.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no `operator stopped` line: {stopped:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_gracefully_and_restart_lists_nothing() {
    common::init_tracing();
    let server = common::pod_server(PODS).await;
    let h = server.handle();
    let dir = tempfile::tempdir().unwrap();
    let url = server.url();

    // First run: cold start; probes; SIGTERM while it labels.
    let first = Operator::spawn(dir.path(), &url);
    let addr = first.addr().await;
    assert_eq!(get(&addr, "/livez").await.0, 200);
    let deadline = Instant::now() + common::WAIT;
    while get(&addr, "/readyz").await.0 != 200 {
        assert!(Instant::now() < deadline, "never ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (code, body) = get(&addr, "/metrics").await;
    if cfg!(feature = "metrics") {
        assert_eq!(code, 200);
        assert!(
            body.contains("kube_persist_ready{stream=\"pods\"} 1"),
            "metrics: {body}"
        );
        // The controller's series beside the store's, under its durable state's name.
        assert!(
            body.contains(&format!(
                "kube_persist_controller_active_workers{{controller=\"{}\"}}",
                operator::CONTROLLER_NAME
            )),
            "no controller metrics: {body}"
        );
    } else {
        assert_eq!(code, 404);
    }
    common::eventually("the operator labels a third of the pods", || {
        h.counts().patch as usize >= PODS / 3
    })
    .await;
    if cfg!(feature = "metrics") {
        // Each label written is a reconcile that returned `Ok` with its hourly requeue.
        let reconciled = format!(
            "kube_persist_controller_reconcile_total{{controller=\"{}\",result=\"requeue_after\"}}",
            operator::CONTROLLER_NAME
        );
        let deadline = Instant::now() + common::WAIT;
        loop {
            let (code, body) = get(&addr, "/metrics").await;
            assert_eq!(code, 200);
            let count = sample(&body, &reconciled);
            if count.is_some_and(|n| n >= (PODS / 3) as f64) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{reconciled} is {count:?}, not the {} reconciles of the pods labeled: {body}",
                PODS / 3
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let (ok, took, stopped) = first.terminate();
    let before = labeled(&h);
    println!(
        "sigterm: first run exited {} in {:.3} s after SIGTERM, {}/{PODS} pods labeled; [{stopped}]",
        if ok { "0" } else { "non-zero" },
        took.as_secs_f64(),
        before.len()
    );
    assert!(ok, "the operator exits 0 on SIGTERM");
    assert!(took < EXIT_WITHIN, "exit took {took:?}");
    assert!(
        !before.is_empty() && before.len() < PODS,
        "SIGTERM mid-way: {} of {PODS} labeled",
        before.len()
    );
    assert_eq!(
        writes(&stopped),
        before.len(),
        "each labeled pod written once"
    );
    assert_state_covers(dir.path(), &before);

    // Second run: resumes (0 LIST) and labels exactly the pods left, plus a new one.
    h.reset_counts();
    let second = Operator::spawn(dir.path(), &url);
    let addr = second.addr().await;
    common::eventually("the restart labels every pod", || labeled(&h).len() == PODS).await;
    let rt = ResourceType::pods();
    h.apply(
        &rt,
        kube_persist_testkit::make_pod("ns-0", "sentinel", 4242),
    );
    common::eventually("the restart labels a new pod", || {
        labeled(&h).len() == PODS + 1
    })
    .await;
    assert_eq!(get(&addr, "/readyz").await.0, 200);
    let counts = h.counts();
    let (ok, took, stopped) = second.terminate();
    println!(
        "sigterm: restart made {} LIST, {} WATCH calls, labeled {} pods, exited in {:.3} s; [{stopped}]",
        counts.list,
        counts.watch,
        writes(&stopped),
        took.as_secs_f64()
    );
    assert_eq!(counts.list, 0, "the restart made LIST calls");
    assert!(ok && took < EXIT_WITHIN, "second exit: ok={ok} in {took:?}");
    assert_eq!(
        writes(&stopped),
        PODS + 1 - before.len(),
        "the restart labels only the pods left and the new one"
    );
    assert_state_covers(dir.path(), &labeled(&h));
}

/// Root only (a tmpfs). The operator's store fills a 4 MiB tmpfs during its first list:
/// `/livez` stays 200 while the disk is full (a restart would fail again), says why, and
/// turns 503 once the tmpfs grows (space is back: only a reopen recovers the store). The
/// operator restarted on the same directory (what the kubelet does) becomes ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn livez_asks_for_a_restart_once_space_is_back() {
    common::init_tracing();
    if !common::is_root() {
        println!("SKIPPED livez_asks_for_a_restart_once_space_is_back: needs root (tmpfs mount)");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mnt = tmp.path().join("mnt");
    let fs = match common::Tmpfs::mount(&mnt, "size=4m") {
        Ok(fs) => fs,
        Err(e) => {
            println!("SKIPPED livez_asks_for_a_restart_once_space_is_back: cannot mount: {e}");
            return;
        }
    };
    let server = common::pod_server(PODS).await;
    let dir = mnt.join("store");
    let op = Operator::spawn(&dir, &server.url());
    let addr = op.addr().await;
    let mut livez = (0, String::new());
    let deadline = Instant::now() + common::WAIT;
    while !livez.1.contains("full disk") {
        assert!(
            Instant::now() < deadline,
            "no full disk reported: {livez:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        livez = get(&addr, "/livez").await;
    }
    assert_eq!(livez.0, 200, "the disk is still full: {livez:?}");
    fs.remount("size=256m");
    let deadline = Instant::now() + common::WAIT;
    while livez.0 != 503 {
        assert!(Instant::now() < deadline, "no restart asked for: {livez:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
        livez = get(&addr, "/livez").await;
    }
    assert!(livez.1.contains("restart"), "{livez:?}");
    // The kubelet restarts the container: SIGKILL after the grace period at worst.
    op.kill();
    let op = Operator::spawn(&dir, &server.url());
    let addr = op.addr().await;
    let deadline = Instant::now() + common::WAIT;
    loop {
        let (code, body) = get(&addr, "/readyz").await;
        if code == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the restarted operator is not ready: {body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(get(&addr, "/livez").await.0, 200);
    let (ok, _, stopped) = op.terminate();
    assert!(ok, "the restarted operator exits 0: {stopped}");
    drop(fs);
}

/// `KUBE_PERSIST_KEY` as the operator reads it, by the library's one rule
/// (`EncryptionKey::from_env_optional`, which the `kube-persist` tool follows too): unset is
/// no key (the store is written unencrypted), 64 hex characters encrypt the store, and any
/// other value, empty or blank included (issue 60 item 2: empty was no key), stops the
/// operator before it opens the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_env_empty_is_refused() {
    common::init_tracing();
    let server = common::pod_server(20).await;
    let url = server.url();
    let tmp = tempfile::tempdir().unwrap();
    let hex = "5a".repeat(32);
    let fingerprint = kube_persist::EncryptionKey::from_hex(&hex)
        .unwrap()
        .fingerprint();
    for (value, want) in [(None, None), (Some(hex.as_str()), Some(fingerprint))] {
        let dir = tmp
            .path()
            .join(format!("store-{}", value.map_or(0, str::len)));
        let env: Vec<(&str, &std::ffi::OsStr)> = value
            .map(|v| ("KUBE_PERSIST_KEY", v.as_ref()))
            .into_iter()
            .collect();
        let op = Operator::spawn_with(&dir, &url, &env);
        op.ready().await;
        let (ok, _, stopped) = op.terminate();
        assert!(
            ok,
            "KUBE_PERSIST_KEY={value:?}: the operator failed: {stopped}"
        );
        let db = Db::open(&dir).unwrap();
        let streams = db.streams().unwrap();
        assert_eq!(streams.len(), 1, "{streams:?}");
        assert_eq!(
            streams[0].key_fingerprint, want,
            "KUBE_PERSIST_KEY={value:?}: the store's key"
        );
    }
    for bad in ["not-a-key", "", " \n"] {
        let dir = tmp.path().join("store-bad");
        let op = Operator::spawn_with(&dir, &url, &[("KUBE_PERSIST_KEY", bad.as_ref())]);
        let (ok, lines) = op.wait();
        assert!(
            !ok,
            "the operator ran with KUBE_PERSIST_KEY={bad:?}: {lines:?}"
        );
        assert!(
            !lines.iter().any(|l| l.contains("operator listening on ")),
            "{lines:?}"
        );
        assert!(
            !dir.exists(),
            "a store was created with KUBE_PERSIST_KEY={bad:?}"
        );
    }
}
