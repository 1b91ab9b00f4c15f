#!/usr/bin/env python3
"""The shim on real CUDA: does PyTorch run unchanged under LD_PRELOAD=libcoloc_cuda.so,
does the online doorbell see its launches, and what does the shim cost per launch?

Runs the same PyTorch workload (needs PyTorch with CUDA) as a child process three ways:
no shim; the shim as an online process (doorbell page in a temporary directory); the shim
as an offline process (launch gate with K in flight; no agent beats the gate file, so
its gates count as open). The workload: an MLP forward and backward (cuBLAS GEMMs,
elementwise kernels, async copies), a CUDA graph captured and replayed, and a loop of
tiny kernels timed per launch. Each run prints a checksum of its results; with the shim
they must equal the run without it. The online run also reads its own doorbell page
before it exits (the shim removes the page at exit) and reports what the shim recorded.

  python3 benches/gpu/shim_check.py --shim target/release/libcoloc_cuda.so --out /tmp/r/shim.json

Exit status 0 when every check holds, 1 otherwise; the JSON says which.
"""
import argparse, json, os, struct, subprocess, sys, tempfile

CHILD = r'''
import json, os, struct, sys, time
import torch
torch.manual_seed(0)
dev = torch.device("cuda")
out = {}
# Forward and backward (cuBLAS GEMMs, elementwise kernels), async host<->device copies.
model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024)).to(dev)
x = torch.randn(64, 1024).pin_memory().to(dev, non_blocking=True)
loss = model(x).square().mean()
loss.backward()
g = sum(p.grad.double().abs().sum().item() for p in model.parameters())
out["loss"] = loss.item()
out["grad_abs_sum"] = g
# A CUDA graph, captured on a side stream and replayed.
static_x = torch.randn(64, 1024, device=dev)
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(3):
        y = model(static_x)
torch.cuda.current_stream().wait_stream(s)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    static_y = model(static_x)
for _ in range(5):
    graph.replay()
torch.cuda.synchronize()
out["graph_sum"] = static_y.double().sum().item()
# Tiny kernels: the launch path's cost.
a = torch.zeros(16, device=dev)
for _ in range(1000):
    a.add_(1.0)
torch.cuda.synchronize()
n = int(os.environ.get("CHECK_LAUNCHES", "20000"))
t = time.perf_counter()
for _ in range(n):
    a.add_(1.0)
torch.cuda.synchronize()
out["us_per_launch"] = (time.perf_counter() - t) / n * 1e6
out["tiny_sum"] = a.sum().item()
# The doorbell page, read before exit (the shim removes it at exit).
d = os.environ.get("COLOC_DOORBELL_DIR")
if d and os.path.isdir(d):
    pages = []
    for name in os.listdir(d):
        if not name.startswith(f"{os.getpid()}-") or not name.endswith(".bell"):
            continue
        b = open(os.path.join(d, name), "rb").read()
        magic, version, pid, wake, cls = struct.unpack_from("<8sIIII", b, 0)
        entries = []
        for i in range(16):
            off = 64 + 128 * i
            state, _pad, lo, hi, last, since, wakes, inflight, in_submit, ack = struct.unpack_from("<IIQQQQQIII", b, off)
            if state:
                entries.append({"state": state, "last_launch_ns": last, "busy_since_ns": since, "wakes": wakes, "inflight": inflight})
        pages.append({"file": name, "magic": magic.decode(errors="replace"), "version": version, "pid": pid, "class": cls, "wake": wake, "entries": entries})
    out["pages"] = pages
print("RESULT " + json.dumps(out), flush=True)
'''


def run(env, launches):
    env = dict(env, CHECK_LAUNCHES=str(launches))
    p = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    line = next((l for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
    shim_lines = [l for l in p.stderr.splitlines() if "coloc" in l.lower()]
    return {"rc": p.returncode, "result": json.loads(line[7:]) if line else None, "shim_stderr": shim_lines,
            "stderr_tail": p.stderr[-2000:] if p.returncode else ""}


def close(a, b, rel=1e-6):
    return a is not None and b is not None and abs(a - b) <= rel * max(1.0, abs(a), abs(b))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shim", required=True, help="libcoloc_cuda.so")
    ap.add_argument("--launches", type=int, default=20000, help="tiny kernels timed per run")
    ap.add_argument("--inflight", type=int, default=4, help="K for the offline run")
    ap.add_argument("--out", required=True, help="JSON file to write")
    a = ap.parse_args()
    shim = os.path.abspath(a.shim)
    tmp = tempfile.mkdtemp(prefix="coloc-shim-check-")
    bells = os.path.join(tmp, "bells")
    os.makedirs(bells)
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "COLOC_SHIM_CLASS", "COLOC_DOORBELL_DIR", "COLOC_GATE_FILE")}
    runs = {
        "no shim": run(base, a.launches),
        "online (doorbell)": run(dict(base, LD_PRELOAD=shim, COLOC_SHIM_CLASS="online", COLOC_DOORBELL_DIR=bells), a.launches),
        "offline (gate, no agent)": run(dict(base, LD_PRELOAD=shim, COLOC_SHIM_CLASS="offline", COLOC_DOORBELL_DIR=bells,
                                             COLOC_GATE_FILE=os.path.join(tmp, "gates"), COLOC_SHIM_INFLIGHT=str(a.inflight)), a.launches),
    }
    ref = runs["no shim"]["result"] or {}
    checks = {}
    for name, r in runs.items():
        res = r["result"] or {}
        checks[f"{name}: ran"] = r["rc"] == 0 and r["result"] is not None
        if name != "no shim":
            for k in ("loss", "grad_abs_sum", "graph_sum", "tiny_sum"):
                checks[f"{name}: {k} as without the shim"] = close(ref.get(k), res.get(k))
            checks[f"{name}: no failure line from the shim"] = not r["shim_stderr"]
    pages = (runs["online (doorbell)"]["result"] or {}).get("pages") or []
    entries = [e for p in pages for e in p["entries"]]
    checks["online: one doorbell page, class online"] = len(pages) == 1 and pages[0]["class"] == 1
    checks["online: the page saw launches (a run started, latest launch stamped)"] = any(e["wakes"] >= 1 and e["last_launch_ns"] > 0 for e in entries)
    cost = {name: (r["result"] or {}).get("us_per_launch") for name, r in runs.items()}
    base_us = cost.get("no shim")
    summary = {
        "checks": checks,
        "ok": all(checks.values()),
        "us_per_launch": cost,
        "shim_cost_ns_per_launch": {k: (v - base_us) * 1e3 for k, v in cost.items() if k != "no shim" and v is not None and base_us is not None},
        "runs": runs,
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    json.dump(summary, open(a.out, "w"), indent=1)
    for k, v in checks.items():
        print(("ok   " if v else "FAIL ") + k)
    print("µs per launch:", json.dumps(cost))
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
