//! The delta relist where it meets the rest of the product (issue 49), against the testkit
//! server on both engines: a store with a selector keeps only its selection when an object
//! leaves it between its metadata page and its fetch; a server that refuses the fetches (the
//! `list` verb narrowed to one object, 403) makes the relist list in full instead of failing
//! for ever; a transient failure (429) retries one fetch, not the page; objects deleted or
//! recreated under the same name before their fetch end as the server has them; `Auto`
//! relists by delta when few objects changed; an encrypted store relists by delta; and
//! outside a delta relist's window a replayed older event applies as the server sent it.

use std::collections::BTreeSet;
use std::time::Duration;

use kube_persist::{Engine, RelistMode, StreamConfig};
use kube_persist_testkit::{ResourceType, ServerHandle};

use crate::common::{
    Ev, Fixture, assert_matches, deleted_keys, eventually, relabel_pod, server_versions,
    store_versions,
};
use crate::delta_relist::{PODS, cfg, relist_after, relist_after_with, relisted};

/// The last Pod in key order (on the last page of a list): `(namespace, name)`.
pub(crate) fn last_pod(h: &ServerHandle) -> (String, String) {
    let key = server_versions(h, &ResourceType::pods())
        .keys()
        .next_back()
        .unwrap()
        .clone();
    let (ns, name) = key.split_once('/').unwrap();
    (ns.to_string(), name.to_string())
}

/// Reopen a stopped store whose Pods changed while it was down, with the last metadata page
/// held back by a page delay; `between` runs once the list's snapshot is fixed (its second
/// page was asked for) and before the last page's fetches.
pub(crate) async fn reopen_with_changes_before_fetch(
    fx: &Fixture,
    db: &kube_persist::Db,
    config: StreamConfig,
    between: impl FnOnce(&ServerHandle),
) -> (
    kube_persist::Reader<k8s_openapi::api::core::v1::Pod>,
    Vec<Ev>,
) {
    fx.h.compact();
    fx.h.reset_counts();
    fx.h.faults().page_delay(Duration::from_millis(400));
    let (reader, mut w) = fx.watch_pods(db, config);
    let h = fx.h.clone();
    eventually("the second metadata page was asked for", || {
        h.counts().list >= 2
    })
    .await;
    between(&fx.h);
    fx.h.faults().page_delay(Duration::ZERO);
    let events = relisted(fx, &reader, &mut w).await;
    (reader, events)
}

/// (1a) A store of `touched!=out` Pods: P is listed in a metadata page, then moves out of
/// the selection and changes again before its fetch. The fetch (a LIST within the
/// selection) answers empty: P is swept with a `Delete`, and the replayed deletion (P
/// leaving the selection) finds nothing. At 100c979 the GET wrote P outside the selection
/// and the older replayed deletion was skipped: P stayed for good.
async fn an_object_leaving_the_selection_before_its_fetch_is_gone(engine: Engine) {
    let fx = Fixture::with_pods(PODS, 3).await;
    let pods = ResourceType::pods();
    let config = cfg(RelistMode::Delta).labels("touched!=out");
    let db = fx.open(engine);
    let (_, w) = fx.synced_pods(&db, config.clone()).await;
    w.stop().await;
    let (ns, name) = last_pod(&fx.h);
    let key = format!("{ns}/{name}");
    relabel_pod(&fx.h, &ns, &name, "down");
    let (reader, events) = reopen_with_changes_before_fetch(&fx, &db, config, |h| {
        relabel_pod(h, &ns, &name, "out");
        let mut pod = h.get(&pods, Some(&ns), &name).unwrap();
        pod["metadata"]["annotations"]["again"] = "1".into();
        h.apply(&pods, pod);
    })
    .await;
    assert!(
        reader.get_named(Some(&ns), &name).unwrap().is_none(),
        "{key} is outside the selection"
    );
    // The only Pod outside the selection is the one that left it.
    let mut want = server_versions(&fx.h, &pods);
    want.remove(&key);
    assert_eq!(store_versions(&reader), want, "the store is the selection");
    assert_eq!(
        deleted_keys(&events),
        vec![key.clone()],
        "one Delete, of the object that left: {events:?}"
    );
    assert_eq!(fx.h.counts().get, 0, "no GET");
}

