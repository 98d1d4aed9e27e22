//! The example operator against a real cluster (`--cluster`), as it runs in a Pod (see
//! `deploy/` and docs/kubernetes.md).
//!
//! - The store lives in `--dir` (a volume), the shard comes from `--shard-index` (the
//!   StatefulSet ordinal: a number, or a Pod name ending in `-<ordinal>`) and `--shards`,
//!   or `--shards-from` (the StatefulSet's `replicas`, read again every `shards_poll`; a
//!   change stops this replica to restart with the new count). Replicas running with one
//!   count own disjoint slices; while the count changes they do not, and nothing makes
//!   them wait for each other: a replica with the new count may own objects that one with
//!   the old count still reconciles (two owners, until the old one's next poll and
//!   graceful stop: about `shards_poll` + the longest reconcile), and a slice whose old
//!   owner stopped is unowned until its new owner is restarted and has listed it (the
//!   kubelet's restart back-off plus a cold LIST; late, not lost). docs/kubernetes.md,
//!   *While the count changes*, has the bounds and examples.
//! - One HTTP port (`--listen`) serves `/readyz` (200 once [`Reader::is_ready`] and
//!   [`Reader::is_live`], 503 while syncing, reconnecting or shutting down), `/livez` (200
//!   unless a restart would cure what is wrong: the watch is connected but
//!   [`Reader::last_watch_activity`] is older than `--stale-after`, a stuck connection; or
//!   the store failed on a full disk and space is back, which only a reopen recovers) and
//!   `/metrics` (the `metrics` feature: the store's `kube_persist_*{stream="pods"}` read
//!   from [`Reader::stats`], and the controller's
//!   `kube_persist_controller_*{controller="owner-labeler"}` read from its
//!   `Controller::stats`, at scrape time).
//! - SIGTERM (or SIGINT) stops the controller gracefully (no new reconcile, running ones
//!   finish, the last reconcile-state batch is written), then the store is flushed and
//!   closed and the process exits 0. The next start resumes the watch: no paginated LIST.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube_persist::Reader;
use tokio::sync::watch;

use super::{Ctx, error_policy, persistent_controller_with, reconcile};

/// The environment variable holding the store's encryption key (64 hex characters), read
/// by [`EncryptionKey::from_env_optional`](kube_persist::EncryptionKey::from_env_optional):
/// the store is not encrypted when it is unset, and any other value that is not a key (an
/// empty one too) stops the operator before it opens the store. Whether the store is
/// encrypted is in the `operator listening on` line (`encrypted=true key=<fingerprint>` or
/// `encrypted=false`), and an unencrypted store is logged at warn.
pub const KEY_ENV: &str = "KUBE_PERSIST_KEY";

/// What the operator needs from the command line.
#[derive(Debug, Clone)]
pub struct ClusterOpts {
    /// The store directory (a volume in a Pod).
    pub dir: PathBuf,
    /// Address of the probe and metrics port.
    pub listen: SocketAddr,
    /// This replica's shard: a number, or a name ending in `-<number>` (a StatefulSet
    /// Pod's name); `None` for replica 0.
    pub shard_index: Option<String>,
    /// Replicas (shards) in total; 1 for an unsharded store. Ignored with `shards_from`.
    pub shards: u32,
    /// `NAMESPACE/NAME` of the StatefulSet whose `replicas` is the number of shards: read at
    /// start, then every `shards_poll`; a change stops the operator gracefully (exit 0) so
    /// that it restarts with the new count. Not atomic across replicas: until every
    /// replica runs with the new count, slices may have two owners or none (see the
    /// module doc).
    pub shards_from: Option<String>,
    /// How often `shards_from` is read again.
    pub shards_poll: Duration,
    /// Only the Pods with these labels (a label selector).
    pub labels: Option<String>,
    /// `/livez` fails once the connected watch has been quiet this long.
    pub stale_after: Duration,
    /// When the store's commits become durable. [`Durability::EveryBatch`] (the operator's
    /// default) lets the `kube-persist` tool read the store while the operator runs
    /// (`kubectl exec <pod> -- kube-persist stats <dir>`); `Periodic` holds it exclusively
    /// (BENCHMARKS.md, "Durability and the tool beside the operator").
    ///
    /// [`Durability::EveryBatch`]: kube_persist::Durability::EveryBatch
    pub durability: kube_persist::Durability,
}

/// `replicas` of the StatefulSet `NAMESPACE/NAME`.
async fn replicas_of(client: &Client, sts: &str) -> Result<u32, String> {
    use k8s_openapi::api::apps::v1::StatefulSet;
    let (ns, name) = sts
        .split_once('/')
        .ok_or_else(|| format!("--shards-from {sts:?}: NAMESPACE/NAME"))?;
    let set = kube::Api::<StatefulSet>::namespaced(client.clone(), ns)
        .get(name)
        .await
        .map_err(|e| format!("reading StatefulSet {sts}: {e}"))?;
    let replicas = set.spec.replicas.unwrap_or(1);
    u32::try_from(replicas).map_err(|_| format!("StatefulSet {sts}: replicas {replicas}"))
}

