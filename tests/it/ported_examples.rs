//! kube-rs' own examples, ported to kube-persist by changing their construction
//! (`examples/pod_reflector.rs`, `examples/configmapgen_controller.rs`), each run against
//! the testkit: the port builds, and it does what the original does.

#[path = "../../examples/configmapgen_controller.rs"]
mod configmapgen_controller;
#[path = "../../examples/pod_reflector.rs"]
mod pod_reflector;

use std::sync::Arc;

use crate::common::eventually;
use futures::StreamExt;
use kube_persist::Db;
use kube_persist_testkit::{ResourceType, TestServer};
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_reflector_sees_every_pod_of_the_default_namespace() {
    let server = TestServer::with_web_pods().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let mut seen = pod_reflector::reflect(server.client(), path.to_str().unwrap(), Some(2))
        .await
        .unwrap();
    seen.sort();
    assert_eq!(seen, ["web-0", "web-1"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configmapgen_controller_owns_one_configmap_per_generator() {
    let server = TestServer::start().await;
    let h = server.handle();
    let cmg = ResourceType::new(
        "nullable.se",
        "v1",
        "configmapgenerators",
        "ConfigMapGenerator",
        true,
    );
    h.register(&cmg);
    let cms = ResourceType::configmaps();
    let generator = |content: &str| {
        json!({"apiVersion": "nullable.se/v1", "kind": "ConfigMapGenerator",
               "metadata": {"name": "gen-a", "namespace": "default"},
               "spec": {"content": content}})
    };
    h.apply(&cmg, generator("hello"));
    let uid = h.get(&cmg, Some("default"), "gen-a").unwrap()["metadata"]["uid"].clone();

    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path()).unwrap();
    let client = server.client();
    let data = Arc::new(configmapgen_controller::Data {
        client: client.clone(),
    });
    let run = configmapgen_controller::controller(client, &db)
        .unwrap()
        .run(
            configmapgen_controller::reconcile,
            configmapgen_controller::error_policy,
            data,
        )
        .for_each(|_| async {});
    let task = tokio::spawn(run);

    let content = |h: &kube_persist_testkit::ServerHandle| -> Option<Value> {
        let cm = h.get(&cms, Some("default"), "gen-a")?;
        (cm["metadata"]["ownerReferences"][0]["uid"] == uid).then(|| cm["data"]["content"].clone())
    };
    eventually("the generator's ConfigMap, owned by it", || {
        content(&h) == Some(json!("hello"))
    })
    .await;
    // The generator changes: its ConfigMap follows.
    h.apply(&cmg, generator("bye"));
    eventually("the ConfigMap updated", || {
        content(&h) == Some(json!("bye"))
    })
    .await;
    // The owned ConfigMap is deleted: its owner is reconciled and writes it again.
    h.delete(&cms, Some("default"), "gen-a");
    eventually("the ConfigMap written again", || {
        content(&h) == Some(json!("bye"))
    })
    .await;
    task.abort();
}

/// Transforms compose in the order given (a port chains them like kube-runtime's `modify`):
/// `drop_managed_fields()` and a second transform both apply.
#[tokio::test(flavor = "current_thread")]
async fn transforms_compose_in_the_order_given() {
    use k8s_openapi::api::core::v1::Pod;
    let server = TestServer::start().await;
    server.handle().seed_pods(3, 1);
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path()).unwrap();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let config = kube_persist::StreamConfig::default()
        .drop_managed_fields()
        .transform("no-status", {
            let seen = seen.clone();
            move |pod| {
                // Runs second: managedFields are already gone.
                seen.lock()
                    .unwrap()
                    .push(pod["metadata"].get("managedFields").is_some());
                if let Some(pod) = pod.as_object_mut() {
                    pod.remove("status");
                }
            }
        });
    let (reader, watcher) = db
        .store("pods", kube::Api::<Pod>::all(server.client()), config)
        .unwrap();
    tokio::spawn(watcher.run());
    reader.wait_until_ready().await.unwrap();
    for pod in reader.iter() {
        let pod = pod.unwrap();
        assert!(
            pod.metadata.managed_fields.is_none(),
            "the first transform ran"
        );
        assert!(pod.status.is_none(), "the second transform ran");
    }
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 3);
    assert!(seen.iter().all(|had| !had), "in the order given");
}
