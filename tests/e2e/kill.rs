//! SIGKILL of a child process mid-list and mid-watch with changes while it is down, and a
//! durable controller killed and restarted: it reconciles only what changed, with 0 LIST.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube_persist::SyncPhase;

use crate::child::{CONTROLLER, Child, PROBE, store_config};
use crate::common;
use crate::support::*;

/// Open the store a killed child left (the kernel released its lock).
fn inspect(
    dir: &Path,
    server: &Server,
) -> Result<(kube_persist::Db, kube_persist::Reader<Pod>), Fail> {
    let (db, reader, _watcher) =
        open_pods(server, dir, common::child_engine(), store_config(false))?;
    Ok((db, reader))
}

/// Changes while the child is down: creates, updates and deletes (`base` keeps the new
/// names apart between scenarios).
async fn changes(server: &Server, base: usize) -> Outcome {
    let now = server_now(&server.client).await?;
    let victims: Vec<String> = pick(&now, base % 37, 50, 30)
        .into_iter()
        .filter(|k| k != PROBE)
        .collect();
    let updated: Vec<String> = pick(&now, base % 37 + 1, 50, 30)
        .into_iter()
        .filter(|k| k != PROBE)
        .collect();
    delete_pods(&server.client, &victims).await?;
    update_pods(&server.client, &updated).await?;
    create_pods(&server.client, base..base + 30).await?;
    Ok(())
}

/// Restart the store child, change the probe, wait until the child has made that change
/// durable; returns the LIST calls made meanwhile and the child's lines.
async fn restart_until_probe(server: &Server, dir: &Path) -> Result<(u64, Vec<String>), Fail> {
    let before = server.lists().await?;
    let child = Child::spawn("store", dir, &server.kubeconfig, false);
    if !child
        .wait_for(WAIT, |l| l == "state phase=Synced live=true")
        .await
    {
        return Err(error(format!(
            "restarted child not live: {}",
            child.last_line()
        )));
    }
    let probe = touch_probe(&server.client).await?;
    let want = format!("durable applied {PROBE} {probe}");
    if !child.wait_for(WAIT, |l| l == want).await {
        return Err(error(format!(
            "the child did not apply the probe: {}",
            child.last_line()
        )));
    }
    let lists = server.lists().await? - before;
    let lines = child.lines();
    child.kill();
    Ok((lists, lines))
}

/// The killed child's store equals the server now (no change is under way) and at its
/// checkpoint.
async fn check_store(server: &Server, dir: &Path) -> Outcome {
    let (_db, reader) = inspect(dir, server)?;
    ensure(reader.phase() == SyncPhase::Synced, || {
        format!("phase {:?}", reader.phase())
    })?;
    same_as(
        &common::store_versions(&reader),
        &server_now(&server.client).await?,
    )?;
    at_checkpoint(&reader, &server.client).await
}

