//! The delta relist (issue 42): a store past the watch history lists metadata only and
//! fetches the bodies of the new or changed objects. Against the testkit server on both
//! engines: the store equals the server after it, deletions are exact, one LIST narrowed to
//! the object (never a GET) is made for each new or changed object and none for the others,
//! `Auto` lists a page in full when most of it changed, `Full` makes no fetch, and a body
//! fetched newer than the list is not replaced by the older events the watch replays. The
//! seams (selectors, refusals, failures, names, the window) are in `delta_seams.rs`.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::common::{Ev, Fixture, assert_matches, deleted_keys, eventually, server_versions};

use kube_persist::{Engine, RelistMode, StreamConfig};
use kube_persist_testkit::ResourceType;

pub(crate) const PODS: usize = 600;
pub(crate) const PAGE: u32 = 100;

pub(crate) fn cfg(mode: RelistMode) -> StreamConfig {
    StreamConfig::default()
        .page_size(PAGE)
        .relist_mode(mode)
        .backoff(Duration::from_millis(20), Duration::from_millis(200))
        .relist_jitter(Duration::ZERO)
}

/// The keys whose version differs between `before` and `after` or that are new, and the
/// keys deleted.
fn changes(
    before: &BTreeMap<String, String>,
    after: &BTreeMap<String, String>,
) -> (BTreeSet<String>, BTreeSet<String>) {
    let changed = after
        .iter()
        .filter(|(k, v)| before.get(*k) != Some(*v))
        .map(|(k, _)| k.clone())
        .collect();
    let deleted = before
        .keys()
        .filter(|k| !after.contains_key(*k))
        .cloned()
        .collect();
    (changed, deleted)
}

/// Sync a store, stop it, change the server (`updates`, `creates`, `deletes`) and forget
/// its history, then reopen the store in `mode` and wait for its resume. Returns the
/// fixture's view: (changed keys, deleted keys, events after the reopen, stats, GETs).
pub(crate) async fn relist_after(
    engine: Engine,
    mode: RelistMode,
    updates: usize,
    creates: usize,
    deletes: usize,
) -> Outcome {
    relist_after_with(engine, cfg(mode), (updates, creates, deletes), |_| {}).await
}

/// [`relist_after`] with the stream configured by `config`, and `before` run on the server
/// just before the store is reopened (faults to inject), by a client without kube's retry
/// layer.
pub(crate) async fn relist_after_with(
    engine: Engine,
    config: StreamConfig,
    (updates, creates, deletes): (usize, usize, usize),
    before: impl FnOnce(&kube_persist_testkit::ServerHandle),
) -> Outcome {
    let fx = Fixture::with_pods(PODS, 3).await;
    let pods = ResourceType::pods();
    let db = fx.open(engine);
    let (_, w) = fx.synced_pods(&db, config.clone()).await;
    w.stop().await;
    let before_versions = server_versions(&fx.h, &pods);
    fx.h.churn(updates, creates, deletes, 42);
    let after = server_versions(&fx.h, &pods);
    fx.h.compact();
    fx.h.reset_counts();
    before(&fx.h);
    // Without kube's retry layer: the store sees every failure the server answers.
    let client = kube_persist_testkit::client_for_opts(&fx.server.url(), None, false);
    let (reader, watcher) = db.store("pods", kube::Api::all(client), config).unwrap();
    let mut w = crate::common::drive(watcher);
    let events = relisted(&fx, &reader, &mut w).await;
    fx.h.faults().clear();
    assert_matches(&reader, &fx.h, &pods);
    let (changed, deleted) = changes(&before_versions, &after);
    Outcome {
        changed,
        deleted,
        events,
        stats: reader.stats(),
        gets: fx.h.counts().get,
        fetches: fx.h.counts().list_named,
        max_fetches_in_flight: fx.h.counts().list_named_max_in_flight,
    }
}

