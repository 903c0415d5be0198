//! Latency histograms for the load tester: log-linear buckets over microseconds.
//!
//! Values below 128 µs are exact; above, each power of two is split into 64 buckets, so a
//! reported percentile is within 1/64 (1.6 %) of the true value — HDR-histogram accuracy
//! with two significant digits, in a fixed 14 KB per histogram and without a dependency.
//! [`AtomicHistogram`] is what the virtual nodes record into concurrently (relaxed atomic
//! adds, no locks); [`Histogram`] is its snapshot that percentiles are read from.

use std::sync::atomic::{AtomicU64, Ordering};

const SUB_BITS: u32 = 6;
const SUB: u64 = 1 << SUB_BITS;

/// Largest value a histogram holds (one hour in microseconds); larger values are
/// recorded as this.
pub const MAX_VALUE_US: u64 = 3_600_000_000;

const BUCKETS: usize = index_of(MAX_VALUE_US) + 1;

/// Bucket index of `v` (which must be ≤ `MAX_VALUE_US` for the index to be in range).
const fn index_of(v: u64) -> usize {
    if v < SUB {
        return v as usize;
    }
    let msb = 63 - v.leading_zeros();
    let shift = msb - SUB_BITS;
    let mantissa = v >> shift; // in [SUB, 2 * SUB)
    ((shift as u64 + 1) * SUB + (mantissa - SUB)) as usize
}

/// Smallest and largest value that land in bucket `index`.
fn bounds_of(index: usize) -> (u64, u64) {
    let index = index as u64;
    if index < SUB {
        return (index, index);
    }
    let shift = index / SUB - 1;
    let mantissa = SUB + index % SUB;
    let low = mantissa << shift;
    (low, low + (1u64 << shift) - 1)
}

/// A latency distribution in microseconds.
#[derive(Debug, Clone)]
pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
    sum: u64,
    min: u64,
    max: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: vec![0; BUCKETS],
            total: 0,
            sum: 0,
            min: u64::MAX,
            max: 0,
        }
    }
}

impl Histogram {
    /// Records one value (clamped to [`MAX_VALUE_US`]).
    pub fn record(&mut self, micros: u64) {
        let v = micros.min(MAX_VALUE_US);
        self.counts[index_of(v)] += 1;
        self.total += 1;
        self.sum = self.sum.saturating_add(v);
        self.min = self.min.min(v);
        self.max = self.max.max(v);
    }

    /// Adds every value of `other` to this histogram.
    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.total += other.total;
        self.sum = self.sum.saturating_add(other.sum);
        self.min = self.min.min(other.min);
        self.max = self.max.max(other.max);
    }

    /// Number of values recorded.
    pub fn count(&self) -> u64 {
        self.total
    }

    /// Largest value recorded (exact), 0 when empty.
    pub fn max(&self) -> u64 {
        self.max
    }

    /// Smallest value recorded (exact), 0 when empty.
    pub fn min(&self) -> u64 {
        if self.total == 0 { 0 } else { self.min }
    }

    /// Arithmetic mean (exact), 0 when empty.
    pub fn mean(&self) -> f64 {
        if self.total == 0 {
            0.0
        } else {
            self.sum as f64 / self.total as f64
        }
    }

    /// The value below or at which a fraction `q` (0..=1) of the values lie: the highest
    /// value of the bucket holding that rank, never above the recorded maximum. 0 when empty.
    pub fn value_at_quantile(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let q = if q.is_nan() { 1.0 } else { q.clamp(0.0, 1.0) };
        let rank = ((q * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0u64;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                let (_, high) = bounds_of(i);
                return high.min(self.max).max(self.min);
            }
        }
        self.max
    }
}

/// A histogram many tasks record into at once.
#[derive(Debug)]
pub struct AtomicHistogram {
    counts: Box<[AtomicU64]>,
    total: AtomicU64,
    sum: AtomicU64,
    min: AtomicU64,
    max: AtomicU64,
}

impl Default for AtomicHistogram {
    fn default() -> Self {
        AtomicHistogram {
            counts: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            total: AtomicU64::new(0),
            sum: AtomicU64::new(0),
            min: AtomicU64::new(u64::MAX),
            max: AtomicU64::new(0),
        }
    }
}

impl AtomicHistogram {
    /// Records one value (clamped to [`MAX_VALUE_US`]).
    pub fn record(&self, micros: u64) {
        let v = micros.min(MAX_VALUE_US);
        self.counts[index_of(v)].fetch_add(1, Ordering::Relaxed);
        self.total.fetch_add(1, Ordering::Relaxed);
        self.sum.fetch_add(v, Ordering::Relaxed);
        self.min.fetch_min(v, Ordering::Relaxed);
        self.max.fetch_max(v, Ordering::Relaxed);
    }

