//! Actuators: the only code that stops and restarts processes.
//!
//! - **freezer**: cgroup v2 `cgroup.freeze` (confirmed by `frozen 1` in `cgroup.events`,
//!   waited on with `poll(2)`), or the v1 freezer (`freezer.state` = `FROZEN`, re-read with
//!   a sleeping backoff: v1 offers no notification). Freezes a whole cgroup, so it is used
//!   only on cgroups the pod source declared offline as a whole.
//! - **signal**: `SIGSTOP`/`SIGCONT` through a pidfd opened when the process was first
//!   seen, so a reused PID is never hit; confirmed by the `T` state in `/proc/<pid>/stat`.
//!
//! Every operation is issued for all targets first and confirmed afterwards, so the cost of
//! confirming is paid once per batch, not once per process.
//!
//! May touch: cgroup files under the configured cgroup root, signals to offline processes.

use crate::procinfo::{read_stat, ProcKey};
use serde::{Deserialize, Serialize};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Which actuator the agent uses for offline processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// cgroup freezer (v2 `cgroup.freeze` or v1 freezer) on cgroups declared offline;
    /// processes matched only by exe/cmdline/uid fall back to `signal`.
    Freezer,
    /// SIGSTOP/SIGCONT through pidfds.
    Signal,
}

impl Kind {
    /// Metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Freezer => "freezer",
            Kind::Signal => "signal",
        }
    }
}

/// cgroup hierarchy version of a freezer target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CgroupVersion {
    /// Unified hierarchy (`cgroup.freeze`).
    V2,
    /// v1 freezer controller (`freezer.state`).
    V1,
}

/// Something the agent suspends: a whole cgroup, or one process.
#[derive(Debug, Clone)]
pub enum Target {
    /// A cgroup directory (absolute path on this host).
    Cgroup {
        /// The directory.
        dir: PathBuf,
        /// Its hierarchy.
        version: CgroupVersion,
    },
    /// One process, through its pidfd.
    Process {
        /// Identity.
        key: ProcKey,
        /// pidfd opened when the process was first seen.
        pidfd: Arc<OwnedFd>,
    },
}

impl Target {
    /// The durable description of this target, for the fail-open record.
    pub fn record(&self) -> RecordEntry {
        match self {
            Target::Cgroup { dir, version } => RecordEntry::Cgroup {
                dir: dir.clone(),
                version: *version,
            },
            Target::Process { key, .. } => RecordEntry::Process {
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
        }
    }
}

/// A suspended object as written to the fail-open record.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RecordEntry {
    /// A frozen cgroup.
    Cgroup {
        /// Directory.
        dir: PathBuf,
        /// Hierarchy.
        version: CgroupVersion,
    },
    /// A stopped process (PID plus start time, so a reused PID is recognised).
    Process {
        /// PID.
        pid: u32,
        /// Start time, clock ticks since boot.
        start: u64,
    },
}

/// Why an actuation failed (short, bounded names via [`ActError::reason`]).
#[derive(Debug, thiserror::Error)]
pub enum ActError {
    /// Writing the cgroup control file failed.
    #[error("cannot write {file}: {source}")]
    Write {
        /// The file.
        file: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Sending the signal failed.
    #[error("cannot signal pid {pid}: {source}")]
    Signal {
        /// PID.
        pid: u32,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The new state was not confirmed in time.
    #[error("{what} not confirmed within {timeout:?}")]
    Timeout {
        /// What was waited for.
        what: String,
        /// How long.
        timeout: Duration,
    },
}

impl ActError {
    /// Bounded metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            ActError::Write { .. } => "cgroup_write",
            ActError::Signal { .. } => "signal",
            ActError::Timeout { .. } => "timeout",
        }
    }
}

/// Outcome of one target in a batch.
#[derive(Debug)]
pub enum Outcome {
    /// Confirmed.
    Done,
    /// The process is gone: nothing to suspend or resume.
    Gone,
    /// Failed.
    Failed(ActError),
}

/// Suspend or resume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Stop / freeze.
    Suspend,
    /// Continue / thaw.
    Resume,
}

impl Op {
    /// Metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Op::Suspend => "suspend",
            Op::Resume => "resume",
        }
    }
}

fn control_file(dir: &Path, version: CgroupVersion) -> PathBuf {
    match version {
        CgroupVersion::V2 => dir.join("cgroup.freeze"),
        CgroupVersion::V1 => dir.join("freezer.state"),
    }
}

