//! An object deleted and created again under its name (issue 56, item 1: `kubectl delete`
//! and `apply` of a custom resource, a Helm reinstall, a GitOps prune and recreate) is a new
//! object, and a durable controller reconciles it, also with the `generation` predicate:
//! the new object starts at generation 1, as the one it replaced may have been, and a
//! reconcile record of the old one (keyed by namespace and name) must not count it as
//! handled. Three ways the new object reaches the controller, each on both engines:
//!
//! - while the controller is stopped: the startup merge finds the new uid in the store;
//! - while it runs, the delete and the create merged into one request (the object's
//!   reconcile was busy when both came);
//! - after a relist (`410 Gone` on resume), which shows only an Apply of the new uid.

use std::sync::{Arc, Mutex};

use crate::common;
use crate::reconcile_state::{deployment, deployments_controller, sync_store};
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use kube::runtime::controller::Action;
use kube_persist::controller::Config;
use kube_persist::{Db, Engine};
use kube_persist_testkit::{ResourceType, ServerHandle, TestServer, Verb};
use tokio::sync::Semaphore;

const CONTROLLER: &str = "recreate";

#[derive(Debug, thiserror::Error)]
#[error("never")]
struct Never;

/// What the reconciler saw: (name, uid) of each reconcile, in order.
type Seen = Arc<Mutex<Vec<(String, String)>>>;

/// A durable controller of the Deployments of namespace `app`, with the generation filter,
/// running in a task of this process.
struct Run {
    seen: Seen,
    reader: kube_persist::Reader<Deployment>,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Run {
    /// Starts it; the first reconcile of `gated` (if any) waits for a permit of the gate.
    fn start(db: &Db, client: kube::Client, gated: Option<(&str, Arc<Semaphore>)>) -> Run {
        let (stop, rx) = tokio::sync::oneshot::channel();
        let config = Config::default().concurrency(2);
        let controller = deployments_controller(db, client, config, CONTROLLER, rx)
            .predicate_filter(kube::runtime::predicates::generation, Default::default());
        let reader = controller.store();
        let seen = Seen::default();
        let sink = seen.clone();
        let gated = gated.map(|(name, gate)| (name.to_string(), gate));
        let run = controller.run(
            move |d: Arc<Deployment>, _ctx: Arc<()>| {
                let name = d.metadata.name.clone().unwrap_or_default();
                let uid = d.metadata.uid.clone().unwrap_or_default();
                let first = {
                    let mut seen = sink.lock().unwrap();
                    let first = !seen.iter().any(|(n, _)| *n == name);
                    seen.push((name.clone(), uid));
                    first
                };
                let gate = gated
                    .as_ref()
                    .filter(|(g, _)| first && *g == name)
                    .map(|(_, gate)| gate.clone());
                async move {
                    if let Some(gate) = gate {
                        gate.acquire().await.unwrap().forget();
                    }
                    Ok::<_, Never>(Action::await_change())
                }
            },
            |_, _, _| Action::await_change(),
            Arc::new(()),
        );
        let task = tokio::spawn(run.for_each(|_| async {}));
        Run {
            seen,
            reader,
            stop,
            task,
        }
    }

    fn reconciled(&self, name: &str, uid: &str) -> bool {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .any(|(n, u)| n == name && u == uid)
    }

    /// Stops it gracefully (its reconcile state written).
    async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.unwrap();
    }
}

fn uid(h: &ServerHandle, name: &str) -> String {
    let d = h
        .get(&ResourceType::deployments(), Some("app"), name)
        .unwrap();
    d["metadata"]["uid"].as_str().unwrap().to_string()
}

/// Deletes Deployment `name` and creates it again (generation 1, another uid); the new uid.
fn recreate(h: &ServerHandle, name: &str) -> String {
    let rt = ResourceType::deployments();
    let old = uid(h, name);
    h.delete(&rt, Some("app"), name).unwrap();
    h.apply(&rt, deployment(name, 1));
    let new = uid(h, name);
    assert_ne!(old, new, "a new object of the name has a new uid");
    let generation = h.get(&rt, Some("app"), name).unwrap()["metadata"]["generation"].clone();
    assert_eq!(generation, 1, "the new object starts at generation 1");
    new
}

