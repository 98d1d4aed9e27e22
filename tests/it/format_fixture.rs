//! A store written by the previous on-disk format, committed under `tests/fixtures/`, opens
//! with this version as a clean relist: no error, no resume of its old records, the
//! server's objects afterwards, and the stream rewritten in the current format.
//!
//! The fixture is a real store directory written by the code of that format (its README
//! says by which commit and engine version); `write_format_fixture` below writes a new one
//! when the format moves again:
//!
//! ```text
//! KP_WRITE_FORMAT_FIXTURE=tests/fixtures/<name>/store \
//!   target/release/deps/it-<hash> format_fixture::write_format_fixture --ignored --exact
//! ```

use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube_persist::{Db, StreamConfig, SyncPhase};
use kube_persist_testkit::ResourceType;

use crate::common::{Ev, Fixture, converge, drive};

/// The committed store of the previous format: 3 Pods (`ns-0/pod-0` to `pod-2`) in stream
/// `pods`, synced at the server's revision 3 and closed.
const PREVIOUS: &str = "tests/fixtures/store-format-4-redb-4.6/store";
/// The format the fixture was written in.
const PREVIOUS_FORMAT: u32 = 4;
/// How the fixture's server was seeded (the test's server is seeded the same way, so that
/// the fixture's checkpoint is a revision this server can resume from: only the format,
/// not a stale checkpoint, makes the store list again).
const PODS: usize = 3;

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let target = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), target).unwrap();
        }
    }
}

/// The uid of every object, `namespace/name` → uid.
fn uids(objects: impl IntoIterator<Item = Pod>) -> std::collections::BTreeMap<String, String> {
    objects
        .into_iter()
        .map(|p| {
            let m = p.metadata;
            (
                format!("{}/{}", m.namespace.unwrap_or_default(), m.name.unwrap()),
                m.uid.unwrap(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_of_the_previous_format_opens_as_a_clean_relist() {
    let fx = Fixture::with_pods(PODS, 1).await;
    let path: PathBuf = fx.path().join("store");
    copy_dir(&Path::new(env!("CARGO_MANIFEST_DIR")).join(PREVIOUS), &path);

    // Before it is opened for writing, the tool's view reads it as it is.
    let db = Db::open(&path).unwrap();
    let info = db.streams().unwrap();
    assert_eq!(info.len(), 1, "{info:?}");
    assert_eq!(info[0].format_version, PREVIOUS_FORMAT);
    assert_eq!(info[0].objects, PODS as u64);
    assert_eq!(info[0].checkpoint.as_deref(), Some("3"));
    assert_eq!(
        fx.h.revision(),
        3,
        "the server is at the fixture's checkpoint"
    );
    let stored_uids = uids(
        db.raw_objects("pods")
            .unwrap()
            .map(|o| serde_json::from_slice::<Pod>(&o.unwrap().1).unwrap()),
    );
    let server_uids = uids(
        fx.h.list(&ResourceType::pods())
            .into_iter()
            .map(|v| serde_json::from_value::<Pod>(v).unwrap()),
    );
    assert_eq!(stored_uids.len(), PODS);
    assert_ne!(
        stored_uids, server_uids,
        "the fixture's objects are another server's (their uids differ)"
    );

    // Opened by a watcher: a full list from the start (no `Resumed`, no error), every
    // object the server's.
    fx.h.reset_counts();
    let (reader, watcher) = db
        .store(
            "pods",
            Api::<Pod>::all(fx.server.client()),
            StreamConfig::default(),
        )
        .unwrap();
    let mut w = drive(watcher);
    let first = w
        .until(|e| matches!(e, Ev::Init | Ev::Resumed(_) | Ev::Error(_)))
        .await;
    assert_eq!(first, [Ev::Init], "a relist, not a resume");
    let seen = w.until(|e| *e == Ev::InitDone).await;
    assert!(!seen.iter().any(|e| matches!(e, Ev::Error(_))), "{seen:?}");
    assert!(fx.h.counts().list >= 1, "listed again");
    converge(&reader, &fx.h, &ResourceType::pods()).await;
    let now_uids = uids(reader.iter().map(|o| (*o.unwrap()).clone()));
    assert_eq!(
        now_uids, server_uids,
        "the server's objects, not the fixture's"
    );
    w.stop().await;
    drop(reader);

    // Written in the current format from then on.
    let info = db.streams().unwrap();
    assert!(
        info[0].format_version > PREVIOUS_FORMAT,
        "rewritten in the current format: {info:?}"
    );
    assert_eq!(info[0].phase, SyncPhase::Synced);
    assert_eq!(info[0].objects, PODS as u64);
}

/// Writes a store of the current format to `$KP_WRITE_FORMAT_FIXTURE` (ignored: run by
/// hand before a format change, see the module's doc).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "writes a fixture; run by hand before a format change"]
async fn write_format_fixture() {
    let out = PathBuf::from(std::env::var("KP_WRITE_FORMAT_FIXTURE").expect("a directory"));
    assert!(!out.exists(), "{} exists", out.display());
    let fx = Fixture::with_pods(PODS, 1).await;
    let db = Db::open(&out).unwrap();
    let (reader, watcher) = db
        .store(
            "pods",
            Api::<Pod>::all(fx.server.client()),
            StreamConfig::default(),
        )
        .unwrap();
    let mut w = drive(watcher);
    w.until(|e| *e == Ev::InitDone).await;
    converge(&reader, &fx.h, &ResourceType::pods()).await;
    w.stop().await;
    drop(reader);
    db.flush().unwrap();
    drop(db);
}
