//! Prometheus metrics of streams (cargo feature `metrics`), in the
//! [`prometheus-client`](https://docs.rs/prometheus-client) registry a controller already
//! serves (the client kube-rs's controller examples use).
//!
//! [`Metrics::register`] adds one collector to the registry; [`Metrics::add`] adds a
//! stream to it. Nothing is counted twice: at every scrape the collector reads the
//! stream's live counters (the ones [`Reader::stats`] returns) and status, so the metrics
//! cost nothing between scrapes; a directory's size and volume are read once per scrape
//! whatever its number of streams. Every metric is named `kube_persist_*`:
//!
//! | metric | type | labels | what |
//! |---|---|---|---|
//! | `kube_persist_<field>_total` | counter | `stream` | each counter of [`Stats`] but `errors`, e.g. `kube_persist_objects_written_total`, `kube_persist_relists_total` (the list below) |
//! | `kube_persist_errors_total` | counter | `stream`, `kind`, `code` | errors the watcher met, each followed by a retry with backoff, by [`ErrorKind`] (`refused`, `gone`, `throttled`, `server`, `timeout`, `decode`, `disk`, `other`) and HTTP status (`""` for none) |
//! | `kube_persist_objects` | gauge | `stream` | objects stored |
//! | `kube_persist_sync_phase` | gauge | `stream`, `phase` | 1 for the stream's [`SyncPhase`], 0 for the others |
//! | `kube_persist_ready` | gauge | `stream` | 1 once a consistent snapshot is on disk |
//! | `kube_persist_watch_connected` | gauge | `stream` | 1 while the watch is connected (not necessarily caught up) |
//! | `kube_persist_caught_up` | gauge | `stream` | 1 once the store has applied everything the server had when its watch last (re)connected ([`Reader::is_caught_up`]) |
//! | `kube_persist_resource_versions_behind` | gauge | `stream` | revisions the checkpoint is behind the server's resourceVersion read at the last (re)connect (absent where resourceVersions are not comparable) |
//! | `kube_persist_last_watch_activity_timestamp_seconds` | gauge | `stream` | when the watch last delivered an event or bookmark, in Unix seconds (absent before the first) |
//! | `kube_persist_commit_duration_seconds` | histogram | `stream` | how long each batch's commit took: the engine's write, and its fsync where every commit is durable ([`Durability::EveryBatch`](crate::Durability::EveryBatch)) |
//! | `kube_persist_batch_bytes` | histogram | `stream` | bytes of keys and values each batch wrote (its sum: the bytes written) |
//! | `kube_persist_store_disk_bytes` | gauge | `dir` | bytes of the store directory's files |
//! | `kube_persist_volume_size_bytes` | gauge | `dir` | size of the volume holding the store directory |
//! | `kube_persist_volume_free_bytes` | gauge | `dir` | bytes free for the process on that volume |
//! | `kube_persist_oldest_read_seconds` | gauge | `dir` | age of the oldest scan open on the directory (an iteration, a sweep, a dump; 0 when none is) |
//! | `kube_persist_build_info` | gauge | `version`, `engine`, `format` | 1, for the kube-persist version, each engine in use and the store format it writes |
//!
//! The counters of [`Stats`] by name: `objects_written`, `objects_unchanged`,
//! `objects_deleted`, `list_pages`, `batches`, `watch_events`, `bookmarks`, `relists`,
//! `resumes`, `bad_objects`, `identity_resets`, `hot_cache_hits`, `hot_cache_misses`,
//! `shard_client_filtered`, `server_version_reads`, `decodes`, `metadata_pages`,
//! `bodies_fetched`, `fetch_retries`, `delta_fallbacks`, `stale_events_skipped`.
//!
//! [`Metrics::add_controller`] adds a controller's counters ([`Controller::stats`]), named
//! like controller-runtime's and labeled with `controller`:
//!
//! | metric | type | labels | what |
//! |---|---|---|---|
//! | `kube_persist_controller_reconcile_total` | counter | `controller`, `result` | reconciles by `result`: `success`, `requeue_after` (`Ok` with a requeue), `error`, `skipped` (not run: the durable state showed the version handled) |
//! | `kube_persist_controller_reconcile_errors_total` | counter | `controller` | reconciles that returned `Err` |
//! | `kube_persist_controller_reconcile_time_seconds` | histogram | `controller` | reconcile durations ([`RECONCILE_BUCKETS`]) |
//! | `kube_persist_controller_active_workers` | gauge | `controller` | reconciles running |
//! | `kube_persist_controller_queue_depth` | gauge | `controller` | requests waiting in the scheduler, requeues excepted |
//! | `kube_persist_controller_pending_requeues` | gauge | `controller` | requeues and retries waiting in the scheduler |
//! | `kube_persist_controller_queue_adds_total` | counter | `controller` | requests added for an object that had none waiting (`workqueue_adds_total`) |
//! | `kube_persist_controller_queue_retries_total` | counter | `controller` | retries the error policy asked for (`workqueue_retries_total`) |
//! | `kube_persist_controller_queue_wait_seconds` | histogram | `controller` | how long a due request waited before its reconcile started (`workqueue_queue_duration_seconds`, [`QUEUE_WAIT_BUCKETS`]) |
//! | `kube_persist_controller_startup_pass_running` | gauge | `controller` | 1 while the startup pass (or its wait for the store to catch up) runs |
//! | `kube_persist_controller_startup_pass_objects` | gauge | `controller` | objects in the store when the last startup pass began |
//! | `kube_persist_controller_startup_pass_read_total` | counter | `controller` | objects the startup passes have read |
//!
//! [`Controller::stats`]: crate::Controller::stats
//! [`RECONCILE_BUCKETS`]: crate::controller::RECONCILE_BUCKETS
//! [`QUEUE_WAIT_BUCKETS`]: crate::controller::QUEUE_WAIT_BUCKETS
//! [`ErrorKind`]: crate::ErrorKind
//!
//! Serving `/metrics` with the registry (here with hyper-free std networking; a controller
//! would use its HTTP server, e.g. axum):
//!
//! ```no_run
//! use std::io::Write;
//! use std::sync::{Arc, Mutex};
//! use k8s_openapi::api::core::v1::Pod;
//! use kube::{Api, Client};
//! use kube_persist::{StreamConfig, Db, metrics::Metrics};
//! use prometheus_client::{encoding::text::encode, registry::Registry};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let db = Db::open("/var/lib/my-controller/cache")?;
//! let (reader, watcher) = db.store("pods", Api::<Pod>::all(Client::try_default().await?), StreamConfig::default())?;
//! let mut registry = Registry::default();
//! let metrics = Metrics::register(&mut registry);
//! metrics.add(&reader);
//! tokio::spawn(watcher.run());
//!
//! let registry = Arc::new(registry);
//! let listener = std::net::TcpListener::bind("127.0.0.1:9090")?;
//! std::thread::spawn(move || {
//!     for mut conn in listener.incoming().flatten() {
//!         let mut body = String::new();
//!         if encode(&mut body, &registry).is_ok() {
//!             let _ = write!(
//!                 conn,
//!                 "HTTP/1.1 200 OK\r\ncontent-type: application/openmetrics-text; version=1.0.0; charset=utf-8\r\ncontent-length: {}\r\n\r\n{body}",
//!                 body.len()
//!             );
//!         }
//!     }
//! });
//! # Ok(()) }
//! ```

