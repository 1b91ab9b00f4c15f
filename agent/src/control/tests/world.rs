//! A model of the world as the edges of the real control loop ([`Loop`], the same shell
//! as every other test here): processes that start, exit and reuse PIDs, online work,
//! NVML that fails per GPU, a record whose writes land late or fail, an actuator that
//! fails or whose holds a tenant breaks, launch gates whose shims acknowledge at once,
//! late, falsely or never, and a CUDA driver with the checkpoint API whose calls wait while
//! their process is stopped (as the H100's did), over GPUs whose memory online and offline
//! processes share. Time is the loop's fake clock: nothing moves within a tick but what
//! the test moves.
//!
//! Every edge is a view of one [`Model`]; the edges that act (the actuator, the gate
//! keeper, the driver's calls) check at each call what the controller may never ask
//! (`props_ctl` checks the rest after each tick), and a conversation that never ends (a
//! tick that would never return to have its violation looked at) fails the test at once.
//! A test reads and steers the model through [`World::m`], never while the loop runs.

use super::*;
use crate::control::io::Obs;
use crate::control::record::Write;
use crate::control::shell::scribe::Writer;
use crate::edges::actuator::{ActError, Actuator, Progress, Target};
use crate::edges::checkpoint::{Done, DriverWork};
use crate::edges::doorbell::{BellReading, Doorbells, Owner, PageInfo, Waker};
use crate::edges::gate::LaunchGates;
use crate::edges::gpu::{Activity, GpuError, GpuMemory, GpuSampler};
use crate::edges::procfs::{Cgroups, ProcFs, ProcInfo, ProcKey, Stat};
use crate::edges::source::PodSource;
use coloc_doorbell::GateReading;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::{Mutex, MutexGuard};

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

use crate::control::driver_book::DState;

/// The world the edges show the loop.
pub(super) struct Model {
    clock: FakeClock,
    /// The loop's clock: the wall clock, the model's time unless the test stepped it.
    wall: SteppedClock,
    /// A step forward of the wall clock, ns, made at the loop's next wait for a write or a
    /// driver call (an NTP step while the agent is on its way out).
    pub wall_step: u64,
    /// The host's cgroup v2 hierarchy (a scratch directory): the shared cgroups, and the
    /// memory limits of processes given one.
    root: PathBuf,
    gpus: u32,
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
    pub writes: VecDeque<(u64, Write)>,
    /// What the actuator holds stopped now.
    pub stopped: BTreeSet<ProcKey>,
    /// Closed gates: process → (epoch, when).
    pub closed: BTreeMap<ProcKey, (u32, u64)>,
    epoch: u32,
    samples: BTreeMap<u32, Vec<Activity>>,
    pub nvml_failing: BTreeSet<u32>,
    pub suspend_fails: BTreeSet<ProcKey>,
    pub generation: u64,
    pages_changed: bool,
    /// Processes whose pods are annotated `gpu-coloc.dev/checkpoint: "false"`.
    pub opt_out: BTreeSet<ProcKey>,
    /// Keys the shell found no longer live (their pidfd said so: exited, or the PID reused).
    pub reported_gone: BTreeSet<ProcKey>,
    /// What went wrong at each call, if anything.
    pub violation: Option<String>,
    /// The edges' calls at one instant of the clock: (the instant, how many). The loop
    /// looks at the record's writes at every round of a conversation, so a conversation
    /// that never ends is a count that never stops ([`CALLS_PER_INSTANT`]).
    edge_calls: (u64, u32),
    /// Where the driver has each process (absent: running).
    pub dstate: BTreeMap<ProcKey, DState>,
    /// Driver calls on their way: (earliest end, id, process, op).
    calls: Vec<(u64, u64, ProcKey, DriverOp)>,
    next_call: u64,
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
    /// The offline processes of each GPU share one cgroup (`/cg/gpu<N>`), declared offline
    /// by their pods, suspended by stopping all its processes (`--actuator signal`): one
    /// process's hold stops the others, a checkpointed one among them, and their restore
    /// must wait for the thaw.
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
}

type DriverOp = crate::edges::checkpoint::Op;

fn uuid(gpu: u32) -> [u8; 16] {
    fake_uuid(gpu)
}

