//! Controllers on the persistent store: kube-runtime's `Controller`, reading from disk.
//!
//! Port a kube-runtime controller by changing its constructor: the reconciler and the error
//! policy keep kube-runtime's signatures and types ([`Action`], [`ObjectRef`]):
//!
//! ```text
//! async fn reconcile(obj: Arc<K>, ctx: Arc<Ctx>) -> Result<Action, E>
//! fn error_policy(obj: Arc<K>, err: &E, ctx: Arc<Ctx>) -> Action
//! ```
//!
//! Objects come from a kube-persist [`Reader`] (disk, not RAM) and triggers from the
//! persistent [`Watcher`]'s events. Scheduling is kube-runtime's own
//! [`scheduler`](mod@kube::runtime::scheduler): deduplication, debounce and timed requeues.
//! What kube-runtime's `Controller` guarantees is kept: never two reconciles of one object
//! at once, a concurrency limit, requeue after an [`Action`], retries through the error
//! policy, triggers from related objects (which may live in persistent stores too),
//! graceful shutdown, and a stream of results.
//!
//! What the persistent store adds: a restarted controller resumes its watch from the
//! checkpoint on disk, with no paginated LIST (one `LIST limit=1` reads the server's
//! resourceVersion, to know when the store has caught up). Without more, it then
//! reconciles every stored object once, because the reconciles that were queued, running
//! or scheduled for later when it died are lost. With
//! [`Controller::durable_state`] it remembers, per object, the version last reconciled and
//! the requeue pending, and a restart reconciles only the objects changed since (or never
//! reconciled) and the requeues that fell due ([`StartupMode`]). Both read the store from
//! disk in chunks: they never hold all objects, nor all their references, in memory.
//!
//! For controllers that keep their main kind in kube-runtime's in-memory store and only
//! move the big related kinds to disk, [`Watcher::touched_objects`] is a trigger stream for
//! kube-runtime's `Controller::owns_stream` / `watches_stream`.
//!
//! ```no_run
//! use std::{sync::Arc, time::Duration};
//! use futures::StreamExt;
//! use k8s_openapi::api::core::v1::Pod;
//! use kube::{Api, Client, runtime::controller::Action};
//! use kube_persist::{Db, controller::{self, Controller}};
//!
//! #[derive(Debug, thiserror::Error)]
//! #[error("reconcile failed")]
//! struct MyError;
//!
//! // Unchanged from the kube-runtime version:
//! async fn reconcile(pod: Arc<Pod>, _ctx: Arc<()>) -> Result<Action, MyError> {
//!     println!("pod {:?}", pod.metadata.name);
//!     Ok(Action::requeue(Duration::from_secs(300)))
//! }
//! fn error_policy(_pod: Arc<Pod>, _err: &MyError, _ctx: Arc<()>) -> Action {
//!     Action::requeue(Duration::from_secs(5))
//! }
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let client = Client::try_default().await?;
//! let db = Db::open("/var/lib/my-controller/cache")?;
//! // Was: Controller::new(Api::<Pod>::all(client), watcher::Config::default())
//! Controller::for_store(&db, "pods", Api::<Pod>::all(client), kube_persist::StreamConfig::default(),
//!         controller::Config::default().concurrency(16))?
//!     .durable_state(&db, "my-controller")? // a restart reconciles only what changed
//!     .shutdown_on_signal()
//!     .run(reconcile, error_policy, Arc::new(()))
//!     .for_each(|res| async move {
//!         if let Err(e) = res { eprintln!("{e}") }
//!     })
//!     .await;
//! # Ok(()) }
//! ```

// Layer: controller/, above sync/. Owns the controller runtime and its durable-state
// keyspace (`keyspace.rs`). May import: model, exec, disk, store, sync (tests/layers.rs).
//
// Longer than 600 lines because every method of `Controller`, its public builder surface
// with a doc example each (most of the file), is here in one place; each is short and the
// work is in the files of its concepts (triggers.rs, runner/, state.rs, keyspace.rs).

mod action;
mod config;
mod controller_error;
mod controller_stats;
pub(crate) mod keyspace;
mod owed;
mod runner;
mod scan;
mod state;
mod triggers;

use std::future::Future;
use std::hash::Hash;
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::{FutureExt, Stream};
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Resource};
use serde::de::DeserializeOwned;

pub use crate::sync::to_watcher_error;
pub use config::{Config, StartupMode};
pub use controller_error::ControllerError;
pub use controller_stats::{ControllerCounts, ControllerStats, RECONCILE_BUCKETS};
pub use kube::runtime::controller::{Action, ReconcileReason, ReconcileRequest};

use crate::store::{Db, Reader};
use crate::sync::{Pair, Watcher};
use controller_error::TriggerError;
use runner::{Parts, Runner};
use triggers::TriggerStream;

