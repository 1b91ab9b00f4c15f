//! # fake-nvml — a test-only NVML driver library
//!
//! A `cdylib` exporting the subset of the NVML C API that `coloc-agent` calls through
//! `nvml-wrapper`. Answers come from the simulated GPUs of `coloc-sim` (state file named by
//! `COLOC_SIM_STATE`). The agent loads it through its normal NVML path
//! (`--nvml-lib target/debug/libfake_nvml.so`), so the agent's real code runs unchanged.
//! The crate is also an `rlib`, so tests can call the C functions directly.
//!
//! Behaviour kept from the real driver: samples newer than `lastSeenTimeStamp` only,
//! `NVML_ERROR_NOT_FOUND` when there are none, `NVML_ERROR_INSUFFICIENT_SIZE` with the
//! needed count when the buffer is too small or absent.
//!
//! UUIDs: `coloc_sim::uuid_string(&coloc_sim::gpu_uuid(gpu))`, e.g.
//! `GPU-c010c517-0000-0000-0000-000000000001` for GPU 1, the same 16 bytes the fake CUDA
//! driver (`tests/fake-cuda`) answers from `cuDeviceGetUuid`.
//!
//! ## Fault injection
//!
//! The switches live in the state file's header (atomics), so a test in another process
//! flips them while the agent runs: in Rust through `coloc_sim::SimGpu`, from a shell
//! through `coloc-sim nvml ...` (see `coloc-sim nvml --help`). Functions are named by
//! `coloc_sim::NvmlFunc` (stable IDs 0-9; C name, e.g. `nvmlDeviceGetUUID`, or short
//! name, e.g. `uuid`).
//!
//! | switch | Rust (`SimGpu::`) | shell (`coloc-sim nvml`) | effect |
//! |---|---|---|---|
//! | inject | `nvml_inject(func, gpu, code, count, data_call_only)` | `inject FUNC --code C [--gpu G] [--count N] [--data-call]` | the next N calls (0: until cleared) of FUNC, on GPU G or all, answer `nvmlReturn_t` C |
//! | delay | `nvml_delay(func, dur)` | `delay FUNC --ms X` | every call sleeps first |
//! | hang | `nvml_hang(func, on)` | `hang FUNC [--off]` | calls block until cleared (cap 120 s), then answer normally |
//! | gone | `nvml_gone(on)` | `gone [--off] [--code C]` | every call, `nvmlInit` included, answers `NVML_ERROR_DRIVER_NOT_LOADED` (9) |
//! | clear | `nvml_clear()` | `clear` | all of the above off, and `nvml_fail` |
//! | legacy | header `nvml_fail` | | every call on a device handle answers `NVML_ERROR_GPU_IS_LOST` |
//!
//! Counters: `nvml_call_count(func)`, `nvml_injected_count(func)`, `nvml_in_flight(func)`,
//! `nvml_hung_count(func)` (`coloc-sim nvml status` prints them all as JSON), and the
//! header's `nvml_calls` (calls on a device handle, all functions).
//!
//! Details:
//! - Order inside a call: count → block while hung → delay → gone → injection (for this
//!   GPU, else for all GPUs) → `nvml_fail` (device-handle calls) → the normal answer.
//! - Two-step functions (`nvmlDeviceGetComputeRunningProcesses_v3`,
//!   `nvmlDeviceGetProcessUtilization`): a *data call* is one with a non-null buffer; an
//!   injection made with `data_call_only` hits only those and leaves the count call
//!   (null buffer) alone — the real driver's race, where samples arrive between the two
//!   calls. `INSUFFICIENT_SIZE` injected on a data call writes the needed count as the
//!   driver does: the real count, at least the buffer size + 1.
//! - "Per GPU" is the handle's GPU, or for `nvmlDeviceGetHandleByIndex_v2` the index
//!   asked for. `nvmlInit`, `nvmlShutdown`, `nvmlDeviceGetCount_v2` and
//!   `nvmlSystemGetDriverVersion` name no GPU: only injections for all GPUs apply.
//! - Gone: 9 is what `nvmlInit` answers when the NVIDIA driver is not running;
//!   `SimGpu::nvml_gone_code` picks another (e.g. 12 `LIBRARY_NOT_FOUND`).
//!   `nvmlErrorString` keeps working, as it does in the real library.
//! - Before the first `nvmlInit` the library cannot see the state file, so calls answer
//!   `NVML_ERROR_UNINITIALIZED` and are not counted.
#![allow(non_snake_case, clippy::missing_safety_doc)]

