#!/bin/sh
# The demo's `gate` scenario for several K (COLOC_SHIM_INFLIGHT), one demo run each, with
# the other scenarios beside it as in every demo run. Prints one line per K.
# Usage: benches/gate-k.sh [SECONDS] [K ...]   (defaults: 90 s; K = 1 2 4 8 0, 0 = unbounded)
# Needs `cargo build --release --workspace` first.
set -eu
secs=${1:-90}
[ $# -gt 0 ] && shift
ks=${*:-1 2 4 8 0}
out=$(mktemp -d /tmp/coloc-gate-k.XXXXXX)
printf '%-4s %8s %10s %10s %8s %9s %10s %10s %10s\n' K requests "p50 ms" "p99 ms" "vs alone" "of idle" "pre p50" "pre p99" "doorbell x"
for k in $ks; do
  ./target/release/coloc-demo --duration-s "$secs" --gate-inflight "$k" \
    --out-dir "$out/k$k" --json "$out/k$k.json" >/dev/null
  python3 - "$out/k$k.json" "$k" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
g = s["scenarios"]["gate"]; d = s["scenarios"]["doorbell"]
print(f'{sys.argv[2]:<4} {g["requests"]:>8} {g["p50_ms"]:>10.1f} {g["p99_ms"]:>10.1f} {g["p99_vs_alone"]:>7.2f}x '
      f'{100*g["offline_share_of_idle"]:>8.0f}% {g["preemption_ms"]["p50"]:>9.2f} {g["preemption_ms"]["p99"]:>9.2f} {d["p99_vs_alone"]:>9.2f}x')
PY
done
echo "raw: $out"
