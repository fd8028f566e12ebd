#!/usr/bin/env python3
"""End-to-end: structured output (`response_format`, vLLM's `guided_json`) of `moeinfer serve`
(docs/serving.md), with the official `openai` client on the built-in demo model, every output
validated with the `jsonschema` package. One line per check:

  json_object          chat and completions, greedy and seeded at temperature 1, streamed too:
                       every text that ends with finish_reason "stop" parses as a JSON object
  json_schema          several schemas (nested objects, arrays with bounds, enum, const, anyOf,
                       $ref to $defs, integer bounds, oneOf with a discriminator, string
                       formats and patterns, number bounds): every "stop" output parses and
                       validates (formats too, with jsonschema's 2020-12 format checker); with n=4
                       each choice does
  guided_json          vLLM's extra field (an object, or its JSON text) constrains the same way
  length               a small max_tokens cuts the value: finish_reason "length", and the text is
                       a prefix the schema still allows (not necessarily complete)
  refusals             unsupported keywords and pattern constructs (backreferences, lookahead,
                       ...), bounds no number meets, a bad type, a schema that is not an
                       object, both fields at once: 400 naming the field; an unknown format is
                       an annotation (200)
  idle                 after all of it: no running or waiting request, no used KV block

Prints one line per check and a last line "N passed, M failed"; exits non-zero on any failure.
"""

from __future__ import annotations

import json
import sys
import urllib.request

import jsonschema
import openai
from openai import OpenAI

import e2e_util
from e2e_util import ServerProcess, parse_metrics, wait_for

PROMPT = "Q: Describe a fortune cookie as JSON.\nA:"
MAX_TOKENS = 200

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad", "wise"]},
        "lucky": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 99},
                  "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "mood", "lucky"],
    "additionalProperties": False,
}
SCHEMAS = {
    "person": PERSON,
    "nested": {
        "type": "object",
        "properties": {
            "fortune": {"type": "object",
                        "properties": {"text": {"type": "string", "maxLength": 16},
                                       "stars": {"type": "integer", "minimum": 1, "maximum": 5}},
                        "required": ["text", "stars"], "additionalProperties": False},
            "kind": {"const": "cookie"},
            "extra": {"anyOf": [{"type": "null"}, {"type": "boolean"},
                                {"type": "string", "maxLength": 4}]},
        },
        "required": ["fortune", "kind", "extra"],
        "additionalProperties": False,
    },
    "defs": {
        "type": "array",
        "items": {"$ref": "#/$defs/item"},
        "minItems": 1,
        "maxItems": 3,
        "$defs": {"item": {"type": "object",
                           "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "ok": {"type": "boolean"}},
                           "required": ["id", "ok"], "additionalProperties": False}},
    },
    "one_of": {
        "oneOf": [
            {"type": "object", "properties": {"kind": {"const": "num"},
                                              "value": {"type": "number"}},
             "required": ["kind", "value"], "additionalProperties": False},
            {"type": "object", "properties": {"kind": {"const": "word"},
                                              "value": {"type": "string", "maxLength": 8}},
             "required": ["kind", "value"], "additionalProperties": False},
        ]
    },
    "enum_only": {"enum": ["yes", "no", 42, None, {"a": [1, 2]}]},
    "formats": {
        "type": "object",
        "properties": {
            "day": {"type": "string", "format": "date"},
            "id": {"type": "string", "format": "uuid"},
            "ip": {"type": "string", "format": "ipv4"},
            "at": {"type": "string", "format": "time"},
        },
        "required": ["day", "id", "ip", "at"],
        "additionalProperties": False,
    },
    "patterns": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"},
            "word": {"type": "string", "pattern": "^(yes|no|maybe)!*$", "maxLength": 7},
            "mail": {"type": "string", "format": "email", "maxLength": 16},
            "host": {"type": "string", "format": "hostname", "maxLength": 12},
        },
        "required": ["code", "word", "mail", "host"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "price": {"type": "number", "minimum": 0.5, "exclusiveMaximum": 100},
            "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            "cold": {"type": "number", "minimum": -40.5, "maximum": -10.25},
            "count": {"type": "integer", "exclusiveMinimum": 3, "maximum": 7},
        },
        "required": ["price", "ratio", "cold", "count"],
        "additionalProperties": False,
    },
}
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER  # the time format of RFC 3339


