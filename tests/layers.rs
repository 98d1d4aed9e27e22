//! The tree is the architecture: `src/` is cut into layers, one folder each, and a file may
//! name (`use crate::…`, or any `crate::…` path in code) only its own layer or a lower one.
//! ARCHITECTURE.md's code map says what each layer owns; this test keeps the imports one-way.
//!
//! A file's layer is its first folder under `src/` (`src/store/reader/iter.rs` is `store`);
//! the files at the top (`lib.rs`, `db.rs`, `metrics.rs`) are the top layer, which may name
//! anything. A name the crate root re-exports (`crate::Db`, `crate::Error`) belongs to the
//! layer `lib.rs` re-exports it from. `super::` paths that climb out of a layer's folder to
//! the crate root count as `crate::` paths. Comments (and so doc links) are not read.
//!
//! Std only: no dependencies, runs with the suite.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The layers, lowest first. Each may name its own layer and those before it.
const LAYERS: &[&str] = &[
    "model",
    "exec",
    "disk",
    "store",
    "sync",
    "controller",
    "top",
];

/// Files at the root of `src/`: the top layer.
const TOP_FILES: &[&str] = &["lib", "db", "metrics"];

fn rank(layer: &str) -> Option<usize> {
    LAYERS.iter().position(|l| *l == layer)
}

/// The layer of a file, from its path relative to `src/`.
fn layer_of(rel: &Path) -> Option<&'static str> {
    let parts: Vec<_> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if parts.len() == 1 {
        let stem = parts[0].strip_suffix(".rs")?;
        return TOP_FILES.contains(&stem).then_some("top");
    }
    LAYERS
        .iter()
        .copied()
        .find(|l| *l == parts[0] && *l != "top")
}

/// How many modules deep a file is: `lib.rs` 0, `store/mod.rs` 1, `store/cache.rs` 2.
fn depth(rel: &Path) -> usize {
    let n = rel.iter().count();
    let file = rel.file_name().unwrap().to_string_lossy();
    if file == "lib.rs" {
        0
    } else if file == "mod.rs" {
        n - 1
    } else {
        n
    }
}

