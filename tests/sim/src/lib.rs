//! # coloc-sim — a simulated GPU for tests, demos and benchmarks
//!
//! Only the GPU is simulated; processes, signals and cgroups stay real. The simulated
//! GPUs live in a small shared-memory file (`COLOC_SIM_STATE`, usually under `/dev/shm`):
//!
//! ```text
//!  workload process ──submit work (ns)──►┐            ┌──► fake NVML (libfake_nvml.so, in the agent)
//!  (coloc-sim online/offline)            │  shm file  │     reads process list + samples
//!         ▲  wait: futex on its slot     ├────────────┤
//!         └───────────────────────────── │ GPU daemon │ (coloc-sim gpu): time slices,
//!                                        └────────────┘  per-period utilisation samples
//! ```
//!
//! - Each workload claims a [`Slot`] and submits GPU work as nanoseconds of exclusive GPU
//!   time. Only the daemon advances the model, so a workload stopped by SIGSTOP or a
//!   freezer can never hold a lock that others wait on: there are no locks, only atomics
//!   with a single writer per field.
//! - The daemon shares each GPU among the slots with outstanding work in time slices, as
//!   an H100 does: one slot runs at a time, at full speed, and keeps the GPU until its
//!   queue runs dry or, once another slot has work, for one slice (default 2.4 ms,
//!   [`DEFAULT_TIMESLICE`]: what a tiny kernel waited beside a training loop on an
//!   H100); then the next slot with work takes its turn. [`SimGpu::set_timeslice`]`(None)`
//!   (`coloc-sim gpu --timeslice-us 0`) selects processor sharing instead (two busy
//!   processes each at half speed). Either way the daemon keeps running work a stopped
//!   process queued before it stopped (its *drain*), as a real GPU does. Work starts when it is
//!   submitted: a slot whose queue ran dry leaves its share idle until the next
//!   submission, however late the daemon learns of it, so the host's gap between a
//!   completion and its next launch costs GPU time here as on a GPU. A submission to an
//!   idle slot wakes the daemon; otherwise it sleeps until the next completion a waiter
//!   is owed (at most its tick). A waiter the daemon woke late is not charged that
//!   lateness: its next submission is dated back by it, while the GPU was otherwise idle.
//! - Every `sample_period` the daemon records, for each process that was active in that
//!   period, a sample `(timestamp µs, sm %)`, as the NVIDIA driver does; the fake NVML
//!   library serves them through `nvmlDeviceGetProcessUtilization`.
//!
//! - The header also holds the fake NVML library's fault switches and call counters
//!   ([`SimGpu::nvml_inject`], [`SimGpu::nvml_hang`], … in [`nvml`]), so a test in one
//!   process can make the NVML calls of the agent in another fail, stall or hang.
//!
//! - Each GPU has device memory (`mem_total`, 80 GiB by default); the fake NVML reports
//!   what is free (`nvmlDeviceGetMemoryInfo_v2`). The CUDA driver's checkpoint API is
//!   modelled in [`checkpoint`]: a checkpointed process's slots are *parked* (out of the
//!   process list and the GPU's used memory) until it is restored.
//!
//! - Workloads may also submit through the CUDA driver API: `tests/fake-cuda` builds
//!   `libfake_cuda.so`, a `libcuda.so.1` whose launches become slot submissions;
//!   [`fake_libcuda_dir`] gives the directory to put on `LD_LIBRARY_PATH`, and
//!   `coloc-sim online --cuda` / `offline --cuda` use it. Both fakes name GPUs by
//!   [`gpu_uuid`] / [`uuid_string`].
//!
//! Clock: `CLOCK_REALTIME` nanoseconds, as NVML's timestamps are wall-clock microseconds.

use anyhow::{bail, Context, Result};
use memmap2::MmapMut;
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::*};

pub mod checkpoint;
pub mod nvml;
pub use nvml::{NvmlCall, NvmlFunc, NvmlStatus};

/// Environment variable naming the state file.
pub const STATE_ENV: &str = "COLOC_SIM_STATE";
/// Identifies a state file of this layout.
pub const MAGIC: u64 = 0x434f_4c4f_4353_4d36; // "COLOCSM6" (6: the time slice)
/// Most processes on all simulated GPUs together.
pub const MAX_SLOTS: usize = 512;
/// Most simulated GPUs.
pub const MAX_GPUS: u32 = 24;
/// Samples kept per process.
pub const RING: usize = 64;

const SLOT_FREE: u32 = 0;
const SLOT_CLAIMING: u32 = 1;
const SLOT_LIVE: u32 = 2;
/// A slot whose process is checkpointed: its memory is on the host, the driver lists it
/// nowhere, and it takes no work until it is restored.
const SLOT_PARKED: u32 = 3;

/// Default device memory per simulated GPU (an H100's 80 GiB).
pub const DEFAULT_MEM_TOTAL: u64 = 80 << 30;
/// Default cost of a checkpoint per GB (measured on an H100, driver 580: about 0.6 s).
pub const DEFAULT_CKPT_PER_GB: std::time::Duration = std::time::Duration::from_millis(600);
/// Default cost of a restore per GB (the same H100: about 0.2 s).
pub const DEFAULT_RESTORE_PER_GB: std::time::Duration = std::time::Duration::from_millis(200);

/// Default time slice of a context while another has work: 2.4 ms, what a tiny kernel
/// waited beside a training loop on an H100 (driver 580: p50 2.41 ms, p99 2.44 ms,
/// `benches/RESULTS.md`, the step that locks the loop with the checkpoint API). The
/// driver's nominal channel-group slice is 1024 µs; the measured wait, nearly constant
/// (p99 within 0.03 ms of p50), is what a waiting context sees, so that is the default.
pub const DEFAULT_TIMESLICE: std::time::Duration = std::time::Duration::from_micros(2400);

/// Shared header.
#[repr(C)]
#[derive(Debug)]
pub struct Header {
    magic: AtomicU64,
    n_gpus: AtomicU32,
    /// 1: the daemon removes slots whose process died; 0: keep them (to test stale PIDs).
    pub reap_dead: AtomicU32,
    sample_period_ns: AtomicU64,
    /// Written by the daemon each tick.
    pub heartbeat_ns: AtomicU64,
    /// Non-zero: the fake NVML answers every device call with `NVML_ERROR_GPU_IS_LOST`
    /// (the original, coarse failure switch; finer ones: [`SimGpu::nvml_inject`] & co).
    pub nvml_fail: AtomicU32,
    daemon_pid: AtomicU32,
    /// Incremented by helper processes forked by `offline --fork-every-ms` (progress probe).
    pub fork_progress: AtomicU64,
    /// Count of NVML calls on a device handle served by the fake library (for cost
    /// accounting); per-function counts: [`SimGpu::nvml_call_count`].
    pub nvml_calls: AtomicU64,
    /// One past the highest slot index ever claimed: readers scan only that far.
    slots_hwm: AtomicU64,
    /// Bumped and woken by a submission to a slot with nothing outstanding: the daemon
    /// sleeps on it, so that a short kernel on an idle GPU completes when it is due, not
    /// at the daemon's next tick.
    daemon_wake: AtomicU32,
    _pad: u32,
    /// Device memory of each simulated GPU (bytes).
    mem_total_bytes: AtomicU64,
    /// What a checkpoint costs per GB of device memory, ns ([`checkpoint`]).
    ckpt_ns_per_gb: AtomicU64,
    /// What a restore costs per GB, ns.
    restore_ns_per_gb: AtomicU64,
    /// An injected checkpoint fault ([`SimGpu::ckpt_inject`]): op mask, fail-state bit,
    /// code in the high half.
    ckpt_fault: AtomicU64,
    /// The PID the fault hits (0: every process).
    ckpt_fault_pid: AtomicU64,
    /// How the GPU is shared between contexts with work: their time slice, ns
    /// ([`SimGpu::set_timeslice`]); 0: processor sharing (each runs at 1/n).
    timeslice_ns: AtomicU64,
    /// NVML fault switches and per-function counters (see [`nvml`]).
    nvml: nvml::NvmlState,
}

