//! The control loop: sample → classify → decide → act, every poll interval.
//!
//! ```text
//!  edges::gpu ──samples──► table (pid → class, GPUs,      qos_core::Machine
//!  (NVML)     ──list─────►  activity, plan)  ──inputs──►  tick(now, per GPU) ──► execute
//!  edges::source ─class──►      ▲                              │        holds (record, then act)
//!  edges::procfs ─/proc──►──────┘                              │        events (tracker → emit)
//!                         health (per-GPU fail-open) ◄─ errors │        state (/state document)
//!                         watchdog (hung calls, own thread)
//! ```
//!
//! Rooms: [`table`] (the process table, PID reuse, exited PIDs), [`target`] (freezer or
//! signal, whole cgroup or one process), [`holds`] (what is suspended, record before act,
//! confirmations that never stall the loop), [`health`] (transient vs persistent NVML
//! failures, the watchdog), [`events`] (typed events), [`state`] (the typed `/state`
//! document and the handle shared with HTTP); [`execute`](self) turns a decision into holds and
//! events; [`publish`](self) builds `/state` and the time accounting.
//!
//! Runs on its own OS thread so that its timing does not depend on the async runtime
//! serving HTTP. Fails open: on a persistent NVML failure (per GPU), a hung NVML call, a
//! record write error, shutdown, or a panic (via `Drop`).

mod bells;
pub mod events;
mod execute;
pub mod health;
pub mod holds;
mod observe;
mod publish;
pub mod retry;
pub mod state;
pub mod table;
pub mod target;

#[cfg(test)]
mod tests;

use crate::edges::actuator::{Actuator, CgroupMounts, Kind};
use crate::edges::clock::Clock;
use crate::edges::doorbell::Doorbells;
use crate::edges::gpu::GpuSampler;
use crate::edges::procfs::{ProcFs, ProcKey};
use crate::edges::record::RecordStore;
use crate::edges::source::PodSource;
use crate::telemetry::Telemetry;
use events::{Event, FailOpen, Tracker};
use health::{Health, Watchdog};
use holds::Holds;
use qos_core::Machine;
use state::Shared;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use table::{Classifier, Table};
use target::Chooser;
use tracing::{error, info, warn};

/// Settings of the loop (validated by the CLI layer).
#[derive(Debug, Clone)]
pub struct LoopConfig {
    /// Utilisation sampling period while offline work is present.
    pub poll: Duration,
    /// Sampling period while no offline process is on any managed GPU.
    pub idle_poll: Duration,
    /// Running-process list period.
    pub process_interval: Duration,
    /// How often NVML's per-process samples are read.
    pub nvml_interval: Duration,
    /// The driver's sample period (a sample covers the period ending at its timestamp).
    pub nvml_sample_period: Duration,
    /// State machine settings.
    pub machine: qos_core::Config,
    /// Preferred actuator.
    pub actuator: Kind,
    /// Decide and report, never act (the edges are then a dry-run actuator and an
    /// in-memory record; this flag only labels reports).
    pub dry_run: bool,
    /// How long a suspend/resume may take to be confirmed.
    pub confirm_timeout: Duration,
    /// cgroup hierarchies.
    pub cgroups: CgroupMounts,
    /// JSON-lines log of every event, if set.
    pub event_log: Option<PathBuf>,
    /// Node name, for `/state`.
    pub node: String,
    /// Nice value of the control-loop thread (0: unchanged).
    pub loop_nice: i32,
    /// How long a GPU's NVML calls must keep failing before it fails open.
    pub nvml_grace: Duration,
    /// How long one NVML call may take before the watchdog fails open.
    pub nvml_hang_timeout: Duration,
    /// How often a held target is checked again (stopped again if something resumed it).
    pub recheck: Duration,
}

/// The loop's edges (real ones in `main`, fakes in tests).
pub struct Edges {
    /// NVML.
    pub gpu: Box<dyn GpuSampler>,
    /// `/proc`.
    pub procfs: Arc<dyn ProcFs>,
    /// Classification.
    pub source: Arc<dyn PodSource>,
    /// Time.
    pub clock: Arc<dyn Clock>,
    /// Freezer/signal (or dry run).
    pub actuator: Box<dyn Actuator>,
    /// The fail-open record.
    pub record: Box<dyn RecordStore>,
    /// Doorbell pages, and the loop's sleep.
    pub bells: Box<dyn Doorbells>,
}

impl std::fmt::Debug for Edges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Edges").finish_non_exhaustive()
    }
}

