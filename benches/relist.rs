//! A relist past the watch history, full against delta (`RelistMode`), against a real
//! kube-apiserver (the realk8s folder of `KUBE_PERSIST_REALK8S`, or the one beside the
//! checkout; skipped with one line without it).
//!
//! ```text
//! cargo bench --bench relist [-- --pods 100000 --configmaps 20000 --changed 1,5,50]
//! ```
//! For each kind (Pods like the e2e suite's, written with server-side apply so that they carry
//! managedFields; ConfigMaps of about 20 KB) a store is synced by a child process, which exits.
//! Then, for each share of changed objects: that share is updated on the server, the API
//! server is restarted (its watch cache starts at the current revision: the store's
//! checkpoint is past the watch history, and its watch gets `410 Gone`), the store is copied,
//! and one child process reopens each copy, one with `RelistMode::Full` and one with
//! `RelistMode::Delta`, until it has relisted and caught up. Each child talks to the server
//! through a counting TCP proxy in this process (the bytes it received, TLS included); the
//! server's `/metrics` give the requests by verb and `apiserver_response_sizes`. One line per
//! run:
//! `RESULT relist=<full|delta> kind=<Pod|ConfigMap> changed_pct=<P> bytes=<B> requests=<R> caught_up_s=<S> cpu_s=<C> peak_mib=<M>`
//! and a `detail:` line with the requests by verb, the server's response bytes and the
//! store's counters.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod};
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Resource};
use kube_persist::{Db, RelistMode, StreamConfig, SyncPhase};
use kube_persist_testkit::realk8s::{self, RealK8s, Target};
use serde::de::DeserializeOwned;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const NAMESPACES: usize = 10;
/// Server-side applies in flight while seeding and changing.
const PARALLEL: usize = 48;
const CHILD_ENV: &str = "KP_RELIST_CHILD";

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Pod,
    ConfigMap,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Pod => "Pod",
            Kind::ConfigMap => "ConfigMap",
        }
    }

    fn plural(self) -> &'static str {
        match self {
            Kind::Pod => "pods",
            Kind::ConfigMap => "configmaps",
        }
    }

    fn parse(s: &str) -> Kind {
        match s {
            "Pod" => Kind::Pod,
            "ConfigMap" => Kind::ConfigMap,
            other => panic!("unknown kind {other}"),
        }
    }

    /// The object `i` at revision `rev` of the bench's own label.
    fn object(self, i: usize, rev: u64) -> serde_json::Value {
        let ns = format!("relist-{}", i % NAMESPACES);
        match self {
            Kind::Pod => json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": format!("pod-{i:06}"), "namespace": ns,
                    "labels": {"app": "relist", "tier": "web", "rev": rev.to_string()}},
                "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10",
                    "ports": [{"containerPort": 8080, "name": "http"}],
                    "env": [{"name": "MODE", "value": "bench"}],
                    "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}}}]}
            }),
            Kind::ConfigMap => {
                // About 20 KB of text in 10 keys: words drawn from a vocabulary of 4,096 by a
                // seeded generator, so that it compresses like configuration text (about 3x
                // with gzip), not like one repeated string.
                let mut seed = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                let data: serde_json::Map<String, serde_json::Value> = (0..10)
                    .map(|k| (format!("key-{k}"), json!(words(&mut seed, 2000))))
                    .chain([("rev".to_string(), json!(rev.to_string()))])
                    .collect();
                json!({
                    "apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": format!("cm-{i:06}"), "namespace": ns,
                        "labels": {"app": "relist"}},
                    "data": data
                })
            }
        }
    }
}

