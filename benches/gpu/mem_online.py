#!/usr/bin/env python3
"""Online work that needs GPU memory: a service starting beside offline work that holds
the memory it needs. It tries to allocate --go's amount every --retry-ms until an
allocation succeeds (the agent's memory preemption has checkpointed offline work by then)
or --deadline-s passes, then holds the memory for --hold-s, touching it, frees it and exits.

Phases: import (PyTorch; nothing with --driver-api) -> --ready FILE -> waits for --go FILE,
whose content is the GiB to allocate (written by the harness once it knows how much cannot
fit beside offline) -> CUDA context -> allocation attempts -> held -> freed.

The allocation is one PyTorch tensor (one cudaMalloc of the whole amount), written once
(a fill) and read every 100 ms while held; the context's creation runs a first kernel. With
--driver-api the process reaches the CUDA driver through ctypes (libcuda.so.1: cuInit, the
primary context, cuMemAlloc_v2), as on the simulated GPU, where PyTorch does not run; its
kernel is the simulated driver's (busy for the nanoseconds of its first parameter, any
module image), --touch-ms long, after the context's creation and every 100 ms while held.

Writes JSON (always: in a `finally`, with "error" if it failed), times in CLOCK_MONOTONIC
seconds: gib, bytes, context_s (the context's creation), first_attempt_mono, ok_mono,
wait_s (first attempt -> success), attempts, first_error, free/total bytes as the process
saw them (cudaMemGetInfo: at the first attempt, after success, and every 250 ms while it
waited), held_until_mono, exit_mono (and exit_wall_s, CLOCK_REALTIME, to match the agent's
event log). Exits 3 if no allocation succeeded."""
import argparse, ctypes, json, os, signal, sys, time, traceback

stop = False


def _stop(*_):
    global stop
    stop = True


for _s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(_s, _stop)

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--go", required=True, help="file to wait for; its content: the GiB to allocate")
ap.add_argument("--ready", help="file to create once the imports are done (before any CUDA call)")
ap.add_argument("--retry-ms", type=float, default=5.0, help="pause between allocation attempts")
ap.add_argument("--deadline-s", type=float, default=60.0, help="give up this long after the first attempt")
ap.add_argument("--hold-s", type=float, default=3.0, help="how long the memory is held once allocated")
ap.add_argument("--go-timeout-s", type=float, default=300.0, help="give up waiting for --go after this long")
ap.add_argument("--driver-api", action="store_true", help="ctypes on libcuda.so.1 instead of PyTorch")
ap.add_argument("--touch-ms", type=float, default=20.0, help="--driver-api: the simulated kernel's length")
ap.add_argument("--out", required=True)
a = ap.parse_args()

GIB = 1 << 30
res = {"phase": "import", "clock": "monotonic", "driver_api": a.driver_api, "attempts": 0, "free_timeline": []}
t_launch = time.monotonic()


class Stopped(Exception):
    """SIGTERM before the go file came: nothing to do."""


class Driver:
    """The CUDA driver API through ctypes: what --driver-api needs, nothing more."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.check("cuInit", self.lib.cuInit(0))
        dev = ctypes.c_int()
        self.check("cuDeviceGet", self.lib.cuDeviceGet(ctypes.byref(dev), 0))
        ctx = ctypes.c_void_p()
        self.check("cuDevicePrimaryCtxRetain", self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
        self.check("cuCtxSetCurrent", self.lib.cuCtxSetCurrent(ctx))
        self.lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
        self.lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]
        image = ctypes.create_string_buffer(b"mem_online kernel")  # any image will do for the simulated driver
        mod, self.func = ctypes.c_void_p(), ctypes.c_void_p()
        self.check("cuModuleLoadData", self.lib.cuModuleLoadData(ctypes.byref(mod), image))
        self.check("cuModuleGetFunction", self.lib.cuModuleGetFunction(ctypes.byref(self.func), mod, b"busy"))
        self.lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]

    def kernel(self, ms):
        """A kernel busy for `ms` on the default stream, waited for."""
        ns = ctypes.c_uint64(int(ms * 1e6))
        params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(ns), ctypes.c_void_p))
        self.check("cuLaunchKernel", self.lib.cuLaunchKernel(self.func, 1, 1, 1, 1, 1, 1, 0, None, params, None))
        self.check("cuCtxSynchronize", self.lib.cuCtxSynchronize())

    def name(self, code):
        s = ctypes.c_char_p()
        self.lib.cuGetErrorName(code, ctypes.byref(s))
        return s.value.decode() if s.value else str(code)

    def check(self, what, code):
        if code != 0:
            raise RuntimeError(f"{what}: {self.name(code)} ({code})")

    def alloc(self, n):
        """The device pointer, or the error's name."""
        p = ctypes.c_uint64()
        code = self.lib.cuMemAlloc_v2(ctypes.byref(p), n)
        return (p.value, None) if code == 0 else (None, self.name(code))

    def free(self, p):
        self.check("cuMemFree_v2", self.lib.cuMemFree_v2(p))


