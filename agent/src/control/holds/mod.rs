//! Suspension holds: what is suspended, on whose behalf, and the promise that nothing is
//! suspended before the record holds it on disk.
//!
//! ```text
//!  suspend(plans) ─► materialise members ─► record.add ──ok──► actuator.start(budget)
//!                   (cgroup.procs for a         │ err: nothing is suspended,
//!                    signalled cgroup)          ▼      fail_open{reason="record"}
//!                                          completions now, or pending ─► poll() each tick
//! ```
//!
//! A hold is released when its last holder (an offline GPU process) is resumed. Actuation
//! is confirmed within a small budget inline; what is not confirmed yet is checked again
//! every tick without waiting, until `--confirm-timeout`: a stuck cgroup never stalls the
//! loop, and so never the other GPUs. A suspension that fails or times out is undone.

mod finish;
mod gate;
mod recheck;
mod suspend;

pub use recheck::Broken;

pub use crate::control::target::HoldKey;
use crate::control::target::Plan;
use crate::edges::actuator::{Actuator, Kind, Op, Progress, RecordEntry, Target};
use crate::edges::clock::Clock;
use crate::edges::procfs::{ProcFs, ProcKey};
use crate::edges::record::RecordStore;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

/// How long an actuation is waited for inline: none. The actuator issues the operation
/// and looks once; what is not confirmed yet is checked again by the loop, which sleeps
/// between checks in its doorbell wait, so a launch on another GPU is seen meanwhile.
pub const INLINE_BUDGET: Duration = Duration::ZERO;

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

/// How a hold's operation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Confirmed.
    Done,
    /// The targets are gone.
    Gone,
    /// Not acted on (dry run), or abandoned (a resume overtook a pending suspension).
    Skipped,
    /// Failed, with a bounded reason.
    Failed(&'static str),
}

/// A hold finished an operation.
#[derive(Debug, Clone)]
pub struct Completion {
    /// The hold.
    pub key: HoldKey,
    /// Suspend or resume.
    pub op: Op,
    /// How it ended.
    pub outcome: Outcome,
    /// The actuator its members use.
    pub kind: Kind,
    /// When it was confirmed (or ended), ns.
    pub at_ns: u64,
}

struct Hold {
    members: Vec<Target>,
    holders: BTreeSet<ProcKey>,
    kind: Kind,
    /// The freezer this hold escalates to when its processes resume themselves.
    escalate: Option<Target>,
    /// What suspends its holder when its launch gate is not acknowledged in time.
    fallback: Option<Plan>,
    /// When its members were last checked, ns.
    checked_ns: u64,
    /// Times a member was found running while held.
    breaks: u32,
}

struct Pending {
    key: HoldKey,
    op: Op,
    kind: Kind,
    /// Members not confirmed yet.
    members: Vec<Target>,
    /// All members of the operation (what leaves the record when a resume completes).
    all: Vec<Target>,
    deadline_ns: u64,
    /// When it is checked next, and the gap after that, ns.
    next_check_ns: u64,
    gap_ns: u64,
    /// A gate close not acknowledged by then escalates to the hold's fallback, ns.
    escalate_ns: Option<u64>,
}

impl Pending {
    fn new(
        key: HoldKey,
        op: Op,
        kind: Kind,
        members: Vec<Target>,
        all: Vec<Target>,
        now: u64,
        timeout: Duration,
    ) -> Pending {
        Pending {
            key,
            op,
            kind,
            members,
            all,
            deadline_ns: now + timeout.as_nanos() as u64,
            next_check_ns: now + CHECK_FIRST_NS,
            gap_ns: CHECK_FIRST_NS,
            escalate_ns: None,
        }
    }
}

/// Result of [`Holds::suspend`].
#[derive(Debug, Default)]
pub struct Started {
    /// Holds whose suspension started now: (holder, hold).
    pub started: Vec<(ProcKey, HoldKey)>,
    /// Operations that ended now.
    pub done: Vec<Completion>,
}

/// The suspension holds, the actuator and the record.
pub struct Holds {
    actuator: Box<dyn Actuator>,
    record: Box<dyn RecordStore>,
    procfs: Arc<dyn ProcFs>,
    clock: Arc<dyn Clock>,
    held: BTreeMap<HoldKey, Hold>,
    pending: Vec<Pending>,
    /// Holders whose suspension failed and was undone (the loop retries them).
    failed: Vec<ProcKey>,
    /// Resumed targets still in the record (see [`Holds::flush_forgotten`]).
    forgotten: Vec<RecordEntry>,
    /// How often a held target is checked again (`--recheck-interval`), ns.
    pub(crate) recheck_ns: u64,
    /// Where the round-robin re-check goes on next tick.
    recheck_cursor: Option<HoldKey>,
    /// When the next re-check is due, ns.
    next_recheck_ns: u64,
    confirm_timeout: Duration,
    /// How long a launch gate's acknowledgement is waited for (`--gate-timeout`).
    pub(crate) gate_timeout: Duration,
}

