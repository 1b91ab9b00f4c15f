//! The learned release window (`--release learned`): which GPUs may release before the
//! fixed idle window, and after how long. The rule for one online process is
//! `qos_core::release` (its own idle gaps pay `ratio` × the drain of a wrong release);
//! this room keeps each online process's gaps per GPU, from its doorbell, and says per
//! GPU whether a learned window applies.
//!
//! A GPU gets a learned window only when all of these hold (else the fixed window):
//! - every process there that counts as online demand rings a doorbell attributed to it,
//!   with a wake gap no longer than the floor (so a launch after any gap the window
//!   could release in wakes the agent at once), says when its work was last complete
//!   (its page's completion stamp), was complete then (no launch since), and has a
//!   learned window of its own: the GPU's window is the longest of them;
//! - every offline process there sits behind a launch gate for that GPU (the gate bounds
//!   what a wrong release costs: the drain, `--release-drain`);
//! - no online work there is seen through NVML alone.
//!
//! With `--release at-once` the window is 0 under the same conditions, with no gaps to
//! learn: offline resumes at the first tick that sees every online process's work
//! stamped complete (within one `--poll-interval` of the stamp while the agent awaits it).
//!
//! A gap is the time from a completion stamp to the first launch after it (the page's
//! run start), counted when the stamp came after the previous launch. What the online
//! process writes is its own word: it can only bring offline work beside itself sooner
//! or later (SECURITY.md).

use crate::control::model::ProcKey;
use qos_core::release::{Adaptive, GapModel};
use std::collections::HashMap;

/// The learned policy's settings (`--release learned`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Learning {
    /// The rule's parameters (floor, ratio, gaps needed).
    pub adaptive: Adaptive,
    /// What a wrong release costs online at most, ns: the offline processes' in-flight
    /// budget behind their gate (`COLOC_SHIM_INFLIGHT_MS`).
    pub drain_ns: u64,
    /// `--release at-once`: where the conditions hold, release as soon as every online
    /// process's work is seen complete (window 0), with no gaps to learn first: with
    /// random arrivals the time since the last request says nothing about the next one,
    /// so no window beats releasing at once, and the gate bounds what it costs.
    pub at_once: bool,
}

#[derive(Debug, Default)]
struct Track {
    /// Latest launch seen, ns.
    last: u64,
    /// Latest completion stamp seen, ns.
    drained: u64,
    /// The page's wake gap is no longer than the floor.
    wakes: bool,
    model: GapModel,
}

/// See the module.
#[derive(Debug, Default)]
pub struct Learner {
    cfg: Option<Learning>,
    ceiling: u64,
    tracks: HashMap<(ProcKey, u32), Track>,
}

impl Learner {
    /// Learning with `cfg` (`None`: the fixed window everywhere), under the idle window.
    pub fn new(cfg: Option<Learning>, idle_window: u64) -> Learner {
        Learner {
            cfg,
            ceiling: idle_window,
            tracks: HashMap::new(),
        }
    }

    /// The settings, when learning.
    pub fn settings(&self) -> Option<&Learning> {
        self.cfg.as_ref()
    }

    /// A reading attributed to online process `key` on `gpu`: its latest launch, the start
    /// of its current run, its completion stamp (0: none) and its page's wake gap. Returns
    /// the end of its latest activity as the learned policy counts it: the completion
    /// stamp when it is later than the latest launch (the work was seen complete then) and
    /// the page wakes the agent within the floor, else the launch.
    pub fn observe(
        &mut self,
        key: ProcKey,
        gpu: u32,
        (last, since, drained): (u64, u64, u64),
        wake_gap_ns: u64,
    ) -> u64 {
        let Some(cfg) = self.cfg else {
            return last;
        };
        let t = self.tracks.entry((key, gpu)).or_default();
        t.wakes = wake_gap_ns <= cfg.adaptive.floor;
        if last > t.last {
            if t.last > 0 && t.drained >= t.last {
                // The previous work was complete at `t.drained`; this run began at `since`
                // (a start at or before the stamp: a gap under the page's wake gap).
                t.model
                    .record(since.saturating_sub(t.drained), cfg.adaptive.memory);
            }
            t.last = last;
        }
        t.drained = t.drained.max(drained);
        // Only a page set up for the learned window (waking within the floor) moves the
        // end to the stamp: elsewhere the idle window counts from the launch, as without
        // the policy.
        if t.wakes && t.drained >= t.last {
            t.drained
        } else {
            last
        }
    }

