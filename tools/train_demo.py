#!/usr/bin/env python3
"""Trains moeinfer's built-in demo model: a small Qwen3-MoE language model of fortune cookies.

What it makes (in --out): config.json, model.safetensors (bfloat16), tokenizer.json,
tokenizer_config.json and heldout.txt, laid out exactly as Hugging Face transformers saves a
Qwen3MoeForCausalLM, so that `moeinfer` and transformers read the same files.

Corpus
  The English text of the Debian package `fortunes` (`apt-get install fortunes`; the files
  under /usr/share/games/fortunes without the .dat/.u8 companions), about 2.5 MB: quotations,
  jokes, definitions, poems and one-liners in 42 topic files (computers, science, people,
  politics, songs-poems, ...). `ascii-art` is left out (pictures, not prose). The '%' lines
  that separate fortunes are stripped, as are the overstrike sequences (X<backspace>) some
  files use for underlining; duplicates are dropped. Every fortune whose SHA-256 falls in the
  lowest 5% goes to validation (deterministic, independent of --seed); heldout.txt is the
  first few KB of those, never seen in training.

Tokenizer (trained here with `tokenizers`, on the training split only)
  Byte-level BPE in the Qwen2 layout: NFC normaliser, the Qwen2 split regex then ByteLevel,
  ByteLevel decoder; 4093 learned tokens followed by the specials <|endoftext|>,
  <|im_start|>, <|im_end|> (4096 in all). A TemplateProcessing post-processor puts
  <|endoftext|> (the BOS) in front of every encoded text, which is also how each fortune
  starts in training, so a bare prompt reads as the start of a fortune. tokenizer_config.json
  carries a ChatML chat template.

Training text
  Each training fortune is a document "<|endoftext|>fortune". In addition, a seeded 30% of
  them are repeated as a ChatML exchange ("<|im_start|>user\\nTell me something about
  computers.<|im_end|>\\n<|im_start|>assistant\\n<fortune><|im_end|>\\n", the topic taken
  from the file name), so that `moeinfer generate --chat` answers with a fortune. Documents
  are shuffled with the seed and packed into one token stream; batches are random windows.

Model (the defaults below)
  Qwen3MoeForCausalLM: 5 layers, hidden 256, 4 query / 2 KV heads of 64, every layer MoE with
  16 experts of width 128 and top-2 (softmax, renormalised), tied embeddings, vocab 4096,
  context 512, RoPE theta 10000. About 9.9 M parameters (2.0 M active per token beyond the
  embeddings), 20 MB in bfloat16. The router's load-balancing loss stays on
  (router_aux_loss_coef) so that all experts are used, but routing is learned, not uniform.

Optimisation (the defaults below)
  AdamW (betas 0.9/0.95, weight decay 0.1, clip 1.0), linear warm-up then cosine decay to a
  tenth, batches of 32 windows of 512 tokens, bfloat16 autocast on CUDA (float32 weights),
  float32 on CPU. Validation loss (mean cross-entropy per token, nats) is measured every
  --eval-every steps and the best checkpoint is the one saved (early stopping on the
  validation split). The final line printed is that validation loss.

Determinism
  Given --seed, the corpus split, tokenizer, data order, initialisation and batches are
  fixed; on CPU the run is bit-for-bit repeatable. On CUDA some backward kernels (cuDNN
  attention among them) are not deterministic, so the last digits can differ between runs.
  --max-seconds is a safety stop only; a run that hits it says so in its log.

How the shipped model was made (models/demo/README.md has the figures)
  On one NVIDIA H200 (torch 2.11, transformers 5.17, tokenizers 0.23.2) through the project's
  device tool, in one call that ran four settings side by side on the same GPU, each with
  --threads 3 --max-seconds 330 --max-shard-size 12MB (the shards were joined into one
  model.safetensors afterwards, unchanged):
      --aux-coef 0.01  --steps 800                <- shipped: the defaults above
      --aux-coef 0.001 --steps 800
      --aux-coef 0.01  --steps 1600
      --aux-coef 0.01  --steps 1200 --lr 1e-3
  and kept the lowest validation loss (4.3565 nats/token, best at step 500 of 800, about 7.5
  epochs; the others gave 4.3674, 4.4184, 4.3781). Each took about 115-205 s of training
  (7 steps/s while sharing the GPU four ways) and 130-220 s in all, tokenizer included.
  All four overfit after ~500 steps (the corpus is 1.1 M tokens), hence early stopping.
  Note: transformers' load-balancing loss pools the router statistics of all layers before
  balancing, so it evens out expert *indices* across layers, not each layer's experts: in
  every layer a few experts end up rarely chosen. That is the skewed, learned routing the
  expert-load report and the offloading tests want; the model card lists the loads.
  On a CPU the same command works, just slowly; use fewer --steps there.

Usage:  python3 tools/train_demo.py --out models/demo [--seed 1234] [--steps N] [--device cuda]
"""
import argparse
import hashlib
import json
import math
import os
import random
import re
import sys
import time
import unicodedata

