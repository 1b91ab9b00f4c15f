//! What the controller has to say besides events: each log line and counter of its
//! decisions is a typed [`Note`], handed to the shell as a command and reported in one
//! place ([`Note::report`]). The controller itself never logs nor counts: the strings and
//! metric labels appear only here.
//!
//! May touch: the log and the metrics recorder.

use crate::control::holds::{Broken, Escalation, HoldKey, Outcome};
use crate::control::model::act::{Kind, Op};
use crate::control::model::bell::Owner;
use crate::control::nvml::Refresh;
use qos_core::machine::Reason;
use std::path::PathBuf;
use std::time::Duration;
use tracing::{debug, error, info, warn};

pub use super::reason::{FailWhy, Reject};

/// The rule by which offline work was released on a GPU (the `rule` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseRule {
    /// After the idle window (`--idle-window`).
    Fixed,
    /// After a shorter window learned from the online processes' gaps (`--release learned`).
    Learned,
    /// As soon as every online process's work was seen complete (`--release at-once`).
    AtOnce,
}

impl ReleaseRule {
    /// The rule of a release after `window` where the idle window is `idle_window`, with
    /// `--release at-once` or not.
    pub fn of(window: u64, idle_window: u64, at_once: bool) -> ReleaseRule {
        match (window < idle_window, at_once) {
            (false, _) => ReleaseRule::Fixed,
            (true, false) => ReleaseRule::Learned,
            (true, true) => ReleaseRule::AtOnce,
        }
    }

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ReleaseRule::Fixed => "fixed",
            ReleaseRule::Learned => "learned",
            ReleaseRule::AtOnce => "at_once",
        }
    }
}

