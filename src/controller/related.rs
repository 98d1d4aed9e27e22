//! Related kinds: the streams whose changes reconcile objects of the controlled kind
//! (kube-runtime's `owns` and `watches`, with their `_with` forms for kinds with a runtime
//! type). `owns` / `watches` take an `Api` and a configuration as kube-runtime's do and open
//! their streams in the controller's store directory; the `_store`, `_stream` and `_shared`
//! forms take a stream opened by the caller. Each adds a trigger source, and a store's
//! readiness to the controller's.

use std::hash::Hash;

use futures::Stream;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Resource};
use serde::de::DeserializeOwned;

use super::Controller;
use super::controller_error::TriggerError;
use super::{kind_of, ready_of, triggers};
use crate::sync::{Pair, StreamConfig};

impl<K> Controller<K>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Clone + Eq + Hash + Send + Sync + 'static,
{
    /// Reconciles the owners (of kind `K`, by `ownerReferences`) of each object `api` lists
    /// with `wc`: kube-runtime's `Controller::owns`, the objects cached in the controller's
    /// store directory (a stream named after what it watches, see
    /// [`watcher`](crate::watcher())). A failure to open the stream (the directory's
    /// disk, a stream of that name in use) is yielded by [`run`](Controller::run), which
    /// then ends; [`owns_store`](Controller::owns_store) opens it yourself, named as you
    /// choose. Blocking, like [`Db::store`](crate::Db::store) (milliseconds).
    ///
    /// ```no_run
    /// # async fn demo(db: kube_persist::Db, client: kube::Client) -> kube_persist::Result<()> {
    /// use k8s_openapi::api::{apps::v1::ReplicaSet, core::v1::Pod};
    /// use kube::{Api, runtime::watcher};
    /// use kube_persist::controller::Controller;
    /// let controller = Controller::new(&db, Api::<ReplicaSet>::all(client.clone()), watcher::Config::default())?
    ///     .owns(Api::<Pod>::all(client), watcher::Config::default());
    /// # let _ = controller; Ok(()) }
    /// ```
    #[must_use]
    pub fn owns<Child>(self, api: Api<Child>, wc: impl Into<StreamConfig>) -> Self
    where
        Child: Resource + DeserializeOwned + Send + Sync + 'static,
        Child::DynamicType: Clone + Default + Send + Sync + 'static,
    {
        self.owns_with(api, Default::default(), wc)
    }

    /// Like [`Controller::owns`], for kinds with a runtime type: kube-runtime's
    /// `Controller::owns_with(api, dyntype, wc)`.
    ///
    /// ```no_run
    /// # async fn demo(db: kube_persist::Db, client: kube::Client) -> kube_persist::Result<()> {
    /// use k8s_openapi::api::apps::v1::ReplicaSet;
    /// use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
    /// use kube::runtime::watcher;
    /// use kube_persist::controller::Controller;
    /// let ar = ApiResource::from_gvk(&GroupVersionKind::gvk("example.com", "v1", "Widget"));
    /// let controller = Controller::new(&db, Api::<ReplicaSet>::all(client.clone()), watcher::Config::default())?
    ///     .owns_with(Api::<DynamicObject>::all_with(client, &ar), ar, watcher::Config::default());
    /// # let _ = controller; Ok(()) }
    /// ```
    #[must_use]
    pub fn owns_with<Child>(
        self,
        api: Api<Child>,
        dyntype: Child::DynamicType,
        wc: impl Into<StreamConfig>,
    ) -> Self
    where
        Child: Resource + DeserializeOwned + Send + Sync + 'static,
        Child::DynamicType: Clone + Send + Sync + 'static,
    {
        let owner = self.dyntype.clone();
        self.watches_with(api, dyntype, wc, move |child: Child| {
            triggers::owners::<K, Child>(&child, &owner)
        })
    }

    /// Reconciles the objects `mapper` names for each object `api` lists with `wc`:
    /// kube-runtime's `Controller::watches`, the objects cached in the controller's store
    /// directory (as [`owns`](Controller::owns) caches them; a failure to open the stream is
    /// yielded by [`run`](Controller::run), which then ends). Blocking, like
    /// [`Db::store`](crate::Db::store).
    ///
    /// ```no_run
    /// # async fn demo(db: kube_persist::Db, client: kube::Client) -> kube_persist::Result<()> {
    /// use k8s_openapi::api::core::v1::{ConfigMap, Secret};
    /// use kube::{Api, ResourceExt, runtime::{reflector::ObjectRef, watcher}};
    /// use kube_persist::controller::Controller;
    /// let controller = Controller::new(&db, Api::<ConfigMap>::all(client.clone()), watcher::Config::default())?
    ///     // A Secret named like a ConfigMap reconciles that ConfigMap.
    ///     .watches(Api::<Secret>::all(client), kube_persist::StreamConfig::default().keys_only(), |s: Secret| {
    ///         Some(ObjectRef::new(&s.name_any()).within(&s.namespace().unwrap_or_default()))
    ///     });
    /// # let _ = controller; Ok(()) }
    /// ```
    #[must_use]
    pub fn watches<Other, I>(
        self,
        api: Api<Other>,
        wc: impl Into<StreamConfig>,
        mapper: impl Fn(Other) -> I + Send + 'static,
    ) -> Self
    where
        Other: Resource + DeserializeOwned + Send + Sync + 'static,
        Other::DynamicType: Clone + Default + Send + Sync + 'static,
        I: IntoIterator<Item = ObjectRef<K>>,
    {
        self.watches_with(api, Default::default(), wc, mapper)
    }

