//! Deletes and re-creations under the same name at every point of the lifecycle model (issue
//! 56, item 7), and ticks across restarts. Churn recreates objects while the controller
//! runs (`Op::Churn`'s `recreates`), a stop and a kill while it is down (`Op::Stop`'s and
//! `Op::Kill`'s), a burst just before an abort, the jitter while a child runs, a relist
//! between a metadata page and its fetch or before its snapshot (`delta::Move::Recreate`,
//! `Reborn`); and [`Busy`] while the object's own reconcile runs. Every restart may come in
//! the middle of a tick's pass ([`Model::tick_before_restart`]): the durable controller
//! resumes it, so the tick is kept across the restart and swept within its bound of it
//! (`checks::TICK_ACROSS`). What each owes is checked at quiescence like any change: the
//! object reconciled at its latest version as its new uid (`checks::NEW_UID`), the store and
//! the consumers holding the new uid, the reconcile records tracking the store.

use std::time::{Duration, Instant};

use kube::runtime::reflector::ObjectRef;
use kube_persist_testkit::ResourceType;
use rand::Rng;

use super::Model;
use crate::app::{NS, SLOW, Seen};
use crate::checks::{self, Trig};

/// How long the object's reconcile may take to start after its request.
const START_WAIT: Duration = Duration::from_secs(10);
/// How long a tick's pass may take to be seen under way before a restart.
const PASS_WAIT: Duration = Duration::from_secs(3);

/// What happens to an object while its own reconcile runs (`Op::Busy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Busy {
    /// Deleted and created again at once (another uid), while the reconcile of the old
    /// uid runs.
    Recreate,
    /// Deleted while the reconcile runs, created again once it is done.
    DeleteThenCreate,
    /// Deleted while the reconcile runs.
    Delete,
}

impl Busy {
    pub(super) fn draw(r: &mut impl Rng) -> Busy {
        [
            Busy::Recreate,
            Busy::Recreate,
            Busy::DeleteThenCreate,
            Busy::Delete,
        ][r.random_range(0..4)]
    }
}

impl Model {
    /// One selected object whose reconcile runs long (`slow`, `write`; else any selected),
    /// asked for by `reconcile_on`, deleted (and created again) as `busy` says while that
    /// reconcile runs.
    pub(super) async fn busy(&mut self, busy: Busy) {
        let Some(live) = self.live.as_ref() else {
            return;
        };
        let requests = live.requests.clone();
        let server = checks::server_objects(&self.h);
        let selected: Vec<(&String, &checks::Obj)> = server
            .iter()
            .filter(|(_, o)| self.cfg.selects(&o.meta))
            .collect();
        let long: Vec<&String> = selected
            .iter()
            .filter(|(_, o)| ["slow", "write"].contains(&o.mode.as_str()))
            .map(|(n, _)| *n)
            .collect();
        let names = if long.is_empty() {
            selected.iter().map(|(n, _)| *n).collect()
        } else {
            long
        };
        if names.is_empty() {
            return self.history.push("(busy: nothing selected)".into());
        }
        let name = names[self.rng.random_range(0..names.len())].clone();
        let uid = server[&name].meta.uid.clone();
        let (run, from) = (self.run, self.log.lock().unwrap().len());
        let at = Instant::now();
        if requests
            .unbounded_send(ObjectRef::new(&name).within(NS))
            .is_err()
        {
            return;
        }
        self.triggers
            .push(Trig::new(at, Some(name.clone()), "reconcile_on (busy)"));
        let deadline = at + START_WAIT;
        let started = loop {
            let started = self.log.lock().unwrap()[from..].iter().any(|r| {
                r.run == run && r.seen == Seen::Reconciled && r.name == name && r.meta.uid == uid
            });
            if started || Instant::now() > deadline {
                break started;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        let rt = ResourceType::configmaps();
        self.h.delete(&rt, Some(NS), &name);
        match busy {
            Busy::Recreate => self.create_named(&name),
            Busy::DeleteThenCreate => {
                tokio::time::sleep(SLOW + Duration::from_millis(100)).await;
                self.create_named(&name);
            }
            Busy::Delete => {}
        }
        self.history.push(format!(
            "({name} uid {} {busy:?}{})",
            checks::short(&uid),
            if started {
                " while its reconcile ran"
            } else {
                ": its reconcile not seen"
            }
        ));
    }

    /// Before a restart (`tick`): a `reconcile_all_on` tick, and the restart once its pass
    /// is under way (its first objects reconciled: the tick was taken and its pass is
    /// recorded in the durable state). The tick is kept across the restart
    /// (`start_run`), owed by every object selected then.
    pub(super) async fn tick_before_restart(&mut self, tick: bool) {
        let Some(live) = self.live.as_ref().filter(|_| tick) else {
            return;
        };
        let (run, from) = (self.run, self.log.lock().unwrap().len());
        let at = Instant::now();
        if live.ticks.unbounded_send(()).is_err() {
            return;
        }
        // Objects reconciled only by a pass (or a change: none while quiescent).
        let deadline = at + PASS_WAIT;
        let passed = loop {
            let passed = self.log.lock().unwrap()[from..]
                .iter()
                .filter(|r| r.run == run && r.seen == Seen::Reconciled)
                .filter(|r| !matches!(r.meta.mode.as_deref(), Some("short" | "fail")))
                .count();
            if passed >= 2 || Instant::now() > deadline {
                break passed;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        // The pass's progress reaches the durable state (its batches go every 20 ms).
        tokio::time::sleep(Duration::from_millis(50)).await;
        self.history
            .push(format!("(tick before the restart: {passed} passed)"));
        if passed >= 2 {
            let mut t = Trig::new(at, None, "reconcile_all_on before a restart");
            t.restarted = Some(at);
            self.triggers.push(t);
        }
    }

    /// At a run's start: the ticks kept across the restart count their bound from now;
    /// every other trigger is lost with the run that stopped, as in kube-runtime.
    pub(super) fn carry_ticks(&mut self) {
        let now = Instant::now();
        self.triggers.retain(|t| t.restarted.is_some());
        for t in &mut self.triggers {
            t.restarted = Some(now);
        }
    }
}
