"""The harness's driver probes (steps tsg, timeslice-policy, mps of benches/gpu/run.py):
three mechanisms that might bound how long an offline process's queued work delays
online work, each measured beside a training loop with no agent.

  tsg               the training loop sets its own channel groups' time slice
                    (NVA06C_CTRL_CMD_SET_TIMESLICE through tsg_hook.c): the smallest slice
                    the driver accepts, then burst.py's kernel latency beside the loop at
                    that slice against the default (default, minimum, default again)
  timeslice-policy  `nvidia-smi compute-policy --set-timeslice=N` for each N of
                    --timeslice-values: kernel (burst.py) and request (online.py) latency
                    beside a training loop started after the change; the policy read
                    before is restored at the end, also on failure
  mps               an MPS control daemon (pipe and log directories in the run's temp
                    directory): online and offline as MPS clients, offline plain, with
                    CUDA_MPS_CLIENT_PRIORITY and with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE:
                    online p99 against online alone, offline steps/s; kernel latency while
                    offline runs and while it is SIGSTOPped, offline's first synchronisation
                    after SIGCONT; the
                    driver's lock (cuCheckpointProcessLock) on an MPS client; which PIDs
                    NVML's process list and per-process samples name; the daemon told to
                    quit at the end, also on failure

With --sim the tsg step builds the hook and checks it against a fake RM device
(tsg_check.py) and runs tsg_train.py's command protocol on a stand-in for PyTorch
(fake_torch/) whose "CUDA" allocates through that device; the GPU part is recorded as
skipped. timeslice-policy and mps are skipped ("needs an NVIDIA GPU") with the command
lines they would run.
"""
import hashlib, json, os, shutil, signal, subprocess, sys, time

HERE = os.path.dirname(os.path.abspath(__file__))
GPU = os.path.dirname(HERE)
NEEDS_GPU = "needs an NVIDIA GPU"
LOG = print  # the harness sets its own, and these two:
pct = None
burst_stats = None


def section(h, name):
    p = h.results.get("probes")
    if not isinstance(p, dict):
        p = h.results["probes"] = {}
    p.setdefault("env", environment(h))
    return p.setdefault(name, {})


