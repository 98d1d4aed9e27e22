//! LIST/WATCH option validation (apimachinery's `ValidateListOptions`), watch-list semantics
//! and the [`StreamingLists`] modes, over real HTTP.

use crate::common;

use std::time::Duration;

use common::{all_events, describe, first_events, raw_client, status_of};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, WatchEvent, WatchParams};
use kube_persist_testkit::{ServerOptions, StreamingLists, TestServer, make_pod};

/// Asserts a 422 `Invalid` answer whose message and causes name `field` and `text`.
async fn assert_invalid(client: &kube::Client, path: &str, field: &str, text: &str) {
    let s = status_of(client, path).await;
    assert_eq!(
        (s.code, s.reason.as_str()),
        (422, "Invalid"),
        "{path}: {s:?}"
    );
    assert!(
        s.message
            .starts_with("ListOptions.meta.k8s.io \"\" is invalid: "),
        "{path}: {}",
        s.message
    );
    assert!(
        s.message.contains(&format!("{field}: ")) && s.message.contains(text),
        "{path}: {}",
        s.message
    );
    let details = s.details.expect("details");
    assert_eq!(
        (details.group.as_str(), details.kind.as_str()),
        ("meta.k8s.io", "ListOptions")
    );
    assert!(
        details
            .causes
            .iter()
            .any(|c| c.field == field && c.message.contains(text)),
        "{path}: {:?}",
        details.causes
    );
}

#[tokio::test]
async fn list_options_are_validated_like_kube_apiserver() {
    let server = TestServer::start().await;
    server.handle().seed_pods(3, 1);
    let client = raw_client(&server);
    assert_invalid(
        &client,
        "/api/v1/pods?resourceVersionMatch=NotOlderThan",
        "resourceVersionMatch",
        "resourceVersionMatch is forbidden unless resourceVersion is provided",
    )
    .await;
    assert_invalid(
        &client,
        "/api/v1/pods?resourceVersion=1&resourceVersionMatch=Exact&continue=abc&limit=1",
        "resourceVersionMatch",
        "resourceVersionMatch is forbidden when continue is provided",
    )
    .await;
    assert_invalid(
        &client,
        "/api/v1/pods?resourceVersion=1&resourceVersionMatch=Latest",
        "resourceVersionMatch",
        "Unsupported value: \"Latest\": supported values: \"Exact\", \"NotOlderThan\", \"\"",
    )
    .await;
    assert_invalid(
        &client,
        "/api/v1/pods?resourceVersion=0&resourceVersionMatch=Exact",
        "resourceVersionMatch",
        "resourceVersionMatch \"exact\" is forbidden for resourceVersion \"0\"",
    )
    .await;
    for v in ["true", "false"] {
        assert_invalid(
            &client,
            &format!("/api/v1/pods?sendInitialEvents={v}"),
            "sendInitialEvents",
            "sendInitialEvents is forbidden for list",
        )
        .await;
    }
    // Several errors are aggregated like field.ErrorList.ToAggregate().
    let s = status_of(
        &client,
        "/api/v1/pods?resourceVersionMatch=Foo&sendInitialEvents=true",
    )
    .await;
    assert_eq!(s.code, 422);
    assert!(
        s.message.contains(": [resourceVersionMatch: "),
        "{}",
        s.message
    );
    assert_eq!(s.details.unwrap().causes.len(), 3);

    // The valid forms still work, through kube's Api.
    let api: Api<Pod> = Api::all(client.clone());
    let rv = server.handle().resource_version();
    for lp in [
        ListParams::default()
            .at(&rv)
            .matching(kube::api::VersionMatch::Exact),
        ListParams::default()
            .at("0")
            .matching(kube::api::VersionMatch::NotOlderThan),
        ListParams::default().at(&rv),
    ] {
        assert_eq!(api.list(&lp).await.unwrap().items.len(), 3);
    }
    // Garbage stays a 400.
    assert_eq!(
        status_of(&client, "/api/v1/pods?resourceVersion=x1")
            .await
            .code,
        400
    );
    assert_eq!(
        status_of(&client, "/api/v1/pods?resourceVersion=5&continue=abc")
            .await
            .code,
        400
    );
}

