//! # fake-nvml — a test-only NVML driver library
//!
//! A `cdylib` exporting the subset of the NVML C API that `coloc-agent` calls through
//! `nvml-wrapper`. Answers come from the simulated GPUs of `coloc-sim` (state file named by
//! `COLOC_SIM_STATE`). The agent loads it through its normal NVML path
//! (`--nvml-lib target/debug/libfake_nvml.so`), so the agent's real code runs unchanged.
//!
//! Behaviour kept from the real driver: samples newer than `lastSeenTimeStamp` only,
//! `NVML_ERROR_NOT_FOUND` when there are none, `NVML_ERROR_INSUFFICIENT_SIZE` with the
//! needed count when the buffer is too small or absent. Failure injection: when the
//! state's `nvml_fail` flag is set, every device call answers `NVML_ERROR_GPU_IS_LOST`.
#![allow(non_snake_case, clippy::missing_safety_doc)]

use coloc_sim::SimGpu;
use std::ffi::{c_char, c_uint, c_ulonglong};
use std::sync::atomic::Ordering;
use std::sync::OnceLock;

type NvmlReturn = c_uint;
const SUCCESS: NvmlReturn = 0;
const ERROR_UNINITIALIZED: NvmlReturn = 1;
const ERROR_INVALID_ARGUMENT: NvmlReturn = 2;
const ERROR_NOT_FOUND: NvmlReturn = 6;
const ERROR_INSUFFICIENT_SIZE: NvmlReturn = 7;
const ERROR_DRIVER_NOT_LOADED: NvmlReturn = 9;
const ERROR_GPU_IS_LOST: NvmlReturn = 15;

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

fn device(dev: NvmlDevice) -> Result<(&'static SimGpu, u32), NvmlReturn> {
    let sim = sim().ok_or(ERROR_UNINITIALIZED)?;
    sim.header().nvml_calls.fetch_add(1, Ordering::Relaxed);
    if sim.header().nvml_fail.load(Ordering::Relaxed) != 0 {
        return Err(ERROR_GPU_IS_LOST);
    }
    let idx = (dev as usize).wrapping_sub(1);
    if dev.is_null() || idx >= sim.n_gpus() as usize {
        return Err(ERROR_INVALID_ARGUMENT);
    }
    Ok((sim, idx as u32))
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
        Ok(_) => SUCCESS,
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
    SUCCESS
}

#[no_mangle]
pub extern "C" fn nvmlErrorString(code: NvmlReturn) -> *const c_char {
    let s: &'static [u8] = match code {
        SUCCESS => b"Success\0",
        ERROR_UNINITIALIZED => b"Uninitialized\0",
        ERROR_INVALID_ARGUMENT => b"Invalid Argument\0",
        ERROR_NOT_FOUND => b"Not Found\0",
        ERROR_INSUFFICIENT_SIZE => b"Insufficient Size\0",
        ERROR_DRIVER_NOT_LOADED => b"Driver Not Loaded\0",
        ERROR_GPU_IS_LOST => b"GPU is lost\0",
        _ => b"Unknown Error\0",
    };
    s.as_ptr() as *const c_char
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(buf: *mut c_char, len: c_uint) -> NvmlReturn {
    // SAFETY: forwarded caller contract.
    unsafe { write_str(buf, len, "fake-nvml-0.1") }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> NvmlReturn {
    let Some(sim) = sim() else {
        return ERROR_UNINITIALIZED;
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
    if dev.is_null() || index >= sim.n_gpus() {
        return ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: non-null pointer from the caller.
    unsafe { *dev = (index as usize + 1) as NvmlDevice };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetIndex(dev: NvmlDevice, index: *mut c_uint) -> NvmlReturn {
    match device(dev) {
        Ok((_, g)) if !index.is_null() => {
            // SAFETY: non-null pointer from the caller.
            unsafe { *index = g };
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
    match device(dev) {
        // SAFETY: forwarded caller contract.
        Ok((_, g)) => unsafe {
            write_str(buf, len, &format!("GPU-fake0000-0000-0000-0000-{g:012}"))
        },
        Err(e) => e,
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetName(
    dev: NvmlDevice,
    buf: *mut c_char,
    len: c_uint,
) -> NvmlReturn {
    match device(dev) {
        // SAFETY: forwarded caller contract.
        Ok(_) => unsafe { write_str(buf, len, "Simulated GPU (coloc-sim)") },
        Err(e) => e,
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    dev: NvmlDevice,
    count: *mut c_uint,
    infos: *mut NvmlProcessInfo,
) -> NvmlReturn {
    let (sim, g) = match device(dev) {
        Ok(v) => v,
        Err(e) => return e,
    };
    if count.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    let procs = sim.processes(g);
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
    let (sim, g) = match device(dev) {
        Ok(v) => v,
        Err(e) => return e,
    };
    if count.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    let samples = sim.samples(g, last_seen);
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
