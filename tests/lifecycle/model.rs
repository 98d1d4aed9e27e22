//! The lifecycle model: random operations on the server, the store and the controller's
//! process, each followed by the invariant checks of `checks.rs`.
//!
//! Over 600 lines: the draw of the operations, their dispatch and a run's life (open, stop,
//! the checks at quiescence) share the model's state; each family of operations lives in a
//! submodule of its own (`beside`, `delta`, `kill`, `poke`, `storm`, `writes`).

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::Api;
use kube_persist::{Db, Engine, Reader};
use kube_persist_testkit::{ResourceType, ServerHandle, ServerOptions, TestServer};
use rand::{Rng, SeedableRng, rngs::StdRng};
use serde_json::json;
use tokio::task::JoinHandle;

use crate::app::{self, NS, RunCfg};
use crate::checks::{self, Found, Log, Rec, RunChecks, Trig};

mod beside;
mod delta;
mod kill;
mod poke;
mod storm;
mod writes;

use poke::Poke;

const OBJECTS: usize = 100;
const BUSY_PODS: usize = 300;

/// A change of configuration between two runs.
#[derive(Debug, Clone, Copy)]
enum Change {
    Nothing,
    Streaming,
    Narrow,
    Widen,
    Index,
    Page,
    /// Another durability for the next `Db` opened.
    Durability,
}

/// Where a child process is SIGKILLed.
#[derive(Debug, Clone, Copy)]
enum KillAt {
    /// While a relist (after a 410 on resume, pages slowed) is in `Listing`.
    List,
    /// Once `Sweeping` is seen (or `Synced`, if the sweep was too quick to see).
    Sweep,
    /// `ms` after start, with the shard narrowed: during or right after the prune.
    Prune(u64),
    /// After this many reconciles of the child.
    Reconcile(usize),
    /// In a delta relist (after a 410 on resume, pages slowed, objects changed while
    /// down), once this many metadata pages were read: their bodies being fetched.
    Delta(u64),
    /// As soon as a delta relist is `Synced`, objects it fetches having changed again after
    /// its snapshot: the bodies it fetched may be newer than its checkpoint.
    DeltaSynced,
}

#[derive(Debug, Clone)]
enum Op {
    Churn {
        creates: usize,
        updates: usize,
        deletes: usize,
    },
    /// Compaction and the watches cut: the reconnect gets 410 and relists.
    Compact,
    /// The next watch answers 410 at once, the watches cut.
    Gone,
    /// The next watch fails with an ERROR event after some events.
    WatchError(usize),
    /// The API server restarts, down for `ms`.
    ServerRestart(u64),
    /// A graceful stop and a new run (optionally in a new `Db`, with the server compacted
    /// and changed while down).
    Stop {
        new_db: bool,
        change: Change,
        compact: bool,
        churn: bool,
    },
    /// A burst, then the controller's task aborted and a new run started at once, same `Db`.
    AbortReopen { burst: usize },
    /// A child process runs the controller on the store and is SIGKILLed; then a new run.
    Kill { at: KillAt, change: Change },
    /// An object written, then read back through the live store after
    /// `wait_for_resource_version` (read your writes).
    WriteRead,
    /// A trigger sent to the live run.
    Poke(Poke),
    /// A read-only handle opened beside the live run (the `kube-persist` tool's), and a
    /// verify through it.
    ReadBeside,
    /// A relist of the live store while this many objects change under it (`delta.rs`).
    RelistUnder(usize),
    /// A tick's pass under a storm of changes, this many kept waiting, its objects drawn
    /// from `seed` (`storm.rs`).
    ChangeStorm { outstanding: usize, seed: u64 },
}

struct Live {
    reader: Reader<ConfigMap>,
    requests:
        futures::channel::mpsc::UnboundedSender<kube::runtime::reflector::ObjectRef<ConfigMap>>,
    ticks: futures::channel::mpsc::UnboundedSender<()>,
    stats: kube_persist::controller::ControllerStats,
    task: JoinHandle<()>,
    stop: tokio::sync::oneshot::Sender<()>,
    /// Objects outside the shard when the store first reported ready.
    outside_at_ready: Option<JoinHandle<Option<usize>>>,
    /// What the run's reads gave, for the delta invariants.
    view: delta::RunView,
    /// What the shared stream's other consumers saw.
    consumed: Arc<app::Consumed>,
    started: Instant,
}

/// What one engine's run found.
pub struct Outcome {
    pub steps: usize,
    pub restarts: usize,
    pub violations: usize,
    pub kills: String,
}

