//! A model of the world that plays the shell for [`Controller::step`]: processes that
//! start, exit and reuse PIDs, online work, NVML that fails per GPU, a record whose writes
//! land late or fail, an actuator that fails or whose holds a tenant breaks, launch gates
//! whose shims acknowledge at once, late, falsely or never, and a CUDA driver with the
//! checkpoint API whose calls wait while their process is stopped (as the H100's did),
//! over GPUs whose memory online and offline processes share. It answers every command as
//! the edges would, and checks at each command what the controller may never ask
//! (`props_ctl` checks the rest after each tick).

use super::*;
use crate::control::controller::Controller;
use crate::control::entry::Entry;
use crate::control::holds::{HoldCmd, HoldObs};
use crate::control::io::{Bells, BellsRead, Cmd, Lists, Memory, Obs, Samples, Snapshot};
use crate::control::plan::{CgroupFacts, Members};
use crate::control::target::Target;
use crate::edges::actuator::{ActError, Progress};
use crate::edges::doorbell::{Owner, PageInfo};
use crate::edges::procfs::ProcKey;
use coloc_doorbell::GateReading;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// What a shim answers when its gate closes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ack {
    /// Never (no shim listening after all, or work that never drains).
    Never,
    /// The close's epoch, at once.
    AtOnce,
    /// An epoch that is not the close's (a forger's guess).
    Wrong,
    /// The close's epoch, this many ms later.
    Late(u8),
}

#[derive(Debug, Clone)]
pub(super) struct Proc {
    pub key: ProcKey,
    pub gpu: u32,
    pub online: bool,
    pub born: u64,
}

/// The world, as the shell sees it.
pub(super) struct World {
    pub ctl: Controller,
    pub now: u64,
    pub gate: bool,
    pub ack: Ack,
    /// How many ticks a record write takes to land.
    pub write_delay: u32,
    pub procs: BTreeMap<u32, Proc>,
    next_start: u64,
    /// Every key that started offline.
    pub offline: BTreeSet<ProcKey>,
    pub disk: BTreeSet<RecordEntry>,
    pub record_broken: bool,
    pub writes: VecDeque<(u64, crate::control::record::Write)>,
    /// What the actuator holds stopped now.
    pub stopped: BTreeSet<ProcKey>,
    /// Closed gates: process → (epoch, when).
    pub closed: BTreeMap<ProcKey, (u32, u64)>,
    epoch: u32,
    samples: BTreeMap<u32, Vec<crate::edges::gpu::Activity>>,
    pub nvml_failing: BTreeSet<u32>,
    pub suspend_fails: BTreeSet<ProcKey>,
    pub generation: u64,
    pages_changed: bool,
    /// Processes whose pods are annotated `gpu-coloc.dev/checkpoint: "false"`.
    pub opt_out: BTreeSet<ProcKey>,
    /// Keys the shell said no longer live (their PID belongs to another process).
    pub reported_gone: BTreeSet<ProcKey>,
    /// What went wrong at each command, if anything.
    pub violation: Option<String>,
    /// Where the driver has each process (absent: running).
    pub dstate: BTreeMap<ProcKey, DState>,
    /// Driver calls on their way: (earliest end, call).
    calls: Vec<(u64, crate::control::driver_book::Call)>,
    /// How long a driver call takes once its process runs, ms.
    pub call_ms: u64,
    /// How long a lock takes instead, ms, where set: slower than a re-check of the holds
    /// (10 ms) or quicker than a state query, so that the driver's answers come in any
    /// order relative to the hold book's checks.
    pub lock_ms: Option<u64>,
    /// How long a state query takes instead, ms, where set.
    pub state_ms: Option<u64>,
    /// Processes whose lock the driver has refused (answered): none may be asked again.
    pub refused: BTreeSet<ProcKey>,
    /// The offline processes of each GPU share one cgroup (`/cg/gpu<N>`), suspended by
    /// stopping all its processes (`Stop::SignalCgroup`): one process's hold stops the
    /// others, a checkpointed one among them, and their restore must wait for the thaw.
    pub shared_cgroups: bool,
    /// Processes whose lock the driver refuses (`CUDA_ERROR_NOT_SUPPORTED`).
    pub refuse: BTreeSet<ProcKey>,
    /// Processes their tenant stopped (SIGSTOP): the driver's calls that change them wait
    /// (state queries answer at once, as on the H100).
    pub tenant_stopped: BTreeSet<ProcKey>,
    /// Locks asked of the driver, per process.
    pub lock_calls: BTreeMap<ProcKey, u32>,
    /// Each GPU's memory, bytes.
    pub mem_total: u64,
    /// What a process holds on its GPU, bytes (online and offline alike).
    pub proc_bytes: u64,
    /// What processes' memory limits leave them, bytes (by PID; absent: no limit).
    pub room: BTreeMap<u32, u64>,
}

