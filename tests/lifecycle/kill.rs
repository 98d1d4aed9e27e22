//! The SIGKILL operation of the lifecycle model: a child process (this binary again) runs
//! the controller on the store and is killed in a relist, a delta relist, a sweep, a prune or
//! a reconcile batch; the store it left is checked before the next run.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::Rng;

use std::os::unix::process::ExitStatusExt;
use std::process::Child;
use std::thread::JoinHandle;

use super::{Change, KillAt, Model, ready_outside};
use crate::app;
use crate::checks::{self, Found, RunChecks};

type Lines = Arc<Mutex<Vec<String>>>;

impl Model {
    /// Stops this process's run, lets a child process run the controller on the store and
    /// SIGKILLs it at `at`; then a new run in this process.
    pub(super) async fn kill(&mut self, step: usize, at: KillAt, change: Change, recreates: usize) {
        if self.rng.random_bool(0.5) {
            self.stop_graceful(step).await;
        } else if let Some(live) = self.live.take() {
            live.task.abort();
            let _ = live.task.await;
        }
        self.close_db().await;
        // The engine frees its file lock a moment after the last handle is dropped: another
        // process opens the store once it is free (as the other crash tests do).
        let dir = self.dir.path().to_path_buf();
        let unlocked = tokio::task::spawn_blocking(move || crate::common::wait_unlocked(&dir));
        if unlocked.await.is_err() {
            let f = Found {
                invariant: "a closed store is unlocked",
                detail: "still locked 10 s after its Db was dropped".into(),
            };
            self.report(step, f);
        }
        self.recreate_some(recreates);
        self.change(change);
        let delta = matches!(at, KillAt::Delta(_) | KillAt::DeltaSynced);
        if delta {
            self.cfg.relist = kube_persist::RelistMode::Delta;
        }
        // Changed while down (so fetched), and twice more once the relist has a snapshot.
        let targets = match at {
            KillAt::DeltaSynced => self.delta_targets(4),
            _ => Vec::new(),
        };
        let mut retouched = targets.is_empty();
        let faults = self.h.faults();
        if matches!(at, KillAt::List | KillAt::Sweep) || delta {
            // The resume gets 410 and relists, slowly; what was deleted meanwhile is swept.
            // (A delta relist fetches the bodies of what changed.)
            let n = if matches!(at, KillAt::Sweep) { 15 } else { 3 };
            let updates = if delta { 12 } else { 4 };
            self.churn(n, updates, n);
            self.h.compact();
            faults.page_delay(Duration::from_millis(40));
        }
        self.run += 1;
        self.run_started_at_step = self.history.len();
        self.restarts += 1;
        let child_run = self.run;
        let from = self.log.lock().unwrap().len();
        let kill = match at {
            KillAt::Sweep => "phase:Sweeping".to_string(),
            KillAt::Prune(ms) => format!("after:{ms}"),
            KillAt::Delta(pages) => format!("delta:{pages}"),
            KillAt::DeltaSynced => "delta-synced".to_string(),
            _ => String::new(),
        };
        self.run_faults();
        let (mut child, lines, readers) = self.spawn_child(child_run, &kill);
        let seen = |p: &str| lines.lock().unwrap().iter().any(|l| l == p);
        let last_phase = || {
            let lines = lines.lock().unwrap();
            lines
                .iter()
                .rev()
                .find(|l| l.starts_with("phase "))
                .cloned()
                .unwrap_or_default()
        };
        let synced_after_listing = || {
            let lines = lines.lock().unwrap();
            let mut phases = lines.iter().filter(|l| l.starts_with("phase "));
            phases.any(|l| l == "phase Listing") && phases.any(|l| l == "phase Synced")
        };
        // A metadata page of a delta relist was read (its snapshot fixed).
        let delta_read = || {
            let lines = lines.lock().unwrap();
            lines.iter().any(|l| {
                l.strip_prefix("delta ")
                    .and_then(|d| d.split(' ').next()?.parse::<u64>().ok())
                    .is_some_and(|pages| pages > 0)
            })
        };
        let deadline = Instant::now() + Duration::from_secs(15);
        let hit = loop {
            let exited = child.try_wait().unwrap().is_some();
            let reconciles = self.log.lock().unwrap()[from..].len();
            let hit = match at {
                KillAt::List => seen("phase Listing").then_some(true),
                // The child kills itself in the sweep, or missed it (too quick to see).
                KillAt::Sweep | KillAt::Delta(_) => {
                    (exited || synced_after_listing()).then_some(exited)
                }
                // It kills itself once its flush is done: not killed from here meanwhile.
                KillAt::DeltaSynced => exited.then(delta_read),
                KillAt::Prune(_) => exited.then(|| {
                    let lines = lines.lock().unwrap();
                    let lens: Vec<u64> = lines
                        .iter()
                        .filter_map(|l| l.strip_prefix("len ")?.parse().ok())
                        .collect();
                    lens.first().is_some_and(|f| lens.iter().any(|l| l < f))
                }),
                KillAt::Reconcile(n) => (reconciles >= n).then_some(true),
            };
            if let Some(hit) = hit {
                break hit;
            }
            if Instant::now() > deadline {
                break false;
            }
            if !retouched && delta_read() {
                retouched = true;
                for _ in 0..2 {
                    targets.iter().for_each(|n| self.touch(n));
                }
            }
            if matches!(at, KillAt::Reconcile(_)) && self.jitter.random_bool(0.05) {
                let name = format!("cm-{}", self.jitter.random_range(0..self.created));
                self.touch(&name);
                // Now and then created again while the child reconciles.
                if self.jitter.random_bool(0.2) {
                    self.jittered(|m| m.recreate(&name));
                }
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        let hit = if matches!(at, KillAt::List) {
            tokio::time::sleep(Duration::from_millis(self.rng.random_range(0..200))).await;
            last_phase() == "phase Listing"
        } else {
            hit
        };
        let at_kill = last_phase();
        let _ = child.kill();
        let status = child.wait().unwrap();
        // Every line the child wrote is read (and its reconciles logged) before the checks.
        let stderr = readers.0.join().unwrap();
        readers.1.join().unwrap();
        if status.signal() != Some(libc::SIGKILL) {
            let f = Found {
                invariant: "the child process runs until it is killed",
                detail: format!(
                    "it exited with {status}; stderr: {stderr}; last lines: {:?}",
                    lines
                        .lock()
                        .unwrap()
                        .iter()
                        .rev()
                        .take(3)
                        .collect::<Vec<_>>()
                ),
            };
            self.report(step, f);
        }
        let kind = format!("{at:?}")
            .split('(')
            .next()
            .unwrap_or_default()
            .to_lowercase();
        let e = self.kills.entry(kind).or_default();
        e.0 += usize::from(hit);
        e.1 += 1;
        let phases: Vec<String> = lines
            .lock()
            .unwrap()
            .iter()
            .filter_map(|l| l.strip_prefix("phase "))
            .map(String::from)
            .collect();
        self.history.push(format!(
            "(child phases {}, killed in {}, target hit {hit})",
            phases.join(">"),
            at_kill.strip_prefix("phase ").unwrap_or_default()
        ));
        let outside = lines
            .lock()
            .unwrap()
            .iter()
            .find_map(|l| l.strip_prefix("ready-outside ")?.parse::<usize>().ok());
        if let Some(n) = outside.filter(|n| *n > 0) {
            self.report(step, ready_outside(n));
        }
        let given: Vec<String> = lines
            .lock()
            .unwrap()
            .iter()
            .filter_map(|l| l.strip_prefix("given-outside "))
            .map(String::from)
            .collect();
        if !given.is_empty() {
            let f = Found {
                invariant: "no consumer of a stream is given an object outside its selection",
                detail: format!("child: {} {:?}", given.len(), &given[..given.len().min(5)]),
            };
            self.report(step, f);
        }
        faults.clear();
        self.check_killed(step).await;
        let mut rc = RunChecks {
            owned_upto: from,
            ..RunChecks::default()
        };
        let cfg = self.cfg.clone();
        for f in checks::owned_only(&self.log, child_run, &cfg, &mut rc) {
            self.report(step, f);
        }
        if self.rng.random_bool(0.5) {
            self.churn(1, 3, 1);
        }
        self.restart(step).await;
    }

    /// This binary again, as the child process of run `run`: the process, its lines other
    /// than reconciles (which go to the log), and the threads reading its stderr (the last
    /// 10 lines) and stdout.
    fn spawn_child(
        &self,
        run: usize,
        kill: &str,
    ) -> (Child, Lines, (JoinHandle<String>, JoinHandle<()>)) {
        use std::io::BufRead;
        let mut child = std::process::Command::new("/proc/self/exe")
            .env(app::CHILD_DIR_ENV, self.dir.path())
            .env(app::CHILD_URL_ENV, self.server.url())
            .env(app::CHILD_CFG_ENV, self.cfg.encode())
            .env(app::CHILD_KILL_ENV, kill)
            .env(crate::common::ENGINE_ENV, self.engine.name())
            .env("RUST_LOG", "off")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn the child process");
        let out = child.stdout.take().unwrap();
        let mut err = child.stderr.take().unwrap();
        let errors = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = std::io::Read::read_to_string(&mut err, &mut text);
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(10)..].join(" | ")
        });
        let lines = Arc::new(Mutex::new(Vec::new()));
        let (sink, other) = (self.sink(run), lines.clone());
        let output = std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                let seen = [app::Seen::Reconciled, app::Seen::Wrote]
                    .into_iter()
                    .find_map(|seen| {
                        let rest = line.strip_prefix(seen.word())?.strip_prefix(' ')?;
                        Some((seen, app::decode_meta(rest)?))
                    });
                match seen {
                    Some((seen, meta)) => sink(seen, &meta),
                    _ => other.lock().unwrap().push(line),
                }
            }
        });
        (child, lines, (errors, output))
    }
}