// Over 600 lines for a reason: the metric tables above are the contract (docs/operations.md
// and a test hold them equal to a scrape), and the code below encodes exactly those
// families; kept in one file, a new metric changes one file, and the tables cannot drift
// from the code that emits them.

// Layer: top (beside lib.rs). May import anything (tests/layers.rs).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use crate::Reader;
use crate::controller::{ControllerCounts, ControllerStats};
use crate::model::{Counters, ErrorKind, HistogramSnapshot, Stats};
use crate::store::MetricsSource;
use crate::store::SyncPhase;

/// A metric: name (after `kube_persist_`), help, and how to read it from a value.
type Metric<T, V> = (&'static str, &'static str, fn(&T) -> V);

/// The counters of [`Stats`], by metric name (without `kube_persist_` and `_total`).
const COUNTERS: &[Metric<Stats, u64>] = &[
    (
        "objects_written",
        "Objects written to disk (new or changed).",
        |s| s.objects_written,
    ),
    (
        "objects_unchanged",
        "Listed or replayed objects skipped because the stored resourceVersion was the same.",
        |s| s.objects_unchanged,
    ),
    (
        "objects_deleted",
        "Objects removed from disk (watch deletions, relist sweeps).",
        |s| s.objects_deleted,
    ),
    ("list_pages", "LIST requests that returned a page.", |s| {
        s.list_pages
    }),
    ("batches", "Atomic batches committed.", |s| s.batches),
    (
        "watch_events",
        "Watch events applied (bookmarks excluded).",
        |s| s.watch_events,
    ),
    ("bookmarks", "Bookmarks received.", |s| s.bookmarks),
    (
        "relists",
        "Lists started after the stream had been complete once (410 Gone, expired continue token).",
        |s| s.relists,
    ),
    (
        "resumes",
        "Starts that resumed from a stored checkpoint without a paginated LIST.",
        |s| s.resumes,
    ),
    (
        "bad_objects",
        "Objects or events from the server skipped because they could not be decoded.",
        |s| s.bad_objects,
    ),
    (
        "identity_resets",
        "Times the stream was wiped because it was opened with a different identity.",
        |s| s.identity_resets,
    ),
    (
        "hot_cache_hits",
        "Reader::get calls answered from the hot cache.",
        |s| s.hot_cache_hits,
    ),
    (
        "hot_cache_misses",
        "Reader::get calls that read from disk while the hot cache was on.",
        |s| s.hot_cache_misses,
    ),
    (
        "shard_client_filtered",
        "Objects outside the stream's shard sent by a server that ignores shardSelector.",
        |s| s.shard_client_filtered,
    ),
    (
        "server_version_reads",
        "LIST limit=1 requests that read the server's resourceVersion to know when the store caught up.",
        |s| s.server_version_reads,
    ),
    (
        "decodes",
        "Objects decoded from JSON by the store (validation, and reads that missed the hot cache).",
        |s| s.decodes,
    ),
    (
        "metadata_pages",
        "Metadata-only LIST pages of delta relists.",
        |s| s.metadata_pages,
    ),
    (
        "bodies_fetched",
        "Object bodies a delta relist fetched (one LIST narrowed to the object each) because they were new or changed.",
        |s| s.bodies_fetched,
    ),
    (
        "fetch_retries",
        "A delta relist's fetches retried after a transient failure (429, 5xx, a timeout).",
        |s| s.fetch_retries,
    ),
    (
        "delta_fallbacks",
        "Delta relists that listed in full from some page on because the server refused a metadata page or a fetch (401, 403, 405, 406, 415, 400, 422), or answered a fetch with 404 or with what it did not ask for.",
        |s| s.delta_fallbacks,
    ),
    (
        "stale_events_skipped",
        "Watch events skipped because the store held a newer version (the replay after a delta relist).",
        |s| s.stale_events_skipped,
    ),
];

