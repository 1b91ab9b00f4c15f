//! The simulated driver's checkpoint API, through the agent's own driver edge
//! (`coloc-bench --cuda-checkpoint`, which calls `coloc_agent::edges::checkpoint`) against
//! real workload processes on the simulated GPU: what the H100 with driver 580 was
//! measured to do (benches/RESULTS.md, "Real GPU: the driver's checkpoint API") — calls
//! on a stopped process wait for it, a lock drains and holds, a checkpoint frees the GPU's
//! memory and leaves the driver's process list — plus the answers the agent must handle
//! (wrong state, no CUDA, no process, injected refusals, a lock that times out, a restore
//! with no room).

use coloc_e2e::*;
use coloc_sim::checkpoint::{CkFault, CkOp};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The simulated GPU with cheap checkpoints (10 ms per GB each way) and 16 GiB.
fn sim() -> Sim {
    Sim::start(
        1,
        &[
            "--memory-gib",
            "16",
            "--checkpoint-ms-per-gb",
            "10",
            "--restore-ms-per-gb",
            "10",
        ],
    )
}

/// An offline job submitting through the simulated libcuda (2 ms kernels unless `extra`
/// names a --step-ms).
fn offline(sim: &Sim, extra: &[&str]) -> Proc {
    let mut args = vec!["offline", "--cuda", "--depth", "4"];
    if !extra.contains(&"--step-ms") {
        args.extend(["--step-ms", "2"]);
    }
    args.extend_from_slice(extra);
    let p = Proc(
        sim.cmd(&args)
            .env("LD_LIBRARY_PATH", fake_cuda())
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

/// `coloc-bench --cuda-checkpoint OPS --pid PID` on the simulated driver: its JSON.
fn ck(sim: &Sim, ops: &str, pid: u32, timeout_ms: u32) -> serde_json::Value {
    let out = output_within(
        Command::new(bin("coloc-bench"))
            .args([
                "--cuda-checkpoint",
                ops,
                "--pid",
                &pid.to_string(),
                "--timeout-ms",
                &timeout_ms.to_string(),
            ])
            .args([
                "--cuda-lib",
                &fake_cuda().join("libcuda.so.1").display().to_string(),
            ])
            .env("COLOC_SIM_STATE", &sim.state),
        Duration::from_secs(30),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.lines().last().unwrap_or("")).unwrap_or_else(|e| {
        panic!(
            "coloc-bench --cuda-checkpoint {ops}: {e}: {text} {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// The answers, one per call: "ok" (with " state" for a state query) or the error name.
fn answers(v: &serde_json::Value) -> Vec<String> {
    v["calls"]
        .as_array()
        .unwrap_or_else(|| panic!("no calls in {v}"))
        .iter()
        .map(|c| match (c["ok"].as_bool(), c["state"].as_str()) {
            (Some(true), Some(s)) => format!("ok {s}"),
            (Some(true), None) => "ok".into(),
            _ => c["name"].as_str().unwrap_or("?").to_string(),
        })
        .collect()
}

fn completed(sim: &Sim, pid: u32) -> u64 {
    sim.open().slot_info(pid, 0).map_or(0, |i| i.completed_ns)
}

#[test]
fn lock_holds_checkpoint_frees_memory_restore_and_unlock_bring_it_back() {
    let sim = sim();
    let job = offline(&sim, &["--mem-mib", "4096"]);
    let pid = job.pid();
    let s = sim.open();
    assert_eq!(s.mem_used(0), 4 << 30);
    assert_eq!(
        answers(&ck(&sim, "state,lock,state", pid, 5000)),
        ["ok running", "ok", "ok locked"]
    );
    // Locked: the work it had queued has run, and nothing more runs.
    let held = completed(&sim, pid);
    std::thread::sleep(Duration::from_millis(150));
    assert_eq!(completed(&sim, pid), held, "a locked process made progress");
    let info = s.slot_info(pid, 0).unwrap();
    assert_eq!(
        info.submitted_ns, info.completed_ns,
        "the lock returned before the queue drained"
    );
    // Checkpointed: out of the driver's list, its memory free.
    let t = Instant::now();
    assert_eq!(
        answers(&ck(&sim, "checkpoint,state", pid, 0)),
        ["ok", "ok checkpointed"]
    );
    assert!(
        t.elapsed() >= Duration::from_millis(40),
        "4 GiB at 10 ms/GB takes about 43 ms"
    );
    assert!(
        s.processes(0).iter().all(|p| p.pid != pid),
        "a checkpointed process is listed"
    );
    assert_eq!(s.mem_used(0), 0);
    // Restored: listed again with its memory, still locked; unlocked: it runs.
    assert_eq!(
        answers(&ck(&sim, "restore,state", pid, 0)),
        ["ok", "ok locked"]
    );
    assert_eq!(s.mem_used(0), 4 << 30);
    assert_eq!(completed(&sim, pid), held);
    assert_eq!(
        answers(&ck(&sim, "unlock,state", pid, 0)),
        ["ok", "ok running"]
    );
    wait_for("progress after the unlock", Duration::from_secs(5), || {
        completed(&sim, pid) > held
    })
    .unwrap();
}

#[test]
fn every_call_that_changes_a_stopped_process_waits_until_it_runs() {
    let sim = sim();
    let job = offline(&sim, &[]);
    let pid = job.pid();
    for (ops, after) in [
        ("lock", "ok locked"),
        ("checkpoint", "ok checkpointed"),
        ("restore", "ok locked"),
        ("unlock", "ok running"),
    ] {
        // SAFETY: plain kill(2) on our own child.
        unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
        let (tx, rx) = std::sync::mpsc::channel();
        let state = sim.state.clone();
        let caller = std::thread::spawn(move || {
            let out = Command::new(bin("coloc-bench"))
                .args([
                    "--cuda-checkpoint",
                    ops,
                    "--pid",
                    &pid.to_string(),
                    "--timeout-ms",
                    "100",
                ])
                .args([
                    "--cuda-lib",
                    &fake_cuda().join("libcuda.so.1").display().to_string(),
                ])
                .env("COLOC_SIM_STATE", &state)
                .output()
                .unwrap();
            tx.send(String::from_utf8_lossy(&out.stdout).to_string())
                .unwrap();
        });
        // The lock's 100 ms timeout does not bound it either.
        assert!(
            rx.recv_timeout(Duration::from_millis(400)).is_err(),
            "{ops} of a stopped process returned"
        );
        // State queries still answer.
        assert!(ck(&sim, "state", pid, 0)["calls"][0]["ok"]
            .as_bool()
            .unwrap());
        // SAFETY: as above.
        unsafe { libc::kill(pid as i32, libc::SIGCONT) };
        let out = rx
            .recv_timeout(Duration::from_secs(5))
            .expect("the call returned after SIGCONT");
        caller.join().unwrap();
        assert!(out.contains(r#""ok":true"#), "{ops}: {out}");
        assert_eq!(answers(&ck(&sim, "state", pid, 0)), [after]);
    }
}

#[test]
fn wrong_states_no_cuda_and_no_process_are_named() {
    let sim = sim();
    let job = offline(&sim, &[]);
    let pid = job.pid();
    assert_eq!(
        answers(&ck(
            &sim,
            "unlock,checkpoint,restore,lock,lock,restore,unlock",
            pid,
            0
        )),
        [
            "CUDA_ERROR_ILLEGAL_STATE",
            "CUDA_ERROR_ILLEGAL_STATE",
            "CUDA_ERROR_ILLEGAL_STATE",
            "ok",
            "CUDA_ERROR_ILLEGAL_STATE",
            "CUDA_ERROR_ILLEGAL_STATE",
            "ok"
        ]
    );
    // A process without CUDA (this test), and none at all.
    assert_eq!(
        answers(&ck(&sim, "state,lock", std::process::id(), 0)),
        ["CUDA_ERROR_NOT_INITIALIZED"; 2]
    );
    assert_eq!(
        answers(&ck(&sim, "state", 4_194_000, 0)),
        ["CUDA_ERROR_OPERATING_SYSTEM"]
    );
    let tid = ck(&sim, "restore-thread", pid, 0)["calls"][0]["tid"]
        .as_i64()
        .unwrap();
    assert!(
        std::path::Path::new(&format!("/proc/{pid}/task/{tid}")).exists(),
        "the restore thread {tid} is not a thread of {pid}"
    );
}

#[test]
fn a_lock_that_cannot_drain_in_time_leaves_the_process_running() {
    let sim = sim();
    // 300 ms kernels, four queued: a second of work to drain.
    let job = offline(&sim, &["--step-ms", "300"]);
    let pid = job.pid();
    let t = Instant::now();
    assert_eq!(
        answers(&ck(&sim, "lock,state", pid, 50)),
        ["CUDA_ERROR_TIMEOUT", "ok running"]
    );
    assert!(
        t.elapsed() < Duration::from_millis(900),
        "the timeout was not applied: {:?}",
        t.elapsed()
    );
    let before = completed(&sim, pid);
    wait_for(
        "progress after a lock that timed out",
        Duration::from_secs(5),
        || completed(&sim, pid) > before,
    )
    .unwrap();
    // With time enough it locks.
    assert_eq!(answers(&ck(&sim, "lock,unlock", pid, 5000)), ["ok", "ok"]);
}

#[test]
fn injected_refusals_and_the_failed_state() {
    let sim = sim();
    let job = offline(&sim, &[]);
    let pid = job.pid();
    let s = sim.open();
    s.ckpt_inject(CkFault {
        ops: 1 << CkOp::Lock as u32,
        code: 801,
        fail_state: false,
        pid,
    });
    assert_eq!(
        answers(&ck(&sim, "lock,state", pid, 0)),
        ["CUDA_ERROR_NOT_SUPPORTED", "ok running"]
    );
    // Another PID is not hit.
    s.ckpt_inject(CkFault {
        ops: 1 << CkOp::Lock as u32,
        code: 801,
        fail_state: false,
        pid: pid + 1,
    });
    assert_eq!(answers(&ck(&sim, "lock", pid, 0)), ["ok"]);
    s.ckpt_inject(CkFault {
        ops: 1 << CkOp::Checkpoint as u32,
        code: 999,
        fail_state: true,
        pid: 0,
    });
    assert_eq!(
        answers(&ck(&sim, "checkpoint,state", pid, 0)),
        ["CUDA_ERROR_UNKNOWN", "ok failed"]
    );
    s.ckpt_clear_fault();
    assert_eq!(
        answers(&ck(&sim, "unlock", pid, 0)),
        ["CUDA_ERROR_ILLEGAL_STATE"]
    );
}

#[test]
fn a_restore_without_room_is_refused_and_stays_checkpointed() {
    let sim = sim();
    let job = offline(&sim, &["--mem-mib", "8192"]);
    let pid = job.pid();
    assert_eq!(answers(&ck(&sim, "lock,checkpoint", pid, 0)), ["ok", "ok"]);
    // Online takes 12 of the 16 GiB while offline is on the host.
    let _online = Proc(
        sim.cmd(&["online", "--cuda", "--rate", "1", "--mem-mib", "12288"])
            .env("LD_LIBRARY_PATH", fake_cuda())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let s = sim.open();
    wait_for("online's memory", Duration::from_secs(10), || {
        s.mem_used(0) == 12 << 30
    })
    .unwrap();
    assert_eq!(
        answers(&ck(&sim, "restore,state", pid, 0)),
        ["CUDA_ERROR_OUT_OF_MEMORY", "ok checkpointed"]
    );
    assert_eq!(s.mem_used(0), 12 << 30);
}

#[test]
fn allocations_beyond_the_gpu_fail() {
    let sim = sim();
    let _a = offline(&sim, &["--mem-mib", "10240"]);
    // 10 + 8 > 16 GiB: the second job cannot start.
    let mut b = Proc(
        sim.cmd(&["offline", "--cuda", "--mem-mib", "8192"])
            .env("LD_LIBRARY_PATH", fake_cuda())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let st = b.wait_within("a job whose memory does not fit", Duration::from_secs(10));
    assert!(!st.success());
    let mut err = String::new();
    std::io::Read::read_to_string(b.0.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(err.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{err}");
    let s = sim.open();
    assert_eq!((s.mem_total(), s.mem_used(0)), (16 << 30, 10 << 30));
}
