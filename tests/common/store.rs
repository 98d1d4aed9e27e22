//! Stores on disk: opened with an engine, synced once, compared object by object with the
//! server.

use std::collections::BTreeMap;
use std::time::Duration;

use kube::Resource;
use kube_persist::{Db, DbConfig, Engine, Reader};
use kube_persist_testkit::{ResourceType, ServerHandle};
use serde::de::DeserializeOwned;

use super::{Ev, WAIT, drive, key, server_versions};

/// Open the store at `path` with `engine` and otherwise default options.
pub fn try_open_db(engine: Engine, path: impl AsRef<std::path::Path>) -> kube_persist::Result<Db> {
    Db::open_with(path, DbConfig::default().engine(engine))
}

/// Sync stream `pods` of `db` once from `server` (until the initial list is on disk).
pub async fn sync_pods(server: &kube_persist_testkit::TestServer, db: &Db) {
    let (_reader, watcher) = db
        .store(
            "pods",
            kube::Api::<k8s_openapi::api::core::v1::Pod>::all(server.client()),
            kube_persist::StreamConfig::default(),
        )
        .unwrap();
    let mut w = drive(watcher);
    w.until(|e| *e == Ev::InitDone).await;
    w.stop().await;
}

/// `namespace/name` → resourceVersion of every object in the store, read from disk.
pub fn store_versions<K: Resource + DeserializeOwned + Send + Sync + 'static>(
    r: &Reader<K>,
) -> BTreeMap<String, String> {
    r.iter()
        .map(|o| {
            let o = o.expect("stored object decodes");
            (
                key(&*o),
                o.meta().resource_version.clone().unwrap_or_default(),
            )
        })
        .collect()
}

/// Assert that the store equals the server object by object (and that `get` finds each).
pub fn assert_matches<K: Resource + DeserializeOwned + Send + Sync + 'static>(
    r: &Reader<K>,
    h: &ServerHandle,
    rt: &ResourceType,
) {
    let server = server_versions(h, rt);
    let store = store_versions(r);
    assert!(
        store == server,
        "store differs: {}",
        diff("store", &store, &server)
    );
    assert_eq!(r.len(), server.len(), "Reader::len");
    for k in server.keys().take(50) {
        let (ns, name) = match k.split_once('/') {
            Some((ns, n)) => (Some(ns), n),
            None => (None, k.as_str()),
        };
        assert!(r.get_named(ns, name).unwrap().is_some(), "get({k})");
    }
}

/// Wait until the store equals the server (used after server-side changes).
pub async fn converge<K: Resource + DeserializeOwned + Send + Sync + 'static>(
    r: &Reader<K>,
    h: &ServerHandle,
    rt: &ResourceType,
) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if store_versions(r) == server_versions(h, rt) {
            assert_matches(r, h, rt);
            return;
        }
        if tokio::time::Instant::now() > deadline {
            assert_matches(r, h, rt);
            panic!("store did not converge");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What differs between two `key -> resourceVersion` maps (a few of each kind), for messages.
pub fn diff(
    what: &str,
    have: &BTreeMap<String, String>,
    want: &BTreeMap<String, String>,
) -> String {
    let missing: Vec<_> = want
        .keys()
        .filter(|k| !have.contains_key(*k))
        .take(5)
        .collect();
    let extra: Vec<_> = have
        .keys()
        .filter(|k| !want.contains_key(*k))
        .take(5)
        .collect();
    let stale: Vec<_> = want
        .iter()
        .filter(|(k, v)| have.get(*k).is_some_and(|x| x != *v))
        .take(5)
        .collect();
    format!(
        "{what} {} vs server {}: missing {missing:?} extra {extra:?} stale {stale:?}",
        have.len(),
        want.len()
    )
}

/// The fetch window a store directory's stream has open (`StreamInfo::fetched_through`):
/// while it is, a delta relist's bounded exception to "equal to the server at the
/// checkpoint" applies; `None` for a store that is exact at its checkpoint.
pub fn fetch_window(db: &kube_persist::Db, stream: &str) -> Option<String> {
    db.streams()
        .expect("the store's streams are readable")
        .into_iter()
        .find(|s| s.name == stream)
        .and_then(|s| s.fetched_through)
}

/// The differences between a store and the server's state at the store's checkpoint that
/// the store's own fetch window (`window`, [`fetch_window`]) does not explain (empty: none).
/// With no window open, every difference is a divergence. With one open (a delta relist
/// fetched bodies and the watch has not replayed past them), a stored object may be NEWER
/// than the server's at the checkpoint (a version the server had since: at most its version
/// `now`), and one may be missing that the server no longer has now, or has at a version
/// newer than the window (deleted or moved out of the selection before its fetch, and
/// replaced or back since). Versions are ordered only through
/// `kube_persist::resource_version`.
pub fn unexplained_by_window(
    store: &BTreeMap<String, String>,
    at_checkpoint: &BTreeMap<String, String>,
    now: &BTreeMap<String, String>,
    checkpoint: &str,
    window: Option<&str>,
) -> Vec<String> {
    use kube_persist::resource_version::compare;
    use std::cmp::Ordering::Greater;
    let newer = |v: &str, than: &str| compare(v, than).ok() == Some(Greater);
    let mut out = Vec::new();
    let keys: std::collections::BTreeSet<&String> =
        store.keys().chain(at_checkpoint.keys()).collect();
    for k in keys {
        let (have, want) = (store.get(k), at_checkpoint.get(k));
        if have == want {
            continue;
        }
        let explained = window.is_some_and(|high| match have {
            Some(v) => newer(v, checkpoint) && now.get(k).is_none_or(|n| !newer(v, n)),
            None => now.get(k).is_none_or(|n| newer(n, high)),
        });
        if !explained {
            out.push(format!(
                "{k}: store {have:?}, server at checkpoint {want:?}, now {:?}, fetch window {window:?}",
                now.get(k)
            ));
        }
    }
    out
}