/// The control loop.
pub struct Loop {
    cfg: LoopConfig,
    gpu: Box<dyn GpuSampler>,
    gpus: Vec<u32>,
    clock: Arc<dyn Clock>,
    classifier: Classifier,
    table: Table,
    machine: Machine<ProcKey>,
    holds: Arc<Mutex<Holds>>,
    health: Health,
    watchdog: Arc<Watchdog>,
    tracker: Tracker,
    retries: retry::Retries,
    telemetry: Telemetry,
    shared: Arc<Shared>,
    /// Newest sample timestamp seen per GPU (µs, NVML's `lastSeenTimeStamp`).
    last_seen_us: BTreeMap<u32, u64>,
    /// Samples at or before this time are ignored (after a fail-open), per GPU.
    blind_until: BTreeMap<u32, u64>,
    /// Reused sample buffer.
    scratch: Vec<crate::edges::gpu::Activity>,
    next_refresh_ns: u64,
    /// When NVML's samples are next read.
    next_nvml_ns: u64,
    /// Something asked for the process lists to be read at the next tick (and why).
    refresh_asked: Option<&'static str>,
    last_tick_ns: Option<u64>,
    last_publish_ns: u64,
    /// Doorbells: pages, their attribution, the UUID → GPU map.
    bells: bells::Bells,
    /// The state machine must run at the next tick whatever changed (start, fail-open).
    decide_next: bool,
    /// The inputs of the latest decision.
    last_inputs: Vec<qos_core::GpuInput<ProcKey>>,
    /// Per-GPU summary of the latest decision (time accounting between decisions).
    summary: Vec<publish::GpuSummary>,
}

impl std::fmt::Debug for Loop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loop")
            .field("gpus", &self.gpus)
            .finish_non_exhaustive()
    }
}

impl Loop {
    /// Builds the loop. The record must already be cleared of leftovers.
    pub fn new(cfg: LoopConfig, edges: Edges, shared: Arc<Shared>) -> anyhow::Result<Loop> {
        let event_log = match &cfg.event_log {
            Some(p) => Some(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
                    .map_err(|e| anyhow::anyhow!("opening --event-log {}: {e}", p.display()))?,
            ),
            None => None,
        };
        let gpus = edges.gpu.gpus();
        let uuids: Vec<(u32, String)> = gpus.iter().map(|g| (*g, edges.gpu.uuid(*g))).collect();
        let started_ns = edges.clock.now_ns();
        let chooser = Chooser {
            preferred: cfg.actuator,
            mounts: cfg.cgroups.clone(),
            own: edges.procfs.self_cgroups(),
        };
        let mut holds = Holds::new(
            edges.actuator,
            edges.record,
            edges.procfs.clone(),
            edges.clock.clone(),
            cfg.confirm_timeout,
        );
        holds.recheck_ns = cfg.recheck.as_nanos() as u64;
        Ok(Loop {
            machine: Machine::new(cfg.machine),
            health: Health::new(cfg.nvml_grace),
            telemetry: Telemetry::new(&gpus, event_log),
            classifier: Classifier {
                procfs: edges.procfs,
                source: edges.source,
                chooser,
            },
            gpu: edges.gpu,
            gpus,
            clock: edges.clock,
            table: Table::default(),
            holds: Arc::new(Mutex::new(holds)),
            watchdog: Arc::new(Watchdog::default()),
            tracker: Tracker::default(),
            retries: retry::Retries::default(),
            shared,
            last_seen_us: BTreeMap::new(),
            blind_until: BTreeMap::new(),
            scratch: Vec::new(),
            next_refresh_ns: 0,
            next_nvml_ns: 0,
            refresh_asked: None,
            bells: bells::Bells::new(edges.bells, &uuids, started_ns, cfg.machine.idle_window),
            last_tick_ns: None,
            last_publish_ns: 0,
            decide_next: true,
            last_inputs: Vec::new(),
            summary: Vec::new(),
            cfg,
        })
    }

    fn holds(&self) -> MutexGuard<'_, Holds> {
        self.holds.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs until `shared.stop` is set, then resumes everything. Starts the watchdog.
    pub fn run(mut self) {
        raise_priority(self.cfg.loop_nice);
        let wd = self.watchdog.spawn(
            self.cfg.nvml_hang_timeout,
            self.holds.clone(),
            self.shared.clone(),
            self.clock.clone(),
        );
        if let Err(err) = &wd {
            warn!(%err, "Cannot start the NVML watchdog thread: a hung NVML call will not fail open");
        }
        while !self.shared.stop.load(Ordering::Relaxed) {
            let started = Instant::now();
            self.tick();
            let sleep = self
                .next_wait(self.clock.now_ns())
                .saturating_sub(started.elapsed());
            if !sleep.is_zero() && self.bells.wait(sleep) {
                metrics::counter!("coloc_doorbell_wakeups_total").increment(1);
            }
        }
        info!("Stopping: resuming all offline work before exit");
        self.release_everything("shutdown");
    }

