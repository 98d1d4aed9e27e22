//! Errors after a WATCH is accepted (ERROR events on HTTP 200), too large resourceVersions,
//! generic timeouts and bookmark timing, over real HTTP.

use crate::common;

use std::time::{Duration, Instant};

use common::{all_events, cause_reasons, describe, first_events, raw_client, status_of};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, VersionMatch, WatchEvent, WatchParams};
use kube_persist_testkit::{ResourceType, ServerOptions, TestServer, Verb, make_pod};

fn opts(too_large_wait: Duration) -> ServerOptions {
    ServerOptions {
        too_large_wait,
        ..Default::default()
    }
}

/// The single ERROR event of a watch that was accepted and then failed.
async fn single_error(client: &kube::Client, path: &str) -> kube::core::Status {
    let evs = all_events(client, path).await;
    assert_eq!(
        evs.len(),
        1,
        "{path}: {:?}",
        evs.iter().map(describe).collect::<Vec<_>>()
    );
    match evs.into_iter().next() {
        Some(WatchEvent::Error(s)) => *s,
        Some(other) => panic!("{path}: expected ERROR, got {}", describe(&other)),
        None => unreachable!(),
    }
}

fn assert_too_large(s: &kube::core::Status, requested: &str, current: &str) {
    assert_eq!((s.code, s.reason.as_str()), (504, "Timeout"), "{s:?}");
    assert_eq!(
        s.message,
        format!("Timeout: Too large resource version: {requested}, current: {current}")
    );
    assert_eq!(cause_reasons(s), ["ResourceVersionTooLarge"]);
    let cause = &s.details.as_ref().unwrap().causes[0];
    assert_eq!(cause.message, "Too large resource version");
}

#[tokio::test]
async fn watch_from_a_too_large_resource_version_waits_then_gets_an_error_event() {
    let server = TestServer::start_with(opts(Duration::from_millis(300))).await;
    server.handle().seed_pods(3, 1);
    let client = raw_client(&server);
    for path in [
        "/api/v1/pods?watch=true&resourceVersion=13",
        "/api/v1/pods?watch=true&resourceVersion=13&allowWatchBookmarks=true\
         &sendInitialEvents=true&resourceVersionMatch=NotOlderThan",
    ] {
        let started = Instant::now();
        let s = single_error(&client, path).await;
        assert!(
            started.elapsed() >= Duration::from_millis(300),
            "{path}: waited"
        );
        assert_too_large(&s, "13", "3");
    }
    // kube's Api sees the same: HTTP 200, then one ERROR event.
    let api: Api<Pod> = Api::all(client.clone());
    let evs: Vec<WatchEvent<Pod>> = api
        .watch(&WatchParams::default(), "99")
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    assert!(matches!(&evs[..], [WatchEvent::Error(s)] if s.code == 504));
}

#[tokio::test]
async fn watch_from_a_too_large_resource_version_proceeds_once_reached() {
    let server = TestServer::start_with(opts(Duration::from_secs(20))).await;
    let h = server.handle();
    h.seed_pods(3, 1);
    let writer = {
        let h = h.clone();
        tokio::spawn(async move {
            for i in 0..3 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                h.apply(
                    &ResourceType::pods(),
                    make_pod("ns-0", &format!("new-{i}"), i),
                );
            }
        })
    };
    // From revision 5: the events after it (6), not the ones up to it.
    let evs = first_events(
        &raw_client(&server),
        "/api/v1/pods?watch=true&resourceVersion=5",
        1,
    )
    .await;
    writer.await.unwrap();
    assert_eq!(describe(&evs[0]), "ADDED new-2@6");
}

