//! End-to-end benchmark: preemption and release latency for 1, 8 and 64 offline
//! processes, freezer vs signal, on the simulated GPU (driver sample period 1 ms); and the
//! agent's CPU and RSS at a 1 ms poll on an idle node.
//!
//! Run with `benches/run.sh` (release build). Prints a Markdown table; `--json FILE`
//! writes the raw figures. `--multi-gpu`: the agent's cost on a busy 8-GPU node (see
//! `multi_gpu.rs`). `--gate`: the launch gate's in-flight bound (see
//! `gate.rs`). `--help` lists the modes.

mod checkpoint;
mod gate;
mod multi_gpu;
mod nvml;
mod wake;

use coloc_tools::*;
use std::time::{Duration, Instant};

/// CPU time of every thread of `pid`, ns (schedstat: exact, unlike tick-sampled utime).
fn cpu_ns(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.flatten()
                .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
                .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
                .sum()
        })
        .unwrap_or(0)
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn latency_run(actuator: &str, n: usize, cycles: u32) -> serde_json::Value {
    let sim = Sim::start(1, &["--sample-period-ms", "1"]);
    let group = unique("coloc-bench");
    let children: Vec<String> = (0..n).map(|i| format!("off{i}")).collect();
    let (cgroups, rules) = coloc_tools::offline_rules(&group, &children, actuator == "freezer");
    let events = std::env::temp_dir().join(format!("{group}-events.jsonl"));
    let agent = Agent::start(
        &sim,
        AgentOpts {
            rules: &rules,
            actuator,
            extra: vec![
                "--event-log".into(),
                events.display().to_string(),
                "--poll-interval".into(),
                "1ms".into(),
            ],
            ..Default::default()
        },
    );
    let mut offline = Vec::new();
    for i in 0..n {
        let a = ["offline", "--step-ms", "2", "--tag", "bench"];
        offline.push(if actuator == "freezer" {
            sim.spawn_in_cgroup(&cgroups[i + 1].dir, &a)
        } else {
            sim.spawn(&a)
        });
    }
    wait_for("agent sees all offline", Duration::from_secs(20), || {
        agent.state()["gpus"][0]["processes"]
            .as_array()
            .is_some_and(|p| p.len() == n)
    })
    .expect("agent did not see the offline processes");
    std::thread::sleep(Duration::from_millis(300));
    let mut online = sim.spawn(&[
        "busy",
        "--ms",
        "20",
        "--repeat",
        &cycles.to_string(),
        "--gap-ms",
        "250",
    ]);
    online.0.wait().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    drop(agent);
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
    let (pre, det, act, rel) = (
        get("preempt", "preemption_s"),
        get("preempt", "detection_s"),
        get("preempt", "actuation_s"),
        get("release", "release_s"),
    );
    drop(offline);
    drop(cgroups);
    let _ = std::fs::remove_file(&events);
    serde_json::json!({
        "actuator": actuator, "offline": n, "cycles": pre.len(),
        "preemption_ms": {"p50": percentile(&pre, 50.0), "p99": percentile(&pre, 99.0), "max": percentile(&pre, 100.0)},
        "detection_ms": {"p50": percentile(&det, 50.0), "p99": percentile(&det, 99.0)},
        "actuation_ms": {"p50": percentile(&act, 50.0), "p99": percentile(&act, 99.0)},
        "release_ms": {"p50": percentile(&rel, 50.0), "p99": percentile(&rel, 99.0), "max": percentile(&rel, 100.0)},
    })
}

fn idle_cost(secs: u64, with_offline: usize) -> serde_json::Value {
    let sim = Sim::start(1, &["--sample-period-ms", "1"]);
    let agent = Agent::start(
        &sim,
        AgentOpts {
            extra: vec!["--poll-interval".into(), "1ms".into()],
            ..Default::default()
        },
    );
    let _off: Vec<_> = (0..with_offline)
        .map(|_| sim.spawn(&["offline", "--step-ms", "2"]))
        .collect();
    std::thread::sleep(Duration::from_secs(1));
    let pid = agent.child.as_ref().unwrap().id();
    let (t0, c0) = (Instant::now(), cpu_ns(pid));
    std::thread::sleep(Duration::from_secs(secs));
    let cpu = (cpu_ns(pid) - c0) as f64 / 1e9 / t0.elapsed().as_secs_f64();
    serde_json::json!({"offline_processes": with_offline, "cpu_percent_of_one_core": cpu * 100.0, "rss_mib": rss_kib(pid) as f64 / 1024.0})
}

