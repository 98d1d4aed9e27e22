//! Shared by the benchmarks and the demo: run `testkit-server` and each client variant as
//! separate processes, and measure each client's wall time and peak RSS (VmHWM).
//!
//! A binary using this module re-executes itself as a client with
//! `--client <persist|reflector|floor> --url URL [--dir DIR] [--engine E] [--until-rv N]
//! [--until-relist] [--gets-from FILE] [--streams N [--sequential]]`; the client prints one line `client-result <json>`
//! and exits.
#![allow(dead_code)]

pub mod alloc;
pub mod reads;
pub mod streams;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use serde::{Deserialize, Serialize};

/// `--durability every-batch|periodic` (default `periodic`, the library's default: 500 ms).
pub fn durability_arg() -> kube_persist::Durability {
    let args: Vec<String> = std::env::args().collect();
    let Some(i) = args.iter().position(|a| a == "--durability") else {
        return kube_persist::Durability::Periodic(Duration::from_millis(500));
    };
    match args.get(i + 1).map(String::as_str) {
        Some("every-batch") => kube_persist::Durability::EveryBatch,
        Some("periodic") => kube_persist::Durability::Periodic(Duration::from_millis(500)),
        other => {
            eprintln!("--durability takes every-batch or periodic, not {other:?}");
            std::process::exit(2)
        }
    }
}

/// The value of `--engine sled|redb`: default redb, the engine new stores get (see
/// BENCHMARKS.md for why); exits with a message for an unknown engine.
pub fn engine_arg() -> kube_persist::Engine {
    let args: Vec<String> = std::env::args().collect();
    let Some(i) = args.iter().position(|a| a == "--engine") else {
        return kube_persist::Engine::default();
    };
    args.get(i + 1)
        .map(|s| s.parse::<kube_persist::Engine>())
        .unwrap_or_else(|| {
            eprintln!("--engine takes sled or redb");
            std::process::exit(2)
        })
        .unwrap_or_else(|e| {
            eprintln!("{e}");
            std::process::exit(2)
        })
}

/// The value of a `--pods N` argument, if given.
pub fn pods_arg() -> Option<usize> {
    let args: Vec<String> = std::env::args().collect();
    let i = args.iter().position(|a| a == "--pods")?;
    Some(
        args.get(i + 1)
            .and_then(|s| s.parse().ok())
            .expect("--pods takes a number"),
    )
}

