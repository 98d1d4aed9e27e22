//! `Reader::get` latency next to kube-runtime's `Store::get`, and watch-event apply
//! throughput, against a `testkit-server` process.
//!
//! ```text
//! cargo bench --bench lookup [-- --pods 100000] [--engine sled|redb]
//! cargo bench --bench lookup -- --apply-only [--durability every-batch|periodic]
//! cargo bench --bench lookup_mimalloc [-- ...]   # the same, mimalloc as the allocator
//! ```
//! Last line: `RESULT n=<N> persist_get_p50_us=<x> persist_get_p99_us=<y> reflector_get_p50_us=<z> persist_apply_events_per_s=<e> persist_get_raw_p50_us=<r> hot_cache_hit_rate=<h> engine=<E> persist_iter_objects_per_s=<i> persist_iter_as_objects_per_s=<a> reflector_iter_objects_per_s=<ri> persist_recent_get_p50_us=<g> allocator=<glibc|mimalloc> persist_get_async_hot_p50_us=<ah> persist_get_async_p50_us=<au>`
//!
//! `persist_iter_as` decodes into a small type (name and node of each Pod);
//! `persist_recent_get` reads the 1,000 objects most recently changed by watch events while
//! the server updates 1,000 Pods per second (the write-through hot cache's case);
//! `persist_get_async_hot` / `persist_get_async` are `Reader::get_async` on the hot keys
//! (cache hits, answered on the calling task) and on the uniform keys (mostly misses, read
//! on tokio's blocking pool), awaited one at a time on a worker of the multi-thread runtime.

mod support;

#[path = "support/lookup_reads.rs"]
mod reads;
use reads::{NameAndNode, index_figures, profile_reads, scan_figures, spawn_churn};

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{WatchStreamExt, watcher};
use rand::{Rng, SeedableRng, rngs::StdRng};

const GETS: usize = 100_000;
/// How many of the most recently changed objects `persist_recent_get` reads.
const RECENT: usize = 1000;

fn percentiles(mut v: Vec<Duration>) -> (f64, f64) {
    v.sort();
    let at = |q: f64| v[((v.len() as f64 - 1.0) * q) as usize].as_nanos() as f64 / 1000.0;
    (at(0.50), at(0.99))
}

pub fn main() {
    if support::client_main() {
        return;
    }
    let n = support::pods_arg().unwrap_or(100_000);
    let engine = support::engine_arg();
    eprintln!("storage engine: {engine}");
    eprintln!("allocator: {}", support::alloc::NAME);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(bench(n, engine));
}

