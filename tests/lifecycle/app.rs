//! The system under test of the lifecycle model: one ConfigMap stream with a durable
//! controller on it, built the same way in the test process and in its child processes.
//! The controller reaches its concurrency limit, skips versions of an unchanged generation,
//! watches related ConfigMaps (namespace [`REL_NS`]) and takes `reconcile_on` requests and
//! `reconcile_all_on` ticks; its reconciler writes its own object (mode `write`), runs long
//! (`slow`), requeues (`short`, and a minute for `slow` and `write`) and fails (`fail`).
//! Its sweeps go in chunks of [`SWEEP_CHUNK`], so a sweep outlasts a storm's tick period.
//! The stream is shared ([`kube_persist::SharedWatcher`]) with two more consumers: one that
//! takes an event every [`SLOW_TAKE`] (never longer than the stall bound for one event,
//! always behind the watch) and one first polled [`LATE_POLL`] after the run starts.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use futures::stream::BoxStream;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::PostParams;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube_persist::controller::Controller;
use kube_persist::{
    Db, DbConfig, Durability, Engine, Event, Reader, RelistMode, Shard, ShardKey, SharedEvent,
    SharedWatcher, Subscriber,
};

/// Namespace of the ConfigMaps the controller reconciles.
pub const NS: &str = "lc";
/// Namespace of the related ConfigMaps: `rel-<name>` triggers a reconcile of `<name>`.
pub const REL_NS: &str = "lc-rel";
/// The stream's name in the `Db`.
pub const STREAM: &str = "cms";
/// The related objects' stream.
pub const REL_STREAM: &str = "rel";
/// The durable controller's name.
pub const CONTROLLER: &str = "lifecycle";
/// Requeue (and retry) delay of `short` and `fail` objects: they are reconciled forever.
pub const SHORT: Duration = Duration::from_millis(200);
/// Requeue of `slow` and `write` objects: inside the requeue window (so it waits in the
/// scheduler, where triggers merge into it) and far beyond the checks' trigger bound (so a
/// trigger held until it is due is seen as lost).
pub const LONG: Duration = Duration::from_secs(60);
/// How long a `slow` reconcile runs (and a `write` one after its write).
pub const SLOW: Duration = Duration::from_millis(400);
/// The controller's concurrency limit: reached by bursts, ticks and slow reconciles.
pub const CONCURRENCY: u16 = 4;
/// References per sweep chunk: a sweep of the model's hundred-odd objects takes several
/// chunks, and seconds (the `slow` and `write` reconciles at [`CONCURRENCY`]).
pub const SWEEP_CHUNK: usize = 8;
/// The shared stream's queue per consumer, and its stall bound.
pub const SHARED_BUFFER: usize = 4;
pub const MAX_STALL: Duration = Duration::from_millis(500);
/// How often the slow consumer takes an event: within [`MAX_STALL`] each time, so only a
/// bound across events lags it.
pub const SLOW_TAKE: Duration = Duration::from_millis(300);
/// When the late consumer is first polled: its queue is full and it is lagged by then.
pub const LATE_POLL: Duration = Duration::from_millis(1500);

/// An `ok` object whose `data.value` starts with this is a change storm's (`storm.rs`): its
/// reconciles take [`STORM_TAKES`].
pub const STORM_MARK: &str = "storm";
/// How long a reconcile of a storm's object runs: long enough that the storm's changes wait
/// for the concurrency (they do not run through it faster than they are written).
pub const STORM_TAKES: Duration = Duration::from_millis(10);

/// The annotation a `write` reconcile sets to its object's `data.value` (a write that keeps
/// the generation).
pub const MIRRORED: &str = "mirrored";

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
    /// How the store lists again after a 410 (`RelistMode`).
    pub relist: RelistMode,
}

