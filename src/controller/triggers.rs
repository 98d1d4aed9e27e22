//! Trigger streams: what makes the controller schedule a reconcile.
//!
//! Every source (the main kind's persistent watcher, related kinds' persistent watchers,
//! plain streams, user triggers) becomes one boxed stream of [`Trigger`]s; the runner
//! merges them.

use futures::stream::{self, BoxStream};
use futures::{Stream, StreamExt};
use kube::Resource;
use kube::runtime::controller::{ReconcileReason, ReconcileRequest};
use kube::runtime::reflector::ObjectRef;
use serde::de::DeserializeOwned;

use super::controller_error::TriggerError;
use crate::sync::Touched;
use crate::sync::{Event, SharedEvent, Subscriber, Watcher};

/// One thing a trigger stream asks of the runner.
pub(crate) enum Trigger<K: Resource> {
    /// Schedule this object now.
    Request(ReconcileRequest<K>),
    /// Reconcile every stored object of the main kind (a pass over the store on disk).
    ReconcileAll,
    /// The main kind's subscriber of a shared watch missed events (all of them on disk): a
    /// durable controller reconciles what changed and forgets what is gone (the startup
    /// pass's merge); one without durable state reconciles every stored object.
    Lagged,
    /// The main kind's store is ready: after its first list (`cold`) or resumed from its
    /// checkpoint. The runner decides what to reconcile ([`Config::startup`](super::Config::startup)).
    Startup { cold: bool },
}

/// A boxed trigger stream.
pub(crate) type TriggerStream<K> = BoxStream<'static, Result<Trigger<K>, TriggerError>>;

/// A reference without the `extra` fields (uid, resourceVersion): equality and hashing
/// ignore them, and the scheduler may hold many references.
pub(crate) fn bare_ref<K: Resource>(obj: &K, dyntype: K::DynamicType) -> ObjectRef<K> {
    let mut r = ObjectRef::from_obj_with(obj, dyntype);
    r.extra = Default::default();
    r
}

/// The main kind's persistent watcher. Changes schedule the object itself; the end of the
/// first list (`InitDone`) and a warm restart (`Resumed`) are the startup. The first list's
/// objects (`InitApply`) are not scheduled one by one: the pass after `InitDone` reads
/// them back from disk in chunks, so the scheduler never receives the whole first list at
/// once.
pub(crate) fn main_kind<K>(watcher: Watcher<K>, dyntype: K::DynamicType) -> TriggerStream<K>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Clone + Send + Sync + 'static,
{
    watcher
        .events(true)
        .filter_map(move |ev| {
            futures::future::ready(match ev {
                // Shared with the hot cache: the reconcile gets this same object.
                Ok(Touched::Changed(obj)) => Some(Ok(Trigger::Request(ReconcileRequest {
                    obj_ref: bare_ref(obj.as_ref(), dyntype.clone()),
                    reason: ReconcileReason::ObjectUpdated,
                }))),
                Ok(Touched::Event(ev)) => trigger_of(&ev, &dyntype).map(Ok),
                Err(e) => Some(Err(TriggerError::Store(e))),
            })
        })
        .boxed()
}

/// The main kind's triggers from a subscriber of a shared watch: its events as
/// [`main_kind`] maps them, and a lag as [`Trigger::Lagged`] (what it missed is on disk).
pub(crate) fn shared_main<K>(sub: Subscriber<K>, dyntype: K::DynamicType) -> TriggerStream<K>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Clone + Send + Sync + 'static,
{
    sub.filter_map(move |ev| {
        futures::future::ready(match ev {
            Ok(SharedEvent::Event(ev)) => trigger_of(&ev, &dyntype).map(Ok),
            Ok(SharedEvent::Lagged) => Some(Ok(Trigger::Lagged)),
            Err(e) => Some(Err(TriggerError::Store(e))),
        })
    })
    .boxed()
}

/// What one event of the main kind's stream asks of the runner.
fn trigger_of<K>(ev: &Event<K>, dyntype: &K::DynamicType) -> Option<Trigger<K>>
where
    K: Resource,
    K::DynamicType: Clone,
{
    let request = |obj_ref| {
        Some(Trigger::Request(ReconcileRequest {
            obj_ref,
            reason: ReconcileReason::ObjectUpdated,
        }))
    };
    match ev {
        Event::Resumed { .. } => Some(Trigger::Startup { cold: false }),
        Event::InitDone => Some(Trigger::Startup { cold: true }),
        Event::Init | Event::InitApply(_) => None,
        Event::Apply(k) | Event::Delete(k) => request(bare_ref(k, dyntype.clone())),
        Event::DeleteKey(key) => {
            let obj_ref = ObjectRef::new_with(&key.name, dyntype.clone());
            request(match &key.namespace {
                Some(ns) => obj_ref.within(ns),
                None => obj_ref,
            })
        }
    }
}