/// The gate file the model's gate keeper names (never opened: the keeper is the model).
const GATE_FILE: &str = "/run/gpu-coloc/gate/gates";

impl Model {
    fn now(&self) -> u64 {
        self.clock.now_ns()
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
        self.calls.iter().any(|(_, _, k, _)| k == key)
    }

    fn alive(&self, key: &ProcKey) -> Option<&Proc> {
        self.procs.values().find(|p| p.key == *key)
    }

    fn by_pid(&self, pid: u32) -> Option<&Proc> {
        self.procs.values().find(|p| p.key.pid == pid)
    }

    fn flag(&mut self, what: String) {
        self.violation.get_or_insert(what);
    }

    /// The cgroup `p` shares with the other offline processes of its GPU, as its pod
    /// declares it, if they share one.
    fn shared_cgroup(&self, p: &Proc) -> Option<String> {
        (self.shared_cgroups && !p.online).then(|| format!("/cg/gpu{}", p.gpu))
    }

    /// `p`'s cgroup v2 path, if it has one the agent can see: its shared cgroup, or the
    /// cgroup of its memory limit.
    fn cgroup_path(&self, p: &Proc) -> Option<String> {
        let own = format!("/p/{}", p.key.pid);
        self.shared_cgroup(p)
            .or_else(|| self.root.join(&own[1..]).is_dir().then_some(own))
    }

    /// How long a call of `op` takes once its process runs, ms.
    fn call_ms(&self, op: DriverOp) -> u64 {
        match op {
            DriverOp::Lock => self.lock_ms.unwrap_or(self.call_ms),
            DriverOp::State => self.state_ms.unwrap_or(self.call_ms),
            _ => self.call_ms,
        }
    }

    /// Whether call `(due, key, op)` can end by `at`: due, and its process running (or
    /// gone, or a state query).
    fn can_end(&self, due: u64, key: &ProcKey, op: DriverOp, at: u64) -> bool {
        let alive = self.alive(key).is_some();
        let waits = op != DriverOp::State
            && (self.stopped.contains(key) || self.tenant_stopped.contains(key));
        !alive || (due <= at && !waits)
    }

