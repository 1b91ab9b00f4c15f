#!/usr/bin/env python3
"""Online latency against offline's share, per policy: the curve, not one point.

Runs `coloc-demo` in the real-GPU harness's world (30 requests/s of 1 ms beside offline
kernels of --offline-step-ms) once per point and prints one markdown row per policy and
point:

- doorbell, and doorbell + gate, at each idle window (--windows, ms): how long online must
  stay idle before offline work is released;
- at-once release (doorbell + gate, `--release at-once`) at each in-flight bound of the
  gate (--bounds, ms of GPU time, COLOC_SHIM_INFLIGHT_MS): how much offline work may be in
  flight when online's next request arrives.

Ratios are over online alone in the same run; 'offline' is offline's progress over
(offline alone x the share of time online leaves the GPU idle).

    benches/policy-curve.py [--demo target/release/coloc-demo] [--duration-s 30]
                            [--offline-step-ms 2] [--windows 100,30,10,3]
                            [--bounds 0.25,0.5,1,2,4] [--json FILE]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile


def run(demo, duration, step, window_ms, release, env_extra):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [demo, "--world", "harness", "--duration-s", str(duration),
           "--offline-step-ms", str(step), "--idle-window", f"{window_ms}ms", "--release", release,
           "--json", out]
    env = dict(os.environ, **env_extra)
    p = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    with open(out) as f:
        d = json.load(f)
    os.unlink(out)
    return d.get("harness", d)["scenarios"]


def row(policy, knob, s, alone):
    return {
        "policy": policy,
        "knob": knob,
        "p50_x": s["p50_ms"] / alone["p50_ms"],
        "p99_x": s["p99_ms"] / alone["p99_ms"],
        "offline": s.get("offline_share_of_idle", float("nan")),
        "preemptions": s.get("preemptions", 0),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo", default="target/release/coloc-demo")
    ap.add_argument("--duration-s", type=float, default=30)
    ap.add_argument("--offline-step-ms", type=float, default=2)
    ap.add_argument("--windows", default="100,30,10,3")
    ap.add_argument("--bounds", default="0.25,0.5,1,2,4")
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    for w in [float(x) for x in a.windows.split(",")]:
        s = run(a.demo, a.duration_s, a.offline_step_ms, w, "learned", {})
        rows.append(row("doorbell", f"window {w:g} ms", s["doorbell"], s["alone"]))
        rows.append(row("doorbell + gate", f"window {w:g} ms", s["gate"], s["alone"]))
        print(f"window {w:g} ms done", file=sys.stderr, flush=True)
    for b in [float(x) for x in a.bounds.split(",")]:
        s = run(a.demo, a.duration_s, a.offline_step_ms, 100, "at-once", {"COLOC_SHIM_INFLIGHT_MS": f"{b:g}"})
        rows.append(row("at-once release", f"bound {b:g} ms", s["learned"], s["alone"]))
        print(f"bound {b:g} ms done", file=sys.stderr, flush=True)
    print("| policy | knob | online p50 / p99 vs alone | offline (of idle) | preemptions |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['knob']} | {r['p50_x']:.2f} / {r['p99_x']:.2f}× | "
              f"{r['offline'] * 100:.0f} % | {r['preemptions']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
