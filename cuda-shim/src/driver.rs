//! The driver's own functions that the shim calls itself (never the application's
//! pointers, never the shim's wrappers): found through the getter the process was seen
//! to use, or in the loaded `libcuda.so.1`.
//!
//! - For every mode: `cuCtxGetCurrent`, `cuCtxGetDevice`, `cuDeviceGetUuid[_v2]` (which
//!   GPU a submission targets) and, optionally, `cuStreamIsCapturing` ([`resolve_helpers`]).
//! - For the launch gate: streams, contexts and events ([`GateFns`]).

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::OnceLock;

/// A real getter (`cuGetProcAddress[_v2]`) seen so far (set by [`crate::hooks`]).
pub static ANY_GETTER: AtomicUsize = AtomicUsize::new(0);

type Getter =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> c_int;

/// A driver function by base name through the getter we saw (`cudaVersion` 12000, default
/// stream semantics), or else `exported` from the loaded `libcuda.so.1`. Never one of our
/// wrappers: the getter is the driver's own, and the names asked for are not wrapped.
pub fn lookup(base: &CStr, exported: &CStr) -> usize {
    let g = ANY_GETTER.load(Acquire);
    if g != 0 {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: the driver's own getter; a null status pointer is allowed.
        let r = unsafe {
            std::mem::transmute::<usize, Getter>(g)(
                base.as_ptr(),
                &mut p,
                12000,
                0,
                std::ptr::null_mut(),
            )
        };
        if r == 0 && !p.is_null() {
            return p as usize;
        }
    }
    // SAFETY: RTLD_NOLOAD only returns an already loaded library.
    let h = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    let h = if h.is_null() { libc::RTLD_NEXT } else { h };
    crate::dl::real_dlsym(h, exported) as usize
}

type CtxGetCurrent = unsafe extern "C" fn(*mut usize) -> c_int;
type CtxGetDevice = unsafe extern "C" fn(*mut c_int) -> c_int;
type DeviceGetUuid = unsafe extern "C" fn(*mut [u8; 16], c_int) -> c_int;

static CTX_GET_CURRENT: AtomicUsize = AtomicUsize::new(0);
static CTX_GET_DEVICE: AtomicUsize = AtomicUsize::new(0);
static DEVICE_GET_UUID: AtomicUsize = AtomicUsize::new(0);
/// The driver's `cuStreamIsCapturing` (0: none).
pub static STREAM_IS_CAPTURING: AtomicUsize = AtomicUsize::new(0);

/// Finds the helper functions every mode needs; false if one is missing.
pub fn resolve_helpers() -> bool {
    let cur = lookup(c"cuCtxGetCurrent", c"cuCtxGetCurrent");
    let dev = lookup(c"cuCtxGetDevice", c"cuCtxGetDevice");
    let mut uuid = lookup(c"cuDeviceGetUuid", c"cuDeviceGetUuid_v2");
    if uuid == 0 {
        uuid = lookup(c"cuDeviceGetUuid", c"cuDeviceGetUuid");
    }
    // Optional (CUDA 10.0): without it nothing counts as captured.
    STREAM_IS_CAPTURING.store(
        lookup(c"cuStreamIsCapturing", c"cuStreamIsCapturing"),
        Relaxed,
    );
    CTX_GET_CURRENT.store(cur, Relaxed);
    CTX_GET_DEVICE.store(dev, Relaxed);
    DEVICE_GET_UUID.store(uuid, Relaxed);
    cur != 0 && dev != 0 && uuid != 0
}

/// Bumped after every call that may change some thread's current context
/// (`cuCtxSetCurrent`, `…PushCurrent`, `…PopCurrent`, `…Create`, `…Destroy`,
/// `cuDevicePrimaryCtxRelease`, `…Reset`: [`crate::watch::W_CTX_SWITCH`]): a thread's cached
/// context is good while this has not moved.
pub static CTX_GEN: AtomicU64 = AtomicU64::new(1);

