//! The shell's eyes: the edges the tick's snapshot is read through — NVML's samples,
//! process lists and memory, `/proc` and the pod source for classification, the doorbell
//! pages — each read turned into a part of the snapshot. Nothing here decides: what the
//! controller knows ([`Known`]) says which listed PIDs to classify and whether a page
//! names a process it does not hold yet.
//!
//! May touch: NVML, reads `/proc` and `cgroup.procs`, the doorbell directories (through
//! their edge, which also removes the directories of pods that are gone).

use super::classify::Classifier;
use crate::control::io::{Bells, BellsRead, Known, Lists, Memory, Samples};
use crate::control::model::bell::PageInfo;
use crate::control::nvml::Refresh;
use crate::edges::doorbell::Doorbells;
use crate::edges::gpu::GpuSampler;
use std::collections::{BTreeMap, BTreeSet};

/// A pod's directory is removed only when nothing changed in it for this long (and the
/// pod source says the pod is gone).
const POD_DIR_IDLE: std::time::Duration = std::time::Duration::from_secs(300);

/// The lists are read for launches on one page at most once in this long (its owner
/// unknown).
const LISTS_PER_PAGE_NS: u64 = 1_000_000_000;

/// See the module.
pub struct Eyes {
    /// NVML.
    pub gpu: Box<dyn GpuSampler>,
    /// Doorbell pages, and the loop's sleep.
    pub bells: Box<dyn Doorbells>,
    /// Classification.
    pub classifier: Classifier,
    /// The offline pages (their gate fields are read with `--gate`), as of the latest
    /// change of the set.
    offline_pages: Vec<u64>,
    /// The pod source's generation when the pods' doorbell directories were last made.
    pod_dirs_gen: Option<u64>,
    /// Every page, as of the latest change of the set.
    pages: BTreeMap<u64, PageInfo>,
    /// When the lists were last read for a launch on each page (its owner unknown).
    refreshed: BTreeMap<u64, u64>,
    /// Launches up to this time (the latest tick's) were judged for a process the
    /// controller does not hold.
    judged_until: u64,
    /// The latest round of sample reads was put off whole for a ring: the next one reads
    /// at least one GPU, whatever rings (a page ringing without a pause never starves
    /// NVML, which corroborates its claims).
    put_off: bool,
}

impl std::fmt::Debug for Eyes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Eyes").finish_non_exhaustive()
    }
}

impl Eyes {
    /// Eyes over these edges.
    pub fn new(
        gpu: Box<dyn GpuSampler>,
        bells: Box<dyn Doorbells>,
        classifier: Classifier,
    ) -> Eyes {
        Eyes {
            gpu,
            bells,
            classifier,
            offline_pages: Vec::new(),
            pages: BTreeMap::new(),
            refreshed: BTreeMap::new(),
            judged_until: 0,
            pod_dirs_gen: None,
            put_off: false,
        }
    }

    /// Each GPU's memory (memory preemption).
    pub fn memory(&mut self, gpus: &[u32]) -> Memory {
        let reads: Vec<_> = gpus
            .iter()
            .map(|g| (*g, self.gpu.memory(*g).map_err(|e| e.to_string())))
            .collect();
        let mut room = std::collections::BTreeMap::new();
        for (_, r) in &reads {
            for (pid, _) in r.iter().flatten().flat_map(|m| m.processes.iter()) {
                if let Ok(info) = self.classifier.procfs.read_proc(*pid) {
                    if let Some(b) = self.classifier.chooser.mounts.memory_room(&info.cgroups) {
                        room.insert(*pid, b);
                    }
                }
            }
        }
        Memory { reads, room }
    }

    /// Reads the samples of `gpus` since their timestamps, in order; stops when a doorbell
    /// has rung: before the first GPU (a launch that woke the loop is decided before any
    /// NVML call, ~2 ms each on an H100), unless the round before was put off so, and
    /// after any GPU (a launch never waits behind more than the call in progress). The
    /// GPUs not read stay due.
    pub fn samples(&mut self, gpus: &[(u32, u64)]) -> Samples {
        let mut read = Vec::with_capacity(gpus.len());
        let mut yielded = false;
        for (i, (gpu, since)) in gpus.iter().enumerate() {
            if (i > 0 || !self.put_off) && self.bells.rang() {
                metrics::counter!("coloc_nvml_rounds_yielded_total").increment(1);
                yielded = true;
                break;
            }
            let mut out = Vec::new();
            read.push((
                *gpu,
                match self.gpu.samples(*gpu, *since, &mut out) {
                    Ok(()) => Ok(out),
                    Err(err) => {
                        metrics::counter!("coloc_nvml_errors_total", "gpu" => gpu.to_string(), "reason" => err.reason()).increment(1);
                        Err(err.to_string())
                    }
                },
            ));
        }
        self.put_off = read.is_empty() && !gpus.is_empty();
        Samples { read, yielded }
    }

