#!/usr/bin/env python3
"""The shim on real CUDA: does PyTorch run unchanged under LD_PRELOAD=libcoloc_cuda.so,
do its pages record what it did, and what does the shim cost per launch?

Runs the same PyTorch workload (needs PyTorch with CUDA) in child processes, three ways:
- "no shim";
- "online (doorbell)": the shim as an online process (doorbell page in a temporary
  directory);
- "offline (gate)": the shim as an offline process under a real launch gate. With
  --agent, a coloc-agent runs with --gate, a gate file of its own and one rule that matches
  nothing: every GPU process is then unmanaged, nothing is ever suspended, and the gate
  stays open with a fresh heartbeat, so the shim takes its gated path at every launch
  (in_submit, the gate word, one cuEventRecord, the in-flight bound K). The agent runs
  during all three configurations, so they differ only by the shim. Without --agent (or
  if it does not start) the offline run has no gate file: the shim then passes through,
  and the run is named "offline (no gate: pass-through)" instead.

The workload: an MLP forward and backward (cuBLAS GEMMs, elementwise kernels, async
copies), a CUDA graph captured on a side stream and replayed (with the gate on, this is the
gated shim under stream capture), and a loop of tiny kernels timed per launch. Each part
records its own error, so a failure says which part broke. Each run prints checksums; with
the shim they must equal the run without it (and the runs without it must repeat). Each
shimmed run reads its own page before it exits (the shim removes it at exit).

Cost: --rounds rounds, the three configurations in alternating order (round 2 reversed),
each child timing --repeats loops of --launches tiny kernels. Reported per configuration:
the median, min and max over every timed loop; the cost is the difference of medians
(and of minima) to "no shim"; "noise_ns" is the spread (max - min) of the no-shim loops,
the resolution below which a difference says nothing.

  python3 benches/gpu/shim_check.py --shim .gpubin/libcoloc_cuda.so --agent .gpubin/coloc-agent --out /tmp/r/shim.json

The JSON is rewritten after every child (nothing is lost to a timeout). Exit status 0
when every check holds, 1 otherwise; the JSON says which.
"""
import argparse, json, os, shutil, signal, socket, statistics, subprocess, sys, tempfile, time, traceback

# Reads the calling process's own doorbell pages (layout: doorbell/src/lib.rs: a 64-byte
# header `<8sIIII`, then 16 entries of 128 bytes; entry fields `<IIQQQQQIIIIQQ`: state,
# pad, uuid lo, uuid hi, last_launch_ns, busy_since_ns, wakes, inflight, in_submit,
# gate_ack, pad, blocked_ns, submitted).
PAGES_CODE = r'''
def read_pages():
    import os, struct
    d = os.environ.get("COLOC_DOORBELL_DIR")
    if not d or not os.path.isdir(d):
        return None
    pages = []
    for name in sorted(os.listdir(d)):
        if not name.startswith(f"{os.getpid()}-") or not name.endswith(".bell"):
            continue
        b = open(os.path.join(d, name), "rb").read()
        magic, version, pid, wake, cls = struct.unpack_from("<8sIIII", b, 0)
        entries = []
        for i in range(16):
            (state, _p, lo, hi, last, since, wakes, inflight, in_submit, ack, _p2, blocked,
             submitted) = struct.unpack_from("<IIQQQQQIIIIQQ", b, 64 + 128 * i)
            if state:
                entries.append({"state": state, "last_launch_ns": last, "busy_since_ns": since, "wakes": wakes,
                                "inflight": inflight, "in_submit": in_submit, "gate_ack": ack,
                                "blocked_ns": blocked, "submitted": submitted})
        pages.append({"file": name, "magic": magic.decode(errors="replace"), "version": version, "pid": pid,
                      "class": cls, "wake": wake, "entries": entries})
    return pages
'''

