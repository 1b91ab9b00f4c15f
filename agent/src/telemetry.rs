//! Telemetry: the Prometheus recorder with every metric described, the per-GPU metric
//! handles, and [`Telemetry`], what the shell's renderer (`control::shell::render`) says
//! notes and events into: the per-GPU histograms and history, `/state`'s recent events,
//! the `--event-log` file, the per-owner limit on lines a tenant can cause.

use crate::control::coverage::{REASONS, WITH_SHIM};
use crate::control::events::Event;
use crate::control::state::StateDoc;
use crate::edges::actuator::Kind;
use crate::logbudget::{LogBudget, Verdict};
use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::collections::{BTreeMap, VecDeque};
use std::io::Write;
use std::time::Instant;
use tracing::error;

/// Histogram buckets for every `_seconds` histogram: 100 µs to 1 s.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

/// Buckets of `coloc_release_harvest_seconds`: 1 ms to 30 s of offline running between
/// a release and the next preemption.
pub const HARVEST_BUCKETS: &[f64] = &[
    0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Buckets of `coloc_driver_call_seconds`: a lock takes a fraction of a millisecond, a
/// checkpoint of a whole GPU's memory tens of seconds (about 0.6 s per GB on an H100).
pub const DRIVER_BUCKETS: &[f64] = &[
    0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Every bounded reason of `coloc_fail_open_total`, present at 0 from the start.
pub const FAIL_OPEN_REASONS: &[&str] = &["nvml", "nvml_hung", "record", "actuation", "panic"];

/// Every bounded (actuator, reasons) of `coloc_actuation_errors_total`, present at 0 from
/// the start for both ops.
pub const ACTUATION_ERRORS: &[(&str, &[&str])] = &[
    ("freezer", &["cgroup_write", "signal", "timeout"]),
    ("signal", &["signal", "timeout"]),
    ("gate", &["no_gate", "timeout"]),
    ("lock", &["driver", "timeout"]),
];

/// Installs the global recorder and returns the renderer for `/metrics`.
pub fn install() -> anyhow::Result<PrometheusHandle> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("coloc_release_harvest_seconds".into()),
            HARVEST_BUCKETS,
        )?
        .set_buckets_for_metric(
            Matcher::Full("coloc_driver_call_seconds".into()),
            DRIVER_BUCKETS,
        )?
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)?
        .install_recorder()?;
    describe();
    metrics::counter!("coloc_gate_escalations_total").increment(0);
    // Breaks per node and actuator (a panel and a recording rule read them): at 0 from
    // the start, so that `increase()` sees the first one.
    for kind in [Kind::Freezer, Kind::Signal, Kind::Gate, Kind::Lock] {
        metrics::counter!("coloc_suspension_breaks_total", "actuator" => kind.as_str())
            .increment(0);
    }
    for reason in FAIL_OPEN_REASONS {
        metrics::counter!("coloc_fail_open_total", "reason" => *reason).increment(0);
    }
    // So is every actuation error an alert waits for (`increase()` needs an earlier sample).
    for (actuator, reasons) in ACTUATION_ERRORS {
        for op in ["suspend", "resume"] {
            for reason in *reasons {
                metrics::counter!("coloc_actuation_errors_total", "actuator" => *actuator, "op" => op, "reason" => *reason).increment(0);
            }
        }
    }
    // The driver's failures an alert waits for, at 0 from the start.
    for op in ["lock", "checkpoint", "restore", "unlock"] {
        for reason in [
            "not_supported",
            "illegal_state",
            "timeout",
            "operating_system",
            "out_of_memory",
        ] {
            metrics::counter!("coloc_driver_call_failures_total", "op" => op, "reason" => reason)
                .increment(0);
        }
    }
    Ok(handle)
}

