//! A delta relist's fetches (issue 56), against the testkit server on both engines: a fetch
//! answered 404 or with what it did not ask for (a server that ignores the field selector,
//! or answers from a stale cache) makes the relist list the rest in full, without a
//! `Delete` of an object that is still there; a fetch stays within the stream's label and
//! field selectors (an object recreated outside the selection before its fetch is not
//! stored); and no more fetches are in flight than `FETCHES_IN_FLIGHT` per stream and
//! `FETCHES_PER_DIRECTORY` per directory.

use std::time::Duration;

use kube_persist::{Engine, RelistMode, StreamConfig, SyncPhase};
use kube_persist_testkit::{ResourceType, ServerHandle};
use serde_json::Value;

use crate::common::{deleted_keys, eventually, server_versions, store_versions};
use crate::delta_relist::{PODS, cfg, relist_after_with};
use crate::delta_seams::{last_pod, reopen_with_changes_before_fetch};

/// `src/sync/machine/fetch.rs`'s `FETCHES_IN_FLIGHT`: one stream's fetches at once.
const FETCHES_IN_FLIGHT: u64 = 16;
/// `src/exec/worker.rs`'s `FETCHES_PER_DIRECTORY`: the fetches of a directory's streams at
/// once.
const FETCHES_PER_DIRECTORY: u64 = 32;

/// (4) Every fetch answered 404 (a LIST of the collection: it says nothing of one object).
/// The relist lists the rest in full: every changed object is in the store at its current
/// version (the relist's helper compares the store with the server), and the only
/// `Delete` events are of the objects deleted on the server. At 9ad23f8 each 404 was taken
/// as "gone": the changed objects were swept with a `Delete` and stayed missing.
async fn a_fetch_answered_404_lists_the_rest_in_full(engine: Engine) {
    let o = relist_after_with(engine, cfg(RelistMode::Delta), (20, 5, 5), |h| {
        h.faults().fail_named_lists(1, 404)
    })
    .await;
    o.assert_fell_back_exactly();
}

/// (5) A server that ignores the field selector of a fetch answers the whole collection,
/// unpaginated: nothing of it is taken, the relist lists the rest in full (counted once in
/// `delta_fallbacks`) and ends equal to the server with exact events. At 9ad23f8 the
/// answer was searched for the object and taken (no fallback, every fetch a collection).
async fn a_server_ignoring_the_fetch_selector_lists_the_rest_in_full(engine: Engine) {
    let o = relist_after_with(engine, cfg(RelistMode::Delta), (20, 5, 5), |h| {
        h.faults().ignore_named_field_selector(true)
    })
    .await;
    o.assert_fell_back_exactly();
}

/// (5) A server that answers fetches from a stale cache (it ignores
/// `resourceVersionMatch=NotOlderThan`: every fetch is answered as the collection was
/// before the store's downtime): no answer older than its metadata page is taken, the
/// relist lists the rest in full and ends equal to the server. At 9ad23f8 the older bodies
/// were stored, and the watch from the list's resourceVersion never brought the changes
/// again: the store kept them stale, and missed the objects created meanwhile.
async fn a_fetch_answered_older_than_its_page_lists_the_rest_in_full(engine: Engine) {
    let fx = crate::common::Fixture::with_pods(PODS, 3).await;
    let pods = ResourceType::pods();
    let db = fx.open(engine);
    let (_, w) = fx.synced_pods(&db, cfg(RelistMode::Delta)).await;
    w.stop().await;
    let before = fx.h.revision();
    fx.h.churn(20, 5, 5, 42);
    // The history is kept (the stale answers are read from it): the relist comes from the
    // resumed watch's 410.
    fx.h.faults().answer_named_lists_at(Some(before));
    fx.h.faults().gone_next_watch();
    fx.h.reset_counts();
    let (reader, mut w) = fx.watch_pods(&db, cfg(RelistMode::Delta));
    crate::delta_relist::relisted(&fx, &reader, &mut w).await;
    fx.h.faults().clear();
    crate::common::assert_matches(&reader, &fx.h, &pods);
    let stats = reader.stats();
    assert!(fx.h.counts().list_named > 0, "fetches were made");
    assert_eq!(stats.delta_fallbacks, 1, "{stats:?}");
    assert_eq!(stats.bodies_fetched, 0, "{stats:?}");
}

