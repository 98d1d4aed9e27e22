//! The controller process: this binary re-executed with `--soak-child`. One store of all
//! Pods shared by a durable controller (ticked, `concurrency` reconciles at once) and a slow
//! plain subscriber; everything it does goes to its log, one line per event (read back by
//! [`crate::logs::Gen`]).

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::controller::Action;
use kube_persist::controller::{Config, Controller};
use kube_persist::resource_version;
use kube_persist::{Event, SharedEvent};

use crate::support;
use crate::{Params, now_ms};

/// Reconciles take 5..=50 ms, uniformly: 27.5 ms on average.
const MIN_RECONCILE_MS: u64 = 5;
const MAX_RECONCILE_MS: u64 = 50;
pub(crate) const MEAN_RECONCILE_MS: f64 = (MIN_RECONCILE_MS + MAX_RECONCILE_MS) as f64 / 2.0;

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The reconcile time of `name` at `rv`: 5-50 ms, fixed by the seed.
fn reconcile_ms(seed: u64, name: &str, rv: &str) -> u64 {
    // FNV-1a of the name and version, mixed with the seed.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes().chain([b' ']).chain(rv.bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    MIN_RECONCILE_MS + splitmix64(h ^ seed) % (MAX_RECONCILE_MS - MIN_RECONCILE_MS + 1)
}

/// A log file written one line per `write` (append mode: a SIGKILL keeps every whole line).
#[derive(Clone)]
struct Log(Arc<Mutex<std::fs::File>>);

impl Log {
    fn line(&self, s: String) {
        let mut f = self.0.lock().unwrap_or_else(|e| e.into_inner());
        f.write_all(s.as_bytes()).expect("write the soak log");
    }
}

pub(crate) fn child_main() {
    let heap = std::env::var_os("SOAK_HEAP").is_some_and(|v| v != "0");
    if heap {
        support::alloc::count_live_bytes();
    }
    let args: Vec<String> = std::env::args().collect();
    let get = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
            .unwrap_or_else(|| panic!("{flag} missing"))
    };
    let (url, dir, log) = (get("--url"), get("--dir"), get("--log"));
    let p = Params::from_env();
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)
        .expect("open the soak log");
    let log = Log(Arc::new(Mutex::new(file)));
    let rt = support::runtime_with_logs();
    if heap {
        rt.spawn(heap_reports());
    }
    let code = rt.block_on(child(p, url, PathBuf::from(dir), log));
    drop(rt);
    std::process::exit(code);
}

/// Every 10 s, one line on stderr: VmRSS, the live bytes Rust code allocated, and glibc's
/// view of the heap (`SOAK_HEAP=1`; see the bench's doc).
async fn heap_reports() {
    let started = std::time::Instant::now();
    let mib = |b: f64| b / (1024.0 * 1024.0);
    let mut every = tokio::time::interval(Duration::from_secs(10));
    loop {
        every.tick().await;
        let (_, rss_kib) = support::rss_kib_at("/proc/self/status");
        // SAFETY: mallinfo2 only reads glibc's counters (under its arena locks).
        let mi = unsafe { libc::mallinfo2() };
        eprintln!(
            "soak-heap pid={} t={:.0}s rss_mib={:.1} live_mib={:.1} malloc_used_mib={:.1} malloc_free_mib={:.1} mmap_mib={:.1} arena_mib={:.1}",
            std::process::id(),
            started.elapsed().as_secs_f64(),
            support::mib(rss_kib),
            mib(support::alloc::live_bytes() as f64),
            mib(mi.uordblks as f64),
            mib(mi.fordblks as f64),
            mib(mi.hblkhd as f64),
            mib(mi.arena as f64),
        );
    }
}

async fn child(p: Params, url: String, dir: PathBuf, log: Log) -> i32 {
    let client = kube_persist_testkit::client_for(&url, None);
    let db = kube_persist::Db::open(&dir).expect("open the store");
    let (reader, watcher) = db
        .store(
            "pods",
            Api::<Pod>::all(client),
            kube_persist::StreamConfig::default(),
        )
        .expect("open the stream");
    let shared = watcher.shared(p.buffer);
    let (for_controller, mut slow) = (shared.subscribe(), shared.subscribe());
    let hub = tokio::spawn(shared.run());

    // The plain subscriber: one event every `slow_ms`; checks the order of each object's
    // versions and logs its start signals and lags.
    let slow_log = log.clone();
    let slow_ms = p.slow_ms;
    let slow_task = tokio::spawn(async move {
        let mut last: HashMap<String, String> = HashMap::new();
        while let Some(item) = slow.next().await {
            match item {
                Ok(SharedEvent::Event(ev)) => match &*ev {
                    Event::InitDone | Event::Resumed { .. } => {
                        slow_log.line(format!("s {}\n", now_ms()));
                    }
                    Event::InitApply(pod) | Event::Apply(pod) => {
                        let m = &pod.metadata;
                        let key = format!(
                            "{}/{}",
                            m.namespace.as_deref().unwrap_or(""),
                            m.name.as_deref().unwrap_or("")
                        );
                        let rv = m.resource_version.clone().unwrap_or_default();
                        if let Some(prev) = last.get(&key)
                            && resource_version::at_least(&rv, prev) == Some(false)
                        {
                            slow_log.line(format!("o {key} {prev} {rv}\n"));
                        }
                        last.insert(key, rv);
                    }
                    _ => {}
                },
                Ok(SharedEvent::Lagged) => slow_log.line(format!("l {}\n", now_ms())),
                Ok(_) => {}
                Err(e) => slow_log.line(format!("e slow-subscriber {e}\n")),
            }
            tokio::time::sleep(Duration::from_millis(slow_ms)).await;
        }
    });

    let tick_log = log.clone();
    let period = Duration::from_secs(p.tick_s);
    let ticks = futures::stream::unfold((), move |()| {
        let tick_log = tick_log.clone();
        async move {
            tokio::time::sleep(period).await;
            // Logged when the controller takes it.
            tick_log.line(format!("t {}\n", now_ms()));
            Some(((), ()))
        }
    });
    let controller = Controller::for_shared(reader, for_controller)
        .with_config(Config::default().concurrency(p.concurrency))
        .durable_state("soak")
        .expect("durable state")
        .reconcile_all_on(ticks)
        .shutdown_on_signal();

    let (seed, rlog) = (p.seed, log.clone());
    let mut results = std::pin::pin!(controller.run(
        move |pod: Arc<Pod>, _ctx: Arc<()>| {
            let rlog = rlog.clone();
            async move {
                let start = now_ms();
                let m = &pod.metadata;
                let key = format!(
                    "{}/{}",
                    m.namespace.as_deref().unwrap_or(""),
                    m.name.as_deref().unwrap_or("")
                );
                let rv = m.resource_version.clone().unwrap_or_default();
                tokio::time::sleep(Duration::from_millis(reconcile_ms(seed, &key, &rv))).await;
                rlog.line(format!("r {key} {rv} {start} {}\n", now_ms()));
                Ok::<_, std::io::Error>(Action::await_change())
            }
        },
        |_pod, _err, _ctx| Action::requeue(Duration::from_secs(1)),
        Arc::new(()),
    ));
    while let Some(item) = results.next().await {
        if let Err(e) = item {
            log.line(format!(
                "e controller {}\n",
                e.to_string().replace('\n', " ")
            ));
        }
    }
    // Graceful shutdown: the controller's stream ended; stop the consumers and the watch.
    slow_task.abort();
    hub.abort();
    let _ = slow_task.await;
    let _ = hub.await;
    db.flush().expect("flush the store");
    0
}
