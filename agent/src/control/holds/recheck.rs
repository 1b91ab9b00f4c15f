//! Suspensions that hold: a started hold's targets are checked again while it is held,
//! and stopped again when something resumed them (a sibling process in the pod sending
//! SIGCONT, a tenant writing to a delegated `cgroup.freeze`).
//!
//! Every `--recheck-interval` (default [`RECHECK_NS`], 10 ms) the loop re-checks at most
//! [`RECHECK_TARGETS_PER_TICK`] held targets, round robin (with 64 held processes each is
//! checked about every 320 ms), and every hold that was found broken once. A hold by
//! signal whose processes keep resuming themselves takes its backstop after
//! [`ESCALATE_AFTER`] breaks (the freezer: SIGCONT cannot thaw a frozen cgroup; see
//! [`super::signal`]); it is recorded before it is frozen, like any suspension.
//!
//! Why not every hold every time: reading `/proc/<pid>/stat` of a held process costs
//! 3-15 µs; 64 of them every 10 ms would cost a twentieth of a core. The default interval
//! was 5 ms; 10 ms halves the loop's wake-ups while something is held (on the 8 × 8
//! benchmark, about 0.9 points of a core), and a cgroup that keeps resuming itself is
//! still frozen within a few intervals.

use super::signal::ESCALATE_AFTER;
use super::{Continuation, HoldBook, HoldCmd, HoldKey, HoldRef, Progress};
use crate::control::model::act::Op;
use crate::control::target::Target;

/// How often a hold that never broke is checked, by default.
pub const RECHECK_NS: u64 = 10_000_000;
/// How many held targets (processes, cgroups) are checked in one re-check at most, besides
/// the holds already found broken: bounds the cost (a `/proc/<pid>/stat` read is a few
/// µs) whatever the number of held processes.
pub const RECHECK_TARGETS_PER_TICK: usize = 2;
/// How many holds one tick looks at, at most, to find the due ones.
pub const RECHECK_SCAN: usize = 16;

impl super::Hold {
    /// What a re-check looks at: its freezers once it has one (a frozen process is not in
    /// the stopped state, and cannot run), else every member.
    fn checked_members(&self) -> Vec<Target> {
        let frozen = self.freezers();
        if frozen.is_empty() {
            self.members.clone()
        } else {
            frozen
        }
    }
}

impl HoldBook {
    /// Looks at the holds that are due; what runs is stopped again when the answer comes,
    /// and repeat offenders escalated.
    pub fn recheck(&mut self, now: u64) {
        self.now_ns = now;
        // A loop awake anyway in the last quarter of the interval re-checks now: one
        // wake-up instead of two close together.
        if self.started().next().is_none() || now + self.recheck_ns / 4 < self.next_recheck_ns {
            return;
        }
        self.next_recheck_ns = now + self.recheck_ns;
        for r in self.due_for_recheck(now) {
            let Some(hold) = self.hold_mut(&r) else {
                continue;
            };
            hold.checked_ns = now;
            let targets = hold.checked_members();
            // A signalled cgroup not frozen yet: a process that joined it since (a child
            // forked after the stop) runs until it is found and stopped as well.
            let regroup = match (&r.key, hold.members.first()) {
                (HoldKey::Group(dir), Some(leader))
                    if !hold
                        .members
                        .iter()
                        .any(|t| matches!(t, Target::Cgroup { .. })) =>
                {
                    Some((dir.clone(), leader.clone()))
                }
                _ => None,
            };
            self.ask(Continuation::Rechecked(r.clone()), |req| HoldCmd::Check {
                req,
                op: Op::Suspend,
                targets,
            });
            if let Some((dir, leader)) = regroup {
                self.ask(Continuation::Regrouped(r), |req| HoldCmd::Members {
                    req,
                    dir,
                    leader,
                });
            }
        }
    }

    /// A held hold was looked at: stop again what runs; freeze a signalled cgroup that
    /// keeps resuming itself.
    pub(super) fn rechecked(&mut self, r: HoldRef, state: Vec<Progress>) {
        let Some(hold) = self.hold_mut(&r) else {
            return;
        };
        let running: Vec<Target> = hold
            .checked_members()
            .into_iter()
            .zip(&state)
            // A gate holds nothing (its fallback does): there is nothing behind it to find
            // running.
            .filter(|(t, p)| matches!(p, Progress::Pending) && !matches!(t, Target::Gate { .. }))
            .map(|(t, _)| t)
            .collect();
        // Found running with no freezer holding it: the tenant may be running now.
        hold.escaping = !running.is_empty();
        if running.is_empty() {
            return;
        }
        let broken = hold.broke(running.len());
        let escalates = hold.breaks >= ESCALATE_AFTER;
        self.ask(Continuation::Restopped, |req| HoldCmd::Start {
            req,
            op: Op::Suspend,
            targets: running,
            budget: std::time::Duration::ZERO,
        });
        if escalates {
            self.escalate(r, broken);
        } else {
            self.broken.push(broken);
        }
    }

    /// The holds to re-check now: round robin from a cursor, at most
    /// RECHECK_TARGETS_PER_TICK targets and only those not checked for an interval, then
    /// every hold found broken before.
    fn due_for_recheck(&mut self, now: u64) -> Vec<HoldRef> {
        // Broken holds at every re-check; the others round-robin from a cursor, at most
        // RECHECK_TARGETS_PER_TICK targets a re-check and only when due (so the cost does
        // not grow with the number of held processes, nor with how often the loop wakes:
        // with many holds, each is checked less often), looking at no more than
        // RECHECK_SCAN holds.
        let mut due: Vec<HoldRef> = Vec::new();
        let mut budget = RECHECK_TARGETS_PER_TICK;
        let start = self.recheck_cursor.take();
        let after = start
            .clone()
            .map(std::ops::Bound::Excluded)
            .unwrap_or(std::ops::Bound::Unbounded);
        let started = self.started().count();
        let ring = self
            .holds
            .range((after, std::ops::Bound::Unbounded))
            .chain(self.holds.iter())
            .filter(|(_, h)| h.state.started())
            .take(started.min(RECHECK_SCAN));
        let mut last = None;
        for (k, h) in ring {
            // The cursor stays on the last hold looked at: one left for want of budget is
            // the first of the next re-check (it was skipped for good when each hold
            // filled the budget, as gate holds of two targets do).
            if budget == 0 {
                break;
            }
            last = Some(k.clone());
            if h.breaks == 0
                && now.saturating_sub(h.checked_ns) + self.recheck_ns / 4 >= self.recheck_ns
                && !h.state.polled()
            {
                budget = budget.saturating_sub(h.members.len());
                due.push(HoldRef {
                    key: k.clone(),
                    serial: h.serial,
                });
            }
        }
        self.recheck_cursor = last.or(start);
        due.extend(
            self.started()
                .filter(|(_, h)| h.breaks > 0)
                .map(|(k, h)| HoldRef {
                    key: k.clone(),
                    serial: h.serial,
                }),
        );
        due
    }
}
