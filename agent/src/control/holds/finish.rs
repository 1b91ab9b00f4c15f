//! How holds end: confirmations checked each tick, failed suspensions undone, resumes
//! that leave the record, and the resume of everything (fail-open, shutdown).

use super::{
    members_progress, pending_members, Completion, Continuation, Failure, Hold, HoldBook, HoldCmd,
    HoldKey, Outcome, Pending, Progress,
};
use crate::control::model::act::{Kind, Op, RecordEntry};
use crate::control::model::ProcKey;
use crate::control::note::{self, FailWhy};
use crate::control::target::Target;
use std::collections::BTreeSet;

impl HoldBook {
    /// What the current holds (held or on their way) cover, as the record names it.
    fn covered(&self) -> BTreeSet<RecordEntry> {
        self.held
            .values()
            .chain(self.staged.values())
            .flat_map(|h| h.members.iter().map(Target::record))
            .collect()
    }

    /// Notes each member of an operation that failed.
    fn note_failed(&mut self, op: Op, members: &[Target], p: &[Progress]) {
        for (t, pr) in members.iter().zip(p) {
            if let Progress::Failed(err) = pr {
                self.notes.push(
                    note::ActFailed {
                        op,
                        target: t.to_string(),
                        actuator: t.kind(),
                        reason: err.reason(),
                        error: err.to_string(),
                    }
                    .into(),
                );
            }
        }
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
        self.note_failed(Op::Suspend, &hold.members, p);
        if reason == Failure::Timeout {
            self.notes.push(
                note::TimedOut {
                    op: Op::Suspend,
                    hold: key.clone(),
                    actuator: hold.kind,
                    timeout: self.confirm_timeout,
                }
                .into(),
            );
        }
        self.notes.push(
            note::FailedOpen {
                why: FailWhy::Actuation,
            }
            .into(),
        );
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
        // A gate is the exception: its record entry is the GPU's, but the gate keeper counts
        // its holders per process, so each holder opens its own hold on it (the last one
        // opens the gate).
        let still = self.covered();
        let members: Vec<Target> = members
            .into_iter()
            .filter(|t| matches!(t, Target::Gate { .. }) || !still.contains(&t.record()))
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
            Continuation::StartedResume {
                key,
                kind,
                members,
                report,
            },
            |req| HoldCmd::Start {
                req,
                op: Op::Resume,
                targets,
                budget: std::time::Duration::ZERO,
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
                0,
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
            self.note_failed(Op::Resume, members, p);
            return;
        }
        self.notes.push(
            note::Resumed {
                hold: key.clone(),
                outcome: outcome.clone(),
            }
            .into(),
        );
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
        // A hold still on its way to the record (its write has not landed) is cancelled:
        // when the answer comes nothing is started for it.
        let mut cancelled = Vec::new();
        for holder in holders {
            for (key, h) in self.staged.iter_mut() {
                if h.holders.remove(holder) && h.holders.is_empty() {
                    started.push((*holder, key.clone()));
                    cancelled.push(key.clone());
                }
            }
            for (key, h) in self.held.iter_mut() {
                if h.holders.remove(holder) && h.holders.is_empty() {
                    started.push((*holder, key.clone()));
                    released.push(key.clone());
                }
            }
        }
        for key in cancelled {
            let Some(hold) = self.staged.remove(&key) else {
                continue;
            };
            self.to_record.retain(|k| *k != key);
            self.to_start.retain(|k| *k != key);
            self.forget(&hold.members);
            for op in [Op::Suspend, Op::Resume] {
                self.done.push(Completion {
                    key: key.clone(),
                    op,
                    outcome: if op == Op::Suspend {
                        Outcome::Skipped
                    } else {
                        Outcome::Done
                    },
                    kind: hold.kind,
                    at_ns: now,
                });
            }
        }
        for key in released {
            self.release(key, now);
        }
        self.flush_forgotten();
        started
    }

    pub(super) fn release(&mut self, key: HoldKey, now: u64) {
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
            let mut p = p;
            self.confirm_escalated(&mut p);
            let (op, targets) = (p.op, p.members.clone());
            self.ask(Continuation::Checked(p), |req| HoldCmd::Check {
                req,
                op,
                targets,
            });
        }
    }

    /// Looks once more, now, at every resume still pending (the agent stops: no tick will
    /// look at them again; a driver lock's resume is then answered at once).
    pub fn check_resumes_now(&mut self) {
        for p in std::mem::take(&mut self.pending) {
            if p.op != Op::Resume || p.escalate_ns.is_some() {
                self.pending.push(p);
                continue;
            }
            let (op, targets) = (p.op, p.members.clone());
            self.ask(Continuation::Checked(p), |req| HoldCmd::Check {
                req,
                op,
                targets,
            });
        }
    }

    /// A pending operation was looked at.
    pub(super) fn checked(&mut self, mut p: Pending, progress: Vec<Progress>, now: u64) {
        let outcome = match members_progress(&progress) {
            None if now >= p.deadline_ns => Some(Outcome::Failed(Failure::Timeout)),
            None => {
                p.members = pending_members(&p.members, &progress);
                if p.op == Op::Suspend {
                    self.restop_pending(&p, now);
                }
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
            (Op::Resume, Outcome::Failed(_)) => self.notes.push(
                note::TimedOut {
                    op: Op::Resume,
                    hold: p.key.clone(),
                    actuator: p.kind,
                    timeout: self.confirm_timeout,
                }
                .into(),
            ),
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
    pub fn release_all(&mut self, reason: crate::control::ReleaseAll) -> usize {
        // A conversation cut short (a panic in the middle of one) is abandoned: what it
        // started is resumed with the rest, staged holds included.
        self.waiting.clear();
        self.abandoned_below = self.next_req;
        self.out.clear();
        self.to_record.clear();
        self.to_start.clear();
        if self.held.is_empty() && self.staged.is_empty() {
            return 0;
        }
        self.notes.push(
            note::ReleasingAll {
                reason,
                count: self.held.len() + self.staged.len(),
            }
            .into(),
        );
        let mut all = std::mem::take(&mut self.held);
        all.append(&mut self.staged);
        let holds: Vec<(HoldKey, Vec<Target>)> =
            all.into_iter().map(|(k, h)| (k, h.members)).collect();
        self.pending.retain(|p| p.op == Op::Resume);
        let n = holds.len();
        let targets: Vec<Target> = holds.iter().flat_map(|(_, m)| m.iter().cloned()).collect();
        let budget = self.confirm_timeout;
        self.ask(Continuation::ReleasedAll(holds), |req| HoldCmd::Start {
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
