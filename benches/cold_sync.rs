//! A cold sync at the speed of the wire, against a real kube-apiserver (the realk8s folder of
//! `KUBE_PERSIST_REALK8S`, or the one beside the checkout; skipped with one line without it).
//!
//! ```text
//! cargo bench --bench cold_sync [-- --pods 100000 --rounds 1 --gzip]
//! cargo bench --bench cold_sync -- --quick          # 10,000 Pods
//! ```
//!
//! The server runs in a kept directory (`KP_COLD_SYNC_DIR`, default
//! `target/tmp/cold-sync-realk8s-<N>`): it is loaded once with N Pods of about 7.5 KB each
//! (created with a field manager, so that they carry managedFields like a cluster's), and a
//! later run with the same N reuses the data. Then, one child process after another, each a
//! separate process from the server, each with a fresh `kube::Client` from the same
//! kubeconfig (no gzip unless `--gzip`: on loopback it only costs both sides CPU):
//!
//! 1. `floor-paged`: kube's HTTP client reads every page of the paged LIST (page 500) chunk
//!    by chunk and drops the bytes; only the continue token is parsed, from the page's head,
//!    and the next page is asked for once the page is read.
//! 2. `floor-stream`: the same for a streaming list (`sendInitialEvents=true`), read until
//!    the end bookmark; only each line's first bytes are looked at.
//! 3. `persist-paged`: kube-persist (redb, the default configuration) syncs into an empty
//!    store until ready; then the reads phase in the same process: iterate all, 10,000
//!    random `get_named_async`, 10,000 gets of a hot set of 100.
//! 4. `persist-stream`: the same sync with `streaming_lists()`, no reads.
//! 5. `reflector`: kube-runtime's `reflector` with its default watcher configuration, until
//!    `InitDone`.
//!
//! With `--rounds R` each runs R times in that order and the median counts. One line:
//! `RESULT cold_sync pods=<N> floor_paged_s=<s> paged_s=<s> paged_ratio=<x> floor_stream_s=<s>
//! stream_s=<s> stream_ratio=<x> reflector_s=<s> rss_ready_mib=<m> rss_reads_mib=<m>
//! commit=<sha>`, where `rss_ready_mib` is the larger peak RSS (VmHWM) of the two kube-persist
//! syncs when ready and `rss_reads_mib` the peak after the reads phase; `detail:` lines on
//! stderr carry every run. A benchmark, not a test: nothing here asserts a time.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures::{AsyncBufRead, AsyncBufReadExt, StreamExt};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{ListParams, PostParams, WatchParams};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Api, core::Request};
use kube_persist::{Db, StreamConfig};
use kube_persist_testkit::realk8s::{self, RealK8s, Target};
use serde_json::json;

mod support;

const NAMESPACES: usize = 10;
/// Creates in flight while loading.
const PARALLEL: usize = 32;
const PAGE: u32 = 500;
const READS: usize = 10_000;
const HOT: usize = 100;
const CHILD_ENV: &str = "KP_COLD_SYNC_CHILD";

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn flag(name: &str) -> bool {
    std::env::args().any(|a| a == name)
}

fn namespace(i: usize) -> String {
    format!("cold-{}", i % NAMESPACES)
}

fn name(i: usize) -> String {
    format!("pod-{i:07}")
}

