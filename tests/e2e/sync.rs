//! Cold sync (paginated and streaming), warm restart, compaction (410 and relist), and the
//! API server restarted during a streaming list.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use kube_persist::{Engine, Event, StreamConfig, SyncPhase};

use crate::common::{self, Ev, drive};
use crate::support::*;

/// Stores the cold syncs leave behind (closed) for later scenarios.
#[derive(Default)]
pub struct Shared {
    pub paginated: Mutex<Option<(tempfile::TempDir, Engine)>>,
    pub streaming: Mutex<Option<(tempfile::TempDir, Engine)>>,
}

const PAGE: u32 = 500;

pub fn config(streaming: bool) -> StreamConfig {
    let c = StreamConfig::default()
        .page_size(PAGE)
        .backoff(Duration::from_millis(20), Duration::from_millis(500));
    if streaming { c.streaming_lists() } else { c }
}

/// Errors the stream reported (there should be none against a healthy server).
fn errors(evs: &[Ev]) -> Vec<&str> {
    evs.iter()
        .filter_map(|e| match e {
            Ev::Error(s) => Some(s.as_str()),
            _ => None,
        })
        .collect()
}

/// A fresh store syncs all Pods; paginated with exactly one LIST per page, streaming with
/// none; the store equals the server at its checkpoint.
pub async fn cold_sync(server: Arc<Server>, shared: Arc<Shared>, streaming: bool) -> Outcome {
    let engine = if streaming {
        Engine::Sled
    } else {
        Engine::Redb
    };
    let dir = tempfile::tempdir()?;
    let want = server_now(&server.client).await?;
    let before = server.lists().await?;
    let (db, reader, watcher) = open_pods(&server, dir.path(), engine, config(streaming))?;
    let mut w = drive(watcher);
    let evs = w.until(|e| *e == Ev::InitDone).await;
    let lists = server.lists().await? - before;
    let pages = if streaming {
        0
    } else {
        want.len().div_ceil(PAGE as usize) as u64
    };
    ensure(lists == pages, || {
        format!(
            "{lists} LIST calls for {} Pods (expected {pages})",
            want.len()
        )
    })?;
    let applied = evs.iter().filter(|e| matches!(e, Ev::InitApply(_))).count();
    ensure(applied == want.len(), || {
        format!("{applied} InitApply for {} Pods", want.len())
    })?;
    ensure(errors(&evs).is_empty(), || {
        format!("stream errors: {:?}", errors(&evs))
    })?;
    same_as(&common::store_versions(&reader), &want)?;
    at_checkpoint(&reader, &server.client).await?;
    w.stop().await;
    drop((reader, db));
    let slot = if streaming {
        &shared.streaming
    } else {
        &shared.paginated
    };
    *slot.lock().unwrap() = Some((dir, engine));
    Ok(())
}

/// The paginated cold sync's store, reopened after changes made while it was closed: ready
/// before its watcher runs, resumes (no LIST), catches up.
pub async fn warm_restart(server: Arc<Server>, shared: Arc<Shared>) -> Outcome {
    let (dir, engine) = shared
        .paginated
        .lock()
        .unwrap()
        .take()
        .ok_or_else(|| error("no store from cold-sync-paginated"))?;
    let keys: Vec<String> = server_now(&server.client).await?.into_keys().collect();
    update_pods(&server.client, &keys[100..120]).await?;
    delete_pods(&server.client, &keys[200..210]).await?;
    create_pods(&server.client, crate::PODS..crate::PODS + 10).await?;

    let before = server.lists().await?;
    let (_db, reader, watcher) = open_pods(&server, dir.path(), engine, config(false))?;
    ensure(reader.is_ready(), || {
        format!("not ready at open: phase {:?}", reader.phase())
    })?;
    let mut w = drive(watcher);
    let first = w.until(|_| true).await;
    ensure(matches!(first[0], Ev::Resumed(_)), || {
        format!("first event {:?}, not Resumed", first[0])
    })?;
    let probe = touch_probe(&server.client).await?;
    let evs = common::until_apply(&mut w, crate::child::PROBE).await;
    let lists = server.lists().await? - before;
    let reads = reader.stats().server_version_reads;
    ensure(lists == reads && reads >= 1, || {
        format!(
            "warm restart made {lists} LIST calls ({reads} limit=1 reads of the server's resourceVersion, at least 1 expected)"
        )
    })?;
    ensure(errors(&evs).is_empty(), || {
        format!("stream errors: {:?}", errors(&evs))
    })?;
    let _ = probe;
    converge(&reader, &server.client).await?;
    w.stop().await;
    Ok(())
}

