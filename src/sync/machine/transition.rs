//! The watcher's one transition function: [`next`] takes where the stream is ([`At`]), what
//! the last effect returned ([`Outcome`], a value: counts, tokens, a status classified once
//! by [`StatusKind::of`]) and the stream's [`Rules`], and says where the stream is now and
//! what to do next ([`Effect`]). It performs no I/O and reads no clock: the driver
//! (`machine/mod.rs`) performs the effect and feeds the outcome back. Every decision of a
//! stream is here: where a restart resumes from the stored phase, which list runs (delta,
//! streaming or paginated) and each delta page's shape, the fallbacks (incomparable
//! resourceVersions, a refused request, a streaming list the server does not support), the
//! relist after `410 Gone`, the retries of `ResourceVersionTooLarge`, the backoff and its
//! resets, the sweep, the start signal and the bookkeeping that follows the stage.
//!
//! The diagram in docs/design.md ("The watcher state machine") is checked against this
//! function by `tests::the_diagram_draws_every_transition`.
//!
//! Longer than 600 lines: the stage, outcome and effect types with the function that moves
//! between them, in one file so that every decision of a stream reads in one place.

use super::super::config::{RelistMode, StreamConfig};
use super::super::raw::StatusKind;
use crate::store::Phase;

/// `ERROR` events in a row (other than 410 and `ResourceVersionTooLarge`) on watches from
/// one checkpoint, with no event delivered in between, before the watcher relists instead
/// of resuming from that checkpoint again: kube-apiserver without a watch cache answers a
/// watch from just below its compaction point with `500 PrevKv=nil` every time.
pub(crate) const WATCH_ERRORS_BEFORE_RELIST: u32 = 5;

/// Streaming lists cut before their end bookmark, in a row, before the watcher falls back
/// to paginated LISTs for the rest of the process.
pub(crate) const STREAMING_CUTS_BEFORE_FALLBACK: u32 = 3;

/// Where the watcher is. Pure data: the driver holds the I/O that goes with it (the watch
/// connection of a connected stage, the commit in flight of `Listing`, the metadata page of
/// `Fetching`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Stage {
    /// Not started: reconcile the configured indexes with those on disk.
    Start,
    /// Building newly configured indexes from disk; `after` is the last key indexed.
    BuildingIndex { after: Option<Vec<u8>> },
    /// Removing the objects outside a narrowed shard (the cursor is on disk), then
    /// building indexes if `then_build`.
    Pruning { then_build: bool },
    /// Derive the next stage from the persisted phase (after start, and after any error).
    Resume,
    /// Start a list in a new epoch (whatever it does not see is swept at its end);
    /// `relist`: after `410 Gone` or its like, the list waits the relist delay first.
    BeginList { relist: Option<String> },
    /// A paginated LIST; the next page continues from `continue_token` (the first page
    /// without one), read while the page before is still committing on the disk thread.
    Listing {
        continue_token: Option<String>,
        committing: Committing,
    },
    /// A delta relist's page: listed as metadata, or in `Full` (exactly `at`, the snapshot
    /// of the metadata page it replaces, when there was one).
    DeltaListing {
        continue_token: Option<String>,
        shape: PageShape,
        at: Option<String>,
    },
    /// Fetching the bodies of a metadata page's new or changed objects (listed `at`).
    Fetching {
        continue_token: Option<String>,
        at: String,
    },
    /// A streaming list (`sendInitialEvents=true`); `received`: initial events seen on this
    /// connection.
    StreamingInitial { connected: bool, received: u64 },
    /// Removing objects the last list did not see; `then_connected`: the streaming list's
    /// connection (and the live events after its end bookmark) is kept for the watch.
    Sweeping { then_connected: bool },
    /// Watching from the checkpoint.
    Watching { connected: bool },
    /// Waiting `delay`, then `next`.
    Backoff { delay: Delay, next: Box<Stage> },
    /// A configuration the server will never accept: the watcher has stopped.
    Stopped,
}

/// What a paginated LIST's stage has on the disk thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Committing {
    Nothing,
    /// A page, and more pages after it.
    Page,
    /// The last page: nothing more to read, only its commit to take in.
    LastPage,
}

/// How a delta relist reads its next page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PageShape {
    /// Metadata only; the new or changed bodies are fetched one by one.
    Metadata,
    /// Full objects: the previous page had too many changes to fetch one by one.
    Full,
}

/// Which wait a [`Stage::Backoff`] is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Delay {
    /// The retry backoff after a failure.
    Retry,
    /// The jitter (and backoff, for relists in a row) before a relist, for `why`.
    Relist(String),
}

/// Whether delta relists may run in this stream (besides the mode and the store's state).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DeltaGate {
    /// They may.
    Open,
    /// The server refused a metadata page or a fetch of the relist in progress: it lists
    /// in full to its end; the next relist tries again.
    ClosedForThisRelist,
    /// The server's resourceVersions are not comparable (KEP-5504): full relists for the
    /// life of the process.
    Closed,
}