CHILD = PAGES_CODE + r'''
import json, os, sys, time, traceback
out = {"errors": {}}
def part(name, f):
    try:
        f()
    except Exception:
        out["errors"][name] = traceback.format_exc()[-1500:]
t0 = time.monotonic()
import torch
out["import_s"] = time.monotonic() - t0
torch.manual_seed(0)
dev = torch.device("cuda")
st = {}
def mlp():
    # Forward and backward (cuBLAS GEMMs, elementwise kernels), async host->device copy.
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024)).to(dev)
    st["model"] = model
    x = torch.randn(64, 1024).pin_memory().to(dev, non_blocking=True)
    loss = model(x).square().mean()
    loss.backward()
    out["grad_abs_sum"] = sum(p.grad.double().abs().sum().item() for p in model.parameters())
    out["loss"] = loss.item()
def graph():
    # A CUDA graph, captured on a side stream and replayed.
    model = st["model"]
    static_x = torch.randn(64, 1024, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = model(static_x)
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    out["graph_sum"] = static_y.double().sum().item()
def launches():
    # Tiny kernels: the launch path's cost, --repeats timed loops of --launches each.
    a = torch.zeros(16, device=dev)
    for _ in range(2000):
        a.add_(1.0)
    torch.cuda.synchronize()
    n, reps = int(os.environ["CHECK_LAUNCHES"]), int(os.environ["CHECK_REPEATS"])
    us = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            a.add_(1.0)
        torch.cuda.synchronize()
        us.append((time.perf_counter() - t) / n * 1e6)
    out["us_per_launch_repeats"] = us
    out["tiny_sum"] = a.sum().item()
part("mlp", mlp)
if "model" in st:
    part("graph", graph)
part("launches", launches)
part("pages", lambda: out.__setitem__("pages", read_pages()))
print("RESULT " + json.dumps(out), flush=True)
'''

BASE_ENV_DROP = ("LD_PRELOAD", "COLOC_SHIM_CLASS", "COLOC_DOORBELL_DIR", "COLOC_GATE_FILE", "COLOC_SHIM_INFLIGHT", "COLOC_SHIM_INFLIGHT_MS", "COLOC_SHIM_WAKE_GAP_MS")


def run_child(code, env, timeout):
    """Runs `python3 -c code`; its `RESULT {json}` line, return code, and the shim's stderr
    lines. Never raises on a timeout or a crash: they are recorded."""
    t = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=max(1.0, timeout))
        rc, so, se = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc = "timeout"
        so = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        se = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
    line = next((l for l in so.splitlines() if l.startswith("RESULT ")), None)
    try:
        result = json.loads(line[7:]) if line else None
    except ValueError:
        result = None
    return {"rc": rc, "wall_s": round(time.monotonic() - t, 2), "result": result,
            "shim_stderr": [l for l in se.splitlines() if "coloc" in l.lower() and not l.startswith(TRACE)][:20],
            # COLOC_SHIM_TRACE=1: every distinct entry point looked up, wrapped or passed.
            "shim_trace": [l[len(TRACE):] for l in se.splitlines() if l.startswith(TRACE)][:4000],
            "stderr_tail": se[-2000:] if (rc != 0 or result is None) else ""}


TRACE = "libcoloc_cuda: trace: "


