//! `coloc-agent resume`: resumes everything the fail-open record holds, with the code the
//! agent itself uses at start (one function, [`resume_entries`], for both).
//!
//! ```text
//!  --state-dir/suspended.json ─► for each entry: thaw the cgroup / SIGCONT the process
//!        (the same record,          through a pidfd checked against its start time
//!         read by FileRecord)     ─► what was resumed (or is gone) leaves the record;
//!                                    what failed stays, and the exit status is 1
//! ```
//!
//! **It never fights a live agent.** A running agent keeps its suspensions in memory as
//! well as on disk, and stops again whatever it finds resumed; a resume behind its back
//! would be undone at once, and would leave the record without entries the agent still
//! holds. So the agent holds an exclusive lock ([`StateLock`], `flock(2)` on the state
//! directory) for as long as it runs, and `resume` acts only with that lock: while an
//! agent holds it, `resume` says so and leaves the work to that agent, which resumes
//! everything itself when it stops (SIGTERM), or waits for it to exit
//! (`--wait-for-agent`). A killed agent's lock is released by the kernel.
//!
//! `--standby` waits for SIGTERM or SIGINT first: the chart runs it as a sidecar of the
//! agent's pod, which the kubelet terminates only after the agent's container has stopped,
//! so whatever a killed, crash-looping or stuck agent left behind is resumed when the pod
//! is deleted (uninstall, upgrade), even though the agent is not running then.
//!
//! May touch: the state directory (the record, its lock); cgroup freeze files of
//! recorded cgroups; SIGCONT to recorded processes.

use crate::cli::parse_duration;
use crate::edges::actuator::{self, Cell, Progress, RecordEntry};
use crate::edges::record::{FileRecord, RecordStore};
use anyhow::{bail, Context, Result};
use clap::Args;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// `coloc-agent resume`.
#[derive(Args, Debug, Clone)]
pub struct ResumeArgs {
    /// The agent's state directory (`coloc-agent run --state-dir`): the record is
    /// `suspended.json` in it.
    #[arg(long, env = "COLOC_STATE_DIR", default_value = "/run/coloc-agent")]
    pub state_dir: PathBuf,
    /// How long each resume may take to be confirmed (the cgroup reports thawed, the
    /// process leaves the stopped state).
    #[arg(long, env = "COLOC_CONFIRM_TIMEOUT", default_value = "1s", value_parser = parse_duration)]
    pub confirm_timeout: Duration,
    /// While a running agent holds the record, wait this long for it to exit before
    /// leaving the work to it (0s: do not wait).
    #[arg(long, default_value = "0s", value_parser = parse_duration)]
    pub wait_for_agent: Duration,
    /// Where this command sees the host's cgroup filesystem.
    #[arg(long, env = "COLOC_CGROUP_ROOT", default_value = "/sys/fs/cgroup")]
    pub cgroup_root: PathBuf,
    /// Where the agent that wrote the record saw it (its --cgroup-root), when that differs
    /// from --cgroup-root: recorded cgroups under it are looked up under --cgroup-root
    /// instead. The chart's agent writes /host/sys/fs/cgroup/...; on the host itself:
    /// --recorded-cgroup-root /host/sys/fs/cgroup.
    #[arg(long)]
    pub recorded_cgroup_root: Option<PathBuf>,
    /// Do nothing until SIGTERM or SIGINT, then resume (for a container that is stopped
    /// after the agent's: the chart's `resume-guard` sidecar).
    #[arg(long)]
    pub standby: bool,
    /// The CUDA driver library that restores and unlocks what `--driver-lock` and
    /// `--memory-reserve` left locked or checkpointed (loaded only when the record holds
    /// such entries).
    #[arg(long, env = "COLOC_CUDA_LIB", default_value = "libcuda.so.1")]
    pub cuda_lib: String,
    /// How long one call to the CUDA driver (its state, a restore, an unlock) may take
    /// before the entry is given up as failed (it stays recorded): a restore of a whole
    /// GPU's memory takes seconds, and a process stopped by someone else makes the driver
    /// wait for it.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub driver_timeout: Duration,
}

