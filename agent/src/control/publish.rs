//! What the loop shows: the `/state` document and the per-GPU time accounting.

use super::state::{GpuDoc, ProcDoc, StateDoc};
use super::Loop;
use qos_core::stats::Summary;
use qos_core::{Class, GpuState};

impl Loop {
    /// Per GPU, from the latest decision: online busy, offline processes, suspended ones
    /// (the time accounting and the gauges; recomputed only when the machine ran).
    pub(super) fn summarise(&mut self) {
        let mut out = std::mem::take(&mut self.summary);
        out.clear();
        for input in &self.last_inputs {
            let busy = matches!(self.machine.state(input.gpu), GpuState::OnlineBusy { .. });
            let (mut offline, mut suspended) = (0, 0);
            for p in input.procs.iter().filter(|p| p.class == Class::Offline) {
                offline += 1;
                if self.machine.suspended().contains_key(&p.key) {
                    suspended += 1;
                }
            }
            if let Some(m) = self.telemetry.gpus.get(&input.gpu) {
                m.set_busy(busy);
                m.set_suspended(suspended);
            }
            out.push(GpuSummary {
                gpu: input.gpu,
                busy,
                offline,
                suspended,
            });
        }
        self.summary = out;
    }

    /// Adds `dt_ns` to each GPU's suspended and reclaimed time.
    pub(super) fn account(&mut self, dt_ns: u64) {
        let dts = dt_ns as f64 / 1e9;
        let mut secs = self
            .shared
            .gpu_seconds
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for s in &self.summary {
            let acc = secs.entry(s.gpu).or_default();
            if s.suspended > 0 {
                acc.suspended += dts;
            }
            if !s.busy && s.offline > s.suspended {
                acc.reclaimed += dts;
            }
        }
    }

    pub(super) fn publish(&mut self, now: u64) {
        let ms_ago = |t: u64| now.saturating_sub(t) as f64 / 1e6;
        let gpus = self
            .gpus
            .iter()
            .map(|&g| {
                let state = self.machine.state(g);
                let (since, last_online) = match state {
                    GpuState::OnlineBusy { since, last_online } => (Some(since), Some(last_online)),
                    GpuState::OfflineRunning => (None, None),
                };
                let mut processes: Vec<ProcDoc> = self
                    .table
                    .entries()
                    .filter(|e| e.gpus.contains(&g))
                    .map(|e| ProcDoc {
                        pid: e.key.pid,
                        class: e.cls.class,
                        owner: e.cls.owner.clone(),
                        cmd: e.cmd.clone(),
                        suspended: self.machine.suspended().contains_key(&e.key),
                        actuator: e.plan.as_ref().map(|p| p.kind()),
                        last_active_ms_ago: e.last_active.get(&g).map(|t| ms_ago(*t)),
                    })
                    .collect();
                processes.sort_by_key(|p| p.pid);
                let h = self.telemetry.history.get(&g);
                GpuDoc {
                    index: g,
                    uuid: self.gpu.uuid(g),
                    state: state.as_str().into(),
                    since,
                    last_online,
                    degraded: self.health.degraded(g),
                    processes,
                    last_preemption_ms_ago: h.and_then(|h| h.last_preempt_ns).map(ms_ago),
                    preemption_ms: h
                        .map(|h| Summary::of(h.preemption_ms.iter().copied()))
                        .unwrap_or_default(),
                    release_ms: h
                        .map(|h| Summary::of(h.release_ms.iter().copied()))
                        .unwrap_or_default(),
                }
            })
            .collect();
        let degraded_reason = self.shared.degraded();
        let doc = StateDoc {
            node: self.cfg.node.clone(),
            actuator: Some(self.cfg.actuator),
            dry_run: self.cfg.dry_run,
            idle_window_ms: self.cfg.machine.idle_window as f64 / 1e6,
            degraded: degraded_reason.is_some(),
            degraded_reason,
            suspended_targets: self.book.len(),
            updated_ns: now,
            gpus,
            recent_events: self.telemetry.recent.iter().cloned().collect(),
            distrusted_pages: self.bells.distrusted(),
        };
        *self.shared.state.lock().unwrap_or_else(|e| e.into_inner()) = doc;
    }
}

/// One GPU's summary for the time accounting (see [`Loop::summarise`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct GpuSummary {
    gpu: u32,
    busy: bool,
    offline: usize,
    suspended: usize,
}
