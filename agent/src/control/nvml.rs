//! NVML in the controller: when the driver's samples and process lists are read, what a
//! sample says (a sampled period, its onset), where a round of reads stands, and what is
//! history (samples from before a fail-open).

use crate::control::model::gpu;
use crate::control::table::{Activity, Table};
use qos_core::Signal;
use std::collections::BTreeMap;

/// A sample at least this busy (%) says the work ran through the end of its period.
const FULL_PERIOD_UTIL: u32 = 95;

/// How long after a sampled period ends its samples are read, ns. The driver writes the
/// samples of a period at its end: on an H100 with driver 580 they were visible 0.65 ms
/// (p50) and 2.8 ms (p99) after their timestamp (`coloc-bench --nvml-probe`).
pub const READ_LAG_NS: u64 = 5_000_000;

pub use crate::control::model::gpu::Refresh;

/// The NVML bookkeeping of the controller.
#[derive(Debug)]
pub struct Sampling {
    gpus: Vec<u32>,
    interval_ns: u64,
    process_interval_ns: u64,
    period_ns: u64,
    window_ns: u64,
    /// Newest sample timestamp seen per GPU (µs, NVML's `lastSeenTimeStamp`).
    last_seen_us: BTreeMap<u32, u64>,
    /// When the driver's samples were last read, per GPU (a successful read).
    sampled_at: BTreeMap<u32, u64>,
    /// Samples at or before this time are ignored (after a fail-open), per GPU.
    blind_until: BTreeMap<u32, u64>,
    /// When each GPU's samples are next read. A GPU whose driver's period is known (a
    /// sample's timestamp gives its phase) and longer than `--nvml-interval` is read
    /// [`READ_LAG_NS`] after each period ends, when its samples are there, and not in
    /// between: reading sooner finds nothing new (and a read costs ~2 ms on an H100).
    next_read: BTreeMap<u32, u64>,
    /// When the process lists are next read.
    next_refresh_ns: u64,
    /// Something asked for the process lists to be read at the next tick (and why).
    pub(crate) asked: Option<Refresh>,
    /// The GPUs whose NVML calls ran this tick, and those that failed (with the error).
    called: Vec<u32>,
    failed: BTreeMap<u32, String>,
}

impl Sampling {
    /// Samples of `gpus` read every `interval`, lists every `process_interval`; a sample
    /// covers the `period` before its timestamp; runs end after `window`.
    pub fn new(
        gpus: Vec<u32>,
        interval: u64,
        process_interval: u64,
        period: u64,
        window: u64,
    ) -> Self {
        Sampling {
            gpus,
            interval_ns: interval,
            process_interval_ns: process_interval,
            period_ns: period,
            window_ns: window,
            last_seen_us: BTreeMap::new(),
            sampled_at: BTreeMap::new(),
            blind_until: BTreeMap::new(),
            next_read: BTreeMap::new(),
            next_refresh_ns: 0,
            asked: None,
            called: Vec::new(),
            failed: BTreeMap::new(),
        }
    }

    /// A tick starts: nothing called yet.
    pub fn start_tick(&mut self) {
        self.called.clear();
        self.failed.clear();
    }

    /// The GPUs whose samples are due at `now`, each with the newest timestamp seen (µs).
    pub fn samples_due(&self, now: u64) -> Option<Vec<(u32, u64)>> {
        let due: Vec<(u32, u64)> = self
            .gpus
            .iter()
            .filter(|g| self.next_read.get(g).is_none_or(|t| now >= *t))
            .map(|g| (*g, self.last_seen_us.get(g).copied().unwrap_or(0)))
            .collect();
        (!due.is_empty()).then_some(due)
    }

    /// When `gpu`'s samples are next read after a read at `now`: [`READ_LAG_NS`] after the
    /// next end of its driver's period (phase from its newest sample) when that period is
    /// known and longer than the interval; else `now` + `--nvml-interval`.
    fn schedule(&self, gpu: u32, now: u64) -> u64 {
        let plain = now + self.interval_ns;
        let Some(ts) = self.last_seen_us.get(&gpu).map(|us| us * 1000) else {
            return plain;
        };
        if !self.aligned(gpu) {
            return plain;
        }
        // The first period end whose read time is still ahead.
        let lag = self.lag_ns();
        let behind = now.saturating_sub(ts + lag);
        let k = behind / self.period_ns + 1;
        ts + k * self.period_ns + lag
    }

