//! Sharded replicas, each with its own store: no cluster needed.
//!
//! ```text
//! cargo run --release --example sharded [-- --shards 4] [--pods 20000] [--server-ignores-shards]
//! ```
//! Starts `testkit-server` (a Kubernetes API server for tests) with N Pods and one process
//! per shard (`StreamConfig::shards(i, S)`, split by uid), each with its own store directory, and
//! checks, object by object (key and resourceVersion), that the shards are disjoint and
//! that their union equals the server. Then:
//!
//! - SIGKILLs one replica, changes Pods on the server while it is down, and restarts it on
//!   the same store: it resumes from its checkpoint with 0 paginated LIST calls;
//! - stops every replica, changes Pods again, and re-shards S -> 2S: the store of shard `i`
//!   of S is reopened as shard `2i` of 2S (a narrower shard: pruned on disk, resumed with
//!   0 paginated LIST calls) and shard `2i + 1` of 2S starts on a new, empty store (it lists).
//!
//! LIST calls are the API server's own request counters, read around each start (the
//! replicas that list are started one at a time, so each count is that replica's). Bytes
//! received are counted by a TCP relay between each replica and the server (HTTP headers
//! and bodies). Peak RSS is the replica's VmHWM; "caught up" is the time from the process
//! start until its checkpoint is the server's resourceVersion (a replica whose shard got
//! no event since its checkpoint gets there with the server's next bookmark, up to 1 s);
//! "client-drop" counts the objects the replica received for other shards and dropped. With `--server-ignores-shards` the server
//! runs without `ShardedListAndWatch` (`testkit-server --no-sharding`): it ignores
//! `shardSelector` and sends every object, and each replica filters on the client.
//!
//! The last line is `sharded ok: <S> shards, disjoint, union equals server (<N> objects)`.

#[path = "../benches/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube_persist::{Db, Shard, ShardKey, StreamConfig};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

/// Sharded replicas against a local API server (testkit-server): disjoint shards whose
/// union is the server, a SIGKILLed replica resuming without a paginated LIST, and a re-shard S -> 2S.
#[derive(Parser)]
struct Args {
    /// Replicas (shards of the uid hash space) to start with; the re-shard doubles them.
    #[arg(long, default_value_t = 4)]
    shards: u32,
    /// Pods served by the local API server.
    #[arg(long, default_value_t = 20_000)]
    pods: usize,
    /// Run the server without `ShardedListAndWatch`: it ignores `shardSelector`, so the
    /// replicas receive every object and filter on the client.
    #[arg(long)]
    server_ignores_shards: bool,
    /// Internal: run as the replica of this shard index.
    #[arg(long, hide = true)]
    index: Option<u32>,
    /// Internal: the replica's shard count.
    #[arg(long, hide = true)]
    count: Option<u32>,
    /// Internal: the replica's API server.
    #[arg(long, hide = true)]
    url: Option<String>,
    /// Internal: the replica's store directory.
    #[arg(long, hide = true)]
    dir: Option<PathBuf>,
    /// Internal: the server resourceVersion the replica reports at first.
    #[arg(long, hide = true)]
    rv: Option<String>,
}

/// What a replica reports once it is live and its checkpoint is the server's version.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Report {
    /// Milliseconds from the process start (or the report request) to this report.
    ms: u64,
    objects: u64,
    /// Stored objects whose uid hashes outside the replica's shard (must be 0).
    outside: u64,
    /// Objects the replica dropped because the server sent them for another shard.
    client_filtered: u64,
    peak_rss_kib: u64,
    /// `namespace/name` -> resourceVersion of every stored object.
    versions: BTreeMap<String, String>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let rt = support::runtime_with_logs();
    if let Some(index) = args.index {
        rt.block_on(replica(index, &args));
        return ExitCode::SUCCESS;
    }
    if args.shards == 0 {
        eprintln!("--shards must be at least 1");
        return ExitCode::from(2);
    }
    let started = Instant::now();
    let code = rt.block_on(run(&args));
    eprintln!("wall time {:.1} s", started.elapsed().as_secs_f64());
    code
}

