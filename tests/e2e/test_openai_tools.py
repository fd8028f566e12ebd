#!/usr/bin/env python3
"""End-to-end: tools and chat_template_kwargs of `moeinfer serve` (docs/serving.md, "Tools"),
with the official `openai` client. One line per check:

  rendered        a checkpoint folder with the demo model's weights and a Qwen3-style chat
                  template that shows tools (tests/fixtures/templates/chat_qwen3_style.jinja):
                  /tokenize of a conversation with tools, an earlier tool call, its result and
                  chat_template_kwargs {"enable_thinking": false} gives exactly the tokens of
                  jinja2's rendering (as transformers renders it) of the context vLLM builds:
                  tools as its request model dumps them, the call's arguments parsed to a dict
  no_parser       that server started with --tool-call-parser none: tools with tool_choice
                  "auto" are a 400 naming tool_choice, "none" is answered
  response        the demo model (hermes parser by family) with tools: greedy text, the same
                  as without tools (its template ignores them), comes back as content with no
                  tool_calls and finish_reason stop/length; tool_choice "none" the same
  stream          the same request streamed: the client's chunks parse, the content deltas
                  concatenate to the non-streamed content, no tool-call markup, one role chunk
  conversation    a conversation with an assistant tool_calls message and a tool result
                  (arguments as a JSON string, as the client sends them) is answered
  forced          tool_choice "required" and a named function (constrained decoding): greedy
                  and sampled (n=3), streamed and not, every choice has tool_calls whose
                  arguments parse and validate (jsonschema) against the tool's parameters
                  (a sampled choice may instead end at max_tokens with its text as content),
                  content null, finish_reason tool_calls ("required") or stop (named); the
                  greedy stream's calls equal the non-streamed ones
  forced_no_parser  the same on the server started with --tool-call-parser none
  refusals        a forced tool_choice with a JSON response_format, tools whose parameters use
                  a keyword the grammar cannot follow (named in the message), tool_choice
                  without tools, a malformed tool, chat_template_kwargs that is not an object,
                  tool_calls with invalid arguments: each a 400 naming its field

What e2e does not cover: the demo model never writes a tool call unforced, so the parsers and
the tool-call responses and stream deltas of "auto" are covered by
tests/server/tool_calls_test.cpp (every format, every split of a stream, ChoiceSet's responses
and chunks).

Prints one line per check and a last line "N passed, M failed"; exits non-zero on any failure.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile
import urllib.error
import urllib.request

import jsonschema
import openai
from openai import OpenAI

import e2e_util
from e2e_util import ServerProcess

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent / "tools"))
from make_template_fixtures import make_environment, render  # noqa: E402

DEMO = HERE.parent.parent / "models" / "demo"

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather at a place — in °C",
        "parameters": {"type": "object", "properties": {"zip": {"type": "string"},
                                                         "city": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "now"}},
]
# vLLM's ChatCompletionToolsParam.model_dump(): description and parameters null when absent.
TOOLS_DUMPED = [
    TOOLS[0],
    {"type": "function", "function": {"name": "now", "description": None, "parameters": None}},
]

CONVERSATION = [
    {"role": "system", "content": "You answer with fortunes."},
    {"role": "user", "content": "What is the weather in Zürich?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Zürich", "zip": "8001"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"},
    {"role": "user", "content": "Tell me a fortune about it."},
]


def post(base: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as res:
            return res.status, json.loads(res.read().decode())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def expect_400(param: str, fn) -> None:
    try:
        fn()
    except openai.BadRequestError as e:
        assert e.status_code == 400, e.status_code
        assert e.body.get("param") == param, (param, e.body)
        return
    raise AssertionError(f"no 400 for {param}")


def tool_model_dir(root: pathlib.Path) -> pathlib.Path:
    """The demo model's weights and tokenizer under a chat template that shows tools."""
    model = root / "tools-model"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        os.symlink(DEMO / name, model / name)
    config = json.loads((DEMO / "tokenizer_config.json").read_text())
    config["chat_template"] = (HERE.parent / "fixtures" / "templates" /
                               "chat_qwen3_style.jinja").read_text()
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model


