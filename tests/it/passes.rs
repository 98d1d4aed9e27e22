//! The controller under sustained load (issue 50): passes that survive restarts, changes
//! before pass work with pass work's guaranteed share, a lagged durable subscriber that
//! merges instead of passing, and passes that never hold a blocking thread.
//!
//! - Items 1: a durable controller (`StartupMode::Changed`, `concurrency(1)`, 20 ms
//!   reconciles) over 200 Pods, every Pod changed while it is stopped, then started and
//!   stopped after about 70 reconciles (about 1.5 s), four times, gracefully and with
//!   SIGKILL: every Pod is reconciled over the four runs. Before, each start reconciled the
//!   changes in the order the watch replayed them, the same ones each time.
//! - Item 2: a storm of changes during a long pass: changes go first, the pass gets one
//!   dispatch in four, and it completes.
//! - Item 4: a lag of a durable controller's main subscriber reconciles what changed and
//!   forgets the record of a Pod deleted during the lag, not every Pod.
//! - Item 5: with one blocking thread, a warm restart's pass (chunks of 10) and the reads
//!   of the objects it dispatches do not wait on each other.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::{self, Engine, relabel_pod};
use crate::triggers::{Never, name_of, store_cfg};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::controller::Action;
use kube_persist::controller::{Config, Controller, StartupMode};
use kube_persist_testkit::ResourceType;

pub(crate) const PODS: usize = 200;
/// Reconciles each run of the restart tests takes before it is stopped.
pub(crate) const PER_RUN: usize = 70;
const DIR_ENV: &str = "KP_PASSES_DIR";
const URL_ENV: &str = "KP_PASSES_URL";
/// Set (to anything): the child asks for one `reconcile_all_on` tick as it starts.
pub(crate) const TICK_ENV: &str = "KP_PASSES_TICK";
/// Set to `all`: the child starts with `StartupMode::ReconcileAll`.
pub(crate) const STARTUP_ENV: &str = "KP_PASSES_STARTUP";
/// The library's test hook: the durable state's identity check is held this long (ms).
pub(crate) const INIT_DELAY_ENV: &str = "KUBE_PERSIST_TEST_STATE_INIT_DELAY_MS";

/// A controller of every Pod of `server` in `db`.
fn pods_controller(
    db: &kube_persist::Db,
    server: &kube_persist_testkit::TestServer,
    config: Config,
) -> Controller<Pod> {
    db.store("pods", Api::<Pod>::all(server.client()), store_cfg())
        .map(|pair| Controller::for_store(pair).with_config(config))
        .unwrap()
}

/// The child process: a durable controller of every Pod, `concurrency(1)`, reconciles of
/// 20 ms, stopped gracefully by SIGTERM. Started only by `passes_resume_*`.
#[test]
#[ignore = "child process of the pass restart tests"]
fn pass_child() {
    let dir = std::env::var(DIR_ENV).expect("KP_PASSES_DIR");
    let url = std::env::var(URL_ENV).expect("KP_PASSES_URL");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async move {
        let client = kube_persist_testkit::client_for(&url, None);
        let db = common::try_open_db(common::child_engine(), &dir).expect("child opens the store");
        let controller = db
            .store("pods", Api::<Pod>::all(client), store_cfg())
            .map(|pair| {
                Controller::for_store(pair).with_config(Config::default().concurrency(1).startup(
                    match std::env::var(STARTUP_ENV).as_deref() {
                        Ok("all") => StartupMode::ReconcileAll,
                        _ => StartupMode::Changed,
                    },
                ))
            })
            .unwrap()
            .durable_state("passes")
            .unwrap()
            .shutdown_on_signal();
        let controller = match std::env::var_os(TICK_ENV) {
            Some(_) => controller.reconcile_all_on(futures::stream::once(async {})),
            None => controller,
        };
        // Every time the passes end (the startup pass and a tick's), one line.
        let stats = controller.stats();
        tokio::spawn(async move {
            let mut running = false;
            loop {
                let now = stats.get().startup_pass_running;
                if running && !now {
                    println!("child-passes-idle");
                }
                running = now;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        });
        println!("child-started");
        controller
            .run(
                |pod: Arc<Pod>, _: Arc<()>| async move {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    let rv = pod.metadata.resource_version.clone().unwrap_or_default();
                    println!("reconciled {} {rv}", name_of(&pod));
                    Ok::<_, Never>(Action::await_change())
                },
                |_, _: &Never, _| Action::await_change(),
                Arc::new(()),
            )
            .for_each(|_| async {})
            .await;
        db.flush().unwrap();
        println!("child-stopped");
    });
}

