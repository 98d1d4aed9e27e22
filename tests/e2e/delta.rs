//! Delta relists against the real kube-apiserver, on the server with the watch cache off
//! for Pods (a resume from a compacted checkpoint gets 410 at once):
//!
//! - `delta-relist`: a store closed while a few % of the Pods are updated, created and
//!   deleted, and etcd is compacted, relists in `RelistMode::Delta`: metadata pages only,
//!   one LIST narrowed to each new or changed Pod and no GET (the server counts the same),
//!   exactly the changes as
//!   `Apply` and the deletions as `Delete`, and it equals the server after it. Closed again,
//!   changed and compacted, it relists in `RelistMode::Full`: full pages, no fetch.
//! - `delta-relist-kill`: a child process (this binary with `KP_E2E_CHILD=delta-store`) runs
//!   the store in `RelistMode::Delta` with small pages from a checkpoint past the watch
//!   history, while the last namespace's new or changed Pods are updated twice under the
//!   relist (after its snapshot, before their fetches: fetched newer than the list), and
//!   SIGKILLs itself: mid-list (once some metadata pages are read, their fetches under way), in
//!   the sweep, and as soon as the relist is `Synced` (before the watch replays what changed
//!   under it). After each kill the store on disk (every batch durable) holds only versions
//!   the server had, keeps every Pod that did not change, holds every Pod once swept, and
//!   when `Synced` equals the server at its checkpoint up to what a delta relist explains,
//!   and only while the store's fetch window is open (`unexplained_by_window`). A last
//!   restart converges to the server; when it resumed from a checkpoint behind versions the
//!   relist fetched, the replayed older events are skipped.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube_persist::resource_version::compare;
use kube_persist::{Db, Reader, RelistMode, Stats, StreamConfig, SyncPhase};
use kube_persist_testkit::realk8s::request_count;

use crate::child::PROBE;
use crate::common::{self, Driven, Ev, drive};
use crate::support::*;

mod proc;

pub use proc::{CHILD_ROLE, child};
use proc::{KillAt, Proc, phase_line, synced_after_listing};

/// Page size of `delta-relist`; the kill scenario's is small, so its relist takes ~50 pages.
const PAGE: u32 = 500;
const KILL_PAGE: u32 = 50;
/// Attempts at a kill in the sweep (a missed sweep is tried again with new changes).
const SWEEP_ATTEMPTS: usize = 3;

fn config(mode: RelistMode, page: u32) -> StreamConfig {
    StreamConfig::default()
        .page_size(page)
        .relist_mode(mode)
        .backoff(Duration::from_millis(20), Duration::from_millis(500))
        .relist_jitter(Duration::ZERO)
}

