//! The control loop: sample → classify → decide → act, every poll interval.
//!
//! ```text
//!   GpuSampler ──samples──►┐
//!   (NVML, 1 ms)           │            qos_core::Machine           actuator::apply
//!   GpuSampler ──procs────►├─► table ──► tick(now, per-GPU obs) ──► suspend / resume ──► Record
//!   (every 50 ms, or at    │   (pid →        │                      (record written
//!    once for a new pid)   │   class, pidfd, └─► transitions ──►     before acting)
//!   PodSource ──classify──►┘   target)           latency metrics, event log
//! ```
//!
//! Runs on its own OS thread so that its timing does not depend on the async runtime
//! serving HTTP. Fails open: on an NVML error, a record write error, shutdown, or a panic
//! (via `Drop`), every suspended process is resumed.

use crate::actuator::{self, CgroupMounts, Kind, Op, Outcome, RecordEntry, Target};
use crate::gpu::{GpuError, GpuSampler};
use crate::procinfo::{read_proc, read_stat, Cgroups, ProcKey};
use crate::record::Record;
use crate::source::{Classified, PodSource};
use qos_core::machine::Reason;
use qos_core::{Class, Decision, GpuInput, GpuState, Machine, ProcessObs, Transition};
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Write;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::{debug, error, info, warn};

/// Wall clock, ns since the Unix epoch (the clock of NVML's sample timestamps).
pub fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// Settings of the loop (validated by the CLI layer).
#[derive(Debug, Clone)]
pub struct LoopConfig {
    /// Utilisation sampling period while offline work is present.
    pub poll: Duration,
    /// Sampling period while no offline process is on any managed GPU.
    pub idle_poll: Duration,
    /// Running-process list period.
    pub process_interval: Duration,
    /// State machine settings.
    pub machine: qos_core::Config,
    /// Preferred actuator.
    pub actuator: Kind,
    /// Decide and report, never act.
    pub dry_run: bool,
    /// How long to wait for a suspend/resume to be confirmed.
    pub confirm_timeout: Duration,
    /// cgroup hierarchies.
    pub cgroups: CgroupMounts,
    /// JSON-lines log of every preemption and release, if set.
    pub event_log: Option<PathBuf>,
    /// Node name, for `/state`.
    pub node: String,
    /// Nice value of the control-loop thread (0: unchanged).
    pub loop_nice: i32,
}

/// State shared with the HTTP server.
#[derive(Debug, Default)]
pub struct Shared {
    /// The loop has completed a tick since start.
    pub ticked: AtomicBool,
    /// Wall time of the latest tick (ns).
    pub last_tick_ns: AtomicU64,
    /// NVML is failing: offline work has been resumed and nothing is suspended.
    pub degraded: AtomicBool,
    /// Set to stop the loop (it resumes everything first).
    pub stop: AtomicBool,
    /// The `/state` document.
    pub state: Mutex<serde_json::Value>,
    /// Per-GPU time accounting (fractional-second counters, rendered by `/metrics`).
    pub gpu_seconds: Mutex<BTreeMap<u32, GpuSeconds>>,
}

/// Fractional-second counters of one GPU.
#[derive(Debug, Default, Clone, Copy)]
pub struct GpuSeconds {
    /// Wall time with at least one offline process suspended.
    pub suspended: f64,
    /// Wall time with offline running while online was idle.
    pub reclaimed: f64,
}

impl Shared {
    /// Prometheus text for the fractional-second counters (the `metrics` crate's counters
    /// are integers).
    pub fn render_seconds(&self) -> String {
        let secs = self.gpu_seconds.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = String::new();
        for (name, help, get) in [
            ("coloc_offline_suspended_seconds_total", "Wall time during which at least one offline process on the GPU was suspended.", (|s: &GpuSeconds| s.suspended) as fn(&GpuSeconds) -> f64),
            ("coloc_offline_reclaimed_seconds_total", "Wall time during which offline work ran on the GPU while online work was idle (GPU time given back).", |s: &GpuSeconds| s.reclaimed),
        ] {
            out += &format!("# HELP {name} {help}\n# TYPE {name} counter\n");
            for (g, s) in secs.iter() {
                out += &format!("{name}{{gpu=\"{g}\"}} {}\n", get(s));
            }
        }
        out
    }
}