async fn bench(n: usize, engine: kube_persist::Engine) {
    let server = support::start_server(n, &["--history", "200000"]);
    let url = server.url.clone();
    let client = kube_persist_testkit::client_for(&url, None);
    let keys: Vec<(String, String)> = support::server_versions(&url)
        .await
        .into_keys()
        .map(|k| {
            let (ns, name) = k.split_once('/').expect("namespaced");
            (ns.to_string(), name.to_string())
        })
        .collect();
    let mut rng = StdRng::seed_from_u64(42);
    let hot: Vec<usize> = (0..1000).map(|_| rng.random_range(0..keys.len())).collect();
    let hot_seq: Vec<usize> = (0..GETS)
        .map(|_| hot[rng.random_range(0..hot.len())])
        .collect();
    let uniform_seq: Vec<usize> = (0..GETS).map(|_| rng.random_range(0..keys.len())).collect();

    let work = Workload {
        keys: &keys,
        hot: &hot,
        hot_seq: &hot_seq,
        uniform_seq: &uniform_seq,
    };
    if let Some(mode) = std::env::args().find(|a| a == "--scan-only" || a == "--gets-only") {
        // For profiling the read paths: sync, then only iterate (or only get) for a while.
        profile_reads(engine, &client, &work, mode == "--scan-only").await;
        return;
    }
    if std::env::args().any(|a| a == "--apply-only") {
        // For profiling the write path: sync, then apply the streamed events; no gets.
        let f = measure_persist(engine, &url, &client, &work, None, true).await;
        eprintln!("apply only: {:.0} events/s", f.apply_per_s);
        return;
    }
    let plain = measure_persist(engine, &url, &client, &work, None, false).await;
    let key = kube_persist::EncryptionKey::from_bytes([7; 32]);
    let enc = measure_persist(engine, &url, &client, &work, Some(key), false).await;
    eprintln!(
        "encryption cost: uniform get p50 {:.1} -> {:.1} us, apply {:.0} -> {:.0} events/s",
        plain.uni50, enc.uni50, plain.apply_per_s, enc.apply_per_s
    );
    let (hot50, uni50, uni99, raw50, hit_rate, per_s) = (
        plain.hot50,
        plain.uni50,
        plain.uni99,
        plain.raw50,
        plain.hit_rate,
        plain.apply_per_s,
    );
    let (iter_per_s, iter_as_per_s, recent50) =
        (plain.iter_per_s, plain.iter_as_per_s, plain.recent50);
    let (async_hot50, async_uni50) = (plain.async_hot50, plain.async_uni50);

    // kube-runtime's reflector Store::get on the same keys.
    let (store, writer) = reflector::store::<Pod>();
    let rtask = tokio::spawn(
        reflector::reflector(
            writer,
            watcher::watcher(
                Api::<Pod>::all(client),
                watcher::Config::default().page_size(500),
            ),
        )
        .default_backoff()
        .for_each(|_| async {}),
    );
    store.wait_until_ready().await.expect("reflector ready");
    let refs: Vec<ObjectRef<Pod>> = keys
        .iter()
        .map(|(ns, name)| ObjectRef::new(name).within(ns))
        .collect();
    let time_store = |seq: &[usize]| -> Vec<Duration> {
        seq.iter()
            .map(|&i| {
                let t = Instant::now();
                let got = store.get(&refs[i]);
                let d = t.elapsed();
                assert!(got.is_some());
                d
            })
            .collect()
    };
    let t = Instant::now();
    let mut touched = 0usize;
    for pod in store.state() {
        touched += pod.metadata.name.as_ref().map_or(0, String::len);
    }
    let r_iter_per_s = keys.len() as f64 / t.elapsed().as_secs_f64();
    std::hint::black_box(touched);
    eprintln!("kube-runtime Store::state() iteration: {r_iter_per_s:.0} objects/s");
    let (r_hot50, _) = percentiles(time_store(&hot_seq));
    let (r_uni50, r_uni99) = percentiles(time_store(&uniform_seq));
    eprintln!(
        "kube-runtime Store::get   hot keys: p50 {r_hot50:.2} us; uniform random: p50 {r_uni50:.2} us p99 {r_uni99:.2} us"
    );
    eprintln!(
        "hit path: kube-persist hot p50 / Store::get hot p50 = {:.1}x",
        hot50 / r_hot50
    );
    rtask.abort();
    println!(
        "RESULT n={n} persist_get_p50_us={uni50:.1} persist_get_p99_us={uni99:.1} reflector_get_p50_us={r_uni50:.2} persist_apply_events_per_s={per_s:.0} persist_get_raw_p50_us={raw50:.1} hot_cache_hit_rate={hit_rate:.3} engine={engine} persist_iter_objects_per_s={iter_per_s:.0} persist_iter_as_objects_per_s={iter_as_per_s:.0} reflector_iter_objects_per_s={r_iter_per_s:.0} persist_recent_get_p50_us={recent50:.2} allocator={} persist_get_async_hot_p50_us={async_hot50:.2} persist_get_async_p50_us={async_uni50:.1}",
        support::alloc::NAME
    );
}