def check_rendered(s: ServerProcess, c: OpenAI, ctx: dict) -> None:
    kwargs = {"enable_thinking": False}
    status, t = post(s.base, "/tokenize", {"messages": CONVERSATION, "tools": TOOLS,
                                           "chat_template_kwargs": kwargs})
    assert status == 200, t
    # The context vLLM gives the template: messages with null keys dropped (transformers) and the
    # call's arguments parsed (vLLM's _postprocess_messages), tools as dumped, then the kwargs.
    messages = []
    for m in CONVERSATION:
        m = {k: v for k, v in m.items() if v is not None}
        if "tool_calls" in m:
            m["tool_calls"] = [dict(call, function=dict(call["function"], arguments=json.loads(
                call["function"]["arguments"]))) for call in m["tool_calls"]]
        m.setdefault("content", "")
        messages.append(m)
    config = json.loads((DEMO / "tokenizer_config.json").read_text())
    context = {"messages": messages, "tools": TOOLS_DUMPED, "documents": None,
               "add_generation_prompt": True, "bos_token": config.get("bos_token", ""),
               "eos_token": config.get("eos_token", ""), **kwargs}
    source = (HERE.parent / "fixtures" / "templates" / "chat_qwen3_style.jinja").read_text()
    rendered = render(make_environment(), source, context)
    assert "output" in rendered, rendered
    expected = rendered["output"]
    assert "<tools>" in expected and '"name": "get_weather", "description": "Weather' in expected
    assert '{"name": "get_weather", "arguments": {"city": "Zürich", "zip": "8001"}}' in expected
    assert expected.endswith("<think>\n\n</think>\n\n"), expected[-80:]
    status, ref = post(s.base, "/tokenize", {"prompt": expected, "add_special_tokens": False})
    assert status == 200, ref
    if t["tokens"] != ref["tokens"]:
        _, got = post(s.base, "/detokenize", {"tokens": t["tokens"]})
        raise AssertionError(f"rendered prompt differs from jinja2's:\n{got['prompt']!r}\n"
                             f"{expected!r}")
    # Without the kwargs the thinking block is not closed for the model.
    status, plain = post(s.base, "/tokenize", {"messages": CONVERSATION, "tools": TOOLS})
    assert status == 200 and plain["tokens"] != t["tokens"], plain
    status, e = post(s.base, "/tokenize", {"messages": CONVERSATION, "chat_template_kwargs": 3})
    assert status == 400 and e["error"]["param"] == "chat_template_kwargs", e


def check_no_parser(s: ServerProcess, c: OpenAI, ctx: dict) -> None:
    user = [{"role": "user", "content": "Tell me a fortune."}]
    expect_400("tool_choice", lambda: c.chat.completions.create(
        model=c.models.list().data[0].id, messages=user, tools=TOOLS, max_tokens=4))
    r = c.chat.completions.create(model=c.models.list().data[0].id, messages=user, tools=TOOLS,
                                  tool_choice="none", max_tokens=4, temperature=0)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls, r


USER = [{"role": "user", "content": "Tell me a fortune."}]


