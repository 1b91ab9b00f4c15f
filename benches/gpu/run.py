#!/usr/bin/env python3
"""Real-GPU co-location harness, and the same harness on the simulated GPU (--sim).

Steps, in this order (most important facts first; --only/--skip pick steps or groups):
  preflight      binaries (sha256, version), nvidia-smi, PyTorch sees the GPU, the shim
                 loads into a PyTorch process without breaking it (online and offline class)
  probe          coloc-bench --nvml-probe beside a training loop: NVML call cost, sample
                 period (passed to every agent below as --nvml-sample-period), freshness,
                 drain after SIGSTOP
  shim           shim_check.py: PyTorch unchanged under the shim (online; offline under a
                 real gate), its pages, its cost per launch
  warmup         one short online run, thrown away (cold GPU, cold page cache)
  online-alone | offline-alone | no-agent (both, no agent) | dry-run (agent --dry-run)
  | signal (NVML only) | freezer (NVML only; skipped without a cgroup v2 freezer)
  | doorbell (online under libcoloc_cuda.so) | gate (doorbell + --gate, offline under the
  shim too, K = --gate-inflight) | learned (the gate row with --release learned, online's
  shim waking the agent after --release-floor-ms gaps) | at-once (the gate row with
  --release at-once, online's shim waking the agent after --at-once-wake-ms gaps, the
  agent polling every 100us while it awaits a completion stamp) | driver-lock (the gate row with
  --driver-lock: the driver's lock holds offline once its gate drained): each --duration
  seconds, one GPU
  wake-floor     coloc-bench --wake-floor (CPU only: the floor under launch -> decision),
                 with and without a CPU wake-up latency request (--cpu-wake-latency 0)
  nvml-load      burst.py alone (tiny kernels, each waited for) while coloc-bench
                 --nvml-poll calls what the agent's loop calls (process list, samples) every
                 1 / 10 / 100 ms (--nvml-load-intervals): does the driver's lock slow
                 online work?
  drain          burst.py (an online probe: bursts of tiny kernels, each waited for) beside
                 a training loop, per --drain-configs: alone; sharing, no agent; SIGSTOP at
                 two model sizes (freezer:M on request); the gate at K = 1 and 4 with the
                 default budget, K = 4 without it. Per
                 config: how long offline's queued work delays online after online starts
                 (the drain, as online sees it), online kernel latency meanwhile, the
                 agent's preemption latency, and offline throughput with no online work
                 (with the gate open: the price of K)
  checkpoint     the CUDA driver's checkpoint API (coloc-bench --cuda-checkpoint) against
                 a seeded training loop per --ckpt-gb size: lock, checkpoint, restore,
                 unlock timed, GPU memory freed, results identical after; the driver's
                 answers out of order (a stopped process included); the lock beside the
                 large model and online kernel latency while offline is locked (ckpt_step.py)
  memory         the agent's memory preemption and driver's lock end to end (mem_step.py):
                 training loops holding --memory-runs extra GB, classed offline with
                 checkpoint = true, and an online process (mem_online.py) that needs more
                 memory than is free beside them; the agent (--driver-lock, --memory-reserve,
                 --restore-after) checkpoints them and restores them after online exits:
                 online's wait for its memory, the agent's events and driver metrics, GPU
                 memory before / during / after, the loops' checksums against an
                 uninterrupted run. Then online alone, offline alone and the driver-lock row,
                 --memory-row-duration s each. Fails at once without the agent's flags or
                 the driver's checkpoint API
  tsg            probe: a training loop (probes/tsg_train.py) learns its own channel groups
                 through probes/tsg_hook.c (LD_PRELOAD, built here with cc or --tsg-hook)
                 and sets their time slice (NVA06C_CTRL_CMD_SET_TIMESLICE): the smallest
                 of --tsg-candidates the driver accepts, burst.py's kernel latency beside
                 the loop at the default, at that minimum and at the default again
  timeslice-policy  probe: nvidia-smi compute-policy --set-timeslice=N per
                 --timeslice-values, a training loop started after each change, burst.py
                 and online.py beside it; the policy read before restored at the end
  mps            probe: an MPS control daemon, online and offline as its clients (offline
                 plain, with CUDA_MPS_CLIENT_PRIORITY=--mps-priority, with
                 CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=--mps-thread-pct): online p99 against
                 alone, offline steps/s; kernel latency while offline is SIGSTOPped; the
                 driver's lock on an MPS client; the PIDs NVML names; the daemon quit at
                 the end. The three probes run no agent (probes/README.md)
Groups: part1 = preflight probe shim warmup online-alone offline-alone no-agent dry-run;
        part2 = preflight probe signal freezer doorbell gate learned wake-floor;
        part3 = preflight drain nvml-load; part4 = preflight checkpoint; probes = preflight tsg timeslice-policy mps
        (about 10.5 minutes by the steps' estimates: split it, --only preflight,tsg,mps then
        --only preflight,timeslice-policy, where a command must end within 10); all. The step
        memory runs alone (--only memory: 164 s on the H100, --budget 240).
The parts (part1 ... part4) take about 5-7 minutes each, for machines that are lent
for short runs; `--merge DIR DIR DIR --out DIR` joins their results (no GPU needed).

Every step runs in its own try/except; results.json and results.md are rewritten
atomically after every step, and artifacts.tar.gz (agent logs, event logs, /state,
per-process JSON and logs) is repacked; a step that fails is recorded and the run goes
on; SIGTERM ends the step in hand (teardown), records it and writes everything. --budget
is a deadline for the whole run: a step that would not fit is skipped and recorded.
Output (top level of --out): results.json, results.md, progress.log, artifacts.tar.gz,
and shim-check.json when the shim step ran.

  PYTHONUNBUFFERED=1 python3 benches/gpu/run.py --bin .gpubin --out results/p1 --only part1 --budget 480 --commit SHA
  python3 benches/gpu/run.py --sim --bin target/debug --duration 5 --out /tmp/r        # no GPU
  python3 benches/gpu/run.py --merge /tmp/p1 /tmp/p2 --out /tmp/gpu                       # join parts

Uses only the Python standard library and, without --sim, PyTorch with CUDA in child
processes (the harness itself never touches the GPU); binaries come from --bin (built and
stripped on a build machine and copied over: a GPU machine needs no Rust toolchain and no
package registry).
"""
import argparse, bisect, hashlib, io, json, math, os, platform, re, shutil, signal, subprocess, sys, tarfile, tempfile, time, traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import shim_check  # noqa: E402  (standard library only: its child-process helpers)
import ckpt_step  # noqa: E402  (the checkpoint step)
import mem_step  # noqa: E402  (the memory step)
sys.path.insert(0, os.path.join(HERE, "probes"))
import probe_steps  # noqa: E402  (the driver probes: tsg, timeslice-policy, mps)

T0 = time.monotonic()
PROGRESS = []  # the progress.log file, once --out exists

ROWS = [  # step, scenario, online, offline, agent: None or (actuator, dry_run, launch)
    ("online-alone", "online alone", True, False, None),
    ("offline-alone", "offline alone", False, True, None),
    ("no-agent", "both, no agent", True, True, None),
    ("dry-run", "both, agent dry-run", True, True, ("signal", True, None)),
    ("signal", "both, agent signal", True, True, ("signal", False, None)),
    ("freezer", "both, agent freezer", True, True, ("freezer", False, None)),
    ("doorbell", "both, agent doorbell", True, True, ("signal", False, "doorbell")),
    ("gate", "both, agent doorbell + gate", True, True, ("signal", False, "gate")),
    ("learned", "both, agent doorbell + gate + learned release", True, True, ("signal", False, "learned")),
    ("at-once", "both, agent doorbell + gate + release at once", True, True, ("signal", False, "at-once")),
    ("driver-lock", "both, agent doorbell + gate + driver lock", True, True, ("signal", False, "lock")),
]
ORDER = ["preflight", "probe", "nvml-view", "shim", "warmup"] + [r[0] for r in ROWS] + ["wake-floor", "drain", "nvml-load", "checkpoint", "memory", "tsg", "timeslice-policy", "mps"]
PROBES = ("tsg", "timeslice-policy", "mps")
GROUPS = {
    "part1": ["preflight", "probe", "shim", "warmup", "online-alone", "offline-alone", "no-agent", "dry-run"],
    "part2": ["preflight", "probe", "nvml-view", "signal", "freezer", "doorbell", "gate", "learned", "at-once", "wake-floor"],
    "part3": ["preflight", "drain", "nvml-load"],
    "part4": ["preflight", "checkpoint"],
    "probes": ["preflight", *PROBES],
    "rows": [r[0] for r in ROWS],
    "all": ORDER,
}
# Used for NVML-only rows when neither --nvml-sample-period nor a probe gives one: the
# agent's own default.
FALLBACK_SAMPLE_PERIOD = "200ms"
BINARIES = ("coloc-agent", "coloc-bench", "libcoloc_cuda.so")
# The drain step's training loops: offline.py's arguments on a real GPU (fp32: "large" is
# about 1 ms per GEMM on an H100, "small" tens of microseconds), the simulated kernel per
# step with --sim. The simulated GPU shares the GPU evenly, where a real one gives time
# slices, so --sim checks the harness, not the figures.
MODELS = {"small": (["--batch", "64", "--width", "4096", "--layers", "4"], "0.5"),
          "large": (["--batch", "512", "--width", "8192", "--layers", "8"], "2")}
DRAIN_CONFIGS = "alone,share:large,signal:small,signal:large,gate1:large,gate4:large,gate4+0ms:large,gate4:small"

# A PyTorch process that checks the GPU: versions, a GEMM and an fp16 linear, checksums,
# and (under the shim) its own doorbell pages.
TORCH_PROBE = shim_check.PAGES_CODE + r'''
import json, time, traceback
out = {}
t0 = time.monotonic()
try:
    import torch
    out.update(torch=torch.__version__, cuda=torch.version.cuda, import_s=time.monotonic() - t0)
    out["available"] = torch.cuda.is_available()
    if out["available"]:
        t1 = time.monotonic()
        out.update(device=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)),
                   count=torch.cuda.device_count(), cudnn=torch.backends.cudnn.version())
        torch.manual_seed(0)  # the Linear's initial weights too: runs with and without the shim compare
        a = torch.randn(1024, 1024).cuda()
        b = a @ a
        lin = torch.nn.Linear(512, 512).cuda().half()
        y = lin(torch.ones(8, 512, device="cuda", dtype=torch.half))
        torch.cuda.synchronize()
        out.update(gemm_sum=b.double().sum().item(), linear_sum=y.double().sum().item(), cuda_init_s=time.monotonic() - t1)
    out["pages"] = read_pages()
except Exception:
    out["error"] = traceback.format_exc()[-2000:]
print("RESULT " + json.dumps(out), flush=True)
'''


def log(msg):
    line = f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - T0:6.1f}s] {msg}"
    try:
        print(line, flush=True)
    except (OSError, RuntimeError, ValueError):  # a reentrant call from a signal handler, a closed pipe
        pass
    for f in PROGRESS:
        try:
            f.write(line + "\n")
            f.flush()
        except (OSError, ValueError):
            pass


class Interrupted(BaseException):
    """SIGTERM/SIGINT/SIGHUP to the harness: not an `Exception`, so no step swallows it."""


def on_signal(sig, _frame):
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, lambda sg, _f: log(f"signal {sg} again: finishing the teardown and the results"))
    raise Interrupted(sig)


def pct(v, q):
    v = sorted(x for x in v if x is not None)
    return v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))] if v else None


def duration_ms(s):
    """'100ms' / '0.1s' / '100000us' -> milliseconds (the agent's duration syntax)."""
    for unit, f in (("ms", 1.0), ("us", 1e-3), ("µs", 1e-3), ("ns", 1e-6), ("s", 1e3), ("m", 6e4)):
        if s.endswith(unit):
            return float(s[: -len(unit)]) * f
    raise SystemExit(f"{s!r}: a duration needs a unit (ms, us, s)")


def sanitize(name):
    """A portable file name for the output: letters, digits, '.', '_' and '-'."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "x"


def clean(v):
    """NaN and infinities -> None (JSON has neither)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, list) or isinstance(v, tuple):
        return [clean(x) for x in v]
    if isinstance(v, dict):
        return {k: clean(x) for k, x in v.items()}
    return v


def write_atomic(path, text):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def tail(path, n=1500):
    return shim_check.tail(path, n)


def free_port():
    return shim_check.free_port()


get = shim_check.http_get


def cgroup_dir(name):
    for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        if os.path.exists(os.path.join(root, "cgroup.controllers")):
            d = os.path.join(root, name)
            try:
                os.makedirs(d, exist_ok=True)
            except OSError:
                return None
            if os.path.exists(os.path.join(d, "cgroup.freeze")):
                return d
            try:
                os.rmdir(d)
            except OSError:
                pass
            return None
    return None