fn describe() {
    describe_histogram!(
        "coloc_driver_call_seconds",
        Unit::Seconds,
        "Calls to the CUDA driver's checkpoint API that succeeded, by op (lock, checkpoint, restore, unlock, state): from the call to its return."
    );
    describe_counter!(
        "coloc_driver_call_failures_total",
        "Calls to the CUDA driver's checkpoint API that failed, by op and reason (not_supported, illegal_state, timeout, out_of_memory, gone, ...; op=load reason=no_api: the driver has no checkpoint API). A refused lock or checkpoint leaves the process to the other holds."
    );
    describe_counter!(
        "coloc_checkpoint_bytes_total",
        "Device memory moved by the driver: op=checkpoint to the host (given to online work), op=restore back to the GPU."
    );
    describe_gauge!(
        "coloc_checkpointed_processes",
        "Offline processes whose GPU memory is checkpointed to the host, per GPU."
    );
    describe_gauge!(
        "coloc_checkpointed_bytes",
        "GPU memory given back by checkpointed offline processes, per GPU, bytes."
    );
    describe_gauge!(
        "coloc_gpu_memory_free_bytes",
        "Free GPU memory at the latest read (memory preemption on), bytes."
    );
    describe_gauge!(
        "coloc_gpu_memory_reserve_bytes",
        "The free memory memory preemption keeps while online work is present (--memory-reserve), bytes."
    );
    describe_gauge!(
        "coloc_memory_pressure",
        "1 while online work is present on the GPU and its free memory is under the reserve."
    );
    describe_gauge!(
        "coloc_driver_locked_processes",
        "Offline processes the CUDA driver holds locked or checkpointed for the agent."
    );
    describe_counter!(
        "coloc_gate_escalations_total",
        "Launch gates not acknowledged within --gate-timeout (or that could not close): the process was stopped without waiting for its drain."
    );
    describe_counter!(
        "coloc_pod_watch_errors_total",
        "Errors of the Kubernetes pod watch (the last known pods stay in use; retried with backoff)."
    );
    describe_counter!(
        "coloc_pod_class_change_refused_total",
        "Pods seen offline whose qos_level later asked for online: refused, they stay offline."
    );
    describe_counter!(
        "coloc_unknown_qos_level_total",
        "Pods whose qos_level annotation has an unknown value (treated as online)."
    );
    describe_counter!(
        "coloc_process_list_refreshes_total",
        "Reads of the GPU process lists, by why (interval; unknown_pid: a sample of a process not yet known; pod_source: classification may have changed)."
    );
    describe_counter!(
        "coloc_suspension_breaks_total",
        "Held offline work found running (resumed by something else, e.g. a SIGCONT from inside the pod) and stopped again, by actuator."
    );
    describe_counter!(
        "coloc_suspension_retries_total",
        "Failed (undone) suspensions tried again while online work stayed busy."
    );
    describe_gauge!(
        "coloc_doorbell_pages",
        "Doorbell pages of the CUDA shim mapped by the agent (one per process that loaded libcoloc_cuda.so as online)."
    );
    describe_counter!(
        "coloc_doorbell_rejected_total",
        "Doorbell pages whose launches count for nothing, by reason (unknown_gpu, unknown_owner, not_online, uid_mismatch, not_on_gpu; uncorroborated: it kept its GPU busy for --doorbell-trust-window while NVML never showed its owner at work; invalidated: a mapped page that stopped being valid, e.g. its file was truncated); counted once per page and reason."
    );
    describe_gauge!(
        "coloc_doorbell_distrusted_pages",
        "Doorbell pages whose launches do not count now because NVML never corroborated them (see coloc_doorbell_rejected_total{reason=\"uncorroborated\"})."
    );
    describe_gauge!(
        "coloc_escaping_processes",
        "Offline processes held suspended that were found running at their latest check with nothing they cannot undo holding them (no freezer, no cell of the agent's own, no driver lock): their work may run beside online work. Nonzero only where a cell cannot be made (see the agent's log and /state `escaping`)."
    );
    describe_gauge!(
        "coloc_gate_silent_processes",
        "Offline processes with the CUDA shim whose launch gate did not acknowledge its latest close within --gate-timeout (the shim follows another gate file, e.g. a COLOC_GATE_FILE set by the tenant, or found none): each preemption of them waited the whole timeout, so they are stopped at once without the gate for a minute, then the gate is tried again."
    );
    describe_counter!(
        "coloc_doorbell_pod_dirs_made_total",
        "Pods' doorbell directories (pods/<uid>, mode 1777) the agent made from its pod watch, or widened when the kubelet had made them first."
    );
    describe_counter!(
        "coloc_doorbell_pod_dirs_removed_total",
        "Doorbell directories of pods that are gone (deleted from the API server, nothing changed in them for 5 minutes) removed by the agent."
    );
    describe_counter!(
        "coloc_nvml_rounds_yielded_total",
        "Rounds of NVML reads interrupted by a doorbell: sample reads stopped after the GPU in progress, or process lists put off (the loop decided first and read the rest at the next tick)."
    );
    describe_counter!(
        "coloc_doorbell_wakeups_total",
        "Times the control loop was woken early by a doorbell (a run of launches started) or by a page appearing."
    );
    describe_histogram!("coloc_detection_latency_seconds", Unit::Seconds,
        "Onset of online work on a GPU (a launch seen by the doorbell, or the start of an NVML sampled period) to the agent's decision that the GPU is busy, by the signal that detected it.");
    describe_histogram!("coloc_actuation_latency_seconds", Unit::Seconds,
        "Decision that a GPU is busy to every offline process on it confirmed stopped, by the actuator that acted.");
    describe_histogram!("coloc_preemption_latency_seconds", Unit::Seconds,
        "Onset of online work to every offline process confirmed stopped (detection + actuation), by the actuator that acted and the signal that detected it.");
    describe_histogram!("coloc_release_latency_seconds", Unit::Seconds,
        "End of the idle window to every offline process confirmed running again, by the actuator that acted.");
    describe_counter!(
        "coloc_releases_total",
        "Offline work released on a GPU, by rule: fixed (after --idle-window), learned (--release learned: a shorter window learned from the online processes' own gaps) or at_once (--release at-once: as soon as online's work was seen complete)."
    );
    describe_histogram!("coloc_release_harvest_seconds", Unit::Seconds,
        "How long offline work ran between a release and the next preemption on that GPU, by the release's rule (the sum: offline time harvested).");
    describe_counter!(
        "coloc_releases_wrong_total",
        "Learned releases after which online work came back before offline had run --release-ratio x --release-drain: releases that did not pay."
    );
    describe_histogram!(
        "coloc_nvml_call_duration_seconds",
        Unit::Seconds,
        "Duration of NVML calls made by the agent, by function."
    );
    describe_histogram!(
        "coloc_online_run_seconds",
        Unit::Seconds,
        "Runs of online work timed from doorbell pages that stamp completions: a run's first launch (after a gap of the page's wake gap) to the moment its process saw all its work on the GPU complete, by GPU and by whether offline work ran there when the run began (offline=running or stopped). The difference is what offline work added."
    );
    describe_histogram!(
        "coloc_loop_lag_seconds",
        Unit::Seconds,
        "How late each control-loop tick started relative to the poll interval."
    );
    describe_gauge!(
        "coloc_gpu_online_busy",
        "1 while online work on the GPU is busy (offline suspended), else 0."
    );
    describe_gauge!("coloc_gpu_degraded", "1 while NVML fails persistently for the GPU (its offline work resumed, the GPU unmanaged), else 0.");
    describe_gauge!(
        "coloc_offline_suspended_processes",
        "Offline processes on the GPU currently suspended."
    );
    describe_gauge!("coloc_shim_coverage_processes", "GPU processes of online and offline pods on this node by the CUDA shim: shim=page when its doorbell page is seen, else why not (not_injected: the webhook did not see the pod; refused: it left a container out; opted_out: the pod asked; not_loaded: injected, no page).");
    describe_gauge!("coloc_invisible_gpu_processes", "GPU processes the driver has listed for over 1 s that are not visible in /proc (agent outside the host PID namespace?).");
    describe_counter!(
        "coloc_suspensions_total",
        "Offline processes suspended, by GPU and reason (online_busy, share_cap)."
    );
    describe_counter!("coloc_fail_open_total",
        "Times the agent resumed offline work because something failed, by reason (nvml: a GPU's NVML failing persistently; nvml_hung: an NVML call that did not return; record: the suspension record could not be written; actuation: a suspension failed or was not confirmed; panic).");
    describe_counter!("coloc_nvml_transient_answers_total", "Transient NVML answers (INSUFFICIENT_SIZE between the count and data calls) retried at once, by function.");
    describe_counter!(
        "coloc_nvml_errors_total",
        "Failed NVML calls that reached the control loop, by GPU and reason."
    );
    describe_counter!(
        "coloc_actuation_errors_total",
        "Failed suspend/resume operations, by actuator, operation and reason."
    );
    describe_counter!(
        "coloc_unmanaged_processes_total",
        "GPU processes seen that belong to no known pod or rule."
    );
    describe_gauge!(
        "coloc_agent_info",
        "Static information about the agent (always 1)."
    );
}