/// Wait until the reopened store has relisted and is synced again, and return the events
/// it gave meanwhile. (A store reopened from a `Synced` checkpoint announces `Resumed` at
/// once; the 410 and the relist come after.) The end is proven by an event: a new sentinel
/// Pod is created once the relist is over, and its `Apply` is awaited.
pub(crate) async fn relisted(
    fx: &Fixture,
    reader: &kube_persist::Reader<k8s_openapi::api::core::v1::Pod>,
    w: &mut crate::common::Driven,
) -> Vec<Ev> {
    eventually("the relist completes", || {
        reader.stats().relists >= 1 && reader.phase() == kube_persist::SyncPhase::Synced
    })
    .await;
    let pod = serde_json::json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "sentinel", "namespace": "ns-0"},
        "spec": {"containers": [{"name": "c", "image": "i"}]}});
    fx.h.apply(&ResourceType::pods(), pod);
    let mut events = crate::common::until_apply(w, "ns-0/sentinel").await;
    events.pop();
    events
}

pub(crate) struct Outcome {
    pub(crate) changed: BTreeSet<String>,
    pub(crate) deleted: BTreeSet<String>,
    pub(crate) events: Vec<Ev>,
    pub(crate) stats: kube_persist::Stats,
    /// GETs of single objects: none in any mode (the shipped RBAC grants no `get`).
    pub(crate) gets: u64,
    /// LISTs narrowed to one object: the delta relist's fetches.
    pub(crate) fetches: u64,
    /// The most of them the server answered at once.
    pub(crate) max_fetches_in_flight: u64,
}

impl Outcome {
    /// The relist fell back to full pages once, took no fetched body, and gave exactly
    /// the changes as `Apply` and the deletions as `Delete` events.
    pub(crate) fn assert_fell_back_exactly(&self) {
        assert_eq!(self.stats.delta_fallbacks, 1, "{:?}", self.stats);
        assert_eq!(
            self.stats.bodies_fetched, 0,
            "no fetched body taken: {:?}",
            self.stats
        );
        assert!(
            self.stats.list_pages > self.stats.metadata_pages,
            "pages in full: {:?}",
            self.stats
        );
        assert_eq!(
            self.applied(),
            self.changed,
            "Apply events: exactly the changes"
        );
        let deleted: BTreeSet<String> = deleted_keys(&self.events).into_iter().collect();
        assert_eq!(
            deleted, self.deleted,
            "Delete events: exactly the deletions"
        );
    }

    pub(crate) fn applied(&self) -> BTreeSet<String> {
        self.events
            .iter()
            .filter_map(|e| match e {
                Ev::Apply(k) => Some(k.clone()),
                _ => None,
            })
            .collect()
    }
}

/// A delta relist of a store stopped while 5% of the objects changed: one GET per new or
/// changed object, metadata pages only, exact deletions and changes.
async fn delta_relist_fetches_only_what_changed(engine: Engine) {
    let o = relist_after(engine, RelistMode::Delta, 20, 5, 5).await;
    assert_eq!(
        (o.fetches, o.gets),
        (o.changed.len() as u64, 0),
        "one fetch (a narrowed LIST) per new or changed object, no GET"
    );
    assert_eq!(o.stats.bodies_fetched, o.changed.len() as u64);
    assert!(o.stats.metadata_pages >= (PODS as u64).div_ceil(PAGE as u64));
    assert_eq!(
        o.stats.list_pages, o.stats.metadata_pages,
        "no page listed in full"
    );
    assert_eq!(o.applied(), o.changed, "Apply events: exactly the changes");
    let deleted: BTreeSet<String> = deleted_keys(&o.events).into_iter().collect();
    assert_eq!(deleted, o.deleted, "Delete events: exactly the deletions");
}

/// `Full` lists full pages and makes no fetch.
async fn full_relist_makes_no_get(engine: Engine) {
    let o = relist_after(engine, RelistMode::Full, 20, 5, 5).await;
    assert_eq!(
        (
            o.gets,
            o.fetches,
            o.stats.bodies_fetched,
            o.stats.metadata_pages
        ),
        (0, 0, 0, 0)
    );
    assert_eq!(o.applied(), o.changed);
    let deleted: BTreeSet<String> = deleted_keys(&o.events).into_iter().collect();
    assert_eq!(deleted, o.deleted);
}

