//! Watcher configuration, in the style of `kube::runtime::watcher::Config`.

use std::any::Any;
use std::sync::Arc;

use kube::Resource;
use std::time::Duration;

/// A transform applied to each object's JSON before it is written (e.g. to drop fields).
pub type Transform = Arc<dyn Fn(&mut serde_json::Value) + Send + Sync>;

/// How the watcher lists and watches.
///
/// ```
/// use std::time::Duration;
/// let cfg = kube_persist::Config::default()
///     .labels("app=web")
///     .page_size(1000)
///     .drop_managed_fields();
/// assert_eq!(cfg.page_size, 1000);
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct Config {
    /// Label selector (part of the store identity).
    pub label_selector: Option<String>,
    /// Field selector (part of the store identity).
    pub field_selector: Option<String>,
    /// Objects per LIST page, and the most events applied in one batch. Default 500.
    pub page_size: u32,
    /// Use streaming lists (`sendInitialEvents=true`) instead of paginated LISTs.
    pub streaming_lists: bool,
    /// Server-side watch timeout in seconds (default 290, as kube-runtime).
    pub timeout: u32,
    /// Decode each incoming object into the store's type before writing it, and skip (and
    /// count) objects that fail. Default on: a bad object is caught at the door, not at `get`.
    pub validate: bool,
    /// Objects larger than this many bytes of JSON are skipped and counted (default 16 MiB).
    pub max_object_bytes: usize,
    /// First retry delay after an error; doubles up to `max_backoff`, with jitter.
    pub min_backoff: Duration,
    /// Largest retry delay.
    pub max_backoff: Duration,
    /// A relist after `410 Gone` waits a random delay up to this, so that many clients
    /// relisting after an apiserver restart spread out (default 1 s).
    pub relist_jitter: Duration,
    /// Bytes of decoded objects kept for `Reader::get` (estimated; 0 disables). Default 8 MiB.
    pub hot_cache_bytes: usize,
    /// How many `ResourceVersionTooLarge` answers to retry before relisting (default 5).
    pub too_large_retries: u32,
    /// Whether this stream holds sensitive data (default: only for `Secret`).
    pub sensitive: Option<bool>,
    /// Opt-in to writing sensitive objects (Secrets) to disk.
    pub allow_sensitive_data: bool,
    /// Store only each object's key, uid and resourceVersion (see [`Config::keys_only`]).
    pub keys_only: bool,
    pub(crate) transform: Option<(String, Transform)>,
    pub(crate) indexes: Vec<(String, Arc<dyn Any + Send + Sync>)>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            label_selector: None,
            field_selector: None,
            page_size: 500,
            streaming_lists: false,
            timeout: 290,
            validate: true,
            max_object_bytes: 16 << 20,
            min_backoff: Duration::from_millis(800),
            max_backoff: Duration::from_secs(30),
            relist_jitter: Duration::from_secs(1),
            too_large_retries: 5,
            hot_cache_bytes: 8 << 20,
            sensitive: None,
            allow_sensitive_data: false,
            keys_only: false,
            transform: None,
            indexes: Vec::new(),
        }
    }
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("label_selector", &self.label_selector)
            .field("field_selector", &self.field_selector)
            .field("page_size", &self.page_size)
            .field("streaming_lists", &self.streaming_lists)
            .field("timeout", &self.timeout)
            .field("validate", &self.validate)
            .field("transform", &self.transform.as_ref().map(|t| &t.0))
            .finish_non_exhaustive()
    }
}

impl Config {
    /// Only objects matching this label selector.
    pub fn labels(mut self, selector: &str) -> Self {
        self.label_selector = Some(selector.to_string());
        self
    }

    /// Only objects matching this field selector.
    pub fn fields(mut self, selector: &str) -> Self {
        self.field_selector = Some(selector.to_string());
        self
    }

    /// Objects per LIST page (and per batch of events). Values below 1 are raised to 1.
    pub fn page_size(mut self, n: u32) -> Self {
        self.page_size = n.max(1);
        self
    }

    /// Use streaming lists (`sendInitialEvents=true`, Kubernetes 1.27+ with the
    /// `WatchList` feature) for the initial list and relists; events are written in pages.
    pub fn streaming_lists(mut self) -> Self {
        self.streaming_lists = true;
        self
    }

    /// Server-side watch timeout in seconds.
    pub fn timeout(mut self, seconds: u32) -> Self {
        self.timeout = seconds;
        self
    }

    /// Whether to decode each object into the store's type before writing it.
    pub fn validate(mut self, on: bool) -> Self {
        self.validate = on;
        self
    }

