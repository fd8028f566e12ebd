#!/usr/bin/env bash
# Speed of the families' published shapes and of the options that change what is computed, on
# the GPU machine, each run a `moeinfer bench --device cuda` of a synthetic model that measures
# its own floors (copy bandwidth, bf16 GEMM peak) in the same process. Prints two tables last:
#
#   families  one run per synthetic:NAME, cut to its first N layers (--layers) to fit the card:
#             batch 1, a 2048-token prompt, then 32 decode steps (issue 18 item 4): decode step
#             and its ratio to the bytes floor, prefill and its ratio to the GEMM peak.
#   options   synthetic:qwen3-30b-a3b cut to MOE_GB_OPTION_LAYERS layers, once unmodified and
#             once per option (issue 17 item 6): batch 1 with a 4096-token prompt (prefill 4096,
#             decode at that context) and batch 64 with 128-token prompts; each as a ratio to
#             the unmodified run of the same shape in this call. "weights GiB" is what the
#             device holds (under --weights fp8|int4 the routed experts as codes and scales),
#             "experts GiB" the routed experts' share of it and their format, "b1 floor/step"
#             the batch-1 decode step's ratio to its bytes floor (those real bytes).
#
# Knobs: MOE_GB_FAMILIES ("NAME:LAYERS ..."), MOE_GB_OPTIONS (";"-separated flag sets; a set
# the build refuses is reported as refused, not counted), MOE_GB_OPTION_LAYERS (16),
# MOE_GB_BUILD_DIR (build-gpu, which must hold a built moeinfer), MOE_GB_SKIP (families or
# options). Logs and JSON in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-bench-sweep}"
mkdir -p "$OUT"
BIN="${MOE_GB_BUILD_DIR:-build-gpu}/moeinfer"
FAMILIES="${MOE_GB_FAMILIES:-gpt-oss-120b:4 llama4-scout:6 glm-4.5-air:8 kimi-k2:2 qwen3-next-80b-a3b:8}"
OPTIONS="${MOE_GB_OPTIONS:---active-experts 4 --renorm full;--active-experts 4 --renorm kept;--drop-below 0.1;--router-temperature 1.5;--kv-dtype fp8;--weights fp8;--weights int4}"
OPTION_LAYERS="${MOE_GB_OPTION_LAYERS:-16}"
SKIP="${MOE_GB_SKIP:-}"

bench() {  # name, then bench flags
  local name=$1
  shift
  timeout -s KILL 240 "$BIN" bench --device cuda --temperature 1 "$@" --json "$OUT/$name.json" \
    >"$OUT/$name.log" 2>&1 || { echo "$name: failed or refused: $(tail -1 "$OUT/$name.log")"; rm -f "$OUT/$name.json"; }
}

if [ "$SKIP" != families ]; then
  for spec in $FAMILIES; do
    name=${spec%%:*} layers=${spec##*:}
    bench "family_$name" --model "synthetic:$name" --layers "$layers" --batch 1 --input-len 2048 \
      --output-len 32
  done
fi
if [ "$SKIP" != options ]; then
  model=(--model synthetic:qwen3-30b-a3b --layers "$OPTION_LAYERS")
  bench opt0_b1 "${model[@]}" --batch 1 --input-len 4096 --output-len 32
  bench opt0_b64 "${model[@]}" --batch 64 --input-len 128 --output-len 32
  i=0
  IFS=';' read -ra sets <<<"$OPTIONS"
  for flags in "${sets[@]}"; do
    i=$((i + 1))
    echo "$flags" >"$OUT/opt${i}.flags"
    # shellcheck disable=SC2086  # the flag set is words
    bench "opt${i}_b1" "${model[@]}" --batch 1 --input-len 4096 --output-len 32 $flags
    # shellcheck disable=SC2086
    bench "opt${i}_b64" "${model[@]}" --batch 64 --input-len 128 --output-len 32 $flags
  done
fi

python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
def load(name):
    path = os.path.join(out, name + ".json")
    return json.load(open(path)).get("gpu") if os.path.exists(path) else None
families = sorted(glob.glob(os.path.join(out, "family_*.json")))
if families:
    print(f"{'family (layers kept)':<30} {'decode ms':>9} {'floor/step':>10} {'prefill ms':>10} {'TFLOP/s':>8} {'peak ratio':>10} {'weights GiB':>11}")
    for path in families:
        g = json.load(open(path))["gpu"]
        print(f"{os.path.basename(path)[7:-5]:<30} {g['decode_step_seconds'] * 1e3:9.3f} "
              f"{g['decode_floor_ratio']:10.3f} {g.get('prefill_flops', 0) / max(g['prefill_peak_ratio'], 1e-12) / g['gemm_flops'] * 1e3:10.1f} "
              f"{g['prefill_peak_ratio'] * g['gemm_flops'] / 1e12:8.1f} {g['prefill_peak_ratio']:10.3f} {g['weight_bytes'] / 2**30:11.2f}")
base1, base64 = load("opt0_b1"), load("opt0_b64")
if base1 and base64:
    print()
    print(f"{'option':<34} {'b1 decode ms':>12} {'x speed':>7} {'b1 floor/step':>13} {'b64 decode ms':>13} {'x speed':>7} {'prefill4096 ms':>14} {'x speed':>7} {'weights GiB':>11} {'experts GiB':>16}")
    def row(label, b1, b64):
        pre = lambda g: g["prefill_flops"] / (g["prefill_peak_ratio"] * g["gemm_flops"])
        experts = f"{b1.get('routed_expert_bytes', 0) / 2**30:.2f} {b1.get('expert_format', '?')}"
        print(f"{label:<34} {b1['decode_step_seconds'] * 1e3:12.3f} {base1['decode_step_seconds'] / b1['decode_step_seconds']:7.2f} "
              f"{b1['decode_floor_ratio']:13.3f} "
              f"{b64['decode_step_seconds'] * 1e3:13.3f} {base64['decode_step_seconds'] / b64['decode_step_seconds']:7.2f} "
              f"{pre(b1) * 1e3:14.1f} {pre(base1) / pre(b1):7.2f} {b1['weight_bytes'] / 2**30:11.2f} {experts:>16}")
    row("unmodified", base1, base64)
    for flags_path in sorted(glob.glob(os.path.join(out, "opt*.flags")), key=lambda p: int(os.path.basename(p)[3:-6])):
        n = os.path.basename(flags_path)[3:-6]
        label = open(flags_path).read().strip()
        b1, b64 = load(f"opt{n}_b1"), load(f"opt{n}_b64")
        if b1 and b64:
            row(label, b1, b64)
        else:
            print(f"{label:<34} refused or failed (see opt{n}_b1.log)")
PY
