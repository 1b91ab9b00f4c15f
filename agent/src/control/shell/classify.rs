//! Classification, the shell's part: who a GPU process is (`/proc`), what class the pod
//! source gives it, a pidfd pinning it (kept in the shell's [`super::pins`]), and what is
//! observed of its cgroup ([`super::choose`]); whether a known process still lives; and,
//! in rules mode, whether a cgroup the rules declare offline holds only offline processes
//! ([`Members`]). The controller chooses the plan from these facts
//! ([`crate::control::plan`]); this room only reads.
//!
//! May touch: reads `/proc/<pid>/…`, `cgroup.procs`; opens pidfds; asks the pod source.

use super::choose::Chooser;
use super::pins::Pins;
use crate::control::entry::Entry;
use crate::control::plan::{Alone, CgroupFacts, Members};
use crate::control::table::Table;
use crate::control::text::truncate;
use crate::edges::procfs::{ProcFs, ProcKey};
use crate::edges::source::PodSource;
use qos_core::Class;
use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use tracing::{info, warn};

/// What classification needs.
#[derive(Clone)]
pub struct Classifier {
    /// `/proc`.
    pub procfs: Arc<dyn ProcFs>,
    /// The pod source.
    pub source: Arc<dyn PodSource>,
    /// Target choice.
    pub chooser: Chooser,
    /// The pidfds that pin the processes it classifies.
    pub pins: Arc<Pins>,
    /// One-time warnings already given.
    warned: BTreeSet<String>,
}

impl std::fmt::Debug for Classifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Classifier")
            .field("chooser", &self.chooser)
            .finish_non_exhaustive()
    }
}

impl Classifier {
    /// A classifier over these edges.
    pub fn new(
        procfs: Arc<dyn ProcFs>,
        source: Arc<dyn PodSource>,
        chooser: Chooser,
        pins: Arc<Pins>,
    ) -> Self {
        Classifier {
            procfs,
            source,
            chooser,
            pins,
            warned: BTreeSet::new(),
        }
    }

    /// Which of `known` (each with whether it is pinned) no longer live (one pidfd poll
    /// for those pinned; the start time of the others), among the PIDs in `listed`.
    pub fn gone(
        &self,
        known: &[(ProcKey, bool)],
        listed: &BTreeMap<u32, BTreeSet<u32>>,
    ) -> Vec<ProcKey> {
        let known: Vec<(ProcKey, Option<Arc<OwnedFd>>)> = known
            .iter()
            .filter(|(k, _)| listed.contains_key(&k.pid))
            .map(|(k, pinned)| (*k, pinned.then(|| self.pins.get(k)).flatten()))
            .collect();
        let pins: Vec<(ProcKey, &OwnedFd)> = known
            .iter()
            .filter_map(|(k, pin)| pin.as_deref().map(|fd| (*k, fd)))
            .collect();
        let exited = self.procfs.exited(&pins);
        let mut out: Vec<ProcKey> = pins
            .iter()
            .zip(exited)
            .filter(|(_, gone)| *gone)
            .map(|((k, _), _)| *k)
            .collect();
        for (k, pin) in &known {
            if pin.is_none() && !matches!(self.procfs.read_stat(k.pid), Ok(s) if s.start == k.start)
            {
                out.push(*k);
            }
        }
        out
    }

