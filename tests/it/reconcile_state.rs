//! Durable reconcile state (issue 18) across SIGKILLs, on both engines.
//!
//! A child process runs a durable controller that mirrors ConfigMaps of namespace `in`
//! into namespace `out` (a write per reconcile that changes something), with requeues
//! (300 ms for a tenth of the objects), failures (another tenth write and then fail; the
//! error policy retries after 300 ms) and one-hour requeues for the rest, while the parent
//! changes objects. The parent SIGKILLs it at a random moment, changes, deletes and creates
//! objects while it is down, waits until the short requeues fall due, and reads the state
//! the child left on disk. The restarted child (every requeue now one hour) must reconcile
//! exactly the objects whose version changed since the version its state records, whose
//! requeue fell due, or that it never reconciled: each once, nothing else. The server then
//! holds what a full reconcile gives, and after the last round (a graceful stop) the state
//! tracks exactly the objects that exist, at their current versions.

use std::collections::{BTreeMap, HashMap};
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use crate::common;
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::PostParams;
use kube::runtime::controller::Action;
use kube_persist::Engine;
use kube_persist::controller::{Config, Controller};
use kube_persist_testkit::{ResourceType, ServerHandle, ServerOptions, TestServer};
use rand::{Rng, SeedableRng, rngs::StdRng};
use serde_json::json;

const DEFAULT_SEED: u64 = 0x6b70_7265_636f_6e63;
const OBJECTS: usize = 200;
const ROUNDS: usize = 3;
const CONTROLLER: &str = "mirror";
const SHORT: Duration = Duration::from_millis(300);
const LONG: Duration = Duration::from_secs(3600);

#[derive(Debug, thiserror::Error)]
enum MirrorError {
    #[error("injected failure")]
    Injected,
    #[error(transparent)]
    Kube(#[from] kube::Error),
}

struct Ctx {
    out: Api<ConfigMap>,
    /// Every requeue and retry one hour away (the restarted run, whose reconciles are counted).
    settle: bool,
    stop: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    stop_on: Option<String>,
}

fn data(cm: &ConfigMap, key: &str) -> String {
    cm.data
        .as_ref()
        .and_then(|d| d.get(key).cloned())
        .unwrap_or_default()
}

/// Mirrors `in/<name>`'s value into `out/<name>`; prints `reconciled <name> <rv>` after.
async fn reconcile(cm: Arc<ConfigMap>, ctx: Arc<Ctx>) -> Result<Action, MirrorError> {
    let name = cm.metadata.name.clone().unwrap_or_default();
    let value = data(&cm, "value");
    let current = ctx.out.get_opt(&name).await?;
    let wanted = ConfigMap {
        metadata: kube::api::ObjectMeta {
            name: Some(name.clone()),
            namespace: Some("out".into()),
            resource_version: current
                .as_ref()
                .and_then(|c| c.metadata.resource_version.clone()),
            ..Default::default()
        },
        data: Some([("value".to_string(), value.clone())].into()),
        ..Default::default()
    };
    match current {
        Some(c) if data(&c, "value") == value => {}
        Some(_) => {
            ctx.out
                .replace(&name, &PostParams::default(), &wanted)
                .await?;
        }
        None => {
            ctx.out.create(&PostParams::default(), &wanted).await?;
        }
    }
    let rv = cm.metadata.resource_version.clone().unwrap_or_default();
    println!("reconciled {name} {rv}");
    if ctx.stop_on.as_deref() == Some(name.as_str())
        && let Some(tx) = ctx.stop.lock().unwrap().take()
    {
        let _ = tx.send(());
    }
    match data(&cm, "mode").as_str() {
        "fail" => Err(MirrorError::Injected),
        "short" if !ctx.settle => Ok(Action::requeue(SHORT)),
        _ => Ok(Action::requeue(LONG)),
    }
}

fn error_policy(_cm: Arc<ConfigMap>, _e: &MirrorError, ctx: Arc<Ctx>) -> Action {
    Action::requeue(if ctx.settle { LONG } else { SHORT })
}

const DIR_ENV: &str = "KP_STATE_CHILD_DIR";
const URL_ENV: &str = "KP_STATE_URL";
const SETTLE_ENV: &str = "KP_STATE_SETTLE";
const STOP_ENV: &str = "KP_STATE_STOP_ON";

/// The child process: the durable controller. Started only by `restart_reconciles_*`.
#[test]
#[ignore = "child process of the reconcile state tests"]
fn state_child() {
    let dir = std::env::var(DIR_ENV).expect("KP_STATE_CHILD_DIR");
    let url = std::env::var(URL_ENV).expect("KP_STATE_URL");
    let settle = std::env::var(SETTLE_ENV).is_ok_and(|v| v == "1");
    let stop_on = std::env::var(STOP_ENV).ok().filter(|s| !s.is_empty());
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async move {
        let client = kube_persist_testkit::client_for(&url, None);
        let db = common::try_open_db(common::child_engine(), &dir).expect("child opens the store");
        let (tx, rx) = tokio::sync::oneshot::channel();
        let ctx = Arc::new(Ctx {
            out: Api::namespaced(client.clone(), "out"),
            settle,
            stop: Mutex::new(Some(tx)),
            stop_on,
        });
        let store_cfg = kube_persist::StreamConfig::default()
            .backoff(Duration::from_millis(20), Duration::from_millis(200));
        let controller = db
            .store("in", Api::<ConfigMap>::namespaced(client, "in"), store_cfg)
            .map(|pair| Controller::for_store(pair).with_config(Config::default().concurrency(4)))
            .unwrap()
            .durable_state(CONTROLLER)
            .unwrap()
            .graceful_shutdown_on(async move {
                let _ = rx.await;
            });
        println!("child-started");
        controller
            .run(reconcile, error_policy, ctx)
            .for_each(|_| async {})
            .await;
        db.flush().unwrap();
        println!("child-stopped");
    });
}

