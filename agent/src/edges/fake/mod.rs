//! Fakes of every edge, for the control loop's tests (no root, no GPU, no processes).
//! Each fake is a handle over shared state, so a test keeps a clone to steer it and to
//! see what the loop did.

use super::actuator::RecordEntry;
use super::clock::Clock;
use super::gpu::{Activity, GpuError, GpuSampler};
use super::procfs::{Cgroups, ProcFs, ProcInfo, ProcKey, Stat};
use super::record::RecordStore;
use super::source::{Classified, PodSource};
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// A clock the test moves.
#[derive(Debug, Default, Clone)]
pub struct FakeClock(pub Arc<AtomicU64>);

impl FakeClock {
    /// Sets the time.
    pub fn set(&self, ns: u64) {
        self.0.store(ns, Ordering::SeqCst);
    }
    /// Moves it forward.
    pub fn advance(&self, ns: u64) {
        self.0.fetch_add(ns, Ordering::SeqCst);
    }
}

impl Clock for FakeClock {
    fn now_ns(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
    /// The same time: a fake clock steps only when the test moves it forward.
    fn elapsed_ns(&self) -> u64 {
        self.now_ns()
    }
}

/// A wall clock a test can step (an NTP step) apart from the time that passes: its
/// `now_ns` is `time` plus the step, its `elapsed_ns` is `time` alone.
#[derive(Debug, Default, Clone)]
pub struct SteppedClock {
    /// The time that passes (the test moves it).
    pub time: FakeClock,
    /// How far the wall clock has been stepped, ns (negative: back).
    pub step: Arc<std::sync::atomic::AtomicI64>,
}

impl SteppedClock {
    /// Steps the wall clock by `ns` (negative: back); no time passes.
    pub fn step(&self, ns: i64) {
        self.step.fetch_add(ns, Ordering::SeqCst);
    }
}

impl Clock for SteppedClock {
    fn now_ns(&self) -> u64 {
        self.time
            .now_ns()
            .saturating_add_signed(self.step.load(Ordering::SeqCst))
    }
    fn elapsed_ns(&self) -> u64 {
        self.time.now_ns()
    }
}

/// What the fake GPU answers.
#[derive(Debug, Default)]
pub struct GpuState {
    /// PIDs per GPU.
    pub procs: BTreeMap<u32, Vec<u32>>,
    /// Samples waiting to be read, per GPU: (pid, at_ns).
    pub samples: BTreeMap<u32, Vec<(u32, u64)>>,
    /// GPUs whose calls fail.
    pub failing: BTreeSet<u32>,
    /// Calls made.
    pub calls: u64,
    /// The GPUs whose samples were read, in order.
    pub sampled: Vec<u32>,
    /// The GPUs whose process lists were read, in order.
    pub listed: Vec<u32>,
}

/// The fake NVML.
#[derive(Debug, Clone)]
pub struct FakeGpu {
    /// GPU indices.
    pub gpus: Vec<u32>,
    /// Shared state.
    pub state: Arc<Mutex<GpuState>>,
    /// While set, `samples` blocks (a hung call), until cleared.
    pub hang: Arc<(Mutex<bool>, Condvar)>,
    /// Set while a call is blocked in a hang.
    pub in_hang: Arc<AtomicBool>,
    /// How long each call takes on the loop's clock, and what happens during one.
    pub call_time: Arc<Mutex<CallTime>>,
}

/// How long each call of [`FakeGpu`] takes on the loop's fake clock (NVML's calls take
/// about 2 ms each on an H100), and something that happens halfway through the next call
/// (a launch that rings while the loop is inside NVML).
#[derive(Default)]
pub struct CallTime {
    /// The loop's clock, moved by `ns` per call (none: calls take no time).
    pub clock: Option<FakeClock>,
    /// How long a call takes.
    pub ns: u64,
    /// Run halfway through the next call, with the clock's time then.
    pub midway: Option<Box<dyn FnOnce(u64) + Send>>,
    /// When each call since `midway` ran ended (the first is the call it ran in).
    pub ends: Vec<u64>,
}

impl std::fmt::Debug for CallTime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallTime")
            .field("ns", &self.ns)
            .field("midway", &self.midway.is_some())
            .field("ends", &self.ends)
            .finish_non_exhaustive()
    }
}

