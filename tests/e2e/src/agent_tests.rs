//! What the tests of the running agent share (`tests/agent_*.rs`, `tests/demo.rs`,
//! `tests/gpu_harness.rs`): time bounds, the offline workload's arguments, and the lock on
//! the machine-wide CPU wake-up latency request.

use std::time::Duration;

/// How soon the agent must have acted (suspended, resumed, published).
pub const SOON: Duration = Duration::from_secs(2);

/// The CPU wake-up latency request is the whole machine's: the tests that hold one (the
/// demo's agent, the GPU harness's wake-floor step) or read the one in force run one at a
/// time. The lock covers one test binary; `cargo test` runs the binaries one after another.
static CPU_LATENCY: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Takes the CPU wake-up latency lock (see `CPU_LATENCY`), even after a test that held it
/// panicked.
pub fn cpu_latency_lock() -> std::sync::MutexGuard<'static, ()> {
    CPU_LATENCY.lock().unwrap_or_else(|e| e.into_inner())
}
/// Longest a one-shot `coloc-agent` command (check-rules, status, a run that must fail at
/// start) may take before the test fails instead of hanging.
pub const CMD_LIMIT: Duration = Duration::from_secs(30);

/// `coloc-sim offline` on GPU 0, 2 ms steps, tagged `tag` (for rules and for `ps`).
pub fn offline_args(tag: &str) -> Vec<String> {
    ["offline", "--gpu", "0", "--step-ms", "2", "--tag", tag]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

/// Borrows owned arguments as `&str`s.
pub fn args(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}
