#!/usr/bin/env python3
"""The channel-group hook (tsg_hook.c) against a fake RM device, no GPU needed.

A child process, preloaded with the hook and then the fake RM (tsg_fake_rm.c), plays
libcuda: it issues NV_ESC_RM_ALLOC / NV_ESC_RM_FREE ioctls with the driver's structures,
packed here with `struct` (not from the C headers), on fake devices, then calls the
hook's exported functions. Checked: which allocations the hook records (channel groups on
the control device that succeeded; not a failed one, not one on another device, not a
freed one; the XFER form too), and the controls it issues, byte for byte from the fake's
log: the ioctl request word, the NVOS54 fields and the timeslice parameter, on each
group's own descriptor.

Layouts (from NVIDIA's open kernel modules 595.45.04, commit
df1c9a3de2be4b130f4fc7680f7198193d8ac6ad; gVisor's pkg/abi/nvgpu/frontend.go agrees):
  NVOS21_PARAMETERS (src/common/sdk/nvidia/inc/nvos.h): hRoot, hObjectParent,
      hObjectNew, hClass (u32 each), pAllocParms (u64), paramsSize, status (u32): 32 bytes
  NVOS64_PARAMETERS (nvos.h): the same four handles, pAllocParms, pRightsRequested (u64),
      paramsSize, flags, status (u32), 4 bytes of padding: 48 bytes
  NVOS00_PARAMETERS (nvos.h): hRoot, hObjectParent, hObjectOld, status: 16 bytes
  NVOS54_PARAMETERS (nvos.h): hClient, hObject, cmd, flags (u32), params (u64),
      paramsSize, status (u32): 32 bytes
  nv_ioctl_xfer_t (kernel-open/common/inc/nv-ioctl.h): cmd, size (u32), ptr (u64): 16 bytes
  NVA06C_CTRL_TIMESLICE_PARAMS (src/common/sdk/nvidia/inc/ctrl/ctrla06c.h): timesliceUs (u64)
  Escapes (src/nvidia/arch/nvalloc/unix/include/nv_escape.h): RM_FREE 0x29, RM_CONTROL 0x2A,
      RM_ALLOC 0x2B; NV_ESC_IOCTL_XFER_CMD 211 (kernel-open/common/inc/nv-ioctl-numbers.h);
      the request word _IOWR('F', nr, size) as libcuda issues it.
  Commands (ctrla06c.h): SET_TIMESLICE 0xa06c0103, GET_TIMESLICE 0xa06c0104; class
      KEPLER_CHANNEL_GROUP_A 0xA06C (class/cla06c.h).

  python3 benches/gpu/probes/tsg_check.py            # builds both with cc; exit 1 on a failed check
"""
import json, os, shutil, struct, subprocess, sys, tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
HOOK_SRC = os.path.join(HERE, "tsg_hook.c")
FAKE_SRC = os.path.join(HERE, "tsg_fake_rm.c")


def iowr(nr, size):
    """_IOWR('F', nr, size) on Linux: direction read|write (3) << 30, size << 16, type << 8, nr."""
    return (3 << 30) | (size << 16) | (ord("F") << 8) | nr


ESC_FREE, ESC_CONTROL, ESC_ALLOC, ESC_XFER = 0x29, 0x2A, 0x2B, 200 + 11
GROUP, DEVICE, CLIENT = 0xA06C, 0x0080, 0x0041
GET, SET = 0xA06C0104, 0xA06C0103


