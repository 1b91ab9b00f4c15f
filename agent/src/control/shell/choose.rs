//! The plan of an offline process, chosen when it is classified (the shell's part: it
//! looks at the host's cgroup mounts and the agent's own cgroups).
//!
//! - A cgroup the pod source declared offline as a whole (a pod's container, a rule's
//!   `cgroup` matcher) is frozen with the freezer when it is preferred and available, or
//!   else every process in it is stopped with signals — its CPU-only children too.
//! - A process known to be offline only by itself (exe, cmdline, uid rules) is stopped
//!   alone, with a signal through its pidfd.
//! - A cgroup that contains the agent itself is never frozen or signalled as a whole.
//!
//! May touch: nothing (the mounts and the agent's cgroups are read at start).

use crate::control::model::process::Classified;
use crate::control::model::Kind;
use crate::control::target::{Frozen, Plan};
use crate::edges::cgroupfs::CgroupMounts;
use crate::edges::procfs::{Cgroups, ProcInfo};
#[cfg(test)]
use std::path::PathBuf;

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
        let alone = Plan::Signal(info.key);
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
                Plan::Freeze(Frozen {
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
                    leader: info.key,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::model::ProcKey;
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
            matches!(&plan, Plan::Freeze(Frozen { dir: d, .. }) if *d == dir),
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
            assert!(matches!(plan, Plan::Signal(_)), "{own}: {plan:?}");
            assert!(why.unwrap().contains("contains the agent"));
            c.preferred = Kind::Signal;
            let (plan, _) = c.choose(&info, &cls);
            assert!(matches!(plan, Plan::Signal(_)), "{own}: {plan:?}");
        }
        // A sibling whose name merely starts the same is not "inside".
        let (c, info, cls, _, _root) = setup("0::/batch/job2\n");
        assert!(matches!(c.choose(&info, &cls).0, Plan::Freeze(_)));
    }
}
