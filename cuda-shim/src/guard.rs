//! A mapped file shrunk under the process must not kill it.
//!
//! The shim maps its doorbell page (read-write) and the agent's gate file (read-only).
//! The page lies in a directory other processes of the pod can write: if one truncates
//! it, the shim's next load or store in the mapping raises SIGBUS, whose default action
//! ends the CUDA process. The guard: a SIGBUS handler, installed when the first such
//! mapping is made (the first submission, never at load time), that — when the faulting
//! address lies in a registered mapping — maps private zeros over it (`MAP_FIXED`), turns
//! the shim into a pass-through for good, writes one line on stderr, and returns; the
//! access is retried on the zeros. A SIGBUS anywhere else goes to the handler the process
//! had before (called as it asked to be: with or without `SA_SIGINFO`), or, where it had
//! none, to the default action: the process dies of it as it would have without the
//! shim.
//!
//! The handler only reads atomics and the saved disposition, and calls `mmap`, `write`
//! and `sigaction`, async-signal-safe system calls.

use crate::mode::{MODE, OFF};
use coloc_doorbell::PAGE;
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::Once;

/// Mappings guarded at once (one page, and one gate file per agent restart).
const MAX_GUARDED: usize = 64;

static SLOTS: [AtomicUsize; MAX_GUARDED] = [const { AtomicUsize::new(0) }; MAX_GUARDED];
static RESCUED: AtomicU64 = AtomicU64::new(0);
static SAID: AtomicBool = AtomicBool::new(false);
static INSTALL: Once = Once::new();
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The process's SIGBUS disposition before ours (written once, before ours is installed).
struct Previous(UnsafeCell<Option<libc::sigaction>>);
// SAFETY: written once inside `INSTALL` before the handler that reads it can run (the
// sigaction system call orders them); read-only afterwards.
unsafe impl Sync for Previous {}
static PREVIOUS: Previous = Previous(UnsafeCell::new(None));

/// Guards the mapping of `PAGE` bytes at `base`; false when the handler could not be
/// installed or every slot is taken (the mapping then stays unguarded, as before).
pub fn register(base: usize) -> bool {
    INSTALL.call_once(install);
    INSTALLED.load(Acquire)
        && SLOTS
            .iter()
            .any(|s| s.compare_exchange(0, base, AcqRel, Acquire).is_ok())
}

/// Faults on shrunk mappings absorbed so far.
#[cfg(test)]
pub fn rescued() -> u64 {
    RESCUED.load(Relaxed)
}

fn install() {
    // SAFETY: sigaction with a zeroed struct naming our handler (SA_SIGINFO: si_addr is
    // given; SA_NODEFER: a fault in the handler's retry is not blocked); the previous
    // disposition is saved first, then ours installed, in one call.
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
}

const RESCUE_LINE: &[u8] =
    b"libcoloc_cuda: a file the shim maps was truncated; passing every call through\n";

extern "C" fn handler(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler; for SIGBUS,
    // si_addr is the faulting address.
    let addr = unsafe { (*info).si_addr() } as usize;
    let base = addr & !(PAGE - 1);
    if base != 0 && SLOTS.iter().any(|s| s.load(Acquire) == base) {
        // SAFETY: replaces exactly the registered mapping (ours, PAGE bytes) with private
        // zeros, readable and writable as the page was; nothing else is touched.
        let r = unsafe {
            libc::mmap(
                base as *mut libc::c_void,
                PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if r != libc::MAP_FAILED {
            MODE.store(OFF, Release);
            RESCUED.fetch_add(1, Relaxed);
            if !SAID.swap(true, Relaxed) {
                // SAFETY: write(2) of a static buffer: async-signal-safe.
                unsafe { libc::write(2, RESCUE_LINE.as_ptr().cast(), RESCUE_LINE.len()) };
            }
            return;
        }
    }
    // Not ours: what the process had before.
    // SAFETY: PREVIOUS is written before this handler was installed, never after.
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

    static APP_SAW: AtomicBool = AtomicBool::new(false);

    extern "C" fn app_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
        APP_SAW.store(true, SeqCst);
    }

    /// The only test that raises SIGBUS (the guard is installed once per process): a
    /// SIGBUS not in a registered mapping goes to the handler the process had; a page of a
    /// file mapped and registered, the file truncated: the access takes private zeros and
    /// the shim is off.
    #[test]
    fn a_truncated_mapping_is_rescued_and_other_faults_go_to_the_process_s_handler() {
        // SAFETY: installs a plain SA_SIGINFO handler of the test's, as an application
        // would before the shim's first submission.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = app_handler as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO;
            libc::sigemptyset(&mut sa.sa_mask);
            assert_eq!(libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut()), 0);
        }
        let path = std::env::temp_dir().join(format!("coloc-shim-guard-{}", std::process::id()));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        // Unlinked at once: nothing is left behind, whatever happens below.
        std::fs::remove_file(&path).unwrap();
        f.set_len(PAGE as u64).unwrap();
        use std::os::fd::AsRawFd;
        // SAFETY: a shared read-write mapping of a page-long file.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        assert!(register(base as usize));
        // Another test may have installed the guard before this test's handler replaced
        // it: install it again over the test's handler, as the shim's first submission
        // would in an application that has one.
        install();
        assert!(INSTALLED.load(Acquire));
        // A SIGBUS that is not the shim's: the application's handler has it.
        // SAFETY: raise(3) on the calling thread.
        unsafe { libc::raise(libc::SIGBUS) };
        assert!(APP_SAW.load(SeqCst), "chained to the process's handler");
        assert_eq!(rescued(), 0);
        let word = base as *mut u64;
        MODE.store(crate::mode::ON, Release);
        f.set_len(0).unwrap();
        // SAFETY: the mapping stays; its file is gone under it (the fault is the test).
        unsafe { word.write_volatile(9) };
        // SAFETY: as above, now the private page.
        assert_eq!(
            unsafe { word.read_volatile() },
            9,
            "the private page took the store"
        );
        assert_eq!(rescued(), 1);
        assert_eq!(MODE.load(Acquire), OFF);
    }
}