/// The help text's examples and exit statuses.
pub const AFTER_HELP: &str = "\
What it does:
  Reads the agent's fail-open record (<state-dir>/suspended.json), thaws every recorded
  cgroup and continues (SIGCONT) every recorded process that still has its recorded start
  time, through the same code the agent runs at start; then, through the CUDA driver
  (--cuda-lib), restores every process --memory-reserve left checkpointed and unlocks every
  process --driver-lock or a checkpoint left locked (last: the driver restores on a thread
  inside the process, which must run). Removes from the record what it resumed or found
  gone, and prints one line per entry. Running it again does nothing.
  It acts only when no agent is running with that state directory: a running agent holds
  the record, resumes everything itself when it stops (SIGTERM), and would stop again
  whatever was resumed behind its back.

Examples:
  coloc-agent resume                                  # the default state directory
  coloc-agent resume --wait-for-agent 20s             # after `kill -TERM <agent>`
  # the chart's pod, its agent container down (crash-looping): from the sidecar
  kubectl -n gpu-coloc exec <agent pod> -c resume-guard -- coloc-agent resume
  # on the Kubernetes node itself (the chart's agent records /host/sys/fs/cgroup/...):
  coloc-agent resume --recorded-cgroup-root /host/sys/fs/cgroup

Exit status: 0 when nothing recorded is left suspended by an agent that is gone (all
resumed or gone, or a running agent holds the record); 1 when an entry could not be
resumed (it stays recorded) or the record cannot be read.";

/// Exclusive lock on a state directory: held by `coloc-agent run` for its whole life, and
/// by `coloc-agent resume` while it works. `flock(2)` on the directory itself (its inode
/// outlives the record file, which is replaced by rename), released by the kernel when the
/// holder exits, however it exits.
#[derive(Debug)]
pub struct StateLock {
    _dir: File,
}

impl StateLock {
    /// Takes the lock of `dir` (created if missing) if it is free; `None` while another
    /// process holds it.
    pub fn try_acquire(dir: &Path) -> Result<Option<StateLock>> {
        use rustix::fs::{flock, FlockOperation};
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating state directory {}", dir.display()))?;
        let f = File::open(dir).with_context(|| format!("opening {}", dir.display()))?;
        match flock(&f, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => Ok(Some(StateLock { _dir: f })),
            Err(rustix::io::Errno::WOULDBLOCK) => Ok(None),
            Err(e) => Err(std::io::Error::from(e))
                .with_context(|| format!("locking state directory {}", dir.display())),
        }
    }

    /// Takes the lock, waiting up to `wait` for its holder to release it (to exit);
    /// `on_wait` is called once, with the holder's PID when it can be found, if the lock
    /// is held at first. `None` if it is still held after `wait`.
    pub fn acquire_within(
        dir: &Path,
        wait: Duration,
        mut on_wait: impl FnMut(Option<u32>),
    ) -> Result<Option<StateLock>> {
        let until = Instant::now() + wait;
        let mut told = false;
        loop {
            if let Some(l) = StateLock::try_acquire(dir)? {
                return Ok(Some(l));
            }
            if !told {
                on_wait(lock_holder(dir));
                told = true;
            }
            if Instant::now() >= until {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(20).min(until - Instant::now()));
        }
    }

    /// Keeps the lock until the process exits (the agent: released by the kernel when it
    /// exits, even by SIGKILL).
    pub fn hold_until_exit(self) {
        std::mem::forget(self);
    }
}

/// How long `coloc-agent run` waits for another holder of its state directory (an agent
/// still resuming on its way out while its successor starts, or a `resume` at work).
pub const AGENT_LOCK_WAIT: Duration = Duration::from_secs(60);