/// Every signal, for label values present from the start.
const SIGNALS: [qos_core::Signal; 2] = [qos_core::Signal::Doorbell, qos_core::Signal::Nvml];

/// Metric handles of one GPU.
#[derive(Debug)]
pub struct GpuMetrics {
    busy: (metrics::Gauge, std::cell::Cell<f64>),
    degraded: (metrics::Gauge, std::cell::Cell<f64>),
    suspended: (metrics::Gauge, std::cell::Cell<f64>),
    detection: BTreeMap<&'static str, metrics::Histogram>,
    actuation: BTreeMap<&'static str, metrics::Histogram>,
    preemption: BTreeMap<(&'static str, &'static str), metrics::Histogram>,
    release: BTreeMap<&'static str, metrics::Histogram>,
}

impl GpuMetrics {
    fn new(gpu: u32) -> GpuMetrics {
        let g = gpu.to_string();
        let per_actuator = |name: &'static str| {
            [Kind::Freezer, Kind::Signal, Kind::Gate, Kind::Lock]
                .iter()
                .map(|k| {
                    (
                        k.as_str(),
                        metrics::histogram!(name, "gpu" => g.clone(), "actuator" => k.as_str()),
                    )
                })
                .collect()
        };
        GpuMetrics {
            busy: gauge(metrics::gauge!("coloc_gpu_online_busy", "gpu" => g.clone())),
            degraded: gauge(metrics::gauge!("coloc_gpu_degraded", "gpu" => g.clone())),
            suspended: gauge(
                metrics::gauge!("coloc_offline_suspended_processes", "gpu" => g.clone()),
            ),
            detection: SIGNALS
                .iter()
                .map(|s| {
                    let h = metrics::histogram!("coloc_detection_latency_seconds", "gpu" => g.clone(), "signal" => s.as_str());
                    (s.as_str(), h)
                })
                .collect(),
            actuation: per_actuator("coloc_actuation_latency_seconds"),
            preemption: [Kind::Freezer, Kind::Signal, Kind::Gate, Kind::Lock]
                .iter()
                .flat_map(|k| SIGNALS.iter().map(move |s| (*k, *s)))
                .map(|(k, s)| {
                    let h = metrics::histogram!("coloc_preemption_latency_seconds", "gpu" => g.clone(), "actuator" => k.as_str(), "signal" => s.as_str());
                    ((k.as_str(), s.as_str()), h)
                })
                .collect(),
            release: per_actuator("coloc_release_latency_seconds"),
        }
    }
}

