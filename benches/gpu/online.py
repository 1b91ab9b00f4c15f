#!/usr/bin/env python3
"""Online service on a real GPU: requests arrive at random (Poisson, --rate per second);
each runs one forward pass of a small model at small batch and waits for the GPU
(torch.cuda.synchronize). Records per-request latency (arrival -> done, CLOCK_MONOTONIC)
and writes JSON (always: in a `finally`, with "error" if it failed), with its active window
(schedule start -> last completion, monotonic seconds) so a harness can measure another
process over the same window. --ready FILE is created after the warm-up, just before the
first arrival. Needs PyTorch with CUDA; nothing from a registry."""
import argparse, json, math, os, random, signal, sys, time, traceback

# Signal handlers before `import torch` (see offline.py).
stop = False


def _stop(*_):
    global stop
    stop = True


for _s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(_s, _stop)

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--rate", type=float, default=30.0, help="requests per second")
ap.add_argument("--duration", type=float, default=30.0, help="seconds")
ap.add_argument("--batch", type=int, default=8)
ap.add_argument("--width", type=int, default=4096, help="hidden width of the model")
ap.add_argument("--layers", type=int, default=12)
ap.add_argument("--seed", type=int, default=7)
ap.add_argument("--ready", help="file to create after the warm-up")
ap.add_argument("--out", required=True)
a = ap.parse_args()

res = {"requests": 0, "p50_ms": None, "p99_ms": None, "max_ms": None, "rate": a.rate, "phase": "import", "clock": "monotonic"}
records = []
t_launch = time.monotonic()
try:
    import torch

    res["phase"] = "init"
    if not stop:
        dev = torch.device("cuda")
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(a.width, a.width), torch.nn.GELU()) for _ in range(a.layers)]).to(dev).half().eval()
        x = torch.randn(a.batch, a.width, device=dev, dtype=torch.half)
        with torch.no_grad():
            for _ in range(20):  # warm-up (kernels, allocator)
                model(x)
        torch.cuda.synchronize()
        res["startup_s"] = time.monotonic() - t_launch
        if a.ready:
            with open(a.ready, "w") as f:
                f.write(f"{time.monotonic()}\n")
        res["phase"] = "run"
        rng = random.Random(a.seed)
        start = time.monotonic()
        res["window_mono_s"] = [start, start]
        arrival = start
        with torch.no_grad():
            while not stop:
                arrival += -math.log(1.0 - rng.random()) / a.rate
                if arrival - start > a.duration:
                    break
                now = time.monotonic()
                if arrival > now:
                    time.sleep(arrival - now)
                model(x)
                torch.cuda.synchronize()
                records.append((arrival, time.monotonic()))
                res["window_mono_s"][1] = records[-1][1]
        res["phase"] = "done" if not stop else "stopped"
    else:
        res["phase"] = "stopped before start"
except BaseException:
    res["error"] = traceback.format_exc()[-3000:]
    raise
finally:
    lat = sorted((d - r) * 1e3 for r, d in records)
    pct = lambda q: lat[min(len(lat) - 1, max(0, math.ceil(q / 100 * len(lat)) - 1))] if lat else None
    res.update(requests=len(lat), p50_ms=pct(50), p99_ms=pct(99), max_ms=lat[-1] if lat else None,
               records=[[int(r * 1e9), int(r * 1e9), int(d * 1e9)] for r, d in records])
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f)
    os.replace(tmp, a.out)
sys.exit(0)
