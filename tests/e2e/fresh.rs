//! Freshness against the real server (issue 25): a warm restart is ready at once and
//! caught up only once it applied what it missed (the replay, or the relist after a
//! compaction); a collection that did not change catches up at a bookmark; a reader waits
//! for its own writes. Right after each "caught up" the store is compared with the server,
//! which is quiescent then.

use std::cmp::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use kube_persist::resource_version::compare;
use kube_persist::{CatchUpRule, Engine, Reader};
use serde_json::json;

use crate::common::{self, Ev, drive};
use crate::support::*;
use crate::sync::config;

/// A store of every Pod, synced once and closed.
async fn synced(server: &Server, engine: Engine) -> Result<tempfile::TempDir, Fail> {
    let dir = tempfile::tempdir()?;
    let (_db, _reader, watcher) = open_pods(server, dir.path(), engine, config(false))?;
    let mut w = drive(watcher);
    w.until(|e| *e == Ev::InitDone).await;
    w.stop().await;
    Ok(dir)
}

/// Waits for "caught up", compares the store with the server at once, and checks the rule.
async fn caught_up_and_equal(
    what: &str,
    reader: &Reader<Pod>,
    server: &Server,
    rule: CatchUpRule,
) -> Outcome {
    caught_up_within(what, reader, server, rule, WAIT).await
}

/// [`caught_up_and_equal`] with its own bound: not caught up within `wait` is a divergence.
async fn caught_up_within(
    what: &str,
    reader: &Reader<Pod>,
    server: &Server,
    rule: CatchUpRule,
    wait: Duration,
) -> Outcome {
    let started = Instant::now();
    tokio::time::timeout(wait, reader.wait_until_caught_up())
        .await
        .map_err(|_| {
            Fail::Diverged(format!(
                "not caught up {} s after the watcher started: {:?}, {} bookmarks received",
                wait.as_secs(),
                reader.freshness(),
                reader.stats().bookmarks
            ))
        })??;
    let have = common::store_versions(reader);
    let elapsed = started.elapsed();
    let want = server_now(&server.client).await?;
    same_as(&have, &want).map_err(|e| match e {
        Fail::Diverged(m) => Fail::Diverged(format!("right after caught-up: {m}")),
        e => e,
    })?;
    let fresh = reader.freshness();
    println!(
        "e2e {what}: caught up {:.0} ms after the watcher started, by {}",
        elapsed.as_secs_f64() * 1e3,
        fresh.rule
    );
    ensure(fresh.rule == rule, || {
        format!("caught up by {:?}, expected {rule:?}", fresh.rule)
    })
}

/// Reopened after Pods changed while it was closed: ready at once and not yet caught up.
fn reopen(
    server: &Server,
    dir: &tempfile::TempDir,
    engine: Engine,
) -> Result<(kube_persist::Db, Reader<Pod>, common::Driven), Fail> {
    let (db, reader, watcher) = open_pods(server, dir.path(), engine, config(false))?;
    ensure(reader.is_ready() && !reader.is_caught_up(), || {
        format!(
            "at open: ready {} caught up {}",
            reader.is_ready(),
            reader.is_caught_up()
        )
    })?;
    Ok((db, reader, drive(watcher)))
}

/// Reopens the store at `dir` (ready, not caught up), then checks it right after caught-up.
async fn restart_and_check(
    what: &str,
    server: &Server,
    dir: &tempfile::TempDir,
    engine: Engine,
    rule: CatchUpRule,
) -> Outcome {
    let (_db, reader, w) = reopen(server, dir, engine)?;
    caught_up_and_equal(what, &reader, server, rule).await?;
    w.stop().await;
    Ok(())
}

/// Warm restart with changes while down: caught up only after the replay.
pub async fn warm_restart(server: Arc<Server>) -> Outcome {
    let dir = synced(&server, Engine::Redb).await?;
    let now = server_now(&server.client).await?;
    update_pods(&server.client, &pick(&now, 1, 50, 40)).await?;
    delete_pods(&server.client, &pick(&now, 7, 50, 20)).await?;
    create_pods(&server.client, crate::PODS + 100..crate::PODS + 120).await?;
    restart_and_check(
        "fresh-warm-restart",
        &server,
        &dir,
        Engine::Redb,
        CatchUpRule::ComparableResourceVersions,
    )
    .await
}

/// Only ConfigMaps changed while down: no Pod event moves the checkpoint past the server's
/// resourceVersion; a bookmark does (the watch opened while catching up has a short
/// server-side timeout, so kube-apiserver's watch cache sends one 2 s before its end).
pub async fn quiet_collection(server: Arc<Server>) -> Outcome {
    let dir = synced(&server, Engine::Sled).await?;
    create_config_maps(&server, "fresh", 10).await?;
    restart_and_check(
        "fresh-quiet-collection",
        &server,
        &dir,
        Engine::Sled,
        CatchUpRule::ComparableResourceVersions,
    )
    .await
}

