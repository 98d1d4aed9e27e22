//! What a controller crate gets with kube-persist's default features: no sled. sled 0.34
//! is an opt-in engine (`features = ["sled"]`, docs/engines.md says why: its upstream is
//! dormant and it brings crates RustSec lists as unmaintained), so `cargo tree` of
//! kube-persist's normal dependencies with its default features must not name it, and
//! with the feature it must (the check can see sled where it is).

use std::process::Command;

/// The crates (`name vX.Y.Z`) of kube-persist's normal dependency tree, with `features`.
fn tree(features: &[&str]) -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args([
        "tree",
        "-p",
        "kube-persist",
        "-e",
        "normal",
        "--prefix",
        "none",
    ])
    .args(["--offline", "--locked"])
    .current_dir(env!("CARGO_MANIFEST_DIR"));
    if !features.is_empty() {
        cmd.args(["--features", &features.join(",")]);
    }
    let out = cmd.output().expect("cargo tree runs");
    assert!(
        out.status.success(),
        "cargo tree: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            Some(format!("{} {}", w.next()?, w.next()?))
        })
        .collect()
}

#[test]
fn default_features_build_no_sled() {
    let named = |t: &[String], krate: &str| t.iter().any(|c| c.starts_with(&format!("{krate} v")));
    let default = tree(&[]);
    assert!(named(&default, "redb"), "redb is always built: {default:?}");
    for krate in ["sled", "fxhash", "instant"] {
        assert!(
            !named(&default, krate),
            "the default features build {krate}: {:?}",
            default
                .iter()
                .filter(|c| c.starts_with(krate))
                .collect::<Vec<_>>()
        );
    }
    let with_sled = tree(&["sled"]);
    assert!(
        named(&with_sled, "sled"),
        "`--features sled` builds sled: {with_sled:?}"
    );
}
