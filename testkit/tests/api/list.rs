//! LIST semantics over real HTTP with kube's `Api<Pod>`.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, PostParams, VersionMatch};
use kube_persist_testkit::{ResourceType, TestServer, Verb, client_for_opts, make_pod};

fn names(list: &kube::core::ObjectList<Pod>) -> Vec<String> {
    list.items
        .iter()
        .map(|p| p.metadata.name.clone().unwrap_or_default())
        .collect()
}

fn api_code(err: kube::Error) -> (u16, String) {
    match err {
        kube::Error::Api(s) => (s.code, s.reason),
        other => panic!("expected an API error, got {other:?}"),
    }
}

#[tokio::test]
async fn pagination_walks_everything_in_order() {
    let server = TestServer::start().await;
    server.handle().seed_pods(1234, 3);
    let api: Api<Pod> = Api::all(server.client());
    let mut lp = ListParams::default().limit(100);
    let mut all = Vec::new();
    let mut pages = 0;
    let mut rv = None;
    loop {
        let page = api.list(&lp).await.unwrap();
        pages += 1;
        if let Some(first_rv) = &rv {
            assert_eq!(page.metadata.resource_version.as_ref(), Some(first_rv));
        } else {
            rv = page.metadata.resource_version.clone();
        }
        all.extend(page.items.iter().map(|p| {
            (
                p.metadata.namespace.clone().unwrap(),
                p.metadata.name.clone().unwrap(),
            )
        }));
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(c) => {
                assert!(page.metadata.remaining_item_count.is_some());
                lp = lp.continue_token(&c);
            }
            None => break,
        }
    }
    assert_eq!(pages, 13);
    assert_eq!(all.len(), 1234);
    let mut sorted = all.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(
        all, sorted,
        "ordered by (namespace, name) without duplicates"
    );
    assert_eq!(rv.unwrap(), server.handle().revision().to_string());
    assert_eq!(server.handle().counts().list, 13);
}

#[tokio::test]
async fn pages_are_a_consistent_snapshot_despite_writes() {
    let server = TestServer::start().await;
    let h = server.handle();
    h.seed_pods(300, 1);
    let before: Vec<_> = h
        .list(&ResourceType::pods())
        .iter()
        .map(|p| p["metadata"]["resourceVersion"].clone())
        .collect();
    let api: Api<Pod> = Api::all(server.client());
    let mut lp = ListParams::default().limit(50);
    let mut seen = Vec::new();
    let mut round = 0u64;
    loop {
        let page = api.list(&lp).await.unwrap();
        seen.extend(
            page.items
                .iter()
                .map(|p| serde_json::Value::String(p.metadata.resource_version.clone().unwrap())),
        );
        // Write between pages: update, delete and create objects anywhere in the key space.
        h.churn(5, 3, 2, round);
        h.delete(
            &ResourceType::pods(),
            Some("ns-0"),
            &format!("pod-{}", 299 - round),
        );
        round += 1;
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(c) => lp = lp.continue_token(&c),
            None => break,
        }
    }
    assert_eq!(
        seen, before,
        "every page reflects the revision of the first page"
    );
}

#[tokio::test]
async fn exact_list_at_an_old_revision() {
    let server = TestServer::start().await;
    let h = server.handle();
    h.seed_pods(10, 1);
    let rev = h.revision();
    h.delete(&ResourceType::pods(), Some("ns-0"), "pod-3");
    h.apply(&ResourceType::pods(), make_pod("ns-0", "pod-new", 1));
    let api: Api<Pod> = Api::all(server.client());
    let lp = ListParams::default()
        .at(&rev.to_string())
        .matching(VersionMatch::Exact);
    let old = api.list(&lp).await.unwrap();
    assert_eq!(old.items.len(), 10);
    assert!(names(&old).contains(&"pod-3".to_string()));
    assert!(!names(&old).contains(&"pod-new".to_string()));
    assert_eq!(old.metadata.resource_version, Some(rev.to_string()));
    // NotOlderThan answers with the current state.
    let lp = ListParams::default()
        .at(&rev.to_string())
        .matching(VersionMatch::NotOlderThan);
    let now = api.list(&lp).await.unwrap();
    assert_eq!(
        now.metadata.resource_version,
        Some(h.revision().to_string())
    );
    assert!(names(&now).contains(&"pod-new".to_string()));
    // After compaction the old revision is gone.
    h.compact();
    let lp = ListParams::default()
        .at(&rev.to_string())
        .matching(VersionMatch::Exact);
    assert_eq!(
        api_code(api.list(&lp).await.unwrap_err()),
        (410, "Expired".into())
    );
}

