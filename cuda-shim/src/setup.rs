//! The first submission decides the mode: the environment ([`crate::config`]), the
//! driver's helpers ([`crate::driver`]), the page ([`crate::page`]) and, offline, the
//! launch gate ([`crate::gate`]). Never in a constructor: nothing runs at load time.

use crate::config::Config;
use crate::mode::{self, GATED, MODE, OFF, ON, OPEN, UNSET};
use coloc_doorbell::CLASS_ONLINE;
use std::sync::atomic::Ordering::*;
use std::sync::Once;

static INIT: Once = Once::new();

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
        return mode::failed(&format!(
            "cannot create a doorbell in {}: {e}",
            dir.display()
        ));
    }
    if online {
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