const _: () = assert!(std::mem::size_of::<Header>() & 7 == 0);

/// One process on one simulated GPU.
#[repr(C)]
#[derive(Debug)]
pub struct Slot {
    state: AtomicU32,
    pid: AtomicU32,
    gpu: AtomicU32,
    wake_seq: AtomicU32,
    start_time: AtomicU64,
    mem_bytes: AtomicU64,
    /// Work submitted, ns of exclusive GPU time (written by the owner).
    submitted_ns: AtomicU64,
    /// Work completed (written by the daemon).
    completed_ns: AtomicU64,
    /// Wake the slot's waiters when `completed_ns` reaches this, the smallest target any
    /// of them waits for (0: no waiter).
    wake_at: AtomicU64,
    /// When the oldest submission the daemon has not seen yet was made (0: none). Set by
    /// submitters (first one wins), taken by the daemon.
    pending_since_ns: AtomicU64,
    /// Work the model has admitted (written by the daemon): `completed_ns <= admitted_ns
    /// <= submitted_ns`.
    admitted_ns: AtomicU64,
    /// When the work submitted beyond `admitted_ns` may start (written by the daemon; 0:
    /// at once).
    admit_at_ns: AtomicU64,
    /// How late the daemon woke this slot's waiters last time, after their work was done
    /// (written by the daemon; taken off the time of the next submission).
    late_ns: AtomicU64,
    /// Wall time its work ran (written by the daemon; under processor sharing, all the
    /// time it had work outstanding).
    active_ns_total: AtomicU64,
    /// Samples ever written (written by the daemon).
    ring_count: AtomicU64,
    /// `timestamp_us | sm_util << 56`, one atomic word each, so reads never tear.
    ring: [AtomicU64; RING],
}

/// A utilisation sample as the driver reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// Process ID.
    pub pid: u32,
    /// End of the sampled period, microseconds since the Unix epoch.
    pub timestamp_us: u64,
    /// Percent of the period the process had work on the GPU.
    pub sm_util: u32,
}

/// A process as listed by the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcInfo {
    /// Process ID.
    pub pid: u32,
    /// Memory it holds on the GPU.
    pub mem_bytes: u64,
}

/// The mapped state file.
#[derive(Debug)]
pub struct SimGpu {
    map: MmapMut,
}

const fn layout_size() -> usize {
    std::mem::size_of::<Header>()
        + MAX_SLOTS * std::mem::size_of::<Slot>()
        + checkpoint::MAX_PROCS * std::mem::size_of::<checkpoint::ProcEntry>()
}

/// `CLOCK_REALTIME` in nanoseconds.
pub fn now_ns() -> u64 {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    d.as_nanos() as u64
}

/// The process start time (`/proc/<pid>/stat` field 22, clock ticks since boot).
pub fn proc_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 2..];
    after.split_whitespace().nth(19)?.parse().ok()
}

impl SimGpu {
    /// Creates (or truncates) a state file for `n_gpus` GPUs.
    pub fn create(path: &Path, n_gpus: u32, sample_period_ns: u64) -> Result<SimGpu> {
        if n_gpus == 0 || n_gpus > MAX_GPUS {
            bail!("--gpus {n_gpus}: between 1 and {MAX_GPUS} simulated GPUs are supported");
        }
        if !(100_000..=1_000_000_000).contains(&sample_period_ns) {
            bail!("sample period {sample_period_ns} ns: allowed 0.1 ms to 1 s");
        }
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .with_context(|| format!("creating simulated GPU state {}", path.display()))?;
        f.set_len(layout_size() as u64)?;
        // SAFETY: the file is ours, sized above; all access goes through atomics.
        let map = unsafe { MmapMut::map_mut(&f)? };
        let sim = SimGpu { map };
        let h = sim.header();
        h.n_gpus.store(n_gpus, SeqCst);
        h.sample_period_ns.store(sample_period_ns, SeqCst);
        h.reap_dead.store(1, SeqCst);
        h.mem_total_bytes.store(DEFAULT_MEM_TOTAL, SeqCst);
        sim.set_timeslice(Some(DEFAULT_TIMESLICE));
        sim.set_ckpt_cost(DEFAULT_CKPT_PER_GB, DEFAULT_RESTORE_PER_GB);
        h.magic.store(MAGIC, SeqCst);
        Ok(sim)
    }

    /// Opens an existing state file.
    pub fn open(path: &Path) -> Result<SimGpu> {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .with_context(|| format!("opening simulated GPU state {}", path.display()))?;
        let len = f.metadata()?.len();
        if len < layout_size() as u64 {
            bail!("{}: not a coloc-sim state file (too small)", path.display());
        }
        // SAFETY: as in `create`; the file is only accessed through atomics.
        let map = unsafe { MmapMut::map_mut(&f)? };
        let sim = SimGpu { map };
        if sim.header().magic.load(SeqCst) != MAGIC {
            bail!("{}: not a coloc-sim state file (bad magic)", path.display());
        }
        Ok(sim)
    }

    /// Opens the file named by `COLOC_SIM_STATE`.
    pub fn from_env() -> Result<SimGpu> {
        let p = std::env::var_os(STATE_ENV)
            .with_context(|| format!("{STATE_ENV} is not set: no simulated GPU to use"))?;
        SimGpu::open(Path::new(&p))
    }

    /// The shared header.
    pub fn header(&self) -> &Header {
        // SAFETY: the map is at least `layout_size()` bytes, page-aligned, and Header is
        // made of atomics (valid for any bit pattern, zero included).
        unsafe { &*(self.map.as_ptr() as *const Header) }
    }

    /// All slots.
    pub fn slots(&self) -> &[Slot] {
        // SAFETY: the slots follow the header inside the map; atomics only; the header's
        // size is a multiple of 8, which is Slot's alignment.
        unsafe {
            let p = self.map.as_ptr().add(std::mem::size_of::<Header>()) as *const Slot;
            std::slice::from_raw_parts(p, MAX_SLOTS)
        }
    }

