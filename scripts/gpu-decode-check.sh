#!/usr/bin/env bash
# One device call for the small-batch decode path: build test_cuda, moeinfer and
# bench_cuda_moe_layer; run the CUDA tests that hold it (the small-batch MoE kernels, the GPU
# parity fixtures, the random-configuration sweep, the stage and decoder tests); the MoE layer at
# T = 1..64, general against fused; then `moeinfer bench --device cuda` on
# synthetic:qwen3-30b-a3b at decode batch 1 and 8 with the fused path off (--fused-moe-rows 0)
# and on (the default), and batch 1 with the stage profiler. Prints a table last.
#
# Run it through the device tool with `carry: [".deps"]` after `scripts/device-deps.sh
# download` here. Knobs: MOE_DECODE_TEST_FILTER (gtest filter), MOE_DECODE_SKIP_TESTS=1.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-decode-check}"
mkdir -p "$OUT"
BUILD="${MOE_GPU_BUILD_DIR:-build-gpu}"
export PATH=/usr/local/cuda/bin:$PATH
export LD_LIBRARY_PATH=/opt/deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
MODEL=synthetic:qwen3-30b-a3b
summary=()

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
bash scripts/device-deps.sh unpack || { echo "FAILED unpacking .deps"; exit 1; }
start=$SECONDS
if ! { cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
         -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_PREFIX_PATH=/opt/deps/usr &&
       cmake --build "$BUILD" -j16 --target test_cuda moeinfer bench_cuda_moe_layer; } \
       >"$OUT/build.log" 2>&1; then
  grep -E "error|FAILED" "$OUT/build.log" | head -20
  echo "BUILD FAILED"
  exit 1
fi
echo "build: $((SECONDS - start)) s"

if [ "${MOE_DECODE_SKIP_TESTS:-0}" != 1 ]; then
  filter="${MOE_DECODE_TEST_FILTER:-CudaSmall*:CudaParity*:CudaSweep*:CudaStages*:CudaDecoder*:CudaProfile*:CudaRouter*}"
  start=$SECONDS
  timeout 420 "$BUILD/tests/test_cuda" --gtest_filter="$filter" >"$OUT/test_cuda.log" 2>&1
  rc=$?
  grep -E "^\[  (FAILED|PASSED) |^(family|qwen|mixtral|olmoe|deepseek|gpt|top-1|sweep)" \
    "$OUT/test_cuda.log" | head -40
  grep -B2 -A12 "Failure" "$OUT/test_cuda.log" | head -60
  summary+=("test_cuda ($filter): rc $rc, $((SECONDS - start)) s")
fi

timeout 240 "$BUILD/bench/bench_cuda_moe_layer" --tokens 1,2,4,8,16,32,64,128 --quick \
  >"$OUT/layer.log" 2>&1
summary+=("bench_cuda_moe_layer: rc $?")
sed -n '/^ *T /,/^$/p' "$OUT/layer.log"

bench() {  # name, then bench flags
  local name=$1
  shift
  timeout 300 "$BUILD/moeinfer" bench --device cuda --model "$MODEL" "$@" \
    --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1
  summary+=("$name ($*): rc $?")
}
bench b1_general --batch 1 --input-len 1024 --output-len 64 --fused-moe-rows 0
bench b1_fused --batch 1 --input-len 1024 --output-len 64
bench b8_general --batch 8 --input-len 1024 --output-len 64 --fused-moe-rows 0
bench b8_fused --batch 8 --input-len 1024 --output-len 64
bench b1_8l_fused --batch 1 --input-len 128 --output-len 128 --layers 8
bench b1_profile --batch 1 --input-len 1024 --output-len 64 --profile
grep -A30 -i "stage" "$OUT/b1_profile.log" | head -40

python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
print(f"\n{'run':<14} {'step ms':>9} {'floor ratio':>12}")
for name in ["b1_general", "b1_fused", "b8_general", "b8_fused", "b1_8l_fused", "b1_profile"]:
    path = os.path.join(out, name + ".json")
    if not os.path.exists(path):
        print(f"{name:<14} (no result)")
        continue
    g = json.load(open(path)).get("gpu") or {}
    print(f"{name:<14} {g.get('decode_step_seconds', 0) * 1e3:9.3f} "
          f"{g.get('decode_floor_ratio', 0):12.3f}")
PY
printf '%s\n' "${summary[@]}"
