//! Helpers shared by the integration tests: a watcher driven on a task, event collection
//! with timeouts, and an object-by-object comparison of a store with the testkit server.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use kube::Resource;
pub use kube_persist::Engine;
use kube_persist::{Db, DbConfig, Event, Reader, Watcher};
use kube_persist_testkit::{ResourceType, ServerHandle};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

pub const WAIT: Duration = Duration::from_secs(60);

/// Runs each named scenario (`async fn name(engine: Engine)` or `fn name(engine: Engine)`)
/// once per storage engine, as tests `sled::name` and `redb::name`.
#[macro_export]
macro_rules! engine_tests {
    (async: $($a:ident),* $(,)? ; sync: $($s:ident),* $(,)?) => {
        $crate::engine_tests!(@mod sled, Sled, [$($a),*], [$($s),*]);
        $crate::engine_tests!(@mod redb, Redb, [$($a),*], [$($s),*]);
    };
    (async: $($a:ident),* $(,)?) => { $crate::engine_tests!(async: $($a),*; sync: ); };
    (@mod $m:ident, $engine:ident, [$($a:ident),*], [$($s:ident),*]) => {
        mod $m {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $a() {
                    super::$a(kube_persist::Engine::$engine).await
                }
            )*
            $(
                #[test]
                fn $s() {
                    super::$s(kube_persist::Engine::$engine)
                }
            )*
        }
    };
}

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

/// Open the store at `path` with `engine` and otherwise default options.
pub fn try_open_db(engine: Engine, path: impl AsRef<std::path::Path>) -> kube_persist::Result<Db> {
    Db::open_with(path, DbConfig::default().engine(engine))
}

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "kube_persist=info,warn".into()),
        )
        .with_test_writer()
        .try_init();
}

/// A compact view of an event for assertions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ev {
    Resumed(String),
    Init,
    InitApply(String),
    InitDone,
    Apply(String),
    Delete(String),
    Error(String),
}

pub fn key<K: Resource>(k: &K) -> String {
    let m = k.meta();
    match &m.namespace {
        Some(ns) => format!("{ns}/{}", m.name.clone().unwrap_or_default()),
        None => m.name.clone().unwrap_or_default(),
    }
}

/// Runs a watcher's event stream on a task and forwards compact events.
pub struct Driven {
    pub rx: mpsc::UnboundedReceiver<Ev>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for Driven {
    fn drop(&mut self) {
        if let Some(t) = &self.task {
            t.abort();
        }
    }
}

pub fn drive<K>(watcher: Watcher<K>) -> Driven
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
{
    let (tx, rx) = mpsc::unbounded_channel();
    let task = tokio::spawn(async move {
        let mut s = std::pin::pin!(watcher.stream());
        while let Some(ev) = s.next().await {
            let ev = match ev {
                Ok(Event::Resumed { resource_version }) => Ev::Resumed(resource_version),
                Ok(Event::Init) => Ev::Init,
                Ok(Event::InitApply(k)) => Ev::InitApply(key(&k)),
                Ok(Event::InitDone) => Ev::InitDone,
                Ok(Event::Apply(k)) => Ev::Apply(key(&k)),
                Ok(Event::Delete(k)) => Ev::Delete(key(&k)),
                Ok(Event::DeleteKey(k)) => Ev::Delete(k.to_string()),
                Err(e) => Ev::Error(e.to_string()),
            };
            if tx.send(ev).is_err() {
                return;
            }
        }
    });
    Driven {
        rx,
        task: Some(task),
    }
}

impl Driven {
    /// Stop the watcher and wait until its task (and so its store handles) is gone.
    pub async fn stop(mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
            let _ = t.await;
        }
    }

