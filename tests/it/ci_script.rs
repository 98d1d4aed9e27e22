//! `.ci/run` without the RustSec advisory snapshot: CI fails, at once and saying why, rather
//! than skip the advisory check and pass. The script is copied into a temporary checkout
//! that has no `../shared/rustsec` beside it and run there; it must exit non-zero before
//! its first step (no build starts) with a message naming the missing snapshot.

use std::process::Command;

#[test]
fn ci_fails_without_the_advisory_snapshot() {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".ci/run");
    let tmp = tempfile::tempdir().unwrap();
    // `<tmp>/checkout/.ci/run`: the script runs from `<tmp>/checkout`, and looks for the
    // snapshot in `<tmp>/shared/rustsec`, which does not exist.
    let ci = tmp.path().join("checkout/.ci");
    std::fs::create_dir_all(&ci).unwrap();
    std::fs::copy(&script, ci.join("run")).unwrap();
    assert!(!tmp.path().join("shared").exists());
    let out = Command::new("bash")
        .arg(ci.join("run"))
        .env_remove("CARGO_TARGET_DIR")
        .output()
        .expect("run .ci/run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        ".ci/run passed without the advisory snapshot:\n{stdout}\n{stderr}"
    );
    assert!(
        stderr.contains("no RustSec advisory snapshot at ../shared/rustsec/advisory-db.bundle"),
        "not the snapshot's message:\n{stdout}\n{stderr}"
    );
    // Before any step: not after the builds, and never a skip.
    assert!(!stdout.contains("=== "), "steps ran first:\n{stdout}");
    assert!(!stdout.contains("not checked"), "{stdout}");
}
