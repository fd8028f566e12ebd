#!/usr/bin/env python3
"""Writes tests/fixtures/demo_reference.json: what transformers computes with the shipped demo
model (models/demo), for tests/model/demo_model_test.cpp to hold the engine to.

The checkpoint is read as stored (bfloat16) and evaluated in float32 on those weights, which is
what the engine does apart from rounding activations to bf16 inside bf16 matrix products; hence
the relative bound of 2e-2 rather than float32's 1e-4.

  prompt, prompt_ids       an English prompt and its ids from the model's own tokenizer
                           (transformers' encode, BOS included by the tokenizer's post-processor)
  greedy_ids               16 greedy tokens after the prompt (KV cache on, end-of-sequence ignored)
  greedy_min_top2_margin   the smallest gap between the best and second-best logit on that path;
                           prompts are tried in order until it is at least 2e-2, so that rounding
                           alone cannot flip a token
  logits                   the first NUM_ROWS rows [NUM_ROWS, V] of one forward pass over the prompt

Run where torch and transformers are installed:  python3 tools/make_demo_reference.py
"""
import argparse
import json
import os

import torch
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NUM_GREEDY = 16
NUM_ROWS = 3
MAX_REL_ERROR = 2e-2
PROMPTS = [
    "The computer is",
    "A man walks into a bar and",
    "Love is",
    "Q:\tWhat do you get when you cross",
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=os.path.join(ROOT, "models", "demo"))
    parser.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures",
                                                      "demo_reference.json"))
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model,
                                                              dtype=torch.float32).eval()
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        n = ids.shape[1]
        with torch.no_grad():
            logits = model(ids).logits[0]
            out = model.generate(ids, max_new_tokens=NUM_GREEDY, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, use_cache=True)
            path = model(out).logits[0, n - 1:-1]
        top = torch.topk(path, 2, dim=-1).values
        margin = (top[:, 0] - top[:, 1]).min().item()
        if margin >= MAX_REL_ERROR:
            break
    else:
        raise SystemExit(f"no prompt with a top-2 margin of {MAX_REL_ERROR}")

    greedy = out[0, n:].tolist()
    reference = dict(
        model="models/demo", prompt=prompt, prompt_ids=ids[0].tolist(), greedy_ids=greedy,
        greedy_text=tokenizer.decode(greedy), greedy_min_top2_margin=round(margin, 4),
        max_rel_error=MAX_REL_ERROR, num_logit_rows=NUM_ROWS,
        logits=[[round(v, 4) for v in row] for row in logits[:NUM_ROWS].tolist()],
        transformers_version=transformers.__version__, torch_version=torch.__version__)
    with open(args.out, "w") as f:
        json.dump(reference, f, separators=(",", ":"))
        f.write("\n")
    print(f"{os.path.relpath(args.out, ROOT)}: prompt {prompt!r} ({n} ids), margin {margin:.4f}, "
          f"greedy {tokenizer.decode(greedy)!r}")


if __name__ == "__main__":
    main()
