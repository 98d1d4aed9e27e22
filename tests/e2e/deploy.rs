//! The `deploy/` manifests checked against a real API server (issue 27, item 5): every YAML
//! document under `deploy/` (subfolders included) is applied with server-side apply in dry
//! run (`dryRun=All`) and strict field validation, so the server runs its defaulting,
//! validation and admission on it (RBAC included) and refuses unknown or misspelled fields,
//! without persisting anything.
//!
//! The only real write of [`manifests_accepted`]: a namespace the manifests put objects in
//! is created when it does not exist, because the server refuses a namespaced object in a
//! missing namespace even in dry run (and a dry-run Namespace is not persisted).
//!
//! [`rbac_suffices`] applies the RBAC for real and runs the example operator as its
//! ServiceAccount: the least RBAC is also enough.

use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams, ValidationDirective};
use kube::core::GroupVersionKind;
use kube::discovery::{Discovery, Scope};
use serde_json::Value;

/// The example operator the manifests run.
#[path = "../../examples/operator.rs"]
#[allow(dead_code)]
pub mod operator;

/// The field manager of the dry-run applies.
const MANAGER: &str = "kube-persist-e2e";

/// The manifests folder of the repository.
pub fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy")
}

/// Every YAML document under `dir` (files ending `.yaml` or `.yml`, subfolders included,
/// in path order), each with `file#index` for messages; empty documents are skipped.
pub fn documents(dir: &Path) -> Result<Vec<(String, Value)>, String> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        let entries = std::fs::read_dir(&d).map_err(|e| format!("{}: {e}", d.display()))?;
        for entry in entries {
            let path = entry.map_err(|e| format!("{}: {e}", d.display()))?.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|x| x == "yaml" || x == "yml") {
                files.push(path);
            }
        }
    }
    files.sort();
    let mut out = Vec::new();
    for file in files {
        let text =
            std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        let docs: Vec<Value> = serde_saphyr::from_multiple(&text)
            .map_err(|e| format!("{}: not YAML: {e}", file.display()))?;
        let name = file
            .strip_prefix(dir)
            .unwrap_or(&file)
            .display()
            .to_string();
        for (i, doc) in docs.into_iter().enumerate() {
            if !doc.is_null() {
                out.push((format!("{name}#{i}"), doc));
            }
        }
    }
    Ok(out)
}

/// Reads every manifest under `deploy/` and applies each with `dryRun=All`; returns how
/// many the server accepted, or the first refusal (`file#doc Kind/name: <server message>`).
pub async fn manifests_accepted(client: kube::Client) -> Result<usize, String> {
    let docs = documents(&deploy_dir())?;
    if docs.is_empty() {
        return Err(format!("no manifest under {}", deploy_dir().display()));
    }
    documents_accepted(client, &docs).await
}

/// Applies `docs` (`(where, object)`) with `dryRun=All` and strict field validation, in
/// order; see the module docs.
pub async fn documents_accepted(
    client: kube::Client,
    docs: &[(String, Value)],
) -> Result<usize, String> {
    apply(client, docs, true).await
}

