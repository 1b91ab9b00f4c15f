//! The controller: every decision of the agent, and no I/O. It is told what the shell
//! observed ([`Obs`]) and answers with what to do, in order ([`Cmd`]):
//! `Controller::step(now, observations) -> commands`. No edge, no clock, no log line and
//! no metric inside: time is an argument, and telemetry leaves as commands.
//!
//! The shell talks to it in quinn-proto's shape: each observation is handed in
//! ([`Controller::handle`]), each command polled ([`Controller::poll_command`], which runs
//! `step` once every command of the latest step was polled), and the loop sleeps until
//! [`Controller::poll_timeout`] or a doorbell.
//!
//! A tick starts with [`Controller::start_tick`], which says what is due ([`Reads`]); the
//! shell gathers it into one snapshot, the doorbells first (a launch is never read after
//! an NVML call that did not have to come first), with everything else the tick reads:
//! the classification of the PIDs the lists name that the controller does not know, the
//! lists for a launch of a process they do not hold yet (judged from [`Known`]), GPU
//! memory. The first step takes the snapshot in whole; no read is asked for after it. The
//! controller then runs the state machine, chooses each suspension's plan, and asks for
//! what the hold book needs (the record first, then the actuator); the shell performs
//! each round of commands and feeds the answers back, until the controller asks for
//! nothing more.
//!
//! ```text
//!  start_tick ─► Reads ─► shell: bells, samples (stop at a ring), lists + classification
//!                         (not after a ring), memory (not after a ring), bells again (after
//!                         a ring); lists and bells again for a page of an unknown process
//!                         ─► Snapshot
//!  step(Snapshot) ─► samples ─► lists ─► judge (health) ─► attribute the bells ─► gate acks
//!      ─► memory ─► book ─► retries ─► Machine::tick ─► plans ─► book.suspend/resume
//!      ─► (record book: at once, or Write … Written) ─► Start/Check … ─► events ─► publish
//! ```
//!
//! Record before act is the order of that conversation: the hold book asks for a
//! suspension's `Start` only in answer to `Recorded { ok: true }`, which the record book
//! gives once the entries are on disk ([`crate::control::record`]).
//!
//! This file holds the conversation (where the tick stands, the hold book's answers
//! awaited); the sub-states and what a tick does with them are [`Substates`].

use super::holds::HoldObs;
use super::io::{Cmd, Known, Obs, Reads, Snapshot};
use super::substates::Substates;
use super::{LoopConfig, ReleaseAll};
use crate::control::model::act::RecordEntry;
use crate::control::model::ProcKey;
use std::collections::BTreeSet;
use std::path::PathBuf;

/// Where the tick's conversation stands.
#[derive(Debug)]
enum Stage {
    /// Between ticks.
    Idle,
    /// The tick's snapshot, taken in whole.
    Observe,
    /// The hold book's conversation, then the stage in the box.
    Drain(Box<Stage>),
    /// Retries, the heartbeat, the decision and its holds.
    Decide,
    /// After the decision's holds: the pending confirmations.
    Poll,
    /// After the confirmations: the re-check.
    Recheck,
    /// After the re-check: broken holds, failures, purge, publication.
    Finish,
    /// Out of a tick, after a record write landed: what the book did with it.
    Settle,
    /// Everything was resumed (this many holds), for this reason.
    Released(ReleaseAll, usize),
}

/// See the module.
pub struct Controller {
    /// The sub-states.
    pub(crate) sub: Substates,
    stage: Stage,
    /// The tick's time.
    tick_ns: u64,
    /// The hold book's answers awaited this round.
    awaiting: usize,
    /// A record write was asked for: the round ends there, so that an answer the shell
    /// gives at once is taken in before the conversation goes on.
    yielding: bool,
    /// This round's answers to hold commands.
    answers: Vec<HoldObs>,
    /// The tick's snapshot, until the first step takes it in.
    snapshot: Option<Box<Snapshot>>,
    /// Observations handed in since the latest step ([`Controller::handle`]).
    inbox: Vec<Obs>,
    /// Commands of the latest step not polled yet ([`Controller::poll_command`]).
    outbox: std::collections::VecDeque<Cmd>,
}

