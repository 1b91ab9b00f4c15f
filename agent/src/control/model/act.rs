//! What a suspension is done with and what came of it: the actuator kinds, suspend or
//! resume, a target's progress and why it failed, and the fail-open record's entries.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Duration;

/// Which actuator the agent prefers for offline processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// cgroup freezer (v2 `cgroup.freeze` or v1 freezer) on cgroups declared offline;
    /// processes matched only by exe/cmdline/uid fall back to `signal` (and, if they keep
    /// resuming themselves, to a freezer cgroup of the agent's own).
    Freezer,
    /// SIGSTOP/SIGCONT through pidfds (every process of a cgroup declared offline).
    Signal,
    /// The launch gate (`--gate`): not chosen here; a label for holds that close one.
    #[value(skip)]
    Gate,
    /// The CUDA driver's lock (`--driver-lock`): not chosen here; a label for holds the
    /// driver keeps.
    #[value(skip)]
    Lock,
}

/// A suspended object as written to the fail-open record.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RecordEntry {
    /// A frozen cgroup.
    Cgroup {
        /// Directory.
        dir: PathBuf,
        /// Hierarchy.
        version: CgroupVersion,
        /// A cell of the agent's own: whom it holds and where they go back to.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cell: Option<Cell>,
    },
    /// A stopped process (PID plus start time, so a reused PID is recognised).
    Process {
        /// PID.
        pid: u32,
        /// Start time, clock ticks since boot.
        start: u64,
    },
    /// A closed launch gate (one GPU's slot of a gate file).
    Gate {
        /// The gate file.
        file: PathBuf,
        /// The GPU's UUID, as NVML writes it.
        uuid: String,
    },
    /// A process the CUDA driver may hold locked or checkpointed (PID plus start time).
    /// Resumed after every other entry: restore (the process must run: thaw first), then
    /// unlock.
    Lock {
        /// PID.
        pid: u32,
        /// Start time, clock ticks since boot.
        start: u64,
    },
    /// A process the agent may have locked and checkpointed to give its GPU memory to
    /// online work: resumed like [`RecordEntry::Lock`].
    Checkpoint {
        /// PID.
        pid: u32,
        /// Start time, clock ticks since boot.
        start: u64,
    },
}

/// Why an actuation failed (short, bounded names via [`ActError::reason`]).
#[derive(Debug, thiserror::Error)]
pub enum ActError {
    /// Writing the cgroup control file failed.
    #[error("cannot write {file}: {source}")]
    Write {
        /// The file.
        file: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Sending the signal failed.
    #[error("cannot signal pid {pid}: {source}")]
    Signal {
        /// PID.
        pid: u32,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The target needs the launch gate, which this actuator does not have.
    #[error("{0}: no launch gate here")]
    NoGate(String),
    /// The CUDA driver refused a call (or has no checkpoint API).
    #[error("{0}")]
    Driver(String),
    /// The new state was not confirmed in time.
    #[error("{what} not confirmed within {timeout:?}")]
    Timeout {
        /// What was waited for.
        what: String,
        /// How long.
        timeout: Duration,
    },
}

/// Where one target of a batch stands.
#[derive(Debug)]
pub enum Progress {
    /// Confirmed in the requested state.
    Done,
    /// Not confirmed yet: check again later.
    Pending,
    /// The process or cgroup is gone: nothing to suspend or resume.
    Gone,
    /// Nothing was done on purpose (dry run).
    Skipped,
    /// Failed.
    Failed(ActError),
}

/// Suspend or resume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Stop / freeze.
    Suspend,
    /// Continue / thaw.
    Resume,
}

/// cgroup hierarchy version of a freezer target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CgroupVersion {
    /// Unified hierarchy (`cgroup.freeze`).
    V2,
    /// v1 freezer controller (`freezer.state`).
    V1,
}

/// A cell's process and its home.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Cell {
    /// PID of the process moved in.
    pub pid: u32,
    /// Its start time, clock ticks since boot (a reused PID is never moved).
    pub start: u64,
    /// The cgroup directory it came from, where it goes back.
    pub home: PathBuf,
}
