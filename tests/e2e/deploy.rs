//! The `deploy/` manifests checked against a real API server (issue 27, item 5): every YAML
//! document under `deploy/` (subfolders included, `deploy/monitoring/` excepted:
//! [`NOT_MANIFESTS`]) is applied with server-side apply in dry
//! run (`dryRun=All`) and strict field validation, so the server runs its defaulting,
//! validation and admission on it (RBAC included) and refuses unknown or misspelled fields,
//! without persisting anything.
//!
//! The only real write of [`manifests_accepted`]: a namespace the manifests put objects in
//! is created when it does not exist, because the server refuses a namespaced object in a
//! missing namespace even in dry run (and a dry-run Namespace is not persisted).
//!
//! [`rbac_suffices`] applies the RBAC and the admission policy for real and runs the example
//! operator as its ServiceAccount: the least RBAC is also enough, and the policy admits the
//! operator's writes. [`policy_holds`] checks, as that ServiceAccount, that the policy of
//! `deploy/admission-policy.yaml` admits a patch of the owner label and refuses any other
//! change of a Pod (its image, its ownerReferences, another label) with the policy's
//! message, and that RBAC refuses an `update`.

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

/// The subfolders of `deploy/` that hold no manifests for the API server, skipped by
/// [`documents`]: `monitoring/` holds a Prometheus rules file and its unit tests (not
/// Kubernetes objects), a Grafana dashboard, and prometheus-operator objects (PodMonitor,
/// PrometheusRule) whose CRDs a bare API server does not serve; `tests/monitoring.rs`
/// checks them with promtool.
pub const NOT_MANIFESTS: &[&str] = &["monitoring"];

