//! What the controller and its shell say to each other: the reads due at a tick's start
//! ([`Reads`]), which the shell gathers into one [`Snapshot`] before the tick's first step,
//! doorbells first; what the controller knows that the shell needs to judge its own reads
//! ([`Known`]); the commands the controller asks for, in order ([`Cmd`]); and the
//! observations the shell brings back ([`Obs`]).
//!
//! No read is asked for in the middle of a tick: every read is in the snapshot, and no
//! [`Cmd`] reads anything (the type has no read). What only a read can show is judged by
//! the shell while it gathers, from [`Known`]: the PIDs the lists name that the controller
//! does not know are classified with them; a sample of a PID it does not know, or a
//! doorbell page naming a process it does not hold (a launch of a process that has just
//! started), has the lists read in the same snapshot, and the pages again after them.
//! The commands that remain are acts and their confirmations (the hold book's), each
//! answered by one observation in the same round of the conversation, and a record
//! [`Cmd::Write`] or a [`Cmd::Driver`] call, which the shell performs off the loop's
//! thread and answers when it ends ([`Obs::Written`], [`Obs::Driver`]), a later round or
//! tick.

use crate::control::driver_book::DriverBook;
use crate::control::entry::Entry;
use crate::control::events::Event;
use crate::control::holds::{HoldCmd, HoldObs};
use crate::control::model::bell::{BellReading, Owner, PageInfo};
use crate::control::model::gpu;
use crate::control::model::ProcKey;
use crate::control::note::Note;
use crate::control::nvml::Refresh;
use crate::control::observed::Observed;
use crate::control::plan::Members;
use crate::control::record::Write;
use crate::control::state::StateDoc;
use crate::control::table::Table;
use crate::control::ReleaseAll;
use coloc_doorbell::GateReading;
use qos_core::Class;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

/// What the shell reads at a tick's start, before the controller's first step, in this
/// order: the doorbell pages; NVML's samples, stopping after a GPU when a doorbell rang
/// (the rest are read at the next tick); the process lists, unless a doorbell rang
/// meanwhile (then they wait for the next tick, once in a row at most) — or, when they
/// are not due, because a sample named a PID the controller does not know (no doorbell
/// rang) —, with the classification of the PIDs they name that the controller does not
/// know and the members of the cgroups [`Known::cgroups`] names; GPU memory, unless a doorbell rang; the doorbell
/// pages again when one rang during the NVML reads; and, when the lists were not read, the
/// lists and the pages again if a page names a process the controller does not hold (at
/// most once a second per page). Handed in as one [`Snapshot`].
#[derive(Debug)]
pub struct Reads {
    /// The doorbell pages.
    pub bells: BellsRead,
    /// NVML's per-process samples of each GPU newer than its timestamp (µs), if due:
    /// (GPU, newest timestamp seen, µs).
    pub samples: Option<Vec<(u32, u64)>>,
    /// Why the running-process lists are due, if they are.
    pub lists: Option<Refresh>,
    /// The GPUs whose memory is due (memory preemption), if any.
    pub memory: Option<Vec<u32>>,
}

/// How the doorbell pages are read: sweep the directories of pods that are gone
/// (`sweep`), rescan the directories when they changed or `force`, read every page; with
/// `gate`, the launch-gate fields of every offline page too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BellsRead {
    /// Rescan every directory.
    pub force: bool,
    /// Sweep gone pods' directories.
    pub sweep: bool,
    /// Read the offline pages' gate fields.
    pub gate: bool,
}

/// What the controller knows, as the shell needs it while it gathers a snapshot: which
/// processes it knows (to tell which no longer live, which listed PIDs to classify, what
/// class a cgroup's member has), and whether a sample or a doorbell page names one it
/// does not know. A view: nothing is copied.
#[derive(Clone, Copy)]
pub struct Known<'a> {
    pub(crate) observed: &'a Observed,
    pub(crate) driver_book: &'a DriverBook,
}

impl std::fmt::Debug for Known<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Known").finish_non_exhaustive()
    }
}

