//! Resource types served by the test server, request verbs and request counters.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

/// A served resource type (group/version/plural/kind + scope). Objects are handled as
/// generic JSON; the only per-kind behaviour is the scope.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ResourceType {
    /// API group, `""` for the core group.
    pub group: String,
    /// API version, e.g. `v1`.
    pub version: String,
    /// Lowercase plural used in URLs, e.g. `pods`.
    pub plural: String,
    /// Kind, e.g. `Pod`.
    pub kind: String,
    /// Whether objects live in a namespace.
    pub namespaced: bool,
}

impl ResourceType {
    /// Builds a resource type.
    pub fn new(group: &str, version: &str, plural: &str, kind: &str, namespaced: bool) -> Self {
        Self {
            group: group.into(),
            version: version.into(),
            plural: plural.into(),
            kind: kind.into(),
            namespaced,
        }
    }

    /// core/v1 Pods.
    pub fn pods() -> Self {
        Self::new("", "v1", "pods", "Pod", true)
    }

    /// core/v1 ConfigMaps.
    pub fn configmaps() -> Self {
        Self::new("", "v1", "configmaps", "ConfigMap", true)
    }

    /// core/v1 Namespaces (cluster-scoped).
    pub fn namespaces() -> Self {
        Self::new("", "v1", "namespaces", "Namespace", false)
    }

    /// apps/v1 Deployments.
    pub fn deployments() -> Self {
        Self::new("apps", "v1", "deployments", "Deployment", true)
    }

    /// The `example.kube-persist.dev/v1` `Widget` custom resource (namespaced).
    pub fn widgets() -> Self {
        Self::new("example.kube-persist.dev", "v1", "widgets", "Widget", true)
    }

    /// `apiVersion` as it appears in objects: `v1` or `apps/v1`.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// The plural qualified by group, as used in error messages (`pods`, `deployments.apps`).
    pub(crate) fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.plural.clone()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }

    /// The resource types every server serves from the start.
    pub(crate) fn builtin() -> Vec<Self> {
        vec![
            Self::pods(),
            Self::configmaps(),
            Self::namespaces(),
            Self::deployments(),
            Self::widgets(),
        ]
    }
}

/// Number of requests served per verb since start (or the last reset).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestCounts {
    /// LIST requests that may return more than one object (each page counts once): the
    /// requests of a list or relist.
    pub list: u64,
    /// LIST requests with `limit=1`, not counted in `list`: a client reading the server's
    /// current resourceVersion (kube-persist does before a watch connects while the store
    /// catches up), not listing the collection.
    #[serde(default)]
    pub list_one: u64,
    /// LIST requests whose field selector pins one object's name (`metadata.name=<name>`),
    /// not counted in `list`: a client fetching one object by LIST (kube-persist's delta
    /// relist fetches a changed body so, within the stream's selection).
    #[serde(default)]
    pub list_named: u64,
    /// The most LISTs narrowed to one object by name (as counted in `list_named`) that the
    /// server was answering at once: how many fetches a client keeps in flight
    /// ([`Faults::named_list_delay`](crate::Faults::named_list_delay) makes them overlap).
    #[serde(default)]
    pub list_named_max_in_flight: u64,
    /// WATCH requests.
    pub watch: u64,
    /// GET of a single object.
    pub get: u64,
    /// POST (create).
    pub create: u64,
    /// PUT (replace).
    pub update: u64,
    /// DELETE.
    pub delete: u64,
    /// PATCH (merge or apply).
    #[serde(default)]
    pub patch: u64,
}

/// A request verb, for counters and fault injection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verb {
    /// LIST a collection (one page).
    List,
    /// WATCH a collection.
    Watch,
    /// GET one object.
    Get,
    /// POST a new object.
    Create,
    /// PUT an existing object.
    Update,
    /// DELETE an object.
    Delete,
    /// PATCH an object (JSON merge patch, or server-side apply).
    Patch,
}

impl Verb {
    /// Parses `list`, `watch`, `get`, `create`, `update`/`replace`, `delete`, `patch`
    /// (case-insensitive).
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "list" => Some(Self::List),
            "watch" => Some(Self::Watch),
            "get" => Some(Self::Get),
            "create" => Some(Self::Create),
            "update" | "replace" => Some(Self::Update),
            "delete" => Some(Self::Delete),
            "patch" => Some(Self::Patch),
            _ => None,
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Lock-free per-verb counters: per verb, LISTs of one (`limit=1`), LISTs narrowed to one
/// name, and those in flight now and at most.
#[derive(Debug, Default)]
pub(crate) struct Counters([AtomicU64; 7], AtomicU64, AtomicU64, NamedInFlight);

/// LISTs narrowed to one name being answered, and the most at once.
#[derive(Debug, Default)]
struct NamedInFlight {
    now: AtomicU64,
    max: AtomicU64,
}

/// One LIST narrowed to one name in flight, from its arrival until its answer is built
/// (dropped).
pub(crate) struct NamedListInFlight<'a>(&'a Counters);

impl Drop for NamedListInFlight<'_> {
    fn drop(&mut self) {
        self.0.3.now.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Counters {
    pub(crate) fn incr(&self, verb: Verb) {
        self.0[verb.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// A LIST with `limit=1` (counted apart from `list`).
    pub(crate) fn incr_list_one(&self) {
        self.1.fetch_add(1, Ordering::Relaxed);
    }

    /// A LIST narrowed to one object by name (counted apart from `list`).
    pub(crate) fn incr_list_named(&self) {
        self.2.fetch_add(1, Ordering::Relaxed);
    }

    /// A LIST narrowed to one name arrives: in flight until the guard is dropped.
    pub(crate) fn named_list_in_flight(&self) -> NamedListInFlight<'_> {
        let now = self.3.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.3.max.fetch_max(now, Ordering::SeqCst);
        NamedListInFlight(self)
    }

    pub(crate) fn snapshot(&self) -> RequestCounts {
        let g = |v: Verb| self.0[v.index()].load(Ordering::Relaxed);
        RequestCounts {
            list: g(Verb::List),
            list_one: self.1.load(Ordering::Relaxed),
            list_named: self.2.load(Ordering::Relaxed),
            list_named_max_in_flight: self.3.max.load(Ordering::SeqCst),
            watch: g(Verb::Watch),
            get: g(Verb::Get),
            create: g(Verb::Create),
            update: g(Verb::Update),
            delete: g(Verb::Delete),
            patch: g(Verb::Patch),
        }
    }

    pub(crate) fn reset(&self) {
        for c in &self.0 {
            c.store(0, Ordering::Relaxed);
        }
        self.1.store(0, Ordering::Relaxed);
        self.2.store(0, Ordering::Relaxed);
        // The most in flight since the reset: those in flight now.
        self.3
            .max
            .store(self.3.now.load(Ordering::SeqCst), Ordering::SeqCst);
    }
}
