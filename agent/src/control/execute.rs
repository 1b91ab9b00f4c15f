//! A decision becomes holds and events: the plan of each suspension, assembled here and
//! nowhere else at suspension (the table's, vetted in rules mode; the driver's lock where
//! it applies; behind a gate where one applies), and the preempt/release events that wait
//! for their holds' confirmations.

use super::bells::Bells;
use super::events::{Event, Preempt, Release, Tracker};
use super::gates::Gates;
use super::holds::HoldKey;
use super::note::{self, Note};
use super::table::Table;
use super::target::Plan;
use crate::control::model::act::Op;
use crate::control::model::ProcKey;
use qos_core::machine::Reason;
use qos_core::{Decision, Transition};
use std::collections::BTreeSet;

fn secs(ns: u64) -> f64 {
    ns as f64 / 1e9
}

/// A plan to vet: (holder, plan).
pub type ToVet = (ProcKey, Plan);

/// The suspensions whose plan freezes or stops a whole cgroup: membership may have
/// changed since classification, so the shell checks them again (rules mode) before they
/// are used: (holder, plan, the holder alone).
pub fn to_vet(d: &Decision<ProcKey>, table: &Table) -> Vec<ToVet> {
    d.suspend
        .iter()
        .filter_map(|(key, _)| {
            let e = table.entry(key)?;
            let plan = e.plan.clone()?;
            e.pinned.then_some(())?;
            matches!(plan, Plan::Freeze(_) | Plan::SignalCgroup { .. }).then(|| (*key, plan))
        })
        .collect()
}

/// The suspensions of a decision: (holder, plan), and (holder, reason), in order.
pub type Planned = (Vec<(ProcKey, Plan)>, Vec<(ProcKey, Reason)>);

/// The plan of each suspension, in the decision's order (`vetted` replaces a whole-cgroup
/// plan), with its reason.
pub fn plans(
    d: &Decision<ProcKey>,
    vault: &super::vault::Vault,
    table: &Table,
    gates: &Gates,
    bells: &Bells,
    vetted: &[(ProcKey, Plan)],
    notes: &mut Vec<Note>,
) -> Planned {
    let mut reqs = Vec::new();
    let mut reasons = Vec::new();
    for (key, reason) in &d.suspend {
        let Some(entry) = table.entry(key) else {
            continue;
        };
        let (Some(plan), true) = (entry.plan.clone(), entry.pinned) else {
            continue;
        };
        let plan = vetted
            .iter()
            .find(|(k, _)| k == key)
            .map_or(plan, |(_, p)| p.clone());
        // The driver's lock where it applies (its refusal leaves the table's plan).
        let plan = vault.plan(table, key, plan);
        let plan = match reason {
            Reason::OnlineBusy { gpu } => gates.plan(table, bells, key, *gpu, plan),
            Reason::ShareCap => plan,
        };
        notes.push(note::Suspending { reason: *reason }.into());
        reqs.push((*key, plan));
        reasons.push((*key, *reason));
    }
    (reqs, reasons)
}

/// What an event needs besides the transition.
#[derive(Debug, Clone, Copy)]
pub struct Context {
    /// `--dry-run`.
    pub dry_run: bool,
    /// The idle window, ns.
    pub window_ns: u64,
    /// The loop's sleep before this tick.
    pub slept: Option<(u64, u64)>,
}

/// Opens the event of each transition, waiting for the holds this decision started for
/// it: suspensions for the busy GPU, resumptions of its processes. Events with nothing to
/// wait for are finished at once (`out`).
#[allow(clippy::too_many_arguments)]
pub fn open_events(
    transitions: &[Transition],
    started: &[(ProcKey, HoldKey)],
    resumed: &[(ProcKey, HoldKey)],
    reasons: &[(ProcKey, Reason)],
    cx: Context,
    table: &mut Table,
    tracker: &mut Tracker,
    notes: &mut Vec<Note>,
    out: &mut Vec<Event>,
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
                notes.push(
                    note::Detected {
                        gpu,
                        signal,
                        seconds: secs(detection),
                    }
                    .into(),
                );
                let holds: BTreeSet<HoldKey> = started
                    .iter()
                    .filter(|(holder, _)| reasons.contains(&(*holder, Reason::OnlineBusy { gpu })))
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
                    dry_run: cx.dry_run,
                    confirmed_ns: None,
                    actuation_s: None,
                    preemption_s: None,
                    slept_ns: cx.slept.map(|s| s.0),
                    woke_ns: cx.slept.map(|s| s.1),
                });
                tracker.open(ev, Op::Suspend, holds)
            }
            Transition::Release {
                gpu,
                window_end,
                decided_at,
                busy_for,
                offline,
                window,
            } => {
                // The busy period is over: the next one's onset is its own evidence, not
                // the start of a chain of samples that spans both.
                table.end_runs(gpu);
                let holds: BTreeSet<HoldKey> = resumed
                    .iter()
                    .filter(|(holder, _)| {
                        table.entry(holder).is_some_and(|e| e.gpus.contains(&gpu))
                    })
                    .map(|(_, k)| k.clone())
                    .collect();
                let ev = Event::Release(Release {
                    gpu,
                    window_end_ns: window_end,
                    decided_ns: decided_at,
                    idle_window_ns: cx.window_ns,
                    window_ns: window,
                    learned: window < cx.window_ns,
                    busy_for_s: secs(busy_for),
                    offline,
                    actuator: None,
                    dry_run: cx.dry_run,
                    confirmed_ns: None,
                    release_s: None,
                });
                tracker.open(ev, Op::Resume, holds)
            }
        };
        out.extend(opened);
    }
}
