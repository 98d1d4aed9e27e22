//! Options of a [`Controller`](super::Controller) run.

use std::time::Duration;

/// What a [`Controller`](super::Controller) reconciles when its store is ready (after the
/// first list, or resumed from its checkpoint after a restart).
///
/// A cold start (the store's first list) reconciles every object without durable state, and
/// with it every object that is not recorded as reconciled at its current version.
///
/// ```
/// use kube_persist::controller::{Config, StartupMode};
/// let cfg = Config::default().startup(StartupMode::ReconcileAll);
/// assert_eq!(cfg.get_startup(), StartupMode::ReconcileAll);
/// assert_eq!(Config::default().get_startup(), StartupMode::Changed);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum StartupMode {
    /// The default. With durable state
    /// ([`Controller::durable_state`](super::Controller::durable_state)): reconcile only the
    /// objects whose resourceVersion differs from the one last reconciled (or never
    /// reconciled), fire the requeues and retries that fell due while the process was down
    /// at once, and later ones at their due time. Without durable state there is nothing to
    /// compare with: every stored object is reconciled, as with `ReconcileAll`.
    #[default]
    Changed,
    /// Reconcile every stored object once (a pass from disk, no LIST), as kube-runtime's
    /// controller does after each start.
    ReconcileAll,
    /// Reconcile nothing on a warm restart: only changes from now on (and, with durable
    /// state, the requeues that come due).
    Nothing,
}

/// How a [`Controller`](super::Controller) schedules reconciles.
///
/// The same knobs as kube-runtime's `controller::Config` (`debounce`, `concurrency`), plus
/// what a persistent store adds: what a restart reconciles ([`StartupMode`]), how many
/// object references a pass feeds the scheduler at a time, and, with durable state, how
/// far ahead requeues are held in memory and whether changes of status or metadata alone
/// are skipped.
///
/// ```
/// use std::time::Duration;
/// use kube_persist::controller::{Config, StartupMode};
///
/// let cfg = Config::default()
///     .concurrency(16)
///     .debounce(Duration::from_millis(100))
///     .startup(StartupMode::ReconcileAll)
///     .pass_chunk(256);
/// assert_eq!(cfg.get_concurrency(), 16);
/// assert_eq!(cfg.get_startup(), StartupMode::ReconcileAll);
/// ```
#[derive(Debug, Clone)]
#[must_use = "a Config does nothing until given to a Controller"]
pub struct Config {
    pub(crate) concurrency: u16,
    pub(crate) debounce: Duration,
    pub(crate) startup: StartupMode,
    pub(crate) pass_chunk: usize,
    pub(crate) requeue_window: Duration,
    pub(crate) startup_catch_up: Option<Duration>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            concurrency: 0,
            debounce: Duration::ZERO,
            startup: StartupMode::Changed,
            pass_chunk: 500,
            requeue_window: Duration::from_secs(300),
            startup_catch_up: Some(Duration::from_secs(60)),
        }
    }
}

impl Config {
    /// The most reconciles running at once; `0` (the default, as in kube-runtime) means no
    /// limit. Whatever the limit, one object is never reconciled twice at once.
    ///
    /// ```
    /// let cfg = kube_persist::controller::Config::default().concurrency(8);
    /// assert_eq!(cfg.get_concurrency(), 8);
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn concurrency(mut self, concurrency: u16) -> Self {
        self.concurrency = concurrency;
        self
    }

    /// Trailing-edge debounce of reconcile requests (kube-runtime's `debounce`): a request
    /// waits until no other request for the same object arrived for this long. Default zero.
    ///
    /// ```
    /// use std::time::Duration;
    /// let cfg = kube_persist::controller::Config::default().debounce(Duration::from_millis(50));
    /// assert_eq!(cfg.get_debounce(), Duration::from_millis(50));
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn debounce(mut self, debounce: Duration) -> Self {
        self.debounce = debounce;
        self
    }

    /// Whether the startup pass (see [`StartupMode`]) waits until the main store has caught
    /// up with the server ([`Reader::wait_until_caught_up`](crate::Reader::wait_until_caught_up)),
    /// and for at most how long. Default: it waits, at most 60 s.
    ///
    /// A warm restart is ready at once, on the data of the last run: without the wait, the
    /// startup pass would reconcile objects as they were when the process stopped (deleted
    /// objects included), and reconcile them again as the missed events arrive. With it, the
    /// pass starts once the store holds what the server had when the watch reconnected: after
    /// the replay of missed events (usually milliseconds), after a relist when the checkpoint
    /// was compacted away (seconds to a minute for 100,000 objects), or at most after the
    /// timeout, with a warning. Reconciles that watch events trigger meanwhile are not held.
    /// `None` starts the pass at once: faster restarts, possibly stale reconciles.
    ///
    /// ```
    /// use std::time::Duration;
    /// use kube_persist::controller::Config;
    /// assert_eq!(Config::default().get_catch_up_before_startup(), Some(Duration::from_secs(60)));
    /// let eager = Config::default().catch_up_before_startup(None);
    /// assert_eq!(eager.get_catch_up_before_startup(), None);
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn catch_up_before_startup(mut self, timeout: Option<Duration>) -> Self {
        self.startup_catch_up = timeout;
        self
    }

