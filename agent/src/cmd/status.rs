//! `coloc-agent status`: a running agent's `/state`, for people (`--watch`) and scripts
//! (`--json`), and its recent timeline as a picture (`--plot FILE.svg`).
//!
//! May touch: one HTTP connection to the agent; the plot file.

use crate::control::state::StateDoc;
use crate::control::table::sanitize;
use anyhow::{bail, Context, Result};
use clap::Args;
use std::io::Write;
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

/// GET `path` from an `http://host:port` URL: one HTTP/1.1 request through hyper's
/// client (the same hyper the agent serves with), bounded by 5 s, on a runtime of its own.
pub fn http_get(url: &str, path: &str) -> Result<String> {
    let rest = url
        .strip_prefix("http://")
        .with_context(|| format!("--url {url:?}: only http://host:port is supported"))?;
    let hostport = rest.trim_end_matches('/').to_string();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let get = async {
        let tcp = tokio::net::TcpStream::connect(&hostport)
            .await
            .with_context(|| format!("cannot reach the agent at {url} (is it running? --url)"))?;
        let (mut send, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp)).await?;
        tokio::spawn(conn);
        let req = hyper::Request::get(path)
            .header(hyper::header::HOST, &hostport)
            .body(http_body_util::Empty::<hyper::body::Bytes>::new())?;
        let resp = send.send_request(req).await?;
        let status = resp.status();
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await?
            .to_bytes();
        if status != hyper::StatusCode::OK {
            bail!("{url}{path}: {status}");
        }
        Ok(String::from_utf8_lossy(&body).into_owned())
    };
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(5), get)
            .await
            .with_context(|| format!("{url}{path}: no answer within 5 s"))?
    })
}

fn ms(v: Option<f64>) -> String {
    v.map(|x| format!("{x:.2} ms"))
        .unwrap_or_else(|| "-".into())
}

/// What the command column shows for a process without a command line: the agent hides
/// them unless it runs with `--state-cmdlines`.
pub const HIDDEN_CMD: &str = "(command line hidden: agent runs without --state-cmdlines)";

/// Human-readable rendering of a `/state` document. Every text that comes from the agent
/// (and so from tenants: command lines) has its control characters escaped, so nothing in
/// it can move the cursor, recolour or retitle the terminal.
pub fn render(st: &StateDoc) -> String {
    let mut out = format!(
        "node {}  actuator {}{}  idle window {} ms{}\n",
        sanitize(&st.node),
        st.actuator.map(|k| k.as_str()).unwrap_or("?"),
        if st.dry_run { " (dry run)" } else { "" },
        st.idle_window_ms,
        match &st.degraded_reason {
            Some(why) => format!("  DEGRADED: {}", sanitize(why)),
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
            sanitize(&g.uuid),
            shown_state(g),
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
            let mut shim = match p.shim.as_deref() {
                Some("page") | None => String::new(),
                Some(why) => format!("  [no shim: {}]", sanitize(why)),
            };
            if let Some(gate) = p.gate.as_deref() {
                shim += &format!("  [gate {}]", sanitize(gate));
            }
            out += &format!(
                "  {:>8}  {:<10} {:<9} {:<28} {}{shim}\n",
                p.pid,
                p.class.to_string(),
                // Held on the books, found running, nothing it cannot undo holding it.
                if p.escaping {
                    "ESCAPING"
                } else if p.suspended {
                    "SUSPENDED"
                } else {
                    "running"
                },
                sanitize(&p.owner),
                if p.cmd.is_empty() {
                    HIDDEN_CMD.to_string()
                } else {
                    sanitize(&p.cmd).chars().take(60).collect::<String>()
                },
            );
        }
    }
    // The CUDA shim's coverage: online and offline processes with it, and why not.
    for class in ["online", "offline"] {
        let rows: Vec<_> = st
            .shim_coverage
            .iter()
            .filter(|r| r.class == class)
            .collect();
        if rows.is_empty() {
            continue;
        }
        let with: usize = rows
            .iter()
            .filter(|r| r.shim == "page")
            .map(|r| r.processes)
            .sum();
        let without: Vec<String> = rows
            .iter()
            .filter(|r| r.shim != "page")
            .map(|r| format!("{} {}", sanitize(&r.shim), r.processes))
            .collect();
        out += &format!(
            "\nCUDA shim, {class} processes: {with} with it{}",
            if without.is_empty() {
                "\n".to_string()
            } else {
                format!(
                    ", {} without ({})\n",
                    rows.iter()
                        .filter(|r| r.shim != "page")
                        .map(|r| r.processes)
                        .sum::<usize>(),
                    without.join(", ")
                )
            }
        );
    }
    out += &earned(st);
    out
}

