//! End-to-end: the real agent suspends offline work while online work uses the GPU and
//! resumes it once the idle window has passed, with the signal and the freezer actuators;
//! and never touches what it must not (online, system and unmanaged work, a reused PID, a
//! dry run). Real processes, signals and cgroups, simulated GPU.
//!
//! Timing bounds are generous (debug builds on a loaded 2-core CI machine); the precise
//! latency figures come from the benchmarks, not from these tests.

use coloc_e2e::agent_tests::*;
use coloc_e2e::*;
use std::time::{Duration, Instant};

/// The agent's idle window (its `--idle-window` default; `agent_operator.rs`'s `http_endpoints` checks it).
const WINDOW_US: u64 = 100_000;

/// What the simulated GPU can misplace the first offline work after the release by (see
/// `preempt_release_cycle`): the daemon credits work from its previous model advance, so
/// work submitted right after the release may land in the period before; its tick is
/// 100 µs, but on a loaded 2-core machine the daemon can be scheduled a few ms late.
/// One 1 ms sample period plus 9 ms of daemon lag. A 70 ms window is still far outside.
const EARLY_US: u64 = 10_000;

/// How late "soon after" may be: the agent's tick (1 ms poll), thawing or SIGCONT, the
/// offline process being scheduled and submitting its next step, and the 1 ms sample period
/// it shows up in, all on a loaded 2-core machine running debug builds.
const LATE_US: u64 = 150_000;

/// Offline's queued work still runs after it is suspended (its drain: at most one 2 ms
/// step, in time slices beside online, so at most about 5 ms); offline samples up to this long
/// after the test saw it suspended are that drain, not a resumption.
const DRAIN_US: u64 = 20_000;

