"""Sampling parameters, as vLLM's ``SamplingParams`` takes them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Union

from . import _core


@dataclass
class SamplingParams:
    """How one request samples and when it stops (vLLM's fields and defaults).

    The engine checks every value when the object is made: a value out of range raises
    ``ValueError`` with the engine's message.

    Attributes:
        n: sequences generated from the prompt (returned as ``outputs[0..n-1]``); with a seed,
            sequence i draws from ``seed + i``.
        temperature: softmax temperature; 0 is greedy (the most likely token every step).
        top_p: nucleus sampling: keep the most likely tokens whose probabilities sum to top_p
            (1: all).
        top_k: keep the k most likely tokens (0 or -1: all).
        min_p: drop tokens below min_p times the most likely token's probability.
        repetition_penalty: > 1 discourages tokens of the prompt and the output (1: none).
        presence_penalty: subtracted once from the logit of every token already in the output.
        frequency_penalty: subtracted from a token's logit per occurrence in the output.
        seed: random seed of the request; None: the engine draws one.
        max_tokens: most tokens to generate (0 only with prompt_logprobs: score the prompt).
        stop: strings that end generation; the text ends before the first match.
        stop_token_ids: token ids that end generation, besides the model's end-of-sequence ids.
        ignore_eos: keep generating past end-of-sequence tokens.
        logprobs: None for none; k for each generated token's log-probability (natural log,
            under the model's raw distribution) and the k most likely alternatives (k <= 20).
        prompt_logprobs: None for none; k for every prompt token's log-probability given the
            tokens before it, and k alternatives.
        skip_special_tokens: leave special tokens out of the text.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        logit_bias: {token id: bias in [-100, 100]} added to the logits before sampling.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Optional[Dict[int, float]] = None

    def __post_init__(self) -> None:
        # Checked now, as vLLM checks; built again at each use, so that a field changed after
        # construction counts (and is checked then).
        self._build(self.max_tokens if self.max_tokens is not None else 16)

    def _build(self, max_tokens: int) -> "_core.GenerationParams":
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        top_k = 0 if self.top_k == -1 else self.top_k  # vLLM's older "all"
        return _core.make_params(
            temperature=float(self.temperature),
            top_p=float(self.top_p),
            top_k=int(top_k),
            min_p=float(self.min_p),
            repetition_penalty=float(self.repetition_penalty),
            presence_penalty=float(self.presence_penalty),
            frequency_penalty=float(self.frequency_penalty),
            seed=None if self.seed is None else int(self.seed),
            max_tokens=int(max_tokens),
            stop=stop,
            stop_token_ids=[int(t) for t in (self.stop_token_ids or [])],
            ignore_eos=bool(self.ignore_eos),
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            skip_special_tokens=bool(self.skip_special_tokens),
            logprobs=None if self.logprobs is None else int(self.logprobs),
            prompt_logprobs=None if self.prompt_logprobs is None else int(self.prompt_logprobs),
            n=int(self.n),
            logit_bias=[(int(t), float(b)) for t, b in (self.logit_bias or {}).items()],
        )

    def _for_prompt(self, num_prompt_tokens: int, max_model_len: int) -> "_core.GenerationParams":
        """The engine's parameters; max_tokens None means the rest of the context (vLLM)."""
        if self.max_tokens is not None:
            return self._build(self.max_tokens)
        return self._build(max(1, max_model_len - num_prompt_tokens))