/// Poll `f` (every 10 ms) until it holds; an error after [`WAIT`].
async fn wait_until(what: &str, mut f: impl FnMut() -> bool) -> Outcome {
    let deadline = Instant::now() + WAIT;
    while !f() {
        if Instant::now() > deadline {
            return Err(error(format!("timed out waiting for {what}")));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// Pods GET requests the server has answered so far.
async fn gets(server: &Server) -> Result<u64, Fail> {
    Ok(request_count(&server.client, "pods", "GET").await?)
}

/// The Pod store at `dir` (the child engine) in `mode` with pages of `page`, its watcher
/// driven.
fn open_driven(
    server: &Server,
    dir: &Path,
    mode: RelistMode,
    page: u32,
) -> Result<(Db, Reader<Pod>, Driven), Fail> {
    let (db, reader, watcher) = open_pods(server, dir, common::child_engine(), config(mode, page))?;
    Ok((db, reader, drive(watcher)))
}

/// Stop the watcher, make the store durable, close it and wait until its lock is free.
async fn close(db: Db, reader: Reader<Pod>, w: Driven, dir: &Path) -> Outcome {
    w.stop().await;
    db.flush()?;
    drop((reader, db));
    unlocked(dir).await
}

async fn unlocked(dir: &Path) -> Outcome {
    let dir = dir.to_path_buf();
    tokio::task::spawn_blocking(move || common::wait_unlocked(&dir))
        .await
        .map_err(|e| error(format!("the store stays locked: {e}")))
}

/// What changed on the server while a store was closed.
struct Changed {
    /// New or updated keys.
    changed: BTreeSet<String>,
    deleted: BTreeSet<String>,
    after: BTreeMap<String, String>,
}

/// While the store is closed: `updates` Pods updated and `deletes` deleted (spread over the
/// whole collection from `offset`, the probe spared), `creates` created from name index
/// `base`; then etcd compacted. Every version seen is added to `known`.
async fn change_and_compact(
    server: &Server,
    (offset, updates, deletes, creates, base): (usize, usize, usize, usize, usize),
    known: &mut Known,
) -> Result<Changed, Fail> {
    let before = server_now(&server.client).await?;
    known.add(&before);
    let eligible: BTreeMap<String, String> = before
        .iter()
        .filter(|(k, _)| *k != PROBE)
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let n = updates + deletes;
    let picked = pick(&eligible, offset, eligible.len() / n.max(1), n);
    // Alternately, until one kind has its count.
    let (mut updated, mut deleted) = (Vec::new(), Vec::new());
    for (i, k) in picked.into_iter().enumerate() {
        if (i % 2 == 0 && updated.len() < updates) || deleted.len() >= deletes {
            updated.push(k);
        } else {
            deleted.push(k);
        }
    }
    known.add(&update_pods(&server.client, &updated).await?);
    delete_pods(&server.client, &deleted).await?;
    create_pods(&server.client, base..base + creates).await?;
    let after = server_now(&server.client).await?;
    known.add(&after);
    server.with_guard(|g| g.compact())?;
    let changed: BTreeSet<String> = after
        .iter()
        .filter(|(k, v)| before.get(*k) != Some(*v))
        .map(|(k, _)| k.clone())
        .collect();
    let gone: BTreeSet<String> = before
        .keys()
        .filter(|k| !after.contains_key(*k))
        .cloned()
        .collect();
    if changed.len() != updates + creates || gone.len() != deletes {
        return Err(error(format!(
            "the changes made {} new or changed and {} deleted Pods, not {} and {deletes}",
            changed.len(),
            gone.len(),
            updates + creates
        )));
    }
    Ok(Changed {
        changed,
        deleted: gone,
        after,
    })
}

/// The events of a relist report exactly the changes (`Apply`, each once, the probe apart)
/// and the deletions (`Delete`, each once), and no error.
fn events_match(evs: &[Ev], c: &Changed) -> Outcome {
    let applied: Vec<&String> = evs
        .iter()
        .filter_map(|e| match e {
            Ev::Apply(k) if k != PROBE => Some(k),
            _ => None,
        })
        .collect();
    let deleted = common::deleted_keys(evs);
    same_keys("Apply", &applied, &c.changed, "new or changed")?;
    same_keys(
        "Delete",
        &deleted.iter().collect::<Vec<_>>(),
        &c.deleted,
        "deleted",
    )?;
    let odd: Vec<&Ev> = evs
        .iter()
        .filter(|e| matches!(e, Ev::Error(_) | Ev::Init | Ev::InitApply(_)))
        .take(3)
        .collect();
    ensure(odd.is_empty(), || format!("a relist reported {odd:?}"))
}

/// `got` (the keys of the `kind` events) names each key of `want` once, and nothing else.
fn same_keys(kind: &str, got: &[&String], want: &BTreeSet<String>, what: &str) -> Outcome {
    let keys: BTreeSet<String> = got.iter().map(|k| (*k).clone()).collect();
    ensure(keys == *want && got.len() == keys.len(), || {
        format!(
            "{} {kind} events ({} keys) for {} {what} Pods: extra {:?} missing {:?}",
            got.len(),
            keys.len(),
            want.len(),
            keys.difference(want).take(5).collect::<Vec<_>>(),
            want.difference(&keys).take(5).collect::<Vec<_>>()
        )
    })
}

/// What a store reopened after changes did until its relist ended.
struct Relisted {
    /// The changes made while it was closed.
    c: Changed,
    /// Its stats once the relist ended.
    stats: Stats,
    /// Pods GETs and LISTs the server answered from the reopening to the relist's end.
    gets: u64,
    lists: u64,
}

/// `changes` (see [`change_and_compact`]) while the store at `dir` is closed, then the store
/// reopened in `mode` until its relist ends. Its events up to the probe's Apply (made once
/// the relist is over: every event of the relist comes before it) report exactly the
/// changes, and it equals the server; then it is closed again.
async fn change_and_relist(
    server: &Server,
    dir: &Path,
    mode: RelistMode,
    changes: (usize, usize, usize, usize, usize),
    known: &mut Known,
) -> Result<Relisted, Fail> {
    let c = change_and_compact(server, changes, known).await?;
    let counts = (gets(server).await?, server.lists().await?);
    let (db, reader, mut w) = open_driven(server, dir, mode, PAGE)?;
    wait_until("the relist to end", || {
        reader.stats().relists >= 1 && reader.phase() == SyncPhase::Synced
    })
    .await?;
    let stats = reader.stats();
    let gets = gets(server).await? - counts.0;
    let lists = server.lists().await? - counts.1;
    touch_probe(&server.client).await?;
    events_match(&common::until_apply(&mut w, PROBE).await, &c)?;
    converge(&reader, &server.client).await?;
    close(db, reader, w, dir).await?;
    Ok(Relisted {
        c,
        stats,
        gets,
        lists,
    })
}

/// `delta-relist`: see the module's doc.
pub async fn relist(server: Arc<Server>) -> Outcome {
    let dir = tempfile::tempdir()?;
    let mut known = Known::default();
    {
        let (db, reader, mut w) = open_driven(&server, dir.path(), RelistMode::Delta, PAGE)?;
        w.until(|e| *e == Ev::InitDone).await;
        close(db, reader, w, dir.path()).await?;
    }
    // A few % of the Pods: 40 updated, 30 deleted, 30 created.
    let changes = (3, 40, 30, 30, 60_000);
    let delta =
        change_and_relist(&server, dir.path(), RelistMode::Delta, changes, &mut known).await?;
    let (s, fetched) = (&delta.stats, delta.c.changed.len() as u64);
    let pages = delta.c.after.len().div_ceil(PAGE as usize) as u64;
    ensure(s.relists == 1, || format!("not one relist: {s:?}"))?;
    ensure(
        s.metadata_pages >= pages && s.metadata_pages == s.list_pages,
        || format!("{pages} metadata pages expected, none in full: {s:?}"),
    )?;
    ensure(s.bodies_fetched == fetched, || {
        format!("{fetched} new or changed Pods fetched: {s:?}")
    })?;
    ensure(delta.gets == 0, || {
        format!(
            "the server answered {} Pods GETs (the delta relist fetches by LIST)",
            delta.gets
        )
    })?;
    let retries = s.fetch_retries;
    ensure(
        delta.lists == s.list_pages + s.server_version_reads + fetched + retries,
        || {
            format!(
                "the server answered {} Pods LISTs for {fetched} fetches: {s:?}",
                delta.lists
            )
        },
    )?;

    // Full: 20 updated, 10 deleted, 10 created; full pages, no fetch.
    let changes = (11, 20, 10, 10, 60_100);
    let full =
        change_and_relist(&server, dir.path(), RelistMode::Full, changes, &mut known).await?;
    let s = &full.stats;
    ensure(s.relists == 1 && s.list_pages >= pages, || {
        format!("not one relist in full pages: {s:?}")
    })?;
    ensure(
        (s.bodies_fetched, s.metadata_pages, full.gets) == (0, 0, 0),
        || format!("a full relist fetched bodies: {} GETs, {s:?}", full.gets),
    )?;
    println!(
        "e2e delta-relist: delta {} metadata pages, {} bodies fetched by {} LISTs, 0 GETs; full {} pages, no fetch",
        delta.stats.metadata_pages,
        delta.stats.bodies_fetched,
        delta.lists - delta.stats.list_pages - delta.stats.server_version_reads,
        s.list_pages
    );
    Ok(())
}

/// Every version of every Pod the scenario saw the server hold.
#[derive(Default)]
struct Known(BTreeMap<String, BTreeSet<String>>);

impl Known {
    fn add(&mut self, versions: &BTreeMap<String, String>) {
        for (k, v) in versions {
            self.0.entry(k.clone()).or_default().insert(v.clone());
        }
    }

    fn had(&self, k: &str, v: &str) -> bool {
        self.0.get(k).is_some_and(|vs| vs.contains(v))
    }
}

/// One kill: changes and a compaction while the store is down, then a child that relists
/// and kills itself at `at`, while the last namespace's new or changed Pods are updated
/// twice once its list has a snapshot (two metadata pages read). Returns the phase the child was killed in
/// (`None`: it ended its relist without meeting `at` and was killed then).
async fn kill_round(
    server: &Server,
    dir: &Path,
    at: KillAt,
    round: usize,
    known: &mut Known,
) -> Result<Option<String>, Fail> {
    let c = change_and_compact(server, (round, 40, 20, 20, 70_000 + 100 * round), known).await?;
    // New or changed Pods of the last namespace: listed as changed (so fetched) on the last
    // pages, and updated again after the list's snapshot, before their fetches.
    let late: Vec<String> = c
        .changed
        .iter()
        .filter(|k| k.starts_with(&format!("{}/", ns(NAMESPACES - 1))))
        .cloned()
        .collect();
    let mut p = Proc::spawn(server, dir, at);
    let snapshot = |l: &[String]| {
        l.iter()
            .filter_map(|l| phase_line(l))
            .any(|(p, n)| p == "Listing" && n >= 2)
    };
    let deadline = Instant::now() + WAIT;
    let mut updated = false;
    let status = loop {
        if let Some(status) = p.child.try_wait()? {
            break Some(status);
        }
        if at != KillAt::Synced && p.printed(synced_after_listing) {
            break None;
        }
        if !updated && p.printed(snapshot) {
            updated = true;
            for _ in 0..2 {
                known.add(&update_pods(&server.client, &late).await?);
            }
        }
        if Instant::now() > deadline {
            return Err(error(format!(
                "the child neither died nor synced ({at:?}): {}",
                p.last_line()
            )));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    let Some(status) = status else {
        drop(p);
        return Ok(None);
    };
    // Every line is read once the pipe closes.
    let killed_in = {
        let lines = &p.lines;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let found = lines
                .lock()
                .unwrap()
                .iter()
                .find_map(|l| l.strip_prefix("killed in ").map(String::from));
            if found.is_some() || Instant::now() > deadline {
                break found;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    };
    ensure(status.signal() == Some(libc::SIGKILL), || {
        format!("the child exited with {status}: {}", p.last_line())
    })?;
    killed_in
        .map(Some)
        .ok_or_else(|| error(format!("the child was killed elsewhere: {}", p.last_line())))
}

/// The store a killed child left: only versions the server had; every Pod the server
/// still has unchanged since `prev` (the store before the round) kept; in `Sweeping`,
/// every Pod of the server held; in `Synced`, equal to the server at its checkpoint up to
/// what the store's open fetch window explains.
async fn inspect(
    server: &Server,
    dir: &Path,
    known: &mut Known,
    prev: &BTreeMap<String, String>,
) -> Result<Inspected, Fail> {
    let engine = common::child_engine();
    let (db, reader, w) = open_pods(server, dir, engine, config(RelistMode::Delta, KILL_PAGE))?;
    let (phase, cp) = (reader.phase(), reader.checkpoint());
    let store = common::store_versions(&reader);
    let window = common::fetch_window(&db, "pods");
    drop((reader, db, w));
    unlocked(dir).await?;
    let now = server_now(&server.client).await?;
    known.add(&now);
    let foreign: Vec<_> = store.iter().filter(|(k, v)| !known.had(k, v)).collect();
    ensure(foreign.is_empty(), || {
        format!("{phase:?}: versions the server never had: {foreign:?}")
    })?;
    let lost: Vec<_> = now
        .iter()
        .filter(|(k, v)| prev.get(*k) == Some(*v) && store.get(*k) != Some(*v))
        .take(5)
        .collect();
    ensure(lost.is_empty(), || {
        format!("{phase:?}: Pods that did not change lost or changed: {lost:?}")
    })?;
    let mut explained = 0;
    match phase {
        SyncPhase::Sweeping => {
            let missing: Vec<_> = now.keys().filter(|k| !store.contains_key(*k)).collect();
            ensure(missing.is_empty(), || {
                format!("Sweeping: Pods of the server not held: {missing:?}")
            })?;
        }
        SyncPhase::Synced => {
            let cp = cp
                .clone()
                .ok_or_else(|| Fail::Diverged("Synced without a checkpoint".into()))?;
            let at = server_pods(&server.client, Some(&cp))
                .await?
                .ok_or_else(|| error(format!("checkpoint {cp} compacted: cannot check it")))?;
            let bad = common::unexplained_by_window(&store, &at, &now, &cp, window.as_deref());
            ensure(bad.is_empty(), || {
                format!(
                    "Synced at {cp}: {} differences a delta relist does not explain: {:?}",
                    bad.len(),
                    &bad[..bad.len().min(5)]
                )
            })?;
            explained = store.iter().filter(|(k, v)| at.get(*k) != Some(*v)).count()
                + at.keys().filter(|k| !store.contains_key(*k)).count();
        }
        _ => {}
    }
    Ok(Inspected {
        phase,
        checkpoint: cp,
        explained,
        store,
    })
}

/// What [`inspect`] found.
struct Inspected {
    phase: SyncPhase,
    checkpoint: Option<String>,
    /// Differences from the server at the checkpoint that a delta relist explains.
    explained: usize,
    store: BTreeMap<String, String>,
}

impl Inspected {
    /// Whether a Synced store holds a Pod at a version newer than its checkpoint with an
    /// older version of it also newer than the checkpoint: the watch from the checkpoint
    /// replays that older version, which must be skipped.
    fn behind_fetched(&self, known: &Known) -> bool {
        use std::cmp::Ordering::{Greater, Less};
        let Some(cp) = self
            .checkpoint
            .as_deref()
            .filter(|_| self.phase == SyncPhase::Synced)
        else {
            return false;
        };
        let after = |v: &str| compare(v, cp).ok() == Some(Greater);
        self.store.iter().any(|(k, v)| {
            after(v)
                && known.0.get(k).is_some_and(|vs| {
                    vs.iter()
                        .any(|w| after(w) && compare(w, v).ok() == Some(Less))
                })
        })
    }
}

/// `delta-relist-kill`: see the module's doc.
pub async fn relist_kill(server: Arc<Server>) -> Outcome {
    let dir = tempfile::tempdir()?;
    let mut known = Known::default();
    let mut prev = {
        let (db, reader, mut w) = open_driven(&server, dir.path(), RelistMode::Delta, KILL_PAGE)?;
        w.until(|e| *e == Ev::InitDone).await;
        let store = common::store_versions(&reader);
        close(db, reader, w, dir.path()).await?;
        store
    };
    known.add(&prev);
    let pages = prev.len().div_ceil(KILL_PAGE as usize) as u64;
    let mut said = Vec::new();
    let mut behind = false;
    let mut round = 0;
    for at in [KillAt::Pages(pages / 4), KillAt::Sweeping, KillAt::Synced] {
        for attempt in 1.. {
            round += 1;
            let killed = kill_round(&server, dir.path(), at, round, &mut known).await?;
            let found = inspect(&server, dir.path(), &mut known, &prev).await?;
            behind = found.behind_fetched(&known);
            let (phase, explained) = (found.phase, found.explained);
            prev = found.store;
            said.push(format!(
                "{at:?} killed in {} ({phase:?} on disk, {explained} differences explained)",
                killed.as_deref().unwrap_or("nothing: missed")
            ));
            if killed.is_some() {
                break;
            }
            if attempt == SWEEP_ATTEMPTS {
                return Err(error(format!("never killed at {at:?}: {said:?}")));
            }
        }
    }
    let (db, reader, mut w) = open_driven(&server, dir.path(), RelistMode::Delta, KILL_PAGE)?;
    wait_until("the restarted store to be synced and live", || {
        reader.phase() == SyncPhase::Synced && reader.is_live()
    })
    .await?;
    touch_probe(&server.client).await?;
    common::until_apply(&mut w, PROBE).await;
    converge(&reader, &server.client).await?;
    let s = reader.stats();
    // Resumed (no relist) from a checkpoint behind fetched versions: the replay of the
    // older updates (each Pod was updated twice under the relist) is skipped.
    if behind && s.relists == 0 {
        ensure(s.stale_events_skipped >= 1, || {
            format!("no replayed event skipped after a resume behind fetched versions: {s:?}")
        })?;
    }
    close(db, reader, w, dir.path()).await?;
    println!(
        "e2e delta-relist-kill: {}; restart: {} stale events skipped, {} relists",
        said.join(", "),
        s.stale_events_skipped,
        s.relists
    );
    Ok(())
}