/// About `len` bytes of words from a vocabulary of 4,096 (syllable pairs), drawn by an
/// xorshift generator.
fn words(seed: &mut u64, len: usize) -> String {
    const SYLLABLES: [&str; 64] = [
        "ba", "be", "bi", "bo", "bu", "da", "de", "di", "do", "du", "ka", "ke", "ki", "ko", "ku",
        "la", "le", "li", "lo", "lu", "ma", "me", "mi", "mo", "mu", "na", "ne", "ni", "no", "nu",
        "pa", "pe", "pi", "po", "pu", "ra", "re", "ri", "ro", "ru", "sa", "se", "si", "so", "su",
        "ta", "te", "ti", "to", "tu", "va", "ve", "vi", "vo", "vu", "za", "ze", "zi", "zo", "zu",
        "xa", "xo", "qa", "qo",
    ];
    let mut out = String::with_capacity(len + 8);
    while out.len() < len {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        out.push_str(SYLLABLES[(*seed & 63) as usize]);
        out.push_str(SYLLABLES[((*seed >> 6) & 63) as usize]);
        out.push(if (*seed >> 12).is_multiple_of(8) {
            '\n'
        } else {
            ' '
        });
    }
    out.truncate(len);
    out
}

fn main() {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        child(&spec);
        return;
    }
    let pods: usize = arg("--pods").map_or(100_000, |v| v.parse().expect("--pods: a number"));
    let cms: usize = arg("--configmaps").map_or(20_000, |v| v.parse().expect("--configmaps"));
    let changed: Vec<u32> = arg("--changed")
        .unwrap_or_else(|| "1,5,50".into())
        .split(',')
        .map(|p| p.trim().parse().expect("--changed: percentages"))
        .collect();
    let folder = match realk8s::locate_or(concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/realk8s"))
    {
        Target::Folder(f) => f,
        Target::Kubeconfig(_) => {
            println!("relist: skipped: needs a realk8s folder (it restarts the API server)");
            return;
        }
        Target::Missing(why) => {
            println!("relist: skipped: {why}");
            return;
        }
    };
    let mut server = RealK8s::start(&folder, "").expect("kube-apiserver starts");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let client = rt.block_on(server.client()).expect("client");
    let version = rt.block_on(realk8s::git_version(&client)).expect("version");
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    eprintln!(
        "relist: kube-apiserver {version}, commit {commit}, {pods} Pods, {cms} ConfigMaps, changed {changed:?}%"
    );
    let proxy = rt.block_on(Proxy::start(&server));
    let work = tempfile::tempdir().expect("tempdir");
    for (kind, n) in [(Kind::ConfigMap, cms), (Kind::Pod, pods)] {
        if n == 0 {
            continue;
        }
        let t = Instant::now();
        rt.block_on(seed(&client, kind, n));
        eprintln!(
            "relist: {n} {}s created in {:.0} s",
            kind.name(),
            t.elapsed().as_secs_f64()
        );
        let base = work.path().join(format!("{}-base", kind.plural()));
        let synced = run_child(&server, &proxy, &rt, &base, kind, "sync", false);
        eprintln!("relist: base store synced: {synced:?}");
        for (round, pct) in changed.iter().enumerate() {
            let t = Instant::now();
            let updated = rt.block_on(change(&client, kind, n, *pct, round as u64 + 1));
            eprintln!(
                "relist: {updated} {}s updated ({pct}%) in {:.0} s",
                kind.name(),
                t.elapsed().as_secs_f64()
            );
            // A new watch cache: the stored checkpoint is past its history.
            server.stop().expect("stop");
            server.restart().expect("restart");
            rt.block_on(warm_up(&client, kind));
            // The order alternates, so that neither mode always runs on a warmer server.
            let modes = if round % 2 == 0 {
                ["full", "delta"]
            } else {
                ["delta", "full"]
            };
            // kube's default (no gzip) gives the RESULT lines; with kube's `gzip` feature
            // the server compresses LIST pages (over 128 KiB) but not single objects.
            for (mode, gzip) in modes.iter().flat_map(|m| [(*m, false), (*m, true)]) {
                let suffix = if gzip { "-gzip" } else { "" };
                let dir = work
                    .path()
                    .join(format!("{}-{mode}{suffix}", kind.plural()));
                let _ = std::fs::remove_dir_all(&dir);
                copy_dir(&base, &dir);
                let r = run_child(&server, &proxy, &rt, &dir, kind, mode, gzip);
                let tag = if gzip {
                    "gzip: with kube's gzip:"
                } else {
                    "RESULT"
                };
                println!(
                    "{tag} relist={mode} kind={} changed_pct={pct} bytes={} requests={} caught_up_s={:.2} cpu_s={:.2} peak_mib={:.1}",
                    kind.name(),
                    r.bytes,
                    r.requests,
                    r.caught_up_ms as f64 / 1000.0,
                    r.cpu_ms as f64 / 1000.0,
                    r.peak_kib as f64 / 1024.0
                );
                println!(
                    "detail: gzip={gzip} relist={mode} kind={} changed_pct={pct} list={} get={} watch={} server_response_bytes={} list_pages={} metadata_pages={} bodies_fetched={} objects={}",
                    kind.name(),
                    r.lists,
                    r.gets,
                    r.watches,
                    r.response_bytes,
                    r.list_pages,
                    r.metadata_pages,
                    r.bodies_fetched,
                    r.objects
                );
            }
            // The delta run's store is synced now: the base of the next round.
            let _ = std::fs::remove_dir_all(&base);
            let delta = work.path().join(format!("{}-delta", kind.plural()));
            std::fs::rename(&delta, &base).expect("rename");
        }
    }
    drop(proxy);
}