/// Server-side apply of `docs` in order, strict field validation, in dry run or for real.
pub async fn apply(
    client: kube::Client,
    docs: &[(String, Value)],
    dry_run: bool,
) -> Result<usize, String> {
    let discovery = Discovery::new(client.clone())
        .run()
        .await
        .map_err(|e| format!("API discovery: {e}"))?;
    let mut params = PatchParams::apply(MANAGER);
    params.dry_run = dry_run;
    params.field_validation = Some(ValidationDirective::Strict);
    let mut accepted = 0;
    for (at, doc) in docs {
        let str_at = |ptr: &str| doc.pointer(ptr).and_then(Value::as_str);
        let (Some(api_version), Some(kind), Some(name)) = (
            str_at("/apiVersion"),
            str_at("/kind"),
            str_at("/metadata/name"),
        ) else {
            return Err(format!("{at}: no apiVersion, kind or metadata.name"));
        };
        let what = format!("{at} {kind}/{name}");
        let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
        let gvk = GroupVersionKind::gvk(group, version, kind);
        let Some((resource, caps)) = discovery.resolve_gvk(&gvk) else {
            return Err(format!("{what}: the server serves no {api_version} {kind}"));
        };
        let api: Api<DynamicObject> = match caps.scope {
            Scope::Cluster => Api::all_with(client.clone(), &resource),
            Scope::Namespaced => {
                let Some(ns) = str_at("/metadata/namespace") else {
                    return Err(format!("{what}: a namespaced object without a namespace"));
                };
                ensure_namespace(&client, ns).await?;
                Api::namespaced_with(client.clone(), ns, &resource)
            }
        };
        let back = api
            .patch(name, &params, &Patch::Apply(doc))
            .await
            .map_err(|e| match e {
                kube::Error::Api(s) => format!("{what}: refused ({}): {}", s.code, s.message),
                other => format!("{what}: {other}"),
            })?;
        if back.metadata.name.as_deref() != Some(name) {
            return Err(format!(
                "{what}: the server answered {:?}",
                back.metadata.name
            ));
        }
        accepted += 1;
    }
    Ok(accepted)
}

/// Creates namespace `ns` (for real) unless it exists.
async fn ensure_namespace(client: &kube::Client, ns: &str) -> Result<(), String> {
    let api = Api::<Namespace>::all(client.clone());
    match api.get_opt(ns).await {
        Ok(Some(_)) => Ok(()),
        Ok(None) => {
            let mut n = Namespace::default();
            n.metadata.name = Some(ns.to_string());
            match api.create(&PostParams::default(), &n).await {
                Ok(_) => Ok(()),
                // Created meanwhile by another test: fine.
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
                Err(e) => Err(format!("creating namespace {ns}: {e}")),
            }
        }
        Err(e) => Err(format!("reading namespace {ns}: {e}")),
    }
}