pub struct Model {
    engine: Engine,
    seed: u64,
    /// Draws the operations: consumed the same way whatever the timing.
    rng: StdRng,
    /// Draws whose number depends on timing (churn while waiting for a child).
    jitter: StdRng,
    server: TestServer,
    h: ServerHandle,
    dir: tempfile::TempDir,
    log: Log,
    cfg: RunCfg,
    run: usize,
    step: usize,
    db: Option<(Db, JoinHandle<()>)>,
    live: Option<Live>,
    rc: RunChecks,
    created: usize,
    restarts: usize,
    history: Vec<String>,
    run_started_at_step: usize,
    violations: usize,
    reported: HashSet<(usize, &'static str)>,
    kills: BTreeMap<String, (usize, usize)>,
    /// Triggers sent to the live run and not checked yet.
    triggers: Vec<Trig>,
    /// When the last churn of a live store ended, and the server's version then.
    churned: Option<(Instant, String)>,
    /// What the delta operations and checks found.
    delta: delta::Tally,
}

fn cm(name: &str, mode: &str, value: &str) -> serde_json::Value {
    json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": NS, "labels": {"mode": mode}},
        "data": {"value": value},
    })
}

impl Model {
    /// Runs `steps` operations on `engine` from the test's `seed` (each engine draws its own
    /// sequence from it).
    pub async fn run(engine: Engine, seed: u64, steps: usize) -> Outcome {
        let own = seed.wrapping_add(if engine == Engine::Redb { 0 } else { 1 });
        let server = TestServer::start_with(ServerOptions {
            bookmark_interval: Duration::from_millis(100),
            ..ServerOptions::default()
        })
        .await;
        let h = server.handle();
        h.seed_pods(BUSY_PODS, 3);
        let mut m = Model {
            engine,
            seed,
            rng: StdRng::seed_from_u64(own),
            jitter: StdRng::seed_from_u64(!own),
            server,
            h,
            dir: tempfile::tempdir().unwrap(),
            log: Arc::default(),
            cfg: RunCfg {
                streaming: false,
                shard: None,
                index: false,
                page: 20,
                flush_ms: 100,
                relist: kube_persist::RelistMode::Auto,
            },
            run: 0,
            step: 0,
            db: None,
            live: None,
            rc: RunChecks::default(),
            created: 0,
            restarts: 0,
            history: Vec::new(),
            run_started_at_step: 0,
            violations: 0,
            reported: HashSet::new(),
            kills: BTreeMap::new(),
            triggers: Vec::new(),
            churned: None,
            delta: delta::Tally::default(),
        };
        for _ in 0..OBJECTS {
            m.create();
        }
        m.start_run().await;
        m.check(0).await;
        let mut slowest = (Duration::ZERO, 0);
        for step in 1..=steps {
            m.step = step;
            let op = m.pick(steps - step);
            m.history.push(format!("{step}:{op:?}"));
            let started = Instant::now();
            m.apply(step, op).await;
            m.check(step).await;
            slowest = slowest.max((started.elapsed(), step));
        }
        if let Some(live) = m.live.take() {
            live.task.abort();
            let _ = live.task.await;
        }
        m.close_db().await;
        let kills = m
            .kills
            .iter()
            .map(|(k, (hit, n))| format!("{k} {hit}/{n}"))
            .collect::<Vec<_>>()
            .join(", ");
        let kills = format!(
            "{kills}; slowest step {} ({:.1} s); {}",
            slowest.1,
            slowest.0.as_secs_f64(),
            m.delta
        );
        if m.violations > 0 || std::env::var_os("KP_LIFECYCLE_HISTORY").is_some() {
            println!("history ({engine}, seed {seed}): {}", m.history.join(" "));
        }
        Outcome {
            steps,
            restarts: m.restarts,
            violations: m.violations,
            kills,
        }
    }