/// The one start signal a watcher gives its consumers, whatever phase it starts in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StartSignal {
    /// A store never synced: `Init`, the first list as `InitApply`, then `InitDone`.
    FirstList,
    /// A store synced before: `Resumed` once it is consistent again, that is at once from
    /// a `Synced` checkpoint, or when the interrupted relist, sweep or prune completed.
    Resume,
    /// Given; later changes are `Apply`/`Delete`.
    Given,
}

/// Where the stream is: its stage and what the stages share (in memory: a restarted
/// process starts afresh from its stored phase).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct At {
    pub(crate) stage: Stage,
    /// Streaming lists in use: configured, and the server has not shown it lacks them (or
    /// they kept being cut).
    pub(crate) streaming: bool,
    pub(crate) gate: DeltaGate,
    pub(crate) signal: StartSignal,
    /// `ResourceVersionTooLarge` answers in a row.
    pub(crate) too_large: u32,
    /// Streaming lists cut before their end bookmark, in a row.
    pub(crate) streaming_cuts: u32,
    /// Watch `ERROR` events in a row without an event delivered.
    pub(crate) watch_errors: u32,
    /// The store was synced as of the last outcome.
    pub(crate) synced: bool,
}

impl At {
    /// A stream about to start.
    pub(crate) fn start(rules: &Rules) -> At {
        At {
            stage: Stage::Start,
            streaming: rules.streaming_lists,
            gate: DeltaGate::Open,
            signal: StartSignal::FirstList,
            too_large: 0,
            streaming_cuts: 0,
            watch_errors: 0,
            synced: false,
        }
    }
}

/// The stream's configuration that the transitions read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Rules {
    pub(crate) relist_mode: RelistMode,
    /// A metadata-only store: its objects are the metadata, no delta relist applies.
    pub(crate) metadata_only: bool,
    pub(crate) streaming_lists: bool,
    pub(crate) too_large_retries: u32,
    /// How long a streaming list may send nothing before the server is taken not to
    /// support it, in ms (for the log).
    pub(crate) initial_events_timeout_ms: u128,
}

impl Rules {
    pub(crate) fn of(cfg: &StreamConfig, metadata_only: bool) -> Rules {
        Rules {
            relist_mode: cfg.relist_mode,
            metadata_only,
            streaming_lists: cfg.streaming_lists,
            too_large_retries: cfg.too_large_retries,
            initial_events_timeout_ms: cfg.initial_events_timeout.as_millis(),
        }
    }
}

/// The store as of an outcome: its stored phase and checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Stored {
    pub(crate) phase: Phase,
    /// The store was synced once (it has a checkpoint to resume from).
    pub(crate) ever_synced: bool,
    /// Its last checkpoint is comparable (KEP-5504).
    pub(crate) comparable: bool,
}

impl Stored {
    fn synced(&self) -> bool {
        matches!(self.phase, Phase::Synced { .. })
    }
}

/// What the last effect returned, summarised; with the store as of then.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Outcome {
    pub(crate) returned: Returned,
    pub(crate) store: Stored,
}

/// What an effect returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Returned {
    /// The effect did no I/O.
    Nothing,
    /// The indexes were reconciled: some must be built, or a narrowed shard pruned.
    Prepared { build: bool, prune: bool },
    /// A chunk of a prune or a sweep; `done`: the last one.
    Chunk { done: bool },
    /// A chunk of an index build: the last key indexed, `None` once all are.
    Indexed { after: Option<Vec<u8>> },
    /// A new list's epoch is on disk.
    ListBegun,
    /// A paginated LIST read its page (and submitted its commit); `next_token`: its
    /// continue token, `None` for the last page.
    PageRead { next_token: Option<String> },
    /// A page was committed: `written` new or changed objects and `unchanged` ones.
    Committed { written: u64, unchanged: u64 },
    /// A list's continue token (or its exact resourceVersion) is compacted: `410 Gone`.
    Expired,
    /// A metadata page was listed `at`; `changed` of its `listed` objects differ from the
    /// store (counted only when `comparable`).
    MetadataListed {
        at: String,
        comparable: bool,
        changed: usize,
        listed: usize,
    },
    /// The server refused a delta relist's request (a verb, representation or parameter):
    /// `reason` and `detail` for the log.
    Refused { reason: String, detail: String },
    /// A watch (or streaming list) is connected.
    Connected,
    /// A burst of a streaming list's initial events.
    Initial(InitialBurst),
    /// A burst of live watch events.
    Watch(WatchBurst),
    /// A backoff's wait is over.
    Waited,
    /// The effect failed: `status` classified by [`StatusKind::of`] when the server
    /// answered one; `fatal`: a configuration the server will never accept; `detail`: the
    /// error, for the log.
    Failed {
        status: Option<StatusKind>,
        fatal: bool,
        detail: String,
    },
}

