//! What follows a decision: confirmations, broken holds, failed suspensions, and the
//! inputs the state machine reads.

use super::{holds, Loop};
use crate::edges::procfs::ProcKey;
use std::collections::BTreeMap;
use tracing::warn;

impl Loop {
    /// After the decision: confirmations that came, holds found broken, suspensions that
    /// failed (retried later), and the table purged of processes nothing refers to.
    pub(super) fn follow_holds(&mut self, now: u64) {
        self.book.poll(now);
        self.drain();
        let done = self.book.take_done();
        if !done.is_empty() {
            for ev in self.tracker.complete(&done) {
                self.telemetry.emit(ev);
            }
        }
        self.book.recheck(now);
        self.drain();
        for b in self.book.take_broken() {
            self.report_broken(b);
        }
        // Completions that came of the re-check (an escalation's freeze).
        let done = self.book.take_done();
        if !done.is_empty() {
            for ev in self.tracker.complete(&done) {
                self.telemetry.emit(ev);
            }
        }
        let failed = self.book.take_failed();
        for key in failed {
            let due = self.retries.failed(key, now);
            warn!(
                pid = key.pid,
                retry_in_ms = due.saturating_sub(now) / 1_000_000,
                "Suspension failed and was undone; retrying while online stays busy"
            );
        }
        let book = &self.book;
        let machine = &self.machine;
        let table = &self.table;
        self.retries.retain(|k| table.entry(k).is_some());
        self.table
            .purge(|k| machine.suspended().contains_key(k) || book.holds(k));
    }

    /// Something resumed held offline work: say who, count it.
    fn report_broken(&mut self, b: holds::Broken) {
        metrics::counter!("coloc_suspension_breaks_total", "actuator" => b.kind.as_str())
            .increment(1);
        let owners: Vec<String> = b
            .holders
            .iter()
            .filter_map(|k| self.table.entry(k).map(|e| e.cls.owner.clone()))
            .collect();
        if b.escalated {
            warn!(
                ?owners,
                breaks = b.breaks,
                "Offline work keeps resuming itself while suspended: its cgroup is now frozen"
            );
        } else if b.breaks == 1 || b.breaks.is_multiple_of(100) {
            warn!(
                ?owners,
                breaks = b.breaks,
                resumed = b.resumed,
                "Offline work was resumed by something else while suspended: stopped again"
            );
        }
    }

    pub(super) fn suspended_on(&self, gpu: u32) -> usize {
        self.table
            .entries()
            .filter(|e| e.gpus.contains(&gpu) && self.machine.suspended().contains_key(&e.key))
            .count()
    }

    pub(super) fn inputs(&self, managed: &[u32]) -> Vec<qos_core::GpuInput<ProcKey>> {
        let mut by_gpu: BTreeMap<u32, Vec<qos_core::ProcessObs<ProcKey>>> =
            managed.iter().map(|g| (*g, Vec::new())).collect();
        for e in self.table.entries() {
            for g in &e.gpus {
                if let Some(v) = by_gpu.get_mut(g) {
                    let onset = e.onset.get(g).copied();
                    v.push(qos_core::ProcessObs {
                        key: e.key,
                        class: e.cls.class,
                        last_active: e.last_active.get(g).copied(),
                        onset: onset.map(|o| o.0),
                        signal: onset.map_or(qos_core::Signal::Nvml, |o| o.1),
                        share: e.cls.share,
                    });
                }
            }
        }
        by_gpu
            .into_iter()
            .map(|(gpu, procs)| qos_core::GpuInput {
                gpu,
                sampled_busy: self.sampled_busy(gpu),
                procs,
            })
            .collect()
    }

    /// Whether online work on `gpu` seen only through NVML may still be busy: its latest
    /// busy sample covers the period ending at `t`, and no read of the driver's samples has
    /// happened since the next period was due (`t` + one sample period, and a quarter more
    /// for the driver to write it). Until then it counts as busy: the sample that shows the
    /// work still running may be written just after the read (at the shipped defaults, a
    /// 100 ms window and a 100 ms driver period, the release fell due exactly when the next
    /// sample was written, and a sample read just before its successor was already a window
    /// old). Processes with a doorbell page are exempt: their launches are seen as they
    /// happen.
    fn sampled_busy(&self, gpu: u32) -> bool {
        let period = self.cfg.nvml_sample_period.as_nanos() as u64;
        let read = self.sampled_at.get(&gpu).copied().unwrap_or(0);
        let unmanaged = self.cfg.machine.unmanaged_is_online;
        self.table.entries().any(|e| {
            e.gpus.contains(&gpu)
                && !e.rung
                && e.cls.class.is_online_demand(unmanaged)
                && e.last_sampled
                    .get(&gpu)
                    .is_some_and(|t| read < t + period + period / 4)
        })
    }
}