    /// The word the daemon sleeps on: a submission to an idle slot bumps and wakes it.
    pub fn daemon_wake(&self) -> &AtomicU32 {
        &self.header().daemon_wake
    }

    /// Number of simulated GPUs.
    pub fn n_gpus(&self) -> u32 {
        self.header().n_gpus.load(Relaxed)
    }

    /// The driver's sample period.
    pub fn sample_period_ns(&self) -> u64 {
        self.header().sample_period_ns.load(Relaxed)
    }

    /// How contexts with work share a GPU: `Some(slice)`: they take turns, each keeping
    /// the GPU for `slice` once another waits (the default, [`DEFAULT_TIMESLICE`], as an
    /// H100 does); `None`: processor sharing, each of n busy contexts at 1/n speed.
    pub fn set_timeslice(&self, slice: Option<std::time::Duration>) {
        let ns = slice.map_or(0, |d| (d.as_nanos() as u64).max(1));
        self.header().timeslice_ns.store(ns, Release);
    }

    /// The time slice ([`SimGpu::set_timeslice`]); None: processor sharing.
    pub fn timeslice(&self) -> Option<std::time::Duration> {
        match self.header().timeslice_ns.load(Acquire) {
            0 => None,
            ns => Some(std::time::Duration::from_nanos(ns)),
        }
    }

    /// Device memory of each GPU.
    pub fn mem_total(&self) -> u64 {
        self.header().mem_total_bytes.load(Relaxed)
    }

    /// Sets the device memory of each GPU.
    pub fn set_mem_total(&self, bytes: u64) {
        self.header().mem_total_bytes.store(bytes, Relaxed);
    }

    /// Device memory in use on `gpu`: what its live processes hold (a checkpointed
    /// process holds none).
    pub fn mem_used(&self, gpu: u32) -> u64 {
        self.processes(gpu).iter().map(|p| p.mem_bytes).sum()
    }

    /// Live processes on `gpu`.
    pub fn processes(&self, gpu: u32) -> Vec<ProcInfo> {
        self.slots()
            .iter()
            .filter(|s| s.state.load(Acquire) == SLOT_LIVE && s.gpu.load(Relaxed) == gpu)
            .map(|s| ProcInfo {
                pid: s.pid.load(Relaxed),
                mem_bytes: s.mem_bytes.load(Relaxed),
            })
            .collect()
    }

    /// Samples on `gpu` newer than `last_seen_us`, oldest first.
    pub fn samples(&self, gpu: u32, last_seen_us: u64) -> Vec<Sample> {
        let mut out = Vec::new();
        let hwm = (self.header().slots_hwm.load(Acquire) as usize).min(MAX_SLOTS);
        for s in &self.slots()[..hwm] {
            if s.state.load(Acquire) != SLOT_LIVE || s.gpu.load(Relaxed) != gpu {
                continue;
            }
            let pid = s.pid.load(Relaxed);
            // Newest first, back to the first sample not newer than `last_seen_us`. The
            // newest entry may be claimed but not written yet (it then holds an old
            // sample): it alone does not end the scan.
            let n = s.ring_count.load(Acquire) as usize;
            for k in 0..n.min(RING) {
                let v = s.ring[(n - 1 - k) % RING].load(Acquire);
                let ts = v & ((1 << 56) - 1);
                if v != 0 && ts > last_seen_us {
                    out.push(Sample {
                        pid,
                        timestamp_us: ts,
                        sm_util: (v >> 56) as u32,
                    });
                } else if k > 0 {
                    break;
                }
            }
        }
        out.sort_by_key(|s| s.timestamp_us);
        out
    }

    /// Claims a slot for the calling process on `gpu`.
    pub fn register(&self, gpu: u32, mem_bytes: u64) -> Result<SlotHandle<'_>> {
        if gpu >= self.n_gpus() {
            bail!(
                "GPU {gpu} does not exist: the simulated node has {} GPU(s)",
                self.n_gpus()
            );
        }
        let pid = std::process::id();
        for (i, s) in self.slots().iter().enumerate() {
            if s.state
                .compare_exchange(SLOT_FREE, SLOT_CLAIMING, AcqRel, Relaxed)
                .is_ok()
            {
                s.pid.store(pid, Relaxed);
                s.gpu.store(gpu, Relaxed);
                s.start_time
                    .store(proc_start_time(pid).unwrap_or(0), Relaxed);
                s.mem_bytes.store(mem_bytes, Relaxed);
                s.submitted_ns.store(0, Relaxed);
                s.completed_ns.store(0, Relaxed);
                s.wake_at.store(0, Relaxed);
                s.pending_since_ns.store(0, Relaxed);
                s.admitted_ns.store(0, Relaxed);
                s.admit_at_ns.store(0, Relaxed);
                s.late_ns.store(0, Relaxed);
                s.active_ns_total.store(0, Relaxed);
                s.ring_count.store(0, Relaxed);
                for w in &s.ring {
                    w.store(0, Relaxed);
                }
                s.state.store(SLOT_LIVE, Release);
                self.header().slots_hwm.fetch_max(i as u64 + 1, AcqRel);
                return Ok(SlotHandle {
                    sim: self,
                    index: i,
                });
            }
        }
        bail!("all {MAX_SLOTS} simulated GPU process slots are in use")
    }

    /// Every live slot with its counters (tests read other processes' progress here).
    pub fn slot_infos(&self) -> Vec<SlotInfo> {
        let hwm = (self.header().slots_hwm.load(Acquire) as usize).min(MAX_SLOTS);
        self.slots()[..hwm]
            .iter()
            .filter(|s| s.state.load(Acquire) == SLOT_LIVE)
            .map(|s| SlotInfo {
                pid: s.pid.load(Relaxed),
                gpu: s.gpu.load(Relaxed),
                mem_bytes: s.mem_bytes.load(Relaxed),
                submitted_ns: s.submitted_ns.load(Acquire),
                completed_ns: s.completed_ns.load(Acquire),
            })
            .collect()
    }

    /// The live slot of `pid` on `gpu`, if any.
    pub fn slot_info(&self, pid: u32, gpu: u32) -> Option<SlotInfo> {
        self.slot_infos()
            .into_iter()
            .find(|s| s.pid == pid && s.gpu == gpu)
    }

    /// Releases every slot of `pid` (used when a workload exits).
    pub fn unregister_pid(&self, pid: u32) {
        for s in self.slots() {
            let st = s.state.load(Acquire);
            if (st == SLOT_LIVE || st == SLOT_PARKED) && s.pid.load(Relaxed) == pid {
                s.state.store(SLOT_FREE, Release);
            }
        }
    }
}

/// A snapshot of one live slot's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotInfo {
    /// Owner.
    pub pid: u32,
    /// Simulated GPU.
    pub gpu: u32,
    /// Memory it holds.
    pub mem_bytes: u64,
    /// Work submitted, ns.
    pub submitted_ns: u64,
    /// Work completed, ns.
    pub completed_ns: u64,
}

