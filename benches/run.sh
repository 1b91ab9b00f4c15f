#!/usr/bin/env bash
# End-to-end benchmarks on the simulated GPU (release build). Needs root for the freezer
# rows (cgroups). Usage: benches/run.sh [--cycles N] [--json FILE]
#        benches/run.sh --multi-gpu [--gpus 8] [--offline-per-gpu 8] [--duration-s 60]
#                       [--actuator signal|freezer] [--json FILE]   # agent cost, busy node
#        benches/run.sh --help                                       # every mode
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --workspace --bins --lib
exec "${CARGO_TARGET_DIR:-target}/release/coloc-bench" "$@"
