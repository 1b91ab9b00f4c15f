//! The hold book: what is suspended, on whose behalf, and the promise that nothing is
//! suspended before the record holds it on disk.
//!
//! The book does no I/O. It asks for what it needs as commands ([`HoldCmd`]) and is told
//! what came of them ([`HoldObs`]); the loop's shell (its hands, `shell/hands.rs`) performs
//! the commands in order and feeds the results back until the book asks for nothing more.
//! Record before act is the order of the conversation: a suspension's `Start` is only asked
//! for after the `Recorded` answer to its `RecordAdd` said the record holds it.
//!
//! ```text
//!  suspend(plans) ─► [Members: a signalled cgroup's processes] ─► RecordAdd
//!                        ──Recorded ok──► Start(Suspend) ─► Progress: done | pending | failed
//!                        ──Recorded err─► nothing suspended, Failed(Record)      │
//!  pending ─► Check each tick (50 µs after the start, the gap doubling to 1 ms) ◄─┘
//!  failed  ─► Start(Resume) (undone), the holders retried by the loop
//!  resume(holders) ─► Start(Resume) ─► confirmed ─► RecordRemove (one batch)
//! ```
//!
//! A hold is released when its last holder (an offline GPU process) is resumed. What is not
//! confirmed yet is checked again every tick without waiting, until `--confirm-timeout`: a
//! stuck cgroup never stalls the loop, and so never the other GPUs. A suspension that fails
//! or times out is undone.

mod finish;
mod gate;
mod io;
mod pending;
mod recheck;
mod suspend;

pub use recheck::Broken;

use crate::control::model::act::{Kind, Progress, RecordEntry};
use crate::control::model::ProcKey;
use crate::control::note::Note;
pub use crate::control::target::HoldKey;
use crate::control::target::Plan;
use crate::control::target::Target;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// First re-check of a pending operation, ns after it started; the gap doubles up to
/// [`CHECK_MAX_NS`]. A SIGSTOP takes effect when its target next runs (tens to hundreds
/// of µs on a busy node); a freezer when every task has reached it.
pub const CHECK_FIRST_NS: u64 = 50_000;
/// Longest gap between two checks of a pending operation, ns.
pub const CHECK_MAX_NS: u64 = 1_000_000;

/// How long a launch gate's acknowledgement is waited for before the process is stopped
/// by its fallback (freezer or signal), by default: about 6 × the drain measured with
/// K = 4 and 2 ms kernels on the simulated GPU (7.6 ms). Real drains are unmeasured.
pub const DEFAULT_GATE_TIMEOUT: Duration = Duration::from_millis(50);

pub use io::{Completion, Escalation, Failure, HoldCmd, HoldObs, Outcome, Req};
use pending::Pending;
use pending::{members_progress, pending_members};

struct Hold {
    /// Tells this hold from an earlier one on the same key (an answer that comes after a
    /// release belongs to the hold it was asked for).
    serial: u64,
    members: Vec<Target>,
    holders: BTreeSet<ProcKey>,
    kind: Kind,
    /// The freezer this hold escalates to when its processes resume themselves.
    escalate: Option<Target>,
    /// What suspends its holder when its launch gate is not acknowledged in time.
    fallback: Option<Plan>,
    /// The epoch its launch gate was closed at.
    epoch: Option<u32>,
    /// When its members were last checked, ns.
    checked_ns: u64,
    /// Times a member was found running while held.
    breaks: u32,
    /// Found running at its latest check, with nothing the tenant cannot undo holding it.
    escaping: bool,
    /// Asked for a cell of the agent's own (answered or not): asked once per hold.
    cell_asked: bool,
    /// It holds one process alone by signal (directly, or as its gate's fallback): a
    /// cell of the agent's own can hold it instead.
    alone: bool,
}

