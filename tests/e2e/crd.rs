//! A CRD whose schema changes while a store of it runs: objects that no longer decode into
//! the Rust type are refused (`Error::ObjectRejected` from the stream, the stored version
//! removed), none is served stale, and the others stay current.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    ApiResource, DynamicObject, ListParams, ObjectMeta, Patch, PatchParams, PostParams,
};
use kube::{Api, Client};
use kube_persist::{Error, Event};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::common::{self, try_open_db};
use crate::support::*;

const GROUP: &str = "e2e.kube-persist.io";
const WIDGETS: usize = 300;

/// The Rust type of the CRD's first schema: `spec.size` is an integer.
#[derive(Clone, Debug, Deserialize, Serialize)]
struct Widget {
    metadata: ObjectMeta,
    spec: WidgetSpec,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
struct WidgetSpec {
    size: i64,
}

impl k8s_openapi::Resource for Widget {
    const API_VERSION: &'static str = "e2e.kube-persist.io/v1";
    const GROUP: &'static str = GROUP;
    const KIND: &'static str = "Widget";
    const VERSION: &'static str = "v1";
    const URL_PATH_SEGMENT: &'static str = "widgets";
    type Scope = k8s_openapi::NamespaceResourceScope;
}

impl k8s_openapi::Metadata for Widget {
    type Ty = ObjectMeta;
    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

fn crd(size_type: &str) -> Result<CustomResourceDefinition, Fail> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": format!("widgets.{GROUP}")},
        "spec": {
            "group": GROUP,
            "names": {"kind": "Widget", "plural": "widgets", "singular": "widget", "listKind": "WidgetList"},
            "scope": "Namespaced",
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                    "spec": {"type": "object", "required": ["size"],
                             "properties": {"size": {"type": size_type}}}
                }}}
            }]
        }
    }))?)
}

fn ar() -> ApiResource {
    ApiResource {
        group: GROUP.into(),
        version: "v1".into(),
        api_version: format!("{GROUP}/v1"),
        kind: "Widget".into(),
        plural: "widgets".into(),
    }
}

fn dynamic(client: &Client, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), ns, &ar())
}

/// `namespace/name` → resourceVersion of the Widgets on the server.
async fn server_widgets(client: &Client) -> Result<BTreeMap<String, String>, Fail> {
    let list = Api::<DynamicObject>::all_with(client.clone(), &ar())
        .list_metadata(&ListParams::default())
        .await?;
    Ok(list
        .items
        .into_iter()
        .map(|o| {
            (
                meta_key(&o.metadata),
                o.metadata.resource_version.unwrap_or_default(),
            )
        })
        .collect())
}

