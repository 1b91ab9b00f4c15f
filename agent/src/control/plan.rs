//! The plan of a suspension, chosen here and nowhere else ([`choose`]). The others supply
//! facts: the shell what it observed of the process's cgroup and the host
//! ([`CgroupFacts`], kept in the process's table entry), the driver book whether the driver's
//! lock applies, the gate book the GPU's gate slot, the hold book what it had to freeze
//! lately ([`Remembered`]).
//!
//! The rules, in order:
//! - A process the driver's lock applies to is held by the lock (its CUDA calls block);
//!   else it is stopped:
//!   - a cgroup the pod source declared offline as a whole (a pod's container, a rule's
//!     `cgroup` matcher) is frozen with the freezer when `--actuator freezer`, or else
//!     every process in it is stopped with signals — its CPU-only children too;
//!   - a process known to be offline only by itself (exe, cmdline, uid rules) is stopped
//!     alone, with a signal through its pidfd;
//!   - so is one whose cgroup contains the agent itself, has no freezer directory under
//!     the cgroup root, or (rules mode) also holds a process that is not offline, or whose
//!     members cannot be read: a cgroup holding online work is never stopped whole.
//! - A stop by signal that the hold book remembers its tenant undoing lately is a freeze
//!   at once: the signalled cgroup's freezer, or the process's cell of the agent's own.
//! - Where the GPU's launch gate applies (online work busy there, the process's shim
//!   answering on that GPU alone), the gate closes first, and what holds the process
//!   follows once it has drained.

use crate::control::model::act::{CgroupVersion, Kind};
use crate::control::model::ProcKey;
use crate::control::target::{Frozen, GateSlot, Held, Plan, Stop};
use qos_core::Class;
use std::path::{Path, PathBuf};

/// What the shell observed of an offline process's cgroup (when it classified the
/// process; in rules mode its members again at each read of the lists).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CgroupFacts {
    /// The cgroup the pod source declares offline as a whole, as the source names it;
    /// `None`: only the process itself is known to be offline.
    pub declared: Option<String>,
    /// That cgroup's directory in a freezer hierarchy under the host's cgroup root, and
    /// the hierarchy; `None`: there is none.
    pub dir: Option<(PathBuf, CgroupVersion)>,
    /// The agent itself lives in that cgroup or beneath it.
    pub holds_agent: bool,
    /// What its members are.
    pub members: Members,
}

/// What the members of a cgroup declared offline are.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Members {
    /// Offline, every one: the pod source vouches for the cgroup (a pod's container), or
    /// each member was seen offline (rules mode).
    #[default]
    Offline,
    /// This process in it (or beneath it) is not offline (the agent itself counts as
    /// `System`).
    Mixed {
        /// Its PID.
        pid: u32,
        /// Its class.
        class: Class,
    },
    /// Its membership (or a cgroup's beneath it) could not be read: not known to be all
    /// offline.
    Unreadable,
}

/// Why an offline process is stopped alone when its cgroup could have been held whole
/// (the shell warns once).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Alone {
    /// Its rule does not declare a whole cgroup offline.
    NotDeclared,
    /// The declared cgroup contains the agent itself.
    HoldsAgent(String),
    /// No freezer directory for the declared cgroup under the cgroup root.
    NoFreezer(String),
    /// The cgroup also holds a process that is not offline.
    Mixed {
        /// The cgroup's directory.
        dir: PathBuf,
        /// That process.
        pid: u32,
        /// Its class.
        class: Class,
    },
    /// The cgroup's membership cannot be read.
    Unreadable(PathBuf),
}

impl Alone {
    /// Whether it is worth a warning with `preferred` the actuator asked for: always where
    /// a cgroup was declared, else only when the freezer was asked for.
    pub fn warns(&self, preferred: Kind) -> bool {
        match self {
            Alone::NotDeclared | Alone::NoFreezer(_) => preferred == Kind::Freezer,
            Alone::HoldsAgent(_) | Alone::Mixed { .. } | Alone::Unreadable(_) => true,
        }
    }
}

impl Members {
    /// Why cgroup `dir` with these members is not held whole, if it is not.
    pub fn alone(self, dir: &Path) -> Option<Alone> {
        match self {
            Members::Offline => None,
            Members::Mixed { pid, class } => Some(Alone::Mixed {
                dir: dir.to_path_buf(),
                pid,
                class,
            }),
            Members::Unreadable => Some(Alone::Unreadable(dir.to_path_buf())),
        }
    }
}

impl std::fmt::Display for Alone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Alone::NotDeclared => write!(f, "its rule does not declare a whole cgroup offline"),
            Alone::HoldsAgent(p) => write!(f, "cgroup {p} contains the agent itself"),
            Alone::NoFreezer(p) => write!(f, "no freezer for cgroup {p} under the cgroup root"),
            Alone::Mixed { dir, pid, class } => write!(
                f,
                "cgroup {} also holds process {pid}, {class}",
                dir.display()
            ),
            Alone::Unreadable(dir) => {
                write!(f, "the members of cgroup {} cannot be read", dir.display())
            }
        }
    }
}

