"""LLM(ep=N) under `mpirun -np N python SCRIPT`: rank 0's generate and chat give what one
process gives (greedy, so the tokens are exact), the requests spread over every rank's engine
(stats()["ranks"]), a placement with replicas changes nothing, the other ranks end inside
LLM(...) once rank 0 closes, and what expert parallelism cannot run is refused by name."""

import json
import os
import shutil
import subprocess
import sys

import pytest

import moeinfer

from conftest import DEMO, FIXTURES

PROMPTS = ["The meaning of life is", "A fortune cookie says", "Never", "one two three four",
           "MoE layers route tokens"]

# Run on every rank; rank 0 prints one JSON line, every rank prints "rank R done" after LLM().
SCRIPT = """
import json, sys
import moeinfer
model, ep, placement, overlap = sys.argv[1], int(sys.argv[2]), sys.argv[3] or None, sys.argv[4]
llm = moeinfer.LLM(model, ep=ep, placement=placement, overlap=overlap == "on", max_num_seqs=2,
                   dispatch_dtype=sys.argv[6], micro_batches=int(sys.argv[7]))
prompts = json.loads(sys.argv[5])
greedy = moeinfer.SamplingParams(temperature=0, max_tokens=8)
outs = llm.generate(prompts, greedy)
result = {"tokens": [o.outputs[0].token_ids for o in outs], "ranks": llm.stats()["ranks"]}
if "demo" in model:
    chat = llm.chat([{"role": "user", "content": "Hello"}], greedy)
    result["chat"] = chat[0].outputs[0].token_ids
errors = {}
for name, call in [("logits", lambda: llm.logits([1, 2, 3])),
                   ("trace_routing", lambda: llm.trace_routing("unused.trace"))]:
    try:
        call()
    except moeinfer.EngineError as e:
        errors[name] = str(e)
llm.close()
try:
    llm.generate(prompts[:1], greedy)
except moeinfer.EngineError as e:
    errors["after_close"] = str(e)
result["errors"] = errors
print(json.dumps(result), flush=True)
"""


def mpirun_or_skip() -> str:
    launcher = shutil.which("mpirun")
    if launcher is None:
        pytest.skip("mpirun not found (scripts/install-deps.sh installs openmpi-bin)")
    return launcher


