//! The declared minimum Rust version (MSRV) holds for what a user builds: every crate that
//! a published crate of this workspace depends on (normal dependencies, all features, as
//! locked) declares a `rust-version` no newer than the workspace's. Only one toolchain can be
//! installed where CI runs, so the MSRV is not compiled; this check and clippy's
//! `incompatible_msrv` lint (denied in `.ci/run`: no std API newer than the MSRV) stand in.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use serde_json::Value;

/// `1.90` or `1.90.0` as (major, minor, patch).
fn version(text: &str) -> (u64, u64, u64) {
    let mut parts = text.split('.').map(|p| p.parse::<u64>().unwrap_or(0));
    let mut next = || parts.next().unwrap_or(0);
    (next(), next(), next())
}

#[test]
fn dependencies_build_on_the_declared_rust_version() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--all-features",
            "--locked",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: Value = serde_json::from_slice(&out.stdout).unwrap();
    let packages: BTreeMap<&str, &Value> = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["id"].as_str().unwrap(), p))
        .collect();
    let nodes: BTreeMap<&str, &Value> = meta["resolve"]["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| (n["id"].as_str().unwrap(), n))
        .collect();
    let mut checked = 0;
    for root in ["kube-persist", "kube-persist-testkit"] {
        let (root_id, root_pkg) = packages
            .iter()
            .find(|(_, p)| p["name"] == root)
            .unwrap_or_else(|| panic!("{root} is in the workspace"));
        let msrv = root_pkg["rust_version"]
            .as_str()
            .unwrap_or_else(|| panic!("{root} declares a rust-version"));
        let mut seen = BTreeSet::new();
        let mut todo = vec![*root_id];
        let mut newer = Vec::new();
        while let Some(id) = todo.pop() {
            if !seen.insert(id) {
                continue;
            }
            let pkg = packages[id];
            if let Some(needs) = pkg["rust_version"].as_str()
                && version(needs) > version(msrv)
            {
                newer.push(format!("{} {} needs {needs}", pkg["name"], pkg["version"]));
            }
            for dep in nodes[id]["deps"].as_array().unwrap() {
                let normal = dep["dep_kinds"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|k| k["kind"].is_null());
                if normal {
                    todo.push(dep["pkg"].as_str().unwrap());
                }
            }
        }
        assert!(
            newer.is_empty(),
            "{root} declares rust-version {msrv}, but: {newer:?}"
        );
        assert!(seen.len() > 50, "{root}: only {} crates walked", seen.len());
        checked += seen.len();
    }
    println!("msrv: {checked} crates checked");
}
