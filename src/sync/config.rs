//! Watcher configuration, in the style of `kube::runtime::watcher::Config`.
//!
//! Longer than 600 lines because it is one public builder: one method per option, each with
//! its doc and example, and the checks that clamp them. Splitting it would scatter one type.

use std::any::Any;
use std::sync::Arc;

use kube::Resource;
use std::time::Duration;

use crate::model::{Shard, ShardKey};

/// A transform applied to each object's JSON before it is written (e.g. to drop fields).
///
/// ```
/// use std::sync::Arc;
/// let drop_annotations: kube_persist::Transform = Arc::new(|obj| {
///     if let Some(meta) = obj["metadata"].as_object_mut() {
///         meta.remove("annotations");
///     }
/// });
/// let mut pod = serde_json::json!({"metadata": {"name": "a", "annotations": {"x": "y"}}});
/// drop_annotations(&mut pod);
/// assert_eq!(pod, serde_json::json!({"metadata": {"name": "a"}}));
/// ```
pub type Transform = Arc<dyn Fn(&mut serde_json::Value) + Send + Sync>;

/// The name [`StreamConfig::drop_secret_data`] has in the store identity.
const DROP_SECRET_DATA: &str = "drop-secret-data";

/// The annotation `kubectl apply` (client-side) sets to the whole object as applied.
pub(crate) const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// Remove what holds a Secret's (or ConfigMap's) values: `data`, `stringData`,
/// `binaryData` and the last-applied annotation.
fn drop_secret_values(v: &mut serde_json::Value) {
    let Some(obj) = v.as_object_mut() else {
        return;
    };
    for field in ["data", "stringData", "binaryData"] {
        obj.remove(field);
    }
    if let Some(annotations) = obj
        .get_mut("metadata")
        .and_then(|m| m.get_mut("annotations"))
        .and_then(|a| a.as_object_mut())
    {
        annotations.remove(LAST_APPLIED);
    }
}

/// An index function as [`StreamConfig::index`] keeps it (type-erased in the config by the
/// object type `K`, recovered by `indexers::inspector`).
pub(crate) type IndexFn<K> = Arc<dyn Fn(&K) -> Vec<String> + Send + Sync>;

/// How the watcher lists and watches.
///
/// Fields are set through methods that keep them valid (out-of-range values are clamped
/// and documented as such), so a `StreamConfig` can never make the watcher loop or send an
/// invalid request.
///
/// ```
/// use std::time::Duration;
/// let cfg = kube_persist::StreamConfig::default()
///     .labels("app=web")
///     .page_size(1000)
///     .timeout(600) // above kube-apiserver's limit: clamped
///     .drop_managed_fields();
/// assert_eq!(cfg.get_page_size(), 1000);
/// assert_eq!(cfg.get_timeout(), kube_persist::StreamConfig::MAX_TIMEOUT);
/// ```
#[derive(Clone)]
#[must_use = "a StreamConfig does nothing until given to Db::store"]
pub struct StreamConfig {
    pub(crate) label_selector: Option<String>,
    pub(crate) field_selector: Option<String>,
    pub(crate) page_size: u32,
    pub(crate) streaming_lists: bool,
    pub(crate) initial_events_timeout: Duration,
    pub(crate) timeout: u32,
    pub(crate) validate: bool,
    pub(crate) max_object_bytes: usize,
    pub(crate) max_page_bytes: usize,
    pub(crate) min_backoff: Duration,
    pub(crate) max_backoff: Duration,
    pub(crate) relist_jitter: Duration,
    pub(crate) relist_backoff_reset: Duration,
    pub(crate) hot_cache_bytes: usize,
    pub(crate) too_large_retries: u32,
    pub(crate) sensitive: Option<bool>,
    pub(crate) allow_sensitive_data: bool,
    /// [`StreamConfig::drop_secret_data`]: run last, after every transform.
    pub(crate) drop_secret_data: bool,
    pub(crate) keys_only: bool,
    pub(crate) transform: Option<(String, Transform)>,
    pub(crate) indexes: Vec<(String, Arc<dyn Any + Send + Sync>)>,
    /// The shard kept, or why the requested one is invalid (reported by `check`).
    pub(crate) shard: Option<std::result::Result<Shard, String>>,
    pub(crate) relist_mode: RelistMode,
}

impl Default for StreamConfig {
    fn default() -> Self {
        StreamConfig {
            label_selector: None,
            field_selector: None,
            page_size: 500,
            streaming_lists: false,
            initial_events_timeout: Duration::from_secs(30),
            timeout: 290,
            validate: true,
            max_object_bytes: 16 << 20,
            max_page_bytes: 1 << 30,
            min_backoff: Duration::from_millis(800),
            max_backoff: Duration::from_secs(30),
            relist_jitter: Duration::from_secs(1),
            relist_backoff_reset: Duration::from_secs(120),
            too_large_retries: 5,
            hot_cache_bytes: 8 << 20,
            sensitive: None,
            allow_sensitive_data: false,
            drop_secret_data: false,
            keys_only: false,
            transform: None,
            indexes: Vec::new(),
            shard: None,
            relist_mode: RelistMode::Auto,
        }
    }
}