impl RunCfg {
    /// The form passed to a child process (`from_env` reads it back).
    pub fn encode(&self) -> String {
        let shard = match self.shard {
            Some((i, n)) => format!("{i}/{n}"),
            None => "all".into(),
        };
        let (s, i, p, f) = (self.streaming, self.index, self.page, self.flush_ms);
        let r = match self.relist {
            RelistMode::Full => "full",
            RelistMode::Delta => "delta",
            _ => "auto",
        };
        format!("{s} {shard} {i} {p} {f} {r}")
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
            relist: match f[5] {
                "full" => RelistMode::Full,
                "delta" => RelistMode::Delta,
                _ => RelistMode::Auto,
            },
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

    pub fn store_config(&self) -> kube_persist::StreamConfig {
        let mut c = kube_persist::StreamConfig::default()
            .page_size(self.page)
            .relist_mode(self.relist)
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
/// [`SHORT`]), `fail` (fails; the error policy retries after [`SHORT`]), `slow` (runs
/// [`SLOW`], requeued after [`LONG`]), `write` (writes [`MIRRORED`] on its own object when it
/// differs from `data.value`, runs [`SLOW`], requeued after [`LONG`]). An `ok` object marked
/// by a change storm ([`STORM_MARK`]) runs [`STORM_TAKES`].
pub fn mode(cm: &ConfigMap) -> &str {
    cm.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get("mode"))
        .map(String::as_str)
        .unwrap_or("ok")
}

/// What a reconciler reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    /// A reconcile started, of the object at this version.
    Reconciled,
    /// A reconcile wrote its object (only [`MIRRORED`]: the generation is kept), which is now
    /// at this version: with `skip_unchanged_generation`, a version that needs no reconcile.
    Wrote,
}

impl Seen {
    /// The word a child process prints before `name rv uid`.
    pub fn word(self) -> &'static str {
        match self {
            Seen::Reconciled => "reconciled",
            Seen::Wrote => "wrote",
        }
    }
}

/// What a reconcile reports: `(what, name, resourceVersion, uid)`.
pub type Sink = Arc<dyn Fn(Seen, &str, &str, &str) + Send + Sync>;

/// The reconciler's context.
pub struct Ctx {
    sink: Sink,
    api: Api<ConfigMap>,
}

#[derive(Debug, thiserror::Error)]
#[error("injected failure")]
pub struct Injected;

fn value(cm: &ConfigMap) -> Option<&str> {
    cm.data.as_ref()?.get("value").map(String::as_str)
}

/// Whether a `write` object's [`MIRRORED`] annotation shows its current value.
pub fn mirrored(cm: &serde_json::Value) -> bool {
    cm["metadata"]["annotations"][MIRRORED] == cm["data"]["value"]
}

async fn reconcile(cm: Arc<ConfigMap>, ctx: Arc<Ctx>) -> Result<Action, Injected> {
    let m = &cm.metadata;
    let (name, rv, uid) = (
        m.name.as_deref().unwrap_or_default(),
        m.resource_version.as_deref().unwrap_or_default(),
        m.uid.as_deref().unwrap_or_default(),
    );
    // Reported before the result is returned, so before the durable state records it.
    (ctx.sink)(Seen::Reconciled, name, rv, uid);
    match mode(&cm) {
        "short" => Ok(Action::requeue(SHORT)),
        "fail" => Err(Injected),
        "slow" => {
            tokio::time::sleep(SLOW).await;
            Ok(Action::requeue(LONG))
        }
        "write" => {
            let annotated = m.annotations.as_ref().and_then(|a| a.get(MIRRORED));
            if annotated.map(String::as_str) != value(&cm) {
                let mut next = (*cm).clone();
                next.metadata
                    .annotations
                    .get_or_insert_default()
                    .insert(MIRRORED.into(), value(&cm).unwrap_or_default().into());
                // At this resourceVersion only: the write changes nothing but the annotation.
                // A failed write (a conflict with a newer version, the server restarting)
                // fails the reconcile, which the error policy retries.
                let w = ctx
                    .api
                    .replace(name, &PostParams::default(), &next)
                    .await
                    .map_err(|_| Injected)?;
                let written = w.metadata.resource_version.unwrap_or_default();
                (ctx.sink)(Seen::Wrote, name, &written, uid);
            }
            tokio::time::sleep(SLOW).await;
            Ok(Action::requeue(LONG))
        }
        _ if value(&cm).is_some_and(|v| v.starts_with(STORM_MARK)) => {
            tokio::time::sleep(STORM_TAKES).await;
            Ok(Action::await_change())
        }
        _ => Ok(Action::await_change()),
    }
}