fn gauge(g: metrics::Gauge) -> (metrics::Gauge, std::cell::Cell<f64>) {
    g.set(0.0);
    (g, std::cell::Cell::new(0.0))
}

/// Sets a gauge only when its value changes (the loop sets them every tick).
fn set(g: &(metrics::Gauge, std::cell::Cell<f64>), v: f64) {
    if g.1.get() != v {
        g.1.set(v);
        g.0.set(v);
    }
}

impl GpuMetrics {
    /// `coloc_gpu_online_busy`.
    pub fn set_busy(&self, busy: bool) {
        set(&self.busy, if busy { 1.0 } else { 0.0 });
    }
    /// `coloc_gpu_degraded`.
    pub fn set_degraded(&self, degraded: bool) {
        set(&self.degraded, if degraded { 1.0 } else { 0.0 });
    }
    /// `coloc_offline_suspended_processes`.
    pub fn set_suspended(&self, n: usize) {
        set(&self.suspended, n as f64);
    }
    /// `coloc_actuation_latency_seconds` and `coloc_preemption_latency_seconds` of a
    /// preemption confirmed by `kind`, its onset given by `signal`.
    pub fn preempted(
        &self,
        kind: Kind,
        signal: qos_core::Signal,
        actuation_s: f64,
        preemption_s: f64,
    ) {
        self.actuation[kind.as_str()].record(actuation_s);
        self.preemption[&(kind.as_str(), signal.as_str())].record(preemption_s);
    }
    /// `coloc_release_latency_seconds` of a release confirmed by `kind`.
    pub fn released(&self, kind: Kind, release_s: f64) {
        self.release[kind.as_str()].record(release_s);
    }
}

