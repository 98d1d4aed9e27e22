//! Predicates on the controlled kind: kube-runtime's (`predicates::generation`,
//! `resource_version`, `labels`, `annotations`, `finalizers`, or any `Fn(&K) -> Option<u64>`)
//! filter the changes of the controlled objects, as `WatchStreamExt::predicate_filter` and
//! controller-runtime's predicates do. A change is skipped when the predicate's value equals
//! its value at the last successful reconcile of the same object (the same uid: a create
//! always passes) and no reconcile failed since; a predicate without a value (`None`, e.g.
//! a kind without `metadata.generation`) never skips. With durable state the value is kept
//! in the reconcile state on disk (a restart's pass filters with it too); without, in
//! memory, one entry per reconciled object, each dropped after [`PredicateConfig::ttl`]
//! without a reconcile (then its next change passes).

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Arc;
use std::time::Duration;

use kube::Resource;
use kube::runtime::reflector::ObjectRef;
use tokio::time::Instant;

/// A predicate, shared with the startup pass's reads.
pub(crate) type PredicateFn<K> = Arc<dyn Fn(&K) -> Option<u64> + Send + Sync>;

/// Options of [`Controller::predicate_filter`](super::Controller::predicate_filter), in the
/// shape of kube-runtime's `PredicateConfig` (`Default::default()` is the usual argument).
///
/// ```
/// use std::time::Duration;
/// use kube_persist::controller::PredicateConfig;
/// let config = PredicateConfig::default().ttl(Duration::from_secs(600));
/// assert_eq!(config.get_ttl(), Duration::from_secs(600));
/// assert_eq!(PredicateConfig::default().get_ttl(), Duration::from_secs(3600));
/// ```
#[derive(Debug, Clone)]
pub struct PredicateConfig {
    ttl: Duration,
}

impl Default for PredicateConfig {
    fn default() -> Self {
        // kube-runtime's default: long enough to avoid needless reconciles, short enough
        // to bound the memory of objects that stopped changing.
        PredicateConfig {
            ttl: Duration::from_secs(3600),
        }
    }
}

impl PredicateConfig {
    /// Without durable state: how long the predicate's value at an object's last
    /// successful reconcile is remembered (in memory) without another reconcile of it
    /// (default one hour). With durable state the values are on disk and never expire.
    ///
    /// ```
    /// use std::time::Duration;
    /// let config = kube_persist::controller::PredicateConfig::default().ttl(Duration::from_secs(60));
    /// assert_eq!(config.get_ttl(), Duration::from_secs(60));
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// The configured time to live.
    ///
    /// ```
    /// use std::time::Duration;
    /// assert_eq!(kube_persist::controller::PredicateConfig::default().get_ttl(), Duration::from_secs(3600));
    /// ```
    pub fn get_ttl(&self) -> Duration {
        self.ttl
    }
}

/// The value an object's last successful reconcile saw, kept in memory.
struct Seen {
    uid: Option<String>,
    value: u64,
    at: Instant,
}

/// A controller's predicate and, without durable state, what it remembers.
pub(crate) struct Filter<K: Resource> {
    pub(crate) predicate: PredicateFn<K>,
    config: PredicateConfig,
    seen: HashMap<ObjectRef<K>, Seen>,
    last_evicted: Instant,
}

impl<K> Filter<K>
where
    K: Resource,
    K::DynamicType: Eq + Hash + Clone,
{
    pub(crate) fn new(predicate: PredicateFn<K>, config: PredicateConfig) -> Self {
        Filter {
            predicate,
            config,
            seen: HashMap::new(),
            last_evicted: Instant::now(),
        }
    }

    /// The predicate's value for `obj`.
    pub(crate) fn value(&self, obj: &K) -> Option<u64> {
        (self.predicate)(obj)
    }

    /// In memory: whether the last successful reconcile of `obj` (the same uid, within the
    /// time to live) saw the predicate's value it has now.
    pub(crate) fn unchanged(&mut self, obj_ref: &ObjectRef<K>, obj: &K) -> bool {
        let now = Instant::now();
        self.evict(now);
        let Some(value) = self.value(obj) else {
            return false;
        };
        self.seen.get(obj_ref).is_some_and(|seen| {
            seen.value == value
                && seen.uid.as_deref() == obj.meta().uid.as_deref()
                && now.duration_since(seen.at) < self.config.ttl
        })
    }

    /// In memory: a reconcile of `obj` ended (`ok` or not).
    pub(crate) fn reconciled(&mut self, obj_ref: &ObjectRef<K>, obj: &K, ok: bool) {
        match self.value(obj).filter(|_| ok) {
            Some(value) => {
                let seen = Seen {
                    uid: obj.meta().uid.clone(),
                    value,
                    at: Instant::now(),
                };
                self.seen.insert(obj_ref.clone(), seen);
            }
            None => {
                self.seen.remove(obj_ref);
            }
        }
    }

    /// In memory: the object is gone.
    pub(crate) fn forget(&mut self, obj_ref: &ObjectRef<K>) {
        self.seen.remove(obj_ref);
    }

    /// Drops the entries older than the time to live, at most once per time to live.
    fn evict(&mut self, now: Instant) {
        let ttl = self.config.ttl;
        if now.duration_since(self.last_evicted) >= ttl {
            self.seen
                .retain(|_, seen| now.duration_since(seen.at) < ttl);
            self.last_evicted = now;
        }
    }
}
