//! `coloc-demo`: gpu-coloc's co-location on simulated GPUs, on any Linux host (no GPU, no
//! cluster). Not part of the product: it drives the product's binaries like a user would.
//!
//! Six scenarios run side by side for the same time, each on `--replicas` simulated GPUs
//! (default 3, so that every p99 rests on hundreds of requests), with the same online
//! request sequences in every scenario:
//!
//! | scenario   | workload                                              | shows                          |
//! |------------|-------------------------------------------------------|--------------------------------|
//! | `alone`    | online alone                                          | the latency online should get  |
//! | `offline`  | offline alone (one GPU)                               | offline's full speed           |
//! | `no-agent` | online + offline                                      | uncontrolled sharing           |
//! | `nvml`     | online + offline, the agent, NVML only                | gpu-coloc without the shim     |
//! | `doorbell` | online under `libcoloc_cuda.so` + offline, the agent  | gpu-coloc with the doorbell    |
//! | `gate`     | the same, offline under the shim too (`--gate`)       | doorbell + launch gate (K)     |
//! | `learned`  | the same, online waking the agent after 2 ms gaps     | the learned release window     |
//!
//! The agent runs with `--release learned`: a learned window applies only where online's
//! shim wakes the agent after gaps as short as the window's floor (`learned`'s GPUs);
//! elsewhere it releases after the idle window as before.
//! Offline keeps `--offline-queue-depth` kernels queued (16 by default: training
//! frameworks run far ahead of the GPU), so what runs after a stop is up to that many
//! kernels; the gate bounds it by the shim's in-flight budget (`COLOC_SHIM_INFLIGHT_MS` in
//! the environment, 0.5 ms per process and GPU by default) under K (`--gate-inflight`).
//!
//! Every workload submits through the CUDA driver API (`coloc-sim … --cuda`: `dlopen` of
//! the simulated `libcuda.so.1`, entry points through `cuGetProcAddress_v2`), offline work
//! is a stream of kernels (its drain is the kernels in flight), and the simulated driver
//! samples every `--sample-period-ms` (200 ms, as an H100's driver does). One real `coloc-agent
//! run` manages the `nvml` and `doorbell` GPUs, loading the fake NVML library through its
//! normal NVML path; processes, signals (or cgroups) and the dynamic linker are real. The
//! agent and every workload are stopped on the way out, also when the demo fails.

mod memory;

