//! Each event's rendering: its log line, and the latency histograms and per-GPU history
//! of a preemption or a release (labelled by the actuator that acted last). The JSON line
//! of `--event-log` and `/state`'s `recent_events` are every event's alike
//! ([`super::event`]).

use super::Emit;
use crate::control::events::{Distrust, DriverEvent, Escape, FailOpen, Preempt, Release};
use crate::control::model::act::Kind;
use crate::telemetry::{push_bounded, Telemetry, HISTORY};
use tracing::{error, info, warn};

/// The log target of every event's line, as it was when events were reported in
/// `telemetry.rs`: `COLOC_LOG` directives and log pipelines select on it.
const EVENTS: &str = "coloc_agent::telemetry";

impl Emit for Preempt {
    fn emit(&self, to: &mut Telemetry) {
        let p = self;
        info!(
            target: EVENTS,
            gpu = p.gpu,
            offline = p.offline,
            signal = p.signal.as_str(),
            detection_ms = p.detection_s * 1e3,
            preemption_ms = p.preemption_s.map(|s| s * 1e3),
            actuator = p.actuator.map(Kind::as_str),
            "Online busy: offline suspended"
        );
        let h = to.history.entry(p.gpu).or_default();
        h.last_preempt_ns = Some(p.decided_ns);
        if let (Some(pre), Some(act), Some(kind)) = (p.preemption_s, p.actuation_s, p.actuator) {
            push_bounded(&mut h.preemption_ms, pre * 1e3, HISTORY);
            if let Some(m) = to.gpus.get(&p.gpu) {
                m.preempted(kind, p.signal, act, pre);
            }
        }
    }
}

impl Emit for Release {
    fn emit(&self, to: &mut Telemetry) {
        let r = self;
        info!(
            target: EVENTS,
            gpu = r.gpu,
            offline = r.offline,
            busy_ms = r.busy_for_s * 1e3,
            release_ms = r.release_s.map(|s| s * 1e3),
            actuator = r.actuator.map(Kind::as_str),
            "Online idle for the window: offline resumed"
        );
        if let (Some(rel), Some(kind)) = (r.release_s, r.actuator) {
            push_bounded(
                &mut to.history.entry(r.gpu).or_default().release_ms,
                rel * 1e3,
                HISTORY,
            );
            if let Some(m) = to.gpus.get(&r.gpu) {
                m.released(kind, rel);
            }
        }
    }
}

impl Emit for FailOpen {
    fn emit(&self, _: &mut Telemetry) {
        let f = self;
        error!(
            target: EVENTS,
            gpu = f.gpu,
            reason = %f.reason,
            resumed = f.resumed,
            "Failed open: offline work resumed"
        );
    }
}

impl Emit for Distrust {
    fn emit(&self, _: &mut Telemetry) {
        let d = self;
        if d.restored {
            info!(
                target: EVENTS,
                gpu = d.gpu,
                page = %d.page,
                owner = %d.owner,
                "Doorbell page trusted again: NVML showed its owner at work"
            );
        } else {
            warn!(
                target: EVENTS,
                gpu = d.gpu,
                page = %d.page,
                owner = %d.owner,
                claimed_s = d.claimed_s,
                nvml_seen_ns = d.nvml_seen_ns,
                "Doorbell page distrusted: it kept the GPU busy while NVML never showed its owner at work; its launches count for nothing until a sample does"
            );
        }
    }
}

/// A checkpoint or a restore: logged and counted by its note ([`crate::control::note::DriverCall`]).
impl Emit for DriverEvent {
    fn emit(&self, _: &mut Telemetry) {}
}

/// Logged and counted by its note ([`crate::control::note::Broken`]).
impl Emit for Escape {
    fn emit(&self, _: &mut Telemetry) {}
}