/// A controller for the objects of one persistent stream of kind `K`.
///
/// Build it from the stream's [`Reader`] and [`Watcher`] (or let
/// [`Controller::for_store`] open them), add related triggers, then
/// [`run`](Controller::run) it. Nothing happens until the returned stream is polled; the
/// controller drives the watchers it was given (they must not be driven elsewhere).
///
/// ```no_run
/// # async fn demo(db: kube_persist::Db, client: kube::Client) -> kube_persist::Result<()> {
/// use k8s_openapi::api::{apps::v1::ReplicaSet, core::v1::Pod};
/// use kube::Api;
/// use kube_persist::controller::{Config, Controller};
///
/// let (replicasets, rs_watcher) = db.store("replicasets", Api::<ReplicaSet>::all(client.clone()), Default::default())?;
/// let pods = db.store("pods", Api::<Pod>::all(client), Default::default())?;
/// let controller = Controller::new(replicasets, rs_watcher, Config::default().concurrency(8))
///     .owns_store(pods); // a Pod change reconciles its owning ReplicaSet
/// # let _ = controller; Ok(()) }
/// ```
pub struct Controller<K>
where
    K: Resource,
{
    reader: Reader<K>,
    dyntype: K::DynamicType,
    config: Config,
    triggers: Vec<TriggerStream<K>>,
    ready: Vec<BoxFuture<'static, ()>>,
    shutdown: Vec<BoxFuture<'static, ()>>,
    /// `apiVersion/kind` of the related kinds (part of the durable state's identity).
    related: Vec<String>,
    /// The durable reconcile state, if enabled ([`Controller::durable_state`]).
    durable: Option<(
        crate::controller::keyspace::ControllerKeyspace,
        crate::exec::DiskWorker,
        String,
    )>,
    stats: ControllerStats,
}

impl<K: Resource> std::fmt::Debug for Controller<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Controller")
            .field("reader", &self.reader)
            .field("config", &self.config)
            .field("triggers", &self.triggers.len())
            .finish_non_exhaustive()
    }
}

/// `apiVersion/kind` of a kind.
fn kind_of<T: Resource>(dyntype: &T::DynamicType) -> String {
    format!("{}/{}", T::api_version(dyntype), T::kind(dyntype))
}

fn ready_of<T>(reader: &Reader<T>) -> BoxFuture<'static, ()>
where
    T: Resource + DeserializeOwned + Send + Sync + 'static,
{
    let reader = reader.clone();
    // A watcher dropped before its store was ready never makes it ready: do not wait forever.
    async move {
        let _ = reader.wait_until_ready().await;
    }
    .boxed()
}

impl<K> Controller<K>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Clone + Eq + Hash + Send + Sync + 'static,
{
    /// A controller for the objects of a persistent stream, from its [`Reader`] and its
    /// [`Watcher`] (as returned by [`Db::store`]). The controller drives the watcher.
    ///
    /// ```no_run
    /// # async fn demo(db: kube_persist::Db, client: kube::Client) -> kube_persist::Result<()> {
    /// use k8s_openapi::api::core::v1::ConfigMap;
    /// use kube_persist::controller::{Config, Controller};
    /// let (reader, watcher) = db.store("configmaps", kube::Api::<ConfigMap>::all(client), Default::default())?;
    /// let controller = Controller::new(reader, watcher, Config::default());
    /// # let _ = controller; Ok(()) }
    /// ```
    pub fn new(reader: Reader<K>, watcher: Watcher<K>, config: Config) -> Self
    where
        K::DynamicType: Default,
    {
        Self::new_with(reader, watcher, config, Default::default())
    }

    /// Like [`Controller::new`], for kinds with a runtime type (e.g. `DynamicObject`).
    ///
    /// ```no_run
    /// # async fn demo(db: kube_persist::Db, client: kube::Client) -> kube_persist::Result<()> {
    /// use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
    /// use kube_persist::controller::{Config, Controller};
    /// let gvk = GroupVersionKind::gvk("example.com", "v1", "Widget");
    /// let ar = ApiResource::from_gvk(&gvk);
    /// let api = kube::Api::<DynamicObject>::all_with(client, &ar);
    /// let (reader, watcher) = db.store_with("widgets", api, Default::default(), &ar)?;
    /// let controller = Controller::new_with(reader, watcher, Config::default(), ar);
    /// # let _ = controller; Ok(()) }
    /// ```
    pub fn new_with(
        reader: Reader<K>,
        watcher: Watcher<K>,
        config: Config,
        dyntype: K::DynamicType,
    ) -> Self {
        let main = triggers::main_kind(watcher, dyntype.clone());
        Self::from_main(reader, main, config, dyntype)
    }

    /// A controller of the objects of a shared watch ([`Watcher::shared`](crate::Watcher::shared)),
    /// from its [`Reader`] and one [`Subscriber`](crate::Subscriber): several controllers (or a
    /// controller and the user's own event loop) on one WATCH. After a lag of the subscriber
    /// (see [`SharedWatcher`](crate::SharedWatcher)) the controller reads the store again:
    /// with [`durable_state`](Controller::durable_state) it reconciles the objects changed
    /// since their last reconcile and forgets deleted ones, without it every stored object.
    /// Nothing it missed is lost. Spawn [`SharedWatcher::run`](crate::SharedWatcher::run) to drive it.
    ///
    /// ```no_run
    /// # async fn demo(db: kube_persist::Db, client: kube::Client) -> kube_persist::Result<()> {
    /// use k8s_openapi::api::core::v1::Pod;
    /// use kube_persist::controller::{Config, Controller};
    /// let (reader, watcher) = db.store("pods", kube::Api::<Pod>::all(client), Default::default())?;
    /// let shared = watcher.shared(1024);
    /// let labeler = Controller::for_shared(reader.clone(), shared.subscribe(), Config::default());
    /// let auditor = Controller::for_shared(reader, shared.subscribe(), Config::default());
    /// tokio::spawn(shared.run());
    /// # let _ = (labeler, auditor); Ok(()) }
    /// ```
    pub fn for_shared(
        reader: Reader<K>,
        subscriber: crate::sync::Subscriber<K>,
        config: Config,
    ) -> Self
    where
        K::DynamicType: Default,
    {
        Self::for_shared_with(reader, subscriber, config, Default::default())
    }

