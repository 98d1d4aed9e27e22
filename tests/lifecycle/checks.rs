//! The invariants of the lifecycle model, checked once the server is quiescent.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ConfigMap;
use kube_persist::{Reader, SyncPhase};
use kube_persist_testkit::{ResourceType, ServerHandle};

use crate::app::{NS, RunCfg, Seen};
use crate::select::Meta;

mod owed;
pub use owed::*;

/// How long the store may take to be `Synced`, live and at the server's resourceVersion.
pub const SYNC_WAIT: Duration = Duration::from_secs(20);
/// How long the controller may take to reconcile what it owes, once the store is synced.
pub const RECONCILE_WAIT: Duration = Duration::from_secs(5);

/// One reconcile (or a reconciler's write), as seen by the test process.
#[derive(Debug, Clone)]
pub struct Rec {
    pub seen: Seen,
    pub at: Instant,
    pub run: usize,
    pub name: String,
    pub rv: String,
    /// Its metadata then (uid, labels: what the selection is decided on).
    pub meta: Meta,
}

/// Every reconcile of every run, in the order the test saw them.
pub type Log = Arc<Mutex<Vec<Rec>>>;

/// A server object: resourceVersion, mode label, metadata, and whether a `write` object shows
/// its value in its annotation.
#[derive(Debug, Clone)]
pub struct Obj {
    pub rv: String,
    pub generation: i64,
    pub mode: String,
    pub mirrored: bool,
    /// Its metadata (what a selection is decided on).
    pub meta: Meta,
}

/// `name -> object` of the model's ConfigMaps on the server.
pub fn server_objects(h: &ServerHandle) -> BTreeMap<String, Obj> {
    h.list(&ResourceType::configmaps())
        .into_iter()
        .filter(|o| o["metadata"]["namespace"] == NS)
        .map(|o| {
            let m = &o["metadata"];
            let s = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
            let obj = Obj {
                rv: s(&m["resourceVersion"]),
                generation: m["generation"].as_i64().unwrap_or_default(),
                mode: s(&m["labels"]["mode"]),
                mirrored: crate::app::mirrored(&o),
                meta: Meta::of_json(&o),
            };
            (s(&m["name"]), obj)
        })
        .collect()
}

/// A broken invariant: which one, and what was seen.
#[derive(Debug, Clone)]
pub struct Found {
    pub invariant: &'static str,
    pub detail: String,
}

pub fn found(invariant: &'static str, detail: String) -> Found {
    Found { invariant, detail }
}

pub fn few<T: std::fmt::Debug>(items: impl IntoIterator<Item = T>) -> String {
    let all: Vec<T> = items.into_iter().collect();
    let n = all.len();
    let shown: Vec<_> = all.into_iter().take(6).collect();
    format!("{n} {shown:?}")
}

/// The state one run's checks carry from step to step: what was already reported missing
/// (reported once per run, not waited for again).
#[derive(Default)]
pub struct RunChecks {
    pub unreconciled: BTreeSet<(String, String)>,
    pub lost_requeues: BTreeSet<String>,
    /// Reconciles of this run's log already checked for ownership.
    pub owned_upto: usize,
}

/// How long "caught up" may trail the checkpoint reaching the server's resourceVersion.
const CAUGHT_UP_LAG: Duration = Duration::from_secs(5);