/// The uid of the reconcile record of `name`, as `Db::reconcile_states` reads it.
fn recorded_uid(db: &Db, name: &str) -> Option<String> {
    db.reconcile_states(CONTROLLER)
        .ok()?
        .filter_map(Result::ok)
        .find(|r| r.name == name)
        .and_then(|r| r.uid)
}

/// Both Deployments reconciled once (generation 1) and recorded.
async fn first_run(db: &Db, client: kube::Client, h: &ServerHandle) -> Run {
    let run = Run::start(db, client, None);
    for name in ["d-0", "d-1"] {
        reconciled_as(&run, db, name, &uid(h, name), "the first reconciles").await;
    }
    run
}

/// A server holding Deployments `d-0` and `d-1`, and a store directory on `engine`.
async fn setup(engine: Engine) -> (TestServer, ServerHandle, tempfile::TempDir, Db) {
    common::init_tracing();
    let server = TestServer::start().await;
    let h = server.handle();
    for name in ["d-0", "d-1"] {
        h.apply(&ResourceType::deployments(), deployment(name, 1));
    }
    let dir = tempfile::tempdir().unwrap();
    let db = common::try_open_db(engine, dir.path()).unwrap();
    (server, h, dir, db)
}

/// Waits until the reconciler saw `name` as the object `uid`, and its record is of it.
async fn reconciled_as(run: &Run, db: &Db, name: &str, uid: &str, what: &str) {
    common::eventually(what, || run.reconciled(name, uid)).await;
    common::eventually("its record is of that uid", || {
        recorded_uid(db, name).as_deref() == Some(uid)
    })
    .await;
}

/// Deleted and created again while the controller was stopped: the startup merge reconciles
/// the new object (at 9ad23f8 it counted it handled by the old one's generation).
async fn recreated_while_stopped_is_reconciled_on_start(engine: Engine) {
    let (server, h, _dir, db) = setup(engine).await;
    first_run(&db, server.client(), &h).await.stop().await;

    let new = recreate(&h, "d-0");
    sync_store(&db, server.client(), &h).await;
    let run = Run::start(&db, server.client(), None);
    let what = "d-0 reconciled as the new object by the startup pass";
    reconciled_as(&run, &db, "d-0", &new, what).await;
    run.stop().await;
}

/// Deleted and created again while the object's reconcile is busy: the delete and the
/// create reach the runner as one request, after the reconcile of the old object recorded
/// it; the new object is reconciled.
async fn recreated_while_busy_is_reconciled(engine: Engine) {
    let (server, h, _dir, db) = setup(engine).await;
    let gate = Arc::new(Semaphore::new(0));
    let run = Run::start(&db, server.client(), Some(("d-0", gate.clone())));
    let old = uid(&h, "d-0");
    common::eventually("d-0's first reconcile under way", || {
        run.reconciled("d-0", &old)
    })
    .await;
    let new = recreate(&h, "d-0");
    common::eventually("the store holds the new object", || {
        run.reader
            .get_named(Some("app"), "d-0")
            .ok()
            .flatten()
            .and_then(|d| d.metadata.uid.clone())
            .as_deref()
            == Some(&new)
    })
    .await;
    gate.add_permits(1);
    reconciled_as(&run, &db, "d-0", &new, "d-0 reconciled as the new object").await;
    run.stop().await;
}

/// Deleted and created again while the watch is down and the server's history compacted:
/// the relist after `410 Gone` shows an Apply of the new uid only, and the new object is
/// reconciled.
async fn recreated_behind_a_relist_is_reconciled(engine: Engine) {
    let (server, h, _dir, db) = setup(engine).await;
    let run = first_run(&db, server.client(), &h).await;

    // Keep the watch down: every reconnect fails until the history is compacted.
    let faults = h.faults();
    faults.fail_next(Verb::Watch, 500, usize::MAX);
    let watches = h.counts().watch;
    faults.close_watches();
    common::eventually("a reconnect refused", || h.counts().watch > watches).await;
    let new = recreate(&h, "d-0");
    h.compact();
    faults.clear();
    let what = "d-0 reconciled as the new object after the relist";
    reconciled_as(&run, &db, "d-0", &new, what).await;
    run.stop().await;
}

engine_tests!(async: recreated_while_stopped_is_reconciled_on_start,
    recreated_while_busy_is_reconciled, recreated_behind_a_relist_is_reconciled);
