//! `coloc-bench --cuda-checkpoint`: the CUDA driver's checkpoint calls on one process,
//! through the agent's own edge (`coloc_agent::edges::checkpoint`), each timed. The
//! real-GPU harness runs it against a PyTorch training loop (lock, checkpoint, restore,
//! unlock; what a stopped process does to each); on the simulated GPU the fake driver
//! answers.

use coloc_agent::edges::checkpoint::{CudaCheckpoint, Op};
use std::time::{Duration, Instant};

/// Usage, appended to `--help`.
pub const USAGE: &str = "
  --cuda-checkpoint OP[,OP...] --pid PID [--timeout-ms 10000] [--cuda-lib libcuda.so.1]
        the CUDA driver's checkpoint calls on PID, in order, each timed; OP: state, lock
        (with --timeout-ms), checkpoint, restore, unlock, restore-thread. Prints one JSON
        object: the driver's version, how long loading took, and per call its answer
        (CUresult code and name), its milliseconds and, for state, the state. Goes on
        after a refused call (the next ones say what they find); exits 0 when every call
        succeeded, 1 when one was refused, 2 when the API cannot be loaded or on bad
        arguments.
";

fn opt(args: &[String], k: &str) -> Option<String> {
    args.iter()
        .position(|a| a == k)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

fn fail(msg: String) -> ! {
    eprintln!("coloc-bench --cuda-checkpoint: {msg}");
    std::process::exit(2)
}

/// Runs the calls named after `--cuda-checkpoint`; exits the process.
pub fn run(args: &[String]) -> ! {
    let ops: Vec<Op> = opt(args, "--cuda-checkpoint")
        .unwrap_or_default()
        .split(',')
        .map(|s| {
            Op::parse(s.trim()).unwrap_or_else(|| {
                fail(format!(
                    "unknown operation {s:?}: one of state, lock, checkpoint, restore, unlock, restore-thread"
                ))
            })
        })
        .collect();
    let pid: u32 = opt(args, "--pid")
        .and_then(|p| p.parse().ok())
        .filter(|p| *p > 0)
        .unwrap_or_else(|| fail("--pid PID (a positive number) is needed".into()));
    let timeout_ms: u64 = match opt(args, "--timeout-ms") {
        None => 10_000,
        Some(t) => t
            .parse()
            .unwrap_or_else(|_| fail(format!("--timeout-ms {t:?}: milliseconds, a number"))),
    };
    let lib = opt(args, "--cuda-lib").unwrap_or_else(|| "libcuda.so.1".into());
    let t = Instant::now();
    let drv = match CudaCheckpoint::open(&lib) {
        Ok(d) => d,
        Err(e) => {
            println!(
                "{}",
                serde_json::json!({"pid": pid, "load_error": e.to_string(), "load_ms": t.elapsed().as_secs_f64() * 1e3})
            );
            std::process::exit(2)
        }
    };
    let load_ms = t.elapsed().as_secs_f64() * 1e3;
    let mut calls = Vec::new();
    let mut refused = false;
    for op in ops {
        let t = Instant::now();
        let (res, extra) = match op {
            Op::State => match drv.state(pid) {
                Ok(s) => (Ok(()), serde_json::json!({"state": s.as_str()})),
                Err(e) => (Err(e), serde_json::Value::Null),
            },
            Op::Lock => (
                drv.lock(pid, Duration::from_millis(timeout_ms)),
                serde_json::json!({"timeout_ms": timeout_ms}),
            ),
            Op::Checkpoint => (drv.checkpoint(pid), serde_json::Value::Null),
            Op::Restore => (drv.restore(pid), serde_json::Value::Null),
            Op::Unlock => (drv.unlock(pid), serde_json::Value::Null),
            Op::RestoreThread => match drv.restore_thread(pid) {
                Ok(tid) => (Ok(()), serde_json::json!({"tid": tid})),
                Err(e) => (Err(e), serde_json::Value::Null),
            },
        };
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let mut c = serde_json::json!({"op": op.as_str(), "ms": ms});
        match res {
            Ok(()) => c["ok"] = true.into(),
            Err(e) => {
                refused = true;
                c["ok"] = false.into();
                c["code"] = e.code.into();
                c["name"] = e.name.into();
            }
        }
        if let serde_json::Value::Object(m) = extra {
            for (k, v) in m {
                c[k] = v;
            }
        }
        calls.push(c);
    }
    println!(
        "{}",
        serde_json::json!({"pid": pid, "library": drv.library(), "driver_version": drv.driver_version(),
                           "load_ms": load_ms, "calls": calls})
    );
    std::process::exit(i32::from(refused))
}
