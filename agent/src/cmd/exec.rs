//! `coloc-agent exec --class online|offline -- CMD …`: runs a command under the CUDA shim
//! on a plain host (the webhook does the same for pods).
//!
//! ```text
//!  LD_PRELOAD          += the shim (appended: a preload the command already has stays first)
//!  COLOC_SHIM_CLASS     = online | offline
//!  COLOC_DOORBELL_DIR   = --doorbell-dir   (the agent's, where the page goes)
//!  COLOC_GATE_FILE      = --gate-file      (offline: the gate the agent closes)
//!  COLOC_SHIM_INFLIGHT  = --inflight       (offline, when given: K)
//!  COLOC_SHIM_INFLIGHT_MS = --inflight-ms  (offline, when given: the budget)
//!  then execvp(CMD): the command replaces this process (same PID, same cgroup)
//! ```
//!
//! The class tells the shim what to be (a doorbell or a gate); it is not how the agent
//! classifies the process. The agent goes by its rules file (`--rules`): a command run
//! with `--class online` that no rule calls online rings a doorbell nobody listens to
//! (`coloc_doorbell_rejected_total{reason="not_online"}`), and one run with
//! `--class offline` that no rule calls offline is never held at its gate.

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;

/// What the shim is in the command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ShimClass {
    /// A doorbell: each launch tells the agent that online work started.
    Online,
    /// A launch gate: the agent can block new submissions and bound work in flight.
    Offline,
}

/// `coloc-agent exec`.
#[derive(Args, Debug, Clone)]
pub struct ExecArgs {
    /// What the shim is in the command (must agree with the agent's rules; see below).
    #[arg(long, value_enum)]
    pub class: ShimClass,
    /// The shim library (`libcoloc_cuda.so`).
    #[arg(
        long,
        env = "COLOC_SHIM_LIB",
        default_value = "/var/lib/gpu-coloc/lib/libcoloc_cuda.so"
    )]
    pub shim: PathBuf,
    /// The agent's doorbell directory (`coloc-agent run --doorbell-dir`).
    #[arg(
        long,
        env = "COLOC_DOORBELL_DIR",
        default_value = "/run/gpu-coloc/doorbells"
    )]
    pub doorbell_dir: PathBuf,
    /// The agent's gate file (`coloc-agent run --gate-file`; offline only).
    #[arg(long, env = "COLOC_GATE_FILE", default_value = coloc_doorbell::gate::DEFAULT_GATE_FILE)]
    pub gate_file: PathBuf,
    /// Offline: at most this many submissions in flight per stream (K, a ceiling under the
    /// budget; 0 = unbounded). Unset: the shim's default (64).
    #[arg(long)]
    pub inflight: Option<u32>,
    /// Offline: at most this much estimated GPU time in flight per process and GPU, ms
    /// (the budget, shared among the process's streams there; at least one submission per
    /// stream, at most K; 0 = none). Unset: the shim's default (0.5).
    #[arg(long, value_parser = parse_ms)]
    pub inflight_ms: Option<f64>,
    /// The command and its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    pub command: Vec<std::ffi::OsString>,
}

fn parse_ms(v: &str) -> Result<f64, String> {
    match v.trim().parse::<f64>() {
        Ok(ms) if ms.is_finite() && ms >= 0.0 => Ok(ms),
        _ => Err(format!(
            "{v:?} is not a number of milliseconds (0: no budget)"
        )),
    }
}

