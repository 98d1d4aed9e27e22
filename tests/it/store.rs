//! The core store and watcher against the testkit API server over real HTTP, with a real
//! store in a temporary directory, once per storage engine.

use std::time::Duration;

use crate::common::{self, *};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::reflector::ObjectRef;
use kube_persist::{Error, StreamConfig, SyncPhase};
use kube_persist_testkit::{ResourceType, Verb, make_pod};

fn cfg(streaming: bool) -> StreamConfig {
    let c = StreamConfig::default()
        .backoff(Duration::from_millis(20), Duration::from_millis(200))
        .relist_jitter(Duration::from_millis(10));
    if streaming { c.streaming_lists() } else { c }
}

/// Create, update and delete `n` pods each; returns the deleted keys.
fn change_pods(h: &kube_persist_testkit::ServerHandle, n: usize, tag: &str) -> Vec<String> {
    let rt = ResourceType::pods();
    let all = h.list(&rt);
    let mut deleted = Vec::new();
    for (i, o) in all.iter().take(n).enumerate() {
        let ns = o["metadata"]["namespace"].as_str().unwrap();
        let name = o["metadata"]["name"].as_str().unwrap();
        h.delete(&rt, Some(ns), name).unwrap();
        deleted.push(format!("{ns}/{name}"));
        h.apply(
            &rt,
            make_pod("ns-0", &format!("new-{tag}-{i}"), 10_000 + i as u64),
        );
    }
    for o in all.iter().skip(n).take(n) {
        let mut o = o.clone();
        o["metadata"]["labels"]["changed"] = tag.into();
        h.apply(&rt, o);
    }
    deleted
}

async fn cold_then_warm(engine: Engine, streaming: bool) {
    let fx = Fixture::with_pods(5000, 10).await;
    let (h, rt) = (&fx.h, ResourceType::pods());

    // Cold sync.
    {
        let db = fx.open(engine);
        let (reader, watcher) = db.store("pods", fx.pods(), cfg(streaming)).unwrap();
        assert!(!reader.is_ready());
        let mut w = drive(watcher);
        let evs = w.until(|e| *e == Ev::InitDone).await;
        assert_eq!(evs[0], Ev::Init, "{}", summary(&evs));
        let applies = evs.iter().filter(|e| matches!(e, Ev::InitApply(_))).count();
        assert_eq!(applies, 5000, "{}", summary(&evs));
        reader.wait_until_ready().await.unwrap();
        assert_matches(&reader, h, &rt);
        let counts = h.counts();
        if streaming {
            assert_eq!(counts.list, 0, "streaming lists make no LIST call");
        } else {
            assert_eq!(counts.list, 10, "one LIST call per page of 500");
            assert_eq!(reader.stats().list_pages, 10);
        }
        // The checkpoint is the list's resourceVersion, exactly as the server rendered it.
        assert_eq!(reader.checkpoint(), Some(h.resource_version()));
        w.stop().await;
    }

    // Changes while the process is down.
    let deleted = change_pods(h, 20, "down");
    h.reset_counts();

    // Warm restart: no LIST, one WATCH from the checkpoint.
    let db = fx.open(engine);
    let (reader, watcher) = db.store("pods", fx.pods(), cfg(streaming)).unwrap();
    assert!(reader.is_ready(), "ready at once on a warm open");
    assert_eq!(reader.len(), 5000);
    let mut w = drive(watcher);
    let first = w.until(|_| true).await;
    assert!(matches!(first[0], Ev::Resumed(_)), "{first:?}");
    // 20 deletes, 20 creates, 20 updates.
    let mut evs = Vec::new();
    while evs
        .iter()
        .filter(|e| matches!(e, Ev::Apply(_) | Ev::Delete(_)))
        .count()
        < 60
    {
        evs.extend(w.until(|e| matches!(e, Ev::Apply(_) | Ev::Delete(_))).await);
    }
    for d in &deleted {
        assert!(evs.contains(&Ev::Delete(d.clone())), "missing Delete({d})");
    }
    reader.wait_until_live().await.unwrap();
    assert_matches(&reader, h, &rt);
    // The last event was the last change: the checkpoint is the server's current version.
    assert_eq!(reader.checkpoint(), Some(h.resource_version()));
    let counts = h.counts();
    assert_eq!(counts.list, 0, "warm restart made a LIST call");
    assert_eq!(counts.watch, 1, "warm restart opens exactly one WATCH");
    assert_eq!(reader.stats().resumes, 1);
    assert!(
        !evs.iter().any(|e| matches!(e, Ev::Error(_))),
        "{}",
        summary(&evs)
    );
}

