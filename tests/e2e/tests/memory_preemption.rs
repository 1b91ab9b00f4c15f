//! Memory preemption and the driver's lock end to end: the real agent (`coloc-agent run
//! --memory-reserve`) on the simulated GPU, calling the simulated CUDA driver's checkpoint
//! API (`libcuda.so.1` of `tests/fake-cuda`, the calls carried out by a restore thread
//! inside each target as the real driver does; `coloc-sim`'s fake NVML reports the memory).
//! An online service that needs memory offline jobs hold gets it (the largest job
//! checkpointed, recorded first); the other job is held by the driver's lock while online
//! works, never stopped; the checkpointed job comes back after `--restore-after`; at the
//! agent's exit, and after `kill -9` through `coloc-agent resume`, everything is restored
//! and unlocked — thawed first where a hold froze it. Every wait is bounded.

use coloc_e2e::*;
use coloc_sim::checkpoint::{STATE_CHECKPOINTED, STATE_LOCKED, STATE_RUNNING};
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

const RULES: &str = "[[rule]]\nname = \"off\"\nclass = \"reclaimed_cores\"\ncmdline = \"*coloc-sim offline*\"\ncheckpoint = true\n\
                     [[rule]]\nname = \"svc\"\nclass = \"shared_cores\"\ncmdline = \"*coloc-sim online*\"\n";

const GIB: u64 = 1 << 30;

/// 16 GiB; a checkpoint costs 40 ms per GB, a restore 20 (plus 20 ms each).
fn sim() -> Sim {
    Sim::start(
        1,
        &[
            "--memory-gib",
            "16",
            "--checkpoint-ms-per-gb",
            "40",
            "--restore-ms-per-gb",
            "20",
        ],
    )
}

fn fake_libcuda() -> String {
    fake_cuda().join("libcuda.so.1").display().to_string()
}

/// The agent: a 6 GiB reserve, restores 2 s after the pressure ends, memory read every
/// 20 ms, events in `events`.
fn agent(sim: &Sim, events: &Path, state_dir: Option<PathBuf>) -> Agent {
    Agent::start(
        sim,
        AgentOpts {
            rules: RULES,
            extra: vec![
                "--memory-reserve".into(),
                "6GiB".into(),
                "--restore-after".into(),
                "2s".into(),
                "--memory-interval".into(),
                "20ms".into(),
                "--cuda-lib".into(),
                fake_libcuda(),
                "--event-log".into(),
                events.display().to_string(),
            ],
            state_dir,
            ..Default::default()
        },
    )
}

/// An offline job holding `mib` of device memory, 2 ms kernels; inside `cg` when given.
fn offline(sim: &Sim, mib: u64, cg: Option<&Path>) -> Proc {
    let mib = mib.to_string();
    let args = [
        "offline",
        "--cuda",
        "--step-ms",
        "2",
        "--depth",
        "4",
        "--mem-mib",
        &mib,
    ];
    let mut c = match cg {
        Some(cg) => {
            let mut c = coloc_sim::command_in_cgroup(cg, &bin("coloc-sim"));
            c.args(args).env("COLOC_SIM_STATE", &sim.state);
            c
        }
        None => sim.cmd(&args),
    };
    let p = Proc(
        c.env("LD_LIBRARY_PATH", fake_cuda())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn offline"),
    );
    let s = sim.open();
    wait_for("the job's first kernels", Duration::from_secs(10), || {
        s.slot_info(p.pid(), 0).is_some_and(|i| i.completed_ns > 0)
    })
    .unwrap();
    p
}

/// An online service that needs `mib` and waits for it (up to 20 s); returns it and how
/// long it waited for its memory.
fn online_waiting(sim: &Sim, mib: u64) -> (Proc, f64) {
    let mut child = sim
        .cmd(&[
            "online",
            "--cuda",
            "--rate",
            "50",
            "--work-ms",
            "2",
            "--mem-mib",
            &mib.to_string(),
            "--mem-wait-s",
            "20",
        ])
        .env("LD_LIBRARY_PATH", fake_cuda())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn online");
    let out = child.stdout.take().unwrap();
    let p = Proc(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // Reads to the end: the service must never write into a closed pipe.
        let mut lines = std::io::BufReader::new(out).lines();
        let first = lines.next().and_then(Result::ok).unwrap_or_default();
        let _ = tx.send(first);
        for _ in lines {}
    });
    let line = rx
        .recv_timeout(Duration::from_secs(25))
        .expect("the online service never got its memory");
    let v: serde_json::Value =
        serde_json::from_str(line.trim()).unwrap_or_else(|e| panic!("online said {line:?}: {e}"));
    let waited = v["memory_wait_s"]
        .as_f64()
        .unwrap_or_else(|| panic!("online said {line:?}"));
    (p, waited)
}

