//! The delta relist where it meets a real deployment, against the real kube-apiserver (on
//! the server with the watch cache off for Pods and ClusterRoles, so that a resume from a
//! compacted checkpoint gets 410 at once):
//!
//! - `delta-relist-rbac`: `deploy/rbac.yaml` applied for real; a Pod store of its namespace
//!   run as its ServiceAccount (impersonated; it may not `get` a Pod), and again as a
//!   ServiceAccount granted only `list` and `watch` on Pods, each with the default relist
//!   mode: closed, Pods changed, etcd compacted, reopened. Each relists by delta without a
//!   GET or a fallback, reaches caught up and equals the server.
//! - `delta-relist-node`: the per-node agent, a store of `spec.nodeName=n1` Pods in
//!   `RelistMode::Delta`: a Pod (a StatefulSet's, by its stable name) deleted and recreated
//!   on n2 after its metadata page was listed and before its fetch is not kept by n1's
//!   store, which ends equal to the server's n1 Pods.
//! - `delta-relist-names`: a ClusterRole store whose objects have names a URL path or a
//!   field selector must escape (`?`, `#`, a space, `,`, `=`, `\`, non-ASCII) relists by
//!   delta, fetches each changed one by its exact name, and equals the server.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::rbac::v1::ClusterRole;
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube_persist::{Db, Reader, RelistMode, StreamConfig, SyncPhase};
use kube_persist_testkit::realk8s::request_count;

use crate::common::{self, Driven, Ev, drive};
use crate::support::*;

fn config(mode: RelistMode, page: u32) -> StreamConfig {
    StreamConfig::default()
        .page_size(page)
        .relist_mode(mode)
        .backoff(Duration::from_millis(20), Duration::from_millis(500))
        .relist_jitter(Duration::ZERO)
}

/// Poll `f` (every 10 ms) until it holds; an error naming `what` and `detail()` after
/// [`WAIT`].
async fn wait_for(what: &str, mut f: impl FnMut() -> bool, detail: impl Fn() -> String) -> Outcome {
    let deadline = Instant::now() + WAIT;
    while !f() {
        if Instant::now() > deadline {
            return Err(error(format!("timed out waiting for {what}: {}", detail())));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// A store of `api` at `dir` (the child engine), its watcher driven.
fn open<K>(
    dir: &std::path::Path,
    name: &str,
    api: Api<K>,
    cfg: StreamConfig,
) -> Result<(Db, Reader<K>, Driven), Fail>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + serde::Serialize
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let db = common::try_open_db(common::child_engine(), dir)?;
    let (reader, watcher) = db.store(name, api, cfg)?;
    Ok((db, reader, drive(watcher)))
}

/// Stop the watcher, flush and close the store.
async fn close<K>(db: Db, reader: Reader<K>, w: Driven) -> Outcome {
    w.stop().await;
    db.flush()?;
    drop((reader, db));
    Ok(())
}

/// Wait until a reopened store has relisted and caught up with the server.
async fn relisted<K>(reader: &Reader<K>) -> Outcome
where
    K: kube::Resource + serde::de::DeserializeOwned + Send + Sync + 'static,
{
    wait_for(
        "the relist to end and the store to catch up",
        || {
            reader.stats().relists >= 1
                && reader.phase() == SyncPhase::Synced
                && reader.is_caught_up()
        },
        || format!("{:?} {:?}", reader.phase(), reader.stats()),
    )
    .await
}

/// `name` → resourceVersion of what `api` lists with `lp`.
async fn versions<K>(api: &Api<K>, lp: &ListParams) -> Result<BTreeMap<String, String>, Fail>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    Ok(api
        .list(lp)
        .await?
        .items
        .into_iter()
        .map(|o| {
            let v = o.meta().resource_version.clone().unwrap_or_default();
            (common::key(&o), v)
        })
        .collect())
}

fn pod(name: &str, node: Option<&str>) -> Result<Pod, Fail> {
    let mut p = serde_json::json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"kp-e2e": "delta-seams"}},
        "spec": {"containers": [{"name": "c", "image": "example.invalid/c:1"}]}});
    // `delta-relist-rbac` creates them in deploy/'s namespace, which enforces `restricted`.
    crate::pod_security::restricted(&mut p);
    if let Some(node) = node {
        p["spec"]["nodeName"] = node.into();
    }
    serde_json::from_value(p).map_err(|e| error(e.to_string()))
}