/// Pod `i`: two containers with env, probes, mounts and resources, labels, annotations and
/// an owner, like a Deployment's Pod (about 7.5 KB as the server lists it, managedFields
/// included).
fn pod(i: usize) -> Pod {
    let app = format!("app-{:02}", i % 50);
    let env: Vec<_> = (0..5)
        .map(|k| json!({"name": format!("SETTING_{k:02}"), "value": format!("value-{k}-{}", i % 997)}))
        .collect();
    let container = |name: &str, port: u16| {
        json!({
            "name": name,
            "image": format!("registry.example.com/team/{app}:v1.{}.{}", i % 7, i % 13),
            "env": env,
            "ports": [{"containerPort": port, "name": "http", "protocol": "TCP"},
                      {"containerPort": port + 1, "name": "metrics", "protocol": "TCP"}],
            "resources": {"requests": {"cpu": "100m", "memory": "128Mi"},
                          "limits": {"cpu": "500m", "memory": "512Mi"}},
            "livenessProbe": {"httpGet": {"path": "/healthz", "port": port},
                              "initialDelaySeconds": 10, "periodSeconds": 10},
            "volumeMounts": [{"name": "config", "mountPath": "/etc/app"},
                             {"name": "data", "mountPath": "/var/lib/app"},
                             {"name": "tls", "mountPath": "/etc/tls", "readOnly": true}],
            "securityContext": {"runAsNonRoot": true, "allowPrivilegeEscalation": false,
                                "capabilities": {"drop": ["ALL"]}}
        })
    };
    let hash = format!("{:016x}", (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let value = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": name(i), "namespace": namespace(i),
            "labels": {"app": app, "tier": "web", "team": format!("team-{}", i % 9),
                "env": "production", "release": format!("r{}", i % 5), "version": "v1",
                "component": "server", "pod-template-hash": &hash[..10]},
            "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": "8081",
                "checksum/config": format!("{hash}{hash}{hash}{hash}")},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                "name": format!("{app}-{}", &hash[..10]),
                "uid": format!("{}-0000-4000-8000-{}", &hash[..8], &hash[4..16]),
                "controller": true, "blockOwnerDeletion": true}]
        },
        "spec": {
            "containers": [container("app", 8080), container("sidecar", 9090)],
            "volumes": [{"name": "config", "configMap": {"name": format!("{app}-config")}},
                        {"name": "data", "emptyDir": {"sizeLimit": "1Gi"}},
                        {"name": "tls", "secret": {"secretName": format!("{app}-tls")}}],
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "tolerations": [{"key": "example.com/dedicated", "operator": "Equal",
                             "value": "web", "effect": "NoSchedule"}],
            "terminationGracePeriodSeconds": 30,
            "priorityClassName": "",
        }
    });
    serde_json::from_value(value).expect("the bench's Pod is a Pod")
}

async fn client_from(kubeconfig: &Path, gzip: bool) -> kube::Client {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig).expect("kubeconfig");
    let mut config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .expect("config");
    config.disable_compression = !gzip;
    kube::Client::try_from(config).expect("client")
}

/// How many Pods the server holds (one LIST of one item and its `remainingItemCount`).
async fn count(client: &kube::Client) -> usize {
    let list = Api::<Pod>::all(client.clone())
        .list_metadata(&ListParams::default().limit(1))
        .await
        .expect("count");
    list.items.len() + list.metadata.remaining_item_count.unwrap_or(0) as usize
}

/// Creates every missing Pod of `0..n` (an existing one answers 409 and is kept).
async fn load(client: &kube::Client, n: usize) {
    let have = count(client).await;
    if have >= n {
        eprintln!("cold_sync: the server holds {have} Pods, reused");
        return;
    }
    for ns in 0..NAMESPACES {
        let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": namespace(ns)}}))
            .expect("namespace");
        match Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => panic!("namespace: {e}"),
        }
    }
    eprintln!("cold_sync: loading {n} Pods (the server holds {have})");
    let t = Instant::now();
    let pp = PostParams {
        field_manager: Some("cold-sync-bench".into()),
        ..Default::default()
    };
    futures::stream::iter(0..n)
        .map(|i| {
            let (client, pp) = (client.clone(), pp.clone());
            async move {
                let api = Api::<Pod>::namespaced(client, &namespace(i));
                loop {
                    match api.create(&pp, &pod(i)).await {
                        Ok(_) => break,
                        Err(kube::Error::Api(s)) if s.code == 409 => break,
                        Err(e) => {
                            eprintln!("cold_sync: create {i}: {e}; again");
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                    }
                }
                if (i + 1) % 10_000 == 0 {
                    eprintln!("cold_sync: {} created", i + 1);
                }
            }
        })
        .buffer_unordered(PARALLEL)
        .collect::<()>()
        .await;
    eprintln!("cold_sync: loaded in {:.1} s", t.elapsed().as_secs_f64());
}