    /// Like [`Controller::for_shared`], for kinds with a runtime type.
    ///
    /// ```no_run
    /// # async fn demo(db: kube_persist::Db, client: kube::Client) -> kube_persist::Result<()> {
    /// use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
    /// use kube_persist::controller::{Config, Controller};
    /// let ar = ApiResource::from_gvk(&GroupVersionKind::gvk("example.com", "v1", "Widget"));
    /// let api = kube::Api::<DynamicObject>::all_with(client, &ar);
    /// let (reader, watcher) = db.store_with("widgets", api, Default::default(), &ar)?;
    /// let shared = watcher.shared(1024);
    /// let controller = Controller::for_shared_with(reader, shared.subscribe(), Config::default(), ar);
    /// tokio::spawn(shared.run());
    /// # let _ = controller; Ok(()) }
    /// ```
    pub fn for_shared_with(
        reader: Reader<K>,
        subscriber: crate::sync::Subscriber<K>,
        config: Config,
        dyntype: K::DynamicType,
    ) -> Self {
        let main = triggers::shared_main(subscriber, dyntype.clone());
        Self::from_main(reader, main, config, dyntype)
    }

    fn from_main(
        reader: Reader<K>,
        main: triggers::TriggerStream<K>,
        config: Config,
        dyntype: K::DynamicType,
    ) -> Self {
        Controller {
            ready: vec![ready_of(&reader)],
            reader,
            dyntype,
            config,
            triggers: vec![main],
            shutdown: Vec::new(),
            related: Vec::new(),
            durable: None,
            stats: ControllerStats::default(),
        }
    }

    /// Keeps this controller's reconcile state in `db` under `name`, so that a restart
    /// reconciles only what needs it ([`StartupMode::Changed`], the default): the objects
    /// changed since their last reconcile (or never reconciled), and the requeues that fell
    /// due while the process was down; later requeues fire at their due time.
    ///
    /// For each object the state holds the resourceVersion (and `metadata.generation`) at
    /// which the last reconcile returned `Ok`, the version of a failed one, and when the
    /// requeue its [`Action`] (or the error policy's) asked for is due, in wall-clock time.
    /// It is written in batches on the store's disk thread, after each reconcile returned:
    /// a crash in between reconciles that object again (at least once, never skipped).
    /// Requeues due beyond [`Config::requeue_window`] stay on disk until they come near.
    ///
    /// The state belongs to `name` and the watched kinds (the controlled kind and those of
    /// [`Controller::owns_store`] / [`Controller::watches_store`] / `owns_stream` /
    /// `watches_stream`): another name or other kinds start fresh (every object is
    /// reconciled once). [`Db::controller_states`] describes it.
    ///
    /// Changes of related objects are not part of the state: a related object changed (and
    /// stored) just before a crash, whose reconcile had not run yet, is not reconciled
    /// again after the restart. Controllers that rely on such triggers can keep
    /// [`StartupMode::ReconcileAll`].
    ///
    /// ```no_run
    /// # async fn demo(db: kube_persist::Db, client: kube::Client) -> kube_persist::Result<()> {
    /// use k8s_openapi::api::core::v1::Pod;
    /// use kube_persist::controller::{Config, Controller};
    /// let controller = Controller::for_store(&db, "pods", kube::Api::<Pod>::all(client),
    ///         kube_persist::StreamConfig::default(), Config::default())?
    ///     .durable_state(&db, "pod-labeler")?;
    /// # let _ = controller; Ok(()) }
    /// ```
    pub fn durable_state(mut self, db: &Db, name: &str) -> crate::model::Result<Self> {
        let ks = keyspace::open(&db.dir, name)?;
        self.durable = Some((ks, db.dir.worker(), name.to_string()));
        Ok(self)
    }

    /// Opens (or resumes) the persistent stream `name` of `api` in `db` and builds a
    /// controller on it: the persistent counterpart of kube-runtime's `Controller::new`.
    ///
    /// ```no_run
    /// # async fn demo(client: kube::Client) -> kube_persist::Result<()> {
    /// use k8s_openapi::api::core::v1::Pod;
    /// use kube_persist::{Db, controller::{Config, Controller}};
    /// let db = Db::open("/var/lib/my-controller/cache")?;
    /// let controller = Controller::for_store(&db, "pods", kube::Api::<Pod>::all(client),
    ///     kube_persist::StreamConfig::default().drop_managed_fields(), Config::default())?;
    /// # let _ = controller; Ok(()) }
    /// ```
    pub fn for_store(
        db: &Db,
        name: &str,
        api: Api<K>,
        store_config: crate::sync::StreamConfig,
        config: Config,
    ) -> crate::model::Result<Self>
    where
        K::DynamicType: Default,
    {
        let (reader, watcher) =
            crate::sync::open_store(&db.dir, name, api, store_config, &Default::default())?;
        Ok(Self::new(reader, watcher, config))
    }

