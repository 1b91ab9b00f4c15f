//! Holds at a launch gate. The gate accelerates; it never decides: a closed gate bounds
//! what the process has in flight, and the hold itself is its fallback (the freezer or a
//! signal, recorded first), started as soon as the process acknowledges the close (its
//! work drained), or when `--gate-timeout` passes without an acknowledgement, or at once
//! when the gate cannot close (no free slot in the gate file). The gate stays closed beside
//! the fallback until the release, which resumes the fallback first and opens the gate
//! last. An acknowledgement is the tenant's word, so all it can do is bring the stop
//! sooner: a forged one gets the process no GPU time.

use super::{
    Completion, Confirm, Continuation, Escalation, Failure, HoldBook, HoldCmd, HoldKey, HoldRef,
    Means, Outcome, Progress, State,
};
use crate::control::model::act::{Kind, Op};
use crate::control::model::ProcKey;
use crate::control::note::{self, FailWhy};
use crate::control::target::Target;

impl HoldBook {
    /// The gate holds waiting for their drain (`Gated`): (process, GPU UUID) whose pages'
    /// acknowledgements the loop should read.
    pub fn wanted_acks(&self) -> Vec<(ProcKey, [u8; 16])> {
        self.holds
            .iter()
            .filter(|(_, h)| matches!(h.state, State::Gated { .. }))
            .filter_map(|(k, h)| match (k, h.members.first()) {
                (HoldKey::Gate(k), Some(Target::Gate { uuid, .. })) => Some((*k, *uuid)),
                _ => None,
            })
            .collect()
    }

    /// What the pages of `key` say for `uuid` (every `gate_ack` of its offline pages with
    /// an entry for the GPU): when every one equals the close's epoch, the work in flight
    /// has drained and the fallback holds the process from now on (`Gated` →
    /// `FallingBack`).
    pub fn gate_acks(&mut self, key: ProcKey, acks: &[u32]) {
        let key = HoldKey::Gate(key);
        let Some(hold) = self.holds.get(&key) else {
            return;
        };
        let State::Gated { epoch, .. } = hold.state else {
            return;
        };
        if acks.is_empty() || acks.iter().any(|a| *a != epoch) {
            return;
        }
        let serial = hold.serial;
        self.escalate_gate(HoldRef { key, serial }, Escalation::Drained);
    }

    /// A fresh gate hold's gate closed (`Closing`): `Gated`, waiting for the drain (the
    /// acknowledgement) until `--gate-timeout`; a gate that cannot close goes to its
    /// fallback at once.
    pub(super) fn closed_gate(&mut self, r: HoldRef, epoch: Option<u32>, now: u64) {
        let until_ns = now + self.gate_timeout.as_nanos() as u64;
        let Some(hold) = self.hold_mut(&r) else {
            return;
        };
        match epoch {
            Some(epoch) => hold.state = State::Gated { epoch, until_ns },
            // No free slot in the gate file (more GPUs than it holds): the fallback at
            // once, not a failure and a retry.
            None => self.escalate_gate(r, Escalation::CannotClose),
        }
    }

    /// Starts gate hold `r`'s fallback, for `why` (→ `FallingBack`): its members listed (a
    /// signalled cgroup), then recorded, then started.
    pub(super) fn escalate_gate(&mut self, r: HoldRef, why: Escalation) {
        let now = self.now_ns;
        let confirm_timeout = self.confirm_timeout;
        let Some(hold) = self.hold_mut(&r) else {
            return;
        };
        let Means::Gate { fallback } = std::mem::replace(&mut hold.means, Means::Plain) else {
            // A gate hold keeps its fallback until it starts: without one there is nothing
            // to escalate to, and the gate is confirmed until its deadline.
            debug_assert!(false, "a gate hold without its fallback: {:?}", r.key);
            hold.state = State::Confirming {
                confirm: Confirm::new(hold.members.clone(), now, confirm_timeout),
                looking: false,
            };
            return;
        };
        hold.state = State::FallingBack {
            plan: fallback.clone(),
            drained: why == Escalation::Drained,
        };
        let gates: Vec<String> = hold.members.iter().map(Target::to_string).collect();
        if let HoldKey::Gate(k) = &r.key {
            match why {
                Escalation::Drained => self.gate_answers.push((*k, true)),
                Escalation::Timeout => self.gate_answers.push((*k, false)),
                Escalation::CannotClose => {}
            }
        }
        if why == Escalation::Drained {
            self.notes.push(
                note::GateDrained {
                    hold: r.key.clone(),
                    fallback: fallback.kind(),
                }
                .into(),
            );
        } else {
            self.notes.push(
                note::GateEscalated {
                    gates,
                    fallback: fallback.kind(),
                    timeout: self.gate_timeout,
                    why,
                }
                .into(),
            );
        }
        match fallback.signalled_cgroup() {
            Some((dir, _)) => {
                let (dir, leader) = (dir.to_path_buf(), fallback.target());
                self.ask(Continuation::FallbackListed(r), |req| HoldCmd::Members {
                    req,
                    dir,
                    leader,
                });
            }
            None => {
                self.record_fallback(r, vec![fallback.target()]);
            }
        }
    }

    /// The fallback's members are known: record them first.
    pub(super) fn record_fallback(&mut self, r: HoldRef, members: Vec<Target>) {
        let entries = members.iter().map(Target::record).collect();
        self.ask(Continuation::FallbackRecorded(r, members), |req| {
            HoldCmd::RecordAdd { req, entries }
        });
    }

    /// The record answered for a fallback: start it, or fail open.
    pub(super) fn recorded_fallback(
        &mut self,
        r: HoldRef,
        members: Vec<Target>,
        ok: bool,
        now: u64,
    ) {
        if self.hold(&r).is_none() {
            // Released while the fallback's record was being written: nothing to stop,
            // and out of the record again.
            self.forget(&members);
            return;
        }
        if ok {
            let targets = members.clone();
            self.ask(Continuation::FallbackStarted(r, members), |req| {
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
        self.notes.push(note::FallbackNotRecorded.into());
        self.let_go_left(&members);
        self.notes.push(
            note::FailedOpen {
                why: FailWhy::Record,
            }
            .into(),
        );
        let Some(hold) = self.take(&r) else {
            return;
        };
        let kind = hold.kind;
        self.fail_suspension(&r.key, hold, Failure::Record, &[]);
        self.done.push(Completion {
            key: r.key,
            op: Op::Suspend,
            outcome: Outcome::Failed(Failure::Record),
            kind,
            at_ns: now,
        });
    }

    /// A fallback started (`FallingBack`): the hold is now its members' too, `Held` or
    /// `Confirming` (with the whole `--confirm-timeout` of its own), or it ends, undone.
    pub(super) fn started_fallback(
        &mut self,
        r: HoldRef,
        members: Vec<Target>,
        progress: Vec<Progress>,
        now: u64,
        at: u64,
    ) {
        let Some(h) = self.hold_mut(&r) else {
            return;
        };
        let State::FallingBack { plan, drained } = &h.state else {
            return;
        };
        // A drained gate keeps its label: the gate is what ended the work in flight.
        let kind = if *drained { Kind::Gate } else { plan.kind() };
        h.means = Means::of(plan);
        h.members.extend(members.iter().cloned());
        h.kind = kind;
        // The fallback's own confirmation gets the whole --confirm-timeout.
        self.settle_start(r, &members, &progress, now, at);
    }
}
