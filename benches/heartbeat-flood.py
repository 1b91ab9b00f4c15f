#!/usr/bin/env python3
"""The launch gate's heartbeat while a tenant floods its doorbell directory, with the agent
under the chart's CPU limit (500m: a CFS quota of 50 ms per 100 ms, as Kubernetes sets it).

The agent (`coloc-agent run --gate`, rules mode, one simulated GPU with one offline process)
writes the gate file's heartbeat every 100 ms; a shim treats a heartbeat older than 1 s as
a dead agent and opens its gate (fails open). One pod directory under the agent's doorbell
directory holds FILES files named like pages that are not, and a thread creates and
removes files there for the whole run. The heartbeat's age is sampled every 10 ms from a
read-only mapping of the gate file.

    benches/heartbeat-flood.py [--files 150000] [--seconds 20] [--cpu-m 500] [--bin target/release]

Needs root (the CPU limit is a cgroup: the v1 `cpu` controller or v2 `cpu.max`). Prints one
JSON line: samples, stale samples (> 1 s), the age's p50 / p99 / max in ms, the agent's CPU.
Everything it makes is removed at the end.
"""
import argparse, json, mmap, os, shutil, signal, struct, subprocess, sys, tempfile, threading, time

GATE_HEADER = struct.Struct("<QIIIIQ")  # magic, version, agent pid, generation, pad, heartbeat_ns (doorbell/src/gate.rs)
POD = "0b7f7c1e-8d52-4c4a-9b0e-2f0b1d6c5a11"


def cpu_cgroup(name, cpu_m):
    """A cgroup limited to cpu_m millicores; returns (procs file, cleanup)."""
    v2 = "/sys/fs/cgroup/cgroup.controllers"
    if os.path.exists(v2) and "cpu" in open(v2).read().split():
        d = f"/sys/fs/cgroup/{name}"
        os.mkdir(d)
        open(f"{d}/cpu.max", "w").write(f"{cpu_m * 100} 100000")
    elif os.path.isdir("/sys/fs/cgroup/cpu"):
        d = f"/sys/fs/cgroup/cpu/{name}"
        os.mkdir(d)
        open(f"{d}/cpu.cfs_period_us", "w").write("100000")
        open(f"{d}/cpu.cfs_quota_us", "w").write(str(cpu_m * 100))
    else:
        sys.exit("no cpu cgroup controller (v2 cpu.max or v1 cpu) on this host")
    return f"{d}/cgroup.procs", lambda: os.rmdir(d)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=150000)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--cpu-m", type=int, default=500, help="the agent's CPU limit, millicores (0: none)")
    ap.add_argument("--bin", default="target/release")
    a = ap.parse_args()
    b = os.path.abspath(a.bin)
    root = tempfile.mkdtemp(prefix="coloc-hb-")
    shm = tempfile.mkdtemp(prefix="coloc-hb-", dir="/dev/shm")
    state, bells, gate = f"{shm}/sim", f"{shm}/bells", f"{root}/gate/gates"
    procs, cleanup = [], [lambda: shutil.rmtree(root, ignore_errors=True), lambda: shutil.rmtree(shm, ignore_errors=True)]
    stop = threading.Event()
    try:
        env = dict(os.environ, COLOC_SIM_STATE=state)
        procs.append(subprocess.Popen([f"{b}/coloc-sim", "gpu", "--gpus", "1", "--sample-period-ms", "100"], env=env,
                                      stderr=subprocess.DEVNULL))
        while not os.path.exists(state):
            time.sleep(0.01)
        # The flood first (the files take a while to write).
        flood = f"{bells}/pods/{POD}"
        os.makedirs(flood)
        for i in range(a.files):
            open(f"{flood}/junk{i}.bell", "wb").write(b"no")
        rules = f"{root}/rules.toml"
        open(rules, "w").write('[[rule]]\nname = "off"\nclass = "reclaimed_cores"\ncmdline = "*coloc-sim offline*"\n')
        limit = None
        if a.cpu_m:
            limit, rm = cpu_cgroup(os.path.basename(root), a.cpu_m)
            cleanup.insert(0, rm)
        agent = subprocess.Popen(
            [f"{b}/coloc-agent", "run", "--nvml-lib", f"{b}/libfake_nvml.so", "--rules", rules, "--state-dir", f"{shm}/state",
             "--listen", "127.0.0.1:0", "--doorbell-dir", bells, "--gate", "--gate-file", gate, "--nvml-interval", "100ms",
             "--nvml-sample-period", "100ms"],
            env=env, stderr=open(f"{root}/agent.log", "w"), preexec_fn=(lambda: open(limit, "w").write(str(os.getpid()))) if limit else None)
        procs.append(agent)
        procs.append(subprocess.Popen([f"{b}/coloc-sim", "offline", "--gpu", "0", "--step-ms", "2"], env=env,
                                      stdout=subprocess.DEVNULL))
        while not os.path.exists(gate):
            time.sleep(0.01)
        time.sleep(1)

        def churn():
            i = 0
            while not stop.is_set():
                p = f"{flood}/loop{i % 50}.tmp"
                open(p, "wb").close()
                os.unlink(p)
                i += 1

        t = threading.Thread(target=churn)
        t.start()
        f = open(gate, "rb")
        m = mmap.mmap(f.fileno(), 4096, prot=mmap.PROT_READ)
        cpu0 = sum(int(x) for x in open(f"/proc/{agent.pid}/stat").read().rsplit(")", 1)[1].split()[11:13])
        t0, ages = time.time(), []
        while time.time() - t0 < a.seconds:
            beat = GATE_HEADER.unpack_from(m, 0)[5]
            ages.append(max(0, time.time_ns() - beat) / 1e6)
            time.sleep(0.01)
        cpu1 = sum(int(x) for x in open(f"/proc/{agent.pid}/stat").read().rsplit(")", 1)[1].split()[11:13])
        stop.set()
        t.join()
        s = sorted(ages)
        pick = lambda p: s[min(len(s) - 1, int(len(s) * p / 100))]
        print(json.dumps({
            "files": a.files, "seconds": a.seconds, "cpu_limit_m": a.cpu_m, "samples": len(s),
            "stale_over_1s": sum(x > 1000 for x in s), "age_ms": {"p50": round(pick(50), 1), "p99": round(pick(99), 1), "max": round(s[-1], 1)},
            "agent_cpu_pct_of_a_core": round(100 * (cpu1 - cpu0) / os.sysconf("SC_CLK_TCK") / a.seconds, 1),
            "agent_alive": agent.poll() is None,
            # The agent saw the flood: it stopped watching the directory (over 1,000 events a second).
            "flooded_dir_unwatched": "changing too fast" in open(f"{root}/agent.log").read(),
        }))
    finally:
        stop.set()
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for c in cleanup:
            try:
                c()
            except OSError as e:
                print(f"cleanup: {e}", file=sys.stderr)


if __name__ == "__main__":
    main()