/// Retry `f` every 200 ms until it succeeds (a new CRD or schema takes a moment to serve).
async fn retry<T, F: std::future::Future<Output = Result<T, kube::Error>>>(
    what: &str,
    mut f: impl FnMut() -> F,
) -> Result<T, Fail> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match f().await {
            Ok(v) => return Ok(v),
            Err(e) if tokio::time::Instant::now() > deadline => {
                return Err(error(format!("{what}: {e}")));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

fn key_of(i: usize) -> (String, String) {
    (ns(i % NAMESPACES), format!("w-{i:04}"))
}

pub async fn schema_change(server: Arc<Server>) -> Outcome {
    let client = server.client.clone();
    let crds = Api::<CustomResourceDefinition>::all(client.clone());
    crds.create(&PostParams::default(), &crd("integer")?)
        .await?;
    retry("the new CRD serves", || {
        let api = dynamic(&client, "e2e-0");
        async move { api.list(&ListParams::default().limit(1)).await }
    })
    .await?;
    futures::stream::iter(0..WIDGETS)
        .map(|i| {
            let (ns, name) = key_of(i);
            let obj: DynamicObject = serde_json::from_value(json!({
                "apiVersion": format!("{GROUP}/v1"), "kind": "Widget",
                "metadata": {"name": name, "namespace": ns}, "spec": {"size": i}
            }))
            .expect("a Widget");
            let api = dynamic(&client, &ns);
            async move { api.create(&PostParams::default(), &obj).await.map(drop) }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<()>>()
        .await?;

    let dir = tempfile::tempdir()?;
    let db = try_open_db(common::Engine::Redb, dir.path())?;
    let (reader, watcher) = db.store(
        "widgets",
        Api::<Widget>::all(client.clone()),
        crate::sync::config(false),
    )?;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let task = tokio::spawn(async move {
        let mut events = std::pin::pin!(watcher.stream());
        while let Some(ev) = events.next().await {
            let ev = match ev {
                Ok(Event::InitDone) => "initdone".to_string(),
                Ok(Event::Apply(w)) => format!("apply {}", crate::child::key(&w)),
                Err(Error::ObjectRejected { key, .. }) => format!("rejected {key}"),
                Err(e) => format!("error {e}"),
                Ok(_) => continue,
            };
            if tx.send(ev).is_err() {
                return;
            }
        }
    });
    let mut seen: Vec<String> = Vec::new();
    let mut wait = async |pred: &(dyn Fn(&[String]) -> bool + Sync), seen: &mut Vec<String>| {
        let deadline = tokio::time::Instant::now() + WAIT;
        while !pred(seen) {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(e)) => seen.push(e),
                _ => {
                    return Err(error(format!(
                        "timed out; last events {:?}",
                        seen.iter().rev().take(3).collect::<Vec<_>>()
                    )));
                }
            }
        }
        Ok(())
    };
    wait(&|s| s.iter().any(|e| e == "initdone"), &mut seen).await?;
    same_as(&store_widgets(&reader), &server_widgets(&client).await?)?;

    // The schema changes: `size` is now a string. 30 Widgets get string sizes (they no
    // longer decode into `Widget`); 10 only change a label (still integers, kept by
    // validation ratcheting) and stay current.
    let mut new = crd("string")?;
    let old = crds.get(&format!("widgets.{GROUP}")).await?;
    new.metadata.resource_version = old.metadata.resource_version;
    crds.replace(&format!("widgets.{GROUP}"), &PostParams::default(), &new)
        .await?;
    let rejected: BTreeSet<String> = (0..30)
        .map(|i| key_of(i * 7))
        .map(|(n, m)| format!("{n}/{m}"))
        .collect();
    for k in &rejected {
        let (ns, name) = k.split_once('/').expect("namespace/name");
        let patch = json!({"spec": {"size": format!("big-{name}")}});
        retry("a string size under the new schema", || {
            let (api, patch) = (dynamic(&client, ns), patch.clone());
            async move {
                api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
            }
        })
        .await?;
    }
    let relabeled: BTreeSet<String> = (0..10)
        .map(|i| key_of(i * 7 + 3))
        .map(|(n, m)| format!("{n}/{m}"))
        .collect();
    for k in &relabeled {
        let (ns, name) = k.split_once('/').expect("namespace/name");
        let patch = json!({"metadata": {"labels": {"touched": "yes"}}});
        dynamic(&client, ns)
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
    }
    let done = |s: &[String]| {
        rejected
            .iter()
            .all(|k| s.contains(&format!("rejected {k}")))
            && relabeled.iter().all(|k| s.contains(&format!("apply {k}")))
    };
    wait(&done, &mut seen).await?;
    task.abort();

    let got: BTreeSet<String> = seen
        .iter()
        .filter_map(|e| e.strip_prefix("rejected "))
        .map(str::to_string)
        .collect();
    ensure(got == rejected, || {
        format!(
            "{} rejected, expected {}: {got:?}",
            got.len(),
            rejected.len()
        )
    })?;
    let errors: Vec<&String> = seen.iter().filter(|e| e.starts_with("error ")).collect();
    ensure(errors.is_empty(), || {
        format!("other stream errors: {errors:?}")
    })?;
    for k in &rejected {
        let (ns, name) = k.split_once('/').expect("namespace/name");
        ensure(reader.get_named(Some(ns), name)?.is_none(), || {
            format!("{k} served stale")
        })?;
    }
    let mut want = server_widgets(&client).await?;
    want.retain(|k, _| !rejected.contains(k));
    same_as(&store_widgets(&reader), &want)?;
    ensure(reader.stats().bad_objects >= rejected.len() as u64, || {
        format!("stats {:?}", reader.stats())
    })
}

fn store_widgets(reader: &kube_persist::Reader<Widget>) -> BTreeMap<String, String> {
    common::store_versions(reader)
}
