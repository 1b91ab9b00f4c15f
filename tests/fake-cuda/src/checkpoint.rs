//! The CUDA driver's checkpoint API over the simulated GPU (the model:
//! `coloc_sim::checkpoint`).
//!
//! - The caller's side: `cuCheckpointProcess{GetState,Lock,Checkpoint,Restore,Unlock,
//!   GetRestoreThreadId}`, exported as the real driver (12.8 and later) exports them. They
//!   need no `cuInit` of the caller, only `COLOC_SIM_STATE`; without it they answer
//!   `CUDA_ERROR_NO_DEVICE`.
//! - The target's side: the *restore thread* this library starts at `cuInit`. It carries
//!   out every state-changing call on this process, so a stopped or frozen process stalls
//!   its callers until it runs, as on the real driver.

use super::*;
use coloc_sim::checkpoint::{
    self as ck, CkOp, STATE_CHECKPOINTED, STATE_FAILED, STATE_LOCKED, STATE_RUNNING,
};
use std::time::{Duration, Instant};

/// What a checkpoint or a restore costs beyond its per-GB cost (setting up, the context).
const FIXED_COST: Duration = Duration::from_millis(20);

/// Starts this process's restore thread.
pub(crate) fn start_restore_thread(entry: &'static ProcEntry) {
    let _ = std::thread::Builder::new()
        .name("fake-cuda-restore".into())
        .spawn(move || {
            // SAFETY: gettid has no preconditions.
            entry.set_tid(unsafe { libc::gettid() } as u32);
            loop {
                let Some((op, timeout)) = entry.next_request(Duration::from_secs(1)) else {
                    continue;
                };
                let r = catch_unwind(AssertUnwindSafe(|| serve(entry, op, timeout)))
                    .unwrap_or(CUDA_ERROR_UNKNOWN);
                entry.done(r);
            }
        });
}

/// This process's slots (one per GPU with a live context).
fn my_slots() -> Vec<Slot> {
    match drv_unlocked() {
        Ok(d) => d
            .lock()
            .gpus
            .iter()
            .filter_map(|g| g.slot.clone())
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// Carries out `op` on this process (the restore thread).
fn serve(entry: &ProcEntry, op: CkOp, timeout: Duration) -> CUresult {
    let Ok(d) = drv_unlocked() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    if let Some(f) = d.sim.ckpt_fault(op, d.pid) {
        if f.fail_state {
            entry.set_cu_state(STATE_FAILED);
        }
        return f.code;
    }
    let state = entry.cu_state();
    match op {
        CkOp::Lock => {
            if state != STATE_RUNNING {
                return CUDA_ERROR_ILLEGAL_STATE;
            }
            // New calls block first; then the work already submitted runs out. A call
            // that passed the gate just before may still submit: drained means drained
            // twice in a row.
            entry.set_gate(true);
            let deadline = (!timeout.is_zero()).then(|| Instant::now() + timeout);
            let drained = || my_slots().iter().all(|s| s.outstanding() == 0);
            let ok = ck::wait_until(deadline, || {
                drained() && {
                    std::thread::sleep(Duration::from_micros(100));
                    drained()
                }
            });
            if !ok {
                entry.set_gate(false);
                return CUDA_ERROR_TIMEOUT;
            }
            entry.set_cu_state(STATE_LOCKED);
            CUDA_SUCCESS
        }
        CkOp::Checkpoint => {
            if state != STATE_LOCKED {
                return CUDA_ERROR_ILLEGAL_STATE;
            }
            let slots = my_slots();
            let bytes: u64 = slots.iter().map(|s| s.mem_bytes()).sum();
            std::thread::sleep(FIXED_COST + d.sim.ckpt_cost(bytes, false));
            for s in &slots {
                s.park(true);
            }
            entry.set_host_bytes(bytes);
            entry.set_cu_state(STATE_CHECKPOINTED);
            CUDA_SUCCESS
        }
        CkOp::Restore => {
            if state != STATE_CHECKPOINTED {
                return CUDA_ERROR_ILLEGAL_STATE;
            }
            let slots = my_slots();
            for s in &slots {
                let free = d.sim.mem_total().saturating_sub(d.sim.mem_used(s.gpu()));
                if s.mem_bytes() > free {
                    return CUDA_ERROR_OUT_OF_MEMORY;
                }
            }
            let bytes: u64 = slots.iter().map(|s| s.mem_bytes()).sum();
            std::thread::sleep(FIXED_COST + d.sim.ckpt_cost(bytes, true));
            for s in &slots {
                s.park(false);
            }
            entry.set_host_bytes(0);
            entry.set_cu_state(STATE_LOCKED);
            CUDA_SUCCESS
        }
        CkOp::Unlock => {
            if state != STATE_LOCKED {
                return CUDA_ERROR_ILLEGAL_STATE;
            }
            entry.set_cu_state(STATE_RUNNING);
            entry.set_gate(false);
            CUDA_SUCCESS
        }
    }
}

/// The simulated GPU as a caller of the checkpoint API sees it (no `cuInit` needed): the
/// state file `COLOC_SIM_STATE` names at the call (one mapping per file, kept).
fn caller_sim() -> Result<&'static SimGpu, CUresult> {
    static SIMS: Mutex<Vec<(std::ffi::OsString, &'static SimGpu)>> = Mutex::new(Vec::new());
    let path = std::env::var_os(coloc_sim::STATE_ENV).ok_or(CUDA_ERROR_NO_DEVICE)?;
    let mut sims = SIMS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, s)) = sims.iter().find(|(p, _)| *p == path) {
        return Ok(s);
    }
    let s: &'static SimGpu = Box::leak(Box::new(
        SimGpu::open(std::path::Path::new(&path)).map_err(|_| CUDA_ERROR_NO_DEVICE)?,
    ));
    sims.push((path, s));
    Ok(s)
}