    /// Like [`Controller::for_store`], for kinds with a runtime type (e.g. `DynamicObject`
    /// with its `ApiResource`): the persistent counterpart of kube-runtime's
    /// `Controller::new_with`.
    ///
    /// ```no_run
    /// # async fn demo(db: kube_persist::Db, client: kube::Client) -> kube_persist::Result<()> {
    /// use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
    /// use kube_persist::controller::{Config, Controller};
    /// let ar = ApiResource::from_gvk(&GroupVersionKind::gvk("example.com", "v1", "Widget"));
    /// let api = kube::Api::<DynamicObject>::all_with(client, &ar);
    /// let controller = Controller::for_store_with(&db, "widgets", api, Default::default(),
    ///     Config::default(), ar)?;
    /// # let _ = controller; Ok(()) }
    /// ```
    pub fn for_store_with(
        db: &Db,
        name: &str,
        api: Api<K>,
        store_config: crate::sync::StreamConfig,
        config: Config,
        dyntype: K::DynamicType,
    ) -> crate::model::Result<Self> {
        let (reader, watcher) =
            crate::sync::open_store(&db.dir, name, api, store_config, &dyntype)?;
        Ok(Self::new_with(reader, watcher, config, dyntype))
    }

    /// Replaces the controller's [`Config`], like kube-runtime's `Controller::with_config`.
    ///
    /// ```no_run
    /// # async fn demo(db: kube_persist::Db, client: kube::Client) -> kube_persist::Result<()> {
    /// use k8s_openapi::api::core::v1::Pod;
    /// use kube_persist::controller::{Config, Controller};
    /// let controller = Controller::for_store(&db, "pods", kube::Api::<Pod>::all(client),
    ///         Default::default(), Config::default())?
    ///     .with_config(Config::default().concurrency(8));
    /// # let _ = controller; Ok(()) }
    /// ```
    #[must_use]
    pub fn with_config(mut self, config: Config) -> Self {
        self.config = config;
        self
    }

    /// A [`Reader`] of the controlled objects (for lookups from the reconciler's context).
    ///
    /// ```no_run
    /// # async fn demo(db: kube_persist::Db, client: kube::Client) -> kube_persist::Result<()> {
    /// use k8s_openapi::api::core::v1::Pod;
    /// use kube_persist::controller::{Config, Controller};
    /// let controller = Controller::for_store(&db, "pods", kube::Api::<Pod>::all(client),
    ///     Default::default(), Config::default())?;
    /// let reader = controller.reader(); // e.g. put it in the reconciler's context
    /// let web = reader.get_named(Some("default"), "web-0")?;
    /// # Ok(()) }
    /// ```
    pub fn reader(&self) -> Reader<K> {
        self.reader.clone()
    }

    /// Reconciles each object reference `trigger` yields (kube-runtime's `reconcile_on`).
    ///
    /// ```no_run
    /// # fn demo(c: kube_persist::controller::Controller<k8s_openapi::api::core::v1::Pod>, rx: tokio::sync::mpsc::Receiver<kube::runtime::reflector::ObjectRef<k8s_openapi::api::core::v1::Pod>>) {
    /// let c = c.reconcile_on(tokio_stream_like(rx));
    /// # fn tokio_stream_like<T: Send + 'static>(mut rx: tokio::sync::mpsc::Receiver<T>) -> impl futures::Stream<Item = T> + Send {
    /// #     futures::stream::poll_fn(move |cx| rx.poll_recv(cx)) }
    /// # let _ = c; }
    /// ```
    #[must_use]
    pub fn reconcile_on(
        mut self,
        trigger: impl Stream<Item = ObjectRef<K>> + Send + 'static,
    ) -> Self {
        self.triggers.push(triggers::refs(trigger));
        self
    }

    /// Reconciles every stored object each time `trigger` yields (kube-runtime's
    /// `reconcile_all_on`), by a pass over the store on disk in chunks
    /// ([`Config::pass_chunk`]), without a LIST.
    ///
    /// ```no_run
    /// # fn demo(c: kube_persist::controller::Controller<k8s_openapi::api::core::v1::Pod>) {
    /// use std::time::Duration;
    /// // Resync from disk every 10 minutes.
    /// let ticks = futures::stream::unfold((), |()| async {
    ///     tokio::time::sleep(Duration::from_secs(600)).await;
    ///     Some(((), ()))
    /// });
    /// let c = c.reconcile_all_on(ticks);
    /// # let _ = c; }
    /// ```
    #[must_use]
    pub fn reconcile_all_on(mut self, trigger: impl Stream<Item = ()> + Send + 'static) -> Self {
        self.triggers.push(triggers::all_on(trigger));
        self
    }

