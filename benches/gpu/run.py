#!/usr/bin/env python3
"""Real-GPU co-location scenarios, and the same harness on the simulated GPU (--sim).

Scenarios, each --duration seconds, one GPU:
  online alone | offline alone | both, no agent | both, agent --dry-run (cost of observing)
  | both, agent signal (NVML only) | both, agent freezer (skipped where no cgroup freezer
  is usable) | both, agent doorbell (online under libcoloc_cuda.so) | both, agent doorbell
  + gate (offline under the shim too, the agent's --gate, K = --gate-inflight)
then an NVML probe (sample period, freshness, call cost, drain after SIGSTOP), the
machine's wake-up floor (coloc-bench --wake-floor: the floor under launch -> decision),
and, on a real GPU, shim_check.py (PyTorch unchanged under the shim, its doorbell page,
the shim's cost per launch).
Writes results.md and results.json to --out. Uses only the Python standard library and,
without --sim, PyTorch with CUDA; binaries come from --bin (build them elsewhere and carry
them: the device machine has no registries).

  python3 benches/gpu/run.py --bin target/release --out /tmp/gpu-results          # real GPU
  python3 benches/gpu/run.py --sim --bin target/release --duration 5 --out /tmp/r  # no GPU
"""
import argparse, json, math, os, shutil, signal, socket, subprocess, sys, tempfile, time

HERE = os.path.dirname(os.path.abspath(__file__))


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))] if v else float("nan")


def duration_ms(s):
    """'100ms' / '0.1s' / '100000us' -> milliseconds (the agent's duration syntax)."""
    for unit, f in (("ms", 1.0), ("us", 1e-3), ("µs", 1e-3), ("ns", 1e-6), ("s", 1e3), ("m", 6e4)):
        if s.endswith(unit):
            return float(s[: -len(unit)]) * f
    raise SystemExit(f"{s!r}: a duration needs a unit (ms, us, s)")


def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p


def get(port, path):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    data = b""
    while True:
        b = s.recv(65536)
        if not b:
            break
        data += b
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode(errors="replace")


def cgroup_dir(name):
    for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        if os.path.exists(os.path.join(root, "cgroup.controllers")):
            d = os.path.join(root, name)
            try:
                os.makedirs(d, exist_ok=True)
            except OSError:
                return None
            return d if os.path.exists(os.path.join(d, "cgroup.freeze")) else None
    return None