/// A replica process: keeps its shard's store in sync, reports once live at `--rv`, then
/// again for every `report <rv>` line on stdin; on end of stdin it stops and flushes.
async fn replica(index: u32, args: &Args) {
    let started = Instant::now();
    let count = args.count.expect("--count");
    let url = args.url.as_deref().expect("--url");
    let dir = args.dir.as_ref().expect("--dir");
    let shard = Shard::even(ShardKey::Uid, index, count).expect("a valid shard");
    let db = Db::open_async(dir).await.expect("open the store");
    let api = Api::<Pod>::all(kube_persist_testkit::client_for(url, None));
    let (reader, watcher) = db
        .store("pods", api, StreamConfig::default().shard(shard.clone()))
        .expect("open the pods stream");
    let task = tokio::spawn(watcher.run());
    let mut stdin = BufReader::new(tokio::io::stdin()).lines();
    let (mut rv, mut since) = (args.rv.clone().expect("--rv"), started);
    loop {
        // Live comes after any prune of a narrowed shard (the watch connects after it);
        // the checkpoint then reaches `rv` through events or the server's bookmarks.
        reader.wait_until_live().await.expect("live");
        while !reader.is_live() || reader.checkpoint().as_deref() != Some(rv.as_str()) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // A full scan of the store: on the blocking pool, not on a runtime worker.
        let (r, s, ms) = (
            reader.clone(),
            shard.clone(),
            since.elapsed().as_millis() as u64,
        );
        let report = tokio::task::spawn_blocking(move || scan(&r, &s, ms))
            .await
            .expect("scan the store");
        println!("shard-report {}", serde_json::to_string(&report).unwrap());
        match stdin.next_line().await {
            Ok(Some(line)) => {
                rv = line
                    .strip_prefix("report ")
                    .expect("report <rv>")
                    .to_string();
                since = Instant::now();
            }
            _ => break,
        }
    }
    task.abort();
    let _ = task.await;
    db.flush().expect("flush");
}

/// The report of a replica: its stored objects and their versions, checked against its shard.
fn scan(reader: &kube_persist::Reader<Pod>, shard: &Shard, ms: u64) -> Report {
    let mut report = Report {
        ms,
        objects: reader.len() as u64,
        client_filtered: reader.stats().shard_client_filtered,
        peak_rss_kib: support::rss_kib().0,
        ..Report::default()
    };
    for pod in reader.iter() {
        let m = pod.expect("stored pod decodes").metadata.clone();
        if !shard.contains(m.uid.as_deref(), m.namespace.as_deref()) {
            report.outside += 1;
        }
        let key = format!(
            "{}/{}",
            m.namespace.unwrap_or_default(),
            m.name.unwrap_or_default()
        );
        report
            .versions
            .insert(key, m.resource_version.unwrap_or_default());
    }
    report
}

/// A TCP relay from a local port to the API server that counts the bytes sent back.
struct Relay {
    url: String,
    received: Arc<AtomicU64>,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn relay(server: SocketAddr) -> Relay {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a relay");
    let url = format!("http://{}", listener.local_addr().expect("relay address"));
    let received = Arc::new(AtomicU64::new(0));
    let counter = received.clone();
    let accept = tokio::spawn(async move {
        while let Ok((down, _)) = listener.accept().await {
            let counter = counter.clone();
            tokio::spawn(async move {
                let Ok(up) = TcpStream::connect(server).await else {
                    return;
                };
                let (mut down_r, mut down_w) = down.into_split();
                let (mut up_r, mut up_w) = up.into_split();
                let requests = tokio::io::copy(&mut down_r, &mut up_w);
                let responses = async {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = up_r.read(&mut buf).await?;
                        if n == 0 {
                            return Ok::<_, std::io::Error>(());
                        }
                        counter.fetch_add(n as u64, Ordering::Relaxed);
                        down_w.write_all(&buf[..n]).await?;
                    }
                };
                // Either side closing (or the replica being killed) ends the connection.
                tokio::select! { _ = requests => {}, _ = responses => {} }
            });
        }
    });
    Relay {
        url,
        received,
        accept,
    }
}

/// A running replica process and its relay.
struct Replica {
    index: u32,
    count: u32,
    store: String,
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: Lines<BufReader<ChildStdout>>,
    relay: Relay,
}

/// One row of the table: a replica process's first report.
struct Row {
    phase: &'static str,
    shard: (u32, u32),
    store: String,
    report: Report,
    list_calls: u64,
    received: u64,
}

/// How long a replica may take to report before the example gives up.
const REPORT_TIMEOUT: Duration = Duration::from_secs(300);

impl Replica {
    async fn spawn(index: u32, count: u32, server: SocketAddr, dir: &Path, rv: &str) -> Replica {
        let relay = relay(server).await;
        let mut child = Command::new(std::env::current_exe().expect("current exe"))
            .args(["--index", &index.to_string(), "--count", &count.to_string()])
            .args(["--url", &relay.url, "--rv", rv])
            .arg("--dir")
            .arg(dir)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn a replica");
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let store = dir.file_name().unwrap().to_string_lossy().into_owned();
        Replica {
            index,
            count,
            store,
            child,
            stdin,
            stdout,
            relay,
        }
    }

    fn shard(&self) -> String {
        format!("{}/{}", self.index, self.count)
    }