impl FakeGpu {
    /// A node with `n` GPUs.
    pub fn new(n: u32) -> FakeGpu {
        FakeGpu {
            gpus: (0..n).collect(),
            state: Default::default(),
            hang: Default::default(),
            in_hang: Default::default(),
            call_time: Default::default(),
        }
    }
    /// A call takes its time (see [`CallTime`]).
    fn spend(&self) {
        let mut c = self.call_time.lock().unwrap();
        let Some(clock) = c.clock.clone() else {
            return;
        };
        let half = c.ns / 2;
        clock.advance(half);
        let midway = c.midway.take();
        let ran = midway.is_some();
        if let Some(f) = midway {
            c.ends.clear();
            f(clock.now_ns());
        }
        clock.advance(c.ns - half);
        if ran || !c.ends.is_empty() {
            c.ends.push(clock.now_ns());
        }
    }
    /// Puts `pid` on `gpu`.
    pub fn add(&self, gpu: u32, pid: u32) {
        self.state
            .lock()
            .unwrap()
            .procs
            .entry(gpu)
            .or_default()
            .push(pid);
    }
    /// A sample of `pid` on `gpu` at `at`.
    pub fn sample(&self, gpu: u32, pid: u32, at: u64) {
        self.state
            .lock()
            .unwrap()
            .samples
            .entry(gpu)
            .or_default()
            .push((pid, at));
    }
    /// Makes `gpu`'s calls fail (or succeed again).
    pub fn fail(&self, gpu: u32, on: bool) {
        let mut s = self.state.lock().unwrap();
        if on {
            s.failing.insert(gpu);
        } else {
            s.failing.remove(&gpu);
        }
    }
    /// Makes the next `samples` call hang until [`FakeGpu::set_hang`] false.
    pub fn set_hang(&self, on: bool) {
        let (m, cv) = &*self.hang;
        *m.lock().unwrap() = on;
        cv.notify_all();
    }
    fn err(gpu: u32) -> GpuError {
        GpuError::Call {
            function: "nvmlDeviceGetProcessUtilization",
            gpu,
            source: nvml_wrapper::error::NvmlError::GpuLost,
        }
    }
}

impl GpuSampler for FakeGpu {
    fn gpus(&self) -> Vec<u32> {
        self.gpus.clone()
    }
    fn uuid(&self, gpu: u32) -> String {
        coloc_doorbell::format_uuid(&fake_uuid(gpu))
    }
    fn processes(&mut self, gpu: u32) -> Result<Vec<u32>, GpuError> {
        self.spend();
        let mut s = self.state.lock().unwrap();
        s.calls += 1;
        s.listed.push(gpu);
        if s.failing.contains(&gpu) {
            return Err(Self::err(gpu));
        }
        Ok(s.procs.get(&gpu).cloned().unwrap_or_default())
    }
    fn samples(
        &mut self,
        gpu: u32,
        since_us: u64,
        out: &mut Vec<Activity>,
    ) -> Result<(), GpuError> {
        {
            let (m, cv) = &*self.hang;
            let mut hung = m.lock().unwrap();
            while *hung {
                self.in_hang.store(true, Ordering::SeqCst);
                hung = cv.wait_timeout(hung, Duration::from_secs(10)).unwrap().0;
            }
            self.in_hang.store(false, Ordering::SeqCst);
        }
        self.spend();
        let mut s = self.state.lock().unwrap();
        s.calls += 1;
        s.sampled.push(gpu);
        if s.failing.contains(&gpu) {
            return Err(Self::err(gpu));
        }
        let v = s.samples.remove(&gpu).unwrap_or_default();
        out.extend(
            v.into_iter()
                .filter(|(_, at)| at / 1000 > since_us)
                .map(|(pid, at_ns)| Activity {
                    pid,
                    at_ns,
                    sm_util: 100,
                }),
        );
        Ok(())
    }
}

/// The fake `/proc`.
#[derive(Debug, Default, Clone)]
pub struct FakeProc {
    /// Visible processes.
    pub procs: Arc<Mutex<BTreeMap<u32, ProcInfo>>>,
    /// `cgroup.procs` per directory.
    pub members: Arc<Mutex<BTreeMap<PathBuf, Vec<u32>>>>,
    /// The agent's cgroups.
    pub own: Arc<Mutex<Cgroups>>,
}

impl FakeProc {
    /// Adds (or replaces) a process with start time `start` in v2 cgroup `cgroup`.
    pub fn add(&self, pid: u32, start: u64, cmd: &str, cgroup: &str) -> ProcKey {
        let key = ProcKey { pid, start };
        self.procs.lock().unwrap().insert(
            pid,
            ProcInfo {
                key,
                uid: 0,
                exe: None,
                cmdline: cmd.into(),
                cgroups: Cgroups::parse(&format!("0::{cgroup}\n")),
                ns_pid: Some(pid),
            },
        );
        key
    }
    /// Makes `pid` exit.
    pub fn remove(&self, pid: u32) {
        self.procs.lock().unwrap().remove(&pid);
    }
}