import torch

CORPUS_DIR = "/usr/share/games/fortunes"
EXCLUDED_FILES = {"ascii-art"}  # pictures, not prose
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
BOS = "<|endoftext|>"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# How the user asks for a fortune in the chat-formatted copies; {topic} comes from the file.
CHAT_PROMPTS = [
    "Tell me something about {topic}.",
    "Give me a fortune about {topic}.",
    "Do you know a quote about {topic}?",
    "Say something wise about {topic}.",
    "Tell me a fortune.",
    "What does my fortune cookie say?",
]
TOPIC_NAMES = {
    "art": "art", "computers": "computers", "cookie": "life", "debian": "Debian",
    "definitions": "words", "disclaimer": "disclaimers", "drugs": "drugs",
    "education": "education", "ethnic": "people and places", "food": "food",
    "fortunes": "fortunes", "goedel": "logic", "humorists": "humor", "kids": "kids",
    "knghtbrd": "computers", "law": "the law", "linux": "Linux", "linuxcookie": "Linux",
    "literature": "literature", "love": "love", "magic": "magic", "medicine": "medicine",
    "men-women": "men and women", "miscellaneous": "life", "news": "the news",
    "paradoxum": "paradoxes", "people": "people", "perl": "Perl", "pets": "pets",
    "platitudes": "life", "politics": "politics", "pratchett": "Discworld",
    "riddles": "riddles", "science": "science", "songs-poems": "poetry", "sports": "sports",
    "startrek": "Star Trek", "tao": "the Tao", "translate-me": "translation",
    "wisdom": "wisdom", "work": "work", "zippy": "Zippy the Pinhead",
}
VALIDATION_PER_MILLE = 50
HELDOUT_BYTES = 8000


def log(*args):
    print(*args, flush=True)


# ---------------------------------------------------------------------------------------------
# Corpus


def clean_fortune(text):
    text = re.sub(r".\x08", "", text)  # overstrike: "_\bX" underlines X, "X\bX" bolds it
    text = unicodedata.normalize("NFC", text)
    text = "".join(c for c in text if c in "\n\t" or unicodedata.category(c)[0] != "C")
    lines = [line.rstrip() for line in text.split("\n")]
    return "\n".join(lines).strip("\n")


def read_fortunes(corpus_dir):
    """[(topic_file, text)] in file order, duplicates dropped."""
    names = sorted(n for n in os.listdir(corpus_dir)
                   if "." not in n and n not in EXCLUDED_FILES
                   and os.path.isfile(os.path.join(corpus_dir, n)))
    if not names:
        sys.exit(f"no fortune files in {corpus_dir}: apt-get install fortunes")
    seen, fortunes = set(), []
    for name in names:
        with open(os.path.join(corpus_dir, name), "rb") as f:
            raw = f.read().decode("utf-8", errors="replace")
        for chunk in re.split(r"^%[ \t]*$", raw, flags=re.M):
            text = clean_fortune(chunk)
            if not text.strip() or text in seen:
                continue
            seen.add(text)
            fortunes.append((name, text))
    return fortunes