struct Entry {
    key: ProcKey,
    cls: Classified,
    cmd: String,
    gpus: BTreeSet<u32>,
    last_active: BTreeMap<u32, u64>,
    target: Option<Target>,
    generation: u64,
}

struct GpuMetrics {
    busy: metrics::Gauge,
    suspended: metrics::Gauge,
    detection: metrics::Histogram,
    actuation: BTreeMap<&'static str, metrics::Histogram>,
    preemption: BTreeMap<&'static str, metrics::Histogram>,
    release: BTreeMap<&'static str, metrics::Histogram>,
}

impl GpuMetrics {
    fn new(gpu: u32, actuator: &'static str) -> GpuMetrics {
        let g = gpu.to_string();
        let per_actuator = |name: &'static str| {
            [Kind::Freezer, Kind::Signal]
                .iter()
                .map(|k| {
                    (
                        k.as_str(),
                        metrics::histogram!(name, "gpu" => g.clone(), "actuator" => k.as_str()),
                    )
                })
                .collect()
        };
        GpuMetrics {
            busy: metrics::gauge!("coloc_gpu_online_busy", "gpu" => g.clone()),
            suspended: metrics::gauge!("coloc_offline_suspended_processes", "gpu" => g.clone()),
            detection: metrics::histogram!("coloc_detection_latency_seconds", "gpu" => g.clone(), "actuator" => actuator),
            actuation: per_actuator("coloc_actuation_latency_seconds"),
            preemption: per_actuator("coloc_preemption_latency_seconds"),
            release: per_actuator("coloc_release_latency_seconds"),
        }
    }
}

/// The control loop's state.
pub struct Agent {
    cfg: LoopConfig,
    sampler: Box<dyn GpuSampler>,
    source: Arc<dyn PodSource>,
    machine: Machine<ProcKey>,
    procs: HashMap<u32, Entry>,
    last_seen_us: BTreeMap<u32, u64>,
    /// Suspended targets and the processes that hold each one suspended.
    held: BTreeMap<RecordEntry, (Target, BTreeSet<ProcKey>)>,
    record: Record,
    shared: Arc<Shared>,
    next_refresh: Instant,
    last_tick: Option<Instant>,
    last_state_publish: Instant,
    self_cgroups: Cgroups,
    event_log: Option<std::fs::File>,
    gpu_metrics: BTreeMap<u32, GpuMetrics>,
    warned: BTreeSet<String>,
    lag: metrics::Histogram,
    /// Latest preemption/release events (for `/state`, `status --plot`).
    recent: std::collections::VecDeque<serde_json::Value>,
    history: BTreeMap<u32, GpuHistory>,
}

/// Recent latencies of one GPU, for `/state` and `coloc-agent status`.
#[derive(Debug, Default)]
struct GpuHistory {
    last_preempt_ns: Option<u64>,
    preemption_ms: std::collections::VecDeque<f64>,
    release_ms: std::collections::VecDeque<f64>,
}

fn push_bounded<T>(q: &mut std::collections::VecDeque<T>, v: T, cap: usize) {
    if q.len() == cap {
        q.pop_front();
    }
    q.push_back(v);
}

fn summary(v: &std::collections::VecDeque<f64>) -> serde_json::Value {
    let mut s: Vec<f64> = v.iter().copied().collect();
    s.sort_by(f64::total_cmp);
    let p = |q: f64| -> Option<f64> {
        if s.is_empty() {
            return None;
        }
        let rank = ((q / 100.0) * s.len() as f64).ceil() as usize;
        Some(s[rank.clamp(1, s.len()) - 1])
    };
    json!({"count": s.len(), "p50": p(50.0), "p90": p(90.0), "p99": p(99.0), "max": s.last()})
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("procs", &self.procs.len())
            .finish()
    }
}

/// Describes what happened to leftovers of a previous run.
pub fn resume_leftovers(record: &mut Record, leftover: &[RecordEntry], timeout: Duration) {
    for e in leftover {
        let outcome = actuator::resume_recorded(e, timeout);
        match &outcome {
            Outcome::Done => info!(entry = ?e, "Resumed work a previous run left suspended"),
            Outcome::Gone => info!(entry = ?e, "Work a previous run suspended is gone"),
            Outcome::Failed(err) => {
                error!(entry = ?e, %err, "Failed to resume work a previous run left suspended");
                metrics::counter!("coloc_actuation_errors_total", "actuator" => "record", "op" => "resume", "reason" => err.reason()).increment(1);
            }
        }
        if !matches!(outcome, Outcome::Failed(_)) {
            if let Err(err) = record.remove([e]) {
                error!(error = %format!("{err:#}"), "Failed to update the suspension record");
            }
        }
    }
}