    /// A copy of what has been recorded so far.
    pub fn snapshot(&self) -> Histogram {
        Histogram {
            counts: self
                .counts
                .iter()
                .map(|c| c.load(Ordering::Relaxed))
                .collect(),
            total: self.total.load(Ordering::Relaxed),
            sum: self.sum.load(Ordering::Relaxed),
            min: self.min.load(Ordering::Relaxed),
            max: self.max.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn within(actual: u64, expected: u64, rel: f64) -> bool {
        (actual as f64 - expected as f64).abs() <= expected as f64 * rel
    }

    #[test]
    fn bucket_bounds_cover_every_value_once() {
        let mut expected_low = 0u64;
        for i in 0..BUCKETS {
            let (low, high) = bounds_of(i);
            assert_eq!(
                low, expected_low,
                "bucket {i} starts where the previous ended"
            );
            assert!(high >= low);
            assert_eq!(index_of(low), i);
            assert_eq!(index_of(high), i);
            expected_low = high + 1;
        }
        assert!(expected_low > MAX_VALUE_US);
    }

    #[test]
    fn small_values_are_exact() {
        let mut h = Histogram::default();
        for v in 0..100 {
            h.record(v);
        }
        assert_eq!(h.value_at_quantile(0.5), 49);
        assert_eq!(h.value_at_quantile(0.99), 98);
        assert_eq!(h.value_at_quantile(1.0), 99);
        assert_eq!(h.min(), 0);
        assert_eq!(h.count(), 100);
    }

    #[test]
    fn percentiles_of_a_uniform_range_are_within_two_percent() {
        let mut h = Histogram::default();
        for v in 1..=100_000 {
            h.record(v);
        }
        let p50 = h.value_at_quantile(0.50);
        let p99 = h.value_at_quantile(0.99);
        assert!(within(p50, 50_000, 1.0 / 64.0), "p50 {p50}");
        assert!(within(p99, 99_000, 1.0 / 64.0), "p99 {p99}");
        assert!(
            p50 >= 50_000,
            "reports the bucket's highest value, never below"
        );
        assert_eq!(h.value_at_quantile(1.0), 100_000);
        assert_eq!(h.max(), 100_000);
        assert!((h.mean() - 50_000.5).abs() < 1e-6);
    }

    #[test]
    fn tail_is_not_hidden_by_the_body() {
        // 990 fast requests and 10 slow ones: p99 is the slowest fast one, max the slow.
        let mut h = Histogram::default();
        for _ in 0..990 {
            h.record(1_000);
        }
        for _ in 0..10 {
            h.record(250_000);
        }
        assert!(within(h.value_at_quantile(0.99), 1_000, 1.0 / 64.0));
        assert!(within(h.value_at_quantile(0.995), 250_000, 1.0 / 64.0));
        assert_eq!(h.max(), 250_000);
    }

    #[test]
    fn empty_histogram_reports_zero() {
        let h = Histogram::default();
        assert_eq!(h.value_at_quantile(0.5), 0);
        assert_eq!(h.max(), 0);
        assert_eq!(h.min(), 0);
        assert_eq!(h.mean(), 0.0);
    }

    #[test]
    fn huge_values_are_clamped() {
        let mut h = Histogram::default();
        h.record(u64::MAX);
        assert_eq!(h.max(), MAX_VALUE_US);
        assert_eq!(h.value_at_quantile(0.5), MAX_VALUE_US);
    }

    #[test]
    fn atomic_snapshot_and_merge_agree_with_plain_recording() {
        let a = AtomicHistogram::default();
        let mut plain = Histogram::default();
        for v in (0..5_000).map(|i| i * 37 % 20_011) {
            a.record(v);
            plain.record(v);
        }
        let snap = a.snapshot();
        assert_eq!(snap.count(), plain.count());
        for q in [0.1, 0.5, 0.9, 0.99, 1.0] {
            assert_eq!(snap.value_at_quantile(q), plain.value_at_quantile(q));
        }
        let mut merged = Histogram::default();
        merged.merge(&snap);
        merged.merge(&plain);
        assert_eq!(merged.count(), 10_000);
        assert_eq!(merged.value_at_quantile(0.5), plain.value_at_quantile(0.5));
        assert_eq!(merged.max(), plain.max());
    }
}