try:
    torch = None
    if not a.driver_api:
        import torch
    res["import_s"] = time.monotonic() - t_launch
    if a.ready:
        with open(a.ready, "w") as f:
            f.write(f"{time.monotonic()}\n")
    res["phase"] = "waiting for go"
    until = time.monotonic() + a.go_timeout_s
    while not stop and not os.path.exists(a.go):
        if time.monotonic() > until:
            raise RuntimeError(f"no {a.go} after {a.go_timeout_s:g} s")
        time.sleep(0.01)
    if stop:
        res["phase"] = "stopped before go"
        raise Stopped
    with open(a.go) as f:
        gib = float(f.read().strip())
    n = int(gib * GIB)
    res.update(gib=gib, bytes=n, go_mono=time.monotonic())
    res["phase"] = "context"
    t = time.monotonic()
    if torch is not None:
        torch.cuda.init()
        probe = torch.ones(1, device="cuda")  # the context and the allocator
        torch.cuda.synchronize()
        mem_info = torch.cuda.mem_get_info
        drv = None
    else:
        drv = Driver()
        drv.kernel(a.touch_ms)
        mem_info = None
    res["context_s"] = time.monotonic() - t
    res["phase"] = "allocating"
    buf = ptr = None
    first = time.monotonic()
    res["first_attempt_mono"] = first
    if mem_info:
        res["free_total_first"] = list(mem_info())
    last_info = first
    while not stop:
        res["attempts"] += 1
        if torch is not None:
            try:
                buf = torch.empty(n, dtype=torch.uint8, device="cuda")
                err = None
            except torch.cuda.OutOfMemoryError as e:
                err = str(e).splitlines()[0][:300]
        else:
            ptr, err = drv.alloc(n)
        if err is None:
            break
        res.setdefault("first_error", err)
        now = time.monotonic()
        if now - first > a.deadline_s:
            break
        if mem_info and now - last_info >= 0.25:
            res["free_timeline"].append([now, mem_info()[0]])
            last_info = now
        time.sleep(a.retry_ms / 1e3)
    if buf is None and ptr is None:
        res["phase"] = "gave up" if not stop else "stopped"
        res["error"] = f"no allocation of {gib:g} GiB succeeded in {time.monotonic() - first:.1f} s ({res['attempts']} attempts): {res.get('first_error')}"
    else:
        ok = time.monotonic()
        res.update(ok_mono=ok, wait_s=ok - first, phase="held")
        if torch is not None:
            buf.fill_(1)
            torch.cuda.synchronize()
            res["filled_s"] = time.monotonic() - ok
            res["free_total_held"] = list(mem_info())
        until = time.monotonic() + a.hold_s
        while not stop and time.monotonic() < until:
            if torch is not None:
                res["read_sum"] = int(buf[: 1 << 20].sum().item())  # a read of the memory
            else:
                drv.kernel(a.touch_ms)
            time.sleep(0.1)
        res["held_until_mono"] = time.monotonic()
        if torch is not None:
            del buf
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
        else:
            drv.free(ptr)
        res["phase"] = "done" if not stop else "stopped"
except Stopped:
    pass
except BaseException:
    res["error"] = traceback.format_exc()[-3000:]
    raise
finally:
    res["exit_mono"], res["exit_wall_s"] = time.monotonic(), time.time()
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f)
    os.replace(tmp, a.out)
sys.exit(0 if "ok_mono" in res or res["phase"].startswith("stopped") else 3)
