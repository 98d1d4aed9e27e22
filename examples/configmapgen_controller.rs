//! kube-rs' `configmapgen_controller` example, ported to kube-persist: a controller of
//! `ConfigMapGenerator` objects (group `nullable.se`) that owns one ConfigMap each, holding
//! the generator's `content`, written with server-side apply. Pressing enter reconciles
//! every generator again.
//!
//! ```text
//! cargo run --example configmapgen_controller    # a cluster from KUBECONFIG, with the CRD
//! ```
//!
//! The port changes the construction only (README, *Porting from kube-runtime*):
//! `Controller::new(api, watcher::Config)` and `.owns(api, watcher::Config)` become
//! `Controller::for_store(&db, ..)` and `.owns_store(db.store(..))` on a store directory.
//! The CRD, `reconcile`, `error_policy`, the triggers and the run loop are kube-runtime's.

use std::{collections::BTreeMap, io::BufRead, sync::Arc};

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::{
    Client, CustomResource,
    api::{Api, ObjectMeta, Patch, PatchParams, Resource},
    runtime::{controller::Action, watcher},
};
use kube_persist::{
    Db,
    controller::{Config, Controller},
};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tokio::time::Duration;
use tracing::{info, warn};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Failed to create ConfigMap: {0}")]
    ConfigMapCreationFailed(#[source] kube::Error),
    #[error("MissingObjectKey: {0}")]
    MissingObjectKey(&'static str),
}

#[derive(CustomResource, Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[kube(group = "nullable.se", version = "v1", kind = "ConfigMapGenerator")]
#[kube(shortname = "cmg", namespaced)]
pub struct ConfigMapGeneratorSpec {
    pub content: String,
}

/// Controller triggers this whenever our main object or our children changed
pub async fn reconcile(
    generator: Arc<ConfigMapGenerator>,
    ctx: Arc<Data>,
) -> Result<Action, Error> {
    let client = &ctx.client;

    let mut contents = BTreeMap::new();
    contents.insert("content".to_string(), generator.spec.content.clone());
    let oref = generator
        .controller_owner_ref(&())
        .ok_or(Error::MissingObjectKey(".metadata.uid"))?;
    let cm = ConfigMap {
        metadata: ObjectMeta {
            name: generator.metadata.name.clone(),
            owner_references: Some(vec![oref]),
            ..ObjectMeta::default()
        },
        data: Some(contents),
        ..Default::default()
    };
    let cm_api = Api::<ConfigMap>::namespaced(
        client.clone(),
        generator
            .metadata
            .namespace
            .as_ref()
            .ok_or(Error::MissingObjectKey(".metadata.namespace"))?,
    );
    cm_api
        .patch(
            cm.metadata
                .name
                .as_ref()
                .ok_or(Error::MissingObjectKey(".metadata.name"))?,
            &PatchParams::apply("configmapgenerator.kube-rt.nullable.se"),
            &Patch::Apply(&cm),
        )
        .await
        .map_err(Error::ConfigMapCreationFailed)?;
    Ok(Action::requeue(Duration::from_secs(300)))
}

/// The controller triggers this on reconcile errors
pub fn error_policy(_object: Arc<ConfigMapGenerator>, _error: &Error, _ctx: Arc<Data>) -> Action {
    Action::requeue(Duration::from_secs(1))
}

// Data we want access to in error/reconcile calls
pub struct Data {
    pub client: Client,
}

#[allow(dead_code)] // the test calls `controller`
#[tokio::main]
async fn main() -> Result<(), BoxError> {
    tracing_subscriber::fmt::init();
    let client = Client::try_default().await?;
    let dir = std::env::var("STORE_DIR").unwrap_or_else(|_| "configmapgen-store".into());

    info!("starting configmapgen-controller");
    info!("press <enter> to force a reconciliation of all objects");

    let (mut reload_tx, reload_rx) = futures::channel::mpsc::channel(0);
    // Using a regular background thread since tokio::io::stdin() doesn't allow aborting reads,
    // and its worker prevents the Tokio runtime from shutting down.
    std::thread::spawn(move || {
        for _ in std::io::BufReader::new(std::io::stdin()).lines() {
            let _ = reload_tx.try_send(());
        }
    });

    controller(client.clone(), &Db::open(dir)?)?
        .reconcile_all_on(reload_rx.map(|_| ()))
        .shutdown_on_signal()
        .run(reconcile, error_policy, Arc::new(Data { client }))
        .for_each(|res| async move {
            match res {
                Ok(o) => info!("reconciled {:?}", o),
                Err(e) => warn!("reconcile failed: {}", e),
            }
        })
        .await;
    info!("controller terminated");
    Ok(())
}

/// The controller of the example, on the store directory `db`.
pub fn controller(client: Client, db: &Db) -> kube_persist::Result<Controller<ConfigMapGenerator>> {
    let cmgs = Api::<ConfigMapGenerator>::all(client.clone());
    let cms = Api::<ConfigMap>::all(client.clone());
    Ok(Controller::for_store(
        db,
        "cmgs",
        cmgs,
        watcher::Config::default().into(),
        Config::default(),
    )?
    .owns_store(db.store("cms", cms, watcher::Config::default().into())?))
}
