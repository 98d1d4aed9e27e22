//! An example operator on kube-persist's controller: it labels every Pod with the name of
//! its owner (`example.kube-persist.rs/owner=<owner>`), writing through the API.
//!
//! ```text
//! cargo run --release --example operator [-- --pods N] [--changed M] [--new K]  # no cluster needed
//! cargo run --release --example operator -- --cluster [--dir DIR]  # a real cluster (KUBECONFIG)
//! ```
//!
//! `--cluster` is the mode that runs in a Pod (`deploy/`, docs/kubernetes.md): in-cluster config or KUBECONFIG, `--dir`, `--listen` (probes and metrics),
//! `--shard-index` with `--shards-from` (or `--shards`), graceful shutdown on SIGTERM; see
//! `operator/cluster.rs`.
//!
//! Without `--cluster` it starts `testkit-server` (a local Kubernetes API server) with N Pods
//! and runs the same reconciler, in separate processes, on kube-persist's `Controller` (with
//! durable reconcile state) and on kube-runtime's `Controller`: a cold start (label every
//! Pod), a SIGKILL once every Pod is labeled, M Pods changed (their label removed) and K
//! Pods created on the server while the operator is down, and a restart. It prints, for the
//! restart, the objects reconciled, reconciles, API writes, LIST calls, time to converge and
//! peak RSS (VmHWM) of each.
//!
//! The port is one constructor: compare [`persistent_controller`] with [`runtime_controller`].
//! `reconcile` and `error_policy` are plain kube-runtime code.

#[path = "../benches/support/mod.rs"]
mod support;

#[path = "operator/cluster.rs"]
pub mod cluster;

use std::collections::HashSet;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ListParams, PostParams};
use kube::runtime::controller::Action;
use kube::{Api, Client, ResourceExt};
use serde::{Deserialize, Serialize};

/// The label the operator maintains.
pub const OWNER_LABEL: &str = "example.kube-persist.rs/owner";

/// The reconciler's context.
pub struct Ctx {
    /// Client for writes.
    pub client: Client,
    /// Pods relabeled so far.
    pub writes: AtomicU64,
    /// Reconciles so far.
    pub reconciles: AtomicU64,
    /// The objects reconciled so far (`namespace/name`).
    pub objects: Mutex<HashSet<String>>,
}

impl Ctx {
    /// A context writing through `client`.
    pub fn new(client: Client) -> Arc<Ctx> {
        Arc::new(Ctx {
            client,
            writes: AtomicU64::new(0),
            reconciles: AtomicU64::new(0),
            objects: Mutex::new(HashSet::new()),
        })
    }
}

/// What can go wrong in a reconcile.
#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    /// The write failed (409 Conflict when the cached Pod is older than the server's).
    #[error("cannot label the pod: {0}")]
    Kube(#[from] kube::Error),
}

/// The label value a Pod should carry: its controller owner's name, else `none`.
pub fn wanted_owner(pod: &Pod) -> String {
    let owners = pod.owner_references();
    owners
        .iter()
        .find(|o| o.controller == Some(true))
        .or(owners.first())
        .map_or_else(|| "none".to_string(), |o| o.name.clone())
}

/// Whether the Pod carries the label the operator maintains, with the right value.
pub fn is_labeled(pod: &Pod) -> bool {
    pod.labels().get(OWNER_LABEL) == Some(&wanted_owner(pod))
}

/// Labels the Pod with its owner. Idempotent: a labeled Pod is left alone.
pub async fn reconcile(pod: Arc<Pod>, ctx: Arc<Ctx>) -> Result<Action, OperatorError> {
    ctx.reconciles.fetch_add(1, Ordering::Relaxed);
    ctx.objects.lock().unwrap().insert(format!(
        "{}/{}",
        pod.namespace().unwrap_or_default(),
        pod.name_any()
    ));
    let want = wanted_owner(&pod);
    if pod.labels().get(OWNER_LABEL) != Some(&want) {
        let mut labeled = (*pod).clone();
        labeled.labels_mut().insert(OWNER_LABEL.to_string(), want);
        // The cached resourceVersion makes this an optimistic write: 409 if the cache is stale.
        let api = Api::<Pod>::namespaced(ctx.client.clone(), &pod.namespace().unwrap_or_default());
        api.replace(&pod.name_any(), &PostParams::default(), &labeled)
            .await?;
        ctx.writes.fetch_add(1, Ordering::Relaxed);
    }
    Ok(Action::requeue(Duration::from_secs(3600)))
}

