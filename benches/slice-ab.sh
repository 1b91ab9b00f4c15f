#!/bin/sh
# --loop-slice A/B: the demo with two CPU hogs beside it (each spins 1 ms, sleeps 1 ms, as
# a data loader or a busy host thread would), alternating the agent's default 100 µs
# slice and the kernel's default (COLOC_LOOP_SLICE=0). Prints, per run, the demo's split
# of doorbell and gate detections over 200 µs.
# Usage: benches/slice-ab.sh [SECONDS] [ROUNDS]   (defaults: 40 s, 2 rounds)
# Needs `cargo build --release --workspace` first, and gcc for the hog.
set -eu
secs=${1:-40}
rounds=${2:-2}
out=$(mktemp -d /tmp/coloc-slice-ab.XXXXXX)
cat >"$out/hog.c" <<'C'
#include <time.h>
#include <unistd.h>
static long long ns(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1000000000LL + t.tv_nsec; }
int main(void) { for (;;) { long long t = ns(); while (ns() - t < 1000000) {} usleep(1000); } }
C
gcc -O2 -o "$out/hog" "$out/hog.c"
i=1
while [ "$i" -le "$rounds" ]; do
  for slice in 100us 0; do
    "$out/hog" & h1=$!
    "$out/hog" & h2=$!
    COLOC_LOOP_SLICE=$slice ./target/release/coloc-demo --duration-s "$secs" \
      --out-dir "$out/$slice-$i" >"$out/$slice-$i.txt" 2>&1 || true
    kill "$h1" "$h2"
    echo "round $i, --loop-slice $slice:"
    grep -E 'over 200' "$out/$slice-$i.txt" || echo "  (no summary: see $out/$slice-$i.txt)"
  done
  i=$((i + 1))
done
echo "results in $out"
