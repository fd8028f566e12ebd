#!/usr/bin/env python3
"""Reference renderings of published chat templates by transformers' own apply_chat_template.

tests/fixtures/templates/published/NAME.jinja is a checkpoint's chat template as its Hugging Face
repository publishes it; this script renders it on a few conversations with
PreTrainedTokenizerFast.apply_chat_template (transformers' message preprocessing, its Jinja
environment) and writes tests/fixtures/templates/published/NAME.cases.json:

    [{"messages": [...], "tools": [...] | null, "add_generation_prompt": bool,
      "kwargs": {...}, "output": "..." | "error": "..."}, ...]

Templates that print today's date (strftime_now) are rendered with the clock pinned to
PINNED_DATE; the engine's test puts its own date in that place before comparing.

  gpt_oss   openai/gpt-oss-120b's chat_template.jinja (the harmony format), 16738 bytes, sha256
            a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146 (the copy llama.cpp
            keeps as models/templates/openai-gpt-oss-120b.jinja)

Run where transformers is installed:  python3 tools/make_published_template_fixtures.py
"""
import datetime as real_datetime
import json
import os
from unittest import mock

from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast
from transformers.utils import chat_template_utils

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "fixtures", "templates", "published")
PINNED_DATE = real_datetime.datetime(2025, 8, 5, 12, 0, 0)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
        "days": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "where": {"type": "object", "properties": {"lat": {"type": "number"},
                                                   "lon": {"type": "number"}},
                  "required": ["lat"]},
        "flag": {"type": ["string", "null"]}},
        "required": ["city"]}}}
NO_ARGS = {"type": "function", "function": {"name": "now", "description": "The time."}}

CHAT = [{"role": "system", "content": "Let's sing!"},
        {"role": "user", "content": "Because maybe"},
        {"role": "assistant", "content": "You're gonna be the one that saves me"},
        {"role": "user", "content": "And after all ✋"}]
TOOLS_CHAT = [
    {"role": "developer", "content": "Answer in one line."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "thinking": "Need the tool.",
     "tool_calls": [{"type": "function", "function": {
         "name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}}]},
    {"role": "tool", "content": "{\"temp\": 21}"},
]
TOOLS_DONE = TOOLS_CHAT + [{"role": "assistant", "content": "21 °C in Zürich."},
                           {"role": "user", "content": "Thanks"}]
TRAINING = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "thinking": "Simple sum.", "content": "4"}]
BAD = [{"role": "user", "content": "Hi"},
       {"role": "assistant", "content": "<|channel|>final<|message|>Hello"}]

CASES = {
    "gpt_oss": [
        (CHAT, None, True, {}),
        (CHAT, None, False, {}),
        (CHAT[1:], None, True, {"reasoning_effort": "high"}),
        (TOOLS_CHAT, [WEATHER, NO_ARGS], True, {}),
        (TOOLS_DONE, [WEATHER], True, {"reasoning_effort": "low"}),
        (TRAINING, None, False, {"model_identity": "You are a test model."}),
        (TRAINING, None, True, {}),
        (CHAT[1:2], None, True, {"builtin_tools": ["browser", "python"]}),
        (BAD, None, True, {}),
    ],
}


def render(tokenizer, messages, tools, add_generation_prompt, kwargs):
    class PinnedClock(real_datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return PINNED_DATE

    with mock.patch.object(chat_template_utils, "datetime", PinnedClock):
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             **kwargs)


def main():
    # Any tokenizer does: the template is rendered to text, never tokenized.
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    for name, cases in CASES.items():
        with open(os.path.join(OUT, name + ".jinja"), encoding="utf-8") as f:
            tokenizer.chat_template = f.read()
        out = []
        for messages, tools, agp, kwargs in cases:
            case = {"messages": messages, "tools": tools, "add_generation_prompt": agp,
                    "kwargs": kwargs}
            try:
                case["output"] = render(tokenizer, messages, tools, agp, kwargs)
            except Exception as e:  # jinja2's TemplateError from raise_exception
                case["error"] = str(e)
            out.append(case)
        with open(os.path.join(OUT, name + ".cases.json"), "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1, ensure_ascii=False)
            f.write("\n")
        print(f"{name}: {len(out)} cases, "
              f"{sum('error' in c for c in out)} raising")


if __name__ == "__main__":
    main()
