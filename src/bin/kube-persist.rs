//! `kube-persist`: look inside a store directory.
//!
//! ```text
//! kube-persist inspect DIR                       streams, kinds, checkpoints, object counts
//! kube-persist get DIR STREAM [NAMESPACE/]NAME   one object as JSON
//! kube-persist dump DIR STREAM                   every object, one JSON document per line
//! ```
//! Encrypted stores need their key: `--key-file PATH` or the `KUBE_PERSIST_KEY` environment
//! variable (64 hex characters). The store must not be open in another process. Stores of
//! either engine (redb or sled) are opened with the engine recorded in them.

use std::io::Write;
use std::process::ExitCode;

use kube_persist::{Db, DbConfig, EncryptionKey, Engine};

const USAGE: &str = "usage:
  kube-persist inspect DIR [--key-file PATH]
  kube-persist get DIR STREAM [NAMESPACE/]NAME [--key-file PATH]
  kube-persist dump DIR STREAM [--key-file PATH]
The key may also come from the KUBE_PERSIST_KEY environment variable (64 hex characters).";

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let key = match take_key(&mut args) {
        Ok(k) => k,
        Err(e) => return fail(&e),
    };
    let mut config = DbConfig::default();
    if let Some(k) = key {
        config = config.encryption_key(k);
    }
    // Never create a store. Without an explicit engine, `Db::open_with` opens an existing
    // store with whichever engine wrote it.
    let open = |dir: &str| match Engine::of_store(dir) {
        Ok(Some(_)) => Db::open_with(dir, config.clone()).map_err(|e| e.to_string()),
        Ok(None) => Err(format!("no kube-persist store at {dir}")),
        Err(e) => Err(e.to_string()),
    };
    let result = match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["inspect", dir] => open(dir).map_err(Failure::from).and_then(|db| inspect(&db)),
        ["get", dir, stream, object] => open(dir)
            .map_err(Failure::from)
            .and_then(|db| get(&db, stream, object)),
        ["dump", dir, stream] => open(dir)
            .map_err(Failure::from)
            .and_then(|db| dump(&db, stream)),
        ["-h" | "--help"] => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        _ => return fail(USAGE),
    };
    match result {
        Ok(()) | Err(Failure::Closed) => ExitCode::SUCCESS,
        Err(Failure::Error(e)) => fail(&e),
    }
}

/// Why a command stopped: an error to report, or the reader of stdout went away (`| head`),
/// which is not an error: exit quietly, like other Unix tools.
enum Failure {
    Closed,
    Error(String),
}

impl From<String> for Failure {
    fn from(e: String) -> Self {
        Failure::Error(e)
    }
}

impl From<std::io::Error> for Failure {
    fn from(e: std::io::Error) -> Self {
        match e.kind() {
            std::io::ErrorKind::BrokenPipe => Failure::Closed,
            _ => Failure::Error(format!("writing to stdout: {e}")),
        }
    }
}

fn fail(msg: &str) -> ExitCode {
    eprintln!("kube-persist: {msg}");
    ExitCode::from(2)
}

fn take_key(args: &mut Vec<String>) -> Result<Option<EncryptionKey>, String> {
    if let Some(i) = args.iter().position(|a| a == "--key-file") {
        let path = args.get(i + 1).cloned().ok_or("--key-file needs a path")?;
        args.drain(i..=i + 1);
        return EncryptionKey::from_file(&path)
            .map(Some)
            .map_err(|e| e.to_string());
    }
    match std::env::var("KUBE_PERSIST_KEY") {
        // The variable's value is wiped once parsed.
        Ok(hex) => EncryptionKey::from_hex(&zeroize::Zeroizing::new(hex))
            .map(Some)
            .map_err(|e| format!("KUBE_PERSIST_KEY: {e}")),
        Err(_) => Ok(None),
    }
}

fn inspect(db: &Db) -> Result<(), Failure> {
    let mut out = std::io::stdout().lock();
    let streams = db.streams().map_err(|e| e.to_string())?;
    let size = db.size_on_disk().map_err(|e| e.to_string())?;
    writeln!(
        out,
        "store {} ({:.1} MiB on disk, {} streams)",
        db.path().display(),
        size as f64 / (1 << 20) as f64,
        streams.len()
    )?;
    for s in streams {
        writeln!(out, "stream {}", s.name)?;
        writeln!(
            out,
            "  kind:       {} {}{}",
            s.api_version,
            s.kind,
            if s.metadata_only {
                " (metadata only)"
            } else {
                ""
            }
        )?;
        writeln!(out, "  url:        {}", s.url)?;
        if let Some(l) = &s.label_selector {
            writeln!(out, "  labels:     {l}")?;
        }
        if let Some(f) = &s.field_selector {
            writeln!(out, "  fields:     {f}")?;
        }
        if let Some(t) = &s.transform {
            writeln!(out, "  transform:  {t}")?;
        }
        writeln!(
            out,
            "  encrypted:  {}",
            s.key_fingerprint
                .as_deref()
                .map(|f| format!("yes (key {f})"))
                .unwrap_or_else(|| "no".into())
        )?;
        writeln!(out, "  phase:      {:?}", s.phase)?;
        writeln!(
            out,
            "  checkpoint: {}",
            s.checkpoint.as_deref().unwrap_or("-")
        )?;
        writeln!(out, "  objects:    {}", s.objects)?;
    }
    Ok(())
}

fn get(db: &Db, stream: &str, object: &str) -> Result<(), Failure> {
    let mut out = std::io::stdout().lock();
    let (ns, name) = match object.split_once('/') {
        Some((ns, name)) => (Some(ns), name),
        None => (None, object),
    };
    match db.raw_get(stream, ns, name).map_err(|e| e.to_string())? {
        Some(json) => {
            let v: serde_json::Value = serde_json::from_slice(&json)
                .map_err(|e| format!("stored JSON of {object}: {e}"))?;
            writeln!(
                out,
                "{}",
                serde_json::to_string_pretty(&v).unwrap_or_default()
            )?;
            Ok(())
        }
        None => Err(format!("{object} is not in stream {stream:?}").into()),
    }
}

fn dump(db: &Db, stream: &str) -> Result<(), Failure> {
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    for entry in db.raw_objects(stream).map_err(|e| e.to_string())? {
        let (_, json) = entry.map_err(|e| e.to_string())?;
        out.write_all(&json)?;
        out.write_all(b"\n")?;
    }
    Ok(out.flush()?)
}
