//! kube-persist's `Controller` against the testkit API server over real HTTP, with real
//! stores (the default engine, redb): reconcile semantics (one reconcile per object at a
//! time, concurrency limit, requeue, error policy, related triggers, graceful shutdown,
//! warm-restart sweeps), the persistent watcher as a trigger of kube-runtime's own
//! `Controller`, and an end-to-end crash test: the example operator (examples/operator.rs)
//! in a child process labels 5,000 Pods, is SIGKILLed mid-way, restarts, and converges with
//! zero LIST calls.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::{self, Fixture, eventually};
use crate::operator;
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::Api;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube_persist::controller::{Config, Controller, ControllerError, StartupMode};
use kube_persist::{Db, Reader};
use kube_persist_testkit::{ResourceType, ServerHandle, Verb};
use serde_json::json;
use tokio::sync::oneshot;

fn store_cfg() -> kube_persist::StreamConfig {
    kube_persist::StreamConfig::default()
        .backoff(Duration::from_millis(20), Duration::from_millis(200))
        .relist_jitter(Duration::from_millis(10))
}

fn key<K: kube::Resource>(k: &K) -> String {
    let m = k.meta();
    format!(
        "{}/{}",
        m.namespace.clone().unwrap_or_default(),
        m.name.clone().unwrap_or_default()
    )
}

#[derive(Debug, thiserror::Error)]
#[error("injected failure {0}")]
struct Boom(usize);

/// Per-object bookkeeping shared by the test reconcilers.
#[derive(Default)]
struct Book {
    active: Mutex<HashSet<String>>,
    running: AtomicUsize,
    max_running: AtomicUsize,
    overlaps: AtomicUsize,
    started: AtomicUsize,
    finished: AtomicUsize,
    times: Mutex<HashMap<String, Vec<Instant>>>,
}

impl Book {
    fn enter(&self, k: &str) {
        if !self.active.lock().unwrap().insert(k.to_string()) {
            self.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_running.fetch_max(now, Ordering::SeqCst);
        self.started.fetch_add(1, Ordering::SeqCst);
        self.times
            .lock()
            .unwrap()
            .entry(k.to_string())
            .or_default()
            .push(Instant::now());
    }

    fn leave(&self, k: &str) {
        self.active.lock().unwrap().remove(k);
        self.running.fetch_sub(1, Ordering::SeqCst);
        self.finished.fetch_add(1, Ordering::SeqCst);
    }

    fn count(&self, k: &str) -> usize {
        self.times.lock().unwrap().get(k).map_or(0, Vec::len)
    }

    fn distinct(&self) -> usize {
        self.times.lock().unwrap().len()
    }

    fn clear(&self) {
        self.times.lock().unwrap().clear();
    }
}

/// Runs a controller's result stream on a task, collecting its errors as strings.
fn spawn_run<S, T, E>(s: S) -> (tokio::task::JoinHandle<()>, Arc<Mutex<Vec<String>>>)
where
    S: futures::Stream<Item = Result<T, E>> + Send + 'static,
    E: std::fmt::Display,
{
    let errors = Arc::new(Mutex::new(Vec::new()));
    let sink = errors.clone();
    let task = tokio::spawn(s.for_each(move |r| {
        if let Err(e) = r {
            sink.lock().unwrap().push(e.to_string());
        }
        async {}
    }));
    (task, errors)
}

fn touch_pod(h: &ServerHandle, ns: &str, name: &str, tag: &str) {
    let rt = ResourceType::pods();
    let mut o = h.get(&rt, Some(ns), name).expect("pod exists");
    o["metadata"]["labels"]["touched"] = tag.into();
    h.apply(&rt, o);
}

/// Sets `data.k` of configmap `app/name`.
fn set_configmap(h: &ServerHandle, name: &str, value: &str) {
    let rt = ResourceType::configmaps();
    let mut o = h.get(&rt, Some("app"), name).expect("configmap exists");
    o["data"]["k"] = value.into();
    h.apply(&rt, o);
}

/// Sets the `barrier` annotation of deployment `app/name`.
fn annotate_deployment(h: &ServerHandle, name: &str, value: &str) {
    let rt = ResourceType::deployments();
    let mut o = h.get(&rt, Some("app"), name).expect("deployment exists");
    o["metadata"]["annotations"]["barrier"] = value.into();
    h.apply(&rt, o);
}

/// What the reconciles of a sentinel Deployment (`app/d-c`, owner of pod `app/c-0` and named
/// by configmap `app/cm-c`) saw, one line per reconcile:
/// `;self=<its barrier annotation>;pod=<c-0's touched label>;cm=<cm-c's data.k>;`.
#[derive(Default)]
struct Seen(Mutex<Vec<String>>);

impl Seen {
    fn record(&self, d: &Deployment, pods: &Reader<Pod>, cms: Option<&Reader<ConfigMap>>) {
        let own = d
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("barrier").cloned());
        let pod = pods
            .get_named(Some("app"), "c-0")
            .ok()
            .flatten()
            .and_then(|p| p.metadata.labels.as_ref()?.get("touched").cloned());
        let cm = cms
            .and_then(|r| r.get_named(Some("app"), "cm-c").ok().flatten())
            .and_then(|c| c.data.as_ref()?.get("k").cloned());
        let line = format!(
            ";self={};pod={};cm={};",
            own.unwrap_or_default(),
            pod.unwrap_or_default(),
            cm.unwrap_or_default()
        );
        self.0.lock().unwrap().push(line);
    }