const PHASES: [(SyncPhase, &str); 4] = [
    (SyncPhase::Empty, "Empty"),
    (SyncPhase::Listing, "Listing"),
    (SyncPhase::Sweeping, "Sweeping"),
    (SyncPhase::Synced, "Synced"),
];

/// The streams whose metrics a registry serves; see the [module docs](self).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use k8s_openapi::api::core::v1::Pod;
/// use prometheus_client::{encoding::text::encode, registry::Registry};
///
/// let dir = tempfile::tempdir()?;
/// let db = kube_persist::Db::open(dir.path())?;
/// let client = kube::Client::try_from(kube::Config::new("http://127.0.0.1:1".parse()?))?;
/// let (reader, _watcher) =
///     db.store("pods", kube::Api::<Pod>::all(client), kube_persist::StreamConfig::default())?;
///
/// let mut registry = Registry::default();
/// kube_persist::metrics::Metrics::register(&mut registry).add(&reader);
/// let mut text = String::new();
/// encode(&mut text, &registry)?;
/// assert!(text.contains("kube_persist_objects{stream=\"pods\"} 0"));
/// assert!(text.contains("kube_persist_sync_phase{stream=\"pods\",phase=\"Empty\"} 1"));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Metrics {
    streams: Arc<Mutex<Vec<MetricsSource>>>,
    controllers: Arc<Mutex<Vec<(String, ControllerStats)>>>,
}

