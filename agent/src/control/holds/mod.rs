//! The hold book: what is suspended, on whose behalf, and the promise that nothing is
//! suspended before the record holds it on disk.
//!
//! The book does no I/O. It asks for what it needs as commands ([`HoldCmd`]) and is told
//! what came of them ([`HoldObs`]); the loop's shell (its hands, `shell/hands.rs`) performs
//! the commands in order and feeds the results back until the book asks for nothing more.
//! Record before act is the order of the conversation: a suspension's `Start` is only asked
//! for after the `Recorded` answer to its `RecordAdd` said the record holds it.
//!
//! Each hold is in one [`State`], which says what it waits for; a request's
//! [`Continuation`] names the hold and the transition its answer makes:
//!
//! ```text
//!  suspend(plan) ─► Listing ──Members──► Listed     (a signalled cgroup's processes)
//!              └──────────────────────► Listed ──(end of step) RecordAdd──► Recording
//!  Recording ──Recorded ok──► Recorded ──(end of step)──► Starting: Start (one batch)
//!            │                        └─────────────────► Closing: CloseGate (a gate)
//!            └─Recorded err─► gone: Failed(Record), holders retried
//!  Starting ──Progress──► done: Held │ pending: Confirming │ failed: gone, undone
//!  Closing ──GateClosed──► epoch: Gated │ none: FallingBack
//!  Gated ──ack = epoch, or --gate-timeout at a poll──► FallingBack
//!  FallingBack ──[Members] RecordAdd ok, Start──► Held │ Confirming   (err: gone, undone)
//!  Confirming ──poll: Check (50 µs, the gap doubling to 1 ms)──► confirmed: Held
//!             └─ failed, or past --confirm-timeout ─► gone, undone
//!  Held ──recheck: Check──► found running: stopped again (a signal's backstop: signal.rs)
//!  resume(last holder) ─► not started (Listing … Starting): gone, Skipped
//!                      └► started: gone (Confirming, Gated, FallingBack: Skipped) ─► Start(Resume)
//!      ─► pending: a Resume, Check at each poll ─► confirmed ─► RecordRemove (one batch)
//! ```
//!
//! What each kind of hold does of its own is in its module: [`signal`] (a process alone or
//! a cgroup's processes by SIGSTOP, stopped again when resumed, then frozen), [`gate`] (close,
//! acknowledgement, fallback). A freeze and a driver's lock have nothing of their own here:
//! the actuator writes `cgroup.freeze`, and the driver book (`control/driver_book.rs`) holds the
//! driver's side of a lock, answering its `Start` and `Check` itself.
//!
//! A hold is released when its last holder (an offline GPU process) is resumed. What is not
//! confirmed yet is checked again every tick without waiting, until `--confirm-timeout`: a
//! stuck cgroup never stalls the loop, and so never the other GPUs. A suspension that fails
//! or times out is undone.

mod confirm;
mod finish;
mod gate;
mod io;
mod recheck;
mod signal;
mod suspend;

pub use signal::Broken;

use crate::control::model::act::{Kind, Progress, RecordEntry};
use crate::control::model::ProcKey;
use crate::control::note::Note;
pub use crate::control::target::HoldKey;
use crate::control::target::Plan;
use crate::control::target::Target;
use confirm::{members_progress, pending_members, Confirm, Resume};
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

