#!/usr/bin/env bash
# The stage profiler's cost on GPU decode steps, in one call after scripts/gpu-check.sh built
# $BUILD. `moeinfer profile --device cuda` on synthetic:qwen3-30b-a3b (all 48 layers) measures it
# in one process: blocks of the same decode step with the profiler off and on, alternating (an on
# block holds one timed step per --time-every steps), and whole workloads off and on. It runs at
# batch 1 and 8 (context 1024) and batch 32 (context 256) with the default sampling (stages timed
# on one step in 16) and at batch 1 and 8 with every step timed. Then `moeinfer bench --profile`
# against plain `bench` (the engine's path: sampling on the GPU), off-on-on-off at batch 1.
# Prints a table last.
#
# Knobs: MOE_PROFILE_MODEL (default synthetic:qwen3-30b-a3b); MOE_PROFILE_RUNS, the runs to make
# (default "b1 b8 b32 b1_every b8_every bench").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-profile}"
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu-profile.log") 2>&1  # kept even if the call is cut short
WORK=/tmp/gpu-profile-reports
mkdir -p "$WORK"
BUILD="${MOE_GPU_BUILD_DIR:-build-gpu}"
export LD_LIBRARY_PATH=/opt/deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
M="$BUILD/moeinfer"
MODEL="${MOE_PROFILE_MODEL:-synthetic:qwen3-30b-a3b}"

RUNS=" ${MOE_PROFILE_RUNS:-b1 b8 b32 b1_every b8_every bench} "
profile() {  # name, then profile flags
  local name=$1
  shift
  [[ "$RUNS" == *" $name "* ]] || return 0
  echo "== $(date +%T) $name: moeinfer profile --device cuda --model $MODEL $*"
  timeout 150 "$M" profile --device cuda --model "$MODEL" --output-len 64 --repeats 3 \
    --out "$WORK/$name" "$@" >"$WORK/$name.log" 2>&1
  echo "rc=$?"
  grep -E "^(time|profiler overhead|  measured|stages|moeinfer: error)" "$WORK/$name.log"
}
profile b1 --batch 1 --input-len 1024
profile b8 --batch 8 --input-len 1024
profile b32 --batch 32 --input-len 256
profile b1_every --batch 1 --input-len 1024 --time-every 1
profile b8_every --batch 8 --input-len 1024 --time-every 1
cp "$WORK/b8/report.txt" "$OUT/profile_b8_report.txt" 2>/dev/null

bench() {  # name, then bench flags
  local name=$1
  shift
  echo "== $(date +%T) bench $name"
  timeout 120 "$M" bench --device cuda --model "$MODEL" --batch 1 --input-len 1024 \
    --output-len 256 --json "$WORK/$name.json" "$@" >"$WORK/$name.log" 2>&1
  echo "rc=$?"
}
if [[ "$RUNS" == *" bench "* ]]; then
  bench off1
  bench on1 --profile
  bench on2 --profile
  bench off2
fi

python3 - "$WORK" <<'PY' | tee "$OUT/profile-summary.txt"
import json, os, sys
work = sys.argv[1]
print("\nrun         time_every  paired step off -> on (us)   overhead   whole runs   budget 3%")
for name in ("b1", "b8", "b32", "b1_every", "b8_every"):
    path = os.path.join(work, name, "report.json")
    if not os.path.exists(path):
        print(f"{name:<11} (no report)")
        continue
    r = json.load(open(path))
    o, s = r["overhead"], r["summary"]
    print(f"{name:<11} {s['time_every']:>10}  {o['step_off_us']:10.1f} -> {o['step_on_us']:10.1f}"
          f"   {o['measured_step']:+8.2%}   {o['measured']:+9.2%}   "
          f"{'ok' if o['measured_step'] <= 0.03 else 'over'}")
for name in ("b8", "b8_every"):
    path = os.path.join(work, name, "report.json")
    if os.path.exists(path):
        r = json.load(open(path))
        shares = {t["stage"]: t["share"] for t in r["totals"] if t["share"] > 0.005}
        print(f"{name} stage shares ({r['summary']['timed_steps']} timed steps): " +
              ", ".join(f"{k} {v:.3f}" for k, v in shares.items()))
steps = {}
for name in ("off1", "on1", "on2", "off2"):
    path = os.path.join(work, name + ".json")
    if os.path.exists(path):
        steps[name] = json.load(open(path))["gpu"]["decode_step_seconds"] * 1e3
if len(steps) == 4:
    off = (steps["off1"] + steps["off2"]) / 2
    on = (steps["on1"] + steps["on2"]) / 2
    print(f"bench B1 decode step, off {steps['off1']:.3f}/{steps['off2']:.3f} ms, on "
          f"{steps['on1']:.3f}/{steps['on2']:.3f} ms: overhead {on / off - 1:+.2%}")
PY