/// Waits until the store is `Synced`, live and at the server's current resourceVersion, and
/// then reports caught up.
pub async fn quiesce(reader: &Reader<ConfigMap>, h: &ServerHandle) -> Result<(), Found> {
    let deadline = Instant::now() + SYNC_WAIT;
    loop {
        let server = h.resource_version();
        let at = reader.checkpoint();
        if reader.phase() == SyncPhase::Synced && reader.is_live() && at.as_deref() == Some(&server)
        {
            // At the server's version and live: caught up too (it may lag the commit that
            // moved the checkpoint by a moment, not more).
            return match tokio::time::timeout(CAUGHT_UP_LAG, reader.wait_until_caught_up()).await {
                Ok(Ok(())) => Ok(()),
                _ => Err(found(
                    "a live store at the server's resourceVersion reports caught up",
                    format!("{:?}", reader.freshness()),
                )),
            };
        }
        if Instant::now() > deadline {
            return Err(found(
                "store Synced and live at the server's resourceVersion",
                format!(
                    "after {SYNC_WAIT:?}: phase {:?}, live {}, checkpoint {at:?}, server {server}",
                    reader.phase(),
                    reader.is_live()
                ),
            ));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The store, once quiescent: equal to the server's selection, object by object (name,
/// resourceVersion, uid); nothing outside the selection; `len()` equal to the records; the index consistent.
pub fn store_matches(
    reader: &Reader<ConfigMap>,
    cfg: &RunCfg,
    server: &BTreeMap<String, Obj>,
) -> Vec<Found> {
    let mut out = Vec::new();
    // Object by object: name, resourceVersion and uid (a store that kept an object deleted
    // and created again under its name holds another uid).
    let want: BTreeMap<&str, (&str, &str)> = server
        .iter()
        .filter(|(_, o)| cfg.selects(&o.meta))
        .map(|(n, o)| (n.as_str(), (o.rv.as_str(), o.meta.uid.as_str())))
        .collect();
    let stored: Vec<ConfigMap> = reader
        .iter()
        .map(|o| (*o.expect("decodes")).clone())
        .collect();
    let name = |c: &ConfigMap| c.metadata.name.clone().unwrap_or_default();
    let have: BTreeMap<String, (String, String)> = stored
        .iter()
        .map(|c| {
            let m = &c.metadata;
            let rv = m.resource_version.clone().unwrap_or_default();
            (name(c), (rv, m.uid.clone().unwrap_or_default()))
        })
        .collect();
    let missing: Vec<_> = want.keys().filter(|k| !have.contains_key(**k)).collect();
    let extra: Vec<_> = have
        .keys()
        .filter(|k| !want.contains_key(k.as_str()))
        .collect();
    let stale: Vec<_> = have
        .iter()
        .filter(|(k, (rv, uid))| {
            want.get(k.as_str())
                .is_some_and(|w| (w.0, w.1) != (rv.as_str(), uid.as_str()))
        })
        .collect();
    if !missing.is_empty() || !extra.is_empty() || !stale.is_empty() {
        out.push(found(
            "store equals the server at its checkpoint",
            format!(
                "store {} vs server {}: missing {}, extra {}, stale {}",
                have.len(),
                want.len(),
                few(missing),
                few(extra),
                few(stale)
            ),
        ));
    }
    let outside: Vec<_> = stored
        .iter()
        .filter(|c| !cfg.selects(&Meta::of(&c.metadata, false)))
        .map(name)
        .collect();
    if !outside.is_empty() {
        out.push(found("no object outside the selection", few(outside)));
    }
    if cfg.transform {
        let untransformed: Vec<_> = stored
            .iter()
            .filter(|c| {
                let blob = c.data.as_ref().is_some_and(|d| d.contains_key("blob"));
                !Meta::of(&c.metadata, blob).transformed || blob
            })
            .map(name)
            .collect();
        if !untransformed.is_empty() {
            out.push(found(
                "every stored object went through the transform",
                few(untransformed),
            ));
        }
    }
    let records = stored.len();
    if reader.len() != records {
        out.push(found(
            "len() equals the number of records",
            format!("len() {} but iter() gives {records}", reader.len()),
        ));
    }
    if cfg.index {
        let label = |c: &ConfigMap, k: &str| {
            c.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(k))
                .cloned()
                .unwrap_or_default()
        };
        let values = [("mode", "ok"), ("mode", "short"), ("mode", "fail")]
            .into_iter()
            .chain(crate::select::TIERS.map(|t| (crate::select::TIER, t)));
        for (k, v) in values {
            let by_label: BTreeSet<String> = stored
                .iter()
                .filter(|c| label(c, k) == v)
                .map(name)
                .collect();
            let indexed: Result<BTreeSet<String>, _> = reader
                .by_index(&format!("label:{k}"), v)
                .map(|it| it.map(|o| name(&o.expect("decodes"))).collect());
            match indexed {
                Ok(i) if i == by_label => {}
                Ok(i) => out.push(found(
                    "the index equals the stored objects",
                    format!("{k}={v}: index {} vs store {}", few(&i), few(&by_label)),
                )),
                Err(e) => out.push(found(
                    "the index equals the stored objects",
                    format!("by_index(label:{k}) on a Synced store: {e}"),
                )),
            }
        }
    }
    out
}

/// The async reads give what the blocking ones give, once quiescent: `iter_stream` the
/// objects and versions of `iter`, `get_named_async` each of them.
pub async fn async_reads_match(reader: &Reader<ConfigMap>) -> Vec<Found> {
    use futures::TryStreamExt;
    let key = |c: &ConfigMap| {
        (
            c.metadata.name.clone().unwrap_or_default(),
            c.metadata.resource_version.clone().unwrap_or_default(),
        )
    };
    let blocking: Vec<_> = reader.iter().map(|o| key(&o.expect("decodes"))).collect();
    let streamed: Vec<_> = match reader.iter_stream().try_collect::<Vec<_>>().await {
        Ok(objs) => objs.iter().map(|o| key(o)).collect(),
        Err(e) => return vec![found("iter_stream reads the store", e.to_string())],
    };
    let mut out = Vec::new();
    if streamed != blocking {
        out.push(found(
            "iter_stream gives what iter gives",
            format!("{} streamed vs {} iterated", streamed.len(), blocking.len()),
        ));
    }
    let namespaces: Vec<Option<String>> = reader
        .iter()
        .take(20)
        .map(|o| o.expect("decodes").metadata.namespace.clone())
        .collect();
    for ((name, rv), ns) in blocking.iter().zip(namespaces) {
        let got = reader.get_named_async(ns.as_deref(), name).await;
        let got_rv = got.as_ref().ok().and_then(|o| o.as_ref()).map(|c| key(c).1);
        if got_rv.as_deref() != Some(rv.as_str()) {
            out.push(found(
                "get_named_async gives what iter gives",
                format!("{name}: {got_rv:?} vs {rv}"),
            ));
        }
    }
    out
}

/// How long the store may take to reach the server's version after a churn of a live
/// store: the shared stream's stall bound, twice (a slow consumer stalls the watch for at
/// most `MAX_STALL` in a row, then is lagged until its queue is empty, and may fill it once
/// more), and a margin for the writes themselves.
const HOLD_WAIT: Duration = Duration::from_secs(4);

/// No consumer of the shared stream holds the watch beyond the stall bound: the store (which
/// the hub feeds as it delivers) reaches the version the server had after a churn within
/// [`HOLD_WAIT`] of it, whatever the slow consumer's pace.
pub async fn watch_not_held(reader: &Reader<ConfigMap>, at: Instant, rv: &str) -> Option<Found> {
    let by = at + HOLD_WAIT;
    loop {
        let reached = reader
            .checkpoint()
            .and_then(|c| kube_persist::resource_version::at_least(&c, rv))
            .unwrap_or(false);
        if reached {
            return None;
        }
        if Instant::now() > by {
            return Some(found(
                "no consumer of a shared stream holds the watch beyond the stall bound",
                format!(
                    "the store's checkpoint {:?} is not at {rv} {HOLD_WAIT:?} after the churn",
                    reader.checkpoint()
                ),
            ));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// How long after a run starts the shared stream's other consumers must have their start
/// signal: the late one is first polled after `LATE_POLL`, the slow one drains its queue at
/// its pace, and the first list may take seconds.
const STARTED_WAIT: Duration = Duration::from_secs(20);

/// Every consumer of the shared stream gets its start signal (`InitDone` or `Resumed`),
/// even one lagged before it came.
pub async fn consumers_started(consumed: &crate::app::Consumed, since: Instant) -> Option<Found> {
    let by = since + STARTED_WAIT;
    loop {
        let started = [0, 1].map(|i| consumed.started[i].load(std::sync::atomic::Ordering::SeqCst));
        if started.iter().all(|n| *n > 0) {
            return None;
        }
        if Instant::now() > by {
            let lagged =
                [0, 1].map(|i| consumed.lagged[i].load(std::sync::atomic::Ordering::SeqCst));
            return Some(found(
                "every consumer of a shared stream gets its start signal",
                format!(
                    "start signals (slow, late) {started:?}, lagged {lagged:?}, {STARTED_WAIT:?} after the run started"
                ),
            ));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// How long the shared stream's other consumers may take, once the store is quiescent, to
/// hold what it holds: the slow one, hurried meanwhile, takes what is queued for it (and
/// reads the store again if it was lagged).
const HELD_WAIT: Duration = Duration::from_secs(6);

/// Every consumer of the shared stream, once the store is quiescent, holds exactly the
/// run's selection (what the server has of it): it was given every change of the store,
/// and never kept an object that left it.
pub async fn consumers_hold(
    consumed: &crate::app::Consumed,
    cfg: &RunCfg,
    server: &BTreeMap<String, Obj>,
) -> Vec<Found> {
    let want: BTreeMap<String, String> = server
        .iter()
        .filter(|(_, o)| cfg.selects(&o.meta))
        .map(|(n, o)| (n.clone(), o.rv.clone()))
        .collect();
    let by = Instant::now() + HELD_WAIT;
    consumed
        .hurry
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let _slow_again = SlowAgain(consumed);
    loop {
        let held = [0, 1].map(|i| consumed.held[i].lock().unwrap().clone());
        let off: Vec<usize> = (0..2).filter(|i| held[*i] != want).collect();
        if off.is_empty() {
            return Vec::new();
        }
        if Instant::now() > by {
            let detail = off
                .iter()
                .map(|i| {
                    let trace = consumed.trace[*i].lock().unwrap();
                    let trace: Vec<&String> = trace.iter().collect();
                    format!(
                        "consumer {i}: {}; its last events: {trace:?}",
                        crate::common::diff("held", &held[*i], &want)
                    )
                })
                .collect::<Vec<_>>()
                .join("; ");
            return vec![found(
                "a consumer of a stream holds exactly its selection once caught up",
                format!("{detail} ({HELD_WAIT:?} after the store was)"),
            )];
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Makes the slow consumer slow again when the check is done.
struct SlowAgain<'a>(&'a crate::app::Consumed);

impl Drop for SlowAgain<'_> {
    fn drop(&mut self) {
        self.0
            .hurry
            .store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

/// No consumer of the shared stream was given an object outside the run's selection (by
/// the object's own metadata); what was is taken from `consumed`.
pub fn given_outside(consumed: &crate::app::Consumed) -> Option<Found> {
    let given = std::mem::take(&mut *consumed.outside.lock().unwrap());
    (!given.is_empty()).then(|| {
        found(
            "no consumer of a stream is given an object outside its selection",
            format!("{} {:?}", given.len(), &given[..given.len().min(5)]),
        )
    })
}