    /// Reads every GPU's process list for `why`; which of the processes the controller
    /// knows no longer live; the classification of the listed PIDs it does not know (new,
    /// reused, or classified under an older pod-source generation); and the members of
    /// the cgroups it would hold whole (rules mode).
    pub fn lists(&mut self, gpus: &[u32], why: Refresh, known: &Known) -> Lists {
        let generation = self.classifier.source.generation();
        let mut listed: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::new();
        let mut failed = BTreeMap::new();
        for gpu in gpus {
            match self.gpu.processes(*gpu) {
                Ok(pids) => {
                    for pid in pids {
                        listed.entry(pid).or_default().insert(*gpu);
                    }
                }
                Err(err) => {
                    metrics::counter!("coloc_nvml_errors_total", "gpu" => gpu.to_string(), "reason" => err.reason()).increment(1);
                    failed.insert(*gpu, err.to_string());
                }
            }
        }
        let gone = self.classifier.gone(&known.keys(), &listed);
        let table = known.table();
        let classified = known
            .to_classify(&listed, &gone, generation)
            .into_iter()
            .map(|pid| (pid, self.classifier.classify(pid, generation, table)))
            .collect();
        let members = known
            .cgroups()
            .into_iter()
            .map(|dir| {
                let m = self.classifier.vet(&dir, table);
                (dir, m)
            })
            .collect();
        Lists {
            why,
            listed,
            failed,
            gone,
            generation,
            classified,
            members,
        }
    }

    /// Whether a reading of `bells` is a launch since the previous tick's (the pages are
    /// read every tick; an older one was judged then) of a process the controller does
    /// not hold yet (`known`), on a page not so seen in the last second before `now` (the
    /// tick's time, as the controller counts it): the lists are read for it in the
    /// snapshot unless they were already (a tenant's pages that name processes that never
    /// come cost one read a second each at most).
    pub fn names_unknown(&mut self, bells: &Bells, known: &Known, now: u64) -> bool {
        let since = std::mem::replace(&mut self.judged_until, now);
        let mut unknown = false;
        for r in bells
            .readings
            .iter()
            .filter(|r| r.reading.last_launch_ns >= since)
        {
            // Offline work's pages (their gate fields) are not what a launch of online work
            // rings: their owners are judged by the controller alone (the lists at the next
            // tick).
            let Some(page) = self
                .pages
                .get(&r.page)
                .filter(|p| p.class != coloc_doorbell::CLASS_OFFLINE)
            else {
                continue;
            };
            let recent = self
                .refreshed
                .get(&r.page)
                .is_some_and(|at| now.saturating_sub(*at) < LISTS_PER_PAGE_NS);
            if recent {
                continue;
            }
            // A PID's start time is read at most once a second per page, as the lists are.
            let procfs = &self.classifier.procfs;
            let mut looked = false;
            let mut start_of = |pid: u32| {
                looked = true;
                procfs.read_stat(pid).ok().map(|s| s.start)
            };
            if known.names_unknown(page, r, &mut start_of) {
                unknown = true;
                self.refreshed.insert(r.page, now);
            } else if looked {
                self.refreshed.insert(r.page, now);
            }
        }
        unknown
    }

    /// The gate fields of every offline page (as of the latest change of the page set).
    pub fn gate_fields(&self) -> Vec<(u64, Vec<coloc_doorbell::GateReading>)> {
        self.offline_pages
            .iter()
            .map(|id| {
                let mut out = Vec::new();
                self.bells.read_gate(*id, &mut out);
                (*id, out)
            })
            .collect()
    }

    /// Reads the doorbell pages (see [`BellsRead`]).
    pub fn bells(&mut self, read: BellsRead) -> Bells {
        let BellsRead { force, sweep, gate } = read;
        // Kubernetes: each pod's own directory, made when the pod is first seen (before
        // its containers start, unless the kubelet is quicker: then widened).
        let gen = self.classifier.source.generation();
        if self.pod_dirs_gen != Some(gen) {
            self.pod_dirs_gen = Some(gen);
            if let Some(uids) = self.classifier.source.pod_uids() {
                let n = self.bells.ensure_pod_dirs(&uids);
                if n > 0 {
                    metrics::counter!("coloc_doorbell_pod_dirs_made_total").increment(n as u64);
                }
            }
        }
        if sweep {
            // Kubernetes: the directories of deleted pods (the kubelet leaves host paths).
            let source = &self.classifier.source;
            let removed = self
                .bells
                .sweep_pods(&|uid| source.pod_gone(uid), POD_DIR_IDLE);
            if !removed.is_empty() {
                metrics::counter!("coloc_doorbell_pod_dirs_removed_total")
                    .increment(removed.len() as u64);
            }
        }
        let pages = self.bells.rescan(force).then(|| self.bells.pages());
        if let Some(pages) = &pages {
            self.offline_pages = pages
                .iter()
                .filter(|p| p.class == coloc_doorbell::CLASS_OFFLINE)
                .map(|p| p.id)
                .collect();
            self.pages = pages.iter().map(|p| (p.id, p.clone())).collect();
            let ids: BTreeSet<u64> = pages.iter().map(|p| p.id).collect();
            self.refreshed.retain(|id, _| ids.contains(id));
        }
        let mut readings = Vec::new();
        // Always, pages or not: the read also notes the wake words for the next sleep.
        self.bells.read(&mut readings);
        let gates = if gate { self.gate_fields() } else { Vec::new() };
        Bells {
            pages,
            readings,
            gates,
        }
    }
}
