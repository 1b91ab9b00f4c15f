//! Suspensions that hold: a held target is checked again while it is held, and stopped
//! again when something resumed it (a sibling process in the pod sending SIGCONT, a
//! tenant writing to a delegated `cgroup.freeze`).
//!
//! Every `--recheck-interval` (default [`RECHECK_NS`], 10 ms) the loop re-checks at most
//! [`RECHECK_TARGETS_PER_TICK`] held targets, round robin (with 64 held processes each is
//! checked about every 320 ms), and every hold that was found broken once. A signalled
//! cgroup whose processes keep resuming themselves is escalated to the freezer (SIGCONT
//! cannot thaw a frozen cgroup) after [`ESCALATE_AFTER`] breaks; it is recorded before it
//! is frozen, like any suspension.
//!
//! Why not every hold every time: reading `/proc/<pid>/stat` of a held process costs
//! 3-15 µs; 64 of them every 10 ms would cost a twentieth of a core. The default interval
//! was 5 ms; 10 ms halves the loop's wake-ups while something is held (on the 8 × 8
//! benchmark, about 0.9 points of a core), and a cgroup that keeps resuming itself is
//! still frozen within a few intervals.

use super::pending::Pending;
use super::{Continuation, HoldBook, HoldCmd, HoldKey, Progress};
use crate::control::model::act::{Kind, Op};
use crate::control::model::ProcKey;
use crate::control::note::Note;
use crate::control::target::Target;

/// How often a hold that never broke is checked, by default.
pub const RECHECK_NS: u64 = 10_000_000;
/// How many held targets (processes, cgroups) are checked in one re-check at most, besides
/// the holds already found broken: bounds the cost (a `/proc/<pid>/stat` read is a few
/// µs) whatever the number of held processes.
pub const RECHECK_TARGETS_PER_TICK: usize = 2;
/// How many holds one tick looks at, at most, to find the due ones.
pub const RECHECK_SCAN: usize = 16;
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

/// A hold found running while held.
#[derive(Debug, Clone)]
pub struct Broken {
    /// Its holders (offline GPU processes).
    pub holders: Vec<ProcKey>,
    /// Members found running.
    pub resumed: usize,
    /// Times this hold broke so far.
    pub breaks: u32,
    /// It is now frozen as well (its cgroup, or a cell of the agent's own).
    pub escalated: bool,
    /// Why nothing the tenant cannot undo could hold it (no cell on this host, the cell
    /// refused): it stays on signals, which it undoes.
    pub unheld: Option<String>,
    /// The actuator that holds it.
    pub kind: Kind,
}

impl super::Hold {
    /// What a re-check looks at: its freezers once it has one (a frozen process is not in
    /// the stopped state, and cannot run), else every member.
    fn checked_members(&self) -> Vec<Target> {
        let frozen: Vec<Target> = self
            .members
            .iter()
            .filter(|t| matches!(t, Target::Cgroup { .. }))
            .cloned()
            .collect();
        if frozen.is_empty() {
            self.members.clone()
        } else {
            frozen
        }
    }

