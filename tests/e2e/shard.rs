//! Sharded stores (KEP-5866 `shardSelector`) on a server with `ShardedListAndWatch` (the
//! server filters and echoes `shardInfo`) and without it (the client filters, one warning
//! per store); a narrowing re-shard resumes with 0 LIST.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kube_persist::{Reader, Shard, ShardKey};
use kube_persist_testkit::realk8s;

use crate::common::{self, Ev, drive};
use crate::support::*;
use crate::sync::config;

const SHARDS: u32 = 4;
const WARNING: &str = "server ignores shardSelector";

/// `namespace/name` → resourceVersion of the server's Pods in `shard` (hashed here).
async fn expected(server: &Server, shard: &Shard) -> Result<BTreeMap<String, String>, Fail> {
    let metas = server_metas(&server.client, None)
        .await?
        .unwrap_or_default();
    Ok(metas
        .into_iter()
        .filter(|(_, m)| shard.contains(m.uid.as_deref(), m.namespace.as_deref()))
        .map(|(k, m)| (k, m.resource_version.unwrap_or_default()))
        .collect())
}

/// `metadata.shardInfo.selector` of a one-item LIST with `shard`'s selector, if echoed.
async fn echoed(server: &Server, shard: &Shard) -> Result<Option<String>, Fail> {
    let query: String = form_urlencoded::Serializer::new(String::new())
        .append_pair("limit", "1")
        .append_pair("shardSelector", &shard.selector())
        .finish();
    let req = http::Request::get(format!("/api/v1/pods?{query}")).body(Vec::new())?;
    let list: serde_json::Value = server.client.request(req).await?;
    Ok(list["metadata"]["shardInfo"]["selector"]
        .as_str()
        .map(str::to_string))
}

/// Four stores `shards(i, 4)`: each holds exactly its shard, they are disjoint and their
/// union is the server's collection. `gate`: the server filters (nothing dropped on the
/// client, no warning); otherwise the client filters and warns once per store.
pub async fn sharded(server: Arc<Server>, gate: bool) -> Outcome {
    let enabled = realk8s::feature_enabled(&server.client, "ShardedListAndWatch").await?;
    if enabled != gate {
        return Err(error(format!(
            "ShardedListAndWatch enabled: {enabled}, wanted {gate}"
        )));
    }
    let probe = Shard::even(ShardKey::Uid, 1, SHARDS)?;
    let echo = echoed(&server, &probe).await?;
    let want_echo = gate.then(|| probe.selector());
    ensure(echo == want_echo, || {
        format!("shardInfo.selector {echo:?}, expected {want_echo:?}")
    })?;

    let warned = crate::warnings::count(WARNING);
    let tmp = tempfile::tempdir()?;
    let mut stores = Vec::new();
    for i in 0..SHARDS {
        let (db, reader, watcher) = open_pods(
            &server,
            tmp.path().join(format!("shard-{i}")),
            common::Engine::Redb,
            config(i % 2 == 1).shards(i, SHARDS),
        )?;
        let mut w = drive(watcher);
        w.until(|e| *e == Ev::InitDone).await;
        stores.push((db, reader, w, Shard::even(ShardKey::Uid, i, SHARDS)?));
    }
    let mut union = BTreeMap::new();
    let mut total = 0;
    for (i, (_, reader, _, shard)) in stores.iter().enumerate() {
        let have = common::store_versions(reader);
        same_as(&have, &expected(&server, shard).await?)
            .map_err(|e| prefix(&format!("shard {i}"), e))?;
        let filtered = reader.stats().shard_client_filtered;
        ensure(gate == (filtered == 0), || {
            format!("shard {i}: {filtered} objects filtered on the client (server filters: {gate})")
        })?;
        total += have.len();
        union.extend(have);
    }
    ensure(total == union.len(), || {
        format!("shards overlap: {total} objects, {} keys", union.len())
    })?;
    same_as(&union, &server_now(&server.client).await?)?;
    let warnings = crate::warnings::count(WARNING) - warned;
    let want = if gate { 0 } else { SHARDS as usize };
    ensure(warnings == want, || {
        format!("{warnings} '{WARNING}' warnings, expected {want}")
    })?;
    for (_, _, w, _) in stores {
        w.stop().await;
    }
    Ok(())
}

fn prefix(what: &str, e: Fail) -> Fail {
    match e {
        Fail::Diverged(m) => Fail::Diverged(format!("{what}: {m}")),
        e => e,
    }
}

/// A store of shard 0 of 4, reopened as the first half of that shard, prunes the rest
/// without a LIST and resumes.
pub async fn narrowing(server: Arc<Server>) -> Outcome {
    let dir = tempfile::tempdir()?;
    let wide = Shard::even(ShardKey::Uid, 0, SHARDS)?;
    let narrow = Shard::new(ShardKey::Uid).range(0, 1 << 61);
    {
        let (_db, reader, watcher) = open_pods(
            &server,
            dir.path(),
            common::Engine::Redb,
            config(false).shard(wide.clone()),
        )?;
        let mut w = drive(watcher);
        w.until(|e| *e == Ev::InitDone).await;
        same_as(
            &common::store_versions(&reader),
            &expected(&server, &wide).await?,
        )?;
        w.stop().await;
    }
    let want = expected(&server, &narrow).await?;
    let before = server.lists().await?;
    let (_db, reader, watcher) = open_pods(
        &server,
        dir.path(),
        common::Engine::Redb,
        config(false).shard(narrow.clone()),
    )?;
    let mut w = drive(watcher);
    let first = w.until(|e| matches!(e, Ev::Resumed(_) | Ev::Init)).await;
    ensure(matches!(first.last(), Some(Ev::Resumed(_))), || {
        format!("narrowing did not resume: {first:?}")
    })?;
    converge_to(&reader, &want).await?;
    let reads = reader.stats().server_version_reads;
    // kube-apiserver counts a request (`apiserver_request_total`) once its response is
    // written, which the client may read first: wait (at most 5 s) until it has counted the
    // store's reads; any LIST beyond them is then counted too.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let mut lists = server.lists().await? - before;
    while lists < reads && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        lists = server.lists().await? - before;
    }
    ensure(lists == reads, || {
        format!(
            "narrowing made {lists} LIST calls ({reads} limit=1 reads of the server's resourceVersion)"
        )
    })?;
    w.stop().await;
    Ok(())
}

/// Wait until the store holds exactly `want` (it does not change on the server meanwhile).
async fn converge_to(reader: &Reader<Pod>, want: &BTreeMap<String, String>) -> Outcome {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let have = common::store_versions(reader);
        if have == *want || tokio::time::Instant::now() > deadline {
            return same_as(&have, want);
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}
