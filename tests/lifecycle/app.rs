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

use std::collections::{BTreeMap, HashMap};
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
    Db, DbConfig, Durability, Engine, Event, Reader, RelistMode, SharedEvent, SharedWatcher,
    Subscriber,
};

use crate::select::{Meta, Sel, TIER, TRANSFORM};

mod child;
pub use child::*;

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
    /// The stream's label and field selectors and its uid shard.
    pub sel: Sel,
    /// Label indexes on `mode` and `tier`.
    pub index: bool,
    pub page: u32,
    /// The `Db`'s durability: fsync every batch (0) or a background flush every that many ms.
    pub flush_ms: u64,
    /// How the store lists again after a 410 (`RelistMode`).
    pub relist: RelistMode,
    /// The model's transform ([`crate::select::transform`]) applied before writing.
    pub transform: bool,
    /// The `Db` is encrypted (drawn once per engine: a store keeps its key).
    pub encrypt: bool,
    /// The stream's client keeps kube's retry layer (which retries 429/503/504 itself);
    /// without it the store sees them.
    pub retry: bool,
    /// Every LIST narrowed to one object (a delta relist's fetch) is refused (403) while
    /// this run lasts: its delta relists list in full from the refused page on.
    pub refuse: bool,
    /// Every page of the stream's paginated LISTs (those of `page` items) holds its items
    /// until its next page is asked for (`Faults::hold_list_bodies_of_limit`): a store that
    /// asked for the next page only after reading the whole page would never sync.
    pub hold: bool,
}

/// The key of an encrypted model store.
const KEY: [u8; 32] = [0x4c; 32];

impl RunCfg {
    /// The form passed to a child process (`from_env` reads it back).
    pub fn encode(&self) -> String {
        let (s, i, p, f) = (self.streaming, self.index, self.page, self.flush_ms);
        let r = match self.relist {
            RelistMode::Full => "full",
            RelistMode::Delta => "delta",
            _ => "auto",
        };
        let (t, e, y, x) = (self.transform, self.encrypt, self.retry, self.refuse);
        let h = self.hold;
        format!(
            "{s} {} {i} {p} {f} {r} {t} {e} {y} {x} {h}",
            self.sel.encode()
        )
    }

    pub fn decode(s: &str) -> RunCfg {
        let f: Vec<&str> = s.split(' ').collect();
        RunCfg {
            streaming: f[0] == "true",
            sel: Sel::decode(f[1]),
            index: f[2] == "true",
            page: f[3].parse().unwrap(),
            flush_ms: f[4].parse().unwrap(),
            relist: match f[5] {
                "full" => RelistMode::Full,
                "delta" => RelistMode::Delta,
                _ => RelistMode::Auto,
            },
            transform: f[6] == "true",
            encrypt: f[7] == "true",
            retry: f[8] == "true",
            refuse: f[9] == "true",
            hold: f[10] == "true",
        }
    }

    /// Whether this run's stream selects the object `m` describes.
    pub fn selects(&self, m: &Meta) -> bool {
        self.sel.selects(m)
    }

    /// The `DbConfig` of this run's store (engine, key), before its durability.
    pub fn db_config(&self, engine: Engine) -> DbConfig {
        let c = DbConfig::default().engine(engine);
        if self.encrypt {
            c.encryption_key(kube_persist::EncryptionKey::from_bytes(KEY))
        } else {
            c
        }
    }

    /// The read-only `DbConfig` a tool opens this run's store with (its key, if any).
    pub fn read_only_config(&self) -> DbConfig {
        let c = DbConfig::default().read_only();
        if self.encrypt {
            c.encryption_key(kube_persist::EncryptionKey::from_bytes(KEY))
        } else {
            c
        }
    }

    /// Open the `Db` at `dir` with this run's durability.
    pub fn open_db(&self, engine: Engine, dir: &std::path::Path) -> kube_persist::Result<Db> {
        let durability = match self.flush_ms {
            0 => Durability::EveryBatch,
            ms => Durability::Periodic(Duration::from_millis(ms)),
        };
        Db::open_with(dir, self.db_config(engine).durability(durability))
    }

