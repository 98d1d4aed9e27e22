//! The readers' status: what a stream's readers see of its progress (phase, count,
//! checkpoint, indexes, freshness, liveness), and [`StatusTx`], its one writer. The writer
//! publishes each committed state, the index upkeep the indexes built, the watcher
//! freshness and liveness: each through one method here, so what a reader sees is set in
//! one place.

use tokio::sync::watch;

use super::caught_up::Freshness;
use super::stream_state::{Phase, State};

/// Where a stream is in its list/watch cycle, as seen by [`Reader::phase`](crate::Reader::phase).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let client = kube::Client::try_from(kube::Config::new("http://127.0.0.1:1".parse()?))?;
/// use kube_persist::SyncPhase;
/// assert_eq!(SyncPhase::default(), SyncPhase::Empty);
/// let dir = tempfile::tempdir()?;
/// let db = kube_persist::Db::open(dir.path())?;
/// let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(client);
/// let (reader, _watcher) = db.store("pods", api, kube_persist::StreamConfig::default())?;
/// assert_eq!(reader.phase(), SyncPhase::Empty); // the watcher has not run yet
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum SyncPhase {
    /// Nothing listed yet.
    #[default]
    Empty,
    /// A list or relist is writing pages (readers see old or new objects).
    Listing,
    /// A relist is complete and objects absent from it are being removed.
    Sweeping,
    /// The store equals the server at [`Reader::checkpoint`](crate::Reader::checkpoint).
    Synced,
}

impl From<&Phase> for SyncPhase {
    fn from(p: &Phase) -> Self {
        match p {
            Phase::Empty => SyncPhase::Empty,
            Phase::Listing { .. } => SyncPhase::Listing,
            Phase::Sweeping { .. } => SyncPhase::Sweeping,
            Phase::Synced { .. } => SyncPhase::Synced,
        }
    }
}

/// What readers can see of the writer's progress.
#[derive(Debug, Clone, Default)]
pub(crate) struct Status {
    pub(crate) phase: SyncPhase,
    pub(crate) ready: bool,
    pub(crate) live: bool,
    pub(crate) count: u64,
    pub(crate) checkpoint: Option<String>,
    /// Secondary indexes built on disk and ready for `Reader::by_index`.
    pub(crate) indexes: Vec<String>,
    /// Whether the store has caught up with the server (set by the watcher).
    pub(crate) catch_up: Freshness,
    /// The epoch of the latest list begun (every list attempt is a new epoch).
    pub(crate) list_epoch: u64,
    /// The epoch of the latest list completed (with its sweep): `listed_epoch` greater
    /// than an earlier `list_epoch` proves a consistent list begun after that moment.
    pub(crate) listed_epoch: u64,
}

/// The one writer of a stream's [`Status`]; readers hold the receivers.
#[derive(Clone, Debug)]
pub(crate) struct StatusTx(watch::Sender<Status>);

impl StatusTx {
    /// A new status channel: its writer and a first reader.
    pub(crate) fn channel() -> (StatusTx, watch::Receiver<Status>) {
        let (tx, rx) = watch::channel(Status::default());
        (StatusTx(tx), rx)
    }

    /// The current status.
    pub(crate) fn borrow(&self) -> watch::Ref<'_, Status> {
        self.0.borrow()
    }

    /// A committed state: its count, phase, checkpoint and list epochs. `pruning`: objects
    /// outside a narrowed shard are still being removed (not ready yet).
    pub(crate) fn committed(&self, state: &State, pruning: bool) {
        self.0.send_modify(|s| {
            s.count = state.count;
            let phase = (&state.phase).into();
            // Entering `Synced` from another phase is the end of a list (and its sweep).
            if phase == SyncPhase::Synced && s.phase != SyncPhase::Synced {
                s.listed_epoch = state.epoch;
            }
            s.list_epoch = state.epoch;
            s.phase = phase;
            s.checkpoint = state.last_synced.clone();
            s.ready = state.last_synced.is_some() && !pruning;
        });
    }

    /// The secondary indexes built on disk.
    pub(crate) fn indexes(&self, names: Vec<String>) {
        self.0.send_modify(|s| s.indexes = names);
    }

    /// Whether the store has caught up with the server.
    pub(crate) fn catch_up(&self, f: impl FnOnce(&mut Freshness)) {
        self.0.send_modify(|s| f(&mut s.catch_up));
    }

    /// Whether the watch is connected; readers are woken only by a change.
    pub(crate) fn live(&self, live: bool) {
        self.0
            .send_if_modified(|s| std::mem::replace(&mut s.live, live) != live);
    }
}
