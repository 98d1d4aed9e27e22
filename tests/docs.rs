//! The manual against the code: the README stays a manual (its size), its *Installation*
//! names every crate its snippets use, and docs/configuration.md lists every setting of
//! `StreamConfig`, `DbConfig` and `controller::Config`, and no other.
//!
//! A setting is a builder method: a `pub fn` of an inherent `impl` of the type whose first
//! parameter is `self` or `mut self` (getters take `&self`). The impls are found wherever
//! they are under `src/` (`StreamConfig`'s are spread over several files), so moving code
//! between files does not blind the test; a type with no setter found fails it.
//!
//! `cargo test --release --test docs`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The README's size limit, in bytes (`wc -c README.md`): a manual, with the detail in docs/.
const README_MAX_BYTES: usize = 16_000;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

#[test]
fn readme_is_a_manual_of_at_most_16_kb() {
    let size = read("README.md").len();
    assert!(
        size <= README_MAX_BYTES,
        "README.md is {size} bytes, over {README_MAX_BYTES}: move detail to docs/ and link it"
    );
}

#[test]
fn readme_installation_names_every_crate_its_snippets_use() {
    let readme = read("README.md");
    let listed = installation_crates(&readme);
    assert!(
        listed.contains("kube_persist"),
        "the Installation section lists no kube-persist: {listed:?}"
    );
    let used = snippet_crates(&readme);
    assert!(
        used.contains("kube_persist") && used.contains("kube"),
        "no snippet found using kube-persist: {used:?}"
    );
    let missing: Vec<_> = used.difference(&listed).collect();
    assert!(
        missing.is_empty(),
        "README snippets use {missing:?}, which its Installation section does not list \
         (listed: {listed:?})"
    );
}

