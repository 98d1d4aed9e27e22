//! The example operator's reconciler: it labels every Pod with the name of its owner
//! (`example.kube-persist.rs/owner=<owner>`), writing through the API, on kube-persist's
//! `Controller` with durable reconcile state.
//!
//! The operator (`examples/operator.rs`, what `deploy/` ships) runs it in `cluster.rs`; the
//! restart benchmark (`benches/operator.rs`) includes this file alone, to run the same
//! reconciler in its measured processes beside kube-runtime's `Controller`. It depends on
//! the library and kube only.
//!
//! The port is one constructor: [`persistent_controller`] where kube-runtime's
//! `Controller::new` was. `reconcile` and `error_policy` are plain kube-runtime code.
//!
//! The reconciler writes the label and nothing else: a JSON merge patch of
//! `metadata.labels` (verb `patch`), never the whole Pod back (an `update` would let the
//! operator's ServiceAccount rewrite any field of any Pod). The patch carries the cached
//! `metadata.resourceVersion` as a precondition: a Pod changed since it was cached is
//! refused with 409 Conflict, and the reconcile is retried once the store has the newer
//! Pod. `deploy/admission-policy.yaml` holds the ServiceAccount to that one label.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Api, Client, ResourceExt};

/// The label the operator maintains.
pub const OWNER_LABEL: &str = "example.kube-persist.rs/owner";

/// The reconciler's context.
pub struct Ctx {
    /// Client for writes.
    pub client: Client,
    /// Pods relabeled so far.
    pub writes: AtomicU64,
    /// Reconciles so far.
    pub reconciles: AtomicU64,
    /// The objects reconciled so far (`namespace/name`).
    pub objects: Mutex<HashSet<String>>,
}

impl Ctx {
    /// A context writing through `client`.
    pub fn new(client: Client) -> Arc<Ctx> {
        Arc::new(Ctx {
            client,
            writes: AtomicU64::new(0),
            reconciles: AtomicU64::new(0),
            objects: Mutex::new(HashSet::new()),
        })
    }
}

/// What can go wrong in a reconcile.
#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    /// The label patch failed (409 Conflict when the cached Pod is older than the
    /// server's: the patch's resourceVersion precondition).
    #[error("cannot label the pod: {0}")]
    Kube(#[from] kube::Error),
}

/// The label value a Pod should carry: its controller owner's name, else `none`.
pub fn wanted_owner(pod: &Pod) -> String {
    let owners = pod.owner_references();
    owners
        .iter()
        .find(|o| o.controller == Some(true))
        .or(owners.first())
        .map_or_else(|| "none".to_string(), |o| o.name.clone())
}

/// Whether the Pod carries the label the operator maintains, with the right value.
pub fn is_labeled(pod: &Pod) -> bool {
    pod.labels().get(OWNER_LABEL) == Some(&wanted_owner(pod))
}

/// The JSON merge patch that sets the owner label to `owner` on a Pod cached at
/// `resource_version`: only `metadata.labels` and the precondition, so that applying it
/// changes nothing but that label, and only if the Pod is still at that version.
pub fn label_patch(resource_version: Option<&str>, owner: &str) -> serde_json::Value {
    serde_json::json!({
        "metadata": {
            "resourceVersion": resource_version,
            "labels": { OWNER_LABEL: owner },
        }
    })
}

/// Labels the Pod with its owner. Idempotent: a labeled Pod is left alone.
pub async fn reconcile(pod: Arc<Pod>, ctx: Arc<Ctx>) -> Result<Action, OperatorError> {
    ctx.reconciles.fetch_add(1, Ordering::Relaxed);
    ctx.objects.lock().unwrap().insert(format!(
        "{}/{}",
        pod.namespace().unwrap_or_default(),
        pod.name_any()
    ));
    let want = wanted_owner(&pod);
    if pod.labels().get(OWNER_LABEL) != Some(&want) {
        // A merge patch of the label alone, conditional on the cached resourceVersion:
        // 409 Conflict if the cache is stale (error_policy retries).
        let patch = label_patch(pod.resource_version().as_deref(), &want);
        let api = Api::<Pod>::namespaced(ctx.client.clone(), &pod.namespace().unwrap_or_default());
        api.patch(
            &pod.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await?;
        ctx.writes.fetch_add(1, Ordering::Relaxed);
    }
    Ok(Action::requeue(Duration::from_secs(3600)))
}

/// Retries soon, as a kube-runtime controller's error policy does: a conflict (the patch's
/// resourceVersion precondition) resolves once the cache has the newer Pod.
pub fn error_policy(_pod: Arc<Pod>, _err: &OperatorError, _ctx: Arc<Ctx>) -> Action {
    Action::requeue(Duration::from_millis(500))
}

/// The name of the operator's durable reconcile state.
pub const CONTROLLER_NAME: &str = "owner-labeler";

/// The operator's controller on kube-persist: Pods cached on disk in `db`, resumed without a
/// LIST after a restart, and a durable reconcile state: a restart reconciles only the Pods
/// that changed while it was down (and requeues that fell due).
pub fn persistent_controller(
    db: &kube_persist::Db,
    client: Client,
) -> kube_persist::Result<kube_persist::Controller<Pod>> {
    persistent_controller_with(db, client, kube_persist::StreamConfig::default())
}

/// [`persistent_controller`] with the store's configuration (e.g. its shard).
pub fn persistent_controller_with(
    db: &kube_persist::Db,
    client: Client,
    store: kube_persist::StreamConfig,
) -> kube_persist::Result<kube_persist::Controller<Pod>> {
    use kube_persist::controller::{Config, Controller};
    db.store("pods", Api::<Pod>::all(client), store)
        .map(|pair| Controller::for_store(pair).with_config(Config::default().concurrency(16)))?
        .durable_state(CONTROLLER_NAME)
}