impl std::fmt::Debug for Controller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Controller")
            .field("stage", &self.stage)
            .finish_non_exhaustive()
    }
}

impl Controller {
    /// A controller for these GPUs (index, UUID) under `cfg`, started at `now`, with the
    /// gate file (`--gate`), over a record that holds `on_disk`.
    pub fn new(
        cfg: &LoopConfig,
        gpus: Vec<(u32, String)>,
        now: u64,
        gate_file: Option<PathBuf>,
        on_disk: BTreeSet<RecordEntry>,
    ) -> Controller {
        Controller {
            sub: Substates::new(cfg, gpus, now, gate_file, on_disk),
            stage: Stage::Idle,
            tick_ns: now,
            awaiting: 0,
            yielding: false,
            answers: Vec::new(),
            snapshot: None,
            inbox: Vec::new(),
            outbox: std::collections::VecDeque::new(),
        }
    }

    /// A tick starts at `now`, after the loop's latest sleep (went to sleep, woke; ns),
    /// under the pod source's `generation`: what the shell reads before the first step.
    pub fn start_tick(&mut self, now: u64, slept: Option<(u64, u64)>, generation: u64) -> Reads {
        debug_assert!(matches!(self.stage, Stage::Idle), "a tick inside a tick");
        self.tick_ns = now;
        self.sub.start_tick(slept, generation);
        self.stage = Stage::Observe;
        self.snapshot = None;
        let observed = &mut self.sub.observed;
        Reads {
            bells: observed.bells_due(now),
            samples: observed.samples_due(now),
            lists: observed.list_due(now),
            memory: self.sub.driver_book.memory_due(now, &observed.table),
        }
    }

