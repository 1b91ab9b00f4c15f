//! What the controller and its shell say to each other: the reads due at a tick's start
//! ([`Reads`]), which the shell gathers into a snapshot before the tick's first step,
//! doorbells first ([`Obs::Snapshot`]); the commands the controller asks for, in order
//! ([`Cmd`]); and the observations the shell brings back ([`Obs`]).
//!
//! Inside a tick the controller still asks for a few reads whose need only the snapshot
//! shows: the classification of processes the lists name for the first time, the lists
//! again for a launch of a process they do not hold yet (or for samples of an unknown PID),
//! the doorbells again after those lists. Every
//! command that reads something is answered by one observation, in the same round of the
//! conversation, except a record [`Cmd::Write`], which the shell performs off the loop's
//! thread and answers when it lands ([`Obs::Written`]), a later round or tick.

use crate::control::entry::Entry;
use crate::control::events::Event;
use crate::control::holds::{HoldCmd, HoldObs};
use crate::control::model::bell::{BellReading, PageInfo};
use crate::control::model::gpu;
use crate::control::model::ProcKey;
use crate::control::note::Note;
use crate::control::nvml::Refresh;
use crate::control::plan::Members;
use crate::control::record::Write;
use crate::control::state::StateDoc;
use crate::control::ReleaseAll;
use coloc_doorbell::GateReading;
use std::collections::{BTreeMap, BTreeSet};

/// What the shell reads at a tick's start, before the controller's first step, in this
/// order: the doorbell pages; NVML's samples, stopping after a GPU when a doorbell rang
/// (the rest are read at the next tick); the process lists, unless a doorbell rang
/// meanwhile (then they wait for the next tick, once in a row at most); and the doorbell
/// pages again when one rang during the NVML reads. Handed in as one [`Obs::Snapshot`].
#[derive(Debug)]
pub struct Reads {
    /// The doorbell pages: a [`Cmd::ReadBells`].
    pub bells: Cmd,
    /// NVML's per-process samples, if due: a [`Cmd::ReadSamples`].
    pub samples: Option<Cmd>,
    /// The running-process lists, if due: a [`Cmd::ReadLists`].
    pub lists: Option<Cmd>,
    /// GPU memory, if due (memory preemption), unless a doorbell rang: a
    /// [`Cmd::ReadMemory`].
    pub memory: Option<Cmd>,
}

/// What the controller asks the shell to do.
#[derive(Debug)]
pub enum Cmd {
    /// Read NVML's per-process samples of each GPU newer than its timestamp (µs), in this
    /// order; stop after a GPU when a doorbell has rung (the rest are read at the next
    /// tick). Only in [`Reads`]; read into an [`Obs::Samples`].
    ReadSamples {
        /// (GPU, newest timestamp seen, µs).
        gpus: Vec<(u32, u64)>,
    },
    /// Read every GPU's running-process list, tell which of `known` no longer live, and
    /// read the members of `cgroups` again (rules mode). Answered by [`Obs::Lists`].
    ReadLists {
        /// Why.
        why: Refresh,
        /// The processes the table knows, and whether the shell pins each (by its key).
        known: Vec<(ProcKey, bool)>,
        /// The cgroups an offline process would be held with as a whole if every member is
        /// offline.
        cgroups: Vec<std::path::PathBuf>,
    },
    /// Classify these listed PIDs. Answered by [`Obs::Classified`].
    Classify {
        /// The PIDs.
        pids: Vec<u32>,
        /// The pod source's generation they are classified under.
        generation: u64,
    },
    /// Read the doorbell pages: sweep the directories of pods that are gone (`sweep`),
    /// rescan the directories when they changed or `force`, read every page; with `gate`,
    /// the launch-gate fields of every offline page too. Answered by [`Obs::Bells`].
    ReadBells {
        /// Rescan every directory.
        force: bool,
        /// Sweep gone pods' directories.
        sweep: bool,
        /// Read the offline pages' gate fields.
        gate: bool,
    },
    /// Wait on these pages first.
    PreferPages(Vec<u64>),
    /// What the hold book asks (the record's part goes through [`Cmd::Write`]).
    Hold(HoldCmd),
    /// Write the record. Answered, maybe later, by [`Obs::Written`].
    Write(Write),
    /// Refresh the gate file's heartbeat.
    Beat,
    /// Report an event (log line, event log, histograms, `/state` history).
    Emit(Event),
    /// Log and count.
    Note(Note),
    /// Set (or clear) why the agent is degraded (`/readyz`).
    Degraded(Option<String>),
    /// Publish `/state` (the shell adds the event history).
    Publish(Box<StateDoc>),
    /// Read these GPUs' memory (NVML). Only in [`Reads`]; read into an [`Obs::Memory`].
    ReadMemory {
        /// The GPUs.
        gpus: Vec<u32>,
    },
    /// Start a call to the driver's checkpoint API, off the loop. Answered, when it ends
    /// (a later round or tick), by [`Obs::Driver`].
    Driver(crate::control::vault::Call),
}

