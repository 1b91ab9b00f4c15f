//! The real-GPU harness (`benches/gpu/run.py`) without a GPU: its drain measure on made-up
//! kernels, and a whole run with `--sim` (the simulated GPU and the fake NVML in place of
//! PyTorch and the driver).

use coloc_e2e::agent_tests::*;
use coloc_e2e::*;
use std::time::Duration;

#[test]
fn gpu_harness_drain_threshold_survives_a_noisy_baseline() {
    // The harness's drain measure on made-up kernels (start s, latency ms), no GPU: a
    // baseline of 5 ms with p90 at 8.6 ms (what a loaded CI machine gave the simulated
    // GPU) must still see kernels slowed twofold, the simulated GPU's even share, as the
    // drain: six of them, then clean kernels. Without the cap on the threshold, the
    // threshold was 12.1 ms and the drain measured 0 ms.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../benches/gpu");
    let code = r#"
import json, sys
sys.path.insert(0, sys.argv[1])
import run
ks = [(i * 0.0101, 10.1) for i in range(6)] + [(0.0606 + i * 0.0051, 5.1) for i in range(40)]
print(json.dumps(run.burst_stats(ks, [(0.0, 0.3)], [5.1, 8.6, 11.0])))
"#;
    let r = output_within(
        std::process::Command::new("python3")
            .args(["-c", code])
            .arg(&dir),
        CMD_LIMIT,
    );
    let log = format!(
        "{}\n{}",
        String::from_utf8_lossy(&r.stdout),
        String::from_utf8_lossy(&r.stderr)
    );
    assert!(r.status.success(), "{log}");
    let v: serde_json::Value = serde_json::from_slice(&r.stdout).expect(&log);
    let thr = v["threshold_ms"].as_f64().unwrap();
    assert!(thr < 10.0, "the threshold is under a twofold step: {v}");
    let drain = v["drain_ms"][0].as_f64().unwrap();
    assert!((60.0..61.0).contains(&drain), "six slowed kernels: {v}");
    assert_eq!(v["drain_n"], 1, "{v}");
    // A quiet baseline keeps the p50 / 2 floor.
    let code = code.replace("[5.1, 8.6, 11.0]", "[5.1, 5.2, 5.4]");
    let r = output_within(
        std::process::Command::new("python3")
            .args(["-c", &code])
            .arg(&dir),
        CMD_LIMIT,
    );
    let v: serde_json::Value = serde_json::from_slice(&r.stdout).unwrap();
    assert!(
        (v["threshold_ms"].as_f64().unwrap() - 7.65).abs() < 1e-9,
        "{v}"
    );
}