    /// The driver's answer to a call that ends now.
    fn end_call(&mut self, id: u64, key: ProcKey, op: DriverOp, due: u64) -> Done {
        use crate::edges::checkpoint::{CallEnd, CuError, ProcessState};
        let now = self.now();
        let st = self.driver_state(&key);
        let err = |code: i32, name: &str| {
            CallEnd::Answered(Err(CuError {
                op,
                code,
                name: name.into(),
            }))
        };
        let mut state = None;
        let end = if self.alive(&key).is_none() {
            CallEnd::Gone
        } else {
            match (op, st) {
                (DriverOp::Lock, _) if self.refuse.contains(&key) => {
                    self.refused.insert(key);
                    err(801, "CUDA_ERROR_NOT_SUPPORTED")
                }
                (DriverOp::Lock, DState::Running) => {
                    self.dstate.insert(key, DState::Locked);
                    CallEnd::Answered(Ok(()))
                }
                (DriverOp::Checkpoint, DState::Locked) => {
                    self.dstate.insert(key, DState::Checkpointed);
                    CallEnd::Answered(Ok(()))
                }
                (DriverOp::Restore, DState::Checkpointed) => {
                    let gpu = self.alive(&key).map_or(0, |p| p.gpu);
                    if self.free(gpu) < self.proc_bytes {
                        err(2, "CUDA_ERROR_OUT_OF_MEMORY")
                    } else {
                        self.dstate.insert(key, DState::Locked);
                        CallEnd::Answered(Ok(()))
                    }
                }
                (DriverOp::Unlock, DState::Locked) => {
                    self.dstate.remove(&key);
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
                _ => err(401, "CUDA_ERROR_ILLEGAL_STATE"),
            }
        };
        Done {
            id,
            key,
            op,
            end,
            state,
            elapsed: Duration::from_nanos(now.saturating_sub(due) + self.call_ms(op) * MS),
        }
    }

    /// The driver calls that can end by `at`, ended (a call on a stopped process waits for
    /// it, as the real driver's did).
    fn driver_done(&mut self, at: u64) -> Vec<Done> {
        let mut out = Vec::new();
        for (due, id, key, op) in std::mem::take(&mut self.calls) {
            if self.can_end(due, &key, op, at) {
                out.push(self.end_call(id, key, op, due));
            } else {
                self.calls.push((due, id, key, op));
            }
        }
        out
    }

    /// The loop waits: the wall clock steps now if the test asked for it.
    fn waits(&mut self) {
        let step = std::mem::take(&mut self.wall_step);
        self.wall.step(step as i64);
    }

    /// Lands write `w` (or fails it, while the record is broken).
    fn land(&mut self, w: Write) -> Obs {
        let ok = !self.record_broken;
        if ok {
            self.disk.extend(w.add.iter().cloned());
            for e in &w.remove {
                self.disk.remove(e);
            }
            self.still_recorded();
        }
        Obs::Written { id: w.id, ok }
    }

    /// Record before act, after the act too: whatever the agent holds of a live process
    /// (stopped, its gate closed, locked or checkpointed by the driver) stays on disk until
    /// it is let go (a write that lets its entry go while it is held leaves the next start
    /// nothing to resume it by).
    fn still_recorded(&mut self) {
        let mut lost = Vec::new();
        for p in self.procs.values() {
            let k = p.key;
            let process = RecordEntry::Process {
                pid: k.pid,
                start: k.start,
            };
            if self.stopped.contains(&k) && !self.disk.contains(&process) {
                lost.push(format!("{k:?} is stopped"));
            }
            let gate = crate::control::target::Target::Gate {
                key: k,
                uuid: uuid(p.gpu),
                file: PathBuf::from(GATE_FILE),
            }
            .record();
            if self.closed.contains_key(&k) && !self.disk.contains(&gate) {
                lost.push(format!("{k:?} is behind its closed gate"));
            }
            let driver = [
                RecordEntry::Lock {
                    pid: k.pid,
                    start: k.start,
                },
                RecordEntry::Checkpoint {
                    pid: k.pid,
                    start: k.start,
                },
            ];
            if self.driver_state(&k) != DState::Running
                && !driver.iter().any(|e| self.disk.contains(e))
            {
                lost.push(format!(
                    "{k:?} is {:?} by the driver",
                    self.driver_state(&k)
                ));
            }
        }
        for what in lost {
            self.flag(format!("a write let go of the record while {what}"));
        }
    }

    /// The writes due by now, landed (or failed).
    fn landed(&mut self) -> Vec<Obs> {
        let mut out = Vec::new();
        while self
            .writes
            .front()
            .is_some_and(|(due, _)| *due <= self.now())
        {
            let (_, w) = self.writes.pop_front().unwrap();
            out.push(self.land(w));
        }
        out
    }

    /// Record before act; only a process started offline, under that key, and never one
    /// the shell has found gone (its PID reused). Before the shell could tell, a key
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
            (Target::Gate { .. }, _) => {
                self.flag("a gate reached the actuator".into());
                Progress::Done
            }
            (Target::Process { key, .. }, Op::Suspend) => {
                self.may_stop(*key, t.record(), "stopped");
                // A cgroup's stop takes every process in it, whatever the driver holds
                // there: only a process's own plan must wait for the driver.
                let cgroup = self.shared_cgroups && self.offline.contains(key);
                if !cgroup && (self.driver_state(key) != DState::Running || self.call_for(key)) {
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
            (Target::Cgroup { .. }, _) => {
                self.flag(format!(
                    "a cgroup acted on ({t}): none is the actuator's here"
                ));
                Progress::Done
            }
        }
    }

    fn check(&mut self, t: &Target, op: Op) -> Progress {
        match (t, op) {
            (Target::Process { key, .. }, Op::Suspend) => {
                if self.alive(key).is_none() {
                    Progress::Gone
                } else if self.stopped.contains(key) {
                    Progress::Done
                } else {
                    Progress::Pending
                }
            }
            (Target::Lock { .. } | Target::Gate { .. } | Target::Cgroup { .. }, _) => {
                self.flag(format!("{t} checked by the actuator"));
                Progress::Done
            }
            _ => Progress::Done,
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
}

/// How many calls of the model's edges one instant of the loop's clock may see: a tick
/// of the properties makes a few dozen.
const CALLS_PER_INSTANT: u32 = 100_000;

/// The model, shared by its edges: each trait of the loop's edges is implemented on this
/// handle (not to be confused with the loop's `state::Shared`, its handle for HTTP).
#[derive(Clone)]
pub(super) struct ModelEdges(Arc<Mutex<Model>>);

impl std::fmt::Debug for ModelEdges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the world's model")
    }
}

impl ModelEdges {
    /// The model. Locked by one holder at a time: a test that holds it while the loop runs
    /// is told so at once, rather than hanging.
    ///
    /// More than [`CALLS_PER_INSTANT`] calls while the clock stands still is a conversation
    /// of the loop's that never ends (a tick whose violation would never be looked at
    /// otherwise): it fails the test with the first violation found, at once. The count
    /// starts again for the loop's way out as the test unwinds; a way out that never ends
    /// either aborts the test binary rather than hang it.
    fn m(&self) -> MutexGuard<'_, Model> {
        let mut m = match self.0.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {
                panic!("the world's model is locked twice (a test holds it while the loop runs)")
            }
        };
        let now = m.now();
        if m.edge_calls.0 != now {
            m.edge_calls = (now, 0);
        }
        m.edge_calls.1 += 1;
        if m.edge_calls.1 > CALLS_PER_INSTANT {
            let what = format!(
                "the loop's conversation at {} ms did not end ({CALLS_PER_INSTANT} calls of its edges at one instant); first violation: {}",
                now.saturating_sub(T0) / MS,
                m.violation.as_deref().unwrap_or("none")
            );
            m.edge_calls = (now, 0);
            drop(m);
            if std::thread::panicking() {
                // Straight to the process's stderr: the test harness's capture of
                // `eprintln!` is lost with the process.
                use std::io::Write as _;
                let _ = writeln!(std::io::stderr(), "{what}, again on the way out: aborting");
                // No drop runs past the abort: the scratch directories of every world of
                // this process go first.
                let me = format!("-{}", std::process::id());
                for e in std::fs::read_dir(std::env::temp_dir())
                    .into_iter()
                    .flatten()
                {
                    let Ok(e) = e else { continue };
                    let name = e.file_name().to_string_lossy().into_owned();
                    if name.starts_with("coloc-world-") && name.ends_with(&me) {
                        let _ = std::fs::remove_dir_all(e.path());
                    }
                }
                std::process::abort();
            }
            panic!("{what}");
        }
        m
    }
}

