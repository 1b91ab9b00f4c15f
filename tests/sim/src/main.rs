//! `coloc-sim`: the simulated GPU daemon and the test workloads.
//!
//! ```text
//! coloc-sim gpu     --state /dev/shm/x --gpus 2 --sample-period-ms 1 --memory-gib 80
//! coloc-sim online  --state /dev/shm/x --gpu 0 --rate 20 --work-ms 5 --duration-s 10 --out online.json
//! coloc-sim offline --state /dev/shm/x --gpu 0 --step-ms 5 --queue-depth 2 --out offline.json
//! coloc-sim burst   --state /dev/shm/x --kernel-us 50 --bursts 5 --burst-ms 300 --gap-ms 700 --out burst.json
//! coloc-sim nvml    --state /dev/shm/x inject utilization --code INSUFFICIENT_SIZE --data-call --count 1
//! ```
//!
//! `online --cuda` and `offline --cuda` submit through the CUDA driver API instead
//! (`libcuda.so.1` found by `dlopen`, entry points through `cuGetProcAddress_v2`, as the
//! CUDA 12 runtime does; see `cuda.rs`), so a shim in front of the driver sees them.
use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use coloc_sim::nvml::parse_nvml_return;
use coloc_sim::{now_ns, percentile, NvmlFunc, SimGpu, STATE_ENV};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

mod cuda;