/// The store configuration of the related objects' stream.
fn rel_config() -> kube_persist::StreamConfig {
    kube_persist::StreamConfig::default()
        .backoff(Duration::from_millis(20), Duration::from_millis(300))
        .relist_jitter(Duration::from_millis(20))
}

/// The reconcile requests and "reconcile everything" ticks a run takes.
pub struct Inputs {
    pub requests: BoxStream<'static, ObjectRef<ConfigMap>>,
    pub ticks: BoxStream<'static, ()>,
}

impl Inputs {
    /// A run that takes neither (a child process).
    pub fn none() -> Self {
        Inputs {
            requests: futures::stream::pending().boxed(),
            ticks: futures::stream::pending().boxed(),
        }
    }
}

/// The durable controller of a run, on stream [`STREAM`] of `db`, with the related stream
/// [`REL_STREAM`].
pub fn controller(
    db: &Db,
    client: kube::Client,
    cfg: &RunCfg,
    inputs: Inputs,
) -> kube_persist::Result<(Controller<ConfigMap>, Consumers)> {
    let related = db.store(
        REL_STREAM,
        Api::<ConfigMap>::namespaced(client.clone(), REL_NS),
        rel_config(),
    )?;
    let (reader, watcher) = db.store(
        STREAM,
        Api::<ConfigMap>::namespaced(client, NS),
        cfg.store_config(),
    )?;
    let hub = watcher.shared(SHARED_BUFFER).max_stall(MAX_STALL);
    let main = hub.subscribe();
    let consumers = Consumers {
        slow: hub.subscribe(),
        late: hub.subscribe(),
        hub,
    };
    let c = Controller::for_shared(
        reader,
        main,
        kube_persist::controller::Config::default()
            .concurrency(CONCURRENCY)
            .skip_unchanged_generation(true)
            .pass_chunk(SWEEP_CHUNK),
    )
    .watches_store(related, |rel: ConfigMap| {
        let name = rel.metadata.name.unwrap_or_default();
        name.strip_prefix("rel-")
            .map(|n| ObjectRef::new(n).within(NS))
    })
    .reconcile_on(inputs.requests)
    .reconcile_all_on(inputs.ticks)
    .durable_state(db, CONTROLLER)?;
    Ok((c, consumers))
}

/// The shared stream's hub and its two other consumers.
pub struct Consumers {
    hub: SharedWatcher<ConfigMap>,
    slow: Subscriber<ConfigMap>,
    late: Subscriber<ConfigMap>,
}

/// What the other consumers of the shared stream saw.
#[derive(Debug, Default)]
pub struct Consumed {
    /// Start signals (`InitDone`, `Resumed`) the slow and the late consumer received.
    pub started: [AtomicUsize; 2],
    /// `Lagged` each received.
    pub lagged: [AtomicUsize; 2],
    /// Per consumer, `name -> resourceVersion` of the newest version it was given (from the
    /// store's contents when the run opened it on).
    pub newest: [Mutex<HashMap<String, String>>; 2],
    /// Objects a consumer was given older than a version it (or the store) had before.
    pub older: Mutex<Vec<String>>,
}

impl Consumed {
    /// Consumer `i` is given `cm`: never older than what it had of that object.
    fn given(&self, i: usize, cm: &ConfigMap) {
        use kube_persist::resource_version::compare;
        let m = &cm.metadata;
        let (name, rv) = (
            m.name.clone().unwrap_or_default(),
            m.resource_version.clone(),
        );
        let Some(rv) = rv else { return };
        let mut newest = self.newest[i].lock().unwrap();
        if let Some(had) = newest.get(&name)
            && compare(&rv, had).is_ok_and(|o| o.is_lt())
        {
            let what = format!("consumer {i}: {name} at {rv} after {had}");
            self.older.lock().unwrap().push(what);
            return;
        }
        newest.insert(name, rv);
    }
}

