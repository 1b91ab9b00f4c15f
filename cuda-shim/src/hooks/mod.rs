//! The entry points: the getters (`cuGetProcAddress`, `cuGetProcAddress_v2`), forwarding
//! slots for the launch entry points and for the watched ones (`crate::watch`: the
//! synchronising calls, event bookkeeping, synchronous copies), our `dlsym` ([`dlsym`]) and
//! the exported symbols of both for programs linked against `libcuda` directly
//! ([`exported`]).
//!
//! A *slot* is a wrapper bound to one real driver pointer. The driver may hand out several
//! pointers for one name (`_ptsz` with the per-thread default stream, older ABIs for older
//! `cudaVersion`s); each gets its own slot, so a wrapper always calls exactly the pointer
//! the driver chose for that request (forwarding twelve machine words: [`crate::launch`]).

use crate::launch::{base_name, is_launch, kind_at, per_thread, Fwd, NEW_ABI};
use crate::mode;
use crate::watch::is_watched;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering::*};

/// A submission: doorbell (online: the thread is marked inside a submission until the
/// driver's call returns, [`crate::threads`]), gate (offline with a gate), or straight
/// through. A macro, so that the arguments are gathered into an array only where needed.
macro_rules! dispatch {
    ($f:expr, $kind:expr, $($a:ident),*) => {{
        match crate::setup::mode() {
            mode::ON => {
                let k = $kind.load(Relaxed);
                let rec = crate::page::ring(
                    crate::launch::stream_key(k, &[$($a),*]),
                    || crate::launch::captured(k, &[$($a),*]),
                );
                // SAFETY: as below.
                let r = unsafe { std::mem::transmute::<usize, Fwd>($f)($($a),*) };
                crate::page::rung(rec);
                return r;
            }
            mode::GATED if !crate::gate::submitting() => return $crate::hooks::gated($kind.load(Relaxed), $f, $($a),*),
            mode::WAIT => crate::setup::retry(),
            _ => {}
        }
        // SAFETY: the caller's contract: `$f` is the driver's entry point for this
        // request, called with the caller's own arguments.
        unsafe { std::mem::transmute::<usize, Fwd>($f)($($a),*) }
    }};
}

/// A watched call (`crate::watch`): completion stamps online ([`crate::drain`]), straight
/// through otherwise. A synchronous copy or memset is a submission: it decides the mode if
/// it is the first; the other watched calls never do (before the first submission there is
/// nothing to stamp).
macro_rules! observe {
    ($f:expr, $kind:expr, $($a:ident),*) => {{
        let k = $kind.load(Relaxed);
        if crate::watch::is_bookkeeping(k) {
            // SAFETY: the caller's contract, as below.
            return crate::watch::bookkeeping(k, || unsafe {
                std::mem::transmute::<usize, Fwd>($f)($($a),*)
            });
        }
        let copies = matches!(crate::watch::what(k), crate::watch::W_COPY | crate::watch::W_COPY_DRAINS);
        let m = if copies { crate::setup::mode() } else { crate::mode::MODE.load(Acquire) };
        if m == mode::ON {
            crate::drain::call(k, $f, [$($a),*])
        } else {
            // SAFETY: the caller's contract: `$f` is the driver's entry point for this
            // request, called with the caller's own arguments.
            unsafe { std::mem::transmute::<usize, Fwd>($f)($($a),*) }
        }
    }};
}

mod dlsym;
mod exported;

/// `CUDA_SUCCESS`.
const CUDA_SUCCESS: c_int = 0;

/// The gated path, out of line (the arguments are gathered only here).
#[cold]
#[inline(never)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn gated(
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

fn is_getter(name: &[u8]) -> bool {
    name == b"cuGetProcAddress" || name == b"cuGetProcAddress_v2"
}

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
/// Distinct driver pointers of watched entry points (`crate::watch`): 29 bases, most with
/// a per-thread variant and an older ABI, come to about 80.
const NWATCH: usize = 128;
static WATCH_REAL: [AtomicUsize; NWATCH] = [const { AtomicUsize::new(0) }; NWATCH];
/// Watch slot N's kind (`crate::watch::kind_of`), set when it is handed out.
static WATCH_KIND: [AtomicU32; NWATCH] = [const { AtomicU32::new(0) }; NWATCH];
static WATCH_FULL: AtomicBool = AtomicBool::new(false);

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

unsafe extern "C" fn watch<const N: usize>(
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
    // Watch slot N is handed out only after its real pointer was stored.
    let f = WATCH_REAL[N].load(Relaxed);
    observe!(
        f,
        WATCH_KIND[N],
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
    } else if let Some(n) = std::str::from_utf8(name).ok().filter(|n| is_watched(n)) {
        let kind = crate::watch::kind_at(n, real, ver, per_thread(flags), driver_symbol);
        watch_slot_for(real, kind)
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
        let f = crate::driver::lookup(c"cuDriverGetVersion", c"cuDriverGetVersion");
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
static WATCH_FNS: [Fwd; NWATCH] = table!(watch, Fwd,
    0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32
    33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61
    62 63 64 65 66 67 68 69 70 71 72 73 74 75 76 77 78 79 80 81 82 83 84 85 86 87 88 89 90
    91 92 93 94 95 96 97 98 99 100 101 102 103 104 105 106 107 108 109 110 111 112 113 114
    115 116 117 118 119 120 121 122 123 124 125 126 127);

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
            mode::warn_once(
                &SLOTS_FULL,
                "out of launch wrappers: further entry points pass through unobserved",
            );
            None
        }
    }
}

/// The wrapper forwarding to watched entry point `real` (`None`: pointer is ours already,
/// or no watch slot is left — the caller then gets the real pointer, unwatched).
pub fn watch_slot_for(real: usize, kind: u32) -> Option<usize> {
    if is_ours(real) {
        return None;
    }
    match claim(&WATCH_REAL, real) {
        Some(i) => {
            let _ = WATCH_KIND[i].compare_exchange(0, kind, AcqRel, Acquire);
            Some(WATCH_FNS[i] as usize)
        }
        None => {
            mode::warn_once(
                &WATCH_FULL,
                "out of wrappers for synchronising calls: further ones pass through unobserved",
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
    crate::driver::ANY_GETTER.store(real, Release);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::{KIND_PTDS, KIND_SET};

    #[test]
    fn getters() {
        assert!(is_getter(b"cuGetProcAddress_v2"));
        assert!(is_getter(b"cuGetProcAddress"));
        assert!(!is_getter(b"cuGetProcAddress_v3"));
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
    fn slots_are_per_real_pointer() {
        let a = claim(&SLOT_REAL, 0x1000).unwrap();
        let b = claim(&SLOT_REAL, 0x2000).unwrap();
        assert_ne!(a, b);
        assert_eq!(claim(&SLOT_REAL, 0x1000), Some(a));
    }
}
