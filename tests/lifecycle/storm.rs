//! The change storm of the lifecycle model (issue 50, item 2): a `reconcile_all_on` tick
//! starts a long pass, and once the pass has passed some objects, changes of related
//! objects come for those objects, as fast as the controller takes them, until the pass is
//! done. Checked from the run's ordered reconcile log, in dispatches (reconciles, counted
//! in the order they started), not in wall-clock time:
//!
//! 1. changes go first: every change is reconciled, and a change waits behind at most
//!    `Q + ceil((Q+1)/3) + L` other dispatches, `Q` being the changes dispatched ahead of
//!    it, all due before it (the scheduler serves changes in the order they fall due), and
//!    `L` the concurrency limit: of the dispatches ahead of it, at most `ceil((Q+1)/3) + L`
//!    are pass work (plus [`REORDER`]);
//! 2. the pass keeps its share: every object is reconciled after the tick within
//!    `4·N + L` dispatches of it (`N` objects; plus [`REORDER`]);
//! 3. while both wait, pass work gets at least one dispatch in four.
//!
//! The storm's objects are `ok` objects marked first ([`STORM_MARK`] in `data.value`, before
//! the tick: their reconciles take [`crate::app::STORM_TAKES`], so that the changes wait
//! for the concurrency instead of running through it at once), and its changes are writes of
//! their related objects (`rel-<name>`, `data.value` `storm-<i>`): the related stream is not
//! shared, so no consumer of the shared stream stalls them on their way (the slow one holds
//! the watch for up to `MAX_STALL` every few events). An `ok` object is reconciled only when
//! something changes, so every reconcile of a storm object after the pass passed it is
//! owed to its storm change. The storm keeps a number of its changes written and not yet
//! reconciled ([`Op::ChangeStorm`]'s `outstanding`), so that changes always wait while the
//! pass runs; its objects are drawn with the model's seeded RNG (a seed drawn with the
//! operation, so the model's own draws do not depend on the timing).
//!
//! Slack, stated: the changes reach the controller in batches of the related stream's
//! events, each once it is on disk, so a change's count starts when the model sees it in
//! the related store on disk (polled every millisecond), or at the first reconcile of a
//! storm change written no earlier than it (the stream hands its changes on in order),
//! whichever comes first: the pass work dispatched while it was on its way is not counted
//! against it. The log records a reconcile when it starts, after its object is read (pass
//! work from the hot cache, a related change perhaps from disk), so the log's order may
//! differ from the dispatch order by up to [`REORDER`] places, which every bound allows.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use kube_persist_testkit::ResourceType;
use rand::{Rng, SeedableRng, rngs::StdRng};
use serde_json::json;

use super::Model;
use crate::app::{CONCURRENCY, NS, REL_NS, REL_STREAM, STORM_MARK, STORM_TAKES, Seen};
use crate::checks::{self, Trig};

/// How far the log's order may be from the dispatch order: the running reconciles' reads.
pub const REORDER: usize = 2 * CONCURRENCY as usize;
/// How long the marks, a previous pass and the pass's first objects may take.
const SETTLE_WAIT: Duration = Duration::from_secs(30);
/// Most a storm lasts (the pass then is far past its bound anyway).
const STORM_CAP: Duration = Duration::from_secs(40);
/// How long the changes written may take to be reconciled once the storm stops.
const DRAIN_WAIT: Duration = Duration::from_secs(15);
/// A storm object is written again only this long after its last reconcile started (so
/// that its change does not wait for that reconcile, held as the object is busy).
const REST: Duration = Duration::from_millis(3 * STORM_TAKES.as_millis() as u64);

pub const CHANGES_FIRST: &str = "changes go first: every change reconciled within its bound";
pub const PASS_BOUND: &str =
    "the pass keeps its share: a pass under a storm completes within its bound";
pub const PASS_SHARE: &str = "the pass keeps its share: one dispatch in four while changes wait";

/// What one reconcile of the run (in log order, from the tick) was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// The reconcile owed to storm change `i`.
    Storm(usize),
    /// The first reconcile after the tick of an object only the pass reconciles (`ok`,
    /// `slow`, `write`; a due requeue of a `slow` or `write` object, which the pass then
    /// counts as its own, is taken for pass work too).
    Pass,
    /// Anything else: requeues and retries of `short` and `fail` objects (or their pass
    /// work, which cannot be told apart), a `write` object's own write.
    Change,
}

