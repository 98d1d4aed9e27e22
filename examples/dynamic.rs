//! Cache a custom resource (any kind, through `DynamicObject`) on disk.
//!
//! ```text
//! cargo run --release --example dynamic -- --dir /tmp/cr-cache --group example.com --version v1 --kind Widget --plural widgets
//! ```
//! Uses the cluster your kubeconfig points at.

use std::time::Duration;

use clap::Parser;
use futures::StreamExt;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::{Api, Client};
use kube_persist::{Db, StreamConfig};

/// Cache a custom resource (any kind) of the cluster your kubeconfig points at on disk.
#[derive(Parser)]
struct Args {
    /// Store directory.
    #[arg(long)]
    dir: String,
    /// API group, e.g. example.com.
    #[arg(long)]
    group: String,
    /// API version, e.g. v1.
    #[arg(long)]
    version: String,
    /// Kind, e.g. Widget.
    #[arg(long)]
    kind: String,
    /// Plural resource name, e.g. widgets.
    #[arg(long)]
    plural: String,
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
        group,
        version,
        kind,
        plural,
    } = Args::parse();
    let gvk = GroupVersionKind::gvk(&group, &version, &kind);
    let ar = ApiResource::from_gvk_with_plural(&gvk, &plural);
    let api = Api::<DynamicObject>::all_with(Client::try_default().await?, &ar);

    let db = Db::open_async(&dir).await?;
    let (reader, watcher) = db.store_with(&plural, api, StreamConfig::default(), &ar)?;
    tokio::spawn(watcher.run());
    reader.wait_until_ready().await?;
    loop {
        println!(
            "{} {kind} objects cached (checkpoint {:?})",
            reader.len(),
            reader.checkpoint()
        );
        let mut first = reader.iter_stream().take(5);
        while let Some(obj) = first.next().await {
            let obj = obj?;
            println!(
                "  {}/{}",
                obj.metadata.namespace.as_deref().unwrap_or_default(),
                obj.metadata.name.as_deref().unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_secs(10)).await;
    }
}
