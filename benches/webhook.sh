#!/usr/bin/env bash
# Admission reviews per second and latency over HTTPS (release build, wrk).
# Usage: benches/webhook.sh [seconds] [connections]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}; conns=${2:-16}
command -v wrk >/dev/null || apt-get install -y wrk >/dev/null
command -v openssl >/dev/null || apt-get install -y openssl >/dev/null
cargo build --release -p coloc-webhook
dir=$(mktemp -d)
trap 'kill $pid 2>/dev/null || true; rm -rf "$dir"' EXIT
openssl req -x509 -newkey rsa:2048 -nodes -keyout "$dir/tls.key" -out "$dir/tls.crt" \
  -days 1 -subj "/CN=localhost" -addext "subjectAltName=DNS:localhost" 2>/dev/null
port=18443
target/release/coloc-webhook --listen 127.0.0.1:$port --cert "$dir/tls.crt" --key "$dir/tls.key" \
  --backend hami 2>"$dir/webhook.log" &
pid=$!
for _ in $(seq 50); do curl -sk https://127.0.0.1:$port/healthz >/dev/null && break; sleep 0.1; done
body=webhook/tests/data/offline-deployment-create.json
cat > "$dir/post.lua" <<LUA
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local f = io.open("$body", "rb"); wrk.body = f:read("*a"); f:close()
LUA
echo "== $(nproc) cores, webhook 2 worker threads, wrk 1 thread, $conns connections, ${secs}s, body $(wc -c <$body) bytes (offline pod, hami: patched)"
wrk -t1 -c"$conns" -d"${secs}s" --latency -s "$dir/post.lua" "https://127.0.0.1:$port/mutate"
