//! The list/watch/relist state machine.
//!
//! The watcher is always in one [`Stage`]; [`Machine::step`] performs one unit of work (one
//! LIST page, one burst of watch events, one sweep chunk, one connect, one backoff wait) and
//! moves to the next stage. Every write goes through the [`Writer`] on the disk thread in one
//! atomic batch with the persisted [`Phase`], which is what a restarted process resumes
//! from. See docs/design.md for the diagram.
//!
//! Two rules keep the store honest:
//! - every start of a list, paginated or streaming, first, initial attempt or retry, goes
//!   through `begin_list`: a new epoch, so that whatever the list does not mark is swept;
//! - any error returns to [`Stage::Resume`] (after a backoff), which derives the next stage
//!   from the persisted phase only, never from in-memory leftovers of the failed attempt.
//!
//! Longer than 600 lines: the [`Stage`] enum with its transitions and the shared state of
//! every stage, in one file so that the state machine reads in one place; the stages' work is
//! in `machine/listing.rs` and `machine/watching.rs`.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use kube::core::Request;
use tokio::time::Instant;
use tracing::Instrument;

use super::backoff::{Backoff, jitter};
use super::catch_up::CatchUp;
use super::config::StreamConfig;
use super::conn::{Line, WatchConn, WatchTarget};
use super::indexers::Inspector;
use super::pacing::Pacing;
use super::parse::{Ingest, Parsed, Rejected};

mod delta;
mod fetch;
mod listing;
mod watching;
use crate::exec::{DiskWorker, ListingGuard};
use crate::model::Counters;
use crate::model::{Error, Result};
use crate::store::StatusTx;
use crate::store::{Change, Writer};
use crate::store::{Phase, State};
use delta::{DeltaGate, PageShape};

/// How long a live watch burst waits for more events after its first one: events that
/// arrive together are committed in one batch (up to `page_size`), for a few ms of latency.
const WATCH_LINGER: std::time::Duration = std::time::Duration::from_millis(5);

/// The same for a streaming list's initial events, which arrive as fast as the server
/// sends them: nothing is live yet, so they are gathered into pages like a LIST's.
const INITIAL_LINGER: std::time::Duration = std::time::Duration::from_millis(100);

/// An event before it is decoded into the user's type.
#[derive(Debug)]
pub(crate) enum RawEvent {
    Resumed(String),
    Init,
    InitApply(crate::store::Body),
    InitDone,
    Apply(crate::store::Body),
    Delete(Vec<u8>),
    /// An object the store refused; its previous version was removed.
    Rejected(Rejected),
}

/// Where the watcher is. Each variant carries what its next step needs.
#[derive(Debug)]
pub(crate) enum Stage {
    /// Not started: reconcile the configured indexes with those on disk, announce a resume.
    Start,
    /// Building newly configured indexes from disk; `after` is the last key indexed.
    BuildingIndex { after: Option<Vec<u8>> },
    /// Removing the objects outside a narrowed shard (the cursor is on disk), then
    /// building indexes if `then_build`.
    Pruning { then_build: bool },
    /// Derive the next stage from the persisted phase (after start, and after any error).
    Resume,
    /// A paginated LIST; the next page continues from `continue_token` (the first page
    /// without one), fetched while the page before is still `committing` on the disk thread.
    Listing {
        continue_token: Option<String>,
        committing: Option<listing::Committing>,
    },
    /// A delta relist (see `sync/relist.rs`): the next page continues from
    /// `continue_token`, in `shape`.
    DeltaListing {
        continue_token: Option<String>,
        shape: PageShape,
    },
    /// A streaming list (`sendInitialEvents=true`): reading initial events from `conn`
    /// (`None`: connect next). `received`: initial events seen on this connection.
    StreamingInitial {
        conn: Option<WatchConn>,
        received: u64,
    },
    /// Removing objects the last list did not see; `then` is the streaming list's
    /// connection with the live events that followed its end bookmark.
    Sweeping {
        then: Option<(WatchConn, Vec<Line>)>,
    },
    /// Watching from the checkpoint (`None`: connect next); what is `deferred` is applied
    /// before reading more.
    Watching {
        conn: Option<WatchConn>,
        deferred: Deferred,
    },
    /// Waiting until `until` after an error or before a relist, then `next`.
    Backoff { until: Instant, next: Box<Stage> },
}