class Harness:
    def __init__(self, a):
        self.a, self.bin = a, os.path.abspath(a.bin)
        self.out = os.path.abspath(a.out)
        os.makedirs(self.out, exist_ok=True)
        self.tmp = tempfile.mkdtemp(prefix="coloc-gpu-")
        self.env = dict(os.environ)
        self.gpu_daemon = None
        self.shim = os.path.abspath(a.shim or os.path.join(self.bin, "libcoloc_cuda.so"))
        self.bells = os.path.join(self.tmp, "bells")
        self.gate_file = os.path.join(self.tmp, "gate", "gates")
        os.makedirs(self.bells)
        os.makedirs(os.path.dirname(self.gate_file))
        if a.sim:
            self.env["COLOC_SIM_STATE"] = os.path.join("/dev/shm", f"coloc-gpu-bench-{os.getpid()}")
            self.gpu_daemon = subprocess.Popen([os.path.join(self.bin, "coloc-sim"), "gpu", "--gpus", "1", "--sample-period-ms", str(a.sim_sample_period_ms)], env=self.env, stderr=subprocess.DEVNULL)
            while not os.path.exists(self.env["COLOC_SIM_STATE"]):
                time.sleep(0.01)
            time.sleep(0.1)
            self.nvml = os.path.join(self.bin, "libfake_nvml.so")
            # The simulated libcuda.so.1: every simulated workload submits through it (as
            # PyTorch does through the real one), so the shim sees its launches.
            cuda = os.path.join(self.tmp, "fake-cuda")
            os.makedirs(cuda)
            os.symlink(os.path.join(self.bin, "libfake_cuda.so"), os.path.join(cuda, "libcuda.so.1"))
            self.env["LD_LIBRARY_PATH"] = cuda
        else:
            self.nvml = a.nvml_lib

    def online_cmd(self, out):
        if self.a.sim:
            return [os.path.join(self.bin, "coloc-sim"), "online", "--rate", str(self.a.rate), "--work-ms", str(self.a.sim_work_ms), "--duration-s", str(self.a.duration), "--cuda", "--out", out]
        return [sys.executable, os.path.join(HERE, "online.py"), "--rate", str(self.a.rate), "--duration", str(self.a.duration), "--out", out]

    def offline_cmd(self, out):
        if self.a.sim:
            return [os.path.join(self.bin, "coloc-sim"), "offline", "--step-ms", "2", "--cuda", "--out", out]
        return [sys.executable, os.path.join(HERE, "offline.py"), "--out", out]

    def rules(self, cgroup):
        off = f'cgroup = "/{os.path.relpath(cgroup, self.cg_root(cgroup))}"' if cgroup else ('cmdline = "*coloc-sim offline*"' if self.a.sim else 'cmdline = "*benches/gpu/offline.py*"')
        on = 'cmdline = "*coloc-sim online*"' if self.a.sim else 'cmdline = "*benches/gpu/online.py*"'
        p = os.path.join(self.tmp, "rules.toml")
        open(p, "w").write(f'[[rule]]\nname = "offline"\nclass = "reclaimed_cores"\n{off}\n[[rule]]\nname = "online"\nclass = "shared_cores"\n{on}\n')
        return p

    @staticmethod
    def cg_root(d):
        return "/sys/fs/cgroup/unified" if d.startswith("/sys/fs/cgroup/unified") else "/sys/fs/cgroup"

    def shim_env(self, cls):
        """The environment of a workload under the shim (what `coloc-agent exec` sets)."""
        env = dict(self.env, LD_PRELOAD=self.shim, COLOC_SHIM_CLASS=cls, COLOC_DOORBELL_DIR=self.bells)
        if cls == "online":
            env["COLOC_SHIM_WAKE_GAP_MS"] = str(duration_ms(self.a.idle_window))
        else:
            env.update(COLOC_GATE_FILE=self.gate_file, COLOC_SHIM_INFLIGHT=str(self.a.gate_inflight))
        return env

    def scenario(self, name, online=True, offline=True, agent=None):
        """agent: None, or (actuator, dry_run, launch) with launch None (NVML only),
        "doorbell" (online under the shim) or "gate" (offline under it too, --gate)."""
        tag = name.replace(" ", "-").replace(",", "")
        on_out, off_out = os.path.join(self.tmp, tag + "-online.json"), os.path.join(self.tmp, tag + "-offline.json")
        procs, ag, port, events, cg = [], None, None, None, None
        if agent and agent[0] == "freezer":
            cg = cgroup_dir(f"coloc-gpu-bench-{os.getpid()}")
            if not cg:
                return {"scenario": name, "skipped": "no cgroup v2 freezer usable here"}
        try:
            if agent:
                port = free_port()
                events = os.path.join(self.tmp, tag + "-events.jsonl")
                cmd = [os.path.join(self.bin, "coloc-agent"), "run", "--rules", self.rules(cg), "--nvml-lib", self.nvml,
                       "--actuator", agent[0], "--listen", f"127.0.0.1:{port}", "--state-dir", os.path.join(self.tmp, tag + "-state"),
                       "--event-log", events, "--idle-window", self.a.idle_window, "--poll-interval", self.a.poll_interval,
                       "--doorbell-dir", self.bells]
                if self.a.sim:
                    cmd += ["--nvml-sample-period", f"{self.a.sim_sample_period_ms}ms"]
                if agent[1]:
                    cmd.append("--dry-run")
                if agent[2] == "gate":
                    cmd += ["--gate", "--gate-file", self.gate_file]
                ag = subprocess.Popen(cmd, env=self.env, stderr=open(os.path.join(self.out, tag + "-agent.log"), "w"))
                for _ in range(200):
                    try:
                        if get(port, "/readyz")[0] == 200:
                            break
                    except OSError:
                        pass
                    time.sleep(0.05)
                else:
                    raise SystemExit(f"{name}: agent not ready; see {tag}-agent.log")
            if offline:
                cmd = self.offline_cmd(off_out)
                if cg:
                    cmd = ["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$0" "$@"'] + cmd
                gated = agent is not None and agent[2] == "gate"
                procs.append(subprocess.Popen(cmd, env=self.shim_env("offline") if gated else self.env))
                time.sleep(self.a.warmup)
            if online:
                rung = agent is not None and agent[2] in ("doorbell", "gate")
                o = subprocess.Popen(self.online_cmd(on_out), env=self.shim_env("online") if rung else self.env)
                o.wait()
            else:
                time.sleep(self.a.duration)
            metrics = get(port, "/metrics")[1] if port else ""
        finally:
            for p in procs:
                os.kill(p.pid, signal.SIGCONT); p.send_signal(signal.SIGTERM)
            for p in procs:
                p.wait()
            if ag:
                ag.send_signal(signal.SIGTERM); ag.wait()
            if cg:
                try:
                    os.rmdir(cg)
                except OSError:
                    pass
        r = {"scenario": name}
        if online:
            j = json.load(open(on_out)); r.update(online_p50_ms=j["p50_ms"], online_p99_ms=j["p99_ms"], requests=j["requests"])
        if offline:
            r["offline_steps_per_s"] = json.load(open(off_out))["steps_per_s"]
        if events and os.path.exists(events):
            ev = [json.loads(l) for l in open(events) if l.strip()]
            pre = [e["preemption_s"] * 1e3 for e in ev if "preemption_s" in e]
            det = [e["detection_s"] * 1e3 for e in ev if e["event"] == "preempt"]
            rel = [e["release_s"] * 1e3 for e in ev if "release_s" in e]
            signals = {}
            for e in ev:
                if e["event"] == "preempt":
                    signals[e["signal"]] = signals.get(e["signal"], 0) + 1
            acts = {}
            for e in ev:
                if e["event"] == "preempt" and e.get("actuator"):
                    acts[e["actuator"]] = acts.get(e["actuator"], 0) + 1
            r.update(preemptions=len(det), preemption_ms=[pct(pre, 50), pct(pre, 99)], detection_ms=[pct(det, 50), pct(det, 99)], release_ms=[pct(rel, 50), pct(rel, 99)],
                     signals=signals, actuators=acts)
            r["agent_metrics_preemption_count"] = sum(float(l.rsplit(" ", 1)[1]) for l in metrics.splitlines() if l.startswith("coloc_preemption_latency_seconds_count"))
        print(f"done: {name}: {json.dumps(r)}", flush=True)
        return r

    def probe(self):
        off_out = os.path.join(self.tmp, "probe-offline.json")
        p = subprocess.Popen(self.offline_cmd(off_out), env=self.env)
        time.sleep(self.a.warmup)
        try:
            out = subprocess.run([os.path.join(self.bin, "coloc-bench"), "--nvml-probe", "--nvml-lib", self.nvml, "--seconds", str(self.a.probe_seconds), "--stop-pid", str(p.pid)],
                                 env=self.env, capture_output=True, text=True, check=True).stdout
        finally:
            os.kill(p.pid, signal.SIGCONT); p.send_signal(signal.SIGTERM); p.wait()
        return json.loads(out)

    def wake_floor(self):
        out = subprocess.run([os.path.join(self.bin, "coloc-bench"), "--wake-floor", "--samples", str(self.a.wake_floor_samples), "--hogs", "0,2h", "--gap-ms", "5-50",
                              "--json", os.path.join(self.tmp, "wake-floor.json")], env=self.env, capture_output=True, text=True)
        print(out.stdout, flush=True)
        if out.returncode != 0:
            # The scenarios' figures are worth more than this one: keep them.
            return {"error": f"coloc-bench --wake-floor exited {out.returncode}: {out.stderr[-500:]}", "table": "wake-up floor: failed (see results.json)"}
        r = json.load(open(os.path.join(self.tmp, "wake-floor.json")))
        r["table"] = out.stdout
        return r

    def close(self):
        if self.gpu_daemon:
            self.gpu_daemon.send_signal(signal.SIGTERM); self.gpu_daemon.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


def table(rows, probe, a):
    alone = next((r for r in rows if r["scenario"] == "online alone"), {})
    off_alone = next((r for r in rows if r["scenario"] == "offline alone"), {})
    f = lambda v: "-" if v is None or (isinstance(v, float) and math.isnan(v)) else (f"{v:.2f}" if isinstance(v, float) else str(v))
    lines = ["| scenario | online p50 (ms) | online p99 (ms) | p99 / alone | offline steps/s | offline share of alone | preemption p50/p99 (ms) | detection p50/p99 | release p50/p99 (ms) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['scenario']} | skipped: {r['skipped']} |||||||| ")
            continue
        ratio = r["online_p99_ms"] / alone["online_p99_ms"] if "online_p99_ms" in r and alone.get("online_p99_ms") else None
        share = r["offline_steps_per_s"] / off_alone["offline_steps_per_s"] if "offline_steps_per_s" in r and off_alone.get("offline_steps_per_s") else None
        pair = lambda k: "/".join(f(x) for x in r[k]) if k in r else "-"
        lines.append(f"| {r['scenario']} | {f(r.get('online_p50_ms'))} | {f(r.get('online_p99_ms'))} | {f(ratio)} | {f(r.get('offline_steps_per_s'))} | {f(share)} | {pair('preemption_ms')} | {pair('detection_ms')} | {pair('release_ms')} |")
    lines += ["", "NVML probe: " + json.dumps({k: probe[k] for k in ("call_cost", "sample_interval_ms", "freshness_ms", "drain_after_sigstop_ms", "samples")})]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sim", action="store_true", help="simulated GPU (coloc-sim + fake NVML): checks the harness without a GPU")
    ap.add_argument("--bin", default="target/release", help="directory with coloc-agent, coloc-bench (and coloc-sim, libfake_nvml.so for --sim)")
    ap.add_argument("--nvml-lib", default="libnvidia-ml.so.1")
    ap.add_argument("--out", required=True)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--rate", type=float, default=30.0, help="online requests per second")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--idle-window", default="100ms")
    ap.add_argument("--poll-interval", default="1ms")
    ap.add_argument("--probe-seconds", type=float, default=6.0)
    ap.add_argument("--sim-work-ms", type=float, default=10.0)
    ap.add_argument("--sim-sample-period-ms", type=float, default=100.0, help="the simulated driver's sample period (a real driver's is 100 ms to 1 s)")
    ap.add_argument("--only", help="comma-separated scenario names")
    ap.add_argument("--shim", help="libcoloc_cuda.so (default: in --bin)")
    ap.add_argument("--gate-inflight", type=int, default=4, help="K for the gate scenario (COLOC_SHIM_INFLIGHT)")
    ap.add_argument("--wake-floor-samples", type=int, default=300, help="coloc-bench --wake-floor samples per cell (0: skip)")
    a = ap.parse_args()
    h = Harness(a)
    plan = [("online alone", True, False, None), ("offline alone", False, True, None), ("both, no agent", True, True, None),
            ("both, agent dry-run", True, True, ("signal", True, None)), ("both, agent signal", True, True, ("signal", False, None)),
            ("both, agent freezer", True, True, ("freezer", False, None)),
            ("both, agent doorbell", True, True, ("signal", False, "doorbell")),
            ("both, agent doorbell + gate", True, True, ("signal", False, "gate"))]
    if a.only:
        keep = set(a.only.split(","))
        plan = [p for p in plan if p[0] in keep or p[0] in ("online alone", "offline alone")]
    try:
        rows = [h.scenario(n, on, off, ag) for n, on, off, ag in plan]
        probe = h.probe()
        floor = h.wake_floor() if a.wake_floor_samples > 0 else None
        shim_check = None
        if not a.sim:
            # PyTorch under the shim (forward/backward, CUDA graphs, cuBLAS), its doorbell
            # page, and the shim's cost per real launch: see shim_check.py.
            sc = os.path.join(a.out, "shim-check.json")
            subprocess.run([sys.executable, os.path.join(HERE, "shim_check.py"), "--shim", h.shim, "--inflight", str(a.gate_inflight), "--out", sc])
            shim_check = json.load(open(sc)) if os.path.exists(sc) else {"error": "shim_check.py wrote nothing"}
    finally:
        h.close()
    doc = table(rows, probe, a)
    meta = {"sim": a.sim, "duration_s": a.duration, "rate": a.rate, "idle_window": a.idle_window, "poll_interval": a.poll_interval, "gate_inflight": a.gate_inflight,
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        meta["commit"] = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    except OSError:
        pass
    if floor:
        doc += "\n\n" + floor["table"]
    if not a.sim:
        try:
            import torch
            meta.update(torch=torch.__version__, cuda=torch.version.cuda, device=torch.cuda.get_device_name(0))
        except Exception as e:  # noqa: BLE001
            meta["torch_error"] = str(e)
        try:
            meta["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
        except OSError:
            pass
    if shim_check:
        doc += "\n\nShim on real CUDA: " + ("all checks hold" if shim_check.get("ok") else "FAILED: " + ", ".join(k for k, v in shim_check.get("checks", {}).items() if not v)) + \
            f"; µs per launch {json.dumps(shim_check.get('us_per_launch'))}"
    open(os.path.join(a.out, "results.md"), "w").write(f"{json.dumps(meta)}\n\n{doc}")
    clean = lambda v: None if isinstance(v, float) and math.isnan(v) else ([clean(x) for x in v] if isinstance(v, list) else ({k: clean(x) for k, x in v.items()} if isinstance(v, dict) else v))
    json.dump(clean({"meta": meta, "scenarios": rows, "nvml_probe": probe, "wake_floor": floor, "shim_check": shim_check}), open(os.path.join(a.out, "results.json"), "w"), indent=1)
    print(doc)


if __name__ == "__main__":
    main()
