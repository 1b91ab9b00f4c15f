"""The harness's checkpoint step: the CUDA driver's checkpoint API against a training loop
(`coloc-bench --cuda-checkpoint`, which calls the agent's own driver edge).

What it measures, per --ckpt-gb size (a training loop holding that much extra device memory):
  lock (its time is the drain of the work already submitted), checkpoint, restore and
  unlock, each timed; the GPU memory the process holds before, while checkpointed and
  after (nvidia-smi); whether the process stays in the driver's process list while
  checkpointed; that no training step advanced while it was locked; that the training's
  parameter checksums after the restore equal those of an uninterrupted run, and that its
  extra memory came back bit for bit.
Then, on one more run, what the driver answers out of order: unlock or checkpoint of a
  running process, lock twice, a state query of a process without CUDA and of no process,
  a lock with a 1 ms timeout, lock of a SIGSTOPped process (with a timeout), and restore of
  a checkpointed process that is SIGSTOPped (does it wait for SIGCONT?).
Then the lock beside the large training model (--ckpt-lock-reps locks and unlocks: the lock
  time is its queued work's drain), and burst.py's kernel latency alone, beside the free
  training loop, and beside it while it is locked (does the lock keep the GPU free?).

Then (--ckpt-parts stopped) which calls a SIGSTOPped process answers: checkpoint and unlock
  of a locked one, and whether a lock made while it is stopped completes once it runs; and
  (parallel) two --ckpt-parallel-gb loops checkpointed and restored one at a time and at once.

With --sim: the simulated driver's checkpoint API (the fake libcuda.so.1) against
`coloc-sim offline --cuda` jobs holding the same memory; no checksums and no memory
figures (no nvidia-smi): it checks the step, and the model's rules.
"""
import json, math, os, signal, subprocess, sys, time

TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ckpt_train.py")
LOG = print  # the harness sets its own


def pct(v, q):
    """Nearest-rank percentile (the harness's rule); None for no values."""
    v = sorted(x for x in v if x is not None)
    return v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))] if v else None


PARTS = ("sizes", "edges", "large", "stopped", "parallel")


def parse_parts(spec):
    out = [x.strip() for x in spec.split(",") if x.strip()]
    bad = [x for x in out if x not in PARTS]
    if bad:
        raise SystemExit(f"--ckpt-parts: unknown {bad}: any of {', '.join(PARTS)}")
    return out


def need(a):
    """About how long the step takes (s): a start per job (PyTorch's import on a GPU), the
    copies, the probes."""
    parts = parse_parts(a.ckpt_parts)
    start = 2.0 if a.sim else 25.0
    sizes = [float(x) for x in a.ckpt_gb.split(",") if x.strip()] if "sizes" in parts else []
    per_gb = 0.8  # checkpoint and restore together (the H100: 0.6 + 0.2 s)
    return ((start * (len(sizes) + 1) + 4 * len(sizes) + sum(sizes) * per_gb) if sizes else 0) \
        + (start + 3) * ("edges" in parts) \
        + (3 * start + 10 + 0.5 * a.ckpt_lock_reps) * ("large" in parts) \
        + (start + 4 + 4 * (a.ckpt_stop_s + 0.5)) * ("stopped" in parts) \
        + (start + 4 + 3 * a.ckpt_parallel_gb * per_gb) * ("parallel" in parts) + 5


def ckpt(h, ops, pid, timeout_ms=10000, wait_s=60.0):
    """coloc-bench --cuda-checkpoint OPS --pid PID: its JSON, with "rc"; {"hung": true}
    when it did not return within wait_s (killed then)."""
    cmd = [os.path.join(h.bin, "coloc-bench"), "--cuda-checkpoint", ops, "--pid", str(pid), "--timeout-ms", str(timeout_ms), "--cuda-lib", h.a.cuda_lib]
    t = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=wait_s, stdin=subprocess.DEVNULL, env=h.env)
    except subprocess.TimeoutExpired:
        return {"ops": ops, "hung": True, "waited_s": round(time.monotonic() - t, 2)}
    try:
        out = json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        out = {"unparsed": p.stdout[-500:], "stderr": p.stderr[-500:]}
    out.update(ops=ops, rc=p.returncode, wall_ms=round((time.monotonic() - t) * 1e3, 1))
    return out


def calls(r):
    """{op: call} of a ckpt() answer (the last call of each op)."""
    return {c["op"]: c for c in r.get("calls") or []}


