"""The harness's memory step: the agent's memory preemption and its driver's lock, end to
end on the GPU.

Part preempt, per --memory-runs entry (offline sizes joined by '+': one run holds them all at
once): seeded training loops (ckpt_train.py) holding that much extra device memory each,
classed offline with `checkpoint = true`; an online process (mem_online.py) classed online
that needs M GiB, more than is free beside the offline loops and no more than is free once
every one of them is checkpointed (M = free + the loops' memory - half the smallest loop's).
The agent runs with --driver-lock, --memory-reserve M (plus a margin) and --restore-after.
Recorded: the online process's wait from its first allocation attempt to its success (and
how many attempts failed), the agent's checkpoint and restore events (bytes, time taken,
order), its driver metrics (coloc_driver_call_seconds per op, failures, bytes moved), its
log lines about them, GPU memory before / while online holds M / after (nvidia-smi, and the
agent's own view), each offline process's driver state over time (/state), the training
steps made while it was held, how long after online exited it ran again, and its parameter
checksums against an uninterrupted run of the same loop (one reference for every run).

Part lock: the scenario rows online alone, offline alone, and both with the agent holding
offline by the driver's lock behind the launch gate (doorbell + gate + --driver-lock),
--memory-row-duration seconds each: online p99 against alone, offline steps/s.

Before anything starts, the step fails at once when the agent in --bin has none of the
flags, or the driver's checkpoint API does not load (a driver before 570).

With --sim: the simulated driver (the fake libcuda.so.1, its checkpoint API and memory) and
`coloc-sim offline --cuda` loops; mem_online.py reaches the driver through ctypes. No
checksums and no nvidia-smi: it checks the step, not the figures.
"""
import json, math, os, re, subprocess, sys, time

import ckpt_step
from ckpt_step import Train, calls, ckpt, smi
from shim_check import http_get, tail

HERE = os.path.dirname(os.path.abspath(__file__))
ONLINE = os.path.join(HERE, "mem_online.py")
LOG = print  # the harness sets its own
PARTS = ("preempt", "lock")
AGENT_FLAGS = ("--driver-lock", "--memory-reserve", "--restore-after")
MIB, GIB = 1 << 20, 1 << 30
# What the online process holds besides its allocation (its CUDA context), and the margin
# kept between the reserve and what it allocates, MiB.
ONLINE_CTX_MIB = {False: 1024, True: 0}  # real GPU (PyTorch's context), simulated
RESERVE_MARGIN_MIB = {False: 512, True: 64}
# The checkpoint and restore costs the H100 showed (s per GB of the process's memory).
CKPT_S_PER_GB, RESTORE_S_PER_GB = 0.6, 0.2
# A training loop's memory beside its extra (the model, optimizer, context), GB.
TRAIN_BASE_GB = 1.5
# The most steps the uninterrupted reference runs (about 20 s on the H100; a run that went
# as planned checks fewer: its loops train a few seconds before and after being held).
REFERENCE_STEPS = 6000
ROWS = (("online alone", "memory-online-alone", True, False, None),
        ("offline alone", "memory-offline-alone", False, True, None),
        ("both, agent doorbell + gate + driver lock", "memory-driver-lock", True, True, ("signal", False, "lock")))


def parse_parts(spec):
    out = [x.strip() for x in spec.split(",") if x.strip()]
    bad = [x for x in out if x not in PARTS]
    if bad:
        raise SystemExit(f"--memory-parts: unknown {bad}: any of {', '.join(PARTS)}")
    return out


def parse_runs(spec):
    """--memory-runs: comma-separated runs, each offline sizes (extra GB) joined by '+'."""
    runs = []
    for r in (x.strip() for x in spec.split(",") if x.strip()):
        try:
            sizes = [float(x) for x in r.split("+")]
        except ValueError:
            sizes = []
        if not sizes or any(not (math.isfinite(g) and g >= 0) for g in sizes):
            raise SystemExit(f"--memory-runs: {r!r}: want extra GB per offline loop, joined by '+' (8+32), runs comma-separated")
        runs.append(sizes)
    return runs


def start_s(h):
    return 2.0 if h.sim else 13.0  # a workload's start (PyTorch's import, CUDA, the ballast)


def run_need(h, sizes):
    """About how long one preempt run takes (s): the loops' start (side by side), their
    checkpoints (side by side: the largest's, with a fifth more for the sharing), the hold,
    the wait before the restores and the restores (one after another). On the H100 a run
    of 8 + 32 GB took 41 s from the loops' start, against 64 here."""
    a = h.a
    gb = [g + TRAIN_BASE_GB for g in sizes]
    return start_s(h) + 6 + 1.2 * max(gb) * CKPT_S_PER_GB + sum(gb) * RESTORE_S_PER_GB + a.memory_hold_s + a.memory_restore_after_s + 6


