//! Scratch cgroups (v2 or the v1 freezer), and thawing whatever froze a process.

use crate::wait_for;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The v2 hierarchy's mount point: `/sys/fs/cgroup` (pure v2) or `/sys/fs/cgroup/unified`
/// (hybrid).
pub fn cgroup_v2_root() -> Option<PathBuf> {
    ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.join("cgroup.controllers").exists())
}

/// Thaws the (non-root) v2 cgroup and v1 freezer cgroup that `pid` is in, if frozen.
pub fn thaw_cgroups_of(pid: u32) {
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else {
        return;
    };
    for line in text.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(_), Some(ctrl), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let rel = path.trim_start_matches('/');
        if rel.is_empty() {
            continue;
        }
        if ctrl.is_empty() {
            if let Some(root) = cgroup_v2_root() {
                let _ = std::fs::write(root.join(rel).join("cgroup.freeze"), "0");
            }
        } else if ctrl.split(',').any(|c| c == "freezer") {
            let _ = std::fs::write(
                Path::new("/sys/fs/cgroup/freezer")
                    .join(rel)
                    .join("freezer.state"),
                "THAWED",
            );
        }
    }
}

/// A cgroup created for a test, removed on drop.
#[derive(Debug)]
pub struct TestCgroup {
    /// Absolute directory.
    pub dir: PathBuf,
    /// Path inside its hierarchy (for rules).
    pub path: String,
    /// "v2" or "v1".
    pub version: &'static str,
}

impl TestCgroup {
    /// Creates a cgroup in the v2 hierarchy (`/sys/fs/cgroup` or its `unified/`).
    pub fn v2(name: &str) -> Option<TestCgroup> {
        TestCgroup::try_v2(name).ok()
    }

    /// Like [`TestCgroup::v2`], saying why when the v2 freezer cannot be used here.
    pub fn try_v2(name: &str) -> std::result::Result<TestCgroup, String> {
        let root = cgroup_v2_root().ok_or(
            "no cgroup v2 hierarchy (no cgroup.controllers in /sys/fs/cgroup or /sys/fs/cgroup/unified)",
        )?;
        let dir = root.join(name);
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("cannot create {} ({e}; root needed)", dir.display()))?;
        if !dir.join("cgroup.freeze").exists() {
            let _ = std::fs::remove_dir(&dir);
            return Err(format!(
                "{} has no cgroup.freeze (kernel older than 5.2)",
                dir.display()
            ));
        }
        Ok(TestCgroup {
            dir,
            path: format!("/{name}"),
            version: "v2",
        })
    }

    /// Creates a cgroup in the v1 freezer hierarchy.
    pub fn v1(name: &str) -> Option<TestCgroup> {
        TestCgroup::try_v1(name).ok()
    }

    /// Like [`TestCgroup::v1`], saying why when the v1 freezer cannot be used here.
    pub fn try_v1(name: &str) -> std::result::Result<TestCgroup, String> {
        let root = PathBuf::from("/sys/fs/cgroup/freezer");
        if !root.join("tasks").exists() {
            return Err(
                "no v1 freezer hierarchy at /sys/fs/cgroup/freezer (pure cgroup v2 host)".into(),
            );
        }
        let dir = root.join(name);
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("cannot create {} ({e}; root needed)", dir.display()))?;
        Ok(TestCgroup {
            dir,
            path: format!("/{name}"),
            version: "v1",
        })
    }

    /// The file the agent writes to freeze this cgroup (`cgroup.freeze` or
    /// `freezer.state`), as it reads now.
    pub fn control_file(&self) -> String {
        let f = if self.version == "v2" {
            "cgroup.freeze"
        } else {
            "freezer.state"
        };
        std::fs::read_to_string(self.dir.join(f))
            .unwrap_or_default()
            .trim()
            .to_string()
    }

    /// Whether the cgroup is frozen.
    pub fn frozen(&self) -> bool {
        match self.version {
            "v2" => std::fs::read_to_string(self.dir.join("cgroup.events"))
                .map(|s| s.lines().any(|l| l == "frozen 1"))
                .unwrap_or(false),
            _ => std::fs::read_to_string(self.dir.join("freezer.state"))
                .map(|s| s.trim() == "FROZEN")
                .unwrap_or(false),
        }
    }

    /// PIDs in the cgroup.
    pub fn pids(&self) -> Vec<u32> {
        let f = if self.version == "v2" {
            "cgroup.procs"
        } else {
            "tasks"
        };
        std::fs::read_to_string(self.dir.join(f))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }
}

