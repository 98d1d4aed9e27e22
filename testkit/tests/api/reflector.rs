//! Acceptance: kube-runtime's `watcher` + `reflector` sync against the server, survive a
//! forced 410, and end equal to the server state object by object.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube_persist_testkit::{ResourceType, ServerHandle, ServerOptions, TestServer};

type Versions = BTreeMap<(String, String), String>;

fn server_versions(h: &ServerHandle) -> Versions {
    h.resource_versions(&ResourceType::pods())
}

fn store_versions(store: &Store<Pod>) -> Versions {
    store
        .state()
        .iter()
        .map(|p| {
            let m = &p.metadata;
            (
                (
                    m.namespace.clone().unwrap_or_default(),
                    m.name.clone().unwrap_or_default(),
                ),
                m.resource_version.clone().unwrap_or_default(),
            )
        })
        .collect()
}

async fn wait_equal(h: &ServerHandle, store: &Store<Pod>, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (want, got) = (server_versions(h), store_versions(store));
        if want == got {
            return;
        }
        if Instant::now() > deadline {
            let missing = want.keys().filter(|k| !got.contains_key(*k)).count();
            let extra = got.keys().filter(|k| !want.contains_key(*k)).count();
            panic!(
                "{what}: store != server (server {}, store {}, missing {missing}, extra {extra})",
                want.len(),
                got.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn sync_survives_410(config: watcher::Config, streaming: bool) {
    let opts = ServerOptions {
        bookmark_interval: Duration::from_millis(200),
        ..Default::default()
    };
    let server = TestServer::start_with(opts).await;
    let h = server.handle();
    h.seed_pods(5000, 10);
    let api: Api<Pod> = Api::all(server.client());
    let (store, writer) = reflector::store::<Pod>();
    let stream = reflector::reflector(writer, watcher(api, config)).default_backoff();
    let task = tokio::spawn(stream.for_each(|_| futures::future::ready(())));

    tokio::time::timeout(Duration::from_secs(15), store.wait_until_ready())
        .await
        .unwrap()
        .unwrap();
    wait_equal(&h, &store, "initial sync").await;
    let counts = h.counts();
    if streaming {
        assert_eq!(counts.list, 0, "streaming lists never LIST");
    } else {
        assert_eq!(counts.list, 10, "5000 pods in pages of 500");
    }

    // Live changes flow through the open watch.
    h.churn(50, 20, 10, 1);
    wait_equal(&h, &store, "live events").await;

    // Force a 410: history is compacted while changes happen, the open watch is closed and
    // the next WATCH gets an ERROR 410, so the watcher must relist.
    h.reset_counts();
    h.faults().gone_next_watch();
    h.churn(100, 50, 40, 2);
    h.compact();
    h.faults().close_watches();
    h.churn(30, 10, 10, 3);
    wait_equal(&h, &store, "after 410 relist").await;
    let counts = h.counts();
    if streaming {
        assert!(
            counts.watch >= 2,
            "resume watch + streaming relist: {counts:?}"
        );
    } else {
        assert!(counts.list >= 10, "paginated relist: {counts:?}");
    }
    h.churn(20, 5, 5, 4);
    wait_equal(&h, &store, "after recovery").await;
    assert_eq!(store.state().len(), server_versions(&h).len());
    // The cheap map agrees with the full objects.
    let full: Versions = h
        .list(&ResourceType::pods())
        .iter()
        .map(|p| {
            let m = &p["metadata"];
            let s = |k: &str| m[k].as_str().unwrap_or_default().to_string();
            ((s("namespace"), s("name")), s("resourceVersion"))
        })
        .collect();
    assert_eq!(full, server_versions(&h));
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflector_list_watch_pages_survives_410() {
    sync_survives_410(watcher::Config::default().page_size(500), false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflector_streaming_list_survives_410() {
    sync_survives_410(watcher::Config::default().streaming_lists(), true).await;
}
