//! The transition table: every (stage, outcome class) pair with its expected next stage,
//! action and bookkeeping (`Book`), without HTTP; and the diagram of docs/design.md checked
//! against the function.
//!
//! Longer than 600 lines: the table itself (one row a line, with its bookkeeping and, where
//! the configuration decides, the configuration it runs under), the enumeration of every
//! stage and outcome class, and the exploration that the diagram is checked against, which
//! read best beside each other.

use std::collections::BTreeSet;

use super::*;

fn rules() -> Rules {
    Rules {
        relist_mode: RelistMode::Auto,
        metadata_only: false,
        streaming_lists: false,
        too_large_retries: 2,
        initial_events_timeout_ms: 30_000,
    }
}

fn listing(token: Option<&str>) -> Phase {
    Phase::Listing {
        continue_token: token.map(str::to_string),
        sweep: true,
    }
}

fn synced() -> Phase {
    Phase::Synced {
        resource_version: "9".into(),
    }
}

fn sweeping() -> Phase {
    Phase::Sweeping {
        resource_version: "9".into(),
        after: None,
    }
}

fn store(phase: Phase) -> Stored {
    Stored {
        phase,
        ever_synced: true,
        comparable: true,
    }
}

/// A stream past its start, in `stage`.
fn at(stage: Stage) -> At {
    let mut at = At::start(&rules());
    at.stage = stage;
    at.signal = StartSignal::Given;
    at.synced = true;
    at
}

fn go(from: At, returned: Returned, phase: Phase) -> (At, Effect) {
    next(
        from,
        Outcome {
            returned,
            store: store(phase),
        },
        &rules(),
    )
}

fn failed(status: Option<StatusKind>) -> Returned {
    Returned::Failed {
        status,
        fatal: false,
        detail: "boom".into(),
    }
}

fn delta(token: Option<&str>, shape: PageShape, at: Option<&str>) -> Stage {
    Stage::DeltaListing {
        continue_token: token.map(str::to_string),
        shape,
        at: at.map(str::to_string),
    }
}

fn paginated(token: Option<&str>, committing: Committing) -> Stage {
    Stage::Listing {
        continue_token: token.map(str::to_string),
        committing,
    }
}

fn relisting(why: &str) -> Stage {
    Stage::BeginList {
        relist: Some(why.into()),
    }
}

fn retry(next: Stage) -> Stage {
    Stage::Backoff {
        delay: Delay::Retry,
        next: Box::new(next),
    }
}

fn watching(connected: bool) -> Stage {
    Stage::Watching { connected }
}

fn initial(connected: bool, received: u64) -> Stage {
    Stage::StreamingInitial {
        connected,
        received,
    }
}

/// What a row's stream is configured as, and what it learnt of the server before: the
/// rules, whether it streams lists, and its delta gate.
#[derive(Debug, Clone)]
struct Config {
    rules: Rules,
    streaming: bool,
    gate: DeltaGate,
}

impl Config {
    /// [`rules`]: `Auto`, paginated lists, the gate open.
    fn base() -> Config {
        Config {
            rules: rules(),
            streaming: false,
            gate: DeltaGate::Open,
        }
    }

    fn mode(mut self, mode: RelistMode) -> Config {
        self.rules.relist_mode = mode;
        self
    }

    fn metadata_only(mut self) -> Config {
        self.rules.metadata_only = true;
        self
    }

    fn streaming(mut self) -> Config {
        self.rules.streaming_lists = true;
        self.streaming = true;
        self
    }

    fn gate(mut self, gate: DeltaGate) -> Config {
        self.gate = gate;
        self
    }
}

/// One row: from `stage` (stored `phase`), on `returned`, to `to` asking for `action`, with
/// the bookkeeping `book` (none unless the row says), under `config` ([`Config::base`]
/// unless the row says).
struct Row {
    stage: Stage,
    phase: Phase,
    returned: Returned,
    to: Stage,
    action: Action,
    book: Book,
    config: Config,
}

fn row(stage: Stage, phase: Phase, returned: Returned, to: Stage, action: Action) -> Row {
    Row {
        stage,
        phase,
        returned,
        to,
        action,
        book: Book::default(),
        config: Config::base(),
    }
}

impl Row {
    fn book(mut self, book: Book) -> Row {
        self.book = book;
        self
    }

    fn under(mut self, config: Config) -> Row {
        self.config = config;
        self
    }

    /// The stream of this row, past its start, in its stage.
    fn at(&self) -> At {
        let mut from = at(self.stage.clone());
        from.streaming = self.config.streaming;
        from.gate = self.config.gate;
        from
    }
}

