//! The CUDA driver's checkpoint API as the controller sees it: the operations, the state
//! a process is in, and how a call ended.

use super::process::ProcKey;
use std::time::Duration;

/// What the driver says a process is in (`CUprocessState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessState {
    /// `CU_PROCESS_STATE_RUNNING`: the process can make CUDA calls.
    Running,
    /// `CU_PROCESS_STATE_LOCKED`: its CUDA calls block.
    Locked,
    /// `CU_PROCESS_STATE_CHECKPOINTED`: its device memory is on the host, its GPU
    /// resources released.
    Checkpointed,
    /// `CU_PROCESS_STATE_FAILED`: an uncorrectable error during checkpoint or restore.
    Failed,
    /// A value this build does not know (a newer driver's).
    Other(u32),
}

/// One of the driver's checkpoint operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `cuCheckpointProcessGetState`.
    State,
    /// `cuCheckpointProcessLock`.
    Lock,
    /// `cuCheckpointProcessCheckpoint`.
    Checkpoint,
    /// `cuCheckpointProcessRestore`.
    Restore,
    /// `cuCheckpointProcessUnlock`.
    Unlock,
    /// `cuCheckpointProcessGetRestoreThreadId`.
    RestoreThread,
}

/// A checkpoint call the driver refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CuError {
    /// The call.
    pub op: Op,
    /// The driver's `CUresult`.
    pub code: i32,
    /// Its name (`CUDA_ERROR_…`), from the driver where it names it.
    pub name: String,
}

/// How a call ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallEnd {
    /// The driver answered (its answer).
    Answered(Result<(), CuError>),
    /// The process was not the one asked for any more (exited, or its PID reused), so
    /// the driver was not called.
    Gone,
}

/// A call that has ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Done {
    /// Which call (the id its start was given).
    pub id: u64,
    /// The process.
    pub key: ProcKey,
    /// The operation.
    pub op: Op,
    /// How it ended.
    pub end: CallEnd,
    /// What the driver said the process is in (an [`Op::State`] call that succeeded).
    pub state: Option<ProcessState>,
    /// How long it took, from the start of the call.
    pub elapsed: Duration,
}