/// Where a hold is in its life: what it waits for, and what the next input does with it.
#[derive(Debug)]
enum State {
    /// Its signalled cgroup's processes are asked for (`Members`): the answer makes them
    /// its members → `Listed`.
    Listing,
    /// Its members are known: its entries are asked of the record at the end of the step
    /// (`RecordAdd`) → `Recording`.
    Listed,
    /// Its entries are asked of the record, perhaps waiting for a write: `Recorded` ok →
    /// `Recorded`; refused → the hold ends, failed (`Failure::Record`), its holders retried.
    Recording,
    /// On disk: started at the end of the step with the others recorded in it → `Starting`
    /// (a gate → `Closing`).
    Recorded,
    /// Its launch gate is asked to close (`CloseGate`): closed at an epoch → `Gated`;
    /// cannot close → `FallingBack` at once.
    Closing,
    /// Its suspension is asked for (`Start`, no wait): done, gone or skipped → `Held`;
    /// pending → `Confirming`; failed → the hold ends, undone (its members resumed).
    Starting,
    /// Started, not confirmed yet: looked at (`Check`) by the poll when due (`looking`: the
    /// answer is awaited) → `Held` once confirmed; failed or past `--confirm-timeout` → the
    /// hold ends, undone. A signal still not seen taking hold is sent again, and its cgroup
    /// frozen ([`signal`]).
    Confirming { confirm: Confirm, looking: bool },
    /// Its gate closed at `epoch`: waits for the process's acknowledgement (every page's
    /// `gate_ack` equal to the epoch) or `until_ns` (`--gate-timeout`, at a poll) →
    /// `FallingBack`.
    Gated { epoch: u32, until_ns: u64 },
    /// Its gate's fallback (`plan`) is on its way: listed (a signalled cgroup), recorded,
    /// started → `Held` or `Confirming`; the record refused or the start failed → the hold
    /// ends, undone. `drained`: the process acknowledged the close (the gate keeps the
    /// label).
    FallingBack { plan: Plan, drained: bool },
    /// Suspended and confirmed: re-checked every `--recheck-interval` (round robin), what
    /// runs stopped again; the release of its last holder → the hold ends, resumed.
    Held,
}

impl State {
    /// Its suspension was started (else it is on its way to the record or the actuator).
    fn started(&self) -> bool {
        matches!(
            self,
            State::Confirming { .. }
                | State::Gated { .. }
                | State::FallingBack { .. }
                | State::Held
        )
    }

    /// It waits for a poll: a confirmation to look at, or a gate's acknowledgement.
    fn polled(&self) -> bool {
        matches!(
            self,
            State::Confirming { looking: false, .. } | State::Gated { .. }
        )
    }
}

/// What a hold of each kind keeps of its own, beside its members.
#[derive(Debug)]
enum Means {
    /// Nothing of its own: a freezer (the actuator writes `cgroup.freeze`), a driver's
    /// lock (the driver book holds the driver's side), a gate whose fallback is on its way.
    Plain,
    /// SIGSTOP, to one process alone or to a cgroup's processes ([`signal`]): `backstop`
    /// holds it once its processes keep resuming themselves.
    Signal { backstop: signal::Backstop },
    /// A launch gate ([`gate`]): `fallback` stops the process once the close is
    /// acknowledged, times out, or cannot be made.
    Gate { fallback: Plan },
}

impl Means {
    /// What a hold by `plan` keeps.
    fn of(plan: &Plan) -> Means {
        match plan.fallback() {
            Some(fallback) => Means::Gate { fallback },
            None => Means::signal(plan).map_or(Means::Plain, |backstop| Means::Signal { backstop }),
        }
    }
}

/// One suspension, on behalf of its holders.
struct Hold {
    /// Tells this hold from an earlier one on the same key (an answer that comes after a
    /// release belongs to the hold it was asked for).
    serial: u64,
    state: State,
    means: Means,
    members: Vec<Target>,
    holders: BTreeSet<ProcKey>,
    kind: Kind,
    /// When its members were last checked, ns.
    checked_ns: u64,
    /// Times a member was found running while held.
    breaks: u32,
    /// Found running at its latest check, with nothing the tenant cannot undo holding it.
    escaping: bool,
}

/// A hold, as a request names it: its key and its serial.
#[derive(Debug, Clone)]
struct HoldRef {
    key: HoldKey,
    serial: u64,
}