/// For `coloc-agent run`: takes the state directory's lock for the agent's whole life,
/// waiting (with a log line) for a previous agent or a `resume` that still holds it. Two
/// agents on one state directory would fight over the same processes: after
/// [`AGENT_LOCK_WAIT`], the agent stops with an error that says so.
pub fn lock_for_agent(dir: &Path) -> Result<()> {
    let lock = StateLock::acquire_within(dir, AGENT_LOCK_WAIT, |holder| {
        tracing::warn!(state_dir = %dir.display(), holder = ?holder, "Another process holds the state directory (an agent still stopping, or `coloc-agent resume`): waiting for it");
    })?;
    match lock {
        Some(l) => {
            l.hold_until_exit();
            Ok(())
        }
        None => bail!(
            "another process ({}) has held state directory {} for {:?}: is another agent running \
             with it? Two agents on one node must have their own --state-dir",
            describe_holder(lock_holder(dir)),
            dir.display(),
            AGENT_LOCK_WAIT
        ),
    }
}

fn describe_holder(pid: Option<u32>) -> String {
    pid.map_or_else(|| "PID unknown".to_string(), |p| format!("pid {p}"))
}

/// The PID holding the `flock(2)` of `dir`, from `/proc/locks` (`None` if it cannot be
/// told: not listed, or in another PID namespace).
pub fn lock_holder(dir: &Path) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    let md = std::fs::metadata(dir).ok()?;
    let (maj, min, ino) = (
        rustix::fs::major(md.dev()),
        rustix::fs::minor(md.dev()),
        md.ino(),
    );
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    locks.lines().find_map(|line| {
        // "1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF"; waiters are "1: -> FLOCK …".
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.get(1) != Some(&"FLOCK") {
            return None;
        }
        let pid: u32 = f.get(4)?.parse().ok()?;
        let mut id = f.get(5)?.split(':');
        let m = u32::from_str_radix(id.next()?, 16).ok()?;
        let n = u32::from_str_radix(id.next()?, 16).ok()?;
        let i: u64 = id.next()?.parse().ok()?;
        (m == maj && n == min && i == ino && pid != 0).then_some(pid)
    })
}

/// One entry's result.
#[derive(Debug)]
pub struct Step {
    /// The entry as recorded.
    pub entry: RecordEntry,
    /// What resuming it gave: `Done`, `Gone` or `Failed` (never `Pending`: a resume not
    /// confirmed within the timeout is `Failed`).
    pub progress: Progress,
    /// Removing it from the record failed (it was resumed, but stays recorded).
    pub record_error: Option<String>,
}

