//! What the hold book says and hears: its commands ([`HoldCmd`]), what comes of them
//! ([`HoldObs`]), and how an operation ends ([`Outcome`], [`Failure`], [`Escalation`],
//! [`Completion`]).

use crate::control::model::act::{Kind, Op, Progress, RecordEntry};
use crate::control::target::HoldKey;
use crate::control::target::Target;
use std::path::PathBuf;
use std::time::Duration;

pub use crate::control::model::hold::{Escalation, Failure, Outcome};

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

/// Names a command whose answer the book waits for.
pub type Req = u64;

/// What the book asks the shell to do, in this order.
#[derive(Debug, Clone)]
pub enum HoldCmd {
    /// List the processes of signalled cgroup `dir` now, `leader` first, each pinned by a
    /// pidfd, the agent excluded. Answered by [`HoldObs::Members`].
    Members {
        /// The request.
        req: Req,
        /// The cgroup directory.
        dir: PathBuf,
        /// The GPU process itself.
        leader: Target,
    },
    /// Add entries to the fail-open record (on disk before the answer). Answered by
    /// [`HoldObs::Recorded`].
    RecordAdd {
        /// The request.
        req: Req,
        /// What to add.
        entries: Vec<RecordEntry>,
    },
    /// Remove entries from the record (no answer: a failure is logged, and the entries
    /// are resumed again at the next start).
    RecordRemove {
        /// What to remove.
        entries: Vec<RecordEntry>,
    },
    /// Start `op` on targets, waiting up to `budget`. Answered by [`HoldObs::Progress`].
    Start {
        /// The request.
        req: Req,
        /// Suspend or resume.
        op: Op,
        /// The targets.
        targets: Vec<Target>,
        /// How long to wait for confirmations: zero inside a tick (the actuator issues the
        /// operation and looks once; what is not confirmed yet is checked again by the
        /// loop, which sleeps between checks in its doorbell wait, so a launch on another
        /// GPU is seen meanwhile), the confirmation timeout when everything is released.
        budget: Duration,
    },
    /// Close a GPU's launch gate for a process (a [`Target::Gate`]). Answered by
    /// [`HoldObs::GateClosed`].
    CloseGate {
        /// The request.
        req: Req,
        /// The gate.
        gate: Target,
    },
    /// Find a cell of the agent's own for process `key`, held alone and resuming itself
    /// (the actuator's cells): nothing is made yet. Answered by [`HoldObs::Cell`].
    Isolate {
        /// The request.
        req: Req,
        /// The process.
        key: crate::control::model::ProcKey,
    },
    /// Look once whether targets are in the state of `op`. Answered by
    /// [`HoldObs::Progress`].
    Check {
        /// The request.
        req: Req,
        /// The state looked for.
        op: Op,
        /// The targets.
        targets: Vec<Target>,
    },
}

/// What came of a command.
#[derive(Debug)]
pub enum HoldObs {
    /// A cgroup's processes (the leader first).
    Members {
        /// The request.
        req: Req,
        /// The processes.
        members: Vec<Target>,
        /// The cgroup's directory is gone (removed once its last process exited).
        gone: bool,
    },
    /// Whether the record holds the entries now.
    Recorded {
        /// The request.
        req: Req,
        /// It does.
        ok: bool,
    },
    /// The gate closed at this epoch (`None`: it could not close).
    GateClosed {
        /// The request.
        req: Req,
        /// The close's epoch, which the process's acknowledgement must equal.
        epoch: Option<u32>,
    },
    /// The cell for a process (a frozen-cgroup target that moves it in), or why there is
    /// none on this host.
    Cell {
        /// The request.
        req: Req,
        /// The cell, or why not.
        cell: Result<Target, String>,
    },
    /// Where each target stands, in the command's order.
    Progress {
        /// The request.
        req: Req,
        /// Per target.
        progress: Vec<Progress>,
        /// When the shell looked, ns.
        at_ns: u64,
    },
}
