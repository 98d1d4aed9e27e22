//! The `deploy/` manifests checked against a real API server (issue 27, item 5): every YAML
//! document under `deploy/` (subfolders included) is applied with server-side apply in dry
//! run (`dryRun=All`) and strict field validation, so the server runs its defaulting,
//! validation and admission on it (RBAC included) and refuses unknown or misspelled fields,
//! without persisting anything.
//!
//! The only real write: a namespace the manifests put objects in is created when it does
//! not exist, because the server refuses a namespaced object in a missing namespace even in
//! dry run (and a dry-run Namespace is not persisted).

use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams, ValidationDirective};
use kube::core::GroupVersionKind;
use kube::discovery::{Discovery, Scope};
use serde_json::Value;

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
    let discovery = Discovery::new(client.clone())
        .run()
        .await
        .map_err(|e| format!("API discovery: {e}"))?;
    let mut params = PatchParams::apply(MANAGER).dry_run();
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
