//! The shell's eyes: the edges the controller's reads go through — NVML's samples and
//! process lists, `/proc` and the pod source for classification, the doorbell pages — each
//! read turned into an observation. Nothing here decides.
//!
//! May touch: NVML, reads `/proc` and `cgroup.procs`, the doorbell directories (through
//! their edge, which also removes the directories of pods that are gone).

use super::classify::Classifier;
use crate::control::io::Obs;
use crate::control::nvml::Refresh;
use crate::control::table::Table;
use crate::edges::doorbell::Doorbells;
use crate::edges::gpu::GpuSampler;
use crate::edges::procfs::ProcKey;
use std::collections::{BTreeMap, BTreeSet};

/// A pod's directory is removed only when nothing changed in it for this long (and the
/// pod source says the pod is gone).
const POD_DIR_IDLE: std::time::Duration = std::time::Duration::from_secs(300);

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
            pod_dirs_gen: None,
            put_off: false,
        }
    }

    /// Each GPU's memory (memory preemption).
    pub fn memory(&mut self, gpus: &[u32]) -> Obs {
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
        Obs::Memory { reads, room }
    }

    /// Reads the samples of `gpus` since their timestamps, in order; stops when a doorbell
    /// has rung: before the first GPU (a launch that woke the loop is decided before any
    /// NVML call, ~2 ms each on an H100), unless the round before was put off so, and
    /// after any GPU (a launch never waits behind more than the call in progress). The
    /// GPUs not read stay due.
    pub fn samples(&mut self, gpus: &[(u32, u64)]) -> Obs {
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
        Obs::Samples { read, yielded }
    }

    /// Reads every GPU's process list, which of `known` no longer live, and the members of
    /// `cgroups` (rules mode; `table`: the classes it knows).
    pub fn lists(
        &mut self,
        gpus: &[u32],
        why: Refresh,
        known: &[(ProcKey, bool)],
        cgroups: Vec<std::path::PathBuf>,
        table: &Table,
    ) -> Obs {
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
        let gone = self.classifier.gone(known, &listed);
        let members = cgroups
            .into_iter()
            .map(|dir| {
                let m = self.classifier.vet(&dir, table);
                (dir, m)
            })
            .collect();
        Obs::Lists {
            why,
            listed,
            failed,
            gone,
            generation,
            members,
        }
    }

    /// Classifies `pids` under `generation`.
    pub fn classify(&mut self, pids: &[u32], generation: u64, table: &Table) -> Obs {
        Obs::Classified(
            pids.iter()
                .map(|pid| (*pid, self.classifier.classify(*pid, generation, table)))
                .collect(),
        )
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

    /// Reads the doorbell pages (see [`crate::control::io::Cmd::ReadBells`]).
    pub fn bells(&mut self, force: bool, sweep: bool, gate: bool) -> Obs {
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
        }
        let mut readings = Vec::new();
        // Always, pages or not: the read also notes the wake words for the next sleep.
        self.bells.read(&mut readings);
        let gates = if gate { self.gate_fields() } else { Vec::new() };
        Obs::Bells {
            pages,
            readings,
            gates,
        }
    }
}