fn issue(target: &Target, op: Op) -> Result<(), Outcome> {
    match target {
        Target::Cgroup { dir, version } => {
            let file = control_file(dir, *version);
            let value: &[u8] = match (version, op) {
                (CgroupVersion::V2, Op::Suspend) => b"1",
                (CgroupVersion::V2, Op::Resume) => b"0",
                (CgroupVersion::V1, Op::Suspend) => b"FROZEN",
                (CgroupVersion::V1, Op::Resume) => b"THAWED",
            };
            match std::fs::write(&file, value) {
                Ok(()) => Ok(()),
                // The cgroup is gone with its processes: nothing is left frozen.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Outcome::Gone),
                Err(source) => Err(Outcome::Failed(ActError::Write { file, source })),
            }
        }
        Target::Process { key, pidfd } => {
            let sig = match op {
                Op::Suspend => rustix::process::Signal::STOP,
                Op::Resume => rustix::process::Signal::CONT,
            };
            match rustix::process::pidfd_send_signal(pidfd.as_fd(), sig) {
                Ok(()) => Ok(()),
                Err(rustix::io::Errno::SRCH) => Err(Outcome::Gone),
                Err(e) => Err(Outcome::Failed(ActError::Signal {
                    pid: key.pid,
                    source: e.into(),
                })),
            }
        }
    }
}

/// Whether `target` is in the state `op` asks for: `Some(true)` yes, `Some(false)` not
/// yet, `None` gone.
fn confirmed(target: &Target, op: Op) -> Option<bool> {
    match target {
        Target::Cgroup { dir, version } => match version {
            CgroupVersion::V2 => {
                let events = std::fs::read_to_string(dir.join("cgroup.events")).ok()?;
                let frozen = events.lines().any(|l| l.trim() == "frozen 1");
                Some(frozen == (op == Op::Suspend))
            }
            CgroupVersion::V1 => {
                let state = std::fs::read_to_string(dir.join("freezer.state")).ok()?;
                let state = state.trim();
                Some(match op {
                    Op::Suspend => state == "FROZEN",
                    Op::Resume => state == "THAWED",
                })
            }
        },
        Target::Process { key, .. } => {
            let stat = read_stat(key.pid).ok()?;
            if stat.start != key.start || stat.state == 'Z' || stat.state == 'X' {
                return None;
            }
            Some((stat.state == 'T') == (op == Op::Suspend))
        }
    }
}

/// Applies `op` to every target, then waits for every one to be confirmed (or `timeout`).
///
/// cgroup v2 targets are waited on with `ppoll(2)` on `cgroup.events` (the kernel notifies
/// on change; each read through the same descriptor re-arms it); v1 freezers and
/// processes are re-read with a sleeping backoff from 20 µs to 1 ms. Never spins.
pub fn apply(targets: &[Target], op: Op, timeout: Duration) -> Vec<Outcome> {
    use std::os::unix::fs::FileExt;
    let start = Instant::now();
    // v2 event files are opened before the write so that no change is missed.
    let mut events: Vec<Option<std::fs::File>> = targets
        .iter()
        .map(|t| match t {
            Target::Cgroup {
                dir,
                version: CgroupVersion::V2,
            } => std::fs::File::open(dir.join("cgroup.events")).ok(),
            _ => None,
        })
        .collect();
    let mut out: Vec<Option<Outcome>> = targets.iter().map(|t| issue(t, op).err()).collect();
    let mut buf = [0u8; 256];
    let mut backoff = Duration::from_micros(20);
    loop {
        for (i, t) in targets.iter().enumerate() {
            if out[i].is_some() {
                continue;
            }
            let state = match &events[i] {
                // Reading through the polled descriptor re-arms its notification.
                Some(f) => f.read_at(&mut buf, 0).ok().map(|n| {
                    let frozen = std::str::from_utf8(&buf[..n])
                        .map(|s| s.lines().any(|l| l.trim() == "frozen 1"))
                        .unwrap_or(false);
                    frozen == (op == Op::Suspend)
                }),
                None => confirmed(t, op),
            };
            match state {
                Some(true) => out[i] = Some(Outcome::Done),
                Some(false) => {}
                None => out[i] = Some(Outcome::Gone),
            }
        }
        if out.iter().all(Option::is_some) {
            break;
        }
        let elapsed = start.elapsed();
        if elapsed >= timeout {
            for (i, t) in targets.iter().enumerate() {
                if out[i].is_none() {
                    out[i] = Some(Outcome::Failed(ActError::Timeout {
                        what: format!("{} of {}", op.as_str(), describe(t)),
                        timeout,
                    }));
                }
            }
            break;
        }
        for (i, e) in events.iter_mut().enumerate() {
            if out[i].is_some() {
                *e = None;
            }
        }
        let pending_without_events =
            (0..targets.len()).any(|i| out[i].is_none() && events[i].is_none());
        let wait = backoff.min(timeout - elapsed);
        if pending_without_events {
            std::thread::sleep(wait);
        } else {
            let mut fds: Vec<rustix::event::PollFd<'_>> = events
                .iter()
                .flatten()
                .map(|f| rustix::event::PollFd::new(f, rustix::event::PollFlags::PRI))
                .collect();
            // A notification ends the wait early; the bound covers a missed one.
            let ts = rustix::event::Timespec {
                tv_sec: 0,
                tv_nsec: wait.as_nanos().min(999_999_999) as _,
            };
            let _ = rustix::event::poll(&mut fds, Some(&ts));
        }
        backoff = (backoff * 2).min(Duration::from_millis(1));
    }
    out.into_iter()
        .map(|o| o.unwrap_or(Outcome::Done))
        .collect()
}

