#!/usr/bin/env bash
# The CUDA backend's end-to-end figures on one GPU, in one call after scripts/gpu-check.sh has
# built $BUILD: `moeinfer bench --device cuda` on synthetic:qwen3-30b-a3b (all 48 layers) for
# decode at batch 1, 8, 64 and 256 (context 1024) and a 4096-token prefill, each as a ratio to
# the floors measured in the same process; then the MoE layer against PyTorch's
# torch._grouped_mm layer (bench/torch_moe_reference.py). Prints a table last.
#
# Knobs: MOE_BENCH_MODEL (default synthetic:qwen3-30b-a3b), MOE_BENCH_EXTRA (more bench flags,
# e.g. "--routing-skew zipf:1.0"), MOE_BENCH_SKIP_TORCH=1, MOE_BENCH_PROFILE=1 (also runs decode
# at batch 1, 8 and 64 with the stage profiler on: its stage table and its overhead on the step),
# MOE_BENCH_DETERMINISTIC=1 (also runs decode at batch 1, 8 and 64 and the prefill with
# --deterministic: the cost of batch-invariant kernels against the default mode).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-bench}"
mkdir -p "$OUT"
BUILD="${MOE_GPU_BUILD_DIR:-build-gpu}"
export LD_LIBRARY_PATH=/opt/deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
MODEL="${MOE_BENCH_MODEL:-synthetic:qwen3-30b-a3b}"
EXTRA="${MOE_BENCH_EXTRA:-}"

run() {  # name, then bench flags
  local name=$1
  shift
  echo "== $name: moeinfer bench --device cuda --model $MODEL $* $EXTRA"
  timeout 300 "$BUILD/moeinfer" bench --device cuda --model "$MODEL" "$@" $EXTRA \
    --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log" | grep -vE "^\s*$"
}
run decode_b1 --batch 1 --input-len 1024 --output-len 64
run decode_b8 --batch 8 --input-len 1024 --output-len 64
run decode_b64 --batch 64 --input-len 1024 --output-len 64
run decode_b256 --batch 256 --input-len 1024 --output-len 32
run prefill_4096 --batch 1 --input-len 4096 --output-len 2

if [ "${MOE_BENCH_PROFILE:-0}" = 1 ]; then
  run profiled_b1 --batch 1 --input-len 1024 --output-len 64 --profile
  run profiled_b8 --batch 8 --input-len 1024 --output-len 64 --profile
  run profiled_b64 --batch 64 --input-len 1024 --output-len 64 --profile
fi

if [ "${MOE_BENCH_DETERMINISTIC:-0}" = 1 ]; then
  run deterministic_b1 --batch 1 --input-len 1024 --output-len 64 --deterministic
  run deterministic_b8 --batch 8 --input-len 1024 --output-len 64 --deterministic
  run deterministic_b64 --batch 64 --input-len 1024 --output-len 64 --deterministic
  run deterministic_prefill_4096 --batch 1 --input-len 4096 --output-len 2 --deterministic
fi

if [ "${MOE_BENCH_SKIP_TORCH:-0}" != 1 ] && [ -x "$BUILD/bench/bench_cuda_moe_layer" ]; then
  echo "== MoE layer vs torch._grouped_mm"
  timeout 300 python3 bench/torch_moe_reference.py \
    --moeinfer-bench "$BUILD/bench/bench_cuda_moe_layer" 2>&1 | tee "$OUT/torch.log"
fi

python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
print("\nfigure                      step/prefill   floor ratio   target")
for name, key, target in [("decode_b1", "decode_floor_ratio", 0.70),
                          ("decode_b8", "decode_floor_ratio", 0.70),
                          ("decode_b64", "decode_floor_ratio", 0.75),
                          ("decode_b256", "decode_floor_ratio", 0.75),
                          ("prefill_4096", "prefill_peak_ratio", 0.40)]:
    path = os.path.join(out, name + ".json")
    if not os.path.exists(path):
        print(f"{name:<27} (no result)")
        continue
    g = json.load(open(path)).get("gpu") or {}
    t = g.get("decode_step_seconds", 0) * 1e3 if key.startswith("decode") else None
    shown = f"{t:9.3f} ms" if t is not None else f"{json.load(open(path))['prefill_seconds']*1e3:9.1f} ms"
    r = g.get(key, 0)
    print(f"{name:<27} {shown:>12}   {r:11.3f}   >= {target:.2f} {'ok' if r >= target else 'MISS'}")
for b in (1, 8, 64):
    off, on = os.path.join(out, f"decode_b{b}.json"), os.path.join(out, f"profiled_b{b}.json")
    if os.path.exists(off) and os.path.exists(on):
        t0 = json.load(open(off))["gpu"]["decode_step_seconds"]
        t1 = json.load(open(on))["gpu"]["decode_step_seconds"]
        print(f"profiler overhead, decode B {b}: {t0*1e3:.3f} -> {t1*1e3:.3f} ms/step = {t1/t0 - 1:+.2%} (budget 3%)")
for plain, det in [("decode_b1", "deterministic_b1"), ("decode_b8", "deterministic_b8"),
                   ("decode_b64", "deterministic_b64"), ("prefill_4096", "deterministic_prefill_4096")]:
    off, on = os.path.join(out, plain + ".json"), os.path.join(out, det + ".json")
    if not (os.path.exists(off) and os.path.exists(on)):
        continue
    key = "prefill_seconds" if plain.startswith("prefill") else None
    pick = (lambda j: j["prefill_seconds"]) if key else (lambda j: j["gpu"]["decode_step_seconds"])
    t0, t1 = pick(json.load(open(off))), pick(json.load(open(on)))
    what = "prefill" if key else "ms/step"
    print(f"--deterministic, {plain}: {t0*1e3:.3f} -> {t1*1e3:.3f} ms ({what}) = x{t1/t0:.2f}")
PY
