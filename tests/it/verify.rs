//! `Db::verify` of stores that do not stand still (issue 49): beside their running writer
//! under create/delete churn, and while a narrowed shard's prune removes the objects outside
//! it. Neither is a store that differs from the server, and neither may be reported as one.

use std::time::Duration;

use kube_persist::{Engine, Error, Shard, ShardKey, StreamConfig, Verdict, Verification};
use kube_persist_testkit::{ResourceType, ServerHandle, make_pod};

use crate::common::{Fixture, drive, eventually};

const PODS: usize = 200;

/// How long the server holds each LIST page while a round churns (it lets the first LIST of
/// a verification go on earlier when the churn is applied).
pub(crate) const HOLD: Duration = Duration::from_millis(500);

/// Beside a verification whose LIST pages the server holds ([`HOLD`], set with `page_delay`
/// by the caller before the verification starts): once its first LIST has arrived (`lists`:
/// the LIST count before), create 6 Pods and delete 3, wait until the writer has applied
/// them (`checkpoint`: the writer's), and release the LISTs. The first list then sees the
/// churn and so does the store, but the object count the verification read before it does
/// not: the store moved during the comparison.
pub(crate) async fn churn_during_the_first_list(
    h: &ServerHandle,
    lists: u64,
    round: usize,
    checkpoint: impl Fn() -> Option<String>,
) {
    eventually("the verification's first LIST", || h.counts().list > lists).await;
    let rt = ResourceType::pods();
    for i in 0..6u64 {
        let name = format!("churn-{round}-{i}");
        h.create(&rt, make_pod("ns-0", &name, i)).unwrap();
    }
    let doomed: Vec<(String, String)> = h.resource_versions(&rt).into_keys().take(3).collect();
    for (ns, name) in doomed {
        h.delete(&rt, Some(&ns), &name);
    }
    let last = h.resource_version();
    eventually("the writer applied the churn", || {
        checkpoint().as_deref() == Some(last.as_str())
    })
    .await;
    h.faults().page_delay(Duration::ZERO);
}

/// Whether a verification beside a running writer answered as it may: the store is
/// correct, or it moved during each attempt (`Error::NotVerifiable`). Never `Differs`, never
/// a drifted count. Returns whether it concluded.
fn answered_beside_a_writer(round: usize, result: kube_persist::Result<Verification>) -> bool {
    match result {
        Ok(report) => {
            assert!(
                report.is_ok() && report.count_consistent(),
                "round {round}: a healthy store beside its writer reported as wrong: {report:?}"
            );
            true
        }
        Err(Error::NotVerifiable { detail, .. }) if detail.contains("in a row") => false,
        Err(e) => panic!("round {round}: {e}"),
    }
}

/// Ten verifications of a healthy store beside its running writer, each with Pods created
/// and deleted during its first comparison: none says the store differs or that its count
/// drifted (the store moved: it is verified again).
async fn verify_beside_a_writer_under_churn_never_differs(engine: Engine) {
    let fx = Fixture::with_pods(PODS, 2).await;
    let h = &fx.h;
    let db = fx.open(engine);
    let (reader, _w) = fx.synced_pods(&db, StreamConfig::default()).await;
    let mut concluded = 0;
    for round in 0..10 {
        h.faults().page_delay(HOLD);
        let lists = h.counts().list;
        let verifying = tokio::spawn({
            let (db, client) = (db.clone(), fx.server.client());
            async move { db.verify("pods", client, 10).await }
        });
        churn_during_the_first_list(h, lists, round, || reader.checkpoint()).await;
        if answered_beside_a_writer(round, verifying.await.unwrap()) {
            concluded += 1;
        }
    }
    assert!(concluded > 0, "no verification concluded in ten rounds");
}

/// A verification while a narrowed shard's prune is pending (the store reopened with a
/// quarter of its half, its watcher not started) and while it runs: the objects outside
/// the quarter that the prune has not removed yet are not differences.
async fn verify_during_a_prune_reports_no_difference(engine: Engine) {
    let fx = Fixture::with_pods(PODS, 4).await;
    let db = fx.open(engine);
    let cfg = |shard: Shard| StreamConfig::default().shard(shard);
    let half = Shard::even(ShardKey::Uid, 0, 2).unwrap();
    let quarter = Shard::even(ShardKey::Uid, 1, 4).unwrap();
    let (reader, w) = fx.synced_pods(&db, cfg(half)).await;
    let in_half = reader.len() as u64;
    w.stop().await;
    drop(reader);

    let (reader, watcher) = db.store("pods", fx.pods(), cfg(quarter.clone())).unwrap();
    let in_quarter =
        fx.h.list(&ResourceType::pods())
            .iter()
            .filter(|p| {
                let m = &p["metadata"];
                quarter.contains(m["uid"].as_str(), m["namespace"].as_str())
            })
            .count() as u64;
    assert!(in_quarter < in_half, "the quarter holds fewer objects");
    let report = db.verify("pods", fx.server.client(), 10).await.unwrap();
    assert_eq!(report.verdict, Verdict::Equal, "prune pending: {report:?}");
    assert!(report.is_ok(), "{report:?}");
    assert_eq!(
        (report.stored_objects, report.server_objects),
        (in_half, in_quarter),
        "nothing pruned yet"
    );
    assert_eq!(report.awaiting_prune, in_half - in_quarter, "{report:?}");

    // The prune runs beside the verification.
    let w = drive(watcher);
    let result = db.verify("pods", fx.server.client(), 10).await;
    answered_beside_a_writer(0, result);
    reader.wait_until_ready().await.unwrap();
    eventually("the prune is done", || reader.len() as u64 == in_quarter).await;
    let report = db.verify("pods", fx.server.client(), 10).await.unwrap();
    assert_eq!(report.verdict, Verdict::Equal, "pruned: {report:?}");
    assert_eq!(
        (report.stored_objects, report.server_objects),
        (in_quarter, in_quarter)
    );
    assert_eq!(report.awaiting_prune, 0);
    w.stop().await;
}

engine_tests!(async:
    verify_beside_a_writer_under_churn_never_differs,
    verify_during_a_prune_reports_no_difference,
);
