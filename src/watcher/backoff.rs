//! Jittered exponential backoff for reconnects and retries.

use std::time::Duration;

use rand::Rng;

#[derive(Debug)]
pub(crate) struct Backoff {
    min: Duration,
    max: Duration,
    attempt: u32,
}

impl Backoff {
    pub(crate) fn new(min: Duration, max: Duration) -> Self {
        Backoff {
            min,
            max,
            attempt: 0,
        }
    }

    /// The next delay: `min * 2^attempt`, capped at `max`, then scaled by a random
    /// factor in [0.5, 1.5) so that clients spread out.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let exp = self.min.saturating_mul(1u32 << self.attempt.min(16));
        self.attempt = self.attempt.saturating_add(1);
        let base = exp.min(self.max);
        base.mul_f64(rand::rng().random_range(0.5..1.5))
    }

    pub(crate) fn reset(&mut self) {
        self.attempt = 0;
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
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let first = b.next_delay();
        assert!(first >= Duration::from_millis(50) && first < Duration::from_millis(150));
        for _ in 0..20 {
            assert!(b.next_delay() < Duration::from_millis(1500));
        }
        b.reset();
        assert!(b.next_delay() < Duration::from_millis(150));
    }
}