async fn cold_sync_then_warm_restart_paginated(engine: Engine) {
    cold_then_warm(engine, false).await;
}

async fn cold_sync_then_warm_restart_streaming(engine: Engine) {
    cold_then_warm(engine, true).await;
}

/// Changes made while the process is down, then history compacted: the resumed watch gets
/// 410, the relist rewrites only what changed and reports exact deletions.
async fn relist_after_gone(engine: Engine, streaming: bool) {
    let fx = Fixture::with_pods(1200, 4).await;
    let (h, rt) = (&fx.h, ResourceType::pods());
    {
        let db = fx.open(engine);
        let (_reader, w) = fx.synced_pods(&db, cfg(streaming)).await;
        w.stop().await;
    }
    let deleted = change_pods(h, 7, "gone");
    h.compact();
    h.reset_counts();

    let db = fx.open(engine);
    let (reader, mut w) = fx.watch_pods(&db, cfg(streaming));
    let mut evs = Vec::new();
    while evs.iter().filter(|e| matches!(e, Ev::Delete(_))).count() < 7 {
        evs.extend(w.until(|e| matches!(e, Ev::Delete(_))).await);
    }
    converge(&reader, h, &rt).await;
    // Positive end of the relist's events: a pod created after convergence reaches us as a
    // watch event, after everything the relist reported; nothing more is awaited.
    h.apply(&rt, make_pod("ns-0", "sentinel", 77_777));
    evs.extend(until_apply(&mut w, "ns-0/sentinel").await);
    evs.pop(); // the sentinel's own Apply
    assert_eq!(reader.checkpoint(), Some(h.resource_version()));
    let mut want = deleted.clone();
    want.sort();
    assert_eq!(
        common::deleted_keys(&evs),
        want,
        "exact deletions: {}",
        summary(&evs)
    );
    let applies = evs.iter().filter(|e| matches!(e, Ev::Apply(_))).count();
    assert_eq!(
        applies,
        14,
        "7 creates + 7 updates, not a flood of re-adds: {}",
        summary(&evs)
    );
    let stats = reader.stats();
    assert_eq!(stats.relists, 1);
    assert_eq!(
        stats.objects_written,
        14 + 1,
        "unchanged objects are not rewritten (+1: the sentinel): {stats:?}"
    );
    assert_eq!(stats.objects_unchanged, 1200 - 7 - 7, "{stats:?}");
    assert_eq!(stats.objects_deleted, 7);
    assert!(reader.is_ready());
}

async fn relist_after_410_on_resume_paginated(engine: Engine) {
    relist_after_gone(engine, false).await;
}

async fn relist_after_410_on_resume_streaming(engine: Engine) {
    relist_after_gone(engine, true).await;
}