    /// The window of `gpu` (`None`: the fixed window): [`Learner::window`] of its
    /// online-demand processes `online`, only where every offline process there is gated
    /// (`offline_gated`) and no work there is seen through NVML alone (`sampled_busy`: a
    /// sample shows a process busy that no doorbell speaks for).
    pub fn gpu_window(
        &self,
        gpu: u32,
        online: &[ProcKey],
        offline_gated: bool,
        sampled_busy: bool,
    ) -> Option<u64> {
        if !offline_gated || sampled_busy {
            return None;
        }
        self.window(gpu, online)
    }

    /// Forgets the processes `alive` does not know.
    pub fn retain(&mut self, alive: impl Fn(&ProcKey) -> bool) {
        self.tracks.retain(|(k, _), _| alive(k));
    }

    /// The learned window of `gpu` whose online-demand processes are `online`, each with
    /// whether a doorbell page counts for it there; `None`: the fixed window. The caller
    /// has checked the offline side (every offline process gated).
    pub fn window(&self, gpu: u32, online: &[ProcKey]) -> Option<u64> {
        let cfg = self.cfg?;
        let mut w = None;
        for k in online {
            let t = self.tracks.get(&(*k, gpu))?;
            if !t.wakes || t.last == 0 || t.drained < t.last {
                return None;
            }
            let mine = if cfg.at_once {
                0
            } else {
                t.model.window(&cfg.adaptive, cfg.drain_ns, self.ceiling)?
            };
            w = Some(w.map_or(mine, |x: u64| x.max(mine)));
        }
        w
    }

    /// Whether an online process on `gpu` that a learned window may apply to has work not
    /// yet stamped complete: the stamp does not wake the agent, so the loop looks at the
    /// pages every `--poll-interval` until it comes (the window counts from it).
    pub fn awaits_stamp(&self, gpu: u32) -> bool {
        let Some(cfg) = &self.cfg else {
            return false;
        };
        self.tracks.iter().any(|((_, g), t)| {
            *g == gpu
                && t.wakes
                && (cfg.at_once || t.model.len() >= cfg.adaptive.min_gaps)
                && t.drained < t.last
        })
    }
}

/// Views the tests read.
#[cfg(test)]
impl Learner {
    /// The shortest window the machine may be given: 0 with `at_once`, else the floor.
    pub fn floor(&self) -> Option<u64> {
        self.cfg
            .map(|c| if c.at_once { 0 } else { c.adaptive.floor })
    }

