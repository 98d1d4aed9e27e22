//! Opaque resourceVersions, short pages, gzip and the `testkit-server` flags, over real HTTP.

use crate::common;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read};
use std::time::Duration;

use common::{describe, first_events, get, raw_client, raw_get, status_of};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, PostParams, VersionMatch, WatchEvent, WatchParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube_persist_testkit::{ResourceType, ServerHandle, ServerOptions, TestServer, make_pod};

fn opaque() -> ServerOptions {
    ServerOptions {
        opaque_resource_versions: true,
        bookmark_interval: Duration::from_millis(50),
        ..Default::default()
    }
}

fn assert_opaque(rv: &str) {
    assert!(rv.parse::<u64>().is_err(), "{rv} looks numeric");
    assert!(!rv.is_empty());
}

#[tokio::test]
async fn opaque_resource_versions_round_trip() {
    let server = TestServer::start_with(opaque()).await;
    let h = server.handle();
    h.seed_pods(5, 1);
    let client = raw_client(&server);
    let api: Api<Pod> = Api::all(client.clone());

    let list = api.list(&ListParams::default().limit(2)).await.unwrap();
    let list_rv = list.metadata.resource_version.clone().unwrap();
    assert_opaque(&list_rv);
    assert_eq!(list_rv, h.resource_version());
    assert_eq!(h.parse_resource_version(&list_rv), Some(5));
    assert_eq!(h.render_resource_version(5), list_rv);
    for p in &list.items {
        let rv = p.metadata.resource_version.as_deref().unwrap();
        assert_opaque(rv);
        assert!(h.parse_resource_version(rv).is_some());
    }
    // The rendered form does not sort like the revision.
    let (r1, r26) = (h.render_resource_version(1), h.render_resource_version(26));
    assert!(r26 < r1);
    let versions = h.resource_versions(&ResourceType::pods());
    assert_eq!(
        versions[&("ns-0".to_string(), "pod-4".to_string())],
        list_rv
    );

    // list -> watch from the list's resourceVersion.
    let stream = api.watch(&WatchParams::default(), &list_rv).await.unwrap();
    h.apply(&ResourceType::pods(), make_pod("ns-0", "late", 9));
    let mut stream = std::pin::pin!(stream);
    let ev = loop {
        match stream.try_next().await.unwrap().unwrap() {
            WatchEvent::Bookmark(b) => assert_opaque(&b.metadata.resource_version),
            other => break other,
        }
    };
    let WatchEvent::Added(p) = &ev else {
        panic!("{}", describe(&ev))
    };
    assert_eq!(
        p.metadata.resource_version.as_deref(),
        Some(&*h.resource_version())
    );
    // Bookmarks carry the rendered revision the watch is at.
    let bm = loop {
        if let WatchEvent::Bookmark(b) = stream.try_next().await.unwrap().unwrap() {
            break b;
        }
    };
    assert_eq!(bm.metadata.resource_version, h.resource_version());

    // Exact and NotOlderThan lists at an opaque resourceVersion; "0" keeps its meaning.
    let old = api
        .list(
            &ListParams::default()
                .at(&list_rv)
                .matching(VersionMatch::Exact),
        )
        .await
        .unwrap();
    assert_eq!(old.items.len(), 5);
    assert_eq!(old.metadata.resource_version.as_deref(), Some(&*list_rv));
    let now = api
        .list(
            &ListParams::default()
                .at("0")
                .matching(VersionMatch::NotOlderThan),
        )
        .await
        .unwrap();
    assert_eq!(now.items.len(), 6);

    // A plain number is not a resourceVersion of this server.
    for path in [
        "/api/v1/pods?resourceVersion=5",
        "/api/v1/pods?resourceVersion=5&resourceVersionMatch=NotOlderThan",
        "/api/v1/pods?watch=true&resourceVersion=5",
    ] {
        let s = status_of(&client, path).await;
        assert_eq!((s.code, s.reason.as_str()), (400, "BadRequest"), "{path}");
        assert!(
            s.message.contains("invalid resource version"),
            "{}",
            s.message
        );
    }
    // Streaming lists with rv "0" and with an opaque rv.
    for rv in ["0", list_rv.as_str()] {
        let evs = first_events(
            &client,
            &format!(
                "/api/v1/pods?watch=true&allowWatchBookmarks=true&sendInitialEvents=true\
                 &resourceVersionMatch=NotOlderThan&resourceVersion={rv}"
            ),
            7,
        )
        .await;
        let WatchEvent::Bookmark(end) = &evs[6] else {
            panic!("{}", describe(&evs[6]))
        };
        assert_eq!(end.metadata.resource_version, h.resource_version());
    }

    // Updates: the opaque form round-trips, a stale one conflicts, a number is rejected.
    let ns_api: Api<Pod> = Api::namespaced(client.clone(), "ns-0");
    let mut pod = ns_api.get("pod-1").await.unwrap();
    pod.metadata
        .labels
        .get_or_insert_default()
        .insert("x".into(), "y".into());
    let replaced = ns_api
        .replace("pod-1", &PostParams::default(), &pod)
        .await
        .unwrap();
    assert_opaque(replaced.metadata.resource_version.as_deref().unwrap());
    let err = ns_api
        .replace("pod-1", &PostParams::default(), &pod)
        .await
        .unwrap_err();
    assert!(matches!(err, kube::Error::Api(s) if s.code == 409));
    let mut numeric = replaced.clone();
    numeric.metadata.resource_version = Some(h.revision().to_string());
    let err = ns_api
        .replace("pod-1", &PostParams::default(), &numeric)
        .await
        .unwrap_err();
    assert!(
        matches!(err, kube::Error::Api(s) if s.code == 400 && s.message.contains("invalid resource version"))
    );
    let deleted = ns_api.delete("pod-1", &Default::default()).await.unwrap();
    let obj = deleted.left().unwrap();
    assert_eq!(obj.metadata.resource_version.unwrap(), h.resource_version());

    // Status messages render resourceVersions the same way.
    h.compact();
    let evs = first_events(
        &client,
        &format!(
            "/api/v1/pods?watch=true&resourceVersion={}",
            h.render_resource_version(2)
        ),
        1,
    )
    .await;
    let WatchEvent::Error(s) = &evs[0] else {
        panic!("{}", describe(&evs[0]))
    };
    assert_eq!(s.code, 410);
    assert_eq!(
        s.message,
        format!(
            "too old resource version: {} ({})",
            h.render_resource_version(2),
            h.resource_version()
        )
    );
    // The admin endpoint reports both forms.
    let text = client.request_text(get("/testkit/revision")).await.unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["revision"], h.revision());
    assert_eq!(v["resourceVersion"], h.resource_version());
}

