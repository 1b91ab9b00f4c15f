//! The controller's sub-states together, and what a tick does with them once the shell
//! has answered. Each sub-state is a type of its own, in its own file, and meets the
//! others only here, through explicit arguments: what the controller has [`Observed`]
//! (the process table, the NVML bookkeeping, health, the doorbells, the gate book),
//! `qos_core::Machine` (per GPU), the [`HoldBook`], the [`DriverBook`], the [`RecordBook`],
//! [`Retries`], the event [`Tracker`] and the [`Pacer`]. No I/O: what the sub-states say
//! (notes, events, commands that need no answer) goes to `out`, for the controller to hand
//! to the shell in order.

use super::driver_book::{DriverBook, RecordAsk};
use super::events::{Event, FailOpen, Tracker};
use super::holds::{HoldBook, HoldCmd, HoldObs};
use super::io::Cmd;
use super::note::{self, FailWhy, Note, ReleaseRule};
use super::observed::Observed;
use super::pace::{Due, Pacer};
use super::publish::{GpuSummary, Header};
use super::record::RecordBook;
use super::retry::Retries;
use super::{execute, LoopConfig, ReleaseAll};
use crate::control::model::act::RecordEntry;
use crate::control::model::ProcKey;
use crate::control::target::Target;
use qos_core::{Decision, Machine};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

/// See the module.
pub struct Substates {
    header: Header,
    /// What the controller sees.
    pub(crate) observed: Observed,
    pub(crate) machine: Machine<ProcKey>,
    pub(crate) book: HoldBook,
    /// The driver's lock and memory preemption.
    pub(crate) driver_book: DriverBook,
    record: RecordBook,
    pub(crate) tracker: Tracker,
    retries: Retries,
    pacer: Pacer,
    summary: Vec<GpuSummary>,
    /// Per GPU, the latest release not yet followed by a preemption: (when, learned).
    released_at: BTreeMap<u32, (u64, ReleaseRule)>,
    /// What a learned release must give offline to pay, ns (`--release-ratio` ×
    /// `--release-drain`).
    pays_ns: u64,
    /// The loop's sleep before this tick.
    slept: Option<(u64, u64)>,
    notes: Vec<Note>,
    events: Vec<Event>,
    /// What the sub-states say, in order.
    pub(crate) out: Vec<Cmd>,
    /// Hold commands whose locks the driver book answered and whose other targets went to the
    /// shell: request → (the driver book's answers with their places, how many targets).
    driver_answers:
        BTreeMap<super::holds::Req, (Vec<(usize, crate::control::model::act::Progress)>, usize)>,
    /// Gate fields were read after a gate closed: the next hold round tells the gate holds
    /// what they say.
    fresh_acks: bool,
}

impl std::fmt::Debug for Substates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Substates")
            .field("observed", &self.observed)
            .finish_non_exhaustive()
    }
}

impl Substates {
    /// The sub-states for these GPUs (index, UUID) under `cfg`, at `now`, with the gate file
    /// (`--gate`), over a record that holds `on_disk`.
    pub fn new(
        cfg: &LoopConfig,
        gpus: Vec<(u32, String)>,
        now: u64,
        gate_file: Option<PathBuf>,
        on_disk: BTreeSet<RecordEntry>,
    ) -> Substates {
        let window = cfg.machine.idle_window;
        let mut book = HoldBook::new(cfg.confirm_timeout);
        book.recheck_ns = cfg.recheck.as_nanos() as u64;
        book.gate_timeout = cfg.gate_timeout;
        Substates {
            header: Header {
                node: cfg.node.clone(),
                actuator: cfg.actuator,
                dry_run: cfg.dry_run,
                window_ns: window,
            },
            observed: Observed::new(cfg, gpus, now, gate_file),
            machine: {
                let mut m = Machine::new(cfg.machine);
                if let Some(l) = &cfg.release {
                    m.set_release_floor(if l.at_once { 0 } else { l.adaptive.floor });
                }
                m
            },
            book,
            driver_book: DriverBook::new(cfg.driver_book.clone()),
            record: RecordBook::new(on_disk),
            tracker: Tracker::default(),
            retries: Retries::default(),
            pacer: Pacer::new(cfg.poll, cfg.idle_poll),
            summary: Vec::new(),
            released_at: BTreeMap::new(),
            pays_ns: cfg.release.map_or(0, |l| {
                u64::from(l.adaptive.ratio).saturating_mul(l.drain_ns)
            }),
            slept: None,
            notes: Vec::new(),
            events: Vec::new(),
            out: Vec::new(),
            driver_answers: BTreeMap::new(),
            fresh_acks: false,
        }
    }

