//! What the scenarios share: the outcome type, the server under test, Pods made and changed
//! with a parallel client, the server's collection read with paginated LISTs, and waiting
//! for a store to equal it.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::ObjectMeta;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, VersionMatch};
use kube::{Api, Client};
use kube_persist::Reader;
use kube_persist_testkit::realk8s::RealK8s;
use serde_json::json;

use crate::common;

/// Why a scenario did not pass.
#[derive(Debug)]
pub enum Fail {
    /// The store (or a check of the library) disagrees with the server.
    Diverged(String),
    /// The scenario could not run (a request failed, a timeout).
    Error(String),
}

impl<E: std::error::Error> From<E> for Fail {
    fn from(e: E) -> Self {
        Fail::Error(e.to_string())
    }
}

pub type Outcome = Result<(), Fail>;

/// A divergence unless `ok`.
pub fn ensure(ok: bool, what: impl FnOnce() -> String) -> Outcome {
    if ok {
        Ok(())
    } else {
        Err(Fail::Diverged(what()))
    }
}

/// An error (not a divergence): the scenario could not get where it meant to.
pub fn error(what: impl Into<String>) -> Fail {
    Fail::Error(what.into())
}

/// How long a scenario waits for a positive signal before giving up.
pub const WAIT: Duration = Duration::from_secs(90);
/// Concurrent requests when making or changing Pods.
const PARALLEL: usize = 32;
/// Namespaces the Pods are spread over.
pub const NAMESPACES: usize = 4;

/// One running kube-apiserver and an admin client of it.
pub struct Server {
    pub guard: Mutex<RealK8s>,
    pub client: Client,
    pub kubeconfig: std::path::PathBuf,
}

impl Server {
    pub async fn new(guard: RealK8s) -> Result<Server, Fail> {
        let client = guard.client().await?;
        let kubeconfig = guard.kubeconfig().to_path_buf();
        let server = Server {
            guard: Mutex::new(guard),
            client,
            kubeconfig,
        };
        for i in 0..NAMESPACES {
            ensure_namespace(&server.client, &ns(i)).await?;
        }
        Ok(server)
    }

    /// Pods LIST requests the server has answered so far (`apiserver_request_total`).
    pub async fn lists(&self) -> Result<u64, Fail> {
        Ok(kube_persist_testkit::realk8s::request_count(&self.client, "pods", "LIST").await?)
    }

    /// Runs `f` on the guard on a blocking thread's terms (start.sh, stop.sh, compact.sh
    /// wait for child processes) while the runtime's other tasks keep running.
    pub fn with_guard<T>(&self, f: impl FnOnce(&mut RealK8s) -> T) -> T {
        tokio::task::block_in_place(|| f(&mut self.guard.lock().unwrap()))
    }
}

/// Create namespace `name` unless it exists.
pub async fn ensure_namespace(client: &Client, name: &str) -> Outcome {
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}}))?;
    match Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

pub fn ns(i: usize) -> String {
    format!("e2e-{i}")
}

/// The namespace and name of Pod `i`.
pub fn pod_key(i: usize) -> (String, String) {
    (ns(i % NAMESPACES), format!("p-{i:05}"))
}

fn pod(ns: &str, name: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": ns, "labels": {"app": "e2e", "rev": "0"}},
        "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}
    }))
    .expect("a valid Pod")
}

/// Create Pods `range` (see [`pod_key`]) with a parallel client; returns their keys.
pub async fn create_pods(
    client: &Client,
    range: std::ops::Range<usize>,
) -> Result<Vec<String>, Fail> {
    create(client, range.map(pod_key).map(|(ns, name)| pod(&ns, &name))).await
}

/// Create `n` Pods of about `bytes` each (a large annotation) in namespace `ns`.
pub async fn create_big_pods(
    client: &Client,
    ns: &str,
    n: usize,
    bytes: usize,
) -> Result<Vec<String>, Fail> {
    ensure_namespace(client, ns).await?;
    let filler = "x".repeat(bytes);
    create(
        client,
        (0..n).map(|i| {
            let mut p = pod(ns, &format!("big-{i:05}"));
            p.metadata.annotations = Some([("e2e/filler".to_string(), filler.clone())].into());
            p
        }),
    )
    .await
}

