//! `coloc-agent probe live|ready`: what the running agent's health file says (the chart's
//! exec probes; see `http::health_file`). Exit 0 with the agent's word, or 1 with why not.

use crate::cli::parse_duration;
use crate::http::health_file::{judge, Probe, FILE};
use clap::Args;
use std::path::PathBuf;
use std::time::Duration;

/// `coloc-agent probe`.
#[derive(Args, Debug, Clone)]
pub struct ProbeArgs {
    /// Liveness (the control loop ticks) or readiness (also: the pod source is synced and
    /// no GPU failed open).
    #[arg(value_enum)]
    pub which: Probe,
    /// The agent's state directory (`coloc-agent run --state-dir`), where it writes
    /// `health.json` every second.
    #[arg(long, env = "COLOC_STATE_DIR", default_value = "/run/coloc-agent")]
    pub state_dir: PathBuf,
    /// A health file older than this fails the probe (the agent stopped writing it).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub max_age: Duration,
}

/// Runs the probe: prints the agent's word and returns 0, or the reason and 1.
pub fn run(a: &ProbeArgs) -> i32 {
    match judge(&a.state_dir.join(FILE), a.which, a.max_age) {
        Ok(word) => {
            println!("{word}");
            0
        }
        Err(why) => {
            println!("{why}");
            1
        }
    }
}
