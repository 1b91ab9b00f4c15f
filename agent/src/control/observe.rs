//! Observation: samples and process lists from NVML, and what their failures mean
//! (the health policy, the watchdog's aftermath).

use super::events::{Event, FailOpen};
use super::health::Verdict;
use super::table::Activity;
use super::Loop;
use qos_core::Signal;

/// A sample at least this busy (%) says the work ran through the end of its period.
const FULL_PERIOD_UTIL: u32 = 95;
use std::collections::{BTreeMap, BTreeSet};
use tracing::{error, info, warn};

/// Why the process lists are read now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Refresh {
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
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Refresh::UnknownPid => "unknown_pid",
            Refresh::PodSource => "pod_source",
            Refresh::Doorbell => "doorbell",
            Refresh::Interval => "interval",
        }
    }
}

impl Loop {
    /// Reads, when due, the samples and the process lists of every GPU. Returns the GPUs
    /// whose calls failed this tick, with the reason; `None` when no NVML call was due.
    pub(super) fn observe(&mut self, now: u64) -> Option<BTreeMap<u32, String>> {
        let samples_due = now >= self.next_nvml_ns;
        let list_due = self.list_due(now);
        if !samples_due && list_due.is_none() {
            return None;
        }
        let mut failed = BTreeMap::new();
        let mut unknown: Vec<(u32, u32, Activity)> = Vec::new();
        let mut samples = std::mem::take(&mut self.scratch);
        self.called.clear();
        if samples_due && self.read_samples(&mut samples, &mut failed, &mut unknown, now) {
            self.next_nvml_ns = now + self.cfg.nvml_interval.as_nanos() as u64;
        }
        self.scratch = samples;
        let generation = self.classifier.source.generation();
        let why = if !unknown.is_empty() {
            Some(Refresh::UnknownPid)
        } else {
            self.list_due(now)
        };
        if let Some(why) = why {
            self.refresh_asked = None;
            metrics::counter!("coloc_process_list_refreshes_total", "why" => why.as_str())
                .increment(1);
            self.next_refresh_ns = now + self.cfg.process_interval.as_nanos() as u64;
            let mut listed: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::new();
            let mut list_failed = BTreeSet::new();
            for i in 0..self.gpus.len() {
                let gpu = self.gpus[i];
                if !self.called.contains(&gpu) {
                    self.called.push(gpu);
                }
                match self.gpu.processes(gpu) {
                    Ok(pids) => {
                        for pid in pids {
                            listed.entry(pid).or_default().insert(gpu);
                        }
                    }
                    Err(err) => {
                        metrics::counter!("coloc_nvml_errors_total", "gpu" => gpu.to_string(), "reason" => err.reason()).increment(1);
                        list_failed.insert(gpu);
                        failed.entry(gpu).or_insert_with(|| err.to_string());
                    }
                }
            }
            self.table
                .refresh(&listed, &list_failed, generation, now, &self.classifier);
            for (gpu, pid, act) in unknown {
                self.table.note_sample(gpu, pid, act);
            }
        }
        Some(failed)
    }

    /// Reads every GPU's per-process samples since the newest one seen, notes them in the
    /// table; PIDs the table does not know go to `unknown`, failures to `failed`.
    fn read_samples(
        &mut self,
        samples: &mut Vec<crate::edges::gpu::Activity>,
        failed: &mut BTreeMap<u32, String>,
        unknown: &mut Vec<(u32, u32, Activity)>,
        now: u64,
    ) -> bool {
        let period = self.cfg.nvml_sample_period.as_nanos() as u64;
        let window = self.cfg.machine.idle_window;
        for i in self.nvml_cursor..self.gpus.len() {
            // A launch rang while this round of NVML calls runs: the loop decides first,
            // and the round goes on from here at the next tick (a doorbell never waits
            // behind more than one GPU's calls).
            if i > self.nvml_cursor && self.bells.rang() {
                metrics::counter!("coloc_nvml_rounds_yielded_total").increment(1);
                self.nvml_cursor = i;
                return false;
            }
            let gpu = self.gpus[i];
            self.called.push(gpu);
            let since = self.last_seen_us.get(&gpu).copied().unwrap_or(0);
            samples.clear();
            match self.gpu.samples(gpu, since, samples) {
                Ok(()) => {
                    self.sampled_at.insert(gpu, now);
                    if self.health.degraded(gpu) {
                        // Answers again after failing open: what the driver buffered
                        // meanwhile is history, not the start of a busy period.
                        self.blind_until.insert(gpu, now);
                    }
                    let blind = self.blind_until.get(&gpu).copied().unwrap_or(0);
                    for a in samples.iter().copied() {
                        let seen = self.last_seen_us.entry(gpu).or_insert(0);
                        *seen = (*seen).max(a.at_ns / 1000);
                        if a.at_ns <= blind {
                            continue;
                        }
                        // A sample covers the period that ends at its timestamp: the work
                        // started no earlier than the period's start (the onset). Busy for
                        // (nearly) all of it: still running at its end (see `Entry::note`).
                        let act = Activity {
                            start: a.at_ns.saturating_sub(period).max(blind),
                            end: a.at_ns,
                            through_end: a.sm_util >= FULL_PERIOD_UTIL,
                            signal: Signal::Nvml,
                            window,
                        };
                        if !self.table.note_sample(gpu, a.pid, act) {
                            unknown.push((gpu, a.pid, act));
                        }
                    }
                }
                Err(err) => {
                    metrics::counter!("coloc_nvml_errors_total", "gpu" => gpu.to_string(), "reason" => err.reason()).increment(1);
                    failed.insert(gpu, err.to_string());
                }
            }
        }
        self.nvml_cursor = 0;
        true
    }

