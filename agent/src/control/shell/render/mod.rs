//! How the shell says what the controller hands it: each note
//! ([`crate::control::note`]) and each event ([`crate::control::events`]) is a struct
//! with its own [`Emit`], which writes its log line (message, fields, level), its
//! counters, gauges and histograms, and what telemetry keeps of it. The controller never
//! logs nor counts; the strings, metric names and labels appear here alone.
//!
//! ```text
//!  Cmd::Note(Note::X(x)) ─► x.emit(telemetry) ─► log line, metrics, tenant-line limit
//!  Cmd::Emit(Event::X(x)) ─► event(): --event-log line, x.emit(telemetry), /state history
//! ```
//!
//! [`notes`] (one `emit` per note), [`events`] (one per event).

pub mod events;
pub mod notes;

use crate::control::events::Event;
use crate::control::note::Note;
use crate::telemetry::Telemetry;

/// Says one note or event: its log line, its metrics, what telemetry keeps of it.
pub trait Emit {
    /// Renders it into `to` (and the global log and metrics recorder).
    fn emit(&self, to: &mut Telemetry);
}

impl Emit for Note {
    fn emit(&self, to: &mut Telemetry) {
        match self {
            Note::FailedOpen(n) => n.emit(to),
            Note::NotRecorded(n) => n.emit(to),
            Note::FallbackNotRecorded(n) => n.emit(to),
            Note::EscalationNotRecorded(n) => n.emit(to),
            Note::NewcomersNotRecorded(n) => n.emit(to),
            Note::HoldGone(n) => n.emit(to),
            Note::NewcomersStopped(n) => n.emit(to),
            Note::ActFailed(n) => n.emit(to),
            Note::TimedOut(n) => n.emit(to),
            Note::Resumed(n) => n.emit(to),
            Note::ReleasingAll(n) => n.emit(to),
            Note::GateDrained(n) => n.emit(to),
            Note::GateEscalated(n) => n.emit(to),
            Note::Decision(n) => n.emit(to),
            Note::Suspending(n) => n.emit(to),
            Note::Resuming(n) => n.emit(to),
            Note::Detected(n) => n.emit(to),
            Note::RetryLater(n) => n.emit(to),
            Note::Retrying(n) => n.emit(to),
            Note::Released(n) => n.emit(to),
            Note::Harvested(n) => n.emit(to),
            Note::Broken(n) => n.emit(to),
            Note::ListRefresh(n) => n.emit(to),
            Note::NvmlTransient(n) => n.emit(to),
            Note::NvmlFailOpen(n) => n.emit(to),
            Note::NvmlRecovered(n) => n.emit(to),
            Note::NvmlAllRecovered(n) => n.emit(to),
            Note::Degraded(n) => n.emit(to),
            Note::HungCallReturned(n) => n.emit(to),
            Note::Invisible(n) => n.emit(to),
            Note::Replaced(n) => n.emit(to),
            Note::WakeGapTooLong(n) => n.emit(to),
            Note::PageAttributed(n) => n.emit(to),
            Note::PageRejected(n) => n.emit(to),
            Note::Uncorroborated(n) => n.emit(to),
            Note::Distrusted(n) => n.emit(to),
            Note::HoldGauges(n) => n.emit(to),
            Note::MemoryUnread(n) => n.emit(to),
            Note::MemoryPressure(n) => n.emit(to),
            Note::Evicting(n) => n.emit(to),
            Note::EvictionNotRecorded(n) => n.emit(to),
            Note::DriverCall(n) => n.emit(to),
            Note::NoRoomForCheckpoint(n) => n.emit(to),
            Note::DriverCallStuck(n) => n.emit(to),
            Note::RestoreGivenUp(n) => n.emit(to),
            Note::DriverFailedState(n) => n.emit(to),
        }
    }
}

impl Emit for Event {
    fn emit(&self, to: &mut Telemetry) {
        match self {
            Event::Preempt(e) => e.emit(to),
            Event::Release(e) => e.emit(to),
            Event::FailOpen(e) => e.emit(to),
            Event::Distrust(e) => e.emit(to),
            Event::Checkpoint(e) | Event::Restore(e) => e.emit(to),
            Event::Escape(e) => e.emit(to),
        }
    }
}

/// The one place an event is reported: its JSON line in `--event-log`, its own
/// [`Emit`], then `/state`'s recent events.
pub fn event(to: &mut Telemetry, ev: Event) {
    to.append_to_event_log(&ev);
    ev.emit(to);
    to.keep(ev);
}

#[cfg(test)]
mod tests;
