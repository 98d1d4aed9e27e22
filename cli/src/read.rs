//! The reading commands: inspect, stats, get, dump, controller-states.

use std::io::Write;
use std::time::{SystemTime, UNIX_EPOCH};

use std::rc::Rc;

use kube_persist::{ControllerStateInfo, StreamInfo};
use serde_json::{Value, json};

use crate::read_store::ReadStore;
use crate::term::{self, Text};
use crate::{Failure, Outcome, Output};

/// A stream's identity and state as JSON (`inspect` and `stats`).
fn stream_json(s: &StreamInfo) -> Value {
    json!({
        "name": s.name,
        "objects": s.objects,
        "checkpoint": s.checkpoint,
        "phase": format!("{:?}", s.phase),
        "format_version": s.format_version,
        "identity": {
            "api_version": s.api_version,
            "kind": s.kind,
            "url": s.url,
            "label_selector": s.label_selector,
            "field_selector": s.field_selector,
            "shard_selector": s.shard.as_ref().map(|s| s.selector()),
            "metadata_only": s.metadata_only,
            "keys_only": s.keys_only,
            "transform": s.transform,
            "encryption_key_fingerprint": s.key_fingerprint,
        },
    })
}

/// A durable controller's state as JSON (`stats` and `controller-states`).
fn controller_json(c: &ControllerStateInfo) -> Value {
    json!({
        "name": c.name,
        "kinds": c.kinds,
        "objects_tracked": c.objects,
        "pending_requeues": c.pending_requeues,
        "oldest_due_unix_ms": c.oldest_due.map(unix_ms),
    })
}

fn print_json(doc: &Value) -> Outcome {
    // serde_json escapes C0 controls in strings, not DEL and C1: escaped the same way.
    writeln!(
        std::io::stdout().lock(),
        "{}",
        term::escape(&format!("{doc:#}"))
    )?;
    Ok(())
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

fn encryption(s: &StreamInfo) -> String {
    s.key_fingerprint
        .as_deref()
        .map(|f| format!("yes (key {f})"))
        .unwrap_or_else(|| "no".into())
}

/// What a stream stores of each object.
fn contents(s: &StreamInfo) -> &'static str {
    match (s.keys_only, s.metadata_only) {
        (true, _) => "keys only",
        (false, true) => "metadata only",
        (false, false) => "whole objects",
    }
}

pub(crate) fn inspect(db: &ReadStore, output: Output) -> Outcome {
    let streams = db.streams()?;
    if output == Output::Json {
        return print_json(&json!({
            "path": db.path().display().to_string(),
            "engine": db.engine().name(),
            "disk_bytes": db.size_on_disk()?,
            "streams": streams.iter().map(stream_json).collect::<Vec<_>>(),
        }));
    }
    let mut out = Text::default();
    writeln!(
        out,
        "store {} ({:.1} MiB on disk, {} streams)",
        db.path().display(),
        mib(db.size_on_disk()?),
        streams.len()
    )?;
    for s in streams {
        writeln!(out, "stream {}", s.name)?;
        let only = if s.metadata_only {
            " (metadata only)"
        } else {
            ""
        };
        writeln!(out, "  kind:       {} {}{only}", s.api_version, s.kind)?;
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
        writeln!(out, "  encrypted:  {}", encryption(&s))?;
        writeln!(out, "  phase:      {:?}", s.phase)?;
        let cp = s.checkpoint.as_deref().unwrap_or("-");
        writeln!(out, "  checkpoint: {cp}")?;
        writeln!(out, "  objects:    {}", s.objects)?;
        writeln!(out, "  format:     {}", s.format_version)?;
    }
    out.print()?;
    Ok(())
}

pub(crate) fn stats(db: &ReadStore, output: Output) -> Outcome {
    let streams = db.streams()?;
    let total = db.size_on_disk()?;
    let engine = db.engine().name();
    let mut rows = Vec::with_capacity(streams.len());
    for s in &streams {
        rows.push((s, db.stream_disk_bytes(&s.name)?));
    }
    let controllers = db.controller_states()?;
    if output == Output::Json {
        let streams: Vec<_> = rows
            .iter()
            .map(|(s, bytes)| {
                let mut doc = stream_json(s);
                doc["disk_bytes"] = json!(bytes);
                doc["engine"] = json!(engine);
                doc
            })
            .collect();
        return print_json(&json!({
            "path": db.path().display().to_string(),
            "engine": engine,
            "disk_bytes": total,
            "streams": streams,
            "controllers": controllers.iter().map(controller_json).collect::<Vec<_>>(),
        }));
    }
    let mut out = Text::default();
    writeln!(
        out,
        "store {} (engine {engine}, {:.1} MiB on disk, {} streams)",
        db.path().display(),
        mib(total),
        rows.len()
    )?;
    for (s, bytes) in rows {
        writeln!(out, "stream {}", s.name)?;
        writeln!(out, "  objects:     {}", s.objects)?;
        let cp = s.checkpoint.as_deref().unwrap_or("-");
        writeln!(out, "  checkpoint:  {cp}")?;
        writeln!(out, "  phase:       {:?}", s.phase)?;
        writeln!(out, "  disk:        {bytes} bytes ({:.1} MiB)", mib(bytes))?;
        writeln!(out, "  engine:      {engine}")?;
        writeln!(out, "  format:      {}", s.format_version)?;
        writeln!(out, "  kind:        {} {}", s.api_version, s.kind)?;
        writeln!(out, "  url:         {}", s.url)?;
        writeln!(out, "  stores:      {}", contents(s))?;
        let none = || "-".to_string();
        let labels = s.label_selector.clone().unwrap_or_else(none);
        writeln!(out, "  labels:      {labels}")?;
        let fields = s.field_selector.clone().unwrap_or_else(none);
        writeln!(out, "  fields:      {fields}")?;
        let shard = s.shard.as_ref().map(|s| s.selector()).unwrap_or_else(none);
        writeln!(out, "  shard:       {shard}")?;
        let transform = s.transform.clone().unwrap_or_else(none);
        writeln!(out, "  transform:   {transform}")?;
        writeln!(out, "  encrypted:   {}", encryption(s))?;
    }
    controllers_text(&mut out, &controllers)?;
    out.print()?;
    Ok(())
}

