//! What a suspension holds: its [`Target`] (a whole cgroup, one process, a launch gate,
//! the driver's lock), the [`Plan`] of an offline process (a [`Stop`] or the driver's
//! lock, [`Held`] at once or behind its launch gate), and the [`HoldKey`] two processes of
//! one frozen cgroup share. The plan is chosen in one place, [`crate::control::plan`].
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
    /// held by the controller's driver book, not by an actuator ([`crate::control::driver_book`]).
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

/// A stop: the freezer, or SIGSTOP through the pins (the hold book stops again what a
/// tenant resumes, and freezes a signalled cgroup that keeps resuming itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stop {
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
}

/// What holds an offline process: a stop, or the CUDA driver's lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Held {
    /// A stop (freezer or signals).
    Stop(Stop),
    /// The CUDA driver's lock (`cuCheckpointProcessLock`): its CUDA calls block, its CPU
    /// threads run on. Held by the driver book ([`crate::control::driver_book`]); where the driver
    /// refuses, the process is stopped instead from its next suspension on.
    Lock(ProcKey),
}

/// How one offline process is suspended, chosen in one place
/// ([`crate::control::plan::choose`]): what holds it, behind its launch gate where one
/// applies. Nothing can stand behind a stop or a lock, and a gate never stands behind a
/// gate: the type cannot say either.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// Held at once.
    Now(Held),
    /// Close the GPU's launch gate for the process, then hold it with `fallback` once the
    /// gate has drained (acknowledged) or `--gate-timeout` passed.
    Gate {
        /// The gate.
        gate: GateSlot,
        /// What holds the process once its gate has drained.
        fallback: Held,
    },
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

impl Stop {
    /// The hold this stop suspends.
    pub fn hold_key(&self) -> HoldKey {
        match self {
            Stop::Freeze(f) => HoldKey::Cgroup(f.dir.clone()),
            Stop::Signal(key) => HoldKey::Process(*key),
            Stop::SignalCgroup { dir, .. } => HoldKey::Group(dir.clone()),
        }
    }

    /// The one target this stop acts on first: the cgroup, or the process (the leader of
    /// a signalled cgroup).
    pub fn target(&self) -> Target {
        match self {
            Stop::Freeze(f) => Target::Cgroup {
                dir: f.dir.clone(),
                version: f.version,
                cell: f.cell.clone(),
            },
            Stop::Signal(key) | Stop::SignalCgroup { leader: key, .. } => {
                Target::Process { key: *key }
            }
        }
    }

    /// The actuator this stop uses.
    pub fn kind(&self) -> Kind {
        match self {
            Stop::Freeze(_) => Kind::Freezer,
            Stop::Signal(_) | Stop::SignalCgroup { .. } => Kind::Signal,
        }
    }

    /// The cgroup directory this stop freezes or signals as a whole, if any.
    pub fn cgroup(&self) -> Option<&std::path::Path> {
        match self {
            Stop::Freeze(Frozen { dir, .. }) | Stop::SignalCgroup { dir, .. } => Some(dir),
            Stop::Signal(_) => None,
        }
    }
}

impl Held {
    /// The hold this suspends.
    pub fn hold_key(&self) -> HoldKey {
        match self {
            Held::Stop(s) => s.hold_key(),
            Held::Lock(key) => HoldKey::Lock(*key),
        }
    }

    /// The one target this acts on first.
    pub fn target(&self) -> Target {
        match self {
            Held::Stop(s) => s.target(),
            Held::Lock(key) => Target::Lock { key: *key },
        }
    }

    /// The actuator this uses.
    pub fn kind(&self) -> Kind {
        match self {
            Held::Stop(s) => s.kind(),
            Held::Lock(_) => Kind::Lock,
        }
    }

    /// The cgroup directory this freezes or signals as a whole, if any.
    pub fn cgroup(&self) -> Option<&std::path::Path> {
        match self {
            Held::Stop(s) => s.cgroup(),
            Held::Lock(_) => None,
        }
    }
}

