#!/usr/bin/env bash
# One call on the GPU machine for the GPU-equals-reference work (issue 12): build test_cuda and
# moeinfer for sm_90, run every CUDA test but the sweeps, then the random-configuration sweep
# (330 configurations by default, MOE_SWEEP_CONFIGS to change) MOE_TRUST_SWEEPS times with fresh
# seeds, and a long prompt through `bench` with default flags; a table last.
#
# Knobs (environment): MOE_TRUST_FILTER='gtest filter' runs only those CUDA tests before the
# sweeps (default: all but the sweeps); MOE_TRUST_SWEEPS=N sweeps (default 2); MOE_TRUST_BENCH=0
# skips the long-prompt bench. Run it through the device tool with `carry: [".deps"]` after
# `scripts/device-deps.sh download` here. Logs go to $OUT (or /tmp/gpu-trust).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-trust}"
mkdir -p "$OUT"
BUILD="${MOE_GPU_BUILD_DIR:-build-gpu}"
export PATH=/usr/local/cuda/bin:$PATH
export PKG_CONFIG_PATH=/opt/deps/usr/lib/x86_64-linux-gnu/pkgconfig:/opt/deps/usr/share/pkgconfig
export LD_LIBRARY_PATH=/opt/deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
rows=()
row() { rows+=("| $1 | $2 |"); }

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
bash scripts/device-deps.sh unpack >/dev/null || { echo "gpu-trust: FAILED unpacking .deps"; exit 1; }

start=$SECONDS
if ! { cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
         -DCMAKE_PREFIX_PATH=/opt/deps/usr -DMOE_BUILD_BENCH=OFF &&
       cmake --build "$BUILD" -j16 --target test_cuda ${MOE_TRUST_TARGETS-moeinfer}; } >"$OUT/build.log" 2>&1; then
  grep -E "error|FAILED" "$OUT/build.log" | head -30
  echo "gpu-trust: BUILD FAILED"
  exit 1
fi
row "build" "$((SECONDS - start)) s"

filter="${MOE_TRUST_FILTER:--CudaSweep.*}"
start=$SECONDS
timeout "${MOE_TRUST_TEST_TIMEOUT:-420}" "$BUILD/tests/test_cuda" --gtest_filter="$filter" \
  >"$OUT/tests.log" 2>&1
rc=$?
grep -E "^\[  FAILED  \]|Failure|error" "$OUT/tests.log" | head -40
row "test_cuda ($filter)" "rc $rc, $(grep -E '^\[  PASSED  \]' "$OUT/tests.log" | tail -1), $(grep -cE '^\[  FAILED  \]' "$OUT/tests.log") failed lines, $((SECONDS - start)) s"
grep -E "top-1 agreement over all|mean worst rel error" "$OUT/tests.log" | while read -r line; do
  row "  " "$line"
done

for i in $(seq 1 "${MOE_TRUST_SWEEPS:-2}"); do
  start=$SECONDS
  timeout 300 "$BUILD/tests/test_cuda" --gtest_filter='CudaSweep.RandomConfigsOfEveryFamilyMatchTheCpu' \
    >"$OUT/sweep$i.log" 2>&1
  rc=$?
  grep -A8 "^family" "$OUT/sweep$i.log"
  grep -E "seed [0-9]+: rel error" "$OUT/sweep$i.log" | head -10
  row "sweep $i" "rc $rc, $(grep -E '^sweep: ' "$OUT/sweep$i.log" | head -1 | cut -c1-60), $(grep -E 'top-1 agreement over all' "$OUT/sweep$i.log"), $((SECONDS - start)) s"
  while read -r line; do row "  " "$line"; done < <(grep -A7 "^family" "$OUT/sweep$i.log" | tail -6)
done
if [ "${MOE_TRUST_DET_SWEEP:-1}" != 0 ]; then
  start=$SECONDS
  timeout 200 "$BUILD/tests/test_cuda" --gtest_filter='CudaSweep.Deterministic*' >"$OUT/sweep_det.log" 2>&1
  row "deterministic sweep" "rc $?, $(grep -E 'top-1 agreement over all' "$OUT/sweep_det.log"), $((SECONDS - start)) s"
fi

if [ "${MOE_TRUST_BENCH:-1}" != 0 ]; then
  for len in 8192 32768; do
    timeout 200 "$BUILD/moeinfer" bench --device cuda --model synthetic:qwen3-30b-a3b --layers 4 \
      --input-len "$len" --output-len 4 --batch 1 >"$OUT/bench$len.log" 2>&1
    row "bench --input-len $len (defaults)" "rc $?: $(grep -iE 'prefill' "$OUT/bench$len.log" | head -1 | cut -c1-120)"
  done
fi

echo
echo "| gpu-trust | $(head -1 "$OUT/gpu.txt") |"
echo "|---|---|"
printf '%s\n' "${rows[@]}"
