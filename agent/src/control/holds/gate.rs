//! Holds at a launch gate: a close that its process does not acknowledge within
//! `--gate-timeout` escalates to the hold's fallback (freezer or signals, recorded first),
//! and the gate stays closed beside it until the release. A gate that cannot close at
//! all (no free slot in the gate file) escalates at once.

use super::{
    members_progress, pending_members, Completion, Failure, HoldBook, HoldCmd, Outcome, Pending,
    Progress, Then,
};
use crate::control::target::Plan;
use crate::edges::actuator::{Op, Target};
use tracing::{error, warn};

impl HoldBook {
    /// Escalates pending gate suspension `p` to its fallback; when there is nothing to
    /// escalate to, `p` waits for the acknowledgement until its deadline.
    pub(super) fn escalate_gate(&mut self, mut p: Pending, why: &'static str) {
        p.escalate_ns = None;
        let Some(fallback) = self.held.get_mut(&p.key).and_then(|h| h.fallback.take()) else {
            self.pending.push(p);
            return;
        };
        let gates: Vec<String> = p.members.iter().map(Target::to_string).collect();
        metrics::counter!("coloc_gate_escalations_total").increment(1);
        warn!(?gates, fallback = fallback.kind().as_str(), timeout = ?self.gate_timeout, why,
            "Launch gate did not hold the process: stopping it with its fallback");
        match &fallback {
            Plan::SignalCgroup { dir, leader, .. } => {
                let (dir, leader) = (dir.clone(), leader.clone());
                self.ask(Then::FallbackMembers(p, fallback), |req| HoldCmd::Members {
                    req,
                    dir,
                    leader,
                });
            }
            Plan::Freeze(t) | Plan::Signal(t) | Plan::Gate { gate: t, .. } => {
                let members = vec![t.clone()];
                self.record_fallback(p, fallback, members);
            }
        }
    }

    /// The fallback's members are known: record them first.
    pub(super) fn record_fallback(&mut self, p: Pending, fallback: Plan, members: Vec<Target>) {
        let entries = members.iter().map(Target::record).collect();
        self.ask(Then::RecordedFallback(p, fallback, members), |req| {
            HoldCmd::RecordAdd { req, entries }
        });
    }

    /// The record answered for a fallback: start it, or fail open when nothing else holds
    /// the process.
    pub(super) fn recorded_fallback(
        &mut self,
        p: Pending,
        fallback: Plan,
        members: Vec<Target>,
        ok: bool,
        now: u64,
    ) {
        if ok {
            let targets = members.clone();
            self.ask(Then::StartedFallback(p, fallback, members), |req| {
                HoldCmd::Start {
                    req,
                    op: Op::Suspend,
                    targets,
                    budget: std::time::Duration::ZERO,
                }
            });
            return;
        }
        if !p.members.is_empty() {
            error!("Cannot record the fallback suspension: waiting for the gate alone");
            self.pending.push(p);
            return;
        }
        // Nothing else holds it (the gate never closed): fail open.
        error!("Cannot record the fallback suspension: not suspending (fail open)");
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
        _at: u64,
    ) {
        let kind = fallback.kind();
        if let Some(h) = self.held.get_mut(&p.key) {
            h.members.extend(members.iter().cloned());
            h.kind = kind;
            if let Plan::SignalCgroup { dir, version, .. } = &fallback {
                h.escalate = Some(Target::Cgroup {
                    dir: dir.clone(),
                    version: *version,
                });
            }
        }
        p.kind = kind;
        p.all.extend(members.iter().cloned());
        match members_progress(&progress) {
            None => {
                // The gate's acknowledgement is no longer waited for.
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
                    at_ns: now,
                });
            }
            Some(outcome) => self.done.push(Completion {
                key: p.key,
                op: Op::Suspend,
                outcome,
                kind,
                at_ns: now,
            }),
        }
    }
}