impl GpuSampler for ModelEdges {
    fn gpus(&self) -> Vec<u32> {
        (0..self.m().gpus).collect()
    }
    fn uuid(&self, gpu: u32) -> String {
        coloc_doorbell::format_uuid(&uuid(gpu))
    }
    fn processes(&mut self, gpu: u32) -> Result<Vec<u32>, GpuError> {
        let m = self.m();
        if m.nvml_failing.contains(&gpu) {
            return Err(lost(gpu));
        }
        // A checkpointed process has left the driver's lists.
        Ok(m.procs
            .values()
            .filter(|p| p.gpu == gpu && m.driver_state(&p.key) != DState::Checkpointed)
            .map(|p| p.key.pid)
            .collect())
    }
    fn samples(
        &mut self,
        gpu: u32,
        _since_us: u64,
        out: &mut Vec<Activity>,
    ) -> Result<(), GpuError> {
        let mut m = self.m();
        let s = m.samples.remove(&gpu).unwrap_or_default();
        if m.nvml_failing.contains(&gpu) {
            return Err(lost(gpu));
        }
        out.extend(s);
        Ok(())
    }
    fn memory(&mut self, gpu: u32) -> Result<Option<GpuMemory>, GpuError> {
        let m = self.m();
        let processes = m
            .procs
            .values()
            .filter(|p| p.gpu == gpu && m.driver_state(&p.key) != DState::Checkpointed)
            .map(|p| (p.key.pid, m.proc_bytes))
            .collect();
        Ok(Some(GpuMemory {
            total: m.mem_total,
            free: m.free(gpu),
            processes,
        }))
    }
}

