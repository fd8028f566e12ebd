"""LLM.generate's results: vLLM's shape, logprobs that are the model's, n sequences, stop
conditions, and text equal to the `moeinfer generate` command's for the same seed."""

import subprocess

import numpy as np
import pytest

import moeinfer

from conftest import DEMO, run_module

PROMPTS = ["The meaning of life is", "A fortune cookie says", "Never"]


def cli_generate(binary, prompt, *flags):
    result = subprocess.run([str(binary), "generate", "--model", str(DEMO), "--prompt", prompt,
                             *flags], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("\n")
    return result.stdout[:-1]


def test_readme_example_greedy_text(demo_llm):
    out = demo_llm.generate("The meaning of life is",
                            moeinfer.SamplingParams(temperature=0, max_tokens=128))
    # The README's text for `moeinfer generate --prompt "The meaning of life is"`.
    assert out[0].outputs[0].text == \
        ' a game of life.\n\t\t-- William Shakespeare, "Henry IV"'
    assert out[0].outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("flags,params", [
    ((), dict(temperature=0)),
    (("--temperature", "0.9", "--top-p", "0.95", "--seed", "7"),
     dict(temperature=0.9, top_p=0.95, seed=7)),
    (("--temperature", "1.2", "--top-k", "20", "--seed", "123"),
     dict(temperature=1.2, top_k=20, seed=123)),
])
def test_text_equals_the_cli(cli, demo_llm, flags, params):
    sampling = moeinfer.SamplingParams(max_tokens=40, **params)
    # All prompts in one call: the batch does not change any request's text.
    out = demo_llm.generate(PROMPTS, sampling)
    for prompt, result in zip(PROMPTS, out):
        expected = cli_generate(cli, prompt, "--max-tokens", "40", *flags)
        assert result.outputs[0].text == expected, prompt


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_kv_dtype_text_equals_the_cli(cli, kv_dtype):
    # The same rounding of the cached rows through Python and through the command.
    with moeinfer.LLM(DEMO, kv_dtype=kv_dtype) as llm:
        out = llm.generate(PROMPTS[0], moeinfer.SamplingParams(temperature=0, max_tokens=24))
    assert out[0].outputs[0].text == cli_generate(cli, PROMPTS[0], "--max-tokens", "24",
                                                  "--temperature", "0", "--kv-dtype", kv_dtype)


@pytest.mark.parametrize("weights", ["fp8", "int4"])
def test_linear_scope_text_equals_the_cli(cli, weights):
    # Every dense Linear quantised at load the same way through Python and through the command.
    with moeinfer.LLM(DEMO, weights=weights, weights_scope="linear") as llm:
        out = llm.generate(PROMPTS[0], moeinfer.SamplingParams(temperature=0, max_tokens=24))
    assert out[0].outputs[0].text == cli_generate(cli, PROMPTS[0], "--max-tokens", "24",
                                                  "--temperature", "0", "--weights", weights,
                                                  "--weights-scope", "linear")


def test_text_equals_python_m_moeinfer_generate(demo_llm):
    params = moeinfer.SamplingParams(temperature=0.8, seed=3, max_tokens=30)
    expected = run_module("generate", "--model", str(DEMO), "--prompt", PROMPTS[1],
                          "--max-tokens", "30", "--temperature", "0.8", "--seed", "3").stdout
    assert demo_llm.generate(PROMPTS[1], params)[0].outputs[0].text + "\n" == expected


def test_result_shape(demo_llm):
    out = demo_llm.generate(PROMPTS, moeinfer.SamplingParams(temperature=0, max_tokens=8))
    assert [o.prompt for o in out] == PROMPTS
    assert len({o.request_id for o in out}) == len(PROMPTS)
    for o in out:
        assert isinstance(o, moeinfer.RequestOutput) and o.finished
        assert o.prompt_token_ids == demo_llm.encode(o.prompt)
        assert o.prompt_logprobs is None
        (c,) = o.outputs
        assert isinstance(c, moeinfer.CompletionOutput)
        assert c.index == 0 and 1 <= len(c.token_ids) <= 8
        assert c.finish_reason in ("stop", "length")
        assert c.logprobs is None and c.cumulative_logprob is None
        assert c.tool_calls is None


def test_logprobs_are_the_models(demo_llm):
    params = moeinfer.SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    (out,) = demo_llm.generate(PROMPTS[0], params)
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 6
    ids = out.prompt_token_ids + c.token_ids
    logits = demo_llm.logits(ids[:-1]).astype(np.float64)
    logsoftmax = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1,
                                 keepdims=True)) - logits.max(1, keepdims=True)
    total = 0.0
    for i, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        row = logsoftmax[len(out.prompt_token_ids) - 1 + i]
        assert token in entry and 3 <= len(entry) <= 4
        assert entry[token].rank == 1  # greedy: the most likely token
        assert entry[token].decoded_token == demo_llm._engine.token_text(token)
        for alt, lp in entry.items():
            assert lp.logprob == pytest.approx(row[alt], abs=1e-4)
        total += entry[token].logprob
    assert c.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_prompt_logprobs(demo_llm):
    params = moeinfer.SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    (out,) = demo_llm.generate(PROMPTS[0], params)
    ids = out.prompt_token_ids
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    logits = demo_llm.logits(ids).astype(np.float64)
    for j in range(1, len(ids)):
        row = logits[j - 1] - np.log(np.exp(logits[j - 1] - logits[j - 1].max()).sum()) \
            - logits[j - 1].max()
        assert out.prompt_logprobs[j][ids[j]].logprob == pytest.approx(row[ids[j]], abs=1e-4)