/// A burst of a streaming list's initial events.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct InitialBurst {
    /// No event for the initial-events timeout (nothing committed).
    pub(crate) idle: bool,
    /// The connection broke (nothing committed): the error.
    pub(crate) broke: Option<String>,
    /// The end bookmark came: the list is complete.
    pub(crate) end: bool,
    /// A bookmark without `k8s.io/initial-events-end` came before the end.
    pub(crate) plain_bookmark: bool,
    /// An `ERROR` event.
    pub(crate) status: Option<Status>,
    /// The server ended the stream.
    pub(crate) ended: bool,
    /// Events delivered in this burst.
    pub(crate) delivered: u64,
}

/// A burst of live watch events.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct WatchBurst {
    /// An event could not be read (nothing committed): why.
    pub(crate) lost: Option<String>,
    /// Events and bookmarks delivered.
    pub(crate) delivered: u64,
    /// An `ERROR` event.
    pub(crate) status: Option<Status>,
    /// The server ended the stream.
    pub(crate) ended: bool,
    /// Reading the next burst (while this one committed) failed.
    pub(crate) ahead_failed: bool,
}

/// An `ERROR` event's status: its kind, and `code reason (message)` for the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Status {
    pub(crate) kind: StatusKind,
    pub(crate) detail: String,
}

/// What the driver does next: one action, and the bookkeeping the transition asks for.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Effect {
    pub(crate) action: Action,
    pub(crate) book: Book,
}

/// The I/O a stage asks for.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) enum Action {
    /// Nothing: feed [`Returned::Nothing`] back.
    #[default]
    Nothing,
    /// Reconcile the configured indexes with those on disk; is a prune pending?
    Prepare,
    BuildIndex {
        after: Option<Vec<u8>>,
    },
    Prune,
    /// Begin a list (a new epoch); `init`: the first list of a store never synced gives
    /// `Init` first.
    BeginList {
        init: bool,
    },
    /// A paginated LIST step: take in the commit in flight, and read the page at
    /// `continue_token` unless `read` is false.
    ListPage {
        continue_token: Option<String>,
        read: bool,
    },
    /// A delta relist's metadata page.
    MetadataPage {
        continue_token: Option<String>,
    },
    /// Fetch the new or changed bodies of the metadata page just listed, and commit.
    Fetch,
    /// A page in full: at `continue_token`, or exactly `at`, or a new snapshot.
    FullPage {
        continue_token: Option<String>,
        at: Option<String>,
    },
    ConnectInitial,
    ReadInitial,
    Sweep,
    ConnectWatch,
    ReadWatch,
    Wait(Delay),
    /// The watcher stops (a fatal configuration error).
    Stop,
}

/// The bookkeeping a transition asks of the driver, besides its action.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Book {
    /// Fail this step with the effect's error: count it, the store is no longer live nor
    /// caught up.
    pub(crate) fail: bool,
    /// Push `Init` now (a cold store continues an interrupted first list).
    pub(crate) init: bool,
    /// Give the start signal now.
    pub(crate) announce: Option<StartSignal>,
    /// A list just completed: reset the retry backoff and the list pacing, the catch-up
    /// records the checkpoint.
    pub(crate) list_complete: bool,
    /// A healthy connection: reset the retry backoff.
    pub(crate) reset_backoff: bool,
    /// The watch is (or is no longer) connected.
    pub(crate) live: Option<bool>,
    /// The watch's healthy period starts (if it has not).
    pub(crate) watch_up: bool,
    /// The watch's healthy period ends.
    pub(crate) watch_failed: bool,
    /// A continue token expired: the next list reads bigger pages.
    pub(crate) token_expired: bool,
    /// A delta relist fell back to a full one: count it.
    pub(crate) delta_fallback: bool,
    /// The store resumes from its checkpoint without a list: count it.
    pub(crate) resumed: bool,
}

/// The `Auto` rule, for a page (or the page before) with `changed` of `listed` objects new
/// or changed: above [`RelistMode::AUTO_FULL_PAGE_ABOVE`] of them, the page is listed in
/// full. `Delta` always fetches; `Full` never gets here.
pub(crate) fn page_shape(mode: RelistMode, changed: usize, listed: usize) -> PageShape {
    let limit = RelistMode::AUTO_FULL_PAGE_ABOVE * listed as f64;
    if mode == RelistMode::Auto && changed as f64 > limit {
        PageShape::Full
    } else {
        PageShape::Metadata
    }
}

