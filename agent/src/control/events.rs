//! Typed events: every preemption, release and fail-open, each a struct of its own
//! ([`Preempt`], [`Release`], [`FailOpen`], ...) inside one [`Event`], and the
//! [`Tracker`] that finishes them.
//!
//! An event is opened when the state machine decides and finished when the actuator has
//! confirmed every target it started for it (or they failed, or went away). A finished
//! event goes to the shell as data (`Cmd::Emit`), whose renderer (`shell/render/`) writes
//! its JSON line in `--event-log`, its log line and latency histograms (labelled by the
//! actuator that acted last, not the one configured; each struct's own `emit`) and the
//! `/state` history. The controller never logs nor counts. The same [`Event`] type is read
//! back by the timeline, `coloc-agent status`, the demo, the benchmarks and the tests;
//! nobody parses a log line.

use crate::control::holds::{Completion, HoldKey, Outcome};
use crate::control::model::act::{Kind, Op};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

/// One line of the event log, one entry of `/state`'s `recent_events`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// A GPU became busy with online work: offline work on it was suspended.
    Preempt(Preempt),
    /// A GPU's online work was idle for the window: offline work on it was resumed.
    Release(Release),
    /// Offline work was resumed because something failed (see `reason`).
    FailOpen(FailOpen),
    /// A doorbell page's launches stopped counting (NVML never corroborated them), or
    /// count again (NVML showed its owner at work).
    Distrust(Distrust),
    /// An offline process's GPU memory was checkpointed to the host (or the driver
    /// refused).
    Checkpoint(DriverEvent),
    /// A checkpointed process's GPU memory was restored (or the driver refused).
    Restore(DriverEvent),
    /// Suspended offline work was found running (something resumed it): its first
    /// time, when something it cannot undo holds it from then on, or when nothing can.
    Escape(Escape),
}

/// Suspended offline work found running.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Escape {
    /// When, ns.
    pub at_ns: u64,
    /// The offline GPU processes of the hold.
    pub pids: Vec<u32>,
    /// Their owners (`namespace/pod`, or `rule:<name>`).
    pub owners: Vec<String>,
    /// The actuator that held it (`signal`, `gate`, ...).
    pub actuator: Kind,
    /// Times it was found running in this hold.
    pub breaks: u32,
    /// What holds it now: `stopped_again` (signalled again: it may resume itself again),
    /// `frozen` (its cgroup, or a cell of the agent's own: it cannot), `unheld` (nothing
    /// it cannot undo can hold it on this host; see `reason`).
    pub now: String,
    /// Why it is `unheld`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// A checkpoint or a restore.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DriverEvent {
    /// When it ended, ns.
    pub at_ns: u64,
    /// GPU index.
    pub gpu: Option<u32>,
    /// The process.
    pub pid: u32,
    /// Its owner (`namespace/pod`, or `rule:<name>`).
    pub owner: String,
    /// Device memory moved, bytes.
    pub bytes: u64,
    /// How long the driver took, s.
    pub took_s: f64,
    /// The driver did it.
    pub ok: bool,
    /// Why not (bounded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl Event {
    /// The GPU the event is about (`None` for a node-wide fail-open).
    pub fn gpu(&self) -> Option<u32> {
        match self {
            Event::Preempt(p) => Some(p.gpu),
            Event::Release(r) => Some(r.gpu),
            Event::FailOpen(f) => f.gpu,
            Event::Distrust(d) => Some(d.gpu),
            Event::Checkpoint(c) | Event::Restore(c) => c.gpu,
            Event::Escape(_) => None,
        }
    }
}

/// `OfflineRunning` → `OnlineBusy` on one GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Preempt {
    /// GPU index.
    pub gpu: u32,
    /// Onset: the earliest evidence of the online work (a doorbell's launch time, or the
    /// start of the NVML sampled period that showed it), ns.
    pub onset_ns: u64,
    /// The signal that gave the onset.
    pub signal: qos_core::Signal,
    /// When the agent decided, ns.
    pub decided_ns: u64,
    /// `decided_ns - onset_ns`, seconds.
    pub detection_s: f64,
    /// Offline processes on the GPU.
    pub offline: usize,
    /// The actuator that acted (the last target confirmed); none when nothing was stopped.
    #[serde(default)]
    pub actuator: Option<Kind>,
    /// The agent runs with `--dry-run`.
    #[serde(default)]
    pub dry_run: bool,
    /// When every target was confirmed stopped, ns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confirmed_ns: Option<u64>,
    /// `confirmed_ns - decided_ns`, seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub actuation_s: Option<f64>,
    /// `confirmed_ns - onset_ns`, seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preemption_s: Option<f64>,
    /// When the loop last went to sleep before the deciding tick, ns. An onset before it
    /// fell while the loop was busy in a tick: detection then includes that tick's rest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slept_ns: Option<u64>,
    /// When that sleep ended (a doorbell, or the deadline), ns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub woke_ns: Option<u64>,
}

