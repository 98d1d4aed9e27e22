//! The page budget of a store directory, shared by its streams' lists: a stream whose
//! consumer stops polling in the middle of its list keeps no place of it.

use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube_persist::{Event, StreamConfig};

use crate::common::{self, Engine, Fixture};

/// Places in a directory's page budget: CPU threads (one per core, at most 8) + 2.
fn budget() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(8)
        + 2
}

/// As many streams as the budget has places stop being polled in the middle of their
/// lists (each has given its first page's objects); one more stream in the same directory
/// must still list to the end. Before, each idle stream kept the permit of the page it
/// had fetched ahead, and the last stream waited for a place forever.
async fn idle_consumers_do_not_starve_other_lists(engine: Engine) {
    let fx = Fixture::new().await;
    let idle = budget();
    let per_namespace = 60;
    fx.h.seed_pods(per_namespace * (idle + 1), idle + 1);
    let db = fx.open(engine);
    let cfg = || StreamConfig::default().page_size(10);
    // Each idle stream is polled (on its own task, all at once) until its first object,
    // then handed back and kept, not polled.
    let mut tasks = Vec::new();
    for ns in 0..idle {
        let api = Api::<Pod>::namespaced(fx.server.client(), &format!("ns-{ns}"));
        let (_reader, watcher) = db.store(&format!("idle-{ns}"), api, cfg()).unwrap();
        tasks.push(tokio::spawn(async move {
            let mut events = Box::pin(watcher.stream());
            loop {
                match events.next().await {
                    Some(Ok(Event::InitApply(_))) => return events,
                    Some(Ok(_)) => {}
                    other => panic!("idle-{ns}: {other:?} before its first object"),
                }
            }
        }));
    }
    let mut idle_streams = Vec::new();
    for t in tasks {
        let events = tokio::time::timeout(common::WAIT, t)
            .await
            .expect("every idle stream gave its first object")
            .unwrap();
        idle_streams.push(events);
    }
    let api = Api::<Pod>::namespaced(fx.server.client(), &format!("ns-{idle}"));
    let (reader, watcher) = db.store("last", api, cfg()).unwrap();
    let task = tokio::spawn(watcher.run());
    tokio::time::timeout(Duration::from_secs(30), reader.wait_until_ready())
        .await
        .unwrap_or_else(|_| {
            panic!("{idle} streams not polled starved the last stream's list (not ready in 30 s)")
        })
        .unwrap();
    assert_eq!(reader.len(), per_namespace);
    task.abort();
    drop(idle_streams);
}

engine_tests!(async: idle_consumers_do_not_starve_other_lists);
