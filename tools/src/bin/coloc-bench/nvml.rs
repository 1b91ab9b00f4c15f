//! `coloc-bench --nvml-probe` and `--nvml-poll`: what the NVML library at hand (the real
//! driver on a GPU machine, the fake one here) answers, and what asking costs.
//!
//! - **probe**: the cost of each call the agent makes in its loop; GPM (Hopper's GPU
//!   performance monitoring: whether it is supported and which sampling intervals give
//!   a metric); then `--seconds` of polling per-process samples every 1 ms: the sample
//!   period per process, their freshness (poll time − sample timestamp), how the calls
//!   answered (new samples; nothing new: NVML's `NOT_FOUND`, or only samples of 0 %,
//!   which the agent's sampler drops; errors by reason;
//!   `INSUFFICIENT_SIZE` retried), and with `--stop-pid` the drain NVML shows after a
//!   SIGSTOP (at 1/3 of the run; SIGCONT at 2/3).
//! - **watch**: every per-process sample as the driver reports it, zero samples included,
//!   so that a harness can line them up with the work a process really did.
//! - **poll**: makes the two calls of the agent's loop (process list, then samples newer
//!   than the last one seen) together every `INTERVAL` — the agent itself spaces them by
//!   `--process-interval` (50 ms) and `--nvml-interval` (100 ms) — until `--seconds` or
//!   SIGTERM, then prints what it did and what each call cost. The real-GPU harness runs
//!   an online PyTorch probe beside it at 1, 10 and 100 ms to see whether the driver's
//!   lock slows online work.

use coloc_agent::edges::gpu::{Activity, GpuError, GpuSampler, Nvml};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use coloc_tools::percentile;

