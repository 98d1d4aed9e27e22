//! Issue 60 item 7: every crate of the workspace denies unsafe code at its root
//! (`#![deny(unsafe_code)]`), so that any `unsafe` block needs a narrowly scoped
//! `#[allow(unsafe_code)]` next to its SAFETY comment.

use std::path::Path;

#[test]
fn every_crate_root_denies_unsafe_code() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut roots = vec![
        root.join("src/lib.rs"),
        root.join("cli/src/main.rs"),
        root.join("testkit/src/lib.rs"),
        root.join("charts/src/main.rs"),
    ];
    for entry in std::fs::read_dir(root.join("testkit/src/bin")).unwrap() {
        roots.push(entry.unwrap().path());
    }
    let missing: Vec<_> = roots
        .iter()
        .filter(|p| {
            let text = std::fs::read_to_string(p).unwrap();
            !text.lines().any(|l| {
                matches!(
                    l.trim(),
                    "#![deny(unsafe_code)]" | "#![forbid(unsafe_code)]"
                )
            })
        })
        .collect();
    assert!(
        missing.is_empty(),
        "crate roots without #![deny(unsafe_code)]: {missing:?}"
    );
}
