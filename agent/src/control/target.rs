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

/// How one offline process is suspended. Each variant names only what it can hold: a
/// cgroup is frozen, a process is stopped or locked by its key, a gate is one process's
/// slot for one GPU. (A gate's fallback is a plan too; [`Plan::gated`] never puts a gate
/// behind a gate.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// Freeze a cgroup (declared offline as a whole, or a cell of the agent's own).
    Freeze(Frozen),
    /// Stop the process alone, through its pin.
    Signal(ProcKey),
    /// Stop every process of its cgroup, listed when the suspension starts.
    SignalCgroup {
        /// The cgroup directory (its `cgroup.procs` is read at suspension).
        dir: PathBuf,
        /// Its hierarchy (the freezer it escalates to if its processes resume themselves).
        version: CgroupVersion,
        /// The GPU process itself.
        leader: ProcKey,
    },
    /// Close the GPU's launch gate for the process, then hold it with `fallback` once the
    /// gate has drained (acknowledged) or `--gate-timeout` passed.
    Gate {
        /// The gate.
        gate: GateSlot,
        /// What suspends the process without the gate.
        fallback: Box<Plan>,
    },
    /// Hold the process with the CUDA driver's lock: its CUDA calls block, its CPU threads
    /// run on. Chosen at suspension by the vault ([`crate::control::vault::Vault::plan`])
    /// in place of the table's plan, which stays the fallback where the driver refuses.
    Lock(ProcKey),
}

/// A cgroup to freeze.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frozen {
    /// The directory (absolute path on this host).
    pub dir: PathBuf,
    /// Its hierarchy.
    pub version: CgroupVersion,
    /// Set for a cell of the agent's own: its process is moved in before the freeze, and
    /// moved back home after the thaw.
    pub cell: Option<Cell>,
}

impl Frozen {
    /// The cgroup a [`Target::Cgroup`] names (`None` for any other target).
    pub fn of(t: &Target) -> Option<Frozen> {
        match t {
            Target::Cgroup { dir, version, cell } => Some(Frozen {
                dir: dir.clone(),
                version: *version,
                cell: cell.clone(),
            }),
            _ => None,
        }
    }
}

/// One process's launch gate for one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GateSlot {
    /// The process whose acknowledgement confirms the close.
    pub key: ProcKey,
    /// The GPU's UUID bytes (the gate file's slot).
    pub uuid: [u8; 16],
    /// The gate file.
    pub file: PathBuf,
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
    /// `plan` behind the launch gate `gate` (a plan behind a gate already keeps its
    /// fallback: never a gate behind a gate).
    pub fn gated(gate: GateSlot, plan: Plan) -> Plan {
        let fallback = match plan {
            Plan::Gate { fallback, .. } => fallback,
            p => Box::new(p),
        };
        Plan::Gate { gate, fallback }
    }

    /// The hold this plan suspends.
    pub fn hold_key(&self) -> HoldKey {
        match self {
            Plan::Freeze(f) => HoldKey::Cgroup(f.dir.clone()),
            Plan::Signal(key) => HoldKey::Process(*key),
            Plan::SignalCgroup { dir, .. } => HoldKey::Group(dir.clone()),
            Plan::Gate { gate, .. } => HoldKey::Gate(gate.key),
            Plan::Lock(key) => HoldKey::Lock(*key),
        }
    }

    /// The one target this plan acts on first: the cgroup, the process (the leader of a
    /// signalled cgroup), the gate, the lock.
    pub fn target(&self) -> Target {
        match self {
            Plan::Freeze(f) => Target::Cgroup {
                dir: f.dir.clone(),
                version: f.version,
                cell: f.cell.clone(),
            },
            Plan::Signal(key) | Plan::SignalCgroup { leader: key, .. } => {
                Target::Process { key: *key }
            }
            Plan::Gate { gate, .. } => Target::Gate {
                key: gate.key,
                uuid: gate.uuid,
                file: gate.file.clone(),
            },
            Plan::Lock(key) => Target::Lock { key: *key },
        }
    }

    /// The actuator this plan uses.
    pub fn kind(&self) -> Kind {
        match self {
            Plan::Freeze(_) => Kind::Freezer,
            Plan::Signal(_) | Plan::SignalCgroup { .. } => Kind::Signal,
            Plan::Gate { .. } => Kind::Gate,
            Plan::Lock(_) => Kind::Lock,
        }
    }

    /// The cgroup directory this plan freezes or signals as a whole, if any (a process
    /// inside it is stopped when the hold is).
    pub fn cgroup(&self) -> Option<&std::path::Path> {
        match self {
            Plan::Freeze(Frozen { dir, .. }) | Plan::SignalCgroup { dir, .. } => Some(dir),
            Plan::Gate { fallback, .. } => fallback.cgroup(),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plan names only what it can hold, and a gate is never put behind a gate: a plan
    /// gated again keeps the first gate's fallback, behind the new gate.
    #[test]
    fn a_gated_plan_is_never_a_gate_behind_a_gate() {
        let key = ProcKey { pid: 10, start: 7 };
        let slot = |b: u8| GateSlot {
            key,
            uuid: [b; 16],
            file: "/tmp/coloc-gates".into(),
        };
        let once = Plan::gated(slot(1), Plan::Signal(key));
        let twice = Plan::gated(slot(2), once.clone());
        assert_eq!(
            twice,
            Plan::Gate {
                gate: slot(2),
                fallback: Box::new(Plan::Signal(key)),
            }
        );
        assert_eq!(twice.hold_key(), HoldKey::Gate(key));
        assert_eq!(twice.kind(), Kind::Gate);
        assert_eq!(
            Plan::Lock(key).target(),
            Target::Lock { key },
            "a lock's target is the lock"
        );
        assert_eq!(Plan::Signal(key).target(), Target::Process { key });
    }
}
