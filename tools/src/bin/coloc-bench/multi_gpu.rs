//! `coloc-bench --multi-gpu`: the agent's cost on a busy node. 8 simulated GPUs (1 ms
//! sample period), 8 offline processes per GPU (continuous 2 ms steps), and on every GPU
//! an independent online process with bursty work: bursts of 5–20 ms of GPU time (uniform)
//! separated by exponential idle gaps (mean 200 ms), from a seeded RNG so runs compare.
//! With the default 100 ms idle window each GPU goes through a few preemptions and releases
//! a second. The real agent binary runs with its defaults (`--poll-interval 1ms`,
//! `--idle-poll-interval 10ms`, `--idle-window 100ms`, `--loop-nice -10`) plus the
//! actuator, the rules and `--event-log`.
//!
//! Reports agent CPU (schedstat delta of every thread / wall time, and utime+stime from
//! /proc/<pid>/stat as a cross-check), RSS, preemptions and releases, their latencies (from
//! the event log), fail-opens and actuation errors (from /metrics at the end), loop lag p99
//! (from the `coloc_loop_lag_seconds` histogram buckets), and how many offline processes
//! were still stopped or frozen after the agent exited (must be 0).
//!
//! The online workers are this binary re-executed (`coloc-bench --online-worker ...`, one
//! process per GPU), so each GPU's online work is its own process, as in production.

use super::{cpu_ns, rss_kib};
use coloc_tools::*;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Scenario parameters (command-line options of `--multi-gpu`).
#[derive(Debug, Clone)]
pub struct Opts {
    pub gpus: u32,
    pub offline_per_gpu: usize,
    pub duration_s: f64,
    pub actuator: String,
    pub step_ms: f64,
    pub burst_min_ms: f64,
    pub burst_max_ms: f64,
    pub gap_mean_ms: f64,
    pub seed: u64,
    pub json: Option<PathBuf>,
    pub keep_logs: Option<PathBuf>,
    /// Online submits through the CUDA driver API under `libcoloc_cuda.so`, the driver
    /// samples every 100 ms and the agent reads NVML at its default interval.
    pub doorbell: bool,
    /// `--nvml-only`: the shipped defaults seen through NVML alone: the simulated driver
    /// samples every 200 ms (an H100's period), the agent runs at its own defaults
    /// (nothing overridden), online submits without the shim.
    pub nvml_only: bool,
    /// `--flood N`: one pod's doorbell directory holds N files that are not pages, and a
    /// thread creates and removes files there in a loop for the whole run (a tenant
    /// flooding its own directory); 0: none.
    pub flood: usize,
    /// `--state-dir DIR`: the agent's state directory (a slow disk, to measure what its
    /// record costs); default: a fresh one under /dev/shm.
    pub state_dir: Option<PathBuf>,
}

pub const USAGE: &str = "\
coloc-bench --multi-gpu [--gpus 8] [--offline-per-gpu 8] [--duration-s 60]
            [--actuator signal|freezer] [--step-ms 2] [--burst-ms 5-20]
            [--gap-mean-ms 200] [--seed 1] [--json FILE] [--keep-logs DIR] [--doorbell]
            [--nvml-only] [--flood N] [--state-dir DIR]
    Agent cost on a busy node: GPUS simulated GPUs (1 ms sample period), OFFLINE-PER-GPU
    offline processes per GPU (continuous STEP-MS steps; with the freezer actuator each
    GPU's offline processes share one cgroup, declared offline by a rules `cgroup`
    matcher), and per GPU one online process with bursts of uniform BURST-MS of GPU time
    separated by exponential idle gaps (mean GAP-MEAN-MS), seeded. The release agent runs
    with its defaults (--poll-interval 1ms). Prints a Markdown table; --json writes the
    figures; --keep-logs copies the agent's log and event log into DIR.
    --duration-s 600 is the soak variant. Needs root for the freezer actuator.
    --doorbell: the realistic setting: the simulated driver samples every 100 ms, the agent
    reads NVML at its defaults (every 100 ms), and each online process submits through the
    simulated libcuda.so.1 under libcoloc_cuda.so (class online), so online work is seen
    at the launch.
    --nvml-only: the shipped defaults seen through NVML alone: the simulated driver samples
    every 200 ms, the agent runs at its own defaults (no --poll-interval), online work
    without the shim (e.g. --burst-ms 5-5 --gap-mean-ms 100: 10 bursts/s of 5 ms).
    --flood N (with --doorbell): a pod directory under the agent's doorbell directory
    holds N files named like pages that are not, and a thread creates and removes files
    there in a loop for the whole run: what a tenant flooding its own directory costs the
    others.
    --state-dir DIR: the agent's state directory (its fail-open record), e.g. on a disk
    whose fdatasync is slow (benches/slow-dir.py mounts one).";