/// What the shell observed.
#[derive(Debug)]
pub enum Obs {
    /// What the shell gathered for the [`Reads`] of the tick that started: an
    /// [`Obs::Bells`], then an [`Obs::Samples`] and an [`Obs::Lists`] where they were read.
    Snapshot {
        /// The reads.
        reads: Vec<Obs>,
        /// A doorbell rang during the NVML reads: what was not read waits for the next
        /// tick, and no NVML read is asked for before the decision other than the lists a
        /// launch of a process they do not hold yet needs.
        rang: bool,
    },
    /// Answers [`Cmd::ReadSamples`]: per GPU read, its samples or the error.
    Samples {
        /// Per GPU, in order.
        read: Vec<(u32, Result<Vec<gpu::Activity>, String>)>,
        /// A doorbell rang: the round stopped after these.
        yielded: bool,
    },
    /// Answers [`Cmd::ReadLists`].
    Lists {
        /// Why they were read.
        why: Refresh,
        /// PID → GPUs, from the GPUs whose listing succeeded.
        listed: BTreeMap<u32, BTreeSet<u32>>,
        /// GPUs whose listing failed, with the error.
        failed: BTreeMap<u32, String>,
        /// Known processes that no longer live.
        gone: Vec<ProcKey>,
        /// The pod source's generation.
        generation: u64,
        /// What the members of the cgroups asked for are.
        members: Vec<(std::path::PathBuf, Members)>,
    },
    /// Answers [`Cmd::Classify`]: each PID's entry (`None`: not in `/proc`, exited).
    Classified(Vec<(u32, Option<Entry>)>),
    /// Answers [`Cmd::ReadBells`].
    Bells {
        /// The pages mapped now, when the set changed.
        pages: Option<Vec<PageInfo>>,
        /// Every page's readings.
        readings: Vec<BellReading>,
        /// The offline pages' gate fields.
        gates: Vec<(u64, Vec<GateReading>)>,
    },
    /// What came of a hold command.
    Hold(HoldObs),
    /// A record write landed (`ok`) or failed.
    Written {
        /// The write.
        id: u64,
        /// It landed.
        ok: bool,
    },
    /// The NVML watchdog resumed everything while a call hung; the call returned.
    WatchdogTripped,
    /// Resume everything (shutdown, panic).
    ReleaseAll(ReleaseAll),
    /// Answers [`Cmd::ReadMemory`].
    Memory {
        /// Per GPU, its memory, or the error.
        reads: Vec<(u32, Result<Option<gpu::GpuMemory>, String>)>,
        /// Per process on those GPUs, what its memory limits leave it, bytes (absent: no
        /// limit): a checkpoint moves its device memory into its own host memory.
        room: BTreeMap<u32, u64>,
    },
    /// A driver call ended.
    Driver(crate::control::model::driver::Done),
    /// The offline pages' gate fields, read by the shell right after it closed a gate (a
    /// shim with nothing in flight acknowledges at once: its process is held in the tick
    /// that closed its gate, not at the next one).
    GateFields(Vec<(u64, Vec<GateReading>)>),
}