/// A workload's claim on a slot; released on drop.
#[derive(Debug)]
pub struct SlotHandle<'a> {
    sim: &'a SimGpu,
    index: usize,
}

impl SlotHandle<'_> {
    fn slot(&self) -> &Slot {
        &self.sim.slots()[self.index]
    }

    /// Queues `ns` of exclusive GPU time now; returns the completion target.
    pub fn submit(&self, ns: u64) -> u64 {
        self.submit_at(ns, now_ns())
    }

    /// Queues `ns` of exclusive GPU time submitted at `now` (the model's clock: tests that
    /// drive the daemon by hand pass their own). The work cannot start before `now`: a
    /// slot that ran dry stays idle until its next submission, however late the daemon
    /// learns of it.
    pub fn submit_at(&self, ns: u64, now: u64) -> u64 {
        let s = self.slot();
        let empty = s.completed_ns.load(Acquire) >= s.submitted_ns.load(Acquire);
        let first = s
            .pending_since_ns
            .compare_exchange(0, now.max(1), AcqRel, Acquire)
            .is_ok();
        let target = s.submitted_ns.fetch_add(ns, AcqRel) + ns;
        if empty && first {
            let h = self.sim.header();
            h.daemon_wake.fetch_add(1, AcqRel);
            futex_wake(&h.daemon_wake);
        }
        target
    }

    /// The simulated GPU of this slot.
    pub fn gpu(&self) -> u32 {
        self.slot().gpu.load(Relaxed)
    }

    /// Sets the GPU memory the process holds (as NVML lists it).
    pub fn set_mem_bytes(&self, bytes: u64) {
        self.slot().mem_bytes.store(bytes, Relaxed);
    }

    /// The memory the slot holds.
    pub fn mem_bytes(&self) -> u64 {
        self.slot().mem_bytes.load(Relaxed)
    }

    /// Checkpointed (`true`): the slot leaves the driver's lists and the GPU's used
    /// memory, its memory kept aside; restored (`false`): back, with that memory. Its
    /// work must have drained (the driver's lock saw to it).
    pub fn park(&self, parked: bool) {
        let s = self.slot();
        let (from, to) = if parked {
            (SLOT_LIVE, SLOT_PARKED)
        } else {
            (SLOT_PARKED, SLOT_LIVE)
        };
        let _ = s.state.compare_exchange(from, to, AcqRel, Acquire);
    }

    /// Whether the slot is parked (its process checkpointed).
    pub fn parked(&self) -> bool {
        self.slot().state.load(Acquire) == SLOT_PARKED
    }

    /// Work submitted so far.
    pub fn submitted(&self) -> u64 {
        self.slot().submitted_ns.load(Acquire)
    }

    /// Work completed so far.
    pub fn completed(&self) -> u64 {
        self.slot().completed_ns.load(Acquire)
    }

    /// Work queued and not yet completed.
    pub fn outstanding(&self) -> u64 {
        let s = self.slot();
        s.submitted_ns
            .load(Acquire)
            .saturating_sub(s.completed_ns.load(Acquire))
    }

    /// Blocks until `completed() >= target` (futex wait, woken by the daemon). A target
    /// beyond what was submitted is clamped to it: work never submitted never completes.
    pub fn wait_completed(&self, target: u64) {
        let s = self.slot();
        let target = target.min(s.submitted_ns.load(Acquire));
        loop {
            let seq = s.wake_seq.load(Acquire);
            if s.completed_ns.load(Acquire) >= target {
                return;
            }
            // Several threads may wait on one slot (the application and the shim's
            // watcher): the word holds the smallest target, the daemon wakes them all,
            // and each one short of its own target registers it again.
            let _ = s.wake_at.fetch_update(AcqRel, Acquire, |cur| match cur {
                0 => Some(target),
                c => Some(c.min(target)),
            });
            if s.completed_ns.load(Acquire) >= target {
                return;
            }
            futex_wait(&s.wake_seq, seq, 2_000_000);
        }
    }
}

impl Drop for SlotHandle<'_> {
    fn drop(&mut self) {
        self.slot().state.store(SLOT_FREE, Release);
    }
}

use coloc_doorbell::{futex_wait, futex_wake};

/// The GPU daemon's model: the only writer of completion, activity and samples.
#[derive(Debug)]
pub struct Daemon<'a> {
    sim: &'a SimGpu,
    last_ns: u64,
    next_boundary: u64,
    period_active: Vec<u64>,
    last_reap: u64,
    /// The time `advance` was called for: when the waiters it wakes are woken.
    now: u64,
    /// Per GPU: since when no slot has had work (0: busy).
    idle_since: Vec<u64>,
    /// Per GPU, under time slices: the slot that has the GPU.
    running: Vec<Option<usize>>,
    /// Per GPU: the slot that ran last (whose turn the next follows).
    last_run: Vec<usize>,
    /// Per GPU: when the running slot's slice ends (0: no other slot waits).
    slice_end: Vec<u64>,
}

