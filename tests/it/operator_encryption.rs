//! The example operator says whether its store is encrypted: its `operator listening on`
//! line (what `kubectl logs` shows first) ends in `encrypted=false` when `KUBE_PERSIST_KEY`
//! is unset, and in `encrypted=true key=<fingerprint>` with a key, so that a store running
//! in plaintext is never silent.

use crate::common;
use crate::sigterm::Operator;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_says_whether_the_store_is_encrypted() {
    common::init_tracing();
    let server = common::pod_server(20).await;
    let url = server.url();
    let tmp = tempfile::tempdir().unwrap();
    let hex = "5a".repeat(32);
    let fingerprint = kube_persist::EncryptionKey::from_hex(&hex)
        .unwrap()
        .fingerprint();
    let keyed = format!("encrypted=true key={fingerprint})");
    for (key, want) in [
        (None, "encrypted=false)"),
        (Some(hex.as_str()), keyed.as_str()),
    ] {
        let dir = tmp
            .path()
            .join(if key.is_some() { "keyed" } else { "plain" });
        let op = match key {
            Some(k) => Operator::spawn_with(&dir, &url, &[("KUBE_PERSIST_KEY", k.as_ref())]),
            None => Operator::spawn(&dir, &url),
        };
        op.ready().await;
        let lines = op.lines();
        let (ok, _, stopped) = op.terminate();
        assert!(ok, "the operator failed: {stopped}");
        let listening = lines
            .iter()
            .find(|l| l.contains("operator listening on "))
            .expect("the listening line");
        assert!(
            listening.ends_with(want),
            "KUBE_PERSIST_KEY {key:?}: the line does not end in {want:?}: {listening}"
        );
    }
}