#[derive(Parser, Debug)]
#[command(
    version,
    about = "Simulated GPU and workloads for gpu-coloc tests and demos",
    long_about = "Simulated GPU and workloads for gpu-coloc tests and demos.\n\n\
                  `gpu` runs the simulated GPUs; `online`, `offline`, `burst` and `busy` are \
                  workloads on them; `nvml` injects faults into the fake NVML library the agent loads."
)]
struct Cli {
    /// Shared state file of the simulated GPUs.
    #[arg(long, env = STATE_ENV, global = true)]
    state: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run the simulated GPUs (creates the state file).
    Gpu {
        /// Number of GPUs.
        #[arg(long, default_value_t = 1)]
        gpus: u32,
        /// Driver sample period for per-process utilisation, ms. 200 ms: what an H100 with
        /// driver 580 gave (sample interval p50 200.0 ms, `benches/gpu/results/`).
        #[arg(long, default_value_t = 200.0)]
        sample_period_ms: f64,
        /// Model tick, µs: the longest the daemon sleeps, so the latest it sees new work.
        /// A completion someone waits for is made when it is due, not at the next tick.
        #[arg(long, default_value_t = 100)]
        tick_us: u64,
        /// Keep the slots of dead processes listed (to test stale PIDs).
        #[arg(long)]
        keep_dead: bool,
        /// Device memory of each GPU, GiB (allocations beyond it fail with
        /// CUDA_ERROR_OUT_OF_MEMORY; NVML reports what is free).
        #[arg(long, default_value_t = 80.0)]
        memory_gib: f64,
        /// What the checkpoint API's checkpoint costs per GB of the process's device
        /// memory, ms (an H100 with driver 580: about 600).
        #[arg(long, default_value_t = 600.0)]
        checkpoint_ms_per_gb: f64,
        /// What a restore costs per GB, ms (the same H100: about 200).
        #[arg(long, default_value_t = 200.0)]
        restore_ms_per_gb: f64,
        /// How contexts with work share a GPU: each keeps it for this slice, µs, once
        /// another has work, then the next takes its turn (2400: the wait of a tiny kernel
        /// beside a training loop on an H100, p50 2.41 ms). 0: processor sharing instead
        /// (n busy contexts each at 1/n speed).
        #[arg(long, default_value_t = 2400)]
        timeslice_us: u64,
    },
    /// An online service: requests arrive at random; each is busy on the GPU for a while.
    Online {
        #[arg(long, default_value_t = 0)]
        gpu: u32,
        /// Mean request arrivals per second (Poisson).
        #[arg(long, default_value_t = 20.0)]
        rate: f64,
        /// GPU time per request, ms (at full speed).
        #[arg(long, default_value_t = 5.0)]
        work_ms: f64,
        /// Stop after this many seconds (0: run until SIGTERM).
        #[arg(long, default_value_t = 0.0)]
        duration_s: f64,
        /// Wait before the first request, s.
        #[arg(long, default_value_t = 0.0)]
        start_delay_s: f64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Write a JSON summary (and per-request records) here on exit.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Submit through the CUDA driver API (`libcuda.so.1`; in tests the fake driver
        /// on LD_LIBRARY_PATH): each request is --kernels kernels, back to back on one
        /// stream, then cuStreamSynchronize. --gpu is then the CUDA device ordinal.
        #[arg(long)]
        cuda: bool,
        /// With --cuda: kernels per request (their durations sum to --work-ms).
        #[arg(long, default_value_t = 4, requires = "cuda")]
        kernels: u32,
        /// With --cuda: ask cuGetProcAddress for the per-thread default stream variants
        /// (flag 2, the `_ptsz` entry points), as a program built with
        /// --default-stream per-thread does.
        #[arg(long, requires = "cuda")]
        per_thread_stream: bool,
        /// Device memory the service holds, MiB.
        #[arg(long, default_value_t = 1024)]
        mem_mib: u64,
        /// With --cuda: while the GPU has no room for --mem-mib, try the allocation
        /// again every 5 ms for up to this long (its context already made, so the driver
        /// lists it), then print `{"memory_wait_s": …}` and serve; 0: fail at once.
        #[arg(long, default_value_t = 0.0, requires = "cuda")]
        mem_wait_s: f64,
    },
    /// An offline job: continuous steps, each busy on the GPU for a while.
    Offline {
        #[arg(long, default_value_t = 0)]
        gpu: u32,
        /// GPU time per step, ms (at full speed).
        #[arg(long, default_value_t = 5.0)]
        step_ms: f64,
        /// Steps kept queued on the GPU (the run-ahead, as PyTorch's asynchronous
        /// launches keep kernels queued): what keeps running after a SIGSTOP is about
        /// (queue_depth - 1..queue_depth) × step. With --cuda: kernels in flight, each
        /// followed by an event; the job waits on the oldest event (cuEventSynchronize).
        #[arg(long, visible_alias = "depth", default_value_t = 1)]
        queue_depth: u32,
        #[arg(long, default_value_t = 0.0)]
        duration_s: f64,
        /// Spawn a short-lived helper process this often (tests that a child forked
        /// while being frozen stays frozen); 0: never.
        #[arg(long, default_value_t = 0)]
        fork_every_ms: u64,
        #[arg(long)]
        out: Option<PathBuf>,
        /// Free-form label, for rules that match on the command line.
        #[arg(long)]
        tag: Option<String>,
        /// Submit through the CUDA driver API (see `online --cuda`): one kernel of
        /// --step-ms per step. --gpu is then the CUDA device ordinal.
        #[arg(long)]
        cuda: bool,
        /// With --cuda: the `_ptsz` entry points (see `online --per-thread-stream`).
        #[arg(long, requires = "cuda")]
        per_thread_stream: bool,
        /// With --cuda: submit to stream 0 (the legacy default stream, or the thread's
        /// per-thread default stream with --per-thread-stream) instead of a created stream.
        #[arg(long, requires = "cuda")]
        default_stream: bool,
        /// With --cuda: after this many kernels, wait for them and stay idle (context
        /// kept, nothing submitted) until the end; 0: never idle.
        #[arg(long, default_value_t = 0, requires = "cuda")]
        idle_after_steps: u64,
        /// With --cuda: this many threads submit to the same stream, each keeping
        /// --queue-depth kernels of its own in flight (on stream 0 each thread's own
        /// per-thread default stream with --per-thread-stream). The summary's launches
        /// are every thread's, its steps the first thread's.
        #[arg(long, default_value_t = 1, requires = "cuda")]
        threads: u32,
        /// Device memory the job holds, MiB.
        #[arg(long, default_value_t = 4096)]
        mem_mib: u64,
    },
    /// An online probe: bursts of tiny kernels, each launched and waited for alone
    /// (through the CUDA driver API), with idle gaps between bursts. Each kernel's
    /// latency shows whether another process's work shares the GPU at that moment, so a
    /// burst shows how long an offline process's queued work (its drain) delays online
    /// work after online starts. The simulated twin of `benches/gpu/burst.py` (same
    /// JSON: `kernels` [[CLOCK_MONOTONIC s, latency ms]], `bursts` [[start s, end s]],
    /// `bursts_wall_s` [each burst's start, CLOCK_REALTIME s]).
    Burst {
        /// CUDA device ordinal.
        #[arg(long, default_value_t = 0)]
        gpu: u32,
        /// GPU time per kernel, µs (at full speed).
        #[arg(long, default_value_t = 50.0)]
        kernel_us: f64,
        /// Number of bursts.
        #[arg(long, default_value_t = 5)]
        bursts: u32,
        /// Length of a burst, ms.
        #[arg(long, default_value_t = 300.0)]
        burst_ms: f64,
        /// Idle time before each burst, ms (longer than the agent's idle window, so that
        /// offline work resumes and queues up again between bursts).
        #[arg(long, default_value_t = 700.0)]
        gap_ms: f64,
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Busy on the GPU once for a fixed time (after an optional delay), then exit.
    Busy {
        #[arg(long, default_value_t = 0)]
        gpu: u32,
        /// GPU time, ms (at full speed).
        #[arg(long, default_value_t = 300.0)]
        ms: f64,
        /// Registered but idle for this long first, ms.
        #[arg(long, default_value_t = 0.0)]
        delay_ms: f64,
        /// Repeat the busy period this many times.
        #[arg(long, default_value_t = 1)]
        repeat: u32,
        /// Idle time between repeats, ms.
        #[arg(long, default_value_t = 250.0)]
        gap_ms: f64,
        /// Free-form label, for rules that match on the command line.
        #[arg(long)]
        tag: Option<String>,
    },
    /// Make the fake NVML library (in the agent) fail, stall or hang; show its call counts.
    #[command(
        long_about = NVML_ABOUT,
        after_long_help = NVML_AFTER,
        after_help = "Functions: init shutdown count handle uuid processes utilization index name \
                      driver-version (or C names). More with --help."
    )]
    Nvml {
        #[command(subcommand)]
        cmd: NvmlCmd,
    },
    /// Helper spawned by `offline --fork-every-ms`: bumps a shared counter every ms.
    #[command(hide = true)]
    Child {
        #[arg(long, default_value_t = 200)]
        life_ms: u64,
    },
}

