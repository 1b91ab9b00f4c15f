//! The CUDA driver's checkpoint API, simulated: what the fake `libcuda.so.1` answers to
//! `cuCheckpointProcess{GetState,Lock,Checkpoint,Restore,Unlock,GetRestoreThreadId}`.
//!
//! It follows what an H100 with driver 580 was measured to do (benches/RESULTS.md, "Real
//! GPU: the driver's checkpoint API"):
//!
//! - Every call that changes a process's state is carried out by a thread inside that
//!   process (the fake driver starts one at `cuInit`: the *restore thread*). The caller
//!   posts a request in the process's [`ProcEntry`] and waits for that thread, with no
//!   timeout of its own: a process that is stopped or frozen stalls the caller until it
//!   runs again, and a lock's `timeoutMs` bounds only the wait for its submitted work.
//! - A lock blocks the process's further driver calls (every entry point of the fake
//!   driver that needs an initialised driver), then waits until the work it had
//!   submitted on every GPU has run; on timeout the process is left running
//!   (`CUDA_ERROR_TIMEOUT`).
//! - A checkpoint (locked processes only) takes [`Header`]'s cost per GB, then moves the
//!   process's device memory to the host: its slots leave the driver's process list, the
//!   GPU's used memory drops, and NVML shows no samples of it. A restore (checkpointed
//!   only) needs that much free memory on the GPU (`CUDA_ERROR_OUT_OF_MEMORY`
//!   otherwise), takes its own cost per GB and leaves the process locked. An unlock
//!   (locked only) lets it run. A call in the wrong state: `CUDA_ERROR_ILLEGAL_STATE`.
//! - State queries are answered from the shared table, so they work on a stopped process.
//!   A process that never initialised the driver: `CUDA_ERROR_NOT_INITIALIZED`; no such
//!   process: `CUDA_ERROR_OPERATING_SYSTEM`.
//! - Faults are injectable per operation (any code, and optionally leaving the process
//!   in the `failed` state), for every process or one PID: [`SimGpu::ckpt_inject`].
//!
//! Layout: one [`ProcEntry`] per process that initialised the fake driver, after the
//! slots in the state file. The request word and the acknowledgement are futex words.

use crate::{proc_start_time, SimGpu, MAX_SLOTS};
use coloc_doorbell::{futex_wait, futex_wake};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::*};
use std::time::{Duration, Instant};

/// Process entries in the table (one per process that initialised the fake driver).
pub const MAX_PROCS: usize = MAX_SLOTS;

const ENTRY_FREE: u32 = 0;
const ENTRY_CLAIMING: u32 = 1;
const ENTRY_LIVE: u32 = 2;

/// `CUprocessState`.
pub const STATE_RUNNING: u32 = 0;
/// `CU_PROCESS_STATE_LOCKED`.
pub const STATE_LOCKED: u32 = 1;
/// `CU_PROCESS_STATE_CHECKPOINTED`.
pub const STATE_CHECKPOINTED: u32 = 2;
/// `CU_PROCESS_STATE_FAILED`.
pub const STATE_FAILED: u32 = 3;

/// `CUDA_SUCCESS`.
pub const OK: i32 = 0;
/// `CUDA_ERROR_OUT_OF_MEMORY`.
pub const ERR_OUT_OF_MEMORY: i32 = 2;
/// `CUDA_ERROR_NOT_INITIALIZED`.
pub const ERR_NOT_INITIALIZED: i32 = 3;
/// `CUDA_ERROR_OPERATING_SYSTEM`.
pub const ERR_OPERATING_SYSTEM: i32 = 304;
/// `CUDA_ERROR_ILLEGAL_STATE`.
pub const ERR_ILLEGAL_STATE: i32 = 401;
/// `CUDA_ERROR_NOT_SUPPORTED`.
pub const ERR_NOT_SUPPORTED: i32 = 801;
/// `CUDA_ERROR_TIMEOUT`.
pub const ERR_TIMEOUT: i32 = 909;
/// `CUDA_ERROR_UNKNOWN`.
pub const ERR_UNKNOWN: i32 = 999;