def smi(query, kind="gpu"):
    """nvidia-smi --query-{kind}=QUERY as a list of rows of strings ([] if it failed)."""
    try:
        p = subprocess.run(["nvidia-smi", f"--query-{kind}={query}", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=15, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [[x.strip() for x in line.split(",")] for line in p.stdout.strip().splitlines() if line.strip()] if p.returncode == 0 else []


def gpu_mem():
    """(used MiB of GPU 0, {pid: MiB} of its compute processes)."""
    used = smi("memory.used")
    apps = {}
    for row in smi("pid,used_memory", "compute-apps"):
        try:
            apps[int(row[0])] = int(row[1])
        except (ValueError, IndexError):
            pass
    try:
        u = int(used[0][0])
    except (ValueError, IndexError):
        u = None
    return u, apps


def steps_between(timeline, t0, t1):
    """Training steps the timeline shows completed strictly inside (t0, t1)."""
    inside = [s for t, s in timeline if t0 < t < t1]
    before = [s for t, s in timeline if t <= t0]
    return (max(inside) - (max(before) if before else 0)) if inside else 0


class Train:
    """One ckpt_train.py process."""

    def __init__(self, h, tag, gb, extra=(), max_steps=0):
        self.h, self.tag, self.gb = h, tag, gb
        self.mib = None  # the simulated job's memory (a real one's: nvidia-smi)
        self.out = os.path.join(h.art, f"{tag}.json")
        self.ready = os.path.join(h.tmp, f"{tag}-ready")
        self.log = f"{tag}.log"
        if h.sim:
            # A simulated job holding the model's memory plus the extra (no checksums).
            self.mib = mib = 1400 + int(gb * 1e9 / 1048576)
            cmd = [os.path.join(h.bin, "coloc-sim"), "offline", "--cuda", "--step-ms", "0.5", "--depth", "4", "--mem-mib", str(mib), "--out", self.out]
        else:
            cmd = [sys.executable, TRAIN, "--gb", str(gb), "--out", self.out, "--ready", self.ready] + list(extra)
            if max_steps:
                cmd += ["--max-steps", str(max_steps)]
        self.p = h.spawn("work", tag, cmd, h.env, self.log)

    def wait_ready(self, deadline):
        self.h.wait_ready(self.p, self.ready, self.tag, self.log, deadline, timeout=150)

    def finish(self, deadline, stop=True):
        """SIGTERM (after SIGCONT) unless it ends by itself; its JSON."""
        if stop and self.p.poll() is None:
            os.kill(self.p.pid, signal.SIGCONT)
            self.p.terminate()
        try:
            self.p.wait(max(1.0, min(60.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            pass
        self.h.end(self.p, self.tag, 10)
        with open(self.out) as f:
            return json.load(f)


def cycle(h, row, deadline):
    """Lock, checkpoint, restore and unlock of one training loop, each timed."""
    t = Train(h, f"ckpt-{row['gb']:g}gb", row["gb"])
    try:
        t.wait_ready(deadline)
        pid = t.p.pid
        time.sleep(1.0)
        row["mem_before_mib"], apps = gpu_mem()
        row["process_mib"] = apps.get(pid)
        r = ckpt(h, "state,lock,state", pid)
        locked_at = time.monotonic()
        c = calls(r)
        row["lock"] = r
        row["lock_ms"] = (c.get("lock") or {}).get("ms")
        row["state_locked"] = r.get("calls", [{}])[-1].get("state")
        time.sleep(1.0)
        r = ckpt(h, "checkpoint,state", pid, wait_s=180)
        row["checkpoint"] = r
        row["checkpoint_ms"] = (calls(r).get("checkpoint") or {}).get("ms")
        row["state_checkpointed"] = (calls(r).get("state") or {}).get("state")
        row["mem_checkpointed_mib"], apps = gpu_mem()
        row["listed_while_checkpointed"] = pid in apps
        time.sleep(0.5)
        r = ckpt(h, "restore,state", pid, wait_s=180)
        row["restore"] = r
        row["restore_ms"] = (calls(r).get("restore") or {}).get("ms")
        row["state_restored"] = (calls(r).get("state") or {}).get("state")
        r = ckpt(h, "unlock,state", pid)
        unlocked_at = time.monotonic()
        row["unlock"] = r
        row["unlock_ms"] = (calls(r).get("unlock") or {}).get("ms")
        row["state_after"] = (calls(r).get("state") or {}).get("state")
        row["mem_after_mib"], _ = gpu_mem()
        time.sleep(2.0)
        res = t.finish(deadline)
    finally:
        h.end(t.p, t.tag, 10)
    tl = res.get("timeline") or []
    row["steps_while_locked"] = steps_between(tl, locked_at + 0.05, unlocked_at - 0.05)
    row["steps_after_unlock"] = (tl[-1][1] if tl else 0) - max([s for tt, s in tl if tt <= unlocked_at] or [0])
    row["ballast_bytes"] = res.get("ballast_bytes")
    row["ballast_same"] = res["ballast_before"] == res["ballast_after"] if "ballast_after" in res else None
    row["checks"] = res.get("checks")
    row["error"] = res.get("error")
    mib = row.get("process_mib")
    if mib and row.get("checkpoint_ms") is not None:
        gb = mib * 1048576 / 1e9
        row["checkpoint_ms_per_gb"] = row["checkpoint_ms"] / gb
        if row.get("restore_ms") is not None:
            row["restore_ms_per_gb"] = row["restore_ms"] / gb


def edges(h, e, deadline):
    """What the driver answers out of order."""
    t = Train(h, "ckpt-edges", 0)
    sleeper = subprocess.Popen(["sleep", "120"], stdin=subprocess.DEVNULL)
    try:
        t.wait_ready(deadline)
        pid = t.p.pid
        time.sleep(0.5)
        e["unlock_running"] = ckpt(h, "unlock,state", pid)
        e["checkpoint_running"] = ckpt(h, "checkpoint,state", pid)
        e["lock_twice"] = ckpt(h, "lock,lock,state,unlock,state", pid)
        e["state_no_cuda"] = ckpt(h, "state", sleeper.pid)
        e["state_no_process"] = ckpt(h, "state", 4194000)
        e["lock_1ms"] = ckpt(h, "lock,state", pid, timeout_ms=1)
        if (calls(e["lock_1ms"]).get("lock") or {}).get("ok"):
            e["lock_1ms_unlock"] = ckpt(h, "unlock", pid)
        time.sleep(1.0)
        res = t.finish(deadline)
        tl = res.get("timeline") or []
        e["steps_total"] = tl[-1][1] if tl else 0
        e["train_error"] = res.get("error")
    finally:
        sleeper.kill()
        sleeper.wait()
        try:
            os.kill(t.p.pid, signal.SIGCONT)
        except OSError:
            pass
        h.end(t.p, t.tag, 10)


def while_stopped(h, pid, ops, stopped_s=5.0, timeout_ms=2000):
    """ops on pid while it is SIGSTOPped: did the call return while stopped, or only after
    SIGCONT (sent after stopped_s)? The target is running again on return."""
    os.kill(pid, signal.SIGSTOP)
    time.sleep(0.2)
    cmd = [os.path.join(h.bin, "coloc-bench"), "--cuda-checkpoint", ops, "--pid", str(pid), "--timeout-ms", str(timeout_ms), "--cuda-lib", h.a.cuda_lib]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, env=h.env)
    try:
        out, _ = p.communicate(timeout=stopped_s)
        os.kill(pid, signal.SIGCONT)
        r = {"returned_while_stopped": True, "ms": (time.monotonic() - t0) * 1e3}
    except subprocess.TimeoutExpired:
        os.kill(pid, signal.SIGCONT)
        t1 = time.monotonic()
        try:
            out, _ = p.communicate(timeout=60)
            r = {"returned_while_stopped": False, "waited_stopped_ms": (t1 - t0) * 1e3, "ms_after_sigcont": (time.monotonic() - t1) * 1e3}
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            r = {"returned_while_stopped": False, "hung_after_sigcont": True}
    try:
        j = json.loads(out.strip().splitlines()[-1])
        r.update({k: j[k] for k in ("calls", "load_error") if k in j})
    except (ValueError, IndexError):
        r["out"] = out[-400:]
    return r


def stopped(h, S, deadline):
    """Which calls a stopped process answers: checkpoint and unlock of a locked one, and
    whether a lock made while it is stopped completes once it runs again."""
    t = Train(h, "ckpt-stopped", 0)
    try:
        t.wait_ready(deadline)
        pid = t.p.pid
        time.sleep(0.5)
        stop_s = h.a.ckpt_stop_s
        S["lock"] = ckpt(h, "lock,state", pid)
        S["checkpoint_stopped"] = while_stopped(h, pid, "checkpoint,state", stop_s)
        S["state_1"] = ckpt(h, "state", pid)
        if (calls(S["state_1"]).get("state") or {}).get("state") == "checkpointed":
            S["restore_stopped"] = while_stopped(h, pid, "restore,state", stop_s)
        S["unlock_stopped"] = while_stopped(h, pid, "unlock,state", stop_s)
        S["state_2"] = ckpt(h, "state", pid)
        if (calls(S["state_2"]).get("state") or {}).get("state") == "locked":
            S["unlock"] = ckpt(h, "unlock,state", pid)
        S["lock_stopped"] = while_stopped(h, pid, "lock,state", stop_s, timeout_ms=1000)
        S["state_3"] = ckpt(h, "state", pid)
        if (calls(S["state_3"]).get("state") or {}).get("state") == "locked":
            S["unlock_3"] = ckpt(h, "unlock,state", pid)
        time.sleep(1.0)
        res = t.finish(deadline)
        tl = res.get("timeline") or []
        S["steps_total"] = tl[-1][1] if tl else 0
        S["train_error"] = res.get("error")
    finally:
        try:
            os.kill(t.p.pid, signal.SIGCONT)
        except OSError:
            pass
        h.end(t.p, t.tag, 10)


def parallel(h, P, deadline):
    """Two 8 GB training loops: checkpoint one alone, then both at once (and restore both at once)."""
    gb = h.a.ckpt_parallel_gb
    ts = [Train(h, f"ckpt-par{i}", gb) for i in range(2)]

    def together(ops):
        procs = [(t.p.pid, subprocess.Popen([os.path.join(h.bin, "coloc-bench"), "--cuda-checkpoint", ops, "--pid", str(t.p.pid), "--cuda-lib", h.a.cuda_lib],
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, env=h.env)) for t in ts]
        t0 = time.monotonic()
        out = []
        for pid, p in procs:
            o, _ = p.communicate(timeout=180)
            try:
                out.append(json.loads(o.strip().splitlines()[-1]))
            except (ValueError, IndexError):
                out.append({"unparsed": o[-300:]})
        return {"wall_ms": (time.monotonic() - t0) * 1e3, "each": [[c.get("op"), c.get("ok"), c.get("ms")] for r in out for c in r.get("calls") or []]}

    try:
        for t in ts:
            t.wait_ready(deadline)
        time.sleep(0.5)
        _, apps = gpu_mem()
        P["process_mib"] = [apps.get(t.p.pid) for t in ts]
        P["lock"] = together("lock")
        r = ckpt(h, "checkpoint", ts[0].p.pid, wait_s=180)
        P["checkpoint_one_ms"] = (calls(r).get("checkpoint") or {}).get("ms")
        r = ckpt(h, "restore", ts[0].p.pid, wait_s=180)
        P["restore_one_ms"] = (calls(r).get("restore") or {}).get("ms")
        P["checkpoint_both"] = together("checkpoint")
        P["mem_both_checkpointed_mib"], _ = gpu_mem()
        P["restore_both"] = together("restore")
        P["unlock"] = together("unlock,state")
        time.sleep(1.0)
        P["memory_same"] = []
        for t in ts:
            res = t.finish(deadline)
            P["memory_same"].append(res["ballast_before"] == res["ballast_after"] if "ballast_after" in res else None)
    finally:
        for t in ts:
            h.end(t.p, t.tag, 10)


def lock_large(h, L, deadline):
    """Lock beside the large model, and online kernel latency alone / beside / beside locked."""
    a = h.a
    probe = lambda tag: os.path.join(h.art, f"ckpt-{tag}-probe.json")

    def run_probe(tag):
        pr = h.spawn("work", f"ckpt {tag} probe", h.burst_cmd(probe(tag), bursts=3, burst_ms=300, gap_ms=200), h.env, f"ckpt-{tag}-probe.log")
        h.wait_exit(pr, "probe", deadline)
        h.end(pr, "probe", 5)
        with open(probe(tag)) as f:
            pj = json.load(f)
        lat = sorted(k[1] for k in pj.get("kernels") or [])
        return {"kernels": len(lat), "latency_ms": [pct(lat, 50), pct(lat, 90), pct(lat, 99), lat[-1] if lat else None], "error": pj.get("error")}

    L["alone"] = run_probe("alone")
    off_out, ready = os.path.join(h.art, "ckpt-large-offline.json"), os.path.join(h.tmp, "ckpt-large-ready")
    off = h.spawn("work", "ckpt large offline", h.offline_cmd(off_out, ready, "large"), h.env, "ckpt-large-offline.log")
    try:
        h.wait_ready(off, ready, "offline", "ckpt-large-offline.log", deadline, timeout=90)
        time.sleep(1.0)
        L["locks"] = []
        for _ in range(a.ckpt_lock_reps):
            r = ckpt(h, "lock", off.pid)
            u = ckpt(h, "unlock", off.pid)
            L["locks"].append({"lock_ms": (calls(r).get("lock") or {}).get("ms"), "lock_ok": (calls(r).get("lock") or {}).get("ok"),
                               "unlock_ms": (calls(u).get("unlock") or {}).get("ms"), "raw": [r, u] if not (calls(r).get("lock") or {}).get("ok") else None})
            time.sleep(0.4)
        L["beside"] = run_probe("beside")
        r = ckpt(h, "lock", off.pid)
        L["lock_for_probe"] = r
        t0 = time.monotonic()
        L["beside_locked"] = run_probe("locked")
        t1 = time.monotonic()
        L["unlock_after_probe"] = ckpt(h, "unlock", off.pid)
        time.sleep(1.0)
    finally:
        h.end(off, "ckpt large offline", 20)
    try:
        with open(off_out) as f:
            tl = json.load(f).get("timeline") or []
        L["offline_steps_while_locked"] = steps_between(tl, t0 + 0.05, t1 - 0.05)
    except (OSError, ValueError) as ex:
        L["offline_steps_while_locked"] = f"unknown: {ex!r}"


def run(h, deadline):
    a = h.a
    c = h.results["checkpoint"] = {"sizes_gb": a.ckpt_gb, "parts": a.ckpt_parts, "runs": [], "edges": {}, "large": {}}
    smi_row = smi("name,driver_version,memory.total")
    c["gpu"] = smi_row[0] if smi_row else None
    probe = ckpt(h, "state", os.getpid())  # this process has no CUDA: only whether the API loads
    c["driver"] = {k: probe.get(k) for k in ("library", "driver_version", "load_ms", "load_error", "calls")}
    if probe.get("load_error") or probe.get("hung") or "calls" not in probe:
        raise RuntimeError(f"the driver's checkpoint API cannot be used: {json.dumps(probe)[:800]}")
    parts = set(x.strip() for x in a.ckpt_parts.split(",") if x.strip())
    first = [float(x) for x in a.ckpt_gb.split(",") if x.strip()] if "sizes" in parts else []
    errors = []
    for gb in first:
        row = {"gb": gb}
        c["runs"].append(row)
        try:
            cycle(h, row, deadline)
        except Exception as ex:  # noqa: BLE001  (one size: recorded, the others run)
            row["error"] = f"{type(ex).__name__}: {ex}"[:1500]
            errors.append(f"{gb:g} GB")
        LOG(f"  checkpoint {gb:g} GB: " + json.dumps({k: v for k, v in row.items() if k not in ("lock", "checkpoint", "restore", "unlock", "checks")})[:900])
        h.save()
    # The reference: the same training, uninterrupted, as many steps as the longest run checked.
    last = max([ch[-1][0] for r in c["runs"] for ch in [r.get("checks") or []] if ch] or [0])
    if last:
        try:
            ref = Train(h, "ckpt-reference", 0, max_steps=last)
            ref.wait_ready(deadline)
            rj = ref.finish(deadline, stop=False)
            refs = {s: v for s, v in rj.get("checks") or []}
            c["reference_steps"] = last
            for r in c["runs"]:
                mine = r.get("checks") or []
                same = [refs.get(s) == v for s, v in mine if s in refs]
                r["checks_compared"] = len(same)
                r["checks_equal"] = all(same) and bool(same)
                r.pop("checks", None)
        except Exception as ex:  # noqa: BLE001
            c["reference_error"] = f"{type(ex).__name__}: {ex}"[:1500]
            errors.append("reference")
    h.save()
    for name, fn, key in (("edges", edges, "edges"), ("large", lock_large, "large"), ("stopped", stopped, "stopped"), ("parallel", parallel, "parallel")):
        if name not in parts:
            continue
        c.setdefault(key, {})
        try:
            fn(h, c[key], deadline)
        except Exception as ex:  # noqa: BLE001
            c[key]["error"] = f"{type(ex).__name__}: {ex}"[:1500]
            errors.append(name)
        h.save()
    if errors:
        raise RuntimeError(f"checkpoint: parts failed: {errors}")


def render(c):
    """The step's section of results.md."""
    out = ["", "## The CUDA driver's checkpoint API (coloc-bench --cuda-checkpoint against a training loop)", "",
           f"GPU: {c.get('gpu')}; driver: {json.dumps(c.get('driver'))}. Per run: a seeded training loop with extra device memory; lock (10 s timeout), checkpoint, "
           "restore, unlock, each timed by the caller around the driver call. Memory from nvidia-smi. Checks: the training's "
           f"parameter checksums after the restore against an uninterrupted run ({c.get('reference_steps')} steps), the extra memory bit for bit, "
           "no step while locked.", "",
           "| extra GB | process MiB | lock ms | checkpoint ms (ms/GB) | restore ms (ms/GB) | unlock ms | GPU MiB used before / checkpointed / after | listed while checkpointed | states | steps while locked / after | checksums equal (n) | memory same | error |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in c.get("runs") or []:
        f = lambda v: "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))
        states = "/".join(str(r.get(k)) for k in ("state_locked", "state_checkpointed", "state_restored", "state_after"))
        out.append(f"| {r['gb']:g} | {f(r.get('process_mib'))} | {f(r.get('lock_ms'))} | {f(r.get('checkpoint_ms'))} ({f(r.get('checkpoint_ms_per_gb'))}) | "
                   f"{f(r.get('restore_ms'))} ({f(r.get('restore_ms_per_gb'))}) | {f(r.get('unlock_ms'))} | "
                   f"{f(r.get('mem_before_mib'))} / {f(r.get('mem_checkpointed_mib'))} / {f(r.get('mem_after_mib'))} | {r.get('listed_while_checkpointed')} | {states} | "
                   f"{r.get('steps_while_locked')} / {r.get('steps_after_unlock')} | {r.get('checks_equal')} ({r.get('checks_compared')}) | {r.get('ballast_same')} | "
                   f"{str(r.get('error') or '')[:200].replace('|', '/')} |")
    e = c.get("edges") or {}
    if e:
        out += ["", "Out of order (each: the calls' answers):", ""]
        for k, v in e.items():
            if isinstance(v, dict) and "calls" in v:
                desc = ", ".join(f"{x['op']} {'ok' if x.get('ok') else x.get('name')} {x.get('ms', 0):.1f} ms" + (f" -> {x['state']}" if x.get("state") else "") for x in v["calls"])
                out.append(f"- {k}: {desc}")
            else:
                out.append(f"- {k}: {json.dumps(v)[:600]}")
    for key, title in (("stopped", "A stopped process"), ("parallel", "Two processes at once")):
        x = c.get(key) or {}
        if x:
            out += ["", f"{title}:", ""]
            for k, v in x.items():
                if isinstance(v, dict) and "calls" in v and "returned_while_stopped" not in v:
                    v = ", ".join(f"{y['op']} {'ok' if y.get('ok') else y.get('name')} {y.get('ms', 0):.1f} ms" + (f" -> {y['state']}" if y.get("state") else "") for y in v["calls"])
                out.append(f"- {k}: {v if isinstance(v, str) else json.dumps(v)[:700]}")
    L = c.get("large") or {}
    if L:
        locks = L.get("locks") or []
        out += ["", f"Large model (lock, then unlock, {len(locks)} times): lock ms {[round(x['lock_ms'], 1) for x in locks if x.get('lock_ms') is not None]}, "
                f"unlock ms {[round(x['unlock_ms'], 2) for x in locks if x.get('unlock_ms') is not None]}.", "",
                "| online probe (burst.py, 3 bursts) | kernels | latency p50/p90/p99/max ms |", "|---|---|---|"]
        for k in ("alone", "beside", "beside_locked"):
            x = L.get(k) or {}
            out.append(f"| {k} | {x.get('kernels')} | {'/'.join('-' if v is None else f'{v:.3f}' for v in x.get('latency_ms') or [])} |")
        out.append(f"\nOffline steps while locked for the probe: {L.get('offline_steps_while_locked')}" + (f"; ERROR {L['error']}" if L.get("error") else ""))
    return "\n".join(out)