def row_need(h, online, offline):
    """A row: its workloads' starts, one after the other, and its duration."""
    return h.a.memory_row_duration + start_s(h) * (online + offline) + 4


def need(h):
    """About how long the step takes (s); its parts skip what would not fit its deadline."""
    a = h.a
    parts = parse_parts(a.memory_parts)
    t = 5.0
    if "preempt" in parts:
        t += sum(run_need(h, s) for s in parse_runs(a.memory_runs)) + (0 if h.sim else start_s(h) + 15)
    if "lock" in parts:
        t += sum(row_need(h, r[2], r[3]) for r in ROWS)
    return t


# ---- what the agent says -------------------------------------------------------------------

METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text):
    """Prometheus text: [(name, {label: value}, float)]."""
    out = []
    for line in text.splitlines():
        m = METRIC.match(line)
        if not m or line.startswith("#"):
            continue
        try:
            v = float(m.group(3))
        except ValueError:
            continue
        out.append((m.group(1), dict(LABEL.findall(m.group(2) or "")), v))
    return out


def driver_metrics(text):
    """The agent's driver and memory metrics: per op, the calls' count, sum and where they
    fell (the cumulative buckets where the count grew); failures by op and reason; bytes
    moved; the gauges."""
    ms = parse_metrics(text)
    calls_, fails, moved, gauges = {}, {}, {}, {}
    for name, lab, v in ms:
        if name.startswith("coloc_driver_call_seconds"):
            c = calls_.setdefault(lab.get("op", "?"), {"count": 0, "sum_s": 0.0, "buckets": []})
            if name.endswith("_count"):
                c["count"] = int(v)
            elif name.endswith("_sum"):
                c["sum_s"] = v
            elif name.endswith("_bucket"):
                c["buckets"].append([lab.get("le"), int(v)])
        elif name == "coloc_driver_call_failures_total":
            fails[f"{lab.get('op')}/{lab.get('reason')}"] = int(v)
        elif name == "coloc_checkpoint_bytes_total":
            moved[lab.get("op", "?")] = int(v)
        elif name in ("coloc_checkpointed_processes", "coloc_checkpointed_bytes", "coloc_gpu_memory_free_bytes",
                      "coloc_gpu_memory_reserve_bytes", "coloc_memory_pressure", "coloc_driver_locked_processes"):
            gauges[name + (f"{{gpu={lab['gpu']}}}" if "gpu" in lab else "")] = v
    for c in calls_.values():
        b, kept, last = sorted(c["buckets"], key=lambda x: math.inf if x[0] == "+Inf" else float(x[0])), [], 0
        for le, n in b:
            if n != last:
                kept.append([le, n])
                last = n
        c["buckets"] = kept
        c["mean_ms"] = c["sum_s"] / c["count"] * 1e3 if c["count"] else None
    return {"calls": calls_, "failures": fails, "bytes": moved, "gauges": gauges}


def driver_events(path):
    """The event log's checkpoint and restore events, in order."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if (e.get("event") or e.get("kind")) in ("checkpoint", "restore"):
                    if isinstance(e.get("took_s"), (int, float)):
                        e["took_ms"] = e["took_s"] * 1e3
                    out.append(e)
    except OSError:
        pass
    return out


def agent_lines(path, n=30):
    """The agent's log lines about the driver (checkpoint, restore, lock, memory)."""
    out = []
    try:
        with open(path, errors="replace") as f:
            for line in f:
                line = ANSI.sub("", line)
                if re.search(r"[Cc]heckpoint|[Rr]estor|[Uu]nlock|[Ll]ocked|[Dd]river|[Rr]eserve|[Pp]ressure", line) and "Classified GPU process" not in line:
                    out.append(line.strip()[:400])
    except OSError as e:
        out.append(f"({e})")
    return out[:n] + ([f"... {len(out) - n} more"] if len(out) > n else [])


def evictions(path):
    """The agent's decisions to checkpoint, in order, from its log: [[pid, GiB held]]."""
    out = []
    try:
        with open(path, errors="replace") as f:
            for line in f:
                line = ANSI.sub("", line)
                if "Checkpointing an offline process" in line:
                    pid, held = re.search(r"pid=(\d+)", line), re.search(r"holds_gib=([\d.]+)", line)
                    out.append([int(pid.group(1)) if pid else None, float(held.group(1)) if held else None])
    except OSError:
        pass
    return out


