//! Polling with a bound: wait until something holds, or check that it keeps holding.

use anyhow::{bail, Result};
use std::time::{Duration, Instant};

/// Polls `f` every 2 ms until it holds or `timeout` passes.
pub fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) -> Result<Duration> {
    let t = Instant::now();
    while t.elapsed() < timeout {
        if f() {
            return Ok(t.elapsed());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    bail!("timed out after {timeout:?} waiting for {what}")
}

/// Checks that `f` holds at every poll for `dur`.
pub fn holds_for(what: &str, dur: Duration, mut f: impl FnMut() -> bool) -> Result<()> {
    let t = Instant::now();
    while t.elapsed() < dur {
        if !f() {
            bail!("{what} stopped holding after {:?}", t.elapsed());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}
