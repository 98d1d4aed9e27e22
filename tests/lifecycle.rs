//! The lifecycle model test (issue 23): one randomized, seeded run that drives a store and a
//! durable controller through random sequences of operations against the testkit API server,
//! on both engines, and checks invariants after each step.
//!
//! The configuration matrix (issues 49 and 56): the stream's selection, transform, indexes,
//! streaming lists and encryption are drawn (`lifecycle/select.rs`): a label selector over
//! the objects' `tier` and `mode` labels, a field selector (`metadata.namespace`,
//! `metadata.name!=`: what the testkit serves), an even uid shard, the transform on or off
//! (each a store identity of its own: a change wipes the store and lists again), label
//! indexes, streaming lists, the `Db` encrypted or not for a whole engine's run, and one
//! engine's server filters shards while the other's leaves it to the store
//! (`ServerOptions::sharded_list_and_watch`). A side stream in the same `Db`
//! (`lifecycle/side.rs`) takes the part of the matrix a controller cannot: keys-only and
//! metadata-only stores (and whole ones) with selectors, shard, transform and streaming
//! lists of their own. Every reopen relists in a `RelistMode` of its own (Auto, Full or
//! Delta), and each of these changes between runs; so do the page size, the durability
//! (fsync every batch, or a background flush: a SIGKILL then loses the last commits and
//! the store reopens in an older phase), kube's retry layer in the stream's client,
//! every delta fetch refused (403) for a run, and the stream's list pages held by the server
//! until their next page is asked for (`RunCfg::hold`: the store asks for the next page as
//! soon as a page's head names its continue token, or never syncs).
//!
//! Operations: server churn (creates, updates, deletes, of objects the controller requeues or
//! fails on too; moves of objects to another `tier`, in or out of a label selection),
//! compaction (410 on the live watch, and on resume after a restart), watch errors, an API
//! server restart (watches cut, connections refused for a moment), graceful stop, task abort
//! and immediate reopen in the same `Db` (after a burst, with a second stream keeping the
//! disk thread busy), SIGKILL of a child process (this binary, re-executed) in the middle of
//! a relist, a delta relist (mid fetches, and as soon as it is synced), a sweep, a prune or
//! a reconcile batch, and a read-only handle opened beside the live run with a verify
//! through it (the tool's). A relist of the live store runs while objects change between
//! its metadata page and its fetch (changed, moved out of the selection, moved in, created
//! again elsewhere, deleted: a fetch that finds nothing) with a fault on its fetches (all
//! refused with 403 or answered 404, every n-th 429 or 500, every LIST slow). Objects are deleted and
//! created again under the same name (another uid, maybe another mode, tier or shard) at
//! every point (`lifecycle/recreate.rs`): while the controller runs (churn), while it is
//! stopped (after a graceful stop, before a killed child's run), in a burst just before an
//! abort, while a child reconciles, while the object's own reconcile runs (deleted, created
//! again at once or once it is done: `Op::Busy`), and during a relist (between a metadata
//! page and its fetch, or deleted before the snapshot and created again after its first
//! page). Triggers at random moments, also right after a restart (during the startup pass
//! and the catch-up wait): `reconcile_on` requests, changes of related objects (a
//! `watches_store` stream), `reconcile_all_on` ticks, storms of ticks that come faster than
//! one sweep takes (sweeps go in chunks of eight), a tick whose pass a restart (graceful,
//! abort or SIGKILL) interrupts, and a change storm (`lifecycle/storm.rs`, under the run's
//! drawn configuration: a tick's long pass while changes of related objects keep coming for
//! the objects it already passed), to a controller on a shared stream (beside a consumer
//! slower than the watch and one first polled late) that reaches its concurrency limit,
//! skips versions of an unchanged generation, and whose reconcilers write their own object
//! (a change that keeps the generation), run long, requeue after a second or an hour, and
//! fail.
//!
//! Invariants, checked in this process once the server is quiescent and the store reports
//! `Synced`, live and a checkpoint equal to the server's resourceVersion: the store equals the
//! server's selection object by object (name, resourceVersion and uid; the selection is its
//! label and field selectors and its shard, decided on each object's own metadata), holds
//! nothing outside it, a transformed store holds only transformed objects, `len()` equals
//! the records, the indexes equal the records, the async reads (`iter_stream`,
//! `get_named_async`) give what the blocking ones give; every selected object has been
//! reconciled at its current version and uid, as the reconciler saw them (the reconcile log
//! records the uid of every reconcile, a child's too; or, its uid, at its current
//! generation: a move to another tier keeps it), and an object created again under its name
//! is reconciled as its new uid (`checks::NEW_UID`: never taken as handled by the old uid's
//! reconciles); every selected object that requeues (or fails and is retried) is
//! reconciled again (no due requeue is lost); no run, in this process or a child,
//! reconciles an object outside its selection; a store that reports ready holds nothing
//! outside its selection (a narrowed store is pruned first); no consumer of a stream (the
//! shared stream's two, a child's, the side stream's) is ever given an object outside its
//! selection, and once caught up each holds exactly the selection (what its events left it
//! with, reading the store again at `Resumed`, `Init` and `Lagged`); a stream and its
//! controller reopen in the same `Db` at once after an abort; a child process runs until it
//! is killed; every trigger is followed by a reconcile of its object (of every object, for a
//! tick) that starts after it, within the longest reconciles ahead of it and a margin (for a
//! storm's tick: two sweeps and a margin, so no tick is starved by the ones after it), never
//! at a later requeue's due time; every tick is swept within its bound across restarts (a
//! tick whose pass a restart interrupted: every selected object reconciled after it, by any
//! run, a child's too, within the bound of the last restart: the durable controller resumes
//! the pass); no consumer of the shared stream holds the watch beyond its
//! stall bound (the store reaches the server's version soon after a churn); every consumer
//! gets its start signal, also one lagged before it came; a read-only handle (the
//! `kube-persist` tool's) opens beside a redb writer that makes every batch durable, and its
//! verify never reports a difference, while beside any other writer it is `Locked` at once;
//! no reconcile record is forgotten for a stored object, none is kept for an object the
//! store does not hold, and `controller_states()` counts the stored objects; a run in
//! `RelistMode::Full` fetches no body and lists no metadata page, one in `Delta` on a store
//! that was synced lists no page in full unless its fetches were refused, and no relist
//! falls back to full pages without a refusal; no reader and no consumer of the shared
//! stream is given an object older than the one stored before; a killed child's store, when
//! `Synced`, holds nothing its selectors exclude and equals the server at its checkpoint up
//! to what a delta relist explains (`unexplained_by_window`: only while the killed store's
//! fetch window is open); the side store, `Synced` and live at the server's version, equals
//! the server's selection (keys-only: its length), and a verify of it finds no difference;
//! under a change storm, counted in dispatches from the run's reconcile log (issue 50, item
//! 2): changes go first (every change reconciled, behind at most `Q + ceil((Q+1)/3) + L`
//! other dispatches, Q the changes ahead of it), and the pass keeps its share (done within
//! `4·N + L` dispatches of its tick, and one dispatch in four while changes wait).
//! A broken invariant is reported once per run (the same keys are not waited for again).
//!
//! `KP_LIFECYCLE_SEED=<n>` replays a seed, `=random` picks one (printed); `KP_LIFECYCLE_STEPS`
//! sets the steps per engine, `KP_LIFECYCLE_ENGINE` runs one engine only, `KP_LIFECYCLE_HISTORY`
//! prints every engine's history (it is printed after a violation anyway); `RUST_LOG` the
//! library's log (of this process). Each broken invariant is printed with the engine, seed,
//! step, the run's configuration and the operations since the last restart; each engine's
//! summary line counts the kills, the relists and fetches, and says where the time went; the
//! last line is exactly `lifecycle: <S> steps, <R> restarts, <V> violations`, and the test
//! fails unless V is 0.

