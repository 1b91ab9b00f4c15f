//! Holds at a launch gate: a close that its process does not acknowledge within
//! `--gate-timeout` escalates to the hold's fallback (freezer or signals, recorded first),
//! and the gate stays closed beside it until the release. A gate that cannot close at
//! all (no free slot in the gate file) escalates at once.

use super::{members_progress, pending_members, Completion, Holds, Outcome, Pending};
use crate::edges::actuator::{Op, Target};
use std::time::Duration;
use tracing::{error, warn};

impl Holds {
    /// Escalates pending gate suspension `p`: returns its completion if the fallback
    /// confirmed (or failed) at once; else `p` is pending again, waiting for the fallback,
    /// or, when there is nothing to escalate to, for the acknowledgement until its
    /// deadline.
    pub(super) fn escalate_gate(
        &mut self,
        mut p: Pending,
        now: u64,
        why: &'static str,
    ) -> Option<Completion> {
        p.escalate_ns = None;
        let Some(fallback) = self.held.get_mut(&p.key).and_then(|h| h.fallback.take()) else {
            self.pending.push(p);
            return None;
        };
        let members = self.materialise(&fallback);
        let gates: Vec<String> = p.members.iter().map(Target::to_string).collect();
        metrics::counter!("coloc_gate_escalations_total").increment(1);
        warn!(?gates, fallback = fallback.kind().as_str(), timeout = ?self.gate_timeout, why,
            "Launch gate did not hold the process: stopping it with its fallback");
        let records: Vec<_> = members.iter().map(Target::record).collect();
        if let Err(err) = self.record.add(&records) {
            if p.members.is_empty() {
                // Nothing else holds it (the gate never closed): fail open.
                error!(error = %format!("{err:#}"), "Cannot record the fallback suspension: not suspending (fail open)");
                let hold = self.held.remove(&p.key)?;
                let kind = hold.kind;
                self.fail_suspension(&p.key, hold, "record", &[], now);
                return Some(Completion {
                    key: p.key,
                    op: Op::Suspend,
                    outcome: Outcome::Failed("record"),
                    kind,
                    at_ns: now,
                });
            }
            error!(error = %format!("{err:#}"), "Cannot record the fallback suspension: waiting for the gate alone");
            self.pending.push(p);
            return None;
        }
        let progress = self.actuator.start(&members, Op::Suspend, Duration::ZERO);
        let kind = fallback.kind();
        if let Some(h) = self.held.get_mut(&p.key) {
            h.members.extend(members.iter().cloned());
            h.kind = kind;
            if let crate::control::target::Plan::SignalCgroup { dir, version, .. } = &fallback {
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
                None
            }
            Some(Outcome::Failed(reason)) => {
                if let Some(hold) = self.held.remove(&p.key) {
                    self.fail_suspension(&p.key, hold, reason, &progress, now);
                }
                Some(Completion {
                    key: p.key,
                    op: Op::Suspend,
                    outcome: Outcome::Failed(reason),
                    kind,
                    at_ns: now,
                })
            }
            Some(outcome) => Some(Completion {
                key: p.key,
                op: Op::Suspend,
                outcome,
                kind,
                at_ns: now,
            }),
        }
    }
}