fn lost(gpu: u32) -> GpuError {
    GpuError::Call {
        function: "nvmlDeviceGetProcessUtilization",
        gpu,
        source: nvml_wrapper::error::NvmlError::GpuLost,
    }
}

impl ProcFs for ModelEdges {
    fn read_proc(&self, pid: u32) -> std::io::Result<ProcInfo> {
        let m = self.m();
        let p = m.by_pid(pid).ok_or(std::io::ErrorKind::NotFound)?;
        let cgroups = match m.cgroup_path(p) {
            Some(path) => Cgroups::parse(&format!("0::{path}\n")),
            None => Cgroups::default(),
        };
        Ok(ProcInfo {
            key: p.key,
            uid: 0,
            exe: None,
            cmdline: "work".into(),
            cgroups,
            ns_pid: Some(pid),
        })
    }
    fn read_stat(&self, pid: u32) -> std::io::Result<Stat> {
        let m = self.m();
        let p = m.by_pid(pid).ok_or(std::io::ErrorKind::NotFound)?;
        let stopped = m.stopped.contains(&p.key) || m.tenant_stopped.contains(&p.key);
        Ok(Stat {
            state: if stopped { 'T' } else { 'S' },
            start: p.key.start,
            cpu: 0,
        })
    }
    fn self_cgroups(&self) -> Cgroups {
        Cgroups::parse("0::/system.slice/coloc-agent.service\n")
    }
    fn self_pid(&self) -> u32 {
        1
    }
    /// A shared cgroup's live processes; its runtime removes it once the last has exited.
    fn cgroup_members(&self, dir: &Path) -> std::io::Result<Vec<u32>> {
        let m = self.m();
        let pids: Vec<u32> = m
            .procs
            .values()
            .filter(|p| {
                m.shared_cgroup(p)
                    .is_some_and(|c| m.root.join(&c[1..]) == dir)
            })
            .map(|p| p.key.pid)
            .collect();
        if pids.is_empty() {
            return Err(std::io::ErrorKind::NotFound.into());
        }
        Ok(pids)
    }
    fn cgroup_tree_members(&self, dir: &Path) -> std::io::Result<Vec<u32>> {
        self.cgroup_members(dir)
    }
    fn open_pidfd(&self, key: ProcKey) -> std::io::Result<OwnedFd> {
        if self.m().alive(&key).is_none() {
            return Err(std::io::ErrorKind::NotFound.into());
        }
        Ok(std::fs::File::open("/dev/null")?.into())
    }
    /// Whether each pinned process has exited; the shell knows from now on.
    fn exited(&self, pins: &[(ProcKey, &OwnedFd)]) -> Vec<bool> {
        let mut m = self.m();
        pins.iter()
            .map(|(k, _)| {
                let gone = m.alive(k).is_none();
                if gone {
                    m.reported_gone.insert(*k);
                }
                gone
            })
            .collect()
    }
}

impl PodSource for ModelEdges {
    fn classify(&self, info: &ProcInfo) -> crate::edges::source::Classified {
        let m = self.m();
        let Some(p) = m.alive(&info.key) else {
            return crate::edges::source::Classified::unmanaged(Class::Unmanaged);
        };
        let mut c = super::class(
            if p.online {
                Class::Online
            } else {
                Class::Offline
            },
            m.shared_cgroup(p).as_deref(),
        );
        if m.opt_out.contains(&p.key) {
            c.checkpoint = Some(false);
        }
        c
    }
    fn ready(&self) -> bool {
        true
    }
    fn generation(&self) -> u64 {
        self.m().generation
    }
    /// A pod's container cgroup: the pod source vouches for its members.
    fn whole_cgroups(&self) -> bool {
        true
    }
}

impl Actuator for ModelEdges {
    fn start(&mut self, targets: &[Target], op: Op, _budget: Duration) -> Vec<Progress> {
        let mut m = self.m();
        targets.iter().map(|t| m.act(t, op)).collect()
    }
    fn check(&mut self, targets: &[Target], op: Op, _budget: Duration) -> Vec<Progress> {
        let mut m = self.m();
        targets.iter().map(|t| m.check(t, op)).collect()
    }
}