/// The source with comments and the contents of string literals blanked, line breaks kept,
/// so that byte offsets still give line numbers and only code is searched.
fn strip_comments(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let blank = |out: &mut Vec<u8>, c: u8| out.push(if c == b'\n' { b'\n' } else { b' ' });
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == b'/' && next == Some(b'/') {
            while i < b.len() && b[i] != b'\n' {
                out.push(b' ');
                i += 1;
            }
        } else if c == b'/' && next == Some(b'*') {
            let mut level = 0;
            while i < b.len() {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    level += 1;
                    out.extend_from_slice(b"  ");
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    level -= 1;
                    out.extend_from_slice(b"  ");
                    i += 2;
                    if level == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, b[i]);
                    i += 1;
                }
            }
        } else if c == b'r'
            && (i == 0 || !is_ident(b[i - 1] as char) || b[i - 1] == b'b')
            && matches!(next, Some(b'"' | b'#'))
        {
            // A raw string r"…", r#"…"#: up to the quote followed by as many hashes.
            let hashes = b[i + 1..].iter().take_while(|&&h| h == b'#').count();
            if b.get(i + 1 + hashes) != Some(&b'"') {
                out.push(c);
                i += 1;
                continue;
            }
            let start = i + 2 + hashes;
            out.extend_from_slice(&b[i..start]);
            let close: Vec<u8> = std::iter::once(b'"')
                .chain(std::iter::repeat_n(b'#', hashes))
                .collect();
            let end = b[start..]
                .windows(close.len())
                .position(|w| w == close.as_slice())
                .map_or(b.len(), |p| start + p);
            for &x in &b[start..end] {
                blank(&mut out, x);
            }
            out.extend_from_slice(&b[end..(end + close.len()).min(b.len())]);
            i = end + close.len();
        } else if c == b'"' && !(i > 0 && b[i - 1] == b'\'' && next == Some(b'\'')) {
            out.push(c);
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' && i + 1 < b.len() {
                    blank(&mut out, b[i]);
                    i += 1;
                }
                blank(&mut out, b[i]);
                i += 1;
            }
            if i < b.len() {
                out.push(b'"');
                i += 1;
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    String::from_utf8(out).unwrap()
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The first segments of the crate paths in `code` (comments stripped), with the byte offset
/// of each: `crate::store::Db` gives `store`, `use crate::{disk::keys, Db}` gives `disk` and
/// `Db`, and `super::super::x` in a file `depth` 2 deep gives `x`.
fn crate_paths(code: &str, depth: usize) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    let bytes = code.as_bytes();
    let push_after = |found: &mut Vec<(usize, String)>, at: usize, rest: &str| {
        let rest = rest.trim_start();
        if let Some(group) = rest.strip_prefix('{') {
            // Top-level items of the group: `{a::b, c as d, e::{f, g}}`.
            let (mut level, mut item) = (0, String::new());
            for ch in group.chars() {
                match ch {
                    '{' => level += 1,
                    '}' if level == 0 => break,
                    '}' => level -= 1,
                    ',' if level == 0 => {
                        found.push((at, first_segment(&item)));
                        item.clear();
                        continue;
                    }
                    _ => {}
                }
                item.push(ch);
            }
            found.push((at, first_segment(&item)));
        } else {
            found.push((at, first_segment(rest)));
        }
    };
    for (at, _) in code.match_indices("crate::") {
        if at > 0 {
            let prev = code[..at].chars().next_back().unwrap();
            if is_ident(prev) || prev == '$' {
                continue;
            }
        }
        push_after(&mut found, at, &code[at + "crate::".len()..]);
    }
    if depth > 0 {
        for (at, _) in code.match_indices("super::") {
            if at > 0 && (is_ident(bytes[at - 1] as char) || code[..at].ends_with("::")) {
                continue; // the second `super::` of a chain, or `foo_super::`
            }
            let mut rest = &code[at..];
            let mut climbs = 0;
            while let Some(r) = rest.strip_prefix("super::") {
                climbs += 1;
                rest = r.trim_start();
            }
            if climbs >= depth {
                push_after(&mut found, at, rest);
            }
        }
    }
    found.retain(|(_, s)| !s.is_empty() && s != "self");
    found
}

fn first_segment(path: &str) -> String {
    path.trim().chars().take_while(|c| is_ident(*c)).collect()
}

