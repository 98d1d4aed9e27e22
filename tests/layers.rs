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
        } else if c == b'\'' && char_literal_len(&b[i..]).is_some() {
            // A char literal ('"', '\"', '\'', '\u{22}'), not a lifetime: copied as is,
            // so that a quote inside it starts no string.
            let n = char_literal_len(&b[i..]).unwrap();
            for &x in &b[i..i + n] {
                out.push(if x == b'"' { b' ' } else { x });
            }
            i += n;
        } else if c == b'"' {
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

/// The length in bytes of the char literal `b` starts with (`b[0]` is `'`), or `None` for a
/// lifetime or label (`'a`, `'static`).
fn char_literal_len(b: &[u8]) -> Option<usize> {
    match b.get(1)? {
        b'\\' => {
            // An escape: `'\n'`, `'\''`, `'\"'`, `'\x7f'`, `'\u{1F600}'`.
            let close = b[2..].iter().skip(1).position(|&c| c == b'\'')? + 3;
            (close <= 12).then_some(close + 1)
        }
        _ => {
            // One character, of 1 to 4 bytes in UTF-8, then the closing quote.
            let width = match b[1] {
                0x00..=0x7f => 1,
                0xc0..=0xdf => 2,
                0xe0..=0xef => 3,
                _ => 4,
            };
            (b.get(1 + width) == Some(&b'\'')).then_some(width + 2)
        }
    }
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

/// The first segment of a path: an identifier, or `*` for a glob.
fn first_segment(path: &str) -> String {
    let path = path.trim();
    if path.starts_with('*') {
        return "*".to_string();
    }
    path.chars().take_while(|c| is_ident(*c)).collect()
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
            let line = code[..at].matches('\n').count() + 1;
            let text = src.lines().nth(line - 1).unwrap_or("").trim();
            let target = match LAYERS.iter().copied().find(|l| *l == first && *l != "top") {
                Some(l) => l,
                // A glob of the crate root names everything, the top's items too.
                None if TOP_FILES.contains(&first.as_str()) || first == "*" => "top",
                None => match names.get(&first) {
                    Some(_) if layer != "top" => {
                        bad.push(format!(
                            "{shown}:{line}: {layer}/ names `{first}` through the crate root's \
                             re-export: name it by its layer's path: {text}"
                        ));
                        continue;
                    }
                    Some(l) => l,
                    None => continue, // `crate::architecture`, a macro, …
                },
            };
            if rank(target) > rank(layer) {
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
    let files = source_files();
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

/// Types an inherent `impl` may extend outside the layer that defines them, with the reason.
const FOREIGN_IMPLS_ALLOWED: &[(&str, &str, &str)] = &[
    // The public handle's methods, each a delegation to the layer that does the work.
    ("Db", "db.rs", "the facade"),
    // `Engine::of_store` reads a directory: `Engine` the value is `model/`'s (the public
    // `Error::EngineMismatch` holds it), the files that tell an engine are the disk's.
    (
        "Engine",
        "disk/engine/mod.rs",
        "Engine::of_store reads the disk",
    ),
];

/// The type names `code` defines (`struct`, `enum`, `union`, `trait`, `type`).
fn defined_types(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    for kw in ["struct ", "enum ", "union ", "trait ", "type "] {
        for (at, _) in code.match_indices(kw) {
            if at > 0 && is_ident(code[..at].chars().next_back().unwrap()) {
                continue;
            }
            let name = first_segment(&code[at + kw.len()..]);
            if !name.is_empty() && name != "*" {
                out.push(name);
            }
        }
    }
    out
}

/// The inherent impls of `code` (`impl<…> Name<…> … {`, not `impl Trait for Name`): the
/// name of the type each extends, with its byte offset.
fn inherent_impls(code: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (at, _) in code.match_indices("impl") {
        let before = code[..at].chars().next_back();
        let after = code[at + 4..].chars().next();
        if before.is_some_and(is_ident) || !matches!(after, Some('<' | ' ' | '\n')) {
            continue;
        }
        // An item starts its line (`unsafe impl` aside); `impl Trait` in a signature does not.
        let line_start = code[..at].rfind('\n').map_or(0, |n| n + 1);
        let lead = code[line_start..at].trim();
        if !(lead.is_empty() || lead == "unsafe") {
            continue;
        }
        // Skip the impl's own generics, then read up to the body or `where`.
        let mut rest = code[at + 4..].trim_start();
        if rest.starts_with('<') {
            let mut level = 0;
            let end = rest.char_indices().find_map(|(i, c)| {
                match c {
                    '<' => level += 1,
                    '>' => level -= 1,
                    _ => {}
                }
                (level == 0).then_some(i)
            });
            let Some(end) = end else { continue };
            rest = rest[end + 1..].trim_start();
        }
        let head_end = rest.find(['{', ';']).unwrap_or(rest.len());
        let head = rest[..head_end].split(" where").next().unwrap_or("");
        if head.contains(" for ") || head.trim_start().starts_with('!') {
            continue; // a trait impl
        }
        // The last path segment before the type's generics: `crate::store::Db<K>` is `Db`.
        let path = head.split('<').next().unwrap_or("").trim();
        let name = path.rsplit("::").next().unwrap_or("").trim();
        if !name.is_empty() && name.chars().all(is_ident) {
            out.push((at, name.to_string()));
        }
    }
    out
}

/// Every inherent `impl T` outside the layer that defines `T` (except those allowed above).
fn foreign_impls(files: &[(PathBuf, String)]) -> Vec<String> {
    let stripped: Vec<_> = files
        .iter()
        .map(|(p, s)| (p, s, strip_comments(s)))
        .collect();
    let mut defined: HashMap<String, Vec<&'static str>> = HashMap::new();
    for (rel, _, code) in &stripped {
        if let Some(layer) = layer_of(rel) {
            for name in defined_types(code) {
                defined.entry(name).or_default().push(layer);
            }
        }
    }
    let mut bad = Vec::new();
    for (rel, src, code) in &stripped {
        let Some(layer) = layer_of(rel) else { continue };
        let shown = rel.to_string_lossy().replace('\\', "/");
        for (at, name) in inherent_impls(code) {
            let Some(homes) = defined.get(&name) else {
                continue; // not the crate's type (a compile error anyway)
            };
            if homes.contains(&layer)
                || FOREIGN_IMPLS_ALLOWED
                    .iter()
                    .any(|(t, f, _)| *t == name && *f == shown)
            {
                continue;
            }
            let line = code[..at].matches('\n').count() + 1;
            let text = src.lines().nth(line - 1).unwrap_or("").trim();
            bad.push(format!(
                "src/{shown}:{line}: an inherent impl of `{name}` in {layer}/, which does not \
                 define it (defined in {}): {text}",
                homes.join(", ")
            ));
        }
    }
    bad
}

/// The names of the functions `code` declares (`fn name`).
fn declared_fns(code: &str) -> Vec<String> {
    code.match_indices("fn ")
        .filter(|(at, _)| *at == 0 || !is_ident(code[..*at].chars().next_back().unwrap()))
        .map(|(at, _)| first_segment(&code[at + 3..]))
        .filter(|n| !n.is_empty())
        .collect()
}

/// Calls, below the top, of a method only `db.rs` declares: such a call compiles only
/// because the facade exists, and hides an upward dependency no path names. A call whose
/// arguments name an atomic ordering (`x.store(v, Relaxed)`) is an atomic's, not the
/// facade's.
fn facade_calls(files: &[(PathBuf, String)]) -> Vec<String> {
    let stripped: Vec<_> = files
        .iter()
        .map(|(p, s)| (p, s, strip_comments(s)))
        .collect();
    let Some((_, _, facade)) = stripped.iter().find(|(p, _, _)| *p == Path::new("db.rs")) else {
        return Vec::new();
    };
    let elsewhere: Vec<String> = stripped
        .iter()
        .filter(|(p, _, _)| *p != Path::new("db.rs"))
        .flat_map(|(_, _, code)| declared_fns(code))
        .collect();
    let only_facade: Vec<String> = declared_fns(facade)
        .into_iter()
        .filter(|n| !elsewhere.contains(n))
        .collect();
    let mut bad = Vec::new();
    for (rel, src, code) in &stripped {
        if layer_of(rel).is_none_or(|l| l == "top") {
            continue;
        }
        for name in &only_facade {
            for pat in [format!(".{name}("), format!("::{name}(")] {
                for (at, _) in code.match_indices(&pat) {
                    // The call's arguments, to its own closing parenthesis (calls inside
                    // them, `x.store(v.len(), Relaxed)`, have theirs).
                    let rest = &code[at + pat.len()..];
                    let mut depth = 0usize;
                    let end = rest
                        .char_indices()
                        .find(|&(_, c)| match c {
                            '(' => {
                                depth += 1;
                                false
                            }
                            ')' if depth == 0 => true,
                            ')' => {
                                depth -= 1;
                                false
                            }
                            _ => false,
                        })
                        .map_or(rest.len(), |(i, _)| i);
                    let args = &rest[..end];
                    if ["Relaxed", "Release", "Acquire", "AcqRel", "SeqCst"]
                        .iter()
                        .any(|o| args.contains(o))
                    {
                        continue;
                    }
                    let line = code[..at].matches('\n').count() + 1;
                    let text = src.lines().nth(line - 1).unwrap_or("").trim();
                    bad.push(format!(
                        "src/{}:{line}: calls `{name}`, which only db.rs (the top) declares: {text}",
                        rel.display()
                    ));
                }
            }
        }
    }
    bad
}

/// What each lower layer must not name of the Kubernetes client: `disk/` nothing of `kube`
/// or `k8s_openapi` (it stores bytes), `store/` no `Client` or `Api` (it makes no request).
fn kubernetes_below(files: &[(PathBuf, String)]) -> Vec<String> {
    let mut bad = Vec::new();
    for (rel, src) in files {
        let layer = layer_of(rel);
        let forbidden: &[&str] = match layer {
            Some("disk") => &["kube", "k8s_openapi"],
            Some("store") => &[
                "kube::Client",
                "kube::Api",
                "kube::api::Api",
                "Client",
                "Api",
            ],
            _ => continue,
        };
        let code = strip_comments(src);
        let mut hit = |at: usize, what: &str| {
            let line = code[..at].matches('\n').count() + 1;
            let text = src.lines().nth(line - 1).unwrap_or("").trim();
            bad.push(format!(
                "src/{}:{line}: {}/ names `{what}`: {text}",
                rel.display(),
                layer.unwrap()
            ));
        };
        for root in ["kube", "k8s_openapi"] {
            for (at, _) in code.match_indices(&format!("{root}::")) {
                if at > 0 && is_ident(code[..at].chars().next_back().unwrap()) {
                    continue;
                }
                if forbidden.contains(&root) {
                    hit(at, root);
                    continue;
                }
                // `kube::Client`, `kube::api::Api`, `use kube::{Client, api::Api}`: the leaves.
                let rest = &code[at..];
                let end = rest
                    .find([';', '(', ')', '<', '>', '=', '\n'])
                    .unwrap_or(rest.len());
                let path: String = rest[..end].chars().filter(|c| !c.is_whitespace()).collect();
                let leaves = path
                    .split(['{', '}', ','])
                    .filter_map(|p| p.rsplit("::").next())
                    .map(|l| l.split(" as ").next().unwrap_or(l));
                for leaf in leaves {
                    if forbidden.contains(&leaf) {
                        hit(at, leaf);
                    }
                }
            }
        }
    }
    bad
}

/// Object keys (the tags `OBJECT`, `SEEN`, `INDEX`, `ENTRIES` of `disk::keys`) named above
/// the store: every read and write of a stream's objects goes through `store/`.
fn object_keys_above_store(files: &[(PathBuf, String)]) -> Vec<String> {
    let mut bad = Vec::new();
    for (rel, src) in files {
        if matches!(
            layer_of(rel),
            None | Some("model" | "exec" | "disk" | "store")
        ) {
            continue;
        }
        let code = strip_comments(src);
        for tag in ["OBJECT", "SEEN", "INDEX", "ENTRIES"] {
            for (at, _) in code.match_indices(tag) {
                let before = code[..at].chars().next_back();
                let after = code[at + tag.len()..].chars().next();
                if before.is_some_and(is_ident) || after.is_some_and(is_ident) {
                    continue;
                }
                let line = code[..at].matches('\n').count() + 1;
                let text = src.lines().nth(line - 1).unwrap_or("").trim();
                bad.push(format!(
                    "src/{}:{line}: names the object key tag `{tag}` above the store: {text}",
                    rel.display()
                ));
            }
        }
    }
    bad
}

/// The files of `src/`, each with its path relative to `src/`.
fn source_files() -> Vec<(PathBuf, String)> {
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
    files
}

#[test]
fn every_inherent_impl_is_in_the_layer_of_its_type() {
    let bad = foreign_impls(&source_files());
    assert!(
        bad.is_empty(),
        "{} misplaced impl(s):\n{}",
        bad.len(),
        bad.join("\n")
    );
}

#[test]
fn no_layer_below_the_top_calls_the_facade() {
    let bad = facade_calls(&source_files());
    assert!(
        bad.is_empty(),
        "{} facade call(s):\n{}",
        bad.len(),
        bad.join("\n")
    );
}

#[test]
fn only_the_store_reads_and_writes_object_keys() {
    let bad = object_keys_above_store(&source_files());
    assert!(bad.is_empty(), "{}:\n{}", bad.len(), bad.join("\n"));
}

#[test]
fn disk_knows_no_kubernetes_and_store_makes_no_request() {
    let bad = kubernetes_below(&source_files());
    assert!(bad.is_empty(), "{}:\n{}", bad.len(), bad.join("\n"));
}

/// The checks themselves, on made-up files: each rule catches its case with file and line,
/// and lets the allowed forms through.
#[test]
fn the_rules_catch_their_cases() {
    let file = |p: &str, lines: &[&str]| (PathBuf::from(p), lines.join("\n"));
    let at = |bad: Vec<String>| -> Vec<String> {
        bad.iter()
            .map(|b| b.split(": ").next().unwrap().to_string())
            .collect()
    };
    // An inherent impl outside its type's layer; trait impls and the facade are fine.
    let files = vec![
        file(
            "store/mod.rs",
            &["pub struct Db;", "pub(crate) struct Dir;"],
        ),
        file(
            "model/engine.rs",
            &["pub enum Engine { Redb }", "struct Counters;"],
        ),
        file(
            "sync/mod.rs",
            &[
                "impl Dir {",
                "}",
                "impl std::fmt::Debug for Dir {}",
                "impl<K: Clone> crate::store::Db where K: Send {}",
                "impl Counters { fn x(&self) {} }",
                "fn f(x: impl Dir) -> impl Dir {}",
            ],
        ),
        file("db.rs", &["impl Db { pub fn open() {} }"]),
        file(
            "disk/engine/mod.rs",
            &["impl Engine { pub fn of_store() {} }"],
        ),
        file("store/cache.rs", &["impl Dir {}"]),
    ];
    assert_eq!(
        at(foreign_impls(&files)),
        [
            "src/sync/mod.rs:1",
            "src/sync/mod.rs:4",
            "src/sync/mod.rs:5"
        ]
    );
    // A facade-only method called below the top; atomics and shared names are not.
    let files = vec![
        file(
            "db.rs",
            &["impl Db {", "pub fn store() {}", "pub fn path() {}", "}"],
        ),
        file("store/mod.rs", &["impl Dir { pub(crate) fn path() {} }"]),
        file(
            "controller/mod.rs",
            &[
                "let (r, w) = db.store(name, api, cfg)?;",
                "flag.store(true, Ordering::Release);",
                "n.store(1, Relaxed);",
                "let p = dir.path();",
                "let x = Db::store(&db);",
                "len.store(bytes.len(), Ordering::Relaxed);",
                "let y = db.store(f(a), cfg)?;",
            ],
        ),
    ];
    assert_eq!(
        at(facade_calls(&files)),
        [
            "src/controller/mod.rs:1",
            "src/controller/mod.rs:7",
            "src/controller/mod.rs:5"
        ]
    );
    // Kubernetes below the sync layer.
    let files = vec![
        file(
            "disk/record.rs",
            &[
                "use serde::Deserialize;",
                "use kube::Resource;",
                "fn f(x: k8s_openapi::X) {}",
            ],
        ),
        file(
            "store/reader.rs",
            &[
                "use kube::Resource;",
                "use kube::{Client, api::ListParams};",
                "fn f(api: kube::api::Api<Pod>) {}",
                "use kube::runtime::reflector::ObjectRef;",
            ],
        ),
        file("sync/conn.rs", &["use kube::Client;"]),
    ];
    assert_eq!(
        at(kubernetes_below(&files)),
        [
            "src/disk/record.rs:2",
            "src/disk/record.rs:3",
            "src/store/reader.rs:2",
            "src/store/reader.rs:3"
        ]
    );
    // Object key tags above the store.
    let files = vec![
        file(
            "store/writer/mod.rs",
            &["let k = keys::tagged(OBJECT, &s);"],
        ),
        file(
            "sync/verify.rs",
            &[
                "use crate::disk::keys::{self, OBJECT};",
                "let (a, b) = keys::range(keys::SEEN, None);",
                "const OBJECTS: usize = 1;",
            ],
        ),
    ];
    assert_eq!(
        at(object_keys_above_store(&files)),
        ["src/sync/verify.rs:1", "src/sync/verify.rs:2"]
    );
    // A glob of the crate root counts as the top; a char literal with a quote does not hide
    // the code after it from the lexer.
    let files = vec![
        file("lib.rs", &["mod store;", "pub use store::Db;"]),
        file(
            "store/keys.rs",
            &[
                "use crate::*;",
                "const Q: char = '\\\"';",
                "const R: char = '\"';",
                "fn f<'a>(x: &'a str) -> char { '\\'' }",
                "use crate::sync::Watcher;",
                "use crate::model::Error;",
            ],
        ),
    ];
    assert_eq!(
        at(violations(&files)),
        ["src/store/keys.rs:1", "src/store/keys.rs:5"]
    );
}
