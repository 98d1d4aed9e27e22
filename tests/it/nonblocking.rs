//! The controller never lets one reconcile stall the others or the watch (issue 34 item 3).
//!
//! A reconcile that scans 20,000 stored objects with the blocking `Reader::iter` holds, in
//! the middle of its scan, until the test has seen another object's change reconciled and
//! the store's checkpoint move: each reconcile is a task of its own, so the controller
//! keeps driving the scheduler and the watch while one reconcile blocks its worker. The
//! async reads (`iter_stream`, `get_async`) give the same objects as the blocking ones.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::{Fixture, eventually, relabel_pod};
use futures::{FutureExt, StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube_persist::controller::{Config, Controller};
use kube_persist::{Db, Reader, resource_version};
use tokio::sync::Notify;

const OBJECTS: usize = 20_000;
/// How long the test waits for what must happen while the scan is held.
const PROMPT: Duration = Duration::from_secs(20);

#[derive(Debug, thiserror::Error)]
#[error("never fails")]
struct Never;

struct Ctx {
    reader: Reader<Pod>,
    /// Set by the test once the first reconciles are done: the next reconcile of the
    /// scanner scans.
    armed: AtomicBool,
    /// The scan reached its middle and holds.
    mid_scan: Notify,
    /// The test lets the scan go on.
    release: Mutex<Option<std::sync::mpsc::Receiver<()>>>,
    scanned: AtomicUsize,
    scan_done: Notify,
    /// Objects whose reconcile started since the test cleared it.
    started: Mutex<HashSet<String>>,
    reconciled: AtomicUsize,
}

async fn reconcile(pod: Arc<Pod>, ctx: Arc<Ctx>) -> Result<Action, Never> {
    let name = pod.metadata.name.clone().unwrap_or_default();
    ctx.started.lock().unwrap().insert(name.clone());
    if name == "pod-0" && ctx.armed.swap(false, Ordering::SeqCst) {
        // A blocking scan on this task's worker, held in its middle.
        let release = ctx.release.lock().unwrap().take().expect("one scan");
        let mut n = 0;
        for obj in ctx.reader.iter() {
            obj.expect("stored pod decodes");
            n += 1;
            if n == OBJECTS / 2 {
                ctx.mid_scan.notify_one();
                // Bounded, so that a failing run ends instead of hanging.
                let _ = release.recv_timeout(PROMPT * 2);
            }
        }
        ctx.scanned.store(n, Ordering::SeqCst);
        ctx.scan_done.notify_one();
    }
    ctx.reconciled.fetch_add(1, Ordering::SeqCst);
    Ok(Action::await_change())
}

fn error_policy(_: Arc<Pod>, _: &Never, _: Arc<Ctx>) -> Action {
    Action::await_change()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocking_scan_in_a_reconcile_stalls_neither_other_reconciles_nor_the_watch() {
    let fx = Fixture::with_pods(OBJECTS, 20).await;
    let h = &fx.h;
    let db = Db::open(fx.path()).unwrap();
    let (reader, watcher) = db
        .store("pods", fx.pods(), kube_persist::StreamConfig::default())
        .unwrap();
    let (release_tx, release_rx) = std::sync::mpsc::channel();
    let ctx = Arc::new(Ctx {
        reader: reader.clone(),
        armed: AtomicBool::new(false),
        mid_scan: Notify::new(),
        release: Mutex::new(Some(release_rx)),
        scanned: AtomicUsize::new(0),
        scan_done: Notify::new(),
        started: Mutex::default(),
        reconciled: AtomicUsize::new(0),
    });
    let run = Controller::for_store((reader.clone(), watcher))
        .with_config(Config::default())
        .run(reconcile, error_policy, ctx.clone())
        .for_each(|_| async {});
    let task = tokio::spawn(run);
    eventually("every object reconciled once", || {
        ctx.reconciled.load(Ordering::SeqCst) >= OBJECTS
    })
    .await;

    // The scanner's change: its reconcile scans the store and holds in the middle.
    ctx.armed.store(true, Ordering::SeqCst);
    let mid = ctx.mid_scan.notified();
    relabel_pod(h, "ns-0", "pod-0", "scan");
    tokio::time::timeout(PROMPT, mid)
        .await
        .expect("the scanning reconcile reaches its middle");
    ctx.started.lock().unwrap().clear();
    let before = reader.checkpoint().expect("synced");

    // Another object changes while the scan holds its worker.
    relabel_pod(h, "ns-1", "pod-1", "during-scan");
    eventually("pod-1's reconcile starts while the scan holds", || {
        ctx.started.lock().unwrap().contains("pod-1")
    })
    .await;
    eventually("the watch applies events while the scan holds", || {
        reader.checkpoint().is_some_and(|now| {
            matches!(
                resource_version::compare(&now, &before),
                Ok(std::cmp::Ordering::Greater)
            )
        })
    })
    .await;
    assert_eq!(
        ctx.scanned.load(Ordering::SeqCst),
        0,
        "the scan still holds"
    );

    let done = ctx.scan_done.notified();
    release_tx.send(()).unwrap();
    tokio::time::timeout(PROMPT, done)
        .await
        .expect("the scan completes");
    assert_eq!(ctx.scanned.load(Ordering::SeqCst), OBJECTS);
    task.abort();
}

#[tokio::test(flavor = "current_thread")]
async fn the_async_reads_give_what_the_blocking_ones_give() {
    let fx = Fixture::with_pods(600, 3).await;
    let db = Db::open(fx.path()).unwrap();
    let (reader, watcher) = db
        .store("pods", fx.pods(), kube_persist::StreamConfig::default())
        .unwrap();
    tokio::spawn(watcher.run());
    reader.wait_until_ready().await.unwrap();
    let names = |pods: Vec<Arc<Pod>>| -> Vec<String> {
        pods.iter()
            .map(|p| p.metadata.name.clone().unwrap_or_default())
            .collect()
    };
    let blocking: Vec<_> = reader.iter().collect::<Result<_, _>>().unwrap();
    let streamed: Vec<_> = reader.iter_stream().try_collect().await.unwrap();
    assert_eq!(streamed.len(), 600);
    assert_eq!(names(streamed), names(blocking));
    let ns: Vec<_> = reader
        .iter_namespace_stream("ns-1")
        .try_collect()
        .await
        .unwrap();
    assert_eq!(ns.len(), 200);
    let got = reader
        .get_async(&ObjectRef::new("pod-7").within("ns-1"))
        .await
        .unwrap()
        .expect("stored");
    assert_eq!(got.metadata.name.as_deref(), Some("pod-7"));
    // A stream dropped after its first object stops its scan (no error, no hang).
    let first = reader.iter_stream().next().await.unwrap().unwrap();
    assert!(first.metadata.name.is_some());
    // An unknown index is the stream's one item, an error.
    let mut unknown = reader.by_index_stream("nope", "x");
    assert!(unknown.next().await.unwrap().is_err());
    assert!(unknown.next().await.is_none());
}

/// Issue 39 item 7: an async scan kept but not polled holds no blocking-pool thread. With a
/// pool of 2 threads, 4 scans are each taken to their first object and kept; every one of
/// them starts, a point read still completes at once, and a kept scan still yields every
/// object when it is polled again. (When a scan was one blocking task for its whole life,
/// waiting for its consumer with its thread, the first two scans pinned both threads: the
/// third scan never started and the point read never ran.)
#[test]
fn kept_but_unpolled_scans_leave_the_blocking_pool_free() {
    const POOL: usize = 2;
    const SCANS: usize = 4;
    // Several chunks of 256 per scan, so that a scan has more to read than it hands over.
    const PODS: usize = 3_000;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(POOL)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let fx = Fixture::with_pods(PODS, 3).await;
        let db = Db::open(fx.path()).unwrap();
        let (reader, watcher) = db
            .store("pods", fx.pods(), kube_persist::StreamConfig::default())
            .unwrap();
        let task = tokio::spawn(watcher.run());
        reader.wait_until_ready().await.unwrap();
        let mut kept = Vec::new();
        for i in 0..SCANS {
            let mut scan = reader.iter_stream();
            let first = tokio::time::timeout(PROMPT, scan.next())
                .await
                .unwrap_or_else(|_| {
                    panic!("scan {i} never started: the blocking pool is held by the kept scans")
                })
                .expect("an object")
                .expect("decodes");
            assert!(first.metadata.name.is_some());
            kept.push(scan);
        }
        let got = tokio::time::timeout(
            PROMPT,
            reader.get_async(&ObjectRef::new("pod-7").within("ns-1")),
        )
        .await
        .expect("a point read completes while the scans are kept")
        .unwrap()
        .expect("stored");
        assert_eq!(got.metadata.name.as_deref(), Some("pod-7"));
        // The kept scans go on where they stopped.
        for scan in kept.iter_mut() {
            let rest: Vec<_> = tokio::time::timeout(PROMPT, scan.by_ref().try_collect::<Vec<_>>())
                .await
                .expect("a kept scan completes")
                .unwrap();
            assert_eq!(rest.len(), PODS - 1);
        }
        task.abort();
    });
}