/// Help text after the options.
pub const AFTER_HELP: &str = "\
The class tells the shim what to be; the agent classifies the process by its rules file.
Example (a rules file with cmdline = \"*train.py*\" as reclaimed_cores):
  coloc-agent exec --class offline -- python train.py
Nothing else changes: the command keeps this process's PID, cgroup and environment.";

/// The environment `args` gives the command: (name, value) pairs.
pub fn environment(
    args: &ExecArgs,
    ld_preload: Option<&std::ffi::OsStr>,
) -> Vec<(&'static str, std::ffi::OsString)> {
    let mut preload = std::ffi::OsString::new();
    if let Some(p) = ld_preload.filter(|p| !p.is_empty()) {
        preload.push(p);
        preload.push(":");
    }
    preload.push(&args.shim);
    let mut env = vec![
        ("LD_PRELOAD", preload),
        (
            "COLOC_SHIM_CLASS",
            match args.class {
                ShimClass::Online => "online",
                ShimClass::Offline => "offline",
            }
            .into(),
        ),
        ("COLOC_DOORBELL_DIR", args.doorbell_dir.clone().into()),
    ];
    if args.class == ShimClass::Offline {
        env.push(("COLOC_GATE_FILE", args.gate_file.clone().into()));
        if let Some(k) = args.inflight {
            env.push(("COLOC_SHIM_INFLIGHT", k.to_string().into()));
        }
        if let Some(ms) = args.inflight_ms {
            env.push(("COLOC_SHIM_INFLIGHT_MS", ms.to_string().into()));
        }
    }
    env
}

/// Runs the command under the shim; returns only on failure.
pub fn run(args: ExecArgs) -> Result<()> {
    if !args.shim.is_file() {
        bail!(
            "--shim {}: no such file (install it with coloc-node-setup --install SRC --sha256 FILE --into DIR, or pass --shim / COLOC_SHIM_LIB)",
            args.shim.display()
        );
    }
    let already = std::env::var_os("LD_PRELOAD");
    let env = environment(&args, already.as_deref());
    let (prog, rest) = args.command.split_first().context("no command given")?;
    let err = std::process::Command::new(prog).args(rest).envs(env).exec();
    Err(err).with_context(|| format!("running {}", prog.to_string_lossy()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;

    fn parse(argv: &[&str]) -> ExecArgs {
        let cli = Cli::try_parse_from(argv).unwrap();
        let Command::Exec(a) = cli.cmd else {
            panic!("not exec")
        };
        a
    }

    #[test]
    fn offline_gets_the_gate_and_keeps_an_existing_preload_first() {
        let a = parse(&[
            "coloc-agent",
            "exec",
            "--class",
            "offline",
            "--shim",
            "/s.so",
            "--inflight",
            "2",
            "--inflight-ms",
            "1.5",
            "--",
            "python",
            "-u",
            "train.py",
        ]);
        assert_eq!(a.command, ["python", "-u", "train.py"]);
        let env = environment(&a, Some("/other.so".as_ref()));
        let get = |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
        assert_eq!(get("LD_PRELOAD").unwrap(), "/other.so:/s.so");
        assert_eq!(get("COLOC_SHIM_CLASS").unwrap(), "offline");
        assert_eq!(get("COLOC_SHIM_INFLIGHT").unwrap(), "2");
        assert_eq!(get("COLOC_SHIM_INFLIGHT_MS").unwrap(), "1.5");
        assert!(get("COLOC_GATE_FILE").is_some());
    }

    #[test]
    fn online_gets_a_doorbell_and_no_gate() {
        let a = parse(&[
            "coloc-agent",
            "exec",
            "--class",
            "online",
            "--shim",
            "/s.so",
            "--",
            "serve",
        ]);
        let env = environment(&a, None);
        let get = |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
        assert_eq!(get("LD_PRELOAD").unwrap(), "/s.so");
        assert_eq!(get("COLOC_SHIM_CLASS").unwrap(), "online");
        assert!(get("COLOC_GATE_FILE").is_none());
        assert!(Cli::try_parse_from(["coloc-agent", "exec", "--class", "online"]).is_err());
        assert!(
            Cli::try_parse_from(["coloc-agent", "exec", "--class", "bulk", "--", "x"]).is_err()
        );
        let bad = [
            "coloc-agent",
            "exec",
            "--class",
            "offline",
            "--inflight-ms",
            "-1",
            "--",
            "x",
        ];
        let e = Cli::try_parse_from(bad).unwrap_err().to_string();
        assert!(
            e.contains("--inflight-ms") && e.contains("milliseconds"),
            "{e}"
        );
    }

    #[test]
    fn a_missing_shim_is_named() {
        let a = parse(&[
            "coloc-agent",
            "exec",
            "--class",
            "online",
            "--shim",
            "/nonexistent/s.so",
            "--",
            "true",
        ]);
        let err = run(a).unwrap_err().to_string();
        assert!(err.contains("/nonexistent/s.so"), "{err}");
    }
}
