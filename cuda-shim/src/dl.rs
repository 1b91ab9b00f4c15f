//! `dlsym` interposition.
//!
//! Our `dlsym` is a naked trampoline: it asks [`dlsym_hook`] whether the name is one we
//! wrap; if not, it restores the arguments and *jumps* to glibc's `dlsym`, so glibc sees
//! the original caller's return address (what `RTLD_NEXT` is relative to) as if we were
//! not there. Only names starting with `cu` are looked at.

use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::*};

/// glibc's `dlsym`, found with `dlvsym` (never through ourselves).
static REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);
static NO_DLSYM: AtomicBool = AtomicBool::new(false);

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

/// glibc's `dlsym` (2.34 moved it into libc; older versions have the 2.2.5 one).
pub fn real_dlsym_fn() -> Option<DlsymFn> {
    let mut p = REAL_DLSYM.load(Acquire);
    if p == 0 {
        for ver in [c"GLIBC_2.34", c"GLIBC_2.2.5", c"GLIBC_2.17"] {
            // SAFETY: dlvsym with valid C strings; RTLD_NEXT from this library finds libc's.
            let f = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), ver.as_ptr()) };
            if !f.is_null() {
                p = f as usize;
                break;
            }
        }
        if p == 0 {
            crate::warn_once(&NO_DLSYM, "cannot find glibc's dlsym; the shim is inactive");
            return None;
        }
        REAL_DLSYM.store(p, Release);
    }
    // SAFETY: a non-zero value is always glibc's dlsym.
    Some(unsafe { std::mem::transmute::<usize, DlsymFn>(p) })
}

/// `real dlsym(handle, name)` (null when glibc's dlsym cannot be found).
pub fn real_dlsym(handle: *mut c_void, name: &CStr) -> *mut c_void {
    match real_dlsym_fn() {
        // SAFETY: glibc's dlsym with a valid C string.
        Some(f) => unsafe { f(handle, name.as_ptr()) },
        None => std::ptr::null_mut(),
    }
}

/// Decides for the trampoline: our wrapper for `name`, or null to let glibc answer.
/// Always leaves `REAL_DLSYM` set when it can (the trampoline jumps through it).
extern "C" fn dlsym_hook(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    if real_dlsym_fn().is_none() || name.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: dlsym's contract: `name` is a NUL-terminated string. Only its first two bytes
    // are read unless they are "cu".
    let quick = unsafe { *name as u8 == b'c' && *name.add(1) as u8 == b'u' };
    if !quick {
        return std::ptr::null_mut();
    }
    // SAFETY: as above.
    let cname = unsafe { CStr::from_ptr(name) };
    std::panic::catch_unwind(|| crate::hooks::on_dlsym(handle, cname))
        .unwrap_or(std::ptr::null_mut())
}

#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[unsafe(no_mangle)]
/// `dlsym(3)`, interposed (see the module doc).
pub unsafe extern "C" fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    core::arch::naked_asm!(
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "call {hook}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "test rax, rax",
        "jz 2f",
        "ret",
        "2:",
        "mov rax, qword ptr [rip + {real}]",
        "test rax, rax",
        "jz 3f",
        "jmp rax",
        "3:",
        "xor eax, eax",
        "ret",
        hook = sym dlsym_hook,
        real = sym REAL_DLSYM,
    )
}

#[cfg(target_arch = "aarch64")]
#[unsafe(naked)]
#[unsafe(no_mangle)]
/// `dlsym(3)`, interposed (see the module doc).
pub unsafe extern "C" fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    core::arch::naked_asm!(
        "stp x29, x30, [sp, #-32]!",
        "stp x0, x1, [sp, #16]",
        "bl {hook}",
        "mov x9, x0",
        "ldp x0, x1, [sp, #16]",
        "ldp x29, x30, [sp], #32",
        "cbz x9, 2f",
        "mov x0, x9",
        "ret",
        "2:",
        "adrp x9, {real}",
        "ldr x9, [x9, :lo12:{real}]",
        "cbz x9, 3f",
        "br x9",
        "3:",
        "mov x0, #0",
        "ret",
        hook = sym dlsym_hook,
        real = sym REAL_DLSYM,
    )
}
