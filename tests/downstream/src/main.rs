//! The smallest controller-shaped program on kube-persist: a persistent Pod store. It is
//! only compiled (`cargo check`), to prove the crate builds under the binary's choice of
//! Kubernetes version.

use k8s_openapi::api::core::v1::Pod;
use kube::{Api, Client};
use kube_persist::{Db, StreamConfig};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let client = Client::try_default().await?;
    let db = Db::open("/tmp/kube-persist-downstream")?;
    let (reader, watcher) = db.store("pods", Api::<Pod>::all(client), StreamConfig::default())?;
    tokio::spawn(watcher.run());
    reader.wait_until_ready().await?;
    println!("{} pods", reader.len());
    Ok(())
}