fn pid_of(pid: c_int) -> Result<u32, CUresult> {
    u32::try_from(pid)
        .ok()
        .filter(|p| *p > 0)
        .ok_or(CUDA_ERROR_INVALID_VALUE)
}

fn call(pid: c_int, op: CkOp, timeout_ms: u32) -> R {
    let sim = caller_sim()?;
    match sim.ckpt_call(pid_of(pid)?, op, timeout_ms) {
        0 => Ok(()),
        e => Err(e),
    }
}

/// `CUcheckpointLockArgs`.
#[repr(C)]
#[derive(Debug)]
pub struct CUcheckpointLockArgs {
    pub timeoutMs: c_uint,
    pub reserved0: c_uint,
    pub reserved1: [u64; 7],
}

#[no_mangle]
pub unsafe extern "C" fn cuCheckpointProcessGetState(pid: c_int, state: *mut c_uint) -> CUresult {
    ffi(|| {
        let s = caller_sim()?.ckpt_state(pid_of(pid)?)?;
        put(state, s)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCheckpointProcessGetRestoreThreadId(
    pid: c_int,
    tid: *mut c_int,
) -> CUresult {
    ffi(|| {
        let t = caller_sim()?.ckpt_restore_tid(pid_of(pid)?)?;
        put(tid, t as c_int)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCheckpointProcessLock(
    pid: c_int,
    args: *mut CUcheckpointLockArgs,
) -> CUresult {
    ffi(|| {
        // SAFETY: null or the caller's argument struct, per cuda.h.
        let timeout = if args.is_null() {
            0
        } else {
            unsafe { (*args).timeoutMs }
        };
        call(pid, CkOp::Lock, timeout)
    })
}

#[no_mangle]
pub extern "C" fn cuCheckpointProcessCheckpoint(pid: c_int, _args: *mut c_void) -> CUresult {
    ffi(|| call(pid, CkOp::Checkpoint, 0))
}

#[no_mangle]
pub extern "C" fn cuCheckpointProcessRestore(pid: c_int, _args: *mut c_void) -> CUresult {
    ffi(|| call(pid, CkOp::Restore, 0))
}

#[no_mangle]
pub extern "C" fn cuCheckpointProcessUnlock(pid: c_int, _args: *mut c_void) -> CUresult {
    ffi(|| call(pid, CkOp::Unlock, 0))
}
