//! The process table: every GPU process the driver lists, who it is (PID + start time, so
//! a reused PID is a new process), its class, the GPUs it is on, its latest activity per
//! GPU, and how it would be suspended.
//!
//! A PID the driver lists but `/proc` does not show is treated as exited: never online
//! demand, never touched, its samples ignored. The agent runs in the host PID namespace,
//! where that is what it means; if such PIDs stay listed for over
//! [`INVISIBLE_WARN_AFTER_NS`], the agent is probably not in the host PID namespace, and
//! says so once.

use crate::control::target::{Chooser, Plan};
use crate::edges::actuator::Target;
use crate::edges::procfs::{ProcFs, ProcKey};
use crate::edges::source::PodSource;
use qos_core::Class;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use tracing::{info, warn};

/// How long a listed PID may stay invisible in `/proc` before the agent warns that it is
/// probably not in the host PID namespace.
pub const INVISIBLE_WARN_AFTER_NS: u64 = 1_000_000_000;

pub use super::entry::{Activity, Entry};

/// What classification needs.
#[derive(Clone)]
pub struct Classifier {
    /// `/proc`.
    pub procfs: Arc<dyn ProcFs>,
    /// The pod source.
    pub source: Arc<dyn PodSource>,
    /// Target choice.
    pub chooser: Chooser,
}

impl std::fmt::Debug for Classifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Classifier")
            .field("chooser", &self.chooser)
            .finish_non_exhaustive()
    }
}

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
    warned: BTreeSet<String>,
}

impl Table {
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