    /// Classifies `pid`; `None` when it is not visible in `/proc` (exited).
    pub fn classify(&mut self, pid: u32, generation: u64, table: &Table) -> Option<Entry> {
        let info = match self.procfs.read_proc(pid) {
            Ok(i) => i,
            Err(err) => {
                tracing::debug!(pid, %err, "GPU process not in /proc (exited): ignored");
                return None;
            }
        };
        let mut cls = self.source.classify(&info);
        let mut cgroup = CgroupFacts::default();
        let pin = self.procfs.open_pidfd(info.key);
        if cls.class.is_suspendable() {
            match &pin {
                Ok(_) => {
                    cgroup = self.chooser.facts(&info, &cls);
                    if let Some(dir) = cgroup.may_be_whole().map(std::path::Path::to_path_buf) {
                        cgroup.members = self.members(&dir, table);
                    }
                    match cgroup.whole() {
                        Err(why @ (Alone::Mixed { .. } | Alone::Unreadable(_))) => {
                            self.warn_mixed(&why)
                        }
                        Err(why)
                            if why.warns(self.chooser.preferred)
                                && self.warned.insert(format!("fallback:{}", cls.owner)) =>
                        {
                            warn!(pid, owner = %cls.owner, reason = %why, "Freezer not usable for this offline process: using signal");
                        }
                        _ => {}
                    }
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
        let stop = cls
            .class
            .is_suspendable()
            .then(|| crate::control::plan::stop(info.key, self.chooser.preferred, &cgroup));
        info!(
            pid,
            class = %cls.class,
            owner = %cls.owner,
            actuator = stop.as_ref().map(|p| p.kind().as_str()).unwrap_or("-"),
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
            cgroup,
            pinned: match pin {
                Ok(fd) => {
                    self.pins.insert(info.key, fd);
                    true
                }
                Err(_) => false,
            },
            home: self
                .chooser
                .mounts
                .dir_for(
                    info.cgroups.v2.as_deref(),
                    info.cgroups.v1.get("freezer").map(String::as_str),
                )
                .map(|(dir, _)| dir),
            generation,
        })
    }

    /// The first process in cgroup `dir` or beneath it that is not offline, with its class
    /// (the agent itself counts as not offline), or that none is. In rules mode only: the
    /// pod source vouches for the cgroups it declares offline otherwise.
    pub fn members(&self, dir: &std::path::Path, table: &Table) -> Members {
        if self.source.whole_cgroups() {
            return Members::Offline;
        }
        let me = self.procfs.self_pid();
        let Ok(pids) = self.procfs.cgroup_tree_members(dir) else {
            return Members::Unreadable;
        };
        let mixed = pids.into_iter().find_map(|pid| {
            if pid == me {
                return Some((pid, Class::System));
            }
            // The table's entry only while its PID is still that process (not reused
            // since it was classified).
            let class = match table
                .by_pid(pid)
                .filter(|e| matches!(self.procfs.read_stat(pid), Ok(s) if s.start == e.key.start))
            {
                Some(e) => e.cls.class,
                None => match self.procfs.read_proc(pid) {
                    Ok(info) => self.source.classify(&info).class,
                    Err(_) => return None,
                },
            };
            (!class.is_suspendable()).then_some((pid, class))
        });
        match mixed {
            Some((pid, class)) => Members::Mixed { pid, class },
            None => Members::Offline,
        }
    }

    /// Members of `dir`, read again (rules mode) with the lists, warned about once.
    pub fn vet(&mut self, dir: &std::path::Path, table: &Table) -> Members {
        let members = self.members(dir, table);
        if let Some(why) = members.alone(dir) {
            self.warn_mixed(&why);
        }
        members
    }

    /// The one-time warning that an offline cgroup is not held whole because of its members.
    fn warn_mixed(&mut self, why: &Alone) {
        let (Alone::Mixed { dir, .. } | Alone::Unreadable(dir)) = why else {
            return;
        };
        if !self.warned.insert(format!("mixed:{}", dir.display())) {
            return;
        }
        match why {
            Alone::Mixed { pid, class, .. } => {
                warn!(cgroup = %dir.display(), pid, class = %class, "The offline cgroup (or one beneath it) also holds a process that is not offline: stopping only the offline processes, one by one");
            }
            _ => {
                warn!(cgroup = %dir.display(), "Cannot read the members of the offline cgroup and the cgroups beneath it: stopping only the offline processes, one by one");
            }
        }
    }
}
