//! Pacing: when the loop wakes, and when a tick runs the state machine.

use super::Loop;
use std::time::Duration;

impl Loop {
    /// How long the loop may sleep before something is due: `--poll-interval` while an
    /// event, a retry or a fixed-share duty cycle is in progress; else until the next
    /// check of a pending confirmation (50 µs after the operation, the gap doubling up to
    /// 1 ms), NVML read, process-list read, end of an idle window, re-check or publication,
    /// and at most `--idle-poll-interval`. A doorbell ends the sleep early.
    pub(crate) fn next_wait(&self, now: u64) -> Duration {
        let poll = self.cfg.poll;
        let (next_check, recheck) = (self.book.next_check_ns(), self.book.next_recheck_ns());
        let gated = self.hands().gates_closed();
        let held = recheck.is_some();
        if (next_check.is_none() && !self.tracker.is_empty())
            || !self.retries.is_empty()
            || self.table.fixed_share_present()
            || self.refresh_asked.is_some()
        {
            return poll;
        }
        let mut due = now + self.cfg.idle_poll.max(poll).as_nanos() as u64;
        if self.table.offline_present() || held {
            due = due.min(self.next_nvml_ns);
        }
        due = due.min(self.next_refresh_ns);
        if let Some(t) = recheck {
            due = due.min(t.max(now));
        }
        if let Some(t) = next_check {
            due = due.min(t);
        }
        let window = self.cfg.machine.idle_window;
        for (_, st) in self.machine.states() {
            if let qos_core::GpuState::OnlineBusy { last_online, .. } = st {
                due = due.min(last_online.saturating_add(window));
            }
        }
        due = due.min(self.last_publish_ns + 100_000_000);
        if gated {
            // The shims read a stale heartbeat as an open gate.
            due = due.min(self.last_beat_ns + super::gates::BEAT_NS);
        }
        Duration::from_nanos(due.saturating_sub(now)).max(Duration::from_micros(50))
    }

    /// Whether this tick runs the state machine. It needs to only when what it reads
    /// changed or a time it waits for came: NVML was read (samples, process lists,
    /// health), a retry is due, a doorbell rang on a GPU that offline work runs on, an
    /// idle window may have ended, a `fixed-share` duty cycle runs, or after a fail-open
    /// and once per publication. A doorbell on a GPU already busy only moves its window's
    /// end, which the next decision reads: skipping those ticks is what keeps re-checks
    /// and confirmations cheap.
    pub(super) fn decision_due(&mut self, now: u64, changed: bool) -> bool {
        let touched = self.table.take_touched();
        if changed || std::mem::take(&mut self.decide_next) || self.table.fixed_share_present() {
            return true;
        }
        let window = self.cfg.machine.idle_window;
        self.machine.states().any(|(g, st)| match st {
            qos_core::GpuState::OnlineBusy { last_online, .. } => {
                now >= last_online.saturating_add(window)
            }
            qos_core::GpuState::OfflineRunning => touched.contains(&g),
        })
    }
}