/// Names the crate root re-exports, with the layer each comes from: every `pub use
/// <module>::…;` of `lib.rs` (and its private `use`s, which are no exports but resolve alike).
fn root_names(lib: &str) -> HashMap<String, &'static str> {
    let code = strip_comments(lib);
    let mut names = HashMap::new();
    for stmt in code.split(';') {
        let stmt = stmt.trim();
        let Some(path) = stmt
            .strip_prefix("pub use ")
            .or_else(|| stmt.strip_prefix("use "))
        else {
            continue;
        };
        let path = path
            .trim()
            .trim_start_matches("crate::")
            .trim_start_matches("self::");
        let module = first_segment(path);
        let Some(layer) = LAYERS.iter().copied().find(|l| *l == module) else {
            continue; // a dependency's item
        };
        let leaves: Vec<&str> = match (path.find('{'), path.rfind('}')) {
            (Some(a), Some(b)) => path[a + 1..b].split(',').collect(),
            _ => vec![path],
        };
        for leaf in leaves {
            let leaf = leaf.trim();
            if leaf.is_empty() {
                continue;
            }
            let name = match leaf.rsplit_once(" as ") {
                Some((_, alias)) => alias.trim(),
                None => leaf.rsplit("::").next().unwrap().trim(),
            };
            names.insert(name.to_string(), layer);
        }
    }
    names
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Every upward import in `files` (path relative to `src/`, source), as `file:line: …`.
fn violations(files: &[(PathBuf, String)]) -> Vec<String> {
    let lib = files
        .iter()
        .find(|(p, _)| p == Path::new("lib.rs"))
        .map(|(_, s)| s.as_str())
        .unwrap_or("");
    let names = root_names(lib);
    let mut bad = Vec::new();
    for (rel, src) in files {
        let shown = format!("src/{}", rel.display());
        let Some(layer) = layer_of(rel) else {
            bad.push(format!(
                "{shown}: in no layer (add its folder to LAYERS in tests/layers.rs and to \
                 ARCHITECTURE.md's code map)"
            ));
            continue;
        };
        let code = strip_comments(src);
        for (at, first) in crate_paths(&code, depth(rel)) {
            let target = match LAYERS.iter().copied().find(|l| *l == first && *l != "top") {
                Some(l) => l,
                None if TOP_FILES.contains(&first.as_str()) => "top",
                None => match names.get(&first) {
                    Some(l) => l,
                    None => continue, // `crate::architecture`, a macro, …
                },
            };
            if rank(target) > rank(layer) {
                let line = code[..at].matches('\n').count() + 1;
                let text = src.lines().nth(line - 1).unwrap_or("").trim();
                bad.push(format!(
                    "{shown}:{line}: {layer}/ names `{first}` of the higher layer {target}/: {text}"
                ));
            }
        }
    }
    bad
}

#[test]
fn every_layer_imports_only_lower_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut paths = Vec::new();
    rust_files(&src, &mut paths);
    let files: Vec<_> = paths
        .iter()
        .map(|p| {
            (
                p.strip_prefix(&src).unwrap().to_path_buf(),
                std::fs::read_to_string(p).unwrap(),
            )
        })
        .collect();
    assert!(
        files.len() > 20,
        "read {} files of {}",
        files.len(),
        src.display()
    );
    let bad = violations(&files);
    assert!(
        bad.is_empty(),
        "{} upward import(s) (layers, lowest first: {}):\n{}",
        bad.len(),
        LAYERS.join(" < "),
        bad.join("\n")
    );
}

/// The check itself: an upward import, in each form, is caught with its file and line;
/// downward ones, comments and strings are not.
#[test]
fn an_upward_import_is_reported_with_file_and_line() {
    let files = vec![
        (
            PathBuf::from("lib.rs"),
            "mod disk;\nmod store;\npub use store::{Db, SyncPhase};\npub use disk::DbConfig;\n"
                .to_string(),
        ),
        (
            PathBuf::from("disk/keys.rs"),
            [
                "use crate::model::Error; // fine: lower",
                "// use crate::store::Db; a comment is not code",
                "const S: &str = \"crate::sync::x\";",
                "use crate::store::Db;",
                "use crate::{",
                "    model::Result,",
                "    Db as _,",
                "};",
                "fn f() { let _ = crate::sync::Watcher::new(); }",
                "use crate::disk::DbConfig; // own layer",
            ]
            .join("\n"),
        ),
        (
            PathBuf::from("disk/mod.rs"),
            "use super::store::Db;\n".to_string(),
        ),
        (
            PathBuf::from("store/reader/iter.rs"),
            "use super::super::super::sync::X;\n".into(),
        ),
        (PathBuf::from("stray/x.rs"), String::new()),
    ];
    let bad = violations(&files);
    let at: Vec<_> = bad.iter().map(|b| b.split(": ").next().unwrap()).collect();
    assert_eq!(
        at,
        [
            "src/disk/keys.rs:4",
            "src/disk/keys.rs:5",
            "src/disk/keys.rs:9",
            "src/disk/mod.rs:1",
            "src/store/reader/iter.rs:1",
            "src/stray/x.rs",
        ],
        "{bad:#?}"
    );
}
