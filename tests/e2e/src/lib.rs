//! # coloc-e2e — end-to-end test harness
//!
//! Real processes, real signals, real cgroups; only the GPU is simulated (`coloc-sim gpu`
//! plus `libfake_nvml.so` loaded by the real agent). Binaries come from the same cargo
//! target directory as the test executable, so run `cargo build --workspace` first (the
//! README's test command does).

pub mod agent_tests;
pub mod fakeapi;

use anyhow::{bail, Context, Result};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A binary from the target directory (`target/<profile>/`).
pub fn bin(name: &str) -> PathBuf {
    // Tests live in target/<profile>/deps/, binaries (coloc-bench too) in target/<profile>/.
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().expect("exe dir");
    let dir = if dir.ends_with("deps") {
        dir.parent().expect("target dir")
    } else {
        dir
    };
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} missing: run `cargo build --workspace` before the end-to-end tests",
        p.display()
    );
    p
}

/// A unique name for this test process.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::SeqCst)
    )
}

/// The directory of the simulated `libcuda.so.1` (for `LD_LIBRARY_PATH`).
pub fn fake_cuda() -> PathBuf {
    let profile = bin("coloc-sim").parent().unwrap().to_path_buf();
    coloc_sim::fake_libcuda_dir(&profile).expect("fake libcuda dir")
}

/// A running simulated GPU daemon; killed and cleaned up on drop.
#[derive(Debug)]
pub struct Sim {
    /// State file.
    pub state: PathBuf,
    child: Child,
}

impl Sim {
    /// Starts `gpus` simulated GPUs, with a 1 ms sample period unless `extra` names one
    /// (most tests model a fast driver; the doorbell tests a realistic one).
    pub fn start(gpus: u32, extra: &[&str]) -> Sim {
        let state = PathBuf::from("/dev/shm").join(unique("coloc-e2e"));
        let period: &[&str] = if extra.contains(&"--sample-period-ms") {
            &[]
        } else {
            &["--sample-period-ms", "1"]
        };
        let child = Command::new(bin("coloc-sim"))
            .args(["gpu", "--gpus", &gpus.to_string()])
            .args(period)
            .args(extra)
            .env("COLOC_SIM_STATE", &state)
            .stderr(Stdio::null())
            .spawn()
            .expect("start coloc-sim gpu");
        wait_for("simulated GPU state", Duration::from_secs(5), || {
            coloc_sim::SimGpu::open(&state).is_ok()
        })
        .unwrap();
        Sim { state, child }
    }

    /// Opens the shared state (to inject failures or read probes).
    pub fn open(&self) -> coloc_sim::SimGpu {
        coloc_sim::SimGpu::open(&self.state).unwrap()
    }

    /// A `coloc-sim` command bound to this GPU state.
    pub fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(bin("coloc-sim"));
        c.args(args).env("COLOC_SIM_STATE", &self.state);
        c
    }

    /// Spawns a workload, killed on drop.
    pub fn spawn(&self, args: &[&str]) -> Proc {
        Proc(
            self.cmd(args)
                .stdout(Stdio::null())
                .spawn()
                .expect("spawn workload"),
        )
    }

    /// Spawns a workload inside cgroup directory `cg` (before it executes).
    pub fn spawn_in_cgroup(&self, cg: &Path, args: &[&str]) -> Proc {
        let mut c = coloc_sim::command_in_cgroup(cg, &bin("coloc-sim"));
        c.args(args)
            .env("COLOC_SIM_STATE", &self.state)
            .stdout(Stdio::null());
        Proc(c.spawn().expect("spawn workload in cgroup"))
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = reap_within(&mut self.child, Duration::from_secs(5));
        let _ = std::fs::remove_file(&self.state);
    }
}