impl<'a> Daemon<'a> {
    /// Starts the model at `now`.
    pub fn new(sim: &'a SimGpu, now: u64) -> Daemon<'a> {
        sim.header().daemon_pid.store(std::process::id(), Relaxed);
        let p = sim.sample_period_ns();
        Daemon {
            sim,
            last_ns: now,
            next_boundary: (now / p + 1) * p,
            period_active: vec![0; MAX_SLOTS],
            last_reap: now,
            now,
            idle_since: vec![0; MAX_GPUS as usize],
            running: vec![None; MAX_GPUS as usize],
            last_run: vec![usize::MAX; MAX_GPUS as usize],
            slice_end: vec![0; MAX_GPUS as usize],
        }
    }

    /// Advances the model to `now`: shares each GPU among slots with outstanding work,
    /// records samples at period boundaries, wakes waiters, and reaps dead processes.
    pub fn advance(&mut self, now: u64) {
        let period = self.sim.sample_period_ns();
        self.now = now;
        for (_, s) in self.live(None) {
            self.take_submissions(s, self.last_ns);
        }
        while self.next_boundary <= now {
            let b = self.next_boundary;
            self.run_until(b);
            self.emit_samples(b, period);
            self.next_boundary = b + period;
        }
        self.run_until(now);
        self.sim.header().heartbeat_ns.store(now, Release);
        if now.saturating_sub(self.last_reap) > 20_000_000 {
            self.last_reap = now;
            self.reap();
        }
    }

    /// When the model next has something to do on its own, if nothing is submitted
    /// meanwhile: the earliest time at which a waiter's target is reached, or a slot runs
    /// out of work (the others' shares then grow); None when no GPU has work. A daemon
    /// that sleeps until then (or its tick, whichever is first) completes work when it
    /// is done, as a GPU's completion interrupt does, instead of at the next tick.
    pub fn next_event_ns(&self) -> Option<u64> {
        let slots = self.sim.slots();
        let slice = self.sim.header().timeslice_ns.load(Acquire);
        let mut best: Option<u64> = None;
        for gpu in 0..self.sim.n_gpus() {
            let active = self.active(gpu);
            if slice != 0 && !active.is_empty() {
                // Time slices: the runner's completion owed or its slice's end.
                let g = gpu as usize;
                let t = match self.running[g].and_then(|r| active.iter().find(|a| a.0 == r)) {
                    None => self.last_ns,
                    Some(&(i, rem)) => {
                        let s = &slots[i];
                        let (w, done) = (s.wake_at.load(Acquire), s.completed_ns.load(Acquire));
                        let need = if w > done { rem.min(w - done) } else { rem };
                        let mut t = self.last_ns.saturating_add(need);
                        if self.slice_end[g] != 0 {
                            t = t.min(self.slice_end[g]);
                        } else if active.len() > 1 {
                            t = t.min(self.last_ns.saturating_add(slice));
                        }
                        t
                    }
                };
                best = Some(best.map_or(t, |b| b.min(t)));
                continue;
            }
            let n = active.len() as u64;
            for (i, rem) in active {
                let s = &slots[i];
                let (w, done) = (s.wake_at.load(Acquire), s.completed_ns.load(Acquire));
                let need = if w > done { rem.min(w - done) } else { rem };
                let t = self.last_ns.saturating_add(need.saturating_mul(n));
                best = Some(best.map_or(t, |b| b.min(t)));
            }
        }
        best
    }

    /// The live slots of `gpu` with admitted work outstanding: (slot index, ns of work
    /// left).
    fn active(&self, gpu: u32) -> Vec<(usize, u64)> {
        self.live(Some(gpu))
            .filter_map(|(i, s)| {
                let rem = s
                    .admitted_ns
                    .load(Acquire)
                    .saturating_sub(s.completed_ns.load(Acquire));
                (rem > 0).then_some((i, rem))
            })
            .collect()
    }

    /// The live slots of `gpu` (`None`: of every GPU), up to the high-water mark.
    fn live(&self, gpu: Option<u32>) -> impl Iterator<Item = (usize, &Slot)> {
        let hwm = (self.sim.header().slots_hwm.load(Acquire) as usize).min(MAX_SLOTS);
        self.sim.slots()[..hwm]
            .iter()
            .enumerate()
            .filter(move |(_, s)| {
                s.state.load(Acquire) == SLOT_LIVE && gpu.is_none_or(|g| s.gpu.load(Relaxed) == g)
            })
    }

    /// Work submitted since the last look, and when it may start: the time of its first
    /// submission, or `from` when that is unknown (a submission made while the daemon
    /// read the slot, so at about `from`). The daemon's own lateness in waking the
    /// slot's waiters is taken off: a waiter that submits again when it wakes is charged
    /// its own wake-up, not the daemon's (a GPU signals a completion when it happens).
    fn take_submissions(&self, s: &Slot, from: u64) {
        let submitted = s.submitted_ns.load(Acquire);
        let late = s.late_ns.swap(0, AcqRel);
        let since = match s.pending_since_ns.swap(0, AcqRel) {
            0 => 0,
            v => v.saturating_sub(late).max(1),
        };
        if submitted <= s.admitted_ns.load(Acquire) {
            return;
        }
        let at = s.admit_at_ns.load(Acquire);
        if at == 0 || (since != 0 && since < at) {
            s.admit_at_ns
                .store(if since == 0 { from } else { since }, Release);
        }
    }

    fn run_until(&mut self, t: u64) {
        let from = self.last_ns;
        let t = t.max(from);
        self.last_ns = t;
        let slots = self.sim.slots();
        let slice = self.sim.header().timeslice_ns.load(Acquire);
        for gpu in 0..self.sim.n_gpus() {
            // New work joins when it was submitted: (slot, when). A slot whose queue ran
            // dry idles until then, as a GPU does between a completion and the host's
            // next launch.
            // Work that may start before `from` (a waiter the daemon woke late, see
            // take_submissions) starts then only if the GPU was idle since: the time was
            // free, and no other slot was given it.
            let mut active = self.active(gpu);
            let g = gpu as usize;
            if !active.is_empty() {
                self.idle_since[g] = 0;
            } else if self.idle_since[g] == 0 {
                self.idle_since[g] = from;
            }
            let idle_since = self.idle_since[g];
            let mut joins: Vec<(usize, u64)> = Vec::new();
            for (i, s) in self.live(Some(gpu)) {
                if s.submitted_ns.load(Acquire) > s.admitted_ns.load(Acquire) {
                    let at = s.admit_at_ns.load(Acquire);
                    let at = if idle_since != 0 && at >= idle_since {
                        at
                    } else {
                        at.max(from)
                    };
                    if at <= t {
                        joins.push((i, at));
                    }
                }
            }
            joins.sort_by_key(|j| j.1);
            // Time slices (the default): one slot runs at a time, see run_slices.
            // Processor sharing: every slot with outstanding work advances at 1/n.
            let mut due: Vec<(usize, u64)> = Vec::new();
            let mut cursor = joins.first().map_or(from, |j| j.1.min(from));
            let mut next = 0;
            loop {
                while next < joins.len() && joins[next].1 <= cursor {
                    let i = joins[next].0;
                    let s = &slots[i];
                    let add = s.submitted_ns.load(Acquire) - s.admitted_ns.load(Acquire);
                    s.admitted_ns.fetch_add(add, AcqRel);
                    s.admit_at_ns.store(0, Release);
                    match active.iter_mut().find(|a| a.0 == i) {
                        Some(a) => a.1 += add,
                        None => active.push((i, add)),
                    }
                    next += 1;
                }
                let horizon = joins.get(next).map_or(t, |j| j.1);
                let mut left = horizon - cursor;
                let mut clock = cursor;
                if slice != 0 {
                    self.run_slices(g, &mut active, &mut due, &mut clock, left, slice);
                    left = 0;
                }
                while left > 0 && !active.is_empty() {
                    let n = active.len() as u64;
                    let min_rem = active.iter().map(|a| a.1).min().unwrap_or(0);
                    let (work, wall) = if min_rem.saturating_mul(n) <= left {
                        (min_rem, min_rem * n)
                    } else {
                        (left / n, left)
                    };
                    for (i, rem) in active.iter_mut() {
                        *rem -= work.min(*rem);
                        let s = &slots[*i];
                        // When a waiter's target is reached: how late its wake-up is.
                        let (w, x) = (s.wake_at.load(Acquire), s.completed_ns.load(Acquire));
                        if w > x && w <= x + work && !due.iter().any(|d| d.0 == *i) {
                            due.push((*i, clock + (w - x) * n));
                        }
                        s.completed_ns.fetch_add(work, AcqRel);
                        s.active_ns_total.fetch_add(wall, Relaxed);
                        self.period_active[*i] += wall;
                    }
                    left -= wall;
                    clock += wall;
                    if work == 0 {
                        break;
                    }
                    active.retain(|a| a.1 > 0);
                }
                cursor = horizon;
                if active.is_empty() && self.idle_since[g] == 0 {
                    self.idle_since[g] = clock;
                } else if !active.is_empty() {
                    self.idle_since[g] = 0;
                }
                if next == joins.len() {
                    break;
                }
            }
            for (i, s) in slots
                .iter()
                .enumerate()
                .filter(|s| s.1.gpu.load(Relaxed) == gpu)
            {
                let w = s.wake_at.load(Acquire);
                if w != 0 && s.completed_ns.load(Acquire) >= w {
                    let at = due.iter().find(|d| d.0 == i).map_or(t, |d| d.1);
                    s.late_ns.store(self.now.max(t).saturating_sub(at), Release);
                    s.wake_at.store(0, Release);
                    s.wake_seq.fetch_add(1, AcqRel);
                    futex_wake(&s.wake_seq);
                }
            }
        }
    }

    /// Time slices: the GPU runs one context at a time, at full speed. A context keeps it
    /// until its queue runs dry or, once another context has work, for one `slice` from
    /// then (work in flight is not cut short before); then the next context with work
    /// (round robin by slot) gets a slice. Runs `left` ns from `clock`, noting in `due`
    /// when waiters' targets are reached.
    fn run_slices(
        &mut self,
        g: usize,
        active: &mut Vec<(usize, u64)>,
        due: &mut Vec<(usize, u64)>,
        clock: &mut u64,
        mut left: u64,
        slice: u64,
    ) {
        let slots = self.sim.slots();
        while left > 0 && !active.is_empty() {
            let cur = match self.running[g].filter(|r| active.iter().any(|a| a.0 == *r)) {
                Some(r) => r,
                None => {
                    let r = Self::next_in_turn(active, self.last_run[g]);
                    self.running[g] = Some(r);
                    self.slice_end[g] = 0;
                    r
                }
            };
            if active.len() > 1 && self.slice_end[g] == 0 {
                self.slice_end[g] = *clock + slice;
            }
            let k = active.iter().position(|a| a.0 == cur).unwrap_or(0);
            let mut wall = left.min(active[k].1);
            if self.slice_end[g] != 0 {
                wall = wall.min(self.slice_end[g].saturating_sub(*clock));
            }
            if wall > 0 {
                let s = &slots[cur];
                let (w, x) = (s.wake_at.load(Acquire), s.completed_ns.load(Acquire));
                if w > x && w <= x + wall && !due.iter().any(|d| d.0 == cur) {
                    due.push((cur, *clock + (w - x)));
                }
                s.completed_ns.fetch_add(wall, AcqRel);
                s.active_ns_total.fetch_add(wall, Relaxed);
                self.period_active[cur] += wall;
                active[k].1 -= wall;
                left -= wall;
                *clock += wall;
            }
            if active[k].1 == 0 {
                active.remove(k);
                self.last_run[g] = cur;
                self.running[g] = None;
                self.slice_end[g] = 0;
            } else if self.slice_end[g] != 0 && *clock >= self.slice_end[g] {
                let next = Self::next_in_turn(active, cur);
                self.last_run[g] = cur;
                self.running[g] = Some(next);
                self.slice_end[g] = if active.len() > 1 { *clock + slice } else { 0 };
            }
        }
    }

    /// The slot whose turn follows `after`'s: the next higher index with work, wrapping.
    fn next_in_turn(active: &[(usize, u64)], after: usize) -> usize {
        let mut idx: Vec<usize> = active.iter().map(|a| a.0).collect();
        idx.sort_unstable();
        idx.iter().copied().find(|&i| i > after).unwrap_or(idx[0])
    }

    fn emit_samples(&mut self, boundary: u64, period: u64) {
        for (i, s) in self.sim.slots().iter().enumerate() {
            let active = std::mem::take(&mut self.period_active[i]);
            if active == 0 || s.state.load(Acquire) != SLOT_LIVE {
                continue;
            }
            // A whole percent of the period, rounded down, as the NVIDIA driver reports it:
            // on an H100 (driver 580) a process whose kernels ran under 1 % of a 200 ms
            // period reads 0 % (`benches/gpu/results/`, step nvml-view), and NVML's callers
            // (the agent among them) take a 0 % sample for idle.
            let util = (active * 100 / period).min(100);
            let n = s.ring_count.fetch_add(1, AcqRel) as usize;
            s.ring[n % RING].store((boundary / 1000) | (util << 56), Release);
        }
    }

    fn reap(&self) {
        if self.sim.header().reap_dead.load(Relaxed) == 0 {
            return;
        }
        for s in self.sim.slots() {
            let st = s.state.load(Acquire);
            if st != SLOT_LIVE && st != SLOT_PARKED {
                continue;
            }
            let pid = s.pid.load(Relaxed);
            let alive = proc_start_time(pid).is_some_and(|st| st == s.start_time.load(Relaxed));
            if !alive {
                s.state.store(SLOT_FREE, Release);
            }
        }
    }
}

/// The UUID of simulated GPU `gpu`, as 16 bytes (`CUuuid`, what `cuDeviceGetUuid`
/// answers): `c0 10 c5 17` ("coloc"), zeros, and the GPU index big-endian in the last two
/// bytes. [`uuid_string`] turns it into NVML's form, what `nvmlDeviceGetUUID` answers.
pub fn gpu_uuid(gpu: u32) -> [u8; 16] {
    let mut u = [0u8; 16];
    u[..4].copy_from_slice(&[0xc0, 0x10, 0xc5, 0x17]);
    u[14..].copy_from_slice(&(gpu as u16).to_be_bytes());
    u
}

/// NVML's text form of a UUID: `GPU-` and 8-4-4-4-12 lowercase hex digits
/// (`GPU-c010c517-0000-0000-0000-000000000001` for GPU 1).
pub fn uuid_string(u: &[u8; 16]) -> String {
    let h = |r: std::ops::Range<usize>| u[r].iter().map(|b| format!("{b:02x}")).collect::<String>();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        h(0..4),
        h(4..6),
        h(6..8),
        h(8..10),
        h(10..16)
    )
}

