//! Holds at a launch gate. The gate accelerates; it never decides: a closed gate bounds
//! what the process has in flight, and the hold itself is its fallback (the freezer or a
//! signal, recorded first), started as soon as the process acknowledges the close (its
//! work drained), or when `--gate-timeout` passes without an acknowledgement, or at once
//! when the gate cannot close (no free slot in the gate file). The gate stays closed beside
//! the fallback until the release, which resumes the fallback first and opens the gate
//! last. An acknowledgement is the tenant's word, so all it can do is bring the stop
//! sooner: a forged one gets the process no GPU time.

use super::{
    members_progress, pending_members, Completion, Continuation, Escalation, Failure, HoldBook,
    HoldCmd, HoldKey, Outcome, Pending, Progress,
};
use crate::control::model::act::{Kind, Op};
use crate::control::model::ProcKey;
use crate::control::note::{FailWhy, Note};
use crate::control::target::Plan;
use crate::control::target::Target;

impl HoldBook {
    /// The gate holds waiting for their drain: (process, GPU UUID) whose pages' acknowledgements
    /// the loop should read.
    pub fn wanted_acks(&self) -> Vec<(ProcKey, [u8; 16])> {
        self.pending
            .iter()
            .filter(|p| p.escalate_ns.is_some())
            .filter_map(|p| match (&p.key, p.all.first()) {
                (HoldKey::Gate(k), Some(Target::Gate { uuid, .. })) => Some((*k, *uuid)),
                _ => None,
            })
            .collect()
    }

    /// What the pages of `key` say for `uuid` (every `gate_ack` of its offline pages with
    /// an entry for the GPU): when every one equals the close's epoch, the work in flight
    /// has drained and the fallback holds the process from now on.
    pub fn gate_acks(&mut self, key: ProcKey, acks: &[u32]) {
        let hold = HoldKey::Gate(key);
        let Some(epoch) = self.held.get(&hold).and_then(|h| h.epoch) else {
            return;
        };
        if acks.is_empty() || acks.iter().any(|a| *a != epoch) {
            return;
        }
        let Some(i) = self
            .pending
            .iter()
            .position(|p| p.key == hold && p.escalate_ns.is_some())
        else {
            return;
        };
        let p = self.pending.remove(i);
        self.escalate_gate(p, Escalation::Drained);
    }

    /// Starts pending gate suspension `p`'s fallback, for `why`; when there is nothing to
    /// escalate to, `p` waits until its deadline.
    pub(super) fn escalate_gate(&mut self, mut p: Pending, why: Escalation) {
        p.escalate_ns = None;
        p.drained = why == Escalation::Drained;
        let Some(fallback) = self.held.get_mut(&p.key).and_then(|h| h.fallback.take()) else {
            self.pending.push(p);
            return;
        };
        // The gate is not waited for any more: only the fallback's members are.
        p.members.clear();
        if let HoldKey::Gate(k) = &p.key {
            match why {
                Escalation::Drained => self.gate_answers.push((*k, true)),
                Escalation::Timeout => self.gate_answers.push((*k, false)),
                Escalation::CannotClose => {}
            }
        }
        if why == Escalation::Drained {
            self.notes.push(Note::GateDrained {
                hold: p.key.clone(),
                fallback: fallback.kind(),
            });
        } else {
            self.notes.push(Note::GateEscalated {
                gates: p.all.iter().map(Target::to_string).collect(),
                fallback: fallback.kind(),
                timeout: self.gate_timeout,
                why,
            });
        }
        match fallback.signalled_cgroup() {
            Some((dir, _)) => {
                let (dir, leader) = (dir.to_path_buf(), fallback.target());
                self.ask(Continuation::FallbackMembers(p, fallback), |req| {
                    HoldCmd::Members { req, dir, leader }
                });
            }
            None => {
                let members = vec![fallback.target()];
                self.record_fallback(p, fallback, members);
            }
        }
    }

    /// The fallback's members are known: record them first.
    pub(super) fn record_fallback(&mut self, p: Pending, fallback: Plan, members: Vec<Target>) {
        let entries = members.iter().map(Target::record).collect();
        self.ask(
            Continuation::RecordedFallback(p, fallback, members),
            |req| HoldCmd::RecordAdd { req, entries },
        );
    }

    /// The record answered for a fallback: start it, or fail open.
    pub(super) fn recorded_fallback(
        &mut self,
        p: Pending,
        fallback: Plan,
        members: Vec<Target>,
        ok: bool,
        now: u64,
    ) {
        if !self.current(&p.key, p.serial) {
            // Released while the fallback's record was being written: nothing to stop,
            // and out of the record again.
            self.forget(&members);
            return;
        }
        if ok {
            let targets = members.clone();
            self.ask(Continuation::StartedFallback(p, fallback, members), |req| {
                HoldCmd::Start {
                    req,
                    op: Op::Suspend,
                    targets,
                    budget: std::time::Duration::ZERO,
                }
            });
            return;
        }
        // A gate holds nothing by itself: without its fallback the process is not held.
        // Fail open (the gate opens with the undo); the holder is retried.
        self.notes.push(Note::FallbackNotRecorded);
        self.notes.push(Note::FailedOpen(FailWhy::Record));
        let Some(hold) = self.held.remove(&p.key) else {
            return;
        };
        let kind = hold.kind;
        self.fail_suspension(&p.key, hold, Failure::Record, &[]);
        self.done.push(Completion {
            key: p.key,
            op: Op::Suspend,
            outcome: Outcome::Failed(Failure::Record),
            kind,
            at_ns: now,
        });
    }

    /// A fallback started: the hold is now its members' too.
    pub(super) fn started_fallback(
        &mut self,
        mut p: Pending,
        fallback: Plan,
        members: Vec<Target>,
        progress: Vec<Progress>,
        now: u64,
        at: u64,
    ) {
        // A drained gate keeps its label: the gate is what ended the work in flight.
        let kind = if p.drained {
            Kind::Gate
        } else {
            fallback.kind()
        };
        if let Some(h) = self.held.get_mut(&p.key) {
            h.members.extend(members.iter().cloned());
            h.kind = kind;
            if let Some((dir, version)) = fallback.signalled_cgroup() {
                h.escalate = Some(Target::Cgroup {
                    dir: dir.to_path_buf(),
                    version,
                    cell: None,
                });
            }
        }
        p.kind = kind;
        p.all.extend(members.iter().cloned());
        // The fallback's own confirmation gets the whole --confirm-timeout.
        p.deadline_ns = now + self.confirm_timeout.as_nanos() as u64;
        p.started_ns = now;
        match members_progress(&progress) {
            None => {
                p.members = pending_members(&members, &progress);
                p.gap_ns = super::CHECK_FIRST_NS;
                p.next_check_ns = now + p.gap_ns;
                self.pending.push(p);
            }
            Some(Outcome::Failed(reason)) => {
                if let Some(hold) = self.held.remove(&p.key) {
                    self.fail_suspension(&p.key, hold, reason, &progress);
                }
                self.done.push(Completion {
                    key: p.key,
                    op: Op::Suspend,
                    outcome: Outcome::Failed(reason),
                    kind,
                    at_ns: at,
                });
            }
            Some(outcome) => self.done.push(Completion {
                key: p.key,
                op: Op::Suspend,
                outcome,
                kind,
                at_ns: at,
            }),
        }
    }
}
