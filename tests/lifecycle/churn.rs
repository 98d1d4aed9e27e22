//! The model's writes of its objects on the server (namespace [`NS`]): creates of random
//! modes and tiers, updates, deletes, moves to another tier (in or out of a label
//! selection) and deletes followed by a create under the same name (another uid).

use kube_persist_testkit::ResourceType;
use rand::Rng;
use serde_json::json;

use super::Model;
use crate::app::NS;
use crate::checks;
use crate::select::{TIER, TIERS};

pub(super) fn cm(name: &str, mode: &str, tier: &str, value: &str) -> serde_json::Value {
    json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": NS, "labels": {"mode": mode, TIER: tier}},
        "data": {"value": value, "blob": "dropped by the model's transform"},
    })
}

impl Model {
    pub(super) fn create(&mut self) {
        let name = format!("cm-{}", self.created);
        self.created += 1;
        self.create_named(&name);
    }

    /// A new object `name` (a new uid), of a random mode and tier.
    pub(super) fn create_named(&mut self, name: &str) {
        let mode = match self.rng.random_range(0..100) {
            0..=11 => "short",
            12..=19 => "fail",
            20..=27 => "slow",
            28..=35 => "write",
            _ => "ok",
        };
        let tier = TIERS[self.rng.random_range(0..3)];
        self.h
            .apply(&ResourceType::configmaps(), cm(name, mode, tier, "v0"));
    }

    /// `name` moved to `tier`, if it exists (a new version).
    pub(super) fn retier(&mut self, name: &str, tier: &str) {
        let rt = ResourceType::configmaps();
        if let Some(mut o) = self.h.get(&rt, Some(NS), name) {
            o["metadata"]["labels"][TIER] = json!(tier);
            self.h.apply(&rt, o);
        }
    }

    /// `name` deleted and created again (another uid), if it exists.
    pub(super) fn recreate(&mut self, name: &str) {
        let rt = ResourceType::configmaps();
        if self.h.delete(&rt, Some(NS), name).is_some() {
            self.create_named(name);
        }
    }

    /// `moves` random objects moved to another tier (out of the stream's label selection
    /// or into it, whichever they are not), `recreates` others created again.
    pub(super) fn shuffle(&mut self, moves: usize, recreates: usize) {
        let server = checks::server_objects(&self.h);
        let names: Vec<&String> = server.keys().collect();
        if names.is_empty() {
            return;
        }
        let mut done = Vec::new();
        for _ in 0..moves {
            let name = names[self.rng.random_range(0..names.len())];
            let labels = self.cfg.sel.labels;
            let tier = if self.cfg.selects(&server[name].meta) {
                labels.outside(&mut self.rng)
            } else {
                labels.inside(&mut self.rng)
            };
            self.retier(name, tier);
            done.push(format!("{name}>{tier}"));
        }
        for _ in 0..recreates {
            let name = names[self.rng.random_range(0..names.len())].clone();
            self.recreate(&name);
            done.push(format!("{name} recreated"));
        }
        if !done.is_empty() {
            self.history.push(format!("({})", done.join(", ")));
        }
    }

    /// A new version of `name`, if it exists.
    pub(super) fn touch(&mut self, name: &str) {
        let rt = ResourceType::configmaps();
        if let Some(mut o) = self.h.get(&rt, Some(NS), name) {
            o["data"]["value"] = json!(format!("v{}", self.jitter.random::<u32>()));
            self.h.apply(&rt, o);
        }
    }

    pub(super) fn churn(&mut self, creates: usize, updates: usize, deletes: usize) {
        let rt = ResourceType::configmaps();
        for _ in 0..creates {
            self.create();
        }
        let mut names: Vec<String> = checks::server_objects(&self.h).into_keys().collect();
        for _ in 0..updates.min(names.len()) {
            let name = &names[self.rng.random_range(0..names.len())];
            if let Some(mut o) = self.h.get(&rt, Some(NS), name) {
                o["data"]["value"] = json!(format!("v{}", self.rng.random::<u32>()));
                self.h.apply(&rt, o);
            }
        }
        for _ in 0..deletes.min(names.len()) {
            let name = names.swap_remove(self.rng.random_range(0..names.len()));
            self.h.delete(&rt, Some(NS), &name);
        }
    }

    /// `n` random objects deleted and created again now (another uid).
    pub(super) fn recreate_some(&mut self, n: usize) {
        self.shuffle(0, n);
    }

    /// Runs `f` with the timing-dependent draws: what it draws does not move the model's
    /// own sequence.
    pub(super) fn jittered<T>(&mut self, f: impl FnOnce(&mut Self) -> T) -> T {
        std::mem::swap(&mut self.rng, &mut self.jitter);
        let out = f(self);
        std::mem::swap(&mut self.rng, &mut self.jitter);
        out
    }
}
