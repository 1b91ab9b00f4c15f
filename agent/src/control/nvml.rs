//! NVML in the controller: when the driver's samples and process lists are read, what a
//! sample says (a sampled period, its onset), where a round of reads stands, and what is
//! history (samples from before a fail-open).

use crate::control::table::{Activity, Table};
use crate::edges::gpu;
use qos_core::Signal;
use std::collections::BTreeMap;

/// A sample at least this busy (%) says the work ran through the end of its period.
const FULL_PERIOD_UTIL: u32 = 95;

/// Why the process lists are read now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refresh {
    /// A sample named a PID the table does not know.
    UnknownPid,
    /// The pod source changed (a pod came, went or changed class).
    PodSource,
    /// A doorbell rang for a process the lists did not hold yet.
    Doorbell,
    /// `--process-interval` passed.
    Interval,
}

impl Refresh {
    /// Metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Refresh::UnknownPid => "unknown_pid",
            Refresh::PodSource => "pod_source",
            Refresh::Doorbell => "doorbell",
            Refresh::Interval => "interval",
        }
    }
}

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
    /// Where the current round of sample reads goes on (a doorbell interrupted it).
    cursor: usize,
    /// When NVML's samples are next read.
    next_nvml_ns: u64,
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
            cursor: 0,
            next_nvml_ns: 0,
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

    /// The GPUs whose samples are due at `now`, each with the newest timestamp seen (µs),
    /// from where the round stands.
    pub fn samples_due(&self, now: u64) -> Option<Vec<(u32, u64)>> {
        (now >= self.next_nvml_ns).then(|| {
            self.gpus[self.cursor.min(self.gpus.len())..]
                .iter()
                .map(|g| (*g, self.last_seen_us.get(g).copied().unwrap_or(0)))
                .collect()
        })
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
    /// stopped after these GPUs.
    pub fn samples(
        &mut self,
        read: Vec<(u32, Result<Vec<gpu::Activity>, String>)>,
        yielded: bool,
        now: u64,
        table: &mut Table,
        degraded: impl Fn(u32) -> bool,
    ) -> Vec<(u32, u32, Activity)> {
        let mut unknown = Vec::new();
        let n = read.len();
        for (gpu, result) in read {
            self.called.push(gpu);
            let samples = match result {
                Ok(s) => s,
                Err(e) => {
                    self.failed.insert(gpu, e);
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
        }
        if yielded {
            self.cursor += n;
        } else {
            self.cursor = 0;
            self.next_nvml_ns = now + self.interval_ns;
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
        (self.next_nvml_ns, self.next_refresh_ns)
    }
}
