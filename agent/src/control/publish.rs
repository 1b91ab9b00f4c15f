//! What the controller shows: per-GPU summaries of the latest decision (the gauges and
//! the time accounting) and the controller's part of the `/state` document. The shell adds
//! what telemetry keeps (the event history, the latency summaries, the degraded reason).

use super::state::{GpuDoc, ProcDoc, StateDoc};
use super::table::Table;
use crate::control::model::ProcKey;
use qos_core::{Class, GpuState, Machine};

/// One GPU as of the latest decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuSummary {
    /// GPU.
    pub gpu: u32,
    /// Online busy.
    pub busy: bool,
    /// Offline processes on it.
    pub offline: usize,
    /// Of those, suspended.
    pub suspended: usize,
}

/// Per GPU, from the latest decision's inputs.
pub fn summarise(
    inputs: &[qos_core::GpuInput<ProcKey>],
    machine: &Machine<ProcKey>,
    out: &mut Vec<GpuSummary>,
) {
    out.clear();
    for input in inputs {
        let busy = matches!(machine.state(input.gpu), GpuState::OnlineBusy { .. });
        let (mut offline, mut suspended) = (0, 0);
        for p in input.procs.iter().filter(|p| p.class == Class::Offline) {
            offline += 1;
            if machine.suspended().contains_key(&p.key) {
                suspended += 1;
            }
        }
        out.push(GpuSummary {
            gpu: input.gpu,
            busy,
            offline,
            suspended,
        });
    }
}

/// The document's own settings.
#[derive(Debug, Clone)]
pub struct Header {
    /// Node name.
    pub node: String,
    /// `--actuator`.
    pub actuator: crate::control::model::act::Kind,
    /// `--dry-run`.
    pub dry_run: bool,
    /// The idle window, ns.
    pub window_ns: u64,
}

/// The controller's part of `/state` at `now`.
#[allow(clippy::too_many_arguments)]
pub fn state_doc(
    now: u64,
    h: &Header,
    gpus: &[(u32, String)],
    machine: &Machine<ProcKey>,
    table: &Table,
    degraded: impl Fn(u32) -> bool,
    held: usize,
    distrusted: Vec<super::state::DistrustedPage>,
) -> StateDoc {
    let ms_ago = |t: u64| now.saturating_sub(t) as f64 / 1e6;
    let gpus = gpus
        .iter()
        .map(|(g, uuid)| {
            let g = *g;
            let state = machine.state(g);
            let (since, last_online) = match state {
                GpuState::OnlineBusy { since, last_online } => (Some(since), Some(last_online)),
                GpuState::OfflineRunning => (None, None),
            };
            let mut processes: Vec<ProcDoc> = table
                .entries()
                .filter(|e| e.gpus.contains(&g))
                .map(|e| ProcDoc {
                    pid: e.key.pid,
                    class: e.cls.class,
                    owner: e.cls.owner.clone(),
                    cmd: e.cmd.clone(),
                    suspended: machine.suspended().contains_key(&e.key),
                    actuator: e.stop(h.actuator).map(|s| s.kind()),
                    last_active_ms_ago: e.last_active.get(&g).map(|t| ms_ago(*t)),
                    driver: None,
                    checkpointed_bytes: None,
                    container: e.cls.container.clone(),
                    shim: None,
                    escaping: false,
                    gate: None,
                })
                .collect();
            processes.sort_by_key(|p| p.pid);
            GpuDoc {
                index: g,
                uuid: uuid.clone(),
                state: state.as_str().into(),
                since,
                last_online,
                degraded: degraded(g),
                processes,
                release_window_ms: machine.release_window(g) as f64 / 1e6,
                ..GpuDoc::default()
            }
        })
        .collect();
    StateDoc {
        node: h.node.clone(),
        actuator: Some(h.actuator),
        dry_run: h.dry_run,
        idle_window_ms: h.window_ns as f64 / 1e6,
        suspended_targets: held,
        updated_ns: now,
        gpus,
        distrusted_pages: distrusted,
        ..StateDoc::default()
    }
}