def idle(base: str) -> bool:
    with urllib.request.urlopen(base + "/metrics", timeout=60) as res:
        m = parse_metrics(res.read().decode())
    return (m["moeinfer:num_requests_running"] == 0 and m["moeinfer:num_requests_waiting"] == 0
            and m["moeinfer:kv_cache_used_blocks"] == 0)


def json_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def check_output(text: str, finish: str, schema: dict | None, stats: dict) -> None:
    """A "stop" output parses and validates; a "length" one is only counted."""
    assert finish in ("stop", "length"), finish
    stats[finish] = stats.get(finish, 0) + 1
    if finish != "stop":
        return
    value = json.loads(text)
    if schema is None:
        assert isinstance(value, dict), text
    else:
        jsonschema.validate(value, schema, format_checker=FORMATS)


def chat(c: OpenAI, model: str, **kw):
    if "max_completion_tokens" not in kw:
        kw.setdefault("max_tokens", MAX_TOKENS)
    return c.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                     **kw)


def streamed_text(stream) -> tuple[str, str]:
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                text += choice.delta.content
            if choice.finish_reason:
                finish = choice.finish_reason
    return text, finish


def check_json_object(s: ServerProcess, c: OpenAI, ctx: dict) -> None:
    model = ctx["model"]
    fmt = {"type": "json_object"}
    stats: dict = {}
    r = chat(c, model, response_format=fmt, temperature=0)
    check_output(r.choices[0].message.content, r.choices[0].finish_reason, None, stats)
    for seed in range(6):
        r = chat(c, model, response_format=fmt, temperature=1.0, seed=seed)
        check_output(r.choices[0].message.content, r.choices[0].finish_reason, None, stats)
        r = c.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                 temperature=1.0, seed=seed, extra_body={"response_format": fmt})
        check_output(r.choices[0].text, r.choices[0].finish_reason, None, stats)
    text, finish = streamed_text(chat(c, model, response_format=fmt, temperature=1.0, seed=3,
                                      stream=True))
    check_output(text, finish, None, stats)
    assert stats.get("stop", 0) >= 8, stats
    print(f"  json_object: {stats}")


def check_json_schema(s: ServerProcess, c: OpenAI, ctx: dict) -> None:
    model = ctx["model"]
    for name, schema in SCHEMAS.items():
        stats: dict = {}
        fmt = json_format(name, schema)
        r = chat(c, model, response_format=fmt, temperature=0)
        check_output(r.choices[0].message.content, r.choices[0].finish_reason, schema, stats)
        for seed in range(4):
            r = chat(c, model, response_format=fmt, temperature=1.0, seed=seed)
            check_output(r.choices[0].message.content, r.choices[0].finish_reason, schema, stats)
        r = c.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, n=4,
                                 temperature=1.0, seed=11, extra_body={"response_format": fmt})
        assert len(r.choices) == 4
        for choice in r.choices:
            check_output(choice.text, choice.finish_reason, schema, stats)
        text, finish = streamed_text(chat(c, model, response_format=fmt, temperature=1.0, seed=5,
                                          stream=True))
        check_output(text, finish, schema, stats)
        assert stats.get("stop", 0) >= 6, (name, stats)
        print(f"  {name}: {stats}")


def check_guided_json(s: ServerProcess, c: OpenAI, ctx: dict) -> None:
    model = ctx["model"]
    stats: dict = {}
    for guided in (PERSON, json.dumps(PERSON)):
        for seed in range(3):
            r = c.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                     temperature=1.0, seed=seed, extra_body={"guided_json": guided})
            check_output(r.choices[0].text, r.choices[0].finish_reason, PERSON, stats)
    assert stats.get("stop", 0) >= 4, stats


