//! What the controller has to say besides events: each log line, counter and gauge of its
//! decisions is a note, a struct of its own ([`HoldGone`], [`ActFailed`], ...) with the
//! fields its line and its labels need, handed to the shell as data ([`Note`], in
//! `Cmd::Note`). The controller never logs nor counts: each note's rendering (its log
//! line, its metrics, the limit on lines a tenant can cause) is its own `emit`, in the
//! shell's renderer (`shell/render/`). Tests read notes as data.
//!
//! A note is made at its site in one expression: `note::HoldGone { hold }.into()`.
//!
//! Imports the controller's model and small label types only (no sub-state that says a
//! note imports this module back).

use crate::control::model::act::{Kind, Op};
use crate::control::model::bell::Owner;
use crate::control::model::gpu::Refresh;
use crate::control::model::hold;
use crate::control::target::HoldKey;
use crate::control::ReleaseAll;
use qos_core::machine::Reason;
use std::path::PathBuf;
use std::time::Duration;

pub use super::reason::{FailWhy, Reject};

/// The rule by which offline work was released on a GPU (the `rule` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseRule {
    /// After the idle window (`--idle-window`).
    Fixed,
    /// After a shorter window learned from the online processes' gaps (`--release learned`).
    Learned,
    /// As soon as every online process's work was seen complete (`--release at-once`).
    AtOnce,
}

impl ReleaseRule {
    /// The rule of a release after `window` where the idle window is `idle_window`, with
    /// `--release at-once` or not.
    pub fn of(window: u64, idle_window: u64, at_once: bool) -> ReleaseRule {
        match (window < idle_window, at_once) {
            (false, _) => ReleaseRule::Fixed,
            (true, false) => ReleaseRule::Learned,
            (true, true) => ReleaseRule::AtOnce,
        }
    }

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ReleaseRule::Fixed => "fixed",
            ReleaseRule::Learned => "learned",
            ReleaseRule::AtOnce => "at_once",
        }
    }
}

/// Declares [`Note`], one variant per note struct, named as the struct, and the `From`
/// that makes `note::X { .. }.into()` a note.
macro_rules! notes {
    ($($name:ident),* $(,)?) => {
        /// One thing worth a log line or a counter: the note struct of the same name.
        #[derive(Debug, Clone)]
        pub enum Note {
            $(
                #[doc = concat!("[`", stringify!($name), "`]")]
                $name($name),
            )*
        }

        $(
            impl From<$name> for Note {
                fn from(n: $name) -> Note {
                    Note::$name(n)
                }
            }
        )*
    };
}

notes! {
    FailedOpen,
    NotRecorded,
    FallbackNotRecorded,
    EscalationNotRecorded,
    NewcomersNotRecorded,
    HoldGone,
    NewcomersStopped,
    ActFailed,
    TimedOut,
    Resumed,
    ReleasingAll,
    GateDrained,
    GateEscalated,
    Decision,
    Suspending,
    Resuming,
    Detected,
    RetryLater,
    Retrying,
    Released,
    Harvested,
    Broken,
    ListRefresh,
    NvmlTransient,
    NvmlFailOpen,
    NvmlRecovered,
    NvmlAllRecovered,
    Degraded,
    HungCallReturned,
    Invisible,
    Replaced,
    WakeGapTooLong,
    PageAttributed,
    PageRejected,
    Uncorroborated,
    Distrusted,
    HoldGauges,
    MemoryUnread,
    MemoryPressure,
    Evicting,
    EvictionNotRecorded,
    DriverCall,
    NoRoomForCheckpoint,
    DriverCallStuck,
    RestoreGivenUp,
    DriverFailedState,
}

/// Offline work resumed because something failed: the holds' record or actuation, a
/// panic (the counter only; the event says the rest).
#[derive(Debug, Clone)]
pub struct FailedOpen {
    /// Why.
    pub why: FailWhy,
}

/// A suspension's record could not be written: nothing was suspended.
#[derive(Debug, Clone)]
pub struct NotRecorded {
    /// Holds that were not started.
    pub targets: usize,
}

