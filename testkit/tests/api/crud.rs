//! Single-object verbs, auth, counters and admin endpoints over real HTTP.

use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube_persist_testkit::{
    RequestCounts, ResourceType, ServerOptions, TestServer, client_for, make_pod,
};
use serde_json::json;

fn api_code(err: kube::Error) -> (u16, String) {
    match err {
        kube::Error::Api(s) => (s.code, s.reason),
        other => panic!("expected an API error, got {other:?}"),
    }
}

#[tokio::test]
async fn create_get_replace_delete() {
    let server = TestServer::start().await;
    let api: Api<ConfigMap> = Api::namespaced(server.client(), "default");
    let cm: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "cfg", "labels": {"a": "b"}}, "data": {"k": "v"}
    }))
    .unwrap();
    let created = api.create(&PostParams::default(), &cm).await.unwrap();
    let meta = &created.metadata;
    assert_eq!(meta.resource_version.as_deref(), Some("1"));
    assert_eq!(meta.generation, Some(1));
    assert!(meta.uid.is_some() && meta.creation_timestamp.is_some());
    assert_eq!(meta.namespace.as_deref(), Some("default"));

    let err = api.create(&PostParams::default(), &cm).await.unwrap_err();
    assert_eq!(api_code(err), (409, "AlreadyExists".into()));

    let mut got = api.get("cfg").await.unwrap();
    assert_eq!(got.data.as_ref().unwrap()["k"], "v");
    got.data = Some([("k".to_string(), "w".to_string())].into());
    let replaced = api
        .replace("cfg", &PostParams::default(), &got)
        .await
        .unwrap();
    assert_eq!(replaced.metadata.resource_version.as_deref(), Some("2"));
    assert_eq!(replaced.metadata.generation, Some(2));
    assert_eq!(replaced.metadata.uid, created.metadata.uid);

    // Stale resourceVersion.
    let err = api
        .replace("cfg", &PostParams::default(), &got)
        .await
        .unwrap_err();
    assert_eq!(api_code(err), (409, "Conflict".into()));

    let deleted = api.delete("cfg", &DeleteParams::default()).await.unwrap();
    let obj = deleted.left().expect("the deleted object");
    assert_eq!(obj.metadata.resource_version.as_deref(), Some("3"));
    assert_eq!(
        api_code(api.get("cfg").await.unwrap_err()),
        (404, "NotFound".into())
    );
    assert_eq!(
        api_code(
            api.delete("cfg", &DeleteParams::default())
                .await
                .unwrap_err()
        )
        .0,
        404
    );
    assert_eq!(
        api_code(
            api.replace("cfg", &PostParams::default(), &cm)
                .await
                .unwrap_err()
        )
        .0,
        404
    );

    assert_eq!(
        server.handle().counts(),
        RequestCounts {
            list: 0,
            list_one: 0,
            list_named: 0,
            list_named_max_in_flight: 0,
            watch: 0,
            get: 2,
            create: 2,
            update: 3,
            delete: 2,
            patch: 0,
        }
    );
    server.handle().reset_counts();
    assert_eq!(server.handle().counts(), RequestCounts::default());
}

/// PATCH: server-side apply creates the object when absent and merges when present; a
/// JSON merge patch merges (`null` removes a key) and is 404 on an absent object.
#[tokio::test]
async fn patch_merges_and_apply_creates() {
    use kube::api::{Patch, PatchParams};
    let server = TestServer::start().await;
    let api: Api<ConfigMap> = Api::namespaced(server.client(), "default");
    let err = api
        .patch(
            "cfg",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"a": "1"}})),
        )
        .await
        .unwrap_err();
    assert_eq!(api_code(err), (404, "NotFound".into()));
    let applied = api
        .patch(
            "cfg",
            &PatchParams::apply("test"),
            &Patch::Apply(json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "cfg"}, "data": {"a": "1", "b": "2"}})),
        )
        .await
        .unwrap();
    assert_eq!(applied.data.as_ref().unwrap()["a"], "1");
    let uid = applied.metadata.uid.clone();
    let merged = api
        .patch(
            "cfg",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"x": "y"}}, "data": {"a": null}})),
        )
        .await
        .unwrap();
    let data = merged.data.unwrap();
    assert!(!data.contains_key("a") && data["b"] == "2", "{data:?}");
    assert_eq!(merged.metadata.labels.unwrap()["x"], "y");
    assert_eq!(merged.metadata.uid, uid, "the same object");
    assert_eq!(server.handle().counts().patch, 3);
}

