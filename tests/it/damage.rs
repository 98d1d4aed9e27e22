//! Damaged bytes on disk (issue 60, item 1): whoever holds the store's volume (a restored
//! snapshot, a neighbour that mounts it, a bad sector) can change any value, and no value may
//! abort or panic the process that reads it: damage is an error (`Error::Corrupt`) or,
//! where the bytes still decode, a value.
//!
//! A store with a record of every kind (objects, index entries and entry lists, the
//! stream's state, identity and built indexes, a fetch window and a prune cursor, a durable
//! controller's identity, counts, object records and a ticks' pass under way) is built
//! once per engine. Each mutation of a fixed, seeded budget (`KP_DAMAGE_BUDGET`, default
//! [`BUDGET`]; `KP_DAMAGE_SEED`) changes one value of a copy of it: a length prefix claiming
//! ~4e18 bytes at each position, bytes set to 0x00, 0xFD, 0xFF or flipped, truncations,
//! random rewrites, removal. A child process (so that an abort is seen, as a signal) then
//! reads the copy through the library's real paths: open, stream and controller listings,
//! the stream opened and resumed against the server, which changed every object since (so
//! the writer reads each stored head), gets, iteration, an index lookup, and the
//! controller's reconcile state. The parent fails on a signal, a panic, or a read that
//! neither finished nor failed.
//!
//! For longer runs: `KP_DAMAGE_BUDGET=5000 cargo test --release --all-features --test it --
//! damage::` (and a fuzz target over the decoders: `fuzz/README.md`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use crate::common::{self, Engine};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube_persist::StreamConfig;
use kube_persist::controller::{Config, Controller};
use kube_persist_testkit::ResourceType;
use rand::{Rng, SeedableRng, rngs::StdRng};

/// Mutations per engine in the test command (the CI budget).
const BUDGET: usize = 240;
const PODS: usize = 24;
const CONTROLLER: &str = "damage";
const DIR_ENV: &str = "KP_DAMAGE_DIR";
const URL_ENV: &str = "KP_DAMAGE_URL";
const LIST_ENV: &str = "KP_DAMAGE_LIST";

fn stream_config() -> StreamConfig {
    crate::triggers::store_cfg().index("ns", |p: &Pod| {
        p.metadata.namespace.iter().cloned().collect()
    })
}

/// One raw record of a store: (keyspace, key, value).
type Raw = (String, Vec<u8>, Vec<u8>);

