//! Percentiles for the tools' reports.

/// Percentile `q` (0–100) of `values` in any order: the project's one nearest-rank
/// percentile, [`qos_core::stats::percentile`], on a sorted copy. NaN when there are no
/// values (a `null` in the JSON reports).
pub fn percentile(values: &[f64], q: f64) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    qos_core::stats::percentile(&v, q).unwrap_or(f64::NAN)
}

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn nearest_rank_of_unsorted_values() {
        // 1..=100 shuffled: the nearest rank of q is the value q itself.
        let v: Vec<f64> = (1..=100).map(|i| f64::from((i * 37) % 100 + 1)).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 99.9), 100.0);
        assert_eq!(percentile(&v, 100.0), 100.0);
        assert_eq!(percentile(&v, 0.0), 1.0);
        // Six values: p50 is the third, p99 the largest (not an interpolation).
        let six = [6.0, 1.0, 5.0, 2.0, 4.0, 3.0];
        assert_eq!(percentile(&six, 50.0), 3.0);
        assert_eq!(percentile(&six, 99.0), 6.0);
        // None: NaN, which the JSON reports write as null.
        assert!(percentile(&[], 99.0).is_nan());
        assert_eq!(
            serde_json::json!(percentile(&[], 50.0)),
            serde_json::Value::Null
        );
    }
}