/// The keys and the get sequences every variant is measured on.
struct Workload<'a> {
    keys: &'a [(String, String)],
    /// The hot set (indexes into `keys`).
    hot: &'a [usize],
    /// Gets drawn from the hot set.
    hot_seq: &'a [usize],
    /// Gets drawn uniformly from all keys.
    uniform_seq: &'a [usize],
}

struct PersistFigures {
    hot50: f64,
    /// `get_async` p50 on the hot keys and on the uniform ones.
    async_hot50: f64,
    async_uni50: f64,
    uni50: f64,
    uni99: f64,
    raw50: f64,
    hit_rate: f64,
    apply_per_s: f64,
    iter_per_s: f64,
    iter_as_per_s: f64,
    recent50: f64,
}

/// p50 of `f` over `seq`, in microseconds.
fn p50_of(seq: &[usize], mut f: impl FnMut(usize)) -> f64 {
    let times = seq
        .iter()
        .map(|&i| {
            let t = Instant::now();
            f(i);
            t.elapsed()
        })
        .collect();
    percentiles(times).0
}

/// Sync a kube-persist store, time `Reader::get` on hot and uniform keys, then time how fast
/// it applies 50,000 streamed watch events.
async fn measure_persist(
    engine: kube_persist::Engine,
    url: &str,
    client: &kube::Client,
    work: &Workload<'_>,
    key: Option<kube_persist::EncryptionKey>,
    apply_only: bool,
) -> PersistFigures {
    let keys = work.keys;
    let encrypted = key.is_some();
    let label = if encrypted {
        "kube-persist (encrypted)"
    } else {
        "kube-persist"
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let mut db_config = kube_persist::DbConfig::default()
        .engine(engine)
        .durability(support::durability_arg());
    if let Some(k) = key {
        db_config = db_config.encryption_key(k);
    }
    let db = kube_persist::Db::open_with(dir.path().join("store"), db_config).expect("open");
    // A hot cache large enough for the hot key set (1000 Pods, about 50 MiB decoded);
    // `--no-hot-cache` turns it off (and with it the write-through of applied events).
    let cache = if std::env::args().any(|a| a == "--no-hot-cache") {
        0
    } else {
        128 << 20
    };
    let config = || kube_persist::StreamConfig::default().hot_cache(cache);
    let (reader, persist_watcher) = db
        .store("pods", Api::<Pod>::all(client.clone()), config())
        .expect("stream");
    // The objects the watch changed, newest last (at most RECENT), for the recent gets.
    let recent = Arc::new(Mutex::new(VecDeque::<(String, String)>::new()));
    let ring = recent.clone();
    let task = tokio::spawn(async move {
        let mut events = std::pin::pin!(persist_watcher.stream());
        while let Some(ev) = events.next().await {
            if let Ok(kube_persist::Event::Apply(pod)) = ev {
                let mut ring = ring.lock().unwrap();
                let m = pod.metadata;
                ring.push_back((m.namespace.unwrap_or_default(), m.name.unwrap_or_default()));
                if ring.len() > RECENT {
                    ring.pop_front();
                }
            }
        }
    });
    let t = Instant::now();
    reader.wait_until_live().await.expect("ready");
    eprintln!(
        "{label} synced {} pods in {:.2} s",
        keys.len(),
        t.elapsed().as_secs_f64()
    );
    // The store's size on disk after the initial list (before any watch event).
    db.flush().expect("flush");
    eprintln!(
        "{label} store on disk after the sync: {} bytes",
        support::dir_size(dir.path())
    );

    let (hot50, uni50, uni99, raw50, hit_rate, reads) = if apply_only {
        Default::default()
    } else {
        let (a, b, c, d, e) = read_figures(label, &reader, url, work, encrypted).await;
        let reads = scan_figures(label, &reader, url, recent).await;
        index_figures(label, &db, client).await;
        (a, b, c, d, e, reads)
    };
    let (async_hot50, async_uni50) = if apply_only {
        Default::default()
    } else {
        async_figures(label, &reader, work).await
    };

    // Apply throughput: updates are made while the watcher is stopped (the test server
    // writes only a few thousand objects per second, slower than the store applies them),
    // then the watcher resumes from its checkpoint and the server streams them all.
    task.abort();
    let _ = task.await;
    let events = 50_000u64;
    let changed = support::admin(
        url,
        "POST",
        &format!("/testkit/churn?updates={events}&creates=0&deletes=0&seed=3"),
    )
    .await;
    assert!(changed["revision"].is_u64(), "churn answered {changed}");
    // Caught up when the store's checkpoint equals the collection's resourceVersion now
    // (nothing changes on the server after the churn); compared as opaque strings.
    let target = Api::<Pod>::all(client.clone())
        .list_metadata(&kube::api::ListParams::default().limit(1))
        .await
        .expect("list")
        .metadata
        .resource_version
        .expect("list resourceVersion");
    let (reader, persist_watcher) = db
        .store("pods", Api::<Pod>::all(client.clone()), config())
        .expect("stream");
    eprintln!("{label} resuming to apply {events} watch events");
    let t = Instant::now();
    let task = tokio::spawn(persist_watcher.run());
    while reader.checkpoint().as_deref() != Some(target.as_str()) {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let apply_secs = t.elapsed().as_secs_f64();
    let per_s = events as f64 / apply_secs;
    let stats = reader.stats();
    eprintln!(
        "{label} applied {events} streamed watch events in {apply_secs:.2} s ({per_s:.0}/s, {} batches)",
        stats.batches
    );
    task.abort();

    PersistFigures {
        hot50,
        async_hot50,
        async_uni50,
        uni50,
        uni99,
        raw50,
        hit_rate,
        apply_per_s: per_s,
        iter_per_s: reads.iter_per_s,
        iter_as_per_s: reads.iter_as_per_s,
        recent50: reads.recent50,
    }
}

/// The hot cache's hit rate for Zipf-distributed gets (s = 1: rank r is read with weight
/// 1/r) over every key for 5 s, while the server updates 1,000 random Pods per second.
async fn churn_hit_rate(
    url: &str,
    reader: &kube_persist::Reader<Pod>,
    keys: &[(String, String)],
) -> f64 {
    let mut cdf = Vec::with_capacity(keys.len());
    let mut total = 0.0;
    for r in 1..=keys.len() {
        total += 1.0 / r as f64;
        cdf.push(total);
    }
    let mut rng = StdRng::seed_from_u64(7);
    let mut order: Vec<usize> = (0..keys.len()).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.random_range(0..=i));
    }
    let churn = spawn_churn(url, 1000);
    let before = reader.stats();
    let reader = reader.clone();
    let keys = keys.to_vec();
    tokio::task::spawn_blocking(move || {
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(5) {
            let x = rng.random_range(0.0..total);
            let rank = cdf.partition_point(|&c| c < x).min(keys.len() - 1);
            let (ns, name) = &keys[order[rank]];
            reader.get_named(Some(ns), name).expect("get");
        }
        let after = reader.stats();
        churn.abort();
        let hits = (after.hot_cache_hits - before.hot_cache_hits) as f64;
        let misses = (after.hot_cache_misses - before.hot_cache_misses) as f64;
        hits / (hits + misses).max(1.0)
    })
    .await
    .expect("churn gets")
}

