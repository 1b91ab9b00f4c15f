//! What the controller has observed: the sub-states that take in the shell's reads — the process
//! [`Table`], the NVML bookkeeping ([`Sampling`]), [`Health`], the doorbells ([`Bells`])
//! and the gate book ([`Gates`]) — and what a tick does with each read. No I/O: what they
//! say goes to `notes`, `events` and `out`, which the controller hands to the shell.

use super::bells::Bells;
use super::events::{Event, FailOpen};
use super::gates::Gates;
use super::health::{Health, Verdict};
use super::holds::HoldBook;
use super::io::Cmd;
use super::learn::Learner;
use super::note::{self, FailWhy, Note};
use super::nvml::{Refresh, Sampling};
use super::table::{Activity, Table};
use super::LoopConfig;
use crate::control::model::act::RecordEntry;
use crate::control::model::gpu;
use crate::control::model::ProcKey;
use qos_core::{GpuInput, Machine};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

/// See the module.
#[derive(Debug)]
pub struct Observed {
    gpus: Vec<(u32, String)>,
    grace: Duration,
    /// `--actuator`.
    preferred: crate::control::model::act::Kind,
    pub(crate) table: Table,
    pub(crate) sampling: Sampling,
    pub(crate) health: Health,
    pub(crate) bells: Bells,
    pub(crate) gates: Gates,
    /// The learned release window's gaps.
    pub(crate) learner: Learner,
    /// The pod source's generation at the tick's start.
    generation: u64,
    /// What this tick's reads changed (the machine runs).
    pub(crate) changed: bool,
    /// Samples of PIDs the table did not know, until the lists are read (this tick, or the
    /// next when a doorbell put them off).
    unknown: Vec<(u32, u32, Activity)>,
    /// What the record should hold ahead, when the table changed.
    pub(crate) ahead: Option<BTreeSet<RecordEntry>>,
    pub(crate) notes: Vec<Note>,
    pub(crate) events: Vec<Event>,
    pub(crate) out: Vec<Cmd>,
}

impl Observed {
    /// The observed sub-states for these GPUs (index, UUID) under `cfg`, at `now`, with the gate file.
    pub fn new(
        cfg: &LoopConfig,
        gpus: Vec<(u32, String)>,
        now: u64,
        gate_file: Option<PathBuf>,
    ) -> Observed {
        let window = cfg.machine.idle_window;
        let uuids: Vec<(u32, [u8; 16])> = gpus
            .iter()
            .filter_map(|(g, u)| coloc_doorbell::parse_uuid(u).map(|b| (*g, b)))
            .collect();
        let ns = |d: Duration| d.as_nanos() as u64;
        Observed {
            grace: cfg.nvml_grace,
            preferred: cfg.actuator,
            table: Table::default(),
            sampling: Sampling::new(
                gpus.iter().map(|g| g.0).collect(),
                ns(cfg.nvml_interval),
                ns(cfg.process_interval),
                ns(cfg.nvml_sample_period),
                window,
            ),
            health: Health::new(cfg.nvml_grace),
            bells: Bells::new(&uuids, now, window, ns(cfg.doorbell_trust_window)),
            gates: Gates::new(gate_file),
            learner: Learner::new(cfg.release, window),
            gpus,
            generation: 0,
            changed: false,
            unknown: Vec::new(),
            ahead: None,
            notes: Vec::new(),
            events: Vec::new(),
            out: Vec::new(),
        }
    }

    /// A tick starts, under this pod-source generation.
    pub fn start_tick(&mut self, generation: u64) {
        self.generation = generation;
        self.changed = false;
        self.sampling.start_tick();
    }

    /// The samples to read now, if due.
    pub fn samples_due(&self, t: u64) -> Option<Vec<(u32, u64)>> {
        self.sampling.samples_due(t)
    }

    /// The samples read.
    pub fn samples(
        &mut self,
        read: Vec<(u32, Result<Vec<gpu::Activity>, String>)>,
        yielded: bool,
        t: u64,
    ) {
        let health = &self.health;
        let unknown = self
            .sampling
            .samples(read, yielded, t, &mut self.table, |g| health.degraded(g));
        self.unknown.extend(unknown);
    }

    /// Why the lists are due at a tick's start, if they are (samples of PIDs the table
    /// does not know wait for them when a doorbell put them off).
    pub fn list_due(&self, t: u64) -> Option<Refresh> {
        if self.unknown_pids() {
            return Some(Refresh::UnknownPid);
        }
        self.sampling.list_due(t, self.table.stale(self.generation))
    }

    /// Whether samples named PIDs the table does not know (the lists are read for them).
    pub fn unknown_pids(&self) -> bool {
        !self.unknown.is_empty()
    }