impl std::fmt::Debug for StreamConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamConfig")
            .field("label_selector", &self.label_selector)
            .field("field_selector", &self.field_selector)
            .field("page_size", &self.page_size)
            .field("streaming_lists", &self.streaming_lists)
            .field("timeout", &self.timeout)
            .field("validate", &self.validate)
            .field("transform", &self.transform_name())
            .field("shard", &self.shard)
            .field("relist_mode", &self.relist_mode)
            .finish_non_exhaustive()
    }
}

impl StreamConfig {
    /// The largest page size ([`StreamConfig::page_size`] clamps to it).
    ///
    /// ```
    /// use kube_persist::StreamConfig;
    /// assert_eq!(StreamConfig::default().page_size(1_000_000).get_page_size(), StreamConfig::MAX_PAGE_SIZE);
    /// ```
    pub const MAX_PAGE_SIZE: u32 = 100_000;
    /// The largest server-side watch timeout in seconds (kube-apiserver and kube-rs reject
    /// 295 and above).
    ///
    /// ```
    /// use kube_persist::StreamConfig;
    /// assert_eq!(StreamConfig::default().timeout(3600).get_timeout(), StreamConfig::MAX_TIMEOUT);
    /// ```
    pub const MAX_TIMEOUT: u32 = 294;

    /// The label selector, if any (part of the store identity).
    ///
    /// ```
    /// use kube_persist::StreamConfig;
    /// assert_eq!(StreamConfig::default().get_label_selector(), None);
    /// assert_eq!(StreamConfig::default().labels("app=web").get_label_selector(), Some("app=web"));
    /// ```
    pub fn get_label_selector(&self) -> Option<&str> {
        self.label_selector.as_deref()
    }

    /// The field selector, if any (part of the store identity).
    ///
    /// ```
    /// use kube_persist::StreamConfig;
    /// assert_eq!(StreamConfig::default().get_field_selector(), None);
    /// let cfg = StreamConfig::default().fields("status.phase=Running");
    /// assert_eq!(cfg.get_field_selector(), Some("status.phase=Running"));
    /// ```
    pub fn get_field_selector(&self) -> Option<&str> {
        self.field_selector.as_deref()
    }

    /// Objects per LIST page and per batch of events.
    ///
    /// ```
    /// use kube_persist::StreamConfig;
    /// assert_eq!(StreamConfig::default().get_page_size(), 500);
    /// assert_eq!(StreamConfig::default().page_size(2000).get_page_size(), 2000);
    /// ```
    pub fn get_page_size(&self) -> u32 {
        self.page_size
    }

    /// Whether streaming lists are used.
    ///
    /// ```
    /// use kube_persist::StreamConfig;
    /// assert!(!StreamConfig::default().get_streaming_lists());
    /// assert!(StreamConfig::default().streaming_lists().get_streaming_lists());
    /// ```
    pub fn get_streaming_lists(&self) -> bool {
        self.streaming_lists
    }

    /// The server-side watch timeout in seconds.
    ///
    /// ```
    /// use kube_persist::StreamConfig;
    /// assert_eq!(StreamConfig::default().get_timeout(), 290);
    /// assert_eq!(StreamConfig::default().timeout(60).get_timeout(), 60);
    /// ```
    pub fn get_timeout(&self) -> u32 {
        self.timeout
    }

    /// The largest object, in bytes of JSON, that is stored.
    ///
    /// ```
    /// use kube_persist::StreamConfig;
    /// assert_eq!(StreamConfig::default().get_max_object_bytes(), 16 << 20);
    /// assert_eq!(StreamConfig::default().max_object_bytes(1 << 20).get_max_object_bytes(), 1 << 20);
    /// ```
    pub fn get_max_object_bytes(&self) -> usize {
        self.max_object_bytes
    }

    /// The longest watch line read: the largest object plus room for its event envelope.
    pub(crate) fn max_line_bytes(&self) -> usize {
        self.max_object_bytes.saturating_add(4096)
    }

    /// Whether only keys, uids and resourceVersions are stored.
    ///
    /// ```
    /// use kube_persist::StreamConfig;
    /// assert!(!StreamConfig::default().get_keys_only());
    /// assert!(StreamConfig::default().keys_only().get_keys_only());
    /// ```
    pub fn get_keys_only(&self) -> bool {
        self.keys_only
    }

    /// Check the configuration as a whole; [`Error::InvalidArgument`](crate::Error::InvalidArgument) names
    /// the field at fault. The setters already keep each field in range, so this only
    /// catches combinations.
    pub(crate) fn check(&self) -> crate::model::Result<()> {
        let bad = |field: &str, why: &str| {
            Err(crate::model::Error::InvalidArgument {
                detail: format!("StreamConfig::{field}: {why}"),
            })
        };
        if self.page_size == 0 || self.page_size > Self::MAX_PAGE_SIZE {
            return bad("page_size", "must be between 1 and MAX_PAGE_SIZE");
        }
        if self.timeout == 0 || self.timeout > Self::MAX_TIMEOUT {
            return bad("timeout", "must be between 1 and MAX_TIMEOUT seconds");
        }
        for (field, sel) in [
            ("labels", &self.label_selector),
            ("fields", &self.field_selector),
        ] {
            if sel.as_deref().is_some_and(|s| s.contains(['\n', '\0'])) {
                return bad(field, "selector contains a newline or NUL");
            }
        }
        match &self.shard {
            Some(Err(why)) => return bad("shards", why),
            Some(Ok(shard)) => shard.check()?,
            None => {}
        }
        Ok(())
    }

