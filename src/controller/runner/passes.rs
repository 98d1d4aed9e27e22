//! The runner's passes: the pass over every stored object (`reconcile_all_on`, a cold
//! start, a warm start without durable state) and the startup pass of a durable controller,
//! which waits until the main store has caught up; both feed the scheduler chunk by chunk.

use std::task::{Context, Poll};

use futures::FutureExt;
use kube::Resource;
use serde::de::DeserializeOwned;
use tokio::time::Instant;

use super::super::StartupMode;
use super::super::controller_error::ControllerError;
use super::super::scan::{Pass, PassMode, Plan, StartupOptions};
use super::super::state::{instant_at, now_ms};
use super::Runner;
use crate::controller::keyspace::StateOp;

impl<K, Ctx, E> Runner<K, Ctx, E>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Clone + Eq + std::hash::Hash + Send + Sync + 'static,
    Ctx: Send + Sync + 'static,
    E: Send + 'static,
{
    /// Asks for a pass over every stored object: starts one, or, while one is under way,
    /// one more after it (asks that come meanwhile are coalesced into that one).
    pub(super) fn pass_all(&mut self) {
        if self.full_pass.is_some() {
            if !self.full_pass_again {
                tracing::debug!("a pass is under way: one more follows it");
            }
            self.full_pass_again = true;
            return;
        }
        self.start_full_pass();
    }

    fn start_full_pass(&mut self) {
        tracing::debug!("reconciling every stored object (pass from disk)");
        self.full_pass_again = false;
        self.full_pass = Some(Pass::all(
            self.p.reader.clone(),
            self.p.dyntype.clone(),
            self.p.config.pass_chunk,
        ));
    }

    /// The main store is consistent: run the startup pass once it has caught up with the
    /// server too (see `Config::catch_up_before_startup`).
    pub(super) fn request_startup(&mut self, cold: bool) {
        let Some(limit) = self.p.config.startup_catch_up else {
            return self.startup(cold);
        };
        if self.p.reader.is_caught_up() {
            return self.startup(cold);
        }
        tracing::info!(
            timeout_ms = limit.as_millis() as u64,
            "startup pass waits until the store has caught up with the server"
        );
        self.p.stats.pass_began(None);
        let reader = self.p.reader.clone();
        let wait = async move {
            matches!(
                tokio::time::timeout(limit, reader.wait_until_caught_up()).await,
                Ok(Ok(()))
            )
        };
        self.catching_up = Some((cold, wait.boxed()));
    }

    /// Runs the startup pass that waited for the store to catch up, once it has (or the
    /// wait gave up); true if it started.
    pub(super) fn poll_catch_up(&mut self, cx: &mut Context<'_>) -> bool {
        let Some((cold, wait)) = self.catching_up.as_mut() else {
            return false;
        };
        let Poll::Ready(caught_up) = wait.poll_unpin(cx) else {
            return false;
        };
        let cold = *cold;
        self.catching_up = None;
        if caught_up {
            tracing::debug!("store caught up: the startup pass starts");
        } else {
            tracing::warn!(
                checkpoint = ?self.p.reader.checkpoint(),
                "the store did not catch up with the server in time: the startup pass runs on the data it has"
            );
        }
        self.startup(cold);
        true
    }

    /// Reconcile what the startup mode says.
    pub(super) fn startup(&mut self, cold: bool) {
        let mode = self.p.config.startup;
        let Some(d) = self.durable.as_mut() else {
            if cold || mode != StartupMode::Nothing {
                self.pass_all();
            }
            return;
        };
        let pass_mode = match (mode, cold) {
            (StartupMode::ReconcileAll, _) => PassMode::All,
            (StartupMode::Nothing, false) => PassMode::DueOnly,
            _ => PassMode::Changed,
        };
        tracing::debug!(?pass_mode, cold, "startup pass over the reconcile state");
        let loaded_until = d.start_window();
        self.p.stats.pass_began(Some(self.p.reader.len() as u64));
        self.startup_pass = Some(Pass::startup(
            self.p.reader.clone(),
            d.keyspace(),
            self.p.dyntype.clone(),
            self.p.config.pass_chunk,
            StartupOptions {
                mode: pass_mode,
                loaded_until,
                generation_filter: self.p.config.skip_unchanged_generation,
            },
            self.p.stats.clone(),
        ));
    }

    /// Feeds the next chunk of the pass and of the startup pass, each once half of the
    /// previous chunk has started.
    pub(super) fn poll_passes(&mut self, cx: &mut Context<'_>) -> bool {
        if self.pass_outstanding.len() > self.p.config.pass_chunk / 2 {
            return false; // re-checked after each dispatch
        }
        let mut progressed = false;
        for startup in [false, true] {
            let slot = if startup {
                &mut self.startup_pass
            } else {
                &mut self.full_pass
            };
            let Some(pass) = slot.as_mut() else {
                continue;
            };
            let chunk = match pass.poll_chunk(cx) {
                Poll::Pending => continue,
                Poll::Ready(None) => {
                    *slot = None;
                    if startup {
                        self.p.stats.pass_ended();
                    } else if self.full_pass_again {
                        self.start_full_pass();
                    }
                    progressed = true;
                    continue;
                }
                Poll::Ready(Some(chunk)) => chunk,
            };
            progressed = true;
            match chunk {
                Ok(plans) => self.plan(plans),
                Err(e) => self.out.push_back(Err(ControllerError::Store(e))),
            }
        }
        progressed
    }

    /// Schedules what a pass chunk asks for.
    pub(super) fn plan(&mut self, plans: Vec<Plan<K>>) {
        let (now, wall) = (Instant::now(), now_ms());
        for plan in plans {
            match plan {
                Plan::Reconcile {
                    obj_ref,
                    reason,
                    at_ms,
                } => match at_ms.filter(|&at| at > wall) {
                    None => {
                        self.pass_outstanding.insert(obj_ref.clone());
                        self.schedule(obj_ref, reason, now);
                    }
                    Some(at) => self.schedule(obj_ref, reason, instant_at(at)),
                },
                Plan::Forget { suffix, seen } => {
                    if let Some(d) = self.durable.as_mut() {
                        d.push(StateOp::Forget {
                            suffix,
                            only_if: Some(seen),
                        });
                    }
                }
            }
        }
    }
}