impl Consumers {
    /// Drives the shared watch and the two consumers (until dropped).
    async fn run(self, seen: Arc<Consumed>) {
        let Consumers { hub, slow, late } = self;
        let take = |sub: Subscriber<ConfigMap>, i: usize, pace: Duration, first: Duration| {
            let seen = seen.clone();
            async move {
                tokio::time::sleep(first).await;
                let mut sub = std::pin::pin!(sub);
                while let Some(item) = sub.next().await {
                    match item {
                        Ok(SharedEvent::Lagged) => {
                            seen.lagged[i].fetch_add(1, Ordering::SeqCst);
                        }
                        Ok(SharedEvent::Event(ev))
                            if matches!(*ev, Event::InitDone | Event::Resumed { .. }) =>
                        {
                            seen.started[i].fetch_add(1, Ordering::SeqCst);
                        }
                        Ok(SharedEvent::Event(ev)) => {
                            if let Event::Apply(cm) | Event::InitApply(cm) = &*ev {
                                seen.given(i, cm);
                            }
                        }
                        _ => {}
                    }
                    tokio::time::sleep(pace).await;
                }
            }
        };
        futures::join!(
            hub.run(),
            take(slow, 0, SLOW_TAKE, Duration::ZERO),
            take(late, 1, Duration::ZERO, LATE_POLL),
        );
    }
}

/// Runs `c` until `stop` resolves (a graceful stop) or the future is dropped (an abort).
/// Runs `c` and the shared stream's consumers until `stop` resolves (a graceful stop; the
/// shared watch ends with the controller) or the future is dropped (an abort).
pub async fn run(
    (c, consumers): (Controller<ConfigMap>, Consumers),
    client: kube::Client,
    sink: Sink,
    seen: Arc<Consumed>,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let ctx = Ctx {
        sink,
        api: Api::namespaced(client, NS),
    };
    let controller = c
        .graceful_shutdown_on(stop)
        .run(reconcile, |_, _, _| Action::requeue(SHORT), Arc::new(ctx))
        .for_each(|_| async {});
    tokio::select! {
        () = controller => {}
        () = consumers.run(seen) => {}
    }
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
/// phase; `after:<ms>`: that long after it opened the store; `delta:<n>`: in `Listing` once
/// it has read `n` metadata pages of a delta relist; `delta-synced`: in `Synced` after one
/// (flushed first).
pub const CHILD_KILL_ENV: &str = "KP_LIFECYCLE_CHILD_KILL";

/// The child process: the controller on the store at `dir`, printing `child-started`,
/// `phase <phase>`, `len <n>` and `delta <metadata pages> <bodies fetched>` at each change
/// of the store's phase, length and delta relist counters (watched on a thread, every 200 µs), `ready-outside <n>` once ready, and `reconciled <name> <rv>
/// <uid>` (and `wrote ...`), until it is killed (by the test, or by itself as `CHILD_KILL_ENV` says).
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
        let c =
            controller(&db, client.clone(), &cfg, Inputs::none()).expect("the child's controller");
        let reader = c.0.reader();
        println!("child-started");
        let watched = reader.clone();
        let flushed = db.clone();
        std::thread::spawn(move || watch_phases(watched, &kill, flushed));
        let ready = tokio::spawn(outside_at_ready(reader, cfg));
        tokio::spawn(async move {
            if let Ok(Some(n)) = ready.await {
                println!("ready-outside {n}");
            }
        });
        let sink: Sink =
            Arc::new(|seen, name, rv, uid| println!("{} {name} {rv} {uid}", seen.word()));
        run(c, client, sink, Arc::default(), futures::future::pending()).await;
    });
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
