//! Holds by signal: one process alone, or every process of a cgroup (its leader first).
//! A SIGSTOP is the one hold a tenant can undo (a sibling process sending SIGCONT), so a
//! hold by signal has a backstop ([`Backstop`]): the cgroup's freezer, or, for a process
//! alone, a cell of the agent's own it is moved into and frozen; recorded first, like any
//! suspension. The backstop is taken when the signal does not hold: a suspension still not
//! seen taking hold [`ESCALATE_PENDING_NS`] after its SIGSTOP (sent again at each look
//! after [`RESTOP_AFTER_NS`]), or a held hold found running [`ESCALATE_AFTER`] times
//! (stopped again each time). A cgroup or process that had to be frozen is frozen at once
//! by the suspensions of the next [`REMEMBER_NS`]. A held cgroup's processes are listed again
//! at each re-check until it is frozen: one that joined it (a child forked after the stop)
//! is recorded, then stopped.

use super::{Continuation, Hold, HoldBook, HoldCmd, HoldRef, Means, Progress, State};
use crate::control::model::act::Op;
use crate::control::model::ProcKey;
use crate::control::note;
use crate::control::plan::Remembered;
use crate::control::target::{Frozen, Held, Plan, Stop, Target};
use std::path::Path;

/// Breaks after which a signalled cgroup is frozen.
pub const ESCALATE_AFTER: u32 = 2;
/// A suspension by signal not confirmed this long after its SIGSTOP is sent the signal
/// again at each check, ns: a SIGSTOP takes effect when its target next runs (tens to
/// hundreds of µs), so a process still running after 1 ms was most likely resumed by
/// someone else (a sibling sending SIGCONT) before the stop could be seen.
pub const RESTOP_AFTER_NS: u64 = 1_000_000;
/// A signalled cgroup whose processes are still not seen stopped this long after the
/// SIGSTOP is frozen instead, ns: a process resumed again and again between the agent's
/// looks would otherwise time out its suspension (and be left running, fail open) every
/// `--confirm-timeout`.
pub const ESCALATE_PENDING_NS: u64 = 10_000_000;
/// How long a signalled cgroup that had to be frozen is frozen at once by later
/// suspensions, ns: ten minutes. Without it, a job sending itself SIGCONT would run for
/// the first 10 ms or two re-checks of every busy period (many of them with short
/// release windows).
pub const REMEMBER_NS: u64 = 600_000_000_000;

/// What holds a hold by signal when its processes resume themselves.
#[derive(Debug)]
pub(super) enum Backstop {
    /// A process alone: a cell of the agent's own, not asked for yet ([`HoldCmd::Isolate`]).
    Cell,
    /// This freezer (the signalled cgroup's, or a cell whose record failed), to record
    /// and freeze.
    Freezer(Target),
    /// Asked for, in place, or refused: nothing more to take.
    Taken,
}

pub use crate::control::model::hold::Broken;

impl Means {
    /// The backstop of a hold by `plan`, if it is by signal.
    pub(super) fn signal(plan: &Plan) -> Option<Backstop> {
        match plan {
            Plan::Now(Held::Stop(Stop::SignalCgroup { dir, version, .. })) => {
                Some(Backstop::Freezer(Target::Cgroup {
                    dir: dir.clone(),
                    version: *version,
                    cell: None,
                }))
            }
            Plan::Now(Held::Stop(Stop::Signal(_))) => Some(Backstop::Cell),
            Plan::Now(_) | Plan::Gate { .. } => None,
        }
    }
}

impl Hold {
    /// The process of a hold on one process alone whose cell is not asked for yet (its
    /// members that process, and its gate if any).
    fn cell_for(&self) -> Option<ProcKey> {
        if !matches!(
            self.means,
            Means::Signal {
                backstop: Backstop::Cell
            }
        ) {
            return None;
        }
        let mut procs = self.members.iter().filter_map(|t| match t {
            Target::Process { key } => Some(*key),
            _ => None,
        });
        let one = procs.next()?;
        let alone = procs.next().is_none()
            && self
                .members
                .iter()
                .all(|t| matches!(t, Target::Process { .. } | Target::Gate { .. }));
        alone.then_some(one)
    }

    /// Its members that are freezers (a cgroup, or a cell of the agent's own).
    pub(super) fn freezers(&self) -> Vec<Target> {
        self.members
            .iter()
            .filter(|t| matches!(t, Target::Cgroup { .. }))
            .cloned()
            .collect()
    }

    /// It has a backstop left to take.
    fn can_escalate(&self) -> bool {
        matches!(
            self.means,
            Means::Signal {
                backstop: Backstop::Freezer(_)
            }
        ) || self.cell_for().is_some()
    }

    /// Counts one more break, with `resumed` members found running: the report of it.
    pub(super) fn broke(&mut self, resumed: usize) -> Broken {
        self.breaks += 1;
        Broken {
            holders: self.holders.iter().copied().collect(),
            resumed,
            breaks: self.breaks,
            escalated: false,
            unheld: None,
            kind: self.kind,
        }
    }
}

