//! Fidelity: the core scenarios against the testkit server in each of its strict modes
//! (opaque resourceVersions, short and empty pages, gzip, no streaming lists), each ending
//! with an object-by-object comparison of the store with the server.
//!
//! Prints `scenario <name> <mode> ok` per scenario and mode, then exactly
//! `fidelity: <N> scenarios, <D> divergences`; exits non-zero unless D is 0 and every
//! scenario passed. Run alone with `cargo test --release --test fidelity`.

mod common;

use std::time::Duration;

use common::*;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube_persist::{Db, Reader, StreamConfig, SyncPhase};
use kube_persist_testkit::{
    ResourceType, ServerHandle, ServerOptions, StreamingLists, TestServer, Verb, make_pod,
};

const PODS: usize = 300;
const PAGE: u32 = 40;

/// A strict server mode.
#[derive(Clone, Copy)]
struct Mode {
    name: &'static str,
    opts: fn() -> ServerOptions,
}

fn strict() -> ServerOptions {
    ServerOptions {
        // kube-apiserver sends a bookmark about once a minute: nothing may rely on more.
        bookmark_interval: Duration::from_secs(60),
        too_large_wait: Duration::from_millis(200),
        ..Default::default()
    }
}

const MODES: [Mode; 4] = [
    Mode {
        name: "opaque-rv",
        opts: || ServerOptions {
            opaque_resource_versions: true,
            ..strict()
        },
    },
    Mode {
        name: "short-pages",
        opts: || ServerOptions {
            short_pages: true,
            ..strict()
        },
    },
    Mode {
        name: "gzip",
        opts: || ServerOptions {
            gzip: true,
            ..strict()
        },
    },
    Mode {
        name: "no-streaming",
        opts: || ServerOptions {
            streaming_lists: StreamingLists::Rejected,
            opaque_resource_versions: true,
            ..strict()
        },
    },
];

fn cfg(streaming: bool) -> StreamConfig {
    let c = StreamConfig::default()
        .page_size(PAGE)
        .backoff(Duration::from_millis(20), Duration::from_millis(200))
        .relist_jitter(Duration::from_millis(5));
    if streaming { c.streaming_lists() } else { c }
}

/// A server of `mode` with `PODS` Pods.
async fn server(mode: Mode) -> TestServer {
    let server = TestServer::start_with((mode.opts)()).await;
    server.handle().seed_pods(PODS, 5);
    server
}

fn open(
    server: &TestServer,
    dir: &std::path::Path,
    config: StreamConfig,
) -> (Db, Reader<Pod>, Driven) {
    let db = Db::open(dir).expect("open store");
    let (reader, watcher) = db
        .store("pods", Api::<Pod>::all(server.client()), config)
        .expect("open stream");
    (db, reader, drive(watcher))
}

/// Keys whose stored resourceVersion differs from the server's (missing, extra, stale),
/// ignoring `except`.
fn divergences(reader: &Reader<Pod>, h: &ServerHandle, except: &[String]) -> usize {
    let rt = ResourceType::pods();
    let mut server = server_versions(h, &rt);
    let mut store = store_versions(reader);
    for k in except {
        server.remove(k);
        store.remove(k);
    }
    let keys: std::collections::BTreeSet<&String> = server.keys().chain(store.keys()).collect();
    let n = keys
        .iter()
        .filter(|k| server.get(**k) != store.get(**k))
        .count();
    if n > 0 {
        eprintln!("  divergence: {}", diff("store", &store, &server));
    }
    n
}

/// Wait until the store is synced and equals the server (or time runs out), then count
/// the divergences.
async fn settle(reader: &Reader<Pod>, h: &ServerHandle, except: &[String]) -> usize {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !(reader.phase() == SyncPhase::Synced && divergences_quiet(reader, h, except) == 0)
        && tokio::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    divergences(reader, h, except)
}

fn divergences_quiet(reader: &Reader<Pod>, h: &ServerHandle, except: &[String]) -> usize {
    let rt = ResourceType::pods();
    let mut server = server_versions(h, &rt);
    let mut store = store_versions(reader);
    for k in except {
        server.remove(k);
        store.remove(k);
    }
    usize::from(server != store)
}

/// A first sync of a new store, then the process "stops".
async fn sync_and_stop(server: &TestServer, dir: &std::path::Path) {
    let (_db, _reader, mut w) = open(server, dir, cfg(false));
    w.until(|e| *e == Ev::InitDone).await;
    w.stop().await;
}

