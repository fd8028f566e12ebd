#!/usr/bin/env bash
# The serving figures on one GPU (the serving issue's item 7), in one call on the GPU machine:
# `moeinfer bench` at batch 64 and `moeinfer serve` driven by `moeinfer bench-serve` at
# concurrency 64, the same synthetic model and request shape, in the same run; prints the
# server's output tokens/s as a share of the offline ceiling and the scheduler's share of the
# server's step time (from its /metrics counters), then a one-line summary.
#
# Needs `scripts/device-deps.sh download` here (it fetches cpp-httplib into .deps/http) and
# `carry: [".deps"]`; builds its own build dir with HTTP ($MOE_SERVE_BUILD_DIR, default
# build-serve). Knobs: MOE_SERVE_MODEL (synthetic:qwen3-30b-a3b), MOE_SERVE_INPUT (512),
# MOE_SERVE_OUTPUT (128), MOE_SERVE_PROMPTS (256).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-serve}"
mkdir -p "$OUT"
BUILD="${MOE_SERVE_BUILD_DIR:-build-serve}"
ROOT="${MOE_DEPS_ROOT:-/opt/deps}"
MODEL="${MOE_SERVE_MODEL:-synthetic:qwen3-30b-a3b}"
I="${MOE_SERVE_INPUT:-512}"
O="${MOE_SERVE_OUTPUT:-128}"
N="${MOE_SERVE_PROMPTS:-256}"
PORT=8123
export PATH=/usr/local/cuda/bin:$PATH
export PKG_CONFIG_PATH=$ROOT-http/usr/lib/x86_64-linux-gnu/pkgconfig:$ROOT/usr/lib/x86_64-linux-gnu/pkgconfig:$ROOT/usr/share/pkgconfig
export LD_LIBRARY_PATH=$ROOT-http/usr/lib/x86_64-linux-gnu:$ROOT/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}

[ -d "$ROOT-http" ] || bash scripts/device-deps.sh unpack >/dev/null
if ! { cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
         "-DCMAKE_PREFIX_PATH=$ROOT/usr;$ROOT-http/usr" &&
       cmake --build "$BUILD" -j16 --target moeinfer; } >"$OUT/serve-build.log" 2>&1; then
  grep -E "error|FAILED|httplib" "$OUT/serve-build.log" | head -20
  echo "gpu-serve: FAILED to build moeinfer with HTTP"
  exit 1
fi
grep -i "httplib" "$OUT/serve-build.log" | head -3

echo "== moeinfer bench --device cuda --model $MODEL --batch 64 --input-len $I --output-len $O"
"$BUILD/moeinfer" bench --device cuda --model "$MODEL" --batch 64 --input-len "$I" \
  --output-len "$O" --json "$OUT/bench_b64.json" 2>&1 | grep -E "throughput|Scheduler|step|GPU:"

echo "== moeinfer serve --device cuda --model $MODEL --max-num-seqs 64"
"$BUILD/moeinfer" serve --device cuda --model "$MODEL" --port "$PORT" --max-num-seqs 64 \
  --max-num-batched-tokens 8192 --max-model-len $((I + O)) >"$OUT/serve.log" 2>&1 &
server=$!
for _ in $(seq 1 240); do
  python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health')" \
    2>/dev/null && break
  kill -0 $server 2>/dev/null || break
  sleep 0.5
done
echo "== moeinfer bench-serve --concurrency 64 --num-prompts $N"
"$BUILD/moeinfer" bench-serve --url "http://127.0.0.1:$PORT" --concurrency 64 \
  --num-prompts "$N" --input-len "$I" --output-len "$O" --json "$OUT/serve_c64.json" 2>&1 |
  tee "$OUT/bench-serve.log" | grep -E "Successful|Failed|throughput|share|Median TTFT|Median TPOT"
python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$PORT/metrics').read().decode())" \
  >"$OUT/metrics.txt" 2>&1
kill -TERM $server
wait $server
echo "server exit status $?"
tail -3 "$OUT/serve.log"

python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
try:
    bench = json.load(open(os.path.join(out, "bench_b64.json")))
    serve = json.load(open(os.path.join(out, "serve_c64.json")))
except Exception as e:
    print("gpu-serve: no result:", e); sys.exit(1)
ratio = serve["output_throughput"] / bench["output_throughput"]
share = serve.get("server_schedule_share", float("nan"))
print(f"gpu-serve: server {serve['output_throughput']:.1f} tok/s at concurrency 64 vs bench "
      f"{bench['output_throughput']:.1f} tok/s at batch 64 = {ratio:.3f} (target >= 0.85); "
      f"scheduler {share:.4f} of the server's step (target <= 0.05); "
      f"{serve['completed']} completed, {serve['failed']} failed")
PY
