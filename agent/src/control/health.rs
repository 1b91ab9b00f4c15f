//! When NVML fails, and what the agent does about it.
//!
//! **Transient** answers are absorbed where they happen (the sampler retries
//! `INSUFFICIENT_SIZE`) and, past that, by this policy: a GPU whose calls fail keeps its
//! last decisions (suspended work stays suspended, the idle window keeps running) until
//! the failure **persists**: every call for that GPU has failed on at least
//! [`MIN_FAILED_TICKS`] consecutive ticks spanning at least `--nvml-failure-grace`
//! (default 50 ms). Then that GPU fails open — its offline work is resumed and it is left
//! unmanaged — while the other GPUs stay protected. The first successful tick makes it
//! managed again; samples from before that moment are ignored, so no old sample starts
//! the next busy period.
//!
//! A **hung** call is caught by a [`Watchdog`] thread: when one NVML call of the loop has
//! not returned after `--nvml-hang-timeout`, it resumes every hold itself (the loop thread
//! is stuck in the driver), counts `coloc_fail_open_total{reason="nvml_hung"}` and makes
//! `/readyz` answer 503 until the call returns.

use crate::control::hands::Hands;
use crate::control::state::Shared;
use crate::edges::clock::Clock;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::{error, info};

/// Consecutive failed ticks before a GPU's failure can count as persistent.
pub const MIN_FAILED_TICKS: u32 = 3;

#[derive(Debug, Default)]
struct GpuHealth {
    failing_since: Option<u64>,
    failed_ticks: u32,
    degraded: bool,
    last_error: String,
}

/// What a tick's result means for a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// All is well.
    Healthy,
    /// It answered again after failing persistently.
    Recovered,
    /// It failed, not (yet) persistently: keep its last decisions.
    Transient,
    /// Its failure just became persistent: fail open for it.
    FailOpen,
    /// Still failing persistently.
    StillDegraded,
}

/// Per-GPU failure tracking.
#[derive(Debug)]
pub struct Health {
    grace_ns: u64,
    gpus: BTreeMap<u32, GpuHealth>,
}

impl Health {
    /// A policy with the given grace.
    pub fn new(grace: Duration) -> Health {
        Health {
            grace_ns: grace.as_nanos() as u64,
            gpus: BTreeMap::new(),
        }
    }

    /// A tick in which every call for `gpu` succeeded.
    pub fn ok(&mut self, gpu: u32) -> Verdict {
        let h = self.gpus.entry(gpu).or_default();
        let was = h.degraded;
        *h = GpuHealth::default();
        if was {
            Verdict::Recovered
        } else {
            Verdict::Healthy
        }
    }

    /// A tick in which a call for `gpu` failed with `error` (a bounded reason).
    pub fn failed(&mut self, gpu: u32, now: u64, error: String) -> Verdict {
        let grace = self.grace_ns;
        let h = self.gpus.entry(gpu).or_default();
        let since = *h.failing_since.get_or_insert(now);
        h.failed_ticks += 1;
        h.last_error = error;
        if h.degraded {
            return Verdict::StillDegraded;
        }
        if h.failed_ticks >= MIN_FAILED_TICKS && now.saturating_sub(since) >= grace {
            h.degraded = true;
            return Verdict::FailOpen;
        }
        Verdict::Transient
    }

    /// Whether `gpu` has failed open and is unmanaged.
    pub fn degraded(&self, gpu: u32) -> bool {
        self.gpus.get(&gpu).is_some_and(|h| h.degraded)
    }

    /// A sentence on what is degraded, if anything.
    pub fn describe(&self) -> Option<String> {
        let bad: Vec<String> = self
            .gpus
            .iter()
            .filter(|(_, h)| h.degraded)
            .map(|(g, h)| format!("GPU {g} ({})", h.last_error))
            .collect();
        (!bad.is_empty()).then(|| {
            format!(
                "NVML failing on {}: its offline work was resumed (fail-open)",
                bad.join(", ")
            )
        })
    }
}

/// Watches the loop's NVML calls from another thread.
#[derive(Debug, Default)]
pub struct Watchdog {
    /// Wall time the current call started (0: no call in progress).
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

    /// One check: fails open if a call has been in progress for longer than `timeout`.
    /// Returns whether it did.
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
                    me.check(clock.now_ns(), timeout, &hands, budget, &shared);
                }
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn a_failure_persists_after_three_ticks_and_the_grace() {
        let mut h = Health::new(Duration::from_millis(50));
        assert_eq!(h.failed(0, 0, "x".into()), Verdict::Transient);
        assert_eq!(h.failed(0, MS, "x".into()), Verdict::Transient);
        // Three ticks, but only 2 ms: still transient.
        assert_eq!(h.failed(0, 2 * MS, "x".into()), Verdict::Transient);
        assert_eq!(h.failed(0, 49 * MS, "x".into()), Verdict::Transient);
        assert_eq!(h.failed(0, 50 * MS, "x".into()), Verdict::FailOpen);
        assert_eq!(h.failed(0, 51 * MS, "x".into()), Verdict::StillDegraded);
        assert!(h.degraded(0) && !h.degraded(1));
        assert!(h.describe().unwrap().contains("GPU 0"));
        assert_eq!(h.ok(0), Verdict::Recovered);
        assert_eq!(h.ok(0), Verdict::Healthy);
        // A success in between starts the count again.
        h.failed(1, 0, "x".into());
        h.failed(1, 30 * MS, "x".into());
        h.ok(1);
        assert_eq!(h.failed(1, 60 * MS, "x".into()), Verdict::Transient);
        assert_eq!(h.failed(1, 100 * MS, "x".into()), Verdict::Transient);
        assert_eq!(h.failed(1, 200 * MS, "x".into()), Verdict::FailOpen);
    }
}
