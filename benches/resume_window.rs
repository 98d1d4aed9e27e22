//! How long a store can stay down and still resume its WATCH without a relist, against a
//! real kube-apiserver (the realk8s folder of `KUBE_PERSIST_REALK8S`, or the one beside the
//! checkout), under steady writes.
//!
//! ```text
//! cargo bench --bench resume_window [-- --rate 10 --down 30,60,90,120,180]
//! ```
//! For each downtime: a store of the ConfigMaps of one namespace syncs and goes live, is
//! closed, ConfigMaps are updated at `--rate` writes per second for the downtime, and the
//! store reopens: it either resumes from its checkpoint (`resumed`) or gets `410 Gone` and
//! relists (`relisted`). The window is the API server's watch history (its watch cache),
//! not the store's. One line per downtime:
//! `RESULT resume_window rate=<R> down_s=<T> writes=<W> outcome=<resumed|relisted> relists=<n> list_pages=<p> caught_up_ms=<ms>`

use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::Api;
use kube::api::{ObjectMeta, Patch, PatchParams, PostParams};
use kube_persist::{Db, StreamConfig};
use kube_persist_testkit::realk8s::{self, RealK8s, Target};
use serde_json::json;

const NAMESPACE: &str = "resume-window";
const OBJECTS: usize = 50;

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn main() {
    let rate: f64 = arg("--rate").map_or(10.0, |r| r.parse().expect("--rate: a number"));
    let downs: Vec<u64> = arg("--down")
        .unwrap_or_else(|| "30,60,90,120,180".into())
        .split(',')
        .map(|d| d.trim().parse().expect("--down: seconds, comma-separated"))
        .collect();
    let folder = match realk8s::locate_or(concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/realk8s"))
    {
        Target::Folder(f) => f,
        Target::Kubeconfig(_) => panic!("needs a realk8s folder, not an external cluster"),
        Target::Missing(why) => {
            println!("resume_window: skipped: {why}");
            return;
        }
    };
    let server = RealK8s::start(&folder, "").expect("kube-apiserver starts");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let client = server.client().await.expect("client");
        let version = realk8s::git_version(&client).await.expect("version");
        eprintln!("kube-apiserver {version}, {rate} writes/s, downtimes {downs:?} s");
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(NAMESPACE.into()),
                ..Default::default()
            },
            ..Default::default()
        };
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .expect("namespace");
        let api: Api<ConfigMap> = Api::namespaced(client.clone(), NAMESPACE);
        for i in 0..OBJECTS {
            let cm = ConfigMap {
                metadata: ObjectMeta {
                    name: Some(format!("cm-{i}")),
                    ..Default::default()
                },
                ..Default::default()
            };
            api.create(&PostParams::default(), &cm).await.expect("create");
        }
        let mut written = 0u64;
        for down in downs {
            let dir = tempfile::tempdir().expect("tempdir");
            // Sync and go live, then close the store.
            {
                let db = Db::open(dir.path()).expect("open");
                let (reader, watcher) = db
                    .store("cms", api.clone(), StreamConfig::default())
                    .expect("store");
                let task = tokio::spawn(watcher.run());
                reader.wait_until_live().await.expect("live");
                task.abort();
                let _ = task.await;
            }
            // Steady writes while it is down.
            let every = Duration::from_secs_f64(1.0 / rate);
            let mut tick = tokio::time::interval(every);
            let until = Instant::now() + Duration::from_secs(down);
            let mut writes = 0u64;
            while Instant::now() < until {
                tick.tick().await;
                let name = format!("cm-{}", written % OBJECTS as u64);
                let patch = json!({"data": {"n": written.to_string()}});
                api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .expect("patch");
                written += 1;
                writes += 1;
            }
            // Reopen: resumed or relisted?
            let db = tokio::task::spawn_blocking({
                let path = dir.path().to_path_buf();
                move || Db::open(path)
            })
            .await
            .expect("join")
            .expect("reopen");
            let (reader, watcher) = db
                .store("cms", api.clone(), StreamConfig::default())
                .expect("store");
            let started = Instant::now();
            let task = tokio::spawn(async move {
                let mut events = std::pin::pin!(watcher.stream());
                while events.next().await.is_some() {}
            });
            tokio::time::timeout(Duration::from_secs(120), reader.wait_until_caught_up())
                .await
                .expect("caught up within 120 s")
                .expect("caught up");
            let caught_up_ms = started.elapsed().as_millis();
            let stats = reader.stats();
            task.abort();
            let outcome = if stats.relists > 0 { "relisted" } else { "resumed" };
            println!(
                "RESULT resume_window rate={rate} down_s={down} writes={writes} outcome={outcome} relists={} list_pages={} caught_up_ms={caught_up_ms}",
                stats.relists, stats.list_pages
            );
        }
    });
}
