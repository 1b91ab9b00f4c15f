//! How suspensions are confirmed and holds end: `Confirming` looked at each poll, failed
//! suspensions undone, releases resumed ([`Resume`], confirmed in turn) and out of the
//! record, and the resume of everything (fail-open, shutdown).

use super::{
    members_progress, pending_members, Completion, Confirm, Continuation, Failure, Hold, HoldBook,
    HoldCmd, HoldKey, HoldRef, Outcome, Progress, Resume, State,
};
use crate::control::model::act::{Kind, Op, RecordEntry};
use crate::control::model::ProcKey;
use crate::control::note::{self, FailWhy};
use crate::control::target::Target;
use std::collections::BTreeSet;

impl HoldBook {
    /// What the current holds (held or on their way) cover, as the record names it: their
    /// members, and what they asked the record for on the way to stopping it (a gate's
    /// fallback, a freezer escalation, processes that joined a held cgroup), which is not
    /// among their members until it is started.
    fn covered(&self) -> BTreeSet<RecordEntry> {
        let members = self
            .holds
            .values()
            .flat_map(|h| h.members.iter().map(Target::record));
        let on_their_way = self.waiting.values().flat_map(|t| {
            let (r, targets): (&HoldRef, Vec<&Target>) = match t {
                Continuation::FallbackRecorded(r, m)
                | Continuation::FallbackStarted(r, m)
                | Continuation::RecordedNewcomers(r, m) => (r, m.iter().collect()),
                Continuation::RecordedEscalation(r, cg, _)
                | Continuation::StartedEscalation(r, cg, _) => (r, vec![cg]),
                _ => return Vec::new(),
            };
            if self.hold(r).is_none() {
                return Vec::new();
            }
            targets.into_iter().map(Target::record).collect()
        });
        members.chain(on_their_way).collect()
    }