    /// What the controller knows, as the shell needs it while it gathers the snapshot.
    pub fn known(&self) -> Known<'_> {
        Known {
            observed: &self.sub.observed,
            driver_book: &self.sub.driver_book,
        }
    }

    /// Hands in one observation (quinn's `handle_*`): taken in by the step that
    /// [`Controller::poll_command`] runs once every command of the latest one was polled.
    pub fn handle(&mut self, obs: Obs) {
        self.inbox.push(obs);
    }

    /// The next command to perform, in order (quinn's `poll_*`); `None`: nothing more
    /// until an observation is handed in or the next tick starts. A command is performed
    /// and what came of it handed in before the next one is polled.
    pub fn poll_command(&mut self, now: u64) -> Option<Cmd> {
        if self.outbox.is_empty() {
            let obs = std::mem::take(&mut self.inbox);
            let cmds = self.step(now, obs);
            self.outbox.extend(cmds);
        }
        self.outbox.pop_front()
    }

    /// When the controller wants to be woken, ns (quinn's `poll_timeout`): the loop sleeps
    /// until then, or until a doorbell rings.
    pub fn poll_timeout(&self, now: u64) -> u64 {
        now.saturating_add(self.next_wait(now).as_nanos() as u64)
    }

    /// Takes in what the shell observed at `now` and returns what to do next, in order.
    /// An empty answer ends the conversation (the tick is over).
    fn step(&mut self, now: u64, obs: Vec<Obs>) -> Vec<Cmd> {
        for o in obs {
            self.take(o, now);
        }
        if matches!(self.stage, Stage::Idle) && self.sub.book.has_commands() {
            self.stage = Stage::Drain(Box::new(Stage::Settle));
        }
        self.yielding = false;
        while self.awaiting == 0 && !self.yielding && !matches!(self.stage, Stage::Idle) {
            let stage = std::mem::replace(&mut self.stage, Stage::Idle);
            self.stage = self.run(stage, now);
            self.sub.flush();
        }
        self.sub.driver_round(now);
        if !self.yielding {
            self.sub.write(now);
        }
        self.sub.flush();
        std::mem::take(&mut self.sub.out)
    }

    fn take(&mut self, o: Obs, now: u64) {
        match o {
            Obs::Snapshot(s) => self.snapshot = Some(s),
            Obs::Written { id, ok } => self.sub.written(id, ok, now),
            Obs::Driver(d) => self.sub.driver_book.done(d, now),
            Obs::WatchdogTripped => self.sub.after_watchdog(now),
            Obs::GateFields(gates) => self.sub.gate_fields(gates),
            Obs::ReleaseAll(reason) => {
                let n = self.sub.release_all(reason);
                self.stage = Stage::Drain(Box::new(Stage::Released(reason, n)));
            }
            Obs::Hold(h) => {
                self.awaiting -= 1;
                self.answers.push(h);
            }
        }
    }

    /// Asks for something answered in this round.
    fn ask(&mut self, cmd: Cmd) {
        self.awaiting += 1;
        self.sub.out.push(cmd);
    }

    /// Runs one stage; returns the next (the same one when it waits for answers).
    fn run(&mut self, stage: Stage, now: u64) -> Stage {
        let t = self.tick_ns;
        match stage {
            Stage::Idle => Stage::Idle,
            Stage::Observe => {
                if let Some(s) = self.snapshot.take() {
                    self.sub.observe(*s, t);
                }
                Stage::Drain(Box::new(Stage::Decide))
            }
            Stage::Drain(then) => {
                let answers = std::mem::take(&mut self.answers);
                let (asks, wrote) = self.sub.hold_round(answers, now);
                self.yielding = wrote;
                if asks.is_empty() && !wrote {
                    return *then;
                }
                for c in asks {
                    self.ask(c);
                }
                Stage::Drain(then)
            }
            Stage::Decide => match self.sub.decide(t) {
                None => Stage::Poll,
                Some(d) => {
                    self.sub.execute(d, now);
                    Stage::Drain(Box::new(Stage::Poll))
                }
            },
            Stage::Poll => {
                self.sub.poll(t);
                Stage::Drain(Box::new(Stage::Recheck))
            }
            Stage::Recheck => {
                self.sub.recheck(t);
                Stage::Drain(Box::new(Stage::Finish))
            }
            Stage::Finish => {
                self.sub.finish(t);
                Stage::Idle
            }
            Stage::Settle => {
                self.sub.settle(t);
                Stage::Idle
            }
            Stage::Released(reason, n) => {
                self.sub.released(reason, n, now);
                Stage::Idle
            }
        }
    }

    /// Whether the controller names process `key` anywhere (its table, a hold, the driver book):
    /// the shell keeps its pin while it does.
    pub fn names(&self, key: &ProcKey) -> bool {
        let r = &self.sub;
        r.observed.table.entry(key).is_some()
            || r.driver_book.knows(key)
            || r.book.holds(key)
            || r.book.stops(key, None)
    }

    /// How long the loop may sleep from `now` (a doorbell ends the sleep early).
    pub fn next_wait(&self, now: u64) -> std::time::Duration {
        self.sub.next_wait(now)
    }

    /// Per GPU, as of the latest decision (the gauges and the time accounting).
    pub fn summary(&self) -> &[super::publish::GpuSummary] {
        self.sub.summary()
    }

    /// The hold book.
    pub fn holds(&self) -> &super::holds::HoldBook {
        self.sub.holds()
    }

    /// The driver book (the driver's lock, memory preemption).
    pub fn driver_book(&self) -> &super::driver_book::DriverBook {
        &self.sub.driver_book
    }

    /// Whether the driver holds nothing the driver book put there, and no call is in flight.
    pub fn driver_idle(&self) -> bool {
        self.sub.driver_book.idle()
    }

    /// The record book.
    pub fn record(&self) -> &super::record::RecordBook {
        self.sub.record()
    }

    /// The process table.
    pub fn table(&self) -> &super::table::Table {
        &self.sub.observed.table
    }
}
