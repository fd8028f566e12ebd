#!/usr/bin/env python3
"""Byte-for-byte parity of `moeinfer template` with Python jinja2, on every fixture template.

Each template under FIXTURES/templates is rendered by live jinja2 (configured as transformers
configures it) and by `moeinfer template --template T --context C`, on the stored contexts and on
randomly generated conversations (random role order, unicode, tool calls, empty or missing
content, with or without a system message, with or without tools). Outputs must be identical;
when jinja2 raises, moeinfer must exit non-zero. The chat_* templates are also rendered through a
throw-away checkpoint folder (`moeinfer template --model DIR --messages M`) and compared with
transformers' apply_chat_template preprocessing done here in Python. Last, randomly generated
templates (whitespace control around nested tags; assignments, loops, macros and blocks that test
jinja2's scoping) are compared the same way.

Usage: test_chat_template_diff.py --moeinfer BIN --fixtures DIR [--random N] [--random-templates N]
                                  [--seed S]
Exit status is non-zero on any mismatch; the last line reads "N passed, M failed".
"""

import argparse
import glob
import json
import os
import random
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools"))
from make_template_fixtures import make_environment, render  # noqa: E402

WORDS = ["hello", "world", "Zürich", "naïve", "東京", "данные", "🎉", "👩‍💻", "ça va", "مرحبا",
         "it's", 'say "hi"', "back\\slash", "tab\there", "a\nb", "  padded  ", "<|im_end|>",
         "{{ not a tag }}", "{% raw %}", "100%", "x=1; y=2", "\u00a0nbsp", "", "\n"]
ROLES = ["user", "assistant", "system", "tool"]


def random_text(rng, allow_think=False):
    n = rng.randint(0, 6)
    text = " ".join(rng.choice(WORDS) for _ in range(n))
    if allow_think and rng.random() < 0.3:
        text = "<think>\n" + random_text(rng) + "\n</think>\n\n" + text
    if rng.random() < 0.2:
        text = rng.choice(["\n", "  ", "\n\n"]) + text + rng.choice(["\n", "  ", ""])
    return text


def random_tool_call(rng):
    args = {"city": rng.choice(["Paris", "東京", "São Paulo"]), "days": rng.randint(1, 9)}
    if rng.random() < 0.3:
        args["options"] = {"metric": rng.random() < 0.5, "ratio": rng.choice([0.5, 1.0, 2.25e-5])}
    return {"id": "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(rng.choice([9, 9, 9, 8]))),
            "type": "function",
            "function": {"name": rng.choice(["get_weather", "search", "lookup_ünï"]),
                         "arguments": args if rng.random() < 0.6 else json.dumps(args, ensure_ascii=False)}}


def random_message(rng, role):
    m = {"role": role}
    r = rng.random()
    if r < 0.08:
        m["content"] = None
    elif r < 0.14:
        pass  # no content key at all
    elif r < 0.2:
        m["content"] = ""
    else:
        m["content"] = random_text(rng, allow_think=role == "assistant")
    if role == "assistant":
        if rng.random() < 0.25:
            m["tool_calls"] = [random_tool_call(rng) for _ in range(rng.randint(1, 2))]
        if rng.random() < 0.15:
            m["reasoning_content"] = random_text(rng)
    if role == "tool" and rng.random() < 0.8:
        m["tool_call_id"] = random_tool_call(rng)["id"]
    return m


def random_conversation(rng):
    messages = []
    if rng.random() < 0.5:
        messages.append(random_message(rng, "system"))
    n = rng.randint(1, 6)
    alternate = rng.random() < 0.6
    for i in range(n):
        if alternate:
            role = "user" if i % 2 == 0 else "assistant"
            if role == "user" and i > 0 and rng.random() < 0.15:
                role = "tool"
        else:
            role = rng.choice(ROLES)
        messages.append(random_message(rng, role))
    return messages


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather — °C",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search",
                                      "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
                                      "return": {"type": "string"}}},
]


def random_context(rng):
    ctx = {"messages": random_conversation(rng), "add_generation_prompt": rng.random() < 0.5,
           "bos_token": rng.choice(["<s>", "<|begin_of_text|>", ""]), "eos_token": "</s>"}
    r = rng.random()
    if r < 0.3:
        ctx["tools"] = TOOLS[: rng.randint(1, 2)]
    elif r < 0.6:
        ctx["tools"] = None
    if rng.random() < 0.3:
        ctx["date_string"] = "05 Mar 2025"
    if rng.random() < 0.2:
        ctx["enable_thinking"] = rng.random() < 0.5
    return ctx