impl Agent {
    /// Builds the loop. `record` must already be cleared of leftovers.
    pub fn new(
        cfg: LoopConfig,
        sampler: Box<dyn GpuSampler>,
        source: Arc<dyn PodSource>,
        record: Record,
        shared: Arc<Shared>,
    ) -> anyhow::Result<Agent> {
        let event_log = match &cfg.event_log {
            Some(p) => Some(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
                    .map_err(|e| anyhow::anyhow!("opening event log {}: {e}", p.display()))?,
            ),
            None => None,
        };
        let self_cgroups = std::fs::read_to_string("/proc/self/cgroup")
            .map(|s| Cgroups::parse(&s))
            .unwrap_or_default();
        let gpu_metrics = sampler
            .gpus()
            .into_iter()
            .map(|g| (g, GpuMetrics::new(g, cfg.actuator.as_str())))
            .collect();
        Ok(Agent {
            machine: Machine::new(cfg.machine),
            cfg,
            sampler,
            source,
            procs: HashMap::new(),
            last_seen_us: BTreeMap::new(),
            held: BTreeMap::new(),
            record,
            shared,
            next_refresh: Instant::now(),
            last_tick: None,
            last_state_publish: Instant::now() - Duration::from_secs(1),
            self_cgroups,
            event_log,
            gpu_metrics,
            warned: BTreeSet::new(),
            lag: metrics::histogram!("coloc_loop_lag_seconds"),
            recent: Default::default(),
            history: BTreeMap::new(),
        })
    }

    /// Runs until `shared.stop` is set, then resumes everything.
    pub fn run(mut self) {
        raise_priority(self.cfg.loop_nice);
        let mut next = Instant::now();
        while !self.shared.stop.load(Ordering::Relaxed) {
            self.tick();
            next += self.current_poll();
            let now = Instant::now();
            if next > now {
                std::thread::sleep(next - now);
            } else {
                // Overran: don't try to catch up with a burst of ticks.
                next = now;
            }
        }
        info!("Stopping: resuming all offline work before exit");
        self.release_everything("shutdown");
    }

    /// The poll interval for the next tick: `--poll-interval` while any offline process is
    /// on a managed GPU (someone may need preempting); `--idle-poll-interval` otherwise,
    /// since with no offline work there is nothing to preempt and a 1 ms wake-up costs
    /// CPU for nothing. New processes are still listed every `--process-interval`.
    fn current_poll(&self) -> Duration {
        let offline_present = self
            .procs
            .values()
            .any(|e| e.cls.class == Class::Offline && !e.gpus.is_empty());
        if offline_present || !self.held.is_empty() {
            self.cfg.poll
        } else {
            self.cfg.idle_poll.max(self.cfg.poll)
        }
    }

    fn warn_once(&mut self, key: String, f: impl FnOnce()) {
        if self.warned.insert(key) {
            f();
        }
    }

    /// One iteration: sample, classify new processes, decide, act, publish.
    pub fn tick(&mut self) {
        let tick_start = Instant::now();
        if let Some(last) = self.last_tick {
            let lag = tick_start
                .duration_since(last)
                .saturating_sub(self.cfg.poll);
            self.lag.record(lag.as_secs_f64());
        }
        let dt = self
            .last_tick
            .map(|l| tick_start.duration_since(l))
            .unwrap_or_default();
        self.last_tick = Some(tick_start);

        match self.observe(tick_start) {
            Ok(()) => {
                if self.shared.degraded.swap(false, Ordering::Relaxed) {
                    info!("NVML answers again: resuming normal operation");
                }
            }
            Err(err) => {
                if !self.shared.degraded.swap(true, Ordering::Relaxed) {
                    error!(%err, "NVML failed: failing open, resuming all offline work");
                    metrics::counter!("coloc_fail_open_total", "reason" => "nvml").increment(1);
                }
                self.release_everything("nvml");
                self.finish_tick(dt);
                return;
            }
        }

        let now = now_ns();
        let inputs = self.inputs();
        let decision = self.machine.tick(now, &inputs);
        if !decision.is_empty() {
            debug!(suspend = ?decision.suspend, resume = ?decision.resume, transitions = ?decision.transitions, "Decision");
            self.execute(decision, now);
        }
        self.purge_gone();
        self.account(dt, &inputs);
        self.finish_tick(dt);
    }

