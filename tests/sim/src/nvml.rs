//! NVML fault switches shared between a test (the controller) and the fake NVML library
//! (`libfake_nvml.so`, loaded by the agent in another process).
//!
//! Everything lives in the state file's header as atomics. Per function ([`NvmlFunc`]):
//!
//! - **injection** ([`SimGpu::nvml_inject`]): answer a given `nvmlReturn_t` for the next N
//!   calls (or until cleared), for every GPU or one GPU, optionally only for the *data* call
//!   of a two-step function (the call with a non-null buffer; the count call with a null
//!   buffer is then served normally). One injection per (function, GPU or all GPUs); an
//!   injection for one GPU is consulted before the one for all GPUs.
//! - **delay** ([`SimGpu::nvml_delay`]): every call sleeps this long first.
//! - **hang** ([`SimGpu::nvml_hang`]): every call blocks until the hang is cleared (at most
//!   [`HANG_CAP`], so a broken test cannot hang forever), then goes on normally.
//! - **counters**: calls made ([`SimGpu::nvml_call_count`]), injected answers given,
//!   calls in progress and calls blocked in a hang right now.
//!
//! And for the whole library: **gone** ([`SimGpu::nvml_gone`]): every call, `nvmlInit`
//! included, answers `NVML_ERROR_DRIVER_NOT_LOADED` (what `nvmlInit` answers when the
//! NVIDIA driver is not running) until cleared.
//!
//! Order inside one call: count it → wait while hung → delay → gone → injection → (fake
//! library) the legacy `nvml_fail` switch → the normal answer.

use super::{futex_wait, futex_wake, SimGpu, MAX_GPUS};
use anyhow::{bail, Result};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::*};
use std::time::{Duration, Instant};

/// Longest a call stays blocked by [`SimGpu::nvml_hang`] before answering anyway.
pub const HANG_CAP: Duration = Duration::from_secs(120);
/// `NVML_ERROR_INSUFFICIENT_SIZE`.
pub const NVML_ERROR_INSUFFICIENT_SIZE: u32 = 7;
/// `NVML_ERROR_DRIVER_NOT_LOADED`: the code [`SimGpu::nvml_gone`] answers.
pub const NVML_ERROR_DRIVER_NOT_LOADED: u32 = 9;

/// Function slots in the header (room to add functions without a layout change).
const FUNC_SLOTS: usize = 16;

/// An NVML function the fake library serves. The numeric ID (`as u32`) is stable: it is
/// the index of the function's entry in the state file.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NvmlFunc {
    /// `nvmlInit_v2` and `nvmlInitWithFlags` (short name `init`).
    Init = 0,
    /// `nvmlShutdown` (`shutdown`).
    Shutdown = 1,
    /// `nvmlDeviceGetCount_v2` (`count`).
    DeviceGetCount = 2,
    /// `nvmlDeviceGetHandleByIndex_v2` (`handle`); per GPU: the index asked for.
    DeviceGetHandleByIndex = 3,
    /// `nvmlDeviceGetUUID` (`uuid`).
    DeviceGetUUID = 4,
    /// `nvmlDeviceGetComputeRunningProcesses_v3` (`processes`); two-step.
    DeviceGetComputeRunningProcesses = 5,
    /// `nvmlDeviceGetProcessUtilization` (`utilization`); two-step.
    DeviceGetProcessUtilization = 6,
    /// `nvmlDeviceGetIndex` (`index`).
    DeviceGetIndex = 7,
    /// `nvmlDeviceGetName` (`name`).
    DeviceGetName = 8,
    /// `nvmlSystemGetDriverVersion` (`driver-version`).
    SystemGetDriverVersion = 9,
    /// `nvmlDeviceGetMemoryInfo_v2` (`memory`).
    DeviceGetMemoryInfo = 10,
}