    /// Keep only one shard of the collection (see [`Shard`]): the `shardSelector` list
    /// option is sent on every LIST and WATCH (kube-apiserver 1.36+ with the
    /// `ShardedListAndWatch` feature gate then sends only the shard), and the store drops
    /// any object outside it, so a server without the feature costs bandwidth, not
    /// correctness ([`Stats::shard_client_filtered`](crate::Stats::shard_client_filtered)
    /// counts them, and one warning is logged). Part of the store identity; reopening a
    /// store with a shard inside its stored one prunes the objects outside it instead of
    /// listing again.
    ///
    /// Which key: `ShardKey::Namespace` keeps owners and their children (same namespace)
    /// in one replica; `ShardKey::Uid` spreads a single kind evenly.
    ///
    /// ```
    /// use kube_persist::{StreamConfig, Shard, ShardKey};
    /// let cfg = StreamConfig::default().shard(Shard::new(ShardKey::Uid).range(0, 1 << 63));
    /// assert!(cfg.get_shard().is_some());
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn shard(mut self, shard: Shard) -> Self {
        self.shard = Some(Ok(shard));
        self
    }

    /// Keep shard `index` of `count` even slices of the uid hash space: replica `index` of a
    /// controller run as `count` replicas. `index >= count` is reported when the store is
    /// opened ([`Error::InvalidArgument`](crate::Error::InvalidArgument)).
    ///
    /// ```
    /// let cfg = kube_persist::StreamConfig::default().shards(1, 3);
    /// assert_eq!(cfg.get_shard().unwrap().ranges().len(), 1);
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn shards(mut self, index: u32, count: u32) -> Self {
        self.shard = Some(Shard::even(ShardKey::Uid, index, count).map_err(|e| e.to_string()));
        self
    }

    /// The shard kept, if any (and valid).
    ///
    /// ```
    /// use kube_persist::{StreamConfig, ShardKey};
    /// assert!(StreamConfig::default().get_shard().is_none());
    /// let shard = StreamConfig::default().shards(0, 2).get_shard().cloned().unwrap();
    /// assert_eq!(shard.key(), ShardKey::Uid);
    /// // An invalid shard is not kept: the store reports it when opened.
    /// assert!(StreamConfig::default().shards(2, 2).get_shard().is_none());
    /// ```
    pub fn get_shard(&self) -> Option<&Shard> {
        self.shard.as_ref().and_then(|s| s.as_ref().ok())
    }
    /// Only objects matching this label selector.
    ///
    /// ```
    /// let cfg = kube_persist::StreamConfig::default().labels("app=web,tier!=cache");
    /// assert_eq!(cfg.get_label_selector(), Some("app=web,tier!=cache"));
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn labels(mut self, selector: &str) -> Self {
        self.label_selector = Some(selector.to_string());
        self
    }

    /// Only objects matching this field selector.
    ///
    /// ```
    /// let cfg = kube_persist::StreamConfig::default().fields("spec.nodeName=node-1");
    /// assert_eq!(cfg.get_field_selector(), Some("spec.nodeName=node-1"));
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn fields(mut self, selector: &str) -> Self {
        self.field_selector = Some(selector.to_string());
        self
    }

    /// Objects per LIST page (and per batch of events). Default 500. Clamped to
    /// `1..=`[`StreamConfig::MAX_PAGE_SIZE`]: `0` would mean "no limit" to the API server (the
    /// whole collection in one response), which this store exists to avoid.
    ///
    /// A list slower than the server keeps its continue tokens (kube-apiserver's expire
    /// when etcd compacts the list's revision, every 5 minutes by default) gets `410` for
    /// its next page: the store lists again in a new epoch (objects it already wrote are
    /// kept, unchanged ones are only marked), and each expiry in a row doubles the page
    /// size of the next attempt, up to 16 times this one (memory grows with it), so the
    /// list completes; the page size returns to this one after a complete list.
    ///
    /// ```
    /// use kube_persist::StreamConfig;
    /// assert_eq!(StreamConfig::default().page_size(100).get_page_size(), 100);
    /// assert_eq!(StreamConfig::default().page_size(0).get_page_size(), 1); // never "no limit"
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn page_size(mut self, n: u32) -> Self {
        self.page_size = n.clamp(1, Self::MAX_PAGE_SIZE);
        self
    }