use crate::control::driver_book::DState;

fn uuid(gpu: u32) -> [u8; 16] {
    fake_uuid(gpu)
}

impl World {
    pub fn new(gpus: u32, gate: bool, ack: Ack, write_delay: u32) -> World {
        let mut cfg = default_config();
        cfg.gate_timeout = Duration::from_millis(50);
        let ids = (0..gpus)
            .map(|g| (g, coloc_doorbell::format_uuid(&uuid(g))))
            .collect();
        let file = gate.then(|| PathBuf::from("/run/gpu-coloc/gate/gates"));
        World {
            ctl: Controller::new(&cfg, ids, T0, file, BTreeSet::new()),
            now: T0,
            gate,
            ack,
            write_delay,
            procs: BTreeMap::new(),
            next_start: 1000,
            offline: BTreeSet::new(),
            disk: BTreeSet::new(),
            record_broken: false,
            writes: VecDeque::new(),
            stopped: BTreeSet::new(),
            closed: BTreeMap::new(),
            epoch: 0,
            samples: BTreeMap::new(),
            nvml_failing: BTreeSet::new(),
            suspend_fails: BTreeSet::new(),
            generation: 1,
            pages_changed: true,
            reported_gone: BTreeSet::new(),
            violation: None,
            dstate: BTreeMap::new(),
            calls: Vec::new(),
            call_ms: 2,
            lock_ms: None,
            state_ms: None,
            shared_cgroups: false,
            refused: BTreeSet::new(),
            refuse: BTreeSet::new(),
            tenant_stopped: BTreeSet::new(),
            lock_calls: BTreeMap::new(),
            opt_out: BTreeSet::new(),
            mem_total: 16 << 30,
            proc_bytes: 4 << 30,
            room: BTreeMap::new(),
        }
    }

    /// A world whose driver has the checkpoint API, with the driver book configured: the lock
    /// hold for every offline process (`lock`), memory preemption with `reserve`
    /// (every offline process opted in).
    pub fn with_driver_book(
        gpus: u32,
        gate: bool,
        write_delay: u32,
        lock: bool,
        reserve: Option<crate::control::driver_book::Reserve>,
    ) -> World {
        let mut cfg = default_config();
        cfg.gate_timeout = Duration::from_millis(50);
        cfg.driver_book = crate::control::driver_book::DriverBookConfig {
            api: true,
            lock,
            reserve,
            restore_after_ns: 300 * MS,
            pods: crate::control::driver_book::PodsPolicy::OptOut,
            memory_interval_ns: 5 * MS,
            lock_timeout: cfg.confirm_timeout,
        };
        let ids = (0..gpus)
            .map(|g| (g, coloc_doorbell::format_uuid(&uuid(g))))
            .collect();
        let file = gate.then(|| PathBuf::from("/run/gpu-coloc/gate/gates"));
        let mut w = World::new(gpus, gate, Ack::AtOnce, write_delay);
        w.ctl = Controller::new(&cfg, ids, T0, file, BTreeSet::new());
        w
    }

    /// Where the driver has `key`.
    pub fn driver_state(&self, key: &ProcKey) -> DState {
        self.dstate.get(key).copied().unwrap_or(DState::Running)
    }

    /// The GPU's free memory: what its processes hold, checkpointed ones excepted.
    pub fn free(&self, gpu: u32) -> u64 {
        let used: u64 = self
            .procs
            .values()
            .filter(|p| p.gpu == gpu && self.driver_state(&p.key) != DState::Checkpointed)
            .map(|_| self.proc_bytes)
            .sum();
        self.mem_total.saturating_sub(used)
    }

