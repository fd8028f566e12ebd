"""What ``LLM.generate`` and ``LLM.chat`` return: vLLM's ``RequestOutput`` shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional


@dataclass
class Logprob:
    """One token's log-probability (natural log, under the model's raw distribution).

    Attributes:
        logprob: log-probability, <= 0.
        rank: 1 + the number of tokens strictly more likely.
        decoded_token: the token's text alone (U+FFFD for a part of a character).
    """

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# Per position: {token id: Logprob}, the chosen token and the most likely alternatives.
SampleLogprobs = List[Dict[int, Logprob]]
# Per prompt position: None for the first token (nothing predicts it), then as above.
PromptLogprobs = List[Optional[Dict[int, Logprob]]]


@dataclass
class CompletionOutput:
    """One generated sequence.

    Attributes:
        index: the sequence's number within its request, 0..n-1.
        text: the generated text (stop strings excluded unless include_stop_str_in_output).
        token_ids: the generated token ids, [num_generated] (a stop token included).
        cumulative_logprob: sum of the generated tokens' log-probabilities; None unless
            logprobs or n > 1 were asked for.
        logprobs: per generated token {id: Logprob}; None unless asked for.
        finish_reason: "stop" (end-of-sequence, a stop token or string), "length" (max_tokens
            or the context's end) or "abort".
        tool_calls: ``chat`` with tools: the calls read from the text by the model family's
            tool-call format, as OpenAI's ``message.tool_calls`` ({"id", "type": "function",
            "function": {"name", "arguments"}}); [] when the text holds none; None when the
            output was not read for calls (no tools, or the family has no format).
        content: ``chat`` with tools: the text without the calls' markup (None when nothing is
            left); None when the output was not read for calls.
    """

    index: int
    text: str
    token_ids: List[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[SampleLogprobs]
    finish_reason: Optional[str] = None
    tool_calls: Optional[List[Dict[str, Any]]] = None
    content: Optional[str] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's result.

    Attributes:
        request_id: the request's id within this LLM ("0", "1", ...).
        prompt: the prompt text (for chat, the rendered conversation); None for a prompt given
            as token ids.
        prompt_token_ids: the prompt's token ids, [num_prompt_tokens].
        prompt_logprobs: with SamplingParams.prompt_logprobs: None for the first token, then
            {id: Logprob} per prompt token; else None.
        outputs: the n sequences, by index.
        finished: always True (generate returns finished requests).
        num_cached_tokens: prompt tokens whose KV came from the prefix cache.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    prompt_logprobs: Optional[PromptLogprobs]
    outputs: List[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