/// `OnlineBusy` → `OfflineRunning` on one GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Release {
    /// GPU index.
    pub gpu: u32,
    /// Last online activity plus the idle window: when the release was due, ns.
    pub window_end_ns: u64,
    /// When the agent decided, ns.
    pub decided_ns: u64,
    /// The idle window, ns.
    pub idle_window_ns: u64,
    /// The window that ran out: the idle window, or a shorter learned one, ns.
    #[serde(default)]
    pub window_ns: u64,
    /// The window was learned (`--release learned`).
    #[serde(default)]
    pub learned: bool,
    /// From the first to the last online activity of the busy period, seconds.
    pub busy_for_s: f64,
    /// Offline processes on the GPU.
    pub offline: usize,
    /// The actuator that acted (the last target confirmed running).
    #[serde(default)]
    pub actuator: Option<Kind>,
    /// The agent runs with `--dry-run`.
    #[serde(default)]
    pub dry_run: bool,
    /// When every target was confirmed running, ns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confirmed_ns: Option<u64>,
    /// `confirmed_ns - window_end_ns`, seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release_s: Option<f64>,
}

/// Offline work resumed because something failed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FailOpen {
    /// When, ns.
    pub at_ns: u64,
    /// Bounded reason (`nvml`, `nvml_hung`, `record`, `actuation`, `shutdown`, `panic`).
    pub reason: String,
    /// The GPU whose failure it was; `None` for the whole node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<u32>,
    /// Suspended targets resumed.
    pub resumed: usize,
}

/// A doorbell page whose claims NVML did not corroborate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Distrust {
    /// GPU index the page's launches named.
    pub gpu: u32,
    /// When, ns.
    pub at_ns: u64,
    /// The page's path.
    pub page: String,
    /// Its owner: `pid:<n>` or `pod:<uid>`.
    pub owner: String,
    /// How long its claims had kept the GPU busy without a break, seconds.
    pub claimed_s: f64,
    /// End of the latest sampled period that showed the owner at work on that GPU, ns
    /// (none: never).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvml_seen_ns: Option<u64>,
    /// False: distrusted from now on; true: trusted again (a sample showed it at work).
    pub restored: bool,
}

/// Parses an event log (JSON lines); lines that are not events are skipped.
pub fn parse_log(text: &str) -> Vec<Event> {
    text.lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn secs(ns: u64) -> f64 {
    ns as f64 / 1e9
}

struct Waiting {
    event: Event,
    op: Op,
    holds: BTreeSet<HoldKey>,
    last: Option<(u64, Kind)>,
}

/// Events waiting for their targets' confirmations.
#[derive(Default)]
pub struct Tracker {
    waiting: Vec<Waiting>,
}

impl std::fmt::Debug for Tracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracker")
            .field("waiting", &self.waiting.len())
            .finish()
    }
}

impl Tracker {
    /// Opens `event`, which finishes once every hold in `holds` has completed `op`. With
    /// no holds to wait for it is finished at once and returned.
    pub fn open(&mut self, event: Event, op: Op, holds: BTreeSet<HoldKey>) -> Option<Event> {
        if holds.is_empty() {
            return Some(event);
        }
        self.waiting.push(Waiting {
            event,
            op,
            holds,
            last: None,
        });
        None
    }

    /// Finishes every waiting event as it stands (the holds it waits for were resumed
    /// behind the book's back: the NVML watchdog's fail-open).
    pub fn abandon(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.waiting)
            .into_iter()
            .map(finish)
            .collect()
    }

    /// Applies completions; returns the events they finished.
    pub fn complete(&mut self, done: &[Completion]) -> Vec<Event> {
        for c in done {
            for w in self.waiting.iter_mut().filter(|w| w.op == c.op) {
                if w.holds.remove(&c.key)
                    && matches!(c.outcome, Outcome::Done)
                    && w.last.is_none_or(|(t, _)| c.at_ns >= t)
                {
                    w.last = Some((c.at_ns, c.kind));
                }
            }
        }
        let (finished, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.waiting)
            .into_iter()
            .partition(|w| w.holds.is_empty());
        self.waiting = waiting;
        finished.into_iter().map(finish).collect()
    }

    /// No event is waiting.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }
}

fn finish(w: Waiting) -> Event {
    let mut ev = w.event;
    if let Some((at, kind)) = w.last {
        match &mut ev {
            Event::Preempt(p) => {
                p.actuator = Some(kind);
                p.confirmed_ns = Some(at);
                p.actuation_s = Some(secs(at.saturating_sub(p.decided_ns)));
                p.preemption_s = Some(secs(at.saturating_sub(p.onset_ns)));
            }
            Event::Release(r) => {
                r.actuator = Some(kind);
                r.confirmed_ns = Some(at);
                r.release_s = Some(secs(at.saturating_sub(r.window_end_ns)));
            }
            Event::FailOpen(_)
            | Event::Distrust(_)
            | Event::Checkpoint(_)
            | Event::Restore(_)
            | Event::Escape(_) => {}
        }
    }
    ev
}
