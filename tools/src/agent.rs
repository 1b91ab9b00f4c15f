//! The real agent (`coloc-agent run`) on the simulated GPU and the fake NVML library.

use crate::{bin, free_port, http_get, reap_within, unique, wait_for, Sim};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

/// The environment every test agent gets: the simulated GPU, NVML read as often as the
/// simulated driver samples in most tests (every millisecond; a test may say otherwise
/// with its own environment, set after this), and a doorbell directory of its own.
pub fn test_agent_env(cmd: &mut Command, sim: &Sim, doorbell_dir: &Path) {
    cmd.env("COLOC_SIM_STATE", &sim.state)
        .env("COLOC_NVML_INTERVAL", "1ms")
        .env("COLOC_NVML_SAMPLE_PERIOD", "1ms")
        .env("COLOC_DOORBELL_DIR", doorbell_dir);
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
    /// What was made for this agent alone (the directory of its log and rules file, its
    /// state directory unless it was given one): removed on drop, or kept and named when
    /// dropped by a failing test. An agent given another's state directory leaves it to
    /// that one, which must then be dropped after it.
    pub scratch: Vec<PathBuf>,
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
        let mut scratch = vec![dir.clone()];
        let state_dir = state_dir.unwrap_or_else(|| {
            let d = PathBuf::from("/dev/shm").join(unique("coloc-e2e-state"));
            scratch.push(d.clone());
            d
        });
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
            .args(
                (!args.contains(&"--cgroup-root"))
                    .then_some(["--cgroup-root", "/sys/fs/cgroup"])
                    .into_iter()
                    .flatten(),
            )
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
            scratch,
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
        let mut a = Agent::spawn_in(sim, &args, &env, o.state_dir);
        a.scratch.push(dir);
        a
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
        if std::thread::panicking() {
            eprintln!(
                "NOTE: the agent's files are kept for this failure: {:?} (removed by the next run of the end-to-end tests)",
                self.scratch
            );
        } else {
            for p in &self.scratch {
                let _ = std::fs::remove_dir_all(p);
            }
        }
    }
}
