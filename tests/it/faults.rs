//! Crash safety, faults and bad input (issue 6, parts 2-4), over real HTTP against testkit
//! and real stores in temporary directories (each engine: `redb::…`, `sled::…`):
//!
//! - `model_random_faults_store_equals_server`: a seeded random sequence of server changes,
//!   dropped and closed watch streams, 410s, expired continue tokens, 5xx answers and store
//!   restarts (paginated or streaming lists), checked after each settle: store, `Reader::len`
//!   and the event stream all equal the server, object by object. Prints
//!   `model: seed S ... D divergences`; `KP_MODEL_SEED` replays a run, `KP_MODEL_STEPS` scales it.
//! - storage faults: a second process gets `Error::Locked`; garbage and truncated files give
//!   `Error::Corrupt` (or, for truncation, a store that opens and converges); `Db::destroy`;
//!   a full disk (`Error::DiskFull`) and an unwritable directory (root: tmpfs mounts).
//! - bad input from the server: objects without name or resourceVersion, with a non-UTF-8
//!   name, malformed JSON, in LIST pages and watch events; a 1.5 MiB object.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use crate::common::{
    self, Engine, Fixture, Tmpfs, child_engine, converge, diff, env_num, init_tracing, is_root,
    server_versions, spawn_self, store_versions, try_open_db,
};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::{Api, Resource};
use kube_persist::{Db, DbConfig, Error, Event, Reader, StreamConfig, SyncPhase};
use kube_persist_testkit::{ResourceType, ServerHandle, ServerOptions, TestServer, Verb, make_pod};
use rand::{Rng, SeedableRng, rngs::StdRng};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

fn cfg() -> StreamConfig {
    StreamConfig::default()
        .backoff(Duration::from_millis(10), Duration::from_millis(100))
        .relist_jitter(Duration::from_millis(5))
}

fn key_of<K: Resource>(k: &K) -> String {
    let m = k.meta();
    match &m.namespace {
        Some(ns) => format!("{ns}/{}", m.name.clone().unwrap_or_default()),
        None => m.name.clone().unwrap_or_default(),
    }
}

/// An event as the tests see it: a keyed change with its resourceVersion, or a typed error.
#[derive(Debug)]
enum Seen {
    Put(String, String),
    Delete(String),
    InitDone,
    Other,
    Error(Error),
}

/// A store opened on a directory with its watcher's event stream driven on a task.
struct Client<K> {
    db: Db,
    reader: Reader<K>,
    task: tokio::task::JoinHandle<()>,
    rx: mpsc::UnboundedReceiver<Seen>,
}

fn open_client<K>(
    engine: Engine,
    dir: &Path,
    api: Api<K>,
    config: StreamConfig,
) -> Result<Client<K>, Error>
where
    K: Resource + DeserializeOwned + Clone + std::fmt::Debug + Send + Sync + 'static,
    K::DynamicType: Default,
{
    client_on(try_open_db(engine, dir)?, api, config)
}

/// A store of stream `s` in `db`, with its watcher's event stream driven on a task.
fn client_on<K>(db: Db, api: Api<K>, config: StreamConfig) -> Result<Client<K>, Error>
where
    K: Resource + DeserializeOwned + Clone + std::fmt::Debug + Send + Sync + 'static,
    K::DynamicType: Default,
{
    let (reader, watcher) = db.store("s", api, config)?;
    let (tx, rx) = mpsc::unbounded_channel();
    let task = tokio::spawn(async move {
        let mut s = std::pin::pin!(watcher.stream());
        while let Some(ev) = s.next().await {
            let seen = match ev {
                Ok(Event::Apply(k)) | Ok(Event::InitApply(k)) => Seen::Put(
                    key_of(&k),
                    k.meta().resource_version.clone().unwrap_or_default(),
                ),
                Ok(Event::Delete(k)) => Seen::Delete(key_of(&k)),
                Ok(Event::InitDone) => Seen::InitDone,
                Ok(_) => Seen::Other,
                Err(e) => Seen::Error(e),
            };
            if tx.send(seen).is_err() {
                return;
            }
        }
    });
    Ok(Client {
        db,
        reader,
        task,
        rx,
    })
}

impl<K> Client<K> {
    /// Stop the watcher task and drop every handle on the store (so it can be reopened).
    async fn stop(self) {
        self.task.abort();
        let _ = self.task.await;
        drop(self.reader);
        drop(self.db);
    }

    /// Wait for an event matching `pred` (panics after 60 s), returning the events seen.
    async fn until(&mut self, pred: impl Fn(&Seen) -> bool) -> Vec<Seen> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        let mut seen = Vec::new();
        loop {
            match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some(ev)) => {
                    let done = pred(&ev);
                    seen.push(ev);
                    if done {
                        return seen;
                    }
                }
                Ok(None) => panic!("event stream ended: {seen:?}"),
                Err(_) => panic!("timed out waiting for an event; seen: {seen:?}"),
            }
        }
    }
}

fn pods_client(engine: Engine, dir: &Path, url: &str, config: StreamConfig) -> Client<Pod> {
    let client = kube_persist_testkit::client_for_opts(url, None, false);
    open_client(engine, dir, Api::<Pod>::all(client), config).expect("store opens")
}

/// Like `pods_client`, for a store that this process closed a moment ago. sled releases its
/// directory lock lazily after the last handle is dropped (file handles are freed by its
/// epoch-based reclamation), so an immediate reopen can see `Locked` for a while: retry
/// for up to 5 s and return how long the lock outlived the handles.
async fn reopen_pods_client(
    engine: Engine,
    dir: &Path,
    url: &str,
    config: StreamConfig,
) -> (Client<Pod>, Option<Duration>) {
    let t0 = Instant::now();
    let mut locked = false;
    loop {
        let client = kube_persist_testkit::client_for_opts(url, None, false);
        match open_client(engine, dir, Api::<Pod>::all(client), config.clone()) {
            Ok(c) => return (c, locked.then(|| t0.elapsed())),
            Err(Error::Locked { .. }) if t0.elapsed() < Duration::from_secs(5) => {
                locked = true;
                tokio::time::sleep(Duration::from_millis(5)).await
            }
            Err(e) => panic!("store reopens: {e:?} after {:?}", t0.elapsed()),
        }
    }
}