#[tokio::test]
async fn future_watch_waits_silently_when_configured() {
    let server = TestServer::start_with(ServerOptions {
        future_watch_waits: true,
        too_large_wait: Duration::from_millis(50),
        bookmark_interval: Duration::from_millis(20),
        ..Default::default()
    })
    .await;
    let h = server.handle();
    h.seed_pods(3, 1);
    let api: Api<Pod> = Api::all(raw_client(&server));
    let stream = api.watch(&WatchParams::default(), "5").await.unwrap();
    let mut stream = std::pin::pin!(stream);
    // Well past too_large_wait, the watch is still open and silent (no bookmark either).
    h.apply(&ResourceType::pods(), make_pod("ns-0", "a", 1)); // 4
    tokio::time::sleep(Duration::from_millis(200)).await;
    h.apply(&ResourceType::pods(), make_pod("ns-0", "b", 2)); // 5
    h.apply(&ResourceType::pods(), make_pod("ns-0", "c", 3)); // 6
    let first = tokio::time::timeout(Duration::from_secs(10), stream.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(describe(&first), "ADDED c@6");
}

#[tokio::test]
async fn too_large_next_watch_fault_is_immediate_and_one_shot() {
    let server = TestServer::start_with(opts(Duration::from_secs(60))).await;
    let h = server.handle();
    h.seed_pods(3, 1);
    let client = raw_client(&server);
    h.faults().too_large_next_watch();
    let started = Instant::now();
    let s = single_error(&client, "/api/v1/pods?watch=true&resourceVersion=2").await;
    assert!(started.elapsed() < Duration::from_secs(30));
    assert_too_large(&s, "2", "3");
    let evs = first_events(&client, "/api/v1/pods?watch=true&resourceVersion=2", 1).await;
    assert_eq!(describe(&evs[0]), "ADDED pod-2@3", "one-shot");
    // Over the admin endpoint too.
    let req = axum::http::Request::post("/testkit/faults/too-large-next-watch")
        .body(Vec::new())
        .unwrap();
    client.request_text(req).await.unwrap();
    let s = single_error(&client, "/api/v1/pods?watch=true").await;
    assert_too_large(&s, "4", "3");
}

#[tokio::test]
async fn list_with_a_too_large_resource_version_is_504_after_waiting() {
    let server = TestServer::start_with(opts(Duration::from_millis(300))).await;
    let h = server.handle();
    h.seed_pods(3, 1);
    let client = raw_client(&server);
    for path in [
        "/api/v1/pods?resourceVersion=10",
        "/api/v1/pods?resourceVersion=10&resourceVersionMatch=NotOlderThan",
        "/api/v1/pods?resourceVersion=10&resourceVersionMatch=Exact&limit=2",
    ] {
        let started = Instant::now();
        let s = status_of(&client, path).await;
        assert!(started.elapsed() >= Duration::from_millis(300), "{path}");
        assert_too_large(&s, "10", "3");
    }
    // Reached while waiting: the list is served.
    let server = TestServer::start_with(opts(Duration::from_secs(20))).await;
    let h = server.handle();
    h.seed_pods(3, 1);
    let writer = {
        let h = h.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            h.seed_pods(4, 1);
        })
    };
    let api: Api<Pod> = Api::all(raw_client(&server));
    let lp = ListParams::default()
        .at("5")
        .matching(VersionMatch::NotOlderThan);
    let list = api.list(&lp).await.unwrap();
    writer.await.unwrap();
    assert_eq!(list.items.len(), 4);
    assert_eq!(list.metadata.resource_version.as_deref(), Some("7"));
}

#[tokio::test]
async fn generic_timeouts_have_no_too_large_cause() {
    let server = TestServer::start().await;
    let h = server.handle();
    h.seed_pods(2, 1);
    let client = raw_client(&server);
    let api: Api<Pod> = Api::all(client.clone());
    h.faults().timeout_next(Verb::List, 2);
    for _ in 0..2 {
        let s = status_of(&client, "/api/v1/pods").await;
        assert_eq!((s.code, s.reason.as_str()), (504, "Timeout"));
        assert_eq!(
            s.message,
            "Timeout: request did not complete within requested timeout - context deadline exceeded"
        );
        assert!(cause_reasons(&s).is_empty(), "{s:?}");
    }
    assert_eq!(
        api.list(&ListParams::default()).await.unwrap().items.len(),
        2
    );
    // fail_next(.., 504, ..) keeps its ResourceVersionTooLarge cause.
    h.faults().fail_next(Verb::List, 504, 1);
    let s = status_of(&client, "/api/v1/pods").await;
    assert_eq!(cause_reasons(&s), ["ResourceVersionTooLarge"]);
    // Watches and the admin endpoint.
    let req = axum::http::Request::post("/testkit/faults/timeout-next?verb=watch&count=1")
        .body(Vec::new())
        .unwrap();
    client.request_text(req).await.unwrap();
    let s = status_of(&client, "/api/v1/pods?watch=true").await;
    assert_eq!((s.code, cause_reasons(&s).len()), (504, 0));
    // kube's default client retries a 504 transparently.
    h.faults().timeout_next(Verb::List, 1);
    let retrying: Api<Pod> = Api::all(server.client());
    assert!(retrying.list(&ListParams::default()).await.is_ok());
}

