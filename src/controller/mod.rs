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
//! persistent [`Watcher`](crate::Watcher)'s events. Scheduling is kube-runtime's own
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
//! move the big related kinds to disk, [`Watcher::touched_objects`](crate::Watcher::touched_objects) is a trigger stream for
//! kube-runtime's `Controller::owns_stream` / `watches_stream`.
//!
//! ```no_run
//! use std::{sync::Arc, time::Duration};
//! use futures::StreamExt;
//! use k8s_openapi::api::core::v1::Pod;
//! use kube::{Api, Client, runtime::{controller::Action, watcher}};
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
//! let db = Db::open_async("/var/lib/my-controller/cache").await?;
//! // Was: Controller::new(Api::<Pod>::all(client), watcher::Config::default())
//! Controller::new(&db, Api::<Pod>::all(client), watcher::Config::default())?
//!     .with_config(controller::Config::default().concurrency(16))
//!     .durable_state("my-controller")? // a restart reconciles only what changed
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
mod predicate;
mod related;
mod runner;
mod scan;
mod state;
mod triggers;

use std::future::Future;
use std::hash::Hash;
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::{FutureExt, Stream, StreamExt};
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Resource};
use serde::de::DeserializeOwned;

pub use crate::sync::to_watcher_error;
pub use config::{Config, StartupMode};
pub use controller_error::ControllerError;
pub use controller_stats::{
    ControllerCounts, ControllerStats, QUEUE_WAIT_BUCKETS, RECONCILE_BUCKETS,
};
pub use kube::runtime::controller::{Action, ReconcileReason, ReconcileRequest};
pub use predicate::PredicateConfig;

use crate::store::{Db, Dir, Reader};
use crate::sync::Pair;
use runner::{Parts, RunItem, Runner};
use triggers::TriggerStream;