def build(src, out, cc=None):
    """cc -O2 -shared -fPIC: (path, None) or (None, why)."""
    cc = cc or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None, "no C compiler (cc or gcc) on PATH"
    p = subprocess.run([cc, "-O2", "-Wall", "-shared", "-fPIC", "-o", out, src, "-ldl", "-lpthread"],
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        return None, f"{cc} failed on {os.path.basename(src)}: {p.stderr.strip()[-800:]}"
    return out, None


# The child: libcuda's part, through ctypes (the preloaded hook's ioctl comes first).
CHILD = r'''
import ctypes, json, os, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
d = sys.argv[1]
IOWR = lambda nr, size: (3 << 30) | (size << 16) | (ord("F") << 8) | nr
keep = []
def call(fd, nr, fmt, *fields, xfer=False):
    buf = ctypes.create_string_buffer(struct.pack(fmt, *fields), struct.calcsize(fmt))
    keep.append(buf)
    if xfer:
        x = ctypes.create_string_buffer(struct.pack("<IIQ", nr, len(buf.raw), ctypes.addressof(buf)), 16)
        keep.append(x)
        rc = libc.ioctl(fd, IOWR(211, 16), ctypes.addressof(x))
    else:
        rc = libc.ioctl(fd, IOWR(nr, len(buf.raw)), ctypes.addressof(buf))
    return rc, struct.unpack(fmt, buf.raw)
OS21, OS64, OS00 = "<IIIIQII", "<IIIIQQIIII", "<IIII"
out = {}
ctl = os.open(os.path.join(d, "nvidiactl"), os.O_RDWR)
ctl2 = os.open(os.path.join(d, "nvidiactl"), os.O_RDWR)
other = os.open(os.path.join(d, "nvidia0"), os.O_RDWR)
_, c1 = call(ctl, 0x2B, OS21, 0, 0, 0, 0x41, 0, 0, 0)
client = c1[0]
_, dv = call(ctl, 0x2B, OS64, client, client, 0, 0x80, 0, 0, 0, 0, 0, 0)
dev = dv[2]
out["a"] = call(ctl, 0x2B, OS64, client, dev, 0xcaf00001, 0xA06C, 0, 0, 0, 0, 0, 0)
out["b"] = call(ctl, 0x2B, OS21, client, dev, 0xcaf00002, 0xA06C, 0, 0, 0, xfer=True)
out["failed"] = call(ctl, 0x2B, OS64, client, dev, 0xbad00bad, 0xA06C, 0, 0, 0, 0, 0, 0)
out["other_device"] = call(other, 0x2B, OS64, client, dev, 0xcaf00004, 0xA06C, 0, 0, 0, 0, 0, 0)
_, c2 = call(ctl2, 0x2B, OS21, 0, 0, 0, 0x41, 0, 0, 0)
out["d"] = call(ctl2, 0x2B, OS64, c2[0], c2[0], 0xcaf00003, 0xA06C, 0, 0, 0, 0, 0, 0)
out["free_b"] = call(ctl, 0x29, OS00, client, dev, 0xcaf00002, 0)
hook = ctypes.CDLL(sys.argv[2])
n = hook.coloc_tsg_count()
groups = []
for i in range(n):
    info = (ctypes.c_uint32 * 4)()
    hook.coloc_tsg_info(i, info)
    us = ctypes.c_uint64(0)
    hook.coloc_tsg_get_timeslice.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint64)]
    hook.coloc_tsg_set_timeslice.argtypes = [ctypes.c_int, ctypes.c_uint64]
    g = {"fd": info[0], "client": info[1], "parent": info[2], "object": info[3]}
    g["get"] = [hook.coloc_tsg_get_timeslice(i, ctypes.byref(us)), us.value]
    g["set_50"] = hook.coloc_tsg_set_timeslice(i, 50)
    g["set_1000"] = hook.coloc_tsg_set_timeslice(i, 1000)
    g["get_after"] = [hook.coloc_tsg_get_timeslice(i, ctypes.byref(us)), us.value]
    groups.append(g)
seen = (ctypes.c_uint32 * 3)()
hook.coloc_tsg_seen(seen)
hook.coloc_tsg_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
out.update(client=client, client2=c2[0], device=dev, fds=[ctl, ctl2, other], count=n, groups=groups, seen=list(seen),
           out_of_range=[hook.coloc_tsg_set_timeslice(n, 1000), hook.coloc_tsg_info(n, ctypes.addressof(ctypes.create_string_buffer(16)))])
print("RESULT " + json.dumps(out))
'''


def run(hook, fake, work):
    """Runs the child against fake devices in `work`; {"checks": {name: bool}, "ok": bool, ...}."""
    dev = os.path.join(work, "fake-rm")
    os.makedirs(dev, exist_ok=True)
    for n in ("nvidiactl", "nvidia0"):
        open(os.path.join(dev, n), "w").close()
    log = os.path.join(work, "fake-rm.log")
    if os.path.exists(log):
        os.remove(log)
    env = dict(os.environ, LD_PRELOAD=f"{hook} {fake}", COLOC_TSG_CTL=os.path.join(dev, "nvidiactl"),
               COLOC_TSG_FAKE_DIR=dev, COLOC_TSG_FAKE_LOG=log, COLOC_TSG_FAKE_MIN_US="100")
    p = subprocess.run([sys.executable, "-c", CHILD, dev, hook], capture_output=True, text=True, timeout=60, env=env,
                       stdin=subprocess.DEVNULL)
    res = {"rc": p.returncode, "stderr": p.stderr[-1500:]}
    line = next((l for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        res.update(ok=False, checks={"the child ran": False})
        return res
    r = json.loads(line[7:])
    with open(log) if os.path.exists(log) else open(os.devnull) as f:
        controls = [l.split() for l in f if l.strip()]
    res.update(result=r, controls=controls)
    ctl, ctl2, _ = r["fds"]
    by = {g["object"]: g for g in r["groups"]}
    a, d = by.get(0xCAF00001, {}), by.get(0xCAF00003, {})
    c = {
        "every alloc answered (status 0), the failed one 0x1f": all(r[k][0] == 0 and r[k][1][-2] == 0 for k in ("a", "d"))
        and r["b"][0] == 0 and r["b"][1][-1] == 0 and r["failed"][0] == 0 and r["failed"][1][-2] == 0x1F,
        "recorded: the two live groups on the control device (not the failed one, not one on another device, not the freed one)":
            r["count"] == 2 and sorted(by) == [0xCAF00001, 0xCAF00003],
        "group a: its client, its parent (the device), its descriptor": a.get("client") == r["client"] and a.get("parent") == r["device"] and a.get("fd") == ctl,
        "group d: the second client, on the second descriptor": d.get("client") == r["client2"] and d.get("fd") == ctl2,
        "seen: 6 allocs on the control device (the XFER one included), 2 clients, 3 groups ever": r["seen"] == [6, 2, 3],
        "GET_TIMESLICE answered NV_OK with the group's slice": all(g["get"] == [0, 2048] for g in r["groups"]),
        "SET_TIMESLICE under the minimum: the RM's status (0x1f) returned": all(g["set_50"] == 0x1F for g in r["groups"]),
        "SET_TIMESLICE 1000 us: NV_OK, read back": all(g["set_1000"] == 0 and g["get_after"] == [0, 1000] for g in r["groups"]),
        "no group i: -ERANGE": r["out_of_range"] == [-34, -34],
    }
    # The controls, byte for byte: 4 per group (get, set 50, set 1000, get).
    want = []
    for g, fd in ((a, ctl), (d, ctl2)):
        for cmd, us in ((GET, 0), (SET, 50), (SET, 1000), (GET, 0)):
            want.append((fd, g.get("client"), g.get("object"), cmd, us))
    got_ok = len(controls) == len(want)
    for (fd, client, obj, cmd, us), row in zip(want, controls):
        if len(row) != 4:
            got_ok = False
            break
        raw = bytes.fromhex(row[2])
        h_client, h_obj, h_cmd, flags, ptr, size, status = struct.unpack("<IIIIQII", raw)
        param = bytes.fromhex(row[3])
        got_ok &= (int(row[0]) == fd and int(row[1], 16) == iowr(ESC_CONTROL, 32) and len(raw) == 32 and (h_client, h_obj, h_cmd, flags, size, status) == (client, obj, cmd, 0, 8, 0)
                   and ptr != 0 and (cmd == GET or param == struct.pack("<Q", us)))
    c["controls byte for byte: _IOWR('F', 0x2A, 32) = 0xc020462a, NVOS54 {client, group, cmd, flags 0, params, 8, status 0}, timesliceUs, each on its group's descriptor"] = got_ok
    res.update(checks=c, ok=all(c.values()) and p.returncode == 0)
    return res


def main():
    work = tempfile.mkdtemp(prefix="coloc-tsg-check-")
    try:
        hook, why = build(HOOK_SRC, os.path.join(work, "libcoloc_tsg_hook.so"))
        fake, why2 = build(FAKE_SRC, os.path.join(work, "libtsg_fake_rm.so")) if hook else (None, None)
        if not hook or not fake:
            print(f"cannot build: {why or why2}", file=sys.stderr)
            sys.exit(2)
        res = run(hook, fake, work)
        for k, v in res["checks"].items():
            print(f"{'ok  ' if v else 'FAIL'} {k}")
        if not res["ok"]:
            print(json.dumps({k: res.get(k) for k in ("rc", "stderr", "result", "controls")}, indent=1), file=sys.stderr)
        sys.exit(0 if res["ok"] else 1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
