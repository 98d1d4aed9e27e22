//! The delta relist in the lifecycle model: each run's `RelistMode` (Auto, Full or Delta,
//! drawn at every reopen), a relist of the live store while the objects it fetches change
//! again under it (after its snapshot, before their GETs), and a child killed in the middle
//! of a delta relist (`KillAt::Delta`). Invariants: a run in `Full` fetches no body and
//! lists no metadata page; a run in `Delta` on a store that was synced lists no page in full;
//! no reader and no consumer of the shared stream is ever given an object older than the
//! one the store held before (in this run, or when it opened); and the store a killed child
//! left, when `Synced`, equals the server at its checkpoint up to what a delta relist
//! explains, only while its fetch window is open (`unexplained_by_window`: bodies fetched
//! newer than the list, objects deleted before their fetch). After a relist the store equals the server, and deletions are
//! exact: the model's checks at quiescence (`checks::store_matches`) hold in every mode.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::{ListParams, VersionMatch};
use kube_persist::resource_version::compare;
use kube_persist::{Reader, RelistMode, Stats, SyncPhase};
use rand::Rng;
use rand::rngs::StdRng;

use super::Model;
use crate::app::{Consumed, NS, STREAM};
use crate::checks::{self, found};

/// How long each LIST page of a relist under changes waits before its snapshot.
const PAGE_DELAY: Duration = Duration::from_millis(50);

/// Poll the store's stats (every ms) until `f` holds: whether it did before `deadline`.
async fn wait_stats(
    reader: &Reader<ConfigMap>,
    deadline: Instant,
    f: impl Fn(&Stats) -> bool,
) -> bool {
    while !f(&reader.stats()) {
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    true
}

/// A relist mode, drawn for a run.
pub(super) fn draw_mode(r: &mut StdRng) -> RelistMode {
    [RelistMode::Auto, RelistMode::Full, RelistMode::Delta][r.random_range(0..3)]
}

fn mode_name(m: RelistMode) -> &'static str {
    match m {
        RelistMode::Full => "full",
        RelistMode::Delta => "delta",
        _ => "auto",
    }
}

/// `name -> resourceVersion` of the stored objects.
fn stored(reader: &Reader<ConfigMap>) -> BTreeMap<String, String> {
    reader
        .iter()
        .filter_map(|o| o.ok())
        .map(|c| {
            let m = &c.metadata;
            let rv = m.resource_version.clone().unwrap_or_default();
            (m.name.clone().unwrap_or_default(), rv)
        })
        .collect()
}

/// What the model saw of a run's store, for the delta invariants.
pub(super) struct RunView {
    /// The store had never been synced when the run opened it: its first list is a full one.
    first_list: bool,
    /// The newest version of each object a read of the store gave in this run (from the
    /// store's contents when the run opened it).
    read: BTreeMap<String, String>,
}

impl RunView {
    /// At a run's start, before its watcher runs: the store's contents, which the shared
    /// stream's consumers start from too.
    pub(super) fn open(reader: &Reader<ConfigMap>, consumed: &Consumed) -> RunView {
        let read = stored(reader);
        for newest in &consumed.newest {
            *newest.lock().unwrap() = read.clone().into_iter().collect();
        }
        RunView {
            first_list: reader.checkpoint().is_none() || read.is_empty(),
            read,
        }
    }
}

/// What the delta operations and checks found, for the engine's summary line.
#[derive(Default)]
pub(super) struct Tally {
    /// The last stats of each run in this process, and its mode.
    runs: BTreeMap<usize, (RelistMode, Stats)>,
    /// Killed stores found `Synced`: checked at their checkpoint, and the differences a
    /// delta relist explained there; not checkable (the checkpoint compacted).
    synced_checked: usize,
    explained: usize,
    unchecked: usize,
    /// Relists under changes: how many saw their objects change after the snapshot.
    under: (usize, usize),
}

impl std::fmt::Display for Tally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut relists: BTreeMap<&str, u64> = BTreeMap::new();
        let (mut fetched, mut pages, mut stale) = (0, 0, 0);
        for (mode, s) in self.runs.values() {
            *relists.entry(mode_name(*mode)).or_default() += s.relists;
            fetched += s.bodies_fetched;
            pages += s.metadata_pages;
            stale += s.stale_events_skipped;
        }
        write!(
            f,
            "relists {relists:?}, {pages} metadata pages, {fetched} bodies fetched, {stale} stale events skipped; changed under a relist {}/{}; killed synced stores checked {} ({} differences explained by a delta relist, {} not checkable)",
            self.under.0, self.under.1, self.synced_checked, self.explained, self.unchecked
        )
    }
}