const NVML_ABOUT: &str = "\
Make the fake NVML library (libfake_nvml.so, loaded by the agent) fail, stall or hang,
and show how often the agent called each function. Acts on a running simulated GPU's
state file (--state or COLOC_SIM_STATE); takes effect on the agent's next call. The same
switches are methods of coloc_sim::SimGpu (nvml_inject, nvml_delay, nvml_hang, nvml_gone,
nvml_clear, nvml_call_count, ...).

Inside one call: count it -> block while hung -> delay -> gone -> injection for the
call's GPU, else for all GPUs -> the legacy nvml_fail flag -> the normal answer.";

const NVML_AFTER: &str = "\
Functions (FUNC: ID, short name, or C name with or without its _vN suffix):
  0 init         nvmlInit_v2, nvmlInitWithFlags
  1 shutdown     nvmlShutdown
  2 count        nvmlDeviceGetCount_v2
  3 handle       nvmlDeviceGetHandleByIndex_v2            (per GPU: the index asked for)
  4 uuid         nvmlDeviceGetUUID                        (per GPU)
  5 processes    nvmlDeviceGetComputeRunningProcesses_v3  (per GPU, two-step)
  6 utilization  nvmlDeviceGetProcessUtilization          (per GPU, two-step)
  7 index        nvmlDeviceGetIndex                       (per GPU)
  8 name         nvmlDeviceGetName                        (per GPU)
  9 driver-version  nvmlSystemGetDriverVersion

Two-step functions are called twice per query: a count call (null buffer), then a data
call (a buffer). --data-call injects into the data call only.

Codes (--code: number or name): 2 INVALID_ARGUMENT, 3 NOT_SUPPORTED, 6 NOT_FOUND,
7 INSUFFICIENT_SIZE, 9 DRIVER_NOT_LOADED, 10 TIMEOUT, 12 LIBRARY_NOT_FOUND,
15 GPU_IS_LOST, 21 NO_DATA, 999 UNKNOWN, ... (any nvmlReturn_t).

Examples:
  # The driver's race: samples arrive between the count and the data call, once.
  coloc-sim nvml inject utilization --code INSUFFICIENT_SIZE --data-call --count 1
  # GPU 1's process list fails until cleared.
  coloc-sim nvml inject processes --gpu 1 --code GPU_IS_LOST
  # Every utilization call takes 300 ms.
  coloc-sim nvml delay utilization --ms 300
  # Hang the process list; wait until the agent is stuck in it; release it.
  coloc-sim nvml hang processes
  coloc-sim nvml wait-hung processes --timeout-s 10
  coloc-sim nvml hang processes --off
  # The driver goes away, then comes back.
  coloc-sim nvml gone; coloc-sim nvml gone --off
  # Call counts and active faults, as JSON.
  coloc-sim nvml status
  coloc-sim nvml clear";