use anyhow::{bail, Context, Result};
use clap::Parser;
use coloc_agent::control::events::{parse_log, Event};
use coloc_agent::control::state::StateDoc;
use coloc_agent::edges::actuator::Kind;
use coloc_agent::edges::cgroupfs::CgroupMounts;
use coloc_sim::command_in_cgroup;
use qos_core::stats::percentile;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// gpu-coloc demo: online and offline workloads on simulated GPUs, without the agent, with
/// the agent on NVML alone, and with the CUDA shim's doorbell; then a table of online
/// latency and offline progress, and a timeline picture.
#[derive(Parser, Debug, Clone)]
#[command(version, about, long_about = None)]
pub struct DemoArgs {
    /// Which world to run: `demo` (online at `--online-rate` × `--online-work-ms`, 2/s ×
    /// 20 ms by default), `harness` (the GPU harness's online service: 30/s × 1 ms, beside
    /// offline kernels of `--offline-step-ms`), or `both`, one after the other, each with
    /// its table.
    #[arg(long, value_enum, default_value_t = World::Both)]
    pub world: World,
    /// How long each workload runs, seconds (default: 90 for one world, 45 per world with
    /// `--world both`).
    #[arg(long)]
    pub duration_s: Option<f64>,
    /// GPUs per scenario (the scenarios' request counts add up over them; at most 3, as
    /// the simulator has 24 GPUs).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=3))]
    pub replicas: u32,
    /// The release of the `learned` scenario: `learned` (the agent's `--release learned`,
    /// a window learned from online's gaps, online waking the agent after 2 ms gaps) or
    /// `at-once` (`--release at-once`: release as soon as online's work is stamped
    /// complete, the agent polling pages every 100 µs while it awaits a stamp, online
    /// waking it after 0.2 ms gaps). Elsewhere the idle window.
    #[arg(long, value_enum, default_value_t = DemoRelease::Learned)]
    pub release: DemoRelease,
    /// Actuator the agent uses (freezer puts offline work in cgroups of its own; needs root).
    #[arg(long, value_enum, default_value_t = Kind::Signal)]
    pub actuator: Kind,
    /// Online requests per second per GPU (Poisson arrivals): 2 leaves the GPU idle 96 %
    /// of the time; an inference service under load is nearer 15-25 (70-50 % idle), where
    /// a 100 ms window seldom runs out between requests and the learned window matters.
    #[arg(long, default_value_t = 2.0)]
    pub online_rate: f64,
    /// GPU time per online request, ms.
    #[arg(long, default_value_t = 20.0)]
    pub online_work_ms: f64,
    /// GPU time per offline kernel, ms (what keeps running after a stop: the drain).
    #[arg(long, default_value_t = 2.0)]
    pub offline_step_ms: f64,
    /// Kernels the offline application keeps queued (all of them keep running after a
    /// SIGSTOP or a freeze; the gate lets at most K run).
    #[arg(long, default_value_t = 16)]
    pub offline_queue_depth: u32,
    /// K for the `gate` scenario: a ceiling on submissions in flight per stream (0 =
    /// unbounded; the shim's default 64). The shim's time budget sets the bound
    /// (`COLOC_SHIM_INFLIGHT_MS` in the environment, 0.5 ms unless set; 0: K alone).
    #[arg(long, default_value_t = 64)]
    pub gate_inflight: u32,
    /// Simulated driver sample period, ms (also the agent's --nvml-sample-period); 200 ms
    /// as measured on an H100 (driver 580).
    #[arg(long, default_value_t = 200.0)]
    pub sample_period_ms: f64,
    /// The simulated GPU's time slice, µs: a context with work keeps the GPU this long
    /// once another has work (2400: an H100's measured wait of a tiny kernel beside a
    /// training loop); 0: processor sharing instead (`coloc-sim gpu --timeslice-us`).
    #[arg(long, default_value_t = 2400)]
    pub timeslice_us: u64,
    /// Agent idle window.
    #[arg(long, default_value = "100ms", value_parser = coloc_agent::cli::parse_duration)]
    pub idle_window: Duration,
    /// The agent's --cpu-wake-latency while the demo runs: idle CPUs are kept in states
    /// they leave within this long (a PM QoS request on /dev/cpu_dma_latency, for the
    /// whole machine, withdrawn when the agent exits; 0: idle CPUs poll instead of
    /// halting). `off`: no request, as the agent does unless asked. On a VM whose idle
    /// vCPUs halt, most of the doorbell's tail is the host running the halted vCPU again
    /// (benches/RESULTS.md); needs root, else the agent logs an error and runs without it.
    #[arg(long, default_value = "0", value_parser = parse_wake)]
    pub cpu_wake_latency: WakeRequest,
    /// Directory for the workloads' results, the agent's log and event log (default: a
    /// new directory under /tmp).
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
    /// Write the summary as JSON to this file as well.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Run the memory demo instead: an online service that needs GPU memory two offline
    /// jobs hold, on a GPU nothing manages and on one where the agent gives it memory
    /// (`--memory-reserve`: the largest job checkpointed, the other held by the driver's
    /// lock, the job restored once online has left). About 35 s.
    #[arg(long)]
    pub memory: bool,
    /// With --memory: what the simulated driver's checkpoint costs, ms per GB (0.6 s per GB
    /// was measured on an H100).
    #[arg(long, default_value_t = 600, requires = "memory")]
    pub checkpoint_ms_per_gb: u64,
    /// With --memory: what a restore costs, ms per GB (0.2 s per GB on an H100).
    #[arg(long, default_value_t = 200, requires = "memory")]
    pub restore_ms_per_gb: u64,
}

/// `--world`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum World {
    /// Online at --online-rate × --online-work-ms.
    Demo,
    /// Online at 30 requests/s × 1 ms, as the GPU harness runs it.
    Harness,
    /// The demo's world, then the harness's.
    Both,
}

impl DemoArgs {
    /// How long each workload runs, seconds.
    pub fn duration(&self) -> f64 {
        self.duration_s.unwrap_or(if self.world == World::Both {
            45.0
        } else {
            90.0
        })
    }

    /// These arguments for one world: the harness's sets online's rate and work.
    fn for_world(&self, world: World) -> DemoArgs {
        let mut a = self.clone();
        a.duration_s = Some(self.duration());
        a.world = world;
        if world == World::Harness {
            a.online_rate = 30.0;
            a.online_work_ms = 1.0;
        }
        if self.world == World::Both {
            let name = if world == World::Harness {
                "harness"
            } else {
                "demo"
            };
            a.out_dir = self.out_dir.as_ref().map(|d| d.join(name));
        }
        a
    }
}

/// `--cpu-wake-latency`: a duration, or `off`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum WakeRequest {
    Off,
    Within(Duration),
}

/// The kernel's CPU latency limit as read, or "none" for its default (2000 s, no request).
fn in_force_text(v: Option<i32>) -> String {
    match v {
        None => "unreadable".into(),
        Some(v) if v >= coloc_agent::sched::NO_CPU_LATENCY_REQUEST_US => "none".into(),
        Some(v) => format!("{v} µs"),
    }
}

fn parse_wake(s: &str) -> Result<WakeRequest> {
    if s.trim() == "off" {
        return Ok(WakeRequest::Off);
    }
    Ok(WakeRequest::Within(coloc_agent::cli::parse_duration(s)?))
}

/// The scenarios, in GPU order (`offline` has one GPU, the others `--replicas`).
const SCENARIOS: [&str; 7] = [
    "alone", "offline", "no-agent", "nvml", "doorbell", "gate", "learned",
];