struct Running {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Running {
    fn spawn(
        engine: Engine,
        dir: &std::path::Path,
        url: &str,
        settle: bool,
        stop_on: &str,
    ) -> Self {
        let mut child = common::spawn_self(
            "reconcile_state::state_child",
            &[
                (common::ENGINE_ENV, engine.name().as_ref()),
                (DIR_ENV, dir.as_os_str()),
                (URL_ENV, url.as_ref()),
                (SETTLE_ENV, if settle { "1" } else { "0" }.as_ref()),
                (STOP_ENV, stop_on.as_ref()),
            ],
        );
        let lines = common::collect_stdout(&mut child, |l| {
            l.starts_with("reconciled ") || l.starts_with("child-")
        });
        Running { child, lines }
    }

    /// Names reconciled so far, in order.
    fn reconciled(&self) -> Vec<String> {
        self.reconciles().into_iter().map(|(n, _)| n).collect()
    }

    /// (name, resourceVersion) of each reconcile so far, in order.
    fn reconciles(&self) -> Vec<(String, String)> {
        common::reconciled_lines(&self.lines)
    }

    fn saw(&self, line: &str) -> bool {
        common::printed(&self.lines, line)
    }

    fn kill(mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().unwrap();
    }
}

fn in_cm(name: &str, value: &str, mode: &str) -> serde_json::Value {
    json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": "in"},
        "data": {"value": value, "mode": mode},
    })
}

fn mode_of(i: usize) -> &'static str {
    match i % 10 {
        0 => "fail",
        1 => "short",
        _ => "ok",
    }
}