def split_key(text):
    return int(hashlib.sha256(text.encode("utf-8")).hexdigest()[:12], 16)


def split_corpus(fortunes):
    train, val = [], []
    for item in fortunes:
        (val if split_key(item[1]) % 1000 < VALIDATION_PER_MILLE else train).append(item)
    return train, val


def heldout_text(val):
    """The first HELDOUT_BYTES or so of validation fortunes (in hash order), blank-line separated."""
    chosen, size = [], 0
    for _, text in sorted(val, key=lambda item: split_key(item[1])):
        if size >= HELDOUT_BYTES:
            break
        chosen.append(text)
        size += len(text.encode("utf-8")) + 2
    return "\n\n".join(chosen) + "\n"


def chat_document(topic_file, text, rng):
    prompt = rng.choice(CHAT_PROMPTS).format(topic=TOPIC_NAMES.get(topic_file, topic_file))
    return (f"<|im_start|>user\n{prompt}<|im_end|>\n"
            f"<|im_start|>assistant\n{text}<|im_end|>\n")


# ---------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(texts, vocab_size):
    from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                            pre_tokenizers, processors, trainers)
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIALS), min_frequency=2,
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, bos_id)])
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        sys.exit(f"tokenizer has {tok.get_vocab_size(with_added_tokens=True)} entries, "
                 f"wanted {vocab_size}: the corpus ran out of merges")
    return tok


def tokenizer_config(tok):
    added = {}
    for token in SPECIALS:
        added[str(tok.token_to_id(token))] = dict(content=token, lstrip=False, normalized=False,
                                                  rstrip=False, single_word=False, special=True)
    return dict(tokenizer_class="PreTrainedTokenizerFast", bos_token=BOS, eos_token=BOS,
                pad_token=BOS, unk_token=None, add_bos_token=False, add_eos_token=False,
                model_max_length=512, clean_up_tokenization_spaces=False,
                added_tokens_decoder=added, chat_template=CHAT_TEMPLATE)


# ---------------------------------------------------------------------------------------------
# Model


def build_config(args, tok):
    from transformers import Qwen3MoeConfig
    bos = tok.token_to_id(BOS)
    im_end = tok.token_to_id("<|im_end|>")
    return Qwen3MoeConfig(
        vocab_size=tok.get_vocab_size(with_added_tokens=True), hidden_size=args.hidden,
        intermediate_size=2 * args.hidden, moe_intermediate_size=args.expert_width,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=args.seq_len,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0), rms_norm_eps=1e-6,
        tie_word_embeddings=True, initializer_range=0.02, output_router_logits=True,
        router_aux_loss_coef=args.aux_coef, bos_token_id=bos, eos_token_id=[bos, im_end],
        pad_token_id=bos, use_cache=True)


def pick_experts_implementation(model, device, batch):
    """On CUDA try transformers' default (grouped_mm) once; fall back to the eager loop."""
    if device.type != "cuda":
        return getattr(model.config, "_experts_implementation", "default")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return getattr(model.config, "_experts_implementation", "default")
    except Exception as error:  # noqa: BLE001 - any failure means: use the plain loop
        log(f"experts implementation fell back to eager: {type(error).__name__}: {error}")
        model.zero_grad(set_to_none=True)
        if hasattr(model, "set_experts_implementation"):
            model.set_experts_implementation("eager")
        else:
            model.config._experts_implementation = "eager"
        return "eager"


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def evaluate(model, val_ids, args, device):
    """Mean next-token cross-entropy (nats) over consecutive windows of the validation stream,
    and the per-layer expert load over the same tokens."""
    model.eval()
    window = args.seq_len
    total_loss, total_tokens = 0.0, 0
    load = torch.zeros(args.layers, args.experts, dtype=torch.long)
    starts = list(range(0, len(val_ids) - 1, window))
    for i in range(0, len(starts), args.batch_size):
        rows = []
        for s in starts[i:i + args.batch_size]:
            piece = val_ids[s:s + window + 1]
            if len(piece) == window + 1:
                rows.append(piece)
        if not rows:
            continue
        batch = torch.tensor(rows, dtype=torch.long, device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(input_ids=batch[:, :-1], output_router_logits=True)
        logits = out.logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                                 batch[:, 1:].reshape(-1), reduction="sum")
        total_loss += loss.item()
        total_tokens += batch[:, 1:].numel()
        for layer, router_logits in enumerate(out.router_logits):
            ids = router_logits.float().topk(args.top_k, dim=-1).indices.reshape(-1).cpu()
            load[layer] += torch.bincount(ids, minlength=args.experts)
    model.train()
    return total_loss / max(1, total_tokens), load


