//! The read paths at memory speed: the hot cache written through by watch events (one
//! decode per event, never stale), and iteration decoded in parallel in key order.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;
use k8s_openapi::api::core::v1::Pod;
use kube::core::PartialObjectMeta;
use kube::runtime::controller::Action;
use kube_persist::StreamConfig;
use kube_persist_testkit::{ResourceType, ServerHandle};

fn cfg() -> StreamConfig {
    StreamConfig::default()
        .backoff(Duration::from_millis(20), Duration::from_millis(200))
        .relist_jitter(Duration::from_millis(10))
        .hot_cache(64 << 20)
}

fn set_label(h: &ServerHandle, name: &str, value: &str) {
    let rt = ResourceType::pods();
    let mut o = h.get(&rt, Some("ns-0"), name).expect("pod exists");
    o["metadata"]["labels"]["round"] = value.into();
    h.apply(&rt, o);
}

fn round_of(pod: &Pod) -> Option<&str> {
    pod.metadata
        .labels
        .as_ref()?
        .get("round")
        .map(String::as_str)
}

/// The names of this process's threads (`/proc/self/task/*/comm`).
fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_string())
        .collect()
}

/// The server's resourceVersion of `ns-0/name`, as an opaque string.
fn server_rv(h: &ServerHandle, name: &str) -> String {
    let o = h.get(&ResourceType::pods(), Some("ns-0"), name).unwrap();
    o["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string()
}

/// Wait for an `Apply` of each of `names` (in namespace `ns-0`).
async fn until_applied(w: &mut Driven, names: &[String]) {
    for n in names {
        until_apply(w, &format!("ns-0/{n}")).await;
    }
}

/// Objects changed by watch events are read from the hot cache, as decoded by the write
/// path's validation, without a decode; deleted, rejected and changed-again objects are never served
/// in an older version, and a reopen starts with an empty cache.
async fn write_through_cache_is_one_decode_and_never_stale(engine: Engine) {
    let fx = Fixture::with_pods(300, 1).await;
    let (h, rt) = (&fx.h, ResourceType::pods());
    let db = fx.open(engine);
    let api = fx.pods();
    let (reader, watcher) = db.store("pods", api.clone(), cfg()).unwrap();
    let mut w = drive(watcher);
    w.until(|e| *e == Ev::InitDone).await;
    reader.wait_until_live().await.unwrap();
    let names: Vec<String> = (0..60).map(|i| format!("pod-{i}")).collect();
    let before = reader.stats();
    for n in &names {
        set_label(h, n, "1");
    }
    until_applied(&mut w, &names).await;
    let applied = reader.stats();
    let events = applied.watch_events - before.watch_events;
    assert_eq!(events, 60, "{applied:?}");
    // The write path's validation, and `Watcher::stream` handing out an owned `Pod`
    // (a controller's trigger shares the validation decode instead: see below).
    assert_eq!(applied.decodes - before.decodes, 2 * events, "{applied:?}");
    for n in &names {
        let pod = reader.get_named(Some("ns-0"), n).unwrap().expect("stored");
        assert_eq!(round_of(&pod), Some("1"), "{n}");
        assert_eq!(pod.metadata.resource_version, Some(server_rv(h, n)));
    }
    let read = reader.stats();
    assert_eq!(
        read.decodes, applied.decodes,
        "gets of fresh objects decode nothing"
    );
    assert_eq!(read.hot_cache_hits - applied.hot_cache_hits, 60, "{read:?}");

    // Deleted, rejected (does not decode into a Pod), changed again.
    let (deleted, changed) = (&names[..10], &names[10..20]);
    for n in deleted {
        h.delete(&rt, Some("ns-0"), n).expect("deleted");
    }
    let mut bad = h.get(&rt, Some("ns-0"), &names[20]).unwrap();
    bad["spec"]["containers"] = "not a list".into();
    h.apply(&rt, bad);
    for n in changed {
        set_label(h, n, "2");
    }
    // Every deletion, the rejection, then every change, in whatever order they come.
    let rejected = format!("ns-0/{}", names[20]);
    let pending = Mutex::new(changed.len() + 1);
    let evs = w
        .until(|e| {
            let mut left = pending.lock().unwrap();
            match e {
                Ev::Error(m) if m.contains(&rejected) => *left -= 1,
                Ev::Apply(k) if changed.iter().any(|n| *k == format!("ns-0/{n}")) => *left -= 1,
                _ => {}
            }
            *left == 0
        })
        .await;
    let want: Vec<String> = deleted.iter().map(|n| format!("ns-0/{n}")).collect();
    assert_eq!(deleted_keys(&evs), want, "{}", summary(&evs));
    for n in deleted.iter().chain([&names[20]]) {
        assert!(
            reader.get_named(Some("ns-0"), n).unwrap().is_none(),
            "{n} still served"
        );
    }
    for n in changed {
        let pod = reader.get_named(Some("ns-0"), n).unwrap().unwrap();
        assert_eq!(round_of(&pod), Some("2"), "{n}");
    }

    // Reopened: the cache starts empty, and what is read is what is on disk.
    w.stop().await;
    drop(reader);
    let (reader, watcher) = db.store("pods", api, cfg()).unwrap();
    let reopened = reader.stats();
    let pod = reader.get_named(Some("ns-0"), &names[30]).unwrap().unwrap();
    assert_eq!(round_of(&pod), Some("1"));
    let after = reader.stats();
    assert_eq!(after.hot_cache_hits, reopened.hot_cache_hits, "{after:?}");
    assert_eq!(after.decodes - reopened.decodes, 1, "{after:?}");
    drop(watcher);
}

/// `iter`, `iter_as`, `iter_namespace(_as)` and `by_index` hand out every object exactly
/// once, in key order, as stored; chunks decoded in parallel keep that order.
async fn parallel_iteration_keeps_key_order(engine: Engine) {
    let fx = Fixture::with_pods(1500, 3).await;
    let (h, rt) = (&fx.h, ResourceType::pods());
    let db = fx.open(engine);
    let config = cfg().index("app", |p: &Pod| {
        let labels = p.metadata.labels.as_ref();
        labels
            .and_then(|l| l.get("app").cloned())
            .into_iter()
            .collect()
    });
    let (reader, watcher) = db.store("pods", fx.pods(), config).unwrap();
    // Decoded ahead on the CPU threads (the default decodes on the calling thread).
    let reader = reader.read_threads(0);
    let mut w = drive(watcher);
    w.until(|e| *e == Ev::InitDone).await;
    // Key order: namespace, then name (byte order), as (namespace, name, resourceVersion).
    let mut want: Vec<(String, String, String)> = server_versions(h, &rt)
        .into_iter()
        .map(|(k, rv)| {
            let (ns, name) = k.split_once('/').unwrap();
            (ns.to_string(), name.to_string(), rv)
        })
        .collect();
    want.sort();
    let row = |m: &kube::api::ObjectMeta| {
        let m = m.clone();
        (
            m.namespace.unwrap(),
            m.name.unwrap(),
            m.resource_version.unwrap(),
        )
    };
    let before = reader.stats().decodes;
    let all: Vec<_> = reader.iter().map(|p| row(&p.unwrap().metadata)).collect();
    assert_eq!(all, want);
    assert_eq!(reader.stats().decodes - before, want.len() as u64);
    let metas: Vec<_> = reader
        .iter_as::<PartialObjectMeta<Pod>>()
        .map(|p| row(&p.unwrap().metadata))
        .collect();
    assert_eq!(metas, want);
    let ns1: Vec<_> = want.iter().filter(|r| r.0 == "ns-1").cloned().collect();
    let got: Vec<_> = reader
        .iter_namespace("ns-1")
        .map(|p| row(&p.unwrap().metadata))
        .collect();
    assert_eq!(got, ns1);
    let got: Vec<_> = reader
        .iter_namespace_as::<PartialObjectMeta<Pod>>("ns-1")
        .map(|p| row(&p.unwrap().metadata))
        .collect();
    assert_eq!(got, ns1);
    // A lazy reader taking a few pays for a small first chunk, and stops there.
    let before = reader.stats().decodes;
    assert_eq!(reader.iter().take(3).count(), 3);
    assert!(reader.stats().decodes - before < 32);
    // Dropped while read ahead (its queued chunks find nothing to take), then read again.
    let mut it = reader.iter();
    assert_eq!(it.by_ref().take(500).count(), 500);
    drop(it);
    assert_eq!(reader.iter().skip(1000).count(), want.len() - 1000);
    // Sixteen iterations at once, each read ahead, start no thread of their own: they
    // share the process's CPU threads, whose number does not depend on theirs.
    let mut open: Vec<_> = (0..16).map(|_| reader.iter()).collect();
    for it in &mut open {
        assert_eq!(it.by_ref().take(300).count(), 300);
    }
    let names = thread_names();
    // The kernel keeps 15 bytes of a thread's name: "kube-persist-cpu" is "kube-persist-cp".
    let cpu = names.iter().filter(|n| *n == "kube-persist-cp").count();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert!(
        (1..=cores.min(8)).contains(&cpu),
        "{cpu} CPU threads with 16 iterations open: {names:?}"
    );
    for it in open {
        assert_eq!(it.count(), want.len() - 300);
    }

    let mut by_app = std::collections::BTreeMap::<String, Vec<_>>::new();
    for p in reader.iter() {
        let p = p.unwrap();
        let app = p.metadata.labels.as_ref().unwrap()["app"].clone();
        by_app.entry(app).or_default().push(row(&p.metadata));
    }
    let (app, rows) = by_app.iter().max_by_key(|(_, r)| r.len()).unwrap();
    assert!(
        rows.len() > 64,
        "a large index value: {} under {app}",
        rows.len()
    );
    for (app, rows) in &by_app {
        let got: Vec<_> = reader
            .by_index("app", app)
            .unwrap()
            .map(|p| row(&p.unwrap().metadata))
            .collect();
        assert_eq!(&got, rows, "by_index app={app}");
    }
    w.stop().await;
}

/// The reconcile of an object a watch event changed gets it from the hot cache: one decode
/// per event in all (the write path's), and the version the event carried.
async fn reconcile_path_decodes_once_per_event(engine: Engine) {
    let fx = Fixture::with_pods(40, 1).await;
    let h = &fx.h;
    let db = fx.open(engine);
    let (reader, watcher) = db.store("pods", fx.pods(), cfg()).unwrap();
    let seen = Arc::new(Mutex::new(
        std::collections::HashMap::<String, String>::new(),
    ));
    let run = kube_persist::controller::Controller::for_store((reader.clone(), watcher)).with_config(kube_persist::controller::Config::default())
    .run(
        |pod: Arc<Pod>, seen: Arc<Mutex<std::collections::HashMap<String, String>>>| async move {
            let name = pod.metadata.name.clone().unwrap();
            let round = round_of(&pod).unwrap_or("0").to_string();
            seen.lock().unwrap().insert(name, round);
            Ok::<_, std::convert::Infallible>(Action::await_change())
        },
        |_, _, _| Action::await_change(),
        seen.clone(),
    );
    let task = tokio::spawn(futures::StreamExt::for_each(run, |_| async {}));
    eventually("every pod reconciled once", || {
        seen.lock().unwrap().len() == 40
    })
    .await;
    reader.wait_until_live().await.unwrap();
    let before = reader.stats();
    let names: Vec<String> = (0..40).map(|i| format!("pod-{i}")).collect();
    for n in &names {
        set_label(h, n, "1");
    }
    eventually("every change reconciled", || {
        seen.lock().unwrap().values().all(|r| r == "1")
    })
    .await;
    let after = reader.stats();
    task.abort();
    let events = after.watch_events - before.watch_events;
    assert_eq!(events, 40, "{after:?}");
    assert_eq!(
        after.decodes - before.decodes,
        events,
        "decodes per event on the reconcile path: {:.2}",
        (after.decodes - before.decodes) as f64 / events as f64
    );
}

engine_tests! {
    async: write_through_cache_is_one_decode_and_never_stale,
        parallel_iteration_keeps_key_order,
        reconcile_path_decodes_once_per_event,
}
