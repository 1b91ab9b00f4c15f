#!/usr/bin/env bash
# The online shim's completion stamps and its cost per launch (benches/shim-drain.c), on
# the machine's real GPU or, with --fake, on the fake driver (a simulated GPU of its own).
#
#   benches/shim-drain.sh [--fake] NEW_SHIM [BASE_SHIM [ROUNDS [BATCHES]]]
#
# check: every rule once under NEW_SHIM (one line a step, "all steps as expected" or
# FAILED). cost: ROUNDS (3) alternating rounds of no shim, BASE_SHIM (when given) and
# NEW_SHIM, each BATCHES (200) batches of 500 empty-kernel launches; ns per launch, min
# and median over the batches. Builds the program with Zig for glibc 2.17 where Zig is
# there (so that it runs on any GPU host), else with cc; SHIM_DRAIN=path uses a build.
# --fake takes the fake driver and the simulator from this checkout's release build, or
# FAKE_CUDA=libfake_cuda.so and SIM=coloc-sim. On a real GPU, CUDART_LIB=dir (where
# libcudart.so.12 is, e.g. NVIDIA's nvidia-cuda-runtime-cu12 wheel) also runs the real
# runtime's synchronising calls under NEW_SHIM (benches/shim-drain-cudart.c; a build of it
# with SHIM_DRAIN_CUDART=path).
set -euo pipefail
cd "$(dirname "$0")/.."
fake=0
if [ "${1:-}" = --fake ]; then fake=1; shift; fi
new=${1:?usage: benches/shim-drain.sh [--fake] NEW_SHIM [BASE_SHIM [ROUNDS [BATCHES]]]}
base=${2:-}
rounds=${3:-3}
batches=${4:-200}
work=$(mktemp -d)
sim_pid=
cleanup() {
  [ -n "$sim_pid" ] && kill "$sim_pid" 2>/dev/null || true
  rm -rf "$work"
  [ -n "${state:-}" ] && rm -f "$state"
}
trap cleanup EXIT
prog=${SHIM_DRAIN:-}
if [ -z "$prog" ]; then
  prog=$work/shim-drain
  if python3 -m ziglang version >/dev/null 2>&1; then
    python3 -m ziglang cc -target x86_64-linux-gnu.2.17 -O2 -Wall -Werror -o "$prog" benches/shim-drain.c -ldl
  else
    cc -O2 -Wall -Werror -o "$prog" benches/shim-drain.c -ldl
  fi
fi
if [ "$fake" = 1 ]; then
  # The fake driver and the simulated GPU from this checkout's release build.
  state=/dev/shm/coloc-shim-drain-$$
  COLOC_SIM_STATE=$state "${SIM:-target/release/coloc-sim}" gpu --gpus 1 2>/dev/null &
  sim_pid=$!
  for _ in $(seq 50); do [ -e "$state" ] && break; sleep 0.1; done
  mkdir -p "$work/cuda"
  ln -s "$(realpath "${FAKE_CUDA:-target/release/libfake_cuda.so}")" "$work/cuda/libcuda.so.1"
  export COLOC_SIM_STATE=$state LD_LIBRARY_PATH=$work/cuda
fi
run() { # run SHIM PROGRAM ARGS...: PROGRAM under SHIM (none: without a shim), online.
  local shim=$1
  shift
  rm -rf "$work/bells" && mkdir "$work/bells"
  if [ "$shim" = none ]; then
    "$@"
  else
    LD_PRELOAD=$shim COLOC_SHIM_CLASS=online COLOC_DOORBELL_DIR=$work/bells "$@"
  fi
}
echo "== check (new shim)"
run "$new" "$prog" check || true
if [ -n "${CUDART_LIB:-}" ]; then
  cprog=${SHIM_DRAIN_CUDART:-}
  if [ -z "$cprog" ]; then
    cprog=$work/shim-drain-cudart
    cc -O2 -Wall -Werror -o "$cprog" benches/shim-drain-cudart.c -L"$CUDART_LIB" \
      -l:libcudart.so.12 -Wl,-rpath,"$CUDART_LIB"
  fi
  echo "== the CUDA runtime's synchronising calls (new shim)"
  run "$new" "$cprog" || true
fi
echo "== cost: ns per launch, $rounds rounds of $batches batches"
for r in $(seq "$rounds"); do
  for v in none ${base:+base} new; do
    case $v in none) s=none ;; base) s=$base ;; new) s=$new ;; esac
    printf '%-5s round %s: ' "$v" "$r"
    run "$s" "$prog" cost "$batches"
  done
done