def state_of(h, port):
    try:
        code, body = http_get(port, "/state", 2.0)
        return json.loads(body) if code == 200 else None
    except (OSError, ValueError):
        return None


def procs(state):
    """{pid: {class, driver, checkpointed_bytes, suspended}} of /state's GPU 0."""
    out = {}
    for g in (state or {}).get("gpus", [])[:1]:
        for p in g.get("processes", []):
            out[p.get("pid")] = {k: p.get(k) for k in ("class", "driver", "checkpointed_bytes", "suspended", "actuator")}
    return out


def agent_memory(state):
    g = ((state or {}).get("gpus") or [{}])[0]
    return g.get("memory")


def smi_memory():
    """nvidia-smi's GPU 0: total, used, free MiB and {pid: MiB}; None where it failed."""
    row = smi("memory.total,memory.used,memory.free")
    apps = {}
    for r in smi("pid,used_memory", "compute-apps"):
        try:
            apps[int(r[0])] = int(r[1])
        except (ValueError, IndexError):
            pass
    try:
        total, used, free = (int(x) for x in row[0][:3])
    except (ValueError, IndexError):
        return None
    return {"total_mib": total, "used_mib": used, "free_mib": free, "apps_mib": apps}


# ---- part preempt ----------------------------------------------------------------------------

def rules(h, tag):
    off = 'cmdline = "*coloc-sim offline*"' if h.sim else 'cmdline = "*benches/gpu/ckpt_train.py*"'
    p = os.path.join(h.art, f"{tag}-rules.toml")
    with open(p, "w") as f:
        f.write(f'[[rule]]\nname = "offline"\nclass = "reclaimed_cores"\n{off}\ncheckpoint = true\n'
                f'[[rule]]\nname = "online"\nclass = "shared_cores"\ncmdline = "*benches/gpu/mem_online.py*"\n')
    return p


def choose(h, trains, before):
    """M (GiB) and the reserve (MiB) from the memory free beside the offline loops and what
    they hold: M does not fit beside them, and fits once all of them are checkpointed."""
    if h.sim:
        total = h.a.sim_memory_gib * GIB
        held = [t.mib * MIB for t in trains]
        free = total - sum(held)
    else:
        if not before:
            raise RuntimeError("nvidia-smi gave no memory figures")
        held = [before["apps_mib"].get(t.p.pid, 0) * MIB for t in trains]
        if not all(held):
            raise RuntimeError(f"nvidia-smi does not list every offline loop: {before['apps_mib']} (pids {[t.p.pid for t in trains]})")
        total, free = before["total_mib"] * MIB, before["free_mib"] * MIB
    ctx, margin = ONLINE_CTX_MIB[h.sim] * MIB, RESERVE_MARGIN_MIB[h.sim] * MIB
    m = free + sum(held) - min(held) / 2
    if min(held) / 2 < ctx + margin:
        raise RuntimeError(f"the smallest offline loop holds {min(held) / MIB:.0f} MiB: too little to make room for the online context and margin "
                           f"({(ctx + margin) / MIB:.0f} MiB) in half of it")
    gib = math.floor(m / GIB * 100) / 100
    return {"total_bytes": total, "free_bytes": free, "offline_bytes": held, "online_gib": gib,
            "reserve_mib": int(gib * GIB / MIB + RESERVE_MARGIN_MIB[h.sim])}


def unblock(h, pid):
    """A loop the agent left locked or checkpointed (it failed, or was killed): restore and
    unlock it, so that it can end and write its result. What was found, or None."""
    s = (calls(ckpt(h, "state", pid, wait_s=15)).get("state") or {}).get("state")
    if s == "checkpointed":
        r = ckpt(h, "restore,unlock", pid, wait_s=120)
    elif s == "locked":
        r = ckpt(h, "unlock", pid, wait_s=15)
    else:
        return None
    return {"state": s, "calls": [[c.get("op"), c.get("ok"), c.get("name")] for c in r.get("calls") or []]}


