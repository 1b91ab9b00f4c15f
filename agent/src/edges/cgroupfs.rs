//! cgroup paths as the host sees them, and cgroup files opened safely.
//!
//! In its own cgroup namespace (containerd gives one to every non-privileged container on
//! cgroup v2), the agent reads other processes' `/proc/<pid>/cgroup` relative to its own
//! namespace root: `0::/../../kubepods/…`. The host hierarchy mounted into the agent
//! (`--cgroup-root`) is the host's whole tree, so such a path must be re-rooted at the
//! agent's namespace root before it names a directory there. [`NsRoots`] finds that root
//! once at start (the directory of the host mount whose `cgroup.procs` holds the agent's
//! PID), and [`NsRoots::to_host`] maps a seen path to a host path, lexically, refusing any
//! path that climbs above the hierarchy's root.
//!
//! Files under a cgroup are opened with `openat2(2)` and `RESOLVE_NO_SYMLINKS |
//! RESOLVE_NO_MAGICLINKS`, never with `O_CREAT`: a symlink planted anywhere on the path,
//! or a file that does not exist, is an error, never a write somewhere else.
//!
//! May touch: reads `cgroup.procs` under the cgroup mounts (once at start, to find the
//! namespace root); opens cgroup files for the actuator.

pub use crate::control::model::host::CgroupMounts;
use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

impl CgroupMounts {
    /// Finds the hierarchies under `root` (usually `/sys/fs/cgroup`): pure v2 at the root,
    /// hybrid v2 at `root/unified`, and the v1 freezer at `root/freezer`.
    pub fn detect(root: &Path) -> CgroupMounts {
        let v2 = [root.to_path_buf(), root.join("unified")]
            .into_iter()
            .find(|p| p.join("cgroup.controllers").exists());
        let v1_freezer = Some(root.join("freezer"))
            .filter(|p| p.join("freezer.state").exists() || p.join("tasks").exists());
        let v1_memory =
            Some(root.join("memory")).filter(|p| p.join("memory.limit_in_bytes").exists());
        CgroupMounts {
            v2,
            v1_freezer,
            v1_memory,
        }
    }

    /// What a process's memory limits leave it, bytes: the least, over its cgroup and every
    /// cgroup above it (a pod's limit sits above its containers'), of the limit less what
    /// is charged there now; `None` when no limit applies or none can be read. `cg`: its
    /// cgroup paths as seen from the host. The v2 hierarchy where it has the memory
    /// controller, else the v1 memory hierarchy.
    pub fn memory_room(&self, cg: &crate::edges::procfs::Cgroups) -> Option<u64> {
        let walk = |mount: &Path, path: &str, limit_file: &str, usage_file: &str| {
            let mut dir = mount.join(path.trim_start_matches('/'));
            let mut room: Option<u64> = None;
            let mut found = false;
            while dir.starts_with(mount) {
                let limit = read(&dir, limit_file).ok();
                if limit.is_some() {
                    found = true;
                }
                let limit = limit.and_then(|s| s.trim().parse::<u64>().ok());
                // v1 writes "no limit" as a page-rounded i64::MAX.
                if let Some(l) = limit.filter(|l| *l < 1 << 60) {
                    let used = read(&dir, usage_file)
                        .ok()
                        .and_then(|s| s.trim().parse::<u64>().ok())
                        .unwrap_or(0);
                    let r = l.saturating_sub(used);
                    room = Some(room.map_or(r, |x| x.min(r)));
                }
                if dir == mount || !dir.pop() {
                    break;
                }
            }
            (found, room)
        };
        if let (Some(m), Some(p)) = (&self.v2, &cg.v2) {
            let (found, room) = walk(m, p, "memory.max", "memory.current");
            if found {
                return room;
            }
        }
        match (&self.v1_memory, cg.v1.get("memory")) {
            (Some(m), Some(p)) => walk(m, p, "memory.limit_in_bytes", "memory.usage_in_bytes").1,
            _ => None,
        }
    }