/// Create `n` objects of `kind` with server-side apply.
async fn seed(client: &kube::Client, kind: Kind, n: usize) {
    let ns_api = Api::<Namespace>::all(client.clone());
    for i in 0..NAMESPACES {
        let ns: Namespace =
            serde_json::from_value(json!({"metadata": {"name": format!("relist-{i}")}}))
                .expect("namespace");
        let _ = ns_api.create(&PostParams::default(), &ns).await;
    }
    apply_all(client, kind, (0..n).collect(), 0).await;
}

/// Update `pct`% of the `n` objects (spread over the collection) with revision `rev`.
async fn change(client: &kube::Client, kind: Kind, n: usize, pct: u32, rev: u64) -> usize {
    let picked: Vec<usize> = (0..n)
        .filter(|i| (i.wrapping_mul(7919) + rev as usize * 13) % 100 < pct as usize)
        .collect();
    let count = picked.len();
    apply_all(client, kind, picked, rev).await;
    count
}

async fn apply_all(client: &kube::Client, kind: Kind, which: Vec<usize>, rev: u64) {
    let pp = PatchParams::apply("relist-bench").force();
    futures::stream::iter(which)
        .map(|i| {
            let obj = kind.object(i, rev);
            let ns = format!("relist-{}", i % NAMESPACES);
            let name = obj["metadata"]["name"].as_str().expect("name").to_string();
            let client = client.clone();
            let pp = pp.clone();
            async move {
                let res = match kind {
                    Kind::Pod => Api::<Pod>::namespaced(client, &ns)
                        .patch(&name, &pp, &Patch::Apply(obj))
                        .await
                        .map(|_| ()),
                    Kind::ConfigMap => Api::<ConfigMap>::namespaced(client, &ns)
                        .patch(&name, &pp, &Patch::Apply(obj))
                        .await
                        .map(|_| ()),
                };
                res.unwrap_or_else(|e| panic!("apply {ns}/{name}: {e}"));
            }
        })
        .buffer_unordered(PARALLEL)
        .collect::<()>()
        .await;
}

