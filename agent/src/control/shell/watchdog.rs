//! The NVML watchdog: when one NVML call of the loop has not returned after
//! `--nvml-hang-timeout`, it resumes every hold itself through the hands (the loop thread
//! is stuck in the driver), counts `coloc_fail_open_total{reason="nvml_hung"}` and makes
//! `/readyz` answer 503 until the call returns; the controller is then told
//! ([`crate::control::io::Obs::WatchdogTripped`]).
//!
//! May touch: what the hands touch, on its own thread.

use crate::control::shell::hands::Hands;
use crate::control::state::Shared;
use crate::edges::clock::Clock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::{error, info};

/// Watches the loop's NVML calls from another thread.
#[derive(Debug, Default)]
pub struct Watchdog {
    /// When the current call started, in elapsed time ([`Clock::elapsed_ns`]: a step of
    /// the wall clock neither hides a hung call nor trips on a quick one; 0: no call in
    /// progress).
    call_since_ns: AtomicU64,
    /// The watchdog resumed everything during the current call.
    tripped: AtomicBool,
}

impl Watchdog {
    /// The loop starts its NVML calls.
    pub fn enter(&self, now: u64) {
        self.call_since_ns.store(now.max(1), Ordering::SeqCst);
    }

    /// The loop's NVML calls returned. Returns whether the watchdog failed open meanwhile
    /// (the loop must then forget its decisions and old samples).
    pub fn leave(&self, hands: &Mutex<Hands>) -> bool {
        // Under the hands' lock, so that the watchdog never acts on a call that has ended.
        let _g = hands.lock().unwrap_or_else(|e| e.into_inner());
        self.call_since_ns.store(0, Ordering::SeqCst);
        self.tripped.swap(false, Ordering::SeqCst)
    }

    /// One check at `now` (elapsed time, [`Clock::elapsed_ns`]): fails open if a call has
    /// been in progress for longer than `timeout`. Returns whether it did.
    pub fn check(
        &self,
        now: u64,
        timeout: Duration,
        hands: &Mutex<Hands>,
        budget: Duration,
        shared: &Shared,
    ) -> bool {
        let mut h = hands.lock().unwrap_or_else(|e| e.into_inner());
        let since = self.call_since_ns.load(Ordering::SeqCst);
        if since == 0 || self.tripped.load(Ordering::SeqCst) {
            return false;
        }
        let stuck = now.saturating_sub(since);
        if stuck < timeout.as_nanos() as u64 {
            return false;
        }
        self.tripped.store(true, Ordering::SeqCst);
        let why = format!(
            "an NVML call has not returned for {:.0} ms",
            stuck as f64 / 1e6
        );
        error!(reason = %why, "NVML call hung: failing open, resuming all offline work");
        metrics::counter!("coloc_fail_open_total", "reason" => "nvml_hung").increment(1);
        shared.set_degraded(Some(format!("{why}: offline work was resumed (fail-open)")));
        let n = h.resume_everything(budget);
        info!(resumed = n, "Watchdog resumed offline work");
        true
    }

    /// Runs checks every quarter of `timeout` (at least 1 ms) until `shared.stop`.
    pub fn spawn(
        self: &Arc<Self>,
        timeout: Duration,
        hands: Arc<Mutex<Hands>>,
        budget: Duration,
        shared: Arc<Shared>,
        clock: Arc<dyn Clock>,
    ) -> std::io::Result<std::thread::JoinHandle<()>> {
        let me = self.clone();
        let every = (timeout / 4).max(Duration::from_millis(1));
        std::thread::Builder::new()
            .name("coloc-watchdog".into())
            .spawn(move || {
                while !shared.stop.load(Ordering::Relaxed) {
                    std::thread::sleep(every);
                    me.check(clock.elapsed_ns(), timeout, &hands, budget, &shared);
                }
            })
    }
}