#[derive(Subcommand, Debug)]
enum NvmlCmd {
    /// Answer an error code for the next calls of a function.
    Inject {
        /// The function (ID, short name or C name; see `coloc-sim nvml --help`).
        func: NvmlFunc,
        /// nvmlReturn_t to answer: a number or a name (INSUFFICIENT_SIZE, GPU_IS_LOST, ...).
        #[arg(long, value_parser = parse_nvml_return)]
        code: u32,
        /// Only calls about this GPU (default: every GPU). Replaces an earlier injection
        /// for the same function and GPU; one for a GPU is consulted before one for all.
        #[arg(long)]
        gpu: Option<u32>,
        /// Number of calls to answer so (0: until `uninject` or `clear`).
        #[arg(long, default_value_t = 0)]
        count: u32,
        /// Two-step functions only: hit only the data call (non-null buffer); the count
        /// call is served normally and does not use up --count. INSUFFICIENT_SIZE also
        /// writes the needed count (more than the buffer holds), as the driver does.
        #[arg(long)]
        data_call: bool,
    },
    /// Remove a function's injections (every GPU).
    Uninject {
        /// The function.
        func: NvmlFunc,
    },
    /// Every call of a function sleeps first.
    Delay {
        /// The function.
        func: NvmlFunc,
        /// Delay, ms (fractions allowed; 0 removes it).
        #[arg(long)]
        ms: f64,
    },
    /// Calls of a function block until `hang FUNC --off` (at most 120 s), then answer
    /// normally.
    Hang {
        /// The function.
        func: NvmlFunc,
        /// Release: blocked calls go on, new calls no longer block.
        #[arg(long)]
        off: bool,
    },
    /// Wait until at least one call of a function is blocked in a hang (exit 1 on timeout).
    WaitHung {
        /// The function.
        func: NvmlFunc,
        /// Give up after this many seconds.
        #[arg(long, default_value_t = 10.0)]
        timeout_s: f64,
    },
    /// The library is gone: every call, nvmlInit included, answers DRIVER_NOT_LOADED.
    Gone {
        /// Back again.
        #[arg(long)]
        off: bool,
        /// Answer this code instead (e.g. LIBRARY_NOT_FOUND, GPU_IS_LOST).
        #[arg(long, value_parser = parse_nvml_return, default_value = "DRIVER_NOT_LOADED")]
        code: u32,
    },
    /// Remove every fault: injections, delays, hangs, gone, and the legacy nvml_fail flag
    /// (counters are kept).
    Clear,
    /// Print call counters and active faults as JSON.
    Status,
}

