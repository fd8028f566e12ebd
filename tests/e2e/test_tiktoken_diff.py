#!/usr/bin/env python3
"""Differential test: `moeinfer tokenize` on Kimi K2's tiktoken layout against `tiktoken`.

The fixture FIXTURES/tokenizers/kimi_tiktoken holds a rank file (tiktoken.model) and a
tokenizer_config.json as Kimi K2 publishes them (tools/make_tokenizer_fixtures.py). The reference
is the `tiktoken` package with Kimi's split pattern and special tokens, encoding as Kimi's
TikTokenTokenizer.encode does (every special allowed, runs over 25000 characters cut). Random
strings (mixed scripts, whitespace runs, emoji, marks, the special and reserved tokens, random
code points, and a few long runs) must give identical ids.
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

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent.parent / "tools"))

from test_tokenizer_diff import random_text  # noqa: E402
from make_tokenizer_fixtures import (kimi_encode, kimi_specials,  # noqa: E402
                                     kimi_tiktoken_encoding)


def long_run(rng: random.Random) -> str:
    """A run of spaces or of one merged pair, a little past the 25000-character cut."""
    unit = rng.choice([" ", "  ", "ab", "x", "中", "\n"])
    count = (25000 + rng.randrange(-3, 40)) // len(unit)
    return rng.choice(["", "pre "]) + unit * count + rng.choice(["", " post", "!"])


def run_moeinfer(binary: str, model_dir: pathlib.Path, texts: list[str],
                 extra: list[str]) -> list[str]:
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", encoding="utf-8",
                                     delete=False) as f:
        for text in texts:
            f.write(json.dumps(text, ensure_ascii=False) + "\n")
        path = f.name
    try:
        cmd = [binary, "tokenize", "--model", str(model_dir), "--input-jsonl", path, *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    finally:
        os.unlink(path)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    lines = proc.stdout.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) != len(texts):
        raise RuntimeError(f"moeinfer printed {len(lines)} lines for {len(texts)} inputs")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--moeinfer", required=True, help="the moeinfer binary")
    parser.add_argument("--fixtures", required=True, type=pathlib.Path,
                        help="the fixtures folder (holding tokenizers/kimi_tiktoken)")
    parser.add_argument("--seed", type=int, default=None, help="replay a run")
    parser.add_argument("--count", type=int, default=1000, help="random strings")
    args = parser.parse_args()

    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed} (replay with --seed {seed})")
    model_dir = args.fixtures / "tokenizers" / "kimi_tiktoken"
    config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    rank_file = model_dir / "tiktoken.model"
    num_base = sum(1 for line in rank_file.read_text(encoding="ascii").splitlines() if line)
    specials = kimi_specials(num_base, config)
    enc = kimi_tiktoken_encoding(rank_file, specials)

    rng = random.Random(seed)
    names = list(specials.values())
    texts = [random_text(rng, names) for _ in range(args.count)]
    texts += [long_run(rng) for _ in range(4)]
    expected = [kimi_encode(enc, text) for text in texts]
    got = [[int(x) for x in line.split(",")] if line else []
           for line in run_moeinfer(args.moeinfer, model_dir, texts, [])]
    failed = 0
    for text, want, have in zip(texts, expected, got):
        if want != have:
            failed += 1
            if failed <= 5:
                print(f"MISMATCH encode\n  input    {text[:200]!r}\n  expected {want[:40]}\n"
                      f"  got      {have[:40]}")
    print(f"{len(texts) - failed} of {len(texts)} strings encode as tiktoken does")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