impl CgroupFacts {
    /// The cgroup directory that may be held whole, with its hierarchy; else why not.
    pub fn whole(&self) -> Result<(&Path, CgroupVersion), Alone> {
        let Some(declared) = &self.declared else {
            return Err(Alone::NotDeclared);
        };
        if self.holds_agent {
            return Err(Alone::HoldsAgent(declared.clone()));
        }
        let Some((dir, version)) = &self.dir else {
            return Err(Alone::NoFreezer(declared.clone()));
        };
        match self.members.alone(dir) {
            None => Ok((dir, *version)),
            Some(why) => Err(why),
        }
    }

    /// The directory of the cgroup that may be held whole if its members allow it: the one
    /// whose members the shell reads (rules mode).
    pub fn may_be_whole(&self) -> Option<&Path> {
        match (&self.declared, &self.dir, self.holds_agent) {
            (Some(_), Some((dir, _)), false) => Some(dir),
            _ => None,
        }
    }

    /// The cgroup directory that may be held whole, if any (a hold on it stops the
    /// process, whatever actuator holds it).
    pub fn whole_dir(&self) -> Option<&Path> {
        self.whole().ok().map(|(d, _)| d)
    }
}

/// What the hold book remembers of how an offline process had to be held lately
/// ([`crate::control::holds::HoldBook::remembered`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Remembered {
    /// Its signalled cgroup had to be frozen: its processes resumed themselves.
    pub cgroup_frozen: bool,
    /// It had to be moved into this cell of the agent's own (held alone, it resumed
    /// itself).
    pub cell: Option<Frozen>,
}

/// Everything a suspension's plan depends on.
#[derive(Debug, Clone)]
pub struct Facts<'a> {
    /// The offline process.
    pub key: ProcKey,
    /// `--actuator`.
    pub preferred: Kind,
    /// What the shell observed of its cgroup.
    pub cgroup: &'a CgroupFacts,
    /// The driver's lock applies (the driver book's word).
    pub lock: bool,
    /// The GPU's launch gate slot, where the gate applies (the gate book's word).
    pub gate: Option<GateSlot>,
    /// How it had to be held lately (the hold book's word).
    pub remembered: Remembered,
}

/// The stop of an offline process (see the module's rules).
pub fn stop(key: ProcKey, preferred: Kind, cgroup: &CgroupFacts) -> Stop {
    match (cgroup.whole(), preferred) {
        (Err(_), _) => Stop::Signal(key),
        (Ok((dir, version)), Kind::Freezer) => Stop::Freeze(Frozen {
            dir: dir.to_path_buf(),
            version,
            cell: None,
        }),
        (Ok((dir, version)), Kind::Signal | Kind::Gate | Kind::Lock) => Stop::SignalCgroup {
            dir: dir.to_path_buf(),
            version,
            leader: key,
        },
    }
}