def cg_root(d):
    return "/sys/fs/cgroup/unified" if d.startswith("/sys/fs/cgroup/unified") else "/sys/fs/cgroup"


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def cmd_out(cmd, timeout=10.0):
    """stdout of a short command; never raises (the error as text)."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        return p.stdout.strip() if p.returncode == 0 else f"(exit {p.returncode}: {p.stderr.strip()[-300:]})"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"({type(e).__name__}: {e})"


def proc_cpu_s(pid):
    """CPU seconds (user + system) a live process has used, from /proc; None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def steps_at(timeline, t):
    """Steps done at monotonic time t, interpolated linearly on the (t, steps) timeline."""
    ts = [p[0] for p in timeline]
    i = bisect.bisect_left(ts, t)
    if i <= 0:
        return timeline[0][1]
    if i >= len(ts):
        return timeline[-1][1]
    (t0, s0), (t1, s1) = timeline[i - 1], timeline[i]
    return s0 + (s1 - s0) * (t - t0) / (t1 - t0) if t1 > t0 else s1


def event_stats(path, since_ns=None):
    """The agent's event log: preemption, detection and release latencies (p50, p99 in
    ms, and how many), preemptions by signal and by actuator, fail-open events; with
    `since_ns` (CLOCK_REALTIME), only the events from then on."""
    ev = []
    with open(path) as f:
        for line in f:
            try:
                e = json.loads(line)
            except ValueError:
                continue
            t = e.get("onset_ns") or e.get("window_end_ns") or e.get("decided_ns")
            if since_ns is None or t is None or t >= since_ns:
                ev.append(e)
    pre = [e["preemption_s"] * 1e3 for e in ev if e.get("preemption_s") is not None]
    det = [e["detection_s"] * 1e3 for e in ev if e.get("event") == "preempt" and e.get("detection_s") is not None]
    rel = [e["release_s"] * 1e3 for e in ev if e.get("release_s") is not None]
    signals, acts = {}, {}
    for e in ev:
        if e.get("event") == "preempt":
            signals[e.get("signal")] = signals.get(e.get("signal"), 0) + 1
            if e.get("actuator"):
                acts[e["actuator"]] = acts.get(e["actuator"], 0) + 1
    return dict(preemptions=sum(1 for e in ev if e.get("event") == "preempt"), preemption_ms=[pct(pre, 50), pct(pre, 99)], preemption_n=len(pre),
                detection_ms=[pct(det, 50), pct(det, 99)], detection_n=len(det), release_ms=[pct(rel, 50), pct(rel, 99)], release_n=len(rel),
                signals=signals, actuators=acts, fail_open=sum(1 for e in ev if e.get("event") == "fail_open"))


def items(spec):
    """A comma-separated option's items, stripped, empty ones dropped."""
    return [x.strip() for x in (spec or "").split(",") if x.strip()]


def parse_intervals(spec):
    """--nvml-load-intervals: "none" (no polling) or a poll interval in ms, comma-separated."""
    out = []
    for x in items(spec):
        if x != "none":
            try:
                if not float(x) > 0:
                    raise ValueError
            except ValueError:
                raise SystemExit(f"--nvml-load-intervals: {x!r} is neither 'none' nor a positive number of ms") from None
        out.append(x)
    return out


def parse_rates(spec):
    """--nvml-view-rates: positive request rates per second."""
    out = []
    for x in items(spec):
        try:
            v = float(x)
        except ValueError:
            v = -1.0
        if not (v > 0 and math.isfinite(v)):
            raise SystemExit(f"--nvml-view-rates: {x!r} is not a positive rate (requests per second)")
        out.append(v)
    return out


def nvml_view_stats(samples, pid, records, period_ms):
    """What NVML's per-process samples show of one online process whose requests are known.

    samples: [pid, timestamp µs, sm %, mem %] (zeros included); records: (start ns, done ns)
    of each request on the same clock (wall). A request counts as seen when a sample of the
    process with any utilisation has its timestamp from the request's start to 1.25 sample
    periods after its end (the agent's own rule for a sample's reach)."""
    mine = sorted((s[1], s[2], s[3]) for s in samples if s[0] == pid)
    ts = [m[0] for m in mine]
    gaps = [(b - a) / 1e3 for a, b in zip(ts, ts[1:])]
    active = [m for m in mine if m[1] > 0 or m[2] > 0]
    reach_ns = 1.25 * period_ms * 1e6
    act_ns = sorted(m[0] * 1000 for m in active)
    seen = 0
    for st, done in records:
        i = bisect.bisect_left(act_ns, st)
        if i < len(act_ns) and act_ns[i] <= done + reach_ns:
            seen += 1
    busy = sum(d - st for st, d in records)
    span = (records[-1][1] - records[0][0]) if records else 0
    sm = sorted(m[1] for m in mine)
    return {"samples": len(mine), "samples_active": len(active), "interval_ms": [pct(gaps, 50), pct(gaps, 99)],
            "sm_util": [pct(sm, 50), pct(sm, 99), sm[-1] if sm else None], "sm_values": sorted(set(sm))[:20],
            "requests": len(records), "requests_seen": seen, "seen_share": seen / len(records) if records else None,
            "busy_share": busy / span if span else None, "other_pids": sorted({s[0] for s in samples} - {pid})}


def parse_drain(spec):
    """--drain-configs: alone | share:MODEL | signal:MODEL | freezer:MODEL | gateK[+Bms]:MODEL
    (K: COLOC_SHIM_INFLIGHT; B: COLOC_SHIM_INFLIGHT_MS, the shim's default when not given)."""
    out = []
    for x in items(spec):
        kind, _, model = x.partition(":")
        m = re.fullmatch(r"gate(\d+)(?:\+(\d+(?:\.\d+)?)ms)?", kind)
        ok = (kind == "alone" and not model) or (model in MODELS and (kind in ("share", "signal", "freezer") or m))
        if not ok:
            raise SystemExit(f"--drain-configs: {x!r}: want alone, share:M, signal:M, freezer:M or gateK[+Bms]:M with M in {', '.join(MODELS)}, "
                             "K a whole number (0: unbounded) and B a number of ms (0: no budget)")
        out.append({"name": x, "model": model or None, "actuator": None if kind in ("alone", "share") else ("signal" if m else kind),
                    "gate": bool(m), "inflight": int(m.group(1)) if m else None, "inflight_ms": m.group(2) if m else None})
    return out


# A drain has ended when the probe's kernels are back at the baseline for this long (and
# at least three of them): longer than a GPU time slice, so that a kernel that slipped in
# between two slices of the other process does not end it.
CLEAN_MS = 2.0
# The drain threshold is never more than p50 above the baseline p50 times this (see
# burst_stats): CI once saw a baseline p90 at 1.7 p50, which put the threshold over the
# twofold step the simulated GPU makes and measured no drain at all.
THRESHOLD_CAP = 0.75


def drain_end(ks, thr, clean_ms=CLEAN_MS):
    """Index of the first kernel of the first run of kernels at or under `thr` that spans
    `clean_ms` and three kernels (or reaches the burst's end with three); None if none."""
    i, n = 0, len(ks)
    while i < n:
        if ks[i][1] > thr:
            i += 1
            continue
        j = i
        while j < n and ks[j][1] <= thr:
            if j - i >= 2 and (ks[j][0] - ks[i][0]) * 1e3 >= clean_ms:
                return i
            j += 1
        if j == n and j - i >= 3:
            return i
        i = j + 1
    return None


def burst_stats(kernels, spans, base):
    """One probe run against the baseline (p50, p90, p99 of kernel latency alone, ms): per
    burst, the drain as online sees it (from the burst's start to the first run of kernels
    back at the baseline, see drain_end: latency <= p50 + max(p50 / 2, 2 (p90 - p50)), capped
    at 1.75 p50; p90, not p99, so that a few slow kernels of the baseline run do not hide a
    drain, and the cap so that a noisy baseline does not either: a kernel slowed twofold (the
    simulated GPU's even share) is always over it, a noise spike of a clean run may be, and
    only delays the end by a few kernels), the first
    kernel's latency, and the delay until the drain ended (the latency above p50 of the
    kernels over that threshold, summed: what online lost to the drain, without the noise
    of the rest of the burst)."""
    lat = [k[1] for k in kernels]
    out = {"kernels": len(lat), "bursts": len(spans), "latency_ms": [pct(lat, 50), pct(lat, 99), max(lat) if lat else None]}
    if not base:
        out["note"] = "no baseline (the 'alone' configuration did not run): drain not computed"
        return out
    b50, b90 = base[0], base[1]
    thr = b50 + min(max(b50 / 2, 2 * (b90 - b50)), THRESHOLD_CAP * b50)
    drains, firsts, delays, open_ended = [], [], [], 0
    for s0, s1 in spans:
        ks = [k for k in kernels if s0 <= k[0] <= s1]
        if not ks:
            continue
        firsts.append(ks[0][1])
        end = drain_end(ks, thr)
        delays.append(sum(k[1] - b50 for k in ks[:len(ks) if end is None else end] if k[1] > thr))
        if end is None:
            open_ended += 1
        else:
            drains.append((ks[end][0] - s0) * 1e3)
    out.update(threshold_ms=thr, drain_ms=[pct(drains, 50), max(drains) if drains else None], drain_n=len(drains), drain_not_ended=open_ended,
               first_kernel_ms=[pct(firsts, 50), max(firsts) if firsts else None], delay_ms=[pct(delays, 50), max(delays) if delays else None])
    return out