    /// Whether a driver call for `key` is on its way.
    pub fn call_for(&self, key: &ProcKey) -> bool {
        self.calls.iter().any(|(_, c)| c.key == *key)
    }

    /// The driver calls that have ended by now (a call on a stopped process waits for it,
    /// as the real driver's did).
    fn driver_done(&mut self) -> Vec<Obs> {
        use crate::edges::checkpoint::{CallEnd, CuError, Done, Op as DriverOp, ProcessState};
        let mut out = Vec::new();
        let now = self.now;
        let mut keep = Vec::new();
        for (due, call) in std::mem::take(&mut self.calls) {
            let alive = self.alive(&call.key).is_some();
            let waits = call.op != crate::edges::checkpoint::Op::State
                && (self.stopped.contains(&call.key) || self.tenant_stopped.contains(&call.key));
            if alive && (due > now || waits) {
                keep.push((due, call));
                continue;
            }
            let st = self.driver_state(&call.key);
            let err = |code: i32, name: &str| {
                CallEnd::Answered(Err(CuError {
                    op: call.op,
                    code,
                    name: name.into(),
                }))
            };
            let illegal = || err(401, "CUDA_ERROR_ILLEGAL_STATE");
            let mut state = None;
            let end = if !alive {
                CallEnd::Gone
            } else {
                match (call.op, st) {
                    (DriverOp::Lock, _) if self.refuse.contains(&call.key) => {
                        self.refused.insert(call.key);
                        err(801, "CUDA_ERROR_NOT_SUPPORTED")
                    }
                    (DriverOp::Lock, DState::Running) => {
                        self.dstate.insert(call.key, DState::Locked);
                        CallEnd::Answered(Ok(()))
                    }
                    (DriverOp::Checkpoint, DState::Locked) => {
                        self.dstate.insert(call.key, DState::Checkpointed);
                        CallEnd::Answered(Ok(()))
                    }
                    (DriverOp::Restore, DState::Checkpointed) => {
                        let gpu = self.alive(&call.key).map_or(0, |p| p.gpu);
                        if self.free(gpu) < self.proc_bytes {
                            err(2, "CUDA_ERROR_OUT_OF_MEMORY")
                        } else {
                            self.dstate.insert(call.key, DState::Locked);
                            CallEnd::Answered(Ok(()))
                        }
                    }
                    (DriverOp::Unlock, DState::Locked) => {
                        self.dstate.remove(&call.key);
                        CallEnd::Answered(Ok(()))
                    }
                    (DriverOp::State, s) => {
                        state = Some(match s {
                            DState::Running => ProcessState::Running,
                            DState::Locked => ProcessState::Locked,
                            DState::Checkpointed => ProcessState::Checkpointed,
                            DState::Failed => ProcessState::Failed,
                        });
                        CallEnd::Answered(Ok(()))
                    }
                    _ => illegal(),
                }
            };
            out.push(Obs::Driver(Done {
                id: 0,
                key: call.key,
                op: call.op,
                end,
                state,
                elapsed: Duration::from_nanos(now.saturating_sub(due) + self.call_ms(call.op) * MS),
            }));
        }
        self.calls = keep;
        out
    }

    /// The cgroup `p` shares with the other offline processes of its GPU, if they share
    /// one.
    fn cgroup_of(&self, p: &Proc) -> Option<PathBuf> {
        (self.shared_cgroups && !p.online).then(|| PathBuf::from(format!("/cg/gpu{}", p.gpu)))
    }

    /// How long a call of `op` takes once its process runs, ms.
    fn call_ms(&self, op: crate::edges::checkpoint::Op) -> u64 {
        use crate::edges::checkpoint::Op as DriverOp;
        match op {
            DriverOp::Lock => self.lock_ms.unwrap_or(self.call_ms),
            DriverOp::State => self.state_ms.unwrap_or(self.call_ms),
            _ => self.call_ms,
        }
    }

    /// Ticks until every driver call has ended and the driver book holds nothing (the agent on
    /// its way out), at most `ms` ms.
    pub fn drain_driver(&mut self, ms: u64) {
        for _ in 0..ms {
            if self.calls.is_empty() && self.ctl.driver_idle() {
                return;
            }
            let mut obs = self.landed();
            obs.extend(self.driver_done());
            self.converse(obs);
            self.now += MS;
        }
    }