fn opt<'a>(args: &'a [String], k: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == k)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

fn num<T: std::str::FromStr>(args: &[String], k: &str, default: T) -> T {
    match opt(args, k) {
        None => default,
        Some(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{k}: cannot parse {v:?}\n\n{USAGE}")),
    }
}

impl Opts {
    pub fn parse(args: &[String]) -> Opts {
        let (burst_min_ms, burst_max_ms) = match opt(args, "--burst-ms") {
            None => (5.0, 20.0),
            Some(v) => {
                let (a, b) = v.split_once('-').unwrap_or((v, v));
                (
                    a.parse().expect("--burst-ms MIN-MAX"),
                    b.parse().expect("--burst-ms MIN-MAX"),
                )
            }
        };
        let actuator = opt(args, "--actuator").unwrap_or("signal").to_string();
        assert!(
            actuator == "signal" || actuator == "freezer",
            "--actuator must be signal or freezer\n\n{USAGE}"
        );
        Opts {
            gpus: num(args, "--gpus", 8),
            offline_per_gpu: num(args, "--offline-per-gpu", 8),
            duration_s: num(args, "--duration-s", 60.0),
            actuator,
            step_ms: num(args, "--step-ms", 2.0),
            burst_min_ms,
            burst_max_ms,
            gap_mean_ms: num(args, "--gap-mean-ms", 200.0),
            seed: num(args, "--seed", 1),
            json: opt(args, "--json").map(PathBuf::from),
            keep_logs: opt(args, "--keep-logs").map(PathBuf::from),
            doorbell: args.iter().any(|a| a == "--doorbell"),
            nvml_only: args.iter().any(|a| a == "--nvml-only"),
            flood: num(args, "--flood", 0),
            state_dir: opt(args, "--state-dir").map(PathBuf::from),
        }
    }
}

/// splitmix64: a small seeded generator (the e2e crate has no `rand`).
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in (0, 1].
    fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }
}

/// `coloc-bench --online-worker --state S --gpu G --seed N --duration-s D --burst-ms A-B
/// --gap-mean-ms M --out FILE`: one GPU's bursty online process. Writes a JSON summary.
pub fn online_worker(args: &[String]) {
    let state = PathBuf::from(opt(args, "--state").expect("--state"));
    let gpu: u32 = num(args, "--gpu", 0);
    let o = Opts::parse(args);
    let sim = coloc_sim::SimGpu::open(&state).expect("open simulated GPU state");
    // Through the driver API (under the shim, in --doorbell runs), or the slot directly.
    let (slot, drv) = if o.doorbell {
        (None, Some(coloc_tools::cuda::Driver::open(gpu as i32)))
    } else {
        (
            Some(sim.register(gpu, 1 << 30).expect("register online slot")),
            None,
        )
    };
    let mut rng = Rng(o.seed ^ (u64::from(gpu) + 1).wrapping_mul(0x2545_f491_4f6c_dd1d));
    let end = Instant::now() + Duration::from_secs_f64(o.duration_s);
    let mut extra_ms = Vec::new(); // wall time of a burst minus its GPU time
    let mut busy_ms = 0.0;
    loop {
        let gap = -rng.unit().ln() * o.gap_mean_ms;
        let burst = o.burst_min_ms + (o.burst_max_ms - o.burst_min_ms) * rng.unit();
        let wake = Instant::now() + Duration::from_secs_f64(gap / 1e3);
        if wake >= end {
            break;
        }
        std::thread::sleep(wake - Instant::now());
        let t = Instant::now();
        match (&slot, &drv) {
            (Some(slot), _) => {
                let target = slot.submit((burst * 1e6) as u64);
                slot.wait_completed(target);
            }
            (None, Some(d)) => {
                d.launch((burst * 1e6) as u64);
                d.synchronize();
            }
            (None, None) => unreachable!(),
        }
        extra_ms.push(t.elapsed().as_secs_f64() * 1e3 - burst);
        busy_ms += burst;
    }
    let out = serde_json::json!({
        "gpu": gpu, "bursts": extra_ms.len(), "busy_ms": busy_ms,
        "slowdown_ms": {"p50": percentile(&extra_ms, 50.0), "p99": percentile(&extra_ms, 99.0), "max": percentile(&extra_ms, 100.0)},
    });
    if let Some(p) = opt(args, "--out") {
        std::fs::write(p, out.to_string()).expect("write worker summary");
    }
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// utime + stime of the whole process (reaped threads included), seconds.
fn cpu_ticks_s(pid: u32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = s.rfind(')').map(|i| &s[i + 2..]).unwrap_or("");
    let f: Vec<u64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    // After the comm field: state is index 0, utime 11, stime 12.
    let ticks = f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    ticks as f64 / hz
}

fn status_kib(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Quantile of a Prometheus histogram from its cumulative buckets: the upper bound of the
/// first bucket holding `q` of the observations (so "p99 ≤ this"), seconds.
fn hist_quantile(text: &str, name: &str, q: f64) -> Option<f64> {
    let bucket = format!("{name}_bucket");
    let mut b: Vec<(f64, f64)> = text
        .lines()
        .filter(|l| l.starts_with(&bucket))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, l.rsplit(' ').next()?.parse().ok()?))
        })
        .collect();
    b.sort_by(|x, y| x.0.total_cmp(&y.0));
    let total = b.last()?.1;
    if total <= 0.0 {
        return None;
    }
    b.iter().find(|x| x.1 >= q * total).map(|x| x.0)
}

