//! The lifecycle model's child process: this binary again, running the same controller on
//! the store (`app::controller`), reporting what it sees on stdout for the test process,
//! and SIGKILLed by the test or by itself (`CHILD_KILL_ENV`).

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube_persist::{Db, Reader};

use super::{Consumed, Inputs, RunCfg, Sink, controller, outside_at_ready, run};
use crate::app::NS;
use crate::select::Meta;

pub const CHILD_DIR_ENV: &str = "KP_LIFECYCLE_CHILD_DIR";
pub const CHILD_URL_ENV: &str = "KP_LIFECYCLE_CHILD_URL";
pub const CHILD_CFG_ENV: &str = "KP_LIFECYCLE_CHILD_CFG";
/// `phase:<SyncPhase>`: the child SIGKILLs itself as soon as it sees the store in that
/// phase; `after:<ms>`: that long after it opened the store; `delta:<n>`: in `Listing` once
/// it has read `n` metadata pages of a delta relist; `delta-synced`: in `Synced` after one
/// (flushed first).
pub const CHILD_KILL_ENV: &str = "KP_LIFECYCLE_CHILD_KILL";

/// The child process: the controller on the store at `dir`, printing `child-started`,
/// `phase <phase>`, `len <n>` and `delta <metadata pages> <bodies fetched>` at each change
/// of the store's phase, length and delta relist counters (watched on a thread, every
/// 200 µs), `ready-outside <n>` once ready, `given-outside <what>` for an object a consumer
/// of the shared stream was given outside the selection, and `reconciled <name> <rv> <uid>
/// <generation> <tier> <mode>` (and `wrote ...`), until it is killed (by the test, or by itself as
/// `CHILD_KILL_ENV` says).
pub fn child_main(dir: String) {
    let url = std::env::var(CHILD_URL_ENV).expect("the server's URL");
    let cfg = RunCfg::decode(&std::env::var(CHILD_CFG_ENV).expect("the run's config"));
    let kill = std::env::var(CHILD_KILL_ENV).unwrap_or_default();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async move {
        let client = cfg.client(&url);
        let db = cfg
            .open_db(crate::common::child_engine(), dir.as_ref())
            .expect("the child opens the store");
        let c =
            controller(&db, client.clone(), &cfg, Inputs::none()).expect("the child's controller");
        let reader = c.0.store();
        println!("child-started");
        let watched = reader.clone();
        let flushed = db.clone();
        std::thread::spawn(move || watch_phases(watched, &kill, flushed));
        let seen = Arc::new(Consumed::new(cfg.sel));
        let ready = tokio::spawn(outside_at_ready(reader, cfg));
        tokio::spawn(async move {
            if let Ok(Some(n)) = ready.await {
                println!("ready-outside {n}");
            }
        });
        let given = seen.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(20)).await;
                for what in std::mem::take(&mut *given.outside.lock().unwrap()) {
                    println!("given-outside {}", what.replace(' ', "_"));
                }
            }
        });
        let sink: Sink = Arc::new(|seen, m| println!("{} {}", seen.word(), encode_meta(m)));
        run(c, client, sink, seen, futures::future::pending()).await;
    });
}

/// A reconcile's metadata as the child prints it: `name rv uid generation tier mode` (`-`:
/// no label).
fn encode_meta(m: &Meta) -> String {
    let l = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
    let (n, rv, uid, g) = (&m.name, &m.rv, &m.uid, m.generation);
    format!("{n} {rv} {uid} {g} {} {}", l(&m.tier), l(&m.mode))
}

/// What [`encode_meta`] printed (after the word).
pub fn decode_meta(s: &str) -> Option<Meta> {
    let f: Vec<&str> = s.split(' ').collect();
    let l = |v: &str| (v != "-").then(|| v.to_string());
    (f.len() == 6).then(|| Meta {
        namespace: NS.into(),
        name: f[0].into(),
        rv: f[1].into(),
        uid: f[2].into(),
        generation: f[3].parse().unwrap_or_default(),
        tier: l(f[4]),
        mode: l(f[5]),
        ..Meta::default()
    })
}

fn watch_phases(reader: Reader<ConfigMap>, kill: &str, db: Db) {
    let start = std::time::Instant::now();
    let kill_after = kill.strip_prefix("after:").and_then(|ms| ms.parse().ok());
    let kill_on = kill.strip_prefix("phase:");
    let kill_delta: Option<u64> = kill.strip_prefix("delta:").and_then(|n| n.parse().ok());
    let kill_delta_synced = kill == "delta-synced";
    let (mut phase, mut len, mut delta, mut delta_listed) = (None, None, None, false);
    loop {
        let p = reader.phase();
        if phase != Some(p) {
            println!("phase {p:?}");
            phase = Some(p);
            if kill_on == Some(format!("{p:?}").as_str()) {
                sigkill_self();
            }
        }
        let l = reader.len();
        if len != Some(l) {
            println!("len {l}");
            len = Some(l);
        }
        let s = reader.stats();
        if delta != Some((s.metadata_pages, s.bodies_fetched)) {
            println!("delta {} {}", s.metadata_pages, s.bodies_fetched);
            delta = Some((s.metadata_pages, s.bodies_fetched));
            if p == kube_persist::SyncPhase::Listing
                && kill_delta.is_some_and(|n| s.metadata_pages >= n)
            {
                sigkill_self();
            }
        }
        delta_listed |= p == kube_persist::SyncPhase::Listing && s.metadata_pages > 0;
        if kill_delta_synced && delta_listed && p == kube_persist::SyncPhase::Synced {
            // Durable whatever the durability: the store checked is the synced one.
            let _ = db.flush();
            sigkill_self();
        }
        if kill_after.is_some_and(|ms| start.elapsed() >= Duration::from_millis(ms)) {
            sigkill_self();
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

fn sigkill_self() {
    // SAFETY: kill(2) on this process's own pid; it does not return.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
}
