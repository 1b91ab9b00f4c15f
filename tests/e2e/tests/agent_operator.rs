//! End-to-end: what an operator sees of the real agent. One clear line when it cannot start
//! (malformed rules, no driver), its HTTP endpoints, `coloc-agent status` and its timeline
//! plot, and the CPU wake-up latency request it holds while it runs.
//!
//! Timing bounds are generous (debug builds on a loaded 2-core CI machine); the precise
//! latency figures come from the benchmarks, not from these tests.

use coloc_e2e::agent_tests::*;
use coloc_e2e::*;
use std::time::Duration;

#[test]
fn malformed_rules_are_a_clear_error_and_nothing_is_frozen() {
    let sim = Sim::start(1, &[]);
    let off = sim.spawn(&args(&offline_args("bad")));
    let _online = sim.spawn(&["busy", "--ms", "2000"]);
    for (rules, needle) in [
        (
            "[[rule]]\nclass = \"reclaimed\"\ncmdline = \"*\"\n",
            "\"reclaimed\"",
        ),
        ("[[rule]\nclass = 1", "rules.toml:1:"),
        ("[[rule]]\nclass = \"offline\"\n", "no matcher"),
    ] {
        let mut a = Agent::spawn(
            &sim,
            AgentOpts {
                rules,
                ..Default::default()
            },
        );
        let st = a.wait();
        assert!(!st.success());
        let log = a.log_text();
        assert!(
            log.contains("rules.toml") && log.contains(needle),
            "{needle}: {log}"
        );
        assert_eq!(log.lines().count(), 1, "one clear line: {log}");
        assert_ne!(off.state(), Some('T'));
    }
    let out = output_within(
        std::process::Command::new(bin("coloc-agent"))
            .args(["check-rules", "/nonexistent/rules.toml"]),
        CMD_LIMIT,
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/rules.toml"));
}

#[test]
fn no_driver_is_one_clear_line() {
    let dir = TempPath::dir("coloc-e2e-nodrv");
    std::fs::write(
        dir.join("r.toml"),
        "[[rule]]\nclass = \"offline\"\ncmdline = \"x\"\n",
    )
    .unwrap();
    let out = output_within(
        std::process::Command::new(bin("coloc-agent"))
            .args([
                "run",
                "--nvml-lib",
                "/nonexistent/libnvidia-ml.so.1",
                "--listen",
                "127.0.0.1:0",
                "--actuator",
                "signal",
            ])
            .arg("--rules")
            .arg(dir.join("r.toml"))
            .arg("--state-dir")
            .arg(dir.join("state")),
        CMD_LIMIT,
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<_> = err.lines().filter(|l| l.contains("coloc-agent:")).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].contains("no NVIDIA driver"), "{err}");
    assert_eq!(
        lines[0].matches("cannot open shared object file").count(),
        1,
        "the cause is said once: {err}"
    );
}

#[test]
fn http_endpoints() {
    let sim = Sim::start(2, &[]);
    let agent = Agent::start(&sim, AgentOpts::default());
    assert_eq!(http_get(agent.port, "/healthz").unwrap().0, 200);
    assert_eq!(http_get(agent.port, "/readyz").unwrap().0, 200);
    let st = agent.state();
    assert_eq!(st["gpus"].as_array().unwrap().len(), 2);
    assert_eq!(st["idle_window_ms"], 100.0);
    let m = agent.metrics();
    for name in [
        "coloc_gpu_online_busy",
        "coloc_nvml_call_duration_seconds_bucket",
        "coloc_loop_lag_seconds_count",
        "coloc_agent_info",
    ] {
        assert!(m.contains(name), "/metrics lacks {name}");
    }
    // Every metric family has help text.
    for fam in m
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| l.split(' ').next().unwrap())
    {
        assert!(
            m.contains(&format!("# HELP {fam} ")),
            "{fam} has no help text"
        );
    }
}