impl Model {
    /// A relist of the live store (410 on the reconnect, watches cut, pages slowed) while
    /// `n` objects, one per page after the first, change under it: once after the relist
    /// began (before its snapshot, which a slowed page takes [`PAGE_DELAY`] after the
    /// request: so they differ from the store), and twice more once its first page is read
    /// (after the snapshot, before their pages' GETs). In `Delta` (and `Auto`, while few
    /// change per page) their bodies are fetched newer than the list, and the watch from
    /// the list's version replays the older change: it must be skipped (the consumers'
    /// and readers' invariants see it if not).
    pub(super) async fn relist_under(&mut self, n: usize) {
        let Some(reader) = self.live.as_ref().map(|l| l.reader.clone()) else {
            return;
        };
        let page = self.cfg.page.max(1) as usize;
        let names: Vec<String> = checks::server_objects(&self.h).into_keys().collect();
        let picked: Vec<String> = names.into_iter().skip(page).step_by(page).take(n).collect();
        let faults = self.h.faults();
        faults.page_delay(PAGE_DELAY);
        let before = reader.stats();
        // 410 on the reconnect, whatever the store's checkpoint (a compaction would not
        // expire one already at the head), until the relist begins (another stream may
        // reconnect first).
        faults.gone_every_watch(true);
        faults.close_watches();
        let deadline = Instant::now() + checks::SYNC_WAIT;
        let began = wait_stats(&reader, deadline, |s| s.relists > before.relists).await;
        faults.gone_every_watch(false);
        for name in picked.iter().filter(|_| began) {
            self.touch(name);
        }
        // A full relist of a streaming store reads no page.
        let paged = !(self.cfg.streaming && self.cfg.relist == RelistMode::Full);
        let listed = began
            && paged
            && wait_stats(&reader, deadline, |s| s.list_pages > before.list_pages).await;
        if listed {
            for _ in 0..2 {
                for name in &picked {
                    self.touch(name);
                }
            }
        }
        faults.page_delay(Duration::ZERO);
        self.delta.under.0 += usize::from(listed);
        self.delta.under.1 += 1;
        self.history.push(format!(
            "(relist under changes of {picked:?}, {}: {})",
            mode_name(self.cfg.relist),
            if listed {
                "changed after its snapshot"
            } else {
                "no paged relist seen"
            }
        ));
    }

    /// `n` random objects, changed now (before a delta relist: their bodies are fetched).
    pub(super) fn delta_targets(&mut self, n: usize) -> Vec<String> {
        let mut names: Vec<String> = checks::server_objects(&self.h).into_keys().collect();
        let picked: Vec<String> = (0..n.min(names.len()))
            .map(|_| names.swap_remove(self.rng.random_range(0..names.len())))
            .collect();
        for name in &picked {
            self.touch(name);
        }
        picked
    }

    /// The delta invariants of the live run, once quiescent.
    pub(super) fn check_delta(&mut self, step: usize) {
        let Some(live) = self.live.as_mut() else {
            return;
        };
        let s = live.reader.stats();
        let mut out = Vec::new();
        match self.cfg.relist {
            RelistMode::Full if s.bodies_fetched > 0 || s.metadata_pages > 0 => out.push(found(
                "RelistMode::Full fetches no body and lists no metadata page",
                format!("{s:?}"),
            )),
            RelistMode::Delta if !live.view.first_list && s.list_pages != s.metadata_pages => out
                .push(found(
                    "RelistMode::Delta lists no page in full once the store was synced",
                    format!("{s:?}"),
                )),
            _ => {}
        }
        let now = stored(&live.reader);
        let older: Vec<String> = now
            .iter()
            .filter_map(|(k, v)| {
                let had = live.view.read.get(k)?;
                compare(v, had)
                    .is_ok_and(|o| o.is_lt())
                    .then(|| format!("{k} at {v} after {had}"))
            })
            .collect();
        if !older.is_empty() {
            out.push(found(
                "a reader never sees an object older than the one stored before",
                format!("{older:?}"),
            ));
        }
        live.view.read.extend(now);
        let given = std::mem::take(&mut *live.consumed.older.lock().unwrap());
        if !given.is_empty() {
            out.push(found(
                "no consumer is given an object older than the one stored before",
                format!("{} {:?}", given.len(), &given[..given.len().min(5)]),
            ));
        }
        self.delta.runs.insert(self.run, (self.cfg.relist, s));
        for f in out {
            self.report(step, f);
        }
    }

