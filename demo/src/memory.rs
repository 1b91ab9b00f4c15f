//! `coloc-demo --memory`: an online service that needs GPU memory offline jobs hold, on two
//! simulated 16 GiB GPUs side by side. On GPU 0 nothing manages the memory; on GPU 1 the
//! agent runs with `--memory-reserve`: it checkpoints the largest offline job (through the
//! simulated CUDA driver's checkpoint API, at the cost per GB measured on an H100), holds
//! the other with the driver's lock while online works, and restores the job after
//! `--restore-after` once online has left.
//!
//! ```text
//! GPU 0, 1: offline A (9 GiB) + offline B (3 GiB) from the start; 4 GiB free
//! t = 3 s:  online arrives, needs 6 GiB, waits for it (at most 20 s), serves for 8 s
//! ```

use anyhow::{bail, Context, Result};
use coloc_agent::control::events::{parse_log, Event};
use serde_json::Value;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// What one GPU's run gave.
#[derive(Debug, Default)]
struct Row {
    /// How long online waited for its memory; `None`: it never got it.
    waited_s: Option<f64>,
    /// Online's request latency p99, ms.
    online_p99_ms: Option<f64>,
    /// Each offline job's steps per second over its run.
    steps: Vec<f64>,
    /// Checkpoints and restores (took, s; GiB).
    checkpoints: Vec<(f64, f64)>,
    restores: Vec<(f64, f64)>,
}