    /// Delay range of the jittered exponential backoff.
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        self.min_backoff = min;
        self.max_backoff = max.max(min);
        self
    }

    /// Bytes of decoded objects cached for `Reader::get` (an estimate: about 10x the JSON
    /// size per object). Hits cost a lock and an `Arc` clone; 0 disables the cache.
    pub fn hot_cache(mut self, bytes: usize) -> Self {
        self.hot_cache_bytes = bytes;
        self
    }

    /// Upper bound of the random delay before a relist (zero disables it).
    pub fn relist_jitter(mut self, d: Duration) -> Self {
        self.relist_jitter = d;
        self
    }

    /// Apply `f` to each object's JSON before writing it. `name` identifies the transform
    /// in the store identity: change it when `f` changes, so old data is not resumed.
    pub fn transform(
        mut self,
        name: &str,
        f: impl Fn(&mut serde_json::Value) + Send + Sync + 'static,
    ) -> Self {
        self.transform = Some((name.to_string(), Arc::new(f)));
        self
    }

    /// Mark this stream's kind as sensitive (or not), overriding the default (only `Secret`
    /// is). Sensitive streams need [`Config::allow_sensitive_data`].
    pub fn sensitive(mut self, sensitive: bool) -> Self {
        self.sensitive = Some(sensitive);
        self
    }

    /// Accept writing sensitive objects (e.g. Secrets, ServiceAccount tokens) to disk.
    ///
    /// An in-memory cache dies with its process; this one leaves the data on disk. Prefer a
    /// metadata-only store, or a transform that drops `data`/`stringData`, when the
    /// controller does not need the values; otherwise encrypt the store
    /// (`DbConfig::encryption_key`) and keep its directory private.
    pub fn allow_sensitive_data(mut self) -> Self {
        self.allow_sensitive_data = true;
        self
    }

    /// Maintain a secondary index `name` on disk: `f` maps an object to the values it is
    /// found under with `Reader::by_index(name, value)` (client-go's Indexers). Entries are
    /// written in the same atomic batch as the object and removed with it. An index added to
    /// an existing store is built from disk, page by page, when the watcher starts.
    ///
    /// ```
    /// use k8s_openapi::api::core::v1::Pod;
    /// let cfg = kube_persist::Config::default().index("node", |p: &Pod| {
    ///     p.spec.as_ref().and_then(|s| s.node_name.clone()).into_iter().collect()
    /// });
    /// # let _ = cfg;
    /// ```
    pub fn index<K: 'static>(
        mut self,
        name: &str,
        f: impl Fn(&K) -> Vec<String> + Send + Sync + 'static,
    ) -> Self {
        let f: super::index::IndexFn<K> = Arc::new(f);
        self.indexes.retain(|(n, _)| n != name);
        self.indexes.push((name.to_string(), Arc::new(f)));
        self
    }

    /// Index objects by the value of label `key`, under the index name `label:<key>`.
    /// `Reader::select` uses it for selectors with `key=value` or `key in (...)`.
    pub fn label_index<K: Resource + 'static>(self, key: &str) -> Self {
        let k = key.to_string();
        self.index(&format!("label:{key}"), move |obj: &K| {
            obj.meta()
                .labels
                .as_ref()
                .and_then(|l| l.get(&k))
                .cloned()
                .into_iter()
                .collect()
        })
    }

    pub(crate) fn index_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.indexes.iter().map(|(n, _)| n.clone()).collect();
        names.sort();
        names
    }

    /// Keys-only mode, between a watch and an informer: the store keeps only each object's
    /// key, uid and resourceVersion on disk, not its body. The event stream still carries
    /// the full objects as the server sends them, and after a restart or a `410` relist it
    /// yields only the real differences (no flood of re-adds); memory stays bounded by one
    /// page. Deletions found by a relist carry an object with only `apiVersion`, `kind`,
    /// name, namespace, uid and resourceVersion. `Reader::get`/`iter` are not available.
    ///
    /// Use it to ship events (audit, sync to another system, triggers) exactly once per
    /// change; use the full store when the controller reads objects back.
    pub fn keys_only(mut self) -> Self {
        self.keys_only = true;
        self
    }

    /// Drop `metadata.managedFields` before writing (often half of an object's size).
    pub fn drop_managed_fields(self) -> Self {
        self.transform("drop-managed-fields", |v| {
            if let Some(meta) = v.get_mut("metadata").and_then(|m| m.as_object_mut()) {
                meta.remove("managedFields");
            }
        })
    }
}