/// The transition function: where the stream goes from `at` after `outcome`, and what to do
/// there. Pure: no I/O, no clock; its logs are its only side effect.
pub(crate) fn next(mut at: At, outcome: Outcome, rules: &Rules) -> (At, Effect) {
    if at.stage == Stage::Stopped {
        // The end: nothing moves a stopped watcher.
        let effect = Effect {
            action: Action::Stop,
            book: Book::default(),
        };
        return (at, effect);
    }
    let Outcome { returned, store } = outcome;
    let was_synced = std::mem::replace(&mut at.synced, store.synced());
    let stage = std::mem::replace(&mut at.stage, Stage::Stopped);
    let retry = stage.retry_point();
    let mut book = Book::default();
    let decided = match returned {
        Returned::Failed {
            status,
            fatal,
            detail,
        } => on_failure(&mut at, &mut book, &stage, status, fatal, &detail, rules),
        returned => decide(&mut at, &mut book, stage, returned, &store, rules),
    };
    let to = match decided {
        Ok(to) => to,
        Err(Fail { fatal }) => {
            book.fail = true;
            book.live = Some(false);
            at.stage = if fatal {
                Stage::Stopped
            } else {
                Stage::Backoff {
                    delay: Delay::Retry,
                    next: Box::new(retry),
                }
            };
            let action = at.stage.action(at.signal);
            return (at, Effect { action, book });
        }
    };
    if !was_synced && at.synced {
        book.list_complete = true;
        book.reset_backoff = true;
        at.streaming_cuts = 0;
    }
    enter(at, to, book, &store)
}

/// A step that fails with its effect's error (which the driver holds): retried from the
/// stage's retry point after the backoff, or, `fatal`, the end of the watcher.
struct Fail {
    fatal: bool,
}

type Decided = Result<Stage, Fail>;

fn fail(fatal: bool) -> Decided {
    Err(Fail { fatal })
}

/// Move into `to`: the checks on entering it, the start signal, its action.
fn enter(mut at: At, mut to: Stage, mut book: Book, store: &Stored) -> (At, Effect) {
    if matches!(to, Stage::Watching { connected: false }) && !store.synced() {
        // Only a synced store has a checkpoint to watch from.
        to = Stage::Resume;
    }
    if matches!(to, Stage::BeginList { .. })
        && at.gate == DeltaGate::ClosedForThisRelist
        && !matches!(store.phase, Phase::Listing { .. })
    {
        // A new relist (not the retry of one in progress) may try a delta relist again.
        at.gate = DeltaGate::Open;
    }
    if at.signal != StartSignal::Given && store.synced() && !to.preparing() {
        book.announce = Some(at.signal);
        at.signal = StartSignal::Given;
    }
    let action = to.action(at.signal);
    at.stage = to;
    (at, Effect { action, book })
}

/// The stage after `returned` in `stage` (a success).
fn decide(
    at: &mut At,
    book: &mut Book,
    stage: Stage,
    returned: Returned,
    store: &Stored,
    rules: &Rules,
) -> Decided {
    match stage {
        Stage::Listing { .. } | Stage::DeltaListing { .. } | Stage::Fetching { .. } => {
            decide_listing(at, book, stage, returned, store, rules)
        }
        Stage::StreamingInitial { .. } | Stage::Sweeping { .. } | Stage::Watching { .. } => {
            decide_watching(at, book, stage, returned, store, rules)
        }
        Stage::Start
        | Stage::BuildingIndex { .. }
        | Stage::Pruning { .. }
        | Stage::Resume
        | Stage::BeginList { .. }
        | Stage::Backoff { .. }
        | Stage::Stopped => decide_local(at, book, stage, returned, store, rules),
    }
}

/// The stages on the local store: the start, a prune, an index build, a resume from the
/// stored phase, a list's new epoch, a wait.
fn decide_local(
    at: &mut At,
    book: &mut Book,
    stage: Stage,
    returned: Returned,
    store: &Stored,
    rules: &Rules,
) -> Decided {
    Ok(match (stage, returned) {
        (Stage::Start, Returned::Prepared { build, prune }) => {
            started(at, book, store, prune);
            if prune {
                Stage::Pruning { then_build: build }
            } else if build {
                Stage::BuildingIndex { after: None }
            } else {
                Stage::Resume
            }
        }
        (Stage::Pruning { then_build }, Returned::Chunk { done }) => match (done, then_build) {
            (false, _) => Stage::Pruning { then_build },
            (true, true) => Stage::BuildingIndex { after: None },
            (true, false) => {
                tracing::info!("prune complete");
                Stage::Resume
            }
        },
        (Stage::BuildingIndex { .. }, Returned::Indexed { after: Some(after) }) => {
            Stage::BuildingIndex { after: Some(after) }
        }
        (Stage::BuildingIndex { .. }, Returned::Indexed { after: None }) => Stage::Resume,
        (Stage::Resume, Returned::Nothing) => resume(at, store, rules),
        (Stage::BeginList { relist }, Returned::ListBegun) => {
            let list = list_stage(at, store, rules);
            match relist {
                Some(why) => Stage::Backoff {
                    delay: Delay::Relist(why),
                    next: Box::new(list),
                },
                None => list,
            }
        }
        (Stage::Backoff { next, .. }, Returned::Waited) => *next,
        (stage, returned) => unexpected(stage, returned),
    })
}

