//! Soak: a durable controller under sustained load, restarted every few minutes, against a
//! `testkit-server` process; at the end the invariants are checked on what it reconciled.
//!
//! ```text
//! cargo bench --bench soak                                  # the full soak: 10 minutes
//! SOAK_MINUTES=3 SOAK_OBJECTS=5000 SOAK_RESTART_S=45 cargo bench --bench soak
//! ```
//!
//! # The set-up
//!
//! - `testkit-server` (its own process) holds `SOAK_OBJECTS` Pods (20,000).
//! - The controller runs in a child process (this binary re-executed with `--soak-child`):
//!   one store of all Pods, shared ([`kube_persist::Watcher::shared`], queues of
//!   `SOAK_BUFFER` = 256 events, `max_stall` 1 s) by two consumers: a durable controller
//!   ([`kube_persist::controller::Controller::for_shared`] with
//!   [`durable_state`](kube_persist::controller::Controller::durable_state), default
//!   `StartupMode::Changed`, `concurrency(SOAK_CONCURRENCY)` = 8, a `reconcile_all_on` tick
//!   every `SOAK_TICK_S` = 30 s of the process's life) and a plain
//!   [`kube_persist::Subscriber`] that takes one event every `SOAK_SLOW_MS` = 10 ms (half the
//!   churn's rate: it falls behind and is lagged). A reconcile sleeps 5-50 ms, a function of
//!   the object, its resourceVersion and `SOAK_SEED`, and returns `await_change`.
//! - The driver (this process) writes `SOAK_RATE` = 200 merge patches a second through the
//!   testkit's Kubernetes API (an annotation of a Pod picked by a seeded RNG; no creates or
//!   deletes, so the set of objects is fixed), for `SOAK_MINUTES` = 10 minutes.
//! - Every `SOAK_RESTART_S` = 120 s the driver restarts the controller: the second restart
//!   (the first, if there is only one) is a SIGKILL, the others SIGTERM (graceful; the child
//!   must exit 0 within 30 s). The child starts again at once on the same store directory.
//! - After the last write the driver waits (at most `SOAK_DRAIN_S` = 120 s) until every
//!   write was reconciled, then stops the child with SIGTERM.
//!
//! `SOAK_KEEP=1` keeps the logs and the store (the directory is printed).
//!
//! Each child appends a line per completed reconcile (`r <name> <rv> <start_ms> <end_ms>`),
//! per tick it yields (`t <unix_ms>`), per start signal and lag of the plain subscriber, and
//! per error of the controller's stream to a log file of its own, written per line (a
//! SIGKILL loses only the reconciles that had not ended).
//!
//! # The invariants
//!
//! - **Triggers**: every write the driver made (`triggers`) must be followed by a completed
//!   reconcile of that object that saw that resourceVersion or a newer one (compared with
//!   [`kube_persist::resource_version`] only). `lost_triggers`: writes with no such reconcile
//!   by the end; `max_trigger_latency_s`: the longest time from the write's response to the
//!   end of that reconcile (downtime across a restart included). A latency beyond
//!   `SOAK_TRIGGER_BOUND_S` (60 s) is a violation.
//! - **Ticks**: a tick at time T (when the controller took it from the tick stream) is
//!   *fully swept* when every object has a reconcile by the same process that started at
//!   or after T and ended by T + the sweep bound. The sweep bound is `SOAK_SWEEP_BOUND_S`,
//!   by default 1.5 × the expected sweep time + 10 s, the expected sweep time being
//!   objects / (reconcile capacity − churn rate), capacity = concurrency / mean reconcile
//!   time (27.5 ms). A tick is *cut* when its process ended (a restart) before the bound
//!   ran out and had not swept every object by then: ticks are not durable (a restart with
//!   durable state reconciles what changed, not what a tick owed), so a cut tick is
//!   neither swept nor a failure; it is counted apart (`soak:` line). `ticks` counts every
//!   tick, `ticks_fully_swept` the swept ones, so a run where every tick is cut reads
//!   `ticks_fully_swept=0`: the target (every tick swept) needs a sweep shorter than the
//!   time between restarts.
//! - **Violations** (each counted): two reconciles of one object overlapping in time in
//!   one process; a reconcile that saw an older resourceVersion of an object than an
//!   earlier one; an error item of the controller's stream; a graceful stop that did not
//!   exit 0 within 30 s; a process that lived `SOAK_START_BOUND_S` (60 s) without its plain
//!   subscriber getting a start signal (`InitDone` or `Resumed`); an object whose events
//!   reached the plain subscriber out of resourceVersion order; a trigger later than its
//!   bound.
//! - **Memory**: `peak_rss_mib` is the highest VmHWM of the controller processes (the
//!   testkit's memory is its own process's); the target is 64 MiB.
//!
//! Last line: `RESULT soak_minutes=.. objects=.. triggers=.. lost_triggers=..
//! max_trigger_latency_s=.. ticks=.. ticks_fully_swept=.. peak_rss_mib=.. violations=..`

