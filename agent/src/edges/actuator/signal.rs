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

/// Whether the process is in the state `op` asks for (`None`: gone or replaced).
pub(super) fn confirmed(key: ProcKey, op: Op) -> Option<bool> {
    let stat = read_stat(key.pid).ok()?;
    if stat.start != key.start || stat.state == 'Z' || stat.state == 'X' {
        return None;
    }
    // `t`: stopped under a tracer (e.g. `strace -f`): stopped all the same.
    let stopped = stat.state == 'T' || stat.state == 't';
    Some(stopped == (op == Op::Suspend))
}