/// The stages of a paginated LIST and of a delta relist.
fn decide_listing(
    at: &mut At,
    book: &mut Book,
    stage: Stage,
    returned: Returned,
    store: &Stored,
    rules: &Rules,
) -> Decided {
    Ok(match (stage, returned) {
        (Stage::Listing { .. }, Returned::PageRead { next_token }) => Stage::Listing {
            committing: match next_token {
                Some(_) => Committing::Page,
                None => Committing::LastPage,
            },
            continue_token: next_token,
        },
        (Stage::Listing { .. }, Returned::Committed { .. }) => after_list_page(store),
        (Stage::Listing { .. }, Returned::Expired) => {
            book.token_expired = true;
            relist(at, "continue token expired (410)")
        }
        (
            Stage::DeltaListing {
                continue_token,
                shape: PageShape::Metadata,
                ..
            },
            returned,
        ) => match returned {
            Returned::MetadataListed {
                at: listed_at,
                comparable: false,
                ..
            } => {
                // Opaque versions cannot tell a fetched body from an older replayed event.
                tracing::warn!(resource_version = %listed_at,
                    "the server's resourceVersions are not comparable (KEP-5504): full relists for this process");
                at.gate = DeltaGate::Closed;
                full_page(continue_token, Some(listed_at))
            }
            Returned::MetadataListed {
                at: listed_at,
                comparable: true,
                changed,
                listed,
            } => match page_shape(rules.relist_mode, changed, listed) {
                PageShape::Full => {
                    tracing::debug!(
                        changed,
                        items = listed,
                        "too many changed for fetches: the page in full"
                    );
                    full_page(continue_token, Some(listed_at))
                }
                PageShape::Metadata => Stage::Fetching {
                    continue_token,
                    at: listed_at,
                },
            },
            Returned::Refused { reason, detail } => {
                delta_unusable(at, book, "a metadata-only LIST page", &reason, &detail);
                full_page(continue_token, None)
            }
            Returned::Expired => {
                book.token_expired = true;
                relist(at, "continue token expired (410)")
            }
            returned => unexpected(
                Stage::DeltaListing {
                    continue_token,
                    shape: PageShape::Metadata,
                    at: None,
                },
                returned,
            ),
        },
        (
            Stage::DeltaListing {
                shape: PageShape::Full,
                ..
            },
            Returned::Committed { written, unchanged },
        ) => {
            let shape = page_shape(
                rules.relist_mode,
                written as usize,
                (written + unchanged) as usize,
            );
            after_delta_page(at, store, shape)
        }
        (
            Stage::DeltaListing {
                shape: PageShape::Full,
                ..
            },
            Returned::Expired,
        ) => {
            book.token_expired = true;
            relist(at, "continue token or resourceVersion expired (410)")
        }
        (Stage::Fetching { .. }, Returned::Committed { .. }) => {
            after_delta_page(at, store, PageShape::Metadata)
        }
        (
            Stage::Fetching {
                continue_token,
                at: listed_at,
            },
            Returned::Refused { reason, detail },
        ) => {
            delta_unusable(at, book, "a LIST narrowed to one object", &reason, &detail);
            full_page(continue_token, Some(listed_at))
        }
        (stage, returned) => unexpected(stage, returned),
    })
}

/// The stages on a watch connection: a streaming list, the sweep after it, the watch.
fn decide_watching(
    at: &mut At,
    book: &mut Book,
    stage: Stage,
    returned: Returned,
    store: &Stored,
    rules: &Rules,
) -> Decided {
    Ok(match (stage, returned) {
        (
            Stage::StreamingInitial {
                connected: false, ..
            },
            Returned::Connected,
        ) => Stage::StreamingInitial {
            connected: true,
            received: 0,
        },
        (
            Stage::StreamingInitial {
                connected: true,
                received,
            },
            Returned::Initial(burst),
        ) => return initial_burst(at, book, received, burst, store, rules),
        (Stage::Sweeping { then_connected }, Returned::Chunk { done: false }) => {
            Stage::Sweeping { then_connected }
        }
        (Stage::Sweeping { then_connected }, Returned::Chunk { done: true }) => Stage::Watching {
            connected: then_connected,
        },
        (Stage::Watching { connected: false }, Returned::Connected) => {
            book.live = Some(true);
            book.watch_up = true;
            Stage::Watching { connected: true }
        }
        (Stage::Watching { connected: true }, Returned::Watch(burst)) => {
            return watch_burst(at, book, burst, rules);
        }
        (stage, returned) => unexpected(stage, returned),
    })
}

/// An outcome the stage's action cannot return (a defect of the driver): logged, and the
/// stream resumes from the stored phase, which is always safe. The transition table's tests
/// enumerate these pairs.
fn unexpected(stage: Stage, returned: Returned) -> Stage {
    tracing::error!(stage = stage.name(), outcome = ?returned,
        "the watcher got an outcome its stage does not expect; resuming from the stored phase");
    Stage::Resume
}