/// `ns/name` → resourceVersion of the server's pods (cheap: no JSON parsing).
fn server_pods(h: &ServerHandle) -> BTreeMap<String, String> {
    h.resource_versions(&ResourceType::pods())
        .into_iter()
        .map(|((ns, name), rv)| (format!("{ns}/{name}"), rv))
        .collect()
}

// ---------------------------------------------------------------------------------------
// A. Model-based test
// ---------------------------------------------------------------------------------------

#[derive(Default)]
struct Tally {
    ops: BTreeMap<&'static str, usize>,
    errors: usize,
    fatal: Vec<String>,
    divergences: Vec<String>,
    relists: u64,
    resumes: u64,
    bad_objects: u64,
    streaming_opens: usize,
    settles: usize,
    /// Reopens that found the lock still held after every handle was dropped, and how long.
    late_unlocks: Vec<Duration>,
}

/// Apply the events received so far to the event model.
fn absorb(c: &mut Client<Pod>, model: &mut BTreeMap<String, String>, t: &mut Tally) {
    while let Ok(ev) = c.rx.try_recv() {
        match ev {
            Seen::Put(k, rv) => {
                model.insert(k, rv);
            }
            Seen::Delete(k) => {
                model.remove(&k);
            }
            Seen::Error(e) => {
                t.errors += 1;
                if !e.is_transient() {
                    t.fatal.push(e.to_string());
                }
            }
            Seen::InitDone | Seen::Other => {}
        }
    }
}

/// Wait until store, `Reader::len`, phase and event model all equal the server.
async fn settle(
    c: &mut Client<Pod>,
    h: &ServerHandle,
    model: &mut BTreeMap<String, String>,
    t: &mut Tally,
) -> Result<(), String> {
    t.settles += 1;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        absorb(c, model, t);
        let server = server_pods(h);
        let store: Result<BTreeMap<String, String>, String> = c
            .reader
            .iter()
            .map(|p| {
                p.map(|p| {
                    (
                        key_of(&*p),
                        p.metadata.resource_version.clone().unwrap_or_default(),
                    )
                })
                .map_err(|e| format!("store read failed: {e}"))
            })
            .collect();
        let store = store?;
        let synced = c.reader.phase() == SyncPhase::Synced;
        if synced && store == server && *model == server && c.reader.len() == server.len() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "phase {:?}, len {}; {}; {}",
                c.reader.phase(),
                c.reader.len(),
                diff("store", &store, &server),
                diff("events", model, &server)
            ));
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

fn random_pod_key(h: &ServerHandle, rng: &mut StdRng) -> Option<(String, String)> {
    let keys: Vec<_> = h
        .resource_versions(&ResourceType::pods())
        .into_keys()
        .collect();
    (!keys.is_empty()).then(|| keys[rng.random_range(0..keys.len())].clone())
}