    /// Use streaming lists (`sendInitialEvents=true`, Kubernetes 1.27+ with the
    /// `WatchList` feature) for the initial list and relists; events are written in pages.
    ///
    /// A server that rejects streaming lists (the `WatchList` gate off, or a storage
    /// without the feature it needs) or ignores them (older servers) is detected, logged
    /// once, and the stream falls back to paginated LISTs, as client-go does. So does a
    /// stream whose streaming lists are cut before their end bookmark three times in a
    /// row (a `timeoutSeconds` or a load balancer's stream lifetime shorter than the
    /// initial events take); each cut waits the [`StreamConfig::backoff`] first.
    ///
    /// ```
    /// let cfg = kube_persist::StreamConfig::default().streaming_lists();
    /// assert!(cfg.get_streaming_lists());
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn streaming_lists(mut self) -> Self {
        self.streaming_lists = true;
        self
    }

    /// How long a streaming list may go without a line from the server before the
    /// initial-events-end bookmark is given up on and the stream falls back to paginated
    /// LISTs (a server that ignores `sendInitialEvents` sends the current objects, then
    /// nothing until something changes). Default 30 s; at least 1 ms.
    ///
    /// ```
    /// use std::time::Duration;
    /// // Give a slow server's initial events 2 minutes before falling back to paginated LISTs.
    /// let cfg = kube_persist::StreamConfig::default()
    ///     .streaming_lists()
    ///     .initial_events_timeout(Duration::from_secs(120));
    /// # let _ = cfg;
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn initial_events_timeout(mut self, d: Duration) -> Self {
        self.initial_events_timeout = d.max(Duration::from_millis(1));
        self
    }

    /// Server-side watch timeout in seconds (default 290, as kube-runtime). Clamped to
    /// `1..=`[`StreamConfig::MAX_TIMEOUT`]: kube-apiserver's limit, which kube-rs enforces.
    ///
    /// ```
    /// use kube_persist::StreamConfig;
    /// assert_eq!(StreamConfig::default().timeout(120).get_timeout(), 120);
    /// assert_eq!(StreamConfig::default().timeout(0).get_timeout(), 1);
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn timeout(mut self, seconds: u32) -> Self {
        self.timeout = seconds.clamp(1, Self::MAX_TIMEOUT);
        self
    }

    /// Whether to decode each incoming object into the store's type before writing it, and
    /// skip (and count) objects that fail. Default on: a bad object is caught at the door,
    /// not at `get`.
    ///
    /// Its cost is one decode per object, on kube-persist's CPU threads. A decode that only
    /// validates (no index set, the object not kept for the hot cache) leaves out the
    /// values of `metadata.managedFields[*].fieldsV1`, which `ObjectMeta` takes as any JSON
    /// (the bytes are checked as JSON all the same): they are about half of a typical
    /// object and most of its decoding. A type whose `Deserialize` refuses some `fieldsV1`
    /// values is not validated on them.
    ///
    /// ```
    /// // Store what the server sends without decoding it first (a bad object then fails at `get`).
    /// let cfg = kube_persist::StreamConfig::default().validate(false);
    /// # let _ = cfg;
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn validate(mut self, on: bool) -> Self {
        self.validate = on;
        self
    }

    /// Objects larger than this many bytes of JSON are skipped and counted (default 16 MiB,
    /// above etcd's limit). A watch line is never read past this size. At least 1 KiB.
    ///
    /// ```
    /// use kube_persist::StreamConfig;
    /// assert_eq!(StreamConfig::default().max_object_bytes(256 << 10).get_max_object_bytes(), 256 << 10);
    /// assert_eq!(StreamConfig::default().max_object_bytes(10).get_max_object_bytes(), 1 << 10);
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn max_object_bytes(mut self, bytes: usize) -> Self {
        self.max_object_bytes = bytes.max(1 << 10);
        self
    }

    /// The largest LIST page read, in bytes of JSON (default 1 GiB): a page the server makes
    /// longer is not read past this bound but fails the list (`Error::Protocol`, retried with
    /// backoff), so that a server that sends without end (a broken proxy, an aggregated API
    /// that ignores `limit`, a hostile endpoint) cannot exhaust the process's memory. Watch
    /// lines and a delta relist's fetches are bounded by [`StreamConfig::max_object_bytes`].
    /// At least `max_object_bytes` plus 64 KiB (one object and its list envelope); lower
    /// [`StreamConfig::page_size`] rather than this if pages of large objects exceed it.
    ///
    /// ```
    /// use kube_persist::StreamConfig;
    /// assert_eq!(StreamConfig::default().get_max_page_bytes(), 1 << 30);
    /// let cfg = StreamConfig::default().max_object_bytes(1 << 20).max_page_bytes(64 << 20);
    /// assert_eq!(cfg.get_max_page_bytes(), 64 << 20);
    /// assert_eq!(cfg.max_page_bytes(0).get_max_page_bytes(), (1 << 20) + (64 << 10));
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn max_page_bytes(mut self, bytes: usize) -> Self {
        self.max_page_bytes = bytes;
        self
    }

