//! The kube-persist demo: no cluster needed.
//!
//! ```text
//! cargo run --release --example demo [-- --pods N] [--dir DIR] [--engine sled|redb]
//! ```
//! Starts `testkit-server` (a Kubernetes API server for tests) with N realistic Pods as a
//! child process, cold-syncs them into a kube-persist store in a client process, changes
//! Pods on the server, restarts the client on the same directory (warm restart: no paginated LIST),
//! does the same with kube-runtime's in-memory reflector, and prints a side-by-side table.
//!
//! The store uses redb, the default engine for new stores (flat memory under reads, less
//! than half of sled's peak while syncing, a warm restart ready in milliseconds: see
//! BENCHMARKS.md); `--engine sled` runs the same demo on sled. A `--dir` that already
//! holds a store keeps the engine recorded in it unless `--engine` names one.

#[path = "../benches/support/mod.rs"]
mod support;

use std::io::IsTerminal;
use std::path::PathBuf;

use clap::Parser;
use support::{ClientKind, ClientOpts, ClientReport, mib, run_client, start_server};

/// The kube-persist demo, no cluster needed: syncs N Pods from a local API server
/// (testkit-server) into a store, restarts warm (no paginated LIST), and compares with kube-runtime's
/// in-memory reflector.
#[derive(Parser)]
struct Args {
    /// Pods served by the local API server.
    #[arg(long, default_value_t = 50_000)]
    pods: usize,
    /// Store directory (default: a temporary one).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Storage engine (default: the one recorded in --dir, else redb).
    #[arg(long, value_name = "sled|redb")]
    engine: Option<kube_persist::Engine>,
}

/// Runs a client, showing its progress (a bar on a terminal, plain lines otherwise).
fn client(kind: ClientKind, url: &str, opts: ClientOpts, total: u64, label: &str) -> ClientReport {
    let bar = if std::io::stdout().is_terminal() {
        let bar = indicatif::ProgressBar::new(total);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{msg:28} [{bar:40}] {pos}/{len} ({per_sec})")
                .expect("valid template")
                .progress_chars("=> "),
        );
        bar.set_message(label.to_string());
        Some(bar)
    } else {
        println!("{label} ...");
        None
    };
    let report = run_client(
        kind,
        url,
        &ClientOpts {
            progress: true,
            ..opts
        },
        |line| {
            if let Some(n) = line
                .strip_prefix("progress ")
                .and_then(|n| n.parse::<u64>().ok())
            {
                match &bar {
                    Some(b) => b.set_position(n),
                    None if n % 10_000 == 0 => println!("  {label}: {n}/{total} objects"),
                    None => {}
                }
            }
        },
    );
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    println!(
        "  {label}: ready in {:.2} s, {} objects, peak RSS {:.0} MiB",
        report.ready_ms as f64 / 1000.0,
        report.objects,
        mib(report.peak_rss_kib)
    );
    report
}

async fn measured(url: &str, f: impl FnOnce() -> ClientReport) -> ClientReport {
    support::admin(url, "POST", "/testkit/reset-counts").await;
    let mut r = tokio::task::block_in_place(f);
    r.list_calls = support::list_calls(url).await;
    r.list_one_calls = support::list_one_calls(url).await;
    r
}

fn main() -> std::process::ExitCode {
    // The same binary runs the client processes.
    if support::client_main() {
        return std::process::ExitCode::SUCCESS;
    }
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(demo(args))
}