impl Metrics {
    /// Add a collector for kube-persist streams to `registry` (once per registry); add
    /// streams to it with [`Metrics::add`].
    ///
    /// ```
    /// use prometheus_client::{encoding::text::encode, registry::Registry};
    /// let mut registry = Registry::default();
    /// let metrics = kube_persist::metrics::Metrics::register(&mut registry);
    /// let mut text = String::new();
    /// encode(&mut text, &registry).unwrap();
    /// assert!(!text.contains("kube_persist_")); // no stream added yet
    /// # drop(metrics);
    /// ```
    pub fn register(registry: &mut Registry) -> Metrics {
        let metrics = Metrics {
            streams: Arc::default(),
            controllers: Arc::default(),
        };
        registry.register_collector(Box::new(metrics.clone()));
        metrics
    }

    /// Serve the metrics of `reader`'s stream (labeled with its
    /// [`stream_name`](Reader::stream_name)). Adding a stream of that name again replaces
    /// the earlier one.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let client = kube::Client::try_from(kube::Config::new("http://127.0.0.1:1".parse()?))?;
    /// # let dir = tempfile::tempdir()?;
    /// # let db = kube_persist::Db::open(dir.path())?;
    /// # let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(client);
    /// # let (reader, _watcher) = db.store("pods", api, kube_persist::StreamConfig::default())?;
    /// use prometheus_client::{encoding::text::encode, registry::Registry};
    /// let mut registry = Registry::default();
    /// let metrics = kube_persist::metrics::Metrics::register(&mut registry);
    /// metrics.add(&reader);
    /// metrics.add(&reader); // replaces: still one stream
    /// let mut text = String::new();
    /// encode(&mut text, &registry)?;
    /// assert_eq!(text.matches("kube_persist_objects{stream=\"pods\"}").count(), 1);
    /// # Ok(()) }
    /// ```
    pub fn add<K>(&self, reader: &Reader<K>) {
        let source = reader.metrics_source();
        let mut streams = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        streams.retain(|s| *s.stream != *source.stream);
        streams.push(source);
    }

    /// Serve the metrics of controller `name` (`kube_persist_controller_*`, see the
    /// [module docs](self)), read from its [`ControllerStats`]. Adding a name again
    /// replaces the earlier controller of that name.
    ///
    /// ```
    /// use prometheus_client::{encoding::text::encode, registry::Registry};
    /// let mut registry = Registry::default();
    /// let metrics = kube_persist::metrics::Metrics::register(&mut registry);
    /// // A controller's: `Controller::stats()`.
    /// let stats = kube_persist::controller::ControllerStats::default();
    /// metrics.add_controller("configmapgen", &stats);
    /// let mut text = String::new();
    /// encode(&mut text, &registry).unwrap();
    /// assert!(text.contains(
    ///     "kube_persist_controller_reconcile_total{controller=\"configmapgen\",result=\"success\"} 0"
    /// ));
    /// assert!(text.contains("kube_persist_controller_queue_depth{controller=\"configmapgen\"} 0"));
    /// ```
    pub fn add_controller(&self, name: &str, stats: &ControllerStats) {
        let mut controllers = self.controllers.lock().unwrap_or_else(|p| p.into_inner());
        controllers.retain(|(n, _)| n != name);
        controllers.push((name.to_string(), stats.clone()));
    }
}

/// What one scrape reads of one stream.
struct Sample {
    stream: String,
    stats: Stats,
    errors: Vec<(ErrorKind, Option<u16>, u64)>,
    objects: u64,
    phase: SyncPhase,
    ready: bool,
    live: bool,
    caught_up: bool,
    behind: Option<u64>,
    last_activity: Option<f64>,
    commits: HistogramSnapshot,
    batch_bytes: HistogramSnapshot,
}

fn sample(source: &MetricsSource) -> Sample {
    let status = source.status();
    let counters: &Counters = &source.stats;
    Sample {
        stream: source.stream.to_string(),
        stats: source.stats(),
        errors: counters.errors_by_kind(),
        objects: status.count,
        phase: status.phase,
        ready: status.ready,
        live: status.live,
        caught_up: status.catch_up.caught_up,
        behind: status.catch_up.behind,
        last_activity: counters.last_watch_activity().map(|t| {
            t.duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64())
        }),
        commits: counters.writes.commit_seconds.snapshot(),
        batch_bytes: counters.writes.batch_bytes.snapshot(),
    }
}

