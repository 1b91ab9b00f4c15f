//! Each note's rendering: its log line (message, fields, level), its counters, gauges and
//! histograms, and for the lines a tenant can cause at will, the per-owner limit
//! ([`Telemetry::tenant_line`]) with what a held-back line still counts.

use super::Emit;
use crate::control::model::act::Op;
use crate::control::model::driver;
use crate::control::note::*;
use crate::telemetry::Telemetry;
use qos_core::machine::Reason;
use tracing::{debug, error, info, warn};

/// The log target of every note's line, as it was when notes were reported in
/// `control/note.rs`: `COLOC_LOG` directives and log pipelines select on it.
const NOTES: &str = "coloc_agent::control::note";

/// Bytes in GiB, two decimals.
fn gib(b: u64) -> f64 {
    (b as f64 / (1u64 << 30) as f64 * 100.0).round() / 100.0
}

impl Emit for FailedOpen {
    fn emit(&self, _: &mut Telemetry) {
        metrics::counter!("coloc_fail_open_total", "reason" => self.why.as_str()).increment(1)
    }
}

impl Emit for NotRecorded {
    fn emit(&self, _: &mut Telemetry) {
        error!(
            target: NOTES,
            targets = self.targets,
            "Cannot write the suspension record: not suspending (fail open)"
        )
    }
}

impl Emit for FallbackNotRecorded {
    fn emit(&self, _: &mut Telemetry) {
        error!(target: NOTES, "Cannot record the fallback suspension: not suspending (fail open)")
    }
}

impl Emit for EscalationNotRecorded {
    fn emit(&self, _: &mut Telemetry) {
        error!(target: NOTES, "Cannot record the freezer escalation: not escalating")
    }
}

impl Emit for NewcomersNotRecorded {
    fn emit(&self, _: &mut Telemetry) {
        error!(
            target: NOTES,
            processes = self.processes,
            "Cannot record processes that joined a held cgroup: not stopping them"
        )
    }
}

impl Emit for HoldGone {
    fn emit(&self, _: &mut Telemetry) {
        // The shell said it once, at info.
        debug!(target: NOTES, hold = ?self.hold, "Hold of a gone cgroup ended")
    }
}

impl Emit for NewcomersStopped {
    fn emit(&self, _: &mut Telemetry) {
        info!(
            target: NOTES,
            hold = ?self.hold,
            processes = self.processes,
            "Processes joined a held cgroup: stopping them too"
        )
    }
}

impl Emit for ActFailed {
    fn emit(&self, _: &mut Telemetry) {
        let (target, error) = (&self.target, &self.error);
        metrics::counter!("coloc_actuation_errors_total", "actuator" => self.actuator.as_str(), "op" => self.op.as_str(), "reason" => self.reason).increment(1);
        match self.op {
            Op::Suspend => {
                error!(target: NOTES, %target, %error, "Suspension failed: undoing it (fail open)")
            }
            Op::Resume => {
                error!(
                    target: NOTES,
                    %target,
                    %error,
                    "Resume failed; left in the record for the next start"
                )
            }
        }
    }
}

impl Emit for TimedOut {
    fn emit(&self, _: &mut Telemetry) {
        let (hold, timeout) = (&self.hold, &self.timeout);
        metrics::counter!("coloc_actuation_errors_total", "actuator" => self.actuator.as_str(), "op" => self.op.as_str(), "reason" => "timeout").increment(1);
        match self.op {
            Op::Suspend => error!(
                target: NOTES,
                ?hold,
                ?timeout,
                "Suspension not confirmed in time: undoing it (fail open)"
            ),
            Op::Resume => error!(
                target: NOTES,
                ?hold,
                "Resume not confirmed in time; left in the record for the next start"
            ),
        }
    }
}

impl Emit for Resumed {
    fn emit(&self, _: &mut Telemetry) {
        debug!(target: NOTES, hold = ?self.hold, outcome = ?self.outcome, "Resumed")
    }
}

impl Emit for ReleasingAll {
    fn emit(&self, _: &mut Telemetry) {
        info!(
            target: NOTES,
            reason = self.reason.as_str(),
            count = self.count,
            "Resuming all suspended offline work"
        )
    }
}

impl Emit for GateDrained {
    fn emit(&self, _: &mut Telemetry) {
        debug!(
            target: NOTES,
            hold = ?self.hold,
            fallback = self.fallback.as_str(),
            "Launch gate drained: holding the process with its fallback"
        )
    }
}

impl Emit for GateEscalated {
    fn emit(&self, _: &mut Telemetry) {
        let (gates, timeout) = (&self.gates, &self.timeout);
        metrics::counter!("coloc_gate_escalations_total").increment(1);
        warn!(
            target: NOTES,
            ?gates,
            fallback = self.fallback.as_str(),
            ?timeout,
            why = self.why.as_str(),
            "Launch gate did not drain the process: stopping it with its fallback"
        );
    }
}