impl NvmlFunc {
    /// Every function, in ID order.
    pub const ALL: [NvmlFunc; 11] = [
        NvmlFunc::Init,
        NvmlFunc::Shutdown,
        NvmlFunc::DeviceGetCount,
        NvmlFunc::DeviceGetHandleByIndex,
        NvmlFunc::DeviceGetUUID,
        NvmlFunc::DeviceGetComputeRunningProcesses,
        NvmlFunc::DeviceGetProcessUtilization,
        NvmlFunc::DeviceGetIndex,
        NvmlFunc::DeviceGetName,
        NvmlFunc::SystemGetDriverVersion,
        NvmlFunc::DeviceGetMemoryInfo,
    ];

    /// The stable numeric ID.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// The function with this ID.
    pub fn from_id(id: u32) -> Option<NvmlFunc> {
        NvmlFunc::ALL.get(id as usize).copied()
    }

    /// The exported C symbol.
    pub fn c_name(self) -> &'static str {
        match self {
            NvmlFunc::Init => "nvmlInit_v2",
            NvmlFunc::Shutdown => "nvmlShutdown",
            NvmlFunc::DeviceGetCount => "nvmlDeviceGetCount_v2",
            NvmlFunc::DeviceGetHandleByIndex => "nvmlDeviceGetHandleByIndex_v2",
            NvmlFunc::DeviceGetUUID => "nvmlDeviceGetUUID",
            NvmlFunc::DeviceGetComputeRunningProcesses => "nvmlDeviceGetComputeRunningProcesses_v3",
            NvmlFunc::DeviceGetProcessUtilization => "nvmlDeviceGetProcessUtilization",
            NvmlFunc::DeviceGetIndex => "nvmlDeviceGetIndex",
            NvmlFunc::DeviceGetName => "nvmlDeviceGetName",
            NvmlFunc::SystemGetDriverVersion => "nvmlSystemGetDriverVersion",
            NvmlFunc::DeviceGetMemoryInfo => "nvmlDeviceGetMemoryInfo_v2",
        }
    }

    /// A short name for command lines.
    pub fn short_name(self) -> &'static str {
        match self {
            NvmlFunc::Init => "init",
            NvmlFunc::Shutdown => "shutdown",
            NvmlFunc::DeviceGetCount => "count",
            NvmlFunc::DeviceGetHandleByIndex => "handle",
            NvmlFunc::DeviceGetUUID => "uuid",
            NvmlFunc::DeviceGetComputeRunningProcesses => "processes",
            NvmlFunc::DeviceGetProcessUtilization => "utilization",
            NvmlFunc::DeviceGetIndex => "index",
            NvmlFunc::DeviceGetName => "name",
            NvmlFunc::SystemGetDriverVersion => "driver-version",
            NvmlFunc::DeviceGetMemoryInfo => "memory",
        }
    }

    /// Whether the call names a GPU (so an injection can target one GPU).
    pub fn per_gpu(self) -> bool {
        !matches!(
            self,
            NvmlFunc::Init
                | NvmlFunc::Shutdown
                | NvmlFunc::DeviceGetCount
                | NvmlFunc::SystemGetDriverVersion
        )
    }

    /// Whether callers call it twice: a count call (null buffer), then a data call.
    pub fn two_step(self) -> bool {
        matches!(
            self,
            NvmlFunc::DeviceGetComputeRunningProcesses | NvmlFunc::DeviceGetProcessUtilization
        )
    }
}

impl std::fmt::Display for NvmlFunc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.c_name())
    }
}

impl std::str::FromStr for NvmlFunc {
    type Err = String;

