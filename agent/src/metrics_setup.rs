//! Installs the Prometheus recorder and describes every metric (help text, units).

use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Histogram buckets for every `_seconds` histogram: 100 µs to 1 s.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

/// Installs the global recorder and returns the renderer for `/metrics`.
pub fn install() -> anyhow::Result<PrometheusHandle> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)?
        .install_recorder()?;
    describe();
    Ok(handle)
}

fn describe() {
    describe_histogram!("coloc_detection_latency_seconds", Unit::Seconds,
        "Sample timestamp of the first online activity on a GPU to the agent's decision that the GPU is busy.");
    describe_histogram!(
        "coloc_actuation_latency_seconds",
        Unit::Seconds,
        "Decision that a GPU is busy to every offline process on it confirmed stopped."
    );
    describe_histogram!("coloc_preemption_latency_seconds", Unit::Seconds,
        "Sample timestamp of the first online activity to every offline process confirmed stopped (detection + actuation).");
    describe_histogram!(
        "coloc_release_latency_seconds",
        Unit::Seconds,
        "End of the idle window to every offline process confirmed running again."
    );
    describe_histogram!(
        "coloc_nvml_call_duration_seconds",
        Unit::Seconds,
        "Duration of NVML calls made by the agent, by function."
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
    describe_gauge!(
        "coloc_offline_suspended_processes",
        "Offline processes on the GPU currently suspended."
    );
    describe_counter!(
        "coloc_suspensions_total",
        "Offline processes suspended, by GPU and reason (online_busy, share_cap)."
    );
    describe_counter!("coloc_fail_open_total",
        "Times the agent resumed all offline work because something failed, by reason (nvml, record, actuation, shutdown).");
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