    /// A tick starts.
    pub fn start_tick(&mut self, slept: Option<(u64, u64)>, generation: u64) {
        self.slept = slept;
        self.observed.start_tick(generation);
    }

    /// Moves what the sub-states said into `out`, in order.
    pub fn flush(&mut self) {
        if let Some(mut ahead) = self.observed.ahead.take() {
            ahead.extend(self.driver_book.ahead(&self.observed.table));
            self.record.want_ahead(ahead);
        }
        let (notes, events) = self.driver_book.take_notes();
        self.notes.extend(notes);
        self.events.extend(events);
        self.out.append(&mut self.observed.out);
        self.notes.append(&mut self.observed.notes);
        self.events.append(&mut self.observed.events);
        self.notes.extend(self.book.take_notes());
        self.out.extend(self.notes.drain(..).map(Cmd::Note));
        self.out.extend(self.events.drain(..).map(Cmd::Emit));
    }

    /// The tick's snapshot taken in, in the order its reads mean: the samples, the lists
    /// (with the classification of what they name for the first time, and the members of
    /// the cgroups held whole), the health policy's judgement of the tick's NVML calls,
    /// the doorbell readings attributed, the gate holds' acknowledgements, GPU memory.
    pub fn observe(&mut self, s: super::io::Snapshot, t: u64) {
        let super::io::Snapshot {
            bells,
            samples,
            lists,
            memory,
            rang: _,
        } = s;
        if let Some(super::io::Samples { read, yielded }) = samples {
            self.observed.samples(read, yielded, t);
        }
        let listed = lists.is_some();
        if let Some(l) = lists {
            self.driver_book.gone(&l.gone);
            self.observed.lists(t, l);
        }
        self.observed.judge_tick(t, &self.machine);
        self.observed.bells_read(t, bells, listed);
        self.gate_acks();
        if let Some(m) = memory {
            self.memory(t, m.reads, m.room);
        }
    }

    /// The gate holds waiting for their drain are told what their pages say.
    pub fn gate_acks(&mut self) {
        self.observed.gate_acks(&mut self.book);
    }

    /// The offline pages' gate fields, read right after a gate closed: taken in at the
    /// hold round that learns the close's epoch.
    pub fn gate_fields(&mut self, gates: Vec<(u64, Vec<coloc_doorbell::GateReading>)>) {
        self.observed.gates.read(gates);
        self.fresh_acks = true;
    }

    /// One round of the hold book's conversation: what it asks of the record is answered
    /// here (at once, or when a write lands); returns what goes to the shell (each
    /// answered), and whether a record write was asked for. Empty: the book asks nothing.
    pub fn hold_round(&mut self, answers: Vec<HoldObs>, now: u64) -> (Vec<Cmd>, bool) {
        let answers: Vec<HoldObs> = answers
            .into_iter()
            .map(|a| self.merge_driver_answers(a))
            .collect();
        if !answers.is_empty() {
            self.book.observe(answers, now);
        }
        if std::mem::take(&mut self.fresh_acks) {
            self.gate_acks();
        }
        loop {
            let cmds = self.book.take_commands();
            if cmds.is_empty() {
                return (Vec::new(), false);
            }
            let mut asks = Vec::new();
            let mut at_once = Vec::new();
            for c in cmds {
                match c {
                    HoldCmd::RecordAdd { req, entries } => {
                        if let Some(ok) = self.record.add(req, entries) {
                            at_once.push(HoldObs::Recorded { req, ok });
                        }
                    }
                    HoldCmd::RecordRemove { entries } => {
                        let dropped = self.record.remove(&entries);
                        self.book.dropped(&dropped);
                    }
                    c => match self.locks(c, now) {
                        Ok(answer) => at_once.push(answer),
                        Err(c) => asks.push(Cmd::Hold(c)),
                    },
                }
            }
            if !at_once.is_empty() {
                self.book.observe(at_once, now);
            }
            let write = self.write(now);
            if !asks.is_empty() || write {
                return (asks, write);
            }
        }
    }