    /// Accepts the ID (`4`), the C name with or without its version suffix
    /// (`nvmlDeviceGetUUID`, `nvmlDeviceGetCount_v2`, `nvmlDeviceGetCount`), the variant
    /// name (`DeviceGetUUID`) or the short name (`uuid`); case-insensitive.
    fn from_str(s: &str) -> Result<NvmlFunc, String> {
        let t = s.trim();
        if let Ok(id) = t.parse::<u32>() {
            return NvmlFunc::from_id(id).ok_or_else(|| format!("no NVML function has ID {id}"));
        }
        let norm = |n: &str| -> String {
            let n = n.to_ascii_lowercase().replace('_', "-");
            let n = n.strip_prefix("nvml").unwrap_or(&n).to_string();
            match n.rfind("-v") {
                Some(i) if n[i + 2..].bytes().all(|b| b.is_ascii_digit()) && i + 2 < n.len() => {
                    n[..i].to_string()
                }
                _ => n,
            }
        };
        let want = norm(t);
        if want == "initwithflags" {
            return Ok(NvmlFunc::Init);
        }
        NvmlFunc::ALL
            .into_iter()
            .find(|f| norm(f.c_name()) == want || f.short_name() == want)
            .ok_or_else(|| {
                let names: Vec<_> = NvmlFunc::ALL.iter().map(|f| f.short_name()).collect();
                format!(
                    "unknown NVML function {s:?}: give a C name (nvmlDeviceGetUUID), an ID (0-{}) or one of {}",
                    NvmlFunc::ALL.len() - 1,
                    names.join(", ")
                )
            })
    }
}

/// `nvmlReturn_t` names, without the `NVML_ERROR_` prefix.
const RETURN_NAMES: &[(u32, &str)] = &[
    (0, "SUCCESS"),
    (1, "UNINITIALIZED"),
    (2, "INVALID_ARGUMENT"),
    (3, "NOT_SUPPORTED"),
    (4, "NO_PERMISSION"),
    (5, "ALREADY_INITIALIZED"),
    (6, "NOT_FOUND"),
    (7, "INSUFFICIENT_SIZE"),
    (8, "INSUFFICIENT_POWER"),
    (9, "DRIVER_NOT_LOADED"),
    (10, "TIMEOUT"),
    (11, "IRQ_ISSUE"),
    (12, "LIBRARY_NOT_FOUND"),
    (13, "FUNCTION_NOT_FOUND"),
    (14, "CORRUPTED_INFOROM"),
    (15, "GPU_IS_LOST"),
    (16, "RESET_REQUIRED"),
    (17, "OPERATING_SYSTEM"),
    (18, "LIB_RM_VERSION_MISMATCH"),
    (19, "IN_USE"),
    (20, "MEMORY"),
    (21, "NO_DATA"),
    (22, "VGPU_ECC_NOT_SUPPORTED"),
    (23, "INSUFFICIENT_RESOURCES"),
    (24, "FREQ_NOT_SUPPORTED"),
    (25, "ARGUMENT_VERSION_MISMATCH"),
    (26, "DEPRECATED"),
    (27, "NOT_READY"),
    (28, "GPU_NOT_FOUND"),
    (29, "INVALID_STATE"),
    (999, "UNKNOWN"),
];

/// The name of an `nvmlReturn_t` (`INSUFFICIENT_SIZE` for 7), if it has one.
pub fn nvml_return_name(code: u32) -> Option<&'static str> {
    RETURN_NAMES.iter().find(|r| r.0 == code).map(|r| r.1)
}

/// Parses an `nvmlReturn_t`: a number (`7`) or a name, with or without its prefix
/// (`INSUFFICIENT_SIZE`, `NVML_ERROR_INSUFFICIENT_SIZE`, `insufficient-size`).
pub fn parse_nvml_return(s: &str) -> Result<u32, String> {
    let t = s.trim();
    if let Ok(n) = t.parse::<u32>() {
        return Ok(n);
    }
    let up = t.to_ascii_uppercase().replace('-', "_");
    let name = up
        .strip_prefix("NVML_ERROR_")
        .or_else(|| up.strip_prefix("NVML_"))
        .unwrap_or(&up);
    RETURN_NAMES
        .iter()
        .find(|r| r.1 == name)
        .map(|r| r.0)
        .ok_or_else(|| format!("unknown nvmlReturn_t {s:?}: give a number or a name such as INSUFFICIENT_SIZE, GPU_IS_LOST, TIMEOUT"))
}

// An injection is one atomic word, so the library never sees half of one:
// bits 0..16 the code, bit 16 data-call-only, bits 32..64 the answers left
// (0: none, u32::MAX: until cleared).
const DATA_ONLY: u64 = 1 << 16;
const LEFT_SHIFT: u32 = 32;
const FOREVER: u64 = u32::MAX as u64;