/// File name of the fake CUDA driver as built by cargo (`tests/fake-cuda`).
pub const FAKE_CUDA_LIB: &str = "libfake_cuda.so";

/// A directory holding `libcuda.so.1` (a symlink to the fake CUDA driver built in
/// `target_profile_dir`, e.g. `target/debug`), to put on `LD_LIBRARY_PATH`: programs that
/// `dlopen("libcuda.so.1")`, as the CUDA runtime does, then get the fake. Creates
/// `<dir>/fake-cuda/libcuda.so.1`; idempotent, and safe when several tests call it at
/// once (the link is made under a unique name and renamed into place). Fails when
/// the library is not built (`cargo build -p fake-cuda`). The library is taken from
/// `target_profile_dir` or, when only there or newer there, its `deps/` (where cargo
/// leaves it when built as a dependency of a test).
pub fn fake_libcuda_dir(target_profile_dir: &Path) -> Result<PathBuf> {
    let mtime = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let top = target_profile_dir.join(FAKE_CUDA_LIB);
    let deps = target_profile_dir.join("deps").join(FAKE_CUDA_LIB);
    let lib = match (mtime(&top), mtime(&deps)) {
        (Some(a), Some(b)) if b > a => deps,
        (Some(_), _) => top,
        (None, Some(_)) => deps,
        (None, None) => bail!(
            "{} missing: build the fake CUDA driver first (`cargo build -p fake-cuda`)",
            top.display()
        ),
    };
    let lib =
        std::fs::canonicalize(&lib).with_context(|| format!("resolving {}", lib.display()))?;
    let dir = target_profile_dir.join("fake-cuda");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let link = dir.join("libcuda.so.1");
    if std::fs::read_link(&link).is_ok_and(|t| t == lib) {
        return Ok(dir);
    }
    static SEQ: AtomicU32 = AtomicU32::new(0);
    let tmp = dir.join(format!(
        ".libcuda.so.1.{}.{}",
        std::process::id(),
        SEQ.fetch_add(1, Relaxed)
    ));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(&lib, &tmp).with_context(|| format!("linking {}", tmp.display()))?;
    std::fs::rename(&tmp, &link).with_context(|| format!("placing {}", link.display()))?;
    Ok(dir)
}