/// A live watch that gets an ERROR 410 relists and converges; the store is never emptied.
async fn live_watch_410_relists_without_emptying(engine: Engine) {
    let fx = Fixture::with_pods(2000, 4).await;
    let (h, rt) = (&fx.h, ResourceType::pods());
    let db = fx.open(engine);
    let (reader, mut w) = fx.synced_pods(&db, cfg(false).page_size(200)).await;
    reader.wait_until_live().await.unwrap();

    h.faults().page_delay(Duration::from_millis(30));
    h.faults().gone_next_watch();
    h.faults().close_watches();
    // While the relist runs, the store never shrinks below what it had.
    let relisted = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watch_len = tokio::spawn({
        let (reader, relisted) = (reader.clone(), relisted.clone());
        async move {
            let mut min = usize::MAX;
            while !relisted.load(std::sync::atomic::Ordering::SeqCst) {
                min = min.min(reader.len());
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            min.min(reader.len())
        }
    });
    // The relist is over once it was counted and the store is synced and live again (the
    // watcher marks itself not live before the relist is counted).
    eventually("the relist to complete", || {
        reader.stats().relists >= 1 && reader.phase() == SyncPhase::Synced && reader.is_live()
    })
    .await;
    relisted.store(true, std::sync::atomic::Ordering::SeqCst);
    // A pod created now arrives through the new watch, after anything the relist reported.
    h.apply(&rt, make_pod("ns-0", "sentinel", 77_777));
    let mut evs = until_apply(&mut w, "ns-0/sentinel").await;
    evs.pop(); // the sentinel's own Apply
    assert!(
        watch_len.await.unwrap() >= 2000,
        "store shrank during the relist"
    );
    converge(&reader, h, &rt).await;
    let stats = reader.stats();
    assert_eq!(stats.relists, 1, "{stats:?} {}", summary(&evs));
    assert_eq!(
        stats.objects_written,
        2000 + 1,
        "relist rewrote unchanged objects (+1: the sentinel): {stats:?}"
    );
    assert!(
        !evs.iter()
            .any(|e| matches!(e, Ev::Apply(_) | Ev::Delete(_))),
        "{}",
        summary(&evs)
    );
    assert_eq!(reader.checkpoint(), Some(h.resource_version()));
}

/// The continue token expires mid-list: the list restarts with a new epoch, objects deleted
/// meanwhile are swept and reported.
async fn expired_continue_token_restarts_the_list(engine: Engine) {
    let fx = Fixture::with_pods(2000, 1).await;
    let (h, rt) = (&fx.h, ResourceType::pods());
    h.faults().page_delay(Duration::from_millis(200));
    let db = fx.open(engine);
    let (reader, mut w) = fx.watch_pods(&db, cfg(false));
    // First page (500 objects) is on disk.
    let mut evs = Vec::new();
    while evs.iter().filter(|e| matches!(e, Ev::InitApply(_))).count() < 500 {
        evs.extend(w.until(|e| matches!(e, Ev::InitApply(_))).await);
    }
    // Delete objects of the first page, then expire every continue token.
    let first: Vec<String> = evs
        .iter()
        .filter_map(|e| match e {
            Ev::InitApply(k) => Some(k.clone()),
            _ => None,
        })
        .take(3)
        .collect();
    for k in &first {
        let (ns, name) = k.split_once('/').unwrap();
        h.delete(&rt, Some(ns), name).unwrap();
    }
    h.compact();
    h.faults().page_delay(Duration::ZERO);
    evs.extend(w.until(|e| *e == Ev::InitDone).await);
    assert_matches(&reader, h, &rt);
    for k in &first {
        assert!(
            evs.contains(&Ev::Delete(k.clone())),
            "missing Delete({k}): {}",
            summary(&evs)
        );
    }
    assert!(h.counts().list > 4, "the list restarted");
}

/// A widget custom resource through `DynamicObject`.
async fn dynamic_object_cold_warm_and_relist(engine: Engine) {
    let fx = Fixture::new().await;
    let (h, rt) = (&fx.h, ResourceType::widgets());
    for i in 0..300 {
        h.apply(
            &rt,
            serde_json::json!({
                "apiVersion": "example.kube-persist.dev/v1", "kind": "Widget",
                "metadata": {"name": format!("w-{i}"), "namespace": format!("ns-{}", i % 3)},
                "spec": {"size": i}
            }),
        );
    }
    let gvk = GroupVersionKind::gvk("example.kube-persist.dev", "v1", "Widget");
    let ar = ApiResource::from_gvk_with_plural(&gvk, "widgets");
    {
        let db = fx.open(engine);
        let api = Api::<DynamicObject>::all_with(fx.server.client(), &ar);
        let (reader, watcher) = db
            .store_with("widgets", api, cfg(false).page_size(64), &ar)
            .unwrap();
        let mut w = drive(watcher);
        w.until(|e| *e == Ev::InitDone).await;
        assert_matches(&reader, h, &rt);
        assert_eq!(reader.iter_namespace("ns-1").count(), 100);
        h.delete(&rt, Some("ns-2"), "w-2").unwrap();
        w.until(|e| *e == Ev::Delete("ns-2/w-2".into())).await;
        w.stop().await;
    }
    h.delete(&rt, Some("ns-0"), "w-0").unwrap();
    h.compact();
    let db = fx.open(engine);
    let api = Api::<DynamicObject>::all_with(fx.server.client(), &ar);
    let (reader, watcher) = db
        .store_with("widgets", api, cfg(false).page_size(64), &ar)
        .unwrap();
    let mut w = drive(watcher);
    w.until(|e| *e == Ev::Delete("ns-0/w-0".into())).await;
    converge(&reader, h, &rt).await;
}

/// Metadata-only streams store `PartialObjectMeta<Pod>`: cold sync, changes, warm restart
/// without LIST, and a relist after 410 with exact deletions.
async fn metadata_only_store(engine: Engine) {
    let fx = Fixture::with_pods(700, 2).await;
    let (h, rt) = (&fx.h, ResourceType::pods());
    {
        let db = fx.open(engine);
        let (reader, watcher) = db
            .metadata_store("pods-meta", fx.pods(), cfg(false))
            .unwrap();
        let mut w = drive(watcher);
        w.until(|e| *e == Ev::InitDone).await;
        assert_matches(&reader, h, &rt);
        change_pods(h, 5, "meta");
        converge(&reader, h, &rt).await;
        let one = reader.iter().next().unwrap().unwrap();
        assert!(
            one.metadata.labels.is_some(),
            "labels are kept in metadata-only mode"
        );
        w.stop().await;
    }
    let deleted = change_pods(h, 3, "meta2");
    h.compact();
    h.reset_counts();
    let db = fx.open(engine);
    let (reader, watcher) = db
        .metadata_store("pods-meta", fx.pods(), cfg(false))
        .unwrap();
    assert!(reader.is_ready());
    let mut w = drive(watcher);
    let mut evs = w.until(|e| matches!(e, Ev::Resumed(_))).await;
    while evs.iter().filter(|e| matches!(e, Ev::Delete(_))).count() < 3 {
        evs.extend(w.until(|e| matches!(e, Ev::Delete(_))).await);
    }
    for d in &deleted {
        assert!(
            evs.contains(&Ev::Delete(d.clone())),
            "missing Delete({d}): {}",
            summary(&evs)
        );
    }
    converge(&reader, h, &rt).await;
    assert_eq!(reader.stats().relists, 1);
}

/// A transform runs before writing, and its name is part of the identity.
async fn transform_drops_managed_fields_before_writing(engine: Engine) {
    let fx = Fixture::with_pods(300, 1).await;
    let h = &fx.h;
    assert!(h.list(&ResourceType::pods())[0]["metadata"]["managedFields"].is_array());
    {
        let db = fx.open(engine);
        let (reader, w) = fx.synced_pods(&db, cfg(false).drop_managed_fields()).await;
        assert_matches(&reader, h, &ResourceType::pods());
        for p in reader.iter() {
            assert!(
                p.unwrap().metadata.managed_fields.is_none(),
                "managedFields were stored"
            );
        }
        w.stop().await;
    }
    // Without the transform the stored data would be wrong for the new identity: reset.
    let db = fx.open(engine);
    let (reader, _watcher) = db.store("pods", fx.pods(), cfg(false)).unwrap();
    assert_eq!(reader.stats().identity_resets, 1);
    assert_eq!(reader.len(), 0);
}

/// A store opened with other selectors does not resume: it starts clean and relists.
async fn changed_selector_does_not_resume(engine: Engine) {
    let fx = Fixture::with_pods(600, 2).await;
    let h = &fx.h;
    {
        let db = fx.open(engine);
        let (_r, w) = fx.synced_pods(&db, cfg(false)).await;
        w.stop().await;
    }
    h.reset_counts();
    let db = fx.open(engine);
    let (reader, watcher) = db
        .store(
            "pods",
            Api::<Pod>::namespaced(fx.server.client(), "ns-1"),
            cfg(false).labels("app"),
        )
        .unwrap();
    assert_eq!(reader.stats().identity_resets, 1);
    assert!(!reader.is_ready(), "a reset store is not ready");
    let mut w = drive(watcher);
    let evs = w.until(|e| *e == Ev::InitDone).await;
    assert!(!evs.iter().any(|e| matches!(e, Ev::Resumed(_))));
    assert!(h.counts().list >= 1);
    let expected = h
        .list(&ResourceType::pods())
        .into_iter()
        .filter(|o| o["metadata"]["namespace"] == "ns-1")
        .count();
    assert_eq!(reader.len(), expected as usize);
    assert!(
        reader
            .iter()
            .all(|p| p.unwrap().metadata.namespace.as_deref() == Some("ns-1"))
    );
}

/// Malformed objects in a page and in a watch event are skipped and counted; nothing else is lost.
async fn bad_objects_are_skipped_and_counted(engine: Engine) {
    let fx = Fixture::with_pods(800, 2).await;
    let (h, rt) = (&fx.h, ResourceType::pods());
    h.faults().malformed_next_list();
    let db = fx.open(engine);
    let (reader, _w) = fx.synced_pods(&db, cfg(false)).await;
    assert_matches(&reader, h, &rt);
    assert_eq!(reader.stats().bad_objects, 1);
    h.faults().malformed_next_watch();
    h.faults().close_watches();
    change_pods(h, 3, "bad");
    converge(&reader, h, &rt).await;
    assert_eq!(reader.stats().bad_objects, 2);
}

/// 5xx answers and `ResourceVersionTooLarge` are retried with backoff, without a relist.
async fn server_errors_are_retried(engine: Engine) {
    let fx = Fixture::with_pods(1000, 2).await;
    let (h, rt) = (&fx.h, ResourceType::pods());
    h.faults().fail_next(Verb::List, 503, 2);
    // Without kube's own retry layer, so that the watcher's backoff is what recovers.
    let client = kube_persist_testkit::client_for_opts(&fx.server.url(), None, false);
    let db = fx.open(engine);
    let (reader, watcher) = db
        .store("pods", Api::<Pod>::all(client), cfg(false))
        .unwrap();
    let mut w = drive(watcher);
    let evs = w.until(|e| *e == Ev::InitDone).await;
    assert_eq!(
        evs.iter().filter(|e| matches!(e, Ev::Error(_))).count(),
        2,
        "{}",
        summary(&evs)
    );
    reader.wait_until_live().await.unwrap();
    h.faults().fail_next(Verb::Watch, 504, 2);
    h.faults().close_watches();
    change_pods(h, 4, "err");
    converge(&reader, h, &rt).await;
    let stats = reader.stats();
    assert_eq!(stats.relists, 0, "{stats:?}");
    assert!(stats.errors >= 3, "{stats:?}");
}

/// A second open of the same directory names it; the stream name is exclusive too. Each
/// refusal is a variant a caller can match, naming what it refused.
async fn locked_directory_and_duplicate_stream_are_clear_errors(engine: Engine) {
    let fx = Fixture::new().await;
    let db = fx.open(engine);
    match try_open_db(engine, fx.path()) {
        Err(Error::Locked { path, .. }) => assert_eq!(path, fx.path()),
        other => panic!("expected Locked, got {other:?}"),
    }
    let _pair = db
        .store("pods", fx.pods(), StreamConfig::default())
        .unwrap();
    let err = db
        .store("pods", fx.pods(), StreamConfig::default())
        .unwrap_err();
    assert!(err.to_string().contains("already open"), "{err}");
    match &err {
        Error::StreamInUse { path, stream, .. } => {
            assert_eq!((path.as_path(), stream.as_str()), (fx.path(), "pods"))
        }
        other => panic!("expected StreamInUse, got {other:?}"),
    }
    assert!(!err.is_transient(), "another live writer is not waited out");
    match db.drop_stream("pods") {
        Err(Error::StreamInUse { stream, .. }) => assert_eq!(stream, "pods"),
        other => panic!("expected StreamInUse, got {other:?}"),
    }
    match db.drop_stream("absent") {
        Err(Error::NoSuchStream { stream, .. }) => assert_eq!(stream, "absent"),
        other => panic!("expected NoSuchStream, got {other:?}"),
    }
    match db.reconcile_states("nobody").err() {
        Some(Error::NoSuchController { controller, .. }) => assert_eq!(controller, "nobody"),
        other => panic!("expected NoSuchController, got {other:?}"),
    }
    match db.store("", fx.pods(), StreamConfig::default()).err() {
        Some(Error::InvalidArgument { detail, .. }) => {
            assert!(detail.contains("empty"), "{detail}")
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    let (keys, _w) = db
        .store("keys", fx.pods(), StreamConfig::default().keys_only())
        .unwrap();
    match keys.get(&ObjectRef::new("web-0").within("default")) {
        Err(Error::KeysOnly { stream, .. }) => assert_eq!(stream, "keys"),
        other => panic!("expected KeysOnly, got {other:?}"),
    }
}

/// A store closed in this process reopens once the last handle on its files is gone, however
/// long that takes (within 30 s): here a `Reader` outlives its `Db` by 3 s, as a queued write
/// or redb's final flush on a loaded disk can. The reopen waits for that release, not for a
/// fixed time (it was 2 s, and CI once saw `Locked` on a reopen after a watcher stopped).
async fn reopen_waits_for_the_last_handle_of_a_closed_store(engine: Engine) {
    let fx = Fixture::new().await;
    let db = fx.open(engine);
    let (reader, watcher) = db
        .store("pods", fx.pods(), StreamConfig::default())
        .unwrap();
    drop((watcher, db));
    let held = Duration::from_secs(3);
    let releaser = std::thread::spawn(move || {
        std::thread::sleep(held);
        drop(reader);
    });
    let path = fx.path().to_path_buf();
    let t0 = std::time::Instant::now();
    let reopened = tokio::task::spawn_blocking(move || try_open_db(engine, &path))
        .await
        .unwrap();
    let waited = t0.elapsed();
    reopened.expect("the store reopens once the reader is dropped");
    assert!(
        waited >= held,
        "reopened after {waited:?}, while the reader held the files"
    );
    releaser.join().unwrap();
}

/// Readers on many tasks never see an object older than one they already saw, while the
/// watcher applies updates (the hot cache is invalidated in the same step as the write).
async fn hot_cache_never_goes_back_in_time(engine: Engine) {
    let fx = Fixture::with_pods(200, 1).await;
    let (h, rt) = (&fx.h, ResourceType::pods());
    let db = fx.open(engine);
    let (reader, _w) = fx.synced_pods(&db, cfg(false).hot_cache(64 << 20)).await;
    let names: Vec<String> = (0..20).map(|i| format!("pod-{i}")).collect();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut readers = Vec::new();
    for _ in 0..4 {
        let (reader, names, stop) = (reader.clone(), names.clone(), stop.clone());
        readers.push(tokio::task::spawn_blocking(move || {
            // The age of a read is the `round` label the test wrote (None before the first
            // round), never the resourceVersion: that is opaque and has no order.
            let mut last = std::collections::HashMap::<String, Option<u64>>::new();
            let mut reads = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for n in &names {
                    let pod = reader.get_named(Some("ns-0"), n).unwrap().expect("present");
                    let round: Option<u64> = pod
                        .metadata
                        .labels
                        .as_ref()
                        .and_then(|l| l.get("round"))
                        .map(|r| r.parse().expect("the test writes numbers"));
                    let prev = last.insert(n.clone(), round).flatten();
                    assert!(
                        round >= prev,
                        "{n}: read round {round:?} after round {prev:?} (rv {:?})",
                        pod.metadata.resource_version
                    );
                    reads += 1;
                }
            }
            reads
        }));
    }
    for round in 0..30 {
        for n in &names {
            let mut o = h.get(&rt, Some("ns-0"), n).unwrap();
            o["metadata"]["labels"]["round"] = round.to_string().into();
            h.apply(&rt, o);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    converge(&reader, h, &rt).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut total = 0;
    for r in readers {
        total += r.await.unwrap();
    }
    assert!(total > 1000, "readers made {total} reads");
    // After convergence, cached reads return the newest versions.
    for n in &names {
        let cached = reader.get_named(Some("ns-0"), n).unwrap().unwrap();
        let server = h.get(&rt, Some("ns-0"), n).unwrap();
        assert_eq!(
            cached.metadata.resource_version.as_deref(),
            server["metadata"]["resourceVersion"].as_str()
        );
    }
}

const READER_CHILD_ENV: &str = "KP_STORE_READER_DIR";

/// The child process of the reader tests below: creates a redb store if there is none, then
/// holds it open read-only (as the `kube-persist` tool's reading commands do) until killed.
#[test]
#[ignore = "child process of a_periodic_writer_waits_for_a_reader_in_another_process"]
fn read_only_holder_child() {
    let dir = std::env::var(READER_CHILD_ENV).expect("child mode needs KP_STORE_READER_DIR");
    if !std::path::Path::new(&dir).exists() {
        drop(kube_persist::Db::open(&dir).expect("child creates the store"));
        wait_unlocked(std::path::Path::new(&dir));
    }
    let db = kube_persist::Db::open_with(&dir, kube_persist::DbConfig::default().read_only())
        .expect("child opens the store read-only");
    println!("reading {dir}");
    loop {
        std::hint::black_box(&db);
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// A child process holding `path` read-only, started once it has opened the store; killed
/// and reaped when dropped.
struct ReaderChild(std::process::Child);

impl ReaderChild {
    fn start(path: &std::path::Path) -> ReaderChild {
        use std::io::BufRead;
        let mut child = spawn_self(
            "store::read_only_holder_child",
            &[(READER_CHILD_ENV, path.as_os_str())],
        );
        let out = child.stdout.take().unwrap();
        let child = ReaderChild(child);
        let opened = std::io::BufReader::new(out)
            .lines()
            .map_while(Result::ok)
            .any(|l| l.contains("reading "));
        assert!(opened, "the child opened the store read-only");
        child
    }
}

impl Drop for ReaderChild {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Issue 39 item 3: a reader (the `kube-persist` tool, in another process) never keeps a
/// controller with periodic durability (the default) from starting: its `Db::open` waits for
/// the reader to close (here the reader leaves after 1 s) instead of failing `Locked` at once.
/// A reader that stays past `DbConfig::wait_for_readers` makes the open `Locked`, and a
/// store held by a writer is `Locked` without that wait.
#[test]
fn a_periodic_writer_waits_for_a_reader_in_another_process() {
    use kube_persist::{Db, DbConfig};
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("cache");
    // The child creates the store: this process never had it open, so its own reopen
    // waits (for handles of a store it closed) play no part.

    // The reader leaves after 1 s: the writer opens then.
    let reader = ReaderChild::start(&path);
    let t0 = std::time::Instant::now();
    let leaving = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(1));
        drop(reader);
    });
    let db = Db::open(&path).expect("the writer opens once the reader has closed");
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    leaving.join().unwrap();
    // A second writer is refused at once, not after the readers' wait.
    let t0 = std::time::Instant::now();
    assert!(matches!(Db::open(&path), Err(Error::Locked { .. })));
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    drop(db);
    wait_unlocked(&path);

    // A reader that stays: Locked once the (short) wait has passed.
    let _reader = ReaderChild::start(&path);
    let wait = Duration::from_millis(500);
    let t0 = std::time::Instant::now();
    match Db::open_with(&path, DbConfig::default().wait_for_readers(wait)) {
        Err(Error::Locked { path: p, .. }) => assert_eq!(p, path),
        other => panic!("expected Locked past the wait, got {other:?}"),
    }
    assert!(t0.elapsed() >= wait, "{:?}", t0.elapsed());
}

engine_tests! {
    async: cold_sync_then_warm_restart_paginated,
        cold_sync_then_warm_restart_streaming,
        relist_after_410_on_resume_paginated,
        relist_after_410_on_resume_streaming,
        live_watch_410_relists_without_emptying,
        expired_continue_token_restarts_the_list,
        dynamic_object_cold_warm_and_relist,
        metadata_only_store,
        transform_drops_managed_fields_before_writing,
        changed_selector_does_not_resume,
        bad_objects_are_skipped_and_counted,
        server_errors_are_retried,
        locked_directory_and_duplicate_stream_are_clear_errors,
        reopen_waits_for_the_last_handle_of_a_closed_store,
        hot_cache_never_goes_back_in_time,
}
