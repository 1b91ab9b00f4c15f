//! Classification, the shell's part: who a GPU process is (`/proc`), what class the pod
//! source gives it, a pidfd pinning it (kept in the shell's [`super::pins`]), and how it
//! would be suspended (the target
//! chooser); whether a known process still lives; and, in rules mode, whether a cgroup the
//! rules declare offline holds only offline processes. The controller decides which PIDs
//! to classify and what follows; this room only reads.
//!
//! May touch: reads `/proc/<pid>/…`, `cgroup.procs`; opens pidfds; asks the pod source.

use super::choose::Chooser;
use super::pins::Pins;
use crate::control::entry::Entry;
use crate::control::table::Table;
use crate::control::target::{Frozen, Plan};
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
        let mut plan = None;
        let pin = self.procfs.open_pidfd(info.key);
        if cls.class.is_suspendable() {
            match &pin {
                Ok(_) => {
                    let (p, why) = self.chooser.choose(&info, &cls);
                    if let Some(why) = why {
                        if self.warned.insert(format!("fallback:{}", cls.owner)) {
                            warn!(pid, owner = %cls.owner, reason = %why, "Freezer not usable for this offline process: using signal");
                        }
                    }
                    plan = Some(self.unmixed(p, info.key, table));
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
    /// (the agent itself counts as not offline). `None`: every member is offline. A
    /// membership that cannot be read is `Some((0, Unmanaged))`: it is not known to be all
    /// offline.
    fn mixed(&self, dir: &std::path::Path, table: &Table) -> Option<(u32, Class)> {
        let me = self.procfs.self_pid();
        let Ok(pids) = self.procfs.cgroup_tree_members(dir) else {
            return Some((0, Class::Unmanaged));
        };
        pids.into_iter().find_map(|pid| {
            if pid == me {
                return Some((pid, Class::System));
            }
            let class = match table.by_pid(pid) {
                Some(e) => e.cls.class,
                None => match self.procfs.read_proc(pid) {
                    Ok(info) => self.source.classify(&info).class,
                    Err(_) => return None,
                },
            };
            (!class.is_suspendable()).then_some((pid, class))
        })
    }

    /// `plan`, or, when it would freeze or stop a whole cgroup that also holds processes
    /// that are not offline (possible with standalone rules only), the plan to stop the
    /// offline process (`key`) alone.
    pub fn unmixed(&mut self, plan: Plan, key: ProcKey, table: &Table) -> Plan {
        if self.source.whole_cgroups() {
            return plan;
        }
        let dir = match &plan {
            Plan::Freeze(Frozen { dir, .. }) | Plan::SignalCgroup { dir, .. } => dir.clone(),
            _ => return plan,
        };
        let Some((pid, class)) = self.mixed(&dir, table) else {
            return plan;
        };
        if self.warned.insert(format!("mixed:{}", dir.display())) {
            if pid == 0 {
                warn!(cgroup = %dir.display(), "Cannot read the members of the offline cgroup and the cgroups beneath it: stopping only the offline processes, one by one");
            } else {
                warn!(cgroup = %dir.display(), pid, class = %class, "The offline cgroup (or one beneath it) also holds a process that is not offline: stopping only the offline processes, one by one");
            }
        }
        Plan::Signal(key)
    }
}
