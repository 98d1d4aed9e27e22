//! The delta relist in the lifecycle model: each run's `RelistMode` (Auto, Full or Delta,
//! drawn at every reopen), a relist of the live store while objects change under it between
//! their metadata page and their fetch ([`Move`]: changed again, moved out of the selection
//! or into it, created again under the same name with another uid, deleted; or deleted
//! before its snapshot and created again after its first page) with a fault on
//! its fetches ([`FetchFault`]: all refused with 403 or answered 404, every n-th 429 or
//! 500, every LIST slow), every fetch of a run refused (`RunCfg::refuse`), and a child killed in the middle
//! of a delta relist (`KillAt::Delta`). Invariants: a run in `Full` fetches no body and
//! lists no metadata page; a run in `Delta` on a store that was synced lists no page in full
//! unless its fetches were refused, and no relist falls back to full pages without a
//! refusal; no reader and no consumer of the shared stream is ever given an object older
//! than the one the store held before (in this run, or when it opened); and the store a
//! killed child left, when `Synced`, holds nothing its selectors exclude and equals the
//! server at its checkpoint (each side selected by its own objects' metadata) up to what a
//! delta relist explains, only while its fetch window is open (`unexplained_by_window`:
//! bodies fetched newer than the list, objects gone from the selection before their
//! fetch). After a relist the store equals the server's selection, and deletions are exact:
//! the model's checks at quiescence (`checks::store_matches`) hold in every mode.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::{ListParams, VersionMatch};
use kube_persist::resource_version::compare;
use kube_persist::{Reader, RelistMode, Stats, SyncPhase};
use kube_persist_testkit::ResourceType;
use rand::Rng;
use rand::rngs::StdRng;

use super::Model;
use crate::app::{Consumed, NS, STREAM};
use crate::checks::{self, found};
use crate::select::Meta;

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
    /// The delta fetches were refused (403) at some time in this run: its delta relists
    /// may list in full.
    pub(super) refused: bool,
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
        for held in &consumed.held {
            *held.lock().unwrap() = read.clone();
        }
        RunView {
            first_list: reader.checkpoint().is_none() || read.is_empty(),
            refused: false,
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
    /// Their fetches retried (a transient fault), and their fallbacks to full pages (a
    /// refusal).
    fetch_retries: u64,
    fallbacks: u64,
}

impl std::fmt::Display for Tally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut relists: BTreeMap<&str, u64> = BTreeMap::new();
        let (mut fetched, mut pages, mut stale) = (0, 0, 0);
        let (mut retries, mut fallbacks) = (0, 0);
        for (mode, s) in self.runs.values() {
            *relists.entry(mode_name(*mode)).or_default() += s.relists;
            fetched += s.bodies_fetched;
            pages += s.metadata_pages;
            stale += s.stale_events_skipped;
            retries += s.fetch_retries;
            fallbacks += s.delta_fallbacks;
        }
        write!(
            f,
            "relists {relists:?}, {pages} metadata pages, {fetched} bodies fetched, {retries} fetch retries, {fallbacks} fallbacks to full pages, {stale} stale events skipped; changed under a relist {}/{} ({} fetch retries, {} fallbacks there); killed synced stores checked {} ({} differences explained by a delta relist, {} not checkable)",
            self.under.0,
            self.under.1,
            self.fetch_retries,
            self.fallbacks,
            self.synced_checked,
            self.explained,
            self.unchecked
        )
    }
}

/// What happens to an object under a relist, between its metadata page and its fetch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Move {
    /// A new version (its fetch gets a body newer than the page).
    Touch,
    /// Moved to a tier outside the label selection (its fetch answers nothing: swept).
    Out,
    /// An object outside the selection moved into it (on no page: the watch brings it).
    In,
    /// Deleted and created again under the same name: another uid (maybe outside the
    /// shard), the fetch gets the new object or nothing.
    Recreate,
    /// Deleted before its fetch (the 404 of a GET: an empty answer, swept).
    Delete,
    /// Deleted once the relist began (before its snapshot: on no page), created again
    /// once its first page is read (another uid, which the watch brings).
    Reborn,
}

/// A fault on a relist's fetches (LISTs narrowed to one object), while it lasts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FetchFault {
    None,
    /// Every fetch refused (403): the relist lists in full from that page on.
    Refused,
    /// Every fetch answered 404 (the collection's path not found): unusable like a
    /// refusal, the relist lists in full from that page on.
    NotFound,
    /// Every n-th fetch 429 (retried by kube's retry layer when the run's client keeps it,
    /// by the store when it does not).
    Throttled(usize),
    /// Every n-th fetch 500: that fetch is retried.
    Failing(usize),
    /// Every LIST answers this many ms late (fetches too).
    Slow(u64),
}

/// A relist of the live store under changes (`Op::RelistUnder`).
#[derive(Debug, Clone)]
pub(super) struct Under {
    moves: Vec<Move>,
    fault: FetchFault,
}