def random_whitespace_template(rng):
    """Text with spaces, tabs and newlines around tags carrying random -/+ markers."""
    pieces = [" ", "  ", "\t", "\n", "\n\n", "a", "b c", " x \n", "\n  ", "  \n", "\r\n", "}", "{", "-"]

    def mark(plus=True):
        return rng.choice(["", "", "-", "+"] if plus else ["", "", "-"])

    def text():
        return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 4)))

    def block(depth):
        out = []
        for _ in range(rng.randint(1, 4)):
            out.append(text())
            r = rng.random()
            if r < 0.25 and depth < 3:
                out.append("{%" + mark() + " if c " + mark() + "%}" + block(depth + 1))
                if rng.random() < 0.5:
                    out.append("{%" + mark() + " else " + mark() + "%}" + block(depth + 1))
                out.append("{%" + mark() + " endif " + mark() + "%}")
            elif r < 0.4 and depth < 3:
                out.append("{%" + mark() + " for i in [1, 2] " + mark() + "%}" + block(depth + 1)
                           + "{%" + mark() + " endfor " + mark() + "%}")
            elif r < 0.55:
                out.append("{{" + mark(False) + " v " + mark(False) + "}}")
            elif r < 0.7:
                out.append("{#" + mark() + " note " + mark() + "#}")
            elif r < 0.8:
                out.append("{%" + mark() + " set s = 1 " + mark() + "%}")
            elif r < 0.85:
                out.append("{%" + mark() + " raw " + mark(False) + "%} r {{ x }} {%" + mark() + " endraw "
                           + mark() + "%}")
        out.append(text())
        return "".join(out)

    return block(0), {"c": rng.random() < 0.5, "v": "V"}


def random_scoping_template(rng):
    """Assignments, loops, macros, namespaces and block sets nested at random."""
    names = ["a", "b", "c"]
    values = ["1", "'s'", "a", "b ~ 'x'", "ns.n + 1", "loop.index if loop is defined else 0", "[a, b]",
              "c | default(5)", "m(a)"]

    def stmts(depth):
        out = []
        for _ in range(rng.randint(1, 4)):
            r = rng.random()
            if r < 0.25:
                out.append("{% set " + rng.choice(names) + " = " + rng.choice(values) + " %}")
            elif r < 0.4:
                out.append("[{{ " + rng.choice(names + ["ns.n", "loop.index0 if loop is defined else '-'"]) + " }}]")
            elif r < 0.5:
                out.append("{% set ns.n = " + rng.choice(values) + " %}")
            elif r < 0.62 and depth < 3:
                out.append("{% for i in range(" + str(rng.randint(0, 3)) + ") %}" + stmts(depth + 1)
                           + ("{% else %}E" if rng.random() < 0.3 else "") + "{% endfor %}")
            elif r < 0.75 and depth < 3:
                out.append("{% if " + rng.choice(["a", "b == 1", "c is defined", "not a"]) + " %}" + stmts(depth + 1)
                           + "{% else %}" + stmts(depth + 1) + "{% endif %}")
            elif r < 0.82 and depth < 3:
                out.append("{% macro m(x, y=a) %}<{{ x }}{{ y }}" + stmts(depth + 1) + ">{% endmacro %}")
            elif r < 0.88:
                out.append("{{ m(" + rng.choice(values) + ") }}")
            elif r < 0.93 and depth < 3:
                out.append("{% set c %}" + stmts(depth + 1) + "{% endset %}")
            elif r < 0.97 and depth > 0:
                out.append("{% if b %}{% break %}{% endif %}")
            else:
                out.append("{% set a, b = b, a %}")
        return "".join(out)

    source = "{% set ns = namespace(n=0) %}{% macro m(x) %}({{ x }}){% endmacro %}" + stmts(0)
    return source, {"a": rng.choice([0, 1, "q"]), "b": rng.choice([1, None, ""])}