#[path = "../support/mod.rs"]
mod support;

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube_persist::controller::{Config, Controller};
use kube_persist::resource_version;
use kube_persist::{Event, SharedEvent};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The soak's parameters: the spec's defaults, each overridable by its environment variable.
#[derive(Debug, Clone)]
struct Params {
    minutes: f64,
    objects: usize,
    rate: u64,
    tick_s: u64,
    restart_s: u64,
    concurrency: u16,
    slow_ms: u64,
    buffer: usize,
    seed: u64,
    drain_s: u64,
    trigger_bound_s: f64,
    sweep_bound_s: Option<f64>,
    start_bound_s: u64,
}

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a valid value")),
        Err(_) => default,
    }
}

impl Params {
    fn from_env() -> Self {
        Params {
            minutes: env("SOAK_MINUTES", 10.0),
            objects: env("SOAK_OBJECTS", 20_000),
            rate: env("SOAK_RATE", 200),
            tick_s: env("SOAK_TICK_S", 30),
            restart_s: env("SOAK_RESTART_S", 120),
            concurrency: env("SOAK_CONCURRENCY", 8),
            slow_ms: env("SOAK_SLOW_MS", 10),
            buffer: env("SOAK_BUFFER", 256),
            seed: env("SOAK_SEED", 39),
            drain_s: env("SOAK_DRAIN_S", 120),
            trigger_bound_s: env("SOAK_TRIGGER_BOUND_S", 60.0),
            sweep_bound_s: std::env::var("SOAK_SWEEP_BOUND_S")
                .ok()
                .map(|v| v.parse().expect("SOAK_SWEEP_BOUND_S")),
            start_bound_s: env("SOAK_START_BOUND_S", 60),
        }
    }

    /// The sweep bound: 1.5 × objects / (capacity − churn) + 10 s, or `SOAK_SWEEP_BOUND_S`.
    fn sweep_bound_s(&self) -> f64 {
        if let Some(b) = self.sweep_bound_s {
            return b;
        }
        let capacity = f64::from(self.concurrency) / (MEAN_RECONCILE_MS / 1000.0);
        let spare = capacity - self.rate as f64;
        if spare <= 0.0 {
            return f64::INFINITY;
        }
        1.5 * self.objects as f64 / spare + 10.0
    }
}

/// Reconciles take 5..=50 ms, uniformly: 27.5 ms on average.
const MIN_RECONCILE_MS: u64 = 5;
const MAX_RECONCILE_MS: u64 = 50;
const MEAN_RECONCILE_MS: f64 = (MIN_RECONCILE_MS + MAX_RECONCILE_MS) as f64 / 2.0;
/// How long a SIGTERMed controller may take to exit.
const GRACE: Duration = Duration::from_secs(30);

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

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

/// The index `k` of the testkit's `pod-k`.
fn pod_index(name: &str) -> Option<usize> {
    name.rsplit('/').next()?.strip_prefix("pod-")?.parse().ok()
}

