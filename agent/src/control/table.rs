//! The process table: every GPU process the driver lists, who it is (PID + start time, so
//! a reused PID is a new process), its class, the GPUs it is on, its latest activity per
//! GPU, and how it would be suspended.
//!
//! A PID the driver lists but `/proc` does not show is treated as exited: never online
//! demand, never touched, its samples ignored. The agent runs in the host PID namespace,
//! where that is what it means; if such PIDs stay listed for over
//! [`INVISIBLE_WARN_AFTER_NS`], the agent is probably not in the host PID namespace, and
//! says so once.
//!
//! The table does no I/O: the shell reads the lists and classifies the PIDs the table
//! names ([`Table::to_classify`]); the table applies what it is told ([`Table::apply`]).

use crate::control::model::act::Kind;
use crate::control::model::act::RecordEntry;
use crate::control::model::ProcKey;
use crate::control::note::{self, Note};
use crate::control::plan::Members;
use qos_core::Class;
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// How long a listed PID may stay invisible in `/proc` before the agent warns that it is
/// probably not in the host PID namespace.
pub const INVISIBLE_WARN_AFTER_NS: u64 = 1_000_000_000;

pub use super::entry::{Activity, Entry};

/// The table.
#[derive(Debug, Default)]
pub struct Table {
    procs: HashMap<u32, Entry>,
    /// Listed PIDs not visible in `/proc`, with when that was first seen.
    invisible: HashMap<u32, u64>,
    /// The pod source's generation at the latest refresh (every entry is classified
    /// under it afterwards).
    generation: Option<u64>,
    /// Some offline process is on a GPU (as of the latest refresh).
    offline_present: bool,
    /// Some of them has a `fixed-share` cap (as of the latest refresh).
    fixed_share_present: bool,
    /// A refresh happened since the latest purge.
    refreshed: bool,
    /// GPUs with doorbell activity noted since the last [`Table::take_touched`].
    touched: Vec<u32>,
    /// The warning about PIDs invisible in `/proc` was given.
    warned_invisible: bool,
}

impl Table {
    /// Whether a sample of `pid` on `gpu` names a process the table knows there (an exited
    /// process's samples count for nothing, known or not).
    pub fn knows_sample(&self, gpu: u32, pid: u32) -> bool {
        match self.procs.get(&pid) {
            Some(e) if e.gpus.contains(&gpu) => true,
            _ => self.invisible.contains_key(&pid),
        }
    }

    /// Records a sample; returns `false` when the PID is unknown on that GPU (the caller
    /// re-reads the process list).
    pub fn note_sample(&mut self, gpu: u32, pid: u32, act: Activity) -> bool {
        match self.procs.get_mut(&pid) {
            Some(e) if e.gpus.contains(&gpu) => {
                e.note(gpu, act);
                true
            }
            // An exited process's samples count for nothing.
            _ => self.invisible.contains_key(&pid),
        }
    }

    /// Forgets the onsets on `gpu` (its busy period ended): the next activity there starts
    /// a run of its own.
    pub fn end_runs(&mut self, gpu: u32) {
        for e in self.procs.values_mut() {
            e.onset.remove(&gpu);
        }
    }

    /// The entry of `pid`, if known.
    pub fn by_pid(&self, pid: u32) -> Option<&Entry> {
        self.procs.get(&pid)
    }

    /// Notes activity of a known process (a doorbell reading attributed to it).
    pub fn note(&mut self, key: &ProcKey, gpu: u32, act: Activity) {
        if let Some(e) = self.procs.get_mut(&key.pid).filter(|e| e.key == *key) {
            if e.note(gpu, act) && !self.touched.contains(&gpu) {
                self.touched.push(gpu);
            }
        }
    }

