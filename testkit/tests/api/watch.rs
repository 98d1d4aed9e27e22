//! WATCH semantics over real HTTP with kube's `Api<Pod>::watch`.

use crate::common;

use std::time::{Duration, Instant};

use common::describe;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, WatchEvent, WatchParams};
use kube_persist_testkit::{ResourceType, ServerOptions, TestServer, make_pod};

type Ev = WatchEvent<Pod>;

/// Collects events until `n` non-bookmark events arrived or the stream ended.
async fn collect(api: &Api<Pod>, wp: &WatchParams, rv: &str, n: usize) -> Vec<String> {
    let stream = api.watch(wp, rv).await.unwrap();
    let mut stream = std::pin::pin!(stream);
    let mut out = Vec::new();
    let deadline = tokio::time::sleep(Duration::from_secs(10));
    tokio::pin!(deadline);
    while out.len() < n {
        tokio::select! {
            ev = stream.next() => match ev {
                Some(Ok(WatchEvent::Bookmark(_))) => {}
                Some(Ok(ev)) => out.push(describe(&ev)),
                Some(Err(e)) => out.push(format!("ERR {e}")),
                None => break,
            },
            _ = &mut deadline => panic!("timed out; got {out:?}"),
        }
    }
    out
}

fn pod(ns: &str, name: &str, app: &str) -> serde_json::Value {
    let mut p = make_pod(ns, name, 7);
    p["metadata"]["labels"] = serde_json::json!({"app": app});
    p
}

#[tokio::test]
async fn replays_history_then_live_events() {
    let server = TestServer::start().await;
    let h = server.handle();
    let rt = ResourceType::pods();
    h.create(&rt, pod("a", "p1", "x")).unwrap(); // rv 1
    let rv = h.revision().to_string();
    h.apply(&rt, pod("a", "p2", "x")); // 2
    h.apply(&rt, pod("a", "p1", "y")); // 3
    h.create(
        &ResourceType::configmaps(),
        serde_json::json!({"metadata": {"name": "c", "namespace": "a"}}),
    )
    .unwrap(); // 4: other type
    h.delete(&rt, Some("a"), "p2"); // 5
    let api: Api<Pod> = Api::all(server.client());
    let events = collect(&api, &WatchParams::default(), &rv, 3).await;
    assert_eq!(events, vec!["ADDED p2@2", "MODIFIED p1@3", "DELETED p2@5"]);

    // Live: events written after the watch started.
    let stream = api
        .watch(&WatchParams::default(), &h.revision().to_string())
        .await
        .unwrap();
    let writer = {
        let h = h.clone();
        tokio::spawn(async move {
            for i in 0..300 {
                h.apply(&ResourceType::pods(), pod("b", &format!("q{i}"), "z"));
                if i % 50 == 0 {
                    tokio::task::yield_now().await;
                }
            }
        })
    };
    let got: Vec<Ev> = stream
        .try_filter(|e| futures::future::ready(!matches!(e, WatchEvent::Bookmark(_))))
        .take(300)
        .try_collect()
        .await
        .unwrap();
    writer.await.unwrap();
    let revs: Vec<u64> = got
        .iter()
        .map(|e| match e {
            WatchEvent::Added(p) => p
                .metadata
                .resource_version
                .as_ref()
                .unwrap()
                .parse()
                .unwrap(),
            other => panic!("unexpected {}", describe(other)),
        })
        .collect();
    assert_eq!(
        revs,
        (6..306).collect::<Vec<u64>>(),
        "no event lost or duplicated"
    );
}

