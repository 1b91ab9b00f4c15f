//! # libcoloc_cuda.so — the gpu-coloc CUDA driver-API shim
//!
//! Loaded with `LD_PRELOAD` into a GPU process. In an **online** process
//! (`COLOC_SHIM_CLASS=online`) it is a doorbell: every submission of GPU work stamps its
//! time for the GPU it targets in a one-page shared file (`coloc-doorbell`), and the
//! first submission after a pause wakes the node agent. Every other call, and every call
//! in a process of any other class, passes straight through.
//!
//! ```text
//!  libcudart / cuBLAS / Triton / NCCL
//!     │ dlopen("libcuda.so.1"); dlsym(h, "cuGetProcAddress_v2")
//!     ▼
//!  dlsym (ours, naked) ── a cu* name we wrap? ──► our wrapper (real pointer kept)
//!     │ otherwise: tail-jump to glibc's dlsym (the caller's RTLD_NEXT stays the caller's)
//!  cuGetProcAddress[_v2] (ours) ── launch entry point? ──► a forwarding slot
//!     │ anything else: the driver's pointer, untouched
//!  slot N: ring the doorbell (online only), then call the driver's pointer for slot N
//! ```
//!
//! - **How the CUDA 12 runtime is caught**: it looks up `cuGetProcAddress_v2` with `dlsym`
//!   on its own handle of `libcuda.so.1`, which `LD_PRELOAD` alone never sees, and then asks
//!   that getter for every entry point by base name. [`dl`] interposes `dlsym`; [`hooks`]
//!   wraps the getters (both versions, and themselves when asked for) and hands out a
//!   forwarding slot per real launch pointer, so every variant (`_ptsz`, old ABIs) calls
//!   exactly the pointer the driver returned for it. Programs linked against `libcuda`
//!   directly reach the exported launch symbols instead.
//! - **Which GPU**: the current context's device, by UUID (`cuCtxGetCurrent` →
//!   `cuCtxGetDevice` → `cuDeviceGetUuid`), cached per thread and context, so
//!   `CUDA_VISIBLE_DEVICES` remapping does not matter.
//! - **Cost**: see `benches/RESULTS.md`. With no agent (no `COLOC_DOORBELL_DIR`, or the
//!   class is not `online`) a launch costs one load and one branch beyond the forwarding.
//! - **Never breaks its host process**: any internal failure turns the shim into a
//!   pass-through and prints one line on stderr; nothing panics across the C boundary.
//!
//! Environment: `COLOC_SHIM_CLASS` (`online`; anything else: pass-through),
//! `COLOC_DOORBELL_DIR` (where to create `<pid>-<nonce>.bell`), `COLOC_SHIM_WAKE_GAP_MS`
//! (a launch this long after the previous one on the same GPU wakes the agent; default 10).

#![allow(clippy::missing_safety_doc)]

mod bell;
mod dl;
mod gate;
mod hooks;

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

/// One line on stderr, at most once per reason kind, never panicking.
pub(crate) fn warn_once(flag: &AtomicBool, msg: &str) {
    if !flag.swap(true, Relaxed) {
        let line = format!("libcoloc_cuda: {msg}\n");
        // SAFETY: writing a valid buffer to fd 2; errors are ignored on purpose.
        unsafe {
            libc::write(2, line.as_ptr().cast(), line.len());
        }
    }
}
