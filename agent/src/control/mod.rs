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
//! events; [`follow`](self) handles what follows it (confirmations, broken holds, retries);
//! [`pace`](self) decides when the loop wakes and when a tick runs the state machine;
//! [`publish`](self) builds `/state` and the time accounting.
//!
//! Runs on its own OS thread so that its timing does not depend on the async runtime
//! serving HTTP. Fails open: on a persistent NVML failure (per GPU), a hung NVML call, a
//! record write error, shutdown, or a panic (via `Drop`).

mod bells;
mod entry;
pub mod events;
mod execute;
mod follow;
pub mod gates;
pub mod hands;
pub mod health;
pub mod holds;
mod observe;
mod pace;
mod publish;
pub mod retry;
pub mod state;
pub mod table;
pub mod target;
mod text;

#[cfg(test)]
mod tests;

use crate::edges::actuator::{Actuator, Kind};
use crate::edges::cgroupfs::CgroupMounts;
use crate::edges::clock::Clock;
use crate::edges::doorbell::Doorbells;
use crate::edges::gpu::GpuSampler;
use crate::edges::procfs::{ProcFs, ProcKey};
use crate::edges::record::RecordStore;
use crate::edges::source::PodSource;
use crate::telemetry::Telemetry;
use events::{Event, FailOpen, Tracker};
use hands::Hands;
use health::{Health, Watchdog};
use holds::HoldBook;
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
    /// SCHED_FIFO priority of the control-loop thread (0: the normal scheduler).
    pub loop_rt_priority: i32,
    /// Scheduler slice the control-loop thread asks for (zero: the kernel's default).
    pub loop_slice: Duration,
    /// How long a GPU's NVML calls must keep failing before it fails open.
    pub nvml_grace: Duration,
    /// How long one NVML call may take before the watchdog fails open.
    pub nvml_hang_timeout: Duration,
    /// How often a held target is checked again (stopped again if something resumed it).
    pub recheck: Duration,
    /// How long a launch gate's acknowledgement is waited for before the fallback.
    pub gate_timeout: Duration,
    /// How long a doorbell page may keep a GPU busy with no NVML sample of its owner at
    /// work before it is distrusted (zero: never).
    pub doorbell_trust_window: Duration,
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
    /// The launch gates (`--gate`).
    pub gates: Option<crate::edges::gate::GateKeeper>,
}

impl std::fmt::Debug for Edges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Edges").finish_non_exhaustive()
    }
}

/// Why everything is resumed at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseAll {
    /// The agent stops.
    Shutdown,
    /// The loop is unwinding from a panic.
    Panic,
}

