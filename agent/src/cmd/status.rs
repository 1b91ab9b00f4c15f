//! `coloc-agent status`: a running agent's `/state`, for people (`--watch`) and scripts
//! (`--json`), and its recent timeline as a picture (`--plot FILE.svg`).
//!
//! May touch: one HTTP connection to the agent; the plot file.

use crate::control::state::StateDoc;
use anyhow::{bail, Context, Result};
use clap::Args;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::Duration;

/// `coloc-agent status`.
#[derive(Args, Debug, Clone)]
pub struct StatusArgs {
    /// The agent's HTTP address.
    #[arg(
        long,
        env = "COLOC_STATUS_URL",
        default_value = "http://127.0.0.1:9400"
    )]
    pub url: String,
    /// Refresh every this many seconds until interrupted.
    #[arg(long, value_name = "SECS", num_args = 0..=1, default_missing_value = "1")]
    pub watch: Option<f64>,
    /// Print the raw /state JSON.
    #[arg(long)]
    pub json: bool,
    /// Write the recent timeline (online busy, offline suspended) of GPU --gpu as SVG.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// GPU for --plot.
    #[arg(long, default_value_t = 0)]
    pub gpu: u32,
}

/// GET `path` from an `http://host:port` URL.
pub fn http_get(url: &str, path: &str) -> Result<String> {
    let rest = url
        .strip_prefix("http://")
        .with_context(|| format!("--url {url:?}: only http://host:port is supported"))?;
    let hostport = rest.trim_end_matches('/');
    let mut s = std::net::TcpStream::connect(hostport)
        .with_context(|| format!("cannot reach the agent at {url} (is it running? --url)"))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {hostport}\r\nConnection: close\r\n\r\n"
    )?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .context("malformed HTTP response")?;
    if !head.starts_with("HTTP/1.1 200") {
        bail!("{url}{path}: {}", head.lines().next().unwrap_or(""));
    }
    // axum answers /state with a content-length; chunked bodies are not expected here.
    Ok(body.to_string())
}

fn ms(v: Option<f64>) -> String {
    v.map(|x| format!("{x:.2} ms"))
        .unwrap_or_else(|| "-".into())
}

/// Human-readable rendering of a `/state` document.
pub fn render(st: &StateDoc) -> String {
    let mut out = format!(
        "node {}  actuator {}{}  idle window {} ms{}\n",
        st.node,
        st.actuator.map(|k| k.as_str()).unwrap_or("?"),
        if st.dry_run { " (dry run)" } else { "" },
        st.idle_window_ms,
        match &st.degraded_reason {
            Some(why) => format!("  DEGRADED: {why}"),
            None if st.degraded => "  DEGRADED".to_string(),
            None => String::new(),
        },
    );
    for g in &st.gpus {
        let since = g
            .last_preemption_ms_ago
            .map(|x| format!("{:.1} s ago", x / 1e3))
            .unwrap_or_else(|| "never".into());
        out += &format!(
            "\nGPU {} {}  {}{}\n  last preemption: {since}\n  preemption latency: p50 {} p99 {} (n={})   release latency: p50 {} p99 {} (n={})\n",
            g.index,
            g.uuid,
            g.state.to_uppercase(),
            if g.degraded { "  (NVML failing: not managed)" } else { "" },
            ms(g.preemption_ms.p50),
            ms(g.preemption_ms.p99),
            g.preemption_ms.count,
            ms(g.release_ms.p50),
            ms(g.release_ms.p99),
            g.release_ms.count,
        );
        if g.processes.is_empty() {
            out += "  no GPU processes\n";
        }
        for p in &g.processes {
            out += &format!(
                "  {:>8}  {:<10} {:<9} {:<28} {}\n",
                p.pid,
                p.class.to_string(),
                if p.suspended { "SUSPENDED" } else { "running" },
                p.owner,
                p.cmd.chars().take(60).collect::<String>(),
            );
        }
    }
    out
}

/// Runs `coloc-agent status`.
pub fn run(a: StatusArgs) -> Result<()> {
    loop {
        let body = http_get(&a.url, "/state")?;
        let st: StateDoc = serde_json::from_str(&body)
            .context("the agent's /state is not a state document (agent of another version?)")?;
        if let Some(p) = &a.plot {
            let events = &st.recent_events;
            let now = st.updated_ns;
            let t0 = events
                .first()
                .map(|e| match e {
                    crate::control::events::Event::Preempt(p) => p.decided_ns,
                    crate::control::events::Event::Release(r) => r.decided_ns,
                    crate::control::events::Event::FailOpen(f) => f.at_ns,
                })
                .unwrap_or(now)
                .min(now.saturating_sub(10_000_000_000));
            let doc = super::timeline::svg(
                &format!("gpu-coloc on {}, GPU {}", st.node, a.gpu),
                events,
                a.gpu,
                &[],
                t0,
                now,
            );
            std::fs::write(p, doc).with_context(|| format!("writing {}", p.display()))?;
            println!("wrote {}", p.display());
        } else if a.json {
            println!("{}", serde_json::to_string_pretty(&st)?);
        } else {
            if a.watch.is_some() {
                print!("\x1b[2J\x1b[H");
            }
            print!("{}", render(&st));
        }
        match a.watch {
            Some(secs) if a.plot.is_none() => {
                std::thread::sleep(Duration::from_secs_f64(secs.max(0.1)))
            }
            _ => return Ok(()),
        }
    }
}
