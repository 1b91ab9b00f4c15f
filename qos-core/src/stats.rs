//! The one percentile of the project (nearest rank), and a latency summary built on it.
//!
//! Every place that reports a percentile — the agent's `/state`, `coloc-agent status`, the
//! demo, the benchmarks, the simulated workloads — uses these, so a "p99" means the same
//! thing everywhere.

use serde::{Deserialize, Serialize};

/// Nearest-rank percentile `q` (0–100) of an ascending slice; `None` when it is empty.
pub fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((q / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// Count, p50, p90, p99 and max of a set of values (same unit as the values).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Number of values.
    pub count: usize,
    /// Median.
    pub p50: Option<f64>,
    /// 90th percentile.
    pub p90: Option<f64>,
    /// 99th percentile.
    pub p99: Option<f64>,
    /// Largest value.
    pub max: Option<f64>,
}

impl Summary {
    /// Summarises `values` (any order; NaNs sort last).
    pub fn of(values: impl IntoIterator<Item = f64>) -> Summary {
        let mut v: Vec<f64> = values.into_iter().collect();
        v.sort_by(f64::total_cmp);
        Summary {
            count: v.len(),
            p50: percentile(&v, 50.0),
            p90: percentile(&v, 90.0),
            p99: percentile(&v, 99.0),
            max: v.last().copied(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&[], 99.0), None);
        // Six values: the p99 is the largest, p50 the third.
        let s = Summary::of([6.0, 1.0, 5.0, 2.0, 4.0, 3.0]);
        assert_eq!(
            (s.count, s.p50, s.p99, s.max),
            (6, Some(3.0), Some(6.0), Some(6.0))
        );
    }
}