/// Recent latencies of one GPU, for `/state` and `coloc-agent status`.
#[derive(Debug, Default)]
pub struct GpuHistory {
    /// Latest preemption decision, ns.
    pub last_preempt_ns: Option<u64>,
    /// Recent preemption latencies, ms.
    pub preemption_ms: VecDeque<f64>,
    /// Recent release latencies, ms.
    pub release_ms: VecDeque<f64>,
}

/// How many latencies each GPU's history keeps.
pub const HISTORY: usize = 1024;
/// How many events `/state` keeps.
pub const RECENT: usize = 512;

/// Metrics, event log and history.
#[derive(Debug)]
pub struct Telemetry {
    /// Per-GPU handles.
    pub gpus: BTreeMap<u32, GpuMetrics>,
    /// Per-GPU history.
    pub history: BTreeMap<u32, GpuHistory>,
    /// The latest events.
    pub recent: VecDeque<Event>,
    /// `coloc_loop_lag_seconds`.
    pub lag: metrics::Histogram,
    event_log: Option<std::fs::File>,
    /// Lines tenants caused, limited per owner.
    lines: LogBudget,
}

/// Pushes `v` onto `q`, dropping its oldest beyond `cap`.
pub fn push_bounded<T>(q: &mut VecDeque<T>, v: T, cap: usize) {
    if q.len() == cap {
        q.pop_front();
    }
    q.push_back(v);
}

impl Telemetry {
    /// Handles for `gpus`, appending events to `event_log` if given.
    pub fn new(gpus: &[u32], event_log: Option<std::fs::File>) -> Telemetry {
        Telemetry {
            gpus: gpus.iter().map(|g| (*g, GpuMetrics::new(*g))).collect(),
            history: BTreeMap::new(),
            recent: VecDeque::new(),
            lag: metrics::histogram!("coloc_loop_lag_seconds"),
            event_log,
            lines: LogBudget::default(),
        }
    }

    /// Records the detection latency of a preemption decided now.
    pub fn detected(&self, gpu: u32, signal: qos_core::Signal, detection_s: f64) {
        if let Some(h) = self
            .gpus
            .get(&gpu)
            .and_then(|m| m.detection.get(signal.as_str()))
        {
            h.record(detection_s);
        }
    }