/// With the watch cache off for Pods, a store closed across deletions, updates, creates
/// and `compact.sh` resumes into 410, relists, and reports exactly the deletions.
pub async fn compaction(server: Arc<Server>) -> Outcome {
    let dir = tempfile::tempdir()?;
    {
        let (_db, _reader, watcher) = open_pods(&server, dir.path(), Engine::Redb, config(false))?;
        let mut w = drive(watcher);
        w.until(|e| *e == Ev::InitDone).await;
        w.stop().await;
    }
    let now = server_now(&server.client).await?;
    let deleted = pick(&now, 3, 40, 40);
    let updated = pick(&now, 5, 40, 40);
    delete_pods(&server.client, &deleted).await?;
    update_pods(&server.client, &updated).await?;
    create_pods(&server.client, crate::PODS..crate::PODS + 20).await?;
    let compacted = server.with_guard(|g| g.compact())?;

    let before = server.lists().await?;
    let (_db, reader, watcher) = open_pods(&server, dir.path(), Engine::Redb, config(false))?;
    let mut w = drive(watcher);
    let first = w.until(|e| matches!(e, Ev::Resumed(_) | Ev::Init)).await;
    let resumed = match first.last() {
        Some(Ev::Resumed(rv)) => rv.clone(),
        other => {
            return Err(error(format!(
                "the reopened store did not resume: {other:?}"
            )));
        }
    };
    // The relist reports changes as Apply and removals as Delete (no Init). Wait for the
    // deletions, then for the sweep to end (phase Synced): the relist is over, so its LIST
    // calls are all counted. A change of the probe after that, seen as a watch event, comes
    // after every event of the relist: then no other deletion can follow.
    let missing = Mutex::new(deleted.iter().cloned().collect::<BTreeSet<String>>());
    let mut evs = first;
    evs.extend(
        w.until(|e| {
            if let Ev::Delete(k) = e {
                missing.lock().unwrap().remove(k);
            }
            missing.lock().unwrap().is_empty()
        })
        .await,
    );
    common::eventually("the relist's sweep to end", || {
        reader.phase() == SyncPhase::Synced
    })
    .await;
    let lists = server.lists().await? - before;
    let pages = server_now(&server.client)
        .await?
        .len()
        .div_ceil(PAGE as usize) as u64;
    let s = reader.stats();
    let reads = s.server_version_reads;
    // A delta relist (the default mode) fetches each new or changed Pod with a LIST narrowed
    // to it: none vanishes under this relist, so each fetch gave a body.
    let fetches = s.bodies_fetched + s.fetch_retries;
    ensure(lists == pages + reads + fetches, || {
        format!(
            "the resume at {resumed} after {compacted}: {lists} LIST calls, expected one relist of {pages} pages, {fetches} fetches and {reads} limit=1 reads"
        )
    })?;
    ensure(reader.stats().relists == 1, || {
        format!("stats: {:?}", reader.stats())
    })?;
    converge(&reader, &server.client).await?;
    touch_probe(&server.client).await?;
    evs.extend(common::until_apply(&mut w, crate::child::PROBE).await);
    let got: BTreeSet<&str> = evs
        .iter()
        .filter_map(|e| match e {
            Ev::Delete(k) => Some(k.as_str()),
            _ => None,
        })
        .collect();
    let want: BTreeSet<&str> = deleted.iter().map(String::as_str).collect();
    let reported = evs.iter().filter(|e| matches!(e, Ev::Delete(_))).count();
    ensure(got == want && reported == want.len(), || {
        format!(
            "relist deletions: {reported} reported ({} keys), {} deleted; extra {:?} missing {:?}",
            got.len(),
            want.len(),
            got.difference(&want).take(5).collect::<Vec<_>>(),
            want.difference(&got).take(5).collect::<Vec<_>>()
        )
    })?;
    w.stop().await;
    Ok(())
}

