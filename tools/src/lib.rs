//! # coloc-tools — the project's own tools, and the harness they share with the tests
//!
//! Binaries (built with the workspace, next to `coloc-agent` in `target/<profile>/`):
//!
//! - `coloc-bench` (`src/bin/coloc-bench/`): the end-to-end benchmarks on the simulated GPU
//!   (`benches/run.sh`), and the NVML and wake-up probes `benches/gpu/run.py` runs on a real
//!   one. `coloc-bench --help` lists the modes.
//! - `coloc-capture`: a CUDA graph capture workload beside another thread's launches.
//! - `coloc-batch`: batched copies (`cuMemcpyBatchAsync`) through both of their ABIs.
//! - `coloc-syncs`: submissions and synchronising calls in the order a test dictates.
//!
//! The library drives the real binaries: real processes, real signals, real cgroups; only
//! the GPU is simulated (`coloc-sim gpu` plus `libfake_nvml.so` loaded by the real agent).
//! The end-to-end tests (`tests/e2e`) use it too. Binaries are found in the cargo target
//! directory of the running executable, so run `cargo build --workspace` first (the
//! README's test command does).

mod agent;
mod cgroups;
pub mod cuda;
pub mod fakeapi;
mod http;
mod page;
mod paths;
mod poll;
mod procs;
mod sim;
mod stats;

pub use agent::{test_agent_env, Agent, AgentOpts};
pub use cgroups::{cgroup_v2_root, offline_rules, thaw_cgroups_of, TestCgroup};
pub use http::{free_port, http_get, metric};
pub use page::MappedPage;
pub use paths::{bin, fake_cuda, sweep_leftovers, unique, TempPath};
pub use poll::{holds_for, wait_for};
pub(crate) use procs::reap_within;
pub use procs::{output_within, proc_state, Proc};
pub use sim::Sim;
pub use stats::percentile;