    /// The next report; panics if the replica exits or takes longer than REPORT_TIMEOUT.
    async fn report(&mut self) -> Report {
        let shard = self.shard();
        let wait = async {
            while let Some(line) = self.stdout.next_line().await.expect("replica output") {
                if let Some(json) = line.strip_prefix("shard-report ") {
                    return serde_json::from_str(json).expect("replica report");
                }
            }
            panic!("replica {shard} exited without a report");
        };
        tokio::time::timeout(REPORT_TIMEOUT, wait)
            .await
            .unwrap_or_else(|_| panic!("replica {shard} did not report within {REPORT_TIMEOUT:?}"))
    }

    /// Asks for a report once the replica's checkpoint is `rv`.
    async fn report_at(&mut self, rv: &str) -> Report {
        let stdin = self.stdin.as_mut().expect("replica stdin");
        stdin
            .write_all(format!("report {rv}\n").as_bytes())
            .await
            .expect("write to the replica");
        self.report().await
    }

    async fn sigkill(mut self) {
        self.child.kill().await.expect("SIGKILL the replica");
    }

    /// Graceful stop: end of stdin, the replica stops its watcher and flushes.
    async fn stop(mut self) {
        drop(self.stdin.take());
        let status = self.child.wait().await.expect("wait for the replica");
        assert!(
            status.success(),
            "replica {} failed: {status}",
            self.shard()
        );
    }

    fn row(&self, phase: &'static str, report: Report, list_calls: u64) -> Row {
        Row {
            phase,
            shard: (self.index, self.count),
            store: self.store.clone(),
            report,
            list_calls,
            received: self.relay.received.load(Ordering::Relaxed),
        }
    }
}

/// Starts a replica alone (server counters reset first) and returns it with its row.
async fn start_alone(
    phase: &'static str,
    (index, count): (u32, u32),
    url: &str,
    server: SocketAddr,
    dir: &Path,
    rv: &str,
) -> (Replica, Row) {
    support::admin(url, "POST", "/testkit/reset-counts").await;
    let mut r = Replica::spawn(index, count, server, dir, rv).await;
    let report = r.report().await;
    let lists = support::list_calls(url).await;
    let row = r.row(phase, report, lists);
    (r, row)
}

/// The server's current resourceVersion (compared for equality only).
async fn server_rv(url: &str) -> String {
    support::admin(url, "GET", "/testkit/revision").await["resourceVersion"]
        .as_str()
        .expect("resourceVersion")
        .to_string()
}

/// Whether the shards are disjoint, hold only their own objects, and their union equals
/// the server object by object; prints the verdict.
async fn check(url: &str, reports: &[&Report]) -> Option<usize> {
    let server = support::server_versions(url).await;
    let mut union = BTreeMap::new();
    let (mut overlaps, mut outside) = (0, 0);
    for r in reports {
        outside += r.outside;
        for (k, v) in &r.versions {
            if union.insert(k, v).is_some() {
                overlaps += 1;
            }
        }
    }
    let missing = server.keys().filter(|k| !union.contains_key(k)).count();
    let extra = union.keys().filter(|k| !server.contains_key(**k)).count();
    let stale = server
        .iter()
        .filter(|(k, v)| union.get(k).is_some_and(|have| have != v))
        .count();
    let s = reports.len();
    if overlaps + missing + extra + stale == 0 && outside == 0 {
        println!(
            "check: {s} shards disjoint, union equals server ({} objects)",
            server.len()
        );
        Some(server.len())
    } else {
        println!(
            "check FAILED: {s} shards: {overlaps} objects in two shards, {outside} outside their shard, \
             {missing} missing, {extra} not on the server, {stale} at another resourceVersion"
        );
        None
    }
}

/// Server changes while replicas are down; returns the new resourceVersion.
async fn churn(url: &str, (updates, creates, deletes, seed): (u32, u32, u32, u32)) -> String {
    let path =
        format!("/testkit/churn?updates={updates}&creates={creates}&deletes={deletes}&seed={seed}");
    support::admin(url, "POST", &path).await;
    println!("server: {updates} updates, {creates} creates, {deletes} deletes");
    server_rv(url).await
}

fn print_table(rows: &[Row]) {
    println!();
    println!(
        "{:<10} {:>6} {:<14} {:>8} {:>11} {:>9} {:>10} {:>12} {:>9}",
        "phase",
        "shard",
        "store",
        "objects",
        "LIST calls",
        "peak RSS",
        "received",
        "client-drop",
        "caught up"
    );
    for r in rows {
        println!(
            "{:<10} {:>6} {:<14} {:>8} {:>11} {:>9} {:>10} {:>12} {:>9}",
            r.phase,
            format!("{}/{}", r.shard.0, r.shard.1),
            r.store,
            r.report.objects,
            r.list_calls,
            format!("{:.0} MiB", support::mib(r.report.peak_rss_kib)),
            format!("{:.1} MiB", r.received as f64 / (1024.0 * 1024.0)),
            r.report.client_filtered,
            format!("{:.2} s", r.report.ms as f64 / 1000.0),
        );
    }
    println!();
}

