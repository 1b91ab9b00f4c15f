//! What a hold reports of itself: how an operation ended ([`Outcome`], [`Failure`]), why
//! a gate hold went to its fallback ([`Escalation`]), and a hold found running while held
//! ([`Broken`]). The hold book ([`crate::control::holds`]) decides them; the notes carry
//! them to the shell, which renders them.

use crate::control::model::act::{ActError, Kind};
use crate::control::model::ProcKey;

/// Why an operation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The record could not be written: nothing was suspended.
    Record,
    /// Not confirmed within `--confirm-timeout`.
    Timeout,
    /// A cgroup control file could not be written.
    CgroupWrite,
    /// A signal could not be sent.
    Signal,
    /// The launch gate could not close (no slot for the GPU, or not this agent's file).
    NoGate,
    /// The CUDA driver refused its lock (the process falls back to its other hold).
    Driver,
}

impl Failure {
    /// Metric and log label.
    pub fn as_str(self) -> &'static str {
        match self {
            Failure::Record => "record",
            Failure::Timeout => "timeout",
            Failure::CgroupWrite => "cgroup_write",
            Failure::Signal => "signal",
            Failure::NoGate => "no_gate",
            Failure::Driver => "driver",
        }
    }

    /// The failure an actuator's error means.
    pub fn of(e: &ActError) -> Failure {
        match e {
            ActError::Write { .. } => Failure::CgroupWrite,
            ActError::Signal { .. } => Failure::Signal,
            ActError::Timeout { .. } => Failure::Timeout,
            ActError::NoGate(_) => Failure::NoGate,
            ActError::Driver(_) => Failure::Driver,
        }
    }
}

/// Why a gate hold goes to its fallback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Escalation {
    /// The process acknowledged the close: its work in flight drained.
    Drained,
    /// No acknowledgement within `--gate-timeout`.
    Timeout,
    /// The gate could not close.
    CannotClose,
}

impl Escalation {
    /// Log label.
    pub fn as_str(self) -> &'static str {
        match self {
            Escalation::Drained => "drained",
            Escalation::Timeout => "no acknowledgement within --gate-timeout (no shim listening, or work still in flight)",
            Escalation::CannotClose => "the gate cannot close",
        }
    }
}

/// How a hold's operation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Confirmed.
    Done,
    /// The targets are gone.
    Gone,
    /// Not acted on (dry run), or abandoned (a resume overtook a pending suspension).
    Skipped,
    /// Failed.
    Failed(Failure),
}

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