impl HoldBook {
    /// What the book remembers, at `now`, of how offline process `key` (in cgroup `dir`,
    /// where it may be held whole) had to be held: a fact the plan is chosen from
    /// ([`crate::control::plan::choose`]). Its signalled cgroup had to be frozen in the
    /// last [`REMEMBER_NS`] (its processes resumed themselves), or it had to be moved into
    /// a cell of the agent's own.
    pub fn remembered(&self, key: &ProcKey, dir: Option<&Path>, now: u64) -> Remembered {
        let lately = |at: &u64| now.saturating_sub(*at) < REMEMBER_NS;
        Remembered {
            cgroup_frozen: dir.is_some_and(|d| self.resumed_itself.get(d).is_some_and(lately)),
            cell: self
                .isolated
                .get(key)
                .filter(|(_, at)| lately(at))
                .and_then(|(cell, _)| Frozen::of(cell)),
        }
    }

    /// A `Confirming` suspension by signal looked at, with `running` (its members not seen
    /// stopped yet) started at `started_ns`: its processes are sent SIGSTOP again, and its
    /// backstop taken once they have stayed unconfirmed for [`ESCALATE_PENDING_NS`]. Its
    /// confirmation is then the freezer's (see [`HoldBook::confirm_escalated`]).
    pub(super) fn restop_pending(
        &mut self,
        r: &HoldRef,
        running: &[Target],
        started_ns: u64,
        now: u64,
    ) {
        let waited = now.saturating_sub(started_ns);
        let running: Vec<Target> = running
            .iter()
            .filter(|t| matches!(t, Target::Process { .. }))
            .cloned()
            .collect();
        if running.is_empty() || waited < RESTOP_AFTER_NS {
            return;
        }
        let Some(hold) = self.hold_mut(r) else {
            return;
        };
        let broken = (waited >= ESCALATE_PENDING_NS && hold.can_escalate()).then(|| {
            hold.escaping = true;
            hold.broke(running.len())
        });
        self.ask(Continuation::Restopped, |req| HoldCmd::Start {
            req,
            op: Op::Suspend,
            targets: running,
            budget: std::time::Duration::ZERO,
        });
        if let Some(b) = broken {
            self.escalate(r.clone(), b);
        }
    }

    /// Holds a breaking hold by its backstop: its signalled cgroup's freezer, or, for a
    /// process held alone, a cell of the agent's own (asked for once per hold); recorded
    /// first like any suspension. Without either the break is only reported.
    pub(super) fn escalate(&mut self, r: HoldRef, broken: Broken) {
        let Some(hold) = self.hold_mut(&r) else {
            self.broken.push(broken);
            return;
        };
        let process = hold.cell_for();
        let Means::Signal { backstop } = &mut hold.means else {
            self.broken.push(broken);
            return;
        };
        match std::mem::replace(backstop, Backstop::Taken) {
            Backstop::Freezer(cg) => {
                let entries = vec![cg.record()];
                self.ask(Continuation::RecordedEscalation(r, cg, broken), |req| {
                    HoldCmd::RecordAdd { req, entries }
                });
            }
            Backstop::Cell if process.is_some() => {
                let process = process.expect("a process alone");
                self.ask(Continuation::Isolated(r, broken), |req| HoldCmd::Isolate {
                    req,
                    key: process,
                });
            }
            was => {
                *backstop = was;
                self.broken.push(broken);
            }
        }
    }

    /// The answer to [`HoldCmd::Isolate`]: the cell is recorded, then the process moved in
    /// and frozen; without one, the hold stays on signals and says so.
    pub(super) fn isolated(&mut self, r: HoldRef, mut b: Broken, cell: Result<Target, String>) {
        match cell {
            Ok(cg) if self.hold(&r).is_some() => {
                let entries = vec![cg.record()];
                self.ask(Continuation::RecordedEscalation(r, cg, b), |req| {
                    HoldCmd::RecordAdd { req, entries }
                });
            }
            Ok(_) => self.broken.push(b),
            Err(why) => {
                b.unheld = Some(why);
                self.broken.push(b);
            }
        }
    }

    /// A `Confirming` suspension whose hold was frozen meanwhile waits for the freezer, not
    /// for its processes (frozen tasks are not in the stopped state).
    pub(super) fn confirm_escalated(&mut self, r: &HoldRef) {
        let Some(hold) = self.hold_mut(r) else {
            return;
        };
        let frozen = hold.freezers();
        let State::Confirming { confirm, .. } = &mut hold.state else {
            return;
        };
        if frozen.is_empty()
            || confirm
                .members
                .iter()
                .any(|t| matches!(t, Target::Cgroup { .. }))
        {
            return;
        }
        confirm.members = frozen;
    }