    /// A lock hold's `Start` or `Check` is answered by the driver book, at once (the driver's
    /// calls it needs go out as [`Cmd::Driver`]); the hold book checks again as it would
    /// an actuator's pending work. Other commands go to the shell.
    fn locks(&mut self, mut c: HoldCmd, now: u64) -> Result<HoldObs, HoldCmd> {
        let (req, op, targets) = match &mut c {
            HoldCmd::Start {
                req, op, targets, ..
            }
            | HoldCmd::Check { req, op, targets } => (*req, *op, targets),
            _ => return Err(c),
        };
        if !targets.iter().any(|t| matches!(t, Target::Lock { .. })) {
            return Err(c);
        }
        let total = targets.len();
        let mut answered = Vec::new();
        let mut rest = Vec::new();
        for (i, t) in std::mem::take(targets).into_iter().enumerate() {
            match t {
                Target::Lock { key } => {
                    let book = &self.book;
                    let stops = |k: &ProcKey, cg: Option<&std::path::Path>| book.stops(k, cg);
                    answered.push((
                        i,
                        self.driver_book.hold(key, op, &self.observed.table, stops),
                    ))
                }
                t => rest.push(t),
            }
        }
        // What the driver book claims in the record is asked for before the hold book can let
        // the lock's entry go.
        self.driver_records();
        if rest.is_empty() {
            return Ok(HoldObs::Progress {
                req,
                progress: answered.into_iter().map(|(_, p)| p).collect(),
                at_ns: now,
            });
        }
        // The other targets go to the shell; its answer gets the driver book's merged in.
        *targets = rest;
        self.driver_answers.insert(req, (answered, total));
        Err(c)
    }

    /// The shell's answer to a command whose locks the driver book answered, made whole.
    fn merge_driver_answers(&mut self, a: HoldObs) -> HoldObs {
        let HoldObs::Progress {
            req,
            progress,
            at_ns,
        } = a
        else {
            return a;
        };
        let Some((answered, total)) = self.driver_answers.remove(&req) else {
            return HoldObs::Progress {
                req,
                progress,
                at_ns,
            };
        };
        let mut shell = progress.into_iter();
        let mut driver_book = answered.into_iter().peekable();
        let mut whole = Vec::with_capacity(total);
        for i in 0..total {
            match driver_book.next_if(|(j, _)| *j == i) {
                Some((_, p)) => whole.push(p),
                None => whole.extend(shell.next()),
            }
        }
        HoldObs::Progress {
            req,
            progress: whole,
            at_ns,
        }
    }

    /// One round of the driver book: its record requests to the record book (answered at once
    /// when on disk already), then the driver calls that can go out now. The hold book
    /// tells which processes a hold stops (a restore waits for their thaw).
    pub fn driver_round(&mut self, now: u64) {
        if !self.driver_book.active() {
            return;
        }
        for _ in 0..2 {
            self.driver_records();
            let book = &self.book;
            self.driver_book.calls(now, |k, cg| book.stops(k, cg));
        }
        self.out
            .extend(self.driver_book.take_calls().into_iter().map(Cmd::Driver));
    }

    /// The driver book's requests to the record book.
    fn driver_records(&mut self) {
        for ask in self.driver_book.take_records() {
            match ask {
                RecordAsk::Add(req, entries) => {
                    if let Some(ok) = self.record.add(req, entries) {
                        self.driver_book.recorded(req, ok);
                    }
                }
                RecordAsk::Remove(entries) => {
                    // Only the driver book's own requests for what it let go (a process
                    // gone): it waits for them no more.
                    self.record.remove(&entries);
                }
            }
        }
    }