/// Retries soon: a conflict resolves once the cache has the newer Pod.
pub fn error_policy(_pod: Arc<Pod>, _err: &OperatorError, _ctx: Arc<Ctx>) -> Action {
    Action::requeue(Duration::from_millis(500))
}

/// The name of the operator's durable reconcile state.
pub const CONTROLLER_NAME: &str = "owner-labeler";

/// The operator's controller on kube-persist: Pods cached on disk in `db`, resumed without a
/// LIST after a restart, and a durable reconcile state: a restart reconciles only the Pods
/// that changed while it was down (and requeues that fell due).
pub fn persistent_controller(
    db: &kube_persist::Db,
    client: Client,
) -> kube_persist::Result<kube_persist::Controller<Pod>> {
    persistent_controller_with(db, client, kube_persist::StreamConfig::default())
}

/// [`persistent_controller`] with the store's configuration (e.g. its shard).
pub fn persistent_controller_with(
    db: &kube_persist::Db,
    client: Client,
    store: kube_persist::StreamConfig,
) -> kube_persist::Result<kube_persist::Controller<Pod>> {
    use kube_persist::controller::{Config, Controller};
    Controller::for_store(
        db,
        "pods",
        Api::<Pod>::all(client),
        store,
        Config::default().concurrency(16),
    )?
    .durable_state(db, CONTROLLER_NAME)
}

/// The same operator's controller on kube-runtime (Pods in memory), for comparison.
pub fn runtime_controller(client: Client) -> kube::runtime::Controller<Pod> {
    use kube::runtime::{Controller, controller::Config, watcher};
    Controller::new(Api::<Pod>::all(client), watcher::Config::default())
        .with_config(Config::default().concurrency(16))
}

/// What a measured operator process reports.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Report {
    ms: u64,
    peak_rss_kib: u64,
    writes: u64,
    reconciles: u64,
    /// Distinct objects reconciled.
    objects: u64,
    #[serde(default)]
    list_calls: u64,
}

/// The operator's command line.
#[derive(Debug, Parser)]
#[command(about = "An example operator on kube-persist, compared with kube-runtime's Controller")]
pub struct Args {
    /// Pods on the local API server.
    #[arg(long, default_value_t = 20_000)]
    pub pods: usize,
    /// Pods changed on the server (their owner label removed) while the operator is down.
    #[arg(long, default_value_t = 500)]
    pub changed: usize,
    /// Pods created on the server while the operator is down.
    #[arg(long, default_value_t = 0)]
    pub new: usize,
    /// Run the persistent operator against the cluster (in-cluster config or KUBECONFIG)
    /// until SIGTERM or Ctrl-C.
    #[arg(long)]
    pub cluster: bool,
    /// The store directory with `--cluster` (default /tmp/kube-persist-operator).
    #[arg(long, visible_alias = "store-dir")]
    pub dir: Option<PathBuf>,
    /// With `--cluster`: the address serving /readyz, /livez and /metrics.
    #[arg(long, default_value = "0.0.0.0:8080")]
    pub listen: std::net::SocketAddr,
    /// With `--cluster`: this replica's shard, a number or a name ending in `-<number>`
    /// (a StatefulSet Pod's name or its `apps.kubernetes.io/pod-index` label).
    #[arg(long)]
    pub shard_index: Option<String>,
    /// With `--cluster`: the number of replicas (shards); 1 is unsharded.
    #[arg(long, default_value_t = 1)]
    pub shards: u32,
    /// With `--cluster`: take the number of shards from this StatefulSet's `replicas`
    /// (`NAMESPACE/NAME`, the operator's own), instead of `--shards`, and stop (to be
    /// restarted with the new count) when it changes. While the replicas re-shard, a
    /// slice may have two owners or none for a while (docs/kubernetes.md, *While the
    /// count changes*).
    #[arg(long, value_name = "NAMESPACE/NAME")]
    pub shards_from: Option<String>,
    /// With `--shards-from`: how often the StatefulSet is read again.
    #[arg(long, default_value_t = 10, hide = true)]
    pub shards_poll_secs: u64,
    /// With `--cluster`: reconcile only the Pods with these labels (a label selector).
    #[arg(long, hide = true)]
    pub labels: Option<String>,
    /// With `--cluster`: /livez fails once the connected watch has been quiet this many
    /// seconds (kube-apiserver sends a bookmark about every minute).
    #[arg(long, default_value_t = 300)]
    pub stale_after_secs: u64,
    /// With `--cluster`: when the store's commits are durable. `every-batch` (fsync each
    /// batch) lets the `kube-persist` tool read the store while the operator runs
    /// (`kubectl exec`); `periodic` (the library's default: every 500 ms) is faster and
    /// holds the store exclusively, so the tool is refused (`Error::Locked`) meanwhile.
    #[arg(long, value_enum, default_value_t = DurabilityArg::EveryBatch)]
    pub durability: DurabilityArg,
    /// Internal: run as a measured operator process (`persist` or `runtime`).
    #[arg(long, hide = true)]
    pub role: Option<String>,
    /// Internal: the API server of a measured process.
    #[arg(long, hide = true)]
    pub url: Option<String>,
    /// Internal: the Pods a measured process waits for.
    #[arg(long, hide = true)]
    pub expect: Option<usize>,
}

