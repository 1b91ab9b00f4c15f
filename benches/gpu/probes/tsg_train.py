#!/usr/bin/env python3
"""A training loop (offline.py's model) that sets its own channel groups' time slice.

Run with LD_PRELOAD=libcoloc_tsg_hook.so (tsg_hook.c) and --hook naming the same file.
After the warm-up it reads, through the hook, the channel groups its CUDA context
allocated and each one's time slice (NVA06C_CTRL_CMD_GET_TIMESLICE), and writes them to
--ready (JSON). Then it trains until SIGTERM, and between steps carries out the command
the harness writes to --command (JSON {"seq": N, "op": ...}), answering in --ack:
  {"op": "min", "candidates": [us, ...]}  SET_TIMESLICE on each group with each candidate,
                                         smallest first, until the driver accepts one;
                                         every status, then GET_TIMESLICE
  {"op": "set", "us": N}                 SET_TIMESLICE N on each group, then GET
  {"op": "restore"}                      each group back to the slice it read at start
Writes JSON (always, in a `finally`): steps, steps/s, the timeline of (CLOCK_MONOTONIC s,
steps) and every command's answer. RM statuses are numbers (0: NV_OK; negative: -errno
of the ioctl itself). Needs PyTorch with CUDA."""
import argparse, ctypes, json, os, signal, sys, time, traceback

stop = False


def _stop(*_):
    global stop
    stop = True


for _s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(_s, _stop)

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--hook", required=True, help="libcoloc_tsg_hook.so (the file LD_PRELOAD loaded)")
ap.add_argument("--batch", type=int, default=512)
ap.add_argument("--width", type=int, default=8192)
ap.add_argument("--layers", type=int, default=8)
ap.add_argument("--ready", required=True, help="file to write the groups and their slices to once warm")
ap.add_argument("--command", help="file the harness writes commands to")
ap.add_argument("--ack", help="file to answer each command in")
ap.add_argument("--out", required=True)
a = ap.parse_args()


def write(path, doc):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


class Hook:
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        self.lib.coloc_tsg_info.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint32)]
        self.lib.coloc_tsg_seen.argtypes = [ctypes.POINTER(ctypes.c_uint32)]
        self.lib.coloc_tsg_get_timeslice.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint64)]
        self.lib.coloc_tsg_set_timeslice.argtypes = [ctypes.c_int, ctypes.c_uint64]

    def groups(self):
        out = []
        for i in range(self.lib.coloc_tsg_count()):
            v = (ctypes.c_uint32 * 4)()
            if self.lib.coloc_tsg_info(i, v) == 0:
                out.append({"index": i, "fd": v[0], "client": hex(v[1]), "parent": hex(v[2]), "object": hex(v[3])})
        return out

    def seen(self):
        v = (ctypes.c_uint32 * 3)()
        self.lib.coloc_tsg_seen(v)
        return {"rm_allocs": v[0], "clients": v[1], "groups_ever": v[2]}

    def get(self, i):
        us = ctypes.c_uint64(0)
        st = self.lib.coloc_tsg_get_timeslice(i, ctypes.byref(us))
        return {"status": st, "us": us.value if st == 0 else None}

    def set(self, i, us):
        t = time.monotonic()
        st = self.lib.coloc_tsg_set_timeslice(i, int(us))
        return {"us": int(us), "status": st, "call_ms": (time.monotonic() - t) * 1e3}


res = {"steps": 0, "steps_per_s": None, "phase": "import", "clock": "monotonic", "timeline": [], "commands": []}
hook = Hook(a.hook)
defaults = {}


def carry_out(cmd):
    ans = {"seq": cmd.get("seq"), "op": cmd.get("op"), "at": time.monotonic(), "groups": []}
    for g in hook.groups():
        i, r = g["index"], {"object": g["object"]}
        if cmd["op"] == "min":
            r["tries"] = []
            for us in sorted(cmd["candidates"]):
                t = hook.set(i, us)
                r["tries"].append(t)
                if t["status"] == 0:
                    r["accepted_us"] = us
                    break
        elif cmd["op"] == "set":
            r["set"] = hook.set(i, cmd["us"])
        elif cmd["op"] == "restore":
            d = defaults.get(g["object"])
            r["set"] = hook.set(i, d) if d is not None else {"status": None, "note": "no slice read at start"}
        r["get_after"] = hook.get(i)
        ans["groups"].append(r)
    return ans


try:
    import torch

    res["phase"] = "init"
    t_launch = time.monotonic()
    dev = torch.device("cuda")
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(a.width, a.width), torch.nn.GELU()) for _ in range(a.layers)]).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(a.batch, a.width, device=dev)
    for _ in range(3):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    res["startup_s"] = time.monotonic() - t_launch
    groups = hook.groups()
    for g in groups:
        g["timeslice"] = hook.get(g["index"])
        if g["timeslice"]["status"] == 0:
            defaults[g["object"]] = g["timeslice"]["us"]
    res.update(groups=groups, seen=hook.seen(), pid=os.getpid())
    write(a.ready, {"groups": groups, "seen": res["seen"], "pid": os.getpid()})
    res["phase"] = "run"
    start, steps, last_seq = time.monotonic(), 0, None
    res["timeline"].append([start, 0])
    while not stop:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        steps += 1
        if steps % 4 == 0:
            torch.cuda.synchronize()
            res["timeline"].append([time.monotonic(), steps])
            if a.command and os.path.exists(a.command):
                try:
                    with open(a.command) as f:
                        cmd = json.load(f)
                except ValueError:
                    cmd = None
                if cmd and cmd.get("seq") != last_seq:
                    last_seq = cmd.get("seq")
                    ans = carry_out(cmd)
                    res["commands"].append(ans)
                    write(a.ack, ans)
    torch.cuda.synchronize()
    end = time.monotonic()
    res["timeline"].append([end, steps])
    res.update(steps=steps, steps_per_s=steps / max(end - start, 1e-9), phase="done")
except BaseException:
    res["error"] = traceback.format_exc()[-3000:]
    raise
finally:
    write(a.out, res)
sys.exit(0)