/// `dir` and every cgroup below it, parents before children.
fn cgroup_tree(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![dir.to_path_buf()];
    let mut i = 0;
    while i < out.len() {
        if let Ok(rd) = std::fs::read_dir(&out[i]) {
            let subs: Vec<PathBuf> = rd
                .flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path())
                .collect();
            out.extend(subs);
        }
        i += 1;
    }
    out
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // Never leave anything frozen: thaw, kill, then remove (nested cgroups too, deepest
        // first, so a test that fails half-way leaves no directory behind).
        // Bounded throughout: a failing test must end in seconds, not hang on a frozen
        // process. Kill in a loop: a process may fork while being killed.
        let _ = match self.version {
            "v2" => std::fs::write(self.dir.join("cgroup.freeze"), "0"),
            _ => std::fs::write(self.dir.join("freezer.state"), "THAWED"),
        };
        let procs = if self.version == "v2" {
            "cgroup.procs"
        } else {
            "tasks"
        };
        let tree = cgroup_tree(&self.dir);
        let all_pids = || -> Vec<u32> {
            tree.iter()
                .flat_map(|d| {
                    std::fs::read_to_string(d.join(procs))
                        .unwrap_or_default()
                        .lines()
                        .filter_map(|l| l.trim().parse().ok())
                        .collect::<Vec<u32>>()
                })
                .collect()
        };
        let empty = wait_for("cgroup empty", Duration::from_secs(5), || {
            let pids = all_pids();
            for pid in &pids {
                // SAFETY: kill(2).
                unsafe { libc::kill(*pid as i32, libc::SIGKILL) };
            }
            pids.is_empty()
        });
        if let Err(e) = empty {
            eprintln!(
                "WARNING: {e}: {} still holds {:?} (frozen: {})",
                self.dir.display(),
                all_pids(),
                self.frozen()
            );
        }
        for d in tree.iter().rev() {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// The offline processes' classification for a benchmark's agent: with `freezer`, scratch
/// cgroups `<group>/<child>` (v2, or the v1 freezer; the parent first in the returned
/// list) declared offline by a rules `cgroup` matcher; otherwise a `cmdline` matcher on
/// the simulated offline workload. Returns the cgroups (kept alive by the caller) and the
/// rules text.
pub fn offline_rules(group: &str, children: &[String], freezer: bool) -> (Vec<TestCgroup>, String) {
    if !freezer {
        let rules =
            "[[rule]]\nname = \"off\"\nclass = \"reclaimed_cores\"\ncmdline = \"*coloc-sim offline*\"\n";
        return (Vec::new(), rules.to_string());
    }
    let parent = TestCgroup::v2(group)
        .or_else(|| TestCgroup::v1(group))
        .expect("a cgroup freezer (run as root)");
    let mut cgroups = vec![];
    for child in children {
        let name = format!("{group}/{child}");
        let cg = if parent.version == "v2" {
            TestCgroup::v2(&name)
        } else {
            TestCgroup::v1(&name)
        };
        cgroups.push(cg.expect("child cgroup"));
    }
    cgroups.insert(0, parent);
    let rules =
        format!("[[rule]]\nname = \"off\"\nclass = \"reclaimed_cores\"\ncgroup = \"/{group}/*\"\n");
    (cgroups, rules)
}
