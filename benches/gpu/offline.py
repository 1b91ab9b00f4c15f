#!/usr/bin/env python3
"""Offline job on a real GPU: training steps of a model large enough to keep the GPU busy,
until SIGTERM or --duration; writes steps/s as JSON. Needs PyTorch with CUDA."""
import argparse, json, signal, time

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--duration", type=float, default=0.0, help="seconds (0: until SIGTERM)")
ap.add_argument("--batch", type=int, default=64)
ap.add_argument("--width", type=int, default=8192)
ap.add_argument("--layers", type=int, default=8)
ap.add_argument("--out", required=True)
a = ap.parse_args()

import torch  # noqa: E402

stop = False
signal.signal(signal.SIGTERM, lambda *_: globals().__setitem__("stop", True))
dev = torch.device("cuda")
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(a.width, a.width), torch.nn.GELU()) for _ in range(a.layers)]).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
x = torch.randn(a.batch, a.width, device=dev)
for _ in range(3):  # warm-up
    model(x).square().mean().backward(); opt.step(); opt.zero_grad()
torch.cuda.synchronize()
start = time.time(); steps = 0
while not stop and (a.duration <= 0 or time.time() - start < a.duration):
    model(x).square().mean().backward()
    opt.step(); opt.zero_grad()
    steps += 1
    if steps % 4 == 0:
        torch.cuda.synchronize()  # bound the queued work, as a real training loop's logging does
torch.cuda.synchronize()
el = time.time() - start
json.dump({"steps": steps, "elapsed_s": el, "steps_per_s": steps / el}, open(a.out, "w"))