/// Time `Reader::get_async` on the hot keys (after `read_figures`' gets: cache hits) and on
/// the uniform ones, each awaited alone: `(hot p50, uniform p50)`, in µs.
async fn async_figures(
    label: &str,
    reader: &kube_persist::Reader<Pod>,
    work: &Workload<'_>,
) -> (f64, f64) {
    async fn time(
        reader: &kube_persist::Reader<Pod>,
        keys: &[(String, String)],
        seq: &[usize],
    ) -> Vec<Duration> {
        let mut times = Vec::with_capacity(seq.len());
        for &i in seq {
            let (ns, name) = &keys[i];
            let t = Instant::now();
            let got = reader
                .get_named_async(Some(ns), name)
                .await
                .expect("get_async");
            times.push(t.elapsed());
            assert!(got.is_some(), "{ns}/{name} missing");
        }
        times
    }
    let before = reader.stats();
    let (hot50, hot99) = percentiles(time(reader, work.keys, work.hot_seq).await);
    let mid = reader.stats();
    let (uni50, uni99) = percentiles(time(reader, work.keys, work.uniform_seq).await);
    let after = reader.stats();
    let hits =
        |a: &kube_persist::Stats, b: &kube_persist::Stats| b.hot_cache_hits - a.hot_cache_hits;
    eprintln!(
        "{label} Reader::get_async hot keys: p50 {hot50:.2} us p99 {hot99:.2} us ({} of {} hits); \
         uniform random: p50 {uni50:.1} us p99 {uni99:.1} us ({} of {} hits)",
        hits(&before, &mid),
        work.hot_seq.len(),
        hits(&mid, &after),
        work.uniform_seq.len()
    );
    (hot50, uni50)
}