    fn finish_tick(&mut self, _dt: Duration) {
        self.shared.ticked.store(true, Ordering::Relaxed);
        self.shared.last_tick_ns.store(now_ns(), Ordering::Relaxed);
        if self.last_state_publish.elapsed() >= Duration::from_millis(100) {
            self.publish_state();
        }
    }

    fn observe(&mut self, now: Instant) -> Result<(), GpuError> {
        let mut unknown: Vec<(u32, u32, u64)> = Vec::new();
        for gpu in self.sampler.gpus() {
            let since = self.last_seen_us.get(&gpu).copied().unwrap_or(0);
            let samples = self.sampler.samples(gpu, since)?;
            for a in samples {
                let ts_us = a.at_ns / 1000;
                let seen = self.last_seen_us.entry(gpu).or_insert(0);
                *seen = (*seen).max(ts_us);
                match self.procs.get_mut(&a.pid) {
                    Some(e) if e.gpus.contains(&gpu) => {
                        let t = e.last_active.entry(gpu).or_insert(0);
                        *t = (*t).max(a.at_ns);
                    }
                    _ => unknown.push((a.pid, gpu, a.at_ns)),
                }
            }
        }
        let generation = self.source.generation();
        let stale = self.procs.values().any(|e| e.generation != generation);
        if !unknown.is_empty() || now >= self.next_refresh || stale {
            self.refresh(generation)?;
            self.next_refresh = now + self.cfg.process_interval;
            for (pid, gpu, at) in unknown {
                if let Some(e) = self.procs.get_mut(&pid) {
                    if e.gpus.contains(&gpu) {
                        let t = e.last_active.entry(gpu).or_insert(0);
                        *t = (*t).max(at);
                    }
                }
            }
        }
        Ok(())
    }

    fn refresh(&mut self, generation: u64) -> Result<(), GpuError> {
        let mut listed: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::new();
        for gpu in self.sampler.gpus() {
            for pid in self.sampler.processes(gpu)? {
                listed.entry(pid).or_default().insert(gpu);
            }
        }
        for (pid, gpus) in &listed {
            let reused = match (self.procs.get(pid), read_stat(*pid)) {
                (Some(e), Ok(s)) => s.start != e.key.start,
                (Some(e), Err(_)) => e.key.start != 0,
                (None, _) => true,
            };
            let reclassify = self
                .procs
                .get(pid)
                .is_some_and(|e| e.generation != generation);
            if reused || reclassify {
                // What is held suspended lives in `held` with its target, so replacing
                // the entry loses nothing: the machine resumes the old key next tick.
                if self.procs.remove(pid).is_some() && reused {
                    info!(pid, "GPU process replaced by another with the same PID");
                }
                let entry = self.classify(*pid, generation);
                self.procs.insert(*pid, entry);
            }
            if let Some(e) = self.procs.get_mut(pid) {
                e.gpus = gpus.clone();
                e.last_active.retain(|g, _| gpus.contains(g));
            }
        }
        for (pid, e) in self.procs.iter_mut() {
            if !listed.contains_key(pid) {
                e.gpus.clear();
            }
        }
        Ok(())
    }

