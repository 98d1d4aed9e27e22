//! The kube-runtime shapes of issue 57: the controller's predicates without durable state,
//! a related kind that cannot be opened (the controller does not start, and says why), and
//! related streams named after what they watch, one per selection.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::common::{self, Fixture};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::Api;
use kube::runtime::controller::Action;
use kube::runtime::{predicates, watcher};
use kube_persist::Db;
use kube_persist::controller::{Controller, ControllerError};
use kube_persist_testkit::{ResourceType, ServerHandle};
use serde_json::json;

#[derive(Debug, thiserror::Error)]
#[error("never fails")]
struct Never;

/// Reconciles started, by object name.
#[derive(Default, Clone)]
struct Count(Arc<Mutex<HashMap<String, usize>>>);

impl Count {
    fn add(&self, name: &str) {
        *self.0.lock().unwrap().entry(name.to_string()).or_default() += 1;
    }
    fn of(&self, name: &str) -> usize {
        self.0
            .lock()
            .unwrap()
            .get(name)
            .copied()
            .unwrap_or_default()
    }
}

/// Runs `controller` with a reconciler that counts its reconciles by name and awaits the
/// next change.
fn run_counting(controller: Controller<Pod>) -> (Count, tokio::task::JoinHandle<()>) {
    let count = Count::default();
    let run = controller.run(
        |pod: Arc<Pod>, count: Arc<Count>| async move {
            count.add(pod.metadata.name.as_deref().unwrap_or_default());
            Ok::<_, Never>(Action::await_change())
        },
        |_, _, _| Action::await_change(),
        Arc::new(count.clone()),
    );
    (count, tokio::spawn(run.for_each(|_| async {})))
}

/// Sets `metadata.<field>` of pod `ns/name` on the server.
fn set_meta(h: &ServerHandle, ns: &str, name: &str, field: &str, value: serde_json::Value) {
    let pods = ResourceType::pods();
    let mut pod = h.get(&pods, Some(ns), name).unwrap();
    pod["metadata"][field] = value;
    h.apply(&pods, pod);
}

/// Without durable state, `predicate_filter(predicates::labels)` skips a change that leaves
/// the labels as the last successful reconcile saw them (an annotation), reconciles one
/// that changes them, and reconciles an object created again with the same labels (a new
/// uid: a create always passes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_predicate_filters_changes_in_memory_and_a_create_passes() {
    let fx = Fixture::with_pods(2, 1).await; // ns-0/pod-0, ns-0/pod-1
    let db = Db::open(fx.path()).unwrap();
    let controller = Controller::new(&db, fx.pods(), watcher::Config::default())
        .unwrap()
        .predicate_filter(predicates::labels, Default::default());
    let stats = controller.stats();
    let (count, task) = run_counting(controller);
    common::eventually("both pods reconciled", || {
        count.of("pod-0") == 1 && count.of("pod-1") == 1
    })
    .await;

    set_meta(
        &fx.h,
        "ns-0",
        "pod-0",
        "annotations",
        json!({"note": "seen"}),
    );
    common::eventually("the annotation's change skipped", || {
        stats.get().skipped == 1
    })
    .await;
    assert_eq!(
        count.of("pod-0"),
        1,
        "an annotation leaves the labels: no reconcile"
    );

    set_meta(&fx.h, "ns-0", "pod-0", "labels", json!({"app": "other"}));
    common::eventually("the label's change reconciled", || count.of("pod-0") == 2).await;

    // Deleted and created again with the same labels: another uid, reconciled.
    let pods = ResourceType::pods();
    let mut pod = fx.h.get(&pods, Some("ns-0"), "pod-0").unwrap();
    fx.h.delete(&pods, Some("ns-0"), "pod-0");
    for field in ["uid", "resourceVersion", "creationTimestamp"] {
        pod["metadata"].as_object_mut().unwrap().remove(field);
    }
    fx.h.create(&pods, pod).unwrap();
    common::eventually("the created pod reconciled", || count.of("pod-0") == 3).await;
    assert_eq!(stats.get().skipped, 1);
    task.abort();
}

/// Two `owns` of one kind and one selection would share a stream: the second cannot open
/// it (in use), and `run` yields that error and ends instead of running without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_related_stream_that_cannot_open_stops_the_controller_with_its_error() {
    let fx = Fixture::with_pods(1, 1).await;
    let db = Db::open(fx.path()).unwrap();
    let cms = || Api::<ConfigMap>::all(fx.server.client());
    let controller = Controller::new(&db, fx.pods(), watcher::Config::default())
        .unwrap()
        .owns(cms(), watcher::Config::default())
        .owns(cms(), watcher::Config::default());
    let items: Vec<_> = controller
        .run(
            |_: Arc<Pod>, _: Arc<()>| async { Ok::<_, Never>(Action::await_change()) },
            |_, _, _| Action::await_change(),
            Arc::new(()),
        )
        .collect()
        .await;
    assert_eq!(items.len(), 1, "one item, the error: {items:?}");
    match &items[0] {
        Err(ControllerError::Setup(e)) => assert!(e.to_string().contains("configmaps"), "{e}"),
        other => panic!("expected the setup error, got {other:?}"),
    }
}

/// Related kinds opened by `owns` with different selections get streams of their own,
/// named after what they watch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn related_streams_are_named_after_their_selection() {
    let fx = Fixture::with_pods(1, 1).await;
    let db = Db::open(fx.path()).unwrap();
    let cms = || Api::<ConfigMap>::all(fx.server.client());
    let controller = Controller::new(&db, fx.pods(), watcher::Config::default())
        .unwrap()
        .owns(cms(), watcher::Config::default().labels("app=a"))
        .owns(cms(), watcher::Config::default().labels("app=b"))
        .owns(
            Api::<ConfigMap>::namespaced(fx.server.client(), "ns-0"),
            watcher::Config::default(),
        );
    // Every store is ready before the first reconcile starts.
    let (count, task) = run_counting(controller);
    common::eventually("the pod reconciled", || count.of("pod-0") == 1).await;
    let mut names: Vec<String> = db.streams().unwrap().into_iter().map(|s| s.name).collect();
    names.sort();
    assert_eq!(names.len(), 4, "{names:?}");
    assert!(names[0].starts_with("configmaps#") && names[1].starts_with("configmaps#"));
    assert_ne!(names[0], names[1], "two selections, two streams");
    assert_eq!(names[2..], ["configmaps@ns-0", "pods"]);
    task.abort();
}
