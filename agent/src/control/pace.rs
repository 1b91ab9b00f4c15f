//! Pacing: when the loop wakes, when a tick runs the state machine, and when `/state` is
//! published.

use qos_core::GpuState;
use std::time::Duration;

/// How often `/state` is published, ns.
pub const PUBLISH_NS: u64 = 100_000_000;

/// What pacing keeps between ticks.
#[derive(Debug)]
pub struct Pacer {
    poll: Duration,
    idle_poll: Duration,
    /// The state machine must run at the next tick whatever changed (start, fail-open,
    /// publication).
    decide_next: bool,
    last_publish_ns: u64,
}

/// What the wait depends on, from the other rooms.
#[derive(Debug, Default)]
pub struct Due {
    /// An event waits with nothing pending, a retry waits, a duty cycle runs, or the
    /// lists were asked for: the fast tick.
    pub fast: bool,
    /// The next check of a pending confirmation.
    pub next_check: Option<u64>,
    /// The next re-check of held targets (some are held).
    pub recheck: Option<u64>,
    /// Offline work is present (the samples are read at their interval).
    pub offline: bool,
    /// The next sample read and list read.
    pub reads: (u64, u64),
    /// The next heartbeat, while a gate is closed.
    pub beat: Option<u64>,
    /// When the vault looks again (a memory read, a driver call's end).
    pub vault: Option<u64>,
}

impl Pacer {
    /// Pacing with `--poll-interval` and `--idle-poll-interval` (each GPU's release window
    /// comes with each call).
    pub fn new(poll: Duration, idle_poll: Duration) -> Pacer {
        Pacer {
            poll,
            idle_poll,
            decide_next: true,
            last_publish_ns: 0,
        }
    }

    /// The state machine runs at the next tick, whatever changed.
    pub fn decide_next(&mut self) {
        self.decide_next = true;
    }

    /// Whether `/state` is due at `now` (and, if so, it is taken as published; the next
    /// tick then decides, so that the document shows the machine's view).
    pub fn publish_due(&mut self, now: u64) -> bool {
        let due = now.saturating_sub(self.last_publish_ns) >= PUBLISH_NS;
        if due {
            self.last_publish_ns = now;
            self.decide_next = true;
        }
        due
    }

    /// How long the loop may sleep before something is due: `--poll-interval` while an
    /// event, a retry or a fixed-share duty cycle is in progress; else until the next
    /// check of a pending confirmation (50 µs after the operation, the gap doubling up to
    /// 1 ms), NVML read, process-list read, end of an idle window, re-check or publication,
    /// and at most `--idle-poll-interval`. A doorbell ends the sleep early.
    pub fn next_wait(
        &self,
        now: u64,
        d: Due,
        states: impl Iterator<Item = (u32, GpuState)>,
        window: impl Fn(u32) -> u64,
    ) -> Duration {
        if d.fast {
            return self.poll;
        }
        let mut due = now + self.idle_poll.max(self.poll).as_nanos() as u64;
        if d.offline || d.recheck.is_some() {
            due = due.min(d.reads.0);
        }
        due = due.min(d.reads.1);
        if let Some(t) = d.recheck {
            due = due.min(t.max(now));
        }
        if let Some(t) = d.next_check {
            due = due.min(t);
        }
        for (g, st) in states {
            if let GpuState::OnlineBusy { last_online, .. } = st {
                due = due.min(last_online.saturating_add(window(g)));
            }
        }
        due = due.min(self.last_publish_ns + PUBLISH_NS);
        if let Some(t) = d.beat {
            // The shims read a stale heartbeat as an open gate.
            due = due.min(t);
        }
        if let Some(t) = d.vault {
            due = due.min(t);
        }
        Duration::from_nanos(due.saturating_sub(now)).max(Duration::from_micros(50))
    }

    /// Whether this tick runs the state machine. It needs to only when what it reads
    /// changed or a time it waits for came: NVML was read (samples, process lists,
    /// health), a retry is due, a doorbell rang on a GPU that offline work runs on
    /// (`touched`), an idle window may have ended, a `fixed-share` duty cycle runs, or
    /// after a fail-open and once per publication. A doorbell on a GPU already busy only
    /// moves its window's end, which the next decision reads: skipping those ticks is what
    /// keeps re-checks and confirmations cheap.
    pub fn decision_due(
        &mut self,
        now: u64,
        changed: bool,
        touched: &[u32],
        mut states: impl Iterator<Item = (u32, GpuState)>,
        window: impl Fn(u32) -> u64,
    ) -> bool {
        if changed || std::mem::take(&mut self.decide_next) {
            return true;
        }
        states.any(|(g, st)| match st {
            GpuState::OnlineBusy { last_online, .. } => {
                now >= last_online.saturating_add(window(g))
            }
            GpuState::OfflineRunning => touched.contains(&g),
        })
    }
}
