#!/usr/bin/env python3
"""Writes the Grafana dashboard (deploy/grafana/gpu-coloc.json) and the chart's copies of
the dashboard and the alert rules. Edit this file, not the JSON; rerun it after changes
(deploy/scripts/check-deploy.py fails when the copies differ)."""
import json, os, shutil

HERE = os.path.dirname(os.path.abspath(__file__))
CHART = os.path.join(HERE, "..", "helm", "gpu-coloc")
# `node` is the agent's node: the chart's ServiceMonitor sets it from the pod's node name.
SEL = 'cluster=~"$cluster", node=~"$node"'
GPU = SEL + ', gpu=~"$gpu"'
R = "$__rate_interval"


def q(expr, legend):
    return {"expr": expr, "legendFormat": legend}


def table(expr, value=True):
    """An instant query shown as a table (one row per series, a column per label; the
    value's column too unless `value` is false)."""
    return {"expr": expr, "legendFormat": "", "format": "table", "instant": True, "value": value}


def quantile(metric, p, extra=""):
    return f'histogram_quantile({p}, sum by (le{extra}) (rate({metric}_bucket{{{GPU}}}[{R}])))'


PANELS = [
    # (title, unit, width, height, targets, description); a title starting with "Table: "
    # is a table of instant queries.
    # On call: where it is slow, which hold, which pods, what failed. The recording rules
    # (deploy/prometheus/rules.yaml, gpu_coloc:… and gpu_coloc_node:…) are the alerts' own
    # figures; `> 0` leaves out GPUs and holds without preemptions in the last 5 minutes.
    ("Worst GPUs: preemption latency p99, top 5", "s", 12, 8, [
        q(f'topk(5, gpu_coloc:preemption_latency_seconds:p99_5m{{{GPU}}} > 0)', "{{node}} GPU {{gpu}} {{signal}} {{UUID}}"),
    ], "The five GPUs with the slowest preemptions (p99 over 5 minutes, onset → offline confirmed stopped), by the signal that saw the onset: what GpuColocPreemptionSlow (doorbell, above 50 ms) and GpuColocPreemptionSlowNvml (NVML, above 500 ms) judge. UUID joins DCGM's series for that GPU (DCGM_FI_DEV_GPU_UTIL{UUID=\"…\"}, XID errors)."),
    ("Worst nodes: preemption latency p99, top 5", "s", 12, 8, [
        q(f'topk(5, gpu_coloc_node:preemption_latency_seconds:p99_5m{{{SEL}}} > 0)', "{{node}} {{signal}}"),
    ], "The five nodes with the slowest preemptions (p99 over 5 minutes, all their GPUs), by signal: one slow node shows here though the cluster's quantile hides it."),
    ("Preemption latency p99 by actuator and signal", "s", 12, 8, [
        q(f'histogram_quantile(0.99, sum by (actuator, signal, le) (gpu_coloc:preemption_latency_seconds_bucket:rate5m{{{GPU}}})) > 0', "p99 {{actuator}} {{signal}}"),
    ], "Which hold is slow: gate (the shim's launch gate, a drain of in-flight kernels), freezer, signal (SIGSTOP), lock (the CUDA driver's lock); doorbell: onset at the launch, nvml: at the start of the sampled period."),
    ("Fail-opens and breaks by node", "short", 12, 8, [
        q(f'gpu_coloc_node:fail_open:increase10m{{{SEL}}}', "{{node}} fail-open {{reason}}"),
        q(f'gpu_coloc_node:suspension_breaks:increase10m{{{SEL}}}', "{{node}} breaks {{actuator}}"),
    ], "Per node over 10 minutes: fail-opens (the agent resumed all offline work: nvml, nvml_hung, record, actuation, panic) and breaks (held offline work found running, e.g. a SIGCONT from inside its pod, and stopped again), by actuator. A node with steady breaks has a tenant undoing its holds."),
    ("GPU processes without the CUDA shim, by node and reason", "short", 24, 7, [
        q(f'sum by (node, class, shim) (gpu_coloc_node:shim_coverage_processes:sum{{{SEL}, shim!="page"}})', "{{node}} {{class}} {{shim}}"),
    ], "Processes of online and offline pods whose doorbell page is not seen, by why: their onset is seen through NVML only, a sample period late (online), or they are held by the fallback instead of the gate (offline). The table below names the pods."),
    ("Table: Pods on each GPU (class, hold, shim)", "short", 24, 8, [
        table(f'max by (node, namespace, pod, container, class, gpu, UUID, actuator, shim) (coloc_process_info{{{GPU}}})', value=False),
    ], "One row per container on each GPU (coloc_process_info): its class, the actuator that holds it while online is busy (offline), and whether its CUDA shim's page is seen (page) or why not (not_injected, refused, opted_out, not_loaded). UUID joins DCGM's series (DCGM_FI_DEV_FB_USED, DCGM_FI_DEV_XID_ERRORS) for that GPU."),
    # What co-location earned (agent/src/earned.rs defines each counter): GPU time online
    # pods' GPUs gave to offline work, per namespace, and what it cost online work.
    ("What co-location earned: GPUs given to offline work, per namespace", "short", 12, 8, [
        q(f'sum by (namespace) (rate(coloc_offline_harvested_seconds_total{{{SEL}}}[{R}]))', "{{namespace}} ran beside online"),
        q(f'sum by (namespace) (rate(coloc_offline_held_seconds_total{{{SEL}}}[{R}]))', "{{namespace}} held"),
    ], "GPU-seconds per second (GPUs' worth) that offline work of each namespace ran on GPUs where online pods have a context (harvested: what co-location gave), and was held while online work was busy. Summed over GPUs: 2 means two GPUs' worth."),
    ("Its cost to online work, per namespace", "percentunit", 12, 8, [
        q(f'sum by (namespace) (rate(coloc_online_waited_seconds_total{{{SEL}}}[{R}]))', "{{namespace}} waited for offline to stop"),
        q(f'sum by (namespace) (rate(coloc_online_beside_offline_seconds_total{{{SEL}}}[{R}]))', "{{namespace}} shared its GPUs with running offline"),
    ], "As shares of wall time (summed over GPUs): how long online work of each namespace, once started, waited for offline work to get out of the way (the preemption latencies on its GPUs, onset → offline confirmed stopped; with NVML alone the onset is the start of the sampled period, so a sample period is part of it), and how long it shared its GPUs with offline work that ran. The runs panel beside gives the per-request view."),
    ("Online runs with offline running and stopped (doorbell), p50/p99", "s", 12, 8, [
        q(f'histogram_quantile(0.5, sum by (offline, le) (rate(coloc_online_run_seconds_bucket{{{GPU}}}[{R}])))', "p50 offline {{offline}}"),
        q(f'histogram_quantile(0.99, sum by (offline, le) (rate(coloc_online_run_seconds_bucket{{{GPU}}}[{R}])))', "p99 offline {{offline}}"),
    ], "Online work's runs timed from doorbell pages that stamp completions (the shim, page version 3): first launch (after a gap of the page's wake gap, 100 ms by default, 2 ms with the learned release) to the moment the process saw all its work complete, by whether offline work ran on the GPU when the run began. offline=running minus offline=stopped is the latency offline work added; with the default wake gap a run can span several requests."),
    ("Table: GPU-hours over the dashboard's range, per namespace and class", "short", 12, 8, [
        table(f'sum by (namespace, class) (increase(coloc_offline_harvested_seconds_total{{{SEL}}}[$__range])) / 3600'),
    ], "GPU-hours offline work of each namespace ran beside online work over the dashboard's time range (what co-location earned); `coloc-agent status` on a node prints the same since the agent started, with held time and online's waits."),
    ("Preemption latency (onset of online work → offline confirmed stopped)", "s", 16, 9, [
        q(quantile("coloc_preemption_latency_seconds", 0.5, ", signal"), "p50 {{signal}}"),
        q(quantile("coloc_preemption_latency_seconds", 0.9, ", signal"), "p90 {{signal}}"),
        q(quantile("coloc_preemption_latency_seconds", 0.99, ", signal"), "p99 {{signal}}"),
    ], "How fast offline work gets out of the way: from the onset of online work to every offline process confirmed stopped. signal=doorbell: the onset is the launch, seen by the CUDA shim; signal=nvml: work without the shim, whose onset is the start of the NVML sampled period that showed it (one driver sample period or more late)."),
    ("Preemptions per second", "ops", 8, 9, [
        q(f'sum by (node, gpu) (rate(coloc_suspensions_total{{{GPU}, reason="online_busy"}}[{R}]))', "{{node}} GPU {{gpu}}"),
    ], "Offline processes suspended because online work became busy."),
    ("Release latency (end of idle window → offline running)", "s", 12, 8, [
        q(quantile("coloc_release_latency_seconds", 0.5), "p50"),
        q(quantile("coloc_release_latency_seconds", 0.99), "p99"),
    ], "How soon offline work gets the GPU back once online has been idle for the window."),
    ("Detection vs actuation (p99)", "s", 12, 8, [
        q(quantile("coloc_detection_latency_seconds", 0.99, ", signal"), "detection p99 {{signal}}"),
        q(quantile("coloc_actuation_latency_seconds", 0.99), "actuation p99"),
    ], "Detection: onset → decision, by the signal that showed the onset (doorbell: the launch; nvml: the start of the sampled period). Actuation: decision → confirmed stopped (freezer or signals)."),
    ("Online busy vs offline suspended, per GPU", "short", 12, 8, [
        q(f'max by (node, gpu) (coloc_gpu_online_busy{{{GPU}}})', "online busy {{node}} GPU {{gpu}}"),
        q(f'max by (node, gpu) (coloc_offline_suspended_processes{{{GPU}}})', "offline suspended {{node}} GPU {{gpu}}"),
    ], "1 while online work is busy on the GPU; number of offline processes suspended."),
    ("GPU time given back to offline work", "percentunit", 12, 8, [
        q(f'sum by (node, gpu) (rate(coloc_offline_reclaimed_seconds_total{{{GPU}}}[{R}]))', "offline running {{node}} GPU {{gpu}}"),
        q(f'sum by (node, gpu) (rate(coloc_offline_suspended_seconds_total{{{GPU}}}[{R}]))', "offline suspended {{node}} GPU {{gpu}}"),
    ], "Share of wall time offline work ran while online was idle (reclaimed), and was held suspended."),
    ("Releases by rule (and learned ones that did not pay)", "ops", 12, 8, [
        q(f'sum by (rule) (rate(coloc_releases_total{{{GPU}}}[{R}]))', "releases {{rule}}"),
        q(f'sum (rate(coloc_releases_wrong_total{{{GPU}}}[{R}])) or vector(0)', "wrong learned releases"),
    ], "How offline work got the GPU back: rule=fixed after --idle-window, rule=learned after a shorter window learned from the online processes' own gaps (--release learned, only where every online process rings a doorbell with completion stamps and every offline one is gated). Wrong: learned releases after which online came back before offline had run --release-ratio x --release-drain; a steady share of them means the learned windows are too short for this load."),
    ("Offline time harvested after releases, by rule", "percentunit", 12, 8, [
        q(f'sum by (node, gpu, rule) (rate(coloc_release_harvest_seconds_sum{{{GPU}}}[{R}]))', "{{node}} GPU {{gpu}} {{rule}}"),
    ], "Share of wall time offline work ran between a release and the next preemption, by the release's rule: what the learned window adds over the fixed one."),
    ("Fail-open events and actuation errors", "short", 12, 8, [
        q(f'sum by (reason) (increase(coloc_fail_open_total{{{SEL}}}[{R}])) or vector(0)', "fail-open {{reason}}"),
        q(f'sum by (actuator, op, reason) (increase(coloc_actuation_errors_total{{{SEL}}}[{R}])) or vector(0)', "error {{actuator}} {{op}} {{reason}}"),
    ], "Fail-open: the agent resumed all offline work (NVML failure, record write failure, failed actuation). Any non-zero value deserves a look."),
    ("Launch doorbells and gates", "short", 12, 8, [
        q(f'sum by (node) (coloc_doorbell_pages{{{SEL}}}) or vector(0)', "doorbell pages {{node}}"),
        q(f'sum by (node) (increase(coloc_gate_escalations_total{{{SEL}}}[{R}])) or vector(0)', "gate escalations {{node}}"),
        q(f'sum by (node, reason) (increase(coloc_doorbell_rejected_total{{{SEL}}}[{R}])) or vector(0)', "doorbell pages rejected {{reason}}"),
    ], "Doorbell pages mapped (processes under the CUDA shim); launch gates not acknowledged within --gate-timeout, whose processes were stopped by the fallback instead (a few are normal, many mean drains longer than the timeout); pages whose launches count for nothing (misconfiguration or forgery; see the agent's log)."),
    # GPU memory given back to online work (memory preemption: --memory-reserve) and the
    # CUDA driver's lock (--driver-lock). The agent exports these only while one of them
    # is on (the call histogram from the first call): `or on () vector(0)` draws 0 where
    # it exports nothing, and never a second series beside the real ones.
    ("GPU memory given back: checkpointed bytes, per GPU", "bytes", 12, 8, [
        q(f'sum by (node, gpu) (coloc_checkpointed_bytes{{{GPU}}}) or on () vector(0)', "checkpointed {{node}} GPU {{gpu}}"),
    ], "Device memory of offline processes that memory preemption checkpointed (moved by the CUDA driver into their own host memory, the GPU's freed for online work), per GPU. 0 while nothing is checkpointed, or with memory preemption off (--memory-reserve unset)."),
    ("Free GPU memory vs the reserve, per GPU", "bytes", 12, 8, [
        q(f'min by (node, gpu) (coloc_gpu_memory_free_bytes{{{GPU}}}) or on () vector(0)', "free {{node}} GPU {{gpu}}"),
        q(f'max by (node, gpu) (coloc_gpu_memory_reserve_bytes{{{GPU}}}) or on () vector(0)', "reserve {{node}} GPU {{gpu}}"),
    ], "Free memory as NVML reads it, and the reserve online work is kept (--memory-reserve). Both read 0 where neither memory preemption nor the driver's lock is on (the agent then reads no memory). While online work is present and free stays under the reserve, offline processes there are checkpointed, largest first; a checkpointed process is restored once free has held it plus the reserve for --restore-after."),
    ("Memory pressure, checkpointed and driver-locked processes", "short", 12, 8, [
        q(f'max by (node, gpu) (coloc_memory_pressure{{{GPU}}}) or on () vector(0)', "pressure {{node}} GPU {{gpu}}"),
        q(f'sum by (node, gpu) (coloc_checkpointed_processes{{{GPU}}}) or on () vector(0)', "checkpointed {{node}} GPU {{gpu}}"),
        q(f'sum by (node) (coloc_driver_locked_processes{{{SEL}}}) or on () vector(0)', "driver-locked {{node}}"),
    ], "Pressure: 1 while online work on the GPU needs memory that offline work holds. Checkpointed: offline processes whose device memory was moved out. Driver-locked: offline processes held by the CUDA driver's lock (--driver-lock, and every checkpointed process)."),
    ("CUDA driver call latency p50/p99, by op", "s", 12, 8, [
        q(f'histogram_quantile(0.5, sum by (le, op) (rate(coloc_driver_call_seconds_bucket{{{SEL}}}[{R}]))) or on () vector(0)', "p50 {{op}}"),
        q(f'histogram_quantile(0.99, sum by (le, op) (rate(coloc_driver_call_seconds_bucket{{{SEL}}}[{R}]))) or on () vector(0)', "p99 {{op}}"),
    ], "The driver's checkpoint calls as the agent makes them: lock (returns once the work the process had submitted has run: what a drain costs), checkpoint (about 0.6 s per GB of device memory on an H100), restore (about 0.2 s per GB), unlock (about a millisecond). A process that is stopped or frozen stalls every call but the state query until it runs. 0 before the agent's first call."),
    ("CUDA driver call failures, by op and reason", "ops", 12, 8, [
        q(f'sum by (op, reason) (rate(coloc_driver_call_failures_total{{{SEL}}}[{R}])) or on () vector(0)', "{{op}} {{reason}}"),
    ], "Driver calls that failed, by call and reason. A lock that fails (not_supported, timeout, ...) leaves the process to --actuator, which stops it instead; a restore that fails leaves the process checkpointed. no_api: the driver has no checkpoint API (570 or later needed); operating_system on every call: the agent lacks capability SYS_PTRACE or DAC_OVERRIDE; gone: the process exited first."),
    ("GPU memory moved by checkpoints and restores", "binBps", 12, 8, [
        q(f'sum by (node, op) (rate(coloc_checkpoint_bytes_total{{{SEL}}}[{R}])) or on () vector(0)', "{{op}} {{node}}"),
    ], "Device memory moved to host memory (checkpoint) and back (restore), per node. Steady traffic both ways means offline work is evicted and brought back over and over: raise --restore-after or the reserve."),
    ("GPU processes without the CUDA shim, by class and why", "short", 12, 8, [
        q(f'sum by (node, class, shim) (coloc_shim_coverage_processes{{{SEL}, shim!="page"}})', "{{node}} {{class}} {{shim}}"),
        q(f'sum by (node, class) (coloc_shim_coverage_processes{{{SEL}, shim="page"}})', "{{node}} {{class}} with the shim"),
    ], "GPU processes of online and offline pods on each node, by whether the CUDA shim's doorbell page is seen. Without it their work is seen through NVML only (later; offline held by its fallback, not its gate). not_injected: the webhook did not see the pod (namespace opted out or enforcing Pod Security baseline, webhook down, a GPU resource it does not know); refused: it left a container out (gpu-coloc.dev/shim-skipped says why); opted_out: gpu-coloc.dev/shim: disabled; not_loaded: injected, but the process has no page (a static binary, LD_PRELOAD replaced at start, no CUDA launch yet)."),
    ("Agent health", "s", 12, 8, [
        q(f'max by (node) (rate(coloc_loop_lag_seconds_sum{{{SEL}}}[{R}]) / rate(coloc_loop_lag_seconds_count{{{SEL}}}[{R}]))', "loop lag {{node}}"),
        q(f'histogram_quantile(0.99, sum by (le, function) (rate(coloc_nvml_call_duration_seconds_bucket{{{SEL}}}[{R}])))', "NVML p99 {{function}}"),
        q(f'min by (node, instance) (up{{{SEL}}} and on (job, instance) max_over_time(coloc_agent_info[1d]))', "up {{node}} {{instance}}"),
        q(f'max by (node, gpu) (coloc_gpu_degraded{{{SEL}}})', "degraded {{node}} GPU {{gpu}}"),
    ], "Control-loop lag (how late ticks start), NVML call latency, whether each agent (any scrape job that exported coloc_agent_info in the last day) is scraped, and GPUs failed open (degraded: offline work there runs unmanaged)."),
    ("Webhook admissions", "reqps", 12, 8, [
        q(f'sum by (endpoint, result) (rate(coloc_webhook_admissions_total{{cluster=~"$cluster"}}[{R}]))', "{{endpoint}} {{result}}"),
    ], "Admission reviews by result: allowed (nothing to change), patched (translated), denied, invalid (malformed request)."),
    ("Webhook denials by reason", "reqps", 12, 8, [
        q(f'sum by (reason) (rate(coloc_webhook_denials_total{{cluster=~"$cluster"}}[{R}])) or vector(0)', "{{reason}}"),
    ], "Pods rejected for invalid mGPU requests, by reason."),
]