    /// The process of a hold on one process alone (by signal, or its gate's fallback),
    /// which a cell of the agent's own can hold instead.
    fn lone_process(&self) -> Option<ProcKey> {
        if !self.alone {
            return None;
        }
        let mut procs = self.members.iter().filter_map(|t| match t {
            Target::Process { key, .. } => Some(*key),
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

    /// Counts one more break, with `resumed` members found running: the report of it.
    fn broke(&mut self, resumed: usize) -> Broken {
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
    /// Looks at the holds that are due; what runs is stopped again when the answer comes,
    /// and repeat offenders escalated.
    pub fn recheck(&mut self, now: u64) {
        self.now_ns = now;
        // A loop awake anyway in the last quarter of the interval re-checks now: one
        // wake-up instead of two close together.
        if self.held.is_empty() || now + self.recheck_ns / 4 < self.next_recheck_ns {
            return;
        }
        self.next_recheck_ns = now + self.recheck_ns;
        for key in self.due_for_recheck(now) {
            let Some(hold) = self.held.get_mut(&key) else {
                continue;
            };
            hold.checked_ns = now;
            let targets = hold.checked_members();
            // A signalled cgroup not frozen yet: a process that joined it since (a child
            // forked after the stop) runs until it is found and stopped as well.
            let regroup = match (&key, hold.members.first()) {
                (HoldKey::Group(dir), Some(leader))
                    if !hold
                        .members
                        .iter()
                        .any(|t| matches!(t, Target::Cgroup { .. })) =>
                {
                    Some((dir.clone(), leader.clone()))
                }
                _ => None,
            };
            self.ask(Continuation::Rechecked(key.clone()), |req| HoldCmd::Check {
                req,
                op: Op::Suspend,
                targets,
            });
            if let Some((dir, leader)) = regroup {
                self.ask(Continuation::Regrouped(key), |req| HoldCmd::Members {
                    req,
                    dir,
                    leader,
                });
            }
        }
    }

    /// `plan`, or the freezer of its signalled cgroup when that cgroup had to be frozen
    /// in the last [`REMEMBER_NS`] (its processes resumed themselves).
    pub(super) fn remembered(
        &self,
        plan: &crate::control::target::Plan,
    ) -> crate::control::target::Plan {
        use crate::control::target::{Frozen, Held, Stop};
        plan.clone().map_held(|held| match held {
            Held::Stop(Stop::SignalCgroup { dir, version, .. })
                if self
                    .resumed_itself
                    .get(&dir)
                    .is_some_and(|at| self.now_ns.saturating_sub(*at) < REMEMBER_NS) =>
            {
                Held::Stop(Stop::Freeze(Frozen {
                    dir,
                    version,
                    cell: None,
                }))
            }
            // A process that had to be moved into a cell of the agent's own: moved in and
            // frozen at once.
            Held::Stop(Stop::Signal(key)) => match self.isolated.get(&key) {
                Some((cell, at)) if self.now_ns.saturating_sub(*at) < REMEMBER_NS => {
                    Frozen::of(cell).map_or(held, |f| Held::Stop(Stop::Freeze(f)))
                }
                _ => held,
            },
            h => h,
        })
    }

    /// A suspension by signal that is still not confirmed: its processes are sent SIGSTOP
    /// again, and a signalled cgroup is frozen (recorded first) once they have stayed
    /// unconfirmed for [`ESCALATE_PENDING_NS`]. Its confirmation is then the freezer's
    /// (see [`HoldBook::confirm_escalated`]).
    pub(super) fn restop_pending(&mut self, p: &Pending, now: u64) {
        let waited = now.saturating_sub(p.started_ns);
        let running: Vec<Target> = p
            .members
            .iter()
            .filter(|t| matches!(t, Target::Process { .. }))
            .cloned()
            .collect();
        if running.is_empty() || waited < RESTOP_AFTER_NS {
            return;
        }
        let Some(hold) = self.held.get_mut(&p.key).filter(|h| h.serial == p.serial) else {
            return;
        };
        let escalates =
            hold.escalate.is_some() || (!hold.cell_asked && hold.lone_process().is_some());
        let broken = (waited >= ESCALATE_PENDING_NS && escalates).then(|| {
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
            self.escalate(p.key.clone(), p.serial, b);
        }
    }

    /// Holds a breaking hold by something the tenant cannot undo: its signalled cgroup's
    /// freezer, or, for a process held alone, a cell of the agent's own (asked for once
    /// per hold); recorded first like any suspension. Without either the break is only
    /// reported.
    fn escalate(&mut self, key: HoldKey, serial: u64, broken: Broken) {
        let Some(hold) = self.held.get_mut(&key).filter(|h| h.serial == serial) else {
            self.broken.push(broken);
            return;
        };
        if let Some(cg) = hold.escalate.take() {
            let entries = vec![cg.record()];
            self.ask(
                Continuation::RecordedEscalation(key, serial, cg, broken),
                |req| HoldCmd::RecordAdd { req, entries },
            );
            return;
        }
        match hold.lone_process().filter(|_| !hold.cell_asked) {
            Some(process) => {
                hold.cell_asked = true;
                self.ask(Continuation::Isolated(key, serial, broken), |req| {
                    HoldCmd::Isolate { req, key: process }
                });
            }
            None => self.broken.push(broken),
        }
    }

    /// The answer to [`HoldCmd::Isolate`]: the cell is recorded, then the process moved in
    /// and frozen; without one, the hold stays on signals and says so.
    pub(super) fn isolated(
        &mut self,
        key: HoldKey,
        serial: u64,
        mut b: Broken,
        cell: Result<Target, String>,
    ) {
        match cell {
            Ok(cg) if self.current(&key, serial) => {
                let entries = vec![cg.record()];
                self.ask(
                    Continuation::RecordedEscalation(key, serial, cg, b),
                    |req| HoldCmd::RecordAdd { req, entries },
                );
            }
            Ok(_) => self.broken.push(b),
            Err(why) => {
                b.unheld = Some(why);
                self.broken.push(b);
            }
        }
    }

    /// A pending suspension whose hold was frozen meanwhile waits for the freezer, not for
    /// its processes (frozen tasks are not in the stopped state).
    pub(super) fn confirm_escalated(&self, p: &mut Pending) {
        if p.op != Op::Suspend || p.members.iter().any(|t| matches!(t, Target::Cgroup { .. })) {
            return;
        }
        let Some(hold) = self.held.get(&p.key).filter(|h| h.serial == p.serial) else {
            return;
        };
        let frozen: Vec<Target> = hold
            .members
            .iter()
            .filter(|t| matches!(t, Target::Cgroup { .. }))
            .cloned()
            .collect();
        if !frozen.is_empty() {
            p.members = frozen;
        }
    }

    /// A held hold was looked at: stop again what runs; freeze a signalled cgroup that
    /// keeps resuming itself.
    pub(super) fn rechecked(&mut self, key: HoldKey, state: Vec<Progress>) {
        let Some(hold) = self.held.get_mut(&key) else {
            return;
        };
        let running: Vec<Target> = hold
            .checked_members()
            .into_iter()
            .zip(&state)
            // A gate holds nothing (its fallback does): there is nothing behind it to find
            // running.
            .filter(|(t, p)| matches!(p, Progress::Pending) && !matches!(t, Target::Gate { .. }))
            .map(|(t, _)| t)
            .collect();
        // Found running with no freezer holding it: the tenant may be running now.
        hold.escaping = !running.is_empty();
        if running.is_empty() {
            return;
        }
        let broken = hold.broke(running.len());
        let escalates = hold.breaks >= ESCALATE_AFTER;
        let serial = hold.serial;
        self.ask(Continuation::Restopped, |req| HoldCmd::Start {
            req,
            op: Op::Suspend,
            targets: running,
            budget: std::time::Duration::ZERO,
        });
        if escalates {
            self.escalate(key, serial, broken);
        } else {
            self.broken.push(broken);
        }
    }

    pub(super) fn recorded_escalation(
        &mut self,
        key: HoldKey,
        serial: u64,
        cg: Target,
        b: Broken,
        ok: bool,
    ) {
        if !ok {
            self.notes.push(Note::EscalationNotRecorded);
            // The next break may try again.
            if let Some(h) = self.held.get_mut(&key).filter(|h| h.serial == serial) {
                h.escalate.get_or_insert(cg);
            }
            self.broken.push(b);
            return;
        }
        if !self.current(&key, serial) {
            // Released (or replaced) while the record was written: nothing to freeze; out
            // of the record again, unless another hold covers it.
            self.forget(std::slice::from_ref(&cg));
            self.broken.push(b);
            return;
        }
        let targets = vec![cg.clone()];
        self.ask(Continuation::StartedEscalation(key, serial, cg, b), |req| {
            HoldCmd::Start {
                req,
                op: Op::Suspend,
                targets,
                budget: std::time::Duration::ZERO,
            }
        });
    }

    pub(super) fn started_escalation(
        &mut self,
        key: HoldKey,
        serial: u64,
        cg: Target,
        mut b: Broken,
        p: Vec<Progress>,
    ) {
        match p.first() {
            Some(Progress::Done | Progress::Pending | Progress::Skipped) => {
                match self.held.get_mut(&key).filter(|h| h.serial == serial) {
                    Some(h) => {
                        let now = self.now_ns;
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
                        h.members.push(cg);
                        h.escaping = false;
                        b.escalated = true;
                    }
                    // Released meanwhile: thawed again, and out of the record only once
                    // the thaw is confirmed (unless another hold covers it).
                    None => self.start_resume(key, b.kind, vec![cg], false),
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
    pub(super) fn regrouped(&mut self, key: HoldKey, members: Vec<Target>, gone: bool, now: u64) {
        let Some(hold) = self.held.get(&key) else {
            return;
        };
        if gone {
            // Removed once its last process exited: nothing is left to hold or to look
            // for again. The hold ends (its resume finds every member gone) and leaves the
            // record.
            self.notes.push(Note::HoldGone { hold: key.clone() });
            self.release(key, now);
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
        self.ask(Continuation::RecordedNewcomers(key, newcomers), |req| {
            HoldCmd::RecordAdd { req, entries }
        });
    }

    pub(super) fn recorded_newcomers(&mut self, key: HoldKey, newcomers: Vec<Target>, ok: bool) {
        let Some(hold) = self.held.get_mut(&key) else {
            // Released meanwhile: nothing to stop; out of the record again.
            self.forget(&newcomers);
            return;
        };
        if !ok {
            self.notes.push(Note::NewcomersNotRecorded {
                processes: newcomers.len(),
            });
            return;
        }
        self.notes.push(Note::NewcomersStopped {
            hold: key.clone(),
            processes: newcomers.len(),
        });
        hold.members.extend(newcomers.iter().cloned());
        self.ask(Continuation::Restopped, |req| HoldCmd::Start {
            req,
            op: Op::Suspend,
            targets: newcomers,
            budget: std::time::Duration::ZERO,
        });
    }

    /// The holds to re-check now: round robin from a cursor, at most
    /// RECHECK_TARGETS_PER_TICK targets and only those not checked for an interval, then
    /// every hold found broken before.
    fn due_for_recheck(&mut self, now: u64) -> Vec<HoldKey> {
        // Broken holds at every re-check; the others round-robin from a cursor, at most
        // RECHECK_TARGETS_PER_TICK targets a re-check and only when due (so the cost does
        // not grow with the number of held processes, nor with how often the loop wakes:
        // with many holds, each is checked less often), looking at no more than
        // RECHECK_SCAN holds.
        let mut due: Vec<HoldKey> = Vec::new();
        let mut budget = RECHECK_TARGETS_PER_TICK;
        let start = self.recheck_cursor.take();
        let after = start
            .clone()
            .map(std::ops::Bound::Excluded)
            .unwrap_or(std::ops::Bound::Unbounded);
        let ring = self
            .held
            .range((after, std::ops::Bound::Unbounded))
            .chain(self.held.iter())
            .take(self.held.len().min(RECHECK_SCAN));
        let mut last = None;
        for (k, h) in ring {
            // The cursor stays on the last hold looked at: one left for want of budget is
            // the first of the next re-check (it was skipped for good when each hold
            // filled the budget, as gate holds of two targets do).
            if budget == 0 {
                break;
            }
            last = Some(k.clone());
            if h.breaks == 0
                && now.saturating_sub(h.checked_ns) + self.recheck_ns / 4 >= self.recheck_ns
                && !self.pending.iter().any(|p| p.key == *k)
            {
                budget = budget.saturating_sub(h.members.len());
                due.push(k.clone());
            }
        }
        self.recheck_cursor = last.or(start);
        due.extend(
            self.held
                .iter()
                .filter(|(_, h)| h.breaks > 0)
                .map(|(k, _)| k.clone()),
        );
        due
    }
}