/// Wait for the `Delete` of the last of `deleted`; returns the events seen.
async fn until_deleted(w: &mut Driven, deleted: &[String]) -> Vec<Ev> {
    let last = deleted.last().expect("something was deleted").clone();
    w.until(|e| matches!(e, Ev::Delete(k) if *k == last)).await
}

/// Wait for the deletion of the last of `deleted`, let the store settle, stop the watcher,
/// and count the divergences.
async fn converge_after(
    mut w: Driven,
    reader: &Reader<Pod>,
    h: &ServerHandle,
    deleted: &[String],
) -> usize {
    until_deleted(&mut w, deleted).await;
    let d = settle(reader, h, &[]).await;
    w.stop().await;
    d
}

/// Change the server: delete `n`, update `n`, create `n` Pods; returns the deleted keys.
fn churn(h: &ServerHandle, n: usize, tag: &str) -> Vec<String> {
    let rt = ResourceType::pods();
    let all = h.list(&rt);
    let mut deleted = Vec::new();
    for o in all.iter().take(n) {
        let ns = o["metadata"]["namespace"].as_str().unwrap();
        let name = o["metadata"]["name"].as_str().unwrap();
        h.delete(&rt, Some(ns), name).unwrap();
        deleted.push(format!("{ns}/{name}"));
    }
    for o in all.iter().skip(n).take(n) {
        let mut o = o.clone();
        o["metadata"]["labels"]["changed"] = tag.into();
        h.apply(&rt, o);
    }
    for i in 0..n {
        h.apply(
            &rt,
            make_pod("ns-0", &format!("{tag}-{i}"), 50_000 + i as u64),
        );
    }
    deleted
}

async fn cold_sync(mode: Mode, streaming: bool) -> usize {
    let server = server(mode).await;
    let h = server.handle();
    let dir = tempfile::tempdir().unwrap();
    let (_db, reader, mut w) = open(&server, dir.path(), cfg(streaming));
    w.until(|e| *e == Ev::InitDone).await;
    assert_eq!(reader.checkpoint(), Some(h.resource_version()));
    let d = settle(&reader, &h, &[]).await;
    w.stop().await;
    d
}

async fn warm_restart(mode: Mode) -> usize {
    let server = server(mode).await;
    let h = server.handle();
    let dir = tempfile::tempdir().unwrap();
    sync_and_stop(&server, dir.path()).await;
    let deleted = churn(&h, 10, "down");
    h.reset_counts();
    let (_db, reader, mut w) = open(&server, dir.path(), cfg(false));
    let evs = until_deleted(&mut w, &deleted).await;
    assert!(matches!(evs[0], Ev::Resumed(_)), "{}", summary(&evs));
    let d = settle(&reader, &h, &[]).await;
    assert_eq!(h.counts().list, 0, "a warm restart makes no LIST call");
    w.stop().await;
    d
}

/// The checkpoint is compacted while the process is down: 410 on resume, as an ERROR
/// event (`http: false`, what kube-apiserver's watch cache sends) or an HTTP status.
async fn gone_on_resume(mode: Mode, http: bool) -> usize {
    let server = server(mode).await;
    let h = server.handle();
    let dir = tempfile::tempdir().unwrap();
    sync_and_stop(&server, dir.path()).await;
    let deleted = churn(&h, 10, "gone");
    h.compact();
    if http {
        h.faults().fail_next(Verb::Watch, 410, 1);
    }
    let (_db, reader, mut w) = open(&server, dir.path(), cfg(false));
    let evs = until_deleted(&mut w, &deleted).await;
    let deletes = evs.iter().filter(|e| matches!(e, Ev::Delete(_))).count();
    assert_eq!(deletes, deleted.len(), "exact deletions: {}", summary(&evs));
    assert_eq!(reader.stats().relists, 1);
    let d = settle(&reader, &h, &[]).await;
    w.stop().await;
    d
}

/// 410 while watching: history compacted under a live watch, which reconnects.
async fn gone_live(mode: Mode, streaming: bool) -> usize {
    let server = server(mode).await;
    let h = server.handle();
    let dir = tempfile::tempdir().unwrap();
    let (_db, reader, mut w) = open(&server, dir.path(), cfg(streaming));
    w.until(|e| *e == Ev::InitDone).await;
    reader.wait_until_live().await.unwrap();
    h.faults().gone_next_watch();
    h.faults().close_watches();
    let deleted = churn(&h, 10, "live");
    converge_after(w, &reader, &h, &deleted).await
}

