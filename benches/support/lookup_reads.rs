//! The lookup bench's read-path figures: iteration (all, one namespace, full and partial
//! decode, on worker threads and on the calling thread), `by_index`, gets of the objects
//! last changed under churn, and the `--scan-only` / `--gets-only` modes for `perf`.

use super::*;

/// Iteration and recent-get figures of one store.
#[derive(Default)]
pub(super) struct ScanFigures {
    pub(super) iter_per_s: f64,
    pub(super) iter_as_per_s: f64,
    pub(super) recent50: f64,
}

/// What a partial scan decodes: each Pod's name and node.
#[derive(serde::Deserialize)]
pub(super) struct NameAndNode {
    metadata: NameOnly,
    spec: Option<NodeOnly>,
}

#[derive(serde::Deserialize)]
struct NameOnly {
    name: Option<String>,
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct NodeOnly {
    node_name: Option<String>,
}

/// Objects per second of `f`, which returns how many objects it read.
fn per_s(f: impl FnOnce() -> usize) -> (f64, usize) {
    let t = Instant::now();
    let n = f();
    (n as f64 / t.elapsed().as_secs_f64(), n)
}

/// Iteration (all, one namespace, full and partial decode) on the blocking pool, then gets
/// of the objects most recently changed while the server updates 1,000 Pods/s.
pub(super) async fn scan_figures(
    label: &str,
    reader: &kube_persist::Reader<Pod>,
    url: &str,
    recent: Arc<Mutex<VecDeque<(String, String)>>>,
) -> ScanFigures {
    let r = reader.clone();
    let name = label.to_string();
    let (iter_per_s, iter_as_per_s) = tokio::task::spawn_blocking(move || {
        let label = name;
        let count = |it: &mut dyn Iterator<Item = kube_persist::Result<()>>| {
            it.map(|o| o.expect("decodes")).count()
        };
        let (all, n) = per_s(|| count(&mut r.iter().map(|p| p.map(|p| drop(std::hint::black_box(p))))));
        let (partial, _) = per_s(|| {
            count(&mut r.iter_as::<NameAndNode>().map(|p| {
                p.map(|p| { std::hint::black_box((&p.metadata.name, p.spec.as_ref().map(|s| &s.node_name))); })
            }))
        });
        let ahead = r.clone().read_threads(0);
        let (one, _) = per_s(|| count(&mut ahead.iter().map(|p| p.map(drop))));
        let (one_as, _) = per_s(|| count(&mut ahead.iter_as::<NameAndNode>().map(|p| p.map(drop))));
        let (ns, ns_n) = per_s(|| count(&mut r.iter_namespace("ns-3").map(|p| p.map(drop))));
        let (ns_as, _) = per_s(|| {
            count(&mut r.iter_namespace_as::<NameAndNode>("ns-3").map(|p| p.map(drop)))
        });
        eprintln!(
            "{label} iteration (objects/s): iter {all:.0} ({n} objects), iter_as::<name and node> {partial:.0}; \
             iter_namespace {ns:.0} ({ns_n} objects), iter_namespace_as {ns_as:.0}; {} cores; \
             decoded ahead on the CPU threads (read_threads(0)): iter {one:.0}, iter_as {one_as:.0}",
            std::thread::available_parallelism().map_or(1, |n| n.get())
        );
        (all, partial)
    })
    .await
    .expect("iteration");

    let churn = spawn_churn(url, 5000);
    while recent.lock().unwrap().len() < RECENT {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let r = reader.clone();
    let before = reader.stats();
    let (times, events) = tokio::task::spawn_blocking(move || {
        let mut times = Vec::new();
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(3) {
            let keys: Vec<(String, String)> = recent.lock().unwrap().iter().cloned().collect();
            for (ns, name) in &keys {
                let t = Instant::now();
                let got = r.get_named(Some(ns), name).expect("get");
                times.push(t.elapsed());
                assert!(got.is_some(), "{ns}/{name} missing");
            }
        }
        (times, r.stats().watch_events - before.watch_events)
    })
    .await
    .expect("recent gets");
    churn.abort();
    let after = reader.stats();
    let gets = times.len();
    let (recent50, recent99) = percentiles(times);
    let hits = after.hot_cache_hits - before.hot_cache_hits;
    eprintln!(
        "{label} recent gets (the {RECENT} objects last changed, while the server updates ~1,000 Pods/s; \
         {events} events applied in 3 s): p50 {recent50:.2} us p99 {recent99:.2} us over {gets} gets, \
         {hits} hot cache hits, {} misses",
        after.hot_cache_misses - before.hot_cache_misses
    );
    ScanFigures {
        iter_per_s,
        iter_as_per_s,
        recent50,
    }
}

/// `by_index` throughput: a second stream of the same Pods with a `node` index (100
/// nodes), read 10 nodes' worth (about a tenth of the Pods).
pub(super) async fn index_figures(label: &str, db: &kube_persist::Db, client: &kube::Client) {
    let config = kube_persist::StreamConfig::default().index("node", |p: &Pod| {
        p.spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .into_iter()
            .collect()
    });
    let (reader, watcher) = db
        .store("pods-by-node", Api::<Pod>::all(client.clone()), config)
        .expect("indexed stream");
    let task = tokio::spawn(watcher.run());
    reader
        .wait_until_ready()
        .await
        .expect("indexed stream ready");
    let label = label.to_string();
    tokio::task::spawn_blocking(move || {
        let (rate, n) = per_s(|| {
            (0..10)
                .map(|i| {
                    let objects = reader
                        .by_index("node", &format!("node-{i}"))
                        .expect("index");
                    objects.map(|p| drop(p.expect("decodes"))).count()
                })
                .sum()
        });
        eprintln!("{label} by_index (node, 10 values): {rate:.0} objects/s ({n} objects)");
    })
    .await
    .expect("by_index");
    task.abort();
}

/// `--scan-only`: `iter()` over the whole store for 10 s (`--read-threads N` as
/// `Reader::read_threads`); `--gets-only`: uniform random gets for 10 s (with the hot cache
/// off). For `perf record`.
pub(super) async fn profile_reads(
    engine: kube_persist::Engine,
    client: &kube::Client,
    work: &Workload<'_>,
    scan: bool,
) {
    let dir = tempfile::tempdir().expect("tempdir");
    let db_config = kube_persist::DbConfig::default().engine(engine);
    let db = kube_persist::Db::open_with(dir.path().join("store"), db_config).expect("open");
    let config = kube_persist::StreamConfig::default().hot_cache(0);
    let (reader, watcher) = db
        .store("pods", Api::<Pod>::all(client.clone()), config)
        .expect("stream");
    let task = tokio::spawn(watcher.run());
    reader.wait_until_live().await.expect("ready");
    let threads = std::env::args()
        .skip_while(|a| a != "--read-threads")
        .nth(1)
        .map_or(1, |n| n.parse().expect("--read-threads N"));
    let reader = reader.read_threads(threads);
    let keys = work.keys.to_vec();
    let seq = work.uniform_seq.to_vec();
    tokio::task::spawn_blocking(move || {
        let (t, cpu) = (Instant::now(), cpu_seconds());
        let mut n = 0usize;
        while t.elapsed() < Duration::from_secs(10) {
            if scan {
                n += reader.iter().map(|p| drop(p.expect("decodes"))).count();
            } else {
                for &i in &seq[..10_000] {
                    let (ns, name) = &keys[i];
                    assert!(reader.get_named(Some(ns), name).expect("get").is_some());
                }
                n += 10_000;
            }
        }
        let what = if scan { "objects iterated" } else { "gets" };
        let (wall, cpu) = (t.elapsed().as_secs_f64(), cpu_seconds() - cpu);
        eprintln!(
            "{n} {what} in {wall:.1} s: {:.0}/s; process CPU {:.1} us per object ({:.2} cores busy)",
            n as f64 / wall,
            cpu * 1e6 / n as f64,
            cpu / wall
        );
    })
    .await
    .expect("reads");
    task.abort();
}

/// CPU time (user + system) of this process so far, in seconds.
fn cpu_seconds() -> f64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct it is given; RUSAGE_SELF is always valid.
    let usage = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr());
        usage.assume_init()
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

/// Updates 1,000 random Pods per second on the server (100 every 100 ms), with seeds from
/// `seed`, until aborted.
pub(super) fn spawn_churn(url: &str, seed: u64) -> tokio::task::JoinHandle<()> {
    let url = url.to_string();
    tokio::spawn(async move {
        for round in 0u64.. {
            let path = format!(
                "/testkit/churn?updates=100&creates=0&deletes=0&seed={}",
                seed + round
            );
            support::admin(&url, "POST", &path).await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}
