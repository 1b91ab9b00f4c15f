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
//! shell gathers it, the doorbells first (a launch is never read after an NVML call that
//! did not have to come first), and hands the snapshot to the first step. The controller
//! judges it (classifying what the lists name for the first time), runs the state machine,
//! and asks for what the hold book needs (the record first, then the actuator); the shell
//! performs each round of commands and feeds the answers back, until the controller asks
//! for nothing more.
//!
//! ```text
//!  start_tick ─► Reads ─► shell: bells, samples (stop at a ring), lists (not after a ring),
//!                                bells again (after a ring) ─► Snapshot
//!  step(Snapshot) ─► samples ─► lists [─► Classify] ─► judge (health) ─► attribute the bells
//!      [─► ReadLists, ReadBells: a launch of a process the lists do not hold yet]
//!      ─► gate acks ─► [memory] ─► book ─► retries ─► Machine::tick ─► plans ─► book.suspend/resume
//!      ─► (record book: at once, or Write … Written) ─► Start/Check … ─► events ─► publish
//! ```
//!
//! Record before act is the order of that conversation: the hold book asks for a
//! suspension's `Start` only in answer to `Recorded { ok: true }`, which the record book
//! gives once the entries are on disk ([`crate::control::record`]).
//!
//! This file holds the conversation (where the tick stands, the answers awaited); the
//! sub-states and what a tick does with them are [`Substates`].

