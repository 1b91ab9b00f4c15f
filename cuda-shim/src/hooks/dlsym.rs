//! Our `dlsym`: a naked trampoline that asks [`dlsym_hook`] whether the name is one we
//! wrap; if not, it restores the arguments and *jumps* to glibc's `dlsym`, so glibc sees
//! the original caller's return address (what `RTLD_NEXT` is relative to) as if we were
//! not there. Only names starting with `cu` are looked at.

use super::{getter_for, is_getter, is_ours, slot_for};
use crate::dl::REAL_DLSYM;
use crate::launch::{is_launch, kind_of};
use std::ffi::{c_char, c_void, CStr};

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

/// Decides for the trampoline: our wrapper for `name`, or null to let glibc answer.
/// Always leaves `REAL_DLSYM` set when it can (the trampoline jumps through it).
extern "C" fn dlsym_hook(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    if crate::dl::real_dlsym_fn().is_none() || name.is_null() {
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
    std::panic::catch_unwind(|| on_dlsym(handle, cname)).unwrap_or(std::ptr::null_mut())
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
