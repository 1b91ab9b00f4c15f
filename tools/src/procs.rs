//! Child processes that never outlive their test or tool: continued and killed on drop,
//! waited for with a bound.

use crate::thaw_cgroups_of;
use anyhow::{bail, Result};
use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A child process that is continued and killed on drop (never left stopped).
#[derive(Debug)]
pub struct Proc(pub Child);

impl Proc {
    /// PID.
    pub fn pid(&self) -> u32 {
        self.0.id()
    }
    /// Run state letter from /proc (None once gone).
    pub fn state(&self) -> Option<char> {
        proc_state(self.pid())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(Some(_))) {
            return;
        }
        let pid = self.0.id();
        // A frozen process does not die of SIGKILL under the v1 freezer (and waiting on it
        // would hang the test until the outer timeout): thaw whatever froze it first.
        thaw_cgroups_of(pid);
        // SAFETY: plain kill(2) on our own child.
        unsafe {
            libc::kill(pid as i32, libc::SIGCONT);
            libc::kill(pid as i32, libc::SIGKILL);
        }
        if let Err(e) = reap_within(&mut self.0, Duration::from_secs(5)) {
            eprintln!("WARNING: test child {pid} left behind: {e}");
        }
    }
}

impl Proc {
    /// Waits for the process to exit by itself, at most `timeout`; panics (the process is
    /// then killed by drop) when it does not.
    pub fn wait_within(&mut self, what: &str, timeout: Duration) -> std::process::ExitStatus {
        let t = Instant::now();
        loop {
            match self.0.try_wait() {
                Ok(Some(st)) => return st,
                Ok(None) if t.elapsed() < timeout => std::thread::sleep(Duration::from_millis(2)),
                Ok(None) => panic!(
                    "{what}: pid {} still running after {timeout:?} (state {:?})",
                    self.pid(),
                    self.state()
                ),
                Err(e) => panic!("{what}: waiting for pid {}: {e}", self.pid()),
            }
        }
    }
}

/// Polls `child` until it has exited, at most `timeout`.
pub(crate) fn reap_within(
    child: &mut Child,
    timeout: Duration,
) -> Result<std::process::ExitStatus> {
    let t = Instant::now();
    loop {
        if let Some(st) = child.try_wait()? {
            return Ok(st);
        }
        if t.elapsed() >= timeout {
            bail!(
                "still there after {timeout:?} (state {:?})",
                proc_state(child.id())
            );
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Runs `cmd` to completion with captured output, at most `timeout`; kills it and panics
/// (with what it printed so far) when it takes longer.
pub fn output_within(cmd: &mut Command, timeout: Duration) -> std::process::Output {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let out_t = std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = out.read_to_end(&mut b);
        b
    });
    let err_t = std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = err.read_to_end(&mut b);
        b
    });
    let status = match reap_within(&mut child, timeout) {
        Ok(st) => st,
        Err(e) => {
            let _ = child.kill();
            let _ = reap_within(&mut child, Duration::from_secs(5));
            let (o, r) = (
                out_t.join().unwrap_or_default(),
                err_t.join().unwrap_or_default(),
            );
            panic!(
                "{cmd:?}: {e}\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&o),
                String::from_utf8_lossy(&r)
            );
        }
    };
    std::process::Output {
        status,
        stdout: out_t.join().unwrap_or_default(),
        stderr: err_t.join().unwrap_or_default(),
    }
}

/// Run state letter of a PID (`R`, `S`, `T`, ...).
pub fn proc_state(pid: u32) -> Option<char> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    s[s.rfind(')')? + 1..].trim_start().chars().next()
}