/// Human description of a target for logs.
pub fn describe(t: &Target) -> String {
    match t {
        Target::Cgroup { dir, version } => format!("cgroup {} ({version:?})", dir.display()),
        Target::Process { key, .. } => format!("pid {}", key.pid),
    }
}

/// Resumes something from the fail-open record (no pidfd survives a restart: the start
/// time is checked instead, right before the signal, so a reused PID is left alone).
pub fn resume_recorded(e: &RecordEntry, timeout: Duration) -> Outcome {
    match e {
        RecordEntry::Cgroup { dir, version } => {
            let t = Target::Cgroup {
                dir: dir.clone(),
                version: *version,
            };
            apply(std::slice::from_ref(&t), Op::Resume, timeout)
                .pop()
                .unwrap_or(Outcome::Done)
        }
        RecordEntry::Process { pid, start } => {
            let key = ProcKey {
                pid: *pid,
                start: *start,
            };
            let Ok(fd) = open_pidfd(key) else {
                return Outcome::Gone;
            };
            let t = Target::Process {
                key,
                pidfd: Arc::new(fd),
            };
            apply(std::slice::from_ref(&t), Op::Resume, timeout)
                .pop()
                .unwrap_or(Outcome::Done)
        }
    }
}

/// Opens a pidfd for `key`, and checks afterwards that the PID still has `key`'s start
/// time: the pidfd then pins exactly that process.
pub fn open_pidfd(key: ProcKey) -> std::io::Result<OwnedFd> {
    let pid = rustix::process::Pid::from_raw(key.pid as i32)
        .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    let fd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty())?;
    match read_stat(key.pid) {
        Ok(s) if s.start == key.start => Ok(fd),
        _ => Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "process replaced",
        )),
    }
}

/// The cgroup mounts of this host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CgroupMounts {
    /// Mount point of the unified (v2) hierarchy, if any.
    pub v2: Option<PathBuf>,
    /// Mount point of the v1 freezer hierarchy, if any.
    pub v1_freezer: Option<PathBuf>,
}

impl CgroupMounts {
    /// Finds the hierarchies under `root` (usually `/sys/fs/cgroup`): pure v2 at the root,
    /// hybrid v2 at `root/unified`, and the v1 freezer at `root/freezer`.
    pub fn detect(root: &Path) -> CgroupMounts {
        let v2 = [root.to_path_buf(), root.join("unified")]
            .into_iter()
            .find(|p| p.join("cgroup.controllers").exists());
        let v1_freezer = Some(root.join("freezer"))
            .filter(|p| p.join("freezer.state").exists() || p.join("tasks").exists());
        CgroupMounts { v2, v1_freezer }
    }

    /// The freezer target for a cgroup given by its path inside a hierarchy. v2 is
    /// preferred when the cgroup exists there and has `cgroup.freeze`.
    pub fn target_for(
        &self,
        v2_path: Option<&str>,
        v1_freezer_path: Option<&str>,
    ) -> Option<Target> {
        if let (Some(mount), Some(p)) = (&self.v2, v2_path) {
            let dir = mount.join(p.trim_start_matches('/'));
            if p != "/" && dir.join("cgroup.freeze").exists() {
                return Some(Target::Cgroup {
                    dir,
                    version: CgroupVersion::V2,
                });
            }
        }
        if let (Some(mount), Some(p)) = (&self.v1_freezer, v1_freezer_path) {
            let dir = mount.join(p.trim_start_matches('/'));
            if p != "/" && dir.join("freezer.state").exists() {
                return Some(Target::Cgroup {
                    dir,
                    version: CgroupVersion::V1,
                });
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signal_stop_and_continue_are_confirmed() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        let key = ProcKey {
            pid,
            start: read_stat(pid).unwrap().start,
        };
        let t = Target::Process {
            key,
            pidfd: Arc::new(open_pidfd(key).unwrap()),
        };
        let r = apply(
            std::slice::from_ref(&t),
            Op::Suspend,
            Duration::from_secs(2),
        );
        assert!(matches!(r[0], Outcome::Done), "{r:?}");
        assert_eq!(read_stat(pid).unwrap().state, 'T');
        let r = apply(std::slice::from_ref(&t), Op::Resume, Duration::from_secs(2));
        assert!(matches!(r[0], Outcome::Done), "{r:?}");
        assert_ne!(read_stat(pid).unwrap().state, 'T');
        child.kill().unwrap();
        child.wait().unwrap();
        // The process is gone (reaped): the pidfd refuses, nothing else is hit.
        let r = apply(
            std::slice::from_ref(&t),
            Op::Suspend,
            Duration::from_secs(1),
        );
        assert!(matches!(r[0], Outcome::Gone), "{r:?}");
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
}
