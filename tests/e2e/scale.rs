//! Scaling the example operator's StatefulSet 2 -> 3 -> 2 against kube-apiserver, where no
//! StatefulSet controller or kubelet runs: the ordinals are processes of this binary, each
//! the operator's `--cluster` mode with `--shards-from` the StatefulSet, a store of its own
//! and a label selector (this scenario's Pods). At each step the test sets `spec.replicas`,
//! waits until the running replicas stop by themselves (they follow the count), and starts
//! the ordinals again, as the kubelet and the StatefulSet controller would; once the
//! replicas are ready it stops them and checks their stores: disjoint slices whose union is
//! every Pod, so that each Pod is owned (stored and reconciled) by exactly one replica.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use kube_persist::{Db, DbConfig};
use serde_json::json;

use crate::child::Operator;
use crate::support::{Fail, Outcome, Server, ensure, error};

const NS: &str = "e2e-scale";
const NAME: &str = "kp-scale";
const LABELS: &str = "e2e-scale=yes";
const PODS: usize = 60;
const WAIT: Duration = Duration::from_secs(90);

pub async fn scale(s: Arc<Server>) -> Outcome {
    let client = s.client.clone();
    crate::support::ensure_namespace(&client, NS).await?;
    let sets = Api::<StatefulSet>::namespaced(client.clone(), NS);
    let set: StatefulSet = serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": NAME},
        "spec": {
            "replicas": 2,
            "serviceName": NAME,
            "selector": {"matchLabels": {"app": NAME}},
            "template": {
                "metadata": {"labels": {"app": NAME}},
                "spec": {"containers": [{"name": "c", "image": "example.invalid/c:1"}]},
            },
        },
    }))?;
    sets.create(&PostParams::default(), &set).await?;
    let pods = Api::<Pod>::namespaced(client.clone(), NS);
    for i in 0..PODS {
        let pod: Pod = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("pod-{i}"), "labels": {"e2e-scale": "yes"}},
            "spec": {"containers": [{"name": "c", "image": "example.invalid/c:1"}]},
        }))?;
        pods.create(&PostParams::default(), &pod).await?;
    }
    let all: BTreeSet<String> = (0..PODS).map(|i| format!("{NS}/pod-{i}")).collect();
    let tmp = tempfile::tempdir()?;
    let dirs: Vec<PathBuf> = (0..3)
        .map(|i| tmp.path().join(format!("store-{i}")))
        .collect();
    let sts = format!("{NS}/{NAME}");
    let start = |ordinals: std::ops::Range<usize>| -> Vec<Operator> {
        ordinals
            .map(|i| Operator::spawn(i, &dirs[i], &s.kubeconfig, &sts, LABELS))
            .collect()
    };
    let mut report = Vec::new();

    // 2 replicas.
    let running = start(0..2);
    ready(&running).await?;
    // 2 -> 3: the running replicas stop by themselves; the ordinals start again.
    set_replicas(&sets, 3).await?;
    stopped_by_themselves(running).await?;
    let running = start(0..3);
    ready(&running).await?;
    stop(running).await?;
    report.push(owned_once(&all, &dirs[..3], 3)?);
    // 3 -> 2: the same; ordinal 2 finds itself past the count and exits at once.
    let running = start(0..3);
    ready(&running).await?;
    set_replicas(&sets, 2).await?;
    stopped_by_themselves(running).await?;
    let mut running = start(0..3);
    let past = running.pop().expect("ordinal 2");
    let exited = past
        .wait_for(WAIT, |l| l.contains("past the 2 replicas: nothing to own"))
        .await;
    ensure(exited, || {
        format!("ordinal 2 did not exit: {}", past.last_line())
    })?;
    ready(&running).await?;
    stop(running).await?;
    report.push(owned_once(&all, &dirs[..2], 2)?);
    for name in all
        .iter()
        .map(|k| k.trim_start_matches(&format!("{NS}/")).to_string())
    {
        let _ = pods.delete(&name, &Default::default()).await;
    }
    let _ = sets.delete(NAME, &Default::default()).await;
    println!("e2e scale: {}", report.join("; "));
    Ok(())
}

async fn set_replicas(sets: &Api<StatefulSet>, n: i32) -> Outcome {
    let patch = json!({"spec": {"replicas": n}});
    sets.patch(NAME, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

/// Every replica serves `/readyz` 200 (its store synced and its watch live).
async fn ready(running: &[Operator]) -> Outcome {
    for op in running {
        let addr = op
            .addr(WAIT)
            .await
            .ok_or_else(|| error(format!("no probe port: {}", op.last_line())))?;
        let deadline = Instant::now() + WAIT;
        loop {
            if crate::common::http_get(&addr, "/readyz").await.0 == 200 {
                break;
            }
            if Instant::now() > deadline {
                return Err(error(format!("{addr} not ready: {}", op.last_line())));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(())
}

/// The replicas saw the new count, stopped gracefully and exited 0.
async fn stopped_by_themselves(running: Vec<Operator>) -> Outcome {
    for op in running {
        let said = op
            .wait_for(WAIT, |l| l.contains("stopping to re-shard"))
            .await;
        ensure(said, || {
            format!("a replica did not follow the count: {}", op.last_line())
        })?;
        ensure(op.exited_ok(WAIT).await, || {
            format!(
                "a replica did not exit 0 after re-sharding: {}",
                op.last_line()
            )
        })?;
    }
    Ok(())
}

/// SIGTERM every replica and wait for its graceful exit.
async fn stop(running: Vec<Operator>) -> Outcome {
    for op in running {
        op.terminate();
        ensure(op.exited_ok(WAIT).await, || {
            format!("a replica did not exit 0 on SIGTERM: {}", op.last_line())
        })?;
    }
    Ok(())
}

/// The stores of `dirs` (closed) hold disjoint sets of Pods whose union is `all`.
fn owned_once(all: &BTreeSet<String>, dirs: &[PathBuf], replicas: usize) -> Result<String, Fail> {
    let mut owner: BTreeMap<String, usize> = BTreeMap::new();
    let mut sizes = Vec::new();
    for (i, dir) in dirs.iter().enumerate() {
        let keys = stored(dir)?;
        sizes.push(keys.len());
        for k in keys {
            if let Some(other) = owner.insert(k.clone(), i) {
                return Err(Fail::Diverged(format!(
                    "{replicas} replicas: {k} is in the stores of ordinals {other} and {i}"
                )));
            }
        }
    }
    let owned: BTreeSet<String> = owner.into_keys().collect();
    ensure(owned == *all, || {
        let missing: Vec<_> = all.difference(&owned).take(5).collect();
        let extra: Vec<_> = owned.difference(all).take(5).collect();
        format!("{replicas} replicas: missing {missing:?}, extra {extra:?}")
    })?;
    Ok(format!(
        "{replicas} replicas own {sizes:?} of {} Pods, each exactly once",
        all.len()
    ))
}

fn stored(dir: &Path) -> Result<BTreeSet<String>, Fail> {
    let db = Db::open_with(dir, DbConfig::default().read_only())?;
    let mut keys = BTreeSet::new();
    for object in db.raw_objects("pods")? {
        let (key, _) = object?;
        keys.insert(key.to_string());
    }
    Ok(keys)
}