async fn create(client: &Client, pods: impl Iterator<Item = Pod>) -> Result<Vec<String>, Fail> {
    futures::stream::iter(pods)
        .map(|p| {
            let ns = p.metadata.namespace.clone().unwrap_or_default();
            let api = Api::<Pod>::namespaced(client.clone(), &ns);
            async move {
                let p = api.create(&PostParams::default(), &p).await?;
                Ok::<_, Fail>(format!("{ns}/{}", p.metadata.name.unwrap_or_default()))
            }
        })
        .buffer_unordered(PARALLEL)
        .try_collect()
        .await
}

fn split(key: &str) -> (&str, &str) {
    key.split_once('/').expect("namespace/name")
}

/// Change a label of each Pod `keys` (a new resourceVersion each); returns the new versions.
pub async fn update_pods(
    client: &Client,
    keys: &[String],
) -> Result<BTreeMap<String, String>, Fail> {
    futures::stream::iter(keys.iter().cloned())
        .map(|key| {
            let client = client.clone();
            async move {
                let (ns, name) = split(&key);
                let patch = json!({"metadata": {"labels": {"rev": uniq()}}});
                let p = Api::<Pod>::namespaced(client, ns)
                    .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await?;
                Ok::<_, Fail>((key, p.metadata.resource_version.unwrap_or_default()))
            }
        })
        .buffer_unordered(PARALLEL)
        .try_collect()
        .await
}

/// A fresh label value for each update.
fn uniq() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(1);
    N.fetch_add(1, Ordering::Relaxed).to_string()
}

/// Delete Pods `keys` (an unscheduled Pod goes at once).
pub async fn delete_pods(client: &Client, keys: &[String]) -> Result<(), Fail> {
    futures::stream::iter(keys.iter().cloned())
        .map(|key| {
            let client = client.clone();
            async move {
                let (ns, name) = split(&key);
                Api::<Pod>::namespaced(client, ns)
                    .delete(name, &DeleteParams::default().grace_period(0))
                    .await?;
                Ok::<_, Fail>(())
            }
        })
        .buffer_unordered(PARALLEL)
        .try_collect()
        .await
}

/// `namespace/name` → resourceVersion of every Pod on the server: now (a consistent
/// paginated LIST) or exactly at `rv`; `None` if `rv` was compacted away.
pub async fn server_pods(
    client: &Client,
    rv: Option<&str>,
) -> Result<Option<BTreeMap<String, String>>, Fail> {
    Ok(server_metas(client, rv).await?.map(|m| {
        m.into_iter()
            .map(|(k, m)| (k, m.resource_version.unwrap_or_default()))
            .collect()
    }))
}