    /// The largest LIST page read ([`StreamConfig::max_page_bytes`]).
    ///
    /// ```
    /// assert_eq!(kube_persist::StreamConfig::default().get_max_page_bytes(), 1 << 30);
    /// ```
    pub fn get_max_page_bytes(&self) -> usize {
        self.max_page_bytes
            .max(self.max_object_bytes.saturating_add(64 << 10))
    }

    /// How many `ResourceVersionTooLarge` answers (a lagging API server replica) to retry
    /// with backoff before relisting (default 5).
    ///
    /// ```
    /// // Relist at the first ResourceVersionTooLarge instead of waiting for the replica to catch up.
    /// let cfg = kube_persist::StreamConfig::default().too_large_retries(0);
    /// # let _ = cfg;
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn too_large_retries(mut self, n: u32) -> Self {
        self.too_large_retries = n;
        self
    }

    /// Delays of the jittered exponential backoff before a retry (default 800 ms and 30 s,
    /// as kube-runtime's `DefaultBackoff`): the n-th retry in a row waits `min * 2^n`,
    /// capped at `max`, plus a random jitter of up to that much again (so within
    /// `[min, 2 * max)`), as kube-runtime's watcher backoff does. `min` is at least 1 ms;
    /// `max` at least `min`.
    ///
    /// ```
    /// use std::time::Duration;
    /// let cfg = kube_persist::StreamConfig::default()
    ///     .backoff(Duration::from_millis(100), Duration::from_secs(10));
    /// # let _ = cfg;
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        self.min_backoff = min.max(Duration::from_millis(1));
        self.max_backoff = max.max(self.min_backoff);
        self
    }

    /// Bytes of decoded objects cached for `Reader::get` (an estimate: about 10x the JSON
    /// size per object). Hits cost a lock and an `Arc` clone; 0 disables the cache.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let client = server.client();
    /// let config = kube_persist::StreamConfig::default().hot_cache(64 << 20); // 0: always read from disk
    /// let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(client);
    /// let (reader, watcher) = db.store("pods", api, config)?;
    /// tokio::spawn(watcher.run());
    /// reader.wait_until_ready().await?;
    /// for _ in 0..3 {
    ///     reader.get_named(Some("default"), "web-0")?;
    /// }
    /// // Admitted on its second miss (a key read once does not evict others), then a hit.
    /// let stats = reader.stats();
    /// assert_eq!((stats.hot_cache_misses, stats.hot_cache_hits), (2, 1));
    /// # Ok(()) }
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn hot_cache(mut self, bytes: usize) -> Self {
        self.hot_cache_bytes = bytes;
        self
    }

    /// Upper bound of the random delay before a relist (zero disables it).
    ///
    /// ```
    /// use std::time::Duration;
    /// // Many replicas relisting after the same 410: spread them over 10 s.
    /// let cfg = kube_persist::StreamConfig::default().relist_jitter(Duration::from_secs(10));
    /// # let _ = cfg;
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn relist_jitter(mut self, d: Duration) -> Self {
        self.relist_jitter = d;
        self
    }

    /// How long a watch must stay connected without an error (a failed connect, a broken
    /// stream, an `ERROR` event) after a relist before the next relist is again immediate
    /// (default 2 minutes, as client-go's reflector). Relists closer together
    /// (a server answering `410` right after every sync, continue tokens that keep
    /// expiring) wait the [`StreamConfig::backoff`] delays on top of their jitter, doubling each
    /// time up to the maximum.
    ///
    /// ```
    /// use std::time::Duration;
    /// let cfg = kube_persist::StreamConfig::default().relist_backoff_reset(Duration::from_secs(600));
    /// assert_eq!(cfg.get_relist_backoff_reset(), Duration::from_secs(600));
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn relist_backoff_reset(mut self, d: Duration) -> Self {
        self.relist_backoff_reset = d;
        self
    }

    /// See [`StreamConfig::relist_backoff_reset`].
    ///
    /// ```
    /// use std::time::Duration;
    /// assert_eq!(kube_persist::StreamConfig::default().get_relist_backoff_reset(), Duration::from_secs(120));
    /// ```
    pub fn get_relist_backoff_reset(&self) -> Duration {
        self.relist_backoff_reset
    }

    /// Apply `f` to each object's JSON before writing it. `name` identifies the transform
    /// in the store identity: change it when `f` changes, so old data is not resumed.
    /// Transforms compose in the order given (each sees the output of the one before,
    /// like kube-runtime's chained `modify`), so `.drop_managed_fields().transform(..)`
    /// does both; the identity names them all (`drop-managed-fields+no-status-v1`).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let client = server.client();
    /// # server.handle().seed_pods(1, 1); // pod-0 in ns-0, with a status
    /// use kube::runtime::reflector::ObjectRef;
    /// let config = kube_persist::StreamConfig::default().transform("no-status-v1", |pod| {
    ///     if let Some(obj) = pod.as_object_mut() {
    ///         obj.remove("status");
    ///     }
    /// });
    /// let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(client);
    /// let (reader, watcher) = db.store("pods", api, config)?;
    /// tokio::spawn(watcher.run());
    /// reader.wait_until_ready().await?;
    /// let pod = reader.get(&ObjectRef::new("pod-0").within("ns-0"))?.unwrap();
    /// assert!(pod.status.is_none());
    /// # let on_server = server.handle().get(&kube_persist_testkit::ResourceType::pods(), Some("ns-0"), "pod-0").unwrap();
    /// # assert!(on_server["status"].is_object());
    /// # Ok(()) }
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn transform(
        mut self,
        name: &str,
        f: impl Fn(&mut serde_json::Value) + Send + Sync + 'static,
    ) -> Self {
        self.transform = Some(match self.transform.take() {
            None => (name.to_string(), Arc::new(f)),
            // A second transform runs after the first, on its output; the stream's identity
            // names both, in order (a single transform keeps its own name).
            Some((first, g)) => (
                format!("{first}+{name}"),
                Arc::new(move |v: &mut serde_json::Value| {
                    g(v);
                    f(v)
                }),
            ),
        });
        self
    }

    /// Mark this stream's kind as sensitive (or not), overriding the default: core/v1
    /// `secrets` is, whether the stream names it by its type (`Api<Secret>`, a kind
    /// `Secret`) or by its group and resource (a `DynamicObject` stream of an
    /// `ApiResource`, whatever kind it gives). A sensitive stream, full or metadata-only
    /// ([`Db::metadata_store`](crate::Db::metadata_store): its annotations can hold the
    /// whole object), is refused unless it drops the data
    /// ([`StreamConfig::drop_secret_data`]), stores keys only
    /// ([`StreamConfig::keys_only`]) or opts in ([`StreamConfig::allow_sensitive_data`]).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let client = kube::Client::try_from(kube::Config::new("http://127.0.0.1:1".parse()?))?;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// use k8s_openapi::api::core::v1::ConfigMap;
    /// use kube_persist::{StreamConfig, Error};
    /// // ConfigMaps holding credentials: refuse to write them to disk without an explicit opt-in.
    /// let api = kube::Api::<ConfigMap>::all(client);
    /// let err = db.store("config", api, StreamConfig::default().sensitive(true)).unwrap_err();
    /// assert!(matches!(err, Error::SensitiveKind { ref kind, .. } if kind == "ConfigMap"));
    /// # Ok(()) }
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn sensitive(mut self, sensitive: bool) -> Self {
        self.sensitive = Some(sensitive);
        self
    }

    /// Accept writing sensitive objects (e.g. Secrets, ServiceAccount tokens) to disk.
    ///
    /// An in-memory cache dies with its process; this one leaves the data on disk. Prefer
    /// [`StreamConfig::drop_secret_data`] when the controller does not need the values;
    /// otherwise encrypt the store (`DbConfig::encryption_key`) and keep its directory
    /// private.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let client = kube::Client::try_from(kube::Config::new("http://127.0.0.1:1".parse()?))?;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// use k8s_openapi::api::core::v1::Secret;
    /// use kube_persist::StreamConfig;
    /// let api = kube::Api::<Secret>::all(client);
    /// assert!(db.store("secrets", api.clone(), StreamConfig::default()).is_err()); // not without opting in
    /// let (reader, _watcher) = db.store("secrets", api, StreamConfig::default().allow_sensitive_data())?;
    /// # let _ = reader;
    /// # Ok(()) }
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn allow_sensitive_data(mut self) -> Self {
        self.allow_sensitive_data = true;
        self
    }

    /// Drop what holds a Secret's values from every object before it is written: `data`,
    /// `stringData` (and `binaryData`, a ConfigMap's) and the
    /// `kubectl.kubernetes.io/last-applied-configuration` annotation, which `kubectl apply`
    /// sets to the whole object as applied, values included. The names, labels, other
    /// annotations, type and owner references stay. This is the built-in configuration a
    /// sensitive stream (see [`StreamConfig::sensitive`]) is accepted with, full or
    /// metadata-only, without [`StreamConfig::allow_sensitive_data`].
    ///
    /// It runs after every [`StreamConfig::transform`], whatever the order they are
    /// given in, so no transform can put the values back; the store identity names it
    /// (`drop-secret-data`), so a store written without it is wiped and listed again.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::start().await;
    /// # let secrets = kube_persist_testkit::ResourceType::new("", "v1", "secrets", "Secret", true);
    /// # server.handle().register(&secrets);
    /// # server.handle().apply(&secrets, serde_json::json!({
    /// #     "apiVersion": "v1", "kind": "Secret",
    /// #     "metadata": {"name": "db", "namespace": "default", "annotations": {
    /// #         "kubectl.kubernetes.io/last-applied-configuration": "{\"data\":{\"password\":\"aHVudGVyMg==\"}}",
    /// #         "team": "storage"}},
    /// #     "type": "Opaque",
    /// #     "data": {"password": "aHVudGVyMg=="}
    /// # }));
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let client = server.client();
    /// use k8s_openapi::api::core::v1::Secret;
    /// use kube_persist::StreamConfig;
    /// let api = kube::Api::<Secret>::all(client);
    /// let (reader, watcher) = db.store("secrets", api, StreamConfig::default().drop_secret_data())?;
    /// tokio::spawn(watcher.run());
    /// reader.wait_until_ready().await?;
    /// let secret = reader.get_named(Some("default"), "db")?.unwrap();
    /// assert!(secret.data.is_none());
    /// let annotations = secret.metadata.annotations.clone().unwrap();
    /// assert!(!annotations.contains_key("kubectl.kubernetes.io/last-applied-configuration"));
    /// assert_eq!(annotations["team"], "storage");
    /// assert_eq!(secret.type_.as_deref(), Some("Opaque"));
    /// # Ok(()) }
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn drop_secret_data(mut self) -> Self {
        self.drop_secret_data = true;
        self
    }

    /// Whether [`StreamConfig::drop_secret_data`] is set.
    ///
    /// ```
    /// use kube_persist::StreamConfig;
    /// assert!(!StreamConfig::default().get_drop_secret_data());
    /// assert!(StreamConfig::default().drop_secret_data().get_drop_secret_data());
    /// ```
    pub fn get_drop_secret_data(&self) -> bool {
        self.drop_secret_data
    }

    /// Whether object bodies are rewritten before they are stored (a transform, or
    /// [`StreamConfig::drop_secret_data`]).
    pub(crate) fn transforms(&self) -> bool {
        self.transform.is_some() || self.drop_secret_data
    }

    /// The name of what rewrites the bodies, as the store identity records it: the
    /// transforms in order, then `drop-secret-data`.
    pub(crate) fn transform_name(&self) -> Option<String> {
        let drop = self.drop_secret_data.then_some(DROP_SECRET_DATA);
        match (self.transform.as_ref().map(|t| t.0.as_str()), drop) {
            (Some(t), Some(d)) => Some(format!("{t}+{d}")),
            (Some(t), None) => Some(t.to_string()),
            (None, d) => d.map(str::to_string),
        }
    }

    /// Rewrite `v` as the stream stores it: the transforms in order, then the drop of
    /// [`StreamConfig::drop_secret_data`].
    pub(crate) fn apply_transforms(&self, v: &mut serde_json::Value) {
        if let Some((_, f)) = &self.transform {
            f(v);
        }
        if self.drop_secret_data {
            drop_secret_values(v);
        }
    }

    /// Maintain a secondary index `name` on disk: `f` maps an object to the values it is
    /// found under with `Reader::by_index(name, value)` (client-go's Indexers). Entries are
    /// written in the same atomic batch as the object and removed with it. An index added to
    /// an existing store is built from disk, page by page, when the watcher starts.
    ///
    /// ```
    /// use k8s_openapi::api::core::v1::Pod;
    /// let cfg = kube_persist::StreamConfig::default().index("node", |p: &Pod| {
    ///     p.spec.as_ref().and_then(|s| s.node_name.clone()).into_iter().collect()
    /// });
    /// # let _ = cfg;
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn index<K: 'static>(
        mut self,
        name: &str,
        f: impl Fn(&K) -> Vec<String> + Send + Sync + 'static,
    ) -> Self {
        let f: IndexFn<K> = Arc::new(f);
        self.indexes.retain(|(n, _)| n != name);
        self.indexes.push((name.to_string(), Arc::new(f)));
        self
    }

    /// Index objects by the value of label `key`, under the index name `label:<key>`.
    /// `Reader::select` uses it for selectors with `key=value` or `key in (...)`.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let client = server.client();
    /// use k8s_openapi::api::core::v1::Pod;
    /// use kube::core::{Expression, Selector};
    /// let config = kube_persist::StreamConfig::default().label_index::<Pod>("app");
    /// let (reader, watcher) = db.store("pods", kube::Api::<Pod>::all(client), config)?;
    /// tokio::spawn(watcher.run());
    /// reader.wait_until_ready().await?;
    /// let web: Selector = Expression::Equal("app".into(), "web".into()).into();
    /// assert_eq!(reader.select(&web)?.count(), 2); // through index "label:app", no scan
    /// assert_eq!(reader.by_index("label:app", "web")?.count(), 2);
    /// # Ok(()) }
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
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
    /// name, namespace, uid and resourceVersion; for a type that such an object does not
    /// decode into (required fields, as a kube-derive `spec`) they are
    /// [`Event::DeleteKey`](crate::Event::DeleteKey). `Reader::get`/`iter` are not available.
    ///
    /// Use it to ship events (audit, sync to another system, triggers) exactly once per
    /// change; use the full store when the controller reads objects back.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let client = server.client();
    /// use futures::StreamExt;
    /// use kube::runtime::reflector::ObjectRef;
    /// use kube_persist::Event;
    /// let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(client);
    /// let (reader, watcher) = db.store("pods", api, kube_persist::StreamConfig::default().keys_only())?;
    /// let mut events = std::pin::pin!(watcher.stream());
    /// let mut listed = 0;
    /// while let Some(event) = events.next().await {
    ///     match event? {
    ///         Event::InitApply(pod) => listed += usize::from(pod.spec.is_some()), // full objects
    ///         Event::InitDone => break,
    ///         _ => {}
    ///     }
    /// }
    /// assert_eq!((listed, reader.len()), (2, 2));
    /// assert!(reader.get(&ObjectRef::new("web-0").within("default")).is_err()); // no bodies
    /// # Ok(()) }
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn keys_only(mut self) -> Self {
        self.keys_only = true;
        self
    }

    /// Drop `metadata.managedFields` before writing (often half of an object's size).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let client = server.client();
    /// # server.handle().seed_pods(1, 1); // pod-0 in ns-0, with managedFields
    /// use k8s_openapi::api::core::v1::Pod;
    /// let config = kube_persist::StreamConfig::default().drop_managed_fields();
    /// let (reader, watcher) = db.store("pods", kube::Api::<Pod>::all(client), config)?;
    /// tokio::spawn(watcher.run());
    /// reader.wait_until_ready().await?;
    /// let pod = reader.get_named(Some("ns-0"), "pod-0")?.unwrap();
    /// assert!(pod.metadata.managed_fields.is_none());
    /// # let on_server = server.handle().get(&kube_persist_testkit::ResourceType::pods(), Some("ns-0"), "pod-0").unwrap();
    /// # assert!(on_server["metadata"]["managedFields"].is_array());
    /// # Ok(()) }
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn drop_managed_fields(self) -> Self {
        self.transform("drop-managed-fields", |v| {
            if let Some(meta) = v.get_mut("metadata").and_then(|m| m.as_object_mut()) {
                meta.remove("managedFields");
            }
        })
    }
}

