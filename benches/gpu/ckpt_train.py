#!/usr/bin/env python3
"""A training loop whose results can be compared across a driver checkpoint: seeded,
deterministic (torch.use_deterministic_algorithms), with --gb of extra device memory (a
"ballast" of seeded random numbers) so that the checkpoint moves a known amount.

Until SIGTERM or --max-steps: training steps, a synchronisation every 4 steps (the
timeline), and every --check-every steps a checksum of the parameters (float64 sum of
every parameter's bits as int64, exact and independent of summation order). At the end
the ballast's checksum again, beside the one taken when it was written. Writes JSON
(always, in a `finally`; "error" if it failed): steps, timeline [[CLOCK_MONOTONIC s,
steps]], checks [[step, checksum]], ballast_before, ballast_after, ballast_bytes,
allocated_bytes. --ready FILE once the warm-up and the ballast are on the GPU.

Two runs with the same model arguments give the same checksums at the same steps; a run
that was locked, checkpointed, restored and unlocked mid-way must too. Needs PyTorch with
CUDA."""
import argparse, json, os, signal, sys, time, traceback

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
stop = False


def _stop(*_):
    global stop
    stop = True


for _s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(_s, _stop)

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--gb", type=float, default=0.0, help="extra device memory (GB = 1e9 bytes), seeded random float32")
ap.add_argument("--batch", type=int, default=64)
ap.add_argument("--width", type=int, default=4096)
ap.add_argument("--layers", type=int, default=4)
ap.add_argument("--check-every", type=int, default=20)
ap.add_argument("--max-steps", type=int, default=0, help="0: until SIGTERM")
ap.add_argument("--ready", help="file to create once warm-up and ballast are on the GPU")
ap.add_argument("--out", required=True)
a = ap.parse_args()

CHUNK = 1 << 26  # float32 elements per ballast tensor (256 MiB)
res = {"steps": 0, "phase": "import", "clock": "monotonic", "timeline": [], "checks": [], "gb": a.gb}


def bits_sum(t):
    """Exact checksum of a float32 tensor: its bits as int32, summed as int64."""
    return int(t.contiguous().view(-1).view(torch.int32).to(torch.int64).sum().item())


try:
    import torch

    res["phase"] = "init"
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(a.width, a.width), torch.nn.GELU()) for _ in range(a.layers)]).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator(device=dev)
    g.manual_seed(1)
    x = torch.randn(a.batch, a.width, device=dev, generator=g)
    ballast, left = [], int(a.gb * 1e9) // 4
    while left > 0 and not stop:
        n = min(CHUNK, left)
        ballast.append(torch.randn(n, device=dev, generator=g))
        left -= n
    res["ballast_bytes"] = sum(b.numel() * 4 for b in ballast)
    res["ballast_before"] = sum(bits_sum(b) for b in ballast)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    def params_sum():
        return sum(bits_sum(p.detach()) for p in model.parameters())

    torch.cuda.synchronize()
    res["allocated_bytes"] = torch.cuda.memory_allocated()
    res["checks"].append([0, params_sum()])
    if a.ready:
        with open(a.ready, "w") as f:
            f.write(f"{time.monotonic()}\n")
    res["phase"] = "run"
    steps, timeline = 0, res["timeline"]
    timeline.append([time.monotonic(), 0])
    while not stop and (a.max_steps <= 0 or steps < a.max_steps):
        step()
        steps += 1
        if steps % a.check_every == 0:
            res["checks"].append([steps, params_sum()])
        if steps % 4 == 0:
            torch.cuda.synchronize()
            timeline.append([time.monotonic(), steps])
            res["steps"] = steps
    torch.cuda.synchronize()
    timeline.append([time.monotonic(), steps])
    res["steps"] = steps
    res["ballast_after"] = sum(bits_sum(b) for b in ballast)
    res["phase"] = "done"
except BaseException:
    res["error"] = traceback.format_exc()[-3000:]
    raise
finally:
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f)
    os.replace(tmp, a.out)
sys.exit(0)
