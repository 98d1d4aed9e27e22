//! How hard the watcher may press the API server when lists keep failing: relists close
//! together back off, and a list slower than its continue tokens live asks for bigger pages.
//! (When a streaming list that keeps being cut falls back to paginated LISTs, and when watch
//! errors in a row relist, is the transition function's: `machine/transition.rs`.)
//!
//! client-go's reflector does the same three things: its relists go through a backoff
//! manager (800 ms to 30 s, reset once it was not used for two minutes: every failed list
//! or watch uses it, so only two minutes without an error reset it), a watch-list that
//! fails falls back to a paginated LIST, and its pager falls back to a full list when a
//! continue token expires (here: bigger pages, so that memory stays bounded).

use std::time::Duration;

use tokio::time::Instant;

use super::backoff::Backoff;

/// Each continue token that expires in a row doubles the next list's page size, up to
/// this factor of the configured one.
pub(crate) const MAX_PAGE_GROWTH: u32 = 16;

/// The watcher's pacing state across list attempts (in memory: a restarted process starts
/// afresh, which its own startup delay already spaces out).
#[derive(Debug)]
pub(crate) struct Pacing {
    relist_backoff: Backoff,
    /// Relists since the watch was last healthy for `reset_after`.
    relists: u32,
    reset_after: Duration,
    /// Since when the watch has been connected without an error or a relist (the routine
    /// reconnect after a watch's server-side timeout keeps it).
    healthy_since: Option<Instant>,
    /// Continue tokens expired in a row (page size doubled as many times, capped).
    expired_tokens: u32,
}

impl Pacing {
    pub(crate) fn new(min: Duration, max: Duration, reset_after: Duration) -> Self {
        Pacing {
            relist_backoff: Backoff::new(min, max),
            relists: 0,
            reset_after,
            healthy_since: None,
            expired_tokens: 0,
        }
    }

    /// The watch is connected and applying events (first call starts the healthy period).
    pub(crate) fn watch_up(&mut self) {
        self.watch_up_at(Instant::now());
    }

    fn watch_up_at(&mut self, now: Instant) {
        self.healthy_since.get_or_insert(now);
    }

    /// A watch failed (could not connect, broke, or ended with an `ERROR` event): the
    /// healthy period ends. One that had lasted `reset_after` still resets the relist
    /// backoff; a watch that errors every few seconds never does.
    pub(crate) fn watch_failed(&mut self) {
        self.watch_failed_at(Instant::now());
    }

    fn watch_failed_at(&mut self, now: Instant) {
        self.healthy_period_ends(now);
    }

    fn healthy_period_ends(&mut self, now: Instant) {
        let healthy = self
            .healthy_since
            .take()
            .is_some_and(|t| now.saturating_duration_since(t) >= self.reset_after);
        if healthy {
            self.relists = 0;
            self.relist_backoff.reset();
        }
    }

    /// The extra delay before a relist, on top of its jitter: none for the first relist
    /// after a watch stayed connected without an error for `reset_after` (or for the first
    /// one ever), then an exponential backoff. So a server that answers 410 right after
    /// every sync is not relisted from scratch every second.
    pub(crate) fn relist_delay(&mut self) -> Duration {
        self.relist_delay_at(Instant::now())
    }

    fn relist_delay_at(&mut self, now: Instant) -> Duration {
        self.healthy_period_ends(now);
        self.relists += 1;
        if self.relists == 1 {
            Duration::ZERO
        } else {
            self.relist_backoff.next_delay()
        }
    }

    /// Relists since the last healthy period (1 for the first).
    pub(crate) fn relists_in_a_row(&self) -> u32 {
        self.relists
    }

    /// A list (paginated or streaming) completed.
    pub(crate) fn list_complete(&mut self) {
        self.expired_tokens = 0;
    }

    /// A continue token expired before the list completed.
    pub(crate) fn token_expired(&mut self) {
        self.expired_tokens = self.expired_tokens.saturating_add(1);
    }