/// A state-changing call, as carried out by the restore thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum CkOp {
    /// `cuCheckpointProcessLock`.
    Lock = 1,
    /// `cuCheckpointProcessCheckpoint`.
    Checkpoint = 2,
    /// `cuCheckpointProcessRestore`.
    Restore = 3,
    /// `cuCheckpointProcessUnlock`.
    Unlock = 4,
}

impl CkOp {
    /// Every operation.
    pub const ALL: [CkOp; 4] = [CkOp::Lock, CkOp::Checkpoint, CkOp::Restore, CkOp::Unlock];

    fn from_raw(v: u32) -> Option<CkOp> {
        CkOp::ALL.into_iter().find(|o| *o as u32 == v)
    }

    /// Short name (command lines).
    pub fn as_str(self) -> &'static str {
        match self {
            CkOp::Lock => "lock",
            CkOp::Checkpoint => "checkpoint",
            CkOp::Restore => "restore",
            CkOp::Unlock => "unlock",
        }
    }

    /// From [`CkOp::as_str`].
    pub fn parse(s: &str) -> Option<CkOp> {
        CkOp::ALL.into_iter().find(|o| o.as_str() == s)
    }
}

/// One process that initialised the fake driver.
#[repr(C)]
#[derive(Debug)]
pub struct ProcEntry {
    state: AtomicU32,
    pid: AtomicU32,
    start_time: AtomicU64,
    /// `CUprocessState` (written by the restore thread).
    cu_state: AtomicU32,
    /// Non-zero while the process's driver calls block (a futex word).
    gate: AtomicU32,
    /// A request: `seq << 4 | op`, 0 when none (a futex word; a caller sets it from 0,
    /// the restore thread clears it).
    req: AtomicU32,
    /// The `seq` of the last request done (a futex word).
    ack: AtomicU32,
    /// Its `CUresult`.
    result: AtomicU32,
    /// The lock's timeout, ms (0: none).
    timeout_ms: AtomicU32,
    /// The restore thread's TID.
    tid: AtomicU32,
    _pad: u32,
    /// Device memory kept on the host while checkpointed, per simulated GPU summed.
    host_bytes: AtomicU64,
}

const _: () = assert!(std::mem::size_of::<ProcEntry>() & 7 == 0);

impl ProcEntry {
    /// The PID.
    pub fn pid(&self) -> u32 {
        self.pid.load(Relaxed)
    }

    /// `CUprocessState`.
    pub fn cu_state(&self) -> u32 {
        self.cu_state.load(Acquire)
    }

    /// Sets `CUprocessState` (the restore thread).
    pub fn set_cu_state(&self, s: u32) {
        self.cu_state.store(s, Release);
    }

    /// The restore thread's TID (0 before it started).
    pub fn tid(&self) -> u32 {
        self.tid.load(Acquire)
    }

    /// Records the restore thread's TID.
    pub fn set_tid(&self, tid: u32) {
        self.tid.store(tid, Release);
    }

    /// Memory held on the host while checkpointed.
    pub fn host_bytes(&self) -> u64 {
        self.host_bytes.load(Acquire)
    }

    /// Sets it (the restore thread).
    pub fn set_host_bytes(&self, b: u64) {
        self.host_bytes.store(b, Release);
    }

    /// Blocks the process's driver calls (`on`) or lets them run and wakes the blocked.
    pub fn set_gate(&self, on: bool) {
        self.gate.store(u32::from(on), Release);
        if !on {
            futex_wake(&self.gate);
        }
    }

    /// Whether the driver calls are blocked.
    pub fn gated(&self) -> bool {
        self.gate.load(Acquire) != 0
    }

    /// Called at every driver entry point of the process: waits while it is locked.
    pub fn wait_gate(&self) {
        loop {
            let g = self.gate.load(Acquire);
            if g == 0 {
                return;
            }
            futex_wait(&self.gate, g, 100_000_000);
        }
    }

