//! `coloc-sim online --cuda` / `offline --cuda`: the workloads reach the simulated GPU
//! through the fake CUDA driver (`libcuda.so.1` on `LD_LIBRARY_PATH`, found with
//! `dlopen` and `cuGetProcAddress_v2` as the CUDA runtime finds it).
//!
//! libfake_cuda.so is built before these tests because `fake-cuda` is a dev-dependency of
//! this package; `scripts/test-all`'s `cargo build --workspace --all-targets` builds it too.

use coloc_sim::SimGpu;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_coloc-sim");

fn fake_dir() -> PathBuf {
    coloc_sim::fake_libcuda_dir(Path::new(BIN).parent().unwrap()).unwrap()
}

/// A child killed (after SIGCONT) on drop.
struct Kid(Child);

impl Drop for Kid {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(Some(_))) {
            return;
        }
        signal(self.0.id(), libc::SIGCONT);
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(pid as i32, sig) };
}

/// A running `coloc-sim gpu` (1 ms sample period) on its own state file.
struct Gpu {
    state: PathBuf,
    sim: SimGpu,
    _daemon: Kid,
}

impl Gpu {
    fn start(gpus: u32) -> Gpu {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let state = PathBuf::from("/dev/shm").join(format!(
            "coloc-sim-cuda-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::SeqCst)
        ));
        let daemon = Command::new(BIN)
            .arg("--state")
            .arg(&state)
            .args([
                "gpu",
                "--gpus",
                &gpus.to_string(),
                "--sample-period-ms",
                "1",
            ])
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let daemon = Kid(daemon);
        let t0 = Instant::now();
        let sim = loop {
            if let Ok(s) = SimGpu::open(&state) {
                break s;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "simulated GPU did not start"
            );
            std::thread::sleep(Duration::from_millis(5));
        };
        Gpu {
            state,
            sim,
            _daemon: daemon,
        }
    }

