//! The shim's own driver calls on events and contexts: in a given context, and with the
//! thread's stream-capture mode relaxed while it queries or waits.

use super::CUDA_SUCCESS;
use crate::driver::gate_fns;
use std::ffi::{c_int, c_uint};

const CUDA_ERROR_NOT_READY: c_int = 600;

/// `CU_STREAM_CAPTURE_MODE_RELAXED`.
const CAPTURE_MODE_RELAXED: c_int = 2;

/// `CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING`.
const EVENT_FLAGS: c_uint = 0x1 | 0x2;

/// Runs `f` with `ctx` current on the calling thread (pushed, then popped).
pub(super) fn with_ctx<T>(ctx: usize, f: impl FnOnce() -> T) -> T {
    let cur = crate::driver::current_ctx();
    if ctx == 0 || cur == ctx {
        return f();
    }
    let fns = gate_fns();
    // SAFETY: the driver's push/pop with a context handle of this process.
    let pushed = unsafe { (fns.ctx_push)(ctx) } == CUDA_SUCCESS;
    let r = f();
    if pushed {
        let mut popped = 0usize;
        // SAFETY: pops what we pushed; valid out-pointer.
        unsafe { (fns.ctx_pop)(&mut popped as *mut usize as usize) };
    }
    r
}

/// Runs `f` (the shim's own event query or wait) with the calling thread's stream-capture
/// mode RELAXED, then restores the thread's mode, as PyTorch's
/// `CUDAStreamCaptureModeGuard` does: while another thread captures a stream in mode
/// GLOBAL (PyTorch's default), a query or wait from a thread in another mode fails with
/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and invalidates that capture. Our events are
/// never recorded on a capturing stream ([`capturing`]), so the wait itself is legal.
/// Only while some capture is in progress ([`crate::driver::CAPTURES`], counted up before
/// the driver's `cuStreamBeginCapture` is called): a capture begun through an entry point
/// the shim does not wrap, or one that begins on another thread between this check and
/// the query, is not relaxed for.
pub(super) fn relaxed<T>(f: impl FnOnce() -> T) -> T {
    let Some(exchange) = gate_fns().exchange_capture_mode else {
        return f();
    };
    // No capture in progress (counted from before its beginning): nothing to relax, and
    // no driver call for it.
    if crate::driver::CAPTURES.load(std::sync::atomic::Ordering::SeqCst) <= 0 {
        return f();
    }
    let mut mode = CAPTURE_MODE_RELAXED;
    // SAFETY: the driver's cuThreadExchangeStreamCaptureMode with a valid in/out pointer.
    let swapped = unsafe { exchange(&mut mode as *mut c_int as usize) } == CUDA_SUCCESS;
    let r = f();
    if swapped {
        // SAFETY: as above; puts back the mode the thread had.
        unsafe { exchange(&mut mode as *mut c_int as usize) };
    }
    r
}

/// Waits for event `e` (an error, e.g. a destroyed context, counts as complete).
pub(super) fn sync_event(e: usize) {
    // SAFETY: the driver's cuEventSynchronize on an event of ours.
    relaxed(|| unsafe { (gate_fns().event_sync)(e) });
}

/// Waits for everything of the current context (`cuCtxSynchronize`); the driver's answer.
pub(super) fn sync_ctx() -> c_int {
    // SAFETY: the driver's cuCtxSynchronize (no arguments: the current context's ABI).
    relaxed(|| unsafe { (gate_fns().ctx_sync)() })
}

pub(super) fn event_done(e: usize) -> bool {
    // SAFETY: the driver's cuEventQuery on an event of ours.
    relaxed(|| unsafe { (gate_fns().event_query)(e) }) != CUDA_ERROR_NOT_READY
}

pub(super) fn create_event(ctx: usize) -> Option<usize> {
    let mut e = 0usize;
    // SAFETY: the driver's cuEventCreate with a valid out-pointer, in the ring's context.
    let r = with_ctx(ctx, || unsafe {
        (gate_fns().event_create)(&mut e as *mut usize as usize, EVENT_FLAGS as usize)
    });
    (r == CUDA_SUCCESS && e != 0).then_some(e)
}