#[test]
fn configuration_md_lists_every_setting_and_no_other() {
    let doc = read("docs/configuration.md");
    let mut failures = Vec::new();
    for (section, ty, under) in [
        ("StreamConfig", "StreamConfig", "src"),
        ("DbConfig", "DbConfig", "src"),
        ("controller::Config", "Config", "src/controller"),
    ] {
        let code = setters(&root().join(under), ty);
        assert!(
            !code.is_empty(),
            "no setter of {ty} found under {under}/ (was it renamed or moved?)"
        );
        let documented = documented_settings(&doc, section);
        for name in code.difference(&documented) {
            failures.push(format!(
                "{section}::{name} is a setting in the code but not in the table of docs/configuration.md"
            ));
        }
        for name in documented.difference(&code) {
            failures.push(format!(
                "docs/configuration.md names {section}::{name}, which is not a setting in the code"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The self-tests of the parsers, on made-up text (the real files are checked above).
#[test]
fn parsers_find_what_they_should() {
    let src = "impl Foo {\n    /// `fn fake(self)` in a doc { unbalanced\n    pub fn a(mut self, x: u32) -> Self { let s = \"}\"; self }\n    pub fn get_a(&self) -> u32 { 0 }\n    pub fn b<K: 'static>(\n        self,\n        f: impl Fn(&K) -> Vec<String>,\n    ) -> Self { self }\n    fn private(self) -> Self { self }\n    pub(crate) fn internal(self) -> Self { self }\n    pub fn new() -> Self { Foo }\n}\nimpl Bar {\n    pub fn c(self) -> Self { self }\n}\nimpl Default for Foo { fn default() -> Self { Foo } }\n";
    let found = setters_in(src, "Foo");
    assert_eq!(found, BTreeSet::from(["a".to_string(), "b".to_string()]));

    let doc = "## Foo\n\n| setting | default |\n|---|---|\n| `a(n)` | 1 |\n| `b()`, and more | x |\n\n- `not_a_row(x)`\n\n## Bar\n\n| `c(d)` | 2 |\n";
    assert_eq!(
        documented_settings(doc, "Foo"),
        BTreeSet::from(["a".to_string(), "b".to_string()])
    );

    let readme = "# x\n\n## Installation\n\n```toml\n[dependencies]\nkube-persist = \"0.1\"\nserde_json = \"1\"\n```\n\n## Use\n\n```rust\n# use std::sync::Arc;\nuse kube::{Api, runtime::controller::Action};\nuse kube_persist::{Db, controller::{self, Controller}};\n#[derive(Debug, thiserror::Error)]\nstruct E;\nfn f() { let c = controller::Config::default(); let v = serde_json::json!({}); let d = Duration::from_secs(1); x.y::<u8>(); }\n```\n\n```text\nnotacrate::thing\n```\n";
    assert_eq!(
        installation_crates(readme),
        BTreeSet::from(["kube_persist".to_string(), "serde_json".to_string()])
    );
    assert_eq!(
        snippet_crates(readme),
        ["kube", "kube_persist", "serde_json", "thiserror"]
            .map(String::from)
            .into()
    );
}

// ---------------------------------------------------------------------------------------
// The code's settings.

/// The setters of `ty` in every `.rs` file under `dir`.
fn setters(dir: &Path, ty: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for file in rust_files(dir) {
        let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{file:?}: {e}"));
        out.extend(setters_in(&text, ty));
    }
    out
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{d:?}: {e}")) {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|x| x == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// The setters of the inherent `impl <ty> {` blocks of one source file.
fn setters_in(source: &str, ty: &str) -> BTreeSet<String> {
    let code = strip_comments_and_literals(source);
    let header = format!("impl {ty} {{");
    let mut out = BTreeSet::new();
    let mut from = 0;
    while let Some(at) = code[from..].find(&header) {
        let start = from + at + header.len();
        // Only an `impl` at the start of a line (not `impl Trait for`, not a longer name).
        let line_start = code[..from + at].rfind('\n').map_or(0, |i| i + 1);
        let at_line_start = code[line_start..from + at].trim().is_empty();
        let end = block_end(&code, start);
        if at_line_start {
            let body = &code[start..end];
            out.extend(pub_self_fns(body));
        }
        from = end;
    }
    out
}

/// The index of the `}` closing the block that starts just before `start`.
fn block_end(code: &str, start: usize) -> usize {
    let mut depth = 1usize;
    for (i, c) in code[start..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return start + i;
                }
            }
            _ => {}
        }
    }
    code.len()
}

/// The `pub fn`s at the top level of an impl body whose first parameter is `self` or
/// `mut self`.
fn pub_self_fns(body: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut depth = 0usize;
    let bytes = body.as_bytes();
    let mut i = 0;
    while i < body.len() {
        match bytes[i] {
            b'{' => depth += 1,
            b'}' => depth = depth.saturating_sub(1),
            b'p' if depth == 0 && body[i..].starts_with("pub fn ") && word_start(body, i) => {
                let rest = &body[i + "pub fn ".len()..];
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if let Some(open) = params_open(rest) {
                    let params = &rest[open + 1..];
                    let first = params
                        .split([',', ')'])
                        .next()
                        .unwrap_or("")
                        .split_whitespace()
                        .collect::<Vec<_>>()
                        .join(" ");
                    if first == "self" || first == "mut self" {
                        out.push(name);
                    }
                }
            }
            _ => {}
        }
        i += 1;
    }
    out
}

fn word_start(s: &str, i: usize) -> bool {
    i == 0 || !s.as_bytes()[i - 1].is_ascii_alphanumeric() && s.as_bytes()[i - 1] != b'_'
}

/// The index of the `(` opening a function's parameters, after its generics.
fn params_open(sig: &str) -> Option<usize> {
    let mut angle = 0usize;
    for (i, c) in sig.char_indices() {
        match c {
            '<' => angle += 1,
            '>' => angle = angle.saturating_sub(1),
            '(' if angle == 0 => return Some(i),
            _ => {}
        }
    }
    None
}

/// Rust source with comments, string literals and character literals blanked (their
/// braces would confuse the block matching), lengths kept.
fn strip_comments_and_literals(src: &str) -> String {
    let chars: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            while i < chars.len() && !(chars[i] == '*' && chars.get(i + 1) == Some(&'/')) {
                out.push(if chars[i] == '\n' { '\n' } else { ' ' });
                i += 1;
            }
            out.push_str("  ");
            i += 2;
        } else if c == '"' {
            out.push(' ');
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    out.push(' ');
                    i += 1;
                }
                out.push(if chars.get(i) == Some(&'\n') {
                    '\n'
                } else {
                    ' '
                });
                i += 1;
            }
            out.push(' ');
            i += 1;
        } else if c == '\'' && next == Some('\\') && chars.get(i + 3) == Some(&'\'') {
            out.push_str("    ");
            i += 4;
        } else if c == '\'' && chars.get(i + 2) == Some(&'\'') {
            out.push_str("   ");
            i += 3;
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

// ---------------------------------------------------------------------------------------
// The documented settings.

/// The lines of the `## <heading>` section of a markdown page (up to the next `## `).
fn section<'a>(doc: &'a str, heading: &str) -> Vec<&'a str> {
    let title = format!("## {heading}");
    doc.lines()
        .skip_while(|l| l.trim_end() != title)
        .skip(1)
        .take_while(|l| !l.starts_with("## "))
        .collect()
}

