#!/usr/bin/env python3
"""Differential test: `moeinfer tokenize` against the `tokenizers` library on random strings.

For every fixture tokenizer under FIXTURES/tokenizers/*/tokenizer.json, generates random strings
(mixed scripts, whitespace runs, emoji sequences, combining marks, the tokenizer's own added
tokens, random code points), encodes them with `tokenizers` and with
`moeinfer tokenize --input-jsonl` (with and without special tokens) and requires identical ids.
The seed is fresh each run and printed; pass --seed to replay a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import subprocess
import sys
import tempfile

from tokenizers import Tokenizer

_WORDS = ["the", "The", "model", "experts", "routing", "token", "hello", "World", "café",
          "naïve", "Größe", "don't", "it's", "WE'LL", "I'M", "x", "a1b2", "snake_case",
          "camelCase", "https://example.com/a?b=c", "foo.bar()", "λ", "Ωmega", "Привет", "мир",
          "γειά", "مرحبا", "שלום", "नमस्ते", "東京", "中文", "你好", "世界", "ひらがな", "カタカナ",
          "한국어", "ไทย", "▁meta", "<0x41>", "<unk>", "</s", "<|", "|>", "ﬁ", "①", "²", "Ⅻ"]
_EMOJI = ["😀", "👍", "👍🏽", "🎉", "🚀", "❤️", "🇫🇷", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🤖", "✨", "☃"]
_SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\r", " \n ", "\u00a0", "\u3000",
           "\u2028", "\u2003", "\u180e", "\u200b", "\u0085", "\x0b", "\x0c", "        "]
_PUNCT = list(".,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`") + ["...", "--", "->", "::", "'s", "'t",
                                                      "'re", "'ve", "'m", "'ll", "'d", "'S"]
_MARKS = ["\u0301", "\u0308", "\u0327", "\u20dd", "\u093f", "\u0e31", "\ufe0f", "\u200d"]
_RANGES = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF),
           (0x900, 0x97F), (0xE00, 0xE7F), (0x1100, 0x11FF), (0x2000, 0x206F), (0x2100, 0x24FF),
           (0x3000, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0xF900, 0xFAFF),
           (0xFB00, 0xFB4F), (0xFF00, 0xFFEF), (0x1F300, 0x1FAFF), (0x20000, 0x2A6DF)]


def random_code_point(rng: random.Random) -> str:
    if rng.random() < 0.5:
        lo, hi = rng.choice(_RANGES)
        return chr(rng.randint(lo, hi))
    while True:  # any scalar value, assigned or not
        cp = rng.randint(0, 0x10FFFF)
        if not 0xD800 <= cp <= 0xDFFF:
            return chr(cp)


def random_text(rng: random.Random, specials: list[str]) -> str:
    parts = []
    for _ in range(rng.randrange(0, 24)):
        r = rng.random()
        if r < 0.30:
            parts.append(rng.choice(_WORDS))
        elif r < 0.45:
            parts.append(rng.choice(_SPACES))
        elif r < 0.55:
            parts.append(rng.choice(_PUNCT))
        elif r < 0.62:
            parts.append(rng.choice(_EMOJI))
        elif r < 0.68:
            parts.append(str(rng.randrange(10 ** rng.randrange(1, 9))))
        elif r < 0.74 and specials:
            parts.append(rng.choice(specials))
        elif r < 0.78:
            parts.append(rng.choice(_MARKS))
        else:
            parts.append("".join(random_code_point(rng) for _ in range(rng.randrange(1, 6))))
        if rng.random() < 0.4:
            parts.append(" ")
    return "".join(parts)


def run_moeinfer(binary: str, tokenizer_json: pathlib.Path, texts: list[str],
                 add_special: bool) -> list[list[int]]:
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", encoding="utf-8",
                                     delete=False) as f:
        for text in texts:
            f.write(json.dumps(text, ensure_ascii=False) + "\n")
        path = f.name
    try:
        cmd = [binary, "tokenize", "--model", str(tokenizer_json), "--input-jsonl", path]
        if not add_special:
            cmd.append("--no-special")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    finally:
        os.unlink(path)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    lines = proc.stdout.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) != len(texts):
        raise RuntimeError(f"moeinfer printed {len(lines)} lines for {len(texts)} inputs")
    return [[int(x) for x in line.split(",")] if line else [] for line in lines]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--moeinfer", required=True, help="the moeinfer binary")
    parser.add_argument("--fixtures", required=True, type=pathlib.Path,
                        help="the fixtures folder (holding tokenizers/<name>/tokenizer.json)")
    parser.add_argument("--seed", type=int, default=None, help="replay a run")
    parser.add_argument("--count", type=int, default=1000, help="strings per tokenizer")
    args = parser.parse_args()

    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed} (replay with --seed {seed})")
    files = sorted((args.fixtures / "tokenizers").glob("*/tokenizer.json"))
    if not files:
        print(f"no tokenizer fixtures under {args.fixtures / 'tokenizers'}")
        return 1

    passed = failed = 0
    for path in files:
        name = path.parent.name
        rng = random.Random(f"{seed}-{name}")
        reference = Tokenizer.from_file(str(path))
        specials = [t.content for t in reference.get_added_tokens_decoder().values()]
        texts = [random_text(rng, specials) for _ in range(args.count)]
        shown = 0
        for add_special in (True, False):
            expected = [e.ids for e in reference.encode_batch(texts,
                                                              add_special_tokens=add_special)]
            got = run_moeinfer(args.moeinfer, path, texts, add_special)
            for text, want, have in zip(texts, expected, got):
                if want == have:
                    passed += 1
                    continue
                failed += 1
                if shown < 5:
                    shown += 1
                    print(f"MISMATCH {name} add_special_tokens={add_special}\n"
                          f"  input    {text!r}\n  expected {want}\n  got      {have}")
        print(f"{name}: {len(texts)} strings checked")
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