    /// The directory of a cgroup given by its host path inside the v2 hierarchy or the v1
    /// freezer hierarchy, with the file that must exist there (`cgroup.freeze` /
    /// `freezer.state`). v2 is preferred. The root cgroup is never a target, and a path
    /// that climbs out of its hierarchy (`..`) names nothing.
    pub fn dir_for(
        &self,
        v2_path: Option<&str>,
        v1_freezer_path: Option<&str>,
    ) -> Option<(PathBuf, crate::edges::actuator::CgroupVersion)> {
        let beneath = |mount: &Path, p: &str| -> Option<PathBuf> {
            let norm = rebase("/", p).filter(|n| n != "/")?;
            Some(mount.join(norm.trim_start_matches('/')))
        };
        if let (Some(mount), Some(p)) = (&self.v2, v2_path) {
            let dir = beneath(mount, p)?;
            if dir.join("cgroup.freeze").exists() {
                return Some((dir, crate::edges::actuator::CgroupVersion::V2));
            }
        }
        if let (Some(mount), Some(p)) = (&self.v1_freezer, v1_freezer_path) {
            let dir = beneath(mount, p)?;
            if dir.join("freezer.state").exists() {
                return Some((dir, crate::edges::actuator::CgroupVersion::V1));
            }
        }
        None
    }
}

/// Joins a seen cgroup path onto `root` (a host path) and normalises it: `.` and empty
/// segments vanish, `..` climbs. `None` when it would climb above the hierarchy's root or
/// holds a NUL. The result is absolute (`/` for the root).
pub fn rebase(root: &str, seen: &str) -> Option<String> {
    if seen.contains('\0') || root.contains('\0') {
        return None;
    }
    let mut parts: Vec<&str> = Vec::new();
    let start = if seen.starts_with('/') { root } else { "/" };
    for seg in start.split('/').chain(seen.split('/')) {
        match seg {
            "" | "." => {}
            ".." => {
                parts.pop()?;
            }
            s => parts.push(s),
        }
    }
    Some(format!("/{}", parts.join("/")))
}

/// Where the agent's cgroup namespace is rooted in each hierarchy it uses (host paths;
/// `/` when the agent is not in a cgroup namespace of its own).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NsRoots {
    /// Unified hierarchy.
    pub v2: String,
    /// v1 freezer hierarchy.
    pub v1_freezer: String,
}

impl Default for NsRoots {
    fn default() -> Self {
        NsRoots {
            v2: "/".into(),
            v1_freezer: "/".into(),
        }
    }
}

impl NsRoots {
    /// Finds the namespace roots: for each mounted hierarchy, the agent's own path as it
    /// sees it (`seen`) is checked under the mount; when the agent is not listed there, the
    /// mount is searched for the directory that lists it, and the root is that directory
    /// with `seen` taken off its end.
    pub fn find(v2: Option<(&Path, &str)>, v1_freezer: Option<(&Path, &str)>, pid: u32) -> NsRoots {
        let one = |h: Option<(&Path, &str)>| -> String {
            let Some((mount, seen)) = h else {
                return "/".into();
            };
            let direct = rebase("/", seen).unwrap_or_else(|| "/".into());
            if lists(&mount.join(direct.trim_start_matches('/')), pid) {
                return "/".into();
            }
            match search(mount, pid) {
                Some(host) => strip_suffix(&host, &direct).unwrap_or_else(|| "/".into()),
                None => "/".into(),
            }
        };
        NsRoots {
            v2: one(v2),
            v1_freezer: one(v1_freezer),
        }
    }

    /// The host path of a path seen in `/proc/<pid>/cgroup` (`v1`: of the freezer
    /// hierarchy). `None` when it climbs out of the hierarchy.
    pub fn to_host(&self, seen: &str, v1: bool) -> Option<String> {
        rebase(if v1 { &self.v1_freezer } else { &self.v2 }, seen)
    }
}

