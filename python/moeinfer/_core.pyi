"""Type stubs of moeinfer._core, the compiled engine (src/python/module.cpp). Use the package's
Python API (moeinfer.LLM, moeinfer.serve, moeinfer.plan, ...) rather than these directly."""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import numpy.typing as npt

__version__: str
built_with_cuda: bool

class EngineError(RuntimeError):
    """An error of the engine, with its message (a bad model folder, a refused request, ...)."""

class UsageError(EngineError):
    """A bad command line (an unknown option, a refused combination of options)."""

class GenerationParams:
    """One request's sampling and stopping parameters, checked (made by make_params)."""

def make_params(
    *,
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float,
    repetition_penalty: float,
    presence_penalty: float,
    frequency_penalty: float,
    seed: Optional[int],
    max_tokens: int,
    stop: List[str],
    stop_token_ids: List[int],
    ignore_eos: bool,
    include_stop_str_in_output: bool,
    skip_special_tokens: bool,
    logprobs: Optional[int],
    prompt_logprobs: Optional[int],
    n: int,
    logit_bias: List[Tuple[int, float]],
) -> GenerationParams:
    """Raises ValueError with the engine's message for a value out of range."""

# generate()/chat() results: per request {"prompt_token_ids": [T] ids, "prompt_logprobs":
# [(token, logprob, rank, [(token, logprob), ...])] (T - 1 entries, or empty),
# "num_cached_tokens": int, "outputs": [{"index", "text", "token_ids", "logprobs" (as
# prompt_logprobs, one per token), "cumulative_logprob", "finish_reason" ("stop", "length",
# "abort" or None), "tool_calls" (chat with tools: {"content", "tool_calls"}; else None)}]}.
_Result = Dict[str, Any]

class EngineOptions:
    """LLM(...)'s engine arguments, by the engine's names (moeinfer.LLM documents each)."""

    device: str
    dtype: str
    gpu_memory_fraction: float
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_mb: int
    kv_dtype: str
    block_size: int
    enable_prefix_caching: bool
    enforce_eager: bool
    expert_budget: str
    expert_cache: str
    cold_experts: str
    deterministic: bool
    generation_config: str
    profile_stages: bool
    profile_time_every: int
    tool_call_parser: str
    ep: int
    placement: str
    overlap: bool
    dispatch_dtype: str
    micro_batches: int
    active_experts: int
    renorm: str
    drop_below: float
    expert_capacity: float
    overflow: str
    router_temperature: float
    def __init__(self) -> None: ...

class Engine:
    """One engine over one checkpoint, with its chat template (use moeinfer.LLM)."""

    @staticmethod
    def load(model: str, options: EngineOptions) -> Engine:
        """With options.ep > 1 this process must be one of ep MPI ranks (mpirun -np ep)."""
    @property
    def rank(self) -> int:
        """This process's rank under ep > 1 (0 otherwise)."""
    @property
    def num_ranks(self) -> int:
        """The expert-parallel job's ranks (1 without ep)."""
    def follow_rank_zero(self) -> None:
        """Ranks > 0: steps with rank 0 until rank 0 closes its engine."""
    def close(self) -> None:
        """Rank 0 under ep > 1: the job's last round (the other ranks return); idempotent."""
    @property
    def vocab_size(self) -> int:
        """V: the width of a logits row."""
    @property
    def max_model_len(self) -> int:
        """Context length in tokens."""
    @property
    def model_type(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def tool_call_parser(self) -> str:
        """The tool-call format chat outputs are read in ("none" for none)."""
    @property
    def has_chat_template(self) -> bool: ...
    def generation_defaults(self) -> Dict[str, Any]:
        """generation_config.json's sampling defaults, by SamplingParams field."""
    def encode(self, text: str, add_special_tokens: bool) -> List[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str: ...
    def token_text(self, id: int) -> str:
        """One token's text alone (U+FFFD for a part of a character)."""
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: Sequence[GenerationParams]) -> List[_Result]:
        """Every prompt as a request of the engine's continuous batching, run to its end. The
        GIL is released while the engine steps; Ctrl-C aborts the requests and raises."""
    def chat(self, conversations: Sequence[str], params: Sequence[GenerationParams], tools: str,
             tool_choice: str, add_generation_prompt: bool,
             chat_template_kwargs: str) -> List[_Result]:
        """As generate, for conversations (JSON text) rendered by the chat template; tools,
        tool_choice and chat_template_kwargs are JSON text ("null" for none)."""
    def score(self, ids: Sequence[int]) -> npt.NDArray[np.float32]:
        """Logits [n, V] of every position of ids, written by the engine into the array's own
        memory."""
    def stats(self) -> Dict[str, Any]:
        """The engine's counters (moeinfer.LLM.stats documents the keys)."""
    def trace_routing(self, path: str) -> None:
        """Records every later forward's routing to a trace file ("": stop and close)."""

def main(argv: Sequence[str]) -> int:
    """The moeinfer command line (argv[0]: the program's name); returns the exit status."""

def run_command(args: Sequence[str]) -> None:
    """One moeinfer subcommand; raises EngineError or UsageError with its message."""

def plan(model: str, gpus: int, gpu_mem_gib: float, dtype: str, kv_dtype: str, max_seq_len: int,
         gpu_memory_fraction: float) -> str:
    """`moeinfer plan --json` as JSON text."""

def expert_load(model: str, text: str, draws: int, seed: int,
                chunk_tokens: int) -> Tuple[str, npt.NDArray[np.int64]]:
    """(`moeinfer expert-load --json` without the layers' counts, counts [layers, E])."""

def rank_rows(counts: npt.NDArray[np.int64], layers: Sequence[int], ranks: int,
              placement: str) -> npt.NDArray[np.float64]:
    """Rows each rank's experts compute per layer [L, ranks] for counts [L, E] ("" placement:
    contiguous ranges)."""

def read_routing_trace(path: str) -> Dict[str, Any]:
    """A routing trace's records as arrays (moeinfer.read_routing_trace documents them)."""

def summarize_routing_trace(path: str, pairs: int) -> str:
    """`moeinfer trace summarize --json` as JSON text."""
