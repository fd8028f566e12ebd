#!/usr/bin/env bash
# Serving under an expert budget (issue 14, item 8's last line): `moeinfer serve` all-resident,
# then under each budget and cold-expert mode, each sent the same concurrent greedy requests
# (distinct prompts, /v1/completions, temperature 0); every request must complete, and each
# budget's outputs must equal the all-resident server's token for token. Prints a line per
# server and a summary; exits 1 on any failed request or difference.
#
# Usage: scripts/offload-serve-check.sh MOEINFER_BINARY
# Knobs: MOE_OSC_DEVICE (cuda), MOE_OSC_MODEL (models/demo), MOE_OSC_RUNS ("25%:gpu 25%:auto"),
# MOE_OSC_CONCURRENCY (16), MOE_OSC_MAX_TOKENS (48), MOE_OSC_PORT (8131), MOE_OSC_FLAGS (more serve
# flags; default --deterministic, so that a request's tokens do not depend on which requests
# shared its steps), OUT (logs; /tmp/osc). Under --cold-experts gpu the outputs are bit for bit
# the resident ones; under cpu|auto the host computes in float32, within the parity bound, so a
# near-tie may differ.
# On the CPU backend the budget is the simulated one (the same cache, prefetch and cost-model
# code), so the script runs in CI-like settings too.
set -uo pipefail
BIN="${1:?usage: $0 MOEINFER_BINARY}"
DEVICE="${MOE_OSC_DEVICE:-cuda}"
MODEL="${MOE_OSC_MODEL:-models/demo}"
RUNS="${MOE_OSC_RUNS:-25%:gpu 25%:auto}"
CONC="${MOE_OSC_CONCURRENCY:-16}"
MAX_TOKENS="${MOE_OSC_MAX_TOKENS:-48}"
PORT="${MOE_OSC_PORT:-8131}"
FLAGS="${MOE_OSC_FLAGS---deterministic}"
OUT="${OUT:-/tmp/osc}"
mkdir -p "$OUT"

# serve NAME [flags...]: starts the server, sends the requests into $OUT/NAME.json, stops it.
serve() {
  local name=$1
  shift
  "$BIN" serve --device "$DEVICE" --model "$MODEL" --port "$PORT" --max-num-seqs "$CONC" $FLAGS "$@" \
    >"$OUT/$name.log" 2>&1 &
  local server=$!
  local up=0
  for _ in $(seq 1 600); do
    if python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health')" \
      2>/dev/null; then
      up=1
      break
    fi
    kill -0 $server 2>/dev/null || break
    sleep 0.5
  done
  if [ $up = 1 ]; then
    python3 - "$PORT" "$CONC" "$MAX_TOKENS" "$OUT/$name.json" <<'PY'
import json, sys, threading, urllib.request
port, conc, max_tokens, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
results = [None] * conc
def ask(i):
    # Distinct prompts of different lengths, so the batch mixes prefill and decode.
    prompt = f"Request {i}: " + " ".join(["the expert cache"] * (1 + i % 5)) + " and then"
    # ignore_eos: every request runs its max_tokens, so the budget's cache serves every step.
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "logprobs": 1}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            choice = json.load(r)["choices"][0]
            results[i] = {"text": choice["text"], "finish": choice["finish_reason"],
                          "tokens": choice["logprobs"]["tokens"]}
    except Exception as e:  # a failed request is a result too
        results[i] = {"error": str(e)}
threads = [threading.Thread(target=ask, args=(i,)) for i in range(conc)]
for t in threads: t.start()
for t in threads: t.join()
json.dump(results, open(path, "w"))
PY
  else
    echo "$name: the server did not come up:"
    tail -5 "$OUT/$name.log"
  fi
  kill -TERM $server 2>/dev/null
  wait $server
}

serve resident
names=()
for run in $RUNS; do
  budget=${run%%:*} cold=${run#*:}
  name="b${budget%\%}_$cold"
  names+=("$name")
  serve "$name" --expert-budget "$budget" --cold-experts "$cold"
done

python3 - "$OUT" "${names[@]}" <<'PY'
import json, os, sys
out, names = sys.argv[1], sys.argv[2:]
def load(name):
    path = os.path.join(out, name + ".json")
    return json.load(open(path)) if os.path.exists(path) else None
base = load("resident")
ok = base is not None and all(r and "error" not in r for r in base)
print(f"resident: {sum(1 for r in base or [] if r and 'error' not in r)} completed")
for name in names:
    runs = load(name)
    if runs is None or base is None:
        print(f"{name}: no result"); ok = False; continue
    done = sum(1 for r in runs if r and "error" not in r)
    same = sum(1 for a, b in zip(base, runs)
               if a and b and "error" not in a and "error" not in b and a["tokens"] == b["tokens"])
    for i, r in enumerate(runs):
        if not r or "error" in r: print(f"  {name} request {i}: {r}")
    print(f"{name}: {done}/{len(runs)} completed, {same}/{len(runs)} token for token equal to "
          f"resident")
    ok = ok and done == len(runs) and same == len(runs)
print("offload-serve-check:", "PASSED" if ok else "FAILED")
sys.exit(0 if ok else 1)
PY