/// Random faults against the model "store == server after each settle" (see the module docs).
async fn model_random_faults_store_equals_server(engine: Engine) {
    init_tracing();
    let seed: u64 = env_num("KP_MODEL_SEED").unwrap_or_else(|| rand::rng().random());
    let steps: usize = env_num("KP_MODEL_STEPS").unwrap_or(250);
    println!("model: seed {seed} (replay with KP_MODEL_SEED={seed}), {steps} steps");
    let mut rng = StdRng::seed_from_u64(seed);
    let server = TestServer::start_with(ServerOptions {
        history: 100_000,
        bookmark_interval: Duration::from_millis(100),
        ..ServerOptions::default()
    })
    .await;
    let h = server.handle();
    let rt = ResourceType::pods();
    let url = server.url();
    h.seed_pods(300, 3);
    let dir = tempfile::tempdir().unwrap();
    let mut t = Tally::default();

    let config = |rng: &mut StdRng, t: &mut Tally| {
        let page = [25u32, 60, 500][rng.random_range(0..3)];
        let streaming = rng.random_bool(0.35);
        t.streaming_opens += usize::from(streaming);
        let c = if streaming {
            cfg().streaming_lists()
        } else {
            cfg()
        };
        c.page_size(page)
    };
    let mut c = pods_client(engine, dir.path(), &url, config(&mut rng, &mut t));
    let mut model = BTreeMap::new();
    let started = Instant::now();
    for step in 0..steps {
        let op = rng.random_range(0..100);
        let name = match op {
            0..=21 => {
                let (u, cr, d) = (
                    rng.random_range(0..8),
                    rng.random_range(0..4),
                    rng.random_range(0..3),
                );
                h.churn(u, cr, d, rng.random());
                "churn"
            }
            22..=26 => {
                let ns = format!("ns-{}", rng.random_range(0..3));
                h.apply(&rt, make_pod(&ns, &format!("m-{step}"), rng.random()));
                "create"
            }
            27..=31 => {
                if let Some((ns, name)) = random_pod_key(&h, &mut rng) {
                    let mut o = h.get(&rt, Some(&ns), &name).unwrap();
                    o["metadata"]["labels"]["model"] = step.to_string().into();
                    h.replace(&rt, o).unwrap();
                }
                "update"
            }
            32..=36 => {
                if let Some((ns, name)) = random_pod_key(&h, &mut rng) {
                    h.delete(&rt, Some(&ns), &name);
                }
                "delete"
            }
            37..=44 => {
                h.faults().drop_watch_after(rng.random_range(0..5));
                h.churn(rng.random_range(2..10), 1, 1, rng.random());
                "drop_watch_after"
            }
            45..=50 => {
                h.faults().close_watches();
                h.churn(2, 1, 1, rng.random());
                "close_watches"
            }
            51..=57 => {
                h.churn(
                    rng.random_range(0..6),
                    1,
                    rng.random_range(0..3),
                    rng.random(),
                );
                h.compact();
                h.faults().gone_next_watch();
                h.faults().close_watches();
                "gone_410"
            }
            58..=64 => {
                // A relist slowed down page by page; compaction mid-list expires its token.
                h.faults()
                    .page_delay(Duration::from_millis(rng.random_range(20..60)));
                h.faults().gone_next_watch();
                h.faults().close_watches();
                tokio::time::sleep(Duration::from_millis(rng.random_range(10..150))).await;
                h.churn(3, 1, 2, rng.random());
                h.compact();
                tokio::time::sleep(Duration::from_millis(rng.random_range(0..100))).await;
                h.faults().page_delay(Duration::ZERO);
                "expired_continue"
            }
            65..=74 => {
                let verb = if rng.random_bool(0.5) {
                    Verb::List
                } else {
                    Verb::Watch
                };
                let status = [500u16, 503, 504][rng.random_range(0..3)];
                h.faults().fail_next(verb, status, rng.random_range(1..4));
                if verb == Verb::List {
                    h.faults().gone_next_watch();
                }
                h.faults().close_watches();
                h.churn(2, 1, 1, rng.random());
                "5xx"
            }
            75..=89 => {
                // Restart, sometimes in the middle of a relist, sometimes with changes and
                // compaction while down.
                if rng.random_bool(0.3) {
                    h.faults().gone_next_watch();
                    h.faults().close_watches();
                    tokio::time::sleep(Duration::from_millis(rng.random_range(0..80))).await;
                }
                let s = c.reader.stats();
                (t.relists, t.resumes, t.bad_objects) = (
                    t.relists + s.relists,
                    t.resumes + s.resumes,
                    t.bad_objects + s.bad_objects,
                );
                absorb(&mut c, &mut model, &mut t);
                c.stop().await;
                if rng.random_bool(0.5) {
                    h.churn(rng.random_range(0..10), 2, 2, rng.random());
                }
                if rng.random_bool(0.3) {
                    h.compact();
                }
                let waited;
                (c, waited) =
                    reopen_pods_client(engine, dir.path(), &url, config(&mut rng, &mut t)).await;
                t.late_unlocks.extend(waited);
                // Events are at most once across a restart: the model restarts from the store.
                model = store_versions(&c.reader);
                "restart"
            }
            90..=94 => {
                h.churn(rng.random_range(40..120), 5, 5, rng.random());
                "burst"
            }
            _ => {
                tokio::time::sleep(Duration::from_millis(250)).await;
                "idle"
            }
        };
        *t.ops.entry(name).or_default() += 1;
        if let Err(d) = settle(&mut c, &h, &mut model, &mut t).await {
            println!("model: step {step} ({name}): DIVERGENCE: {d}");
            t.divergences.push(format!("step {step} ({name}): {d}"));
            // Resynchronise the model to go on looking for other divergences.
            model = store_versions(&c.reader);
        }
    }
    let s = c.reader.stats();
    t.relists += s.relists;
    t.resumes += s.resumes;
    t.bad_objects += s.bad_objects;
    c.stop().await;
    println!(
        "model: ops {:?}; {} settles, {} opens with streaming lists, {} relists, {} resumes, \
         {} errors (all retried), {} non-transient errors, in {:.1} s",
        t.ops,
        t.settles,
        t.streaming_opens,
        t.relists,
        t.resumes,
        t.errors,
        t.fatal.len(),
        started.elapsed().as_secs_f64()
    );
    println!(
        "model: {} of {} reopens waited for sled to release its lock: {:?}",
        t.late_unlocks.len(),
        t.ops.get("restart").copied().unwrap_or(0),
        t.late_unlocks
    );
    println!("model: {steps} steps, {} divergences", t.divergences.len());
    assert!(t.divergences.is_empty(), "seed {seed}: {:?}", t.divergences);
    assert!(
        t.fatal.is_empty(),
        "seed {seed}: non-transient errors {:?}",
        t.fatal
    );
    assert_eq!(t.bad_objects, 0, "no bad object was injected");
    if steps >= 100 {
        // The faults were really exercised (else this test proves little).
        let restarts = t.ops.get("restart").copied().unwrap_or(0);
        assert!(
            restarts > 0 && t.resumes > 0,
            "seed {seed}: no warm restart"
        );
        assert!(t.relists > 0, "seed {seed}: no relist");
        assert!(t.errors > 0, "seed {seed}: no error was seen");
    }
}

// ---------------------------------------------------------------------------------------
// B1. Lock held by another process
// ---------------------------------------------------------------------------------------

const LOCK_CHILD_ENV: &str = "KP_FAULTS_LOCK_DIR";

/// The child process of `second_process_gets_locked_naming_the_path`: holds the store open
/// until killed.
#[test]
#[ignore = "child process of second_process_gets_locked_naming_the_path"]
fn lock_holder_child() {
    let dir = std::env::var(LOCK_CHILD_ENV).expect("child mode needs KP_FAULTS_LOCK_DIR");
    let db = try_open_db(child_engine(), &dir).expect("child opens the store");
    println!("holding {dir}");
    loop {
        std::hint::black_box(&db);
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// Kills and reaps a child process when dropped.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn second_process_gets_locked_naming_the_path(engine: Engine) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let mut child = spawn_self(
        "faults::lock_holder_child",
        &[
            (LOCK_CHILD_ENV, path.as_os_str()),
            (common::ENGINE_ENV, engine.name().as_ref()),
        ],
    );
    let out = child.stdout.take().unwrap();
    let guard = ChildGuard(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if line.contains("holding ") {
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(60))
        .expect("the child opened the store");

    match try_open_db(engine, &path) {
        Err(Error::Locked { path: p, .. }) => assert_eq!(p, path),
        other => panic!("expected Locked, got {other:?}"),
    }
    let msg = try_open_db(engine, &path).unwrap_err().to_string();
    assert!(msg.contains(path.to_str().unwrap()), "{msg}");
    match Db::destroy(&path) {
        Err(Error::Locked { path: p, .. }) => assert_eq!(p, path),
        other => panic!("destroy of a store open elsewhere: expected Locked, got {other:?}"),
    }
    assert!(
        path.join(engine_files(engine)[0]).is_file(),
        "a locked store was not removed"
    );

    drop(guard); // SIGKILL: the lock dies with the process
    try_open_db(engine, &path).expect("opens once the other process is gone");
}

// ---------------------------------------------------------------------------------------
// B2. Damaged files, and Db::destroy
// ---------------------------------------------------------------------------------------

/// The engine's own files: the one holding the data first.
fn engine_files(engine: Engine) -> &'static [&'static str] {
    match engine {
        Engine::Sled => &["db", "conf"],
        _ => &["data.redb"],
    }
}

