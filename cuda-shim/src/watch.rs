//! The entry points an online shim watches besides the submissions of [`crate::launch`]:
//! what tells that work completed (stream, context and event synchronisation and queries),
//! what tells which stream an event waits for (event record, create, destroy), and the
//! synchronous copies and memsets, which submit work as the asynchronous ones do. See
//! [`crate::drain`] for what is done with them; offline (the gate) and in pass-through they
//! are forwarded untouched.
//!
//! Which synchronous copies show the earlier work complete (the CUDA driver API's
//! "API synchronization behavior"): a copy to host memory from device memory or an array
//! (`cuMemcpyDtoH`, `cuMemcpyAtoH`) returns once the copy has completed, and the copy ran
//! after everything submitted before it to the default stream it is issued on. The others
//! do not: a copy from pageable host memory returns once its data is staged, its DMA maybe
//! still running; device-to-device copies and the memsets of device memory do not wait at
//! all; `cuMemcpy`, `cuMemcpyPeer` and the 2D/3D copies are any of these, by their pointers.
//! Those only submit (they ring the doorbell, on the default stream of their variant).

use crate::launch::{base_name, KIND_PTDS, KIND_SET};

/// A stream synchronize or query: the stream is argument 0.
pub const W_STREAM: u32 = 1;
/// A context synchronize of the current context (no argument).
pub const W_CTX: u32 = 2;
/// A context synchronize naming its context in argument 0 (0: the current one)
/// (`cuCtxSynchronize_v2`).
pub const W_CTX_ARG: u32 = 3;
/// An event synchronize or query: the event is argument 0.
pub const W_EVENT: u32 = 4;
/// An event record: event argument 0, stream argument 1.
pub const W_RECORD: u32 = 5;
/// An event create: the event is written through argument 0.
pub const W_CREATE: u32 = 6;
/// An event destroy: the event is argument 0.
pub const W_DESTROY: u32 = 7;
/// A synchronous copy that returns once it and the earlier work of its default stream
/// completed.
pub const W_COPY_DRAINS: u32 = 8;
/// Another synchronous copy or memset: work submitted to the default stream.
pub const W_COPY: u32 = 9;
/// A watched entry point whose ABI is not known (a context synchronize handed out for a
/// version that may take its context as an argument): forwarded, nothing stamped.
pub const W_OPAQUE: u32 = 10;
/// A call that may change a thread's current context: forwarded in every mode, then the
/// cached contexts are stale ([`crate::driver::CTX_GEN`]).
pub const W_CTX_SWITCH: u32 = 11;
/// A stream capture's beginning: forwarded in every mode, counted
/// ([`crate::driver::CAPTURES`]).
pub const W_CAPTURE_BEGIN: u32 = 12;
/// A stream capture's end: forwarded in every mode, counted down.
pub const W_CAPTURE_END: u32 = 13;

