//! `coloc-bench --gate`: what the launch gate's in-flight bound K costs and buys, on the
//! simulated GPU. No agent: the benchmark plays it with the agent's `GateFile`.
//!
//! For each kernel length and each K (`COLOC_SHIM_INFLIGHT`), one `coloc-sim offline
//! --cuda` under `libcoloc_cuda.so` (class offline), the application keeping 16 kernels
//! queued (as an asynchronous training loop does):
//!
//! - **throughput**: kernel time completed per second of wall time with the gate open
//!   (1.0 = the GPU never idles), over one second;
//! - **drain**: over `--gate-closes` closes, the time from the close to the process's
//!   acknowledgement (`gate_ack` = the epoch, read from its page), and the kernel time the
//!   GPU still ran for it after the close (what online work would queue behind).
//!
//! A row without the shim gives the same figures for the application alone (its drain is
//! what SIGSTOP or the freezer leave running: everything queued).

use coloc_agent::edges::gate::GateFile;
use coloc_doorbell::PAGE;
use coloc_tools::*;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Usage, appended to `--help`.
pub const USAGE: &str = "
  --gate [--gate-step-ms 2,0.2] [--gate-k 1,2,4,8,0] [--gate-closes 10] [--gate-seconds 1]
        the launch gate on the simulated GPU: throughput with the gate open (over
        --gate-seconds) and drain after a close, per kernel length and in-flight bound K
        (0: unbounded; the budget, COLOC_SHIM_INFLIGHT_MS, from the environment, the
        shim's default when unset); a row without the shim for comparison";

fn list<T: std::str::FromStr>(args: &[String], flag: &str, default: &str) -> Vec<T> {
    let v = args
        .iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| default.to_string());
    v.split(',').filter_map(|x| x.trim().parse().ok()).collect()
}

/// Runs the measurement and prints a Markdown table; returns the rows as JSON.
pub fn run(args: &[String]) -> serde_json::Value {
    let steps: Vec<f64> = list(args, "--gate-step-ms", "2,0.2");
    let ks: Vec<u32> = list(args, "--gate-k", "1,2,4,8,0");
    let closes: usize = list(args, "--gate-closes", "10")
        .first()
        .copied()
        .unwrap_or(10);
    let secs: f64 = list(args, "--gate-seconds", "1")
        .first()
        .copied()
        .unwrap_or(1.0);
    println!("| kernel | K | throughput (gate open) | drain: close → ack p50 / p99 / max (ms) | kernel time run after the close p50 / p99 / max (ms) |");
    println!("|---|---|---|---|---|");
    let mut rows = Vec::new();
    for &step in &steps {
        let mut cases: Vec<Option<u32>> = vec![None];
        cases.extend(ks.iter().map(|&k| Some(k)));
        for k in cases {
            let r = one(step, k, closes, secs);
            let f = |p: &str| r.pointer(p).and_then(|v| v.as_f64()).unwrap_or(f64::NAN);
            let kname = match k {
                None => "no shim".to_string(),
                Some(0) => "0 (unbounded)".to_string(),
                Some(k) => k.to_string(),
            };
            println!(
                "| {step} ms | {kname} | {:.3} | {:.2} / {:.2} / {:.2} | {:.2} / {:.2} / {:.2} |",
                f("/throughput"),
                f("/ack_ms/p50"),
                f("/ack_ms/p99"),
                f("/ack_ms/max"),
                f("/after_ms/p50"),
                f("/after_ms/p99"),
                f("/after_ms/max"),
            );
            rows.push(r);
        }
    }
    serde_json::Value::Array(rows)
}

fn page_of(dir: &Path, pid: u32) -> Option<PathBuf> {
    std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                n.starts_with(&format!("{pid}-")) && n.ends_with(coloc_doorbell::SUFFIX)
            }) && std::fs::metadata(p).is_ok_and(|m| m.len() >= PAGE as u64)
        })
}