/// (8) An object deleted between its metadata page and its fetch (the fetch answers
/// empty), and one deleted and recreated under the same name (another uid): the store ends
/// as the server, with one `Delete` of the first and the second's new uid.
async fn objects_deleted_or_recreated_before_their_fetch(engine: Engine) {
    let fx = Fixture::with_pods(PODS, 3).await;
    let pods = ResourceType::pods();
    let db = fx.open(engine);
    let (_, w) = fx.synced_pods(&db, cfg(RelistMode::Delta)).await;
    w.stop().await;
    let keys: Vec<String> = server_versions(&fx.h, &pods)
        .keys()
        .rev()
        .take(2)
        .cloned()
        .collect();
    let split = |k: &str| {
        let (ns, name) = k.split_once('/').unwrap();
        (ns.to_string(), name.to_string())
    };
    let ((ns1, gone), (ns2, again)) = (split(&keys[0]), split(&keys[1]));
    relabel_pod(&fx.h, &ns1, &gone, "down");
    relabel_pod(&fx.h, &ns2, &again, "down");
    let (reader, events) =
        reopen_with_changes_before_fetch(&fx, &db, cfg(RelistMode::Delta), |h| {
            h.delete(&pods, Some(&ns1), &gone).unwrap();
            let mut pod = h.delete(&pods, Some(&ns2), &again).unwrap();
            let m = pod["metadata"].as_object_mut().unwrap();
            for field in [
                "uid",
                "resourceVersion",
                "creationTimestamp",
                "managedFields",
            ] {
                m.remove(field);
            }
            h.create(&pods, pod).unwrap();
        })
        .await;
    assert_matches(&reader, &fx.h, &pods);
    let server_uid = fx.h.get(&pods, Some(&ns2), &again).unwrap()["metadata"]["uid"]
        .as_str()
        .unwrap()
        .to_string();
    let stored = reader.get_named(Some(&ns2), &again).unwrap().unwrap();
    assert_eq!(stored.metadata.uid.as_deref(), Some(server_uid.as_str()));
    assert!(reader.get_named(Some(&ns1), &gone).unwrap().is_none());
    let deleted: Vec<String> = deleted_keys(&events);
    assert!(
        deleted.contains(&keys[0]),
        "the deleted object is reported: {events:?}"
    );
}

/// (2) A server that refuses every fetch (403 on a LIST narrowed to one object: a verb the
/// store's credentials lack) makes the relist list in full from that page on: it ends equal
/// to the server with exact events, counted once in `delta_fallbacks`. At 100c979 each
/// refused GET failed the page and the stream retried the same page for ever.
async fn refused_fetches_list_the_rest_in_full(engine: Engine) {
    let o = relist_after_with(engine, cfg(RelistMode::Delta), (20, 5, 5), |h| {
        h.faults().fail_named_lists(1, 403)
    })
    .await;
    o.assert_fell_back_exactly();
}

/// (2) A server that refuses metadata-only pages (406: it cannot serve that
/// representation) makes the relist list in full from the first page: exact, counted once.
async fn refused_metadata_pages_list_the_relist_in_full(engine: Engine) {
    let o = relist_after_with(engine, cfg(RelistMode::Delta), (20, 5, 5), |h| {
        h.faults().fail_metadata_lists(Some(406))
    })
    .await;
    assert_eq!(o.stats.delta_fallbacks, 1, "{:?}", o.stats);
    assert_eq!((o.stats.metadata_pages, o.fetches), (0, 0), "{:?}", o.stats);
    assert_eq!(o.stats.errors, 0, "no page failed: {:?}", o.stats);
    assert_eq!(o.applied(), o.changed);
    let deleted: BTreeSet<String> = deleted_keys(&o.events).into_iter().collect();
    assert_eq!(deleted, o.deleted);
}

