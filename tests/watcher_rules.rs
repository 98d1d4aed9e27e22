//! The watcher's own rules, each a regression test for a path where the store could stop
//! making progress or stall its runtime: validated configuration, backoff that resets on a
//! healthy watch, disk work off the async workers (also on `current_thread` + `LocalSet`),
//! and watch lines bounded while they are read.

mod common;

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use common::*;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube_persist::{Db, DbConfig, Durability, StreamConfig};
use kube_persist_testkit::{ResourceType, TestServer, Verb};
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt;

/// Thread names of every "batch committed" log event, process-wide. Installs this binary's
/// one global subscriber, which also prints the logs of a failing test (every test calls it
/// first).
fn commit_threads() -> &'static Arc<Mutex<Vec<String>>> {
    static THREADS: OnceLock<Arc<Mutex<Vec<String>>>> = OnceLock::new();
    THREADS.get_or_init(|| {
        let threads = Arc::new(Mutex::new(Vec::new()));
        let layer = CommitThreads(threads.clone());
        let logs = tracing_subscriber::fmt::layer()
            .with_test_writer()
            .with_filter(tracing_subscriber::EnvFilter::new(
                "kube_persist=debug,kube_persist_testkit=debug,warn",
            ));
        let subscriber = tracing_subscriber::registry().with(layer).with(logs);
        tracing::subscriber::set_global_default(subscriber).expect("one global subscriber");
        threads
    })
}

struct CommitThreads(Arc<Mutex<Vec<String>>>);

struct Message(bool);

impl tracing::field::Visit for Message {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" && format!("{value:?}") == "batch committed" {
            self.0 = true;
        }
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for CommitThreads {
    fn on_event(
        &self,
        event: &tracing::Event<'_>,
        _ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if !event.metadata().target().starts_with("kube_persist") {
            return;
        }
        let mut m = Message(false);
        event.record(&mut m);
        if m.0 {
            let name = std::thread::current()
                .name()
                .unwrap_or("unnamed")
                .to_string();
            self.0.lock().unwrap().push(name);
        }
    }
}

/// Item 5: every commit (here with an fsync per batch) runs on the store's disk thread,
/// never on the runtime's thread, and the watcher works inside a `LocalSet` on a
/// `current_thread` runtime (where `block_in_place` would panic).
#[test]
fn disk_work_runs_on_the_disk_thread_under_a_local_set() {
    let threads = commit_threads().clone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async {
        let server = TestServer::start().await;
        server.handle().seed_pods(500, 3);
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open_with(
            dir.path(),
            DbConfig::default().durability(Durability::EveryBatch),
        )
        .unwrap();
        let (reader, watcher) = db
            .store(
                "pods",
                Api::<Pod>::all(server.client()),
                StreamConfig::default().page_size(100),
            )
            .unwrap();
        let task = tokio::task::spawn_local(watcher.run());
        reader.wait_until_ready().await.unwrap();
        assert_eq!(reader.len(), 500);
        task.abort();
    });
    let names = threads.lock().unwrap().clone();
    assert!(names.len() >= 5, "commits seen: {names:?}");
    assert!(
        names.iter().all(|n| n == "kube-persist-disk"),
        "commits ran on: {names:?}"
    );
}

/// Item 3: a timeout kube-apiserver would refuse is clamped, so the watch connects (it used
/// to fail validation on every attempt, forever); a page size of 0 is raised to 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_range_config_is_clamped_and_the_watch_goes_live() {
    commit_threads();
    let cfg = StreamConfig::default().timeout(300).page_size(0);
    assert_eq!(cfg.get_timeout(), StreamConfig::MAX_TIMEOUT);
    assert_eq!(cfg.get_page_size(), 1);
    let server = TestServer::start().await;
    server.handle().seed_pods(20, 2);
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path()).unwrap();
    let (reader, watcher) = db
        .store("pods", Api::<Pod>::all(server.client()), cfg.page_size(5))
        .unwrap();
    let mut w = drive(watcher);
    w.until(|e| *e == Ev::InitDone).await;
    tokio::time::timeout(WAIT, reader.wait_until_live())
        .await
        .expect("the watch connects")
        .unwrap();
    assert_eq!(reader.stats().errors, 0);
    w.stop().await;
}

/// Two streams of one URL (two selectors) are told apart in their errors: each names its
/// stream (issue 34 item 5).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_name_their_stream() {
    commit_threads();
    use futures::StreamExt;
    let server = TestServer::start().await;
    server.handle().seed_pods(4, 1);
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path()).unwrap();
    // Without kube's retry layer, so that the injected 500 reaches the store.
    let client = kube_persist_testkit::client_for_opts(&server.url(), None, false);
    for (name, labels) in [("pods-web", "app=web"), ("pods-db", "app=db")] {
        let cfg = StreamConfig::default().labels(labels);
        let (_reader, watcher) = db
            .store(name, Api::<Pod>::all(client.clone()), cfg)
            .unwrap();
        server.handle().faults().fail_next(Verb::List, 500, 1);
        let mut events = std::pin::pin!(watcher.stream());
        let err = loop {
            match tokio::time::timeout(WAIT, events.next()).await {
                Ok(Some(Err(e))) => break e,
                Ok(Some(Ok(_))) => continue,
                other => panic!("{name}: expected the LIST failure, got {other:?}"),
            }
        };
        let text = err.to_string();
        assert!(
            text.contains(&format!("(stream {name:?})")),
            "{name}: the error names its stream: {text}"
        );
    }
}