/// The RBAC of `deploy/rbac.yaml` is enough for the operator: applies `namespace.yaml` and
/// `rbac.yaml` for real, creates two Pods in that namespace, and runs the example operator's
/// persistent controller (`examples/operator.rs`) as the ServiceAccount (impersonated from
/// `admin`, a configuration allowed to impersonate) until it has labeled both; the
/// ServiceAccount's `get` of a Pod must be refused (403), a verb the operator does not use.
/// Returns a summary line, or what failed. Leaves the namespace and the RBAC objects (a
/// namespace never finishes terminating without a controller-manager) and deletes the Pods.
pub async fn rbac_suffices(admin: kube::Config) -> Result<String, String> {
    use futures::StreamExt;
    use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
    let client = kube::Client::try_from(admin.clone()).map_err(|e| format!("client: {e}"))?;
    let docs: Vec<_> = documents(&deploy_dir())?
        .into_iter()
        .filter(|(at, _)| at.starts_with("namespace.yaml") || at.starts_with("rbac.yaml"))
        .collect();
    apply(client.clone(), &docs, false).await?;
    let sa = docs
        .iter()
        .find(|(_, d)| d["kind"] == "ServiceAccount")
        .map(|(_, d)| serde_json::from_value::<ServiceAccount>(d.clone()))
        .ok_or("no ServiceAccount in rbac.yaml")?
        .map_err(|e| format!("ServiceAccount: {e}"))?;
    let ns = sa.metadata.namespace.clone().unwrap_or_default();
    let user = format!(
        "system:serviceaccount:{ns}:{}",
        sa.metadata.name.unwrap_or_default()
    );
    let pods = Api::<Pod>::namespaced(client.clone(), &ns);
    for (name, owner) in [("rbac-owned", Some("web-1")), ("rbac-bare", None)] {
        let mut pod = serde_json::json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name},
            // The namespace enforces Pod Security `restricted` (deploy/namespace.yaml).
            "spec": {"securityContext": {"runAsNonRoot": true, "runAsUser": 65532,
                    "seccompProfile": {"type": "RuntimeDefault"}},
                "containers": [{"name": "c", "image": "example.invalid/c:1",
                    "securityContext": {"allowPrivilegeEscalation": false,
                        "capabilities": {"drop": ["ALL"]}}}]}});
        if let Some(owner) = owner {
            pod["metadata"]["ownerReferences"] = serde_json::json!([{"apiVersion": "apps/v1",
                "kind": "ReplicaSet", "name": owner, "controller": true,
                "uid": "0b1c2d3e-0000-4000-8000-000000000001"}]);
        }
        let pod: Pod = serde_json::from_value(pod).map_err(|e| e.to_string())?;
        pods.create(&PostParams::default(), &pod)
            .await
            .map_err(|e| format!("creating pod {name}: {e}"))?;
    }
    let mut as_sa = admin;
    as_sa.auth_info.impersonate = Some(user.clone());
    let as_sa = kube::Client::try_from(as_sa).map_err(|e| format!("client: {e}"))?;
    let get = Api::<Pod>::namespaced(as_sa.clone(), &ns)
        .get("rbac-bare")
        .await;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let db = kube_persist::Db::open(dir.path().join("store")).map_err(|e| e.to_string())?;
    let ctx = operator::Ctx::new(as_sa.clone());
    let controller = operator::persistent_controller(&db, as_sa.clone())
        .map_err(|e| format!("controller: {e}"))?;
    let errors = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let sink = errors.clone();
    let run = controller.run(operator::reconcile, operator::error_policy, ctx.clone());
    let task = tokio::spawn(run.for_each(move |r| {
        if let Err(e) = r {
            sink.lock().unwrap().push(e.to_string());
        }
        async {}
    }));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let outcome = loop {
        let list = pods
            .list(&Default::default())
            .await
            .map_err(|e| e.to_string())?;
        let mine: Vec<&Pod> = list
            .items
            .iter()
            .filter(|p| {
                p.metadata
                    .name
                    .as_deref()
                    .is_some_and(|n| n.starts_with("rbac-"))
            })
            .collect();
        if mine.len() == 2 && mine.iter().all(|p| operator::is_labeled(p)) {
            break Ok(());
        }
        if std::time::Instant::now() > deadline {
            break Err(format!(
                "as {user}, the operator did not label both pods in 60 s; its errors: {:?}",
                errors.lock().unwrap().iter().take(3).collect::<Vec<_>>()
            ));
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    task.abort();
    for name in ["rbac-owned", "rbac-bare"] {
        let _ = pods.delete(name, &Default::default()).await;
    }
    outcome?;
    // `get` of its own StatefulSet only (--shards-from): not found here (not applied for
    // real) rather than refused; another StatefulSet's is refused.
    {
        use k8s_openapi::api::apps::v1::StatefulSet;
        let sets = Api::<StatefulSet>::namespaced(as_sa.clone(), &ns);
        match sets.get("kube-persist-operator").await {
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Ok(_) => {}
            other => return Err(format!("as {user}, get of its StatefulSet: {other:?}")),
        }
        match sets.get("another-statefulset").await {
            Err(kube::Error::Api(s)) if s.code == 403 => {}
            other => {
                return Err(format!(
                    "as {user}, get of another StatefulSet was not refused: {other:?}"
                ));
            }
        }
    }
    match get {
        Err(kube::Error::Api(s)) if s.code == 403 => Ok(format!(
            "as {user}: both pods labeled with list/watch/update ({} writes); get refused (403); its StatefulSet readable, another refused",
            ctx.writes.load(std::sync::atomic::Ordering::Relaxed)
        )),
        other => Err(format!(
            "as {user}, get of a pod was not refused: {other:?}"
        )),
    }
}
