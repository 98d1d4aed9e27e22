//! Delays before retries: kube-runtime's exponential backoff for reconnects and retries,
//! and a uniform jitter before relists.

use std::time::Duration;

use backon::ExponentialBuilder;
use kube::runtime::utils::Backoff as _;
use kube::runtime::watcher::ExponentialBackoff;
use rand::Rng;

/// The watcher's retry delays: kube-runtime's [`ExponentialBackoff`] (built on `backon`, as
/// kube's own `DefaultBackoff` is), reset by the state machine when a watch delivers an
/// event or bookmark and on reaching `Synced` rather than after a fixed time.
pub(crate) struct Backoff(ExponentialBackoff);

impl std::fmt::Debug for Backoff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Backoff")
    }
}

impl Backoff {
    /// The n-th delay (from 0) is `min * 2^n`, capped at `max`, plus a random jitter of up
    /// to that much again (so that clients spread out): within `[min, 2 * max)`.
    pub(crate) fn new(min: Duration, max: Duration) -> Self {
        Backoff(ExponentialBackoff::from(
            ExponentialBuilder::default()
                .with_min_delay(min)
                .with_max_delay(max)
                .with_factor(2.0)
                .with_jitter()
                .without_max_times(),
        ))
    }

    pub(crate) fn next_delay(&mut self) -> Duration {
        // Never `None`: the builder sets no limit on the number of retries or their total.
        self.0.next().unwrap_or_default()
    }

    pub(crate) fn reset(&mut self) {
        self.0.reset();
    }
}

/// A random delay in `[0, max)`.
pub(crate) fn jitter(max: Duration) -> Duration {
    if max.is_zero() {
        return Duration::ZERO;
    }
    max.mul_f64(rand::rng().random_range(0.0..1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_and_caps_with_jitter() {
        let ms = Duration::from_millis;
        let mut b = Backoff::new(ms(100), Duration::from_secs(1));
        let first = b.next_delay();
        assert!(first >= ms(100) && first < ms(200), "{first:?}");
        let second = b.next_delay();
        assert!(second >= ms(200) && second < ms(400), "{second:?}");
        for _ in 0..20 {
            let d = b.next_delay();
            assert!(d < ms(2000), "{d:?}");
        }
        assert!(b.next_delay() >= ms(1000), "capped at max, jitter on top");
        b.reset();
        let again = b.next_delay();
        assert!(again >= ms(100) && again < ms(200), "{again:?}");
    }
}
