//! The example operator that `deploy/` ships as an image: it labels every Pod with the name
//! of its owner (`example.kube-persist.rs/owner=<owner>`), writing through the API, on
//! kube-persist's controller with durable reconcile state.
//!
//! ```text
//! cargo run --release --example operator -- --cluster [--dir DIR]  # in-cluster config or KUBECONFIG
//! ```
//!
//! It runs against a cluster as it runs in a Pod (`deploy/`, docs/kubernetes.md): `--dir`,
//! `--listen` (probes and metrics), `--shard-index` with `--shards-from` (or `--shards`),
//! graceful shutdown on SIGTERM; see `operator/cluster.rs`. `--cluster` is required, so that
//! a command line without it labels no cluster's Pods by mistake.
//!
//! The code that ships is this file, `operator/cluster.rs` (the probes, metrics, sharding
//! and shutdown) and `operator/labeler.rs` (the reconciler). The restart benchmark against
//! kube-runtime's `Controller` (`cargo bench --bench operator`, `benches/operator.rs`)
//! includes the reconciler alone; nothing here depends on `benches/`.

#[path = "operator/labeler.rs"]
mod labeler;

#[path = "operator/cluster.rs"]
pub mod cluster;

pub use labeler::*;

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use kube::Client;

/// The operator's command line.
#[derive(Debug, Parser)]
#[command(about = "An example operator on kube-persist: labels every Pod with its owner")]
pub struct Args {
    /// Run the operator against the cluster (in-cluster config or KUBECONFIG) until
    /// SIGTERM or Ctrl-C. Required.
    #[arg(long, required = true)]
    pub cluster: bool,
    /// The store directory (default /tmp/kube-persist-operator).
    #[arg(long, visible_alias = "store-dir")]
    pub dir: Option<PathBuf>,
    /// The address serving /readyz, /livez and /metrics.
    #[arg(long, default_value = "0.0.0.0:8080")]
    pub listen: std::net::SocketAddr,
    /// This replica's shard, a number or a name ending in `-<number>` (a StatefulSet Pod's
    /// name or its `apps.kubernetes.io/pod-index` label).
    #[arg(long)]
    pub shard_index: Option<String>,
    /// The number of replicas (shards); 1 is unsharded.
    #[arg(long, default_value_t = 1)]
    pub shards: u32,
    /// Take the number of shards from this StatefulSet's `replicas` (`NAMESPACE/NAME`, the
    /// operator's own), instead of `--shards`, and stop (to be restarted with the new
    /// count) when it changes. While the replicas re-shard, a slice may have two owners or
    /// none for a while (docs/kubernetes.md, *While the count changes*).
    #[arg(long, value_name = "NAMESPACE/NAME")]
    pub shards_from: Option<String>,
    /// With `--shards-from`: how often the StatefulSet is read again.
    #[arg(long, default_value_t = 10, hide = true)]
    pub shards_poll_secs: u64,
    /// Reconcile only the Pods with these labels (a label selector).
    #[arg(long, hide = true)]
    pub labels: Option<String>,
    /// /livez fails once the connected watch has been quiet this many seconds
    /// (kube-apiserver sends a bookmark about every minute).
    #[arg(long, default_value_t = 300)]
    pub stale_after_secs: u64,
    /// When the store's commits are durable. `every-batch` (fsync each batch) lets the
    /// `kube-persist` tool read the store while the operator runs (`kubectl exec`);
    /// `periodic` (the library's default: every 500 ms) is faster and holds the store
    /// exclusively, so the tool is refused (`Error::Locked`) meanwhile.
    #[arg(long, value_enum, default_value_t = DurabilityArg::EveryBatch)]
    pub durability: DurabilityArg,
    /// How log lines are written on stderr: `text`, or `json` (one object per line, with
    /// the span fields that name the stream, controller and directory), for a log
    /// pipeline. Also read from `LOG_FORMAT`.
    #[arg(long, value_enum, env = "LOG_FORMAT", default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
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
    /// What the operator runs with.
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

/// The format of the operator's log lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// tracing-subscriber's human format: `watcher{stream=pods dir=..}: message fields`.
    Text,
    /// One JSON object per line (`timestamp`, `level`, `fields`, `target`, `span`,
    /// `spans`).
    Json,
}

/// Logs to stderr (`RUST_LOG`, default `warn`; `--log-format`), then runs the operator on
/// a multi-thread tokio runtime until SIGTERM; exit 2 on a usage error.
fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let filter =
        || tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
    let logs = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter());
    let _ = match args.log_format {
        LogFormat::Text => logs
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init(),
        LogFormat::Json => logs.json().try_init(),
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start the tokio runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let opts = args.cluster_opts();
    rt.block_on(async move {
        match Client::try_default().await {
            Ok(client) => cluster::run(client, opts).await,
            Err(e) => {
                eprintln!("no cluster: {e}");
                std::process::ExitCode::FAILURE
            }
        }
    })
}
