//! End-to-end: the real agent fails open. Offline work is resumed when the agent ends on
//! any catchable signal, by the next agent after a `kill -9`, and while NVML fails or
//! hangs; NVML answers that are only transient never fail open.
//!
//! Timing bounds are generous (debug builds on a loaded 2-core CI machine); the precise
//! latency figures come from the benchmarks, not from these tests.

use coloc_e2e::agent_tests::*;
use coloc_e2e::*;
use std::time::Duration;

#[test]
fn kill9_then_restart_resumes_offline() {
    let sim = Sim::start(1, &[]);
    let mut agent = Agent::start(&sim, AgentOpts::default());
    let off = sim.spawn(&args(&offline_args("k9")));
    agent.wait_processes(1);
    let mut online = sim.spawn(&["busy", "--ms", "300"]);
    wait_for("offline suspended", SOON, || off.state() == Some('T')).unwrap();
    agent.signal(libc::SIGKILL);
    agent.wait();
    online.wait_within("online's 300 ms of GPU work", Duration::from_secs(10));
    // Nobody resumes it now: the record on disk is what saves it.
    holds_for(
        "offline left stopped by the killed agent",
        Duration::from_millis(300),
        || off.state() == Some('T'),
    )
    .unwrap();
    let record = std::fs::read_to_string(agent.state_dir.join("suspended.json")).unwrap();
    assert!(
        record.contains(&format!("\"pid\": {}", off.pid())),
        "{record}"
    );
    let again = Agent::start(
        &sim,
        AgentOpts {
            state_dir: Some(agent.state_dir.clone()),
            ..Default::default()
        },
    );
    wait_for("offline resumed by the restarted agent", SOON, || {
        off.state() != Some('T')
    })
    .unwrap();
    assert!(
        again.log_text().contains("previous run left suspended"),
        "{}",
        again.log_text()
    );
    // It is offline work on a GPU still: the restarted agent writes it down again, ahead.
    wait_for("recorded ahead by the restarted agent", SOON, || {
        std::fs::read_to_string(agent.state_dir.join("suspended.json"))
            .is_ok_and(|r| r.contains(&format!("\"pid\": {}", off.pid())))
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", again.log_text()));
}

/// Record ahead: offline work is on disk before anything is stopped (a preemption waits
/// for no write), so an agent killed at any moment — here, right as online work starts,
/// while the stop may or may not have happened — leaves nothing that the next start does
/// not resume.
#[test]
fn recorded_before_any_preemption_and_resumed_after_a_kill_at_any_moment() {
    let sim = Sim::start(1, &[]);
    let mut agent = Agent::start(&sim, AgentOpts::default());
    let off = sim.spawn(&args(&offline_args("ahead")));
    agent.wait_processes(1);
    let record =
        || std::fs::read_to_string(agent.state_dir.join("suspended.json")).unwrap_or_default();
    wait_for(
        "recorded while running, before any preemption",
        SOON,
        || record().contains(&format!("\"pid\": {}", off.pid())),
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log_text()));
    assert_ne!(off.state(), Some('T'), "stopped with no online work");
    let online = sim.spawn(&["busy", "--ms", "300"]);
    // Killed as soon as the agent could have acted, whether or not it has.
    std::thread::sleep(Duration::from_millis(20));
    agent.signal(libc::SIGKILL);
    agent.wait();
    drop(online);
    let state_dir = agent.state_dir.clone();
    let again = Agent::start(
        &sim,
        AgentOpts {
            state_dir: Some(state_dir),
            ..Default::default()
        },
    );
    wait_for("offline running after the restart", SOON, || {
        off.state() != Some('T')
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", again.log_text()));
    assert!(
        again.log_text().contains("previous run left"),
        "{}",
        again.log_text()
    );
}

#[test]
fn sigterm_resumes_offline_before_exit() {
    let sim = Sim::start(1, &[]);
    let mut agent = Agent::start(&sim, AgentOpts::default());
    let off = sim.spawn(&args(&offline_args("term")));
    let _online = sim.spawn(&["busy", "--ms", "5000"]);
    wait_for("offline suspended", SOON, || off.state() == Some('T')).unwrap();
    agent.signal(libc::SIGTERM);
    let st = agent.wait();
    assert!(st.success(), "agent exit {st}:\n{}", agent.log_text());
    // At the moment the agent has exited, offline already runs.
    assert_ne!(off.state(), Some('T'), "offline left stopped after SIGTERM");
    assert!(
        agent.log_text().contains("resuming all offline work"),
        "{}",
        agent.log_text()
    );
}

/// Every catchable signal that would end the agent resumes offline work first.
#[test]
fn every_terminating_signal_resumes_offline_first() {
    let sim = Sim::start(1, &[]);
    let off = sim.spawn(&args(&offline_args("sigs")));
    let _online = sim.spawn(&["busy", "--ms", "30000"]);
    for (sig, name) in [
        (libc::SIGHUP, "SIGHUP"),
        (libc::SIGQUIT, "SIGQUIT"),
        (libc::SIGUSR1, "SIGUSR1"),
        (libc::SIGUSR2, "SIGUSR2"),
        (libc::SIGALRM, "SIGALRM"),
    ] {
        let mut agent = Agent::start(&sim, AgentOpts::default());
        wait_for("offline suspended", SOON, || off.state() == Some('T'))
            .unwrap_or_else(|e| panic!("{name}: {e}\n{}", agent.log_text()));
        agent.signal(sig);
        let st = agent.wait();
        assert!(
            st.success(),
            "{name}: agent exit {st}:\n{}",
            agent.log_text()
        );
        assert_ne!(off.state(), Some('T'), "offline left stopped after {name}");
        assert!(agent.log_text().contains(name), "{}", agent.log_text());
    }
}

#[test]
fn nvml_failure_fails_open_and_recovers() {
    let sim = Sim::start(1, &[]);
    let agent = Agent::start(&sim, AgentOpts::default());
    let off = sim.spawn(&args(&offline_args("nvml")));
    let _online = sim.spawn(&["busy", "--ms", "6000"]);
    wait_for("offline suspended", SOON, || off.state() == Some('T')).unwrap();
    let probe = sim.open();
    probe
        .header()
        .nvml_fail
        .store(1, std::sync::atomic::Ordering::SeqCst);
    wait_for("offline resumed on NVML failure", SOON, || {
        off.state() != Some('T')
    })
    .unwrap();
    wait_for("not ready while degraded", SOON, || {
        http_get(agent.port, "/readyz")
            .map(|r| r.0 == 503)
            .unwrap_or(false)
    })
    .unwrap();
    wait_for("fail-open counted", SOON, || {
        metric(
            &agent.metrics(),
            "coloc_fail_open_total",
            &["reason=\"nvml\""],
        ) >= 1.0
    })
    .unwrap();
    holds_for(
        "nothing suspended while NVML fails",
        Duration::from_millis(300),
        || off.state() != Some('T'),
    )
    .unwrap();
    probe
        .header()
        .nvml_fail
        .store(0, std::sync::atomic::Ordering::SeqCst);
    wait_for("ready again", SOON, || {
        http_get(agent.port, "/readyz")
            .map(|r| r.0 == 200)
            .unwrap_or(false)
    })
    .unwrap();
    wait_for("protecting online again", SOON, || off.state() == Some('T')).unwrap();
}

/// `INSUFFICIENT_SIZE` between NVML's count and data calls (samples arriving in between)
/// is transient: it never fails open, and offline stays suspended while online is busy.
#[test]
fn transient_nvml_answers_never_fail_open() {
    use coloc_sim::NvmlFunc;
    let sim = Sim::start(1, &[]);
    let agent = Agent::start(&sim, AgentOpts::default());
    let off = sim.spawn(&args(&offline_args("transient")));
    let _online = sim.spawn(&["busy", "--ms", "5000"]);
    wait_for("offline suspended", SOON, || off.state() == Some('T')).unwrap();
    let probe = sim.open();
    let t = std::time::Instant::now();
    let mut injected = 0;
    while t.elapsed() < Duration::from_millis(1500) {
        for f in [
            NvmlFunc::DeviceGetProcessUtilization,
            NvmlFunc::DeviceGetComputeRunningProcesses,
        ] {
            // Twice in a row: the first answer and the first retry both fail.
            probe.nvml_inject(f, Some(0), 7, 2, true).unwrap();
        }
        injected += 1;
        std::thread::sleep(Duration::from_millis(10));
        assert_eq!(
            off.state(),
            Some('T'),
            "offline resumed during online work after {injected} injections:\n{}",
            agent.log_text()
        );
    }
    assert!(probe.nvml_injected_count(NvmlFunc::DeviceGetProcessUtilization) >= 50);
    let m = agent.metrics();
    assert_eq!(
        metric(&m, "coloc_fail_open_total", &["reason=\"nvml\""]),
        0.0,
        "{m}"
    );
    assert!(
        metric(&m, "coloc_nvml_transient_answers_total", &[]) >= 50.0,
        "{m}"
    );
}

/// A hung NVML call trips the watchdog: offline resumes, /readyz says why, the counter
/// names it; when the call returns the agent protects online again.
#[test]
fn hung_nvml_call_trips_the_watchdog() {
    use coloc_sim::NvmlFunc;
    let sim = Sim::start(1, &[]);
    let agent = Agent::start(&sim, AgentOpts::default());
    let off = sim.spawn(&args(&offline_args("hung")));
    let _online = sim.spawn(&["busy", "--ms", "8000"]);
    wait_for("offline suspended", SOON, || off.state() == Some('T')).unwrap();
    let probe = sim.open();
    probe.nvml_hang(NvmlFunc::DeviceGetProcessUtilization, true);
    let took = wait_for("offline resumed by the watchdog", SOON, || {
        off.state() != Some('T')
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log_text()));
    assert!(
        took >= Duration::from_millis(200),
        "resumed after {took:?}, before the 250 ms hang timeout"
    );
    let (code, body) = http_get(agent.port, "/readyz").unwrap();
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("NVML call"), "{body}");
    assert!(
        metric(
            &agent.metrics(),
            "coloc_fail_open_total",
            &["reason=\"nvml_hung\""]
        ) >= 1.0
    );
    probe.nvml_hang(NvmlFunc::DeviceGetProcessUtilization, false);
    wait_for("ready again", SOON, || {
        http_get(agent.port, "/readyz")
            .map(|r| r.0 == 200)
            .unwrap_or(false)
    })
    .unwrap();
    wait_for("protecting online again", SOON, || off.state() == Some('T')).unwrap();
}
