//! Prometheus metrics of streams (cargo feature `metrics`), in the
//! [`prometheus-client`](https://docs.rs/prometheus-client) registry a controller already
//! serves (the client kube-rs's controller examples use).
//!
//! [`Metrics::register`] adds one collector to the registry; [`Metrics::add`] adds a
//! stream to it. Nothing is counted twice: at every scrape the collector reads the
//! stream's live counters (the ones [`Reader::stats`] returns) and status, so the metrics
//! cost nothing between scrapes. Every metric is named `kube_persist_*` and labeled with
//! `stream`:
//!
//! | metric | type | what |
//! |---|---|---|
//! | `kube_persist_<field>_total` | counter | each field of [`Stats`], e.g. `kube_persist_objects_written_total`, `kube_persist_relists_total` |
//! | `kube_persist_objects` | gauge | objects stored |
//! | `kube_persist_sync_phase` | gauge | 1 for the stream's [`SyncPhase`] (label `phase`), 0 for the others |
//! | `kube_persist_ready` | gauge | 1 once a consistent snapshot is on disk |
//! | `kube_persist_watch_connected` | gauge | 1 while the watch is connected (not necessarily caught up) |
//! | `kube_persist_caught_up` | gauge | 1 once the store has applied everything the server had when its watch last (re)connected ([`Reader::is_caught_up`]) |
//! | `kube_persist_resource_versions_behind` | gauge | revisions the checkpoint is behind the server's resourceVersion read at the last (re)connect (absent where resourceVersions are not comparable) |
//! | `kube_persist_seconds_since_watch_activity` | gauge | seconds since the last watch event or bookmark (absent before the first) |
//! | `kube_persist_store_disk_bytes` | gauge | bytes of the store directory's files (shared by its streams) |
//!
//! [`Metrics::add_controller`] adds a controller's counters ([`Controller::stats`]), named
//! like controller-runtime's and labeled with `controller`:
//!
//! | metric | type | what |
//! |---|---|---|
//! | `kube_persist_controller_reconcile_total` | counter | reconciles by `result`: `success`, `requeue_after` (`Ok` with a requeue), `error`, `skipped` (not run: the durable state showed the version handled) |
//! | `kube_persist_controller_reconcile_errors_total` | counter | reconciles that returned `Err` |
//! | `kube_persist_controller_reconcile_time_seconds` | histogram | reconcile durations ([`RECONCILE_BUCKETS`]) |
//! | `kube_persist_controller_active_workers` | gauge | reconciles running |
//! | `kube_persist_controller_queue_depth` | gauge | requests waiting in the scheduler, requeues excepted |
//! | `kube_persist_controller_pending_requeues` | gauge | requeues and retries waiting in the scheduler |
//! | `kube_persist_controller_startup_pass_running` | gauge | 1 while the startup pass (or its wait for the store to catch up) runs |
//! | `kube_persist_controller_startup_pass_objects` | gauge | objects in the store when the last startup pass began |
//! | `kube_persist_controller_startup_pass_read_total` | counter | objects the startup passes have read |
//!
//! [`Controller::stats`]: crate::Controller::stats
//! [`RECONCILE_BUCKETS`]: crate::controller::RECONCILE_BUCKETS
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
//! metrics.add("pods", &reader);
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

// Layer: top (beside lib.rs). May import anything (tests/layers.rs).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use crate::Reader;
use crate::controller::{ControllerCounts, ControllerStats};
use crate::model::Stats;
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
        "errors",
        "Errors seen (each followed by a retry with backoff).",
        |s| s.errors,
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
/// kube_persist::metrics::Metrics::register(&mut registry).add("pods", &reader);
/// let mut text = String::new();
/// encode(&mut text, &registry)?;
/// assert!(text.contains("kube_persist_objects{stream=\"pods\"} 0"));
/// assert!(text.contains("kube_persist_sync_phase{stream=\"pods\",phase=\"Empty\"} 1"));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Metrics {
    streams: Arc<Mutex<Vec<Stream>>>,
    controllers: Arc<Mutex<Vec<(String, ControllerStats)>>>,
}

#[derive(Debug)]
struct Stream {
    name: String,
    source: MetricsSource,
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

