//! docs/operations.md, *Every flag and exit status*, against the tool itself: the commands,
//! their arguments and flags as the built binary's `--help` of each command gives them, and
//! their exit statuses as its help lists them and as its code returns them.
//!
//! The section has a `#### Every command` part (the flags every command takes, and the
//! exit statuses of a command without its own), a `` #### `kube-persist` `` part (the
//! flags of the tool alone), and one `` #### `kube-persist COMMAND ARGS..` `` part per
//! command: a table of its own flags (rows starting with `` `-``) and, where its help has
//! an exit status list of its own, a table of its exit statuses (rows starting with a
//! digit).
//!
//! `cargo test --release -p kube-persist-cli --test operations_doc`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

/// The section of docs/operations.md this test holds.
const SECTION: &str = "### Every flag and exit status";

/// What `--help` (or the doc) says about one command.
#[derive(Debug, Default, PartialEq, Eq)]
struct Usage {
    /// Positional arguments, in order (`DIR`, `STREAM`).
    args: Vec<String>,
    /// Flags, each as `-o --output OUTPUT` (short, long, value name).
    flags: BTreeSet<String>,
    /// Exit statuses of its own (empty: the tool's).
    exits: BTreeSet<u8>,
}

fn help(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_kube-persist"))
        .args(args)
        .output()
        .expect("running kube-persist");
    assert_eq!(out.status.code(), Some(0), "kube-persist {args:?}");
    String::from_utf8(out.stdout).expect("UTF-8 help")
}

/// A flag as `-o --output OUTPUT`, from `-o, --output <OUTPUT>` (help) or
/// `-o, --output OUTPUT` (doc).
fn flag(spec: &str) -> String {
    spec.replace([',', '<', '>'], " ")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// Parses a `--help` text: its positional arguments (from `Usage:`), its flags (the
/// `Options:` lines), its exit statuses (the `Exit status:` lines) and, for the tool
/// itself, its commands.
fn parse_help(text: &str) -> (Usage, Vec<String>) {
    let mut usage = Usage::default();
    let mut commands = Vec::new();
    let mut part = "";
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("Usage: ") {
            usage.args = rest
                .split_whitespace()
                .skip(2) // `kube-persist COMMAND` (the tool's own: `kube-persist [OPTIONS]`)
                .filter(|w| *w != "[OPTIONS]" && *w != "<COMMAND>")
                .map(|w| w.trim_matches(['<', '>', '[', ']', '.']).to_string())
                .collect();
            continue;
        }
        if !line.starts_with(' ') && line.ends_with(':') {
            part = line;
            continue;
        }
        let indent = line.len() - line.trim_start().len();
        let item = line.trim();
        match part {
            "Commands:" if indent == 2 => {
                let name = item.split_whitespace().next().unwrap_or("");
                if name != "help" {
                    commands.push(name.to_string());
                }
            }
            "Options:" if item.starts_with('-') && indent <= 6 => {
                usage.flags.insert(flag(item));
            }
            "Exit status:" if indent == 2 => {
                if let Some(n) = item.split_whitespace().next().and_then(|n| n.parse().ok()) {
                    usage.exits.insert(n);
                }
            }
            _ => {}
        }
    }
    (usage, commands)
}