    /// Starts a graceful shutdown when `trigger` completes: no new reconcile starts (nor
    /// requeue), the watchers stop, running reconciles finish, then the run stream ends.
    /// Several triggers may be given; the first one to complete counts.
    ///
    /// ```no_run
    /// # fn demo(c: kube_persist::controller::Controller<k8s_openapi::api::core::v1::Pod>) {
    /// let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    /// let c = c.graceful_shutdown_on(async move { let _ = rx.await; });
    /// // later: tx.send(()) stops the controller gracefully
    /// # let _ = (c, tx); }
    /// ```
    #[must_use]
    pub fn graceful_shutdown_on(
        mut self,
        trigger: impl Future<Output = ()> + Send + 'static,
    ) -> Self {
        self.shutdown.push(trigger.boxed());
        self
    }

    /// Shuts down gracefully on SIGINT (Ctrl-C) or, on Unix, SIGTERM.
    ///
    /// ```no_run
    /// # fn demo(c: kube_persist::controller::Controller<k8s_openapi::api::core::v1::Pod>) {
    /// let c = c.shutdown_on_signal();
    /// # let _ = c; }
    /// ```
    #[must_use]
    pub fn shutdown_on_signal(self) -> Self {
        self.graceful_shutdown_on(async {
            #[cfg(unix)]
            {
                use tokio::signal::unix::{SignalKind, signal};
                match signal(SignalKind::terminate()) {
                    Ok(mut term) => {
                        tokio::select! {
                            _ = tokio::signal::ctrl_c() => {},
                            _ = term.recv() => {},
                        }
                    }
                    Err(_) => {
                        let _ = tokio::signal::ctrl_c().await;
                    }
                }
            }
            #[cfg(not(unix))]
            {
                let _ = tokio::signal::ctrl_c().await;
            }
            tracing::info!("signal received, shutting down gracefully");
        })
    }

    /// A handle on this controller's live counters (reconciles by result and duration,
    /// what waits in its scheduler, the startup pass's progress), to read while it runs or
    /// to export ([`Metrics::add_controller`](crate::metrics::Metrics::add_controller) with
    /// the `metrics` feature).
    ///
    /// ```no_run
    /// # async fn demo(c: kube_persist::controller::Controller<k8s_openapi::api::core::v1::Pod>) {
    /// let stats = c.stats();
    /// // ... run the controller, then at any time:
    /// let now = stats.get();
    /// println!("{} reconciles, {} waiting", now.reconciles(), now.queue_depth);
    /// # }
    /// ```
    pub fn stats(&self) -> ControllerStats {
        self.stats.clone()
    }