fn run_nvml(sim: &SimGpu, cmd: NvmlCmd) -> Result<()> {
    match cmd {
        NvmlCmd::Inject {
            func,
            code,
            gpu,
            count,
            data_call,
        } => sim.nvml_inject(func, gpu, code, count, data_call)?,
        NvmlCmd::Uninject { func } => sim.nvml_uninject(func),
        NvmlCmd::Delay { func, ms } => {
            anyhow::ensure!(ms.is_finite() && ms >= 0.0, "--ms {ms}: give a delay >= 0");
            sim.nvml_delay(func, Duration::from_secs_f64(ms / 1e3))
        }
        NvmlCmd::Hang { func, off } => sim.nvml_hang(func, !off),
        NvmlCmd::WaitHung { func, timeout_s } => {
            let end = std::time::Instant::now() + Duration::from_secs_f64(timeout_s.max(0.0));
            while sim.nvml_hung_count(func) == 0 {
                if std::time::Instant::now() >= end {
                    anyhow::bail!("no call of {func} blocked in a hang after {timeout_s} s");
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        NvmlCmd::Gone { off, code } => sim.nvml_gone_code(if off { 0 } else { code }),
        NvmlCmd::Clear => sim.nvml_clear(),
        NvmlCmd::Status => println!("{}", serde_json::to_string_pretty(&sim.nvml_status())?),
    }
    Ok(())
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_term(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

fn install_term_handler() {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGTERM, on_term as *const () as libc::sighandler_t);
        libc::signal(libc::SIGINT, on_term as *const () as libc::sighandler_t);
    }
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let state = cli
        .state
        .clone()
        .context("--state (or COLOC_SIM_STATE) is required")?;
    install_term_handler();
    match cli.cmd {
        Cmd::Gpu {
            gpus,
            sample_period_ms,
            tick_us,
            keep_dead,
            memory_gib,
            checkpoint_ms_per_gb,
            restore_ms_per_gb,
            timeslice_us,
        } => run_gpu(
            state,
            gpus,
            sample_period_ms,
            tick_us,
            keep_dead,
            Memory {
                gib: memory_gib,
                checkpoint_ms_per_gb,
                restore_ms_per_gb,
                timeslice_us,
            },
        ),
        Cmd::Online {
            gpu,
            rate,
            work_ms,
            duration_s,
            start_delay_s,
            seed,
            out,
            cuda,
            kernels,
            per_thread_stream,
            mem_mib,
            mem_wait_s,
        } => {
            let sim = SimGpu::open(&state)?;
            let mem = mem_mib << 20;
            let gpu = if cuda {
                anyhow::ensure!(kernels > 0, "--kernels must be positive");
                // The driver finds the simulated GPU through the environment.
                std::env::set_var(STATE_ENV, &state);
                let g = if mem_wait_s > 0.0 {
                    // A context and 1 MiB first (the driver lists the process), then
                    // the rest, waiting for room.
                    let first = mem.min(1 << 20);
                    let g = cuda::CudaGpu::open(gpu, per_thread_stream, false, first as usize)?;
                    let waited = g.alloc_waiting(
                        (mem - first).max(1) as usize,
                        std::time::Duration::from_secs_f64(mem_wait_s),
                    )?;
                    println!("{{\"memory_wait_s\": {}}}", waited.as_secs_f64());
                    use std::io::Write;
                    std::io::stdout().flush()?;
                    g
                } else {
                    cuda::CudaGpu::open(gpu, per_thread_stream, false, mem as usize)?
                };
                Gpu::Cuda(g, kernels)
            } else {
                Gpu::Slot(sim.register(gpu, mem)?)
            };
            run_online(&gpu, rate, work_ms, duration_s, start_delay_s, seed, out)
        }
        Cmd::Offline {
            gpu,
            step_ms,
            queue_depth,
            duration_s,
            fork_every_ms,
            out,
            tag: _,
            cuda,
            per_thread_stream,
            default_stream,
            idle_after_steps,
            threads,
            mem_mib,
        } => {
            let sim = SimGpu::open(&state)?;
            if cuda {
                std::env::set_var(STATE_ENV, &state);
                let g = cuda::CudaGpu::open(
                    gpu,
                    per_thread_stream,
                    default_stream,
                    (mem_mib << 20) as usize,
                )?;
                run_offline_cuda(
                    &g,
                    step_ms,
                    queue_depth,
                    duration_s,
                    fork_every_ms,
                    idle_after_steps,
                    threads,
                    out,
                )
            } else {
                run_offline(
                    &sim,
                    gpu,
                    step_ms,
                    queue_depth,
                    duration_s,
                    fork_every_ms,
                    out,
                )
            }
        }
        Cmd::Burst {
            gpu,
            kernel_us,
            bursts,
            burst_ms,
            gap_ms,
            out,
        } => {
            anyhow::ensure!(
                kernel_us > 0.0 && burst_ms > 0.0 && gap_ms >= 0.0,
                "--kernel-us and --burst-ms must be positive, --gap-ms not negative"
            );
            std::env::set_var(STATE_ENV, &state);
            let g = cuda::CudaGpu::open(gpu, false, false, 1 << 28)?;
            run_burst(&g, kernel_us, bursts, burst_ms, gap_ms, out)
        }
        Cmd::Busy {
            gpu,
            ms,
            delay_ms,
            repeat,
            gap_ms,
            tag: _,
        } => {
            let sim = SimGpu::open(&state)?;
            let slot = sim.register(gpu, 1 << 28)?;
            std::thread::sleep(Duration::from_secs_f64(delay_ms / 1e3));
            for i in 0..repeat {
                if i > 0 {
                    std::thread::sleep(Duration::from_secs_f64(gap_ms / 1e3));
                }
                if STOP.load(Ordering::Relaxed) {
                    break;
                }
                let target = slot.submit((ms * 1e6) as u64);
                slot.wait_completed(target);
            }
            Ok(())
        }
        Cmd::Nvml { cmd } => run_nvml(&SimGpu::open(&state)?, cmd),
        Cmd::Child { life_ms } => {
            let sim = SimGpu::open(&state)?;
            let end = now_ns() + life_ms * 1_000_000;
            while now_ns() < end && !STOP.load(Ordering::Relaxed) {
                sim.header().fork_progress.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(1));
            }
            Ok(())
        }
    }
}

/// `coloc-sim gpu`'s memory and checkpoint-cost settings.
#[derive(Debug, Clone, Copy)]
struct Memory {
    gib: f64,
    checkpoint_ms_per_gb: f64,
    restore_ms_per_gb: f64,
    /// The time slice, µs (0: processor sharing).
    timeslice_us: u64,
}

fn run_gpu(
    state: PathBuf,
    gpus: u32,
    period_ms: f64,
    tick_us: u64,
    keep_dead: bool,
    mem: Memory,
) -> Result<()> {
    anyhow::ensure!(
        mem.gib > 0.0 && mem.gib.is_finite(),
        "--memory-gib {}: a positive number of GiB",
        mem.gib
    );
    anyhow::ensure!(
        mem.checkpoint_ms_per_gb >= 0.0 && mem.restore_ms_per_gb >= 0.0,
        "--checkpoint-ms-per-gb and --restore-ms-per-gb cannot be negative"
    );
    let sim = SimGpu::create(&state, gpus, (period_ms * 1e6) as u64)?;
    if keep_dead {
        sim.header().reap_dead.store(0, Ordering::SeqCst);
    }
    sim.set_mem_total((mem.gib * (1u64 << 30) as f64) as u64);
    sim.set_timeslice((mem.timeslice_us > 0).then(|| Duration::from_micros(mem.timeslice_us)));
    sim.set_ckpt_cost(
        Duration::from_secs_f64(mem.checkpoint_ms_per_gb / 1e3),
        Duration::from_secs_f64(mem.restore_ms_per_gb / 1e3),
    );
    let mut d = coloc_sim::Daemon::new(&sim, now_ns());
    eprintln!(
        "coloc-sim gpu: {gpus} simulated GPU(s), sample period {period_ms} ms, {}, state {}",
        match mem.timeslice_us {
            0 => "processor sharing".to_string(),
            us => format!("time slice {us} µs"),
        },
        state.display()
    );
    let tick = tick_us.max(10) * 1000;
    // Wake-ups to the microsecond (the default slack is 50 µs).
    // SAFETY: prctl(PR_SET_TIMERSLACK) on this thread; no pointers.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong, 0, 0, 0) };
    while !STOP.load(Ordering::Relaxed) {
        let seq = sim.daemon_wake().load(Ordering::Acquire);
        let now = now_ns();
        d.advance(now);
        // Until the next completion a waiter is owed (or a share changes), at most a tick,
        // or a submission to an idle slot (it wakes us): completions when they happen.
        let until = d
            .next_event_ns()
            .map_or(now + tick, |t| t.clamp(now + 2_000, now + tick));
        let left = until.saturating_sub(now_ns());
        if left > 0 {
            coloc_doorbell::futex_wait(sim.daemon_wake(), seq, left);
        }
    }
    std::fs::remove_file(&state).ok();
    Ok(())
}

fn sleep_until(t_ns: u64) {
    loop {
        let now = now_ns();
        if now >= t_ns || STOP.load(Ordering::Relaxed) {
            return;
        }
        std::thread::sleep(Duration::from_nanos((t_ns - now).min(50_000_000)));
    }
}

/// Where a workload's GPU work goes.
enum Gpu<'a> {
    /// Straight into a simulated GPU slot.
    Slot(coloc_sim::SlotHandle<'a>),
    /// Through the CUDA driver API, this many kernels per request.
    Cuda(cuda::CudaGpu, u32),
}

impl Gpu<'_> {
    /// Runs `ns` of GPU work and waits for it.
    fn run(&self, ns: u64) -> Result<()> {
        match self {
            Gpu::Slot(slot) => {
                let target = slot.submit(ns);
                slot.wait_completed(target);
            }
            Gpu::Cuda(g, k) => {
                let k = u64::from(*k);
                for i in 0..k {
                    // Durations sum to ns exactly.
                    g.launch(ns * (i + 1) / k - ns * i / k)?;
                }
                g.synchronize()?;
            }
        }
        Ok(())
    }
}

fn run_online(
    gpu: &Gpu<'_>,
    rate: f64,
    work_ms: f64,
    duration_s: f64,
    start_delay_s: f64,
    seed: u64,
    out: Option<PathBuf>,
) -> Result<()> {
    anyhow::ensure!(rate > 0.0, "--rate must be positive");
    let mut rng = StdRng::seed_from_u64(seed);
    let work_ns = (work_ms * 1e6) as u64;
    let start = now_ns() + (start_delay_s * 1e9) as u64;
    let end = if duration_s > 0.0 {
        start + (duration_s * 1e9) as u64
    } else {
        u64::MAX
    };
    let mut arrival = start;
    let mut records: Vec<(u64, u64, u64)> = Vec::new(); // arrival, started, done
    loop {
        let u: f64 = rng.gen_range(f64::EPSILON..1.0);
        arrival += (-u.ln() / rate * 1e9) as u64;
        if arrival >= end || STOP.load(Ordering::Relaxed) {
            break;
        }
        sleep_until(arrival);
        if STOP.load(Ordering::Relaxed) {
            break;
        }
        let started = now_ns();
        gpu.run(work_ns)?;
        records.push((arrival, started, now_ns()));
    }
    let mut lat: Vec<f64> = records.iter().map(|r| (r.2 - r.0) as f64 / 1e6).collect();
    lat.sort_by(f64::total_cmp);
    // With --cuda on the fake driver: every driver call the process made (the
    // application's and a shim's).
    let driver_calls = match gpu {
        Gpu::Cuda(g, _) => g.stats().map(|s| s.driver_calls),
        Gpu::Slot(_) => None,
    };
    let summary = serde_json::json!({
        "driver_calls": driver_calls,
        "requests": lat.len(),
        "p50_ms": percentile(&lat, 50.0),
        "p99_ms": percentile(&lat, 99.0),
        "max_ms": lat.last().copied().unwrap_or(0.0),
        "work_ms": work_ms,
        "rate": rate,
        "records": records,
    });
    write_out(out, &summary)
}

fn run_offline(
    sim: &SimGpu,
    gpu: u32,
    step_ms: f64,
    depth: u32,
    duration_s: f64,
    fork_every_ms: u64,
    out: Option<PathBuf>,
) -> Result<()> {
    let slot = sim.register(gpu, 4 << 30)?;
    let step_ns = ((step_ms * 1e6) as u64).max(1);
    let depth = depth.max(1) as u64;
    let start = now_ns();
    let end = if duration_s > 0.0 {
        start + (duration_s * 1e9) as u64
    } else {
        u64::MAX
    };
    let mut children = Vec::new();
    let mut next_fork = start;
    let exe = std::env::current_exe()?;
    while now_ns() < end && !STOP.load(Ordering::Relaxed) {
        if fork_every_ms > 0 && now_ns() >= next_fork {
            next_fork = now_ns() + fork_every_ms * 1_000_000;
            if let Ok(c) = std::process::Command::new(&exe).arg("child").spawn() {
                children.push(c);
            }
            children.retain_mut(|c| c.try_wait().ok().flatten().is_none());
        }
        // Keep `depth` steps queued: submit when fewer than depth remain.
        while slot.outstanding() < depth * step_ns {
            slot.submit(step_ns);
        }
        // Wait until one step has drained (outstanding below depth steps again). Computed
        // from what was submitted: `completed` may move while we read it.
        let target = slot.submitted() - (depth - 1) * step_ns;
        let wait_until = if fork_every_ms > 0 {
            next_fork.min(end)
        } else {
            end
        };
        wait_bounded(&slot, target, wait_until);
    }
    let elapsed = (now_ns() - start) as f64 / 1e9;
    let steps = slot.completed() / step_ns;
    for mut c in children {
        c.wait().ok();
    }
    let summary = serde_json::json!({
        "steps": steps,
        "elapsed_s": elapsed,
        "steps_per_s": steps as f64 / elapsed.max(1e-9),
        "step_ms": step_ms,
    });
    write_out(out, &summary)
}

/// `offline --cuda`: keep `depth` kernels of `step_ms` in flight on one stream, an event
/// after each; wait on the oldest event (cuEventSynchronize), then top up. What runs on
/// after a SIGSTOP is exactly the kernels in flight: (depth - 1..depth) × step.
///
/// Observing it from outside (the launch gate's tests): every kernel adds `step_ms` to the
/// process's `submitted_ns` in the simulated GPU's state (`SimGpu::slot_info`), live; the
/// summary gives `launches`, the first and last launch times, and the fake driver's
/// counters (`max_outstanding_stream`: the most kernels ever in flight on the stream,
/// which an in-flight bound in a shim caps; `idle_stream_submissions`: those that found the
/// stream with nothing in flight, the GPU waiting for the host). With `threads` > 1 the
/// other threads each keep `depth` kernels of their own queued on the same stream.
#[allow(clippy::too_many_arguments)]
fn run_offline_cuda(
    g: &cuda::CudaGpu,
    step_ms: f64,
    depth: u32,
    duration_s: f64,
    fork_every_ms: u64,
    idle_after_steps: u64,
    threads: u32,
    out: Option<PathBuf>,
) -> Result<()> {
    let step_ns = ((step_ms * 1e6) as u64).max(1);
    let depth = depth.max(1) as usize;
    let start = now_ns();
    let end = if duration_s > 0.0 {
        start + (duration_s * 1e9) as u64
    } else {
        u64::MAX
    };
    // The other threads on the same stream: each keeps `depth` kernels of its own queued.
    let other = |g: &cuda::CudaGpu| -> Result<u64> {
        g.bind()?;
        let (mut q, mut n) = (std::collections::VecDeque::new(), 0u64);
        while now_ns() < end && !STOP.load(Ordering::Relaxed) {
            while q.len() < depth {
                g.launch(step_ns)?;
                n += 1;
                q.push_back(g.record()?);
            }
            if let Some(e) = q.pop_front() {
                g.wait(e)?;
            }
        }
        for e in q {
            g.wait(e)?;
        }
        Ok(n)
    };
    std::thread::scope(|s| {
        let others: Vec<_> = (1..threads.max(1)).map(|_| s.spawn(|| other(g))).collect();
        let mine = offline_cuda_loop(g, step_ns, depth, end, fork_every_ms, idle_after_steps);
        let mut launches = 0;
        for t in others {
            launches += t
                .join()
                .map_err(|_| anyhow::anyhow!("a submitting thread panicked"))??;
        }
        let (steps, mine, first, last) = mine?;
        let elapsed = (now_ns() - start) as f64 / 1e9;
        offline_cuda_summary(
            g,
            out,
            step_ms,
            steps,
            elapsed,
            launches + mine,
            first,
            last,
        )
    })
}

/// The submitting loop of `offline --cuda`'s first thread: (steps, launches, first and
/// last launch, ns).
fn offline_cuda_loop(
    g: &cuda::CudaGpu,
    step_ns: u64,
    depth: usize,
    end: u64,
    fork_every_ms: u64,
    idle_after_steps: u64,
) -> Result<(u64, u64, u64, u64)> {
    let start = now_ns();
    let mut children = Vec::new();
    let mut next_fork = start;
    let exe = std::env::current_exe()?;
    let mut in_flight = std::collections::VecDeque::new();
    let mut steps = 0u64;
    let (mut launches, mut first_launch_ns, mut last_launch_ns) = (0u64, 0u64, 0u64);
    while now_ns() < end && !STOP.load(Ordering::Relaxed) {
        if fork_every_ms > 0 && now_ns() >= next_fork {
            next_fork = now_ns() + fork_every_ms * 1_000_000;
            if let Ok(c) = std::process::Command::new(&exe).arg("child").spawn() {
                children.push(c);
            }
            children.retain_mut(|c| c.try_wait().ok().flatten().is_none());
        }
        if idle_after_steps > 0 && launches >= idle_after_steps {
            for e in in_flight.drain(..) {
                g.wait(e)?;
                steps += 1;
            }
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        while in_flight.len() < depth {
            g.launch(step_ns)?;
            last_launch_ns = now_ns();
            if launches == 0 {
                first_launch_ns = last_launch_ns;
            }
            launches += 1;
            in_flight.push_back(g.record()?);
        }
        if let Some(e) = in_flight.pop_front() {
            g.wait(e)?;
            steps += 1;
        }
    }
    for e in &in_flight {
        if g.done(e)? {
            steps += 1;
        }
    }
    for mut c in children {
        c.wait().ok();
    }
    Ok((steps, launches, first_launch_ns, last_launch_ns))
}

#[allow(clippy::too_many_arguments)]
fn offline_cuda_summary(
    g: &cuda::CudaGpu,
    out: Option<PathBuf>,
    step_ms: f64,
    steps: u64,
    elapsed: f64,
    launches: u64,
    first_launch_ns: u64,
    last_launch_ns: u64,
) -> Result<()> {
    let stats = g.stats();
    let summary = serde_json::json!({
        "steps": steps,
        "elapsed_s": elapsed,
        "steps_per_s": steps as f64 / elapsed.max(1e-9),
        "step_ms": step_ms,
        "launches": launches,
        "first_launch_ns": first_launch_ns,
        "last_launch_ns": last_launch_ns,
        "max_outstanding_stream": stats.map(|s| s.max_outstanding_stream),
        "idle_stream_submissions": stats.map(|s| s.idle_stream_submissions),
        "max_outstanding_gpu": stats.map(|s| s.max_outstanding_gpu),
        "driver_submissions": stats.map(|s| s.submissions),
        "driver_calls": stats.map(|s| s.driver_calls),
    });
    write_out(out, &summary)
}

fn mono_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime with a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// `burst`: see [`Cmd::Burst`].
fn run_burst(
    g: &cuda::CudaGpu,
    kernel_us: f64,
    bursts: u32,
    burst_ms: f64,
    gap_ms: f64,
    out: Option<PathBuf>,
) -> Result<()> {
    let ns = ((kernel_us * 1e3) as u64).max(1);
    let (mut kernels, mut spans, mut walls) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..bursts {
        let wake = mono_s() + gap_ms / 1e3;
        while mono_s() < wake && !STOP.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_secs_f64((wake - mono_s()).clamp(0.0, 0.05)));
        }
        if STOP.load(Ordering::Relaxed) {
            break;
        }
        let start = mono_s();
        walls.push(now_ns() as f64 / 1e9);
        while mono_s() - start < burst_ms / 1e3 && !STOP.load(Ordering::Relaxed) {
            let t = mono_s();
            g.launch(ns)?;
            g.synchronize()?;
            kernels.push([t, (mono_s() - t) * 1e3]);
        }
        spans.push([start, mono_s()]);
    }
    let summary = serde_json::json!({
        "clock": "monotonic",
        "kernel_us": kernel_us,
        "burst_ms": burst_ms,
        "gap_ms": gap_ms,
        "bursts": spans,
        "bursts_wall_s": walls,
        "kernels": kernels,
    });
    write_out(out, &summary)
}

fn wait_bounded(slot: &coloc_sim::SlotHandle<'_>, target: u64, until_ns: u64) {
    // wait_completed wakes at least every 2 ms, so STOP and deadlines are honoured.
    while slot.completed() < target && now_ns() < until_ns && !STOP.load(Ordering::Relaxed) {
        let t = slot.completed() + (target - slot.completed()).min(2_000_000);
        slot.wait_completed(t.min(target));
    }
}

fn write_out(out: Option<PathBuf>, v: &serde_json::Value) -> Result<()> {
    match out {
        Some(p) => {
            let tmp = p.with_extension("tmp");
            std::fs::write(&tmp, serde_json::to_vec(v)?)?;
            std::fs::rename(&tmp, &p).with_context(|| format!("writing {}", p.display()))
        }
        None => {
            let mut v = v.clone();
            v.as_object_mut().map(|o| o.remove("records"));
            println!("{v}");
            Ok(())
        }
    }
}