fn main() {
    if std::env::args().any(|a| a == "--soak-child") {
        child_main();
        return;
    }
    let p = Params::from_env();
    eprintln!(
        "soak parameters: {p:?}; sweep bound {:.0} s",
        p.sweep_bound_s()
    );
    let rt = support::runtime_with_logs();
    let server = support::start_server(p.objects, &["--history", "500000"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let report = rt.block_on(drive(&p, &server.url, dir.path()));
    if std::env::var_os("SOAK_KEEP").is_some() {
        eprintln!("logs and store kept in {}", dir.keep().display());
    }
    eprintln!("{}", report.detail);
    println!("{}", report.result);
}

// ---------------------------------------------------------------------------------------
// The controller process.

/// A log file written one line per `write` (append mode: a SIGKILL keeps every whole line).
#[derive(Clone)]
struct Log(Arc<Mutex<std::fs::File>>);

impl Log {
    fn line(&self, s: String) {
        let mut f = self.0.lock().unwrap_or_else(|e| e.into_inner());
        f.write_all(s.as_bytes()).expect("write the soak log");
    }
}

fn child_main() {
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
    let code = rt.block_on(child(p, url, PathBuf::from(dir), log));
    drop(rt);
    std::process::exit(code);
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
    let controller = Controller::for_shared(
        reader,
        for_controller,
        Config::default().concurrency(p.concurrency),
    )
    .durable_state(&db, "soak")
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

// ---------------------------------------------------------------------------------------
// The driver.

/// One write of the driver: the object, the version the server returned, when.
struct Written {
    obj: usize,
    rv: String,
    at_ms: u64,
}

/// One completed reconcile.
struct Rec {
    rv: String,
    start: u64,
    end: u64,
}

/// One controller process: its log and life.
struct Gen {
    log: PathBuf,
    started_ms: u64,
    ended_ms: Option<u64>,
    /// Bytes of the log read so far.
    read: u64,
    /// The tail of the log after its last newline.
    partial: String,
    /// Per object, the reconciles in the order they were logged (by end).
    recs: Vec<Vec<Rec>>,
    ticks: Vec<u64>,
    start_signals: Vec<u64>,
    lags: u64,
    errors: Vec<String>,
    disorder: Vec<String>,
}

impl Gen {
    fn new(log: PathBuf, objects: usize) -> Self {
        Gen {
            log,
            started_ms: now_ms(),
            ended_ms: None,
            read: 0,
            partial: String::new(),
            recs: (0..objects).map(|_| Vec::new()).collect(),
            ticks: Vec::new(),
            start_signals: Vec::new(),
            lags: 0,
            errors: Vec::new(),
            disorder: Vec::new(),
        }
    }

    /// Read the lines appended to the log since the last call.
    fn tail(&mut self, newest: &mut [Option<String>]) {
        let Ok(mut f) = std::fs::File::open(&self.log) else {
            return;
        };
        if f.seek(SeekFrom::Start(self.read)).is_err() {
            return;
        }
        let mut buf = String::new();
        let Ok(n) = f.read_to_string(&mut buf) else {
            return;
        };
        self.read += n as u64;
        self.partial.push_str(&buf);
        let Some(cut) = self.partial.rfind('\n') else {
            return;
        };
        let whole: String = self.partial.drain(..=cut).collect();
        for line in whole.lines() {
            self.parse(line, newest);
        }
    }

    fn parse(&mut self, line: &str, newest: &mut [Option<String>]) {
        let f: Vec<&str> = line.split(' ').collect();
        let num = |i: usize| f.get(i).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
        match f.first().copied() {
            Some("r") => {
                let Some(obj) = f.get(1).and_then(|n| pod_index(n)) else {
                    self.errors.push(format!("unknown object in {line:?}"));
                    return;
                };
                let Some(list) = self.recs.get_mut(obj) else {
                    self.errors.push(format!("unknown object in {line:?}"));
                    return;
                };
                let rv = f.get(2).copied().unwrap_or("").to_string();
                let slot = &mut newest[obj];
                if slot
                    .as_deref()
                    .is_none_or(|n| resource_version::at_least(&rv, n) == Some(true))
                {
                    *slot = Some(rv.clone());
                }
                list.push(Rec {
                    rv,
                    start: num(3),
                    end: num(4),
                });
            }
            Some("t") => self.ticks.push(num(1)),
            Some("s") => self.start_signals.push(num(1)),
            Some("l") => self.lags += 1,
            Some("o") => self.disorder.push(line.to_string()),
            Some("e") => self.errors.push(line.to_string()),
            _ => self.errors.push(format!("unreadable log line {line:?}")),
        }
    }
}

/// The controller child process.
struct ControllerProc {
    child: Child,
}

impl ControllerProc {
    fn start(url: &str, dir: &Path, log: &Path) -> Self {
        let child = Command::new(std::env::current_exe().expect("current exe"))
            .arg("--soak-child")
            .arg("--url")
            .arg(url)
            .arg("--dir")
            .arg(dir)
            .arg("--log")
            .arg(log)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdout(Stdio::null())
            .spawn()
            .expect("start the controller process");
        ControllerProc { child }
    }

    /// (VmHWM, VmRSS) in KiB.
    fn rss_kib(&self) -> (u64, u64) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
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

    /// SIGTERM and wait for the exit: `Err` with what went wrong (then it is SIGKILLed).
    async fn stop(mut self) -> Result<(), String> {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + GRACE;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) if status.success() => return Ok(()),
                Ok(Some(status)) => return Err(format!("graceful stop exited with {status}")),
                Ok(None) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                _ => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return Err(format!("no exit {GRACE:?} after SIGTERM"));
                }
            }
        }
    }

    fn kill(mut self) {
        self.child.kill().expect("SIGKILL the controller");
        self.child.wait().expect("wait for the controller");
    }

    /// Whether it exited by itself (it should not).
    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

