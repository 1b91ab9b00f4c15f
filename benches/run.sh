#!/usr/bin/env bash
# End-to-end benchmarks on the simulated GPU (release build). Needs root for the freezer
# rows (cgroups). Usage: benches/run.sh [--cycles N] [--json FILE]
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --workspace --bins --lib
exec target/release/coloc-bench "$@"