def environment(h):
    """What the probes ran on: kernel, GPU and driver, compute and MIG mode, CUDA (from
    the preflight's PyTorch), the tools the steps use."""
    e = {"kernel": os.uname().release, "sim": h.sim}
    if not h.sim:
        q = "name,driver_version,vbios_version,compute_mode,mig.mode.current,persistence_mode,clocks.max.sm"
        raw = cmd(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"])
        e["gpu"] = dict(zip(q.split(","), [x.strip() for x in raw["out"].split(",")])) if raw["rc"] == 0 else raw
    torch_r = (((h.results.get("preflight") or {}).get("torch") or {}).get("result")) or {}
    e["torch"] = {k: torch_r.get(k) for k in ("torch", "cuda", "device")} if torch_r else None
    e["tools"] = {t: shutil.which(t) for t in ("cc", "nvidia-smi", "nvidia-cuda-mps-control")}
    return e


def cmd(argv, timeout=20.0, env=None, stdin=None):
    """A short command: {"argv", "rc", "out", "err"}; never raises."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, input=stdin,
                           stdin=None if stdin is not None else subprocess.DEVNULL)
        return {"argv": argv, "rc": p.returncode, "out": p.stdout.strip()[-2000:], "err": p.stderr.strip()[-1000:]}
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"argv": argv, "rc": None, "out": "", "err": f"{type(e).__name__}: {e}"}


def need(step, h):
    """About how long a step takes (s)."""
    a, start = h.a, (2.0 if h.sim else 12.0)  # a workload's start, as the drain step counts it
    burst = start + a.probe_bursts * 1.0 + 3
    online = start + a.probe_online_s + 3
    if step == "tsg":
        return 15.0 if h.sim else burst + start + 3 * burst + 10
    if step == "timeslice-policy":
        return burst + online + len(values(a.timeslice_values)) * (start + burst + online + 5)
    return online + 3 * (start + online + 5) + 2 * start + 2 * burst + 20


def values(spec):
    out = []
    for x in (spec or "").split(","):
        x = x.strip()
        if not x:
            continue
        if x not in ("0", "1", "2", "3"):
            raise SystemExit(f"--timeslice-values: {x!r}: the policy's values are 0 (default), 1 (short), 2 (medium), 3 (long)")
        out.append(int(x))
    return out


def candidates(spec):
    try:
        out = sorted({int(x) for x in (spec or "").split(",") if x.strip()})
    except ValueError:
        out = []
    if not out or out[0] <= 0:
        raise SystemExit(f"--tsg-candidates: {spec!r}: want positive whole numbers of microseconds, comma-separated")
    return out


# ---- shared measurements --------------------------------------------------------------------

def kernels(h, tag, deadline, env=None, base=None, bursts=None):
    """burst.py (bursts of tiny kernels, each waited for): latency p50/p90/p99/max, and the
    drain against `base` (p50, p90, p99 of kernels alone)."""
    out = os.path.join(h.art, f"{tag}-probe.json")
    p = h.spawn("work", f"{tag} probe", h.burst_cmd(out, bursts=bursts or h.a.probe_bursts, burst_ms=300, gap_ms=700), env or h.env, f"{tag}-probe.log")
    try:
        h.wait_exit(p, "probe", deadline)
    finally:
        h.end(p, f"{tag} probe", 5)
    with open(out) as f:
        pj = json.load(f)
    if pj.get("error"):
        raise RuntimeError(f"{tag}: burst.py failed: {pj['error'][-600:]}")
    ks, spans = pj.get("kernels") or [], pj.get("bursts") or []
    if not ks:
        raise RuntimeError(f"{tag}: burst.py ran no kernel: {h_tail(h, tag + '-probe.log')}")
    lat = [k[1] for k in ks]
    r = {"kernels": len(lat), "latency_ms": [pct(lat, 50), pct(lat, 90), pct(lat, 99), max(lat)], "window": [spans[0][0], spans[-1][1]] if spans else None}
    if base:
        st = burst_stats(ks, spans, base)
        r.update({k: st.get(k) for k in ("threshold_ms", "drain_ms", "drain_n", "drain_not_ended", "delay_ms", "first_kernel_ms")})
    pj["kernels"] = [k for i, k in enumerate(ks) if i % 50 == 0 or k[1] > 2 * r["latency_ms"][0]]
    with open(out, "w") as f:
        json.dump(pj, f)
    return r


def requests(h, tag, deadline, env=None):
    """online.py for --probe-online-s at --rate: request latency p50/p99/max."""
    out = os.path.join(h.art, f"{tag}-online.json")
    p = h.spawn("work", f"{tag} online", h.online_cmd(out, duration=h.a.probe_online_s), env or h.env, f"{tag}-online.log")
    try:
        h.wait_exit(p, "online", deadline)
    finally:
        h.end(p, f"{tag} online", 5)
    with open(out) as f:
        j = json.load(f)
    if j.get("error") or not j.get("requests"):
        raise RuntimeError(f"{tag}: online.py served no request: {(j.get('error') or h_tail(h, tag + '-online.log'))[-600:]}")
    return {"requests": j["requests"], "p50_ms": j.get("p50_ms"), "p99_ms": j.get("p99_ms"), "max_ms": j.get("max_ms"), "window": j.get("window_mono_s"), "pid": p.pid}


def h_tail(h, name, n=600):
    """The end of an artifact (a process's log)."""
    import shim_check
    return shim_check.tail(os.path.join(h.art, name), n)


def rate(path, window):
    """Training steps per second inside `window` (monotonic s) from a loop's timeline."""
    try:
        with open(path) as f:
            tl = json.load(f).get("timeline") or []
    except (OSError, ValueError):
        return None
    if not window or len(tl) < 2:
        return None
    inside = [(t, s) for t, s in tl if window[0] <= t <= window[1]]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def ratio(x, y):
    return x / y if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y else None


# ---- probe a: the channel group's time slice ----------------------------------------------

def hook_lib(h):
    """The hook's shared library: --tsg-hook if given, else built here with cc, else a
    prebuilt BIN/libcoloc_tsg_hook.so. (path, how)."""
    import tsg_check
    if h.a.tsg_hook:
        if not os.path.isfile(h.a.tsg_hook):
            raise RuntimeError(f"--tsg-hook {h.a.tsg_hook}: no such file")
        return os.path.abspath(h.a.tsg_hook), "--tsg-hook"
    path, why = tsg_check.build(tsg_check.HOOK_SRC, os.path.join(h.tmp, "libcoloc_tsg_hook.so"))
    if path:
        return path, "built here with cc"
    pre = os.path.join(h.bin, "libcoloc_tsg_hook.so")
    if os.path.isfile(pre):
        return pre, f"prebuilt {pre} ({why})"
    raise RuntimeError(f"no channel-group hook: {why}, and no prebuilt one (--tsg-hook or {pre}). Build it on any x86-64 Linux "
                       "machine: cc -O2 -shared -fPIC -o libcoloc_tsg_hook.so benches/gpu/probes/tsg_hook.c -ldl -lpthread")


class Loop:
    """tsg_train.py under the hook, and its command file."""

    def __init__(self, h, tag, hook, env=None):
        self.h, self.tag, self.seq = h, tag, 0
        self.ready, self.command, self.ack = (os.path.join(h.tmp, f"{tag}-{x}") for x in ("ready", "command", "ack"))
        self.out = os.path.join(h.art, f"{tag}-train.json")
        argv = [sys.executable, os.path.join(HERE, "tsg_train.py"), "--hook", hook, "--ready", self.ready, "--command", self.command,
                "--ack", self.ack, "--out", self.out]
        e = dict(env or h.env)
        e["LD_PRELOAD"] = (hook + " " + e["LD_PRELOAD"]).strip() if e.get("LD_PRELOAD") else hook
        self.p = h.spawn("work", f"{tag} train", argv, e, f"{tag}-train.log")

    def wait_ready(self, deadline, timeout=None):
        limit = min(deadline, time.monotonic() + (timeout or self.h.a.ready_timeout))
        while not os.path.exists(self.ready):
            if self.p.poll() is not None:
                raise RuntimeError(f"tsg_train.py exited {self.p.returncode} before it was ready: {h_tail(self.h, self.tag + '-train.log', 1500)}")
            if time.monotonic() > limit:
                raise RuntimeError(f"tsg_train.py not ready: {h_tail(self.h, self.tag + '-train.log', 1500)}")
            time.sleep(0.1)
        with open(self.ready) as f:
            return json.load(f)

    def send(self, doc, deadline, timeout=30.0):
        self.seq += 1
        doc = dict(doc, seq=self.seq)
        tmp = self.command + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, self.command)
        limit = min(deadline, time.monotonic() + timeout)
        while time.monotonic() < limit:
            try:
                with open(self.ack) as f:
                    ans = json.load(f)
                if ans.get("seq") == self.seq:
                    return ans
            except (OSError, ValueError):
                pass
            if self.p.poll() is not None:
                raise RuntimeError(f"tsg_train.py exited {self.p.returncode}: {h_tail(self.h, self.tag + '-train.log', 1500)}")
            time.sleep(0.05)
        raise RuntimeError(f"tsg_train.py did not answer {doc} within {timeout:g} s")

    def stop(self):
        return self.h.end(self.p, f"{self.tag} train", 20)


def tsg(h, deadline):
    T = section(h, "tsg")
    hook, how = hook_lib(h)
    with open(hook, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    T.update(hook=how, hook_sha256=sha, candidates_us=candidates(h.a.tsg_candidates))
    if h.sim:
        return tsg_sim(h, T, hook, deadline)
    T["baseline"] = kernels(h, "tsg-alone", deadline)
    base = T["baseline"]["latency_ms"][:3]
    loop = Loop(h, "tsg", hook)
    try:
        ready = loop.wait_ready(deadline)
        T.update(groups=ready["groups"], seen=ready["seen"])
        defaults = sorted({g["timeslice"].get("us") for g in ready["groups"] if g["timeslice"]["status"] == 0} - {None})
        T["default_us"] = defaults
        T["phases"] = []

        def phase(name, setting):
            r = kernels(h, f"tsg-{name}", deadline, base=base)
            r.update(phase=name, setting=setting)
            T["phases"].append(r)
            h.save()
            return r

        phase("default", "as the driver set it")
        if ready["groups"]:
            T["min"] = loop.send({"op": "min", "candidates": T["candidates_us"]}, deadline)
            accepted = [g.get("accepted_us") for g in T["min"]["groups"]]
            T["accepted_us"] = accepted
            if any(x is not None for x in accepted):
                phase("minimum", f"{min(x for x in accepted if x is not None)} us")
            T["restore"] = loop.send({"op": "restore"}, deadline)
            phase("default again", "restored")
    finally:
        loop.stop()
    for r in T["phases"]:
        r["offline_steps_per_s"] = rate(loop.out, r.pop("window", None))
    T["verdict"] = tsg_verdict(T)
    LOG(f"  tsg: {T['verdict']}")


def tsg_verdict(T):
    seen, groups = T.get("seen") or {}, T.get("groups") or []
    if not groups:
        return (f"the hook recorded no channel group (RM allocations seen on the control device: {seen.get('rm_allocs')}): "
                "libcuda's ioctls did not pass through the C library's ioctl, or its groups use another class")
    tries = [t for g in (T.get("min") or {}).get("groups", []) for t in g.get("tries", [])]
    ok = [t["us"] for t in tries if t["status"] == 0]
    if not ok:
        st = sorted({t["status"] for t in tries})
        return f"the driver refused SET_TIMESLICE on {len(groups)} group(s) for every candidate (RM status {', '.join(hex(s) if s >= 0 else str(s) for s in st)})"
    ph = {p["phase"]: p for p in T.get("phases") or []}
    d, m, d2 = ph.get("default"), ph.get("minimum"), ph.get("default again")
    moved = ""
    if d and m:
        p99 = ratio(m["latency_ms"][2], d["latency_ms"][2])
        word = "did not move (within 20%)" if p99 is not None and 0.8 <= p99 <= 1.25 else "moved"
        moved = (f"; online kernel latency {word}: p99 beside the loop {m['latency_ms'][2]:.3f} ms at {min(ok)} us against {d['latency_ms'][2]:.3f} ms "
                 f"at the default ({p99:.2f}x" + (f"; default again {d2['latency_ms'][2]:.3f} ms" if d2 else "") + ")")
    elif d:
        moved = "; no phase at the minimum was measured"
    return f"the driver accepted SET_TIMESLICE down to {min(ok)} us (default read back: {T.get('default_us')} us){moved}"


def tsg_sim(h, T, hook, deadline):
    """No GPU: the hook against the fake RM device, and tsg_train.py's protocol on fake_torch."""
    import tsg_check
    fake, why = tsg_check.build(tsg_check.FAKE_SRC, os.path.join(h.tmp, "libtsg_fake_rm.so"))
    if not fake:
        raise RuntimeError(f"cannot build the fake RM device: {why}")
    work = os.path.join(h.tmp, "tsg-check")
    os.makedirs(work, exist_ok=True)
    chk = tsg_check.run(hook, fake, work)
    T["fake_device"] = {"checks": chk["checks"], "ok": chk["ok"]}
    if not chk["ok"]:
        raise RuntimeError(f"the hook failed its checks against the fake RM device: {[k for k, v in chk['checks'].items() if not v]}; {chk.get('stderr', '')[-500:]}")
    dev = os.path.join(work, "fake-rm")
    env = dict(h.env, PYTHONPATH=os.path.join(HERE, "fake_torch"), COLOC_TSG_CTL=os.path.join(dev, "nvidiactl"), COLOC_TSG_FAKE_DIR=dev,
               COLOC_TSG_FAKE_MIN_US="100", LD_PRELOAD=fake)
    env.pop("LD_LIBRARY_PATH", None)
    loop = Loop(h, "tsg-sim", hook, env)  # the hook first, then the fake device
    try:
        ready = loop.wait_ready(deadline, 30)
        T.update(groups=ready["groups"], seen=ready["seen"])
        T["default_us"] = sorted({g["timeslice"].get("us") for g in ready["groups"] if g["timeslice"]["status"] == 0} - {None})
        T["min"] = loop.send({"op": "min", "candidates": T["candidates_us"]}, deadline)
        T["accepted_us"] = [g.get("accepted_us") for g in T["min"]["groups"]]
        T["restore"] = loop.send({"op": "restore"}, deadline)
    finally:
        loop.stop()
    T["gpu_part"] = f"skipped: {NEEDS_GPU} (kernel latency beside the loop at the default and the minimum slice)"
    T["verdict"] = "simulated: " + tsg_verdict(T)
    LOG(f"  tsg (fake RM device): {T['verdict']}")


# ---- probe b: the device's time-slice policy ------------------------------------------------

def policy_cmds(a):
    return {"read": ["nvidia-smi", "compute-policy", "-i", "0", "-l"],
            "set": [["nvidia-smi", "compute-policy", "-i", "0", f"--set-timeslice={v}"] for v in values(a.timeslice_values)],
            "help": ["nvidia-smi", "compute-policy", "-h"]}


def policy_value(text):
    """The timeslice value in `nvidia-smi compute-policy -l`'s output, if it names one."""
    import re
    m = re.search(r"[Tt]ime\s*[Ss]lice[^\d\n]{0,40}?(\d)\b", text or "")
    if m:
        return int(m.group(1))
    names = {"default": 0, "short": 1, "medium": 2, "long": 3}
    m = re.search(r"[Tt]ime\s*[Ss]lice[^\n]{0,30}?\b(default|short|medium|long)\b", text or "", re.I)
    return names[m.group(1).lower()] if m else None


def timeslice_policy(h, deadline):
    P = section(h, "timeslice_policy")
    c = policy_cmds(h.a)
    P["commands"] = c
    P["help"] = cmd(c["help"])
    before = cmd(c["read"])
    P["before"] = before
    restore = policy_value(before["out"])
    P["restore_to"] = restore if restore is not None else 0
    P["restore_basis"] = "read before" if restore is not None else "0 (the default): the value could not be read"
    hook = None
    try:
        hook = hook_lib(h)[0]
    except RuntimeError as e:
        P["hook"] = f"none ({e}): the slice each value gives is not read"
    P["alone"] = {"kernels": kernels(h, "policy-alone", deadline), "requests": requests(h, "policy-alone", deadline)}
    base = P["alone"]["kernels"]["latency_ms"][:3]
    P["rows"] = []
    try:
        for v, argv in zip(values(h.a.timeslice_values), c["set"]):
            row = {"value": v, "set": cmd(argv)}
            P["rows"].append(row)
            row["read"] = cmd(c["read"])["out"][-500:]
            if row["set"]["rc"] != 0:
                row["error"] = f"nvidia-smi refused: {row['set']['err'] or row['set']['out']}"
                continue
            try:
                policy_row(h, row, v, hook, base, deadline)
            except Exception as e:  # noqa: BLE001  (one value: recorded, the others run)
                row["error"] = f"{type(e).__name__}: {e}"[:1500]
            row["p99_vs_alone"] = ratio((row.get("requests") or {}).get("p99_ms"), P["alone"]["requests"]["p99_ms"])
            h.save()
    finally:
        back = cmd(["nvidia-smi", "compute-policy", "-i", "0", f"--set-timeslice={P['restore_to']}"])
        P["restored"] = {"set": back, "read": cmd(c["read"])["out"][-500:]}
        if back["rc"] != 0:
            LOG(f"  timeslice-policy: COULD NOT RESTORE the policy to {P['restore_to']}: {back['err']}")
    bad = [r["value"] for r in P["rows"] if r.get("error")]
    if bad or P["restored"]["set"]["rc"] != 0:
        raise RuntimeError(f"timeslice-policy: values {bad} failed; restore rc {P['restored']['set']['rc']}")


def policy_row(h, row, v, hook, base, deadline):
    """One value: a training loop started after the change (the policy is read when a
    context is made), burst.py and online.py beside it."""
    tag = f"policy-{v}"
    loop = off = None
    try:
        if hook:
            loop = Loop(h, tag, hook)
            ready = loop.wait_ready(deadline)
            row["slices_us"] = sorted({g["timeslice"].get("us") for g in ready["groups"]} - {None})
            out, proc = loop.out, loop.p
        else:
            out, rd = os.path.join(h.art, f"{tag}-offline.json"), os.path.join(h.tmp, f"{tag}-ready")
            off = proc = h.spawn("work", f"{tag} offline", h.offline_cmd(out, rd, "large"), h.env, f"{tag}-offline.log")
            h.wait_ready(off, rd, "offline", f"{tag}-offline.log", deadline)
        row["kernels"] = kernels(h, tag, deadline, base=base)
        row["requests"] = requests(h, tag, deadline)
        if proc.poll() is not None:
            raise RuntimeError(f"the training loop exited {proc.returncode} during the row")
    finally:
        if loop:
            loop.stop()
        h.end(off, f"{tag} offline", 20)
    for k in ("kernels", "requests"):
        row[k]["offline_steps_per_s"] = rate(out, row[k].pop("window", None))


# ---- probe c: MPS ---------------------------------------------------------------------------

def mps_env(h):
    d = os.path.join(h.tmp, "mps")
    return dict(h.env, CUDA_MPS_PIPE_DIRECTORY=os.path.join(d, "pipe"), CUDA_MPS_LOG_DIRECTORY=os.path.join(d, "log"))


def mps_cmds(h):
    e = mps_env(h)
    return {"start": ["nvidia-cuda-mps-control", "-d"], "servers": "echo get_server_list | nvidia-cuda-mps-control",
            "quit": "echo quit | nvidia-cuda-mps-control", "env": {k: e[k] for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")},
            "offline_variants": {"plain": {}, "priority": {"CUDA_MPS_CLIENT_PRIORITY": str(h.a.mps_priority)},
                                 "threads": {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(h.a.mps_thread_pct)}}}


def pids_named(name):
    """PIDs whose program (argv[0]'s base name; /proc/PID/comm is cut at 15 characters,
    which makes the MPS control daemon and server the same) is `name`."""
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    argv0 = f.read().split(b"\0", 1)[0].decode(errors="replace")
            except OSError:
                continue
            if os.path.basename(argv0) == name:
                out.append(int(p))
    return sorted(out)


def nvml_pids(h, seconds):
    """Which PIDs NVML names: the process list (nvidia-smi) and the per-process samples
    (coloc-bench --nvml-watch) over `seconds`."""
    apps = cmd(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"])
    w = cmd([os.path.join(h.bin, "coloc-bench"), "--nvml-watch", "--nvml-lib", h.nvml, "--seconds", str(seconds)], timeout=seconds + 20)
    sampled = {}
    try:
        for s in json.loads(w["out"] or "{}").get("samples") or []:
            k = str(s[0])
            sampled[k] = [sampled.get(k, [0, 0])[0] + 1, sampled.get(k, [0, 0])[1] + (1 if s[2] > 0 else 0)]
    except (ValueError, IndexError, TypeError):
        sampled = {"error": (w["err"] or w["out"])[-300:]}
    return {"compute_apps": apps["out"] if apps["rc"] == 0 else apps, "samples_by_pid": sampled}


def mps(h, deadline):
    import ckpt_step
    M = section(h, "mps")
    c = M["commands"] = mps_cmds(h)
    env = mps_env(h)
    for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
        os.makedirs(env[k], exist_ok=True)
    M["online_alone"] = requests(h, "mps-alone", deadline)  # outside MPS: the reference
    M["kernels_alone"] = kernels(h, "mps-alone", deadline, bursts=3)
    base = M["kernels_alone"]["latency_ms"][:3]
    M["rows"] = []
    before = set(pids_named("nvidia-cuda-mps-server") + pids_named("nvidia-cuda-mps-control"))
    M["mps_processes_before"] = sorted(before)  # another daemon's, left alone
    try:
        # Its output to a file, not a pipe: a daemon that keeps the pipe open would hold a
        # reader of it for ever.
        with open(os.path.join(h.art, "mps-control-start.log"), "w") as f:
            try:
                rc = subprocess.run(c["start"], env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, timeout=30).returncode
                M["start"] = {"argv": c["start"], "rc": rc, "err": ""}
            except (OSError, subprocess.TimeoutExpired) as e:
                M["start"] = {"argv": c["start"], "rc": None, "err": f"{type(e).__name__}: {e}"}
        M["start"]["out"] = h_tail(h, "mps-control-start.log", 1000)
        if M["start"]["rc"] != 0:
            raise RuntimeError(f"nvidia-cuda-mps-control -d failed: {M['start']['err'] or M['start']['out']}")
        M["control_pids"] = pids_named("nvidia-cuda-mps-control")
        for name, extra in c["offline_variants"].items():
            row = {"offline": name, "env": extra}
            M["rows"].append(row)
            tag = f"mps-{name}"
            out, rd = os.path.join(h.art, f"{tag}-offline.json"), os.path.join(h.tmp, f"{tag}-ready")
            off = h.spawn("work", f"{tag} offline", h.offline_cmd(out, rd, "large"), dict(env, **extra), f"{tag}-offline.log")
            try:
                h.wait_ready(off, rd, "offline", f"{tag}-offline.log", deadline)
                t0 = time.monotonic()
                time.sleep(3.0)
                row["offline_alone_steps_per_s"] = rate(out, [t0, time.monotonic()])
                row["requests"] = requests(h, tag, deadline, env=env)
                row["offline_steps_per_s_online_window"] = rate(out, row["requests"].pop("window"))
                row["p99_vs_alone"] = ratio(row["requests"]["p99_ms"], M["online_alone"]["p99_ms"])
                if name == "plain":
                    mps_holds(h, M, off, out, env, base, deadline, ckpt_step)
            finally:
                h.end(off, f"{tag} offline", 20)
                if name == "plain":
                    mps_finish(M, out)
            h.save()
    finally:
        ours = lambda: sorted(set(pids_named("nvidia-cuda-mps-server") + pids_named("nvidia-cuda-mps-control")) - before)
        M["servers"] = ours()
        q = cmd(["sh", "-c", c["quit"]], env=env)
        for _ in range(50):
            if not ours():
                break
            time.sleep(0.2)
        left = ours()
        M["quit"] = {"rc": q["rc"], "err": q["err"], "left_running": left}
        try:
            with open(os.path.join(env["CUDA_MPS_LOG_DIRECTORY"], "control.log")) as f:
                M["control_log_tail"] = f.read()[-1500:]
        except OSError:
            pass
        if left:
            LOG(f"  mps: the daemon did not quit: {left} still running")
    if M["quit"]["left_running"]:
        raise RuntimeError(f"mps: the MPS daemon did not quit: {M['quit']['left_running']}")


def mps_holds(h, M, off, out, env, base, deadline, ckpt_step):
    """With the plain offline MPS client running: which PIDs NVML names; kernel latency
    beside it, then while it is SIGSTOPped (its steps meanwhile); the driver's lock on it."""
    ready = os.path.join(h.tmp, "mps-nvml-ready")
    on = h.spawn("work", "mps-nvml online", h.online_cmd(os.path.join(h.art, "mps-nvml-online.json"), duration=6.0, ready=ready), env, "mps-nvml-online.log")
    try:
        h.wait_ready(on, ready, "online", "mps-nvml-online.log", deadline)
        M["nvml"] = nvml_pids(h, 4.0)
        M["nvml"]["pids"] = {"offline": off.pid, "online": on.pid, "mps_servers": pids_named("nvidia-cuda-mps-server")}
        h.wait_exit(on, "online", deadline)
    finally:
        h.end(on, "mps-nvml online", 5)
    M["kernels_beside"] = kernels(h, "mps-beside", deadline, env=env, base=base, bursts=3)
    os.kill(off.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        time.sleep(0.5)
        M["kernels_stopped"] = kernels(h, "mps-stopped", deadline, env=env, base=base, bursts=3)
        t1 = time.monotonic()
    finally:
        os.kill(off.pid, signal.SIGCONT)
        t_cont = time.monotonic()
    time.sleep(1.0)
    M["sigstop"] = {"stopped_s": round(t_cont - t0, 2)}
    M["_stop_window"] = [t0, t_cont]
    r = ckpt_step.ckpt(h, "lock", off.pid, timeout_ms=5000, wait_s=30)
    u = ckpt_step.ckpt(h, "unlock", off.pid, timeout_ms=5000, wait_s=30)
    M["driver_lock"] = {"lock": ckpt_step.calls(r).get("lock") or r, "unlock": ckpt_step.calls(u).get("unlock") or u}
    if (ckpt_step.calls(r).get("lock") or {}).get("ok") and not (ckpt_step.calls(u).get("unlock") or {}).get("ok"):
        import mem_step
        M["driver_lock"]["left_locked_unblocked"] = mem_step.unblock(h, off.pid)


def mps_finish(M, out):
    """After the plain offline exited, from its timeline: synchronisations it recorded while
    stopped (none expected: a check of the stop) and how long after SIGCONT its next one
    came (near 0: its queued work ran on while it was stopped; about one synchronisation
    interval or more: the work waited for it)."""
    w = M.pop("_stop_window", None)
    if not w or M.get("sigstop") is None:
        return
    try:
        with open(out) as f:
            tl = json.load(f).get("timeline") or []
    except (OSError, ValueError):
        tl = []
    after = [t for t, _ in tl if t > w[1]]
    M["sigstop"]["syncs_while_stopped"] = sum(1 for t, _ in tl if w[0] + 0.05 < t < w[1]) if tl else None
    M["sigstop"]["first_sync_after_cont_ms"] = (after[0] - w[1]) * 1e3 if after else None
    gaps = [b - a for (a, _), (b, _) in zip(tl, tl[1:]) if b < w[0]]
    M["sigstop"]["sync_interval_ms_before"] = pct(gaps, 50) * 1e3 if gaps else None


def plan(step, h):
    """--sim: what the step would run, for the record."""
    if step == "timeslice-policy":
        return {"commands": policy_cmds(h.a), "per_value": "a training loop (tsg_train.py under the hook, or offline.py) started after the change; "
                "burst.py and online.py beside it; the value read before restored in a finally"}
    return {"commands": mps_cmds(h)}


# ---- report ---------------------------------------------------------------------------------

def f3(v):
    return "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))


def lat(r):
    return "/".join(f3(x) for x in (r or {}).get("latency_ms") or []) or "-"


def render(P):
    out = ["", "## Driver probes (no agent): the channel group's time slice, the device's time-slice policy, MPS", "",
           f"Environment: {json.dumps(P.get('env'))}"]
    T = P.get("tsg")
    if T:
        out += ["", "### tsg: the training loop sets its own channel groups' time slice (NVA06C_CTRL_CMD_SET_TIMESLICE)", "",
                f"Hook: {T.get('hook')}. Seen: {json.dumps(T.get('seen'))}. Groups: {len(T.get('groups') or [])}, default slice read back {T.get('default_us')} us; "
                f"candidates {T.get('candidates_us')} us, accepted per group {T.get('accepted_us')}.", "",
                f"**Verdict: {T.get('verdict')}**", ""]
        if T.get("fake_device"):
            out += [f"Fake RM device checks: {sum(T['fake_device']['checks'].values())}/{len(T['fake_device']['checks'])} passed.", ""]
        if T.get("gpu_part"):
            out += [f"GPU part: {T['gpu_part']}.", ""]
        tries = [(g.get("object"), t) for g in (T.get("min") or {}).get("groups", []) for t in g.get("tries", [])]
        if tries:
            out.append("SET_TIMESLICE answers (group: us -> RM status): " + "; ".join(f"{o}: {t['us']} -> {hex(t['status']) if t['status'] >= 0 else t['status']}" for o, t in tries))
        if T.get("phases") or T.get("baseline"):
            out += ["", "| phase | slice | kernel p50/p90/p99/max ms | drain p50/max ms (n, not ended) | delay p50/max ms | offline steps/s |", "|---|---|---|---|---|---|"]
            if T.get("baseline"):
                out.append(f"| burst.py alone | - | {lat(T['baseline'])} | - | - | - |")
            for r in T.get("phases") or []:
                out.append(f"| {r['phase']} | {r['setting']} | {lat(r)} | {'/'.join(f3(x) for x in r.get('drain_ms') or [])} ({r.get('drain_n')}, {r.get('drain_not_ended')}) | "
                           f"{'/'.join(f3(x) for x in r.get('delay_ms') or [])} | {f3(r.get('offline_steps_per_s'))} |")
    S = P.get("timeslice_policy")
    if S:
        out += ["", "### timeslice-policy: nvidia-smi compute-policy --set-timeslice=N, a training loop started after each change", ""]
        if S.get("skipped"):
            out.append(f"Skipped: {S['skipped']}. Would run: {json.dumps(S.get('plan'))}")
        else:
            out += [f"Before: `{(S.get('before') or {}).get('out', '')[-200:]}`; restored to {S.get('restore_to')} ({S.get('restore_basis')}): "
                    f"rc {((S.get('restored') or {}).get('set') or {}).get('rc')}.", "",
                    "| value | loop's slices us | kernel p50/p90/p99/max ms | drain p50/max ms (n) | request p50/p99 ms | p99 / alone | offline steps/s | error |",
                    "|---|---|---|---|---|---|---|---|"]
            al = S.get("alone") or {}
            if al:
                out.append(f"| alone | - | {lat(al.get('kernels'))} | - | {f3((al.get('requests') or {}).get('p50_ms'))}/{f3((al.get('requests') or {}).get('p99_ms'))} | 1.00 | - | |")
            for r in S.get("rows") or []:
                k, q = r.get("kernels") or {}, r.get("requests") or {}
                out.append(f"| {r['value']} | {r.get('slices_us', '-')} | {lat(k)} | {'/'.join(f3(x) for x in k.get('drain_ms') or [])} ({k.get('drain_n', '-')}) | "
                           f"{f3(q.get('p50_ms'))}/{f3(q.get('p99_ms'))} | {f3(r.get('p99_vs_alone'))} | {f3(q.get('offline_steps_per_s'))} | {str(r.get('error', ''))[:150]} |")
    M = P.get("mps")
    if M:
        out += ["", "### mps: online and offline as MPS clients", ""]
        if M.get("skipped"):
            out.append(f"Skipped: {M['skipped']}. Would run: {json.dumps(M.get('plan'))}")
        else:
            al = M.get("online_alone") or {}
            out += [f"Online alone (no MPS): p50/p99 {f3(al.get('p50_ms'))}/{f3(al.get('p99_ms'))} ms. Daemon quit: {json.dumps(M.get('quit'))}.", "",
                    "| offline client | env | offline steps/s alone | online p50/p99 ms | p99 / alone | offline steps/s beside online |", "|---|---|---|---|---|---|"]
            for r in M.get("rows") or []:
                q = r.get("requests") or {}
                out.append(f"| {r['offline']} | {json.dumps(r.get('env'))} | {f3(r.get('offline_alone_steps_per_s'))} | {f3(q.get('p50_ms'))}/{f3(q.get('p99_ms'))} | "
                           f"{f3(r.get('p99_vs_alone'))} | {f3(r.get('offline_steps_per_s_online_window'))} |")
            out += ["", f"Kernel latency p50/p90/p99/max ms: alone {lat(M.get('kernels_alone'))}; beside the offline client {lat(M.get('kernels_beside'))}; "
                    f"while it is SIGSTOPped {lat(M.get('kernels_stopped'))}; offline's next synchronisation {f3((M.get('sigstop') or {}).get('first_sync_after_cont_ms'))} ms "
                    f"after SIGCONT (its interval before: {f3((M.get('sigstop') or {}).get('sync_interval_ms_before'))} ms).",
                    f"Driver's lock on the MPS client: {json.dumps(M.get('driver_lock'))[:400]}.",
                    f"NVML: {json.dumps(M.get('nvml'))[:800]}."]
    return "\n".join(out)
