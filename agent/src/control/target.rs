//! What a suspension holds: its [`Target`] (a whole cgroup, one process, a launch gate,
//! the driver's lock), the [`Plan`] of an offline process (freeze, signal it alone or
//! with its cgroup, gate it, lock it), and the [`HoldKey`] two processes of one frozen
//! cgroup share. The plan is chosen when the process is classified (the shell's
//! `choose`), and by the vault at suspension (the driver's lock).
//!
//! A [`Target`] here names what is suspended and holds no file descriptor: a process is
//! named by its key, and the shell keeps the pidfd that pins it (opened when it was
//! classified, looked up by that key when a command names it).

use crate::control::model::act::{Cell, CgroupVersion, Kind, RecordEntry};
use crate::control::model::ProcKey;
use std::path::PathBuf;

/// Something the agent suspends: a whole cgroup, one process, one process's launch gate
/// for a GPU, or one process's CUDA calls (the driver's lock).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// A cgroup directory (absolute path on this host).
    Cgroup {
        /// The directory.
        dir: PathBuf,
        /// Its hierarchy.
        version: CgroupVersion,
        /// Set for a cell of the agent's own: the process is moved in before the freeze,
        /// and moved back home after the thaw.
        cell: Option<Cell>,
    },
    /// One process, signalled through the pidfd the shell pins it with (its key is the
    /// pin's name).
    Process {
        /// Identity.
        key: ProcKey,
    },
    /// One process's submissions to one GPU, through the launch gate. A closed gate
    /// bounds what the process has in flight; it holds nothing by itself (the hold's
    /// fallback does).
    Gate {
        /// The process whose acknowledgement confirms the close.
        key: ProcKey,
        /// The GPU's UUID bytes (the gate file's slot).
        uuid: [u8; 16],
        /// The gate file.
        file: PathBuf,
    },
    /// One process's CUDA calls, blocked by the driver's lock (`cuCheckpointProcessLock`):
    /// held by the controller's vault, not by an actuator ([`crate::control::vault`]).
    Lock {
        /// Identity (checked right before each driver call: the driver takes a bare PID).
        key: ProcKey,
    },
}

impl Target {
    /// The durable description of this target, for the fail-open record.
    pub fn record(&self) -> RecordEntry {
        match self {
            Target::Cgroup { dir, version, cell } => RecordEntry::Cgroup {
                dir: dir.clone(),
                version: *version,
                cell: cell.clone(),
            },
            Target::Process { key } => RecordEntry::Process {
                pid: key.pid,
                start: key.start,
            },
            Target::Gate { uuid, file, .. } => RecordEntry::Gate {
                file: file.clone(),
                uuid: coloc_doorbell::format_uuid(uuid),
            },
            Target::Lock { key } => RecordEntry::Lock {
                pid: key.pid,
                start: key.start,
            },
        }
    }

    /// The actuator kind this target uses.
    pub fn kind(&self) -> Kind {
        match self {
            Target::Cgroup { .. } => Kind::Freezer,
            Target::Process { .. } => Kind::Signal,
            Target::Gate { .. } => Kind::Gate,
            Target::Lock { .. } => Kind::Lock,
        }
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Cgroup {
                dir,
                version,
                cell: None,
            } => write!(f, "cgroup {} ({version:?})", dir.display()),
            Target::Cgroup {
                dir, cell: Some(c), ..
            } => write!(f, "cell {} of pid {}", dir.display(), c.pid),
            Target::Process { key } => write!(f, "pid {}", key.pid),
            Target::Gate { key, uuid, .. } => write!(
                f,
                "gate of {} for pid {}",
                coloc_doorbell::format_uuid(uuid),
                key.pid
            ),
            Target::Lock { key } => write!(f, "driver lock of pid {}", key.pid),
        }
    }
}

/// How one offline process is suspended.
#[derive(Debug, Clone)]
pub enum Plan {
    /// Freeze its cgroup (a [`Target::Cgroup`]).
    Freeze(Target),
    /// Stop the process alone (a [`Target::Process`]).
    Signal(Target),
    /// Stop every process of its cgroup, listed when the suspension starts.
    SignalCgroup {
        /// The cgroup directory (its `cgroup.procs` is read at suspension).
        dir: PathBuf,
        /// Its hierarchy (the freezer it escalates to if its processes resume themselves).
        version: crate::control::model::act::CgroupVersion,
        /// The GPU process itself.
        leader: Target,
    },
    /// Close the GPU's launch gate for the process (a [`Target::Gate`]), then hold it
    /// with `fallback` once the gate has drained (acknowledged) or `--gate-timeout` passed.
    Gate {
        /// The gate target.
        gate: Target,
        /// What suspends the process without the gate.
        fallback: Box<Plan>,
    },
    /// Hold the process with the CUDA driver's lock (a [`Target::Lock`]): its CUDA calls
    /// block, its CPU threads run on. Chosen at suspension by the vault
    /// ([`crate::control::vault::Vault::plan`]) in place of the table's plan, which stays
    /// the fallback where the driver refuses.
    Lock(Target),
}

/// What a suspension is held on: two offline processes in one frozen cgroup share one.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum HoldKey {
    /// A frozen cgroup.
    Cgroup(PathBuf),
    /// A stopped process.
    Process(ProcKey),
    /// Every process of a cgroup, stopped with signals.
    Group(PathBuf),
    /// A process held at a launch gate.
    Gate(ProcKey),
    /// A process held by the driver's lock.
    Lock(ProcKey),
}

impl Plan {
    /// The hold this plan suspends.
    pub fn hold_key(&self) -> HoldKey {
        match self {
            Plan::Freeze(Target::Cgroup { dir, .. }) => HoldKey::Cgroup(dir.clone()),
            Plan::Freeze(Target::Process { key, .. })
            | Plan::Signal(Target::Process { key, .. }) => HoldKey::Process(*key),
            Plan::Signal(Target::Cgroup { dir, .. }) => HoldKey::Cgroup(dir.clone()),
            Plan::SignalCgroup { dir, .. } => HoldKey::Group(dir.clone()),
            Plan::Freeze(Target::Gate { key, .. })
            | Plan::Signal(Target::Gate { key, .. })
            | Plan::Gate {
                gate: Target::Gate { key, .. },
                ..
            } => HoldKey::Gate(*key),
            Plan::Gate { fallback, .. } => fallback.hold_key(),
            Plan::Lock(Target::Lock { key })
            | Plan::Freeze(Target::Lock { key })
            | Plan::Signal(Target::Lock { key }) => HoldKey::Lock(*key),
            Plan::Lock(t) => Plan::Freeze(t.clone()).hold_key(),
        }
    }

    /// The actuator this plan uses.
    pub fn kind(&self) -> Kind {
        match self {
            Plan::Freeze(t) | Plan::Signal(t) => t.kind(),
            Plan::SignalCgroup { .. } => Kind::Signal,
            Plan::Gate { .. } => Kind::Gate,
            Plan::Lock(_) => Kind::Lock,
        }
    }

    /// The cgroup directory this plan freezes or signals as a whole, if any (a process
    /// inside it is stopped when the hold is).
    pub fn cgroup(&self) -> Option<&std::path::Path> {
        match self {
            Plan::Freeze(Target::Cgroup { dir, .. }) | Plan::SignalCgroup { dir, .. } => Some(dir),
            Plan::Gate { fallback, .. } => fallback.cgroup(),
            _ => None,
        }
    }
}