    /// The GPUs with doorbell activity since the last call (NVML samples and refreshes
    /// are known to the loop by the tick that read them).
    pub fn take_touched(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.touched)
    }

    /// Whether an entry was classified under an older pod-source generation.
    pub fn stale(&self, generation: u64) -> bool {
        self.generation != Some(generation)
    }

    /// Whether an offline process was on a GPU at the latest refresh.
    pub fn offline_present(&self) -> bool {
        self.offline_present
    }

    /// Some offline process with a `fixed-share` cap is on a GPU (its duty cycle needs
    /// the fast tick).
    pub fn fixed_share_present(&self) -> bool {
        self.fixed_share_present
    }

    /// The entry of `key` (same PID and start time).
    pub fn entry(&self, key: &ProcKey) -> Option<&Entry> {
        self.procs.get(&key.pid).filter(|e| e.key == *key)
    }

    /// All entries.
    pub fn entries(&self) -> impl Iterator<Item = &Entry> {
        self.procs.values()
    }

    /// Forgets activity seen so far (on `gpu`, or everywhere): after a fail-open, old
    /// samples must not start the next busy period.
    pub fn clear_activity(&mut self, gpu: Option<u32>) {
        for e in self.procs.values_mut() {
            match gpu {
                Some(g) => {
                    e.last_active.remove(&g);
                    e.onset.remove(&g);
                }
                None => {
                    e.last_active.clear();
                    e.onset.clear();
                }
            }
        }
    }

    /// Drops entries no longer on any GPU, unless `keep` says otherwise.
    /// Only entries changed by a refresh can have left every GPU, so it does nothing
    /// between refreshes.
    pub fn purge(&mut self, keep: impl Fn(&ProcKey) -> bool) {
        if !std::mem::take(&mut self.refreshed) {
            return;
        }
        self.procs.retain(|_, e| !e.gpus.is_empty() || keep(&e.key));
    }

    /// The table's processes, and whether the shell pins each: what the shell checks are
    /// still alive.
    pub fn known(&self) -> Vec<(ProcKey, bool)> {
        self.procs.values().map(|e| (e.key, e.pinned)).collect()
    }

    /// The cgroups an offline process on a GPU would be held with as a whole if its
    /// members allow it: their members are read again with the lists (rules mode).
    pub fn whole_cgroups(&self) -> Vec<std::path::PathBuf> {
        let mut out: Vec<std::path::PathBuf> = Vec::new();
        for e in self.procs.values() {
            if !e.cls.class.is_suspendable() || e.gpus.is_empty() {
                continue;
            }
            if let Some(dir) = e.cgroup.may_be_whole() {
                if !out.iter().any(|d| d == dir) {
                    out.push(dir.to_path_buf());
                }
            }
        }
        out
    }

    /// The members of cgroup `dir` were read (rules mode): the entries whose cgroup it is
    /// learn them.
    pub fn members_read(&mut self, dir: &std::path::Path, members: Members) {
        for e in self.procs.values_mut() {
            if e.cgroup.may_be_whole() == Some(dir) {
                e.cgroup.members = members;
            }
        }
    }

    /// The listed PIDs to classify: unknown, replaced by another process (`gone` names the
    /// old one), or classified under an older pod-source generation.
    pub fn to_classify(
        &self,
        listed: &BTreeMap<u32, BTreeSet<u32>>,
        gone: &[ProcKey],
        generation: u64,
    ) -> Vec<u32> {
        listed
            .keys()
            .filter(|pid| match self.procs.get(pid) {
                None => true,
                Some(e) => gone.contains(&e.key) || e.generation != generation,
            })
            .copied()
            .collect()
    }

    /// Applies a fresh process listing. `listed`: PID → GPUs, from the GPUs whose listing
    /// succeeded; `failed`: GPUs whose listing failed (membership there is kept as it was);
    /// `fresh`: the classification of each PID [`Table::to_classify`] named (`None`: not in
    /// `/proc`, exited). Returns what is worth reporting (replaced PIDs, PIDs invisible in
    /// `/proc`).
    pub fn apply(
        &mut self,
        listed: &BTreeMap<u32, BTreeSet<u32>>,
        failed: &BTreeSet<u32>,
        generation: u64,
        now: u64,
        fresh: Vec<(u32, Option<Entry>)>,
    ) -> Vec<Note> {
        let mut notes = Vec::new();
        for (pid, classified) in fresh {
            // What is held suspended lives in the holds with its target, so replacing the
            // entry loses nothing: the machine resumes the old key next tick.
            let old = self.procs.remove(&pid);
            if let (Some(o), Some(e)) = (&old, &classified) {
                if o.key != e.key {
                    notes.push(note::Replaced { pid }.into());
                }
            }
            let Some(mut entry) = classified else {
                self.invisible.entry(pid).or_insert(now);
                continue;
            };
            self.invisible.remove(&pid);
            // The same process classified again: what it was seen doing is still true (a
            // sample noted earlier in this tick included).
            if let Some(o) = old.filter(|o| o.key == entry.key) {
                entry.last_active = o.last_active;
                entry.last_sampled = o.last_sampled;
                entry.nvml_seen = o.nvml_seen;
                entry.onset = o.onset;
                entry.rung = o.rung;
            }
            self.procs.insert(pid, entry);
        }
        for (pid, gpus) in listed {
            if let Some(e) = self.procs.get_mut(pid) {
                let keep: BTreeSet<u32> = e.gpus.intersection(failed).copied().collect();
                e.gpus = gpus.union(&keep).copied().collect();
                let on = e.gpus.clone();
                e.last_active.retain(|g, _| on.contains(g));
                e.onset.retain(|g, _| on.contains(g));
            }
        }
        for (pid, e) in self.procs.iter_mut() {
            if !listed.contains_key(pid) {
                e.gpus.retain(|g| failed.contains(g));
            }
        }
        self.generation = Some(generation);
        self.refreshed = true;
        let offline = || {
            self.procs
                .values()
                .filter(|e| e.cls.class == Class::Offline && !e.gpus.is_empty())
        };
        self.offline_present = offline().next().is_some();
        self.fixed_share_present =
            offline().any(|e| matches!(e.cls.share, qos_core::Share::Fixed { .. }));
        self.invisible.retain(|pid, since| {
            listed.contains_key(pid) || now.saturating_sub(*since) < 10 * INVISIBLE_WARN_AFTER_NS
        });
        let pids: Vec<u32> = self
            .invisible
            .iter()
            .filter(|(pid, since)| {
                listed.contains_key(pid) && now.saturating_sub(**since) >= INVISIBLE_WARN_AFTER_NS
            })
            .map(|(pid, _)| *pid)
            .collect();
        let warn = !pids.is_empty() && !std::mem::replace(&mut self.warned_invisible, true);
        notes.push(note::Invisible { pids, warn }.into());
        notes
    }

    /// What the record should hold ahead: every target an offline process on a GPU could
    /// be suspended through (its stop's own target under `--actuator` `preferred`; a
    /// signalled cgroup's leader, its other members being read at suspension), and with
    /// `gate` (the gate file; `uuid`: a GPU's UUID) the gate of the GPU an offline process
    /// uses alone.
    pub fn ahead(
        &self,
        preferred: Kind,
        gate: Option<&std::path::Path>,
        uuid: impl Fn(u32) -> Option<String>,
    ) -> BTreeSet<RecordEntry> {
        let mut out = BTreeSet::new();
        for e in self.procs.values() {
            if e.cls.class != Class::Offline || e.gpus.is_empty() {
                continue;
            }
            // The process (a signalled cgroup's leader) or the cgroup.
            if let Some(stop) = e.stop(preferred) {
                out.insert(stop.target().record());
            }
            if let (Some(file), [gpu]) = (gate, &e.gpus.iter().copied().collect::<Vec<_>>()[..]) {
                if let Some(uuid) = uuid(*gpu) {
                    out.insert(RecordEntry::Gate {
                        file: file.to_path_buf(),
                        uuid,
                    });
                }
            }
        }
        out
    }

    /// The inputs of the state machine for the `managed` GPUs; `sampled_busy(gpu)` says
    /// whether NVML-only online work there may still be busy.
    pub fn inputs(
        &self,
        managed: &[u32],
        sampled_busy: impl Fn(u32) -> bool,
    ) -> Vec<qos_core::GpuInput<ProcKey>> {
        let mut by_gpu: BTreeMap<u32, Vec<qos_core::ProcessObs<ProcKey>>> =
            managed.iter().map(|g| (*g, Vec::new())).collect();
        for e in self.procs.values() {
            for g in &e.gpus {
                if let Some(v) = by_gpu.get_mut(g) {
                    let onset = e.onset.get(g).copied();
                    v.push(qos_core::ProcessObs {
                        key: e.key,
                        class: e.cls.class,
                        last_active: e.last_active.get(g).copied(),
                        onset: onset.map(|o| o.0),
                        signal: onset.map_or(qos_core::Signal::Nvml, |o| o.1),
                        share: e.cls.share,
                    });
                }
            }
        }
        by_gpu
            .into_iter()
            .map(|(gpu, procs)| qos_core::GpuInput {
                gpu,
                sampled_busy: sampled_busy(gpu),
                procs,
            })
            .collect()
    }

    /// Whether online work on `gpu` seen only through NVML may still be busy: its latest
    /// busy sample covers the period ending at `t`, and no read of the driver's samples
    /// (the latest at `read`) has happened since the next period was due (`t` + one sample
    /// `period`, and `margin` more for the driver to write it: a quarter period, or
    /// `nvml::READ_LAG_NS` where reads follow the driver's periods). Until then it counts as
    /// busy: the sample that shows the work still running may be written just after the
    /// read (at the shipped defaults, a 100 ms window and a 100 ms driver period, the
    /// release fell due exactly when the next sample was written, and a sample read just
    /// before its successor was already a window old). Processes with a doorbell page are
    /// exempt: their launches are seen as they happen.
    pub fn sampled_busy(
        &self,
        gpu: u32,
        read: u64,
        period: u64,
        margin: u64,
        unmanaged_online: bool,
    ) -> bool {
        self.procs.values().any(|e| {
            e.gpus.contains(&gpu)
                && !e.rung
                && e.cls.class.is_online_demand(unmanaged_online)
                && e.last_sampled
                    .get(&gpu)
                    .is_some_and(|t| read < t + period + margin)
        })
    }

    /// How many of `gpu`'s processes `suspended` says are suspended.
    pub fn suspended_on(&self, gpu: u32, suspended: impl Fn(&ProcKey) -> bool) -> usize {
        self.procs
            .values()
            .filter(|e| e.gpus.contains(&gpu) && suspended(&e.key))
            .count()
    }
}

pub use super::text::sanitize;
