//! What a submission entry point is: its names, where it takes its stream, whether stream 0
//! is the per-thread default stream, whether its stream is being captured into a CUDA
//! graph, and how to call it with the caller's arguments unchanged.
//!
//! Every submission entry point takes only integer and pointer arguments, so the shim
//! forwards twelve machine words unchanged ([`call`]): the callee reads the ones it has
//! (for the SysV and AAPCS64 ABIs alike) and the rest is never looked at.

use crate::driver::{Fn2, STREAM_IS_CAPTURING};
use std::ffi::c_int;
use std::sync::atomic::Ordering::*;

/// `CUDA_SUCCESS`.
const CUDA_SUCCESS: c_int = 0;
/// `CU_STREAM_LEGACY`.
pub const CU_STREAM_LEGACY: usize = 1;
/// `CU_STREAM_PER_THREAD`.
pub const CU_STREAM_PER_THREAD: usize = 2;
/// `CU_STREAM_CAPTURE_STATUS_NONE`.
const CAPTURE_STATUS_NONE: c_int = 0;

/// Base names of the entry points that submit GPU work.
pub const LAUNCH_BASES: &[&str] = &[
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cuLaunchCooperativeKernel",
    "cuLaunchCooperativeKernelMultiDevice",
    "cuLaunchHostFunc",
    "cuGraphLaunch",
    "cuMemcpyAsync",
    "cuMemcpyHtoDAsync",
    "cuMemcpyDtoHAsync",
    "cuMemcpyDtoDAsync",
    "cuMemcpyHtoAAsync",
    "cuMemcpyAtoHAsync",
    "cuMemcpyPeerAsync",
    "cuMemcpy2DAsync",
    "cuMemcpy3DAsync",
    "cuMemcpy3DPeerAsync",
    "cuMemsetD8Async",
    "cuMemsetD16Async",
    "cuMemsetD32Async",
    "cuMemsetD2D8Async",
    "cuMemsetD2D16Async",
    "cuMemsetD2D32Async",
    "cuMemcpyBatchAsync",
    "cuMemcpy3DBatchAsync",
];

/// Where a submission entry point takes its stream: argument `i` (0-based), as in
/// `cuda.h`; [`STREAM_IN_CONFIG`]: `cuLaunchKernelEx`'s `CUlaunchConfig::hStream`;
/// [`STREAM_NONE`]: `cuLaunchCooperativeKernelMultiDevice` (one stream per device, in its
/// parameter list: gated on the current context's GPU, its work not tracked).
const STREAM_ARG: &[(&str, u32)] = &[
    ("cuLaunchKernel", 8),
    ("cuLaunchKernelEx", STREAM_IN_CONFIG),
    ("cuLaunchCooperativeKernel", 8),
    ("cuLaunchCooperativeKernelMultiDevice", STREAM_NONE),
    ("cuLaunchHostFunc", 0),
    ("cuGraphLaunch", 1),
    ("cuMemcpyAsync", 3),
    ("cuMemcpyHtoDAsync", 3),
    ("cuMemcpyDtoHAsync", 3),
    ("cuMemcpyDtoDAsync", 3),
    ("cuMemcpyHtoAAsync", 4),
    ("cuMemcpyAtoHAsync", 4),
    ("cuMemcpyPeerAsync", 5),
    ("cuMemcpy2DAsync", 1),
    ("cuMemcpy3DAsync", 1),
    ("cuMemcpy3DPeerAsync", 1),
    ("cuMemsetD8Async", 3),
    ("cuMemsetD16Async", 3),
    ("cuMemsetD32Async", 3),
    ("cuMemsetD2D8Async", 5),
    ("cuMemsetD2D16Async", 5),
    ("cuMemsetD2D32Async", 5),
    // CUDA 12.8 ABI; the 13.0 ABI (`_v2`) drops `failIdx`: see [`NEW_ABI`].
    ("cuMemcpyBatchAsync", 8),
    ("cuMemcpy3DBatchAsync", 4),
];

/// Entry points whose stream moved in a newer ABI: (base name, CUDA version of the new
/// ABI, stream argument in it). A getter request at that version or later gets the new
/// ABI (as does the exported `…_v2` name); earlier requests the old one. The batched
/// copies lost their `failIdx` argument in CUDA 13.0:
/// `cuMemcpyBatchAsync_v2(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream)`,
/// `cuMemcpy3DBatchAsync_v2(numOps, opList, flags, stream)`.
pub const NEW_ABI: &[(&str, i32, u32)] = &[
    ("cuMemcpyBatchAsync", 13000, 7),
    ("cuMemcpy3DBatchAsync", 13000, 3),
];