def close(a, b, rel=1e-6):
    return a is not None and b is not None and abs(a - b) <= rel * max(1.0, abs(a), abs(b))


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def http_get(port, path, timeout=2.0):
    """GET http://127.0.0.1:port/path: (status, body)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while True:
            b = s.recv(65536)
            if not b:
                break
            data += b
    finally:
        s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode(errors="replace")


def readyz(port):
    code, body = http_get(port, "/readyz", timeout=1)
    return code, body.strip()


def start_gate_agent(a, tmp, bells, gate_file):
    """A coloc-agent that owns a real gate file and never suspends anything. Returns
    (Popen, log path, error or None)."""
    gate_dir = os.path.dirname(gate_file)
    os.makedirs(gate_dir, exist_ok=True)
    os.chmod(gate_dir, 0o755)  # the agent refuses a group- or other-writable directory
    rules = os.path.join(tmp, "rules.toml")
    with open(rules, "w") as f:
        f.write('[[rule]]\nname = "nothing"\nclass = "reclaimed_cores"\ncmdline = "*coloc-shim-check-matches-no-process*"\n')
    port = free_port()
    log = os.path.join(a.log_dir or tmp, "shim-check-agent.log")
    cmd = [a.agent, "run", "--rules", rules, "--nvml-lib", a.nvml_lib, "--actuator", "signal", "--gate", "--gate-file", gate_file,
           "--listen", f"127.0.0.1:{port}", "--state-dir", os.path.join(tmp, "state"), "--doorbell-dir", bells]
    ag = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "w"), stdin=subprocess.DEVNULL)
    until, last = time.monotonic() + 15, ""
    while True:
        if ag.poll() is not None:
            return ag, log, f"the agent exited with {ag.returncode}: {tail(log)}"
        try:
            code, last = readyz(port)
            if code == 200 and os.path.exists(gate_file):
                return ag, log, None
        except OSError as e:
            last = str(e)
        if time.monotonic() > until:
            return ag, log, f"the agent was not ready after 15 s ({last}): {tail(log)}"
        time.sleep(0.05)


def tail(path, n=1500):
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError as e:
        return f"({e})"


def stop_agent(ag):
    if ag is None or ag.poll() is not None:
        return None if ag is None else ag.returncode
    ag.terminate()
    try:
        ag.wait(10)
    except subprocess.TimeoutExpired:
        ag.kill()
        ag.wait(5)
    return ag.returncode


def summarise(runs, cfgs, gated_name, a, agent_err, skipped):
    first = lambda name: next((r for r in runs.get(name, []) if r["result"]), None)
    ref = (first("no shim") or {}).get("result") or {}
    checks = {}
    for name in cfgs:
        rs = runs.get(name, [])
        if not rs:
            continue
        checks[f"{name}: ran"] = all(r["rc"] == 0 and r["result"] is not None for r in rs)
        for part in ("mlp", "graph", "launches", "pages"):
            checks[f"{name}: {part} without error"] = all(r["result"] is not None and part not in r["result"].get("errors", {}) for r in rs)
        keys = ("loss", "grad_abs_sum", "graph_sum", "tiny_sum")
        if name == "no shim":
            if len(rs) > 1:
                checks["no shim: results repeat across runs (the comparisons below are meaningful)"] = all(
                    close(ref.get(k), (r["result"] or {}).get(k)) for r in rs[1:] for k in keys)
        else:
            for k in keys:
                checks[f"{name}: {k} as without the shim"] = all(close(ref.get(k), (r["result"] or {}).get(k)) for r in rs)
            checks[f"{name}: no failure line from the shim"] = not any(r["shim_stderr"] for r in rs)
    pages = lambda name: [p for r in runs.get(name, []) for p in ((r["result"] or {}).get("pages") or [])]
    if runs.get("online (doorbell)"):
        on = pages("online (doorbell)")
        ent = [e for p in on for e in p["entries"]]
        checks["online: one doorbell page per run, class online"] = len(on) == len(runs["online (doorbell)"]) and all(p["class"] == 1 for p in on)
        checks["online: the page saw launches (a run started, latest launch stamped)"] = bool(ent) and all(e["wakes"] >= 1 and e["last_launch_ns"] > 0 for e in ent)
    if runs.get(gated_name):
        off = pages(gated_name)
        ent = [e for p in off for e in p["entries"]]
        checks[f"{gated_name}: one page per run, class offline"] = len(off) == len(runs[gated_name]) and all(p["class"] == 2 for p in off)
        if gated_name == "offline (gate)":
            # `submitted` is counted on the gated path only: the gate was in force.
            checks["offline (gate): the gate was in force (the page counted submissions)"] = bool(ent) and all(e["submitted"] > 0 for e in ent)
    # Cost per launch.
    loops = {name: [u for r in runs.get(name, []) for u in ((r["result"] or {}).get("us_per_launch_repeats") or [])] for name in cfgs}
    stat = {name: {"median_us": statistics.median(v), "min_us": min(v), "max_us": max(v), "loops": len(v)} for name, v in loops.items() if v}
    base = stat.get("no shim")
    cost = {}
    if base:
        noise = (base["max_us"] - base["min_us"]) * 1e3
        for name, s in stat.items():
            if name != "no shim":
                cost[name] = {"median_diff_ns": (s["median_us"] - base["median_us"]) * 1e3, "min_diff_ns": (s["min_us"] - base["min_us"]) * 1e3}
        cost["noise_ns"] = noise
        cost["note"] = (f"{a.rounds} rounds x {a.repeats} loops x {a.launches} launches per configuration, alternating order; "
                        f"differences below noise_ns ({noise:.0f} ns: the spread of the no-shim loops) are not resolved")
    return {
        "checks": checks,
        "ok": bool(checks) and all(checks.values()) and not skipped,
        "gate": {"config": gated_name, "agent_error": agent_err},
        "us_per_launch": stat,
        "shim_cost_ns_per_launch": cost,
        "skipped": skipped,
        "runs": runs,
    }


def write(path, doc):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shim", required=True, help="libcoloc_cuda.so")
    ap.add_argument("--agent", help="coloc-agent: run one with a real gate file for the offline configuration")
    ap.add_argument("--nvml-lib", default="libnvidia-ml.so.1", help="for --agent")
    ap.add_argument("--launches", type=int, default=100000, help="tiny kernels per timed loop")
    ap.add_argument("--repeats", type=int, default=5, help="timed loops per child")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the three configurations (alternating order)")
    ap.add_argument("--inflight", type=int, default=4, help="K for the offline run")
    ap.add_argument("--child-timeout", type=float, default=120.0, help="seconds per child process")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds for the whole check: children that would not fit are skipped")
    ap.add_argument("--log-dir", help="where to write the agent's log (default: a temporary directory)")
    ap.add_argument("--out", required=True, help="JSON file to write")
    a = ap.parse_args()
    deadline = time.monotonic() + a.budget
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    shim = os.path.abspath(a.shim)
    tmp = tempfile.mkdtemp(prefix="coloc-shim-check-")
    bells = os.path.join(tmp, "bells")
    os.makedirs(bells)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    gate_file = os.path.join(tmp, "gate", "gates")
    ag, agent_log, agent_err = None, None, "no --agent given"
    if a.agent:
        ag, agent_log, agent_err = start_gate_agent(a, tmp, bells, gate_file)
    gated_name = "offline (gate)" if agent_err is None else "offline (no gate: pass-through)"
    print(f"shim_check: offline configuration: {gated_name}" + (f" ({agent_err})" if agent_err else ""), flush=True)
    base = {k: v for k, v in os.environ.items() if k not in BASE_ENV_DROP}
    base.update(CHECK_LAUNCHES=str(a.launches), CHECK_REPEATS=str(a.repeats))
    envs = {
        "no shim": base,
        "online (doorbell)": dict(base, LD_PRELOAD=shim, COLOC_SHIM_CLASS="online", COLOC_DOORBELL_DIR=bells),
        gated_name: dict(base, LD_PRELOAD=shim, COLOC_SHIM_CLASS="offline", COLOC_DOORBELL_DIR=bells,
                         COLOC_GATE_FILE=gate_file, COLOC_SHIM_INFLIGHT=str(a.inflight)),
    }
    cfgs = list(envs)
    order = [c for r in range(a.rounds) for c in (cfgs if r % 2 == 0 else cfgs[::-1])]
    runs, skipped, summary = {}, [], None
    try:
        slowest = 30.0
        for i, name in enumerate(order):
            left = deadline - time.monotonic()
            if left < slowest * 1.2:
                skipped = [f"{n} (budget: {left:.0f} s left)" for n in order[i:]]
                print(f"shim_check: budget: skipping {len(skipped)} runs", flush=True)
                break
            print(f"shim_check: run {i + 1}/{len(order)}: {name}", flush=True)
            r = run_child(CHILD, envs[name], min(a.child_timeout, left - 2))
            slowest = max(slowest, r["wall_s"])
            runs.setdefault(name, []).append(r)
            res = r["result"] or {}
            us = res.get("us_per_launch_repeats")
            print(f"shim_check:   rc {r['rc']}, {r['wall_s']} s, µs/launch {['%.3f' % u for u in us] if us else None}, "
                  f"errors {list(res.get('errors', {})) if r['result'] else 'no result'}", flush=True)
            summary = summarise(runs, cfgs, gated_name, a, agent_err, skipped)
            write(a.out, summary)
    finally:
        rc = stop_agent(ag)
        summary = summarise(runs, cfgs, gated_name, a, agent_err, skipped)
        summary["gate"].update(agent_exit=rc, agent_log_tail=tail(agent_log) if agent_log else None)
        write(a.out, summary)
        shutil.rmtree(tmp, ignore_errors=True)
    for k, v in summary["checks"].items():
        print(("ok   " if v else "FAIL ") + k, flush=True)
    print("µs per launch:", json.dumps(summary["us_per_launch"]), flush=True)
    print("shim cost:", json.dumps(summary["shim_cost_ns_per_launch"]), flush=True)
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except Exception:
        traceback.print_exc()
        sys.exit(2)