def dashboard():
    panels, x, y, rowh = [], 0, 0, 0
    for i, (title, unit, w, h, targets, desc) in enumerate(PANELS):
        if x + w > 24:
            x, y = 0, y + rowh
            rowh = 0
        is_table = title.startswith("Table: ")
        title = title.removeprefix("Table: ")
        panels.append({
            "id": i + 1, "type": "table" if is_table else "timeseries", "title": title, "description": desc,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"x": x, "y": y, "w": w, "h": h},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"showHeader": True} if is_table else
            {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]}},
            **({"transformations": [{"id": "organize", "options": {"excludeByName": dict(
                {"Time": True}, **({} if all(t["value"] for t in targets) else {"Value": True}))}}]} if is_table else {}),
            "targets": [dict({k: v for k, v in t.items() if k != "value"}, refId=chr(65 + j),
                             datasource={"type": "prometheus", "uid": "${datasource}"}) for j, t in enumerate(targets)],
        })
        x += w
        rowh = max(rowh, h)
    var = lambda name, query, label: {
        "name": name, "label": label, "type": "query", "query": {"query": query, "refId": name},
        "datasource": {"type": "prometheus", "uid": "${datasource}"}, "includeAll": True, "multi": True,
        "allValue": ".*", "current": {"text": "All", "value": "$__all"}, "refresh": 2, "sort": 1,
    }
    return {
        # For Grafana's import (Dashboards -> Import): it asks for a Prometheus data source
        # and sets the datasource variable to it. The chart's ConfigMap (sidecar) works too:
        # there the variable falls back to the default Prometheus.
        "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "description": "Prometheus scraping the gpu-coloc agent and webhook",
                      "type": "datasource", "pluginId": "prometheus", "pluginName": "Prometheus"}],
        "__requires": [{"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
                       {"type": "panel", "id": "timeseries", "name": "Time series", "version": ""},
                       {"type": "panel", "id": "table", "name": "Table", "version": ""},
                       {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.0.0"}],
        "uid": "gpu-coloc", "title": "gpu-coloc: GPU co-location", "tags": ["gpu-coloc", "gpu"],
        "schemaVersion": 39, "version": 1, "editable": True, "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {"text": "Prometheus", "value": "${DS_PROMETHEUS}"}},
            var("cluster", "label_values(coloc_agent_info, cluster)", "Cluster"),
            var("node", 'label_values(coloc_agent_info{cluster=~"$cluster"}, node)', "Node"),
            var("gpu", 'label_values(coloc_gpu_online_busy{cluster=~"$cluster", node=~"$node"}, gpu)', "GPU"),
        ]},
        "panels": panels,
    }


def main():
    text = json.dumps(dashboard(), indent=2) + "\n"
    with open(os.path.join(HERE, "gpu-coloc.json"), "w") as f:
        f.write(text)
    os.makedirs(os.path.join(CHART, "dashboards"), exist_ok=True)
    with open(os.path.join(CHART, "dashboards", "gpu-coloc.json"), "w") as f:
        f.write(text)
    os.makedirs(os.path.join(CHART, "rules"), exist_ok=True)
    shutil.copyfile(os.path.join(HERE, "..", "prometheus", "rules.yaml"), os.path.join(CHART, "rules", "gpu-coloc.yaml"))


if __name__ == "__main__":
    main()
