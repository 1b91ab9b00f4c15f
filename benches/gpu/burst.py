#!/usr/bin/env python3
"""Online probe on a real GPU: bursts of tiny kernels, each launched and waited for alone
(one small in-place add, then torch.cuda.synchronize), with idle gaps between bursts.
Alone, a kernel's latency is the launch and completion path (~10-30 us). While another
process's work occupies the GPU, the kernel waits for the GPU's time slice, so a burst
shows for how long an offline process's queued work (its drain) delays online work after
online starts, and by how much. --gap-ms should exceed the agent's idle window, so that
offline resumes and queues work again between bursts.

Writes JSON (always: in a `finally`, with "error" if it failed), the same as
`coloc-sim burst`: "kernels" [[CLOCK_MONOTONIC s, latency ms]], "bursts" [[start s, end
s]], and "bursts_wall_s" (each burst's start, CLOCK_REALTIME s, to match the agent's
event log). --ready FILE is created after the warm-up. Needs PyTorch with CUDA."""
import argparse, json, os, signal, sys, time, traceback

stop = False


def _stop(*_):
    global stop
    stop = True


for _s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(_s, _stop)

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--bursts", type=int, default=5)
ap.add_argument("--burst-ms", type=float, default=300.0)
ap.add_argument("--gap-ms", type=float, default=700.0)
ap.add_argument("--elements", type=int, default=1 << 16, help="size of the tensor the kernel adds to")
ap.add_argument("--ready", help="file to create after the warm-up")
ap.add_argument("--out", required=True)
a = ap.parse_args()

res = {"clock": "monotonic", "burst_ms": a.burst_ms, "gap_ms": a.gap_ms, "phase": "import", "bursts": [], "bursts_wall_s": [], "kernels": []}
t_launch = time.monotonic()
try:
    import torch

    res["phase"] = "init"
    if not stop:
        x = torch.zeros(a.elements, device="cuda")
        for _ in range(200):  # warm-up: the kernel, the allocator, the launch path
            x.add_(1.0)
            torch.cuda.synchronize()
        res["startup_s"] = time.monotonic() - t_launch
        if a.ready:
            with open(a.ready, "w") as f:
                f.write(f"{time.monotonic()}\n")
        res["phase"] = "run"
        kernels, spans = res["kernels"], res["bursts"]
        for _ in range(a.bursts):
            wake = time.monotonic() + a.gap_ms / 1e3
            while not stop and time.monotonic() < wake:
                time.sleep(min(0.05, max(0.0, wake - time.monotonic())))
            if stop:
                break
            start = time.monotonic()
            res["bursts_wall_s"].append(time.time())
            while not stop and time.monotonic() - start < a.burst_ms / 1e3:
                t = time.monotonic()
                x.add_(1.0)
                torch.cuda.synchronize()
                kernels.append([t, (time.monotonic() - t) * 1e3])
            spans.append([start, time.monotonic()])
        res["phase"] = "done" if not stop else "stopped"
    else:
        res["phase"] = "stopped before start"
except BaseException:
    res["error"] = traceback.format_exc()[-3000:]
    raise
finally:
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f)
    os.replace(tmp, a.out)
sys.exit(0)