/// Resumes `entries` (as recorded in `record`), one by one through
/// [`actuator::resume_recorded`]; those resumed or gone leave the record, those that
/// failed stay. `locate` maps a recorded entry to where this process finds it (cgroup
/// paths seen from another mount namespace). The agent runs this at start on what a
/// previous run left behind; `coloc-agent resume` runs it on the whole record.
pub fn resume_entries(
    record: &mut FileRecord,
    entries: &[RecordEntry],
    timeout: Duration,
    locate: impl Fn(&RecordEntry) -> RecordEntry,
    cuda_lib: &str,
    driver_timeout: Duration,
) -> Vec<Step> {
    // Every stop and freeze first, then what the CUDA driver holds: its restore runs on a
    // thread inside the process, which must run (thaw first). The driver's entries side by
    // side, each bounded by `driver_timeout`: a process its owner keeps stopped makes the
    // driver wait, and delays nothing else.
    let (driver, others): (Vec<&RecordEntry>, Vec<&RecordEntry>) =
        entries.iter().partition(|e| e.driver_process().is_some());
    let mut progress: Vec<(RecordEntry, Progress)> = others
        .into_iter()
        .map(|e| (e.clone(), actuator::resume_recorded(&locate(e), timeout)))
        .collect();
    if !driver.is_empty() {
        let api = crate::edges::checkpoint::CudaCheckpoint::open(cuda_lib)
            .map(|c| {
                std::sync::Arc::new(c) as std::sync::Arc<dyn crate::edges::checkpoint::DriverApi>
            })
            .map_err(|e| format!("--cuda-lib {cuda_lib}: {e}"));
        // One call sequence per process (its lock and checkpoint entries alike).
        let mut keys: Vec<crate::edges::procfs::ProcKey> =
            driver.iter().filter_map(|e| e.driver_process()).collect();
        keys.sort();
        keys.dedup();
        let done: Vec<(crate::edges::procfs::ProcKey, Progress)> = std::thread::scope(|scope| {
            let handles: Vec<_> = keys
                .iter()
                .map(|key| {
                    let api = api.clone();
                    let key = Some(*key);
                    scope.spawn(move || match (api, key) {
                        (Ok(api), Some(key)) => {
                            crate::edges::checkpoint::resume_recorded(api, key, driver_timeout)
                        }
                        (Err(err), _) => Progress::Failed(actuator::ActError::Driver(err)),
                        (_, None) => Progress::Gone,
                    })
                })
                .collect();
            keys.iter()
                .zip(handles)
                .map(|(k, h)| {
                    let p = h.join().unwrap_or_else(|_| {
                        Progress::Failed(actuator::ActError::Driver(
                            "the driver call's thread panicked".into(),
                        ))
                    });
                    (*k, p)
                })
                .collect()
        });
        for e in driver {
            let key = e.driver_process();
            let p = done
                .iter()
                .find(|(k, _)| Some(*k) == key)
                .map_or(Progress::Gone, |(_, p)| match p {
                    Progress::Done => Progress::Done,
                    Progress::Gone => Progress::Gone,
                    Progress::Skipped => Progress::Skipped,
                    Progress::Pending => Progress::Pending,
                    Progress::Failed(err) => {
                        Progress::Failed(actuator::ActError::Driver(err.to_string()))
                    }
                });
            progress.push((e.clone(), p));
        }
    }
    progress
        .into_iter()
        .map(|(e, progress)| {
            let record_error = match progress {
                Progress::Failed(_) => None,
                _ => record
                    .remove(std::slice::from_ref(&e))
                    .err()
                    .map(|err| format!("{err:#}")),
            };
            Step {
                entry: e,
                progress,
                record_error,
            }
        })
        .collect()
}

/// Maps cgroup entries recorded under `from` to `to`.
fn rebase(from: &Path, to: &Path) -> impl Fn(&RecordEntry) -> RecordEntry {
    let (from, to) = (from.to_path_buf(), to.to_path_buf());
    move |e| match e {
        RecordEntry::Cgroup { dir, version, cell } => match dir.strip_prefix(&from) {
            Ok(rest) if from != to => RecordEntry::Cgroup {
                dir: to.join(rest),
                version: *version,
                cell: cell.as_ref().map(|c| Cell {
                    home: c
                        .home
                        .strip_prefix(&from)
                        .map(|h| to.join(h))
                        .unwrap_or_else(|_| c.home.clone()),
                    ..c.clone()
                }),
            },
            _ => e.clone(),
        },
        RecordEntry::Process { .. }
        | RecordEntry::Gate { .. }
        | RecordEntry::Lock { .. }
        | RecordEntry::Checkpoint { .. } => e.clone(),
    }
}

fn describe(e: &RecordEntry) -> String {
    match e {
        RecordEntry::Cgroup {
            dir,
            version,
            cell: None,
        } => format!("cgroup {} ({version:?})", dir.display()),
        RecordEntry::Cgroup {
            dir, cell: Some(c), ..
        } => format!(
            "cell {} of process {} (home {})",
            dir.display(),
            c.pid,
            c.home.display()
        ),
        RecordEntry::Process { pid, start } => format!("process {pid} (start time {start})"),
        RecordEntry::Gate { file, uuid } => format!("launch gate {uuid} in {}", file.display()),
        RecordEntry::Lock { pid, start } => {
            format!("driver lock of process {pid} (start time {start})")
        }
        RecordEntry::Checkpoint { pid, start } => {
            format!("checkpoint of process {pid} (start time {start})")
        }
    }
}