/// A duration for people: seconds, minutes or hours.
fn dur(s: f64) -> String {
    if s < 60.0 {
        format!("{s:.2} s")
    } else if s < 3600.0 {
        format!("{:.1} min", s / 60.0)
    } else {
        format!("{:.2} h", s / 3600.0)
    }
}

/// What co-location earned since the agent started, per class and namespace (`/state`'s
/// `earned`; the counters' meaning is in `crate::earned`).
pub fn earned(st: &StateDoc) -> String {
    if st.earned.is_empty() && st.online_runs.is_none() {
        return String::new();
    }
    let mut out =
        "\nWhat co-location earned since the agent started (GPU time, summed over GPUs):\n"
            .to_string();
    let offline: Vec<_> = st.earned.iter().filter(|r| r.class == "offline").collect();
    if !offline.is_empty() {
        out += &format!(
            "  {:<8} {:<24} {:>18} {:>12}\n",
            "class", "namespace", "ran beside online", "held"
        );
        for r in &offline {
            out += &format!(
                "  {:<8} {:<24} {:>18} {:>12}\n",
                r.class,
                sanitize(&r.namespace),
                dur(r.harvested_s),
                dur(r.held_s)
            );
        }
    }
    let online: Vec<_> = st.earned.iter().filter(|r| r.class != "offline").collect();
    if !online.is_empty() {
        out += &format!(
            "  {:<8} {:<24} {:>18} {:>12}  {}\n",
            "class", "namespace", "beside offline", "waited", "(preemptions)"
        );
        for r in &online {
            out += &format!(
                "  {:<8} {:<24} {:>18} {:>12}  ({})\n",
                if r.class == "online_exclusive" {
                    "online!"
                } else {
                    r.class.as_str()
                },
                sanitize(&r.namespace),
                dur(r.beside_offline_s),
                dur(r.waited_s),
                r.preemptions
            );
        }
    }
    if let Some(runs) = &st.online_runs {
        let side = |s: &qos_core::stats::Summary| {
            format!("p50 {} p99 {} (n={})", ms(s.p50), ms(s.p99), s.count)
        };
        out += &format!(
            "  online runs, first launch to seen complete (doorbell): offline running {}; offline stopped {}\n",
            side(&runs.offline_running_ms),
            side(&runs.offline_stopped_ms)
        );
    }
    out
}

/// The state shown for a GPU: the machine's `offline_running` means "nothing online is
/// busy"; with no offline work on the GPU that is just idle, not offline work running.
fn shown_state(g: &crate::control::state::GpuDoc) -> String {
    let offline = g
        .processes
        .iter()
        .any(|p| p.class == qos_core::Class::Offline);
    if g.state == "offline_running" && !offline {
        "IDLE".into()
    } else {
        sanitize(&g.state.to_uppercase()).to_string()
    }
}

/// Writes to standard output; `Ok(false)` once the reader has gone (`status --json | head
/// -1`): the command then ends quietly instead of panicking on the closed pipe.
fn emit(text: &str) -> Result<bool> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
        Err(e) => Err(e).context("writing to standard output"),
    }
}