#[tokio::test]
async fn watch_options_are_validated_like_kube_apiserver() {
    let server = TestServer::start().await;
    server.handle().seed_pods(3, 1);
    let client = raw_client(&server);
    assert_invalid(
        &client,
        "/api/v1/pods?watch=true&sendInitialEvents=true&allowWatchBookmarks=true",
        "resourceVersionMatch",
        "sendInitialEvents requires setting resourceVersionMatch to NotOlderThan",
    )
    .await;
    assert_invalid(
        &client,
        "/api/v1/pods?watch=true&sendInitialEvents=false&resourceVersionMatch=Exact&resourceVersion=1",
        "resourceVersionMatch",
        "Unsupported value: \"Exact\": supported values: \"NotOlderThan\"",
    )
    .await;
    assert_invalid(
        &client,
        "/api/v1/pods?watch=true&resourceVersionMatch=NotOlderThan&resourceVersion=1",
        "resourceVersionMatch",
        "resourceVersionMatch is forbidden for watch unless sendInitialEvents is provided",
    )
    .await;
    assert_invalid(
        &client,
        "/api/v1/pods?watch=true&sendInitialEvents=false&resourceVersionMatch=NotOlderThan&continue=abc",
        "resourceVersionMatch",
        "resourceVersionMatch is forbidden when continue is provided",
    )
    .await;
    let s = status_of(
        &client,
        "/api/v1/pods?watch=true&sendInitialEvents=true&resourceVersionMatch=Exact",
    )
    .await;
    assert_eq!(s.details.unwrap().causes.len(), 2, "{}", s.message);

    // sendInitialEvents=false + NotOlderThan is a plain watch from "any": no initial events.
    let h = server.handle();
    let path = "/api/v1/pods?watch=true&sendInitialEvents=false&resourceVersionMatch=NotOlderThan&resourceVersion=0";
    let stream = client
        .request_events::<Pod>(common::get(path))
        .await
        .unwrap();
    h.apply(
        &kube_persist_testkit::ResourceType::pods(),
        make_pod("ns-0", "late", 1),
    );
    let evs: Vec<kube::Result<WatchEvent<Pod>>> = tokio::time::timeout(
        Duration::from_secs(20),
        futures::StreamExt::collect(futures::StreamExt::take(stream, 1)),
    )
    .await
    .unwrap();
    let evs: Vec<WatchEvent<Pod>> = evs.into_iter().map(Result::unwrap).collect();
    assert_eq!(describe(&evs[0]), "ADDED late@4");
}

#[tokio::test]
async fn initial_events_end_bookmark_needs_allow_watch_bookmarks() {
    let server = TestServer::start_with(ServerOptions {
        bookmark_interval: Duration::from_secs(60),
        ..Default::default()
    })
    .await;
    server.handle().seed_pods(3, 1);
    let client = raw_client(&server);
    let base = "/api/v1/pods?watch=true&timeoutSeconds=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan";
    let without: Vec<String> = all_events(&client, base)
        .await
        .iter()
        .map(describe)
        .collect();
    assert_eq!(without, ["ADDED pod-0@1", "ADDED pod-1@2", "ADDED pod-2@3"]);
    let with: Vec<String> = all_events(&client, &format!("{base}&allowWatchBookmarks=true"))
        .await
        .iter()
        .map(describe)
        .collect();
    assert_eq!(
        with,
        [
            "ADDED pod-0@1",
            "ADDED pod-1@2",
            "ADDED pod-2@3",
            "BOOKMARK END 3"
        ]
    );
}

#[tokio::test]
async fn streaming_list_from_a_resource_version_is_not_older_than() {
    let server = TestServer::start_with(ServerOptions {
        too_large_wait: Duration::from_secs(10),
        ..Default::default()
    })
    .await;
    let h = server.handle();
    h.seed_pods(3, 1);
    let api: Api<Pod> = Api::all(server.client());
    let wp = WatchParams::default().initial_events();
    // An older revision: the current state (not the state at revision 1).
    let stream = api.watch(&wp, "1").await.unwrap();
    let evs: Vec<String> = tokio::time::timeout(
        Duration::from_secs(10),
        futures::TryStreamExt::try_collect::<Vec<_>>(futures::StreamExt::take(stream, 4)),
    )
    .await
    .unwrap()
    .unwrap()
    .iter()
    .map(describe)
    .collect();
    assert_eq!(
        evs,
        [
            "ADDED pod-0@1",
            "ADDED pod-1@2",
            "ADDED pod-2@3",
            "BOOKMARK END 3"
        ]
    );
    // A newer revision: the server waits until it is reached, then sends that state.
    let writer = {
        let h = h.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            h.seed_pods(5, 1);
        })
    };
    let stream = api.watch(&wp, "5").await.unwrap();
    let evs: Vec<WatchEvent<Pod>> = tokio::time::timeout(
        Duration::from_secs(10),
        futures::TryStreamExt::try_collect::<Vec<_>>(futures::StreamExt::take(stream, 6)),
    )
    .await
    .unwrap()
    .unwrap();
    writer.await.unwrap();
    let evs: Vec<String> = evs.iter().map(describe).collect();
    assert_eq!(evs.len(), 6, "{evs:?}");
    assert!(evs[..5].iter().all(|e| e.starts_with("ADDED ")), "{evs:?}");
    assert!(evs[5].starts_with("BOOKMARK END "), "{evs:?}");
    let end: u64 = evs[5]["BOOKMARK END ".len()..].parse().unwrap();
    assert!(end >= 5, "{evs:?}");
}

