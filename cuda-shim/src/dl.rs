//! glibc's `dlsym`, for the shim's own lookups and for its `dlsym` trampoline
//! (`hooks::dlsym`) to jump to.

use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::*};

/// glibc's `dlsym`, found with `dlvsym` (never through ourselves).
pub static REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);
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
            crate::mode::warn_once(&NO_DLSYM, "cannot find glibc's dlsym; the shim is inactive");
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