/// What the book does with the answer to a request: the request is waiting for its
/// answer in this state of the hold's conversation.
enum Continuation {
    /// A fresh hold's cgroup members.
    Materialised(HoldKey),
    /// Fresh holds recorded: start suspending them.
    RecordedFresh(Vec<HoldKey>),
    /// A fresh gate hold's gate closed (or not).
    ClosedGate(HoldKey),
    /// Fresh holds' suspension started: (hold, member count), in the command's order.
    StartedFresh(Vec<(HoldKey, usize)>),
    /// A resume started (a release, or the undo of a failed suspension).
    StartedResume {
        key: HoldKey,
        kind: Kind,
        members: Vec<Target>,
        /// Report its completion (a release does; an undo does not).
        report: bool,
    },
    /// A pending operation looked at.
    Checked(Pending),
    /// A held hold looked at.
    Rechecked(HoldKey),
    /// Members found running stopped again: nothing to do with the answer.
    Restopped,
    /// A signalled cgroup's processes listed again while held.
    Regrouped(HoldKey),
    /// Processes that joined a signalled cgroup while it was held, recorded: stop them.
    RecordedNewcomers(HoldKey, Vec<Target>),
    /// A cell of the agent's own for a process held alone, made (or not): record it.
    Isolated(HoldKey, u64, Broken),
    /// A freezer escalation recorded: freeze it.
    RecordedEscalation(HoldKey, u64, Target, Broken),
    /// A freezer escalation started.
    StartedEscalation(HoldKey, u64, Target, Broken),
    /// A gate hold's fallback members listed.
    FallbackMembers(Pending, Plan),
    /// A gate hold's fallback recorded: start it.
    RecordedFallback(Pending, Plan, Vec<Target>),
    /// A gate hold's fallback started.
    StartedFallback(Pending, Plan, Vec<Target>),
    /// Everything resumed at once (fail-open, shutdown).
    ReleasedAll(Vec<(HoldKey, Vec<Target>)>),
}

/// Result of [`HoldBook::suspend`].
#[derive(Debug, Default)]
pub struct Started {
    /// Holds whose suspension started now: (holder, hold).
    pub started: Vec<(ProcKey, HoldKey)>,
}

/// The suspension holds.
pub struct HoldBook {
    held: BTreeMap<HoldKey, Hold>,
    /// Fresh holds on their way to the record and the actuator.
    staged: BTreeMap<HoldKey, Hold>,
    /// Fresh holds whose members are known, recorded at the end of the step.
    to_record: Vec<HoldKey>,
    /// Fresh holds recorded, started together at the end of the step.
    to_start: Vec<HoldKey>,
    pending: Vec<Pending>,
    /// Holders whose suspension failed (it was undone, or never started because the
    /// record could not be written): the loop retries them.
    failed: Vec<ProcKey>,
    /// Resumed targets still in the record (see [`HoldBook::flush_forgotten`]).
    forgotten: Vec<RecordEntry>,
    /// Signalled cgroups that had to be frozen because their processes kept resuming
    /// themselves, with when: frozen at once by the next suspensions for
    /// [`recheck::REMEMBER_NS`], instead of starting over with signals.
    resumed_itself: BTreeMap<std::path::PathBuf, u64>,
    /// Processes held alone that had to be moved into a cell of the agent's own, with
    /// the cell and when: moved in and frozen at once by the next suspensions for
    /// [`recheck::REMEMBER_NS`].
    isolated: BTreeMap<ProcKey, (Target, u64)>,
    /// Operations that ended, for the loop's events.
    done: Vec<Completion>,
    /// Holds found running while held, for the loop's reports.
    broken: Vec<Broken>,
    /// Processes whose launch gate answered a close (true: acknowledged in time; false:
    /// silent until `--gate-timeout`), for the gate book.
    gate_answers: Vec<(ProcKey, bool)>,
    /// How often a held target is checked again (`--recheck-interval`), ns.
    pub(crate) recheck_ns: u64,
    /// Where the round-robin re-check goes on next tick.
    recheck_cursor: Option<HoldKey>,
    /// When the next re-check is due, ns.
    next_recheck_ns: u64,
    confirm_timeout: Duration,
    /// How long a launch gate's acknowledgement is waited for (`--gate-timeout`).
    pub(crate) gate_timeout: Duration,
    /// The time of the latest call, ns.
    now_ns: u64,
    next_req: Req,
    /// Answers to requests below this one that are no longer waited for are dropped (a
    /// record write that lands after everything was released).
    abandoned_below: Req,
    next_serial: u64,
    waiting: BTreeMap<Req, Continuation>,
    out: Vec<HoldCmd>,
    /// What the book has to say (logs, counters), for the shell.
    notes: Vec<Note>,
}

