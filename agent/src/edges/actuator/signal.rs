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
}

/// Files kept at most; past that the cache starts afresh.
const STAT_CACHE_MAX: usize = 4096;

impl StatCache {
    /// An empty cache.
    pub const fn new() -> StatCache {
        StatCache { files: None }
    }

    fn read(&mut self, key: ProcKey) -> Option<crate::edges::procfs::Stat> {
        use std::os::unix::fs::FileExt;
        let files = self.files.get_or_insert_with(Default::default);
        if files.len() >= STAT_CACHE_MAX {
            files.clear();
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
    let stopped = |state: char| state == 'T' || state == 't';
    if stat.state == 'Z' {
        // The main thread has exited (`pthread_exit`); other threads may run on, and
        // `/proc/<pid>/stat` shows only the leader. Gone only when no thread is left.
        let live = live_thread_states(key.pid);
        if live.is_empty() {
            return None;
        }
        return Some(live.iter().all(|s| stopped(*s)) == (op == Op::Suspend));
    }
    Some(stopped(stat.state) == (op == Op::Suspend))
}

/// The states of process `pid`'s threads that have not exited.
fn live_thread_states(pid: u32) -> Vec<char> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("stat")).ok())
        .filter_map(|s| crate::edges::procfs::parse_stat(&s))
        .map(|s| s.state)
        .filter(|s| *s != 'Z' && *s != 'X')
        .collect()
}