/// One thing worth a log line or a counter.
#[derive(Debug, Clone)]
pub enum Note {
    /// Offline work resumed because something failed (the counter only).
    FailedOpen(FailWhy),
    /// A suspension's record could not be written: nothing was suspended.
    NotRecorded {
        /// Holds that were not started.
        targets: usize,
    },
    /// A gate hold's fallback could not be recorded: not suspended.
    FallbackNotRecorded,
    /// A freezer escalation could not be recorded: not escalated.
    EscalationNotRecorded,
    /// Processes that joined a held cgroup could not be recorded: not stopped.
    NewcomersNotRecorded {
        /// How many.
        processes: usize,
    },
    /// A held signalled cgroup is gone (its processes exited): its hold ends.
    HoldGone {
        /// The hold.
        hold: HoldKey,
    },
    /// Processes that joined a held cgroup are stopped too.
    NewcomersStopped {
        /// The hold.
        hold: HoldKey,
        /// How many.
        processes: usize,
    },
    /// An operation on one target failed.
    ActFailed {
        /// Suspend or resume.
        op: Op,
        /// The target (display form).
        target: String,
        /// Its actuator.
        actuator: Kind,
        /// Bounded reason.
        reason: &'static str,
        /// The error.
        error: String,
    },
    /// An operation on a hold was not confirmed within `--confirm-timeout`.
    TimedOut {
        /// Suspend or resume.
        op: Op,
        /// The hold.
        hold: HoldKey,
        /// Its actuator.
        actuator: Kind,
        /// The timeout.
        timeout: Duration,
    },
    /// A hold's resume ended.
    Resumed {
        /// The hold.
        hold: HoldKey,
        /// How.
        outcome: Outcome,
    },
    /// Everything is resumed at once.
    ReleasingAll {
        /// Why.
        reason: crate::control::ReleaseAll,
        /// Holds.
        count: usize,
    },
    /// A gate hold drained: its fallback holds the process.
    GateDrained {
        /// The hold.
        hold: HoldKey,
        /// The fallback's actuator.
        fallback: Kind,
    },
    /// A gate hold did not drain in time (or could not close): its fallback stops it.
    GateEscalated {
        /// The gates (display form).
        gates: Vec<String>,
        /// The fallback's actuator.
        fallback: Kind,
        /// `--gate-timeout`.
        timeout: Duration,
        /// Why.
        why: Escalation,
    },
    /// A decision of the state machine (debug).
    Decision {
        /// Suspensions.
        suspend: usize,
        /// Resumptions.
        resume: usize,
        /// Transitions.
        transitions: usize,
    },
    /// An offline process is suspended, for this reason.
    Suspending(Reason),
    /// Offline work is resumed.
    Resuming {
        /// Its PIDs.
        pids: Vec<u32>,
        /// The holds resumed.
        targets: usize,
    },
    /// A preemption's detection latency.
    Detected {
        /// GPU.
        gpu: u32,
        /// What gave the onset.
        signal: qos_core::Signal,
        /// Seconds.
        seconds: f64,
    },
    /// A failed suspension is retried later.
    RetryLater {
        /// The holder.
        pid: u32,
        /// In how long, ms.
        in_ms: u64,
    },
    /// A failed suspension is tried again now.
    Retrying {
        /// The holder.
        pid: u32,
    },
    /// A GPU released its offline work, by the fixed or a learned window.
    Released {
        /// The GPU.
        gpu: u32,
        /// The rule that released it.
        rule: ReleaseRule,
        /// The window, ns.
        window_ns: u64,
    },
    /// Online work came back on a GPU after a release: offline ran this long in between
    /// (the time harvested by that release's rule); `wrong`: a learned release after which
    /// offline ran less than `--release-ratio` × `--release-drain`, so it did not pay.
    Harvested {
        /// The GPU.
        gpu: u32,
        /// The rule of the release.
        rule: ReleaseRule,
        /// Offline ran this long, ns.
        ran_ns: u64,
        /// A learned release that did not pay.
        wrong: bool,
    },
    /// A hold was found running.
    Broken {
        /// What was found.
        broken: Broken,
        /// Its holders' owners.
        owners: Vec<String>,
    },
    /// The process lists are read.
    ListRefresh(Refresh),
    /// A GPU's NVML failed, not persistently yet.
    NvmlTransient {
        /// GPU.
        gpu: u32,
        /// The error.
        error: String,
    },
    /// A GPU's NVML keeps failing: it fails open.
    NvmlFailOpen {
        /// GPU.
        gpu: u32,
        /// The error.
        error: String,
        /// `--nvml-failure-grace`.
        grace: Duration,
    },
    /// A GPU's NVML answers again.
    NvmlRecovered {
        /// GPU.
        gpu: u32,
    },
    /// Every GPU's NVML answers again.
    NvmlAllRecovered,
    /// A GPU's degraded gauge.
    Degraded {
        /// GPU.
        gpu: u32,
        /// Degraded now.
        degraded: bool,
    },
    /// The hung NVML call returned.
    HungCallReturned,
    /// Listed PIDs not visible in `/proc` for over a second (the gauge), and whether to
    /// warn (once).
    Invisible {
        /// Those PIDs.
        pids: Vec<u32>,
        /// Warn now.
        warn: bool,
    },
    /// A GPU process was replaced by another with the same PID.
    Replaced {
        /// The PID.
        pid: u32,
    },
    /// A page's wake gap is longer than the idle window.
    WakeGapTooLong {
        /// The page.
        page: PathBuf,
        /// Its wake gap, ns.
        wake_gap_ns: u64,
        /// The idle window, ns.
        window_ns: u64,
    },
    /// A page was attributed to an online process.
    PageAttributed {
        /// The page.
        page: PathBuf,
        /// The process.
        pid: u32,
        /// GPU.
        gpu: u32,
    },
    /// A page was rejected.
    PageRejected {
        /// The page.
        page: PathBuf,
        /// Who it says it belongs to.
        owner: Owner,
        /// Its file's UID.
        file_uid: u32,
        /// Why.
        reason: Reject,
    },
    /// An owner's claims were not corroborated (the counter).
    Uncorroborated,
    /// Owners distrusted now (the gauge).
    Distrusted(usize),
    /// Offline processes escaping their hold now, and whose gate stayed silent (the
    /// gauges).
    HoldGauges {
        /// Held, found running, nothing they cannot undo holding them.
        escaping: usize,
        /// Their gate did not acknowledge its latest close in time.
        gate_silent: usize,
    },
    /// A GPU's memory could not be read (memory preemption waits for the next read).
    MemoryUnread {
        /// GPU.
        gpu: u32,
        /// The error.
        error: String,
    },
    /// A GPU came under memory pressure (online present, free under the reserve) or out
    /// of it.
    MemoryPressure {
        /// GPU.
        gpu: u32,
        /// Under pressure now.
        on: bool,
        /// Free, bytes.
        free: u64,
        /// The reserve, bytes.
        reserve: u64,
    },
    /// An offline process is to be checkpointed for online's memory.
    Evicting {
        /// GPU.
        gpu: u32,
        /// The process.
        pid: u32,
        /// What it holds there, bytes.
        bytes: u64,
        /// What the reserve misses, bytes.
        missing: u64,
    },
    /// An eviction's record entry could not be written: not evicted.
    EvictionNotRecorded {
        /// The process.
        pid: u32,
    },
    /// A call to the driver's checkpoint API ended.
    DriverCall {
        /// The operation.
        op: crate::control::model::driver::Op,
        /// The process.
        pid: u32,
        /// Its owner.
        owner: String,
        /// How long it took, s.
        took_s: f64,
        /// Device memory it concerned, bytes.
        bytes: u64,
        /// Failed: the bounded reason.
        reason: Option<String>,
        /// Failed: the driver's answer.
        error: Option<String>,
        /// The process is held by its other plan from now on.
        fallback: bool,
    },
    /// An offline process was not checkpointed: its memory limit has no room for it.
    NoRoomForCheckpoint {
        /// The process.
        pid: u32,
        /// What its memory limits leave it, bytes.
        room: u64,
        /// What its checkpoint would take, bytes.
        need: u64,
    },
    /// A driver call has run far longer than it should.
    DriverCallStuck {
        /// The operation.
        op: crate::control::model::driver::Op,
        /// The process.
        pid: u32,
        /// Its owner.
        owner: String,
        /// How long so far, s.
        secs: f64,
    },
    /// At exit, the driver refused a restore: left checkpointed and recorded.
    RestoreGivenUp {
        /// The process.
        pid: u32,
        /// Its owner.
        owner: String,
    },
    /// The driver says a process is in its failed state.
    DriverFailedState {
        /// The process.
        pid: u32,
        /// Its owner.
        owner: String,
    },
}