impl std::fmt::Debug for HoldBook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HoldBook")
            .field("held", &self.held.len())
            .field("pending", &self.pending.len())
            .field("waiting", &self.waiting.len())
            .finish()
    }
}

impl HoldBook {
    /// An empty book.
    pub fn new(confirm_timeout: Duration) -> HoldBook {
        HoldBook {
            held: BTreeMap::new(),
            staged: BTreeMap::new(),
            to_record: Vec::new(),
            to_start: Vec::new(),
            pending: Vec::new(),
            failed: Vec::new(),
            forgotten: Vec::new(),
            resumed_itself: BTreeMap::new(),
            isolated: BTreeMap::new(),
            done: Vec::new(),
            broken: Vec::new(),
            gate_answers: Vec::new(),
            recheck_ns: recheck::RECHECK_NS,
            recheck_cursor: None,
            next_recheck_ns: 0,
            confirm_timeout,
            gate_timeout: DEFAULT_GATE_TIMEOUT,
            now_ns: 0,
            next_req: 1,
            abandoned_below: 0,
            next_serial: 1,
            waiting: BTreeMap::new(),
            out: Vec::new(),
            notes: Vec::new(),
        }
    }

    /// Asks for something whose answer comes back as an observation.
    fn ask(&mut self, then: Continuation, cmd: impl FnOnce(Req) -> HoldCmd) {
        let req = self.next_req;
        self.next_req += 1;
        self.waiting.insert(req, then);
        self.out.push(cmd(req));
    }

    /// The commands asked for since the last call, in order.
    pub fn take_commands(&mut self) -> Vec<HoldCmd> {
        std::mem::take(&mut self.out)
    }

    /// Some command waits to be taken.
    pub fn has_commands(&self) -> bool {
        !self.out.is_empty()
    }

    /// Some answer is still awaited.
    pub fn waiting(&self) -> bool {
        !self.waiting.is_empty()
    }

    /// What the book has to say since the last call, in order.
    pub fn take_notes(&mut self) -> Vec<Note> {
        std::mem::take(&mut self.notes)
    }

    /// A serial for a new hold.
    fn serial(&mut self) -> u64 {
        self.next_serial += 1;
        self.next_serial
    }

    /// Whether `serial` is the current hold on `key`.
    fn current(&self, key: &HoldKey, serial: u64) -> bool {
        self.held.get(key).is_some_and(|h| h.serial == serial)
    }

    /// Operations that ended since the last call.
    pub fn take_done(&mut self) -> Vec<Completion> {
        std::mem::take(&mut self.done)
    }

    /// Holds found running while held since the last call.
    pub fn take_broken(&mut self) -> Vec<Broken> {
        std::mem::take(&mut self.broken)
    }

    /// Processes whose launch gate acknowledged a close in time (true) or stayed silent
    /// until `--gate-timeout` (false), since the last call.
    pub fn take_gate_answers(&mut self) -> Vec<(ProcKey, bool)> {
        std::mem::take(&mut self.gate_answers)
    }

    /// Holders whose suspension failed since the last call (it was undone, or never
    /// started because the record could not be written).
    pub fn take_failed(&mut self) -> Vec<ProcKey> {
        std::mem::take(&mut self.failed)
    }