/// The table: each stage with each outcome its action can return.
#[rustfmt::skip]
fn table() -> Vec<Row> {
    use Action as A;
    use Returned as R;
    let some = |s: &str| Some(s.to_string());
    let prepared = |build, prune| R::Prepared { build, prune };
    let committed = |written, unchanged| R::Committed { written, unchanged };
    let meta = |comparable, changed, listed| R::MetadataListed {
        at: "41".into(),
        comparable,
        changed,
        listed,
    };
    let refused = || R::Refused {
        reason: "the `list` verb is refused (401/403)".into(),
        detail: "403".into(),
    };
    let burst = |b: InitialBurst| R::Initial(b);
    let status = |kind| {
        Some(Status {
            kind,
            detail: "500 InternalError: x".into(),
        })
    };
    let live = |b: WatchBurst| R::Watch(b);
    let begin = Stage::BeginList { relist: None };
    use Book as B;
    let failing = || B { fail: true, live: Some(false), ..B::default() };
    let failing_watch = || B { watch_failed: true, ..failing() };
    let up = || B { live: Some(true), watch_up: true, ..B::default() };
    let expired = || B { token_expired: true, ..B::default() };
    let fallback = || B { delta_fallback: true, ..B::default() };
    let resumed = || B { resumed: true, ..B::default() };
    let resumed_announced = || B { announce: Some(StartSignal::Resume), ..resumed() };
    let full = || Config::base().mode(RelistMode::Full);
    let delta_mode = || Config::base().mode(RelistMode::Delta);
    let closed = || Config::base().gate(DeltaGate::ClosedForThisRelist);
    vec![
        // Start and the store's own preparation.
        row(Stage::Start, synced(), prepared(false, false), Stage::Resume, A::Nothing).book(resumed_announced()),
        row(Stage::Start, synced(), prepared(true, false), Stage::BuildingIndex { after: None }, A::BuildIndex { after: None }).book(resumed()),
        row(Stage::Start, synced(), prepared(true, true), Stage::Pruning { then_build: true }, A::Prune).book(resumed()),
        row(Stage::Start, synced(), failed(None), retry(Stage::Start), A::Wait(Delay::Retry)).book(failing()),
        row(Stage::Pruning { then_build: false }, synced(), R::Chunk { done: false }, Stage::Pruning { then_build: false }, A::Prune),
        row(Stage::Pruning { then_build: true }, synced(), R::Chunk { done: true }, Stage::BuildingIndex { after: None }, A::BuildIndex { after: None }),
        row(Stage::Pruning { then_build: false }, synced(), R::Chunk { done: true }, Stage::Resume, A::Nothing),
        row(Stage::Pruning { then_build: false }, synced(), failed(None), retry(Stage::Pruning { then_build: false }), A::Wait(Delay::Retry)).book(failing()),
        row(Stage::BuildingIndex { after: None }, synced(), R::Indexed { after: Some(b"k".to_vec()) }, Stage::BuildingIndex { after: Some(b"k".to_vec()) }, A::BuildIndex { after: Some(b"k".to_vec()) }),
        row(Stage::BuildingIndex { after: None }, synced(), R::Indexed { after: None }, Stage::Resume, A::Nothing),
        row(Stage::BuildingIndex { after: None }, synced(), failed(None), retry(Stage::BuildingIndex { after: None }), A::Wait(Delay::Retry)).book(failing()),
        // Resume: from the stored phase alone.
        row(Stage::Resume, Phase::Empty, R::Nothing, begin.clone(), A::BeginList { init: false }),
        row(Stage::Resume, listing(None), R::Nothing, begin.clone(), A::BeginList { init: false }),
        row(Stage::Resume, listing(Some("t")), R::Nothing, delta(Some("t"), PageShape::Metadata, None), A::MetadataPage { continue_token: some("t") }),
        row(Stage::Resume, sweeping(), R::Nothing, Stage::Sweeping { then_connected: false }, A::Sweep),
        row(Stage::Resume, synced(), R::Nothing, watching(false), A::ConnectWatch),
        // An interrupted list continues by delta only where a delta relist applies, even
        // where lists stream; else paginated, or, where lists stream, a new list.
        row(Stage::Resume, listing(Some("t")), R::Nothing, delta(Some("t"), PageShape::Metadata, None), A::MetadataPage { continue_token: some("t") }).under(delta_mode()),
        row(Stage::Resume, listing(Some("t")), R::Nothing, delta(Some("t"), PageShape::Metadata, None), A::MetadataPage { continue_token: some("t") }).under(Config::base().streaming()),
        row(Stage::Resume, listing(Some("t")), R::Nothing, paginated(Some("t"), Committing::Nothing), A::ListPage { continue_token: some("t"), read: true }).under(full()),
        row(Stage::Resume, listing(Some("t")), R::Nothing, paginated(Some("t"), Committing::Nothing), A::ListPage { continue_token: some("t"), read: true }).under(closed()),
        row(Stage::Resume, listing(Some("t")), R::Nothing, paginated(Some("t"), Committing::Nothing), A::ListPage { continue_token: some("t"), read: true }).under(Config::base().metadata_only()),
        row(Stage::Resume, listing(Some("t")), R::Nothing, paginated(Some("t"), Committing::Nothing), A::ListPage { continue_token: some("t"), read: true }).under(Config::base().gate(DeltaGate::Closed)),
        row(Stage::Resume, listing(Some("t")), R::Nothing, begin.clone(), A::BeginList { init: false }).under(full().streaming()),
        row(Stage::Resume, listing(None), R::Nothing, begin.clone(), A::BeginList { init: false }).under(full()),
        // A list's new epoch: a delta relist where it applies.
        row(begin.clone(), listing(None), R::ListBegun, delta(None, PageShape::Metadata, None), A::MetadataPage { continue_token: None }),
        row(relisting("410"), listing(None), R::ListBegun, Stage::Backoff { delay: Delay::Relist("410".into()), next: Box::new(delta(None, PageShape::Metadata, None)) }, A::Wait(Delay::Relist("410".into()))),
        row(begin.clone(), synced(), failed(None), retry(Stage::Resume), A::Wait(Delay::Retry)).book(failing()),
        row(begin.clone(), listing(None), R::ListBegun, paginated(None, Committing::Nothing), A::ListPage { continue_token: None, read: true }).under(full()),
        row(begin.clone(), listing(None), R::ListBegun, paginated(None, Committing::Nothing), A::ListPage { continue_token: None, read: true }).under(closed()),
        row(begin.clone(), listing(None), R::ListBegun, initial(false, 0), A::ConnectInitial).under(full().streaming()),
        row(begin.clone(), listing(None), R::ListBegun, delta(None, PageShape::Metadata, None), A::MetadataPage { continue_token: None }).under(Config::base().streaming()),
        // A paginated LIST.
        row(paginated(None, Committing::Nothing), listing(None), R::PageRead { next_token: some("t") }, paginated(Some("t"), Committing::Page), A::ListPage { continue_token: some("t"), read: true }),
        row(paginated(Some("t"), Committing::Page), listing(Some("t")), R::PageRead { next_token: None }, paginated(None, Committing::LastPage), A::ListPage { continue_token: None, read: false }),
        row(paginated(None, Committing::LastPage), sweeping(), committed(0, 0), Stage::Sweeping { then_connected: false }, A::Sweep),
        row(paginated(None, Committing::LastPage), synced(), committed(0, 0), watching(false), A::ConnectWatch),
        row(paginated(Some("t"), Committing::Page), listing(Some("t")), R::Expired, relisting("continue token expired (410)"), A::BeginList { init: false }).book(expired()),
        row(paginated(Some("t"), Committing::Page), listing(Some("t")), failed(Some(StatusKind::Other)), retry(Stage::Resume), A::Wait(Delay::Retry)).book(failing()),
        // A delta relist's metadata page.
        row(delta(None, PageShape::Metadata, None), listing(None), meta(true, 0, 100), Stage::Fetching { continue_token: None, at: "41".into() }, A::Fetch),
        row(delta(None, PageShape::Metadata, None), listing(None), meta(true, 7, 100), delta(None, PageShape::Full, Some("41")), A::FullPage { continue_token: None, at: some("41") }),
        row(delta(None, PageShape::Metadata, None), listing(None), meta(false, 0, 100), delta(None, PageShape::Full, Some("41")), A::FullPage { continue_token: None, at: some("41") }),
        row(delta(Some("t"), PageShape::Metadata, None), listing(Some("t")), refused(), delta(Some("t"), PageShape::Full, None), A::FullPage { continue_token: some("t"), at: None }).book(fallback()),
        row(delta(Some("t"), PageShape::Metadata, None), listing(Some("t")), R::Expired, relisting("continue token expired (410)"), A::BeginList { init: false }).book(expired()),
        row(delta(None, PageShape::Metadata, None), listing(None), failed(Some(StatusKind::Other)), retry(Stage::Resume), A::Wait(Delay::Retry)).book(failing()),
        // Its fetches.
        row(Stage::Fetching { continue_token: None, at: "41".into() }, listing(Some("u")), committed(1, 99), delta(Some("u"), PageShape::Metadata, None), A::MetadataPage { continue_token: some("u") }),
        row(Stage::Fetching { continue_token: None, at: "41".into() }, sweeping(), committed(1, 99), Stage::Sweeping { then_connected: false }, A::Sweep),
        row(Stage::Fetching { continue_token: None, at: "41".into() }, listing(None), refused(), delta(None, PageShape::Full, Some("41")), A::FullPage { continue_token: None, at: some("41") }).book(fallback()),
        row(Stage::Fetching { continue_token: None, at: "41".into() }, listing(None), failed(Some(StatusKind::Other)), retry(Stage::Resume), A::Wait(Delay::Retry)).book(failing()),
        // Its pages in full: the next page's shape from this one's changes.
        row(delta(None, PageShape::Full, Some("41")), listing(Some("u")), committed(50, 50), delta(Some("u"), PageShape::Full, None), A::FullPage { continue_token: some("u"), at: None }),
        row(delta(None, PageShape::Full, Some("41")), listing(Some("u")), committed(1, 99), delta(Some("u"), PageShape::Metadata, None), A::MetadataPage { continue_token: some("u") }),
        row(delta(None, PageShape::Full, Some("41")), synced(), committed(1, 99), watching(false), A::ConnectWatch),
        row(delta(None, PageShape::Full, Some("41")), listing(None), R::Expired, relisting("continue token or resourceVersion expired (410)"), A::BeginList { init: false }).book(expired()),
        row(delta(None, PageShape::Full, None), listing(None), failed(None), retry(Stage::Resume), A::Wait(Delay::Retry)).book(failing()),
        // A streaming list's connect.
        row(initial(false, 0), listing(None), R::Connected, initial(true, 0), A::ReadInitial),
        row(initial(false, 0), listing(None), failed(Some(StatusKind::Gone)), relisting("streaming list answered 410"), A::BeginList { init: false }),
        row(initial(false, 0), listing(None), failed(Some(StatusKind::Invalid)), begin.clone(), A::BeginList { init: false }),
        row(initial(false, 0), listing(None), failed(Some(StatusKind::Refused)), retry(Stage::Resume), A::Wait(Delay::Retry)).book(failing()),
        row(initial(false, 0), listing(None), failed(Some(StatusKind::TooLarge)), retry(Stage::Resume), A::Wait(Delay::Retry)).book(failing()),
        row(initial(false, 0), listing(None), failed(Some(StatusKind::Other)), retry(Stage::Resume), A::Wait(Delay::Retry)).book(failing()),
        row(initial(false, 0), listing(None), failed(None), retry(Stage::Resume), A::Wait(Delay::Retry)).book(failing()),
        // Its bursts.
        row(initial(true, 0), listing(None), burst(InitialBurst { delivered: 3, ..Default::default() }), initial(true, 3), A::ReadInitial),
        row(initial(true, 3), sweeping(), burst(InitialBurst { end: true, ..Default::default() }), Stage::Sweeping { then_connected: true }, A::Sweep).book(up()),
        row(initial(true, 3), synced(), burst(InitialBurst { end: true, ..Default::default() }), watching(true), A::ReadWatch).book(up()),
        row(initial(true, 3), listing(None), burst(InitialBurst { idle: true, ..Default::default() }), begin.clone(), A::BeginList { init: false }),
        row(initial(true, 3), listing(None), burst(InitialBurst { plain_bookmark: true, ..Default::default() }), begin.clone(), A::BeginList { init: false }),
        row(initial(true, 3), listing(None), burst(InitialBurst { broke: some("reset"), ..Default::default() }), retry(Stage::Resume), A::Wait(Delay::Retry)).book(failing()),
        row(initial(true, 3), listing(None), burst(InitialBurst { ended: true, ..Default::default() }), retry(Stage::Resume), A::Wait(Delay::Retry)).book(failing()),
        row(initial(true, 0), listing(None), burst(InitialBurst { status: status(StatusKind::Other), ..Default::default() }), begin.clone(), A::BeginList { init: false }),
        row(initial(true, 3), listing(None), burst(InitialBurst { status: status(StatusKind::Other), ..Default::default() }), retry(Stage::Resume), A::Wait(Delay::Retry)).book(failing()),
        row(initial(true, 3), listing(None), burst(InitialBurst { status: status(StatusKind::Gone), ..Default::default() }), relisting("streaming list ERROR 410"), A::BeginList { init: false }),
        row(initial(true, 3), listing(None), burst(InitialBurst { status: status(StatusKind::TooLarge), ..Default::default() }), retry(Stage::Resume), A::Wait(Delay::Retry)).book(failing()),
        row(initial(true, 3), listing(None), failed(None), retry(Stage::Resume), A::Wait(Delay::Retry)).book(failing()),
        // The sweep.
        row(Stage::Sweeping { then_connected: false }, sweeping(), R::Chunk { done: false }, Stage::Sweeping { then_connected: false }, A::Sweep),
        row(Stage::Sweeping { then_connected: false }, synced(), R::Chunk { done: true }, watching(false), A::ConnectWatch),
        row(Stage::Sweeping { then_connected: true }, synced(), R::Chunk { done: true }, watching(true), A::ReadWatch),
        row(Stage::Sweeping { then_connected: true }, sweeping(), failed(None), retry(Stage::Resume), A::Wait(Delay::Retry)).book(failing()),
        // The watch's connect.
        row(watching(false), synced(), R::Connected, watching(true), A::ReadWatch).book(up()),
        row(watching(false), synced(), failed(Some(StatusKind::Gone)), relisting("watch resourceVersion expired (410)"), A::BeginList { init: false }),
        row(watching(false), synced(), failed(Some(StatusKind::TooLarge)), retry(Stage::Resume), A::Wait(Delay::Retry)).book(failing_watch()),
        row(watching(false), synced(), failed(Some(StatusKind::Refused)), retry(Stage::Resume), A::Wait(Delay::Retry)).book(failing_watch()),
        row(watching(false), synced(), failed(Some(StatusKind::Invalid)), retry(Stage::Resume), A::Wait(Delay::Retry)).book(failing_watch()),
        row(watching(false), synced(), failed(Some(StatusKind::Other)), retry(Stage::Resume), A::Wait(Delay::Retry)).book(failing_watch()),
        row(watching(false), synced(), failed(None), retry(Stage::Resume), A::Wait(Delay::Retry)).book(failing_watch()),
        // Its bursts.
        row(watching(true), synced(), live(WatchBurst { delivered: 2, ..Default::default() }), watching(true), A::ReadWatch).book(B { reset_backoff: true, ..B::default() }),
        row(watching(true), synced(), live(WatchBurst { ended: true, ..Default::default() }), watching(false), A::ConnectWatch).book(B { live: Some(false), ..B::default() }),
        row(watching(true), synced(), live(WatchBurst { lost: some("bad line"), ..Default::default() }), relisting("a watch event could not be read (bad line)"), A::BeginList { init: false }),
        row(watching(true), synced(), live(WatchBurst { status: status(StatusKind::Gone), ..Default::default() }), relisting("watch ERROR 410 Gone"), A::BeginList { init: false }),
        row(watching(true), synced(), live(WatchBurst { status: status(StatusKind::TooLarge), ..Default::default() }), retry(Stage::Resume), A::Wait(Delay::Retry)).book(failing_watch()),
        row(watching(true), synced(), live(WatchBurst { status: status(StatusKind::Other), ..Default::default() }), retry(Stage::Resume), A::Wait(Delay::Retry)).book(failing_watch()),
        row(watching(true), synced(), live(WatchBurst { ahead_failed: true, delivered: 1, ..Default::default() }), retry(Stage::Resume), A::Wait(Delay::Retry)).book(B { reset_backoff: true, ..failing_watch() }),
        row(watching(true), synced(), failed(None), retry(Stage::Resume), A::Wait(Delay::Retry)).book(failing_watch()),
        // Waits.
        row(retry(Stage::Resume), synced(), R::Waited, Stage::Resume, A::Nothing),
        row(retry(watching(false)), listing(None), R::Waited, Stage::Resume, A::Nothing),
        row(Stage::Stopped, synced(), R::Nothing, Stage::Stopped, A::Stop),
    ]
}