#[tokio::test]
async fn initial_events_for_rv_zero_and_streaming_lists() {
    let server = TestServer::start().await;
    let h = server.handle();
    h.seed_pods(3, 1);
    let api: Api<Pod> = Api::all(server.client());
    let events = collect(&api, &WatchParams::default(), "0", 3).await;
    assert_eq!(
        events,
        vec!["ADDED pod-0@1", "ADDED pod-1@2", "ADDED pod-2@3"]
    );

    // Streaming list: ADDED for each object, then the initial-events-end bookmark.
    let stream = api
        .watch(&WatchParams::default().initial_events(), "0")
        .await
        .unwrap();
    let first: Vec<Ev> = stream.take(4).try_collect().await.unwrap();
    assert_eq!(
        first.iter().take(3).map(describe).collect::<Vec<_>>(),
        events
    );
    let WatchEvent::Bookmark(bm) = &first[3] else {
        panic!("expected bookmark, got {}", describe(&first[3]))
    };
    assert_eq!(bm.metadata.resource_version, "3");
    assert_eq!(
        bm.metadata
            .annotations
            .get("k8s.io/initial-events-end")
            .map(String::as_str),
        Some("true")
    );

    // Metadata-only watch.
    let stream = api
        .watch_metadata(&WatchParams::default(), "0")
        .await
        .unwrap();
    let first: Vec<_> = stream.take(1).try_collect().await.unwrap();
    let WatchEvent::Added(meta) = &first[0] else {
        panic!("expected ADDED")
    };
    assert_eq!(meta.metadata.name.as_deref(), Some("pod-0"));
}

#[tokio::test]
async fn watch_from_compacted_revision_gets_410() {
    let server = TestServer::start_with(ServerOptions {
        history: 5,
        ..Default::default()
    })
    .await;
    let h = server.handle();
    h.seed_pods(10, 1);
    let api: Api<Pod> = Api::all(server.client());
    // Evicted by the bounded history.
    assert_eq!(
        collect(&api, &WatchParams::default(), "2", 1).await,
        vec!["ERROR 410 Expired"]
    );
    // Still retained.
    assert_eq!(
        collect(&api, &WatchParams::default(), "8", 2).await,
        vec!["ADDED pod-8@9", "ADDED pod-9@10"]
    );
    h.compact();
    assert_eq!(
        collect(&api, &WatchParams::default(), "8", 1).await,
        vec!["ERROR 410 Expired"]
    );
    // The compaction point itself is still watchable.
    h.apply(&ResourceType::pods(), pod("ns-0", "new", "x"));
    assert_eq!(
        collect(&api, &WatchParams::default(), "10", 1).await,
        vec!["ADDED new@11"]
    );

    let stream = api.watch(&WatchParams::default(), "3").await.unwrap();
    let evs: Vec<Ev> = stream.try_collect().await.unwrap();
    let WatchEvent::Error(status) = &evs[0] else {
        panic!()
    };
    assert!(
        status.message.starts_with("too old resource version: 3"),
        "{}",
        status.message
    );
    assert_eq!(evs.len(), 1, "the stream ends after the ERROR event");
}

#[tokio::test]
async fn selectors_apply_to_watches() {
    let server = TestServer::start().await;
    let h = server.handle();
    let rt = ResourceType::pods();
    h.apply(
        &ResourceType::configmaps(),
        serde_json::json!({"metadata": {"name": "c"}}),
    );
    let rv = h.revision().to_string(); // "1": not "0", which would mean "send initial events"
    h.apply(&rt, pod("a", "p1", "x")); // 1 ADDED
    h.apply(&rt, pod("a", "p2", "other")); // 2 not matching
    h.apply(&rt, pod("a", "p1", "other")); // 3 stops matching -> DELETED
    h.apply(&rt, pod("a", "p2", "x")); // 4 starts matching -> ADDED
    h.apply(&rt, pod("b", "p3", "x")); // 5 ADDED (namespace b)
    h.delete(&rt, Some("a"), "p2"); // 6 DELETED
    let api: Api<Pod> = Api::all(server.client());
    let events = collect(&api, &WatchParams::default().labels("app=x"), &rv, 5).await;
    assert_eq!(
        events,
        vec![
            "ADDED p1@2",
            "DELETED p1@4",
            "ADDED p2@5",
            "ADDED p3@6",
            "DELETED p2@7"
        ]
    );
    let events = collect(
        &api,
        &WatchParams::default().fields("metadata.name=p3"),
        &rv,
        1,
    )
    .await;
    assert_eq!(events, vec!["ADDED p3@6"]);
    let ns_api: Api<Pod> = Api::namespaced(server.client(), "b");
    assert_eq!(
        collect(&ns_api, &WatchParams::default(), &rv, 1).await,
        vec!["ADDED p3@6"]
    );
    let bad = ns_api
        .watch(&WatchParams::default().labels("in in in ("), &rv)
        .await;
    assert!(matches!(bad, Err(kube::Error::Api(s)) if s.code == 400));
}

