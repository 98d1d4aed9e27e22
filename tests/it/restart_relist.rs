//! A durable controller whose process is SIGKILLed in the middle of a relist (issue 23,
//! item 1): while its store is `Listing`, and once while `Sweeping`. The restarted process
//! must give the controller its start signal when the relist completes, so that its
//! startup pass runs: every object is reconciled at its latest version (also those whose
//! change the killed relist had already stored), and every requeue that fell due while
//! the process was down fires.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use crate::common;
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::runtime::controller::Action;
use kube_persist::controller::{Config, Controller};
use kube_persist::{Db, DbConfig, Durability, Engine, SyncPhase};
use kube_persist_testkit::{ResourceType, ServerHandle, ServerOptions, TestServer};
use serde_json::json;

const OBJECTS: usize = 1500;
const CONTROLLER: &str = "relist";
/// The first run's requeue of every tenth object: due while the process is down.
const REQUEUE: Duration = Duration::from_secs(4);

const DIR_ENV: &str = "KP_RELIST_DIR";
const URL_ENV: &str = "KP_RELIST_URL";
const PAGE_ENV: &str = "KP_RELIST_PAGE";
const FIRST_ENV: &str = "KP_RELIST_FIRST";

/// The child process: a durable controller over ConfigMaps of namespace `in` that prints
/// `reconciled <name> <rv>` after each reconcile and `phase <phase>` at each change of its
/// store's phase.
#[test]
#[ignore = "child process of restart_mid_relist"]
fn relist_child() {
    let dir = std::env::var(DIR_ENV).expect(DIR_ENV);
    let url = std::env::var(URL_ENV).expect(URL_ENV);
    let page: u32 = common::env_num(PAGE_ENV).unwrap_or(500);
    let first = std::env::var(FIRST_ENV).is_ok_and(|v| v == "1");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async move {
        let client = kube_persist_testkit::client_for(&url, None);
        // Every batch durable: what the child wrote before its SIGKILL is what the next
        // process finds (with periodic fsyncs, redb returns to the last durable commit).
        let db_cfg = DbConfig::default()
            .engine(common::child_engine())
            .durability(Durability::EveryBatch);
        let db = Db::open_with(&dir, db_cfg).expect("child opens the store");
        let store_cfg = kube_persist::StreamConfig::default()
            .page_size(page)
            .backoff(Duration::from_millis(20), Duration::from_millis(200))
            .relist_jitter(Duration::ZERO);
        let controller = db
            .store("in", Api::<ConfigMap>::namespaced(client, "in"), store_cfg)
            .map(|pair| Controller::for_store(pair).with_config(Config::default().concurrency(4)))
            .unwrap()
            .durable_state(CONTROLLER)
            .unwrap()
            .shutdown_on_signal();
        let reader = controller.store();
        tokio::spawn(async move {
            let mut last = None;
            loop {
                let phase = reader.phase();
                if last != Some(phase) {
                    println!("phase {phase:?}");
                    last = Some(phase);
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        });
        let reconcile = move |cm: Arc<ConfigMap>, _: Arc<()>| async move {
            let name = cm.metadata.name.clone().unwrap_or_default();
            let rv = cm.metadata.resource_version.clone().unwrap_or_default();
            println!("reconciled {name} {rv}");
            let requeue = first && cm.data.as_ref().is_some_and(|d| d.contains_key("requeue"));
            Ok::<_, kube::Error>(Action::requeue(if requeue {
                REQUEUE
            } else {
                Duration::from_secs(3600)
            }))
        };
        controller
            .run(
                reconcile,
                |_, _, _| Action::requeue(Duration::from_secs(3600)),
                Arc::new(()),
            )
            .for_each(|_| async {})
            .await;
    });
}

struct Run {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Run {
    fn spawn(engine: Engine, dir: &std::path::Path, url: &str, page: u32, first: bool) -> Self {
        let mut child = common::spawn_self(
            "restart_relist::relist_child",
            &[
                (common::ENGINE_ENV, engine.name().as_ref()),
                (DIR_ENV, dir.as_os_str()),
                (URL_ENV, url.as_ref()),
                (PAGE_ENV, page.to_string().as_ref()),
                (FIRST_ENV, if first { "1" } else { "0" }.as_ref()),
            ],
        );
        let lines = common::collect_stdout(&mut child, |l| {
            l.starts_with("reconciled ") || l.starts_with("phase ")
        });
        Run { child, lines }
    }

    /// (name, resourceVersion) of every reconcile so far.
    fn reconciles(&self) -> BTreeSet<(String, String)> {
        common::reconciled_lines(&self.lines).into_iter().collect()
    }

    fn saw(&self, line: &str) -> bool {
        common::printed(&self.lines, line)
    }

    /// SIGTERM: the controller stops gracefully (its last state batch written).
    fn terminate(mut self) -> BTreeSet<(String, String)> {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        self.child.wait().unwrap();
        self.reconciles()
    }

    fn kill(mut self) -> BTreeSet<(String, String)> {
        self.child.kill().expect("SIGKILL");
        self.child.wait().unwrap();
        self.reconciles()
    }
}

impl Drop for Run {
    /// A failed assertion must not leave the child running.
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn cm(name: &str, value: &str, requeue: bool) -> serde_json::Value {
    let mut data = json!({"value": value});
    if requeue {
        data["requeue"] = json!("1");
    }
    json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": "in"}, "data": data})
}

/// `name -> resourceVersion` of the ConfigMaps of `in` on the server.
fn server(h: &ServerHandle) -> BTreeMap<String, String> {
    common::server_versions(h, &ResourceType::configmaps())
        .into_iter()
        .filter_map(|(k, rv)| k.strip_prefix("in/").map(|n| (n.to_string(), rv)))
        .collect()
}

/// The phase and due requeues the killed child left on disk.
fn on_disk(engine: Engine, dir: &std::path::Path) -> (SyncPhase, Vec<(String, SystemTime)>) {
    common::wait_unlocked(dir);
    let db = common::try_open_db(engine, dir).unwrap();
    let phase = db
        .streams()
        .unwrap()
        .into_iter()
        .find(|s| s.name == "in")
        .map(|s| s.phase)
        .unwrap_or_default();
    let due = db
        .reconcile_states(CONTROLLER)
        .map(|states| {
            states
                .filter_map(Result::ok)
                .filter_map(|s| s.due.map(|d| (s.name, d)))
                .filter(|(_, d)| *d < SystemTime::now() + Duration::from_secs(600))
                .collect()
        })
        .unwrap_or_default();
    (phase, due)
}

async fn restart_mid_relist(engine: Engine, kill_in: SyncPhase) {
    common::init_tracing();
    let server_proc = TestServer::start_with(ServerOptions {
        history: 100_000,
        ..ServerOptions::default()
    })
    .await;
    let (h, url) = (server_proc.handle(), server_proc.url());
    let rt = ResourceType::configmaps();
    for i in 0..OBJECTS {
        h.apply(&rt, cm(&format!("cm-{i}"), "v0", i % 10 == 0));
    }
    let dir = tempfile::tempdir().unwrap();
    // 1. Sync and reconcile everything; the requeues are then on disk, due soon.
    let first = Run::spawn(engine, dir.path(), &url, 500, true);
    common::eventually("the first run reconciles every object", || {
        first.reconciles().len() >= OBJECTS
    })
    .await;
    let mut reconciled = first.terminate();
    let (_, due) = on_disk(engine, dir.path());
    assert!(
        due.len() >= OBJECTS / 10,
        "requeues recorded: {}",
        due.len()
    );

    let mut attempts = 0;
    loop {
        attempts += 1;
        assert!(attempts <= 5, "never stopped the child while {kill_in:?}");
        // 2. While down: changes and deletions, then a compaction (the resume gets 410).
        for i in (attempts * 7..OBJECTS).step_by(25) {
            if let Some(mut o) = h.get(&rt, Some("in"), &format!("cm-{i}")) {
                o["data"]["value"] = json!(format!("a{attempts}"));
                h.apply(&rt, o);
            }
        }
        for i in (attempts * 11..OBJECTS).step_by(97) {
            h.delete(&rt, Some("in"), &format!("cm-{i}"));
        }
        h.compact();
        // 3. The relist, slowed (small pages, a page delay while listing); SIGKILL in it.
        let listing = kill_in == SyncPhase::Listing;
        h.faults()
            .page_delay(Duration::from_millis(if listing { 20 } else { 0 }));
        let second = Run::spawn(engine, dir.path(), &url, 10, false);
        let wanted = format!("phase {kill_in:?}");
        let deadline = Instant::now() + common::WAIT;
        while !second.saw(&wanted) {
            assert!(
                Instant::now() < deadline,
                "the relist never reached {kill_in:?}"
            );
            std::thread::sleep(Duration::from_millis(1)); // a sweep is over in a few ms
        }
        if listing {
            tokio::time::sleep(Duration::from_millis(200)).await; // some pages on disk
        }
        reconciled.extend(second.kill());
        h.faults().page_delay(Duration::ZERO);
        if on_disk(engine, dir.path()).0 == kill_in {
            break;
        }
    }
    // 4. Let the requeues fall due, then restart: the startup pass must run.
    let last_due = due.iter().map(|(_, d)| *d).max().unwrap();
    while SystemTime::now() <= last_due + Duration::from_millis(50) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let objects = server(&h);
    let due_names: BTreeSet<&String> = due.iter().map(|(n, _)| n).collect();
    let third = Run::spawn(engine, dir.path(), &url, 500, false);
    let deadline = Instant::now() + common::WAIT;
    loop {
        let now = third.reconciles();
        let names: BTreeSet<&String> = now.iter().map(|(n, _)| n).collect();
        let stale: Vec<_> = objects
            .iter()
            .filter(|(n, rv)| {
                let key = ((*n).clone(), (*rv).clone());
                !reconciled.contains(&key) && !now.contains(&key)
            })
            .take(5)
            .collect();
        let unfired: Vec<_> = due_names
            .iter()
            .filter(|n| objects.contains_key(**n) && !names.contains(**n))
            .take(5)
            .collect();
        if stale.is_empty() && unfired.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after a restart mid-{kill_in:?} ({engine}): not reconciled at their latest \
             version: {stale:?}; due requeues that never fired: {unfired:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    third.terminate();
}

async fn killed_while_listing(engine: Engine) {
    restart_mid_relist(engine, SyncPhase::Listing).await
}

async fn killed_while_sweeping(engine: Engine) {
    restart_mid_relist(engine, SyncPhase::Sweeping).await
}

engine_tests!(async: killed_while_listing, killed_while_sweeping);