    /// How long the loop may sleep before something is due: `--poll-interval` while an
    /// event, a retry or a fixed-share duty cycle is in progress; else until the next
    /// check of a pending confirmation (50 µs after the operation, the gap doubling up to
    /// 1 ms), NVML read, process-list read, end of an idle window, re-check or publication,
    /// and at most `--idle-poll-interval`. A doorbell ends the sleep early.
    pub(crate) fn next_wait(&self, now: u64) -> Duration {
        let poll = self.cfg.poll;
        let (next_check, recheck) = {
            let h = self.holds();
            (h.next_check_ns(), h.next_recheck_ns())
        };
        let held = recheck.is_some();
        if (next_check.is_none() && !self.tracker.is_empty())
            || !self.retries.is_empty()
            || self.table.fixed_share_present()
            || self.refresh_asked.is_some()
        {
            return poll;
        }
        let mut due = now + self.cfg.idle_poll.max(poll).as_nanos() as u64;
        if self.table.offline_present() || held {
            due = due.min(self.next_nvml_ns);
        }
        due = due.min(self.next_refresh_ns);
        if let Some(t) = recheck {
            due = due.min(t.max(now));
        }
        if let Some(t) = next_check {
            due = due.min(t);
        }
        let window = self.cfg.machine.idle_window;
        for (_, st) in self.machine.states() {
            if let qos_core::GpuState::OnlineBusy { last_online, .. } = st {
                due = due.min(last_online.saturating_add(window));
            }
        }
        due = due.min(self.last_publish_ns + 100_000_000);
        Duration::from_nanos(due.saturating_sub(now)).max(Duration::from_micros(50))
    }

    /// One iteration: sample, classify new processes, decide, act, publish.
    pub fn tick(&mut self) {
        let now = self.clock.now_ns();
        let dt = self
            .last_tick_ns
            .map(|l| now.saturating_sub(l))
            .unwrap_or(0);
        if self.last_tick_ns.is_some() {
            let lag = dt.saturating_sub(self.cfg.poll.as_nanos() as u64);
            self.telemetry.lag.record(lag as f64 / 1e9);
        }
        self.last_tick_ns = Some(now);

        self.watchdog.enter(now);
        let failed = self.observe(now);
        if self.watchdog.leave(&self.holds) {
            self.after_watchdog(now);
            self.decide_next = true;
        }
        let observed = failed.is_some();
        if let Some(failed) = failed {
            self.judge(failed, now);
        }
        self.ring_bells(now);

        let mut retried = false;
        for key in self.retries.due(now) {
            if self.machine.forget(&key) {
                metrics::counter!("coloc_suspension_retries_total").increment(1);
                info!(pid = key.pid, "Retrying a failed suspension");
                retried = true;
            }
        }
        if self.decision_due(now, observed || retried) {
            let managed: Vec<u32> = self
                .gpus
                .iter()
                .copied()
                .filter(|g| !self.health.degraded(*g))
                .collect();
            self.last_inputs = self.inputs(&managed);
            let decision = self.machine.tick(now, &self.last_inputs);
            if !decision.is_empty() {
                self.execute(decision, now);
            }
            self.summarise();
        }
        let done = self.holds().poll(now);
        if !done.is_empty() {
            for ev in self.tracker.complete(&done) {
                self.telemetry.emit(ev);
            }
        }
        let broken = self.holds().recheck(now);
        for b in broken {
            self.report_broken(b);
        }
        let failed = self.holds().take_failed();
        for key in failed {
            let due = self.retries.failed(key, now);
            warn!(
                pid = key.pid,
                retry_in_ms = due.saturating_sub(now) / 1_000_000,
                "Suspension failed and was undone; retrying while online stays busy"
            );
        }
        let holds = self.holds.clone();
        let machine = &self.machine;
        let table = &self.table;
        self.retries.retain(|k| table.entry(k).is_some());
        self.table.purge(|k| {
            machine.suspended().contains_key(k)
                || holds.lock().unwrap_or_else(|e| e.into_inner()).holds(k)
        });
        self.account(dt);
        self.shared.mark_tick(now);
        if now.saturating_sub(self.last_publish_ns) >= 100_000_000 {
            self.last_publish_ns = now;
            self.publish(now);
            // `/state` shows the machine's view: bring it up to date once per publication.
            self.decide_next = true;
        }
    }

