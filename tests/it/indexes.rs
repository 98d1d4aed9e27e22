//! Beyond the in-memory caches: secondary indexes on disk, label-selector queries and the
//! keys-only delta watcher, against the testkit server.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::common::*;
use k8s_openapi::api::core::v1::Pod;
use kube::core::{Expression, Selector};
use kube_persist::{Error, Reader, StreamConfig};
use kube_persist_testkit::{ResourceType, ServerHandle, make_pod};

fn node_of(p: &Pod) -> Vec<String> {
    p.spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .into_iter()
        .collect()
}

fn cfg() -> StreamConfig {
    StreamConfig::default()
        .backoff(Duration::from_millis(20), Duration::from_millis(200))
        .relist_jitter(Duration::from_millis(10))
        .index("node", node_of)
        .label_index::<Pod>("app")
}

fn key(o: &serde_json::Value) -> String {
    format!(
        "{}/{}",
        o["metadata"]["namespace"].as_str().unwrap(),
        o["metadata"]["name"].as_str().unwrap()
    )
}

/// node → pods on the server.
fn server_nodes(h: &ServerHandle) -> BTreeMap<String, BTreeSet<String>> {
    let mut m: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for o in h.list(&ResourceType::pods()) {
        if let Some(n) = o["spec"]["nodeName"].as_str() {
            m.entry(n.to_string()).or_default().insert(key(&o));
        }
    }
    m
}

fn store_node(r: &Reader<Pod>, node: &str) -> BTreeSet<String> {
    r.by_index("node", node)
        .unwrap()
        .map(|p| {
            let p = p.unwrap();
            assert_eq!(
                node_of(&p),
                vec![node.to_string()],
                "index entry points at a pod on another node"
            );
            format!(
                "{}/{}",
                p.metadata.namespace.clone().unwrap(),
                p.metadata.name.clone().unwrap()
            )
        })
        .collect()
}

fn assert_index_matches(r: &Reader<Pod>, h: &ServerHandle) {
    let server = server_nodes(h);
    for node in (0..100).map(|i| format!("node-{i}")) {
        let want = server.get(&node).cloned().unwrap_or_default();
        assert_eq!(store_node(r, &node), want, "pods on {node}");
    }
}

fn move_pods(h: &ServerHandle, n: usize) {
    let rt = ResourceType::pods();
    let all = h.list(&rt);
    for (i, o) in all.iter().take(n).enumerate() {
        let mut o = o.clone();
        o["spec"]["nodeName"] = format!("node-{}", (i * 7) % 100).into();
        h.apply(&rt, o);
    }
    for o in all.iter().skip(n).take(n) {
        h.delete(
            &rt,
            o["metadata"]["namespace"].as_str(),
            o["metadata"]["name"].as_str().unwrap(),
        );
    }
    for i in 0..n {
        h.apply(
            &rt,
            make_pod("ns-1", &format!("idx-new-{i}"), 50_000 + i as u64),
        );
    }
}

async fn index_follows_updates_deletes_and_relists(engine: Engine) {
    let fx = Fixture::with_pods(1500, 3).await;
    let h = &fx.h;
    {
        let db = fx.open(engine);
        let (reader, w) = fx.synced_pods(&db, cfg()).await;
        assert_index_matches(&reader, h);
        move_pods(h, 40);
        converge(&reader, h, &ResourceType::pods()).await;
        assert_index_matches(&reader, h);
        w.stop().await;
    }
    // Changes while down, history compacted: the relist sweeps deleted pods and their entries.
    move_pods(h, 25);
    h.compact();
    let db = fx.open(engine);
    let (reader, watcher) = db.store("pods", fx.pods(), cfg()).unwrap();
    let _w = drive(watcher);
    converge(&reader, h, &ResourceType::pods()).await;
    assert_eq!(reader.stats().relists, 1);
    assert_index_matches(&reader, h);
    match reader.by_index("nope", "x").err() {
        Some(Error::IndexUnavailable { index, stream, .. }) => {
            assert_eq!((index.as_str(), stream.as_str()), ("nope", "pods"))
        }
        other => panic!("unknown index: expected IndexUnavailable, got {other:?}"),
    }
}