fn gib(b: u64) -> f64 {
    (b as f64 / (1u64 << 30) as f64 * 100.0).round() / 100.0
}

impl Note {
    /// Writes the log line and the counter of this note.
    /// A line its tenant can cause at will (its doorbell pages), limited per owner
    /// ([`crate::logbudget`]): what it is about and whose it is.
    pub fn tenant_line(&self) -> Option<(&'static str, String)> {
        match self {
            Note::PageRejected { owner, .. } => {
                Some(("doorbell page not attributed", format!("{owner:?}")))
            }
            Note::PageAttributed { page, .. } => Some((
                "doorbell page attributed",
                page.parent()
                    .map_or_else(String::new, |d| d.display().to_string()),
            )),
            _ => None,
        }
    }

    /// What a note whose line is held back still counts.
    pub fn count_only(&self) {
        if let Note::PageRejected { reason, .. } = self {
            metrics::counter!("coloc_doorbell_rejected_total", "reason" => reason.as_str())
                .increment(1);
        }
    }

    pub fn report(&self) {
        match self {
            Note::FailedOpen(why) => {
                metrics::counter!("coloc_fail_open_total", "reason" => why.as_str()).increment(1)
            }
            Note::NotRecorded { targets } => error!(
                targets,
                "Cannot write the suspension record: not suspending (fail open)"
            ),
            Note::FallbackNotRecorded => {
                error!("Cannot record the fallback suspension: not suspending (fail open)")
            }
            Note::EscalationNotRecorded => {
                error!("Cannot record the freezer escalation: not escalating")
            }
            Note::NewcomersNotRecorded { processes } => error!(
                processes,
                "Cannot record processes that joined a held cgroup: not stopping them"
            ),
            // The shell said it once, at info.
            Note::HoldGone { hold } => tracing::debug!(?hold, "Hold of a gone cgroup ended"),
            Note::NewcomersStopped { hold, processes } => info!(
                ?hold,
                processes, "Processes joined a held cgroup: stopping them too"
            ),
            Note::ActFailed {
                op,
                target,
                actuator,
                reason,
                error,
            } => {
                metrics::counter!("coloc_actuation_errors_total", "actuator" => actuator.as_str(), "op" => op.as_str(), "reason" => *reason).increment(1);
                match op {
                    Op::Suspend => {
                        error!(%target, %error, "Suspension failed: undoing it (fail open)")
                    }
                    Op::Resume => {
                        error!(%target, %error, "Resume failed; left in the record for the next start")
                    }
                }
            }
            Note::TimedOut {
                op,
                hold,
                actuator,
                timeout,
            } => {
                metrics::counter!("coloc_actuation_errors_total", "actuator" => actuator.as_str(), "op" => op.as_str(), "reason" => "timeout").increment(1);
                match op {
                    Op::Suspend => error!(?hold, ?timeout, "Suspension not confirmed in time: undoing it (fail open)"),
                    Op::Resume => error!(?hold, "Resume not confirmed in time; left in the record for the next start"),
                }
            }
            Note::Resumed { hold, outcome } => debug!(?hold, ?outcome, "Resumed"),
            Note::ReleasingAll { reason, count } => {
                info!(reason = reason.as_str(), count, "Resuming all suspended offline work")
            }
            Note::GateDrained { hold, fallback } => debug!(
                ?hold,
                fallback = fallback.as_str(),
                "Launch gate drained: holding the process with its fallback"
            ),
            Note::GateEscalated {
                gates,
                fallback,
                timeout,
                why,
            } => {
                metrics::counter!("coloc_gate_escalations_total").increment(1);
                warn!(?gates, fallback = fallback.as_str(), ?timeout, why = why.as_str(),
                    "Launch gate did not drain the process: stopping it with its fallback");
            }
            Note::Decision {
                suspend,
                resume,
                transitions,
            } => debug!(suspend, resume, transitions, "Decision"),
            Note::Suspending(reason) => {
                let (gpu, why) = match reason {
                    Reason::OnlineBusy { gpu } => (gpu.to_string(), "online_busy"),
                    Reason::ShareCap => ("-".to_string(), "share_cap"),
                };
                metrics::counter!("coloc_suspensions_total", "gpu" => gpu, "reason" => why)
                    .increment(1);
            }
            Note::Resuming { pids, targets } => {
                info!(?pids, targets, "Resuming offline work")
            }
            Note::Detected { .. } => {}
            Note::RetryLater { pid, in_ms } => warn!(
                pid,
                retry_in_ms = in_ms,
                "Suspension failed and was undone; retrying while online stays busy"
            ),
            Note::Retrying { pid } => {
                metrics::counter!("coloc_suspension_retries_total").increment(1);
                info!(pid, "Retrying a failed suspension");
            }
            Note::Released {
                gpu,
                rule,
                window_ns,
            } => {
                let rule = rule.as_str();
                metrics::counter!("coloc_releases_total", "gpu" => gpu.to_string(), "rule" => rule)
                    .increment(1);
                debug!(gpu, rule, window_ms = *window_ns as f64 / 1e6, "Released");
            }
            Note::Harvested {
                gpu,
                rule,
                ran_ns,
                wrong,
            } => {
                let rule = rule.as_str();
                metrics::histogram!("coloc_release_harvest_seconds", "gpu" => gpu.to_string(), "rule" => rule)
                    .record(*ran_ns as f64 / 1e9);
                if *wrong {
                    metrics::counter!("coloc_releases_wrong_total", "gpu" => gpu.to_string())
                        .increment(1);
                }
            }
            Note::Broken { broken: b, owners } => {
                metrics::counter!("coloc_suspension_breaks_total", "actuator" => b.kind.as_str())
                    .increment(1);
                if b.escalated {
                    warn!(?owners, breaks = b.breaks, "Offline work keeps resuming itself while suspended: now frozen (its cgroup, or a cell of the agent's own)");
                } else if let Some(why) = &b.unheld {
                    error!(?owners, breaks = b.breaks, %why, "Offline work keeps resuming itself while suspended, and nothing it cannot undo can hold it here: it may run beside online work (see /state `escaping`)");
                } else if b.breaks == 1 || b.breaks.is_multiple_of(100) {
                    warn!(?owners, breaks = b.breaks, resumed = b.resumed, "Offline work was resumed by something else while suspended: stopped again");
                }
            }
            Note::ListRefresh(why) => {
                metrics::counter!("coloc_process_list_refreshes_total", "why" => why.as_str())
                    .increment(1)
            }
            Note::NvmlTransient { gpu, error } => warn!(gpu, %error, "NVML call failed; keeping this GPU's decisions until the failure persists"),
            Note::NvmlFailOpen { gpu, error, grace } => {
                metrics::counter!("coloc_fail_open_total", "reason" => FailWhy::Nvml.as_str()).increment(1);
                error!(gpu, %error, ?grace, "NVML keeps failing for this GPU: failing open, resuming its offline work; other GPUs stay managed");
            }
            Note::NvmlRecovered { gpu } => {
                info!(gpu, "NVML answers again for this GPU: managing it again")
            }
            Note::NvmlAllRecovered => {
                info!("NVML answers again on every GPU: resuming normal operation")
            }
            Note::Degraded { .. } => {}
            Note::HungCallReturned => {
                info!("The hung NVML call returned: managing offline work again")
            }
            Note::Invisible { pids, warn } => {
                metrics::gauge!("coloc_invisible_gpu_processes").set(pids.len() as f64);
                if *warn {
                    warn!(?pids, "GPU processes listed by the driver have not been visible in /proc for over 1 s: is the agent in the host PID namespace (hostPID: true)? They are ignored");
                }
            }
            Note::Replaced { pid } => {
                info!(pid, "GPU process replaced by another with the same PID")
            }
            Note::WakeGapTooLong {
                page,
                wake_gap_ns,
                window_ns,
            } => warn!(page = %page.display(), wake_gap_ms = *wake_gap_ns as f64 / 1e6, idle_window_ms = *window_ns as f64 / 1e6,
                "Doorbell wake gap longer than the idle window: a launch after a pause between the two is seen at the next tick, not at once (set COLOC_SHIM_WAKE_GAP_MS to the idle window)"),
            Note::PageAttributed { page, pid, gpu } => info!(page = %page.display(), pid, gpu, "Doorbell page attributed to an online process"),
            Note::PageRejected {
                page,
                owner,
                file_uid,
                reason,
            } => {
                metrics::counter!("coloc_doorbell_rejected_total", "reason" => reason.as_str())
                    .increment(1);
                warn!(page = %page.display(), ?owner, file_uid, reason = reason.as_str(),
                    "Doorbell page not attributed: its launches count for nothing");
            }
            Note::Uncorroborated => metrics::counter!("coloc_doorbell_rejected_total", "reason" => Reject::Uncorroborated.as_str())
                .increment(1),
            Note::Distrusted(n) => {
                metrics::gauge!("coloc_doorbell_distrusted_pages").set(*n as f64)
            }
            Note::HoldGauges {
                escaping,
                gate_silent,
            } => {
                metrics::gauge!("coloc_escaping_processes").set(*escaping as f64);
                metrics::gauge!("coloc_gate_silent_processes").set(*gate_silent as f64);
            }
            Note::MemoryUnread { gpu, error } => {
                warn!(gpu, %error, "Cannot read the GPU's memory: memory preemption waits for the next read")
            }
            Note::MemoryPressure {
                gpu,
                on,
                free,
                reserve,
            } => {
                let (free_gib, reserve_gib) = (gib(*free), gib(*reserve));
                if *on {
                    info!(gpu, free_gib, reserve_gib, "Online work needs memory: free memory under the reserve");
                } else {
                    info!(gpu, free_gib, reserve_gib, "Free memory back over the reserve (or no online work)");
                }
            }
            Note::Evicting {
                gpu,
                pid,
                bytes,
                missing,
            } => info!(
                gpu,
                pid,
                holds_gib = gib(*bytes),
                missing_gib = gib(*missing),
                "Checkpointing an offline process to give its GPU memory to online work (recorded first)"
            ),
            Note::EvictionNotRecorded { pid } => error!(
                pid,
                "Cannot record the checkpoint: not checkpointing the process"
            ),
            Note::DriverCall {
                op,
                pid,
                owner,
                took_s,
                bytes,
                reason,
                error,
                fallback,
            } => {
                let opl = op.as_str();
                match reason {
                    None => {
                        metrics::histogram!("coloc_driver_call_seconds", "op" => opl)
                            .record(*took_s);
                        if matches!(
                            op,
                            crate::control::model::driver::Op::Checkpoint
                                | crate::control::model::driver::Op::Restore
                        ) {
                            metrics::counter!("coloc_checkpoint_bytes_total", "op" => opl)
                                .increment(*bytes);
                            info!(op = opl, pid, %owner, gib = gib(*bytes), took_s, "Driver call done");
                        } else {
                            debug!(op = opl, pid, %owner, took_ms = took_s * 1e3, "Driver call done");
                        }
                    }
                    Some(r) => {
                        metrics::counter!("coloc_driver_call_failures_total", "op" => opl, "reason" => r.clone())
                            .increment(1);
                        if r == "operating_system" {
                            warn!(op = opl, pid, %owner, error = error.as_deref().unwrap_or("-"),
                                "The CUDA driver refused with CUDA_ERROR_OPERATING_SYSTEM: the agent lacks the rights its checkpoint calls need on this process (CAP_SYS_PTRACE, and CAP_DAC_OVERRIDE for a process of another user; the chart adds both with agent.driverLock or memoryPreemption.enabled), or the process was killed by the call (a checkpoint moves its GPU memory into its own memory: check its memory limit)");
                        } else if *fallback {
                            warn!(op = opl, pid, %owner, reason = %r, error = error.as_deref().unwrap_or("-"),
                                "The CUDA driver refused: this process is held by its other plan (freezer or signal) from now on, and not checkpointed");
                        } else {
                            warn!(op = opl, pid, %owner, reason = %r, error = error.as_deref().unwrap_or("-"),
                                "Driver call failed: asking the driver where the process is, trying again later");
                        }
                    }
                }
            }
            Note::NoRoomForCheckpoint { pid, room, need } => {
                metrics::counter!("coloc_checkpoints_skipped_total", "reason" => "memory_limit").increment(1);
                warn!(pid, room_gib = gib(*room), need_gib = gib(*need),
                    "Not checkpointing this offline process: the driver keeps its GPU memory in the process's own memory, and its memory limit has no room for it (it would be OOM-killed); raise the pod's memory limit, or annotate it gpu-coloc.dev/checkpoint: \"false\"")
            }
            Note::DriverCallStuck { op, pid, owner, secs } => {
                metrics::counter!("coloc_driver_calls_stuck_total", "op" => op.as_str()).increment(1);
                warn!(op = op.as_str(), pid, %owner, secs,
                    "A CUDA driver call has not returned long after it should: the process is probably stopped (SIGSTOP, a debugger), and the driver waits for it to run; memory preemption takes other processes meanwhile")
            }
            Note::RestoreGivenUp { pid, owner } => error!(pid, %owner,
                "Cannot restore this checkpointed process before exit (the GPU has no room for it): it stays checkpointed and recorded; run `coloc-agent resume` once the GPU has room"),
            Note::DriverFailedState { pid, owner } => {
                metrics::counter!("coloc_driver_call_failures_total", "op" => "state", "reason" => "failed_state")
                    .increment(1);
                error!(pid, %owner, "The CUDA driver reports this process failed (an error during checkpoint or restore): nothing more can be done with it by the agent");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ReleaseRule;

    /// `coloc_releases_total{rule}` says which policy released: the idle window, a learned
    /// window, or at once (it said "learned" for every release of `--release at-once`).
    #[test]
    fn a_release_is_labelled_by_the_policy_that_made_it() {
        let idle = 100_000_000;
        assert_eq!(ReleaseRule::of(idle, idle, false).as_str(), "fixed");
        assert_eq!(ReleaseRule::of(idle, idle, true).as_str(), "fixed");
        assert_eq!(ReleaseRule::of(2_000_000, idle, false).as_str(), "learned");
        assert_eq!(ReleaseRule::of(0, idle, true).as_str(), "at_once");
    }
}