/// A gate hold's fallback could not be recorded: not suspended.
#[derive(Debug, Clone)]
pub struct FallbackNotRecorded;

/// A freezer escalation could not be recorded: not escalated.
#[derive(Debug, Clone)]
pub struct EscalationNotRecorded;

/// Processes that joined a held cgroup could not be recorded: not stopped.
#[derive(Debug, Clone)]
pub struct NewcomersNotRecorded {
    /// How many.
    pub processes: usize,
}

/// A held signalled cgroup is gone (its processes exited): its hold ends.
#[derive(Debug, Clone)]
pub struct HoldGone {
    /// The hold.
    pub hold: HoldKey,
}

/// Processes that joined a held cgroup are stopped too.
#[derive(Debug, Clone)]
pub struct NewcomersStopped {
    /// The hold.
    pub hold: HoldKey,
    /// How many.
    pub processes: usize,
}

/// An operation on one target failed (the actuator answered with an error).
#[derive(Debug, Clone)]
pub struct ActFailed {
    /// Suspend or resume.
    pub op: Op,
    /// The target (display form).
    pub target: String,
    /// Its actuator.
    pub actuator: Kind,
    /// Bounded reason.
    pub reason: &'static str,
    /// The error.
    pub error: String,
}

/// An operation on a hold was not confirmed within `--confirm-timeout`.
#[derive(Debug, Clone)]
pub struct TimedOut {
    /// Suspend or resume.
    pub op: Op,
    /// The hold.
    pub hold: HoldKey,
    /// Its actuator.
    pub actuator: Kind,
    /// The timeout.
    pub timeout: Duration,
}

/// A hold's resume ended (confirmed, gone, skipped or failed).
#[derive(Debug, Clone)]
pub struct Resumed {
    /// The hold.
    pub hold: HoldKey,
    /// How.
    pub outcome: hold::Outcome,
}

/// Everything is resumed at once: the agent stops, or the loop unwinds from a panic.
#[derive(Debug, Clone)]
pub struct ReleasingAll {
    /// Why.
    pub reason: ReleaseAll,
    /// Holds.
    pub count: usize,
}

/// A gate hold drained: its fallback holds the process.
#[derive(Debug, Clone)]
pub struct GateDrained {
    /// The hold.
    pub hold: HoldKey,
    /// The fallback's actuator.
    pub fallback: Kind,
}

/// A gate hold did not drain in time (or could not close): its fallback stops it.
#[derive(Debug, Clone)]
pub struct GateEscalated {
    /// The gates (display form).
    pub gates: Vec<String>,
    /// The fallback's actuator.
    pub fallback: Kind,
    /// `--gate-timeout`.
    pub timeout: Duration,
    /// Why.
    pub why: hold::Escalation,
}

/// The state machine decided (debug): what it asks to suspend and resume.
#[derive(Debug, Clone)]
pub struct Decision {
    /// Suspensions.
    pub suspend: usize,
    /// Resumptions.
    pub resume: usize,
    /// Transitions.
    pub transitions: usize,
}

/// An offline process is suspended, for this reason.
#[derive(Debug, Clone)]
pub struct Suspending {
    /// Why: online work busy on its GPU, or the share cap.
    pub reason: Reason,
}

/// Offline work is resumed (a release, or a failed suspension undone).
#[derive(Debug, Clone)]
pub struct Resuming {
    /// Its PIDs.
    pub pids: Vec<u32>,
    /// The holds resumed.
    pub targets: usize,
}

/// A preemption was decided: its detection latency.
#[derive(Debug, Clone)]
pub struct Detected {
    /// GPU.
    pub gpu: u32,
    /// What gave the onset.
    pub signal: qos_core::Signal,
    /// Seconds.
    pub seconds: f64,
}

/// A failed suspension is retried later, while online work stays busy.
#[derive(Debug, Clone)]
pub struct RetryLater {
    /// The holder.
    pub pid: u32,
    /// In how long, ms.
    pub in_ms: u64,
}

/// A failed suspension is tried again now.
#[derive(Debug, Clone)]
pub struct Retrying {
    /// The holder.
    pub pid: u32,
}