/// Kind: the stream is `CUlaunchConfig::hStream` (first argument).
pub const STREAM_IN_CONFIG: u32 = 0xfd;
/// Kind: no single stream.
pub const STREAM_NONE: u32 = 0xfe;
/// Kind flag: the per-thread default stream variant (`_ptsz`, or asked for with
/// `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`): stream 0 is the thread's own.
pub const KIND_PTDS: u32 = 0x100;
/// Kind flag: set once the kind is known (0: not known, treated as [`STREAM_NONE`]).
pub const KIND_SET: u32 = 0x200;

/// The kind of submission entry point `name` (any of its exported names), asked for
/// per-thread default stream semantics or not.
pub fn kind_of(name: &str, ptds: bool) -> u32 {
    // An exported `…_v2` of an entry point in [`NEW_ABI`] is its new ABI.
    let new = name.contains("_v2") && NEW_ABI.iter().any(|(n, _, _)| *n == base_name(name));
    kind_at(name, if new { i32::MAX } else { 0 }, ptds)
}

/// The kind of submission entry point `name` as a getter hands it out for CUDA version
/// `ver` ([`NEW_ABI`]).
pub fn kind_at(name: &str, ver: i32, ptds: bool) -> u32 {
    let ptds = ptds || name.ends_with("_ptsz") || name.ends_with("_ptds");
    let base = base_name(name);
    let pos = match NEW_ABI.iter().find(|(n, _, _)| *n == base) {
        Some((_, since, p)) if ver >= *since => *p,
        _ => STREAM_ARG
            .iter()
            .find(|(n, _)| *n == base)
            .map_or(STREAM_NONE, |(_, p)| *p),
    };
    pos | KIND_SET | if ptds { KIND_PTDS } else { 0 }
}

/// `cuGetProcAddress` flag `CU_GET_PROC_ADDRESS_LEGACY_STREAM`.
pub const LEGACY_STREAM: u64 = 1;
/// `cuGetProcAddress` flag `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`.
pub const PER_THREAD_DEFAULT_STREAM: u64 = 2;

/// The getter was asked for per-thread default stream semantics (a bit test: other flag
/// bits may come).
pub fn per_thread(flags: u64) -> bool {
    flags & PER_THREAD_DEFAULT_STREAM != 0 && flags & LEGACY_STREAM == 0
}

/// Calls a driver entry point with twelve machine words (see the module doc).
///
/// # Safety
/// `f` must be a submission entry point of the driver, and `a` the caller's arguments.
#[inline(always)]
pub unsafe fn call(f: usize, a: [usize; 12]) -> c_int {
    // SAFETY: the caller's contract.
    unsafe {
        std::mem::transmute::<usize, Fwd>(f)(
            a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11],
        )
    }
}

/// `name` without its ABI suffixes (`_v2`, `_v3`, `_ptsz`, `_ptds`).
pub fn base_name(name: &str) -> &str {
    let mut n = name;
    loop {
        let before = n;
        for suf in ["_ptsz", "_ptds", "_v2", "_v3"] {
            if let Some(s) = n.strip_suffix(suf) {
                n = s;
            }
        }
        if n == before {
            return n;
        }
    }
}

/// A submission entry point, by any of its names.
pub fn is_launch(name: &str) -> bool {
    LAUNCH_BASES.contains(&base_name(name))
}

/// A submission entry point, forwarding twelve machine words.
pub type Fwd = unsafe extern "C" fn(
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
) -> c_int;

/// The stream handle a submission names (`None`: no single stream).
pub fn stream_of(kind: u32, a: &[usize; 12]) -> Option<usize> {
    if kind & KIND_SET == 0 {
        return None;
    }
    match kind & 0xff {
        STREAM_NONE => None,
        STREAM_IN_CONFIG => {
            if a[0] == 0 {
                return None;
            }
            // SAFETY: cuLaunchKernelEx's first argument is a `const CUlaunchConfig *`:
            // seven `unsigned int`s, then `CUstream hStream` at byte 32 (cuda.h).
            Some(unsafe { std::ptr::read_unaligned((a[0] + 32) as *const usize) })
        }
        i if (i as usize) < a.len() => Some(a[i as usize]),
        _ => None,
    }
}