/// Sync `n` pods into a fresh store at `path` and close it.
async fn synced_store(engine: Engine, server: &TestServer, path: &Path) {
    let mut c = pods_client(engine, path, &server.url(), cfg().page_size(200));
    c.until(|e| matches!(e, Seen::InitDone)).await;
    c.db.flush().unwrap();
    c.stop().await;
}

/// A server with 800 Pods, and a synced and closed store of them at `<dir>/pristine`.
async fn pristine_store(engine: Engine) -> (TestServer, tempfile::TempDir, PathBuf) {
    init_tracing();
    let server = TestServer::start().await;
    server.handle().seed_pods(800, 4);
    let dir = tempfile::tempdir().unwrap();
    let pristine = dir.path().join("pristine");
    synced_store(engine, &server, &pristine).await;
    (server, dir, pristine)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let target = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), target).unwrap();
        }
    }
}

/// Open a (possibly damaged) store; if it opens, sync it and check it equals the server.
/// Returns `Err(detail)` for `Error::Corrupt` naming `path`; panics on anything else.
async fn open_damaged(engine: Engine, server: &TestServer, path: &Path) -> Result<(), String> {
    let h = server.handle();
    let client = kube_persist_testkit::client_for_opts(&server.url(), None, false);
    let opened = open_client(engine, path, Api::<Pod>::all(client), cfg().page_size(200));
    let c = match opened {
        Err(Error::Corrupt {
            path: p, detail, ..
        }) => {
            assert_eq!(p, path, "Corrupt names the store path");
            return Err(detail);
        }
        Err(e) => panic!(
            "damaged store at {}: expected Corrupt, got {e:?}",
            path.display()
        ),
        Ok(c) => c,
    };
    // A store that opens must not hold damaged records, and must converge.
    for p in c.reader.iter() {
        if let Err(e) = p {
            panic!("a store that opened has an unreadable record: {e}");
        }
    }
    converge(&c.reader, &h, &ResourceType::pods()).await;
    c.stop().await;
    Ok(())
}

async fn garbage_store_files_are_corrupt_naming_the_path_and_destroy_wipes(engine: Engine) {
    let (server, dir, pristine) = pristine_store(engine).await;
    let h = server.handle();
    let mut rng = StdRng::seed_from_u64(6);
    for &file in engine_files(engine).iter().chain(&["engine"]) {
        let path = dir.path().join(format!("garbage-{file}"));
        copy_dir(&pristine, &path);
        let len = std::fs::metadata(path.join(file)).unwrap().len() as usize;
        let garbage: Vec<u8> = (0..len).map(|_| rng.random()).collect();
        std::fs::write(path.join(file), garbage).unwrap();
        let detail = open_damaged(engine, &server, &path)
            .await
            .expect_err("a garbage-filled file is Corrupt");
        println!("{engine}: garbage {file}: Corrupt: {detail}");
        // The error tells what to do.
        let msg = try_open_db(engine, &path).unwrap_err().to_string();
        assert!(
            msg.contains(path.to_str().unwrap()) && msg.contains("remove"),
            "{msg}"
        );

        // Wipe, and the next start lists from scratch.
        Db::destroy(&path).expect("destroy a corrupt store");
        assert!(!path.exists());
        h.reset_counts();
        let mut c = pods_client(engine, &path, &server.url(), cfg().page_size(200));
        c.until(|e| matches!(e, Seen::InitDone)).await;
        converge(&c.reader, &h, &ResourceType::pods()).await;
        assert!(h.counts().list >= 4, "a wiped store lists again");
        c.stop().await;
    }
    // The pristine copy opens and equals the server: the damage was the cause.
    open_damaged(engine, &server, &pristine).await.unwrap();
}

/// Random 4 KiB blocks in the middle of a cleanly closed store's data file overwritten:
/// engines trust such a file, so damage shows up when reading. Every open and every read
/// must be a value or an error (`Corrupt`, `Decode`), never a panic; `Db::destroy` then
/// wipes the store and the next start lists and converges.
async fn damaged_blocks_read_as_errors_never_panics(engine: Engine) {
    let (server, dir, pristine) = pristine_store(engine).await;
    let h = server.handle();
    let data = engine_files(engine)[0];
    let len = std::fs::metadata(pristine.join(data)).unwrap().len();
    let mut rng = StdRng::seed_from_u64(11);
    for round in 0..4 {
        let path = dir.path().join(format!("damaged-{round}"));
        copy_dir(&pristine, &path);
        let mut bytes = std::fs::read(path.join(data)).unwrap();
        for _ in 0..8 {
            let at = rng.random_range(len / 8..len - 4096) as usize;
            rng.fill(&mut bytes[at..at + 4096]);
        }
        std::fs::write(path.join(data), bytes).unwrap();
        let (mut values, mut errors) = (0usize, 0usize);
        let mut tally = |r: Result<bool, Error>| match r {
            Ok(_) => values += 1,
            Err(Error::Corrupt { .. } | Error::Decode { .. }) => errors += 1,
            Err(e) => panic!("{engine}: damaged store: unexpected error {e:?}"),
        };
        match try_open_db(engine, &path) {
            Err(e) => tally(Err(e)),
            Ok(db) => {
                let api = Api::<Pod>::all(server.client());
                match db.store("s", api, cfg()) {
                    Err(e) => tally(Err(e)),
                    Ok((reader, _watcher)) => {
                        for p in reader.iter() {
                            tally(p.map(|_| true));
                        }
                        for o in h.list(&ResourceType::pods()) {
                            let ns = o["metadata"]["namespace"].as_str().unwrap();
                            let name = o["metadata"]["name"].as_str().unwrap();
                            tally(reader.get_named(Some(ns), name).map(|p| p.is_some()));
                        }
                    }
                }
            }
        }
        println!("{engine}: damaged blocks, round {round}: {values} values, {errors} errors");
        Db::destroy(&path).expect("destroy a damaged store");
        let c = pods_client(engine, &path, &server.url(), cfg().page_size(200));
        converge(&c.reader, &h, &ResourceType::pods()).await;
        c.stop().await;
    }
}