use coloc_sim::{gpu_uuid, uuid_string, NvmlCall, NvmlFunc, SimGpu};
use std::ffi::{c_char, c_uint, c_ulonglong};
use std::sync::atomic::Ordering;
use std::sync::OnceLock;

type NvmlReturn = c_uint;
const SUCCESS: NvmlReturn = 0;
const ERROR_UNINITIALIZED: NvmlReturn = 1;
const ERROR_INVALID_ARGUMENT: NvmlReturn = 2;
const ERROR_NOT_SUPPORTED: NvmlReturn = 3;
const ERROR_NOT_FOUND: NvmlReturn = 6;
const ERROR_INSUFFICIENT_SIZE: NvmlReturn = 7;
const ERROR_DRIVER_NOT_LOADED: NvmlReturn = 9;
const ERROR_TIMEOUT: NvmlReturn = 10;
const ERROR_LIBRARY_NOT_FOUND: NvmlReturn = 12;
const ERROR_GPU_IS_LOST: NvmlReturn = 15;
const ERROR_NO_DATA: NvmlReturn = 21;
const ERROR_UNKNOWN: NvmlReturn = 999;

/// Opaque device handle: the GPU index plus one, as a pointer value.
pub type NvmlDevice = *mut std::ffi::c_void;

/// `nvmlProcessInfo_t` (v2 layout, used by the `_v3` call).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NvmlProcessInfo {
    pub pid: c_uint,
    pub usedGpuMemory: c_ulonglong,
    pub gpuInstanceId: c_uint,
    pub computeInstanceId: c_uint,
}

/// `nvmlProcessUtilizationSample_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NvmlProcessUtilizationSample {
    pub pid: c_uint,
    pub timeStamp: c_ulonglong,
    pub smUtil: c_uint,
    pub memUtil: c_uint,
    pub encUtil: c_uint,
    pub decUtil: c_uint,
}

static SIM: OnceLock<Result<SimGpu, String>> = OnceLock::new();

fn sim() -> Option<&'static SimGpu> {
    SIM.get().and_then(|r| r.as_ref().ok())
}

/// Entry of a call that names no device: the sim, and the call (its fault, if any).
fn enter(
    func: NvmlFunc,
    gpu: Option<u32>,
) -> Result<(&'static SimGpu, NvmlCall<'static>), NvmlReturn> {
    let sim = sim().ok_or(ERROR_UNINITIALIZED)?;
    let call = sim.nvml_enter(func, gpu, false);
    match call.fault {
        Some(code) => Err(code),
        None => Ok((sim, call)),
    }
}

/// A call on a valid device handle that is to be served.
struct DevCall {
    sim: &'static SimGpu,
    gpu: u32,
    _call: NvmlCall<'static>,
}

fn gpu_of(sim: &SimGpu, dev: NvmlDevice) -> Option<u32> {
    let idx = (dev as usize).wrapping_sub(1);
    (!dev.is_null() && idx < sim.n_gpus() as usize).then_some(idx as u32)
}

/// Entry of a call on a device handle: counts it, applies faults (see the crate docs),
/// the legacy `nvml_fail` switch, and checks the handle.
fn device(dev: NvmlDevice, func: NvmlFunc, data_call: bool) -> Result<DevCall, NvmlReturn> {
    let sim = sim().ok_or(ERROR_UNINITIALIZED)?;
    sim.header().nvml_calls.fetch_add(1, Ordering::Relaxed);
    let gpu = gpu_of(sim, dev);
    let call = sim.nvml_enter(func, gpu, data_call);
    if let Some(code) = call.fault {
        return Err(code);
    }
    if sim.header().nvml_fail.load(Ordering::Relaxed) != 0 {
        return Err(ERROR_GPU_IS_LOST);
    }
    let gpu = gpu.ok_or(ERROR_INVALID_ARGUMENT)?;
    Ok(DevCall {
        sim,
        gpu,
        _call: call,
    })
}

/// A two-step call refused with `code`: when that is `INSUFFICIENT_SIZE` (injected), write
/// the needed count as the driver does: what is there, and on a data call more than the
/// buffer holds (else the driver would not have refused it).
///
/// Safety: `count` is null or points to the caller's writable count.
unsafe fn refused(
    dev: NvmlDevice,
    code: NvmlReturn,
    count: *mut c_uint,
    data_call: bool,
    needed: impl Fn(&SimGpu, u32) -> usize,
) -> NvmlReturn {
    if code == ERROR_INSUFFICIENT_SIZE && !count.is_null() {
        if let Some((sim, g)) = sim().and_then(|s| Some((s, gpu_of(s, dev)?))) {
            // SAFETY: `count` is non-null and points to the caller's in/out count.
            unsafe {
                let cap = *count as usize;
                let n = needed(sim, g);
                let n = if data_call { n.max(cap + 1) } else { n };
                *count = n.min(c_uint::MAX as usize) as c_uint;
            }
        }
    }
    code
}