/// A streaming list is held mid-way (the stream not polled) while Pods are deleted, the API
/// server is stopped and started again, and more Pods are deleted: the store ends equal to
/// the server, without the deleted Pods.
pub async fn apiserver_restart(server: Arc<Server>) -> Outcome {
    // Large Pods, so that the initial events outgrow what the sockets buffer: the server is
    // still sending when it stops.
    create_big_pods(&server.client, "e2e-big", 1500, 10_000).await?;
    let dir = tempfile::tempdir()?;
    let (_db, reader, watcher) = open_pods(&server, dir.path(), Engine::Redb, config(true))?;
    let mut events = Box::pin(watcher.stream());
    let mut before_stop = 0usize;
    loop {
        match tokio::time::timeout(WAIT, events.next()).await {
            Ok(Some(Ok(Event::InitApply(_)))) => {
                before_stop += 1;
                if before_stop == 50 {
                    break;
                }
            }
            Ok(Some(Ok(Event::InitDone))) => {
                return Err(error("the initial events ended before 50 arrived"));
            }
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => return Err(error("no initial events")),
        }
    }
    let now = server_now(&server.client).await?;
    let first = pick(&now, 7, 60, 30);
    delete_pods(&server.client, &first).await?;
    let kubeconfig = std::fs::read_to_string(&server.kubeconfig)?;
    server.with_guard(|g| g.stop().and_then(|()| g.restart()))?;
    if std::fs::read_to_string(&server.kubeconfig)? != kubeconfig {
        return Err(error(
            "the restarted server has another URL: the store's client cannot follow",
        ));
    }
    let second = pick(&now, 11, 60, 30);
    delete_pods(&server.client, &second).await?;

    // Poll again: the rest of the held list, the broken connection, and what follows.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let task = tokio::spawn(async move {
        while let Some(ev) = events.next().await {
            let ev = match ev {
                Ok(Event::InitDone) => "initdone".to_string(),
                Ok(Event::Init) => "init".to_string(),
                Err(e) => format!("error {e}"),
                Ok(_) => continue,
            };
            if tx.send(ev).is_err() {
                return;
            }
        }
    });
    let mut seen = Vec::new();
    while !seen.iter().any(|e: &String| e == "initdone") {
        match tokio::time::timeout(WAIT, rx.recv()).await {
            Ok(Some(e)) => seen.push(e),
            _ => {
                return Err(error(format!(
                    "no InitDone after the restart; saw {seen:?}"
                )));
            }
        }
    }
    let result = async {
        converge(&reader, &server.client).await?;
        let store = common::store_versions(&reader);
        let kept: Vec<&String> = first
            .iter()
            .chain(&second)
            .filter(|k| store.contains_key(*k))
            .collect();
        ensure(kept.is_empty(), || {
            format!("deleted Pods still stored: {kept:?}")
        })
    }
    .await;
    task.abort();
    let _ = task.await;
    let stats = reader.stats();
    println!(
        "e2e apiserver-restart-mid-stream: {before_stop} initial events before the stop, then {seen:?}; {} errors, {} pages",
        stats.errors, stats.list_pages
    );
    result?;
    // The stop must have cut the initial events (else the scenario tested nothing).
    if seen.iter().any(|e| e.starts_with("error")) || stats.errors > 0 {
        Ok(())
    } else {
        Err(error(
            "the initial events were all received before the stop: nothing was interrupted",
        ))
    }
}
