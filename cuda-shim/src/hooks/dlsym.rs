//! Our `dlsym` and `dlvsym`: naked trampolines that restore the caller's arguments and
//! *jump* on, so that the function they jump to sees the original caller's return address
//! (what `RTLD_NEXT` is relative to) as if we were not there.
//!
//! - `dlsym`: [`dlsym_hook`] answers a name starting with `cu` that we wrap (a getter, a
//!   submission entry point, a watched one); every other lookup goes on to the next `dlsym`
//!   ([`crate::dl`]: another interposer's loaded after us, or glibc's).
//! - `dlvsym`: interposers find "the real `dlsym`" with `dlvsym(RTLD_NEXT, "dlsym",
//!   version)` (HAMi-core asks for `GLIBC_2.2.5`, an older shim `GLIBC_2.34`). A versioned
//!   lookup skips every unversioned definition, ours included, so such an interposer
//!   loaded before us would hide us (and we it). That one request becomes
//!   `dlsym(RTLD_NEXT, "dlsym")` from the caller: the next `dlsym` after it, whoever
//!   defines it (us, another interposer, or glibc). Every other `dlvsym` is glibc's.
//!
//! Together: whatever the order of the interposers in `LD_PRELOAD` and
//! `/etc/ld.so.preload`, each one's `dlsym` calls the next one's, and each sees every
//! lookup that reaches it.

use super::{getter_for, is_getter, is_ours, slot_for, watch_slot_for};
use crate::dl::{GLIBC_DLSYM, GLIBC_DLVSYM, NEXT_DLSYM};
use crate::launch::{is_launch, kind_of};
use crate::watch::is_watched;
use std::ffi::{c_char, c_void, CStr};

/// Our answer to `dlsym(handle, name)` for a name starting with `cu` (null: the next
/// `dlsym` answers).
pub fn on_dlsym(handle: *mut c_void, name: &CStr) -> *mut c_void {
    let bytes = name.to_bytes();
    let getter = is_getter(bytes);
    let launch = !getter && std::str::from_utf8(bytes).is_ok_and(is_launch);
    let watched = !getter && !launch && std::str::from_utf8(bytes).is_ok_and(is_watched);
    if !getter && !launch && !watched {
        crate::trace::request("dlsym", bytes, 0, 0, false);
        return std::ptr::null_mut();
    }
    let real = crate::dl::next_dlsym(handle, name);
    if real.is_null() {
        return real;
    }
    // An interposer after us may answer with our own exported symbol: its reference to
    // its own function of that name resolves to ours, the first definition (HAMi-core's
    // hooks are such references). That answer is the one to give, as it is.
    let ours = if is_ours(real as usize) {
        Some(real as usize)
    } else if getter {
        getter_for(real as usize)
    } else if watched {
        watch_slot_for(
            real as usize,
            crate::watch::kind_of(&String::from_utf8_lossy(bytes), false),
        )
    } else {
        // A name asked of dlsym is the exported one: `_ptsz` says per-thread.
        slot_for(
            real as usize,
            kind_of(&String::from_utf8_lossy(bytes), false),
        )
    };
    crate::trace::request("dlsym", bytes, 0, 0, ours.is_some());
    // No slot left: the next dlsym's answer, unwrapped.
    ours.map_or(real, |w| w as *mut c_void)
}

/// Decides for the `dlsym` trampoline: our wrapper for `name`, or null to go on to the
/// next `dlsym`. Always leaves `NEXT_DLSYM` set when it can (the trampoline jumps through
/// it).
extern "C" fn dlsym_hook(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    if !crate::dl::resolve() || name.is_null() {
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

/// Decides for the `dlvsym` trampoline where to jump: glibc's `dlsym` for
/// `dlvsym(RTLD_NEXT, "dlsym", any version)` (the arguments it reads are the same two),
/// else glibc's `dlvsym` (0: neither found; the trampoline answers null).
extern "C" fn dlvsym_hook(handle: *mut c_void, name: *const c_char) -> usize {
    if !crate::dl::resolve() {
        return 0;
    }
    // SAFETY: dlvsym's contract: `name` is a NUL-terminated string (a null one is
    // glibc's to answer).
    let is_dlsym = !name.is_null() && unsafe { CStr::from_ptr(name) }.to_bytes() == b"dlsym";
    if handle == libc::RTLD_NEXT && is_dlsym {
        GLIBC_DLSYM.load(std::sync::atomic::Ordering::Acquire)
    } else {
        GLIBC_DLVSYM.load(std::sync::atomic::Ordering::Acquire)
    }
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
        "mov rax, qword ptr [rip + {next}]",
        "test rax, rax",
        "jz 3f",
        "jmp rax",
        "3:",
        "xor eax, eax",
        "ret",
        hook = sym dlsym_hook,
        next = sym NEXT_DLSYM,
    )
}

#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[unsafe(no_mangle)]
/// `dlvsym(3)`, interposed (see the module doc).
pub unsafe extern "C" fn dlvsym(
    handle: *mut c_void,
    name: *const c_char,
    version: *const c_char,
) -> *mut c_void {
    core::arch::naked_asm!(
        // Three pushes after the return address: the stack is 16-byte aligned for the call.
        "push rdi",
        "push rsi",
        "push rdx",
        "call {hook}",
        "pop rdx",
        "pop rsi",
        "pop rdi",
        "test rax, rax",
        "jz 2f",
        "jmp rax",
        "2:",
        "xor eax, eax",
        "ret",
        hook = sym dlvsym_hook,
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
        "adrp x9, {next}",
        "ldr x9, [x9, :lo12:{next}]",
        "cbz x9, 3f",
        "br x9",
        "3:",
        "mov x0, #0",
        "ret",
        hook = sym dlsym_hook,
        next = sym NEXT_DLSYM,
    )
}

#[cfg(target_arch = "aarch64")]
#[unsafe(naked)]
#[unsafe(no_mangle)]
/// `dlvsym(3)`, interposed (see the module doc).
pub unsafe extern "C" fn dlvsym(
    handle: *mut c_void,
    name: *const c_char,
    version: *const c_char,
) -> *mut c_void {
    core::arch::naked_asm!(
        "stp x29, x30, [sp, #-48]!",
        "stp x0, x1, [sp, #16]",
        "str x2, [sp, #32]",
        "bl {hook}",
        "mov x9, x0",
        "ldp x0, x1, [sp, #16]",
        "ldr x2, [sp, #32]",
        "ldp x29, x30, [sp], #48",
        "cbz x9, 2f",
        "br x9",
        "2:",
        "mov x0, #0",
        "ret",
        hook = sym dlvsym_hook,
    )
}
