//! The host actuator on real processes (no root needed: the test's own children).
use super::*;
use crate::edges::procfs::{open_pidfd, read_stat};

fn target_of(child: &std::process::Child) -> Target {
    let pid = child.id();
    let key = ProcKey {
        pid,
        start: read_stat(pid).unwrap().start,
    };
    Target::Process {
        key,
        pidfd: Arc::new(open_pidfd(key).unwrap()),
    }
}

#[test]
fn signal_stop_and_continue_are_confirmed() {
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let pid = child.id();
    let t = target_of(&child);
    let budget = Duration::from_secs(2);
    let r = Host::default().start(std::slice::from_ref(&t), Op::Suspend, budget);
    assert!(matches!(r[0], Progress::Done), "{r:?}");
    assert_eq!(read_stat(pid).unwrap().state, 'T');
    let r = Host::default().start(std::slice::from_ref(&t), Op::Resume, budget);
    assert!(matches!(r[0], Progress::Done), "{r:?}");
    assert_ne!(read_stat(pid).unwrap().state, 'T');
    child.kill().unwrap();
    child.wait().unwrap();
    // The process is gone (reaped): the pidfd refuses, nothing else is hit.
    let r = Host::default().start(std::slice::from_ref(&t), Op::Suspend, budget);
    assert!(matches!(r[0], Progress::Gone), "{r:?}");
}

/// The signal goes through the pidfd, never the PID: a target whose pidfd pins a dead
/// process must not stop the live process that now answers to the PID in its key.
#[test]
fn signal_goes_through_the_pidfd_not_the_pid() {
    let mut dead = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let stale = target_of(&dead);
    dead.kill().unwrap();
    dead.wait().unwrap();
    let mut live = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let Target::Process { pidfd, .. } = stale else {
        unreachable!()
    };
    // As if the PID had been reused: the key names the live process, the pidfd the
    // dead one it was opened for.
    let reused = Target::Process {
        key: ProcKey {
            pid: live.id(),
            start: read_stat(live.id()).unwrap().start,
        },
        pidfd,
    };
    let r = Host::default().start(
        std::slice::from_ref(&reused),
        Op::Suspend,
        Duration::from_millis(200),
    );
    let state = read_stat(live.id()).unwrap().state;
    live.kill().unwrap();
    live.wait().unwrap();
    assert!(matches!(r[0], Progress::Gone), "{r:?}");
    assert_ne!(
        state, 'T',
        "the live process with the key's PID was stopped"
    );
}

#[test]
fn unconfirmed_within_the_budget_is_pending_not_failed() {
    // A running process checked for a suspension that was never issued never
    // confirms: the budget bounds the wait, and the answer is "pending".
    let mut child = std::process::Command::new("sh")
        .args(["-c", "exec sleep 30"])
        .spawn()
        .unwrap();
    let t = target_of(&child);
    let Target::Process { key, .. } = &t else {
        unreachable!()
    };
    let t0 = Instant::now();
    let r = Host::default().check(
        std::slice::from_ref(&t),
        Op::Suspend,
        Duration::from_millis(30),
    );
    let took = t0.elapsed();
    assert!(matches!(r[0], Progress::Pending), "{r:?}");
    assert!(
        took >= Duration::from_millis(30) && took < Duration::from_millis(500),
        "{took:?}"
    );
    assert_ne!(read_stat(key.pid).unwrap().state, 'T');
    child.kill().unwrap();
    child.wait().unwrap();
}

