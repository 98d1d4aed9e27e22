//! Crash consistency with real processes: a child process runs the persistent watcher
//! against the testkit server while the server changes; the test SIGKILLs it at random and
//! at chosen moments (mid first list, mid relist, mid sweep, mid watch burst), then checks
//! the store on disk:
//!
//! - if its phase is `Synced`, it equals the server's state AT the checkpoint's
//!   resourceVersion, object by object (invariant 1);
//! - periodically, after letting a restarted child settle, it equals the server now.
//!
//! The test runs once per storage engine (`sled::` and, with the `redb` feature, `redb::`).
//! `cargo test --release --test crash -- --nocapture` prints
//! `crash: <K> kill points, <D> divergences` for each. `KP_CRASH_SEED` replays a run,
//! `KP_CRASH_KILLS` sets the number of kill points (default 60).

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Engine, try_open_db};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{ListParams, VersionMatch};
use kube_persist::{Config, SyncPhase};
use kube_persist_testkit::{ServerOptions, TestServer};
use rand::{Rng, SeedableRng, rngs::StdRng};

const CHILD_ENV: &str = "KP_CRASH_CHILD_DIR";

fn config() -> Config {
    let c = if std::env::var("KP_CRASH_STREAMING").is_ok_and(|v| v == "1") {
        Config::default().streaming_lists()
    } else {
        Config::default()
    };
    c.index("node", |p: &Pod| {
        p.spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .into_iter()
            .collect()
    })
    .page_size(100)
    .backoff(Duration::from_millis(10), Duration::from_millis(100))
    .relist_jitter(Duration::from_millis(5))
}

/// The child process: runs the watcher forever and reports its state on stdout.
/// Started only by `crash_consistency_under_sigkill` (with `--ignored --exact`).
#[test]
#[ignore = "child process of crash_consistency_under_sigkill"]
fn crash_child() {
    let dir = std::env::var(CHILD_ENV).expect("child mode needs KP_CRASH_CHILD_DIR");
    let url = std::env::var("KP_CRASH_URL").expect("KP_CRASH_URL");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async move {
        let client = kube_persist_testkit::client_for(&url, None);
        let db = try_open_db(common::child_engine(), &dir).expect("child opens the store");
        let (reader, watcher) = db.store("pods", Api::<Pod>::all(client), config()).unwrap();
        tokio::spawn(watcher.run());
        let mut last = String::new();
        loop {
            let line = format!(
                "state phase={:?} checkpoint={} live={}",
                reader.phase(),
                reader.checkpoint().unwrap_or_default(),
                reader.is_live()
            );
            if line != last {
                println!("{line}");
                last = line;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    });
}

struct Running {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

fn spawn_child(engine: Engine, dir: &std::path::Path, url: &str, streaming: bool) -> Running {
    let streaming = if streaming { "1" } else { "0" };
    let mut child = common::spawn_self(
        "crash_child",
        &[
            (common::ENGINE_ENV, engine.name().as_ref()),
            ("KP_CRASH_STREAMING", streaming.as_ref()),
            (CHILD_ENV, dir.as_os_str()),
            ("KP_CRASH_URL", url.as_ref()),
        ],
    );
    let out = child.stdout.take().unwrap();
    let lines = Arc::new(Mutex::new(Vec::new()));
    let sink = lines.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if line.starts_with("state ") {
                sink.lock().unwrap().push(line);
            }
        }
    });
    Running { child, lines }
}

impl Running {
    fn saw(&self, needle: &str) -> bool {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .any(|l| l.contains(needle))
    }

    fn last_checkpoint(&self) -> Option<u64> {
        let lines = self.lines.lock().unwrap();
        let l = lines
            .iter()
            .rev()
            .find(|l| l.contains("phase=Synced") && l.contains("live=true"))?;
        l.split("checkpoint=")
            .nth(1)?
            .split(' ')
            .next()?
            .parse()
            .ok()
    }

    fn kill(mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().unwrap();
    }
}