#[path = "lifecycle/app.rs"]
mod app;
#[path = "lifecycle/checks.rs"]
mod checks;
mod common;
#[path = "lifecycle/model.rs"]
mod model;
#[path = "lifecycle/select.rs"]
mod select;

use kube_persist::Engine;

const DEFAULT_SEED: u64 = 0x6c69_6665_6379_636c;
const STEPS_PER_ENGINE: usize = 60;

fn main() {
    if let Ok(dir) = std::env::var(app::CHILD_DIR_ENV) {
        app::child_main(dir);
        return;
    }
    if std::env::var_os("RUST_LOG").is_some() {
        common::init_tracing();
    }
    let seed = common::test_seed("KP_LIFECYCLE_SEED", DEFAULT_SEED);
    let steps = common::env_num("KP_LIFECYCLE_STEPS").unwrap_or(STEPS_PER_ENGINE);
    println!(
        "lifecycle: seed {seed} (replay with KP_LIFECYCLE_SEED={seed}), {steps} steps per engine"
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let started = std::time::Instant::now();
    let (mut s, mut r, mut v) = (0, 0, 0);
    for engine in engines() {
        let _report = common::SeedReport(format!("KP_LIFECYCLE_SEED={seed} (engine {engine})"));
        let out = rt.block_on(model::Model::run(engine, seed, steps));
        println!(
            "lifecycle {engine}: {} steps, {} restarts, {} violations; kills {}",
            out.steps, out.restarts, out.violations, out.kills
        );
        s += out.steps;
        r += out.restarts;
        v += out.violations;
    }
    println!("lifecycle: ran in {:.1} s", started.elapsed().as_secs_f64());
    println!("lifecycle: {s} steps, {r} restarts, {v} violations");
    if v > 0 {
        std::process::exit(1);
    }
}

/// Both engines, or the one `KP_LIFECYCLE_ENGINE` names (to replay one engine's run).
fn engines() -> Vec<Engine> {
    match std::env::var("KP_LIFECYCLE_ENGINE") {
        Ok(e) => vec![e.parse().expect("KP_LIFECYCLE_ENGINE names an engine")],
        Err(_) => vec![Engine::Redb, Engine::Sled],
    }
}