/// How a store that already holds objects lists the collection again (after `410 Gone`:
/// its checkpoint is past the API server's watch history).
///
/// A delta relist lists metadata only and fetches, one LIST narrowed to each (the `list`
/// verb, as every mode: none needs `get`), the objects that are new or changed since the
/// store saw them: against kube-apiserver it moves a fraction of a full
/// relist's bytes, in less time, when few objects changed, most for kinds whose bodies
/// dwarf their metadata
/// ([BENCHMARKS.md](https://github.com/kube-persist/kube-persist/blob/main/BENCHMARKS.md#relist-past-the-watch-history)).
/// With kube's `gzip` feature the API server compresses LIST pages but not the small answers
/// of single-object fetches (under its 128 KiB threshold), so for a kind whose pages compress
/// well (Pods) full pages move fewer bytes: choose [`RelistMode::Full`] there.
///
/// The first list of an empty store is always a full one, and so is any relist of a
/// metadata-only store ([`Db::metadata_store`](crate::Db::metadata_store): its objects are
/// the metadata) or of a server whose resourceVersions are not comparable (KEP-5504).
///
/// ```
/// use kube_persist::{RelistMode, StreamConfig};
/// assert_eq!(StreamConfig::default().get_relist_mode(), RelistMode::Auto);
/// let cfg = StreamConfig::default().relist_mode(RelistMode::Full);
/// assert_eq!(cfg.get_relist_mode(), RelistMode::Full);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum RelistMode {
    /// A delta relist where it applies (the store's checkpoint and the list's
    /// resourceVersion are comparable, KEP-5504), page by page: a page where more than
    /// [`RelistMode::AUTO_FULL_PAGE_ABOVE`] of the objects differ from the store is listed
    /// again in full (the same page of the same snapshot), and so are the pages after it
    /// while as many differ.
    #[default]
    Auto,
    /// Every relist lists full objects, the relist of kube-runtime and client-go.
    Full,
    /// A delta relist wherever it applies, whatever share of the objects changed.
    Delta,
}