/// Logs to stderr (`RUST_LOG`, default `warn`) and a multi-thread tokio runtime: the start
/// of the examples' `main`, in the parent and in the processes it re-executes.
pub fn runtime_with_logs() -> tokio::runtime::Runtime {
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .try_init();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// A `testkit-server` child process.
pub struct ServerProc {
    child: Child,
    pub url: String,
}

impl Drop for ServerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `testkit-server` binary next to this one in `target/<profile>/`, built if missing.
fn server_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    // target/<profile>/examples/demo or target/<profile>/deps/memory-<hash>
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>");
    let bin = profile_dir.join("testkit-server");
    if !bin.exists() {
        eprintln!("building testkit-server (first run only)...");
        let release = profile_dir.ends_with("release");
        let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        cmd.args([
            "build",
            "-q",
            "-p",
            "kube-persist-testkit",
            "--bin",
            "testkit-server",
            "--features",
            "kube-persist-testkit/server",
        ]);
        if release {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("run cargo build for testkit-server");
        assert!(status.success(), "building testkit-server failed");
    }
    bin
}

/// Start `testkit-server --pods N` and wait for its `listening on` line.
pub fn start_server(pods: usize, extra: &[&str]) -> ServerProc {
    let mut child = Command::new(server_binary())
        .args(["--addr", "127.0.0.1:0", "--pods", &pods.to_string()])
        .args(extra)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .expect("start testkit-server");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .expect("read testkit-server output");
    let url = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected testkit-server output: {line:?}"))
        .to_string();
    ServerProc { child, url }
}

/// A small admin call to the testkit server (`/testkit/...`).
pub async fn admin(url: &str, method: &str, path: &str) -> serde_json::Value {
    let client = kube_persist_testkit::client_for(url, None);
    let req = http::Request::builder()
        .method(method)
        .uri(path)
        .body(Vec::new())
        .unwrap();
    let text = client.request_text(req).await.expect("admin request");
    serde_json::from_str(&text).unwrap_or(serde_json::Value::Null)
}

pub async fn list_calls(url: &str) -> u64 {
    admin(url, "GET", "/testkit/counts").await["list"]
        .as_u64()
        .unwrap_or(0)
}

/// `LIST limit=1` requests the server saw (counted apart from `list_calls`): kube-persist's
/// reads of the server's resourceVersion while a store catches up.
pub async fn list_one_calls(url: &str) -> u64 {
    admin(url, "GET", "/testkit/counts").await["list_one"]
        .as_u64()
        .unwrap_or(0)
}

pub async fn revision(url: &str) -> u64 {
    admin(url, "GET", "/testkit/revision").await["revision"]
        .as_u64()
        .unwrap_or(0)
}

/// What a client process reports.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ClientReport {
    /// Milliseconds from process start until the cache was ready (synced or resumed).
    pub ready_ms: u64,
    /// Milliseconds until the store caught up with the server (`Reader::wait_until_caught_up`)
    /// and, with `--until-rv`, reached that revision.
    pub live_ms: u64,
    /// Objects in the cache at the end.
    pub objects: u64,
    /// Peak RSS of the client process (VmHWM), KiB.
    pub peak_rss_kib: u64,
    /// RSS at the end, KiB.
    pub rss_kib: u64,
    /// LIST calls the server saw during this process's life (filled in by the parent).
    pub list_calls: u64,
    /// `LIST limit=1` calls meanwhile (filled in by the parent; not in `list_calls`).
    #[serde(default)]
    pub list_one_calls: u64,
    /// `get`s made after the sync (`--gets-from`), all of which found their object.
    pub gets: u64,
    /// Milliseconds those gets took.
    pub gets_ms: u64,
    /// The most threads the process had at once while syncing (`--streams` runs).
    #[serde(default)]
    pub threads: u64,
    /// With `--reads`: the peak RSS (VmHWM) after the reads phase, KiB (`peak_rss_kib` is
    /// then the peak when ready).
    #[serde(default)]
    pub reads_peak_kib: u64,
}

/// Which client a child process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientKind {
    /// kube-persist with a store of `ClientOpts::engine`.
    Persist,
    /// kube-runtime's `reflector` with its in-memory `Store`.
    Reflector,
    /// A bare kube-runtime `watcher` discarding every object: the floor.
    Floor,
}

impl ClientKind {
    pub fn name(self) -> &'static str {
        match self {
            ClientKind::Persist => "persist",
            ClientKind::Reflector => "reflector",
            ClientKind::Floor => "floor",
        }
    }
}

/// Options of a client run.
#[derive(Debug, Clone, Default)]
pub struct ClientOpts {
    pub dir: Option<PathBuf>,
    /// Storage engine of the kube-persist client (default redb).
    pub engine: kube_persist::Engine,
    /// After the sync, `get` each `namespace/name` listed in this file (one per line) and
    /// report the RSS after the gets (kube-persist client).
    pub gets_from: Option<PathBuf>,
    /// Wait until the cache has caught up with this server revision.
    pub until_rv: Option<u64>,
    /// Wait until the cache relisted once (after a forced 410) before reporting.
    pub until_relist: bool,
    /// Print `progress <n>` lines while syncing.
    pub progress: bool,
    /// Once live (and caught up), SIGKILL the client instead of letting it finish: the
    /// returned report is empty. Used to measure restarts after a crash.
    pub kill_when_live: bool,
    /// Sync this many namespaced collections as separate streams in the one process
    /// (see [`streams`]); 0: one stream of all Pods.
    pub streams: usize,
    /// With `streams`: start each stream once the one before it is ready.
    pub sequential: bool,
    /// Once synced, in the same process: `iter()` over every object, then `get_named_async`
    /// of the first 10,000 keys of `gets_from`, then 10,000 gets of its first 100 keys (the
    /// cold sync bench's reads phase).
    pub reads: bool,
}