def transformers_view(messages):
    """What transformers hands the template: None-valued keys dropped, reasoning aliased."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class Runner:
    def __init__(self, binary, workdir):
        self.binary = binary
        self.workdir = workdir
        self.passed = 0
        self.failed = 0

    def run(self, args):
        p = subprocess.run([self.binary, "template", *args], capture_output=True, timeout=60)
        return p.returncode, p.stdout.decode("utf-8", errors="replace"), p.stderr.decode("utf-8", errors="replace")

    def check(self, label, expected, rc, out, err, context):
        if "error" in expected:
            ok = rc != 0
            detail = f"jinja2 raised {expected['error_type']}: {expected['error']!r}; moeinfer exited 0 with {out[:300]!r}"
        else:
            ok = rc == 0 and out == expected["output"]
            if rc != 0:
                detail = f"moeinfer failed: {err.strip()[:500]}"
            else:
                detail = first_difference(expected["output"], out)
        if ok:
            self.passed += 1
            return
        self.failed += 1
        if self.failed <= 20:
            print(f"FAIL {label}: {detail}")
            print(f"  context: {json.dumps(context, ensure_ascii=False)[:600]}")


def first_difference(want, got):
    i = 0
    while i < min(len(want), len(got)) and want[i] == got[i]:
        i += 1
    return (f"outputs differ at char {i}: jinja2 {want[max(0, i - 40):i + 40]!r} vs "
            f"moeinfer {got[max(0, i - 40):i + 40]!r}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moeinfer", required=True)
    ap.add_argument("--fixtures", required=True)
    ap.add_argument("--random", type=int, default=12, help="random conversations per template")
    ap.add_argument("--random-templates", type=int, default=150,
                    help="random whitespace and scoping templates, of each kind")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    env = make_environment()
    templates = sorted(glob.glob(os.path.join(args.fixtures, "templates", "*.jinja")))
    if not templates:
        print(f"no templates under {args.fixtures}/templates")
        print("0 passed, 1 failed")
        return 1
    with tempfile.TemporaryDirectory() as work:
        runner = Runner(args.moeinfer, work)
        tmpl_path = os.path.join(work, "t.jinja")
        ctx_path = os.path.join(work, "c.json")
        for path in templates:
            name = os.path.basename(path)[: -len(".jinja")]
            with open(path, encoding="utf-8", newline="") as f:
                source = f.read()
            cases_path = path[: -len(".jinja")] + ".cases.json"
            contexts = []
            if os.path.exists(cases_path):
                with open(cases_path, encoding="utf-8") as f:
                    contexts = [c["context"] for c in json.load(f)]
            contexts += [random_context(rng) for _ in range(args.random)]
            with open(tmpl_path, "w", encoding="utf-8", newline="") as f:
                f.write(source)
            for i, ctx in enumerate(contexts):
                expected = render(env, source, ctx)
                with open(ctx_path, "w", encoding="utf-8") as f:
                    json.dump(ctx, f, ensure_ascii=False)
                rc, out, err = runner.run(["--template", tmpl_path, "--context", ctx_path])
                runner.check(f"{name}[{i}]", expected, rc, out, err, ctx)

            if not name.startswith("chat_"):
                continue
            # The same template read from a checkpoint folder, on raw messages.
            model_dir = os.path.join(work, "model")
            os.makedirs(model_dir, exist_ok=True)
            bos = {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False,
                   "rstrip": False, "single_word": False}
            with open(os.path.join(model_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
                json.dump({"bos_token": bos, "eos_token": "</s>", "chat_template": source}, f, ensure_ascii=False)
            msg_path = os.path.join(work, "messages.json")
            for i in range(max(4, args.random // 2)):
                messages = random_conversation(rng)
                agp = rng.random() < 0.5
                ctx = {"bos_token": "<s>", "eos_token": "</s>", "messages": transformers_view(messages),
                       "tools": None, "documents": None, "add_generation_prompt": agp}
                expected = render(env, source, ctx)
                with open(msg_path, "w", encoding="utf-8") as f:
                    json.dump(messages, f, ensure_ascii=False)
                flags = ["--add-generation-prompt"] if agp else []
                rc, out, err = runner.run(["--model", model_dir, "--messages", msg_path, *flags])
                runner.check(f"{name}[model {i}]", expected, rc, out, err, {"messages": messages, "agp": agp})
        # Random templates.
        for i in range(args.random_templates):
            for kind, make in (("whitespace", random_whitespace_template), ("scoping", random_scoping_template)):
                source, ctx = make(rng)
                expected = render(env, source, ctx)
                if "error" in expected and "break" in expected["error"]:
                    continue  # jinja2 compiles loop controls in macros into invalid Python; not our concern
                with open(tmpl_path, "w", encoding="utf-8", newline="") as f:
                    f.write(source)
                with open(ctx_path, "w", encoding="utf-8") as f:
                    json.dump(ctx, f, ensure_ascii=False)
                rc, out, err = runner.run(["--template", tmpl_path, "--context", ctx_path])
                runner.check(f"random {kind} template {i}", expected, rc, out, err, {"template": source, **ctx})
    print(f"{runner.passed} passed, {runner.failed} failed")
    return 1 if runner.failed else 0


if __name__ == "__main__":
    sys.exit(main())
