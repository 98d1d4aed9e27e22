//! `pod-security`: the namespace of `deploy/` enforces Pod Security `restricted`, and every
//! Pod the project ships passes it, checked by kube-apiserver's own PodSecurity admission.
//!
//! The scenario applies `deploy/namespace.yaml` for real (server-side apply, so that its
//! labels are set on a namespace that already exists), then creates with `dryRun=All`
//! (admission runs, nothing is persisted):
//! - a Pod from each Pod template under `deploy/` (every StatefulSet, Deployment,
//!   DaemonSet, ReplicaSet, Job or CronJob, and any bare Pod), with the claim volumes a
//!   StatefulSet controller would add;
//! - every Pod of a `kubectl ... <<EOF` document in docs/kubernetes.md (the runbooks' Pods,
//!   read from the markdown so that the page cannot drift);
//! - a privileged Pod, which must be refused with 403: the proof that `restricted` is
//!   enforced there, not only warned about.

use std::path::Path;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use crate::support::{Fail, Outcome, Server, ensure, error};

/// `pod-security`: see the module's doc.
pub async fn pod_security(s: Arc<Server>) -> Outcome {
    let deploy = crate::deploy::deploy_dir();
    let docs = crate::deploy::documents(&deploy).map_err(error)?;
    let ns_doc = docs
        .iter()
        .find(|(at, d)| at.starts_with("namespace.yaml") && d["kind"] == "Namespace")
        .map(|(_, d)| d.clone())
        .ok_or_else(|| error("no Namespace in deploy/namespace.yaml"))?;
    let ns = ns_doc["metadata"]["name"]
        .as_str()
        .ok_or_else(|| error("deploy/namespace.yaml: no name"))?
        .to_string();
    let namespace: Namespace = serde_json::from_value(ns_doc)?;
    Api::<Namespace>::all(s.client.clone())
        .patch(
            &ns,
            &PatchParams::apply("kube-persist-e2e").force(),
            &Patch::Apply(&namespace),
        )
        .await?;

    let mut pods = Vec::new();
    for (at, doc) in &docs {
        for pod in pods_of(doc) {
            pods.push((format!("deploy/{at}"), pod));
        }
    }
    let shipped = pods.len();
    ensure(shipped >= 2, || {
        format!("{shipped} Pod templates under deploy/ (both StatefulSets expected)")
    })?;
    let page = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/kubernetes.md");
    let text = std::fs::read_to_string(&page)?;
    let runbook = heredoc_pods(&text).map_err(|e| error(format!("docs/kubernetes.md: {e}")))?;
    ensure(!runbook.is_empty(), || {
        "no Pod in a heredoc of docs/kubernetes.md (the runbook's)".into()
    })?;
    let runbooks = runbook.len();
    pods.extend(
        runbook
            .into_iter()
            .map(|p| ("docs/kubernetes.md".into(), p)),
    );

    let api = Api::<Pod>::namespaced(s.client.clone(), &ns);
    let dry = PostParams {
        dry_run: true,
        field_manager: Some("kube-persist-e2e".into()),
    };
    let mut refused = Vec::new();
    for (i, (at, mut pod)) in pods.into_iter().enumerate() {
        pod["metadata"]["name"] = format!("pod-security-{i}").into();
        pod["metadata"]["namespace"] = ns.clone().into();
        let typed: Pod = serde_json::from_value(pod).map_err(|e| error(format!("{at}: {e}")))?;
        if let Err(e) = api.create(&dry, &typed).await {
            refused.push(format!("{at}: {e}"));
        }
    }
    ensure(refused.is_empty(), || {
        format!("Pods refused in {ns}: {}", refused.join("; "))
    })?;

    // A Pod that violates `restricted`: refused, so the policy is enforced.
    let privileged: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "pod-security-privileged", "namespace": ns},
        "spec": {"containers": [{"name": "c", "image": "example.invalid/c:1",
            "securityContext": {"privileged": true}}]}
    }))?;
    match api.create(&dry, &privileged).await {
        Err(kube::Error::Api(st)) if st.code == 403 && st.message.contains("PodSecurity") => {}
        Err(e) => return Err(Fail::Diverged(format!("privileged Pod: {e}, not a 403"))),
        Ok(_) => {
            return Err(Fail::Diverged(format!(
                "a privileged Pod is admitted in {ns}: restricted is not enforced"
            )));
        }
    }
    println!(
        "e2e pod-security: {shipped} Pod templates of deploy/ and {runbooks} Pod of \
         docs/kubernetes.md admitted in {ns} (restricted enforced), a privileged Pod refused (403)"
    );
    Ok(())
}

/// The Pods a manifest creates: a bare Pod, or one from its Pod template (with the volumes
/// of a StatefulSet's claim templates, as its controller adds them).
fn pods_of(doc: &Value) -> Vec<Value> {
    let template = match doc["kind"].as_str() {
        Some("Pod") => return vec![doc.clone()],
        Some("StatefulSet" | "Deployment" | "DaemonSet" | "ReplicaSet" | "Job") => {
            &doc["spec"]["template"]
        }
        Some("CronJob") => &doc["spec"]["jobTemplate"]["spec"]["template"],
        _ => return Vec::new(),
    };
    let mut pod = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"labels": template["metadata"]["labels"].clone()},
        "spec": template["spec"].clone()});
    let owner = doc["metadata"]["name"].as_str().unwrap_or_default();
    for claim in doc["spec"]["volumeClaimTemplates"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let name = claim["metadata"]["name"].as_str().unwrap_or_default();
        let volume = json!({"name": name,
            "persistentVolumeClaim": {"claimName": format!("{name}-{owner}-0")}});
        match pod["spec"]["volumes"].as_array_mut() {
            Some(v) => v.push(volume),
            None => pod["spec"]["volumes"] = json!([volume]),
        }
    }
    vec![pod]
}

/// The Pods among the YAML documents of the `<<EOF` heredocs of a markdown page (indented
/// as in a list item: each heredoc is dedented by its first line's indentation).
fn heredoc_pods(markdown: &str) -> Result<Vec<Value>, String> {
    let mut pods = Vec::new();
    let mut lines = markdown.lines();
    while let Some(line) = lines.next() {
        if !line.trim_end().ends_with("<<EOF") {
            continue;
        }
        let body: Vec<&str> = lines.by_ref().take_while(|l| l.trim() != "EOF").collect();
        let indent = body
            .first()
            .map(|l| l.len() - l.trim_start().len())
            .unwrap_or(0);
        let yaml: String = body
            .iter()
            .map(|l| format!("{}\n", l.get(indent..).unwrap_or("")))
            .collect();
        let docs: Vec<Value> = serde_saphyr::from_multiple(&yaml)
            .map_err(|e| format!("a heredoc is not YAML: {e}\n{yaml}"))?;
        pods.extend(docs.into_iter().filter(|d| d["kind"] == "Pod"));
    }
    Ok(pods)
}

/// Makes a test Pod (JSON) pass Pod Security `restricted`, for the Pods the scenarios
/// create in the namespace of `deploy/namespace.yaml`: non-root, the RuntimeDefault seccomp
/// profile, and in each container no privilege escalation and no capability.
pub fn restricted(pod: &mut Value) {
    pod["spec"]["securityContext"] = json!({"runAsNonRoot": true, "runAsUser": 65532,
        "seccompProfile": {"type": "RuntimeDefault"}});
    for c in pod["spec"]["containers"]
        .as_array_mut()
        .into_iter()
        .flatten()
    {
        c["securityContext"] = json!({"allowPrivilegeEscalation": false,
            "capabilities": {"drop": ["ALL"]}});
    }
}
