//! `coloc-bench --wake-floor`: the machine's own wake-up latency, the floor under the
//! agent's launch → decision latency.
//!
//! The agent sleeps in `futex_waitv` until a shim bumps a page's wake word. Whatever the
//! agent does, a launch cannot be decided sooner than the kernel (and, in a virtual
//! machine, the hypervisor) takes to run a thread that a `FUTEX_WAKE` made runnable.
//! This mode measures that path without the agent:
//!
//! - **futex**: a ringer thread stamps `CLOCK_MONOTONIC` into shared memory, bumps a
//!   word and calls `FUTEX_WAKE` (what the shim does on a run's first launch), at random
//!   gaps (`--gap-ms`, 1–5 ms by default) so that the waiter is asleep each time; the waiter returns from
//!   `FUTEX_WAIT` and reads the clock. Latency = waiter's clock − ringer's stamp.
//! - **timer**: the waiter sleeps 200 µs (`clock_nanosleep`); latency = how late it wakes.
//!
//! Each under: an idle machine, and CPU hogs (threads at nice 0 that spin 1 ms and sleep
//! 1 ms, or spin without pause), with the waiter at nice 0, nice −10 (the agent's default
//! `--loop-nice`) and SCHED_FIFO 10 (`--loop-rt-priority 10`).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::*};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Usage, appended to `--help`.
pub const USAGE: &str = "
  --wake-floor [--samples 2000] [--hogs 0,2h,2] [--gap-ms 1-5] [--cpu-wake-latency off,0]
        the machine's own wake-up latency (no agent): FUTEX_WAKE in one thread to the
        sleeping waiter running, and a 200 µs timer's lateness, with the waiter at nice 0,
        nice -10 and SCHED_FIFO 10; per load: N hogs spinning (`N`) or spinning half the
        time (`Nh`); rings GAP-MS apart (uniform); per CPU wake-up latency request (as the
        agent's --cpu-wake-latency holds it; `off`: none, the default). The floor under
        launch -> decision";

fn now_ns() -> u64 {
    coloc_doorbell::now_ns()
}

/// The waiting thread's scheduling.
#[derive(Clone, Copy, Debug)]
enum Prio {
    Normal,
    Nice(i32),
    Fifo(i32),
    /// SCHED_OTHER at nice −10 with a custom EEVDF slice, µs (`sched_setattr`'s
    /// `sched_runtime`, Linux ≥ 6.12).
    Slice(u64),
}

impl Prio {
    fn name(self) -> String {
        match self {
            Prio::Normal => "nice 0".into(),
            Prio::Nice(n) => format!("nice {n}"),
            Prio::Fifo(p) => format!("SCHED_FIFO {p}"),
            Prio::Slice(us) => format!("nice -10, slice {us} µs"),
        }
    }

    /// Applies to the calling thread; false when refused (not root, or, for SCHED_FIFO, no
    /// real-time budget: seen on an H100 VM as root).
    fn apply(self) -> bool {
        match self {
            Prio::Normal => true,
            Prio::Nice(n) => {
                // SAFETY: setpriority on the calling thread's TID.
                unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as u32, n) == 0 }
            }
            Prio::Fifo(p) => {
                let param = libc::sched_param { sched_priority: p };
                // SAFETY: a valid sched_param for the calling thread.
                unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) == 0 }
            }
            Prio::Slice(us) => coloc_agent::sched::set_slice(-10, us * 1000).is_ok(),
        }
    }
}

/// CPU hogs running until dropped.
struct Hogs {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Hogs {
    /// `spec`: "0", "N" (N threads spinning) or "Nh" (spinning 1 ms of every 2).
    fn start(spec: &str) -> Hogs {
        let half = spec.ends_with('h');
        let n: usize = spec.trim_end_matches('h').parse().unwrap_or(0);
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..n)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !stop.load(Relaxed) {
                        let t = Instant::now();
                        while t.elapsed() < Duration::from_millis(1) {
                            std::hint::spin_loop();
                        }
                        if half {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                    }
                })
            })
            .collect();
        Hogs { stop, threads }
    }

    fn describe(spec: &str) -> String {
        match spec {
            "0" => "idle".into(),
            s if s.ends_with('h') => format!("{} hogs at 50 %", s.trim_end_matches('h')),
            s => format!("{s} hogs at 100 %"),
        }
    }
}