/// One function's switches and counters.
#[repr(C)]
#[derive(Debug)]
struct FuncState {
    /// `[0]`: for every GPU; `[g + 1]`: for GPU `g` only.
    inject: [AtomicU64; MAX_GPUS as usize + 1],
    delay_us: AtomicU64,
    /// 1 while calls must block.
    hang: AtomicU32,
    /// Calls blocked in a hang now.
    hung: AtomicU32,
    /// Calls between entry and answer now.
    in_flight: AtomicU32,
    _pad: AtomicU32,
    calls: AtomicU64,
    injected: AtomicU64,
}

/// The NVML part of the shared header.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct NvmlState {
    /// Non-zero: every call answers this code.
    gone: AtomicU32,
    _pad: AtomicU32,
    funcs: [FuncState; FUNC_SLOTS],
}

const _: () = assert!(NvmlFunc::ALL.len() <= FUNC_SLOTS);
const _: () = assert!(std::mem::size_of::<NvmlState>() & 7 == 0);

/// One call in progress in the fake library, from [`SimGpu::nvml_enter`]: holds the
/// in-progress count until dropped.
#[derive(Debug)]
#[must_use = "the call counts as in progress until this is dropped"]
pub struct NvmlCall<'a> {
    f: &'a FuncState,
    /// The code to answer instead of serving the call (gone or injected), if any.
    pub fault: Option<u32>,
}

impl Drop for NvmlCall<'_> {
    fn drop(&mut self) {
        self.f.in_flight.fetch_sub(1, AcqRel);
    }
}

/// An active injection, as [`SimGpu::nvml_status`] reports it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct NvmlInjection {
    /// The GPU it is for; `None`: every GPU.
    pub gpu: Option<u32>,
    /// The `nvmlReturn_t` answered.
    pub code: u32,
    /// Answers left; `None`: until cleared.
    pub left: Option<u32>,
    /// Only the data call (non-null buffer) of a two-step function.
    pub data_call_only: bool,
}

/// One function's state, as [`SimGpu::nvml_status`] reports it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct NvmlFuncStatus {
    /// Stable ID.
    pub id: u32,
    /// C symbol.
    pub name: &'static str,
    /// Calls made.
    pub calls: u64,
    /// Calls answered with an injected code.
    pub injected: u64,
    /// Calls in progress now.
    pub in_flight: u32,
    /// Calls blocked in a hang now.
    pub hung: u32,
    /// Whether calls hang.
    pub hang: bool,
    /// Delay added to every call, µs.
    pub delay_us: u64,
    /// Active injections.
    pub injections: Vec<NvmlInjection>,
}

/// All NVML switches and counters (`coloc-sim nvml status` prints it as JSON).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct NvmlStatus {
    /// Code every call answers (library gone); `None`: not gone.
    pub gone: Option<u32>,
    /// The legacy `nvml_fail` switch.
    pub fail: bool,
    /// Device-handle calls served (the header's `nvml_calls`).
    pub nvml_calls: u64,
    /// Per function, in ID order.
    pub functions: Vec<NvmlFuncStatus>,
}

fn decode(w: u64, gpu: Option<u32>) -> Option<NvmlInjection> {
    let left = w >> LEFT_SHIFT;
    (left != 0).then(|| NvmlInjection {
        gpu,
        code: (w & 0xffff) as u32,
        left: (left != FOREVER).then_some(left as u32),
        data_call_only: w & DATA_ONLY != 0,
    })
}

/// Takes one answer from `slot` if it applies to this call.
fn take(slot: &AtomicU64, data_call: bool) -> Option<u32> {
    let mut w = slot.load(Acquire);
    loop {
        let left = w >> LEFT_SHIFT;
        if left == 0 || (w & DATA_ONLY != 0 && !data_call) {
            return None;
        }
        if left == FOREVER {
            return Some((w & 0xffff) as u32);
        }
        match slot.compare_exchange_weak(w, w - (1 << LEFT_SHIFT), AcqRel, Acquire) {
            Ok(_) => return Some((w & 0xffff) as u32),
            Err(now) => w = now,
        }
    }
}

