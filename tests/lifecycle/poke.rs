//! The trigger operations of the lifecycle model: `reconcile_on` requests, changes of
//! related objects and `reconcile_all_on` ticks, sent to the live run at random moments
//! (also right after a restart: during the startup pass and the catch-up wait), each
//! recorded for the check that a reconcile of its object starts after it. A storm of ticks
//! comes faster than a sweep takes: each tick must still reach every object in time.

use std::time::{Duration, Instant};

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
    /// Ticks every [`STORM_PERIOD`] for [`STORM_LENGTH`]: many while one sweep runs.
    Storm,
}

/// A storm's tick period: far shorter than a sweep of the model's objects.
const STORM_PERIOD: Duration = Duration::from_millis(250);
/// How long a storm lasts: longer than a storm tick's bound, so that a tick starved by the
/// ones after it is seen before the storm ends.
const STORM_LENGTH: Duration = Duration::from_secs(12);
/// How soon after a storm tick every object's reconcile must start: the sweep under way,
/// the one more that the tick is coalesced into, and a margin.
const STORM_WAIT: Duration = Duration::from_secs(10);

impl Poke {
    pub fn draw(r: &mut impl Rng) -> Poke {
        match r.random_range(0..6) {
            0 | 1 => Poke::Requests(r.random_range(1..8)),
            2 | 3 => Poke::Related(r.random_range(1..6)),
            4 => Poke::Tick,
            _ => Poke::Storm,
        }
    }
}

impl Model {
    /// Sends `poke` to the live run (if any) and records what it owes; a storm takes
    /// [`STORM_LENGTH`].
    pub(super) async fn poke(&mut self, poke: Poke) {
        let Some(live) = self.live.as_ref() else {
            return;
        };
        let names: Vec<String> = checks::server_objects(&self.h).into_keys().collect();
        match poke {
            Poke::Tick => {
                let at = Instant::now();
                if live.ticks.unbounded_send(()).is_ok() {
                    self.triggers.push(Trig::new(at, None, "reconcile_all_on"));
                }
            }
            Poke::Storm => {
                let ticks = live.ticks.clone();
                let end = Instant::now() + STORM_LENGTH;
                while Instant::now() < end {
                    let at = Instant::now();
                    if ticks.unbounded_send(()).is_err() {
                        break;
                    }
                    let mut tick = Trig::new(at, None, "reconcile_all_on storm");
                    tick.within = STORM_WAIT;
                    self.triggers.push(tick);
                    tokio::time::sleep(STORM_PERIOD).await;
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
                        self.triggers.push(Trig::new(at, Some(name), what));
                    }
                }
            }
            Poke::Requests(_) | Poke::Related(_) => {}
        }
    }
}
