//! SIGSTOP / SIGCONT through pidfds.
//!
//! May touch: signals to offline processes, only through the pidfd opened when the process
//! was first seen (so a PID reused by another process is never hit).

use super::{ActError, Op, Progress};
use crate::edges::procfs::{read_stat, ProcKey};
use std::os::fd::{AsFd, OwnedFd};

/// Sends the stop or continue signal through the pidfd. `Err(Gone)` when the process
/// the pidfd pins has exited.
pub(super) fn issue(key: ProcKey, pidfd: &OwnedFd, op: Op) -> Result<(), Progress> {
    let sig = match op {
        Op::Suspend => rustix::process::Signal::STOP,
        Op::Resume => rustix::process::Signal::CONT,
    };
    match rustix::process::pidfd_send_signal(pidfd.as_fd(), sig) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::SRCH) => Err(Progress::Gone),
        Err(e) => Err(Progress::Failed(ActError::Signal {
            pid: key.pid,
            source: e.into(),
        })),
    }
}

/// Open `/proc/<pid>/stat` files of the processes being confirmed or held: one `pread`
/// per check instead of open, read and close (a few µs instead of about 15 on a loaded
/// node; the loop checks held processes again and again).
#[derive(Debug, Default)]
pub struct StatCache {
    files: Option<std::collections::HashMap<ProcKey, std::fs::File>>,
    /// The CPU time of each held process when it was last seen stopped (see
    /// [`confirmed`]).
    held_cpu: Option<std::collections::HashMap<ProcKey, u64>>,
}

/// Files kept at most; past that the cache starts afresh.
const STAT_CACHE_MAX: usize = 4096;

impl StatCache {
    /// An empty cache.
    pub const fn new() -> StatCache {
        StatCache {
            files: None,
            held_cpu: None,
        }
    }

    fn read(&mut self, key: ProcKey) -> Option<crate::edges::procfs::Stat> {
        use std::os::unix::fs::FileExt;
        let files = self.files.get_or_insert_with(Default::default);
        if files.len() >= STAT_CACHE_MAX {
            files.clear();
            self.held_cpu = None;
        }
        if let std::collections::hash_map::Entry::Vacant(v) = files.entry(key) {
            v.insert(std::fs::File::open(format!("/proc/{}/stat", key.pid)).ok()?);
        }
        let mut buf = [0u8; 1024];
        let n = files.get(&key)?.read_at(&mut buf, 0);
        match n.ok().and_then(|n| {
            std::str::from_utf8(&buf[..n])
                .ok()
                .and_then(crate::edges::procfs::parse_stat)
        }) {
            Some(s) => Some(s),
            None => {
                // Exited (the read fails with ESRCH), or unreadable: forget the file.
                files.remove(&key);
                None
            }
        }
    }
}

/// Whether the process is in the state `op` asks for (`None`: gone or replaced).
pub(super) fn confirmed(key: ProcKey, op: Op, stats: &mut StatCache) -> Option<bool> {
    let stat = stats.read(key).or_else(|| read_stat(key.pid).ok())?;
    if stat.start != key.start || stat.state == 'X' {
        return None;
    }
    // `t`: stopped under a tracer (e.g. `strace -f`): stopped all the same.
    let is_stopped = |state: char| state == 'T' || state == 't';
    let stopped = if stat.state == 'Z' {
        // The main thread has exited (`pthread_exit`); other threads may run on, and
        // `/proc/<pid>/stat` shows only the leader. Gone only when no thread is left.
        threads_stopped(key.pid)?
    } else {
        is_stopped(stat.state)
    };
    // `/proc/<pid>/stat` shows the main thread's state, but the CPU time of every thread:
    // a process seen stopped whose CPU time grew since it was last seen stopped has a
    // thread that runs (one a tracer resumed after the group stop, for one). It counts as
    // running: stopped again, and its cgroup frozen if it keeps on.
    let held = stats.held_cpu.get_or_insert_with(Default::default);
    let stopped = if op == Op::Suspend && stopped {
        let grew = held
            .insert(key, stat.cpu)
            .is_some_and(|before| stat.cpu > before);
        !grew
    } else {
        held.remove(&key);
        stopped
    };
    Some(stopped == (op == Op::Suspend))
}

/// Threads of a process looked at, at most, when its main thread has exited: a process
/// with more is taken as not stopped (its cgroup is frozen if it stays so).
const MAX_THREADS_READ: usize = 64;

/// Whether every thread of process `pid` that has not exited is stopped; `None` when no
/// thread is left. Stops at the first running one, and after [`MAX_THREADS_READ`].
fn threads_stopped(pid: u32) -> Option<bool> {
    let tasks = match std::fs::read_dir(format!("/proc/{pid}/task")) {
        Ok(t) => t,
        Err(e)
            if e.raw_os_error() == Some(libc::ESRCH)
                || e.kind() == std::io::ErrorKind::NotFound =>
        {
            return None
        }
        // Unreadable: not known to be stopped.
        Err(_) => return Some(false),
    };
    let mut live = 0;
    for t in tasks.flatten() {
        let Some(s) = std::fs::read_to_string(t.path().join("stat"))
            .ok()
            .and_then(|s| crate::edges::procfs::parse_stat(&s))
        else {
            continue;
        };
        if s.state == 'Z' || s.state == 'X' {
            continue;
        }
        live += 1;
        if !(s.state == 'T' || s.state == 't') || live > MAX_THREADS_READ {
            return Some(false);
        }
    }
    (live > 0).then_some(true)
}
