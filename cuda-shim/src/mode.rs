//! The shim's mode, and its one line on stderr when it gives up.
//!
//! Modes: *unset* (nothing decided yet), *on* (online process with a doorbell page),
//! *open* (offline process with a page, gate not in force: pass-through), *gated*
//! (offline process, gate file mapped: see [`crate::gate`]), *off* (any other class, no
//! `COLOC_DOORBELL_DIR`, a forked child, or an internal failure). The launch path reads
//! the mode once; *off* and *open* cost that load and a branch. The first submission
//! decides it ([`crate::setup`]); after that it only moves from *wait* to *on* or *open*
//! (the page could be made at last), from *open* to *gated* (the gate file appeared) and
//! from anything to *off*. *Wait* (no page yet) passes through like *off*.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering::*};

/// Nothing decided yet.
pub const UNSET: u8 = 0;
/// Online, with a doorbell page.
pub const ON: u8 = 1;
/// Pass-through.
pub const OFF: u8 = 2;
/// Offline with a page; the gate is not in force (no valid, fresh gate file yet).
pub const OPEN: u8 = 3;
/// Offline, gate file mapped: submissions go through [`crate::gate::submit`].
pub const GATED: u8 = 4;
/// No page yet: the doorbell directory refused it (not there yet, or not writable: on
/// Kubernetes the agent makes the pod's directory writable when it sees the pod). Pass-
/// through, trying again at most once a second ([`crate::setup::retry`]).
pub const WAIT: u8 = 5;

/// The mode (Acquire loads: a thread that sees *on* or *gated* sees the page and the gate
/// state set up before).
pub static MODE: AtomicU8 = AtomicU8::new(UNSET);
static FAILED: AtomicBool = AtomicBool::new(false);

/// Turns the shim into a pass-through for good, with one line on stderr (any internal
/// failure after the start).
pub fn disable(msg: &str) {
    MODE.store(OFF, Release);
    warn_once(&FAILED, &format!("{msg}; passing every call through"));
}

/// The one line for a failure at the start (the caller makes the mode *off*).
pub fn failed(msg: &str) -> u8 {
    warn_once(&FAILED, &format!("{msg}; passing every call through"));
    OFF
}

/// One line on stderr, at most once per reason kind, never panicking.
pub fn warn_once(flag: &AtomicBool, msg: &str) {
    if !flag.swap(true, Relaxed) {
        let line = format!("libcoloc_cuda: {msg}\n");
        // SAFETY: writing a valid buffer to fd 2; errors are ignored on purpose.
        unsafe {
            libc::write(2, line.as_ptr().cast(), line.len());
        }
    }
}