pub(crate) struct Child {
    child: std::process::Child,
    pub(crate) lines: Arc<Mutex<Vec<String>>>,
}

impl Child {
    pub(crate) fn spawn(engine: Engine, dir: &std::path::Path, url: &str) -> Self {
        Self::spawn_with(engine, dir, url, &[])
    }

    /// With more environment: [`TICK_ENV`], [`INIT_DELAY_ENV`].
    pub(crate) fn spawn_with(
        engine: Engine,
        dir: &std::path::Path,
        url: &str,
        more: &[(&str, &std::ffi::OsStr)],
    ) -> Self {
        let mut env = vec![
            (common::ENGINE_ENV, engine.name().as_ref()),
            (DIR_ENV, dir.as_os_str()),
            (URL_ENV, url.as_ref()),
        ];
        env.extend_from_slice(more);
        let mut child = common::spawn_self("passes::pass_child", &env);
        let lines = common::collect_stdout(&mut child, |l| {
            l.starts_with("reconciled ") || l.starts_with("child-")
        });
        Child { child, lines }
    }

    pub(crate) fn reconciled(&self) -> Vec<String> {
        common::reconciled_lines(&self.lines)
            .into_iter()
            .map(|(n, _)| n)
            .collect()
    }

    pub(crate) async fn wait_for(&self, what: &str, f: impl Fn(&Self) -> bool) {
        let deadline = Instant::now() + common::WAIT;
        while !f(self) {
            assert!(
                Instant::now() < deadline,
                "{what}: not within {:?} (last line {:?})",
                common::WAIT,
                common::last_line(&self.lines)
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// SIGTERM, then the exit, which must be a success: every reconcile it did.
    pub(crate) async fn stop(mut self) -> Vec<String> {
        // SAFETY: kill(2) on the pid of a child this test spawned and has not reaped.
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        assert_eq!(rc, 0, "SIGTERM the child");
        let status = self.child.wait().unwrap();
        assert!(status.success(), "graceful stop: {status}");
        // The reconciles that finished after the signal are printed before this line.
        self.wait_for("the child's last line", |c| {
            common::printed(&c.lines, "child-stopped")
        })
        .await;
        self.reconciled()
    }

    /// SIGKILL: the reconciles it printed (one in flight may have ended unprinted, and is
    /// owed again: its state was not written).
    fn kill(mut self) -> Vec<String> {
        self.child.kill().expect("SIGKILL");
        self.child.wait().unwrap();
        self.reconciled()
    }
}

/// Item 1: every Pod changed while the controller is down, four short runs; every Pod is
/// reconciled over the four.
async fn passes_resume_across_restarts(engine: Engine, sigkill: bool) {
    common::init_tracing();
    let server = common::pod_server(PODS).await;
    let h = server.handle();
    let url = server.url();
    let dir = tempfile::tempdir().unwrap();
    let pods: BTreeSet<String> = common::server_versions(&h, &ResourceType::pods())
        .keys()
        .map(|k| k.rsplit('/').next().unwrap().to_string())
        .collect();
    assert_eq!(pods.len(), PODS);

    // The first run reconciles every Pod (a cold start): the state then knows them all.
    let first = Child::spawn(engine, dir.path(), &url);
    first
        .wait_for("the cold start reconciles every Pod", |c| {
            c.reconciled().into_iter().collect::<BTreeSet<_>>() == pods
        })
        .await;
    first.stop().await;

    let mut seen = BTreeSet::new();
    for run in 0..4 {
        for i in 0..PODS {
            relabel_pod(
                &h,
                &format!("ns-{}", i % 10),
                &format!("pod-{i}"),
                &format!("r{run}"),
            );
        }
        let child = Child::spawn(engine, dir.path(), &url);
        child
            .wait_for("the run makes progress", |c| {
                c.reconciled().len() >= PER_RUN
            })
            .await;
        let got = if sigkill {
            child.kill()
        } else {
            child.stop().await
        };
        tracing::info!(run, reconciles = got.len(), first = ?got.first(), last = ?got.last(), "run stopped");
        seen.extend(got);
    }
    let never: Vec<_> = pods.difference(&seen).collect();
    assert!(
        never.is_empty(),
        "{} of {PODS} Pods were never reconciled over four runs of at least {PER_RUN} reconciles: {:?}",
        never.len(),
        never.iter().take(10).collect::<Vec<_>>()
    );
}

async fn passes_resume_across_graceful_restarts(engine: Engine) {
    passes_resume_across_restarts(engine, false).await
}

async fn passes_resume_across_sigkills(engine: Engine) {
    passes_resume_across_restarts(engine, true).await
}

/// Reconciles in order, with the label `touched` each one saw.
#[derive(Default)]
struct Log(Mutex<Vec<(String, String)>>);

impl Log {
    fn names(&self) -> Vec<String> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .map(|(n, _)| n.clone())
            .collect()
    }
    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

/// The Pod's label `touched` (empty if none).
fn touched(pod: &Pod) -> String {
    pod.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get("touched").cloned())
        .unwrap_or_default()
}

async fn logged(pod: Arc<Pod>, log: Arc<Log>) -> Result<Action, Never> {
    tokio::time::sleep(Duration::from_millis(10)).await;
    let label = touched(&pod);
    log.0.lock().unwrap().push((name_of(&pod), label));
    Ok(Action::await_change())
}

/// Holds the reconcile that starts after `hold_at` others until released.
struct Gate {
    log: Log,
    started: std::sync::atomic::AtomicUsize,
    hold_at: usize,
    held: tokio::sync::watch::Sender<bool>,
    release: tokio::sync::Semaphore,
}

async fn gated(pod: Arc<Pod>, gate: Arc<Gate>) -> Result<Action, Never> {
    let n = gate
        .started
        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    if n == gate.hold_at {
        gate.held.send_replace(true);
        let _permit = gate.release.acquire().await.unwrap();
    }
    let label = touched(&pod);
    gate.log.0.lock().unwrap().push((name_of(&pod), label));
    Ok(Action::await_change())
}

/// Item 2: the start's pass over 200 Pods (no durable state, `concurrency(1)`). Its 101st
/// reconcile is held while 60 of the Pods it reconciled change, until the 60 changes wait
/// in the controller's queue; then the changes go first, but of every four dispatches
/// while both wait one is the pass's; every change is reconciled once, and the pass
/// reaches every Pod. (Before, the pass's requests waited in the scheduler ahead of the
/// changes, which came after the rest of the pass.)
async fn changes_go_first_and_the_pass_keeps_its_share(engine: Engine) {
    common::init_tracing();
    let server = common::pod_server(PODS).await;
    let h = server.handle();
    let dir = tempfile::tempdir().unwrap();
    let db = common::try_open_db(engine, dir.path()).unwrap();
    let controller = pods_controller(&db, &server, Config::default().concurrency(1));
    let stats = controller.stats();
    let (held, mut is_held) = tokio::sync::watch::channel(false);
    let gate = Arc::new(Gate {
        log: Log::default(),
        started: Default::default(),
        hold_at: 100,
        held,
        release: tokio::sync::Semaphore::new(0),
    });
    let run = tokio::spawn(
        controller
            .run(gated, |_, _, _| Action::await_change(), gate.clone())
            .for_each(|_| async {}),
    );
    is_held.wait_for(|held| *held).await.unwrap();
    // The pass's work read ahead and waiting: it does not move while the reconcile is held.
    let pass_waiting = stats.get().queue_depth;
    // Pods the pass has reconciled: every later reconcile of them is a change's.
    let storm: Vec<String> = gate.log.names().into_iter().take(60).collect();
    for name in &storm {
        let i: usize = name[4..].parse().unwrap();
        relabel_pod(&h, &format!("ns-{}", i % 10), name, "storm");
    }
    common::eventually("the 60 changes wait in the controller's queue", || {
        stats.get().queue_depth >= pass_waiting + 60
    })
    .await;
    gate.release.add_permits(1);
    let log = &gate.log;
    let saw_storm = || {
        let l = log.0.lock().unwrap();
        storm
            .iter()
            .all(|n| l.iter().any(|(m, v)| m == n && v == "storm"))
    };
    common::eventually("every change is reconciled", saw_storm).await;
    common::eventually("the pass reaches every Pod", || {
        log.names().into_iter().collect::<BTreeSet<_>>().len() == PODS
    })
    .await;
    let entries = log.0.lock().unwrap().clone();
    run.abort();
    // From the held reconcile (the pass's) to the storm's last reconcile.
    let last = entries.iter().rposition(|(_, v)| v == "storm").unwrap();
    let window = &entries[100..=last];
    let changes = window.iter().filter(|(_, v)| v == "storm").count();
    let pass = window.len() - changes;
    assert_eq!(
        changes,
        storm.len(),
        "each change reconciled once: {window:?}"
    );
    // Changes first: three changes, then one pass reconcile, from the held one on.
    assert_eq!(
        pass,
        changes.div_ceil(3),
        "{pass} pass reconciles beside {changes} changes: the pass's share is one in four: {window:?}"
    );
}

/// Item 4: a durable controller on a shared stream, its subscriber lagged (its queue of one
/// held full while the controller is not polled) while one Pod changes, another is
/// deleted and a third changes: it reconciles the two changed Pods, no other, and forgets
/// the deleted Pod's record within 5 s.
async fn a_lagged_durable_subscriber_merges_what_changed(engine: Engine) {
    common::init_tracing();
    let server = common::pod_server(20).await;
    let h = server.handle();
    let dir = tempfile::tempdir().unwrap();
    let db = common::try_open_db(engine, dir.path()).unwrap();
    let (reader, watcher) = db
        .store("pods", Api::<Pod>::all(server.client()), store_cfg())
        .unwrap();
    let shared = watcher.shared(1).max_stall(Duration::from_millis(50));
    let controller_sub = shared.subscribe();
    let mut probe = shared.subscribe();
    tokio::spawn(shared.run());
    let controller = Controller::for_shared(reader, controller_sub)
        .with_config(Config::default())
        .durable_state("lagged")
        .unwrap();
    let log = Arc::new(Log::default());
    let cstats = controller.stats();
    let mut run = Box::pin(controller.run(logged, |_, _, _| Action::await_change(), log.clone()));
    // The probe takes every event, so that only the controller's queue stays full.
    let (seen_tx, seen_rx) = tokio::sync::watch::channel(Vec::<String>::new());
    tokio::spawn(async move {
        while let Some(ev) = probe.next().await {
            if let Ok(kube_persist::SharedEvent::Event(ev)) = ev
                && let kube_persist::Event::Apply(p) | kube_persist::Event::Delete(p) = &*ev
            {
                seen_tx.send_modify(|s| s.push(name_of(p)));
            }
        }
    });
    let records = |db: &kube_persist::Db| -> BTreeSet<String> {
        match db.reconcile_states("lagged") {
            Ok(records) => records.map(|r| r.unwrap().name).collect(),
            Err(_) => BTreeSet::new(), // no state yet
        }
    };
    // The cold start reconciles every Pod and records it.
    let deadline = Instant::now() + common::WAIT;
    while records(&db).len() < 20 {
        assert!(
            Instant::now() < deadline,
            "the cold start records every Pod"
        );
        let _ = tokio::time::timeout(Duration::from_millis(50), run.next()).await;
    }
    // Not polled from here: the controller's queue of one fills and it is lagged.
    let before = log.len();
    relabel_pod(&h, "ns-1", "pod-1", "lag");
    h.delete(&ResourceType::pods(), Some("ns-2"), "pod-2");
    relabel_pod(&h, "ns-3", "pod-3", "lag");
    let mut seen = seen_rx.clone();
    seen.wait_for(|s| s.iter().filter(|n| *n == "pod-3").count() > 0)
        .await
        .unwrap();
    // pod-3's event was offered after pod-2's stalled the controller's full queue for
    // `max_stall`: the controller lagged. Polled again, it must merge.
    let deadline = Instant::now() + Duration::from_secs(5);
    while records(&db).contains("pod-2") {
        assert!(
            Instant::now() < deadline,
            "the deleted Pod's record is forgotten within 5 s of the lag"
        );
        let _ = tokio::time::timeout(Duration::from_millis(20), run.next()).await;
    }
    let since = || -> Vec<String> {
        log.0.lock().unwrap()[before..]
            .iter()
            .map(|(n, _)| n.clone())
            .collect()
    };
    // Then until both changed Pods are reconciled and the controller is idle: nothing
    // queued, running or passing (the merge ended), twice in a row.
    let deadline = Instant::now() + common::WAIT;
    let mut idle = 0;
    while idle < 2 {
        let done = ["pod-1", "pod-3"]
            .iter()
            .all(|p| since().iter().any(|n| n == p));
        let c = cstats.get();
        idle = if done && c.active == 0 && c.queue_depth == 0 && !c.startup_pass_running {
            idle + 1
        } else {
            0
        };
        assert!(
            Instant::now() < deadline,
            "both changed Pods are reconciled: {:?}",
            since()
        );
        let _ = tokio::time::timeout(Duration::from_millis(20), run.next()).await;
    }
    let others: Vec<_> = since()
        .into_iter()
        .filter(|n| n != "pod-1" && n != "pod-3")
        .collect();
    assert!(
        others.is_empty(),
        "unchanged Pods reconciled after the lag: {others:?}"
    );
}

/// Item 5: a runtime with one blocking thread; a warm restart without durable state (every
/// object is reconciled, from disk: the hot cache of the reopened store is empty), passes
/// of 10 objects, `concurrency(1)`: every Pod is reconciled.
fn one_blocking_thread_serves_the_pass_and_the_reads(engine: Engine) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(1)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        common::init_tracing();
        let server = common::pod_server(100).await;
        let dir = tempfile::tempdir().unwrap();
        {
            let db = common::try_open_db(engine, dir.path()).unwrap();
            common::sync_pods(&server, &db).await;
            db.flush().unwrap();
        }
        let db = common::try_open_db(engine, dir.path()).unwrap();
        let controller = pods_controller(
            &db,
            &server,
            Config::default().concurrency(1).pass_chunk(10),
        );
        let log = Arc::new(Log::default());
        let run = tokio::spawn(
            controller
                .run(logged, |_, _, _| Action::await_change(), log.clone())
                .for_each(|_| async {}),
        );
        let deadline = Instant::now() + common::WAIT;
        loop {
            let names: BTreeSet<String> = log.names().into_iter().collect();
            if names.len() == 100 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "with one blocking thread, {} of 100 Pods were reconciled",
                names.len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        run.abort();
    });
}

engine_tests!(async: passes_resume_across_graceful_restarts, passes_resume_across_sigkills,
    changes_go_first_and_the_pass_keeps_its_share, a_lagged_durable_subscriber_merges_what_changed;
    sync: one_blocking_thread_serves_the_pass_and_the_reads);
