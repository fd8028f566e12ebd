"""moeinfer: a C++20/CUDA inference engine for Mixture-of-Experts models, from Python.

    >>> from moeinfer import LLM, SamplingParams
    >>> llm = LLM("models/demo")
    >>> out = llm.generate(["The meaning of life is"], SamplingParams(temperature=0, max_tokens=16))
    >>> out[0].outputs[0].text

``LLM`` is vLLM's offline API over the engine's continuous batching; ``serve`` runs the
OpenAI-compatible server; ``plan``, ``expert_load`` (with ``rank_rows``), ``read_routing_trace``,
``summarize_routing_trace`` and ``profile`` return the engine's reports as dicts and NumPy
arrays. Errors of the engine raise ``EngineError`` (a ``RuntimeError``) with its message.
"""

from ._core import EngineError, UsageError, __version__, built_with_cuda
from .cli import main, run, serve
from .llm import LLM
from .outputs import CompletionOutput, Logprob, RequestOutput
from .reports import (expert_load, plan, profile, rank_rows, read_routing_trace,
                      summarize_routing_trace)
from .sampling_params import SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "EngineError",
    "UsageError",
    "serve",
    "plan",
    "expert_load",
    "rank_rows",
    "read_routing_trace",
    "summarize_routing_trace",
    "profile",
    "run",
    "main",
    "built_with_cuda",
    "__version__",
]
