//! How holds end: confirmations checked each tick, failed suspensions undone, resumes
//! that leave the record, and the resume of everything (fail-open, shutdown).

use super::{
    members_progress, pending_members, Completion, Hold, HoldKey, Holds, Outcome, Pending,
    INLINE_BUDGET,
};
use crate::edges::actuator::{Kind, Op, Progress, RecordEntry, Target};
use std::collections::BTreeSet;
use std::time::Duration;
use tracing::{debug, error, info};

impl Holds {
    /// A suspension failed: undo it (resume its members), drop the hold, and keep the
    /// record entries only if the undo could not be confirmed.
    pub(super) fn fail_suspension(
        &mut self,
        key: &HoldKey,
        hold: Hold,
        reason: &'static str,
        p: &[Progress],
        now: u64,
    ) {
        self.failed.extend(hold.holders.iter().copied());
        for (t, pr) in hold.members.iter().zip(p) {
            if let Progress::Failed(err) = pr {
                metrics::counter!("coloc_actuation_errors_total", "actuator" => t.kind().as_str(), "op" => "suspend", "reason" => err.reason()).increment(1);
                error!(target = %t, %err, "Suspension failed: undoing it (fail open)");
            }
        }
        if reason == "timeout" {
            metrics::counter!("coloc_actuation_errors_total", "actuator" => hold.kind.as_str(), "op" => "suspend", "reason" => "timeout").increment(1);
            error!(hold = ?key, timeout = ?self.confirm_timeout, "Suspension not confirmed in time: undoing it (fail open)");
        }
        metrics::counter!("coloc_fail_open_total", "reason" => "actuation").increment(1);
        self.pending.retain(|p| p.key != *key);
        self.start_resume(key.clone(), hold.kind, hold.members, now);
    }

    /// Starts resuming `members`; a confirmed or gone resume leaves the record at once, a
    /// pending one when it is confirmed, a failed one stays for the next start.
    pub(super) fn start_resume(
        &mut self,
        key: HoldKey,
        kind: Kind,
        members: Vec<Target>,
        now: u64,
    ) -> Option<Completion> {
        let p = self.actuator.start(&members, Op::Resume, INLINE_BUDGET);
        let at = self.clock.now_ns();
        match members_progress(&p) {
            None => {
                self.pending.push(Pending::new(
                    key,
                    Op::Resume,
                    kind,
                    pending_members(&members, &p),
                    members.clone(),
                    now,
                    self.confirm_timeout,
                ));
                None
            }
            Some(outcome) => {
                self.resumed(&key, &members, &p, &outcome);
                Some(Completion {
                    key,
                    op: Op::Resume,
                    outcome,
                    kind,
                    at_ns: at,
                })
            }
        }
    }

    pub(super) fn resumed(
        &mut self,
        key: &HoldKey,
        members: &[Target],
        p: &[Progress],
        outcome: &Outcome,
    ) {
        if let Outcome::Failed(_) = outcome {
            for (t, pr) in members.iter().zip(p) {
                if let Progress::Failed(err) = pr {
                    metrics::counter!("coloc_actuation_errors_total", "actuator" => t.kind().as_str(), "op" => "resume", "reason" => err.reason()).increment(1);
                    error!(target = %t, %err, "Resume failed; left in the record for the next start");
                }
            }
            return;
        }
        debug!(hold = ?key, ?outcome, "Resumed");
        self.forget(members);
    }

    /// Marks `members` resumed: they leave the record at the next [`Holds::flush_forgotten`]
    /// (at the end of the call that resumed them), all of them in one write.
    pub(super) fn forget(&mut self, members: &[Target]) {
        self.forgotten.extend(members.iter().map(Target::record));
    }