    pub fn pid(slot: u32) -> u32 {
        10 + slot
    }

    pub fn start(&mut self, slot: u32, gpu: u32, online: bool) {
        self.next_start += 1;
        let key = ProcKey {
            pid: Self::pid(slot),
            start: self.next_start,
        };
        if !online {
            self.offline.insert(key);
        }
        if let Some(old) = self.procs.get(&slot) {
            self.dstate.remove(&old.key);
        }
        let born = self.now;
        self.procs.insert(
            slot,
            Proc {
                key,
                gpu,
                online,
                born,
            },
        );
        self.pages_changed = true;
    }

    pub fn exit(&mut self, slot: u32) {
        if let Some(p) = self.procs.remove(&slot) {
            // An exited process holds nothing in the driver.
            self.dstate.remove(&p.key);
            self.pages_changed = true;
        }
    }

    pub fn busy(&mut self, gpu: u32, pid: u32) {
        let s = crate::edges::gpu::Activity {
            pid,
            at_ns: self.now,
            sm_util: 50,
        };
        self.samples.entry(gpu).or_default().push(s);
    }

    fn alive(&self, key: &ProcKey) -> Option<&Proc> {
        self.procs.values().find(|p| p.key == *key)
    }

    fn flag(&mut self, what: String) {
        self.violation.get_or_insert(what);
    }

    /// One tick of the loop, then 1 ms passes.
    pub fn tick(&mut self) {
        // The snapshot, as the shell gathers it: the doorbells first, then NVML (no page
        // rings during a read here, and no page names a process: the pages carry no
        // readings).
        let reads = self.ctl.start_tick(self.now, None, self.generation);
        let bells = self.read_bells(reads.bells);
        let samples = reads.samples.map(|gpus| self.read_samples(&gpus));
        let unknown = samples.iter().any(|s| {
            let known = self.ctl.known();
            s.read.iter().any(|(g, r)| {
                r.iter()
                    .flatten()
                    .any(|a| known.sample_unknown(*g, a.pid, a.at_ns))
            })
        });
        let why = reads
            .lists
            .or(unknown.then_some(crate::control::nvml::Refresh::UnknownPid));
        let lists = why.map(|why| self.read_lists(why));
        let memory = reads.memory.map(|gpus| self.read_memory(&gpus));
        let mut obs = vec![Obs::Snapshot(Box::new(Snapshot {
            bells,
            samples,
            lists,
            memory,
            rang: false,
        }))];
        obs.extend(self.landed());
        obs.extend(self.driver_done());
        self.converse(obs);
        self.now += MS;
    }

    fn read_samples(&mut self, gpus: &[(u32, u64)]) -> Samples {
        Samples {
            read: gpus
                .iter()
                .map(|(g, _)| {
                    let s = self.samples.remove(g).unwrap_or_default();
                    if self.nvml_failing.contains(g) {
                        (*g, Err("GPU lost".to_string()))
                    } else {
                        (*g, Ok(s))
                    }
                })
                .collect(),
            yielded: false,
        }
    }

    fn read_lists(&mut self, why: crate::control::nvml::Refresh) -> Lists {
        let mut listed: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::new();
        let mut failed = BTreeMap::new();
        for g in &self.nvml_failing {
            failed.insert(*g, "GPU lost".to_string());
        }
        for p in self.procs.values() {
            // A checkpointed process has left the driver's lists.
            if !self.nvml_failing.contains(&p.gpu)
                && self.driver_state(&p.key) != DState::Checkpointed
            {
                listed.entry(p.key.pid).or_default().insert(p.gpu);
            }
        }
        // As the shell tells it: listed PIDs whose known process is not the one that lives
        // there now.
        let gone: Vec<ProcKey> = (self.ctl.known().keys())
            .iter()
            .map(|(k, _)| *k)
            .filter(|k| listed.contains_key(&k.pid) && self.alive(k).is_none())
            .collect();
        self.reported_gone.extend(gone.iter().copied());
        let generation = self.generation;
        let pids = self.ctl.known().to_classify(&listed, &gone, generation);
        let classified = pids
            .iter()
            .map(|pid| {
                let p = self.procs.values().find(|p| p.key.pid == *pid);
                (
                    *pid,
                    p.map(|p| {
                        let mut e = entry(p, generation, self.cgroup_of(p));
                        if self.opt_out.contains(&p.key) {
                            e.cls.checkpoint = Some(false);
                        }
                        e
                    }),
                )
            })
            .collect();
        // A pod's container: the pod source vouches for it.
        let members = (self.ctl.known().cgroups())
            .into_iter()
            .map(|d| (d, Members::Offline))
            .collect();
        Lists {
            why,
            listed,
            failed,
            gone,
            generation,
            classified,
            members,
        }
    }

