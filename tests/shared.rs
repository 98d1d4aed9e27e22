//! Shared streams (issue 34 item 4): one watch feeding several consumers in one process.
//! Two controllers on one Pod stream make one LIST and one WATCH and both reconcile every
//! change; a consumer that stops taking its events is lagged after the bounded stall, and
//! the other keeps reconciling.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{eventually, relabel_pod};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::controller::Action;
use kube_persist::controller::{Config, Controller};
use kube_persist::{Db, SharedEvent};
use kube_persist_testkit::TestServer;

const PROMPT: Duration = Duration::from_secs(20);

#[derive(Debug, thiserror::Error)]
#[error("never fails")]
struct Never;

/// Reconciles per object name, with the label `touched` each reconcile saw.
#[derive(Default)]
struct Book(Mutex<HashMap<String, Vec<String>>>);

impl Book {
    fn saw(&self, name: &str, value: &str) -> bool {
        self.0
            .lock()
            .unwrap()
            .get(name)
            .is_some_and(|seen| seen.iter().any(|v| v == value))
    }
    fn objects(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

async fn reconcile(pod: Arc<Pod>, book: Arc<Book>) -> Result<Action, Never> {
    let name = pod.metadata.name.clone().unwrap_or_default();
    let touched = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get("touched").cloned())
        .unwrap_or_default();
    book.0
        .lock()
        .unwrap()
        .entry(name)
        .or_default()
        .push(touched);
    Ok(Action::await_change())
}

fn error_policy(_: Arc<Pod>, _: &Never, _: Arc<Book>) -> Action {
    Action::await_change()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_controllers_on_one_stream_make_one_watch_and_both_reconcile_every_change() {
    let server = TestServer::start().await;
    let h = server.handle();
    h.seed_pods(20, 2);
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path()).unwrap();
    let (reader, watcher) = db
        .store("pods", Api::<Pod>::all(server.client()), Default::default())
        .unwrap();
    let shared = watcher.shared(64);
    let books = [Arc::new(Book::default()), Arc::new(Book::default())];
    let mut tasks = Vec::new();
    for book in &books {
        let controller =
            Controller::for_shared(reader.clone(), shared.subscribe(), Config::default());
        tasks.push(tokio::spawn(
            controller
                .run(reconcile, error_policy, book.clone())
                .for_each(|_| async {}),
        ));
    }
    tasks.push(tokio::spawn(shared.run()));
    for (i, book) in books.iter().enumerate() {
        eventually(&format!("controller {i} reconciles every pod"), || {
            book.objects() == 20
        })
        .await;
    }
    for i in 0..5 {
        relabel_pod(&h, &format!("ns-{}", i % 2), &format!("pod-{i}"), "changed");
    }
    for (i, book) in books.iter().enumerate() {
        eventually(&format!("controller {i} reconciles every change"), || {
            (0..5).all(|p| book.saw(&format!("pod-{p}"), "changed"))
        })
        .await;
    }
    let counts = h.counts();
    assert_eq!(
        counts.watch, 1,
        "one WATCH for both controllers: {counts:?}"
    );
    assert_eq!(counts.list, 1, "one LIST for both controllers: {counts:?}");
    for t in tasks {
        t.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_that_stops_taking_events_is_lagged_and_the_other_goes_on() {
    let server = TestServer::start().await;
    let h = server.handle();
    h.seed_pods(10, 1);
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path()).unwrap();
    let (reader, watcher) = db
        .store("pods", Api::<Pod>::all(server.client()), Default::default())
        .unwrap();
    let shared = watcher.shared(4).max_stall(Duration::from_millis(50));
    // Subscribed, never read while the changes come.
    let mut slow = shared.subscribe();
    let book = Arc::new(Book::default());
    let controller = Controller::for_shared(reader.clone(), shared.subscribe(), Config::default())
        .run(reconcile, error_policy, book.clone())
        .for_each(|_| async {});
    let tasks = [tokio::spawn(controller), tokio::spawn(shared.run())];
    eventually("every pod reconciled", || book.objects() == 10).await;
    for round in 0..3 {
        for p in 0..10 {
            relabel_pod(&h, "ns-0", &format!("pod-{p}"), &format!("round-{round}"));
        }
    }
    eventually(
        "the other consumer reconciles the last round of changes",
        || (0..10).all(|p| book.saw(&format!("pod-{p}"), "round-2")),
    )
    .await;
    // The slow consumer has its first events, then learns that it lagged.
    let mut lagged = false;
    while let Ok(Some(item)) = tokio::time::timeout(PROMPT, slow.next()).await {
        if matches!(item.unwrap(), SharedEvent::Lagged) {
            lagged = true;
            break;
        }
    }
    assert!(lagged, "the slow consumer is told it lagged");
    for t in tasks {
        t.abort();
    }
}
