"""The Python API against transformers: every model fixture's reference logits and greedy
continuation (tools/make_fixtures.py), with tests/model/parity_test.cpp's bounds, through
LLM.logits and LLM.generate (the continuous-batching engine)."""

import numpy as np
import pytest

import moeinfer

from conftest import FIXTURES, fixture_names, reference


@pytest.fixture(scope="module", params=fixture_names())
def fixture(request):
    name = request.param
    return name, reference(name), moeinfer.LLM(FIXTURES / name, max_num_seqs=8)


def test_logits_match_reference(fixture):
    name, ref, llm = fixture
    expected = np.load(FIXTURES / name / "logits.npy")
    logits = llm.logits(ref["prompt_ids"])
    assert logits.dtype == np.float32
    assert logits.shape == (len(ref["prompt_ids"]), llm.vocab_size) == expected.shape
    assert np.isfinite(logits).all()
    rel = np.linalg.norm((logits.astype(np.float64) - expected)) / np.linalg.norm(expected)
    assert rel <= ref["max_rel_error"], f"{name}: ||ours - ref|| / ||ref|| = {rel:.3g}"


def test_logits_array_is_the_engines_buffer(fixture):
    _, ref, llm = fixture
    logits = llm.logits(np.asarray(ref["prompt_ids"], dtype=np.int64))
    # Not a copy: NumPy wraps the memory the engine wrote (an owner object holds it).
    assert logits.base is not None
    assert logits.flags.c_contiguous and logits.flags.writeable
    again = llm.logits(ref["prompt_ids"])
    assert not np.shares_memory(logits, again)
    np.testing.assert_array_equal(logits, again)


def test_greedy_continuation_matches_reference(fixture):
    name, ref, llm = fixture
    greedy = ref["greedy_ids"]
    params = moeinfer.SamplingParams(temperature=0, max_tokens=len(greedy), ignore_eos=True)
    out = llm.generate({"prompt_token_ids": ref["prompt_ids"]}, params)
    assert len(out) == 1
    assert out[0].prompt_token_ids == ref["prompt_ids"]
    completion = out[0].outputs[0]
    assert completion.token_ids == greedy, name
    assert completion.finish_reason == "length"
    assert completion.text == llm.decode(greedy)


def test_prompts_batched_together_keep_the_reference(fixture):
    name, ref, llm = fixture
    greedy = ref["greedy_ids"]
    prompt = ref["prompt_ids"]
    params = moeinfer.SamplingParams(temperature=0, max_tokens=len(greedy), ignore_eos=True)
    # Three copies and two shorter prompts share the engine's steps.
    prompts = [{"prompt_token_ids": p} for p in (prompt, prompt[:3], prompt, prompt[:5], prompt)]
    out = llm.generate(prompts, params)
    assert [o.prompt_token_ids for o in out] == [p["prompt_token_ids"] for p in prompts]
    for i in (0, 2, 4):
        assert out[i].outputs[0].token_ids == greedy, f"{name}: prompt {i}"
    assert llm.stats()["num_running"] == 0


def test_logits_in_chunks_match_reference(fixture):
    # The engine runs logits() in chunks of max_num_batched_tokens over its paged KV cache.
    name, ref, _ = fixture
    llm = moeinfer.LLM(FIXTURES / name, max_num_batched_tokens=3, max_num_seqs=2, block_size=4)
    expected = np.load(FIXTURES / name / "logits.npy")
    logits = llm.logits(ref["prompt_ids"])
    rel = np.linalg.norm((logits.astype(np.float64) - expected)) / np.linalg.norm(expected)
    assert rel <= ref["max_rel_error"], f"{name}: ||ours - ref|| / ||ref|| = {rel:.3g}"
