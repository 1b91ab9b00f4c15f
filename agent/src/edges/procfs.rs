//! What `/proc` says about a process: identity (PID + start time), run state, owner,
//! executable, command line and cgroup membership; the members of a cgroup; and pidfds,
//! which pin a process so that a reused PID is never hit.
//!
//! One trait, [`ProcFs`], implemented by [`HostProc`] (this host) and by the tests' fake.
//!
//! May touch: `/proc` and `cgroup.procs` files (read only), pidfds.

pub use crate::control::model::process::ProcKey;
use crate::edges::cgroupfs::CgroupMounts;
use crate::edges::cgroupfs::NsRoots;
use std::collections::BTreeMap;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

/// Everything the control loop asks about processes.
pub trait ProcFs: Send + Sync {
    /// Identity, owner, executable, command line and cgroups of `pid`. `NotFound` when no
    /// such process is visible (it exited, or lives in another PID namespace).
    fn read_proc(&self, pid: u32) -> io::Result<ProcInfo>;
    /// Run state and start time of `pid`.
    fn read_stat(&self, pid: u32) -> io::Result<Stat>;
    /// The agent's own cgroups (it must never freeze or stop itself).
    fn self_cgroups(&self) -> Cgroups;
    /// The agent's own PID.
    fn self_pid(&self) -> u32;
    /// PIDs in the cgroup directory `dir` (`cgroup.procs`).
    fn cgroup_members(&self, dir: &Path) -> io::Result<Vec<u32>>;
    /// The processes of cgroup `dir` and of every cgroup beneath it (what freezing `dir`
    /// freezes: v2 freezing is recursive, and so is the v1 freezer).
    fn cgroup_tree_members(&self, dir: &Path) -> io::Result<Vec<u32>>;
    /// A pidfd pinning exactly the process `key` (checked against its start time).
    fn open_pidfd(&self, key: ProcKey) -> io::Result<OwnedFd>;
    /// For each pinned process, whether it has exited (one `poll(2)` over the pidfds:
    /// much cheaper than reading `/proc/<pid>/stat` of every GPU process).
    fn exited(&self, pins: &[(ProcKey, &OwnedFd)]) -> Vec<bool>;
}

/// This host's `/proc`, with cgroup paths re-rooted at the host hierarchy when the agent
/// runs in a cgroup namespace of its own (see [`crate::edges::cgroupfs`]).
#[derive(Debug, Clone, Default)]
pub struct HostProc {
    roots: NsRoots,
}

impl HostProc {
    /// Finds where the agent's cgroup namespace is rooted in the hierarchies of `mounts`.
    pub fn new(mounts: &CgroupMounts) -> HostProc {
        let own = own_cgroups();
        let v1 = own.v1.get("freezer").map(String::as_str);
        let roots = NsRoots::find(
            mounts.v2.as_deref().zip(own.v2.as_deref()),
            mounts.v1_freezer.as_deref().zip(v1),
            std::process::id(),
        );
        HostProc { roots }
    }

    /// The namespace roots found.
    pub fn roots(&self) -> &NsRoots {
        &self.roots
    }

    /// `cg` with its v2 and v1-freezer paths as host paths; a path that climbs out of its
    /// hierarchy is dropped (nothing may be resolved from it).
    fn to_host(&self, mut cg: Cgroups) -> Cgroups {
        cg.v2 = cg.v2.and_then(|p| self.roots.to_host(&p, false));
        if let Some(p) = cg.v1.remove("freezer") {
            if let Some(h) = self.roots.to_host(&p, true) {
                cg.v1.insert("freezer".into(), h);
            }
        }
        cg
    }
}

fn own_cgroups() -> Cgroups {
    std::fs::read_to_string("/proc/self/cgroup")
        .map(|s| Cgroups::parse(&s))
        .unwrap_or_default()
}

