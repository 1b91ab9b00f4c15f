//! Command line: clap derive, every flag also settable from `COLOC_…` environment
//! variables, validated once into the typed configuration of the control loop.

mod run;

pub use run::RunArgs;

use anyhow::{bail, Context, Result};
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

/// Parses `1ms`, `500us`, `0.5s`, `100ms`, `2m`, and `0` (any other number without a
/// unit: error).
pub fn parse_duration(s: &str) -> Result<Duration> {
    let s = s.trim();
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .with_context(|| format!("{s:?}: missing unit (use ns, us, ms, s or m)"))?;
    let (num, unit) = s.split_at(split);
    let n: f64 = num
        .parse()
        .with_context(|| format!("{s:?}: {num:?} is not a number"))?;
    let secs = match unit {
        "ns" => n / 1e9,
        "us" | "µs" => n / 1e6,
        "ms" => n / 1e3,
        "s" => n,
        "m" => n * 60.0,
        _ => bail!("{s:?}: unknown unit {unit:?} (use ns, us, ms, s or m)"),
    };
    if !secs.is_finite() || secs < 0.0 {
        bail!("{s:?}: not a valid duration");
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests;
