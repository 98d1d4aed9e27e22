//! What every action of the driver works with: the stream's client and request, its
//! configuration, the parser, the writer on the disk thread, and the events it produces.

use std::collections::VecDeque;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};

use kube::core::Request;

use super::transition::StartSignal;
use super::{DriverParts, RawEvent};
use crate::exec::DiskWorker;
use crate::model::{Counters, Result};
use crate::store::{Change, State, StatusTx, Writer};
use crate::sync::catch_up::CatchUp;
use crate::sync::config::StreamConfig;
use crate::sync::conn::WatchTarget;
use crate::sync::pacing::Pacing;
use crate::sync::parse::{Ingest, Rejected};

/// See the module's doc.
pub(crate) struct Core {
    /// The stream's name (its keyspace), in every log line and error of the watcher.
    pub(crate) stream: Arc<str>,
    pub(crate) client: kube::Client,
    pub(crate) request: Request,
    pub(crate) metadata_only: bool,
    pub(crate) cfg: Arc<StreamConfig>,
    pub(crate) ingest: Ingest,
    pub(crate) writer: WriterHandle,
    pub(crate) status: StatusTx,
    pub(crate) stats: Arc<Counters>,
    /// Relist delays, page growth after expired continue tokens.
    pub(crate) pacing: Pacing,
    /// The body size of the last LIST page (see `Lister`).
    pub(crate) last_page_bytes: AtomicUsize,
    /// The next LIST page's request, sent ahead (see `ahead`).
    pub(crate) ahead: std::sync::Mutex<Option<super::ahead::Ahead>>,
    /// Whether the store has caught up with the server (not only connected).
    pub(crate) catch_up: CatchUp,
    /// Whether to produce events (a stream consumer exists).
    pub(crate) emit: bool,
    pub(crate) pending: VecDeque<RawEvent>,
    /// The first list of a store never synced: its objects are `InitApply` events.
    pub(crate) cold: bool,
    /// The error of the last effect, which a failing step returns.
    pub(crate) error: Option<crate::model::Error>,
}

impl Core {
    pub(crate) fn new(parts: DriverParts) -> Core {
        let DriverParts {
            client,
            stream,
            url,
            metadata_only,
            cfg,
            validate,
            writer,
            worker,
            stats,
        } = parts;
        let pacing = Pacing::new(cfg.min_backoff, cfg.max_backoff, cfg.relist_backoff_reset);
        let cfg = Arc::new(cfg);
        let state = writer.state().clone();
        let status = writer.status_sender();
        let catch_up = CatchUp::new(status.clone(), &format!("{url} (stream {stream:?})"));
        Core {
            stream: Arc::from(stream),
            client,
            ingest: Ingest {
                cfg: cfg.clone(),
                validate,
                stats: stats.clone(),
                url: url.as_str().into(),
                shard_warned: Arc::default(),
                compress: writer.compression(),
            },
            request: Request::new(url),
            metadata_only,
            cfg,
            writer: WriterHandle {
                writer: Arc::new(Mutex::new(writer)),
                worker,
                state,
            },
            status,
            stats,
            pacing,
            last_page_bytes: Default::default(),
            ahead: Default::default(),
            catch_up,
            emit: true,
            pending: VecDeque::new(),
            cold: true,
            error: None,
        }
    }

    /// The stream's URL and name, for errors (two streams of one URL differ by name).
    pub(crate) fn described(&self) -> String {
        format!("{} (stream {:?})", self.url(), self.stream)
    }

    pub(crate) fn url(&self) -> &str {
        &self.request.url_path
    }

    /// Where watches connect; `timeout` overrides the configured server-side timeout.
    pub(crate) fn target(&self, timeout: Option<u32>) -> WatchTarget<'_> {
        WatchTarget {
            stream: &self.stream,
            request: &self.request,
            metadata_only: self.metadata_only,
            cfg: &self.cfg,
            timeout,
        }
    }

    pub(crate) fn push(&mut self, ev: RawEvent) {
        if self.emit {
            self.pending.push_back(ev);
        }
    }

    pub(crate) fn push_changes(&mut self, changes: Vec<Change>) {
        let cold = self.cold;
        for c in changes {
            let ev = match c {
                Change::Created(b) | Change::Updated(b) if cold => RawEvent::InitApply(b),
                Change::Created(b) | Change::Updated(b) => RawEvent::Apply(b),
                Change::Deleted(b) => RawEvent::Delete(b),
            };
            self.push(ev);
        }
    }

    pub(crate) fn push_rejected(&mut self, rejected: Vec<Rejected>) {
        for r in rejected {
            self.push(RawEvent::Rejected(r));
        }
    }

    /// Give the start signal the transition decided on: `InitDone` after a first list;
    /// `Resumed` otherwise, whatever phase the store was reopened in (a restart in the middle
    /// of a relist resumes at its end).
    pub(crate) fn announce(&mut self, signal: StartSignal) {
        match signal {
            StartSignal::FirstList => self.push(RawEvent::InitDone),
            StartSignal::Resume => {
                let state = &self.writer.state;
                let rv = state.last_synced.clone().unwrap_or_default();
                tracing::info!(stream = %self.stream, url = %self.url(), resource_version = %rv, objects = state.count,
                    "store consistent again: resumed");
                self.push(RawEvent::Resumed(rv));
            }
            StartSignal::Given => {}
        }
    }
}

/// The writer, owned by the disk thread while it works; the driver keeps a copy of the
/// state as of the last job.
pub(crate) struct WriterHandle {
    writer: Arc<Mutex<Writer>>,
    pub(crate) worker: DiskWorker,
    pub(crate) state: State,
}

/// A job's result with the writer's state after it.
pub(crate) type Done<R> = Result<(Result<R>, State)>;

impl WriterHandle {
    /// Run `f` on the writer before the watcher starts (configuration of a new stream).
    pub(crate) fn configure(&mut self, f: impl FnOnce(&mut Writer)) {
        f(&mut self.writer.lock().unwrap_or_else(|p| p.into_inner()));
    }

    /// Run `job` with the writer on the disk thread.
    pub(crate) async fn run<R: Send + 'static>(
        &mut self,
        job: impl FnOnce(&mut Writer) -> Result<R> + Send + 'static,
    ) -> Result<R> {
        let done = self.start(job).await;
        self.finish(done)
    }

    /// Queue `job` on the disk thread now; the future (which borrows nothing) yields its
    /// result for [`WriterHandle::finish`], so other work can proceed meanwhile.
    pub(crate) fn start<R: Send + 'static>(
        &self,
        job: impl FnOnce(&mut Writer) -> Result<R> + Send + 'static,
    ) -> impl std::future::Future<Output = Done<R>> + Send + 'static {
        let writer = self.writer.clone();
        self.worker.submit(move || {
            let mut w = writer.lock().unwrap_or_else(|p| p.into_inner());
            let res = job(&mut w);
            Ok((res, w.state().clone()))
        })
    }

    /// Take in the state after a job started with [`WriterHandle::start`], and its result.
    pub(crate) fn finish<R>(&mut self, done: Done<R>) -> Result<R> {
        let (res, state) = done?;
        self.state = state;
        res
    }
}