    fn pick(&mut self, left: usize) -> Op {
        let r = &mut self.rng;
        // Enough restarts whatever the draw: at least one in every five steps.
        let restart = left.is_multiple_of(5) || r.random_bool(0.15);
        let change = |r: &mut StdRng| match r.random_range(0..9) {
            0 => Change::Streaming,
            1 | 2 => Change::Narrow,
            3 => Change::Widen,
            4 => Change::Index,
            5 => Change::Page,
            6 => Change::Durability,
            _ => Change::Nothing,
        };
        if restart {
            return match r.random_range(0..10) {
                0..=2 => Op::Stop {
                    new_db: r.random_bool(0.5),
                    change: change(r),
                    compact: r.random_bool(0.4),
                    churn: r.random_bool(0.5),
                },
                3 | 4 => Op::AbortReopen {
                    burst: r.random_range(5..40),
                },
                _ => {
                    let at = match r.random_range(0..6) {
                        0 => KillAt::List,
                        1 => KillAt::Sweep,
                        2 => KillAt::Prune(r.random_range(0..40)),
                        3 => KillAt::Delta(r.random_range(1..3)),
                        4 => KillAt::DeltaSynced,
                        _ => KillAt::Reconcile(r.random_range(1..40)),
                    };
                    let change = if matches!(at, KillAt::Prune(_)) {
                        Change::Narrow
                    } else {
                        change(r)
                    };
                    Op::Kill { at, change }
                }
            };
        }
        match r.random_range(0..17) {
            16 => Op::ChangeStorm {
                outstanding: r.random_range(6..13),
                seed: r.random(),
            },
            15 => Op::RelistUnder(r.random_range(2..6)),
            14 => Op::ReadBeside,
            11..=13 => Op::Poke(Poke::draw(r)),
            0..=4 => Op::Churn {
                creates: r.random_range(0..6),
                updates: r.random_range(0..10),
                deletes: r.random_range(0..6),
            },
            5 => Op::Compact,
            6 => Op::Gone,
            7 => Op::WatchError(r.random_range(0..5)),
            8 => Op::WriteRead,
            _ => Op::ServerRestart(r.random_range(10..300)),
        }
    }

    async fn apply(&mut self, step: usize, op: Op) {
        let faults = self.h.faults();
        match op {
            Op::Churn {
                creates,
                updates,
                deletes,
            } => {
                // Timed from a store that is live at the watch's head: no relist to wait for.
                let live = self.live.as_ref().is_some_and(|l| {
                    l.reader.phase() == kube_persist::SyncPhase::Synced && l.reader.is_live()
                });
                self.churn(creates, updates, deletes);
                if live {
                    self.churned = Some((Instant::now(), self.h.resource_version()));
                }
            }
            Op::Compact => {
                self.h.compact();
                faults.close_watches();
            }
            Op::Gone => {
                faults.gone_next_watch();
                faults.close_watches();
            }
            Op::WatchError(n) => {
                faults.error_watch_after(n);
                self.churn(0, n + 1, 0);
                faults.close_watches();
            }
            Op::WriteRead => self.write_read(step).await,
            Op::ReadBeside => self.read_beside(step).await,
            Op::RelistUnder(n) => self.relist_under(n).await,
            Op::Poke(poke) => self.poke(poke).await,
            Op::ChangeStorm { outstanding, seed } => {
                self.change_storm(step, outstanding, seed).await
            }
            Op::ServerRestart(ms) => {
                self.churn(0, 2, 0);
                self.server
                    .restart(Duration::from_millis(ms))
                    .await
                    .expect("rebind");
            }
            Op::Stop {
                new_db,
                change,
                compact,
                churn,
            } => {
                self.stop_graceful(step).await;
                if new_db {
                    self.close_db().await;
                }
                if compact {
                    self.churn(0, 3, 1);
                    self.h.compact();
                }
                if churn {
                    self.churn(2, 5, 2);
                }
                self.change(change);
                self.restart(step).await;
            }
            Op::AbortReopen { burst } => {
                let live = self.live.take().expect("a run");
                // The other stream's burst keeps the disk thread busy while this stream's
                // batches queue behind it; the task is aborted as soon as the first of them
                // was applied.
                let applied = live.reader.stats().watch_events;
                for _ in 0..2 {
                    self.h.churn(BUSY_PODS, 0, 0, self.rng.random());
                }
                self.churn(burst / 4, burst, burst / 4);
                let deadline = Instant::now() + Duration::from_secs(2);
                while live.reader.stats().watch_events == applied && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                live.task.abort();
                let _ = live.task.await;
                self.restart(step).await;
            }
            Op::Kill { at, change } => self.kill(step, at, change).await,
        }
    }

    fn create(&mut self) {
        let mode = match self.rng.random_range(0..100) {
            0..=11 => "short",
            12..=19 => "fail",
            20..=27 => "slow",
            28..=35 => "write",
            _ => "ok",
        };
        let name = format!("cm-{}", self.created);
        self.created += 1;
        self.h
            .apply(&ResourceType::configmaps(), cm(&name, mode, "v0"));
    }