/// A controller for the objects of one persistent stream of kind `K`.
///
/// Build it with [`Controller::new`] (kube-runtime's constructor with the store
/// directory), or from a stream's [`Reader`] and [`Watcher`](crate::Watcher) with
/// [`Controller::for_store`], add related triggers, then
/// [`run`](Controller::run) it. Nothing happens until the returned stream is polled; the
/// controller drives the watchers it was given (they must not be driven elsewhere).
///
/// ```no_run
/// # async fn demo(db: kube_persist::Db, client: kube::Client) -> kube_persist::Result<()> {
/// use k8s_openapi::api::{apps::v1::ReplicaSet, core::v1::Pod};
/// use kube::Api;
/// use kube_persist::controller::{Config, Controller};
///
/// let (replicasets, rs_watcher) = db.store("replicasets", Api::<ReplicaSet>::all(client.clone()), kube_persist::StreamConfig::default())?;
/// let pods = db.store("pods", Api::<Pod>::all(client), kube_persist::StreamConfig::default())?;
/// let controller = Controller::for_store((replicasets, rs_watcher))
///     .with_config(Config::default().concurrency(8))
///     .owns_store(pods); // a Pod change reconciles its owning ReplicaSet
/// # let _ = controller; Ok(()) }
/// ```
pub struct Controller<K>
where
    K: Resource,
{
    /// The store directory: related kinds' streams and the durable state are kept there.
    dir: Dir,
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
    /// The filter of changes of the controlled objects ([`Controller::predicate_filter`]).
    predicate: Option<predicate::Filter<K>>,
    /// The first failure of a builder step that opens a stream (`owns`, `watches`):
    /// [`Controller::run`] yields it and ends.
    setup: Option<crate::model::Error>,
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
    /// A controller of the objects `main_api` lists with `wc`, cached in `db`: kube-runtime's
    /// `Controller::new(main_api, wc)` with one more argument, the store directory. `wc` is
    /// a `watcher::Config` as it is (or a [`StreamConfig`](crate::StreamConfig) for the
    /// options only kube-persist has). The stream is opened (or resumed from its checkpoint)
    /// at once, named after what it watches (`pods`, `configmapgenerators.nullable.se`,
    /// `pods@default` for a namespaced `Api`, with a hash of the selectors and the shard when
    /// set: see [`watcher`](crate::watcher())); [`Controller::for_store`] takes a stream opened under a
    /// name of your choosing. [`owns`](Controller::owns) and [`watches`](Controller::watches)
    /// open theirs in `db` too, and [`durable_state`](Controller::durable_state) keeps the
    /// reconcile state there. Blocking, like [`Db::store`] (milliseconds).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use k8s_openapi::api::{apps::v1::Deployment, core::v1::Pod};
    /// use kube::{Api, Client, runtime::watcher};
    /// use kube_persist::{Db, controller::{Config, Controller}};
    ///
    /// let client = Client::try_default().await?;
    /// let db = Db::open("/var/lib/my-controller/cache")?;
    /// // Was: Controller::new(Api::<Deployment>::all(client.clone()), watcher::Config::default())
    /// let controller = Controller::new(&db, Api::<Deployment>::all(client.clone()), watcher::Config::default())?
    ///     .owns(Api::<Pod>::all(client), watcher::Config::default())
    ///     .with_config(Config::default().concurrency(8));
    /// # let _ = controller; Ok(()) }
    /// ```
    pub fn new(
        db: &Db,
        main_api: Api<K>,
        wc: impl Into<crate::sync::StreamConfig>,
    ) -> crate::model::Result<Self>
    where
        K::DynamicType: Default,
    {
        let dyntype = K::DynamicType::default();
        let pair = crate::sync::open_derived(&db.dir, main_api, wc.into(), &dyntype)?;
        Ok(Self::for_store_with(pair, dyntype))
    }

    /// Like [`Controller::new`], for kinds with a runtime type (e.g. `DynamicObject` with its
    /// `ApiResource`): kube-runtime's `Controller::new_with(main_api, wc, dyntype)`.
    ///
    /// ```no_run
    /// # async fn demo(db: kube_persist::Db, client: kube::Client) -> kube_persist::Result<()> {
    /// use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
    /// use kube::runtime::watcher;
    /// use kube_persist::controller::Controller;
    /// let ar = ApiResource::from_gvk(&GroupVersionKind::gvk("example.com", "v1", "Widget"));
    /// let api = kube::Api::<DynamicObject>::all_with(client, &ar);
    /// let controller = Controller::new_with(&db, api, watcher::Config::default(), ar)?;
    /// # let _ = controller; Ok(()) }
    /// ```
    pub fn new_with(
        db: &Db,
        main_api: Api<K>,
        wc: impl Into<crate::sync::StreamConfig>,
        dyntype: K::DynamicType,
    ) -> crate::model::Result<Self> {
        let pair = crate::sync::open_derived(&db.dir, main_api, wc.into(), &dyntype)?;
        Ok(Self::for_store_with(pair, dyntype))
    }

    /// A controller of the objects of a persistent stream: its [`Reader`] and its
    /// [`Watcher`](crate::Watcher) as [`Db::store`] returns them (the stream named as you choose). The
    /// controller drives the watcher; related kinds added with [`owns`](Controller::owns) /
    /// [`watches`](Controller::watches) are opened in the same store directory.
    ///
    /// ```no_run
    /// # async fn demo(db: kube_persist::Db, client: kube::Client) -> kube_persist::Result<()> {
    /// use k8s_openapi::api::core::v1::ConfigMap;
    /// use kube_persist::{StreamConfig, controller::{Config, Controller}};
    /// let configmaps = db.store("configmaps", kube::Api::<ConfigMap>::all(client), StreamConfig::default().drop_managed_fields())?;
    /// let controller = Controller::for_store(configmaps).with_config(Config::default().concurrency(4));
    /// # let _ = controller; Ok(()) }
    /// ```
    pub fn for_store(pair: Pair<K>) -> Self
    where
        K::DynamicType: Default,
    {
        Self::for_store_with(pair, Default::default())
    }

    /// Like [`Controller::for_store`], for kinds with a runtime type (e.g. `DynamicObject`).
    ///
    /// ```no_run
    /// # async fn demo(db: kube_persist::Db, client: kube::Client) -> kube_persist::Result<()> {
    /// use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
    /// use kube_persist::controller::Controller;
    /// let gvk = GroupVersionKind::gvk("example.com", "v1", "Widget");
    /// let ar = ApiResource::from_gvk(&gvk);
    /// let api = kube::Api::<DynamicObject>::all_with(client, &ar);
    /// let widgets = db.store_with("widgets", api, kube_persist::StreamConfig::default(), &ar)?;
    /// let controller = Controller::for_store_with(widgets, ar);
    /// # let _ = controller; Ok(()) }
    /// ```
    pub fn for_store_with(pair: Pair<K>, dyntype: K::DynamicType) -> Self {
        let (reader, watcher) = pair;
        let dir = watcher.dir().clone();
        let main = triggers::main_kind(watcher, dyntype.clone());
        Self::from_main(dir, reader, main, dyntype)
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
    /// use kube_persist::{StreamConfig, controller::Controller};
    /// let (reader, watcher) = db.store("pods", kube::Api::<Pod>::all(client), StreamConfig::default())?;
    /// let shared = watcher.shared(1024);
    /// let labeler = Controller::for_shared(reader.clone(), shared.subscribe());
    /// let auditor = Controller::for_shared(reader, shared.subscribe());
    /// tokio::spawn(shared.run());
    /// # let _ = (labeler, auditor); Ok(()) }
    /// ```
    pub fn for_shared(reader: Reader<K>, subscriber: crate::sync::Subscriber<K>) -> Self
    where
        K::DynamicType: Default,
    {
        Self::for_shared_with(reader, subscriber, Default::default())
    }

    /// Like [`Controller::for_shared`], for kinds with a runtime type.
    ///
    /// ```no_run
    /// # async fn demo(db: kube_persist::Db, client: kube::Client) -> kube_persist::Result<()> {
    /// use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
    /// use kube_persist::controller::Controller;
    /// let ar = ApiResource::from_gvk(&GroupVersionKind::gvk("example.com", "v1", "Widget"));
    /// let api = kube::Api::<DynamicObject>::all_with(client, &ar);
    /// let (reader, watcher) = db.store_with("widgets", api, kube_persist::StreamConfig::default(), &ar)?;
    /// let shared = watcher.shared(1024);
    /// let controller = Controller::for_shared_with(reader, shared.subscribe(), ar);
    /// tokio::spawn(shared.run());
    /// # let _ = controller; Ok(()) }
    /// ```
    pub fn for_shared_with(
        reader: Reader<K>,
        subscriber: crate::sync::Subscriber<K>,
        dyntype: K::DynamicType,
    ) -> Self {
        let dir = subscriber.dir().clone();
        let main = triggers::shared_main(subscriber, dyntype.clone());
        Self::from_main(dir, reader, main, dyntype)
    }

    fn from_main(
        dir: Dir,
        reader: Reader<K>,
        main: triggers::TriggerStream<K>,
        dyntype: K::DynamicType,
    ) -> Self {
        Controller {
            dir,
            ready: vec![ready_of(&reader)],
            reader,
            dyntype,
            config: Config::default(),
            triggers: vec![main],
            shutdown: Vec::new(),
            related: Vec::new(),
            durable: None,
            predicate: None,
            setup: None,
            stats: ControllerStats::default(),
        }
    }

    /// Keeps this controller's reconcile state in its store directory under `name`, so that
    /// a restart reconciles only what needs it ([`StartupMode::Changed`], the default): the
    /// objects changed since their last reconcile (or never reconciled), and the requeues
    /// that fell due while the process was down; later requeues fire at their due time.
    ///
    /// For each object the state holds the resourceVersion at which the last reconcile
    /// returned `Ok` (and the value of the [`predicate`](Controller::predicate_filter), if
    /// one is set), the version of a failed one, and when the requeue its [`Action`] (or the
    /// error policy's) asked for is due, in wall-clock time. It is written in batches on the
    /// store's disk thread, after each reconcile returned: a crash in between reconciles
    /// that object again (at least once, never skipped). Requeues due beyond
    /// [`Config::requeue_window`] stay on disk until they come near.
    ///
    /// The state belongs to `name` and the watched kinds (the controlled kind and those of
    /// [`owns`](Controller::owns) / [`watches`](Controller::watches) and their `_store`,
    /// `_stream` and `_shared` forms): another name or other kinds start fresh (every object
    /// is reconciled once). [`Db::controller_states`] describes it. Blocking (it opens the
    /// state's keyspace: milliseconds).
    ///
    /// Changes of related objects are not part of the state: a related object changed (and
    /// stored) just before a crash, whose reconcile had not run yet, is not reconciled
    /// again after the restart. Controllers that rely on such triggers can keep
    /// [`StartupMode::ReconcileAll`].
    ///
    /// ```no_run
    /// # async fn demo(db: kube_persist::Db, client: kube::Client) -> kube_persist::Result<()> {
    /// use k8s_openapi::api::core::v1::Pod;
    /// use kube::runtime::watcher;
    /// use kube_persist::controller::Controller;
    /// let controller = Controller::new(&db, kube::Api::<Pod>::all(client), watcher::Config::default())?
    ///     .durable_state("pod-labeler")?;
    /// # let _ = controller; Ok(()) }
    /// ```
    pub fn durable_state(mut self, name: &str) -> crate::model::Result<Self> {
        let ks = keyspace::open(&self.dir, name)?;
        self.durable = Some((ks, self.dir.worker(), name.to_string()));
        Ok(self)
    }

    /// Replaces the controller's [`Config`], like kube-runtime's `Controller::with_config`.
    ///
    /// ```no_run
    /// # async fn demo(db: kube_persist::Db, client: kube::Client) -> kube_persist::Result<()> {
    /// use k8s_openapi::api::core::v1::Pod;
    /// use kube::runtime::watcher;
    /// use kube_persist::controller::{Config, Controller};
    /// let controller = Controller::new(&db, kube::Api::<Pod>::all(client), watcher::Config::default())?
    ///     .with_config(Config::default().concurrency(8));
    /// # let _ = controller; Ok(()) }
    /// ```
    #[must_use]
    pub fn with_config(mut self, config: Config) -> Self {
        self.config = config;
        self
    }

    /// Reconciles a change of a controlled object only when `predicate`'s value changed
    /// since the last successful reconcile of that object: kube-runtime's
    /// `WatchStreamExt::predicate_filter` on the controller, with kube-runtime's own
    /// [`predicates`](kube::runtime::predicates) (`generation`, `resource_version`,
    /// `labels`, `annotations`, `finalizers`, combined with `Predicate::combine` /
    /// `fallback`) or any `Fn(&K) -> Option<u64>`.
    ///
    /// - A create (an object of a uid no reconcile saw) always passes, as in
    ///   controller-runtime; so does a change after a failed reconcile, and any object for
    ///   which the predicate has no value (`generation` of a ConfigMap).
    /// - It filters changes of the object itself (watch events and a restart's pass over
    ///   the store), never requeues, error retries, triggers of related objects or
    ///   `reconcile_all_on`.
    /// - With [`durable_state`](Controller::durable_state) the value is kept on disk with
    ///   the reconcile state, so a restart skips the objects whose value is unchanged too;
    ///   without, in memory (an entry per reconciled object, dropped after
    ///   [`PredicateConfig::ttl`] without a reconcile), and a restart reconciles everything.
    ///   kube-runtime's hash (`std`'s default hasher) may change between Rust releases: a
    ///   value stored by another build then counts as a change (one reconcile, never a
    ///   skip).
    ///
    /// The API server does not bump `generation` for label, annotation, finalizer or
    /// status changes: a reconciler that reads those combines `generation` with the
    /// predicate of what it reads (or does not filter on `generation`).
    ///
    /// ```no_run
    /// # async fn demo(db: kube_persist::Db, client: kube::Client) -> kube_persist::Result<()> {
    /// use k8s_openapi::api::apps::v1::Deployment;
    /// use kube::runtime::{Predicate, predicates, watcher};
    /// use kube_persist::controller::Controller;
    /// let controller = Controller::new(&db, kube::Api::<Deployment>::all(client), watcher::Config::default())?
    ///     // Spec changes (generation) and label changes; status-only updates are skipped.
    ///     .predicate_filter(predicates::generation.combine(predicates::labels), Default::default())
    ///     .durable_state("deployments")?;
    /// # let _ = controller; Ok(()) }
    /// ```
    #[must_use]
    pub fn predicate_filter(
        mut self,
        predicate: impl kube::runtime::Predicate<K> + Send + Sync + 'static,
        config: PredicateConfig,
    ) -> Self {
        let predicate: predicate::PredicateFn<K> =
            Arc::new(move |obj: &K| predicate.hash_property(obj));
        self.predicate = Some(predicate::Filter::new(predicate, config));
        self
    }

    /// A [`Reader`] of the controlled objects (for lookups from the reconciler's context),
    /// as kube-runtime's `Controller::store` gives its `Store`: read with
    /// [`get_async`](Reader::get_async) where kube-runtime's `Store::get` was.
    ///
    /// ```no_run
    /// # async fn demo(db: kube_persist::Db, client: kube::Client) -> kube_persist::Result<()> {
    /// use k8s_openapi::api::core::v1::Pod;
    /// use kube::runtime::{reflector::ObjectRef, watcher};
    /// use kube_persist::controller::Controller;
    /// let controller = Controller::new(&db, kube::Api::<Pod>::all(client), watcher::Config::default())?;
    /// let store = controller.store(); // e.g. put it in the reconciler's context
    /// let web = store.get_async(&ObjectRef::new("web-0").within("default")).await?;
    /// # Ok(()) }
    /// ```
    pub fn store(&self) -> Reader<K> {
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
        if let Some(e) = self.setup {
            tracing::error!(error = %e, "the controller's setup failed: it does not start");
            let failed: RunItem<K, E> = Err(ControllerError::Setup(e));
            return futures::stream::once(futures::future::ready(failed)).left_stream();
        }
        let ready = futures::future::join_all(self.ready).map(|_| ()).boxed();
        let shutdown = (!self.shutdown.is_empty()).then(|| {
            futures::future::select_all(self.shutdown)
                .map(|_| ())
                .boxed()
        });
        let main = kind_of::<K>(&self.dyntype);
        let window = self.config.requeue_window;
        // Every line of the controller (and of its reconciles) names it, its stream and its
        // directory: the durable state's name, else the controlled kind.
        let span = tracing::info_span!(
            "controller",
            controller = %self.durable.as_ref().map_or(main.as_str(), |(_, _, name)| name.as_str()),
            stream = %self.reader.stream_name(),
            dir = %self.reader.path().display()
        );
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
            predicate: self.predicate,
            stats: self.stats,
            span,
        })
        .right_stream()
    }
}