impl Plan {
    /// Stop the process alone, at once.
    pub fn signal(key: ProcKey) -> Plan {
        Plan::Now(Held::Stop(Stop::Signal(key)))
    }

    /// The hold this plan suspends.
    pub fn hold_key(&self) -> HoldKey {
        match self {
            Plan::Now(h) => h.hold_key(),
            Plan::Gate { gate, .. } => HoldKey::Gate(gate.key),
        }
    }

    /// The one target this plan acts on first: the cgroup, the process (the leader of a
    /// signalled cgroup), the gate, the lock.
    pub fn target(&self) -> Target {
        match self {
            Plan::Now(h) => h.target(),
            Plan::Gate { gate, .. } => Target::Gate {
                key: gate.key,
                uuid: gate.uuid,
                file: gate.file.clone(),
            },
        }
    }

    /// The actuator this plan uses.
    pub fn kind(&self) -> Kind {
        match self {
            Plan::Now(h) => h.kind(),
            Plan::Gate { .. } => Kind::Gate,
        }
    }

    /// What holds the process: at once, or once its gate has drained.
    pub fn held(&self) -> &Held {
        match self {
            Plan::Now(h) | Plan::Gate { fallback: h, .. } => h,
        }
    }

    /// The cgroup directory this plan freezes or signals as a whole, if any (a process
    /// inside it is stopped when the hold is).
    pub fn cgroup(&self) -> Option<&std::path::Path> {
        self.held().cgroup()
    }

    /// The cgroup this plan stops with signals at once (its members are listed first), and
    /// its hierarchy (the freezer it escalates to).
    pub fn signalled_cgroup(&self) -> Option<(&std::path::Path, CgroupVersion)> {
        match self {
            Plan::Now(Held::Stop(Stop::SignalCgroup { dir, version, .. })) => Some((dir, *version)),
            Plan::Now(_) | Plan::Gate { .. } => None,
        }
    }

    /// What holds a gated process once its gate has drained, as a plan of its own.
    pub fn fallback(&self) -> Option<Plan> {
        match self {
            Plan::Gate { fallback, .. } => Some(Plan::Now(fallback.clone())),
            Plan::Now(_) => None,
        }
    }

    /// Whether what holds the process stops it alone.
    pub fn stops_alone(&self) -> bool {
        matches!(self.held(), Held::Stop(Stop::Signal(_)))
    }

    /// This plan with what holds the process replaced by `f` of it (the gate kept).
    pub fn map_held(self, f: impl FnOnce(Held) -> Held) -> Plan {
        match self {
            Plan::Now(h) => Plan::Now(f(h)),
            Plan::Gate { gate, fallback } => Plan::Gate {
                gate,
                fallback: f(fallback),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plan names only what it can hold: a gated plan acts on its gate first and holds
    /// with its fallback, a lock's target is the lock.
    #[test]
    fn a_plan_acts_on_its_gate_first_and_holds_with_its_fallback() {
        let key = ProcKey { pid: 10, start: 7 };
        let gate = GateSlot {
            key,
            uuid: [1; 16],
            file: "/tmp/coloc-gates".into(),
        };
        let gated = Plan::Gate {
            gate: gate.clone(),
            fallback: Held::Stop(Stop::Signal(key)),
        };
        assert_eq!(gated.hold_key(), HoldKey::Gate(key));
        assert_eq!(gated.kind(), Kind::Gate);
        assert_eq!(gated.fallback(), Some(Plan::signal(key)));
        assert!(gated.stops_alone());
        assert_eq!(
            Plan::Now(Held::Lock(key)).target(),
            Target::Lock { key },
            "a lock's target is the lock"
        );
        assert_eq!(Plan::signal(key).target(), Target::Process { key });
        assert_eq!(Plan::signal(key).fallback(), None);
    }
}