#[tokio::test]
async fn bookmarks_and_timeout() {
    let opts = ServerOptions {
        bookmark_interval: Duration::from_millis(100),
        ..Default::default()
    };
    let server = TestServer::start_with(opts).await;
    let h = server.handle();
    h.seed_pods(2, 1);
    let api: Api<Pod> = Api::all(server.client());
    let started = Instant::now();
    let stream = api
        .watch(&WatchParams::default().timeout(1), "2")
        .await
        .unwrap();
    let evs: Vec<Ev> = stream.try_collect().await.unwrap();
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_millis(900) && elapsed < Duration::from_secs(5),
        "{elapsed:?}"
    );
    assert!(
        evs.len() >= 5,
        "expected periodic bookmarks, got {}",
        evs.len()
    );
    for ev in &evs {
        let WatchEvent::Bookmark(b) = ev else {
            panic!("unexpected {}", describe(ev))
        };
        assert_eq!(b.metadata.resource_version, "2");
        assert_eq!(b.types.kind, "Pod");
    }
    // Without allowWatchBookmarks there are none.
    let stream = api
        .watch(&WatchParams::default().timeout(1).disable_bookmarks(), "2")
        .await
        .unwrap();
    let evs: Vec<Ev> = stream.try_collect().await.unwrap();
    assert!(evs.is_empty());
}

#[tokio::test]
async fn watch_faults() {
    let server = TestServer::start().await;
    let h = server.handle();
    h.seed_pods(10, 1);
    let api: Api<Pod> = Api::all(server.client());
    let f = h.faults();

    f.drop_watch_after(3);
    let evs: Vec<Ev> = api
        .watch(&WatchParams::default().disable_bookmarks(), "0")
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    assert_eq!(evs.len(), 3, "stream ends cleanly after 3 events");
    assert_eq!(
        collect(&api, &WatchParams::default(), "0", 10).await.len(),
        10,
        "one-shot"
    );

    f.gone_next_watch();
    assert_eq!(
        collect(&api, &WatchParams::default(), "5", 5).await,
        vec!["ERROR 410 Expired"]
    );

    f.malformed_next_watch();
    let events = collect(&api, &WatchParams::default(), "8", 3).await;
    assert!(events[0].starts_with("ERR"), "{events:?}");
    assert_eq!(&events[1..], ["ADDED pod-8@9", "ADDED pod-9@10"]);

    f.fail_next(kube_persist_testkit::Verb::Watch, 500, 1);
    assert!(
        matches!(api.watch(&WatchParams::default(), "0").await, Err(kube::Error::Api(s)) if s.code == 500)
    );
    assert_eq!(h.counts().watch, 5);

    // close_watches ends open streams.
    let stream = api.watch(&WatchParams::default(), "10").await.unwrap();
    let closer = {
        let f = f.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            f.close_watches();
        })
    };
    let evs: Vec<Ev> = tokio::time::timeout(Duration::from_secs(5), stream.try_collect())
        .await
        .unwrap()
        .unwrap();
    assert!(evs.iter().all(|e| matches!(e, WatchEvent::Bookmark(_))));
    closer.await.unwrap();
}
