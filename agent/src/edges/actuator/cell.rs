//! Cells: freezer cgroups of the agent's own, for offline processes whose suspension by
//! signal keeps being undone (a parent that ptrace-attaches and cancels every SIGSTOP, a
//! sibling sending SIGCONT) and that have no cgroup of their own to freeze (matched by
//! uid, cmdline or exe, or a cgroup shared with other work).
//!
//! ```text
//!  <cgroup mount>/gpu-coloc.held/<pid>-<start>    one per held process, made by the agent
//!  enter: mkdir; start time checked; pid written to its cgroup.procs; then frozen
//!  leave: every process in it written back to its home's cgroup.procs (a home removed
//!         meanwhile is made again), each thawing as it leaves; then thawed; rmdir
//! ```
//!
//! A frozen cgroup cannot be thawed by the tenant: only root can write `cgroup.freeze` or
//! move a process between cgroups here, and a ptrace stop does not end a freeze. The cell
//! is recorded (with the process's home) before the process is moved, so a restarted
//! agent moves it home and thaws it like any recorded cgroup. A child the process forks
//! while in the cell lands in the cell, and goes home with it.
//!
//! Leaving the home cgroup for the hold's length moves the process's CPU and pids
//! accounting to the cell (its memory stays charged where it was allocated); a frozen
//! process uses neither.
//!
//! May touch: `<mount>/gpu-coloc.held/`, the held process's home `cgroup.procs`.

use super::{ActError, CgroupVersion, Progress, Target};
use crate::edges::cgroupfs::CgroupMounts;
use crate::edges::procfs::{Cgroups, ProcKey};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The directory, under a cgroup mount, that holds the cells.
pub const CELLS_DIR: &str = "gpu-coloc.held";

/// A cell's process and its home.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Cell {
    /// PID of the process moved in.
    pub pid: u32,
    /// Its start time, clock ticks since boot (a reused PID is never moved).
    pub start: u64,
    /// The cgroup directory it came from, where it goes back.
    pub home: PathBuf,
}

/// Where this host's cells are made: the unified hierarchy if mounted, else the v1
/// freezer hierarchy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cells {
    mount: PathBuf,
    version: CgroupVersion,
}

impl Cells {
    /// The cells of `mounts`, or why there can be none.
    pub fn on(mounts: &CgroupMounts) -> Result<Cells, String> {
        if let Some(m) = &mounts.v2 {
            return Ok(Cells {
                mount: m.clone(),
                version: CgroupVersion::V2,
            });
        }
        if let Some(m) = &mounts.v1_freezer {
            return Ok(Cells {
                mount: m.clone(),
                version: CgroupVersion::V1,
            });
        }
        Err("no cgroup v2 hierarchy and no v1 freezer is mounted".into())
    }

    /// The cell for process `key`, whose cgroups are `cgroups` now: a frozen-cgroup target
    /// that moves it in when it is suspended. Refused when its home is unknown or it is
    /// in a cell already.
    pub fn cell_for(&self, key: ProcKey, cgroups: &Cgroups) -> Result<Target, String> {
        let seen = match self.version {
            CgroupVersion::V2 => cgroups.v2.as_deref(),
            CgroupVersion::V1 => cgroups.v1.get("freezer").map(String::as_str),
        }
        .ok_or_else(|| format!("pid {} has no cgroup in {}", key.pid, self.mount.display()))?;
        let rel = crate::edges::cgroupfs::rebase("/", seen)
            .ok_or_else(|| format!("pid {}: cgroup path {seen:?} is not usable", key.pid))?;
        let rel = rel.trim_start_matches('/');
        if rel == CELLS_DIR || rel.starts_with(&format!("{CELLS_DIR}/")) {
            return Err(format!("pid {} is in a cell already ({seen})", key.pid));
        }
        Ok(Target::Cgroup {
            dir: self
                .mount
                .join(CELLS_DIR)
                .join(format!("{}-{}", key.pid, key.start)),
            version: self.version,
            cell: Some(Cell {
                pid: key.pid,
                start: key.start,
                home: self.mount.join(rel),
            }),
        })
    }
}

fn write_failed(file: PathBuf, source: std::io::Error) -> Progress {
    Progress::Failed(ActError::Write { file, source })
}

/// Makes the cell and moves its process in (not frozen yet). `Err(Gone)` when the process
/// has exited (or its PID is another process's now).
pub(super) fn enter(dir: &Path, version: CgroupVersion, c: &Cell) -> Result<(), Progress> {
    std::fs::create_dir_all(dir).map_err(|e| write_failed(dir.to_path_buf(), e))?;
    let control = match version {
        CgroupVersion::V2 => "cgroup.freeze",
        CgroupVersion::V1 => "freezer.state",
    };
    if !dir.join(control).exists() {
        let _ = std::fs::remove_dir(dir);
        return Err(write_failed(
            dir.join(control),
            std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "the kernel gives this hierarchy no freezer",
            ),
        ));
    }
    match crate::edges::procfs::read_stat(c.pid) {
        Ok(s) if s.start == c.start => {}
        _ => return Err(Progress::Gone),
    }
    match crate::edges::cgroupfs::write(dir, "cgroup.procs", c.pid.to_string().as_bytes()) {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Err(Progress::Gone),
        Err(e) => Err(write_failed(dir.join("cgroup.procs"), e)),
    }
}

/// Moves every process of the cell back to its home (each thaws as it leaves a frozen
/// cgroup). A home removed meanwhile (a tenant may remove its own delegated cgroup once
/// the process is out of it) is made again where it was, so the process goes back under
/// the limits of the cgroups above it rather than staying in the cell. `Err` when a
/// process could not be moved: it stays in the cell, which the caller then thaws.
pub(super) fn leave(dir: &Path, c: &Cell) -> Result<(), Progress> {
    let pids = match crate::edges::cgroupfs::read(dir, "cgroup.procs") {
        Ok(s) => s,
        // Gone with its processes, or removed already: nothing is held there.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(write_failed(dir.join("cgroup.procs"), e)),
    };
    if !pids.trim().is_empty() && !c.home.exists() {
        match std::fs::create_dir_all(&c.home) {
            Ok(()) => tracing::warn!(
                home = %c.home.display(),
                "A held process's cgroup was removed while it was in the agent's cell: made again to move it back"
            ),
            Err(e) => {
                tracing::warn!(home = %c.home.display(), err = %e, "Cannot make a held process's removed cgroup again")
            }
        }
    }
    let mut failed = None;
    for pid in pids.split_whitespace() {
        match crate::edges::cgroupfs::write(&c.home, "cgroup.procs", pid.as_bytes()) {
            Ok(()) => {}
            // Exited meanwhile.
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
            Err(e) => {
                tracing::warn!(
                    pid,
                    home = %c.home.display(),
                    cell = %dir.display(),
                    err = %e,
                    "Cannot move a held process back to its cgroup: it runs on in the agent's cell"
                );
                failed = Some(write_failed(c.home.join("cgroup.procs"), e));
            }
        }
    }
    match failed {
        Some(f) => Err(f),
        None => Ok(()),
    }
}

/// Removes a cell once empty (a cell still holding a process that could not leave stays,
/// thawed, and is said in the log by [`leave`]).
pub(super) fn remove(dir: &Path) {
    let _ = std::fs::remove_dir(dir);
}
