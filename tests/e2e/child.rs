//! Child processes for the SIGKILL scenarios: this test binary started again with
//! `KP_E2E_CHILD=store` (a Pod store that reports its state and events on stdout) or
//! `KP_E2E_CHILD=controller` (a durable controller over Pods that prints each reconcile), and
//! the roles of other scenarios (`delta::CHILD_ROLE`), all started by [`spawn_role`].

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::controller::Action;
use kube::{Api, Resource};
use kube_persist::{Db, DbConfig, Durability, Event, StreamConfig};
use kube_persist_testkit::realk8s::RealK8s;

use crate::common;

pub const CHILD_ENV: &str = "KP_E2E_CHILD";
const DIR_ENV: &str = "KP_E2E_DIR";
const KUBECONFIG_ENV: &str = "KP_E2E_KUBECONFIG";
const STREAMING_ENV: &str = "KP_E2E_STREAMING";
/// The key of the Pod whose Apply makes the store child flush and say so.
pub const PROBE: &str = "e2e-0/probe";
/// The durable controller's name.
pub const CONTROLLER: &str = "e2e-pods";

/// The store options of the child processes (small pages: the list takes a while).
pub fn store_config(streaming: bool) -> StreamConfig {
    let c = StreamConfig::default()
        .page_size(100)
        .backoff(Duration::from_millis(20), Duration::from_millis(500))
        .relist_jitter(Duration::from_millis(10));
    if streaming { c.streaming_lists() } else { c }
}

pub fn key<K: Resource>(k: &K) -> String {
    let m = k.meta();
    format!(
        "{}/{}",
        m.namespace.clone().unwrap_or_default(),
        m.name.clone().unwrap_or_default()
    )
}

fn rv<K: Resource>(k: &K) -> String {
    k.meta().resource_version.clone().unwrap_or_default()
}

pub fn run(role: &str) {
    let dir = std::env::var(DIR_ENV).expect("KP_E2E_DIR");
    let kubeconfig = std::env::var(KUBECONFIG_ENV).expect("KP_E2E_KUBECONFIG");
    if role == "operator" {
        return operator(dir.into(), kubeconfig.into());
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async move {
        let client = RealK8s::external(kubeconfig.as_ref())
            .client()
            .await
            .expect("child client");
        let mut config = DbConfig::default().engine(common::child_engine());
        if role == crate::delta::CHILD_ROLE {
            // Its store on disk is inspected after each kill: every batch durable.
            config = config.durability(Durability::EveryBatch);
        }
        let db = Db::open_with(&dir, config).expect("child opens the store");
        match role {
            "store" => store(db, client).await,
            "controller" => controller(db, client).await,
            crate::delta::CHILD_ROLE => crate::delta::child(db, client).await,
            other => panic!("unknown child role {other}"),
        }
    });
}

const ORDINAL_ENV: &str = "KP_E2E_ORDINAL";
const STATEFULSET_ENV: &str = "KP_E2E_STATEFULSET";
const LABELS_ENV: &str = "KP_E2E_LABELS";

/// The example operator's `--cluster` mode as one StatefulSet ordinal (`scale.rs`): the
/// shard count from the StatefulSet, read again every second. Exits with its exit status.
fn operator(dir: std::path::PathBuf, kubeconfig: std::path::PathBuf) {
    let ordinal = std::env::var(ORDINAL_ENV).expect(ORDINAL_ENV);
    let sts = std::env::var(STATEFULSET_ENV).expect(STATEFULSET_ENV);
    let labels = std::env::var(LABELS_ENV).expect(LABELS_ENV);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let code = rt.block_on(async move {
        let client = RealK8s::external(&kubeconfig)
            .client()
            .await
            .expect("child client");
        let opts = crate::deploy::operator::cluster::ClusterOpts {
            dir,
            listen: "127.0.0.1:0".parse().unwrap(),
            shard_index: Some(ordinal),
            shards: 1,
            shards_from: Some(sts),
            shards_poll: Duration::from_secs(1),
            labels: Some(labels),
            stale_after: Duration::from_secs(300),
            // What the deploy/ manifests run (the example's `--cluster` default).
            durability: kube_persist::Durability::EveryBatch,
        };
        crate::deploy::operator::cluster::run(client, opts).await
    });
    std::process::exit(if code == std::process::ExitCode::SUCCESS {
        0
    } else {
        1
    });
}