/// Objects a persistent watcher touched (applied, listed or deleted); errors as
/// [`TriggerError::Store`].
pub(crate) fn touched<O>(
    watcher: Watcher<O>,
) -> impl Stream<Item = Result<Option<O>, TriggerError>> + Send
where
    O: Resource + DeserializeOwned + Send + Sync + 'static,
{
    watcher.stream().filter_map(|ev| {
        futures::future::ready(match ev {
            Ok(Event::Apply(o) | Event::InitApply(o) | Event::Delete(o)) => Some(Ok(Some(o))),
            // A related object is mapped from its body; without one there is nothing to map.
            Ok(Event::Resumed { .. } | Event::Init | Event::InitDone | Event::DeleteKey(_)) => None,
            Err(e) => Some(Err(TriggerError::Store(e))),
        })
    })
}

/// Objects a subscriber of a shared watch saw touched (cloned out of the shared event); a
/// lag as `None`: what it missed is on disk, so every object of the main kind is reconciled.
pub(crate) fn touched_shared<O>(
    sub: Subscriber<O>,
) -> impl Stream<Item = Result<Option<O>, TriggerError>> + Send
where
    O: Resource + Clone + DeserializeOwned + Send + Sync + 'static,
{
    sub.filter_map(|ev| {
        futures::future::ready(match ev {
            Ok(SharedEvent::Event(ev)) => match &*ev {
                Event::Apply(o) | Event::InitApply(o) | Event::Delete(o) => {
                    Some(Ok(Some(o.clone())))
                }
                _ => None,
            },
            Ok(SharedEvent::Lagged) => Some(Ok(None)),
            Err(e) => Some(Err(TriggerError::Store(e))),
        })
    })
}

/// Related objects mapped to the main kind's objects, with the reason kube-runtime uses;
/// `None` (related changes missed) reconciles every object of the main kind.
pub(crate) fn related<K, O, I, S>(
    objects: S,
    other_dyntype: O::DynamicType,
    mapper: impl Fn(O) -> I + Send + 'static,
) -> TriggerStream<K>
where
    K: Resource + 'static,
    K::DynamicType: Clone + Send,
    O: Resource + Send + 'static,
    O::DynamicType: Clone + Send + 'static,
    I: IntoIterator<Item = ObjectRef<K>>,
    S: Stream<Item = Result<Option<O>, TriggerError>> + Send + 'static,
{
    objects
        .flat_map(move |res| {
            let items: Vec<Result<Trigger<K>, TriggerError>> = match res {
                // Related changes were missed (a lagged subscriber): reconcile every object.
                Ok(None) => vec![Ok(Trigger::ReconcileAll)],
                Ok(Some(o)) => {
                    let watched = ObjectRef::from_obj_with(&o, other_dyntype.clone()).erase();
                    mapper(o)
                        .into_iter()
                        .map(|obj_ref| {
                            Ok(Trigger::Request(ReconcileRequest {
                                obj_ref,
                                reason: ReconcileReason::RelatedObjectUpdated {
                                    obj_ref: Box::new(watched.clone()),
                                },
                            }))
                        })
                        .collect()
                }
                Err(e) => vec![Err(e)],
            };
            stream::iter(items)
        })
        .boxed()
}

/// The owners of `child` that are of the main kind `K` (by apiVersion and kind).
pub(crate) fn owners<K, O>(child: &O, dyntype: &K::DynamicType) -> Vec<ObjectRef<K>>
where
    K: Resource,
    K::DynamicType: Clone,
    O: Resource,
{
    let meta = child.meta();
    let ns = meta.namespace.as_deref();
    meta.owner_references
        .iter()
        .flatten()
        .filter_map(|owner| ObjectRef::from_owner_ref(ns, owner, dyntype.clone()))
        .collect()
}

/// User-supplied references, scheduled as `Unknown` (kube-runtime's `reconcile_on`).
pub(crate) fn refs<K>(refs: impl Stream<Item = ObjectRef<K>> + Send + 'static) -> TriggerStream<K>
where
    K: Resource + 'static,
{
    refs.map(|obj_ref| Ok(Trigger::Request(ReconcileRequest::from(obj_ref))))
        .boxed()
}

/// User-supplied "reconcile everything" ticks (kube-runtime's `reconcile_all_on`).
pub(crate) fn all_on<K>(ticks: impl Stream<Item = ()> + Send + 'static) -> TriggerStream<K>
where
    K: Resource + 'static,
{
    ticks.map(|()| Ok(Trigger::ReconcileAll)).boxed()
}