impl LaunchGates for ModelEdges {
    fn path(&self) -> &Path {
        Path::new(GATE_FILE)
    }
    fn close(&mut self, key: ProcKey, uuid: [u8; 16], file: &Path) -> Result<u32, ActError> {
        let mut m = self.m();
        let entry = crate::control::target::Target::Gate {
            key,
            uuid,
            file: file.to_path_buf(),
        }
        .record();
        m.may_stop(key, entry, "closed the gate of");
        m.epoch += 1;
        let (epoch, now) = (m.epoch, m.now());
        m.closed.insert(key, (epoch, now));
        Ok(epoch)
    }
    fn open(&mut self, key: ProcKey, _uuid: [u8; 16]) {
        self.m().closed.remove(&key);
    }
    fn open_all(&mut self) {
        self.m().closed.clear();
    }
    fn beat(&self) {}
}

impl Doorbells for ModelEdges {
    /// The offline processes' pages, when gated (no page rings: they carry no readings).
    fn rescan(&mut self, _force: bool) -> bool {
        let mut m = self.m();
        m.gate && std::mem::take(&mut m.pages_changed)
    }
    fn pages(&self) -> Vec<PageInfo> {
        let m = self.m();
        m.procs
            .values()
            .filter(|p| m.gate && !p.online)
            .map(Model::page)
            .collect()
    }
    fn read(&mut self, _out: &mut Vec<BellReading>) {}
    fn wait(&mut self, _timeout: Duration) -> bool {
        false
    }
    fn waker(&self) -> Waker {
        Waker::default()
    }
    fn rang(&self) -> bool {
        false
    }
    /// The shim of the page's process acknowledges its gate's close as [`Model::ack`] says.
    fn read_gate(&self, page: u64, out: &mut Vec<GateReading>) {
        let m = self.m();
        let Some(p) = m.by_pid(page as u32).filter(|p| !p.online) else {
            return;
        };
        let now = m.now();
        let ack = m.closed.get(&p.key).map_or(0, |(e, at)| match m.ack {
            Ack::Never => 0,
            Ack::AtOnce => *e,
            Ack::Wrong => e.wrapping_add(7),
            Ack::Late(ms) if now >= at + ms as u64 * MS => *e,
            Ack::Late(_) => 0,
        });
        out.push(GateReading {
            index: 0,
            uuid: uuid(p.gpu),
            gate_ack: ack,
            inflight: 0,
            in_submit: 0,
            blocked_ns: 0,
            submitted: 0,
        });
    }
}

impl DriverWork for ModelEdges {
    fn start(&mut self, key: ProcKey, op: DriverOp, _lock_timeout: Duration) -> u64 {
        let mut m = self.m();
        if m.call_for(&key) {
            m.flag(format!(
                "a second driver call for {key:?} while one is on its way"
            ));
        }
        if op == DriverOp::Lock {
            *m.lock_calls.entry(key).or_insert(0) += 1;
            if m.refused.contains(&key) {
                m.flag(format!(
                    "asked the driver to lock {key:?} again after it refused (its other plan holds it)"
                ));
            }
            let lock = RecordEntry::Lock {
                pid: key.pid,
                start: key.start,
            };
            let ckpt = RecordEntry::Checkpoint {
                pid: key.pid,
                start: key.start,
            };
            // Memory preemption records the checkpoint entry before its lock; a lock
            // hold, the lock entry (ahead).
            let entry = if m.disk.contains(&lock) { lock } else { ckpt };
            m.may_stop(key, entry, "locked");
        }
        if op != DriverOp::State && m.stopped.contains(&key) {
            m.flag(format!(
                "{} of {key:?} asked of the driver while the process is stopped (thaw first)",
                op.as_str()
            ));
        }
        let due = m.now() + m.call_ms(op) * MS;
        m.next_call += 1;
        let id = m.next_call;
        m.calls.push((due, id, key, op));
        id
    }
    fn finished(&mut self) -> Vec<Done> {
        let mut m = self.m();
        let now = m.now();
        m.driver_done(now)
    }
    /// Time passes until the next call can end, or `budget` has.
    fn wait_next(&mut self, budget: Duration) -> Option<Done> {
        let mut m = self.m();
        m.waits();
        let until = m.now() + budget.as_nanos() as u64;
        let next = (m.calls.iter())
            .filter(|(due, _, k, op)| m.can_end(*due, k, *op, until))
            .map(|(due, id, _, _)| (*due, *id))
            .min();
        let Some((due, id)) = next else {
            m.clock.set(until);
            return None;
        };
        if due > m.now() {
            m.clock.set(due);
        }
        let i = m.calls.iter().position(|c| c.1 == id).unwrap();
        let (due, id, key, op) = m.calls.remove(i);
        Some(m.end_call(id, key, op, due))
    }
}