/// Run a client variant as a child process and return its report. `on_line` sees every
/// line the child prints (progress lines).
pub fn run_client(
    kind: ClientKind,
    url: &str,
    opts: &ClientOpts,
    mut on_line: impl FnMut(&str),
) -> ClientReport {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--client", kind.name(), "--url", url]);
    if let Some(d) = &opts.dir {
        cmd.arg("--dir").arg(d);
    }
    cmd.args(["--engine", opts.engine.name()]);
    if let Some(f) = &opts.gets_from {
        cmd.arg("--gets-from").arg(f);
    }
    if let Some(rv) = opts.until_rv {
        cmd.args(["--until-rv", &rv.to_string()]);
    }
    if opts.until_relist {
        cmd.arg("--until-relist");
    }
    if opts.progress {
        cmd.arg("--progress");
    }
    if opts.kill_when_live {
        cmd.arg("--hang-when-live");
    }
    if opts.streams > 0 {
        cmd.args(["--streams", &opts.streams.to_string()]);
    }
    if opts.sequential {
        cmd.arg("--sequential");
    }
    if opts.reads {
        cmd.arg("--reads");
    }
    let mut child = cmd
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn client");
    let mut report = None;
    for line in BufReader::new(child.stdout.take().unwrap())
        .lines()
        .map_while(Result::ok)
    {
        if line == "client-live" && opts.kill_when_live {
            child.kill().expect("SIGKILL the client");
            child.wait().expect("wait client");
            return ClientReport::default();
        }
        if let Some(json) = line.strip_prefix("client-result ") {
            report = Some(serde_json::from_str(json).expect("client report"));
        } else {
            on_line(&line);
        }
    }
    let status = child.wait().expect("wait client");
    assert!(status.success(), "{} client failed: {status}", kind.name());
    report.unwrap_or_else(|| panic!("{} client printed no result", kind.name()))
}

/// If this process was started as a client (`--client ...`), run it and return true.
pub fn client_main() -> bool {
    let args: Vec<String> = std::env::args().collect();
    let Some(pos) = args.iter().position(|a| a == "--client") else {
        return false;
    };
    let get = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let kind = match args.get(pos + 1).map(String::as_str) {
        Some("persist") => ClientKind::Persist,
        Some("reflector") => ClientKind::Reflector,
        Some("floor") => ClientKind::Floor,
        other => panic!("unknown client {other:?}"),
    };
    let url = get("--url").expect("--url");
    let opts = ClientOpts {
        dir: get("--dir").map(PathBuf::from),
        engine: get("--engine")
            .map(|e| e.parse().expect("--engine sled|redb"))
            .unwrap_or_default(),
        gets_from: get("--gets-from").map(PathBuf::from),
        until_rv: get("--until-rv").and_then(|s| s.parse().ok()),
        until_relist: args.iter().any(|a| a == "--until-relist"),
        progress: args.iter().any(|a| a == "--progress"),
        kill_when_live: args.iter().any(|a| a == "--hang-when-live"),
        streams: get("--streams").and_then(|s| s.parse().ok()).unwrap_or(0),
        sequential: args.iter().any(|a| a == "--sequential"),
        reads: args.iter().any(|a| a == "--reads"),
    };
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .try_init();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let report = if opts.streams > 0 {
        rt.block_on(streams::run(kind, &url, &opts))
    } else {
        rt.block_on(run_as(kind, &url, &opts))
    };
    println!("client-result {}", serde_json::to_string(&report).unwrap());
    true
}