    /// What a warm restart (the store resumed from its checkpoint, see
    /// [`Event::Resumed`](crate::Event::Resumed)) reconciles (default
    /// [`StartupMode::Changed`], which without durable state reconciles every object:
    /// reconciles that were running or queued when the process died are lost, and the watch
    /// only replays changes). A pass reads the store from disk in chunks; it makes no LIST
    /// call.
    ///
    /// ```
    /// use kube_persist::controller::{Config, StartupMode};
    /// assert_eq!(Config::default().get_startup(), StartupMode::Changed);
    /// let cfg = Config::default().startup(StartupMode::ReconcileAll);
    /// assert_eq!(cfg.get_startup(), StartupMode::ReconcileAll);
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn startup(mut self, mode: StartupMode) -> Self {
        self.startup = mode;
        self
    }

    /// With durable state: requeues due within this window are held in kube-runtime's
    /// scheduler (in memory); later ones stay on disk, indexed by due time, and are read back
    /// (every half window) as they come near. Default 5 minutes, at least 1 second. Without
    /// durable state every requeue is held in memory.
    ///
    /// ```
    /// use std::time::Duration;
    /// use kube_persist::controller::Config;
    /// let cfg = Config::default().requeue_window(Duration::from_secs(60));
    /// assert_eq!(cfg.get_requeue_window(), Duration::from_secs(60));
    /// // At least one second.
    /// assert_eq!(Config::default().requeue_window(Duration::ZERO).get_requeue_window(), Duration::from_secs(1));
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn requeue_window(mut self, window: Duration) -> Self {
        self.requeue_window = window.max(Duration::from_secs(1));
        self
    }

    /// How many object references a pass over the store (cold start, warm restart,
    /// [`Controller::reconcile_all_on`](super::Controller::reconcile_all_on)) hands to the
    /// scheduler at a time (default 500, at least 1). The next chunk is read from disk once
    /// half of the previous one has started, so a pass holds at most about three chunks of
    /// references in memory, never the whole collection.
    ///
    /// ```
    /// use kube_persist::controller::Config;
    /// assert_eq!(Config::default().pass_chunk(100).get_pass_chunk(), 100);
    /// assert_eq!(Config::default().pass_chunk(0).get_pass_chunk(), 1);
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn pass_chunk(mut self, refs: usize) -> Self {
        self.pass_chunk = refs.max(1);
        self
    }

    /// The configured concurrency limit (`0`: none).
    ///
    /// ```
    /// // No limit by default, as in kube-runtime.
    /// assert_eq!(kube_persist::controller::Config::default().get_concurrency(), 0);
    /// ```
    pub fn get_concurrency(&self) -> u16 {
        self.concurrency
    }

    /// The configured debounce.
    ///
    /// ```
    /// use std::time::Duration;
    /// assert_eq!(kube_persist::controller::Config::default().get_debounce(), Duration::ZERO);
    /// ```
    pub fn get_debounce(&self) -> Duration {
        self.debounce
    }

    /// The startup mode.
    ///
    /// ```
    /// use kube_persist::controller::{Config, StartupMode};
    /// assert_eq!(Config::default().get_startup(), StartupMode::Changed);
    /// ```
    pub fn get_startup(&self) -> StartupMode {
        self.startup
    }

    /// How long the startup pass waits for the store to catch up (`None`: it does not).
    ///
    /// ```
    /// let wait = kube_persist::controller::Config::default().get_catch_up_before_startup();
    /// assert_eq!(wait, Some(std::time::Duration::from_secs(60)));
    /// ```
    pub fn get_catch_up_before_startup(&self) -> Option<Duration> {
        self.startup_catch_up
    }

    /// The requeue window of durable state.
    ///
    /// ```
    /// use std::time::Duration;
    /// let window = kube_persist::controller::Config::default().get_requeue_window();
    /// assert_eq!(window, Duration::from_secs(300));
    /// ```
    pub fn get_requeue_window(&self) -> Duration {
        self.requeue_window
    }

    /// References per pass chunk.
    ///
    /// ```
    /// assert_eq!(kube_persist::controller::Config::default().get_pass_chunk(), 500);
    /// ```
    pub fn get_pass_chunk(&self) -> usize {
        self.pass_chunk
    }
}