#[tokio::test]
async fn continue_token_expires_on_compaction() {
    let server = TestServer::start().await;
    let h = server.handle();
    h.seed_pods(20, 1);
    let api: Api<Pod> = Api::all(server.client());
    let page = api.list(&ListParams::default().limit(5)).await.unwrap();
    let token = page.metadata.continue_.unwrap();
    h.compact();
    let err = api
        .list(&ListParams::default().limit(5).continue_token(&token))
        .await
        .unwrap_err();
    let kube::Error::Api(status) = err else {
        panic!("expected API error")
    };
    assert_eq!(status.code, 410);
    assert_eq!(status.reason, "Expired");
    assert!(
        status.message.contains("continue parameter is too old"),
        "{}",
        status.message
    );
    // Garbage tokens are a 400, not a panic.
    let err = api
        .list(&ListParams::default().continue_token("%%%"))
        .await
        .unwrap_err();
    assert_eq!(api_code(err).0, 400);
}

#[tokio::test]
async fn too_large_resource_version_is_504() {
    let server = TestServer::start_with(kube_persist_testkit::ServerOptions {
        too_large_wait: std::time::Duration::from_millis(200),
        ..Default::default()
    })
    .await;
    server.handle().seed_pods(3, 1);
    let client = client_for_opts(&server.url(), None, false);
    let api: Api<Pod> = Api::all(client);
    let future = (server.handle().revision() + 100).to_string();
    for m in [VersionMatch::NotOlderThan, VersionMatch::Exact] {
        let err = api
            .list(&ListParams::default().at(&future).matching(m))
            .await
            .unwrap_err();
        let kube::Error::Api(status) = err else {
            panic!("expected API error")
        };
        assert_eq!((status.code, status.reason.as_str()), (504, "Timeout"));
        let causes = status.details.unwrap().causes;
        assert_eq!(causes[0].reason, "ResourceVersionTooLarge");
    }
}

#[tokio::test]
async fn label_and_field_selectors() {
    let server = TestServer::start().await;
    let h = server.handle();
    let rt = ResourceType::pods();
    for (i, (app, tier)) in [("a", "web"), ("b", "web"), ("c", "db"), ("a", "db")]
        .iter()
        .enumerate()
    {
        let mut p = make_pod(
            if i % 2 == 0 { "x" } else { "y" },
            &format!("p{i}"),
            i as u64,
        );
        p["metadata"]["labels"] = serde_json::json!({"app": app, "tier": tier});
        if i == 3 {
            p["metadata"]["labels"]["canary"] = "true".into();
        }
        // On node `n1`, and not scheduled (no `spec.nodeName`); the others on `node-<k>`.
        if i == 1 {
            p["spec"]["nodeName"] = "n1".into();
        }
        if i == 0 {
            p["spec"].as_object_mut().unwrap().remove("nodeName");
        }
        h.create(&rt, p).unwrap();
    }
    let api: Api<Pod> = Api::all(server.client());
    let sel = |l: &str| ListParams::default().labels(l);
    let cases = [
        ("app=a", vec!["p0", "p3"]),
        ("app==a,tier=db", vec!["p3"]),
        ("app!=a", vec!["p2", "p1"]),
        ("app in (b,c)", vec!["p2", "p1"]),
        ("app notin (a, b)", vec!["p2"]),
        ("canary", vec!["p3"]),
        ("!canary,tier=web", vec!["p0", "p1"]),
    ];
    for (s, want) in cases {
        assert_eq!(
            names(&api.list(&sel(s)).await.unwrap()),
            want,
            "selector {s}"
        );
    }
    let fields = |f: &str| ListParams::default().fields(f);
    assert_eq!(
        names(&api.list(&fields("metadata.name=p2")).await.unwrap()),
        vec!["p2"]
    );
    assert_eq!(
        names(&api.list(&fields("metadata.namespace==y")).await.unwrap()),
        vec!["p1", "p3"]
    );
    assert_eq!(
        names(
            &api.list(&fields("metadata.namespace!=y,metadata.name!=p0"))
                .await
                .unwrap()
        ),
        vec!["p2"]
    );
    let ns_api: Api<Pod> = Api::namespaced(server.client(), "x");
    assert_eq!(
        names(&ns_api.list(&sel("tier=db")).await.unwrap()),
        vec!["p2"]
    );
    // Paginated + selector.
    let page = api.list(&sel("tier in (web,db)").limit(3)).await.unwrap();
    assert_eq!(names(&page), vec!["p0", "p2", "p1"]);
    let rest = api
        .list(
            &sel("tier in (web,db)")
                .limit(3)
                .continue_token(&page.metadata.continue_.unwrap()),
        )
        .await
        .unwrap();
    assert_eq!(names(&rest), vec!["p3"]);
    // Bad selectors are 400.
    for bad in ["app in (a", "a b"] {
        assert_eq!(
            api_code(api.list(&sel(bad)).await.unwrap_err()).0,
            400,
            "{bad}"
        );
    }
    // Pods are selected by `spec.nodeName` too (`""`: not scheduled), as kube-apiserver
    // selects them; other kinds refuse it, and every kind refuses a field it does not have.
    assert_eq!(
        names(&api.list(&fields("spec.nodeName=n1")).await.unwrap()),
        vec!["p1"]
    );
    assert_eq!(
        names(&api.list(&fields("spec.nodeName!=n1")).await.unwrap()),
        vec!["p0", "p2", "p3"]
    );
    assert_eq!(
        names(
            &api.list(&fields("spec.nodeName=,metadata.name=p0"))
                .await
                .unwrap()
        ),
        vec!["p0"]
    );
    assert!(
        names(
            &api.list(&fields("spec.nodeName=n1,metadata.name=p0"))
                .await
                .unwrap()
        )
        .is_empty()
    );
    assert_eq!(
        api_code(api.list(&fields("spec.host=x")).await.unwrap_err()).0,
        400
    );
    let cms: Api<k8s_openapi::api::core::v1::ConfigMap> = Api::all(server.client());
    assert_eq!(
        api_code(cms.list(&fields("spec.nodeName=n1")).await.unwrap_err()).0,
        400
    );
}