    fn classify(&mut self, pid: u32, generation: u64) -> Entry {
        let info = match read_proc(pid) {
            Ok(i) => i,
            Err(err) => {
                self.warn_once(format!("proc:{pid}"), || {
                    warn!(pid, %err, "GPU process not visible in /proc (is the agent in the host PID namespace?): treated as unmanaged")
                });
                return Entry {
                    key: ProcKey { pid, start: 0 },
                    cls: Classified::unmanaged(Class::Unmanaged),
                    cmd: String::new(),
                    gpus: BTreeSet::new(),
                    last_active: BTreeMap::new(),
                    target: None,
                    generation,
                };
            }
        };
        let mut cls = self.source.classify(&info);
        let mut target = None;
        if cls.class.is_suspendable() {
            match actuator::open_pidfd(info.key) {
                Ok(fd) => {
                    target = Some(self.target_for(&info.cgroups, &cls, info.key, Arc::new(fd)));
                }
                Err(err) => {
                    // Without a pidfd we cannot be sure whom we would signal: leave it be.
                    warn!(pid, %err, "Cannot pin offline process (pidfd): never suspended");
                    cls.class = Class::Unmanaged;
                }
            }
        }
        info!(
            pid,
            class = %cls.class,
            owner = %cls.owner,
            actuator = target.as_ref().map(|t| t.kind().as_str()).unwrap_or("-"),
            cmd = %truncate(&info.cmdline, 120),
            "Classified GPU process"
        );
        if cls.class == Class::Unmanaged {
            metrics::counter!("coloc_unmanaged_processes_total").increment(1);
        }
        Entry {
            key: info.key,
            cls,
            cmd: truncate(&info.cmdline, 200),
            gpus: BTreeSet::new(),
            last_active: BTreeMap::new(),
            target,
            generation,
        }
    }

    fn target_for(
        &mut self,
        cg: &Cgroups,
        cls: &Classified,
        key: ProcKey,
        fd: Arc<OwnedFd>,
    ) -> Target {
        let signal = Target::Process { key, pidfd: fd };
        if self.cfg.actuator != Kind::Freezer {
            return signal;
        }
        let why = match &cls.freeze_cgroup {
            None => "its rule does not declare a whole cgroup offline".to_string(),
            Some(path) => {
                let v2 = cg.v2.as_deref().filter(|p| p == path);
                let v1 = cg
                    .v1
                    .get("freezer")
                    .map(String::as_str)
                    .filter(|p| p == path);
                let inside = |own: Option<&str>| {
                    own.is_some_and(|o| {
                        o == path || o.starts_with(&format!("{}/", path.trim_end_matches('/')))
                    })
                };
                if inside(self.self_cgroups.v2.as_deref())
                    || inside(self.self_cgroups.v1.get("freezer").map(String::as_str))
                {
                    format!("cgroup {path} contains the agent itself")
                } else {
                    match self.cfg.cgroups.target_for(v2, v1) {
                        Some(t) => return t,
                        None => format!("no freezer for cgroup {path} under the cgroup root"),
                    }
                }
            }
        };
        let k = format!("fallback:{}", cls.owner);
        self.warn_once(k, || {
            warn!(pid = key.pid, owner = %cls.owner, reason = %why, "Freezer not usable for this offline process: using signal")
        });
        signal
    }

    fn inputs(&self) -> Vec<GpuInput<ProcKey>> {
        let mut by_gpu: BTreeMap<u32, Vec<ProcessObs<ProcKey>>> = self
            .sampler
            .gpus()
            .into_iter()
            .map(|g| (g, Vec::new()))
            .collect();
        for e in self.procs.values() {
            for g in &e.gpus {
                if let Some(v) = by_gpu.get_mut(g) {
                    v.push(ProcessObs {
                        key: e.key,
                        class: e.cls.class,
                        last_active: e.last_active.get(g).copied(),
                        share: e.cls.share,
                    });
                }
            }
        }
        by_gpu
            .into_iter()
            .map(|(gpu, procs)| GpuInput { gpu, procs })
            .collect()
    }

    fn entry_by_key(&self, key: &ProcKey) -> Option<&Entry> {
        self.procs.get(&key.pid).filter(|e| e.key == *key)
    }