/// The environment every test agent gets: the simulated GPU, NVML read as often as the
/// simulated driver samples in most tests (every millisecond; a test may say otherwise
/// with its own environment, set after this), and a doorbell directory of its own.
pub fn test_agent_env(cmd: &mut Command, sim: &Sim, doorbell_dir: &Path) {
    cmd.env("COLOC_SIM_STATE", &sim.state)
        .env("COLOC_NVML_INTERVAL", "1ms")
        .env("COLOC_NVML_SAMPLE_PERIOD", "1ms")
        .env("COLOC_DOORBELL_DIR", doorbell_dir);
}

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
fn reap_within(child: &mut Child, timeout: Duration) -> Result<std::process::ExitStatus> {
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

/// The v2 hierarchy's mount point: `/sys/fs/cgroup` (pure v2) or `/sys/fs/cgroup/unified`
/// (hybrid).
pub fn cgroup_v2_root() -> Option<PathBuf> {
    ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.join("cgroup.controllers").exists())
}

/// Thaws the (non-root) v2 cgroup and v1 freezer cgroup that `pid` is in, if frozen.
pub fn thaw_cgroups_of(pid: u32) {
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else {
        return;
    };
    for line in text.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(_), Some(ctrl), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let rel = path.trim_start_matches('/');
        if rel.is_empty() {
            continue;
        }
        if ctrl.is_empty() {
            if let Some(root) = cgroup_v2_root() {
                let _ = std::fs::write(root.join(rel).join("cgroup.freeze"), "0");
            }
        } else if ctrl.split(',').any(|c| c == "freezer") {
            let _ = std::fs::write(
                Path::new("/sys/fs/cgroup/freezer")
                    .join(rel)
                    .join("freezer.state"),
                "THAWED",
            );
        }
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

/// Polls `f` every 2 ms until it holds or `timeout` passes.
pub fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) -> Result<Duration> {
    let t = Instant::now();
    while t.elapsed() < timeout {
        if f() {
            return Ok(t.elapsed());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    bail!("timed out after {timeout:?} waiting for {what}")
}

/// Checks that `f` holds at every poll for `dur`.
pub fn holds_for(what: &str, dur: Duration, mut f: impl FnMut() -> bool) -> Result<()> {
    let t = Instant::now();
    while t.elapsed() < dur {
        if !f() {
            bail!("{what} stopped holding after {:?}", t.elapsed());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

/// A free TCP port on 127.0.0.1.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Minimal HTTP/1.1 GET: (status, body).
pub fn http_get(port: u16, path: &str) -> Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )?;
    let mut buf = String::new();
    s.read_to_string(&mut buf)?;
    let status = buf
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("bad HTTP response")?;
    let body = buf
        .split_once("\r\n\r\n")
        .map(|x| x.1.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

/// Sum of a Prometheus series' values whose line starts with `prefix` (name plus labels).
pub fn metric(text: &str, name: &str, label_filter: &[&str]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split(['{', ' ']).next() == Some(name))
        .filter(|l| label_filter.iter().all(|f| l.contains(f)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A running agent.
#[derive(Debug)]
pub struct Agent {
    /// The process.
    pub child: Option<Child>,
    /// HTTP port.
    pub port: u16,
    /// State directory (fail-open record).
    pub state_dir: PathBuf,
    /// Doorbell directory (`--doorbell-dir`).
    pub doorbell_dir: PathBuf,
    /// Log file.
    pub log: PathBuf,
}

/// Options for [`Agent::start`].
#[derive(Debug)]
pub struct AgentOpts<'a> {
    /// Rules file text.
    pub rules: &'a str,
    /// Actuator name.
    pub actuator: &'a str,
    /// Extra arguments.
    pub extra: Vec<String>,
    /// Reuse this state directory (restart tests).
    pub state_dir: Option<PathBuf>,
    /// Extra environment (e.g. `COLOC_NVML_INTERVAL` back to its default).
    pub env: Vec<(&'a str, String)>,
}

impl Default for AgentOpts<'_> {
    fn default() -> Self {
        AgentOpts {
            rules: "[[rule]]\nname = \"off\"\nclass = \"reclaimed_cores\"\ncmdline = \"*coloc-sim offline*\"\n",
            actuator: "signal",
            extra: vec![],
            state_dir: None,
            env: vec![],
        }
    }
}

impl Agent {
    /// Starts the agent and waits until `/readyz` answers 200.
    pub fn start(sim: &Sim, o: AgentOpts<'_>) -> Agent {
        let a = Agent::spawn(sim, o);
        wait_for("agent ready", Duration::from_secs(10), || {
            http_get(a.port, "/readyz")
                .map(|r| r.0 == 200)
                .unwrap_or(false)
        })
        .unwrap_or_else(|e| {
            panic!(
                "{e}: log:\n{}",
                std::fs::read_to_string(&a.log).unwrap_or_default()
            )
        });
        a
    }

    /// Starts the agent with the Kubernetes pod source (no rules file), extra arguments
    /// and environment, without waiting.
    pub fn spawn_with(sim: &Sim, args: &[&str], env: &[(&str, &std::ffi::OsStr)]) -> Agent {
        Agent::spawn_in(sim, args, env, None)
    }

    /// Starts the agent through a shell prefix: `sh -c '<prefix> "$0" "$@"' coloc-agent
    /// run …` (e.g. `echo $$ > DIR/cgroup.procs && exec unshare -C`).
    pub fn spawn_wrapped(sim: &Sim, prefix: &str, args: &[&str]) -> Agent {
        Agent::spawn_cmd(sim, args, &[], None, Some(prefix))
    }

    fn spawn_in(
        sim: &Sim,
        args: &[&str],
        env: &[(&str, &std::ffi::OsStr)],
        state_dir: Option<PathBuf>,
    ) -> Agent {
        Agent::spawn_cmd(sim, args, env, state_dir, None)
    }

    fn spawn_cmd(
        sim: &Sim,
        args: &[&str],
        env: &[(&str, &std::ffi::OsStr)],
        state_dir: Option<PathBuf>,
        prefix: Option<&str>,
    ) -> Agent {
        let dir = std::env::temp_dir().join(unique("coloc-e2e-agent"));
        std::fs::create_dir_all(&dir).unwrap();
        let state_dir =
            state_dir.unwrap_or_else(|| PathBuf::from("/dev/shm").join(unique("coloc-e2e-state")));
        let port = free_port();
        let log = dir.join("agent.log");
        let doorbell_dir = PathBuf::from("/dev/shm").join(unique("coloc-e2e-bells"));
        let mut cmd = match prefix {
            None => Command::new(bin("coloc-agent")),
            Some(p) => {
                let mut c = Command::new("sh");
                c.arg("-c")
                    .arg(format!("{p} \"$0\" \"$@\""))
                    .arg(bin("coloc-agent"));
                c
            }
        };
        cmd.arg("run")
            .arg("--nvml-lib")
            .arg(bin("libfake_nvml.so"))
            .arg("--state-dir")
            .arg(&state_dir)
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--cgroup-root")
            .arg("/sys/fs/cgroup")
            .args(args)
            .stderr(std::fs::File::create(&log).unwrap());
        test_agent_env(&mut cmd, sim, &doorbell_dir);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("start coloc-agent");
        Agent {
            child: Some(child),
            port,
            state_dir,
            doorbell_dir,
            log,
        }
    }

    /// Starts the agent with a rules file and the options, without waiting.
    pub fn spawn(sim: &Sim, o: AgentOpts<'_>) -> Agent {
        let dir = std::env::temp_dir().join(unique("coloc-e2e-rules"));
        std::fs::create_dir_all(&dir).unwrap();
        let rules = dir.join("rules.toml");
        std::fs::write(&rules, o.rules).unwrap();
        let mut args = vec![
            "--rules".to_string(),
            rules.display().to_string(),
            "--actuator".into(),
            o.actuator.into(),
        ];
        args.extend(o.extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let env: Vec<(&str, &std::ffi::OsStr)> = o
            .env
            .iter()
            .map(|(k, v)| (*k, std::ffi::OsStr::new(v.as_str())))
            .collect();
        Agent::spawn_in(sim, &args, &env, o.state_dir)
    }

    /// Waits until `/state` lists at least `n` processes on GPU 0.
    pub fn wait_processes(&self, n: usize) {
        wait_for(
            &format!("agent sees {n} GPU process(es)"),
            Duration::from_secs(5),
            || {
                self.state()["gpus"][0]["processes"]
                    .as_array()
                    .is_some_and(|p| p.len() >= n)
            },
        )
        .unwrap_or_else(|e| panic!("{e}\n{}", self.log_text()));
    }

    /// `/metrics` text.
    pub fn metrics(&self) -> String {
        http_get(self.port, "/metrics")
            .map(|r| r.1)
            .unwrap_or_default()
    }

    /// `/state` JSON.
    pub fn state(&self) -> serde_json::Value {
        http_get(self.port, "/state")
            .ok()
            .and_then(|r| serde_json::from_str(&r.1).ok())
            .unwrap_or_default()
    }

    /// The agent's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends a signal.
    pub fn signal(&self, sig: i32) {
        if let Some(c) = &self.child {
            // SAFETY: kill(2) on our own child.
            unsafe { libc::kill(c.id() as i32, sig) };
        }
    }

    /// Waits for exit, at most 20 s: an agent that does not exit is killed and the test
    /// fails with its log (instead of hanging).
    pub fn wait(&mut self) -> std::process::ExitStatus {
        let mut c = self.child.take().expect("running");
        match reap_within(&mut c, Duration::from_secs(20)) {
            Ok(st) => st,
            Err(e) => {
                let _ = c.kill();
                let _ = reap_within(&mut c, Duration::from_secs(5));
                panic!("agent did not exit: {e}\nlog:\n{}", self.log_text());
            }
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SIGTERM first: the agent resumes everything it suspended before it exits.
            // SAFETY: kill(2) on our own child.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            if reap_within(&mut c, Duration::from_secs(5)).is_err() {
                eprintln!("WARNING: agent ignored SIGTERM for 5 s: killing it");
                let _ = c.kill();
                let _ = reap_within(&mut c, Duration::from_secs(5));
            }
        }
        let _ = std::fs::remove_dir_all(&self.doorbell_dir);
    }
}

/// A cgroup created for a test, removed on drop.
#[derive(Debug)]
pub struct TestCgroup {
    /// Absolute directory.
    pub dir: PathBuf,
    /// Path inside its hierarchy (for rules).
    pub path: String,
    /// "v2" or "v1".
    pub version: &'static str,
}

impl TestCgroup {
    /// Creates a cgroup in the v2 hierarchy (`/sys/fs/cgroup` or its `unified/`).
    pub fn v2(name: &str) -> Option<TestCgroup> {
        TestCgroup::try_v2(name).ok()
    }

    /// Like [`TestCgroup::v2`], saying why when the v2 freezer cannot be used here.
    pub fn try_v2(name: &str) -> std::result::Result<TestCgroup, String> {
        let root = cgroup_v2_root().ok_or(
            "no cgroup v2 hierarchy (no cgroup.controllers in /sys/fs/cgroup or /sys/fs/cgroup/unified)",
        )?;
        let dir = root.join(name);
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("cannot create {} ({e}; root needed)", dir.display()))?;
        if !dir.join("cgroup.freeze").exists() {
            let _ = std::fs::remove_dir(&dir);
            return Err(format!(
                "{} has no cgroup.freeze (kernel older than 5.2)",
                dir.display()
            ));
        }
        Ok(TestCgroup {
            dir,
            path: format!("/{name}"),
            version: "v2",
        })
    }

    /// Creates a cgroup in the v1 freezer hierarchy.
    pub fn v1(name: &str) -> Option<TestCgroup> {
        TestCgroup::try_v1(name).ok()
    }

    /// Like [`TestCgroup::v1`], saying why when the v1 freezer cannot be used here.
    pub fn try_v1(name: &str) -> std::result::Result<TestCgroup, String> {
        let root = PathBuf::from("/sys/fs/cgroup/freezer");
        if !root.join("tasks").exists() {
            return Err(
                "no v1 freezer hierarchy at /sys/fs/cgroup/freezer (pure cgroup v2 host)".into(),
            );
        }
        let dir = root.join(name);
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("cannot create {} ({e}; root needed)", dir.display()))?;
        Ok(TestCgroup {
            dir,
            path: format!("/{name}"),
            version: "v1",
        })
    }

    /// The file the agent writes to freeze this cgroup (`cgroup.freeze` or
    /// `freezer.state`), as it reads now.
    pub fn control_file(&self) -> String {
        let f = if self.version == "v2" {
            "cgroup.freeze"
        } else {
            "freezer.state"
        };
        std::fs::read_to_string(self.dir.join(f))
            .unwrap_or_default()
            .trim()
            .to_string()
    }

    /// Whether the cgroup is frozen.
    pub fn frozen(&self) -> bool {
        match self.version {
            "v2" => std::fs::read_to_string(self.dir.join("cgroup.events"))
                .map(|s| s.lines().any(|l| l == "frozen 1"))
                .unwrap_or(false),
            _ => std::fs::read_to_string(self.dir.join("freezer.state"))
                .map(|s| s.trim() == "FROZEN")
                .unwrap_or(false),
        }
    }

    /// PIDs in the cgroup.
    pub fn pids(&self) -> Vec<u32> {
        let f = if self.version == "v2" {
            "cgroup.procs"
        } else {
            "tasks"
        };
        std::fs::read_to_string(self.dir.join(f))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }
}

/// `dir` and every cgroup below it, parents before children.
fn cgroup_tree(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![dir.to_path_buf()];
    let mut i = 0;
    while i < out.len() {
        if let Ok(rd) = std::fs::read_dir(&out[i]) {
            let subs: Vec<PathBuf> = rd
                .flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path())
                .collect();
            out.extend(subs);
        }
        i += 1;
    }
    out
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // Never leave anything frozen: thaw, kill, then remove (nested cgroups too, deepest
        // first, so a test that fails half-way leaves no directory behind).
        // Bounded throughout: a failing test must end in seconds, not hang on a frozen
        // process. Kill in a loop: a process may fork while being killed.
        let _ = match self.version {
            "v2" => std::fs::write(self.dir.join("cgroup.freeze"), "0"),
            _ => std::fs::write(self.dir.join("freezer.state"), "THAWED"),
        };
        let procs = if self.version == "v2" {
            "cgroup.procs"
        } else {
            "tasks"
        };
        let tree = cgroup_tree(&self.dir);
        let all_pids = || -> Vec<u32> {
            tree.iter()
                .flat_map(|d| {
                    std::fs::read_to_string(d.join(procs))
                        .unwrap_or_default()
                        .lines()
                        .filter_map(|l| l.trim().parse().ok())
                        .collect::<Vec<u32>>()
                })
                .collect()
        };
        let empty = wait_for("cgroup empty", Duration::from_secs(5), || {
            let pids = all_pids();
            for pid in &pids {
                // SAFETY: kill(2).
                unsafe { libc::kill(*pid as i32, libc::SIGKILL) };
            }
            pids.is_empty()
        });
        if let Err(e) = empty {
            eprintln!(
                "WARNING: {e}: {} still holds {:?} (frozen: {})",
                self.dir.display(),
                all_pids(),
                self.frozen()
            );
        }
        for d in tree.iter().rev() {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// Renders an SVG to PNG with `rsvg-convert` and checks the picture is not blank: returns
/// the number of distinct byte values in the decoded pixel data (a blank image has ~2).
pub fn render_svg(svg: &Path) -> Result<usize> {
    let png = svg.with_extension("png");
    let out = Command::new("rsvg-convert")
        .arg("-o")
        .arg(&png)
        .arg(svg)
        .output()
        .context(
            "rsvg-convert is not installed (the README's test command installs librsvg2-bin)",
        )?;
    if !out.status.success() {
        bail!(
            "rsvg-convert failed on {}: {}",
            svg.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let script = "import sys,zlib\nd=open(sys.argv[1],'rb').read()\nassert d[:8]==b'\\x89PNG\\r\\n\\x1a\\n'\ni=8;idat=b''\nwhile i<len(d):\n  n=int.from_bytes(d[i:i+4],'big');t=d[i+4:i+8]\n  if t==b'IDAT': idat+=d[i+8:i+8+n]\n  i+=12+n\nprint(len(set(zlib.decompress(idat))))";
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(&png)
        .output()?;
    if !out.status.success() {
        bail!(
            "{} is not a PNG: {}",
            png.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
}

/// A minimal CUDA driver client, found as the CUDA runtime finds it (`dlopen("libcuda.so.1")`,
/// `dlsym(h, "cuGetProcAddress_v2")`, the rest through the getter), for benchmarks that
/// must submit through the driver API (so that `libcoloc_cuda.so` sees the launches). In
/// tests the driver is the simulated one (`coloc_sim::fake_libcuda_dir` on
/// `LD_LIBRARY_PATH`), whose kernels run for the nanoseconds in their first parameter.
pub mod cuda {
    use std::ffi::{c_char, c_int, c_void, CStr};

    /// `cuGetProcAddress_v2`.
    pub type Getter =
        unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> c_int;
    type Launch = unsafe extern "C" fn(
        *mut c_void,
        u32,
        u32,
        u32,
        u32,
        u32,
        u32,
        u32,
        *mut c_void,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> c_int;
    type Sync = unsafe extern "C" fn() -> c_int;

    /// A context on one device with a loaded kernel.
    #[derive(Debug)]
    pub struct Driver {
        launch: Launch,
        sync: Sync,
        func: *mut c_void,
        stream: *mut c_void,
    }

    /// The driver's getter, found as the CUDA runtime finds it: `dlopen("libcuda.so.1")`
    /// (never closed), then `dlsym(h, "cuGetProcAddress_v2")`. Panics if either fails.
    pub fn getter() -> Getter {
        // SAFETY: plain dlopen/dlsym; the symbol is the driver's cuGetProcAddress_v2,
        // whose C type `Getter` is.
        unsafe {
            let h = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW);
            assert!(!h.is_null(), "dlopen libcuda.so.1 (LD_LIBRARY_PATH)");
            let g = libc::dlsym(h, c"cuGetProcAddress_v2".as_ptr());
            assert!(!g.is_null(), "no cuGetProcAddress_v2");
            std::mem::transmute::<*mut c_void, Getter>(g)
        }
    }

    /// Entry point `name` as the getter gives it for CUDA version `ver`; panics if none.
    pub fn get_at(getter: Getter, name: &CStr, ver: c_int) -> *mut c_void {
        let mut p = std::ptr::null_mut();
        // SAFETY: the driver's getter with valid pointers.
        let r = unsafe { getter(name.as_ptr(), &mut p, ver, 0, std::ptr::null_mut()) };
        assert!(
            r == 0 && !p.is_null(),
            "cuGetProcAddress({name:?}, {ver}): {r}"
        );
        p
    }

    /// Entry point `name` at CUDA 12.4.
    pub fn get(getter: Getter, name: &CStr) -> *mut c_void {
        get_at(getter, name, 12040)
    }

    impl Driver {
        /// Loads the driver and sets up device `ordinal`. Panics with the driver's answer
        /// when something fails (benchmark support, not product code).
        pub fn open(ordinal: c_int) -> Driver {
            // SAFETY: FFI to the driver exactly as the CUDA runtime calls it; the handle
            // and every object live until the process exits; every transmute names the
            // entry point's C type.
            unsafe {
                let getter = getter();
                let init = std::mem::transmute::<*mut c_void, unsafe extern "C" fn(u32) -> c_int>(
                    get(getter, c"cuInit"),
                );
                assert_eq!(init(0), 0, "cuInit");
                let dev_get = std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(*mut c_int, c_int) -> c_int,
                >(get(getter, c"cuDeviceGet"));
                let mut dev = 0;
                assert_eq!(dev_get(&mut dev, ordinal), 0, "cuDeviceGet");
                let ctx_create = std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(*mut *mut c_void, u32, c_int) -> c_int,
                >(get(getter, c"cuCtxCreate"));
                let mut ctx = std::ptr::null_mut();
                assert_eq!(ctx_create(&mut ctx, 0, dev), 0, "cuCtxCreate");
                let load = std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> c_int,
                >(get(getter, c"cuModuleLoadData"));
                let mut module = std::ptr::null_mut();
                assert_eq!(load(&mut module, c"bench".as_ptr().cast()), 0);
                let getf = std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const c_char) -> c_int,
                >(get(getter, c"cuModuleGetFunction"));
                let mut func = std::ptr::null_mut();
                assert_eq!(getf(&mut func, module, c"work".as_ptr()), 0);
                let create = std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(*mut *mut c_void, u32) -> c_int,
                >(get(getter, c"cuStreamCreate"));
                let mut stream = std::ptr::null_mut();
                assert_eq!(create(&mut stream, 1), 0, "cuStreamCreate");
                Driver {
                    stream,
                    launch: std::mem::transmute::<*mut c_void, Launch>(get(
                        getter,
                        c"cuLaunchKernel",
                    )),
                    sync: std::mem::transmute::<*mut c_void, Sync>(get(
                        getter,
                        c"cuCtxSynchronize",
                    )),
                    func,
                }
            }
        }

        /// Launches a kernel busy for `ns` on the default stream.
        pub fn launch(&self, ns: u64) {
            self.launch_on(ns, std::ptr::null_mut());
        }

        /// Launches a kernel busy for `ns` on a created stream (non-blocking).
        pub fn launch_on_stream(&self, ns: u64) {
            self.launch_on(ns, self.stream);
        }

        fn launch_on(&self, ns: u64, stream: *mut c_void) {
            let mut arg = ns;
            let mut params = [&mut arg as *mut u64 as *mut c_void];
            // SAFETY: our context's function on a stream of it; params outlive the call.
            let r = unsafe {
                (self.launch)(
                    self.func,
                    1,
                    1,
                    1,
                    1,
                    1,
                    1,
                    0,
                    stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            };
            assert_eq!(r, 0, "cuLaunchKernel");
        }

        /// Waits for everything launched.
        pub fn synchronize(&self) {
            // SAFETY: the current context is ours.
            assert_eq!(unsafe { (self.sync)() }, 0, "cuCtxSynchronize");
        }
    }
}

/// A doorbell page mapped read-only, as the agent maps it.
pub struct MappedPage(*mut libc::c_void);

impl std::fmt::Debug for MappedPage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("MappedPage").field(&self.0).finish()
    }
}

impl MappedPage {
    /// Maps the page at `path` once the shim has sized and initialised it (5 s at most).
    pub fn open(path: &Path) -> MappedPage {
        use std::os::fd::AsRawFd;
        // The shim creates the file, then sizes it: mapping it before would fault.
        wait_for("the page sized", Duration::from_secs(5), || {
            std::fs::metadata(path).is_ok_and(|m| m.len() >= coloc_doorbell::PAGE as u64)
        })
        .unwrap();
        let f = std::fs::File::open(path).unwrap();
        // SAFETY: a read-only shared mapping of a page-long regular file.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                coloc_doorbell::PAGE,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        let m = MappedPage(base);
        wait_for("the page initialised", Duration::from_secs(5), || {
            m.page().valid()
        })
        .unwrap();
        m
    }
    /// The page.
    pub fn page(&self) -> coloc_doorbell::Page<'_> {
        // SAFETY: a live read-only mapping; only reader-side methods are called.
        unsafe { coloc_doorbell::Page::from_raw(self.0.cast()) }
    }
    /// The gate fields of the (one) GPU the process submits to.
    pub fn gate(&self) -> Option<coloc_doorbell::GateReading> {
        let mut v = Vec::new();
        self.page().read_gate(&mut v);
        v.first().copied()
    }
    /// Its latest acknowledged gate epoch (0: none).
    pub fn ack(&self) -> u32 {
        self.gate().map_or(0, |r| r.gate_ack)
    }
}

impl Drop for MappedPage {
    fn drop(&mut self) {
        // SAFETY: our own mapping.
        unsafe { libc::munmap(self.0, coloc_doorbell::PAGE) };
    }
}