def check_response(s: ServerProcess, c: OpenAI, ctx: dict) -> None:
    base = c.chat.completions.create(model="demo", messages=USER, max_tokens=24, temperature=0)
    r = c.chat.completions.create(model="demo", messages=USER, tools=TOOLS, max_tokens=24,
                                  temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == base.choices[0].message.content, (choice, base)
    assert not choice.message.tool_calls, choice.message
    assert choice.finish_reason in ("stop", "length"), choice.finish_reason
    none = c.chat.completions.create(model="demo", messages=USER, tools=TOOLS, tool_choice="none",
                                     max_tokens=24, temperature=0)
    assert none.choices[0].message.content == choice.message.content, none
    ctx["content"] = choice.message.content


def check_stream(s: ServerProcess, c: OpenAI, ctx: dict) -> None:
    stream = c.chat.completions.create(model="demo", messages=USER, tools=TOOLS, max_tokens=24,
                                       temperature=0, stream=True)
    content, roles, finish = "", 0, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            roles += delta.role == "assistant"
            assert not delta.tool_calls, delta
            content += delta.content or ""
            finish = choice.finish_reason or finish
    assert roles == 1, roles
    assert content == ctx["content"], (content, ctx["content"])
    assert "<tool_call" not in content
    assert finish in ("stop", "length"), finish


def check_conversation(s: ServerProcess, c: OpenAI, ctx: dict) -> None:
    r = c.chat.completions.create(model="demo", messages=CONVERSATION, tools=TOOLS, max_tokens=8,
                                  temperature=0)
    assert r.choices[0].message.content is not None, r
    status, t = post(s.base, "/tokenize", {"messages": CONVERSATION, "tools": TOOLS})
    assert status == 200 and t["count"] == r.usage.prompt_tokens, (t, r.usage)


NAMED = {"type": "function", "function": {"name": "get_weather"}}
# What the arguments of each tool must validate against: its parameters, or for a tool without
# them an object of no properties (the schema vLLM forces for it).
PARAMETERS = {t["function"]["name"]: t["function"].get("parameters") or
              {"type": "object", "properties": {}, "additionalProperties": False} for t in TOOLS}
FORCED_MAX_TOKENS = 200


def forced_calls(c: OpenAI, tool_choice, stream: bool, **kwargs) -> list[tuple[list, str]]:
    """(calls as (name, arguments), finish_reason) per choice; streamed: the deltas gathered."""
    r = c.chat.completions.create(model=c.models.list().data[0].id, messages=USER, tools=TOOLS,
                                  tool_choice=tool_choice, max_tokens=FORCED_MAX_TOKENS,
                                  stream=stream, **kwargs)
    if not stream:
        out = []
        for choice in r.choices:
            # Cut off by max_tokens before the JSON closes: no call, the text as content.
            if choice.finish_reason == "length" and not choice.message.tool_calls:
                out.append(([], "length"))
                continue
            assert choice.message.content is None, choice.message
            out.append(([(t.function.name, t.function.arguments, t.id, t.type)
                         for t in choice.message.tool_calls or []], choice.finish_reason))
        return out
    calls: dict = {}
    finish: dict = {}
    for chunk in r:
        for choice in chunk.choices:
            # No JSON in delta.content, but for an output cut off before it closes.
            assert not choice.delta.content or choice.finish_reason == "length", choice.delta
            for t in choice.delta.tool_calls or []:
                assert (choice.index, t.index) not in calls, t  # each call in one piece
                calls[(choice.index, t.index)] = (t.function.name, t.function.arguments, t.id,
                                                  t.type)
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return [([calls[k] for k in sorted(calls) if k[0] == i], finish[i]) for i in sorted(finish)]


def validate_calls(choices: list, named: str | None, cut_off_ok: bool = False) -> int:
    """The number of calls validated; every choice must have some unless cut_off_ok (sampled
    outputs may meet max_tokens before the JSON closes; at least one must still call)."""
    num = 0
    for calls, finish in choices:
        if cut_off_ok and finish == "length" and not calls:
            continue
        assert calls, (calls, finish)
        assert finish == ("stop" if named else "tool_calls"), finish
        for name, arguments, call_id, call_type in calls:
            assert call_type == "function" and call_id.startswith("chatcmpl-tool-"), call_id
            assert name in PARAMETERS and (named is None or name == named), name
            jsonschema.validate(json.loads(arguments), PARAMETERS[name])
            num += 1
    assert num > 0, choices
    return num


def check_forced(s: ServerProcess, c: OpenAI, ctx: dict) -> None:
    """tool_choice "required" and a named function, constrained: greedy and sampled (n=3),
    streamed and not; every call's arguments parse and validate against its tool's schema."""
    for tool_choice, named in (("required", None), (NAMED, "get_weather")):
        greedy = forced_calls(c, tool_choice, False, temperature=0)
        validate_calls(greedy, named)
        streamed = forced_calls(c, tool_choice, True, temperature=0)
        validate_calls(streamed, named)
        # Greedy: the stream carries the same calls (ids aside).
        assert [[t[:2] for t in calls] for calls, _ in streamed] == \
            [[t[:2] for t in calls] for calls, _ in greedy], (streamed, greedy)
        for stream in (False, True):
            sampled = forced_calls(c, tool_choice, stream, n=3, temperature=0.7, seed=7)
            assert len(sampled) == 3, sampled
            validate_calls(sampled, named, cut_off_ok=True)


def check_forced_no_parser(s: ServerProcess, c: OpenAI, ctx: dict) -> None:
    """Forced calls need no parser: the server without one answers them."""
    validate_calls(forced_calls(c, "required", False, temperature=0), None)
    validate_calls(forced_calls(c, NAMED, True, temperature=0), "get_weather")


def check_refusals(s: ServerProcess, c: OpenAI, ctx: dict) -> None:
    make = c.chat.completions.create
    # A forced call is one constraint; a JSON response_format would be a second.
    for tool_choice in ("required", NAMED):
        expect_400("tool_choice", lambda: make(
            model="demo", messages=USER, tools=TOOLS, tool_choice=tool_choice, max_tokens=4,
            response_format={"type": "json_object"}))
    # Parameters the grammar cannot follow are named in the refusal.
    refused_tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "(a)\\1"}}}}}]
    try:
        make(model="demo", messages=USER, tools=refused_tools, tool_choice="required",
             max_tokens=4)
        raise AssertionError("no 400 for a backreference in a pattern")
    except openai.BadRequestError as e:
        assert e.body.get("param") == "tool_choice" and "backreferences" in e.body["message"], \
            e.body
    expect_400("tool_choice", lambda: make(model="demo", messages=USER, tool_choice="auto",
                                           max_tokens=4))
    expect_400("tools[0].function.name", lambda: make(
        model="demo", messages=USER, tools=[{"type": "function", "function": {"name": 5}}],
        max_tokens=4))
    expect_400("chat_template_kwargs", lambda: make(
        model="demo", messages=USER, max_tokens=4, extra_body={"chat_template_kwargs": [1]}))
    bad_call = [dict(CONVERSATION[2], tool_calls=[{"id": "x", "type": "function", "function": {
        "name": "get_weather", "arguments": "{not json"}}])]
    expect_400("messages[1].tool_calls[0].function.arguments", lambda: make(
        model="demo", messages=USER + bad_call, max_tokens=4))


CHECKS = [check_response, check_stream, check_conversation, check_forced, check_refusals]
TOOL_SERVER_CHECKS = [check_rendered, check_no_parser, check_forced_no_parser]


def main() -> int:
    args = e2e_util.parse_args()
    ctx: dict = {}
    passed = failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for flags, checks in (([], CHECKS),
                              ([str(tool_model_dir(pathlib.Path(tmp))), "--tool-call-parser",
                                "none"], TOOL_SERVER_CHECKS)):
            p, f = e2e_util.serve_and_run(args.moeinfer, flags,
                                          e2e_util.selected(checks, args.only),
                                          lambda server, check: check(server, server.client(), ctx))
            passed += p
            failed += f
    return e2e_util.summary(passed, failed)

if __name__ == "__main__":
    sys.exit(main())
