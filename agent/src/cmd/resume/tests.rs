use super::*;
use crate::edges::actuator::CgroupVersion;
use std::process::{Child, Command};

fn tmpdir(name: &str) -> crate::testutil::TmpDir {
    crate::testutil::TmpDir::new(&format!("coloc-resume-{name}"))
}

fn args(dir: &Path) -> ResumeArgs {
    ResumeArgs {
        state_dir: dir.to_path_buf(),
        confirm_timeout: Duration::from_secs(2),
        wait_for_agent: Duration::ZERO,
        cgroup_root: "/sys/fs/cgroup".into(),
        recorded_cgroup_root: None,
        standby: false,
        cuda_lib: "libcuda.so.1".into(),
        driver_timeout: Duration::from_secs(5),
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
}

#[test]
fn the_lock_is_exclusive_and_released_on_drop() {
    let dir = tmpdir("lock");
    let a = StateLock::try_acquire(&dir).unwrap().unwrap();
    assert!(StateLock::try_acquire(&dir).unwrap().is_none());
    assert_eq!(lock_holder(&dir), Some(std::process::id()));
    drop(a);
    assert!(StateLock::try_acquire(&dir).unwrap().is_some());
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
        cell: None,
    };
    record_with(&dir, std::slice::from_ref(&entry));
    let (r, text) = run_resume(&args(&dir));
    let err = format!("{:#}", r.unwrap_err());
    assert!(
        text.contains("FAILED") && err.contains("stay in"),
        "{text}\n{err}"
    );
    assert_eq!(FileRecord::open(&dir).unwrap().1, vec![entry]);
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
        cell: None,
    };
    assert_eq!(
        f(&e),
        RecordEntry::Cgroup {
            dir: "/sys/fs/cgroup/kubepods/pod1/c".into(),
            version: CgroupVersion::V2,
            cell: None,
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
            cell: None,
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