/// Every YAML document under `dir` (files ending `.yaml` or `.yml`, subfolders included,
/// in path order, [`NOT_MANIFESTS`] excepted), each with `file#index` for messages; empty
/// documents are skipped.
pub fn documents(dir: &Path) -> Result<Vec<(String, Value)>, String> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        let entries = std::fs::read_dir(&d).map_err(|e| format!("{}: {e}", d.display()))?;
        for entry in entries {
            let path = entry.map_err(|e| format!("{}: {e}", d.display()))?.path();
            if path.is_dir() {
                let skipped = d == dir
                    && path
                        .file_name()
                        .is_some_and(|n| NOT_MANIFESTS.iter().any(|m| n == *m));
                if !skipped {
                    dirs.push(path);
                }
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

/// The documents that decide what the operator's ServiceAccount may do: `namespace.yaml`,
/// `rbac.yaml`, and every ValidatingAdmissionPolicy and binding under `deploy/`.
pub fn access_documents() -> Result<Vec<(String, Value)>, String> {
    Ok(documents(&deploy_dir())?
        .into_iter()
        .filter(|(at, d)| {
            at.starts_with("namespace.yaml")
                || at.starts_with("rbac.yaml")
                || d["kind"] == "ValidatingAdmissionPolicy"
                || d["kind"] == "ValidatingAdmissionPolicyBinding"
        })
        .collect())
}

/// The ServiceAccount of `rbac.yaml` among `docs`: its namespace and its user name
/// (`system:serviceaccount:<namespace>:<name>`).
fn service_account(docs: &[(String, Value)]) -> Result<(String, String), String> {
    use k8s_openapi::api::core::v1::ServiceAccount;
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
    Ok((ns, user))
}

/// The messages of the validations of every ValidatingAdmissionPolicy among `docs`.
fn policy_messages(docs: &[(String, Value)]) -> Vec<String> {
    docs.iter()
        .filter(|(_, d)| d["kind"] == "ValidatingAdmissionPolicy")
        .flat_map(|(_, d)| {
            d["spec"]["validations"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|v| v["message"].as_str().map(str::to_string))
        .collect()
}

/// A client of `admin`'s server that acts as `user` (impersonated: `admin` may).
fn impersonating(admin: &kube::Config, user: &str) -> Result<kube::Client, String> {
    let mut config = admin.clone();
    config.auth_info.impersonate = Some(user.to_string());
    kube::Client::try_from(config).map_err(|e| format!("client: {e}"))
}

/// A Pod of `deploy/`'s namespace (which enforces Pod Security `restricted`), owned by
/// ReplicaSet `owner` when given.
pub fn test_pod(
    name: &str,
    owner: Option<&str>,
) -> Result<k8s_openapi::api::core::v1::Pod, String> {
    let mut pod = serde_json::json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "kube-persist-e2e"}},
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
    serde_json::from_value(pod).map_err(|e| e.to_string())
}

/// Waits until the admission policy is in force for `as_sa` (kube-apiserver loads a new
/// policy and binding asynchronously): a dry-run change of an annotation of Pod `name`
/// by the ServiceAccount is refused with one of `messages`. Errs after 60 s, or at once
/// when the server refuses it otherwise.
async fn policy_in_force(
    as_sa: &kube::Client,
    ns: &str,
    name: &str,
    messages: &[String],
) -> Result<(), String> {
    use k8s_openapi::api::core::v1::Pod;
    let pods = Api::<Pod>::namespaced(as_sa.clone(), ns);
    let dry = PatchParams::default().dry_run();
    let probe =
        serde_json::json!({"metadata": {"annotations": {"kube-persist.rs/e2e-probe": "1"}}});
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        match pods.patch(name, &dry, &Patch::Merge(&probe)).await {
            Err(kube::Error::Api(s)) if messages.iter().any(|m| s.message.contains(m)) => {
                return Ok(());
            }
            Ok(_) => {}
            Err(e) => return Err(format!("the policy's probe (a dry-run patch): {e}")),
        }
        if std::time::Instant::now() > deadline {
            return Err(format!(
                "the admission policy is not in force after 60 s: a dry-run annotation patch of pod {ns}/{name} is still admitted"
            ));
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// The RBAC of `deploy/rbac.yaml` is enough for the operator: applies `namespace.yaml`,
/// `rbac.yaml` and the admission policy for real, creates two Pods in that namespace, waits
/// until the policy is in force, and runs the example operator's persistent controller
/// (`examples/operator.rs`) as the ServiceAccount (impersonated from `admin`, a
/// configuration allowed to impersonate) until it has labeled both, through the policy;
/// the ServiceAccount's `get` of a Pod must be refused (403), a verb the operator does not
/// use. Returns a summary line, or what failed. Leaves the namespace, the RBAC objects and
/// the policy (a namespace never finishes terminating without a controller-manager) and
/// deletes the Pods.
pub async fn rbac_suffices(admin: kube::Config) -> Result<String, String> {
    use futures::StreamExt;
    use k8s_openapi::api::core::v1::Pod;
    let client = kube::Client::try_from(admin.clone()).map_err(|e| format!("client: {e}"))?;
    let docs = access_documents()?;
    apply(client.clone(), &docs, false).await?;
    let (ns, user) = service_account(&docs)?;
    let messages = policy_messages(&docs);
    if messages.is_empty() {
        return Err("no ValidatingAdmissionPolicy (with a message) under deploy/".into());
    }
    let pods = Api::<Pod>::namespaced(client.clone(), &ns);
    for (name, owner) in [("rbac-owned", Some("web-1")), ("rbac-bare", None)] {
        pods.create(&PostParams::default(), &test_pod(name, owner)?)
            .await
            .map_err(|e| format!("creating pod {name}: {e}"))?;
    }
    let as_sa = impersonating(&admin, &user)?;
    policy_in_force(&as_sa, &ns, "rbac-bare", &messages).await?;
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
            "as {user}: both pods labeled with list/watch/patch through the admission policy ({} writes); get refused (403); its StatefulSet readable, another refused",
            ctx.writes.load(std::sync::atomic::Ordering::Relaxed)
        )),
        other => Err(format!(
            "as {user}, get of a pod was not refused: {other:?}"
        )),
    }
}

/// The admission policy of `deploy/` holds the operator's ServiceAccount to its label:
/// applies `namespace.yaml`, `rbac.yaml` and the policy for real, creates a Pod owned by a
/// ReplicaSet, waits until the policy is in force, then, as the ServiceAccount
/// (impersonated), checks that
/// - the operator's own label patch (`operator::label_patch`, a merge patch of the label
///   with the resourceVersion precondition) is admitted, and sets the label;
/// - the same patch at the old resourceVersion is refused with 409 Conflict;
/// - a change of the container's image, of the ownerReferences and of another label are
///   each refused (403) with the policy's message, and the Pod is left as it was;
/// - an `update` (PUT) of the Pod is refused (403): rbac.yaml grants `patch` only;
///
/// and that the admin may still change the image (the policy binds that ServiceAccount
/// alone). Returns a summary line, or what failed; deletes the Pod.
pub async fn policy_holds(admin: kube::Config) -> Result<String, String> {
    use k8s_openapi::api::core::v1::Pod;
    let client = kube::Client::try_from(admin.clone()).map_err(|e| format!("client: {e}"))?;
    let docs = access_documents()?;
    apply(client.clone(), &docs, false).await?;
    let (ns, user) = service_account(&docs)?;
    let messages = policy_messages(&docs);
    let name = "admission-target";
    let pods = Api::<Pod>::namespaced(client.clone(), &ns);
    let created = pods
        .create(&PostParams::default(), &test_pod(name, Some("web-1"))?)
        .await
        .map_err(|e| format!("creating pod {name}: {e}"))?;
    let as_sa = impersonating(&admin, &user)?;
    let outcome = policy_checks(&pods, &as_sa, &created, &user, &messages).await;
    let _ = pods.delete(name, &Default::default()).await;
    outcome
}

/// [`policy_holds`]'s checks on Pod `created`.
async fn policy_checks(
    pods: &Api<k8s_openapi::api::core::v1::Pod>,
    as_sa: &kube::Client,
    created: &k8s_openapi::api::core::v1::Pod,
    user: &str,
    messages: &[String],
) -> Result<String, String> {
    use k8s_openapi::api::core::v1::Pod;
    use kube::ResourceExt;
    let (ns, name) = (created.namespace().unwrap_or_default(), created.name_any());
    // With no policy under deploy/ there is nothing to wait for: the checks below then
    // find the ServiceAccount's changes admitted.
    if !messages.is_empty() {
        policy_in_force(as_sa, &ns, &name, messages).await?;
    }
    let sa_pods = Api::<Pod>::namespaced(as_sa.clone(), &ns);
    let params = PatchParams::default();
    // The operator's own write.
    let owner = operator::wanted_owner(created);
    let label = operator::label_patch(created.resource_version().as_deref(), &owner);
    let labeled = sa_pods
        .patch(&name, &params, &Patch::Merge(&label))
        .await
        .map_err(|e| format!("as {user}, the operator's label patch was refused: {e}"))?;
    if !operator::is_labeled(&labeled) {
        return Err(format!(
            "as {user}, the label patch was admitted but the Pod's labels are {:?}",
            labeled.labels()
        ));
    }
    // The precondition: the same patch at the old resourceVersion is a conflict.
    let stale = operator::label_patch(created.resource_version().as_deref(), "stale");
    match sa_pods.patch(&name, &params, &Patch::Merge(&stale)).await {
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        other => {
            return Err(format!(
                "as {user}, a label patch at a stale resourceVersion was not a 409 Conflict: {:?}",
                other.map(|p| p.labels().clone())
            ));
        }
    }
    // Anything else is refused by the policy, with its message.
    // The image, by a strategic merge patch (containers merge by name); the owner, by a
    // merge patch that replaces the list.
    let image = serde_json::json!({"spec": {"containers": [
        {"name": "c", "image": "example.invalid/other:2"}]}});
    let mut owners = serde_json::to_value(created.owner_references()).map_err(|e| e.to_string())?;
    owners[0]["name"] = "another-owner".into();
    let owner_ref = serde_json::json!({"metadata": {"ownerReferences": owners}});
    let other_label = serde_json::json!({"metadata": {"labels": {"app": "changed"}}});
    let refusals = [
        ("an image change", Patch::Strategic(image.clone())),
        ("an ownerReferences change", Patch::Merge(owner_ref)),
        ("a change of another label", Patch::Merge(other_label)),
    ];
    for (what, patch) in &refusals {
        match sa_pods.patch(&name, &params, patch).await {
            Err(kube::Error::Api(s))
                if s.code == 403 && messages.iter().any(|m| s.message.contains(m)) => {}
            Err(e) => {
                return Err(format!(
                    "as {user}, {what} was refused, but not with the policy's message {messages:?}: {e}"
                ));
            }
            Ok(p) => {
                return Err(format!(
                    "as {user}, {what} of pod {ns}/{name} was admitted (image {:?}, owners {:?}, labels {:?})",
                    p.spec.as_ref().map(|s| s.containers[0].image.clone()),
                    p.owner_references()
                        .iter()
                        .map(|o| o.name.clone())
                        .collect::<Vec<_>>(),
                    p.labels()
                ));
            }
        }
    }
    let now = pods.get(&name).await.map_err(|e| e.to_string())?;
    if now.spec != labeled.spec
        || now.owner_references() != labeled.owner_references()
        || now.labels() != labeled.labels()
    {
        return Err(format!("pod {ns}/{name} changed after refused patches"));
    }
    // RBAC: no `update`.
    match sa_pods.replace(&name, &PostParams::default(), &now).await {
        Err(kube::Error::Api(s)) if s.code == 403 => {}
        other => {
            return Err(format!(
                "as {user}, an update (PUT) of a pod was not refused: {:?}",
                other.map(|p| p.name_any())
            ));
        }
    }
    // The policy binds the ServiceAccount only: the admin's image change is admitted.
    pods.patch(&name, &params, &Patch::Strategic(image))
        .await
        .map_err(|e| format!("the admin's image change was refused: {e}"))?;
    Ok(format!(
        "as {user}: the label patch admitted, a stale one 409; an image, an ownerReferences and another label's change refused with the policy's message (403); update refused (403); the admin's image change admitted"
    ))
}