    /// Runs the controller: reconciles objects as they (or related objects) change, and
    /// yields each reconcile's result. Same signatures as kube-runtime's
    /// `Controller::run`, so a reconciler and error policy port unchanged.
    ///
    /// - A reconcile's `Ok(action)` (or the error policy's action after an `Err`) schedules
    ///   the next reconcile of that object ([`Action::requeue`]), unless something triggers
    ///   it earlier; [`Action::await_change`] waits for the next change.
    /// - Reconciles start only once every persistent store given to the controller is ready.
    /// - The stream ends after a graceful shutdown (or if every trigger stream ends).
    ///
    /// ```no_run
    /// # async fn demo(c: kube_persist::controller::Controller<k8s_openapi::api::core::v1::Pod>) {
    /// use std::{sync::Arc, time::Duration};
    /// use futures::StreamExt;
    /// use kube::runtime::controller::Action;
    /// c.run(
    ///     |pod, _ctx: Arc<()>| async move {
    ///         println!("{:?}", pod.metadata.name);
    ///         Ok::<_, std::io::Error>(Action::await_change())
    ///     },
    ///     |_pod, _err, _ctx| Action::requeue(Duration::from_secs(10)),
    ///     Arc::new(()),
    /// )
    /// .for_each(|_| async {})
    /// .await;
    /// # }
    /// ```
    pub fn run<R, Fut, E, P, Ctx>(
        self,
        mut reconcile: R,
        error_policy: P,
        ctx: Arc<Ctx>,
    ) -> impl Stream<Item = Result<(ObjectRef<K>, Action), ControllerError<E>>> + Send
    where
        R: FnMut(Arc<K>, Arc<Ctx>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
        E: std::error::Error + Send + 'static,
        P: Fn(Arc<K>, &E, Arc<Ctx>) -> Action + Send + 'static,
        Ctx: Send + Sync + 'static,
    {
        let ready = futures::future::join_all(self.ready).map(|_| ()).boxed();
        let shutdown = (!self.shutdown.is_empty()).then(|| {
            futures::future::select_all(self.shutdown)
                .map(|_| ())
                .boxed()
        });
        let main = kind_of::<K>(&self.dyntype);
        let window = self.config.requeue_window;
        let durable = self.durable.map(|(ks, worker, name)| {
            let identity =
                crate::controller::keyspace::ControllerIdentity::new(&name, main, self.related);
            state::Durable::new(ks, worker, identity, window)
        });
        Runner::new(Parts {
            durable,
            reader: self.reader,
            dyntype: self.dyntype,
            config: self.config,
            triggers: self.triggers,
            ready,
            shutdown,
            reconcile: Box::new(move |obj, ctx| reconcile(obj, ctx).boxed()),
            error_policy: Box::new(error_policy),
            ctx,
            stats: self.stats,
        })
    }

    // Related objects: the stores and streams whose changes reconcile objects of the
    // controlled kind (kube-runtime's `owns` and `watches`, with their `_with` forms for kinds
    // with a runtime type). Each adds a trigger source, and a store's readiness to the
    // controller's.

    /// Reconciles the owners (of kind `K`, by `ownerReferences`) of each object a persistent
    /// stream of `Child` touches. The controller drives the child stream's watcher, and waits
    /// until its store is ready before the first reconcile. Keep a clone of the child
    /// [`Reader`] to look children up from the reconciler.
    ///
    /// ```no_run
    /// # fn demo(db: kube_persist::Db, client: kube::Client, c: kube_persist::controller::Controller<k8s_openapi::api::apps::v1::ReplicaSet>) -> kube_persist::Result<()> {
    /// use k8s_openapi::api::core::v1::Pod;
    /// let (pods, pod_watcher) = db.store("pods", kube::Api::<Pod>::all(client), Default::default())?;
    /// let c = c.owns_store((pods.clone(), pod_watcher));
    /// # let _ = c; Ok(()) }
    /// ```
    #[must_use]
    pub fn owns_store<Child>(self, pair: Pair<Child>) -> Self
    where
        Child: Resource + DeserializeOwned + Send + Sync + 'static,
        Child::DynamicType: Clone + Default + Send + Sync + 'static,
    {
        self.owns_store_with(pair, Default::default())
    }

    /// Like [`Controller::owns_store`], for child kinds with a runtime type (kube-runtime's
    /// `owns_with`).
    ///
    /// ```no_run
    /// # async fn demo(db: kube_persist::Db, client: kube::Client) -> kube_persist::Result<()> {
    /// use k8s_openapi::api::apps::v1::Deployment;
    /// use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
    /// use kube_persist::controller::{Config, Controller};
    /// let ar = ApiResource::from_gvk(&GroupVersionKind::gvk("example.com", "v1", "Widget"));
    /// let widgets = db.store_with("widgets", kube::Api::<DynamicObject>::all_with(client.clone(), &ar),
    ///     Default::default(), &ar)?;
    /// let controller = Controller::for_store(&db, "deployments", kube::Api::<Deployment>::all(client),
    ///         Default::default(), Config::default())?
    ///     .owns_store_with(widgets, ar);
    /// # let _ = controller; Ok(()) }
    /// ```
    #[must_use]
    pub fn owns_store_with<Child>(self, pair: Pair<Child>, dyntype: Child::DynamicType) -> Self
    where
        Child: Resource + DeserializeOwned + Send + Sync + 'static,
        Child::DynamicType: Clone + Send + Sync + 'static,
    {
        let owner = self.dyntype.clone();
        self.watches_store_with(pair, dyntype, move |child: Child| {
            triggers::owners::<K, Child>(&child, &owner)
        })
    }

    /// Reconciles the objects `mapper` returns for each object a persistent stream of `Other`
    /// touches (kube-runtime's `watches`). The controller drives that stream's watcher, and
    /// waits until its store is ready before the first reconcile.
    ///
    /// ```no_run
    /// # fn demo(db: kube_persist::Db, client: kube::Client, c: kube_persist::controller::Controller<k8s_openapi::api::core::v1::Namespace>) -> kube_persist::Result<()> {
    /// use k8s_openapi::api::core::v1::ConfigMap;
    /// use kube::runtime::reflector::ObjectRef;
    /// // Reconcile a Namespace whenever a ConfigMap in it changes.
    /// let cms = db.store("configmaps", kube::Api::<ConfigMap>::all(client), Default::default())?;
    /// let c = c.watches_store(cms, |cm: ConfigMap| cm.metadata.namespace.map(|ns| ObjectRef::new(&ns)));
    /// # let _ = c; Ok(()) }
    /// ```
    #[must_use]
    pub fn watches_store<Other, I>(
        self,
        pair: Pair<Other>,
        mapper: impl Fn(Other) -> I + Send + 'static,
    ) -> Self
    where
        Other: Resource + DeserializeOwned + Send + Sync + 'static,
        Other::DynamicType: Clone + Default + Send + Sync + 'static,
        I: IntoIterator<Item = ObjectRef<K>>,
    {
        self.watches_store_with(pair, Default::default(), mapper)
    }

    /// Like [`Controller::watches_store`], for kinds with a runtime type (kube-runtime's
    /// `watches_with`).
    ///
    /// ```no_run
    /// # async fn demo(db: kube_persist::Db, client: kube::Client) -> kube_persist::Result<()> {
    /// use k8s_openapi::api::core::v1::Pod;
    /// use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
    /// use kube::runtime::reflector::ObjectRef;
    /// use kube_persist::controller::{Config, Controller};
    /// let ar = ApiResource::from_gvk(&GroupVersionKind::gvk("example.com", "v1", "Widget"));
    /// let widgets = db.store_with("widgets", kube::Api::<DynamicObject>::all_with(client.clone(), &ar),
    ///     Default::default(), &ar)?;
    /// let controller = Controller::for_store(&db, "pods", kube::Api::<Pod>::all(client),
    ///         Default::default(), Config::default())?
    ///     .watches_store_with(widgets, ar, |w: DynamicObject| {
    ///         let pod = w.data["spec"]["pod"].as_str().map(|p| ObjectRef::<Pod>::new(p).within("default"));
    ///         pod.into_iter()
    ///     });
    /// # let _ = controller; Ok(()) }
    /// ```
    #[must_use]
    pub fn watches_store_with<Other, I>(
        mut self,
        pair: Pair<Other>,
        dyntype: Other::DynamicType,
        mapper: impl Fn(Other) -> I + Send + 'static,
    ) -> Self
    where
        Other: Resource + DeserializeOwned + Send + Sync + 'static,
        Other::DynamicType: Clone + Send + Sync + 'static,
        I: IntoIterator<Item = ObjectRef<K>>,
    {
        let (reader, watcher) = pair;
        self.related.push(kind_of::<Other>(&dyntype));
        self.ready.push(ready_of(&reader));
        self.triggers.push(triggers::related(
            triggers::touched(watcher),
            dyntype,
            mapper,
        ));
        self
    }

    /// Reconciles the owners (of kind `K`) of each object of a plain stream, e.g.
    /// kube-runtime's `watcher(..).touched_objects()` for a kind kept in memory.
    ///
    /// ```no_run
    /// # fn demo(client: kube::Client, c: kube_persist::controller::Controller<k8s_openapi::api::apps::v1::Deployment>) {
    /// use k8s_openapi::api::apps::v1::ReplicaSet;
    /// use kube::runtime::{WatchStreamExt, watcher};
    /// let rs = watcher(kube::Api::<ReplicaSet>::all(client), watcher::Config::default()).touched_objects();
    /// let c = c.owns_stream(rs);
    /// # let _ = c; }
    /// ```
    #[must_use]
    pub fn owns_stream<Child>(
        self,
        stream: impl Stream<Item = Result<Child, kube::runtime::watcher::Error>> + Send + 'static,
    ) -> Self
    where
        Child: Resource + Send + 'static,
        Child::DynamicType: Clone + Default + Send + 'static,
    {
        self.owns_stream_with(stream, Default::default())
    }

    /// Like [`Controller::owns_stream`], for child kinds with a runtime type (kube-runtime's
    /// `owns_stream_with`).
    ///
    /// ```no_run
    /// # async fn demo(db: kube_persist::Db, client: kube::Client) -> kube_persist::Result<()> {
    /// use futures::StreamExt;
    /// use k8s_openapi::api::apps::v1::Deployment;
    /// use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
    /// use kube::runtime::{watcher, WatchStreamExt};
    /// use kube_persist::controller::{Config, Controller};
    /// let ar = ApiResource::from_gvk(&GroupVersionKind::gvk("example.com", "v1", "Widget"));
    /// let api = kube::Api::<DynamicObject>::all_with(client.clone(), &ar);
    /// let widgets = watcher(api, watcher::Config::default()).touched_objects();
    /// let controller = Controller::for_store(&db, "deployments", kube::Api::<Deployment>::all(client),
    ///         Default::default(), Config::default())?
    ///     .owns_stream_with(widgets, ar);
    /// # let _ = controller; Ok(()) }
    /// ```
    #[must_use]
    pub fn owns_stream_with<Child>(
        self,
        stream: impl Stream<Item = Result<Child, kube::runtime::watcher::Error>> + Send + 'static,
        dyntype: Child::DynamicType,
    ) -> Self
    where
        Child: Resource + Send + 'static,
        Child::DynamicType: Clone + Send + 'static,
    {
        let owner = self.dyntype.clone();
        self.watches_stream_with(
            stream,
            move |child: Child| triggers::owners::<K, Child>(&child, &owner),
            dyntype,
        )
    }

    /// Reconciles the objects `mapper` returns for each object of a plain stream
    /// (kube-runtime's `watches_stream`).
    ///
    /// ```no_run
    /// # fn demo(client: kube::Client, c: kube_persist::controller::Controller<k8s_openapi::api::core::v1::Namespace>) {
    /// use k8s_openapi::api::core::v1::Secret;
    /// use kube::runtime::{WatchStreamExt, reflector::ObjectRef, watcher};
    /// let secrets = watcher(kube::Api::<Secret>::all(client), watcher::Config::default()).touched_objects();
    /// let c = c.watches_stream(secrets, |s: Secret| s.metadata.namespace.map(|ns| ObjectRef::new(&ns)));
    /// # let _ = c; }
    /// ```
    #[must_use]
    pub fn watches_stream<Other, I>(
        self,
        stream: impl Stream<Item = Result<Other, kube::runtime::watcher::Error>> + Send + 'static,
        mapper: impl Fn(Other) -> I + Send + 'static,
    ) -> Self
    where
        Other: Resource + Send + 'static,
        Other::DynamicType: Clone + Default + Send + 'static,
        I: IntoIterator<Item = ObjectRef<K>>,
    {
        self.watches_stream_with(stream, mapper, Default::default())
    }

    /// Like [`Controller::watches_stream`], for kinds with a runtime type (kube-runtime's
    /// `watches_stream_with`, same argument order).
    ///
    /// ```no_run
    /// # async fn demo(db: kube_persist::Db, client: kube::Client) -> kube_persist::Result<()> {
    /// use k8s_openapi::api::core::v1::Pod;
    /// use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
    /// use kube::runtime::{reflector::ObjectRef, watcher, WatchStreamExt};
    /// use kube_persist::controller::{Config, Controller};
    /// let ar = ApiResource::from_gvk(&GroupVersionKind::gvk("example.com", "v1", "Widget"));
    /// let api = kube::Api::<DynamicObject>::all_with(client.clone(), &ar);
    /// let widgets = watcher(api, watcher::Config::default()).touched_objects();
    /// let controller = Controller::for_store(&db, "pods", kube::Api::<Pod>::all(client),
    ///         Default::default(), Config::default())?
    ///     .watches_stream_with(widgets, |w: DynamicObject| {
    ///         w.data["spec"]["pod"].as_str().map(|p| ObjectRef::<Pod>::new(p).within("default"))
    ///     }, ar);
    /// # let _ = controller; Ok(()) }
    /// ```
    #[must_use]
    pub fn watches_stream_with<Other, I>(
        mut self,
        stream: impl Stream<Item = Result<Other, kube::runtime::watcher::Error>> + Send + 'static,
        mapper: impl Fn(Other) -> I + Send + 'static,
        dyntype: Other::DynamicType,
    ) -> Self
    where
        Other: Resource + Send + 'static,
        Other::DynamicType: Clone + Send + 'static,
        I: IntoIterator<Item = ObjectRef<K>>,
    {
        use futures::TryStreamExt;
        self.related.push(kind_of::<Other>(&dyntype));
        self.triggers.push(triggers::related(
            stream.map_ok(Some).map_err(TriggerError::Watcher),
            dyntype,
            mapper,
        ));
        self
    }

    /// Reconciles the owners (of kind `K`) of each object a subscriber of a shared watch
    /// sees change: kube-runtime's `owns_shared_stream`, on a persistent store. A lagged
    /// subscriber reconciles every object of kind `K`.
    ///
    /// ```no_run
    /// # async fn demo(db: kube_persist::Db, client: kube::Client) -> kube_persist::Result<()> {
    /// use k8s_openapi::api::apps::v1::ReplicaSet;
    /// use k8s_openapi::api::core::v1::Pod;
    /// use kube_persist::controller::{Config, Controller};
    /// let (pods, pod_watcher) = db.store("pods", kube::Api::<Pod>::all(client.clone()), Default::default())?;
    /// let shared = pod_watcher.shared(1024);
    /// let controller = Controller::for_store(&db, "replicasets", kube::Api::<ReplicaSet>::all(client),
    ///         Default::default(), Config::default())?
    ///     .owns_shared(&pods, shared.subscribe());
    /// tokio::spawn(shared.run());
    /// # let _ = controller; Ok(()) }
    /// ```
    #[must_use]
    pub fn owns_shared<Child>(
        self,
        reader: &crate::store::Reader<Child>,
        subscriber: crate::sync::Subscriber<Child>,
    ) -> Self
    where
        Child: Resource + Clone + DeserializeOwned + Send + Sync + 'static,
        Child::DynamicType: Clone + Default + Send + Sync + 'static,
    {
        let owner = self.dyntype.clone();
        self.watches_shared(reader, subscriber, move |child: Child| {
            triggers::owners::<K, Child>(&child, &owner)
        })
    }

    /// Reconciles the objects `mapper` returns for each object a subscriber of a shared
    /// watch sees change: kube-runtime's `watches_shared_stream`, on a persistent store. A
    /// lagged subscriber reconciles every object of kind `K`.
    ///
    /// ```no_run
    /// # async fn demo(db: kube_persist::Db, client: kube::Client) -> kube_persist::Result<()> {
    /// use k8s_openapi::api::core::v1::{ConfigMap, Pod};
    /// use kube::runtime::reflector::ObjectRef;
    /// use kube_persist::controller::{Config, Controller};
    /// let (cms, cm_watcher) = db.store("cms", kube::Api::<ConfigMap>::all(client.clone()), Default::default())?;
    /// let shared = cm_watcher.shared(1024);
    /// let controller = Controller::for_store(&db, "pods", kube::Api::<Pod>::all(client),
    ///         Default::default(), Config::default())?
    ///     .watches_shared(&cms, shared.subscribe(), |cm: ConfigMap| {
    ///         let ns = cm.metadata.namespace.clone().unwrap_or_default();
    ///         cm.metadata.name.map(|n| ObjectRef::<Pod>::new(&n).within(&ns))
    ///     });
    /// tokio::spawn(shared.run());
    /// # let _ = controller; Ok(()) }
    /// ```
    #[must_use]
    pub fn watches_shared<Other, I>(
        mut self,
        reader: &crate::store::Reader<Other>,
        subscriber: crate::sync::Subscriber<Other>,
        mapper: impl Fn(Other) -> I + Send + 'static,
    ) -> Self
    where
        Other: Resource + Clone + DeserializeOwned + Send + Sync + 'static,
        Other::DynamicType: Clone + Default + Send + Sync + 'static,
        I: IntoIterator<Item = ObjectRef<K>>,
    {
        let dyntype = Other::DynamicType::default();
        self.related.push(kind_of::<Other>(&dyntype));
        self.ready.push(ready_of(reader));
        self.triggers.push(triggers::related(
            triggers::touched_shared(subscriber),
            dyntype,
            mapper,
        ));
        self
    }
}