/// Pod event → classification latency (in-process source, real client over HTTP), and the
/// agent's CPU with 250 pods on its node and 10 pod changes per second.
fn kube_bench() {
    use coloc_tools::fakeapi::{pod, FakeApi};
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(FakeApi::start());
    let uid = |i: u32| format!("0f2c7a54-9a3b-4c1e-8d2f-{i:012}");
    for i in 0..250 {
        api.apply_silently(pod(
            &uid(i),
            &format!("p{i}"),
            "node1",
            Some(if i % 3 == 0 {
                "reclaimed_cores"
            } else {
                "shared_cores"
            }),
        ));
    }
    // Latency, in process.
    let lat = rt.block_on(async {
        let _g = ();
        let src = coloc_agent::edges::source::kube::KubeSource::start(api.client(), "node1");
        while !coloc_agent::edges::source::PodSource::ready(&src) || api.watches_open() == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let mut rx = src.subscribe().unwrap();
        let mut lat = Vec::new();
        for i in 0..500u32 {
            let qos = if i % 2 == 0 {
                "reclaimed_cores"
            } else {
                "shared_cores"
            };
            rx.borrow_and_update();
            // A new pod each time: every event changes what the index answers.
            api.apply(pod(&uid(1000 + i), &format!("n{i}"), "node1", Some(qos)));
            tokio::time::timeout(Duration::from_secs(5), rx.changed())
                .await
                .unwrap()
                .unwrap();
            lat.push(api.last_sent().unwrap().elapsed().as_secs_f64() * 1e3);
        }
        lat
    });
    println!();
    println!("| pod event → classification (500 events, release) | p50 {:.3} ms | p99 {:.3} ms | max {:.3} ms |", percentile(&lat, 50.0), percentile(&lat, 99.0), percentile(&lat, 100.0));
    // CPU of the real agent binary under pod churn.
    let sim = Sim::start(1, &["--sample-period-ms", "1"]);
    let dir = std::env::temp_dir().join(unique("coloc-bench-kube"));
    std::fs::create_dir_all(&dir).unwrap();
    let kc = api.kubeconfig(&dir);
    let agent = Agent::spawn_with(
        &sim,
        &[
            "--node-name",
            "node1",
            "--actuator",
            "signal",
            "--idle-poll-interval",
            "1ms",
        ],
        &[("KUBECONFIG", kc.as_os_str())],
    );
    wait_for("agent ready", Duration::from_secs(20), || {
        http_get(agent.port, "/readyz")
            .map(|r| r.0 == 200)
            .unwrap_or(false)
    })
    .unwrap();
    let _gpu_work = sim.spawn(&["offline", "--step-ms", "2"]);
    std::thread::sleep(Duration::from_secs(1));
    let pid = agent.child.as_ref().unwrap().id();
    let (t0, c0) = (Instant::now(), cpu_ns(pid));
    let mut i = 0u32;
    while t0.elapsed() < Duration::from_secs(10) {
        let n = i % 250;
        let qos = if (i / 250).is_multiple_of(2) {
            "shared_cores"
        } else {
            "reclaimed_cores"
        };
        api.apply(pod(&uid(n), &format!("p{n}"), "node1", Some(qos)));
        i += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
    let cpu = (cpu_ns(pid) - c0) as f64 / 1e9 / t0.elapsed().as_secs_f64() * 100.0;
    println!("| agent CPU, 750 pods on the node, {} pod changes in {:.1} s, poll forced to 1 ms | {:.2} % of one core |", i, t0.elapsed().as_secs_f64(), cpu);
    drop(agent);
}

const HELP: &str = "\
coloc-bench: end-to-end benchmarks of the agent on the simulated GPU (release build;
run as root for the freezer rows). Modes:

coloc-bench [--cycles 40] [--cost-only] [--json FILE]
    Preemption/release latency for 1, 8 and 64 offline processes, signal and freezer,
    CYCLES online bursts each; then the agent's CPU and RSS at a 1 ms poll (0 and 8
    offline processes). --cost-only: only the CPU/RSS part.