/// The stage after a failed effect (with an error the driver holds).
fn on_failure(
    at: &mut At,
    book: &mut Book,
    stage: &Stage,
    status: Option<StatusKind>,
    fatal: bool,
    detail: &str,
    rules: &Rules,
) -> Decided {
    match (stage, status) {
        (
            Stage::StreamingInitial {
                connected: false, ..
            },
            Some(StatusKind::Gone),
        ) => Ok(relist(at, "streaming list answered 410")),
        (
            Stage::StreamingInitial {
                connected: false, ..
            },
            Some(StatusKind::Invalid),
        ) => Ok(fall_back(at, &format!("the server refused it: {detail}"))),
        (Stage::Watching { connected: false }, Some(StatusKind::Gone)) => {
            Ok(relist(at, "watch resourceVersion expired (410)"))
        }
        (Stage::Watching { connected }, status) => {
            let next = match status {
                Some(StatusKind::TooLarge) if !connected => too_large(at, rules),
                _ => fail(fatal),
            };
            if next.is_err() {
                // A watch that fails (could not connect, broke) ends its healthy period.
                book.watch_failed = true;
            }
            next
        }
        _ => fail(fatal),
    }
}

/// Log how the stream starts from its stored phase; a cold store continuing its
/// interrupted first list gives `Init` now.
fn started(at: &mut At, book: &mut Book, store: &Stored, prune: bool) {
    at.signal = if store.ever_synced {
        StartSignal::Resume
    } else {
        StartSignal::FirstList
    };
    match &store.phase {
        Phase::Synced { resource_version } => {
            book.resumed = true;
            tracing::info!(resource_version = %resource_version, prune,
                "resuming from checkpoint without a paginated LIST");
        }
        Phase::Listing {
            continue_token: Some(_),
            ..
        } if !at.streaming => {
            tracing::info!("continuing an interrupted list");
            book.init = at.signal == StartSignal::FirstList;
        }
        Phase::Sweeping { .. } => tracing::info!("continuing an interrupted sweep"),
        Phase::Listing { .. } if at.signal != StartSignal::FirstList => {
            tracing::info!("an interrupted relist starts again; resumed at its end")
        }
        Phase::Empty | Phase::Listing { .. } => {}
    }
}

/// The next stage from the stored phase alone. Only a paginated list with a continue
/// token can be continued (a delta relist's even where lists stream). A streaming list
/// cannot, and a list without a token may hold objects of an interrupted streaming attempt
/// in this epoch: every such attempt is a new list.
fn resume(at: &At, store: &Stored, rules: &Rules) -> Stage {
    let delta = delta_relist(at, store, rules);
    match &store.phase {
        Phase::Listing {
            continue_token: Some(token),
            ..
        } if delta => Stage::DeltaListing {
            continue_token: Some(token.clone()),
            shape: PageShape::Metadata,
            at: None,
        },
        Phase::Listing {
            continue_token: Some(token),
            ..
        } if !at.streaming => Stage::Listing {
            continue_token: Some(token.clone()),
            committing: Committing::Nothing,
        },
        Phase::Empty | Phase::Listing { .. } => Stage::BeginList { relist: None },
        Phase::Sweeping { .. } => Stage::Sweeping {
            then_connected: false,
        },
        Phase::Synced { .. } => Stage::Watching { connected: false },
    }
}

/// Whether the list in progress (or just begun) is a delta relist: the mode allows it, the
/// stream lists full objects, the store held objects when it began, the server has not
/// refused it, and the store's checkpoint is comparable (KEP-5504).
fn delta_relist(at: &At, store: &Stored, rules: &Rules) -> bool {
    rules.relist_mode != RelistMode::Full
        && !rules.metadata_only
        && at.gate == DeltaGate::Open
        && matches!(store.phase, Phase::Listing { sweep: true, .. })
        && store.comparable
}

/// The first stage of a list just begun.
fn list_stage(at: &At, store: &Stored, rules: &Rules) -> Stage {
    if delta_relist(at, store, rules) {
        tracing::info!(mode = ?rules.relist_mode,
            "delta relist: metadata pages, bodies of the new or changed objects only");
        Stage::DeltaListing {
            continue_token: None,
            shape: PageShape::Metadata,
            at: None,
        }
    } else if at.streaming {
        Stage::StreamingInitial {
            connected: false,
            received: 0,
        }
    } else {
        Stage::Listing {
            continue_token: None,
            committing: Committing::Nothing,
        }
    }
}

/// The server said our version is gone: list again (a new epoch), after the relist delay:
/// a random jitter so that clients relisting after an API server restart spread out, and a
/// backoff for relists in a row (see `Pacing`).
fn relist(at: &mut At, why: &str) -> Stage {
    at.too_large = 0;
    Stage::BeginList {
        relist: Some(why.to_string()),
    }
}

