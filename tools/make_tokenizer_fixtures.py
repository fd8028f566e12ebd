#!/usr/bin/env python3
"""Trains small tokenizers with the `tokenizers` library and writes tokenizer fixtures.

Each fixture is tests/fixtures/tokenizers/<name>/tokenizer.json plus cases.json, which holds
inputs together with the ids and decoded text that `tokenizers` gives for them. The C++ tests
(tests/io/tokenizer_test.cpp) and the differential test (tests/e2e/test_tokenizer_diff.py) compare
moeinfer against these.

The layouts are the ones published checkpoints use:
  qwen2_bytelevel     NFC, Split on the Qwen2 regex, ByteLevel without its own regex, chat specials
  gpt2_bytelevel      ByteLevel with the GPT-2 regex and add_prefix_space, ignore_merges, EOS by a
                      TemplateProcessing inside a Sequence, added tokens with lstrip/rstrip/
                      single_word/normalized flags
  mixtral_legacy      SentencePiece-style BPE with byte fallback, normaliser Prepend + Replace,
                      merges written as "a b" strings
  mixtral_metaspace   the same model with a Metaspace(prepend_scheme="first") pre-tokenizer
  misc_suffix_bpe     subword prefix/suffix BPE behind the other normalisers and pre-tokenizers
  t5_metaspace        older SentencePiece conversion: Nmt, Metaspace split, Roberta processing
  kimi_tiktoken       Kimi K2's layout: tiktoken.model (base64 bytes and rank per line) and
                      tokenizer_config.json naming tokenization_kimi.TikTokenTokenizer, whose
                      special tokens take the 256 ids after the ranks; its cases come from the
                      `tiktoken` package with Kimi's split pattern (KIMI_PATTERN), encoded as
                      that class's encode() does (kimi_encode)

Training is deterministic: the corpus is the licence texts every Debian machine ships under
/usr/share/common-licenses plus generated lines from a fixed seed.

Other scripts import `build_qwen_style(vocab_size)` and `build_mixtral_style(vocab_size)` to give
tiny model fixtures a tokenizer; the vocabulary, added tokens included, is exactly vocab_size
(or smaller only if the corpus runs out of merges).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random

from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors, trainers)

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_ADDED = ["<think>", "</think>"]  # added, not special (as in Qwen3)
LICENSE_DIR = pathlib.Path("/usr/share/common-licenses")
METASPACE = "\u2581"

# Phrases written for this corpus, in several scripts.
_PHRASES = [
    "今天天气很好，我们去公园散步吧。",
    "机器学习模型需要大量的数据进行训练。",
    "专家混合模型把每个词元路由到少数几个专家。",
    "東京の春は桜がとても綺麗です。",
    "ひらがなとカタカナと漢字を混ぜて書きます。",
    "서울은 한국의 수도입니다.",
    "오늘 저녁에 무엇을 먹을까요?",
    "Привет, как дела? Всё хорошо.",
    "Ελληνικά γράμματα: αβγδε ζηθ.",
    "مرحبا بالعالم، هذا نص عربي.",
    "שלום עולם, זה טקסט בעברית.",
    "नमस्ते दुनिया, यह हिंदी है।",
    "café naïve résumé façade Ångström Øre coöperate",
    "Straße, Größe, Mädchen, Übermut, àéîõü ÀÉÎÕÜ",
    "emoji 😀 😃 😄 👍 👍🏽 🎉 🚀 ❤️ 🇫🇷 👨‍👩‍👧‍👦",
    "The year 2024 had 366 days; π ≈ 3.14159 and e ≈ 2.71828.",
    "Prices: $19.99, €5,00, ¥1000, £42 — 50% off!",
    "def forward(self, x):\n    return self.proj(torch.relu(x)) + 1\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "if err != nil {\n\treturn fmt.Errorf(\"failed: %w\", err)\n}",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "<html><body><p class=\"x\">Hello &amp; welcome</p></body></html>",
    "It's what they'll do; we've seen it, I'm sure you'd agree. DON'T SHOUT.",
    "    indented line with\ttabs\tand   runs   of   spaces",
    "line one\nline two\r\nline three\n\n\nafter blank lines",
]


def corpus_lines() -> list[str]:
    """The training corpus: licence texts read at run time plus generated mixed-script lines."""
    lines: list[str] = []
    if LICENSE_DIR.is_dir():
        for path in sorted(LICENSE_DIR.iterdir()):
            if path.is_file() and not path.is_symlink():
                lines.extend(path.read_text(encoding="utf-8", errors="replace").splitlines())
    rng = random.Random(20240611)
    words = " ".join(_PHRASES).split()
    for _ in range(4000):
        kind = rng.randrange(4)
        if kind == 0:
            lines.append(rng.choice(_PHRASES))
        elif kind == 1:
            lines.append(" ".join(rng.choice(words) for _ in range(rng.randrange(3, 12))))
        elif kind == 2:
            lines.append(" ".join(str(rng.randrange(10 ** rng.randrange(1, 7)))
                                  for _ in range(rng.randrange(1, 6))))
        else:
            lines.append(rng.choice(_PHRASES) + " " + rng.choice(_PHRASES))
    return lines


def _check_size(tok: Tokenizer, vocab_size: int) -> Tokenizer:
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise RuntimeError(f"trained vocabulary has {size} entries, more than {vocab_size}")
    return tok


def build_qwen_style(vocab_size: int) -> Tokenizer:
    """Qwen2/Qwen3-style byte-level BPE with <|endoftext|>, <|im_start|>, <|im_end|> (special)
    and <think>, </think> (added) after the model vocabulary; vocab_size counts all of them."""
    num_added = len(QWEN_SPECIALS) + len(QWEN_ADDED)
    if vocab_size < 256 + num_added + 1:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level vocabulary")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                              use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - num_added, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_lines(), trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in QWEN_SPECIALS])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in QWEN_ADDED])
    return _check_size(tok, vocab_size)


def build_gpt2_style(vocab_size: int) -> Tokenizer:
    """GPT-2-style ByteLevel (built-in regex, add_prefix_space) with EOS appended, and added
    tokens that exercise lstrip, rstrip, single_word and normalized."""
    added = [
        AddedToken("<|endoftext|>", special=True, normalized=False),
        AddedToken("<mask>", special=True, lstrip=True, normalized=False),
        AddedToken("<sep>", special=True, rstrip=True, normalized=False),
        AddedToken("[NEW]", special=False, single_word=True, normalized=False),
        AddedToken("moeinfer", special=False, normalized=True),
    ]
    tok = Tokenizer(models.BPE(ignore_merges=True))  # as Llama-3
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(added), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_lines(), trainer)
    tok.add_special_tokens([t for t in added if t.special])
    tok.add_tokens([t for t in added if not t.special])
    eos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=True),
        processors.TemplateProcessing(single="$A <|endoftext|>",
                                      pair="$A <|endoftext|> $B:1 <|endoftext|>:1",
                                      special_tokens=[("<|endoftext|>", eos)]),
    ])
    return _check_size(tok, vocab_size)


def build_mixtral_style(vocab_size: int, layout: str = "legacy") -> Tokenizer:
    """Mixtral/Llama-style SentencePiece BPE: <unk>=0, <s>=1, </s>=2, byte tokens <0x00>..<0xFF>
    at 3..258, byte_fallback, BOS added by TemplateProcessing. layout "legacy" normalises with
    Prepend("▁") + Replace(" ", "▁") (Mixtral's published file); "metaspace" uses a
    Metaspace(prepend_scheme="first", split=False) pre-tokenizer instead."""
    if layout not in ("legacy", "metaspace"):
        raise ValueError(f"unknown layout {layout!r}")
    specials = ["<unk>", "<s>", "</s>"]
    num_fixed = len(specials) + 256
    if vocab_size < num_fixed + 40:
        raise ValueError(f"vocab_size {vocab_size} is too small for byte fallback")
    trained_size = vocab_size - 256
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme="always",
                                                 split=True)  # word boundaries while training
    # Choose the alphabet here: the trainer breaks ties between equally frequent characters in
    # hash order, which would make the fixture change from run to run.
    lines = corpus_lines()
    counts: dict[str, int] = {}
    for line in lines:
        for ch in METASPACE + line.replace(" ", METASPACE):
            counts[ch] = counts.get(ch, 0) + 1
    num_chars = max(30, min(150, (trained_size - len(specials)) // 2))
    alphabet = sorted(counts, key=lambda ch: (-counts[ch], ch))[:num_chars]
    trainer = trainers.BpeTrainer(vocab_size=trained_size, special_tokens=specials,
                                  initial_alphabet=alphabet, limit_alphabet=len(alphabet),
                                  show_progress=False)
    tok.train_from_iterator(lines, trainer)

    # Put the byte tokens right after the specials, as SentencePiece does.
    data = json.loads(tok.to_str())
    trained = sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])
    vocab: dict[str, int] = {}
    for token, _ in trained[:len(specials)]:
        vocab[token] = len(vocab)
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for token, _ in trained[len(specials):]:
        if token not in vocab:
            vocab[token] = len(vocab)
    data["model"]["vocab"] = vocab
    for entry in data["added_tokens"]:
        entry["id"] = vocab[entry["content"]]
        entry["normalized"] = False
    data["normalizer"] = None
    data["pre_tokenizer"] = None
    tok = Tokenizer.from_str(json.dumps(data))

    if layout == "legacy":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(METASPACE),
                                               normalizers.Replace(" ", METASPACE)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=METASPACE,
                                                     prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace(METASPACE, " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(content=" ", left=1)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])])
    return _check_size(tok, vocab_size)


def _alphabet(lines: list[str], num_chars: int, transform=lambda line: line) -> list[str]:
    """The num_chars most frequent characters, ties broken by code point (deterministic)."""
    counts: dict[str, int] = {}
    for line in lines:
        for ch in transform(line):
            counts[ch] = counts.get(ch, 0) + 1
    return sorted(counts, key=lambda ch: (-counts[ch], ch))[:num_chars]


def build_misc_suffix_style() -> Tokenizer:
    """A hand-written BPE with continuing_subword_prefix "##", end_of_word_suffix "</w>" and a
    non-fused unk (the trainer orders such vocabularies by hash, so it is not trained), behind
    the normalisers and pre-tokenizers the other fixtures do not use (NFKC, Lowercase, Strip,
    regex Replace, NFD, StripAccents; WhitespaceSplit, Digits, Punctuation, string and inverted
    Splits with every behaviour), with BertProcessing and a BPEDecoder."""
    vocab: dict[str, int] = {}
    for token in ["<unk>", "[CLS]", "[SEP]"]:
        vocab[token] = len(vocab)
    for ch in "abcdefghijklmnopqrstuvwxyz0123456789-.,!?'":
        for token in (ch, "##" + ch, ch + "</w>", "##" + ch + "</w>"):
            vocab[token] = len(vocab)
    merges = [("t", "##h"), ("th", "##e</w>"), ("##e", "##r"), ("##er", "##s</w>"),
              ("i", "##n"), ("in", "##g</w>"), ("##i", "##n"), ("##in", "##g</w>"),
              ("a", "##n"), ("an", "##d</w>"), ("q", "##u"), ("##o", "##u"), ("##ou", "##s</w>"),
              ("e", "##x"), ("ex", "##-</w>"), ("##e", "##d</w>"), ("##a", "##t"),
              ("##at", "##i"), ("##ati", "##o"), ("##atio", "##n</w>"), ("s", "##t")]
    for a, b in merges:
        vocab.setdefault(a + b[2:], len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=False,
                               continuing_subword_prefix="##", end_of_word_suffix="</w>"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ["<unk>", "[CLS]", "[SEP]"]])
    tok.normalizer = normalizers.Sequence([
        normalizers.NFKC(), normalizers.Lowercase(), normalizers.Strip(),
        normalizers.Replace(Regex(" {2,}"), " "), normalizers.NFD(), normalizers.StripAccents(),
        normalizers.NFC()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.Punctuation(behavior="contiguous"),
        pre_tokenizers.Split("-", behavior="merged_with_previous"),
        pre_tokenizers.Split(Regex(r"(?<=[aeiou])(?=[^aeiou])"), behavior="removed"),
        pre_tokenizers.Split(Regex(r"qu"), behavior="merged_with_next"),
        pre_tokenizers.Split(Regex(r"[^x]+"), behavior="contiguous", invert=True),
    ])
    tok.post_processor = processors.BertProcessing(("[SEP]", vocab["[SEP]"]),
                                                   ("[CLS]", vocab["[CLS]"]))
    tok.decoder = decoders.BPEDecoder(suffix="</w>")
    return tok


def build_t5_metaspace_style(vocab_size: int) -> Tokenizer:
    """Older SentencePiece conversions: Nmt + NFKC normalisers, Metaspace(prepend "always",
    split=True) with its decoder, fused unk without byte fallback, RobertaProcessing."""
    specials = ["<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Nmt(), normalizers.NFKC()])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme="always",
                                                 split=True)
    lines = corpus_lines()
    alphabet = _alphabet(lines, 100, lambda line: METASPACE + line.replace(" ", METASPACE))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, special_tokens=specials,
                                  initial_alphabet=alphabet, limit_alphabet=len(alphabet),
                                  show_progress=False)
    tok.train_from_iterator(lines, trainer)
    tok.add_tokens([AddedToken("<extra_id_0>", special=True, normalized=False)])
    tok.post_processor = processors.RobertaProcessing(("</s>", tok.token_to_id("</s>")),
                                                      ("<s>", tok.token_to_id("<s>")))
    tok.decoder = decoders.Metaspace(replacement=METASPACE, prepend_scheme="always", split=True)
    return _check_size(tok, vocab_size)


# Inputs every fixture is checked on; specials of every fixture appear so each sees foreign ones.
COMMON_CASES = [
    "",
    " ",
    "Hello world",
    "Hello world!",
    "   leading spaces",
    "trailing spaces   ",
    "tabs\tbetween\t\twords",
    "new\nlines\n\n\nand blank ones\n",
    "windows\r\nline\r\nendings",
    "  \n\t  \n",
    "中文测试：你好，世界！",
    "日本語のテキストです。",
    "한국어 텍스트",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "accents: café naïve résumé Ångström",
    "decomposed e\u0301 and composed \u00e9",
    "digits 1234567890 and 3.14159 and 1,000,000",
    "def f(x):\n    return x ** 2  # square\n",
    "It's I'M we'RE they've you'd she'll",
    "unknown bytes \x00\x01\x1b\x7f \u0378 \U0010fffd \ufffd",
    "mixed 中文 and English 123 😀!!",
    "a" * 300,
    "word " * 50,
    "<|endoftext|>",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<s>bos inside</s> and <unk>",
    "  <s> spaced special </s>  ",
    "<think>reasoning</think>answer",
    "<0x41> is not a byte token in text",
    "Ⅻ ① ² ﬁ ㎏ full-width ＡＢＣ",
    "\u00a0non-breaking\u2003em space\u3000ideographic",
]

GPT2_CASES = [
    "a <mask> b",
    "a    <mask>   b",
    "<mask>start",
    "x <sep>   y",
    "x<sep>\n\ny",
    "[NEW] token",
    "a[NEW]b",
    "a [NEW] b [NEW]",
    "é[NEW]",
    "moeinfer is here, moeinfers too",
]

MIXTRAL_CASES = [
    "Hello",
    " Hello",
    "Hello <s> world",
    "</s>",
    "<s><s>",
    "▁already▁has▁metaspace",
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich",
]


def unicode_additions() -> list[tuple[int, int, str]]:
    """Code points assigned after Unicode 14.0 (the data of PCRE2 10.42, which moeinfer's regexes
    run on), with the general category `tokenizers`' Oniguruma gives them, as (first, last,
    category) ranges. `--print-unicode-table` prints them for src/io/unicode.cpp."""
    import unicodedata
    if unicodedata.unidata_version != "14.0.0":
        raise RuntimeError("run with a Python whose unicodedata is Unicode 14.0.0 (Python 3.11)")
    new = "".join(chr(cp) for cp in range(0x110000)
                  if not 0xD800 <= cp <= 0xDFFF and unicodedata.category(chr(cp)) == "Cn")
    probe = Tokenizer(models.BPE())
    probe.pre_tokenizer = pre_tokenizers.Split(Regex(r"\p{Cn}"), behavior="removed")
    assigned = "".join(piece for piece, _ in probe.pre_tokenizer.pre_tokenize_str(new))
    category: dict[int, str] = {}
    for cat in ["Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "No", "Pc", "Pd",
                "Ps", "Pe", "Pi", "Pf", "Po", "Sm", "Sc", "Sk", "So", "Zs", "Zl", "Zp", "Cc",
                "Cf", "Co"]:
        probe.pre_tokenizer = pre_tokenizers.Split(Regex(r"\p{%s}" % cat), behavior="removed",
                                                   invert=True)
        for piece, _ in probe.pre_tokenizer.pre_tokenize_str(assigned):
            for ch in piece:
                category[ord(ch)] = cat
    ranges: list[list] = []
    for cp in sorted(category):
        if ranges and ranges[-1][1] == cp - 1 and ranges[-1][2] == category[cp]:
            ranges[-1][1] = cp
        else:
            ranges.append([cp, cp, category[cp]])
    return [tuple(r) for r in ranges]


MISC_CASES = [
    "Quick-quiet QUEUE, ex-post: x-ray xx 12-34!!",
    "ÉCOLE Ærø ﬁnance ＦＵＬＬ width and   many    spaces  ",
    "\u200bzero\u200dwidth\ufeffjoiners\x07bell",
    "<extra_id_0> sentinel <extra_id_0>",
]


def _ranges(code_points) -> list[tuple[int, int]]:
    ranges: list[list[int]] = []
    for cp in code_points:
        if ranges and ranges[-1][1] == cp - 1:
            ranges[-1][1] = cp
        else:
            ranges.append([cp, cp])
    return [tuple(r) for r in ranges]


def _assigned_non_ascii() -> list[str]:
    import unicodedata
    return [chr(cp) for cp in range(0x80, 0x110000)
            if not 0xD800 <= cp <= 0xDFFF and unicodedata.category(chr(cp)) != "Cn"]


def tokenizers_punctuation() -> list[tuple[int, int]]:
    """Non-ASCII code points `tokenizers`' Punctuation pre-tokenizer splits on (its table is
    older than utf8proc's, and categories moved in between), as (first, last) ranges."""
    probe = pre_tokenizers.Punctuation(behavior="removed")
    return _ranges(ord(ch) for ch in _assigned_non_ascii()
                   if probe.pre_tokenize_str("a" + ch + "b") == [("a", (0, 1)), ("b", (2, 3))])