/// Percentile of a sorted slice: the project's one nearest-rank percentile
/// (`qos_core::stats`); 0 for an empty slice.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    qos_core::stats::percentile(sorted, q).unwrap_or(0.0)
}

/// A command that moves itself into cgroup directory `cg` (v2 `cgroup.procs` or v1
/// `tasks`) and then executes `program`, so the program runs in the cgroup from its first
/// instruction. Used by the demo, the benchmarks and the end-to-end tests.
pub fn command_in_cgroup(cg: &std::path::Path, program: &std::path::Path) -> std::process::Command {
    let file = if cg.join("cgroup.procs").exists() {
        "cgroup.procs"
    } else {
        "tasks"
    };
    let mut c = std::process::Command::new("sh");
    c.arg("-c")
        .arg(format!(
            "echo $$ > '{}/{}' && exec \"$0\" \"$@\"",
            cg.display(),
            file
        ))
        .arg(program);
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch file's path, removed when dropped (passing or failing).
    fn tmp(name: &str) -> tempfile::TempPath {
        tempfile::Builder::new()
            .prefix(&format!("coloc-sim-test-{name}-"))
            .tempfile()
            .unwrap()
            .into_temp_path()
    }

    #[test]
    fn processor_sharing_and_samples() {
        let path = tmp("ps");
        let sim = SimGpu::create(&path, 1, 1_000_000).unwrap();
        let a = sim.register(0, 0).unwrap();
        let t0 = 1_000_000_000_000u64; // a period boundary
        sim.set_timeslice(None); // processor sharing
        let mut d = Daemon::new(&sim, t0);
        a.submit_at(4_000_000, t0);
        d.advance(t0 + 2_000_000);
        assert_eq!(a.completed(), 2_000_000, "alone: full speed");
        // A second slot (pretend another process) shares the GPU.
        let b = sim.register(0, 0).unwrap();
        b.submit_at(1_000_000, t0 + 2_000_000);
        d.advance(t0 + 4_000_000);
        assert_eq!(b.completed(), 1_000_000, "half speed for 2 ms");
        assert_eq!(a.completed(), 3_000_000);
        d.advance(t0 + 5_000_000);
        assert_eq!(a.completed(), 4_000_000);
        d.advance(t0 + 8_000_000);
        let samples = sim.samples(0, 0);
        // a active in periods ending at t0+1..t0+5 ms, b in t0+3 and t0+4 ms.
        assert_eq!(samples.len(), 7, "{samples:?}");
        assert!(samples.iter().all(|s| s.sm_util == 100));
        assert_eq!(sim.samples(0, (t0 + 4_000_000) / 1000).len(), 1);
        drop((a, b));
        assert!(sim.processes(0).is_empty());
    }

    /// Light work reads 0 %: the driver's per-process figure is whole percent of the period,
    /// rounded down, so a process busy for under 1 % of a period gets a sample of 0 %.
    #[test]
    fn light_work_reads_zero_percent() {
        let path = tmp("floor");
        let sim = SimGpu::create(&path, 1, 200_000_000).unwrap();
        let a = sim.register(0, 0).unwrap();
        let t0 = 1_000_000_000_000u64; // a period boundary
        let mut d = Daemon::new(&sim, t0);
        a.submit_at(1_000_000, t0); // 1 ms of the first 200: 0.5 %
        d.advance(t0 + 100_000_000);
        a.submit_at(30_000_000, t0 + 250_000_000); // 30 ms of the second: 15 %
        d.advance(t0 + 300_000_000);
        d.advance(t0 + 450_000_000);
        let util: Vec<u32> = sim.samples(0, 0).iter().map(|s| s.sm_util).collect();
        assert_eq!(util, [0, 15]);
        drop(a);
    }

    /// Work starts when it was submitted, however late the daemon wakes: a slot that ran
    /// dry idles until its next submission (the host's gap between a completion and the
    /// next launch costs GPU time), and a submission to an idle slot wakes the daemon.
    #[test]
    fn work_starts_when_it_is_submitted() {
        let path = tmp("admit");
        let sim = SimGpu::create(&path, 1, 1_000_000).unwrap();
        let (a, b) = (sim.register(0, 0).unwrap(), sim.register(0, 0).unwrap());
        let t0 = 1_000_000_000_000u64;
        sim.set_timeslice(None); // processor sharing
        let mut d = Daemon::new(&sim, t0);
        let w0 = sim.daemon_wake().load(SeqCst);
        a.submit_at(1_000_000, t0);
        assert_eq!(sim.daemon_wake().load(SeqCst), w0 + 1, "idle slot: wakes");
        d.advance(t0 + 1_000_000);
        assert_eq!(a.completed(), 1_000_000);
        // Resubmitted 0.5 ms after it ran dry; the daemon learns of it 1 ms after that.
        a.submit_at(1_000_000, t0 + 1_500_000);
        a.submit_at(1_000_000, t0 + 1_600_000);
        assert_eq!(sim.daemon_wake().load(SeqCst), w0 + 2, "busy slot: no wake");
        d.advance(t0 + 2_500_000);
        assert_eq!(
            a.completed(),
            2_000_000,
            "1 ms since it was submitted, not 1.5"
        );
        // a's second kernel (submitted at 1.6 ms, seen with the first, runs after it):
        // alone until b joins at 3 ms (0.5 ms), half speed after (0.5 ms in 1 ms).
        b.submit_at(1_000_000, t0 + 3_000_000);
        d.advance(t0 + 4_000_000);
        assert_eq!(a.completed(), 3_000_000);
        assert_eq!(b.completed(), 500_000);
        drop((a, b));
    }

    /// A waiter woken late by the daemon is charged its own wake-up, not the daemon's:
    /// its next submission counts from when it would have woken had the daemon been on
    /// time.
    #[test]
    fn the_daemons_lateness_is_not_charged_to_the_waiter() {
        let path = tmp("late");
        let sim = SimGpu::create(&path, 1, 1_000_000).unwrap();
        let a = sim.register(0, 0).unwrap();
        let t0 = 1_000_000_000_000u64;
        let mut d = Daemon::new(&sim, t0);
        a.submit_at(1_000_000, t0);
        a.slot().wake_at.store(1_000_000, Release);
        // Due at 1 ms; the daemon wakes at 1.3 ms; the waiter submits 50 µs later.
        d.advance(t0 + 1_300_000);
        assert_eq!(a.slot().late_ns.load(SeqCst), 300_000);
        a.submit_at(1_000_000, t0 + 1_350_000);
        d.advance(t0 + 1_400_000);
        // It started at 1.05 ms: 0.35 ms done by 1.4 ms.
        assert_eq!(a.completed(), 1_350_000);
        // The lateness is used once: a later submission counts from when it was made.
        d.advance(t0 + 2_050_000);
        assert_eq!(a.completed(), 2_000_000);
        a.submit_at(1_000_000, t0 + 2_100_000);
        d.advance(t0 + 2_200_000);
        assert_eq!(a.completed(), 2_100_000);
        drop(a);
    }

    /// The daemon sleeps until a waiter's target is due under the current sharing, or
    /// a slot runs dry; with no work, until its tick (None).
    #[test]
    fn the_next_event_is_the_earliest_completion_owed() {
        let path = tmp("next");
        let sim = SimGpu::create(&path, 1, 1_000_000).unwrap();
        let t0 = 1_000_000_000_000u64;
        sim.set_timeslice(None); // processor sharing
        let mut d = Daemon::new(&sim, t0);
        assert_eq!(d.next_event_ns(), None, "no work");
        let (a, b) = (sim.register(0, 0).unwrap(), sim.register(0, 0).unwrap());
        a.submit_at(4_000_000, t0);
        b.submit_at(3_000_000, t0);
        d.advance(t0);
        // Two slots at half speed: b runs dry after 6 ms.
        assert_eq!(d.next_event_ns(), Some(t0 + 6_000_000));
        // A waiter on a (1 ms of its work) is owed sooner: 2 ms at half speed.
        a.slot().wake_at.store(1_000_000, Release);
        assert_eq!(d.next_event_ns(), Some(t0 + 2_000_000));
        drop((a, b));
    }

    const SLICE: u64 = 2_400_000;

    /// Under time slices (the default), a tiny kernel submitted beside a context that
    /// keeps the GPU busy waits for that context's slice, then runs at full speed.
    #[test]
    fn a_tiny_kernel_beside_a_busy_context_waits_a_slice() {
        let path = tmp("ts-wait");
        let sim = SimGpu::create(&path, 1, 1_000_000).unwrap();
        assert_eq!(sim.timeslice().map(|d| d.as_nanos() as u64), Some(SLICE));
        let (a, b) = (sim.register(0, 0).unwrap(), sim.register(0, 0).unwrap());
        let t0 = 1_000_000_000_000u64;
        let mut d = Daemon::new(&sim, t0);
        a.submit_at(100_000_000, t0); // a training loop's queue
        d.advance(t0 + 5_000_000);
        b.submit_at(14_000, t0 + 5_000_000); // a 14 µs online kernel
        b.slot().wake_at.store(14_000, Release);
        d.advance(t0 + 5_000_000);
        // The daemon is due back when a's slice ends.
        assert_eq!(d.next_event_ns(), Some(t0 + 5_000_000 + SLICE));
        d.advance(t0 + 5_000_000 + SLICE - 1_000);
        assert_eq!(b.completed(), 0, "b waits for a's slice");
        assert_eq!(a.completed(), 5_000_000 + SLICE - 1_000, "a at full speed");
        d.advance(t0 + 5_000_000 + SLICE);
        assert_eq!(d.next_event_ns(), Some(t0 + 5_000_000 + SLICE + 14_000));
        d.advance(t0 + 5_000_000 + SLICE + 14_000);
        assert_eq!(b.completed(), 14_000, "then b runs alone");
        assert_eq!(b.slot().wake_at.load(SeqCst), 0, "b's waiter woken");
        // a has the GPU back at once (b ran dry).
        d.advance(t0 + 5_000_000 + SLICE + 1_014_000);
        assert_eq!(a.completed(), 6_000_000 + SLICE);
        drop((a, b));
    }

    /// Two busy contexts take turns: over many slices each gets about half the GPU, and
    /// the NVML samples read the time each ran.
    #[test]
    fn two_busy_contexts_share_evenly_over_time() {
        let path = tmp("ts-even");
        let sim = SimGpu::create(&path, 1, 10_000_000).unwrap();
        let (a, b) = (sim.register(0, 0).unwrap(), sim.register(0, 0).unwrap());
        let t0 = 1_000_000_000_000u64;
        let mut d = Daemon::new(&sim, t0);
        a.submit_at(200_000_000, t0);
        b.submit_at(200_000_000, t0 + 1_000_000);
        for ms in 1..=101u64 {
            d.advance(t0 + ms * 1_000_000);
        }
        let (x, y) = (a.completed() as i64, b.completed() as i64);
        assert_eq!(x + y, 101_000_000, "the GPU never idles");
        assert!((x - y).abs() <= SLICE as i64 + 1_000_000, "a {x} b {y}");
        // Neither ran throughout: each slot's samples are near half of each period.
        let utils: Vec<u32> = sim
            .samples(0, (t0 + 20_000_000) / 1000)
            .iter()
            .map(|s| s.sm_util)
            .collect();
        assert!(!utils.is_empty());
        assert!(utils.iter().all(|u| (30..=70).contains(u)), "{utils:?}");
        drop((a, b));
    }

    /// One context alone runs at full speed, whatever the slice.
    #[test]
    fn one_context_alone_runs_at_full_speed() {
        let path = tmp("ts-alone");
        let sim = SimGpu::create(&path, 1, 1_000_000).unwrap();
        let (a, _idle) = (sim.register(0, 0).unwrap(), sim.register(0, 0).unwrap());
        let t0 = 1_000_000_000_000u64;
        let mut d = Daemon::new(&sim, t0);
        a.submit_at(10_000_000, t0);
        assert_eq!(d.next_event_ns(), None, "nothing admitted yet");
        d.advance(t0 + 3_000_000);
        assert_eq!(d.next_event_ns(), Some(t0 + 10_000_000), "no slice to end");
        d.advance(t0 + 10_000_000);
        assert_eq!(a.completed(), 10_000_000);
        drop(a);
    }

    #[test]
    fn uuid_forms() {
        assert_eq!(
            uuid_string(&gpu_uuid(1)),
            "GPU-c010c517-0000-0000-0000-000000000001"
        );
        assert_eq!(
            uuid_string(&gpu_uuid(0x1234)),
            "GPU-c010c517-0000-0000-0000-000000001234"
        );
    }

    #[test]
    fn percentile_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&[], 99.0), 0.0);
    }
}