impl Drop for Hogs {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// A small xorshift for the ringer's gaps (no dependency, reproducible).
fn next(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}

/// FUTEX_WAKE → waiter running, µs, `samples` times. The ringer waits for the waiter to
/// take each ring before the next gap, so no ring is merged into another.
fn futex_lat(prio: Prio, samples: usize, gap_us: (u64, u64)) -> Option<Vec<f64>> {
    let word = Arc::new(AtomicU32::new(0));
    let stamp = Arc::new(AtomicU64::new(0));
    let taken = Arc::new(AtomicU32::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let (tx, rx) = std::sync::mpsc::channel::<bool>();
    let waiter = {
        let (word, stamp, taken, done) = (word.clone(), stamp.clone(), taken.clone(), done.clone());
        std::thread::spawn(move || {
            let ok = prio.apply();
            let _ = tx.send(ok);
            if !ok {
                return None;
            }
            let mut out = Vec::with_capacity(samples);
            let mut seen = word.load(Acquire);
            while !done.load(Acquire) {
                coloc_doorbell::futex_wait(&word, seen, 100_000_000);
                let t = now_ns();
                let w = word.load(Acquire);
                if w == seen {
                    continue; // timeout or spurious
                }
                seen = w;
                out.push(t.saturating_sub(stamp.load(Acquire)) as f64 / 1e3);
                taken.store(w, Release);
            }
            Some(out)
        })
    };
    if !rx.recv().unwrap_or(false) {
        return None;
    }
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for i in 1..=samples as u32 {
        let gap = gap_us.0 + next(&mut seed) % (gap_us.1 - gap_us.0).max(1);
        std::thread::sleep(Duration::from_micros(gap));
        stamp.store(now_ns(), Release);
        word.fetch_add(1, Release);
        coloc_doorbell::futex_wake(&word);
        let t = Instant::now();
        while taken.load(Acquire) != i {
            if t.elapsed() > Duration::from_secs(2) {
                eprintln!("wake-floor: the waiter did not take ring {i} within 2 s");
                break;
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }
    done.store(true, Release);
    word.fetch_add(1, Release);
    coloc_doorbell::futex_wake(&word);
    let mut out = waiter.join().ok().flatten()?;
    out.truncate(samples);
    Some(out)
}

/// How late a 200 µs `clock_nanosleep` wakes, µs.
fn timer_lat(prio: Prio, samples: usize) -> Option<Vec<f64>> {
    std::thread::spawn(move || {
        if !prio.apply() {
            return None;
        }
        let mut out = Vec::with_capacity(samples);
        for _ in 0..samples {
            let t = now_ns();
            let d = libc::timespec {
                tv_sec: 0,
                tv_nsec: 200_000,
            };
            // SAFETY: valid timespec, null remainder.
            unsafe { libc::clock_nanosleep(libc::CLOCK_MONOTONIC, 0, &d, std::ptr::null_mut()) };
            out.push((now_ns() - t).saturating_sub(200_000) as f64 / 1e3);
        }
        Some(out)
    })
    .join()
    .ok()
    .flatten()
}

fn pcts(v: &[f64]) -> serde_json::Value {
    let q = |p: f64| coloc_tools::percentile(v, p);
    serde_json::json!({
        "n": v.len(), "p50_us": q(50.0), "p90_us": q(90.0), "p99_us": q(99.0),
        "p999_us": q(99.9), "max_us": q(100.0),
        "over_200us": v.iter().filter(|x| **x > 200.0).count(),
    })
}

/// Runs every cell and prints a Markdown table; returns the rows as JSON.
pub fn run(args: &[String]) -> serde_json::Value {
    let samples: usize = args
        .iter()
        .position(|a| a == "--samples")
        .and_then(|i| args.get(i + 1)?.parse().ok())
        .unwrap_or(2000);
    let loads: Vec<String> = args
        .iter()
        .position(|a| a == "--hogs")
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| "0,2h,2".into())
        .split(',')
        .map(str::to_string)
        .collect();
    let gap_ms: Vec<f64> = args
        .iter()
        .position(|a| a == "--gap-ms")
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| "1-5".into())
        .split('-')
        .filter_map(|x| x.parse().ok())
        .collect();
    let gap_us = match gap_ms[..] {
        [lo, hi] if lo > 0.0 && hi >= lo => ((lo * 1e3) as u64, (hi * 1e3) as u64),
        [x] if x > 0.0 => ((x * 1e3) as u64, (x * 1e3) as u64),
        _ => {
            eprintln!("--gap-ms takes LO-HI in ms (for example 1-5)");
            std::process::exit(2);
        }
    };
    let requests: Vec<Option<Duration>> = args
        .iter()
        .position(|a| a == "--cpu-wake-latency")
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| "off".into())
        .split(',')
        .map(|v| match v.trim() {
            "off" => None,
            v => Some(coloc_agent::cli::parse_duration(v).unwrap_or_else(|e| {
                eprintln!("--cpu-wake-latency takes `off` or durations, comma-separated: {e:#}");
                std::process::exit(2);
            })),
        })
        .collect();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "Wake-up floor on {cpus} CPUs, {samples} samples per cell, rings {}-{} ms apart (µs, nearest rank)\n",
        gap_us.0 as f64 / 1e3,
        gap_us.1 as f64 / 1e3
    );
    println!(
        "| CPU wake request | load | waiter | path | p50 | p90 | p99 | p99.9 | max | over 200 µs |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    for (request, load) in requests
        .iter()
        .flat_map(|r| loads.iter().map(move |l| (*r, l)))
    {
        let device = std::path::Path::new(coloc_agent::sched::CPU_LATENCY_DEVICE);
        let _held = match request {
            None => None,
            Some(d) => match coloc_agent::sched::CpuWakeLatency::hold(device, d) {
                Ok(h) => Some(h),
                Err(e) => {
                    println!("| {} µs | refused ({e}) | | | | | | | | |", d.as_micros());
                    continue;
                }
            },
        };
        let req = request.map_or("off".to_string(), |d| format!("{} µs", d.as_micros()));
        let _hogs = Hogs::start(load);
        std::thread::sleep(Duration::from_millis(200));
        for prio in [
            Prio::Normal,
            Prio::Nice(-10),
            Prio::Slice(100),
            Prio::Fifo(10),
        ] {
            for (path, v) in [
                ("futex wake", futex_lat(prio, samples, gap_us)),
                ("200 µs timer", timer_lat(prio, samples)),
            ] {
                let Some(v) = v else {
                    println!(
                        "| {req} | {} | {} | {path} | refused (not root, or no real-time budget: RLIMIT_RTPRIO, cpu.rt_runtime_us) | | | | | |",
                        Hogs::describe(load),
                        prio.name()
                    );
                    continue;
                };
                let p = pcts(&v);
                let f = |k: &str| p[k].as_f64().unwrap_or(f64::NAN);
                println!(
                    "| {req} | {} | {} | {path} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {} of {} |",
                    Hogs::describe(load),
                    prio.name(),
                    f("p50_us"),
                    f("p90_us"),
                    f("p99_us"),
                    f("p999_us"),
                    f("max_us"),
                    p["over_200us"],
                    p["n"]
                );
                rows.push(serde_json::json!({
                    "cpu_wake_latency_us": request.map(|d| d.as_micros() as u64),
                    "load": load, "waiter": prio.name(), "path": path, "latency": p,
                }));
            }
        }
    }
    serde_json::json!({ "cpus": cpus, "samples": samples, "gap_us": [gap_us.0, gap_us.1], "rows": rows })
}
