//! `kube-persist verify` (the cli package's binary) against the real server: a store equal
//! to the server, one behind it, and one damaged on disk.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use crate::common::{self, Engine};
use crate::support::*;
use crate::sync::{Shared, config};

/// The `kube-persist` binary next to this test's (`target/<profile>/`), built by
/// `cargo test --workspace` for the cli package's own tests.
fn tool() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let bin = exe.parent()?.parent()?.join("kube-persist");
    bin.is_file().then_some(bin)
}

/// Runs `verify DIR pods` against the server; returns (exit code, stdout).
fn verify(bin: &Path, server: &Server, dir: &Path) -> Result<(Option<i32>, String), Fail> {
    let out = Command::new(bin)
        .args([
            "verify".as_ref(),
            dir.as_os_str(),
            "pods".as_ref(),
            "--context".as_ref(),
            "realk8s".as_ref(),
        ])
        .env("KUBECONFIG", &server.kubeconfig)
        .env_remove("KUBE_PERSIST_KEY")
        .env("RUST_LOG", "warn")
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.stderr.is_empty() {
        // Its logs (e.g. a permissions warning), for whoever reads the suite's output.
        eprint!("{}", String::from_utf8_lossy(&out.stderr));
    }
    Ok((out.status.code(), stdout))
}

fn last_line(out: &str) -> &str {
    out.lines().last().unwrap_or("")
}

/// The checkpoint and object count of the closed store at `dir`.
fn checkpoint(server: &Server, dir: &Path, engine: Engine) -> Result<(String, u64), Fail> {
    let (db, reader, _w) = open_pods(server, dir, engine, config(false))?;
    let out = (reader.checkpoint().unwrap_or_default(), reader.len() as u64);
    drop((reader, _w, db));
    common::wait_unlocked(dir);
    Ok(out)
}

/// The directory and engine of a store a cold sync left in `slot`.
fn stored(
    slot: &std::sync::Mutex<Option<(tempfile::TempDir, Engine)>>,
    by: &str,
) -> Result<(PathBuf, Engine), Fail> {
    let slot = slot.lock().unwrap();
    let (d, e) = slot
        .as_ref()
        .ok_or_else(|| error(format!("no store from {by}")))?;
    Ok((d.path().to_path_buf(), *e))
}

pub async fn verify_all(server: Arc<Server>, shared: Arc<Shared>) -> Outcome {
    let Some(bin) = tool() else {
        return Err(error(
            "no kube-persist binary next to the test (cargo test --workspace builds it)",
        ));
    };
    let (dir, engine) = stored(&shared.paginated, "cold-sync-paginated")?;
    let (cp, n) = checkpoint(&server, &dir, engine)?;

    // Equal.
    let (code, out) = verify(&bin, &server, &dir)?;
    let want = format!("verify ok: {n} objects equal at resourceVersion {cp}");
    ensure(code == Some(0) && last_line(&out) == want, || {
        format!("equal: exit {code:?}: {out}")
    })?;

    // Stale: every change is newer than the checkpoint.
    let now = server_now(&server.client).await?;
    let keys: Vec<String> = now
        .keys()
        .filter(|k| *k != crate::child::PROBE)
        .cloned()
        .collect();
    update_pods(&server.client, &keys[10..17]).await?;
    delete_pods(&server.client, &keys[20..22]).await?;
    create_pods(&server.client, 40_000..40_003).await?;
    let changed = 12;
    let (code, out) = verify(&bin, &server, &dir)?;
    let want = format!(
        "verify ok: {n} objects equal at resourceVersion {cp}; the store is behind the server only by {changed} changes newer than it"
    );
    ensure(code == Some(0) && last_line(&out) == want, || {
        format!("stale: exit {code:?}: {out}")
    })?;

    // Damaged: in the streaming cold sync's store, one object removed and one copied under a
    // name the server lacks.
    let (dir, engine) = stored(&shared.streaming, "cold-sync-streaming")?;
    let (cp, _) = checkpoint(&server, &dir, engine)?;
    let (ns, name) = keys[500].split_once('/').expect("namespace/name");
    let mut record = None;
    common::raw_edit(
        engine,
        &dir,
        "stream/pods",
        format!("o{ns}\0{name}").as_bytes(),
        |v| {
            record = v;
            None
        },
    );
    if record.is_none() {
        return Err(error(format!("{ns}/{name} is not in the stored keyspace")));
    }
    let extra = format!("o{ns}\0zz-not-on-server");
    common::raw_edit(engine, &dir, "stream/pods", extra.as_bytes(), |_| record);
    common::wait_unlocked(&dir);
    let (code, out) = verify(&bin, &server, &dir)?;
    let want = format!("verify failed: the store differs from the server at resourceVersion {cp}");
    ensure(
        code == Some(1)
            && last_line(&out) == want
            && out.contains(&format!("missing {ns}/{name}: on the server at "))
            && out.contains(&format!("extra {ns}/zz-not-on-server: stored at ")),
        || format!("damaged: exit {code:?}: {out}"),
    )
}