async fn demo(args: Args) -> std::process::ExitCode {
    let n = args.pods;
    println!(
        "kube-persist demo: {n} Pods served by testkit-server (a local Kubernetes API server)"
    );
    let server = start_server(n, &[]);
    let url = server.url.clone();
    println!("server: {url}");
    let tmp = tempfile::tempdir().expect("temporary directory");
    let dir = args.dir.clone().unwrap_or_else(|| tmp.path().join("store"));
    // As `Db::open` chooses: the engine asked for, else the one an existing store records,
    // else the default for new stores (redb).
    let engine = match args.engine {
        Some(engine) => engine,
        None => match kube_persist::Engine::of_store(&dir) {
            Ok(recorded) => recorded.unwrap_or_default(),
            Err(e) => {
                eprintln!("{e}");
                return std::process::ExitCode::FAILURE;
            }
        },
    };
    println!("store directory: {} ({engine} engine)", dir.display());

    let opts = |until_rv| ClientOpts {
        dir: Some(dir.clone()),
        engine,
        until_rv,
        ..ClientOpts::default()
    };
    let total = n as u64;
    let cold = measured(&url, || {
        client(
            ClientKind::Persist,
            &url,
            opts(None),
            total,
            "kube-persist cold sync",
        )
    })
    .await;

    // Changes while the client is down: updates, creates and deletes.
    let changed = support::admin(
        &url,
        "POST",
        "/testkit/churn?updates=300&creates=100&deletes=100&seed=7",
    )
    .await;
    let target = changed["revision"].as_u64().unwrap_or(0);
    println!(
        "server: 300 updates, 100 creates, 100 deletes while the client was stopped (revision {target})"
    );

    let warm = measured(&url, || {
        client(
            ClientKind::Persist,
            &url,
            opts(Some(target)),
            total,
            "kube-persist warm restart",
        )
    })
    .await;
    let store = support::store_versions(&dir, &url);
    let server_now = support::server_versions(&url).await;
    let matches = store == server_now;

    let r_cold = measured(&url, || {
        client(
            ClientKind::Reflector,
            &url,
            ClientOpts::default(),
            total,
            "reflector cold sync",
        )
    })
    .await;
    let r_warm = measured(&url, || {
        client(
            ClientKind::Reflector,
            &url,
            ClientOpts::default(),
            total,
            "reflector restart",
        )
    })
    .await;

    let secs = |ms: u64| format!("{:.2} s", ms as f64 / 1000.0);
    let rss = |r: &ClientReport| format!("{:.0} MiB", mib(r.peak_rss_kib));
    println!();
    println!(
        "{:<34} {:>18} {:>26}",
        "", "kube-persist", "kube-runtime reflector"
    );
    println!(
        "{:<34} {:>18} {:>26}",
        "cold sync: time to ready",
        secs(cold.ready_ms),
        secs(r_cold.ready_ms)
    );
    println!(
        "{:<34} {:>18} {:>26}",
        "cold sync: LIST calls", cold.list_calls, r_cold.list_calls
    );
    println!(
        "{:<34} {:>18} {:>26}",
        "cold sync: peak RSS",
        rss(&cold),
        rss(&r_cold)
    );
    println!(
        "{:<34} {:>18} {:>26}",
        "restart: time to ready",
        secs(warm.ready_ms),
        secs(r_warm.ready_ms)
    );
    println!(
        "{:<34} {:>18} {:>26}",
        "restart: time to caught up",
        secs(warm.live_ms),
        secs(r_warm.live_ms)
    );
    println!(
        "{:<34} {:>18} {:>26}",
        "restart: LIST calls", warm.list_calls, r_warm.list_calls
    );
    println!(
        "{:<34} {:>18} {:>26}",
        "restart: LIST limit=1 (server RV)", warm.list_one_calls, r_warm.list_one_calls
    );
    println!(
        "{:<34} {:>18} {:>26}",
        "restart: peak RSS",
        rss(&warm),
        rss(&r_warm)
    );
    let verdict = if matches {
        format!("yes ({} objects)", store.len())
    } else {
        "NO".to_string()
    };
    println!(
        "{:<34} {:>18} {:>26}",
        "store equals server, object by object", verdict, "-"
    );
    println!();
    if !matches {
        let missing = server_now
            .keys()
            .filter(|k| !store.contains_key(*k))
            .count();
        let extra = store
            .keys()
            .filter(|k| !server_now.contains_key(*k))
            .count();
        println!("demo FAILED: store differs from server ({missing} missing, {extra} extra)");
        return std::process::ExitCode::FAILURE;
    }
    if warm.list_calls != 0 {
        println!(
            "demo FAILED: warm restart made {} LIST calls",
            warm.list_calls
        );
        return std::process::ExitCode::FAILURE;
    }
    println!(
        "demo ok: store matches server ({} objects), warm restart made {} LIST calls",
        store.len(),
        warm.list_calls
    );
    std::process::ExitCode::SUCCESS
}