async fn truncated_store_file_is_corrupt_or_a_consistent_prefix(engine: Engine) {
    let (server, dir, pristine) = pristine_store(engine).await;
    let h = server.handle();
    h.churn(20, 5, 5, 1); // the server moved on: a resumed store must catch up
    let data = engine_files(engine)[0];
    let len = std::fs::metadata(pristine.join(data)).unwrap().len();
    let mut outcomes = Vec::new();
    for (i, cut) in [0, len / 20, len / 3, len * 2 / 3, len - 4096, len - 1]
        .into_iter()
        .enumerate()
    {
        let path = dir.path().join(format!("trunc-{i}"));
        copy_dir(&pristine, &path);
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(path.join(data))
            .unwrap();
        f.set_len(cut).unwrap();
        drop(f);
        let outcome = match open_damaged(engine, &server, &path).await {
            Ok(()) => "opens and converges".to_string(),
            Err(detail) => format!("Corrupt ({detail})"),
        };
        println!("{engine}: truncated {data} to {cut} of {len} bytes: {outcome}");
        outcomes.push(outcome);
    }
    assert_eq!(outcomes.len(), 6);
}

/// A store directory opened with the other engine is `EngineMismatch`, and nothing in it is
/// touched: reopened with its own engine it resumes (no LIST) with every object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_other_engine_is_a_clear_error_not_a_wipe() {
    let fx = Fixture::with_pods(300, 3).await;
    let h = &fx.h;
    for (wrote, other) in [(Engine::Sled, Engine::Redb), (Engine::Redb, Engine::Sled)] {
        let path = fx.path().join(wrote.name());
        synced_store(wrote, &fx.server, &path).await;
        assert_eq!(Engine::of_store(&path).unwrap(), Some(wrote));
        match try_open_db(other, &path) {
            Err(e @ Error::EngineMismatch { .. }) => {
                let msg = e.to_string();
                assert!(msg.contains(path.to_str().unwrap()), "{msg}");
                assert!(
                    msg.contains(wrote.name()) && msg.contains(other.name()),
                    "{msg}"
                );
            }
            res => {
                panic!("{wrote} store opened with {other}: expected EngineMismatch, got {res:?}")
            }
        }
        h.reset_counts();
        let mut c = pods_client(wrote, &path, &fx.server.url(), cfg().page_size(200));
        converge(&c.reader, h, &ResourceType::pods()).await;
        assert_eq!(h.counts().list, 0, "{wrote} store resumed without a LIST");
        assert_eq!(c.reader.len(), 300);
        c.until(|_| true).await;
        c.stop().await;
    }
}

/// New stores are redb; an existing store is opened with the engine recorded in it. A sled
/// store (made with an explicit `Engine::Sled`) is reopened by `Db::open` as sled with every
/// object and resumes without a LIST, also when it predates the `engine` file; only an
/// explicit `Engine::Redb` is `EngineMismatch`, and it leaves the store as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_stores_are_redb_and_existing_ones_keep_their_engine() {
    let fx = Fixture::with_pods(300, 3).await;
    let h = &fx.h;
    let api = || {
        Api::<Pod>::all(kube_persist_testkit::client_for_opts(
            &fx.server.url(),
            None,
            false,
        ))
    };

    // New directories without an explicit engine: redb, recorded in the directory.
    assert_eq!(Engine::default(), Engine::Redb);
    assert_eq!(DbConfig::default().get_engine(), None);
    for (i, db) in [
        Db::open(fx.path().join("new-0")),
        Db::open_with(fx.path().join("new-1"), DbConfig::default()),
    ]
    .into_iter()
    .enumerate()
    {
        let db = db.unwrap();
        assert_eq!(db.engine(), Engine::Redb);
        drop(db);
        let path = fx.path().join(format!("new-{i}"));
        assert_eq!(Engine::of_store(&path).unwrap(), Some(Engine::Redb));
        assert!(path.join("data.redb").is_file());
    }
    // ... and they reopen as redb with no choice or with an explicit Engine::Redb.
    assert_eq!(
        Db::open(fx.path().join("new-0")).unwrap().engine(),
        Engine::Redb
    );
    let redb_cfg = DbConfig::default().engine(Engine::Redb);
    assert_eq!(redb_cfg.get_engine(), Some(Engine::Redb));
    let db = Db::open_with(fx.path().join("new-1"), redb_cfg.clone()).unwrap();
    assert_eq!(db.engine(), Engine::Redb);
    drop(db);

    // A sled store, asked for explicitly.
    let path = fx.path().join("sled");
    synced_store(Engine::Sled, &fx.server, &path).await;
    assert_eq!(Engine::of_store(&path).unwrap(), Some(Engine::Sled));
    let files = |p: &Path| {
        let mut names: Vec<_> = std::fs::read_dir(p)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        names
    };
    let before = files(&path);

    // An explicit request for redb: EngineMismatch, and nothing in the store changes.
    match Db::open_with(&path, redb_cfg) {
        Err(Error::EngineMismatch {
            stored: Engine::Sled,
            requested: Engine::Redb,
            path: p,
            ..
        }) => assert_eq!(p, path),
        other => panic!("sled store opened with an explicit redb: {other:?}"),
    }
    assert_eq!(files(&path), before, "EngineMismatch touched nothing");
    assert!(!path.join("data.redb").exists());

    // No explicit engine: sled, every object, resumed without a LIST. Twice: the second
    // time without the `engine` file, as a store written before it existed (told by its
    // files: a sled store).
    for without_engine_file in [false, true] {
        if without_engine_file {
            std::fs::remove_file(path.join("engine")).unwrap();
        }
        h.reset_counts();
        let db = Db::open(&path).unwrap();
        assert_eq!(db.engine(), Engine::Sled);
        let mut c = client_on(db, api(), cfg().page_size(200)).unwrap();
        converge(&c.reader, h, &ResourceType::pods()).await;
        assert_eq!(h.counts().list, 0, "the sled store resumed without a LIST");
        assert_eq!(c.reader.len(), 300);
        c.until(|_| true).await;
        c.stop().await;
        assert_eq!(Engine::of_store(&path).unwrap(), Some(Engine::Sled));
        assert!(
            !path.join("data.redb").exists(),
            "no redb file beside sled's"
        );
    }
}

