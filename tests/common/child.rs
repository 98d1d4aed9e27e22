//! This test binary started again as a child process running one `#[ignore]`d test, and
//! the lines it prints.

use kube_persist::Engine;

/// Environment variable naming the engine a child test process opens its store with.
pub const ENGINE_ENV: &str = "KP_TEST_ENGINE";

/// The engine a child test process was started with (`ENGINE_ENV`); unset (a child test run
/// by hand), the default engine for new stores, redb.
pub fn child_engine() -> Engine {
    std::env::var(ENGINE_ENV)
        .ok()
        .map(|e| e.parse().expect("KP_TEST_ENGINE names an engine"))
        .unwrap_or_default()
}

/// Start this test binary again as a child process running only the `#[ignore]`d test
/// `test_name`, with `envs`; stdout is piped, stderr discarded. `/proc/self/exe` runs this
/// very binary even if cargo rebuilt (replaced) it meanwhile.
pub fn spawn_self(test_name: &str, envs: &[(&str, &std::ffi::OsStr)]) -> std::process::Child {
    let mut cmd = std::process::Command::new("/proc/self/exe");
    cmd.args([
        "--ignored",
        "--exact",
        test_name,
        "--nocapture",
        "--test-threads=1",
    ])
    .env("RUST_LOG", "off")
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::null());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.spawn().expect("spawn child test process")
}

/// Collect the lines of a child process's stdout that `keep` accepts, on a thread, into
/// a shared list the test reads while the child runs.
pub fn collect_stdout(
    child: &mut std::process::Child,
    keep: fn(&str) -> bool,
) -> std::sync::Arc<std::sync::Mutex<Vec<String>>> {
    use std::io::BufRead;
    let out = child.stdout.take().expect("the child's stdout is piped");
    let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = lines.clone();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if keep(&line) {
                sink.lock().unwrap().push(line);
            }
        }
    });
    lines
}

/// `(name, resourceVersion)` of each `reconciled <name> <rv>` line a child printed, in order.
pub fn reconciled_lines(lines: &std::sync::Mutex<Vec<String>>) -> Vec<(String, String)> {
    lines
        .lock()
        .unwrap()
        .iter()
        .filter_map(|l| l.strip_prefix("reconciled "))
        .filter_map(|l| l.split_once(' '))
        .map(|(n, rv)| (n.to_string(), rv.to_string()))
        .collect()
}

/// Whether a child printed exactly `line`.
pub fn printed(lines: &std::sync::Mutex<Vec<String>>, line: &str) -> bool {
    lines.lock().unwrap().iter().any(|l| l == line)
}

/// The last line `collect_stdout` kept (empty before the first): for failure messages.
pub fn last_line(lines: &std::sync::Mutex<Vec<String>>) -> String {
    lines.lock().unwrap().last().cloned().unwrap_or_default()
}

/// VmHWM (peak resident set) of this process, KiB.
pub fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}