    fn alive(&self) -> bool {
        let pid = self.pid();
        proc_start_time(pid).is_some_and(|st| st == self.start_time.load(Relaxed))
    }

    /// The caller's side: posts `op` and waits until the process's restore thread has
    /// done it, with no timeout (a stopped process stalls the caller, as the real driver
    /// does), unless the process dies. The driver's answer.
    pub fn call(&self, op: CkOp, timeout_ms: u32) -> i32 {
        let seq = loop {
            let cur = self.req.load(Acquire);
            if cur == 0 {
                let seq = (self.ack.load(Acquire).wrapping_add(1) & 0x0fff_ffff).max(1);
                // Claimed first (operation 0: the restore thread leaves it alone), so the
                // arguments are in place before the request is posted.
                if self
                    .req
                    .compare_exchange(0, seq << 4, AcqRel, Acquire)
                    .is_ok()
                {
                    break seq;
                }
                continue;
            }
            // Another caller's request is in hand: wait for it to finish.
            if !self.alive() {
                return ERR_OPERATING_SYSTEM;
            }
            futex_wait(&self.req, cur, 50_000_000);
        };
        self.timeout_ms.store(timeout_ms, Release);
        self.req.store(seq << 4 | op as u32, Release);
        futex_wake(&self.req);
        loop {
            let a = self.ack.load(Acquire);
            if a == seq {
                return self.result.load(Acquire) as i32;
            }
            if !self.alive() {
                return ERR_OPERATING_SYSTEM;
            }
            futex_wait(&self.ack, a, 50_000_000);
        }
    }

    /// The restore thread's side: waits up to `wait` for a request; `Some((op, lock
    /// timeout))` when there is one (answer it with [`ProcEntry::done`]).
    pub fn next_request(&self, wait: Duration) -> Option<(CkOp, Duration)> {
        let r = self.req.load(Acquire);
        if r & 0xf == 0 {
            // Nothing, or a request still being posted.
            futex_wait(&self.req, r, wait.as_nanos() as u64);
        }
        let r = self.req.load(Acquire);
        if r & 0xf == 0 {
            return None;
        }
        match CkOp::from_raw(r & 0xf) {
            Some(op) => Some((
                op,
                Duration::from_millis(u64::from(self.timeout_ms.load(Acquire))),
            )),
            None => {
                self.done(ERR_UNKNOWN);
                None
            }
        }
    }

    /// Answers the request in hand.
    pub fn done(&self, result: i32) {
        let r = self.req.load(Acquire);
        self.result.store(result as u32, Release);
        self.ack.store(r >> 4, Release);
        futex_wake(&self.ack);
        self.req.store(0, Release);
        futex_wake(&self.req);
    }
}

/// An injected fault: operations (bit `1 << op`), the code, whether the process is left
/// `failed`, and for which PID (0: every process).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CkFault {
    /// The operations it hits.
    pub ops: u32,
    /// The `CUresult` they answer.
    pub code: i32,
    /// The process is left in `CU_PROCESS_STATE_FAILED`.
    pub fail_state: bool,
    /// Only this PID (0: all).
    pub pid: u32,
}

impl SimGpu {
    /// The process table.
    pub fn procs(&self) -> &[ProcEntry] {
        // SAFETY: the table follows the slots inside the map (layout_size counts it);
        // atomics only; the slots' size keeps 8-byte alignment.
        unsafe {
            let p = self.map.as_ptr().add(
                std::mem::size_of::<crate::Header>()
                    + MAX_SLOTS * std::mem::size_of::<crate::Slot>(),
            ) as *const ProcEntry;
            std::slice::from_raw_parts(p, MAX_PROCS)
        }
    }