    fn read_bells(&mut self, read: BellsRead) -> Bells {
        let offline: Vec<&Proc> = self.procs.values().filter(|p| !p.online).collect();
        let pages = (self.gate && std::mem::take(&mut self.pages_changed))
            .then(|| offline.iter().map(|p| page(p)).collect());
        let gates = if read.gate {
            offline
                .iter()
                .map(|p| {
                    let ack = self.closed.get(&p.key).map_or(0, |(e, at)| match self.ack {
                        Ack::Never => 0,
                        Ack::AtOnce => *e,
                        Ack::Wrong => e.wrapping_add(7),
                        Ack::Late(ms) if self.now >= at + ms as u64 * MS => *e,
                        Ack::Late(_) => 0,
                    });
                    let r = GateReading {
                        index: 0,
                        uuid: uuid(p.gpu),
                        gate_ack: ack,
                        inflight: 0,
                        in_submit: 0,
                        blocked_ns: 0,
                        submitted: 0,
                    };
                    (p.key.pid as u64, vec![r])
                })
                .collect()
        } else {
            Vec::new()
        };
        Bells {
            pages,
            readings: Vec::new(),
            gates,
        }
    }

    fn read_memory(&mut self, gpus: &[u32]) -> Memory {
        Memory {
            reads: gpus
                .iter()
                .map(|g| {
                    let processes = self
                        .procs
                        .values()
                        .filter(|p| {
                            p.gpu == *g && self.driver_state(&p.key) != DState::Checkpointed
                        })
                        .map(|p| (p.key.pid, self.proc_bytes))
                        .collect();
                    (
                        *g,
                        Ok(Some(crate::edges::gpu::GpuMemory {
                            total: self.mem_total,
                            free: self.free(*g),
                            processes,
                        })),
                    )
                })
                .collect(),
            room: self.room.clone(),
        }
    }

    /// Steps the controller until it asks for nothing more. A driver call that ends at
    /// once (a call of 0 ms) is answered in the next round of the same tick, as the shell
    /// hands in what ended while it performed a round: before or after the hold book's
    /// checks, whichever the controller does first.
    /// A tick that takes more rounds than this never ends: a violation, not a hang.
    pub fn converse(&mut self, mut obs: Vec<Obs>) {
        for _ in 0..10_000 {
            let cmds = self.ctl.step(self.now, obs);
            if cmds.is_empty() {
                return;
            }
            obs = cmds.into_iter().filter_map(|c| self.perform(c)).collect();
            obs.extend(self.driver_done());
        }
        self.flag(format!(
            "the controller's conversation at {} ms did not end in 10,000 rounds",
            self.now / MS
        ));
    }

    /// The writes due now, landed (or failed).
    pub fn landed(&mut self) -> Vec<Obs> {
        let mut out = Vec::new();
        while self.writes.front().is_some_and(|(due, _)| *due <= self.now) {
            let (_, w) = self.writes.pop_front().unwrap();
            out.push(self.land(w));
        }
        out
    }

    /// Every write still on its way, landed (the agent stops).
    pub fn land_all(&mut self) {
        while let Some((_, w)) = self.writes.pop_front() {
            let o = self.land(w);
            self.converse(vec![o]);
        }
    }

    fn land(&mut self, w: crate::control::record::Write) -> Obs {
        let ok = !self.record_broken;
        if ok {
            self.disk.extend(w.add.iter().cloned());
            for e in &w.remove {
                self.disk.remove(e);
            }
        }
        Obs::Written { id: w.id, ok }
    }

