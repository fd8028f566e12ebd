#!/usr/bin/env python3
"""End-to-end: the sampling fields of `moeinfer serve` (docs/serving.md), with the official
`openai` client on the built-in demo model. One line per check:

  logit_bias           -100 on the greedy first token changes it (and it never appears), +100
                       on a token makes every token that token, at temperature 1 too, streamed
                       and in chat; an id outside the vocabulary is a 400
  n                    n=3 with a seed gives 3 choices, choice i equal to a single request with
                       seed + i; streamed, each choice's deltas carry its index and concatenate
                       to the same texts; chat n=2 too; usage counts every choice's tokens
  best_of              best_of=3, n=1 returns the one of the 3 seeded sequences whose summed
                       token logprobs are highest; best_of < n and streamed best_of > n are 400
  abort                a streamed n=4 request whose client leaves frees every KV block
  echo                 echo + logprobs + max_tokens 0 returns the prompt and its tokens'
                       logprobs, the first null, the others equal to the log-softmax of what
                       `moeinfer logits` computes for the prompt (within 2e-3); with
                       max_tokens 3 the prompt's entries come before the completion's; vLLM's
                       prompt_logprobs extra field gives {id: {logprob, rank, decoded_token}}
  generation_config    a checkpoint folder with generation_config.json (temperature 0,
                       max_new_tokens 5): a request without those fields is greedy and at most
                       5 tokens, one that gives them overrides the temperature
  ignore_eos           chat with ignore_eos runs to max_tokens past the template's
                       end-of-sequence token, for every seed (without it some stop)
  idle                 after all of it: no running or waiting request, no used KV block

Prints one line per check and a last line "N passed, M failed"; exits non-zero on any failure.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
import tempfile
import subprocess
import urllib.request

import numpy as np
from openai import OpenAI
import openai

import e2e_util
from e2e_util import ServerProcess, parse_metrics, wait_for

PROMPT = "Q: What is the difference between a fortune cookie and a computer?\nA:"


def post(base: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as res:
        return json.loads(res.read().decode())


def metrics(base: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=60) as res:
        return parse_metrics(res.read().decode())


def idle(base: str) -> bool:
    m = metrics(base)
    return (m["moeinfer:num_requests_running"] == 0 and m["moeinfer:num_requests_waiting"] == 0
            and m["moeinfer:kv_cache_used_blocks"] == 0)


def expect_400(fn, param: str | None = None) -> None:
    try:
        fn()
    except openai.BadRequestError as e:
        if param is not None:
            assert e.body.get("param") == param, (param, e.body)
        return
    raise AssertionError("no 400")


def complete(c: OpenAI, **kw):
    args = {"model": "demo", "prompt": PROMPT, "max_tokens": 12,
            "extra_body": {"ignore_eos": True}}
    args.update(kw)
    return c.completions.create(**args)


def check_logit_bias(s: ServerProcess, c: OpenAI, ctx: dict) -> None:
    greedy = complete(c, temperature=0, logprobs=0)
    text = greedy.choices[0].text
    ids = post(s.base, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
    first = ids[0]
    assert post(s.base, "/detokenize", {"tokens": [first]})["prompt"] == \
        greedy.choices[0].logprobs.tokens[0], "the test's own token lookup disagrees"
    banned = complete(c, temperature=0, logit_bias={str(first): -100})
    assert banned.choices[0].text != text, "a -100 bias on the greedy token changed nothing"
    banned_ids = post(s.base, "/tokenize", {"prompt": banned.choices[0].text,
                                            "add_special_tokens": False})["tokens"]
    assert first not in banned_ids, (first, banned_ids)
    forced_id = 1234
    forced_text = post(s.base, "/detokenize", {"tokens": [forced_id] * 6})["prompt"]
    for temperature in (0, 1.0):
        r = complete(c, temperature=temperature, seed=3, max_tokens=6,
                     logit_bias={str(forced_id): 100})
        assert r.choices[0].text == forced_text, (temperature, r.choices[0].text, forced_text)
    streamed = "".join(ch.choices[0].text for ch in complete(
        c, temperature=1.0, seed=4, max_tokens=6, logit_bias={str(forced_id): 100}, stream=True)
        if ch.choices)
    assert streamed == forced_text, streamed
    chat = c.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}],
                                     max_tokens=6, temperature=0.8, seed=5,
                                     logit_bias={str(forced_id): 100},
                                     extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == forced_text, chat.choices[0].message.content
    expect_400(lambda: complete(c, logit_bias={"100000000": 5}), "logit_bias")
    expect_400(lambda: complete(c, extra_body={"stop_token_ids": [100000000]}), "stop_token_ids")
    expect_400(lambda: complete(c, logit_bias={"abc": 5}), "logit_bias")


def check_n(s: ServerProcess, c: OpenAI, ctx: dict) -> None:
    singles = [complete(c, temperature=1.0, seed=7 + i, max_tokens=16).choices[0].text
               for i in range(3)]
    assert len(set(singles)) > 1, "three seeds gave one text"
    r = complete(c, temperature=1.0, seed=7, max_tokens=16, n=3)
    assert [ch.index for ch in r.choices] == [0, 1, 2], r.choices
    assert [ch.text for ch in r.choices] == singles, ([ch.text for ch in r.choices], singles)
    assert r.usage.completion_tokens == 48, r.usage
    parts = {0: "", 1: "", 2: ""}
    finishes = {}
    for chunk in complete(c, temperature=1.0, seed=7, max_tokens=16, n=3, stream=True):
        for ch in chunk.choices:
            parts[ch.index] += ch.text
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert [parts[i] for i in range(3)] == singles, (parts, singles)
    assert finishes == {0: "length", 1: "length", 2: "length"}, finishes
    messages = [{"role": "user", "content": "Tell me a fortune."}]
    chat_singles = [c.chat.completions.create(model="demo", messages=messages, max_tokens=10,
                                              temperature=1.0, seed=21 + i).choices[0]
                    .message.content for i in range(2)]
    chat = c.chat.completions.create(model="demo", messages=messages, max_tokens=10,
                                     temperature=1.0, seed=21, n=2)
    assert [ch.message.content for ch in chat.choices] == chat_singles, (chat.choices,
                                                                         chat_singles)
    streamed = {0: "", 1: ""}
    for chunk in c.chat.completions.create(model="demo", messages=messages, max_tokens=10,
                                           temperature=1.0, seed=21, n=2, stream=True):
        for ch in chunk.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert [streamed[0], streamed[1]] == chat_singles, (streamed, chat_singles)


def check_best_of(s: ServerProcess, c: OpenAI, ctx: dict) -> None:
    scored = []
    for i in range(3):
        r = complete(c, temperature=1.0, seed=30 + i, max_tokens=10, logprobs=0)
        scored.append((sum(r.choices[0].logprobs.token_logprobs), r.choices[0].text))
    best = max(scored)[1]
    r = complete(c, temperature=1.0, seed=30, max_tokens=10, n=1, best_of=3)
    assert len(r.choices) == 1 and r.choices[0].text == best, (r.choices, scored)
    r = complete(c, temperature=1.0, seed=30, max_tokens=10, n=2, best_of=3)
    want = [t for _, t in sorted(scored, reverse=True)[:2]]
    assert [ch.text for ch in r.choices] == want, (r.choices, scored)
    expect_400(lambda: complete(c, n=3, best_of=2), "best_of")
    expect_400(lambda: complete(c, n=1, best_of=2, stream=True), "best_of")


def check_abort(s: ServerProcess, c: OpenAI, ctx: dict) -> None:
    stream = complete(c, temperature=1.0, max_tokens=400, n=4, stream=True)
    seen = 0
    for chunk in stream:
        seen += len(chunk.choices)
        if seen >= 6:
            break
    stream.close()
    wait_for(lambda: idle(s.base), "the aborted n=4 request to free its blocks")


def log_softmax(row: np.ndarray) -> np.ndarray:
    row = row.astype(np.float64)
    m = row.max()
    return row - m - math.log(np.exp(row - m).sum())


def check_echo(s: ServerProcess, c: OpenAI, ctx: dict) -> None:
    ids = post(s.base, "/tokenize", {"prompt": PROMPT})["tokens"]
    r = c.completions.create(model="demo", prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    ch = r.choices[0]
    assert ch.text == PROMPT, ch.text
    lp = ch.logprobs
    assert len(lp.tokens) == len(ids) == len(lp.token_logprobs), (lp.tokens, ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, lp.token_logprobs[:2]
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids), r.usage
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "logits.npy"
        run = subprocess.run([ctx["moeinfer"], "logits", "--ids", ",".join(map(str, ids)),
                              "--out", str(out)], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        logits = np.load(out)
    for j in range(1, len(ids)):
        want = log_softmax(logits[j - 1])[ids[j]]
        assert abs(lp.token_logprobs[j] - want) < 2e-3, (j, lp.token_logprobs[j], want)
        # The prompt's token always, beside the top 1 where it is not that (OpenAI's N + 1).
        assert 1 <= len(lp.top_logprobs[j]) <= 2, lp.top_logprobs[j]
        # (a token of the same text may be more likely: the entry is then that token's)
        assert lp.top_logprobs[j][lp.tokens[j]] >= lp.token_logprobs[j] - 1e-6, lp.top_logprobs[j]
    # With a completion after the prompt: the prompt's entries first.
    r = c.completions.create(model="demo", prompt=PROMPT, echo=True, logprobs=2, max_tokens=3,
                             temperature=0, extra_body={"ignore_eos": True})
    ch = r.choices[0]
    assert ch.text.startswith(PROMPT) and len(ch.text) > len(PROMPT), ch.text
    assert len(ch.logprobs.tokens) == len(ids) + 3, ch.logprobs.tokens
    assert ch.logprobs.text_offset[len(ids)] == len(PROMPT), ch.logprobs.text_offset
    assert abs(ch.logprobs.token_logprobs[1] - log_softmax(logits[0])[ids[1]]) < 2e-3
    # Streamed echo: the prompt, then the completion, with the prompt's logprobs first.
    text, tokens = "", []
    for chunk in c.completions.create(model="demo", prompt=PROMPT, echo=True, logprobs=0,
                                      max_tokens=3, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True}):
        for part in chunk.choices:
            text += part.text
            if part.logprobs:
                tokens += part.logprobs.token_logprobs
    assert text == ch.text, (text, ch.text)
    assert len(tokens) == len(ids) + 3 and tokens[0] is None, tokens
    # vLLM's prompt_logprobs extra field.
    r = c.completions.create(model="demo", prompt=PROMPT, max_tokens=1,
                             extra_body={"prompt_logprobs": 2})
    pl = r.choices[0].model_extra["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None, pl[:2]
    for j in range(1, len(ids)):
        entry = pl[j][str(ids[j])]
        assert abs(entry["logprob"] - log_softmax(logits[j - 1])[ids[j]]) < 2e-3, (j, entry)
        assert entry["rank"] >= 1 and "decoded_token" in entry
        assert 1 <= len(pl[j]) <= 3
    chat = c.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}],
                                     max_tokens=1, extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None


def check_generation_config(s: ServerProcess, c: OpenAI, ctx: dict) -> None:
    demo = pathlib.Path(ctx["fixtures"]).resolve().parent.parent / "models" / "demo"
    with tempfile.TemporaryDirectory() as tmp:
        model = pathlib.Path(tmp) / "demo"
        model.mkdir()
        for f in demo.iterdir():
            (model / f.name).symlink_to(f)
        (model / "generation_config.json").write_text(json.dumps(
            {"temperature": 0.0, "top_k": 50, "max_new_tokens": 5}))
        server = ServerProcess(ctx["moeinfer"], ["--model", str(model)])
        try:
            gc = server.client()
            greedy = complete(c, temperature=0, max_tokens=5).choices[0].text
            for _ in range(2):
                r = complete(gc, max_tokens=None, extra_body={"ignore_eos": True})
                assert r.choices[0].text == greedy, (r.choices[0].text, greedy)
                assert r.usage.completion_tokens == 5, r.usage
            r = complete(gc, max_tokens=40)
            assert r.usage.completion_tokens == 5, "max_new_tokens caps max_tokens (vLLM)"
            sampled = {complete(gc, temperature=1.0, seed=i).choices[0].text for i in range(4)}
            assert sampled != {greedy}, "an explicit temperature did not override the default"
        finally:
            code = server.stop()
        assert code == 0, code


def check_ignore_eos(s: ServerProcess, c: OpenAI, ctx: dict) -> None:
    # Chat ends at the template's end-of-sequence token (<|im_end|>), which ignore_eos ignores
    # as it ignores EOS: every seed runs to max_tokens. Without it most stop early.
    stopped = 0
    for seed in range(6):
        messages = [{"role": "user", "content": "Hi"}]
        r = c.chat.completions.create(model="demo", messages=messages, max_tokens=100,
                                      seed=seed, extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length", (seed, r.choices[0])
        assert r.usage.completion_tokens == 100, (seed, r.usage)
        r = c.chat.completions.create(model="demo", messages=messages, max_tokens=100, seed=seed)
        stopped += r.choices[0].finish_reason == "stop"
    assert stopped > 0, "no chat stopped by itself: the check shows nothing"


def check_idle(s: ServerProcess, c: OpenAI, ctx: dict) -> None:
    wait_for(lambda: idle(s.base), "an idle server")


CHECKS = [check_logit_bias, check_n, check_best_of, check_abort, check_echo,
          check_generation_config, check_ignore_eos, check_idle]


def main() -> int:
    args = e2e_util.parse_args()
    ctx = {"moeinfer": args.moeinfer, "fixtures": str(args.fixtures)}
    return e2e_util.summary(*e2e_util.serve_and_run(
        args.moeinfer, [], e2e_util.selected(CHECKS, args.only),
        lambda server, check: check(server, server.client(), ctx)))

if __name__ == "__main__":
    sys.exit(main())