def tokenizers_accents() -> list[tuple[int, int]]:
    """Code points `tokenizers`' StripAccents removes, as (first, last) ranges."""
    strip = normalizers.StripAccents()
    return _ranges(ord(ch) for ch in _assigned_non_ascii() if strip.normalize_str(ch) == "")


def tokenizers_lowercase_additions() -> list[tuple[int, int]]:
    """(code point, lowercase) pairs where `tokenizers`' Lowercase (Rust, newer Unicode) differs
    from Unicode 14's mapping."""
    lower = normalizers.Lowercase()
    pairs = []
    for cp in range(0x80, 0x110000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        mapped = lower.normalize_str(chr(cp))
        if mapped != chr(cp).lower():
            if len(mapped) != 1:
                raise RuntimeError(f"U+{cp:04X} lowercases to {len(mapped)} characters")
            pairs.append((cp, ord(mapped)))
    return pairs


def tokenizers_numeric_additions() -> list[tuple[int, int]]:
    """Code points the Digits pre-tokenizer (Rust's char::is_numeric, newest Unicode) treats as
    numeric that are not numbers in Unicode 14 nor in unicode_additions()."""
    import unicodedata
    newer = {cp for first, last, _ in unicode_additions() for cp in range(first, last + 1)}
    digits = pre_tokenizers.Digits(individual_digits=True)
    return _ranges(cp for cp in range(0x80, 0x110000)
                   if not 0xD800 <= cp <= 0xDFFF and cp not in newer
                   and not unicodedata.category(chr(cp)).startswith("N")
                   and len(digits.pre_tokenize_str("a" + chr(cp) + "b")) == 3)


def unknown_to_normalizers() -> list[tuple[int, int]]:
    """Code points with a decomposition or a combining class in Unicode 14 that `tokenizers`'
    NFC/NFD/NFKC/NFKD leave alone as if unassigned (its tables are older), as (first, last)."""
    import unicodedata
    nfkd, nfd = normalizers.NFKD(), normalizers.NFD()
    ranges: list[list[int]] = []
    for cp in range(0x80, 0x110000):
        ch = chr(cp)
        if 0xD800 <= cp <= 0xDFFF or unicodedata.category(ch) == "Cn":
            continue
        if unicodedata.normalize("NFKD", ch) == ch and unicodedata.combining(ch) == 0:
            continue
        starter = (nfkd.normalize_str(ch) == ch
                   and nfd.normalize_str("a" + ch + "\u0334") == "a" + ch + "\u0334"
                   and nfd.normalize_str("a\u0301" + ch) == "a\u0301" + ch)
        if starter:
            if ranges and ranges[-1][1] == cp - 1:
                ranges[-1][1] = cp
            else:
                ranges.append([cp, cp])
    return [tuple(r) for r in ranges]


# tokenization_kimi.py's TikTokenTokenizer.pat_str (Rust regex syntax, for tiktoken).
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
KIMI_NUM_SPECIAL = 256
# Kimi K2's named special tokens, by offset after the ranks (its tokenizer_config.json puts them at
# 163584 + offset); the other offsets are <|reserved_token_<id>|>.
KIMI_SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
                 6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]",
                 10: "<|im_system|>", 11: "<|tool_calls_section_begin|>",
                 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
                 14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>",
                 17: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]"}