/// What the answer to a request does: the hold it is for and the transition it makes.
enum Continuation {
    /// `Listing` → `Listed`: a fresh hold's cgroup members.
    Listed(HoldRef),
    /// `Recording` → `Recorded`, or the hold ends failed.
    Recorded(HoldRef),
    /// `Closing` → `Gated`, or `FallingBack` (the gate cannot close).
    GateClosed(HoldRef),
    /// `Starting` → `Held`, `Confirming`, or ended: (hold, member count), in the
    /// command's order.
    Started(Vec<(HoldRef, usize)>),
    /// `Confirming` looked at → `Held`, `Confirming` again, or ended.
    Confirmed(HoldRef),
    /// A released hold's resume (or a failed suspension's undo) started.
    StartedResume {
        key: HoldKey,
        kind: Kind,
        members: Vec<Target>,
        /// Report its completion (a release does; an undo does not).
        report: bool,
    },
    /// A resume not confirmed yet looked at.
    ResumeChecked(Resume),
    /// A `Held` hold looked at: what runs is stopped again.
    Rechecked(HoldRef),
    /// Members found running stopped again: nothing to do with the answer.
    Restopped,
    /// A held signalled cgroup's processes listed again ([`signal`]).
    Regrouped(HoldRef),
    /// Processes that joined a held signalled cgroup, recorded: stop them ([`signal`]).
    RecordedNewcomers(HoldRef, Vec<Target>),
    /// A cell of the agent's own for a process held alone, made (or not): record it.
    Isolated(HoldRef, Broken),
    /// A freezer escalation recorded: freeze it.
    RecordedEscalation(HoldRef, Target, Broken),
    /// A freezer escalation started.
    StartedEscalation(HoldRef, Target, Broken),
    /// `FallingBack`: the fallback's members listed; record them.
    FallbackListed(HoldRef),
    /// `FallingBack`: the fallback's members recorded; start them.
    FallbackRecorded(HoldRef, Vec<Target>),
    /// `FallingBack` → `Held`, `Confirming`, or ended: the fallback started.
    FallbackStarted(HoldRef, Vec<Target>),
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
    /// Every hold, in its state.
    holds: BTreeMap<HoldKey, Hold>,
    /// Resumes of holds that ended, not confirmed yet.
    resumes: Vec<Resume>,
    /// Holders whose suspension failed (it was undone, or never started because the
    /// record could not be written): the loop retries them.
    failed: Vec<ProcKey>,
    /// Resumed targets still in the record (see [`HoldBook::flush_forgotten`]).
    forgotten: Vec<RecordEntry>,
    /// Resumed targets kept in the record because another hold covered them: one that
    /// ends without being started (its write failed) lets them go.
    left_to_others: BTreeSet<RecordEntry>,
    /// Signalled cgroups that had to be frozen because their processes kept resuming
    /// themselves, with when: frozen at once by the next suspensions for
    /// [`signal::REMEMBER_NS`], instead of starting over with signals.
    resumed_itself: BTreeMap<std::path::PathBuf, u64>,
    /// Processes held alone that had to be moved into a cell of the agent's own, with
    /// the cell and when: moved in and frozen at once by the next suspensions for
    /// [`signal::REMEMBER_NS`].
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
            .field("holds", &self.holds.len())
            .field("resumes", &self.resumes.len())
            .field("waiting", &self.waiting.len())
            .finish()
    }
}

