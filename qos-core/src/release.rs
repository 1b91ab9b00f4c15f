//! When offline work may resume before the fixed idle window: the learned release window.
//!
//! The fixed window (100 ms by default) is the product's contract and stays the default.
//! A shorter window is worth it where two things hold on a GPU: onset is seen at once (the
//! online processes ring a doorbell, and say when their work was last complete), and what
//! a wrong release costs online is bounded (the offline processes there sit behind a
//! launch gate, or the driver's lock has measured their drain). A *wrong release* is one
//! after which online work comes back while offline work is in flight: online then waits
//! for at most that drain, `drain` below.
//!
//! Each online process's own history decides its window: the idle gaps it left, from the
//! moment its work was seen complete to its next launch ([`GapModel`]). A window `w` is
//! chosen when, over the gaps longer than `w` (the ones a release at `w` would use), the
//! idle time offline would get after `w` averages at least `ratio` times `drain`: each
//! release costs online at most `drain`, so offline gains `ratio` times what online risks.
//! Gaps inside a request (between its kernels) are short and many; while they make up the
//! gaps a window would release in, the average stays low and the window grows past them.
//! No window shorter than [`Adaptive::floor`]; none until [`Adaptive::min_gaps`] gaps were
//! seen; none (the fixed window) when no candidate pays.

use crate::{Nanos, MS};
use std::collections::VecDeque;

/// The learned policy's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Adaptive {
    /// The shortest window: 2 ms by default, about ten times what a release and a
    /// re-preemption cost the agent (resume ≈ 0.3 ms, doorbell detection ≈ 0.05–0.3 ms on
    /// the simulated GPU and the H100's wake-up floor ≈ 0.1 ms), so that the agent's own
    /// work stays a small part of each gap, and longer than the host-side gaps between
    /// one request's launches.
    pub floor: Nanos,
    /// Idle time gained per unit of online delay risked: 10 by default.
    pub ratio: u32,
    /// Gaps seen before a window is learned at all: 20 by default.
    pub min_gaps: usize,
    /// Gaps longer than a candidate window needed to judge it: 8 by default.
    pub min_support: usize,
    /// Gaps remembered per process (the most recent): 256 by default.
    pub memory: usize,
}

impl Default for Adaptive {
    fn default() -> Self {
        Adaptive {
            floor: 2 * MS,
            ratio: 10,
            min_gaps: 20,
            min_support: 8,
            memory: 256,
        }
    }
}

/// Candidate windows grow by this factor (in percent) from the floor.
const STEP_PCT: u64 = 125;

/// One online process's idle gaps on one GPU, most recent last.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GapModel {
    gaps: VecDeque<Nanos>,
    seen: u64,
}

impl GapModel {
    /// Records one idle gap: from the moment the process's work was seen complete to its
    /// next launch. Keeps the `memory` most recent.
    pub fn record(&mut self, gap: Nanos, memory: usize) {
        if memory == 0 {
            return;
        }
        while self.gaps.len() >= memory {
            self.gaps.pop_front();
        }
        self.gaps.push_back(gap);
        self.seen += 1;
    }

    /// Gaps remembered.
    pub fn len(&self) -> usize {
        self.gaps.len()
    }

    /// No gap remembered.
    pub fn is_empty(&self) -> bool {
        self.gaps.is_empty()
    }

    /// Gaps ever recorded.
    pub fn seen(&self) -> u64 {
        self.seen
    }

