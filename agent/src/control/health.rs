//! When NVML fails, and what the agent does about it.
//!
//! **Transient** answers are absorbed where they happen (the sampler retries
//! `INSUFFICIENT_SIZE`) and, past that, by this policy: a GPU whose calls fail keeps its
//! last decisions (suspended work stays suspended, the idle window keeps running) until
//! the failure **persists**: every call for that GPU has failed on at least
//! [`MIN_FAILED_TICKS`] consecutive ticks spanning at least `--nvml-failure-grace`
//! (default 50 ms). Continuation that GPU fails open — its offline work is resumed and it is left
//! unmanaged — while the other GPUs stay protected. The first successful tick makes it
//! managed again; samples from before that moment are ignored, so no old sample starts
//! the next busy period.
//!
//! A **hung** call is caught by the shell's watchdog thread (`shell/watchdog.rs`).

use std::collections::BTreeMap;
use std::time::Duration;

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
