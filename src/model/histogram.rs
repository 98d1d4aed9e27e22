//! A histogram of fixed buckets kept in relaxed atomics: observed by the writer, the
//! controller's queue and its reconciles, read (cumulated) at each scrape.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Upper bounds (seconds) of a batch commit's duration buckets (and `+Inf`).
pub(crate) const COMMIT_BUCKETS: &[f64] = &[
    0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Upper bounds (bytes) of a batch's size buckets (and `+Inf`).
pub(crate) const BATCH_BYTES_BUCKETS: &[f64] = &[
    1_024.0,
    4_096.0,
    16_384.0,
    65_536.0,
    262_144.0,
    1_048_576.0,
    4_194_304.0,
    16_777_216.0,
    67_108_864.0,
];

/// Counts of observations per bucket of `bounds` (then `+Inf`), their count and their sum
/// (in units of `1 / scale`, exact for integers: bytes with scale 1, seconds with scale
/// 1e6 summed in microseconds).
#[derive(Debug)]
pub(crate) struct Histogram {
    bounds: &'static [f64],
    scale: f64,
    /// Per bucket, not cumulative (cumulated when read); the last is `+Inf`.
    buckets: Box<[AtomicU64]>,
    sum: AtomicU64,
}

/// What a [`Histogram`] holds now.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct HistogramSnapshot {
    /// `(upper bound, observations at most it)`, cumulative, ending with `f64::INFINITY`.
    pub(crate) buckets: Vec<(f64, u64)>,
    /// Sum of the observations.
    pub(crate) sum: f64,
    /// Number of observations.
    pub(crate) count: u64,
}

impl Histogram {
    /// A histogram of `bounds` (ascending), summing in units of `1 / scale`.
    pub(crate) fn new(bounds: &'static [f64], scale: f64) -> Histogram {
        Histogram {
            bounds,
            scale,
            buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum: AtomicU64::new(0),
        }
    }

    /// Count `value`.
    pub(crate) fn observe(&self, value: f64) {
        let bucket = self
            .bounds
            .iter()
            .position(|&b| value <= b)
            .unwrap_or(self.bounds.len());
        self.buckets[bucket].fetch_add(1, Relaxed);
        let units = (value.max(0.0) * self.scale).round();
        self.sum
            .fetch_add(units.min(u64::MAX as f64) as u64, Relaxed);
    }

    /// The buckets cumulated, the sum and the count.
    pub(crate) fn snapshot(&self) -> HistogramSnapshot {
        let mut total = 0;
        let buckets = self
            .bounds
            .iter()
            .copied()
            .chain([f64::INFINITY])
            .zip(self.buckets.iter())
            .map(|(bound, n)| {
                total += n.load(Relaxed);
                (bound, total)
            })
            .collect();
        HistogramSnapshot {
            buckets,
            sum: self.sum.load(Relaxed) as f64 / self.scale,
            count: total,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_fall_in_cumulative_buckets_and_sum_exactly() {
        let h = Histogram::new(&[1.0, 10.0], 1.0);
        for v in [0.5, 1.0, 3.0, 10.0, 11.0] {
            h.observe(v);
        }
        let s = h.snapshot();
        assert_eq!(s.buckets, vec![(1.0, 2), (10.0, 4), (f64::INFINITY, 5)]);
        assert_eq!((s.count, s.sum), (5, 26.0));
        let secs = Histogram::new(COMMIT_BUCKETS, 1e6);
        secs.observe(0.000_25);
        secs.observe(2.0);
        let s = secs.snapshot();
        assert_eq!(s.sum, 2.000_25);
        assert_eq!(s.buckets[0], (0.000_5, 1));
    }
}
