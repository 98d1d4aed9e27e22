//! End-to-end suite against a real kube-apiserver (v1.36.2 with etcd, from the shared
//! `realk8s` folder, see `kube_persist_testkit::realk8s`), or the cluster of
//! `KUBE_PERSIST_E2E_KUBECONFIG`. Without either it prints one skip line and passes.
//!
//! Each scenario prints `e2e <name> ok` (or why it diverged or failed); the last line is
//! `e2e: <N> scenarios against kube-apiserver <gitVersion>, <D> divergences`, and the
//! process fails if a scenario diverged or could not run. LIST counts come from the
//! server's own `/metrics` (`apiserver_request_total`), read just around the client being
//! measured. Child processes (for SIGKILL) are this binary started again with
//! `KP_E2E_CHILD` set.
//!
//! `cargo test --release --all-features --test e2e` runs it alone; `RUST_LOG=kube_persist=debug`
//! prints the library's logs on stderr; `KP_E2E_ONLY=compaction,verify` runs only those.

#[path = "../common/mod.rs"]
mod common;

mod child;
mod cli;
mod crd;
mod delta;
mod delta_seams;
mod deploy;
mod fresh;
mod kill;
mod monitoring;
mod pod_security;
mod scale;
mod shard;
mod support;
mod sync;

use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use futures::Future;
use kube_persist_testkit::realk8s::{self, RealK8s, Target};
use support::{Fail, Outcome, Server};

/// Runs only the scenarios named here (comma-separated), for debugging one.
const ONLY_ENV: &str = "KP_E2E_ONLY";

/// Number of Pods the shared server holds when the scenarios start.
pub const PODS: usize = 2400;