/// The one start signal a watcher gives its consumers, whatever phase it starts in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StartSignal {
    /// A store never synced: `Init`, the first list as `InitApply`, then `InitDone`.
    FirstList,
    /// A store synced before: `Resumed` once it is consistent again, that is at once from
    /// a `Synced` checkpoint, or when the interrupted relist, sweep or prune completed.
    Resume,
    /// Given; later changes are `Apply`/`Delete`.
    Given,
}

/// What a watch applies before it reads more from its connection.
#[derive(Debug, Default)]
pub(crate) enum Deferred {
    #[default]
    Nothing,
    /// Lines read but not parsed: live events that followed a streaming list's end bookmark.
    Lines(Vec<Line>),
    /// A burst read and parsed while the previous one was being committed.
    Parsed(Box<PendingBurst>),
}

/// A parsed watch burst waiting for its commit.
#[derive(Debug)]
pub(crate) struct PendingBurst {
    parsed: Parsed,
    /// The server ended the stream after this burst.
    ended: bool,
}

impl Stage {
    /// Where to go after an error in this stage.
    fn retry_point(&self) -> Stage {
        match self {
            Stage::Start => Stage::Start,
            Stage::BuildingIndex { after } => Stage::BuildingIndex {
                after: after.clone(),
            },
            Stage::Pruning { then_build } => Stage::Pruning {
                then_build: *then_build,
            },
            _ => Stage::Resume,
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Stage::Start => "start",
            Stage::BuildingIndex { .. } => "building-index",
            Stage::Pruning { .. } => "pruning",
            Stage::Resume => "resume",
            Stage::Listing { .. } => "listing",
            Stage::DeltaListing { .. } => "delta-listing",
            Stage::StreamingInitial { .. } => "streaming-initial",
            Stage::Sweeping { .. } => "sweeping",
            Stage::Watching { .. } => "watching",
            Stage::Backoff { .. } => "backoff",
        }
    }

    /// Still preparing the store (indexes, a prune) before it serves a consistent view.
    fn preparing(&self) -> bool {
        match self {
            Stage::Start | Stage::BuildingIndex { .. } | Stage::Pruning { .. } => true,
            Stage::Backoff { next, .. } => next.preparing(),
            _ => false,
        }
    }
}

/// The writer, owned by the disk thread while it works; the machine keeps a copy of the
/// state as of the last job.
struct WriterHandle {
    writer: Arc<Mutex<Writer>>,
    worker: DiskWorker,
    state: State,
}

/// A job's result with the writer's state after it.
type Done<R> = Result<(Result<R>, State)>;

impl WriterHandle {
    /// Run `job` with the writer on the disk thread.
    async fn run<R: Send + 'static>(
        &mut self,
        job: impl FnOnce(&mut Writer) -> Result<R> + Send + 'static,
    ) -> Result<R> {
        let done = self.start(job).await;
        self.finish(done)
    }

    /// Queue `job` on the disk thread now; the future (which borrows nothing) yields its
    /// result for [`WriterHandle::finish`], so other work can proceed meanwhile.
    fn start<R: Send + 'static>(
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
    fn finish<R>(&mut self, done: Done<R>) -> Result<R> {
        let (res, state) = done?;
        self.state = state;
        res
    }
}

pub(crate) struct Machine {
    /// The stream's name (its keyspace), in every log line and error of the machine.
    stream: Arc<str>,
    client: kube::Client,
    request: Request,
    metadata_only: bool,
    cfg: Arc<StreamConfig>,
    ingest: Ingest,
    writer: WriterHandle,
    status: StatusTx,
    stats: Arc<Counters>,
    backoff: Backoff,
    stage: Stage,
    /// Whether to produce events (a stream consumer exists).
    emit: bool,
    pub(crate) pending: VecDeque<RawEvent>,
    /// The start signal still to give (and whether this is the first list: `Init*` events).
    signal: StartSignal,
    /// Streaming lists in use: configured, and the server has not shown it lacks them (or
    /// they kept being cut).
    streaming: bool,
    /// Relist backoff, streaming-list cuts, page growth after expired continue tokens.
    pacing: Pacing,
    /// `ResourceVersionTooLarge` answers in a row.
    too_large: u32,
    /// The body size of the last LIST page (see `Lister`).
    last_page_bytes: std::sync::atomic::AtomicUsize,
    /// Whether the store has caught up with the server (not only connected).
    catch_up: CatchUp,
    /// A configuration error the server will not accept ended the watcher.
    pub(crate) fatal: bool,
    /// Whether delta relists may run (the server may have refused them, or its
    /// resourceVersions are not comparable).
    delta: DeltaGate,
    /// Held while the persisted phase is a list: the directory keeps list-page buffers
    /// for reuse only while some stream lists (see [`DiskWorker::listing`]).
    listing: Option<ListingGuard>,
}