/// The settings of a section's tables: the name of the code span (`name(..)`) that starts
/// each row's first cell.
fn documented_settings(doc: &str, heading: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in section(doc, heading) {
        let Some(row) = line.trim().strip_prefix("| `") else {
            continue;
        };
        let name: String = row
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() && row[name.len()..].starts_with('(') {
            out.insert(name);
        }
    }
    out
}

// ---------------------------------------------------------------------------------------
// The README's crates.

/// The fenced code blocks of a markdown page: (info string, lines).
fn code_blocks(doc: &str) -> Vec<(String, Vec<&str>)> {
    let mut out = Vec::new();
    let mut lines = doc.lines();
    while let Some(line) = lines.next() {
        if let Some(info) = line.trim_start().strip_prefix("```") {
            let body: Vec<&str> = lines
                .by_ref()
                .take_while(|l| !l.trim_start().starts_with("```"))
                .collect();
            out.push((info.trim().to_string(), body));
        }
    }
    out
}

/// The crates the `## Installation` section's TOML blocks name (`-` read as `_`).
fn installation_crates(readme: &str) -> BTreeSet<String> {
    let text = section(readme, "Installation").join("\n");
    let mut out = BTreeSet::new();
    for (info, body) in code_blocks(&text) {
        if info != "toml" {
            continue;
        }
        for line in body {
            let line = line.trim();
            if line.starts_with('[') || line.starts_with('#') {
                continue;
            }
            if let Some((key, _)) = line.split_once('=') {
                out.insert(key.trim().replace('-', "_"));
            }
        }
    }
    out
}

/// The crates the README's Rust blocks use (compiled as doctests: a block without an info
/// string is Rust too), hidden `# ` lines included: the roots of `use` paths, and
/// lowercase path roots (`serde_json::json!`, `#[derive(thiserror::Error)]`) that no `use`
/// brought in. The standard library's crates are not listed.
fn snippet_crates(readme: &str) -> BTreeSet<String> {
    const STD: [&str; 6] = ["std", "core", "alloc", "crate", "self", "super"];
    let mut out = BTreeSet::new();
    for (info, body) in code_blocks(readme) {
        let lang = info.split(',').next().unwrap_or("");
        if !(lang.is_empty() || lang == "rust") {
            continue;
        }
        let code: String = body
            .iter()
            .map(|l| l.trim_start().strip_prefix("# ").unwrap_or(l).to_string() + "\n")
            .collect();
        let code = strip_comments_and_literals(&code);
        let mut imported = BTreeSet::new();
        // `use` statements: their root is a crate; every other name they bring in is local.
        let mut from = 0;
        while let Some(at) = code[from..].find("use ").map(|a| from + a) {
            from = at + 4;
            if !word_start(&code, at) {
                continue;
            }
            let end = code[from..].find(';').map_or(code.len(), |e| from + e);
            let names = identifiers(&code[from..end]);
            if let Some((root, rest)) = names.split_first() {
                out.insert(root.clone());
                imported.extend(rest.iter().cloned());
            }
            from = end;
        }
        // Paths that start with a lowercase name: `name::`.
        let bytes = code.as_bytes();
        for (i, _) in code.match_indices("::") {
            let start = code[..i]
                .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
                .map_or(0, |s| s + 1);
            let name = &code[start..i];
            let after_path = start >= 2 && &code[start - 2..start] == "::";
            let method = start >= 1 && bytes[start - 1] == b'.';
            if name.is_empty()
                || after_path
                || method
                || !name.starts_with(|c: char| c.is_ascii_lowercase())
                || imported.contains(name)
            {
                continue;
            }
            out.insert(name.to_string());
        }
    }
    for s in STD {
        out.remove(s);
    }
    out
}

/// The identifiers of a `use` tree, in order.
fn identifiers(s: &str) -> Vec<String> {
    s.split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty() && w != &"self" && w != &"as")
        .map(String::from)
        .collect()
}
