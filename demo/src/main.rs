//! `coloc-demo`: gpu-coloc's co-location on a simulated GPU, on any Linux host (no GPU, no
//! cluster). Not part of the product: it drives the product's binary like a user would.
//!
//! Runs four simulated GPUs side by side for the same time, with the same online request
//! sequence on each:
//!
//! | GPU | workload                         | shows                         |
//! |-----|----------------------------------|-------------------------------|
//! | 0   | online alone                     | the latency online should get |
//! | 1   | offline alone                    | offline's full speed          |
//! | 2   | online + offline, no agent       | uncontrolled sharing          |
//! | 3   | online + offline, agent managing | gpu-coloc                     |
//!
//! The agent is the real `coloc-agent run` next to this binary, loading the fake NVML
//! library through its normal NVML path; processes and signals (or cgroups) are real. The
//! agent and every workload are stopped on the way out, also when the demo fails.

use anyhow::{bail, Context, Result};
use clap::Parser;
use coloc_agent::control::events::{parse_log, Event};
use coloc_agent::edges::actuator::{CgroupMounts, Kind};
use coloc_sim::command_in_cgroup;
use qos_core::stats::percentile;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// gpu-coloc demo: online and offline workloads on simulated GPUs, without and with the
/// agent, then a table of online latency and offline progress, and a timeline picture.
#[derive(Parser, Debug, Clone)]
#[command(version, about, long_about = None)]
pub struct DemoArgs {
    /// How long each workload runs, seconds.
    #[arg(long, default_value_t = 20.0)]
    pub duration_s: f64,
    /// Actuator the agent uses (freezer puts offline work in its own cgroup; needs root).
    #[arg(long, value_enum, default_value_t = Kind::Signal)]
    pub actuator: Kind,
    /// Online requests per second (Poisson arrivals).
    #[arg(long, default_value_t = 2.0)]
    pub online_rate: f64,
    /// GPU time per online request, ms.
    #[arg(long, default_value_t = 20.0)]
    pub online_work_ms: f64,
    /// GPU time per offline step, ms (also what keeps running after a stop: the drain).
    #[arg(long, default_value_t = 2.0)]
    pub offline_step_ms: f64,
    /// Simulated driver sample period, ms.
    #[arg(long, default_value_t = 1.0)]
    pub sample_period_ms: f64,
    /// Agent idle window.
    #[arg(long, default_value = "100ms", value_parser = coloc_agent::cli::parse_duration)]
    pub idle_window: Duration,
    /// Agent poll interval.
    #[arg(long, default_value = "1ms", value_parser = coloc_agent::cli::parse_duration)]
    pub poll_interval: Duration,
    /// Directory for the workloads' results, the agent's log and event log (default: a
    /// new directory under /tmp).
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
    /// Write the summary as JSON to this file as well.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Finds a sibling binary of the running executable (same cargo target directory).
fn sibling(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe.parent().context("executable has no directory")?;
    let p = dir.join(name);
    if !p.exists() {
        bail!(
            "{} not found next to {}: build the whole workspace first \
             (cargo build --release --workspace)",
            name,
            exe.display()
        );
    }
    Ok(p)
}

/// Children stopped on the way out, the demo's error paths included: SIGTERM (the agent
/// resumes offline work before it exits), then SIGKILL after 5 s.
struct Kill(Vec<Child>);
impl Drop for Kill {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(c.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        for c in &mut self.0 {
            while matches!(c.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            if matches!(c.try_wait(), Ok(None)) {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

fn read_json(p: &Path) -> Result<Value> {
    let b = std::fs::read(p).with_context(|| format!("reading {}", p.display()))?;
    Ok(serde_json::from_slice(&b)?)
}

fn pct(mut v: Vec<f64>, q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    percentile(&v, q).unwrap_or(f64::NAN)
}

fn main() {
    if let Err(err) = run(DemoArgs::parse()) {
        eprintln!("coloc-demo: {err:#}");
        std::process::exit(1);
    }
}

/// Runs the demo and prints the table.
fn run(a: DemoArgs) -> Result<()> {
    let sim = sibling("coloc-sim")?;
    let fake = sibling("libfake_nvml.so")?;
    let me = sibling("coloc-agent")?;
    let id = std::process::id();
    let out = match &a.out_dir {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("coloc-demo-{id}")),
    };
    std::fs::create_dir_all(&out)?;
    let shm = Path::new("/dev/shm");
    let state = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        out.clone()
    }
    .join(format!("coloc-demo-{id}"));

    // Offline work on GPU 3 goes in its own cgroup when the freezer is used.
    let mut cgroup_dir: Option<PathBuf> = None;
    let mut rules = String::from("# coloc-agent demo rules\n");
    if a.actuator == Kind::Freezer {
        let mounts = CgroupMounts::detect(Path::new("/sys/fs/cgroup"));
        let base = mounts
            .v2
            .or(mounts.v1_freezer)
            .context("--actuator freezer: no cgroup v2 or v1 freezer under /sys/fs/cgroup")?;
        let dir = base.join(format!("coloc-demo-{id}"));
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("creating cgroup {} (needs root)", dir.display()))?;
        rules += &format!(
            "[[rule]]\nname = \"demo-offline\"\nclass = \"reclaimed_cores\"\ncgroup = \"/coloc-demo-{id}\"\n"
        );
        cgroup_dir = Some(dir);
    } else {
        rules += "[[rule]]\nname = \"demo-offline\"\nclass = \"reclaimed_cores\"\ncmdline = \"*coloc-sim offline*\"\n";
    }
    rules += "[[rule]]\nname = \"demo-online\"\nclass = \"shared_cores\"\ncmdline = \"*coloc-sim online*\"\n";
    let rules_path = out.join("rules.toml");
    std::fs::write(&rules_path, rules)?;

    println!(
        "gpu-coloc demo: 4 simulated GPUs, {} s, actuator {}, results in {}",
        a.duration_s,
        a.actuator.as_str(),
        out.display()
    );
    let mut procs = Kill(Vec::new());
    procs.0.push(
        Command::new(&sim)
            .args(["gpu", "--gpus", "4", "--sample-period-ms"])
            .arg(a.sample_period_ms.to_string())
            .env("COLOC_SIM_STATE", &state)
            .stderr(Stdio::null())
            .spawn()?,
    );
    let t0 = Instant::now();
    while std::fs::metadata(&state)
        .map(|m| m.len() == 0)
        .unwrap_or(true)
    {
        if t0.elapsed() > Duration::from_secs(5) {
            bail!("simulated GPU did not start");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(100));

    let events = out.join("events.jsonl");
    let _ = std::fs::remove_file(&events);
    let agent_log = std::fs::File::create(out.join("agent.log"))?;
    let agent = Command::new(&me)
        .args([
            "run",
            "--gpus",
            "3",
            "--listen",
            "127.0.0.1:0",
            "--actuator",
            a.actuator.as_str(),
        ])
        .arg("--rules")
        .arg(&rules_path)
        .arg("--nvml-lib")
        .arg(&fake)
        .arg("--state-dir")
        .arg(state.with_extension("agent"))
        .arg("--event-log")
        .arg(&events)
        .arg("--idle-window")
        .arg(format!("{}us", a.idle_window.as_micros()))
        .arg("--poll-interval")
        .arg(format!("{}us", a.poll_interval.as_micros()))
        .env("COLOC_SIM_STATE", &state)
        .stderr(agent_log)
        .spawn()
        .context("starting the agent")?;
    let mut agent = Kill(vec![agent]);
    std::thread::sleep(Duration::from_millis(500));
    if let Some(st) = agent.0[0].try_wait()? {
        bail!(
            "agent exited at start ({st}); see {}",
            out.join("agent.log").display()
        );
    }

    let dur = a.duration_s.to_string();
    let online = |gpu: u32, name: &str| -> Result<Child> {
        Ok(Command::new(&sim)
            .args([
                "online",
                "--gpu",
                &gpu.to_string(),
                "--duration-s",
                &dur,
                "--seed",
                "7",
            ])
            .args([
                "--rate",
                &a.online_rate.to_string(),
                "--work-ms",
                &a.online_work_ms.to_string(),
            ])
            .arg("--out")
            .arg(out.join(name))
            .env("COLOC_SIM_STATE", &state)
            .spawn()?)
    };
    let offline = |gpu: u32, name: &str, cgroup: Option<&Path>| -> Result<Child> {
        let mut args: Vec<String> = vec![
            "offline".into(),
            "--gpu".into(),
            gpu.to_string(),
            "--duration-s".into(),
            dur.clone(),
            "--step-ms".into(),
            a.offline_step_ms.to_string(),
            "--out".into(),
            out.join(name).display().to_string(),
        ];
        let mut cmd = match cgroup {
            Some(cg) => command_in_cgroup(cg, &sim),
            None => Command::new(&sim),
        };
        cmd.args(args.drain(..));
        Ok(cmd.env("COLOC_SIM_STATE", &state).spawn()?)
    };
    let mut work = vec![
        online(0, "online-alone.json")?,
        offline(1, "offline-alone.json", None)?,
        online(2, "online-noagent.json")?,
        offline(2, "offline-noagent.json", None)?,
        online(3, "online-agent.json")?,
        offline(3, "offline-agent.json", cgroup_dir.as_deref())?,
    ];
    // Workloads end by themselves after the duration; never wait forever on one.
    let deadline = Instant::now() + Duration::from_secs_f64(a.duration_s + 30.0);
    for w in &mut work {
        loop {
            if let Some(st) = w.try_wait()? {
                if !st.success() {
                    bail!("a workload failed ({st})");
                }
                break;
            }
            if Instant::now() > deadline {
                for w in &mut work {
                    let _ = w.kill();
                }
                bail!(
                    "workloads did not finish within {} s; results in {}",
                    a.duration_s + 30.0,
                    out.display()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent.0[0].id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )?;
    let mut child = agent.0.pop().context("agent")?;
    let st = child.wait()?;
    drop(procs);
    if let Some(cg) = &cgroup_dir {
        let _ = std::fs::remove_dir(cg);
    }
    let _ = std::fs::remove_file(&state);
    if !st.success() {
        bail!(
            "agent exited with {st}; see {}",
            out.join("agent.log").display()
        );
    }

    let mut summary = summarize(&out, &events, a.duration_s)?;
    let svg = out.join("timeline.svg");
    write_timeline(&out, &events, &svg)?;
    summary["timeline"] = serde_json::json!(svg.display().to_string());
    print_table(&summary);
    println!(
        "timeline (online busy, offline suspended, request latency): {}",
        svg.display()
    );
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_vec_pretty(&summary)?)?;
    }
    Ok(())
}

/// Reads the workloads' results and the agent's event log into one summary.
fn summarize(out: &Path, events: &Path, duration_s: f64) -> Result<Value> {
    let on = |n: &str| read_json(&out.join(n));
    let (alone, noagent, agent) = (
        on("online-alone.json")?,
        on("online-noagent.json")?,
        on("online-agent.json")?,
    );
    let (off_alone, off_noagent, off_agent) = (
        on("offline-alone.json")?,
        on("offline-noagent.json")?,
        on("offline-agent.json")?,
    );
    // Share of the time online leaves the GPU idle, from the online-alone run.
    let busy_ns: f64 = alone["records"]
        .as_array()
        .map(|r| {
            r.iter()
                .map(|x| x[2].as_f64().unwrap_or(0.0) - x[1].as_f64().unwrap_or(0.0))
                .sum()
        })
        .unwrap_or(0.0);
    let idle_fraction = (1.0 - busy_ns / (duration_s * 1e9)).clamp(0.0, 1.0);
    let evs = parse_log(&std::fs::read_to_string(events).unwrap_or_default());
    let ms = |v: Option<f64>| v.map(|s| s * 1e3);
    let pre: Vec<f64> = evs
        .iter()
        .filter_map(|e| match e {
            Event::Preempt(p) => ms(p.preemption_s),
            _ => None,
        })
        .collect();
    let det: Vec<f64> = evs
        .iter()
        .filter_map(|e| match e {
            Event::Preempt(p) => Some(p.detection_s * 1e3),
            _ => None,
        })
        .collect();
    let rel: Vec<f64> = evs
        .iter()
        .filter_map(|e| match e {
            Event::Release(r) => ms(r.release_s),
            _ => None,
        })
        .collect();
    let fail_opens = evs
        .iter()
        .filter(|e| matches!(e, Event::FailOpen(_)))
        .count();
    let steps = |v: &Value| v["steps_per_s"].as_f64().unwrap_or(0.0);
    let idle_share = steps(&off_agent) / (steps(&off_alone) * idle_fraction).max(1e-9);
    Ok(serde_json::json!({
        "online_alone": {"p50_ms": alone["p50_ms"], "p99_ms": alone["p99_ms"], "requests": alone["requests"]},
        "online_no_agent": {"p50_ms": noagent["p50_ms"], "p99_ms": noagent["p99_ms"], "requests": noagent["requests"]},
        "online_agent": {"p50_ms": agent["p50_ms"], "p99_ms": agent["p99_ms"], "requests": agent["requests"]},
        "offline_alone_steps_per_s": steps(&off_alone),
        "offline_no_agent_steps_per_s": steps(&off_noagent),
        "offline_agent_steps_per_s": steps(&off_agent),
        "online_idle_fraction": idle_fraction,
        "offline_share_of_idle": idle_share,
        "preemptions": pre.len(),
        "fail_opens": fail_opens,
        "preemption_ms": {"p50": pct(pre.clone(), 50.0), "p99": pct(pre, 99.0)},
        "detection_ms": {"p50": pct(det.clone(), 50.0), "p99": pct(det, 99.0)},
        "release_ms": {"p50": pct(rel.clone(), 50.0), "p99": pct(rel, 99.0)},
        "p99_ratio_agent": agent["p99_ms"].as_f64().unwrap_or(0.0) / alone["p99_ms"].as_f64().unwrap_or(1.0).max(1e-9),
        "p99_ratio_no_agent": noagent["p99_ms"].as_f64().unwrap_or(0.0) / alone["p99_ms"].as_f64().unwrap_or(1.0).max(1e-9),
    }))
}

fn print_table(s: &Value) {
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    println!();
    println!(
        "{:<34} {:>12} {:>12} {:>16}",
        "scenario", "online p50", "online p99", "offline steps/s"
    );
    println!(
        "{:<34} {:>9.1} ms {:>9.1} ms {:>16}",
        "online alone (GPU 0)",
        f(&s["online_alone"]["p50_ms"]),
        f(&s["online_alone"]["p99_ms"]),
        "-"
    );
    println!(
        "{:<34} {:>12} {:>12} {:>16.1}",
        "offline alone (GPU 1)",
        "-",
        "-",
        f(&s["offline_alone_steps_per_s"])
    );
    println!(
        "{:<34} {:>9.1} ms {:>9.1} ms {:>16.1}",
        "online + offline, no agent (GPU 2)",
        f(&s["online_no_agent"]["p50_ms"]),
        f(&s["online_no_agent"]["p99_ms"]),
        f(&s["offline_no_agent_steps_per_s"])
    );
    println!(
        "{:<34} {:>9.1} ms {:>9.1} ms {:>16.1}",
        "online + offline, gpu-coloc (GPU 3)",
        f(&s["online_agent"]["p50_ms"]),
        f(&s["online_agent"]["p99_ms"]),
        f(&s["offline_agent_steps_per_s"])
    );
    println!();
    println!(
        "online p99 vs alone:      no agent {:.2}x, with gpu-coloc {:.2}x",
        f(&s["p99_ratio_no_agent"]),
        f(&s["p99_ratio_agent"])
    );
    println!(
        "offline share of the time online leaves idle ({:.0} % idle): {:.0} %",
        100.0 * f(&s["online_idle_fraction"]),
        100.0 * f(&s["offline_share_of_idle"])
    );
    println!(
        "preemptions: {}   preemption latency p50 {:.2} ms, p99 {:.2} ms (detection p50 {:.2} ms)",
        s["preemptions"],
        f(&s["preemption_ms"]["p50"]),
        f(&s["preemption_ms"]["p99"]),
        f(&s["detection_ms"]["p50"])
    );
    println!(
        "release latency (after the idle window) p50 {:.2} ms, p99 {:.2} ms",
        f(&s["release_ms"]["p50"]),
        f(&s["release_ms"]["p99"])
    );
}

/// Writes the demo's timeline picture: GPU 3's busy/suspended periods from the agent's
/// event log, and online request latency with and without the agent.
fn write_timeline(out: &Path, events: &Path, svg: &Path) -> Result<()> {
    let evs = parse_log(&std::fs::read_to_string(events).unwrap_or_default());
    let recs = |name: &str| -> Result<Vec<(u64, u64)>> {
        Ok(read_json(&out.join(name))?["records"]
            .as_array()
            .map(|r| {
                r.iter()
                    .map(|x| (x[0].as_u64().unwrap_or(0), x[2].as_u64().unwrap_or(0)))
                    .collect()
            })
            .unwrap_or_default())
    };
    let (with, without) = (recs("online-agent.json")?, recs("online-noagent.json")?);
    let t0 = with
        .first()
        .map(|r| r.0)
        .unwrap_or(0)
        .saturating_sub(200_000_000);
    let t1 = with.last().map(|r| r.1).unwrap_or(t0) + 200_000_000;
    let doc = coloc_agent::cmd::timeline::svg(
        "gpu-coloc demo: GPU 3 (online + offline, agent managing)",
        &evs,
        3,
        &[
            ("online, with gpu-coloc", "#1f77b4", &with),
            ("online, no agent (GPU 2)", "#999999", &without),
        ],
        t0,
        t1,
    );
    std::fs::write(svg, doc).with_context(|| format!("writing {}", svg.display()))
}