#[tokio::test]
async fn cluster_scoped_and_custom_resources() {
    let server = TestServer::start().await;
    let ns_api: Api<Namespace> = Api::all(server.client());
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": "team-a"}})).unwrap();
    ns_api.create(&PostParams::default(), &ns).await.unwrap();
    assert_eq!(
        ns_api.get("team-a").await.unwrap().metadata.name.as_deref(),
        Some("team-a")
    );
    assert_eq!(
        ns_api
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len(),
        1
    );

    let h = server.handle();
    let widgets = ResourceType::widgets();
    h.create(
        &widgets,
        json!({"metadata": {"name": "w1", "namespace": "n"}, "spec": {"size": 3}}),
    )
    .unwrap();
    let req = axum::http::Request::get("/apis/example.kube-persist.dev/v1/namespaces/n/widgets/w1")
        .body(Vec::new())
        .unwrap();
    let text = server.client().request_text(req).await.unwrap();
    let w: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(w["kind"], "Widget");
    assert_eq!(w["apiVersion"], "example.kube-persist.dev/v1");
    assert_eq!(w["spec"]["size"], 3);

    for path in [
        "/apis/nope/v1/things",
        "/api/v1/namespaces/x/namespaces",
        "/api/v1/pods/x",
        "/foo",
    ] {
        let req = axum::http::Request::get(path).body(Vec::new()).unwrap();
        let err = server.client().request_text(req).await.unwrap_err();
        assert_eq!(api_code(err).0, 404, "{path}");
    }
}

#[tokio::test]
async fn handle_write_api() {
    let server = TestServer::start().await;
    let h = server.handle();
    let rt = ResourceType::pods();
    let created = h.create(&rt, make_pod("a", "p", 1)).unwrap();
    assert_eq!(created["metadata"]["resourceVersion"], "1");
    assert_eq!(h.create(&rt, make_pod("a", "p", 1)).unwrap_err().code, 409);
    let mut stale = created.clone();
    h.apply(&rt, make_pod("a", "p", 2));
    stale["metadata"]["labels"]["x"] = "y".into();
    assert_eq!(h.replace(&rt, stale).unwrap_err().reason, "Conflict");
    assert_eq!(
        h.replace(&rt, make_pod("a", "missing", 1))
            .unwrap_err()
            .code,
        404
    );
    assert!(h.get(&rt, Some("a"), "p").is_some());
    assert_eq!(
        h.delete(&rt, Some("a"), "p").unwrap()["metadata"]["resourceVersion"],
        "3"
    );
    assert!(h.delete(&rt, Some("a"), "p").is_none());
    assert_eq!(h.revision(), 3);
    // Bad input is an error, not a panic.
    assert_eq!(
        h.create(&rt, json!({"metadata": {"name": 5}}))
            .unwrap_err()
            .code,
        422
    );
    assert_eq!(h.apply(&rt, json!("nope"))["kind"], "Status");
}

