#!/usr/bin/env bash
# The --device cuda command paths on the GPU machine, after scripts/gpu-check.sh built $BUILD:
# `logits` against the CPU on two fixtures, `generate` on the demo model (CPU and GPU, greedy),
# `info --device cuda`, and every synthetic model through `bench --device cuda` (cut with
# --layers where the whole model would not fit one GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-cli}"
mkdir -p "$OUT"
BUILD="${MOE_GPU_BUILD_DIR:-build-gpu}"
export LD_LIBRARY_PATH=/opt/deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
M="$BUILD/moeinfer"
F=tests/fixtures/models

for fixture in qwen3_moe_bf16 deepseek_v3_fp8 olmoe_f32; do
  ids=$(python3 -c "import json; print(','.join(map(str, json.load(open('$F/$fixture/reference.json'))['prompt_ids'])))")
  "$M" logits --model "$F/$fixture" --ids "$ids" --out "$OUT/$fixture-cpu.npy" &&
    "$M" logits --model "$F/$fixture" --ids "$ids" --out "$OUT/$fixture-gpu.npy" --device cuda &&
    python3 - "$OUT/$fixture" "$F/$fixture/logits.npy" <<'PY'
import sys, numpy as np
base, ref = sys.argv[1], np.load(sys.argv[2])
cpu, gpu = np.load(base + "-cpu.npy"), np.load(base + "-gpu.npy")
rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
print(f"logits {base.split('/')[-1]}: gpu vs reference {rel(gpu, ref):.2e}, cpu vs reference "
      f"{rel(cpu, ref):.2e}, top-1 gpu/ref {np.mean(gpu.argmax(1) == ref.argmax(1)):.3f}")
PY
done
echo "== generate, demo model, greedy"
"$M" generate --prompt "A wise man" --max-tokens 24 2>"$OUT/gen-cpu.err" | sed 's/^/cpu:  /'
"$M" generate --prompt "A wise man" --max-tokens 24 --device cuda 2>"$OUT/gen-gpu.err" | sed 's/^/cuda: /'
tail -2 "$OUT/gen-gpu.err"
echo "== info --device cuda"
"$M" info --device cuda | tail -5
for spec in "qwen3-30b-a3b" "qwen3-235b-a22b --layers 12" "mixtral-8x7b" "olmoe-1b-7b" \
            "deepseek-v2-lite" "deepseek-v3 --layers 5"; do
  set -- $spec
  name=$1
  shift
  line=$("$M" bench --device cuda --model "synthetic:$name" "$@" --batch 4 --input-len 64 \
           --output-len 8 2>&1 | grep -E "Decode step|error" | head -1)
  echo "synthetic:$name $*: ${line:-FAILED}"
done