impl std::fmt::Debug for Holds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Holds")
            .field("held", &self.held.len())
            .field("pending", &self.pending.len())
            .finish()
    }
}

pub(super) fn members_progress(p: &[Progress]) -> Option<Outcome> {
    if let Some(Progress::Failed(e)) = p.iter().find(|p| matches!(p, Progress::Failed(_))) {
        return Some(Outcome::Failed(e.reason()));
    }
    if p.iter().any(|p| matches!(p, Progress::Pending)) {
        return None;
    }
    Some(if p.iter().any(|p| matches!(p, Progress::Done)) {
        Outcome::Done
    } else if p.iter().all(|p| matches!(p, Progress::Skipped)) {
        Outcome::Skipped
    } else {
        Outcome::Gone
    })
}

impl Holds {
    /// Holds over `actuator` and `record`.
    pub fn new(
        actuator: Box<dyn Actuator>,
        record: Box<dyn RecordStore>,
        procfs: Arc<dyn ProcFs>,
        clock: Arc<dyn Clock>,
        confirm_timeout: Duration,
    ) -> Holds {
        Holds {
            actuator,
            record,
            procfs,
            clock,
            held: BTreeMap::new(),
            pending: Vec::new(),
            failed: Vec::new(),
            forgotten: Vec::new(),
            recheck_ns: recheck::RECHECK_NS,
            recheck_cursor: None,
            next_recheck_ns: 0,
            confirm_timeout,
            gate_timeout: DEFAULT_GATE_TIMEOUT,
        }
    }

    /// Number of holds (suspended or being suspended).
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Some suspension or resumption waits for confirmation.
    pub fn pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// When the held targets are next re-checked, ns (`None`: nothing is held).
    pub fn next_recheck_ns(&self) -> Option<u64> {
        (!self.held.is_empty()).then_some(self.next_recheck_ns)
    }

    /// The gate's heartbeat (see [`Actuator::keepalive`]).
    pub fn keepalive(&mut self) {
        self.actuator.keepalive();
    }

    /// Whether a launch gate is closed.
    pub fn gates_closed(&self) -> bool {
        self.actuator.gates_closed()
    }

    /// When the next pending operation is due to be checked, ns.
    pub fn next_check_ns(&self) -> Option<u64> {
        self.pending
            .iter()
            .map(|p| {
                p.next_check_ns
                    .min(p.deadline_ns)
                    .min(p.escalate_ns.unwrap_or(u64::MAX))
            })
            .min()
    }

    /// Nothing is held.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Whether `holder` holds some suspension.
    pub fn holds(&self, holder: &ProcKey) -> bool {
        self.held.values().any(|h| h.holders.contains(holder))
    }

    /// Holders whose suspension failed since the last call (it was undone, or never
    /// started because the record could not be written).
    pub fn take_failed(&mut self) -> Vec<ProcKey> {
        std::mem::take(&mut self.failed)
    }

    /// Releases `holders`; holds left without holders are resumed. Returns the holds whose
    /// resume started, by holder, and the operations that ended now.
    pub fn resume(
        &mut self,
        holders: &[ProcKey],
        now: u64,
    ) -> (Vec<(ProcKey, HoldKey)>, Vec<Completion>) {
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
        let mut done = Vec::new();
        for key in released {
            if let Some(c) = self.release(key, now) {
                done.push(c);
            }
        }
        self.flush_forgotten();
        (started, done)
    }

    fn release(&mut self, key: HoldKey, now: u64) -> Option<Completion> {
        let hold = self.held.remove(&key)?;
        let mut out = None;
        // A suspension still being confirmed is overtaken by the resume.
        if self
            .pending
            .iter()
            .any(|p| p.key == key && p.op == Op::Suspend)
        {
            self.pending
                .retain(|p| !(p.key == key && p.op == Op::Suspend));
            out = Some(Completion {
                key: key.clone(),
                op: Op::Suspend,
                outcome: Outcome::Skipped,
                kind: hold.kind,
                at_ns: now,
            });
        }
        let c = self.start_resume(key, hold.kind, hold.members, now);
        c.or(out)
    }
}

pub(super) fn pending_members(members: &[Target], p: &[Progress]) -> Vec<Target> {
    members
        .iter()
        .zip(p)
        .filter(|(_, p)| matches!(p, Progress::Pending))
        .map(|(t, _)| t.clone())
        .collect()
}