fn destroy_refuses_what_is_not_a_store(engine: Engine) {
    let dir = tempfile::tempdir().unwrap();
    // Absent: nothing to do.
    Db::destroy(dir.path().join("absent")).unwrap();
    // Empty directory, or one without a store's files: refused and left alone.
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    assert!(matches!(Db::destroy(&empty), Err(Error::NoStore { path, .. }) if path == empty));
    assert!(empty.is_dir());
    // A store with a foreign file in it: refused, nothing removed.
    let store = dir.path().join("store");
    drop(try_open_db(engine, &store).unwrap());
    std::fs::write(store.join("notes.txt"), "mine").unwrap();
    match Db::destroy(&store) {
        Err(e @ Error::NotAStore { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.contains("notes.txt") && msg.contains(store.to_str().unwrap()),
                "{msg}"
            )
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(store.join(engine_files(engine)[0]).is_file() && store.join("notes.txt").is_file());
    // Open in this process: Locked.
    std::fs::remove_file(store.join("notes.txt")).unwrap();
    let db = try_open_db(engine, &store).unwrap();
    assert!(matches!(Db::destroy(&store), Err(Error::Locked { .. })));
    drop(db);
    Db::destroy(&store).unwrap();
    assert!(!store.exists());
}

// ---------------------------------------------------------------------------------------
// B3, B4. Full disk and unwritable directory (tmpfs mounts: root only)
// ---------------------------------------------------------------------------------------

/// Root only (tmpfs mounts); prints a skip message otherwise. A 4 MiB tmpfs fills up during
/// the first sync: the watcher's stream yields `Error::DiskFull` naming the store. Then the
/// tmpfs grows to 256 MiB and the store recovers to equal the server.
async fn full_disk_is_disk_full_then_recovers_as_root(engine: Engine) {
    init_tracing();
    if !is_root() {
        println!("SKIPPED full_disk_is_disk_full_then_recovers_as_root: needs root (tmpfs mount)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().join("mnt");
    let fs = match Tmpfs::mount(&mnt, "size=4m") {
        Ok(m) => m,
        Err(e) => {
            println!("SKIPPED full_disk_is_disk_full_then_recovers_as_root: cannot mount: {e}");
            return;
        }
    };
    let server = TestServer::start().await;
    let h = server.handle();
    let rt = ResourceType::pods();
    h.seed_pods(3000, 4); // ~15 MB of JSON
    let path = mnt.join("store");
    let mut c = pods_client(engine, &path, &server.url(), cfg().page_size(200));
    let seen = c
        .until(|e| matches!(e, Seen::Error(Error::DiskFull { .. })))
        .await;
    match seen.last() {
        Some(Seen::Error(Error::DiskFull { path: p, .. })) => assert_eq!(*p, path),
        other => panic!("{other:?}"),
    }
    let written = c.reader.stats().objects_written;
    println!("disk full: {engine}: DiskFull after {written} objects written");
    // sled writes each batch through to its log, so the tmpfs fills before the list ends.
    // redb keeps non-durable commits in memory until its periodic durable commit, which is
    // where it meets the full disk (possibly after the whole list was committed).
    assert!(written < 3000 || engine == Engine::Redb);

    // Space returns. A change on the server needs a successful write to show up in the
    // store, so equality below proves the store writes again (not only that reads work).
    fs.remount("size=256m");
    h.churn(3, 1, 1, 8);
    let t0 = Instant::now();
    let mut in_place = false;
    let mut still_full = 0;
    while t0.elapsed() < Duration::from_secs(5) {
        while let Ok(ev) = c.rx.try_recv() {
            if matches!(ev, Seen::Error(Error::DiskFull { .. })) {
                still_full += 1;
            }
        }
        // After a failed write redb refuses reads too until reopened: check before comparing.
        if c.reader.phase() == SyncPhase::Synced
            && c.reader.iter().all(|p| p.is_ok())
            && store_versions(&c.reader) == server_versions(&h, &rt)
        {
            in_place = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "disk full: after space returned: recovered in place: {in_place}; \
         DiskFull errors in the next 5 s: {still_full}"
    );
    if !in_place {
        // sled keeps the first I/O error of its log ("global error") until it is reopened;
        // redb answers every later transaction with that error (`PreviousIo`) until then.
        assert!(still_full > 0, "not recovered, yet no error reported");
        c.stop().await;
        c = reopen_pods_client(engine, &path, &server.url(), cfg().page_size(200))
            .await
            .0;
    }
    converge(&c.reader, &h, &rt).await;
    h.churn(10, 3, 3, 9);
    converge(&c.reader, &h, &rt).await;
    c.stop().await;
    drop(fs);
}

/// Root: a read-only tmpfs (chmod does not stop root). Otherwise: chmod 0500.
async fn unwritable_directory_is_a_clear_error_naming_the_path(engine: Engine) {
    let fx = Fixture::with_pods(300, 2).await;
    let h = &fx.h;
    let mnt = fx.path().join("mnt");
    let check = |path: &Path| {
        let err = match try_open_db(engine, path) {
            Err(e) => e,
            Ok(_) => panic!("{} opened although unwritable", path.display()),
        };
        let msg = err.to_string();
        println!("unwritable: {msg}");
        assert!(matches!(err, Error::Io { .. }), "{err:?}");
        assert!(msg.contains(path.to_str().unwrap()), "{msg}");
    };
    let existing = mnt.join("store");
    if is_root() {
        let fs = match Tmpfs::mount(&mnt, "size=64m") {
            Ok(m) => m,
            Err(e) => {
                println!("SKIPPED unwritable_directory_is_a_clear_error_naming_the_path: {e}");
                return;
            }
        };
        synced_store(engine, &fx.server, &existing).await;
        fs.remount("ro");
        check(&existing); // an existing store on a read-only file system
        check(&mnt.join("new")); // a new store cannot be created
        fs.remount("rw");
        // Nothing was lost.
        let mut c = pods_client(engine, &existing, &fx.server.url(), cfg());
        converge(&c.reader, h, &ResourceType::pods()).await;
        assert_eq!(c.reader.stats().resumes, 1);
        c.until(|e| matches!(e, Seen::Other)).await;
        c.stop().await;
        drop(fs);
        // A read-only tmpfs from the start.
        let ro = fx.path().join("ro");
        let _fs = match Tmpfs::mount(&ro, "ro,size=1m") {
            Ok(m) => m,
            Err(e) => panic!("{e}"),
        };
        check(&ro.join("store"));
    } else {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir_all(&mnt).unwrap();
        std::fs::set_permissions(&mnt, std::fs::Permissions::from_mode(0o500)).unwrap();
        check(&mnt.join("new"));
        std::fs::set_permissions(&mnt, std::fs::Permissions::from_mode(0o700)).unwrap();
    }
}

// ---------------------------------------------------------------------------------------
// C. Bad input from the server
// ---------------------------------------------------------------------------------------

/// Bad objects: no name, no resourceVersion, a name with invalid UTF-8 bytes.
fn bad_objects(tag: &str) -> Vec<Vec<u8>> {
    let mut non_utf8 = format!(
        r#"{{"apiVersion":"v1","kind":"Pod","metadata":{{"namespace":"ns-0","resourceVersion":"7","name":"bad-{tag}-"#
    )
    .into_bytes();
    non_utf8.extend_from_slice(b"\xff\xfe\xc3\x28");
    non_utf8.extend_from_slice(br#""},"spec":{"containers":[]}}"#);
    vec![
        br#"{"apiVersion":"v1","kind":"Pod","metadata":{"namespace":"ns-0","resourceVersion":"7"},"spec":{"containers":[]}}"#.to_vec(),
        format!(r#"{{"apiVersion":"v1","kind":"Pod","metadata":{{"namespace":"ns-0","name":"bad-{tag}-norv"}},"spec":{{"containers":[]}}}}"#).into_bytes(),
        non_utf8,
    ]
}

/// Malformed JSON (truncated object).
fn malformed_json(tag: &str) -> Vec<u8> {
    format!(r#"{{"apiVersion":"v1","kind":"Pod","metadata":{{"namespace":"ns-0","name":"bad-{tag}-json","resourceVersion":"7""#).into_bytes()
}

async fn bad_input(engine: Engine, streaming: bool) {
    let fx = Fixture::with_pods(600, 3).await;
    let (h, rt) = (&fx.h, ResourceType::pods());
    let f = h.faults();
    // The first list: three bad objects (paginated: in the first LIST page; streaming: in
    // the initial events), plus malformed JSON in the streaming case (one line each).
    let mut expected_bad = 3;
    if streaming {
        for raw in bad_objects("init") {
            f.inject_next_watch(raw);
        }
        f.inject_next_watch(malformed_json("init"));
        expected_bad += 1;
    } else {
        for raw in bad_objects("list") {
            f.inject_next_list(raw);
        }
    }
    let config = if streaming {
        cfg().streaming_lists()
    } else {
        cfg()
    };
    let mut c = pods_client(engine, fx.path(), &fx.server.url(), config.page_size(250));
    c.until(|e| matches!(e, Seen::InitDone)).await;
    converge(&c.reader, h, &rt).await;
    let s = c.reader.stats();
    assert_eq!(s.bad_objects, expected_bad, "{s:?}");
    assert_eq!(s.errors, 0, "bad objects are skipped, not errors: {s:?}");
    assert!(
        c.reader
            .get_named(Some("ns-0"), "bad-list-norv")
            .unwrap()
            .is_none()
    );

    if !streaming {
        // Malformed JSON inside a LIST page makes the whole page undecodable: the page is
        // refused (a Protocol error, retried), never half-applied.
        f.inject_next_list(malformed_json("relist"));
        f.gone_next_watch();
        f.close_watches();
        h.churn(5, 2, 2, 3);
        let seen = c.until(|e| matches!(e, Seen::Error(_))).await;
        match seen.last() {
            Some(Seen::Error(Error::Protocol { detail, .. })) => {
                assert!(detail.contains("does not decode"), "{detail}")
            }
            other => panic!("expected a Protocol error, got {other:?}"),
        }
        converge(&c.reader, h, &rt).await;
        let s = c.reader.stats();
        assert_eq!(s.relists, 1, "{s:?}");
        assert_eq!(s.bad_objects, expected_bad, "{s:?}");
    }

    // Live watch, objects the store can identify (no resourceVersion, invalid UTF-8 in the
    // name): each is refused, counted and reported, and the stream goes on.
    let watches = h.counts().watch;
    let relists = c.reader.stats().relists;
    for raw in bad_objects("watch").into_iter().skip(1) {
        f.inject_next_watch(raw);
    }
    f.close_watches();
    c.reader.wait_until_live().await.unwrap();
    h.churn(10, 3, 3, 4);
    converge(&c.reader, h, &rt).await;
    let s = c.reader.stats();
    assert_eq!(s.bad_objects, expected_bad + 2, "{s:?}");
    assert_eq!(
        s.relists, relists,
        "identified bad objects need no relist: {s:?}"
    );
    assert_eq!(
        h.counts().watch,
        watches + 1,
        "the stream went on after the bad lines (one reconnect, for close_watches)"
    );

    // Live watch, lines the store cannot identify (no name, malformed JSON, a numeric
    // name): an update to some object may be lost, so the store relists instead of moving
    // its checkpoint past it; the relist skips nothing that exists.
    let bad_before = s.bad_objects;
    f.inject_next_watch(bad_objects("watch").swap_remove(0));
    f.inject_next_watch(malformed_json("watch"));
    f.malformed_next_watch(); // metadata.name is a number
    f.close_watches();
    h.churn(10, 3, 3, 5);
    let deadline = Instant::now() + common::WAIT;
    while c.reader.stats().relists == relists {
        assert!(
            Instant::now() < deadline,
            "no relist after unreadable watch lines"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    converge(&c.reader, h, &rt).await;
    let s = c.reader.stats();
    assert_eq!(s.relists, relists + 1, "{s:?}");
    assert!(s.bad_objects > bad_before, "{s:?}");
    // Nothing else was skipped: the stored keys are exactly the server's.
    assert_eq!(
        store_versions(&c.reader),
        server_versions(h, &rt),
        "store equals server"
    );
    c.stop().await;
}

async fn bad_objects_in_list_and_watch_are_skipped_and_counted_paginated(engine: Engine) {
    bad_input(engine, false).await;
}

async fn bad_objects_in_list_and_watch_are_skipped_and_counted_streaming(engine: Engine) {
    bad_input(engine, true).await;
}

/// A 1.5 MiB ConfigMap (listed, and then created while watching) is stored and read back
/// intact; with `max_object_bytes` below its size it is skipped and counted instead.
async fn huge_object_is_stored_and_read_back_intact(engine: Engine) {
    let fx = Fixture::new().await;
    let h = &fx.h;
    let rt = ResourceType::configmaps();
    let big = |name: &str, fill: char| {
        let value: String = std::iter::repeat_n(fill, 1536 * 1024).collect();
        serde_json::json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": "big", "annotations": {"example.com/blob": value}},
            "data": {"k": "v"}
        })
    };
    for i in 0..5 {
        h.apply(
            &rt,
            serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": format!("small-{i}"), "namespace": "big"}}),
        );
    }
    h.apply(&rt, big("huge-listed", 'a'));
    let annotation = |cm: &ConfigMap| {
        cm.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("example.com/blob"))
            .cloned()
            .unwrap_or_default()
    };
    let check = |reader: &Reader<ConfigMap>, name: &str, fill: char| {
        let cm = reader
            .get_named(Some("big"), name)
            .unwrap()
            .expect("stored");
        let server = h.get(&rt, Some("big"), name).unwrap();
        let a = annotation(&cm);
        assert_eq!(a.len(), 1536 * 1024);
        assert!(a.chars().all(|c| c == fill));
        assert_eq!(
            serde_json::to_value(&*cm).unwrap(),
            server,
            "get returns the server's object"
        );
    };
    let client = fx.server.client();
    let mut c = open_client(
        engine,
        &fx.path().join("a"),
        Api::<ConfigMap>::all(client.clone()),
        cfg().page_size(3),
    )
    .unwrap();
    c.until(|e| matches!(e, Seen::InitDone)).await;
    check(&c.reader, "huge-listed", 'a');
    h.apply(&rt, big("huge-watched", 'b'));
    c.until(|e| matches!(e, Seen::Put(k, _) if k == "big/huge-watched"))
        .await;
    check(&c.reader, "huge-watched", 'b');
    assert_eq!(c.reader.len(), 7);
    assert_eq!(c.reader.stats().bad_objects, 0);
    c.stop().await;

    // Under a 1 MiB limit, the huge objects are skipped and counted; the rest is stored.
    let small = cfg().max_object_bytes(1 << 20);
    let mut c = open_client(
        engine,
        &fx.path().join("b"),
        Api::<ConfigMap>::all(client),
        small,
    )
    .unwrap();
    c.until(|e| matches!(e, Seen::InitDone)).await;
    assert_eq!(c.reader.len(), 5);
    assert_eq!(c.reader.stats().bad_objects, 2);
    assert!(
        c.reader
            .get_named(Some("big"), "huge-listed")
            .unwrap()
            .is_none()
    );
    c.stop().await;
}

engine_tests! {
    async: model_random_faults_store_equals_server,
        garbage_store_files_are_corrupt_naming_the_path_and_destroy_wipes,
        truncated_store_file_is_corrupt_or_a_consistent_prefix,
        damaged_blocks_read_as_errors_never_panics,
        full_disk_is_disk_full_then_recovers_as_root,
        unwritable_directory_is_a_clear_error_naming_the_path,
        bad_objects_in_list_and_watch_are_skipped_and_counted_paginated,
        bad_objects_in_list_and_watch_are_skipped_and_counted_streaming,
        huge_object_is_stored_and_read_back_intact;
    sync: second_process_gets_locked_naming_the_path,
        destroy_refuses_what_is_not_a_store
}