    fn execute(&mut self, d: Decision<ProcKey>, decided: u64) {
        let actuator = self.cfg.actuator.as_str();
        // Suspensions: one batch, recorded before acting.
        let mut batch: Vec<Target> = Vec::new();
        let mut batch_gpus: BTreeMap<u32, usize> = BTreeMap::new();
        for (key, reason) in &d.suspend {
            let Some(target) = self.entry_by_key(key).and_then(|e| e.target.clone()) else {
                continue;
            };
            let rec = target.record();
            let (_, holders) = self
                .held
                .entry(rec)
                .or_insert_with(|| (target.clone(), BTreeSet::new()));
            let first = holders.is_empty();
            holders.insert(*key);
            let (gpu, why) = match reason {
                Reason::OnlineBusy { gpu } => (Some(*gpu), "online_busy"),
                Reason::ShareCap => (None, "share_cap"),
            };
            if let Some(g) = gpu {
                *batch_gpus.entry(g).or_default() += 1;
            }
            metrics::counter!("coloc_suspensions_total", "gpu" => gpu.map(|g| g.to_string()).unwrap_or_else(|| "-".into()), "reason" => why).increment(1);
            if first {
                batch.push(target);
            }
        }
        let mut confirmed_at = decided;
        if !batch.is_empty() {
            if self.cfg.dry_run {
                for t in &batch {
                    info!(target = %actuator::describe(t), "Dry run: would suspend");
                }
            } else if let Err(err) = self.record.add(batch.iter().map(Target::record)) {
                error!(error = %format!("{err:#}"), "Cannot write the suspension record: not suspending (fail open)");
                metrics::counter!("coloc_fail_open_total", "reason" => "record").increment(1);
                for t in &batch {
                    self.held.remove(&t.record());
                }
                batch.clear();
            } else {
                let outcomes = actuator::apply(&batch, Op::Suspend, self.cfg.confirm_timeout);
                confirmed_at = now_ns();
                self.handle_outcomes(&batch, outcomes, Op::Suspend);
            }
        }

        // Resumptions.
        let mut resume: Vec<Target> = Vec::new();
        // By key, not through the process table: a process reclassified or gone since it
        // was suspended is still resumed through the target it was suspended with.
        for key in &d.resume {
            self.held.retain(|_, (t, holders)| {
                if holders.remove(key) && holders.is_empty() {
                    resume.push(t.clone());
                    return false;
                }
                true
            });
        }
        let mut resumed_at = decided;
        if !resume.is_empty() {
            let pids: Vec<u32> = d.resume.iter().map(|k| k.pid).collect();
            info!(?pids, targets = resume.len(), "Resuming offline work");
            if self.cfg.dry_run {
                for t in &resume {
                    info!(target = %actuator::describe(t), "Dry run: would resume");
                }
            } else {
                let outcomes = actuator::apply(&resume, Op::Resume, self.cfg.confirm_timeout);
                resumed_at = now_ns();
                self.handle_outcomes(&resume, outcomes, Op::Resume);
            }
        }

        for tr in &d.transitions {
            match *tr {
                Transition::Preempt {
                    gpu,
                    first_activity,
                    decided_at,
                    offline,
                } => {
                    let detection = decided_at.saturating_sub(first_activity);
                    let acted = batch_gpus.get(&gpu).copied().unwrap_or(0) > 0
                        && !self.cfg.dry_run
                        && !batch.is_empty();
                    let m = self.gpu_metrics.get(&gpu);
                    if let Some(m) = m {
                        m.detection.record(secs(detection));
                    }
                    let mut ev = json!({
                        "event": "preempt", "gpu": gpu, "first_activity_ns": first_activity,
                        "decided_ns": decided_at, "detection_s": secs(detection), "offline": offline,
                        "actuator": actuator, "dry_run": self.cfg.dry_run,
                    });
                    if acted {
                        let act = confirmed_at.saturating_sub(decided_at);
                        let pre = confirmed_at.saturating_sub(first_activity);
                        if let Some(m) = m {
                            m.actuation[actuator].record(secs(act));
                            m.preemption[actuator].record(secs(pre));
                        }
                        ev["confirmed_ns"] = json!(confirmed_at);
                        ev["actuation_s"] = json!(secs(act));
                        ev["preemption_s"] = json!(secs(pre));
                    }
                    info!(
                        gpu,
                        offline,
                        detection_ms = detection as f64 / 1e6,
                        preemption_ms = ev["preemption_s"].as_f64().map(|s| s * 1e3),
                        "Online busy: offline suspended"
                    );
                    self.log_event(ev);
                }
                Transition::Release {
                    gpu,
                    window_end,
                    decided_at,
                    busy_for,
                    offline,
                } => {
                    let mut ev = json!({
                        "event": "release", "gpu": gpu, "window_end_ns": window_end, "decided_ns": decided_at,
                        "idle_window_ns": self.cfg.machine.idle_window,
                        "busy_for_s": secs(busy_for), "offline": offline, "actuator": actuator, "dry_run": self.cfg.dry_run,
                    });
                    if !resume.is_empty() && !self.cfg.dry_run && offline > 0 {
                        let rel = resumed_at.saturating_sub(window_end);
                        if let Some(m) = self.gpu_metrics.get(&gpu) {
                            m.release[actuator].record(secs(rel));
                        }
                        ev["confirmed_ns"] = json!(resumed_at);
                        ev["release_s"] = json!(secs(rel));
                    }
                    info!(
                        gpu,
                        offline,
                        busy_ms = busy_for as f64 / 1e6,
                        release_ms = ev["release_s"].as_f64().map(|s| s * 1e3),
                        "Online idle for the window: offline resumed"
                    );
                    self.log_event(ev);
                }
            }
        }
    }