    /// The live entry of `pid`, if that process initialised the fake driver.
    pub fn proc_entry(&self, pid: u32) -> Option<&ProcEntry> {
        self.procs()
            .iter()
            .find(|e| e.state.load(Acquire) == ENTRY_LIVE && e.pid() == pid && e.alive())
    }

    /// Claims an entry for the calling process (at `cuInit`).
    pub fn register_proc(&self) -> anyhow::Result<&ProcEntry> {
        let pid = std::process::id();
        let start = proc_start_time(pid).unwrap_or(0);
        for e in self.procs() {
            // A dead process's entry is free to take.
            let st = e.state.load(Acquire);
            let dead = st == ENTRY_LIVE && !e.alive();
            if (st == ENTRY_FREE || dead)
                && e.state
                    .compare_exchange(st, ENTRY_CLAIMING, AcqRel, Relaxed)
                    .is_ok()
            {
                e.pid.store(pid, Relaxed);
                e.start_time.store(start, Relaxed);
                e.cu_state.store(STATE_RUNNING, Relaxed);
                e.gate.store(0, Relaxed);
                e.req.store(0, Relaxed);
                e.ack.store(0, Relaxed);
                e.result.store(0, Relaxed);
                e.timeout_ms.store(0, Relaxed);
                e.tid.store(0, Relaxed);
                e.host_bytes.store(0, Relaxed);
                e.state.store(ENTRY_LIVE, Release);
                return Ok(e);
            }
        }
        anyhow::bail!("all {MAX_PROCS} simulated driver process entries are in use")
    }

    /// Frees the calling process's entry (at exit).
    pub fn unregister_proc(&self, pid: u32) {
        for e in self.procs() {
            if e.state.load(Acquire) == ENTRY_LIVE && e.pid() == pid {
                e.state.store(ENTRY_FREE, Release);
            }
        }
    }

    /// The caller's side of a state-changing call on `pid` (see [`ProcEntry::call`]).
    pub fn ckpt_call(&self, pid: u32, op: CkOp, timeout_ms: u32) -> i32 {
        match self.proc_entry(pid) {
            Some(e) => e.call(op, timeout_ms),
            None => no_entry(pid),
        }
    }

    /// `cuCheckpointProcessGetState` on `pid`.
    pub fn ckpt_state(&self, pid: u32) -> Result<u32, i32> {
        self.proc_entry(pid)
            .map(|e| e.cu_state())
            .ok_or(no_entry(pid))
    }

    /// `cuCheckpointProcessGetRestoreThreadId` on `pid`.
    pub fn ckpt_restore_tid(&self, pid: u32) -> Result<u32, i32> {
        self.proc_entry(pid).map(|e| e.tid()).ok_or(no_entry(pid))
    }

    /// Makes `fault.ops` answer `fault.code` (see [`CkFault`]); replaces the last one.
    pub fn ckpt_inject(&self, fault: CkFault) {
        let h = self.header();
        let w = u64::from(fault.ops & 0xff)
            | u64::from(fault.fail_state) << 8
            | u64::from(fault.code as u32) << 32;
        h.ckpt_fault_pid.store(u64::from(fault.pid), Release);
        h.ckpt_fault.store(w, Release);
    }

    /// Removes the injected fault.
    pub fn ckpt_clear_fault(&self) {
        self.header().ckpt_fault.store(0, Release);
    }

    /// The fault that hits `op` on `pid`, if one is injected.
    pub fn ckpt_fault(&self, op: CkOp, pid: u32) -> Option<CkFault> {
        let h = self.header();
        let w = h.ckpt_fault.load(Acquire);
        let fpid = h.ckpt_fault_pid.load(Acquire) as u32;
        let ops = (w & 0xff) as u32;
        (ops & (1 << op as u32) != 0 && (fpid == 0 || fpid == pid)).then_some(CkFault {
            ops,
            code: (w >> 32) as u32 as i32,
            fail_state: w & 0x100 != 0,
            pid: fpid,
        })
    }