/// Flush on request (the parent creates the file): the store on disk then holds everything
/// the child printed before "flushed".
fn serve_flush_requests(db: kube_persist::Db) {
    let request = flush_request(std::path::Path::new(&std::env::var(DIR_ENV).unwrap()));
    tokio::spawn(async move {
        loop {
            if std::fs::remove_file(&request).is_ok() {
                db.flush().expect("flush");
                println!("flushed");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
}

async fn store(db: kube_persist::Db, client: kube::Client) {
    serve_flush_requests(db.clone());
    let streaming = std::env::var(STREAMING_ENV).is_ok_and(|v| v == "1");
    let (reader, watcher) = db
        .store("pods", Api::<Pod>::all(client), store_config(streaming))
        .unwrap();
    print_reads(reader.clone());
    tokio::spawn(async move {
        let mut last = String::new();
        loop {
            let line = format!("state phase={:?} live={}", reader.phase(), reader.is_live());
            if line != last {
                println!("{line}");
                last = line;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    });
    let mut events = std::pin::pin!(watcher.stream());
    while let Some(ev) = events.next().await {
        match ev {
            Ok(Event::Resumed { .. }) => println!("event resumed"),
            Ok(Event::Init) => println!("event init"),
            Ok(Event::InitDone) => println!("event initdone"),
            Ok(Event::Apply(p)) if key(&p) == PROBE => {
                db.flush().expect("flush");
                println!("durable applied {} {}", key(&p), rv(&p));
            }
            Ok(Event::Apply(_)) => println!("event apply"),
            Ok(_) => {}
            Err(e) => println!("error {e}"),
        }
    }
}

/// Prints `reads <n>` each time the store's `LIST limit=1` reads of the server's
/// resourceVersion (`Stats::server_version_reads`) change: the parent counts them apart
/// from the LIST calls of a list.
fn print_reads(reader: kube_persist::Reader<Pod>) {
    tokio::spawn(async move {
        let mut last = None;
        loop {
            let n = reader.stats().server_version_reads;
            if last != Some(n) {
                println!("reads {n}");
                last = Some(n);
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    });
}

/// The last `reads <n>` a child printed (0 if none).
pub fn reads(lines: &[String]) -> u64 {
    lines
        .iter()
        .rev()
        .find_map(|l| l.strip_prefix("reads ")?.parse().ok())
        .unwrap_or(0)
}

async fn reconcile(pod: Arc<Pod>, _: Arc<()>) -> Result<Action, kube::Error> {
    println!("reconciled {} {}", key(pod.as_ref()), rv(pod.as_ref()));
    Ok(Action::requeue(Duration::from_secs(3600)))
}

fn error_policy(_: Arc<Pod>, _: &kube::Error, _: Arc<()>) -> Action {
    Action::requeue(Duration::from_secs(3600))
}

async fn controller(db: kube_persist::Db, client: kube::Client) {
    use kube_persist::controller::{Config as CConfig, Controller};
    let controller = db
        .store("pods", Api::<Pod>::all(client), store_config(false))
        .map(|pair| Controller::for_store(pair).with_config(CConfig::default().concurrency(8)))
        .unwrap()
        .durable_state(CONTROLLER)
        .unwrap();
    print_reads(controller.store());
    serve_flush_requests(db.clone());
    println!("child-started");
    controller
        .run(reconcile, error_policy, Arc::new(()))
        .for_each(|_| async {})
        .await;
}

/// The file whose creation asks a controller child to flush its store.
pub fn flush_request(dir: &std::path::Path) -> std::path::PathBuf {
    dir.with_extension("flush")
}

/// This binary started again as the child `role` on the store at `dir` (with the child
/// engine), with `env` besides, and the lines it prints (collected on a thread).
pub fn spawn_role(
    role: &str,
    dir: &std::path::Path,
    kubeconfig: &std::path::Path,
    env: &[(&str, &str)],
) -> (std::process::Child, Arc<Mutex<Vec<String>>>) {
    let mut vars: Vec<(&str, &std::ffi::OsStr)> = vec![
        (CHILD_ENV, role.as_ref()),
        (common::ENGINE_ENV, common::child_engine().name().as_ref()),
        (DIR_ENV, dir.as_os_str()),
        (KUBECONFIG_ENV, kubeconfig.as_os_str()),
    ];
    vars.extend(env.iter().map(|(k, v)| (*k, v.as_ref())));
    let mut child = common::spawn_self(role, &vars);
    let lines = common::collect_stdout(&mut child, |_| true);
    (child, lines)
}

/// A running child process and the lines it printed.
pub struct Child {
    child: std::process::Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Child {
    pub fn spawn(
        role: &str,
        dir: &std::path::Path,
        kubeconfig: &std::path::Path,
        streaming: bool,
    ) -> Child {
        let streaming = if streaming { "1" } else { "0" };
        let (child, lines) = spawn_role(role, dir, kubeconfig, &[(STREAMING_ENV, streaming)]);
        Child { child, lines }
    }

    /// The lines printed so far.
    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// Wait (up to `timeout`) until a printed line satisfies `pred`.
    pub async fn wait_for(&self, timeout: Duration, pred: impl Fn(&str) -> bool) -> bool {
        self.wait_until(timeout, |lines| lines.iter().any(|l| pred(l)))
            .await
    }

    /// Wait (up to `timeout`) until the printed lines satisfy `pred`.
    pub async fn wait_until(&self, timeout: Duration, pred: impl Fn(&[String]) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if pred(&self.lines.lock().unwrap()) {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Ask the child to flush its store; wait until it says it did.
    pub async fn flush(&self, dir: &std::path::Path) -> bool {
        let flushed = self
            .lines
            .lock()
            .unwrap()
            .iter()
            .filter(|l| *l == "flushed")
            .count();
        if std::fs::write(flush_request(dir), b"").is_err() {
            return false;
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        while self
            .lines
            .lock()
            .unwrap()
            .iter()
            .filter(|l| *l == "flushed")
            .count()
            == flushed
        {
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        true
    }

    /// The last line, for messages.
    pub fn last_line(&self) -> String {
        common::last_line(&self.lines)
    }

    /// SIGKILL and reap.
    pub fn kill(mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reap");
    }
}

/// One ordinal of the example operator (`operator` role) and the lines it printed.
pub struct Operator {
    child: std::sync::Mutex<std::process::Child>,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Operator {
    pub fn spawn(
        ordinal: usize,
        dir: &std::path::Path,
        kubeconfig: &std::path::Path,
        statefulset: &str,
        labels: &str,
    ) -> Operator {
        let ordinal = ordinal.to_string();
        let mut child = common::spawn_self(
            "operator",
            &[
                (CHILD_ENV, "operator".as_ref()),
                (DIR_ENV, dir.as_os_str()),
                (KUBECONFIG_ENV, kubeconfig.as_os_str()),
                (ORDINAL_ENV, ordinal.as_ref()),
                (STATEFULSET_ENV, statefulset.as_ref()),
                (LABELS_ENV, labels.as_ref()),
            ],
        );
        let lines = common::collect_stdout(&mut child, |_| true);
        Operator {
            child: std::sync::Mutex::new(child),
            lines,
        }
    }

    /// The probe port, once printed.
    pub async fn addr(&self, timeout: Duration) -> Option<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let addr = self.lines.lock().unwrap().iter().find_map(|l| {
                let (_, rest) = l.split_once("operator listening on ")?;
                Some(rest.split_whitespace().next()?.to_string())
            });
            if addr.is_some() || Instant::now() > deadline {
                return addr;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Wait (up to `timeout`) until a printed line satisfies `pred`.
    pub async fn wait_for(&self, timeout: Duration, pred: impl Fn(&str) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.lines.lock().unwrap().iter().any(|l| pred(l)) {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// SIGTERM: a graceful stop.
    pub fn terminate(&self) {
        let pid = self.child.lock().unwrap().id();
        // SAFETY: kill(2) on the pid of a child this process spawned and has not reaped.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    }

    /// Whether it exits 0 within `timeout` (SIGKILLed otherwise).
    pub async fn exited_ok(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.lock().unwrap().try_wait().unwrap() {
                return status.success();
            }
            if Instant::now() > deadline {
                let mut child = self.child.lock().unwrap();
                let _ = child.kill();
                let _ = child.wait();
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The last line, for messages.
    pub fn last_line(&self) -> String {
        common::last_line(&self.lines)
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let mut child = self.child.lock().unwrap();
        if child.try_wait().ok().flatten().is_none() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
