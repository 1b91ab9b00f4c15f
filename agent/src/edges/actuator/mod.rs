//! Actuators: the only code that stops and restarts processes.
//!
//! - [`freezer`]: cgroup v2 `cgroup.freeze` (confirmed by `frozen 1` in `cgroup.events`,
//!   waited on with `poll(2)`), or the v1 freezer (`freezer.state` = `FROZEN`). Freezes a
//!   whole cgroup, so it is used only on cgroups the pod source declared offline as a whole.
//! - [`signal`]: `SIGSTOP`/`SIGCONT` through a pidfd opened when the process was first
//!   seen, so a reused PID is never hit; confirmed by the `T` state in `/proc/<pid>/stat`.
//! - [`dry_run`]: logs what it would do and touches nothing.
//!
//! An actuator starts an operation on a batch of targets and waits for confirmation only
//! up to a budget it is given; what is not confirmed by then is reported
//! [`Progress::Pending`] and checked again later with [`Actuator::check`]. The control loop
//! keeps the deadline (`--confirm-timeout`), so one cgroup that never confirms costs the
//! loop at most the budget once, and never stalls the other GPUs.
//!
//! May touch: cgroup freeze files under the cgroup mounts, signals through pidfds.

pub use crate::control::model::act::{ActError, Kind, Op, Progress, RecordEntry};
pub mod cell;
pub mod dry_run;
pub mod freezer;
pub mod signal;

pub use cell::Cell;
pub use freezer::CgroupVersion;

use crate::edges::procfs::ProcKey;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

impl Kind {
    /// Metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Freezer => "freezer",
            Kind::Signal => "signal",
            Kind::Gate => "gate",
            Kind::Lock => "lock",
        }
    }
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
        /// Set for a cell of the agent's own ([`cell`]): the process is moved in before
        /// the freeze, and moved back home after the thaw.
        cell: Option<Cell>,
    },
    /// One process, through its pidfd.
    Process {
        /// Identity.
        key: ProcKey,
        /// pidfd opened when the process was first seen.
        pidfd: Arc<OwnedFd>,
    },
    /// One process's submissions to one GPU, through the launch gate
    /// ([`crate::edges::gate::GateKeeper`]). A closed gate bounds what the process has in
    /// flight; it holds nothing by itself (the hold's fallback does).
    Gate {
        /// The process whose acknowledgement confirms the close.
        key: ProcKey,
        /// The GPU's UUID bytes (the gate file's slot).
        uuid: [u8; 16],
        /// The gate file.
        file: PathBuf,
    },
    /// One process's CUDA calls, blocked by the driver's lock (`cuCheckpointProcessLock`):
    /// held by the controller's driver book, not by an actuator ([`crate::control::driver_book`]).
    Lock {
        /// Identity (checked right before each driver call: the driver takes a bare PID).
        key: ProcKey,
    },
}

impl Target {
    /// The controller's name for this target (a process by its key, without its pidfd).
    pub fn named(&self) -> crate::control::target::Target {
        use crate::control::target::Target as Named;
        match self {
            Target::Cgroup { dir, version, cell } => Named::Cgroup {
                dir: dir.clone(),
                version: *version,
                cell: cell.clone(),
            },
            Target::Process { key, .. } => Named::Process { key: *key },
            Target::Gate { key, uuid, file } => Named::Gate {
                key: *key,
                uuid: *uuid,
                file: file.clone(),
            },
            Target::Lock { key } => Named::Lock { key: *key },
        }
    }

    /// The durable description of this target, for the fail-open record.
    pub fn record(&self) -> RecordEntry {
        self.named().record()
    }

    /// The actuator kind this target uses.
    pub fn kind(&self) -> Kind {
        self.named().kind()
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.named().fmt(f)
    }
}

impl RecordEntry {
    /// The process the CUDA driver may hold, for a lock or checkpoint entry.
    pub fn driver_process(&self) -> Option<ProcKey> {
        match self {
            RecordEntry::Lock { pid, start } | RecordEntry::Checkpoint { pid, start } => {
                Some(ProcKey {
                    pid: *pid,
                    start: *start,
                })
            }
            _ => None,
        }
    }
}

impl ActError {
    /// Bounded metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            ActError::Write { .. } => "cgroup_write",
            ActError::Signal { .. } => "signal",
            ActError::Timeout { .. } => "timeout",
            ActError::NoGate(_) => "no_gate",
            ActError::Driver(_) => "driver",
        }
    }
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

/// Stops and continues targets.
pub trait Actuator: Send {
    /// Starts `op` on every target, then waits up to `budget` for confirmations.
    fn start(&mut self, targets: &[Target], op: Op, budget: Duration) -> Vec<Progress>;
    /// Checks targets started earlier, waiting up to `budget` (zero: look once).
    fn check(&mut self, targets: &[Target], op: Op, budget: Duration) -> Vec<Progress>;
}

/// The host's actuator: the freezer for cgroup targets, signals for process targets, in
/// one batch so that confirming costs one wait, not one per process.
#[derive(Debug, Default)]
pub struct Host {
    /// Open `/proc/<pid>/stat` files of processes being confirmed or held.
    stats: signal::StatCache,
}