fn one(step_ms: f64, k: Option<u32>, closes: usize, secs: f64) -> serde_json::Value {
    let sim = Sim::start(1, &[]);
    let root = std::env::temp_dir().join(unique("coloc-bench-gate"));
    let bells = root.join("bells");
    std::fs::create_dir_all(&bells).unwrap();
    let gate = Arc::new(GateFile::create(&root.join("gate").join("gates")).unwrap());
    let beating = Arc::new(AtomicBool::new(true));
    let beater = {
        let (g, b) = (gate.clone(), beating.clone());
        std::thread::spawn(move || {
            while b.load(Ordering::SeqCst) {
                g.beat();
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    let cuda = coloc_sim::fake_libcuda_dir(bin("coloc-sim").parent().unwrap()).unwrap();
    let step = step_ms.to_string();
    let mut c = sim.cmd(&[
        "offline",
        "--gpu",
        "0",
        "--step-ms",
        &step,
        "--queue-depth",
        "16",
        "--cuda",
    ]);
    c.env("LD_LIBRARY_PATH", &cuda).stdout(Stdio::null());
    if let Some(k) = k {
        c.env("LD_PRELOAD", bin("libcoloc_cuda.so"))
            .env("COLOC_SHIM_CLASS", "offline")
            .env("COLOC_DOORBELL_DIR", &bells)
            .env("COLOC_GATE_FILE", gate.path())
            .env("COLOC_SHIM_INFLIGHT", k.to_string());
    }
    let job = Proc(c.spawn().unwrap());
    let pid = job.pid();
    let progress = || {
        sim.open()
            .slot_info(pid, 0)
            .map_or((0, 0), |s| (s.submitted_ns, s.completed_ns))
    };
    wait_for("the workload running", Duration::from_secs(10), || {
        progress().1 > 0
    })
    .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    // Throughput with the gate open.
    let (t0, (_, c0)) = (Instant::now(), progress());
    std::thread::sleep(Duration::from_secs_f64(secs));
    let (_, c1) = progress();
    let throughput = (c1 - c0) as f64 / t0.elapsed().as_nanos() as f64;
    let uuid = coloc_sim::gpu_uuid(0);
    let (mut ack_ms, mut after_ms) = (Vec::new(), Vec::new());
    if k.is_some() {
        let path = page_of(&bells, pid).expect("the workload's page");
        let page = MappedPage::open(&path);
        let ack = || page.ack();
        for _ in 0..closes {
            let (_, at_close) = progress();
            let t = Instant::now();
            let epoch = gate.close(&uuid).unwrap();
            while ack() != epoch {
                assert!(t.elapsed() < Duration::from_secs(5), "no acknowledgement");
                std::thread::sleep(Duration::from_micros(50));
            }
            ack_ms.push(t.elapsed().as_secs_f64() * 1e3);
            let (sub, done) = progress();
            assert!(done >= sub, "acknowledged with work in flight");
            after_ms.push((done - at_close) as f64 / 1e6);
            gate.open(&uuid);
            std::thread::sleep(Duration::from_millis(60));
        }
    } else {
        // Without the shim: what runs on after the process stops submitting is whatever
        // it had queued, measured at a SIGSTOP.
        for _ in 0..closes {
            let (_, at_stop) = progress();
            let t = Instant::now();
            // SAFETY: kill(2) on our own child.
            unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
            wait_for("the queue drained", Duration::from_secs(5), || {
                let (s, c) = progress();
                c >= s
            })
            .unwrap();
            ack_ms.push(t.elapsed().as_secs_f64() * 1e3);
            after_ms.push((progress().1 - at_stop) as f64 / 1e6);
            // SAFETY: as above.
            unsafe { libc::kill(pid as i32, libc::SIGCONT) };
            std::thread::sleep(Duration::from_millis(60));
        }
    }
    drop(job);
    beating.store(false, Ordering::SeqCst);
    beater.join().unwrap();
    drop(gate);
    let _ = std::fs::remove_dir_all(&root);
    serde_json::json!({
        "step_ms": step_ms,
        "k": k,
        "throughput": throughput,
        "ack_ms": {"p50": percentile(&ack_ms, 50.0), "p99": percentile(&ack_ms, 99.0), "max": percentile(&ack_ms, 100.0)},
        "after_ms": {"p50": percentile(&after_ms, 50.0), "p99": percentile(&after_ms, 99.0), "max": percentile(&after_ms, 100.0)},
    })
}
