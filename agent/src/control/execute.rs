//! A decision becomes holds and events: the facts each suspension's plan is chosen from,
//! gathered here ([`plan::choose`] chooses), and the preempt/release events that wait for
//! their holds' confirmations.

use super::bells::Bells;
use super::events::{Event, Preempt, Release, Tracker};
use super::gates::Gates;
use super::holds::HoldKey;
use super::note::{self, Note};
use super::plan;
use super::table::Table;
use super::target::Plan;
use crate::control::model::act::{Kind, Op};
use crate::control::model::ProcKey;
use qos_core::machine::Reason;
use qos_core::{Decision, Transition};
use std::collections::BTreeSet;

fn secs(ns: u64) -> f64 {
    ns as f64 / 1e9
}

/// The suspensions of a decision: (holder, plan), and (holder, reason), in order.
pub type Planned = (Vec<(ProcKey, Plan)>, Vec<(ProcKey, Reason)>);

/// The plan of each suspension, in the decision's order, with its reason: the facts
/// gathered — the table's (what the shell observed of the process's cgroup), the driver book's
/// (whether the driver's lock applies), the gate book's (the GPU's gate slot, for online
/// work busy there), the hold book's (what it had to freeze lately) — and the plan chosen
/// from them ([`plan::choose`]).
#[allow(clippy::too_many_arguments)]
pub fn plans(
    d: &Decision<ProcKey>,
    preferred: Kind,
    driver_book: &super::driver_book::DriverBook,
    book: &super::holds::HoldBook,
    table: &Table,
    gates: &Gates,
    bells: &Bells,
    now: u64,
    notes: &mut Vec<Note>,
) -> Planned {
    let mut reqs = Vec::new();
    let mut reasons = Vec::new();
    for (key, reason) in &d.suspend {
        let Some(entry) = table.entry(key) else {
            continue;
        };
        if !entry.cls.class.is_suspendable() || !entry.pinned {
            continue;
        }
        let gate = match reason {
            Reason::OnlineBusy { gpu } => gates.slot(table, bells, key, *gpu),
            Reason::ShareCap => None,
        };
        let plan = plan::choose(&plan::Facts {
            key: *key,
            preferred,
            cgroup: &entry.cgroup,
            lock: driver_book.would_lock(table, key),
            gate,
            remembered: book.remembered(key, entry.cgroup.whole_dir(), now),
        });
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