    /// Why the process lists must be read now, if they must.
    fn list_due(&self, now: u64) -> Option<Refresh> {
        if self.table.stale(self.classifier.source.generation()) {
            Some(Refresh::PodSource)
        } else if let Some(why) = self.refresh_asked {
            Some(why)
        } else if now >= self.next_refresh_ns {
            Some(Refresh::Interval)
        } else {
            None
        }
    }

    /// Applies the health policy to this tick's failures.
    pub(super) fn judge(&mut self, failed: BTreeMap<u32, String>, now: u64) {
        for i in 0..self.gpus.len() {
            let gpu = self.gpus[i];
            // Only the GPUs whose NVML calls ran this tick are judged.
            if !self.called.contains(&gpu) {
                continue;
            }
            let verdict = match failed.get(&gpu) {
                None => self.health.ok(gpu),
                Some(err) => self.health.failed(gpu, now, err.clone()),
            };
            match verdict {
                Verdict::Healthy | Verdict::StillDegraded => {}
                Verdict::Transient => {
                    warn!(gpu, error = %failed[&gpu], "NVML call failed; keeping this GPU's decisions until the failure persists");
                }
                Verdict::FailOpen => {
                    error!(gpu, error = %failed[&gpu], grace = ?self.cfg.nvml_grace, "NVML keeps failing for this GPU: failing open, resuming its offline work; other GPUs stay managed");
                    metrics::counter!("coloc_fail_open_total", "reason" => "nvml").increment(1);
                    let resumed = self.suspended_on(gpu);
                    self.telemetry.emit(Event::FailOpen(FailOpen {
                        at_ns: now,
                        reason: "nvml".into(),
                        gpu: Some(gpu),
                        resumed,
                    }));
                    self.table.clear_activity(Some(gpu));
                }
                Verdict::Recovered => {
                    info!(gpu, "NVML answers again for this GPU: managing it again");
                }
            }
            if let Some(m) = self.telemetry.gpus.get(&gpu) {
                m.set_degraded(self.health.degraded(gpu));
            }
        }
        let why = self.health.describe();
        if self.shared.set_degraded(why.clone()) && why.is_none() {
            info!("NVML answers again on every GPU: resuming normal operation");
        }
    }

    /// The watchdog resumed everything while the loop was stuck in NVML: forget the
    /// decisions and the samples from before, and report when the call came back.
    pub(super) fn after_watchdog(&mut self, now: u64) {
        self.machine.release_all();
        // The watchdog resumed every hold through the hands and cleared the record: the
        // events that waited for those holds end unconfirmed.
        self.book.forget_all();
        for ev in self.tracker.abandon() {
            self.telemetry.emit(ev);
        }
        self.table.clear_activity(None);
        for g in &self.gpus {
            self.blind_until.insert(*g, now);
        }
        self.telemetry.emit(Event::FailOpen(FailOpen {
            at_ns: now,
            reason: "nvml_hung".into(),
            gpu: None,
            resumed: 0,
        }));
        self.shared.set_degraded(self.health.describe());
        info!("The hung NVML call returned: managing offline work again");
    }
}
