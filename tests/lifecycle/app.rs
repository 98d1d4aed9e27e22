//! The system under test of the lifecycle model: one ConfigMap stream with a durable
//! controller on it, built the same way in the test process and in its child processes.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::runtime::controller::Action;
use kube_persist::controller::Controller;
use kube_persist::{Db, DbConfig, Durability, Engine, Reader, Shard, ShardKey};

/// Namespace of the ConfigMaps the controller reconciles.
pub const NS: &str = "lc";
/// The stream's name in the `Db`.
pub const STREAM: &str = "cms";
/// The durable controller's name.
pub const CONTROLLER: &str = "lifecycle";
/// Requeue (and retry) delay of `short` and `fail` objects: they are reconciled forever.
pub const SHORT: Duration = Duration::from_millis(200);

/// One run's configuration (what changes between runs).
#[derive(Debug, Clone, PartialEq)]
pub struct RunCfg {
    pub streaming: bool,
    /// `(index, count)` of an even uid shard, or everything.
    pub shard: Option<(u32, u32)>,
    /// A label index on `mode`.
    pub index: bool,
    pub page: u32,
    /// The `Db`'s durability: fsync every batch (0) or a background flush every that many ms.
    pub flush_ms: u64,
}

impl RunCfg {
    /// The form passed to a child process (`from_env` reads it back).
    pub fn encode(&self) -> String {
        let shard = match self.shard {
            Some((i, n)) => format!("{i}/{n}"),
            None => "all".into(),
        };
        let (s, i, p, f) = (self.streaming, self.index, self.page, self.flush_ms);
        format!("{s} {shard} {i} {p} {f}")
    }

    pub fn decode(s: &str) -> RunCfg {
        let f: Vec<&str> = s.split(' ').collect();
        let shard = f[1]
            .split_once('/')
            .map(|(i, n)| (i.parse().unwrap(), n.parse().unwrap()));
        RunCfg {
            streaming: f[0] == "true",
            shard,
            index: f[2] == "true",
            page: f[3].parse().unwrap(),
            flush_ms: f[4].parse().unwrap(),
        }
    }

    pub fn shard(&self) -> Option<Shard> {
        self.shard
            .map(|(i, n)| Shard::even(ShardKey::Uid, i, n).expect("a valid shard"))
    }

    /// Whether this run's replica owns the object with this uid.
    pub fn owns(&self, uid: &str) -> bool {
        self.shard().is_none_or(|s| s.contains(Some(uid), Some(NS)))
    }

    /// Open the `Db` at `dir` with this run's durability.
    pub fn open_db(&self, engine: Engine, dir: &std::path::Path) -> kube_persist::Result<Db> {
        let durability = match self.flush_ms {
            0 => Durability::EveryBatch,
            ms => Durability::Periodic(Duration::from_millis(ms)),
        };
        Db::open_with(
            dir,
            DbConfig::default().engine(engine).durability(durability),
        )
    }

    pub fn store_config(&self) -> kube_persist::Config {
        let mut c = kube_persist::Config::default()
            .page_size(self.page)
            .backoff(Duration::from_millis(20), Duration::from_millis(300))
            .relist_jitter(Duration::from_millis(20));
        if self.streaming {
            c = c.streaming_lists();
        }
        if let Some(shard) = self.shard() {
            c = c.shard(shard);
        }
        if self.index {
            c = c.label_index::<ConfigMap>("mode");
        }
        c
    }
}

/// The `mode` label: `ok` (reconciled once per version), `short` (requeued every
/// [`SHORT`]), `fail` (fails; the error policy retries after [`SHORT`]).
pub fn mode(cm: &ConfigMap) -> &str {
    cm.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get("mode"))
        .map(String::as_str)
        .unwrap_or("ok")
}

/// What a reconcile reports: `(name, resourceVersion, uid)`.
pub type Sink = Arc<dyn Fn(&str, &str, &str) + Send + Sync>;

#[derive(Debug, thiserror::Error)]
#[error("injected failure")]
pub struct Injected;