fn store_versions(store: &Store<Pod>) -> std::collections::BTreeMap<(String, String), String> {
    store
        .state()
        .iter()
        .map(|p| {
            let m = &p.metadata;
            (
                (m.namespace.clone().unwrap(), m.name.clone().unwrap()),
                m.resource_version.clone().unwrap(),
            )
        })
        .collect()
}

async fn wait_synced(h: &ServerHandle, store: &Store<Pod>) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while store_versions(store) != h.resource_versions(&ResourceType::pods()) {
        assert!(
            std::time::Instant::now() < deadline,
            "store never matched the server"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// kube-runtime's watcher syncs against a server with opaque resourceVersions and short
/// pages, paginated and streaming.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflector_syncs_with_opaque_versions_and_short_pages() {
    for config in [
        watcher::Config::default().page_size(7),
        watcher::Config::default().streaming_lists(),
    ] {
        let server = TestServer::start_with(ServerOptions {
            short_pages: true,
            ..opaque()
        })
        .await;
        let h = server.handle();
        h.seed_pods(100, 3);
        let api: Api<Pod> = Api::all(server.client());
        let (store, writer) = reflector::store::<Pod>();
        let stream = reflector::reflector(writer, watcher(api, config)).default_backoff();
        let task = tokio::spawn(stream.for_each(|_| futures::future::ready(())));
        wait_synced(&h, &store).await;
        h.churn(20, 5, 5, 1);
        wait_synced(&h, &store).await;
        task.abort();
    }
}

#[tokio::test]
async fn short_pages_walk_every_object_exactly_once() {
    let server = TestServer::start_with(ServerOptions {
        short_pages: true,
        ..Default::default()
    })
    .await;
    let h = server.handle();
    h.seed_pods(100, 3);
    let api: Api<Pod> = Api::all(server.client());
    for (selector, expected) in [("", 100usize), ("shard", 100), ("tier=backend", usize::MAX)] {
        let mut lp = ListParams::default().limit(10);
        if !selector.is_empty() {
            lp = lp.labels(selector);
        }
        let mut sizes = Vec::new();
        let mut seen = Vec::new();
        loop {
            let page = api.list(&lp).await.unwrap();
            sizes.push(page.items.len());
            seen.extend(page.items.iter().map(|p| {
                (
                    p.metadata.namespace.clone().unwrap(),
                    p.metadata.name.clone().unwrap(),
                )
            }));
            if let Some(remaining) = page.metadata.remaining_item_count {
                assert_eq!(
                    remaining as usize,
                    100 - seen.len(),
                    "exact remainingItemCount"
                );
            }
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(c) => lp = lp.continue_token(&c),
                None => break,
            }
        }
        let unique: BTreeSet<_> = seen.iter().cloned().collect();
        assert_eq!(unique.len(), seen.len(), "{selector}: no duplicates");
        let mut sorted = seen.clone();
        sorted.sort();
        assert_eq!(sorted, seen, "{selector}: in order");
        let want = if expected == usize::MAX {
            h.list(&ResourceType::pods())
                .iter()
                .filter(|p| p["metadata"]["labels"]["tier"] == "backend")
                .count()
        } else {
            expected
        };
        assert_eq!(seen.len(), want, "{selector}: every object");
        assert!(sizes.iter().all(|s| *s <= 5), "{selector}: {sizes:?}");
        assert!(sizes.len() > 2 && sizes[1] == 0, "{selector}: {sizes:?}");
        if selector.is_empty() {
            // 20 pages of 5 with an empty one every third page: 0,5 | 1,0 | 2,5 | ...
            assert_eq!(
                sizes.iter().filter(|s| **s == 0).count(),
                sizes.len() / 3,
                "{sizes:?}"
            );
            assert_eq!(*sizes.last().unwrap(), 5, "{sizes:?}");
        }
    }
    // Without a limit, lists are whole.
    assert_eq!(
        api.list(&ListParams::default()).await.unwrap().items.len(),
        100
    );
}

