//! How holds end: confirmations checked each tick, failed suspensions undone, resumes
//! that leave the record, and the resume of everything (fail-open, shutdown).

use super::{
    members_progress, pending_members, Completion, Failure, Hold, HoldBook, HoldCmd, HoldKey,
    Outcome, Pending, Progress, Then, INLINE_BUDGET,
};
use crate::edges::actuator::{Kind, Op, RecordEntry, Target};
use crate::edges::procfs::ProcKey;
use std::collections::BTreeSet;
use tracing::{debug, error, info};

impl HoldBook {
    /// What the current holds (held or on their way) cover, as the record names it.
    fn covered(&self) -> BTreeSet<RecordEntry> {
        self.held
            .values()
            .chain(self.staged.values())
            .flat_map(|h| h.members.iter().map(Target::record))
            .collect()
    }

    /// A suspension failed: undo it (resume its members), drop the hold, and keep the
    /// record entries only if the undo could not be confirmed.
    pub(super) fn fail_suspension(
        &mut self,
        key: &HoldKey,
        hold: Hold,
        reason: Failure,
        p: &[Progress],
    ) {
        self.failed.extend(hold.holders.iter().copied());
        for (t, pr) in hold.members.iter().zip(p) {
            if let Progress::Failed(err) = pr {
                metrics::counter!("coloc_actuation_errors_total", "actuator" => t.kind().as_str(), "op" => "suspend", "reason" => err.reason()).increment(1);
                error!(target = %t, %err, "Suspension failed: undoing it (fail open)");
            }
        }
        if reason == Failure::Timeout {
            metrics::counter!("coloc_actuation_errors_total", "actuator" => hold.kind.as_str(), "op" => "suspend", "reason" => "timeout").increment(1);
            error!(hold = ?key, timeout = ?self.confirm_timeout, "Suspension not confirmed in time: undoing it (fail open)");
        }
        metrics::counter!("coloc_fail_open_total", "reason" => "actuation").increment(1);
        self.pending.retain(|p| p.key != *key);
        self.start_resume(key.clone(), hold.kind, hold.members, false);
    }

