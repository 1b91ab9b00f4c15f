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
use crate::edges::actuator::{self, Progress, RecordEntry};
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
}

/// The help text's examples and exit statuses.
pub const AFTER_HELP: &str = "\
What it does:
  Reads the agent's fail-open record (<state-dir>/suspended.json), thaws every recorded
  cgroup and continues (SIGCONT) every recorded process that still has its recorded start
  time, through the same code the agent runs at start; removes from the record what it
  resumed or found gone, and prints one line per entry. Running it again does nothing.
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
) -> Vec<Step> {
    entries
        .iter()
        .map(|e| {
            let progress = actuator::resume_recorded(&locate(e), timeout);
            let record_error = match progress {
                Progress::Failed(_) => None,
                _ => record
                    .remove(std::slice::from_ref(e))
                    .err()
                    .map(|err| format!("{err:#}")),
            };
            Step {
                entry: e.clone(),
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
        RecordEntry::Cgroup { dir, version } => match dir.strip_prefix(&from) {
            Ok(rest) if from != to => RecordEntry::Cgroup {
                dir: to.join(rest),
                version: *version,
            },
            _ => e.clone(),
        },
        RecordEntry::Process { .. } => e.clone(),
    }
}

fn describe(e: &RecordEntry) -> String {
    match e {
        RecordEntry::Cgroup { dir, version } => format!("cgroup {} ({version:?})", dir.display()),
        RecordEntry::Process { pid, start } => format!("process {pid} (start time {start})"),
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
mod tests {
    use super::*;
    use crate::edges::actuator::CgroupVersion;
    use std::process::{Child, Command};

    fn tmpdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("coloc-resume-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn args(dir: &Path) -> ResumeArgs {
        ResumeArgs {
            state_dir: dir.to_path_buf(),
            confirm_timeout: Duration::from_secs(2),
            wait_for_agent: Duration::ZERO,
            cgroup_root: "/sys/fs/cgroup".into(),
            recorded_cgroup_root: None,
            standby: false,
        }
    }

    fn state(pid: u32) -> char {
        crate::edges::procfs::read_stat(pid).unwrap().state
    }

    fn start_time(pid: u32) -> u64 {
        crate::edges::procfs::read_stat(pid).unwrap().start
    }

    struct Kid(Child);
    impl Drop for Kid {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// A child process stopped with SIGSTOP, as the signal actuator leaves it.
    fn stopped_child() -> Kid {
        let kid = Kid(Command::new("sleep").arg("30").spawn().unwrap());
        let pid = kid.0.id();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGSTOP,
        )
        .unwrap();
        let t = Instant::now();
        while state(pid) != 'T' {
            assert!(t.elapsed() < Duration::from_secs(5), "child never stopped");
            std::thread::sleep(Duration::from_millis(5));
        }
        kid
    }

    fn record_with(dir: &Path, entries: &[RecordEntry]) {
        let (mut r, _) = FileRecord::open(dir).unwrap();
        r.add(entries).unwrap();
    }

    fn run_resume(a: &ResumeArgs) -> (Result<()>, String) {
        let mut out = Vec::new();
        let r = resume(a, &mut out);
        (r, String::from_utf8(out).unwrap())
    }

    /// What a killed agent left behind is resumed, the record emptied, and a second run
    /// finds nothing to do.
    #[test]
    fn resumes_a_recorded_process_once_and_empties_the_record() {
        let dir = tmpdir("process");
        let kid = stopped_child();
        let pid = kid.0.id();
        let gone = RecordEntry::Process {
            pid,
            start: start_time(pid) + 1, // the PID with another start time: not this process
        };
        let entry = RecordEntry::Process {
            pid,
            start: start_time(pid),
        };
        record_with(&dir, &[entry.clone(), gone]);
        let (r, text) = run_resume(&args(&dir));
        assert!(r.is_ok(), "{text}");
        assert_ne!(
            state(pid),
            'T',
            "the recorded process is still stopped:\n{text}"
        );
        assert!(
            text.contains(&format!("resumed process {pid}"))
                && text.contains("1 resumed, 1 gone, 0 failed"),
            "{text}"
        );
        let (_, left) = FileRecord::open(&dir).unwrap();
        assert!(left.is_empty(), "{left:?}");
        // Idempotent.
        let (r, text) = run_resume(&args(&dir));
        assert!(r.is_ok() && text.contains("nothing suspended"), "{text}");
        std::fs::remove_dir_all(&dir).ok();
    }

    /// A PID reused by another process is never continued: the entry is gone.
    #[test]
    fn a_reused_pid_is_not_continued() {
        let dir = tmpdir("reused");
        let kid = stopped_child();
        let pid = kid.0.id();
        record_with(
            &dir,
            &[RecordEntry::Process {
                pid,
                start: start_time(pid).saturating_sub(1),
            }],
        );
        let (r, text) = run_resume(&args(&dir));
        assert!(r.is_ok() && text.contains("gone"), "{text}");
        assert_eq!(
            state(pid),
            'T',
            "a process the record does not name was continued"
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    /// While an agent holds the state directory, nothing is touched and the record stays.
    #[test]
    fn a_running_agent_is_left_alone() {
        let dir = tmpdir("held");
        let kid = stopped_child();
        let pid = kid.0.id();
        let entry = RecordEntry::Process {
            pid,
            start: start_time(pid),
        };
        record_with(&dir, std::slice::from_ref(&entry));
        let agent = StateLock::try_acquire(&dir)
            .unwrap()
            .expect("lock free at first");
        let (r, text) = run_resume(&args(&dir));
        assert!(r.is_ok(), "{text}");
        assert!(
            text.contains(&format!("pid {}", std::process::id()))
                && text.contains("left to the running agent"),
            "{text}"
        );
        assert_eq!(state(pid), 'T', "resumed behind a running agent's back");
        assert_eq!(FileRecord::open(&dir).unwrap().1, vec![entry.clone()]);
        // Waiting for it: it exits (drops the lock) within the wait, then resume acts.
        let a = ResumeArgs {
            wait_for_agent: Duration::from_secs(5),
            ..args(&dir)
        };
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            drop(agent);
        });
        let (r, text) = run_resume(&a);
        release.join().unwrap();
        assert!(r.is_ok() && text.contains("waiting up to"), "{text}");
        assert!(text.contains("1 resumed"), "{text}");
        assert_ne!(state(pid), 'T');
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn the_lock_is_exclusive_and_released_on_drop() {
        let dir = tmpdir("lock");
        let a = StateLock::try_acquire(&dir).unwrap().unwrap();
        assert!(StateLock::try_acquire(&dir).unwrap().is_none());
        assert_eq!(lock_holder(&dir), Some(std::process::id()));
        drop(a);
        assert!(StateLock::try_acquire(&dir).unwrap().is_some());
        std::fs::remove_dir_all(&dir).ok();
    }

    /// What cannot be resumed stays recorded and makes the exit status 1.
    #[test]
    fn a_failure_stays_recorded_and_fails_the_command() {
        let dir = tmpdir("fail");
        // A "cgroup" whose freeze file cannot be written (a directory in its place).
        let fake = dir.join("not-a-cgroup");
        std::fs::create_dir_all(fake.join("cgroup.freeze")).unwrap();
        let entry = RecordEntry::Cgroup {
            dir: fake,
            version: CgroupVersion::V2,
        };
        record_with(&dir, std::slice::from_ref(&entry));
        let (r, text) = run_resume(&args(&dir));
        let err = format!("{:#}", r.unwrap_err());
        assert!(
            text.contains("FAILED") && err.contains("stay in"),
            "{text}\n{err}"
        );
        assert_eq!(FileRecord::open(&dir).unwrap().1, vec![entry]);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn cgroups_recorded_in_another_mount_namespace_are_rebased() {
        let f = rebase(
            Path::new("/host/sys/fs/cgroup"),
            Path::new("/sys/fs/cgroup"),
        );
        let e = RecordEntry::Cgroup {
            dir: "/host/sys/fs/cgroup/kubepods/pod1/c".into(),
            version: CgroupVersion::V2,
        };
        assert_eq!(
            f(&e),
            RecordEntry::Cgroup {
                dir: "/sys/fs/cgroup/kubepods/pod1/c".into(),
                version: CgroupVersion::V2,
            }
        );
        let p = RecordEntry::Process { pid: 1, start: 2 };
        assert_eq!(f(&p), p);
    }

    /// Real frozen cgroups are thawed: v2 (at the root, or hybrid `unified/`) and the v1
    /// freezer, whichever this host has (root only).
    #[test]
    fn thaws_recorded_cgroups() {
        let root = Path::new("/sys/fs/cgroup");
        let name = format!("coloc-resume-test-{}", std::process::id());
        let mut cases = Vec::new();
        for (base, version, file, frozen, thawed) in [
            (
                root.to_path_buf(),
                CgroupVersion::V2,
                "cgroup.freeze",
                "1",
                "0",
            ),
            (
                root.join("unified"),
                CgroupVersion::V2,
                "cgroup.freeze",
                "1",
                "0",
            ),
            (
                root.join("freezer"),
                CgroupVersion::V1,
                "freezer.state",
                "FROZEN",
                "THAWED",
            ),
        ] {
            let marker = if version == CgroupVersion::V2 {
                "cgroup.controllers"
            } else {
                "tasks"
            };
            let dir = base.join(&name);
            if !base.join(marker).exists() {
                continue;
            }
            if std::fs::create_dir(&dir).is_err() {
                continue;
            }
            if std::fs::write(dir.join(file), frozen).is_err() {
                std::fs::remove_dir(&dir).ok();
                continue;
            }
            cases.push((dir, version, file, thawed));
        }
        if cases.is_empty() {
            eprintln!("skipped: needs root and a writable cgroup hierarchy with a freezer");
            return;
        }
        let state = tmpdir("cgroup");
        let entries: Vec<RecordEntry> = cases
            .iter()
            .map(|(dir, version, ..)| RecordEntry::Cgroup {
                dir: dir.clone(),
                version: *version,
            })
            .collect();
        record_with(&state, &entries);
        let (r, text) = run_resume(&args(&state));
        let after: Vec<String> = cases
            .iter()
            .map(|(dir, _, file, _)| std::fs::read_to_string(dir.join(file)).unwrap_or_default())
            .collect();
        for (dir, ..) in &cases {
            std::fs::remove_dir(dir).ok();
        }
        assert!(r.is_ok(), "{text}");
        for ((dir, _, _, thawed), got) in cases.iter().zip(&after) {
            assert_eq!(got.trim(), *thawed, "{} not thawed:\n{text}", dir.display());
        }
        assert!(text.contains(&format!("{} resumed", cases.len())), "{text}");
        std::fs::remove_dir_all(&state).ok();
    }

    #[test]
    fn help_teaches() {
        use clap::CommandFactory;
        let mut cmd = crate::cli::Cli::command();
        let help = cmd
            .find_subcommand_mut("resume")
            .expect("a resume subcommand")
            .render_long_help()
            .to_string();
        for needle in [
            "--state-dir",
            "--wait-for-agent",
            "--standby",
            "--recorded-cgroup-root",
            "Exit status",
            "SIGTERM",
        ] {
            assert!(help.contains(needle), "{needle} missing from:\n{help}");
        }
    }
}