/// Annotate `name` (a new resourceVersion).
async fn touch<K>(api: &Api<K>, name: &str, round: usize) -> Outcome
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let patch =
        serde_json::json!({"metadata": {"annotations": {"kp-e2e/round": round.to_string()}}});
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

/// The admin's configuration, from the server's kubeconfig.
async fn admin_config(server: &Server) -> Result<kube::Config, Fail> {
    let kubeconfig = kube::config::Kubeconfig::read_from(&server.kubeconfig)
        .map_err(|e| error(format!("reading {}: {e}", server.kubeconfig.display())))?;
    kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .map_err(|e| error(format!("kubeconfig: {e}")))
}

/// A client of the admin impersonating `user`.
fn as_user(admin: &kube::Config, user: &str) -> Result<kube::Client, Fail> {
    let mut cfg = admin.clone();
    cfg.auth_info.impersonate = Some(user.to_string());
    kube::Client::try_from(cfg).map_err(|e| error(format!("client: {e}")))
}

/// `delta-relist-rbac`: see the module's doc.
pub async fn rbac(server: Arc<Server>) -> Outcome {
    let admin = admin_config(&server).await?;
    let docs: Vec<_> = crate::deploy::documents(&crate::deploy::deploy_dir())
        .map_err(error)?
        .into_iter()
        .filter(|(at, _)| at.starts_with("namespace.yaml") || at.starts_with("rbac.yaml"))
        .collect();
    crate::deploy::apply(server.client.clone(), &docs, false)
        .await
        .map_err(error)?;
    let sa = |d: &serde_json::Value| d["kind"] == "ServiceAccount";
    let operator = docs
        .iter()
        .find(|(_, d)| sa(d))
        .map(|(_, d)| d.clone())
        .ok_or_else(|| error("no ServiceAccount in rbac.yaml"))?;
    let ns = operator["metadata"]["namespace"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let operator_user = format!(
        "system:serviceaccount:{ns}:{}",
        operator["metadata"]["name"].as_str().unwrap_or_default()
    );
    // A ServiceAccount granted only what a store needs: list and watch.
    let store_only = serde_json::json!([
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": "kp-e2e-store-only", "namespace": ns}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": "kp-e2e-store-only"},
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "kp-e2e-store-only"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "kp-e2e-store-only"},
         "subjects": [{"kind": "ServiceAccount", "name": "kp-e2e-store-only", "namespace": ns}]}
    ]);
    let store_only: Vec<(String, serde_json::Value)> = store_only
        .as_array()
        .into_iter()
        .flatten()
        .map(|d| ("store-only".to_string(), d.clone()))
        .collect();
    crate::deploy::apply(server.client.clone(), &store_only, false)
        .await
        .map_err(error)?;
    let store_only_user = format!("system:serviceaccount:{ns}:kp-e2e-store-only");

    let pods = Api::<Pod>::namespaced(server.client.clone(), &ns);
    let names: Vec<String> = (0..100).map(|i| format!("relist-{i:03}")).collect();
    for name in &names {
        pods.create(&PostParams::default(), &pod(name, None)?)
            .await?;
    }
    let mut summary = Vec::new();
    for (round, (who, user)) in [
        ("shipped RBAC", &operator_user),
        ("list and watch only", &store_only_user),
    ]
    .into_iter()
    .enumerate()
    {
        let client = as_user(&admin, user)?;
        let mine = Api::<Pod>::namespaced(client, &ns);
        let refused =
            matches!(mine.get(&names[0]).await, Err(kube::Error::Api(ref s)) if s.code == 403);
        ensure(refused, || format!("{who}: a Pod get is not refused"))?;
        let dir = tempfile::tempdir()?;
        let cfg = || config(RelistMode::Auto, 50);
        let (db, reader, mut w) = open(dir.path(), "pods", mine.clone(), cfg())?;
        w.until(|e| *e == Ev::InitDone).await;
        close(db, reader, w).await?;
        // 2 updated, 1 deleted, 1 created: a few % of each page, so Auto relists by delta.
        touch(&pods, &names[10 + round], round).await?;
        touch(&pods, &names[70 + round], round).await?;
        pods.delete(&names[40 + round], &DeleteParams::default())
            .await?;
        pods.create(
            &PostParams::default(),
            &pod(&format!("relist-new-{round}"), None)?,
        )
        .await?;
        server.with_guard(|g| g.compact())?;
        let gets = request_count(&server.client, "pods", "GET").await?;
        let (db, reader, w) = open(dir.path(), "pods", mine, cfg())?;
        relisted(&reader).await?;
        let s = reader.stats();
        let want = versions(&pods, &ListParams::default()).await?;
        same_as(&common::store_versions(&reader), &want)?;
        let gets = request_count(&server.client, "pods", "GET").await? - gets;
        ensure(
            s.delta_fallbacks == 0 && s.metadata_pages > 0 && s.bodies_fetched == 3 && gets == 0,
            || {
                format!(
                    "{who}: a delta relist with 3 fetches, no GET ({gets}) and no fallback: {s:?}"
                )
            },
        )?;
        close(db, reader, w).await?;
        summary.push(format!(
            "{who}: {} metadata pages, {} fetched, 0 GETs",
            s.metadata_pages, s.bodies_fetched
        ));
    }
    for name in names
        .iter()
        .chain(["relist-new-0".to_string(), "relist-new-1".to_string()].iter())
    {
        let _ = pods.delete(name, &DeleteParams::default()).await;
    }
    println!("e2e delta-relist-rbac: {}", summary.join("; "));
    Ok(())
}