    fn perform(&mut self, cmd: Cmd) -> Option<Obs> {
        Some(match cmd {
            Cmd::Hold(h) => Obs::Hold(self.hold(h)?),
            Cmd::Write(w) => {
                if self.write_delay == 0 {
                    return Some(self.land(w));
                }
                let due = self.now + self.write_delay as u64 * MS;
                self.writes.push_back((due, w));
                return None;
            }
            Cmd::Driver(call) => {
                use crate::edges::checkpoint::Op as DriverOp;
                let key = call.key;
                if self.calls.iter().any(|(_, c)| c.key == key) {
                    self.flag(format!(
                        "a second driver call for {key:?} while one is on its way"
                    ));
                }
                if call.op == DriverOp::Lock {
                    *self.lock_calls.entry(key).or_insert(0) += 1;
                    if self.refused.contains(&key) {
                        self.flag(format!(
                            "asked the driver to lock {key:?} again after it refused (its other plan holds it)"
                        ));
                    }
                    let lock = Target::Lock { key }.record();
                    let ckpt = RecordEntry::Checkpoint {
                        pid: key.pid,
                        start: key.start,
                    };
                    // Memory preemption records the checkpoint entry before its lock; a
                    // lock hold, the lock entry (ahead).
                    let entry = if self.disk.contains(&lock) {
                        lock
                    } else {
                        ckpt
                    };
                    self.may_stop(key, entry, "locked");
                }
                if call.op != DriverOp::State && self.stopped.contains(&key) {
                    self.flag(format!(
                        "{} of {key:?} asked of the driver while the process is stopped (thaw first)",
                        call.op.as_str()
                    ));
                }
                let due = self.now + self.call_ms(call.op) * MS;
                self.calls.push((due, call));
                return None;
            }
            Cmd::PreferPages(_)
            | Cmd::Beat
            | Cmd::Emit(_)
            | Cmd::Note(_)
            | Cmd::Degraded(_)
            | Cmd::Publish(_) => return None,
        })
    }

    fn hold(&mut self, h: HoldCmd) -> Option<HoldObs> {
        Some(match h {
            HoldCmd::Members { req, leader, dir } => {
                // The leader, then every other live process of its cgroup.
                let mut members = vec![leader.clone()];
                members.extend(
                    self.procs
                        .values()
                        .filter(|p| self.cgroup_of(p).as_deref() == Some(dir.as_path()))
                        .filter(
                            |p| !matches!(&leader, Target::Process { key, .. } if *key == p.key),
                        )
                        .map(|p| Target::Process { key: p.key }),
                );
                // Its runtime removes a cgroup once its last process has exited.
                let leader_lives = self
                    .procs
                    .values()
                    .any(|p| matches!(&leader, Target::Process { key, .. } if *key == p.key));
                let gone = members.len() == 1 && !leader_lives;
                HoldObs::Members { req, members, gone }
            }
            HoldCmd::RecordAdd { .. } | HoldCmd::RecordRemove { .. } => {
                self.flag("the record book's own commands reached the shell".into());
                return None;
            }
            // This world has no cgroup hierarchy of the agent's own.
            HoldCmd::Isolate { req, .. } => HoldObs::Cell {
                req,
                cell: Err("no cells in the simulated world".into()),
            },
            HoldCmd::CloseGate { req, gate } => {
                let Target::Gate { key, .. } = &gate else {
                    unreachable!()
                };
                self.may_stop(*key, gate.record(), "closed the gate of");
                self.epoch += 1;
                self.closed.insert(*key, (self.epoch, self.now));
                HoldObs::GateClosed {
                    req,
                    epoch: Some(self.epoch),
                }
            }
            HoldCmd::Start {
                req, op, targets, ..
            } => {
                let progress = targets.iter().map(|t| self.act(t, op)).collect();
                HoldObs::Progress {
                    req,
                    progress,
                    at_ns: self.now,
                }
            }
            HoldCmd::Check { req, op, targets } => {
                let progress = targets
                    .iter()
                    .map(|t| match (t, op) {
                        (Target::Lock { .. }, _) => {
                            self.flag("a lock reached the actuator".into());
                            Progress::Done
                        }
                        (Target::Process { key, .. }, Op::Suspend) => {
                            if self.alive(key).is_none() {
                                Progress::Gone
                            } else if self.stopped.contains(key) {
                                Progress::Done
                            } else {
                                Progress::Pending
                            }
                        }
                        _ => Progress::Done,
                    })
                    .collect();
                HoldObs::Progress {
                    req,
                    progress,
                    at_ns: self.now,
                }
            }
        })
    }