/// A GPU released its offline work, by the fixed or a learned window.
#[derive(Debug, Clone)]
pub struct Released {
    /// The GPU.
    pub gpu: u32,
    /// The rule that released it.
    pub rule: ReleaseRule,
    /// The window, ns.
    pub window_ns: u64,
}

/// Online work came back on a GPU after a release: offline ran this long in between
/// (the time harvested by that release's rule); `wrong`: a learned release after which
/// offline ran less than `--release-ratio` × `--release-drain`, so it did not pay.
#[derive(Debug, Clone)]
pub struct Harvested {
    /// The GPU.
    pub gpu: u32,
    /// The rule of the release.
    pub rule: ReleaseRule,
    /// Offline ran this long, ns.
    pub ran_ns: u64,
    /// A learned release that did not pay.
    pub wrong: bool,
}

/// A hold was found running while held (something resumed it).
#[derive(Debug, Clone)]
pub struct Broken {
    /// What was found.
    pub broken: hold::Broken,
    /// Its holders' owners.
    pub owners: Vec<String>,
}

/// The process lists are read, for this reason.
#[derive(Debug, Clone)]
pub struct ListRefresh {
    /// Why now.
    pub why: Refresh,
}

/// A GPU's NVML failed, not persistently yet.
#[derive(Debug, Clone)]
pub struct NvmlTransient {
    /// GPU.
    pub gpu: u32,
    /// The error.
    pub error: String,
}

/// A GPU's NVML kept failing past `--nvml-failure-grace`: it fails open.
#[derive(Debug, Clone)]
pub struct NvmlFailOpen {
    /// GPU.
    pub gpu: u32,
    /// The error.
    pub error: String,
    /// `--nvml-failure-grace`.
    pub grace: Duration,
}

/// A GPU's NVML answers again after failing.
#[derive(Debug, Clone)]
pub struct NvmlRecovered {
    /// GPU.
    pub gpu: u32,
}

/// Every GPU's NVML answers again (said by the shell when the degraded reason clears).
#[derive(Debug, Clone)]
pub struct NvmlAllRecovered;

/// A GPU's degraded gauge changed.
#[derive(Debug, Clone)]
pub struct Degraded {
    /// GPU.
    pub gpu: u32,
    /// Degraded now.
    pub degraded: bool,
}

/// The hung NVML call returned (after the watchdog failed open).
#[derive(Debug, Clone)]
pub struct HungCallReturned;

/// Listed PIDs not visible in `/proc` for over a second (the gauge), and whether to
/// warn (once).
#[derive(Debug, Clone)]
pub struct Invisible {
    /// Those PIDs.
    pub pids: Vec<u32>,
    /// Warn now.
    pub warn: bool,
}

/// A GPU process was replaced by another with the same PID.
#[derive(Debug, Clone)]
pub struct Replaced {
    /// The PID.
    pub pid: u32,
}

/// A page's wake gap is longer than the idle window (said when the page is first seen).
#[derive(Debug, Clone)]
pub struct WakeGapTooLong {
    /// The page.
    pub page: PathBuf,
    /// Its wake gap, ns.
    pub wake_gap_ns: u64,
    /// The idle window, ns.
    pub window_ns: u64,
}

/// A page was attributed to an online process (a line its tenant can cause at will:
/// limited per owner).
#[derive(Debug, Clone)]
pub struct PageAttributed {
    /// The page.
    pub page: PathBuf,
    /// The process.
    pub pid: u32,
    /// GPU.
    pub gpu: u32,
}

/// A page was rejected: its launches count for nothing (a line its tenant can cause at
/// will: limited per owner, always counted).
#[derive(Debug, Clone)]
pub struct PageRejected {
    /// The page.
    pub page: PathBuf,
    /// Who it says it belongs to.
    pub owner: Owner,
    /// Its file's UID.
    pub file_uid: u32,
    /// Why.
    pub reason: Reject,
}

/// An owner's claims were not corroborated by NVML (the counter).
#[derive(Debug, Clone)]
pub struct Uncorroborated;