/// Killed 100 ms into its first (paginated) list; the store left on disk is not ready.
pub async fn mid_list(server: Arc<Server>) -> Outcome {
    let dir = tempfile::tempdir()?;
    let child = Child::spawn("store", dir.path(), &server.kubeconfig, false);
    if !child
        .wait_for(WAIT, |l| l.starts_with("state phase=Listing"))
        .await
    {
        return Err(error(format!("child never listed: {}", child.last_line())));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    child.kill();
    {
        let (_db, reader) = inspect(dir.path(), &server)?;
        if reader.phase() == SyncPhase::Synced {
            return Err(error(
                "the first list finished before the kill: not mid-list",
            ));
        }
        ensure(!reader.is_ready(), || {
            "a half-listed store says it is ready".into()
        })?;
    }
    changes(&server, 10_000).await?;
    restart_until_probe(&server, dir.path()).await?;
    check_store(&server, dir.path()).await
}

/// Synced and flushed, then killed while watch events flow (a stream of updates); more
/// changes while it is down; the restart resumes with 0 LIST.
pub async fn mid_watch(server: Arc<Server>) -> Outcome {
    let dir = tempfile::tempdir()?;
    let child = Child::spawn("store", dir.path(), &server.kubeconfig, false);
    if !child
        .wait_for(WAIT, |l| l == "state phase=Synced live=true")
        .await
    {
        return Err(error(format!("child never live: {}", child.last_line())));
    }
    // The synced store made durable (else a kill within the periodic flush interval may
    // leave nothing on disk: the restart would list again, as documented).
    if !child.flush(dir.path()).await {
        return Err(error(format!(
            "the child did not flush: {}",
            child.last_line()
        )));
    }
    let keys: Vec<String> = server_now(&server.client)
        .await?
        .into_keys()
        .filter(|k| k != PROBE)
        .collect();
    let churning = Arc::new(AtomicBool::new(true));
    let churn = tokio::spawn({
        let (client, churning) = (server.client.clone(), churning.clone());
        async move {
            let mut i = 0;
            while churning.load(Ordering::Relaxed) {
                let batch: Vec<String> = keys
                    .iter()
                    .skip(i * 7 % keys.len())
                    .take(10)
                    .cloned()
                    .collect();
                update_pods(&client, &batch).await?;
                i += 1;
            }
            Ok::<_, Fail>(())
        }
    });
    // Kill once the child has applied watch events of the churn.
    let applied = child.wait_for(WAIT, |l| l == "event apply").await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    child.kill();
    churning.store(false, Ordering::Relaxed);
    churn.await.map_err(|e| error(e.to_string()))??;
    if !applied {
        return Err(error("the child saw no watch event before the kill"));
    }
    changes(&server, 20_000).await?;
    let (lists, lines) = restart_until_probe(&server, dir.path()).await?;
    // No list: only the child's `LIST limit=1` reads of the server's resourceVersion.
    let reads = crate::child::reads(&lines);
    ensure(lists == reads, || {
        let said: Vec<&String> = lines
            .iter()
            .filter(|l| !l.starts_with("event apply"))
            .take(12)
            .collect();
        format!(
            "the restart after a kill mid-watch made {lists} LIST calls ({reads} limit=1 reads); the child said {said:?}"
        )
    })?;
    ensure(lines.iter().any(|l| l == "event resumed"), || {
        "the restart did not resume".into()
    })?;
    check_store(&server, dir.path()).await
}

/// `(name, resourceVersion)` of each reconcile a controller child printed.
fn reconciles(lines: &[String]) -> Vec<(String, String)> {
    lines
        .iter()
        .filter_map(|l| l.strip_prefix("reconciled "))
        .filter_map(|l| l.split_once(' '))
        .map(|(k, rv)| (k.to_string(), rv.to_string()))
        .collect()
}

/// A durable controller over all Pods reconciles each once, flushes its store, is SIGKILLed
/// (what it did after the flush may be lost: the expectation is read from disk), Pods change while
/// it is down; the restart reconciles exactly the Pods whose version differs from the one
/// its state on disk recorded (each once), and makes no LIST.
pub async fn controller(server: Arc<Server>) -> Outcome {
    let dir = tempfile::tempdir()?;
    let all = server_now(&server.client).await?;
    let child = Child::spawn("controller", dir.path(), &server.kubeconfig, false);
    let every = |lines: &[String]| {
        let done: std::collections::BTreeSet<String> =
            reconciles(lines).into_iter().map(|(k, _)| k).collect();
        all.keys().all(|k| done.contains(k))
    };
    if !child.wait_until(WAIT, every).await {
        let last = child.last_line();
        return Err(error(format!("first run did not reconcile all: {last}")));
    }
    if !child.flush(dir.path()).await {
        return Err(error(format!(
            "the controller did not flush: {}",
            child.last_line()
        )));
    }
    child.kill();
    changes(&server, 30_000).await?;

    // What the state on disk says was reconciled, at which version.
    let recorded: BTreeMap<String, Option<String>> = {
        let db = common::try_open_db(common::child_engine(), dir.path())?;
        let states = db.reconcile_states(CONTROLLER)?;
        states
            .map(|s| {
                s.map(|s| {
                    (
                        format!("{}/{}", s.namespace.unwrap_or_default(), s.name),
                        s.resource_version,
                    )
                })
            })
            .collect::<Result<_, _>>()?
    };
    common::wait_unlocked(dir.path());
    let now = server_now(&server.client).await?;
    let mut expected: Vec<String> = now
        .iter()
        .filter(|(k, rv)| recorded.get(*k).and_then(|r| r.as_ref()) != Some(*rv))
        .map(|(k, _)| k.clone())
        .filter(|k| k != PROBE)
        .collect();
    expected.sort();

    let before = server.lists().await?;
    let child = Child::spawn("controller", dir.path(), &server.kubeconfig, false);
    let probe = touch_probe(&server.client).await?;
    let want = format!("reconciled {PROBE} {probe}");
    let seen_all = |lines: &[String]| {
        let r = reconciles(lines);
        lines.contains(&want) && expected.iter().all(|k| r.iter().any(|(n, _)| n == k))
    };
    if !child.wait_until(WAIT, seen_all).await {
        let last = child.last_line();
        return Err(error(format!(
            "restart did not reconcile the changes: {last}"
        )));
    }
    let lists = server.lists().await? - before;
    let lines = child.lines();
    child.kill();
    let reads = crate::child::reads(&lines);
    ensure(lists == reads, || {
        format!(
            "the controller's restart made {lists} LIST calls ({reads} limit=1 reads of the server's resourceVersion)"
        )
    })?;
    // Each changed (or never recorded) Pod is reconciled, last at its current version; no
    // version is reconciled twice, none the state already recorded, and no unchanged Pod.
    // (A Pod without a record may be reconciled at its stored version by the start-up sweep
    // and then at its newer one from the watch: two versions, both needed; one deleted while
    // the controller was down is still in the store when the sweep runs, and one whose
    // reconcile was not yet on disk, at most 20 ms of batched records, is reconciled again.)
    let got = reconciles(&lines);
    let mut last: BTreeMap<&str, &str> = BTreeMap::new();
    let mut seen = std::collections::BTreeSet::new();
    let mut wrong = Vec::new();
    for (k, rv) in got.iter().filter(|(k, _)| k != PROBE) {
        let recorded_rv = recorded.get(k).and_then(|r| r.as_deref());
        if !seen.insert((k, rv)) {
            wrong.push(format!("{k} twice at {rv}"));
        } else if recorded_rv == Some(rv.as_str()) {
            wrong.push(format!("{k} again at its recorded {rv}"));
        } else if !expected.contains(k) && now.contains_key(k) {
            wrong.push(format!("{k} unchanged, reconciled at {rv}"));
        }
        last.insert(k, rv);
    }
    for k in &expected {
        match last.get(k.as_str()) {
            Some(rv) if Some(*rv) == now.get(k).map(String::as_str) => {}
            other => wrong.push(format!(
                "{k} last reconciled at {other:?}, not {:?}",
                now.get(k)
            )),
        }
    }
    ensure(wrong.is_empty(), || {
        format!(
            "{} reconciles after the restart, {} Pods changed: {} wrong, e.g. {:?}",
            got.len(),
            expected.len(),
            wrong.len(),
            wrong.iter().take(6).collect::<Vec<_>>()
        )
    })?;
    ensure(expected.len() >= 45, || {
        format!("only {} changes to reconcile", expected.len())
    })
}