unsafe fn write_str(buf: *mut c_char, len: c_uint, s: &str) -> NvmlReturn {
    if buf.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    if s.len() + 1 > len as usize {
        return ERROR_INSUFFICIENT_SIZE;
    }
    // SAFETY: the caller gave a buffer of `len` bytes; we write s.len() + 1 <= len.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf as *mut u8, s.len());
        *buf.add(s.len()) = 0;
    }
    SUCCESS
}

#[no_mangle]
pub extern "C" fn nvmlInit_v2() -> NvmlReturn {
    match SIM.get_or_init(|| SimGpu::from_env().map_err(|e| format!("{e:#}"))) {
        Ok(sim) => sim
            .nvml_enter(NvmlFunc::Init, None, false)
            .fault
            .unwrap_or(SUCCESS),
        Err(e) => {
            eprintln!("fake-nvml: {e}");
            ERROR_DRIVER_NOT_LOADED
        }
    }
}

#[no_mangle]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> NvmlReturn {
    nvmlInit_v2()
}

#[no_mangle]
pub extern "C" fn nvmlShutdown() -> NvmlReturn {
    match sim() {
        Some(sim) => sim
            .nvml_enter(NvmlFunc::Shutdown, None, false)
            .fault
            .unwrap_or(SUCCESS),
        None => SUCCESS,
    }
}

