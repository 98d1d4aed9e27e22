//! The watcher: a pure transition function and the driver that performs its effects.
//!
//! `transition.rs` decides: [`next`](transition::next) takes where the stream is, what the
//! last effect returned (a value) and the stream's rules, and says where the stream is now
//! and what to do next. It holds every decision of a stream and does no I/O.
//!
//! The [`Driver`] here performs: each [`step`](Driver::step) performs the one action the
//! last transition asked for (a LIST page, a burst of watch events, a sweep chunk, a
//! connect, a backoff wait: `list.rs`, `delta.rs`, `watch.rs`, `local.rs`), summarises what
//! it returned as an [`Outcome`], feeds it to `next`, and carries out the bookkeeping the
//! transition asks for. It keeps the I/O a stage holds (a watch connection, a commit in
//! flight, a metadata page waiting for its fetches) and drops it when the stage no longer
//! does. Every write goes through the store's `Writer` on the disk thread in one atomic batch
//! with the persisted `Phase`, which is what a restarted process resumes from. See
//! docs/design.md for the diagram.
//!
//! Two rules keep the store honest:
//! - every start of a list, paginated or streaming, first, initial attempt or retry, goes
//!   through [`Action::BeginList`]: a new epoch, so that whatever the list does not mark is
//!   swept;
//! - any failure returns to [`Stage::Resume`] (after a backoff), which derives the next stage
//!   from the persisted phase only, never from in-memory leftovers of the failed attempt.

use std::sync::Arc;

use tokio::time::Instant;
use tracing::Instrument;

use super::backoff::{Backoff, jitter};
use super::config::StreamConfig;
use super::conn::{Line, WatchConn};
use super::indexers::Inspector;
use super::parse::{Parsed, Rejected};
use crate::exec::{DiskWorker, ListingGuard};
use crate::model::{Counters, Error, Result, resource_version};
use crate::store::{Phase, Writer};

mod ahead;
mod core;
mod delta;
mod fetch;
mod list;
mod local;
mod transition;
mod watch;

use self::core::Core;
use transition::{Action, At, Book, Delay, Outcome, Returned, Rules, Stage, StartSignal, Stored};

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

/// The I/O the current stage holds, kept between steps.
#[derive(Default)]
struct Held {
    /// The watch connection of a connected stage, and what it defers.
    conn: Option<WatchConn>,
    deferred: Deferred,
    /// A paginated LIST's commit in flight.
    committing: Option<list::Committing>,
    /// A metadata page waiting for its fetches.
    page: Option<delta::ListedPage>,
    /// When a backoff's wait ends.
    until: Option<Instant>,
}

impl Held {
    /// Drop what `stage` does not hold.
    fn keep_for(&mut self, stage: &Stage) {
        if !stage.connected() {
            self.conn = None;
            self.deferred = Deferred::Nothing;
        }
        if !matches!(
            stage,
            Stage::Listing {
                committing: transition::Committing::Page | transition::Committing::LastPage,
                ..
            }
        ) {
            self.committing = None;
        }
        if !matches!(stage, Stage::Fetching { .. }) {
            self.page = None;
        }
        if !matches!(stage, Stage::Backoff { .. }) {
            self.until = None;
        }
    }
}

/// Drives one stream: performs what [`transition::next`] asks for.
pub(crate) struct Driver {
    core: Core,
    rules: Rules,
    at: At,
    /// The action the last transition asked for.
    action: Action,
    held: Held,
    backoff: Backoff,
    /// A configuration error the server will not accept ended the watcher.
    pub(crate) fatal: bool,
    /// Held while the persisted phase is a list: the directory keeps list-page buffers
    /// for reuse only while some stream lists (see [`DiskWorker::listing`]).
    listing: Option<ListingGuard>,
}

/// What [`Driver::new`] needs.
pub(crate) struct DriverParts {
    pub(crate) client: kube::Client,
    /// The stream's name (its keyspace).
    pub(crate) stream: String,
    /// The collection's URL.
    pub(crate) url: String,
    /// A metadata-only store.
    pub(crate) metadata_only: bool,
    pub(crate) cfg: StreamConfig,
    /// Validation, indexes and the decode check of the user's type.
    pub(crate) validate: Option<Inspector>,
    pub(crate) writer: Writer,
    pub(crate) worker: DiskWorker,
    pub(crate) stats: Arc<Counters>,
}

impl Driver {
    pub(crate) fn new(parts: DriverParts) -> Self {
        let rules = Rules::of(&parts.cfg, parts.metadata_only);
        let backoff = Backoff::new(parts.cfg.min_backoff, parts.cfg.max_backoff);
        let at = At::start(&rules);
        Driver {
            core: Core::new(parts),
            rules,
            at,
            action: Action::Prepare,
            held: Held::default(),
            backoff,
            fatal: false,
            listing: None,
        }
    }

    /// Run `f` on the writer before the watcher starts (configuration of a new stream).
    pub(crate) fn configure_writer(&mut self, f: impl FnOnce(&mut Writer)) {
        self.core.writer.configure(f);
    }

    /// Whether to produce events (a stream consumer exists).
    pub(crate) fn set_emit(&mut self, emit: bool) {
        self.core.emit = emit;
    }

    /// The next event produced, if any.
    pub(crate) fn pop_event(&mut self) -> Option<RawEvent> {
        self.core.pending.pop_front()
    }