/// `Auto` with half of the objects changed lists pages in full (the same snapshot) and
/// still ends equal to the server, with exact deletions.
async fn auto_lists_pages_in_full_when_most_changed(engine: Engine) {
    let o = relist_after(engine, RelistMode::Auto, 400, 10, 10).await;
    assert!(
        o.stats.list_pages > o.stats.metadata_pages,
        "some pages in full: {:?}",
        o.stats
    );
    assert!(
        o.stats.bodies_fetched < o.changed.len() as u64,
        "fewer fetches than changes: {:?}",
        o.stats
    );
    assert_eq!(o.applied(), o.changed);
    let deleted: BTreeSet<String> = deleted_keys(&o.events).into_iter().collect();
    assert_eq!(deleted, o.deleted);
}

/// An object changed twice while the delta relist runs, after the list's snapshot and
/// before its fetch: the store holds the newer body, and the watch from the list's
/// resourceVersion replays the older change, which must not replace it (one `Apply` of the
/// object, not three).
async fn replayed_events_never_replace_a_newer_fetched_body(engine: Engine) {
    let fx = Fixture::with_pods(PODS, 3).await;
    let pods = ResourceType::pods();
    let db = fx.open(engine);
    let (_, w) = fx.synced_pods(&db, cfg(RelistMode::Delta)).await;
    w.stop().await;
    // The last Pod in key order (on the last page): changed while the store is down.
    let key = server_versions(&fx.h, &pods)
        .keys()
        .next_back()
        .unwrap()
        .clone();
    let (ns, name) = key.split_once('/').unwrap();
    crate::common::relabel_pod(&fx.h, ns, name, "down");
    fx.h.compact();
    fx.h.reset_counts();
    fx.h.faults().page_delay(Duration::from_millis(400));
    let (reader, mut w) = fx.watch_pods(&db, cfg(RelistMode::Delta));
    // The first page fixed the list's snapshot (the second is asked for with its continue
    // token): change the Pod twice before its own page, the last.
    let h = fx.h.clone();
    eventually("the second metadata page was asked for", || {
        h.counts().list >= 2
    })
    .await;
    crate::common::relabel_pod(&fx.h, ns, name, "during-1");
    crate::common::relabel_pod(&fx.h, ns, name, "during-2");
    fx.h.faults().page_delay(Duration::ZERO);
    let events = relisted(&fx, &reader, &mut w).await;
    assert!(
        reader.stats().stale_events_skipped >= 1,
        "the older replayed change was skipped: {:?}",
        reader.stats()
    );
    assert_matches(&reader, &fx.h, &pods);
    let applies = events
        .iter()
        .filter(|e| **e == Ev::Apply(key.clone()))
        .count();
    assert_eq!(applies, 1, "{key}: one Apply, the fetched body: {events:?}");
    let pod = reader.get_named(Some(ns), name).unwrap().unwrap();
    assert_eq!(
        pod.metadata
            .labels
            .as_ref()
            .unwrap()
            .get("touched")
            .map(String::as_str),
        Some("during-2")
    );
}