    /// [`READ_LAG_NS`], or a quarter period if that is shorter.
    fn lag_ns(&self) -> u64 {
        READ_LAG_NS.min(self.period_ns / 4)
    }

    /// Whether `gpu`'s reads follow its driver's periods (see [`Sampling::schedule`]): its
    /// period is longer than `--nvml-interval` (the controller's tests read at every tick,
    /// with an interval of 0) and a sample gave its phase.
    pub fn aligned(&self, gpu: u32) -> bool {
        self.interval_ns > 0
            && self.period_ns > self.interval_ns
            && self.last_seen_us.get(&gpu).is_some_and(|t| *t > 0)
    }

    /// How long past the end of the period after a busy sample a read must be to show
    /// that no new sample came: [`READ_LAG_NS`] when reads follow the driver's periods,
    /// else a quarter period (a read at any time may come just before the driver
    /// writes).
    pub fn busy_margin(&self, gpu: u32) -> u64 {
        if self.aligned(gpu) {
            self.lag_ns()
        } else {
            self.period_ns / 4
        }
    }

    /// Why the lists must be read now, if they must (`stale`: the pod source changed).
    pub fn list_due(&self, now: u64, stale: bool) -> Option<Refresh> {
        if stale {
            Some(Refresh::PodSource)
        } else if let Some(why) = self.asked {
            Some(why)
        } else if now >= self.next_refresh_ns {
            Some(Refresh::Interval)
        } else {
            None
        }
    }

    /// The samples read: notes them in the table; returns those of PIDs the table does
    /// not know (kept until the lists are read). `yielded`: a doorbell rang and the round
    /// stopped after these GPUs (the others stay due).
    pub fn samples(
        &mut self,
        read: Vec<(u32, Result<Vec<gpu::Activity>, String>)>,
        _yielded: bool,
        now: u64,
        table: &mut Table,
        degraded: impl Fn(u32) -> bool,
    ) -> Vec<(u32, u32, Activity)> {
        let mut unknown = Vec::new();
        for (gpu, result) in read {
            self.called.push(gpu);
            let samples = match result {
                Ok(s) => s,
                Err(e) => {
                    self.failed.insert(gpu, e);
                    self.next_read.insert(gpu, now + self.interval_ns);
                    continue;
                }
            };
            self.sampled_at.insert(gpu, now);
            if degraded(gpu) {
                // Answers again after failing open: what the driver buffered meanwhile is
                // history, not the start of a busy period.
                self.blind_until.insert(gpu, now);
            }
            let blind = self.blind(gpu);
            for a in samples {
                let seen = self.last_seen_us.entry(gpu).or_insert(0);
                *seen = (*seen).max(a.at_ns / 1000);
                if a.at_ns <= blind {
                    continue;
                }
                // A sample covers the period that ends at its timestamp: the work started
                // no earlier than the period's start (the onset). Busy for (nearly) all of
                // it: still running at its end (see `Entry::note`).
                let act = Activity {
                    start: a.at_ns.saturating_sub(self.period_ns).max(blind),
                    end: a.at_ns,
                    through_end: a.sm_util >= FULL_PERIOD_UTIL,
                    signal: Signal::Nvml,
                    window: self.window_ns,
                };
                if !table.note_sample(gpu, a.pid, act) {
                    unknown.push((gpu, a.pid, act));
                }
            }
            let next = self.schedule(gpu, now);
            self.next_read.insert(gpu, next);
        }
        unknown
    }

    /// The lists are read now, for `why`; `failed`: the GPUs whose listing failed.
    pub fn listed(&mut self, now: u64, failed: &BTreeMap<u32, String>) {
        self.asked = None;
        self.next_refresh_ns = now + self.process_interval_ns;
        for g in &self.gpus {
            if !self.called.contains(g) {
                self.called.push(*g);
            }
        }
        for (g, e) in failed {
            self.failed.entry(*g).or_insert_with(|| e.clone());
        }
    }

