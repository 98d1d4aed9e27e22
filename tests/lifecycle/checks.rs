//! The invariants of the lifecycle model, checked once the server is quiescent.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ConfigMap;
use kube_persist::{Reader, SyncPhase};
use kube_persist_testkit::{ResourceType, ServerHandle};

use crate::app::{NS, RunCfg};

/// How long the store may take to be `Synced`, live and at the server's resourceVersion.
pub const SYNC_WAIT: Duration = Duration::from_secs(20);
/// How long the controller may take to reconcile what it owes, once the store is synced.
const RECONCILE_WAIT: Duration = Duration::from_secs(5);

/// One reconcile, as seen by the test process.
#[derive(Debug, Clone)]
pub struct Rec {
    pub at: Instant,
    pub run: usize,
    pub name: String,
    pub rv: String,
    pub uid: String,
}

/// Every reconcile of every run, in the order the test saw them.
pub type Log = Arc<Mutex<Vec<Rec>>>;

/// A server object: resourceVersion, uid, mode label.
#[derive(Debug, Clone)]
pub struct Obj {
    pub rv: String,
    pub uid: String,
    pub mode: String,
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
                uid: s(&m["uid"]),
                mode: s(&m["labels"]["mode"]),
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

fn few<T: std::fmt::Debug>(items: impl IntoIterator<Item = T>) -> String {
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

/// The store, once quiescent: equal to the server's objects in the shard, object by
/// object; nothing outside the shard; `len()` equal to the records; the index consistent.
pub fn store_matches(
    reader: &Reader<ConfigMap>,
    cfg: &RunCfg,
    server: &BTreeMap<String, Obj>,
) -> Vec<Found> {
    let mut out = Vec::new();
    let want: BTreeMap<&str, &str> = server
        .iter()
        .filter(|(_, o)| cfg.owns(&o.uid))
        .map(|(n, o)| (n.as_str(), o.rv.as_str()))
        .collect();
    let stored: Vec<ConfigMap> = reader.iter().map(|o| o.expect("decodes")).collect();
    let name = |c: &ConfigMap| c.metadata.name.clone().unwrap_or_default();
    let have: BTreeMap<String, String> = stored
        .iter()
        .map(|c| {
            (
                name(c),
                c.metadata.resource_version.clone().unwrap_or_default(),
            )
        })
        .collect();
    let missing: Vec<_> = want.keys().filter(|k| !have.contains_key(**k)).collect();
    let extra: Vec<_> = have
        .keys()
        .filter(|k| !want.contains_key(k.as_str()))
        .collect();
    let stale: Vec<_> = have
        .iter()
        .filter(|(k, v)| want.get(k.as_str()).is_some_and(|w| w != v))
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
        .filter(|c| !cfg.owns(c.metadata.uid.as_deref().unwrap_or_default()))
        .map(name)
        .collect();
    if !outside.is_empty() {
        out.push(found("no object outside the shard", few(outside)));
    }
    let records = stored.len() as u64;
    if reader.len() != records {
        out.push(found(
            "len() equals the number of records",
            format!("len() {} but iter() gives {records}", reader.len()),
        ));
    }
    if cfg.index {
        for m in ["ok", "short", "fail"] {
            let by_mode: BTreeSet<String> = stored
                .iter()
                .filter(|c| crate::app::mode(c) == m)
                .map(name)
                .collect();
            let indexed: Result<BTreeSet<String>, _> = reader
                .by_index("label:mode", m)
                .map(|it| it.map(|o| name(&o.expect("decodes"))).collect());
            match indexed {
                Ok(i) if i == by_mode => {}
                Ok(i) => out.push(found(
                    "the index equals the stored objects",
                    format!("mode={m}: index {} vs store {}", few(&i), few(&by_mode)),
                )),
                Err(e) => out.push(found(
                    "the index equals the stored objects",
                    format!("by_index(label:mode) on a Synced store: {e}"),
                )),
            }
        }
    }
    out
}

/// The controller, once the store is quiescent: every owned object reconciled at its
/// current version (by any run), every owned `short`/`fail` object reconciled again after
/// `since` (its due requeue or retry fired).
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
            cfg.owns(&o.uid) && !rc.unreconciled.contains(&((*n).clone(), o.rv.clone()))
        })
        .map(|(n, o)| (n.clone(), o.rv.clone()))
        .collect();
    let requeued: Vec<String> = server
        .iter()
        .filter(|(n, o)| cfg.owns(&o.uid) && o.mode != "ok" && !rc.lost_requeues.contains(*n))
        .map(|(n, _)| n.clone())
        .collect();
    let deadline = Instant::now() + RECONCILE_WAIT;
    loop {
        let (missing, lost) = {
            let log = log.lock().unwrap();
            let done: BTreeSet<(&str, &str)> = log
                .iter()
                .map(|r| (r.name.as_str(), r.rv.as_str()))
                .collect();
            let again: BTreeSet<&str> = log
                .iter()
                .rev()
                .take_while(|r| r.at > since)
                .map(|r| r.name.as_str())
                .collect();
            let missing: Vec<(String, String)> = owed
                .iter()
                .filter(|(n, rv)| !done.contains(&(n.as_str(), rv.as_str())))
                .cloned()
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
            if !missing.is_empty() {
                out.push(found(
                    "every object reconciled at its latest version",
                    format!("not within {RECONCILE_WAIT:?} of Synced: {}", few(&missing)),
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
            rc.unreconciled.extend(missing);
            rc.lost_requeues.extend(lost);
            return out;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// No reconcile of run `run` (with `cfg`) of an object its shard does not own.
pub fn owned_only(log: &Log, run: usize, cfg: &RunCfg, rc: &mut RunChecks) -> Vec<Found> {
    let log = log.lock().unwrap();
    let foreign: Vec<(String, String)> = log[rc.owned_upto..]
        .iter()
        .filter(|r| r.run == run && !cfg.owns(&r.uid))
        .map(|r| (r.name.clone(), r.rv.clone()))
        .collect();
    rc.owned_upto = log.len();
    if foreign.is_empty() {
        return Vec::new();
    }
    vec![found(
        "no object reconciled by a replica that does not own it",
        format!("shard {:?}: {}", cfg.shard, few(foreign)),
    )]
}