    /// The stream's client: with or without kube's retry layer.
    pub fn client(&self, url: &str) -> kube::Client {
        kube_persist_testkit::client_for_opts(url, None, self.retry)
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
        c = self.sel.apply(c);
        if self.transform {
            c = c.transform(TRANSFORM, crate::select::transform);
        }
        if self.index {
            c = c
                .label_index::<ConfigMap>("mode")
                .label_index::<ConfigMap>(TIER);
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
    /// at this version: with the `generation` predicate, a version that needs no reconcile.
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

/// What a reconcile reports: what it did, and the object's metadata (at the version it
/// reconciled, or wrote).
pub type Sink = Arc<dyn Fn(Seen, &Meta) + Send + Sync>;

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
    let name = m.name.as_deref().unwrap_or_default();
    let meta = Meta::of(m, cm.data.as_ref().is_some_and(|d| d.contains_key("blob")));
    // Reported before the result is returned, so before the durable state records it.
    (ctx.sink)(Seen::Reconciled, &meta);
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
                let written = Meta {
                    rv: w.metadata.resource_version.unwrap_or_default(),
                    ..meta
                };
                (ctx.sink)(Seen::Wrote, &written);
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
        reader: reader.clone(),
    };
    let c = Controller::for_shared(reader, main)
        .with_config(
            kube_persist::controller::Config::default()
                .concurrency(CONCURRENCY)
                .pass_chunk(SWEEP_CHUNK),
        )
        .predicate_filter(kube::runtime::predicates::generation, Default::default())
        .watches_store(related, |rel: ConfigMap| {
            let name = rel.metadata.name.unwrap_or_default();
            name.strip_prefix("rel-")
                .map(|n| ObjectRef::new(n).within(NS))
        })
        .reconcile_on(inputs.requests)
        .reconcile_all_on(inputs.ticks)
        .durable_state(CONTROLLER)?;
    Ok((c, consumers))
}

/// The shared stream's hub and its two other consumers.
pub struct Consumers {
    hub: SharedWatcher<ConfigMap>,
    slow: Subscriber<ConfigMap>,
    late: Subscriber<ConfigMap>,
    /// The stream's store: what a consumer reads again at `Resumed` and `Lagged`.
    reader: Reader<ConfigMap>,
}

/// What the other consumers of the shared stream saw.
#[derive(Debug, Default)]
pub struct Consumed {
    /// The run's selection (none in a child process: nothing checked there).
    pub sel: Option<Sel>,
    /// Start signals (`InitDone`, `Resumed`) the slow and the late consumer received.
    pub started: [AtomicUsize; 2],
    /// `Lagged` each received.
    pub lagged: [AtomicUsize; 2],
    /// Per consumer, `name -> resourceVersion` of the newest version it was given (from the
    /// store's contents when the run opened it on).
    pub newest: [Mutex<HashMap<String, String>>; 2],
    /// Objects a consumer was given older than a version it (or the store) had before.
    pub older: Mutex<Vec<String>>,
    /// Per consumer, what it holds: `name -> resourceVersion`, from the store when the run
    /// opened it, read again at `Resumed` and `Lagged` (a consumer's contract: the store is
    /// the state then), changed by every `Apply` and `Delete` it is given.
    pub held: [Mutex<BTreeMap<String, String>>; 2],
    /// Objects a consumer was given outside the run's selection (by their own metadata).
    pub outside: Mutex<Vec<String>>,
    /// Per consumer, its last events (for a violation's detail).
    pub trace: [Mutex<std::collections::VecDeque<String>>; 2],
    /// Set while the model checks what the consumers hold, once the store is quiescent:
    /// the slow consumer takes what is left at once (it is slow while the store moves).
    pub hurry: std::sync::atomic::AtomicBool,
}

/// `name -> resourceVersion` of what `reader` holds.
pub fn held_by(reader: &Reader<ConfigMap>) -> BTreeMap<String, String> {
    reader
        .iter()
        .filter_map(|o| o.ok())
        .map(|c| {
            let m = &c.metadata;
            let rv = m.resource_version.clone().unwrap_or_default();
            (m.name.clone().unwrap_or_default(), rv)
        })
        .collect()
}

/// How many events of each consumer [`Consumed::trace`] keeps.
const TRACED: usize = 40;

impl Consumed {
    fn traced(&self, i: usize, what: String) {
        let mut t = self.trace[i].lock().unwrap();
        if t.len() == TRACED {
            t.pop_front();
        }
        t.push_back(what);
    }

