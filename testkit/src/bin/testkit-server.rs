//! `testkit-server`: runs the kube-persist test API server as a standalone process.
//!
//! ```text
//! testkit-server --addr 127.0.0.1:0 --pods N [--namespaces M] [--history EVENTS] [--token T]
//!                [--bookmark-interval-ms MS] [--too-large-wait-ms MS] [--opaque-rv]
//!                [--short-pages] [--gzip] [--streaming-lists supported|rejected|forbidden|ignored]
//!                [--no-sharding]
//! ```
//! (`--no-sharding`: a server without `ShardedListAndWatch`, which ignores `shardSelector`.)
//! (`--bookmark-ms` is an alias of `--bookmark-interval-ms`.)
//! Seeds N pods, prints exactly one line `listening on http://HOST:PORT` to stdout, logs to
//! stderr (`RUST_LOG`), and serves until killed.

#![deny(unsafe_code)]

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use kube_persist_testkit::{ServerOptions, StreamingLists, TestServer};

const USAGE: &str = "usage: testkit-server [--addr HOST:PORT] [--pods N] [--namespaces M] \
                     [--history EVENTS] [--token T] [--bookmark-interval-ms MS] \
                     [--too-large-wait-ms MS] [--opaque-rv] [--short-pages] [--gzip] \
                     [--streaming-lists supported|rejected|forbidden|ignored] [--no-sharding]";

struct Args {
    opts: ServerOptions,
    pods: usize,
    namespaces: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        opts: ServerOptions::default(),
        pods: 0,
        namespaces: 10,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "-h" | "--help" => return Err(USAGE.to_string()),
            "--opaque-rv" => {
                args.opts.opaque_resource_versions = true;
                continue;
            }
            "--short-pages" => {
                args.opts.short_pages = true;
                continue;
            }
            "--gzip" => {
                args.opts.gzip = true;
                continue;
            }
            "--no-sharding" => {
                args.opts.sharded_list_and_watch = false;
                continue;
            }
            _ => {}
        }
        let value = it
            .next()
            .ok_or_else(|| format!("missing value for {flag}\n{USAGE}"))?;
        let bad = |e: &dyn std::fmt::Display| format!("invalid value {value:?} for {flag}: {e}");
        match flag.as_str() {
            "--addr" => args.opts.addr = value.parse().map_err(|e| bad(&e))?,
            "--pods" => args.pods = value.parse().map_err(|e| bad(&e))?,
            "--namespaces" => args.namespaces = value.parse().map_err(|e| bad(&e))?,
            "--history" => args.opts.history = value.parse().map_err(|e| bad(&e))?,
            "--token" => args.opts.token = Some(value),
            "--bookmark-ms" | "--bookmark-interval-ms" => {
                args.opts.bookmark_interval =
                    Duration::from_millis(value.parse().map_err(|e| bad(&e))?)
            }
            "--too-large-wait-ms" => {
                args.opts.too_large_wait =
                    Duration::from_millis(value.parse().map_err(|e| bad(&e))?)
            }
            "--streaming-lists" => {
                args.opts.streaming_lists = match value.to_ascii_lowercase().as_str() {
                    "supported" => StreamingLists::Supported,
                    "rejected" => StreamingLists::Rejected,
                    "forbidden" => StreamingLists::Forbidden,
                    "ignored" => StreamingLists::Ignored,
                    _ => return Err(bad(&"expected supported|rejected|forbidden|ignored")),
                }
            }
            _ => return Err(format!("unknown flag {flag}\n{USAGE}")),
        }
    }
    Ok(args)
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = match parse_args() {
        Ok(a) => a,
        Err(msg) => {
            eprintln!("{msg}");
            return ExitCode::from(2);
        }
    };
    let server = match TestServer::try_start_with(args.opts.clone()).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("testkit-server: cannot bind {}: {e}", args.opts.addr);
            return ExitCode::FAILURE;
        }
    };
    let handle = server.handle();
    let started = Instant::now();
    let (pods, namespaces) = (args.pods, args.namespaces);
    if let Err(e) = tokio::task::spawn_blocking(move || handle.seed_pods(pods, namespaces)).await {
        eprintln!("testkit-server: seeding failed: {e}");
        return ExitCode::FAILURE;
    }
    tracing::info!(pods, namespaces, elapsed = ?started.elapsed(), revision = server.handle().revision(), "seeded");
    let mut stdout = std::io::stdout().lock();
    if writeln!(stdout, "listening on {}", server.url())
        .and_then(|_| stdout.flush())
        .is_err()
    {
        return ExitCode::FAILURE;
    }
    drop(stdout);
    let _ = tokio::signal::ctrl_c().await;
    drop(server);
    ExitCode::SUCCESS
}