fn cu_state(sim: &Sim, pid: u32) -> u32 {
    sim.open()
        .proc_entry(pid)
        .map_or(u32::MAX, |e| e.cu_state())
}

fn completed(sim: &Sim, pid: u32) -> u64 {
    sim.open().slot_info(pid, 0).map_or(0, |i| i.completed_ns)
}

/// The job runs its kernels again.
fn wait_running(sim: &Sim, pid: u32, within: Duration) {
    wait_for("the job back in the driver's running state", within, || {
        cu_state(sim, pid) == STATE_RUNNING
    })
    .unwrap_or_else(|e| panic!("{e}: state {}", cu_state(sim, pid)));
    let before = completed(sim, pid);
    wait_for("the job's kernels again", Duration::from_secs(5), || {
        completed(sim, pid) > before
    })
    .unwrap();
}

fn events(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn record(dir: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(dir.join("suspended.json")).unwrap_or_default();
    serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v["suspended"].as_array().cloned())
        .unwrap_or_default()
}

fn recorded_kind(dir: &Path, kind: &str, pid: u32) -> bool {
    record(dir)
        .iter()
        .any(|e| e["kind"] == kind && e["pid"] == pid)
}

/// Waits until the largest job is checkpointed and the online service has its memory.
fn preempted(sim: &Sim, a: &Agent, big: &Proc, small: &Proc) -> (Proc, f64) {
    a.wait_processes(2);
    let (svc, waited) = online_waiting(sim, 6 * 1024);
    assert_eq!(
        cu_state(sim, big.pid()),
        STATE_CHECKPOINTED,
        "the largest job is checkpointed\n{}",
        a.log_text()
    );
    assert_ne!(
        cu_state(sim, small.pid()),
        STATE_CHECKPOINTED,
        "one was enough for the reserve"
    );
    (svc, waited)
}