fn controllers_text(out: &mut impl Write, controllers: &[ControllerStateInfo]) -> Outcome {
    for c in controllers {
        writeln!(out, "controller {}", c.name)?;
        writeln!(out, "  kinds:             {}", c.kinds.join(", "))?;
        writeln!(out, "  objects tracked:   {}", c.objects)?;
        writeln!(out, "  pending requeues:  {}", c.pending_requeues)?;
        let due = match c.oldest_due {
            Some(t) => describe_due(t),
            None => "-".into(),
        };
        writeln!(out, "  oldest due:        {due}")?;
    }
    Ok(())
}

pub(crate) fn controller_states(db: &ReadStore, output: Output) -> Outcome {
    let controllers = db.controller_states()?;
    match output {
        Output::Json => print_json(&json!(
            controllers.iter().map(controller_json).collect::<Vec<_>>()
        )),
        Output::Text if controllers.is_empty() => {
            let mut out = Text::default();
            writeln!(out, "no controller states in {}", db.path().display())?;
            out.print()?;
            Ok(())
        }
        Output::Text => {
            let mut out = Text::default();
            controllers_text(&mut out, &controllers)?;
            out.print()?;
            Ok(())
        }
    }
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A due time as unix milliseconds and relative to now ("in 5 s", "12 s ago").
fn describe_due(t: SystemTime) -> String {
    let rel = match t.duration_since(SystemTime::now()) {
        Ok(ahead) => format!("in {} s", ahead.as_secs()),
        Err(e) => format!("{} s ago", e.duration().as_secs()),
    };
    format!("{} (unix ms; {rel})", unix_ms(t))
}

/// Not found is the answer "no" (exit status 1), with a line on stderr.
pub(crate) fn get(db: &ReadStore, stream: &str, object: &str, output: Output) -> Outcome {
    let (ns, name) = match object.split_once('/') {
        Some((ns, name)) => (Some(ns), name),
        None => (None, object),
    };
    match db.raw_get(stream, ns, name)? {
        Some(json) => {
            // The stored JSON's error, by position: serde_json quotes what it refused.
            let v: serde_json::Value = serde_json::from_slice(&json).map_err(|e| {
                format!(
                    "stored JSON of {} does not parse (line {}, column {})",
                    term::escape(object),
                    e.line(),
                    e.column()
                )
            })?;
            let info = db.streams()?.into_iter().find(|s| s.name == stream);
            term::warn_if_sensitive(info.as_ref());
            let text = match output {
                Output::Text => format!("{v:#}\n"),
                Output::Json => format!("{v}\n"),
            };
            let mut out = std::io::stdout().lock();
            out.write_all(term::escape(&text).as_bytes())?;
            Ok(())
        }
        None => {
            eprintln!(
                "{} is not in stream {:?}",
                term::escape(object),
                term::escape(stream)
            );
            Err(Failure::No)
        }
    }
}

/// Objects a `dump` reads per opening of the store, and the bytes after which it stops
/// sooner: the store is held only while a piece is read, never while stdout is blocked.
const DUMP_PIECE: usize = 1000;
const DUMP_PIECE_BYTES: usize = 4 << 20;

/// Every object of `stream`, read in pieces: `open` opens the store for each piece, which
/// is closed before it is written out, so that a reader of stdout that does not read (a
/// pager left open) never keeps a controller from opening the store.
pub(crate) fn dump(open: impl Fn() -> Result<Rc<ReadStore>, Failure>, stream: &str) -> Outcome {
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let mut after: Option<String> = None;
    loop {
        let mut piece = Vec::new();
        let mut bytes = 0;
        {
            let db = open()?;
            if after.is_none() {
                let info = db.streams()?.into_iter().find(|s| s.name == stream);
                term::warn_if_sensitive(info.as_ref());
            }
            let objects = match &after {
                None => db.raw_objects(stream)?,
                Some(key) => db.raw_objects_after(stream, key)?,
            };
            for entry in objects {
                let (key, json) = entry?;
                bytes += json.len();
                piece.push((key, json));
                if piece.len() == DUMP_PIECE || bytes >= DUMP_PIECE_BYTES {
                    break;
                }
            }
        }
        let last = piece.len() < DUMP_PIECE && bytes < DUMP_PIECE_BYTES;
        for (_, json) in &piece {
            out.write_all(term::escape_bytes(json).as_bytes())?;
            out.write_all(b"\n")?;
        }
        out.flush()?;
        match piece.pop() {
            Some((key, _)) if !last => after = Some(key),
            _ => return Ok(()),
        }
    }
}