coloc-bench --kube
    Pod event -> classification latency and agent CPU under pod churn (fake API server).
";

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!(
            "{HELP}{}{}{}{}{}",
            nvml::USAGE,
            checkpoint::USAGE,
            multi_gpu::USAGE,
            gate::USAGE,
            wake::USAGE
        );
        return;
    }
    if args.iter().any(|a| a == "--cuda-checkpoint") {
        checkpoint::run(&args);
    }
    if args.iter().any(|a| a == "--online-worker") {
        multi_gpu::online_worker(&args);
        return;
    }
    if args.iter().any(|a| a == "--multi-gpu") {
        let o = multi_gpu::Opts::parse(&args);
        let r = multi_gpu::run(&o);
        multi_gpu::print(&r);
        if let Some(p) = &o.json {
            std::fs::write(p, serde_json::to_vec_pretty(&r).unwrap()).unwrap();
        }
        return;
    }
    // Modes that print a table and write their figures to `--json FILE` when asked.
    let json_out = |r: &serde_json::Value| {
        if let Some(p) = args
            .iter()
            .position(|a| a == "--json")
            .and_then(|i| args.get(i + 1))
        {
            std::fs::write(p, serde_json::to_vec_pretty(r).unwrap()).unwrap();
        }
    };
    if args.iter().any(|a| a == "--gate") {
        json_out(&gate::run(&args));
        return;
    }
    if args.iter().any(|a| a == "--wake-floor") {
        json_out(&wake::run(&args));
        return;
    }
    if args.iter().any(|a| a == "--nvml-probe") {
        nvml::probe(&args);
        return;
    }
    if args.iter().any(|a| a == "--nvml-watch") {
        nvml::watch(&args);
        return;
    }
    if args.iter().any(|a| a == "--nvml-poll") {
        nvml::poll(&args);
        return;
    }
    if args.iter().any(|a| a == "--kube") {
        kube_bench();
        return;
    }
    let cycles: u32 = args
        .iter()
        .position(|a| a == "--cycles")
        .and_then(|i| args.get(i + 1)?.parse().ok())
        .unwrap_or(40);
    let json_out = args
        .iter()
        .position(|a| a == "--json")
        .and_then(|i| args.get(i + 1).cloned());
    let mut rows = Vec::new();
    let cost_only = args.iter().any(|a| a == "--cost-only");
    if !cost_only {
        println!("| actuator | offline procs | cycles | preemption p50 / p99 / max (ms) | detection p50 / p99 | actuation p50 / p99 | release p50 / p99 / max (ms) |");
        println!("|---|---|---|---|---|---|---|");
        for actuator in ["signal", "freezer"] {
            for n in [1usize, 8, 64] {
                let r = latency_run(actuator, n, cycles);
                let g = |p: &str| r.pointer(p).and_then(|v| v.as_f64()).unwrap_or(f64::NAN);
                println!(
                "| {actuator} | {n} | {} | {:.2} / {:.2} / {:.2} | {:.2} / {:.2} | {:.2} / {:.2} | {:.2} / {:.2} / {:.2} |",
                r["cycles"], g("/preemption_ms/p50"), g("/preemption_ms/p99"), g("/preemption_ms/max"),
                g("/detection_ms/p50"), g("/detection_ms/p99"), g("/actuation_ms/p50"), g("/actuation_ms/p99"),
                g("/release_ms/p50"), g("/release_ms/p99"), g("/release_ms/max")
            );
                rows.push(r);
            }
        }
    }
    let idle = idle_cost(10, 0);
    let busy = idle_cost(10, 8);
    println!();
    println!("| agent, --poll-interval 1ms (idle poll 10ms) | CPU (% of one core, schedstat) | RSS (MiB) |");
    println!("|---|---|---|");
    for r in [&idle, &busy] {
        println!(
            "| {} offline processes | {:.2} | {:.1} |",
            r["offline_processes"],
            r["cpu_percent_of_one_core"].as_f64().unwrap_or(0.0),
            r["rss_mib"].as_f64().unwrap_or(0.0)
        );
    }
    if let Some(p) = json_out {
        std::fs::write(
            p,
            serde_json::to_vec_pretty(&serde_json::json!({"latency": rows, "cost": [idle, busy]}))
                .unwrap(),
        )
        .unwrap();
    }
}
