//! Verifications of real stores against the testkit server, in a state only the store
//! layer makes here: the window of a delta relist (DESIGN.md, invariant 1's bounded
//! exception). The state is built as a delta relist leaves it: the store holds the server's
//! objects as the watch brought them, then its checkpoint is put back to an earlier list's
//! resourceVersion and the window opened (`FETCHED_KEY`), as after a relist listed at that
//! resourceVersion, fetched newer bodies and found deleted objects gone (an empty answer),
//! and was stopped before its watch replayed past them.

use std::collections::BTreeSet;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube_persist_testkit::{ResourceType, ServerHandle, TestServer, make_pod};

use super::{Difference, Verdict, verify};
use crate::disk::keys::{FETCHED_KEY, STATE_KEY};
use crate::disk::{WriteBatch, record};
use crate::store::{Dir, Phase, State};
use crate::sync::{StreamConfig, open_store};

/// Run stream `pods`'s watcher until the store has applied everything the server holds.
async fn sync(dir: &Dir, server: &TestServer) {
    let h = server.handle();
    let api = Api::<Pod>::all(server.client());
    let (reader, watcher) = open_store(dir, "pods", api, StreamConfig::default(), &()).unwrap();
    let task = tokio::spawn(watcher.run());
    let last = h.resource_version();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while reader.checkpoint().as_deref() != Some(last.as_str()) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the store did not reach {last}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    task.abort();
    let _ = task.await;
}

/// Put stream `pods`'s checkpoint back to `checkpoint`, keeping its objects, and open the
/// window of a delta relist that fetched bodies up to `fetched` (`None`: close it).
fn set_window(dir: &Dir, checkpoint: &str, fetched: Option<&str>) {
    let keyspace = dir.storage().keyspace("pods").unwrap();
    let mut state: State = record::decode(&keyspace.get(STATE_KEY).unwrap().unwrap()).unwrap();
    state.phase = Phase::Synced {
        resource_version: checkpoint.to_string(),
    };
    state.last_synced = Some(checkpoint.to_string());
    let mut batch = WriteBatch::default();
    batch.put(STATE_KEY.to_vec(), record::encode(&state));
    match fetched {
        Some(rv) => batch.put(FETCHED_KEY.to_vec(), record::encode(&rv.to_string())),
        None => batch.delete(FETCHED_KEY.to_vec()),
    }
    keyspace.apply(batch).unwrap();
}

/// Set label `touched=<value>` on Pod `ns/name`: a new resourceVersion of it.
fn relabel(h: &ServerHandle, (ns, name): &(String, String), value: &str) {
    let rt = ResourceType::pods();
    let mut pod = h.get(&rt, Some(ns), name).unwrap();
    pod["metadata"]["labels"]["touched"] = value.into();
    h.apply(&rt, pod);
}

/// A store in a delta relist's window (an object stored newer than the checkpoint, one
/// deleted before its fetch already gone) is correct while the window is open, and differs
/// from the server at its checkpoint once it is closed; the window explains only those
/// two: an object the server created after the checkpoint is a difference within it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delta_relists_window_is_correct_and_bounded() {
    let server = TestServer::start().await;
    let h = server.handle();
    let rt = ResourceType::pods();
    h.seed_pods(40, 2);
    let tmp = tempfile::tempdir().unwrap();
    let dir = Dir::open(tmp.path(), Default::default()).unwrap();
    sync(&dir, &server).await;
    let checkpoint = h.resource_version();
    let mut keys = h.resource_versions(&rt).into_keys();
    let (a, b) = (keys.next().unwrap(), keys.next().unwrap());
    let key = |(ns, name): &(String, String)| format!("{ns}/{name}");

    // After the checkpoint: `a` changes (a body the relist fetched newer than its list), `b`
    // is deleted (its fetch answered empty).
    relabel(&h, &a, "fetched");
    let fetched = h.resource_version();
    h.delete(&rt, Some(&b.0), &b.1);
    sync(&dir, &server).await;
    set_window(&dir, &checkpoint, Some(&fetched));
    // The server moves on, so that the store differs from its current state and is compared
    // with the list at its checkpoint.
    relabel(&h, &a, "after");
    let report = verify(&dir, "pods", server.client(), 10).await.unwrap();
    assert!(
        matches!(report.verdict, Verdict::Behind { .. }) && report.is_ok(),
        "in the window: {report:?}"
    );
    assert_eq!(report.checkpoint, checkpoint);
    assert_eq!(report.explained_by_delta_relist, 2, "{report:?}");

    // The same store without the window: `a` newer and `b` missing are differences.
    set_window(&dir, &checkpoint, None);
    let report = verify(&dir, "pods", server.client(), 10).await.unwrap();
    assert_eq!(report.verdict, Verdict::Differs, "{report:?}");
    let differences: BTreeSet<String> = report
        .differences
        .iter()
        .map(|d| match d {
            Difference::Version { key, stored, .. } => {
                assert_eq!(*stored, fetched, "{d}");
                format!("version {key}")
            }
            Difference::Missing { key, .. } => format!("missing {key}"),
            other => panic!("unexpected {other}"),
        })
        .collect();
    assert_eq!(
        differences,
        BTreeSet::from([
            format!("version {}", key(&a)),
            format!("missing {}", key(&b))
        ])
    );

    // Bounded: an object created after the checkpoint, which no relist listed there, is a
    // difference in the window too (and the window's two exceptions still are not).
    h.create(&rt, make_pod(&a.0, "created-after", 7)).unwrap();
    sync(&dir, &server).await;
    set_window(&dir, &checkpoint, Some(&h.resource_version()));
    relabel(&h, &a, "later");
    let report = verify(&dir, "pods", server.client(), 10).await.unwrap();
    assert_eq!(report.verdict, Verdict::Differs, "{report:?}");
    match &report.differences[..] {
        [Difference::Extra { key, .. }] => assert_eq!(*key, format!("{}/created-after", a.0)),
        other => panic!("expected one extra object, got {other:?}"),
    }
    assert_eq!(
        (report.difference_count, report.explained_by_delta_relist),
        (1, 2),
        "{report:?}"
    );
    assert!(report.count_consistent(), "{report:?}");
}