/// One change of the storm.
struct Change {
    name: String,
    /// Reconciles of the run logged before it was written.
    written: usize,
    /// Reconciles of the run logged before the model saw it in the related store on disk
    /// (the store hands its events to the controller once they are on disk).
    arrived: Option<usize>,
    /// Its reconcile's place in the log.
    reconciled: Option<usize>,
}

/// The run's reconciles since the tick, as the storm reads them.
struct Tally {
    run: usize,
    /// Place in the model's log up to which it was read.
    read: usize,
    kinds: Vec<Kind>,
    /// Owned objects at the tick: name -> mode.
    owned: BTreeMap<String, String>,
    /// Objects reconciled since the tick, with the start of their last reconcile.
    seen: HashMap<String, Instant>,
    /// The place of the reconcile that completed the pass (every owned object reconciled).
    complete: Option<usize>,
    changes: Vec<Change>,
    /// Storm objects with a change not reconciled yet -> that change.
    outstanding: HashMap<String, usize>,
}

impl Tally {
    fn read(&mut self, log: &checks::Log) {
        let log = log.lock().unwrap();
        for rec in &log[self.read..] {
            if rec.run != self.run || rec.seen != Seen::Reconciled {
                continue;
            }
            let at = self.kinds.len();
            let first = self.seen.insert(rec.name.clone(), rec.at).is_none();
            let kind = if let Some(i) = self.outstanding.remove(&rec.name) {
                self.changes[i].reconciled = Some(at);
                Kind::Storm(i)
            } else if first
                && self
                    .owned
                    .get(&rec.name)
                    .is_some_and(|m| !["short", "fail"].contains(&m.as_str()))
            {
                Kind::Pass
            } else {
                Kind::Change
            };
            self.kinds.push(kind);
            if self.complete.is_none() && self.owned.keys().all(|n| self.seen.contains_key(n)) {
                self.complete = Some(at);
            }
        }
        self.read = log.len();
    }

    /// The storm objects a change may be written for now: marked, passed, none pending.
    fn eligible(&self, marked: &BTreeSet<String>) -> Vec<String> {
        marked
            .iter()
            .filter(|n| !self.outstanding.contains_key(*n))
            .filter(|n| self.seen.get(*n).is_some_and(|at| at.elapsed() >= REST))
            .cloned()
            .collect()
    }
}