/// The server's objects at an exact resourceVersion (paginated, consistent), or None if
/// that version was compacted away.
async fn server_at(client: &kube::Client, rv: &str) -> Option<BTreeMap<String, String>> {
    let api = Api::<Pod>::all(client.clone());
    let mut out = BTreeMap::new();
    let mut lp = ListParams::default().limit(1000);
    lp.resource_version = Some(rv.to_string());
    lp.version_match = Some(VersionMatch::Exact);
    loop {
        let page = match api.list(&lp).await {
            Ok(p) => p,
            Err(kube::Error::Api(s)) if s.code == 410 => return None,
            Err(e) => panic!("exact list at {rv}: {e}"),
        };
        for p in page.items {
            let m = p.metadata;
            out.insert(
                format!("{}/{}", m.namespace.unwrap(), m.name.unwrap()),
                m.resource_version.unwrap(),
            );
        }
        match page.metadata.continue_ {
            Some(c) if !c.is_empty() => {
                lp = ListParams::default().limit(1000);
                lp.continue_token = Some(c);
            }
            _ => return Some(out),
        }
    }
}

/// Open the killed child's store and read its phase, checkpoint and objects.
fn inspect(
    engine: Engine,
    dir: &std::path::Path,
    client: &kube::Client,
) -> (SyncPhase, Option<String>, BTreeMap<String, String>) {
    let db = try_open_db(engine, dir).expect("store opens after SIGKILL");
    let (reader, _watcher) = db
        .store("pods", Api::<Pod>::all(client.clone()), config())
        .unwrap();
    (
        reader.phase(),
        reader.checkpoint(),
        common::store_versions(&reader),
    )
}