fn gunzip(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(bytes)
        .read_to_end(&mut out)
        .unwrap();
    out
}

const GZIP: &[(&str, &str)] = &[("Accept-Encoding", "gzip")];

#[tokio::test]
async fn gzip_compresses_non_watch_responses_when_asked() {
    let server = TestServer::start_with(ServerOptions {
        gzip: true,
        ..Default::default()
    })
    .await;
    server.handle().seed_pods(50, 2);
    let plain = raw_get(server.addr(), "/api/v1/pods", &[]).await;
    assert_eq!(plain.status, 200);
    assert_eq!(plain.header("content-encoding"), None);
    let zipped = raw_get(server.addr(), "/api/v1/pods", GZIP).await;
    assert_eq!(zipped.status, 200);
    assert_eq!(zipped.header("content-encoding"), Some("gzip"));
    assert_eq!(zipped.header("vary"), Some("Accept-Encoding"));
    assert!(
        zipped.body.len() < plain.body.len() / 3,
        "{} vs {}",
        zipped.body.len(),
        plain.body.len()
    );
    assert_eq!(gunzip(&zipped.body), plain.body);
    let list: kube::core::ObjectList<Pod> = serde_json::from_slice(&gunzip(&zipped.body)).unwrap();
    assert_eq!(list.items.len(), 50);
    // Other encodings in the list are fine; without gzip nothing is compressed.
    let other = raw_get(
        server.addr(),
        "/api/v1/pods",
        &[("Accept-Encoding", "br, gzip;q=0.9")],
    )
    .await;
    assert_eq!(other.header("content-encoding"), Some("gzip"));
    let none = raw_get(
        server.addr(),
        "/api/v1/pods",
        &[("Accept-Encoding", "identity")],
    )
    .await;
    assert_eq!(none.header("content-encoding"), None);
    // GET and Status error bodies too.
    let got = raw_get(server.addr(), "/api/v1/namespaces/ns-0/pods/pod-0", GZIP).await;
    assert_eq!(
        (got.status, got.header("content-encoding")),
        (200, Some("gzip"))
    );
    let pod: Pod = serde_json::from_slice(&gunzip(&got.body)).unwrap();
    assert_eq!(pod.metadata.name.as_deref(), Some("pod-0"));
    let missing = raw_get(server.addr(), "/api/v1/namespaces/ns-0/pods/nope", GZIP).await;
    assert_eq!(
        (missing.status, missing.header("content-encoding")),
        (404, Some("gzip"))
    );
    let status: kube::core::Status = serde_json::from_slice(&gunzip(&missing.body)).unwrap();
    assert_eq!(status.reason, "NotFound");
    let invalid = raw_get(
        server.addr(),
        "/api/v1/pods?resourceVersionMatch=Exact",
        GZIP,
    )
    .await;
    assert_eq!(
        (invalid.status, invalid.header("content-encoding")),
        (422, Some("gzip"))
    );
    assert!(serde_json::from_slice::<kube::core::Status>(&gunzip(&invalid.body)).is_ok());
    // WATCH streams are never compressed (like kube-apiserver).
    let watch = raw_get(
        server.addr(),
        "/api/v1/pods?watch=true&resourceVersion=0&timeoutSeconds=1",
        GZIP,
    )
    .await;
    assert_eq!(watch.status, 200);
    assert_eq!(watch.header("content-encoding"), None);
    let lines = watch
        .body
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .count();
    assert_eq!(lines, 50);
    // kube's client reads it, whether or not it has the `gzip` feature (which asks for and
    // decompresses gzip transparently).
    let api: Api<Pod> = Api::all(server.client());
    assert_eq!(
        api.list(&ListParams::default()).await.unwrap().items.len(),
        50
    );
    let ns_api: Api<Pod> = Api::namespaced(server.client(), "ns-0");
    let err = ns_api.get("nope").await.unwrap_err();
    assert!(matches!(err, kube::Error::Api(s) if s.reason == "NotFound"));
}