    /// A new version of `name`, if it exists.
    fn touch(&mut self, name: &str) {
        let rt = ResourceType::configmaps();
        if let Some(mut o) = self.h.get(&rt, Some(NS), name) {
            o["data"]["value"] = json!(format!("v{}", self.jitter.random::<u32>()));
            self.h.apply(&rt, o);
        }
    }

    fn churn(&mut self, creates: usize, updates: usize, deletes: usize) {
        let rt = ResourceType::configmaps();
        for _ in 0..creates {
            self.create();
        }
        let mut names: Vec<String> = checks::server_objects(&self.h).into_keys().collect();
        for _ in 0..updates.min(names.len()) {
            let name = &names[self.rng.random_range(0..names.len())];
            if let Some(mut o) = self.h.get(&rt, Some(NS), name) {
                o["data"]["value"] = json!(format!("v{}", self.rng.random::<u32>()));
                self.h.apply(&rt, o);
            }
        }
        for _ in 0..deletes.min(names.len()) {
            let name = names.swap_remove(self.rng.random_range(0..names.len()));
            self.h.delete(&rt, Some(NS), &name);
        }
    }

    fn change(&mut self, change: Change) {
        // Every reopen lists again (after a 410) in a mode of its own.
        self.cfg.relist = delta::draw_mode(&mut self.rng);
        let cfg = &mut self.cfg;
        match change {
            Change::Nothing => {}
            Change::Streaming => cfg.streaming = !cfg.streaming,
            Change::Narrow => {
                cfg.shard = match cfg.shard {
                    None => Some((self.rng.random_range(0..2), 2)),
                    Some((i, 2)) => Some((2 * i + self.rng.random_range(0..2), 4)),
                    other => other,
                }
            }
            Change::Widen => cfg.shard = None,
            Change::Index => cfg.index = !cfg.index,
            Change::Page => cfg.page = self.rng.random_range(5..60),
            Change::Durability => {
                cfg.flush_ms = [0, 20, 100, 500][self.rng.random_range(0..4)];
            }
        }
    }

    fn report(&mut self, step: usize, f: Found) {
        if !self.reported.insert((self.run, f.invariant)) {
            return;
        }
        self.violations += 1;
        let ops = &self.history[self
            .run_started_at_step
            .saturating_sub(1)
            .min(self.history.len())..];
        println!(
            "VIOLATION KP_LIFECYCLE_SEED={} engine {} step {step} run {} ({:?}): {}: {}\n  ops since the run started: {}",
            self.seed,
            self.engine,
            self.run,
            self.cfg,
            f.invariant,
            f.detail,
            ops.join(" ")
        );
    }

    fn sink(&self, run: usize) -> app::Sink {
        let log = self.log.clone();
        Arc::new(move |seen, name, rv, uid| {
            let mut log = log.lock().unwrap();
            let rec = Rec {
                seen,
                at: Instant::now(),
                run,
                name: name.into(),
                rv: rv.into(),
                uid: uid.into(),
            };
            log.push(rec);
        })
    }

    async fn open_db(&mut self) -> &Db {
        if self.db.is_none() {
            let db = self
                .cfg
                .open_db(self.engine, self.dir.path())
                .expect("open the store");
            // A second stream on the same Db, so that the disk thread has other work queued.
            let api = Api::<Pod>::all(self.server.client());
            let (_, watcher) = db
                .store("busy", api, kube_persist::StreamConfig::default())
                .unwrap();
            self.db = Some((db, tokio::spawn(watcher.run())));
        }
        &self.db.as_ref().unwrap().0
    }

    async fn close_db(&mut self) {
        if let Some((db, busy)) = self.db.take() {
            busy.abort();
            let _ = busy.await;
            db.flush().unwrap();
        }
    }

