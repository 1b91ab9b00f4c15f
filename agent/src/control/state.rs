//! The typed `/state` document, and the handle the control loop shares with the HTTP
//! server (health, readiness, the document, the fractional-second counters).

use crate::control::events::Event;
use crate::control::model::act::Kind;
use qos_core::stats::Summary;
use qos_core::Class;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

/// `/state`: what the agent sees and does, per GPU.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StateDoc {
    /// Node name.
    pub node: String,
    /// The preferred actuator (`--actuator`); each process shows the one it gets.
    pub actuator: Option<Kind>,
    /// `--dry-run`.
    pub dry_run: bool,
    /// The idle window, ms.
    pub idle_window_ms: f64,
    /// Some GPU's NVML is failing or a call hung: its offline work was resumed.
    pub degraded: bool,
    /// Why, when degraded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub degraded_reason: Option<String>,
    /// Targets (cgroups, processes) currently held suspended.
    pub suspended_targets: usize,
    /// Offline processes held suspended but found running (see [`ProcDoc::escaping`]).
    #[serde(default)]
    pub escaping_processes: usize,
    /// Offline processes whose launch gate stayed silent (see [`ProcDoc::gate`]).
    #[serde(default)]
    pub gate_silent_processes: usize,
    /// When the document was built, ns since the epoch.
    pub updated_ns: u64,
    /// Per GPU.
    pub gpus: Vec<GpuDoc>,
    /// The latest events, oldest first.
    pub recent_events: Vec<Event>,
    /// Doorbell pages whose launches do not count: NVML did not corroborate them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub distrusted_pages: Vec<DistrustedPage>,
    /// GPU processes of online and offline pods by whether they run with the CUDA shim,
    /// and why not (`control::coverage`).
    #[serde(default)]
    pub shim_coverage: Vec<CoverageRow>,
    /// What co-location earned and cost since the agent started, per namespace and class
    /// (`earned`).
    #[serde(default)]
    pub earned: Vec<crate::earned::EarnedRow>,
    /// Online work's runs (launch to completion, from doorbell pages that stamp
    /// completions), by whether offline work ran when each began (`earned::Runs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub online_runs: Option<crate::earned::RunsDoc>,
}

/// An owner of doorbell pages distrusted on a GPU, in `/state`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DistrustedPage {
    /// `pid:<n>` (standalone) or `pod:<uid>`.
    pub owner: String,
    /// The GPU its launches named.
    pub gpu: u32,
    /// Distrusted since, ns.
    pub since_ns: u64,
}

/// One GPU in `/state`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuDoc {
    /// Index.
    pub index: u32,
    /// UUID.
    pub uuid: String,
    /// `offline_running` or `online_busy`.
    pub state: String,
    /// Busy since (the onset of the online work that made it busy), ns; while busy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<u64>,
    /// Latest online activity, ns; while busy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_online: Option<u64>,
    /// NVML fails for this GPU: it is not managed until it answers again.
    pub degraded: bool,
    /// The window after which this GPU releases, ms: the idle window, or a shorter one
    /// learned (`--release learned`).
    #[serde(default)]
    pub release_window_ms: f64,
    /// GPU processes.
    pub processes: Vec<ProcDoc>,
    /// Time since the latest preemption, ms.
    pub last_preemption_ms_ago: Option<f64>,
    /// Recent preemption latencies, ms.
    pub preemption_ms: Summary,
    /// Recent release latencies, ms.
    pub release_ms: Summary,
    /// Its memory, with memory preemption on (`--memory-reserve`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<crate::control::driver_book::MemorySummary>,
}