/// `coloc-agent resume`: waits for SIGTERM/SIGINT first with `--standby`.
pub fn run(args: ResumeArgs) -> Result<()> {
    let mut out = std::io::stdout().lock();
    if args.standby {
        let sig = wait_for_termination()?;
        writeln!(
            out,
            "{sig}: resuming what the record at {} still holds",
            args.state_dir.display()
        )?;
    }
    resume(&args, &mut out)
}

/// Blocks until SIGTERM or SIGINT; returns its name.
fn wait_for_termination() -> Result<&'static str> {
    use nix::sys::signal::{SigSet, Signal};
    let mut set = SigSet::empty();
    set.add(Signal::SIGTERM);
    set.add(Signal::SIGINT);
    set.thread_block().context("blocking SIGTERM and SIGINT")?;
    Ok(match set.wait().context("waiting for SIGTERM or SIGINT")? {
        Signal::SIGINT => "SIGINT",
        _ => "SIGTERM",
    })
}

/// Resumes the record in `args.state_dir`, reporting to `out`: see the module
/// documentation.
pub fn resume(args: &ResumeArgs, out: &mut dyn Write) -> Result<()> {
    let dir = &args.state_dir;
    if !dir.join("suspended.json").exists() {
        writeln!(
            out,
            "no record at {}: nothing was suspended by an agent with --state-dir {}",
            dir.join("suspended.json").display(),
            dir.display()
        )?;
        return Ok(());
    }
    let Some(_lock) = StateLock::acquire_within(dir, args.wait_for_agent, |holder| {
        let _ = writeln!(
            out,
            "an agent ({}) holds {}{}",
            describe_holder(holder),
            dir.display(),
            if args.wait_for_agent.is_zero() {
                String::new()
            } else {
                format!("; waiting up to {:?} for it to exit", args.wait_for_agent)
            }
        );
    })?
    else {
        writeln!(
            out,
            "left to the running agent: it resumes everything it holds when it stops (SIGTERM), \
             and would stop again what was resumed behind its back; nothing done"
        )?;
        return Ok(());
    };
    let (mut record, entries) = FileRecord::open(dir)?;
    if entries.is_empty() {
        writeln!(out, "{}: nothing suspended", record.path().display())?;
        return Ok(());
    }
    let recorded = args
        .recorded_cgroup_root
        .clone()
        .unwrap_or_else(|| args.cgroup_root.clone());
    let steps = resume_entries(
        &mut record,
        &entries,
        args.confirm_timeout,
        rebase(&recorded, &args.cgroup_root),
        &args.cuda_lib,
        args.driver_timeout,
    );
    let (mut resumed, mut gone, mut failed) = (0, 0, 0);
    for s in &steps {
        let what = describe(&s.entry);
        match &s.progress {
            Progress::Failed(err) => {
                failed += 1;
                writeln!(out, "FAILED  {what}: {err} (it stays recorded)")?;
            }
            Progress::Gone => {
                gone += 1;
                writeln!(out, "gone    {what}: nothing to resume")?;
            }
            Progress::Skipped => {
                gone += 1;
                writeln!(
                    out,
                    "failed  {what}: the CUDA driver reports the process failed; nothing to restore"
                )?;
            }
            _ => {
                resumed += 1;
                writeln!(out, "resumed {what}")?;
            }
        }
        if let Some(err) = &s.record_error {
            failed += 1;
            writeln!(out, "FAILED  to remove {what} from the record: {err}")?;
        }
    }
    writeln!(
        out,
        "{}: {resumed} resumed, {gone} gone, {failed} failed",
        record.path().display()
    )?;
    if failed > 0 {
        bail!(
            "{failed} recorded entr{} could not be resumed; they stay in {} (see above)",
            if failed == 1 { "y" } else { "ies" },
            record.path().display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests;