    pub fn new(sel: Sel) -> Consumed {
        Consumed {
            sel: Some(sel),
            ..Consumed::default()
        }
    }

    /// Consumer `i` is given `cm`: never older than what it had of that object, never
    /// outside the selection.
    fn given(&self, i: usize, cm: &ConfigMap) {
        use kube_persist::resource_version::compare;
        let m = &cm.metadata;
        let (name, rv) = (
            m.name.clone().unwrap_or_default(),
            m.resource_version.clone(),
        );
        let meta = Meta::of(m, false);
        if self.sel.is_some_and(|s| !s.selects(&meta)) {
            let what = format!(
                "consumer {i}: {name} at {rv:?} (tier {:?}, mode {:?}, uid {})",
                meta.tier, meta.mode, meta.uid
            );
            self.outside.lock().unwrap().push(what);
        }
        let Some(rv) = rv else { return };
        self.held[i]
            .lock()
            .unwrap()
            .insert(name.clone(), rv.clone());
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
        let Consumers {
            hub,
            slow,
            late,
            reader,
        } = self;
        let take = |sub: Subscriber<ConfigMap>, i: usize, pace: Duration, first: Duration| {
            let (seen, reader) = (seen.clone(), reader.clone());
            async move {
                tokio::time::sleep(first).await;
                let mut sub = std::pin::pin!(sub);
                let reread = |why: &str| {
                    let now = held_by(&reader);
                    seen.traced(i, format!("{why}(read {})", now.len()));
                    *seen.held[i].lock().unwrap() = now;
                };
                while let Some(item) = sub.next().await {
                    let name = |cm: &ConfigMap| {
                        let m = &cm.metadata;
                        let rv = m.resource_version.as_deref().unwrap_or_default();
                        format!("{}@{rv}", m.name.as_deref().unwrap_or_default())
                    };
                    match item {
                        Ok(SharedEvent::Lagged) => {
                            seen.lagged[i].fetch_add(1, Ordering::SeqCst);
                            reread("Lagged");
                        }
                        Ok(SharedEvent::Event(ev)) => match &*ev {
                            Event::InitDone => {
                                seen.traced(i, "InitDone".into());
                                seen.started[i].fetch_add(1, Ordering::SeqCst);
                            }
                            Event::Resumed {
                                resource_version, ..
                            } => {
                                seen.started[i].fetch_add(1, Ordering::SeqCst);
                                reread(&format!("Resumed@{resource_version}"));
                            }
                            Event::Init => reread("Init"),
                            Event::Apply(cm) | Event::InitApply(cm) => {
                                let init = matches!(&*ev, Event::InitApply(_));
                                seen.traced(
                                    i,
                                    format!("{}{}", if init { "I+" } else { "+" }, name(cm)),
                                );
                                seen.given(i, cm);
                            }
                            Event::Delete(cm) => {
                                seen.traced(i, format!("-{}", name(cm)));
                                let name = cm.metadata.name.clone().unwrap_or_default();
                                seen.held[i].lock().unwrap().remove(&name);
                            }
                            Event::DeleteKey(k) => {
                                seen.traced(i, format!("-{}", k.name));
                                seen.held[i].lock().unwrap().remove(&k.name);
                            }
                            other => panic!("an event this test does not know: {other:?}"),
                        },
                        Ok(other) => panic!("an event this test does not know: {other:?}"),
                        Err(e) => seen.traced(
                            i,
                            format!(
                                "error {}",
                                e.to_string().chars().take(60).collect::<String>()
                            ),
                        ),
                    }
                    if !seen.hurry.load(Ordering::SeqCst) {
                        tokio::time::sleep(pace).await;
                    }
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
/// selection (by their own metadata): a store must not be ready while it still holds what
/// a narrowed shard prunes, nor ever hold what its selectors exclude.
pub async fn outside_at_ready(reader: Reader<ConfigMap>, cfg: RunCfg) -> Option<usize> {
    reader.wait_until_ready().await.ok()?;
    let outside = reader
        .iter()
        .filter_map(|o| o.ok())
        .filter(|o| !cfg.selects(&Meta::of(&o.metadata, false)))
        .count();
    Some(outside)
}