    /// Removes what was resumed from the record, except what a current hold still covers:
    /// one write however many holds a release resumed (one per hold would be 8 writes for
    /// a GPU with 8 offline processes).
    pub(super) fn flush_forgotten(&mut self) {
        if self.forgotten.is_empty() {
            return;
        }
        let still: BTreeSet<RecordEntry> = self
            .held
            .values()
            .flat_map(|h| h.members.iter().map(Target::record))
            .collect();
        let gone: Vec<RecordEntry> = std::mem::take(&mut self.forgotten)
            .into_iter()
            .filter(|e| !still.contains(e))
            .collect();
        if let Err(err) = self.record.remove(&gone) {
            error!(error = %format!("{err:#}"), "Failed to update the suspension record");
        }
    }

    /// Checks pending operations without waiting; ends those past their deadline.
    pub fn poll(&mut self, now: u64) -> Vec<Completion> {
        if self.pending.is_empty() {
            return Vec::new();
        }
        let mut done = Vec::new();
        for mut p in std::mem::take(&mut self.pending) {
            if p.escalate_ns.is_some_and(|e| now >= e) {
                done.extend(self.escalate_gate(p, now, "no acknowledgement within --gate-timeout (no shim listening, or work still in flight)"));
                continue;
            }
            // A gate is acknowledged through a page, which wakes the loop: look at every
            // tick (a few loads), not only on the check schedule.
            if now < p.next_check_ns.min(p.deadline_ns) && p.kind != Kind::Gate {
                self.pending.push(p);
                continue;
            }
            let progress = self.actuator.check(&p.members, p.op, Duration::ZERO);
            let outcome = match members_progress(&progress) {
                None if now >= p.deadline_ns => Some(Outcome::Failed("timeout")),
                None => {
                    p.members = pending_members(&p.members, &progress);
                    p.gap_ns = (p.gap_ns * 2).min(super::CHECK_MAX_NS);
                    p.next_check_ns = now + p.gap_ns;
                    self.pending.push(p);
                    continue;
                }
                o => o,
            };
            let outcome = outcome.unwrap_or(Outcome::Done);
            match (p.op, &outcome) {
                (Op::Suspend, Outcome::Failed(reason)) => {
                    if let Some(hold) = self.held.remove(&p.key) {
                        self.fail_suspension(&p.key, hold, reason, &progress, now);
                    }
                }
                (Op::Resume, Outcome::Failed(_)) => {
                    metrics::counter!("coloc_actuation_errors_total", "actuator" => p.kind.as_str(), "op" => "resume", "reason" => "timeout").increment(1);
                    error!(hold = ?p.key, "Resume not confirmed in time; left in the record for the next start");
                }
                (Op::Resume, _) => self.forget(&p.all),
                (Op::Suspend, _) => {}
            }
            done.push(Completion {
                key: p.key,
                op: p.op,
                outcome,
                kind: p.kind,
                at_ns: now,
            });
        }
        self.flush_forgotten();
        done
    }

    /// Resumes every hold (fail-open, shutdown), waiting up to `--confirm-timeout` for the
    /// confirmations. Returns how many holds were resumed.
    pub fn release_all(&mut self, reason: &str, now: u64) -> usize {
        let keys: Vec<HoldKey> = self.held.keys().cloned().collect();
        if keys.is_empty() {
            return 0;
        }
        info!(
            reason,
            count = keys.len(),
            "Resuming all suspended offline work"
        );
        let holds: Vec<(HoldKey, Hold)> = keys
            .into_iter()
            .filter_map(|k| self.held.remove(&k).map(|h| (k, h)))
            .collect();
        self.pending.retain(|p| p.op == Op::Resume);
        let n = holds.len();
        let targets: Vec<Target> = holds
            .iter()
            .flat_map(|(_, h)| h.members.iter().cloned())
            .collect();
        let mut progress = self
            .actuator
            .start(&targets, Op::Resume, self.confirm_timeout)
            .into_iter();
        for (key, hold) in holds {
            let p: Vec<Progress> = progress.by_ref().take(hold.members.len()).collect();
            let outcome = members_progress(&p).unwrap_or(Outcome::Failed("timeout"));
            self.resumed(&key, &hold.members, &p, &outcome);
        }
        self.flush_forgotten();
        let _ = now;
        n
    }
}