    /// Asks for the record's next write, if one is wanted; true if it did.
    pub fn write(&mut self, now: u64) -> bool {
        match self.record.next_write(now) {
            Some(w) => {
                self.out.push(Cmd::Write(w));
                true
            }
            None => false,
        }
    }

    /// A record write landed (or failed): the requests it settles, answered.
    pub fn written(&mut self, id: u64, ok: bool, now: u64) {
        let mut answers = Vec::new();
        for (req, ok) in self.record.written(id, ok, now) {
            if req >= super::driver_book::REQ_BASE {
                self.driver_book.recorded(req, ok);
            } else {
                answers.push(HoldObs::Recorded { req, ok });
            }
        }
        if !answers.is_empty() {
            self.book.observe(answers, now);
        }
    }

    /// The retries that are due, the heartbeat, and the decision if the machine has to
    /// run: `Some` when there is something to do.
    pub fn decide(&mut self, t: u64) -> Option<Decision<ProcKey>> {
        self.complete();
        if self.observed.gates.beat_due(t) {
            self.out.push(Cmd::Beat);
        }
        let mut retried = false;
        for key in self.retries.due(t) {
            if self.machine.forget(&key) {
                self.notes.push(note::Retrying { pid: key.pid }.into());
                retried = true;
            }
        }
        let touched = self.observed.table.take_touched();
        let changed = self.observed.changed || retried || self.observed.table.fixed_share_present();
        // With learned windows, each GPU's window is set before the decision is judged due
        // (a window's end is one of the times it waits for).
        let mut inputs = None;
        if self.observed.learner.settings().is_some() {
            let i = self
                .observed
                .inputs(self.machine.config().unmanaged_is_online);
            self.learned_windows(&i);
            inputs = Some(i);
        }
        let machine = &self.machine;
        if !self
            .pacer
            .decision_due(t, changed, &touched, machine.states(), |g| {
                machine.release_window(g)
            })
        {
            return None;
        }
        let inputs = inputs.unwrap_or_else(|| {
            self.observed
                .inputs(self.machine.config().unmanaged_is_online)
        });
        let d = self.machine.tick(t, &inputs);
        let machine = &self.machine;
        self.pacer
            .decided(t, machine.states(), |g| machine.release_window(g));
        super::publish::summarise(&inputs, &self.machine, &mut self.summary);
        if d.is_empty() {
            return None;
        }
        Some(d)
    }

    /// Each GPU's release window for the next decision: learned where the learner gives
    /// one (every online process with its doorbell and gaps, every offline process gated,
    /// nothing seen through NVML alone), else the idle window.
    fn learned_windows(&mut self, inputs: &[qos_core::GpuInput<ProcKey>]) {
        if self.observed.learner.settings().is_none() {
            return;
        }
        let unmanaged_online = self.machine.config().unmanaged_is_online;
        let s = &self.observed;
        for input in inputs {
            let online: Vec<ProcKey> = input
                .procs
                .iter()
                .filter(|p| p.class.is_online_demand(unmanaged_online))
                .map(|p| p.key)
                .collect();
            let gated = input
                .procs
                .iter()
                .filter(|p| p.class.is_suspendable())
                .all(|p| s.gates.gated(&s.table, &s.bells, &p.key, input.gpu));
            let w = s
                .learner
                .gpu_window(input.gpu, &online, gated, input.sampled_busy);
            self.machine.set_release_window(input.gpu, w);
        }
    }