# Runs past 25000 characters, which the class cuts, are left to tests/e2e/test_tiktoken_diff.py
# (their ids would make this file large).
KIMI_CASES = [
    "<|im_system|>system<|im_middle|>You are Kimi.<|im_end|><|im_user|>user<|im_middle|>hi"
    "<|im_end|><|im_assistant|>assistant<|im_middle|>",
    "[BOS]text[EOS] and [UNK][PAD]",
    "<|reserved_token_{r}|> reserved, <|reserved_token_1|> not",
    "漢字とカタカナ、한글 and Latin: ÉCOLE École école",
    "CamelCaseWords HTTPServer iPhone's O'Neil'S",
    " separators that str.isspace() counts",
    "CJK Ext H/I: \U00031350\U00031351 \U0002EBF0 and Ext J \U000323B0!",
    "Han by Script, not Script_Extensions: \u3008'm \u3005a \u31c0a \u3007a \u2e80a \u3001a",
]


def kimi_encode(enc, text: str) -> list[int]:
    """TikTokenTokenizer.encode(text): chunks of 400000 characters, each cut where a run of
    spaces or of non-spaces (str.isspace) passes 25000, encoded with every special allowed."""
    def cut(s: str, limit: int):
        run, is_space, start = 0, s[0].isspace() if s else False, 0
        for i, ch in enumerate(s):
            now = ch.isspace()
            if is_space ^ now:
                run, is_space = 1, now
            else:
                run += 1
                if run > limit:
                    yield s[start:i]
                    start, run = i, 1
        yield s[start:]
    ids: list[int] = []
    for i in range(0, len(text), 400000):
        for part in cut(text[i:i + 400000], 25000):
            ids.extend(enc.encode(part, allowed_special="all"))
    return ids