/// Parses the doc's section: per `####` part (keyed `*` for *Every command*, `` for the
/// tool itself, else the command), its arguments, flags and exit statuses.
fn parse_doc(doc: &str) -> BTreeMap<String, Usage> {
    let mut parts = BTreeMap::new();
    let mut current: Option<String> = None;
    let lines = doc
        .lines()
        .skip_while(|l| l.trim_end() != SECTION)
        .skip(1)
        .take_while(|l| !l.starts_with("## ") && !l.starts_with("### "));
    for line in lines {
        if let Some(title) = line.strip_prefix("#### ") {
            let key = if title.trim() == "Every command" {
                "*".to_string()
            } else {
                let words: Vec<&str> = title.trim_matches('`').split_whitespace().collect();
                assert_eq!(words.first(), Some(&"kube-persist"), "heading {title:?}");
                let key = words.get(1).map_or(String::new(), |w| w.to_string());
                let usage: &mut Usage = parts.entry(key.clone()).or_default();
                usage.args = words.iter().skip(2).map(|w| w.to_string()).collect();
                key
            };
            parts.entry(key.clone()).or_default();
            current = Some(key);
            continue;
        }
        let (Some(key), Some(row)) = (&current, line.trim().strip_prefix("| ")) else {
            continue;
        };
        let cell = row.split(" |").next().unwrap_or("").trim();
        let usage = parts.get_mut(key).expect("a part");
        if let Some(spec) = cell.strip_prefix('`').and_then(|c| c.strip_suffix('`'))
            && spec.starts_with('-')
        {
            usage.flags.insert(flag(spec));
        } else if let Ok(n) = cell.parse::<u8>() {
            usage.exits.insert(n);
        }
    }
    parts
}

/// The exit codes the tool's code returns, by the `Failure` variant each answers
/// (`Err(Failure::No) => ExitCode::from(1)`; `SUCCESS` as 0): every `ExitCode::from(N)` of
/// cli/src, under the name of the nearest `Failure::` before it.
fn code_exits() -> BTreeMap<String, u8> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = BTreeMap::from([("SUCCESS".to_string(), 0)]);
    for entry in std::fs::read_dir(&src).expect("cli/src") {
        let text = std::fs::read_to_string(entry.expect("an entry").path()).expect("a file");
        for (at, _) in text.match_indices("ExitCode::from(") {
            let digits: String = text[at + "ExitCode::from(".len()..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            let Ok(code) = digits.parse() else {
                continue; // clap's own status for --help and usage errors
            };
            let variant = text[..at]
                .rfind("Failure::")
                .map(|v| {
                    text[v + "Failure::".len()..]
                        .chars()
                        .take_while(char::is_ascii_alphanumeric)
                        .collect::<String>()
                })
                .unwrap_or_else(|| panic!("ExitCode::from({code}) answers no Failure"));
            out.insert(variant, code);
        }
    }
    out
}

fn operations_md() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/operations.md");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn operations_md_lists_every_flag_and_exit_status_of_the_tool() {
    check(&operations_md()).unwrap_or_else(|failures| panic!("{}", failures.join("\n")));
}