    /// Asks to resume `members`; a confirmed or gone resume leaves the record at once, a
    /// pending one when it is confirmed, a failed one stays for the next start.
    pub(super) fn start_resume(
        &mut self,
        key: HoldKey,
        kind: Kind,
        members: Vec<Target>,
        report: bool,
    ) {
        // A target another hold still covers stays suspended: two gate holds whose
        // fallbacks freeze one cgroup (a job with a process per GPU) must not thaw it for
        // each other. The last hold that covers it resumes it.
        let still = self.covered();
        let members: Vec<Target> = members
            .into_iter()
            .filter(|t| !still.contains(&t.record()))
            .collect();
        if members.is_empty() {
            if report {
                self.done.push(Completion {
                    key,
                    op: Op::Resume,
                    outcome: Outcome::Done,
                    kind,
                    at_ns: self.now_ns,
                });
            }
            return;
        }
        let targets = members.clone();
        self.ask(
            Then::StartedResume {
                key,
                kind,
                members,
                report,
            },
            |req| HoldCmd::Start {
                req,
                op: Op::Resume,
                targets,
                budget: INLINE_BUDGET,
            },
        );
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn started_resume(
        &mut self,
        key: HoldKey,
        kind: Kind,
        members: Vec<Target>,
        report: bool,
        p: Vec<Progress>,
        now: u64,
        at: u64,
    ) {
        match members_progress(&p) {
            None => self.pending.push(Pending::new(
                key,
                Op::Resume,
                kind,
                pending_members(&members, &p),
                members.clone(),
                now,
                self.confirm_timeout,
            )),
            Some(outcome) => {
                self.resumed(&key, &members, &p, &outcome);
                if report {
                    self.done.push(Completion {
                        key,
                        op: Op::Resume,
                        outcome,
                        kind,
                        at_ns: at,
                    });
                }
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

    /// Marks `members` resumed: they leave the record at the next
    /// [`HoldBook::flush_forgotten`], all of them in one write.
    pub(super) fn forget(&mut self, members: &[Target]) {
        self.forgotten.extend(members.iter().map(Target::record));
    }

    /// Asks to remove what was resumed from the record, except what a current hold still
    /// covers: one write however many holds a release resumed (one per hold would be 8
    /// writes for a GPU with 8 offline processes).
    pub(super) fn flush_forgotten(&mut self) {
        if self.forgotten.is_empty() {
            return;
        }
        let still = self.covered();
        let gone: Vec<RecordEntry> = std::mem::take(&mut self.forgotten)
            .into_iter()
            .filter(|e| !still.contains(e))
            .collect();
        if !gone.is_empty() {
            self.out.push(HoldCmd::RecordRemove { entries: gone });
        }
    }

    /// Releases `holders`; holds left without holders are resumed. Returns the holds whose
    /// resume starts, by holder.
    pub fn resume(&mut self, holders: &[ProcKey], now: u64) -> Vec<(ProcKey, HoldKey)> {
        self.now_ns = now;
        let mut started = Vec::new();
        let mut released = Vec::new();
        for holder in holders {
            for (key, h) in self.held.iter_mut() {
                if h.holders.remove(holder) && h.holders.is_empty() {
                    started.push((*holder, key.clone()));
                    released.push(key.clone());
                }
            }
        }
        for key in released {
            self.release(key, now);
        }
        self.flush_forgotten();
        started
    }

    fn release(&mut self, key: HoldKey, now: u64) {
        let Some(hold) = self.held.remove(&key) else {
            return;
        };
        // A suspension still being confirmed is overtaken by the resume.
        if self
            .pending
            .iter()
            .any(|p| p.key == key && p.op == Op::Suspend)
        {
            self.pending
                .retain(|p| !(p.key == key && p.op == Op::Suspend));
            self.done.push(Completion {
                key: key.clone(),
                op: Op::Suspend,
                outcome: Outcome::Skipped,
                kind: hold.kind,
                at_ns: now,
            });
        }
        self.start_resume(key, hold.kind, hold.members, true);
    }

    /// Looks at the pending operations that are due, without waiting; ends those past
    /// their deadline; escalates gate holds whose acknowledgement did not come in time.
    pub fn poll(&mut self, now: u64) {
        self.now_ns = now;
        for p in std::mem::take(&mut self.pending) {
            if p.escalate_ns.is_some_and(|e| now >= e) {
                self.escalate_gate(p, super::Escalation::Timeout);
                continue;
            }
            // A gate waits for its acknowledgement, which the loop reads from the pages
            // (see [`HoldBook::gate_acks`]); nothing to look at here.
            if p.escalate_ns.is_some() || now < p.next_check_ns.min(p.deadline_ns) {
                self.pending.push(p);
                continue;
            }
            let (op, targets) = (p.op, p.members.clone());
            self.ask(Then::Checked(p), |req| HoldCmd::Check { req, op, targets });
        }
    }

    /// A pending operation was looked at.
    pub(super) fn checked(&mut self, mut p: Pending, progress: Vec<Progress>, now: u64) {
        let outcome = match members_progress(&progress) {
            None if now >= p.deadline_ns => Some(Outcome::Failed(Failure::Timeout)),
            None => {
                p.members = pending_members(&p.members, &progress);
                p.gap_ns = (p.gap_ns * 2).min(super::CHECK_MAX_NS);
                p.next_check_ns = now + p.gap_ns;
                self.pending.push(p);
                return;
            }
            o => o,
        };
        let outcome = outcome.unwrap_or(Outcome::Done);
        match (p.op, &outcome) {
            (Op::Suspend, Outcome::Failed(reason)) => {
                if let Some(hold) = self.held.remove(&p.key) {
                    self.fail_suspension(&p.key, hold, *reason, &progress);
                }
            }
            (Op::Resume, Outcome::Failed(_)) => {
                metrics::counter!("coloc_actuation_errors_total", "actuator" => p.kind.as_str(), "op" => "resume", "reason" => "timeout").increment(1);
                error!(hold = ?p.key, "Resume not confirmed in time; left in the record for the next start");
            }
            (Op::Resume, _) => self.forget(&p.all),
            (Op::Suspend, _) => {}
        }
        self.done.push(Completion {
            key: p.key,
            op: p.op,
            outcome,
            kind: p.kind,
            at_ns: now,
        });
    }

    /// Resumes every hold (fail-open, shutdown), the shell waiting up to
    /// `--confirm-timeout` for the confirmations. Returns how many holds are resumed.
    pub fn release_all(&mut self, reason: &str) -> usize {
        // A conversation cut short (a panic in the middle of one) is abandoned: what it
        // started is resumed with the rest, staged holds included.
        self.waiting.clear();
        self.out.clear();
        self.to_record.clear();
        if self.held.is_empty() && self.staged.is_empty() {
            return 0;
        }
        info!(
            reason,
            count = self.held.len() + self.staged.len(),
            "Resuming all suspended offline work"
        );
        let mut all = std::mem::take(&mut self.held);
        all.append(&mut self.staged);
        let holds: Vec<(HoldKey, Vec<Target>)> =
            all.into_iter().map(|(k, h)| (k, h.members)).collect();
        self.pending.retain(|p| p.op == Op::Resume);
        let n = holds.len();
        let targets: Vec<Target> = holds.iter().flat_map(|(_, m)| m.iter().cloned()).collect();
        let budget = self.confirm_timeout;
        self.ask(Then::ReleasedAll(holds), |req| HoldCmd::Start {
            req,
            op: Op::Resume,
            targets,
            budget,
        });
        n
    }

    pub(super) fn released_all(
        &mut self,
        holds: Vec<(HoldKey, Vec<Target>)>,
        progress: Vec<Progress>,
    ) {
        let mut progress = progress.into_iter();
        for (key, members) in holds {
            let p: Vec<Progress> = progress.by_ref().take(members.len()).collect();
            let outcome = members_progress(&p).unwrap_or(Outcome::Failed(Failure::Timeout));
            self.resumed(&key, &members, &p, &outcome);
        }
    }
}