async fn run_as(kind: ClientKind, url: &str, opts: &ClientOpts) -> ClientReport {
    let start = Instant::now();
    let client = kube_persist_testkit::client_for(url, None);
    let api = Api::<Pod>::all(client);
    let mut report = ClientReport::default();
    match kind {
        ClientKind::Persist => {
            let dir = opts.dir.clone().expect("--dir for the persist client");
            let knob = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
            let mut dbc = kube_persist::DbConfig::default().engine(opts.engine);
            if knob("KP_COMPRESSION") == Some(0) {
                dbc = dbc.compression(false);
            }
            if let Some(c) = knob("KP_CACHE") {
                dbc = dbc.cache_capacity(c);
            }
            let db = kube_persist::Db::open_with(&dir, dbc).expect("open store");
            let cfg =
                kube_persist::StreamConfig::default().validate(knob("KP_VALIDATE") != Some(0));
            let (reader, watcher) = db.store("pods", api, cfg).expect("open stream");
            let progress = opts.progress;
            // A cache-only user: `run()` keeps the store in sync without decoding events.
            let task = tokio::spawn(watcher.run());
            if progress {
                let reader = reader.clone();
                tokio::spawn(async move {
                    let mut last = 0;
                    while !reader.is_ready() {
                        let n = reader.len() / 1000 * 1000;
                        if n > last {
                            println!("progress {n}");
                            last = n;
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                });
            }
            reader.wait_until_ready().await.expect("ready");
            report.ready_ms = start.elapsed().as_millis() as u64;
            // Caught up, not only connected: what the store missed while down is applied.
            reader.wait_until_caught_up().await.expect("caught up");
            if opts.until_relist {
                force_gone(url).await;
                while reader.stats().relists == 0
                    || reader.phase() != kube_persist::SyncPhase::Synced
                {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            if let Some(rv) = opts.until_rv {
                let rv = rv.to_string();
                while !reader
                    .checkpoint()
                    .and_then(|c| kube_persist::resource_version::at_least(&c, &rv))
                    .unwrap_or(false)
                {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
            report.live_ms = start.elapsed().as_millis() as u64;
            report.objects = reader.len() as u64;
            if opts.kill_when_live {
                // Keep watching until the parent's SIGKILL.
                println!("client-live");
                std::future::pending::<()>().await;
            }
            if opts.reads {
                report.peak_rss_kib = rss_kib().0;
                let keys = std::fs::read_to_string(opts.gets_from.as_ref().expect("--gets-from"))
                    .expect("read the keys file");
                let keys: Vec<(String, String)> = keys
                    .lines()
                    .map(|k| k.split_once('/').expect("namespace/name"))
                    .map(|(ns, name)| (ns.to_string(), name.to_string()))
                    .collect();
                let hot = &keys[..100.min(keys.len())];
                let reads = reads::run(&reader, &keys[..10_000.min(keys.len())], hot).await;
                assert_eq!(reads.iterated as u64, report.objects, "iterated");
                report.reads_peak_kib = reads.peak_kib;
            }
            task.abort();
            let _ = task.await;
            db.flush().expect("flush");
            if let Some(file) = opts.gets_from.as_ref().filter(|_| !opts.reads) {
                let keys = std::fs::read_to_string(file).expect("read the keys file");
                let t = Instant::now();
                for key in keys.lines() {
                    let (ns, name) = key.split_once('/').expect("namespace/name");
                    let pod = reader.get_named(Some(ns), name).expect("get");
                    assert!(pod.is_some(), "{key} missing");
                    report.gets += 1;
                }
                report.gets_ms = t.elapsed().as_millis() as u64;
            }
        }
        ClientKind::Reflector | ClientKind::Floor => {
            let (store, writer) = reflector::store::<Pod>();
            let cfg = watcher::Config::default().page_size(500);
            let relists = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
            let seen = relists.clone();
            let progress = opts.progress;
            let is_floor = kind == ClientKind::Floor;
            let (ready_tx, mut ready_rx) = tokio::sync::watch::channel(false);
            let task = tokio::spawn(async move {
                let events = watcher(api, cfg).default_backoff();
                let mut n = 0u64;
                let mut handle = |ev: &watcher::Event<Pod>| match ev {
                    watcher::Event::InitApply(_) => {
                        n += 1;
                        if progress && n.is_multiple_of(1000) {
                            println!("progress {n}");
                        }
                    }
                    watcher::Event::InitDone => {
                        seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        let _ = ready_tx.send(true);
                    }
                    _ => {}
                };
                if is_floor {
                    let mut events = std::pin::pin!(events);
                    while let Some(ev) = events.next().await {
                        if let Ok(ev) = ev {
                            handle(&ev);
                        }
                    }
                } else {
                    let mut events = std::pin::pin!(reflector(writer, events));
                    while let Some(ev) = events.next().await {
                        if let Ok(ev) = ev {
                            handle(&ev);
                        }
                    }
                }
            });
            ready_rx.wait_for(|r| *r).await.expect("ready");
            report.ready_ms = start.elapsed().as_millis() as u64;
            if opts.until_relist {
                force_gone(url).await;
                while relists.load(std::sync::atomic::Ordering::SeqCst) < 2 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            report.live_ms = start.elapsed().as_millis() as u64;
            report.objects = if is_floor {
                0
            } else {
                store.state().len() as u64
            };
            task.abort();
            let _ = task.await;
        }
    }
    let (hwm, rss) = rss_kib();
    if report.reads_peak_kib == 0 {
        report.peak_rss_kib = hwm;
    }
    report.rss_kib = rss;
    report
}

/// Make every watcher's next watch fail with 410 Gone: compact the history, arm a
/// `gone` fault and close the open watches. The clients then relist.
pub async fn force_gone(url: &str) {
    admin(url, "POST", "/testkit/compact").await;
    admin(url, "POST", "/testkit/faults/gone-next-watch").await;
    admin(url, "POST", "/testkit/faults/close-watches").await;
}

/// (VmHWM, VmRSS) of this process in KiB, from /proc/self/status.
pub fn rss_kib() -> (u64, u64) {
    rss_kib_at("/proc/self/status")
}

/// (VmHWM, VmRSS) in KiB from a `/proc/<pid>/status` file (zeros if it cannot be read).
pub fn rss_kib_at(status: &str) -> (u64, u64) {
    let status = std::fs::read_to_string(status).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmHWM:"), field("VmRSS:"))
}

/// `namespace/name` → resourceVersion for every Pod on the server (metadata-only pages).
pub async fn server_versions(url: &str) -> BTreeMap<String, String> {
    let api = Api::<Pod>::all(kube_persist_testkit::client_for(url, None));
    let mut out = BTreeMap::new();
    let mut lp = ListParams::default().limit(1000);
    loop {
        let page = api.list_metadata(&lp).await.expect("list server pods");
        for p in page.items {
            let m = p.metadata;
            out.insert(
                format!(
                    "{}/{}",
                    m.namespace.unwrap_or_default(),
                    m.name.unwrap_or_default()
                ),
                m.resource_version.unwrap_or_default(),
            );
        }
        match page.metadata.continue_ {
            Some(c) if !c.is_empty() => lp = ListParams::default().limit(1000).continue_token(&c),
            _ => return out,
        }
    }
}

/// `namespace/name` → resourceVersion for every Pod in a kube-persist store on disk.
pub fn store_versions(dir: &Path, url: &str) -> BTreeMap<String, String> {
    assert!(
        kube_persist::Engine::of_store(dir)
            .expect("read the store's engine")
            .is_some(),
        "a store at {}",
        dir.display()
    );
    // No engine chosen: the store is opened with the one recorded in it.
    let db = kube_persist::Db::open(dir).expect("open store");
    let api = Api::<Pod>::all(kube_persist_testkit::client_for(url, None));
    let (reader, _watcher) = db
        .store("pods", api, kube_persist::StreamConfig::default())
        .expect("open stream");
    reader
        .iter()
        .map(|p| {
            let p = p.expect("stored pod decodes");
            let m = p.metadata.clone();
            (
                format!(
                    "{}/{}",
                    m.namespace.unwrap_or_default(),
                    m.name.unwrap_or_default()
                ),
                m.resource_version.unwrap_or_default(),
            )
        })
        .collect()
}

pub fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// Bytes of the files under `p` (a store directory's size on disk; for redb, its file's
/// length, which grows in steps).
pub fn dir_size(p: &Path) -> u64 {
    std::fs::read_dir(p)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .map(|e| match e.metadata() {
                    Ok(m) if m.is_dir() => dir_size(&e.path()),
                    Ok(m) => m.len(),
                    Err(_) => 0,
                })
                .sum()
        })
        .unwrap_or(0)
}