    /// A `coloc-sim` workload on the fake CUDA driver.
    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(BIN);
        c.arg("--state")
            .arg(&self.state)
            .args(args)
            .env("LD_LIBRARY_PATH", fake_dir())
            .env_remove("CUDA_VISIBLE_DEVICES")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    }

    /// Waits until `pid` has a slot on `gpu` with at least `ns` completed.
    fn wait_progress(&self, pid: u32, gpu: u32, ns: u64) {
        let t0 = Instant::now();
        while self
            .sim
            .slot_info(pid, gpu)
            .is_none_or(|s| s.completed_ns < ns)
        {
            assert!(
                t0.elapsed() < Duration::from_secs(3),
                "pid {pid} made no progress on GPU {gpu}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.state);
    }
}

fn json(o: &Output) -> serde_json::Value {
    assert!(
        o.status.success(),
        "workload failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).unwrap()
}

fn wait_output(k: Kid, limit: Duration) -> Output {
    let pid = k.0.id();
    let t0 = Instant::now();
    let mut k = k;
    while k.0.try_wait().unwrap().is_none() {
        assert!(
            t0.elapsed() < limit,
            "pid {pid} still running after {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let child = std::mem::replace(&mut k.0, Command::new("true").spawn().unwrap());
    std::mem::forget(k);
    child.wait_with_output().unwrap()
}

#[test]
fn online_cuda_alone_latency_is_the_work() {
    let gpu = Gpu::start(1);
    let o = gpu
        .cmd(&[
            "online",
            "--cuda",
            "--rate",
            "20",
            "--work-ms",
            "5",
            "--duration-s",
            "1",
        ])
        .output()
        .unwrap();
    let v = json(&o);
    let (n, p50) = (
        v["requests"].as_u64().unwrap(),
        v["p50_ms"].as_f64().unwrap(),
    );
    assert!(n >= 8, "{v}");
    assert!(
        (5.0..10.0).contains(&p50),
        "alone, a 5 ms request takes ~5 ms: {v}"
    );
    // Per-thread default stream entry points, one kernel per request.
    let o = gpu
        .cmd(&[
            "online",
            "--cuda",
            "--per-thread-stream",
            "--kernels",
            "1",
            "--rate",
            "20",
            "--work-ms",
            "5",
            "--duration-s",
            "0.5",
        ])
        .output()
        .unwrap();
    let v = json(&o);
    assert!(v["requests"].as_u64().unwrap() >= 3, "{v}");
    assert!(v["p50_ms"].as_f64().unwrap() < 10.0, "{v}");
    assert!(
        gpu.sim.slot_infos().is_empty(),
        "workloads released their slots"
    );
}

#[test]
fn two_offline_cuda_processes_share_the_gpu() {
    let gpu = Gpu::start(1);
    let args = [
        "offline",
        "--cuda",
        "--step-ms",
        "2",
        "--depth",
        "2",
        "--duration-s",
        "1",
    ];
    let a = Kid(gpu.cmd(&args).spawn().unwrap());
    let b = Kid(gpu.cmd(&args).spawn().unwrap());
    gpu.wait_progress(a.0.id(), 0, 10_000_000);
    gpu.wait_progress(b.0.id(), 0, 10_000_000);
    let (va, vb) = (
        json(&wait_output(a, Duration::from_secs(5))),
        json(&wait_output(b, Duration::from_secs(5))),
    );
    let (ra, rb) = (
        va["steps_per_s"].as_f64().unwrap(),
        vb["steps_per_s"].as_f64().unwrap(),
    );
    // Alone: 500 steps/s of 2 ms. Together: about half each, the GPU full.
    assert!(
        (150.0..350.0).contains(&ra) && (150.0..350.0).contains(&rb),
        "{va} {vb}"
    );
    assert!((400.0..520.0).contains(&(ra + rb)), "{va} {vb}");
}

#[test]
fn cuda_visible_devices_sends_ordinal_0_to_gpu_1() {
    let gpu = Gpu::start(2);
    let k = Kid(gpu
        .cmd(&[
            "online",
            "--cuda",
            "--gpu",
            "0",
            "--rate",
            "50",
            "--work-ms",
            "2",
            "--duration-s",
            "1",
        ])
        .env("CUDA_VISIBLE_DEVICES", "1")
        .spawn()
        .unwrap());
    let pid = k.0.id();
    gpu.wait_progress(pid, 1, 2_000_000);
    assert!(gpu.sim.slot_info(pid, 0).is_none(), "nothing on GPU 0");
    let v = json(&wait_output(k, Duration::from_secs(5)));
    assert!(v["requests"].as_u64().unwrap() >= 10, "{v}");
}

#[test]
fn sigstop_drains_exactly_the_kernels_in_flight() {
    const STEP: u64 = 5_000_000;
    let gpu = Gpu::start(1);
    let k = Kid(gpu
        .cmd(&["offline", "--cuda", "--depth", "4", "--step-ms", "5"])
        .spawn()
        .unwrap());
    let pid = k.0.id();
    gpu.wait_progress(pid, 0, 10 * STEP);
    let info = gpu.sim.slot_info(pid, 0).unwrap();
    assert_eq!(
        info.mem_bytes,
        4 << 30,
        "cuMemAlloc'd memory, as NVML lists it"
    );
    let before = info.completed_ns;
    signal(pid, libc::SIGSTOP);
    let t0 = Instant::now();
    while coloc_state(pid) != Some('T') {
        assert!(t0.elapsed() < Duration::from_secs(2), "not stopped");
        std::thread::sleep(Duration::from_micros(200));
    }
    let submitted = gpu.sim.slot_info(pid, 0).unwrap().submitted_ns;
    let drain = submitted - before;
    // Depth 4 × 5 ms: 3 to 4 kernels in flight (one may have just completed; 10 ms allows
    // for a test machine that delayed the workload's top-up).
    assert!(
        (2 * STEP..=4 * STEP + STEP / 10).contains(&drain),
        "drain {} ms, expected 15-20 ms",
        drain as f64 / 1e6
    );
    // The queued kernels run to the end while the process is stopped, then nothing.
    let t_drain = Instant::now();
    loop {
        let s = gpu.sim.slot_info(pid, 0).unwrap();
        assert_eq!(s.submitted_ns, submitted, "a stopped process launched");
        if s.completed_ns == submitted {
            break;
        }
        assert!(
            t_drain.elapsed() < Duration::from_secs(2),
            "drain did not finish"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
    let drained_in = t0.elapsed();
    assert!(
        drained_in < Duration::from_millis(4 * 5 + 30),
        "drain took {drained_in:?}"
    );
    std::thread::sleep(Duration::from_millis(100));
    let s = gpu.sim.slot_info(pid, 0).unwrap();
    assert_eq!((s.submitted_ns, s.completed_ns), (submitted, submitted));
    // Continued, it goes on; SIGTERM ends it cleanly and frees the slot.
    signal(pid, libc::SIGCONT);
    gpu.wait_progress(pid, 0, submitted + 2 * STEP);
    signal(pid, libc::SIGTERM);
    let v = json(&wait_output(k, Duration::from_secs(3)));
    assert!(v["steps"].as_u64().unwrap() >= 12, "{v}");
    assert!(gpu.sim.slot_info(pid, 0).is_none(), "slot released at exit");
}

fn coloc_state(pid: u32) -> Option<char> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    s[s.rfind(')')? + 2..].chars().next()
}
