#!/usr/bin/env python3
"""Offline checks of everything in deploy/: the Helm chart rendered with several value
sets (render-chart.py), the kustomize base and overlay (kubectl kustomize), each object
validated against the Kubernetes 1.33 schemas (kubernetes-validate, strict), the plain
manifests in sync with the chart, and the promises the README makes about them."""
import os, subprocess, sys, tempfile
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
DEPLOY = os.path.dirname(HERE)
ROOT = os.path.dirname(DEPLOY)
K8S = "1.33.0"
CRD_GROUPS = ("cert-manager.io/", "monitoring.coreos.com/")
failures = []


def run(*cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise SystemExit(f"FAILED: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def check(cond, msg):
    if not cond:
        failures.append(msg)


def validate(text, label):
    docs = [d for d in yaml.safe_load_all(text) if d]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(text)
    r = subprocess.run(["kubernetes-validate", "-k", K8S, "--strict", f.name], capture_output=True, text=True)
    out = r.stdout + r.stderr
    for line in out.splitlines():
        if line.startswith("INFO") or not line.strip():
            continue
        if "Couldn't find schema" in line and any(g in line for g in CRD_GROUPS):
            continue  # custom resources (cert-manager, prometheus-operator): no schema offline
        failures.append(f"{label}: {line}")
    if r.returncode != 0 and not any("Couldn't find schema" in l for l in out.splitlines()):
        failures.append(f"{label}: kubernetes-validate exited {r.returncode}")
    print(f"ok  {label}: {len(docs)} objects validated against Kubernetes {K8S}")
    return docs


def by_kind(docs, kind):
    return [d for d in docs if d.get("kind") == kind]


def render(*sets):
    args = ["python3", os.path.join(HERE, "render-chart.py")]
    for s in sets:
        args += ["--set", s]
    return run(*args)


def promises(docs, label, caps=("KILL",), release_ns="gpu-coloc"):
    caps = list(caps)
    ds = by_kind(docs, "DaemonSet")[0]
    pod = ds["spec"]["template"]["spec"]
    c = pod["containers"][0]
    sc = c["securityContext"]
    check(pod.get("hostPID") is True, f"{label}: agent needs hostPID")
    check(not sc.get("privileged"), f"{label}: agent must not be privileged by default")
    check(sc["capabilities"]["drop"] == ["ALL"], f"{label}: agent drops all capabilities")
    check(sc["capabilities"]["add"] == caps, f"{label}: agent capabilities {sc['capabilities']['add']}, expected {caps}")
    check(sc.get("allowPrivilegeEscalation") is False, f"{label}: agent allowPrivilegeEscalation")
    check(pod.get("securityContext", {}).get("seccompProfile") == {"type": "RuntimeDefault"}, f"{label}: agent seccomp RuntimeDefault")
    env = {e["name"]: e for e in c["env"]}
    check(env["COLOC_LOOP_NICE"]["value"] == ("-10" if "SYS_NICE" in caps else "0"), f"{label}: COLOC_LOOP_NICE without/with SYS_NICE")
    check(env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName", f"{label}: NODE_NAME from the downward API")
    check(c["livenessProbe"]["httpGet"]["path"] == "/healthz" and c["readinessProbe"]["httpGet"]["path"] == "/readyz", f"{label}: probes")
    check("requests" in c["resources"] and "limits" in c["resources"], f"{label}: resources")
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    check("/host/sys/fs/cgroup" in mounts and "/run/coloc-agent" in mounts, f"{label}: cgroup and state mounts")
    check(pod.get("priorityClassName") == "gpu-coloc-agent", f"{label}: agent priority class")
    check(pod.get("nodeSelector"), f"{label}: GPU node selection")
    role = by_kind(docs, "ClusterRole")[0]
    check(role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}], f"{label}: RBAC limited to get/list/watch pods")
    svc = [s for s in by_kind(docs, "Service") if s["metadata"]["name"].endswith("agent-metrics")][0]
    check(svc["metadata"]["annotations"].get("prometheus.io/scrape") == "true", f"{label}: scrape annotations")
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        for cfg in by_kind(docs, kind):
            for w in cfg["webhooks"]:
                check(w["sideEffects"] == "None" and w["failurePolicy"] and w["timeoutSeconds"], f"{label}: {w['name']} settings")
                ns = w["namespaceSelector"]["matchExpressions"][0]
                # By namespace name (set by the API server only), never by a label that a
                # tenant could put on its own pod.
                check(ns["key"] == "kubernetes.io/metadata.name" and ns["operator"] == "NotIn" and set(ns["values"]) == {"kube-system", release_ns},
                      f"{label}: {w['name']} excludes kube-system and the release namespace {release_ns} by name")
                check("objectSelector" not in w, f"{label}: {w['name']} has an objectSelector (tenants can set pod labels)")
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
        check(by_kind(docs, "PodDisruptionBudget"), f"{label}: webhook PDB")


def main():
    subprocess.run([sys.executable, "-m", "pip", "show", "-q", "kubernetes-validate"], capture_output=True).returncode == 0 or \
        run(sys.executable, "-m", "pip", "install", "-q", "kubernetes-validate==1.33.1")
    default = render()
    promises(validate(default, "chart (defaults)"), "chart (defaults)")
    host = validate(render("agent.runtimeClassName="), "chart (driver from host path)")
    env = {e["name"] for e in by_kind(host, "DaemonSet")[0]["spec"]["template"]["spec"]["containers"][0]["env"]}
    check("COLOC_NVML_LIB" in env, "host-path mode sets COLOC_NVML_LIB")
    promises(validate(render("agent.sysPtrace=true"), "chart (SYS_PTRACE)"), "chart (SYS_PTRACE)", caps=("KILL", "SYS_PTRACE"))
    promises(validate(render("agent.raiseLoopPriority=true"), "chart (SYS_NICE)"), "chart (SYS_NICE)", caps=("KILL", "SYS_NICE"))
    other_ns = validate(run("python3", os.path.join(HERE, "render-chart.py"), "--namespace", "gpu-sharing"), "chart (namespace gpu-sharing)")
    promises(other_ns, "chart (namespace gpu-sharing)", release_ns="gpu-sharing")
    full = validate(render("agent.serviceMonitor.enabled=true", "webhook.certManager.enabled=true", "prometheusRules.enabled=true"), "chart (ServiceMonitor, cert-manager, rules)")
    check(by_kind(full, "ServiceMonitor") and by_kind(full, "Certificate"), "optional objects rendered when enabled")
    agent_only = validate(render("webhook.enabled=false"), "chart (agent only)")
    check(not by_kind(agent_only, "MutatingWebhookConfiguration"), "webhook.enabled=false drops the webhook")

    with open(os.path.join(DEPLOY, "kustomize", "base", "gpu-coloc.yaml")) as f:
        committed = f.read()
    fresh = run("bash", "-c", f"cd {DEPLOY} && {{ echo '# Generated by deploy/scripts/render-manifests.sh from deploy/helm/gpu-coloc (default values).'; echo '# Do not edit: change the chart and regenerate.'; python3 scripts/render-chart.py --name gpu-coloc --namespace gpu-coloc; }}")
    check(committed == fresh, "deploy/kustomize/base/gpu-coloc.yaml is stale: run deploy/scripts/render-manifests.sh")
    base = run("kubectl", "kustomize", os.path.join(DEPLOY, "kustomize", "base"))
    promises(validate(base, "kustomize base"), "kustomize base")
    over = validate(run("kubectl", "kustomize", os.path.join(DEPLOY, "kustomize", "overlays", "cert-manager")), "kustomize overlay cert-manager")
    for cfg in by_kind(over, "MutatingWebhookConfiguration") + by_kind(over, "ValidatingWebhookConfiguration"):
        check(cfg["metadata"]["annotations"].get("cert-manager.io/inject-ca-from") == "gpu-coloc/gpu-coloc-webhook", "overlay injects the CA")

    # The chart ships the same dashboard and rules as deploy/grafana and deploy/prometheus.
    pairs = [("grafana/gpu-coloc.json", "helm/gpu-coloc/dashboards/gpu-coloc.json"),
             ("prometheus/rules.yaml", "helm/gpu-coloc/rules/gpu-coloc.yaml")]
    for a, b in pairs:
        with open(os.path.join(DEPLOY, a)) as fa, open(os.path.join(DEPLOY, b)) as fb:
            check(fa.read() == fb.read(), f"deploy/{b} differs from deploy/{a}: run deploy/grafana/generate.py")
    run("promtool", "check", "rules", os.path.join(DEPLOY, "prometheus", "rules.yaml"))
    print("ok  promtool check rules")

    # The README's install commands name these paths.
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    for needle in ("kubectl apply -k deploy/kustomize/base", "kubectl apply -k deploy/kustomize/overlays/cert-manager",
                   "deploy/scripts/self-signed-webhook-cert.sh", "helm install gpu-coloc deploy/helm/gpu-coloc"):
        check(needle in readme, f"README lacks {needle!r}")

    # The README's privileges table names exactly the capabilities the chart can grant.
    import re
    table = set(re.findall(r"^\| capability `([A-Z_]+)`", readme, flags=re.M))
    granted = set()
    for sets in ((), ("agent.sysPtrace=true",), ("agent.raiseLoopPriority=true",)):
        ds = by_kind([d for d in yaml.safe_load_all(render(*sets)) if d], "DaemonSet")[0]
        granted |= set(ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"]["add"])
    check(table == granted, f"README privileges table lists capabilities {sorted(table)}, the chart can grant {sorted(granted)}")

    if failures:
        print("\n".join("FAIL " + f for f in failures))
        sys.exit(1)
    print("deploy checks: all passed")


if __name__ == "__main__":
    main()