/// A delta relist of a sharded store (the server filtering by `shardSelector`, or ignoring it
/// so that the store filters), with a transform and an index, and of a keys-only store:
/// each ends with exactly its objects, fetched only where they changed in its shard, the
/// transform applied to the fetched bodies, and the index equal to the stored objects.
async fn delta_relist_of_sharded_transformed_indexed_and_keys_only_stores(engine: Engine) {
    use kube_persist::{Shard, ShardKey};
    use kube_persist_testkit::{ServerOptions, TestServer};
    for server_side in [true, false] {
        let server = TestServer::start_with(ServerOptions {
            sharded_list_and_watch: server_side,
            ..Default::default()
        })
        .await;
        let fx = Fixture::on(server);
        fx.h.seed_pods(PODS, 3);
        let pods = ResourceType::pods();
        let shard = Shard::even(ShardKey::Uid, 0, 2).unwrap();
        let sharded = || {
            cfg(RelistMode::Delta)
                .shard(shard.clone())
                .drop_managed_fields()
                .index("ns", |p: &k8s_openapi::api::core::v1::Pod| {
                    p.metadata.namespace.clone().into_iter().collect()
                })
        };
        let keys_only = || cfg(RelistMode::Delta).keys_only();
        let db = fx.open(engine);
        let open = |name: &str, c: StreamConfig| {
            let (reader, watcher) = db.store(name, fx.pods(), c).unwrap();
            (reader, crate::common::drive(watcher))
        };
        for (name, c) in [("sharded", sharded()), ("keys", keys_only())] {
            let (_, mut w) = open(name, c);
            w.until(|e| *e == Ev::InitDone).await;
            w.stop().await;
        }
        let in_shard = |v: &serde_json::Value| {
            let m = &v["metadata"];
            shard.contains(m["uid"].as_str(), m["namespace"].as_str())
        };
        let key_of = |v: &serde_json::Value| {
            let m = &v["metadata"];
            format!(
                "{}/{}",
                m["namespace"].as_str().unwrap(),
                m["name"].as_str().unwrap()
            )
        };
        let before: BTreeMap<String, String> = server_versions(&fx.h, &pods);
        fx.h.churn(30, 6, 6, 7);
        fx.h.compact();
        let after_objects = fx.h.list(&pods);
        let (changed, _) = changes(&before, &server_versions(&fx.h, &pods));
        let changed_in_shard = after_objects
            .iter()
            .filter(|o| in_shard(o) && changed.contains(&key_of(o)))
            .count() as u64;
        let want: BTreeMap<String, String> = after_objects
            .iter()
            .filter(|o| in_shard(o))
            .map(|o| {
                (
                    key_of(o),
                    o["metadata"]["resourceVersion"]
                        .as_str()
                        .unwrap()
                        .to_string(),
                )
            })
            .collect();
        // Caught up after the relist: the store holds what the server had at the watch's
        // (re)connect, and nothing changed since.
        let caught_up = |r: &kube_persist::Reader<k8s_openapi::api::core::v1::Pod>| {
            r.stats().relists >= 1
                && r.phase() == kube_persist::SyncPhase::Synced
                && r.is_caught_up()
        };
        let (reader, w) = open("sharded", sharded());
        eventually("the sharded store relists and catches up", || {
            caught_up(&reader)
        })
        .await;
        let store = crate::common::store_versions(&reader);
        assert_eq!(store, want, "server-side shards: {server_side}");
        assert_eq!(
            reader.stats().bodies_fetched,
            changed_in_shard,
            "fetches only for the shard's changes (server-side shards: {server_side})"
        );
        for ns in ["ns-0", "ns-1", "ns-2"] {
            let indexed: BTreeSet<String> = reader
                .by_index("ns", ns)
                .unwrap()
                .map(|p| crate::common::key(&*p.unwrap()))
                .collect();
            let stored: BTreeSet<String> = reader
                .iter()
                .map(Result::unwrap)
                .filter(|p| p.metadata.namespace.as_deref() == Some(ns))
                .map(|p| crate::common::key(&*p))
                .collect();
            assert_eq!(indexed, stored, "index {ns}");
        }
        for p in reader.iter() {
            let p = p.unwrap();
            assert!(p.metadata.managed_fields.is_none(), "transform applied");
        }
        drop(w);
        let (keys, _w) = open("keys", keys_only());
        eventually("the keys-only store relists and catches up", || {
            caught_up(&keys)
        })
        .await;
        assert_eq!(keys.len(), fx.h.list(&pods).len(), "keys-only store");
        assert_eq!(
            keys.stats().bodies_fetched,
            changed.len() as u64,
            "keys-only: one fetch per change"
        );
    }
}

engine_tests!(async:
    delta_relist_fetches_only_what_changed,
    full_relist_makes_no_get,
    auto_lists_pages_in_full_when_most_changed,
    replayed_events_never_replace_a_newer_fetched_body,
    delta_relist_of_sharded_transformed_indexed_and_keys_only_stores,
);
