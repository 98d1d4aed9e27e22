//! The lifecycle model: random operations on the server, the store and the controller's
//! process, each followed by the invariant checks of `checks.rs`.
//!
//! Here: the model's state, the draw of the operations and their dispatch; a run's life
//! (open, stop, the checks at quiescence) is `life.rs`'s, and each family of operations
//! lives in a submodule of its own (`beside`, `churn`, `delta`, `kill`, `life`, `poke`, `recreate`,
//! `side`, `storm`, `writes`).

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ConfigMap;
use kube_persist::{Db, Engine, Reader};
use kube_persist_testkit::{ServerHandle, ServerOptions, TestServer};
use rand::{Rng, SeedableRng, rngs::StdRng};
use tokio::task::JoinHandle;

use crate::app::{self, RunCfg};
use crate::checks::{Found, Log, RunChecks, Trig};
use crate::select::{Fields, Labels, Sel};

mod beside;
mod churn;
mod delta;
mod kill;
mod life;
mod poke;
mod recreate;
mod side;
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
    /// Another label selector (the store is wiped: another identity).
    Labels,
    /// Another field selector (idem).
    Fields,
    /// The transform on or off (idem).
    Transform,
    /// kube's retry layer on or off in the stream's client.
    Retry,
    /// Every delta fetch refused (403) for the next run, or no longer.
    Refuse,
    /// The stream's list pages held until their next page is asked for, or no longer.
    Hold,
    /// Another configuration of the side stream (`side.rs`).
    Side,
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
        /// Objects moved to another tier (in or out of a label selection).
        moves: usize,
        /// Objects deleted and created again under the same name (another uid: maybe
        /// another shard, another mode).
        recreates: usize,
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
    /// `recreates` objects deleted and created again while it is down; `tick`: the stop
    /// comes in the middle of a tick's pass (`recreate.rs`), for every restart.
    Stop {
        new_db: bool,
        change: Change,
        compact: bool,
        churn: bool,
        recreates: usize,
        tick: bool,
    },
    /// A burst (recreates too), then the controller's task aborted and a new run started at
    /// once, same `Db`.
    AbortReopen { burst: usize, tick: bool },
    /// A child process runs the controller on the store and is SIGKILLed; then a new run.
    /// `recreates` objects created again while the store is down (before the child).
    Kill {
        at: KillAt,
        change: Change,
        recreates: usize,
        tick: bool,
    },
    /// An object deleted (and created again) while its own reconcile runs (`recreate.rs`).
    Busy(recreate::Busy),
    /// An object written, then read back through the live store after
    /// `wait_for_resource_version` (read your writes).
    WriteRead,
    /// A trigger sent to the live run.
    Poke(Poke),
    /// A read-only handle opened beside the live run (the `kube-persist` tool's), and a
    /// verify through it.
    ReadBeside,
    /// A relist of the live store while objects change under it, between their metadata
    /// page and their fetch, with a fault on the fetches (`delta.rs`).
    RelistUnder(delta::Under),
    /// A tick's pass under a storm of changes, this many kept waiting, its objects drawn
    /// from `seed` (`storm.rs`).
    ChangeStorm { outstanding: usize, seed: u64 },
}

impl Op {
    /// What the summary's timing calls it.
    fn kind(&self) -> &'static str {
        match self {
            Op::Churn { .. } => "churn",
            Op::Compact | Op::Gone | Op::WatchError(_) | Op::ServerRestart(_) => "watch faults",
            Op::Stop { .. } | Op::AbortReopen { .. } => "stops",
            Op::Busy(_) => "recreates while busy",
            Op::Kill { .. } => "kills",
            Op::WriteRead | Op::ReadBeside => "reads",
            Op::Poke(_) => "triggers",
            Op::RelistUnder(_) => "relists under changes",
            Op::ChangeStorm { .. } => "change storms",
        }
    }
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
    /// The side stream of the live run, and its configuration.
    side: Option<side::Side>,
    side_cfg: side::SideCfg,
    /// The server honours `shardSelector` (else every shard is filtered by the store).
    sharded_server: bool,
    /// Where the run's time went: the operations, and each check.
    timing: BTreeMap<&'static str, Duration>,
    /// Relists under changes drawn so far (their faults come in turn).
    unders: usize,
    /// Side streams opened, by kind.
    side_opened: BTreeMap<&'static str, usize>,
    /// The runs whose stream's list pages the server held (`RunCfg::hold`).
    held_runs: std::collections::BTreeSet<usize>,
}