def preempt_run(h, R, sizes, deadline, idx):
    a = h.a
    tag = f"memory-{idx}"
    R.update(sizes_gb=sizes, restore_after_s=a.memory_restore_after_s, hold_s=a.memory_hold_s, warnings=[])
    warn = R["warnings"]
    trains, ag, on, port, events = [], None, None, None, None
    go = os.path.join(h.tmp, f"{tag}-go")
    agent_log = os.path.join(h.art, f"{tag}-agent.log")
    on_out, on_ready = os.path.join(h.art, f"{tag}-online.json"), os.path.join(h.tmp, f"{tag}-online-ready")
    timeline, unblocked = [], {}
    try:
        for i, gb in enumerate(sizes):
            trains.append(Train(h, f"{tag}-offline{i}-{gb:g}gb", gb))
        cmd = [sys.executable, ONLINE, "--go", go, "--ready", on_ready, "--out", on_out, "--retry-ms", f"{a.memory_retry_ms:g}",
               "--hold-s", f"{a.memory_hold_s:g}"] + (["--driver-api"] if h.sim else [])
        est = sum(g + TRAIN_BASE_GB for g in sizes) * CKPT_S_PER_GB
        cmd += ["--deadline-s", f"{max(20.0, min(3 * est + 20, deadline - time.monotonic() - 30)):.0f}"]
        on = h.spawn("work", f"{tag} online", cmd, h.env, f"{tag}-online.log")
        for t in trains:
            t.wait_ready(deadline)
        h.wait_ready(on, on_ready, "memory online", f"{tag}-online.log", deadline, timeout=120)
        time.sleep(0.5)
        before = None if h.sim else smi_memory()
        R["before"] = before
        R.update(choose(h, trains, before))
        R["offline_pids"] = [t.p.pid for t in trains]
        extra = ["--driver-lock", "--cuda-lib", a.cuda_lib, "--memory-reserve", f"{R['reserve_mib']}MiB", "--restore-after", f"{a.memory_restore_after_s:g}s"]
        ag, port, events = h.start_agent(tag, rules(h, tag), "signal", False, False, deadline, extra=extra)
        R["agent_flags"] = extra
        # The agent must see the loops as offline before online asks (else the run measures
        # its discovery).
        until, seen = time.monotonic() + 10, {}
        while time.monotonic() < until:
            seen = procs(state_of(h, port))
            if all((seen.get(t.p.pid) or {}).get("class") == "offline" for t in trains):
                break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"the agent does not list every offline loop as offline after 10 s: {seen}")
        R["agent_memory_before"] = agent_memory(state_of(h, port))
        LOG(f"  memory run {idx}: offline {[f'{b / GIB:.1f}' for b in R['offline_bytes']]} GiB, free {R['free_bytes'] / GIB:.1f} GiB "
            f"of {R['total_bytes'] / GIB:.1f}; online needs {R['online_gib']:g} GiB, reserve {R['reserve_mib']} MiB")
        with open(go + ".tmp", "w") as f:
            f.write(f"{R['online_gib']}\n")
        os.replace(go + ".tmp", go)
        t_go = time.monotonic()
        R["go_mono"] = t_go

        last_smi = [0.0]

        def sample():
            st = state_of(h, port)
            s = {"t": round(time.monotonic() - t_go, 3), "agent": agent_memory(st),
                 "driver": {str(pid): (p.get("driver"), p.get("checkpointed_bytes")) for pid, p in procs(st).items() if pid in R["offline_pids"]}}
            if not h.sim and time.monotonic() - last_smi[0] >= 0.9:
                last_smi[0] = time.monotonic()
                s["smi"] = smi_memory()
            timeline.append(s)
            return s

        # While online waits, holds and exits: every 0.25 s the agent's view, about every
        # second nvidia-smi's (its two queries take about 0.35 s on the H100).
        def agent_alive():
            if ag.poll() is not None:
                raise RuntimeError(f"the agent exited {ag.returncode} during the run: {tail(agent_log, 600)}")

        while on.poll() is None:
            agent_alive()
            if time.monotonic() > deadline - 10:
                raise RuntimeError("the online process was still running at the step's deadline")
            sample()
            time.sleep(0.25)
        R["online_rc"] = on.returncode
        t_exit = time.monotonic()
        # Then until every loop runs again (restored and unlocked), or well past the time
        # that should take.
        limit = t_exit + a.memory_restore_after_s + sum(R["offline_bytes"]) / 1e9 * RESTORE_S_PER_GB * 3 + 20
        while True:
            agent_alive()
            s = sample()
            kinds = [e.get("event") or e.get("kind") for e in driver_events(events)]
            if not any(held(s, pid) for pid in R["offline_pids"]) and kinds.count("restore") >= kinds.count("checkpoint"):
                break
            if time.monotonic() > min(limit, deadline - 10):
                warn.append(f"not every offline loop ran again within {limit - t_exit:.0f} s of online's exit")
                break
            time.sleep(0.25)
        R["running_again_mono"] = time.monotonic()
        R["running_again_s_after_online_exit"] = R["running_again_mono"] - t_exit  # (online's own exit time below)
        time.sleep(1.5)  # training steps after the restore, for the checksums
        R["after"] = None if h.sim else smi_memory()
        R["agent_memory_after"] = agent_memory(state_of(h, port))
        try:
            R["metrics"] = driver_metrics(http_get(port, "/metrics")[1])
        except OSError as e:
            warn.append(f"no /metrics: {e!r}")
        st = state_of(h, port)
        if st is not None:
            with open(os.path.join(h.art, f"{tag}-state.json"), "w") as f:
                json.dump(st, f, indent=1)
    finally:
        # The agent first (it restores and unlocks what it holds as it exits), then any loop
        # left held, then the workloads.
        if ag is not None:
            R["agent_exit"] = h.end(ag, f"{tag} agent", 75, cont=False)  # it waits up to 60 s for its last restores
        for t in trains:
            if t.p.poll() is None:
                try:
                    u = unblock(h, t.p.pid)
                except Exception as ex:  # noqa: BLE001
                    u = {"error": repr(ex)}
                if u:
                    unblocked[t.p.pid] = u
        h.end(on, f"{tag} online", 10)
        results = {}
        for t in trains:
            try:
                results[t.p.pid] = t.finish(deadline)
            except (OSError, ValueError) as ex:
                results[t.p.pid] = {"error": f"no result: {ex!r}"}
            h.end(t.p, t.tag, 10)
        R["timeline"] = timeline
        R["agent_log"] = agent_lines(agent_log)
    if unblocked:
        warn.append(f"loops left held after the agent exited, restored by the harness: {json.dumps(unblocked)}")
    summarize(h, R, trains, results, on_out, events, agent_log)


