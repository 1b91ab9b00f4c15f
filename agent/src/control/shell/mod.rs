//! The shell: the loop that performs what the controller asks. At a tick's start it
//! gathers what [`Controller::start_tick`] says is due into one snapshot, the doorbells
//! first (its [`eyes`]), with every read the tick needs (what the controller knows,
//! [`Controller::known`], says which listed PIDs to classify and when a sample or a page
//! names a process it does not know yet: the lists are then read in the snapshot too),
//! hands it in ([`Controller::handle`]), performs each command
//! [`Controller::poll_command`] gives, in order (its [`hands`] act, its [`scribe`] writes
//! the record off the loop's thread, its [`render`] says notes and events), hands in what
//! came of each, and sleeps in the doorbell wait until [`Controller::poll_timeout`]. No
//! command reads.
//!
//! ```text
//!  start_tick ─► Reads ─► eyes: bells, samples (stop at a ring), lists + classification
//!                         (not after a ring), memory (not after a ring), bells again
//!                         (after a ring); lists + bells again for a page of an unknown
//!                         process ─► Snapshot
//!            ┌──────────────── Obs ────────────────┐
//!  edges ─► eyes ─► handle … poll_command ─► Cmd ─► hands (actuator, gates) ─► edges
//!                        ▲                 ├─► scribe (record; answers later) ──┐
//!                        └──── Written ────┼────────────────────────────────────┘
//!                                          └─► telemetry (log, metrics, events, /state)
//! ```
//!
//! The controller holds no file descriptor: the [`pins`] keep the pidfd of every process
//! it names, opened by the classifier, used by the hands, closed after the tick in which
//! the controller names the process no more.
//!
//! Runs on its own OS thread so that its timing does not depend on the async runtime
//! serving HTTP. Fails open: on shutdown, or a panic (via `Drop`), it resumes everything;
//! the NVML [`watchdog`] does so from its own thread while a call hangs.

pub mod choose;
pub mod classify;
pub mod eyes;
pub mod hands;
pub mod pins;
pub mod render;
pub mod scribe;
pub mod watchdog;

use super::controller::Controller;
use super::holds::{HoldBook, HoldObs};
use super::io::{Bells, BellsRead, Cmd, Obs, Reads, Snapshot};
use super::note::{self, Note};
use super::nvml::Refresh;
use super::state::{Shared, StateDoc};
use super::{LoopConfig, ReleaseAll};
use crate::edges::actuator::Actuator;
use crate::edges::clock::Clock;
use crate::edges::doorbell::Doorbells;
use crate::edges::gpu::GpuSampler;
use crate::edges::procfs::ProcFs;
use crate::edges::record::RecordStore;
use crate::edges::source::PodSource;
use crate::telemetry::Telemetry;
use choose::Chooser;
use classify::Classifier;
use eyes::Eyes;
use hands::Hands;
use pins::Pins;
use qos_core::stats::Summary;
use render::Emit;
use scribe::Scribe;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tracing::{error, info, warn};
use watchdog::Watchdog;

/// How long the agent waits, on its way out, for the record's last writes.
const LAST_WRITES: Duration = Duration::from_secs(5);

/// How long the agent waits, on its way out, for the driver to restore and unlock what it
/// holds (restores were measured at about 0.2 s per GB on an H100, several at once no
/// slower than one). What is left stays in the record for `coloc-agent resume` and the
/// next start.
pub const LAST_RESTORES: Duration = Duration::from_secs(60);

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
    pub gates: Option<Box<dyn crate::edges::gate::LaunchGates>>,
    /// The CUDA driver's checkpoint calls (`--driver-lock`, `--memory-reserve`), when its
    /// API is loaded: made off the loop.
    pub driver: Option<Box<dyn crate::edges::checkpoint::DriverWork>>,
}

impl std::fmt::Debug for Edges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Edges").finish_non_exhaustive()
    }
}