/// Owners distrusted now (the gauge), said at each tick.
#[derive(Debug, Clone)]
pub struct Distrusted {
    /// How many.
    pub owners: usize,
}

/// Offline processes escaping their hold now, and whose gate stayed silent (the gauges),
/// said at each tick.
#[derive(Debug, Clone)]
pub struct HoldGauges {
    /// Held, found running, nothing they cannot undo holding them.
    pub escaping: usize,
    /// Their gate did not acknowledge its latest close in time.
    pub gate_silent: usize,
}

/// A GPU's memory could not be read (memory preemption waits for the next read).
#[derive(Debug, Clone)]
pub struct MemoryUnread {
    /// GPU.
    pub gpu: u32,
    /// The error.
    pub error: String,
}

/// A GPU came under memory pressure (online present, free under the reserve) or out
/// of it.
#[derive(Debug, Clone)]
pub struct MemoryPressure {
    /// GPU.
    pub gpu: u32,
    /// Under pressure now.
    pub on: bool,
    /// Free, bytes.
    pub free: u64,
    /// The reserve, bytes.
    pub reserve: u64,
}

/// An offline process is to be checkpointed for online's memory.
#[derive(Debug, Clone)]
pub struct Evicting {
    /// GPU.
    pub gpu: u32,
    /// The process.
    pub pid: u32,
    /// What it holds there, bytes.
    pub bytes: u64,
    /// What the reserve misses, bytes.
    pub missing: u64,
}

/// An eviction's record entry could not be written: not evicted.
#[derive(Debug, Clone)]
pub struct EvictionNotRecorded {
    /// The process.
    pub pid: u32,
}

/// A call to the driver's checkpoint API ended.
#[derive(Debug, Clone)]
pub struct DriverCall {
    /// The operation.
    pub op: crate::control::model::driver::Op,
    /// The process.
    pub pid: u32,
    /// Its owner.
    pub owner: String,
    /// How long it took, s.
    pub took_s: f64,
    /// Device memory it concerned, bytes.
    pub bytes: u64,
    /// Failed: the bounded reason.
    pub reason: Option<String>,
    /// Failed: the driver's answer.
    pub error: Option<String>,
    /// The process is held by its other plan from now on.
    pub fallback: bool,
}

/// An offline process was not checkpointed: its memory limit has no room for it.
#[derive(Debug, Clone)]
pub struct NoRoomForCheckpoint {
    /// The process.
    pub pid: u32,
    /// What its memory limits leave it, bytes.
    pub room: u64,
    /// What its checkpoint would take, bytes.
    pub need: u64,
}

/// A driver call has run far longer than it should (said once per call).
#[derive(Debug, Clone)]
pub struct DriverCallStuck {
    /// The operation.
    pub op: crate::control::model::driver::Op,
    /// The process.
    pub pid: u32,
    /// Its owner.
    pub owner: String,
    /// How long so far, s.
    pub secs: f64,
}

/// At exit, the driver refused a restore: left checkpointed and recorded.
#[derive(Debug, Clone)]
pub struct RestoreGivenUp {
    /// The process.
    pub pid: u32,
    /// Its owner.
    pub owner: String,
}

/// The driver says a process is in its failed state.
#[derive(Debug, Clone)]
pub struct DriverFailedState {
    /// The process.
    pub pid: u32,
    /// Its owner.
    pub owner: String,
}

#[cfg(test)]
mod tests {
    use super::ReleaseRule;

    /// `coloc_releases_total{rule}` says which policy released: the idle window, a learned
    /// window, or at once (it said "learned" for every release of `--release at-once`).
    #[test]
    fn a_release_is_labelled_by_the_policy_that_made_it() {
        let idle = 100_000_000;
        assert_eq!(ReleaseRule::of(idle, idle, false).as_str(), "fixed");
        assert_eq!(ReleaseRule::of(idle, idle, true).as_str(), "fixed");
        assert_eq!(ReleaseRule::of(2_000_000, idle, false).as_str(), "learned");
        assert_eq!(ReleaseRule::of(0, idle, true).as_str(), "at_once");
    }
}