/// One GPU process in `/state`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProcDoc {
    /// Host PID.
    pub pid: u32,
    /// Class.
    pub class: Class,
    /// Owner (`namespace/pod`, `rule:NAME`, `-`).
    pub owner: String,
    /// Command line (truncated).
    pub cmd: String,
    /// Currently suspended.
    pub suspended: bool,
    /// The actuator it gets when suspended (offline only).
    pub actuator: Option<Kind>,
    /// Time since its latest activity on this GPU, ms.
    pub last_active_ms_ago: Option<f64>,
    /// Where the CUDA driver has it (`running`, `locked`, `checkpointed`, `failed`), when
    /// the agent has called the driver for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver: Option<String>,
    /// Device memory it holds on the host while checkpointed, bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpointed_bytes: Option<u64>,
    /// Its container's name in its pod, where the pod source knows it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
    /// The CUDA shim (online and offline processes): `page` when its doorbell page is
    /// seen, else why not (`not_injected`, `refused`, `opted_out`, `not_loaded`;
    /// `control::coverage`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shim: Option<String>,
    /// Suspended, but found running at its latest check with nothing it cannot undo
    /// holding it (no freezer, no cell of the agent's own, no driver lock): its work may
    /// run beside online work.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub escaping: bool,
    /// `silent` (offline, with `--gate`): its launch gate did not acknowledge its latest
    /// close within `--gate-timeout` (its shim follows another gate file, or none); it is
    /// stopped without the gate for a minute, then tried again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gate: Option<String>,
}

/// GPU processes of one class by their coverage (`/state`'s `shim_coverage`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CoverageRow {
    /// `online` or `offline`.
    pub class: String,
    /// `page`, or why not.
    pub shim: String,
    /// How many processes.
    pub processes: usize,
}

/// State shared between the control loop, its watchdog and the HTTP server.
#[derive(Debug, Default)]
pub struct Shared {
    /// The loop has completed a tick since start.
    pub ticked: AtomicBool,
    /// Wall time of the latest tick (ns).
    pub last_tick_ns: AtomicU64,
    /// Set to stop the loop (it resumes everything first).
    pub stop: AtomicBool,
    /// Why offline work is not protected right now (NVML failing, a hung call); `None`
    /// when all is well. `/readyz` answers 503 with it.
    pub degraded: Mutex<Option<String>>,
    /// The `/state` document.
    pub state: Mutex<StateDoc>,
    /// Per-GPU time accounting (fractional-second counters, rendered by `/metrics`).
    pub gpu_seconds: Mutex<BTreeMap<u32, GpuSeconds>>,
    /// Each managed GPU's UUID by index, set once at start: `/metrics` labels every
    /// per-GPU series with it (`telemetry::label_gpus`).
    pub gpu_uuids: std::sync::OnceLock<BTreeMap<u32, String>>,
    /// What co-location earned, counted from each published document (`earned`).
    pub earned: Mutex<crate::earned::Book>,
}

/// Fractional-second counters of one GPU.
#[derive(Debug, Default, Clone, Copy)]
pub struct GpuSeconds {
    /// Wall time with at least one offline process suspended.
    pub suspended: f64,
    /// Wall time with offline running while online was idle.
    pub reclaimed: f64,
}

impl Shared {
    /// Why the agent is degraded, if it is.
    pub fn degraded(&self) -> Option<String> {
        self.degraded
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Sets or clears the degraded reason; returns whether it changed.
    pub fn set_degraded(&self, why: Option<String>) -> bool {
        let mut d = self.degraded.lock().unwrap_or_else(|e| e.into_inner());
        let changed = *d != why;
        *d = why;
        changed
    }

    /// Marks a completed tick at `now_ns`.
    pub fn mark_tick(&self, now_ns: u64) {
        self.ticked.store(true, Ordering::Relaxed);
        self.last_tick_ns.store(now_ns, Ordering::Relaxed);
    }

    /// A copy of the `/state` document.
    pub fn state(&self) -> StateDoc {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Prometheus text for the fractional-second counters (the `metrics` crate's counters
    /// are integers).
    pub fn render_seconds(&self) -> String {
        let secs = self.gpu_seconds.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = String::new();
        type Get = fn(&GpuSeconds) -> f64;
        let series: [(&str, &str, Get); 2] = [
            ("coloc_offline_suspended_seconds_total", "Wall time during which at least one offline process on the GPU was suspended.", |s| s.suspended),
            ("coloc_offline_reclaimed_seconds_total", "Wall time during which offline work ran on the GPU while online work was idle (GPU time given back).", |s| s.reclaimed),
        ];
        for (name, help, get) in series {
            out += &format!("# HELP {name} {help}\n# TYPE {name} counter\n");
            for (g, s) in secs.iter() {
                out += &format!("{name}{{gpu=\"{g}\"}} {}\n", get(s));
            }
        }
        out
    }
}
