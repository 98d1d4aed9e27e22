//! No object holds a pass open (issue 56, item 3). A pass ends when every object it asked
//! for has been attempted since it asked: one whose read keeps failing (a body that does
//! not decode into the controller's kind) keeps its own retries, and the pass ends
//! without it. At 9ad23f8 such an object went back to waiting after each failed read, the
//! pass never ended, and every later tick was coalesced into it: the readable objects
//! were never reconciled again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::common;
use crate::triggers::Never;
use futures::StreamExt;
use futures::channel::mpsc::unbounded;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::runtime::controller::Action;
use kube_persist::Engine;
use kube_persist::controller::{Config, Controller};
use kube_persist_testkit::{ResourceType, TestServer};
use serde_json::json;

const GOOD: usize = 5;

/// A durable controller (or not) of ConfigMaps, whose store holds one object that does not
/// decode into a ConfigMap (`data` is a number: stored as the server sent it, with
/// `validate(false)`): two ticks, each followed by a reconcile of every readable object.
async fn an_unreadable_object_holds_no_tick(engine: Engine, durable: bool) {
    common::init_tracing();
    let server = TestServer::start().await;
    let h = server.handle();
    for i in 0..GOOD {
        h.apply(
            &ResourceType::configmaps(),
            json!({"apiVersion": "v1", "kind": "ConfigMap",
                   "metadata": {"name": format!("cm-{i}"), "namespace": "in"},
                   "data": {"k": "v"}}),
        );
    }
    let bad = json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "bad", "namespace": "in", "uid": "uid-bad",
                     "resourceVersion": h.resource_version()},
        "data": 5});
    h.faults()
        .inject_next_list(serde_json::to_vec(&bad).unwrap());
    let dir = tempfile::tempdir().unwrap();
    let db = common::try_open_db(engine, dir.path()).unwrap();
    let (ticks, tick_stream) = unbounded::<()>();
    let controller = db
        .store(
            "in",
            Api::<ConfigMap>::namespaced(server.client(), "in"),
            crate::triggers::store_cfg().validate(false),
        )
        .map(|pair| {
            Controller::for_store(pair).with_config(Config::default().concurrency(2).pass_chunk(2))
        })
        .unwrap();
    let controller = match durable {
        true => controller.durable_state("held").unwrap(),
        false => controller,
    };
    let reader = controller.store();
    let counts: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let sink = counts.clone();
    let run = controller.reconcile_all_on(tick_stream).run(
        move |cm: Arc<ConfigMap>, _: Arc<()>| {
            let name = cm.metadata.name.clone().unwrap_or_default();
            *sink.lock().unwrap().entry(name).or_default() += 1;
            async { Ok::<_, Never>(Action::await_change()) }
        },
        |_, _: &Never, _| Action::await_change(),
        Arc::new(()),
    );
    let task = tokio::spawn(run.for_each(|_| async {}));
    common::eventually("the bad object stored", || {
        reader.len() == GOOD + 1 && reader.get_named(Some("in"), "bad").is_err()
    })
    .await;
    let each_at_least = |n: usize| {
        let counts = counts.lock().unwrap();
        (0..GOOD).all(|i| counts.get(&format!("cm-{i}")).copied().unwrap_or(0) >= n)
    };
    common::eventually("the start reconciles every readable object", || {
        each_at_least(1)
    })
    .await;
    for round in 2..=3 {
        ticks.unbounded_send(()).unwrap();
        common::eventually(
            &format!("tick {} reconciles every readable object again", round - 1),
            || each_at_least(round),
        )
        .await;
    }
    assert!(
        !counts.lock().unwrap().contains_key("bad"),
        "the bad object never decoded"
    );
    task.abort();
}

async fn an_unreadable_object_holds_no_tick_durable(engine: Engine) {
    an_unreadable_object_holds_no_tick(engine, true).await
}

async fn an_unreadable_object_holds_no_tick_in_memory(engine: Engine) {
    an_unreadable_object_holds_no_tick(engine, false).await
}

engine_tests!(async: an_unreadable_object_holds_no_tick_durable,
    an_unreadable_object_holds_no_tick_in_memory);