    /// Collect events until `pred` holds for one of them; returns all events seen.
    pub async fn until(&mut self, pred: impl Fn(&Ev) -> bool) -> Vec<Ev> {
        let mut seen = Vec::new();
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some(ev)) => {
                    let done = pred(&ev);
                    seen.push(ev);
                    if done {
                        return seen;
                    }
                }
                Ok(None) => panic!("watcher stream ended; events so far: {}", summary(&seen)),
                Err(_) => panic!(
                    "timed out waiting for an event; events so far: {}",
                    summary(&seen)
                ),
            }
        }
    }

    /// Collect whatever arrives within `d`.
    pub async fn drain_for(&mut self, d: Duration) -> Vec<Ev> {
        let mut seen = Vec::new();
        let deadline = tokio::time::Instant::now() + d;
        while let Ok(Some(ev)) = tokio::time::timeout_at(deadline, self.rx.recv()).await {
            seen.push(ev);
        }
        seen
    }
}

pub fn summary(evs: &[Ev]) -> String {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for e in evs {
        let k = match e {
            Ev::Resumed(_) => "Resumed",
            Ev::Init => "Init",
            Ev::InitApply(_) => "InitApply",
            Ev::InitDone => "InitDone",
            Ev::Apply(_) => "Apply",
            Ev::Delete(_) => "Delete",
            Ev::Error(_) => "Error",
        };
        *counts.entry(k).or_default() += 1;
    }
    let errors: Vec<_> = evs
        .iter()
        .filter_map(|e| match e {
            Ev::Error(s) => Some(s.as_str()),
            _ => None,
        })
        .take(3)
        .collect();
    format!("{counts:?} errors: {errors:?}")
}

/// `namespace/name` → resourceVersion of every object the server holds of `rt`.
pub fn server_versions(h: &ServerHandle, rt: &ResourceType) -> BTreeMap<String, String> {
    h.list(rt)
        .into_iter()
        .map(|o| {
            let m = &o["metadata"];
            let name = m["name"].as_str().unwrap().to_string();
            let key = match m["namespace"].as_str() {
                Some(ns) => format!("{ns}/{name}"),
                None => name,
            };
            (key, m["resourceVersion"].as_str().unwrap().to_string())
        })
        .collect()
}

/// `namespace/name` → resourceVersion of every object in the store, read from disk.
pub fn store_versions<K: Resource + DeserializeOwned + Send + Sync + 'static>(
    r: &Reader<K>,
) -> BTreeMap<String, String> {
    r.iter()
        .map(|o| {
            let o = o.expect("stored object decodes");
            (
                key(&*o),
                o.meta().resource_version.clone().unwrap_or_default(),
            )
        })
        .collect()
}

/// Assert that the store equals the server object by object (and that `get` finds each).
pub fn assert_matches<K: Resource + DeserializeOwned + Send + Sync + 'static>(
    r: &Reader<K>,
    h: &ServerHandle,
    rt: &ResourceType,
) {
    let server = server_versions(h, rt);
    let store = store_versions(r);
    assert!(
        store == server,
        "store differs: {}",
        diff("store", &store, &server)
    );
    assert_eq!(r.len(), server.len(), "Reader::len");
    for k in server.keys().take(50) {
        let (ns, name) = match k.split_once('/') {
            Some((ns, n)) => (Some(ns), n),
            None => (None, k.as_str()),
        };
        assert!(r.get_named(ns, name).unwrap().is_some(), "get({k})");
    }
}

/// Wait until the store equals the server (used after server-side changes).
pub async fn converge<K: Resource + DeserializeOwned + Send + Sync + 'static>(
    r: &Reader<K>,
    h: &ServerHandle,
    rt: &ResourceType,
) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if store_versions(r) == server_versions(h, rt) {
            assert_matches(r, h, rt);
            return;
        }
        if tokio::time::Instant::now() > deadline {
            assert_matches(r, h, rt);
            panic!("store did not converge");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What differs between two `key -> resourceVersion` maps (a few of each kind), for messages.
pub fn diff(
    what: &str,
    have: &BTreeMap<String, String>,
    want: &BTreeMap<String, String>,
) -> String {
    let missing: Vec<_> = want
        .keys()
        .filter(|k| !have.contains_key(*k))
        .take(5)
        .collect();
    let extra: Vec<_> = have
        .keys()
        .filter(|k| !want.contains_key(*k))
        .take(5)
        .collect();
    let stale: Vec<_> = want
        .iter()
        .filter(|(k, v)| have.get(*k).is_some_and(|x| x != *v))
        .take(5)
        .collect();
    format!(
        "{what} {} vs server {}: missing {missing:?} extra {extra:?} stale {stale:?}",
        have.len(),
        want.len()
    )
}

/// A number from the environment (seeds, step counts).
pub fn env_num<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|s| s.parse().ok())
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

