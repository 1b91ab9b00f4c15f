//! Cells: freezer cgroups of the agent's own, for offline processes whose suspension by
//! signal keeps being undone (a parent that ptrace-attaches and cancels every SIGSTOP, a
//! sibling sending SIGCONT) and that have no cgroup of their own to freeze (matched by
//! uid, cmdline or exe, or a cgroup shared with other work).
//!
//! ```text
//!  <cgroup mount>/gpu-coloc.held/<pid>-<start>    one per held process, made by the agent
//!  enter: mkdir; start time checked; pid written to its cgroup.procs; then frozen
//!  leave: every process in it (cgroup.procs, and the thread groups of cgroup.threads)
//!         written back to its home's cgroup.procs (a home removed meanwhile is made
//!         again; else the nearest cgroup above takes it), each thawing as it leaves;
//!         then the empty cell thawed and removed. One that can go nowhere stays frozen
//!         in the cell and recorded, and is tried again by its next hold's release, the
//!         agent's next start or `coloc-agent resume`.
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
pub use crate::control::model::act::Cell;
use crate::edges::cgroupfs::CgroupMounts;
use crate::edges::procfs::{Cgroups, ProcKey};
use std::path::{Path, PathBuf};

/// The directory, under a cgroup mount, that holds the cells.
pub const CELLS_DIR: &str = "gpu-coloc.held";

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
        if rel == CELLS_DIR {
            return Err(format!("pid {} is in the cells' directory itself", key.pid));
        }
        if rel.starts_with(&format!("{CELLS_DIR}/")) {
            // In a cell already (left there by a release that could not move it): that
            // cell is frozen as it is, and thawed in place at the release.
            return Ok(Target::Cgroup {
                dir: self.mount.join(rel),
                version: self.version,
                cell: None,
            });
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

/// The processes in cell `dir`: those `cgroup.procs` lists, and the thread group of
/// every thread `cgroup.threads` lists (a process whose main thread has exited is not in
/// `cgroup.procs`, but its other threads still run there). `None` when the cell is gone.
fn members(dir: &Path) -> Result<Vec<String>, Progress> {
    let procs = match crate::edges::cgroupfs::read(dir, "cgroup.procs") {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(write_failed(dir.join("cgroup.procs"), e)),
    };
    let mut out: Vec<String> = procs.split_whitespace().map(str::to_string).collect();
    let threads = crate::edges::cgroupfs::read(dir, "cgroup.threads").unwrap_or_default();
    for tid in threads.split_whitespace() {
        let tgid = std::fs::read_to_string(format!("/proc/{tid}/status"))
            .ok()
            .and_then(|st| {
                st.lines()
                    .find_map(|l| l.strip_prefix("Tgid:").map(|v| v.trim().to_string()))
            });
        if let Some(tgid) = tgid {
            if !out.contains(&tgid) {
                out.push(tgid);
            }
        }
    }
    Ok(out)
}

/// Where a held process goes back to: its home, made again if removed meanwhile (a
/// tenant may remove its own delegated cgroup once the process is out of it), else the
/// nearest cgroup above it that takes the process (its limits still hold there; the
/// hierarchy's root, which has no `cgroup.freeze` and no limits, is never one).
fn go_home(c: &Cell, pid: &str) -> Result<PathBuf, std::io::Error> {
    if !c.home.exists() {
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
    let mut last = None;
    let mut dir = Some(c.home.as_path());
    while let Some(d) = dir {
        let below_root = d.join("cgroup.freeze").exists() || d.join("freezer.state").exists();
        if !below_root && d != c.home {
            break;
        }
        match crate::edges::cgroupfs::write(d, "cgroup.procs", pid.as_bytes()) {
            Ok(()) => return Ok(d.to_path_buf()),
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => return Err(e),
            Err(e) => last = Some(e),
        }
        dir = d.parent();
    }
    Err(last.unwrap_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound)))
}