    /// Releases and what each harvested until the next preemption, by rule.
    fn harvest(&mut self, transitions: &[qos_core::Transition]) {
        let idle_window = self.header.window_ns;
        for tr in transitions {
            match *tr {
                qos_core::Transition::Release {
                    gpu,
                    window,
                    decided_at,
                    ..
                } => {
                    let at_once = self.observed.learner.settings().is_some_and(|l| l.at_once);
                    let rule = ReleaseRule::of(window, idle_window, at_once);
                    self.notes.push(
                        note::Released {
                            gpu,
                            rule,
                            window_ns: window,
                        }
                        .into(),
                    );
                    self.released_at.insert(gpu, (decided_at, rule));
                }
                qos_core::Transition::Preempt { gpu, onset, .. } => {
                    if let Some((at, rule)) = self.released_at.remove(&gpu) {
                        let ran_ns = onset.saturating_sub(at);
                        self.notes.push(
                            note::Harvested {
                                gpu,
                                rule,
                                ran_ns,
                                wrong: rule != ReleaseRule::Fixed && ran_ns < self.pays_ns,
                            }
                            .into(),
                        );
                    }
                }
            }
        }
    }

    /// Completions to their events.
    fn complete(&mut self) {
        let done = self.book.take_done();
        if !done.is_empty() {
            self.events.extend(self.tracker.complete(&done));
        }
    }

    /// A decision becomes holds (recorded before acted on) and events.
    pub fn execute(&mut self, d: Decision<ProcKey>, now: u64) {
        self.notes.push(
            note::Decision {
                suspend: d.suspend.len(),
                resume: d.resume.len(),
                transitions: d.transitions.len(),
            }
            .into(),
        );
        self.harvest(&d.transitions);
        let (reqs, reasons) = execute::plans(
            &d,
            self.header.actuator,
            &self.driver_book,
            &self.book,
            &self.observed.table,
            &self.observed.gates,
            &self.observed.bells,
            now,
            &mut self.notes,
        );
        let started = if reqs.is_empty() {
            Vec::new()
        } else {
            self.book.suspend(&reqs, now).started
        };
        let resumed = if d.resume.is_empty() {
            Vec::new()
        } else {
            self.book.resume(&d.resume, now)
        };
        if !resumed.is_empty() {
            let pids = d.resume.iter().map(|k| k.pid).collect();
            self.notes.push(
                note::Resuming {
                    pids,
                    targets: resumed.len(),
                }
                .into(),
            );
        }
        let cx = execute::Context {
            dry_run: self.header.dry_run,
            window_ns: self.header.window_ns,
            slept: self.slept,
        };
        execute::open_events(
            &d.transitions,
            &started,
            &resumed,
            &reasons,
            cx,
            &mut self.observed.table,
            &mut self.tracker,
            &mut self.notes,
            &mut self.events,
        );
    }

    /// The pending confirmations that are due, checked.
    pub fn poll(&mut self, t: u64) {
        self.complete();
        self.book.poll(t);
    }

    /// The held targets that are due, checked again.
    pub fn recheck(&mut self, t: u64) {
        self.complete();
        self.book.recheck(t);
    }

    /// The tick's end: broken holds reported, failed suspensions retried later, the table
    /// purged of processes nothing refers to, `/state` published when due.
    pub fn finish(&mut self, t: u64) {
        self.settle(t);
        let (book, machine, table) = (&self.book, &self.machine, &self.observed.table);
        self.retries.retain(|k| table.entry(k).is_some());
        self.observed
            .table
            .purge(|k| machine.suspended().contains_key(k) || book.holds(k));
        let table = &self.observed.table;
        self.observed.learner.retain(|k| table.entry(k).is_some());
        if self.pacer.publish_due(t) {
            let doc = self.state_doc(t);
            self.out.push(Cmd::Publish(Box::new(doc)));
        }
    }

    /// What the hold book's conversation left: completions, broken holds reported,
    /// failed suspensions retried later.
    pub fn settle(&mut self, t: u64) {
        self.complete();
        let answers = self.book.take_gate_answers();
        self.observed.gates.answered(answers, t);
        for broken in self.book.take_broken() {
            let owners: Vec<String> = broken
                .holders
                .iter()
                .filter_map(|k| self.observed.table.entry(k).map(|e| e.cls.owner.clone()))
                .collect();
            if broken.breaks == 1 || broken.escalated || broken.unheld.is_some() {
                let now = if broken.escalated {
                    "frozen"
                } else if broken.unheld.is_some() {
                    "unheld"
                } else {
                    "stopped_again"
                };
                self.events.push(Event::Escape(super::events::Escape {
                    at_ns: t,
                    pids: broken.holders.iter().map(|k| k.pid).collect(),
                    owners: owners.clone(),
                    actuator: broken.kind,
                    breaks: broken.breaks,
                    now: now.into(),
                    reason: broken.unheld.clone(),
                }));
            }
            self.notes.push(note::Broken { broken, owners }.into());
        }
        for key in self.book.take_failed() {
            let due = self.retries.failed(key, t);
            let in_ms = due.saturating_sub(t) / 1_000_000;
            self.notes.push(
                note::RetryLater {
                    pid: key.pid,
                    in_ms,
                }
                .into(),
            );
        }
    }