    /// A new run of the controller in this process, at once.
    async fn start_run(&mut self) {
        self.run += 1;
        self.run_started_at_step = self.history.len();
        self.rc = RunChecks {
            owned_upto: self.log.lock().unwrap().len(),
            ..RunChecks::default()
        };
        // Requests queued in a run that stopped are lost with it, as in kube-runtime.
        self.triggers.clear();
        self.churned = None;
        let client = self.server.client();
        let (cfg, sink) = (self.cfg.clone(), self.sink(self.run));
        self.open_db().await;
        let db = &self.db.as_ref().expect("open").0;
        let mut refused = None;
        let deadline = Instant::now() + Duration::from_secs(10);
        let (requests, requests_rx) = futures::channel::mpsc::unbounded();
        let (ticks, ticks_rx) = futures::channel::mpsc::unbounded();
        let mut inputs = Some(app::Inputs {
            requests: requests_rx.boxed(),
            ticks: ticks_rx.boxed(),
        });
        let c = loop {
            let i = inputs.take().unwrap_or_else(app::Inputs::none);
            match app::controller(db, client.clone(), &cfg, i) {
                Ok(c) => break c,
                Err(e) if Instant::now() < deadline => {
                    refused.get_or_insert(e.to_string());
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(e) => panic!("the controller does not open: {e}"),
            }
        };
        if let Some(e) = refused {
            self.report(
                self.step,
                Found {
                    invariant: "a stream and controller reopen in the same Db at once",
                    detail: format!("refused at first (then opened on a retry): {e}"),
                },
            );
        }
        let reader = c.0.reader();
        let stats = c.0.stats();
        let consumed = Arc::new(app::Consumed::default());
        let view = delta::RunView::open(&reader, &consumed);
        self.history.push(format!(
            "(run {} opens {:?}, ready {})",
            self.run,
            reader.phase(),
            reader.is_ready()
        ));
        let outside = tokio::spawn(app::outside_at_ready(reader.clone(), cfg));
        let (stop, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(app::run(c, client, sink, consumed.clone(), async move {
            let _ = rx.await;
        }));
        self.live = Some(Live {
            reader,
            requests,
            ticks,
            stats,
            task,
            stop,
            outside_at_ready: Some(outside),
            view,
            consumed,
            started: Instant::now(),
        });
    }

    async fn restart(&mut self, _step: usize) {
        self.restarts += 1;
        self.start_run().await;
        // Half the restarts get a trigger at once: during the startup pass or the wait for
        // the store to catch up.
        if self.rng.random_bool(0.5) {
            let poke = Poke::draw(&mut self.rng);
            self.history.push(format!("(at start: {poke:?})"));
            self.poke(poke).await;
        }
    }

    async fn stop_graceful(&mut self, step: usize) {
        let live = self.live.take().expect("a run");
        let _ = live.stop.send(());
        let mut task = live.task;
        if tokio::time::timeout(Duration::from_secs(20), &mut task)
            .await
            .is_err()
        {
            self.report(
                step,
                Found {
                    invariant: "a graceful stop finishes",
                    detail: "the controller still ran 20 s after its shutdown signal".into(),
                },
            );
            task.abort();
            let _ = task.await;
        }
    }

    /// The invariants, once the server is quiescent (nothing changes it during the check).
    async fn check(&mut self, step: usize) {
        let Some(live) = &mut self.live else { return };
        let reader = live.reader.clone();
        let consumed = live.consumed.clone();
        let run_started = live.started;
        let at_ready = match live.outside_at_ready.take_if(|t| t.is_finished()) {
            Some(t) => t.await.ok().flatten(),
            None => None,
        };
        if let Some(n) = at_ready.filter(|n| *n > 0) {
            self.report(step, ready_outside(n));
        }
        if let Some((at, rv)) = self.churned.take()
            && let Some(f) = checks::watch_not_held(&reader, at, &rv).await
        {
            self.report(step, f);
        }
        let cfg = self.cfg.clone();
        match self.quiesce(&reader, &cfg).await {
            Err(f) => self.report(step, f),
            Ok(()) => {
                let since = Instant::now();
                let server = checks::server_objects(&self.h);
                for f in checks::store_matches(&reader, &cfg, &server) {
                    self.report(step, f);
                }
                for f in checks::async_reads_match(&reader).await {
                    self.report(step, f);
                }
                let log = self.log.clone();
                let mut rc = std::mem::take(&mut self.rc);
                let found = checks::reconciled(&log, &cfg, &server, since, &mut rc).await;
                self.rc = rc;
                for f in found {
                    self.report(step, f);
                }
                let mut triggers = std::mem::take(&mut self.triggers);
                for f in checks::triggered(&log, &cfg, &server, &mut triggers).await {
                    self.report(step, f);
                }
                if let Some((db, _)) = self.db.as_ref() {
                    for f in checks::records(db, &reader).await {
                        self.report(step, f);
                    }
                }
                if let Some(f) = checks::consumers_started(&consumed, run_started).await {
                    self.report(step, f);
                }
                self.check_delta(step);
            }
        }
        let mut rc = std::mem::take(&mut self.rc);
        let found = checks::owned_only(&self.log, self.run, &cfg, &mut rc);
        self.rc = rc;
        for f in found {
            self.report(step, f);
        }
    }
}

fn ready_outside(n: usize) -> Found {
    Found {
        invariant: "a ready store holds nothing outside its shard",
        detail: format!("{n} objects outside the shard when the store first reported ready"),
    }
}