fn wait_while_hung(f: &FuncState, cap: Duration) {
    if f.hang.load(Acquire) == 0 {
        return;
    }
    f.hung.fetch_add(1, AcqRel);
    let end = Instant::now() + cap;
    loop {
        let h = f.hang.load(Acquire);
        let now = Instant::now();
        if h == 0 || now >= end {
            break;
        }
        // Woken by nvml_hang(false); the timeout bounds a missed wake-up and the cap.
        let left = (end - now).min(Duration::from_millis(50));
        futex_wait(&f.hang, h, left.as_nanos() as u64);
    }
    f.hung.fetch_sub(1, AcqRel);
}

impl SimGpu {
    fn nvml(&self) -> &NvmlState {
        &self.header().nvml
    }

    fn nvml_func(&self, func: NvmlFunc) -> &FuncState {
        &self.nvml().funcs[func as usize]
    }

    /// Answer `code` (an `nvmlReturn_t`, not 0) for the next `count` calls of `func`
    /// (`count` 0: until cleared), on GPU `gpu` only or on every GPU (`None`). With
    /// `data_call_only`, only the data call of a two-step function (non-null buffer) is
    /// answered so; its count call is served normally and does not use up the count.
    /// `INSUFFICIENT_SIZE` on a data call also writes the needed count, as the driver does.
    /// Replaces an earlier injection for the same function and GPU (or all GPUs).
    pub fn nvml_inject(
        &self,
        func: NvmlFunc,
        gpu: Option<u32>,
        code: u32,
        count: u32,
        data_call_only: bool,
    ) -> Result<()> {
        if code == 0 || code > 0xffff {
            bail!("nvmlReturn_t {code}: inject an error code (1..=65535; 0 is success)");
        }
        if count == u32::MAX {
            bail!("count {count}: too large (0 means until cleared)");
        }
        if data_call_only && !func.two_step() {
            bail!("{func} is not a two-step function: it has no separate data call");
        }
        let slot = match gpu {
            None => 0,
            Some(_) if !func.per_gpu() => bail!("{func} names no GPU: inject for all GPUs"),
            Some(g) if g >= self.n_gpus() => {
                bail!(
                    "GPU {g} does not exist: the simulated node has {} GPU(s)",
                    self.n_gpus()
                )
            }
            Some(g) => g as usize + 1,
        };
        let left = if count == 0 { FOREVER } else { count as u64 };
        let w = code as u64 | if data_call_only { DATA_ONLY } else { 0 } | left << LEFT_SHIFT;
        self.nvml_func(func).inject[slot].store(w, Release);
        Ok(())
    }

    /// Removes every injection of `func` (all GPUs).
    pub fn nvml_uninject(&self, func: NvmlFunc) {
        for s in &self.nvml_func(func).inject {
            s.store(0, Release);
        }
    }

    /// Every call of `func` sleeps `delay` first (`Duration::ZERO`: no delay).
    pub fn nvml_delay(&self, func: NvmlFunc, delay: Duration) {
        let us = u64::try_from(delay.as_micros()).unwrap_or(u64::MAX);
        self.nvml_func(func).delay_us.store(us, Release);
    }

    /// `on`: calls of `func` block (from now on, and calls already blocked stay blocked)
    /// until `nvml_hang(func, false)` or [`HANG_CAP`], then go on normally.
    pub fn nvml_hang(&self, func: NvmlFunc, on: bool) {
        let f = self.nvml_func(func);
        f.hang.store(u32::from(on), Release);
        if !on {
            futex_wake(&f.hang);
        }
    }

    /// `on`: the library is gone: every call, `nvmlInit` included, answers
    /// `NVML_ERROR_DRIVER_NOT_LOADED` until `nvml_gone(false)`.
    pub fn nvml_gone(&self, on: bool) {
        self.nvml_gone_code(if on { NVML_ERROR_DRIVER_NOT_LOADED } else { 0 });
    }