/// One damaged value: where, what it becomes (`None`: removed), and how it was made.
struct Mutation {
    table: String,
    key: Vec<u8>,
    value: Option<Vec<u8>>,
    what: String,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// The kind of record at `key` of `table`, for coverage and reports.
fn kind(table: &str, key: &[u8]) -> String {
    let tag = key.first().copied().unwrap_or(0);
    let meta = || String::from_utf8_lossy(key).into_owned();
    if table.starts_with("controller/") {
        match tag {
            b'r' => "controller record".into(),
            b'd' => "controller requeue".into(),
            _ => format!("controller {}", meta()),
        }
    } else {
        match tag {
            b'o' => "object".into(),
            b's' => "seen mark".into(),
            b'i' => "index entry".into(),
            b'x' => "entry list".into(),
            _ => format!("{} {}", table.trim_start_matches("stream/"), meta()),
        }
    }
}

/// Every way one value `v` is damaged, in order of priority: a huge length claim at each
/// of the first positions first, then the rest.
fn damages(v: &[u8], rng: &mut StdRng) -> Vec<(Option<Vec<u8>>, String)> {
    let huge = [0xFD, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x3F];
    let mut out = Vec::new();
    for at in 0..v.len().min(12) {
        let mut d = v[..at].to_vec();
        d.extend_from_slice(&huge);
        d.extend_from_slice(&v[at + 1..]);
        out.push((Some(d), format!("huge length claim at byte {at}")));
    }
    if v.is_empty() {
        out.push((
            Some(huge.to_vec()),
            "huge length claim in an empty value".into(),
        ));
    }
    for at in 0..v.len().min(8) {
        for (b, name) in [
            (0x00, "0x00"),
            (0xFD, "0xFD"),
            (0xFF, "0xFF"),
            (v[at] ^ 0x80, "flipped"),
        ] {
            let mut d = v.to_vec();
            d[at] = b;
            out.push((Some(d), format!("byte {at} set to {name}")));
        }
    }
    for cut in [0, 1, v.len() / 2, v.len().saturating_sub(1)] {
        if cut < v.len() {
            out.push((Some(v[..cut].to_vec()), format!("truncated to {cut} bytes")));
        }
    }
    out.push((None, "removed".into()));
    for _ in 0..6 {
        let len = rng.random_range(0..64);
        let d: Vec<u8> = (0..len).map(|_| rng.random::<u8>()).collect();
        out.push((Some(d), format!("rewritten with {len} random bytes")));
    }
    for _ in 0..6 {
        if v.is_empty() {
            break;
        }
        let mut d = v.to_vec();
        let at = rng.random_range(0..d.len());
        d[at] = rng.random::<u8>();
        out.push((Some(d), format!("byte {at} set at random")));
    }
    out
}

/// The mutations of the budget: round robin over the kinds of records (so that every kind
/// is damaged within a small budget), each kind's damages in priority order, each applied
/// to a record of that kind picked at random.
fn mutations(records: &[Raw], budget: usize, seed: u64) -> Vec<Mutation> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut by_kind: BTreeMap<String, Vec<&Raw>> = BTreeMap::new();
    for r in records {
        by_kind.entry(kind(&r.0, &r.1)).or_default().push(r);
    }
    let mut queues: Vec<(String, std::collections::VecDeque<Mutation>)> = by_kind
        .into_iter()
        .map(|(k, recs)| {
            // Two records of the kind, picked at random, damaged in every way.
            let mut q = std::collections::VecDeque::new();
            for _ in 0..2 {
                let (table, key, value) = recs[rng.random_range(0..recs.len())];
                for (value, what) in damages(value, &mut rng) {
                    q.push_back(Mutation {
                        table: table.clone(),
                        key: key.clone(),
                        value,
                        what: format!("{k} {:?}: {what}", String::from_utf8_lossy(key)),
                    });
                }
            }
            (k, q)
        })
        .collect();
    let mut out = Vec::new();
    while out.len() < budget && queues.iter().any(|(_, q)| !q.is_empty()) {
        for (_, q) in &mut queues {
            if let Some(m) = q.pop_front()
                && out.len() < budget
            {
                out.push(m);
            }
        }
    }
    out
}

/// A store at `dir` with a record of every kind (see the module doc), synced from `server`.
async fn pristine(
    engine: Engine,
    server: &kube_persist_testkit::TestServer,
    dir: &std::path::Path,
) {
    let db = common::try_open_db(engine, dir).unwrap();
    let (tick_tx, tick_rx) = futures::channel::mpsc::unbounded::<()>();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let controller = db
        .store("pods", Api::<Pod>::all(server.client()), stream_config())
        .map(|pair| Controller::for_store(pair).with_config(Config::default().concurrency(1)))
        .unwrap()
        .durable_state(CONTROLLER)
        .unwrap()
        .reconcile_all_on(tick_rx)
        .graceful_shutdown_on(async move {
            let _ = stop_rx.await;
        });
    let count = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = count.clone();
    let stop = Arc::new(std::sync::Mutex::new(Some(stop_tx)));
    let run = controller.run(
        move |_pod: Arc<Pod>, _: Arc<()>| {
            let n = seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
            let stop = stop.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                // A third into the tick's pass: stop, leaving the pass under way on disk.
                if n == PODS + PODS / 3
                    && let Some(tx) = stop.lock().unwrap().take()
                {
                    let _ = tx.send(());
                }
                Ok::<_, crate::triggers::Never>(Action::await_change())
            }
        },
        |_, _: &crate::triggers::Never, _| Action::await_change(),
        Arc::new(()),
    );
    let task = tokio::spawn(run.for_each(|_| async {}));
    common::eventually("the cold start reconciles every Pod", || {
        count.load(std::sync::atomic::Ordering::SeqCst) >= PODS
    })
    .await;
    tick_tx.unbounded_send(()).unwrap();
    tokio::time::timeout(common::WAIT, task)
        .await
        .expect("the controller stops during the tick's pass")
        .unwrap();
    db.flush().unwrap();
    drop(db);
    common::wait_unlocked(dir);
    // What only a delta relist or a narrowed shard leaves on disk, written as they are: the
    // highest version a fetch brought (a String) and the key a prune resumes after.
    let string = |s: &str| [&[s.len() as u8][..], s.as_bytes()].concat();
    common::raw_edit(engine, dir, "stream/pods", b"mfetched", |_| {
        Some(string("99999999"))
    });
    common::raw_edit(engine, dir, "stream/pods", b"mprune", |_| {
        Some([&[1u8, 8][..], b"ons-0\0po"].concat())
    });
}