/// Online busy → offline confirmed stopped soon; then offline gets no GPU time until the
/// idle window has passed since online's last GPU activity, and gets it again soon after.
///
/// Measured on the simulated GPU's own sample stream, which is what the agent decides on:
/// every 1 ms the simulated driver writes, per active process, a sample stamped with the
/// END of the period it covers. Online's last sample `L` is therefore the end of the period
/// in which its work finished, and the agent (which reads the same samples: online stays
/// alive after its work, so none is lost) releases at its first tick with `now - L >=
/// window`. Offline's first sample after that, `F`, covers a period in which offline did
/// GPU work, which it can only do after the release: `F > L + window` with an exact model,
/// `F >= L + window - EARLY_US` allowing for the daemon's lag, and `F <= L + window +
/// LATE_US` for "running again soon after". Neither bound depends on when the test thread
/// itself gets scheduled.
fn preempt_release_cycle(
    sim: &Sim,
    agent: &Agent,
    off_pid: u32,
    is_suspended: impl Fn() -> bool,
    actuator: &str,
) {
    assert!(
        !is_suspended(),
        "offline must run while the GPU has no online work"
    );
    holds_for(
        "offline running with no online work",
        Duration::from_millis(300),
        || !is_suspended(),
    )
    .unwrap();
    let probe = sim.open();
    // 400 ms of GPU work, then idle but alive (the second period never comes): its slot,
    // and so its last samples, stay readable to the agent and to this test.
    let online = sim.spawn(&[
        "busy", "--gpu", "0", "--ms", "400", "--repeat", "2", "--gap-ms", "600000",
    ]);
    let took = wait_for("offline suspended", SOON, &is_suspended)
        .unwrap_or_else(|e| panic!("{e}\n{}", agent.log_text()));
    let confirmed_us = coloc_sim::now_ns() / 1000;
    eprintln!("{actuator}: offline confirmed suspended {took:?} after online started");
    // Every sample of both processes, polled every ms (the driver keeps the last 64 per
    // process), until offline has GPU activity again after its drain.
    let mut seen = std::collections::BTreeSet::new();
    let first_back = |seen: &std::collections::BTreeSet<(u64, u32)>| {
        seen.iter()
            .find(|(ts, pid)| *pid == off_pid && *ts > confirmed_us + DRAIN_US)
            .map(|s| s.0)
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while first_back(&seen).is_none() {
        assert!(
            Instant::now() < deadline,
            "offline got no GPU time within 5 s of its suspension\n{}",
            agent.log_text()
        );
        let since = seen
            .last()
            .map_or(0, |s: &(u64, u32)| s.0.saturating_sub(5_000));
        seen.extend(
            probe
                .samples(0, since)
                .into_iter()
                .map(|s| (s.timestamp_us, s.pid)),
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let back = first_back(&seen).unwrap();
    let online_last = seen
        .iter()
        .filter(|s| s.1 == online.pid())
        .map(|s| s.0)
        .max()
        .expect("online's samples");
    let gap_ms = (back as f64 - online_last as f64) / 1e3;
    eprintln!(
        "{actuator}: offline back on the GPU {gap_ms:.1} ms after online's last GPU activity (window {} ms)",
        WINDOW_US / 1000
    );
    assert!(
        back >= online_last + WINDOW_US - EARLY_US,
        "offline ran {gap_ms:.1} ms after online's last GPU activity: before the {} ms idle window ended",
        WINDOW_US / 1000
    );
    assert!(
        back <= online_last + WINDOW_US + LATE_US,
        "offline ran only {gap_ms:.1} ms after online's last GPU activity (window {} ms)",
        WINDOW_US / 1000
    );
    // It has run on the GPU, so the actuator has let it go.
    wait_for("offline resumed", SOON, || !is_suspended()).unwrap();
    // The agent records the histograms right after confirming; the test may see the
    // process running a moment before that.
    let labels = ["gpu=\"0\"".to_string(), format!("actuator=\"{actuator}\"")];
    let labels: Vec<&str> = labels.iter().map(String::as_str).collect();
    wait_for("latency histograms count the cycle", SOON, || {
        let m = agent.metrics();
        metric(&m, "coloc_preemption_latency_seconds_count", &labels) >= 1.0
            && metric(&m, "coloc_release_latency_seconds_count", &labels) >= 1.0
    })
    .unwrap_or_else(|e| panic!("{e}:\n{}", agent.metrics()));
}

#[test]
fn signal_actuator_preempts_and_releases() {
    let sim = Sim::start(1, &[]);
    let agent = Agent::start(&sim, AgentOpts::default());
    let off = sim.spawn(&args(&offline_args("sig")));
    agent.wait_processes(1);
    preempt_release_cycle(
        &sim,
        &agent,
        off.pid(),
        || off.state() == Some('T'),
        "signal",
    );
    // The /state document (published every 100 ms) names the GPU state and the process.
    wait_for("state shows release", SOON, || {
        agent.state()["gpus"][0]["state"] == "offline_running"
    })
    .unwrap();
    let st = agent.state();
    let procs = st["gpus"][0]["processes"].as_array().unwrap();
    assert!(
        procs
            .iter()
            .any(|p| p["pid"] == off.pid() && p["class"] == "offline"),
        "{st}"
    );
}

/// An agent with the freezer actuator and a rule declaring `cg` offline as a whole.
fn freezer_agent(sim: &Sim, cg: &TestCgroup) -> Agent {
    let rules = format!(
        "[[rule]]\nname = \"off\"\nclass = \"reclaimed_cores\"\ncgroup = \"{}\"\n",
        cg.path
    );
    Agent::start(
        sim,
        AgentOpts {
            rules: &rules,
            actuator: "freezer",
            ..Default::default()
        },
    )
}

/// Whether the agent's fail-open record lists `cg` as frozen through its own hierarchy.
fn recorded_as_frozen(agent: &Agent, cg: &TestCgroup) -> bool {
    let record: serde_json::Value = std::fs::read(agent.state_dir.join("suspended.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    record["suspended"].as_array().is_some_and(|es| {
        es.iter().any(|e| {
            e["kind"] == "cgroup"
                && e["dir"].as_str() == cg.dir.to_str()
                && e["version"] == cg.version
        })
    })
}

fn freezer_cycle(cg: TestCgroup) {
    let sim = Sim::start(1, &[]);
    let mut agent = freezer_agent(&sim, &cg);
    let off = sim.spawn_in_cgroup(&cg.dir, &args(&offline_args("frz")));
    wait_for("offline in cgroup", SOON, || cg.pids().contains(&off.pid())).unwrap();
    wait_for("agent sees offline", SOON, || {
        agent.state()["gpus"][0]["processes"]
            .as_array()
            .is_some_and(|p| p.iter().any(|p| p["actuator"] == "freezer"))
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log_text()));
    // Suspended means: this cgroup's own state file in its own hierarchy says frozen
    // (`frozen 1` in cgroup.events for v2, FROZEN in freezer.state for v1), its control
    // file holds what the agent wrote, and the agent's record names this hierarchy.
    let frozen_here = || {
        cg.frozen()
            && cg.control_file() == if cg.version == "v2" { "1" } else { "FROZEN" }
            && recorded_as_frozen(&agent, &cg)
    };
    // Written ahead: the cgroup is on disk before its first freeze, so the preemption
    // waits for no write.
    wait_for("the cgroup recorded ahead", SOON, || {
        recorded_as_frozen(&agent, &cg)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log_text()));
    preempt_release_cycle(&sim, &agent, off.pid(), frozen_here, "freezer");
    assert!(
        recorded_as_frozen(&agent, &cg),
        "the record let {} go while it could be frozen again",
        cg.dir.display()
    );
    // The agent stops: everything is resumed, and the record emptied.
    agent.signal(libc::SIGTERM);
    agent.wait();
    assert!(
        !recorded_as_frozen(&agent, &cg),
        "the record still lists {} after the agent stopped",
        cg.dir.display()
    );
}

/// Runs the freezer cycle on the `want` ("v2" or "v1") hierarchy. Where this host lacks
/// it, says so and checks the other one; fails when neither can be used.
fn freezer_test(test: &str, want: &str) {
    let name = unique("coloc-e2e-frz");
    type Make = fn(&str) -> Result<TestCgroup, String>;
    let (mine, other): (Make, Make) = if want == "v2" {
        (TestCgroup::try_v2, TestCgroup::try_v1)
    } else {
        (TestCgroup::try_v1, TestCgroup::try_v2)
    };
    let cg = mine(&name).unwrap_or_else(|why| {
        eprintln!(
            "NOTE: {test}: the cgroup {want} freezer is not usable on this host: {why}. \
             Checking the other hierarchy instead; the {want} path is NOT tested here."
        );
        other(&name).unwrap_or_else(|why2| {
            panic!("{test}: no cgroup freezer usable on this host: {want}: {why}; other: {why2}")
        })
    });
    eprintln!(
        "{test}: exercising the cgroup {} freezer at {}",
        cg.version,
        cg.dir.display()
    );
    freezer_cycle(cg);
}

#[test]
fn freezer_v2_preempts_and_releases() {
    freezer_test("freezer_v2_preempts_and_releases", "v2");
}

#[test]
fn freezer_v1_preempts_and_releases() {
    freezer_test("freezer_v1_preempts_and_releases", "v1");
}

/// With the signal actuator, a cgroup declared offline is stopped whole: its CPU-only
/// processes too, not only the one with a GPU context.
#[test]
fn signal_actuator_stops_every_process_of_an_offline_cgroup() {
    let name = unique("coloc-e2e-sigcg");
    let cg = TestCgroup::try_v2(&name).unwrap_or_else(|why| {
        eprintln!(
            "NOTE: cgroup v2 not usable ({why}): using a v1 freezer cgroup for its member list"
        );
        TestCgroup::try_v1(&name)
            .unwrap_or_else(|why1| panic!("a cgroup is required: v2: {why}; v1: {why1}"))
    });
    eprintln!(
        "signal_actuator_stops_every_process_of_an_offline_cgroup: cgroup {}",
        cg.version
    );
    let sim = Sim::start(1, &[]);
    let rules = format!(
        "[[rule]]\nname = \"off\"\nclass = \"reclaimed_cores\"\ncgroup = \"{}\"\n",
        cg.path
    );
    let agent = Agent::start(
        &sim,
        AgentOpts {
            rules: &rules,
            actuator: "signal",
            ..Default::default()
        },
    );
    let off = sim.spawn_in_cgroup(&cg.dir, &args(&offline_args("sigcg")));
    // A CPU-only helper of the same job: no GPU context, same cgroup.
    let helper = Proc(
        coloc_sim::command_in_cgroup(&cg.dir, std::path::Path::new("/bin/sleep"))
            .arg("60")
            .spawn()
            .unwrap(),
    );
    wait_for("both in the cgroup", SOON, || {
        let p = cg.pids();
        p.contains(&off.pid()) && p.contains(&helper.pid())
    })
    .unwrap();
    agent.wait_processes(1);
    let _online = sim.spawn(&["busy", "--gpu", "0", "--ms", "300"]);
    wait_for("GPU process and helper stopped", SOON, || {
        off.state() == Some('T') && helper.state() == Some('T')
    })
    .unwrap_or_else(|e| {
        panic!(
            "{e}: offline {:?}, helper {:?}\n{}",
            off.state(),
            helper.state(),
            agent.log_text()
        )
    });
    wait_for("both running again", Duration::from_secs(4), || {
        off.state() != Some('T') && helper.state() != Some('T')
    })
    .unwrap();
    assert!(!cg.frozen(), "the signal actuator froze the cgroup");
}

#[test]
fn online_system_and_unmanaged_are_never_touched() {
    let sim = Sim::start(1, &[]);
    let rules = "[[rule]]\nname = \"off\"\nclass = \"reclaimed_cores\"\ncmdline = \"*--tag victim*\"\n\
                 [[rule]]\nname = \"sys\"\nclass = \"system_cores\"\ncmdline = \"*--tag sysproc*\"\n\
                 [[rule]]\nname = \"on\"\nclass = \"shared_cores\"\ncmdline = \"*--tag svc*\"\n";
    let agent = Agent::start(
        &sim,
        AgentOpts {
            rules,
            ..Default::default()
        },
    );
    let off = sim.spawn(&["offline", "--step-ms", "2", "--tag", "victim"]);
    let sys = sim.spawn(&["offline", "--step-ms", "2", "--tag", "sysproc"]);
    let on = sim.spawn(&["offline", "--step-ms", "2", "--tag", "svc"]);
    let unmanaged = sim.spawn(&["offline", "--step-ms", "2", "--tag", "nobody"]);
    // Online (and unmanaged) work is continuously active: offline is suspended...
    wait_for("offline suspended", SOON, || off.state() == Some('T')).unwrap();
    // ...and nothing else is ever touched.
    holds_for(
        "online/system/unmanaged running",
        Duration::from_millis(800),
        || {
            [&sys, &on, &unmanaged]
                .iter()
                .all(|p| p.state() != Some('T'))
        },
    )
    .unwrap();
    let st = agent.state();
    let classes: Vec<_> = st["gpus"][0]["processes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["pid"].as_u64().unwrap() as u32,
                p["class"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    for (p, want) in [
        (&off, "offline"),
        (&sys, "system"),
        (&on, "online"),
        (&unmanaged, "unmanaged"),
    ] {
        assert!(
            classes.contains(&(p.pid(), want.to_string())),
            "{} should be {want}: {classes:?}",
            p.pid()
        );
    }
}

#[test]
fn unmanaged_can_be_configured_not_to_count_as_online() {
    let sim = Sim::start(1, &[]);
    let agent = Agent::start(
        &sim,
        AgentOpts {
            extra: vec!["--unmanaged-is-online".into(), "false".into()],
            ..Default::default()
        },
    );
    let off = sim.spawn(&args(&offline_args("x")));
    let _host = sim.spawn(&["offline", "--step-ms", "2", "--tag", "hostjob"]);
    agent.wait_processes(2);
    holds_for(
        "offline running beside unmanaged work",
        Duration::from_millis(500),
        || off.state() != Some('T'),
    )
    .unwrap();
}

#[test]
fn offline_appearing_while_busy_is_suspended_at_once() {
    let sim = Sim::start(1, &[]);
    let agent = Agent::start(&sim, AgentOpts::default());
    let _online = sim.spawn(&["busy", "--ms", "3000"]);
    wait_for("GPU busy", SOON, || {
        agent.state()["gpus"][0]["state"] == "online_busy"
    })
    .unwrap();
    let t = Instant::now();
    let off = sim.spawn(&args(&offline_args("late")));
    wait_for("late offline suspended", SOON, || off.state() == Some('T')).unwrap();
    eprintln!(
        "offline that appeared while busy was stopped after {:?}",
        t.elapsed()
    );
}

#[test]
fn child_forked_while_freezing_stays_frozen() {
    let name = unique("coloc-e2e-fork");
    let cg = TestCgroup::try_v2(&name).unwrap_or_else(|why| {
        eprintln!("NOTE: cgroup v2 freezer not usable ({why}): using the v1 freezer");
        TestCgroup::try_v1(&name)
            .unwrap_or_else(|why1| panic!("a cgroup freezer is required: v2: {why}; v1: {why1}"))
    });
    eprintln!(
        "child_forked_while_freezing_stays_frozen: exercising the cgroup {} freezer",
        cg.version
    );
    let sim = Sim::start(1, &[]);
    let agent = freezer_agent(&sim, &cg);
    // Offline spawns a helper every 3 ms; helpers bump a shared counter every ms.
    let _off = sim.spawn_in_cgroup(
        &cg.dir,
        &["offline", "--step-ms", "2", "--fork-every-ms", "3"],
    );
    let probe = sim.open();
    let progress = || {
        probe
            .header()
            .fork_progress
            .load(std::sync::atomic::Ordering::SeqCst)
    };
    wait_for("helpers running", SOON, || progress() > 50).unwrap();
    agent.wait_processes(1);
    let _online = sim.spawn(&["busy", "--ms", "1500"]);
    wait_for("cgroup frozen", SOON, || cg.frozen()).unwrap();
    let (p0, pids0) = (progress(), cg.pids());
    holds_for(
        "no progress and no new process while frozen",
        Duration::from_millis(400),
        || progress() == p0 && cg.pids().len() <= pids0.len() && cg.frozen(),
    )
    .unwrap();
    wait_for("thawed", Duration::from_secs(4), || !cg.frozen()).unwrap();
    wait_for("helpers run again", SOON, || progress() > p0 + 20).unwrap();
}

fn spawn_with_pid(want: u32) -> Option<Proc> {
    for _ in 0..50 {
        std::fs::write("/proc/sys/kernel/ns_last_pid", (want - 1).to_string()).ok()?;
        let c = std::process::Command::new("sleep").arg("30").spawn().ok()?;
        if c.id() == want {
            return Some(Proc(c));
        }
        let mut c = Proc(c);
        let _ = c.0.kill();
    }
    None
}

#[test]
fn reused_pid_is_never_signalled() {
    // The simulated driver keeps listing the dead process's PID, as a lagging driver might.
    let sim = Sim::start(1, &["--keep-dead"]);
    let agent = Agent::start(&sim, AgentOpts::default());
    let mut off = sim.spawn(&args(&offline_args("reuse")));
    let pid = off.pid();
    wait_for("agent pins offline", SOON, || {
        agent.state()["gpus"][0]["processes"]
            .as_array()
            .is_some_and(|p| p.iter().any(|p| p["pid"] == pid && p["class"] == "offline"))
    })
    .unwrap();
    off.0.kill().unwrap();
    off.wait_within("killed offline", Duration::from_secs(5));
    let Some(stranger) = spawn_with_pid(pid) else {
        panic!("could not make PID {pid} reused (needs root and /proc/sys/kernel/ns_last_pid)");
    };
    let _online = sim.spawn(&["busy", "--ms", "800"]);
    wait_for("GPU busy", SOON, || {
        agent.state()["gpus"][0]["state"] == "online_busy"
    })
    .unwrap();
    holds_for(
        "unrelated process with the reused PID running",
        Duration::from_millis(500),
        || stranger.state() != Some('T'),
    )
    .unwrap();
    wait_for("agent reclassifies the PID", SOON, || {
        agent.log_text().contains("same PID")
    })
    .unwrap();
}

#[test]
fn dry_run_decides_but_never_acts() {
    let sim = Sim::start(1, &[]);
    let agent = Agent::start(
        &sim,
        AgentOpts {
            extra: vec!["--dry-run".into()],
            ..Default::default()
        },
    );
    let off = sim.spawn(&args(&offline_args("dry")));
    agent.wait_processes(1);
    let _online = sim.spawn(&["busy", "--ms", "500"]);
    wait_for("decided busy", SOON, || {
        agent.state()["gpus"][0]["state"] == "online_busy"
    })
    .unwrap();
    holds_for(
        "offline never stopped in dry run",
        Duration::from_millis(400),
        || off.state() != Some('T'),
    )
    .unwrap();
    assert!(
        agent.log_text().contains("Dry run: would suspend"),
        "{}",
        agent.log_text()
    );
    assert!(
        metric(
            &agent.metrics(),
            "coloc_detection_latency_seconds_count",
            &[]
        ) >= 1.0
    );
    assert!(
        !std::fs::read_to_string(agent.state_dir.join("suspended.json"))
            .unwrap_or_default()
            .contains("pid")
    );
}