/// What one scrape reads of one store directory (once, whatever its number of streams).
struct DirSample {
    dir: String,
    engine: crate::Engine,
    disk_bytes: Option<u64>,
    /// `(size, free)` of the volume holding it.
    volume: Option<(u64, u64)>,
    oldest_read: f64,
}

fn dir_sample(source: &MetricsSource) -> DirSample {
    DirSample {
        dir: source.path.display().to_string(),
        engine: source.engine,
        disk_bytes: dir_bytes(&source.path),
        volume: volume(&source.path),
        oldest_read: source.reads.oldest().map_or(0.0, |d| d.as_secs_f64()),
    }
}

/// Bytes of the files in a store directory and its subdirectories (sled's `blobs/`): a
/// handful of `stat` calls.
fn dir_bytes(dir: &Path) -> Option<u64> {
    let mut total = 0;
    let mut dirs: Vec<PathBuf> = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).ok()?.flatten() {
            let meta = entry.metadata().ok()?;
            if meta.is_dir() {
                dirs.push(entry.path());
            } else {
                total += meta.len();
            }
        }
    }
    Some(total)
}

/// `(size, bytes free to an unprivileged process)` of the file system holding `dir`
/// (`statvfs`).
fn volume(dir: &Path) -> Option<(u64, u64)> {
    let st = rustix::fs::statvfs(dir).ok()?;
    Some((
        st.f_blocks.saturating_mul(st.f_frsize),
        st.f_bavail.saturating_mul(st.f_frsize),
    ))
}

/// One family: its descriptor, then one sample per `(labels, metric)`.
fn encode_family<M: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    metric_type: MetricType,
    samples: impl IntoIterator<Item = (Vec<(String, String)>, M)>,
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, None, metric_type)?;
    for (labels, metric) in samples {
        metric.encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

fn labels<const N: usize>(pairs: [(&str, &str); N]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

impl Collector for Metrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let (samples, dirs): (Vec<Sample>, Vec<DirSample>) = {
            let streams = self.streams.lock().unwrap_or_else(|p| p.into_inner());
            let mut dirs: BTreeMap<PathBuf, &MetricsSource> = BTreeMap::new();
            for s in streams.iter() {
                dirs.entry(s.path.to_path_buf()).or_insert(s);
            }
            (
                streams.iter().map(sample).collect(),
                dirs.values().map(|s| dir_sample(s)).collect(),
            )
        };
        encode_controllers(&self.controllers, &mut encoder)?;
        if samples.is_empty() {
            return Ok(());
        }
        encode_streams(&samples, &mut encoder)?;
        encode_dirs(&dirs, &mut encoder)
    }
}

