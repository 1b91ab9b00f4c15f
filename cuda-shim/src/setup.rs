//! The first submission decides the mode: the environment ([`crate::config`]), the
//! driver's helpers ([`crate::driver`]), the page ([`crate::page`]) and, offline, the
//! launch gate ([`crate::gate`]). Never in a constructor: nothing runs at load time.

use crate::config::Config;
use crate::mode::{self, GATED, MODE, OFF, ON, OPEN, UNSET, WAIT};
use coloc_doorbell::CLASS_ONLINE;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::sync::{Once, OnceLock};

static INIT: Once = Once::new();
/// The settings, kept while the page waits for its directory ([`WAIT`]).
static WAITING: OnceLock<Config> = OnceLock::new();
/// When the page was last tried, ns; one thread tries at a time.
static LAST_TRY_NS: AtomicU64 = AtomicU64::new(0);
static TRYING: AtomicBool = AtomicBool::new(false);
/// How often a page the directory refused is tried again.
const RETRY_NS: u64 = 1_000_000_000;

/// The mode, deciding it on the first call.
#[inline(always)]
pub fn mode() -> u8 {
    match MODE.load(Acquire) {
        UNSET => init_mode(),
        m => m,
    }
}

#[cold]
#[inline(never)]
fn init_mode() -> u8 {
    INIT.call_once(|| {
        let m = std::panic::catch_unwind(init).unwrap_or(OFF);
        // A fork child or a failure may have turned the shim off meanwhile.
        let _ = MODE.compare_exchange(UNSET, m, AcqRel, Acquire);
    });
    MODE.load(Acquire)
}

fn init() -> u8 {
    let c = match Config::from_env() {
        Ok(Some(c)) => c,
        Ok(None) => return OFF,
        Err(e) => return mode::failed(&e),
    };
    if !crate::driver::resolve_helpers() {
        return mode::failed(
            "cannot find cuCtxGetCurrent/cuCtxGetDevice/cuDeviceGetUuid in the driver",
        );
    }
    let online = c.class == CLASS_ONLINE;
    if !online {
        if let Err(e) = crate::gate::configure(&c.gate) {
            return mode::failed(&e);
        }
    }
    let dir = std::path::Path::new(&c.doorbell_dir);
    if let Err(e) = crate::page::create(dir, c.class, c.wake_gap_ns) {
        // (Not there yet, or not writable yet: the agent makes a pod's directory when it
        // sees the pod, and a container can start first.) Tried again every second.
        let msg = format!(
            "cannot create a doorbell in {}: {e}; passing every call through, trying again every second",
            dir.display()
        );
        mode::warn_once(&WAIT_WARNED, &msg);
        LAST_TRY_NS.store(mono_ns(), Relaxed);
        let _ = WAITING.set(c);
        // SAFETY: registering a plain extern "C" function.
        unsafe { libc::pthread_atfork(None, None, Some(wait_fork_child)) };
        return WAIT;
    }
    finish(&c)
}

static WAIT_WARNED: AtomicBool = AtomicBool::new(false);

/// A forked child of a process still waiting for its page does not try for one.
extern "C" fn wait_fork_child() {
    let _ = MODE.compare_exchange(WAIT, OFF, Relaxed, Relaxed);
}

/// In [`WAIT`]: tries the page again if a second has passed since the last try (one
/// thread at a time; the others pass through). On success the mode becomes what the
/// first submission would have made it.
#[cold]
#[inline(never)]
pub fn retry() {
    let now = mono_ns();
    let last = LAST_TRY_NS.load(Relaxed);
    // One ticket per second (the compare-exchange), one thread at a time, and only while
    // still waiting: a thread that read the old time before another's try made the page
    // gets no second page.
    if now.saturating_sub(last) < RETRY_NS
        || LAST_TRY_NS
            .compare_exchange(last, now, AcqRel, Relaxed)
            .is_err()
        || TRYING.swap(true, Acquire)
    {
        return;
    }
    if MODE.load(Acquire) != WAIT {
        TRYING.store(false, Release);
        return;
    }
    let m = std::panic::catch_unwind(|| {
        let c = WAITING.get()?;
        let dir = std::path::Path::new(&c.doorbell_dir);
        crate::page::create(dir, c.class, c.wake_gap_ns).ok()?;
        Some(finish(c))
    })
    .unwrap_or(Some(OFF));
    if let Some(m) = m {
        let _ = MODE.compare_exchange(WAIT, m, AcqRel, Acquire);
    }
    TRYING.store(false, Release);
}

/// `CLOCK_MONOTONIC_COARSE`, ns: the retry timer (no step back with the wall clock, and
/// the cheapest clock read on the pass-through path).
fn mono_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The page is made: online rings it; offline starts its gate.
fn finish(c: &Config) -> u8 {
    if c.class == CLASS_ONLINE {
        return ON;
    }
    // The gate is in force from the first submission if the agent's file is there.
    let m = if crate::gate::map_at_start() {
        GATED
    } else {
        OPEN
    };
    match crate::gate::start_watcher() {
        Ok(()) => m,
        Err(e) => mode::failed(&e),
    }
}