impl ReleaseAll {
    /// Metric and event label.
    pub fn as_str(self) -> &'static str {
        match self {
            ReleaseAll::Shutdown => "shutdown",
            ReleaseAll::Panic => "panic",
        }
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
    /// The hold book (no I/O: it asks the hands).
    book: HoldBook,
    /// The edges that act, shared with the watchdog.
    hands: Arc<Mutex<Hands>>,
    health: Health,
    watchdog: Arc<Watchdog>,
    tracker: Tracker,
    retries: retry::Retries,
    telemetry: Telemetry,
    shared: Arc<Shared>,
    /// Newest sample timestamp seen per GPU (µs, NVML's `lastSeenTimeStamp`).
    last_seen_us: BTreeMap<u32, u64>,
    /// When the driver's samples were last read, per GPU (a successful read).
    sampled_at: BTreeMap<u32, u64>,
    /// Samples at or before this time are ignored (after a fail-open), per GPU.
    blind_until: BTreeMap<u32, u64>,
    /// Reused sample buffer.
    scratch: Vec<crate::edges::gpu::Activity>,
    next_refresh_ns: u64,
    /// When NVML's samples are next read.
    next_nvml_ns: u64,
    /// Something asked for the process lists to be read at the next tick (and why).
    refresh_asked: Option<observe::Refresh>,
    last_tick_ns: Option<u64>,
    last_publish_ns: u64,
    /// Doorbells: pages, their attribution, the UUID → GPU map.
    bells: bells::Bells,
    /// The state machine must run at the next tick whatever changed (start, fail-open).
    decide_next: bool,
    /// Where the current round of NVML sample reads goes on (a doorbell interrupted it).
    nvml_cursor: usize,
    /// The GPUs whose NVML calls ran this tick (the health policy judges those only).
    called: Vec<u32>,
    /// The inputs of the latest decision.
    last_inputs: Vec<qos_core::GpuInput<ProcKey>>,
    /// Per-GPU summary of the latest decision (time accounting between decisions).
    summary: Vec<publish::GpuSummary>,
    /// The gate file (`--gate`).
    gate_file: Option<PathBuf>,
    /// When the gate's heartbeat was last refreshed.
    last_beat_ns: u64,
    /// The loop's latest sleep: (went to sleep, woke), ns (`run` only).
    slept: Option<(u64, u64)>,
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
        let gate_file = edges.gates.as_ref().map(|g| g.path().to_path_buf());
        let hands = Hands::new(
            edges.actuator,
            edges.record,
            edges.procfs.clone(),
            edges.clock.clone(),
            edges.gates,
        );
        let mut book = HoldBook::new(cfg.confirm_timeout);
        book.recheck_ns = cfg.recheck.as_nanos() as u64;
        book.gate_timeout = cfg.gate_timeout;
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
            book,
            hands: Arc::new(Mutex::new(hands)),
            watchdog: Arc::new(Watchdog::default()),
            tracker: Tracker::default(),
            retries: retry::Retries::default(),
            shared,
            last_seen_us: BTreeMap::new(),
            sampled_at: BTreeMap::new(),
            blind_until: BTreeMap::new(),
            scratch: Vec::new(),
            next_refresh_ns: 0,
            next_nvml_ns: 0,
            refresh_asked: None,
            bells: bells::Bells::new(
                edges.bells,
                &uuids,
                started_ns,
                cfg.machine.idle_window,
                cfg.doorbell_trust_window.as_nanos() as u64,
            ),
            last_tick_ns: None,
            last_publish_ns: 0,
            decide_next: true,
            nvml_cursor: 0,
            called: Vec::new(),
            last_inputs: Vec::new(),
            summary: Vec::new(),
            gate_file,
            last_beat_ns: 0,
            slept: None,
            cfg,
        })
    }

    fn hands(&self) -> MutexGuard<'_, Hands> {
        self.hands.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The hold book.
    pub fn holds(&self) -> &HoldBook {
        &self.book
    }

    /// The shell's part of the hold book's conversation: performs what the book asks, in
    /// order, and tells it what came of it, until it asks for nothing more.
    fn drain(&mut self) {
        loop {
            let cmds = self.book.take_commands();
            if cmds.is_empty() {
                debug_assert!(
                    !self.book.waiting(),
                    "the book waits for an answer it never asked for"
                );
                return;
            }
            let obs = self.hands().perform(cmds);
            let now = self.clock.now_ns();
            self.book.observe(obs, now);
        }
    }

    /// Runs until `shared.stop` is set, then resumes everything. Starts the watchdog.
    pub fn run(mut self) {
        crate::sched::raise_priority(
            self.cfg.loop_nice,
            self.cfg.loop_rt_priority,
            self.cfg.loop_slice,
        );
        let wd = self.watchdog.spawn(
            self.cfg.nvml_hang_timeout,
            self.hands.clone(),
            self.cfg.confirm_timeout,
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
            let slept_ns = self.clock.now_ns();
            if !sleep.is_zero() && self.bells.wait(sleep) {
                metrics::counter!("coloc_doorbell_wakeups_total").increment(1);
            }
            self.slept = Some((slept_ns, self.clock.now_ns()));
        }
        info!("Stopping: resuming all offline work before exit");
        self.release_everything(ReleaseAll::Shutdown);
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

        let mut observed = self.observe_and_judge(now);
        self.ring_bells(now);
        if self.refresh_asked == Some(observe::Refresh::Doorbell) {
            // A launch of a process that the driver's lists did not hold yet (it has just
            // started): read the lists now and attribute the launch in this tick, not
            // one `--poll-interval` later. Not judged: the health policy counts one
            // judgement per tick, and a persistent failure shows at the next regular read.
            self.watchdog.enter(self.clock.now_ns());
            observed |= self.observe(now).is_some();
            if self.watchdog.leave(&self.hands) {
                self.after_watchdog(now);
                self.decide_next = true;
            }
            self.ring_bells(now);
        }
        self.follow_gates(now);

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
        self.follow_holds(now);
        self.account(dt);
        self.shared.mark_tick(now);
        if now.saturating_sub(self.last_publish_ns) >= 100_000_000 {
            self.last_publish_ns = now;
            self.publish(now);
            // `/state` shows the machine's view: bring it up to date once per publication.
            self.decide_next = true;
        }
    }

    /// Reads NVML when due (under the watchdog) and judges the failures; true when some
    /// NVML call ran.
    fn observe_and_judge(&mut self, now: u64) -> bool {
        self.watchdog.enter(now);
        let failed = self.observe(now);
        if self.watchdog.leave(&self.hands) {
            self.after_watchdog(now);
            self.decide_next = true;
        }
        let observed = failed.is_some();
        if let Some(failed) = failed {
            self.judge(failed, now);
        }
        observed
    }

    /// Resumes every held target and forgets all suspensions (shutdown, panic).
    pub fn release_everything(&mut self, reason: ReleaseAll) {
        let reason = reason.as_str();
        self.machine.release_all();
        self.decide_next = true;
        let now = self.clock.now_ns();
        let n = self.book.release_all(reason);
        self.drain();
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
        if !self.book.is_empty() {
            error!("Control loop ending with offline work suspended: resuming it");
            self.release_everything(ReleaseAll::Panic);
        }
        // Whatever the book lost track of (a conversation a panic cut short, a resume that
        // failed): the hands still know what they stopped and the record still holds it.
        let budget = self.cfg.confirm_timeout;
        let left = self.hands().resume_everything(budget);
        if left > 0 {
            error!(
                targets = left,
                "Resumed offline work the control loop had lost track of"
            );
        }
    }
}