    /// Whether an NVML call ran this tick.
    pub fn called_any(&self) -> bool {
        !self.called.is_empty()
    }

    /// This tick's verdict material: per GPU called, its error if it failed.
    pub fn results(&self) -> Vec<(u32, Option<String>)> {
        self.gpus
            .iter()
            .filter(|g| self.called.contains(g))
            .map(|g| (*g, self.failed.get(g).cloned()))
            .collect()
    }

    /// Samples at or before this time are history on `gpu`.
    pub fn blind(&self, gpu: u32) -> u64 {
        self.blind_until.get(&gpu).copied().unwrap_or(0)
    }

    /// Every sample so far is history (the watchdog resumed everything).
    pub fn blind_all(&mut self, now: u64) {
        for g in &self.gpus {
            self.blind_until.insert(*g, now);
        }
    }

    /// When the latest read of `gpu`'s samples was.
    pub fn sampled_at(&self, gpu: u32) -> u64 {
        self.sampled_at.get(&gpu).copied().unwrap_or(0)
    }

    /// The driver's sample period, ns.
    pub fn period_ns(&self) -> u64 {
        self.period_ns
    }

    /// When the samples are next read, and the lists.
    pub fn next_reads(&self) -> (u64, u64) {
        let next = self.next_read.values().copied().min().unwrap_or(0);
        let next = if self.next_read.len() < self.gpus.len() {
            0
        } else {
            next
        };
        (next, self.next_refresh_ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn sampling() -> Sampling {
        Sampling::new(vec![0, 1], 100 * MS, 1000 * MS, 200 * MS, 100 * MS)
    }

    fn sample(at_ns: u64) -> Vec<gpu::Activity> {
        vec![gpu::Activity {
            pid: 7,
            at_ns,
            sm_util: 30,
        }]
    }

    /// A GPU whose driver period is known is read 5 ms after each period ends (and not
    /// at the interval in between); one without a sample yet, at the interval.
    #[test]
    fn reads_follow_the_drivers_periods_once_a_sample_gives_their_phase() {
        let mut s = sampling();
        let mut table = Table::default();
        let t0 = 10_000 * MS;
        assert_eq!(s.samples_due(t0).map(|d| d.len()), Some(2));
        // GPU 0's sample stamps a period end at t0 - 30 ms; GPU 1 has none.
        s.samples(
            vec![(0, Ok(sample(t0 - 30 * MS))), (1, Ok(Vec::new()))],
            false,
            t0,
            &mut table,
            |_| false,
        );
        assert!(s.aligned(0) && !s.aligned(1));
        assert_eq!(s.next_read[&0], t0 - 30 * MS + 200 * MS + READ_LAG_NS);
        assert_eq!(s.next_read[&1], t0 + 100 * MS);
        assert_eq!(s.samples_due(t0 + 100 * MS), Some(vec![(1, 0)]));
        assert_eq!(s.busy_margin(0), READ_LAG_NS);
        assert_eq!(
            s.busy_margin(1),
            50 * MS,
            "a quarter period where not aligned"
        );
        // No new sample at the next period's end (idle): the one after is next.
        let at = t0 + 175 * MS;
        s.samples(vec![(0, Ok(Vec::new()))], false, at, &mut table, |_| false);
        assert_eq!(s.next_read[&0], t0 - 30 * MS + 400 * MS + READ_LAG_NS);
        // A failed read is tried again at the interval.
        s.samples(vec![(0, Err("x".into()))], false, at, &mut table, |_| false);
        assert_eq!(s.next_read[&0], at + 100 * MS);
    }

    /// A period no longer than the interval: reads at the interval, as before.
    #[test]
    fn a_period_within_the_interval_is_read_at_the_interval() {
        let mut s = Sampling::new(vec![0], 100 * MS, 1000 * MS, 100 * MS, 100 * MS);
        let mut table = Table::default();
        let t0 = 10_000 * MS;
        s.samples(
            vec![(0, Ok(sample(t0 - 30 * MS)))],
            false,
            t0,
            &mut table,
            |_| false,
        );
        assert!(!s.aligned(0));
        assert_eq!(s.next_read[&0], t0 + 100 * MS);
    }
}