    /// What the current holds may have stopped already, as the record names it: the
    /// members of those whose suspension was asked of the actuator. A hold still on its way
    /// to the record stops nothing yet, and may never (its write may fail).
    fn stopping(&self) -> BTreeSet<RecordEntry> {
        self.holds
            .values()
            .filter(|h| h.state.started() || matches!(h.state, State::Starting))
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
        // each other. The last hold that covers it resumes it. A hold on its way to the
        // record does not count: it has stopped nothing yet, and stops it again once its
        // record is written (a write that fails would leave it stopped by no hold).
        // A gate is the exception: its record entry is the GPU's, but the gate keeper counts
        // its holders per process, so each holder opens its own hold on it (the last one
        // opens the gate).
        let still = self.stopping();
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
            None => self.resumes.push(Resume {
                key,
                kind,
                confirm: Confirm::new(pending_members(&members, &p), now, self.confirm_timeout),
                all: members,
            }),
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

    /// A hold that never started ends (its write failed): what a release left in the
    /// record because this hold covered it leaves with it, unless another still covers it.
    /// (The record itself lets go of what this hold's request alone added.)
    pub(super) fn let_go_left(&mut self, members: &[Target]) {
        let left: Vec<Target> = members
            .iter()
            .filter(|t| self.left_to_others.contains(&t.record()))
            .cloned()
            .collect();
        self.forget(&left);
    }

    /// Asks to remove what was resumed from the record, except what a current hold still
    /// covers: one write however many holds a release resumed (one per hold would be 8
    /// writes for a GPU with 8 offline processes).
    pub(super) fn flush_forgotten(&mut self) {
        if self.forgotten.is_empty() {
            return;
        }
        let still = self.covered();
        let (kept, gone): (Vec<RecordEntry>, Vec<RecordEntry>) =
            std::mem::take(&mut self.forgotten)
                .into_iter()
                .partition(|e| still.contains(e));
        self.left_to_others.extend(kept);
        for e in &gone {
            self.left_to_others.remove(e);
        }
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
            for on_its_way in [true, false] {
                for (key, h) in self.holds.iter_mut() {
                    if h.state.started() == on_its_way {
                        continue;
                    }
                    if h.holders.remove(holder) && h.holders.is_empty() {
                        started.push((*holder, key.clone()));
                        if on_its_way {
                            cancelled.push(key.clone());
                        } else {
                            released.push(key.clone());
                        }
                    }
                }
            }
        }
        for key in cancelled {
            let Some(hold) = self.holds.remove(&key) else {
                continue;
            };
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

    /// A started hold ends: a suspension not confirmed yet is overtaken (`Skipped`), and
    /// its members are resumed.
    pub(super) fn release(&mut self, key: HoldKey, now: u64) {
        let Some(hold) = self.holds.remove(&key) else {
            return;
        };
        if matches!(
            hold.state,
            State::Confirming { .. } | State::Gated { .. } | State::FallingBack { .. }
        ) {
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

    /// Looks at what waits for a poll and is due, without waiting: `Confirming` holds and
    /// resumes not confirmed yet (ended once past their deadline), and `Gated` holds whose
    /// acknowledgement did not come by `--gate-timeout` (their fallback starts).
    pub fn poll(&mut self, now: u64) {
        self.now_ns = now;
        for r in self.in_state(State::polled) {
            match self.hold(&r).map(|h| &h.state) {
                Some(State::Gated { until_ns, .. }) if now >= *until_ns => {
                    self.escalate_gate(r, super::Escalation::Timeout)
                }
                // A gate's acknowledgement is awaited, which the loop reads from the pages
                // (see [`HoldBook::gate_acks`]); nothing to look at here.
                Some(State::Confirming { confirm, .. }) if now >= confirm.due_ns() => {
                    // A hold frozen meanwhile is confirmed by its freezer.
                    self.confirm_escalated(&r);
                    let Some(State::Confirming { confirm, looking }) =
                        self.hold_mut(&r).map(|h| &mut h.state)
                    else {
                        continue;
                    };
                    *looking = true;
                    let targets = confirm.members.clone();
                    self.ask(Continuation::Confirmed(r), |req| HoldCmd::Check {
                        req,
                        op: Op::Suspend,
                        targets,
                    });
                }
                _ => {}
            }
        }
        for r in std::mem::take(&mut self.resumes) {
            if now < r.confirm.due_ns() {
                self.resumes.push(r);
                continue;
            }
            self.check_resume(r);
        }
    }

    /// Asks to look at a resume not confirmed yet.
    fn check_resume(&mut self, r: Resume) {
        let targets = r.confirm.members.clone();
        self.ask(Continuation::ResumeChecked(r), |req| HoldCmd::Check {
            req,
            op: Op::Resume,
            targets,
        });
    }

    /// Looks once more, now, at every resume still pending (the agent stops: no tick will
    /// look at them again; a driver lock's resume is then answered at once).
    pub fn check_resumes_now(&mut self) {
        for r in std::mem::take(&mut self.resumes) {
            self.check_resume(r);
        }
    }

    /// A `Confirming` hold was looked at: `Held` once confirmed, `Confirming` still (a
    /// signal sent again when due), or it ends, failed or past its deadline, and is undone.
    pub(super) fn confirmed(&mut self, r: HoldRef, progress: Vec<Progress>, now: u64) {
        let Some(hold) = self.hold_mut(&r) else {
            return;
        };
        let State::Confirming { confirm, looking } = &mut hold.state else {
            return;
        };
        *looking = false;
        let kind = hold.kind;
        let outcome = match members_progress(&progress) {
            None if now >= confirm.deadline_ns => Outcome::Failed(Failure::Timeout),
            None => {
                let members = pending_members(&confirm.members, &progress);
                confirm.later(members.clone(), now);
                let started_ns = confirm.started_ns;
                self.restop_pending(&r, &members, started_ns, now);
                return;
            }
            Some(o) => o,
        };
        match &outcome {
            Outcome::Failed(reason) => {
                if let Some(hold) = self.take(&r) {
                    self.fail_suspension(&r.key, hold, *reason, &progress);
                }
            }
            _ => hold.state = State::Held,
        }
        self.done.push(Completion {
            key: r.key,
            op: Op::Suspend,
            outcome,
            kind,
            at_ns: now,
        });
    }

    /// A resume not confirmed yet was looked at: out of the record once confirmed, looked
    /// at again while pending, given up past its deadline.
    ///
    /// A resume whose key is held again (a hold made again before the thaw was seen) is
    /// overtaken once the holds cover every member not seen resumed: they keep those
    /// stopped and recorded, so the resume ends `Skipped` rather than timing out (what
    /// the holds do not cover was seen resumed, and leaves the record). A member still
    /// pending that no hold covers keeps the resume looked at, as any other.
    pub(super) fn resume_checked(&mut self, mut r: Resume, progress: Vec<Progress>, now: u64) {
        let overtaken = || {
            let covered = self.covered();
            self.holds.contains_key(&r.key)
                && pending_members(&r.confirm.members, &progress)
                    .iter()
                    .all(|t| covered.contains(&t.record()))
        };
        let outcome = match members_progress(&progress) {
            None if overtaken() => Outcome::Skipped,
            None if now >= r.confirm.deadline_ns => Outcome::Failed(Failure::Timeout),
            None => {
                let members = pending_members(&r.confirm.members, &progress);
                r.confirm.later(members, now);
                self.resumes.push(r);
                return;
            }
            Some(o) => o,
        };
        match &outcome {
            Outcome::Failed(_) => self.notes.push(
                note::TimedOut {
                    op: Op::Resume,
                    hold: r.key.clone(),
                    actuator: r.kind,
                    timeout: self.confirm_timeout,
                }
                .into(),
            ),
            _ => self.forget(&r.all),
        }
        self.done.push(Completion {
            key: r.key,
            op: Op::Resume,
            outcome,
            kind: r.kind,
            at_ns: now,
        });
    }

    /// Resumes every hold (fail-open, shutdown), the shell waiting up to
    /// `--confirm-timeout` for the confirmations. Returns how many holds are resumed.
    pub fn release_all(&mut self, reason: crate::control::ReleaseAll) -> usize {
        // A conversation cut short (a panic in the middle of one) is abandoned: what it
        // started is resumed with the rest, holds on their way included.
        self.waiting.clear();
        self.abandoned_below = self.next_req;
        self.out.clear();
        if self.holds.is_empty() {
            return 0;
        }
        self.notes.push(
            note::ReleasingAll {
                reason,
                count: self.holds.len(),
            }
            .into(),
        );
        let holds: Vec<(HoldKey, Vec<Target>)> = std::mem::take(&mut self.holds)
            .into_iter()
            .map(|(k, h)| (k, h.members))
            .collect();
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