/// `namespace/name` → metadata of every Pod on the server, as [`server_pods`] lists them.
pub async fn server_metas(
    client: &Client,
    rv: Option<&str>,
) -> Result<Option<BTreeMap<String, ObjectMeta>>, Fail> {
    let api = Api::<Pod>::all(client.clone());
    let mut out = BTreeMap::new();
    let mut lp = ListParams::default().limit(500);
    if let Some(rv) = rv {
        lp.resource_version = Some(rv.to_string());
        lp.version_match = Some(VersionMatch::Exact);
    }
    loop {
        let page = match api.list_metadata(&lp).await {
            Ok(p) => p,
            Err(kube::Error::Api(s)) if s.code == 410 && rv.is_some() => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        for p in page.items {
            let m = p.metadata;
            out.insert(meta_key(&m), m);
        }
        match page.metadata.continue_ {
            Some(c) if !c.is_empty() => {
                lp = ListParams::default().limit(500);
                lp.continue_token = Some(c);
            }
            _ => return Ok(Some(out)),
        }
    }
}

/// The server's Pods now.
pub async fn server_now(client: &Client) -> Result<BTreeMap<String, String>, Fail> {
    Ok(server_pods(client, None)
        .await?
        .expect("a LIST of now is never compacted"))
}

/// The store equals `want` object by object (keys and resourceVersions), and `get` finds
/// each of a sample.
pub fn same_as(store: &BTreeMap<String, String>, want: &BTreeMap<String, String>) -> Outcome {
    ensure(store == want, || common::diff("store", store, want))
}

/// Wait until the store equals the server now (polling with LISTs), then also compare the
/// store with the server exactly at the store's checkpoint where the server still has it.
pub async fn converge(reader: &Reader<Pod>, client: &Client) -> Outcome {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let want = server_now(client).await?;
        let have = common::store_versions(reader);
        if have == want {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            return same_as(&have, &want);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    at_checkpoint(reader, client).await
}

/// The store equals the server's collection at the store's checkpoint (when the server can
/// still list at it), and `Reader::len` and `get` agree with its iteration.
pub async fn at_checkpoint(reader: &Reader<Pod>, client: &Client) -> Outcome {
    let cp = reader
        .checkpoint()
        .ok_or_else(|| Fail::Diverged("a synced store has no checkpoint".into()))?;
    let have = common::store_versions(reader);
    if let Some(want) = server_pods(client, Some(&cp)).await? {
        same_as(&have, &want).map_err(|e| match e {
            Fail::Diverged(m) => Fail::Diverged(format!("at checkpoint {cp}: {m}")),
            e => e,
        })?;
    }
    ensure(reader.len() == have.len(), || {
        format!(
            "Reader::len {} but {} objects iterated",
            reader.len(),
            have.len()
        )
    })?;
    for k in have.keys().step_by(97) {
        let (ns, name) = split(k);
        ensure(reader.get_named(Some(ns), name)?.is_some(), || {
            format!("get({k}) is None")
        })?;
    }
    Ok(())
}

/// The keys of `map` whose index is a multiple of `every`, skipping `offset` first.
pub fn pick(map: &BTreeMap<String, String>, offset: usize, every: usize, n: usize) -> Vec<String> {
    map.keys()
        .skip(offset)
        .step_by(every)
        .take(n)
        .cloned()
        .collect()
}

/// Create (or change) the probe Pod `e2e-0/probe`; returns its new resourceVersion. A store
/// that delivered this version has delivered every change made before it.
pub async fn touch_probe(client: &Client) -> Result<String, Fail> {
    let (ns, name) = crate::child::PROBE.split_once('/').expect("namespace/name");
    let api = Api::<Pod>::namespaced(client.clone(), ns);
    let p = match api.get_opt(name).await? {
        None => api.create(&PostParams::default(), &pod(ns, name)).await?,
        Some(_) => {
            let patch = json!({"metadata": {"labels": {"rev": uniq()}}});
            api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await?
        }
    };
    p.metadata
        .resource_version
        .ok_or_else(|| error("the probe Pod has no resourceVersion"))
}

/// Open (or reopen) the Pod store `pods` at `dir` on `engine`, watching all namespaces.
pub fn open_pods(
    server: &Server,
    dir: impl AsRef<std::path::Path>,
    engine: kube_persist::Engine,
    config: kube_persist::StreamConfig,
) -> Result<(kube_persist::Db, Reader<Pod>, kube_persist::Watcher<Pod>), Fail> {
    let db = common::try_open_db(engine, dir)?;
    let (reader, watcher) = db.store("pods", Api::<Pod>::all(server.client.clone()), config)?;
    Ok((db, reader, watcher))
}

/// `namespace/name` of an object.
pub fn meta_key(m: &ObjectMeta) -> String {
    let (ns, name) = (m.namespace.as_deref(), m.name.as_deref());
    format!("{}/{}", ns.unwrap_or_default(), name.unwrap_or_default())
}