impl ProcFs for HostProc {
    fn read_proc(&self, pid: u32) -> io::Result<ProcInfo> {
        let mut info = read_proc(pid)?;
        info.cgroups = self.to_host(info.cgroups);
        Ok(info)
    }
    fn read_stat(&self, pid: u32) -> io::Result<Stat> {
        read_stat(pid)
    }
    fn self_cgroups(&self) -> Cgroups {
        self.to_host(own_cgroups())
    }
    fn self_pid(&self) -> u32 {
        std::process::id()
    }
    fn cgroup_members(&self, dir: &Path) -> io::Result<Vec<u32>> {
        let text = crate::edges::cgroupfs::read(dir, "cgroup.procs")?;
        Ok(text.lines().filter_map(|l| l.trim().parse().ok()).collect())
    }
    fn cgroup_tree_members(&self, dir: &Path) -> io::Result<Vec<u32>> {
        let mut out = self.cgroup_members(dir)?;
        // Every child cgroup, depth first; any that cannot be read is an error (the caller
        // must not take "could not look" for "nothing there").
        for e in std::fs::read_dir(dir)? {
            let e = e?;
            if e.file_type()?.is_dir() {
                out.extend(self.cgroup_tree_members(&e.path())?);
            }
        }
        Ok(out)
    }
    fn open_pidfd(&self, key: ProcKey) -> io::Result<OwnedFd> {
        open_pidfd(key)
    }
    fn exited(&self, pins: &[(ProcKey, &OwnedFd)]) -> Vec<bool> {
        use rustix::event::{poll, PollFd, PollFlags, Timespec};
        let mut fds: Vec<PollFd<'_>> = pins
            .iter()
            .map(|(_, fd)| PollFd::new(*fd, PollFlags::IN))
            .collect();
        let zero = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        match poll(&mut fds, Some(&zero)) {
            // A pidfd is readable once its process has exited.
            Ok(_) => fds.iter().map(|f| !f.revents().is_empty()).collect(),
            // Cannot tell: say "exited", so the caller re-reads /proc.
            Err(_) => vec![true; pins.len()],
        }
    }
}

/// Opens a pidfd for `key`, and checks afterwards that the PID still has `key`'s start
/// time: the pidfd then pins exactly that process.
pub fn open_pidfd(key: ProcKey) -> io::Result<OwnedFd> {
    let pid = rustix::process::Pid::from_raw(key.pid as i32)
        .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    let fd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty())?;
    match read_stat(key.pid) {
        Ok(s) if s.start == key.start => Ok(fd),
        _ => Err(io::Error::new(io::ErrorKind::NotFound, "process replaced")),
    }
}

/// The fields of `/proc/<pid>/stat` the agent uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    /// Run state letter (`R`, `S`, `D`, `T` stopped, `t` traced, `Z`, ...).
    pub state: char,
    /// Start time (clock ticks since boot).
    pub start: u64,
    /// CPU time used, user + system, clock ticks (of every thread, for a process).
    pub cpu: u64,
}

/// Parses `/proc/<pid>/stat` content. The command name may contain spaces and
/// parentheses, so fields are counted after the last `)`.
pub fn parse_stat(s: &str) -> Option<Stat> {
    let after = s.get(s.rfind(')')? + 1..)?.trim_start();
    let mut fields = after.split_ascii_whitespace();
    let state = fields.next()?.chars().next()?;
    // After the state (field 3) come fields 4..: utime and stime are fields 14 and 15,
    // the start time field 22.
    let utime: u64 = fields.nth(10)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    let start = fields.nth(6)?.parse().ok()?;
    Some(Stat {
        state,
        start,
        cpu: utime + stime,
    })
}

/// Reads `/proc/<pid>/stat`. This is the hot path (every confirmation and re-check of a
/// held process reads it), so it parses only the two fields it needs, by hand: on the
/// development VM (release build, 20,000 reads of a live process's stat, three runs) it
/// took 11.4-15.5 µs p50, the `procfs` crate's `Process::stat()` (all 52 fields)
/// 13.4-18.9 µs. Everything read once per process (`read_proc`) goes through `procfs`.
pub fn read_stat(pid: u32) -> io::Result<Stat> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    parse_stat(&s).ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "unparsable stat"))
}

/// Where a process sits in the cgroup hierarchies.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cgroups {
    /// The cgroup v2 path (`0::/path`), if the unified hierarchy is mounted.
    pub v2: Option<String>,
    /// cgroup v1 paths by controller (`freezer`, `memory`, `name=systemd`, ...).
    pub v1: BTreeMap<String, String>,
}

