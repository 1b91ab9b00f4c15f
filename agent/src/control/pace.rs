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
    /// Per busy GPU, the end of its release window that a decision has already judged
    /// (it stayed busy: work seen through NVML alone counts as busy until the next sample
    /// read, see `Table::sampled_busy`). Nothing changes that judgement before the next
    /// read, so that end is not waited for again: without this, the loop decided every
    /// 50 µs from each window's end to the next read (on 8 GPUs at the shipped defaults,
    /// 43.7 % of a core).
    judged: std::collections::BTreeMap<u32, u64>,
}

/// What the wait depends on, from the other sub-states.
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
    /// When the driver book looks again (a memory read, a driver call's end).
    pub driver_book: Option<u64>,
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
            judged: std::collections::BTreeMap::new(),
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
                let end = last_online.saturating_add(window(g));
                if self.judged.get(&g) != Some(&end) {
                    due = due.min(end);
                }
            }
        }
        due = due.min(self.last_publish_ns + PUBLISH_NS);
        if let Some(t) = d.beat {
            // The shims read a stale heartbeat as an open gate.
            due = due.min(t);
        }
        if let Some(t) = d.driver_book {
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
                let end = last_online.saturating_add(window(g));
                now >= end && self.judged.get(&g) != Some(&end)
            }
            GpuState::OfflineRunning => touched.contains(&g),
        })
    }

    /// A decision ran at `now` and left the GPUs in `states`: a busy GPU whose window has
    /// ended is judged until its window's end moves (new online activity, another
    /// window) or a read changes what the decision sees (`changed`).
    pub fn decided(
        &mut self,
        now: u64,
        states: impl Iterator<Item = (u32, GpuState)>,
        window: impl Fn(u32) -> u64,
    ) {
        self.judged.clear();
        for (g, st) in states {
            if let GpuState::OnlineBusy { last_online, .. } = st {
                let end = last_online.saturating_add(window(g));
                if end <= now {
                    self.judged.insert(g, end);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    /// A busy GPU whose window has ended but which a decision kept busy (NVML alone saw
    /// its online work: busy until the next sample read) is not decided on again, and
    /// not waited for, until its window's end moves: the loop used to decide every 50 µs
    /// until the next read.
    #[test]
    fn a_window_end_judged_once_is_not_decided_on_again_nor_waited_for() {
        let mut p = Pacer::new(Duration::from_millis(1), Duration::from_millis(100));
        let busy = |last_online| {
            std::iter::once((
                0u32,
                GpuState::OnlineBusy {
                    since: 0,
                    last_online,
                },
            ))
        };
        let window = |_| 100 * MS;
        let now = 150 * MS;
        assert!(p.publish_due(now));
        assert!(p.decision_due(now, false, &[], busy(40 * MS), window));
        p.decided(now, busy(40 * MS), window);
        assert!(!p.decision_due(now + MS, false, &[], busy(40 * MS), window));
        let due = Due {
            reads: (205 * MS, 1_000 * MS),
            offline: true,
            ..Due::default()
        };
        assert_eq!(
            p.next_wait(now + MS, due, busy(40 * MS), window),
            Duration::from_millis(54),
            "waits for the next read, not for the judged window end"
        );
        // New online activity moves the window's end: judged afresh when it comes.
        assert!(!p.decision_due(now + MS, false, &[], busy(60 * MS), window));
        assert!(p.decision_due(160 * MS, false, &[], busy(60 * MS), window));
    }
}
