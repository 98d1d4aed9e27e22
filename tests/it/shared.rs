//! Shared streams (issue 34 item 4): one watch feeding several consumers in one process.
//! Two controllers on one Pod stream make one LIST and one WATCH and both reconcile every
//! change; a consumer that stops taking its events is lagged after the bounded stall, and
//! the other keeps reconciling.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::{self, Fixture, eventually, relabel_pod};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::controller::Action;
use kube_persist::controller::{Config, Controller};
use kube_persist::{Db, SharedEvent};

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
    let fx = Fixture::with_pods(20, 2).await;
    let h = &fx.h;
    let db = Db::open(fx.path()).unwrap();
    let (reader, watcher) = db
        .store("pods", fx.pods(), kube_persist::StreamConfig::default())
        .unwrap();
    let shared = watcher.shared(64);
    let books = [Arc::new(Book::default()), Arc::new(Book::default())];
    let mut tasks = Vec::new();
    for book in &books {
        let controller = Controller::for_shared(reader.clone(), shared.subscribe())
            .with_config(Config::default());
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
        relabel_pod(h, &format!("ns-{}", i % 2), &format!("pod-{i}"), "changed");
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
    let fx = Fixture::with_pods(10, 1).await;
    let h = &fx.h;
    let db = Db::open(fx.path()).unwrap();
    let (reader, watcher) = db
        .store("pods", fx.pods(), kube_persist::StreamConfig::default())
        .unwrap();
    let shared = watcher.shared(4).max_stall(Duration::from_millis(50));
    // Subscribed, never read while the changes come.
    let mut slow = shared.subscribe();
    let book = Arc::new(Book::default());
    let controller = Controller::for_shared(reader.clone(), shared.subscribe())
        .with_config(Config::default())
        .run(reconcile, error_policy, book.clone())
        .for_each(|_| async {});
    let tasks = [tokio::spawn(controller), tokio::spawn(shared.run())];
    eventually("every pod reconciled", || book.objects() == 10).await;
    for round in 0..3 {
        for p in 0..10 {
            relabel_pod(h, "ns-0", &format!("pod-{p}"), &format!("round-{round}"));
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

/// Issue 39 item 2. A subscriber that is slow but always takes its next event within
/// `max_stall` (one every 500 ms, `max_stall` 1 s, a queue of one) no longer holds the one
/// watch at its pace: its queue stays full across events for `max_stall`, so it is lagged,
/// and a second consumer gets 20 changes while the slow one has taken only a few events.
/// Before, each event waited for it, and the 20 changes reached the other consumer only
/// after the slow one had taken about 20 events (10 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_slower_than_the_watch_is_lagged_not_followed() {
    const CHANGES: usize = 20;
    let fx = Fixture::with_pods(CHANGES, 1).await;
    let h = &fx.h;
    let db = Db::open(fx.path()).unwrap();
    let (_reader, watcher) = db
        .store("pods", fx.pods(), kube_persist::StreamConfig::default())
        .unwrap();
    let shared = watcher.shared(1).max_stall(Duration::from_secs(1));
    let mut slow = shared.subscribe();
    let mut fast = shared.subscribe();
    let taken = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let lagged = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (t, l) = (taken.clone(), lagged.clone());
    let slow_task = tokio::spawn(async move {
        while let Some(item) = slow.next().await {
            if matches!(item.unwrap(), SharedEvent::Lagged) {
                l.store(true, std::sync::atomic::Ordering::SeqCst);
            }
            t.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    });
    let run = tokio::spawn(shared.run());
    // The fast consumer follows the first list to its end.
    while let Some(item) = fast.next().await {
        if matches!(item.unwrap(), SharedEvent::Event(ev) if matches!(*ev, kube_persist::Event::InitDone))
        {
            break;
        }
    }
    let before = taken.load(std::sync::atomic::Ordering::SeqCst);
    for p in 0..CHANGES {
        relabel_pod(h, "ns-0", &format!("pod-{p}"), "changed");
    }
    let mut changed = std::collections::HashSet::new();
    while changed.len() < CHANGES {
        let item = tokio::time::timeout(PROMPT, fast.next())
            .await
            .expect("the fast consumer gets every change")
            .expect("the stream goes on")
            .unwrap();
        if let SharedEvent::Event(ev) = item
            && let kube_persist::Event::Apply(pod) = &*ev
        {
            changed.insert(pod.metadata.name.clone().unwrap());
        }
    }
    let slow_took = taken.load(std::sync::atomic::Ordering::SeqCst) - before;
    assert!(
        slow_took < CHANGES / 2,
        "the fast consumer got {CHANGES} changes only after the slow one took {slow_took} events"
    );
    common::eventually("the slow consumer is told it lagged", || {
        lagged.load(std::sync::atomic::Ordering::SeqCst)
    })
    .await;
    slow_task.abort();
    run.abort();
}

/// Issue 39 item 5. A subscriber lagged before the start signal (here: not read during the
/// first list, with a queue of one) still gets it, after `Lagged`: a controller on it runs
/// its startup pass. Before, the start signal was dropped with the other events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_lagged_before_the_start_signal_still_gets_it() {
    let fx = Fixture::with_pods(10, 1).await;
    let db = Db::open(fx.path()).unwrap();
    let (_reader, watcher) = db
        .store("pods", fx.pods(), kube_persist::StreamConfig::default())
        .unwrap();
    let shared = watcher.shared(1).max_stall(Duration::from_millis(50));
    let mut late = shared.subscribe();
    let mut prompt = shared.subscribe();
    let run = tokio::spawn(shared.run());
    // The prompt consumer sees the first list end: the late one's queue was full long
    // before, with only `Init` in it.
    loop {
        let item = prompt.next().await.unwrap().unwrap();
        if matches!(item, SharedEvent::Event(ev) if matches!(*ev, kube_persist::Event::InitDone)) {
            break;
        }
    }
    let mut seen = Vec::new();
    while let Ok(Some(item)) = tokio::time::timeout(PROMPT, late.next()).await {
        let item = item.unwrap();
        let done = matches!(&item, SharedEvent::Event(ev) if matches!(**ev, kube_persist::Event::InitDone));
        seen.push(match item {
            SharedEvent::Lagged => "Lagged".to_string(),
            SharedEvent::Event(ev) => match &*ev {
                kube_persist::Event::Init => "Init".to_string(),
                kube_persist::Event::InitDone => "InitDone".to_string(),
                other => format!("{other:?}").chars().take(20).collect(),
            },
            other => format!("{other:?}").chars().take(20).collect(),
        });
        if done {
            break;
        }
    }
    assert_eq!(
        seen,
        ["Init", "Lagged", "InitDone"],
        "the late consumer gets what was queued, then Lagged, then the start signal"
    );
    run.abort();
}