impl Known<'_> {
    /// The process table.
    pub fn table(&self) -> &Table {
        &self.observed.table
    }

    /// The processes the lists are checked against: the table's, and those the driver
    /// holds checkpointed (they have left the lists), with whether the shell pins each.
    pub fn keys(&self) -> Vec<(ProcKey, bool)> {
        let mut known = self.observed.table.known();
        for (k, pin) in self.driver_book.known() {
            if !known.iter().any(|(kk, _)| *kk == k) {
                known.push((k, pin));
            }
        }
        known
    }

    /// The listed PIDs to classify: unknown, replaced by another process (`gone` names the
    /// old one), or classified under an older pod-source generation.
    pub fn to_classify(
        &self,
        listed: &BTreeMap<u32, BTreeSet<u32>>,
        gone: &[ProcKey],
        generation: u64,
    ) -> Vec<u32> {
        self.observed.table.to_classify(listed, gone, generation)
    }

    /// The cgroups an offline process would be held with as a whole if every member is
    /// offline: their members are read with the lists (rules mode).
    pub fn cgroups(&self) -> Vec<PathBuf> {
        self.observed.table.whole_cgroups()
    }

    /// Whether a sample of `pid` on `gpu` stamped `at_ns` names a process the table does
    /// not know there (the lists are read for it).
    pub fn sample_unknown(&self, gpu: u32, pid: u32, at_ns: u64) -> bool {
        at_ns > self.observed.sampling.blind(gpu) && !self.observed.table.knows_sample(gpu, pid)
    }

    /// Whether reading `r` of page `page` is a launch of a process the table does not hold
    /// (not listed yet, or not yet on that GPU): the lists are read for it. A PID whose
    /// entry is not online counts as not held once `start_of` (the shell's read of the
    /// PID's start time now, if it looks) says it is another process: an online process
    /// that reused an offline process's PID before a list read dropped the old entry.
    pub fn names_unknown(
        &self,
        page: &PageInfo,
        r: &BellReading,
        start_of: &mut dyn FnMut(u32) -> Option<u64>,
    ) -> bool {
        let obs = self.observed;
        // A launch on a GPU the agent manages, newer than what it treats as history.
        let counts = || {
            let gpu = obs
                .gpus()
                .iter()
                .map(|(g, _)| *g)
                .find(|g| obs.bells.uuid_of(*g) == Some(r.reading.uuid))?;
            let counts =
                !obs.health.degraded(gpu) && r.reading.last_launch_ns > obs.sampling.blind(gpu);
            counts.then_some(gpu)
        };
        let table = &obs.table;
        match &page.owner {
            Owner::Pid(pid) => match table.by_pid(*pid) {
                None => counts().is_some(),
                Some(e) if e.cls.class != Class::Online => {
                    counts().is_some() && start_of(*pid).is_some_and(|s| s != e.key.start)
                }
                Some(e) if e.uid != page.file_uid => false,
                Some(e) => counts().is_some_and(|gpu| !e.gpus.contains(&gpu)),
            },
            Owner::Pod(uid) => {
                let (mut of_pod, mut online) = (false, Vec::new());
                for e in table.entries() {
                    if e.pod_uid.as_deref() == Some(uid.as_str()) {
                        of_pod = true;
                        if e.cls.class == Class::Online {
                            online.push(e);
                        }
                    }
                }
                match (of_pod, online.is_empty()) {
                    (false, _) => counts().is_some(),
                    (true, true) => false,
                    (true, false) => {
                        counts().is_some_and(|gpu| !online.iter().any(|e| e.gpus.contains(&gpu)))
                    }
                }
            }
        }
    }
}

/// What the shell gathered for the [`Reads`] of the tick that started.
#[derive(Debug)]
pub struct Snapshot {
    /// The doorbell pages (the latest read).
    pub bells: Bells,
    /// NVML's samples, where they were read.
    pub samples: Option<Samples>,
    /// The process lists, where they were read.
    pub lists: Option<Lists>,
    /// GPU memory, where it was read.
    pub memory: Option<Memory>,
    /// A doorbell rang during the NVML reads: what was not read waits for the next tick.
    pub rang: bool,
}

/// The doorbell pages read.
#[derive(Debug, Default)]
pub struct Bells {
    /// The pages mapped now, when the set changed.
    pub pages: Option<Vec<PageInfo>>,
    /// Every page's readings.
    pub readings: Vec<BellReading>,
    /// The offline pages' gate fields.
    pub gates: Vec<(u64, Vec<GateReading>)>,
}

/// NVML's samples read: per GPU read, its samples or the error.
#[derive(Debug)]
pub struct Samples {
    /// Per GPU, in order.
    pub read: Vec<(u32, Result<Vec<gpu::Activity>, String>)>,
    /// A doorbell rang: the round stopped after these.
    pub yielded: bool,
}

/// The process lists read, and what came with them.
#[derive(Debug)]
pub struct Lists {
    /// Why they were read.
    pub why: Refresh,
    /// PID → GPUs, from the GPUs whose listing succeeded.
    pub listed: BTreeMap<u32, BTreeSet<u32>>,
    /// GPUs whose listing failed, with the error.
    pub failed: BTreeMap<u32, String>,
    /// Known processes that no longer live.
    pub gone: Vec<ProcKey>,
    /// The pod source's generation.
    pub generation: u64,
    /// The classification of each listed PID [`Known::to_classify`] named (`None`: not
    /// in `/proc`, exited).
    pub classified: Vec<(u32, Option<Entry>)>,
    /// What the members of the cgroups asked for are.
    pub members: Vec<(PathBuf, Members)>,
}

/// GPU memory read.
#[derive(Debug)]
pub struct Memory {
    /// Per GPU, its memory, or the error.
    pub reads: Vec<(u32, Result<Option<gpu::GpuMemory>, String>)>,
    /// Per process on those GPUs, what its memory limits leave it, bytes (absent: no
    /// limit): a checkpoint moves its device memory into its own host memory.
    pub room: BTreeMap<u32, u64>,
}

/// What the controller asks the shell to do. Nothing here reads: the reads are all in
/// the tick's snapshot ([`Reads`]).
#[derive(Debug)]
pub enum Cmd {
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
    /// Start a call to the driver's checkpoint API, off the loop. Answered, when it ends
    /// (a later round or tick), by [`Obs::Driver`].
    Driver(crate::control::driver_book::Call),
}

/// What the shell observed.
#[derive(Debug)]
pub enum Obs {
    /// What the shell gathered for the [`Reads`] of the tick that started.
    Snapshot(Box<Snapshot>),
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
    /// A driver call ended.
    Driver(crate::control::model::driver::Done),
    /// The offline pages' gate fields, read by the shell right after it closed a gate (a
    /// shim with nothing in flight acknowledges at once: its process is held in the tick
    /// that closed its gate, not at the next one).
    GateFields(Vec<(u64, Vec<GateReading>)>),
}