/// Wait until the restarted server lists the kind (its watch cache is being filled).
async fn warm_up(client: &kube::Client, kind: Kind) {
    let lp = kube::api::ListParams::default().limit(1);
    for _ in 0..600 {
        let ok = match kind {
            Kind::Pod => Api::<Pod>::all(client.clone())
                .list_metadata(&lp)
                .await
                .is_ok(),
            Kind::ConfigMap => Api::<ConfigMap>::all(client.clone())
                .list_metadata(&lp)
                .await
                .is_ok(),
        };
        if ok {
            // The watch cache fills from etcd after the server is ready: let it settle.
            tokio::time::sleep(Duration::from_secs(5)).await;
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the restarted server does not list {}", kind.plural());
}

fn copy_dir(from: &Path, to: &Path) {
    let ok = std::process::Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .status()
        .expect("cp")
        .success();
    assert!(ok, "cp -a {} {}", from.display(), to.display());
}

/// What one child process measured, with the proxy's and the server's counts.
#[derive(Debug, Default)]
struct Run {
    bytes: u64,
    requests: u64,
    lists: u64,
    gets: u64,
    watches: u64,
    response_bytes: u64,
    caught_up_ms: u64,
    cpu_ms: u64,
    peak_kib: u64,
    list_pages: u64,
    metadata_pages: u64,
    bodies_fetched: u64,
    objects: u64,
}

fn run_child(
    server: &RealK8s,
    proxy: &Proxy,
    rt: &tokio::runtime::Runtime,
    dir: &Path,
    kind: Kind,
    mode: &str,
    gzip: bool,
) -> Run {
    let client = rt.block_on(server.client()).expect("client");
    let before = rt.block_on(realk8s::metrics(&client)).expect("metrics");
    proxy.received.store(0, Ordering::SeqCst);
    let spec = format!(
        "{}|{}|{}|{}|{}|{gzip}",
        dir.display(),
        kind.name(),
        mode,
        server.kubeconfig().display(),
        proxy.url
    );
    let out = std::process::Command::new(std::env::current_exe().expect("exe"))
        .env(CHILD_ENV, spec)
        .stderr(std::process::Stdio::inherit())
        .output()
        .expect("child runs");
    assert!(out.status.success(), "child {mode} failed: {}", out.status);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find(|l| l.starts_with("child:"))
        .unwrap_or_else(|| panic!("child printed no result: {stdout}"));
    let field = |name: &str| -> u64 {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} in {line}"))
    };
    // A WATCH is counted when it ends: the child's ended with its process.
    std::thread::sleep(Duration::from_secs(1));
    let after = rt.block_on(realk8s::metrics(&client)).expect("metrics");
    let res = kind.plural();
    let delta = |verb: &str| {
        realk8s::count_requests(&after, res, verb)
            .saturating_sub(realk8s::count_requests(&before, res, verb))
    };
    let (lists, gets, watches) = (delta("LIST"), delta("GET"), delta("WATCH"));
    let response_bytes = response_bytes(&after, res).saturating_sub(response_bytes(&before, res));
    Run {
        bytes: proxy.received.load(Ordering::SeqCst),
        requests: lists + gets + watches,
        lists,
        gets,
        watches,
        response_bytes,
        caught_up_ms: field("caught_up_ms"),
        cpu_ms: field("cpu_ms"),
        peak_kib: field("peak_kib"),
        list_pages: field("list_pages"),
        metadata_pages: field("metadata_pages"),
        bodies_fetched: field("bodies_fetched"),
        objects: field("objects"),
    }
}

/// The sum of `apiserver_response_sizes` (bytes) of `resource`, over verbs and scopes.
fn response_bytes(metrics: &str, resource: &str) -> u64 {
    let res = format!("resource=\"{resource}\"");
    metrics
        .lines()
        .filter_map(|l| l.strip_prefix("apiserver_response_sizes_sum{"))
        .filter_map(|l| {
            let (labels, value) = l.rsplit_once("} ")?;
            labels
                .split(',')
                .any(|x| x == res)
                .then(|| value.trim().parse::<f64>().ok())?
        })
        .map(|v| v as u64)
        .sum()
}

/// A TCP proxy to the API server that counts the bytes the server sends.
struct Proxy {
    url: String,
    received: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Proxy {
    async fn start(server: &RealK8s) -> Proxy {
        let config = server.config().await.expect("config");
        let upstream = format!(
            "{}:{}",
            config.cluster_url.host().expect("host"),
            config.cluster_url.port_u16().expect("port")
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let received = Arc::new(AtomicU64::new(0));
        let counter = received.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((down, _)) = listener.accept().await else {
                    return;
                };
                let (upstream, counter) = (upstream.clone(), counter.clone());
                tokio::spawn(async move {
                    let Ok(up) = tokio::net::TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let (dr, dw) = down.into_split();
                    let (ur, uw) = up.into_split();
                    tokio::join!(pump(dr, uw, None), pump(ur, dw, Some(counter)));
                });
            }
        });
        Proxy {
            url: format!("https://127.0.0.1:{port}"),
            received,
            task,
        }
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    counter: Option<Arc<AtomicU64>>,
) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some(c) = &counter {
            c.fetch_add(n as u64, Ordering::Relaxed);
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

/// The child: opens the store in `dir` and waits until it has (re)listed and caught up;
/// prints `child: caught_up_ms=.. cpu_ms=.. peak_kib=.. ...`.
fn child(spec: &str) {
    let parts: Vec<&str> = spec.split('|').collect();
    let [dir, kind, mode, kubeconfig, url, gzip] = parts[..] else {
        panic!("child spec {spec}");
    };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let kc = kube::config::Kubeconfig::read_from(kubeconfig).expect("kubeconfig");
        let mut config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .expect("config");
        config.cluster_url = url.parse().expect("proxy url");
        config.disable_compression = gzip != "true";
        let client = kube::Client::try_from(config).expect("client");
        let start = Instant::now();
        let report = match Kind::parse(kind) {
            Kind::Pod => sync::<Pod>(client, dir, mode).await,
            Kind::ConfigMap => sync::<ConfigMap>(client, dir, mode).await,
        };
        let caught_up_ms = start.elapsed().as_millis() as u64;
        let (cpu_ms, peak_kib) = own_usage();
        println!(
            "child: caught_up_ms={caught_up_ms} cpu_ms={cpu_ms} peak_kib={peak_kib} list_pages={} metadata_pages={} bodies_fetched={} objects={}",
            report.0.list_pages, report.0.metadata_pages, report.0.bodies_fetched, report.1
        );
    });
}