/// A process under a tracer (`strace -f`) stops in `t`, not `T`: that is stopped.
#[test]
fn a_traced_process_stopped_in_t_is_confirmed() {
    let strace = ["/usr/bin/strace", "/bin/strace"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .expect("strace is needed for this test (the README's test command installs it)");
    let mut tracer = std::process::Command::new(strace)
        .args(["-f", "-o", "/dev/null", "sleep", "30"])
        .spawn()
        .unwrap();
    // The traced `sleep` is the tracer's child, once it has exec'd and sleeps.
    let t0 = Instant::now();
    let pid = loop {
        let children = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", tracer.id()))
            .unwrap_or_default();
        let child = children
            .split_whitespace()
            .next()
            .and_then(|p| p.parse::<u32>().ok());
        if let Some(p) = child {
            let comm = std::fs::read_to_string(format!("/proc/{p}/comm")).unwrap_or_default();
            if comm.trim() == "sleep" && read_stat(p).is_ok_and(|s| s.state == 'S') {
                break p;
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "no traced child");
        std::thread::sleep(Duration::from_millis(5));
    };
    let key = ProcKey {
        pid,
        start: read_stat(pid).unwrap().start,
    };
    let t = Target::Process {
        key,
        pidfd: Arc::new(open_pidfd(key).unwrap()),
    };
    let mut host = Host::default();
    let r = host.start(
        std::slice::from_ref(&t),
        Op::Suspend,
        Duration::from_secs(2),
    );
    // The tracer relays the stop: the tracee passes through `t` while the tracer decides,
    // may run a moment, then stays in `t`, group-stopped. Until it has settled there, a
    // check may rightly say "not yet"; once it has, the check must say "stopped".
    let t1 = Instant::now();
    let mut seen_t = false;
    let mut again = Vec::new();
    while t1.elapsed() < Duration::from_secs(3) {
        if read_stat(pid).is_ok_and(|s| s.state == 't') {
            seen_t = true;
            again = host.check(std::slice::from_ref(&t), Op::Suspend, Duration::ZERO);
            if matches!(again[0], Progress::Done) && read_stat(pid).is_ok_and(|s| s.state == 't') {
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = host.start(std::slice::from_ref(&t), Op::Resume, Duration::from_secs(2));
    let _ = tracer.kill();
    let _ = tracer.wait();
    let _ = rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid as i32).unwrap(),
        rustix::process::Signal::KILL,
    );
    assert!(seen_t, "the premise: a traced process stops in t");
    assert!(matches!(r[0], Progress::Done), "{r:?}");
    assert!(
        matches!(again[0], Progress::Done),
        "a process stopped in t is not counted as stopped: {again:?}"
    );
}

/// Compiles C program `src` (with `-pthread`) in a scratch directory of its own: (the
/// directory, the executable). The caller removes the directory once it has started it.
fn compile_c(name: &str, src: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("coloc-act-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let c = dir.join(format!("{name}.c"));
    std::fs::write(&c, src).unwrap();
    let exe = dir.join(name);
    let cc = std::process::Command::new("cc")
        .arg("-pthread")
        .arg("-o")
        .arg(&exe)
        .arg(&c)
        .status()
        .expect("cc (the C compiler the Rust toolchain links with) is needed");
    if !cc.success() {
        let _ = std::fs::remove_dir_all(&dir);
        panic!("cc failed on {name}.c");
    }
    (dir, exe)
}

/// A process whose main thread has exited (`pthread_exit`) while its other threads run on
/// reads `Z` in `/proc/<pid>/stat`: it is not gone. Its suspension is confirmed when its
/// live threads are stopped, and a check finds it running again after a SIGCONT (the
/// review's escape: counted gone, never stopped again).
#[test]
fn a_process_whose_main_thread_exited_is_held_not_counted_gone() {
    let (dir, exe) = compile_c(
        "leader",
        "#include <pthread.h>\n#include <unistd.h>\n\
         static void *spin(void *a) { for (;;) usleep(100); return a; }\n\
         int main(void) { pthread_t t; pthread_create(&t, 0, spin, 0); usleep(20000); pthread_exit(0); }\n",
    );
    /// Killed however the test ends (its spinning thread would outlive a failed test).
    struct Reaped(std::process::Child);
    impl Drop for Reaped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut child = Reaped(std::process::Command::new(&exe).spawn().unwrap());
    let _ = std::fs::remove_dir_all(&dir);
    let pid = child.0.id();
    let t = target_of(&child.0);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while read_stat(pid).unwrap().state != 'Z' {
        assert!(
            std::time::Instant::now() < deadline,
            "the main thread never exited"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let threads = || {
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .flatten()
            .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
            .filter_map(|s| crate::edges::procfs::parse_stat(&s))
            .map(|s| s.state)
            .collect::<Vec<char>>()
    };
    let budget = Duration::from_secs(2);
    let r = Host::default().start(std::slice::from_ref(&t), Op::Suspend, budget);
    assert!(
        matches!(r[0], Progress::Done),
        "{r:?}: threads {:?}",
        threads()
    );
    assert!(threads().iter().filter(|s| **s != 'Z').all(|s| *s == 'T'));
    // Someone sends SIGCONT: a check finds it running (pending), not gone.
    // SAFETY: a plain kill(2) of our own child.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGCONT) }, 0);
    std::thread::sleep(Duration::from_millis(20));
    let r = Host::default().check(std::slice::from_ref(&t), Op::Suspend, Duration::ZERO);
    assert!(
        matches!(r[0], Progress::Pending),
        "{r:?}: threads {:?}",
        threads()
    );
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    let r = Host::default().check(std::slice::from_ref(&t), Op::Suspend, Duration::ZERO);
    assert!(matches!(r[0], Progress::Gone), "{r:?}");
}

/// A tracer resumes one thread of a stopped process (`PTRACE_SEIZE` on the worker thread,
/// `PTRACE_CONT` at its group stop): the main thread reads `T`, the worker runs on (the
/// review's escape: a counter advanced 194 million times in 100 ms while held). The
/// process's CPU time, which counts every thread, keeps growing: a check finds it running.
#[test]
fn a_thread_a_tracer_resumed_is_found_running() {
    let (dir, exe) = compile_c("escape", ESCAPE_C);
    /// The tracer and its traced child, killed however the test ends.
    struct Pair(std::process::Child, u32);
    impl Drop for Pair {
        fn drop(&mut self) {
            if self.1 != 0 {
                // SAFETY: a plain kill(2) of the test's own grandchild; the tracer reaps
                // it and exits.
                unsafe { libc::kill(self.1 as i32, libc::SIGKILL) };
            } else {
                let _ = self.0.kill();
            }
            let _ = self.0.wait();
        }
    }
    let mut pair = Pair(
        std::process::Command::new(&exe)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
        0,
    );
    let _ = std::fs::remove_dir_all(&dir);
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(pair.0.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let pid: u32 = line
        .trim()
        .parse()
        .expect("the tracer could not seize the thread");
    pair.1 = pid;
    let key = ProcKey {
        pid,
        start: read_stat(pid).unwrap().start,
    };
    let t = Target::Process {
        key,
        pidfd: Arc::new(open_pidfd(key).unwrap()),
    };
    let mut host = Host::default();
    let _ = host.start(
        std::slice::from_ref(&t),
        Op::Suspend,
        Duration::from_millis(50),
    );
    let mut seen = Vec::new();
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(60));
        let main = read_stat(pid).unwrap().state;
        let r = host.check(std::slice::from_ref(&t), Op::Suspend, Duration::ZERO);
        seen.push((main, matches!(r[0], Progress::Done)));
    }
    assert!(
        seen.iter().any(|(main, _)| *main == 'T'),
        "the main thread never stopped: the attack was not tried: {seen:?}"
    );
    assert!(
        !seen[1].1 && !seen[2].1,
        "held while a thread ran on (main thread state, confirmed): {seen:?}"
    );
}

/// A process whose worker thread a tracer keeps running through every stop.
const ESCAPE_C: &str = r#"
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <sys/ptrace.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
static volatile int tid;
static void *spin(void *a) { tid = syscall(SYS_gettid); for (;;) { } return a; }
int main(void) {
    int p[2];
    if (pipe(p)) return 1;
    pid_t child = fork();
    if (child == 0) {
        pthread_t t;
        pthread_create(&t, 0, spin, 0);
        while (!tid) usleep(100);
        int v = tid;
        if (write(p[1], &v, sizeof v) != sizeof v) return 1;
        for (;;) pause();
    }
    int wt;
    if (read(p[0], &wt, sizeof wt) != sizeof wt) return 1;
    if (ptrace(PTRACE_SEIZE, wt, 0, 0) != 0) { perror("seize"); return 1; }
    printf("%d\n", child);
    fflush(stdout);
    for (;;) {
        int st;
        /* The child killed: reap it before leaving (nothing is left a zombie). */
        if (waitpid(wt, &st, __WALL) < 0 || WIFEXITED(st) || WIFSIGNALED(st)) {
            waitpid(child, 0, 0);
            return 0;
        }
        if (WIFSTOPPED(st)) {
            int sig = WSTOPSIG(st);
            if ((st >> 16) == PTRACE_EVENT_STOP || sig == SIGSTOP) ptrace(PTRACE_CONT, wt, 0, 0);
            else ptrace(PTRACE_CONT, wt, 0, sig);
        }
    }
}
"#;

/// Attack (root, cgroup v2): a process whose main thread has exited (`pthread_exit`)
/// while a worker thread runs on is moved into a cell, frozen, then released. Moving its
/// PID into the cell moves the live threads, but the exited leader stays behind, so the
/// cell's `cgroup.procs` lists nothing: the release moves nothing home, thaws the cell and
/// cannot remove it. The worker must not be left running in the agent's cell, outside its
/// home's limits.
#[test]
fn a_process_whose_main_thread_exited_goes_home_from_its_cell() {
    let mount = ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
        .iter()
        .map(std::path::PathBuf::from)
        .find(|p| p.join("cgroup.controllers").exists())
        .expect("this test needs cgroup v2 (at /sys/fs/cgroup or /sys/fs/cgroup/unified)");
    let (dir, exe) = compile_c(
        "cellleader",
        "#include <pthread.h>\n#include <unistd.h>\n\
         static void *spin(void *a) { for (;;) usleep(100); return a; }\n\
         int main(void) { pthread_t t; pthread_create(&t, 0, spin, 0); usleep(20000); pthread_exit(0); }\n",
    );
    let home = mount.join(format!("coloc-act-cellhome-{}", std::process::id()));
    std::fs::create_dir_all(&home).unwrap();
    /// Killed, and its cgroups removed, however the test ends.
    struct Reaped(std::process::Child, Vec<std::path::PathBuf>);
    impl Drop for Reaped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
            for d in &self.1 {
                let _ = std::fs::write(d.join("cgroup.freeze"), "0");
                for _ in 0..50 {
                    if std::fs::remove_dir(d).is_ok() || !d.exists() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    }
    let mut cmd = std::process::Command::new(&exe);
    let procs = home.join("cgroup.procs");
    // SAFETY: only a write(2) of the child's own PID into a cgroup file, before exec.
    unsafe {
        use std::os::unix::process::CommandExt;
        let procs = std::ffi::CString::new(procs.to_str().unwrap()).unwrap();
        cmd.pre_exec(move || {
            let fd = libc::open(procs.as_ptr(), libc::O_WRONLY);
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let s = format!("{}", libc::getpid());
            let n = libc::write(fd, s.as_ptr().cast(), s.len());
            libc::close(fd);
            if n < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().unwrap();
    let pid = child.id();
    let start = read_stat(pid).unwrap().start;
    let cell_dir = mount.join(cell::CELLS_DIR).join(format!("{pid}-{start}"));
    let mut child = Reaped(child, vec![cell_dir.clone(), home.clone()]);
    let _ = std::fs::remove_dir_all(&dir);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while read_stat(pid).unwrap().state != 'Z' {
        assert!(
            std::time::Instant::now() < deadline,
            "the main thread never exited"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let t = Target::Cgroup {
        dir: cell_dir.clone(),
        version: CgroupVersion::V2,
        cell: Some(Cell {
            pid,
            start,
            home: home.clone(),
        }),
    };
    let where_threads = || {
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .flatten()
            .map(|e| {
                let state = std::fs::read_to_string(e.path().join("stat"))
                    .ok()
                    .and_then(|s| crate::edges::procfs::parse_stat(&s))
                    .map(|s| s.state);
                let cg = std::fs::read_to_string(e.path().join("cgroup")).unwrap_or_default();
                (
                    e.file_name().to_string_lossy().into_owned(),
                    state,
                    cg.trim().to_string(),
                )
            })
            .collect::<Vec<_>>()
    };
    let budget = Duration::from_secs(2);
    let r = Host::default().start(std::slice::from_ref(&t), Op::Suspend, budget);
    assert!(
        matches!(r[0], Progress::Done),
        "{r:?}: {:?}",
        where_threads()
    );
    let r = Host::default().start(std::slice::from_ref(&t), Op::Resume, budget);
    let threads = where_threads();
    assert!(
        !cell_dir.exists()
            && threads
                .iter()
                .all(|(_, _, cg)| !cg.contains(cell::CELLS_DIR)),
        "released ({r:?}), a thread runs on in the agent's cell {} (cell left: {}): {threads:?}",
        cell_dir.display(),
        cell_dir.exists()
    );
    child.0.kill().unwrap();
    child.0.wait().unwrap();
}