    /// The page size of the next LIST request, from the configured one.
    pub(crate) fn page_size(&self, configured: u32, max: u32) -> u32 {
        let growth = 1u32 << self.expired_tokens.min(MAX_PAGE_GROWTH.trailing_zeros());
        configured.saturating_mul(growth).min(max).max(configured)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relists_back_off_until_a_healthy_watch() {
        let ms = Duration::from_millis;
        let mut p = Pacing::new(ms(100), ms(1000), Duration::ZERO);
        assert_eq!(
            p.relist_delay(),
            Duration::ZERO,
            "the first relist waits its jitter only"
        );
        let second = p.relist_delay();
        let third = p.relist_delay();
        assert!(second >= ms(100) && second < ms(200), "{second:?}");
        assert!(third >= ms(200) && third < ms(400), "{third:?}");
        // A watch that stayed up for `reset_after` (zero here) resets the backoff.
        p.watch_up();
        assert_eq!(p.relist_delay(), Duration::ZERO);
        // Without a healthy watch in between, it keeps growing.
        assert!(p.relist_delay() >= ms(100));
        assert_eq!(p.relists_in_a_row(), 2);
    }

    #[test]
    fn a_short_healthy_period_does_not_reset() {
        let mut p = Pacing::new(
            Duration::from_millis(100),
            Duration::from_secs(1),
            Duration::from_secs(3600),
        );
        p.relist_delay();
        p.watch_up();
        assert!(p.relist_delay() >= Duration::from_millis(100));
    }

    /// client-go's reflector resets its relist backoff only after `reset_after` without a
    /// failure: a watch that reconnects after an error every few seconds is not healthy,
    /// however long that goes on. Time is given as explicit instants.
    #[test]
    fn a_watch_erroring_every_few_seconds_never_resets_the_relist_backoff() {
        let (ms, s) = (Duration::from_millis, Duration::from_secs);
        let mut p = Pacing::new(ms(100), s(1), s(120));
        let t0 = Instant::now();
        assert_eq!(p.relist_delay_at(t0), Duration::ZERO);
        assert!(
            p.relist_delay_at(t0) >= ms(100),
            "the second relist backs off"
        );
        // Connected at once after each error, an error 4 s later, for 150 s.
        for k in 0..30 {
            p.watch_up_at(t0 + s(5 * k));
            p.watch_failed_at(t0 + s(5 * k + 4));
        }
        p.watch_up_at(t0 + s(150));
        let delay = p.relist_delay_at(t0 + s(151));
        assert!(delay >= ms(200), "not reset: {delay:?}");
        assert_eq!(p.relists_in_a_row(), 3);
    }

    /// A watch connected without an error for `reset_after` resets the backoff, even if
    /// it then fails before the relist; routine reconnects (no error) keep the period.
    #[test]
    fn a_watch_up_without_errors_for_the_reset_period_resets_the_relist_backoff() {
        let (ms, s) = (Duration::from_millis, Duration::from_secs);
        let mut p = Pacing::new(ms(100), s(1), s(120));
        let t0 = Instant::now();
        p.relist_delay_at(t0);
        p.relist_delay_at(t0);
        p.watch_up_at(t0 + s(1));
        p.watch_up_at(t0 + s(60)); // a routine reconnect after the server-side timeout
        p.watch_failed_at(t0 + s(122)); // an error, after 121 s without one
        assert_eq!(p.relist_delay_at(t0 + s(130)), Duration::ZERO);
        assert_eq!(p.relists_in_a_row(), 1);
        // Up for less than the period, then failing: no reset.
        p.watch_up_at(t0 + s(131));
        p.watch_failed_at(t0 + s(200));
        assert!(p.relist_delay_at(t0 + s(201)) >= ms(100));
    }

    #[test]
    fn expired_tokens_grow_the_page_up_to_a_cap() {
        let mut p = Pacing::new(
            Duration::from_millis(1),
            Duration::from_millis(2),
            Duration::ZERO,
        );
        assert_eq!(p.page_size(500, 100_000), 500);
        p.token_expired();
        assert_eq!(p.page_size(500, 100_000), 1000);
        for _ in 0..10 {
            p.token_expired();
        }
        assert_eq!(p.page_size(500, 100_000), 500 * MAX_PAGE_GROWTH);
        assert_eq!(p.page_size(500, 4000), 4000);
        p.list_complete();
        assert_eq!(p.page_size(500, 100_000), 500);
    }
}