    /// Serve the metrics of stream `name`, read through `reader`. Adding a name again
    /// replaces the earlier stream of that name.
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
    /// metrics.add("pods", &reader);
    /// metrics.add("pods", &reader); // replaces: still one stream
    /// let mut text = String::new();
    /// encode(&mut text, &registry)?;
    /// assert_eq!(text.matches("kube_persist_objects{stream=\"pods\"}").count(), 1);
    /// # Ok(()) }
    /// ```
    pub fn add<K>(&self, name: &str, reader: &Reader<K>) {
        let mut streams = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        streams.retain(|s| s.name != name);
        streams.push(Stream {
            name: name.to_string(),
            source: reader.metrics_source(),
        });
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
    stats: Stats,
    objects: u64,
    phase: SyncPhase,
    ready: bool,
    live: bool,
    caught_up: bool,
    behind: Option<u64>,
    quiet_seconds: Option<f64>,
    disk_bytes: Option<u64>,
}

fn sample(source: &MetricsSource) -> Sample {
    let status = source.status();
    Sample {
        stats: source.stats(),
        objects: status.count,
        phase: status.phase,
        ready: status.ready,
        live: status.live,
        caught_up: status.catch_up.caught_up,
        behind: status.catch_up.behind,
        quiet_seconds: source
            .stats
            .last_watch_activity()
            .map(|t| t.elapsed().map_or(0.0, |d| d.as_secs_f64())),
        disk_bytes: dir_bytes(&source.path),
    }
}

/// Bytes of the files in a store directory and its subdirectories (sled's `blobs/`): a
/// handful of `stat` calls.
fn dir_bytes(dir: &std::path::Path) -> Option<u64> {
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

impl Collector for Metrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let samples: Vec<(String, Sample)> = {
            let streams = self.streams.lock().unwrap_or_else(|p| p.into_inner());
            streams
                .iter()
                .map(|s| (s.name.clone(), sample(&s.source)))
                .collect()
        };
        encode_controllers(&self.controllers, &mut encoder)?;
        if samples.is_empty() {
            return Ok(());
        }
        let label = |name: &str| [("stream".to_string(), name.to_string())];
        for (metric, help, field) in COUNTERS {
            let name = format!("kube_persist_{metric}");
            let probe = ConstCounter::new(0u64);
            let mut family = encoder.encode_descriptor(&name, help, None, probe.metric_type())?;
            for (stream, s) in &samples {
                let labels = label(stream);
                ConstCounter::new(field(&s.stats)).encode(family.encode_family(&labels)?)?;
            }
        }
        let gauges: [Metric<Sample, Option<f64>>; 7] = [
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
                "seconds_since_watch_activity",
                "Seconds since the watch last delivered an event or bookmark.",
                |s| s.quiet_seconds,
            ),
            (
                "store_disk_bytes",
                "Bytes of the store directory's files (shared by the streams in it).",
                |s| s.disk_bytes.map(|b| b as f64),
            ),
        ];
        for (metric, help, value) in gauges {
            let name = format!("kube_persist_{metric}");
            let probe = ConstGauge::new(0.0f64);
            let mut family = encoder.encode_descriptor(&name, help, None, probe.metric_type())?;
            for (stream, s) in &samples {
                if let Some(v) = value(s) {
                    ConstGauge::new(v).encode(family.encode_family(&label(stream))?)?;
                }
            }
        }
        let probe = ConstGauge::new(0i64);
        let mut family = encoder.encode_descriptor(
            "kube_persist_sync_phase",
            "1 for the stream's phase in its list/watch cycle, 0 for the others.",
            None,
            probe.metric_type(),
        )?;
        for (stream, s) in &samples {
            for (phase, phase_name) in PHASES {
                let labels = [
                    ("stream".to_string(), stream.clone()),
                    ("phase".to_string(), phase_name.to_string()),
                ];
                ConstGauge::new(i64::from(s.phase == phase))
                    .encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
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
    fn of(c: &ControllerCounts) -> Self {
        let mut below = 0;
        let buckets = c
            .duration_buckets
            .iter()
            .map(|&(bound, cumulative)| {
                let n = cumulative - below;
                below = cumulative;
                (if bound.is_finite() { bound } else { f64::MAX }, n)
            })
            .collect();
        ConstHistogram {
            sum: c.duration_sum.as_secs_f64(),
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
    let label = |name: &str| [("controller".to_string(), name.to_string())];
    let mut family = encoder.encode_descriptor(
        "kube_persist_controller_reconcile",
        "Reconciles by result: success, requeue_after (Ok with a requeue), error, skipped (not run: the durable state showed the version handled).",
        None,
        MetricType::Counter,
    )?;
    for (name, c) in &samples {
        let results = [
            ("success", c.reconciled),
            ("requeue_after", c.requeued),
            ("error", c.failed),
            ("skipped", c.skipped),
        ];
        for (result, n) in results {
            let labels = [
                ("controller".to_string(), name.clone()),
                ("result".to_string(), result.to_string()),
            ];
            ConstCounter::new(n).encode(family.encode_family(&labels)?)?;
        }
    }
    let counters: [Metric<ControllerCounts, u64>; 2] = [
        (
            "reconcile_errors",
            "Reconciles that returned an error.",
            |c| c.failed,
        ),
        (
            "startup_pass_read",
            "Objects the startup passes have read.",
            |c| c.startup_pass_read,
        ),
    ];
    for (metric, help, value) in counters {
        let name = format!("kube_persist_controller_{metric}");
        let mut family = encoder.encode_descriptor(&name, help, None, MetricType::Counter)?;
        for (controller, c) in &samples {
            ConstCounter::new(value(c)).encode(family.encode_family(&label(controller))?)?;
        }
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
        let name = format!("kube_persist_controller_{metric}");
        let mut family = encoder.encode_descriptor(&name, help, None, MetricType::Gauge)?;
        for (controller, c) in &samples {
            ConstGauge::new(value(c)).encode(family.encode_family(&label(controller))?)?;
        }
    }
    let mut family = encoder.encode_descriptor(
        "kube_persist_controller_reconcile_time_seconds",
        "How long reconciles took.",
        None,
        MetricType::Histogram,
    )?;
    for (controller, c) in &samples {
        ConstHistogram::of(c).encode(family.encode_family(&label(controller))?)?;
    }
    Ok(())
}