impl Machine {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        client: kube::Client,
        stream: &str,
        url: String,
        metadata_only: bool,
        cfg: StreamConfig,
        validate: Option<Inspector>,
        writer: Writer,
        worker: DiskWorker,
        stats: Arc<Counters>,
    ) -> Self {
        let backoff = Backoff::new(cfg.min_backoff, cfg.max_backoff);
        let pacing = Pacing::new(cfg.min_backoff, cfg.max_backoff, cfg.relist_backoff_reset);
        let cfg = Arc::new(cfg);
        let state = writer.state().clone();
        let status = writer.status_sender();
        let catch_up = CatchUp::new(status.clone(), &format!("{url} (stream {stream:?})"));
        Machine {
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
            streaming: cfg.streaming_lists,
            cfg,
            writer: WriterHandle {
                writer: Arc::new(Mutex::new(writer)),
                worker,
                state,
            },
            status,
            stats,
            backoff,
            stage: Stage::Start,
            emit: true,
            pending: VecDeque::new(),
            signal: StartSignal::FirstList,
            pacing,
            too_large: 0,
            last_page_bytes: Default::default(),
            catch_up,
            fatal: false,
            delta: DeltaGate::Open,
            listing: None,
        }
    }

    /// Run `f` on the writer before the watcher starts (configuration of a new stream).
    pub(crate) fn configure_writer(&mut self, f: impl FnOnce(&mut Writer)) {
        f(&mut self.writer.writer.lock().unwrap_or_else(|p| p.into_inner()));
    }

    pub(crate) fn set_emit(&mut self, emit: bool) {
        self.emit = emit;
    }

    /// The stream's URL and name, for errors (two streams of one URL differ by name).
    fn described(&self) -> String {
        format!("{} (stream {:?})", self.url(), self.stream)
    }

    fn url(&self) -> &str {
        &self.request.url_path
    }

    fn synced(&self) -> bool {
        matches!(self.writer.state.phase, Phase::Synced { .. })
    }

    /// The first list of a store never synced: its objects are `InitApply` events.
    fn cold(&self) -> bool {
        self.signal == StartSignal::FirstList
    }

    /// Give the start signal once the store is consistent: synced, and no prune or index
    /// build left. `InitDone` after a first list; `Resumed` otherwise, whatever phase the
    /// store was reopened in (a restart in the middle of a relist resumes at its end).
    fn announce(&mut self) {
        if self.signal == StartSignal::Given || !self.synced() || self.stage.preparing() {
            return;
        }
        match self.signal {
            StartSignal::FirstList => self.push(RawEvent::InitDone),
            StartSignal::Resume => {
                let rv = self.writer.state.last_synced.clone().unwrap_or_default();
                tracing::info!(stream = %self.stream, url = %self.url(), resource_version = %rv, objects = self.writer.state.count,
                    "store consistent again: resumed");
                self.push(RawEvent::Resumed(rv));
            }
            StartSignal::Given => {}
        }
        self.signal = StartSignal::Given;
    }

    /// Do one unit of work. After an error, the next step waits a jittered backoff and
    /// resumes from the persisted phase.
    pub(crate) async fn step(&mut self) -> Result<()> {
        let stage = std::mem::replace(&mut self.stage, Stage::Resume);
        let retry = stage.retry_point();
        let was_synced = self.synced();
        let span = tracing::debug_span!("kube_persist", stream = %self.stream, url = %self.request.url_path, stage = stage.name());
        let result = self.transition(stage).instrument(span).await;
        let listing = matches!(self.writer.state.phase, Phase::Listing { .. });
        if listing != self.listing.is_some() {
            self.listing = listing.then(|| self.writer.worker.listing());
        }
        match result {
            Ok(next) => self.stage = next,
            Err(e) => {
                Counters::add(&self.stats.errors, 1);
                self.catch_up.lost("list/watch error");
                if let Error::Config(why) = &e {
                    // Retrying cannot fix a configuration the server refuses.
                    tracing::error!(stream = %self.stream, url = %self.url(), error = %why, "configuration error: the watcher stops");
                    self.fatal = true;
                    self.set_live(false);
                    return Err(e);
                }
                let delay = self.backoff.next_delay();
                tracing::warn!(stream = %self.stream, url = %self.url(), error = %e, retry_in_ms = delay.as_millis() as u64,
                    "list/watch error, backing off");
                self.set_live(false);
                self.stage = Stage::Backoff {
                    until: Instant::now() + delay,
                    next: Box::new(retry),
                };
                return Err(e);
            }
        }
        if !was_synced && self.synced() {
            self.backoff.reset();
            self.pacing.list_complete();
            let checkpoint = self.writer.state.last_synced.clone().unwrap_or_default();
            self.catch_up.list_done(&checkpoint);
        }
        self.announce();
        Ok(())
    }

    /// The transition function: one unit of work in `stage`, returning the next stage.
    async fn transition(&mut self, stage: Stage) -> Result<Stage> {
        match stage {
            Stage::Start => self.start().await,
            Stage::BuildingIndex { after } => self.build_index_chunk(after).await,
            Stage::Pruning { then_build } => self.prune_chunk(then_build).await,
            Stage::Resume => self.resume().await,
            Stage::Backoff { until, next } => {
                tracing::debug!(
                    delay_ms = until.saturating_duration_since(Instant::now()).as_millis() as u64,
                    "waiting before the next attempt"
                );
                tokio::time::sleep_until(until).await;
                Ok(*next)
            }
            Stage::Listing {
                continue_token,
                committing,
            } => self.list_page(continue_token, committing).await,
            Stage::DeltaListing {
                continue_token,
                shape,
            } => self.delta_page(continue_token, shape).await,
            Stage::StreamingInitial { conn: None, .. } => self.connect_initial().await,
            Stage::StreamingInitial {
                conn: Some(conn),
                received,
            } => self.read_initial(conn, received).await,
            Stage::Sweeping { then } => self.sweep_chunk(then).await,
            Stage::Watching {
                conn: None,
                deferred,
            } => self.connect_watch(deferred).await,
            Stage::Watching {
                conn: Some(conn),
                deferred,
            } => self.read_watch(conn, deferred).await,
        }
    }

    /// Prepare the indexes and announce a resume; the rest follows from the phase.
    async fn start(&mut self) -> Result<Stage> {
        let configured = self.cfg.index_names();
        let (build, prune) = self
            .writer
            .run(move |w| {
                Ok((
                    w.prepare_indexes(&configured)?,
                    w.prune_pending()?.is_some(),
                ))
            })
            .await?;
        let state = self.writer.state.clone();
        self.signal = match state.last_synced {
            None => StartSignal::FirstList,
            Some(_) => StartSignal::Resume,
        };
        match &state.phase {
            Phase::Synced { resource_version } => {
                Counters::add(&self.stats.resumes, 1);
                tracing::info!(stream = %self.stream, url = %self.url(), resource_version = %resource_version, objects = state.count,
                    prune, "resuming from checkpoint without a paginated LIST");
            }
            Phase::Listing {
                continue_token: Some(_),
                ..
            } if !self.streaming => {
                tracing::info!(stream = %self.stream, url = %self.url(), epoch = state.epoch, "continuing an interrupted list");
                if self.cold() {
                    self.push(RawEvent::Init);
                }
            }
            Phase::Sweeping { .. } => {
                tracing::info!(stream = %self.stream, url = %self.url(), "continuing an interrupted sweep")
            }
            Phase::Listing { .. } if !self.cold() => {
                tracing::info!(stream = %self.stream, url = %self.url(), "an interrupted relist starts again; resumed at its end")
            }
            Phase::Empty | Phase::Listing { .. } => {}
        }
        Ok(if prune {
            Stage::Pruning { then_build: build }
        } else if build {
            Stage::BuildingIndex { after: None }
        } else {
            Stage::Resume
        })
    }

    /// One chunk of the prune of a narrowed shard (one atomic batch with its cursor).
    async fn prune_chunk(&mut self, then_build: bool) -> Result<Stage> {
        let Some(shard) = self.cfg.get_shard().cloned() else {
            return Ok(Stage::Resume);
        };
        let page = self.cfg.page_size as usize;
        let done = self.writer.run(move |w| w.prune_step(&shard, page)).await?;
        Ok(match (done, then_build) {
            (false, _) => Stage::Pruning { then_build },
            (true, true) => Stage::BuildingIndex { after: None },
            (true, false) => {
                tracing::info!(stream = %self.stream, url = %self.url(), objects = self.writer.state.count, "prune complete");
                Stage::Resume
            }
        })
    }

    async fn build_index_chunk(&mut self, after: Option<Vec<u8>>) -> Result<Stage> {
        let Some(inspect) = self.ingest.validate.clone() else {
            return Ok(Stage::Resume);
        };
        let page = self.cfg.page_size as usize;
        let names = self.cfg.index_names();
        self.writer
            .run(move |w| {
                let last = w.index_chunk(after, page, &|b| inspect(b).map(|i| i.entries))?;
                if last.is_none() {
                    tracing::info!(indexes = ?names, "indexes built");
                    w.set_built_indexes(&names)?;
                }
                Ok(match last {
                    Some(after) => Stage::BuildingIndex { after: Some(after) },
                    None => Stage::Resume,
                })
            })
            .await
    }

    /// The next stage from the persisted phase alone (see [`resume_plan`]).
    async fn resume(&mut self) -> Result<Stage> {
        Ok(
            // A delta relist continues from its token even where lists stream.
            match resume_plan(
                &self.writer.state.phase,
                self.streaming && !self.delta_relist(),
            ) {
                ResumePlan::BeginList => return self.begin_list().await,
                ResumePlan::ContinueList(token) if self.delta_relist() => Stage::DeltaListing {
                    continue_token: Some(token),
                    shape: PageShape::Metadata,
                },
                ResumePlan::ContinueList(token) => Stage::Listing {
                    continue_token: Some(token),
                    committing: None,
                },
                ResumePlan::Sweep => Stage::Sweeping { then: None },
                ResumePlan::Watch => Stage::Watching {
                    conn: None,
                    deferred: Deferred::Nothing,
                },
            },
        )
    }

    /// Start a list with a new epoch (whatever it does not see is swept at its end).
    async fn begin_list(&mut self) -> Result<Stage> {
        // A new relist (not the retry of one in progress) may try a delta relist again.
        let retry = matches!(self.writer.state.phase, Phase::Listing { .. });
        if self.delta == DeltaGate::ClosedForThisRelist && !retry {
            self.delta = DeltaGate::Open;
        }
        self.set_live(false);
        self.catch_up.list_began();
        self.writer.run(|w| w.begin_list()).await?;
        if self.cold() {
            self.push(RawEvent::Init);
        }
        Ok(self.list_stage())
    }

    fn list_stage(&self) -> Stage {
        if self.delta_relist() {
            tracing::info!(stream = %self.stream, url = %self.url(), mode = ?self.cfg.relist_mode,
                "delta relist: metadata pages, bodies of the new or changed objects only");
            Stage::DeltaListing {
                continue_token: None,
                shape: PageShape::Metadata,
            }
        } else if self.streaming {
            Stage::StreamingInitial {
                conn: None,
                received: 0,
            }
        } else {
            Stage::Listing {
                continue_token: None,
                committing: None,
            }
        }
    }

    /// The server said our version is gone: list again (new epoch), after a random delay
    /// so that clients relisting after an API server restart spread out.
    /// Relists in a row (without a watch healthy for `relist_backoff_reset` in between) also
    /// wait an exponential backoff, so a server answering 410 after every sync is not
    /// listed from scratch every second.
    async fn relist(&mut self, why: &str) -> Result<Stage> {
        let d = jitter(self.cfg.relist_jitter) + self.pacing.relist_delay();
        tracing::info!(stream = %self.stream, url = %self.url(), reason = why, delay_ms = d.as_millis() as u64,
            relists_in_a_row = self.pacing.relists_in_a_row(), "relisting");
        self.too_large = 0;
        let next = self.begin_list().await?;
        Ok(Stage::Backoff {
            until: Instant::now() + d,
            next: Box::new(next),
        })
    }

    /// The server does not stream lists: use paginated LISTs from now on.
    async fn fall_back(&mut self, why: &str) -> Result<Stage> {
        tracing::warn!(stream = %self.stream, url = %self.url(), reason = why,
            "streaming lists (sendInitialEvents) unusable with this API server; falling back to paginated LIST for this process");
        self.streaming = false;
        self.begin_list().await
    }

    /// A streaming list was cut (or failed) before its end bookmark: a failure (the retry
    /// waits a backoff and lists again in a new epoch); after a few in a row, fall back
    /// to paginated LISTs, as client-go's reflector does when a watch-list fails.
    async fn streaming_cut(&mut self, e: Error) -> Result<Stage> {
        if self.pacing.streaming_cut() {
            let why = format!(
                "{} streaming lists in a row cut before their end bookmark (last: {e})",
                self.pacing.streaming_cuts()
            );
            return self.fall_back(&why).await;
        }
        Err(e)
    }
}