/// Moves every process of the cell back to its home (each thaws as it leaves the frozen
/// cell) or, where the home cannot take it, to the nearest cgroup above (see [`go_home`]).
/// `Err` when a process could go nowhere: it stays frozen in the cell, and the caller does
/// not thaw it (thawed there, it would run outside every limit of its home).
pub(super) fn leave(dir: &Path, c: &Cell) -> Result<(), Progress> {
    let mut failed = None;
    for pid in members(dir)? {
        match go_home(c, &pid) {
            Ok(to) if to == c.home => {}
            Ok(to) => tracing::warn!(
                pid,
                home = %c.home.display(),
                to = %to.display(),
                "A held process's cgroup cannot take it back: moved to the nearest cgroup above it"
            ),
            // Exited meanwhile.
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
            Err(e) => {
                tracing::error!(
                    pid,
                    home = %c.home.display(),
                    cell = %dir.display(),
                    err = %e,
                    "Cannot move a held process back to its cgroup or any above it: it stays frozen in the agent's cell, recorded (its next hold's release, the agent's next start or coloc-agent resume try again)"
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
/// frozen, and is said in the log by [`leave`]).
pub(super) fn remove(dir: &Path) {
    let _ = std::fs::remove_dir(dir);
}

/// Removes every empty cell under `mounts` whose process (`<pid>-<start>`) is gone
/// (`rmdir` refuses a populated one, and a live process's cell may be in use); returns how
/// many. Called at start, after the record's leftovers were resumed.
pub fn sweep(mounts: &CgroupMounts) -> usize {
    let Ok(cells) = Cells::on(mounts) else {
        return 0;
    };
    let Ok(rd) = std::fs::read_dir(cells.mount.join(CELLS_DIR)) else {
        return 0;
    };
    let alive = |name: &str| {
        let Some((pid, start)) = name.split_once('-') else {
            return false;
        };
        let (Ok(pid), Ok(start)) = (pid.parse::<u32>(), start.parse::<u64>()) else {
            return false;
        };
        crate::edges::procfs::read_stat(pid).is_ok_and(|s| s.start == start)
    };
    rd.flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter(|e| !alive(&e.file_name().to_string_lossy()))
        .filter(|e| std::fs::remove_dir(e.path()).is_ok())
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cells() -> Cells {
        Cells::on(&CgroupMounts {
            v2: Some("/sys/fs/cgroup".into()),
            v1_freezer: None,
            v1_memory: None,
        })
        .unwrap()
    }

    /// A process is given a cell of its own with its home; one found in a cell already
    /// (left there by a release that could not move it) is frozen there as it is.
    #[test]
    fn a_cell_names_its_home_and_a_process_in_a_cell_is_frozen_there() {
        let key = ProcKey { pid: 5, start: 7 };
        let t = cells()
            .cell_for(key, &Cgroups::parse("0::/user.slice/job\n"))
            .unwrap();
        assert!(
            matches!(&t, Target::Cgroup { dir, cell: Some(c), .. }
                if *dir == Path::new("/sys/fs/cgroup/gpu-coloc.held/5-7")
                    && c.home == Path::new("/sys/fs/cgroup/user.slice/job")
                    && (c.pid, c.start) == (5, 7)),
            "{t:?}"
        );
        let t = cells()
            .cell_for(key, &Cgroups::parse("0::/gpu-coloc.held/5-7\n"))
            .unwrap();
        assert!(
            matches!(&t, Target::Cgroup { dir, cell: None, .. }
                if *dir == Path::new("/sys/fs/cgroup/gpu-coloc.held/5-7")),
            "{t:?}"
        );
        assert!(cells()
            .cell_for(key, &Cgroups::parse("0::/gpu-coloc.held\n"))
            .is_err());
        assert!(
            Cells::on(&CgroupMounts::default()).is_err(),
            "no hierarchy: no cells"
        );
    }
}