    /// Whether this tick runs the state machine. It needs to only when what it reads
    /// changed or a time it waits for came: NVML was read (samples, process lists,
    /// health), a retry is due, a doorbell rang on a GPU that offline work runs on, an
    /// idle window may have ended, a `fixed-share` duty cycle runs, or after a fail-open
    /// and once per publication. A doorbell on a GPU already busy only moves its window's
    /// end, which the next decision reads: skipping those ticks is what keeps re-checks
    /// and confirmations cheap.
    fn decision_due(&mut self, now: u64, changed: bool) -> bool {
        let touched = self.table.take_touched();
        if changed || std::mem::take(&mut self.decide_next) || self.table.fixed_share_present() {
            return true;
        }
        let window = self.cfg.machine.idle_window;
        self.machine.states().any(|(g, st)| match st {
            qos_core::GpuState::OnlineBusy { last_online, .. } => {
                now >= last_online.saturating_add(window)
            }
            qos_core::GpuState::OfflineRunning => touched.contains(&g),
        })
    }

    /// Something resumed held offline work: say who, count it.
    fn report_broken(&mut self, b: holds::Broken) {
        metrics::counter!("coloc_suspension_breaks_total", "actuator" => b.kind.as_str())
            .increment(1);
        let owners: Vec<String> = b
            .holders
            .iter()
            .filter_map(|k| self.table.entry(k).map(|e| e.cls.owner.clone()))
            .collect();
        if b.escalated {
            warn!(
                ?owners,
                breaks = b.breaks,
                "Offline work keeps resuming itself while suspended: its cgroup is now frozen"
            );
        } else if b.breaks == 1 || b.breaks.is_multiple_of(100) {
            warn!(
                ?owners,
                breaks = b.breaks,
                resumed = b.resumed,
                "Offline work was resumed by something else while suspended: stopped again"
            );
        }
    }

    fn suspended_on(&self, gpu: u32) -> usize {
        self.table
            .entries()
            .filter(|e| e.gpus.contains(&gpu) && self.machine.suspended().contains_key(&e.key))
            .count()
    }

    fn inputs(&self, managed: &[u32]) -> Vec<qos_core::GpuInput<ProcKey>> {
        let mut by_gpu: BTreeMap<u32, Vec<qos_core::ProcessObs<ProcKey>>> =
            managed.iter().map(|g| (*g, Vec::new())).collect();
        for e in self.table.entries() {
            for g in &e.gpus {
                if let Some(v) = by_gpu.get_mut(g) {
                    let onset = e.onset.get(g).copied();
                    v.push(qos_core::ProcessObs {
                        key: e.key,
                        class: e.cls.class,
                        last_active: e.last_active.get(g).copied(),
                        onset: onset.map(|o| o.0),
                        signal: onset.map_or(qos_core::Signal::Nvml, |o| o.1),
                        share: e.cls.share,
                    });
                }
            }
        }
        by_gpu
            .into_iter()
            .map(|(gpu, procs)| qos_core::GpuInput { gpu, procs })
            .collect()
    }

    /// Resumes every held target and forgets all suspensions (shutdown, panic).
    pub fn release_everything(&mut self, reason: &'static str) {
        self.machine.release_all();
        self.decide_next = true;
        let now = self.clock.now_ns();
        let n = self.holds().release_all(reason, now);
        if n > 0 && reason != "shutdown" {
            metrics::counter!("coloc_fail_open_total", "reason" => reason).increment(1);
            self.telemetry.emit(Event::FailOpen(FailOpen {
                at_ns: now,
                reason: reason.into(),
                gpu: None,
                resumed: n,
            }));
        }
    }

    /// The handle shared with the HTTP server.
    pub fn shared(&self) -> Arc<Shared> {
        self.shared.clone()
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        // Reached on normal exit (already empty) and on a panic unwinding the loop.
        if !self.holds().is_empty() {
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
    match rustix::process::setpriority_process(Some(tid), nice) {
        Ok(()) => info!(nice, "Control loop runs at raised CPU priority"),
        Err(error) => {
            warn!(nice, %error, "Cannot raise the control loop's CPU priority (needs CAP_SYS_NICE); running at normal priority")
        }
    }
}