/// The families labeled `stream`.
fn encode_streams(
    samples: &[Sample],
    encoder: &mut DescriptorEncoder,
) -> Result<(), std::fmt::Error> {
    let stream = |s: &Sample| labels([("stream", &s.stream)]);
    for (metric, help, field) in COUNTERS {
        encode_family(
            encoder,
            &format!("kube_persist_{metric}"),
            help,
            MetricType::Counter,
            samples
                .iter()
                .map(|s| (stream(s), ConstCounter::new(field(&s.stats)))),
        )?;
    }
    encode_family(
        encoder,
        "kube_persist_errors",
        "Errors the watcher met, each followed by a retry with backoff, by kind (refused, gone, throttled, server, timeout, decode, disk, other) and HTTP status.",
        MetricType::Counter,
        samples.iter().flat_map(|s| {
            s.errors.iter().map(move |(kind, code, n)| {
                let code = code.map(|c| c.to_string()).unwrap_or_default();
                (
                    labels([
                        ("stream", &s.stream),
                        ("kind", kind.as_str()),
                        ("code", &code),
                    ]),
                    ConstCounter::new(*n),
                )
            })
        }),
    )?;
    let gauges: [Metric<Sample, Option<f64>>; 6] = [
        ("objects", "Objects stored.", |s| Some(s.objects as f64)),
        ("ready", "1 once a consistent snapshot is on disk.", |s| {
            Some(f64::from(u8::from(s.ready)))
        }),
        (
            "watch_connected",
            "1 while the watch is connected and applying events.",
            |s| Some(f64::from(u8::from(s.live))),
        ),
        (
            "caught_up",
            "1 once the store has applied everything the server had when its watch last (re)connected.",
            |s| Some(f64::from(u8::from(s.caught_up))),
        ),
        (
            "resource_versions_behind",
            "Revisions the checkpoint is behind the server's resourceVersion read at the last (re)connect (comparable resourceVersions only).",
            |s| s.behind.map(|b| b as f64),
        ),
        (
            "last_watch_activity_timestamp_seconds",
            "When the watch last delivered an event or bookmark, in seconds since the Unix epoch.",
            |s| s.last_activity,
        ),
    ];
    for (metric, help, value) in gauges {
        encode_family(
            encoder,
            &format!("kube_persist_{metric}"),
            help,
            MetricType::Gauge,
            samples
                .iter()
                .filter_map(|s| value(s).map(|v| (stream(s), ConstGauge::new(v)))),
        )?;
    }
    encode_family(
        encoder,
        "kube_persist_sync_phase",
        "1 for the stream's phase in its list/watch cycle, 0 for the others.",
        MetricType::Gauge,
        samples.iter().flat_map(|s| {
            PHASES.iter().map(move |(phase, name)| {
                (
                    labels([("stream", &s.stream), ("phase", name)]),
                    ConstGauge::new(i64::from(s.phase == *phase)),
                )
            })
        }),
    )?;
    let histograms: [Metric<Sample, ConstHistogram>; 2] = [
        (
            "commit_duration_seconds",
            "How long each batch's commit took (the engine's write, and its fsync where every commit is durable).",
            |s| ConstHistogram::of(&s.commits.buckets, s.commits.sum),
        ),
        (
            "batch_bytes",
            "Bytes of keys and values each batch wrote.",
            |s| ConstHistogram::of(&s.batch_bytes.buckets, s.batch_bytes.sum),
        ),
    ];
    for (metric, help, value) in histograms {
        encode_family(
            encoder,
            &format!("kube_persist_{metric}"),
            help,
            MetricType::Histogram,
            samples.iter().map(|s| (stream(s), value(s))),
        )?;
    }
    Ok(())
}

/// The families labeled `dir`, and the build's.
fn encode_dirs(dirs: &[DirSample], encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
    let gauges: [Metric<DirSample, Option<f64>>; 4] = [
        (
            "store_disk_bytes",
            "Bytes of the store directory's files.",
            |d| d.disk_bytes.map(|b| b as f64),
        ),
        (
            "volume_size_bytes",
            "Size of the volume holding the store directory.",
            |d| d.volume.map(|(size, _)| size as f64),
        ),
        (
            "volume_free_bytes",
            "Bytes free for the process on the volume holding the store directory.",
            |d| d.volume.map(|(_, free)| free as f64),
        ),
        (
            "oldest_read_seconds",
            "Age of the oldest scan open on the store directory (0 when none is).",
            |d| Some(d.oldest_read),
        ),
    ];
    for (metric, help, value) in gauges {
        encode_family(
            encoder,
            &format!("kube_persist_{metric}"),
            help,
            MetricType::Gauge,
            dirs.iter()
                .filter_map(|d| value(d).map(|v| (labels([("dir", &d.dir)]), ConstGauge::new(v)))),
        )?;
    }
    let engines: std::collections::BTreeSet<&str> = dirs.iter().map(|d| d.engine.name()).collect();
    let format = crate::disk::record::FORMAT_VERSION.to_string();
    encode_family(
        encoder,
        "kube_persist_build_info",
        "1, for the kube-persist version, each engine in use and the store format it writes.",
        MetricType::Gauge,
        engines.into_iter().map(|engine| {
            (
                labels([
                    ("version", env!("CARGO_PKG_VERSION")),
                    ("engine", engine),
                    ("format", &format),
                ]),
                ConstGauge::new(1i64),
            )
        }),
    )
}
/// A histogram read at scrape time: per-bucket counts (not cumulative; the encoder
/// cumulates them), the last bound `f64::MAX` for `+Inf`.
#[derive(Debug)]
struct ConstHistogram {
    sum: f64,
    count: u64,
    buckets: Vec<(f64, u64)>,
}