    fn handle_outcomes(&mut self, targets: &[Target], outcomes: Vec<Outcome>, op: Op) {
        let mut done = Vec::new();
        for (t, o) in targets.iter().zip(outcomes) {
            match o {
                Outcome::Done => {
                    debug!(target = %actuator::describe(t), op = op.as_str(), "Confirmed");
                    if op == Op::Resume {
                        done.push(t.record());
                    }
                }
                Outcome::Gone => {
                    debug!(target = %actuator::describe(t), op = op.as_str(), "Target gone");
                    done.push(t.record());
                    self.held.remove(&t.record());
                }
                Outcome::Failed(err) => {
                    metrics::counter!("coloc_actuation_errors_total", "actuator" => t.kind().as_str(), "op" => op.as_str(), "reason" => err.reason()).increment(1);
                    error!(target = %actuator::describe(t), op = op.as_str(), %err, "Actuation failed");
                    if op == Op::Suspend {
                        // Fail open: undo a half-done suspension and stop holding it.
                        let undo = actuator::apply(
                            std::slice::from_ref(t),
                            Op::Resume,
                            self.cfg.confirm_timeout,
                        );
                        if matches!(undo[0], Outcome::Failed(_)) {
                            error!(target = %actuator::describe(t), "Could not undo a failed suspension; left in the record for the next start");
                            continue;
                        }
                        self.held.remove(&t.record());
                        metrics::counter!("coloc_fail_open_total", "reason" => "actuation")
                            .increment(1);
                    }
                    // A failed resume stays in the record so the next start retries it.
                    if op == Op::Suspend {
                        done.push(t.record());
                    }
                }
            }
        }
        if let Err(err) = self.record.remove(done.iter()) {
            error!(error = %format!("{err:#}"), "Failed to update the suspension record");
        }
    }

    /// Resumes every held target and forgets all suspensions (fail-open and shutdown).
    pub fn release_everything(&mut self, reason: &'static str) {
        self.machine.release_all();
        let targets: Vec<Target> = std::mem::take(&mut self.held)
            .into_values()
            .map(|(t, _)| t)
            .collect();
        if targets.is_empty() {
            return;
        }
        info!(
            reason,
            count = targets.len(),
            "Resuming all suspended offline work"
        );
        if !self.cfg.dry_run {
            let outcomes = actuator::apply(&targets, Op::Resume, self.cfg.confirm_timeout);
            self.handle_outcomes(&targets, outcomes, Op::Resume);
        }
    }

    fn purge_gone(&mut self) {
        let machine = &self.machine;
        self.procs
            .retain(|_, e| !e.gpus.is_empty() || machine.suspended().contains_key(&e.key));
    }

    fn account(&mut self, dt: Duration, inputs: &[GpuInput<ProcKey>]) {
        let dts = dt.as_secs_f64();
        for input in inputs {
            let Some(m) = self.gpu_metrics.get(&input.gpu) else {
                continue;
            };
            let busy = matches!(self.machine.state(input.gpu), GpuState::OnlineBusy { .. });
            m.busy.set(if busy { 1.0 } else { 0.0 });
            let offline: Vec<_> = input
                .procs
                .iter()
                .filter(|p| p.class == Class::Offline)
                .collect();
            let suspended = offline
                .iter()
                .filter(|p| self.machine.suspended().contains_key(&p.key))
                .count();
            m.suspended.set(suspended as f64);
            let mut secs = self
                .shared
                .gpu_seconds
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let acc = secs.entry(input.gpu).or_default();
            if suspended > 0 {
                acc.suspended += dts;
            }
            if !busy && offline.len() > suspended {
                acc.reclaimed += dts;
            }
        }
    }