impl Model {
    /// Runs `steps` operations on `engine` from the test's `seed` (each engine draws its own
    /// sequence from it).
    pub async fn run(engine: Engine, seed: u64, steps: usize) -> Outcome {
        let own = seed.wrapping_add(if engine == Engine::Redb { 0 } else { 1 });
        // One engine's server filters shards, the other's leaves it to the store (which
        // engine, the seed says): every run covers both.
        let sharded_server = (engine == Engine::Redb) == seed.is_multiple_of(2);
        let server = TestServer::start_with(ServerOptions {
            bookmark_interval: Duration::from_millis(100),
            sharded_list_and_watch: sharded_server,
            ..ServerOptions::default()
        })
        .await;
        let mut rng = StdRng::seed_from_u64(own);
        let side_cfg = side::SideCfg::draw(&mut rng, OBJECTS);
        let encrypt = rng.random_bool(0.5);
        let h = server.handle();
        h.seed_pods(BUSY_PODS, 3);
        let mut m = Model {
            engine,
            seed,
            rng,
            jitter: StdRng::seed_from_u64(!own),
            server,
            h,
            dir: tempfile::tempdir().unwrap(),
            log: Arc::default(),
            cfg: RunCfg {
                streaming: false,
                sel: Sel::ALL,
                index: false,
                page: 20,
                flush_ms: 100,
                relist: kube_persist::RelistMode::Auto,
                transform: false,
                encrypt,
                retry: true,
                refuse: false,
                hold: false,
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
            side: None,
            side_cfg,
            sharded_server,
            timing: BTreeMap::new(),
            unders: 0,
            side_opened: BTreeMap::new(),
            held_runs: Default::default(),
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
            let kind = op.kind();
            m.apply(step, op).await;
            m.timed(kind, started);
            m.check(step).await;
            slowest = slowest.max((started.elapsed(), step));
        }
        if let Some(live) = m.live.take() {
            live.task.abort();
            let _ = live.task.await;
        }
        m.close_db().await;
        m.h.faults().clear();
        let kills = m
            .kills
            .iter()
            .map(|(k, (hit, n))| format!("{k} {hit}/{n}"))
            .collect::<Vec<_>>()
            .join(", ");
        let timing: Vec<String> = m
            .timing
            .iter()
            .map(|(k, d)| format!("{k} {:.0} s", d.as_secs_f64()))
            .collect();
        let encrypted = if m.cfg.encrypt { "" } else { "not " };
        let kills = format!(
            "{kills}; slowest step {} ({:.1} s); {}; shards filtered by the {}; list pages held in {} of {} runs; {encrypted}encrypted; side streams {:?}; time in {}",
            slowest.1,
            slowest.0.as_secs_f64(),
            m.delta,
            if m.sharded_server { "server" } else { "store" },
            m.held_runs.len(),
            m.run,
            m.side_opened,
            timing.join(", ")
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
        let change = |r: &mut StdRng| match r.random_range(0..16) {
            0 => Change::Streaming,
            1 | 2 => Change::Narrow,
            3 => Change::Widen,
            4 => Change::Index,
            5 => Change::Page,
            6 => Change::Durability,
            7 => Change::Labels,
            8 => Change::Fields,
            9 => Change::Transform,
            10 => Change::Retry,
            11 => Change::Refuse,
            12 => Change::Side,
            13 => Change::Hold,
            _ => Change::Nothing,
        };
        if restart {
            return match r.random_range(0..10) {
                0..=2 => Op::Stop {
                    new_db: r.random_bool(0.5),
                    change: change(r),
                    compact: r.random_bool(0.4),
                    churn: r.random_bool(0.5),
                    recreates: r.random_range(0..3),
                    tick: r.random_bool(0.3),
                },
                3 | 4 => Op::AbortReopen {
                    burst: r.random_range(5..40),
                    tick: r.random_bool(0.3),
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
                    Op::Kill {
                        at,
                        change,
                        recreates: r.random_range(0..3),
                        tick: r.random_bool(0.3),
                    }
                }
            };
        }
        match r.random_range(0..18) {
            17 => Op::Busy(recreate::Busy::draw(r)),
            16 => Op::ChangeStorm {
                outstanding: r.random_range(6..13),
                seed: r.random(),
            },
            15 => {
                self.unders += 1;
                Op::RelistUnder(delta::Under::draw(r, self.unders))
            }
            14 => Op::ReadBeside,
            11..=13 => Op::Poke(Poke::draw(r)),
            0..=4 => Op::Churn {
                creates: r.random_range(0..6),
                updates: r.random_range(0..10),
                deletes: r.random_range(0..6),
                moves: r.random_range(0..5),
                recreates: r.random_range(0..3),
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
                moves,
                recreates,
            } => {
                // Timed from a store that is live at the watch's head: no relist to wait for.
                let live = self.live.as_ref().is_some_and(|l| {
                    l.reader.phase() == kube_persist::SyncPhase::Synced && l.reader.is_live()
                });
                self.churn(creates, updates, deletes);
                self.shuffle(moves, recreates);
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
            Op::RelistUnder(under) => self.relist_under(under).await,
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
            Op::Busy(busy) => self.busy(busy).await,
            Op::Stop {
                new_db,
                change,
                compact,
                churn,
                recreates,
                tick,
            } => {
                self.tick_before_restart(tick).await;
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
                self.recreate_some(recreates);
                self.change(change);
                self.restart(step).await;
            }
            Op::AbortReopen { burst, tick } => {
                self.tick_before_restart(tick).await;
                let live = self.live.take().expect("a run");
                // The other stream's burst keeps the disk thread busy while this stream's
                // batches queue behind it; the task is aborted as soon as the first of them
                // was applied.
                let applied = live.reader.stats().watch_events;
                for _ in 0..2 {
                    self.h.churn(BUSY_PODS, 0, 0, self.rng.random());
                }
                self.churn(burst / 4, burst, burst / 4);
                self.recreate_some(burst / 10);
                let deadline = Instant::now() + Duration::from_secs(2);
                while live.reader.stats().watch_events == applied && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                live.task.abort();
                let _ = live.task.await;
                self.restart(step).await;
            }
            Op::Kill {
                at,
                change,
                recreates,
                tick,
            } => {
                self.tick_before_restart(tick).await;
                self.kill(step, at, change, recreates).await
            }
        }
    }

    fn change(&mut self, change: Change) {
        // Every reopen lists again (after a 410) in a mode of its own.
        self.cfg.relist = delta::draw_mode(&mut self.rng);
        let created = self.created;
        let cfg = &mut self.cfg;
        match change {
            Change::Nothing => {}
            Change::Streaming => cfg.streaming = !cfg.streaming,
            Change::Narrow => cfg.sel.shard = Sel::narrowed(cfg.sel.shard, &mut self.rng),
            Change::Widen => cfg.sel.shard = None,
            Change::Labels => cfg.sel.labels = Labels::draw(&mut self.rng),
            Change::Fields => cfg.sel.fields = Fields::draw(&mut self.rng, created),
            Change::Transform => cfg.transform = !cfg.transform,
            Change::Retry => cfg.retry = !cfg.retry,
            Change::Refuse => cfg.refuse = !cfg.refuse,
            Change::Hold => cfg.hold = !cfg.hold,
            Change::Side => self.side_cfg = side::SideCfg::draw(&mut self.rng, created),
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

    fn timed(&mut self, what: &'static str, since: Instant) {
        *self.timing.entry(what).or_default() += since.elapsed();
    }

    /// The faults a run keeps, if its configuration says so (the others cleared): every
    /// delta fetch refused (403) while it lasts, the stream's list pages held until their
    /// next page is asked for.
    fn run_faults(&mut self) {
        let faults = self.h.faults();
        if self.cfg.refuse {
            faults.fail_named_lists(1, 403);
        } else {
            faults.fail_named_lists(0, 0);
        }
        if self.cfg.hold {
            self.held_runs.insert(self.run);
            faults.hold_list_bodies_of_limit(self.cfg.page as usize);
        } else {
            faults.hold_list_bodies(false);
        }
    }
}

fn ready_outside(n: usize) -> Found {
    Found {
        invariant: "a ready store holds nothing outside its shard",
        detail: format!("{n} objects outside the shard when the store first reported ready"),
    }
}