    fn saw(&self, slot: &str, token: &str) -> bool {
        let want = format!(";{slot}={token};");
        self.0.lock().unwrap().iter().any(|l| l.contains(&want))
    }
}

/// A positive signal that one trigger stream delivered, and the controller scheduled, what
/// came before: change the sentinel's object on that stream (`change(token)`: `slot` is
/// `pod`, `cm` or `self`) and wait for a reconcile of the sentinel Deployment that saw the
/// change. Twice: requests due at once leave the scheduler in no set order and their
/// objects are read from disk concurrently, so a request that was queued before the first
/// change has started by the time a reconcile saw the second one.
async fn barrier(seen: &Seen, slot: &str, tag: &str, change: impl Fn(&str)) {
    for round in 0..2 {
        let token = format!("{tag}-{round}");
        change(&token);
        eventually(
            &format!("a sentinel reconcile that saw {slot}={token}"),
            || seen.saw(slot, &token),
        )
        .await;
    }
}

fn configmap(name: &str, target: &str) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": {"name": name, "namespace": "app", "labels": {"target": target}},
           "data": {"k": "v"}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_reconcile_per_object_at_a_time_within_the_concurrency_limit() {
    let fx = Fixture::with_pods(100, 2).await;
    let h = &fx.h;
    let db = Db::open(fx.path()).unwrap();
    let controller = db
        .store("pods", fx.pods(), store_cfg())
        .map(|pair| Controller::for_store(pair).with_config(Config::default().concurrency(4)))
        .unwrap();
    let book = Arc::new(Book::default());
    let run = controller.run(
        |pod: Arc<Pod>, book: Arc<Book>| async move {
            let k = key(pod.as_ref());
            book.enter(&k);
            tokio::time::sleep(Duration::from_millis(15)).await;
            book.leave(&k);
            // Demand stays under capacity (4 / 15 ms): under overload kube-runtime's
            // scheduler serves pending requests in hash order, which can starve some.
            Ok::<_, Boom>(Action::requeue(Duration::from_millis(1000)))
        },
        |_, _, _| Action::await_change(),
        book.clone(),
    );
    let (task, errors) = spawn_run(run);
    // Hammer ten pods with changes while they are being reconciled.
    let until = Instant::now() + Duration::from_millis(2500);
    let mut i = 0;
    while Instant::now() < until {
        touch_pod(
            h,
            &format!("ns-{}", i % 2),
            &format!("pod-{}", i % 10),
            &i.to_string(),
        );
        i += 1;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    task.abort();
    assert_eq!(
        book.overlaps.load(Ordering::SeqCst),
        0,
        "two reconciles of one object at once"
    );
    let max = book.max_running.load(Ordering::SeqCst);
    assert!(max <= 4, "concurrency limit 4 exceeded: {max}");
    assert_eq!(max, 4, "the limit should be reached under load");
    assert_eq!(book.distinct(), 100, "every pod reconciled");
    for n in 0..10 {
        let k = format!("ns-{}/pod-{n}", n % 2);
        assert!(
            book.count(&k) >= 3,
            "{k} reconciled {} times",
            book.count(&k)
        );
    }
    assert!(
        errors.lock().unwrap().is_empty(),
        "{:?}",
        errors.lock().unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requeue_after_action_and_await_change() {
    let fx = Fixture::with_pods(3, 1).await;
    let db = Db::open(fx.path()).unwrap();
    let (reader, watcher) = db.store("pods", fx.pods(), store_cfg()).unwrap();
    let book = Arc::new(Book::default());
    let run = Controller::for_store((reader, watcher))
        .with_config(Config::default())
        .run(
            |pod: Arc<Pod>, book: Arc<Book>| async move {
                let k = key(pod.as_ref());
                book.enter(&k);
                book.leave(&k);
                Ok::<_, Boom>(if k == "ns-0/pod-2" {
                    Action::await_change()
                } else {
                    Action::requeue(Duration::from_millis(300))
                })
            },
            |_, _, _| Action::await_change(),
            book.clone(),
        );
    let (task, _errors) = spawn_run(run);
    // Positive signal instead of a time window: pod-0 and pod-1 were requeued four times
    // each. A requeue of pod-2 scheduled like theirs would have run long before.
    eventually("pod-0 and pod-1 requeued four times", || {
        book.count("ns-0/pod-0") >= 5 && book.count("ns-0/pod-1") >= 5
    })
    .await;
    let times = book.times.lock().unwrap().clone();
    task.abort();
    for k in ["ns-0/pod-0", "ns-0/pod-1"] {
        for w in times[k].windows(2) {
            let gap = w[1] - w[0];
            assert!(
                gap >= Duration::from_millis(290),
                "{k} requeued after {gap:?}"
            );
            assert!(
                gap < Duration::from_secs(3),
                "{k} requeued only after {gap:?} (asked for 300 ms)"
            );
        }
    }
    assert_eq!(
        times["ns-0/pod-2"].len(),
        1,
        "await_change: no requeue (meanwhile pod-0 and pod-1 ran {} and {} times)",
        times["ns-0/pod-0"].len(),
        times["ns-0/pod-1"].len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_policy_decides_the_retries() {
    let fx = Fixture::with_pods(3, 1).await;
    let db = Db::open(fx.path()).unwrap();
    let controller = db
        .store("pods", fx.pods(), store_cfg())
        .map(|pair| Controller::for_store(pair).with_config(Config::default()))
        .unwrap();
    let attempts = Arc::new(AtomicUsize::new(0));
    let policy_calls = Arc::new(Mutex::new(Vec::new()));
    let seen = policy_calls.clone();
    let mut run = std::pin::pin!(controller.run(
        |pod: Arc<Pod>, attempts: Arc<AtomicUsize>| async move {
            if pod.metadata.name.as_deref() != Some("pod-1") {
                return Ok(Action::await_change());
            }
            let n = attempts.fetch_add(1, Ordering::SeqCst);
            if n < 3 {
                Err(Boom(n))
            } else {
                Ok(Action::await_change())
            }
        },
        move |pod: Arc<Pod>, err: &Boom, _| {
            seen.lock()
                .unwrap()
                .push((key(pod.as_ref()), err.0, Instant::now()));
            Action::requeue(Duration::from_millis(50))
        },
        attempts.clone(),
    ));
    let mut failures = Vec::new();
    let mut ok = HashSet::new();
    while ok.len() < 3 {
        let item = tokio::time::timeout(common::WAIT, run.next())
            .await
            .expect("a result")
            .expect("the stream goes on");
        match item {
            Ok((obj_ref, _)) => {
                ok.insert(obj_ref.name.clone());
            }
            Err(ControllerError::ReconcilerFailed(e, obj_ref)) => {
                failures.push((obj_ref.name, e.0))
            }
            Err(other) => panic!("unexpected error {other}"),
        }
    }
    assert_eq!(
        failures,
        vec![
            ("pod-1".into(), 0),
            ("pod-1".into(), 1),
            ("pod-1".into(), 2)
        ]
    );
    assert_eq!(
        attempts.load(Ordering::SeqCst),
        4,
        "3 failures then a success"
    );
    let calls = policy_calls.lock().unwrap();
    let errs: Vec<_> = calls.iter().map(|(k, e, _)| (k.as_str(), *e)).collect();
    assert_eq!(
        errs,
        vec![("ns-0/pod-1", 0), ("ns-0/pod-1", 1), ("ns-0/pod-1", 2)]
    );
}

fn deployment(ns: &str, name: &str) -> serde_json::Value {
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"selector": {"matchLabels": {"app": name}}, "template": {"metadata": {"labels": {"app": name}}}}
    })
}

fn owned_pod(ns: &str, name: &str, owner: &serde_json::Value, seed: u64) -> serde_json::Value {
    let mut pod = kube_persist_testkit::make_pod(ns, name, seed);
    pod["metadata"]["ownerReferences"] = json!([{
        "apiVersion": "apps/v1", "kind": "Deployment", "controller": true,
        "name": owner["metadata"]["name"], "uid": owner["metadata"]["uid"],
    }]);
    pod
}

/// Two Deployments on disk; Pods (on disk) owned by `d-a`; a ConfigMap (on disk) pointing
/// at `d-b` by label. Changes of each related object reconcile exactly the mapped owner,
/// and the reconciler reads the children from the Pods' Reader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owns_and_watches_stores_trigger_the_mapped_objects() {
    let fx = Fixture::new().await;
    let h = &fx.h;
    let (deps, pods, cms) = (
        ResourceType::deployments(),
        ResourceType::pods(),
        ResourceType::configmaps(),
    );
    let da = h.create(&deps, deployment("app", "d-a")).unwrap();
    h.create(&deps, deployment("app", "d-b")).unwrap();
    for i in 0..3 {
        h.create(&pods, owned_pod("app", &format!("a-{i}"), &da, i))
            .unwrap();
    }
    h.create(&cms, configmap("cm", "d-b")).unwrap();
    // The sentinel d-c, its pod and its configmap: changes of them prove that a stream has
    // delivered everything before (see `barrier`).
    let dc = h.create(&deps, deployment("app", "d-c")).unwrap();
    h.create(&pods, owned_pod("app", "c-0", &dc, 9)).unwrap();
    h.create(&cms, configmap("cm-c", "d-c")).unwrap();

    let db = Db::open(fx.path()).unwrap();
    let client = fx.server.client();
    let (pod_reader, pod_watcher) = db
        .store("pods", Api::<Pod>::all(client.clone()), store_cfg())
        .unwrap();
    let cm_pair = db
        .store(
            "configmaps",
            Api::<ConfigMap>::all(client.clone()),
            store_cfg(),
        )
        .unwrap();
    let cm_reader = cm_pair.0.clone();
    let controller = db
        .store("deployments", Api::<Deployment>::all(client), store_cfg())
        .map(|pair| Controller::for_store(pair).with_config(Config::default()))
        .unwrap()
        .owns_store((pod_reader.clone(), pod_watcher))
        .watches_store(cm_pair, |cm: ConfigMap| {
            let ns = cm.metadata.namespace.clone().unwrap_or_default();
            cm.metadata
                .labels
                .and_then(|l| l.get("target").cloned())
                .map(|d| ObjectRef::<Deployment>::new(&d).within(&ns))
        });

    struct Ctx {
        book: Book,
        pods: Reader<Pod>,
        cms: Reader<ConfigMap>,
        children: Mutex<HashMap<String, usize>>,
        seen: Seen,
    }
    let ctx = Arc::new(Ctx {
        book: Book::default(),
        pods: pod_reader,
        cms: cm_reader,
        children: Mutex::new(HashMap::new()),
        seen: Seen::default(),
    });
    let (task, errors) = spawn_run(controller.run(
        |d: Arc<Deployment>, ctx: Arc<Ctx>| async move {
            let k = key(d.as_ref());
            ctx.book.enter(&k);
            if k == "app/d-c" {
                ctx.seen.record(&d, &ctx.pods, Some(&ctx.cms));
            }
            let uid = d.metadata.uid.clone();
            let n = ctx
                .pods
                .iter_namespace("app")
                .filter(|p| {
                    p.as_ref()
                        .unwrap()
                        .metadata
                        .owner_references
                        .iter()
                        .flatten()
                        .any(|o| Some(&o.uid) == uid.as_ref())
                })
                .count();
            ctx.children.lock().unwrap().insert(k.clone(), n);
            ctx.book.leave(&k);
            Ok::<_, Boom>(Action::await_change())
        },
        |_, _, _| Action::await_change(),
        ctx.clone(),
    ));

    // Start: all reconciled (the sweep after the first list, and the related triggers).
    // Whatever the first lists triggered has run once each of the three streams delivered a
    // later change of the sentinel's objects.
    eventually("the deployments reconciled", || ctx.book.distinct() == 3).await;
    barrier(&ctx.seen, "self", "start", |t| {
        annotate_deployment(h, "d-c", t)
    })
    .await;
    barrier(&ctx.seen, "pod", "start", |t| touch_pod(h, "app", "c-0", t)).await;
    barrier(&ctx.seen, "cm", "start", |t| set_configmap(h, "cm-c", t)).await;
    assert_eq!(ctx.children.lock().unwrap()["app/d-a"], 3);
    ctx.book.clear();

    // A child Pod changes: its owner is reconciled, the other Deployment is not (not up to
    // a later change on the pod stream either).
    touch_pod(h, "app", "a-1", "x");
    eventually("owner of the changed pod reconciled", || {
        ctx.book.count("app/d-a") >= 1
    })
    .await;
    barrier(&ctx.seen, "pod", "after-a-1", |t| {
        touch_pod(h, "app", "c-0", t)
    })
    .await;
    assert_eq!(ctx.book.count("app/d-b"), 0, "d-b does not own the pod");
    ctx.book.clear();

    // The watched ConfigMap changes: the Deployment its mapper names is reconciled, the
    // other is not (not up to a later change on the configmap stream either).
    set_configmap(h, "cm", "w");
    eventually("mapped deployment reconciled", || {
        ctx.book.count("app/d-b") >= 1
    })
    .await;
    barrier(&ctx.seen, "cm", "after-cm", |t| set_configmap(h, "cm-c", t)).await;
    assert_eq!(
        ctx.book.count("app/d-a"),
        0,
        "the configmap maps to d-b only"
    );

    // A child is deleted: the owner is reconciled and sees one child less.
    h.delete(&pods, Some("app"), "a-0").unwrap();
    eventually("owner sees the deletion", || {
        ctx.children.lock().unwrap().get("app/d-a") == Some(&2)
    })
    .await;
    task.abort();
    assert_eq!(ctx.book.overlaps.load(Ordering::SeqCst), 0);
    assert!(
        errors.lock().unwrap().is_empty(),
        "{:?}",
        errors.lock().unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_lets_running_reconciles_finish() {
    let fx = Fixture::with_pods(20, 1).await;
    let db = Db::open(fx.path()).unwrap();
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    /// Reconciles wait at the gate until the test closes it: they are certainly running
    /// when the signal comes, not merely likely to be (no sleep inside).
    struct Gated {
        book: Book,
        gate: tokio::sync::Semaphore,
    }
    let ctx = Arc::new(Gated {
        book: Book::default(),
        gate: tokio::sync::Semaphore::new(0),
    });
    let run = db
        .store("pods", fx.pods(), store_cfg())
        .map(|pair| Controller::for_store(pair).with_config(Config::default().concurrency(5)))
        .unwrap()
        .graceful_shutdown_on(async move {
            let _ = stop_rx.await;
        })
        .run(
            |pod: Arc<Pod>, ctx: Arc<Gated>| async move {
                let k = key(pod.as_ref());
                ctx.book.enter(&k);
                // Closed by the test: the acquire then fails at once.
                let _ = ctx.gate.acquire().await;
                ctx.book.leave(&k);
                Ok::<_, Boom>(Action::requeue(Duration::from_millis(1)))
            },
            |_, _, _| Action::await_change(),
            ctx.clone(),
        );
    let book = &ctx.book;
    let done = tokio::spawn(run.count());
    eventually("five reconciles running", || {
        book.running.load(Ordering::SeqCst) == 5
    })
    .await;
    stop_tx.send(()).unwrap();
    // The five slots are held at the gate: nothing can start or finish meanwhile.
    let started_at_signal = book.started.load(Ordering::SeqCst);
    assert_eq!(started_at_signal, 5, "the concurrency limit is 5");
    ctx.gate.close();
    let results = tokio::time::timeout(Duration::from_secs(5), done)
        .await
        .expect("the run stream ends after a graceful shutdown")
        .unwrap();
    assert_eq!(
        book.started.load(Ordering::SeqCst),
        started_at_signal,
        "no reconcile starts after the signal"
    );
    assert_eq!(
        book.finished.load(Ordering::SeqCst),
        book.started.load(Ordering::SeqCst),
        "running reconciles finished"
    );
    assert_eq!(results, started_at_signal, "one result per reconcile");
    // The watcher was stopped: the stream can be opened again.
    db.store("pods", fx.pods(), store_cfg())
        .expect("stream released after shutdown");
}

/// The pod `run_until` changes at the end.
const SENTINEL: &str = "ns-0/pod-0";

/// Runs a controller until `n` distinct pods were reconciled and then a change of
/// [`SENTINEL`] (made twice, with labels `<tag>-0` and `<tag>-1`) was reconciled each time,
/// then shuts it down gracefully. The sentinel's reconciles come after anything the watch
/// delivered before its changes: the book then holds every reconcile the start caused, and
/// two more of the sentinel.
async fn run_until(db: &Db, fx: &Fixture, cfg: Config, book: Arc<Book>, n: usize, tag: &str) {
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let run = db
        .store("pods", fx.pods(), store_cfg())
        .map(|pair| Controller::for_store(pair).with_config(cfg))
        .unwrap()
        .graceful_shutdown_on(async move {
            let _ = stop_rx.await;
        })
        .run(
            |pod: Arc<Pod>, book: Arc<Book>| async move {
                let k = key(pod.as_ref());
                book.enter(&k);
                book.leave(&k);
                Ok::<_, Boom>(Action::await_change())
            },
            |_, _, _| Action::await_change(),
            book.clone(),
        );
    let done = tokio::spawn(run.count());
    eventually("pods reconciled", || book.distinct() >= n).await;
    let h = &fx.h;
    let (ns, name) = SENTINEL.split_once('/').unwrap();
    for round in 0..2 {
        let before = book.count(SENTINEL);
        touch_pod(h, ns, name, &format!("{tag}-{round}"));
        eventually("the sentinel pod reconciled after its change", || {
            book.count(SENTINEL) > before
        })
        .await;
    }
    let _ = stop_tx.send(());
    done.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_restart_reconciles_every_stored_object_from_disk_without_list() {
    let fx = Fixture::with_pods(300, 3).await;
    let h = &fx.h;
    let db = Db::open(fx.path()).unwrap();

    // Cold start: one reconcile per pod, after the first list (and two of the sentinel's
    // changes, see `run_until`).
    let book = Arc::new(Book::default());
    run_until(
        &db,
        &fx,
        Config::default().pass_chunk(40),
        book.clone(),
        300,
        "cold",
    )
    .await;
    assert_eq!(
        book.started.load(Ordering::SeqCst),
        300 + 2,
        "exactly one reconcile per pod (and one per change of the sentinel)"
    );
    assert_eq!(book.distinct(), 300);
    assert_eq!(book.count(SENTINEL), 1 + 2);

    // Warm restart: every stored pod again, read from disk in chunks; no LIST.
    h.reset_counts();
    let book = Arc::new(Book::default());
    run_until(
        &db,
        &fx,
        Config::default().pass_chunk(40),
        book.clone(),
        300,
        "warm",
    )
    .await;
    assert_eq!(book.started.load(Ordering::SeqCst), 300 + 2);
    assert_eq!(book.distinct(), 300);
    assert_eq!(book.count(SENTINEL), 1 + 2);
    assert_eq!(h.counts().list, 0, "a warm restart lists nothing");

    // StartupMode::Nothing: only changes are reconciled.
    let book = Arc::new(Book::default());
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let run = db
        .store("pods", fx.pods(), store_cfg())
        .map(|pair| {
            Controller::for_store(pair).with_config(Config::default().startup(StartupMode::Nothing))
        })
        .unwrap()
        .graceful_shutdown_on(async move {
            let _ = stop_rx.await;
        })
        .run(
            |pod: Arc<Pod>, book: Arc<Book>| async move {
                book.enter(&key(pod.as_ref()));
                book.leave(&key(pod.as_ref()));
                Ok::<_, Boom>(Action::await_change())
            },
            |_, _, _| Action::await_change(),
            book.clone(),
        );
    let done = tokio::spawn(run.count());
    // Positive signal instead of a quiet period: a changed pod is reconciled (twice, as in
    // `barrier`); nothing else was, before or in between.
    for round in 0..2 {
        touch_pod(h, "ns-1", "pod-7", &format!("x-{round}"));
        eventually("changed pod reconciled", || {
            book.count("ns-1/pod-7") > round
        })
        .await;
    }
    assert_eq!(book.count("ns-1/pod-7"), 2);
    assert_eq!(book.distinct(), 1, "nothing reconciled without a change");
    let _ = stop_tx.send(());
    done.await.unwrap();
    assert_eq!(h.counts().list, 0);
}

/// Item 4: the persistent watcher as an owner trigger of kube-runtime's own controller
/// machinery (`applier` with Deployments in kube-runtime's in-memory store, Pods on disk);
/// its errors arrive mapped to kube-runtime's `watcher::Error`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn touched_objects_trigger_kube_runtime_applier() {
    use kube::runtime::controller::{self, trigger_owners, trigger_self};
    use kube::runtime::{WatchStreamExt, applier, reflector, watcher};
    let fx = Fixture::new().await;
    let h = &fx.h;
    let (deps, pods) = (ResourceType::deployments(), ResourceType::pods());
    let da = h.create(&deps, deployment("app", "d-a")).unwrap();
    h.create(&deps, deployment("app", "d-b")).unwrap();
    h.create(&pods, owned_pod("app", "a-0", &da, 1)).unwrap();
    // The sentinel d-c and its pod (see `barrier`).
    let dc = h.create(&deps, deployment("app", "d-c")).unwrap();
    h.create(&pods, owned_pod("app", "c-0", &dc, 9)).unwrap();

    let db = Db::open(fx.path()).unwrap();
    let client = kube_persist_testkit::client_for_opts(&fx.server.url(), None, false);
    let (pod_reader, pod_watcher) = db
        .store("pods", Api::<Pod>::all(client.clone()), store_cfg())
        .unwrap();
    let (store, writer) = reflector::store::<Deployment>();
    let deployments =
        watcher(Api::<Deployment>::all(client), watcher::Config::default()).default_backoff();
    let queue = futures::stream::select(
        trigger_self(reflector(writer, deployments).applied_objects(), ()),
        trigger_owners(pod_watcher.touched_objects(), (), ()),
    );
    struct Ctx {
        book: Book,
        pods: Reader<Pod>,
        seen: Seen,
    }
    let ctx = Arc::new(Ctx {
        book: Book::default(),
        pods: pod_reader,
        seen: Seen::default(),
    });
    let run = applier(
        |d: Arc<Deployment>, ctx: Arc<Ctx>| {
            Box::pin(async move {
                let k = key(d.as_ref());
                ctx.book.enter(&k);
                if k == "app/d-c" {
                    ctx.seen.record(&d, &ctx.pods, None);
                }
                ctx.book.leave(&k);
                Ok::<_, Boom>(Action::await_change())
            })
        },
        |_, _, _| Action::await_change(),
        ctx.clone(),
        store,
        queue,
        controller::Config::default(),
    );
    let queue_errors = Arc::new(Mutex::new(Vec::new()));
    let sink = queue_errors.clone();
    let task = tokio::spawn(run.for_each(move |r| {
        if let Err(controller::Error::QueueError(e)) = r {
            sink.lock().unwrap().push(e);
        }
        async {}
    }));
    let book = &ctx.book;
    // Whatever the start triggered has run once both streams delivered a later change of
    // the sentinel's objects.
    eventually("the deployments reconciled", || book.distinct() == 3).await;
    barrier(&ctx.seen, "self", "start", |t| {
        annotate_deployment(h, "d-c", t)
    })
    .await;
    barrier(&ctx.seen, "pod", "start", |t| touch_pod(h, "app", "c-0", t)).await;
    book.clear();
    touch_pod(h, "app", "a-0", "x");
    eventually("owner reconciled through the persistent pod stream", || {
        book.count("app/d-a") >= 1
    })
    .await;
    barrier(&ctx.seen, "pod", "after-a-0", |t| {
        touch_pod(h, "app", "c-0", t)
    })
    .await;
    assert_eq!(book.count("app/d-b"), 0, "d-b does not own the pod");

    // Failing WATCH reconnects: the persistent watcher's arrive as WatchFailed with the API
    // status (kube-runtime's own watcher reports WatchStartFailed).
    h.faults().fail_next(Verb::Watch, 403, 10);
    h.faults().close_watches();
    eventually("a mapped watch error", || {
        queue_errors
            .lock()
            .unwrap()
            .iter()
            .any(|e| matches!(e, watcher::Error::WatchFailed(kube::Error::Api(s)) if s.code == 403))
    })
    .await;
    h.faults().clear();
    // And the persistent trigger works again after the errors.
    book.clear();
    eventually("pod watcher reconnected", || {
        touch_pod(h, "app", "a-0", &format!("{:?}", Instant::now()));
        book.count("app/d-a") >= 1
    })
    .await;
    task.abort();
}

// ---- end to end: the example operator, SIGKILLed and restarted ----

const CHILD_DIR: &str = "KP_CONTROLLER_CHILD_DIR";
const PODS: usize = 5000;

/// The child process: the example operator on the persistent store. Started only by
/// `operator_converges_after_sigkill_without_list`.
#[test]
#[ignore = "child process of operator_converges_after_sigkill_without_list"]
fn operator_child() {
    let dir = std::env::var(CHILD_DIR).expect("child mode needs KP_CONTROLLER_CHILD_DIR");
    let url = std::env::var("KP_CONTROLLER_URL").expect("KP_CONTROLLER_URL");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async move {
        let client = kube_persist_testkit::client_for(&url, None);
        let db =
            Db::open_with(&dir, kube_persist::DbConfig::default()).expect("child opens the store");
        let ctx = operator::Ctx::new(client.clone());
        let controller = operator::persistent_controller(&db, client).unwrap();
        let reader = controller.store();
        let run = controller.run(operator::reconcile, operator::error_policy, ctx.clone());
        let task = tokio::spawn(run.for_each(|_| async {}));
        reader.wait_until_ready().await.unwrap();
        db.flush().unwrap(); // the first list is durable: the parent may kill from now on
        println!("\nchild-ready"); // libtest may print "test operator_child ... " first
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let hwm = common::peak_rss_kib();
            println!(
                "state writes={} reconciles={} peak_rss_kib={hwm}",
                ctx.writes.load(Ordering::Relaxed),
                ctx.reconciles.load(Ordering::Relaxed)
            );
            if task.is_finished() {
                break;
            }
        }
    });
}

struct Child {
    child: std::process::Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Child {
    fn spawn(dir: &std::path::Path, url: &str) -> Child {
        let mut child = common::spawn_self(
            "controller::operator_child",
            &[
                (CHILD_DIR, dir.as_os_str()),
                ("KP_CONTROLLER_URL", url.as_ref()),
            ],
        );
        let lines = common::collect_stdout(&mut child, |l| {
            l == "child-ready" || l.starts_with("state ")
        });
        Child { child, lines }
    }

    fn ready(&self) -> bool {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .any(|l| l == "child-ready")
    }

    fn last_state(&self) -> String {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .rev()
            .find(|l| l.starts_with("state "))
            .cloned()
            .unwrap_or_default()
    }

    fn kill(mut self) -> String {
        self.child.kill().expect("SIGKILL");
        self.child.wait().unwrap();
        self.last_state()
    }
}

/// Whether the operator labeled this pod with its owner.
fn is_labeled(p: &serde_json::Value) -> bool {
    let pod: Pod = serde_json::from_value(p.clone()).unwrap();
    pod.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(operator::OWNER_LABEL))
        == Some(&operator::wanted_owner(&pod))
}

/// Pods on the server labeled with their owner by the operator.
fn labeled(h: &ServerHandle) -> usize {
    h.list(&ResourceType::pods())
        .iter()
        .filter(|p| is_labeled(p))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_converges_after_sigkill_without_list() {
    let fx = Fixture::on(common::pod_server(PODS).await);
    let h = &fx.h;
    let url = fx.server.url();

    // First run: cold sync (LISTs), then the operator labels pods; SIGKILL it mid-way.
    let first = Child::spawn(fx.path(), &url);
    let deadline = Instant::now() + common::WAIT;
    while !(first.ready() && h.counts().patch >= 1000) {
        assert!(
            Instant::now() < deadline,
            "first run made no progress: {}",
            first.last_state()
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let at_kill = first.kill();
    let done_before = labeled(h);
    println!(
        "controller e2e: killed the first run at [{at_kill}], {done_before}/{PODS} pods labeled"
    );
    assert!(
        done_before > 0 && done_before < PODS,
        "killed mid-way: {done_before}"
    );

    // Second run: resumes from the checkpoint, sweeps the store from disk, labels the rest.
    h.reset_counts();
    let started = Instant::now();
    let second = Child::spawn(fx.path(), &url);
    let deadline = Instant::now() + common::WAIT;
    loop {
        let n = labeled(h);
        if n == PODS {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not converged: {n}/{PODS}; {}",
            second.last_state()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let took = started.elapsed();
    // Positive signal instead of a quiet period: a pod created now gets labeled too, so the
    // restarted operator has handled whatever its watch delivered before.
    let rt = ResourceType::pods();
    h.apply(
        &rt,
        kube_persist_testkit::make_pod("ns-0", "sentinel", 4242),
    );
    eventually("the operator labels a new pod", || {
        h.get(&rt, Some("ns-0"), "sentinel")
            .is_some_and(|p| is_labeled(&p))
    })
    .await;
    let counts = h.counts();
    let state = second.kill();
    println!(
        "controller e2e: restart converged in {:.2} s with {} LIST, {} WATCH, {} PATCH; child [{state}]",
        took.as_secs_f64(),
        counts.list,
        counts.watch,
        counts.patch
    );
    assert_eq!(counts.list, 0, "the restarted controller made LIST calls");
    assert!(
        counts.patch as usize >= PODS - done_before,
        "each remaining pod written once at least"
    );
    assert_eq!(h.list(&ResourceType::pods()).len(), PODS + 1);
    assert_eq!(labeled(h), PODS + 1, "every pod labeled, the sentinel too");
}