/// Issue 57 item 4: `get_async` and `get_named_async` answer a hot-cache hit on the calling
/// task, at their first poll, while the blocking pool's one thread is held: no hop to the
/// pool, no disk read, counted in `Stats::hot_cache_hits`. A miss reads on kube-persist's
/// CPU threads (issue 59), answered while the pool is held. (When every `get_async` was one
/// blocking task, the hot hit stayed pending behind the held thread.)
#[test]
fn hot_hits_of_the_async_point_reads_need_no_blocking_thread() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .max_blocking_threads(1)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let fx = Fixture::with_pods(600, 3).await;
        let db = Db::open(fx.path()).unwrap();
        let (reader, watcher) = db
            .store("pods", fx.pods(), kube_persist::StreamConfig::default())
            .unwrap();
        let task = tokio::spawn(watcher.run());
        reader.wait_until_ready().await.unwrap();
        let hot = ObjectRef::new("pod-7").within("ns-1");
        let hits = || reader.stats().hot_cache_hits;
        // A key is cached once it missed twice (the cache's doorkeeper): read it until a
        // read is a hit.
        let warm = (0..4).any(|_| {
            let before = hits();
            reader.get(&hot).unwrap().expect("stored");
            hits() > before
        });
        assert!(warm, "pod-7 never became a hot-cache hit");

        // Hold the blocking pool's only thread.
        let (release, held) = std::sync::mpsc::channel::<()>();
        let (started, holding) = tokio::sync::oneshot::channel();
        let holder = tokio::task::spawn_blocking(move || {
            started.send(()).unwrap();
            held.recv().unwrap();
        });
        holding.await.unwrap();

        let before = hits();
        let got = reader
            .get_async(&hot)
            .now_or_never()
            .expect("get_async of a hot key is answered at its first poll, pool held")
            .unwrap()
            .expect("stored");
        assert_eq!(got.metadata.name.as_deref(), Some("pod-7"));
        let got = reader
            .get_named_async(Some("ns-1"), "pod-7")
            .now_or_never()
            .expect("get_named_async of a hot key is answered at its first poll, pool held")
            .unwrap()
            .expect("stored");
        assert_eq!(got.metadata.name.as_deref(), Some("pod-7"));
        assert_eq!(hits(), before + 2, "both answered from the hot cache");

        // A miss reads on kube-persist's CPU threads, not on the pool (issue 59: their
        // allocator arenas hold the list's freed memory): answered while the pool's one
        // thread is still held. (On the pool it stayed pending until the thread was free.)
        let absent = ObjectRef::new("absent").within("ns-1");
        let miss = tokio::time::timeout(Duration::from_secs(30), reader.get_async(&absent))
            .await
            .expect("a miss is answered while the blocking pool is held");
        assert!(miss.unwrap().is_none());
        let miss = tokio::time::timeout(
            Duration::from_secs(30),
            reader.get_named_async(Some("ns-1"), "pod-10"),
        )
        .await
        .expect("a miss is answered while the blocking pool is held");
        assert_eq!(
            miss.unwrap().expect("stored").metadata.name.as_deref(),
            Some("pod-10")
        );
        release.send(()).unwrap();
        holder.await.unwrap();
        task.abort();
    });
}