fn main() {
    if let Ok(mode) = std::env::var(CHILD_ENV) {
        child(&mode);
        return;
    }
    let pods: usize = if flag("--quick") {
        10_000
    } else {
        arg("--pods").map_or(100_000, |v| v.parse().expect("--pods: a number"))
    };
    let rounds: usize = arg("--rounds").map_or(1, |v| v.parse().expect("--rounds: a number"));
    let gzip = flag("--gzip");
    let folder = match realk8s::locate_or(concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/realk8s"))
    {
        Target::Folder(f) => f,
        Target::Kubeconfig(_) => {
            println!("cold_sync: skipped: needs a realk8s folder (it keeps its data)");
            return;
        }
        Target::Missing(why) => {
            println!("cold_sync: skipped: {why}");
            return;
        }
    };
    let dir = std::env::var_os("KP_COLD_SYNC_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("cold-sync-realk8s-{pods}"))
        });
    let server = RealK8s::start_kept(&folder, &dir, "").expect("kube-apiserver starts");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let client = rt.block_on(server.client()).expect("client");
    let version = rt.block_on(realk8s::git_version(&client)).expect("version");
    rt.block_on(load(&client, pods));
    let held = rt.block_on(count(&client));
    assert_eq!(held, pods, "the server holds other Pods than the bench's");
    drop(client);
    drop(rt);
    let commit = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    eprintln!(
        "cold_sync: kube-apiserver {version}, commit {commit}, {pods} Pods, {rounds} round(s), gzip {gzip}"
    );
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    // One unmeasured pass first: the server's watch cache and the page cache warm.
    run_child("floor-paged", server.kubeconfig(), work.path(), gzip, pods);
    let modes = [
        "floor-paged",
        "floor-stream",
        "persist-paged",
        "persist-stream",
        "reflector",
    ];
    let mut runs: Vec<Vec<Report>> = vec![Vec::new(); modes.len()];
    for round in 0..rounds {
        for (m, mode) in modes.iter().enumerate() {
            let r = run_child(mode, server.kubeconfig(), work.path(), gzip, pods);
            eprintln!(
                "detail: round={round} mode={mode} secs={:.2} peak_mib={:.1} {}",
                r.secs,
                r.peak_kib as f64 / 1024.0,
                r.rest
            );
            runs[m].push(r);
        }
    }
    let median = |m: usize| {
        let mut v: Vec<f64> = runs[m].iter().map(|r| r.secs).collect();
        v.sort_by(f64::total_cmp);
        (v[(v.len() - 1) / 2] + v[v.len() / 2]) / 2.0
    };
    let peak =
        |m: usize, f: fn(&Report) -> u64| runs[m].iter().map(f).max().unwrap_or(0) as f64 / 1024.0;
    let (floor_paged, paged, floor_stream, stream, refl) =
        (median(0), median(2), median(1), median(3), median(4));
    let rss_ready = peak(2, |r| r.peak_kib).max(peak(3, |r| r.peak_kib));
    let rss_reads = peak(2, |r| r.reads_peak_kib);
    println!(
        "RESULT cold_sync pods={pods} floor_paged_s={floor_paged:.2} paged_s={paged:.2} paged_ratio={:.2} floor_stream_s={floor_stream:.2} stream_s={stream:.2} stream_ratio={:.2} reflector_s={refl:.2} rss_ready_mib={rss_ready:.1} rss_reads_mib={rss_reads:.1} commit={commit}",
        paged / floor_paged,
        stream / floor_stream,
    );
    drop(server);
}

/// What a child printed: `child: secs=<s> peak_kib=<k> [reads_peak_kib=<k>] ...`.
#[derive(Clone, Debug, Default)]
struct Report {
    secs: f64,
    peak_kib: u64,
    reads_peak_kib: u64,
    rest: String,
}

fn run_child(mode: &str, kubeconfig: &Path, work: &Path, gzip: bool, pods: usize) -> Report {
    let store = work.join(format!("store-{mode}"));
    let _ = std::fs::remove_dir_all(&store);
    let out = Command::new(std::env::current_exe().expect("own path"))
        .env(CHILD_ENV, mode)
        .env("KP_COLD_SYNC_KUBECONFIG", kubeconfig)
        .env("KP_COLD_SYNC_STORE", &store)
        .env("KP_COLD_SYNC_GZIP", if gzip { "1" } else { "0" })
        .env("KP_COLD_SYNC_PODS", pods.to_string())
        .stderr(Stdio::inherit())
        .output()
        .expect("spawn the child");
    let _ = std::fs::remove_dir_all(&store);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{mode} failed: {}: {stdout}",
        out.status
    );
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("child: "))
        .unwrap_or_else(|| panic!("{mode} printed no result: {stdout}"));
    let field = |k: &str| {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(k)?.strip_prefix('='))
            .unwrap_or("0")
            .to_string()
    };
    Report {
        secs: field("secs").parse().expect("secs"),
        peak_kib: field("peak_kib").parse().expect("peak_kib"),
        reads_peak_kib: field("reads_peak_kib").parse().expect("reads_peak_kib"),
        rest: line.to_string(),
    }
}