impl ConstHistogram {
    /// From cumulative `(bound, count)` buckets ending with `+Inf`, and the sum.
    fn of(cumulative: &[(f64, u64)], sum: f64) -> Self {
        let mut below = 0;
        let buckets = cumulative
            .iter()
            .map(|&(bound, cumulative)| {
                let n = cumulative - below;
                below = cumulative;
                (if bound.is_finite() { bound } else { f64::MAX }, n)
            })
            .collect();
        ConstHistogram {
            sum,
            count: below,
            buckets,
        }
    }
}

impl EncodeMetric for ConstHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        encoder.encode_histogram::<NoLabelSet>(self.sum, self.count, &self.buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// The `kube_persist_controller_*` families of the controllers added.
fn encode_controllers(
    controllers: &Mutex<Vec<(String, ControllerStats)>>,
    encoder: &mut DescriptorEncoder,
) -> Result<(), std::fmt::Error> {
    let samples: Vec<(String, ControllerCounts)> = controllers
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .map(|(name, stats)| (name.clone(), stats.get()))
        .collect();
    if samples.is_empty() {
        return Ok(());
    }
    let controller = |name: &str| labels([("controller", name)]);
    encode_family(
        encoder,
        "kube_persist_controller_reconcile",
        "Reconciles by result: success, requeue_after (Ok with a requeue), error, skipped (not run: the durable state showed the version handled).",
        MetricType::Counter,
        samples.iter().flat_map(|(name, c)| {
            [
                ("success", c.reconciled),
                ("requeue_after", c.requeued),
                ("error", c.failed),
                ("skipped", c.skipped),
            ]
            .map(|(result, n)| {
                (
                    labels([("controller", name), ("result", result)]),
                    ConstCounter::new(n),
                )
            })
        }),
    )?;
    let counters: [Metric<ControllerCounts, u64>; 4] = [
        (
            "reconcile_errors",
            "Reconciles that returned an error.",
            |c| c.failed,
        ),
        (
            "queue_adds",
            "Requests added to the queue for an object that had none waiting.",
            |c| c.queue_adds,
        ),
        (
            "queue_retries",
            "Retries the error policy asked for.",
            |c| c.queue_retries,
        ),
        (
            "startup_pass_read",
            "Objects the startup passes have read.",
            |c| c.startup_pass_read,
        ),
    ];
    for (metric, help, value) in counters {
        encode_family(
            encoder,
            &format!("kube_persist_controller_{metric}"),
            help,
            MetricType::Counter,
            samples
                .iter()
                .map(|(name, c)| (controller(name), ConstCounter::new(value(c)))),
        )?;
    }
    let gauges: [Metric<ControllerCounts, i64>; 5] = [
        ("active_workers", "Reconciles running.", |c| c.active as i64),
        (
            "queue_depth",
            "Requests waiting in the scheduler, requeues excepted.",
            |c| c.queue_depth as i64,
        ),
        (
            "pending_requeues",
            "Requeues and retries waiting in the scheduler.",
            |c| c.pending_requeues as i64,
        ),
        (
            "startup_pass_running",
            "1 while the startup pass (or its wait for the store to catch up) runs.",
            |c| i64::from(c.startup_pass_running),
        ),
        (
            "startup_pass_objects",
            "Objects in the store when the last startup pass began.",
            |c| c.startup_pass_objects as i64,
        ),
    ];
    for (metric, help, value) in gauges {
        encode_family(
            encoder,
            &format!("kube_persist_controller_{metric}"),
            help,
            MetricType::Gauge,
            samples
                .iter()
                .map(|(name, c)| (controller(name), ConstGauge::new(value(c)))),
        )?;
    }
    let histograms: [Metric<ControllerCounts, ConstHistogram>; 2] = [
        ("reconcile_time_seconds", "How long reconciles took.", |c| {
            ConstHistogram::of(&c.duration_buckets, c.duration_sum.as_secs_f64())
        }),
        (
            "queue_wait_seconds",
            "How long a due request waited in the queue before its reconcile started.",
            |c| ConstHistogram::of(&c.queue_wait_buckets, c.queue_wait_sum.as_secs_f64()),
        ),
    ];
    for (metric, help, value) in histograms {
        encode_family(
            encoder,
            &format!("kube_persist_controller_{metric}"),
            help,
            MetricType::Histogram,
            samples.iter().map(|(name, c)| (controller(name), value(c))),
        )?;
    }
    Ok(())
}
