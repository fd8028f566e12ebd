"""Ctrl-C during a long generate: the call raises KeyboardInterrupt once its requests are
aborted (KV blocks freed), and the LLM goes on working."""

import subprocess
import sys

from conftest import DEMO, REPO

# SIGINT, as Ctrl-C sends it, must land while the engine steps, not in the Python lines before
# generate releases the GIL (where Python itself would raise). So a helper thread sends it, and
# the helper can only run once the main thread lets go of the GIL: the switch interval is made
# longer than the test, and nothing between event.set() and the engine's steps releases the GIL
# but generate itself.
SCRIPT = f"""
import os, signal, sys, threading
import moeinfer
llm = moeinfer.LLM({str(DEMO)!r}, max_num_seqs=64)
params = moeinfer.SamplingParams(temperature=1.0, seed=0, max_tokens=4000, ignore_eos=True)
prompts = [{{"prompt_token_ids": llm.encode("The meaning of life is")}}] * 64
go = threading.Event()
def ctrl_c():
    go.wait()
    os.kill(os.getpid(), signal.SIGINT)
helper = threading.Thread(target=ctrl_c)
helper.start()
sys.setswitchinterval(1000.0)
go.set()
try:
    llm.generate(prompts, params)
    print("not interrupted", flush=True)
except KeyboardInterrupt:
    stats = llm.stats()
    print("interrupted", stats["generation_tokens"], stats["num_running"], stats["num_waiting"],
          stats["kv"]["num_used"], flush=True)
sys.setswitchinterval(0.005)
helper.join()
out = llm.generate("Never", moeinfer.SamplingParams(temperature=0, max_tokens=4))
print("after", len(out[0].outputs[0].token_ids), flush=True)
"""


def test_ctrl_c_stops_generate_cleanly():
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("\n")
    fields = lines[0].split()
    assert fields[0] == "interrupted", result.stdout + result.stderr
    generated, running, waiting, kv_used = map(int, fields[1:])
    # 64 sequences to the end of the demo model's context (512 tokens) would be ~30,000 tokens.
    assert 0 < generated < 64 * 512
    assert (running, waiting, kv_used) == (0, 0, 0)
    after = lines[1].split()
    assert after[0] == "after" and 1 <= int(after[1]) <= 4
