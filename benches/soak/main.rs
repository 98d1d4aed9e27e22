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
//!   It runs with `MALLOC_ARENA_MAX=2`, as deploy/'s StatefulSets run the example operator
//!   (`SOAK_MALLOC_ARENA_MAX` overrides it: with glibc's default of 8 arenas per core, each
//!   thread that allocates keeps freed memory in an arena of its own, and the process's RSS
//!   grew to three times its live heap; see BENCHMARKS.md, *Soak*).
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
//!   reconcile of that object, by any process, that saw that resourceVersion or a newer one
//!   (compared with [`kube_persist::resource_version`] only). `lost_triggers`: writes with
//!   no such reconcile by the end. A write's *change latency* is the time from its response
//!   to the end of the first such reconcile (downtime across a restart included):
//!   `max_trigger_latency_s`, `change_latency_p50_s` and `change_latency_p99_s` over all
//!   writes, `steady_latency_p99_s` over the writes made while a process was alive and more
//!   than 30 s after it started (the target is 10 s). A latency beyond
//!   `SOAK_TRIGGER_BOUND_S` (60 s) is a violation.
//! - **Ticks**: passes are durable (a restart, graceful or SIGKILL, resumes the pass where it
//!   stopped, and ticks that come during a pass are coalesced into one more pass after it),
//!   so a tick at time T (when a process took it from its tick stream) is *swept* when every
//!   object has a reconcile, by any process, that started at or after T and ended by
//!   T + the tick's bound; `pass_p99_s` is the p99, over the swept ticks, of the time from
//!   the tick to the moment every object had such a reconcile (the end of the pass that
//!   covers it). The bound: a tick is covered at the latest by the end of the pass running
//!   at T plus one more pass, and pass work gets at least one dispatch of every 4 while
//!   changes wait, so a pass goes at least at the floor rate max(capacity / 4,
//!   capacity − churn), capacity = concurrency / mean reconcile time (27.5 ms): with the
//!   defaults max(73, 91) = 91 objects/s. The bound is 1.2 × 2 × objects / floor + 10 s
//!   (537 s with the defaults) or `SOAK_SWEEP_BOUND_S` in place of that, plus 15 s per
//!   restart that falls in [T, T + bound). A tick whose bound has not run out when the last
//!   process ends is *open*: neither swept nor a failure, counted apart (`soak:` line). A
//!   tick neither swept nor open is a violation, whatever restarts came meanwhile. `ticks`
//!   counts every tick, `ticks_fully_swept` the swept ones.
//! - **Violations** (each counted): two reconciles of one object overlapping in time in
//!   one process; a reconcile that saw an older resourceVersion of an object than an
//!   earlier one; an error item of the controller's stream; a graceful stop that did not
//!   exit 0 within 30 s; a process that lived `SOAK_START_BOUND_S` (60 s) without its plain
//!   subscriber getting a start signal (`InitDone` or `Resumed`); an object whose events
//!   reached the plain subscriber out of resourceVersion order; a trigger later than its
//!   bound; a tick not swept within its bound and not open.
//! - **Memory**: `peak_rss_mib` is the highest VmHWM of the controller processes (the
//!   testkit's memory is its own process's); the target is 64 MiB.
//!
//! - **Heap** (opt-in, a measurement, no invariant): with `SOAK_HEAP=1` each controller
//!   process prints to stderr, every 10 s, its VmRSS, the live bytes its Rust code has
//!   allocated (a counting global allocator) and glibc's view of its heap (`mallinfo2`:
//!   bytes in use, free bytes kept in its arenas, mmapped bytes, arena bytes), so the growth
//!   of RSS can be told apart as live data or the allocator's fragmentation.
//!   `SOAK_CHILD_WRAPPER=<program>` starts each controller process as `<program> <exe>
//!   <args>` (the program must `exec` it, so that the driver's signals and `/proc/<pid>`
//!   reach the controller): e.g. a script that preloads heaptrack for that process only.
//!
//! Last line: `RESULT soak_minutes=.. objects=.. triggers=.. lost_triggers=..
//! max_trigger_latency_s=.. ticks=.. ticks_fully_swept=.. peak_rss_mib=.. violations=..
//! change_latency_p50_s=.. change_latency_p99_s=.. steady_latency_p99_s=.. pass_p99_s=..`
//! (a percentile with no value to take it over reads `NaN`).

#[path = "../support/mod.rs"]
mod support;

mod check;
mod child;
mod driver;
mod logs;

use std::time::{SystemTime, UNIX_EPOCH};

use child::{MEAN_RECONCILE_MS, child_main};
use driver::drive;

/// The soak's parameters: the spec's defaults, each overridable by its environment variable.
#[derive(Debug, Clone)]
pub(crate) struct Params {
    pub(crate) minutes: f64,
    pub(crate) objects: usize,
    pub(crate) rate: u64,
    pub(crate) tick_s: u64,
    pub(crate) restart_s: u64,
    pub(crate) concurrency: u16,
    pub(crate) slow_ms: u64,
    pub(crate) buffer: usize,
    pub(crate) seed: u64,
    pub(crate) drain_s: u64,
    pub(crate) trigger_bound_s: f64,
    sweep_bound_s: Option<f64>,
    pub(crate) start_bound_s: u64,
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
    pub(crate) fn from_env() -> Self {
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

    /// The rate a pass goes at, at least: the reconcile capacity (concurrency / mean
    /// reconcile time) less the churn, and never less than the share of the capacity pass
    /// work is guaranteed ([`PASS_SHARE`]); objects/s.
    pub(crate) fn pass_rate_floor(&self) -> f64 {
        let capacity = f64::from(self.concurrency) / (MEAN_RECONCILE_MS / 1000.0);
        (capacity * PASS_SHARE).max(capacity - self.rate as f64)
    }

    /// A tick's bound without its restarts: `SOAK_SWEEP_BOUND_S`, or 1.2 × two passes at the
    /// floor rate + 10 s (the pass running at the tick, then the one that covers it).
    pub(crate) fn sweep_bound_s(&self) -> f64 {
        self.sweep_bound_s
            .unwrap_or_else(|| 1.2 * 2.0 * self.objects as f64 / self.pass_rate_floor() + 10.0)
    }

    /// The bound of a tick at `t` (unix ms), in ms: [`Params::sweep_bound_s`] +
    /// [`RESTART_ALLOWANCE_S`] per restart (a process start, unix ms, in `restarts`) that
    /// falls in `[t, t + bound)`.
    pub(crate) fn tick_bound_ms(&self, t: u64, restarts: &[u64]) -> f64 {
        let base = self.sweep_bound_s() * 1000.0;
        let mut bound = base;
        loop {
            let n = restarts
                .iter()
                .filter(|&&r| r >= t && ((r - t) as f64) < bound)
                .count();
            let next = base + n as f64 * RESTART_ALLOWANCE_S * 1000.0;
            if next <= bound {
                return bound;
            }
            bound = next;
        }
    }
}

/// The share of the reconcile capacity that pass work is guaranteed while changes wait (one
/// dispatch of every 4).
const PASS_SHARE: f64 = 0.25;

/// What a tick's bound grows by per restart within it.
const RESTART_ALLOWANCE_S: f64 = 15.0;

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn main() {
    if std::env::args().any(|a| a == "--soak-child") {
        child_main();
        return;
    }
    let p = Params::from_env();
    eprintln!(
        "soak parameters: {p:?}; tick bound {:.0} s + {RESTART_ALLOWANCE_S} s per restart (pass rate at least {:.0} objects/s)",
        p.sweep_bound_s(),
        p.pass_rate_floor()
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