impl Under {
    /// The `n`-th relist under changes of a run: its moves drawn, its fault the next in
    /// turn (every kind comes up within six of them).
    pub(super) fn draw(r: &mut impl Rng, n: usize) -> Under {
        let moves = (0..r.random_range(2..6))
            .map(|_| {
                [
                    Move::Touch,
                    Move::Touch,
                    Move::Out,
                    Move::In,
                    Move::Recreate,
                    Move::Delete,
                    Move::Reborn,
                ][r.random_range(0..7)]
            })
            .collect();
        let fault = match n % 6 {
            0 => FetchFault::Refused,
            1 => FetchFault::NotFound,
            // Every other or third one: the retry of a fetch (the store's, or kube's retry
            // layer's for a 429) gets through while the fault lasts.
            2 => FetchFault::Throttled(r.random_range(2..4)),
            3 => FetchFault::Failing(r.random_range(2..4)),
            4 => FetchFault::Slow(r.random_range(100..250)),
            _ => FetchFault::None,
        };
        Under { moves, fault }
    }
}

impl Model {
    /// A relist of the live store (410 on the reconnect, watches cut, pages slowed) while
    /// objects change under it, one per page after the first: once after the relist began
    /// (before its snapshot, which a slowed page takes [`PAGE_DELAY`] after the request:
    /// so they differ from the store), then once its first page is read (after the
    /// snapshot, before their pages' fetches) each as its [`Move`] says, and then touched
    /// again. In `Delta` (and `Auto`, while few change per page) their bodies are fetched
    /// newer than the list (or found gone: out of the selection, deleted, recreated
    /// elsewhere), and the watch from the list's version replays the older changes: they
    /// must be skipped (the consumers' and readers' invariants see it if not). The fetches
    /// meet `under.fault` until the relist is done (or [`checks::SYNC_WAIT`]).
    pub(super) async fn relist_under(&mut self, under: Under) {
        let Some(reader) = self.live.as_ref().map(|l| l.reader.clone()) else {
            return;
        };
        let page = self.cfg.page.max(1) as usize;
        let server = checks::server_objects(&self.h);
        let (selected, outside): (Vec<_>, Vec<_>) =
            server.iter().partition(|(_, o)| self.cfg.selects(&o.meta));
        // The first object of each page after the first, then the first page's others
        // (changed as soon as its body is read, before its fetches).
        let firsts = (page..selected.len()).step_by(page);
        let mut on_pages = firsts
            .chain(1..page.min(selected.len()))
            .map(|i| selected[i].0.clone());
        let mut outside = outside.iter().map(|(n, _)| (*n).clone());
        let picked: Vec<(String, Move)> = under
            .moves
            .iter()
            .filter_map(|m| {
                let name = match m {
                    Move::In => outside.next(),
                    _ => on_pages.next(),
                };
                Some((name?, *m))
            })
            .collect();
        let faults = self.h.faults();
        match under.fault {
            FetchFault::Slow(ms) => faults.page_delay(Duration::from_millis(ms)),
            _ => faults.page_delay(PAGE_DELAY),
        }
        match under.fault {
            FetchFault::Refused => faults.fail_named_lists(1, 403),
            FetchFault::NotFound => faults.fail_named_lists(1, 404),
            FetchFault::Throttled(n) => faults.fail_named_lists(n, 429),
            FetchFault::Failing(n) => faults.fail_named_lists(n, 500),
            FetchFault::None | FetchFault::Slow(_) => {}
        }
        if matches!(under.fault, FetchFault::Refused | FetchFault::NotFound)
            && let Some(live) = self.live.as_mut()
        {
            live.view.refused = true;
        }
        let before = reader.stats();
        // 410 on the reconnect, whatever the store's checkpoint (a compaction would not
        // expire one already at the head), until the relist begins (another stream may
        // reconnect first).
        faults.gone_every_watch(true);
        faults.close_watches();
        let deadline = Instant::now() + checks::SYNC_WAIT;
        let began = wait_stats(&reader, deadline, |s| s.relists > before.relists).await;
        faults.gone_every_watch(false);
        for (name, m) in picked.iter().filter(|_| began) {
            match m {
                Move::In => {}
                Move::Reborn => {
                    self.h.delete(&ResourceType::configmaps(), Some(NS), name);
                }
                _ => self.touch(name),
            }
        }
        // A full relist of a streaming store reads no page.
        let paged = !(self.cfg.streaming && self.cfg.relist == RelistMode::Full);
        let listed = began
            && paged
            && wait_stats(&reader, deadline, |s| s.list_pages > before.list_pages).await;
        if listed {
            let labels = self.cfg.sel.labels;
            for (name, m) in &picked {
                match m {
                    Move::Touch => self.touch(name),
                    Move::Out => {
                        let tier = labels.outside(&mut self.rng);
                        self.retier(name, tier);
                    }
                    Move::In => {
                        let tier = labels.inside(&mut self.rng);
                        self.retier(name, tier);
                    }
                    Move::Recreate => self.recreate(name),
                    Move::Delete => {
                        self.h.delete(&ResourceType::configmaps(), Some(NS), name);
                    }
                    Move::Reborn => self.create_named(name),
                }
            }
            for (name, _) in &picked {
                self.touch(name);
            }
        }
        // The fault lasts until the relist is done.
        let done = began
            && wait_stats(&reader, deadline, |_| {
                reader.phase() == SyncPhase::Synced && reader.is_live()
            })
            .await;
        faults.page_delay(Duration::ZERO);
        self.run_faults();
        let after = reader.stats();
        self.delta.under.0 += usize::from(listed);
        self.delta.under.1 += 1;
        let (retries, fallbacks) = (
            after.fetch_retries - before.fetch_retries,
            after.delta_fallbacks - before.delta_fallbacks,
        );
        self.delta.fetch_retries += retries;
        self.delta.fallbacks += fallbacks;
        self.history.push(format!(
            "(relist under {picked:?}, {}: {}; {} bodies fetched, {retries} fetch retries, {fallbacks} fallbacks{})",
            mode_name(self.cfg.relist),
            if listed {
                "changed after its snapshot"
            } else {
                "no paged relist seen"
            },
            after.bodies_fetched - before.bodies_fetched,
            if done { "" } else { "; not synced yet" }
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
        let refused = live.view.refused || self.cfg.refuse;
        match self.cfg.relist {
            RelistMode::Full if s.bodies_fetched > 0 || s.metadata_pages > 0 => out.push(found(
                "RelistMode::Full fetches no body and lists no metadata page",
                format!("{s:?}"),
            )),
            RelistMode::Delta
                if !live.view.first_list && !refused && s.list_pages != s.metadata_pages =>
            {
                out.push(found(
                    "RelistMode::Delta lists no page in full once the store was synced (and its fetches were not refused)",
                    format!("{s:?}"),
                ))
            }
            _ => {}
        }
        if s.delta_fallbacks > 0 && !refused {
            out.push(found(
                "a delta relist lists in full only after a refusal",
                format!("{s:?}"),
            ));
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
        let window = crate::common::fetch_window(&db, STREAM);
        let mut store = BTreeMap::new();
        for o in db.raw_objects(STREAM).into_iter().flatten() {
            let (_, json) = o.expect("a stored object reads");
            let o: serde_json::Value = serde_json::from_slice(&json).expect("stored JSON");
            let m = Meta::of_json(&o);
            store.insert(m.name.clone(), m);
        }
        drop(db);
        let unlocked = tokio::task::spawn_blocking(move || crate::common::wait_unlocked(&dir));
        unlocked.await.expect("the inspected store is unlocked");
        self.history.push(format!(
            "(the killed store: {:?} at {:?}, fetch window {window:?})",
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
        // Each side by the objects' own metadata there: a store (and the server at its
        // checkpoint) selects what it held then, the server now what it holds now.
        let owned = |m: BTreeMap<String, Meta>| -> BTreeMap<String, String> {
            m.into_iter()
                .filter(|(_, m)| cfg.selects(m))
                .map(|(k, m)| (k, m.rv))
                .collect()
        };
        let now = checks::server_objects(&self.h)
            .into_iter()
            .map(|(k, o)| (k, o.meta))
            .collect();
        // (Outside its shard, it may: a prune killed midway holds some until the next run
        // completes it, with the store reported not ready meanwhile.)
        let outside: Vec<String> = store
            .values()
            .filter(|m| !cfg.sel.selectors_match(m))
            .map(|m| m.name.clone())
            .collect();
        if !outside.is_empty() {
            self.report(
                step,
                found(
                    "a killed store at a Synced checkpoint holds nothing its selectors exclude",
                    format!("{outside:?}"),
                ),
            );
        }
        let (store, at, now) = (owned(store), owned(at), owned(now));
        self.delta.synced_checked += 1;
        self.delta.explained += store.iter().filter(|(k, v)| at.get(*k) != Some(*v)).count()
            + at.keys().filter(|k| !store.contains_key(*k)).count();
        let bad = crate::common::unexplained_by_window(&store, &at, &now, &cp, window.as_deref());
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

/// `name -> metadata` of the model's ConfigMaps exactly at `rv`; `None` if the server no
/// longer has it (410).
async fn exact_list(client: kube::Client, rv: &str) -> Option<BTreeMap<String, Meta>> {
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
                    let m = Meta::of(&c.metadata, false);
                    (m.name.clone(), m)
                })
                .collect(),
        ),
        Err(kube::Error::Api(s)) if s.code == 410 => None,
        Err(e) => panic!("exact list at {rv}: {e}"),
    }
}
