#!/usr/bin/env bash
# Expert parallelism on the GPU (--ep N --device cuda), one call on the GPU machine: unpack the
# carried packages (Open MPI among them, scripts/device-deps.sh), configure with MPI, build
# moeinfer and test_cuda_expert_parallel, run the test as two ranks sharing the GPU (mpirun -np
# 2; their rows go over the staged transport, model/cuda/row_transport.h), the one-process
# tests of the device dispatcher (test_cuda --gtest_filter='CudaDeviceDispatch.*': its kernels,
# and --ep 1 over NCCL and staged against the local run), then the CLI checks (tests/e2e/test_expert_parallel.py --only cuda_ep, which selects
# cuda_ep: logits and greedy text of --ep 2 on cuda against one process; cuda_ep_serve: `serve
# --device cuda --ep 2` answering concurrent requests with the one-process server's texts;
# cuda_ep_bench: `bench --device cuda --ep 2` on the demo and a synthetic model). Prints a summary
# last, with one line per e2e check.
#
# Run it through the device tool with `carry: [".deps"]` after `scripts/device-deps.sh
# download` here. Logs go to $OUT or /tmp/gpu-ep-check. A call may run out of its 10 minutes:
# the build folder stays on a warm machine, and two environment variables split the work over
# calls: MOE_GPU_EP_UNIT=0 skips test_cuda_expert_parallel, MOE_GPU_EP_DEVICE_UNIT=0 skips
# test_cuda's CudaDeviceDispatch tests (and building test_cuda), MOE_GPU_EP_ONLY picks the e2e checks
# (test_expert_parallel.py --only; default cuda_ep, which selects all three; none skips them).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-ep-check}"
mkdir -p "$OUT"
# A build folder of its own: one configured without MPI keeps MPI_C_FOUND off in its cache.
BUILD="${MOE_GPU_BUILD_DIR:-build-gpu-ep}"
export PATH=/usr/local/cuda/bin:$PATH
# cpp-httplib (.deps/http, unpacked to /opt/deps-http) for serve: cuda_ep_serve.
export PKG_CONFIG_PATH=/opt/deps-http/usr/lib/x86_64-linux-gnu/pkgconfig:/opt/deps/usr/lib/x86_64-linux-gnu/pkgconfig:/opt/deps/usr/share/pkgconfig
export LD_LIBRARY_PATH=/opt/deps-http/usr/lib/x86_64-linux-gnu:/opt/deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
summary=()

echo "== dependencies"
bash scripts/device-deps.sh unpack || { echo "gpu-ep-check: FAILED unpacking .deps"; exit 1; }
eval "$(bash scripts/device-deps.sh mpi-env)"
command -v mpirun || { echo "gpu-ep-check: no mpirun after unpacking .deps/mpi"; exit 1; }

echo "== configure and build"
if ! { cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
         -DCMAKE_CUDA_ARCHITECTURES=90 "-DCMAKE_PREFIX_PATH=/opt/deps/usr;/opt/deps-http/usr" \
         -DMPI_C_COMPILER="$(command -v mpicc)" -DMPIEXEC_EXECUTABLE="$(command -v mpirun)" &&
       cmake --build "$BUILD" -j16 --target moeinfer test_cuda_expert_parallel \
         $([ "${MOE_GPU_EP_DEVICE_UNIT:-1}" != 0 ] && echo test_cuda); } \
       >"$OUT/build.log" 2>&1; then
  grep -E "error|FAILED|MPI" "$OUT/build.log" | head -20
  echo "gpu-ep-check: BUILD FAILED (see build.log)"
  exit 1
fi
grep -E "MPI" "$OUT/build.log" | head -3
if grep -q "cpp-httplib not found" "$OUT/build.log"; then
  echo "gpu-ep-check: WARNING: built without cpp-httplib (.deps/http not carried?): cuda_ep_serve will fail"
fi

nvidia-smi -L
touch "$OUT/test_cuda_expert_parallel.log" "$OUT/e2e_cuda_ep.log"
if [ "${MOE_GPU_EP_UNIT:-1}" != 0 ]; then
  echo "== mpirun -np 2 test_cuda_expert_parallel (two ranks on GPU rank % count)"
  mpirun -np 2 --oversubscribe "$BUILD/tests/test_cuda_expert_parallel" 2>&1 |
    tee "$OUT/test_cuda_expert_parallel.log"
  rc=${PIPESTATUS[0]}
  summary+=("test_cuda_expert_parallel (np 2): $([ "$rc" -eq 0 ] && echo PASSED || echo "FAILED rc=$rc")")
fi

if [ "${MOE_GPU_EP_DEVICE_UNIT:-1}" != 0 ]; then
  echo "== test_cuda --gtest_filter='CudaDeviceDispatch.*' (one process)"
  "$BUILD/tests/test_cuda" --gtest_filter='CudaDeviceDispatch.*' 2>&1 |
    tee "$OUT/test_cuda_device_dispatch.log"
  rc=${PIPESTATUS[0]}
  summary+=("test_cuda CudaDeviceDispatch.*: $([ "$rc" -eq 0 ] && echo PASSED || echo "FAILED rc=$rc")")
fi

ONLY="${MOE_GPU_EP_ONLY:-cuda_ep}"
if [ "$ONLY" != none ]; then
  echo "== e2e --only $ONLY (cuda_ep, cuda_ep_serve, cuda_ep_bench)"
  python3 tests/e2e/test_expert_parallel.py --moeinfer "$BUILD/moeinfer" \
    --fixtures tests/fixtures --only "$ONLY" 2>&1 | tee "$OUT/e2e_cuda_ep.log"
  rc=${PIPESTATUS[0]}
  summary+=("e2e --only $ONLY: $([ "$rc" -eq 0 ] && echo PASSED || echo "FAILED rc=$rc")")
fi

echo
echo "== summary"
grep -h "rel error vs one process" "$OUT/test_cuda_expert_parallel.log" | sort | head -40
grep -hE "^(PASS|FAIL|SKIP) |requests per rank|bench: |GPU: " "$OUT/e2e_cuda_ep.log" | head -20
printf '%s\n' "${summary[@]}"