def check_length(s: ServerProcess, c: OpenAI, ctx: dict) -> None:
    model = ctx["model"]
    for name in ("person", "nested"):
        schema = SCHEMAS[name]
        r = chat(c, model, response_format=json_format(name, schema), temperature=0,
                 max_completion_tokens=4)
        choice = r.choices[0]
        assert choice.finish_reason == "length", choice
        assert r.usage.completion_tokens == 4, r.usage
        text = choice.message.content
        assert not text.strip() or text.lstrip().startswith("{"), text
        try:  # incomplete, as vLLM returns it
            json.loads(text)
            raise AssertionError(f"four tokens made a whole value: {text!r}")
        except json.JSONDecodeError:
            pass


def expect_400(call, param: str, word: str | None = None) -> None:
    try:
        call()
    except openai.BadRequestError as e:
        assert e.body.get("param") == param, (param, e.body)
        if word is not None:
            assert word in e.body.get("message", ""), (word, e.body)
        return
    raise AssertionError(f"no 400 for {param}")


def check_refusals(s: ServerProcess, c: OpenAI, ctx: dict) -> None:
    model = ctx["model"]
    schema_param = "response_format.json_schema.schema"
    for schema, word in (({"type": "string", "pattern": "(a)\\1"}, "backreferences"),
                         ({"type": "string", "pattern": "a(?=b)"}, "lookahead"),
                         ({"type": "string", "pattern": "a^b"}, "'^'"),
                         ({"type": "number", "minimum": 5, "maximum": 1}, "no number between"),
                         ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
                         ({"not": {"type": "null"}}, "not"),
                         ({"oneOf": [{"type": "string"}, {"type": "string"}]}, "oneOf")):
        expect_400(lambda: chat(c, model, response_format=json_format("x", schema)),
                   schema_param, word)
    expect_400(lambda: chat(c, model, response_format={"type": "yaml"}), "response_format.type")
    expect_400(lambda: chat(c, model, response_format={"type": "json_schema",
                                                       "json_schema": {"name": "x",
                                                                       "schema": [1]}}),
               schema_param)
    expect_400(lambda: chat(c, model, response_format={"type": "json_schema"}),
               "response_format.json_schema")
    expect_400(lambda: c.completions.create(
        model=model, prompt=PROMPT, max_tokens=4,
        extra_body={"response_format": {"type": "json_object"}, "guided_json": PERSON}),
        "guided_json")
    expect_400(lambda: c.completions.create(model=model, prompt=PROMPT, max_tokens=4,
                                            extra_body={"guided_json": "{not json"}),
               "guided_json")
    # An unknown format is an annotation (JSON Schema 2020-12, vLLM's xgrammar): a plain string.
    r = chat(c, model, response_format=json_format("x", {"type": "string", "format": "color"}),
             temperature=0, max_tokens=MAX_TOKENS)
    check_output(r.choices[0].message.content, r.choices[0].finish_reason,
                 {"type": "string"}, {})
    # {"type": "text"} is no constraint at all.
    r = chat(c, model, response_format={"type": "text"}, temperature=0, max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")


def check_idle(s: ServerProcess, c: OpenAI, ctx: dict) -> None:
    wait_for(lambda: idle(s.base), "an idle server")


CHECKS = [check_json_object, check_json_schema, check_guided_json, check_length, check_refusals,
          check_idle]


def main() -> int:
    args = e2e_util.parse_args()
    ctx: dict = {}

    def run(server: ServerProcess, check) -> None:
        client = server.client()
        if "model" not in ctx:
            ctx["model"] = client.models.list().data[0].id
        check(server, client, ctx)

    return e2e_util.summary(*e2e_util.serve_and_run(
        args.moeinfer, [], e2e_util.selected(CHECKS, args.only), run))

if __name__ == "__main__":
    sys.exit(main())