/// Item 4: after transient errors, a watch that connected and delivered events resets the
/// backoff: the next reconnect waits about the minimum, not the grown delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backoff_resets_after_a_healthy_watch() {
    commit_threads();
    let server = TestServer::start().await;
    let h = server.handle();
    h.seed_pods(20, 2);
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path()).unwrap();
    let cfg = StreamConfig::default().backoff(Duration::from_millis(50), Duration::from_secs(20));
    let (reader, watcher) = db
        .store("pods", Api::<Pod>::all(server.client()), cfg)
        .unwrap();
    let mut w = drive(watcher);
    w.until(|e| *e == Ev::InitDone).await;
    // Five failed reconnects: the backoff grows to 50 ms * 2^5 = 1.6 s (plus up to
    // as much again of jitter).
    h.faults().fail_next(Verb::Watch, 500, 5);
    h.faults().close_watches();
    for _ in 0..5 {
        w.until(|e| matches!(e, Ev::Error(_))).await;
    }
    // A healthy watch: an event arrives.
    let rt = ResourceType::pods();
    let mut o = h.list(&rt)[0].clone();
    o["metadata"]["labels"]["round"] = "1".into();
    h.apply(&rt, o.clone());
    w.until(|e| matches!(e, Ev::Apply(_))).await;
    // One more failure: the retry comes after 50..100 ms, not 1.6..3.2 s (the bound leaves
    // room for a loaded machine and stays below the grown delay).
    h.faults().fail_next(Verb::Watch, 500, 1);
    let start = Instant::now();
    h.faults().close_watches();
    w.until(|e| matches!(e, Ev::Error(_))).await;
    o["metadata"]["labels"]["round"] = "2".into();
    h.apply(&rt, o);
    w.until(|e| matches!(e, Ev::Apply(_))).await;
    let took = start.elapsed();
    assert!(
        took < Duration::from_millis(1500),
        "reconnect after a healthy watch took {took:?}: backoff was not reset"
    );
    assert!(reader.stats().errors >= 6);
    w.stop().await;
}

const HUGE_ENV: &str = "KP_RULES_SERVER";

/// Item 8: a watch line far larger than `max_object_bytes` is skipped while it is read:
/// the client process never holds it (its peak RSS stays far below the line's size), counts
/// it, relists (the object cannot be identified) and stays correct.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_watch_lines_are_never_buffered() {
    commit_threads();
    const LINE_MIB: usize = 200;
    let server = TestServer::start().await;
    let h = server.handle();
    h.seed_pods(50, 2);
    let dir = tempfile::tempdir().unwrap();
    let child = spawn_self(
        "child_reads_a_huge_line",
        &[
            (HUGE_ENV, server.url().as_ref()),
            ("KP_RULES_DIR", dir.path().as_os_str()),
        ],
    );
    // Once the child watches, send it one ADDED line of LINE_MIB MiB.
    let deadline = Instant::now() + WAIT;
    while h.counts().watch == 0 {
        assert!(Instant::now() < deadline, "child never watched");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut huge = br#"{"apiVersion":"v1","kind":"Pod","metadata":{"name":"huge","namespace":"ns-0","resourceVersion":"1"},"data":""#.to_vec();
    huge.resize(huge.len() + (LINE_MIB << 20), b'a');
    huge.extend_from_slice(br#""}"#);
    h.faults().inject_next_watch(huge);
    h.faults().close_watches();
    let out = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let hwm: usize = stdout
        .lines()
        .find_map(|l| l.split("HWM_KIB ").nth(1))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("child output: {stdout}"));
    assert!(
        hwm < (LINE_MIB << 10) / 2,
        "client peak RSS {hwm} KiB with a {LINE_MIB} MiB line"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "child process of huge_watch_lines_are_never_buffered"]
async fn child_reads_a_huge_line() {
    let url = std::env::var(HUGE_ENV).unwrap();
    let dir = std::env::var("KP_RULES_DIR").unwrap();
    let client = kube_persist_testkit::client_for(&url, None);
    let db = Db::open(dir).unwrap();
    let cfg = StreamConfig::default()
        .max_object_bytes(1 << 20)
        .relist_jitter(Duration::from_millis(1));
    let (reader, watcher) = db.store("pods", Api::<Pod>::all(client), cfg).unwrap();
    tokio::spawn(watcher.run());
    reader.wait_until_ready().await.unwrap();
    let deadline = Instant::now() + WAIT;
    while reader.stats().bad_objects == 0 || reader.stats().relists == 0 || !reader.is_ready() {
        assert!(Instant::now() < deadline, "no bad object seen");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(reader.len(), 50);
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let hwm = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<usize>().ok())
        .unwrap();
    println!("HWM_KIB {hwm}");
}
