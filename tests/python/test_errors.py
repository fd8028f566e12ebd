"""Engine errors reach Python as exceptions carrying the engine's message."""

import pytest

import moeinfer

from conftest import DEMO, FIXTURES


def test_bad_model_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(moeinfer.EngineError, match="no such folder") as info:
        moeinfer.LLM(missing)
    assert str(missing) in str(info.value)


def test_folder_without_checkpoint(tmp_path):
    with pytest.raises(moeinfer.EngineError, match="config.json"):
        moeinfer.LLM(tmp_path)


@pytest.mark.parametrize("field,value,message", [
    ("temperature", -1.0, "temperature"),
    ("top_p", 0.0, "top_p"),
    ("top_k", -5, "top_k"),
    ("repetition_penalty", 0.0, "repetition_penalty"),
    ("max_tokens", 0, "max_tokens"),
    ("logprobs", 21, "logprobs"),
    ("n", 0, "n must be"),
    ("logit_bias", {5: 500.0}, "bias"),
])
def test_bad_sampling_parameter(field, value, message):
    with pytest.raises(ValueError, match=message):
        moeinfer.SamplingParams(**{field: value})


def test_token_outside_the_vocabulary(demo_llm):
    bad = demo_llm.vocab_size + 3
    with pytest.raises(moeinfer.EngineError, match=f"token id {bad} outside the vocabulary"):
        demo_llm.generate({"prompt_token_ids": [1, bad]}, moeinfer.SamplingParams(max_tokens=2))
    with pytest.raises(moeinfer.EngineError, match="outside the vocabulary"):
        demo_llm.logits([bad])
    with pytest.raises(moeinfer.EngineError, match="outside the vocabulary"):
        demo_llm.decode([bad])


def test_a_refused_request_queues_nothing(demo_llm):
    bad = demo_llm.vocab_size
    with pytest.raises(moeinfer.EngineError, match="prompt 1: token id"):
        demo_llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [bad]}],
                          moeinfer.SamplingParams(max_tokens=2))
    stats = demo_llm.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    out = demo_llm.generate("Never", moeinfer.SamplingParams(temperature=0, max_tokens=2))
    assert len(out[0].outputs[0].token_ids) >= 1


def test_prompt_longer_than_the_context(demo_llm):
    ids = [1] * demo_llm.max_model_len
    with pytest.raises(moeinfer.EngineError, match="context holds"):
        demo_llm.generate({"prompt_token_ids": ids}, moeinfer.SamplingParams(max_tokens=1))
    with pytest.raises(moeinfer.EngineError, match="no token ids"):
        demo_llm.logits([])


def test_bad_engine_options():
    with pytest.raises(moeinfer.EngineError, match="device must be 'cpu' or 'cuda'"):
        moeinfer.LLM(DEMO, device="tpu")
    with pytest.raises(moeinfer.EngineError, match="expert-budget|budget"):
        moeinfer.LLM(DEMO, expert_budget="lots")
    with pytest.raises(moeinfer.EngineError, match="kv_dtype must be 'auto', 'f32', 'bf16' or"):
        moeinfer.LLM(DEMO, kv_dtype="int8")
    with pytest.raises(moeinfer.EngineError, match="kv_dtype='f32' applies to device='cpu'"):
        moeinfer.LLM(DEMO, device="cuda", kv_dtype="f32")
    with pytest.raises(moeinfer.EngineError, match="weights_scope must be 'experts' or 'linear'"):
        moeinfer.LLM(DEMO, weights="fp8", weights_scope="all")
    for weights in (None, "bf16"):
        with pytest.raises(moeinfer.EngineError, match="weights_scope='linear' quantises"):
            moeinfer.LLM(DEMO, weights=weights, weights_scope="linear")
    # (fp8 rows on cuda are kept for GQA and MLA models alike; the one fp8 refusal left, heads
    # past 256, has no fixture.)
    # test_expert_parallel.py has the ep refusals.


def test_chat_without_a_template():
    llm = moeinfer.LLM(FIXTURES / "qwen3_moe_f32")
    with pytest.raises(moeinfer.EngineError, match="has no chat_template"):
        llm.chat([{"role": "user", "content": "hi"}])


def test_command_errors():
    with pytest.raises(moeinfer.UsageError, match="--no-such-flag"):
        moeinfer.serve(DEMO, no_such_flag=True)
    with pytest.raises(moeinfer.EngineError, match="nonexistent"):
        moeinfer.run(["info", "--model", "/nonexistent/model"])