/// `name -> (resourceVersion, value)` of the ConfigMaps of `ns` on the server.
fn server(h: &ServerHandle, ns: &str) -> BTreeMap<String, (String, String)> {
    h.list(&ResourceType::configmaps())
        .into_iter()
        .filter(|o| o["metadata"]["namespace"] == ns)
        .map(|o| {
            let name = o["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let rv = o["metadata"]["resourceVersion"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let value = o["data"]["value"].as_str().unwrap_or_default().to_string();
            (name, (rv, value))
        })
        .collect()
}

/// Changes the value of a random existing object of `in`.
fn change_one(h: &ServerHandle, rng: &mut StdRng, tag: &str) {
    let names: Vec<String> = server(h, "in").into_keys().collect();
    if names.is_empty() {
        return;
    }
    let name = &names[rng.random_range(0..names.len())];
    if let Some(mut o) = h.get(&ResourceType::configmaps(), Some("in"), name) {
        o["data"]["value"] = json!(format!("{tag}-{}", rng.random::<u32>()));
        h.apply(&ResourceType::configmaps(), o);
    }
}

/// `name -> resourceVersion` of the objects in the killed child's store.
fn stored(engine: Engine, dir: &std::path::Path) -> HashMap<String, String> {
    let db = common::try_open_db(engine, dir).expect("open the killed child's store");
    let Ok(objects) = db.raw_objects("in") else {
        return HashMap::new();
    };
    objects
        .map(|o| {
            let (key, json) = o.unwrap();
            let v: serde_json::Value = serde_json::from_slice(&json).unwrap();
            let rv = v["metadata"]["resourceVersion"]
                .as_str()
                .unwrap_or_default();
            (
                key.rsplit('/').next().unwrap_or_default().to_string(),
                rv.to_string(),
            )
        })
        .collect()
}

/// The state the killed child left on disk: `name -> (handled version, due)`.
fn state_on_disk(
    engine: Engine,
    dir: &std::path::Path,
) -> HashMap<String, (Option<String>, Option<SystemTime>)> {
    let db = common::try_open_db(engine, dir).expect("open the killed child's store");
    let states = match db.reconcile_states(CONTROLLER) {
        Ok(states) => states.map(|s| s.unwrap()).collect(),
        Err(_) => Vec::new(), // killed before the state was created
    };
    states
        .into_iter()
        .map(|s| {
            let handled = s
                .failed_resource_version
                .clone()
                .or(s.resource_version.clone());
            (s.name, (handled, s.due))
        })
        .collect()
}

async fn restart_reconciles_exactly_what_changed_or_fell_due(engine: Engine) {
    common::init_tracing();
    let seed = common::test_seed("KP_STATE_SEED", DEFAULT_SEED);
    let _report = common::SeedReport(format!("KP_STATE_SEED={seed} (engine {engine})"));
    let mut rng = StdRng::seed_from_u64(seed);
    let server_proc = TestServer::start_with(ServerOptions {
        history: 100_000,
        ..ServerOptions::default()
    })
    .await;
    let h = server_proc.handle();
    let url = server_proc.url();
    for i in 0..OBJECTS {
        h.apply(
            &ResourceType::configmaps(),
            in_cm(&format!("cm-{i}"), "v0", mode_of(i)),
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let mut created = OBJECTS;
    for round in 0..ROUNDS {
        // Run with requeues and failures; SIGKILL at a random moment while objects change.
        let first = Running::spawn(engine, dir.path(), &url, false, "");
        let kill_after = rng.random_range(20..OBJECTS * 4);
        let deadline = Instant::now() + common::WAIT;
        while first.reconciled().len() < kill_after {
            assert!(
                Instant::now() < deadline,
                "round {round}: the child made no progress"
            );
            change_one(&h, &mut rng, &format!("r{round}"));
            tokio::time::sleep(Duration::from_millis(rng.random_range(0..8))).await;
        }
        first.kill();

        // While it is down: changes, deletions, creations.
        for _ in 0..15 {
            change_one(&h, &mut rng, &format!("down{round}"));
        }
        let names: Vec<String> = server(&h, "in").into_keys().collect();
        for _ in 0..2 {
            let name = &names[rng.random_range(0..names.len())];
            h.delete(&ResourceType::configmaps(), Some("in"), name);
        }
        for _ in 0..2 {
            h.apply(
                &ResourceType::configmaps(),
                in_cm(&format!("cm-{created}"), "new", mode_of(created)),
            );
            created += 1;
        }

        // Let the short requeues and retries fall due, then derive what the restart owes.
        let state = state_on_disk(engine, dir.path());
        let store = stored(engine, dir.path());
        let soon = SystemTime::now() + Duration::from_secs(600);
        if let Some(last_short) = state
            .values()
            .filter_map(|(_, due)| *due)
            .filter(|d| *d < soon)
            .max()
        {
            while SystemTime::now() <= last_short + Duration::from_millis(50) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let now = SystemTime::now();
        let objects = server(&h, "in");
        let mut expected: Vec<String> = objects
            .iter()
            .filter(|(name, (rv, _))| match state.get(*name) {
                None => true,
                Some((handled, due)) => {
                    handled.as_deref() != Some(rv.as_str()) || due.is_some_and(|d| d <= now)
                }
            })
            .map(|(name, _)| name.clone())
            .collect();
        expected.sort();

        // The restart: every requeue one hour away, so each owed reconcile happens once.
        let last = round + 1 == ROUNDS;
        let sentinel = format!("sentinel-{round}");
        let second = Running::spawn(
            engine,
            dir.path(),
            &url,
            true,
            if last { &sentinel } else { "" },
        );
        let deadline = Instant::now() + common::WAIT;
        loop {
            let done = second.reconciled();
            if expected.iter().all(|e| done.contains(e)) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "round {round}: owed reconciles missing: {:?}",
                expected
                    .iter()
                    .filter(|e| !done.contains(e))
                    .collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Barrier: a new object is reconciled after whatever the start scheduled.
        h.apply(&ResourceType::configmaps(), in_cm(&sentinel, "s", "ok"));
        common::eventually("the sentinel reconciled", || {
            second.reconciled().contains(&sentinel)
        })
        .await;
        // Each owed object once at its current version. The one exception is inherent to
        // resuming from a checkpoint: an object whose stored version is older than the
        // server's may be reconciled at the stored version (the startup pass reads the store)
        // before the watch delivers the newer one (or its deletion).
        let mut by_object: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (name, rv) in second.reconciles() {
            if name != sentinel {
                by_object.entry(name).or_default().push(rv);
            }
        }
        let owed_if_present = |name: &str, rv: &str| match state.get(name) {
            None => true,
            Some((handled, due)) => handled.as_deref() != Some(rv) || due.is_some_and(|d| d <= now),
        };
        let deleted: Vec<_> = by_object
            .iter()
            .filter(|(name, _)| !objects.contains_key(*name))
            .map(|(name, rvs)| (name.clone(), rvs.clone()))
            .collect();
        for (name, rvs) in &deleted {
            let at = store.get(name);
            assert!(
                at.is_some_and(|at| *rvs == [at.clone()] && owed_if_present(name, at)),
                "round {round}: {name}, deleted while down, reconciled at {rvs:?}: only once, \
                 at its stored version {at:?}, and only if that version was owed"
            );
            by_object.remove(name);
        }
        let done: Vec<String> = by_object.keys().cloned().collect();
        let stale = by_object.values().filter(|v| v.len() > 1).count();
        println!(
            "round {round}: killed after {kill_after} reconciles; restart reconciled {} of {} \
             objects (owed {}; {} of them also at a stale stored version; {} deleted while down \
             reconciled at their stored version)",
            done.len(),
            objects.len(),
            expected.len(),
            stale,
            deleted.len()
        );
        let missing: Vec<_> = expected.iter().filter(|e| !done.contains(e)).collect();
        let extra: Vec<_> = done.iter().filter(|d| !expected.contains(d)).collect();
        assert_eq!(
            done, expected,
            "round {round}: the restart reconciled exactly the owed objects; extra: {extra:?}, \
             missing: {missing:?}"
        );
        for (name, rvs) in &by_object {
            let current = &objects[name].0;
            assert_eq!(
                rvs.last(),
                Some(current),
                "round {round}: {name} last reconciled at its version"
            );
            if rvs.len() > 1 {
                assert_eq!(rvs.len(), 2, "round {round}: {name} reconciled at {rvs:?}");
                assert!(
                    store.get(name) == Some(&rvs[0]) && rvs[0] != *current,
                    "round {round}: {name}'s extra reconcile {rvs:?} is at the stale stored version {:?}",
                    store.get(name)
                );
            }
        }

        // What a full reconcile gives: every `in` object mirrored in `out`.
        let mirrored = server(&h, "out");
        for (name, (_, value)) in server(&h, "in") {
            assert_eq!(
                mirrored.get(&name).map(|m| &m.1),
                Some(&value),
                "round {round}: out/{name} mirrors in/{name}"
            );
        }
        if !last {
            second.kill();
            continue;
        }
        // A graceful stop writes the last results: the state tracks exactly the objects
        // that exist, at their current versions.
        common::eventually("the child stopped", || second.saw("child-stopped")).await;
        let mut second = second;
        second.child.wait().unwrap();
        let state = state_on_disk(engine, dir.path());
        let objects = server(&h, "in");
        let tracked: BTreeMap<_, _> = state
            .iter()
            .map(|(k, v)| (k.clone(), v.0.clone()))
            .collect();
        let current: BTreeMap<_, _> = objects
            .iter()
            .map(|(k, v)| (k.clone(), Some(v.0.clone())))
            .collect();
        assert_eq!(
            tracked, current,
            "the state tracks every object at its version, and no deleted one"
        );
        let db = common::try_open_db(engine, dir.path()).unwrap();
        let info = db.controller_states().unwrap();
        assert_eq!(info.len(), 1);
        assert_eq!(info[0].name, CONTROLLER);
        assert_eq!(info[0].kinds, vec!["v1/ConfigMap".to_string()]);
        assert_eq!(info[0].objects as usize, objects.len());
        assert_eq!(
            info[0].pending_requeues as usize,
            objects.len(),
            "every object requeued in an hour"
        );
        assert!(
            info[0]
                .oldest_due
                .is_some_and(|d| d > SystemTime::now() + Duration::from_secs(3000))
        );
    }
}

pub(crate) fn deployment(name: &str, replicas: i32) -> serde_json::Value {
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": "app"},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                 "template": {"metadata": {"labels": {"app": name}}}}
    })
}

/// A durable controller (state `name`) of the Deployments of namespace `app`, stopped
/// gracefully once `stop` fires.
pub(crate) fn deployments_controller(
    db: &kube_persist::Db,
    client: kube::Client,
    config: Config,
    name: &str,
    stop: tokio::sync::oneshot::Receiver<()>,
) -> Controller<k8s_openapi::api::apps::v1::Deployment> {
    db.store(
        "deployments",
        Api::namespaced(client, "app"),
        kube_persist::StreamConfig::default(),
    )
    .map(|pair| Controller::for_store(pair).with_config(config))
    .unwrap()
    .durable_state(name)
    .unwrap()
    .graceful_shutdown_on(async move {
        let _ = stop.await;
    })
}

/// Runs a durable Deployment controller in this process until it reconciled every name of
/// `wanted`; then creates Deployment `last` (reconciled after anything scheduled before it,
/// one reconcile at a time) and stops gracefully once that is reconciled. Returns the names
/// reconciled before `last`, sorted.
async fn run_until(
    db: &kube_persist::Db,
    h: &ServerHandle,
    client: kube::Client,
    generation_filter: bool,
    wanted: &[&str],
    last: &str,
) -> Vec<String> {
    use k8s_openapi::api::apps::v1::Deployment;
    let seen = Arc::new(Mutex::new(Vec::<String>::new()));
    let (tx, rx) = tokio::sync::oneshot::channel();
    let tx = Arc::new(Mutex::new(Some(tx)));
    let config = Config::default().concurrency(1);
    let controller = deployments_controller(db, client, config, "deployer", rx);
    let controller = match generation_filter {
        true => {
            controller.predicate_filter(kube::runtime::predicates::generation, Default::default())
        }
        false => controller,
    };
    let sink = seen.clone();
    let wanted: Vec<String> = wanted.iter().map(|w| w.to_string()).collect();
    let (h, last_name) = (h.clone(), last.to_string());
    controller
        .run(
            move |d: Arc<Deployment>, _ctx: Arc<()>| {
                let name = d.metadata.name.clone().unwrap_or_default();
                let mut seen = sink.lock().unwrap();
                seen.push(name.clone());
                if name == last_name {
                    if let Some(tx) = tx.lock().unwrap().take() {
                        let _ = tx.send(());
                    }
                } else if wanted.iter().all(|w| seen.contains(w)) {
                    h.apply(&ResourceType::deployments(), deployment(&last_name, 1));
                }
                async { Ok::<_, MirrorError>(Action::await_change()) }
            },
            |_, _, _| Action::await_change(),
            Arc::new(()),
        )
        .for_each(|_| async {})
        .await;
    let mut seen = seen.lock().unwrap().clone();
    assert_eq!(seen.pop().as_deref(), Some(last));
    seen.sort();
    seen
}

/// Brings the Deployments stream on disk up to the server (its watcher alone, no
/// controller): a restarted controller then finds the changes in the store, not in the watch.
pub(crate) async fn sync_store(db: &kube_persist::Db, client: kube::Client, h: &ServerHandle) {
    use k8s_openapi::api::apps::v1::Deployment;
    let (reader, watcher) = db
        .store(
            "deployments",
            Api::<Deployment>::namespaced(client, "app"),
            kube_persist::StreamConfig::default(),
        )
        .unwrap();
    let task = tokio::spawn(watcher.run());
    let server = h.resource_version();
    common::eventually("the store caught up", || {
        reader.checkpoint().is_some_and(|c| c == server)
    })
    .await;
    task.abort();
    let _ = task.await;
}

/// The `generation` predicate: the startup pass skips a Deployment whose labels alone
/// changed while the controller was down, and reconciles one whose spec changed; without the
/// filter the label change is reconciled too.
async fn generation_filter_skips_metadata_only_changes(engine: Engine) {
    common::init_tracing();
    let server = TestServer::start().await;
    let h = server.handle();
    let rt = ResourceType::deployments();
    for i in 0..3 {
        h.apply(&rt, deployment(&format!("d-{i}"), 1));
    }
    let dir = tempfile::tempdir().unwrap();
    let db = common::try_open_db(engine, dir.path()).unwrap();
    let relabel = |name: &str, value: &str| {
        let mut d = h.get(&rt, Some("app"), name).unwrap();
        d["metadata"]["labels"] = json!({"touched": value});
        h.apply(&rt, d);
    };
    let c = server.client();
    let first = run_until(&db, &h, c.clone(), true, &["d-0", "d-1", "d-2"], "z-0").await;
    assert_eq!(
        first,
        ["d-0", "d-1", "d-2"],
        "a cold start reconciles every Deployment"
    );

    // While down: d-0's labels (generation unchanged), d-1's spec (generation bumped).
    let generation =
        |name: &str| h.get(&rt, Some("app"), name).unwrap()["metadata"]["generation"].clone();
    let before = (generation("d-0"), generation("d-1"));
    relabel("d-0", "a");
    h.apply(&rt, deployment("d-1", 3));
    assert_eq!(generation("d-0"), before.0, "labels leave the generation");
    assert_ne!(generation("d-1"), before.1, "the spec bumps it");
    sync_store(&db, c.clone(), &h).await;
    let second = run_until(&db, &h, c.clone(), true, &["d-1"], "z-1").await;
    assert_eq!(second, ["d-1"], "the label-only change is skipped");

    // The control: the same kind of change without the filter is reconciled.
    relabel("d-0", "b");
    sync_store(&db, c.clone(), &h).await;
    let third = run_until(&db, &h, c, false, &["d-0"], "z-2").await;
    assert_eq!(
        third,
        ["d-0"],
        "without the filter, the label change is reconciled"
    );
}

/// Requeues beyond `Config::requeue_window` stay on disk and are read back when they come
/// near: each object's 2.5 s requeue (window 1 s) fires once, not before it is due, and
/// `Db::controller_states` counts them as pending meanwhile.
async fn far_requeues_are_read_back_from_disk_when_due(engine: Engine) {
    common::init_tracing();
    let server = TestServer::start().await;
    let h = server.handle();
    for i in 0..5 {
        h.apply(
            &ResourceType::configmaps(),
            in_cm(&format!("cm-{i}"), "v", "ok"),
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let db = common::try_open_db(engine, dir.path()).unwrap();
    let times: Arc<Mutex<BTreeMap<String, Vec<Instant>>>> = Arc::default();
    let sink = times.clone();
    let controller = db
        .store(
            "in",
            Api::<ConfigMap>::namespaced(server.client(), "in"),
            kube_persist::StreamConfig::default(),
        )
        .map(|pair| {
            Controller::for_store(pair)
                .with_config(Config::default().requeue_window(Duration::from_secs(1)))
        })
        .unwrap()
        .durable_state("requeuer")
        .unwrap();
    let run = controller.run(
        move |cm: Arc<ConfigMap>, _ctx: Arc<()>| {
            let name = cm.metadata.name.clone().unwrap_or_default();
            let mut times = sink.lock().unwrap();
            let seen = times.entry(name).or_default();
            seen.push(Instant::now());
            let action = if seen.len() == 1 {
                Action::requeue(Duration::from_millis(2500))
            } else {
                Action::await_change()
            };
            async move { Ok::<_, MirrorError>(action) }
        },
        |_, _, _| Action::await_change(),
        Arc::new(()),
    );
    let task = tokio::spawn(run.for_each(|_| async {}));
    common::eventually("every object reconciled once", || {
        times.lock().unwrap().len() == 5
    })
    .await;
    common::eventually("the requeues recorded on disk", || {
        db.controller_states()
            .unwrap()
            .first()
            .is_some_and(|c| c.objects == 5 && c.pending_requeues == 5)
    })
    .await;
    common::eventually("every requeue fired", || {
        times.lock().unwrap().values().all(|t| t.len() == 2)
    })
    .await;
    for (name, t) in times.lock().unwrap().iter() {
        let waited = t[1] - t[0];
        assert!(
            waited >= Duration::from_millis(2400),
            "{name} requeued after {waited:?}, before it was due"
        );
    }
    common::eventually("no requeue pending any more", || {
        db.controller_states()
            .unwrap()
            .first()
            .is_some_and(|c| c.pending_requeues == 0 && c.oldest_due.is_none())
    })
    .await;
    task.abort();
}

engine_tests!(async: restart_reconciles_exactly_what_changed_or_fell_due,
    generation_filter_skips_metadata_only_changes, far_requeues_are_read_back_from_disk_when_due);