/// Reads `sts`'s replicas every `every` until it differs from `shards`, then asks for a
/// graceful stop (the process exits 0 and is restarted with the new count).
async fn follow_replicas(
    client: Client,
    sts: String,
    shards: u32,
    every: Duration,
    stop: Arc<watch::Sender<bool>>,
) {
    loop {
        tokio::time::sleep(every).await;
        match replicas_of(&client, &sts).await {
            Ok(n) if n != shards => {
                println!(
                    "StatefulSet {sts} now has {n} replicas (was {shards}): stopping to re-shard"
                );
                let _ = stop.send(true);
                return;
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "reading the replica count"),
        }
    }
}

/// The shard index from `0`, `3` or `my-operator-3` (a StatefulSet Pod's name).
pub fn parse_shard_index(s: &str) -> Option<u32> {
    let digits = s.rsplit_once('-').map_or(s, |(_, n)| n);
    digits.parse().ok()
}

/// Free bytes the store's filesystem needs before `/livez` asks for a restart after the
/// store failed on a full disk (a restart on a disk still full would fail again).
const FREE_TO_RESTART: u64 = 16 << 20;

/// Bytes an unprivileged process may still write on the filesystem of `dir`.
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs(3) reads a NUL-terminated path and fills the struct it is given.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statvfs(path.as_ptr(), &mut st) };
    (rc == 0).then(|| st.f_bavail as u64 * st.f_frsize as u64)
}

/// Whether a controller error is the store failing on a full disk: both engines keep
/// failing until the store is reopened, so only a restart recovers it once space is back.
fn is_disk_full<E>(e: &kube_persist::controller::ControllerError<E>) -> bool {
    use kube_persist::controller::ControllerError;
    matches!(
        e,
        ControllerError::Store(kube_persist::Error::DiskFull { .. })
            | ControllerError::ReadFailed(kube_persist::Error::DiskFull { .. }, _)
    )
}

/// Shared with the HTTP handlers.
#[derive(Clone)]
struct Probes {
    reader: Reader<Pod>,
    stopping: watch::Receiver<bool>,
    stale_after: Duration,
    /// The store directory, whose free space `/livez` reads after a full disk.
    dir: PathBuf,
    /// The store reported `Error::DiskFull`.
    disk_full: Arc<AtomicBool>,
    #[cfg(feature = "metrics")]
    registry: std::sync::Arc<prometheus_client::registry::Registry>,
}

fn text(code: StatusCode, body: String) -> Response {
    (code, body + "\n").into_response()
}

async fn readyz(State(p): State<Probes>) -> Response {
    let why = if *p.stopping.borrow() {
        Some("shutting down")
    } else if !p.reader.is_ready() {
        Some("store not synced yet")
    } else if !p.reader.is_live() {
        Some("watch not connected")
    } else {
        None
    };
    match why {
        None => text(StatusCode::OK, "ready".into()),
        Some(why) => text(StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {why}")),
    }
}

async fn livez(State(p): State<Probes>) -> Response {
    if p.disk_full.load(Ordering::Relaxed) {
        let free = free_bytes(&p.dir).unwrap_or(0);
        if free >= FREE_TO_RESTART {
            return text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "the store failed on a full disk and {} MiB are free now: restart to reopen it",
                    free >> 20
                ),
            );
        }
        return text(
            StatusCode::OK,
            "live (the store failed on a full disk; waiting for space)".into(),
        );
    }
    let quiet = p
        .reader
        .last_watch_activity()
        .and_then(|t| t.elapsed().ok());
    match quiet {
        Some(q) if p.reader.is_live() && q > p.stale_after => text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("watch connected but quiet for {} s", q.as_secs()),
        ),
        _ => text(StatusCode::OK, "live".into()),
    }
}

#[cfg(feature = "metrics")]
async fn metrics(State(p): State<Probes>) -> Response {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &p.registry) {
        Ok(()) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        )
            .into_response(),
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("encoding: {e}")),
    }
}

#[cfg(not(feature = "metrics"))]
async fn metrics(State(_): State<Probes>) -> Response {
    (
        StatusCode::NOT_FOUND,
        [(header::CONTENT_TYPE, "text/plain")],
        "built without the metrics feature\n",
    )
        .into_response()
}

/// Sets `stopping` on SIGTERM or SIGINT.
async fn on_signal(stopping: Arc<watch::Sender<bool>>) {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("install the SIGTERM handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
    }
    let _ = stopping.send(true);
}

