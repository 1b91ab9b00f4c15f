//! `coloc-sim`: the simulated GPU daemon and the test workloads.
//!
//! ```text
//! coloc-sim gpu     --state /dev/shm/x --gpus 2 --sample-period-ms 1
//! coloc-sim online  --state /dev/shm/x --gpu 0 --rate 20 --work-ms 5 --duration-s 10 --out online.json
//! coloc-sim offline --state /dev/shm/x --gpu 0 --step-ms 5 --queue-depth 2 --out offline.json
//! ```
use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use coloc_sim::{now_ns, percentile, SimGpu, STATE_ENV};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(
    version,
    about = "Simulated GPU and workloads for gpu-coloc tests and demos"
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
        /// Driver sample period for per-process utilisation, ms (NVIDIA drivers: 1/6 s
        /// on older GPUs, finer on recent ones).
        #[arg(long, default_value_t = 1.0)]
        sample_period_ms: f64,
        /// Model tick, µs.
        #[arg(long, default_value_t = 100)]
        tick_us: u64,
        /// Keep the slots of dead processes listed (to test stale PIDs).
        #[arg(long)]
        keep_dead: bool,
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
    },
    /// An offline job: continuous steps, each busy on the GPU for a while.
    Offline {
        #[arg(long, default_value_t = 0)]
        gpu: u32,
        /// GPU time per step, ms (at full speed).
        #[arg(long, default_value_t = 5.0)]
        step_ms: f64,
        /// Steps kept queued on the GPU: what keeps running after a SIGSTOP is about
        /// (queue_depth - 1..queue_depth) × step.
        #[arg(long, default_value_t = 1)]
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
    /// Helper spawned by `offline --fork-every-ms`: bumps a shared counter every ms.
    #[command(hide = true)]
    Child {
        #[arg(long, default_value_t = 200)]
        life_ms: u64,
    },
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
        } => run_gpu(state, gpus, sample_period_ms, tick_us, keep_dead),
        Cmd::Online {
            gpu,
            rate,
            work_ms,
            duration_s,
            start_delay_s,
            seed,
            out,
        } => {
            let sim = SimGpu::open(&state)?;
            run_online(
                &sim,
                gpu,
                rate,
                work_ms,
                duration_s,
                start_delay_s,
                seed,
                out,
            )
        }
        Cmd::Offline {
            gpu,
            step_ms,
            queue_depth,
            duration_s,
            fork_every_ms,
            out,
            tag: _,
        } => {
            let sim = SimGpu::open(&state)?;
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

fn run_gpu(state: PathBuf, gpus: u32, period_ms: f64, tick_us: u64, keep_dead: bool) -> Result<()> {
    let sim = SimGpu::create(&state, gpus, (period_ms * 1e6) as u64)?;
    if keep_dead {
        sim.header().reap_dead.store(0, Ordering::SeqCst);
    }
    let mut d = coloc_sim::Daemon::new(&sim, now_ns());
    eprintln!(
        "coloc-sim gpu: {gpus} simulated GPU(s), sample period {period_ms} ms, state {}",
        state.display()
    );
    let tick = Duration::from_micros(tick_us.max(10));
    while !STOP.load(Ordering::Relaxed) {
        d.advance(now_ns());
        std::thread::sleep(tick);
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

#[allow(clippy::too_many_arguments)]
fn run_online(
    sim: &SimGpu,
    gpu: u32,
    rate: f64,
    work_ms: f64,
    duration_s: f64,
    start_delay_s: f64,
    seed: u64,
    out: Option<PathBuf>,
) -> Result<()> {
    anyhow::ensure!(rate > 0.0, "--rate must be positive");
    let slot = sim.register(gpu, 1 << 30)?;
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
        let target = slot.submit(work_ns);
        slot.wait_completed(target);
        records.push((arrival, started, now_ns()));
    }
    let mut lat: Vec<f64> = records.iter().map(|r| (r.2 - r.0) as f64 / 1e6).collect();
    lat.sort_by(f64::total_cmp);
    let summary = serde_json::json!({
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