impl Emit for Decision {
    fn emit(&self, _: &mut Telemetry) {
        debug!(
            target: NOTES,
            suspend = self.suspend,
            resume = self.resume,
            transitions = self.transitions,
            "Decision"
        )
    }
}

impl Emit for Suspending {
    fn emit(&self, _: &mut Telemetry) {
        let (gpu, why) = match self.reason {
            Reason::OnlineBusy { gpu } => (gpu.to_string(), "online_busy"),
            Reason::ShareCap => ("-".to_string(), "share_cap"),
        };
        metrics::counter!("coloc_suspensions_total", "gpu" => gpu, "reason" => why).increment(1);
    }
}

impl Emit for Resuming {
    fn emit(&self, _: &mut Telemetry) {
        info!(target: NOTES, pids = ?self.pids, targets = self.targets, "Resuming offline work")
    }
}

impl Emit for Detected {
    fn emit(&self, to: &mut Telemetry) {
        to.detected(self.gpu, self.signal, self.seconds)
    }
}

impl Emit for RetryLater {
    fn emit(&self, _: &mut Telemetry) {
        warn!(
            target: NOTES,
            pid = self.pid,
            retry_in_ms = self.in_ms,
            "Suspension failed and was undone; retrying while online stays busy"
        )
    }
}

impl Emit for Retrying {
    fn emit(&self, _: &mut Telemetry) {
        metrics::counter!("coloc_suspension_retries_total").increment(1);
        info!(target: NOTES, pid = self.pid, "Retrying a failed suspension");
    }
}

impl Emit for Released {
    fn emit(&self, _: &mut Telemetry) {
        let (gpu, rule) = (self.gpu, self.rule.as_str());
        metrics::counter!("coloc_releases_total", "gpu" => gpu.to_string(), "rule" => rule)
            .increment(1);
        debug!(
            target: NOTES,
            gpu,
            rule,
            window_ms = self.window_ns as f64 / 1e6,
            "Released"
        );
    }
}

impl Emit for Harvested {
    fn emit(&self, _: &mut Telemetry) {
        let (gpu, rule) = (self.gpu, self.rule.as_str());
        metrics::histogram!("coloc_release_harvest_seconds", "gpu" => gpu.to_string(), "rule" => rule)
            .record(self.ran_ns as f64 / 1e9);
        if self.wrong {
            metrics::counter!("coloc_releases_wrong_total", "gpu" => gpu.to_string()).increment(1);
        }
    }
}

impl Emit for Broken {
    fn emit(&self, _: &mut Telemetry) {
        let (b, owners) = (&self.broken, &self.owners);
        metrics::counter!("coloc_suspension_breaks_total", "actuator" => b.kind.as_str())
            .increment(1);
        if b.escalated {
            warn!(
                target: NOTES,
                ?owners,
                breaks = b.breaks,
                "Offline work keeps resuming itself while suspended: now frozen (its cgroup, or a cell of the agent's own)"
            );
        } else if let Some(why) = &b.unheld {
            error!(
                target: NOTES,
                ?owners,
                breaks = b.breaks,
                %why,
                "Offline work keeps resuming itself while suspended, and nothing it cannot undo can hold it here: it may run beside online work (see /state `escaping`)"
            );
        } else if b.breaks == 1 || b.breaks.is_multiple_of(100) {
            warn!(
                target: NOTES,
                ?owners,
                breaks = b.breaks,
                resumed = b.resumed,
                "Offline work was resumed by something else while suspended: stopped again"
            );
        }
    }
}

impl Emit for ListRefresh {
    fn emit(&self, _: &mut Telemetry) {
        metrics::counter!("coloc_process_list_refreshes_total", "why" => self.why.as_str())
            .increment(1)
    }
}

impl Emit for NvmlTransient {
    fn emit(&self, _: &mut Telemetry) {
        let error = &self.error;
        warn!(
            target: NOTES,
            gpu = self.gpu,
            %error,
            "NVML call failed; keeping this GPU's decisions until the failure persists"
        )
    }
}

impl Emit for NvmlFailOpen {
    fn emit(&self, _: &mut Telemetry) {
        let (error, grace) = (&self.error, &self.grace);
        metrics::counter!("coloc_fail_open_total", "reason" => FailWhy::Nvml.as_str()).increment(1);
        error!(
            target: NOTES,
            gpu = self.gpu,
            %error,
            ?grace,
            "NVML keeps failing for this GPU: failing open, resuming its offline work; other GPUs stay managed"
        );
    }
}