#[tokio::test]
async fn bookmarks_at_a_realistic_interval_and_before_the_deadline() {
    let server = TestServer::start_with(ServerOptions {
        bookmark_interval: Duration::from_secs(60),
        ..Default::default()
    })
    .await;
    server.handle().seed_pods(2, 1);
    let api: Api<Pod> = Api::all(server.client());
    // timeoutSeconds=3: no periodic bookmark (60 s), one about 2 s before the deadline.
    let started = Instant::now();
    let stream = api
        .watch(&WatchParams::default().timeout(3), "2")
        .await
        .unwrap();
    let mut stream = std::pin::pin!(stream);
    let mut got = Vec::new();
    while let Some(ev) = stream.try_next().await.unwrap() {
        got.push((describe(&ev), started.elapsed()));
    }
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].0, "BOOKMARK 2");
    assert!(
        got[0].1 >= Duration::from_millis(800) && got[0].1 < Duration::from_millis(2900),
        "{got:?}"
    );
    // timeoutSeconds=1: the pre-deadline point has passed, so no bookmark at all.
    let stream = api
        .watch(&WatchParams::default().timeout(1), "2")
        .await
        .unwrap();
    let evs: Vec<WatchEvent<Pod>> = stream.try_collect().await.unwrap();
    assert!(
        evs.is_empty(),
        "{:?}",
        evs.iter().map(describe).collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bookmarks_never_run_ahead_of_delivered_events() {
    let server = TestServer::start_with(ServerOptions {
        bookmark_interval: Duration::from_millis(10),
        ..Default::default()
    })
    .await;
    let h = server.handle();
    h.seed_pods(20, 2);
    let start = h.revision();
    // A namespaced watch: most changes (ns-1) are filtered out, yet bookmarks advance.
    let api: Api<Pod> = Api::namespaced(server.client(), "ns-0");
    let stream = api
        .watch(&WatchParams::default(), &start.to_string())
        .await
        .unwrap();
    let writer = {
        let h = h.clone();
        tokio::spawn(async move {
            for round in 0..40u64 {
                h.churn(10, 2, 1, round);
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
        })
    };
    let mut stream = std::pin::pin!(stream);
    let mut delivered: Vec<u64> = Vec::new();
    let mut last_bookmark = start;
    let mut bookmarks = 0;
    let rv = |s: &str| -> u64 { s.parse().unwrap() };
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(20), stream.try_next())
            .await
            .expect("a bookmark at the final revision")
            .unwrap()
            .expect("stream open");
        match &ev {
            WatchEvent::Added(p) | WatchEvent::Modified(p) | WatchEvent::Deleted(p) => {
                let r = rv(p.metadata.resource_version.as_deref().unwrap());
                assert!(
                    r > last_bookmark,
                    "event {r} arrived after a bookmark at {last_bookmark}"
                );
                assert!(delivered.last().is_none_or(|l| *l < r), "ordered");
                assert_eq!(p.metadata.namespace.as_deref(), Some("ns-0"));
                delivered.push(r);
            }
            WatchEvent::Bookmark(b) => {
                let b = rv(&b.metadata.resource_version);
                assert!(b >= last_bookmark, "bookmarks move forward");
                assert!(delivered.last().is_none_or(|l| *l <= b));
                last_bookmark = b;
                bookmarks += 1;
                if writer.is_finished() && b == h.revision() {
                    break;
                }
            }
            WatchEvent::Error(e) => panic!("{e:?}"),
        }
    }
    writer.await.unwrap();
    assert!(bookmarks > 1);
    // Everything up to the last bookmark was delivered: each ns-0 pod changed after `start`
    // has its current version among the delivered events.
    for pod in h.list(&ResourceType::pods()) {
        let m = &pod["metadata"];
        let r = rv(m["resourceVersion"].as_str().unwrap());
        if m["namespace"] == "ns-0" && r > start {
            assert!(delivered.contains(&r), "missing event {r}");
        }
    }
}
