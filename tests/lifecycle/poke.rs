//! The trigger operations of the lifecycle model: `reconcile_on` requests, changes of
//! related objects and `reconcile_all_on` ticks, sent to the live run at random moments
//! (also right after a restart: during the startup pass and the catch-up wait), each
//! recorded for the check that a reconcile of its object starts after it.

use std::time::Instant;

use kube::runtime::reflector::ObjectRef;
use kube_persist_testkit::ResourceType;
use rand::Rng;
use serde_json::json;

use super::Model;
use crate::app::{NS, REL_NS};
use crate::checks::{self, Trig};

/// One trigger operation.
#[derive(Debug, Clone, Copy)]
pub enum Poke {
    /// `reconcile_on` requests for this many random objects.
    Requests(usize),
    /// This many related objects (`rel-<name>`) created or changed.
    Related(usize),
    /// A `reconcile_all_on` tick.
    Tick,
}

impl Poke {
    pub fn draw(r: &mut impl Rng) -> Poke {
        match r.random_range(0..5) {
            0 | 1 => Poke::Requests(r.random_range(1..8)),
            2 | 3 => Poke::Related(r.random_range(1..6)),
            _ => Poke::Tick,
        }
    }
}

impl Model {
    /// Sends `poke` to the live run (if any) and records what it owes.
    pub(super) fn poke(&mut self, poke: Poke) {
        let Some(live) = self.live.as_ref() else {
            return;
        };
        let names: Vec<String> = checks::server_objects(&self.h).into_keys().collect();
        match poke {
            Poke::Tick => {
                let at = Instant::now();
                if live.ticks.unbounded_send(()).is_ok() {
                    self.triggers.push(Trig {
                        at,
                        name: None,
                        what: "reconcile_all_on",
                    });
                }
            }
            Poke::Requests(n) | Poke::Related(n) if !names.is_empty() => {
                let requests = live.requests.clone();
                for _ in 0..n {
                    let name = names[self.rng.random_range(0..names.len())].clone();
                    let at = Instant::now();
                    let sent = match poke {
                        Poke::Requests(_) => requests
                            .unbounded_send(ObjectRef::new(&name).within(NS))
                            .is_ok(),
                        _ => {
                            let value = self.rng.random::<u32>().to_string();
                            self.h.apply(
                                &ResourceType::configmaps(),
                                json!({
                                    "apiVersion": "v1", "kind": "ConfigMap",
                                    "metadata": {"name": format!("rel-{name}"), "namespace": REL_NS},
                                    "data": {"value": value},
                                }),
                            );
                            true
                        }
                    };
                    if sent {
                        let what = match poke {
                            Poke::Requests(_) => "reconcile_on",
                            _ => "related object changed",
                        };
                        self.triggers.push(Trig {
                            at,
                            name: Some(name),
                            what,
                        });
                    }
                }
            }
            Poke::Requests(_) | Poke::Related(_) => {}
        }
    }
}