def run_ranks(tmp_path, n, model, placement="", overlap="on", dispatch_dtype="f32",
              micro_batches=1):
    script = tmp_path / "ep_script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", MOE_NUM_THREADS="1",
               # A session directory of its own: Open MPI 4.1's mkdir of the shared one races
               # with other launches starting at the same moment ("File exists").
               OMPI_MCA_orte_tmpdir_base=str(tmp_path))
    r = subprocess.run([mpirun_or_skip(), "-np", str(n), sys.executable, str(script), str(model),
                        str(n), str(placement), overlap, json.dumps(PROMPTS), dispatch_dtype,
                        str(micro_batches)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert r.returncode == 0, f"mpirun -np {n}: exit {r.returncode}\n{r.stderr[-3000:]}"
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, f"rank 0 alone runs past LLM(...), got:\n{r.stdout}"
    return json.loads(lines[0])


def one_process(model):
    llm = moeinfer.LLM(model, max_num_seqs=2)
    greedy = moeinfer.SamplingParams(temperature=0, max_tokens=8)
    want = {"tokens": [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]}
    if model == DEMO:
        want["chat"] = llm.chat([{"role": "user", "content": "Hello"}], greedy)[0] \
            .outputs[0].token_ids
    return want


@pytest.mark.parametrize("model,n", [(DEMO, 2), (FIXTURES / "deepseek_v3_f32", 3),
                                     (FIXTURES / "mixtral_f32", 2)])
def test_generate_equals_one_process(tmp_path, model, n):
    want = one_process(model)
    got = run_ranks(tmp_path, n, model)
    assert got["tokens"] == want["tokens"]
    if "chat" in want:
        assert got["chat"] == want["chat"]
    ranks = got["ranks"]
    assert len(ranks) == n
    assert sum(r["num_assigned"] for r in ranks) == len(PROMPTS)  # taken before the chat
    assert all(r["num_assigned"] >= 1 for r in ranks), ranks
    assert all(r["num_running"] == 0 and r["num_waiting"] == 0 for r in ranks), ranks
    errors = got["errors"]
    assert "not available under ep > 1" in errors["logits"]
    assert "not available under ep > 1" in errors["trace_routing"]
    assert "closed" in errors["after_close"]


def test_placement_with_replicas_and_no_overlap(tmp_path):
    model = FIXTURES / "qwen2_moe_f32"
    experts = json.loads((model / "config.json").read_text())["num_experts"]
    # Every expert on rank 0 and a replica of each on rank 1.
    placement = tmp_path / "placement.json"
    placement.write_text(json.dumps({"format": "moeinfer-placement", "version": 1,
                                     "num_experts": experts, "num_ranks": 2,
                                     "ranks": [list(range(experts)), list(range(experts))]}))
    want = one_process(model)
    got = run_ranks(tmp_path, 2, model, placement=placement, overlap="off")
    assert got["tokens"] == want["tokens"]


@pytest.mark.parametrize("dispatch_dtype", ["bf16", "fp8"])
def test_encoded_dispatch_keeps_the_demo_text(tmp_path, dispatch_dtype):
    # The demo model's greedy text survives rows sent in bf16 and in fp8 (bench/RESULTS.md,
    # "--dispatch-dtype under --ep 2").
    want = one_process(DEMO)
    got = run_ranks(tmp_path, 2, DEMO, dispatch_dtype=dispatch_dtype)
    assert got["tokens"] == want["tokens"]
    assert got["chat"] == want["chat"]


@pytest.mark.parametrize("model,n", [(DEMO, 2), (FIXTURES / "deepseek_v3_f32", 3)])
def test_two_micro_batches_equal_one_process(tmp_path, model, n):
    # Greedy tokens as one process gives, whichever micro-batch each sequence falls in (five
    # prompts over n ranks leave some rank with one sequence, so one of its halves is empty).
    want = one_process(model)
    got = run_ranks(tmp_path, n, model, micro_batches=2)
    assert got["tokens"] == want["tokens"]
    if "chat" in want:
        assert got["chat"] == want["chat"]


def test_refusals_name_the_problem(tmp_path):
    with pytest.raises(moeinfer.EngineError, match=r"mpirun -np 2"):
        moeinfer.LLM(DEMO, ep=2)
    with pytest.raises(moeinfer.EngineError, match="placement needs ep > 1"):
        moeinfer.LLM(DEMO, placement=tmp_path / "p.json")
    with pytest.raises(moeinfer.EngineError, match="overlap=False needs ep > 1"):
        moeinfer.LLM(DEMO, overlap=False)
    with pytest.raises(moeinfer.EngineError, match="dispatch_dtype='fp8' needs ep > 1"):
        moeinfer.LLM(DEMO, dispatch_dtype="fp8")
    with pytest.raises(moeinfer.EngineError, match="dispatch_dtype must be 'f32', 'bf16' or"):
        moeinfer.LLM(DEMO, ep=2, dispatch_dtype="int8")
    with pytest.raises(moeinfer.EngineError, match="micro_batches=2 needs ep > 1"):
        moeinfer.LLM(DEMO, micro_batches=2)
    with pytest.raises(moeinfer.EngineError, match="micro_batches must be 1 or 2, got 3"):
        moeinfer.LLM(DEMO, ep=2, micro_batches=3)
    with pytest.raises(moeinfer.EngineError, match="ep must be >= 1"):
        moeinfer.LLM(DEMO, ep=0)
    with pytest.raises(moeinfer.EngineError, match="expert parallelism runs on CPU ranks"):
        moeinfer.LLM(DEMO, device="cuda", ep=2)


def test_close_without_ep(tmp_path):
    with moeinfer.LLM(DEMO) as llm:
        out = llm.generate("Never", moeinfer.SamplingParams(temperature=0, max_tokens=2))
        assert len(out[0].outputs[0].token_ids) == 2
    with pytest.raises(moeinfer.EngineError, match="closed"):
        llm.generate("Never", moeinfer.SamplingParams(temperature=0, max_tokens=2))
