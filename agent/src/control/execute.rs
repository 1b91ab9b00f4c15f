//! A decision becomes holds and events: suspensions (recorded, then acted on), resumptions,
//! and the preempt/release events that wait for their confirmations.

use super::events::{Event, Preempt, Release};
use super::holds::HoldKey;
use super::Loop;
use crate::edges::actuator::Op;
use crate::edges::procfs::ProcKey;
use qos_core::machine::Reason;
use qos_core::{Decision, Transition};
use std::collections::BTreeSet;
use tracing::debug;

fn secs(ns: u64) -> f64 {
    ns as f64 / 1e9
}

impl Loop {
    pub(super) fn execute(&mut self, d: Decision<ProcKey>, now: u64) {
        debug!(suspend = ?d.suspend, resume = ?d.resume, transitions = ?d.transitions, "Decision");
        // Suspensions: one batch, recorded before acting.
        let mut reqs = Vec::new();
        let mut reasons = Vec::new();
        for (key, reason) in &d.suspend {
            let Some(entry) = self.table.entry(key) else {
                continue;
            };
            let (Some(plan), Some(pin)) = (entry.plan.clone(), entry.pin.clone()) else {
                continue;
            };
            // Membership may have changed since classification: check again (rules only).
            let alone = crate::edges::actuator::Target::Process {
                key: *key,
                pidfd: pin,
            };
            let plan = self.table.unmixed(plan, alone, &self.classifier);
            let (gpu, why) = match reason {
                Reason::OnlineBusy { gpu } => (Some(*gpu), "online_busy"),
                Reason::ShareCap => (None, "share_cap"),
            };
            let plan = match gpu {
                Some(g) => self.gate_plan(key, g, plan),
                None => plan,
            };
            metrics::counter!("coloc_suspensions_total", "gpu" => gpu.map(|g| g.to_string()).unwrap_or_else(|| "-".into()), "reason" => why).increment(1);
            reqs.push((*key, plan));
            reasons.push((*key, *reason));
        }
        let started = if reqs.is_empty() {
            Default::default()
        } else {
            self.book.suspend(&reqs, now)
        };
        let resumed = if d.resume.is_empty() {
            Vec::new()
        } else {
            self.book.resume(&d.resume, now)
        };
        self.drain();
        let done = self.book.take_done();
        if !resumed.is_empty() {
            let pids: Vec<u32> = d.resume.iter().map(|k| k.pid).collect();
            tracing::info!(?pids, targets = resumed.len(), "Resuming offline work");
        }

        self.open_events(&d.transitions, &started.started, &resumed, &reasons);
        for ev in self.tracker.complete(&done) {
            self.telemetry.emit(ev);
        }
    }

    /// Opens the event of each transition, waiting for the holds this decision started
    /// for it: suspensions for the busy GPU, resumptions of its processes.
    fn open_events(
        &mut self,
        transitions: &[Transition],
        started: &[(ProcKey, HoldKey)],
        resumed: &[(ProcKey, HoldKey)],
        reasons: &[(ProcKey, Reason)],
    ) {
        for tr in transitions {
            let opened = match *tr {
                Transition::Preempt {
                    gpu,
                    onset,
                    signal,
                    decided_at,
                    offline,
                } => {
                    let detection = decided_at.saturating_sub(onset);
                    self.telemetry.detected(gpu, signal, secs(detection));
                    let holds: BTreeSet<HoldKey> = started
                        .iter()
                        .filter(|(holder, _)| {
                            reasons.contains(&(*holder, Reason::OnlineBusy { gpu }))
                        })
                        .map(|(_, k)| k.clone())
                        .collect();
                    let ev = Event::Preempt(Preempt {
                        gpu,
                        onset_ns: onset,
                        signal,
                        decided_ns: decided_at,
                        detection_s: secs(detection),
                        offline,
                        actuator: None,
                        dry_run: self.cfg.dry_run,
                        confirmed_ns: None,
                        actuation_s: None,
                        preemption_s: None,
                        slept_ns: self.slept.map(|s| s.0),
                        woke_ns: self.slept.map(|s| s.1),
                    });
                    self.tracker.open(ev, Op::Suspend, holds)
                }
                Transition::Release {
                    gpu,
                    window_end,
                    decided_at,
                    busy_for,
                    offline,
                    window: _,
                } => {
                    // The busy period is over: the next one's onset is its own evidence,
                    // not the start of a chain of samples that spans both.
                    self.table.end_runs(gpu);
                    let holds: BTreeSet<HoldKey> = resumed
                        .iter()
                        .filter(|(holder, _)| {
                            self.table
                                .entry(holder)
                                .is_some_and(|e| e.gpus.contains(&gpu))
                        })
                        .map(|(_, k)| k.clone())
                        .collect();
                    let ev = Event::Release(Release {
                        gpu,
                        window_end_ns: window_end,
                        decided_ns: decided_at,
                        idle_window_ns: self.cfg.machine.idle_window,
                        busy_for_s: secs(busy_for),
                        offline,
                        actuator: None,
                        dry_run: self.cfg.dry_run,
                        confirmed_ns: None,
                        release_s: None,
                    });
                    self.tracker.open(ev, Op::Resume, holds)
                }
            };
            if let Some(ev) = opened {
                self.telemetry.emit(ev);
            }
        }
    }
}