impl Model {
    /// The change storm (see the module's doc), with `outstanding` changes kept written and
    /// not reconciled, its objects drawn from `seed`.
    pub(super) async fn change_storm(&mut self, step: usize, outstanding: usize, seed: u64) {
        let Some(live) = self.live.as_ref() else {
            return;
        };
        let (ticks, stats) = (live.ticks.clone(), live.stats.clone());
        let l = CONCURRENCY as usize;
        let server = checks::server_objects(&self.h);
        let owned: BTreeMap<String, String> = server
            .iter()
            .filter(|(_, o)| self.cfg.selects(&o.meta))
            .map(|(n, o)| (n.clone(), o.mode.clone()))
            .collect();
        let marked: BTreeSet<String> = owned
            .iter()
            .filter(|(_, m)| m.as_str() == "ok")
            .map(|(n, _)| n.clone())
            .collect();
        if marked.len() < 2 {
            return self.history.push("(change storm: too few objects)".into());
        }
        // Mark the storm's objects (their reconciles then take `STORM_TAKES`), and wait
        // until each is reconciled at its mark and no pass runs.
        let rt = ResourceType::configmaps();
        let mut marks = Vec::new();
        for name in &marked {
            let Some(mut o) = self.h.get(&rt, Some(NS), name) else {
                continue;
            };
            if o["data"]["value"]
                .as_str()
                .is_some_and(|v| v.starts_with(STORM_MARK))
            {
                continue;
            }
            o["data"]["value"] = json!(STORM_MARK);
            let w = self.h.apply(&rt, o);
            let rv = w["metadata"]["resourceVersion"]
                .as_str()
                .unwrap_or_default();
            marks.push((name.clone(), rv.to_string()));
        }
        let deadline = Instant::now() + SETTLE_WAIT;
        loop {
            let marked_done = {
                let log = self.log.lock().unwrap();
                let done: BTreeSet<(&str, &str)> = log
                    .iter()
                    .map(|r| (r.name.as_str(), r.rv.as_str()))
                    .collect();
                marks
                    .iter()
                    .all(|(n, rv)| done.contains(&(n.as_str(), rv.as_str())))
            };
            if marked_done && !stats.get().startup_pass_running {
                break;
            }
            if Instant::now() > deadline {
                // The marks' reconciles are checked after the step like any change.
                return self
                    .history
                    .push("(change storm: marks or a pass not done, no storm)".into());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }

        let n = owned.len();
        let pass_bound = 4 * n + l;
        let mut t = Tally {
            run: self.run,
            read: self.log.lock().unwrap().len(),
            kinds: Vec::new(),
            owned,
            seen: HashMap::new(),
            complete: None,
            changes: Vec::new(),
            outstanding: HashMap::new(),
        };
        let at = Instant::now();
        if ticks.unbounded_send(()).is_err() {
            return;
        }
        let mut tick = Trig::new(at, None, "reconcile_all_on (change storm)");
        tick.within = SETTLE_WAIT + STORM_CAP;
        self.triggers.push(tick);

        // The pass passes some of the storm's objects first.
        let mut pick = StdRng::seed_from_u64(seed);
        let deadline = Instant::now() + SETTLE_WAIT;
        loop {
            t.read(&self.log);
            if t.complete.is_some() {
                return self
                    .history
                    .push("(change storm: the pass was done before the storm)".into());
            }
            if t.eligible(&marked).len() >= outstanding {
                break;
            }
            if Instant::now() > deadline {
                return self
                    .history
                    .push("(change storm: the pass did not reach the storm's objects)".into());
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }

        // The storm: `outstanding` changes written and not reconciled, until the pass is
        // done (or past its bound: nothing more to learn).
        let storm_from = t.kinds.len();
        let end = Instant::now() + STORM_CAP;
        while t.complete.is_none() && t.kinds.len() <= pass_bound + REORDER && Instant::now() < end
        {
            let mut eligible = t.eligible(&marked);
            while t.outstanding.len() < outstanding && !eligible.is_empty() {
                let name = eligible.swap_remove(pick.random_range(0..eligible.len()));
                let i = t.changes.len();
                t.outstanding.insert(name.clone(), i);
                t.changes.push(Change {
                    name: name.clone(),
                    written: t.kinds.len(),
                    arrived: None,
                    reconciled: None,
                });
                self.h.apply(
                    &rt,
                    json!({
                        "apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": format!("rel-{name}"), "namespace": REL_NS},
                        "data": {"value": format!("storm-{i}")},
                    }),
                );
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
            self.arrivals(&mut t);
        }
        let stormed = Instant::now() < end;
        // Every change reconciled, and the pass done (to count it), or the waits over.
        let deadline = Instant::now() + DRAIN_WAIT;
        while (!t.outstanding.is_empty() || t.complete.is_none()) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(1)).await;
            self.arrivals(&mut t);
        }
        let found = judge(&t, storm_from, pass_bound, stormed, outstanding);
        self.history.push(found.summary);
        for f in found.violations {
            self.report(step, f);
        }
    }
}

impl Model {
    /// Reads the log on, and marks the storm's changes the related store holds on disk
    /// (so the controller has them, or is about to) as arrived at the log's end: the
    /// log is read after the store, so a change is not taken to wait before it arrived.
    fn arrivals(&self, t: &mut Tally) {
        let Some((db, _)) = self.db.as_ref() else {
            return t.read(&self.log);
        };
        let stored: Vec<usize> = t
            .outstanding
            .values()
            .copied()
            .filter(|i| t.changes[*i].arrived.is_none())
            .filter(|i| {
                let name = format!("rel-{}", t.changes[*i].name);
                let json = db.raw_get(REL_STREAM, Some(REL_NS), &name).ok().flatten();
                let obj = json.and_then(|j| serde_json::from_slice::<serde_json::Value>(&j).ok());
                obj.is_some_and(|o| o["data"]["value"] == format!("storm-{i}").as_str())
            })
            .collect();
        t.read(&self.log);
        for i in stored {
            let c = &mut t.changes[i];
            if c.reconciled.is_none() {
                c.arrived = Some(t.kinds.len());
            }
        }
    }
}

struct Judged {
    summary: String,
    violations: Vec<checks::Found>,
}