async fn run(args: &Args) -> ExitCode {
    let (s, n) = (args.shards, args.pods);
    let mode = if args.server_ignores_shards {
        "server ignores shardSelector, replicas filter"
    } else {
        "server filters by shardSelector"
    };
    println!("sharded: {n} Pods on testkit-server ({mode}), {s} replicas by uid");
    let flags: &[&str] = if args.server_ignores_shards {
        &["--no-sharding"]
    } else {
        &[]
    };
    let server = support::start_server(n, flags);
    let url = server.url.clone();
    let addr: SocketAddr = url
        .strip_prefix("http://")
        .and_then(|a| a.parse().ok())
        .expect("server address");
    let tmp = tempfile::tempdir().expect("temporary directory");
    let dir = |i: u32, c: u32| tmp.path().join(format!("shard-{i}-of-{c}"));
    let mut rows = Vec::new();
    let mut failures = Vec::new();

    // Start: one replica per shard, each on a new store, one at a time.
    let rv = server_rv(&url).await;
    let mut replicas = Vec::new();
    for i in 0..s {
        let (r, row) = start_alone("start", (i, s), &url, addr, &dir(i, s), &rv).await;
        replicas.push(r);
        rows.push(row);
    }
    let first: Vec<&Report> = rows.iter().map(|r| &r.report).collect();
    if check(&url, &first).await.is_none() {
        failures.push("start: shards differ from the server".to_string());
    }
    // Who filtered: the server (the replicas dropped nothing) or, without the feature,
    // each replica (it dropped the other shards' objects).
    let dropped = rows.iter().filter(|r| r.report.client_filtered > 0).count();
    if !args.server_ignores_shards && dropped > 0 {
        failures.push("start: the server filters, yet a replica dropped objects".into());
    }
    if args.server_ignores_shards && s > 1 && dropped < rows.len() {
        failures.push("start: the server ignores shards, yet a replica dropped nothing".into());
    }

    // SIGKILL one replica, change Pods while it is down, restart it on its store.
    let k = s / 2;
    println!("SIGKILL replica {k}/{s}");
    replicas.remove(k as usize).sigkill().await;
    let rv = churn(&url, (300, 100, 100, 7)).await;
    let (restarted, row) = start_alone("restart", (k, s), &url, addr, &dir(k, s), &rv).await;
    if row.list_calls != 0 {
        failures.push(format!("restart: {} LIST calls", row.list_calls));
    }
    let mut now = Vec::new();
    for r in &mut replicas {
        now.push(r.report_at(&rv).await);
    }
    let mut all: Vec<&Report> = now.iter().collect();
    all.push(&row.report);
    if check(&url, &all).await.is_none() {
        failures.push("restart: shards differ from the server".into());
    }
    rows.push(row);
    replicas.insert(k as usize, restarted);

    // Re-shard S -> 2S: stop all, change Pods, reopen each store as the first half of its
    // shard (0 LIST), then start the second halves on new stores (they list).
    let s2 = s * 2;
    println!("re-shard {s} -> {s2}: stop the {s} replicas");
    for r in replicas.drain(..) {
        r.stop().await;
    }
    let rv = churn(&url, (200, 50, 50, 8)).await;
    let mut final_rows = Vec::new();
    for i in 0..s {
        let (r, row) = start_alone("re-shard", (2 * i, s2), &url, addr, &dir(i, s), &rv).await;
        if row.list_calls != 0 {
            failures.push(format!(
                "re-shard: narrowed shard {}/{s2} made {} LIST calls",
                row.shard.0, row.list_calls
            ));
        }
        replicas.push(r);
        final_rows.push(row);
    }
    for i in 0..s {
        let (r, row) = start_alone(
            "re-shard",
            (2 * i + 1, s2),
            &url,
            addr,
            &dir(2 * i + 1, s2),
            &rv,
        )
        .await;
        if row.list_calls == 0 {
            failures.push(format!(
                "re-shard: new shard {}/{s2} made no LIST call",
                row.shard.0
            ));
        }
        replicas.push(r);
        final_rows.push(row);
    }
    final_rows.sort_by_key(|r| r.shard);
    let last: Vec<&Report> = final_rows.iter().map(|r| &r.report).collect();
    let total = check(&url, &last).await;
    rows.extend(final_rows);
    print_table(&rows);
    for r in replicas {
        r.stop().await;
    }
    match total {
        Some(total) if failures.is_empty() => {
            println!("sharded ok: {s2} shards, disjoint, union equals server ({total} objects)");
            ExitCode::SUCCESS
        }
        _ => {
            if total.is_none() {
                failures.push("re-shard: shards differ from the server".into());
            }
            println!("sharded FAILED: {}", failures.join("; "));
            ExitCode::FAILURE
        }
    }
}
