//! Command line: clap derive, every flag also settable from `COLOC_…` environment
//! variables, validated once into the typed configuration of the control loop.

mod run;

pub use run::RunArgs;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::time::Duration;

/// gpu-coloc node agent: offline GPU work uses every idle moment and gets out of the way
/// the instant online work arrives.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None, after_help = "\
Examples:
  coloc-agent check-rules rules.toml             validate a standalone rules file
  coloc-agent run --rules rules.toml             standalone host: classify GPU processes by rules
  coloc-agent run --rules rules.toml --dry-run   decide and report, never suspend anything
  coloc-agent status --watch                     what a running agent sees and does
  coloc-agent resume                             resume what a killed agent left suspended")]
pub struct Cli {
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, env = "COLOC_LOG_FORMAT", global = true)]
    pub log_format: LogFormat,
    /// Command.
    #[command(subcommand)]
    pub cmd: Command,
}

/// Log output format.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Subcommands.
#[derive(Subcommand, Debug)]
#[allow(clippy::large_enum_variant)] // parsed once at start
pub enum Command {
    /// Run the agent.
    Run(RunArgs),
    /// Validate a standalone rules file and print what it says.
    CheckRules {
        /// The TOML rules file.
        file: PathBuf,
    },
    /// Show a running agent's state: per GPU, its state, the online and offline
    /// processes on it, time since the last preemption and latency percentiles.
    Status(crate::cmd::status::StatusArgs),
    /// Resume everything the fail-open record holds (thaw cgroups, continue processes), as
    /// the agent does at start, when no agent is running with that state directory.
    #[command(after_help = crate::cmd::resume::AFTER_HELP)]
    Resume(crate::cmd::resume::ResumeArgs),
    /// What the running agent's health file says, for exec probes: `live` (its control
    /// loop ticks) or `ready` (also synced and not degraded). Exit 0, or 1 with the reason.
    Probe(crate::cmd::probe::ProbeArgs),
    /// Run a command under the CUDA shim (a plain host; the webhook does it for pods):
    /// online, its launches ring the agent's doorbell; offline, it submits through the
    /// launch gate.
    #[command(after_help = crate::cmd::exec::AFTER_HELP)]
    Exec(crate::cmd::exec::ExecArgs),
}

/// Parses a duration the way `humantime` writes them: `1ms`, `500us`, `100ms`, `2m`,
/// `1m30s`, `1h`, and `0`. A number without a unit (other than 0) is an error.
pub fn parse_duration(s: &str) -> Result<Duration> {
    let s = s.trim();
    humantime::parse_duration(s).with_context(|| {
        format!("{s:?} is not a duration (a number and a unit: 500us, 100ms, 2s, 1m30s, 1h)")
    })
}

/// `COLOC_*` variables other parts of gpu-coloc read, which the agent passes on or
/// ignores: the CUDA shim's (in processes `coloc-agent exec` starts), the simulated
/// driver's (read by the fake NVML library the agent loads in tests), the log filter, the
/// webhook's (`COLOC_WEBHOOK_*`) and the benchmarks'.
pub const OTHER_COMPONENTS: &[&str] = &[
    "COLOC_SHIM_CLASS",
    "COLOC_SHIM_INFLIGHT",
    "COLOC_SHIM_INFLIGHT_MS",
    "COLOC_SHIM_WAKE_GAP_MS",
    "COLOC_SHIM_TRACE",
    "COLOC_GATE_STALE_MS",
    "COLOC_POD_UID",
    "COLOC_SIM_STATE",
    "COLOC_LOG",
    "COLOC_BENCH_MODE",
    "COLOC_BENCH_MIN",
    "COLOC_CAPTURE_ALONE",
    "COLOC_E2E_CAPS_TOOL",
    // The GPU harness's channel-group probe (benches/gpu/probes) and its fake RM device.
    "COLOC_TSG_CTL",
    "COLOC_TSG_TRACE",
    "COLOC_TSG_FAKE_DIR",
    "COLOC_TSG_FAKE_LOG",
    "COLOC_TSG_FAKE_MIN_US",
];

/// Every `COLOC_*` variable a flag of `coloc-agent` reads, in any subcommand.
pub fn flag_env_names() -> std::collections::BTreeSet<String> {
    fn walk(cmd: &clap::Command, out: &mut std::collections::BTreeSet<String>) {
        for a in cmd.get_arguments() {
            if let Some(e) = a.get_env() {
                out.insert(e.to_string_lossy().into_owned());
            }
        }
        for sub in cmd.get_subcommands() {
            walk(sub, out);
        }
    }
    let mut out = Default::default();
    walk(&<Cli as clap::CommandFactory>::command(), &mut out);
    out
}

/// The names among `vars` that look like settings (`COLOC_*`) but that no flag and no
/// other part of gpu-coloc reads: a misspelt setting (`COLOC_IDLE_WINDW`), which would
/// otherwise be ignored without a word. `coloc-agent run` refuses to start with any.
pub fn unknown_settings(vars: impl IntoIterator<Item = String>) -> Vec<String> {
    let known = flag_env_names();
    let mut unknown: Vec<String> = vars
        .into_iter()
        .filter(|v| v.starts_with("COLOC_") && !v.starts_with("COLOC_WEBHOOK_"))
        .filter(|v| !known.contains(v) && !OTHER_COMPONENTS.contains(&v.as_str()))
        .collect();
    unknown.sort();
    unknown
}

#[cfg(test)]
mod tests;