#[tokio::test]
async fn streaming_lists_supported_by_default() {
    let server = TestServer::start().await;
    server.handle().seed_pods(2, 1);
    let api: Api<Pod> = Api::all(server.client());
    let stream = api
        .watch(&WatchParams::default().initial_events(), "")
        .await
        .unwrap();
    let evs: Vec<String> =
        futures::TryStreamExt::try_collect::<Vec<_>>(futures::StreamExt::take(stream, 3))
            .await
            .unwrap()
            .iter()
            .map(describe)
            .collect();
    assert_eq!(evs, ["ADDED pod-0@1", "ADDED pod-1@2", "BOOKMARK END 2"]);
}

#[tokio::test]
async fn streaming_lists_rejected_by_the_storage() {
    let server = TestServer::start_with(ServerOptions {
        streaming_lists: StreamingLists::Rejected,
        ..Default::default()
    })
    .await;
    server.handle().seed_pods(2, 1);
    let api: Api<Pod> = Api::all(raw_client(&server));
    let stream = api
        .watch(&WatchParams::default().initial_events(), "0")
        .await
        .expect("accepted with HTTP 200");
    let evs: Vec<WatchEvent<Pod>> = futures::TryStreamExt::try_collect(stream).await.unwrap();
    assert_eq!(evs.len(), 1, "one ERROR event, then the end");
    let WatchEvent::Error(s) = &evs[0] else {
        panic!("{}", describe(&evs[0]))
    };
    assert_eq!((s.code, s.reason.as_str()), (500, "InternalError"));
    assert_eq!(
        s.message,
        "a watch stream was requested by the client but the required storage feature \
         RequestWatchProgress is disabled"
    );
    // Plain watches and lists are unaffected.
    let evs = first_events(
        &raw_client(&server),
        "/api/v1/pods?watch=true&resourceVersion=0",
        2,
    )
    .await;
    assert_eq!(describe(&evs[1]), "ADDED pod-1@2");
}

#[tokio::test]
async fn streaming_lists_forbidden_without_the_feature_gate() {
    let server = TestServer::start_with(ServerOptions {
        streaming_lists: StreamingLists::Forbidden,
        ..Default::default()
    })
    .await;
    server.handle().seed_pods(2, 1);
    let client = raw_client(&server);
    let api: Api<Pod> = Api::all(client.clone());
    let err = api
        .watch(&WatchParams::default().initial_events(), "0")
        .await
        .err()
        .expect("422");
    let kube::Error::Api(s) = err else {
        panic!("{err:?}")
    };
    assert_eq!((s.code, s.reason.as_str()), (422, "Invalid"));
    assert_eq!(
        s.message,
        "ListOptions.meta.k8s.io \"\" is invalid: sendInitialEvents: Forbidden: \
         sendInitialEvents is forbidden for watch unless the WatchList feature gate is enabled"
    );
    assert_invalid(
        &client,
        "/api/v1/pods?watch=true&sendInitialEvents=false&resourceVersionMatch=NotOlderThan",
        "sendInitialEvents",
        "sendInitialEvents is forbidden for watch unless the WatchList feature gate is enabled",
    )
    .await;
    let evs = first_events(&client, "/api/v1/pods?watch=true", 2).await;
    assert_eq!(describe(&evs[0]), "ADDED pod-0@1");
}

#[tokio::test]
async fn streaming_lists_ignored_by_an_older_server() {
    let server = TestServer::start_with(ServerOptions {
        streaming_lists: StreamingLists::Ignored,
        bookmark_interval: Duration::from_secs(60),
        ..Default::default()
    })
    .await;
    server.handle().seed_pods(3, 1);
    let client = raw_client(&server);
    for rv in ["", "0"] {
        let path = format!(
            "/api/v1/pods?watch=true&timeoutSeconds=1&allowWatchBookmarks=true\
             &sendInitialEvents=true&resourceVersionMatch=NotOlderThan&resourceVersion={rv}"
        );
        let evs: Vec<String> = all_events(&client, &path)
            .await
            .iter()
            .map(describe)
            .collect();
        assert_eq!(
            evs,
            ["ADDED pod-0@1", "ADDED pod-1@2", "ADDED pod-2@3"],
            "no initial-events-end bookmark (rv {rv:?})"
        );
    }
    // resourceVersionMatch alone and bogus values are ignored too.
    let evs = first_events(
        &client,
        "/api/v1/pods?watch=true&resourceVersionMatch=Bogus&resourceVersion=2",
        1,
    )
    .await;
    assert_eq!(describe(&evs[0]), "ADDED pod-2@3");
    // A LIST with sendInitialEvents is not refused either.
    let req = common::get("/api/v1/pods?sendInitialEvents=true");
    assert!(client.request_text(req).await.is_ok());
}
