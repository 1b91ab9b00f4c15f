//! The simulated GPU daemon (`coloc-sim gpu`) and workloads started on it.

use crate::{bin, reap_within, unique, wait_for, Proc};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

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
        crate::paths::sweep_leftovers();
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
