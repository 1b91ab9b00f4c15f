//! How holds start: the members of a plan, the record written first, then the actuator
//! (`Listing` → `Listed` → `Recording` → `Recorded` → `Starting` → `Held` or `Confirming`).
//! A gate's close and fallback are [`super::gate`]'s.

use super::{
    members_progress, pending_members, Completion, Confirm, Continuation, Failure, Hold, HoldBook,
    HoldCmd, HoldRef, Means, Outcome, Progress, Started, State,
};
use crate::control::model::act::{Op, RecordEntry};
use crate::control::model::ProcKey;
use crate::control::note::{self, FailWhy};
use crate::control::target::Plan;
use crate::control::target::Target;
use std::collections::BTreeSet;

impl HoldBook {
    /// Suspends on behalf of `reqs` (holder, plan) at `now`: asks for the members of
    /// signalled cgroups, then for the record, and only then for the actuator. Returns the
    /// holds whose suspension starts now (a holder joining a hold already held is not
    /// among them).
    pub fn suspend(&mut self, reqs: &[(ProcKey, Plan)], now: u64) -> Started {
        self.now_ns = now;
        let mut out = Started::default();
        for (holder, plan) in reqs {
            let key = plan.hold_key();
            if let Some(h) = self.holds.get_mut(&key) {
                // Joining a hold on its way counts as a start for this holder.
                if !h.state.started() {
                    out.started.push((*holder, key.clone()));
                }
                h.holders.insert(*holder);
                continue;
            }
            out.started.push((*holder, key.clone()));
            let listing = plan.signalled_cgroup().is_some();
            let hold = Hold {
                serial: self.serial(),
                state: if listing {
                    State::Listing
                } else {
                    State::Listed
                },
                means: Means::of(plan),
                members: if listing {
                    Vec::new()
                } else {
                    vec![plan.target()]
                },
                holders: BTreeSet::from([*holder]),
                kind: plan.kind(),
                checked_ns: now,
                breaks: 0,
                escaping: false,
            };
            let r = self.add(key, hold);
            if let Some((dir, _)) = plan.signalled_cgroup() {
                self.ask(Continuation::Listed(r), |req| HoldCmd::Members {
                    req,
                    dir: dir.to_path_buf(),
                    leader: plan.target(),
                });
            }
        }
        self.record_listed();
        out
    }

    /// Asks the record to hold every fresh hold whose members are known (`Listed` →
    /// `Recording`), one request per hold: a hold whose entries are on disk already is
    /// answered at once and does not wait for another's write (the record book makes one
    /// write of whatever is missing).
    pub(super) fn record_listed(&mut self) {
        for r in self.in_state(|s| matches!(s, State::Listed)) {
            let Some(h) = self.hold_mut(&r) else {
                continue;
            };
            h.state = State::Recording;
            let entries: Vec<RecordEntry> = h.members.iter().map(Target::record).collect();
            self.ask(Continuation::Recorded(r), |req| HoldCmd::RecordAdd {
                req,
                entries,
            });
        }
    }

    /// The record answered for a fresh hold: `Recorded` (started at the end of the step),
    /// or it ends, failed.
    pub(super) fn recorded_fresh(&mut self, r: HoldRef, ok: bool, now: u64) {
        if ok {
            if let Some(h) = self.hold_mut(&r) {
                h.state = State::Recorded;
            }
            return;
        }
        self.notes.push(note::NotRecorded { targets: 1 }.into());
        self.notes.push(
            note::FailedOpen {
                why: FailWhy::Record,
            }
            .into(),
        );
        if let Some(h) = self.take(&r) {
            self.let_go_left(&h.members);
            self.failed.extend(h.holders.iter().copied());
            self.done.push(Completion {
                key: r.key,
                op: Op::Suspend,
                outcome: Outcome::Failed(Failure::Record),
                kind: h.kind,
                at_ns: now,
            });
        }
    }

    /// Starts suspending the fresh holds recorded since the last call (`Recorded` →
    /// `Starting`, in one batch; a gate → `Closing`).
    pub(super) fn start_recorded(&mut self) {
        let mut counts = Vec::new();
        let mut targets = Vec::new();
        for r in self.in_state(|s| matches!(s, State::Recorded)) {
            let Some(h) = self.hold_mut(&r) else {
                continue;
            };
            if let [gate @ Target::Gate { .. }] = &h.members[..] {
                let gate = gate.clone();
                h.state = State::Closing;
                self.ask(Continuation::GateClosed(r), |req| HoldCmd::CloseGate {
                    req,
                    gate,
                });
                continue;
            }
            h.state = State::Starting;
            targets.extend(h.members.iter().cloned());
            counts.push((r, h.members.len()));
        }
        if counts.is_empty() {
            return;
        }
        self.ask(Continuation::Started(counts), |req| HoldCmd::Start {
            req,
            op: Op::Suspend,
            targets,
            budget: std::time::Duration::ZERO,
        });
    }

    /// The actuator started fresh holds' suspensions (`Starting`).
    pub(super) fn started_fresh(
        &mut self,
        counts: Vec<(HoldRef, usize)>,
        progress: Vec<Progress>,
        now: u64,
        at: u64,
    ) {
        let mut progress = progress.into_iter();
        for (r, n) in counts {
            let p: Vec<Progress> = progress.by_ref().take(n).collect();
            let Some(members) = self.hold(&r).map(|h| h.members.clone()) else {
                continue;
            };
            self.settle_start(r, &members, &p, now, at);
        }
    }

    /// A suspension's `Start` answered with `p` for `started` (a fresh hold's members, or
    /// its gate's fallback): `Held` once done, `Confirming` while some are pending, or the
    /// hold ends, failed and undone.
    pub(super) fn settle_start(
        &mut self,
        r: HoldRef,
        started: &[Target],
        p: &[Progress],
        now: u64,
        at: u64,
    ) {
        let confirm_timeout = self.confirm_timeout;
        let Some(hold) = self.hold_mut(&r) else {
            return;
        };
        let kind = hold.kind;
        let Some(outcome) = members_progress(p) else {
            let pending = pending_members(started, p);
            hold.state = State::Confirming {
                confirm: Confirm::new(pending, now, confirm_timeout),
                looking: false,
            };
            return;
        };
        match &outcome {
            Outcome::Failed(reason) => {
                let reason = *reason;
                if let Some(hold) = self.take(&r) {
                    self.fail_suspension(&r.key, hold, reason, p);
                }
            }
            _ => hold.state = State::Held,
        }
        self.done.push(Completion {
            key: r.key,
            op: Op::Suspend,
            outcome,
            kind,
            at_ns: at,
        });
    }
}
