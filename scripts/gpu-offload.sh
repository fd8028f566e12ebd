#!/usr/bin/env bash
# Expert offloading on the GPU machine, in one call: unpack the carried packages, build test_cuda
# and moeinfer, run the expert-cache and offload tests (admission kernel against the host,
# offloaded decoders against the all-resident one, cold experts on the host), then decode of
# synthetic:qwen3-30b-a3b (all 48 layers) at batch 1 for each budget and --cold-experts mode;
# prints a table last (step time, ratio to all-resident, ratio to the budget's floor).
#
# Knobs: MOE_OFFLOAD_BUDGETS (default "100% 50% 25% 10%"), MOE_OFFLOAD_COLD (default
# "gpu cpu auto"), MOE_OFFLOAD_ROUTING (default "synthetic": the random routers' own choice;
# also "zipf:1.0" or "uniform", each a --routing-skew, and "demo": the demo model's trained
# routers), MOE_OFFLOAD_BATCHES (default "1"),
# MOE_OFFLOAD_OUTPUT_LEN (default 128), MOE_OFFLOAD_PREFETCH (default "auto"; "on off auto" runs
# each),
# MOE_OFFLOAD_EXTRA (more bench flags),
# MOE_OFFLOAD_SKIP_TESTS=1. Run through the device tool with `carry: [".deps"]` after
# `scripts/device-deps.sh download` here. Logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-offload}"
mkdir -p "$OUT"
BUILD="${MOE_GPU_BUILD_DIR:-build-gpu}"
export PATH=/usr/local/cuda/bin:$PATH
export PKG_CONFIG_PATH=/opt/deps-http/usr/lib/x86_64-linux-gnu/pkgconfig:/opt/deps/usr/lib/x86_64-linux-gnu/pkgconfig:/opt/deps/usr/share/pkgconfig
export LD_LIBRARY_PATH=/opt/deps-http/usr/lib/x86_64-linux-gnu:/opt/deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
BUDGETS="${MOE_OFFLOAD_BUDGETS:-100% 50% 25% 10%}"
COLD="${MOE_OFFLOAD_COLD:-gpu cpu auto}"
LEN="${MOE_OFFLOAD_OUTPUT_LEN:-128}"
ROUTINGS="${MOE_OFFLOAD_ROUTING:-synthetic}"
BATCHES="${MOE_OFFLOAD_BATCHES:-1}"
EXTRA="${MOE_OFFLOAD_EXTRA:-}"
PREFETCH="${MOE_OFFLOAD_PREFETCH:-auto}"

bash scripts/device-deps.sh unpack >"$OUT/deps.log" 2>&1 || { cat "$OUT/deps.log"; exit 1; }
start=$SECONDS
TEST_TARGET=test_cuda
[ "${MOE_OFFLOAD_SKIP_TESTS:-0}" = 1 ] && TEST_TARGET=""  # the benches need moeinfer alone
if ! { cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
         "-DCMAKE_PREFIX_PATH=/opt/deps/usr;/opt/deps-http/usr" -DMOE_BUILD_BENCH=OFF &&
       cmake --build "$BUILD" -j16 --target moeinfer $TEST_TARGET; } >"$OUT/build.log" 2>&1; then
  grep -E "error|FAILED" "$OUT/build.log" | head -20
  exit 1
fi
echo "build: $((SECONDS - start)) s"

if [ "${MOE_OFFLOAD_SKIP_TESTS:-0}" != 1 ]; then
  timeout 300 "$BUILD/tests/test_cuda" --gtest_filter='CudaExpertCache*:CudaOffload*:CudaMoeBlock*:CudaRouterNoise*' \
    >"$OUT/offload_tests.log" 2>&1
  echo "offload tests rc=$?: $(grep -E '^\[  PASSED  \]|FAILED' "$OUT/offload_tests.log" | tr '\n' ' ')"
  grep -E "^offload:" "$OUT/offload_tests.log"
fi

run() {  # name, batch, routing, then bench flags
  local name=$1 batch=$2 routing=$3
  shift 3
  # "demo": the trained demo model's own routers (over random prompt ids, 64 of them);
  # otherwise synthetic:qwen3-30b-a3b under that --routing-skew.
  local model=(--model synthetic:qwen3-30b-a3b --input-len 1)
  [ "$routing" = demo ] && model=(--model models/demo --input-len 64)
  local skew=()
  [ "$routing" != synthetic ] && [ "$routing" != demo ] && skew=(--routing-skew "$routing")
  timeout 240 "$BUILD/moeinfer" bench --device cuda "${model[@]}" --batch "$batch" \
    --output-len "$LEN" --temperature 1 "${skew[@]}" "$@" $EXTRA \
    --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1 || { echo "$name failed:"; tail -5 "$OUT/$name.log"; }
}
for routing in $ROUTINGS; do
  for batch in $BATCHES; do
    tag="${routing//[:.]/}_t$batch"
    run "${tag}_resident" "$batch" "$routing"
    for budget in $BUDGETS; do
      for cold in $COLD; do
        for prefetch in $PREFETCH; do
          suffix=""
          [ "$prefetch" != auto ] && suffix="_pf$prefetch"
          run "${tag}_b${budget%\%}_$cold$suffix" "$batch" "$routing" --expert-budget "$budget" \
            --cold-experts "$cold" --expert-prefetch "$prefetch"
        done
      done
    done
  done
done

python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
def load(name):
    path = os.path.join(out, name + ".json")
    return json.load(open(path)) if os.path.exists(path) else None
print(f"{'run':<28} {'step ms':>8} {'tok/s':>7} {'resident/this':>13} {'floor/step':>10} "
      f"{'hit rate':>8} {'PCIe GB/step':>12} {'stall ms/step':>13} {'prefetch acc':>12}")
for path in sorted(glob.glob(os.path.join(out, "*.json")), key=os.path.getmtime):
    name = os.path.basename(path)[:-5]
    base = load(name.split("_b")[0] + "_resident" if "_b" in name else name)
    t0 = base["gpu"]["decode_step_seconds"] if base else None
    j = json.load(open(path))
    g = j.get("gpu") or {}
    t = g.get("decode_step_seconds", 0.0)
    c = j.get("expert_cache") or {}
    touched = c.get("hits", 0) + c.get("misses", 0)
    hit = f"{c['hits'] / touched:.3f}" if touched else ""
    steps = max(j.get("steps", 1), 1)
    pcie = f"{c.get('host_to_device_bytes', 0) / steps / 1e9:.3f}" if c else ""
    ratio = f"{t0 / t:.3f}" if t0 and t else ""
    floor = f"{g.get('offload_floor_ratio', 0):.3f}" if c else f"{g.get('decode_floor_ratio', 0):.3f}"
    stall = f"{c['stall_seconds'] / steps * 1e3:.3f}" if c.get('stall_seconds') is not None else ""
    # Of the prefetches resolved in the run (used by a demand, or evicted unused), the share used.
    used, wasted = c.get("prefetch_used", 0), c.get("prefetch_wasted", 0)
    accuracy = f"{used / (used + wasted):.3f}" if used + wasted else ""
    print(f"{name:<28} {t * 1e3:8.3f} {1 / t if t else 0:7.1f} {ratio:>13} {floor:>10} {hit:>8} "
          f"{pcie:>12} {stall:>13} {accuracy:>12}")
PY