def load_summary(load):
    """Per layer: max/mean of the expert counts, and the least-used expert's share of the mean."""
    mean = load.float().mean(dim=1)
    return [dict(max_over_mean=round((load[l].max() / mean[l]).item(), 3),
                 min_over_mean=round((load[l].min() / mean[l]).item(), 3))
            for l in range(load.size(0))]


@torch.no_grad()
def sample_text(model, tok, device, prompt, max_new_tokens=60, chat=False):
    if chat:
        text = f"{BOS}<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
        ids = tok.encode(text, add_special_tokens=False).ids
    else:
        ids = tok.encode(prompt).ids
    model.eval()
    out = model.generate(torch.tensor([ids], device=device), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=model.config.eos_token_id,
                         pad_token_id=model.config.pad_token_id)
    model.train()
    return tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--corpus-dir", default=CORPUS_DIR)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", default="auto", help="auto, cuda or cpu")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-width", type=int, default=128)
    p.add_argument("--aux-coef", type=float, default=0.01, help="router_aux_loss_coef")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--chat-fraction", type=float, default=0.3)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--max-seconds", type=float, default=0, help="safety stop (0 = none)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch's choice)")
    p.add_argument("--max-shard-size", default="50GB",
                   help="save_pretrained's shard size (smaller to move the files in pieces)")
    args = p.parse_args()

    started = time.time()
    import tokenizers
    import transformers
    from transformers import Qwen3MoeForCausalLM

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    hardware = (torch.cuda.get_device_name(device) if device.type == "cuda"
                else f"CPU, {torch.get_num_threads()} threads")
    log(f"train_demo: torch {torch.__version__}, transformers {transformers.__version__}, "
        f"tokenizers {tokenizers.__version__}, device {hardware}")
    log("args: " + json.dumps(vars(args), sort_keys=True))
    os.makedirs(args.out, exist_ok=True)

    # Corpus and split.
    fortunes = read_fortunes(args.corpus_dir)
    train, val = split_corpus(fortunes)
    log(f"corpus: {len(fortunes)} fortunes, {sum(len(t) for _, t in fortunes)} characters; "
        f"train {len(train)}, validation {len(val)}")
    with open(os.path.join(args.out, "heldout.txt"), "w", encoding="utf-8") as f:
        f.write(heldout_text(val))

    rng = random.Random(args.seed)
    documents = [text for _, text in train]
    documents += [chat_document(name, text, rng) for name, text in train
                  if rng.random() < args.chat_fraction]
    rng.shuffle(documents)

    # Tokenizer.
    tok = train_tokenizer((re.sub(r"<\|im_(?:start|end)\|>", "", d) for d in documents),
                          args.vocab_size)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(tok), f, indent=2)
    bos_id = tok.token_to_id(BOS)
    train_ids = []
    for encoding in tok.encode_batch(documents, add_special_tokens=False):
        train_ids.append(bos_id)
        train_ids.extend(encoding.ids)
    val_ids = []
    for encoding in tok.encode_batch([t for _, t in val], add_special_tokens=False):
        val_ids.append(bos_id)
        val_ids.extend(encoding.ids)
    log(f"tokens: train {len(train_ids)} ({len(documents)} documents, "
        f"{sum(len(d) for d in documents) / max(1, len(train_ids) - len(documents)):.2f} "
        f"characters per token), validation {len(val_ids)}")

    # Model.
    config = build_config(args, tok)
    model = Qwen3MoeForCausalLM(config).to(device)
    model.train()
    num_params = sum(p.numel() for p in model.parameters())
    log(f"model: {num_params / 1e6:.2f} M parameters, {config.num_hidden_layers} layers, "
        f"{config.num_experts} experts top-{config.num_experts_per_tok}")

    data = torch.tensor(train_ids, dtype=torch.long)
    generator = torch.Generator().manual_seed(args.seed)

    def next_batch():
        starts = torch.randint(0, len(data) - args.seq_len - 1, (args.batch_size,),
                               generator=generator)
        rows = torch.stack([data[s:s + args.seq_len + 1] for s in starts.tolist()])
        return rows.to(device)

    impl = pick_experts_implementation(model, device, next_batch()[:2])
    log(f"experts implementation: {impl}")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([dict(params=decay, weight_decay=args.weight_decay),
                                   dict(params=no_decay, weight_decay=0.0)],
                                  lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    best = dict(loss=float("inf"), step=-1, state=None, load=None)
    train_started = time.time()
    stopped_early = False
    step = 0
    for step in range(1, args.steps + 1):
        lr = lr_at(step - 1, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = next_batch()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(input_ids=batch[:, :-1], labels=None, output_router_logits=True)
            logits = out.logits.float()
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                                   batch[:, 1:].reshape(-1))
            loss = ce + args.aux_coef * out.aux_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        out_of_time = args.max_seconds and time.time() - started > args.max_seconds
        if step % args.eval_every == 0 or step == args.steps or out_of_time:
            val_loss, load = evaluate(model, val_ids, args, device)
            elapsed = time.time() - train_started
            marker = ""
            if val_loss < best["loss"]:
                best = dict(loss=val_loss, step=step, load=load,
                            state={k: v.detach().to("cpu", copy=True)
                                   for k, v in model.state_dict().items()})
                marker = " *"
            log(f"step {step:5d}  lr {lr:.2e}  train {ce.item():.4f}  aux "
                f"{out.aux_loss.item():.3f}  val {val_loss:.4f}  "
                f"({elapsed:.0f} s, {step / elapsed:.1f} steps/s){marker}")
        if out_of_time:
            log(f"stopped early by --max-seconds {args.max_seconds:g} at step {step}")
            stopped_early = True
            break
    train_seconds = time.time() - train_started

    model.load_state_dict(best["state"])
    model.eval()
    tokens_seen = step * args.batch_size * args.seq_len
    log(f"best validation loss {best['loss']:.4f} at step {best['step']} "
        f"({tokens_seen / len(train_ids):.1f} epochs run, {train_seconds:.0f} s training)")
    log("validation expert load per layer: " + json.dumps(load_summary(best["load"])))
    for prompt in ["The computer", "Love is", "A man walks into a bar", "Q:"]:
        log(f"sample [{prompt}] -> {sample_text(model, tok, device, prompt)!r}")
    for prompt in ["Tell me something about science.", "Tell me a fortune."]:
        log(f"chat [{prompt}] -> {sample_text(model, tok, device, prompt, chat=True)!r}")

    # Save in bfloat16, as transformers lays it out; output_router_logits is a training switch.
    model.config.output_router_logits = False
    model.to(torch.bfloat16).save_pretrained(args.out, max_shard_size=args.max_shard_size)
    gen_cfg = os.path.join(args.out, "generation_config.json")
    if os.path.exists(gen_cfg):
        os.remove(gen_cfg)
    summary = dict(validation_loss=round(best["loss"], 4), best_step=best["step"],
                   steps_run=step, stopped_early=stopped_early, parameters=num_params,
                   train_tokens=len(train_ids), validation_tokens=len(val_ids),
                   train_seconds=round(train_seconds), total_seconds=round(time.time() - started),
                   hardware=hardware, torch=torch.__version__,
                   transformers=transformers.__version__, tokenizers=tokenizers.__version__)
    log("summary: " + json.dumps(summary))
    log(f"final validation loss {best['loss']:.4f}")


if __name__ == "__main__":
    main()