/// Issue 60, item 1: every mutation of the budget read by a child process through the
/// real paths ends with an error or a value, never an abort, a panic or a hang. At 9ad23f8
/// the first huge length claim in an object's record aborted the child ("memory allocation
/// of ... bytes failed", SIGABRT).
async fn no_damaged_value_aborts_or_panics(engine: Engine) {
    common::init_tracing();
    let server = common::pod_server(PODS).await;
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("pristine");
    pristine(engine, &server, &dir).await;
    let records = common::raw_records(engine, &dir);
    // The server changes every Pod after the store's checkpoint: the resume replays each.
    let h = server.handle();
    for key in common::server_versions(&h, &ResourceType::pods()).keys() {
        let (ns, name) = key.split_once('/').unwrap();
        common::relabel_pod(&h, ns, name, "after");
    }
    let kinds: std::collections::BTreeSet<String> =
        records.iter().map(|r| kind(&r.0, &r.1)).collect();
    for want in [
        "object",
        "index entry",
        "entry list",
        "pods mstate",
        "pods midentity",
        "pods mindexes",
        "pods mfetched",
        "pods mprune",
        "controller record",
        "controller mcontroller",
        "controller mcounts",
        "controller mpass-ticks",
        "controller mpass-merge",
    ] {
        assert!(
            kinds.contains(want),
            "no {want} record in the store: {kinds:?}"
        );
    }
    // The fuzz target's corpus (fuzz/README.md): one real value of each kind.
    if let Some(corpus) = std::env::var_os("KP_DAMAGE_CORPUS") {
        let corpus = std::path::PathBuf::from(corpus);
        std::fs::create_dir_all(&corpus).unwrap();
        for k in &kinds {
            let r = records.iter().find(|r| kind(&r.0, &r.1) == *k).unwrap();
            let file: String = k
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
                .collect();
            std::fs::write(corpus.join(file), &r.2).unwrap();
        }
    }
    let budget = common::env_num("KP_DAMAGE_BUDGET").unwrap_or(BUDGET);
    let seed = common::test_seed("KP_DAMAGE_SEED", 60);
    let muts = mutations(&records, budget, seed);
    let list = root.path().join("mutations");
    std::fs::write(
        &list,
        muts.iter()
            .map(|m| {
                let v = m.value.as_deref().map_or("-".to_string(), hex);
                format!("{}\t{}\t{v}\n", m.table, hex(&m.key))
            })
            .collect::<String>(),
    )
    .unwrap();
    let mut child = common::spawn_self(
        "damage::damage_child",
        &[
            (common::ENGINE_ENV, engine.name().as_ref()),
            (DIR_ENV, dir.as_os_str()),
            (URL_ENV, server.url().as_ref()),
            (LIST_ENV, list.as_os_str()),
        ],
    );
    let lines = common::collect_stdout(&mut child, |l| l.starts_with("damage "));
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    let lines = lines.lock().unwrap().clone();
    let started = lines
        .iter()
        .filter(|l| l.starts_with("damage start "))
        .count();
    let done: Vec<&String> = lines
        .iter()
        .filter(|l| l.starts_with("damage done "))
        .collect();
    let culprit = || {
        muts.get(started.saturating_sub(1))
            .map_or("", |m| m.what.as_str())
    };
    assert!(
        status.success(),
        "the child reading damaged stores failed ({status}) at mutation {}: {}",
        started.saturating_sub(1),
        culprit()
    );
    assert_eq!(done.len(), muts.len(), "every mutation was read to its end");
    let hung: Vec<_> = done.iter().filter(|l| l.contains(" hang ")).collect();
    assert!(
        hung.is_empty(),
        "reads that neither finished nor failed: {hung:?}"
    );
    let errors = done.iter().filter(|l| l.contains(" error ")).count();
    // Not vacuous: the first mutation of the object records (a huge length claim in front of
    // its resourceVersion) is read, and is an error naming the object.
    let first_object = muts
        .iter()
        .position(|m| m.what.starts_with("object "))
        .unwrap();
    let line = done[first_object];
    assert!(
        line.contains(" error ")
            && line.contains("store at")
            && line.contains("corrupt")
            && line.contains("stream \"pods\": record"),
        "a damaged object record is Error::Corrupt naming the stream and key: {line}"
    );
    println!(
        "damage: {engine}: {} mutations over {} kinds of records: {errors} errors, {} values, 0 aborts",
        muts.len(),
        kinds.len(),
        muts.len() - errors
    );
}

