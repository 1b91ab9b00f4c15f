#!/usr/bin/env python3
"""Offline job on a real GPU: training steps of a model large enough to keep the GPU busy,
until SIGTERM or --duration. Writes JSON (always: in a `finally`, with "error" if it
failed): steps, steps/s over its whole loop, and a timeline of (CLOCK_MONOTONIC seconds,
steps done) at every synchronisation, so a harness can take its throughput over another
process's window. --ready FILE is created once the warm-up steps have finished on the GPU.
Needs PyTorch with CUDA."""
import argparse, json, os, signal, sys, time, traceback

# Signal handlers before `import torch`: a SIGTERM during the import (seconds) must still
# end with the JSON written.
stop = False


def _stop(*_):
    global stop
    stop = True


for _s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(_s, _stop)

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--duration", type=float, default=0.0, help="seconds (0: until SIGTERM)")
ap.add_argument("--batch", type=int, default=64)
ap.add_argument("--width", type=int, default=8192)
ap.add_argument("--layers", type=int, default=8)
ap.add_argument("--ready", help="file to create once warm-up is done on the GPU")
ap.add_argument("--kernel-profile", type=int, default=0, metavar="STEPS",
                help="after the warm-up, time every CUDA kernel of this many steps with torch.profiler "
                     "and write their durations' summary as \"kernels\" (what online's request meets "
                     "when it arrives while this loop runs: the simulated GPU's offline kernel is set from it)")
ap.add_argument("--out", required=True)
a = ap.parse_args()

def kernel_profile(torch, model, opt, x, steps):
    """Durations of the CUDA kernels of `steps` training steps (µs): how many per step, their
    percentiles, and the time-weighted median (the kernel a request arriving at a random
    moment of the loop's GPU time finds running)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
    # Each kernel is an event of its own with the device's type; its time range is its run.
    cuda = torch.autograd.DeviceType.CUDA
    us = sorted(d for d in (e.time_range.elapsed_us() for e in prof.events() if getattr(e, "device_type", None) == cuda) if d > 0)
    if not us:
        return {"error": "the profiler saw no CUDA kernel"}
    total = sum(us)
    acc, weighted = 0.0, us[-1]
    for d in us:
        acc += d
        if acc >= total / 2:
            weighted = d
            break
    q = lambda f: us[min(len(us) - 1, int(f * len(us)))]
    return {"steps": steps, "per_step": len(us) / steps, "gpu_ms_per_step": total / steps / 1000,
            "p50_us": q(0.5), "p90_us": q(0.9), "max_us": us[-1], "time_weighted_p50_us": weighted}


res = {"steps": 0, "elapsed_s": 0.0, "steps_per_s": None, "phase": "import", "clock": "monotonic", "timeline": []}
t_launch = time.monotonic()
try:
    import torch

    res["phase"] = "init"
    if not stop:
        dev = torch.device("cuda")
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(a.width, a.width), torch.nn.GELU()) for _ in range(a.layers)]).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        x = torch.randn(a.batch, a.width, device=dev)
        for _ in range(3):  # warm-up
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        if a.kernel_profile > 0 and not stop:
            res["kernels"] = kernel_profile(torch, model, opt, x, a.kernel_profile)
        res["startup_s"] = time.monotonic() - t_launch
        if a.ready:
            with open(a.ready, "w") as f:
                f.write(f"{time.monotonic()}\n")
        res["phase"] = "run"
        start = time.monotonic()
        steps = 0
        timeline = res["timeline"]
        timeline.append([start, 0])
        while not stop and (a.duration <= 0 or time.monotonic() - start < a.duration):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            steps += 1
            if steps % 4 == 0:
                torch.cuda.synchronize()  # bound the queued work, as a real training loop's logging does
                timeline.append([time.monotonic(), steps])
        torch.cuda.synchronize()
        end = time.monotonic()
        timeline.append([end, steps])
        res.update(steps=steps, elapsed_s=end - start, steps_per_s=steps / max(end - start, 1e-9), phase="done")
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