/// `delta-relist-node`: see the module's doc.
pub async fn node(server: Arc<Server>) -> Outcome {
    let ns = "kp-e2e-node";
    ensure_namespace(&server.client, ns).await?;
    let pods = Api::<Pod>::namespaced(server.client.clone(), ns);
    // web-000 .. web-199 on n1, then web-200 .. web-239 on n2; the last of n1 is the one
    // recreated on n2.
    let name = |i: usize| format!("web-{i:03}");
    for i in 0..240 {
        let node = if i < 200 { "n1" } else { "n2" };
        pods.create(&PostParams::default(), &pod(&name(i), Some(node))?)
            .await?;
    }
    let moved = name(199);
    let dir = tempfile::tempdir()?;
    let cfg = || config(RelistMode::Delta, 10).fields("spec.nodeName=n1");
    let (db, reader, mut w) = open(dir.path(), "pods", pods.clone(), cfg())?;
    w.until(|e| *e == Ev::InitDone).await;
    close(db, reader, w).await?;
    // Every n1 Pod changes while the agent is down: each is fetched in the relist.
    for i in 0..200 {
        touch(&pods, &name(i), 1).await?;
    }
    server.with_guard(|g| g.compact())?;
    let (db, reader, w) = open(dir.path(), "pods", pods.clone(), cfg())?;
    wait_for(
        "the first metadata page",
        || reader.stats().metadata_pages >= 1,
        || format!("{:?}", reader.stats()),
    )
    .await?;
    // The StatefulSet's Pod is deleted and recreated on another node, under the same name.
    let force = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    pods.delete(&moved, &force).await?;
    let recreated_at_page = reader.stats().metadata_pages;
    pods.create(&PostParams::default(), &pod(&moved, Some("n2"))?)
        .await?;
    relisted(&reader).await?;
    let n1 = ListParams::default().fields("spec.nodeName=n1");
    let want = versions(&pods, &n1).await?;
    let store = common::store_versions(&reader);
    ensure(!store.contains_key(&format!("{ns}/{moved}")), || {
        format!("{moved}, recreated on n2 before its fetch, is still in n1's store")
    })?;
    same_as(&store, &want)?;
    let s = reader.stats();
    ensure(recreated_at_page < 20, || {
        format!("the relist passed {moved}'s page before it moved: {s:?}")
    })?;
    close(db, reader, w).await?;
    for i in 0..240 {
        let _ = pods.delete(&name(i), &force).await;
    }
    println!(
        "e2e delta-relist-node: {moved} moved to n2 after metadata page {recreated_at_page}; n1's store equals the server's {} Pods ({} fetched)",
        want.len(),
        s.bodies_fetched
    );
    Ok(())
}