impl Drop for Machine {
    /// Readers of a dropped watcher's store are told it is no longer live (nor caught up).
    fn drop(&mut self) {
        self.set_live(false);
        self.catch_up.lost("the watcher was dropped");
    }
}

impl Machine {
    /// Where watches connect; `timeout` overrides the configured server-side timeout.
    fn target(&self, timeout: Option<u32>) -> WatchTarget<'_> {
        WatchTarget {
            stream: &self.stream,
            request: &self.request,
            metadata_only: self.metadata_only,
            cfg: &self.cfg,
            timeout,
        }
    }

    async fn sweep_chunk(&mut self, then: Option<(WatchConn, Vec<Line>)>) -> Result<Stage> {
        let (page, emit) = (self.cfg.page_size as usize, self.emit);
        let (changes, done) = self.writer.run(move |w| w.sweep_step(page, emit)).await?;
        self.push_changes(changes);
        if !done {
            return Ok(Stage::Sweeping { then });
        }
        Ok(match then {
            Some((conn, deferred)) => Stage::Watching {
                conn: Some(conn),
                deferred: Deferred::Lines(deferred),
            },
            None => Stage::Watching {
                conn: None,
                deferred: Deferred::Nothing,
            },
        })
    }

    fn push(&mut self, ev: RawEvent) {
        if self.emit {
            self.pending.push_back(ev);
        }
    }

    fn push_changes(&mut self, changes: Vec<Change>) {
        let cold = self.cold();
        for c in changes {
            let ev = match c {
                Change::Created(b) | Change::Updated(b) if cold => RawEvent::InitApply(b),
                Change::Created(b) | Change::Updated(b) => RawEvent::Apply(b),
                Change::Deleted(b) => RawEvent::Delete(b),
            };
            self.push(ev);
        }
    }

    fn push_rejected(&mut self, rejected: Vec<Rejected>) {
        for r in rejected {
            self.push(RawEvent::Rejected(r));
        }
    }

    /// Mark the watch as connected (or not), for `Reader::wait_until_live`.
    fn set_live(&self, live: bool) {
        self.status.live(live);
    }
}