/// Sync (mode `sync`: a first list) or relist (`full`, `delta`) the store in `dir`.
async fn sync<K>(client: kube::Client, dir: &str, mode: &str) -> (kube_persist::Stats, usize)
where
    K: Resource<DynamicType = ()>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let db = Db::open(PathBuf::from(dir)).expect("store opens");
    let relist = match mode {
        "delta" => RelistMode::Delta,
        _ => RelistMode::Full,
    };
    let cfg = StreamConfig::default()
        .relist_mode(relist)
        .relist_jitter(Duration::ZERO);
    let (reader, watcher) = db
        .store("relist", Api::<K>::all(client), cfg)
        .expect("stream opens");
    let task = tokio::spawn(watcher.run());
    let deadline = Instant::now() + Duration::from_secs(1800);
    loop {
        let s = reader.stats();
        let listed = mode == "sync" || s.relists >= 1;
        if listed && reader.phase() == SyncPhase::Synced && reader.is_caught_up() {
            break;
        }
        assert!(Instant::now() < deadline, "no catch-up: {s:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let out = (reader.stats(), reader.len());
    task.abort();
    let _ = task.await;
    out
}

/// This process's CPU time (user + system) in ms and its peak RSS in KiB.
fn own_usage() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which may hold spaces): state is field 3.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0)
        + f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0);
    let hz = 100; // USER_HZ on Linux
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let peak = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0);
    (ticks * 1000 / hz, peak)
}