/// The list's continue token expires between two pages: the list starts over.
async fn expired_continue(mode: Mode) -> usize {
    let server = server(mode).await;
    let h = server.handle();
    h.faults().page_delay(Duration::from_millis(20));
    let dir = tempfile::tempdir().unwrap();
    let (_db, reader, mut w) = open(&server, dir.path(), cfg(false));
    // Once two pages are in, change the server and compact: the third page's token expires.
    let deadline = tokio::time::Instant::now() + WAIT;
    while reader.stats().list_pages < 2 {
        assert!(tokio::time::Instant::now() < deadline, "no list pages");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    churn(&h, 5, "expired");
    h.compact();
    h.faults().page_delay(Duration::ZERO);
    w.until(|e| *e == Ev::InitDone).await;
    let d = settle(&reader, &h, &[]).await;
    w.stop().await;
    d
}

/// A streaming list fails after some initial events; objects are deleted and updated before
/// the retry. The retry must be a new list whose end sweeps what it did not see.
async fn streaming_retry(mode: Mode) -> usize {
    let server = server(mode).await;
    let h = server.handle();
    let dir = tempfile::tempdir().unwrap();
    h.faults().error_watch_after(PODS / 2);
    let config = cfg(true).backoff(Duration::from_millis(800), Duration::from_secs(2));
    let (_db, reader, mut w) = open(&server, dir.path(), config);
    // The first attempt ends in an ERROR event; the retry waits a backoff of >= 800 ms.
    let evs = w.until(|e| matches!(e, Ev::Error(_))).await;
    let received: Vec<String> = evs
        .iter()
        .filter_map(|e| match e {
            Ev::InitApply(k) => Some(k.clone()),
            _ => None,
        })
        .collect();
    // Delete and update objects the first attempt delivered.
    let rt = ResourceType::pods();
    for k in received.iter().take(10) {
        let (ns, name) = k.split_once('/').unwrap();
        h.delete(&rt, Some(ns), name).unwrap();
    }
    for k in received.iter().skip(10).take(10) {
        let (ns, name) = k.split_once('/').unwrap();
        let mut o = h.get(&rt, Some(ns), name).unwrap();
        o["metadata"]["labels"]["changed"] = "between".into();
        h.apply(&rt, o);
    }
    w.until(|e| *e == Ev::InitDone).await;
    let d = settle(&reader, &h, &[]).await;
    for k in received.iter().take(10) {
        let (ns, name) = k.split_once('/').unwrap();
        assert!(
            reader.get_named(Some(ns), name).unwrap().is_none(),
            "{k} was deleted between the attempts but is still stored"
        );
    }
    w.stop().await;
    d
}

/// An update the store cannot decode: the old version must not stay as current.
async fn rejected_update(mode: Mode) -> usize {
    let server = server(mode).await;
    let h = server.handle();
    let rt = ResourceType::pods();
    let dir = tempfile::tempdir().unwrap();
    let (_db, reader, mut w) = open(&server, dir.path(), cfg(false));
    w.until(|e| *e == Ev::InitDone).await;
    let victim = h.list(&rt)[7].clone();
    let (ns, name) = (
        victim["metadata"]["namespace"]
            .as_str()
            .unwrap()
            .to_string(),
        victim["metadata"]["name"].as_str().unwrap().to_string(),
    );
    let key = format!("{ns}/{name}");
    assert!(reader.get_named(Some(&ns), &name).unwrap().is_some());
    let mut bad = victim.clone();
    bad["spec"]["containers"] = "not a list".into();
    h.apply(&rt, bad);
    // A later valid change in the same watch: the checkpoint moves past the rejected one.
    let mut other = h.list(&rt)[20].clone();
    other["metadata"]["labels"]["after"] = "rejected".into();
    h.apply(&rt, other);
    let evs = w
        .until(|e| matches!(e, Ev::Error(m) if m.contains(&key)))
        .await;
    assert!(
        evs.iter().all(|e| !matches!(e, Ev::Delete(k) if *k == key)),
        "a rejected object is not a deletion: {}",
        summary(&evs)
    );
    assert!(reader.stats().bad_objects >= 1);
    let d = settle(&reader, &h, std::slice::from_ref(&key)).await;
    assert!(
        reader.get_named(Some(&ns), &name).unwrap().is_none(),
        "the stale version of {key} is still served"
    );
    // Fixed on the server: stored again.
    h.apply(&rt, victim);
    w.until(|e| matches!(e, Ev::Apply(k) if *k == key)).await;
    let d2 = settle(&reader, &h, &[]).await;
    w.stop().await;
    d + d2
}

/// Servers without streaming lists: rejected with an ERROR event, forbidden with 422, or
/// ignored (no end bookmark): each falls back to paginated lists and stays live.
async fn no_streaming(mode: Mode, how: StreamingLists) -> usize {
    let server = TestServer::start_with(ServerOptions {
        streaming_lists: how,
        ..(mode.opts)()
    })
    .await;
    let h = server.handle();
    h.seed_pods(PODS, 5);
    let dir = tempfile::tempdir().unwrap();
    let config = cfg(true).initial_events_timeout(Duration::from_millis(300));
    let (_db, reader, mut w) = open(&server, dir.path(), config);
    w.until(|e| *e == Ev::InitDone).await;
    assert!(h.counts().list > 0, "fell back to paginated LIST");
    let deleted = churn(&h, 5, "after-fallback");
    converge_after(w, &reader, &h, &deleted).await
}

/// A lagging replica: ERROR 504 ResourceVersionTooLarge on the watch; retried, then relisted.
async fn too_large(mode: Mode) -> usize {
    let server = server(mode).await;
    let h = server.handle();
    let dir = tempfile::tempdir().unwrap();
    let (_db, reader, mut w) = open(&server, dir.path(), cfg(false).too_large_retries(1));
    w.until(|e| *e == Ev::InitDone).await;
    reader.wait_until_live().await.unwrap();
    h.faults().too_large_next_watch();
    h.faults().close_watches();
    w.until(|e| matches!(e, Ev::Error(m) if m.contains("504")))
        .await;
    let deleted = churn(&h, 3, "too-large");
    converge_after(w, &reader, &h, &deleted).await
}

/// A scenario's run, yielding its divergence count.
type Scenario = std::pin::Pin<Box<dyn std::future::Future<Output = usize>>>;

fn main() {
    init_tracing();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (mut scenarios_run, mut divergences_seen, mut failed) = (0usize, 0usize, 0usize);
    let only = std::env::var("FIDELITY_ONLY").ok();
    for mode in MODES {
        let scenarios: Vec<(&str, Scenario)> = vec![
            ("cold-sync", Box::pin(cold_sync(mode, false))),
            ("cold-sync-streaming", Box::pin(cold_sync(mode, true))),
            ("warm-restart", Box::pin(warm_restart(mode))),
            ("gone-on-resume", Box::pin(gone_on_resume(mode, false))),
            ("gone-on-resume-http", Box::pin(gone_on_resume(mode, true))),
            ("gone-live", Box::pin(gone_live(mode, false))),
            ("gone-live-streaming", Box::pin(gone_live(mode, true))),
            ("expired-continue", Box::pin(expired_continue(mode))),
            ("streaming-retry", Box::pin(streaming_retry(mode))),
            ("rejected-update", Box::pin(rejected_update(mode))),
            ("too-large", Box::pin(too_large(mode))),
            (
                "no-streaming-rejected",
                Box::pin(no_streaming(mode, StreamingLists::Rejected)),
            ),
            (
                "no-streaming-forbidden",
                Box::pin(no_streaming(mode, StreamingLists::Forbidden)),
            ),
            (
                "no-streaming-ignored",
                Box::pin(no_streaming(mode, StreamingLists::Ignored)),
            ),
        ];
        for (name, fut) in scenarios {
            if only.as_deref().is_some_and(|o| !name.contains(o)) {
                continue;
            }
            // A server without streaming lists never starts the initial events to interrupt.
            if name == "streaming-retry" && mode.name == "no-streaming" {
                continue;
            }
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rt.block_on(fut)));
            scenarios_run += 1;
            match run {
                Ok(0) => println!("scenario {name} {} ok", mode.name),
                Ok(d) => {
                    divergences_seen += d;
                    println!("scenario {name} {} FAILED: {d} divergences", mode.name);
                }
                Err(_) => {
                    failed += 1;
                    println!("scenario {name} {} FAILED: panicked (see above)", mode.name);
                }
            }
        }
    }
    println!("fidelity: {scenarios_run} scenarios, {divergences_seen} divergences");
    if divergences_seen > 0 || failed > 0 {
        std::process::exit(1);
    }
}
