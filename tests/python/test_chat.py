"""LLM.chat: the server's chat-template rendering and tool-call reading, from Python."""

import json

import moeinfer

from conftest import DEMO, run_module

CONVERSATION = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Tell me a fortune."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def test_prompt_is_the_templates_text(demo_llm, tmp_path):
    messages = tmp_path / "messages.json"
    messages.write_text(json.dumps(CONVERSATION))
    rendered = run_module("template", "--model", str(DEMO), "--messages", str(messages),
                          "--add-generation-prompt").stdout
    (out,) = demo_llm.chat(CONVERSATION, moeinfer.SamplingParams(temperature=0, max_tokens=20))
    # The template writes the BOS itself: no special tokens added when encoding its text.
    assert out.prompt_token_ids == demo_llm.encode(rendered.rstrip("\n"), add_special_tokens=False) \
        or out.prompt_token_ids == demo_llm.encode(rendered, add_special_tokens=False)
    assert out.outputs[0].finish_reason in ("stop", "length")
    # The template's end-of-turn token stops generation and is not in the text.
    assert "<|im_end|>" not in out.outputs[0].text


def test_chat_equals_generate_on_the_same_ids(demo_llm):
    params = moeinfer.SamplingParams(temperature=0.7, seed=5, max_tokens=24)
    (chat,) = demo_llm.chat(CONVERSATION, params)
    (gen,) = demo_llm.generate({"prompt_token_ids": chat.prompt_token_ids},
                               moeinfer.SamplingParams(temperature=0.7, seed=5, max_tokens=24,
                                                       stop_token_ids=[demo_llm.encode(
                                                           "<|im_end|>", False)[0]]))
    assert chat.outputs[0].token_ids == gen.outputs[0].token_ids


def test_several_conversations_in_one_call(demo_llm):
    other = [{"role": "user", "content": "Another one."}]
    out = demo_llm.chat([CONVERSATION, other],
                        moeinfer.SamplingParams(temperature=0, max_tokens=8))
    assert len(out) == 2
    (alone,) = demo_llm.chat(other, moeinfer.SamplingParams(temperature=0, max_tokens=8))
    assert out[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_tools_auto_reads_the_family_format(demo_llm):
    # qwen3_moe's format is hermes; the demo model writes no <tool_call>, so none is read and
    # the content is the whole text.
    (out,) = demo_llm.chat(CONVERSATION, moeinfer.SamplingParams(temperature=0, max_tokens=16),
                           tools=[WEATHER])
    c = out.outputs[0]
    assert c.tool_calls == []
    assert c.content == c.text


def test_named_tool_choice_forces_a_call(demo_llm):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    (out,) = demo_llm.chat([{"role": "user", "content": "Weather in Paris?"}],
                           moeinfer.SamplingParams(temperature=0.8, seed=2, max_tokens=200),
                           tools=[WEATHER], tool_choice=choice)
    c = out.outputs[0]
    assert c.finish_reason == "stop", c.text
    (call,) = c.tool_calls
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    assert isinstance(arguments["city"], str)


def test_malformed_tools_are_refused(demo_llm):
    import pytest
    with pytest.raises(moeinfer.EngineError, match="tools"):
        demo_llm.chat(CONVERSATION, tools=[{"type": "function"}])
    with pytest.raises(moeinfer.EngineError, match="non-empty list"):
        demo_llm.chat([])
    with pytest.raises(moeinfer.EngineError, match="tool_choice"):
        demo_llm.chat(CONVERSATION, tools=[WEATHER],
                      tool_choice={"type": "function", "function": {"name": "nope"}})
