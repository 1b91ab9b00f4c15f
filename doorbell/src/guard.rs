//! A mapped file shrunk under the process that maps it must not kill that process.
//!
//! Both sides of a doorbell map files someone else can truncate: the node agent maps each
//! page a tenant owns (read-only), the shim maps its own page (read-write) in a directory
//! other processes of the pod can write, and the agent's gate file (read-only). A load or
//! store in a mapping whose file was shrunk raises SIGBUS, whose default action ends the
//! process. The guard: a SIGBUS handler, installed when the first mapping is registered,
//! that — when the faulting address lies in a registered page — maps private zeros over it
//! (`MAP_FIXED`, with the access the page was registered with), calls the hook set with
//! [`on_rescue`], and returns; the access is retried on the zeros (no magic: a doorbell
//! reader sees an invalid page). A SIGBUS anywhere else goes to the handler the process had
//! before (called as it asked to be: with or without `SA_SIGINFO`), or, where it had none,
//! to the default action: the process dies of it as it would have without the guard.
//!
//! The handler only reads atomics and the saved disposition, calls the hook, and calls
//! `mmap` and `sigaction`: async-signal-safe system calls. The hook must be
//! async-signal-safe too.
//!
//! ```text
//!  register(base, access) ─► slot            truncate(file) … load/store at base
//!                                                      │ SIGBUS
//!  handler: base in a slot? ── yes ─► mmap zeros over base, hook, return (retried: zeros)
//!                           └─ no ──► previous handler, or SIG_DFL (retried: dies)
//! ```

use crate::PAGE;
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::Once;

/// Pages that can be guarded at once (more are refused: see [`register`]).
pub const MAX_GUARDED: usize = 4096;

/// How a guarded page is mapped, and so how the zeros that replace it are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Read-only (the agent's view of a page, the shim's view of the gate file).
    Read,
    /// Read and written (the shim's own page).
    ReadWrite,
}

/// A slot holds a page's base address, its low bit set for [`Access::ReadWrite`]
/// (bases are page-aligned); 0 is a free slot.
const WRITABLE: usize = 1;

static SLOTS: [AtomicUsize; MAX_GUARDED] = [const { AtomicUsize::new(0) }; MAX_GUARDED];
static RESCUED: AtomicU64 = AtomicU64::new(0);
/// The hook called after a rescue (a `fn()`; 0: none).
static HOOK: AtomicUsize = AtomicUsize::new(0);
static INSTALL: Once = Once::new();
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The process's SIGBUS disposition before ours.
struct Previous(UnsafeCell<Option<libc::sigaction>>);
// SAFETY: written by `install` only while the disposition in force is not our handler (so
// no rescue can be reading it through this installation), before the sigaction system call
// that installs ours; read-only afterwards.
unsafe impl Sync for Previous {}
static PREVIOUS: Previous = Previous(UnsafeCell::new(None));

/// Guards the mapping of [`PAGE`] bytes at `base` (page-aligned). False when the handler
/// could not be installed or every slot is taken: the mapping is then unguarded, and a
/// caller that cannot afford that must not keep it.
pub fn register(base: usize, access: Access) -> bool {
    debug_assert_eq!(base & (PAGE - 1), 0, "a guarded mapping starts a page");
    INSTALL.call_once(|| {
        install();
    });
    let word = match access {
        Access::Read => base,
        Access::ReadWrite => base | WRITABLE,
    };
    INSTALLED.load(Acquire)
        && base != 0
        && SLOTS
            .iter()
            .any(|s| s.compare_exchange(0, word, AcqRel, Acquire).is_ok())
}

/// Forgets the mapping at `base` (call it before unmapping).
pub fn unregister(base: usize) {
    if let Some(s) = SLOTS.iter().find(|s| s.load(Acquire) & !WRITABLE == base) {
        s.store(0, Release);
    }
}

/// Faults on shrunk mappings absorbed since the process started.
pub fn rescued() -> u64 {
    RESCUED.load(Relaxed)
}

/// Sets the function called in the signal handler after each rescue (the shim turns
/// itself into a pass-through). It runs in a signal handler: it must be
/// async-signal-safe (atomics, `write(2)`; no allocation, no lock).
pub fn on_rescue(hook: fn()) {
    HOOK.store(hook as usize, Release);
}