/// The seed of a randomized test. `name` set to a number replays that seed; set to `random`
/// it asks for a fresh random seed; otherwise (unset) the fixed `default`, so that a plain
/// `cargo test` runs the same schedule every time. Print the result with [`SeedReport`].
pub fn test_seed(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) if v.trim().eq_ignore_ascii_case("random") => {
            use rand::Rng;
            rand::rng().random()
        }
        Ok(v) => v.trim().parse().unwrap_or_else(|_| {
            panic!("{name}={v:?}: expected a number (a seed to replay) or `random`")
        }),
        Err(_) => default,
    }
}

/// Prints how to replay a randomized test when it fails: keep it alive for the whole test;
/// if the test panics, dropping it (while unwinding) prints `what` to stderr.
pub struct SeedReport(pub String);

impl Drop for SeedReport {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("FAILED with {}", self.0);
        }
    }
}

/// Poll `f` (every 10 ms, to pace the loop) until it holds; panics after [`WAIT`].
pub async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Sets label `touched=<value>` on the Pod `ns/name` on the server: a change the watch
/// delivers.
pub fn relabel_pod(h: &ServerHandle, ns: &str, name: &str, value: &str) {
    let rt = ResourceType::pods();
    let mut pod = h.get(&rt, Some(ns), name).expect("seeded pod");
    pod["metadata"]["labels"]["touched"] = value.into();
    h.apply(&rt, pod);
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

/// The keys of the `Delete` events among `evs`, sorted.
pub fn deleted_keys(evs: &[Ev]) -> Vec<String> {
    let mut keys: Vec<String> = evs
        .iter()
        .filter_map(|e| match e {
            Ev::Delete(k) => Some(k.clone()),
            _ => None,
        })
        .collect();
    keys.sort_unstable();
    keys
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

/// Collect events until `Apply(key)` arrives: the positive signal that everything the stream
/// delivered before the change that produced it has been received.
pub async fn until_apply(w: &mut Driven, key: &str) -> Vec<Ev> {
    let want = Ev::Apply(key.to_string());
    w.until(|e| *e == want).await
}

/// Replace (or, with `None`, delete) the value at `key` in keyspace `table` of a closed
/// store, with the engine's own API: `edit` gets the current value, if any. For tests that
/// damage or change a store behind kube-persist's back.
pub fn raw_edit(
    engine: Engine,
    dir: &std::path::Path,
    table: &str,
    key: &[u8],
    edit: impl FnOnce(Option<Vec<u8>>) -> Option<Vec<u8>>,
) {
    match engine {
        Engine::Sled => {
            // sled releases its file lock a moment after the store's last handle is dropped
            // (deferred destructors): wait for it, as `Db::open` does.
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            let raw = loop {
                match ::sled::open(dir) {
                    Ok(raw) => break raw,
                    Err(e)
                        if e.to_string().contains("could not acquire lock")
                            && std::time::Instant::now() < deadline =>
                    {
                        std::thread::sleep(Duration::from_millis(10))
                    }
                    Err(e) => panic!("opening the sled store: {e}"),
                }
            };
            let tree = raw.open_tree(table).unwrap();
            match edit(tree.get(key).unwrap().map(|v| v.to_vec())) {
                Some(v) => drop(tree.insert(key, v).unwrap()),
                None => drop(tree.remove(key).unwrap()),
            }
            raw.flush().unwrap();
        }
        Engine::Redb => {
            use ::redb::ReadableTable;
            let def = ::redb::TableDefinition::<&[u8], &[u8]>::new(table);
            let raw = ::redb::Database::open(dir.join("data.redb")).unwrap();
            let txn = raw.begin_write().unwrap();
            {
                let mut t = txn.open_table(def).unwrap();
                let old = t.get(key).unwrap().map(|v| v.value().to_vec());
                match edit(old) {
                    Some(v) => drop(t.insert(key, v.as_slice()).unwrap()),
                    None => drop(t.remove(key).unwrap()),
                }
            }
            txn.commit().unwrap();
        }
        other => panic!("no raw access to the {other} engine in this test"),
    }
}

/// Sync stream `pods` of `db` once from `server` (until the initial list is on disk).
pub async fn sync_pods(server: &kube_persist_testkit::TestServer, db: &Db) {
    let (_reader, watcher) = db
        .store(
            "pods",
            kube::Api::<k8s_openapi::api::core::v1::Pod>::all(server.client()),
            kube_persist::StreamConfig::default(),
        )
        .unwrap();
    let mut w = drive(watcher);
    w.until(|e| *e == Ev::InitDone).await;
    w.stop().await;
}

/// Wait until no process holds the engine's file lock on the store at `dir` (sled frees it
/// a moment after the last handle is dropped): before another process opens the store.
pub fn wait_unlocked(dir: &std::path::Path) {
    use std::os::fd::AsRawFd;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    for file in ["db", "data.redb"] {
        let Ok(f) = std::fs::File::open(dir.join(file)) else {
            continue;
        };
        // flock on our own open file: it fails while the store's handle holds the lock,
        // and closing `f` drops ours at once.
        // SAFETY: flock on a valid descriptor owned by `f`.
        while unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "{} stays locked",
                dir.display()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// A testkit server holding `pods` Pods over 10 namespaces, with a watch history long
/// enough (100,000 events) for a restarted client to resume through what it missed.
pub async fn pod_server(pods: usize) -> kube_persist_testkit::TestServer {
    let server =
        kube_persist_testkit::TestServer::start_with(kube_persist_testkit::ServerOptions {
            history: 100_000,
            ..Default::default()
        })
        .await;
    server.handle().seed_pods(pods, 10);
    server
}

/// Whether this process runs as root (tmpfs mounts need it).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

fn run_cmd(cmd: &str, args: &[&str]) -> Result<(), String> {
    let out = std::process::Command::new(cmd)
        .args(args)
        .output()
        .map_err(|e| format!("{cmd}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{cmd} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// A tmpfs mounted for the test; unmounted when dropped (lazily if busy).
pub struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    pub fn mount(dir: &std::path::Path, opts: &str) -> Result<Tmpfs, String> {
        std::fs::create_dir_all(dir).unwrap();
        let d = dir.to_str().unwrap();
        run_cmd("mount", &["-t", "tmpfs", "-o", opts, "tmpfs", d])?;
        Ok(Tmpfs(dir.to_path_buf()))
    }

    /// Mount it again with `opts` (e.g. a new size), keeping its files.
    pub fn remount(&self, opts: &str) {
        let o = format!("remount,{opts}");
        run_cmd("mount", &["-o", &o, self.0.to_str().unwrap()]).expect("remount");
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let d = self.0.to_str().unwrap();
        if run_cmd("umount", &[d]).is_err() {
            let _ = run_cmd("umount", &["-l", d]);
        }
    }
}

/// One HTTP/1.1 GET to `addr` (`host:port`): (status code, body).
pub async fn http_get(addr: &str, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut conn) = tokio::net::TcpStream::connect(addr).await else {
        return (0, String::new());
    };
    let req = format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n");
    if conn.write_all(req.as_bytes()).await.is_err() {
        return (0, String::new());
    }
    let mut resp = String::new();
    let _ = conn.read_to_string(&mut resp).await;
    let code = resp
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = resp
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (code, body)
}