    /// The store a killed child left (run with `cfg`): when `Synced`, equal to the server at
    /// its checkpoint (the objects of the shard) up to what a delta relist explains.
    pub(super) async fn check_killed(&mut self, step: usize) {
        let cfg = self.cfg.clone();
        let dir = self.dir.path().to_path_buf();
        let db = cfg
            .open_db(self.engine, &dir)
            .expect("open the killed store");
        let info = db
            .streams()
            .expect("streams")
            .into_iter()
            .find(|s| s.name == STREAM);
        let mut store = BTreeMap::new();
        for o in db.raw_objects(STREAM).into_iter().flatten() {
            let (_, json) = o.expect("a stored object reads");
            let o: serde_json::Value = serde_json::from_slice(&json).expect("stored JSON");
            let m = &o["metadata"];
            let s = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
            store.insert(s(&m["name"]), (s(&m["resourceVersion"]), s(&m["uid"])));
        }
        drop(db);
        let unlocked = tokio::task::spawn_blocking(move || crate::common::wait_unlocked(&dir));
        unlocked.await.expect("the inspected store is unlocked");
        self.history.push(format!(
            "(the killed store: {:?} at {:?})",
            info.as_ref().map(|i| i.phase),
            info.as_ref().and_then(|i| i.checkpoint.clone())
        ));
        let Some(info) = info.filter(|i| i.phase == SyncPhase::Synced) else {
            return;
        };
        let Some(cp) = info.checkpoint else {
            return self.report(
                step,
                found("a Synced store has a checkpoint", String::new()),
            );
        };
        let Some(at) = exact_list(self.server.client(), &cp).await else {
            self.delta.unchecked += 1;
            self.history.push("(its checkpoint is compacted)".into());
            return;
        };
        let owned = |m: BTreeMap<String, (String, String)>| -> BTreeMap<String, String> {
            m.into_iter()
                .filter(|(_, (_, uid))| cfg.owns(uid))
                .map(|(k, (rv, _))| (k, rv))
                .collect()
        };
        let now = checks::server_objects(&self.h)
            .into_iter()
            .map(|(k, o)| (k, (o.rv, o.uid)))
            .collect();
        let (store, at, now) = (owned(store), owned(at), owned(now));
        self.delta.synced_checked += 1;
        self.delta.explained += store.iter().filter(|(k, v)| at.get(*k) != Some(*v)).count()
            + at.keys().filter(|k| !store.contains_key(*k)).count();
        // Relaxed only where the killed store's fetch window is open (read from its disk).
        let bad = crate::common::unexplained_by_window(
            &store,
            &at,
            &now,
            &cp,
            info.fetched_through.as_deref(),
        );
        if !bad.is_empty() {
            self.report(
                step,
                found(
                    "a killed store at a Synced checkpoint equals the server there, up to what a delta relist explains",
                    format!("at {cp}: {} {:?}", bad.len(), &bad[..bad.len().min(5)]),
                ),
            );
        }
    }
}

/// `name -> (resourceVersion, uid)` of the model's ConfigMaps exactly at `rv`; `None` if
/// the server no longer has it (410).
async fn exact_list(client: kube::Client, rv: &str) -> Option<BTreeMap<String, (String, String)>> {
    let api = Api::<ConfigMap>::namespaced(client, NS);
    let lp = ListParams {
        resource_version: Some(rv.to_string()),
        version_match: Some(VersionMatch::Exact),
        ..ListParams::default()
    };
    match api.list(&lp).await {
        Ok(list) => Some(
            list.items
                .into_iter()
                .map(|c| {
                    let m = c.metadata;
                    let rv = m.resource_version.unwrap_or_default();
                    (m.name.unwrap_or_default(), (rv, m.uid.unwrap_or_default()))
                })
                .collect(),
        ),
        Err(kube::Error::Api(s)) if s.code == 410 => None,
        Err(e) => panic!("exact list at {rv}: {e}"),
    }
}