/// The stream key of the legacy default stream of the context current at the call (a
/// handle value no created stream has).
pub const KEY_LEGACY: usize = CU_STREAM_LEGACY;
/// The stream key of the calling thread's per-thread default stream in the context current
/// at the call.
pub const KEY_PER_THREAD: usize = CU_STREAM_PER_THREAD;
/// The stream key of a submission that names no single stream: it matches no stream.
pub const KEY_UNKNOWN: usize = usize::MAX;

/// The stream handle `h` as a key: a created stream is itself; stream 0 is the legacy
/// default stream, or the thread's own with per-thread default stream semantics (`ptds`);
/// `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD` say which explicitly. The two default
/// streams' keys mean "of the current context" (and for the per-thread one, "of the
/// calling thread"): who compares keys compares those too.
#[inline(always)]
pub fn key_of(h: usize, ptds: bool) -> usize {
    match h {
        0 if ptds => KEY_PER_THREAD,
        0 => KEY_LEGACY,
        h => h,
    }
}

/// The stream key ([`key_of`]) of a submission of `kind` with arguments `a`
/// ([`KEY_UNKNOWN`]: no single stream).
#[inline(always)]
pub fn stream_key(kind: u32, a: &[usize; 12]) -> usize {
    match stream_of(kind, a) {
        Some(h) => key_of(h, kind & KIND_PTDS != 0),
        None => KEY_UNKNOWN,
    }
}

/// Whether a submission of `kind` with arguments `a` goes to a stream being captured into
/// a CUDA graph (the doorbell asks this of a launch that would start a run).
pub fn captured(kind: u32, a: &[usize; 12]) -> bool {
    stream_of(kind, a).is_some_and(|h| capturing(h, kind))
}