fn strip_suffix(host: &str, seen: &str) -> Option<String> {
    if seen == "/" {
        return Some(host.to_string());
    }
    host.strip_suffix(seen).map(|r| {
        if r.is_empty() {
            "/".into()
        } else {
            r.to_string()
        }
    })
}

fn lists(dir: &Path, pid: u32) -> bool {
    let mut s = String::new();
    File::open(dir.join("cgroup.procs"))
        .and_then(|mut f| f.read_to_string(&mut s))
        .map(|_| s.lines().any(|l| l.trim().parse() == Ok(pid)))
        .unwrap_or(false)
}

/// Breadth-first search of the hierarchy for the directory listing `pid` (bounded).
fn search(mount: &Path, pid: u32) -> Option<String> {
    let mut queue = vec![PathBuf::new()];
    let mut seen = 0usize;
    while let Some(rel) = queue.pop() {
        seen += 1;
        if seen > 50_000 {
            return None;
        }
        let dir = mount.join(&rel);
        if lists(&dir, pid) {
            return Some(format!("/{}", rel.display()));
        }
        if let Ok(rd) = std::fs::read_dir(&dir) {
            for e in rd.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    queue.push(rel.join(e.file_name()));
                }
            }
        }
    }
    None
}

/// Opens `file` in cgroup directory `dir` without following any symlink and without
/// creating anything.
pub fn open(dir: &Path, file: &str, write: bool) -> io::Result<File> {
    use rustix::fs::{openat2, Mode, OFlags, ResolveFlags, CWD};
    let path = dir.join(file);
    let flags = if write {
        OFlags::WRONLY
    } else {
        OFlags::RDONLY
    } | OFlags::CLOEXEC
        | OFlags::NOFOLLOW;
    match openat2(
        CWD,
        &path,
        flags,
        Mode::empty(),
        ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    ) {
        Ok(fd) => Ok(File::from(fd)),
        // Kernels before 5.6: no openat2. The path was normalised and checked to be under
        // the mount; O_NOFOLLOW still refuses a symlink in the last component.
        Err(rustix::io::Errno::NOSYS) => {
            let fd = rustix::fs::open(&path, flags, Mode::empty())?;
            Ok(File::from(fd))
        }
        Err(e) => Err(e.into()),
    }
}

/// Writes `value` to `file` in `dir` (see [`open`]).
pub fn write(dir: &Path, file: &str, value: &[u8]) -> io::Result<()> {
    use std::io::Write;
    open(dir, file, true)?.write_all(value)
}

