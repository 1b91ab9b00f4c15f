#!/usr/bin/env python3
"""Explains the demo's slow doorbell detections from an ftrace of the run.

Usage: benches/trace_demo.py DIR   (DIR as written by benches/trace-demo.sh: offset,
trace.txt, demo/events.jsonl, demo/agent.log)

For every doorbell preemption whose detection (launch -> the loop's decision) took over
200 us it prints what the trace shows between the launch and the decision:
  - whether the loop was woken by a task (the shim's FUTEX_WAKE, the inotify thread) or by
    its own timeout (a timer interrupt: the wake did not reach it),
  - when the wake-up was sent and when the loop got a CPU,
  - the longest stretch with no trace event on any CPU (the VM not running: the
    simulator's daemon alone has a 100 us timer),
  - whether it was the first launch of that GPU's process (its page new to the agent).
Then a count of such silences over the whole trace.
"""
import bisect
import json
import re
import sys

d = sys.argv[1] if len(sys.argv) > 1 else "/tmp/coloc-trace"
off = int(open(f"{d}/offset").read().split()[0])
ev = [json.loads(l) for l in open(f"{d}/demo/events.jsonl")]
bells = [e for e in ev if e["event"] == "preempt" and e["signal"] == "doorbell"]
first = {}
for e in bells:
    first.setdefault(e["gpu"], e["onset_ns"])

line = re.compile(r"^\s*(.+?)-(\d+)\s+\[(\d+)\]\s+(\S+)\s+(\d+\.\d+): (\w+): (.*)$")
ts, loop_tid = [], None
wakes, switches = [], []  # (t, waker comm, in hardirq), t
rows = []
for raw in open(f"{d}/trace.txt"):
    m = line.match(raw)
    if not m:
        continue
    t = int(round(float(m.group(5)) * 1e9))
    ts.append(t)
    rows.append((t, m.group(1), m.group(4), m.group(6), m.group(7)))
    if m.group(6) == "sched_switch" and "next_comm=coloc-loop " in m.group(7):
        loop_tid = re.search(r"next_comm=coloc-loop next_pid=(\d+)", m.group(7)).group(1)
if loop_tid is None:
    sys.exit("no coloc-loop thread in the trace")
for t, comm, flags, name, rest in rows:
    if name == "sched_waking" and f"pid={loop_tid} " in rest:
        wakes.append((t, comm, "h" in flags))
    elif name == "sched_switch" and f"next_pid={loop_tid} " in rest:
        switches.append(t)
ts.sort()
gaps = [(ts[i], ts[i + 1] - ts[i]) for i in range(len(ts) - 1) if ts[i + 1] - ts[i] > 300_000]
wt = [w[0] for w in wakes]

slow = [e for e in bells if e["detection_s"] > 0.0002]
print(f"\n{len(slow)} of {len(bells)} doorbell detections over 200 us (loop thread {loop_tid}):")
for e in sorted(slow, key=lambda e: -e["detection_s"]):
    on, dec = e["onset_ns"] - off, e["decided_ns"] - off
    asleep = e.get("slept_ns", 0) and e["slept_ns"] <= e["onset_ns"] <= e.get("woke_ns", 0)
    i = bisect.bisect_left(wt, on)
    w = wakes[i] if i < len(wakes) and wakes[i][0] <= dec else None
    j = bisect.bisect_left(switches, on)
    ran = switches[j] if j < len(switches) and switches[j] <= dec + 50_000 else None
    silent = max([g[1] for g in gaps if g[0] + g[1] > on and g[0] < dec], default=0)
    how = "loop busy in a tick" if not asleep else (
        "woken by its own timeout (the wake did not reach it)" if w and w[2] else
        f"woken by {w[1]} after {(w[0] - on) / 1e3:.0f} us" if w else "no wake-up traced")
    print(f"  GPU {e['gpu']:2}: {e['detection_s'] * 1e6:6.0f} us; {how}; "
          f"on a CPU {(ran - on) / 1e3 if ran else float('nan'):.0f} us after the launch; "
          f"longest silence {silent / 1e3:.0f} us"
          + ("; first launch of its process" if first[e["gpu"]] == e["onset_ns"] else ""))
span = (ts[-1] - ts[0]) / 1e9
print(f"\nstretches with no trace event on any CPU, over {span:.1f} s:")
for th in (0.3, 0.5, 1, 2, 5):
    g = [x[1] for x in gaps if x[1] > th * 1e6]
    print(f"  > {th} ms: {len(g)} ({sum(g) / 1e6:.1f} ms in all)")