engine_tests!(async: no_damaged_value_aborts_or_panics);

/// What one damaged store gives when read through the real paths: `Ok` with what was read,
/// or the first error.
async fn read_through(engine: Engine, dir: &std::path::Path, url: &str) -> Result<String, String> {
    let e = |e: kube_persist::Error| e.to_string();
    let db = common::try_open_db(engine, dir).map_err(e)?;
    let streams = db.streams().map_err(e)?.len();
    let controllers = db.controller_states().map_err(e)?.len();
    let mut states = 0;
    for s in db.reconcile_states(CONTROLLER).map_err(e)? {
        s.map_err(e)?;
        states += 1;
    }
    let client = kube_persist_testkit::client_for(url, None);
    let (reader, watcher) = db
        .store("pods", Api::<Pod>::all(client.clone()), stream_config())
        .map_err(e)?;
    let mut w = common::drive(watcher);
    let server: BTreeMap<String, String> = Api::<Pod>::all(client)
        .list(&Default::default())
        .await
        .map_err(|e| e.to_string())?
        .items
        .iter()
        .map(|p| {
            (
                common::key(p),
                p.metadata.resource_version.clone().unwrap_or_default(),
            )
        })
        .collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let outcome = loop {
        if let Ok(ev) = w.rx.try_recv() {
            if let common::Ev::Error(msg) = ev {
                break Err(msg);
            }
            continue;
        }
        let stored: Result<BTreeMap<String, String>, String> = reader
            .iter()
            .map(|o| {
                o.map(|o| {
                    (
                        common::key(&*o),
                        o.metadata.resource_version.clone().unwrap_or_default(),
                    )
                })
                .map_err(e)
            })
            .collect();
        match stored {
            Err(msg) => break Err(msg),
            Ok(s) if s == server => break Ok(()),
            Ok(_) if tokio::time::Instant::now() > deadline => {
                return Err("hang: neither synced nor failed within 30 s".into());
            }
            Ok(_) => tokio::time::sleep(Duration::from_millis(5)).await,
        }
    };
    let gets = server
        .keys()
        .map(|k| {
            let (ns, name) = k.split_once('/').unwrap();
            reader
                .get(&ObjectRef::<Pod>::new(name).within(ns))
                .map_err(e)
        })
        .collect::<Result<Vec<_>, _>>()?
        .len();
    let indexed = reader.by_index("ns", "ns-0").map_err(e)?.count();
    w.stop().await;
    outcome?;
    Ok(format!(
        "{streams} streams, {controllers} controllers, {states} records, {gets} gets, {indexed} indexed"
    ))
}

#[test]
#[ignore = "child process of the damage tests"]
fn damage_child() {
    let engine = common::child_engine();
    let dir = std::path::PathBuf::from(std::env::var(DIR_ENV).expect("KP_DAMAGE_DIR"));
    let url = std::env::var(URL_ENV).expect("KP_DAMAGE_URL");
    let list = std::fs::read_to_string(std::env::var(LIST_ENV).expect("KP_DAMAGE_LIST")).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    for (i, line) in list.lines().enumerate() {
        let mut parts = line.split('\t');
        let (table, key, value) = (
            parts.next().unwrap(),
            unhex(parts.next().unwrap()),
            parts.next().unwrap(),
        );
        let value = (value != "-").then(|| unhex(value));
        let work = dir.with_file_name(format!("work-{i}"));
        common::copy_store(&dir, &work);
        common::raw_edit(engine, &work, table, &key, |_| value);
        common::wait_unlocked(&work);
        println!("damage start {i}");
        let outcome = rt.block_on(read_through(engine, &work, &url));
        let line = match outcome {
            Ok(read) => format!("value {read}"),
            Err(e) if e.starts_with("hang") => format!("hang {e}"),
            Err(e) => format!("error {}", e.replace('\n', " ")),
        };
        println!("damage done {i} {line}");
        common::wait_unlocked(&work);
        let _ = std::fs::remove_dir_all(&work);
    }
}