#[tokio::test]
async fn metadata_only_list() {
    let server = TestServer::start().await;
    server.handle().seed_pods(30, 2);
    let api: Api<Pod> = Api::all(server.client());
    let list = api
        .list_metadata(&ListParams::default().limit(20))
        .await
        .unwrap();
    assert_eq!(list.items.len(), 20);
    let first = &list.items[0];
    assert_eq!(first.metadata.name.as_deref(), Some("pod-0"));
    assert!(first.metadata.resource_version.is_some());
    let types = first.types.as_ref().unwrap();
    assert_eq!(
        (types.api_version.as_str(), types.kind.as_str()),
        ("meta.k8s.io/v1", "PartialObjectMetadata")
    );
    // Raw check: no spec/status on the wire.
    let req = axum::http::Request::get("/api/v1/pods?limit=2")
        .header(
            "Accept",
            "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1",
        )
        .body(Vec::new())
        .unwrap();
    let text = server.client().request_text(req).await.unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["kind"], "PartialObjectMetadataList");
    assert!(v["items"][0].get("spec").is_none());
    assert!(v["items"][0]["metadata"]["labels"].is_object());
}

#[tokio::test]
async fn malformed_and_failing_lists() {
    let server = TestServer::start().await;
    let h = server.handle();
    h.seed_pods(5, 1);
    let api: Api<Pod> = Api::all(client_for_opts(&server.url(), None, false));
    h.faults().malformed_next_list();
    let err = api.list(&ListParams::default()).await.unwrap_err();
    assert!(matches!(err, kube::Error::SerdeError(_)), "{err:?}");
    assert_eq!(
        api.list(&ListParams::default()).await.unwrap().items.len(),
        5
    );

    h.faults().fail_next(Verb::List, 503, 2);
    for _ in 0..2 {
        assert_eq!(
            api_code(api.list(&ListParams::default()).await.unwrap_err()).0,
            503
        );
    }
    assert!(api.list(&ListParams::default()).await.is_ok());
    h.faults().fail_next(Verb::Create, 500, 1);
    let err = api
        .create(
            &PostParams::default(),
            &serde_json::from_value(make_pod("ns-0", "zz", 1)).unwrap(),
        )
        .await
        .unwrap_err();
    assert_eq!(api_code(err), (500, "InternalError".into()));

    // kube's default client retries 503 transparently.
    let retrying: Api<Pod> = Api::all(server.client());
    h.faults().fail_next(Verb::List, 503, 1);
    assert!(retrying.list(&ListParams::default()).await.is_ok());

    h.faults().page_delay(std::time::Duration::from_millis(300));
    let t = std::time::Instant::now();
    api.list(&ListParams::default()).await.unwrap();
    assert!(t.elapsed() >= std::time::Duration::from_millis(300));
    h.faults().clear();
    let t = std::time::Instant::now();
    api.list(&ListParams::default()).await.unwrap();
    assert!(t.elapsed() < std::time::Duration::from_millis(300));
}