    /// Applies a fresh process listing. `listed`: PID → GPUs, from the GPUs whose listing
    /// succeeded; `failed`: GPUs whose listing failed (membership there is kept as it was).
    pub fn refresh(
        &mut self,
        listed: &BTreeMap<u32, BTreeSet<u32>>,
        failed: &BTreeSet<u32>,
        generation: u64,
        now: u64,
        c: &Classifier,
    ) {
        let exited = self.exited(listed, c);
        for (pid, gpus) in listed {
            let reused = match self.procs.get(pid) {
                None => true,
                Some(e) => match exited.get(pid) {
                    Some(gone) => *gone,
                    None => !matches!(c.procfs.read_stat(*pid), Ok(s) if s.start == e.key.start),
                },
            };
            let reclassify = self
                .procs
                .get(pid)
                .is_some_and(|e| e.generation != generation);
            if reused || reclassify {
                // What is held suspended lives in the holds with its target, so replacing
                // the entry loses nothing: the machine resumes the old key next tick.
                let old = self.procs.remove(pid);
                match self.classify(*pid, generation, now, c) {
                    Some(mut entry) => {
                        match old {
                            Some(_) if reused => {
                                info!(pid, "GPU process replaced by another with the same PID")
                            }
                            // The same process classified again: what it was seen doing is
                            // still true (a sample noted earlier in this tick included).
                            Some(o) if o.key == entry.key => {
                                entry.last_active = o.last_active;
                                entry.last_sampled = o.last_sampled;
                                entry.nvml_seen = o.nvml_seen;
                                entry.onset = o.onset;
                                entry.rung = o.rung;
                            }
                            _ => {}
                        }
                        self.procs.insert(*pid, entry);
                    }
                    None => continue,
                }
            }
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
        let long: Vec<u32> = self
            .invisible
            .iter()
            .filter(|(pid, since)| {
                listed.contains_key(pid) && now.saturating_sub(**since) >= INVISIBLE_WARN_AFTER_NS
            })
            .map(|(pid, _)| *pid)
            .collect();
        metrics::gauge!("coloc_invisible_gpu_processes").set(long.len() as f64);
        if !long.is_empty() && self.warned.insert("pid-namespace".into()) {
            warn!(pids = ?long, "GPU processes listed by the driver have not been visible in /proc for over 1 s: is the agent in the host PID namespace (hostPID: true)? They are ignored");
        }
    }

    /// Which listed, known processes with a pidfd have exited (one poll for all).
    fn exited(&self, listed: &BTreeMap<u32, BTreeSet<u32>>, c: &Classifier) -> HashMap<u32, bool> {
        let pins: Vec<(ProcKey, &OwnedFd)> = listed
            .keys()
            .filter_map(|pid| self.procs.get(pid))
            .filter_map(|e| e.pin.as_deref().map(|fd| (e.key, fd)))
            .collect();
        let gone = c.procfs.exited(&pins);
        pins.iter()
            .zip(gone)
            .map(|((k, _), g)| (k.pid, g))
            .collect()
    }

    /// The first process in cgroup `dir` or beneath it that is not offline, with its class
    /// (the agent itself counts as not offline). `None`: every member is offline. A
    /// membership that cannot be read is `Some((0, Unmanaged))`: it is not known to be all
    /// offline.
    pub fn mixed(&self, dir: &std::path::Path, c: &Classifier) -> Option<(u32, Class)> {
        let me = c.procfs.self_pid();
        let Ok(pids) = c.procfs.cgroup_tree_members(dir) else {
            return Some((0, Class::Unmanaged));
        };
        pids.into_iter().find_map(|pid| {
            if pid == me {
                return Some((pid, Class::System));
            }
            let class = match self.procs.get(&pid) {
                Some(e) => e.cls.class,
                None => match c.procfs.read_proc(pid) {
                    Ok(info) => c.source.classify(&info).class,
                    Err(_) => return None,
                },
            };
            (!class.is_suspendable()).then_some((pid, class))
        })
    }

    /// `plan`, or, when it would freeze or stop a whole cgroup that also holds processes
    /// that are not offline (possible with standalone rules only), the plan to stop the
    /// offline process alone (`alone`).
    pub fn unmixed(&mut self, plan: Plan, alone: Target, c: &Classifier) -> Plan {
        if c.source.whole_cgroups() {
            return plan;
        }
        let dir = match &plan {
            Plan::Freeze(Target::Cgroup { dir, .. }) | Plan::SignalCgroup { dir, .. } => {
                dir.clone()
            }
            _ => return plan,
        };
        let Some((pid, class)) = self.mixed(&dir, c) else {
            return plan;
        };
        if self.warned.insert(format!("mixed:{}", dir.display())) {
            if pid == 0 {
                warn!(cgroup = %dir.display(), "Cannot read the members of the offline cgroup and the cgroups beneath it: stopping only the offline processes, one by one");
            } else {
                warn!(cgroup = %dir.display(), pid, class = %class, "The offline cgroup (or one beneath it) also holds a process that is not offline: stopping only the offline processes, one by one");
            }
        }
        Plan::Signal(alone)
    }

    /// Classifies `pid`; `None` when it is not visible in `/proc` (exited).
    fn classify(&mut self, pid: u32, generation: u64, now: u64, c: &Classifier) -> Option<Entry> {
        let info = match c.procfs.read_proc(pid) {
            Ok(i) => i,
            Err(err) => {
                self.invisible.entry(pid).or_insert(now);
                tracing::debug!(pid, %err, "GPU process not in /proc (exited): ignored");
                return None;
            }
        };
        self.invisible.remove(&pid);
        let mut cls = c.source.classify(&info);
        let mut plan = None;
        let pin = c.procfs.open_pidfd(info.key).map(Arc::new);
        if cls.class.is_suspendable() {
            match &pin {
                Ok(fd) => {
                    let (p, why) = c.chooser.choose(&info, &cls, fd.clone());
                    if let Some(why) = why {
                        if self.warned.insert(format!("fallback:{}", cls.owner)) {
                            warn!(pid, owner = %cls.owner, reason = %why, "Freezer not usable for this offline process: using signal");
                        }
                    }
                    let alone = Target::Process {
                        key: info.key,
                        pidfd: fd.clone(),
                    };
                    plan = Some(self.unmixed(p, alone, c));
                }
                Err(err) => {
                    // Without a pidfd we cannot be sure whom we would signal: leave it be,
                    // as a system process (never suspended, and not online demand: it is
                    // offline work, it must not preempt other offline work).
                    warn!(pid, %err, "Cannot pin offline process (pidfd): never suspended, treated as system");
                    cls.class = Class::System;
                }
            }
        }
        info!(
            pid,
            class = %cls.class,
            owner = %cls.owner,
            actuator = plan.as_ref().map(|p| p.kind().as_str()).unwrap_or("-"),
            cmd = %truncate(&info.cmdline, 120),
            "Classified GPU process"
        );
        if cls.class == Class::Unmanaged {
            metrics::counter!("coloc_unmanaged_processes_total").increment(1);
        }
        let pod_uid = info
            .cgroups
            .paths()
            .find_map(crate::edges::source::podref::parse)
            .map(|p| p.uid);
        Some(Entry {
            key: info.key,
            cls,
            cmd: truncate(&info.cmdline, 200),
            gpus: BTreeSet::new(),
            last_active: BTreeMap::new(),
            last_sampled: BTreeMap::new(),
            nvml_seen: BTreeMap::new(),
            onset: BTreeMap::new(),
            uid: info.uid,
            pod_uid,
            ns_pid: info.ns_pid,
            rung: false,
            plan,
            pin: pin.ok(),
            generation,
        })
    }
}

pub use super::text::{sanitize, truncate};