/// Off once a thread's context was seen to change without a call the shim saw (a driver
/// reached by another path): every [`current_ctx`] asks the driver from then on.
static CTX_CACHE_ON: AtomicBool = AtomicBool::new(true);

/// A cached context is checked against the driver's answer once per this many uses: a
/// change the shim did not see is found within this many submissions.
pub const CTX_CHECK_EVERY: u32 = 256;

thread_local! {
    /// (CTX_GEN when asked, the context then, uses left before the next check).
    static CTX_CACHE: Cell<(u64, usize, u32)> = const { Cell::new((0, 0, 0)) };
}

/// The calling thread's current context (0: none, or the driver failed): cached per
/// thread while no call that can change a context was made ([`CTX_GEN`]), so that the
/// steady state makes no driver call for it; checked against the driver every
/// [`CTX_CHECK_EVERY`] uses.
#[inline]
pub fn current_ctx() -> usize {
    let gen = CTX_GEN.load(Acquire);
    if let Ok((g, c, left)) = CTX_CACHE.try_with(|x| x.get()) {
        if g == gen && c != 0 && left > 0 && CTX_CACHE_ON.load(Relaxed) {
            let _ = CTX_CACHE.try_with(|x| x.set((g, c, left - 1)));
            return c;
        }
        let now = ask_current_ctx();
        if g == gen && c != 0 && now != c {
            static WARNED: AtomicBool = AtomicBool::new(false);
            CTX_CACHE_ON.store(false, Relaxed);
            crate::mode::warn_once(
                &WARNED,
                "a thread's CUDA context changed through a call the shim did not see: the \
                 context is asked of the driver at every submission from now on",
            );
        }
        if now != 0 {
            let _ = CTX_CACHE.try_with(|x| x.set((gen, now, CTX_CHECK_EVERY)));
        }
        return now;
    }
    ask_current_ctx()
}

/// The driver's `cuCtxGetCurrent` (0: none, or the driver failed).
fn ask_current_ctx() -> usize {
    let mut ctx = 0usize;
    // SAFETY: the driver's cuCtxGetCurrent (resolved before any mode that calls this is
    // set) with a valid out-pointer.
    let r = unsafe {
        std::mem::transmute::<usize, CtxGetCurrent>(CTX_GET_CURRENT.load(Relaxed))(&mut ctx)
    };
    if r != 0 {
        0
    } else {
        ctx
    }
}

/// Stream captures in progress in this process (begun through a call the shim saw and
/// not yet ended: [`crate::watch::W_CAPTURE_BEGIN`], [`crate::watch::W_CAPTURE_END`]).
/// Counted up before the driver's call, so a submission that reads 0 made its check
/// before any capture of ours began.
pub static CAPTURES: AtomicI64 = AtomicI64::new(0);

/// The current context's GPU UUID.
pub fn current_uuid() -> Option<[u8; 16]> {
    let mut dev: c_int = 0;
    let mut uuid = [0u8; 16];
    // SAFETY: the driver's functions with valid out-pointers (resolved before any mode
    // that calls this is set).
    unsafe {
        if std::mem::transmute::<usize, CtxGetDevice>(CTX_GET_DEVICE.load(Relaxed))(&mut dev) != 0 {
            return None;
        }
        if std::mem::transmute::<usize, DeviceGetUuid>(DEVICE_GET_UUID.load(Relaxed))(
            &mut uuid, dev,
        ) != 0
        {
            return None;
        }
    }
    Some(uuid)
}

/// No argument, a `CUresult` out.
pub type Fn0 = unsafe extern "C" fn() -> c_int;
/// One machine word in, a `CUresult` out.
pub type Fn1 = unsafe extern "C" fn(usize) -> c_int;
/// Two machine words in, a `CUresult` out.
pub type Fn2 = unsafe extern "C" fn(usize, usize) -> c_int;