async fn index_added_later_is_built_from_disk_and_dropped_when_removed(engine: Engine) {
    let fx = Fixture::with_pods(1200, 2).await;
    let h = &fx.h;
    let base =
        || StreamConfig::default().backoff(Duration::from_millis(20), Duration::from_millis(200));
    {
        let db = fx.open(engine);
        let (_r, watcher) = db.store("pods", fx.pods(), base()).unwrap();
        let mut w = drive(watcher);
        w.until(|e| *e == Ev::InitDone).await;
        w.stop().await;
    }
    h.reset_counts();
    {
        let db = fx.open(engine);
        let (reader, watcher) = db
            .store("pods", fx.pods(), base().index("node", node_of))
            .unwrap();
        assert!(
            reader.by_index("node", "node-1").is_err(),
            "not built before the watcher runs"
        );
        let w = drive(watcher);
        let deadline = tokio::time::Instant::now() + WAIT;
        while reader.by_index("node", "node-1").is_err() {
            assert!(tokio::time::Instant::now() < deadline, "index never built");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_index_matches(&reader, h);
        assert_eq!(
            h.counts().list,
            0,
            "building an index reads the disk, not the server"
        );
        w.stop().await;
    }
    // Without the index, it is gone (and lookups say so).
    let db = fx.open(engine);
    let (reader, watcher) = db.store("pods", fx.pods(), base()).unwrap();
    let mut w = drive(watcher);
    // Positive signal instead of a quiet period: the watcher resumed (indexes are prepared
    // before that) and then delivered a pod created now.
    h.apply(&ResourceType::pods(), make_pod("ns-0", "sentinel", 4242));
    let evs = until_apply(&mut w, "ns-0/sentinel").await;
    assert!(matches!(evs[0], Ev::Resumed(_)), "{evs:?}");
    assert_eq!(evs.len(), 2, "only the sentinel's change: {evs:?}");
    assert!(reader.by_index("node", "node-1").is_err());
    assert_eq!(reader.len(), 1200 + 1);
    assert_eq!(h.counts().list, 0, "a warm restart lists nothing");
}

async fn select_by_labels_with_and_without_an_index(engine: Engine) {
    let fx = Fixture::with_pods(800, 2).await;
    let h = &fx.h;
    let db = fx.open(engine);
    let (indexed, w1) = db.store("indexed", fx.pods(), cfg()).unwrap();
    let (plain, w2) = db
        .store("plain", fx.pods(), StreamConfig::default())
        .unwrap();
    let mut d1 = drive(w1);
    let mut d2 = drive(w2);
    d1.until(|e| *e == Ev::InitDone).await;
    d2.until(|e| *e == Ev::InitDone).await;
    let pods = h.list(&ResourceType::pods());
    let app = pods[0]["metadata"]["labels"]["app"]
        .as_str()
        .unwrap()
        .to_string();
    let tier = pods[0]["metadata"]["labels"]["tier"]
        .as_str()
        .unwrap()
        .to_string();
    let selectors: Vec<Selector> = vec![
        Expression::Equal("app".into(), app.clone()).into(),
        Selector::from_iter([
            Expression::Equal("app".into(), app.clone()),
            Expression::NotEqual("tier".into(), tier.clone()),
        ]),
        Expression::Equal("tier".into(), tier.clone()).into(),
    ];
    for sel in selectors {
        let want: BTreeSet<String> = pods
            .iter()
            .filter(|o| {
                let labels: BTreeMap<String, String> =
                    serde_json::from_value(o["metadata"]["labels"].clone()).unwrap();
                kube::core::SelectorExt::matches(&sel, &labels)
            })
            .map(key)
            .collect();
        assert!(!want.is_empty(), "selector {sel} selects something");
        for r in [&indexed, &plain] {
            let got: BTreeSet<String> = r
                .select(&sel)
                .unwrap()
                .map(|p| {
                    let p = p.unwrap();
                    format!(
                        "{}/{}",
                        p.metadata.namespace.clone().unwrap(),
                        p.metadata.name.clone().unwrap()
                    )
                })
                .collect();
            assert_eq!(got, want, "selector {sel}");
        }
    }
}

/// Keys-only: no bodies on disk, full objects in the events, and after a restart with a
/// compacted history only the real differences.
async fn keys_only_stream_reports_exact_differences(engine: Engine) {
    use futures::StreamExt;
    use kube_persist::Event;
    let fx = Fixture::with_pods(1000, 2).await;
    let h = &fx.h;
    let cfg = || {
        StreamConfig::default()
            .keys_only()
            .backoff(Duration::from_millis(20), Duration::from_millis(200))
            .relist_jitter(Duration::from_millis(10))
    };
    let full_dir = fx.path().join("full");
    let keys_dir = fx.path().join("keys");
    {
        let full = try_open_db(engine, &full_dir).unwrap();
        let (_r, w) = full
            .store(
                "pods",
                fx.pods(),
                StreamConfig::default().drop_managed_fields(),
            )
            .unwrap();
        let mut w = drive(w);
        w.until(|e| *e == Ev::InitDone).await;
        w.stop().await;
        full.flush().unwrap();
    }
    {
        let db = try_open_db(engine, &keys_dir).unwrap();
        let (reader, w) = db.store("pods", fx.pods(), cfg()).unwrap();
        let mut w = drive(w);
        let evs = w.until(|e| *e == Ev::InitDone).await;
        assert_eq!(
            evs.iter().filter(|e| matches!(e, Ev::InitApply(_))).count(),
            1000
        );
        assert_eq!(reader.len(), 1000);
        assert!(
            reader.get_named(Some("ns-0"), "pod-0").is_err(),
            "keys-only has no bodies to read"
        );
        w.stop().await;
        db.flush().unwrap();
    }
    let size = |d: &std::path::Path| -> u64 {
        std::fs::read_dir(d)
            .unwrap()
            .flatten()
            .map(|e| e.metadata().map(|m| m.len()).unwrap_or(0))
            .sum()
    };
    assert!(
        size(&keys_dir) * 3 < size(&full_dir),
        "keys-only store ({} bytes) is much smaller than the full one ({} bytes)",
        size(&keys_dir),
        size(&full_dir)
    );

    // Changes while down, history compacted: restart relists and reports exact deltas.
    let rt = ResourceType::pods();
    let all = h.list(&rt);
    let deleted: BTreeSet<String> = all.iter().take(5).map(key).collect();
    for o in all.iter().take(5) {
        h.delete(
            &rt,
            o["metadata"]["namespace"].as_str(),
            o["metadata"]["name"].as_str().unwrap(),
        );
    }
    let mut updated = BTreeSet::new();
    for o in all.iter().skip(5).take(5) {
        let mut o = o.clone();
        o["metadata"]["labels"]["changed"] = "yes".into();
        updated.insert(key(&o));
        h.apply(&rt, o);
    }
    h.apply(&rt, make_pod("ns-0", "keys-new", 99));
    updated.insert("ns-0/keys-new".to_string());
    h.compact();
    let db = try_open_db(engine, &keys_dir).unwrap();
    let (reader, watcher) = db.store("pods", fx.pods(), cfg()).unwrap();
    let mut events = std::pin::pin!(watcher.stream());
    let (mut applied, mut gone) = (BTreeSet::new(), BTreeSet::new());
    // Once the expected differences arrived, a pod is created: its Apply comes through the
    // watch after everything the relist reported (a flood of re-adds would be in there).
    let sentinel = "ns-0/keys-sentinel";
    let mut sentinel_made = false;
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if !sentinel_made && applied.len() >= 6 && gone.len() >= 5 {
            h.apply(&rt, make_pod("ns-0", "keys-sentinel", 98));
            sentinel_made = true;
        }
        let ev = tokio::time::timeout_at(deadline, events.next())
            .await
            .expect("events in time")
            .unwrap();
        match ev.unwrap() {
            Event::Apply(p) => {
                assert!(
                    p.spec.is_some(),
                    "Apply carries the full object from the server"
                );
                let k = format!(
                    "{}/{}",
                    p.metadata.namespace.unwrap(),
                    p.metadata.name.unwrap()
                );
                if k == sentinel {
                    break;
                }
                applied.insert(k);
            }
            Event::Delete(p) => {
                assert!(p.metadata.uid.is_some() && p.metadata.resource_version.is_some());
                gone.insert(format!(
                    "{}/{}",
                    p.metadata.namespace.unwrap(),
                    p.metadata.name.unwrap()
                ));
            }
            Event::Resumed { .. } => {}
            other => panic!("unexpected event after a keys-only restart: {other:?}"),
        }
    }
    assert_eq!(
        applied, updated,
        "only the changed objects, no flood of re-adds"
    );
    assert_eq!(gone, deleted);
    assert_eq!(reader.len(), 1000 - 5 + 1 + 1, "+1: the sentinel");
    assert_eq!(reader.stats().relists, 1);
    assert_eq!(reader.stats().objects_unchanged, 1000 - 5 - 5);
}

engine_tests! {
    async: index_follows_updates_deletes_and_relists,
        index_added_later_is_built_from_disk_and_dropped_when_removed,
        select_by_labels_with_and_without_an_index,
        keys_only_stream_reports_exact_differences,
}