/// Reads `file` in `dir` (see [`open`]).
pub fn read(dir: &Path, file: &str) -> io::Result<String> {
    let mut s = String::new();
    open(dir, file, false)?.read_to_string(&mut s)?;
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pod's limit above its container's: the least room wins; "max" and v1's
    /// "no limit" are no limit; the v1 memory hierarchy where v2 has no memory controller.
    #[test]
    fn memory_room_is_the_least_room_up_the_tree() {
        let root = crate::testutil::TmpDir::new("coloc-memroom");
        let v2 = root.join("v2");
        let ctr = v2.join("pod/ctr");
        std::fs::create_dir_all(&ctr).unwrap();
        let put = |d: &Path, f: &str, v: &str| std::fs::write(d.join(f), v).unwrap();
        put(&ctr, "memory.max", "max\n");
        put(&ctr, "memory.current", "1000\n");
        put(&v2.join("pod"), "memory.max", "8000\n");
        put(&v2.join("pod"), "memory.current", "3000\n");
        let m = CgroupMounts {
            v2: Some(v2.clone()),
            v1_freezer: None,
            v1_memory: Some(root.join("v1")),
        };
        let cg = |v2: Option<&str>, mem: Option<&str>| {
            let mut c = crate::edges::procfs::Cgroups {
                v2: v2.map(String::from),
                ..Default::default()
            };
            if let Some(p) = mem {
                c.v1.insert("memory".into(), p.into());
            }
            c
        };
        assert_eq!(m.memory_room(&cg(Some("/pod/ctr"), None)), Some(5000));
        put(&ctr, "memory.max", "2500\n");
        assert_eq!(m.memory_room(&cg(Some("/pod/ctr"), None)), Some(1500));
        put(&ctr, "memory.max", "max\n");
        put(&v2.join("pod"), "memory.max", "max\n");
        assert_eq!(m.memory_room(&cg(Some("/pod/ctr"), None)), None);
        // No memory controller in v2 (hybrid): the v1 memory hierarchy.
        let v1 = root.join("v1/kubepods/pod");
        std::fs::create_dir_all(&v1).unwrap();
        put(&v1, "memory.limit_in_bytes", "4096\n");
        put(&v1, "memory.usage_in_bytes", "1024\n");
        put(
            &root.join("v1"),
            "memory.limit_in_bytes",
            "9223372036854771712\n",
        );
        put(&root.join("v1"), "memory.usage_in_bytes", "99999\n");
        assert_eq!(
            m.memory_room(&cg(Some("/elsewhere"), Some("/kubepods/pod"))),
            Some(3072)
        );
    }

    #[test]
    fn rebase_climbs_but_never_out() {
        assert_eq!(rebase("/", "/a/b").as_deref(), Some("/a/b"));
        assert_eq!(
            rebase("/k/pod1/c1", "/../../pod2/c2").as_deref(),
            Some("/k/pod2/c2")
        );
        assert_eq!(rebase("/k/pod1/c1", "/").as_deref(), Some("/k/pod1/c1"));
        assert_eq!(rebase("/k", "/./x//y/").as_deref(), Some("/k/x/y"));
        assert_eq!(rebase("/", "/../etc"), None, "climbs above the root");
        assert_eq!(rebase("/a", "/../../x"), None);
        assert_eq!(rebase("/", "/a\0b"), None);
    }

    #[test]
    fn namespace_root_is_found_by_the_agents_pid() {
        let mount = crate::testutil::TmpDir::new("coloc-cgfs");
        let me = mount.join("kubepods/pod1/agent");
        std::fs::create_dir_all(&me).unwrap();
        std::fs::create_dir_all(mount.join("kubepods/pod2/job")).unwrap();
        std::fs::write(mount.join("cgroup.procs"), "1\n").unwrap();
        std::fs::write(me.join("cgroup.procs"), "42\n4242\n").unwrap();
        // Not in a namespace: the seen path is the host path.
        let r = NsRoots::find(Some((&mount, "/kubepods/pod1/agent")), None, 4242);
        assert_eq!(r.v2, "/");
        // In its own namespace, rooted at its cgroup: it sees itself at "/".
        let r = NsRoots::find(Some((&mount, "/")), None, 4242);
        assert_eq!(r.v2, "/kubepods/pod1/agent");
        assert_eq!(
            r.to_host("/../../pod2/job", false).as_deref(),
            Some("/kubepods/pod2/job")
        );
        assert_eq!(r.to_host("/../../../../x", false), None);
    }

    #[test]
    fn open_refuses_symlinks_and_never_creates() {
        let base = crate::testutil::TmpDir::new("coloc-cgfs-open");
        let real = base.join("real");
        let outside = base.join("outside");
        std::fs::create_dir_all(&real).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(real.join("cgroup.freeze"), "0").unwrap();
        std::fs::write(outside.join("cgroup.freeze"), "0").unwrap();
        std::os::unix::fs::symlink(&outside, base.join("link")).unwrap();
        write(&real, "cgroup.freeze", b"1").unwrap();
        assert_eq!(
            std::fs::read_to_string(real.join("cgroup.freeze")).unwrap(),
            "1"
        );
        assert!(
            write(&base.join("link"), "cgroup.freeze", b"1").is_err(),
            "followed a symlink"
        );
        assert_eq!(
            std::fs::read_to_string(outside.join("cgroup.freeze")).unwrap(),
            "0"
        );
        assert!(write(&real, "cgroup.nonexistent", b"1").is_err());
        assert!(!real.join("cgroup.nonexistent").exists(), "created a file");
    }
}