#[test]
fn online_gets_the_memory_offline_holds_and_offline_comes_back_after_the_hold_time() {
    let sim = sim();
    let events_path = TempPath::new("coloc-e2e-mem-events");
    // 8 + 3 GiB of 16: 5 free; online needs 6, the reserve is 6.
    let big = offline(&sim, 8 * 1024, None);
    let small = offline(&sim, 3 * 1024, None);
    let a = agent(&sim, &events_path, None);
    let (mut svc, waited) = preempted(&sim, &a, &big, &small);
    assert!(waited < 5.0, "online waited {waited:.2} s for its memory");
    assert!(
        recorded_kind(&a.state_dir, "checkpoint", big.pid()),
        "the checkpoint is recorded: {:?}",
        record(&a.state_dir)
    );
    // While online works, the other job is held by the driver's lock, not stopped.
    wait_for("the small job locked", Duration::from_secs(5), || {
        cu_state(&sim, small.pid()) == STATE_LOCKED
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", a.log_text()));
    assert_ne!(small.state(), Some('T'), "locked, not stopped");
    let ev = events(&events_path);
    let ck = ev
        .iter()
        .find(|e| e["event"] == "checkpoint" && e["pid"] == big.pid())
        .unwrap_or_else(|| panic!("no checkpoint event: {ev:?}"));
    assert_eq!(ck["ok"], true);
    assert_eq!(ck["bytes"].as_u64(), Some(8 * GIB));
    let m = a.metrics();
    assert!(
        m.contains(&format!(
            "coloc_checkpoint_bytes_total{{op=\"checkpoint\"}} {}",
            8 * GIB
        )),
        "{m}"
    );
    assert!(
        m.contains("coloc_driver_call_seconds_count{op=\"checkpoint\"} 1"),
        "{m}"
    );
    // /state is published every 100 ms.
    let mut st = serde_json::Value::Null;
    wait_for(
        "/state after the checkpoint",
        Duration::from_secs(2),
        || {
            st = a.state();
            // (its memory figures are the latest read's, every 20 ms)
            let m = &st["gpus"][0]["memory"];
            m["checkpointed"] == 1 && m["pressure"] == false
        },
    )
    .unwrap_or_else(|e| panic!("{e}: {st}\n{}", a.log_text()));
    let g = &st["gpus"][0];
    assert_eq!(g["memory"]["pressure"], false, "{g}");
    assert_eq!(g["memory"]["reserve_bytes"].as_u64(), Some(6 * GIB), "{g}");
    assert_eq!(
        g["memory"]["checkpointed_bytes"].as_u64(),
        Some(8 * GIB),
        "{g}"
    );
    assert!(
        g["processes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["pid"] == big.pid() && p["driver"] == "checkpointed"),
        "{g}"
    );
    assert!(
        g["processes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["pid"] == small.pid() && p["actuator"] == "lock"),
        "{g}"
    );
    // Online leaves: 2 s later the job is restored and unlocked, the other unlocked.
    svc.0.kill().unwrap();
    let _ = svc.0.wait();
    wait_running(&sim, big.pid(), Duration::from_secs(10));
    wait_running(&sim, small.pid(), Duration::from_secs(5));
    let ev = events(&events_path);
    assert!(
        ev.iter()
            .any(|e| e["event"] == "restore" && e["pid"] == big.pid() && e["ok"] == true),
        "{ev:?}"
    );
    wait_for(
        "the checkpoint out of the record",
        Duration::from_secs(2),
        || !recorded_kind(&a.state_dir, "checkpoint", big.pid()),
    )
    .unwrap();
}

/// Jobs of 8 GiB (in `cg` when given) and 2 GiB, the agent, and an online service of
/// 1 GiB: 5 GiB free under a 6 GiB reserve, so the 8 GiB job is checkpointed, and there is
/// room for it again once the service has gone. Returns when it is checkpointed.
fn eight_checkpointed(
    sim: &Sim,
    events: &Path,
    state_dir: Option<PathBuf>,
    cg: Option<&Path>,
) -> (Proc, Proc, Agent, Proc) {
    let big = offline(sim, 8 * 1024, cg);
    let small = offline(sim, 2 * 1024, None);
    let a = agent(sim, events, state_dir);
    a.wait_processes(2);
    let (svc, _) = online_waiting(sim, 1024);
    wait_for(
        "the largest job checkpointed",
        Duration::from_secs(10),
        || cu_state(sim, big.pid()) == STATE_CHECKPOINTED,
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", a.log_text()));
    (big, small, a, svc)
}

#[test]
fn the_agents_exit_restores_and_unlocks_everything() {
    let sim = sim();
    let events_path = TempPath::new("coloc-e2e-mem-events");
    let (big, small, mut a, _svc) = eight_checkpointed(&sim, &events_path, None, None);
    let state_dir = a.state_dir.clone();
    a.signal(libc::SIGTERM);
    assert!(a.wait().success(), "{}", a.log_text());
    assert_eq!(cu_state(&sim, big.pid()), STATE_RUNNING, "{}", a.log_text());
    assert_eq!(cu_state(&sim, small.pid()), STATE_RUNNING);
    wait_running(&sim, big.pid(), Duration::from_secs(2));
    assert!(
        record(&state_dir).is_empty(),
        "the record is empty after exit: {:?}",
        record(&state_dir)
    );
}

/// `kill -9` while the job is checkpointed, its cgroup frozen by a hold the record holds
/// too: `coloc-agent resume` thaws first, then restores (the driver's restore runs on a
/// thread inside the job, which a frozen cgroup would keep from running), then unlocks.
#[test]
fn resume_after_kill_thaws_first_then_restores_and_unlocks() {
    let sim = sim();
    let events_path = TempPath::new("coloc-e2e-mem-events");
    let cg = match TestCgroup::try_v2(&unique("coloc-e2e-mem")) {
        Ok(cg) => Some(cg),
        Err(why) => {
            eprintln!(
                "NOTE: no v2 freezer here ({why}): checking the restore without a frozen cgroup"
            );
            None
        }
    };
    let state_dir = PathBuf::from("/dev/shm").join(unique("coloc-e2e-mem-state"));
    let _state = TempPath::at(state_dir.clone());
    let (big, small, mut a, _svc) = eight_checkpointed(
        &sim,
        &events_path,
        Some(state_dir.clone()),
        cg.as_ref().map(|c| c.dir.as_path()),
    );
    a.signal(libc::SIGKILL);
    let _ = a.wait();
    assert!(recorded_kind(&state_dir, "checkpoint", big.pid()));
    if let Some(cg) = &cg {
        // A hold that froze the job's cgroup, recorded as the agent records one.
        std::fs::write(cg.dir.join("cgroup.freeze"), "1").unwrap();
        wait_for("frozen", Duration::from_secs(5), || cg.frozen()).unwrap();
        let text = std::fs::read_to_string(state_dir.join("suspended.json")).unwrap();
        let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let entry = serde_json::to_value(coloc_agent::edges::actuator::RecordEntry::Cgroup {
            dir: cg.dir.clone(),
            version: coloc_agent::edges::actuator::CgroupVersion::V2,
            cell: None,
        })
        .unwrap();
        // Written last, so that an order taken from the file would restore first.
        v["suspended"].as_array_mut().unwrap().push(entry);
        std::fs::write(state_dir.join("suspended.json"), v.to_string()).unwrap();
    }
    let out = output_within(
        Command::new(bin("coloc-agent"))
            .args(["resume", "--state-dir"])
            .arg(&state_dir)
            .args(["--cuda-lib", &fake_libcuda(), "--driver-timeout", "5s"])
            .env("COLOC_SIM_STATE", &sim.state),
        Duration::from_secs(30),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    if let Some(cg) = &cg {
        assert!(!cg.frozen(), "thawed");
        let thaw = text.find("resumed cgroup").expect(&text);
        let restore = text
            .find(&format!("checkpoint of process {}", big.pid()))
            .expect(&text);
        assert!(thaw < restore, "thawed before the restore:\n{text}");
    }
    wait_running(&sim, big.pid(), Duration::from_secs(5));
    assert_eq!(cu_state(&sim, small.pid()), STATE_RUNNING);
    assert!(
        !record(&state_dir)
            .iter()
            .any(|e| e["kind"] == "checkpoint" || e["kind"] == "lock" || e["kind"] == "cgroup"),
        "{:?}",
        record(&state_dir)
    );
}

/// The driver refuses the largest job's lock (`CUDA_ERROR_NOT_SUPPORTED`, injected in the
/// simulated driver): the agent names the refusal, counts it, gives online the next job's
/// memory instead, and holds the refused job while online works with its other hold (a
/// signal), never locked or checkpointed.
#[test]
fn a_lock_the_driver_refuses_falls_back_and_the_next_job_gives_its_memory() {
    use coloc_sim::checkpoint::{CkFault, CkOp};
    let sim = sim();
    let events_path = TempPath::new("coloc-e2e-mem-events");
    let big = offline(&sim, 8 * 1024, None);
    let small = offline(&sim, 3 * 1024, None);
    sim.open().ckpt_inject(CkFault {
        ops: 1 << CkOp::Lock as u32,
        code: 801,
        fail_state: false,
        pid: big.pid(),
    });
    let a = agent(&sim, &events_path, None);
    a.wait_processes(2);
    // 5 GiB free, a reserve of 6: online (1 GiB) makes it 4; the 8 GiB job refuses, the
    // 3 GiB one is taken.
    let (_svc, waited) = online_waiting(&sim, 1024);
    wait_for(
        "the small job checkpointed",
        Duration::from_secs(10),
        || cu_state(&sim, small.pid()) == STATE_CHECKPOINTED,
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", a.log_text()));
    assert!(waited < 5.0, "{waited}");
    assert_eq!(cu_state(&sim, big.pid()), STATE_RUNNING);
    wait_for("the refusal counted", Duration::from_secs(5), || {
        a.metrics()
            .contains("coloc_driver_call_failures_total{op=\"lock\",reason=\"not_supported\"} 1")
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", a.metrics()));
    assert!(
        a.log_text().contains("The CUDA driver refused"),
        "{}",
        a.log_text()
    );
    // While online works, the refused job is stopped by its other plan.
    wait_for("the refused job stopped", Duration::from_secs(10), || {
        big.state() == Some('T')
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", a.log_text()));
    assert_eq!(cu_state(&sim, big.pid()), STATE_RUNNING);
    // Exactly one refusal: the driver is not asked again for the job its stop now holds
    // (it was, once, when the driver's state answer came before the hold book's check).
    let refused = "coloc_driver_call_failures_total{op=\"lock\",reason=\"not_supported\"} 1\n";
    holds_for(
        "one refusal, the lock not asked again",
        Duration::from_millis(500),
        || a.metrics().contains(refused),
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", a.metrics()));
}

/// Thaw before restore inside the running agent: a checkpointed job shares its container's
/// cgroup with a job held by freezing that cgroup. While online works, the hold freezes the
/// checkpointed job too; the GPU then has room for its restore (online's memory and a third
/// job gone) and `--restore-after` passes, but the restore waits for the thaw: it is asked
/// once online is idle and the cgroup thawed, and takes its own time (about 0.2 s for
/// 8 GiB here), not the freeze's.
#[test]
fn a_restore_waits_for_the_thaw_of_the_cgroup_a_hold_froze() {
    let name = unique("coloc-e2e-mem-thaw");
    let cg = TestCgroup::try_v2(&name)
        .or_else(|v2| TestCgroup::try_v1(&name).map_err(|v1| format!("v2: {v2}; v1: {v1}")))
        .unwrap_or_else(|why| panic!("a cgroup freezer is required (run as root): {why}"));
    eprintln!("exercising the cgroup {} freezer", cg.version);
    let sim = sim();
    let events_path = TempPath::new("coloc-e2e-mem-events");
    // The 8 GiB job may be checkpointed; every other job in the cgroup is held by its
    // freezer; the 4 GiB job outside it, by its stop.
    let rules = format!(
        "[[rule]]\nname = \"ckpt\"\nclass = \"reclaimed_cores\"\ncmdline = \"*coloc-sim offline*--mem-mib 8192*\"\ncheckpoint = true\n\
         [[rule]]\nname = \"ctr\"\nclass = \"reclaimed_cores\"\ncgroup = \"{}\"\n\
         [[rule]]\nname = \"other\"\nclass = \"reclaimed_cores\"\ncmdline = \"*coloc-sim offline*\"\n\
         [[rule]]\nname = \"svc\"\nclass = \"shared_cores\"\ncmdline = \"*coloc-sim online*\"\n\
         [[rule]]\nname = \"busy\"\nclass = \"shared_cores\"\ncmdline = \"*coloc-sim busy*\"\n",
        cg.path
    );
    let big = offline(&sim, 8 * 1024, Some(&cg.dir));
    let held = offline(&sim, 1024, Some(&cg.dir));
    let third = offline(&sim, 4 * 1024, None);
    let a = Agent::start(
        &sim,
        AgentOpts {
            rules: &rules,
            actuator: "freezer",
            extra: vec![
                "--memory-reserve".into(),
                "6GiB".into(),
                "--restore-after".into(),
                "1s".into(),
                "--memory-interval".into(),
                "20ms".into(),
                "--cuda-lib".into(),
                fake_libcuda(),
                "--event-log".into(),
                events_path.display().to_string(),
            ],
            ..Default::default()
        },
    );
    a.wait_processes(3);
    // 13 GiB of 16 held: online's 4 GiB waits, the 8 GiB job is checkpointed.
    let (svc, _) = online_waiting(&sim, 4 * 1024);
    assert_eq!(
        cu_state(&sim, big.pid()),
        STATE_CHECKPOINTED,
        "{}",
        a.log_text()
    );
    // Online keeps working with no memory of its own; the service and the third job go:
    // 15 GiB free, room for the restore beside the reserve.
    let busy = sim.spawn(&["busy", "--ms", "4000"]);
    wait_for(
        "the cgroup frozen by the hold",
        Duration::from_secs(5),
        || cg.frozen(),
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", a.log_text()));
    drop((svc, third));
    // Past --restore-after, while online works and the cgroup stays frozen: no restore.
    holds_for(
        "the checkpointed job left checkpointed while its cgroup is frozen",
        Duration::from_millis(2500),
        || cg.frozen() && cu_state(&sim, big.pid()) == STATE_CHECKPOINTED,
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", a.log_text()));
    drop(busy);
    wait_for("the cgroup thawed", Duration::from_secs(5), || !cg.frozen())
        .unwrap_or_else(|e| panic!("{e}\n{}", a.log_text()));
    wait_running(&sim, big.pid(), Duration::from_secs(10));
    let ev = events(&events_path);
    let restore = ev
        .iter()
        .find(|e| e["event"] == "restore" && e["pid"] == big.pid())
        .unwrap_or_else(|| panic!("no restore event: {ev:?}"));
    assert_eq!(restore["ok"], true, "{restore}");
    let took = restore["took_s"].as_f64().unwrap();
    assert!(
        took < 1.0,
        "the restore took {took:.2} s: it was asked while the cgroup was frozen and waited for the thaw\n{}",
        a.log_text()
    );
    assert_ne!(held.state(), Some('T'));
}