    /// The lists read (and the classification of the PIDs they named for the first
    /// time, the members of the cgroups held whole), applied.
    pub fn lists(&mut self, t: u64, l: super::io::Lists) {
        let super::io::Lists {
            why,
            listed,
            failed,
            gone: _,
            generation,
            classified,
            members,
        } = l;
        self.notes.push(note::ListRefresh { why }.into());
        self.sampling.listed(t, &failed);
        for (dir, m) in members {
            self.table.members_read(&dir, m);
        }
        let failed: BTreeSet<u32> = failed.into_keys().collect();
        let notes = self
            .table
            .apply(&listed, &failed, generation, t, classified);
        self.notes.extend(notes);
        for (gpu, pid, act) in std::mem::take(&mut self.unknown) {
            self.table.note_sample(gpu, pid, act);
        }
        self.changed = true;
        // Every target that could be suspended is written down ahead, so that the
        // preemption that suspends it waits for no write.
        let gpus = &self.gpus;
        let uuid = |g: u32| gpus.iter().find(|(i, _)| *i == g).map(|(_, u)| u.clone());
        self.ahead = Some(self.table.ahead(self.preferred, self.gates.file(), uuid));
    }

    /// The tick's NVML calls, judged (when some ran).
    pub fn judge_tick(&mut self, t: u64, machine: &Machine<ProcKey>) {
        if self.sampling.called_any() {
            self.changed = true;
            self.judge(t, machine);
        }
    }

    /// Applies the health policy to this tick's NVML calls.
    fn judge(&mut self, t: u64, machine: &Machine<ProcKey>) {
        for (gpu, err) in self.sampling.results() {
            let verdict = match &err {
                None => self.health.ok(gpu),
                Some(e) => self.health.failed(gpu, t, e.clone()),
            };
            let error = err.unwrap_or_default();
            match verdict {
                Verdict::Healthy | Verdict::StillDegraded => {}
                Verdict::Transient => self.notes.push(note::NvmlTransient { gpu, error }.into()),
                Verdict::FailOpen => {
                    self.notes.push(
                        note::NvmlFailOpen {
                            gpu,
                            error,
                            grace: self.grace,
                        }
                        .into(),
                    );
                    let held = machine.suspended();
                    let resumed = self.table.suspended_on(gpu, |k| held.contains_key(k));
                    self.events.push(Event::FailOpen(FailOpen {
                        at_ns: t,
                        reason: FailWhy::Nvml.as_str().into(),
                        gpu: Some(gpu),
                        resumed,
                    }));
                    self.table.clear_activity(Some(gpu));
                }
                Verdict::Recovered => self.notes.push(note::NvmlRecovered { gpu }.into()),
            }
            let degraded = self.health.degraded(gpu);
            self.notes.push(note::Degraded { gpu, degraded }.into());
        }
        self.out.push(Cmd::Degraded(self.health.describe()));
    }

    /// The doorbell pages read: their launches attributed. A launch of a process the
    /// lists do not hold yet has them read at the next tick, unless this tick's snapshot
    /// read them (`listed`: the shell judged them read for it).
    pub fn bells_read(&mut self, t: u64, read: super::io::Bells, listed: bool) {
        let super::io::Bells {
            pages,
            readings,
            gates,
        } = read;
        if let Some(pages) = pages {
            self.bells
                .pages_changed(pages, &self.table, t, &mut self.notes);
        }
        let (health, sampling) = (&self.health, &self.sampling);
        let rung = self.bells.attribute(
            &readings,
            t,
            &mut self.table,
            &mut self.learner,
            |g| sampling.blind(g),
            |g| health.degraded(g),
            &mut self.events,
            &mut self.notes,
        );
        self.gates.read(gates);
        if let Some(ids) = self.bells.preferred(t) {
            self.out.push(Cmd::PreferPages(ids));
        }
        if rung.refresh && !listed {
            self.sampling.asked = Some(Refresh::Doorbell);
        }
    }

    /// Whether this read of the doorbells rescans, and sweeps, and reads gates.
    pub fn bells_due(&mut self, t: u64) -> super::io::BellsRead {
        let (force, sweep) = self.bells.due(t);
        super::io::BellsRead {
            force,
            sweep,
            gate: self.gates.on(),
        }
    }

    /// The gate holds waiting for their drain are told what their pages say.
    pub fn gate_acks(&self, book: &mut HoldBook) {
        if self.gates.on() {
            for (key, uuid) in book.wanted_acks() {
                let acks = self.gates.acks(&self.table, &self.bells, &key, &uuid);
                book.gate_acks(key, &acks);
            }
        }
    }

    /// Every sample and activity so far is history (the watchdog resumed everything).
    pub fn forget(&mut self, now: u64) {
        self.table.clear_activity(None);
        self.unknown.clear();
        self.sampling.blind_all(now);
    }

    /// The GPUs and their UUIDs.
    pub fn gpus(&self) -> &[(u32, String)] {
        &self.gpus
    }

    /// The state machine's inputs: the managed GPUs (not failed open).
    pub fn inputs(&self, unmanaged_online: bool) -> Vec<GpuInput<ProcKey>> {
        let managed: Vec<u32> = self
            .gpus
            .iter()
            .map(|g| g.0)
            .filter(|g| !self.health.degraded(*g))
            .collect();
        let (s, table) = (&self.sampling, &self.table);
        table.inputs(&managed, |g| {
            table.sampled_busy(
                g,
                s.sampled_at(g),
                s.period_ns(),
                s.busy_margin(g),
                unmanaged_online,
            )
        })
    }
}
