#!/usr/bin/env bash
# One admission review per fresh HTTPS connection (connect + TLS handshake + review), as the
# API server does after an idle period: latency spread, and how many take over 10 ms (a
# server writing its answer in two segments without TCP_NODELAY waits ~40 ms for the
# client's delayed ACK).
# Usage: benches/webhook-fresh.sh [reviews] [binary]   (default: 30, target/release/coloc-webhook)
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-30}; bin=${2:-target/release/coloc-webhook}
[ -x "$bin" ] || cargo build --release -p coloc-webhook
command -v openssl >/dev/null || apt-get install -y openssl >/dev/null
dir=$(mktemp -d)
trap 'kill $pid 2>/dev/null || true; rm -rf "$dir"' EXIT
openssl req -x509 -newkey rsa:2048 -nodes -keyout "$dir/tls.key" -out "$dir/tls.crt" \
  -days 1 -subj "/CN=localhost" -addext "subjectAltName=DNS:localhost" 2>/dev/null
port=18444
"$bin" --listen 127.0.0.1:$port --cert "$dir/tls.crt" --key "$dir/tls.key" --backend hami 2>"$dir/webhook.log" &
pid=$!
for _ in $(seq 50); do curl -sk https://127.0.0.1:$port/healthz >/dev/null && break; sleep 0.1; done
body=webhook/tests/data/offline-deployment-create.json
for _ in $(seq "$n"); do
  curl -sk -o /dev/null -H 'Content-Type: application/json' --data-binary "@$body" \
    -w '%{time_appconnect} %{time_total}\n' "https://127.0.0.1:$port/mutate"
done | python3 -c '
import sys
rows = [tuple(map(float, l.split())) for l in sys.stdin if l.strip()]
review = sorted((t - a) * 1e3 for a, t in rows)   # after the handshake: request -> answer
total = sorted(t * 1e3 for _, t in rows)
q = lambda v, p: v[min(len(v) - 1, int(p * len(v)))]
print(f"{len(rows)} fresh connections: review after handshake p50 {q(review, .5):.2f} ms, p99 {q(review, .99):.2f} ms, max {review[-1]:.2f} ms; over 10 ms: {sum(r > 10 for r in review)} of {len(review)}")
print(f"  whole (connect + TLS + review): p50 {q(total, .5):.2f} ms, max {total[-1]:.2f} ms")
'
