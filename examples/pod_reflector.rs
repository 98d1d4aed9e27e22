//! kube-rs' `pod_reflector` example, ported to kube-persist: a reflector of the Pods of the
//! default namespace, slimmed before they are stored, that logs every Pod it sees and the
//! store's size every 5 seconds. The store is on disk, so a restart resumes the watch
//! instead of listing again.
//!
//! ```text
//! cargo run --example pod_reflector              # a cluster from KUBECONFIG or in-cluster
//! STORE_DIR=/var/lib/pods cargo run --example pod_reflector
//! ```
//!
//! The port changes the store's construction only (README, *Porting from kube-runtime*):
//! kube-runtime's `reflector::store()` + `watcher(..)` + `reflector(writer, stream)` become
//! `Db::open(dir)` + `db.store(..)`; the watch config converts with `From`, and the
//! per-event `modify` becomes a transform on the stored JSON. The loop over
//! `applied_objects()` and the reads of the store are kube-runtime's.

use futures::TryStreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use kube_persist::{Db, StreamConfig};
use tracing::{debug, info};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[allow(dead_code)] // the test calls `reflect`
#[tokio::main]
async fn main() -> Result<(), BoxError> {
    tracing_subscriber::fmt::init();
    let client = Client::try_default().await?;
    let dir = std::env::var("STORE_DIR").unwrap_or_else(|_| "pod-reflector-store".into());
    reflect(client, &dir, None).await?;
    Ok(())
}

/// The example: reflect the default namespace's Pods into the store at `dir`, logging each
/// applied Pod. Returns the names seen once `stop_after` Pods were (never, with `None`).
pub async fn reflect(
    client: Client,
    dir: &str,
    stop_after: Option<usize>,
) -> Result<Vec<String>, BoxError> {
    let api: Api<Pod> = Api::default_namespaced(client);
    let db = Db::open(dir)?;
    // Memory optimization for the store (here: its disk): we don't care about
    // managed fields, annotations or status.
    let config = StreamConfig::from(watcher::Config::default())
        .drop_managed_fields()
        .transform("no-annotations-no-status", |pod| {
            if let Some(meta) = pod["metadata"].as_object_mut() {
                meta.remove("annotations");
            }
            if let Some(pod) = pod.as_object_mut() {
                pod.remove("status");
            }
        });
    let (reader, watcher) = db.store("pods", api, config)?;

    tokio::spawn(async move {
        // Show state every 5 seconds of watching
        loop {
            tokio::time::sleep(std::time::Duration::from_secs(5)).await;
            info!("Current pod count: {}", reader.len());
            // full information with debug logs
            for p in reader.iter().flatten() {
                debug!("Pod {}: {:?}", p.name_any(), p.spec);
            }
        }
    });

    let rf = watcher.applied_objects();
    futures::pin_mut!(rf);

    let mut seen = Vec::new();
    while let Some(pod) = rf.try_next().await? {
        info!("saw {}", pod.name_any());
        seen.push(pod.name_any());
        if Some(seen.len()) == stop_after {
            break;
        }
    }
    Ok(seen)
}
