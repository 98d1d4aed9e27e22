//! `kube-persist verify`: compare a stream with the cluster the kubeconfig points at.

use std::io::Write;

use kube::config::KubeConfigOptions;
use kube_persist::{Db, DbConfig, Verdict, Verification};
use serde_json::json;

use crate::read_store::ReadStore;
use crate::{Failure, Outcome, Output};

/// The store a verification reads.
pub(crate) enum Store {
    /// A redb store, opened read-only for each read and closed during the LISTs.
    At(std::path::PathBuf, DbConfig),
    /// A sled store's private copy (sled has no read-only mode), held throughout.
    Held(ReadStore),
}

pub(crate) fn verify(
    store: Store,
    stream: &str,
    context: Option<String>,
    max: usize,
    output: Output,
) -> Outcome {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("starting the async runtime: {e}"))?;
    let report = runtime.block_on(async {
        let config = match context {
            Some(context) => {
                let options = KubeConfigOptions {
                    context: Some(context),
                    ..KubeConfigOptions::default()
                };
                kube::Config::from_kubeconfig(&options)
                    .await
                    .map_err(|e| e.to_string())
            }
            None => kube::Config::infer().await.map_err(|e| e.to_string()),
        }
        .map_err(|e| format!("loading the kubeconfig: {e}"))?;
        let client =
            kube::Client::try_from(config).map_err(|e| format!("creating a client: {e}"))?;
        match store {
            Store::At(dir, config) => Db::verify_at(dir, config, stream, client, max).await,
            Store::Held(db) => db.verify(stream, client, max).await,
        }
        .map_err(Failure::from)
    })?;
    match output {
        Output::Text => print(&report),
        Output::Json => print_json(&report),
    }
}

/// The answer, as the exit status says it: yes (equal, or behind only by changes newer than
/// the checkpoint, with a consistent object count), no (different at the checkpoint, or an
/// object count that drifted from the records: wrong whatever the server says), or
/// undecided (different from the server's current collection, and the server no longer
/// has the checkpoint to tell; or a verdict this tool does not know).
fn answer(r: &Verification) -> Outcome {
    match &r.verdict {
        _ if !r.count_consistent() => Err(Failure::No),
        Verdict::Equal | Verdict::Behind { .. } => Ok(()),
        Verdict::Differs => Err(Failure::No),
        _ => Err(Failure::Undecided),
    }
}

/// One JSON document; the exit status as with text.
fn print_json(r: &Verification) -> Outcome {
    let (verdict, server_rv) = match &r.verdict {
        Verdict::Equal => ("equal", None),
        Verdict::Behind {
            server_resource_version,
        } => ("behind", Some(server_resource_version)),
        Verdict::Differs => ("differs", None),
        Verdict::Undecided {
            server_resource_version,
        } => ("undecided", Some(server_resource_version)),
        _ => ("unknown", None),
    };
    let doc = json!({
        "stream": r.stream,
        "ok": answer(r).is_ok(),
        "verdict": verdict,
        "checkpoint": r.checkpoint,
        "server_resource_version": server_rv,
        "stored_objects": r.stored_objects,
        "counted_objects": r.counted_objects,
        "server_objects": r.server_objects,
        "count_consistent": r.count_consistent(),
        "difference_count": r.difference_count,
        "differences": r.differences.iter().map(|d| d.to_string()).collect::<Vec<_>>(),
        "awaiting_prune": r.awaiting_prune,
        "explained_by_delta_relist": r.explained_by_delta_relist,
    });
    writeln!(std::io::stdout().lock(), "{doc:#}")?;
    answer(r)
}

fn print(r: &Verification) -> Outcome {
    let mut out = std::io::stdout().lock();
    let more = r.difference_count - r.differences.len() as u64;
    let list = |out: &mut std::io::StdoutLock<'_>| -> std::io::Result<()> {
        for d in &r.differences {
            writeln!(out, "  {d}")?;
        }
        if more > 0 {
            writeln!(out, "  ... and {more} more")?;
        }
        Ok(())
    };
    if r.count_consistent() {
        writeln!(
            out,
            "stream {}: object count consistent ({} counted, {} records stored)",
            r.stream, r.counted_objects, r.stored_objects
        )?;
    } else {
        writeln!(
            out,
            "stream {}: object count drifted: its state counts {} objects but {} records are \
             stored (relists would skip deletions; destroy the stream to list it again)",
            r.stream, r.counted_objects, r.stored_objects
        )?;
    }
    if r.awaiting_prune > 0 {
        writeln!(
            out,
            "stream {}: {} stored objects are outside its narrowed shard and not pruned yet \
             (its prune removes them; not differences)",
            r.stream, r.awaiting_prune
        )?;
    }
    if r.explained_by_delta_relist > 0 {
        writeln!(
            out,
            "stream {}: {} objects are as a delta relist leaves them until its watch replays \
             past them (fetched newer than the checkpoint, or deleted before their fetch; not \
             differences)",
            r.stream, r.explained_by_delta_relist
        )?;
    }
    let drifted = |out: &mut std::io::StdoutLock<'_>| -> Outcome {
        writeln!(
            out,
            "verify failed: the stream's object count differs from its records"
        )?;
        answer(r)
    };
    match &r.verdict {
        Verdict::Equal | Verdict::Behind { .. } if !r.count_consistent() => {
            list(&mut out)?;
            drifted(&mut out)
        }
        Verdict::Equal => {
            writeln!(
                out,
                "verify ok: {} objects equal at resourceVersion {}",
                r.server_objects, r.checkpoint
            )?;
            answer(r)
        }
        Verdict::Behind {
            server_resource_version,
        } => {
            writeln!(
                out,
                "stream {}: the server changed {} objects after the store's checkpoint {} \
                 (it is now at resourceVersion {server_resource_version}):",
                r.stream, r.difference_count, r.checkpoint
            )?;
            list(&mut out)?;
            writeln!(
                out,
                "verify ok: {} objects equal at resourceVersion {}; the store is behind the \
                 server only by {} changes newer than it",
                r.server_objects, r.checkpoint, r.difference_count
            )?;
            answer(r)
        }
        Verdict::Differs => {
            writeln!(
                out,
                "stream {}: {} differences from the server's collection at the store's \
                 checkpoint {} ({} objects stored, {} on the server):",
                r.stream, r.difference_count, r.checkpoint, r.stored_objects, r.server_objects
            )?;
            list(&mut out)?;
            writeln!(
                out,
                "verify failed: the store differs from the server at resourceVersion {}",
                r.checkpoint
            )?;
            answer(r)
        }
        Verdict::Undecided {
            server_resource_version,
        } => {
            writeln!(
                out,
                "stream {}: {} differences from the server's current collection \
                 (resourceVersion {server_resource_version}):",
                r.stream, r.difference_count
            )?;
            list(&mut out)?;
            writeln!(
                out,
                "verify failed: the server no longer serves the store's checkpoint {} \
                 (compacted), so whether these changes are newer than it cannot be told",
                r.checkpoint
            )?;
            answer(r)
        }
        _ => {
            writeln!(out, "verify failed: {:?}", r.verdict)?;
            answer(r)
        }
    }
}