impl Writer for ModelEdges {
    fn write(&mut self, w: Write) -> Option<Obs> {
        let mut m = self.m();
        if m.write_delay == 0 {
            return Some(m.land(w));
        }
        let due = m.now() + m.write_delay as u64 * MS;
        m.writes.push_back((due, w));
        None
    }
    fn landed(&mut self) -> Vec<Obs> {
        self.m().landed()
    }
    /// Time passes until the next write lands, or `timeout` has.
    fn wait(&mut self, timeout: Duration) -> Option<Obs> {
        let mut m = self.m();
        m.waits();
        let until = m.now() + timeout.as_nanos() as u64;
        match m.writes.front() {
            Some((due, _)) if *due <= until => {
                let due = *due;
                if due > m.now() {
                    m.clock.set(due);
                }
                let (_, w) = m.writes.pop_front().unwrap();
                Some(m.land(w))
            }
            _ => {
                m.clock.set(until);
                None
            }
        }
    }
}

/// The harness over the model's edges.
pub(super) type World = H<ModelEdges>;

impl H<ModelEdges> {
    pub fn new(gpus: u32, gate: bool, ack: Ack, write_delay: u32) -> World {
        let mut cfg = default_config();
        cfg.gate_timeout = Duration::from_millis(50);
        H::with_config(cfg, gpus, gate, ack, write_delay)
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
        H::with_config(cfg, gpus, gate, Ack::AtOnce, write_delay)
    }

    fn with_config(
        mut cfg: LoopConfig,
        gpus: u32,
        gate: bool,
        ack: Ack,
        write_delay: u32,
    ) -> World {
        static WORLDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = WORLDS.fetch_add(1, Ordering::SeqCst);
        let root = TmpDir::new(&format!("coloc-world-{n}"));
        std::fs::create_dir_all(&*root).unwrap();
        cfg.cgroups = crate::edges::cgroupfs::CgroupMounts {
            v2: Some(root.to_path_buf()),
            v1_freezer: None,
            v1_memory: None,
        };
        cfg.record_off_loop = false;
        let driver = cfg.driver_book.api;
        let clock = FakeClock::default();
        clock.set(T0);
        let wall = SteppedClock {
            time: clock.clone(),
            ..SteppedClock::default()
        };
        let model = ModelEdges(Arc::new(Mutex::new(Model {
            clock: clock.clone(),
            wall: wall.clone(),
            wall_step: 0,
            root: root.to_path_buf(),
            gpus,
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
            edge_calls: (0, 0),
            dstate: BTreeMap::new(),
            calls: Vec::new(),
            next_call: 0,
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
        })));
        let edges = Edges {
            gpu: Box::new(model.clone()),
            procfs: Arc::new(model.clone()),
            source: Arc::new(model.clone()),
            clock: Arc::new(wall),
            actuator: Box::new(model.clone()),
            record: Box::new(FakeRecord::default()),
            bells: Box::new(model.clone()),
            gates: gate.then(|| Box::new(model.clone()) as Box<dyn LaunchGates>),
            driver: driver.then(|| Box::new(model.clone()) as Box<dyn DriverWork>),
        };
        let mut lp = Loop::new(cfg, edges, Arc::new(super::Shared::default())).unwrap();
        lp.set_writer(Box::new(model.clone()));
        H {
            lp,
            clock,
            edges: model,
            scratch: vec![root],
        }
    }