/// Where a stream goes on from its stored phase (after a restart, a reopen, or an error
/// that retries from the stored state).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ResumePlan {
    /// A new list, in a new epoch.
    BeginList,
    /// The interrupted paginated list, from its continue token.
    ContinueList(String),
    /// The interrupted sweep of a completed list.
    Sweep,
    /// The watch, from the checkpoint.
    Watch,
}

/// The resume plan of `phase`; `streaming`: the stream lists by streaming lists.
pub(crate) fn resume_plan(phase: &Phase, streaming: bool) -> ResumePlan {
    match phase {
        Phase::Empty => ResumePlan::BeginList,
        // Only a paginated list with a continue token can be continued. A streaming list
        // cannot, and a list without a token may hold objects of an interrupted streaming
        // attempt in this epoch: every such attempt is a new list.
        Phase::Listing {
            continue_token: Some(token),
            ..
        } if !streaming => ResumePlan::ContinueList(token.clone()),
        Phase::Listing { .. } => ResumePlan::BeginList,
        Phase::Sweeping { .. } => ResumePlan::Sweep,
        Phase::Synced { .. } => ResumePlan::Watch,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resume_plans_continue_only_a_paginated_list_with_a_token() {
        let listing = |token: Option<&str>| Phase::Listing {
            continue_token: token.map(str::to_string),
            sweep: true,
        };
        for streaming in [false, true] {
            assert_eq!(resume_plan(&Phase::Empty, streaming), ResumePlan::BeginList);
            assert_eq!(
                resume_plan(&listing(None), streaming),
                ResumePlan::BeginList
            );
            assert_eq!(
                resume_plan(
                    &Phase::Synced {
                        resource_version: "9".into()
                    },
                    streaming
                ),
                ResumePlan::Watch
            );
        }
        assert_eq!(
            resume_plan(&listing(Some("t")), false),
            ResumePlan::ContinueList("t".into())
        );
        assert_eq!(
            resume_plan(&listing(Some("t")), true),
            ResumePlan::BeginList
        );
    }
}