/// Every row: its next stage, its action and its bookkeeping, under its configuration
/// (every row that does not hold is reported).
#[test]
fn every_row_of_the_table_holds() {
    let mut wrong = Vec::new();
    for (i, r) in table().into_iter().enumerate() {
        let outcome = Outcome {
            returned: r.returned.clone(),
            store: store(r.phase.clone()),
        };
        let (to, effect) = next(r.at(), outcome, &r.config.rules);
        let got = (&to.stage, &effect.action, &effect.book);
        if got != (&r.to, &r.action, &r.book) {
            wrong.push(format!(
                "row {i}: {:?} on {:?} ({:?}, {:?})\n  want {:?}\n  got  {got:?}",
                r.stage,
                r.returned,
                r.phase,
                r.config,
                (&r.to, &r.action, &r.book)
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// One outcome of each class an action can return.
fn outcome_classes() -> Vec<Returned> {
    let mut all = vec![
        Returned::Nothing,
        Returned::Prepared {
            build: false,
            prune: false,
        },
        Returned::Chunk { done: true },
        Returned::Indexed { after: None },
        Returned::ListBegun,
        Returned::PageRead { next_token: None },
        Returned::Committed {
            written: 0,
            unchanged: 1,
        },
        Returned::Expired,
        Returned::MetadataListed {
            at: "41".into(),
            comparable: true,
            changed: 0,
            listed: 1,
        },
        Returned::Refused {
            reason: "r".into(),
            detail: "d".into(),
        },
        Returned::Connected,
        Returned::Initial(InitialBurst::default()),
        Returned::Watch(WatchBurst::default()),
        Returned::Waited,
    ];
    for status in [
        None,
        Some(StatusKind::Gone),
        Some(StatusKind::TooLarge),
        Some(StatusKind::Invalid),
        Some(StatusKind::Refused),
        Some(StatusKind::Other),
    ] {
        all.push(failed(status));
    }
    all.push(Returned::Failed {
        status: None,
        fatal: true,
        detail: "invalid shard selector".into(),
    });
    all
}

/// One stage of each kind.
fn stage_kinds() -> Vec<Stage> {
    vec![
        Stage::Start,
        Stage::BuildingIndex { after: None },
        Stage::Pruning { then_build: false },
        Stage::Resume,
        Stage::BeginList { relist: None },
        paginated(None, Committing::Nothing),
        delta(None, PageShape::Metadata, None),
        delta(None, PageShape::Full, None),
        Stage::Fetching {
            continue_token: None,
            at: "41".into(),
        },
        initial(false, 0),
        initial(true, 0),
        Stage::Sweeping {
            then_connected: false,
        },
        watching(false),
        watching(true),
        retry(Stage::Resume),
        Stage::Stopped,
    ]
}

/// Whether the action of `stage` can return `returned`.
fn returns(stage: &Stage, returned: &Returned) -> bool {
    use Returned as R;
    if matches!(returned, R::Failed { .. }) {
        return !matches!(
            stage,
            Stage::Resume | Stage::Backoff { .. } | Stage::Stopped
        );
    }
    matches!(
        (stage, returned),
        (Stage::Start, R::Prepared { .. })
            | (
                Stage::Pruning { .. } | Stage::Sweeping { .. },
                R::Chunk { .. }
            )
            | (Stage::BuildingIndex { .. }, R::Indexed { .. })
            | (Stage::Resume | Stage::Stopped, R::Nothing)
            | (Stage::BeginList { .. }, R::ListBegun)
            | (
                Stage::Listing { .. },
                R::PageRead { .. } | R::Committed { .. } | R::Expired
            )
            | (
                Stage::DeltaListing {
                    shape: PageShape::Metadata,
                    ..
                },
                R::MetadataListed { .. } | R::Refused { .. } | R::Expired
            )
            | (
                Stage::DeltaListing {
                    shape: PageShape::Full,
                    ..
                },
                R::Committed { .. } | R::Expired
            )
            | (
                Stage::Fetching { .. },
                R::Committed { .. } | R::Refused { .. }
            )
            | (
                Stage::StreamingInitial {
                    connected: false,
                    ..
                } | Stage::Watching { connected: false },
                R::Connected
            )
            | (
                Stage::StreamingInitial {
                    connected: true,
                    ..
                },
                R::Initial(_)
            )
            | (Stage::Watching { connected: true }, R::Watch(_))
            | (Stage::Backoff { .. }, R::Waited)
    )
}

/// Every (stage, outcome class) pair: one its action can return moves on as the table
/// says (checked above) and never to `Stopped` unless fatal; every failure waits the retry
/// backoff, relists, falls back or stops; and a pair its action cannot return (a defect of
/// the driver) resumes from the stored phase.
#[test]
fn every_stage_and_outcome_class_has_its_transition() {
    let covered: BTreeSet<(&str, String)> = table()
        .iter()
        .map(|r| (r.stage.name(), class(&r.stage, &r.returned)))
        .collect();
    for stage in stage_kinds() {
        for returned in outcome_classes() {
            let what = format!("{stage:?} on {returned:?}");
            let expected = returns(&stage, &returned);
            let fatal = matches!(returned, Returned::Failed { fatal: true, .. });
            if expected && !fatal {
                assert!(
                    covered.contains(&(stage.name(), class(&stage, &returned))),
                    "the table has no row for {what}"
                );
            }
            let (to, effect) = go(at(stage.clone()), returned.clone(), listing(None));
            match (expected, fatal) {
                (true, true) => {
                    assert_eq!(to.stage, Stage::Stopped, "{what}");
                    assert_eq!(effect.action, Action::Stop, "{what}");
                    assert!(effect.book.fail, "{what}");
                }
                (true, false) if stage == Stage::Stopped => assert_eq!(to.stage, Stage::Stopped),
                (true, false) => assert_ne!(to.stage, Stage::Stopped, "{what}"),
                (false, _) if stage == Stage::Stopped => assert_eq!(to.stage, Stage::Stopped),
                // Any failure retries from the stored phase.
                (false, true) => assert_eq!(to.stage, Stage::Stopped, "{what}"),
                (false, false) if matches!(returned, Returned::Failed { .. }) => {
                    assert_eq!(to.stage, retry(Stage::Resume), "{what}")
                }
                (false, _) => assert_eq!(to.stage, Stage::Resume, "{what}"),
            }
        }
    }
}

/// The class of an outcome: its variant, and a failure's status where the stage tells
/// statuses apart (a connect's answer; elsewhere any failure retries).
fn class(stage: &Stage, returned: &Returned) -> String {
    let debug = format!("{returned:?}");
    let variant = debug
        .split(|c: char| !c.is_alphanumeric())
        .next()
        .unwrap_or("")
        .to_string();
    match (stage, returned) {
        (
            Stage::StreamingInitial {
                connected: false, ..
            }
            | Stage::Watching { connected: false },
            Returned::Failed { status, .. },
        ) => format!("{variant}({status:?})"),
        _ => variant,
    }
}

#[test]
fn the_start_signal_is_given_once_the_store_is_consistent() {
    let fresh = At::start(&rules());
    let cold = Stored {
        phase: Phase::Empty,
        ever_synced: false,
        comparable: false,
    };
    let (a, e) = next(
        fresh.clone(),
        Outcome {
            returned: Returned::Prepared {
                build: false,
                prune: false,
            },
            store: cold.clone(),
        },
        &rules(),
    );
    assert_eq!(a.signal, StartSignal::FirstList);
    assert_eq!(e.book.announce, None);
    let (_, e) = next(
        a,
        Outcome {
            returned: Returned::Nothing,
            store: cold,
        },
        &rules(),
    );
    assert_eq!(e.action, Action::BeginList { init: true });
    // A store synced before resumes at once from its checkpoint: `Resumed`.
    let (a, e) = next(
        fresh,
        Outcome {
            returned: Returned::Prepared {
                build: false,
                prune: false,
            },
            store: store(synced()),
        },
        &rules(),
    );
    assert_eq!(e.book.announce, Some(StartSignal::Resume));
    assert!(e.book.resumed);
    assert_eq!(a.signal, StartSignal::Given);
    // While a prune runs the store is not consistent yet.
    let (a, e) = next(
        At::start(&rules()),
        Outcome {
            returned: Returned::Prepared {
                build: false,
                prune: true,
            },
            store: store(synced()),
        },
        &rules(),
    );
    assert_eq!(e.book.announce, None);
    let (_, e) = go(a, Returned::Chunk { done: true }, synced());
    assert_eq!(e.book.announce, Some(StartSignal::Resume));
}

#[test]
fn a_list_completes_once_the_store_reaches_synced() {
    let mut from = at(paginated(None, Committing::LastPage));
    from.synced = false;
    from.streaming_cuts = 2;
    let (to, e) = go(
        from,
        Returned::Committed {
            written: 0,
            unchanged: 0,
        },
        synced(),
    );
    assert!(e.book.list_complete && e.book.reset_backoff);
    assert_eq!(to.streaming_cuts, 0);
    // Not on a failure, even if the store got there.
    let mut from = at(paginated(None, Committing::LastPage));
    from.synced = false;
    let (_, e) = go(from, failed(None), synced());
    assert!(!e.book.list_complete && e.book.fail);
}

#[test]
fn delta_relists_run_only_where_they_apply() {
    let begun = |at: At, stored: Stored, rules: &Rules| {
        next(
            at,
            Outcome {
                returned: Returned::ListBegun,
                store: stored,
            },
            rules,
        )
        .0
        .stage
    };
    let begin = || at(Stage::BeginList { relist: None });
    let is_delta = |s: &Stage| matches!(s, Stage::DeltaListing { .. });
    assert!(is_delta(&begun(begin(), store(listing(None)), &rules())));
    // Not for a store that held nothing (no sweep), nor an incomparable checkpoint.
    let empty = Phase::Listing {
        continue_token: None,
        sweep: false,
    };
    assert!(!is_delta(&begun(begin(), store(empty), &rules())));
    let opaque = Stored {
        comparable: false,
        ..store(listing(None))
    };
    assert!(!is_delta(&begun(begin(), opaque, &rules())));
    // Not with RelistMode::Full, nor for a metadata-only store.
    let full = Rules {
        relist_mode: RelistMode::Full,
        ..rules()
    };
    assert!(!is_delta(&begun(begin(), store(listing(None)), &full)));
    let meta = Rules {
        metadata_only: true,
        ..rules()
    };
    assert!(!is_delta(&begun(begin(), store(listing(None)), &meta)));
    // Streaming lists where configured and no delta relist applies.
    let mut streaming = begin();
    streaming.streaming = true;
    streaming.gate = DeltaGate::Closed;
    assert_eq!(
        begun(streaming, store(listing(None)), &rules()),
        initial(false, 0)
    );
}

#[test]
fn a_refusal_closes_the_gate_for_this_relist_only() {
    let (a, e) = go(
        at(delta(Some("t"), PageShape::Metadata, None)),
        Returned::Refused {
            reason: "r".into(),
            detail: "d".into(),
        },
        listing(Some("t")),
    );
    assert!(e.book.delta_fallback);
    assert_eq!(a.gate, DeltaGate::ClosedForThisRelist);
    // The rest of this relist lists in full, in paginated pages.
    let (a, _) = go(
        a,
        Returned::Committed {
            written: 0,
            unchanged: 1,
        },
        listing(Some("u")),
    );
    assert_eq!(a.stage, paginated(Some("u"), Committing::Nothing));
    // The retry of the same relist keeps it closed; a new relist opens it.
    let mut retrying = a.clone();
    retrying.stage = Stage::Resume;
    let (r, _) = go(retrying, Returned::Nothing, listing(None));
    assert_eq!(r.gate, DeltaGate::ClosedForThisRelist);
    let mut relist = a;
    relist.stage = Stage::Watching { connected: true };
    let (r, _) = go(
        relist,
        Returned::Watch(WatchBurst {
            status: Some(Status {
                kind: StatusKind::Gone,
                detail: "410".into(),
            }),
            ..Default::default()
        }),
        synced(),
    );
    assert_eq!(r.gate, DeltaGate::Open);
    // Incomparable versions close it for the life of the process.
    let (a, _) = go(
        at(delta(None, PageShape::Metadata, None)),
        Returned::MetadataListed {
            at: "x".into(),
            comparable: false,
            changed: 0,
            listed: 1,
        },
        listing(None),
    );
    assert_eq!(a.gate, DeltaGate::Closed);
}

#[test]
fn too_large_answers_retry_then_relist() {
    let too_large = || {
        Returned::Watch(WatchBurst {
            status: Some(Status {
                kind: StatusKind::TooLarge,
                detail: "504".into(),
            }),
            ..Default::default()
        })
    };
    let mut a = at(watching(true));
    for _ in 0..rules().too_large_retries {
        let (b, e) = go(a, too_large(), synced());
        assert!(e.book.fail && e.book.watch_failed);
        a = b;
        a.stage = watching(true);
    }
    let (b, e) = go(a, too_large(), synced());
    assert!(!e.book.fail);
    assert_eq!(
        b.stage,
        relisting("resourceVersion too large, retries exhausted")
    );
    assert_eq!(b.too_large, 0);
}

#[test]
fn watch_errors_in_a_row_relist_and_a_delivered_event_resets_them() {
    let error = |delivered| {
        Returned::Watch(WatchBurst {
            delivered,
            status: Some(Status {
                kind: StatusKind::Other,
                detail: "500".into(),
            }),
            ..Default::default()
        })
    };
    let mut a = at(watching(true));
    for _ in 1..WATCH_ERRORS_BEFORE_RELIST {
        let (b, e) = go(a, error(0), synced());
        assert!(e.book.fail);
        a = b;
        a.stage = watching(true);
    }
    // An event delivered with the error starts the count again.
    let (b, _) = go(a.clone(), error(1), synced());
    assert_eq!(b.watch_errors, 1);
    let (b, e) = go(a, error(0), synced());
    assert!(!e.book.fail);
    assert!(matches!(b.stage, Stage::BeginList { relist: Some(_) }));
    assert_eq!(b.watch_errors, 0, "counted afresh after the relist");
}

#[test]
fn streaming_cuts_fall_back_after_a_few() {
    let cut = || {
        Returned::Initial(InitialBurst {
            ended: true,
            ..Default::default()
        })
    };
    let mut a = at(initial(true, 0));
    a.streaming = true;
    for _ in 1..STREAMING_CUTS_BEFORE_FALLBACK {
        let (b, e) = go(a, cut(), listing(None));
        assert!(e.book.fail);
        a = b;
        a.stage = initial(true, 0);
    }
    let (b, e) = go(a, cut(), listing(None));
    assert!(!e.book.fail);
    assert!(!b.streaming, "paginated LISTs from now on");
    assert_eq!(b.stage, Stage::BeginList { relist: None });
}

#[test]
fn the_auto_rule_lists_a_page_in_full_above_its_share_of_changes() {
    assert_eq!(page_shape(RelistMode::Auto, 6, 100), PageShape::Metadata);
    assert_eq!(page_shape(RelistMode::Auto, 7, 100), PageShape::Full);
    assert_eq!(page_shape(RelistMode::Auto, 0, 0), PageShape::Metadata);
    assert_eq!(page_shape(RelistMode::Delta, 100, 100), PageShape::Metadata);
}

/// The edges of the watcher's diagram in docs/design.md: `from --> to` lines of its
/// `mermaid` block, by the stages' names.
fn drawn_edges() -> BTreeSet<(String, String)> {
    // Read when the test runs: docs/ is not in the published package, whose targets are
    // only compiled.
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/design.md");
    let doc = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let section = doc
        .split("## The watcher state machine")
        .nth(1)
        .expect("docs/design.md has the watcher's section");
    let block = section
        .split("```mermaid")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("the section has a mermaid diagram");
    block
        .lines()
        .filter_map(|l| {
            let (from, rest) = l.split_once("-->")?;
            let to = rest.split(':').next()?.trim();
            Some((from.trim().to_string(), to.to_string()))
        })
        .filter(|(from, to)| from != "[*]" && to != "[*]")
        .collect()
}

/// The edges `next` takes: every stream state reachable from a start (with and without
/// streaming lists), over every outcome class each action returns (bursts and pages of every
/// shape), with every stored phase, for a store synced before or not.
fn taken_edges() -> BTreeSet<(String, String)> {
    let status = |kind| {
        Some(Status {
            kind,
            detail: "x".into(),
        })
    };
    let mut outcomes = outcome_classes();
    for kind in [
        StatusKind::Gone,
        StatusKind::TooLarge,
        StatusKind::Invalid,
        StatusKind::Other,
    ] {
        for delivered in [0, 1] {
            outcomes.push(Returned::Initial(InitialBurst {
                status: status(kind),
                delivered,
                ..Default::default()
            }));
            outcomes.push(Returned::Watch(WatchBurst {
                status: status(kind),
                delivered,
                ..Default::default()
            }));
        }
    }
    outcomes.extend(
        [
            InitialBurst {
                end: true,
                ..Default::default()
            },
            InitialBurst {
                idle: true,
                ..Default::default()
            },
            InitialBurst {
                plain_bookmark: true,
                ..Default::default()
            },
            InitialBurst {
                broke: Some("x".into()),
                ..Default::default()
            },
            InitialBurst {
                ended: true,
                ..Default::default()
            },
        ]
        .map(Returned::Initial),
    );
    outcomes.extend(
        [
            WatchBurst {
                ended: true,
                ..Default::default()
            },
            WatchBurst {
                lost: Some("x".into()),
                ..Default::default()
            },
            WatchBurst {
                ahead_failed: true,
                ..Default::default()
            },
        ]
        .map(Returned::Watch),
    );
    outcomes.extend([
        Returned::Prepared {
            build: true,
            prune: false,
        },
        Returned::Prepared {
            build: true,
            prune: true,
        },
        Returned::Prepared {
            build: false,
            prune: true,
        },
        Returned::Chunk { done: false },
        Returned::Indexed {
            after: Some(b"k".to_vec()),
        },
        Returned::PageRead {
            next_token: Some("t".into()),
        },
        Returned::Committed {
            written: 9,
            unchanged: 1,
        },
        Returned::MetadataListed {
            at: "41".into(),
            comparable: false,
            changed: 0,
            listed: 1,
        },
        Returned::MetadataListed {
            at: "41".into(),
            comparable: true,
            changed: 9,
            listed: 10,
        },
    ]);
    let mut stores = Vec::new();
    for phase in [
        Phase::Empty,
        listing(None),
        listing(Some("t")),
        sweeping(),
        synced(),
    ] {
        stores.push(store(phase.clone()));
        stores.push(Stored {
            phase,
            ever_synced: false,
            comparable: false,
        });
    }
    let mut seen = BTreeSet::new();
    let mut todo = Vec::new();
    for streaming in [false, true] {
        let mut start = At::start(&rules());
        start.streaming = streaming;
        todo.push(start);
    }
    let mut edges = BTreeSet::new();
    while let Some(from) = todo.pop() {
        if from.stage == Stage::Stopped || !seen.insert(format!("{from:?}")) {
            continue;
        }
        for returned in outcomes.iter().filter(|r| returns(&from.stage, r)) {
            for stored in &stores {
                let outcome = Outcome {
                    returned: returned.clone(),
                    store: stored.clone(),
                };
                let (mut to, _) = next(from.clone(), outcome, &rules());
                edges.insert((drawn(&from.stage), drawn(&to.stage)));
                // Counts past their thresholds decide nothing new.
                if let Stage::StreamingInitial { received, .. } = &mut to.stage {
                    *received = (*received).min(1);
                }
                todo.push(to);
            }
        }
    }
    assert!(
        seen.len() > 50,
        "the exploration reached {} states",
        seen.len()
    );
    edges
}

/// A stage's name as the diagram draws it: `building-index` as `BuildingIndex`.
fn drawn(stage: &Stage) -> String {
    stage
        .name()
        .split('-')
        .map(|w| {
            let mut c = w.chars();
            c.next()
                .map(|f| f.to_uppercase().chain(c).collect::<String>())
                .unwrap_or_default()
        })
        .collect()
}

/// Every drawn edge is a transition of `next`, and every transition is drawn.
#[test]
fn the_diagram_draws_every_transition() {
    let drawn = drawn_edges();
    let taken = taken_edges();
    let undrawn: Vec<_> = taken.difference(&drawn).collect();
    let untaken: Vec<_> = drawn.difference(&taken).collect();
    if !undrawn.is_empty() {
        for (from, to) in &undrawn {
            println!("    {from} --> {to}");
        }
    }
    assert!(
        undrawn.is_empty() && untaken.is_empty(),
        "docs/design.md's watcher diagram is out of date:\n  transitions not drawn: {undrawn:?}\n  drawn edges no transition takes: {untaken:?}"
    );
}
