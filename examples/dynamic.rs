//! Cache a custom resource (any kind, through `DynamicObject`) on disk.
//!
//! ```text
//! cargo run --release --example dynamic -- --dir /tmp/cr-cache --group example.com --version v1 --kind Widget --plural widgets
//! ```
//! Uses the cluster your kubeconfig points at.

use std::time::Duration;

use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::{Api, Client};
use kube_persist::{Config, Db};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "kube_persist=info".into()),
        )
        .init();
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let usage = "usage: dynamic --dir DIR --group G --version V --kind K --plural P";
    let (dir, group, version, kind, plural) = match (
        flag("--dir"),
        flag("--group"),
        flag("--version"),
        flag("--kind"),
        flag("--plural"),
    ) {
        (Some(d), Some(g), Some(v), Some(k), Some(p)) => (d, g, v, k, p),
        _ => return Err(usage.into()),
    };
    let gvk = GroupVersionKind::gvk(&group, &version, &kind);
    let ar = ApiResource::from_gvk_with_plural(&gvk, &plural);
    let api = Api::<DynamicObject>::all_with(Client::try_default().await?, &ar);

    let db = Db::open(&dir)?;
    let (reader, watcher) = db.store_with(&plural, api, Config::default(), &ar)?;
    tokio::spawn(watcher.run());
    reader.wait_until_ready().await?;
    loop {
        println!(
            "{} {kind} objects cached (checkpoint {:?})",
            reader.len(),
            reader.checkpoint()
        );
        for obj in reader.iter().take(5) {
            let obj = obj?;
            println!(
                "  {}/{}",
                obj.metadata.namespace.unwrap_or_default(),
                obj.metadata.name.unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_secs(10)).await;
    }
}
