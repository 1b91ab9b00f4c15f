//! A page file shrunk under the agent must not kill it.
//!
//! A doorbell page is a file its tenant owns. If the tenant truncates it while the agent
//! has it mapped, the agent's next load from the mapping raises SIGBUS, whose default
//! action ends the agent (and with it every suspension's owner). The guard: a SIGBUS
//! handler that, when the faulting address lies in a registered page, maps a private zero
//! page over it (`MAP_FIXED`) and returns. The load is then retried and reads zeros: no
//! magic, so the page counts as invalid, and the next rescan drops it. A SIGBUS anywhere
//! else restores the default action and the fault happens again: the agent dies as it
//! would have without the guard.
//!
//! The handler only reads atomics and calls `mmap` and `sigaction`, both async-signal-safe
//! system calls.

use coloc_doorbell::PAGE;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::*};
use std::sync::Once;

/// Pages that can be guarded at once (more pages are refused: see [`register`]).
pub const MAX_GUARDED: usize = 4096;

static SLOTS: [AtomicUsize; MAX_GUARDED] = [const { AtomicUsize::new(0) }; MAX_GUARDED];
static RESCUED: AtomicU64 = AtomicU64::new(0);
static INSTALL: Once = Once::new();
static INSTALLED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Registers the mapping at `base` (PAGE bytes). Returns false when the handler could not
/// be installed or every slot is taken: the caller must not map the page then.
pub fn register(base: usize) -> bool {
    INSTALL.call_once(install);
    if !INSTALLED.load(Acquire) {
        return false;
    }
    SLOTS
        .iter()
        .any(|s| s.compare_exchange(0, base, AcqRel, Acquire).is_ok())
}

/// Forgets the mapping at `base` (before it is unmapped).
pub fn unregister(base: usize) {
    if let Some(s) = SLOTS.iter().find(|s| s.load(Acquire) == base) {
        s.store(0, Release);
    }
}

/// How many faults on shrunk pages were absorbed since start.
pub fn rescued() -> u64 {
    RESCUED.load(Relaxed)
}

fn install() {
    // SAFETY: a zeroed sigaction with our handler, SA_SIGINFO so that si_addr is given.
    let ok = unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = handler as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_NODEFER;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut()) == 0
    };
    INSTALLED.store(ok, Release);
}

extern "C" fn handler(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers; si_addr is the
    // faulting address for SIGBUS.
    let addr = unsafe { (*info).si_addr() } as usize;
    let base = addr & !(PAGE - 1);
    if base != 0 && SLOTS.iter().any(|s| s.load(Acquire) == base) {
        // SAFETY: replaces exactly the registered page (ours, PAGE bytes) with private
        // zeros; nothing else is touched.
        let r = unsafe {
            libc::mmap(
                base as *mut libc::c_void,
                PAGE,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if r != libc::MAP_FAILED {
            RESCUED.fetch_add(1, Relaxed);
            return;
        }
    }
    // Not ours (or the remap failed): the default action, on the retried fault.
    // SAFETY: restoring SIG_DFL is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGBUS, libc::SIG_DFL);
    }
}
