//! Target choice: how an offline process will be suspended.
//!
//! - A cgroup the pod source declared offline as a whole (a pod's container, a rule's
//!   `cgroup` matcher) is frozen with the freezer when it is preferred and available, or
//!   else every process in it is stopped with signals — its CPU-only children too.
//! - A process known to be offline only by itself (exe, cmdline, uid rules) is stopped
//!   alone, with a signal through its pidfd.
//! - A cgroup that contains the agent itself is never frozen or signalled as a whole.
//!
//! A [`Target`] here names what is suspended and holds no file descriptor: a process is
//! named by its key, and the shell keeps the pidfd that pins it (opened when it was
//! classified, looked up by that key when a command names it).

use crate::edges::actuator::cell::Cell;
use crate::edges::actuator::{CgroupVersion, Kind, RecordEntry};
use crate::edges::cgroupfs::CgroupMounts;
use crate::edges::procfs::{Cgroups, ProcInfo, ProcKey};
use crate::edges::source::Classified;
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
        version: crate::edges::actuator::CgroupVersion,
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

/// Chooses plans.
#[derive(Debug, Clone)]
pub struct Chooser {
    /// `--actuator`.
    pub preferred: Kind,
    /// The host's cgroup mounts.
    pub mounts: CgroupMounts,
    /// The agent's own cgroups.
    pub own: Cgroups,
}

impl Chooser {
    /// The plan for an offline process, and why the preferred actuator is not used when it
    /// is not (for a one-time warning).
    pub fn choose(&self, info: &ProcInfo, cls: &Classified) -> (Plan, Option<String>) {
        let alone = Plan::Signal(Target::Process { key: info.key });
        let Some(path) = &cls.freeze_cgroup else {
            let why = (self.preferred == Kind::Freezer)
                .then(|| "its rule does not declare a whole cgroup offline".to_string());
            return (alone, why);
        };
        if self.contains_agent(path) {
            return (
                alone,
                Some(format!("cgroup {path} contains the agent itself")),
            );
        }
        let v2 = info.cgroups.v2.as_deref().filter(|p| p == path);
        let v1 = info
            .cgroups
            .v1
            .get("freezer")
            .map(String::as_str)
            .filter(|p| p == path);
        let Some((dir, version)) = self.mounts.dir_for(v2, v1) else {
            let why = (self.preferred == Kind::Freezer)
                .then(|| format!("no freezer for cgroup {path} under the cgroup root"));
            return (alone, why);
        };
        match self.preferred {
            Kind::Freezer => (
                Plan::Freeze(Target::Cgroup {
                    dir,
                    version,
                    cell: None,
                }),
                None,
            ),
            Kind::Signal | Kind::Gate | Kind::Lock => (
                Plan::SignalCgroup {
                    dir,
                    version,
                    leader: alone_target(alone),
                },
                None,
            ),
        }
    }

    fn contains_agent(&self, path: &str) -> bool {
        let prefix = format!("{}/", path.trim_end_matches('/'));
        let inside = |own: Option<&str>| own.is_some_and(|o| o == path || o.starts_with(&prefix));
        inside(self.own.v2.as_deref()) || inside(self.own.v1.get("freezer").map(String::as_str))
    }
}

fn alone_target(p: Plan) -> Target {
    match p {
        Plan::Signal(t) | Plan::Freeze(t) | Plan::Lock(t) => t,
        Plan::SignalCgroup { leader, .. } => leader,
        Plan::Gate { fallback, .. } => alone_target(*fallback),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use qos_core::{Class, Share};

    /// Removes the test's cgroup root when dropped, so a failing test leaves nothing behind.
    struct Root(PathBuf);

    impl Drop for Root {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn setup(own: &str) -> (Chooser, ProcInfo, Classified, PathBuf, Root) {
        let root =
            std::env::temp_dir().join(format!("coloc-target-{}-{}", own.len(), std::process::id()));
        let guard = Root(root.clone());
        let dir = root.join("batch/job");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("cgroup.freeze"), "0").unwrap();
        let chooser = Chooser {
            preferred: Kind::Freezer,
            mounts: CgroupMounts {
                v2: Some(root),
                v1_freezer: None,
                v1_memory: None,
            },
            own: Cgroups::parse(own),
        };
        let info = ProcInfo {
            key: ProcKey { pid: 10, start: 1 },
            uid: 0,
            exe: None,
            cmdline: "train".into(),
            cgroups: Cgroups::parse("0::/batch/job\n"),
            ns_pid: None,
        };
        let cls = Classified {
            class: Class::Offline,
            share: Share::Burst,
            owner: "rule:off".into(),
            freeze_cgroup: Some("/batch/job".into()),
            checkpoint: None,
            shim: None,
            container: None,
        };
        (chooser, info, cls, dir, guard)
    }

    #[test]
    fn a_declared_cgroup_is_frozen_or_signalled_whole() {
        let (mut c, info, cls, dir, _root) = setup("0::/system.slice/agent.service\n");
        let (plan, why) = c.choose(&info, &cls);
        assert!(
            matches!(&plan, Plan::Freeze(Target::Cgroup { dir: d, .. }) if *d == dir),
            "{plan:?}"
        );
        assert_eq!(why, None);
        c.preferred = Kind::Signal;
        let (plan, _) = c.choose(&info, &cls);
        assert!(
            matches!(&plan, Plan::SignalCgroup { dir: d, .. } if *d == dir),
            "{plan:?}"
        );
        // Only the process is known offline: it is stopped alone.
        let (plan, why) = c.choose(
            &info,
            &Classified {
                freeze_cgroup: None,
                ..cls
            },
        );
        assert!(matches!(plan, Plan::Signal(_)), "{plan:?}");
        assert_eq!(why, None, "signal was asked for: nothing to warn about");
    }

    /// The guard: the agent never freezes (nor stops as a whole) a cgroup it lives in.
    #[test]
    fn a_cgroup_containing_the_agent_is_never_frozen() {
        for own in [
            "0::/batch/job\n",
            "0::/batch/job/agent\n",
            "7:freezer:/batch/job\n0::/\n",
        ] {
            let (mut c, info, cls, _, _root) = setup(own);
            let (plan, why) = c.choose(&info, &cls);
            assert!(
                matches!(plan, Plan::Signal(Target::Process { .. })),
                "{own}: {plan:?}"
            );
            assert!(why.unwrap().contains("contains the agent"));
            c.preferred = Kind::Signal;
            let (plan, _) = c.choose(&info, &cls);
            assert!(
                matches!(plan, Plan::Signal(Target::Process { .. })),
                "{own}: {plan:?}"
            );
        }
        // A sibling whose name merely starts the same is not "inside".
        let (c, info, cls, _, _root) = setup("0::/batch/job2\n");
        assert!(matches!(c.choose(&info, &cls).0, Plan::Freeze(_)));
    }
}