    /// The record answered for a backstop: freeze it, or keep it for the next break.
    pub(super) fn recorded_escalation(&mut self, r: HoldRef, cg: Target, b: Broken, ok: bool) {
        if !ok {
            self.notes.push(note::EscalationNotRecorded.into());
            // The next break may try again.
            if let Some(Means::Signal { backstop }) = self.hold_mut(&r).map(|h| &mut h.means) {
                if !matches!(backstop, Backstop::Freezer(_)) {
                    *backstop = Backstop::Freezer(cg);
                }
            }
            self.broken.push(b);
            return;
        }
        if self.hold(&r).is_none() {
            // Released (or replaced) while the record was written: nothing to freeze; out
            // of the record again, unless another hold covers it.
            self.forget(std::slice::from_ref(&cg));
            self.broken.push(b);
            return;
        }
        let targets = vec![cg.clone()];
        self.ask(Continuation::StartedEscalation(r, cg, b), |req| {
            HoldCmd::Start {
                req,
                op: Op::Suspend,
                targets,
                budget: std::time::Duration::ZERO,
            }
        });
    }

    /// The backstop's freeze started: the hold is frozen as well, and remembered for the
    /// next suspensions.
    pub(super) fn started_escalation(
        &mut self,
        r: HoldRef,
        cg: Target,
        mut b: Broken,
        p: Vec<Progress>,
    ) {
        match p.first() {
            Some(Progress::Done | Progress::Pending | Progress::Skipped) => {
                let now = self.now_ns;
                if self.hold(&r).is_some() {
                    match &cg {
                        Target::Cgroup { cell: Some(c), .. } => {
                            self.isolated
                                .retain(|_, (_, at)| now.saturating_sub(*at) < REMEMBER_NS);
                            let key = ProcKey {
                                pid: c.pid,
                                start: c.start,
                            };
                            self.isolated.insert(key, (cg.clone(), now));
                        }
                        Target::Cgroup { dir, .. } => {
                            self.resumed_itself
                                .retain(|_, at| now.saturating_sub(*at) < REMEMBER_NS);
                            self.resumed_itself.insert(dir.clone(), now);
                        }
                        _ => {}
                    }
                }
                match self.hold_mut(&r) {
                    Some(h) => {
                        h.members.push(cg);
                        h.escaping = false;
                        b.escalated = true;
                    }
                    // Released meanwhile: thawed again, and out of the record only once
                    // the thaw is confirmed (unless another hold covers it).
                    None => self.start_resume(r.key, b.kind, vec![cg], false),
                }
            }
            // Out of the record again, unless another hold covers it (one that froze it).
            p => {
                if let (Target::Cgroup { cell: Some(_), .. }, Some(Progress::Failed(e))) = (&cg, p)
                {
                    b.unheld = Some(e.to_string());
                }
                self.forget(std::slice::from_ref(&cg))
            }
        }
        self.broken.push(b);
    }

    /// A held signalled cgroup's processes now: those not held yet are recorded, then
    /// stopped.
    pub(super) fn regrouped(&mut self, r: HoldRef, members: Vec<Target>, gone: bool, now: u64) {
        let Some(hold) = self.hold(&r) else {
            return;
        };
        if gone {
            // Removed once its last process exited: nothing is left to hold or to look
            // for again. The hold ends (its resume finds every member gone) and leaves the
            // record.
            self.notes.push(
                note::HoldGone {
                    hold: r.key.clone(),
                }
                .into(),
            );
            self.release(r.key, now);
            self.flush_forgotten();
            return;
        }
        let known: std::collections::BTreeSet<_> =
            hold.members.iter().map(Target::record).collect();
        let newcomers: Vec<Target> = members
            .into_iter()
            .filter(|t| !known.contains(&t.record()))
            .collect();
        if newcomers.is_empty() {
            return;
        }
        let entries = newcomers.iter().map(Target::record).collect();
        self.ask(Continuation::RecordedNewcomers(r, newcomers), |req| {
            HoldCmd::RecordAdd { req, entries }
        });
    }

    /// Processes that joined a held signalled cgroup, recorded: stopped.
    pub(super) fn recorded_newcomers(&mut self, r: HoldRef, newcomers: Vec<Target>, ok: bool) {
        if self.hold(&r).is_none() {
            // Released meanwhile: nothing to stop; out of the record again.
            self.forget(&newcomers);
            return;
        }
        if !ok {
            self.notes.push(
                note::NewcomersNotRecorded {
                    processes: newcomers.len(),
                }
                .into(),
            );
            return;
        }
        self.notes.push(
            note::NewcomersStopped {
                hold: r.key.clone(),
                processes: newcomers.len(),
            }
            .into(),
        );
        if let Some(hold) = self.hold_mut(&r) {
            hold.members.extend(newcomers.iter().cloned());
        }
        self.ask(Continuation::Restopped, |req| HoldCmd::Start {
            req,
            op: Op::Suspend,
            targets: newcomers,
            budget: std::time::Duration::ZERO,
        });
    }
}