    /// Like [`Controller::watches`], for kinds with a runtime type: kube-runtime's
    /// `Controller::watches_with(api, dyntype, wc, mapper)`.
    ///
    /// ```no_run
    /// # async fn demo(db: kube_persist::Db, client: kube::Client) -> kube_persist::Result<()> {
    /// use k8s_openapi::api::core::v1::ConfigMap;
    /// use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ResourceExt};
    /// use kube::runtime::{reflector::ObjectRef, watcher};
    /// use kube_persist::controller::Controller;
    /// let ar = ApiResource::from_gvk(&GroupVersionKind::gvk("example.com", "v1", "Widget"));
    /// let controller = Controller::new(&db, Api::<ConfigMap>::all(client.clone()), watcher::Config::default())?
    ///     .watches_with(Api::<DynamicObject>::all_with(client, &ar), ar, watcher::Config::default(), |w: DynamicObject| {
    ///         Some(ObjectRef::new(&w.name_any()).within(&w.namespace().unwrap_or_default()))
    ///     });
    /// # let _ = controller; Ok(()) }
    /// ```
    #[must_use]
    pub fn watches_with<Other, I>(
        mut self,
        api: Api<Other>,
        dyntype: Other::DynamicType,
        wc: impl Into<StreamConfig>,
        mapper: impl Fn(Other) -> I + Send + 'static,
    ) -> Self
    where
        Other: Resource + DeserializeOwned + Send + Sync + 'static,
        Other::DynamicType: Clone + Send + Sync + 'static,
        I: IntoIterator<Item = ObjectRef<K>>,
    {
        if self.setup.is_some() {
            return self;
        }
        match crate::sync::open_derived(&self.dir, api, wc.into(), &dyntype) {
            Ok(pair) => self.watches_store_with(pair, dyntype, mapper),
            Err(e) => {
                tracing::error!(kind = %kind_of::<Other>(&dyntype), error = %e, "cannot open the stream of a related kind; the controller will not start");
                self.setup = Some(e);
                self
            }
        }
    }

    // Related objects: the stores and streams whose changes reconcile objects of the
    // controlled kind (kube-runtime's `owns` and `watches`, with their `_with` forms for kinds
    // with a runtime type). Each adds a trigger source, and a store's readiness to the
    // controller's.

    /// Reconciles the owners (of kind `K`, by `ownerReferences`) of each object a persistent
    /// stream of `Child` touches. The controller drives the child stream's watcher, and waits
    /// until its store is ready before the first reconcile. Keep a clone of the child
    /// [`Reader`](crate::Reader) to look children up from the reconciler.
    ///
    /// ```no_run
    /// # fn demo(db: kube_persist::Db, client: kube::Client, c: kube_persist::controller::Controller<k8s_openapi::api::apps::v1::ReplicaSet>) -> kube_persist::Result<()> {
    /// use k8s_openapi::api::core::v1::Pod;
    /// let (pods, pod_watcher) = db.store("pods", kube::Api::<Pod>::all(client), kube_persist::StreamConfig::default())?;
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
    ///     kube_persist::StreamConfig::default(), &ar)?;
    /// let controller = Controller::for_store(db.store("deployments", kube::Api::<Deployment>::all(client), kube_persist::StreamConfig::default())?)
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
    /// let cms = db.store("configmaps", kube::Api::<ConfigMap>::all(client), kube_persist::StreamConfig::default())?;
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
    ///     kube_persist::StreamConfig::default(), &ar)?;
    /// let controller = Controller::for_store(db.store("pods", kube::Api::<Pod>::all(client), kube_persist::StreamConfig::default())?)
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
    /// let controller = Controller::for_store(db.store("deployments", kube::Api::<Deployment>::all(client), kube_persist::StreamConfig::default())?)
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
    /// let controller = Controller::for_store(db.store("pods", kube::Api::<Pod>::all(client), kube_persist::StreamConfig::default())?)
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
    /// let (pods, pod_watcher) = db.store("pods", kube::Api::<Pod>::all(client.clone()), kube_persist::StreamConfig::default())?;
    /// let shared = pod_watcher.shared(1024);
    /// let controller = Controller::for_store(db.store("replicasets", kube::Api::<ReplicaSet>::all(client), kube_persist::StreamConfig::default())?)
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
    /// let (cms, cm_watcher) = db.store("cms", kube::Api::<ConfigMap>::all(client.clone()), kube_persist::StreamConfig::default())?;
    /// let shared = cm_watcher.shared(1024);
    /// let controller = Controller::for_store(db.store("pods", kube::Api::<Pod>::all(client), kube_persist::StreamConfig::default())?)
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