/// Installs the handler now, saving the disposition in force to chain to; true when ours is
/// in force afterwards. [`register`] calls it once on its first use; call it again only
/// where the process may have replaced the handler since (ours is never saved as the
/// previous one).
pub fn install() -> bool {
    // SAFETY: sigaction with a zeroed struct naming our handler (SA_SIGINFO: si_addr is
    // given; SA_NODEFER: a fault in the handler's retry is not blocked; SA_ONSTACK: a
    // thread's alternate stack when it has one). The previous disposition is read first;
    // it is saved before ours is installed.
    let ok = unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = handler as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_NODEFER | libc::SA_ONSTACK;
        libc::sigemptyset(&mut sa.sa_mask);
        let mut old: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut old) != 0 {
            false
        } else if old.sa_sigaction == handler as *const () as usize {
            // Ours already: what it saved stays (never chain to ourselves).
            true
        } else {
            *PREVIOUS.0.get() = Some(old);
            libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut()) == 0
        }
    };
    INSTALLED.store(ok, Release);
    ok
}

extern "C" fn handler(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler; for SIGBUS,
    // si_addr is the faulting address.
    let addr = unsafe { (*info).si_addr() } as usize;
    let base = addr & !(PAGE - 1);
    let slot = (base != 0)
        .then(|| {
            SLOTS
                .iter()
                .map(|s| s.load(Acquire))
                .find(|w| w & !WRITABLE == base)
        })
        .flatten();
    if let Some(word) = slot {
        let prot = if word & WRITABLE != 0 {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: replaces exactly the registered page (PAGE bytes, mapped by the process
        // that registered it) with private zeros of the same access; nothing else is
        // touched.
        let r = unsafe {
            libc::mmap(
                base as *mut libc::c_void,
                PAGE,
                prot,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if r != libc::MAP_FAILED {
            RESCUED.fetch_add(1, Relaxed);
            let hook = HOOK.load(Acquire);
            if hook != 0 {
                // SAFETY: HOOK only ever holds a `fn()` stored by `on_rescue`.
                let hook: fn() = unsafe { std::mem::transmute::<usize, fn()>(hook) };
                hook();
            }
            return;
        }
    }
    // Not ours (or the remap failed): what the process had before.
    // SAFETY: PREVIOUS is written only while our handler is not in force (see `Previous`).
    let prev = unsafe { *PREVIOUS.0.get() };
    match prev {
        Some(p)
            if p.sa_sigaction != libc::SIG_DFL
                && p.sa_sigaction != libc::SIG_IGN
                && p.sa_sigaction != handler as *const () as usize =>
        {
            // SAFETY: the process's own handler, called the way it was installed.
            unsafe {
                if p.sa_flags & libc::SA_SIGINFO != 0 {
                    let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                        std::mem::transmute(p.sa_sigaction);
                    f(sig, info, ctx);
                } else {
                    let f: extern "C" fn(libc::c_int) = std::mem::transmute(p.sa_sigaction);
                    f(sig);
                }
            }
        }
        _ => {
            // The default action, on the retried fault (SIG_IGN for a fault is the same).
            // SAFETY: restoring SIG_DFL is async-signal-safe.
            unsafe { libc::signal(libc::SIGBUS, libc::SIG_DFL) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    static HOOKED: AtomicU64 = AtomicU64::new(0);

    fn hook() {
        HOOKED.fetch_add(1, Relaxed);
    }

    /// The only test of this crate that raises SIGBUS: a read-only page of a file mapped
    /// and registered, the file truncated: the load reads zeros, the hook ran once; after
    /// `unregister`, the slot is free again.
    #[test]
    fn a_truncated_read_only_page_reads_zeros_and_calls_the_hook() {
        let f = tempfile::tempfile().unwrap();
        f.set_len(PAGE as u64).unwrap();
        std::os::unix::fs::FileExt::write_at(&f, &[7u8; 8], 0).unwrap();
        // SAFETY: a shared read-only mapping of a page-long file.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        on_rescue(hook);
        assert!(register(base as usize, Access::Read));
        let word = base as *const u64;
        // SAFETY: the mapping is live; its file holds eight 7s.
        assert_eq!(unsafe { word.read_volatile() }, 0x0707_0707_0707_0707);
        let before = rescued();
        f.set_len(0).unwrap();
        // SAFETY: the mapping stays; its file is gone under it (the fault is the test).
        assert_eq!(unsafe { word.read_volatile() }, 0, "the private zeros");
        assert_eq!(rescued(), before + 1);
        assert_eq!(HOOKED.load(Relaxed), 1);
        unregister(base as usize);
        assert!(
            !SLOTS
                .iter()
                .any(|s| s.load(Acquire) & !WRITABLE == base as usize),
            "the slot was freed"
        );
        // SAFETY: our own mapping, unregistered first.
        unsafe { libc::munmap(base, PAGE) };
    }
}
