//! How holds start: the members of a plan, the record written first, then the actuator.

use super::{
    members_progress, pending_members, Completion, Continuation, Failure, Hold, HoldBook, HoldCmd,
    HoldKey, Outcome, Pending, Progress, Started,
};
use crate::control::model::act::{Op, RecordEntry};
use crate::control::model::ProcKey;
use crate::control::note::{FailWhy, Note};
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
            // A signalled cgroup that resumed itself recently is frozen at once.
            let plan = &self.remembered(plan);
            let key = plan.hold_key();
            if let Some(h) = self.held.get_mut(&key) {
                h.holders.insert(*holder);
                continue;
            }
            out.started.push((*holder, key.clone()));
            if let Some(h) = self.staged.get_mut(&key) {
                h.holders.insert(*holder);
                continue;
            }
            let hold = Hold {
                serial: self.serial(),
                members: Vec::new(),
                holders: BTreeSet::from([*holder]),
                kind: plan.kind(),
                escalate: plan
                    .signalled_cgroup()
                    .map(|(dir, version)| Target::Cgroup {
                        dir: dir.to_path_buf(),
                        version,
                        cell: None,
                    }),
                fallback: plan.fallback(),
                epoch: None,
                checked_ns: now,
                breaks: 0,
                escaping: false,
                cell_asked: false,
                alone: plan.stops_alone(),
            };
            self.staged.insert(key.clone(), hold);
            match plan.signalled_cgroup() {
                Some((dir, _)) => {
                    self.ask(Continuation::Materialised(key), |req| HoldCmd::Members {
                        req,
                        dir: dir.to_path_buf(),
                        leader: plan.target(),
                    })
                }
                None => {
                    if let Some(h) = self.staged.get_mut(&key) {
                        h.members = vec![plan.target()];
                    }
                    self.to_record.push(key);
                }
            }
        }
        self.record_staged();
        out
    }

    /// Asks the record to hold every fresh hold whose members are known, one request per
    /// hold: a hold whose entries are on disk already is answered at once and does not
    /// wait for another's write (the record book makes one write of whatever is missing).
    pub(super) fn record_staged(&mut self) {
        for key in std::mem::take(&mut self.to_record) {
            let Some(h) = self.staged.get(&key) else {
                continue;
            };
            let entries: Vec<RecordEntry> = h.members.iter().map(Target::record).collect();
            self.ask(Continuation::RecordedFresh(vec![key]), |req| {
                HoldCmd::RecordAdd { req, entries }
            });
        }
    }

    /// The record answered for fresh holds: start suspending them, or fail them all.
    pub(super) fn recorded_fresh(&mut self, keys: Vec<HoldKey>, ok: bool, now: u64) {
        if !ok {
            self.notes.push(Note::NotRecorded {
                targets: keys.len(),
            });
            self.notes.push(Note::FailedOpen(FailWhy::Record));
            for key in keys {
                if let Some(h) = self.staged.remove(&key) {
                    self.failed.extend(h.holders.iter().copied());
                    self.done.push(Completion {
                        key,
                        op: Op::Suspend,
                        outcome: Outcome::Failed(Failure::Record),
                        kind: h.kind,
                        at_ns: now,
                    });
                }
            }
            return;
        }
        self.to_start.extend(keys);
    }

    /// Starts suspending the fresh holds recorded since the last call: gates are closed,
    /// the rest started in one batch.
    pub(super) fn start_recorded(&mut self) {
        let mut counts = Vec::new();
        let mut targets = Vec::new();
        for key in std::mem::take(&mut self.to_start) {
            let Some(h) = self.staged.get(&key) else {
                continue;
            };
            if let [gate @ Target::Gate { .. }] = &h.members[..] {
                let gate = gate.clone();
                self.ask(Continuation::ClosedGate(key), |req| HoldCmd::CloseGate {
                    req,
                    gate,
                });
                continue;
            }
            targets.extend(h.members.iter().cloned());
            counts.push((key, h.members.len()));
        }
        if counts.is_empty() {
            return;
        }
        self.ask(Continuation::StartedFresh(counts), |req| HoldCmd::Start {
            req,
            op: Op::Suspend,
            targets,
            budget: std::time::Duration::ZERO,
        });
    }

    /// The actuator started fresh holds' suspensions: each is held, pending, escalated to
    /// its fallback (a gate that cannot close), or failed and undone.
    pub(super) fn started_fresh(
        &mut self,
        counts: Vec<(HoldKey, usize)>,
        progress: Vec<Progress>,
        now: u64,
        at: u64,
    ) {
        let mut progress = progress.into_iter();
        for (key, n) in counts {
            let p: Vec<Progress> = progress.by_ref().take(n).collect();
            let Some(hold) = self.staged.remove(&key) else {
                continue;
            };
            match members_progress(&p) {
                None => {
                    let mut pending = Pending::new(
                        key.clone(),
                        hold.serial,
                        Op::Suspend,
                        hold.kind,
                        pending_members(&hold.members, &p),
                        hold.members.clone(),
                        now,
                        self.confirm_timeout,
                    );
                    if hold.fallback.is_some() {
                        pending.escalate_ns = Some(now + self.gate_timeout.as_nanos() as u64);
                    }
                    self.pending.push(pending);
                    self.held.insert(key, hold);
                }
                Some(Outcome::Failed(Failure::NoGate)) if hold.fallback.is_some() => {
                    // The gate cannot close (no free slot in the gate file: more GPUs
                    // than it holds): the fallback at once, not a failure and a retry.
                    let pending = Pending::new(
                        key.clone(),
                        hold.serial,
                        Op::Suspend,
                        hold.kind,
                        Vec::new(),
                        hold.members.clone(),
                        now,
                        self.confirm_timeout,
                    );
                    self.held.insert(key, hold);
                    self.escalate_gate(pending, super::Escalation::CannotClose);
                }
                Some(Outcome::Failed(reason)) => {
                    let kind = hold.kind;
                    self.fail_suspension(&key, hold, reason, &p);
                    self.done.push(Completion {
                        key,
                        op: Op::Suspend,
                        outcome: Outcome::Failed(reason),
                        kind,
                        at_ns: at,
                    });
                }
                Some(outcome) => {
                    let kind = hold.kind;
                    self.held.insert(key.clone(), hold);
                    self.done.push(Completion {
                        key,
                        op: Op::Suspend,
                        outcome,
                        kind,
                        at_ns: at,
                    });
                }
            }
        }
    }

    /// A fresh gate hold's gate closed: wait for the drain (the acknowledgement) until
    /// `--gate-timeout`; a gate that cannot close goes to its fallback at once.
    pub(super) fn closed_gate(&mut self, key: HoldKey, epoch: Option<u32>, now: u64) {
        let Some(mut hold) = self.staged.remove(&key) else {
            return;
        };
        hold.epoch = epoch;
        let mut pending = Pending::new(
            key.clone(),
            hold.serial,
            Op::Suspend,
            hold.kind,
            hold.members.clone(),
            hold.members.clone(),
            now,
            self.confirm_timeout,
        );
        self.held.insert(key, hold);
        match epoch {
            Some(_) => {
                pending.escalate_ns = Some(now + self.gate_timeout.as_nanos() as u64);
                self.pending.push(pending);
            }
            // No free slot in the gate file (more GPUs than it holds): the fallback at
            // once, not a failure and a retry.
            None => {
                pending.members.clear();
                self.escalate_gate(pending, super::Escalation::CannotClose);
            }
        }
    }
}