    /// The shortest window at least `cfg.floor` and under `ceiling` whose gaps pay
    /// `cfg.ratio` × `drain` on average (see the module's rule), or `None`: keep the fixed
    /// window.
    pub fn window(&self, cfg: &Adaptive, drain: Nanos, ceiling: Nanos) -> Option<Nanos> {
        if self.gaps.len() < cfg.min_gaps.max(1) || cfg.floor == 0 {
            return None;
        }
        let need = (cfg.ratio as u128) * (drain as u128);
        let mut w = cfg.floor;
        while w < ceiling {
            let (n, sum) = self
                .gaps
                .iter()
                .filter(|&&g| g > w)
                .fold((0u128, 0u128), |(n, s), &g| (n + 1, s + (g - w) as u128));
            if n < cfg.min_support.max(1) as u128 {
                return None;
            }
            if sum >= need * n {
                return Some(w);
            }
            w = w.saturating_mul(STEP_PCT) / 100;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn model(gaps: &[Nanos]) -> GapModel {
        let mut m = GapModel::default();
        for &g in gaps {
            m.record(g, 256);
        }
        m
    }

    #[test]
    fn requests_with_short_inner_gaps_release_after_the_floor() {
        // Four kernels per request (three inner gaps of 0.05 ms), then 40 ms idle.
        let mut gaps = Vec::new();
        for _ in 0..30 {
            gaps.extend([MS / 20, MS / 20, MS / 20, 40 * MS]);
        }
        let m = model(&gaps);
        assert_eq!(
            m.window(&Adaptive::default(), 2 * MS, 100 * MS),
            Some(2 * MS)
        );
        // A 10 ms drain needs 100 ms of idle per release: not at 15 requests/s.
        assert_eq!(m.window(&Adaptive::default(), 10 * MS, 100 * MS), None);
    }

    #[test]
    fn long_inner_gaps_push_the_window_past_them() {
        // Inner gaps of 5 ms (host work between kernels) and 45 ms between requests.
        let mut gaps = Vec::new();
        for _ in 0..30 {
            gaps.extend([5 * MS, 5 * MS, 5 * MS, 45 * MS]);
        }
        let w = model(&gaps)
            .window(&Adaptive::default(), 2 * MS, 100 * MS)
            .unwrap();
        assert!(
            w >= 5 * MS,
            "a window of {w} ns releases inside every request"
        );
    }

    #[test]
    fn too_few_gaps_or_too_little_support_keep_the_fixed_window() {
        let cfg = Adaptive::default();
        assert_eq!(model(&[50 * MS; 19]).window(&cfg, MS, 100 * MS), None);
        assert!(model(&[50 * MS; 20]).window(&cfg, MS, 100 * MS).is_some());
        // 20 gaps, only 5 of them long: the long ones cannot be judged.
        let mut g = vec![MS / 10; 15];
        g.extend([500 * MS; 5]);
        assert_eq!(model(&g).window(&cfg, MS, 100 * MS), None);
    }

    #[test]
    fn memory_keeps_the_most_recent_gaps() {
        let mut m = GapModel::default();
        for i in 0..10 {
            m.record(i, 4);
        }
        assert_eq!((m.len(), m.seen()), (4, 10));
        assert_eq!(m.gaps.iter().copied().collect::<Vec<_>>(), [6, 7, 8, 9]);
    }

    proptest! {
        // A failing case is printed, never written into the tree.
        #![proptest_config(ProptestConfig {
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        /// A learned window is never under the floor nor at or over the ceiling, never
        /// before `min_gaps` gaps, and the rule holds for it: the gaps it would release in
        /// pay `ratio` × `drain`.
        #[test]
        fn a_window_respects_its_bounds_and_its_rule(
            gaps in proptest::collection::vec(0u64..200 * MS, 0..80),
            drain in 0u64..20 * MS,
            floor in 1u64..10 * MS,
        ) {
            let cfg = Adaptive { floor, ..Adaptive::default() };
            let m = model(&gaps);
            if let Some(w) = m.window(&cfg, drain, 100 * MS) {
                prop_assert!(w >= floor && w < 100 * MS);
                prop_assert!(gaps.len() >= cfg.min_gaps);
                let long: Vec<u64> = gaps.iter().copied().filter(|&g| g > w).collect();
                prop_assert!(long.len() >= cfg.min_support);
                let harvest: u128 = long.iter().map(|&g| (g - w) as u128).sum();
                prop_assert!(harvest >= cfg.ratio as u128 * drain as u128 * long.len() as u128);
            }
        }

        /// A longer drain never gives a shorter window (nor a window where there was none).
        #[test]
        fn a_longer_drain_never_shortens_the_window(
            gaps in proptest::collection::vec(0u64..200 * MS, 20..80),
            d1 in 0u64..10 * MS,
            extra in 0u64..10 * MS,
        ) {
            let cfg = Adaptive::default();
            let m = model(&gaps);
            if let Some(w2) = m.window(&cfg, d1 + extra, 100 * MS) {
                let w1 = m.window(&cfg, d1, 100 * MS);
                prop_assert!(w1.is_some_and(|w1| w1 <= w2), "{w1:?} > {w2}");
            }
        }
    }
}
