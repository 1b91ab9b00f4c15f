//! The CUDA shim's cost per launch, through the real dynamic linker: `cuLaunchKernel` of
//! the fake driver, found as the CUDA runtime finds it (`dlopen("libcuda.so.1")`,
//! `dlsym(h, "cuGetProcAddress_v2")`, then the getter), in three processes:
//!
//! - `launch/no-shim`: no `LD_PRELOAD` (the fake driver's own cost);
//! - `launch/no-shim-stream`: the same on a created stream (the baseline of
//!   `shim-gated-open-stream`);
//! - `launch/shim-pass-through`: `libcoloc_cuda.so` preloaded, no class (offline or a host
//!   with no agent): the cost of the wrapper alone;
//! - `launch/shim-doorbell`: class online with a doorbell directory: every launch stamps
//!   its time (launches closer than the wake gap: the busy fast path, no system call).
//! - `launch/shim-offline-no-gate`: class offline, no gate file (no agent): pass-through.
//! - `launch/shim-gated-open`: class offline with a gate file whose gate is open and whose
//!   heartbeat the parent keeps fresh: every launch goes through the gate check, the
//!   in-flight bound (`COLOC_SHIM_INFLIGHT` at its default) and an event record.
//! - `launch/shim-gated-open-stream`: the same on a created stream, which also asks the
//!   driver whether the stream is being captured into a CUDA graph (`cuStreamIsCapturing`;
//!   the default stream above cannot be, and is not asked).
//!
//! The shim's cost is the difference to `no-shim`. `COLOC_BENCH_MIN=<batches>` also
//! prints the least time per launch over that many batches (see [`least_per_launch`]).
//! The parent re-runs this binary once
//! per mode with the environment set (the preload must be there from the start).
//! `cargo bench -p coloc-e2e --bench shim_launch`.
//!
//! After the launches, in each mode, the synchronising calls with nothing left to wait
//! for: `sync-ctx/<mode>` (`cuCtxSynchronize`) and `sync-stream/<mode>`
//! (`cuStreamSynchronize` of a created stream). Online (`shim-doorbell`) each is the
//! completion stamp's whole path: the records read before and after the driver's call, a
//! clock read, two fences, and the stamp.

use criterion::{criterion_group, Criterion};
use std::path::PathBuf;

/// With `COLOC_BENCH_MIN=<batches>`: the least time per launch over that many batches of
/// 5,000 launches, printed before criterion's runs. On a shared host the least batch is
/// the one least disturbed, so it resolves a few ns where criterion's mean moves by tens.
fn least_per_launch(mode: &str, d: &coloc_e2e::cuda::Driver) {
    let Some(batches) = std::env::var("COLOC_BENCH_MIN")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
    else {
        return;
    };
    const N: u32 = 5_000;
    let stream = mode.ends_with("-stream");
    let mut least = f64::MAX;
    for _ in 0..batches {
        let t = std::time::Instant::now();
        for _ in 0..N {
            if stream {
                d.launch_on_stream(0);
            } else {
                d.launch(0);
            }
        }
        least = least.min(t.elapsed().as_nanos() as f64 / f64::from(N));
        d.synchronize();
    }
    println!("launch-least/{mode}: {least:.1} ns (least of {batches} batches of {N})");
}

fn bench(c: &mut Criterion) {
    let mode = std::env::var("COLOC_BENCH_MODE").unwrap_or_default();
    let d = coloc_e2e::cuda::Driver::open(0);
    least_per_launch(&mode, &d);
    // Zero-length kernels: the cost measured is the call path, not simulated GPU time.
    if mode.ends_with("-stream") {
        c.bench_function(&format!("launch/{mode}"), |b| {
            b.iter(|| d.launch_on_stream(0))
        });
    } else {
        c.bench_function(&format!("launch/{mode}"), |b| b.iter(|| d.launch(0)));
    }
    c.bench_function(&format!("sync-ctx/{mode}"), |b| b.iter(|| d.synchronize()));
    c.bench_function(&format!("sync-stream/{mode}"), |b| {
        b.iter(|| d.synchronize_stream())
    });
}

criterion_group!(benches, bench);

fn main() {
    if std::env::var_os("COLOC_BENCH_MODE").is_some() {
        benches();
        Criterion::default().configure_from_args().final_summary();
        return;
    }
    // Built beside this benchmark's profile (`cargo build --release --workspace`).
    let shim = coloc_e2e::bin("libcoloc_cuda.so");
    let dir = shim.parent().expect("target dir").to_path_buf();
    let state = PathBuf::from("/dev/shm").join(format!("coloc-bench-shim-{}", std::process::id()));
    let _sim = coloc_sim::SimGpu::create(&state, 1, 100_000_000).expect("simulated GPU state");
    let cuda = coloc_sim::fake_libcuda_dir(&dir).expect("fake libcuda (cargo build -p fake-cuda)");
    let bells = std::env::temp_dir().join(format!("coloc-bench-bells-{}", std::process::id()));
    std::fs::create_dir_all(&bells).unwrap();
    let gate_path = bells.join("gate").join("gates");
    let gate = std::sync::Arc::new(
        coloc_agent::edges::gate::GateFile::create(&gate_path).expect("gate file"),
    );
    let beating = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let beater = {
        let (g, b) = (gate.clone(), beating.clone());
        std::thread::spawn(move || {
            while b.load(std::sync::atomic::Ordering::SeqCst) {
                g.beat();
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        })
    };
    for mode in [
        "no-shim",
        "no-shim-stream",
        "shim-pass-through",
        "shim-doorbell",
        "shim-offline-no-gate",
        "shim-gated-open",
        "shim-gated-open-stream",
    ] {
        let mut c = std::process::Command::new(std::env::current_exe().unwrap());
        c.args(std::env::args_os().skip(1))
            .env("COLOC_BENCH_MODE", mode)
            .env("COLOC_SIM_STATE", &state)
            .env("LD_LIBRARY_PATH", &cuda);
        if !mode.starts_with("no-shim") {
            c.env("LD_PRELOAD", &shim);
        }
        if mode == "shim-doorbell" {
            c.env("COLOC_SHIM_CLASS", "online")
                .env("COLOC_DOORBELL_DIR", &bells);
        }
        if mode == "shim-offline-no-gate" {
            c.env("COLOC_SHIM_CLASS", "offline")
                .env("COLOC_DOORBELL_DIR", &bells)
                .env("COLOC_GATE_FILE", bells.join("no-such-gate-file"));
        }
        if mode.starts_with("shim-gated-open") {
            c.env("COLOC_SHIM_CLASS", "offline")
                .env("COLOC_DOORBELL_DIR", &bells)
                .env("COLOC_GATE_FILE", &gate_path);
        }
        let st = c.status().expect("run the bench");
        assert!(st.success(), "{mode}: {st}");
    }
    beating.store(false, std::sync::atomic::Ordering::SeqCst);
    beater.join().unwrap();
    drop(gate);
    let _ = std::fs::remove_dir_all(&bells);
    let _ = std::fs::remove_file(&state);
}
