//! The exported submission entry points, watched entry points and getters, for programs
//! linked against `libcuda` directly (and lookups through `RTLD_DEFAULT`): each finds the
//! driver's symbol of its name once and dispatches as a slot does.

use super::{after_get, is_ours, CUDA_SUCCESS};
use crate::launch::{kind_of, Fwd};
use crate::mode;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering::*};

/// `CUDA_ERROR_NOT_FOUND`.
const CUDA_ERROR_NOT_FOUND: c_int = 500;

type Getter =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> c_int;

/// The symbol `name` an exported wrapper forwards to: the next definition after us
/// (another interposer's, or the driver's), or the one in an already loaded
/// `libcuda.so.1`.
fn resolve_next(name: &CStr) -> usize {
    let p = crate::dl::real_dlsym(libc::RTLD_NEXT, name);
    if !p.is_null() {
        return p as usize;
    }
    // SAFETY: dlopen with RTLD_NOLOAD only returns a handle to an already loaded library.
    let h = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if h.is_null() {
        return 0;
    }
    let p = crate::dl::real_dlsym(h, name) as usize;
    // SAFETY: balances the dlopen above (the library stays loaded: RTLD_NOLOAD).
    unsafe { libc::dlclose(h) };
    if is_ours(p) {
        0
    } else {
        p
    }
}

macro_rules! exported_launch {
    ($($name:ident)*) => { $(
        /// Exported submission entry point: rings the doorbell, then calls the driver's.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            a0: usize, a1: usize, a2: usize, a3: usize, a4: usize, a5: usize,
            a6: usize, a7: usize, a8: usize, a9: usize, a10: usize, a11: usize,
        ) -> c_int {
            static REAL: AtomicUsize = AtomicUsize::new(0);
            static KIND: AtomicU32 = AtomicU32::new(0);
            // Acquire: a thread that sees the pointer sees its kind.
            let mut f = REAL.load(Acquire);
            if f == 0 {
                let cname = CStr::from_bytes_with_nul(concat!(stringify!($name), "\0").as_bytes());
                f = cname.map_or(0, resolve_next);
                if f == 0 {
                    return CUDA_ERROR_NOT_FOUND;
                }
                KIND.store(kind_of(stringify!($name), false), Relaxed);
                REAL.store(f, Release);
            }
            // The driver's own entry point of the same name, same arguments.
            dispatch!(f, KIND, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11)
        }
    )* };
}

exported_launch!(
    cuLaunchKernel cuLaunchKernel_ptsz cuLaunchKernelEx cuLaunchKernelEx_ptsz
    cuLaunchCooperativeKernel cuLaunchCooperativeKernel_ptsz cuLaunchCooperativeKernelMultiDevice
    cuLaunchHostFunc cuLaunchHostFunc_ptsz cuGraphLaunch cuGraphLaunch_ptsz
    cuMemcpyAsync cuMemcpyAsync_ptsz
    cuMemcpyHtoDAsync_v2 cuMemcpyHtoDAsync_v2_ptsz cuMemcpyDtoHAsync_v2 cuMemcpyDtoHAsync_v2_ptsz
    cuMemcpyDtoDAsync_v2 cuMemcpyDtoDAsync_v2_ptsz cuMemcpyPeerAsync cuMemcpyPeerAsync_ptsz
    cuMemcpy2DAsync_v2 cuMemcpy2DAsync_v2_ptsz cuMemcpy3DAsync_v2 cuMemcpy3DAsync_v2_ptsz
    cuMemcpy3DPeerAsync cuMemcpy3DPeerAsync_ptsz
    cuMemsetD8Async cuMemsetD8Async_ptsz cuMemsetD16Async cuMemsetD16Async_ptsz
    cuMemsetD32Async cuMemsetD32Async_ptsz
);

macro_rules! exported_watch {
    ($($name:ident)*) => { $(
        /// Exported watched entry point (`crate::watch`): completion stamps online, then
        /// the driver's.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            a0: usize, a1: usize, a2: usize, a3: usize, a4: usize, a5: usize,
            a6: usize, a7: usize, a8: usize, a9: usize, a10: usize, a11: usize,
        ) -> c_int {
            static REAL: AtomicUsize = AtomicUsize::new(0);
            static KIND: AtomicU32 = AtomicU32::new(0);
            // Acquire: a thread that sees the pointer sees its kind.
            let mut f = REAL.load(Acquire);
            if f == 0 {
                let cname = CStr::from_bytes_with_nul(concat!(stringify!($name), "\0").as_bytes());
                f = cname.map_or(0, resolve_next);
                if f == 0 {
                    return CUDA_ERROR_NOT_FOUND;
                }
                KIND.store(crate::watch::kind_of(stringify!($name), false), Relaxed);
                REAL.store(f, Release);
            }
            // The driver's own entry point of the same name, same arguments.
            observe!(f, KIND, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11)
        }
    )* };
}

