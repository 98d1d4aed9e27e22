//! Options of a [`Controller`](super::Controller) run.

use std::time::Duration;

/// How a [`Controller`](super::Controller) schedules reconciles.
///
/// The same knobs as kube-runtime's `controller::Config` (`debounce`, `concurrency`), plus
/// what a persistent store adds: whether a warm restart reconciles every stored object, and
/// how many object references such a sweep feeds the scheduler at a time.
///
/// ```
/// use std::time::Duration;
/// use kube_persist::controller::Config;
///
/// let cfg = Config::default()
///     .concurrency(16)
///     .debounce(Duration::from_millis(100))
///     .reconcile_all_on_start(true)
///     .sweep_chunk(256);
/// assert_eq!(cfg.get_concurrency(), 16);
/// assert!(cfg.get_reconcile_all_on_start());
/// ```
#[derive(Debug, Clone)]
pub struct Config {
    pub(crate) concurrency: u16,
    pub(crate) debounce: Duration,
    pub(crate) reconcile_all_on_start: bool,
    pub(crate) sweep_chunk: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            concurrency: 0,
            debounce: Duration::ZERO,
            reconcile_all_on_start: true,
            sweep_chunk: 500,
        }
    }
}

impl Config {
    /// The most reconciles running at once; `0` (the default, as in kube-runtime) means no
    /// limit. Whatever the limit, one object is never reconciled twice at once.
    #[must_use]
    pub fn concurrency(mut self, concurrency: u16) -> Self {
        self.concurrency = concurrency;
        self
    }

    /// Trailing-edge debounce of reconcile requests (kube-runtime's `debounce`): a request
    /// waits until no other request for the same object arrived for this long. Default zero.
    #[must_use]
    pub fn debounce(mut self, debounce: Duration) -> Self {
        self.debounce = debounce;
        self
    }

    /// Whether a warm restart (the store resumed from its checkpoint, see
    /// [`Event::Resumed`](crate::Event::Resumed)) reconciles every stored object once.
    /// Default `true`: reconciles that were running or queued when the process died are lost,
    /// and the watch only replays changes. The sweep reads the store from disk in chunks; it
    /// makes no LIST call. (A cold start always reconciles every object once, after the first
    /// list is on disk.)
    #[must_use]
    pub fn reconcile_all_on_start(mut self, on: bool) -> Self {
        self.reconcile_all_on_start = on;
        self
    }

    /// How many object references a sweep over the store (cold start, warm restart,
    /// [`Controller::reconcile_all_on`](super::Controller::reconcile_all_on)) hands to the
    /// scheduler at a time (default 500, at least 1). The next chunk is read from disk once
    /// half of the previous one has started, so a sweep holds at most about three chunks of
    /// references in memory, never the whole collection.
    #[must_use]
    pub fn sweep_chunk(mut self, refs: usize) -> Self {
        self.sweep_chunk = refs.max(1);
        self
    }

    /// The configured concurrency limit (`0`: none).
    pub fn get_concurrency(&self) -> u16 {
        self.concurrency
    }

    /// The configured debounce.
    pub fn get_debounce(&self) -> Duration {
        self.debounce
    }

    /// Whether a warm restart reconciles every stored object.
    pub fn get_reconcile_all_on_start(&self) -> bool {
        self.reconcile_all_on_start
    }

    /// References per sweep chunk.
    pub fn get_sweep_chunk(&self) -> usize {
        self.sweep_chunk
    }
}