impl Emit for NvmlRecovered {
    fn emit(&self, _: &mut Telemetry) {
        info!(
            target: NOTES,
            gpu = self.gpu,
            "NVML answers again for this GPU: managing it again"
        )
    }
}

impl Emit for NvmlAllRecovered {
    fn emit(&self, _: &mut Telemetry) {
        info!(target: NOTES, "NVML answers again on every GPU: resuming normal operation")
    }
}

impl Emit for Degraded {
    fn emit(&self, to: &mut Telemetry) {
        if let Some(m) = to.gpus.get(&self.gpu) {
            m.set_degraded(self.degraded);
        }
    }
}

impl Emit for HungCallReturned {
    fn emit(&self, _: &mut Telemetry) {
        info!(target: NOTES, "The hung NVML call returned: managing offline work again")
    }
}

impl Emit for Invisible {
    fn emit(&self, _: &mut Telemetry) {
        let pids = &self.pids;
        metrics::gauge!("coloc_invisible_gpu_processes").set(pids.len() as f64);
        if self.warn {
            warn!(
                target: NOTES,
                ?pids,
                "GPU processes listed by the driver have not been visible in /proc for over 1 s: is the agent in the host PID namespace (hostPID: true)? They are ignored"
            );
        }
    }
}

impl Emit for Replaced {
    fn emit(&self, _: &mut Telemetry) {
        info!(
            target: NOTES,
            pid = self.pid,
            "GPU process replaced by another with the same PID"
        )
    }
}

impl Emit for WakeGapTooLong {
    fn emit(&self, _: &mut Telemetry) {
        warn!(
            target: NOTES,
            page = %self.page.display(),
            wake_gap_ms = self.wake_gap_ns as f64 / 1e6,
            idle_window_ms = self.window_ns as f64 / 1e6,
            "Doorbell wake gap longer than the idle window: a launch after a pause between the two is seen at the next tick, not at once (set COLOC_SHIM_WAKE_GAP_MS to the idle window)"
        )
    }
}

impl Emit for PageAttributed {
    fn emit(&self, to: &mut Telemetry) {
        let dir = self
            .page
            .parent()
            .map_or_else(String::new, |d| d.display().to_string());
        if to.tenant_line("doorbell page attributed", &dir) {
            info!(
                target: NOTES,
                page = %self.page.display(),
                pid = self.pid,
                gpu = self.gpu,
                "Doorbell page attributed to an online process"
            );
        }
    }
}

impl Emit for PageRejected {
    fn emit(&self, to: &mut Telemetry) {
        // Counted whether its line is said or held back.
        metrics::counter!("coloc_doorbell_rejected_total", "reason" => self.reason.as_str())
            .increment(1);
        let owner = &self.owner;
        if to.tenant_line("doorbell page not attributed", &format!("{owner:?}")) {
            warn!(
                target: NOTES,
                page = %self.page.display(),
                ?owner,
                file_uid = self.file_uid,
                reason = self.reason.as_str(),
                "Doorbell page not attributed: its launches count for nothing"
            );
        }
    }
}

impl Emit for Uncorroborated {
    fn emit(&self, _: &mut Telemetry) {
        metrics::counter!("coloc_doorbell_rejected_total", "reason" => Reject::Uncorroborated.as_str())
            .increment(1)
    }
}

impl Emit for Distrusted {
    fn emit(&self, _: &mut Telemetry) {
        metrics::gauge!("coloc_doorbell_distrusted_pages").set(self.owners as f64)
    }
}

impl Emit for HoldGauges {
    fn emit(&self, _: &mut Telemetry) {
        metrics::gauge!("coloc_escaping_processes").set(self.escaping as f64);
        metrics::gauge!("coloc_gate_silent_processes").set(self.gate_silent as f64);
    }
}

impl Emit for MemoryUnread {
    fn emit(&self, _: &mut Telemetry) {
        let error = &self.error;
        warn!(
            target: NOTES,
            gpu = self.gpu,
            %error,
            "Cannot read the GPU's memory: memory preemption waits for the next read"
        )
    }
}

impl Emit for MemoryPressure {
    fn emit(&self, _: &mut Telemetry) {
        let (gpu, free_gib, reserve_gib) = (self.gpu, gib(self.free), gib(self.reserve));
        if self.on {
            info!(
                target: NOTES,
                gpu,
                free_gib,
                reserve_gib,
                "Online work needs memory: free memory under the reserve"
            );
        } else {
            info!(
                target: NOTES,
                gpu,
                free_gib,
                reserve_gib,
                "Free memory back over the reserve (or no online work)"
            );
        }
    }
}