#[tokio::test]
async fn gzip_threshold_and_default_off() {
    let server = TestServer::start_with(ServerOptions {
        gzip: true,
        gzip_min_bytes: 128 * 1024,
        ..Default::default()
    })
    .await;
    server.handle().seed_pods(60, 2);
    let small = raw_get(server.addr(), "/api/v1/pods?limit=1", GZIP).await;
    assert_eq!(small.header("content-encoding"), None, "small body");
    let large = raw_get(server.addr(), "/api/v1/pods", GZIP).await;
    assert_eq!(large.header("content-encoding"), Some("gzip"), "large body");
    assert!(gunzip(&large.body).len() > 128 * 1024);
    let server = TestServer::start().await;
    server.handle().seed_pods(2, 1);
    let off = raw_get(server.addr(), "/api/v1/pods", GZIP).await;
    assert_eq!(
        off.header("content-encoding"),
        None,
        "gzip is off by default"
    );
}

#[tokio::test]
async fn testkit_server_binary_takes_the_new_flags() {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_testkit-server"))
        .args([
            "--addr",
            "127.0.0.1:0",
            "--pods",
            "12",
            "--namespaces",
            "2",
            "--opaque-rv",
            "--short-pages",
            "--gzip",
            "--streaming-lists",
            "forbidden",
            "--bookmark-interval-ms",
            "60000",
            "--too-large-wait-ms",
            "100",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap()
        .to_string();
    let client = kube_persist_testkit::client_for_opts(&url, None, false);
    let result = async {
        let text = client.request_text(get("/testkit/revision")).await.unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["revision"], 12);
        assert!(
            v["resourceVersion"]
                .as_str()
                .unwrap()
                .parse::<u64>()
                .is_err()
        );
        let page: serde_json::Value = serde_json::from_str(
            &client
                .request_text(get("/api/v1/pods?limit=4"))
                .await
                .unwrap(),
        )
        .unwrap();
        assert_eq!(page["items"].as_array().unwrap().len(), 2, "short page");
        let s = status_of(
            &client,
            "/api/v1/pods?watch=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan",
        )
        .await;
        assert_eq!(s.code, 422);
        let addr: std::net::SocketAddr = url.trim_start_matches("http://").parse().unwrap();
        let zipped = raw_get(addr, "/api/v1/pods", GZIP).await;
        assert_eq!(zipped.header("content-encoding"), Some("gzip"));
        let s = status_of(&client, &format!("/api/v1/pods?resourceVersion={}", "tkz")).await;
        assert_eq!(s.code, 504, "too large after 100 ms");
    }
    .await;
    let _ = child.kill();
    let _ = child.wait();
    result
}

#[tokio::test]
async fn metadata_watch_and_bookmarks_use_the_rendered_form() {
    let server = TestServer::start_with(opaque()).await;
    let h = server.handle();
    h.seed_pods(2, 1);
    let api: Api<Pod> = Api::all(server.client());
    let stream = api
        .watch_metadata(&WatchParams::default().initial_events(), "0")
        .await
        .unwrap();
    let evs: Vec<_> = stream.take(3).try_collect().await.unwrap();
    let WatchEvent::Bookmark(b) = &evs[2] else {
        panic!("expected the initial-events-end bookmark")
    };
    assert_eq!(b.metadata.resource_version, h.resource_version());
}