def held(sample, pid):
    """Whether the agent's /state showed pid locked or checkpointed in this sample."""
    return (sample["driver"].get(str(pid)) or (None,))[0] in ("locked", "checkpointed")


def held_window(timeline, pid):
    """(first, last) time since go the agent's /state showed pid held by the driver."""
    ts = [s["t"] for s in timeline if held(s, pid)]
    return (ts[0], ts[-1]) if ts else None


def summarize(h, R, trains, results, on_out, events, agent_log):
    warn = R["warnings"]
    try:
        with open(on_out) as f:
            oj = json.load(f)
    except (OSError, ValueError) as e:
        oj = {"error": f"no result: {e!r}"}
    R["online"] = {k: oj.get(k) for k in ("gib", "attempts", "wait_s", "context_s", "first_error", "free_total_first", "free_total_held",
                                          "filled_s", "import_s", "phase", "error")}
    if oj.get("free_timeline"):
        R["online"]["free_gib_while_waiting"] = [[round(t - oj["first_attempt_mono"], 2), round(v / GIB, 2)] for t, v in oj["free_timeline"]]
    t_go = R.get("go_mono")
    if oj.get("exit_mono") and R.get("running_again_mono"):
        # From online's exit (its own clock reading) to the first /state read showing
        # every loop running again (read every 0.25 s or so).
        R["running_again_s_after_online_exit"] = R["running_again_mono"] - oj["exit_mono"]
    ev = driver_events(events) if events else []
    R["events"] = ev
    ck = [e for e in ev if (e.get("event") or e.get("kind")) == "checkpoint"]
    rs = [e for e in ev if (e.get("event") or e.get("kind")) == "restore"]
    if rs and oj.get("exit_wall_s") and all(isinstance(e.get("at_ns"), int) for e in rs):
        # When the driver had restored the last loop (the event's end), after online exited.
        R["restored_s_after_online_exit"] = max(e["at_ns"] for e in rs) / 1e9 - oj["exit_wall_s"]
    R["agent_log"] = agent_lines(agent_log)
    # Offline loops: held by the driver while online needed the memory, no step meanwhile,
    # running again after, checksums of the training.
    loops = R["offline"] = []
    for t in trains:
        pid, res = t.p.pid, results.get(t.p.pid) or {}
        tl = res.get("timeline") or []
        row = {"pid": pid, "gb": t.gb, "mib": None, "error": res.get("error")}
        if R.get("before") and R["before"].get("apps_mib"):
            row["mib"] = R["before"]["apps_mib"].get(pid)
        elif h.sim:
            row["mib"] = t.mib
        row["checkpoints"] = [{k: e.get(k) for k in ("bytes", "took_ms", "ok", "reason")} for e in ck if e.get("pid") == pid]
        row["restores"] = [{k: e.get(k) for k in ("bytes", "took_ms", "ok", "reason")} for e in rs if e.get("pid") == pid]
        w = held_window(R.get("timeline") or [], pid)
        if w:
            row["held_s"] = [w[0], w[1]]
        else:
            warn.append(f"offline {pid}: the agent's /state never showed it locked or checkpointed")
        if w and t_go is not None and tl:  # (the simulated loop keeps no timeline)
            row["steps_while_held"] = ckpt_step.steps_between(tl, t_go + w[0] + 0.3, t_go + w[1] - 0.3) if w[1] - w[0] > 0.6 else 0
            row["steps_after"] = tl[-1][1] - max([s for tt, s in tl if tt <= t_go + w[1]] or [0])
        row["checks"] = res.get("checks")
        row["ballast_same"] = res["ballast_before"] == res["ballast_after"] if "ballast_after" in res else None
        loops.append(row)
        if not row["checkpoints"] or not all(c.get("ok") for c in row["checkpoints"]):
            warn.append(f"offline {pid} ({t.gb:g} GB): no successful checkpoint")
        if not row["restores"] or not all(c.get("ok") for c in row["restores"]):
            warn.append(f"offline {pid} ({t.gb:g} GB): no successful restore")
        if row.get("steps_while_held"):
            warn.append(f"offline {pid}: {row['steps_while_held']} training steps while the agent held it")
        if "steps_after" in row and not row["steps_after"]:
            warn.append(f"offline {pid}: no training step after the restore")
        if row["ballast_same"] is False:
            warn.append(f"offline {pid}: its extra memory changed across the checkpoint")
    # Largest first: the agent's decisions (its log), in order of what each loop held.
    R["evicted"] = evictions(agent_log)
    sizes = [g for _, g in R["evicted"]]
    R["largest_first"] = sizes == sorted(sizes, reverse=True) if len(sizes) > 1 and None not in sizes else None
    if R["largest_first"] is False:
        warn.append(f"not checkpointed largest first: {R['evicted']}")
    on = R["online"]
    failed = []  # what makes the run fail (the rest are warnings)
    if on.get("wait_s") is None:
        failed.append(f"online never got its memory: {str(on.get('error') or on.get('phase'))[-300:]}")
    elif (on.get("attempts") or 0) <= 1:
        failed.append("online's first allocation succeeded: the memory fit beside offline, nothing was measured")
    if not ck:
        failed.append("no checkpoint event")
    elif not all(e.get("ok") for e in ck + rs) or len(rs) < len(ck):
        failed.append("a checkpoint or restore failed or is missing")
    if R.get("agent_exit") not in (0, None):
        why = [l for l in open(agent_log, errors="replace").read().splitlines() if "panicked at" in l or "ERROR" in l][:2] if os.path.exists(agent_log) else []
        failed.append(f"the agent exited {R['agent_exit']}" + (f" ({' / '.join(x.strip()[:200] for x in why)})" if why else ""))
    if failed:
        R["error"] = "; ".join(failed)
    # Memory while online held its allocation (the sample where the agent or nvidia-smi saw
    # the least free).
    tl = R.get("timeline") or []
    if tl:
        key = (lambda s: (s.get("smi") or {}).get("free_mib", math.inf)) if not h.sim else (lambda s: (s.get("agent") or {}).get("free_bytes", math.inf))
        R["during"] = min(tl, key=key)
    mt = (R.get("metrics") or {}).get("calls") or {}
    if not mt.get("checkpoint", {}).get("count"):
        warn.append("no checkpoint in coloc_driver_call_seconds")
    R["timeline"] = tl[:: max(1, len(tl) // 120)]  # a few per second is plenty in results.json
    LOG(f"  memory run {R.get('sizes_gb')}: online wait {on.get('wait_s')} s ({on.get('attempts')} attempts), checkpoints "
        f"{[(e.get('pid'), e.get('bytes'), e.get('took_ms'), e.get('ok')) for e in ck]}, restores {[(e.get('pid'), e.get('took_ms'), e.get('ok')) for e in rs]}, "
        f"running again {R.get('running_again_s_after_online_exit')} s after online exited; warnings {warn}")


def reference(h, M, deadline):
    """One uninterrupted run of the same loop, as many steps as the longest run checked;
    every loop's checksums compared with it."""
    loops = [o for r in M["runs"] for o in r.get("offline") or []]
    last = max([o["checks"][-1][0] for o in loops if o.get("checks")] or [0])
    if not last:
        return
    if last > REFERENCE_STEPS:
        M["reference_capped"] = f"{last} steps checked, the reference runs {REFERENCE_STEPS}"
        last = REFERENCE_STEPS
    ref = Train(h, "memory-reference", 0, max_steps=last)
    try:
        ref.wait_ready(deadline)
        rj = ref.finish(deadline, stop=False)
    finally:
        h.end(ref.p, ref.tag, 10)
    refs = {s: v for s, v in rj.get("checks") or []}
    M["reference_steps"] = last
    for o in loops:
        mine = o.pop("checks", None) or []
        same = [refs.get(s) == v for s, v in mine if s in refs]
        o["checks_compared"] = len(same)
        o["checks_equal"] = all(same) and bool(same)
        if not o["checks_equal"]:
            M["errors"].append(f"offline {o['pid']}: parameter checksums differ from the uninterrupted run")


# ---- the step -------------------------------------------------------------------------------

def preconditions(h, M):
    """The agent's flags and the driver's checkpoint API, before anything starts."""
    agent = os.path.join(h.bin, "coloc-agent")
    try:
        p = subprocess.run([agent, "run", "--help"], capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL)
        text = p.stdout + p.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"coloc-agent run --help: {e!r}") from None
    missing = [f for f in AGENT_FLAGS if f not in text]
    if missing:
        raise RuntimeError(f"the agent in {h.bin} has no {', '.join(missing)} (built before memory preemption and the driver's lock)")
    probe = ckpt(h, "state", os.getpid(), wait_s=30)  # this process has no CUDA: whether the API loads (--cuda-lib)
    M["driver"] = {k: probe.get(k) for k in ("library", "driver_version", "load_ms", "load_error")}
    if probe.get("load_error") or probe.get("hung") or "calls" not in probe:
        raise RuntimeError(f"the driver's checkpoint API cannot be used (driver 570 or later needed): {json.dumps(probe)[:600]}")


def run(h, deadline):
    a = h.a
    parts = parse_parts(a.memory_parts)
    M = h.results["memory"] = {"parts": parts, "runs": [], "rows": [], "errors": [], "restore_after_s": a.memory_restore_after_s,
                               "row_duration_s": a.memory_row_duration}
    if not h.sim:
        row = smi("name,driver_version,memory.total")
        M["gpu"] = row[0] if row else None
    preconditions(h, M)
    if "preempt" in parts:
        for i, sizes in enumerate(parse_runs(a.memory_runs)):
            R = {"sizes_gb": sizes}
            M["runs"].append(R)
            left, want = deadline - time.monotonic(), run_need(h, sizes) + (0 if h.sim else start_s(h) + 15)
            if left < want:
                R["skipped"] = f"the step's deadline: {left:.0f} s left, the run needs about {want:.0f} s"
                continue
            try:
                preempt_run(h, R, sizes, deadline, i)
            except Exception as ex:  # noqa: BLE001  (one run: recorded, the others run)
                R["error"] = f"{type(ex).__name__}: {ex}"[:1500]
            if R.get("error"):
                M["errors"].append(f"run {'+'.join(f'{g:g}' for g in sizes)}: {R['error'][:300]}")
            h.save()
        if not h.sim:
            try:
                reference(h, M, deadline)
            except Exception as ex:  # noqa: BLE001
                M["reference_error"] = f"{type(ex).__name__}: {ex}"[:1500]
                M["errors"].append("the reference run failed")
        for R in M["runs"]:
            for o in R.get("offline") or []:
                o.pop("checks", None)
        h.save()
    if "lock" in parts:
        for name, step, online, offline, agent in ROWS:
            row = {"scenario": name}
            M["rows"].append(row)
            left, want = deadline - time.monotonic(), row_need(h, online, offline)
            if left < want:
                row["skipped"] = f"the step's deadline: {left:.0f} s left, the row needs about {want:.0f} s"
                continue
            try:
                h.scenario(row, step, online, offline, agent, deadline, duration=a.memory_row_duration)
            except Exception as ex:  # noqa: BLE001
                row["error"] = f"{type(ex).__name__}: {ex}"[:1500]
            # The lock row holds by the driver's lock or shows nothing.
            bad = [w for w in row.get("warnings", []) if agent and w.startswith(("no hold by the driver's lock", "the agent exited", "offline left held"))]
            if row.get("error") or bad:
                M["errors"].append(f"{name}: {'; '.join(([str(row['error'])] if row.get('error') else []) + bad)[:300]}")
            h.save()
    if M["errors"]:
        raise RuntimeError(f"memory: {'; '.join(M['errors'])[:1500]}")


# ---- report ---------------------------------------------------------------------------------

def f(v, d=1):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:.{d}f}" if isinstance(v, float) else str(v)