    /// Resume everything (shutdown, panic): returns how many holds.
    pub fn release_all(&mut self, reason: ReleaseAll) -> usize {
        self.machine.release_all();
        self.pacer.decide_next();
        if reason == ReleaseAll::Shutdown {
            self.record.stop();
        }
        // The driver book first learns that everything goes back to running (the hold book's
        // resumes of locks are then answered at once, the driver book keeping them recorded
        // until unlocked); its restores wait for the holds' thaw.
        self.driver_book.release_all();
        let n = self.book.release_all(reason);
        // Its requests waiting for a write were abandoned: what they alone asked for is
        // not held (a gate's fallback recorded too late stayed recorded after the exit).
        self.record.abandon_book_requests();
        self.book.check_resumes_now();
        n
    }

    /// Everything was resumed (`n` holds).
    pub fn released(&mut self, reason: ReleaseAll, n: usize, now: u64) {
        self.complete();
        if n > 0 && reason != ReleaseAll::Shutdown {
            self.notes.push(
                note::FailedOpen {
                    why: FailWhy::Panic,
                }
                .into(),
            );
            self.events.push(Event::FailOpen(FailOpen {
                at_ns: now,
                reason: reason.as_str().into(),
                gpu: None,
                resumed: n,
            }));
        }
    }

    /// The watchdog resumed everything while the loop was stuck in NVML: forget the
    /// decisions and the samples from before, and report when the call came back.
    pub fn after_watchdog(&mut self, now: u64) {
        self.machine.release_all();
        // The watchdog resumed every hold through the hands: the events that waited for
        // those holds end unconfirmed.
        self.book.forget_all();
        self.driver_book.forget_holds();
        self.record.forget_holds();
        self.events.extend(self.tracker.abandon());
        self.observed.forget(now);
        self.events.push(Event::FailOpen(FailOpen {
            at_ns: now,
            reason: FailWhy::NvmlHung.as_str().into(),
            gpu: None,
            resumed: 0,
        }));
        self.out
            .push(Cmd::Degraded(self.observed.health.describe()));
        self.notes.push(note::HungCallReturned.into());
        self.pacer.decide_next();
    }