    /// The model, to read or steer between ticks.
    pub fn m(&self) -> MutexGuard<'_, Model> {
        self.edges.m()
    }

    /// Where the driver has `key`.
    pub fn driver_state(&self, key: &ProcKey) -> DState {
        self.m().driver_state(key)
    }

    /// The GPU's free memory: what its processes hold, checkpointed ones excepted.
    pub fn free(&self, gpu: u32) -> u64 {
        self.m().free(gpu)
    }

    /// The violation found at a call, if any (taken).
    pub fn violation(&self) -> Option<String> {
        self.m().violation.take()
    }

    pub fn pid(slot: u32) -> u32 {
        10 + slot
    }

    pub fn start(&mut self, slot: u32, gpu: u32, online: bool) {
        let mut m = self.m();
        m.next_start += 1;
        let key = ProcKey {
            pid: Self::pid(slot),
            start: m.next_start,
        };
        if !online {
            m.offline.insert(key);
        }
        if let Some(old) = m.procs.get(&slot).map(|p| p.key) {
            m.dstate.remove(&old);
        }
        let born = m.now();
        let p = Proc {
            key,
            gpu,
            online,
            born,
        };
        if let Some(c) = m.shared_cgroup(&p) {
            let dir = m.root.join(&c[1..]);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("cgroup.freeze"), "0").unwrap();
        }
        m.procs.insert(slot, p);
        m.pages_changed = true;
    }

    pub fn exit(&mut self, slot: u32) {
        let mut m = self.m();
        if let Some(p) = m.procs.remove(&slot) {
            // An exited process holds nothing in the driver.
            m.dstate.remove(&p.key);
            m.pages_changed = true;
        }
    }

    pub fn busy(&mut self, gpu: u32, pid: u32) {
        let mut m = self.m();
        let s = Activity {
            pid,
            at_ns: m.now(),
            sm_util: 50,
        };
        m.samples.entry(gpu).or_default().push(s);
    }

    /// Gives `pid`'s process a memory limit that leaves it `bytes` (a cgroup of its own
    /// with `memory.max`).
    pub fn set_room(&mut self, pid: u32, bytes: u64) {
        let m = self.m();
        let dir = m.root.join(format!("p/{pid}"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("memory.max"), bytes.to_string()).unwrap();
        std::fs::write(dir.join("memory.current"), "0").unwrap();
    }

    /// Tells the loop `o` out of a tick (and lets it perform what follows).
    pub fn tell(&mut self, o: Obs) {
        self.lp.tell(o);
    }

    /// The agent stops: the loop's own way out, the record writable again (every hold
    /// released, the record's last writes, the driver's restores and unlocks waited for
    /// on the loop's clock).
    pub fn shut_down(&mut self) {
        self.m().record_broken = false;
        self.lp
            .release_everything(crate::control::ReleaseAll::Shutdown);
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

/// A conversation of the loop's that never ends (here: the record's writes looked at
/// again and again while the clock stands still, as every round of one does) fails the
/// test at once, naming the instant, instead of hanging it; proptest then shrinks it like
/// any other failure.
#[test]
#[should_panic(expected = "the loop's conversation at 0 ms did not end")]
fn a_conversation_that_never_ends_fails_the_test() {
    let w = World::new(1, false, Ack::AtOnce, 0);
    let mut writer = w.edges.clone();
    for _ in 0..=CALLS_PER_INSTANT {
        writer.landed();
    }
}

/// Record before act holds after the act too: a write that lets go of a stopped process's
/// entry while it is still stopped is a violation (the agent dying then would leave the
/// next start nothing to resume it by), found when the write lands, not only when a later
/// act would look.
#[test]
fn a_write_that_lets_go_of_a_held_process_is_a_violation() {
    let mut w = World::new(1, false, Ack::AtOnce, 0);
    w.start(0, 0, false);
    let k = w.m().procs[&0].key;
    let e = RecordEntry::Process {
        pid: k.pid,
        start: k.start,
    };
    w.m().disk.insert(e.clone());
    w.m().stopped.insert(k);
    let mut writer = w.edges.clone();
    writer.write(Write {
        id: 1,
        add: Vec::new(),
        remove: vec![e],
    });
    let v = w.violation();
    assert!(
        v.as_deref()
            .is_some_and(|v| v.contains("let go of the record while") && v.contains("stopped")),
        "{v:?}"
    );
}