/// Names a path segment or a field selector value must escape (RBAC names allow all but
/// `/` and `%`).
const ODD_NAMES: &[&str] = &[
    "kp-e2e:a?b",
    "kp-e2e:a#b",
    "kp-e2e:a b",
    "kp-e2e:a,b=c",
    "kp-e2e:x\\y",
    "kp-e2e:système-ü",
    "kp-e2e:a&b=c%",
];

/// Annotate ClusterRole `name` with a PATCH whose path carries the name percent-encoded
/// (kube's `Api::patch` formats the name into the path as it is).
async fn touch_by_path(client: &kube::Client, name: &str) -> Outcome {
    let mut segment = String::new();
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~:".contains(&b) {
            segment.push(b as char);
        } else {
            segment.push_str(&format!("%{b:02X}"));
        }
    }
    let patch = serde_json::json!({"metadata": {"annotations": {"kp-e2e/round": "1"}}});
    let req = http::Request::builder()
        .method("PATCH")
        .uri(format!(
            "/apis/rbac.authorization.k8s.io/v1/clusterroles/{segment}"
        ))
        .header("Content-Type", "application/merge-patch+json")
        .body(serde_json::to_vec(&patch).map_err(|e| error(e.to_string()))?)
        .map_err(|e| error(format!("PATCH {name:?}: {e}")))?;
    let role: ClusterRole = client.request(req).await?;
    ensure(role.metadata.name.as_deref() == Some(name), || {
        format!("PATCH {name:?} changed {:?}", role.metadata.name)
    })
}

/// `delta-relist-names`: see the module's doc.
pub async fn names(server: Arc<Server>) -> Outcome {
    let roles = Api::<ClusterRole>::all(server.client.clone());
    // `%` is refused in RBAC names: the last is kept only if the server takes it.
    let mut odd = Vec::new();
    for (i, name) in ODD_NAMES
        .iter()
        .copied()
        .chain((0..20).map(|_| ""))
        .enumerate()
    {
        let name = if name.is_empty() {
            format!("kp-e2e:plain-{i:02}")
        } else {
            name.to_string()
        };
        let role: ClusterRole = serde_json::from_value(serde_json::json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": name, "labels": {"kp-e2e": "names"}},
            "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]}]}))
        .map_err(|e| error(e.to_string()))?;
        match roles.create(&PostParams::default(), &role).await {
            Ok(_) if i < ODD_NAMES.len() => odd.push(name),
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 422 && name.contains('%') => {}
            Err(e) => return Err(error(format!("creating ClusterRole {name:?}: {e}"))),
        }
    }
    let dir = tempfile::tempdir()?;
    let cfg = || config(RelistMode::Delta, 5).labels("kp-e2e=names");
    let (db, reader, mut w) = open(dir.path(), "clusterroles", roles.clone(), cfg())?;
    w.until(|e| *e == Ev::InitDone).await;
    close(db, reader, w).await?;
    for name in &odd {
        touch_by_path(&server.client, name).await?;
    }
    server.with_guard(|g| g.compact())?;
    let (db, reader, w) = open(dir.path(), "clusterroles", roles.clone(), cfg())?;
    relisted(&reader).await?;
    let want = versions(&roles, &ListParams::default().labels("kp-e2e=names")).await?;
    same_as(&common::store_versions(&reader), &want)?;
    let s = reader.stats();
    ensure(
        s.bodies_fetched == odd.len() as u64 && s.delta_fallbacks == 0 && s.errors == 0,
        || {
            format!(
                "{} renamed-for-escaping roles fetched by name: {s:?}",
                odd.len()
            )
        },
    )?;
    close(db, reader, w).await?;
    let _ = roles
        .delete_collection(
            &DeleteParams::default(),
            &ListParams::default().labels("kp-e2e=names"),
        )
        .await;
    println!(
        "e2e delta-relist-names: {} ClusterRoles with names to escape fetched by name, store equals the server's {}",
        odd.len(),
        want.len()
    );
    Ok(())
}