fn main() -> ExitCode {
    if let Ok(role) = std::env::var(child::CHILD_ENV) {
        child::run(&role);
        return ExitCode::SUCCESS;
    }
    // The workspace's CI environment keeps the realk8s folder beside the checkout.
    let target = realk8s::locate_or(concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/realk8s"));
    if let Target::Missing(why) = &target {
        println!("e2e: skipped: {why}");
        return ExitCode::SUCCESS;
    }
    warnings::install();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let suite = rt.block_on(run(target));
    println!(
        "e2e: {} scenarios against kube-apiserver {}, {} divergences",
        suite.ran, suite.version, suite.divergences
    );
    if suite.divergences > 0 || suite.errors > 0 {
        println!("e2e: FAILED ({} scenarios could not run)", suite.errors);
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

#[derive(Default)]
struct Suite {
    ran: usize,
    divergences: usize,
    errors: usize,
    version: String,
}

impl Suite {
    /// Run one scenario on its own task (a panic is an error of that scenario).
    async fn run<F>(&mut self, name: &str, f: F)
    where
        F: Future<Output = Outcome> + Send + 'static,
    {
        if let Ok(only) = std::env::var(ONLY_ENV)
            && !only.split(',').any(|n| n == name)
        {
            return;
        }
        let started = std::time::Instant::now();
        let outcome = match tokio::spawn(f).await {
            Ok(o) => o,
            Err(e) => Err(Fail::Error(format!("panicked: {e}"))),
        };
        self.ran += 1;
        let secs = started.elapsed().as_secs_f64();
        match outcome {
            Ok(()) => println!("e2e {name} ok"),
            Err(Fail::Diverged(why)) => {
                self.divergences += 1;
                println!("e2e {name} DIVERGED ({secs:.1} s): {why}");
            }
            Err(Fail::Error(why)) => {
                self.errors += 1;
                println!("e2e {name} FAILED ({secs:.1} s): {why}");
            }
        }
    }

    /// Reads the server's version for the last line, once; false (an error counted) if
    /// it cannot be read.
    async fn version_of(&mut self, server: &Server) -> bool {
        if !self.version.is_empty() {
            return true;
        }
        match realk8s::git_version(&server.client).await {
            Ok(v) => {
                self.version = v;
                true
            }
            Err(e) => {
                self.error("version", e);
                false
            }
        }
    }

    fn error(&mut self, what: &str, e: impl std::fmt::Display) {
        self.errors += 1;
        println!("e2e {what} FAILED: {e}");
    }
}

/// Start a server from the shared folder with `flags`, or use the external cluster
/// (`None` for flags it cannot have: the caller skips).
async fn server(target: &Target, flags: &str) -> Option<Result<Arc<Server>, Fail>> {
    let guard = match target {
        Target::Folder(folder) => {
            let (folder, flags) = (folder.clone(), flags.to_string());
            match tokio::task::spawn_blocking(move || RealK8s::start(&folder, &flags)).await {
                Ok(Ok(g)) => g,
                Ok(Err(e)) => return Some(Err(e.into())),
                Err(e) => return Some(Err(e.into())),
            }
        }
        Target::Kubeconfig(path) if flags.is_empty() => RealK8s::external(path),
        _ => return None,
    };
    Some(Server::new(guard).await.map(Arc::new))
}

/// A server with `flags` holding [`PODS`] Pods, or `None` (said why, or counted an error).
async fn seeded(suite: &mut Suite, target: &Target, flags: &str) -> Option<Arc<Server>> {
    match server(target, flags).await {
        Some(Ok(s)) => match support::create_pods(&s.client, 0..PODS).await {
            Ok(_) => Some(s),
            Err(e) => {
                suite.error(&format!("seed ({flags})"), format!("{e:?}"));
                None
            }
        },
        Some(Err(e)) => {
            suite.error(&format!("start ({flags})"), format!("{e:?}"));
            None
        }
        None => {
            println!(
                "e2e: the scenarios that need {flags} skipped: the external cluster is not ours to configure"
            );
            None
        }
    }
}

/// The scenarios that need a server started with other flags (the first server, with
/// the defaults, runs every other one).
const SHARDED: &[&str] = &["sharded-server-filters", "reshard-narrowing"];
const NO_WATCH_CACHE: &[&str] = &[
    "compaction",
    "fresh-after-compaction",
    "fresh-quiet-no-bookmarks",
    "delta-relist",
    "delta-relist-kill",
    "delta-relist-rbac",
    "delta-relist-node",
    "delta-relist-names",
];

/// Whether [`ONLY_ENV`] (when set) names a scenario for which `on` holds: a server no
/// selected scenario runs on is not started.
fn selects(on: impl Fn(&str) -> bool) -> bool {
    match std::env::var(ONLY_ENV) {
        Ok(only) => only.split(',').any(on),
        Err(_) => true,
    }
}

async fn run(target: Target) -> Suite {
    let mut suite = Suite::default();
    if selects(|n| !SHARDED.contains(&n) && !NO_WATCH_CACHE.contains(&n)) {
        let Some(a) = seeded(&mut suite, &target, "").await else {
            return suite;
        };
        if !suite.version_of(&a).await {
            return suite;
        }
        default_server(&mut suite, a).await;
    }

    // A server with sharded list and watch on (and the watch cache, which filters watches:
    // without it kube-apiserver v1.36.2 filters LISTs by shardSelector but not WATCH events).
    let flags = "--feature-gates=ShardedListAndWatch=true";
    if selects(|n| SHARDED.contains(&n))
        && let Some(b) = seeded(&mut suite, &target, flags).await
        && suite.version_of(&b).await
    {
        suite
            .run("sharded-server-filters", shard::sharded(b.clone(), true))
            .await;
        suite
            .run("reshard-narrowing", shard::narrowing(b.clone()))
            .await;
    }
    // A server with the watch cache off for Pods and ClusterRoles: a resume from a
    // compacted version answers 410 at once.
    if selects(|n| NO_WATCH_CACHE.contains(&n))
        && let Some(c) = seeded(
            &mut suite,
            &target,
            "--watch-cache-sizes=pods#0,clusterroles.rbac.authorization.k8s.io#0",
        )
        .await
        && suite.version_of(&c).await
    {
        suite.run("compaction", sync::compaction(c.clone())).await;
        suite
            .run("fresh-after-compaction", fresh::after_compaction(c.clone()))
            .await;
        suite
            .run(
                "fresh-quiet-no-bookmarks",
                fresh::quiet_without_bookmarks(c.clone()),
            )
            .await;
        suite.run("delta-relist", delta::relist(c.clone())).await;
        suite
            .run("delta-relist-kill", delta::relist_kill(c.clone()))
            .await;
        suite
            .run("delta-relist-rbac", delta_seams::rbac(c.clone()))
            .await;
        suite
            .run("delta-relist-node", delta_seams::node(c.clone()))
            .await;
        suite.run("delta-relist-names", delta_seams::names(c)).await;
    }
    suite
}

/// The scenarios on a server with the default flags.
async fn default_server(suite: &mut Suite, a: Arc<Server>) {
    let state = Arc::new(sync::Shared::default());
    let s = (a.clone(), state.clone());
    suite
        .run("cold-sync-paginated", sync::cold_sync(s.0, s.1, false))
        .await;
    let s = (a.clone(), state.clone());
    suite
        .run("cold-sync-streaming", sync::cold_sync(s.0, s.1, true))
        .await;
    suite
        .run("verify", cli::verify_all(a.clone(), state.clone()))
        .await;
    let s = (a.clone(), state.clone());
    suite
        .run("warm-restart", sync::warm_restart(s.0, s.1))
        .await;
    suite
        .run("fresh-warm-restart", fresh::warm_restart(a.clone()))
        .await;
    suite
        .run("fresh-quiet-collection", fresh::quiet_collection(a.clone()))
        .await;
    suite
        .run("fresh-read-your-writes", fresh::read_your_writes(a.clone()))
        .await;
    suite
        .run("sigkill-mid-list", kill::mid_list(a.clone()))
        .await;
    suite
        .run("sigkill-mid-watch", kill::mid_watch(a.clone()))
        .await;
    suite
        .run("sharded-client-filters", shard::sharded(a.clone(), false))
        .await;
    suite
        .run("durable-controller", kill::controller(a.clone()))
        .await;
    suite
        .run("crd-schema-change", crd::schema_change(a.clone()))
        .await;
    if a.guard.lock().unwrap().is_local() {
        suite
            .run(
                "apiserver-restart-mid-stream",
                sync::apiserver_restart(a.clone()),
            )
            .await;
    } else {
        println!(
            "e2e apiserver-restart-mid-stream skipped: the external cluster is not ours to restart"
        );
    }
    suite
        .run("deploy-manifests", deploy_manifests(a.clone()))
        .await;
    suite.run("deploy-rbac", deploy_rbac(a.clone())).await;
    suite
        .run("deploy-admission", deploy_admission(a.clone()))
        .await;
    suite
        .run("pod-security", pod_security::pod_security(a.clone()))
        .await;
    suite
        .run("prometheus", monitoring::prometheus(a.clone()))
        .await;
    suite.run("scale-2-3-2", scale::scale(a.clone())).await;
}

/// `deploy/`'s manifests, applied with server-side dry run: every object accepted.
async fn deploy_manifests(s: Arc<Server>) -> Outcome {
    let n = deploy::manifests_accepted(s.client.clone())
        .await
        .map_err(Fail::Diverged)?;
    println!("e2e deploy-manifests: {n} objects accepted with dryRun=All");
    Ok(())
}

/// The admin's configuration of `s` (its kubeconfig), for clients that impersonate.
async fn admin_config(s: &Server) -> Result<kube::Config, Fail> {
    let kubeconfig = kube::config::Kubeconfig::read_from(&s.kubeconfig)
        .map_err(|e| Fail::Error(format!("reading {}: {e}", s.kubeconfig.display())))?;
    kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .map_err(|e| Fail::Error(format!("kubeconfig: {e}")))
}

/// `deploy/rbac.yaml` applied for real is enough for the example operator, and no more.
async fn deploy_rbac(s: Arc<Server>) -> Outcome {
    let config = admin_config(&s).await?;
    let summary = deploy::rbac_suffices(config)
        .await
        .map_err(Fail::Diverged)?;
    println!("e2e deploy-rbac: {summary}");
    Ok(())
}

/// `deploy/admission-policy.yaml` lets the example operator's ServiceAccount change only
/// its label in a Pod.
async fn deploy_admission(s: Arc<Server>) -> Outcome {
    let config = admin_config(&s).await?;
    let summary = deploy::policy_holds(config).await.map_err(Fail::Diverged)?;
    println!("e2e deploy-admission: {summary}");
    Ok(())
}

/// Warnings the library logged (tracing WARN events), captured for checks such as "one
/// warning"; `RUST_LOG` also prints the logs on stderr (off by default).
pub mod warnings {
    use super::*;
    use tracing::field::{Field, Visit};
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::{EnvFilter, Layer};

    static SEEN: Mutex<Vec<String>> = Mutex::new(Vec::new());

    struct Capture;

    struct Message(String);

    impl Visit for Message {
        fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
            if field.name() == "message" {
                self.0 = format!("{value:?}");
            }
        }
    }

    impl<S: tracing::Subscriber> Layer<S> for Capture {
        fn on_event(
            &self,
            event: &tracing::Event<'_>,
            _: tracing_subscriber::layer::Context<'_, S>,
        ) {
            if *event.metadata().level() == tracing::Level::WARN {
                let mut m = Message(String::new());
                event.record(&mut m);
                SEEN.lock().unwrap().push(m.0);
            }
        }
    }

    pub fn install() {
        let print = EnvFilter::try_from_default_env().unwrap_or_else(|_| "off".into());
        let _ = tracing_subscriber::registry()
            .with(Capture.with_filter(EnvFilter::new("kube_persist=warn")))
            .with(
                tracing_subscriber::fmt::layer()
                    .with_writer(std::io::stderr)
                    .with_filter(print),
            )
            .try_init();
    }

    /// How many warnings containing `needle` were logged so far.
    pub fn count(needle: &str) -> usize {
        SEEN.lock()
            .unwrap()
            .iter()
            .filter(|m| m.contains(needle))
            .count()
    }
}
