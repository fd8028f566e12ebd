"""Ctrl-C during a long generate: the call raises KeyboardInterrupt once its requests are
aborted (KV blocks freed), and the LLM goes on working."""

import signal
import subprocess
import sys

from conftest import DEMO, REPO

SCRIPT = f"""
import sys, moeinfer
llm = moeinfer.LLM({str(DEMO)!r}, max_num_seqs=64)
params = moeinfer.SamplingParams(temperature=1.0, seed=0, max_tokens=4000, ignore_eos=True)
print("generating", flush=True)
try:
    llm.generate(["The meaning of life is"] * 64, params)
    print("not interrupted", flush=True)
except KeyboardInterrupt:
    stats = llm.stats()
    print("interrupted", stats["generation_tokens"], stats["num_running"], stats["num_waiting"],
          stats["kv"]["num_used"], flush=True)
out = llm.generate("Never", moeinfer.SamplingParams(temperature=0, max_tokens=4))
print("after", len(out[0].outputs[0].token_ids), flush=True)
"""


def test_ctrl_c_stops_generate_cleanly():
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "generating"
        # 64 sequences to the end of the demo model's context (512 tokens) take far longer than
        # the signal takes to arrive: it lands while the engine steps.
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    lines = out.split("\n")
    fields = lines[0].split()
    assert fields[0] == "interrupted", out + err
    generated, running, waiting, kv_used = map(int, fields[1:])
    assert generated < 64 * 512
    assert (running, waiting, kv_used) == (0, 0, 0)
    assert lines[1].split()[0] == "after" and 1 <= int(lines[1].split()[1]) <= 4