def test_n_sequences_draw_from_seed_plus_index(demo_llm):
    params = moeinfer.SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12)
    (out,) = demo_llm.generate(PROMPTS[2], params)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for c in out.outputs:
        alone = moeinfer.SamplingParams(temperature=1.0, seed=11 + c.index, max_tokens=12)
        assert demo_llm.generate(PROMPTS[2], alone)[0].outputs[0].token_ids == c.token_ids
        assert c.cumulative_logprob is not None and c.cumulative_logprob <= 0


def test_stop_string_and_max_tokens(demo_llm):
    (full,) = demo_llm.generate(PROMPTS[0], moeinfer.SamplingParams(temperature=0, max_tokens=30))
    text = full.outputs[0].text
    cut = text.index("life")
    (stopped,) = demo_llm.generate(
        PROMPTS[0], moeinfer.SamplingParams(temperature=0, max_tokens=30, stop=["life"]))
    assert stopped.outputs[0].text == text[:cut]
    assert stopped.outputs[0].finish_reason == "stop"
    (short,) = demo_llm.generate(PROMPTS[0], moeinfer.SamplingParams(temperature=0, max_tokens=3))
    assert len(short.outputs[0].token_ids) == 3 and short.outputs[0].finish_reason == "length"


def test_default_sampling_params_and_max_tokens_none(demo_llm):
    assert isinstance(demo_llm.get_default_sampling_params(), moeinfer.SamplingParams)
    params = moeinfer.SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    prompt = demo_llm.encode(PROMPTS[0])
    (out,) = demo_llm.generate({"prompt_token_ids": prompt}, params)
    assert len(prompt) + len(out.outputs[0].token_ids) == demo_llm.max_model_len


def test_profile_stats(demo_llm):
    llm = moeinfer.LLM(DEMO, profile=True)
    llm.generate(PROMPTS, moeinfer.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    stats = llm.stats()
    rows = stats["expert_rows"]
    assert rows.dtype == np.int64 and rows.ndim == 2
    assert stats["generation_tokens"] == 15
    # Every token computed goes to top-k experts in every MoE layer.
    top_k = 2
    moe_layers = rows.sum(axis=1) > 0
    assert (rows.sum(axis=1)[moe_layers] == stats["computed_tokens"] * top_k).all()
    assert stats["stage_seconds"]["experts"] > 0
    assert set(stats["stage_seconds"]) >= {"route", "plan", "dispatch", "experts", "unpermute"}


def test_sampling_params_changed_after_construction_count(demo_llm):
    params = moeinfer.SamplingParams(temperature=0, max_tokens=2)
    params.max_tokens = 5
    params.ignore_eos = True
    (out,) = demo_llm.generate(PROMPTS[0], params)
    assert len(out.outputs[0].token_ids) == 5
    params.temperature = -3.0
    import pytest
    with pytest.raises(ValueError, match="temperature"):
        demo_llm.generate(PROMPTS[0], params)