/// Whether the on-disk `node` index lists exactly the server's pods for every node.
fn index_matches(
    engine: Engine,
    dir: &std::path::Path,
    client: &kube::Client,
    h: &kube_persist_testkit::ServerHandle,
) -> bool {
    let db = try_open_db(engine, dir).expect("store opens");
    let (reader, _watcher) = db
        .store("pods", Api::<Pod>::all(client.clone()), config())
        .unwrap();
    let mut want: BTreeMap<String, std::collections::BTreeSet<String>> = BTreeMap::new();
    for o in h.list(&kube_persist_testkit::ResourceType::pods()) {
        let node = o["spec"]["nodeName"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let key = format!(
            "{}/{}",
            o["metadata"]["namespace"].as_str().unwrap(),
            o["metadata"]["name"].as_str().unwrap()
        );
        want.entry(node).or_default().insert(key);
    }
    (0..100).all(|i| {
        let node = format!("node-{i}");
        let got: std::collections::BTreeSet<String> = match reader.by_index("node", &node) {
            Ok(it) => it
                .map(|p| {
                    let p = p.expect("indexed pod reads");
                    format!(
                        "{}/{}",
                        p.metadata.namespace.clone().unwrap(),
                        p.metadata.name.clone().unwrap()
                    )
                })
                .collect(),
            Err(_) => return false,
        };
        got == want.get(&node).cloned().unwrap_or_default()
    })
}

async fn crash_consistency_under_sigkill(engine: Engine) {
    common::init_tracing();
    let seed: u64 = common::env_num("KP_CRASH_SEED").unwrap_or_else(|| rand::rng().random());
    let kills: usize = common::env_num("KP_CRASH_KILLS").unwrap_or(60);
    println!("crash: engine {engine}, seed {seed} (replay with KP_CRASH_SEED={seed})");
    let mut rng = StdRng::seed_from_u64(seed);

    let server = TestServer::start_with(ServerOptions {
        history: 200_000,
        bookmark_interval: Duration::from_millis(200),
        ..ServerOptions::default()
    })
    .await;
    let h = server.handle();
    h.seed_pods(3000, 5);
    h.faults().page_delay(Duration::from_millis(15));
    let client = server.client();
    let url = server.url();
    let dir = tempfile::tempdir().unwrap();

    // Scripted churn: creates, updates and deletes while the child runs.
    let churning = Arc::new(AtomicBool::new(true));
    let churn = tokio::spawn({
        let h = h.clone();
        let churning = churning.clone();
        let mut seed = seed;
        async move {
            loop {
                if churning.load(Ordering::Relaxed) {
                    seed = seed.wrapping_add(1);
                    h.churn(4, 1, 1, seed);
                }
                tokio::time::sleep(Duration::from_millis(15)).await;
            }
        }
    });

    let (mut points, mut divergences, mut exact_checks, mut settled_checks) =
        (0usize, 0usize, 0usize, 0usize);
    let mut by_phase: BTreeMap<String, usize> = BTreeMap::new();
    for i in 0..kills {
        if i > 0 && i % 3 == 0 {
            h.compact(); // the next start finds its checkpoint expired: relist + sweep
        }
        // Alternate paginated and streaming lists (the identity does not include it).
        let streaming = rng.random_bool(0.3);
        let running = spawn_child(engine, dir.path(), &url, streaming);
        let strategy = rng.random_range(0..5);
        let started = Instant::now();
        match strategy {
            0 => tokio::time::sleep(Duration::from_millis(rng.random_range(0..400))).await,
            1 => tokio::time::sleep(Duration::from_millis(rng.random_range(100..1500))).await,
            _ => {
                // Wait for a phase, then kill a few milliseconds into it.
                let target = match strategy {
                    2 => "phase=Sweeping",
                    3 => "phase=Listing",
                    _ => "live=true",
                };
                while !running.saw(target) && started.elapsed() < Duration::from_secs(3) {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                let max = if strategy == 3 { 300 } else { 25 };
                tokio::time::sleep(Duration::from_millis(rng.random_range(0..max))).await;
            }
        }
        running.kill();
        points += 1;

        let (phase, checkpoint, store) = inspect(engine, dir.path(), &client);
        *by_phase.entry(format!("{phase:?}")).or_default() += 1;
        if phase == SyncPhase::Synced {
            let rv = checkpoint.clone().expect("a synced store has a checkpoint");
            if let Some(server) = server_at(&client, &rv).await {
                exact_checks += 1;
                if server != store {
                    divergences += 1;
                    println!(
                        "crash: kill point {i} (strategy {strategy}): divergence at checkpoint {rv}: {}",
                        common::diff("store", &store, &server)
                    );
                }
            }
        }

        if i % 10 == 9 {
            // Settle: stop changes, let a restarted child catch up, kill it, compare with now.
            churning.store(false, Ordering::Relaxed);
            let target = h.revision();
            let running = spawn_child(engine, dir.path(), &url, false);
            let deadline = Instant::now() + Duration::from_secs(60);
            while running.last_checkpoint().is_none_or(|c| c < target) && Instant::now() < deadline
            {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            // Batches are atomic at once but durable after the periodic flush (500 ms).
            tokio::time::sleep(Duration::from_millis(1200)).await;
            running.kill();
            points += 1;
            let (phase, _, store) = inspect(engine, dir.path(), &client);
            let server = common::server_versions(&h, &kube_persist_testkit::ResourceType::pods());
            settled_checks += 1;
            let index_ok = index_matches(engine, dir.path(), &client, &h);
            if !index_ok {
                println!(
                    "crash: settle after kill point {i}: the node index differs from the server"
                );
            }
            if phase != SyncPhase::Synced || store != server || !index_ok {
                divergences += 1;
                println!(
                    "crash: settle after kill point {i}: phase {phase:?}: {}",
                    common::diff("store", &store, &server)
                );
            }
            churning.store(true, Ordering::Relaxed);
        }
    }
    churn.abort();
    println!(
        "crash: engine {engine}: kill phases {by_phase:?}, {exact_checks} exact checks at the checkpoint, {settled_checks} settled checks"
    );
    println!("crash: {points} kill points, {divergences} divergences");
    assert!(points >= 50.min(kills));
    assert!(exact_checks > 0 && settled_checks > 0 || kills < 10);
    assert_eq!(divergences, 0, "engine {engine}, seed {seed}");
}

engine_tests! {
    async: crash_consistency_under_sigkill,
}