/// Usage, appended to `--help`.
pub const USAGE: &str = "
  --nvml-probe [--nvml-lib LIB] [--gpu 0] [--seconds 5] [--stop-pid PID]
        NVML facts on whatever driver LIB loads (JSON to stdout): each call's cost, GPM
        support and its usable sampling intervals, per-process sample period and
        freshness while polling every 1 ms, how the calls answered (new samples, nothing
        new, errors by reason, INSUFFICIENT_SIZE retried), and with --stop-pid the drain
        NVML shows after a SIGSTOP of that process (sent at 1/3 of the run, SIGCONT at 2/3)
  --nvml-watch [--nvml-lib LIB] [--gpu 0] [--seconds 5] [--every-ms 2]
        every per-process utilisation sample the driver reports, zeros included (the
        agent's sampler drops those), polled every --every-ms: JSON to stdout with one
        [pid, timestamp µs, sm %, memory %] per sample, oldest first
  --nvml-poll INTERVAL_MS [--nvml-lib LIB] [--gpu 0] [--seconds 0]
        make the agent loop's two NVML calls (process list, samples) every INTERVAL_MS
        until --seconds (0: until SIGTERM); prints polls, each call's cost and the answers
        (JSON to stdout)
";

fn opt(args: &[String], k: &str) -> Option<String> {
    args.iter()
        .position(|a| a == k)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

fn summary(v: &[f64]) -> serde_json::Value {
    serde_json::json!({"n": v.len(), "p50": percentile(v, 50.0), "p99": percentile(v, 99.0), "max": percentile(v, 100.0)})
}

/// How a series of calls answered.
#[derive(Default)]
struct Answers {
    calls: u64,
    with_data: u64,
    empty: u64,
    errors: BTreeMap<&'static str, u64>,
    first_error: Option<String>,
}

impl Answers {
    fn note<T>(&mut self, r: &Result<T, GpuError>, has_data: bool) {
        self.calls += 1;
        match r {
            Ok(_) if has_data => self.with_data += 1,
            Ok(_) => self.empty += 1,
            Err(e) => {
                *self.errors.entry(e.reason()).or_default() += 1;
                self.first_error.get_or_insert_with(|| e.to_string());
            }
        }
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({"calls": self.calls, "with_data": self.with_data, "empty": self.empty,
            "errors": self.errors, "first_error": self.first_error})
    }
}

fn open(args: &[String]) -> (String, u32, Nvml) {
    let lib = opt(args, "--nvml-lib").unwrap_or_else(|| "libnvidia-ml.so.1".into());
    let gpu: u32 = opt(args, "--gpu").and_then(|v| v.parse().ok()).unwrap_or(0);
    let nvml = Nvml::open(&lib, &[gpu]).unwrap_or_else(|e| {
        eprintln!("coloc-bench: {e}");
        std::process::exit(2)
    });
    (lib, gpu, nvml)
}

/// GPM on GPU `gpu`: support, and per interval whether two samples that far apart give
/// SM utilisation (Hopper's documentation and DCGM say intervals under 100 ms are
/// refused; this asks the driver at hand).
fn gpm(lib: &str, gpu: u32) -> serde_json::Value {
    use nvml_wrapper::enums::gpm::GpmMetricId;
    let nvml = match nvml_wrapper::Nvml::builder()
        .lib_path(std::ffi::OsStr::new(lib))
        .init()
    {
        Ok(n) => n,
        Err(e) => return serde_json::json!({"error": e.to_string()}),
    };
    let dev = match nvml.device_by_index(gpu) {
        Ok(d) => d,
        Err(e) => return serde_json::json!({"error": e.to_string()}),
    };
    let supported = dev.gpm_support();
    let streaming = dev.gpm_streaming_enabled();
    let mut out = serde_json::json!({
        "supported": supported.as_ref().map_err(|e| e.to_string()).ok(),
        "supported_error": supported.as_ref().err().map(|e| e.to_string()),
        "streaming_enabled": streaming.as_ref().ok(),
    });
    if supported.as_ref().ok() != Some(&true) {
        return out;
    }
    let mut cost = Vec::new();
    let mut intervals = Vec::new();
    for ms in [1u64, 10, 50, 100, 200, 1000] {
        let t = Instant::now();
        let s0 = dev.gpm_sample();
        cost.push(t.elapsed().as_secs_f64() * 1e6);
        std::thread::sleep(Duration::from_millis(ms));
        let t = Instant::now();
        let s1 = dev.gpm_sample();
        cost.push(t.elapsed().as_secs_f64() * 1e6);
        let r = match (s0, s1) {
            (Ok(a), Ok(b)) => nvml_wrapper::gpm::gpm_metrics_get(
                &nvml,
                &a,
                &b,
                &[GpmMetricId::SmUtil, GpmMetricId::GraphicsUtil],
            )
            .map_err(|e| e.to_string()),
            (Err(e), _) | (_, Err(e)) => Err(format!("nvmlGpmSampleGet: {e}")),
        };
        intervals.push(match r {
            Ok(m) => {
                let v: Vec<serde_json::Value> = m
                    .into_iter()
                    .map(|x| match x {
                        Ok(r) => serde_json::json!(r.value),
                        Err(e) => serde_json::json!(e.to_string()),
                    })
                    .collect();
                serde_json::json!({"interval_ms": ms, "ok": true, "sm_util": v[0], "graphics_util": v[1]})
            }
            Err(e) => serde_json::json!({"interval_ms": ms, "ok": false, "error": e}),
        });
    }
    out["sample_cost_us"] = summary(&cost);
    out["intervals"] = intervals.into();
    out
}

/// `--nvml-probe`.
pub fn probe(args: &[String]) {
    let (lib, gpu, mut nvml) = open(args);
    let secs: f64 = opt(args, "--seconds")
        .and_then(|v| v.parse().ok())
        .unwrap_or(5.0);
    let stop_pid: Option<i32> = opt(args, "--stop-pid").and_then(|v| v.parse().ok());
    // Per-call cost, each as the loop calls it.
    let mut cost = serde_json::Map::new();
    let mut buf: Vec<Activity> = Vec::new();
    for name in ["running_processes", "process_utilization"] {
        let mut t = Vec::new();
        for _ in 0..1000 {
            let s = Instant::now();
            if name == "running_processes" {
                let _ = nvml.processes(gpu);
            } else {
                buf.clear();
                let _ = nvml.samples(gpu, now_us().saturating_sub(1_000_000), &mut buf);
            }
            t.push(s.elapsed().as_secs_f64() * 1e6);
        }
        cost.insert(
            name.into(),
            serde_json::json!({"p50_us": percentile(&t, 50.0), "p99_us": percentile(&t, 99.0), "max_us": percentile(&t, 100.0)}),
        );
    }
    let gpm = gpm(&lib, gpu);
    // Sample period and freshness: poll every 1 ms.
    let mut last_seen = now_us();
    let mut per_pid: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
    let mut freshness = Vec::new();
    let (mut samples_ans, mut procs_ans) = (Answers::default(), Answers::default());
    let transient0 = nvml.transient_answers();
    let (t0, mut stopped_at, mut resumed) = (Instant::now(), None::<u64>, false);
    let mut resumed_at = u64::MAX;
    while t0.elapsed().as_secs_f64() < secs {
        if let (Some(pid), None) = (stop_pid, stopped_at) {
            if t0.elapsed().as_secs_f64() > secs / 3.0 {
                // SAFETY: kill(2) on a PID given on the command line.
                unsafe { libc::kill(pid, libc::SIGSTOP) };
                stopped_at = Some(now_us() * 1000);
            }
        }
        if let (Some(pid), false) = (stop_pid, resumed) {
            if t0.elapsed().as_secs_f64() > 2.0 * secs / 3.0 {
                // SAFETY: as above.
                unsafe { libc::kill(pid, libc::SIGCONT) };
                resumed = true;
                resumed_at = now_us() * 1000;
            }
        }
        let p = nvml.processes(gpu);
        procs_ans.note(&p, p.as_ref().is_ok_and(|v| !v.is_empty()));
        let poll = now_us() * 1000;
        buf.clear();
        let r = nvml.samples(gpu, last_seen, &mut buf);
        samples_ans.note(&r, !buf.is_empty());
        for a in &buf {
            last_seen = last_seen.max(a.at_ns / 1000);
            per_pid.entry(a.pid).or_default().push(a.at_ns);
            freshness.push(poll.saturating_sub(a.at_ns) as f64 / 1e6);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    if let (Some(pid), false) = (stop_pid, resumed) {
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGCONT) };
    }
    let mut periods = Vec::new();
    for ts in per_pid.values_mut() {
        ts.sort_unstable();
        ts.dedup();
        periods.extend(ts.windows(2).map(|w| (w[1] - w[0]) as f64 / 1e6));
    }
    let drain_ms = match (stop_pid, stopped_at) {
        (Some(pid), Some(t)) => per_pid
            .get(&(pid as u32))
            .and_then(|ts| {
                ts.iter()
                    .filter(|x| **x >= t && **x < resumed_at)
                    .max()
                    .map(|x| (x - t) as f64 / 1e6)
            })
            .or(Some(0.0)),
        _ => None,
    };
    let out = serde_json::json!({
        "nvml_lib": lib, "gpu": gpu, "seconds": secs, "call_cost": cost,
        "sample_interval_ms": {"min": percentile(&periods, 0.0), "p50": percentile(&periods, 50.0), "p99": percentile(&periods, 99.0)},
        "freshness_ms": {"p50": percentile(&freshness, 50.0), "p99": percentile(&freshness, 99.0)},
        "samples": freshness.len(), "processes_seen": per_pid.len(),
        "drain_after_sigstop_ms": drain_ms,
        "answers": {
            "process_utilization": samples_ans.json(),
            "running_processes": procs_ans.json(),
            "insufficient_size_retried": nvml.transient_answers() - transient0,
        },
        "gpm": gpm,
    });
    println!("{}", serde_json::to_string_pretty(&out).unwrap());
}

/// `--nvml-watch`.
pub fn watch(args: &[String]) {
    let lib = opt(args, "--nvml-lib").unwrap_or_else(|| "libnvidia-ml.so.1".into());
    let gpu: u32 = opt(args, "--gpu").and_then(|v| v.parse().ok()).unwrap_or(0);
    let secs: f64 = opt(args, "--seconds")
        .and_then(|v| v.parse().ok())
        .unwrap_or(5.0);
    let every = Duration::from_secs_f64(
        opt(args, "--every-ms")
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| *v > 0.0 && v.is_finite())
            .unwrap_or(2.0)
            / 1e3,
    );
    let fail = |what: &str, e: nvml_wrapper::error::NvmlError| -> ! {
        eprintln!("coloc-bench --nvml-watch: {what} ({lib}): {e}");
        std::process::exit(2)
    };
    let nvml = nvml_wrapper::Nvml::builder()
        .lib_path(std::ffi::OsStr::new(&lib))
        .init()
        .unwrap_or_else(|e| fail("cannot initialise NVML", e));
    let dev = nvml
        .device_by_index(gpu)
        .unwrap_or_else(|e| fail(&format!("no GPU {gpu}"), e));
    let mut seen = std::collections::BTreeSet::new();
    let mut samples = Vec::new();
    let mut errors: BTreeMap<String, u64> = BTreeMap::new();
    // From a second back: the samples of work that started just before the watch began.
    let (mut polls, mut last) = (0u64, now_us().saturating_sub(1_000_000));
    let t0 = Instant::now();
    while t0.elapsed().as_secs_f64() < secs {
        polls += 1;
        match dev.process_utilization_stats(last) {
            Ok(v) => {
                for s in v {
                    last = last.max(s.timestamp);
                    if seen.insert((s.pid, s.timestamp)) {
                        samples.push([
                            s.pid as u64,
                            s.timestamp,
                            s.sm_util as u64,
                            s.mem_util as u64,
                        ]);
                    }
                }
            }
            Err(nvml_wrapper::error::NvmlError::NotFound) => {}
            Err(e) => *errors.entry(e.to_string()).or_default() += 1,
        }
        std::thread::sleep(every);
    }
    samples.sort_by_key(|s| (s[1], s[0]));
    let out = serde_json::json!({
        "nvml_lib": lib, "gpu": gpu, "seconds": t0.elapsed().as_secs_f64(), "polls": polls,
        "every_ms": every.as_secs_f64() * 1e3, "errors": errors,
        "clock": "samples' timestamps are the driver's CPU time (µs since the Unix epoch)",
        "samples": samples,
    });
    println!("{}", serde_json::to_string(&out).unwrap());
}

static TERM: AtomicBool = AtomicBool::new(false);

extern "C" fn on_term(_: libc::c_int) {
    TERM.store(true, Ordering::Relaxed);
}

/// `--nvml-poll INTERVAL_MS`.
pub fn poll(args: &[String]) {
    let interval_ms: f64 = match opt(args, "--nvml-poll").map(|v| v.parse::<f64>()) {
        Some(Ok(v)) if v > 0.0 && v.is_finite() => v,
        other => {
            eprintln!(
                "coloc-bench: --nvml-poll wants a positive interval in ms, got {:?}",
                other.map(|r| r.map_err(|e| e.to_string()))
            );
            std::process::exit(2)
        }
    };
    let secs: f64 = opt(args, "--seconds")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    // SAFETY: installs an async-signal-safe handler (one atomic store).
    unsafe {
        libc::signal(libc::SIGTERM, on_term as *const () as libc::sighandler_t);
        libc::signal(libc::SIGINT, on_term as *const () as libc::sighandler_t);
    }
    let (lib, gpu, mut nvml) = open(args);
    let period = Duration::from_secs_f64(interval_ms / 1e3);
    let (mut procs_t, mut samples_t) = (Vec::new(), Vec::new());
    let (mut samples_ans, mut procs_ans) = (Answers::default(), Answers::default());
    let mut buf = Vec::new();
    let mut last_seen = now_us().saturating_sub(1_000_000);
    let t0 = Instant::now();
    let mut next = t0;
    while !TERM.load(Ordering::Relaxed) && (secs <= 0.0 || t0.elapsed().as_secs_f64() < secs) {
        let s = Instant::now();
        let p = nvml.processes(gpu);
        procs_t.push(s.elapsed().as_secs_f64() * 1e6);
        procs_ans.note(&p, p.as_ref().is_ok_and(|v| !v.is_empty()));
        buf.clear();
        let s = Instant::now();
        let r = nvml.samples(gpu, last_seen, &mut buf);
        samples_t.push(s.elapsed().as_secs_f64() * 1e6);
        samples_ans.note(&r, !buf.is_empty());
        for a in &buf {
            last_seen = last_seen.max(a.at_ns / 1000);
        }
        next += period;
        let now = Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        } else {
            next = now; // late: no catch-up burst
        }
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let out = serde_json::json!({
        "nvml_lib": lib, "gpu": gpu, "interval_ms": interval_ms, "seconds": elapsed,
        "polls": procs_ans.calls, "polls_per_s": procs_ans.calls as f64 / elapsed.max(1e-9),
        "cost_us": {"running_processes": summary(&procs_t), "process_utilization": summary(&samples_t)},
        "answers": {"running_processes": procs_ans.json(), "process_utilization": samples_ans.json(),
            "insufficient_size_retried": nvml.transient_answers()},
    });
    println!("{}", serde_json::to_string_pretty(&out).unwrap());
}
