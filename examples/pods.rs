//! Cache every Pod of a real cluster on disk and look them up.
//!
//! ```text
//! cargo run --release --example pods -- --dir /tmp/pod-cache [--namespace NS] [--lookup NS/NAME] [--engine sled|redb]
//! ```
//! Uses the cluster your kubeconfig (or in-cluster service account) points at. Run it
//! twice: the second start resumes from the checkpoint on disk without listing.
//!
//! A new `--dir` gets redb, the default engine (its memory stays flat however many Pods are
//! read, where sled's grows with them: see BENCHMARKS.md); an existing one keeps the engine
//! recorded in it. `--engine` chooses explicitly (and refuses a store of the other engine).

use std::time::{Duration, Instant};

use clap::Parser;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Client};
use kube_persist::{Db, DbConfig, Engine, Event, StreamConfig};

/// Cache every Pod of the cluster your kubeconfig points at on disk, and look them up.
#[derive(Parser)]
struct Args {
    /// Store directory; a second run resumes from its checkpoint without listing.
    #[arg(long)]
    dir: String,
    /// Only this namespace's Pods (default: all namespaces).
    #[arg(long)]
    namespace: Option<String>,
    /// Print this Pod's phase and node every 10 s (default: the store's stats).
    #[arg(long, value_name = "NS/NAME")]
    lookup: Option<String>,
    /// Storage engine (default: the one recorded in --dir, else redb).
    #[arg(long, value_name = "sled|redb")]
    engine: Option<Engine>,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "kube_persist=info".into()),
        )
        .init();
    let Args {
        dir,
        namespace,
        lookup: target,
        engine,
    } = Args::parse();
    let mut db_config = DbConfig::default();
    if let Some(engine) = engine {
        db_config = db_config.engine(engine);
    }

    let client = Client::try_default().await?;
    let api: Api<Pod> = match namespace {
        Some(ns) => Api::namespaced(client, &ns),
        None => Api::all(client),
    };
    let db = Db::open_with_async(&dir, db_config).await?;
    eprintln!("store {dir} ({} engine)", db.engine());
    // managedFields are often half of a Pod; few controllers read them.
    let (reader, watcher) = db.store("pods", api, StreamConfig::default().drop_managed_fields())?;

    let started = Instant::now();
    tokio::spawn(async move {
        let mut events = std::pin::pin!(watcher.stream());
        while let Some(ev) = events.next().await {
            match ev {
                Ok(Event::Resumed {
                    resource_version, ..
                }) => {
                    println!("resumed from checkpoint {resource_version}: no LIST needed")
                }
                Ok(Event::InitDone) => println!("initial list complete"),
                Ok(Event::Apply(p)) => println!(
                    "changed: {}/{}",
                    p.metadata.namespace.unwrap_or_default(),
                    p.metadata.name.unwrap_or_default()
                ),
                Ok(Event::Delete(p)) => println!(
                    "deleted: {}/{}",
                    p.metadata.namespace.unwrap_or_default(),
                    p.metadata.name.unwrap_or_default()
                ),
                Ok(_) => {}
                Err(e) => eprintln!("watch error (retrying): {e}"),
            }
        }
    });

    reader.wait_until_ready().await?;
    println!(
        "{} pods cached in {} after {:.2} s",
        reader.len(),
        dir,
        started.elapsed().as_secs_f64()
    );
    loop {
        if let Some((ns, name)) = target.as_deref().and_then(|t| t.split_once('/')) {
            match reader.get_async(&ObjectRef::new(name).within(ns)).await? {
                Some(pod) => println!(
                    "{ns}/{name}: phase {:?} on node {:?}",
                    pod.status.as_ref().and_then(|s| s.phase.clone()),
                    pod.spec.as_ref().and_then(|s| s.node_name.clone())
                ),
                None => println!("{ns}/{name}: not found"),
            }
        } else {
            let s = reader.stats();
            println!(
                "{} pods; checkpoint {:?}; live {}; written {}, deleted {}, relists {}",
                reader.len(),
                reader.checkpoint(),
                reader.is_live(),
                s.objects_written,
                s.objects_deleted,
                s.relists
            );
        }
        tokio::time::sleep(Duration::from_secs(10)).await;
    }
}