    /// Gaps recorded for `key` on `gpu`.
    pub fn gaps(&self, key: &ProcKey, gpu: u32) -> u64 {
        self.tracks.get(&(*key, gpu)).map_or(0, |t| t.model.seen())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use qos_core::MS;

    const T0: u64 = 1_000_000_000_000;

    fn learner() -> Learner {
        Learner::new(
            Some(Learning {
                adaptive: Adaptive::default(),
                drain_ns: 2 * MS,
                at_once: false,
            }),
            100 * MS,
        )
    }

    fn at_once() -> Learner {
        Learner::new(
            Some(Learning {
                adaptive: Adaptive::default(),
                drain_ns: MS / 2,
                at_once: true,
            }),
            100 * MS,
        )
    }

    #[test]
    fn at_once_releases_at_the_stamp_without_gaps_to_learn() {
        let mut l = at_once();
        assert_eq!(l.floor(), Some(0));
        assert_eq!(learner().floor(), Some(2 * MS));
        // Never seen: no window.
        assert_eq!(l.window(0, &[key(1)]), None);
        let end = serve(&mut l, key(1), 1, MS);
        assert_eq!(end, T0 + 20 * MS, "activity ends at the stamp");
        assert_eq!(l.window(0, &[key(1)]), Some(0), "one request is enough");
        assert!(!l.awaits_stamp(0));
        // The next request launches: outstanding until stamped.
        let t = T0 + 50 * MS;
        l.observe(key(1), 0, (t, t, 0), MS);
        assert_eq!(l.window(0, &[key(1)]), None);
        assert!(l.awaits_stamp(0), "the loop looks for the stamp");
        l.observe(key(1), 0, (t, t, t + MS), MS);
        assert_eq!(l.window(0, &[key(1)]), Some(0));
        // Gated and no NVML-only work: the window; otherwise the fixed one.
        assert_eq!(l.gpu_window(0, &[key(1)], true, false), Some(0));
        assert_eq!(l.gpu_window(0, &[key(1)], false, false), None);
        assert_eq!(l.gpu_window(0, &[key(1)], true, true), None);
        // A second online process with no doorbell (seen through NVML alone): none.
        assert_eq!(l.gpu_window(0, &[key(1), key(2)], true, false), None);
        // A page that would not wake the agent after a short gap: none.
        let mut l = at_once();
        serve(&mut l, key(1), 1, 100 * MS);
        assert_eq!(l.window(0, &[key(1)]), None);
    }

    fn key(pid: u32) -> ProcKey {
        ProcKey { pid, start: 1 }
    }

    /// Requests of 20 ms of work, 50 ms apart: launch at the start, stamp at the end.
    fn serve(l: &mut Learner, k: ProcKey, n: u64, wake_gap: u64) -> u64 {
        let mut end = 0;
        for i in 0..n {
            let start = T0 + i * 50 * MS;
            l.observe(k, 0, (start + MS / 10, start, 0), wake_gap);
            end = l.observe(k, 0, (start + MS / 10, start, start + 20 * MS), wake_gap);
        }
        end
    }

    #[test]
    fn gaps_are_learned_from_completion_to_the_next_run() {
        let mut l = learner();
        let end = serve(&mut l, key(1), 25, 2 * MS);
        assert_eq!(
            end,
            T0 + 24 * 50 * MS + 20 * MS,
            "activity ends at the stamp"
        );
        assert_eq!(l.gaps(&key(1), 0), 24);
        assert_eq!(l.window(0, &[key(1)]), Some(2 * MS));
        // Another GPU, or a process with no gaps, keeps the fixed window.
        assert_eq!(l.window(1, &[key(1)]), None);
        assert_eq!(l.window(0, &[key(1), key(2)]), None);
    }

    #[test]
    fn no_window_without_stamps_a_short_wake_gap_or_while_work_is_outstanding() {
        let mut l = learner();
        // Launches without stamps: no gap is ever learned.
        for i in 0..40 {
            l.observe(key(1), 0, (T0 + i * 50 * MS, T0 + i * 50 * MS, 0), 2 * MS);
        }
        assert_eq!((l.gaps(&key(1), 0), l.window(0, &[key(1)])), (0, None));
        // A page whose wake gap is the default 100 ms: a launch 40 ms into a gap would not
        // wake the agent.
        let mut l = learner();
        serve(&mut l, key(1), 25, 100 * MS);
        assert_eq!(l.window(0, &[key(1)]), None);
        // Learned, then a launch not yet stamped complete: no window until it is.
        let mut l = learner();
        serve(&mut l, key(1), 25, 2 * MS);
        let t = T0 + 25 * 50 * MS;
        assert_eq!(l.observe(key(1), 0, (t, t, 0), 2 * MS), t);
        assert_eq!(l.window(0, &[key(1)]), None);
        l.observe(key(1), 0, (t, t, t + 20 * MS), 2 * MS);
        assert_eq!(l.window(0, &[key(1)]), Some(2 * MS));
    }

    proptest::proptest! {
        // A failing case is printed, never written into the tree.
        #![proptest_config(proptest::prelude::ProptestConfig {
            failure_persistence: None,
            ..Default::default()
        })]

        /// Over random readings (launches, run starts, stamps, wake gaps): a window is
        /// never under the floor nor at the idle window, and there is none while a
        /// process's latest launch is not stamped complete or its page would not wake the
        /// agent after a gap the window could release in.
        #[test]
        fn a_window_needs_complete_work_and_a_page_that_wakes(
            steps in proptest::collection::vec((0u64..80, 0u64..40, proptest::option::of(0u64..60), proptest::bool::ANY, 0u8..2), 1..120),
        ) {
            let mut l = learner();
            let mut now = T0;
            let mut seen: [(u64, u64, u64); 2] = [(0, 0, 0); 2];
            for (adv, since_back, drain_after, short_wake, who) in steps {
                now += adv * MS / 4;
                let k = key(u32::from(who));
                let (last, since) = (now, now - since_back.min(adv) * MS / 8);
                let drained = drain_after.map_or(0, |d| now + d * MS / 4);
                let wake = if short_wake { MS } else { 100 * MS };
                l.observe(k, 0, (last, since, drained), wake);
                let s = &mut seen[usize::from(who)];
                *s = (s.0.max(last), s.1.max(drained), wake);
                if let Some(w) = l.window(0, &[k]) {
                    proptest::prop_assert!((2 * MS..100 * MS).contains(&w), "{}", w);
                    proptest::prop_assert!(s.1 >= s.0, "a window while work was outstanding");
                    proptest::prop_assert!(s.2 <= 2 * MS, "a window for a page that would not wake");
                }
            }
        }
    }

    proptest::proptest! {
        /// `--release at-once` over random readings of two online processes (launches,
        /// stamps, wake gaps), one of which may have no doorbell at all (seen through NVML
        /// alone), the offline side gated or not, NVML showing unattributed work or not: a
        /// window (0) only where every online process's latest launch is stamped complete
        /// and its page wakes the agent, every offline process is gated, nothing is seen
        /// through NVML alone; never while a doorbell shows work outstanding.
        #[test]
        fn at_once_never_releases_beside_outstanding_or_unseen_work(
            steps in proptest::collection::vec((0u64..80, proptest::option::of(0u64..60), proptest::bool::ANY, 0u8..2, proptest::bool::ANY, proptest::bool::ANY), 1..120),
            second_has_doorbell in proptest::bool::ANY,
        ) {
            let mut l = at_once();
            let mut now = T0;
            let mut seen: [(u64, u64, u64); 2] = [(0, 0, 0); 2];
            let online = [key(0), key(1)];
            for (adv, drain_after, short_wake, who, gated, sampled_busy) in steps {
                now += adv * MS / 4;
                if who == 1 && !second_has_doorbell {
                    continue;
                }
                let k = key(u32::from(who));
                let drained = drain_after.map_or(0, |d| now + d * MS / 4);
                let wake = if short_wake { MS } else { 100 * MS };
                l.observe(k, 0, (now, now, drained), wake);
                let s = &mut seen[usize::from(who)];
                *s = (s.0.max(now), s.1.max(drained), wake);
                if let Some(w) = l.gpu_window(0, &online, gated, sampled_busy) {
                    proptest::prop_assert_eq!(w, 0);
                    proptest::prop_assert!(gated && !sampled_busy);
                    proptest::prop_assert!(second_has_doorbell, "a window beside a process seen through NVML alone");
                    for s in &seen {
                        proptest::prop_assert!(s.0 > 0 && s.1 >= s.0, "a window while work was outstanding");
                        proptest::prop_assert!(s.2 <= 2 * MS, "a window for a page that would not wake");
                    }
                }
            }
        }
    }

    #[test]
    fn off_means_the_launch_and_no_window() {
        let mut l = Learner::new(None, 100 * MS);
        assert_eq!(l.observe(key(1), 0, (T0, T0, T0 + MS), MS), T0);
        assert_eq!(l.window(0, &[key(1)]), None);
        let mut l = learner();
        serve(&mut l, key(1), 25, 2 * MS);
        l.retain(|_| false);
        assert_eq!(l.window(0, &[key(1)]), None);
    }
}