/// Base names of the watched entry points, and what each is.
pub const WATCH_BASES: &[(&str, u32)] = &[
    ("cuStreamSynchronize", W_STREAM),
    ("cuStreamQuery", W_STREAM),
    ("cuCtxSynchronize", W_CTX),
    ("cuEventSynchronize", W_EVENT),
    ("cuEventQuery", W_EVENT),
    ("cuEventRecord", W_RECORD),
    ("cuEventRecordWithFlags", W_RECORD),
    ("cuEventCreate", W_CREATE),
    ("cuEventDestroy", W_DESTROY),
    ("cuMemcpyDtoH", W_COPY_DRAINS),
    ("cuMemcpyAtoH", W_COPY_DRAINS),
    ("cuMemcpy", W_COPY),
    ("cuMemcpyHtoD", W_COPY),
    ("cuMemcpyDtoD", W_COPY),
    ("cuMemcpyHtoA", W_COPY),
    ("cuMemcpyAtoD", W_COPY),
    ("cuMemcpyDtoA", W_COPY),
    ("cuMemcpyAtoA", W_COPY),
    ("cuMemcpy2D", W_COPY),
    ("cuMemcpy2DUnaligned", W_COPY),
    ("cuMemcpy3D", W_COPY),
    ("cuMemcpyPeer", W_COPY),
    ("cuMemcpy3DPeer", W_COPY),
    ("cuMemsetD8", W_COPY),
    ("cuMemsetD16", W_COPY),
    ("cuMemsetD32", W_COPY),
    ("cuMemsetD2D8", W_COPY),
    ("cuMemsetD2D16", W_COPY),
    ("cuMemsetD2D32", W_COPY),
    ("cuCtxSetCurrent", W_CTX_SWITCH),
    ("cuCtxPushCurrent", W_CTX_SWITCH),
    ("cuCtxPopCurrent", W_CTX_SWITCH),
    ("cuCtxCreate", W_CTX_SWITCH),
    ("cuCtxCreate_v4", W_CTX_SWITCH),
    ("cuCtxDestroy", W_CTX_SWITCH),
    ("cuDevicePrimaryCtxRelease", W_CTX_SWITCH),
    ("cuDevicePrimaryCtxReset", W_CTX_SWITCH),
    ("cuStreamBeginCapture", W_CAPTURE_BEGIN),
    ("cuStreamBeginCaptureToGraph", W_CAPTURE_BEGIN),
    ("cuStreamEndCapture", W_CAPTURE_END),
];

/// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`: the capture ended, invalidated.
const CAPTURE_INVALIDATED: i32 = 901;

/// Whether a watched kind is one that every mode forwards and then notes
/// ([`bookkeeping`]).
#[inline(always)]
pub fn is_bookkeeping(kind: u32) -> bool {
    matches!(what(kind), W_CTX_SWITCH | W_CAPTURE_BEGIN | W_CAPTURE_END)
}

/// Calls `f` (the driver's entry point) for a bookkeeping kind and notes what it did: a
/// context switch moves [`crate::driver::CTX_GEN`] (whatever the answer: a failed pop may
/// still have changed nothing, and a spurious move only costs one `cuCtxGetCurrent`); a
/// capture is counted from before its beginning (so that a submission that reads no
/// capture made its check before the capture began) until its end (an invalidated capture
/// ends too).
pub fn bookkeeping(kind: u32, f: impl FnOnce() -> i32) -> i32 {
    use crate::driver::{CAPTURES, CTX_GEN};
    use std::sync::atomic::Ordering::*;
    match what(kind) {
        W_CTX_SWITCH => {
            let r = f();
            CTX_GEN.fetch_add(1, Release);
            r
        }
        W_CAPTURE_BEGIN => {
            CAPTURES.fetch_add(1, SeqCst);
            let r = f();
            if r != 0 {
                CAPTURES.fetch_sub(1, SeqCst);
            }
            r
        }
        _ => {
            let r = f();
            if r == 0 || r == CAPTURE_INVALIDATED {
                let _ = CAPTURES.fetch_update(SeqCst, SeqCst, |n| (n > 0).then(|| n - 1));
            }
            r
        }
    }
}

/// The CUDA version from which a getter asked for `cuCtxSynchronize` may answer with the
/// ABI that takes a context (`cuCtxSynchronize_v2`).
pub const CTX_ARG_SINCE: i32 = 13000;

/// A watched entry point, by any of its names.
pub fn is_watched(name: &str) -> bool {
    WATCH_BASES.iter().any(|(n, _)| *n == base_name(name))
}

/// What a watched kind is (one of the `W_` values).
#[inline(always)]
pub fn what(kind: u32) -> u32 {
    kind & 0xff
}

/// The kind of watched entry point `name` (any of its exported names), asked for with
/// per-thread default stream semantics or not. An exported `cuCtxSynchronize_v2` takes its
/// context.
pub fn kind_of(name: &str, ptds: bool) -> u32 {
    let base = base_name(name);
    let w = match WATCH_BASES.iter().find(|(n, _)| *n == base) {
        Some((_, W_CTX)) if name.contains("_v2") => W_CTX_ARG,
        Some((_, w)) => *w,
        None => W_OPAQUE,
    };
    let ptds = ptds || name.ends_with("_ptsz") || name.ends_with("_ptds");
    w | KIND_SET | if ptds { KIND_PTDS } else { 0 }
}