#[test]
fn gpu_harness_runs_end_to_end_on_the_simulated_gpu() {
    let _cpu_latency = cpu_latency_lock();
    // benches/gpu/run.py is what runs on a real GPU; --sim swaps PyTorch and the driver for
    // coloc-sim and the fake NVML, so the whole harness is exercised here. One step is made
    // to fail (with its workloads running): it must be recorded, torn down, and the run go on.
    let out = std::env::temp_dir().join(unique("coloc-e2e-gpu-harness"));
    let bindir = bin("coloc-agent").parent().unwrap().to_path_buf();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../benches/gpu/run.py");
    let r = output_within(
        std::process::Command::new("python3")
            .arg(&script)
            .args([
                "--sim",
                "--duration",
                "2",
                "--warmup",
                "0.5",
                "--warmup-run",
                "0.5",
                "--probe-seconds",
                "1.5",
                "--rate",
                "5",
                "--wake-floor-samples",
                "5",
                "--nvml-load-duration",
                "1",
                "--nvml-load-intervals",
                "none,1",
                "--nvml-view-rates",
                "5,40",
                "--nvml-view-seconds",
                "1.5",
                "--drain-configs",
                "alone,signal:large,gate2+0ms:large",
                "--drain-bursts",
                "2",
                "--drain-burst-ms",
                "300",
                "--drain-gap-ms",
                "250",
                "--drain-open",
                "0.5",
                "--ckpt-gb",
                "0.5",
                "--ckpt-parallel-gb",
                "0.5",
                "--ckpt-stop-s",
                "0.3",
                "--ckpt-lock-reps",
                "2",
                "--commit",
                "0123456789abcdef0123456789abcdef01234567",
                "--fail-step",
                "no-agent",
                // The driver's lock, memory preemption and the driver probes: their own tests.
                "--skip",
                "driver-lock,memory,tsg,timeslice-policy,mps",
            ])
            .arg("--bin")
            .arg(&bindir)
            .arg("--out")
            .arg(&out),
        Duration::from_secs(300),
    );
    let log = format!(
        "{}\n{}",
        String::from_utf8_lossy(&r.stdout),
        String::from_utf8_lossy(&r.stderr)
    );
    assert!(r.status.success(), "{log}");
    // The output: a few plain files with portable names (easy to copy off a GPU machine).
    let mut files: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "artifacts.tar.gz",
            "progress.log",
            "results.json",
            "results.md"
        ],
        "{log}"
    );
    let res: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("results.json")).unwrap()).unwrap();
    assert_eq!(res["complete"], true, "{res}");
    assert_eq!(
        res["meta"]["commit"],
        "0123456789abcdef0123456789abcdef01234567"
    );
    assert_eq!(
        res["meta"]["binaries"]["coloc-agent"]["sha256"]
            .as_str()
            .unwrap()
            .len(),
        64
    );
    // The simulated driver's period, which is the H100's (200 ms).
    assert_eq!(res["meta"]["nvml_sample_period"]["value"], "200ms");
    // Every step recorded; the injected failure as an error, every other step ok.
    let steps = res["steps"].as_array().unwrap();
    let names: Vec<&str> = steps.iter().map(|s| s["step"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "preflight",
            "probe",
            "nvml-view",
            "warmup",
            "online-alone",
            "offline-alone",
            "no-agent",
            "dry-run",
            "signal",
            "freezer",
            "doorbell",
            "gate",
            "learned",
            "at-once",
            "wake-floor",
            "drain",
            "nvml-load",
            "checkpoint"
        ]
    );
    for s in steps {
        let want = if s["step"] == "no-agent" {
            "error"
        } else {
            "ok"
        };
        assert_eq!(s["status"], want, "{s}");
    }
    let rows = res["scenarios"].as_array().unwrap();
    assert_eq!(rows.len(), 10);
    let get = |name: &str| rows.iter().find(|r| r["scenario"] == name).unwrap().clone();
    let failed = get("both, no agent");
    assert!(
        failed["error"].as_str().unwrap().contains("--fail-step"),
        "{failed}"
    );
    assert!(
        failed["exit"]["offline"].is_i64(),
        "the failed step's offline process was ended: {failed}"
    );
    assert!(get("online alone")["online_p99_ms"].as_f64().unwrap() > 0.0);
    assert!(
        get("offline alone")["offline_steps_per_s"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    let sig = get("both, agent signal");
    assert!(sig["preemptions"].as_u64().unwrap() >= 1, "{sig}");
    assert!(sig.get("warnings").is_none(), "{sig}");
    assert_eq!(sig["exit"]["agent"], 0, "{sig}");
    assert!(sig["agent_cpu_pct"].as_f64().unwrap() >= 0.0, "{sig}");
    assert!(
        get("both, agent dry-run")["preemption_ms"][0].is_null(),
        "dry run never acts"
    );
    // The launch rows: online under the shim rings, and with the gate offline is held at
    // its gate (confirmed by its acknowledgement), not stopped.
    let bell = get("both, agent doorbell");
    assert!(
        bell["signals"]["doorbell"].as_u64().unwrap_or(0) >= 1,
        "{bell}"
    );
    let gate = get("both, agent doorbell + gate");
    assert!(
        gate["signals"]["doorbell"].as_u64().unwrap_or(0) >= 1,
        "{gate}"
    );
    assert!(
        gate["actuators"]["gate"].as_u64().unwrap_or(0) >= 1,
        "{gate}"
    );
    assert!(gate.get("warnings").is_none(), "{gate}");
    // The learned row runs the gate's set-up with --release learned (too short here for a
    // window to be learned: it holds and releases as the gate row does).
    let learned = get("both, agent doorbell + gate + learned release");
    assert!(
        learned["actuators"]["gate"].as_u64().unwrap_or(0) >= 1,
        "{learned}"
    );
    assert_eq!(learned["exit"]["agent"], 0, "{learned}");
    // The release-at-once row needs no gaps learned: it releases at once after requests.
    let at_once = get("both, agent doorbell + gate + release at once");
    assert!(
        at_once["learned_releases"].as_u64().unwrap_or(0) >= 1,
        "{at_once}"
    );
    assert_eq!(at_once["exit"]["agent"], 0, "{at_once}");
    assert!(
        res["wake_floor"]["rows"].as_array().unwrap().len() >= 2,
        "{}",
        res["wake_floor"]
    );
    assert!(
        res["nvml_probe"]["sample_interval_ms"]["p50"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    // What NVML shows of online work: every sample of the online process is recorded, and
    // the simulated 10 ms requests (5 % and 40 % of the time) are seen by them.
    let view = res["nvml_view"].as_array().unwrap();
    assert_eq!(view.len(), 2, "{view:?}");
    for v in view {
        assert!(v["samples_active"].as_u64().unwrap() >= 3, "{v}");
        assert!(v["requests"].as_u64().unwrap() >= 3, "{v}");
        assert!(v["seen_share"].as_f64().unwrap() > 0.5, "{v}");
    }
    // NVML polled beside online work: the unpolled run and the 1 ms one.
    let load = res["nvml_load"].as_array().unwrap();
    assert_eq!(load.len(), 2, "{load:?}");
    assert_eq!(load[0]["interval_ms"], "none");
    assert!(load[0]["latency_ms"][0].as_f64().unwrap() > 0.0, "{load:?}");
    assert!(load[1]["polls_per_s"].as_f64().unwrap() > 100.0, "{load:?}");
    // The drain as online sees it: the probe's bursts against its baseline. SIGSTOP
    // leaves offline's 16 queued kernels to run beside online; the gate at K = 2 leaves
    // two, so online is delayed for less time (the measure tells them apart).
    let drain = &res["drain"];
    assert!(drain["baseline_ms"][0].as_f64().unwrap() > 0.0, "{drain}");
    let cfg = |name: &str| {
        drain["configs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap()
            .clone()
    };
    let (sig, gate) = (cfg("signal:large"), cfg("gate2+0ms:large"));
    for c in [&sig, &gate] {
        assert!(
            c.get("error").is_none() && c.get("warnings").is_none(),
            "{c}"
        );
        assert!(c["drain_n"].as_u64().unwrap() >= 1, "{c}");
        assert!(c["offline_open_steps_per_s"].as_f64().unwrap() > 0.0, "{c}");
    }
    assert!(
        sig["actuators"]["signal"].as_u64().unwrap_or(0) >= 1,
        "{sig}"
    );
    assert!(
        gate["actuators"]["gate"].as_u64().unwrap_or(0) >= 1,
        "{gate}"
    );
    assert!(
        sig["drain_ms"][0].as_f64().unwrap() > 2.0 * gate["drain_ms"][0].as_f64().unwrap(),
        "SIGSTOP's drain is the whole queue, the gate's two kernels: {sig}\n{gate}"
    );
    // The driver's checkpoint API (the simulated driver's): the cycle's states, the
    // answers out of order, every call on a stopped process waiting for SIGCONT, and the
    // lock keeping the GPU to online (the probe's kernels as fast as alone).
    let ck = &res["checkpoint"];
    let run = &ck["runs"][0];
    let states: Vec<&str> = [
        "state_locked",
        "state_checkpointed",
        "state_restored",
        "state_after",
    ]
    .iter()
    .map(|k| run[*k].as_str().unwrap_or("?"))
    .collect();
    assert_eq!(
        states,
        ["locked", "checkpointed", "locked", "running"],
        "{run}"
    );
    assert_eq!(run["listed_while_checkpointed"], false, "{run}");
    assert_eq!(
        ck["edges"]["unlock_running"]["calls"][0]["name"], "CUDA_ERROR_ILLEGAL_STATE",
        "{ck}"
    );
    assert_eq!(
        ck["edges"]["state_no_process"]["calls"][0]["name"], "CUDA_ERROR_OPERATING_SYSTEM",
        "{ck}"
    );
    for k in [
        "checkpoint_stopped",
        "restore_stopped",
        "unlock_stopped",
        "lock_stopped",
    ] {
        let x = &ck["stopped"][k];
        assert_eq!(x["returned_while_stopped"], false, "{k}: {x}");
        assert_eq!(x["calls"][0]["ok"], true, "{k}: {x}");
    }
    let lat = |k: &str| ck["large"][k]["latency_ms"][0].as_f64().unwrap();
    assert!(
        lat("beside_locked") < 0.75 * lat("beside") && lat("beside_locked") < 1.25 * lat("alone"),
        "online beside a locked job runs as if alone: {}",
        ck["large"]
    );
    assert_eq!(
        ck["parallel"]["checkpoint_both"]["each"]
            .as_array()
            .unwrap()
            .len(),
        2,
        "{ck}"
    );
    let md = std::fs::read_to_string(out.join("results.md")).unwrap();
    assert!(md.contains("## The CUDA driver's checkpoint API"), "{md}");
    assert!(md.contains("| gate2+0ms:large |"), "{md}");
    assert!(
        md.contains("## Does polling NVML slow online work?"),
        "{md}"
    );
    assert!(md.contains("| both, agent signal |"), "{md}");
    assert!(md.contains("| agent CPU % of a core |"), "{md}");
    assert!(md.contains("| no-agent | error |"), "{md}");
    // The artifacts: agent and event logs, the agent's /state, per-process results.
    let tar = std::process::Command::new("tar")
        .arg("tzf")
        .arg(out.join("artifacts.tar.gz"))
        .output()
        .unwrap();
    assert!(tar.status.success());
    let listing = String::from_utf8_lossy(&tar.stdout);
    for f in [
        "signal-agent.log",
        "signal-events.jsonl",
        "signal-state.json",
        "gate-offline.json",
        "probe.json",
        "drain-signal-large-probe.json",
        "drain-gate2-0ms-large-offline.log",
        "nvml-load-1-1-poll.json",
        "nvml-load-1-1-probe.json",
    ] {
        assert!(listing.lines().any(|l| l == f), "{f} missing:\n{listing}");
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// `benches/gpu/run.py --sim` with these arguments, into a fresh output directory: the
/// results document and the run's output.
fn run_harness(args: &[&str], limit: Duration) -> (serde_json::Value, String, std::path::PathBuf) {
    let out = std::env::temp_dir().join(unique("coloc-e2e-gpu-harness"));
    let bindir = bin("coloc-agent").parent().unwrap().to_path_buf();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../benches/gpu/run.py");
    let r = output_within(
        std::process::Command::new("python3")
            .arg(&script)
            .arg("--sim")
            .args(args)
            .args(["--commit", "0123456789abcdef0123456789abcdef01234567"])
            .arg("--bin")
            .arg(&bindir)
            .arg("--out")
            .arg(&out),
        limit,
    );
    let log = format!(
        "{}\n{}",
        String::from_utf8_lossy(&r.stdout),
        String::from_utf8_lossy(&r.stderr)
    );
    assert!(r.status.success(), "{log}");
    let res: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("results.json")).expect(&log)).expect(&log);
    (res, log, out)
}

#[test]
fn gpu_harness_memory_step_checkpoints_offline_for_online_and_restores_it() {
    // The memory step on the simulated GPU (its memory and the fake driver's checkpoint
    // API): two offline loops (0.5 and 1 GB extra, classed offline with checkpoint = true)
    // and an online process that needs more than is free beside them. The agent
    // (--driver-lock, --memory-reserve, --restore-after 1s) checkpoints both, the larger
    // first, online's allocation then succeeds, and once online has exited both are
    // restored. Then the driver-lock row (doorbell + gate + --driver-lock): offline held by
    // the driver's lock.
    let (res, log, out) = run_harness(
        &[
            "--only",
            "memory",
            "--memory-runs",
            "0.5+1",
            "--memory-hold-s",
            "0.5",
            "--memory-restore-after-s",
            "1",
            "--memory-row-duration",
            "2",
            "--rate",
            "5",
            "--budget",
            "200",
        ],
        Duration::from_secs(240),
    );
    let steps = res["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 1, "{log}");
    assert_eq!(steps[0]["status"], "ok", "{}\n{log}", steps[0]);
    let m = &res["memory"];
    let run = &m["runs"][0];
    assert!(run.get("error").is_none(), "{run}");
    let online = &run["online"];
    assert!(
        online["attempts"].as_u64().unwrap() > 1,
        "online's first attempts failed: {online}"
    );
    assert!(online["wait_s"].as_f64().unwrap() > 0.0, "{online}");
    let kinds = |k: &str| -> Vec<serde_json::Value> {
        run["events"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["event"] == k || e["kind"] == k)
            .cloned()
            .collect()
    };
    let (ck, rs) = (kinds("checkpoint"), kinds("restore"));
    assert_eq!(ck.len(), 2, "both loops checkpointed: {run}");
    assert_eq!(rs.len(), 2, "both loops restored: {run}");
    assert!(ck.iter().chain(&rs).all(|e| e["ok"] == true), "{run}");
    assert_eq!(run["largest_first"], true, "{run}");
    // Restored after online exited, not before --restore-after (1 s; the harness sees the
    // exit up to a poll late), and not much later either.
    let again = run["running_again_s_after_online_exit"].as_f64().unwrap();
    assert!((0.7..10.0).contains(&again), "{run}");
    let restored = run["restored_s_after_online_exit"].as_f64().unwrap();
    assert!((0.7..again).contains(&restored), "{run}");
    for o in run["offline"].as_array().unwrap() {
        assert!(o["held_s"].is_array(), "seen held in /state: {o}");
    }
    let calls = &run["metrics"]["calls"];
    assert_eq!(calls["checkpoint"]["count"], 2, "{calls}");
    assert_eq!(calls["restore"]["count"], 2, "{calls}");
    let rows = m["rows"].as_array().unwrap();
    let lock = rows
        .iter()
        .find(|r| r["scenario"] == "both, agent doorbell + gate + driver lock")
        .unwrap();
    assert!(lock.get("error").is_none(), "{lock}");
    assert!(
        lock["driver_calls"]["lock"].as_u64().unwrap_or(0) >= 1,
        "held by the driver's lock: {lock}"
    );
    assert!(lock.get("warnings").is_none(), "{lock}");
    assert_eq!(lock["exit"]["agent"], 0, "{lock}");
    assert!(lock["online_p99_ms"].as_f64().unwrap() > 0.0, "{lock}");
    let md = std::fs::read_to_string(out.join("results.md")).unwrap();
    assert!(
        md.contains("## Memory preemption and the driver's lock"),
        "{md}"
    );
    assert!(
        md.contains("| both, agent doorbell + gate + driver lock |"),
        "{md}"
    );
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn gpu_harness_memory_step_fails_at_once_without_the_checkpoint_api() {
    // A driver library without the checkpoint API (here the fake NVML library in its
    // place): the step fails before it starts anything, saying why.
    let lib = bin("coloc-agent").parent().unwrap().join("libfake_nvml.so");
    let t = std::time::Instant::now();
    let (res, log, out) = run_harness(
        &[
            "--only",
            "memory",
            "--memory-runs",
            "0.5",
            "--memory-row-duration",
            "2",
            "--budget",
            "200",
            "--cuda-lib",
            lib.to_str().unwrap(),
        ],
        Duration::from_secs(60),
    );
    assert!(t.elapsed() < Duration::from_secs(20), "{log}");
    let step = &res["steps"][0];
    assert_eq!(step["status"], "error", "{step}");
    assert!(
        step["error"]
            .as_str()
            .unwrap()
            .contains("checkpoint API cannot be used"),
        "{step}"
    );
    assert!(
        res["memory"]["runs"].as_array().unwrap().is_empty(),
        "{res}"
    );
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn gpu_harness_merge_joins_drain_configurations_and_prefers_a_passing_preflight() {
    // Parts run on a GPU machine are joined with --merge: every drain configuration that
    // ran in any part is kept, with its part; one skipped everywhere stays as skipped; the
    // preflight shown is a part's that passed, not the first part's failed one.
    let dir = std::env::temp_dir().join(unique("coloc-e2e-gpu-merge"));
    let part = |name: &str, preflight_ok: bool, configs: serde_json::Value| {
        let d = dir.join(name);
        std::fs::create_dir_all(&d).unwrap();
        let doc = serde_json::json!({
            "complete": true, "meta": {"sim": false, "commit": name, "binaries": {}},
            "steps": [{"step": "preflight", "status": if preflight_ok { "ok" } else { "error" }}],
            "preflight": {"from": name}, "scenarios": [],
            "drain": {"bursts": 5, "burst_ms": 300.0, "gap_ms": 700.0, "open_s": 4.0, "configs": configs},
        });
        std::fs::write(d.join("results.json"), doc.to_string()).unwrap();
        d
    };
    let row = |name: &str, skipped: bool| {
        let mut r = serde_json::json!({"name": name, "model": "large", "bursts": 5, "delay_ms": [1.0, 2.0]});
        if skipped {
            r["skipped"] = "the step's deadline".into();
        }
        r
    };
    let p1 = part(
        "p1",
        false,
        serde_json::json!([
            row("alone", false),
            row("gate4:large", true),
            row("gate1:large", true)
        ]),
    );
    let p2 = part(
        "p2",
        true,
        serde_json::json!([row("alone", false), row("gate4:large", false)]),
    );
    let out = dir.join("all");
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../benches/gpu/run.py");
    let r = output_within(
        std::process::Command::new("python3")
            .arg(&script)
            .arg("--merge")
            .args([&p1, &p2])
            .arg("--out")
            .arg(&out),
        CMD_LIMIT,
    );
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("results.json")).unwrap()).unwrap();
    assert_eq!(m["preflight"]["from"], "p2", "{m}");
    let got: Vec<(String, String, bool)> = m["drain"]["configs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap().to_string(),
                c["part"].as_str().unwrap().to_string(),
                c.get("skipped").is_some(),
            )
        })
        .collect();
    let want = [
        ("alone", "p1", false),
        ("alone", "p2", false),
        ("gate4:large", "p2", false),
        ("gate1:large", "p1", true),
    ]
    .map(|(a, b, c)| (a.to_string(), b.to_string(), c));
    assert_eq!(got, want, "{m}");
    let md = std::fs::read_to_string(out.join("results.md")).unwrap();
    assert!(md.contains("| gate4:large (p2, 5 bursts) |"), "{md}");
    assert!(md.contains("  - p2: "), "{md}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn gpu_harness_probes_run_what_they_can_without_a_gpu() {
    // The driver probes under --sim. tsg builds its hook with cc and checks it against
    // the fake RM device (tsg_check.py: the handles it learns from alloc ioctls, its
    // controls byte for byte), then runs the training loop's command protocol on the
    // stand-in PyTorch, whose "CUDA" allocates two channel groups through that device:
    // the groups learned, the default slice read (the fake's 2048 us), the smallest
    // candidate the fake accepts (100 us; 1, 10 and 50 refused with its status 0x1f),
    // the default restored. timeslice-policy and mps need the GPU: skipped, saying so,
    // with the commands they would run.
    let (res, log, out) = run_harness(
        &["--only", "probes", "--budget", "200"],
        Duration::from_secs(180),
    );
    let steps = res["steps"].as_array().unwrap();
    let step = |n: &str| {
        steps
            .iter()
            .find(|s| s["step"] == n)
            .unwrap_or_else(|| panic!("{n}: {log}"))
    };
    assert_eq!(step("preflight")["status"], "ok", "{log}");
    assert_eq!(step("tsg")["status"], "ok", "{}\n{log}", step("tsg"));
    for n in ["timeslice-policy", "mps"] {
        let s = step(n);
        assert_eq!(s["status"], "skipped", "{s}");
        assert!(
            s["reason"]
                .as_str()
                .unwrap()
                .starts_with("needs an NVIDIA GPU"),
            "{s}"
        );
    }
    let t = &res["probes"]["tsg"];
    assert_eq!(t["fake_device"]["ok"], true, "{t}");
    let checks = t["fake_device"]["checks"].as_object().unwrap();
    assert!(
        checks.len() >= 10 && checks.values().all(|v| v == true),
        "{t}"
    );
    assert_eq!(t["groups"].as_array().unwrap().len(), 2, "{t}");
    assert_eq!(t["seen"]["rm_allocs"], 4, "client, device, two groups: {t}");
    assert_eq!(t["default_us"], serde_json::json!([2048]), "{t}");
    assert_eq!(t["accepted_us"], serde_json::json!([100, 100]), "{t}");
    for g in t["min"]["groups"].as_array().unwrap() {
        let tries: Vec<(u64, i64)> = g["tries"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| (x["us"].as_u64().unwrap(), x["status"].as_i64().unwrap()))
            .collect();
        assert_eq!(tries, [(1, 0x1f), (10, 0x1f), (50, 0x1f), (100, 0)], "{g}");
        assert_eq!(g["get_after"]["us"], 100, "{g}");
    }
    for g in t["restore"]["groups"].as_array().unwrap() {
        assert_eq!(g["set"]["status"], 0, "{g}");
        assert_eq!(g["get_after"]["us"], 2048, "restored to the default: {g}");
    }
    assert!(
        t["gpu_part"]
            .as_str()
            .unwrap()
            .starts_with("skipped: needs an NVIDIA GPU"),
        "{t}"
    );
    assert!(
        t["verdict"]
            .as_str()
            .unwrap()
            .contains("accepted SET_TIMESLICE down to 100 us"),
        "{t}"
    );
    let p = &res["probes"]["timeslice_policy"]["plan"]["commands"];
    let sets: Vec<String> = p["set"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c[4].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        sets,
        [
            "--set-timeslice=0",
            "--set-timeslice=1",
            "--set-timeslice=2",
            "--set-timeslice=3"
        ],
        "{p}"
    );
    let m = &res["probes"]["mps"]["plan"]["commands"];
    assert_eq!(m["quit"], "echo quit | nvidia-cuda-mps-control", "{m}");
    assert_eq!(
        m["offline_variants"]["priority"]["CUDA_MPS_CLIENT_PRIORITY"], "1",
        "{m}"
    );
    assert_eq!(
        m["offline_variants"]["threads"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "50",
        "{m}"
    );
    let md = std::fs::read_to_string(out.join("results.md")).unwrap();
    assert!(
        md.contains("**Verdict: simulated: the driver accepted SET_TIMESLICE down to 100 us"),
        "{md}"
    );
    assert!(
        md.contains("### mps: online and offline as MPS clients"),
        "{md}"
    );
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn gpu_harness_tsg_without_a_c_compiler_says_how_to_build_the_hook() {
    // A machine without cc and without a prebuilt hook: the step fails at once, naming
    // what is missing and the command that builds the hook elsewhere.
    let path = TempPath::dir("coloc-e2e-no-cc"); // removed however the test ends
                                                 // The interpreter itself (a launcher such as pyenv's shim needs a shell on PATH).
    let py = output_within(
        std::process::Command::new("python3").args(["-c", "import sys; print(sys.executable)"]),
        CMD_LIMIT,
    );
    let py = String::from_utf8_lossy(&py.stdout).trim().to_string();
    std::os::unix::fs::symlink(&py, path.join("python3")).unwrap();
    let out = std::env::temp_dir().join(unique("coloc-e2e-gpu-harness"));
    let bindir = bin("coloc-agent").parent().unwrap().to_path_buf();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../benches/gpu/run.py");
    let r = output_within(
        std::process::Command::new(path.join("python3"))
            .arg(&script)
            .args([
                "--sim",
                "--only",
                "tsg",
                "--budget",
                "60",
                "--commit",
                "0123456789abcdef0123456789abcdef01234567",
            ])
            .arg("--bin")
            .arg(&bindir)
            .arg("--out")
            .arg(&out)
            .env("PATH", &path),
        Duration::from_secs(60),
    );
    let log = format!(
        "{}\n{}",
        String::from_utf8_lossy(&r.stdout),
        String::from_utf8_lossy(&r.stderr)
    );
    let res: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("results.json")).expect(&log)).expect(&log);
    let step = &res["steps"][0];
    assert_eq!(step["step"], "tsg", "{log}");
    assert_eq!(step["status"], "error", "{step}");
    let e = step["error"].as_str().unwrap();
    assert!(e.contains("no C compiler (cc or gcc) on PATH"), "{e}");
    assert!(
        e.contains("cc -O2 -shared -fPIC -o libcoloc_tsg_hook.so benches/gpu/probes/tsg_hook.c"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn gpu_harness_tsg_verdict_says_plainly_what_the_driver_did() {
    // The tsg probe's verdict on made-up results, no GPU: no group learned, every
    // candidate refused (the RM's statuses named), accepted with online's p99 moved, and
    // accepted with it unmoved.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../benches/gpu/probes");
    let code = r#"
import json, sys
sys.path.insert(0, sys.argv[1])
import probe_steps as p
g = [{"object": "0x5c000001"}]
tries = lambda *st: {"groups": [{"tries": [{"us": us, "status": s} for us, s in zip((1, 100, 1000), st)]}]}
ph = lambda d, m: [{"phase": "default", "latency_ms": [0.1, 0.2, d, 9]}, {"phase": "minimum", "latency_ms": [0.1, 0.2, m, 9]}]
print(json.dumps([
    p.tsg_verdict({"seen": {"rm_allocs": 0}}),
    p.tsg_verdict({"groups": g, "min": tries(0x1f, 0x1b, 0x1b)}),
    p.tsg_verdict({"groups": g, "min": tries(0x1f, 0), "default_us": [2048], "phases": ph(4.0, 1.0)}),
    p.tsg_verdict({"groups": g, "min": tries(0x1f, 0), "default_us": [2048], "phases": ph(4.0, 3.9)}),
]))
"#;
    let (v, _) = python_json(code, &[dir.as_os_str()], None, CMD_LIMIT);
    let v: Vec<String> = serde_json::from_value(v).unwrap();
    assert!(
        v[0].starts_with(
            "the hook recorded no channel group (RM allocations seen on the control device: 0)"
        ),
        "{}",
        v[0]
    );
    assert!(
        v[1].contains(
            "refused SET_TIMESLICE on 1 group(s) for every candidate (RM status 0x1b, 0x1f)"
        ),
        "{}",
        v[1]
    );
    assert!(
        v[2].contains("accepted SET_TIMESLICE down to 100 us"),
        "{}",
        v[2]
    );
    assert!(
        v[2].contains(
            "online kernel latency moved: p99 beside the loop 1.000 ms at 100 us against 4.000 ms"
        ),
        "{}",
        v[2]
    );
    assert!(
        v[3].contains("online kernel latency did not move (within 20%)"),
        "{}",
        v[3]
    );
}

#[test]
fn gpu_harness_timeslice_policy_restores_the_policy_it_found_even_on_failure() {
    // The timeslice-policy step against a stand-in nvidia-smi (a script on PATH that logs
    // its arguments and lists the policy as 2), the measurements stubbed: every value is
    // set in turn, a failing value is recorded and the others still run, and the policy
    // read before (2) is set back at the end; also when the run is interrupted midway
    // (a BaseException, as the harness's SIGTERM raises).
    let dir = TempPath::dir("coloc-e2e-policy"); // removed however the test ends
    let smi = dir.join("nvidia-smi");
    std::fs::write(
        &smi,
        format!(
            "#!/bin/sh\necho \"$*\" >> {}\ncase \"$*\" in *-l*) echo 'GPU 0: Timeslice: 2';; esac\n",
            dir.join("calls").display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&smi, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let probes = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../benches/gpu/probes");
    let code = r#"
import json, os, sys, types
sys.path.insert(0, sys.argv[1])
import probe_steps as p
calls = os.path.join(sys.argv[2], "calls")
p.kernels = lambda h, tag, dl, **k: {"latency_ms": [1.0, 2.0, 3.0, 4.0]}
p.requests = lambda h, tag, dl, **k: {"p50_ms": 1.0, "p99_ms": 2.0}
p.hook_lib = lambda h: (_ for _ in ()).throw(RuntimeError("no hook here"))
p.environment = lambda h: {}
class Stop(BaseException):
    pass
def row(fail, stop):
    def f(h, row, v, hook, base, dl):
        if v == stop:
            raise Stop()
        if v == fail:
            raise RuntimeError("the loop died")
        row["requests"] = {"p99_ms": 3.0}
    return f
out = []
for fail, stop in ((2, None), (None, 1)):
    open(calls, "w").close()
    p.policy_row = row(fail, stop)
    h = types.SimpleNamespace(sim=False, results={}, a=types.SimpleNamespace(timeslice_values="0,1,2,3"), save=lambda: None)
    try:
        p.timeslice_policy(h, 0)
        r = "ok"
    except Stop:
        r = "interrupted"
    except RuntimeError as e:
        r = str(e)
    P = h.results["probes"]["timeslice_policy"]
    out.append({"result": r, "calls": open(calls).read().split("\n")[:-1], "restore_to": P["restore_to"],
                "errors": {x["value"]: x.get("error") for x in P["rows"]}})
print(json.dumps(out))
"#;
    let (v, _) = python_json(
        code,
        &[probes.as_os_str(), dir.as_os_str()],
        Some(&dir),
        CMD_LIMIT,
    );
    let calls = |i: usize| -> Vec<String> {
        v[i]["calls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_str().unwrap().to_string())
            .collect()
    };
    let (l, set) = ("compute-policy -i 0 -l", |n: u32| {
        format!("compute-policy -i 0 --set-timeslice={n}")
    });
    assert_eq!(v[0]["restore_to"], 2, "{v}");
    assert_eq!(
        calls(0),
        [
            "compute-policy -h".to_string(),
            l.into(),
            set(0),
            l.into(),
            set(1),
            l.into(),
            set(2),
            l.into(),
            set(3),
            l.into(),
            set(2),
            l.into()
        ],
        "{v}"
    );
    assert!(
        v[0]["result"]
            .as_str()
            .unwrap()
            .contains("values [2] failed"),
        "{v}"
    );
    assert_eq!(v[0]["errors"]["2"], "RuntimeError: the loop died", "{v}");
    assert!(
        v[0]["errors"]["3"].is_null(),
        "the value after a failure still ran: {v}"
    );
    // Interrupted at value 1: the policy found is still set back, nothing after runs.
    assert_eq!(v[1]["result"], "interrupted", "{v}");
    let c = calls(1);
    assert_eq!(
        c[c.len() - 4..],
        [set(1), l.into(), set(2), l.into()],
        "{v}"
    );
    assert!(!c.contains(&set(3)), "{v}");
}

#[test]
fn gpu_harness_mps_quits_its_daemon_when_a_row_fails() {
    // The mps step against a stand-in nvidia-cuda-mps-control (a script on PATH: -d starts
    // a "daemon", a sleep named like the real one, and a quit on stdin ends it), the
    // measurements stubbed so that online fails once it is an MPS client: the error is
    // the step's, the daemon was started and told to quit with the run's own pipe
    // directory, and none is left. A daemon that ignores the quit is reported as left
    // running, by PID.
    let dir = TempPath::dir("coloc-e2e-mps"); // removed however the test ends
    let ctl = dir.join("nvidia-cuda-mps-control");
    let d = dir.display();
    std::fs::write(
        &ctl,
        format!(
            "#!/bin/bash\necho \"args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY\" >> {d}/calls\n\
             if [ \"$1\" = -d ]; then (exec -a nvidia-cuda-mps-control sleep 60) & echo $! > {d}/daemon.pid; exit 0; fi\n\
             read c; echo \"stdin=$c\" >> {d}/calls\n\
             if [ \"$c\" = quit ] && [ ! -e {d}/stubborn ]; then kill $(cat {d}/daemon.pid); fi\n"
        ),
    )
    .unwrap();
    std::fs::set_permissions(&ctl, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let gpu = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../benches/gpu");
    let code = r#"
import json, os, signal, subprocess, sys, time, types
sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], "probes")]
import probe_steps as p
d = sys.argv[2]
def requests(h, tag, dl, env=None):
    if env and "CUDA_MPS_PIPE_DIRECTORY" in env:
        raise RuntimeError("online died")
    return {"p50_ms": 1.0, "p99_ms": 2.0, "window": None}
p.requests = requests
p.kernels = lambda *a, **k: {"latency_ms": [1.0, 2.0, 3.0, 4.0]}
p.environment = lambda h: {}
p.LOG = lambda m: print(m, file=sys.stderr)
out = []
for stubborn in (False, True):
    if stubborn:
        open(os.path.join(d, "stubborn"), "w").close()
    open(os.path.join(d, "calls"), "w").close()
    tmp = os.path.join(d, f"run{int(stubborn)}")
    os.makedirs(tmp)
    h = types.SimpleNamespace(sim=False, results={}, tmp=tmp, art=tmp, env=dict(os.environ), save=lambda: None,
                              a=types.SimpleNamespace(mps_priority=1, mps_thread_pct=50), offline_cmd=lambda *a: [],
                              spawn=lambda kind, name, cmd, env, log: subprocess.Popen(["sleep", "30"]),
                              wait_ready=lambda *a, **k: None, end=lambda pr, *a, **k: pr and (pr.kill(), pr.wait()))
    try:
        p.mps(h, 0)
        r = "ok"
    except RuntimeError as e:
        r = str(e)
    daemon = int(open(os.path.join(d, "daemon.pid")).read())
    alive = os.path.exists(f"/proc/{daemon}") and open(f"/proc/{daemon}/stat").read().split()[2] != "Z"
    if alive:
        os.kill(daemon, signal.SIGKILL)
    M = h.results["probes"]["mps"]
    out.append({"result": r, "calls": open(os.path.join(d, "calls")).read().split("\n")[:-1], "pipe": M["commands"]["env"]["CUDA_MPS_PIPE_DIRECTORY"],
                "quit": M["quit"], "daemon": daemon, "alive": alive})
print(json.dumps(out))
"#;
    let (v, _) = python_json(
        code,
        &[gpu.as_os_str(), dir.as_os_str()],
        Some(&dir),
        Duration::from_secs(60),
    );
    let ok = &v[0];
    assert_eq!(ok["result"], "online died", "{v}");
    let pipe = ok["pipe"].as_str().unwrap();
    assert_eq!(
        ok["calls"],
        serde_json::json!([
            format!("args=-d pipe={pipe}"),
            format!("args= pipe={pipe}"),
            "stdin=quit"
        ]),
        "{v}"
    );
    assert_eq!(ok["quit"]["left_running"], serde_json::json!([]), "{v}");
    assert_eq!(ok["alive"], false, "{v}");
    let stubborn = &v[1];
    assert_eq!(stubborn["result"], "online died", "{v}");
    assert_eq!(
        stubborn["quit"]["left_running"],
        serde_json::json!([stubborn["daemon"]]),
        "{v}"
    );
}

/// `python3 -c CODE ARGS...` (with `path_first` ahead of PATH, where stand-in tools lie):
/// the JSON it prints, and its output for messages. Fails the test if it fails.
fn python_json(
    code: &str,
    args: &[&std::ffi::OsStr],
    path_first: Option<&std::path::Path>,
    limit: Duration,
) -> (serde_json::Value, String) {
    let mut cmd = std::process::Command::new("python3");
    cmd.args(["-c", code]).args(args);
    if let Some(dir) = path_first {
        let path = format!(
            "{}:{}",
            dir.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        cmd.env("PATH", path);
    }
    let r = output_within(&mut cmd, limit);
    let log = format!(
        "{}\n{}",
        String::from_utf8_lossy(&r.stdout),
        String::from_utf8_lossy(&r.stderr)
    );
    assert!(r.status.success(), "{log}");
    (serde_json::from_slice(&r.stdout).expect(&log), log)
}