/// The plan of a suspension (see the module's rules).
pub fn choose(f: &Facts) -> Plan {
    let held = if f.lock {
        Held::Lock(f.key)
    } else {
        Held::Stop(match stop(f.key, f.preferred, f.cgroup) {
            // A signalled cgroup whose processes resumed themselves lately: frozen at once.
            Stop::SignalCgroup { dir, version, .. } if f.remembered.cgroup_frozen => {
                Stop::Freeze(Frozen {
                    dir,
                    version,
                    cell: None,
                })
            }
            // A process held alone that had to be moved into a cell of the agent's own:
            // moved in and frozen at once.
            Stop::Signal(key) => f
                .remembered
                .cell
                .clone()
                .map_or(Stop::Signal(key), Stop::Freeze),
            s => s,
        })
    };
    match &f.gate {
        Some(gate) => Plan::Gate {
            gate: gate.clone(),
            fallback: held,
        },
        None => Plan::Now(held),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: ProcKey = ProcKey { pid: 10, start: 1 };

    fn declared() -> CgroupFacts {
        CgroupFacts {
            declared: Some("/batch/job".into()),
            dir: Some(("/sys/fs/cgroup/batch/job".into(), CgroupVersion::V2)),
            holds_agent: false,
            members: Members::Offline,
        }
    }

    fn plan(preferred: Kind, cgroup: &CgroupFacts) -> Plan {
        choose(&Facts {
            key: KEY,
            preferred,
            cgroup,
            lock: false,
            gate: None,
            remembered: Remembered::default(),
        })
    }

    /// A cgroup declared offline as a whole is frozen with the freezer, or every process
    /// in it stopped with signals; a process known offline only by itself is stopped alone.
    #[test]
    fn a_declared_cgroup_is_frozen_or_signalled_whole() {
        let dir = PathBuf::from("/sys/fs/cgroup/batch/job");
        let cg = declared();
        assert!(
            matches!(&plan(Kind::Freezer, &cg), Plan::Now(Held::Stop(Stop::Freeze(Frozen { dir: d, .. }))) if *d == dir),
            "{:?}",
            plan(Kind::Freezer, &cg)
        );
        assert_eq!(
            plan(Kind::Signal, &cg),
            Plan::Now(Held::Stop(Stop::SignalCgroup {
                dir: dir.clone(),
                version: CgroupVersion::V2,
                leader: KEY
            }))
        );
        // Only the process is known offline: it is stopped alone.
        let alone = CgroupFacts::default();
        assert_eq!(plan(Kind::Signal, &alone), Plan::signal(KEY));
        assert_eq!(alone.whole(), Err(Alone::NotDeclared));
        assert!(
            !Alone::NotDeclared.warns(Kind::Signal),
            "signal was asked for"
        );
        assert!(Alone::NotDeclared.warns(Kind::Freezer));
    }

    /// The guard: the agent never freezes (nor stops as a whole) a cgroup it lives in, nor
    /// one without a freezer directory.
    #[test]
    fn a_cgroup_containing_the_agent_is_never_frozen() {
        let cg = CgroupFacts {
            holds_agent: true,
            ..declared()
        };
        for preferred in [Kind::Freezer, Kind::Signal] {
            assert_eq!(plan(preferred, &cg), Plan::signal(KEY), "{preferred:?}");
        }
        assert_eq!(cg.whole(), Err(Alone::HoldsAgent("/batch/job".into())));
        assert!(cg.whole().unwrap_err().warns(Kind::Signal));
        let cg = CgroupFacts {
            dir: None,
            ..declared()
        };
        assert_eq!(plan(Kind::Freezer, &cg), Plan::signal(KEY));
    }

    /// Rules mode: a cgroup that also holds a process that is not offline, or whose
    /// members cannot be read, is never frozen or stopped whole.
    #[test]
    fn a_cgroup_holding_online_work_is_never_held_whole() {
        for members in [
            Members::Mixed {
                pid: 13,
                class: Class::Online,
            },
            Members::Unreadable,
        ] {
            let cg = CgroupFacts {
                members,
                ..declared()
            };
            for preferred in [Kind::Freezer, Kind::Signal] {
                assert_eq!(plan(preferred, &cg), Plan::signal(KEY), "{members:?}");
            }
            assert_eq!(cg.whole_dir(), None);
        }
    }

    /// The driver's lock holds a process it applies to, in place of its stop; a gate where
    /// one applies goes first, whatever holds the process behind it.
    #[test]
    fn a_lock_replaces_the_stop_and_a_gate_goes_first() {
        let cg = declared();
        let gate = GateSlot {
            key: KEY,
            uuid: [1; 16],
            file: "/run/gpu-coloc/gate/gates".into(),
        };
        let f = |lock: bool, gate: Option<GateSlot>| {
            choose(&Facts {
                key: KEY,
                preferred: Kind::Freezer,
                cgroup: &cg,
                lock,
                gate,
                remembered: Remembered::default(),
            })
        };
        assert_eq!(f(true, None), Plan::Now(Held::Lock(KEY)));
        assert_eq!(
            f(true, Some(gate.clone())),
            Plan::Gate {
                gate: gate.clone(),
                fallback: Held::Lock(KEY)
            }
        );
        let gated = f(false, Some(gate.clone()));
        assert_eq!(gated.kind(), Kind::Gate);
        assert_eq!(gated.held(), &Held::Stop(stop(KEY, Kind::Freezer, &cg)));
        assert_eq!(gated.cgroup(), cg.whole_dir());
    }

    /// A stop its tenant undid lately is a freeze at once: the signalled cgroup's
    /// freezer, or the cell of the agent's own the process alone had to be moved into;
    /// the driver's lock and an older memory change nothing.
    #[test]
    fn what_the_hold_book_had_to_freeze_lately_is_frozen_at_once() {
        let cg = declared();
        let cell = Frozen {
            dir: "/sys/fs/cgroup/gpu-coloc.held/10-1".into(),
            version: CgroupVersion::V2,
            cell: None,
        };
        let f = |cgroup: &CgroupFacts, lock: bool, remembered: Remembered| {
            choose(&Facts {
                key: KEY,
                preferred: Kind::Signal,
                cgroup,
                lock,
                gate: None,
                remembered,
            })
        };
        let froze = Remembered {
            cgroup_frozen: true,
            cell: None,
        };
        assert_eq!(
            f(&cg, false, froze.clone()),
            Plan::Now(Held::Stop(Stop::Freeze(Frozen {
                dir: "/sys/fs/cgroup/batch/job".into(),
                version: CgroupVersion::V2,
                cell: None,
            })))
        );
        let celled = Remembered {
            cgroup_frozen: false,
            cell: Some(cell.clone()),
        };
        let alone = CgroupFacts::default();
        assert_eq!(
            f(&alone, false, celled.clone()),
            Plan::Now(Held::Stop(Stop::Freeze(cell)))
        );
        assert_eq!(f(&alone, true, celled), Plan::Now(Held::Lock(KEY)));
        assert_eq!(
            f(&alone, false, froze),
            Plan::signal(KEY),
            "no cgroup held whole"
        );
        assert_eq!(
            f(&cg, false, Remembered::default()),
            Plan::Now(Held::Stop(Stop::SignalCgroup {
                dir: "/sys/fs/cgroup/batch/job".into(),
                version: CgroupVersion::V2,
                leader: KEY,
            }))
        );
    }
}
