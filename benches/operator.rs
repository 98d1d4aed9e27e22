//! The example operator's restart, on kube-persist's `Controller` (with durable reconcile
//! state) and on kube-runtime's, against a local `testkit-server`.
//!
//! ```text
//! cargo bench --bench operator [-- --pods N] [--changed M] [--new K]
//! ```
//!
//! It starts `testkit-server` with N Pods (20,000) and runs the example operator's
//! reconciler (`examples/operator/labeler.rs`, which labels every Pod with its owner), in
//! separate processes, on kube-persist's `Controller` and on kube-runtime's: a cold start
//! (label every Pod), a SIGKILL once every Pod is labeled, M Pods changed (500; their label
//! removed) and K Pods created (0) on the server while the operator is down, and a restart.
//! It prints, for the cold start and the restart, the objects reconciled, reconciles, API
//! writes, LIST calls, time to converge and peak RSS (VmHWM) of each, then
//! `operator ok: ...` (exit 0) or `operator FAILED: ...` (exit 1): the persistent restart
//! must reconcile exactly the Pods changed or created, with no LIST call.
//!
//! Each measured process is this binary re-executed with `--role persist|runtime --url URL
//! --expect N --dir DIR`; it prints `operator-result <json>` once converged and runs until
//! the parent SIGKILLs it. The operator that `deploy/` ships (`examples/operator.rs`) is
//! not involved beyond its reconciler.

mod support;

#[path = "../examples/operator/labeler.rs"]
#[allow(dead_code)]
mod labeler;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use clap::Parser;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ListParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde::{Deserialize, Serialize};

use labeler::{Ctx, OWNER_LABEL, error_policy, is_labeled, persistent_controller, reconcile};

/// The same operator's controller on kube-runtime (Pods in memory), for comparison.
fn runtime_controller(client: Client) -> kube::runtime::Controller<Pod> {
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

/// The benchmark's command line.
#[derive(Debug, Parser)]
#[command(
    about = "The example operator's restart on kube-persist, compared with kube-runtime's Controller"
)]
struct Args {
    /// Pods on the local API server.
    #[arg(long, default_value_t = 20_000)]
    pods: usize,
    /// Pods changed on the server (their owner label removed) while the operator is down.
    #[arg(long, default_value_t = 500)]
    changed: usize,
    /// Pods created on the server while the operator is down.
    #[arg(long, default_value_t = 0)]
    new: usize,
    /// Internal: run as a measured operator process (`persist` or `runtime`).
    #[arg(long, hide = true)]
    role: Option<String>,
    /// Internal: the API server of a measured process.
    #[arg(long, hide = true)]
    url: Option<String>,
    /// Internal: the Pods a measured process waits for.
    #[arg(long, hide = true)]
    expect: Option<usize>,
    /// Internal: the store directory of a measured `persist` process.
    #[arg(long, hide = true)]
    dir: Option<PathBuf>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let rt = support::runtime_with_logs();
    if let Some(role) = &args.role {
        rt.block_on(child(role, &args));
        return std::process::ExitCode::SUCCESS;
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
            let reader = controller.store();
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