fn child(mode: &str) {
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k}"));
    let kubeconfig = PathBuf::from(var("KP_COLD_SYNC_KUBECONFIG"));
    let store = PathBuf::from(var("KP_COLD_SYNC_STORE"));
    let gzip = var("KP_COLD_SYNC_GZIP") == "1";
    let pods: usize = var("KP_COLD_SYNC_PODS").parse().expect("pods");
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .try_init();
    // The floors run on one thread: kube's client then reads without handing each chunk
    // from the connection's task on one worker to the reader on another (a futex wake per
    // chunk, most of a multi-threaded floor's CPU time).
    let rt = if mode.starts_with("floor") && std::env::var_os("KP_COLD_SYNC_FLOOR_MT").is_none() {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Runtime::new()
    }
    .expect("runtime");
    rt.block_on(async {
        let client = client_from(&kubeconfig, gzip).await;
        let start = Instant::now();
        let extra = match mode {
            "floor-paged" => floor_paged(client).await,
            "floor-stream" => floor_stream(client).await,
            "persist-paged" => persist(client, &store, false, pods).await,
            "persist-stream" => persist(client, &store, true, pods).await,
            "reflector" => reflect(client, pods).await,
            other => panic!("unknown child {other}"),
        };
        let (secs, peak) = extra
            .0
            .unwrap_or((start.elapsed().as_secs_f64(), peak_kib()));
        println!("child: secs={secs:.3} peak_kib={peak} {}", extra.1);
    });
}

/// What a child measured: its own (secs, peak) if not the whole run's, and more fields.
type Measured = (Option<(f64, u64)>, String);

/// This process's CPU time so far (user and system), in seconds.
fn cpu_s() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The fields after the command name (which may hold spaces); utime and stime are the
    // 14th and 15th of the line, in clock ticks (USER_HZ, 100 on Linux).
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    (ticks(11) + ticks(12)) as f64 / 100.0
}

/// This process's peak RSS (VmHWM) in KiB.
fn peak_kib() -> u64 {
    support::rss_kib().0
}

/// The list's `metadata.continue` from the head of a page (kube-apiserver writes the list's
/// metadata before its items): `Err` while the head is not complete yet.
fn continue_token(head: &[u8]) -> Result<Option<String>, ()> {
    #[derive(serde::Deserialize)]
    struct Meta {
        #[serde(rename = "continue")]
        token: Option<String>,
    }
    let key = b"\"metadata\":";
    let at = head.windows(key.len()).position(|w| w == key).ok_or(())? + key.len();
    match serde_json::Deserializer::from_slice(&head[at..])
        .into_iter::<Meta>()
        .next()
    {
        Some(Ok(meta)) => Ok(meta.token.filter(|t| !t.is_empty())),
        Some(Err(e)) if !e.is_eof() => panic!("list metadata: {e}"),
        _ => Err(()),
    }
}

/// The paged floor: each page's body is read chunk by chunk as the HTTP client hands it
/// over and dropped; only its head is kept until the continue token is read.
async fn floor_paged(client: kube::Client) -> Measured {
    let request = Request::new("/api/v1/pods");
    let (mut token, mut pages, mut bytes) = (None::<String>, 0u64, 0u64);
    let mut head = Vec::new();
    loop {
        let mut lp = ListParams::default().limit(PAGE);
        if let Some(t) = &token {
            lp = lp.continue_token(t);
        }
        let mut body = Box::pin(
            client
                .request_stream(request.list(&lp).expect("request"))
                .await
                .expect("list"),
        );
        head.clear();
        let mut next = Err(());
        loop {
            let chunk = body.fill_buf().await.expect("body");
            let n = chunk.len();
            if n == 0 {
                break;
            }
            if next.is_err() {
                head.extend_from_slice(&chunk[..n.min(4096)]);
                next = continue_token(&head);
            }
            bytes += n as u64;
            body.as_mut().consume(n);
        }
        pages += 1;
        token = next.expect("a page without list metadata");
        if token.is_none() {
            break;
        }
    }
    (
        None,
        format!("pages={pages} bytes={bytes} cpu_s={:.2}", cpu_s()),
    )
}