/// `name{labels} value` lines of a counter, as (labels, value).
fn series(text: &str, name: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#') && l.split(['{', ' ']).next() == Some(name))
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k[name.len()..].to_string(), v.parse().ok()?))
        })
        .collect()
}

pub fn run(o: &Opts) -> serde_json::Value {
    let load_before = loadavg();
    assert!(
        !(o.doorbell && o.nvml_only),
        "--doorbell and --nvml-only exclude each other\n\n{USAGE}"
    );
    let period = if o.nvml_only {
        "200"
    } else if o.doorbell {
        "100"
    } else {
        "1"
    };
    let sim = Sim::start(o.gpus, &["--sample-period-ms", period]);
    let group = unique("coloc-bench-mgpu");
    // Freezer: one cgroup per GPU holding that GPU's offline processes.
    let children: Vec<String> = (0..o.gpus).map(|g| format!("gpu{g}")).collect();
    let (cgroups, rules) = coloc_tools::offline_rules(&group, &children, o.actuator == "freezer");
    let events = std::env::temp_dir().join(format!("{group}-events.jsonl"));
    let mut agent_args = vec!["--event-log".to_string(), events.display().to_string()];
    if !o.nvml_only {
        agent_args.extend(["--poll-interval".into(), "1ms".into()]);
    }
    let (rules, env) = if o.doorbell {
        (
            rules + "[[rule]]\nname = \"svc\"\nclass = \"shared_cores\"\ncmdline = \"*--online-worker*\"\n",
            vec![
                ("COLOC_NVML_INTERVAL", "100ms".to_string()),
                ("COLOC_NVML_SAMPLE_PERIOD", "100ms".to_string()),
            ],
        )
    } else if o.nvml_only {
        // The shipped defaults (the harness's environment would read NVML every 1 ms).
        (
            rules,
            vec![
                ("COLOC_NVML_INTERVAL", "100ms".to_string()),
                ("COLOC_NVML_SAMPLE_PERIOD", "200ms".to_string()),
            ],
        )
    } else {
        (rules, vec![])
    };
    let mut agent = Agent::start(
        &sim,
        AgentOpts {
            rules: &rules,
            actuator: &o.actuator,
            extra: agent_args.clone(),
            env,
            state_dir: o.state_dir.clone(),
        },
    );
    let pid = agent.child.as_ref().unwrap().id();
    let step = o.step_ms.to_string();
    let mut offline = Vec::new();
    for g in 0..o.gpus {
        let gs = g.to_string();
        let a = [
            "offline",
            "--gpu",
            &gs,
            "--step-ms",
            &step,
            "--tag",
            "bench",
        ];
        for _ in 0..o.offline_per_gpu {
            offline.push(if o.actuator == "freezer" {
                sim.spawn_in_cgroup(&cgroups[g as usize + 1].dir, &a)
            } else {
                sim.spawn(&a)
            });
        }
    }
    let seen = |a: &Agent| -> usize {
        a.state()["gpus"]
            .as_array()
            .map(|gs| {
                gs.iter()
                    .filter_map(|g| g["processes"].as_array().map(Vec::len))
                    .sum()
            })
            .unwrap_or(0)
    };
    let want = o.gpus as usize * o.offline_per_gpu;
    wait_for("agent sees all offline", Duration::from_secs(30), || {
        seen(&agent) >= want
    })
    .unwrap_or_else(|e| panic!("{e}: saw {}\n{}", seen(&agent), agent.log_text()));
    std::thread::sleep(Duration::from_millis(500));
    // A tenant flooding its own doorbell directory, for the whole run.
    let flood_stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut flood_writes = None;
    let flood_dir = agent
        .doorbell_dir
        .join("pods")
        .join("f100d000-0000-4000-8000-000000000001");
    if o.flood > 0 {
        std::fs::create_dir_all(&flood_dir).expect("flood directory");
        for i in 0..o.flood {
            std::fs::write(flood_dir.join(format!("junk{i}.bell")), b"").expect("flood file");
        }
        let (dir, stop) = (flood_dir.clone(), flood_stop.clone());
        flood_writes = Some(std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                // Created and removed: every change is an inotify event.
                let f = dir.join(format!("loop{}.bell", n % 50));
                let _ = std::fs::write(&f, n.to_le_bytes());
                let _ = std::fs::remove_file(&f);
                n += 1;
            }
            n
        }));
    }

    // Online: one bursty worker process per GPU.
    let exe = std::env::current_exe().expect("current exe");
    let dir = std::env::temp_dir().join(format!("{group}-online"));
    std::fs::create_dir_all(&dir).unwrap();
    let burst = format!("{}-{}", o.burst_min_ms, o.burst_max_ms);
    let mut workers = Vec::new();
    let (t0, c0, k0) = (Instant::now(), cpu_ns(pid), cpu_ticks_s(pid));
    let target_dir = bin("coloc-sim").parent().unwrap().to_path_buf();
    for g in 0..o.gpus {
        let out = dir.join(format!("gpu{g}.json"));
        let mut cmd = std::process::Command::new(&exe);
        if o.doorbell {
            cmd.env(
                "LD_LIBRARY_PATH",
                coloc_sim::fake_libcuda_dir(&target_dir).expect("fake libcuda"),
            )
            .env("LD_PRELOAD", bin("libcoloc_cuda.so"))
            .env("COLOC_SHIM_CLASS", "online")
            .env("COLOC_DOORBELL_DIR", &agent.doorbell_dir)
            .env("COLOC_SIM_STATE", &sim.state)
            .arg("--doorbell");
        }
        let child = cmd
            .args(["--online-worker", "--state"])
            .arg(&sim.state)
            .args(["--gpu", &g.to_string(), "--seed", &o.seed.to_string()])
            .args(["--duration-s", &o.duration_s.to_string()])
            .args(["--burst-ms", &burst])
            .args(["--gap-mean-ms", &o.gap_mean_ms.to_string()])
            .arg("--out")
            .arg(&out)
            .spawn()
            .expect("spawn online worker");
        workers.push((child, out));
    }
    let mut rss_max = 0u64;
    let mut rss_timeline = Vec::new(); // (s, MiB) every 10 s
    while t0.elapsed().as_secs_f64() < o.duration_s {
        let r = rss_kib(pid);
        rss_max = rss_max.max(r);
        let t = t0.elapsed().as_secs_f64();
        if rss_timeline.len() as f64 * 10.0 <= t {
            rss_timeline.push(serde_json::json!([t.round(), r as f64 / 1024.0]));
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let mut online = Vec::new();
    for (w, out) in &mut workers {
        let _ = w.wait();
        online.push(
            std::fs::read_to_string(out)
                .ok()
                .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
                .unwrap_or_default(),
        );
    }
    let wall = t0.elapsed().as_secs_f64();
    let cpu = (cpu_ns(pid) - c0) as f64 / 1e9 / wall * 100.0;
    flood_stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let flood_rewrites = flood_writes.map(|h| h.join().unwrap_or(0));
    let cpu_ticks = (cpu_ticks_s(pid) - k0) / wall * 100.0;
    // Let the last idle window end (release) before reading the metrics.
    std::thread::sleep(Duration::from_millis(300));
    let (rss, hwm) = (rss_kib(pid), status_kib(pid, "VmHWM:"));
    let metrics = agent.metrics();
    let fail_open = series(&metrics, "coloc_fail_open_total");
    let act_err = series(&metrics, "coloc_actuation_errors_total");
    let lag_p99 = hist_quantile(&metrics, "coloc_loop_lag_seconds", 0.99);
    let lag_p50 = hist_quantile(&metrics, "coloc_loop_lag_seconds", 0.50);
    let lag_n = metric(&metrics, "coloc_loop_lag_seconds_count", &[]);

    // Stop the agent; afterwards nothing may be left stopped or frozen.
    agent.signal(libc::SIGTERM);
    let exit = agent.wait();
    std::thread::sleep(Duration::from_millis(50));
    let stopped = offline
        .iter()
        .filter(|p| matches!(p.state(), Some('T') | Some('t')))
        .count();
    let frozen_cgroups = cgroups.iter().filter(|c| c.frozen()).count();
    let frozen_procs: usize = cgroups
        .iter()
        .skip(1)
        .filter(|c| c.frozen())
        .map(|c| c.pids().len())
        .sum();
    let log = agent.log_text();
    let problems: Vec<String> = log
        .lines()
        .filter(|l| l.contains("ERROR") || l.contains("WARN"))
        .map(String::from)
        .collect();

    if let Some(d) = &o.keep_logs {
        std::fs::create_dir_all(d).expect("--keep-logs DIR");
        let _ = std::fs::copy(&agent.log, d.join(format!("agent-{}.log", o.actuator)));
        let _ = std::fs::copy(&events, d.join(format!("events-{}.jsonl", o.actuator)));
    }
    let text = std::fs::read_to_string(&events).unwrap_or_default();
    let evs: Vec<serde_json::Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let get = |kind: &str, f: &str| -> Vec<f64> {
        evs.iter()
            .filter(|e| e["event"] == kind)
            .filter_map(|e| e[f].as_f64())
            .map(|s| s * 1e3)
            .collect()
    };
    let count = |kind: &str| evs.iter().filter(|e| e["event"] == kind).count();
    let (pre, det, rel) = (
        get("preempt", "preemption_s"),
        get("preempt", "detection_s"),
        get("release", "release_s"),
    );
    let per_gpu: Vec<usize> = (0..o.gpus)
        .map(|g| {
            evs.iter()
                .filter(|e| e["event"] == "preempt" && e["gpu"] == g)
                .count()
        })
        .collect();
    let bursts: u64 = online.iter().filter_map(|w| w["bursts"].as_u64()).sum();
    let slow_p99: Vec<f64> = online
        .iter()
        .filter_map(|w| w["slowdown_ms"]["p99"].as_f64())
        .collect();
    drop(offline);
    drop(cgroups);
    drop(sim);
    let _ = std::fs::remove_file(&events);
    let _ = std::fs::remove_dir_all(&dir);
    let load_after = loadavg();
    let sum = |v: &[(String, f64)]| v.iter().fold(0.0, |a, x| a + x.1);
    let mut r = serde_json::json!({
        "scenario": "multi-gpu",
        "gpus": o.gpus, "offline_per_gpu": o.offline_per_gpu, "actuator": o.actuator,
        "duration_s": o.duration_s, "wall_s": wall, "step_ms": o.step_ms,
        "burst_ms": [o.burst_min_ms, o.burst_max_ms], "gap_mean_ms": o.gap_mean_ms, "seed": o.seed,
        "agent_args": agent_args, "agent_exit": exit.to_string(),
        "agent_cpu_percent_of_one_core": cpu,
        "agent_cpu_percent_utime_stime": cpu_ticks,
        "agent_rss_mib": rss as f64 / 1024.0, "agent_rss_max_sampled_mib": rss_max.max(rss) as f64 / 1024.0,
        "agent_rss_hwm_mib": hwm as f64 / 1024.0,
        "online_bursts": bursts,
        "online_burst_slowdown_p99_ms_worst_gpu": slow_p99.iter().copied().fold(f64::NAN, f64::max),
        "preemptions": count("preempt"), "preemptions_measured": pre.len(),
        "preemptions_per_gpu": per_gpu,
        "releases": count("release"), "releases_measured": rel.len(),
        "preemption_ms": {"p50": percentile(&pre, 50.0), "p99": percentile(&pre, 99.0), "max": percentile(&pre, 100.0)},
        "detection_ms": {"p50": percentile(&det, 50.0), "p99": percentile(&det, 99.0)},
        "release_ms": {"p50": percentile(&rel, 50.0), "p99": percentile(&rel, 99.0), "max": percentile(&rel, 100.0)},
        "fail_open_total": sum(&fail_open),
        // The exporter lists a counter only once it has been incremented.
        "fail_open_series_present": metrics.contains("coloc_fail_open_total"),
        "metrics_bytes": metrics.len(),
        "fail_open_by_reason": fail_open.iter().map(|(k, v)| serde_json::json!([k, v])).collect::<Vec<_>>(),
        "actuation_errors_total": sum(&act_err),
        "loop_lag_ms": {
            "ticks": lag_n,
            "p50_le": lag_p50.map(|s| s * 1e3),
            "p99_le": lag_p99.map(|s| s * 1e3),
        },
        "offline_stopped_after_exit": stopped,
        "offline_frozen_after_exit": frozen_procs,
        "cgroups_frozen_after_exit": frozen_cgroups,
        "agent_log_warn_error_lines": problems.len(),
        "agent_log_warn_error_first": problems.iter().take(5).collect::<Vec<_>>(),
        "online": online,
        "loadavg_before": load_before, "loadavg_after": load_after,
    });
    r["state_dir"] = serde_json::json!(o.state_dir.as_ref().map(|d| d.display().to_string()));
    r["doorbell"] = serde_json::json!(o.doorbell);
    r["nvml_only"] = serde_json::json!(o.nvml_only);
    r["flood_files"] = serde_json::json!(o.flood);
    r["flood_rewrites"] = serde_json::json!(flood_rewrites);
    if o.flood > 0 {
        let _ = std::fs::remove_dir_all(&flood_dir);
    }
    r["agent_rss_timeline_s_mib"] = serde_json::json!(rss_timeline);
    r
}

pub fn print(r: &serde_json::Value) {
    let g = |p: &str| r.pointer(p).and_then(|v| v.as_f64()).unwrap_or(f64::NAN);
    println!(
        "| actuator | GPUs × offline | duration (s) | agent CPU (% of one core) | RSS (MiB) | preemptions / releases | preemption p50 / p99 / max (ms) | release p50 / p99 (ms) | fail-opens | loop lag p99 | stopped/frozen after exit |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    println!(
        "| {} | {} × {} | {:.0} | {:.2} (utime+stime {:.2}) | {:.1} | {} / {} | {:.2} / {:.2} / {:.2} | {:.2} / {:.2} | {} | ≤ {:.2} ms | {} / {} |",
        r["actuator"].as_str().unwrap_or(""),
        r["gpus"], r["offline_per_gpu"], g("/wall_s"),
        g("/agent_cpu_percent_of_one_core"), g("/agent_cpu_percent_utime_stime"),
        g("/agent_rss_hwm_mib"),
        r["preemptions"], r["releases"],
        g("/preemption_ms/p50"), g("/preemption_ms/p99"), g("/preemption_ms/max"),
        g("/release_ms/p50"), g("/release_ms/p99"),
        r["fail_open_total"], g("/loop_lag_ms/p99_le"),
        r["offline_stopped_after_exit"], r["offline_frozen_after_exit"],
    );
    println!();
    println!(
        "detection p50 / p99 {:.2} / {:.2} ms; release max {:.2} ms; online bursts {}; worst GPU's online burst slowdown p99 {:.2} ms; actuation errors {}; fail-opens by reason {}; agent log WARN/ERROR lines {}; RSS at end {:.1} MiB (VmHWM {:.1}); loadavg before {} after {}",
        g("/detection_ms/p50"), g("/detection_ms/p99"), g("/release_ms/max"),
        r["online_bursts"], g("/online_burst_slowdown_p99_ms_worst_gpu"),
        r["actuation_errors_total"], r["fail_open_by_reason"],
        r["agent_log_warn_error_lines"], g("/agent_rss_mib"), g("/agent_rss_hwm_mib"),
        r["loadavg_before"].as_str().unwrap_or(""), r["loadavg_after"].as_str().unwrap_or(""),
    );
    if let Some(v) = r["agent_log_warn_error_first"].as_array() {
        for l in v {
            println!("  agent log: {}", l.as_str().unwrap_or(""));
        }
    }
}