    /// Appends `ev`'s JSON line to `--event-log`, when given.
    pub fn append_to_event_log(&mut self, ev: &Event) {
        if let Some(f) = &mut self.event_log {
            // One write per event (serde_json writes token by token into an unbuffered
            // file: about a hundred system calls an event).
            let line = serde_json::to_vec(ev).map(|mut l| {
                l.push(b'\n');
                l
            });
            if let Err(err) = line
                .map_err(std::io::Error::from)
                .and_then(|l| f.write_all(&l))
            {
                error!(%err, "Cannot append to the event log");
            }
        }
    }

    /// Keeps `ev` among `/state`'s recent events.
    pub fn keep(&mut self, ev: Event) {
        push_bounded(&mut self.recent, ev, RECENT);
    }

    /// Whether a line its tenant can cause at will (what it is about, whose it is) may be
    /// said now ([`crate::logbudget`]): false when it is held back. Says the summary of
    /// the owner's lines held back in the second that ended.
    pub fn tenant_line(&mut self, kind: &'static str, owner: &str) -> bool {
        let mut held = Vec::new();
        let verdict = self.lines.allow(kind, owner, Instant::now(), &mut held);
        crate::logbudget::say(&held);
        verdict == Verdict::Say
    }

    /// Says the summaries of tenant lines held back in the seconds that ended by `now`.
    pub fn flush_tenant_lines(&mut self, now: Instant) {
        crate::logbudget::say(&self.lines.flush(now));
    }

    /// Sets `coloc_shim_coverage_processes{class, shim}` from `doc`: every class and
    /// coverage, 0 where no process has it (so a panel and an alert see the series).
    pub fn export_coverage(&self, doc: &StateDoc) {
        for class in ["online", "offline"] {
            for shim in std::iter::once(WITH_SHIM).chain(REASONS) {
                let n = doc
                    .shim_coverage
                    .iter()
                    .find(|r| r.class == class && r.shim == shim)
                    .map_or(0, |r| r.processes);
                metrics::gauge!("coloc_shim_coverage_processes", "class" => class, "shim" => shim)
                    .set(n as f64);
            }
        }
    }
}

/// The label the GPU's UUID takes on every per-GPU series: `UUID`, as the DCGM exporter
/// names it (its `gpu` label is the NVML index, as ours), so that any series of the agent
/// joins DCGM's (`* on (UUID) group_left …`).
pub const UUID_LABEL: &str = "UUID";

/// Escapes a Prometheus label value (backslash, double quote, newline).
fn escape(v: &str, out: &mut String) {
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

/// Copies the Prometheus text `text` into `out`, with `UUID="<uuid>"` added after the
/// `gpu="<index>"` label of every sample whose index `uuids` knows: every per-GPU series
/// of the agent, whichever code records it, carries the GPU's identity. Samples of no GPU
/// (`gpu="-"`, or no `gpu` label) and comment lines are copied as they are.
pub fn label_gpus(text: &str, uuids: &BTreeMap<u32, String>, out: &mut String) {
    out.reserve(text.len() + text.len() / 4);
    for line in text.split_inclusive('\n') {
        if !line.starts_with('#') {
            if let Some(at) = gpu_label_end(line, uuids) {
                let (head, tail) = line.split_at(at.0);
                out.push_str(head);
                out.push(',');
                out.push_str(UUID_LABEL);
                out.push_str("=\"");
                escape(at.1, out);
                out.push('"');
                out.push_str(tail);
                continue;
            }
        }
        out.push_str(line);
    }
}

/// Where the `gpu` label's value of a sample line ends, and that GPU's UUID.
fn gpu_label_end<'a>(line: &str, uuids: &'a BTreeMap<u32, String>) -> Option<(usize, &'a str)> {
    let open = line.find('{')?;
    let labels = &line[open..open + line[open..].find('}')?];
    if labels.contains("{UUID=\"") || labels.contains(",UUID=\"") {
        return None;
    }
    // `{gpu="` or `,gpu="`: the label named gpu, not one whose name ends in it.
    let start = labels.find("{gpu=\"").or_else(|| labels.find(",gpu=\""))? + "{gpu=\"".len();
    let len = labels[start..].find('"')?;
    let uuid = uuids.get(&labels[start..start + len].parse::<u32>().ok()?)?;
    Some((open + start + len + 1, uuid.as_str()))
}

