//! The cgroup freezer: v2 `cgroup.freeze` / `cgroup.events`, or v1 `freezer.state`.
//!
//! May touch: `cgroup.freeze` and `freezer.state` of cgroups declared offline.

use super::Op;
pub use crate::control::model::act::CgroupVersion;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

fn control_file(dir: &Path, version: CgroupVersion) -> PathBuf {
    match version {
        CgroupVersion::V2 => dir.join("cgroup.freeze"),
        CgroupVersion::V1 => dir.join("freezer.state"),
    }
}

/// Writes the freeze or thaw request. `Err(Gone)` when the cgroup no longer exists. A
/// cell's process is moved in before its freeze, and moved home after its thaw
/// ([`super::cell`]).
pub(super) fn issue(
    dir: &Path,
    version: CgroupVersion,
    cell: Option<&super::Cell>,
    op: Op,
) -> Result<(), super::Progress> {
    if let (Some(c), Op::Suspend) = (cell, op) {
        super::cell::enter(dir, version, c)?;
    }
    match (cell, op) {
        // Home first (each process thaws as it leaves the frozen cell: it never runs in the
        // cell, outside its home's limits); the empty cell is thawed and removed.
        (Some(c), Op::Resume) => {
            // One that can go nowhere stays frozen in the cell (said in the log).
            super::cell::leave(dir, c)?;
            let _ = write_state(dir, version, op);
            super::cell::remove(dir);
            Ok(())
        }
        _ => write_state(dir, version, op),
    }
}

fn write_state(dir: &Path, version: CgroupVersion, op: Op) -> Result<(), super::Progress> {
    let file = control_file(dir, version);
    let value: &[u8] = match (version, op) {
        (CgroupVersion::V2, Op::Suspend) => b"1",
        (CgroupVersion::V2, Op::Resume) => b"0",
        (CgroupVersion::V1, Op::Suspend) => b"FROZEN",
        (CgroupVersion::V1, Op::Resume) => b"THAWED",
    };
    let name = file
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    match crate::edges::cgroupfs::write(dir, name, value) {
        Ok(()) => Ok(()),
        // The cgroup is gone with its processes: nothing is left frozen.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(super::Progress::Gone),
        Err(source) => Err(super::Progress::Failed(super::ActError::Write {
            file,
            source,
        })),
    }
}

/// Whether the cgroup is in the state `op` asks for (`None`: gone).
pub(super) fn confirmed(dir: &Path, version: CgroupVersion, op: Op) -> Option<bool> {
    match version {
        CgroupVersion::V2 => {
            let events = crate::edges::cgroupfs::read(dir, "cgroup.events").ok()?;
            let frozen = events.lines().any(|l| l.trim() == "frozen 1");
            Some(frozen == (op == Op::Suspend))
        }
        CgroupVersion::V1 => {
            let state = crate::edges::cgroupfs::read(dir, "freezer.state").ok()?;
            let state = state.trim();
            Some(match op {
                Op::Suspend => state == "FROZEN",
                Op::Resume => state == "THAWED",
            })
        }
    }
}

/// `cgroup.events` of every v2 target, opened so that its changes can be polled.
pub(super) fn open_events(targets: &[super::Target]) -> Vec<Option<std::fs::File>> {
    targets
        .iter()
        .map(|t| match t {
            super::Target::Cgroup {
                dir,
                version: CgroupVersion::V2,
                ..
            } => crate::edges::cgroupfs::open(dir, "cgroup.events", false).ok(),
            _ => None,
        })
        .collect()
}

/// Reads `cgroup.events` through the polled descriptor (which re-arms its notification).
pub(super) fn read_events(f: &std::fs::File, op: Op) -> Option<bool> {
    let mut buf = [0u8; 256];
    f.read_at(&mut buf, 0).ok().map(|n| {
        let frozen = std::str::from_utf8(&buf[..n])
            .map(|s| s.lines().any(|l| l.trim() == "frozen 1"))
            .unwrap_or(false);
        frozen == (op == Op::Suspend)
    })
}

/// Waits up to `pause` for a change notification on any of `events`.
pub(super) fn poll_events(events: &[Option<std::fs::File>], pause: Duration) {
    let mut fds: Vec<rustix::event::PollFd<'_>> = events
        .iter()
        .flatten()
        .map(|f| rustix::event::PollFd::new(f, rustix::event::PollFlags::PRI))
        .collect();
    // A notification ends the wait early; the bound covers a missed one.
    let ts = rustix::event::Timespec {
        tv_sec: 0,
        tv_nsec: pause.as_nanos().min(999_999_999) as _,
    };
    let _ = rustix::event::poll(&mut fds, Some(&ts));
}