/// `--durability`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DurabilityArg {
    /// Every batch durable (fsync): the tool may read the live store.
    EveryBatch,
    /// Durable every 500 ms, in the background: the store is the operator's alone.
    Periodic,
}

impl DurabilityArg {
    /// The store's setting.
    pub fn durability(self) -> kube_persist::Durability {
        match self {
            DurabilityArg::EveryBatch => kube_persist::Durability::EveryBatch,
            DurabilityArg::Periodic => {
                kube_persist::Durability::Periodic(Duration::from_millis(500))
            }
        }
    }
}

impl Args {
    /// What `--cluster` mode runs with.
    pub fn cluster_opts(&self) -> cluster::ClusterOpts {
        cluster::ClusterOpts {
            dir: self
                .dir
                .clone()
                .unwrap_or_else(|| "/tmp/kube-persist-operator".into()),
            listen: self.listen,
            shard_index: self.shard_index.clone(),
            shards: self.shards,
            shards_from: self.shards_from.clone(),
            shards_poll: Duration::from_secs(self.shards_poll_secs.max(1)),
            labels: self.labels.clone(),
            stale_after: Duration::from_secs(self.stale_after_secs),
            durability: self.durability.durability(),
        }
    }
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let rt = support::runtime_with_logs();
    if let Some(role) = &args.role {
        rt.block_on(child(role, &args));
        return std::process::ExitCode::SUCCESS;
    }
    if args.cluster {
        let opts = args.cluster_opts();
        return rt.block_on(async move {
            match Client::try_default().await {
                Ok(client) => cluster::run(client, opts).await,
                Err(e) => {
                    eprintln!("no cluster: {e}");
                    std::process::ExitCode::FAILURE
                }
            }
        });
    }
    rt.block_on(compare(args.pods, args.changed, args.new))
}

