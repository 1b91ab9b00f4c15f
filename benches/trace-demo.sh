#!/usr/bin/env bash
# The doorbell's tail under ftrace: runs the demo with the scheduler traced and explains
# every doorbell detection over 200 µs (benches/trace_demo.py). Root and tracefs needed.
#
#   cargo build --release --workspace && benches/trace-demo.sh [seconds, default 40]
#
# Traced: sched_waking/wakeup/switch, cpu_idle, IPIs, shared FUTEX_WAKE calls (op 1: the
# shim's wake of a page) and futex_waitv (the loop's sleep), on CLOCK_MONOTONIC.
set -euo pipefail
cd "$(dirname "$0")/.."
T=/sys/kernel/tracing
DUR=${1:-40}
OUT=${OUT_DIR:-/tmp/coloc-trace}
[ -w $T/tracing_on ] || { echo "tracefs not writable at $T (root?)" >&2; exit 1; }
mkdir -p "$OUT"
cleanup() {
  echo 0 > $T/tracing_on
  echo 0 > $T/events/enable
  echo 0 > $T/events/syscalls/sys_enter_futex/filter 2>/dev/null || true
  echo 1408 > $T/buffer_size_kb
}
trap cleanup EXIT
echo 0 > $T/tracing_on
echo > $T/trace
echo mono > $T/trace_clock
echo 150000 > $T/buffer_size_kb
echo 0 > $T/events/enable
echo "op == 1" > $T/events/syscalls/sys_enter_futex/filter
for e in syscalls/sys_enter_futex syscalls/sys_enter_futex_waitv syscalls/sys_exit_futex_waitv \
         sched/sched_waking sched/sched_wakeup sched/sched_switch power/cpu_idle \
         ipi/ipi_send_cpu irq_vectors/reschedule_entry irq_vectors/call_function_single_entry; do
  if [ -e $T/events/$e/enable ]; then echo 1 > $T/events/$e/enable; else echo "(no event $e here)"; fi
done
# CLOCK_REALTIME (the events' clock) minus CLOCK_MONOTONIC (the trace's).
python3 -c 'import time; print(time.clock_gettime_ns(time.CLOCK_REALTIME)-time.clock_gettime_ns(time.CLOCK_MONOTONIC))' > "$OUT/offset"
steal0=$(awk '/^cpu /{print $9}' /proc/stat)
echo 1 > $T/tracing_on
./target/release/coloc-demo --duration-s "$DUR" --out-dir "$OUT/demo" | tee "$OUT/demo.txt"
echo 0 > $T/tracing_on
steal1=$(awk '/^cpu /{print $9}' /proc/stat)
echo "steal during the run: $(( (steal1 - steal0) * 10 )) ms of vCPU time (/proc/stat)"
grep -h overrun $T/per_cpu/cpu*/stats | grep -v ' 0$' && echo "WARNING: the trace buffer overran" || true
cat $T/trace > "$OUT/trace.txt"
python3 benches/trace_demo.py "$OUT"