/// The learned window's floor the demo gives the agent (its default), and the wake gap of
/// the `learned` scenario's online shim.
const RELEASE_FLOOR_MS: f64 = 2.0;

/// With `--release at-once`: the wake gap of the `learned` scenario's online shim, and the
/// floor the agent checks it against.
const AT_ONCE_WAKE_MS: f64 = 0.2;

/// The `learned` scenario's release (`--release`).
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum DemoRelease {
    /// A window learned from online's own gaps.
    Learned,
    /// At once, where the doorbell and the gate make it safe.
    AtOnce,
}

impl DemoRelease {
    /// The online shim's wake gap in the `learned` scenario, ms (also the agent's floor).
    fn wake_ms(self) -> f64 {
        match self {
            DemoRelease::Learned => RELEASE_FLOOR_MS,
            DemoRelease::AtOnce => AT_ONCE_WAKE_MS,
        }
    }
}

/// GPUs of each scenario.
fn layout(replicas: u32) -> Vec<(&'static str, Vec<u32>)> {
    let mut next = 0;
    SCENARIOS
        .iter()
        .map(|s| {
            let n = if *s == "offline" { 1 } else { replicas };
            let g: Vec<u32> = (next..next + n).collect();
            next += n;
            (*s, g)
        })
        .collect()
}

/// Finds a sibling binary of the running executable (same cargo target directory).
fn sibling(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe.parent().context("executable has no directory")?;
    let p = dir.join(name);
    if !p.exists() {
        bail!(
            "{} not found next to {}: build the whole workspace first \
             (cargo build --release --workspace)",
            name,
            exe.display()
        );
    }
    Ok(p)
}

