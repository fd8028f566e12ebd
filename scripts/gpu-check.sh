#!/usr/bin/env bash
# One call on the GPU machine: unpack the carried packages, configure and build for sm_90, run
# every test (ctest: the CPU tests and, since the build's own test discovery sees the GPU, the
# CUDA kernel tests), run the CUDA tests once more directly (fresh random inputs, twice) and a
# short compute-sanitizer pass, then the MoE-stage benchmark; prints a one-line summary last.
#
# Run it through the device tool with `carry: [".deps"]` after `scripts/device-deps.sh
# download` here. Logs go to $OUT (the folder the tool brings back) or /tmp/gpu-check.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-check}"
mkdir -p "$OUT"
BUILD="${MOE_GPU_BUILD_DIR:-build-gpu}"
export PATH=/usr/local/cuda/bin:$PATH
export PKG_CONFIG_PATH=/opt/deps/usr/lib/x86_64-linux-gnu/pkgconfig:/opt/deps/usr/share/pkgconfig
export LD_LIBRARY_PATH=/opt/deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
summary=()
step() { echo; echo "== $*"; }

step "GPU"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu \
  --format=csv 2>&1 | tee "$OUT/gpu.txt"

step "dependencies"
bash scripts/device-deps.sh unpack || { echo "gpu-check: FAILED unpacking .deps"; exit 1; }

step "configure and build"
start=$SECONDS
if ! { cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
         -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_PREFIX_PATH=/opt/deps/usr &&
       cmake --build "$BUILD" -j16 -- -k 0; } >"$OUT/build.log" 2>&1; then
  # Keep going: a broken target elsewhere must not hide the CUDA results.
  grep -E "error|FAILED" "$OUT/build.log" | head -20
  summary+=("BUILD ERRORS (see build.log)")
fi
if [ ! -x "$BUILD/tests/test_cuda" ] || [ ! -x "$BUILD/bench/bench_cuda_stages" ]; then
  tail -40 "$OUT/build.log"
  echo "gpu-check: FAILED to build test_cuda / bench_cuda_stages"
  exit 1
fi
grep -E "CUDA backend" "$OUT/build.log"
summary+=("build ok in $((SECONDS - start))s")

step "ctest (all tests)"
timeout 300 ctest --test-dir "$BUILD" -j8 --output-on-failure --timeout 240 >"$OUT/ctest.log" 2>&1
ctest_rc=$?
grep -E "tests passed|tests failed|\*\*\*Failed|\*\*\*Timeout|Not Run|Exception" "$OUT/ctest.log" | tail -30
num_cuda=$(grep -cE "Test +#[0-9]+: (CudaRouter|CudaPlan|CudaPermute|CudaUnpermute|CudaRmsNorm|CudaPipeline)\." "$OUT/ctest.log")
summary+=("ctest rc=$ctest_rc: $(grep -E 'tests passed' "$OUT/ctest.log" | tail -1) ($num_cuda CUDA kernel tests among them)")

step "CUDA tests, directly, twice with fresh inputs"
timeout 240 "$BUILD/tests/test_cuda" --gtest_repeat=2 --gtest_brief=1 >"$OUT/test_cuda.log" 2>&1
cuda_rc=$?
tail -15 "$OUT/test_cuda.log"
summary+=("test_cuda x2 rc=$cuda_rc")

step "compute-sanitizer (small sizes)"
if command -v compute-sanitizer >/dev/null; then
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 3 "$BUILD/tests/test_cuda" \
    --gtest_filter='*T1:*T19:*T99:*Ties*:*InPlace*:CudaPipeline.*T19' --gtest_brief=1 \
    >"$OUT/sanitizer.log" 2>&1
  memcheck_rc=$?
  timeout 120 compute-sanitizer --tool racecheck --error-exitcode 3 "$BUILD/tests/test_cuda" \
    --gtest_filter='CudaPlan.*T99:CudaPlan.*T989:CudaRmsNorm.*T19' --gtest_brief=1 >>"$OUT/sanitizer.log" 2>&1
  racecheck_rc=$?
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Error|Hazard" "$OUT/sanitizer.log" | head -12
  summary+=("memcheck rc=$memcheck_rc racecheck rc=$racecheck_rc")
else
  summary+=("no compute-sanitizer")
fi

step "benchmark"
timeout 180 "$BUILD/bench/bench_cuda_stages" 2>&1 | tee "$OUT/bench.log"
bench_line=$(tail -1 "$OUT/bench.log")

echo
echo "gpu-check: $(IFS=';'; echo "${summary[*]}"); $bench_line"