/// A measured operator process: runs until every Pod in its cache carries the right label
/// and `--expect N` Pods are cached, reports (`operator-result <json>`), and keeps running
/// until the parent SIGKILLs it.
async fn child(role: &str, args: &Args) {
    let start = Instant::now();
    let url = args.url.as_deref().expect("--url");
    let expect = args.expect.expect("--expect");
    let client = kube_persist_testkit::client_for(url, None);
    let ctx = Ctx::new(client.clone());
    let mut _db = None;
    let task = match role {
        "persist" => {
            let dir = args.dir.as_ref().expect("--dir");
            let db = kube_persist::Db::open(dir).expect("open");
            let controller = persistent_controller(&db, client).expect("open the pods stream");
            let reader = controller.reader();
            let run = controller.run(reconcile, error_policy, ctx.clone());
            let task = tokio::spawn(run.for_each(|_| async {}));
            until_converged(&ctx, || {
                converged(
                    reader.iter().map(|p| p.expect("stored pod decodes")),
                    expect,
                )
            })
            .await;
            // Every reconcile's state is written (in batches, a few ms after it returned)
            // and durable before the parent may kill this process.
            loop {
                let states = db.controller_states().expect("read the reconcile state");
                if states.iter().any(|s| s.objects as usize >= expect) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            db.flush().expect("flush");
            _db = Some(db);
            task
        }
        _ => {
            let controller = runtime_controller(client);
            let store = controller.store();
            let run = controller.run(reconcile, error_policy, ctx.clone());
            let task = tokio::spawn(run.for_each(|_| async {}));
            until_converged(&ctx, || {
                converged(store.state().iter().map(|p| p.as_ref()), expect)
            })
            .await;
            task
        }
    };
    let ms = start.elapsed().as_millis() as u64;
    let (peak_rss_kib, _) = support::rss_kib();
    let report = Report {
        ms,
        peak_rss_kib,
        writes: ctx.writes.load(Ordering::Relaxed),
        reconciles: ctx.reconciles.load(Ordering::Relaxed),
        objects: ctx.objects.lock().unwrap().len() as u64,
        list_calls: 0,
    };
    println!(
        "operator-result {}",
        serde_json::to_string(&report).unwrap()
    );
    // Keep reconciling until SIGKILL, like an operator that crashes.
    let _ = task.await;
}

/// Whether exactly `expect` Pods are cached, each labeled with its owner.
fn converged<P: std::borrow::Borrow<Pod>>(pods: impl Iterator<Item = P>, expect: usize) -> bool {
    let mut n = 0;
    for p in pods {
        if !is_labeled(p.borrow()) {
            return false;
        }
        n += 1;
    }
    n == expect
}

/// Returns once `check` holds, checking (a full scan of the cache) only while the operator
/// is quiet.
async fn until_converged(ctx: &Ctx, mut check: impl FnMut() -> bool) {
    let mut last = u64::MAX;
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = ctx.reconciles.load(Ordering::Relaxed);
        if now == last && check() {
            return;
        }
        last = now;
    }
}

/// Runs one measured operator process until it reports, SIGKILLs it, and returns the report.
fn run_child(role: &str, url: &str, dir: &std::path::Path, expect: usize) -> Report {
    let mut child = Command::new(std::env::current_exe().expect("current exe"))
        .args([
            "--role",
            role,
            "--url",
            url,
            "--expect",
            &expect.to_string(),
        ])
        .arg("--dir")
        .arg(dir)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn operator process");
    let mut report = None;
    for line in BufReader::new(child.stdout.take().unwrap())
        .lines()
        .map_while(Result::ok)
    {
        if let Some(json) = line.strip_prefix("operator-result ") {
            report = Some(serde_json::from_str(json).expect("operator report"));
            break;
        }
    }
    let _ = child.kill(); // SIGKILL
    let _ = child.wait();
    report.unwrap_or_else(|| panic!("{role} operator printed no result"))
}

async fn measured(
    url: &str,
    role: &str,
    dir: &std::path::Path,
    expect: usize,
    label: &str,
) -> Report {
    support::admin(url, "POST", "/testkit/reset-counts").await;
    let mut r = tokio::task::block_in_place(|| run_child(role, url, dir, expect));
    r.list_calls = support::list_calls(url).await;
    println!(
        "  {label}: {:.2} s, {} reconciles of {} objects, {} API writes, {} LIST calls, peak RSS {:.0} MiB",
        r.ms as f64 / 1000.0,
        r.reconciles,
        r.objects,
        r.writes,
        r.list_calls,
        support::mib(r.peak_rss_kib)
    );
    r
}