async fn reconcile(cm: Arc<ConfigMap>, sink: Arc<Sink>) -> Result<Action, Injected> {
    let m = &cm.metadata;
    let (name, rv, uid) = (
        m.name.as_deref().unwrap_or_default(),
        m.resource_version.as_deref().unwrap_or_default(),
        m.uid.as_deref().unwrap_or_default(),
    );
    // Reported before the result is returned, so before the durable state records it.
    sink(name, rv, uid);
    match mode(&cm) {
        "short" => Ok(Action::requeue(SHORT)),
        "fail" => Err(Injected),
        _ => Ok(Action::await_change()),
    }
}

/// The durable controller of a run, on stream [`STREAM`] of `db`.
pub fn controller(
    db: &Db,
    client: kube::Client,
    cfg: &RunCfg,
) -> kube_persist::Result<Controller<ConfigMap>> {
    Controller::for_store(
        db,
        STREAM,
        Api::<ConfigMap>::namespaced(client, NS),
        cfg.store_config(),
        kube_persist::controller::Config::default(),
    )?
    .durable_state(db, CONTROLLER)
}

/// Runs `c` until `stop` resolves (a graceful stop) or the future is dropped (an abort).
pub async fn run(
    c: Controller<ConfigMap>,
    sink: Sink,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) {
    c.graceful_shutdown_on(stop)
        .run(reconcile, |_, _, _| Action::requeue(SHORT), Arc::new(sink))
        .for_each(|_| async {})
        .await;
}

/// Waits until `reader` reports ready, then counts the stored objects outside `cfg`'s
/// shard: a store must not be ready while it still holds what a narrowed shard prunes.
pub async fn outside_at_ready(reader: Reader<ConfigMap>, cfg: RunCfg) -> Option<usize> {
    reader.wait_until_ready().await.ok()?;
    let outside = reader
        .iter()
        .filter_map(|o| o.ok())
        .filter(|o| !cfg.owns(o.metadata.uid.as_deref().unwrap_or_default()))
        .count();
    Some(outside)
}

pub const CHILD_DIR_ENV: &str = "KP_LIFECYCLE_CHILD_DIR";
pub const CHILD_URL_ENV: &str = "KP_LIFECYCLE_CHILD_URL";
pub const CHILD_CFG_ENV: &str = "KP_LIFECYCLE_CHILD_CFG";
/// `phase:<SyncPhase>`: the child SIGKILLs itself as soon as it sees the store in that
/// phase; `after:<ms>`: that long after it opened the store.
pub const CHILD_KILL_ENV: &str = "KP_LIFECYCLE_CHILD_KILL";

/// The child process: the controller on the store at `dir`, printing `child-started`,
/// `phase <phase>` and `len <n>` at each change of the store's phase and length (watched on
/// a thread, every 200 µs), `ready-outside <n>` once ready, and `reconciled <name> <rv>
/// <uid>`, until it is killed (by the test, or by itself as `CHILD_KILL_ENV` says).
pub fn child_main(dir: String) {
    let url = std::env::var(CHILD_URL_ENV).expect("the server's URL");
    let cfg = RunCfg::decode(&std::env::var(CHILD_CFG_ENV).expect("the run's config"));
    let kill = std::env::var(CHILD_KILL_ENV).unwrap_or_default();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async move {
        let client = kube_persist_testkit::client_for(&url, None);
        let db = cfg
            .open_db(crate::common::child_engine(), dir.as_ref())
            .expect("the child opens the store");
        let c = controller(&db, client, &cfg).expect("the child's controller");
        let reader = c.reader();
        println!("child-started");
        let watched = reader.clone();
        std::thread::spawn(move || watch_phases(watched, &kill));
        let ready = tokio::spawn(outside_at_ready(reader, cfg));
        tokio::spawn(async move {
            if let Ok(Some(n)) = ready.await {
                println!("ready-outside {n}");
            }
        });
        let sink: Sink = Arc::new(|name, rv, uid| println!("reconciled {name} {rv} {uid}"));
        run(c, sink, futures::future::pending()).await;
    });
}

fn watch_phases(reader: Reader<ConfigMap>, kill: &str) {
    let start = std::time::Instant::now();
    let kill_after = kill.strip_prefix("after:").and_then(|ms| ms.parse().ok());
    let kill_on = kill.strip_prefix("phase:");
    let (mut phase, mut len) = (None, None);
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