struct Report {
    detail: String,
    result: String,
}

async fn drive(p: &Params, url: &str, dir: &Path) -> Report {
    let store = dir.join("store");
    let client = kube_persist_testkit::client_for(url, None);
    let mut gens: Vec<Gen> = Vec::new();
    let mut violations: Vec<String> = Vec::new();
    let mut peak_hwm_kib = 0u64;
    // Per object: the newest version reconciled and the newest written.
    let mut reconciled: Vec<Option<String>> = vec![None; p.objects];

    let log_of = |n: usize| dir.join(format!("controller-{n}.log"));
    gens.push(Gen::new(log_of(0), p.objects));
    let mut proc = ControllerProc::start(url, &store, &log_of(0));
    let t0 = Instant::now();
    let soak = Duration::from_secs_f64(p.minutes * 60.0);
    let restart_every = Duration::from_secs(p.restart_s);
    let restarts_due = (soak.as_secs_f64() / restart_every.as_secs_f64()).ceil() as u64 - 1;
    let kill_at = if restarts_due >= 2 { 1 } else { 0 };
    eprintln!(
        "{restarts_due} restarts planned (restart {} is a SIGKILL)",
        kill_at + 1
    );

    // The churn: `rate` merge patches a second, at most 32 in flight.
    let writes: Arc<Mutex<Vec<Written>>> = Arc::default();
    let write_errors = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let stop_writes = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let churn = {
        let (writes, write_errors, stop) =
            (writes.clone(), write_errors.clone(), stop_writes.clone());
        let (objects, rate, seed) = (p.objects, p.rate.max(1), p.seed);
        let client = client.clone();
        tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(seed);
            let permits = Arc::new(tokio::sync::Semaphore::new(32));
            let mut every = tokio::time::interval(Duration::from_secs_f64(1.0 / rate as f64));
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                every.tick().await;
                let k = rng.random_range(0..objects);
                n += 1;
                let permit = permits.clone().acquire_owned().await.expect("semaphore");
                let api = Api::<Pod>::namespaced(client.clone(), &format!("ns-{}", k % 10));
                let (writes, write_errors) = (writes.clone(), write_errors.clone());
                tokio::spawn(async move {
                    let patch = serde_json::json!({"metadata": {"annotations": {"soak/write": n.to_string()}}});
                    match api
                        .patch(
                            &format!("pod-{k}"),
                            &PatchParams::default(),
                            &Patch::Merge(&patch),
                        )
                        .await
                    {
                        Ok(pod) => {
                            let rv = pod.metadata.resource_version.unwrap_or_default();
                            let at_ms = now_ms();
                            writes.lock().unwrap().push(Written { obj: k, rv, at_ms });
                        }
                        Err(e) => {
                            write_errors.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            tracing::warn!("write failed: {e}");
                        }
                    }
                    drop(permit);
                });
            }
            // Let the writes in flight finish.
            let _ = permits.acquire_many(32).await;
        })
    };

    // The soak: sample memory, tail the log, restart on schedule.
    let mut restarts = 0u64;
    let mut last_report = Instant::now();
    while t0.elapsed() < soak {
        tokio::time::sleep(Duration::from_millis(250)).await;
        peak_hwm_kib = peak_hwm_kib.max(proc.rss_kib().0);
        gens.last_mut().unwrap().tail(&mut reconciled);
        if let Some(status) = proc.exited() {
            panic!("the controller exited by itself: {status}");
        }
        if restarts < restarts_due && t0.elapsed() >= restart_every * (restarts as u32 + 1) {
            let g = gens.last_mut().unwrap();
            if restarts == kill_at {
                eprintln!("{:>4.0} s: SIGKILL", t0.elapsed().as_secs_f64());
                proc.kill();
            } else {
                eprintln!("{:>4.0} s: SIGTERM", t0.elapsed().as_secs_f64());
                if let Err(e) = proc.stop().await {
                    violations.push(format!("restart {}: {e}", restarts + 1));
                }
            }
            g.ended_ms = Some(now_ms());
            g.tail(&mut reconciled);
            restarts += 1;
            let n = gens.len();
            gens.push(Gen::new(log_of(n), p.objects));
            proc = ControllerProc::start(url, &store, &log_of(n));
        }
        if last_report.elapsed() >= Duration::from_secs(15) {
            last_report = Instant::now();
            let g = gens.last().unwrap();
            let recs: usize = g.recs.iter().map(Vec::len).sum();
            eprintln!(
                "{:>4.0} s: {} writes, process {}: {recs} reconciles, {} ticks, {} lags, RSS {:.1} MiB",
                t0.elapsed().as_secs_f64(),
                writes.lock().unwrap().len(),
                gens.len() - 1,
                g.ticks.len(),
                g.lags,
                support::mib(proc.rss_kib().1),
            );
        }
    }

    // Drain: no more writes; wait until every write was reconciled.
    stop_writes.store(true, std::sync::atomic::Ordering::SeqCst);
    churn.await.expect("churn task");
    let newest_written = {
        let writes = writes.lock().unwrap();
        let mut newest: Vec<Option<String>> = vec![None; p.objects];
        for w in writes.iter() {
            let slot = &mut newest[w.obj];
            if slot
                .as_deref()
                .is_none_or(|n| resource_version::at_least(&w.rv, n) == Some(true))
            {
                *slot = Some(w.rv.clone());
            }
        }
        newest
    };
    let drain_until = Instant::now() + Duration::from_secs(p.drain_s);
    loop {
        gens.last_mut().unwrap().tail(&mut reconciled);
        peak_hwm_kib = peak_hwm_kib.max(proc.rss_kib().0);
        let owed = newest_written
            .iter()
            .zip(&reconciled)
            .filter(|(w, r)| match (w, r) {
                (None, _) => false,
                (Some(_), None) => true,
                (Some(w), Some(r)) => resource_version::at_least(r, w) != Some(true),
            })
            .count();
        if owed == 0 || Instant::now() >= drain_until {
            eprintln!(
                "drained: {owed} objects owed a reconcile {:.0} s after the last write",
                t0.elapsed().as_secs_f64() - soak.as_secs_f64()
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    peak_hwm_kib = peak_hwm_kib.max(proc.rss_kib().0);
    if let Err(e) = proc.stop().await {
        violations.push(format!("final stop: {e}"));
    }
    let g = gens.last_mut().unwrap();
    g.ended_ms = Some(now_ms());
    g.tail(&mut reconciled);

    let writes = std::mem::take(&mut *writes.lock().unwrap());
    let write_errors = write_errors.load(std::sync::atomic::Ordering::SeqCst);
    check(p, gens, writes, write_errors, violations, peak_hwm_kib)
}

// ---------------------------------------------------------------------------------------
// The invariants.

fn check(
    p: &Params,
    gens: Vec<Gen>,
    mut writes: Vec<Written>,
    write_errors: u64,
    mut violations: Vec<String>,
    peak_hwm_kib: u64,
) -> Report {
    let mut notes: Vec<String> = Vec::new();
    let cmp = |a: &str, b: &str| resource_version::compare(a, b).expect("comparable versions");

    // Every reconcile of each object, across processes, in the order they ended.
    let mut per_obj: Vec<Vec<&Rec>> = vec![Vec::new(); p.objects];
    for g in &gens {
        for (obj, recs) in g.recs.iter().enumerate() {
            per_obj[obj].extend(recs.iter());
        }
    }
    for recs in per_obj.iter_mut() {
        recs.sort_by_key(|r| (r.end, r.start));
    }

    // No two reconciles of one object at once (within a process), no version going back.
    for (gi, g) in gens.iter().enumerate() {
        for (obj, recs) in g.recs.iter().enumerate() {
            let mut by_start: Vec<&Rec> = recs.iter().collect();
            by_start.sort_by_key(|r| r.start);
            for w in by_start.windows(2) {
                if w[1].start < w[0].end {
                    violations.push(format!(
                        "process {gi}: pod-{obj} reconciled twice at once ({}..{} and {}..{})",
                        w[0].start, w[0].end, w[1].start, w[1].end
                    ));
                }
            }
        }
    }
    for (obj, recs) in per_obj.iter().enumerate() {
        for w in recs.windows(2) {
            if cmp(&w[1].rv, &w[0].rv).is_lt() {
                violations.push(format!(
                    "pod-{obj}: reconciled at {} after {}",
                    w[1].rv, w[0].rv
                ));
            }
        }
    }

    // Triggers: each write is followed by a reconcile at its version or newer.
    writes.sort_by(|a, b| a.obj.cmp(&b.obj).then_with(|| cmp(&a.rv, &b.rv)));
    let (mut lost, mut late, mut max_latency_ms) = (0u64, 0u64, 0u64);
    let mut latencies: Vec<u64> = Vec::with_capacity(writes.len());
    // Late triggers by the process that was running (or starting) when the write was made.
    let mut late_by_gen = vec![0u64; gens.len()];
    let gen_at = |ms: u64| gens.iter().rposition(|g| g.started_ms <= ms).unwrap_or(0);
    let mut i = 0;
    while i < writes.len() {
        let obj = writes[i].obj;
        let recs = &per_obj[obj];
        let mut r = 0;
        while i < writes.len() && writes[i].obj == obj {
            let w = &writes[i];
            while r < recs.len() && resource_version::at_least(&recs[r].rv, &w.rv) != Some(true) {
                r += 1;
            }
            match recs.get(r) {
                None => lost += 1,
                Some(rec) => {
                    let latency = rec.end.saturating_sub(w.at_ms);
                    max_latency_ms = max_latency_ms.max(latency);
                    latencies.push(latency);
                    if latency as f64 > p.trigger_bound_s * 1000.0 {
                        late += 1;
                        late_by_gen[gen_at(w.at_ms)] += 1;
                    }
                }
            }
            i += 1;
        }
    }
    if late > 0 {
        violations.push(format!(
            "{late} triggers reconciled later than {} s (by the process running at the write: {late_by_gen:?})",
            p.trigger_bound_s
        ));
    }
    latencies.sort_unstable();
    let pct = |q: f64| {
        latencies
            .get(((latencies.len() as f64 * q) as usize).min(latencies.len().saturating_sub(1)))
            .map_or(0.0, |&ms| ms as f64 / 1000.0)
    };
    notes.push(format!(
        "trigger latency: p50 {:.2} s, p90 {:.2} s, p99 {:.2} s, max {:.2} s",
        pct(0.5),
        pct(0.9),
        pct(0.99),
        max_latency_ms as f64 / 1000.0
    ));

    // Ticks.
    let bound_ms = p.sweep_bound_s() * 1000.0;
    let (mut ticks, mut swept, mut cut, mut failed) = (0u64, 0u64, 0u64, 0u64);
    let mut sweep_times: Vec<f64> = Vec::new();
    for (gi, g) in gens.iter().enumerate() {
        let ended = g.ended_ms.unwrap_or(u64::MAX);
        let mut by_start: Vec<Vec<(u64, u64)>> = g
            .recs
            .iter()
            .map(|recs| recs.iter().map(|r| (r.start, r.end)).collect())
            .collect();
        for v in by_start.iter_mut() {
            v.sort_unstable();
        }
        for &t in &g.ticks {
            ticks += 1;
            // When the last object was reconciled after the tick (None: some never were).
            let mut done: Option<u64> = Some(t);
            let mut missing = 0usize;
            for recs in &by_start {
                let at = recs.partition_point(|&(s, _)| s < t);
                // The first reconcile to end among those that started after the tick.
                match recs[at..].iter().map(|&(_, e)| e).min() {
                    Some(e) => done = done.map(|d| d.max(e)),
                    None => {
                        done = None;
                        missing += 1;
                    }
                }
            }
            let deadline = t as f64 + bound_ms;
            match done {
                Some(d) if (d as f64) <= deadline => {
                    swept += 1;
                    sweep_times.push((d - t) as f64 / 1000.0);
                }
                _ if (ended as f64) < deadline => {
                    cut += 1;
                    notes.push(format!(
                        "process {gi}: tick at +{:.0} s of its life cut by its end {:.0} s later ({missing} objects not reached)",
                        (t - g.started_ms) as f64 / 1000.0,
                        (ended - t) as f64 / 1000.0
                    ));
                }
                _ => {
                    failed += 1;
                    notes.push(format!(
                        "process {gi}: tick at +{:.0} s of its life not swept within {:.0} s ({missing} objects not reached)",
                        (t - g.started_ms) as f64 / 1000.0,
                        bound_ms / 1000.0
                    ));
                }
            }
        }
    }

    // The plain subscriber: a start signal in each process that lived long enough; order.
    let mut lags = 0;
    for (gi, g) in gens.iter().enumerate() {
        lags += g.lags;
        let lived = g.ended_ms.unwrap_or(u64::MAX).saturating_sub(g.started_ms);
        let bound = p.start_bound_s * 1000;
        if lived > bound
            && !g
                .start_signals
                .iter()
                .any(|&s| s.saturating_sub(g.started_ms) <= bound)
        {
            violations.push(format!(
                "process {gi}: the plain subscriber got no start signal within {} s",
                p.start_bound_s
            ));
        }
        for d in &g.disorder {
            violations.push(format!(
                "process {gi}: out of order at the plain subscriber: {d}"
            ));
        }
        for e in &g.errors {
            violations.push(format!("process {gi}: {e}"));
        }
    }

    let reconciles: usize = per_obj.iter().map(Vec::len).sum();
    let max_sweep = sweep_times.iter().copied().fold(0.0, f64::max);
    let mut detail = String::new();
    for n in &notes {
        detail.push_str(&format!("note: {n}\n"));
    }
    for v in violations.iter().take(30) {
        detail.push_str(&format!("violation: {v}\n"));
    }
    if violations.len() > 30 {
        detail.push_str(&format!("... {} violations in all\n", violations.len()));
    }
    detail.push_str(&format!(
        "soak: {} processes, {reconciles} reconciles, {write_errors} failed writes, plain subscriber lagged {lags} times; ticks: {swept} swept (longest {max_sweep:.1} s), {cut} cut by a restart, {failed} not swept within the bound of {:.0} s",
        gens.len(),
        bound_ms / 1000.0
    ));
    let result = format!(
        "RESULT soak_minutes={} objects={} triggers={} lost_triggers={lost} max_trigger_latency_s={:.1} ticks={ticks} ticks_fully_swept={swept} peak_rss_mib={:.1} violations={}",
        p.minutes,
        p.objects,
        writes.len(),
        max_latency_ms as f64 / 1000.0,
        support::mib(peak_hwm_kib),
        violations.len()
    );
    Report { detail, result }
}