/// The control loop: the controller and the shell around it.
pub struct Loop {
    pub(crate) cfg: LoopConfig,
    pub(crate) ctl: Controller,
    eyes: Eyes,
    /// The edges that act, shared with the watchdog.
    pub(crate) hands: Arc<Mutex<Hands>>,
    scribe: Box<dyn scribe::Writer>,
    /// The driver's checkpoint API, called off the loop (`--driver-lock`,
    /// `--memory-reserve`).
    driver: Option<Box<dyn crate::edges::checkpoint::DriverWork>>,
    clock: Arc<dyn Clock>,
    pub(crate) watchdog: Arc<Watchdog>,
    pub(crate) telemetry: Telemetry,
    pub(crate) shared: Arc<Shared>,
    gpus: Vec<u32>,
    last_tick_ns: Option<u64>,
    /// The loop's latest sleep: (went to sleep, woke), ns (`run` only).
    slept: Option<(u64, u64)>,
    /// Everything was released on the way out once already (its restores waited for).
    released: bool,
    /// The latest tick's process lists waited for the next tick because a doorbell rang.
    lists_put_off: bool,
    /// The pidfds of the processes the controller names (shared with the classifier and
    /// the hands); closed after the tick in which the controller stops naming them.
    pub(crate) pins: Arc<Pins>,
    /// Every note reported (tests).
    #[cfg(test)]
    pub(crate) said: Vec<Note>,
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
        for r in super::note::Reject::ALL {
            metrics::counter!("coloc_doorbell_rejected_total", "reason" => r.as_str()).absolute(0);
        }
        metrics::counter!("coloc_doorbell_wakeups_total").absolute(0);
        let gpus = edges.gpu.gpus();
        let uuids: Vec<(u32, String)> = gpus.iter().map(|g| (*g, edges.gpu.uuid(*g))).collect();
        for (gpu, uuid) in &uuids {
            if coloc_doorbell::parse_uuid(uuid).is_none() {
                warn!(gpu, %uuid, "GPU UUID not in NVML's form: doorbells cannot name this GPU");
            }
        }
        let chooser = Chooser {
            preferred: cfg.actuator,
            mounts: cfg.cgroups.clone(),
            own: edges.procfs.self_cgroups(),
        };
        let gate_file = edges.gates.as_ref().map(|g| g.path().to_path_buf());
        let on_disk = edges.record.entries().clone();
        let scribe: Box<dyn scribe::Writer> = Box::new(if cfg.record_off_loop {
            Scribe::spawn(edges.record, edges.bells.waker())?
        } else {
            Scribe::Inline(edges.record)
        });
        // `/metrics` labels every per-GPU series with its GPU's UUID.
        let _ = shared.gpu_uuids.set(uuids.iter().cloned().collect());
        let ctl = Controller::new(&cfg, uuids, edges.clock.now_ns(), gate_file, on_disk);
        let pins = Arc::new(Pins::default());
        let classifier = Classifier::new(edges.procfs.clone(), edges.source, chooser, pins.clone());
        let driver = edges.driver;
        let hands = Hands::new(
            edges.actuator,
            edges.procfs,
            edges.clock.clone(),
            edges.gates,
            crate::edges::actuator::cell::Cells::on(&cfg.cgroups),
            pins.clone(),
        );
        Ok(Loop {
            ctl,
            eyes: Eyes::new(edges.gpu, edges.bells, classifier),
            hands: Arc::new(Mutex::new(hands)),
            scribe,
            driver,
            clock: edges.clock,
            watchdog: Arc::new(Watchdog::default()),
            telemetry: Telemetry::new(&gpus, event_log),
            shared,
            gpus,
            last_tick_ns: None,
            slept: None,
            released: false,
            lists_put_off: false,
            pins,
            #[cfg(test)]
            said: Vec::new(),
            cfg,
        })
    }

    /// Writes the record through `w` from now on (a model of the state directory whose
    /// writes land when the test says).
    #[cfg(test)]
    pub(crate) fn set_writer(&mut self, w: Box<dyn scribe::Writer>) {
        self.scribe = w;
    }

    pub(crate) fn hands(&self) -> MutexGuard<'_, Hands> {
        self.hands.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The hold book.
    pub fn holds(&self) -> &HoldBook {
        self.ctl.holds()
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
            self.tick();
            // From now: the tick's own time is already behind `now`.
            let now = self.clock.now_ns();
            let sleep = Duration::from_nanos(self.ctl.poll_timeout(now).saturating_sub(now));
            let slept_ns = self.clock.now_ns();
            if !sleep.is_zero() && self.eyes.bells.wait(sleep) {
                metrics::counter!("coloc_doorbell_wakeups_total").increment(1);
            }
            self.slept = Some((slept_ns, self.clock.now_ns()));
        }
        info!("Stopping: resuming all offline work before exit");
        self.release_everything(ReleaseAll::Shutdown);
    }

    /// One tick: the controller's conversation, then the gauges and the time accounting.
    pub fn tick(&mut self) {
        let now = self.clock.now_ns();
        let dt = self.last_tick_ns.map_or(0, |l| now.saturating_sub(l));
        if self.last_tick_ns.is_some() {
            let lag = dt.saturating_sub(self.cfg.poll.as_nanos() as u64);
            self.telemetry.lag.record(lag as f64 / 1e9);
        }
        self.last_tick_ns = Some(now);
        self.telemetry.flush_tenant_lines(std::time::Instant::now());
        let generation = self.eyes.classifier.source.generation();
        let reads = self.ctl.start_tick(now, self.slept, generation);
        let snapshot = self.gather(now, reads);
        self.converse(snapshot);
        let ctl = &self.ctl;
        self.pins.retain(|k| ctl.names(k));
        self.account(dt);
        {
            let mut e = self.shared.earned.lock().unwrap_or_else(|e| e.into_inner());
            for s in self.ctl.summary() {
                e.runs.offline_running(s.gpu, now, s.offline > s.suspended);
            }
        }
        self.shared.mark_tick(now);
    }

    /// Tells the controller `o` out of a tick (and performs what follows).
    #[cfg(test)]
    pub(crate) fn tell(&mut self, o: Obs) {
        self.converse(vec![o]);
    }

    /// How long the loop may sleep from `now`.
    pub fn next_wait(&self, now: u64) -> Duration {
        self.ctl.next_wait(now)
    }

    /// The tick's snapshot ([`Reads`]): the doorbells first, then the NVML reads due —
    /// the samples stop after the GPU in progress when a doorbell rings, the lists wait for
    /// the next tick when one rang (once in a row at most: a page that keeps ringing never
    /// starves them) — then GPU memory (not after a ring), and the doorbells again when one
    /// rang during the NVML reads, so that the launch is decided in this tick. The lists are
    /// read when not due if a sample names a PID the controller does not know (no ring), or
    /// if a page names a process it does not hold yet (then the pages again). Returns the
    /// snapshot, then what else came of the reads (the watchdog's trips). `now`: the
    /// tick's time.
    fn gather(&mut self, now: u64, reads: Reads) -> Vec<Obs> {
        let Reads {
            bells: read_bells,
            samples,
            lists,
            memory,
        } = reads;
        let Loop {
            ctl,
            eyes,
            watchdog,
            hands,
            clock,
            gpus,
            lists_put_off,
            shared,
            ..
        } = self;
        let known = ctl.known();
        let mut other = Vec::new();
        let mut watched = |f: &mut dyn FnMut()| {
            watchdog.enter(clock.elapsed_ns());
            f();
            if watchdog.leave(hands) {
                other.push(Obs::WatchdogTripped);
            }
        };
        let mut bells = eyes.bells(read_bells);
        time_runs(shared, &bells);
        let mut rang = false;
        let mut read_samples = None;
        if let Some(due) = samples {
            watched(&mut || read_samples = Some(eyes.samples(&due)));
            rang |= read_samples.as_ref().is_some_and(|s| s.yielded);
        }
        let mut read_lists = None;
        let mut why = None;
        if let Some(due) = lists {
            rang = rang || eyes.bells.rang();
            if rang && !*lists_put_off {
                *lists_put_off = true;
                metrics::counter!("coloc_nvml_rounds_yielded_total").increment(1);
            } else {
                *lists_put_off = false;
                why = Some(due);
            }
        } else if !rang
            && read_samples.iter().any(|s| {
                s.read.iter().any(|(g, r)| {
                    r.iter()
                        .flatten()
                        .any(|a| known.sample_unknown(*g, a.pid, a.at_ns))
                })
            })
        {
            why = Some(Refresh::UnknownPid);
        }
        if let Some(why) = why {
            watched(&mut || read_lists = Some(eyes.lists(gpus, why, &known)));
        }
        let mut read_memory = None;
        if let Some(due) = memory.filter(|_| !rang) {
            watched(&mut || read_memory = Some(eyes.memory(&due)));
        }
        let mut again = rang;
        // A launch of a process the lists do not hold yet (it has just started): the lists
        // now, unless they were read already, and the pages again, so that it is
        // attributed in this tick.
        if eyes.names_unknown(&bells, &known, now) && read_lists.is_none() {
            watched(&mut || read_lists = Some(eyes.lists(gpus, Refresh::Doorbell, &known)));
            again = true;
        }
        if again {
            let latest = eyes.bells(BellsRead {
                force: false,
                sweep: false,
                gate: read_bells.gate,
            });
            time_runs(shared, &latest);
            // The latest readings; the page set as of its latest change.
            if latest.pages.is_some() {
                bells.pages = latest.pages;
            }
            bells.readings = latest.readings;
            bells.gates = latest.gates;
        }
        let mut out = vec![Obs::Snapshot(Box::new(Snapshot {
            bells,
            samples: read_samples,
            lists: read_lists,
            memory: read_memory,
            rang,
        }))];
        out.append(&mut other);
        out
    }

    /// Steps the controller and performs what it asks until it asks for nothing more.
    fn converse(&mut self, obs: Vec<Obs>) {
        for o in obs {
            self.ctl.handle(o);
        }
        loop {
            for o in self.scribe.landed() {
                self.ctl.handle(o);
            }
            if let Some(d) = &mut self.driver {
                for done in d.finished() {
                    self.ctl.handle(Obs::Driver(done));
                }
            }
            let Some(cmd) = self.ctl.poll_command(self.clock.now_ns()) else {
                return;
            };
            for o in self.perform(vec![cmd]) {
                self.ctl.handle(o);
            }
        }
    }

    /// Performs `cmds` in order; returns what came of them.
    fn perform(&mut self, cmds: Vec<Cmd>) -> Vec<Obs> {
        let mut out = Vec::new();
        for cmd in cmds {
            match cmd {
                Cmd::PreferPages(ids) => self.eyes.bells.prefer(&ids),
                Cmd::Hold(c) => {
                    let answer = self.hands().perform(c);
                    // A shim with nothing in flight acknowledges a close at once: its
                    // fields are read now, so that its fallback starts in this tick.
                    let closed = matches!(answer, Some(HoldObs::GateClosed { epoch: Some(_), .. }));
                    out.extend(answer.map(Obs::Hold));
                    if closed {
                        out.push(Obs::GateFields(self.eyes.gate_fields()));
                    }
                }
                Cmd::Write(w) => out.extend(self.scribe.write(w)),
                Cmd::Beat => self.hands().keepalive(),
                Cmd::Emit(ev) => render::event(&mut self.telemetry, ev),
                Cmd::Note(n) => self.report(n),
                Cmd::Degraded(why) => {
                    if self.shared.set_degraded(why.clone()) && why.is_none() {
                        note::NvmlAllRecovered.emit(&mut self.telemetry);
                    }
                }
                Cmd::Publish(doc) => self.publish(*doc),
                Cmd::Driver(call) => match &mut self.driver {
                    Some(d) => {
                        d.start(call.key, call.op, call.timeout);
                    }
                    None => out.push(Obs::Driver(crate::edges::checkpoint::Done {
                        id: 0,
                        key: call.key,
                        op: call.op,
                        end: crate::edges::checkpoint::CallEnd::Answered(Err(
                            crate::edges::checkpoint::CuError {
                                op: call.op,
                                code: -1,
                                name: "NO_API".into(),
                            },
                        )),
                        state: None,
                        elapsed: Duration::ZERO,
                    })),
                },
            }
        }
        out
    }

    /// Says a note: its own [`render::Emit`].
    fn report(&mut self, n: Note) {
        #[cfg(test)]
        self.said.push(n.clone());
        n.emit(&mut self.telemetry);
    }

    /// `/state`: the controller's document, with telemetry's history.
    fn publish(&mut self, mut doc: StateDoc) {
        let now = doc.updated_ns;
        let ms_ago = |t: u64| now.saturating_sub(t) as f64 / 1e6;
        for g in &mut doc.gpus {
            if let Some(h) = self.telemetry.history.get(&g.index) {
                g.last_preemption_ms_ago = h.last_preempt_ns.map(ms_ago);
                g.preemption_ms = Summary::of(h.preemption_ms.iter().copied());
                g.release_ms = Summary::of(h.release_ms.iter().copied());
            }
        }
        doc.degraded_reason = self.shared.degraded();
        doc.degraded = doc.degraded_reason.is_some();
        doc.recent_events = self.telemetry.recent.iter().cloned().collect();
        self.telemetry.export_coverage(&doc);
        (self.shared.earned.lock().unwrap_or_else(|e| e.into_inner())).account(&mut doc);
        *self.shared.state.lock().unwrap_or_else(|e| e.into_inner()) = doc;
    }

    /// The gauges of the latest decision, and `dt_ns` added to each GPU's suspended and
    /// reclaimed time.
    fn account(&mut self, dt_ns: u64) {
        let dts = dt_ns as f64 / 1e9;
        let mut secs = self
            .shared
            .gpu_seconds
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for s in self.ctl.summary() {
            if let Some(m) = self.telemetry.gpus.get(&s.gpu) {
                m.set_busy(s.busy);
                m.set_suspended(s.suspended);
            }
            let acc = secs.entry(s.gpu).or_default();
            if s.suspended > 0 {
                acc.suspended += dts;
            }
            if !s.busy && s.offline > s.suspended {
                acc.reclaimed += dts;
            }
        }
        drop(secs);
        let driver_book = self.ctl.driver_book();
        if driver_book.active() {
            metrics::gauge!("coloc_driver_locked_processes").set(driver_book.locked() as f64);
            for (gpu, m) in driver_book.summary() {
                let g = gpu.to_string();
                metrics::gauge!("coloc_checkpointed_processes", "gpu" => g.clone())
                    .set(m.checkpointed as f64);
                metrics::gauge!("coloc_checkpointed_bytes", "gpu" => g.clone())
                    .set(m.checkpointed_bytes as f64);
                metrics::gauge!("coloc_gpu_memory_free_bytes", "gpu" => g.clone())
                    .set(m.free_bytes as f64);
                metrics::gauge!("coloc_gpu_memory_reserve_bytes", "gpu" => g.clone())
                    .set(m.reserve_bytes as f64);
                metrics::gauge!("coloc_memory_pressure", "gpu" => g).set(if m.pressure {
                    1.0
                } else {
                    0.0
                });
            }
        }
    }

    /// Resumes every held target and forgets all suspensions (shutdown, panic); waits for
    /// the record's last writes.
    pub fn release_everything(&mut self, reason: ReleaseAll) {
        self.released = true;
        self.converse(vec![Obs::ReleaseAll(reason)]);
        let deadline = self.deadline(LAST_WRITES);
        while self.ctl.record().writing() {
            let left = self.left_until(deadline);
            match self.scribe.wait(left) {
                Some(o) => self.converse(vec![o]),
                None => {
                    error!("The record's last writes did not land in time: the next start resumes what it holds");
                    break;
                }
            }
        }
        self.last_restores();
    }

    /// Waits for the driver to restore and unlock what the driver book holds (the holds were
    /// released first: a restore needs its process thawed), and for the record to let
    /// them go.
    fn last_restores(&mut self) {
        if self.ctl.driver_idle() {
            return;
        }
        info!(
            budget_s = LAST_RESTORES.as_secs(),
            "Restoring and unlocking what the CUDA driver holds before exit"
        );
        let deadline = self.deadline(LAST_RESTORES);
        while !self.ctl.driver_idle() || self.ctl.record().writing() {
            let left = self.left_until(deadline);
            if left.is_zero() {
                error!("The CUDA driver still holds offline work: left in the record for `coloc-agent resume` and the next start");
                break;
            }
            let slice = left.min(Duration::from_millis(50));
            let mut obs: Vec<Obs> = Vec::new();
            if let Some(d) = self.driver.as_mut().and_then(|d| d.wait_next(slice)) {
                obs.push(Obs::Driver(d));
            } else if self.driver.is_none() {
                break;
            }
            if self.ctl.record().writing() {
                obs.extend(self.scribe.wait(Duration::from_millis(1)));
            }
            self.converse(obs);
        }
    }

    /// A deadline `budget` from now, in the loop's elapsed time ([`Clock::elapsed_ns`], not
    /// the wall clock: an NTP step neither cuts the agent's way out short nor stretches it)
    /// and in real time, whichever comes first (a test's clock that stands still cannot
    /// stretch it either).
    fn deadline(&self, budget: Duration) -> (u64, Instant) {
        (
            self.clock.elapsed_ns() + budget.as_nanos() as u64,
            Instant::now() + budget,
        )
    }

    /// How long until `deadline` (see [`Loop::deadline`]).
    fn left_until(&self, (clock, real): (u64, Instant)) -> Duration {
        Duration::from_nanos(clock.saturating_sub(self.clock.elapsed_ns()))
            .min(real.saturating_duration_since(Instant::now()))
    }

    /// The handle shared with the HTTP server.
    pub fn shared(&self) -> Arc<Shared> {
        self.shared.clone()
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        // Reached on normal exit (already empty) and on a panic unwinding the loop.
        // (a shutdown that released everything already left only what the driver did not
        // give back in time: recorded, not waited for twice)
        if !self.ctl.holds().is_empty() || (!self.released && !self.ctl.driver_idle()) {
            error!("Control loop ending with offline work suspended: resuming it");
            self.release_everything(ReleaseAll::Panic);
        }
        // Whatever the book lost track of (a conversation a panic cut short, a resume that
        // failed): the hands still know what they stopped.
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

/// Times online work's runs from the doorbell readings (`earned::Runs`).
fn time_runs(shared: &Shared, bells: &Bells) {
    let Some(uuids) = shared.gpu_uuids.get() else {
        return;
    };
    let mut e = shared.earned.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = &bells.pages {
        e.runs.pages(p);
    }
    crate::earned::record_runs(&e.runs.observe(&bells.readings, uuids));
}
