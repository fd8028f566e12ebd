#!/usr/bin/env python3
"""Writes the seed corpora in fuzz/corpus/<target>/ from valid inputs made by the reference
writers: safetensors files saved by `safetensors`, config.json files from tests/fixtures/configs
and tests/fixtures/models (written by transformers), and small BPE tokenizer.json files built
with `tokenizers`.

Usage: python3 fuzz/make_corpus.py   (run from anywhere; overwrites the seeds)
"""
import json
import os
import shutil

import torch
from safetensors.torch import save
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import AddedToken, Regex, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")
TEXT = [
    "Hello, World! It's 2024-06-01: 3.14 café 日本語 😀",
    "The quick brown fox jumps over the lazy dog.",
    "def main():\n    return 42\n",
]


def write(target, name, data):
    os.makedirs(os.path.join(CORPUS, target), exist_ok=True)
    mode = "wb" if isinstance(data, bytes) else "w"
    with open(os.path.join(CORPUS, target, name), mode) as f:
        f.write(data)


def safetensors_seeds():
    g = torch.Generator().manual_seed(0)
    write("safetensors", "three_dtypes.safetensors", save({
        "w.f32": torch.randn(2, 3, generator=g),
        "w.bf16": torch.randn(4, generator=g).to(torch.bfloat16),
        "w.f16": torch.randn(1, 2, 2, generator=g).to(torch.float16),
    }, metadata={"format": "pt"}))
    write("safetensors", "scalar_empty.safetensors", save({
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 4),
        "ids": torch.arange(3, dtype=torch.int64),
    }))
    write("safetensors", "stacked_experts.safetensors", save({
        "model.layers.0.mlp.experts.gate_up_proj": torch.randn(2, 4, 2, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.experts.down_proj": torch.randn(2, 2, 2, generator=g).to(torch.bfloat16),
    }))


def config_seeds():
    fixtures = os.path.join(HERE, "..", "tests", "fixtures", "configs")
    for name in sorted(os.listdir(fixtures)):
        if name.endswith(".json") and name != "expected.json":
            shutil.copy(os.path.join(fixtures, name), os.path.join(CORPUS, "config", name))
    models = os.path.join(HERE, "..", "tests", "fixtures", "models")
    for name in sorted(os.listdir(models)) if os.path.isdir(models) else []:
        path = os.path.join(models, name, "config.json")
        if os.path.exists(path):
            shutil.copy(path, os.path.join(CORPUS, "config", "model_" + name + ".json"))
    write("config", "minimal_mixtral.json", json.dumps({"model_type": "mixtral"}))


def byte_level_bpe():
    # GPT-2 / Qwen style: regex split, byte-level alphabet, chat added tokens.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
                             behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TEXT, trainer)
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True),
                            AddedToken("<|im_end|>", special=True)])
    return tok


def metaspace_bpe():
    # Llama / Mistral style: ▁ for spaces, byte fallback, <s> added by a template.
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "H", "e", "l", "o", "W", "r", "d", ",", "!", "▁H", "▁W", "ll", "llo", "▁Hello"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "H"), ("▁", "W"), ("l", "l"), ("ll", "o"), ("▁H", "e"), ("▁He", "llo")]
    vocab.setdefault("▁He", len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True,
                               byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    tok.add_special_tokens([AddedToken("<unk>", special=True), AddedToken("<s>", special=True),
                            AddedToken("</s>", special=True)])
    return tok


def whitespace_bpe():
    tok = Tokenizer(models.BPE(unk_token="[UNK]", continuing_subword_prefix="##"))
    tok.normalizer = normalizers.Sequence([normalizers.NFKD(), normalizers.Lowercase(),
                                           normalizers.StripAccents()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]", "[CLS]", "[SEP]"],
                                  continuing_subword_prefix="##", show_progress=False)
    tok.train_from_iterator(TEXT, trainer)
    tok.post_processor = processors.BertProcessing(("[SEP]", 2), ("[CLS]", 1))
    return tok


def tokenizer_seeds():
    for name, make in [("byte_level_bpe", byte_level_bpe), ("metaspace_bpe", metaspace_bpe),
                       ("whitespace_bpe", whitespace_bpe)]:
        write("tokenizer", name + ".json", make().to_str())


if __name__ == "__main__":
    safetensors_seeds()
    config_seeds()
    tokenizer_seeds()
    for target in sorted(os.listdir(CORPUS)):
        files = os.listdir(os.path.join(CORPUS, target))
        size = sum(os.path.getsize(os.path.join(CORPUS, target, f)) for f in files)
        print(f"{target}: {len(files)} seeds, {size} bytes")