#[test]
fn status_shows_state_and_plots_a_timeline() {
    let sim = Sim::start(1, &[]);
    let agent = Agent::start(&sim, AgentOpts::default());
    let off = sim.spawn(&args(&offline_args("status")));
    // Known to the agent before online starts, so each cycle is a full preemption.
    agent.wait_processes(1);
    let mut online = sim.spawn(&["busy", "--ms", "20", "--repeat", "3", "--gap-ms", "200"]);
    online.wait_within("online's three 20 ms periods", Duration::from_secs(10));
    let url = format!("http://127.0.0.1:{}", agent.port);
    wait_for("three releases", SOON, || {
        agent.state()["gpus"][0]["release_ms"]["count"].as_u64() >= Some(3)
    })
    .unwrap();
    let out = output_within(
        std::process::Command::new(bin("coloc-agent")).args(["status", "--url", &url]),
        CMD_LIMIT,
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("GPU 0") && text.contains("OFFLINE_RUNNING"),
        "{text}"
    );
    assert!(
        text.contains(&off.pid().to_string()) && text.contains("offline"),
        "{text}"
    );
    assert!(
        text.contains("last preemption:") && !text.contains("last preemption: never"),
        "{text}"
    );
    assert!(
        text.contains("preemption latency: p50") && text.contains("(n=3)"),
        "{text}"
    );
    let out = output_within(
        std::process::Command::new(bin("coloc-agent")).args(["status", "--json", "--url", &url]),
        CMD_LIMIT,
    );
    let st: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(st["gpus"][0]["preemption_ms"]["count"], 3);
    // The timeline, and the picture `render_svg` makes of it beside it.
    let svg =
        TempPath::at(std::env::temp_dir().join(format!("{}.svg", unique("coloc-e2e-status"))));
    let _png = TempPath::at(svg.with_extension("png"));
    let out = output_within(
        std::process::Command::new(bin("coloc-agent"))
            .args(["status", "--url", &url, "--plot"])
            .arg(&svg),
        CMD_LIMIT,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc = std::fs::read_to_string(&svg).unwrap();
    assert_eq!(
        doc.matches("fill=\"#d62728\"").count(),
        3,
        "three suspended periods drawn"
    );
    assert!(
        render_svg(&svg).unwrap() > 5,
        "timeline renders to a non-blank picture"
    );
    // An agent that is not there: one clear line.
    let out = output_within(
        std::process::Command::new(bin("coloc-agent")).args([
            "status",
            "--url",
            "http://127.0.0.1:1",
        ]),
        CMD_LIMIT,
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot reach the agent"));
}

/// `--cpu-wake-latency` is in force while the agent runs and withdrawn by the kernel when
/// it dies, `kill -9` included (nothing to clean up, nothing left behind).
#[test]
fn the_cpu_wake_latency_request_lives_and_dies_with_the_agent() {
    let _cpu_latency = cpu_latency_lock();
    use coloc_agent::sched::{cpu_latency_in_force, CPU_LATENCY_DEVICE};
    let dev = std::path::Path::new(CPU_LATENCY_DEVICE);
    let writable = std::fs::OpenOptions::new().write(true).open(dev).is_ok();
    let before = cpu_latency_in_force(dev).ok();
    let sim = Sim::start(1, &[]);
    let mut agent = Agent::start(
        &sim,
        AgentOpts {
            extra: vec!["--cpu-wake-latency".into(), "7us".into()],
            ..Default::default()
        },
    );
    if !writable {
        eprintln!("NOTE: {CPU_LATENCY_DEVICE} is not writable here: checked that the agent says so and runs on");
        assert!(
            agent
                .log_text()
                .contains("Cannot hold the CPU wake-up latency request"),
            "{}",
            agent.log_text()
        );
        return;
    }
    assert!(
        agent
            .log_text()
            .contains("Holding a CPU wake-up latency request")
            && agent.log_text().contains("requested_us=7"),
        "{}",
        agent.log_text()
    );
    let during = cpu_latency_in_force(dev).unwrap();
    assert!(
        during <= 7,
        "the agent holds 7 µs, the kernel enforces {during} µs"
    );
    agent.signal(libc::SIGKILL);
    agent.wait();
    let after = cpu_latency_in_force(dev).unwrap();
    match before {
        Some(b) if b > 7 => assert!(
            after > 7,
            "the request outlived the killed agent: {after} µs in force (before it: {b} µs)"
        ),
        _ => eprintln!(
            "NOTE: another request of {before:?} µs was in force: the withdrawal could not be seen"
        ),
    }
}

/// The chart's exec probes: `coloc-agent probe live|ready` read the health file the running
/// agent writes every second in its state directory (no listener involved); an agent that
/// stops writing it (here: stopped with SIGSTOP) fails them once the file is older than
/// `--max-age`, and passes again when it goes on.
#[test]
fn the_exec_probes_read_the_health_file() {
    let sim = Sim::start(1, &[]);
    let agent = Agent::start(&sim, AgentOpts::default());
    let probe = |which: &str| {
        let out = std::process::Command::new(bin("coloc-agent"))
            .args(["probe", which, "--max-age", "1500ms", "--state-dir"])
            .arg(&agent.state_dir)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).trim().to_string(),
        )
    };
    wait_for("ready by the probe", SOON, || probe("ready").0 == Some(0))
        .unwrap_or_else(|e| panic!("{e}: {:?}\n{}", probe("ready"), agent.log_text()));
    assert_eq!(probe("live"), (Some(0), "ok".to_string()));
    agent.signal(libc::SIGSTOP);
    let stale = wait_for(
        "the probe fails on a stale file",
        Duration::from_secs(5),
        || probe("live").0 == Some(1),
    );
    let said = probe("live");
    agent.signal(libc::SIGCONT);
    stale.unwrap_or_else(|e| panic!("{e}: {said:?}"));
    assert!(said.1.contains("stopped writing"), "{said:?}");
    wait_for("live again", Duration::from_secs(5), || {
        probe("live").0 == Some(0)
    })
    .unwrap();
}