    /// As [`SimGpu::nvml_gone`], answering `code` instead (0: not gone), e.g. 12
    /// (`LIBRARY_NOT_FOUND`) or 15 (`GPU_IS_LOST`).
    pub fn nvml_gone_code(&self, code: u32) {
        self.nvml().gone.store(code, Release);
    }

    /// Clears every NVML fault: injections, delays, hangs (waking blocked calls), gone,
    /// and the legacy `nvml_fail` switch. Counters are kept.
    pub fn nvml_clear(&self) {
        self.nvml_gone(false);
        self.header().nvml_fail.store(0, Release);
        for func in NvmlFunc::ALL {
            self.nvml_uninject(func);
            self.nvml_delay(func, Duration::ZERO);
            self.nvml_hang(func, false);
        }
    }

    /// Calls of `func` made so far (faulted ones included).
    pub fn nvml_call_count(&self, func: NvmlFunc) -> u64 {
        self.nvml_func(func).calls.load(Acquire)
    }

    /// Calls of `func` answered with an injected code so far.
    pub fn nvml_injected_count(&self, func: NvmlFunc) -> u64 {
        self.nvml_func(func).injected.load(Acquire)
    }

    /// Calls of `func` in progress now (inside the fake library).
    pub fn nvml_in_flight(&self, func: NvmlFunc) -> u32 {
        self.nvml_func(func).in_flight.load(Acquire)
    }

    /// Calls of `func` blocked in a hang now.
    pub fn nvml_hung_count(&self, func: NvmlFunc) -> u32 {
        self.nvml_func(func).hung.load(Acquire)
    }

    /// Everything, for display.
    pub fn nvml_status(&self) -> NvmlStatus {
        let gone = self.nvml().gone.load(Acquire);
        NvmlStatus {
            gone: (gone != 0).then_some(gone),
            fail: self.header().nvml_fail.load(Acquire) != 0,
            nvml_calls: self.header().nvml_calls.load(Acquire),
            functions: NvmlFunc::ALL
                .iter()
                .map(|&func| {
                    let f = self.nvml_func(func);
                    NvmlFuncStatus {
                        id: func.id(),
                        name: func.c_name(),
                        calls: f.calls.load(Acquire),
                        injected: f.injected.load(Acquire),
                        in_flight: f.in_flight.load(Acquire),
                        hung: f.hung.load(Acquire),
                        hang: f.hang.load(Acquire) != 0,
                        delay_us: f.delay_us.load(Acquire),
                        injections: f
                            .inject
                            .iter()
                            .enumerate()
                            .filter_map(|(i, w)| {
                                decode(w.load(Acquire), i.checked_sub(1).map(|g| g as u32))
                            })
                            .collect(),
                    }
                })
                .collect(),
        }
    }