/// Whether stream `h`, as a submission of `kind` names it, is being captured into a CUDA
/// graph (an invalidated capture too). Such a submission runs nothing: it adds a node to
/// the graph, which runs later through `cuGraphLaunch`, itself a gated submission. So it
/// is neither held at the gate nor tracked: an event of ours recorded there would become
/// a node of the application's graph, and waiting for it is illegal. The legacy default
/// stream cannot be captured (not asked); a failed query counts as not capturing. Asked
/// only while some capture is in progress ([`crate::driver::CAPTURES`]): a capture begun
/// through an entry point the shim does not wrap goes unseen, and an event of ours
/// recorded into it answers as complete.
pub fn capturing(h: usize, kind: u32) -> bool {
    let f = STREAM_IS_CAPTURING.load(Relaxed);
    if f == 0 {
        return false;
    }
    // No capture begun (through the entry points the shim wraps): nothing to ask, so
    // the steady state makes no driver call for it.
    if crate::driver::CAPTURES.load(SeqCst) <= 0 {
        return false;
    }
    // SAFETY: a non-zero value is the driver's cuStreamIsCapturing.
    let is_capturing = unsafe { std::mem::transmute::<usize, Fn2>(f) };
    let h = match h {
        0 if kind & KIND_PTDS != 0 => CU_STREAM_PER_THREAD,
        0 | CU_STREAM_LEGACY => return false,
        h => h,
    };
    let mut status = CAPTURE_STATUS_NONE;
    // SAFETY: the driver's cuStreamIsCapturing with the caller's stream and a valid
    // out-pointer.
    let r = unsafe { is_capturing(h, &mut status as *mut c_int as usize) };
    r == CUDA_SUCCESS && status != CAPTURE_STATUS_NONE
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(base_name("cuMemcpyHtoDAsync_v2_ptsz"), "cuMemcpyHtoDAsync");
        assert_eq!(base_name("cuLaunchKernel"), "cuLaunchKernel");
        assert!(is_launch("cuLaunchKernel_ptsz"));
        assert!(is_launch("cuGraphLaunch"));
        assert!(!is_launch("cuMemAlloc_v2"));
        assert!(!is_launch("cuStreamSynchronize"));
    }

    #[test]
    fn kinds_name_the_stream_argument() {
        assert_eq!(kind_of("cuLaunchKernel", false), 8 | KIND_SET);
        assert_eq!(kind_of("cuLaunchKernel", true), 8 | KIND_SET | KIND_PTDS);
        assert_eq!(
            kind_of("cuLaunchKernel_ptsz", false),
            8 | KIND_SET | KIND_PTDS
        );
        assert_eq!(
            kind_of("cuMemcpyHtoDAsync_v2_ptsz", false),
            3 | KIND_SET | KIND_PTDS
        );
        assert_eq!(kind_of("cuLaunchHostFunc", false), KIND_SET);
        assert_eq!(kind_of("cuGraphLaunch", false), 1 | KIND_SET);
        assert_eq!(kind_of("cuMemsetD2D32Async", false), 5 | KIND_SET);
        assert_eq!(
            kind_of("cuLaunchKernelEx", false),
            STREAM_IN_CONFIG | KIND_SET
        );
        assert_eq!(
            kind_of("cuLaunchCooperativeKernelMultiDevice", false),
            STREAM_NONE | KIND_SET
        );
        for b in LAUNCH_BASES {
            assert!(
                STREAM_ARG.iter().any(|(n, _)| n == b),
                "{b} has a stream position"
            );
        }
    }

    #[test]
    fn batched_copies_take_the_stream_of_the_abi_asked_for() {
        // CUDA 12.8: (…, numAttrs, failIdx, stream); 13.0: (…, numAttrs, stream).
        assert_eq!(kind_at("cuMemcpyBatchAsync", 12080, false), 8 | KIND_SET);
        assert_eq!(kind_at("cuMemcpyBatchAsync", 13000, false), 7 | KIND_SET);
        assert_eq!(
            kind_at("cuMemcpyBatchAsync", 13000, true),
            7 | KIND_SET | KIND_PTDS
        );
        assert_eq!(kind_at("cuMemcpy3DBatchAsync", 12090, false), 4 | KIND_SET);
        assert_eq!(kind_at("cuMemcpy3DBatchAsync", 13000, false), 3 | KIND_SET);
        // Exported names: the plain one is the old ABI, `_v2` the new.
        assert_eq!(kind_of("cuMemcpyBatchAsync", false), 8 | KIND_SET);
        assert_eq!(kind_of("cuMemcpyBatchAsync_v2", false), 7 | KIND_SET);
        assert_eq!(
            kind_of("cuMemcpyBatchAsync_v2_ptsz", false),
            7 | KIND_SET | KIND_PTDS
        );
        // Entry points whose ABI did not move ignore the version.
        assert_eq!(kind_at("cuLaunchKernel", 13000, false), 8 | KIND_SET);
        assert_eq!(kind_of("cuMemcpyHtoDAsync_v2", false), 3 | KIND_SET);
        assert!(is_launch("cuMemcpyBatchAsync_v2"));
    }

    #[test]
    fn stream_keys() {
        let mut a = [0usize; 12];
        let k = kind_of("cuLaunchKernel", false);
        let kp = kind_of("cuLaunchKernel_ptsz", false);
        assert_eq!(
            stream_key(k, &a),
            KEY_LEGACY,
            "stream 0: the legacy default stream"
        );
        assert_eq!(
            stream_key(kp, &a),
            KEY_PER_THREAD,
            "stream 0 of a _ptsz variant"
        );
        a[8] = CU_STREAM_LEGACY;
        assert_eq!(stream_key(kp, &a), KEY_LEGACY, "named explicitly");
        a[8] = CU_STREAM_PER_THREAD;
        assert_eq!(stream_key(k, &a), KEY_PER_THREAD);
        a[8] = 0x5000;
        assert_eq!(stream_key(k, &a), 0x5000);
        assert_eq!(
            stream_key(kind_of("cuLaunchCooperativeKernelMultiDevice", false), &a),
            KEY_UNKNOWN
        );
        assert_eq!(stream_key(0, &a), KEY_UNKNOWN, "kind not known");
    }

    #[test]
    fn per_thread_is_a_bit() {
        assert!(per_thread(PER_THREAD_DEFAULT_STREAM));
        assert!(!per_thread(0));
        assert!(!per_thread(LEGACY_STREAM));
        assert!(
            per_thread(PER_THREAD_DEFAULT_STREAM | 0x10),
            "another flag bit"
        );
    }

    #[test]
    fn the_stream_a_submission_names() {
        let mut a = [0usize; 12];
        a[8] = 0x5000;
        assert_eq!(
            stream_of(kind_of("cuLaunchKernel", false), &a),
            Some(0x5000)
        );
        assert_eq!(stream_of(0, &a), None, "kind not known");
        assert_eq!(
            stream_of(kind_of("cuLaunchCooperativeKernelMultiDevice", false), &a),
            None
        );
        // cuLaunchKernelEx: the stream at byte 32 of the CUlaunchConfig.
        let config = [1u32, 1, 1, 1, 1, 1, 0, 0, 0x7000, 0];
        a[0] = config.as_ptr() as usize;
        assert_eq!(
            stream_of(kind_of("cuLaunchKernelEx", false), &a),
            Some(0x7000)
        );
        a[0] = 0;
        assert_eq!(stream_of(kind_of("cuLaunchKernelEx", false), &a), None);
    }
}