    /// What a checkpoint (`restore == false`) or a restore of `bytes` costs.
    pub fn ckpt_cost(&self, bytes: u64, restore: bool) -> Duration {
        let h = self.header();
        let per_gb = if restore {
            h.restore_ns_per_gb.load(Relaxed)
        } else {
            h.ckpt_ns_per_gb.load(Relaxed)
        };
        Duration::from_nanos((bytes as u128 * per_gb as u128 / 1_000_000_000) as u64)
    }

    /// Sets the costs per GB of a checkpoint and of a restore.
    pub fn set_ckpt_cost(&self, ckpt_per_gb: Duration, restore_per_gb: Duration) {
        let h = self.header();
        h.ckpt_ns_per_gb
            .store(ckpt_per_gb.as_nanos() as u64, Relaxed);
        h.restore_ns_per_gb
            .store(restore_per_gb.as_nanos() as u64, Relaxed);
    }
}

fn no_entry(pid: u32) -> i32 {
    if proc_start_time(pid).is_some() {
        ERR_NOT_INITIALIZED
    } else {
        ERR_OPERATING_SYSTEM
    }
}

/// Waits until `done()` or the deadline; true if done.
pub fn wait_until(deadline: Option<Instant>, mut done: impl FnMut() -> bool) -> bool {
    loop {
        if done() {
            return true;
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return false;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A simulated GPU in a scratch file, removed when the guard drops (passing or
    /// failing).
    fn sim() -> (SimGpu, tempfile::TempPath) {
        let p = tempfile::Builder::new()
            .prefix("coloc-sim-ckpt-")
            .tempfile()
            .unwrap()
            .into_temp_path();
        (SimGpu::create(&p, 1, 100_000_000).unwrap(), p)
    }

    #[test]
    fn a_call_waits_for_the_restore_thread_and_gets_its_answer() {
        let (s, _path) = sim();
        let e = s.register_proc().unwrap();
        let pid = std::process::id();
        std::thread::scope(|sc| {
            sc.spawn(|| {
                let (op, t) = loop {
                    if let Some(r) = e.next_request(Duration::from_millis(100)) {
                        break r;
                    }
                };
                assert_eq!((op, t), (CkOp::Lock, Duration::from_millis(250)));
                std::thread::sleep(Duration::from_millis(50));
                e.set_cu_state(STATE_LOCKED);
                e.done(OK);
            });
            let t = Instant::now();
            assert_eq!(s.ckpt_call(pid, CkOp::Lock, 250), OK);
            assert!(t.elapsed() >= Duration::from_millis(50));
        });
        assert_eq!(s.ckpt_state(pid), Ok(STATE_LOCKED));
        s.unregister_proc(pid);
        assert_eq!(s.ckpt_state(pid), Err(ERR_NOT_INITIALIZED));
        assert_eq!(s.ckpt_state(u32::MAX - 1), Err(ERR_OPERATING_SYSTEM));
    }

    #[test]
    fn faults_hit_their_operations_and_pid_only() {
        let (s, _path) = sim();
        s.ckpt_inject(CkFault {
            ops: 1 << CkOp::Checkpoint as u32,
            code: ERR_NOT_SUPPORTED,
            fail_state: true,
            pid: 42,
        });
        let f = s.ckpt_fault(CkOp::Checkpoint, 42).unwrap();
        assert_eq!((f.code, f.fail_state), (ERR_NOT_SUPPORTED, true));
        assert!(s.ckpt_fault(CkOp::Checkpoint, 43).is_none());
        assert!(s.ckpt_fault(CkOp::Lock, 42).is_none());
        s.ckpt_clear_fault();
        assert!(s.ckpt_fault(CkOp::Checkpoint, 42).is_none());
        s.set_ckpt_cost(Duration::from_millis(600), Duration::from_millis(200));
        assert_eq!(
            s.ckpt_cost(2_000_000_000, false),
            Duration::from_millis(1200)
        );
        assert_eq!(s.ckpt_cost(500_000_000, true), Duration::from_millis(100));
    }
}
