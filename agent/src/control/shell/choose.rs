//! What the shell observes of an offline process's cgroup when it classifies the process
//! (the facts the controller's [`crate::control::plan`] chooses the plan from): the cgroup
//! the pod source declares offline as a whole, its freezer directory under the host's
//! cgroup mounts, and whether the agent itself lives in it. The plan is not chosen here.
//!
//! May touch: checks that the freezer files exist (the mounts and the agent's cgroups
//! are read at start).

use crate::control::model::process::Classified;
use crate::control::model::Kind;
use crate::control::plan::CgroupFacts;
use crate::edges::cgroupfs::CgroupMounts;
use crate::edges::procfs::{Cgroups, ProcInfo};
#[cfg(test)]
use std::path::PathBuf;

/// Observes cgroups.
#[derive(Debug, Clone)]
pub struct Chooser {
    /// `--actuator` (for the one-time warning when the freezer cannot be used).
    pub preferred: Kind,
    /// The host's cgroup mounts.
    pub mounts: CgroupMounts,
    /// The agent's own cgroups.
    pub own: Cgroups,
}

impl Chooser {
    /// What is observed of the cgroup of offline process `info`, classified `cls` (its
    /// members are read by the classifier, in rules mode).
    pub fn facts(&self, info: &ProcInfo, cls: &Classified) -> CgroupFacts {
        let Some(path) = &cls.freeze_cgroup else {
            return CgroupFacts::default();
        };
        let v2 = info.cgroups.v2.as_deref().filter(|p| p == path);
        let v1 = info
            .cgroups
            .v1
            .get("freezer")
            .map(String::as_str)
            .filter(|p| p == path);
        CgroupFacts {
            declared: Some(path.clone()),
            dir: self.mounts.dir_for(v2, v1),
            holds_agent: self.contains_agent(path),
            members: Default::default(),
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

    /// The declared cgroup's freezer directory is found under the mounts, and the agent
    /// is found in it (or beneath it) by its own cgroups; a process known offline only by
    /// itself has no cgroup to observe.
    #[test]
    fn a_declared_cgroups_freezer_and_the_agent_in_it_are_observed() {
        let (c, info, cls, dir, _root) = setup("0::/system.slice/agent.service\n");
        let facts = c.facts(&info, &cls);
        assert_eq!(
            facts.dir,
            Some((dir, crate::control::model::act::CgroupVersion::V2))
        );
        assert!(!facts.holds_agent);
        assert_eq!(facts.declared.as_deref(), Some("/batch/job"));
        let facts = c.facts(
            &info,
            &Classified {
                freeze_cgroup: None,
                ..cls.clone()
            },
        );
        assert_eq!(facts, CgroupFacts::default());
        // The cgroup named, not found under the mounts: no freezer for it.
        let mut gone = cls;
        gone.freeze_cgroup = Some("/batch/other".into());
        assert_eq!(c.facts(&info, &gone).dir, None);
    }

    /// The guard's fact: the agent lives in the declared cgroup or beneath it (v2 or the
    /// v1 freezer); a sibling whose name merely starts the same is not "inside".
    #[test]
    fn the_agent_in_a_declared_cgroup_is_observed() {
        for own in [
            "0::/batch/job\n",
            "0::/batch/job/agent\n",
            "7:freezer:/batch/job\n0::/\n",
        ] {
            let (c, info, cls, _, _root) = setup(own);
            assert!(c.facts(&info, &cls).holds_agent, "{own}");
        }
        let (c, info, cls, _, _root) = setup("0::/batch/job2\n");
        assert!(!c.facts(&info, &cls).holds_agent);
    }
}