/// (3) Every 100th fetch answered 429 while every object changed: each failed fetch is
/// retried on its own, so the relist ends with at most 1.1 fetches per change (at 100c979
/// one failure discarded the page's other fetches and listed its metadata again).
async fn transient_fetch_failures_retry_one_fetch(engine: Engine) {
    let o = relist_after_with(engine, cfg(RelistMode::Delta), (PODS, 0, 0), |h| {
        h.faults().fail_named_lists(100, 429)
    })
    .await;
    let changes = o.changed.len() as u64;
    assert!(
        changes >= PODS as u64 / 2,
        "most objects changed: {changes}"
    );
    assert!(o.stats.fetch_retries >= changes / 100, "{:?}", o.stats);
    assert!(
        o.fetches * 10 <= changes * 11,
        "{} fetches for {changes} changes",
        o.fetches
    );
    assert_eq!(o.stats.bodies_fetched, changes);
    assert_eq!(o.applied(), o.changed);
}

/// (8) `Auto` with few changes relists by delta: metadata pages, one fetch per change.
async fn auto_relists_by_delta_when_few_changed(engine: Engine) {
    let o = relist_after(engine, RelistMode::Auto, 3, 1, 1).await;
    assert!(o.stats.metadata_pages > 0, "{:?}", o.stats);
    assert_eq!(
        o.stats.list_pages, o.stats.metadata_pages,
        "no page in full"
    );
    assert_eq!(o.fetches, o.changed.len() as u64);
    assert_eq!(o.applied(), o.changed);
}

/// (8) An encrypted store relists by delta: fetched bodies are sealed as listed ones are.
async fn an_encrypted_store_relists_by_delta(engine: Engine) {
    let fx = Fixture::with_pods(PODS, 3).await;
    let pods = ResourceType::pods();
    let open = || {
        kube_persist::Db::open_with(
            fx.path(),
            kube_persist::DbConfig::default()
                .engine(engine)
                .encryption_key(kube_persist::EncryptionKey::from_bytes([7; 32])),
        )
        .unwrap()
    };
    let db = open();
    let (_, w) = fx.synced_pods(&db, cfg(RelistMode::Delta)).await;
    w.stop().await;
    fx.h.churn(20, 5, 5, 3);
    fx.h.compact();
    fx.h.reset_counts();
    let (reader, mut w) = fx.watch_pods(&db, cfg(RelistMode::Delta));
    relisted(&fx, &reader, &mut w).await;
    assert!(reader.stats().bodies_fetched > 0, "{:?}", reader.stats());
    assert_matches(&reader, &fx.h, &pods);
    w.stop().await;
    drop(reader);
    drop(db);
    // Read back from disk with the key: every body decrypts.
    let db = open();
    let (reader, _w) = fx.watch_pods(&db, cfg(RelistMode::Delta));
    assert_eq!(reader.iter().filter(|p| p.is_ok()).count(), reader.len());
}

/// (7) Outside a delta relist's window (a `Full` store) a replayed event older than the
/// stored version applies as the server sent it; at 100c979 every synced store skipped it.
async fn outside_the_window_an_older_event_applies(engine: Engine) {
    let fx = Fixture::with_pods(50, 1).await;
    let pods = ResourceType::pods();
    let db = fx.open(engine);
    let (reader, mut w) = fx.synced_pods(&db, cfg(RelistMode::Full)).await;
    let (ns, name) = last_pod(&fx.h);
    let mut pod = fx.h.get(&pods, Some(&ns), &name).unwrap();
    let stored = pod["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string();
    let older =
        fx.h.render_resource_version(fx.h.parse_resource_version(&stored).unwrap() - 1);
    pod["metadata"]["resourceVersion"] = older.clone().into();
    pod["metadata"]["labels"]["injected"] = "older".into();
    fx.h.faults()
        .inject_next_watch(serde_json::to_vec(&pod).unwrap());
    fx.h.faults().close_watches();
    crate::common::until_apply(&mut w, &format!("{ns}/{name}")).await;
    let got = reader.get_named(Some(&ns), &name).unwrap().unwrap();
    assert_eq!(
        got.metadata.resource_version.as_deref(),
        Some(older.as_str())
    );
    assert_eq!(reader.stats().stale_events_skipped, 0);
}

engine_tests!(async:
    an_object_leaving_the_selection_before_its_fetch_is_gone,
    objects_deleted_or_recreated_before_their_fetch,
    refused_fetches_list_the_rest_in_full,
    refused_metadata_pages_list_the_relist_in_full,
    transient_fetch_failures_retry_one_fetch,
    auto_relists_by_delta_when_few_changed,
    an_encrypted_store_relists_by_delta,
    outside_the_window_an_older_event_applies,
);
