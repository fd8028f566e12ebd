#!/usr/bin/env bash
# scratch (not committed): build everything with the Python module, full test_cuda, Python on cuda
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH
export PKG_CONFIG_PATH=/opt/deps/usr/lib/x86_64-linux-gnu/pkgconfig:/opt/deps/usr/share/pkgconfig
export LD_LIBRARY_PATH=/opt/deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
bash scripts/device-deps.sh unpack >"$OUT/deps.log" 2>&1 || { tail "$OUT/deps.log"; exit 1; }
PY=python3
$PY -m pip install --no-index --target /tmp/nb .whl/nanobind-*.whl -q >"$OUT/pip.log" 2>&1 || tail -3 "$OUT/pip.log"
NB=$(ls -d /tmp/nb/nanobind/cmake)
start=$SECONDS
if ! { cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DCMAKE_PREFIX_PATH=/opt/deps/usr -DMOE_BUILD_BENCH=OFF -DMOE_BUILD_PYTHON=ON -Dnanobind_DIR=$NB \
  -DPython_EXECUTABLE=$(command -v $PY) && cmake --build build-gpu -j16 --target ${TARGETS:-test_cuda moeinfer _core}; } >"$OUT/build.log" 2>&1; then
  grep -E "error|FAILED" "$OUT/build.log" | head -30; exit 1
fi
echo "build: $((SECONDS-start)) s"
start=$SECONDS
timeout 420 build-gpu/tests/test_cuda ${GFILTER:+--gtest_filter=$GFILTER} >"$OUT/test_cuda.log" 2>&1
echo "test_cuda rc=$? $((SECONDS-start)) s: $(grep -E '^\[  PASSED  \]|^\[  FAILED  \]|tests ran' "$OUT/test_cuda.log" | tr '\n' ' ')"
grep -E "^\[  FAILED  \]" "$OUT/test_cuda.log" | head -20
grep -E "^parity|fixture" "$OUT/test_cuda.log" | head -60
if [ -f build-gpu/src/python/_core*.so ] || ls build-gpu/src/python/_core*.so >/dev/null 2>&1; then
  mkdir -p /tmp/pydev/moeinfer
  for f in python/moeinfer/*; do ln -sf "$PWD/$f" /tmp/pydev/moeinfer/; done
  ln -sf "$PWD"/build-gpu/src/python/_core*.so /tmp/pydev/moeinfer/
  MOEINFER_CLI=$PWD/build-gpu/moeinfer PYTHONPATH=/tmp/pydev timeout 120 $PY - <<'PY' 2>&1 | tail -20
import moeinfer, numpy as np
print("built_with_cuda", moeinfer.built_with_cuda)
from moeinfer import LLM, SamplingParams
sp = SamplingParams(max_tokens=16, temperature=0)
for m in ["tests/fixtures/models/qwen3_moe_bf16", "tests/fixtures/models/glm4_moe_air_bf16"]:
    outs = {}
    for dev in ["cpu", "cuda"]:
        llm = LLM(m, device=dev)
        o = llm.generate(["Hello world", "The quick brown"], sp)
        outs[dev] = [r.outputs[0].token_ids for r in o]
        print(m.split("/")[-1], dev, outs[dev][0][:8], llm.device)
        llm.close() if hasattr(llm, "close") else None
    print(m.split("/")[-1], "cpu==cuda greedy:", outs["cpu"] == outs["cuda"])
PY
fi
if [ "${PROFILE_RUNS:-1}" = 1 ]; then
  B=build-gpu/moeinfer
  for args in "" "--expert-budget 100%" "--expert-budget 50%"; do
    name=$(echo "res $args" | tr -d ' %-' )
    timeout 200 $B bench --device cuda --model synthetic:qwen3-30b-a3b --layers 16 --batch 1 --input-len 1 \
      --output-len 96 --temperature 1 --profile --time-every 4 $args --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1
    echo "== bench $args rc=$?"; grep -E "step|stage|route|plan|experts|unpermute|attention|shared|lm_head|floor" "$OUT/$name.log" | head -30
  done
fi