fn judge(t: &Tally, storm_from: usize, pass_bound: usize, stormed: bool, k: usize) -> Judged {
    let l = CONCURRENCY as usize;
    let mut violations = Vec::new();
    // 1. Every change reconciled, with at most its share of pass work ahead of it.
    let lost: Vec<&str> = t
        .changes
        .iter()
        .filter(|c| c.reconciled.is_none())
        .map(|c| c.name.as_str())
        .collect();
    if !lost.is_empty() {
        violations.push(checks::found(
            CHANGES_FIRST,
            format!(
                "{} of {} changes not reconciled {DRAIN_WAIT:?} after the storm: {:?}",
                lost.len(),
                t.changes.len(),
                &lost[..lost.len().min(6)]
            ),
        ));
    }
    // The reconciles of storm changes, by when their change was written.
    let storm_at: Vec<(usize, usize)> = t
        .changes
        .iter()
        .filter_map(|c| Some((c.written, c.reconciled?)))
        .collect();
    // The change with the most pass work ahead of it over its allowance: (excess, i, pass,
    // allowed).
    let mut worst: Option<(isize, usize, usize, usize)> = None;
    let mut late = Vec::new();
    for (i, c) in t.changes.iter().enumerate() {
        let Some(done) = c.reconciled else { continue };
        // Counted from when it was seen on disk, or from the first reconcile of a change
        // written no earlier than it (the related stream hands changes on in order),
        // whichever came first.
        let from = storm_at
            .iter()
            .filter(|(w, _)| *w >= c.written)
            .map(|(_, r)| *r)
            .chain(c.arrived)
            .min()
            .unwrap_or(done)
            .min(done);
        let ahead = &t.kinds[from..done];
        let pass = ahead.iter().filter(|k| **k == Kind::Pass).count();
        let q = ahead.len() - pass;
        let allowed = (q + 1).div_ceil(3) + l + REORDER;
        let excess = pass as isize - allowed as isize;
        if worst.is_none_or(|w| excess > w.0) {
            worst = Some((excess, i, pass, allowed));
        }
        if pass > allowed {
            late.push(format!(
                "change {i} ({}): {} dispatches ahead, {pass} of them pass work (allowed {allowed} for Q={q})",
                c.name,
                ahead.len()
            ));
        }
    }
    if !late.is_empty() {
        violations.push(checks::found(
            CHANGES_FIRST,
            format!(
                "{} of {} changes behind more pass work than their bound Q + ceil((Q+1)/3) + L (+{REORDER}): {}",
                late.len(),
                t.changes.len(),
                late[..late.len().min(4)].join("; ")
            ),
        ));
    }
    // 2. The pass done within 4·N + L dispatches of the tick.
    let n = t.owned.len();
    match t.complete {
        Some(at) if at < pass_bound + REORDER => {}
        Some(at) => violations.push(checks::found(
            PASS_BOUND,
            format!(
                "{n} objects: every one reconciled only after {} dispatches (bound 4·N + L = {pass_bound}, +{REORDER}); {} changes in the storm",
                at + 1,
                t.changes.len()
            ),
        )),
        None => violations.push(checks::found(
            PASS_BOUND,
            format!(
                "{n} objects: {} not reconciled after {} dispatches (bound 4·N + L = {pass_bound}, +{REORDER}){}",
                n - t.seen.len().min(n),
                t.kinds.len(),
                if stormed { "" } else { ", storm stopped at its time cap" }
            ),
        )),
    }
    // 3. While both wait (from the storm's first reconcile until the pass is done or the
    // storm's last change reconciled), one dispatch in four is pass work. A `short` or
    // `fail` object's pass work is not told apart from its requeues: each counts for one.
    let first = storm_at.iter().map(|(_, r)| *r).min();
    let last = storm_at.iter().map(|(_, r)| *r).max();
    let mut share = String::new();
    if let (Some(first), Some(last)) = (first, last) {
        let until = t.complete.map_or(last, |c| c.min(last));
        let window = &t.kinds[first.min(until)..until];
        let w = window.len();
        let pass = window.iter().filter(|k| **k == Kind::Pass).count();
        let hidden = t
            .owned
            .values()
            .filter(|m| ["short", "fail"].contains(&m.as_str()))
            .count();
        share = format!("; share {pass}(+{hidden})/{w}");
        if pass + hidden + l < w / 4 {
            violations.push(checks::found(
                PASS_SHARE,
                format!(
                    "{pass} of {w} dispatches were pass work (+{hidden} short/fail objects that may have been) while changes waited: fewer than one in four (-{l})"
                ),
            ));
        }
    }
    let worst = worst.map_or(String::new(), |(_, i, p, a)| {
        format!("; most pass work ahead of a change {p} (change {i}, allowed {a})")
    });
    let summary = format!(
        "(change storm: {n} objects, {k} outstanding, {} changes from dispatch {storm_from}; pass done at {:?} (bound {pass_bound}){worst}{share})",
        t.changes.len(),
        t.complete.map(|c| c + 1),
    );
    Judged {
        summary,
        violations,
    }
}
