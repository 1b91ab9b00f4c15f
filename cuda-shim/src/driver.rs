//! The driver's own functions that the shim calls itself (never the application's
//! pointers, never the shim's wrappers): found through the getter the process was seen
//! to use, or in the loaded `libcuda.so.1`.
//!
//! - For every mode: `cuCtxGetCurrent`, `cuCtxGetDevice`, `cuDeviceGetUuid[_v2]` (which
//!   GPU a submission targets) and, optionally, `cuStreamIsCapturing` ([`resolve_helpers`]).
//! - For the launch gate: streams, contexts and events ([`GateFns`]).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering::*};
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

/// The calling thread's current context (0: none, or the driver failed).
#[inline]
pub fn current_ctx() -> usize {
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
    /// `cuThreadExchangeStreamCaptureMode` (CUDA 10.1; `None`: no capture modes).
    pub exchange_capture_mode: Option<Fn1>,
}

static GATE_FNS: OnceLock<GateFns> = OnceLock::new();

/// The launch gate's driver functions (set by [`resolve_gate_fns`] before the mode can
/// become gated).
pub fn gate_fns() -> &'static GateFns {
    GATE_FNS.get().expect("gate configured")
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
        exchange_capture_mode: f1(
            c"cuThreadExchangeStreamCaptureMode",
            c"cuThreadExchangeStreamCaptureMode",
        )
        .ok(),
    };
    let _ = GATE_FNS.set(f);
    Ok(())
}
