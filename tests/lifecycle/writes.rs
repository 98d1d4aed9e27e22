//! The read-your-writes operation of the lifecycle model, and the quiescence the checks
//! wait for: the store at the server's version and the reconcilers' own writes done.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ConfigMap;
use kube_persist::Reader;
use kube_persist_testkit::ResourceType;
use rand::Rng;
use serde_json::json;

use super::Model;
use crate::app::{NS, RunCfg};
use crate::checks::{self, Found};

impl Model {
    /// Writes an object and reads it back once `wait_for_resource_version` says the store
    /// holds that version: it must (or a newer one), if the object is in the selection.
    pub(super) async fn write_read(&mut self, step: usize) {
        let Some(reader) = self.live.as_ref().map(|l| l.reader.clone()) else {
            return;
        };
        let rt = ResourceType::configmaps();
        let names: Vec<String> = checks::server_objects(&self.h).into_keys().collect();
        if names.is_empty() {
            return;
        }
        let name = names[self.rng.random_range(0..names.len())].clone();
        let Some(mut o) = self.h.get(&rt, Some(NS), &name) else {
            return;
        };
        o["data"]["value"] = json!(format!("w{}", self.rng.random::<u32>()));
        let written = self.h.apply(&rt, o);
        let rv = written["metadata"]["resourceVersion"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let meta = crate::select::Meta::of_json(&written);
        if let Err(e) = reader
            .wait_for_resource_version(Some(NS), &name, &rv, checks::SYNC_WAIT)
            .await
        {
            return self.report(
                step,
                checks::found("wait_for_resource_version resolves", e.to_string()),
            );
        }
        if !self.cfg.selects(&meta) {
            return;
        }
        let stored = reader
            .get_named(Some(NS), &name)
            .ok()
            .flatten()
            .and_then(|c| c.metadata.resource_version.clone());
        let fresh = stored
            .as_deref()
            .is_some_and(|s| kube_persist::resource_version::at_least(s, &rv).unwrap_or(false));
        if !fresh {
            self.report(
                step,
                checks::found(
                    "read your writes",
                    format!("{name}: read {stored:?} after wait_for_resource_version({rv})"),
                ),
            );
        }
    }

    /// The store quiescent (see `checks::quiesce`) and the reconcilers' own writes done, so
    /// that nothing changes the server while the invariants are checked.
    pub(super) async fn quiesce(
        &self,
        reader: &Reader<ConfigMap>,
        cfg: &RunCfg,
    ) -> Result<(), Found> {
        let deadline = Instant::now() + checks::SYNC_WAIT;
        loop {
            checks::quiesce(reader, &self.h).await?;
            let left = checks::unmirrored(&checks::server_objects(&self.h), cfg);
            if left.is_empty() {
                // A write may have landed since the store was seen at the server's version.
                return checks::quiesce(reader, &self.h).await;
            }
            if Instant::now() > deadline {
                let names: Vec<String> = left.iter().map(|(n, _)| n.clone()).collect();
                return Err(checks::found(
                    "the controller's own writes are done",
                    format!(
                        "unmirrored after {:?}: {left:?}; seen: {}",
                        checks::SYNC_WAIT,
                        checks::history(&self.log, &names)
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
