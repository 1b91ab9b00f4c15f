//! The entry points: the getters (`cuGetProcAddress`, `cuGetProcAddress_v2`), forwarding
//! slots for the launch entry points, and the exported launch symbols for programs linked
//! against `libcuda` directly.
//!
//! A *slot* is a wrapper bound to one real driver pointer. The driver may hand out several
//! pointers for one name (`_ptsz` with the per-thread default stream, older ABIs for older
//! `cudaVersion`s); each gets its own slot, so a wrapper always calls exactly the pointer
//! the driver chose for that request. Every submission entry point takes only integer and
//! pointer arguments, so a slot forwards twelve machine words unchanged: the callee reads
//! the ones it has (for the SysV and AAPCS64 ABIs alike) and the rest is never looked at.

use crate::bell;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering::*};

/// `CUDA_SUCCESS`.
const CUDA_SUCCESS: c_int = 0;
/// `CUDA_ERROR_NOT_FOUND`.
const CUDA_ERROR_NOT_FOUND: c_int = 500;

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
const NEW_ABI: &[(&str, i32, u32)] = &[
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

/// `cuGetProcAddress` flags `CU_GET_PROC_ADDRESS_LEGACY_STREAM` and
/// `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`.
const LEGACY_STREAM: u64 = 1;
const PER_THREAD_DEFAULT_STREAM: u64 = 2;

/// The getter was asked for per-thread default stream semantics (a bit test: other flag
/// bits may come).
fn per_thread(flags: u64) -> bool {
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

/// A submission: doorbell (online), gate (offline with a gate), or straight through. A
/// macro, so that the arguments are gathered into an array only on the gated path.
macro_rules! dispatch {
    ($f:expr, $kind:expr, $($a:ident),*) => {{
        match bell::mode() {
            bell::ON => bell::ring(|| crate::gate::captured($kind.load(Relaxed), &[$($a),*])),
            bell::GATED => return gated($kind.load(Relaxed), $f, $($a),*),
            _ => {}
        }
        // SAFETY: the caller's contract: `$f` is the driver's entry point for this
        // request, called with the caller's own arguments.
        unsafe { std::mem::transmute::<usize, Fwd>($f)($($a),*) }
    }};
}

/// The gated path, out of line (the arguments are gathered only here).
#[cold]
#[inline(never)]
#[allow(clippy::too_many_arguments)]
fn gated(
    kind: u32,
    f: usize,
    a0: usize,
    a1: usize,
    a2: usize,
    a3: usize,
    a4: usize,
    a5: usize,
    a6: usize,
    a7: usize,
    a8: usize,
    a9: usize,
    a10: usize,
    a11: usize,
) -> c_int {
    crate::gate::submit(kind, f, [a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11])
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

fn is_getter(name: &[u8]) -> bool {
    name == b"cuGetProcAddress" || name == b"cuGetProcAddress_v2"
}

type Fwd = unsafe extern "C" fn(
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

type Getter =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> c_int;

/// Distinct driver pointers that can be wrapped: 24 bases × (legacy, `_ptsz`), the new
/// ABIs of the batched copies and older ABIs of some come to about 65; twice that leaves
/// room.
const NSLOTS: usize = 128;
const NGETTERS: usize = 8;
static SLOT_REAL: [AtomicUsize; NSLOTS] = [const { AtomicUsize::new(0) }; NSLOTS];
/// Slot N's kind ([`kind_of`]), set when it is handed out (the first request wins).
static SLOT_KIND: [AtomicU32; NSLOTS] = [const { AtomicU32::new(0) }; NSLOTS];
static GETTER_REAL: [AtomicUsize; NGETTERS] = [const { AtomicUsize::new(0) }; NGETTERS];
static SLOTS_FULL: AtomicBool = AtomicBool::new(false);

/// A real getter seen so far (the shim resolves its own helpers through it).
pub static ANY_GETTER: AtomicUsize = AtomicUsize::new(0);

unsafe extern "C" fn slot<const N: usize>(
    a0: usize,
    a1: usize,
    a2: usize,
    a3: usize,
    a4: usize,
    a5: usize,
    a6: usize,
    a7: usize,
    a8: usize,
    a9: usize,
    a10: usize,
    a11: usize,
) -> c_int {
    // Slot N is handed out only after its real pointer was stored.
    let f = SLOT_REAL[N].load(Relaxed);
    dispatch!(
        f,
        SLOT_KIND[N],
        a0,
        a1,
        a2,
        a3,
        a4,
        a5,
        a6,
        a7,
        a8,
        a9,
        a10,
        a11
    )
}

unsafe extern "C" fn getter<const N: usize>(
    sym: *const c_char,
    pfn: *mut *mut c_void,
    ver: c_int,
    flags: u64,
    status: *mut c_int,
) -> c_int {
    let f = GETTER_REAL[N].load(Relaxed);
    // SAFETY: as for `slot`; `cuGetProcAddress` (4 arguments) ignores the fifth.
    let r = unsafe { std::mem::transmute::<usize, Getter>(f)(sym, pfn, ver, flags, status) };
    if r == CUDA_SUCCESS && !sym.is_null() && !pfn.is_null() {
        // SAFETY: the driver succeeded, so `sym` is a C string and `pfn` a valid slot.
        unsafe { after_get(sym, pfn, ver, flags) };
    }
    r
}

/// Replaces the driver's answer for a wrapped name with our wrapper (`flags`: the
/// getter's, which say whether stream 0 is the per-thread default stream).
unsafe fn after_get(sym: *const c_char, pfn: *mut *mut c_void, ver: c_int, flags: u64) {
    // SAFETY: caller's contract.
    let (name, real) = unsafe { (CStr::from_ptr(sym), *pfn) };
    if real.is_null() {
        return;
    }
    let name = name.to_bytes();
    let ours = std::panic::catch_unwind(|| {
        let w = wrap_for(name, real as usize, ver, flags);
        if crate::trace::on() {
            // The answer may be ours already (a driver whose table resolves through the
            // dynamic linker finds our exported wrappers first).
            let wrapped = w.is_some() || is_ours(real as usize);
            crate::trace::request("cuGetProcAddress", name, ver, flags, wrapped);
        }
        w
    });
    if let Ok(Some(w)) = ours {
        // SAFETY: `pfn` is the caller's out-pointer.
        unsafe { *pfn = w as *mut c_void };
    }
}

/// Our wrapper for a getter's answer `real` to `name` (`None`: not one we wrap).
fn wrap_for(name: &[u8], real: usize, ver: c_int, flags: u64) -> Option<usize> {
    if is_getter(name) {
        getter_for(real)
    } else if let Some(n) = std::str::from_utf8(name).ok().filter(|n| is_launch(n)) {
        let ver = abi_version(n, real, ver, driver_version, driver_symbol);
        slot_for(real, kind_at(n, ver, per_thread(flags)))
    } else {
        None
    }
}

/// The version whose ABI `real` has, for an entry point in [`NEW_ABI`]: decided by the
/// driver's own exported names where `real` is one of them (`…_v2[_ptsz]`: the new ABI;
/// the plain name or `_ptsz`: the old), else by the version asked for, capped at the
/// driver's (`driver()`, 0: unknown): a driver older than the version asked for answers
/// with its older ABI. `lookup` finds an exported name in the driver (0: none).
fn abi_version(
    name: &str,
    real: usize,
    ver: c_int,
    driver: impl Fn() -> c_int,
    lookup: impl Fn(&str) -> usize,
) -> c_int {
    let base = base_name(name);
    if !NEW_ABI.iter().any(|(n, _, _)| *n == base) {
        return ver;
    }
    let is = |suffixes: &[&str]| {
        suffixes
            .iter()
            .any(|s| lookup(&format!("{base}{s}")) == real)
    };
    if is(&["_v2", "_v2_ptsz"]) {
        c_int::MAX
    } else if is(&["", "_ptsz"]) {
        0
    } else {
        match driver() {
            0 => ver,
            d => ver.min(d),
        }
    }
}

/// The driver's CUDA version (`cuDriverGetVersion`; 0: unknown), asked once.
fn driver_version() -> c_int {
    static V: std::sync::OnceLock<c_int> = std::sync::OnceLock::new();
    *V.get_or_init(|| {
        let f = crate::bell::lookup(c"cuDriverGetVersion", c"cuDriverGetVersion");
        if f == 0 {
            return 0;
        }
        let mut v: c_int = 0;
        // SAFETY: the driver's cuDriverGetVersion with a valid out-pointer (no cuInit
        // needed).
        let r = unsafe {
            std::mem::transmute::<usize, unsafe extern "C" fn(*mut c_int) -> c_int>(f)(&mut v)
        };
        if r == CUDA_SUCCESS {
            v
        } else {
            0
        }
    })
}

/// `name` as the loaded `libcuda.so.1` exports it (0: not loaded, or no such name).
fn driver_symbol(name: &str) -> usize {
    let Ok(c) = std::ffi::CString::new(name) else {
        return 0;
    };
    // SAFETY: dlopen with RTLD_NOLOAD only returns a handle to an already loaded library.
    let h = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if h.is_null() {
        return 0;
    }
    let p = crate::dl::real_dlsym(h, &c) as usize;
    // SAFETY: balances the dlopen above (the library stays loaded: RTLD_NOLOAD).
    unsafe { libc::dlclose(h) };
    p
}

macro_rules! table {
    ($f:ident, $t:ty, $($n:literal)*) => { [$($f::<$n> as $t),*] };
}

static SLOT_FNS: [Fwd; NSLOTS] = table!(slot, Fwd,
    0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32
    33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61
    62 63 64 65 66 67 68 69 70 71 72 73 74 75 76 77 78 79 80 81 82 83 84 85 86 87 88 89 90
    91 92 93 94 95 96 97 98 99 100 101 102 103 104 105 106 107 108 109 110 111 112 113 114
    115 116 117 118 119 120 121 122 123 124 125 126 127);
static GETTER_FNS: [Getter; NGETTERS] = table!(getter, Getter, 0 1 2 3 4 5 6 7);

/// Finds or takes a slot for `real` in `reals`; `None` when all are taken.
fn claim(reals: &[AtomicUsize], real: usize) -> Option<usize> {
    if let Some(i) = reals.iter().position(|r| r.load(Acquire) == real) {
        return Some(i);
    }
    for (i, r) in reals.iter().enumerate() {
        match r.compare_exchange(0, real, AcqRel, Acquire) {
            Ok(_) => return Some(i),
            Err(v) if v == real => return Some(i),
            Err(_) => {}
        }
    }
    None
}

/// The wrapper forwarding to launch pointer `real` (`None`: pointer is ours already, or
/// no slot is left — the caller then gets the real pointer, unwrapped).
pub fn slot_for(real: usize, kind: u32) -> Option<usize> {
    if is_ours(real) {
        return None;
    }
    match claim(&SLOT_REAL, real) {
        Some(i) => {
            let _ = SLOT_KIND[i].compare_exchange(0, kind, AcqRel, Acquire);
            Some(SLOT_FNS[i] as usize)
        }
        None => {
            crate::warn_once(
                &SLOTS_FULL,
                "out of launch wrappers: further entry points pass through unobserved",
            );
            None
        }
    }
}

/// The wrapper forwarding to getter `real`.
pub fn getter_for(real: usize) -> Option<usize> {
    if is_ours(real) {
        return None;
    }
    ANY_GETTER.store(real, Release);
    claim(&GETTER_REAL, real).map(|i| GETTER_FNS[i] as usize)
}

/// `addr` lies in this library (a wrapper of ours, e.g. found through `RTLD_DEFAULT`).
fn is_ours(addr: usize) -> bool {
    static BASE: AtomicUsize = AtomicUsize::new(0);
    let fbase = |a: usize| {
        // SAFETY: dladdr only inspects the address; `info` is a valid out-pointer.
        let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
        let ok = unsafe { libc::dladdr(a as *const c_void, &mut info) };
        if ok == 0 {
            0
        } else {
            info.dli_fbase as usize
        }
    };
    let mut base = BASE.load(Relaxed);
    if base == 0 {
        base = fbase(is_ours as fn(usize) -> bool as usize);
        BASE.store(base, Relaxed);
    }
    base != 0 && fbase(addr) == base
}

/// Our answer to `dlsym(handle, name)` for a name starting with `cu` (null: glibc answers).
pub fn on_dlsym(handle: *mut c_void, name: &CStr) -> *mut c_void {
    let bytes = name.to_bytes();
    let getter = is_getter(bytes);
    let launch = !getter && std::str::from_utf8(bytes).is_ok_and(is_launch);
    if !getter && !launch {
        crate::trace::request("dlsym", bytes, 0, 0, false);
        return std::ptr::null_mut();
    }
    let real = crate::dl::real_dlsym(handle, name);
    if real.is_null() {
        return std::ptr::null_mut();
    }
    let ours = if getter {
        getter_for(real as usize)
    } else {
        // A name asked of dlsym is the exported one: `_ptsz` says per-thread.
        slot_for(
            real as usize,
            kind_of(&String::from_utf8_lossy(bytes), false),
        )
    };
    if crate::trace::on() {
        // `real` may be ours already (RTLD_DEFAULT finds our exported wrappers first).
        let wrapped = ours.is_some() || is_ours(real as usize);
        crate::trace::request("dlsym", bytes, 0, 0, wrapped);
    }
    ours.map_or(std::ptr::null_mut(), |w| w as *mut c_void)
}

/// The driver's symbol `name` for an exported wrapper: the next definition after us, or
/// the one in an already loaded `libcuda.so.1`.
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
                ANY_GETTER.store(f, Release);
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
        assert!(is_getter(b"cuGetProcAddress_v2"));
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
    fn the_abi_of_a_batched_copy_is_told_by_the_pointer_where_it_can_be() {
        let exported = |n: &str| match n {
            "cuMemcpyBatchAsync" => 0x10,
            "cuMemcpyBatchAsync_ptsz" => 0x11,
            "cuMemcpyBatchAsync_v2" => 0x20,
            "cuMemcpyBatchAsync_v2_ptsz" => 0x21,
            _ => 0,
        };
        let d13 = || 13000;
        // Asked for 13.0, answered with the 12.8 function (an older driver): old ABI.
        let v = abi_version("cuMemcpyBatchAsync", 0x10, 13000, d13, exported);
        assert_eq!(kind_at("cuMemcpyBatchAsync", v, false), 8 | KIND_SET);
        let v = abi_version("cuMemcpyBatchAsync", 0x21, 12080, d13, exported);
        assert_eq!(
            kind_at("cuMemcpyBatchAsync", v, true),
            7 | KIND_SET | KIND_PTDS
        );
        // A pointer the driver does not export by name (another interposer): the version
        // asked for decides, capped at the driver's.
        assert_eq!(
            abi_version("cuMemcpyBatchAsync", 0x99, 13000, d13, exported),
            13000
        );
        assert_eq!(
            abi_version("cuMemcpyBatchAsync", 0x99, 12080, d13, exported),
            12080
        );
        let v = abi_version("cuMemcpyBatchAsync", 0x99, 13000, || 12090, exported);
        assert_eq!(kind_at("cuMemcpyBatchAsync", v, false), 8 | KIND_SET);
        assert_eq!(
            abi_version("cuMemcpyBatchAsync", 0x99, 13000, || 0, exported),
            13000
        );
        // Other entry points: untouched.
        assert_eq!(
            abi_version("cuLaunchKernel", 0x10, 12000, || 12090, exported),
            12000
        );
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
    fn slots_are_per_real_pointer() {
        let a = claim(&SLOT_REAL, 0x1000).unwrap();
        let b = claim(&SLOT_REAL, 0x2000).unwrap();
        assert_ne!(a, b);
        assert_eq!(claim(&SLOT_REAL, 0x1000), Some(a));
    }
}