impl Actuator for Host {
    fn start(&mut self, targets: &[Target], op: Op, budget: Duration) -> Vec<Progress> {
        let start = Instant::now();
        // v2 event files are opened before the write so that no change is missed.
        let events = freezer::open_events(targets);
        let issued: Vec<Option<Progress>> = targets
            .iter()
            .map(|t| match t {
                Target::Cgroup { dir, version, cell } => {
                    freezer::issue(dir, *version, cell.as_ref(), op).err()
                }
                // SIGCONT ends a stop inside the kill(2) call (the kernel clears the group
                // stop and wakes every thread before returning): a resume that was sent
                // is done, without reading /proc. A SIGSTOP takes effect only when its
                // target next runs, so a suspension is confirmed by reading its state.
                Target::Process { key, pidfd } => match signal::issue(*key, pidfd, op) {
                    Ok(()) if op == Op::Resume => Some(Progress::Done),
                    r => r.err(),
                },
                Target::Gate { .. } => Some(Progress::Failed(ActError::NoGate(t.to_string()))),
                Target::Lock { .. } => Some(Progress::Failed(ActError::Driver(format!(
                    "{t}: held by the controller's driver book, not by an actuator"
                )))),
            })
            .collect();
        wait(targets, op, issued, events, start, budget, &mut self.stats)
    }

    fn check(&mut self, targets: &[Target], op: Op, budget: Duration) -> Vec<Progress> {
        let start = Instant::now();
        let events = freezer::open_events(targets);
        let none = targets.iter().map(|_| None).collect();
        wait(targets, op, none, events, start, budget, &mut self.stats)
    }
}

/// Whether `target` is in the state `op` asks for: `Some(true)` yes, `Some(false)` not
/// yet, `None` gone.
fn confirmed(target: &Target, op: Op, stats: &mut signal::StatCache) -> Option<bool> {
    match target {
        Target::Cgroup { dir, version, .. } => freezer::confirmed(dir, *version, op),
        Target::Process { key, .. } => signal::confirmed(*key, op, stats),
        // Host::start fails these at once; a check has nothing to confirm.
        Target::Gate { .. } | Target::Lock { .. } => None,
    }
}

/// Waits until every target is confirmed, or `budget` has passed since `start`.
///
/// cgroup v2 targets are waited on with `ppoll(2)` on `cgroup.events` (the kernel notifies
/// on change; each read through the same descriptor re-arms it); v1 freezers and
/// processes are re-read with a sleeping backoff from 20 µs to 1 ms. Never spins.
fn wait(
    targets: &[Target],
    op: Op,
    mut out: Vec<Option<Progress>>,
    mut events: Vec<Option<std::fs::File>>,
    start: Instant,
    budget: Duration,
    stats: &mut signal::StatCache,
) -> Vec<Progress> {
    let mut backoff = Duration::from_micros(20);
    loop {
        // Processes stop (or resume) together: while one is not there yet, the ones after
        // it are not read this round (a `/proc/<pid>/stat` read costs 3-15 µs).
        let mut process_waiting = false;
        for (i, t) in targets.iter().enumerate() {
            if out[i].is_some() {
                continue;
            }
            let state = match &events[i] {
                Some(f) => freezer::read_events(f, op),
                None if process_waiting && matches!(t, Target::Process { .. }) => continue,
                None => confirmed(t, op, stats),
            };
            if state == Some(false) && matches!(t, Target::Process { .. }) {
                process_waiting = true;
            }
            match state {
                Some(true) => out[i] = Some(Progress::Done),
                Some(false) => {}
                None => out[i] = Some(Progress::Gone),
            }
        }
        let elapsed = start.elapsed();
        if out.iter().all(Option::is_some) || elapsed >= budget {
            break;
        }
        for (i, e) in events.iter_mut().enumerate() {
            if out[i].is_some() {
                *e = None;
            }
        }
        let pending_without_events =
            (0..targets.len()).any(|i| out[i].is_none() && events[i].is_none());
        let pause = backoff.min(budget - elapsed);
        if pending_without_events {
            std::thread::sleep(pause);
        } else {
            freezer::poll_events(&events, pause);
        }
        backoff = (backoff * 2).min(Duration::from_millis(1));
    }
    out.into_iter()
        .map(|o| o.unwrap_or(Progress::Pending))
        .collect()
}

/// Resumes something from the fail-open record (no pidfd survives a restart: the start
/// time is checked instead, right before the signal, so a reused PID is left alone).
pub fn resume_recorded(e: &RecordEntry, timeout: Duration) -> Progress {
    let t = match e {
        RecordEntry::Cgroup { dir, version, cell } => Target::Cgroup {
            dir: dir.clone(),
            version: *version,
            cell: cell.clone(),
        },
        RecordEntry::Gate { file, uuid } => return crate::edges::gate::open_recorded(file, uuid),
        RecordEntry::Lock { .. } | RecordEntry::Checkpoint { .. } => {
            return Progress::Failed(ActError::Driver(
                "a driver entry is resumed through the CUDA driver (checkpoint::resume_recorded)"
                    .into(),
            ))
        }
        RecordEntry::Process { pid, start } => {
            let key = ProcKey {
                pid: *pid,
                start: *start,
            };
            let Ok(fd) = crate::edges::procfs::open_pidfd(key) else {
                return Progress::Gone;
            };
            Target::Process {
                key,
                pidfd: Arc::new(fd),
            }
        }
    };
    match Host::default()
        .start(std::slice::from_ref(&t), Op::Resume, timeout)
        .pop()
    {
        Some(Progress::Pending) => Progress::Failed(ActError::Timeout {
            what: format!("resume of {t}"),
            timeout,
        }),
        Some(p) => p,
        None => Progress::Done,
    }
}

#[cfg(test)]
mod tests;