/// Driver entry points the launch gate uses.
#[derive(Debug)]
pub struct GateFns {
    /// `cuStreamGetCtx`.
    pub stream_get_ctx: Fn2,
    /// `cuCtxPushCurrent_v2`.
    pub ctx_push: Fn1,
    /// `cuCtxPopCurrent_v2`.
    pub ctx_pop: Fn1,
    /// `cuEventCreate`.
    pub event_create: Fn2,
    /// `cuEventRecord`.
    pub event_record: Fn2,
    /// `cuEventQuery`.
    pub event_query: Fn1,
    /// `cuEventSynchronize`.
    pub event_sync: Fn1,
    /// `cuEventDestroy_v2`.
    pub event_destroy: Fn1,
    /// `cuCtxSynchronize` (the ABI without a context argument).
    pub ctx_sync: Fn0,
    /// `cuThreadExchangeStreamCaptureMode` (CUDA 10.1; `None`: no capture modes).
    pub exchange_capture_mode: Option<Fn1>,
}

static GATE_FNS: OnceLock<GateFns> = OnceLock::new();

/// The launch gate's driver functions (set by [`resolve_gate_fns`] before the mode can
/// become gated).
pub fn gate_fns() -> &'static GateFns {
    GATE_FNS.get().expect("gate configured")
}

/// Sets the launch gate's driver functions to stand-ins (unit tests of the gate's
/// bookkeeping; the first call wins).
#[cfg(test)]
pub fn set_gate_fns(f: GateFns) {
    let _ = GATE_FNS.set(f);
}

/// Finds the launch gate's driver functions; an error is the line to print.
pub fn resolve_gate_fns() -> Result<(), String> {
    let get = |base: &CStr, exported: &CStr| -> Result<usize, String> {
        match lookup(base, exported) {
            0 => Err(format!(
                "cannot find {} in the driver",
                base.to_string_lossy()
            )),
            p => Ok(p),
        }
    };
    let f1 = |base: &CStr, exported: &CStr| {
        // SAFETY: the driver's entry point of that name, whose C signature (cuda.h) takes
        // one handle or pointer.
        get(base, exported).map(|p| unsafe { std::mem::transmute::<usize, Fn1>(p) })
    };
    let f2 = |base: &CStr, exported: &CStr| {
        // SAFETY: as above, with two handles, pointers or `unsigned int`s: one machine
        // word each.
        get(base, exported).map(|p| unsafe { std::mem::transmute::<usize, Fn2>(p) })
    };
    let f = GateFns {
        stream_get_ctx: f2(c"cuStreamGetCtx", c"cuStreamGetCtx")?,
        ctx_push: f1(c"cuCtxPushCurrent", c"cuCtxPushCurrent_v2")?,
        ctx_pop: f1(c"cuCtxPopCurrent", c"cuCtxPopCurrent_v2")?,
        event_create: f2(c"cuEventCreate", c"cuEventCreate")?,
        event_record: f2(c"cuEventRecord", c"cuEventRecord")?,
        event_query: f1(c"cuEventQuery", c"cuEventQuery")?,
        event_sync: f1(c"cuEventSynchronize", c"cuEventSynchronize")?,
        event_destroy: f1(c"cuEventDestroy", c"cuEventDestroy_v2")?,
        // SAFETY: `cuCtxSynchronize` asked for at version 12000 (`lookup`), the ABI
        // without arguments.
        ctx_sync: get(c"cuCtxSynchronize", c"cuCtxSynchronize")
            .map(|p| unsafe { std::mem::transmute::<usize, Fn0>(p) })?,
        exchange_capture_mode: f1(
            c"cuThreadExchangeStreamCaptureMode",
            c"cuThreadExchangeStreamCaptureMode",
        )
        .ok(),
    };
    let _ = GATE_FNS.set(f);
    Ok(())
}