/// Children stopped on the way out, the demo's error paths included: SIGTERM (the agent
/// resumes offline work before it exits), then SIGKILL after 5 s.
struct Kill(Vec<Child>);
impl Drop for Kill {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(c.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        for c in &mut self.0 {
            while matches!(c.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            if matches!(c.try_wait(), Ok(None)) {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// The fake NVML library, the agent and the simulated `libcuda.so.1`'s directory, next to
/// this executable.
fn agent_binaries() -> Result<(PathBuf, PathBuf, PathBuf)> {
    let fake = sibling("libfake_nvml.so")?;
    let me = sibling("coloc-agent")?;
    let bin_dir = me.parent().context("binary directory")?.to_path_buf();
    let cuda_dir = coloc_sim::fake_libcuda_dir(&bin_dir)
        .context("the simulated libcuda.so.1 (cargo build --release --workspace)")?;
    Ok((fake, me, cuda_dir))
}

/// `--out-dir`, or a new directory `{prefix}-{pid}` under the temporary directory; made.
fn out_dir(a: &DemoArgs, prefix: &str) -> Result<PathBuf> {
    let out = match &a.out_dir {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("{prefix}-{}", std::process::id())),
    };
    std::fs::create_dir_all(&out)?;
    Ok(out)
}

/// `coloc-agent run` as the demos start it: the fake NVML library, `rules`, its state and
/// doorbell directories beside the simulated GPU's `state` file, events to `events`, its
/// HTTP endpoints on `listen`.
fn agent_command(
    me: &Path,
    fake: &Path,
    rules: &Path,
    state: &Path,
    events: &Path,
    actuator: Kind,
    listen: &str,
) -> Command {
    let mut c = Command::new(me);
    c.args(["run", "--listen", listen, "--actuator", actuator.as_str()])
        .arg("--rules")
        .arg(rules)
        .arg("--nvml-lib")
        .arg(fake)
        .arg("--state-dir")
        .arg(state.with_extension("agent"))
        .arg("--event-log")
        .arg(events)
        .arg("--doorbell-dir")
        .arg(state.with_extension("bells"))
        .env("COLOC_SIM_STATE", state);
    c
}

/// Starts the simulated GPU (`cmd`: `coloc-sim gpu …`) on `state` and waits until its state
/// file is written; it is stopped when the answer is dropped.
fn start_sim(mut cmd: Command, state: &Path) -> Result<Kill> {
    let procs = Kill(vec![cmd
        .env("COLOC_SIM_STATE", state)
        .stderr(Stdio::null())
        .spawn()?]);
    let t0 = Instant::now();
    while std::fs::metadata(state)
        .map(|m| m.len() == 0)
        .unwrap_or(true)
    {
        if t0.elapsed() > Duration::from_secs(5) {
            bail!("simulated GPU did not start");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(procs)
}

fn read_json(p: &Path) -> Result<Value> {
    let b = std::fs::read(p).with_context(|| format!("reading {}", p.display()))?;
    Ok(serde_json::from_slice(&b)?)
}

fn pct(mut v: Vec<f64>, q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    percentile(&v, q).unwrap_or(f64::NAN)
}

fn main() {
    if let Err(err) = run_worlds(DemoArgs::parse()) {
        eprintln!("coloc-demo: {err:#}");
        std::process::exit(1);
    }
}

/// Runs the world or worlds `--world` names; with `--json`, one summary (one world) or
/// `{"demo": …, "harness": …}` (both).
fn run_worlds(a: DemoArgs) -> Result<()> {
    if a.memory {
        return memory::run(&a);
    }
    let summary = match a.world {
        World::Both => {
            println!(
                "== the demo's world: {}/s x {} ms online beside {} ms offline kernels",
                a.online_rate, a.online_work_ms, a.offline_step_ms
            );
            let demo = run(a.for_world(World::Demo))?;
            println!();
            println!(
                "== the GPU harness's world: 30/s x 1 ms online beside {} ms offline kernels",
                a.offline_step_ms
            );
            let harness = run(a.for_world(World::Harness))?;
            serde_json::json!({ "demo": demo, "harness": harness })
        }
        w => run(a.for_world(w))?,
    };
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_vec_pretty(&summary)?)?;
    }
    Ok(())
}

/// Runs one world of the demo, prints its table and returns its summary.
fn run(a: DemoArgs) -> Result<Value> {
    let sim = sibling("coloc-sim")?;
    let shim = sibling("libcoloc_cuda.so")?;
    let (fake, me, cuda_dir) = agent_binaries()?;
    let id = std::process::id();
    let out = out_dir(&a, "coloc-demo")?;
    let shm = Path::new("/dev/shm");
    let state = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        out.clone()
    }
    .join(format!("coloc-demo-{id}"));
    // Doorbell pages in memory (tmpfs), as on a node (/run/gpu-coloc/doorbells): a page on
    // a disk-backed file can make the shim's write wait for the filesystem when writeback
    // runs, delaying the ring by milliseconds.
    let bells = state.with_extension("bells");
    let lay = layout(a.replicas);
    let gpus_of = |s: &str| {
        lay.iter()
            .find(|l| l.0 == s)
            .map(|l| l.1.clone())
            .unwrap_or_default()
    };
    let managed: Vec<u32> = [
        gpus_of("nvml"),
        gpus_of("doorbell"),
        gpus_of("gate"),
        gpus_of("learned"),
    ]
    .concat();
    let gate_file = state.with_extension("gate").join("gates");
    let n_gpus: u32 = lay.iter().map(|l| l.1.len() as u32).sum();

    // Offline work on a managed GPU goes in a cgroup of its own when the freezer is used.
    let mut cgroups: Vec<PathBuf> = Vec::new();
    let mut cgroup_base: Option<PathBuf> = None;
    let mut rules = String::from("# coloc-agent demo rules\n");
    if a.actuator == Kind::Freezer {
        let mounts = CgroupMounts::detect(Path::new("/sys/fs/cgroup"));
        let base = mounts
            .v2
            .or(mounts.v1_freezer)
            .context("--actuator freezer: no cgroup v2 or v1 freezer under /sys/fs/cgroup")?;
        rules += &format!(
            "[[rule]]\nname = \"demo-offline\"\nclass = \"reclaimed_cores\"\ncgroup = \"/coloc-demo-{id}-g*\"\n"
        );
        cgroup_base = Some(base);
    } else {
        rules += "[[rule]]\nname = \"demo-offline\"\nclass = \"reclaimed_cores\"\ncmdline = \"*coloc-sim offline*\"\n";
    }
    rules += "[[rule]]\nname = \"demo-online\"\nclass = \"shared_cores\"\ncmdline = \"*coloc-sim online*\"\n";
    let rules_path = out.join("rules.toml");
    std::fs::write(&rules_path, rules)?;

    println!(
        "gpu-coloc demo: {n_gpus} simulated GPUs (driver samples every {} ms), {} s, actuator {}, results in {}",
        a.sample_period_ms,
        a.duration(),
        a.actuator.as_str(),
        out.display()
    );
    let mut gpu = Command::new(&sim);
    gpu.args(["gpu", "--gpus", &n_gpus.to_string(), "--sample-period-ms"])
        .arg(a.sample_period_ms.to_string())
        .arg("--timeslice-us")
        .arg(a.timeslice_us.to_string());
    let procs = start_sim(gpu, &state)?;
    std::thread::sleep(Duration::from_millis(100));

    let events = out.join("events.jsonl");
    let _ = std::fs::remove_file(&events);
    let agent_log = std::fs::File::create(out.join("agent.log"))?;
    let managed_s: Vec<String> = managed.iter().map(u32::to_string).collect();
    // A port of its own, so that the demo can read what the agent says it earned.
    let listen = format!(
        "127.0.0.1:{}",
        std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port()
    );
    let agent = agent_command(
        &me,
        &fake,
        &rules_path,
        &state,
        &events,
        a.actuator,
        &listen,
    )
    .arg("--gpus")
    .arg(managed_s.join(","))
    .arg("--gate")
    .arg("--gate-file")
    .arg(&gate_file)
    .arg("--nvml-sample-period")
    .arg(format!("{}us", (a.sample_period_ms * 1000.0) as u64))
    .arg("--idle-window")
    .arg(format!("{}us", a.idle_window.as_micros()))
    // A wrong release costs online what the gate leaves in flight: the shim's budget
    // (0.5 ms), or one kernel when kernels are longer.
    .args([
        "--release",
        match a.release {
            DemoRelease::Learned => "learned",
            DemoRelease::AtOnce => "at-once",
        },
        "--release-floor",
    ])
    .arg(format!("{}us", (a.release.wake_ms() * 1e3) as u64))
    .args(match a.release {
        DemoRelease::Learned => vec![],
        DemoRelease::AtOnce => vec!["--poll-interval", "100us"],
    })
    .arg("--release-drain")
    .arg(format!("{}us", (a.offline_step_ms.max(0.5) * 1e3) as u64))
    .args(match a.cpu_wake_latency {
        WakeRequest::Off => vec![],
        WakeRequest::Within(d) => {
            vec![
                "--cpu-wake-latency".to_string(),
                format!("{}us", d.as_micros()),
            ]
        }
    })
    .env("COLOC_SIM_STATE", &state)
    .stderr(agent_log)
    .spawn()
    .context("starting the agent")?;
    let mut agent = Kill(vec![agent]);
    std::thread::sleep(Duration::from_millis(500));
    if let Some(st) = agent.0[0].try_wait()? {
        bail!(
            "agent exited at start ({st}); see {}",
            out.join("agent.log").display()
        );
    }

    // What the kernel enforces with the agent running (the lowest request of any holder).
    let in_force =
        coloc_agent::sched::cpu_latency_in_force(Path::new(coloc_agent::sched::CPU_LATENCY_DEVICE))
            .ok();
    let refused = std::fs::read_to_string(out.join("agent.log"))
        .is_ok_and(|l| l.contains("Cannot hold the CPU wake-up latency request"));
    match (a.cpu_wake_latency, in_force) {
        (WakeRequest::Within(d), v) if refused => println!(
            "CPU wake-up latency: the agent could not hold {} µs (in force: {}; see {})",
            d.as_micros(),
            in_force_text(v),
            out.join("agent.log").display()
        ),
        (WakeRequest::Off, v) => println!(
            "CPU wake-up latency: no request from the agent (in force: {})",
            in_force_text(v)
        ),
        (WakeRequest::Within(d), Some(v)) if i64::from(v) <= d.as_micros() as i64 => println!(
            "CPU wake-up latency: the agent holds {} µs (in force: {v} µs{}; `--cpu-wake-latency off` runs without)",
            d.as_micros(),
            if v == 0 { ", idle CPUs poll" } else { "" }
        ),
        (WakeRequest::Within(d), v) => println!(
            "CPU wake-up latency: the agent asked for {} µs but {} is in force (no root? see {})",
            d.as_micros(),
            in_force_text(v),
            out.join("agent.log").display()
        ),
    }

    let dur = a.duration().to_string();
    let cuda = |c: &mut Command| {
        c.arg("--cuda")
            .env("LD_LIBRARY_PATH", &cuda_dir)
            .env("COLOC_SIM_STATE", &state);
    };
    let online = |gpu: u32, replica: u32, name: &str, doorbell: Option<f64>| -> Result<Child> {
        let mut c = Command::new(&sim);
        c.args(["online", "--gpu", &gpu.to_string(), "--duration-s", &dur])
            .args(["--seed", &(7 + replica).to_string()])
            .args(["--rate", &a.online_rate.to_string()])
            .args(["--work-ms", &a.online_work_ms.to_string()])
            .arg("--out")
            .arg(out.join(name));
        cuda(&mut c);
        if let Some(wake_gap_ms) = doorbell {
            c.env("LD_PRELOAD", &shim)
                .env("COLOC_SHIM_CLASS", "online")
                .env("COLOC_DOORBELL_DIR", &bells)
                .env("COLOC_SHIM_WAKE_GAP_MS", wake_gap_ms.to_string());
        }
        Ok(c.spawn()?)
    };
    let offline = |gpu: u32, name: &str, cgroup: Option<&Path>, gated: bool| -> Result<Child> {
        let mut c = match cgroup {
            Some(cg) => command_in_cgroup(cg, &sim),
            None => Command::new(&sim),
        };
        c.args(["offline", "--gpu", &gpu.to_string(), "--duration-s", &dur])
            .args(["--step-ms", &a.offline_step_ms.to_string()])
            .args(["--queue-depth", &a.offline_queue_depth.to_string()])
            .arg("--out")
            .arg(out.join(name));
        cuda(&mut c);
        if gated {
            c.env("LD_PRELOAD", &shim)
                .env("COLOC_SHIM_CLASS", "offline")
                .env("COLOC_DOORBELL_DIR", &bells)
                .env("COLOC_GATE_FILE", &gate_file)
                .env("COLOC_SHIM_INFLIGHT", a.gate_inflight.to_string());
        }
        Ok(c.spawn()?)
    };
    let mut work = Vec::new();
    for (scenario, gpus) in &lay {
        for (i, g) in gpus.iter().enumerate() {
            let i = i as u32;
            if *scenario != "offline" {
                let window_ms = a.idle_window.as_secs_f64() * 1e3;
                let wake_gap = match *scenario {
                    "doorbell" | "gate" => Some(window_ms),
                    "learned" => Some(a.release.wake_ms()),
                    _ => None,
                };
                work.push(online(
                    *g,
                    i,
                    &format!("online-{scenario}-{i}.json"),
                    wake_gap,
                )?);
            }
            if *scenario != "alone" {
                let cg = match &cgroup_base {
                    Some(base) if managed.contains(g) => {
                        let dir = base.join(format!("coloc-demo-{id}-g{g}"));
                        std::fs::create_dir_all(&dir).with_context(|| {
                            format!("creating cgroup {} (needs root)", dir.display())
                        })?;
                        cgroups.push(dir.clone());
                        Some(dir)
                    }
                    _ => None,
                };
                work.push(offline(
                    *g,
                    &format!("offline-{scenario}-{i}.json"),
                    cg.as_deref(),
                    matches!(*scenario, "gate" | "learned"),
                )?);
            }
        }
    }
    // Workloads end by themselves after the duration; never wait forever on one.
    let deadline = Instant::now() + Duration::from_secs_f64(a.duration() + 30.0);
    for w in &mut work {
        loop {
            if let Some(st) = w.try_wait()? {
                if !st.success() {
                    bail!("a workload failed ({st})");
                }
                break;
            }
            if Instant::now() > deadline {
                for w in &mut work {
                    let _ = w.kill();
                }
                bail!(
                    "workloads did not finish within {} s; results in {}",
                    a.duration() + 30.0,
                    out.display()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    // What co-location earned on the managed GPUs, as `coloc-agent status` prints it.
    let earned = coloc_agent::cmd::status::http_get(&format!("http://{listen}"), "/state")
        .and_then(|body| Ok(serde_json::from_str::<StateDoc>(&body)?))
        .map(|doc| {
            (
                coloc_agent::cmd::status::earned(&doc),
                doc.earned,
                doc.online_runs,
            )
        });
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent.0[0].id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )?;
    let mut child = agent.0.pop().context("agent")?;
    let st = child.wait()?;
    drop(procs);
    for cg in &cgroups {
        let _ = std::fs::remove_dir(cg);
    }
    // The agent has exited: its state directory, the pages and the gate file go with it.
    let _ = std::fs::remove_dir_all(&state);
    let _ = std::fs::remove_dir_all(state.with_extension("agent"));
    let _ = std::fs::remove_dir_all(&bells);
    let _ = std::fs::remove_dir_all(state.with_extension("gate"));
    if !st.success() {
        bail!(
            "agent exited with {st}; see {}",
            out.join("agent.log").display()
        );
    }

    let mut summary = summarize(&out, &events, &lay, a.duration())?;
    summary["online_rate"] = serde_json::json!(a.online_rate);
    summary["online_work_ms"] = serde_json::json!(a.online_work_ms);
    summary["offline_step_ms"] = serde_json::json!(a.offline_step_ms);
    let svg = out.join("timeline.svg");
    write_timeline(&out, &events, &lay, &svg)?;
    summary["timeline"] = serde_json::json!(svg.display().to_string());
    summary["cpu_wake_latency_us"] = match a.cpu_wake_latency {
        WakeRequest::Off => Value::Null,
        WakeRequest::Within(d) => serde_json::json!(d.as_micros() as u64),
    };
    summary["cpu_wake_latency_in_force_us"] = serde_json::json!(in_force);

    print_table(&summary, a.release);
    match earned {
        Ok((text, rows, runs)) => {
            // Every managed scenario's GPUs together (the agent counts per namespace).
            print!("{text}");
            summary["earned"] = serde_json::json!(rows);
            summary["online_runs"] = serde_json::json!(runs);
        }
        Err(err) => {
            println!("What co-location earned: the agent's /state could not be read ({err:#})")
        }
    }
    println!(
        "timeline (online busy, offline suspended, request latency): {}",
        svg.display()
    );
    Ok(summary)
}

/// Request latencies (ms) and busy time (ns) of a scenario's online workloads.
fn online_of(out: &Path, scenario: &str, n: usize) -> Result<(Vec<f64>, f64)> {
    let mut lat = Vec::new();
    let mut busy = 0.0;
    for i in 0..n {
        let v = read_json(&out.join(format!("online-{scenario}-{i}.json")))?;
        for r in v["records"].as_array().into_iter().flatten() {
            let (arr, start, done) = (
                r[0].as_f64().unwrap_or(0.0),
                r[1].as_f64().unwrap_or(0.0),
                r[2].as_f64().unwrap_or(0.0),
            );
            lat.push((done - arr) / 1e6);
            busy += done - start;
        }
    }
    Ok((lat, busy))
}

/// Mean offline kernels per second over a scenario's GPUs.
fn offline_of(out: &Path, scenario: &str, n: usize) -> Result<f64> {
    let mut sum = 0.0;
    for i in 0..n {
        sum += read_json(&out.join(format!("offline-{scenario}-{i}.json")))?["steps_per_s"]
            .as_f64()
            .unwrap_or(0.0);
    }
    Ok(sum / n.max(1) as f64)
}

/// Reads the workloads' results and the agent's event log into one summary.
fn summarize(
    out: &Path,
    events: &Path,
    lay: &[(&'static str, Vec<u32>)],
    duration_s: f64,
) -> Result<Value> {
    let n = |s: &str| lay.iter().find(|l| l.0 == s).map_or(0, |l| l.1.len());
    let evs = parse_log(&std::fs::read_to_string(events).unwrap_or_default());
    let (alone_lat, alone_busy) = online_of(out, "alone", n("alone"))?;
    // Share of the time online leaves the GPU idle, from the online-alone runs.
    let idle_fraction = (1.0 - alone_busy / (duration_s * 1e9 * n("alone") as f64)).clamp(0.0, 1.0);
    let off_alone = offline_of(out, "offline", 1)?;
    let alone_p99 = pct(alone_lat.clone(), 99.0);
    let mut rows = serde_json::Map::new();
    rows.insert(
        "alone".into(),
        serde_json::json!({"requests": alone_lat.len(), "p50_ms": pct(alone_lat.clone(), 50.0), "p99_ms": alone_p99, "p99_vs_alone": 1.0}),
    );
    rows.insert(
        "offline".into(),
        serde_json::json!({"offline_steps_per_s": off_alone}),
    );
    let fail_opens = evs
        .iter()
        .filter(|e| matches!(e, Event::FailOpen(_)))
        .count();
    for s in ["no-agent", "nvml", "doorbell", "gate", "learned"] {
        let (lat, _) = online_of(out, s, n(s))?;
        let off = offline_of(out, s, n(s))?;
        let gpus = lay
            .iter()
            .find(|l| l.0 == s)
            .map(|l| l.1.clone())
            .unwrap_or_default();
        let ms = |v: Option<f64>| v.map(|x| x * 1e3);
        let mut pre = Vec::new();
        let mut det = Vec::new();
        let mut rel = Vec::new();
        let (mut learned, mut fixed) = (0usize, 0usize);
        let mut signals = std::collections::BTreeMap::<&str, usize>::new();
        // Detections over 200 µs: the loop was in a tick at the onset, or asleep and
        // woken late (the machine's wake-up latency; `coloc-bench --wake-floor`).
        let (mut slow_busy, mut slow_asleep) = (0usize, 0usize);
        for e in &evs {
            match e {
                Event::Preempt(p) if gpus.contains(&p.gpu) => {
                    det.push(p.detection_s * 1e3);
                    if p.detection_s > 200e-6 {
                        match p.slept_ns {
                            Some(slept) if p.onset_ns >= slept => slow_asleep += 1,
                            _ => slow_busy += 1,
                        }
                    }
                    pre.extend(ms(p.preemption_s));
                    *signals.entry(p.signal.as_str()).or_default() += 1;
                }
                Event::Release(r) if gpus.contains(&r.gpu) => {
                    rel.extend(ms(r.release_s));
                    if r.learned {
                        learned += 1;
                    } else {
                        fixed += 1;
                    }
                }
                _ => {}
            }
        }
        let p99 = pct(lat.clone(), 99.0);
        rows.insert(
            s.into(),
            serde_json::json!({
                "requests": lat.len(),
                "p50_ms": pct(lat.clone(), 50.0),
                "p99_ms": p99,
                "p99_vs_alone": p99 / alone_p99.max(1e-9),
                "offline_steps_per_s": off,
                "offline_share_of_idle": off / (off_alone * idle_fraction).max(1e-9),
                "preemptions": pre.len(),
                "signals": signals,
                "preemption_ms": {"p50": pct(pre.clone(), 50.0), "p99": pct(pre, 99.0)},
                "detection_ms": {"p50": pct(det.clone(), 50.0), "p99": pct(det, 99.0)},
                "detection_over_200us": {"loop_busy": slow_busy, "woken_late": slow_asleep},
                "release_ms": {"p50": pct(rel.clone(), 50.0), "p99": pct(rel, 99.0)},
                "releases": {"learned": learned, "fixed": fixed},
            }),
        );
    }
    Ok(serde_json::json!({
        "scenarios": rows,
        "online_idle_fraction": idle_fraction,
        "fail_opens": fail_opens,
    }))
}

fn print_table(s: &Value, release: DemoRelease) {
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    let r = |name: &str| &s["scenarios"][name];
    println!();
    println!(
        "{:<30} {:>8} {:>10} {:>10} {:>8} {:>12} {:>9}",
        "scenario", "requests", "online p50", "online p99", "vs alone", "offline k/s", "of idle"
    );
    let labels = [
        ("alone", "online alone"),
        ("offline", "offline alone"),
        ("no-agent", "online + offline, no agent"),
        ("nvml", "gpu-coloc, NVML only"),
        ("doorbell", "gpu-coloc, doorbell (shim)"),
        ("gate", "gpu-coloc, doorbell + gate"),
        (
            "learned",
            match release {
                DemoRelease::Learned => "gpu-coloc, + learned release",
                DemoRelease::AtOnce => "gpu-coloc, + release at once",
            },
        ),
    ];
    for (k, label) in labels {
        let row = r(k);
        let opt = |v: &Value, unit: &str, prec: usize| {
            if v.is_null() {
                "-".to_string()
            } else {
                format!("{:.*}{unit}", prec, f(v))
            }
        };
        println!(
            "{:<30} {:>8} {:>10} {:>10} {:>8} {:>12} {:>9}",
            label,
            opt(&row["requests"], "", 0),
            opt(&row["p50_ms"], " ms", 1),
            opt(&row["p99_ms"], " ms", 1),
            opt(&row["p99_vs_alone"], "x", 2),
            opt(&row["offline_steps_per_s"], "", 1),
            if row["offline_share_of_idle"].is_null() {
                "-".to_string()
            } else {
                format!("{:.0} %", 100.0 * f(&row["offline_share_of_idle"]))
            },
        );
    }
    println!();
    println!(
        "online leaves the GPU idle {:.0} % of the time; 'of idle': offline's progress over (offline alone x that share)",
        100.0 * f(&s["online_idle_fraction"])
    );
    for (k, label) in [
        ("nvml", "NVML only"),
        ("doorbell", "doorbell"),
        ("gate", "gate"),
        ("learned", "learned"),
    ] {
        let row = r(k);
        println!(
            "{label:>10}: {} preemptions {}, detection p50 {:.2} ms p99 {:.2} ms, preemption p50 {:.2} ms p99 {:.2} ms (from onset), release p99 {:.2} ms",
            row["preemptions"],
            row["signals"],
            f(&row["detection_ms"]["p50"]),
            f(&row["detection_ms"]["p99"]),
            f(&row["preemption_ms"]["p50"]),
            f(&row["preemption_ms"]["p99"]),
            f(&row["release_ms"]["p99"]),
        );
    }
    let rel = &r("learned")["releases"];
    println!(
        "   learned: releases by a learned window {}, by the idle window {}",
        rel["learned"], rel["fixed"]
    );
    for (k, label) in [("doorbell", "doorbell"), ("gate", "gate")] {
        let slow = &r(k)["detection_over_200us"];
        println!(
            "{label:>10}: detections over 200 µs: {} with the loop inside a tick at the launch, {} with the loop asleep and woken late",
            slow["loop_busy"], slow["woken_late"],
        );
    }
}

/// Writes the demo's timeline picture: the first doorbell GPU's busy/suspended periods
/// from the agent's event log, and online request latency there and without the agent.
fn write_timeline(
    out: &Path,
    events: &Path,
    lay: &[(&'static str, Vec<u32>)],
    svg: &Path,
) -> Result<()> {
    let evs = parse_log(&std::fs::read_to_string(events).unwrap_or_default());
    let recs = |name: &str| -> Result<Vec<(u64, u64)>> {
        Ok(read_json(&out.join(name))?["records"]
            .as_array()
            .map(|r| {
                r.iter()
                    .map(|x| (x[0].as_u64().unwrap_or(0), x[2].as_u64().unwrap_or(0)))
                    .collect()
            })
            .unwrap_or_default())
    };
    let gpu = lay
        .iter()
        .find(|l| l.0 == "doorbell")
        .and_then(|l| l.1.first().copied())
        .unwrap_or(0);
    let (with, nvml, without) = (
        recs("online-doorbell-0.json")?,
        recs("online-nvml-0.json")?,
        recs("online-no-agent-0.json")?,
    );
    let t0 = with
        .first()
        .map(|r| r.0)
        .unwrap_or(0)
        .saturating_sub(200_000_000);
    // The first 20 s at most: a picture, not a log.
    let t1 = (with.last().map(|r| r.1).unwrap_or(t0) + 200_000_000).min(t0 + 20_000_000_000);
    let doc = coloc_agent::cmd::timeline::svg(
        &format!("gpu-coloc demo: GPU {gpu} (online under the shim + offline, agent managing)"),
        &evs,
        gpu,
        &[
            ("online, gpu-coloc with doorbell", "#1f77b4", &with),
            ("online, gpu-coloc NVML only", "#ff7f0e", &nvml),
            ("online, no agent", "#999999", &without),
        ],
        t0,
        t1,
    );
    std::fs::write(svg, doc).with_context(|| format!("writing {}", svg.display()))
}