#[no_mangle]
pub extern "C" fn nvmlErrorString(code: NvmlReturn) -> *const c_char {
    let s: &'static [u8] = match code {
        SUCCESS => b"Success\0",
        ERROR_UNINITIALIZED => b"Uninitialized\0",
        ERROR_INVALID_ARGUMENT => b"Invalid Argument\0",
        ERROR_NOT_SUPPORTED => b"Not Supported\0",
        ERROR_NOT_FOUND => b"Not Found\0",
        ERROR_INSUFFICIENT_SIZE => b"Insufficient Size\0",
        ERROR_DRIVER_NOT_LOADED => b"Driver Not Loaded\0",
        ERROR_TIMEOUT => b"Timeout\0",
        ERROR_LIBRARY_NOT_FOUND => b"NVML Shared Library Not Found\0",
        ERROR_GPU_IS_LOST => b"GPU is lost\0",
        ERROR_NO_DATA => b"No Data\0",
        ERROR_UNKNOWN => b"Unknown Error\0",
        _ => b"Unknown Error\0",
    };
    s.as_ptr() as *const c_char
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(buf: *mut c_char, len: c_uint) -> NvmlReturn {
    // Served without a state file too, as before injection existed.
    let _call = match sim().map(|_| enter(NvmlFunc::SystemGetDriverVersion, None)) {
        Some(Err(e)) => return e,
        Some(Ok((_, call))) => Some(call),
        None => None,
    };
    // SAFETY: forwarded caller contract.
    unsafe { write_str(buf, len, "fake-nvml-0.1") }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> NvmlReturn {
    let (sim, _call) = match enter(NvmlFunc::DeviceGetCount, None) {
        Ok(v) => v,
        Err(e) => return e,
    };
    if count.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: non-null pointer from the caller.
    unsafe { *count = sim.n_gpus() };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    dev: *mut NvmlDevice,
) -> NvmlReturn {
    let Some(sim) = sim() else {
        return ERROR_UNINITIALIZED;
    };
    let gpu = (index < sim.n_gpus()).then_some(index);
    let (sim, _call) = match enter(NvmlFunc::DeviceGetHandleByIndex, gpu) {
        Ok(v) => v,
        Err(e) => return e,
    };
    if dev.is_null() || index >= sim.n_gpus() {
        return ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: non-null pointer from the caller.
    unsafe { *dev = (index as usize + 1) as NvmlDevice };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetIndex(dev: NvmlDevice, index: *mut c_uint) -> NvmlReturn {
    match device(dev, NvmlFunc::DeviceGetIndex, false) {
        Ok(c) if !index.is_null() => {
            // SAFETY: non-null pointer from the caller.
            unsafe { *index = c.gpu };
            SUCCESS
        }
        Ok(_) => ERROR_INVALID_ARGUMENT,
        Err(e) => e,
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    dev: NvmlDevice,
    buf: *mut c_char,
    len: c_uint,
) -> NvmlReturn {
    match device(dev, NvmlFunc::DeviceGetUUID, false) {
        // SAFETY: forwarded caller contract.
        Ok(c) => unsafe { write_str(buf, len, &uuid_string(&gpu_uuid(c.gpu))) },
        Err(e) => e,
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetName(
    dev: NvmlDevice,
    buf: *mut c_char,
    len: c_uint,
) -> NvmlReturn {
    match device(dev, NvmlFunc::DeviceGetName, false) {
        // SAFETY: forwarded caller contract.
        Ok(_) => unsafe { write_str(buf, len, "Simulated GPU (coloc-sim)") },
        Err(e) => e,
    }
}

/// `nvmlMemory_v2_t`.
#[repr(C)]
#[derive(Debug)]
pub struct NvmlMemoryV2 {
    pub version: c_uint,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}

/// `nvmlDeviceGetMemoryInfo_v2`: the GPU's memory (`coloc-sim gpu --memory-gib`), what
/// its listed processes hold (a checkpointed process holds none), and the rest free.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    dev: NvmlDevice,
    mem: *mut NvmlMemoryV2,
) -> NvmlReturn {
    let c = match device(dev, NvmlFunc::DeviceGetMemoryInfo, false) {
        Ok(c) => c,
        Err(e) => return e,
    };
    if mem.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    let total = c.sim.mem_total();
    let used = c.sim.mem_used(c.gpu).min(total);
    // SAFETY: non-null pointer from the caller to an nvmlMemory_v2_t.
    unsafe {
        (*mem).total = total;
        (*mem).reserved = 0;
        (*mem).used = used;
        (*mem).free = total - used;
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    dev: NvmlDevice,
    count: *mut c_uint,
    infos: *mut NvmlProcessInfo,
) -> NvmlReturn {
    let data_call = !infos.is_null();
    let c = match device(dev, NvmlFunc::DeviceGetComputeRunningProcesses, data_call) {
        Ok(c) => c,
        // SAFETY: forwarded caller contract for `count`.
        Err(e) => return unsafe { refused(dev, e, count, data_call, |s, g| s.processes(g).len()) },
    };
    if count.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    let procs = c.sim.processes(c.gpu);
    // SAFETY: `count` is non-null; `infos`, when non-null, has room for `*count` entries.
    unsafe {
        let cap = *count as usize;
        *count = procs.len() as c_uint;
        if infos.is_null() || cap < procs.len() {
            return if procs.is_empty() {
                SUCCESS
            } else {
                ERROR_INSUFFICIENT_SIZE
            };
        }
        for (i, p) in procs.iter().enumerate() {
            *infos.add(i) = NvmlProcessInfo {
                pid: p.pid,
                usedGpuMemory: p.mem_bytes,
                gpuInstanceId: u32::MAX,
                computeInstanceId: u32::MAX,
            };
        }
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetProcessUtilization(
    dev: NvmlDevice,
    out: *mut NvmlProcessUtilizationSample,
    count: *mut c_uint,
    last_seen: c_ulonglong,
) -> NvmlReturn {
    let data_call = !out.is_null();
    let c = match device(dev, NvmlFunc::DeviceGetProcessUtilization, data_call) {
        Ok(c) => c,
        Err(e) => {
            // SAFETY: forwarded caller contract for `count`.
            return unsafe {
                refused(dev, e, count, data_call, |s, g| {
                    s.samples(g, last_seen).len()
                })
            };
        }
    };
    if count.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    let samples = c.sim.samples(c.gpu, last_seen);
    // SAFETY: `count` is non-null; `out`, when non-null, has room for `*count` entries.
    unsafe {
        let cap = *count as usize;
        *count = samples.len() as c_uint;
        if samples.is_empty() {
            return ERROR_NOT_FOUND;
        }
        if out.is_null() || cap < samples.len() {
            return ERROR_INSUFFICIENT_SIZE;
        }
        for (i, s) in samples.iter().enumerate() {
            *out.add(i) = NvmlProcessUtilizationSample {
                pid: s.pid,
                timeStamp: s.timestamp_us,
                smUtil: s.sm_util,
                memUtil: 0,
                encUtil: 0,
                decUtil: 0,
            };
        }
    }
    SUCCESS
}