impl Cgroups {
    /// Parses `/proc/<pid>/cgroup`: `hierarchy-ID:controller-list:path` per line.
    pub fn parse(s: &str) -> Cgroups {
        let mut c = Cgroups::default();
        for line in s.lines() {
            let mut parts = line.splitn(3, ':');
            let (Some(id), Some(ctrls), Some(path)) = (parts.next(), parts.next(), parts.next())
            else {
                continue;
            };
            if id == "0" && ctrls.is_empty() {
                c.v2 = Some(path.to_string());
            } else {
                for ctrl in ctrls.split(',') {
                    c.v1.insert(ctrl.to_string(), path.to_string());
                }
            }
        }
        c
    }

    /// The path that best identifies the process's container or pod: the v2 path when it
    /// is not the root, else the v1 freezer, memory, cpu or systemd path.
    pub fn primary(&self) -> Option<&str> {
        if let Some(p) = self.v2.as_deref().filter(|p| *p != "/") {
            return Some(p);
        }
        ["freezer", "memory", "cpu", "name=systemd"]
            .iter()
            .find_map(|c| self.v1.get(*c).map(String::as_str))
            .or(self.v2.as_deref())
    }

    /// Every distinct path the process has (for rule matching).
    pub fn paths(&self) -> impl Iterator<Item = &str> {
        let mut v: Vec<&str> = self.v2.iter().map(String::as_str).collect();
        v.extend(self.v1.values().map(String::as_str));
        v.sort_unstable();
        v.dedup();
        v.into_iter()
    }
}

/// Everything the classifier may look at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcInfo {
    /// Identity.
    pub key: ProcKey,
    /// Real UID.
    pub uid: u32,
    /// Resolved `/proc/<pid>/exe`, if readable.
    pub exe: Option<PathBuf>,
    /// Command line, arguments joined by single spaces.
    pub cmdline: String,
    /// cgroup membership.
    pub cgroups: Cgroups,
    /// Its PID in its own (innermost) PID namespace, as the process sees itself (a
    /// container's PID), from `NSpid` in `/proc/<pid>/status`; None when not shown.
    pub ns_pid: Option<u32>,
}

/// A `procfs` error as the `io::Error` the callers match on (a process that is gone is
/// `NotFound`).
fn io_error(e: procfs::ProcError) -> io::Error {
    use procfs::ProcError as P;
    match e {
        P::NotFound(_) => io::Error::new(io::ErrorKind::NotFound, "process gone"),
        P::PermissionDenied(_) => {
            io::Error::new(io::ErrorKind::PermissionDenied, "permission denied")
        }
        P::Io(e, _) => e,
        P::Incomplete(_) => io::Error::new(io::ErrorKind::InvalidData, "incomplete /proc entry"),
        other => io::Error::other(other.to_string()),
    }
}