impl Emit for Evicting {
    fn emit(&self, _: &mut Telemetry) {
        info!(
            target: NOTES,
            gpu = self.gpu,
            pid = self.pid,
            holds_gib = gib(self.bytes),
            missing_gib = gib(self.missing),
            "Checkpointing an offline process to give its GPU memory to online work (recorded first)"
        )
    }
}

impl Emit for EvictionNotRecorded {
    fn emit(&self, _: &mut Telemetry) {
        error!(
            target: NOTES,
            pid = self.pid,
            "Cannot record the checkpoint: not checkpointing the process"
        )
    }
}

impl Emit for DriverCall {
    fn emit(&self, _: &mut Telemetry) {
        let (opl, pid, owner, took_s) = (self.op.as_str(), self.pid, &self.owner, self.took_s);
        match &self.reason {
            None => {
                metrics::histogram!("coloc_driver_call_seconds", "op" => opl).record(took_s);
                if matches!(self.op, driver::Op::Checkpoint | driver::Op::Restore) {
                    metrics::counter!("coloc_checkpoint_bytes_total", "op" => opl)
                        .increment(self.bytes);
                    info!(
                        target: NOTES,
                        op = opl,
                        pid,
                        %owner,
                        gib = gib(self.bytes),
                        took_s,
                        "Driver call done"
                    );
                } else {
                    debug!(
                        target: NOTES,
                        op = opl,
                        pid,
                        %owner,
                        took_ms = took_s * 1e3,
                        "Driver call done"
                    );
                }
            }
            Some(r) => {
                let error = self.error.as_deref().unwrap_or("-");
                metrics::counter!("coloc_driver_call_failures_total", "op" => opl, "reason" => r.clone())
                    .increment(1);
                if r == "operating_system" {
                    warn!(
                        target: NOTES,
                        op = opl,
                        pid,
                        %owner,
                        error,
                        "The CUDA driver refused with CUDA_ERROR_OPERATING_SYSTEM: the agent lacks the rights its checkpoint calls need on this process (CAP_SYS_PTRACE, and CAP_DAC_OVERRIDE for a process of another user; the chart adds both with agent.driverLock or memoryPreemption.enabled), or the process was killed by the call (a checkpoint moves its GPU memory into its own memory: check its memory limit)"
                    );
                } else if self.fallback {
                    warn!(
                        target: NOTES,
                        op = opl,
                        pid,
                        %owner,
                        reason = %r,
                        error,
                        "The CUDA driver refused: this process is held by its other plan (freezer or signal) from now on, and not checkpointed"
                    );
                } else {
                    warn!(
                        target: NOTES,
                        op = opl,
                        pid,
                        %owner,
                        reason = %r,
                        error,
                        "Driver call failed: asking the driver where the process is, trying again later"
                    );
                }
            }
        }
    }
}

impl Emit for NoRoomForCheckpoint {
    fn emit(&self, _: &mut Telemetry) {
        metrics::counter!("coloc_checkpoints_skipped_total", "reason" => "memory_limit")
            .increment(1);
        warn!(
            target: NOTES,
            pid = self.pid,
            room_gib = gib(self.room),
            need_gib = gib(self.need),
            "Not checkpointing this offline process: the driver keeps its GPU memory in the process's own memory, and its memory limit has no room for it (it would be OOM-killed); raise the pod's memory limit, or annotate it gpu-coloc.dev/checkpoint: \"false\""
        )
    }
}

impl Emit for DriverCallStuck {
    fn emit(&self, _: &mut Telemetry) {
        let owner = &self.owner;
        metrics::counter!("coloc_driver_calls_stuck_total", "op" => self.op.as_str()).increment(1);
        warn!(
            target: NOTES,
            op = self.op.as_str(),
            pid = self.pid,
            %owner,
            secs = self.secs,
            "A CUDA driver call has not returned long after it should: the process is probably stopped (SIGSTOP, a debugger), and the driver waits for it to run; memory preemption takes other processes meanwhile"
        )
    }
}

impl Emit for RestoreGivenUp {
    fn emit(&self, _: &mut Telemetry) {
        let owner = &self.owner;
        error!(
            target: NOTES,
            pid = self.pid,
            %owner,
            "Cannot restore this checkpointed process before exit (the GPU has no room for it): it stays checkpointed and recorded; run `coloc-agent resume` once the GPU has room"
        )
    }
}

impl Emit for DriverFailedState {
    fn emit(&self, _: &mut Telemetry) {
        let owner = &self.owner;
        metrics::counter!("coloc_driver_call_failures_total", "op" => "state", "reason" => "failed_state")
            .increment(1);
        error!(
            target: NOTES,
            pid = self.pid,
            %owner,
            "The CUDA driver reports this process failed (an error during checkpoint or restore): nothing more can be done with it by the agent"
        );
    }
}