#[tokio::test]
async fn bad_http_input_gets_status_errors() {
    let server = TestServer::start().await;
    let client = server.client();
    let cases = [
        ("POST", "/api/v1/namespaces/default/pods", "not json", 400),
        (
            "POST",
            "/api/v1/namespaces/default/pods",
            "{\"metadata\":{\"name\":7}}",
            422,
        ),
        (
            "POST",
            "/api/v1/namespaces/default/pods",
            "{\"metadata\":{\"name\":\"a\",\"namespace\":\"other\"}}",
            400,
        ),
        (
            "PUT",
            "/api/v1/namespaces/default/pods/a",
            "{\"metadata\":{\"name\":\"b\"}}",
            400,
        ),
        // A patch type the server does not take (plain JSON): 415, as kube-apiserver.
        ("PATCH", "/api/v1/namespaces/default/pods/a", "{}", 415),
        ("PUT", "/api/v1/pods", "{}", 405),
        ("GET", "/api/v1/pods?limit=abc", "", 400),
        (
            "GET",
            "/api/v1/pods?watch=true&resourceVersion=xyz",
            "",
            400,
        ),
        ("GET", "/api/v1/pods?resourceVersion=abc", "", 400),
        ("GET", "/api/v1/pods?resourceVersionMatch=Exact", "", 422),
        ("GET", "/testkit/faults/unknown", "", 404),
        ("POST", "/testkit/faults/fail-next?verb=fly", "", 400),
    ];
    for (method, path, body, code) in cases {
        let req = axum::http::Request::builder()
            .method(method)
            .uri(path)
            .header("Content-Type", "application/json")
            .body(body.as_bytes().to_vec())
            .unwrap();
        let err = client.request_text(req).await.unwrap_err();
        let kube::Error::Api(status) = err else {
            panic!("{method} {path}: expected Status, got {err:?}")
        };
        assert_eq!(status.code, code, "{method} {path}: {status:?}");
    }
}

#[tokio::test]
async fn bearer_token_is_required_when_configured() {
    let opts = ServerOptions {
        token: Some("s3cret".into()),
        ..Default::default()
    };
    let server = TestServer::start_with(opts).await;
    server.handle().seed_pods(2, 1);
    let ok: Api<Pod> = Api::all(server.client());
    assert_eq!(
        ok.list(&ListParams::default()).await.unwrap().items.len(),
        2
    );
    for token in [None, Some("wrong")] {
        let api: Api<Pod> = Api::all(client_for(&server.url(), token));
        assert_eq!(
            api_code(api.list(&ListParams::default()).await.unwrap_err()),
            (401, "Unauthorized".into())
        );
        let req = axum::http::Request::get("/testkit/counts")
            .body(Vec::new())
            .unwrap();
        let err = client_for(&server.url(), token)
            .request_text(req)
            .await
            .unwrap_err();
        assert_eq!(api_code(err).0, 401);
    }
}

#[tokio::test]
async fn admin_endpoints() {
    let server = TestServer::start().await;
    let client = server.client();
    let call = |method: &str, path: &str| {
        let req = axum::http::Request::builder()
            .method(method)
            .uri(path)
            .body(Vec::new())
            .unwrap();
        let client = client.clone();
        async move {
            serde_json::from_str::<serde_json::Value>(&client.request_text(req).await.unwrap())
                .unwrap()
        }
    };
    server.handle().seed_pods(100, 2);
    assert_eq!(call("GET", "/testkit/revision").await["revision"], 100);
    let after = call(
        "POST",
        "/testkit/churn?updates=10&creates=5&deletes=3&seed=7",
    )
    .await;
    assert_eq!(after["revision"], 118);
    assert_eq!(server.handle().list(&ResourceType::pods()).len(), 102);
    let api: Api<Pod> = Api::all(client.clone());
    api.list(&ListParams::default()).await.unwrap();
    let counts: RequestCounts =
        serde_json::from_value(call("GET", "/testkit/counts").await).unwrap();
    assert_eq!(counts.list, 1);
    call("POST", "/testkit/reset-counts").await;
    assert_eq!(server.handle().counts(), RequestCounts::default());
    call(
        "POST",
        "/testkit/faults/fail-next?verb=get&status=500&count=1",
    )
    .await;
    let ns_api: Api<Pod> = Api::namespaced(client.clone(), "ns-0");
    assert_eq!(api_code(ns_api.get_opt("x").await.unwrap_err()).0, 500);
    call("POST", "/testkit/faults/page-delay?ms=0").await;
    call("POST", "/testkit/faults/drop-watch-after?events=3").await;
    call("POST", "/testkit/faults/gone-next-watch").await;
    call("POST", "/testkit/faults/clear").await;
    call("POST", "/testkit/compact").await;
    assert_eq!(
        call("POST", "/testkit/seed?pods=10&namespaces=1").await["revision"],
        128
    );
}