    /// The controller's part of `/state` at `now`.
    pub fn state_doc(&mut self, now: u64) -> super::state::StateDoc {
        let distrusted = self.observed.bells.distrusted();
        self.notes.push(
            note::Distrusted {
                owners: distrusted.len(),
            }
            .into(),
        );
        let health = &self.observed.health;
        let mut doc = super::publish::state_doc(
            now,
            &self.header,
            self.observed.gpus(),
            &self.machine,
            &self.observed.table,
            |g| health.degraded(g),
            self.book.len(),
            distrusted,
        );
        let escaping: std::collections::HashSet<_> = self.book.escaping().copied().collect();
        let mut silent = std::collections::HashSet::new();
        for g in &mut doc.gpus {
            for p in &mut g.processes {
                let Some(e) = self.observed.table.by_pid(p.pid) else {
                    continue;
                };
                p.escaping = escaping.contains(&e.key);
                if self.observed.gates.silent(&e.key) {
                    p.gate = Some("silent".into());
                    silent.insert(e.key);
                }
            }
        }
        doc.escaping_processes = escaping.len();
        doc.gate_silent_processes = silent.len();
        self.notes.push(
            note::HoldGauges {
                escaping: escaping.len(),
                gate_silent: silent.len(),
            }
            .into(),
        );
        if self.driver_book.active() {
            let mem = self.driver_book.summary();
            let view = self.driver_book.view();
            let table = &self.observed.table;
            for g in &mut doc.gpus {
                g.memory = mem.get(&g.index).cloned();
                // The actuator a suspension would use now: the driver's lock where it
                // applies (the table's plan stays its fallback).
                for p in &mut g.processes {
                    let lock = table
                        .by_pid(p.pid)
                        .is_some_and(|e| self.driver_book.would_lock(table, &e.key));
                    if lock {
                        p.actuator = Some(crate::control::model::act::Kind::Lock);
                    }
                }
                for (key, gpu, st, bytes, owner) in &view {
                    let checkpointed =
                        (*st == super::driver_book::DState::Checkpointed).then_some(*bytes);
                    match g.processes.iter_mut().find(|p| p.pid == key.pid) {
                        Some(p) => {
                            p.driver = Some(st.as_str().into());
                            p.checkpointed_bytes = checkpointed;
                        }

                        // Checkpointed: the driver's lists no longer show it.
                        None if *gpu == Some(g.index) => g.processes.push(super::state::ProcDoc {
                            container: None,
                            pid: key.pid,
                            class: qos_core::Class::Offline,
                            owner: owner.clone(),
                            cmd: String::new(),
                            suspended: false,
                            actuator: Some(crate::control::model::act::Kind::Lock),
                            last_active_ms_ago: None,
                            driver: Some(st.as_str().into()),
                            checkpointed_bytes: checkpointed,
                            shim: None,
                            escaping: false,
                            gate: None,
                        }),
                        None => {}
                    }
                }
                g.processes.sort_by_key(|p| p.pid);
            }
        }
        super::coverage::mark(&mut doc, &self.observed.table, &self.observed.bells);
        doc
    }

    /// Memory read: the driver book judges pressure and decides evictions and restores.
    pub fn memory(
        &mut self,
        now: u64,
        reads: Vec<(
            u32,
            Result<Option<crate::control::model::gpu::GpuMemory>, String>,
        )>,
        room: BTreeMap<u32, u64>,
    ) {
        let unmanaged_online = self.machine.config().unmanaged_is_online;
        let table = &self.observed.table;
        let online = |g: u32| {
            table
                .entries()
                .any(|e| e.gpus.contains(&g) && e.cls.class.is_online_demand(unmanaged_online))
        };
        let book = &self.book;
        self.driver_book
            .memory(now, reads, &room, table, online, |k, cg| book.stops(k, cg));
    }

    /// How long the loop may sleep from `now` (a doorbell ends the sleep early).
    pub fn next_wait(&self, now: u64) -> Duration {
        let next_check = self.book.next_check_ns();
        let learner = &self.observed.learner;
        let stamp_due = self.machine.states().any(|(g, st)| {
            matches!(st, qos_core::GpuState::OnlineBusy { .. }) && learner.awaits_stamp(g)
        });
        let due = Due {
            fast: stamp_due
                || (next_check.is_none() && !self.tracker.is_empty())
                || !self.retries.is_empty()
                || self.observed.table.fixed_share_present()
                || self.observed.sampling.asked.is_some(),
            next_check,
            recheck: self.book.next_recheck_ns(),
            offline: self.observed.table.offline_present(),
            reads: self.observed.sampling.next_reads(),
            beat: self
                .book
                .gates_closed()
                .then(|| self.observed.gates.next_beat_ns()),
            driver_book: self.driver_book.next_due_ns(now),
        };
        let machine = &self.machine;
        self.pacer
            .next_wait(now, due, machine.states(), |g| machine.release_window(g))
    }

    /// Per GPU, as of the latest decision (the gauges and the time accounting).
    pub fn summary(&self) -> &[GpuSummary] {
        &self.summary
    }

    /// The hold book.
    pub fn holds(&self) -> &HoldBook {
        &self.book
    }

    /// The record book.
    pub fn record(&self) -> &RecordBook {
        &self.record
    }
}