/// Read your own writes: after each patch, `wait_for_write` then `get` shows that version
/// (or a newer one).
pub async fn read_your_writes(server: Arc<Server>) -> Outcome {
    let dir = tempfile::tempdir()?;
    let (_db, reader, watcher) = open_pods(&server, dir.path(), Engine::Redb, config(false))?;
    let w = drive(watcher);
    reader.wait_until_caught_up().await?;
    let keys: Vec<String> = pick(&server_now(&server.client).await?, 0, 40, 50);
    let mut stale = Vec::new();
    let started = Instant::now();
    for (i, key) in keys.iter().enumerate() {
        let (ns, name) = key.split_once('/').expect("namespace/name");
        let patch = json!({"metadata": {"labels": {"fresh": i.to_string()}}});
        let written = Api::<Pod>::namespaced(server.client.clone(), ns)
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        let rv = written
            .metadata
            .resource_version
            .clone()
            .unwrap_or_default();
        reader
            .wait_for_write(&written, Duration::from_secs(30))
            .await?;
        let stored = reader
            .get_named(Some(ns), name)?
            .and_then(|p| p.metadata.resource_version.clone());
        let fresh = stored
            .as_deref()
            .is_some_and(|s| compare(s, &rv).is_ok_and(|o| o != Ordering::Less));
        if !fresh {
            stale.push(format!("{key}: read {stored:?} after writing {rv}"));
        }
    }
    println!(
        "e2e fresh-read-your-writes: {} writes read back, {:.2} ms per write and wait",
        keys.len(),
        started.elapsed().as_secs_f64() * 1e3 / keys.len() as f64
    );
    ensure(stale.is_empty(), || format!("stale reads: {stale:?}"))?;
    w.stop().await;
    Ok(())
}

/// With the watch cache off, a store closed across deletions and `compact.sh` relists on
/// resume: caught up only after the relist's sweep (no deleted Pod visible).
pub async fn after_compaction(server: Arc<Server>) -> Outcome {
    let dir = synced(&server, Engine::Redb).await?;
    let now = server_now(&server.client).await?;
    delete_pods(&server.client, &pick(&now, 11, 40, 40)).await?;
    server.with_guard(|g| g.compact())?;
    restart_and_check(
        "fresh-after-compaction",
        &server,
        &dir,
        Engine::Redb,
        CatchUpRule::List,
    )
    .await
}

/// `n` ConfigMaps named `<prefix>-<pid>-<i>`: the server's resourceVersion moves on, and
/// no Pod changes.
async fn create_config_maps(server: &Server, prefix: &str, n: usize) -> Outcome {
    let cms = Api::<ConfigMap>::namespaced(server.client.clone(), &ns(0));
    for i in 0..n {
        let cm: ConfigMap = serde_json::from_value(json!({
            "metadata": {"name": format!("{prefix}-{}-{i}", std::process::id())},
            "data": {"i": i.to_string()}
        }))?;
        cms.create(&PostParams::default(), &cm).await?;
    }
    Ok(())
}

/// How long a quiet collection may take to catch up on a server that sends no bookmarks:
/// a few catch-up watches (5 s each).
const NO_BOOKMARKS_WAIT: Duration = Duration::from_secs(30);

/// With the watch cache off for Pods (`--watch-cache-sizes=pods#0`), kube-apiserver sends
/// a Pod watch no bookmark at all (its etcd watcher asks etcd for progress notifications
/// only for the watch cache's own watch). A store reopened after only ConfigMaps changed
/// has neither an event nor a bookmark to move its checkpoint to the server's
/// resourceVersion: it is caught up once a watch ran to its deadline, quiet and without a
/// bookmark. Checked: caught up within [`NO_BOOKMARKS_WAIT`], by that rule, the store equal
/// to the server right then; the bookmarks received are printed.
pub async fn quiet_without_bookmarks(server: Arc<Server>) -> Outcome {
    let dir = synced(&server, Engine::Redb).await?;
    create_config_maps(&server, "no-bookmarks", 10).await?;
    let (_db, reader, w) = reopen(&server, &dir, Engine::Redb)?;
    caught_up_within(
        "fresh-quiet-no-bookmarks",
        &reader,
        &server,
        CatchUpRule::QuietWatchDeadline,
        NO_BOOKMARKS_WAIT,
    )
    .await?;
    let stats = reader.stats();
    println!(
        "e2e fresh-quiet-no-bookmarks: {} bookmarks, {} watch events, {} errors",
        stats.bookmarks, stats.watch_events, stats.errors
    );
    w.stop().await;
    Ok(())
}