// Entry points every driver since CUDA 7.0 has (`cuEventRecordWithFlags`, 11.1, and
// `cuCtxSynchronize_v2` are wrapped only when asked of a getter or of `dlsym` on the
// driver's handle, as the batched copies are).
exported_watch!(
    cuStreamSynchronize cuStreamSynchronize_ptsz cuStreamQuery cuStreamQuery_ptsz
    cuCtxSynchronize cuEventSynchronize cuEventQuery cuEventRecord cuEventRecord_ptsz
    cuEventCreate cuEventDestroy_v2
    cuMemcpyDtoH_v2 cuMemcpyDtoH_v2_ptds cuMemcpyAtoH_v2 cuMemcpyAtoH_v2_ptds
    cuMemcpy cuMemcpy_ptds cuMemcpyHtoD_v2 cuMemcpyHtoD_v2_ptds cuMemcpyDtoD_v2 cuMemcpyDtoD_v2_ptds
    cuMemcpyHtoA_v2 cuMemcpyHtoA_v2_ptds cuMemcpyAtoD_v2 cuMemcpyAtoD_v2_ptds
    cuMemcpyDtoA_v2 cuMemcpyDtoA_v2_ptds cuMemcpyAtoA_v2 cuMemcpyAtoA_v2_ptds
    cuMemcpy2D_v2 cuMemcpy2D_v2_ptds cuMemcpy2DUnaligned_v2 cuMemcpy2DUnaligned_v2_ptds
    cuMemcpy3D_v2 cuMemcpy3D_v2_ptds cuMemcpyPeer cuMemcpyPeer_ptds cuMemcpy3DPeer cuMemcpy3DPeer_ptds
    cuMemsetD8_v2 cuMemsetD8_v2_ptds cuMemsetD16_v2 cuMemsetD16_v2_ptds cuMemsetD32_v2 cuMemsetD32_v2_ptds
    cuMemsetD2D8_v2 cuMemsetD2D8_v2_ptds cuMemsetD2D16_v2 cuMemsetD2D16_v2_ptds
    cuMemsetD2D32_v2 cuMemsetD2D32_v2_ptds
    cuCtxSetCurrent cuCtxPushCurrent_v2 cuCtxPopCurrent_v2 cuCtxCreate_v2 cuCtxDestroy_v2
    cuDevicePrimaryCtxRelease_v2 cuDevicePrimaryCtxReset_v2
    cuStreamBeginCapture_v2 cuStreamBeginCapture_v2_ptsz cuStreamEndCapture cuStreamEndCapture_ptsz
);

macro_rules! exported_getter {
    ($($name:ident)*) => { $(
        /// Exported getter: the driver's answer, with our wrappers for the launch entry points.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            sym: *const c_char, pfn: *mut *mut c_void, ver: c_int, flags: u64, status: *mut c_int,
        ) -> c_int {
            static REAL: AtomicUsize = AtomicUsize::new(0);
            let mut f = REAL.load(Relaxed);
            if f == 0 {
                let cname = CStr::from_bytes_with_nul(concat!(stringify!($name), "\0").as_bytes());
                f = cname.map_or(0, resolve_next);
                if f == 0 {
                    return CUDA_ERROR_NOT_FOUND;
                }
                crate::driver::ANY_GETTER.store(f, Release);
                REAL.store(f, Relaxed);
            }
            // SAFETY: the driver's getter with the caller's arguments.
            let r = unsafe { std::mem::transmute::<usize, Getter>(f)(sym, pfn, ver, flags, status) };
            if r == CUDA_SUCCESS && !sym.is_null() && !pfn.is_null() {
                // SAFETY: as in `getter`.
                unsafe { after_get(sym, pfn, ver, flags) };
            }
            r
        }
    )* };
}

exported_getter!(cuGetProcAddress cuGetProcAddress_v2);