impl ProcFs for FakeProc {
    fn read_proc(&self, pid: u32) -> io::Result<ProcInfo> {
        self.procs
            .lock()
            .unwrap()
            .get(&pid)
            .cloned()
            .ok_or_else(|| io::ErrorKind::NotFound.into())
    }
    fn read_stat(&self, pid: u32) -> io::Result<Stat> {
        let p = self.read_proc(pid)?;
        Ok(Stat {
            state: 'S',
            start: p.key.start,
            cpu: 0,
        })
    }
    fn self_cgroups(&self) -> Cgroups {
        self.own.lock().unwrap().clone()
    }
    fn self_pid(&self) -> u32 {
        1
    }
    fn cgroup_members(&self, dir: &Path) -> io::Result<Vec<u32>> {
        self.members
            .lock()
            .unwrap()
            .get(dir)
            .cloned()
            .ok_or_else(|| io::ErrorKind::NotFound.into())
    }
    fn cgroup_tree_members(&self, dir: &Path) -> io::Result<Vec<u32>> {
        let m = self.members.lock().unwrap();
        if !m.contains_key(dir) {
            return Err(io::ErrorKind::NotFound.into());
        }
        Ok(m.iter()
            .filter(|(d, _)| d.starts_with(dir))
            .flat_map(|(_, pids)| pids.iter().copied())
            .collect())
    }
    fn exited(&self, pins: &[(ProcKey, &OwnedFd)]) -> Vec<bool> {
        pins.iter()
            .map(|(k, _)| !matches!(self.read_stat(k.pid), Ok(s) if s.start == k.start))
            .collect()
    }
    fn open_pidfd(&self, key: ProcKey) -> io::Result<OwnedFd> {
        match self.read_stat(key.pid) {
            Ok(s) if s.start == key.start => Ok(std::fs::File::open("/dev/null")?.into()),
            _ => Err(io::ErrorKind::NotFound.into()),
        }
    }
}

/// Classification by PID.
#[derive(Debug, Default, Clone)]
pub struct FakeSource {
    /// Classes.
    pub classes: Arc<Mutex<BTreeMap<u32, Classified>>>,
    /// Generation.
    pub generation: Arc<AtomicU64>,
}

impl FakeSource {
    /// Classifies `pid`.
    pub fn set(&self, pid: u32, c: Classified) {
        self.classes.lock().unwrap().insert(pid, c);
        self.generation.fetch_add(1, Ordering::SeqCst);
    }
}

impl PodSource for FakeSource {
    fn classify(&self, p: &ProcInfo) -> Classified {
        self.classes
            .lock()
            .unwrap()
            .get(&p.key.pid)
            .cloned()
            .unwrap_or_else(|| Classified::unmanaged(qos_core::Class::Unmanaged))
    }
    fn ready(&self) -> bool {
        true
    }
    fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }
}

/// The record's "disk".
#[derive(Debug, Default, Clone)]
pub struct FakeRecord {
    /// What is on disk.
    pub disk: Arc<Mutex<BTreeSet<RecordEntry>>>,
    /// While set, writes fail.
    pub broken: Arc<AtomicBool>,
    /// When set, this many more `add`s succeed, and the ones after fail.
    pub adds_left: Arc<Mutex<Option<usize>>>,
    /// How long each write takes (a slow state directory).
    pub delay: Arc<Mutex<Duration>>,
    mem: BTreeSet<RecordEntry>,
}

impl RecordStore for FakeRecord {
    fn add(&mut self, es: &[RecordEntry]) -> anyhow::Result<()> {
        std::thread::sleep(*self.delay.lock().unwrap());
        if self.broken.load(Ordering::SeqCst) {
            anyhow::bail!("state directory not writable (fake)");
        }
        if let Some(n) = self.adds_left.lock().unwrap().as_mut() {
            if *n == 0 {
                anyhow::bail!("state directory full (fake)");
            }
            *n -= 1;
        }
        self.mem.extend(es.iter().cloned());
        *self.disk.lock().unwrap() = self.mem.clone();
        Ok(())
    }
    fn remove(&mut self, es: &[RecordEntry]) -> anyhow::Result<()> {
        for e in es {
            self.mem.remove(e);
        }
        *self.disk.lock().unwrap() = self.mem.clone();
        Ok(())
    }
    fn entries(&self) -> &BTreeSet<RecordEntry> {
        &self.mem
    }
}

mod act;
pub use act::*;
