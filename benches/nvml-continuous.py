#!/usr/bin/env python3
"""Online work seen through NVML alone (no shim), busy without a break: how often the
agent releases offline work beside it. Zero is right.

One simulated GPU whose driver samples every PERIOD ms; online `coloc-sim busy` for SECONDS
(continuous kernels, no doorbell), one offline process; the agent at its defaults for
that period (`--nvml-sample-period` = the driver's, `--nvml-interval` 100 ms). Counts the
event log's preemptions and releases while online was busy, and samples whether the offline
process was stopped every 5 ms.

    benches/nvml-continuous.py [--periods 100,1000] [--seconds 20] [--bin target/release]

Prints one JSON line per period. Everything it makes is removed at the end.
"""
import argparse, json, os, shutil, signal, subprocess, tempfile, time


def state_of(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "?"


def run(b, period_ms, seconds):
    root = tempfile.mkdtemp(prefix="coloc-nvml-", dir="/dev/shm")
    procs = []
    try:
        env = dict(os.environ, COLOC_SIM_STATE=f"{root}/sim")
        procs.append(subprocess.Popen([f"{b}/coloc-sim", "gpu", "--gpus", "1", "--sample-period-ms", str(period_ms)],
                                      env=env, stderr=subprocess.DEVNULL))
        while not os.path.exists(f"{root}/sim"):
            time.sleep(0.01)
        open(f"{root}/rules.toml", "w").write(
            '[[rule]]\nname = "off"\nclass = "reclaimed_cores"\ncmdline = "*coloc-sim offline*"\n')
        events = f"{root}/events.jsonl"
        procs.append(subprocess.Popen(
            [f"{b}/coloc-agent", "run", "--nvml-lib", f"{b}/libfake_nvml.so", "--rules", f"{root}/rules.toml",
             "--state-dir", f"{root}/state", "--listen", "127.0.0.1:0", "--no-doorbells", "--event-log", events,
             "--nvml-sample-period", f"{period_ms}ms", "--nvml-interval", "100ms"],
            env=env, stderr=open(f"{root}/agent.log", "w")))
        off = subprocess.Popen([f"{b}/coloc-sim", "offline", "--gpu", "0", "--step-ms", "2"], env=env,
                               stdout=subprocess.DEVNULL)
        procs.append(off)
        time.sleep(1.5)
        on = subprocess.Popen([f"{b}/coloc-sim", "busy", "--gpu", "0", "--ms", str(int(seconds * 1000))], env=env,
                              stdout=subprocess.DEVNULL)
        procs.append(on)
        t0 = time.time_ns()
        # From two sample periods in (the first preemption needs a sample), to the end.
        settle = 2 * period_ms / 1000 + 0.3
        time.sleep(settle)
        stopped = samples = 0
        while on.poll() is None:
            samples += 1
            stopped += state_of(off.pid) == "T"
            time.sleep(0.005)
        t1 = time.time_ns()
        kinds = {"preempt": 0, "release": 0}
        for line in open(events):
            e = json.loads(line)
            at = e.get("decided_ns") or 0
            if e.get("event") in kinds and t0 <= at <= t1:
                kinds[e["event"]] += 1
        return {"period_ms": period_ms, "busy_s": round((t1 - t0) / 1e9, 1), "preemptions": kinds["preempt"],
                "releases_while_busy": kinds["release"], "offline_stopped_share": round(stopped / max(samples, 1), 4),
                "samples": samples}
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(root, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--periods", default="100,1000")
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--bin", default="target/release")
    a = ap.parse_args()
    for p in a.periods.split(","):
        print(json.dumps(run(os.path.abspath(a.bin), int(p), a.seconds)), flush=True)


if __name__ == "__main__":
    main()