    /// Record before act; only a process started offline, under that key, and never one
    /// the shell has said is gone (its PID reused). Before the shell could tell, a key
    /// whose process died is harmless: the shell acts through a pidfd.
    fn may_stop(&mut self, key: ProcKey, entry: RecordEntry, what: &str) {
        if !self.disk.contains(&entry) {
            self.flag(format!("{what} {key:?} before the record held {entry:?}"));
        }
        if !self.offline.contains(&key) {
            self.flag(format!(
                "{what} {key:?}, never an offline process under that key"
            ));
        }
        if self.reported_gone.contains(&key) {
            self.flag(format!("{what} {key:?} after its PID was reused"));
        }
    }

    fn act(&mut self, t: &Target, op: Op) -> Progress {
        match (t, op) {
            (Target::Lock { .. }, _) => {
                self.flag("a lock reached the actuator".into());
                Progress::Done
            }
            (Target::Process { key, .. }, Op::Suspend) => {
                self.may_stop(*key, t.record(), "stopped");
                // A cgroup's stop takes every process in it, whatever the driver holds
                // there: only a process's own plan must wait for the driver.
                let cgroup = self.shared_cgroups && self.offline.contains(key);
                if !cgroup
                    && (self.driver_state(key) != DState::Running
                        || self.calls.iter().any(|(_, c)| c.key == *key))
                {
                    self.flag(format!(
                        "stopped {key:?} while the driver holds it or a call waits for it"
                    ));
                }
                if self.suspend_fails.contains(key) {
                    return Progress::Failed(ActError::Signal {
                        pid: key.pid,
                        source: std::io::Error::other("refused"),
                    });
                }
                if self.alive(key).is_none() {
                    return Progress::Gone;
                }
                self.stopped.insert(*key);
                Progress::Done
            }
            (Target::Process { key, .. }, Op::Resume) => {
                self.stopped.remove(key);
                Progress::Done
            }
            (Target::Gate { key, .. }, Op::Resume) => {
                self.closed.remove(key);
                Progress::Done
            }
            (Target::Gate { .. }, Op::Suspend) => {
                Progress::Failed(ActError::NoGate("closed by CloseGate only".into()))
            }
            (Target::Cgroup { .. }, _) => {
                self.flag("a cgroup acted on: none was declared".into());
                Progress::Done
            }
        }
    }
}

fn entry(p: &Proc, generation: u64, cgroup: Option<PathBuf>) -> Entry {
    let class = if p.online {
        Class::Online
    } else {
        Class::Offline
    };
    // The shared cgroup, declared offline as a whole (a pod's container): every process
    // in it is stopped with signals (`--actuator signal`).
    let facts = match cgroup {
        Some(dir) if !p.online => CgroupFacts {
            declared: Some(dir.display().to_string()),
            dir: Some((dir, crate::edges::actuator::CgroupVersion::V2)),
            holds_agent: false,
            members: Members::Offline,
        },
        _ => CgroupFacts::default(),
    };
    Entry {
        key: p.key,
        cls: super::class(class, None),
        cmd: "work".into(),
        gpus: BTreeSet::new(),
        last_active: BTreeMap::new(),
        last_sampled: BTreeMap::new(),
        nvml_seen: BTreeMap::new(),
        onset: BTreeMap::new(),
        uid: 0,
        pod_uid: None,
        ns_pid: None,
        rung: false,
        cgroup: facts,
        pinned: true,
        home: None,
        generation,
    }
}

fn page(p: &Proc) -> PageInfo {
    PageInfo {
        id: p.key.pid as u64,
        path: PathBuf::from(format!("/run/gpu-coloc/doorbells/{}-1.bell", p.key.pid)),
        owner: Owner::Pid(p.key.pid),
        file_uid: 0,
        wake_gap_ns: 100 * MS,
        pid: p.key.pid,
        class: coloc_doorbell::CLASS_OFFLINE,
    }
}

/// The six properties' world is built from these.
pub(super) fn ack() -> impl Strategy<Value = Ack> {
    prop_oneof![
        Just(Ack::Never),
        Just(Ack::AtOnce),
        Just(Ack::Wrong),
        (1u8..80).prop_map(Ack::Late),
    ]
}