/// The streaming floor: the body is read chunk by chunk and dropped; only the first bytes
/// of each line are looked at (a bookmark line is kept whole, to find the end bookmark).
async fn floor_stream(client: kube::Client) -> Measured {
    const BOOKMARK: &[u8] = b"{\"type\":\"BOOKMARK\"";
    let request = Request::new("/api/v1/pods");
    let wp = WatchParams::streaming_lists();
    let mut body = Box::pin(
        client
            .request_stream(request.watch(&wp, "").expect("request"))
            .await
            .expect("watch"),
    );
    // The current line's first bytes (all of it, for a bookmark), while still wanted.
    let (mut line, mut keep) = (Vec::new(), true);
    let (mut events, mut bytes) = (0u64, 0u64);
    'read: loop {
        let chunk = body.fill_buf().await.expect("body");
        let n = chunk.len();
        assert!(n > 0, "the stream ended before its end bookmark");
        bytes += n as u64;
        let mut start = 0;
        let ends = memchr::memchr_iter(b'\n', chunk).chain(std::iter::once(n));
        for end in ends {
            if keep {
                line.extend_from_slice(&chunk[start..end]);
                keep = line.len() < BOOKMARK.len() || line.starts_with(BOOKMARK);
            }
            if end == n {
                break;
            }
            if line.starts_with(BOOKMARK) {
                if memchr::memmem::find(&line, b"initial-events-end").is_some() {
                    break 'read;
                }
            } else {
                events += 1;
            }
            (start, keep) = (end + 1, true);
            line.clear();
        }
        body.as_mut().consume(n);
    }
    (
        None,
        format!("events={events} bytes={bytes} cpu_s={:.2}", cpu_s()),
    )
}

async fn persist(client: kube::Client, store: &Path, streaming: bool, pods: usize) -> Measured {
    let start = Instant::now();
    // Knobs for experiments (unset in the recorded runs): the engine's cache and the hot
    // cache, in bytes.
    let knob = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
    let mut dbc = kube_persist::DbConfig::default();
    if let Some(c) = knob("KP_CACHE") {
        dbc = dbc.cache_capacity(c);
    }
    let db = Db::open_with(store, dbc).expect("store opens");
    let mut cfg = StreamConfig::default();
    if let Some(h) = knob("KP_HOT") {
        cfg = cfg.hot_cache(h as usize);
    }
    if streaming {
        cfg = cfg.streaming_lists();
    }
    let (reader, watcher) = db
        .store("pods", Api::<Pod>::all(client), cfg)
        .expect("stream opens");
    let task = tokio::spawn(watcher.run());
    reader.wait_until_ready().await.expect("ready");
    let secs = start.elapsed().as_secs_f64();
    let (ready_peak, ready_cpu) = (peak_kib(), cpu_s());
    assert_eq!(reader.len(), pods, "objects in the store");
    let s = reader.stats();
    let mut rest = format!(
        "cpu_s={ready_cpu:.2} list_pages={} batches={} objects_written={}",
        s.list_pages, s.batches, s.objects_written
    );
    // `KP_COLD_SYNC_NO_READS`: the sync alone (for a profile of it).
    if !streaming && std::env::var_os("KP_COLD_SYNC_NO_READS").is_none() {
        // Random keys (xorshift, fixed seed), then a hot set spread over the Pods.
        let key = |i: usize| (namespace(i), name(i));
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        let random: Vec<_> = (0..READS)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                key((seed % pods as u64) as usize)
            })
            .collect();
        let hot: Vec<_> = (0..HOT).map(|k| key(k * (pods / HOT))).collect();
        let r = support::reads::run(&reader, &random, &hot).await;
        assert_eq!(r.iterated, pods, "iterated");
        rest = format!(
            "{rest} reads_peak_kib={} iter_s={:.2} random_gets_s={:.2} hot_gets_s={:.2} peak_after_iter_kib={} peak_after_random_kib={} hot_cache_hits={}",
            r.peak_kib,
            r.iter_s,
            r.random_s,
            r.hot_s,
            r.peak_after_iter_kib,
            r.peak_after_random_kib,
            reader.stats().hot_cache_hits,
        );
    }
    task.abort();
    let _ = task.await;
    (Some((secs, ready_peak)), rest)
}

async fn reflect(client: kube::Client, pods: usize) -> Measured {
    let (store, writer) = reflector::store::<Pod>();
    let events = reflector(
        writer,
        watcher(Api::<Pod>::all(client), watcher::Config::default()),
    )
    .default_backoff();
    let mut events = std::pin::pin!(events);
    while let Some(ev) = events.next().await {
        if let Ok(watcher::Event::InitDone) = ev {
            break;
        }
    }
    assert_eq!(store.state().len(), pods, "objects in the reflector");
    (None, format!("cpu_s={:.2}", cpu_s()))
}