/// The kind of watched entry point `name` as a getter handed out `real` for CUDA version
/// `ver`: a context synchronize is the ABI of the driver's exported name that `real` is
/// (`lookup` finds one in the driver; 0: none); a pointer the driver does not export by
/// name (another interposer's) is the old ABI below [`CTX_ARG_SINCE`], and unknown from it.
pub fn kind_at(
    name: &str,
    real: usize,
    ver: i32,
    ptds: bool,
    lookup: impl Fn(&str) -> usize,
) -> u32 {
    let k = kind_of(name, ptds);
    if what(k) != W_CTX && what(k) != W_CTX_ARG {
        return k;
    }
    let flags = k & !0xff;
    let w = if lookup("cuCtxSynchronize_v2") == real {
        W_CTX_ARG
    } else if lookup("cuCtxSynchronize") == real || ver < CTX_ARG_SINCE {
        W_CTX
    } else {
        W_OPAQUE
    };
    w | flags
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::is_launch;

    #[test]
    fn names_and_kinds() {
        assert!(is_watched("cuStreamSynchronize_ptsz"));
        assert!(is_watched("cuMemcpyDtoH_v2_ptds"));
        assert!(is_watched("cuMemcpy"));
        assert!(is_watched("cuEventDestroy_v2"));
        assert!(!is_watched("cuMemcpyAsync"), "a submission of launch.rs");
        assert!(!is_watched("cuLaunchKernel"));
        assert!(!is_watched("cuMemAlloc_v2"));
        for (n, _) in WATCH_BASES {
            assert!(!is_launch(n), "{n} is not both");
        }
        assert_eq!(kind_of("cuStreamSynchronize", false), W_STREAM | KIND_SET);
        assert_eq!(
            kind_of("cuStreamSynchronize_ptsz", false),
            W_STREAM | KIND_SET | KIND_PTDS
        );
        assert_eq!(
            kind_of("cuMemcpyDtoH", true),
            W_COPY_DRAINS | KIND_SET | KIND_PTDS
        );
        assert_eq!(
            kind_of("cuMemcpyDtoH_v2_ptds", false),
            W_COPY_DRAINS | KIND_SET | KIND_PTDS
        );
        assert_eq!(kind_of("cuMemcpyHtoD_v2", false), W_COPY | KIND_SET);
        assert_eq!(kind_of("cuMemsetD2D32_v2_ptds", false) & 0xff, W_COPY);
        assert_eq!(kind_of("cuCtxSynchronize", false), W_CTX | KIND_SET);
        assert_eq!(kind_of("cuCtxSynchronize_v2", false), W_CTX_ARG | KIND_SET);
        assert_eq!(
            kind_of("cuEventRecordWithFlags_ptsz", false) & 0xff,
            W_RECORD
        );
    }

    #[test]
    fn the_abi_of_a_context_synchronize_is_told_by_the_pointer_where_it_can_be() {
        let exported = |n: &str| match n {
            "cuCtxSynchronize" => 0x10,
            "cuCtxSynchronize_v2" => 0x20,
            _ => 0,
        };
        let k = |real, ver| what(kind_at("cuCtxSynchronize", real, ver, false, exported));
        assert_eq!(k(0x10, 13000), W_CTX);
        assert_eq!(k(0x20, 12000), W_CTX_ARG);
        assert_eq!(k(0x99, 12090), W_CTX, "someone else's pointer, old version");
        assert_eq!(
            k(0x99, 13000),
            W_OPAQUE,
            "someone else's pointer, maybe new ABI"
        );
        let none = |_: &str| 0;
        assert_eq!(
            what(kind_at("cuCtxSynchronize", 0x99, 12040, false, none)),
            W_CTX
        );
        // Other entry points do not look.
        assert_eq!(
            kind_at("cuStreamSynchronize", 0x10, 13000, true, exported),
            W_STREAM | KIND_SET | KIND_PTDS
        );
    }
}