/// Runs the memory demo and prints its table; `json`: the summary as JSON too.
pub fn run(a: &super::DemoArgs) -> Result<()> {
    let sim = super::sibling("coloc-sim")?;
    let (fake, me, cuda_dir) = super::agent_binaries()?;
    let id = std::process::id();
    let out = super::out_dir(a, "coloc-demo-memory")?;
    let state = Path::new("/dev/shm").join(format!("coloc-demo-memory-{id}"));
    let rules = "# coloc-demo --memory\n\
        [[rule]]\nname = \"demo-offline\"\nclass = \"reclaimed_cores\"\ncmdline = \"*coloc-sim offline*\"\ncheckpoint = true\n\
        [[rule]]\nname = \"demo-online\"\nclass = \"shared_cores\"\ncmdline = \"*coloc-sim online*\"\n";
    let rules_path = out.join("rules.toml");
    std::fs::write(&rules_path, rules)?;
    println!(
        "gpu-coloc memory demo: 2 simulated 16 GiB GPUs; checkpoints cost {} ms per GB, restores {} ms per GB (as measured on an H100); results in {}",
        a.checkpoint_ms_per_gb,
        a.restore_ms_per_gb,
        out.display()
    );
    let mut gpu = Command::new(&sim);
    gpu.args(["gpu", "--gpus", "2", "--memory-gib", "16"])
        .args(["--sample-period-ms", &a.sample_period_ms.to_string()])
        .args([
            "--checkpoint-ms-per-gb",
            &a.checkpoint_ms_per_gb.to_string(),
        ])
        .args(["--restore-ms-per-gb", &a.restore_ms_per_gb.to_string()]);
    let procs = super::start_sim(gpu, &state)?;
    let cuda = |c: &mut Command| {
        c.arg("--cuda")
            .env("LD_LIBRARY_PATH", &cuda_dir)
            .env("COLOC_SIM_STATE", &state)
            .stderr(Stdio::null());
    };
    // The jobs run until stopped (SIGTERM: they write their results).
    let mut jobs = super::Kill(Vec::new());
    for gpu in 0..2u32 {
        for (name, mib) in [("a", 9 * 1024), ("b", 3 * 1024)] {
            let mut c = Command::new(&sim);
            c.args(["offline", "--gpu", &gpu.to_string(), "--step-ms", "5"])
                .args(["--queue-depth", "4", "--mem-mib", &mib.to_string()])
                .arg("--out")
                .arg(out.join(format!("offline-{name}-g{gpu}.json")));
            cuda(&mut c);
            jobs.0.push(c.spawn()?);
        }
    }
    let events = out.join("events.jsonl");
    let _ = std::fs::remove_file(&events);
    let agent = super::agent_command(
        &me,
        &fake,
        &rules_path,
        &state,
        &events,
        coloc_agent::edges::actuator::Kind::Signal,
        "127.0.0.1:0",
    )
    .args(["--gpus", "1"])
    .arg("--nvml-sample-period")
    .arg(format!("{}us", (a.sample_period_ms * 1000.0) as u64))
    .args(["--memory-reserve", "6GiB", "--restore-after", "5s"])
    .arg("--cuda-lib")
    .arg(cuda_dir.join("libcuda.so.1"))
    .env("COLOC_SIM_STATE", &state)
    .stderr(std::fs::File::create(out.join("agent.log"))?)
    .spawn()
    .context("starting the agent")?;
    let mut agent = super::Kill(vec![agent]);
    std::thread::sleep(Duration::from_secs(3));
    if let Some(st) = agent.0[0].try_wait()? {
        bail!(
            "agent exited at start ({st}); see {}",
            out.join("agent.log").display()
        );
    }
    println!("t = 3 s: an online service arrives on each GPU, needing 6 GiB (4 GiB are free)");
    let mut online: Vec<Child> = Vec::new();
    for gpu in 0..2u32 {
        let mut c = Command::new(&sim);
        c.args(["online", "--gpu", &gpu.to_string(), "--duration-s", "8"])
            .args(["--rate", "10", "--work-ms", "20", "--mem-mib", "6144"])
            .args(["--mem-wait-s", "20"])
            .arg("--out")
            .arg(out.join(format!("online-g{gpu}.json")))
            .stdout(std::fs::File::create(
                out.join(format!("online-g{gpu}.out")),
            )?);
        cuda(&mut c);
        online.push(c.spawn()?);
    }
    let deadline = Instant::now() + Duration::from_secs(40);
    for c in &mut online {
        while c.try_wait()?.is_none() {
            if Instant::now() > deadline {
                let _ = c.kill();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    println!("online done; waiting for the agent's restore (--restore-after 5s)");
    let restored = Instant::now() + Duration::from_secs(20);
    while Instant::now() < restored {
        let done = parse_log(&std::fs::read_to_string(&events).unwrap_or_default())
            .iter()
            .any(|e| matches!(e, Event::Restore(r) if r.ok));
        if done {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(1));
    drop(jobs);
    drop(agent);
    drop(procs);
    let _ = std::fs::remove_file(&state);
    let _ = std::fs::remove_dir_all(state.with_extension("agent"));
    let _ = std::fs::remove_dir_all(state.with_extension("bells"));

    let evs = parse_log(&std::fs::read_to_string(&events).unwrap_or_default());
    let mut rows = Vec::new();
    for gpu in 0..2u32 {
        let mut r = Row {
            waited_s: std::fs::read_to_string(out.join(format!("online-g{gpu}.out")))
                .ok()
                .and_then(|t| serde_json::from_str::<Value>(t.lines().next()?).ok())
                .and_then(|v| v["memory_wait_s"].as_f64()),
            ..Row::default()
        };
        if let Ok(v) = super::read_json(&out.join(format!("online-g{gpu}.json"))) {
            // Records: [arrival, start, done], ns.
            let lat: Vec<f64> = v["records"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|r| (r[2].as_f64().unwrap_or(0.0) - r[0].as_f64().unwrap_or(0.0)) / 1e6)
                .collect();
            if !lat.is_empty() {
                r.online_p99_ms = Some(super::pct(lat, 0.99));
            }
        }
        for name in ["a", "b"] {
            let steps = super::read_json(&out.join(format!("offline-{name}-g{gpu}.json")))
                .ok()
                .and_then(|v| v["steps_per_s"].as_f64())
                .unwrap_or(f64::NAN);
            r.steps.push(steps);
        }
        for e in &evs {
            match e {
                Event::Checkpoint(c) if c.gpu == Some(gpu) && c.ok => r
                    .checkpoints
                    .push((c.took_s, c.bytes as f64 / (1u64 << 30) as f64)),
                Event::Restore(c) if c.gpu == Some(gpu) && c.ok => r
                    .restores
                    .push((c.took_s, c.bytes as f64 / (1u64 << 30) as f64)),
                _ => {}
            }
        }
        rows.push(r);
    }
    print_table(&rows);
    if let Some(p) = &a.json {
        let j: Vec<Value> = rows
            .iter()
            .zip(["no-agent", "agent"])
            .map(|(r, s)| {
                serde_json::json!({
                    "scenario": s,
                    "online_memory_wait_s": r.waited_s,
                    "online_p99_ms": r.online_p99_ms,
                    "offline_steps": r.steps,
                    "checkpoints": r.checkpoints,
                    "restores": r.restores,
                })
            })
            .collect();
        std::fs::write(
            p,
            serde_json::to_vec_pretty(&serde_json::json!({ "memory": j }))?,
        )?;
    }
    if rows[1].waited_s.is_none() {
        bail!(
            "with the agent, online never got its memory: see {}",
            out.join("agent.log").display()
        );
    }
    Ok(())
}

fn print_table(rows: &[Row]) {
    let secs = |v: &[(f64, f64)]| {
        if v.is_empty() {
            "-".to_string()
        } else {
            v.iter()
                .map(|(s, g)| format!("{s:.1} s ({g:.0} GiB)"))
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    println!();
    println!(
        "| GPU | memory | online waited for 6 GiB | online p99 | offline steps/s (9 GiB job, 3 GiB job) | checkpoint | restore |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (gpu, (r, what)) in rows
        .iter()
        .zip(["nothing manages it", "the agent"])
        .enumerate()
    {
        println!(
            "| {gpu} | {what} | {} | {} | {:.0}, {:.0} | {} | {} |",
            r.waited_s
                .map_or("never (gave up after 20 s)".into(), |w| format!("{w:.1} s")),
            r.online_p99_ms.map_or("-".into(), |p| format!("{p:.1} ms")),
            r.steps.first().copied().unwrap_or(f64::NAN),
            r.steps.get(1).copied().unwrap_or(f64::NAN),
            secs(&r.checkpoints),
            secs(&r.restores),
        );
    }
}
