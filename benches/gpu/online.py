#!/usr/bin/env python3
"""Online service on a real GPU: requests arrive at random (Poisson, --rate per second);
each runs one forward pass of a small model at small batch and waits for the GPU
(torch.cuda.synchronize). Records per-request latency (arrival -> done) and writes JSON.
Needs PyTorch with CUDA; nothing from a registry."""
import argparse, json, math, random, signal, time

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--rate", type=float, default=30.0, help="requests per second")
ap.add_argument("--duration", type=float, default=30.0, help="seconds")
ap.add_argument("--batch", type=int, default=8)
ap.add_argument("--width", type=int, default=4096, help="hidden width of the model")
ap.add_argument("--layers", type=int, default=12)
ap.add_argument("--seed", type=int, default=7)
ap.add_argument("--out", required=True)
a = ap.parse_args()

import torch  # noqa: E402

stop = False
signal.signal(signal.SIGTERM, lambda *_: globals().__setitem__("stop", True))
dev = torch.device("cuda")
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(a.width, a.width), torch.nn.GELU()) for _ in range(a.layers)]).to(dev).half().eval()
x = torch.randn(a.batch, a.width, device=dev, dtype=torch.half)
with torch.no_grad():
    for _ in range(20):  # warm-up (kernels, allocator)
        model(x)
torch.cuda.synchronize()
rng = random.Random(a.seed)
start = time.time()
arrival = start
records = []
with torch.no_grad():
    while not stop:
        arrival += -math.log(1.0 - rng.random()) / a.rate
        if arrival - start > a.duration:
            break
        now = time.time()
        if arrival > now:
            time.sleep(arrival - now)
        model(x)
        torch.cuda.synchronize()
        records.append((arrival, time.time()))
lat = sorted((d - r) * 1e3 for r, d in records)
pct = lambda q: lat[min(len(lat) - 1, max(0, math.ceil(q / 100 * len(lat)) - 1))] if lat else float("nan")
busy = None
json.dump({"requests": len(lat), "p50_ms": pct(50), "p99_ms": pct(99), "max_ms": lat[-1] if lat else None,
           "rate": a.rate, "records": [[int(r * 1e9), int(r * 1e9), int(d * 1e9)] for r, d in records]}, open(a.out, "w"))
