//! The control loop: a controller that decides and does no I/O, inside a shell that reads
//! the edges and performs what it decides.
//!
//! ```text
//!  Controller::start_tick ──Reads──► shell (eyes: the snapshot, doorbells first)
//!  edges ──► shell (eyes) ──Obs──► Controller::step(now, obs) ──Cmd──► shell (hands, scribe,
//!   ▲                                   │ sub-states:                      telemetry) ──► edges
//!   └───────────────────────────────────┘ table, nvml, health, bells/claims, gates,
//!                                         qos_core::Machine, holds, record, retry,
//!                                         events (tracker), pace
//! ```
//!
//! The controller is every file here but [`shell`] and the tests: it imports no edge and
//! holds no file descriptor (a unit test reads its files to keep it so); its data types
//! are its own ([`model`]), and the edges re-export them.
//!
//! Modules: [`controller`] (the conversation of a tick), [`substates`] (the one place the
//! sub-states meet, and what a tick does with them), [`observed`] (the sub-states that take
//! in the shell's reads), [`model`] (the data the controller reasons about), [`io`] (the
//! reads due at a tick's start, the commands and observations), [`note`] (what the
//! controller says for the log and the metrics), [`table`] and [`entry`] (the process
//! table: identity, class, GPUs, activity), [`nvml`] (when the driver is read, what a
//! sample says), [`health`] (transient vs persistent NVML failures), [`bells`] and
//! [`claims`] (doorbell attribution and corroboration), [`gates`] (the gate book),
//! [`holds`] (what is suspended, record before act, confirmations that never stall the
//! loop), [`driver_book`] (the driver's lock and memory preemption), [`record`] (the record
//! book: written ahead, off the loop, in order), [`retry`], [`events`] (typed events, the
//! tracker), [`pace`] (when the loop wakes, when the machine runs), [`execute`] (a
//! decision into holds and events), [`plan`] (the plan of a suspension, chosen in one
//! place from the facts the others supply), [`publish`] (summaries and `/state`),
//! [`target`] (what a hold suspends, named without a file descriptor; freezer or signal,
//! whole cgroup or one process), [`state`] (the `/state` document and the handle shared
//! with HTTP), [`learn`] (the learned release window), [`coverage`] and [`reason`] (what
//! `/state` says of each process); [`shell`] (the loop itself: its eyes, hands, pins,
//! scribe,
//! renderer and watchdog).

pub mod bells;
pub mod claims;
pub mod controller;
pub mod coverage;
pub mod driver_book;
pub mod entry;
pub mod events;
pub mod execute;
pub mod gates;
pub mod health;
pub mod holds;
pub mod io;
pub mod learn;
pub mod model;
pub mod note;
pub mod nvml;
pub mod observed;
pub mod pace;
pub mod plan;
pub mod publish;
pub mod reason;
pub mod record;
pub mod retry;
pub mod shell;
pub mod state;
pub mod substates;
pub mod table;
pub mod target;
mod text;

#[cfg(test)]
mod tests;

pub use shell::{Edges, Loop};

use model::host::CgroupMounts;
use model::Kind;
use std::path::PathBuf;
use std::time::Duration;

/// Settings of the loop (validated by the CLI layer).
#[derive(Debug, Clone)]
pub struct LoopConfig {
    /// Utilisation sampling period while offline work is present.
    pub poll: Duration,
    /// Sampling period while no offline process is on any managed GPU.
    pub idle_poll: Duration,
    /// Running-process list period.
    pub process_interval: Duration,
    /// How often NVML's per-process samples are read.
    pub nvml_interval: Duration,
    /// The driver's sample period (a sample covers the period ending at its timestamp).
    pub nvml_sample_period: Duration,
    /// State machine settings.
    pub machine: qos_core::Config,
    /// Preferred actuator.
    pub actuator: Kind,
    /// Decide and report, never act (the edges are then a dry-run actuator and an
    /// in-memory record; this flag only labels reports).
    pub dry_run: bool,
    /// How long a suspend/resume may take to be confirmed.
    pub confirm_timeout: Duration,
    /// cgroup hierarchies.
    pub cgroups: CgroupMounts,
    /// JSON-lines log of every event, if set.
    pub event_log: Option<PathBuf>,
    /// Node name, for `/state`.
    pub node: String,
    /// Nice value of the control-loop thread (0: unchanged).
    pub loop_nice: i32,
    /// SCHED_FIFO priority of the control-loop thread (0: the normal scheduler).
    pub loop_rt_priority: i32,
    /// Scheduler slice the control-loop thread asks for (zero: the kernel's default).
    pub loop_slice: Duration,
    /// How long a GPU's NVML calls must keep failing before it fails open.
    pub nvml_grace: Duration,
    /// How long one NVML call may take before the watchdog fails open.
    pub nvml_hang_timeout: Duration,
    /// How often a held target is checked again (stopped again if something resumed it).
    pub recheck: Duration,
    /// How long a launch gate's acknowledgement is waited for before the fallback.
    pub gate_timeout: Duration,
    /// How long a doorbell page may keep a GPU busy with no NVML sample of its owner at
    /// work before it is distrusted (zero: never).
    pub doorbell_trust_window: Duration,
    /// The record is written on a thread of its own (the loop never waits for the disk);
    /// false: on the loop's thread.
    pub record_off_loop: bool,
    /// The learned release window (`--release learned`); `None`: the fixed idle window.
    pub release: Option<learn::Learning>,
    /// The driver's lock and memory preemption (`--driver-lock`, `--memory-reserve`).
    pub driver_book: driver_book::DriverBookConfig,
}

/// Why everything is resumed at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseAll {
    /// The agent stops.
    Shutdown,
    /// The loop is unwinding from a panic.
    Panic,
}

impl ReleaseAll {
    /// Metric and event label.
    pub fn as_str(self) -> &'static str {
        match self {
            ReleaseAll::Shutdown => "shutdown",
            ReleaseAll::Panic => "panic",
        }
    }
}