/// Runs `coloc-agent status`.
pub fn run(a: StatusArgs) -> Result<()> {
    loop {
        let body = http_get(&a.url, "/state")?;
        let st: StateDoc = serde_json::from_str(&body)
            .context("the agent's /state is not a state document (agent of another version?)")?;
        if let Some(p) = &a.plot {
            if !st.gpus.iter().any(|g| g.index == a.gpu) {
                let have: Vec<String> = st.gpus.iter().map(|g| g.index.to_string()).collect();
                bail!(
                    "GPU {} is not managed by the agent at {} (its GPUs: {}); pass --gpu",
                    a.gpu,
                    a.url,
                    if have.is_empty() {
                        "none".into()
                    } else {
                        have.join(", ")
                    }
                );
            }
            let events = &st.recent_events;
            let now = st.updated_ns;
            let t0 = events
                .first()
                .map(|e| match e {
                    crate::control::events::Event::Preempt(p) => p.decided_ns,
                    crate::control::events::Event::Release(r) => r.decided_ns,
                    crate::control::events::Event::FailOpen(f) => f.at_ns,
                    crate::control::events::Event::Distrust(d) => d.at_ns,
                    crate::control::events::Event::Escape(x) => x.at_ns,
                    crate::control::events::Event::Checkpoint(c)
                    | crate::control::events::Event::Restore(c) => c.at_ns,
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
            emit(&format!("wrote {}\n", p.display()))?;
        } else if a.json {
            if !emit(&format!("{}\n", serde_json::to_string_pretty(&st)?))? {
                return Ok(());
            }
        } else {
            let clear = if a.watch.is_some() {
                "\x1b[2J\x1b[H"
            } else {
                ""
            };
            if !emit(&format!("{clear}{}", render(&st)))? {
                return Ok(());
            }
        }
        match a.watch {
            Some(secs) if a.plot.is_none() => {
                std::thread::sleep(Duration::from_secs_f64(secs.max(0.1)))
            }
            _ => return Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::state::{GpuDoc, ProcDoc};
    use qos_core::Class;
    use std::io::Read;

    fn doc(cmds: &[&str]) -> StateDoc {
        StateDoc {
            node: "n\x1b]0;pwned\x07".into(),
            gpus: vec![GpuDoc {
                index: 0,
                uuid: "GPU-0".into(),
                state: "offline_running".into(),
                processes: cmds
                    .iter()
                    .enumerate()
                    .map(|(i, c)| ProcDoc {
                        shim: None,
                        pid: 100 + i as u32,
                        class: Class::Offline,
                        owner: "rule:off\n".into(),
                        cmd: c.to_string(),
                        suspended: false,
                        actuator: None,
                        last_active_ms_ago: None,
                        driver: None,
                        checkpointed_bytes: None,
                        escaping: false,
                        gate: None,
                        container: None,
                    })
                    .collect(),
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    #[test]
    fn render_escapes_control_characters() {
        let out = render(&doc(&["train.py\x1b[2J\x1b[31m --x\nFAKE LINE\r\u{9b}1m"]));
        assert!(
            !out.chars().any(|c| c.is_control() && c != '\n'),
            "raw control characters in:\n{out:?}"
        );
        assert!(
            out.contains("train.py\\x1b[2J\\x1b[31m --x\\nFAKE LINE\\r\\x9b1m"),
            "{out}"
        );
        assert!(out.contains("n\\x1b]0;pwned\\x07"), "{out}");
        assert!(out.contains("rule:off\\n"), "{out}");
        // One line per process: the newline in the command line did not start another.
        assert_eq!(out.lines().filter(|l| l.contains("FAKE LINE")).count(), 1);
        assert!(!out.lines().any(|l| l.starts_with("FAKE")));
    }

    #[test]
    fn an_escaping_process_and_a_silent_gate_are_shown() {
        let mut d = doc(&["train.py", "serve.py"]);
        d.gpus[0].processes[0].suspended = true;
        d.gpus[0].processes[0].escaping = true;
        d.gpus[0].processes[1].gate = Some("silent".into());
        let out = render(&d);
        assert!(
            out.lines().any(|l| l.contains("train.py")
                && l.contains("ESCAPING")
                && !l.contains("SUSPENDED")),
            "{out}"
        );
        assert!(
            out.lines()
                .any(|l| l.contains("serve.py") && l.ends_with("[gate silent]")),
            "{out}"
        );
    }

    #[test]
    fn shim_coverage_is_shown_with_its_reasons() {
        let mut d = doc(&["train.py", "serve.py"]);
        d.gpus[0].processes[0].shim = Some("refused".into());
        d.gpus[0].processes[1].shim = Some("page".into());
        d.shim_coverage = vec![
            crate::control::state::CoverageRow {
                class: "offline".into(),
                shim: "page".into(),
                processes: 1,
            },
            crate::control::state::CoverageRow {
                class: "offline".into(),
                shim: "refused".into(),
                processes: 1,
            },
        ];
        let out = render(&d);
        assert!(
            out.lines()
                .any(|l| l.contains("train.py") && l.ends_with("[no shim: refused]")),
            "{out}"
        );
        assert!(!out
            .lines()
            .any(|l| l.contains("serve.py") && l.contains("no shim")));
        assert!(
            out.contains("CUDA shim, offline processes: 1 with it, 1 without (refused 1)"),
            "{out}"
        );
    }

    #[test]
    fn what_co_location_earned_is_shown_per_class_and_namespace() {
        let mut d = doc(&[]);
        assert!(
            !render(&d).contains("earned"),
            "nothing counted yet: no section"
        );
        d.earned = vec![
            crate::earned::EarnedRow {
                namespace: "batch".into(),
                class: "offline".into(),
                harvested_s: 5400.0,
                held_s: 90.0,
                ..Default::default()
            },
            crate::earned::EarnedRow {
                namespace: "serving".into(),
                class: "online".into(),
                beside_offline_s: 7200.0,
                waited_s: 1.5,
                preemptions: 300,
                ..Default::default()
            },
        ];
        let out = render(&d);
        let lines: Vec<&str> = out.lines().collect();
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("What co-location earned")),
            "{out}"
        );
        let row = |ns: &str| {
            lines
                .iter()
                .find(|l| l.contains(ns))
                .map(|l| l.split_whitespace().collect::<Vec<_>>())
                .unwrap_or_else(|| panic!("no row {ns}: {out}"))
        };
        assert_eq!(
            row("batch"),
            ["offline", "batch", "1.50", "h", "1.5", "min"]
        );
        assert_eq!(
            row("serving"),
            ["online", "serving", "2.00", "h", "1.50", "s", "(300)"]
        );
        assert!(!out.contains("online runs"), "no run timed: no line");
        d.online_runs = Some(crate::earned::RunsDoc {
            offline_running_ms: qos_core::stats::Summary::of([12.0, 14.0]),
            offline_stopped_ms: qos_core::stats::Summary::of([5.0]),
        });
        let out = render(&d);
        assert!(
            out.lines()
                .any(|l| l.trim_start().starts_with("online runs")
                    && l.contains("offline running p50 12.00 ms")
                    && l.contains("(n=2)")
                    && l.contains("offline stopped p50 5.00 ms")),
            "{out}"
        );
    }

    #[test]
    fn a_gpu_without_offline_work_is_idle_not_offline_running() {
        let out = render(&doc(&[]));
        assert!(out.contains("GPU 0 GPU-0  IDLE"), "{out}");
        assert!(!out.contains("OFFLINE_RUNNING"), "{out}");
        let out = render(&doc(&["train.py"]));
        assert!(out.contains("OFFLINE_RUNNING"), "{out}");
    }

    /// Serves one `/state` document per connection on 127.0.0.1:0.
    fn serve(doc: StateDoc) -> String {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let body = serde_json::to_string(&doc).unwrap();
        std::thread::spawn(move || {
            for mut c in l.incoming().flatten() {
                let (mut head, mut buf) = (Vec::new(), [0u8; 256]);
                while !head.ends_with(b"\r\n\r\n") {
                    match c.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = write!(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
            }
        });
        url
    }

    #[test]
    fn plot_of_a_gpu_the_agent_does_not_have_fails_and_says_which_it_has() {
        let dir = crate::testutil::TmpDir::new("coloc-status-plot");
        let args = StatusArgs {
            url: serve(doc(&["train.py"])),
            plot: Some(dir.with_extension("svg")),
            gpu: 7,
            watch: None,
            json: false,
        };
        let e = run(args).unwrap_err().to_string();
        assert!(
            e.contains("GPU 7 is not managed") && e.contains("its GPUs: 0"),
            "{e}"
        );
        assert!(
            !dir.with_extension("svg").exists(),
            "no empty chart written"
        );
    }

    #[test]
    fn render_says_why_the_command_is_empty() {
        let out = render(&doc(&["", "python serve.py"]));
        assert!(out.contains(HIDDEN_CMD), "{out}");
        assert!(out.contains("python serve.py"), "{out}");
        assert_eq!(out.matches(HIDDEN_CMD).count(), 1);
    }
}