/// Runs the operator until SIGTERM, then shuts down gracefully (see the module docs).
/// Prints `operator listening on <addr>` once the probes answer and the signal handler is
/// installed, and `operator stopped: ...` after the store is closed.
pub async fn run(client: Client, opts: ClusterOpts) -> ExitCode {
    let index = match opts.shard_index.as_deref().map(parse_shard_index) {
        None => 0,
        Some(Some(i)) => i,
        Some(None) => {
            eprintln!("--shard-index takes a number or a name ending in -<number>");
            return ExitCode::from(2);
        }
    };
    let shards = match &opts.shards_from {
        Some(sts) => match replicas_of(&client, sts).await {
            Ok(n) => n,
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::FAILURE;
            }
        },
        None => opts.shards,
    };
    if opts.shards_from.is_some() && index >= shards {
        // Scaled down past this ordinal: the StatefulSet controller deletes this Pod.
        println!("operator stopped: ordinal {index} is past the {shards} replicas: nothing to own");
        return ExitCode::SUCCESS;
    }
    if shards == 0 || index >= shards {
        eprintln!("shard index {index} is not below --shards {shards}");
        return ExitCode::from(2);
    }
    // Encrypted at rest when the key is given (deploy/: from a required Secret); unset is
    // no key, and said so; set but empty an error, as for the `kube-persist` tool.
    let mut config = kube_persist::DbConfig::default().durability(opts.durability);
    let encrypted = match kube_persist::EncryptionKey::from_env_optional(KEY_ENV) {
        Ok(Some(key)) => {
            let encrypted = format!("encrypted=true key={}", key.fingerprint());
            config = config.encryption_key(key);
            encrypted
        }
        Ok(None) => {
            tracing::warn!(
                "{KEY_ENV} is not set: the store at {} is not encrypted",
                opts.dir.display()
            );
            "encrypted=false".to_string()
        }
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let db = match kube_persist::Db::open_with_async(&opts.dir, config).await {
        Ok(db) => db,
        Err(e) => {
            eprintln!("cannot open the store: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut store = kube_persist::StreamConfig::default();
    if shards > 1 {
        store = store.shards(index, shards);
    }
    if let Some(labels) = &opts.labels {
        store = store.labels(labels);
    }
    let controller = match persistent_controller_with(&db, client.clone(), store) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("cannot open the pods stream: {e}");
            return ExitCode::FAILURE;
        }
    };
    let reader = controller.store();
    let (stop_tx, stopping) = watch::channel(false);
    let mut stop_wait = stopping.clone();
    let controller = controller.graceful_shutdown_on(async move {
        let _ = stop_wait.wait_for(|s| *s).await;
    });

    let disk_full = Arc::new(AtomicBool::new(false));
    let probes = Probes {
        reader: reader.clone(),
        stopping: stopping.clone(),
        stale_after: opts.stale_after,
        dir: opts.dir.clone(),
        disk_full: disk_full.clone(),
        #[cfg(feature = "metrics")]
        registry: {
            let mut registry = prometheus_client::registry::Registry::default();
            let metrics = kube_persist::metrics::Metrics::register(&mut registry);
            metrics.add(&reader);
            metrics.add_controller(super::CONTROLLER_NAME, &controller.stats());
            std::sync::Arc::new(registry)
        },
    };
    let app = axum::Router::new()
        .route("/readyz", axum::routing::get(readyz))
        .route("/livez", axum::routing::get(livez))
        .route("/metrics", axum::routing::get(metrics))
        .with_state(probes);
    let listener = match tokio::net::TcpListener::bind(opts.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("cannot listen on {}: {e}", opts.listen);
            return ExitCode::FAILURE;
        }
    };
    let addr = listener.local_addr().expect("bound address");
    let (http_stop, http_stopped) = tokio::sync::oneshot::channel::<()>();
    let http = tokio::spawn(async move {
        let serve = axum::serve(listener, app).with_graceful_shutdown(async move {
            let _ = http_stopped.await;
        });
        if let Err(e) = serve.await {
            tracing::warn!(error = %e, "probe server failed");
        }
    });
    let stop_tx = Arc::new(stop_tx);
    if let Some(sts) = &opts.shards_from {
        let follow = follow_replicas(
            client.clone(),
            sts.clone(),
            shards,
            opts.shards_poll,
            stop_tx.clone(),
        );
        tokio::spawn(follow);
    }
    tokio::spawn(on_signal(stop_tx));
    println!(
        "operator listening on {addr} (shard {index}/{}, store {}, {encrypted})",
        shards,
        opts.dir.display()
    );

    let ctx = Ctx::new(client);
    controller
        .run(reconcile, error_policy, ctx.clone())
        .for_each(|r| {
            if let Err(e) = &r {
                if is_disk_full(e) && !disk_full.swap(true, Ordering::Relaxed) {
                    tracing::error!(error = %e, "the store failed on a full disk: /livez asks for a restart once space is back");
                }
                tracing::warn!(error = %e, "reconcile");
            }
            async {}
        })
        .await;
    // The run stream ends after a graceful shutdown: no reconcile is running and the last
    // reconcile-state batch is written. Stop the probes, then flush and close the store.
    let since = Instant::now();
    let _ = http_stop.send(());
    let _ = http.await;
    drop(reader);
    let closed = tokio::task::spawn_blocking(move || {
        let res = db.flush();
        drop(db);
        res
    })
    .await
    .expect("the closing task");
    if let Err(e) = closed {
        eprintln!("flushing the store: {e}");
        return ExitCode::FAILURE;
    }
    println!(
        "operator stopped: {} pods labeled, {} reconciles; store closed {} ms after the controller stopped",
        ctx.writes.load(Ordering::Relaxed),
        ctx.reconciles.load(Ordering::Relaxed),
        since.elapsed().as_millis()
    );
    ExitCode::SUCCESS
}