/// The per-process info series.
pub const PROCESS_INFO: &str = "coloc_process_info";

/// Help text of `coloc_process_info`.
pub const PROCESS_INFO_HELP: &str = "One series per GPU process of a pod or rule on each GPU it uses (always 1): namespace and pod (a standalone rule or an unknown pod: namespace empty, pod as /state's owner: rule:NAME, pod-uid:UID, -), container (its name in the pod; empty where unknown), class, gpu (NVML index) and UUID (the GPU's, as DCGM names it), actuator (what holds it while online is busy, offline only, as /state's actuator: freezer, signal, lock; under --gate a process whose page is seen is drained at its launch gate first), shim (page: its doorbell page is seen; else why not: not_injected, refused, opted_out, not_loaded; empty for system and unmanaged processes). Join on UUID to DCGM's series, on namespace and pod to kube-state-metrics'.";

/// Renders `coloc_process_info` from the `/state` document into `out`: one series per
/// (process's labels, GPU); two processes of one container on one GPU give one series.
pub fn render_process_info(doc: &crate::control::state::StateDoc, out: &mut String) {
    let mut series = std::collections::BTreeSet::new();
    for g in &doc.gpus {
        for p in &g.processes {
            let (namespace, pod) = match p.owner.split_once('/') {
                Some((ns, pod)) if !p.owner.contains(':') => (ns, pod),
                _ => ("", p.owner.as_str()),
            };
            let mut s = String::with_capacity(160);
            s.push_str(PROCESS_INFO);
            s.push_str("{namespace=\"");
            escape(namespace, &mut s);
            s.push_str("\",pod=\"");
            escape(pod, &mut s);
            s.push_str("\",container=\"");
            escape(p.container.as_deref().unwrap_or(""), &mut s);
            s.push_str("\",class=\"");
            s.push_str(p.class.as_str());
            s.push_str("\",gpu=\"");
            s.push_str(&g.index.to_string());
            s.push_str("\",UUID=\"");
            escape(&g.uuid, &mut s);
            s.push_str("\",actuator=\"");
            s.push_str(p.actuator.map(Kind::as_str).unwrap_or(""));
            s.push_str("\",shim=\"");
            escape(p.shim.as_deref().unwrap_or(""), &mut s);
            s.push_str("\"} 1\n");
            series.insert(s);
        }
    }
    out.push_str(&format!(
        "# HELP {PROCESS_INFO} {PROCESS_INFO_HELP}\n# TYPE {PROCESS_INFO} gauge\n"
    ));
    for s in series {
        out.push_str(&s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::state::{GpuDoc, ProcDoc, StateDoc};
    use qos_core::Class;

    fn uuids() -> BTreeMap<u32, String> {
        [(0, "GPU-aaaa".to_string()), (1, "GPU-bbbb".to_string())].into()
    }

    #[test]
    fn every_series_of_a_known_gpu_gets_its_uuid() {
        let text = "# HELP coloc_gpu_online_busy x\n# TYPE coloc_gpu_online_busy gauge\n\
            coloc_gpu_online_busy{gpu=\"0\"} 1\n\
            coloc_preemption_latency_seconds_bucket{gpu=\"1\",actuator=\"gate\",signal=\"nvml\",le=\"0.1\"} 3\n\
            coloc_suspensions_total{gpu=\"-\",reason=\"share_cap\"} 2\n\
            coloc_suspensions_total{reason=\"online_busy\",gpu=\"0\"} 5\n\
            coloc_nvml_errors_total{gpu=\"7\",reason=\"timeout\"} 1\n\
            coloc_loop_lag_seconds_sum 0.5\n\
            coloc_x{notgpu=\"0\"} 1\n";
        let mut out = String::new();
        label_gpus(text, &uuids(), &mut out);
        let want = "# HELP coloc_gpu_online_busy x\n# TYPE coloc_gpu_online_busy gauge\n\
            coloc_gpu_online_busy{gpu=\"0\",UUID=\"GPU-aaaa\"} 1\n\
            coloc_preemption_latency_seconds_bucket{gpu=\"1\",UUID=\"GPU-bbbb\",actuator=\"gate\",signal=\"nvml\",le=\"0.1\"} 3\n\
            coloc_suspensions_total{gpu=\"-\",reason=\"share_cap\"} 2\n\
            coloc_suspensions_total{reason=\"online_busy\",gpu=\"0\",UUID=\"GPU-aaaa\"} 5\n\
            coloc_nvml_errors_total{gpu=\"7\",reason=\"timeout\"} 1\n\
            coloc_loop_lag_seconds_sum 0.5\n\
            coloc_x{notgpu=\"0\"} 1\n";
        assert_eq!(out, want);
        // Labelled once, however often it passes.
        let mut again = String::new();
        label_gpus(&out, &uuids(), &mut again);
        assert_eq!(again, want);
    }

    fn proc(
        pid: u32,
        class: Class,
        owner: &str,
        actuator: Option<Kind>,
        shim: Option<&str>,
    ) -> ProcDoc {
        ProcDoc {
            pid,
            class,
            owner: owner.into(),
            cmd: String::new(),
            suspended: false,
            actuator,
            last_active_ms_ago: None,
            driver: None,
            checkpointed_bytes: None,
            container: Some("main".into()),
            escaping: false,
            gate: None,
            shim: shim.map(str::to_string),
        }
    }

    #[test]
    fn process_info_names_pod_gpu_actuator_and_shim() {
        let doc = StateDoc {
            gpus: vec![
                GpuDoc {
                    index: 0,
                    uuid: "GPU-aaaa".into(),
                    processes: vec![
                        proc(10, Class::Online, "serving/web-0", None, Some("page")),
                        proc(
                            11,
                            Class::Offline,
                            "batch/train-1",
                            Some(Kind::Gate),
                            Some("not_loaded"),
                        ),
                        // A second process of the same container: one series.
                        proc(
                            12,
                            Class::Offline,
                            "batch/train-1",
                            Some(Kind::Gate),
                            Some("not_loaded"),
                        ),
                        proc(13, Class::Offline, "rule:nightly", Some(Kind::Signal), None),
                    ],
                    ..GpuDoc::default()
                },
                GpuDoc {
                    index: 1,
                    uuid: "GPU-bb\"bb".into(),
                    processes: vec![proc(
                        11,
                        Class::Offline,
                        "batch/train-1",
                        Some(Kind::Gate),
                        Some("not_loaded"),
                    )],
                    ..GpuDoc::default()
                },
            ],
            ..StateDoc::default()
        };
        let mut out = String::new();
        render_process_info(&doc, &mut out);
        let series: Vec<&str> = out.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(
            series,
            [
                r#"coloc_process_info{namespace="",pod="rule:nightly",container="main",class="offline",gpu="0",UUID="GPU-aaaa",actuator="signal",shim=""} 1"#,
                r#"coloc_process_info{namespace="batch",pod="train-1",container="main",class="offline",gpu="0",UUID="GPU-aaaa",actuator="gate",shim="not_loaded"} 1"#,
                r#"coloc_process_info{namespace="batch",pod="train-1",container="main",class="offline",gpu="1",UUID="GPU-bb\"bb",actuator="gate",shim="not_loaded"} 1"#,
                r#"coloc_process_info{namespace="serving",pod="web-0",container="main",class="online",gpu="0",UUID="GPU-aaaa",actuator="",shim="page"} 1"#,
            ]
        );
        assert!(out.starts_with("# HELP coloc_process_info "));
        // Already labelled with its UUID: label_gpus leaves it alone.
        let mut again = String::new();
        label_gpus(&out, &uuids(), &mut again);
        assert_eq!(again, out);
    }
}