def render(M, scenario_table):
    """The step's section of results.md."""
    out = ["", "## Memory preemption and the driver's lock (the agent on the GPU)", "",
           f"GPU: {M.get('gpu')}; checkpoint API: {json.dumps(M.get('driver'))}. Per run: seeded training loops (ckpt_train.py) with extra device "
           "memory, classed offline with `checkpoint = true`; an online process that needs M GiB, more than is free beside them, retrying its "
           f"allocation every few ms. The agent: --driver-lock, --memory-reserve (M plus a margin), --restore-after {f(M.get('restore_after_s'), 0)} s. "
           "Online's wait: from its first allocation attempt to its success. Memory before, while online held M (the least free seen), after the restores: nvidia-smi, "
           "and the agent's own reading (NVML, in /state). "
           f"Checksums: each loop's parameters every 20 steps against an uninterrupted run ({M.get('reference_steps')} steps).", "",
           "| offline extra GB (MiB held) | online needs GiB (reserve MiB) | online wait s (attempts) | checkpoints: GiB, ms, ok (in order) | restores: ms, ok | "
           "last restore done / running again, s after online exited | GPU MiB used before / during / after | the agent's free GiB before / during / after | steps while held / after | "
           "checksums equal (n) | extra memory same | checks |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for R in M.get("runs") or []:
        name = "+".join(f"{g:g}" for g in R.get("sizes_gb") or [])
        if R.get("skipped"):
            out.append(f"| {name} | skipped: {R['skipped']} |||||||||||")
            continue
        loops = R.get("offline") or []
        on = R.get("online") or {}
        held = " + ".join(f"{o.get('gb'):g} ({f(o.get('mib'))})" for o in loops) or name
        cks = "; ".join(f"{(e.get('bytes') or 0) / GIB:.1f}, {f(e.get('took_ms'), 0)}, {e.get('ok')}" for e in R.get("events") or []
                        if (e.get("event") or e.get("kind")) == "checkpoint") or "-"
        rss = "; ".join(f"{f(e.get('took_ms'), 0)}, {e.get('ok')}" for e in R.get("events") or [] if (e.get("event") or e.get("kind")) == "restore") or "-"
        used = lambda s: f((s or {}).get("used_mib"))
        during = (R.get("during") or {}).get("smi")
        free = lambda s: f((s or {})["free_bytes"] / GIB, 2) if (s or {}).get("free_bytes") is not None else "-"
        steps = ", ".join(f"{f(o.get('steps_while_held'))} / {f(o.get('steps_after'))}" for o in loops) or "-"
        checks = ", ".join(f"{o.get('checks_equal')} ({f(o.get('checks_compared'))})" for o in loops) or "-"
        same = ", ".join(str(o.get("ballast_same")) for o in loops) or "-"
        notes = "; ".join(([f"ERROR {R['error'][:200]}"] if R.get("error") else []) + R.get("warnings", [])) or "ok"
        out.append(f"| {held} | {f(R.get('online_gib'), 2)} ({f(R.get('reserve_mib'))}) | {f(on.get('wait_s'), 2)} ({f(on.get('attempts'))}) | {cks} | {rss} | "
                   f"{f(R.get('restored_s_after_online_exit'), 1)} / {f(R.get('running_again_s_after_online_exit'), 1)} | {used(R.get('before'))} / {used(during)} / {used(R.get('after'))} | "
                   f"{free(R.get('agent_memory_before'))} / {free((R.get('during') or {}).get('agent'))} / {free(R.get('agent_memory_after'))} | {steps} | {checks} | "
                   f"{same} | {notes.replace('|', '/')[:400]} |")
    for R in M.get("runs") or []:
        mt = R.get("metrics") or {}
        if not mt and not R.get("agent_log"):
            continue
        out += ["", f"Run {'+'.join(f'{g:g}' for g in R.get('sizes_gb') or [])}, the agent's driver metrics: " +
                "; ".join(f"{op}: {c.get('count')} calls, mean {f(c.get('mean_ms'))} ms, buckets {json.dumps(c.get('buckets'))}" for op, c in (mt.get("calls") or {}).items()) +
                f"; failures {json.dumps(mt.get('failures'))}; bytes {json.dumps(mt.get('bytes'))}; gauges {json.dumps(mt.get('gauges'))}.",
                "", "Its log lines about them:", "", "```"] + [x for x in R.get("agent_log") or []][:20] + ["```"]
    if M.get("reference_error"):
        out.append(f"\nReference run: ERROR {M['reference_error'][:300]}")
    rows = M.get("rows") or []
    if rows:
        out += ["", f"The driver's lock as the hold ({f(M.get('row_duration_s'), 0)} s per row; offline steps/s over online's window, against offline alone):", "",
                scenario_table(rows)]
        for r in rows:
            if r.get("driver_calls") is not None:
                out.append(f"\n{r['scenario']}: the driver's calls {json.dumps(r['driver_calls'])}, a lock {f(r.get('driver_lock_ms_mean'), 2)} ms on average; "
                           f"preemptions by actuator {json.dumps(r.get('actuators'))}.")
    return "\n".join(out)