impl RelistMode {
    /// The share of a page's objects that, when new or changed, makes [`RelistMode::Auto`]
    /// list that page in full rather than fetch them one by one: where the times to caught up
    /// of the two relists meet for Pods, measured against kube-apiserver (ConfigMaps of
    /// 20 KB, whose bodies weigh more against their metadata, meet later). See
    /// [BENCHMARKS.md](https://github.com/kube-persist/kube-persist/blob/main/BENCHMARKS.md#relist-past-the-watch-history).
    pub const AUTO_FULL_PAGE_ABOVE: f64 = 0.06;
}

impl StreamConfig {
    /// How the stream lists again once it holds objects (after `410 Gone`); see
    /// [`RelistMode`]. Default: [`RelistMode::Auto`].
    ///
    /// ```
    /// use kube_persist::{RelistMode, StreamConfig};
    /// // Always relist full objects (one LIST page per `page_size` objects, no fetches).
    /// let cfg = StreamConfig::default().relist_mode(RelistMode::Full);
    /// assert_eq!(cfg.get_relist_mode(), RelistMode::Full);
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn relist_mode(mut self, mode: RelistMode) -> Self {
        self.relist_mode = mode;
        self
    }

    /// See [`StreamConfig::relist_mode`].
    ///
    /// ```
    /// use kube_persist::{RelistMode, StreamConfig};
    /// assert_eq!(StreamConfig::default().get_relist_mode(), RelistMode::Auto);
    /// ```
    pub fn get_relist_mode(&self) -> RelistMode {
        self.relist_mode
    }
}