use super::io::{Cmd, Obs, Reads};
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
    /// The samples, if due.
    Observe,
    /// The lists, if due (after the samples); `judge`: this tick's regular read.
    Lists {
        /// This tick's regular read (else the one a doorbell asked for).
        judge: bool,
    },
    /// Read the doorbells (`again`: after the lists a doorbell asked for).
    Bells {
        /// The second read of the tick.
        again: bool,
    },
    /// The gate holds' acknowledgements.
    Gates,
    /// GPU memory, if due (memory preemption).
    Memory,
    /// The hold book's conversation, then the stage in the box.
    Drain(Box<Stage>),
    /// Retries, the heartbeat and the decision.
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
    /// Answers awaited this round.
    awaiting: usize,
    /// A record write was asked for: the round ends there, so that an answer the shell
    /// gives at once is taken in before the conversation goes on.
    yielding: bool,
    /// This round's answers.
    answers: Vec<Obs>,
    /// What is left of the tick's snapshot.
    snapshot: Vec<Obs>,
    /// A doorbell rang during the snapshot's NVML reads.
    rang: bool,
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
            snapshot: Vec::new(),
            rang: false,
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
        self.snapshot.clear();
        self.rang = false;
        let lists = (self.sub.observed.list_due(now)).map(|why| self.read_lists(why));
        let samples = (self.sub.observed.samples_due(now)).map(|gpus| Cmd::ReadSamples { gpus });
        let memory = (self.sub.vault)
            .memory_due(now, &self.sub.observed.table)
            .map(|gpus| Cmd::ReadMemory { gpus });
        Reads {
            bells: self.sub.observed.bells_due(now),
            samples,
            lists,
            memory,
        }
    }

    /// The lists read for `why`: checked against the processes the controller knows, with
    /// the members of the cgroups a suspension would hold whole read again.
    fn read_lists(&self, why: super::nvml::Refresh) -> Cmd {
        Cmd::ReadLists {
            why,
            known: self.known(),
            cgroups: self.sub.observed.table.whole_cgroups(),
        }
    }

    /// The processes the lists are checked against: the table's, and those the driver
    /// holds checkpointed (they have left the lists), with their pins.
    fn known(&self) -> Vec<(ProcKey, bool)> {
        let mut known = self.sub.observed.table.known();
        for (k, pin) in self.sub.vault.known() {
            if !known.iter().any(|(kk, _)| *kk == k) {
                known.push((k, pin));
            }
        }
        known
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
    pub fn step(&mut self, now: u64, obs: Vec<Obs>) -> Vec<Cmd> {
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
        self.sub.vault_round(now);
        if !self.yielding {
            self.sub.write(now);
        }
        self.sub.flush();
        std::mem::take(&mut self.sub.out)
    }

    fn take(&mut self, o: Obs, now: u64) {
        match o {
            Obs::Snapshot { reads, rang } => {
                self.snapshot = reads;
                self.rang = rang;
            }
            Obs::Written { id, ok } => self.sub.written(id, ok, now),
            Obs::Driver(d) => self.sub.vault.done(d, now),
            Obs::WatchdogTripped => self.sub.after_watchdog(now),
            Obs::GateFields(gates) => self.sub.gate_fields(gates),
            Obs::ReleaseAll(reason) => {
                let n = self.sub.release_all(reason);
                self.stage = Stage::Drain(Box::new(Stage::Released(reason, n)));
            }
            o => {
                self.awaiting -= 1;
                self.answers.push(o);
            }
        }
    }

    /// Asks for something answered in this round.
    fn ask(&mut self, cmd: Cmd) {
        self.awaiting += 1;
        self.sub.out.push(cmd);
    }

    /// The answer of this round that `pick` takes, if any.
    fn answer<T>(&mut self, pick: impl Fn(Obs) -> Result<T, Obs>) -> Option<T> {
        take_one(&mut self.answers, pick)
    }

    /// The read of the tick's snapshot that `pick` takes, if any.
    fn snapshot<T>(&mut self, pick: impl Fn(Obs) -> Result<T, Obs>) -> Option<T> {
        take_one(&mut self.snapshot, pick)
    }

    /// Runs one stage; returns the next (the same one when it waits for answers).
    fn run(&mut self, stage: Stage, now: u64) -> Stage {
        let t = self.tick_ns;
        match stage {
            Stage::Idle => Stage::Idle,
            Stage::Observe => {
                let samples = self.snapshot(|o| match o {
                    Obs::Samples { read, yielded } => Ok((read, yielded)),
                    o => Err(o),
                });
                if let Some((read, yielded)) = samples {
                    self.sub.observed.samples(read, yielded, t);
                }
                Stage::Lists { judge: true }
            }
            Stage::Lists { judge } => self.lists(judge, t),
            Stage::Bells { again } => {
                let pick = |o| match o {
                    Obs::Bells {
                        pages,
                        readings,
                        gates,
                    } => Ok((pages, readings, gates)),
                    o => Err(o),
                };
                let read = match again {
                    false => self.snapshot(pick).or_else(|| self.answer(pick)),
                    true => self.answer(pick),
                };
                let Some((pages, readings, gates)) = read else {
                    let cmd = self.sub.observed.bells_due(t);
                    self.ask(cmd);
                    return Stage::Bells { again };
                };
                // A launch of a process that the driver's lists did not hold yet (it has
                // just started): read the lists now and attribute the launch in this tick.
                // Not judged: the health policy counts one judgement per tick.
                if self.sub.observed.bells_read(t, pages, &readings, gates) && !again {
                    return Stage::Lists { judge: false };
                }
                Stage::Gates
            }
            Stage::Gates => {
                self.sub.gate_acks();
                Stage::Memory
            }
            Stage::Memory => {
                let read = self.snapshot(|o| match o {
                    Obs::Memory { reads, room } => Ok((reads, room)),
                    o => Err(o),
                });
                if let Some((m, room)) = read {
                    self.sub.memory(t, m, room);
                }
                Stage::Drain(Box::new(Stage::Decide))
            }
            Stage::Drain(then) => {
                let answers = self.take_holds();
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

    /// This round's answers to hold commands.
    fn take_holds(&mut self) -> Vec<super::holds::HoldObs> {
        let mut out = Vec::new();
        for o in std::mem::take(&mut self.answers) {
            match o {
                Obs::Hold(h) => out.push(h),
                o => self.answers.push(o),
            }
        }
        out
    }

    /// The lists, when due (`judge`: the tick's regular read; else a doorbell asked), and
    /// the classification of what they name.
    fn lists(&mut self, judge: bool, t: u64) -> Stage {
        let after = |judged: bool, sub: &mut Substates| {
            if judged {
                sub.observed.judge_tick(t, &sub.machine);
                Stage::Bells { again: false }
            } else {
                Stage::Bells { again: true }
            }
        };
        let classified = self.answer(|o| match o {
            Obs::Classified(c) => Ok(c),
            o => Err(o),
        });
        let pick = |o| match o {
            Obs::Lists {
                listed,
                failed,
                gone,
                generation,
                why,
                members,
            } => Ok((listed, failed, gone, generation, why, members)),
            o => Err(o),
        };
        let mut lists = self.answer(pick);
        if lists.is_none() && judge {
            // The snapshot's lists, read for why they were due.
            lists = self.snapshot(pick);
            if let Some((.., why, _)) = &lists {
                self.sub.observed.lists_read_for(*why);
            }
        }
        let lists = lists.map(|(listed, failed, gone, generation, _, members)| {
            // What the cgroups a suspension would hold whole hold now (rules mode).
            for (dir, m) in members {
                self.sub.observed.table.members_read(&dir, m);
            }
            (listed, failed, gone, generation)
        });
        match (lists, classified) {
            (None, _) => {
                // Not in the snapshot: read now for samples of PIDs the table does not
                // know (unless a doorbell rang: then at the next tick), or for a launch of
                // a process the lists do not hold yet.
                let why = if !judge {
                    Some(super::nvml::Refresh::Doorbell)
                } else if !self.rang && self.sub.observed.unknown_pids() {
                    self.sub
                        .observed
                        .lists_read_for(super::nvml::Refresh::UnknownPid);
                    Some(super::nvml::Refresh::UnknownPid)
                } else {
                    None
                };
                let Some(why) = why else {
                    return after(judge, &mut self.sub);
                };
                let cmd = self.read_lists(why);
                self.ask(cmd);
                Stage::Lists { judge }
            }
            (Some((listed, failed, gone, generation)), None) => {
                self.sub.vault.gone(&gone);
                let pids = self
                    .sub
                    .observed
                    .listed(t, &listed, &failed, &gone, generation);
                if pids.is_empty() {
                    self.sub
                        .observed
                        .apply_lists(t, listed, failed, generation, Vec::new());
                    return after(judge, &mut self.sub);
                }
                // The lists wait with the answers for their classification.
                self.answers.push(Obs::Lists {
                    why: super::nvml::Refresh::Interval,
                    listed,
                    failed,
                    gone,
                    generation,
                    members: Vec::new(),
                });
                self.ask(Cmd::Classify { pids, generation });
                Stage::Lists { judge }
            }
            (Some((listed, failed, _, generation)), Some(classified)) => {
                self.sub
                    .observed
                    .apply_lists(t, listed, failed, generation, classified);
                after(judge, &mut self.sub)
            }
        }
    }

    /// Whether the controller names process `key` anywhere (its table, a hold, the vault):
    /// the shell keeps its pin while it does.
    pub fn names(&self, key: &ProcKey) -> bool {
        let r = &self.sub;
        r.observed.table.entry(key).is_some()
            || r.vault.knows(key)
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

    /// The vault (the driver's lock, memory preemption).
    pub fn vault(&self) -> &super::vault::Vault {
        &self.sub.vault
    }

    /// Whether the driver holds nothing the vault put there, and no call is in flight.
    pub fn vault_idle(&self) -> bool {
        self.sub.vault.idle()
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

/// Takes the first of `from` that `pick` takes, leaving the others in order.
fn take_one<T>(from: &mut Vec<Obs>, pick: impl Fn(Obs) -> Result<T, Obs>) -> Option<T> {
    let mut found = None;
    for o in std::mem::take(from) {
        match found {
            None => match pick(o) {
                Ok(t) => found = Some(t),
                Err(o) => from.push(o),
            },
            Some(_) => from.push(o),
        }
    }
    found
}