/// The server does not stream lists: paginated LISTs from now on.
fn fall_back(at: &mut At, why: &str) -> Stage {
    tracing::warn!(
        reason = why,
        "streaming lists (sendInitialEvents) unusable with this API server; falling back to paginated LIST for this process"
    );
    at.streaming = false;
    Stage::BeginList { relist: None }
}

/// A streaming list was cut (or failed) before its end bookmark: a failure (the retry
/// waits a backoff and lists again in a new epoch); after a few in a row, fall back to
/// paginated LISTs, as client-go's reflector does when a watch-list fails.
fn streaming_cut(at: &mut At, last: &str) -> Decided {
    at.streaming_cuts += 1;
    if at.streaming_cuts >= STREAMING_CUTS_BEFORE_FALLBACK {
        let why = format!(
            "{} streaming lists in a row cut before their end bookmark (last: {last})",
            at.streaming_cuts
        );
        return Ok(fall_back(at, &why));
    }
    fail(false)
}

/// A `ResourceVersionTooLarge` answer (HTTP 504 on connect, or an `ERROR` event): a lagging
/// replica; retry with backoff, and relist once the retries are spent.
fn too_large(at: &mut At, rules: &Rules) -> Decided {
    at.too_large += 1;
    if at.too_large > rules.too_large_retries {
        return Ok(relist(at, "resourceVersion too large, retries exhausted"));
    }
    fail(false)
}

/// A delta relist's page in full, at `continue_token` or exactly `at`.
fn full_page(continue_token: Option<String>, at: Option<String>) -> Stage {
    Stage::DeltaListing {
        continue_token,
        shape: PageShape::Full,
        at,
    }
}

/// The server refused a delta relist's request: warn (naming what it refused), count it,
/// and list the rest of this relist in full.
fn delta_unusable(at: &mut At, book: &mut Book, what: &str, reason: &str, detail: &str) {
    book.delta_fallback = true;
    tracing::warn!(
        refused = what,
        reason,
        detail,
        "a delta relist cannot run here: this relist lists in full from this page on (grant the store `list` on its kind, or choose RelistMode::Full)"
    );
    at.gate = DeltaGate::ClosedForThisRelist;
}

/// The stage after a paginated LIST's last commit, from the stored phase.
fn after_list_page(store: &Stored) -> Stage {
    match &store.phase {
        Phase::Listing { continue_token, .. } => Stage::Listing {
            continue_token: continue_token.clone(),
            committing: Committing::Nothing,
        },
        Phase::Sweeping { .. } => Stage::Sweeping {
            then_connected: false,
        },
        Phase::Empty | Phase::Synced { .. } => Stage::Watching { connected: false },
    }
}

/// The stage after a committed page of a delta relist, from the stored phase.
fn after_delta_page(at: &At, store: &Stored, shape: PageShape) -> Stage {
    match &store.phase {
        Phase::Listing { continue_token, .. } if at.gate != DeltaGate::Open => Stage::Listing {
            continue_token: continue_token.clone(),
            committing: Committing::Nothing,
        },
        Phase::Listing { continue_token, .. } => Stage::DeltaListing {
            continue_token: continue_token.clone(),
            shape,
            at: None,
        },
        Phase::Sweeping { .. } => Stage::Sweeping {
            then_connected: false,
        },
        Phase::Empty | Phase::Synced { .. } => Stage::Watching { connected: false },
    }
}

/// The stage after a burst of a streaming list's initial events.
fn initial_burst(
    at: &mut At,
    book: &mut Book,
    received: u64,
    burst: InitialBurst,
    store: &Stored,
    rules: &Rules,
) -> Decided {
    if let Some(e) = &burst.broke {
        return streaming_cut(at, e);
    }
    if burst.idle {
        let why = format!(
            "no initial-events-end bookmark and no event for {} ms",
            rules.initial_events_timeout_ms
        );
        return Ok(fall_back(at, &why));
    }
    let received = received + burst.delivered;
    if burst.end {
        book.live = Some(true);
        book.watch_up = true;
        return Ok(match store.phase {
            Phase::Sweeping { .. } => Stage::Sweeping {
                then_connected: true,
            },
            _ => Stage::Watching { connected: true },
        });
    }
    if burst.plain_bookmark {
        return Ok(fall_back(
            at,
            "a bookmark without k8s.io/initial-events-end came before the end of the initial events",
        ));
    }
    if let Some(status) = &burst.status {
        return match status.kind {
            StatusKind::Gone => Ok(relist(at, "streaming list ERROR 410")),
            StatusKind::TooLarge => too_large(at, rules),
            // kube-apiserver refuses a watch-list it cannot serve (e.g. its storage lacks
            // the progress notifications the list needs) with an ERROR event.
            _ if received == 0 => Ok(fall_back(at, &format!("ERROR event {}", status.detail))),
            _ => fail(false),
        };
    }
    if burst.ended {
        // The retry (after a backoff) starts a new list: a new epoch, a sweep at its end.
        let why =
            format!("the stream ended after {received} initial events, before the end bookmark");
        return streaming_cut(at, &why);
    }
    Ok(Stage::StreamingInitial {
        connected: true,
        received,
    })
}

