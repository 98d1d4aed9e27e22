//! The controller's invariants of the lifecycle model, checked once the store is quiescent:
//! what every selected object is owed (a reconcile at its latest version and uid, due
//! requeues), what each trigger is owed (also a tick across restarts), that no run
//! reconciles outside its selection, and that the durable reconcile state tracks the store.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ConfigMap;
use kube_persist::Reader;

use super::{Found, Log, Obj, RECONCILE_WAIT, RunChecks, few, found};
use crate::app::{RunCfg, Seen};

/// Invariant: every selected object reconciled at the version and uid the server has.
pub const LATEST: &str = "every object reconciled at its latest version and uid";
/// Invariant: an object deleted and created again under its name (another uid) is
/// reconciled as the new uid, not taken as handled by the old uid's reconciles.
pub const NEW_UID: &str = "a recreated object is reconciled as its new uid";

/// The controller, once the store is quiescent: every selected object reconciled at its
/// current version and uid, as the reconciler saw them (by any run; a version a reconcile
/// wrote itself, keeping the generation, counts as reconciled, and so does one whose uid
/// was reconciled at the same generation: the `generation` predicate skips a change of
/// labels; never a reconcile of another uid under the same name: an object created again
/// is owed a reconcile as its new uid, [`NEW_UID`]), every selected `short`/`fail` object
/// reconciled again after `since` (its due requeue or retry fired).
pub async fn reconciled(
    log: &Log,
    cfg: &RunCfg,
    server: &BTreeMap<String, Obj>,
    since: Instant,
    rc: &mut RunChecks,
) -> Vec<Found> {
    let owed: Vec<(String, String)> = server
        .iter()
        .filter(|(n, o)| {
            cfg.selects(&o.meta) && !rc.unreconciled.contains(&((*n).clone(), o.rv.clone()))
        })
        .map(|(n, o)| (n.clone(), o.rv.clone()))
        .collect();
    let requeued: Vec<String> = server
        .iter()
        .filter(|(n, o)| {
            cfg.selects(&o.meta)
                && ["short", "fail"].contains(&o.mode.as_str())
                && !rc.lost_requeues.contains(*n)
        })
        .map(|(n, _)| n.clone())
        .collect();
    let deadline = Instant::now() + RECONCILE_WAIT;
    loop {
        // Of the objects missing: (name, rv), and whether the name was reconciled only as
        // other uids (then it is a recreated object taken as handled).
        let (missing, lost) = {
            let log = log.lock().unwrap();
            let done: BTreeSet<(&str, &str, &str)> = log
                .iter()
                .map(|r| (r.name.as_str(), r.meta.uid.as_str(), r.rv.as_str()))
                .collect();
            let uids: BTreeSet<(&str, &str)> = log
                .iter()
                .filter(|r| r.seen == Seen::Reconciled)
                .map(|r| (r.name.as_str(), r.meta.uid.as_str()))
                .collect();
            // A `fail` object's last reconcile failed: its generation excuses nothing.
            let generations: BTreeSet<(&str, i64)> = log
                .iter()
                .filter(|r| r.seen == Seen::Reconciled && r.meta.mode.as_deref() != Some("fail"))
                .map(|r| (r.meta.uid.as_str(), r.meta.generation))
                .collect();
            let missing: Vec<(String, String, bool)> = owed
                .iter()
                .filter_map(|(n, rv)| {
                    let o = server.get(n)?;
                    let uid = o.meta.uid.as_str();
                    let reconciled = done.contains(&(n.as_str(), uid, rv.as_str()))
                        || generations.contains(&(uid, o.generation));
                    let as_other = !uids.contains(&(n.as_str(), uid))
                        && uids.iter().any(|(name, _)| name == n);
                    (!reconciled).then(|| (n.clone(), rv.clone(), as_other))
                })
                .collect();
            let again: BTreeSet<&str> = log
                .iter()
                .rev()
                .take_while(|r| r.at > since)
                .filter(|r| r.seen == Seen::Reconciled)
                .map(|r| r.name.as_str())
                .collect();
            let lost: Vec<String> = requeued
                .iter()
                .filter(|n| !again.contains(n.as_str()))
                .cloned()
                .collect();
            (missing, lost)
        };
        if missing.is_empty() && lost.is_empty() {
            return Vec::new();
        }
        if Instant::now() > deadline {
            let mut out = Vec::new();
            let (recreated, other): (Vec<_>, Vec<_>) = missing.iter().partition(|m| m.2);
            for (invariant, missing) in [(NEW_UID, recreated), (LATEST, other)] {
                if missing.is_empty() {
                    continue;
                }
                let names: Vec<String> = missing.iter().map(|m| m.0.clone()).collect();
                let now: Vec<(&String, &str, &str, i64)> = missing
                    .iter()
                    .filter_map(|m| Some((&m.0, server.get(&m.0)?)))
                    .map(|(n, o)| (n, o.rv.as_str(), short(&o.meta.uid), o.generation))
                    .collect();
                out.push(found(
                    invariant,
                    format!(
                        "not within {RECONCILE_WAIT:?} of Synced: {} (name, rv, uid, generation now); seen: {}",
                        few(&now),
                        history(log, &names)
                    ),
                ));
            }
            if !lost.is_empty() {
                out.push(found(
                    "no due requeue lost",
                    format!(
                        "requeued every {:?}, not reconciled within {RECONCILE_WAIT:?}: {}",
                        crate::app::SHORT,
                        few(&lost)
                    ),
                ));
            }
            rc.unreconciled
                .extend(missing.into_iter().map(|(n, rv, _)| (n, rv)));
            rc.lost_requeues.extend(lost);
            return out;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The first 8 characters of a uid (enough to tell uids apart in a report).
pub fn short(uid: &str) -> &str {
    uid.get(..8).unwrap_or(uid)
}

/// No reconcile of run `run` (with `cfg`) of an object outside its selection: its shard,
/// and its selectors (by the object's labels and name at the version reconciled).
pub fn owned_only(log: &Log, run: usize, cfg: &RunCfg, rc: &mut RunChecks) -> Vec<Found> {
    let log = log.lock().unwrap();
    let foreign: Vec<(String, String)> = log[rc.owned_upto..]
        .iter()
        .filter(|r| r.run == run && !cfg.selects(&r.meta))
        .map(|r| (r.name.clone(), r.rv.clone()))
        .collect();
    rc.owned_upto = log.len();
    if foreign.is_empty() {
        return Vec::new();
    }
    vec![found(
        "no object reconciled outside the run's selection (shard, selectors)",
        format!("selection {}: {}", cfg.sel, few(foreign)),
    )]
}

/// How long a trigger may wait for its reconcile: the debounce (none), the longest running
/// reconcile ([`crate::app::SLOW`]) times the queue before it at the concurrency limit (a
/// tick reconciles every object), and a margin; far below a `slow` or `write` object's one-minute requeue.
const TRIGGER_WAIT: Duration = Duration::from_secs(15);

/// A trigger sent to the live run: a reconcile of `name` (every object if `None`) must start
/// after `at`, and at most `within` after it (after the last restart it crossed, for a tick
/// whose pass a restart interrupted: the durable controller resumes it).
#[derive(Debug, Clone)]
pub struct Trig {
    pub at: Instant,
    pub name: Option<String>,
    pub what: &'static str,
    pub within: Duration,
    /// When the last run it crossed started (a tick kept across restarts).
    pub restarted: Option<Instant>,
}

impl Trig {
    /// A trigger owed a reconcile within [`TRIGGER_WAIT`].
    pub fn new(at: Instant, name: Option<String>, what: &'static str) -> Trig {
        Trig {
            at,
            name,
            what,
            within: TRIGGER_WAIT,
            restarted: None,
        }
    }

    /// When its reconciles are due by.
    fn by(&self) -> Instant {
        self.restarted.map_or(self.at, |r| r.max(self.at)) + self.within
    }
}

/// Invariant: a trigger's reconciles start after it and within its bound.
pub const TRIGGERED: &str =
    "every trigger is followed by a reconcile of its object within its bound";
/// Invariant: a tick whose pass a restart interrupted is swept within its bound of the
/// restart, by the pass the durable controller resumes (in a child, or the next run).
pub const TICK_ACROSS: &str = "every tick is swept within its bound across restarts";

/// Every trigger of this run is followed by a reconcile of its object (of every owned object,
/// for a tick) that started after it, within its bound ([`TRIGGER_WAIT`], or a storm
/// tick's): never held until a later requeue's due time, never skipped as already
/// reconciled, never starved by the ticks after it; a tick kept across restarts is swept by
/// reconciles of any run (a child's too) after it, within its bound of the last restart.
/// Objects deleted since (or outside the selection) owe nothing; an object created again
/// under the name owes it too. Checked triggers are removed from `pending`.
pub async fn triggered(
    log: &Log,
    cfg: &RunCfg,
    server: &BTreeMap<String, Obj>,
    pending: &mut Vec<Trig>,
) -> Vec<Found> {
    let owed = |t: &Trig| -> Vec<String> {
        match &t.name {
            Some(n) if server.get(n).is_some_and(|o| cfg.selects(&o.meta)) => vec![n.clone()],
            Some(_) => Vec::new(),
            None => server
                .iter()
                .filter(|(_, o)| cfg.selects(&o.meta))
                .map(|(n, _)| n.clone())
                .collect(),
        }
    };
    loop {
        let now = Instant::now();
        // Per owed object: (trigger, how long ago, name, past its bound, across restarts).
        let late: Vec<(&'static str, Duration, String, bool, bool)> = {
            let log = log.lock().unwrap();
            let mut starts: BTreeMap<&str, Vec<Instant>> = BTreeMap::new();
            for r in log.iter().filter(|r| r.seen == Seen::Reconciled) {
                starts.entry(r.name.as_str()).or_default().push(r.at);
            }
            pending
                .iter()
                .flat_map(|t| {
                    let by = t.by();
                    owed(t)
                        .into_iter()
                        .filter(|n| {
                            !starts
                                .get(n.as_str())
                                .is_some_and(|at| at.iter().any(|at| *at > t.at && *at <= by))
                        })
                        .map(|n| (t.what, t.at.elapsed(), n, now > by, t.restarted.is_some()))
                        .collect::<Vec<_>>()
                })
                .collect()
        };
        if late.is_empty() {
            pending.clear();
            return Vec::new();
        }
        if late.iter().any(|l| l.3) {
            pending.clear();
            let mut out = Vec::new();
            for (invariant, across) in [(TRIGGERED, false), (TICK_ACROSS, true)] {
                let overdue: Vec<_> = late
                    .iter()
                    .filter(|l| l.3 && l.4 == across)
                    .map(|(what, ago, n, ..)| (*what, *ago, n.clone()))
                    .collect();
                if !overdue.is_empty() {
                    let detail =
                        format!("(trigger, since, object) past the bound: {}", few(overdue));
                    out.push(found(invariant, detail));
                }
            }
            return out;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The owned `write` objects that do not show their value yet: once there are none, the
/// controller's own writes are done, and the server stays put during the checks.
pub fn unmirrored(server: &BTreeMap<String, Obj>, cfg: &RunCfg) -> Vec<(String, String)> {
    server
        .iter()
        .filter(|(_, o)| o.mode == "write" && !o.mirrored && cfg.selects(&o.meta))
        .map(|(n, o)| (n.clone(), o.rv.clone()))
        .collect()
}

/// What `log` shows of the objects `names` (for a violation's detail).
pub fn history(log: &Log, names: &[String]) -> String {
    let log = log.lock().unwrap();
    let seen: Vec<String> = log
        .iter()
        .filter(|r| names.contains(&r.name))
        .map(|r| {
            let uid = short(&r.meta.uid);
            format!(
                "{} {} {} uid {uid} (run {})",
                r.seen.word(),
                r.name,
                r.rv,
                r.run
            )
        })
        .collect();
    let from = seen.len().saturating_sub(8);
    seen[from..].join(", ")
}

/// How long the durable state may take to show the stored objects: its batching window,
/// and the reconciles of deletions that forget records.
const RECORDS_WAIT: Duration = Duration::from_secs(5);

/// The durable reconcile state tracks exactly the stored objects: no record is forgotten
/// for a stored object, none is kept for an object the store no longer holds, and
/// `controller_states()` counts as many objects.
pub async fn records(db: &kube_persist::Db, reader: &Reader<ConfigMap>) -> Vec<Found> {
    let deadline = Instant::now() + RECORDS_WAIT;
    loop {
        let stored: BTreeSet<String> = reader
            .iter()
            .filter_map(|o| o.ok()?.metadata.name.clone())
            .collect();
        let recorded: BTreeSet<String> = match db.reconcile_states(crate::app::CONTROLLER) {
            Ok(records) => records.filter_map(|r| Some(r.ok()?.name)).collect(),
            Err(e) => return vec![found("the reconcile state reads", e.to_string())],
        };
        let counted = db
            .controller_states()
            .ok()
            .and_then(|s| s.into_iter().find(|c| c.name == crate::app::CONTROLLER))
            .map_or(0, |c| c.objects);
        let forgotten: Vec<_> = stored.difference(&recorded).collect();
        let kept: Vec<_> = recorded.difference(&stored).collect();
        if forgotten.is_empty() && kept.is_empty() && counted == stored.len() as u64 {
            return Vec::new();
        }
        if Instant::now() > deadline {
            let mut out = Vec::new();
            if !forgotten.is_empty() {
                out.push(found(
                    "no reconcile record is forgotten for a stored object",
                    few(forgotten),
                ));
            }
            if !kept.is_empty() {
                out.push(found(
                    "no reconcile record of an object the store does not hold",
                    few(kept),
                ));
            }
            if counted != stored.len() as u64 {
                out.push(found(
                    "controller_states() counts the stored objects",
                    format!("{counted} objects counted, {} stored", stored.len()),
                ));
            }
            return out;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
