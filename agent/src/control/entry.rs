//! One GPU process in the table, and how its activity is noted (runs, onsets, the
//! latest evidence per GPU).

use crate::control::model::act::Kind;
use crate::control::model::process::Classified;
use crate::control::model::ProcKey;
use crate::control::plan::CgroupFacts;
use crate::control::target::Stop;
use qos_core::Signal;
use std::collections::{BTreeMap, BTreeSet};

/// One GPU process.
#[derive(Debug, Clone)]
pub struct Entry {
    /// Identity.
    pub key: ProcKey,
    /// Class and owner.
    pub cls: Classified,
    /// Command line (truncated).
    pub cmd: String,
    /// GPUs it has a context on.
    pub gpus: BTreeSet<u32>,
    /// End of the latest activity per GPU (a launch, or the end of a sampled period), ns.
    pub last_active: BTreeMap<u32, u64>,
    /// End of the latest sampled period (NVML) that counted as activity, per GPU: until a
    /// read of the driver's samples has gone past the period after it, the process may
    /// still be busy (see `Loop::inputs`).
    pub last_sampled: BTreeMap<u32, u64>,
    /// End of the latest sampled period (NVML) that showed it at work at all, per GPU,
    /// whether or not it counted as activity: what corroborates its doorbell page.
    pub nvml_seen: BTreeMap<u32, u64>,
    /// Onset of the current run of activity per GPU, and the signal that gave it.
    pub onset: BTreeMap<u32, (u64, Signal)>,
    /// Real UID of the process.
    pub uid: u32,
    /// The pod it runs in, from its cgroup path (Kubernetes), if any.
    pub pod_uid: Option<String>,
    /// Its PID in its own PID namespace (the PID its shim writes in its pages).
    pub ns_pid: Option<u32>,
    /// A doorbell page is attributed to it (its launches are seen as they happen).
    pub rung: bool,
    /// What the shell observed of its cgroup: how it may be stopped (offline processes;
    /// [`crate::control::plan`]).
    pub cgroup: CgroupFacts,
    /// The shell pins it with a pidfd (tells cheaply when it has exited; the handle its
    /// signals go through), named by its key.
    pub pinned: bool,
    /// Its own cgroup's directory in the freezer hierarchy, if there is one: a hold that
    /// freezes or stops a cgroup at or above it stops it too, whatever its own plan.
    pub home: Option<std::path::PathBuf>,
    /// The pod source's generation when it was classified.
    pub generation: u64,
}

/// Activity seen on a GPU: from `start` to `end` (ns), through `signal`; a start at least
/// `window` after the previous end begins a new run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Activity {
    /// Earliest evidence (a launch time, or the start of a sampled period).
    pub start: u64,
    /// Latest evidence (a launch time, or the end of a sampled period).
    pub end: u64,
    /// A sampled period busy (nearly) all through: the work was still running at `end`.
    pub through_end: bool,
    /// Where it was seen.
    pub signal: Signal,
    /// The idle window: a gap this long ends a run.
    pub window: u64,
}

impl Entry {
    /// How it is stopped under `--actuator` `preferred` (offline processes only).
    pub fn stop(&self, preferred: Kind) -> Option<Stop> {
        self.cls
            .class
            .is_suspendable()
            .then(|| crate::control::plan::stop(self.key, preferred, &self.cgroup))
    }

    /// The cgroup directory whose holds stop it: the cgroup it is held with as a whole,
    /// else its own.
    pub fn stopped_with(&self) -> Option<&std::path::Path> {
        self.cls
            .class
            .is_suspendable()
            .then(|| self.cgroup.whole_dir())
            .flatten()
            .or(self.home.as_deref())
    }

    /// Records activity on `gpu`. Within a run the onset only moves earlier, except that
    /// a doorbell's launch time (exact) replaces a sampled period's start (a bound).
    ///
    /// How long activity lasts: for a process whose launches the doorbell sees, its
    /// samples count only when it was busy through the end of the sampled period (a kernel
    /// still running long after its launch); a partly busy period is work the doorbell
    /// already saw start, and counting it until the period's end would re-preempt after
    /// the release for work long finished. For a process without the shim the sample is
    /// all there is: it counts until the period's end, so that work seen late is still
    /// preempted.
    pub(super) fn note(&mut self, gpu: u32, a: Activity) -> bool {
        if a.signal == Signal::Nvml {
            let s = self.nvml_seen.entry(gpu).or_insert(0);
            *s = (*s).max(a.end);
        }
        if a.signal == Signal::Doorbell {
            self.rung = true;
        } else if self.rung && !a.through_end {
            return false;
        }
        let before = (
            self.last_active.get(&gpu).copied(),
            self.onset.get(&gpu).copied(),
        );
        let start = a.start.min(a.end);
        let prev_end = self.last_active.get(&gpu).copied();
        let new_run = prev_end.is_none_or(|p| start >= p.saturating_add(a.window));
        let run = self.onset.entry(gpu).or_insert((start, a.signal));
        if new_run {
            *run = (start, a.signal);
        } else if run.1 == a.signal {
            run.0 = run.0.min(start);
        } else if a.signal == Signal::Doorbell {
            *run = (start, Signal::Doorbell);
        }
        if a.signal == Signal::Nvml {
            let s = self.last_sampled.entry(gpu).or_insert(0);
            *s = (*s).max(a.end);
        }
        let t = self.last_active.entry(gpu).or_insert(0);
        *t = (*t).max(a.end);
        before != (Some(*t), Some(*run))
    }
}