/// The stage after a burst of live watch events (committed unless an event was lost).
fn watch_burst(at: &mut At, book: &mut Book, burst: WatchBurst, rules: &Rules) -> Decided {
    if let Some(why) = &burst.lost {
        // Nothing of this burst is committed: the checkpoint stays before the lost event.
        return Ok(relist(
            at,
            &format!("a watch event could not be read ({why})"),
        ));
    }
    if burst.delivered > 0 {
        // A healthy connection: later errors start their backoff from the minimum.
        book.reset_backoff = true;
        at.too_large = 0;
        at.watch_errors = 0;
    }
    if let Some(status) = &burst.status {
        let next = match status.kind {
            StatusKind::Gone => return Ok(relist(at, "watch ERROR 410 Gone")),
            StatusKind::TooLarge => too_large(at, rules),
            _ => {
                at.watch_errors += 1;
                if at.watch_errors >= WATCH_ERRORS_BEFORE_RELIST {
                    at.watch_errors = 0;
                    let why = format!(
                        "watch ERROR {} {WATCH_ERRORS_BEFORE_RELIST} times in a row from the same checkpoint",
                        status.detail
                    );
                    return Ok(relist(at, &why));
                }
                fail(false)
            }
        };
        book.watch_failed = next.is_err();
        return next;
    }
    if burst.ended {
        book.live = Some(false);
        return Ok(Stage::Watching { connected: false });
    }
    if burst.ahead_failed {
        book.watch_failed = true;
        return fail(false);
    }
    Ok(Stage::Watching { connected: true })
}

impl Stage {
    /// Where to go after an error in this stage.
    pub(crate) fn retry_point(&self) -> Stage {
        match self {
            Stage::Start | Stage::BuildingIndex { .. } | Stage::Pruning { .. } => self.clone(),
            _ => Stage::Resume,
        }
    }

    /// The stage's name, in the watcher's span and the diagram of docs/design.md.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Stage::Start => "start",
            Stage::BuildingIndex { .. } => "building-index",
            Stage::Pruning { .. } => "pruning",
            Stage::Resume => "resume",
            Stage::BeginList { .. } => "begin-list",
            Stage::Listing { .. } => "listing",
            Stage::DeltaListing { .. } => "delta-listing",
            Stage::Fetching { .. } => "fetching",
            Stage::StreamingInitial { .. } => "streaming-initial",
            Stage::Sweeping { .. } => "sweeping",
            Stage::Watching { .. } => "watching",
            Stage::Backoff { .. } => "backoff",
            Stage::Stopped => "stopped",
        }
    }

    /// Still preparing the store (indexes, a prune) before it serves a consistent view.
    pub(crate) fn preparing(&self) -> bool {
        match self {
            Stage::Start | Stage::BuildingIndex { .. } | Stage::Pruning { .. } => true,
            Stage::Backoff { next, .. } => next.preparing(),
            _ => false,
        }
    }

    /// Whether the driver holds a watch connection for this stage.
    pub(crate) fn connected(&self) -> bool {
        matches!(
            self,
            Stage::StreamingInitial {
                connected: true,
                ..
            } | Stage::Sweeping {
                then_connected: true
            } | Stage::Watching { connected: true }
        )
    }

    /// The action this stage asks for.
    fn action(&self, signal: StartSignal) -> Action {
        match self {
            Stage::Start => Action::Prepare,
            Stage::BuildingIndex { after } => Action::BuildIndex {
                after: after.clone(),
            },
            Stage::Pruning { .. } => Action::Prune,
            Stage::Resume => Action::Nothing,
            Stage::BeginList { .. } => Action::BeginList {
                init: signal == StartSignal::FirstList,
            },
            Stage::Listing {
                continue_token,
                committing,
            } => Action::ListPage {
                continue_token: continue_token.clone(),
                read: *committing != Committing::LastPage,
            },
            Stage::DeltaListing {
                continue_token,
                shape: PageShape::Metadata,
                ..
            } => Action::MetadataPage {
                continue_token: continue_token.clone(),
            },
            Stage::DeltaListing {
                continue_token,
                shape: PageShape::Full,
                at,
            } => Action::FullPage {
                continue_token: continue_token.clone(),
                at: at.clone(),
            },
            Stage::Fetching { .. } => Action::Fetch,
            Stage::StreamingInitial {
                connected: false, ..
            } => Action::ConnectInitial,
            Stage::StreamingInitial {
                connected: true, ..
            } => Action::ReadInitial,
            Stage::Sweeping { .. } => Action::Sweep,
            Stage::Watching { connected: false } => Action::ConnectWatch,
            Stage::Watching { connected: true } => Action::ReadWatch,
            Stage::Backoff { delay, .. } => Action::Wait(delay.clone()),
            Stage::Stopped => Action::Stop,
        }
    }
}

#[cfg(test)]
mod tests;
