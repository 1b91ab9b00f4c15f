//! Time: the wall clock in nanoseconds since the Unix epoch, the clock of NVML's sample
//! timestamps, and a clock that never steps for the waits that must last as long as they
//! say whatever the wall clock does. The loop reads time only through [`Clock`], so its
//! tests run on a fake one.

/// A source of the current time.
pub trait Clock: Send + Sync {
    /// Nanoseconds since the Unix epoch.
    fn now_ns(&self) -> u64;
    /// Nanoseconds since an arbitrary start, on a clock that never steps (an NTP step of
    /// the wall clock moves [`Clock::now_ns`], not this): for how long a wait has lasted.
    fn elapsed_ns(&self) -> u64;
}

/// The system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ns(&self) -> u64 {
        now_ns()
    }
    /// `CLOCK_MONOTONIC`, from the first call in this process.
    fn elapsed_ns(&self) -> u64 {
        static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        START
            .get_or_init(std::time::Instant::now)
            .elapsed()
            .as_nanos() as u64
    }
}

/// Wall clock, ns since the Unix epoch.
pub fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}