    /// Do one unit of work: perform the action the last transition asked for, and move on.
    /// After an error, the next step waits a jittered backoff and resumes from the
    /// persisted phase.
    pub(crate) async fn step(&mut self) -> Result<()> {
        let action = std::mem::take(&mut self.action);
        self.core.error = None;
        // At info: every line of the step (and of the disk and CPU threads it uses) names the
        // stream and its directory.
        let span = tracing::info_span!("watcher", stream = %self.core.stream, dir = %self.core.writer.worker.path().display(), url = %self.core.url(), stage = self.at.stage.name());
        let returned = self.perform(action).instrument(span.clone()).await;
        let listing = matches!(self.core.writer.state.phase, Phase::Listing { .. });
        if listing != self.listing.is_some() {
            self.listing = listing.then(|| self.core.writer.worker.listing());
        }
        let outcome = Outcome {
            returned,
            store: self.stored(),
        };
        let at = std::mem::replace(&mut self.at, At::start(&self.rules));
        let (at, effect) = span.in_scope(|| transition::next(at, outcome, &self.rules));
        self.at = at;
        self.action = effect.action;
        self.core.cold = self.at.signal == StartSignal::FirstList;
        self.held.keep_for(&self.at.stage);
        span.in_scope(|| self.keep_books(effect.book))
    }

    /// The store as the transition sees it.
    fn stored(&self) -> Stored {
        let state = &self.core.writer.state;
        Stored {
            phase: state.phase.clone(),
            ever_synced: state.last_synced.is_some(),
            comparable: state
                .last_synced
                .as_deref()
                .is_some_and(resource_version::is_comparable),
        }
    }

    /// Perform `action`; what it returned, with its error held for a failing step.
    async fn perform(&mut self, action: Action) -> Returned {
        let core = &mut self.core;
        let held = &mut self.held;
        let done = match action {
            Action::Nothing | Action::Stop => Ok(Returned::Nothing),
            Action::Prepare => local::prepare(core).await,
            Action::BuildIndex { after } => local::build_index(core, after).await,
            Action::Prune => local::prune(core).await,
            Action::BeginList { init } => local::begin_list(core, init).await,
            Action::Sweep => local::sweep(core).await,
            Action::ListPage {
                continue_token,
                read,
            } => list::page(core, &mut held.committing, continue_token, read).await,
            Action::ConnectInitial => list::connect_initial(core, &mut held.conn).await,
            Action::ReadInitial => list::read_initial(core, held).await,
            Action::MetadataPage { continue_token } => {
                delta::metadata_page(core, &mut held.page, continue_token).await
            }
            Action::Fetch => delta::fetch(core, held.page.take()).await,
            Action::FullPage { continue_token, at } => {
                delta::full_page(core, continue_token, at).await
            }
            Action::ConnectWatch => watch::connect(core, &mut held.conn).await,
            Action::ReadWatch => watch::read(core, held).await,
            Action::Wait(_) => {
                let until = held.until.take().unwrap_or_else(Instant::now);
                tracing::debug!(
                    delay_ms = until.saturating_duration_since(Instant::now()).as_millis() as u64,
                    "waiting before the next attempt"
                );
                tokio::time::sleep_until(until).await;
                Ok(Returned::Waited)
            }
        };
        done.unwrap_or_else(|e| self.failed(e))
    }

    /// A failed effect: its summary for the transition; the error is held for the step.
    fn failed(&mut self, e: Error) -> Returned {
        let returned = Returned::Failed {
            status: watch::status_of(&e),
            fatal: e.stops_watcher(),
            detail: e.to_string(),
        };
        self.core.error = Some(e);
        returned
    }

    /// Carry out the bookkeeping the transition asked for.
    fn keep_books(&mut self, book: Book) -> Result<()> {
        let core = &mut self.core;
        if book.init {
            core.push(RawEvent::Init);
        }
        if book.resumed {
            Counters::add(&core.stats.resumes, 1);
        }
        if book.token_expired {
            core.pacing.token_expired();
        }
        if book.delta_fallback {
            Counters::add(&core.stats.delta_fallbacks, 1);
        }
        if book.watch_failed {
            core.pacing.watch_failed();
        }
        if book.watch_up {
            core.pacing.watch_up();
        }
        if let Some(live) = book.live {
            core.status.live(live);
        }
        if book.reset_backoff {
            self.backoff.reset();
        }
        if book.list_complete {
            core.pacing.list_complete();
            let checkpoint = core.writer.state.last_synced.clone().unwrap_or_default();
            core.catch_up.list_done(&checkpoint);
        }
        if let Some(signal) = book.announce {
            core.announce(signal);
        }
        if let Action::Wait(Delay::Relist(why)) = &self.action {
            let d = jitter(core.cfg.relist_jitter) + core.pacing.relist_delay();
            tracing::info!(stream = %core.stream, url = %core.url(), reason = %why, delay_ms = d.as_millis() as u64,
                relists_in_a_row = core.pacing.relists_in_a_row(), "relisting");
            self.held.until = Some(Instant::now() + d);
        }
        if !book.fail {
            return Ok(());
        }
        core.catch_up.lost("list/watch error");
        let e = core.error.take().unwrap_or_else(|| Error::Protocol {
            context: core.described(),
            detail: "a step failed without an error".into(),
        });
        core.stats.error(&e);
        if self.at.stage == Stage::Stopped {
            // Retrying cannot fix a configuration the server refuses.
            tracing::error!(stream = %core.stream, url = %core.url(), error = %e, "configuration error: the watcher stops");
            self.fatal = true;
            return Err(e);
        }
        let delay = self.backoff.next_delay();
        tracing::warn!(stream = %core.stream, url = %core.url(), error = %e, retry_in_ms = delay.as_millis() as u64,
            "list/watch error, backing off");
        self.held.until = Some(Instant::now() + delay);
        Err(e)
    }
}

impl Drop for Driver {
    /// Readers of a dropped watcher's store are told it is no longer live (nor caught up).
    fn drop(&mut self) {
        self.core.status.live(false);
        self.core.catch_up.lost("the watcher was dropped");
    }
}