/// Every difference between the doc and the tool.
fn check(doc: &str) -> Result<(), Vec<String>> {
    let parts = parse_doc(doc);
    let mut failures = Vec::new();
    let (Some(every), Some(tool)) = (parts.get("*"), parts.get("")) else {
        return Err(vec![format!(
            "docs/operations.md, {SECTION}: no `#### Every command` or `#### \\`kube-persist\\`` part"
        )]);
    };
    let (top, commands) = parse_help(&help(&["--help"]));
    if commands.is_empty() {
        failures.push("no command in `kube-persist --help`".into());
    }
    let documented: BTreeSet<&str> = parts
        .keys()
        .filter(|k| !k.is_empty() && *k != "*")
        .map(String::as_str)
        .collect();
    let helped: BTreeSet<&str> = commands.iter().map(String::as_str).collect();
    for c in helped.difference(&documented) {
        failures.push(format!("command {c} is not documented"));
    }
    for c in documented.difference(&helped) {
        failures.push(format!(
            "the doc documents a command {c} the tool does not have"
        ));
    }
    // The tool's own flags and statuses.
    let with_every =
        |u: &Usage| -> BTreeSet<String> { u.flags.union(&every.flags).cloned().collect() };
    compare(
        "kube-persist",
        &top.flags,
        &with_every(tool),
        "flags",
        &mut failures,
    );
    compare(
        "kube-persist",
        &top.exits,
        &every.exits,
        "exit statuses",
        &mut failures,
    );
    // Every exit code the code returns is documented (2 is also clap's usage error), and
    // the doc lists no other.
    let by_variant = code_exits();
    let code: BTreeSet<u8> = by_variant.values().copied().collect();
    if !code.is_subset(&every.exits) {
        failures.push(format!(
            "the tool's code returns exit statuses {code:?}, the doc lists {:?}",
            every.exits
        ));
    }
    for (part, usage) in &parts {
        if !usage.exits.is_subset(&code) {
            failures.push(format!(
                "the doc lists exit statuses {:?} for {part:?}, the code returns {code:?}",
                usage.exits
            ));
        }
    }
    // `verify` answers "could not tell" with a status of its own, which its help and its
    // table list.
    match by_variant.get("Undecided") {
        Some(undecided) => {
            let (verify, _) = parse_help(&help(&["verify", "--help"]));
            let doc = parts.get("verify").map(|u| &u.exits);
            if !verify.exits.contains(undecided) || !doc.is_some_and(|d| d.contains(undecided)) {
                failures.push(format!(
                    "verify's undecided status {undecided} (the code's) is not in its --help \
                     {:?} and its table {doc:?}",
                    verify.exits
                ));
            }
            if [by_variant.get("No"), by_variant.get("Error")].contains(&Some(undecided)) {
                failures.push(format!(
                    "verify's undecided status {undecided} is also another answer's: {by_variant:?}"
                ));
            }
        }
        None => failures.push(format!(
            "no exit status for Failure::Undecided in the code: {by_variant:?}"
        )),
    }
    for c in helped.intersection(&documented) {
        let (usage, _) = parse_help(&help(&[c, "--help"]));
        let doc = &parts[*c];
        let who = format!("kube-persist {c}");
        if usage.args != doc.args {
            failures.push(format!(
                "{who}: arguments {:?} in --help, {:?} in the doc",
                usage.args, doc.args
            ));
        }
        compare(&who, &usage.flags, &with_every(doc), "flags", &mut failures);
        let helped_exits = if usage.exits.is_empty() {
            &top.exits
        } else {
            &usage.exits
        };
        let doc_exits = if doc.exits.is_empty() {
            &every.exits
        } else {
            &doc.exits
        };
        compare(
            &who,
            helped_exits,
            doc_exits,
            "exit statuses",
            &mut failures,
        );
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures)
    }
}

fn compare<T: Ord + std::fmt::Debug>(
    who: &str,
    help: &BTreeSet<T>,
    doc: &BTreeSet<T>,
    what: &str,
    failures: &mut Vec<String>,
) {
    let missing: Vec<_> = help.difference(doc).collect();
    let extra: Vec<_> = doc.difference(help).collect();
    if !missing.is_empty() {
        failures.push(format!(
            "{who}: {what} {missing:?} are in --help, not in the doc"
        ));
    }
    if !extra.is_empty() {
        failures.push(format!(
            "{who}: {what} {extra:?} are in the doc, not in --help"
        ));
    }
}

/// The check fails on a doc that drops a flag, invents one, or changes a command's exit
/// statuses (the real doc passes above; these are edits of it).
#[test]
fn the_check_sees_a_drifted_doc() {
    let doc = operations_md();
    let edits = [
        (
            "| `--yes` | do not ask for confirmation (for scripts) |\n",
            "",
        ),
        (
            "| `-V, --version` | the tool's version |",
            "| `-V, --version` | v |\n| `--verbose` | v |",
        ),
        (
            "#### `kube-persist verify DIR STREAM`",
            "#### `kube-persist verify DIR`",
        ),
        (
            "| 1 | the object is not in the stream",
            "| 3 | the object is not in the stream",
        ),
        (
            "#### `kube-persist dump DIR STREAM`",
            "#### `kube-persist dumps DIR STREAM`",
        ),
        ("| 3 | undecided: ", "| 1 | undecided: "),
        (
            "| 2 | an error, a store locked by a controller",
            "| 2 | an error, a store locked by a controller (\"locked\") included |\n| 4 | x",
        ),
    ];
    for (from, to) in edits {
        assert!(doc.contains(from), "the doc no longer holds {from:?}");
        let drifted = doc.replacen(from, to, 1);
        assert!(check(&drifted).is_err(), "not seen: {from:?} -> {to:?}");
    }
}