    fn log_event(&mut self, ev: serde_json::Value) {
        if let Some(f) = &mut self.event_log {
            let _ = writeln!(f, "{ev}");
        }
        let gpu = ev["gpu"].as_u64().unwrap_or(0) as u32;
        let h = self.history.entry(gpu).or_default();
        match ev["event"].as_str() {
            Some("preempt") => {
                h.last_preempt_ns = ev["decided_ns"].as_u64();
                if let Some(p) = ev["preemption_s"].as_f64() {
                    push_bounded(&mut h.preemption_ms, p * 1e3, 1024);
                }
            }
            Some("release") => {
                if let Some(r) = ev["release_s"].as_f64() {
                    push_bounded(&mut h.release_ms, r * 1e3, 1024);
                }
            }
            _ => {}
        }
        push_bounded(&mut self.recent, ev, 512);
    }

    fn publish_state(&mut self) {
        self.last_state_publish = Instant::now();
        let now = now_ns();
        let gpus: Vec<_> = self
            .sampler
            .gpus()
            .into_iter()
            .map(|g| {
                let state = self.machine.state(g);
                let mut procs: Vec<_> = self
                    .procs
                    .values()
                    .filter(|e| e.gpus.contains(&g))
                    .map(|e| {
                        json!({
                            "pid": e.key.pid,
                            "class": e.cls.class,
                            "owner": e.cls.owner,
                            "cmd": e.cmd,
                            "suspended": self.machine.suspended().contains_key(&e.key),
                            "actuator": e.target.as_ref().map(|t| t.kind().as_str()),
                            "last_active_ms_ago": e.last_active.get(&g).map(|t| now.saturating_sub(*t) as f64 / 1e6),
                        })
                    })
                    .collect();
                procs.sort_by_key(|p| p["pid"].as_u64());
                let mut s = serde_json::to_value(state).unwrap_or_default();
                s["index"] = json!(g);
                s["uuid"] = json!(self.sampler.uuid(g));
                s["processes"] = json!(procs);
                let h = self.history.get(&g);
                s["last_preemption_ms_ago"] = json!(h.and_then(|h| h.last_preempt_ns).map(|t| now.saturating_sub(t) as f64 / 1e6));
                s["preemption_ms"] = h.map(|h| summary(&h.preemption_ms)).unwrap_or(json!({"count": 0}));
                s["release_ms"] = h.map(|h| summary(&h.release_ms)).unwrap_or(json!({"count": 0}));
                s
            })
            .collect();
        let doc = json!({
            "node": self.cfg.node,
            "actuator": self.cfg.actuator.as_str(),
            "dry_run": self.cfg.dry_run,
            "idle_window_ms": self.cfg.machine.idle_window as f64 / 1e6,
            "degraded": self.shared.degraded.load(Ordering::Relaxed),
            "suspended_targets": self.held.len(),
            "updated_ns": now,
            "gpus": gpus,
            "recent_events": self.recent,
        });
        if let Ok(mut s) = self.shared.state.lock() {
            *s = doc;
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // Reached on normal exit (already empty) and on a panic unwinding the loop.
        if !self.held.is_empty() {
            error!("Control loop ending with offline work suspended: resuming it");
            self.release_everything("panic");
        }
    }
}

/// Gives the control-loop thread a higher CPU priority (a negative nice value), so that
/// offline processes competing for CPU (those just resumed, above all) do not delay
/// decisions and confirmations. Needs CAP_SYS_NICE (root has it); without it the loop runs
/// at normal priority and says so. On Linux, setpriority on a thread ID affects that
/// thread only.
fn raise_priority(nice: i32) {
    if nice == 0 {
        return;
    }
    let tid = rustix::thread::gettid();
    let r = rustix::process::setpriority_process(Some(tid), nice);
    match r {
        Ok(()) => info!(nice, "Control loop runs at raised CPU priority"),
        Err(error) => {
            warn!(nice, %error, "Cannot raise the control loop's CPU priority (needs CAP_SYS_NICE); running at normal priority")
        }
    }
}

fn secs(ns: u64) -> f64 {
    ns as f64 / 1e9
}

fn truncate(s: &str, n: usize) -> String {
    if s.len() <= n {
        s.to_string()
    } else {
        let mut end = n;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        format!("{}…", &s[..end])
    }
}

#[allow(dead_code)]
fn assert_send() {
    fn is_send<T: Send>() {}
    is_send::<Agent>();
}