def kimi_tiktoken_encoding(rank_file: pathlib.Path, specials: dict[int, str]):
    """The tiktoken Encoding that Kimi's TikTokenTokenizer builds from these files."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    ranks = load_tiktoken_bpe(str(rank_file))
    special_tokens = {name: id_ for id_, name in specials.items()}
    return tiktoken.Encoding(name=rank_file.name, pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                             special_tokens=special_tokens)


def kimi_specials(num_base: int, config: dict) -> dict[int, str]:
    named = {int(k): v["content"] for k, v in config["added_tokens_decoder"].items()}
    return {i: named.get(i, f"<|reserved_token_{i}|>")
            for i in range(num_base, num_base + KIMI_NUM_SPECIAL)}


def write_kimi_tiktoken_fixture(out_dir: pathlib.Path, vocab_size: int) -> None:
    """A byte-level BPE trained on the corpus (with Kimi's split), written as a tiktoken rank
    file: rank = id, the token's bytes in base64. Cases from the `tiktoken` package."""
    import base64
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_lines(), trainer)
    byte_of = {}
    for b, ch in enumerate(_gpt2_byte_chars()):
        byte_of[ch] = b
    vocab = tok.get_vocab()
    target = out_dir / "kimi_tiktoken"
    target.mkdir(parents=True, exist_ok=True)
    lines = []
    for token, id_ in sorted(vocab.items(), key=lambda kv: kv[1]):
        raw = bytes(byte_of[ch] for ch in token)
        lines.append(f"{base64.b64encode(raw).decode()} {id_}")
    rank_file = target / "tiktoken.model"
    rank_file.write_text("\n".join(lines) + "\n", encoding="ascii")
    num_base = len(vocab)
    config = {
        "added_tokens_decoder": {
            str(num_base + off): {"content": name, "lstrip": False, "normalized": False,
                                  "rstrip": False, "single_word": False, "special": True}
            for off, name in sorted(KIMI_SPECIALS.items())},
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1000000000000000019884624838656,
        "tokenizer_class": "TikTokenTokenizer",
    }
    (target / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n",
                                                  encoding="utf-8")
    specials = kimi_specials(num_base, config)
    enc = kimi_tiktoken_encoding(rank_file, specials)
    named = {num_base + off for off in KIMI_SPECIALS}
    cases = []
    inputs = COMMON_CASES + [c.replace("{r}", str(num_base + 20)) for c in KIMI_CASES]
    for text in inputs:
        ids = kimi_encode(enc, text)
        cases.append({
            "text": text,
            "ids": ids,
            "ids_no_special": ids,  # the class adds no BOS
            "decoded": enc.decode(ids),
            "decoded_skip_special": enc.decode([i for i in ids if i not in named]),
        })
    meta = {"vocab_size": num_base + KIMI_NUM_SPECIAL, "num_base": num_base,
            "named_specials": sorted(named), "cases": cases}
    (target / "cases.json").write_text(json.dumps(meta, ensure_ascii=False, indent=1) + "\n",
                                       encoding="utf-8")


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's byte-to-character table (bytes_to_unicode), byte order."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def write_fixture(out_dir: pathlib.Path, name: str, tok: Tokenizer, inputs: list[str],
                  legacy_merges: bool = False) -> None:
    """Saves the tokenizer and the cases. legacy_merges writes merges as "a b" strings, the
    older layout many published files (Mixtral's among them) still use."""
    target = out_dir / name
    target.mkdir(parents=True, exist_ok=True)
    tok.save(str(target / "tokenizer.json"), pretty=False)
    if legacy_merges:
        data = json.loads((target / "tokenizer.json").read_text(encoding="utf-8"))
        merges = data["model"]["merges"]
        if any(" " in part for pair in merges for part in pair):
            raise ValueError("a merge contains a space; it cannot be written as 'a b'")
        data["model"]["merges"] = [" ".join(pair) for pair in merges]
        (target / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False),
                                               encoding="utf-8")
    # Reload so the cases come from exactly the file we ship.
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    cases = []
    for text in inputs:
        ids = tok.encode(text).ids
        cases.append({
            "text": text,
            "ids": ids,
            "ids_no_special": tok.encode(text, add_special_tokens=False).ids,
            "decoded": tok.decode(ids, skip_special_tokens=False),
            "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
        })
    meta = {"vocab_size": tok.get_vocab_size(with_added_tokens=True), "cases": cases}
    (target / "cases.json").write_text(json.dumps(meta, ensure_ascii=False, indent=1) + "\n",
                                       encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    root = pathlib.Path(__file__).resolve().parent.parent
    parser.add_argument("--out", type=pathlib.Path, default=root / "tests/fixtures/tokenizers")
    parser.add_argument("--only", nargs="*", help="fixture names to write (default: all)")
    parser.add_argument("--print-unicode-table", action="store_true",
                        help="print the Unicode tables of src/io/unicode.cpp")
    args = parser.parse_args()
    if args.print_unicode_table:
        print("// kNewerAssignments")
        for first, last, cat in unicode_additions():
            print(f"    {{0x{first:05X}, 0x{last:05X}, \"{cat}\"}},")
        print("// kUnknownToNormalizers")
        for first, last in unknown_to_normalizers():
            print(f"    {{0x{first:05X}, 0x{last:05X}}},")
        print("// kLowercaseAdditions")
        for cp, mapped in tokenizers_lowercase_additions():
            print(f"    {{0x{cp:05X}, 0x{mapped:05X}}},")
        print("// kNumericAdditions")
        for first, last in tokenizers_numeric_additions():
            print(f"    {{0x{first:05X}, 0x{last:05X}}},")
        print("// kTokenizersPunctuation")
        for first, last in tokenizers_punctuation():
            print(f"    {{0x{first:05X}, 0x{last:05X}}},")
        print("// kTokenizersAccents")
        for first, last in tokenizers_accents():
            print(f"    {{0x{first:05X}, 0x{last:05X}}},")
        return
    builders = {
        "qwen2_bytelevel": lambda: write_fixture(args.out, "qwen2_bytelevel",
                                                 build_qwen_style(1000), COMMON_CASES),
        "gpt2_bytelevel": lambda: write_fixture(args.out, "gpt2_bytelevel", build_gpt2_style(800),
                                                COMMON_CASES + GPT2_CASES),
        "mixtral_legacy": lambda: write_fixture(args.out, "mixtral_legacy",
                                                build_mixtral_style(900, "legacy"),
                                                COMMON_CASES + MIXTRAL_CASES, legacy_merges=True),
        "mixtral_metaspace": lambda: write_fixture(args.out, "mixtral_metaspace",
                                                   build_mixtral_style(900, "metaspace"),
                                                   COMMON_CASES + MIXTRAL_CASES),
        "misc_suffix_bpe": lambda: write_fixture(args.out, "misc_suffix_bpe",
                                                 build_misc_suffix_style(),
                                                 COMMON_CASES + MISC_CASES),
        "t5_metaspace": lambda: write_fixture(args.out, "t5_metaspace",
                                              build_t5_metaspace_style(700),
                                              COMMON_CASES + MISC_CASES),
        "kimi_tiktoken": lambda: write_kimi_tiktoken_fixture(args.out, 1200),
    }
    for name, build in builders.items():
        if not args.only or name in args.only:
            build()


if __name__ == "__main__":
    main()