    /// Number of holds (suspended or being suspended).
    pub fn len(&self) -> usize {
        self.held.len() + self.staged.len()
    }

    /// Nothing is held.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty() && self.staged.is_empty()
    }

    /// Some suspension or resumption waits for confirmation.
    pub fn pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// When the held targets are next re-checked, ns (`None`: nothing is held).
    pub fn next_recheck_ns(&self) -> Option<u64> {
        (!self.held.is_empty()).then_some(self.next_recheck_ns)
    }

    /// When the next pending operation is due to be checked, ns.
    pub fn next_check_ns(&self) -> Option<u64> {
        self.pending
            .iter()
            .map(|p| match p.escalate_ns {
                // A gate waiting for its drain: the acknowledgement wakes the loop through
                // the page; nothing is due before the bound.
                Some(e) => e,
                None => p.next_check_ns.min(p.deadline_ns),
            })
            .min()
    }

    /// Whether some hold has a launch gate closed.
    pub fn gates_closed(&self) -> bool {
        self.held
            .values()
            .any(|h| h.members.iter().any(|t| matches!(t, Target::Gate { .. })))
    }

    /// Holders of holds found running at their latest check that nothing the tenant
    /// cannot undo holds (no freezer, no cell, no driver lock): their work may run.
    pub fn escaping(&self) -> impl Iterator<Item = &ProcKey> {
        self.held
            .values()
            .filter(|h| h.escaping)
            .flat_map(|h| h.holders.iter())
    }

    /// Whether `holder` holds some suspension.
    pub fn holds(&self, holder: &ProcKey) -> bool {
        self.held
            .values()
            .chain(self.staged.values())
            .any(|h| h.holders.contains(holder))
    }

    /// Whether a hold may have `key` stopped or frozen now — itself, or `cgroup` (a
    /// directory it is in) or a cgroup above it — held, being started, or resuming and not
    /// confirmed yet. The driver's restore runs on a thread inside the process: it waits
    /// for this to end (thaw first).
    pub fn stops(&self, key: &ProcKey, cgroup: Option<&std::path::Path>) -> bool {
        let hit = |t: &Target| match t {
            Target::Process { key: k, .. } => k == key,
            Target::Cgroup { dir, .. } => cgroup.is_some_and(|c| c.starts_with(dir)),
            Target::Gate { .. } | Target::Lock { .. } => false,
        };
        // A cgroup hold on its way (its members not listed yet), or a gate's fallback on
        // its way to stop a whole cgroup, stops every process in it once it starts: a
        // driver call asked now would find the process stopped.
        let inside = |d: &std::path::Path| cgroup.is_some_and(|c| c.starts_with(d));
        let under = |k: &HoldKey| match k {
            HoldKey::Group(d) | HoldKey::Cgroup(d) => inside(d),
            _ => false,
        };
        let falls_back = |p: &Plan| p.cgroup().is_some_and(inside);
        self.held
            .values()
            .chain(self.staged.values())
            .any(|h| h.members.iter().any(hit) || h.escalate.iter().any(hit))
            || self.staged.keys().any(under)
            || self.pending.iter().any(|p| p.all.iter().any(hit))
            || self.waiting.values().any(|t| match t {
                Continuation::StartedResume { members, .. } => members.iter().any(hit),
                Continuation::ReleasedAll(holds) => holds.iter().any(|(_, m)| m.iter().any(hit)),
                Continuation::FallbackMembers(_, plan)
                | Continuation::RecordedFallback(_, plan, _)
                | Continuation::StartedFallback(_, plan, _) => falls_back(plan),
                _ => false,
            })
    }

    /// Forgets every hold without acting: something else (the NVML watchdog) resumed
    /// them all and cleared the record.
    pub fn forget_all(&mut self) {
        self.held.clear();
        self.staged.clear();
        self.to_record.clear();
        self.to_start.clear();
        self.pending.clear();
        self.forgotten.clear();
        self.waiting.clear();
        self.abandoned_below = self.next_req;
        self.out.clear();
    }

    /// Takes in what came of the commands; asks for the next ones.
    pub fn observe(&mut self, obs: Vec<HoldObs>, now: u64) {
        self.now_ns = now;
        for o in obs {
            let req = match &o {
                HoldObs::Members { req, .. }
                | HoldObs::Recorded { req, .. }
                | HoldObs::GateClosed { req, .. }
                | HoldObs::Progress { req, .. }
                | HoldObs::Cell { req, .. } => *req,
            };
            let Some(then) = self.waiting.remove(&req) else {
                debug_assert!(req < self.abandoned_below, "an answer to no request: {o:?}");
                continue;
            };
            match (then, o) {
                (Continuation::Materialised(key), HoldObs::Members { members, .. }) => {
                    if let Some(h) = self.staged.get_mut(&key) {
                        h.members = members;
                        self.to_record.push(key);
                    }
                }
                (Continuation::RecordedFresh(keys), HoldObs::Recorded { ok, .. }) => {
                    self.recorded_fresh(keys, ok, now)
                }
                (Continuation::ClosedGate(key), HoldObs::GateClosed { epoch, .. }) => {
                    self.closed_gate(key, epoch, now)
                }
                (
                    Continuation::StartedFresh(keys),
                    HoldObs::Progress {
                        progress, at_ns, ..
                    },
                ) => self.started_fresh(keys, progress, now, at_ns),
                (
                    Continuation::StartedResume {
                        key,
                        kind,
                        members,
                        report,
                    },
                    HoldObs::Progress {
                        progress, at_ns, ..
                    },
                ) => self.started_resume(key, kind, members, report, progress, now, at_ns),
                (Continuation::Checked(p), HoldObs::Progress { progress, .. }) => {
                    self.checked(p, progress, now)
                }
                (Continuation::Rechecked(key), HoldObs::Progress { progress, .. }) => {
                    self.rechecked(key, progress)
                }
                (Continuation::Restopped, HoldObs::Progress { .. }) => {}
                (Continuation::Regrouped(key), HoldObs::Members { members, gone, .. }) => {
                    self.regrouped(key, members, gone, now)
                }
                (Continuation::RecordedNewcomers(key, newcomers), HoldObs::Recorded { ok, .. }) => {
                    self.recorded_newcomers(key, newcomers, ok)
                }
                (Continuation::Isolated(key, serial, b), HoldObs::Cell { cell, .. }) => {
                    self.isolated(key, serial, b, cell)
                }
                (
                    Continuation::RecordedEscalation(key, serial, cg, b),
                    HoldObs::Recorded { ok, .. },
                ) => self.recorded_escalation(key, serial, cg, b, ok),
                (
                    Continuation::StartedEscalation(key, serial, cg, b),
                    HoldObs::Progress { progress, .. },
                ) => self.started_escalation(key, serial, cg, b, progress),
                (Continuation::FallbackMembers(p, plan), HoldObs::Members { members, .. }) => {
                    self.record_fallback(p, plan, members)
                }
                (
                    Continuation::RecordedFallback(p, plan, members),
                    HoldObs::Recorded { ok, .. },
                ) => self.recorded_fallback(p, plan, members, ok, now),
                (
                    Continuation::StartedFallback(p, plan, members),
                    HoldObs::Progress {
                        progress, at_ns, ..
                    },
                ) => self.started_fallback(p, plan, members, progress, now, at_ns),
                (Continuation::ReleasedAll(holds), HoldObs::Progress { progress, .. }) => {
                    self.released_all(holds, progress)
                }
                (_, o) => {
                    debug_assert!(false, "an answer of the wrong kind: {o:?}");
                }
            }
        }
        self.record_staged();
        self.start_recorded();
        self.flush_forgotten();
    }
}

#[cfg(test)]
mod tests;