/// While the operator is down: removes the owner label of `changed` Pods spread over the
/// collection (each needs a reconcile and a write), and creates `new` Pods.
async fn change_while_down(url: &str, changed: usize, new: usize) {
    let client = kube_persist_testkit::client_for(url, None);
    let all = Api::<Pod>::all(client.clone())
        .list(&ListParams::default())
        .await
        .expect("list pods");
    let step = (all.items.len() / changed.max(1)).max(1);
    let picked: Vec<Pod> = all.items.into_iter().step_by(step).take(changed).collect();
    futures::stream::iter(picked)
        .for_each_concurrent(16, |mut pod| {
            let client = client.clone();
            async move {
                pod.labels_mut().remove(OWNER_LABEL);
                let api = Api::<Pod>::namespaced(client, &pod.namespace().unwrap_or_default());
                api.replace(&pod.name_any(), &PostParams::default(), &pod)
                    .await
                    .expect("change a pod");
            }
        })
        .await;
    if new > 0 {
        let create = format!("/testkit/churn?updates=0&creates={new}&deletes=0&seed=7");
        support::admin(url, "POST", &create).await;
    }
}

/// Cold start, SIGKILL, changes while down and restart of both controllers, against fresh
/// `testkit-server` processes.
async fn compare(pods: usize, changed: usize, new: usize) -> std::process::ExitCode {
    println!(
        "operator: label {pods} Pods with their owner; SIGKILL; {changed} Pods changed and {new} created while down; restart"
    );
    let tmp = tempfile::tempdir().expect("temporary directory");
    let mut rows = Vec::new();
    for (role, name) in [("persist", "kube-persist"), ("runtime", "kube-runtime")] {
        let server = support::start_server(pods, &[]);
        let dir = tmp.path().join(role);
        let cold = measured(&server.url, role, &dir, pods, &format!("{name} cold start")).await;
        change_while_down(&server.url, changed, new).await;
        let warm = measured(
            &server.url,
            role,
            &dir,
            pods + new,
            &format!("{name} restart"),
        )
        .await;
        rows.push((cold, warm));
    }
    let (p, r) = (&rows[0], &rows[1]);
    let secs = |x: &Report| format!("{:.2} s", x.ms as f64 / 1000.0);
    let rss = |x: &Report| format!("{:.0} MiB", support::mib(x.peak_rss_kib));
    let n = |v: u64| v.to_string();
    println!();
    println!(
        "{:<40}{:>24}{:>26}",
        "", "kube-persist Controller", "kube-runtime Controller"
    );
    let table: [(&str, String, String); 10] = [
        ("cold start: time to all labeled", secs(&p.0), secs(&r.0)),
        (
            "cold start: reconciles",
            n(p.0.reconciles),
            n(r.0.reconciles),
        ),
        (
            "cold start: LIST calls",
            n(p.0.list_calls),
            n(r.0.list_calls),
        ),
        ("cold start: peak RSS", rss(&p.0), rss(&r.0)),
        (
            "restart: objects reconciled",
            n(p.1.objects),
            n(r.1.objects),
        ),
        ("restart: reconciles", n(p.1.reconciles), n(r.1.reconciles)),
        ("restart: API writes", n(p.1.writes), n(r.1.writes)),
        ("restart: LIST calls", n(p.1.list_calls), n(r.1.list_calls)),
        ("restart: time to converge", secs(&p.1), secs(&r.1)),
        ("restart: peak RSS", rss(&p.1), rss(&r.1)),
    ];
    for (what, a, b) in table {
        println!("{what:<40}{a:>24}{b:>26}");
    }
    println!();
    let total = pods + new;
    let down = if new > 0 {
        format!("{changed} changed, {new} created while down")
    } else {
        format!("{changed} changed while down")
    };
    // The operator requeues after an hour: no requeue falls due during the run.
    let ok = p.1.list_calls == 0
        && p.1.objects == (changed + new) as u64
        && p.1.writes == (changed + new) as u64;
    if ok {
        println!(
            "operator ok: restart reconciled {} of {total} objects ({down}), 0 LIST calls",
            p.1.objects
        );
        std::process::ExitCode::SUCCESS
    } else {
        println!(
            "operator FAILED: restart reconciled {} of {total} objects ({down}) with {} API writes, {} LIST calls",
            p.1.objects, p.1.writes, p.1.list_calls
        );
        std::process::ExitCode::FAILURE
    }
}
