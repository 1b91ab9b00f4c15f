//! A mapped file shrunk under the process must not kill it.
//!
//! The shim maps its doorbell page (read-write) and the agent's gate file (read-only).
//! The page lies in a directory other processes of the pod can write: if one truncates
//! it, the shim's next load or store in the mapping raises SIGBUS, whose default action
//! ends the CUDA process. The guard is the doorbell crate's ([`coloc_doorbell::guard`]),
//! installed when the first such mapping is registered (the first submission, never at
//! load time): a fault in a registered mapping maps private zeros over it, and the shim's
//! hook here turns the shim into a pass-through for good and writes one line on stderr;
//! the access is retried on the zeros. A SIGBUS anywhere else goes to the handler the
//! process had before, or to the default action: the process dies of it as it would have
//! without the shim.
//!
//! The hook only stores atomics and calls `write(2)`: async-signal-safe.

use crate::mode::{MODE, OFF};
use coloc_doorbell::guard::{self, Access};
use std::sync::atomic::{AtomicBool, Ordering::*};

static SAID: AtomicBool = AtomicBool::new(false);

/// Guards the mapping of `PAGE` bytes at `base`; false when the handler could not be
/// installed or every slot is taken (the mapping then stays unguarded, as before). The
/// zeros that replace a truncated mapping are readable and writable whatever the mapping
/// was: the shim's stores to its page land there, and the gate file is only read.
pub fn register(base: usize) -> bool {
    guard::on_rescue(rescued_hook);
    guard::register(base, Access::ReadWrite)
}

const RESCUE_LINE: &[u8] =
    b"libcoloc_cuda: a file the shim maps was truncated; passing every call through\n";

/// Runs in the SIGBUS handler after a rescue: the shim passes every call through from
/// now on, and says so once.
fn rescued_hook() {
    MODE.store(OFF, Release);
    if !SAID.swap(true, Relaxed) {
        // SAFETY: write(2) of a static buffer: async-signal-safe.
        unsafe { libc::write(2, RESCUE_LINE.as_ptr().cast(), RESCUE_LINE.len()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use coloc_doorbell::PAGE;
    use std::sync::atomic::AtomicBool;

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
        assert!(guard::install());
        // A SIGBUS that is not the shim's: the application's handler has it.
        // SAFETY: raise(3) on the calling thread.
        unsafe { libc::raise(libc::SIGBUS) };
        assert!(APP_SAW.load(SeqCst), "chained to the process's handler");
        let before = guard::rescued();
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
        assert_eq!(guard::rescued(), before + 1);
        assert_eq!(MODE.load(Acquire), OFF);
    }
}