impl HoldBook {
    /// An empty book.
    pub fn new(confirm_timeout: Duration) -> HoldBook {
        HoldBook {
            holds: BTreeMap::new(),
            resumes: Vec::new(),
            failed: Vec::new(),
            forgotten: Vec::new(),
            left_to_others: BTreeSet::new(),
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

    /// The record book dropped these requests: what asked for their entries let them go
    /// before a write carried them (a hold cancelled on its way), so no answer will come.
    pub fn dropped(&mut self, reqs: &[Req]) {
        for r in reqs {
            self.waiting.remove(r);
        }
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

    /// A new hold on `key`, in its first state.
    fn add(&mut self, key: HoldKey, hold: Hold) -> HoldRef {
        let r = HoldRef {
            key: key.clone(),
            serial: hold.serial,
        };
        self.holds.insert(key, hold);
        r
    }

    /// The hold a request names, if it is still the current hold on its key.
    fn hold(&self, r: &HoldRef) -> Option<&Hold> {
        self.holds.get(&r.key).filter(|h| h.serial == r.serial)
    }

    /// The hold a request names, if it is still the current hold on its key.
    fn hold_mut(&mut self, r: &HoldRef) -> Option<&mut Hold> {
        self.holds.get_mut(&r.key).filter(|h| h.serial == r.serial)
    }

    /// The hold a request names, taken out of the book (it ends).
    fn take(&mut self, r: &HoldRef) -> Option<Hold> {
        self.hold(r)?;
        self.holds.remove(&r.key)
    }

    /// The holds whose suspension started.
    fn started(&self) -> impl Iterator<Item = (&HoldKey, &Hold)> {
        self.holds.iter().filter(|(_, h)| h.state.started())
    }

    /// The holds in states matching `f`, in the book's order.
    fn in_state(&self, f: impl Fn(&State) -> bool) -> Vec<HoldRef> {
        self.holds
            .iter()
            .filter(|(_, h)| f(&h.state))
            .map(|(k, h)| HoldRef {
                key: k.clone(),
                serial: h.serial,
            })
            .collect()
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
        self.holds.len()
    }

    /// Nothing is held.
    pub fn is_empty(&self) -> bool {
        self.holds.is_empty()
    }

    /// Some suspension or resumption waits for confirmation.
    pub fn pending(&self) -> bool {
        !self.resumes.is_empty() || self.holds.values().any(|h| h.state.polled())
    }

    /// When the held targets are next re-checked, ns (`None`: nothing is held).
    pub fn next_recheck_ns(&self) -> Option<u64> {
        self.started().next().map(|_| self.next_recheck_ns)
    }

    /// When the next pending operation is due to be checked, ns.
    pub fn next_check_ns(&self) -> Option<u64> {
        let holds = self.holds.values().filter_map(|h| match &h.state {
            State::Confirming {
                confirm,
                looking: false,
            } => Some(confirm.due_ns()),
            // A gate waiting for its drain: the acknowledgement wakes the loop through
            // the page; nothing is due before the bound.
            State::Gated { until_ns, .. } => Some(*until_ns),
            _ => None,
        });
        let resumes = self.resumes.iter().map(|r| r.confirm.due_ns());
        holds.chain(resumes).min()
    }

    /// Whether some hold has a launch gate closed.
    pub fn gates_closed(&self) -> bool {
        self.started()
            .any(|(_, h)| h.members.iter().any(|t| matches!(t, Target::Gate { .. })))
    }

    /// Holders of holds found running at their latest check that nothing the tenant
    /// cannot undo holds (no freezer, no cell, no driver lock): their work may run.
    pub fn escaping(&self) -> impl Iterator<Item = &ProcKey> {
        self.started()
            .filter(|(_, h)| h.escaping)
            .flat_map(|(_, h)| h.holders.iter())
    }

    /// Whether `holder` holds some suspension.
    pub fn holds(&self, holder: &ProcKey) -> bool {
        self.holds.values().any(|h| h.holders.contains(holder))
    }

    /// Whether a hold may have `key` stopped or frozen now, or is on its way to — itself,
    /// or `cgroup` (a directory it is in) or a cgroup above it — held, being started (a
    /// gate's fallback or a freezer escalation among them), or resuming and not confirmed
    /// yet. The driver's restore runs on a thread inside the process: it waits
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
        // A fallback on its way stops its process, or its whole cgroup.
        let falls_back = |p: &Plan| p.cgroup().is_some_and(inside) || hit(&p.target());
        self.holds.iter().any(|(k, h)| {
            h.members.iter().any(hit)
                || matches!(&h.means, Means::Signal { backstop: signal::Backstop::Freezer(f) } if hit(f))
                || (!h.state.started() && under(k))
                || matches!(&h.state, State::FallingBack { plan, .. } if falls_back(plan))
        }) || self.resumes.iter().any(|r| r.all.iter().any(hit))
            || self.waiting.values().any(|t| match t {
                Continuation::StartedResume { members, .. } => members.iter().any(hit),
                Continuation::ReleasedAll(holds) => holds.iter().any(|(_, m)| m.iter().any(hit)),
                // A freezer escalation on its way to the record, for a hold still kept.
                Continuation::RecordedEscalation(r, cg, _) => self.hold(r).is_some() && hit(cg),
                _ => false,
            })
    }

    /// Forgets every hold without acting: something else (the NVML watchdog) resumed
    /// them all and cleared the record.
    pub fn forget_all(&mut self) {
        self.holds.clear();
        self.resumes.clear();
        self.forgotten.clear();
        self.left_to_others.clear();
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
                (Continuation::Listed(r), HoldObs::Members { members, .. }) => {
                    if let Some(h) = self.hold_mut(&r) {
                        h.members = members;
                        h.state = State::Listed;
                    }
                }
                (Continuation::Recorded(r), HoldObs::Recorded { ok, .. }) => {
                    self.recorded_fresh(r, ok, now)
                }
                (Continuation::GateClosed(r), HoldObs::GateClosed { epoch, .. }) => {
                    self.closed_gate(r, epoch, now)
                }
                (
                    Continuation::Started(holds),
                    HoldObs::Progress {
                        progress, at_ns, ..
                    },
                ) => self.started_fresh(holds, progress, now, at_ns),
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
                (Continuation::Confirmed(r), HoldObs::Progress { progress, .. }) => {
                    self.confirmed(r, progress, now)
                }
                (Continuation::ResumeChecked(r), HoldObs::Progress { progress, .. }) => {
                    self.resume_checked(r, progress, now)
                }
                (Continuation::Rechecked(r), HoldObs::Progress { progress, .. }) => {
                    self.rechecked(r, progress)
                }
                (Continuation::Restopped, HoldObs::Progress { .. }) => {}
                (Continuation::Regrouped(r), HoldObs::Members { members, gone, .. }) => {
                    self.regrouped(r, members, gone, now)
                }
                (Continuation::RecordedNewcomers(r, newcomers), HoldObs::Recorded { ok, .. }) => {
                    self.recorded_newcomers(r, newcomers, ok)
                }
                (Continuation::Isolated(r, b), HoldObs::Cell { cell, .. }) => {
                    self.isolated(r, b, cell)
                }
                (Continuation::RecordedEscalation(r, cg, b), HoldObs::Recorded { ok, .. }) => {
                    self.recorded_escalation(r, cg, b, ok)
                }
                (Continuation::StartedEscalation(r, cg, b), HoldObs::Progress { progress, .. }) => {
                    self.started_escalation(r, cg, b, progress)
                }
                (Continuation::FallbackListed(r), HoldObs::Members { members, .. }) => {
                    self.record_fallback(r, members)
                }
                (Continuation::FallbackRecorded(r, members), HoldObs::Recorded { ok, .. }) => {
                    self.recorded_fallback(r, members, ok, now)
                }
                (
                    Continuation::FallbackStarted(r, members),
                    HoldObs::Progress {
                        progress, at_ns, ..
                    },
                ) => self.started_fallback(r, members, progress, now, at_ns),
                (Continuation::ReleasedAll(holds), HoldObs::Progress { progress, .. }) => {
                    self.released_all(holds, progress)
                }
                (_, o) => {
                    debug_assert!(false, "an answer of the wrong kind: {o:?}");
                }
            }
        }
        self.record_listed();
        self.start_recorded();
        self.flush_forgotten();
    }
}

#[cfg(test)]
mod tests;