/// A store of the Pods `config` selects: the last Pod P changes while the store is down
/// (so its relist fetches it), and between its metadata page and its fetch P is deleted
/// and created again (another uid) with `move_out` applied, outside the selection. The
/// fetch, a LIST within the selection, answers empty: P is swept with a `Delete`, the
/// watch's replayed deletion of the old P finds nothing, and the store ends as the
/// selection. A fetch without the stream's selectors would store the new P, newer than
/// the replayed deletion of the old one (another uid, skipped as older): P outside the
/// selection, for good.
async fn recreated_outside_the_selection_before_its_fetch(
    engine: Engine,
    config: StreamConfig,
    move_out: fn(&mut Value),
) {
    let fx = crate::common::Fixture::with_pods(PODS, 3).await;
    let pods = ResourceType::pods();
    let db = fx.open(engine);
    let (_, w) = fx.synced_pods(&db, config.clone()).await;
    w.stop().await;
    let (ns, name) = last_pod(&fx.h);
    let key = format!("{ns}/{name}");
    crate::common::relabel_pod(&fx.h, &ns, &name, "down");
    let (reader, events) = reopen_with_changes_before_fetch(&fx, &db, config, |h| {
        let mut pod = h.delete(&pods, Some(&ns), &name).unwrap();
        let m = pod["metadata"].as_object_mut().unwrap();
        for field in [
            "uid",
            "resourceVersion",
            "creationTimestamp",
            "managedFields",
        ] {
            m.remove(field);
        }
        move_out(&mut pod);
        h.create(&pods, pod).unwrap();
    })
    .await;
    assert!(
        reader.get_named(Some(&ns), &name).unwrap().is_none(),
        "{key} was recreated outside the selection"
    );
    let mut want = server_versions(&fx.h, &pods);
    want.remove(&key);
    assert_eq!(store_versions(&reader), want, "the store is the selection");
    assert!(
        deleted_keys(&events).contains(&key),
        "{key} is deleted: {events:?}"
    );
    assert_eq!(reader.stats().delta_fallbacks, 0, "{:?}", reader.stats());
}

/// (8a) A fetch carries the stream's label selector (`params::one`).
async fn a_fetch_stays_within_the_label_selector(engine: Engine) {
    recreated_outside_the_selection_before_its_fetch(
        engine,
        cfg(RelistMode::Delta).labels("touched!=out"),
        |pod| pod["metadata"]["labels"]["touched"] = "out".into(),
    )
    .await
}

/// (8a) A fetch carries the stream's field selector (`params::one`): a per-node agent's
/// store, the Pod recreated on another node (the testkit selects Pods by `spec.nodeName`
/// as kube-apiserver does).
async fn a_fetch_stays_within_the_field_selector(engine: Engine) {
    recreated_outside_the_selection_before_its_fetch(
        engine,
        cfg(RelistMode::Delta).fields("spec.nodeName!=elsewhere"),
        |pod| pod["spec"]["nodeName"] = "elsewhere".into(),
    )
    .await
}

/// (8b) Fetches answered slowly (so that they overlap) while most objects changed: one
/// stream keeps exactly `FETCHES_IN_FLIGHT` of them in flight at most (each page has more
/// changes than that); three streams of one directory relisting at once keep exactly
/// `FETCHES_PER_DIRECTORY` (fewer than their 48). Raising or removing either cap fails
/// this test.
async fn fetches_in_flight_are_capped_per_stream_and_per_directory(engine: Engine) {
    let slow = |h: &ServerHandle| h.faults().named_list_delay(Duration::from_millis(150));
    let o = relist_after_with(engine, cfg(RelistMode::Delta), (PODS, 0, 0), slow).await;
    assert!(
        o.changed.len() >= PODS / 2,
        "most objects changed: {}",
        o.changed.len()
    );
    assert_eq!(
        o.max_fetches_in_flight, FETCHES_IN_FLIGHT,
        "one stream's fetches in flight at most"
    );

    let fx = crate::common::Fixture::with_pods(PODS, 3).await;
    let db = fx.open(engine);
    let names = ["a", "b", "c"];
    for name in names {
        let (_, watcher) = db.store(name, fx.pods(), cfg(RelistMode::Delta)).unwrap();
        let mut w = crate::common::drive(watcher);
        w.until(|e| *e == crate::common::Ev::InitDone).await;
        w.stop().await;
    }
    fx.h.churn(PODS, 0, 0, 42);
    fx.h.compact();
    slow(&fx.h);
    fx.h.reset_counts();
    let streams: Vec<_> = names
        .iter()
        .map(|name| {
            let (reader, watcher) = db.store(name, fx.pods(), cfg(RelistMode::Delta)).unwrap();
            (reader, crate::common::drive(watcher))
        })
        .collect();
    for (reader, _) in &streams {
        eventually("each stream relisted by delta", || {
            reader.stats().relists >= 1 && reader.phase() == SyncPhase::Synced
        })
        .await;
        assert!(reader.stats().bodies_fetched > 0, "{:?}", reader.stats());
    }
    assert_eq!(
        fx.h.counts().list_named_max_in_flight,
        FETCHES_PER_DIRECTORY,
        "the directory's fetches in flight at most"
    );
    fx.h.faults().clear();
}

engine_tests!(async:
    a_fetch_answered_404_lists_the_rest_in_full,
    a_server_ignoring_the_fetch_selector_lists_the_rest_in_full,
    a_fetch_answered_older_than_its_page_lists_the_rest_in_full,
    a_fetch_stays_within_the_label_selector,
    a_fetch_stays_within_the_field_selector,
    fetches_in_flight_are_capped_per_stream_and_per_directory,
);
