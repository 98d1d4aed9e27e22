//! The driver: starts the controller process, writes the churn through the testkit's API,
//! restarts the controller on schedule (SIGTERM, once SIGKILL), samples its memory, tails its
//! logs, drains, and hands everything to [`crate::check::check`].

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams};
use kube_persist::resource_version;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::check::{Report, check};
use crate::logs::Gen;
use crate::support;
use crate::{Params, now_ms};

/// How long a SIGTERMed controller may take to exit.
const GRACE: Duration = Duration::from_secs(30);

/// One write of the driver: the object, the version the server returned, when.
pub(crate) struct Written {
    pub(crate) obj: usize,
    pub(crate) rv: String,
    pub(crate) at_ms: u64,
}

/// The controller child process.
struct ControllerProc {
    child: Child,
}

impl ControllerProc {
    fn start(url: &str, dir: &Path, log: &Path) -> Self {
        let exe = std::env::current_exe().expect("current exe");
        // `SOAK_CHILD_WRAPPER`: a program that execs its arguments (see the bench's doc).
        let mut cmd = match std::env::var_os("SOAK_CHILD_WRAPPER") {
            Some(wrapper) => {
                let mut cmd = Command::new(wrapper);
                cmd.arg(exe);
                cmd
            }
            None => Command::new(exe),
        };
        let child = cmd
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
            // As deploy/ runs the controller (`SOAK_MALLOC_ARENA_MAX` overrides it).
            .env(
                "MALLOC_ARENA_MAX",
                std::env::var("SOAK_MALLOC_ARENA_MAX").unwrap_or_else(|_| "2".into()),
            )
            .stdout(Stdio::null())
            .spawn()
            .expect("start the controller process");
        ControllerProc { child }
    }

    /// (VmHWM, VmRSS) in KiB.
    fn rss_kib(&self) -> (u64, u64) {
        support::rss_kib_at(&format!("/proc/{}/status", self.child.id()))
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

pub(crate) async fn drive(p: &Params, url: &str, dir: &Path) -> Report {
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
