//! The testkit held to the real kube-apiserver: the same LIST and WATCH requests go to
//! testkit's server and to kube-apiserver v1.36.2 (from the shared realk8s folder, see
//! `kube_persist_testkit::realk8s`), and what the answers say is compared: status codes,
//! Status reasons and causes, event types, ERROR codes, the end bookmark, which list
//! metadata fields are present, how many items. Not values that legitimately differ
//! (resourceVersions, continue tokens, messages).
//!
//! Prints `case <name> same|differs: ...` per case and `differential: <N> cases, <D> differ`;
//! fails if any differs. Without a real server it prints one skip line and passes.

use std::process::ExitCode;

use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{ListParams, PostParams};
use kube::{Api, Client};
use kube_persist_testkit::realk8s::{self, RealK8s, Target};
use kube_persist_testkit::{ServerOptions, TestServer};
use serde_json::{Value, json};

const NS: &str = "diff";
const PODS: usize = 5;

/// What one server's values are for the requests (resourceVersions, tokens).
struct Side {
    name: &'static str,
    client: Client,
    /// A list resourceVersion from before the compaction.
    old_rv: String,
    /// A continue token from before the compaction.
    old_continue: String,
    /// A continue token from after it.
    fresh_continue: String,
}

/// A case: its name and the query (on the namespace's pods) for a side.
type Case = (&'static str, fn(&Side) -> String);

fn cases() -> Vec<Case> {
    vec![
        ("list-exact-without-rv", |_| {
            "resourceVersionMatch=Exact".into()
        }),
        ("list-exact-rv-0", |_| {
            "resourceVersion=0&resourceVersionMatch=Exact".into()
        }),
        ("list-match-unknown", |_| {
            "resourceVersion=1&resourceVersionMatch=Bogus".into()
        }),
        ("list-continue-with-rv", |s| {
            format!("resourceVersion=1&continue={}", s.fresh_continue)
        }),
        ("list-send-initial-events", |_| {
            "sendInitialEvents=true".into()
        }),
        ("list-limit-page", |_| "limit=2".into()),
        ("list-continue-valid", |s| {
            format!("limit=2&continue={}", s.fresh_continue)
        }),
        ("list-continue-malformed", |_| {
            "limit=2&continue=not-a-token".into()
        }),
        ("list-continue-expired", |s| {
            format!("limit=2&continue={}", s.old_continue)
        }),
        ("list-exact-compacted", |s| {
            format!("resourceVersion={}&resourceVersionMatch=Exact", s.old_rv)
        }),
        ("list-label-malformed", |_| {
            "labelSelector=a%20in%20(".into()
        }),
        ("list-field-unsupported", |_| {
            "fieldSelector=spec.foo%3Dbar".into()
        }),
        ("list-field-supported", |_| {
            "fieldSelector=metadata.name%3Dp-0".into()
        }),
        ("list-shard-gate-off", |_| {
            format!("shardSelector={}", shard())
        }),
        ("watch-send-initial-events-without-match", |_| {
            "watch=true&sendInitialEvents=true&allowWatchBookmarks=true&timeoutSeconds=1".into()
        }),
        ("watch-send-initial-events-without-bookmarks", |_| {
            "watch=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&timeoutSeconds=1"
                .into()
        }),
        ("watch-match-without-send-initial-events", |_| {
            "watch=true&resourceVersion=1&resourceVersionMatch=NotOlderThan&timeoutSeconds=1".into()
        }),
        ("watch-initial-events-end-bookmark", |_| {
            "watch=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true&timeoutSeconds=1".into()
        }),
        ("watch-compacted", |s| {
            format!("watch=true&resourceVersion={}&timeoutSeconds=1", s.old_rv)
        }),
    ]
}

fn shard() -> String {
    "shardRange(object.metadata.uid,%20'0x0000000000000000',%20'0x8000000000000000')".into()
}

fn main() -> ExitCode {
    // The workspace's CI environment keeps the realk8s folder beside the checkout.
    let beside = concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/realk8s");
    let folder = match realk8s::locate_or(beside) {
        Target::Folder(f) => f,
        Target::Kubeconfig(_) => {
            println!(
                "differential: skipped: needs the realk8s folder (compact.sh), not an external cluster"
            );
            return ExitCode::SUCCESS;
        }
        Target::Missing(why) => {
            println!("differential: skipped: {why}");
            return ExitCode::SUCCESS;
        }
    };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    match rt.block_on(run(folder)) {
        Ok(0) => ExitCode::SUCCESS,
        Ok(_) => ExitCode::FAILURE,
        Err(e) => {
            println!("differential: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

async fn run(folder: std::path::PathBuf) -> Res<usize> {
    // Two real servers: the default one, and one with the watch cache off for Pods, for the
    // cases about compacted versions (with the cache, kube-apiserver still serves a
    // just-compacted version from memory; testkit, like etcd, does not).
    let f = folder.clone();
    let real = tokio::task::spawn_blocking(move || RealK8s::start(&f, "")).await??;
    let nocache =
        tokio::task::spawn_blocking(move || RealK8s::start(&folder, "--watch-cache-sizes=pods#0"))
            .await??;
    let testkit = TestServer::start_with(ServerOptions {
        sharded_list_and_watch: false, // as the real server's default (gate off)
        // kube-apiserver's period (testkit's 1 s default suits tests, not a comparison).
        bookmark_interval: std::time::Duration::from_secs(60),
        ..ServerOptions::default()
    })
    .await;
    let tk_client = kube_persist_testkit::client_for_opts(&testkit.url(), None, false);

    let mut config = real.config().await?;
    config.default_retry = false;
    let real_client = Client::try_from(config)?;
    let real_side = prepare("kube-apiserver", real_client, || real.compact().map(drop)).await?;
    let mut config = nocache.config().await?;
    config.default_retry = false;
    let nocache_side = prepare("kube-apiserver (pods#0)", Client::try_from(config)?, || {
        nocache.compact().map(drop)
    })
    .await?;
    let h = testkit.handle();
    let tk_side = prepare("testkit", tk_client, || {
        h.compact();
        Ok(())
    })
    .await?;

    let (mut n, mut d) = (0, 0);
    for (name, query) in cases() {
        let watch = name.starts_with("watch");
        let real_side = if name.contains("compacted") || name.contains("expired") {
            &nocache_side
        } else {
            &real_side
        };
        let a = answer(real_side, &query(real_side), watch).await?;
        let b = answer(&tk_side, &query(&tk_side), watch).await?;
        n += 1;
        if a == b {
            println!("case {name} same: {a}");
        } else {
            d += 1;
            println!(
                "case {name} differs: {} [{a}] vs {} [{b}]",
                real_side.name, tk_side.name
            );
        }
    }
    println!("differential: {n} cases, {d} differ");
    Ok(d)
}

/// Pods in namespace `diff`, an old resourceVersion and continue token, a change, then a
/// compaction (`compact`), then a fresh continue token.
async fn prepare(
    name: &'static str,
    client: Client,
    compact: impl FnOnce() -> Result<(), realk8s::Error>,
) -> Res<Side> {
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": NS}}))?;
    // testkit serves no namespaces (and needs none); the real server does.
    let _ = Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await;
    let pods = Api::<Pod>::namespaced(client.clone(), NS);
    let pod = |i: usize| -> Res<Pod> {
        Ok(serde_json::from_value(json!({
            "metadata": {"name": format!("p-{i}"), "namespace": NS},
            "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}
        }))?)
    };
    for i in 0..PODS {
        pods.create(&PostParams::default(), &pod(i)?).await?;
    }
    let page = pods.list(&ListParams::default().limit(2)).await?;
    let old_rv = page.metadata.resource_version.clone().unwrap_or_default();
    let old_continue = page.metadata.continue_.clone().unwrap_or_default();
    // Two changes after them (testkit serves no PATCH: creates). Two, so that the old
    // version is strictly below the compaction's revision minus one: kube-apiserver without
    // the watch cache still replays a watch from exactly that revision minus one (etcd keeps
    // the compaction revision's own event; a MODIFIED there answers ERROR 500 "PrevKv=nil",
    // an ADDED is sent), where testkit answers 410. That boundary is not compared.
    pods.create(&PostParams::default(), &pod(PODS)?).await?;
    pods.create(&PostParams::default(), &pod(PODS + 1)?).await?;
    tokio::task::block_in_place(compact)?;
    let page = pods.list(&ListParams::default().limit(2)).await?;
    let fresh_continue = page.metadata.continue_.clone().unwrap_or_default();
    Ok(Side {
        name,
        client,
        old_rv,
        old_continue,
        fresh_continue,
    })
}

/// What a server's answer to `GET .../pods?query` says, in comparable terms.
async fn answer(side: &Side, query: &str, watch: bool) -> Res<String> {
    let req = http::Request::get(format!("/api/v1/namespaces/{NS}/pods?{query}"))
        .body(kube::client::Body::from(Vec::new()))?;
    // Every watch case carries timeoutSeconds=1; the bound only turns a hang into an error.
    let res =
        tokio::time::timeout(std::time::Duration::from_secs(20), side.client.send(req)).await??;
    let status = res.status().as_u16();
    let body = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        res.into_body().collect_bytes(),
    )
    .await??;
    if status != 200 {
        let s: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        return Ok(format!("{status} {}", status_summary(&s)));
    }
    if !watch {
        let list: Value = serde_json::from_slice(&body)?;
        let mut keys: Vec<&str> = list["metadata"]
            .as_object()
            .map(|m| m.keys().map(String::as_str).collect())
            .unwrap_or_default();
        keys.sort_unstable();
        let items = list["items"].as_array().map_or(0, Vec::len);
        return Ok(format!(
            "200 {} metadata {keys:?} items {items}",
            list["kind"].as_str().unwrap_or("?")
        ));
    }
    let mut events: Vec<String> = Vec::new();
    for line in body.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
        let e: Value = serde_json::from_slice(line)?;
        let t = e["type"].as_str().unwrap_or("?");
        let ev = match t {
            "ERROR" => format!("ERROR {}", status_summary(&e["object"])),
            "BOOKMARK" => {
                let end =
                    e["object"]["metadata"]["annotations"]["k8s.io/initial-events-end"].as_str();
                format!("BOOKMARK{}", if end == Some("true") { " end" } else { "" })
            }
            t => t.to_string(),
        };
        match events.last_mut() {
            Some(last) if last.split(" x").next() == Some(ev.as_str()) => {
                let n: usize = last
                    .rsplit_once(" x")
                    .map_or(1, |(_, n)| n.parse().unwrap_or(1));
                *last = format!("{ev} x{}", n + 1);
            }
            _ => events.push(ev),
        }
    }
    Ok(format!("200 watch [{}]", events.join(", ")))
}

/// A Status's code, reason and causes (type and field), not its message.
fn status_summary(s: &Value) -> String {
    let causes: Vec<String> = s["details"]["causes"]
        .as_array()
        .map(|c| {
            c.iter()
                .map(|c| {
                    format!(
                        "{}:{}",
                        c["reason"].as_str().unwrap_or(""),
                        c["field"].as_str().unwrap_or("")
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    format!(
        "{} {} causes {causes:?}",
        s["code"],
        s["reason"].as_str().unwrap_or("-")
    )
}