/// Reads a process's information from `/proc` (once per process: its classification),
/// through the `procfs` crate: `stat` (start time), `status` (real UID, `NSpid`), `exe`,
/// `cmdline`, `cgroup`.
pub fn read_proc(pid: u32) -> io::Result<ProcInfo> {
    let p = procfs::process::Process::new(pid as i32).map_err(io_error)?;
    let start = p.stat().map_err(io_error)?.starttime;
    let status = p.status().map_err(io_error)?;
    let exe = p.exe().ok();
    let cmdline = p
        .cmdline()
        .map(|args| {
            args.into_iter()
                .filter(|a| !a.is_empty())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default();
    let mut cgroups = Cgroups::default();
    for g in p.cgroups().map_err(io_error)? {
        if g.hierarchy == 0 && g.controllers.is_empty() {
            cgroups.v2 = Some(g.pathname);
        } else {
            for ctrl in g.controllers {
                cgroups.v1.insert(ctrl, g.pathname.clone());
            }
        }
    }
    Ok(ProcInfo {
        key: ProcKey { pid, start },
        uid: status.ruid,
        exe,
        cmdline,
        cgroups,
        ns_pid: status
            .nspid
            .and_then(|v| v.last().copied())
            .and_then(|p| u32::try_from(p).ok()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `read_proc` (through the procfs crate) reads what the files say: the cgroup lines
    /// as `Cgroups::parse` reads them, the real UID, the arguments.
    #[test]
    fn read_proc_reads_the_files() {
        let me = read_proc(std::process::id()).unwrap();
        let cg = std::fs::read_to_string("/proc/self/cgroup").unwrap();
        assert_eq!(me.cgroups, Cgroups::parse(&cg));
        assert_eq!(me.uid, rustix::process::getuid().as_raw());
        assert_eq!(me.key.start, read_stat(std::process::id()).unwrap().start);
        assert!(me.cmdline.contains("coloc_agent"), "{}", me.cmdline);
        let gone = read_proc(u32::MAX / 2).unwrap_err();
        assert_eq!(gone.kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn own_pid_in_its_namespace() {
        // The innermost NSpid is the PID the process sees for itself (its shim writes
        // that in its pages), in a container or not.
        let me = read_proc(std::process::id()).unwrap();
        assert_eq!(me.ns_pid, Some(std::process::id()));
    }

    #[test]
    fn stat_with_odd_comm() {
        let s =
            "1234 (a) b (c)) T 1 1234 1234 0 -1 4194560 100 0 0 0 5 3 0 0 20 0 1 0 987654 1000 10";
        assert_eq!(
            parse_stat(s),
            Some(Stat {
                state: 'T',
                start: 987654,
                cpu: 5 + 3,
            })
        );
        let me = read_stat(std::process::id()).unwrap();
        assert!(me.state == 'R' || me.state == 'S');
    }

    #[test]
    fn cgroup_hybrid_and_v2() {
        let hybrid = "9:name=systemd:/\n6:freezer:/coloc/off\n4:memory:/x\n1:cpu,cpuacct:/\n0::/coloc/off2\n";
        let c = Cgroups::parse(hybrid);
        assert_eq!(c.v2.as_deref(), Some("/coloc/off2"));
        assert_eq!(c.v1["freezer"], "/coloc/off");
        assert_eq!(c.v1["cpuacct"], "/");
        assert_eq!(c.primary(), Some("/coloc/off2"));
        let c = Cgroups::parse("6:freezer:/kubepods/pod1\n0::/\n");
        assert_eq!(c.primary(), Some("/kubepods/pod1"));
        let v2 = "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1a2b.slice/cri-containerd-abc.scope\n";
        assert!(Cgroups::parse(v2).primary().unwrap().ends_with("abc.scope"));
    }

    #[test]
    fn pidfd_refuses_a_wrong_start_time() {
        let me = std::process::id();
        let start = read_stat(me).unwrap().start;
        assert!(open_pidfd(ProcKey {
            pid: me,
            start: start + 1
        })
        .is_err());
        assert!(open_pidfd(ProcKey { pid: me, start }).is_ok());
    }

    #[test]
    fn a_pidfd_tells_when_its_process_exits() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let key = ProcKey {
            pid: child.id(),
            start: read_stat(child.id()).unwrap().start,
        };
        let fd = open_pidfd(key).unwrap();
        assert_eq!(HostProc::default().exited(&[(key, &fd)]), vec![false]);
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(HostProc::default().exited(&[(key, &fd)]), vec![true]);
    }

    #[test]
    fn reads_self() {
        let me = read_proc(std::process::id()).unwrap();
        assert!(me.exe.is_some());
        assert!(!me.cmdline.is_empty());
    }

    /// The subtree's members: the cgroup's own and every descendant's; a descendant that
    /// cannot be read is an error, not an empty list.
    #[test]
    fn tree_members_include_every_cgroup_beneath() {
        let root = crate::testutil::TmpDir::new("coloc-tree");
        std::fs::create_dir_all(root.join("a/b")).unwrap();
        std::fs::create_dir_all(root.join("c")).unwrap();
        std::fs::write(root.join("cgroup.procs"), "1\n2\n").unwrap();
        std::fs::write(root.join("a/cgroup.procs"), "3\n").unwrap();
        std::fs::write(root.join("a/b/cgroup.procs"), "4\n").unwrap();
        std::fs::write(root.join("c/cgroup.procs"), "").unwrap();
        let p = HostProc::default();
        let mut got = p.cgroup_tree_members(&root).unwrap();
        got.sort();
        assert_eq!(got, vec![1, 2, 3, 4]);
        assert_eq!(p.cgroup_members(&root).unwrap(), vec![1, 2]);
        std::fs::remove_file(root.join("a/b/cgroup.procs")).unwrap();
        assert!(p.cgroup_tree_members(&root).is_err());
    }
}