class Harness:
    def __init__(self, a):
        self.a, self.sim = a, a.sim
        self.bin = os.path.abspath(a.bin)
        self.out = os.path.abspath(a.out)
        os.makedirs(self.out, exist_ok=True)
        PROGRESS.append(open(os.path.join(self.out, "progress.log"), "a", encoding="utf-8"))
        self.tmp = tempfile.mkdtemp(prefix="coloc-gpu-")
        self.art = os.path.join(self.tmp, "artifacts")
        os.makedirs(self.art)
        self.deadline = T0 + a.budget
        self.live = []  # [kind, name, Popen]: every process we started and have not ended
        self.cgroups = []
        self.hurry = False
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.gpu_daemon = None
        self.shim = os.path.abspath(a.shim or os.path.join(self.bin, "libcoloc_cuda.so"))
        self.bells = os.path.join(self.tmp, "bells")
        self.gate_file = os.path.join(self.tmp, "gate", "gates")
        os.makedirs(self.bells)
        os.makedirs(os.path.dirname(self.gate_file))
        os.chmod(os.path.dirname(self.gate_file), 0o755)  # the agent refuses a group/other-writable one
        self.nvml = a.nvml_lib
        self.torch_ok = None  # None: not checked in this run
        self.shim_ok, self.shim_why = None, None
        self.period, self.period_source = None, None
        self.results = {"complete": False, "meta": {}, "steps": [], "preflight": None, "nvml_probe": None, "shim_check": None,
                        "warmup": None, "scenarios": [], "wake_floor": None, "nvml_load": None, "drain": None, "nvml_view": None, "checkpoint": None,
                        "memory": None, "probes": None}
        self.set_period()

    # ---- setup and bookkeeping ----------------------------------------------------------

    def start_sim(self):
        a = self.a
        self.env["COLOC_SIM_STATE"] = os.path.join("/dev/shm", f"coloc-gpu-bench-{os.getpid()}")
        self.gpu_daemon = subprocess.Popen([os.path.join(self.bin, "coloc-sim"), "gpu", "--gpus", "1", "--sample-period-ms", str(a.sim_sample_period_ms),
                                            "--memory-gib", f"{a.sim_memory_gib:g}"],
                                           env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.art, "sim-gpu.log"), "w"))
        until = time.monotonic() + 10
        while not os.path.exists(self.env["COLOC_SIM_STATE"]):
            if self.gpu_daemon.poll() is not None or time.monotonic() > until:
                raise RuntimeError(f"the simulated GPU did not start: {tail(os.path.join(self.art, 'sim-gpu.log'))}")
            time.sleep(0.01)
        time.sleep(0.1)
        self.nvml = os.path.join(self.bin, "libfake_nvml.so")
        # The simulated libcuda.so.1: every simulated workload submits through it (as
        # PyTorch does through the real one), so the shim sees its launches.
        cuda = os.path.join(self.tmp, "fake-cuda")
        os.makedirs(cuda)
        os.symlink(os.path.join(self.bin, "libfake_cuda.so"), os.path.join(cuda, "libcuda.so.1"))
        self.env["LD_LIBRARY_PATH"] = cuda

    def meta(self):
        a = self.a
        m = {"sim": a.sim, "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "steps_selected": self.selected, "budget_s": a.budget,
             "duration_s": a.duration, "rate": a.rate, "idle_window": a.idle_window, "poll_interval": a.poll_interval,
             "gate_inflight": a.gate_inflight, "probe_seconds": a.probe_seconds, "drain_configs": a.drain_configs, "python": sys.version.split()[0],
             "host": " ".join(platform.uname()), "argv": sys.argv[1:]}
        if a.commit:
            m.update(commit=a.commit, commit_source="--commit")
        else:
            c = cmd_out(["git", "-C", HERE, "rev-parse", "HEAD"], 5)
            ok = bool(re.fullmatch(r"[0-9a-f]{40}", c))
            m.update(commit=c if ok else None, commit_source="git" if ok else f"unknown (no --commit; git: {c})")
            if ok:
                m["dirty"] = cmd_out(["git", "-C", HERE, "status", "--porcelain", "--untracked-files=no"], 5) != ""
        bins = {}
        for b in BINARIES + (("coloc-sim", "libfake_nvml.so", "libfake_cuda.so") if a.sim else ()):
            p = self.shim if b == "libcoloc_cuda.so" else os.path.join(self.bin, b)
            try:
                bins[b] = {"sha256": sha256(p), "bytes": os.path.getsize(p)}
            except OSError as e:
                bins[b] = {"error": str(e)}
        m["binaries"] = bins
        m["agent_version"] = cmd_out([os.path.join(self.bin, "coloc-agent"), "--version"], 10)
        self.results["meta"] = m

    def set_period(self, probe=None):
        a = self.a
        if a.sim:
            self.period, self.period_source = f"{a.sim_sample_period_ms:g}ms", "the simulated driver's (--sim-sample-period-ms)"
        elif a.nvml_sample_period:
            self.period, self.period_source = a.nvml_sample_period, "--nvml-sample-period"
        elif probe is not None:
            p50 = ((probe.get("sample_interval_ms") or {}).get("p50"))
            if isinstance(p50, (int, float)) and math.isfinite(p50) and 5 <= p50 <= 10000 and (probe.get("samples") or 0) >= 5:
                self.period, self.period_source = f"{round(p50)}ms", "measured by the probe (sample interval p50)"
            else:
                self.period, self.period_source = FALLBACK_SAMPLE_PERIOD, f"fallback, the agent's default: the probe gave no usable period ({p50!r})"
        elif self.period is None:
            self.period, self.period_source = FALLBACK_SAMPLE_PERIOD, "fallback, the agent's default: no probe in this run"
        self.results["meta"]["nvml_sample_period"] = {"value": self.period, "source": self.period_source}

    def save(self):
        """results.json, results.md (atomic rewrites) and artifacts.tar.gz; never raises."""
        try:
            r = clean(self.results)
            write_atomic(os.path.join(self.out, "results.json"), json.dumps(r, indent=1))
            write_atomic(os.path.join(self.out, "results.md"), render(r))
        except Exception as e:  # noqa: BLE001
            log(f"cannot write the results: {e!r}")
        self.pack()

    def pack(self, cap=4 << 20):
        """Every artifact into one artifacts.tar.gz (a file over `cap` keeps its head and tail)."""
        dst = os.path.join(self.out, "artifacts.tar.gz")
        tmp = f"{dst}.tmp{os.getpid()}"
        try:
            with tarfile.open(tmp, "w:gz") as t:
                for name in sorted(os.listdir(self.art)):
                    p = os.path.join(self.art, name)
                    if not os.path.isfile(p):
                        continue
                    size = os.path.getsize(p)
                    if size <= cap:
                        t.add(p, arcname=name)
                        continue
                    with open(p, "rb") as f:
                        head = f.read(cap // 8)
                        f.seek(size - (cap - cap // 8))
                        data = head + f"\n[... {size - cap} bytes left out ...]\n".encode() + f.read()
                    ti = tarfile.TarInfo(name)
                    ti.size, ti.mtime = len(data), int(time.time())
                    t.addfile(ti, io.BytesIO(data))
            os.replace(tmp, dst)
        except Exception as e:  # noqa: BLE001
            log(f"cannot pack the artifacts: {e!r}")

    def remaining(self):
        return self.deadline - time.monotonic()

    def need(self, step):
        """About how long a step takes (s): one that needs more than the budget left is skipped."""
        a, start = self.a, (2.0 if self.sim else 25.0)  # a workload's start-up: torch import, CUDA, model
        return {"preflight": 5.0 if self.sim else 50.0,
                "probe": a.probe_seconds + start + 10,
                "shim": 130.0,
                "warmup": a.warmup_run + start + 5,
                # Two loads x four waiters, with and without a CPU wake-up latency request.
                "wake-floor": 2 * 2 * 4 * a.wake_floor_samples * 0.0275 + 10,
                "nvml-load": len(parse_intervals(a.nvml_load_intervals)) * (a.nvml_load_duration + start + 5),
                "nvml-view": len(parse_rates(a.nvml_view_rates)) * (a.nvml_view_seconds + start + 5),
                # The first two configurations (the baseline and one more): the step skips
                # those that would not fit its own deadline, one by one.
                "drain": sum(self.drain_need(c) for c in parse_drain(a.drain_configs)[:2]),
                "checkpoint": ckpt_step.need(a),
                "memory": mem_step.need(self),
                **{p: probe_steps.need(p, self) for p in PROBES},
                }.get(step, a.duration + start + 10)

    def drain_need(self, c):
        a, start = self.a, (1.0 if self.sim else 12.0)
        return (a.drain_open + start if c["model"] else 0) + start + a.drain_bursts * (a.drain_burst_ms + a.drain_gap_ms) / 1e3 + 4

    def blocked(self, step):
        """Why a step cannot run (an earlier result says so), or None."""
        if self.sim and step in ("timeslice-policy", "mps"):
            name = step.replace("-", "_")
            self.results["probes"] = self.results.get("probes") or {}
            self.results["probes"][name] = {"skipped": probe_steps.NEEDS_GPU, "plan": probe_steps.plan(step, self)}
            return f"{probe_steps.NEEDS_GPU} (the commands it would run: results.json, probes.{name}.plan)"
        if self.sim or step in ("preflight", "wake-floor"):
            return None
        if self.torch_ok is False:
            return "preflight: PyTorch cannot use the GPU"
        if step in ("doorbell", "gate", "learned", "at-once", "driver-lock", "drain") and self.shim_ok is False:
            return f"the shim broke PyTorch ({self.shim_why})"
        return None

    def run_step(self, name, fn, row=None):
        rec = {"step": name, "status": "running", "at_s": round(time.monotonic() - T0, 1)}
        self.results["steps"].append(rec)
        if row is not None:
            self.results["scenarios"].append(row)
        need, left = self.need(name), self.remaining()
        why = self.blocked(name) or (f"budget: {left:.0f} s left, the step needs about {need:.0f} s" if left < need else None)
        if why:
            rec.update(status="skipped", reason=why)
            if row is not None:
                row["skipped"] = why
            log(f"step {name}: skipped: {why}")
            self.save()
            return
        # The drain runs every configuration that fits: its deadline covers them all, while
        # the step starts as soon as the first two fit (need).
        span = sum(self.drain_need(c) for c in parse_drain(self.a.drain_configs)) if name == "drain" else need
        deadline = time.monotonic() + min(left - 3, max(2 * span, span + 60))
        log(f"step {name}: start (about {need:.0f} s; {left:.0f} s of the budget left)")
        t = time.monotonic()
        try:
            if self.a.fail_step == name and row is None:
                raise RuntimeError("failure injected with --fail-step")
            fn(deadline)
            rec["status"] = "ok"
            if row is not None and "error" in row:
                rec.update(status="error", error=row["error"])
            elif row is not None and "skipped" in row:
                rec.update(status="skipped", reason=row["skipped"])
        except Exception as e:  # noqa: BLE001
            rec.update(status="error", error=traceback.format_exc()[-3000:])
            if row is not None:
                row.setdefault("error", f"{type(e).__name__}: {e}")
            log(f"step {name}: ERROR {type(e).__name__}: {str(e)[:1000]}")
        except BaseException as e:
            rec.update(status="interrupted", error=repr(e))
            if row is not None:
                row.setdefault("error", "interrupted (the harness got a signal)")
            raise
        finally:
            rec["elapsed_s"] = round(time.monotonic() - t, 1)
            if rec["status"] in ("ok", "skipped"):
                log(f"step {name}: {rec['status']} in {rec['elapsed_s']} s" + (f" ({rec['reason']})" if rec.get("reason") else ""))
            elif rec["status"] == "error" and row is not None and "error" in row and "Traceback" not in rec["error"]:
                log(f"step {name}: ERROR {rec['error'][:1000]}")
            self.save()

    # ---- processes ------------------------------------------------------------------------

    def spawn(self, kind, name, cmd, env, logname=None):
        f = open(os.path.join(self.art, logname), "wb") if logname else subprocess.DEVNULL
        p = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT if logname else subprocess.DEVNULL)
        if logname:
            f.close()
        self.live.append([kind, name, p])
        return p

    def end(self, p, name, wait_s, cont=True):
        """Ends p: SIGCONT (a stopped process cannot take SIGTERM), SIGTERM, a bounded wait,
        then SIGKILL. Never raises, never waits longer than wait_s + 5 s. Its exit code."""
        if p is None:
            return None
        if self.hurry:
            wait_s = min(wait_s, 3)
        try:
            if p.poll() is None:
                if cont:
                    os.kill(p.pid, signal.SIGCONT)
                p.terminate()
                try:
                    p.wait(wait_s)
                except subprocess.TimeoutExpired:
                    log(f"{name}: still running {wait_s:g} s after SIGTERM: SIGKILL")
                    p.kill()
                    p.wait(5)
        except Exception as e:  # noqa: BLE001
            log(f"{name}: teardown: {e!r}")
        self.live = [x for x in self.live if x[2] is not p]
        return p.returncode

    @staticmethod
    def thaw(cg):
        try:
            with open(os.path.join(cg, "cgroup.freeze"), "w") as f:
                f.write("0")
        except OSError as e:
            log(f"cannot thaw {cg}: {e}")

    def drop_cgroup(self, cg):
        for _ in range(20):
            try:
                os.rmdir(cg)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.05)
        else:
            log(f"cannot remove {cg} (a process still in it?)")
        if cg in self.cgroups:
            self.cgroups.remove(cg)

    def teardown(self, agent, works, cg):
        """Agent first (SIGTERM: it resumes every offline process it holds before it exits,
        and stops re-stopping them), then the freezer thawed explicitly, then the workloads
        (SIGCONT, SIGTERM, bounded waits, SIGKILL). Exit codes by name."""
        rc = {}
        if agent is not None:
            rc["agent"] = self.end(agent, "agent", 10, cont=False)
        if cg:
            self.thaw(cg)
        for name, p in works:
            if p is not None:
                rc[name] = self.end(p, name, 30)
        if cg:
            self.drop_cgroup(cg)
        return rc

    def cleanup_all(self):
        """Whatever is still running (an interrupted step): agents, thaw, the rest."""
        self.hurry = True
        for kind, name, p in [x for x in self.live if x[0] == "agent"]:
            self.end(p, name, 5, cont=False)
        for cg in list(self.cgroups):
            self.thaw(cg)
        for kind, name, p in list(self.live):
            self.end(p, name, 5)
        for cg in list(self.cgroups):
            self.drop_cgroup(cg)
        if self.gpu_daemon:
            self.end(self.gpu_daemon, "simulated GPU", 5, cont=False)
            self.gpu_daemon = None

    def close(self):
        self.cleanup_all()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # ---- workloads --------------------------------------------------------------------------

    def online_cmd(self, out, duration=None, ready=None, rate=None):
        d = self.a.duration if duration is None else duration
        r = self.a.rate if rate is None else rate
        if self.sim:
            return [os.path.join(self.bin, "coloc-sim"), "online", "--rate", str(r), "--work-ms", str(self.a.sim_work_ms), "--duration-s", str(d), "--cuda", "--out", out]
        return [sys.executable, os.path.join(HERE, "online.py"), "--rate", str(r), "--duration", str(d), "--out", out] + (["--ready", ready] if ready else [])

    def offline_cmd(self, out, ready, model=None):
        if self.sim:
            step = MODELS[model][1] if model else "2"
            return [os.path.join(self.bin, "coloc-sim"), "offline", "--step-ms", step, "--cuda", "--out", out] + (["--depth", "16"] if model else [])
        return [sys.executable, os.path.join(HERE, "offline.py"), "--out", out, "--ready", ready] + (MODELS[model][0] if model else [])

    def burst_cmd(self, out, bursts=None, burst_ms=None, gap_ms=None):
        a = self.a
        args = ["--bursts", str(bursts or a.drain_bursts), "--burst-ms", str(burst_ms or a.drain_burst_ms),
                "--gap-ms", str(a.drain_gap_ms if gap_ms is None else gap_ms), "--out", out]
        if self.sim:
            # A 5 ms kernel: the simulated GPU shares itself evenly (a kernel beside another
            # process's work takes twice as long, where a real GPU's time slice makes it
            # wait far longer), so the kernel must be long against the daemon's 100 µs tick
            # and the wake-ups for the twofold step to stand out of the noise.
            return [os.path.join(self.bin, "coloc-sim"), "burst", "--kernel-us", "5000"] + args
        return [sys.executable, os.path.join(HERE, "burst.py")] + args

    def wait_ready(self, p, ready, name, logname, deadline, timeout=None):
        """Until the workload says it runs on the GPU (its --ready file, written after its
        first CUDA synchronisation); the simulated workloads start at once (--warmup)."""
        t = time.monotonic()
        limit = min(deadline, t + (self.a.ready_timeout if timeout is None else timeout))
        if self.sim:
            time.sleep(self.a.warmup)
        while not self.sim and not os.path.exists(ready):
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode} before it was ready: {tail(os.path.join(self.art, logname), 800)}")
            if time.monotonic() > limit:
                raise RuntimeError(f"{name} was not ready after {time.monotonic() - t:.0f} s: {tail(os.path.join(self.art, logname), 800)}")
            time.sleep(0.1)
        if p.poll() is not None:
            raise RuntimeError(f"{name} exited with {p.returncode}: {tail(os.path.join(self.art, logname), 800)}")
        log(f"  {name} ready after {time.monotonic() - t:.1f} s")

    def wait_exit(self, p, name, deadline):
        try:
            return p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{name} still running at the step's deadline") from None

    def start_agent(self, tag, rules, actuator, dry_run, gate, deadline, release=None, extra=()):
        port = free_port()
        events = os.path.join(self.art, f"{tag}-events.jsonl")
        cmd = [os.path.join(self.bin, "coloc-agent"), "run", "--rules", rules, "--nvml-lib", self.nvml,
               "--actuator", actuator, "--listen", f"127.0.0.1:{port}", "--state-dir", os.path.join(self.tmp, tag + "-state"),
               "--event-log", events, "--idle-window", self.a.idle_window,
               # At once: the agent looks at the pages every 100us while it awaits a stamp.
               "--poll-interval", "100us" if release == "at-once" else self.a.poll_interval,
               "--doorbell-dir", self.bells, "--nvml-sample-period", self.period]
        if dry_run:
            cmd.append("--dry-run")
        if gate:
            cmd += ["--gate", "--gate-file", self.gate_file]
        if release == "learned":
            cmd += ["--release", "learned", "--release-floor", f"{self.a.release_floor_ms:g}ms", "--release-drain", f"{self.a.release_drain_ms:g}ms"]
        elif release == "at-once":
            # The floor is what online's page must wake the agent within.
            cmd += ["--release", "at-once", "--release-floor", f"{self.a.at_once_wake_ms * 1000:g}us"]
        cmd += list(extra)
        logname = f"{tag}-agent.log"
        ag = self.spawn("agent", f"{tag} agent", cmd, self.env, logname)
        limit, last = min(deadline, time.monotonic() + 15), ""
        while True:
            if ag.poll() is not None:
                raise RuntimeError(f"the agent exited with {ag.returncode} before it was ready: {tail(os.path.join(self.art, logname))}")
            try:
                code, body = get(port, "/readyz", 1.0)
                if code == 200:
                    return ag, port, events
                last = f"/readyz {code}: {body.strip()}"
            except OSError as e:
                last = repr(e)
            if time.monotonic() > limit:
                raise RuntimeError(f"the agent was not ready after 15 s ({last}): {tail(os.path.join(self.art, logname))}")
            time.sleep(0.05)

    def rules(self, tag, cgroup, online="online"):
        if cgroup:
            off = f'cgroup = "/{os.path.relpath(cgroup, cg_root(cgroup))}"'
        else:
            off = 'cmdline = "*coloc-sim offline*"' if self.sim else 'cmdline = "*benches/gpu/offline.py*"'
        on = f'cmdline = "*coloc-sim {online}*"' if self.sim else f'cmdline = "*benches/gpu/{online}.py*"'
        p = os.path.join(self.art, f"{tag}-rules.toml")
        with open(p, "w") as f:
            f.write(f'[[rule]]\nname = "offline"\nclass = "reclaimed_cores"\n{off}\n[[rule]]\nname = "online"\nclass = "shared_cores"\n{on}\n')
        return p

    def shim_env(self, cls, inflight=None, inflight_ms=None, wake_gap_ms=None):
        """The environment of a workload under the shim (what `coloc-agent exec` sets)."""
        env = dict(self.env, LD_PRELOAD=self.shim, COLOC_SHIM_CLASS=cls, COLOC_DOORBELL_DIR=self.bells)
        if cls == "online":
            env["COLOC_SHIM_WAKE_GAP_MS"] = f"{wake_gap_ms:g}" if wake_gap_ms is not None else str(duration_ms(self.a.idle_window))
        else:
            k = self.a.gate_inflight if inflight is None else inflight
            env.update(COLOC_GATE_FILE=self.gate_file, COLOC_SHIM_INFLIGHT=str(k))
            # The shim's default unless a configuration names one (not the caller's).
            env.pop("COLOC_SHIM_INFLIGHT_MS", None)
            if inflight_ms is not None:
                env["COLOC_SHIM_INFLIGHT_MS"] = str(inflight_ms)
        return env

    # ---- steps ------------------------------------------------------------------------------

    def preflight(self, deadline):
        pf = self.results["preflight"] = {}
        if str(self.results["meta"].get("agent_version", "")).startswith("("):
            raise RuntimeError(f"coloc-agent does not run here: {self.results['meta']['agent_version']}")
        if self.sim:
            pf["simulated_gpu"] = self.gpu_daemon is not None and self.gpu_daemon.poll() is None
            missing = [b for b, v in self.results["meta"]["binaries"].items() if "error" in v]
            if missing or not pf["simulated_gpu"]:
                raise RuntimeError(f"missing binaries {missing} or no simulated GPU")
            return
        q = "name,driver_version,compute_mode,persistence_mode,mig.mode.current,clocks.sm,clocks.max.sm,temperature.gpu,memory.used,memory.total"
        raw = cmd_out(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], 10)
        pf["nvidia_smi"] = dict(zip(q.split(","), [x.strip() for x in raw.split(",")])) if not raw.startswith("(") else raw
        smi = pf["nvidia_smi"] if isinstance(pf["nvidia_smi"], dict) else {}
        pf["warnings"] = [w for w in (
            f"compute mode {smi.get('compute_mode')}: two processes may not share the GPU" if smi and smi.get("compute_mode") != "Default" else None,
            f"MIG mode {smi.get('mig.mode.current')}" if smi.get("mig.mode.current") not in (None, "Disabled", "[N/A]", "N/A") else None) if w]
        pf["nvidia_smi_apps"] = cmd_out(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"], 10)
        cg = cgroup_dir(f"coloc-gpu-preflight-{os.getpid()}")
        pf["cgroup_v2_freezer"] = cg is not None
        if cg:
            self.drop_cgroup(cg)
        missing = [b for b, v in self.results["meta"]["binaries"].items() if "error" in v]
        pf["binaries_missing"] = missing
        self.save()
        left = lambda: max(1.0, min(90.0, deadline - time.monotonic()))
        r = shim_check.run_child(TORCH_PROBE, dict(self.env), left())
        pf["torch"] = r
        res = r["result"] or {}
        self.torch_ok = bool(res.get("available")) and "error" not in res and r["rc"] == 0
        log(f"  torch: rc {r['rc']}, {res.get('torch')} (CUDA {res.get('cuda')}), {res.get('device')}, available {res.get('available')}, {r['wall_s']} s")
        self.save()
        if not self.torch_ok:
            raise RuntimeError(f"PyTorch cannot use the GPU: rc {r['rc']}, {res.get('error') or r['stderr_tail'][-800:]}")
        # The shim in a PyTorch process: online (rings its doorbell) and offline (no gate
        # file: its pass-through with the watcher thread); same checksums, pages there.
        why, warn = [], []
        for cls in ("online", "offline"):
            bells = os.path.join(self.tmp, f"preflight-bells-{cls}")
            os.makedirs(bells, exist_ok=True)
            # COLOC_SHIM_TRACE: what the CUDA stack looks up on this driver (kept in
            # results.json: a submission entry point the shim does not wrap shows here).
            env = dict(self.env, LD_PRELOAD=self.shim, COLOC_SHIM_CLASS=cls, COLOC_DOORBELL_DIR=bells,
                       COLOC_GATE_FILE=os.path.join(self.tmp, "preflight-no-gate-file"), COLOC_SHIM_TRACE="1")
            s = shim_check.run_child(TORCH_PROBE, env, left())
            pf[f"shim_{cls}"] = s
            log(f"  shim ({cls}) lookups: {len(s.get('shim_trace') or [])}, wrapped "
                f"{sum(1 for l in s.get('shim_trace') or [] if l.endswith(' wrapped'))}")
            sr = s["result"] or {}
            pages = sr.get("pages") or []
            if s["rc"] != 0 or "error" in sr or not s["result"]:
                why.append(f"{cls}: rc {s['rc']}: {sr.get('error') or s['stderr_tail'][-600:]}")
            else:
                for k in ("gemm_sum", "linear_sum"):
                    if not shim_check.close(res.get(k), sr.get(k)):
                        warn.append(f"{cls}: {k} {sr.get(k)} != {res.get(k)} without the shim")
                if len(pages) != 1:
                    warn.append(f"{cls}: {len(pages)} doorbell pages, expected 1")
                if s["shim_stderr"]:
                    warn.append(f"{cls}: the shim printed {s['shim_stderr'][:3]}")
            log(f"  shim ({cls}): rc {s['rc']}, {len(pages)} page(s), {s['wall_s']} s")
        self.shim_ok, self.shim_why = not why, "; ".join(why) or None
        # Only a crash blocks the shim's rows; a difference is reported and the rows run.
        pf["shim_ok"], pf["shim_problems"], pf["shim_warnings"] = self.shim_ok, self.shim_why, warn
        if missing or not self.shim_ok or warn:
            raise RuntimeError(f"missing binaries {missing}; shim broke PyTorch: {self.shim_why}; shim differences: {warn}")

    def probe(self, deadline):
        tag = "probe"
        out, ready = os.path.join(self.art, f"{tag}-offline.json"), os.path.join(self.tmp, f"{tag}-ready")
        off = self.spawn("work", "probe offline", self.offline_cmd(out, ready), self.env, f"{tag}-offline.log")
        cb = None
        try:
            self.wait_ready(off, ready, "probe offline", f"{tag}-offline.log", deadline)
            cmd = [os.path.join(self.bin, "coloc-bench"), "--nvml-probe", "--nvml-lib", self.nvml, "--seconds", str(self.a.probe_seconds), "--stop-pid", str(off.pid)]
            with open(os.path.join(self.art, "probe.json"), "wb") as so:
                cb = subprocess.Popen(cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=so, stderr=open(os.path.join(self.art, "probe.log"), "wb"))
            self.live.append(["tool", "coloc-bench --nvml-probe", cb])
            rc = self.wait_exit(cb, "coloc-bench --nvml-probe", min(deadline, time.monotonic() + self.a.probe_seconds + 30))
        finally:
            # coloc-bench SIGSTOPs and SIGCONTs the training loop: end it first, then the
            # loop with a SIGCONT (it may have been left stopped).
            self.end(cb, "coloc-bench --nvml-probe", 5, cont=False)
            self.teardown(None, [("probe offline", off)], None)
        if rc != 0:
            raise RuntimeError(f"coloc-bench --nvml-probe exited {rc}: {tail(os.path.join(self.art, 'probe.log'))}")
        with open(os.path.join(self.art, "probe.json")) as f:
            p = json.load(f)
        notes = []
        if not p.get("processes_seen"):
            notes.append("no process seen in NVML's samples: sample interval and drain not measured")
        if p.get("drain_after_sigstop_ms") in (0, 0.0, None):
            notes.append("drain after SIGSTOP not measured (0 or none: no sample of the stopped process after the stop; "
                         "resolution is one sample period anyway)")
        p["notes"] = notes
        if isinstance(self.results.get("nvml_probe"), dict):
            p["earlier"] = self.results["nvml_probe"]
        self.results["nvml_probe"] = p
        self.set_period(p)
        log(f"  probe: sample interval {p.get('sample_interval_ms')}, freshness {p.get('freshness_ms')}, drain {p.get('drain_after_sigstop_ms')} ms; "
            f"agents get --nvml-sample-period {self.period} ({self.period_source})")

    def shim_step(self, deadline):
        sc = os.path.join(self.out, "shim-check.json")
        budget = max(10.0, deadline - time.monotonic() - 15)
        cmd = [sys.executable, os.path.join(HERE, "shim_check.py"), "--shim", self.shim, "--agent", os.path.join(self.bin, "coloc-agent"),
               "--nvml-lib", self.nvml, "--inflight", str(self.a.gate_inflight), "--launches", str(self.a.shim_launches),
               "--repeats", str(self.a.shim_repeats), "--rounds", str(self.a.shim_rounds), "--budget", str(budget),
               "--log-dir", self.art, "--out", sc]
        p = subprocess.Popen(cmd, env=self.env, stdin=subprocess.DEVNULL)
        self.live.append(["tool", "shim_check.py", p])
        try:
            rc = self.wait_exit(p, "shim_check.py", deadline)
        finally:
            self.end(p, "shim_check.py", 15, cont=False)
        doc = None
        if os.path.exists(sc):
            with open(sc) as f:
                doc = json.load(f)
        self.results["shim_check"] = {k: v for k, v in (doc or {}).items() if k != "runs"} if doc else {"error": f"shim_check.py exited {rc} and wrote nothing"}
        if doc:
            self.results["shim_check"]["file"] = "shim-check.json (per-run details)"
            ran = [v for k, v in doc["checks"].items() if k.endswith(": ran")]
            if ran and not all(ran):
                self.shim_ok, self.shim_why = False, "shim_check: " + ", ".join(k for k, v in doc["checks"].items() if k.endswith(": ran") and not v)
        if rc != 0:
            failed = [k for k, v in ((doc or {}).get("checks") or {}).items() if not v]
            raise RuntimeError(f"shim_check.py exited {rc}; failed checks: {failed}")

    def warmup(self, deadline):
        out = os.path.join(self.art, "warmup-online.json")
        d = min(self.a.warmup_run, self.a.duration)
        o = self.spawn("work", "warm-up online", self.online_cmd(out, duration=d), self.env, "warmup-online.log")
        try:
            rc = self.wait_exit(o, "warm-up online", deadline)
        finally:
            self.teardown(None, [("online", o)], None)
        with open(out) as f:
            j = json.load(f)
        self.results["warmup"] = {"rc": rc, "requests": j.get("requests"), "p50_ms": j.get("p50_ms"), "p99_ms": j.get("p99_ms"), "startup_s": j.get("startup_s")}

    def scenario(self, row, step, online, offline, agent, deadline, duration=None):
        """One row: the workloads it names, the agent as `agent` says (actuator, dry run, and
        launch: None (NVML only), doorbell, gate, learned, or lock: the gate's with
        --driver-lock), for `duration` s (default --duration)."""
        name = row["scenario"]
        duration = self.a.duration if duration is None else duration
        tag = sanitize(step)
        on_out, off_out = os.path.join(self.art, f"{tag}-online.json"), os.path.join(self.art, f"{tag}-offline.json")
        ready = os.path.join(self.tmp, f"{tag}-offline-ready")
        cg = None
        if agent and agent[0] == "freezer":
            cg = cgroup_dir(f"coloc-gpu-bench-{os.getpid()}")
            if not cg:
                row["skipped"] = "no cgroup v2 freezer usable here"
                return
            self.cgroups.append(cg)
        ag = off = on = None
        port = events = None
        metrics, state = "", None
        try:
            if agent:
                t_agent = time.monotonic()
                ag, port, events = self.start_agent(tag, self.rules(tag, cg), agent[0], agent[1], agent[2] in ("gate", "learned", "at-once", "lock"), deadline,
                                                    release=agent[2] if agent[2] in ("learned", "at-once") else None, extra=["--driver-lock", "--cuda-lib", self.a.cuda_lib] if agent[2] == "lock" else ())
            if offline:
                cmd = self.offline_cmd(off_out, ready)
                if not online and agent is None and not self.sim:
                    # Offline alone: its kernels' durations, the simulated GPU's yardstick.
                    cmd += ["--kernel-profile", "4"]
                if cg:
                    cmd = ["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$0" "$@"'] + cmd
                gated = agent is not None and agent[2] in ("gate", "learned", "at-once", "lock")
                off = self.spawn("work", f"{tag} offline", cmd, self.shim_env("offline") if gated else self.env, f"{tag}-offline.log")
                self.wait_ready(off, ready, "offline", f"{tag}-offline.log", deadline)
            if self.a.fail_step == step:
                raise RuntimeError("failure injected with --fail-step (workloads running)")
            if online:
                rung = agent is not None and agent[2] in ("doorbell", "gate", "learned", "at-once", "lock")
                wake = {"learned": self.a.release_floor_ms, "at-once": self.a.at_once_wake_ms}.get(agent[2]) if rung else None
                env = self.shim_env("online", wake_gap_ms=wake) if rung else self.env
                on = self.spawn("work", f"{tag} online", self.online_cmd(on_out, duration=duration), env, f"{tag}-online.log")
                self.wait_exit(on, "online", deadline)
            else:
                until = time.monotonic() + duration
                while time.monotonic() < until:
                    if off.poll() is not None:
                        raise RuntimeError(f"offline exited with {off.returncode} during the run: {tail(os.path.join(self.art, tag + '-offline.log'), 800)}")
                    time.sleep(0.1)
            if ag is not None:
                # The agent's CPU over its life (start-up included), % of one core.
                cpu = proc_cpu_s(ag.pid)
                if cpu is not None:
                    row["agent_cpu_pct"] = 100.0 * cpu / max(1e-3, time.monotonic() - t_agent)
            if port:
                try:
                    metrics = get(port, "/metrics")[1]
                    state = json.loads(get(port, "/state")[1])
                    write_atomic(os.path.join(self.art, f"{tag}-state.json"), json.dumps(state, indent=1))
                except (OSError, ValueError) as e:
                    row.setdefault("warnings", []).append(f"cannot read the agent's /metrics or /state: {e!r}")
        finally:
            lock_rc = None
            if agent and agent[2] == "lock" and ag is not None:
                # The agent first (it unlocks what it holds as it exits); a process it left
                # locked (it died) cannot even take SIGTERM: unlocked here, then ended.
                lock_rc = self.end(ag, "agent", 75, cont=False)
                ag = None
                left = mem_step.unblock(self, off.pid) if off is not None and off.poll() is None else None
                if left:
                    row.setdefault("warnings", []).append(f"offline left held by the driver after the agent exited, unlocked by the harness: {json.dumps(left)}")
            row["exit"] = self.teardown(ag, [("offline", off), ("online", on)], cg)
            if lock_rc is not None:
                row["exit"]["agent"] = lock_rc
        self.parse(row, tag, online, offline, agent, on_out, off_out, events, metrics, state, off)

    def parse(self, row, tag, online, offline, agent, on_out, off_out, events, metrics, state, off):
        problems, warn = [], row.setdefault("warnings", [])
        on_j = off_j = None
        for what, want, path in (("online", online, on_out), ("offline", offline, off_out)):
            if not want:
                continue
            try:
                with open(path) as f:
                    j = json.load(f)
            except (OSError, ValueError) as e:
                problems.append(f"{what} wrote no result ({e.__class__.__name__}); its log: {tail(os.path.join(self.art, f'{tag}-{what}.log'), 600)}")
                continue
            if j.get("error"):
                problems.append(f"{what} failed: {j['error'][-600:]}")
            if what == "online":
                on_j = j
            else:
                off_j = j
        if on_j:
            row.update(online_p50_ms=on_j.get("p50_ms"), online_p99_ms=on_j.get("p99_ms"), online_max_ms=on_j.get("max_ms"), requests=on_j.get("requests"))
            if not on_j.get("requests"):
                problems.append("online served no request")
        if off_j:
            row["offline_steps_per_s"] = off_j.get("steps_per_s")
            if off_j.get("kernels"):
                row["offline_kernels"] = off_j["kernels"]
            tl, win = off_j.get("timeline") or [], (on_j or {}).get("window_mono_s")
            if tl and win and win[1] > win[0] and len(tl) >= 2:
                row["offline_steps_per_s_online_window"] = (steps_at(tl, win[1]) - steps_at(tl, win[0])) / (win[1] - win[0])
                row["offline_basis"] = "online window"
            else:
                row["offline_basis"] = "whole run"
        if events and os.path.exists(events):
            row.update(event_stats(events))
            fail_open, acts, signals = row["fail_open"], row["actuators"], row["signals"]
            row["agent_metrics_preemption_count"] = sum(float(l.rsplit(" ", 1)[1]) for l in metrics.splitlines() if l.startswith("coloc_preemption_latency_seconds_count"))
            # Did the agent see and act on the processes (else the row only looks plausible)?
            if fail_open:
                warn.append(f"{fail_open} fail-open event(s)")
            if not agent[1]:
                if not row["preemptions"]:
                    warn.append("no preemption: the agent never acted")
                elif not acts:
                    warn.append("preemptions without an actuator")
                if agent[2] in ("gate", "learned", "at-once", "lock") and not acts.get("gate") and not acts.get("lock"):
                    warn.append("no suspension at the gate")
                if agent[2] == "lock":
                    calls = mem_step.driver_metrics(metrics)["calls"]
                    row["driver_calls"] = {op: c["count"] for op, c in calls.items()}
                    row["driver_lock_ms_mean"] = (calls.get("lock") or {}).get("mean_ms")
                    # The driver's lock calls (the events name the hold's last
                    # confirmation, which may be the gate's).
                    if not row["driver_calls"].get("lock") and not acts.get("lock"):
                        warn.append("no hold by the driver's lock")
                if agent[2] in ("learned", "at-once"):
                    row["learned_releases"] = int(sum(float(l.rsplit(" ", 1)[1]) for l in metrics.splitlines()
                                                      if l.startswith("coloc_releases_total")
                                                      and ('rule="learned"' in l or 'rule="at_once"' in l)))
                    if not row["learned_releases"]:
                        warn.append("no release by a learned window")
                if agent[2] in ("doorbell", "gate", "learned", "at-once", "lock") and not signals.get("doorbell"):
                    warn.append("no preemption signalled by the doorbell")
            if row.get("exit", {}).get("agent") not in (0, None):
                warn.append(f"the agent exited {row['exit']['agent']}")
        if state is not None:
            procs = [dict(p, gpu=g.get("index")) for g in state.get("gpus", []) for p in g.get("processes", [])]
            row["agent_state"] = {"degraded": state.get("degraded"), "degraded_reason": state.get("degraded_reason"),
                                  "gpus_degraded": [g.get("index") for g in state.get("gpus", []) if g.get("degraded")],
                                  "processes": [{k: p.get(k) for k in ("gpu", "pid", "class", "suspended", "actuator", "driver") if k in p} for p in procs]}
            if state.get("degraded"):
                warn.append(f"agent degraded: {state.get('degraded_reason')}")
            if off is not None:
                mine = [p for p in procs if p.get("pid") == off.pid]
                if not mine:
                    warn.append("the offline process is not in the agent's /state (not seen on the GPU)")
                elif any(p.get("class") != "offline" for p in mine):
                    warn.append(f"the offline process is classified {[p.get('class') for p in mine]}")
        elif agent:
            warn.append("no /state from the agent")
        if not warn:
            del row["warnings"]
        if problems:
            row["error"] = "; ".join(problems)
        log(f"  {row['scenario']}: " + json.dumps({k: v for k, v in row.items() if k not in ("agent_state",)})[:1500])

    def wake_floor(self, deadline):
        out = os.path.join(self.art, "wake-floor.json")
        cmd = [os.path.join(self.bin, "coloc-bench"), "--wake-floor", "--samples", str(self.a.wake_floor_samples), "--hogs", "0,2h", "--gap-ms", "5-50",
               "--cpu-wake-latency", "off,0", "--json", out]
        p = self.spawn("tool", "coloc-bench --wake-floor", cmd, self.env, "wake-floor.log")
        try:
            rc = self.wait_exit(p, "coloc-bench --wake-floor", deadline)
        finally:
            self.end(p, "coloc-bench --wake-floor", 5, cont=False)
        text = tail(os.path.join(self.art, "wake-floor.log"), 6000)
        if rc != 0:
            self.results["wake_floor"] = {"error": f"exit {rc}", "table": text[-1500:]}
            raise RuntimeError(f"coloc-bench --wake-floor exited {rc}: {text[-500:]}")
        with open(out) as f:
            r = json.load(f)
        r["table"] = text
        self.results["wake_floor"] = r


    def nvml_view(self, deadline):
        """Online work alone at each --nvml-view-rates while coloc-bench --nvml-watch records
        every per-process sample, zeros included: how much of the online work NVML shows."""
        rows = self.results["nvml_view"] = []
        period_ms = duration_ms(self.period) or 100.0
        for rate in parse_rates(self.a.nvml_view_rates):
            row = {"rate": rate, "period_ms": period_ms}
            rows.append(row)
            tag = f"nvml-view-{rate:g}"
            out, ready = os.path.join(self.art, f"{tag}-online.json"), os.path.join(self.tmp, f"{tag}-ready")
            on = watch = None
            try:
                cmd = self.online_cmd(out, duration=self.a.nvml_view_seconds, ready=ready, rate=rate)
                on = self.spawn("work", f"{tag} online", cmd, self.env, f"{tag}-online.log")
                if self.sim:
                    time.sleep(0.2)
                else:
                    self.wait_ready(on, ready, "online", f"{tag}-online.log", deadline)
                wcmd = [os.path.join(self.bin, "coloc-bench"), "--nvml-watch", "--nvml-lib", self.nvml,
                        "--seconds", str(self.a.nvml_view_seconds + 2 * period_ms / 1e3 + 0.5)]
                with open(os.path.join(self.art, f"{tag}-watch.json"), "wb") as so:
                    watch = subprocess.Popen(wcmd, env=self.env, stdin=subprocess.DEVNULL, stdout=so, stderr=open(os.path.join(self.art, f"{tag}-watch.log"), "wb"))
                self.live.append(["tool", "coloc-bench --nvml-watch", watch])
                self.wait_exit(on, "online", deadline)
                rc = self.wait_exit(watch, "coloc-bench --nvml-watch", deadline)
                if rc != 0:
                    raise RuntimeError(f"coloc-bench --nvml-watch exited {rc}: {tail(os.path.join(self.art, tag + '-watch.log'))}")
            finally:
                self.end(watch, "coloc-bench --nvml-watch", 5, cont=False)
                self.teardown(None, [("online", on)], None)
            with open(os.path.join(self.art, f"{tag}-watch.json")) as f:
                w = json.load(f)
            with open(out) as f:
                j = json.load(f)
            # online.py stamps its requests on the monotonic clock, the simulated one on the
            # wall clock; NVML's timestamps are wall-clock microseconds.
            shift = time.time_ns() - time.monotonic_ns() if j.get("clock") == "monotonic" else 0
            recs = [(r[1] + shift, r[2] + shift) for r in j.get("records") or []]
            row.update(nvml_view_stats(w.get("samples") or [], on.pid, recs, period_ms), errors=w.get("errors"), polls=w.get("polls"))
            if not recs:
                raise RuntimeError(f"nvml-view {rate:g}/s: the online process recorded no request: {tail(os.path.join(self.art, tag + '-online.log'), 600)}")
            log(f"  nvml-view {rate:g}/s: " + json.dumps({k: v for k, v in row.items() if k not in ("sm_values",)})[:600])
            self.save()

    def nvml_load(self, deadline):
        """The online probe (burst.py: tiny kernels, each waited for; the path a driver lock
        would slow) alone while NVML is polled at each interval ("none": not polled)."""
        rows = self.results["nvml_load"] = []
        for i, iv in enumerate(parse_intervals(self.a.nvml_load_intervals)):
            row = {"interval_ms": iv}
            rows.append(row)
            tag = f"nvml-load-{i}-{iv}"
            out = os.path.join(self.art, f"{tag}-probe.json")
            poller = pr = None
            try:
                if iv != "none":
                    cmd = [os.path.join(self.bin, "coloc-bench"), "--nvml-poll", iv, "--nvml-lib", self.nvml]
                    with open(os.path.join(self.art, f"{tag}-poll.json"), "wb") as so:
                        poller = subprocess.Popen(cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=so, stderr=open(os.path.join(self.art, f"{tag}-poll.log"), "wb"))
                    self.live.append(["tool", "coloc-bench --nvml-poll", poller])
                # Four bursts of a quarter of the duration, 100 ms apart.
                cmd = self.burst_cmd(out, bursts=4, burst_ms=self.a.nvml_load_duration * 1e3 / 4, gap_ms=100)
                pr = self.spawn("work", f"{tag} probe", cmd, self.env, f"{tag}-probe.log")
                self.wait_exit(pr, "probe", min(deadline, time.monotonic() + self.a.nvml_load_duration + 90))
            finally:
                row["poller_exit"] = self.end(poller, "coloc-bench --nvml-poll", 5, cont=False)
                self.teardown(None, [("probe", pr)], None)
            try:
                with open(out) as f:
                    j = json.load(f)
                lat = [k[1] for k in j.get("kernels") or []]
                row.update(kernels=len(lat), latency_ms=[pct(lat, 50), pct(lat, 90), pct(lat, 99)], mean_ms=sum(lat) / len(lat) if lat else None)
                if j.get("error") or not lat:
                    row["error"] = (j.get("error") or "no kernel ran")[-600:]
                # The artifact keeps every 100th kernel (the figures are above).
                j["kernels"] = lat[::100]
                write_atomic(out, json.dumps(j))
            except (OSError, ValueError) as e:
                row["error"] = f"the probe wrote no result ({e!r}): {tail(os.path.join(self.art, tag + '-probe.log'), 600)}"
            if poller is not None:
                try:
                    with open(os.path.join(self.art, f"{tag}-poll.json")) as f:
                        pj = json.load(f)
                    row.update(polls_per_s=pj.get("polls_per_s"), cost_us=pj.get("cost_us"), answers=pj.get("answers"))
                except (OSError, ValueError) as e:
                    row["error"] = (row.get("error", "") + f" the poller wrote no result ({e!r}): {tail(os.path.join(self.art, tag + '-poll.log'), 600)}").strip()
            log(f"  nvml-load {iv}: " + json.dumps({k: v for k, v in row.items() if k != "answers"})[:600])
            self.save()
        bad = [r["interval_ms"] for r in rows if r.get("error")]
        if bad:
            raise RuntimeError(f"nvml-load: no result for {bad}")

    def drain(self, deadline):
        """The drain as online sees it, per --drain-configs (see burst_stats)."""
        d = self.results["drain"] = {"configs": [], "baseline_ms": None, "bursts": self.a.drain_bursts, "burst_ms": self.a.drain_burst_ms,
                                     "gap_ms": self.a.drain_gap_ms, "open_s": self.a.drain_open}
        errors = []
        for c in parse_drain(self.a.drain_configs):
            row = dict(c)
            d["configs"].append(row)
            if time.monotonic() + self.drain_need(c) > deadline:
                row["skipped"] = "the step's deadline"
                continue
            try:
                # Each configuration gets twice its estimate (a stuck one cannot eat the rest).
                self.drain_config(row, d, min(deadline, time.monotonic() + 2 * self.drain_need(c) + 20))
            except Exception as e:  # noqa: BLE001  (one configuration: recorded, the others run)
                row["error"] = f"{type(e).__name__}: {e}"[:1500]
                errors.append(c["name"])
                log(f"  drain {c['name']}: ERROR {row['error'][:600]}")
            self.save()
        if errors:
            raise RuntimeError(f"drain: configurations failed: {errors}")

    def drain_config(self, row, d, deadline):
        a, name = self.a, row["name"]
        tag = "drain-" + sanitize(name)
        off_out, probe_out = os.path.join(self.art, f"{tag}-offline.json"), os.path.join(self.art, f"{tag}-probe.json")
        ready = os.path.join(self.tmp, f"{tag}-offline-ready")
        cg = None
        if row["actuator"] == "freezer":
            cg = cgroup_dir(f"coloc-gpu-drain-{os.getpid()}")
            if not cg:
                row["skipped"] = "no cgroup v2 freezer usable here"
                return
            self.cgroups.append(cg)
        ag = off = pr = None
        events, window = None, None
        try:
            if row["actuator"]:
                ag, _, events = self.start_agent(tag, self.rules(tag, cg, online="burst"), row["actuator"], False, row["gate"], deadline)
            if row["model"]:
                cmd = self.offline_cmd(off_out, ready, row["model"])
                if cg:
                    cmd = ["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$0" "$@"'] + cmd
                env = self.shim_env("offline", row["inflight"], row["inflight_ms"]) if row["gate"] else self.env
                off = self.spawn("work", f"{tag} offline", cmd, env, f"{tag}-offline.log")
                self.wait_ready(off, ready, "offline", f"{tag}-offline.log", deadline, timeout=60)
                t0 = time.monotonic() + 0.5
                time.sleep(0.5 + a.drain_open)
                window = [t0, time.monotonic()]
                if off.poll() is not None:
                    raise RuntimeError(f"offline exited with {off.returncode}: {tail(os.path.join(self.art, tag + '-offline.log'), 800)}")
            env = self.shim_env("online") if row["actuator"] else self.env
            pr = self.spawn("work", f"{tag} probe", self.burst_cmd(probe_out), env, f"{tag}-probe.log")
            self.wait_exit(pr, "probe", deadline)
        finally:
            row["exit"] = self.teardown(ag, [("offline", off), ("probe", pr)], cg)
        with open(probe_out) as f:
            pj = json.load(f)
        if pj.get("error"):
            raise RuntimeError(f"the probe failed: {pj['error'][-800:]}")
        kernels, spans = pj.get("kernels") or [], pj.get("bursts") or []
        if not kernels:
            raise RuntimeError(f"the probe ran no kernel: {tail(os.path.join(self.art, tag + '-probe.log'), 600)}")
        if name == "alone":
            lat = [k[1] for k in kernels]
            d["baseline_ms"] = [pct(lat, 50), pct(lat, 90), pct(lat, 99)]
        row.update(burst_stats(kernels, spans, d["baseline_ms"]))
        # Tens of thousands of fast kernels per run: the artifact keeps every 50th and every
        # slow one (those that tell the drain), not megabytes per configuration.
        thr = row.get("threshold_ms")
        pj["kernels"] = [k for i, k in enumerate(kernels) if i % 50 == 0 or (thr is not None and k[1] > thr)]
        pj["kernels_kept"] = f"{len(pj['kernels'])} of {len(kernels)}: every 50th, and every one over the threshold ({thr} ms)"
        write_atomic(probe_out, json.dumps(pj))
        if off is not None:
            try:
                with open(off_out) as f:
                    oj = json.load(f)
                tl = oj.get("timeline") or []
                if window and len(tl) >= 2:
                    row["offline_open_steps_per_s"] = (steps_at(tl, window[1]) - steps_at(tl, window[0])) / (window[1] - window[0])
                    row["offline_basis"] = "gate open, no online"
                else:
                    row["offline_open_steps_per_s"] = oj.get("steps_per_s")
                    row["offline_basis"] = "whole run (no timeline)"
            except (OSError, ValueError) as e:
                row.setdefault("warnings", []).append(f"offline wrote no result ({e!r})")
        if row["model"] and not row["actuator"] and row.get("drain_n"):
            row.setdefault("warnings", []).append(f"{row['drain_n']} burst(s) look drained with nothing to stop the offline: "
                                                  "the drain metric cannot tell sharing from the baseline here")
        if events and os.path.exists(events):
            # From the first burst on: burst.py's warm-up rings the doorbell too.
            walls = pj.get("bursts_wall_s") or []
            st = event_stats(events, since_ns=int((walls[0] - 0.005) * 1e9) if walls else None)
            row.update({k: st[k] for k in ("preemptions", "preemption_ms", "preemption_n", "detection_ms", "actuators", "signals", "fail_open")})
            if not st["preemptions"] and row["model"]:
                row.setdefault("warnings", []).append("no preemption: the agent never acted")
            if row["gate"] and not st["actuators"].get("gate"):
                row.setdefault("warnings", []).append("no suspension at the gate")
        log(f"  drain {name}: " + json.dumps({k: v for k, v in row.items() if k not in ("exit",)})[:900])


# ---- report -------------------------------------------------------------------------------

def fmt(v):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def scenario_table(rows):
    alone = next((r for r in rows if r["scenario"] == "online alone" and r.get("online_p99_ms")), {})
    off_alone = next((r for r in rows if r["scenario"] == "offline alone" and r.get("offline_steps_per_s")), {})
    lines = ["| scenario | online p50 (ms) | online p99 (ms) | p99 / alone | requests | offline steps/s (basis) | offline share of alone | preemption p50/p99 ms (n) | detection p50/p99 ms (n) | release p50/p99 ms (n) | agent CPU % of a core | checks |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['scenario']} | skipped: {r['skipped']} ||||||||||| ")
            continue
        err = f"ERROR: {str(r['error'])[:160]}".replace("|", "/").replace("\n", " ") if r.get("error") else ""
        ratio = r["online_p99_ms"] / alone["online_p99_ms"] if r.get("online_p99_ms") and alone.get("online_p99_ms") else None
        off_v = r.get("offline_steps_per_s_online_window", r.get("offline_steps_per_s"))
        share = off_v / off_alone["offline_steps_per_s"] if off_v is not None and off_alone.get("offline_steps_per_s") else None
        basis = f" ({r.get('offline_basis')})" if off_v is not None and r.get("offline_basis") else ""

        def trio(k):
            if k + "_ms" not in r:
                return "-"
            return "/".join(fmt(x) for x in r[k + "_ms"]) + f" ({r.get(k + '_n', '-')})"
        checks = "; ".join(r.get("warnings", [])) or ("ok" if "preemptions" in r else "-")
        checks = (err + " " + checks).strip() if err else checks
        lines.append(f"| {r['scenario']} | {fmt(r.get('online_p50_ms'))} | {fmt(r.get('online_p99_ms'))} | {fmt(ratio)} | {fmt(r.get('requests'))} | {fmt(off_v)}{basis} | {fmt(share)} | "
                     f"{trio('preemption')} | {trio('detection')} | {trio('release')} | {fmt(r.get('agent_cpu_pct'))} | {checks} |")
    return "\n".join(lines)


def render(r, parts=None):
    m = r.get("meta") or {}
    pf = r.get("preflight") or {}
    torch_r = ((pf.get("torch") or {}).get("result")) or {}
    out = ["# gpu-coloc: real-GPU harness results" + (" (SIMULATED GPU)" if m.get("sim") else ""), ""]
    out.append(f"- complete: {r.get('complete')}" + (f" — interrupted: {r['interrupted']}" if r.get("interrupted") else ""))
    out.append(f"- date {m.get('date')}, commit {m.get('commit')} ({m.get('commit_source')}), agent {m.get('agent_version')}")
    smi = pf.get("nvidia_smi") if isinstance(pf.get("nvidia_smi"), dict) else {}
    out.append(f"- device {torch_r.get('device') or smi.get('name')}, driver {smi.get('driver_version')}, "
               f"torch {torch_r.get('torch')} (CUDA {torch_r.get('cuda')}), python {m.get('python')}")
    if isinstance(pf.get("nvidia_smi"), dict):
        out.append(f"- nvidia-smi: {json.dumps(pf['nvidia_smi'])}")
    if pf.get("warnings"):
        out.append(f"- preflight warnings: {'; '.join(pf['warnings'])}")
    if pf.get("shim_problems") or pf.get("shim_warnings"):
        out.append(f"- shim in PyTorch (preflight): broke it: {pf.get('shim_problems')}; differences: {pf.get('shim_warnings')}")
    out.append(f"- duration {m.get('duration_s')} s per row, {m.get('rate')} requests/s, idle window {m.get('idle_window')}, poll {m.get('poll_interval')}, "
               f"gate K {m.get('gate_inflight')}, NVML sample period given to the agents: {json.dumps(m.get('nvml_sample_period'))}")
    out.append("- binaries: " + ", ".join(f"{k} {v.get('sha256', v.get('error', ''))[:16]}" for k, v in (m.get("binaries") or {}).items()))
    if parts:
        out.append(f"- merged from: {', '.join(parts)}")
        for part in parts:
            pm = (((r.get("parts") or {}).get(part) or {}).get("meta")) or {}
            bins = ", ".join(f"{k} {(v or {}).get('sha256', '?')[:16]}" for k, v in (pm.get("binaries") or {}).items())
            out.append(f"  - {part}: {pm.get('date')}, commit {pm.get('commit')}, steps {','.join(pm.get('steps_selected') or [])}; {bins}")
    out += ["", "## Steps", "", "| step | status | s | note |", "|---|---|---|---|"]
    for s in r.get("steps") or []:
        note = s.get("reason") or (s.get("error") or "").strip().splitlines()[-1:] or [""]
        note = note if isinstance(note, str) else note[0]
        out.append(f"| {s.get('part', '') + ' ' if s.get('part') else ''}{s['step']} | {s['status']} | {fmt(s.get('elapsed_s'))} | {note[:200].replace('|', '/')} |")
    out += ["", "## Scenarios", "", "Offline steps/s is taken over the online process's active window where both ran (basis \"online window\"); the share compares it with offline alone.", "",
            scenario_table(r.get("scenarios") or [])]
    for s in r.get("scenarios") or []:
        if s.get("offline_kernels"):
            out += ["", f"Offline's CUDA kernels ({s['scenario']}, torch.profiler over its steps after the warm-up, µs; "
                    "time-weighted p50: the kernel a request arriving while it runs finds running): " + json.dumps(s["offline_kernels"])]
    probes = r.get("nvml_probe")
    probes = probes if isinstance(probes, list) else [probes]
    for i, p in enumerate(x for x in probes if x):
        out += ["", "## NVML probe" + (f" ({i + 1})" if len(probes) > 1 else ""), ""]
        out.append(json.dumps({k: p.get(k) for k in ("call_cost", "sample_interval_ms", "freshness_ms", "drain_after_sigstop_ms", "samples", "processes_seen", "notes")}))
    nv = r.get("nvml_view")
    if nv:
        out += ["", "## What NVML shows of online work (online alone, every per-process sample, zeros included)", "",
                "A request is seen when a sample of the online process with any utilisation is stamped between the request's start "
                "and 1.25 sample periods after its end (the reach the agent gives a sample).", "",
                "| requests/s | requests | share of time in requests | samples (with utilisation) | sample interval p50/p99 ms | SM % p50/p99/max | requests seen |",
                "|---|---|---|---|---|---|---|"]
        for x in nv:
            if x.get("error") and not x.get("requests"):
                out.append(f"| {fmt(x.get('rate'))} | ERROR {str(x['error'])[:150]} ||||||")
                continue
            out.append(f"| {fmt(x.get('rate'))} | {x.get('requests')} | {fmt(x.get('busy_share'))} | {x.get('samples')} ({x.get('samples_active')}) | "
                       f"{'/'.join(fmt(v) for v in x.get('interval_ms') or [])} | {'/'.join(fmt(v) for v in x.get('sm_util') or [])} | "
                       f"{x.get('requests_seen')} ({fmt(x.get('seen_share'))}) |")
    sc = r.get("shim_check")
    if sc:
        out += ["", "## Shim on real CUDA", ""]
        if sc.get("error"):
            out.append(f"ERROR: {sc['error']}")
        else:
            out.append("all checks hold" if sc.get("ok") else "FAILED: " + ", ".join(k for k, v in (sc.get("checks") or {}).items() if not v))
            out.append(f"\ngate: {json.dumps(sc.get('gate', {}).get('config'))} {('(' + str(sc['gate']['agent_error']) + ')') if (sc.get('gate') or {}).get('agent_error') else ''}")
            out.append(f"\nµs per launch: {json.dumps(sc.get('us_per_launch'))}\n\nshim cost: {json.dumps(sc.get('shim_cost_ns_per_launch'))}")
            if sc.get("skipped"):
                out.append(f"\nskipped runs: {sc['skipped']}")
    nl = r.get("nvml_load")
    if nl:
        base = [x["latency_ms"] for x in nl if x.get("interval_ms") == "none" and x.get("latency_ms")]
        b50 = sum(b[0] for b in base) / len(base) if base else None
        out += ["", "## Does polling NVML slow online work? (burst.py alone, NVML polled beside it)", "",
                "Both calls the agent's loop makes (process list, samples) at every interval; the agent's own defaults are "
                "the process list every 50 ms (--process-interval) and samples every 100 ms (--nvml-interval).", "",
                "| poll interval (ms) | kernel latency p50/p90/p99 (ms) | mean (ms) | p50 / unpolled | kernels | polls/s | processes call p50/p99 µs | samples call p50/p99 µs |",
                "|---|---|---|---|---|---|---|---|"]
        for x in nl:
            c = x.get("cost_us") or {}
            cp, cs = c.get("running_processes") or {}, c.get("process_utilization") or {}
            lat = x.get("latency_ms") or []
            ratio = lat[0] / b50 if b50 and lat else None
            out.append(f"| {x.get('interval_ms')} | {'/'.join(fmt(v) for v in lat) or '-'} | {fmt(x.get('mean_ms'))} | {fmt(ratio)} | {fmt(x.get('kernels'))} | "
                       f"{fmt(x.get('polls_per_s'))} | {fmt(cp.get('p50'))}/{fmt(cp.get('p99'))} | {fmt(cs.get('p50'))}/{fmt(cs.get('p99'))} |"
                       + (f" ERROR {str(x['error'])[:150]}" if x.get("error") else ""))
    dr = r.get("drain")
    if dr:
        out += ["", "## The drain as online sees it", "",
                f"burst.py beside each training loop: {dr.get('bursts')} bursts of {dr.get('burst_ms')} ms of tiny kernels, {dr.get('gap_ms')} ms apart; "
                f"kernel latency alone p50/p90/p99 {json.dumps(dr.get('baseline_ms'))} ms. Drain: from a burst's start until the kernels are back at "
                f"the baseline for {CLEAN_MS:g} ms and three kernels (n: bursts where that happened; 'not ended': bursts it never did). Delay: per burst, until the drain ended, the latency above the baseline p50 of the kernels over the threshold, summed. "
                f"Offline steps/s with the gate open: over {dr.get('open_s')} s with no online work.", "",
                "| config | drain p50/max ms (n, not ended) | first kernel p50/max ms | delay until drained p50/max ms | kernel latency p50/p99/max ms | preemption p50/p99 ms (n) | actuators | offline steps/s, online idle (share of the same model without the gate) | checks |",
                "|---|---|---|---|---|---|---|---|---|"]
        ref = {}
        for x in dr.get("configs") or []:
            if x.get("model") and not x.get("gate") and x.get("offline_open_steps_per_s"):
                ref.setdefault(x["model"], x["offline_open_steps_per_s"])
        for x in dr.get("configs") or []:
            name = f"{x['name']} ({x['part']}, {x.get('bursts')} bursts)" if x.get("part") else x["name"]
            if x.get("skipped"):
                out.append(f"| {name} | skipped: {x['skipped']} ||||||||")
                continue
            pair = lambda k: "/".join(fmt(v) for v in (x.get(k) or [])) or "-"
            sp = x.get("offline_open_steps_per_s")
            share = sp / ref[x["model"]] if sp and x.get("model") in ref else None
            checks = "; ".join(([f"ERROR {x['error'][:150]}"] if x.get("error") else []) + x.get("warnings", []) + ([x["note"]] if x.get("note") else [])) or "ok"
            out.append(f"| {name} | {pair('drain_ms')} ({fmt(x.get('drain_n'))}, {fmt(x.get('drain_not_ended'))}) | {pair('first_kernel_ms')} | {pair('delay_ms')} | "
                       f"{pair('latency_ms')} | {pair('preemption_ms')} ({fmt(x.get('preemption_n'))}) | {json.dumps(x.get('actuators')) if x.get('actuators') else '-'} | "
                       f"{fmt(sp)} ({fmt(share)}) | {checks.replace('|', '/')} |")
    if r.get("checkpoint"):
        out.append(ckpt_step.render(r["checkpoint"]))
    if r.get("probes"):
        out.append(probe_steps.render(r["probes"]))
    if r.get("memory"):
        out.append(mem_step.render(r["memory"], scenario_table))
    if r.get("warmup"):
        out += ["", f"Warm-up run (thrown away): {json.dumps(r['warmup'])}"]
    wf = r.get("wake_floor")
    if wf:
        out += ["", "## Wake-up floor (CPU only)", "", wf.get("error", ""), "```", (wf.get("table") or "").strip()[-3000:], "```"]
    return "\n".join(out) + "\n"


def merge(dirs, out):
    """Joins the results.json of several parts (part1, part2) into one results.json/md."""
    docs = []
    for d in dirs:
        with open(os.path.join(d, "results.json"), encoding="utf-8") as f:
            docs.append((os.path.basename(os.path.normpath(d)), json.load(f)))
    m = {"complete": all(r.get("complete") for _, r in docs), "meta": dict(docs[0][1].get("meta") or {}), "parts": {},
         "steps": [], "preflight": None, "nvml_probe": [], "shim_check": None, "warmup": [], "scenarios": [], "wake_floor": None,
         "nvml_load": None, "drain": None, "nvml_view": None, "checkpoint": None, "memory": None, "probes": None}
    by_name, drains = {}, []
    for part, r in docs:
        m["parts"][part] = {"meta": r.get("meta"), "complete": r.get("complete"), "interrupted": r.get("interrupted")}
        m["steps"] += [dict(s, part=part) for s in r.get("steps") or []]
        # A part whose preflight passed is preferred to one whose preflight found something.
        pf_ok = any(s.get("step") == "preflight" and s.get("status") == "ok" for s in r.get("steps") or [])
        if r.get("preflight") and (m["preflight"] is None or pf_ok and not m.get("_pf_ok")):
            m["preflight"], m["_pf_ok"] = dict(r["preflight"], part=part), pf_ok
        p = r.get("nvml_probe")
        m["nvml_probe"] += [dict(p, part=part)] if isinstance(p, dict) else []
        m["shim_check"] = m["shim_check"] or r.get("shim_check")
        m["warmup"] += [dict(r["warmup"], part=part)] if r.get("warmup") else []
        m["wake_floor"] = m["wake_floor"] or r.get("wake_floor")
        m["nvml_load"] = m["nvml_load"] or r.get("nvml_load")
        m["nvml_view"] = m["nvml_view"] or r.get("nvml_view")
        m["checkpoint"] = m["checkpoint"] or r.get("checkpoint")
        m["memory"] = m["memory"] or r.get("memory")
        for k, v in (r.get("probes") or {}).items():  # a probe that ran wins over one skipped
            m["probes"] = m["probes"] or {}
            if k not in m["probes"] or (m["probes"][k].get("skipped") and not v.get("skipped")):
                m["probes"][k] = dict(v, part=part) if isinstance(v, dict) else v
        if r.get("drain"):
            drains.append((part, r["drain"]))
        for row in r.get("scenarios") or []:
            old = by_name.get(row["scenario"])
            if old is None or ("error" in old or "skipped" in old) and not ("error" in row or "skipped" in row):
                by_name[row["scenario"]] = dict(row, part=part)
    if drains:
        # Every configuration that ran, from every part (each row carries its own baseline
        # threshold and burst count); a skipped one only where no part ran it.
        ran = [dict(c, part=p) for p, d in drains for c in d.get("configs") or [] if not c.get("skipped")]
        names = {c["name"] for c in ran}
        skipped = {c["name"]: dict(c, part=p) for p, d in drains for c in d.get("configs") or [] if c.get("skipped") and c["name"] not in names}
        m["drain"] = dict(drains[0][1], configs=ran + list(skipped.values()), parts=[p for p, _ in drains])
    m.pop("_pf_ok", None)
    order = [s for _, s, *_ in ROWS]
    m["scenarios"] = sorted(by_name.values(), key=lambda x: order.index(x["scenario"]) if x["scenario"] in order else 99)
    m["meta"]["nvml_sample_period"] = {p: (r.get("meta") or {}).get("nvml_sample_period") for p, r in docs}
    os.makedirs(out, exist_ok=True)
    m = clean(m)
    write_atomic(os.path.join(out, "results.json"), json.dumps(m, indent=1))
    write_atomic(os.path.join(out, "results.md"), render(m, parts=list(m["parts"])))
    print(render(m, parts=list(m["parts"])))


def expand(spec):
    names = []
    for s in items(spec):
        if s in GROUPS:
            names += GROUPS[s]
        elif s in ORDER:
            names.append(s)
        else:
            raise SystemExit(f"unknown step or group {s!r}: steps {', '.join(ORDER)}; groups {', '.join(GROUPS)}")
    return set(names)


def main():
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sim", action="store_true", help="simulated GPU (coloc-sim + fake NVML): checks the harness without a GPU")
    ap.add_argument("--bin", default="target/release", help="directory with coloc-agent, coloc-bench, libcoloc_cuda.so (and coloc-sim, libfake_nvml.so, libfake_cuda.so for --sim)")
    ap.add_argument("--nvml-lib", default="libnvidia-ml.so.1")
    ap.add_argument("--cuda-lib", default="libcuda.so.1", help="the CUDA driver library whose checkpoint API coloc-bench and the agents with --driver-lock use")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--merge", nargs="+", metavar="DIR", help="only join the results of these runs' --out directories into --out")
    ap.add_argument("--only", help="comma-separated steps or groups to run (default all): " + ", ".join(ORDER) + "; groups " + ", ".join(GROUPS))
    ap.add_argument("--skip", help="comma-separated steps or groups not to run")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for the whole run: a step that would not fit is skipped (recorded)")
    ap.add_argument("--commit", help="the commit the binaries were built from (the device's copy has no .git); default: git, if there")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds per scenario row")
    ap.add_argument("--rate", type=float, default=30.0, help="online requests per second")
    ap.add_argument("--warmup", type=float, default=0.5, help="--sim only: seconds the simulated offline gets before online starts (the real one says when it is ready)")
    ap.add_argument("--ready-timeout", type=float, default=120.0, help="seconds a real workload may take to start (import, CUDA init, warm-up)")
    ap.add_argument("--warmup-run", type=float, default=5.0, help="seconds of the thrown-away online run (step warmup)")
    ap.add_argument("--idle-window", default="100ms")
    ap.add_argument("--poll-interval", default="1ms")
    ap.add_argument("--nvml-sample-period", help=f"give the agents this sample period instead of the probe's (fallback {FALLBACK_SAMPLE_PERIOD})")
    ap.add_argument("--probe-seconds", type=float, default=12.0, help="coloc-bench --nvml-probe --seconds (SIGSTOP at 1/3, SIGCONT at 2/3)")
    ap.add_argument("--sim-work-ms", type=float, default=10.0)
    ap.add_argument("--sim-sample-period-ms", type=float, default=200.0, help="the simulated driver's sample period (an H100's driver 580: 200 ms)")
    ap.add_argument("--shim", help="libcoloc_cuda.so (default: in --bin)")
    ap.add_argument("--gate-inflight", type=int, default=4, help="K for the gate scenario (COLOC_SHIM_INFLIGHT)")
    ap.add_argument("--shim-launches", type=int, default=100000, help="shim_check.py --launches")
    ap.add_argument("--shim-repeats", type=int, default=5, help="shim_check.py --repeats")
    ap.add_argument("--shim-rounds", type=int, default=2, help="shim_check.py --rounds")
    ap.add_argument("--wake-floor-samples", type=int, default=150, help="coloc-bench --wake-floor samples per cell (0: skip)")
    ap.add_argument("--nvml-view-rates", default="30,150", help="nvml-view: online request rates (per second), one run of online work alone each")
    ap.add_argument("--nvml-view-seconds", type=float, default=10.0, help="nvml-view: seconds of online work per rate")
    ap.add_argument("--nvml-load-intervals", default="none,1,10,100,none", help="nvml-load: poll intervals in ms, 'none' for a run without polling")
    ap.add_argument("--nvml-load-duration", type=float, default=6.0, help="nvml-load: seconds of the probe's bursts per interval")
    ap.add_argument("--drain-configs", default=DRAIN_CONFIGS, help="drain: alone, share:M (no agent), signal:M, freezer:M, gateK[+Bms]:M (K: COLOC_SHIM_INFLIGHT, 0 unbounded; B: COLOC_SHIM_INFLIGHT_MS, the shim's default 0.5 when not given, 0 none); M: " + ", ".join(MODELS))
    ap.add_argument("--drain-bursts", type=int, default=5, help="drain: bursts per configuration")
    ap.add_argument("--drain-burst-ms", type=float, default=300.0, help="drain: length of a burst")
    ap.add_argument("--drain-gap-ms", type=float, default=700.0, help="drain: idle time before each burst (longer than --idle-window)")
    ap.add_argument("--drain-open", type=float, default=4.0, help="drain: seconds of offline work with no online before the probe (throughput with the gate open)")
    ap.add_argument("--release-floor-ms", type=float, default=2.0, help="learned row: the agent's --release-floor and online's shim wake gap")
    ap.add_argument("--release-drain-ms", type=float, default=0.5, help="learned row: the agent's --release-drain (the offline shim's in-flight budget, 0.5 ms by default)")
    ap.add_argument("--at-once-wake-ms", type=float, default=0.2, help="at-once row: online's shim wake gap (COLOC_SHIM_WAKE_GAP_MS) and the agent's --release-floor")
    ap.add_argument("--ckpt-gb", default="0,8,32", help="checkpoint: extra device memory (GB) of each training loop checkpointed and restored")
    ap.add_argument("--ckpt-lock-reps", type=int, default=5, help="checkpoint: locks and unlocks of the large training model")
    ap.add_argument("--ckpt-parts", default=",".join(ckpt_step.PARTS), help="checkpoint: which parts: " + ", ".join(ckpt_step.PARTS))
    ap.add_argument("--ckpt-parallel-gb", type=float, default=8.0, help="checkpoint, part parallel: extra device memory of each of the two loops")
    ap.add_argument("--ckpt-stop-s", type=float, default=5.0, help="checkpoint, part stopped: how long the process stays stopped under each call")
    ap.add_argument("--memory-parts", default=",".join(mem_step.PARTS), help="memory: which parts: " + ", ".join(mem_step.PARTS))
    ap.add_argument("--memory-runs", default="8+32", help="memory, part preempt: runs, comma-separated, each the extra GB of its offline loops joined by '+' (all held at once)")
    ap.add_argument("--memory-hold-s", type=float, default=3.0, help="memory: how long online holds its memory once it got it")
    ap.add_argument("--memory-restore-after-s", type=float, default=5.0, help="memory: the agent's --restore-after, s")
    ap.add_argument("--memory-retry-ms", type=float, default=5.0, help="memory: online's pause between allocation attempts")
    ap.add_argument("--memory-row-duration", type=float, default=15.0, help="memory, part lock: seconds per row (online alone, offline alone, the driver's lock)")
    ap.add_argument("--sim-memory-gib", type=float, default=80.0, help="--sim: the simulated GPU's memory, GiB")
    ap.add_argument("--probe-bursts", type=int, default=4, help="probes: burst.py's bursts (300 ms each, 700 ms apart) per measurement")
    ap.add_argument("--probe-online-s", type=float, default=6.0, help="probes: seconds of online.py requests (at --rate) per measurement")
    ap.add_argument("--tsg-hook", help="tsg: a prebuilt libcoloc_tsg_hook.so (default: built from probes/tsg_hook.c with cc, else BIN/libcoloc_tsg_hook.so)")
    ap.add_argument("--tsg-candidates", default="1,10,50,100,200,500,1000,2000", help="tsg: time slices (us) tried smallest first until the driver accepts one")
    ap.add_argument("--timeslice-values", default="0,1,2,3", help="timeslice-policy: nvidia-smi compute-policy --set-timeslice values (0 default, 1 short, 2 medium, 3 long)")
    ap.add_argument("--mps-priority", type=int, default=1, help="mps: CUDA_MPS_CLIENT_PRIORITY of the offline client's second run (1: below normal)")
    ap.add_argument("--mps-thread-pct", type=int, default=50, help="mps: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of the offline client's third run")
    ap.add_argument("--fail-step", help=argparse.SUPPRESS)  # tests: make this step fail
    a = ap.parse_args()
    if a.merge:
        merge(a.merge, a.out)
        return
    parse_intervals(a.nvml_load_intervals)  # refuse a bad list before anything starts
    parse_drain(a.drain_configs)
    ckpt_step.parse_parts(a.ckpt_parts)
    mem_step.parse_parts(a.memory_parts)
    mem_step.parse_runs(a.memory_runs)
    probe_steps.values(a.timeslice_values)
    probe_steps.candidates(a.tsg_candidates)
    selected = expand(a.only) if a.only else set(ORDER)
    selected -= expand(a.skip)
    if a.sim:
        selected.discard("shim")  # needs PyTorch and a GPU
    if a.wake_floor_samples <= 0:
        selected.discard("wake-floor")
    ckpt_step.LOG = log
    mem_step.LOG = log
    probe_steps.LOG, probe_steps.pct, probe_steps.burst_stats = log, pct, burst_stats
    h = Harness(a)
    h.selected = [s for s in ORDER if s in selected]
    log(f"gpu-coloc harness: steps {' '.join(h.selected)}; budget {a.budget:g} s; out {h.out}")
    code = 0
    try:
        h.meta()
        h.set_period()
        h.save()
        if a.sim:
            h.start_sim()
        rows = {r[0]: r for r in ROWS}
        for step in h.selected:
            if step in rows:
                _, name, on, off, ag = rows[step]
                row = {"scenario": name}
                h.run_step(step, lambda dl, row=row, step=step, on=on, off=off, ag=ag: h.scenario(row, step, on, off, ag, dl), row=row)
            else:
                fn = {"preflight": h.preflight, "probe": h.probe, "shim": h.shim_step, "warmup": h.warmup, "wake-floor": h.wake_floor,
                      "nvml-load": h.nvml_load, "drain": h.drain, "nvml-view": h.nvml_view,
                      "checkpoint": lambda dl: ckpt_step.run(h, dl), "memory": lambda dl: mem_step.run(h, dl),
                      "tsg": lambda dl: probe_steps.tsg(h, dl), "timeslice-policy": lambda dl: probe_steps.timeslice_policy(h, dl),
                      "mps": lambda dl: probe_steps.mps(h, dl)}[step]
                h.run_step(step, fn)
        h.results["complete"] = True
    except Interrupted as e:
        h.results["interrupted"] = f"signal {e.args[0] if e.args else '?'} at +{time.monotonic() - T0:.0f} s"
        log(f"interrupted ({h.results['interrupted']}): tearing down, writing what there is")
        code = 143
    except Exception:  # noqa: BLE001  (setup: the simulated GPU, meta)
        h.results["error"] = traceback.format_exc()[-3000:]
        log(f"ERROR outside the steps: {h.results['error']}")
        code = 1
    finally:
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # from here on a signal only logs
            signal.signal(s, lambda sg, _f: log(f"signal {sg}: finishing the teardown and the results"))
        h.cleanup_all()
        h.results["elapsed_s"] = round(time.monotonic() - T0, 1)
        h.save()
        h.close()
    r = clean(h.results)
    st = {}
    for s in r["steps"]:
        st[s["status"]] = st.get(s["status"], 0) + 1
    log(f"done in {r['elapsed_s']} s: steps {json.dumps(st)}; results in {h.out}: {' '.join(sorted(os.listdir(h.out)))}")
    print(render(r), flush=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