/// Time `Reader::get` (hot and uniform keys), its breakdown, and the hot cache's hit rate
/// under churn: `(hot p50, uniform p50, uniform p99, get_raw p50, hit rate)`.
async fn read_figures(
    label: &str,
    reader: &kube_persist::Reader<Pod>,
    url: &str,
    work: &Workload<'_>,
    encrypted: bool,
) -> (f64, f64, f64, f64, f64) {
    let Workload {
        keys,
        hot,
        hot_seq,
        uniform_seq,
    } = *work;
    let time_gets = |seq: &[usize]| -> Vec<Duration> {
        seq.iter()
            .map(|&i| {
                let (ns, name) = &keys[i];
                let t = Instant::now();
                let got = reader.get_named(Some(ns), name).expect("get");
                let d = t.elapsed();
                assert!(got.is_some(), "{ns}/{name} missing");
                d
            })
            .collect()
    };
    let _warm = time_gets(hot);
    let (hot50, hot99) = percentiles(time_gets(hot_seq));
    let (uni50, uni99) = percentiles(time_gets(uniform_seq));
    eprintln!(
        "{label} Reader::get  hot keys (cache hits): p50 {hot50:.2} us p99 {hot99:.2} us; uniform random: p50 {uni50:.1} us p99 {uni99:.1} us"
    );
    // Where a miss goes: engine read + envelope + decompression (+ decryption) is get_raw;
    // the rest is JSON decoding, timed alone on the same bodies with both parsers.
    let sample = &uniform_seq[..uniform_seq.len().min(20_000)];
    let raw50 = p50_of(sample, |i| {
        let (ns, name) = &keys[i];
        assert!(reader.get_raw(Some(ns), name).expect("get_raw").is_some());
    });
    let partial50 = p50_of(sample, |i| {
        let (ns, name) = &keys[i];
        let m: Option<kube::core::PartialObjectMeta<Pod>> =
            reader.get_as(Some(ns), name).expect("get_as");
        assert!(m.is_some());
    });
    let small50 = p50_of(sample, |i| {
        let (ns, name) = &keys[i];
        let m: Option<NameAndNode> = reader.get_as(Some(ns), name).expect("get_as");
        assert!(m.is_some());
    });
    let bodies: Vec<Vec<u8>> = sample[..2000]
        .iter()
        .map(|&i| {
            let (ns, name) = &keys[i];
            reader.get_raw(Some(ns), name).unwrap().unwrap()
        })
        .collect();
    let idx: Vec<usize> = (0..bodies.len()).collect();
    let serde50 = p50_of(&idx, |i| {
        let _: Pod = serde_json::from_slice(&bodies[i]).expect("serde_json");
    });
    let simd50 = p50_of(&idx, |i| {
        let mut b = bodies[i].clone();
        let _: Pod = simd_json::serde::from_slice(&mut b).expect("simd-json");
    });
    let json_kb = bodies.iter().map(Vec::len).sum::<usize>() as f64 / bodies.len() as f64 / 1e3;
    // The same bodies without metadata.managedFields (what `drop_managed_fields` stores).
    let stripped: Vec<Vec<u8>> = bodies
        .iter()
        .map(|b| {
            let mut v: serde_json::Value = serde_json::from_slice(b).expect("json");
            if let Some(m) = v["metadata"].as_object_mut() {
                m.remove("managedFields");
            }
            serde_json::to_vec(&v).expect("json")
        })
        .collect();
    let stripped50 = p50_of(&idx, |i| {
        let mut b = stripped[i].clone();
        let _: Pod = simd_json::serde::from_slice(&mut b).expect("simd-json");
    });
    let stripped_kb =
        stripped.iter().map(Vec::len).sum::<usize>() as f64 / stripped.len() as f64 / 1e3;
    eprintln!(
        "{label} managedFields: simd-json decode p50 {simd50:.1} us for {json_kb:.1} KB with them, \
         {stripped50:.1} us for {stripped_kb:.1} KB without"
    );
    // The body codec: LZ4 (format 3) against zstd level 1 (format 2) on the same bodies.
    let lz4: Vec<Vec<u8>> = bodies
        .iter()
        .map(|b| lz4_flex::block::compress_prepend_size(b))
        .collect();
    let zst: Vec<Vec<u8>> = bodies
        .iter()
        .map(|b| zstd::bulk::compress(b, 1).expect("zstd"))
        .collect();
    let mut zc = zstd::bulk::Compressor::new(1).expect("zstd");
    let mut zd = zstd::bulk::Decompressor::new().expect("zstd");
    let lz4_c = p50_of(&idx, |i| {
        std::hint::black_box(lz4_flex::block::compress_prepend_size(&bodies[i]));
    });
    let zstd_c = p50_of(&idx, |i| {
        std::hint::black_box(zc.compress(&bodies[i]).expect("zstd"));
    });
    let lz4_d = p50_of(&idx, |i| {
        std::hint::black_box(lz4_flex::block::decompress_size_prepended(&lz4[i]).expect("lz4"));
    });
    let zstd_d = p50_of(&idx, |i| {
        std::hint::black_box(zd.decompress(&zst[i], bodies[i].len()).expect("zstd"));
    });
    let ratio = |c: &[Vec<u8>]| {
        bodies.iter().map(Vec::len).sum::<usize>() as f64
            / c.iter().map(Vec::len).sum::<usize>() as f64
    };
    eprintln!(
        "{label} body codec (p50, us): LZ4 compress {lz4_c:.1} decompress {lz4_d:.1} ratio {:.2}; \
         zstd-1 compress {zstd_c:.1} decompress {zstd_d:.1} ratio {:.2}",
        ratio(&lz4),
        ratio(&zst)
    );
    eprintln!(
        "{label} read breakdown (p50, us): get {uni50:.1} = get_raw {raw50:.1} (engine read, envelope, \
         decompression{}) + decode; decode alone: serde_json {serde50:.1}, simd-json {simd50:.1} \
         (incl. a {json_kb:.1} KB copy); typed partial get_as::<PartialObjectMeta<Pod>> {partial50:.1}, \
         get_as::<name and node> {small50:.1}",
        if encrypted { ", decryption" } else { "" }
    );

    let hit_rate = churn_hit_rate(url, reader, keys).await;
    eprintln!(
        "{label} hot cache under churn (Zipf gets while the server updates 1,000 Pods/s): hit rate {:.1}%",
        hit_rate * 100.0
    );
    (hot50, uni50, uni99, raw50, hit_rate)
}