    /// For the fake library, at the start of each call of `func` (on GPU `gpu` when the
    /// call names a valid one; `data_call`: a two-step function's call with a buffer):
    /// counts it, waits while hung, sleeps the delay, and says which code to answer
    /// instead of serving it (gone, then an injection for this GPU, then one for all).
    pub fn nvml_enter(&self, func: NvmlFunc, gpu: Option<u32>, data_call: bool) -> NvmlCall<'_> {
        self.nvml_enter_capped(func, gpu, data_call, HANG_CAP)
    }

    fn nvml_enter_capped(
        &self,
        func: NvmlFunc,
        gpu: Option<u32>,
        data_call: bool,
        cap: Duration,
    ) -> NvmlCall<'_> {
        let f = self.nvml_func(func);
        f.calls.fetch_add(1, AcqRel);
        f.in_flight.fetch_add(1, AcqRel);
        let mut call = NvmlCall { f, fault: None };
        wait_while_hung(f, cap);
        let delay = f.delay_us.load(Acquire);
        if delay > 0 {
            std::thread::sleep(Duration::from_micros(delay));
        }
        let gone = self.nvml().gone.load(Acquire);
        if gone != 0 {
            call.fault = Some(gone);
            return call;
        }
        let per_gpu = gpu
            .filter(|&g| g < MAX_GPUS)
            .and_then(|g| take(&f.inject[g as usize + 1], data_call));
        call.fault = per_gpu.or_else(|| take(&f.inject[0], data_call));
        if call.fault.is_some() {
            f.injected.fetch_add(1, AcqRel);
        }
        call
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A simulated GPU in a scratch file, removed when the guard drops (passing or
    /// failing).
    fn sim(name: &str) -> (SimGpu, tempfile::TempPath) {
        let p = tempfile::Builder::new()
            .prefix(&format!("coloc-sim-nvml-{name}-"))
            .tempfile()
            .unwrap()
            .into_temp_path();
        (SimGpu::create(&p, 2, 1_000_000).unwrap(), p)
    }

    #[test]
    fn names_parse() {
        for f in NvmlFunc::ALL {
            assert_eq!(f.c_name().parse::<NvmlFunc>(), Ok(f));
            assert_eq!(f.short_name().parse::<NvmlFunc>(), Ok(f));
            assert_eq!(f.id().to_string().parse::<NvmlFunc>(), Ok(f));
            assert_eq!(format!("{f:?}").parse::<NvmlFunc>(), Ok(f));
            assert_eq!(NvmlFunc::from_id(f.id()), Some(f));
        }
        assert_eq!("nvmlDeviceGetCount".parse(), Ok(NvmlFunc::DeviceGetCount));
        assert_eq!("nvmlInitWithFlags".parse(), Ok(NvmlFunc::Init));
        assert!("nvmlDeviceGetFoo".parse::<NvmlFunc>().is_err());
        assert!("11".parse::<NvmlFunc>().is_err());
        assert_eq!(parse_nvml_return("NVML_ERROR_INSUFFICIENT_SIZE"), Ok(7));
        assert_eq!(parse_nvml_return("gpu-is-lost"), Ok(15));
        assert_eq!(parse_nvml_return("999"), Ok(999));
        assert!(parse_nvml_return("BOGUS").is_err());
        assert_eq!(nvml_return_name(9), Some("DRIVER_NOT_LOADED"));
    }

    #[test]
    fn injection_counts_down_and_status_reports_it() {
        let (s, _path) = sim("inject");
        let uuid = NvmlFunc::DeviceGetUUID;
        s.nvml_inject(uuid, Some(1), 15, 2, false).unwrap();
        s.nvml_inject(uuid, None, 10, 1, false).unwrap();
        let st = s.nvml_status();
        let injections = &st.functions[uuid as usize].injections;
        assert_eq!(injections.len(), 2, "{st:?}");
        assert_eq!(injections[1].left, Some(2));
        // GPU 1: its own injection first, then the one for all GPUs, then none.
        let seq: Vec<_> = (0..4)
            .map(|_| s.nvml_enter(uuid, Some(1), false).fault)
            .collect();
        assert_eq!(seq, [Some(15), Some(15), Some(10), None]);
        assert_eq!(s.nvml_call_count(uuid), 4);
        assert_eq!(s.nvml_injected_count(uuid), 3);
        assert_eq!(s.nvml_in_flight(uuid), 0);
        // Validation.
        assert!(s.nvml_inject(uuid, None, 0, 1, false).is_err());
        assert!(s.nvml_inject(uuid, Some(2), 7, 1, false).is_err());
        assert!(s.nvml_inject(uuid, None, 7, 1, true).is_err());
        assert!(s
            .nvml_inject(NvmlFunc::DeviceGetCount, Some(0), 7, 1, false)
            .is_err());
    }

    #[test]
    fn hang_is_capped() {
        let (s, _path) = sim("cap");
        s.nvml_hang(NvmlFunc::DeviceGetCount, true);
        let t = Instant::now();
        let call = s.nvml_enter_capped(
            NvmlFunc::DeviceGetCount,
            None,
            false,
            Duration::from_millis(100),
        );
        assert!(t.elapsed() >= Duration::from_millis(100));
        assert!(t.elapsed() < Duration::from_secs(10));
        assert_eq!(call.fault, None);
        assert_eq!(s.nvml_hung_count(NvmlFunc::DeviceGetCount), 0);
    }
}
