"""``LLM``: offline inference over the engine's continuous batching, as vLLM's ``LLM``."""

from __future__ import annotations

import atexit
import json
import os
import weakref
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Union

import numpy as np

from . import _core
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import SamplingParams

# A prompt: text, {"prompt": text}, or {"prompt_token_ids": [ids]} (vLLM's TextPrompt and
# TokensPrompt).
PromptType = Union[str, Mapping[str, Any]]
Message = Mapping[str, Any]


class LLM:
    """An engine over one Hugging Face checkpoint folder, for offline inference.

    Every prompt of a ``generate`` or ``chat`` call is one request of the same
    continuous-batching engine the server runs (``Engine::step``): all are queued at once and
    share each step's batch. Ctrl-C during a call aborts its requests (their KV blocks are
    freed) and raises ``KeyboardInterrupt``; the LLM stays usable.

    Args:
        model: checkpoint folder (config.json, *.safetensors, tokenizer.json).
        device: "cpu" or "cuda" (the GPU build: ``moeinfer.built_with_cuda``).
        dtype: "auto" or "bfloat16": how a float32/float16 checkpoint's weights are held on
            cuda (the CPU computes with the checkpoint's weights as stored).
        weights: None (the checkpoint's), "fp8", "int4" or "bf16": the routed experts' gate,
            up and down matrices quantised at load, as ``moeinfer ... --weights`` (attention,
            router, shared experts and dense layers unchanged unless weights_scope="linear"). On the CPU the quantised values
            are computed in bf16/f32 (the format's numerics, not its memory saving); on cuda
            "fp8" and "int4" hold the codes and scales ("bf16" is dtype="bfloat16" there).
        weights_scope: "experts" (default) or "linear": with weights "fp8" or "int4", "linear"
            quantises every Linear weight but the embeddings, LM head, norms and routers too
            (attention, shared experts, dense layers), as ``--weights-scope linear``.
        gpu_memory_utilization: cuda: share of the GPU's memory for weights, workspace and KV.
        max_model_len: context length in tokens (None: the model's own).
        max_num_seqs: requests in the running batch at most.
        max_num_batched_tokens: tokens per engine step (prefill chunks and decodes).
        kv_cache_mb: KV cache size in MiB (0: room for max_num_seqs full-length requests, at
            most 4 GiB, on cpu; what gpu_memory_utilization leaves on cuda).
        kv_dtype: how the KV cache stores rows, as ``--kv-dtype``: "auto" (the device's own:
            float32 on cpu, bf16 on cuda), "f32" (cpu only), "bf16" or "fp8" (e4m3 with a
            scale per head, or per MLA latent and rope key, on either device: about four
            times the tokens of f32, twice those of bf16, in the same bytes).
        block_size: tokens per KV block.
        enable_prefix_caching: reuse the KV blocks of repeated prompt prefixes.
        enforce_eager: cuda: no CUDA graphs for decode steps.
        expert_budget: expert offloading: bytes of routed experts kept resident ("24GiB",
            "800MB", "1000000") or a share of them ("25%"); None: all resident. Outputs do not
            change.
        expert_cache: with expert_budget: "lfu" (the default), "lru", or "static:FILE" (a
            routing trace's busiest experts stay resident); "lfu:FILE" / "lru:FILE" warm the
            cache up.
        cold_experts: with expert_budget: "gpu", "cpu" or "auto" (where a missing expert
            computes).
        expert_prefetch: with expert_budget: True predicts the next layer's experts and copies
            the missing ones early; False copies each miss when its layer asks; "auto" (the
            default) prefetches a layer while at least half of its prefetches are used.
        ep: expert parallelism over N CPU ranks: run the script as ``mpirun -np N python
            SCRIPT``, every rank making the same ``LLM(..., ep=N)``. Rank 0's LLM is the one to
            use: it spreads the requests of ``generate`` and ``chat`` over the ranks' engines
            (attention data-parallel, the routed experts sharded); on the other ranks
            ``LLM(...)`` steps with rank 0 until rank 0's LLM closes (``close()``, or at exit),
            then ends the process (``SystemExit(0)``), so the rest of the script runs on rank 0
            only. ``logits`` and ``trace_routing`` are not available under ep > 1.
        placement: with ep: a placement file of ``moeinfer placement`` (which ranks hold which
            experts, replicas allowed); None: contiguous ranges.
        overlap: with ep: compute the shared experts while a layer's rows travel to their ranks.
        dispatch_dtype: with ep: how the rows sent to the experts' ranks are encoded, "f32",
            "bf16" or "fp8" (e4m3 with a scale per row), as ``--dispatch-dtype``.
        micro_batches: with ep: 2 splits each rank's step into two micro-batches that alternate
            per MoE layer, so one's rows travel while the other computes (``--micro-batches``).
        active_experts, renorm, drop_below, expert_capacity, overflow, router_temperature: the
            routing approximations of ``--active-experts K'`` (with ``renorm`` "kept" or
            "full"), ``--drop-below W``, ``--expert-capacity F`` (with ``overflow`` "drop" or
            "reroute"; not on cuda) and ``--router-temperature T``; None: off. They change what
            the model computes (``moeinfer eval`` measures how much).
        deterministic: batch-invariant kernels: a seeded request's text does not depend on
            what else runs.
        generation_config: sampling defaults for ``get_default_sampling_params``: "auto" (the
            checkpoint's generation_config.json), "vllm" (none) or a folder holding one.
        profile: time the MoE stages and count each expert's rows on every step (``stats()``).
        profile_time_every: with profile: time the stages of one step in N (0: every step on
            cpu, one in 16 on cuda).
        tool_call_parser: how ``chat`` outputs are read for tool calls: "hermes", "mistral",
            "deepseek_v3" or "none" (None: the model family's format).
        trace_routing: record every MoE layer's routing of every forward pass to this file (the
            format of ``moeinfer generate --trace-routing``; ``read_routing_trace`` reads it);
            see ``trace_routing()``.
    """

    def __init__(
        self,
        model: Union[str, "os.PathLike[str]"],
        *,
        device: str = "cpu",
        dtype: str = "auto",
        weights: Optional[str] = None,
        weights_scope: str = "experts",
        gpu_memory_utilization: float = 0.9,
        max_model_len: Optional[int] = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        kv_cache_mb: int = 0,
        kv_dtype: str = "auto",
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        enforce_eager: bool = False,
        expert_budget: Optional[Union[str, int]] = None,
        expert_cache: Optional[str] = None,
        cold_experts: Optional[str] = None,
        expert_prefetch: Optional[Union[bool, str]] = None,
        ep: int = 1,
        placement: Optional[Union[str, "os.PathLike[str]"]] = None,
        overlap: bool = True,
        dispatch_dtype: str = "f32",
        micro_batches: int = 1,
        active_experts: Optional[int] = None,
        renorm: Optional[str] = None,
        drop_below: Optional[float] = None,
        expert_capacity: Optional[float] = None,
        overflow: Optional[str] = None,
        router_temperature: Optional[float] = None,
        deterministic: bool = False,
        generation_config: str = "auto",
        profile: bool = False,
        profile_time_every: int = 0,
        tool_call_parser: Optional[str] = None,
        trace_routing: Optional[Union[str, "os.PathLike[str]"]] = None,
    ) -> None:
        options = _core.EngineOptions()
        options.device = device
        options.dtype = dtype
        options.weights = weights or ""
        options.weights_scope = weights_scope
        options.gpu_memory_fraction = gpu_memory_utilization
        options.max_model_len = max_model_len or 0
        options.max_num_seqs = max_num_seqs
        options.max_num_batched_tokens = max_num_batched_tokens
        options.kv_cache_mb = kv_cache_mb
        options.kv_dtype = kv_dtype
        options.block_size = block_size
        options.enable_prefix_caching = enable_prefix_caching
        options.enforce_eager = enforce_eager
        options.expert_budget = "" if expert_budget is None else str(expert_budget)
        options.expert_cache = expert_cache or ""
        options.cold_experts = cold_experts or ""
        if isinstance(expert_prefetch, bool):
            options.expert_prefetch = "on" if expert_prefetch else "off"
        elif isinstance(expert_prefetch, str):
            options.expert_prefetch = expert_prefetch  # checked by the engine: on, off or auto
        elif expert_prefetch is not None:
            raise TypeError("expert_prefetch must be a bool or 'auto', not "
                            f"{type(expert_prefetch).__name__}")
        options.deterministic = deterministic
        options.generation_config = generation_config
        options.profile_stages = profile
        options.profile_time_every = profile_time_every
        options.tool_call_parser = tool_call_parser or ""
        options.ep = ep
        options.placement = "" if placement is None else os.fspath(placement)
        options.overlap = overlap
        options.dispatch_dtype = dispatch_dtype
        options.micro_batches = micro_batches
        if active_experts is not None and active_experts < 1:
            raise _core.EngineError(f"active_experts must be at least 1, got {active_experts}")
        options.active_experts = active_experts or 0
        options.renorm = renorm or ""
        options.drop_below = 0.0 if drop_below is None else drop_below
        options.expert_capacity = 0.0 if expert_capacity is None else expert_capacity
        options.overflow = overflow or ""
        options.router_temperature = 1.0 if router_temperature is None else router_temperature
        self._engine = _core.Engine.load(os.fspath(model), options)
        if self._engine.rank > 0:
            # Rank 0 drives every rank's engine; this one steps with it until it closes.
            self._engine.follow_rank_zero()
            raise SystemExit(0)
        if self._engine.num_ranks > 1:
            # The other ranks wait for rank 0's last round, whatever ends this process.
            atexit.register(_close_at_exit, weakref.ref(self))
        self.model = os.fspath(model)
        self._next_request = 0
        if trace_routing is not None:
            self.trace_routing(trace_routing)

    # -- facts ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Rows of the LM head: the width of ``logits``' rows."""
        return self._engine.vocab_size

    @property
    def max_model_len(self) -> int:
        """Context length in tokens (prompt and generated tokens together)."""
        return self._engine.max_model_len

    @property
    def device(self) -> str:
        return self._engine.device

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json defaults (vLLM's)."""
        return SamplingParams(**self._engine.generation_defaults())

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        """Token ids of ``text`` as tokenizers' ``encode(text)`` gives them."""
        return self._engine.encode(text, add_special_tokens)

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``."""
        return self._engine.decode([int(t) for t in token_ids], skip_special_tokens)

    # -- generation ----------------------------------------------------------------------

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
        *,
        prompt_token_ids: Optional[Sequence[Sequence[int]]] = None,
        use_tqdm: bool = False,
    ) -> List[RequestOutput]:
        """Generates a continuation of every prompt, all in the same engine batch.

        Args:
            prompts: a prompt or a list of them: text (tokenised with the tokenizer's special
                tokens, as vLLM does), {"prompt": text} or {"prompt_token_ids": [ids]}.
            sampling_params: one for all prompts or one per prompt; None:
                ``get_default_sampling_params()``.
            prompt_token_ids: prompts as token ids instead (vLLM's older keyword).
            use_tqdm: accepted for vLLM's signature; no progress bar is drawn.

        Returns:
            One RequestOutput per prompt, in the prompts' order.

        Raises:
            EngineError: the engine refused a request (its message says why: an id outside the
                vocabulary, a prompt longer than the context, ...); nothing was queued.
            KeyboardInterrupt: Ctrl-C; every request of the call was aborted.
        """
        del use_tqdm
        if prompt_token_ids is not None:
            items: List[PromptType] = [{"prompt_token_ids": list(ids)} for ids in prompt_token_ids]
        elif isinstance(prompts, (str, Mapping)):
            items = [prompts]
        else:
            items = list(prompts)
        texts: List[Optional[str]] = []
        ids: List[List[int]] = []
        for item in items:
            if isinstance(item, str):
                texts.append(item)
                ids.append(self._engine.encode(item, True))
            elif isinstance(item, Mapping) and "prompt_token_ids" in item:
                texts.append(item.get("prompt"))
                ids.append([int(t) for t in item["prompt_token_ids"]])
            elif isinstance(item, Mapping) and "prompt" in item:
                texts.append(item["prompt"])
                ids.append(self._engine.encode(item["prompt"], True))
            else:
                raise TypeError(
                    "a prompt is text, {'prompt': text} or {'prompt_token_ids': [ids]}, got "
                    f"{type(item).__name__}")
        params = self._params_for(sampling_params, ids)
        results = self._engine.generate(ids, params)
        return [self._request_output(r, text) for r, text in zip(results, texts)]

    def chat(
        self,
        messages: Union[Sequence[Message], Sequence[Sequence[Message]]],
        sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
        *,
        tools: Optional[List[Dict[str, Any]]] = None,
        tool_choice: Optional[Union[str, Dict[str, Any]]] = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Optional[Dict[str, Any]] = None,
        use_tqdm: bool = False,
    ) -> List[RequestOutput]:
        """Generates the assistant's reply to a conversation, or to each of a list of them.

        The conversation is rendered by the checkpoint's chat template (the engine's own Jinja
        renderer, as the server's /v1/chat/completions does) and its end-of-turn token stops
        generation. With ``tools`` the outputs are read for tool calls as the server reads
        them (``CompletionOutput.tool_calls`` and ``.content``).

        Args:
            messages: [{"role", "content", ...}], or a list of such conversations.
            sampling_params: one for all or one per conversation; None:
                ``get_default_sampling_params()``.
            tools: OpenAI's tools ([{"type": "function", "function": {...}}]), shown to the
                template.
            tool_choice: "auto" (the default with tools), "none", "required" or
                {"type": "function", "function": {"name": ...}}; the last two force the
                output into the tools' JSON as the server does.
            add_generation_prompt: end the prompt with the assistant turn's opening.
            chat_template_kwargs: more template variables (e.g. {"enable_thinking": False}).

        Returns:
            One RequestOutput per conversation; ``prompt`` is None (the rendered text is not
            kept), ``prompt_token_ids`` what the template's text encodes to.
        """
        del use_tqdm
        if not messages or isinstance(messages[0], Mapping):
            conversations = [list(messages)]  # type: ignore[list-item]
        else:
            conversations = [list(c) for c in messages]  # type: ignore[arg-type]
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            chosen = [sampling_params or self.get_default_sampling_params()] * len(conversations)
        else:
            chosen = list(sampling_params)
            if len(chosen) != len(conversations):
                raise ValueError(f"{len(conversations)} conversations but {len(chosen)} "
                                 "sampling_params")
        for sp in chosen:
            if sp.max_tokens is None:
                raise ValueError("chat: max_tokens=None (the rest of the context) is not taken "
                                 "by chat yet; give a number")
        results = self._engine.chat(
            [json.dumps(c) for c in conversations],
            [sp._for_prompt(0, self.max_model_len) for sp in chosen],
            json.dumps(tools),
            json.dumps(tool_choice),
            add_generation_prompt,
            json.dumps(chat_template_kwargs or {}),
        )
        return [self._request_output(r, None) for r in results]

    def logits(self, token_ids: Union[Sequence[int], np.ndarray]) -> np.ndarray:
        """The model's logits at every position of ``token_ids``, run as one sequence.

        Args:
            token_ids: [n] token ids.

        Returns:
            float32 array [n, vocab_size]: row i scores the token after token_ids[0..i]
            (before any softmax). The engine writes into the array's own memory (no copy).
        """
        ids = np.asarray(token_ids).reshape(-1).tolist()
        return self._engine.score([int(t) for t in ids])

    def trace_routing(self, path: Optional[Union[str, "os.PathLike[str]"]]) -> None:
        """Records every MoE layer's routing of every later forward pass (generate, chat,
        logits) to the routing-trace file ``path``, one step per engine step (its tokens in
        batch order); None stops and closes the file, which ``read_routing_trace`` and
        ``summarize_routing_trace`` then read. A trace already open is closed first."""
        self._engine.trace_routing("" if path is None else os.fspath(path))

    def stats(self) -> Dict[str, Any]:
        """The engine's counters since it was made.

        Keys: num_steps, prompt_tokens, computed_tokens, generation_tokens, num_preemptions,
        schedule_seconds / forward_seconds / sample_seconds (seconds, summed over steps),
        kv (blocks and prefix-cache counts); with ``profile=True``: stage_seconds and
        estimated_stage_seconds ({stage: seconds} summed over layers and timed steps, and
        scaled to all steps), timed_steps, expert_rows (int64 [num_layers, num_experts]: rows
        each expert received); with ``expert_budget``: expert_cache (counters int64
        [num_layers, 7] named by counter_names, bytes_host_to_device int64 [num_layers],
        stall_seconds float64 [num_layers]); with ep > 1: the counters summed over the ranks,
        and ranks (a dict per rank as rank 0 last heard it: num_running, num_waiting,
        num_queued_tokens, num_assigned (requests sent to it), prompt_tokens,
        generation_tokens, num_preemptions, kv_blocks, kv_used).
        """
        return self._engine.stats()

    def close(self) -> None:
        """Ends the engine's use. Under ep > 1 on rank 0, the other ranks' ``LLM(...)`` return
        and their processes end; calls after it raise. Without ep it is optional (the engine is
        freed with the LLM). Idempotent; also what leaving a ``with LLM(...)`` block does."""
        self._engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- helpers -------------------------------------------------------------------------

    def _params_for(self, sampling_params: Any, ids: List[List[int]]) -> list:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            chosen = [sampling_params] * len(ids)
        else:
            chosen = list(sampling_params)
            if len(chosen) != len(ids):
                raise ValueError(f"{len(ids)} prompts but {len(chosen)} sampling_params")
        return [sp._for_prompt(len(p), self.max_model_len) for sp, p in zip(chosen, ids)]

    def _logprob_dicts(self, entries: list) -> List[Dict[int, Logprob]]:
        out = []
        for token, logprob, rank, top in entries:
            d = {token: Logprob(logprob, rank, self._engine.token_text(token))}
            for i, (alt, alt_logprob) in enumerate(top):
                if alt not in d:
                    d[alt] = Logprob(alt_logprob, i + 1, self._engine.token_text(alt))
            out.append(d)
        return out

    def _request_output(self, result: dict, prompt: Optional[str]) -> RequestOutput:
        request_id = str(self._next_request)
        self._next_request += 1
        outputs = []
        for seq in result["outputs"]:
            logprobs = self._logprob_dicts(seq["logprobs"]) if seq["logprobs"] else None
            keep_cumulative = logprobs is not None or len(result["outputs"]) > 1
            calls = seq["tool_calls"]
            outputs.append(CompletionOutput(
                index=seq["index"],
                text=seq["text"],
                token_ids=seq["token_ids"],
                cumulative_logprob=seq["cumulative_logprob"] if keep_cumulative else None,
                logprobs=logprobs,
                finish_reason=seq["finish_reason"],
                tool_calls=None if calls is None else calls["tool_calls"],
                content=None if calls is None else calls["content"],
            ))
        prompt_logprobs = None
        if result["prompt_logprobs"]:
            prompt_logprobs = [None] + self._logprob_dicts(result["prompt_logprobs"])
        return RequestOutput(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=result["prompt_token_ids"],
            prompt_logprobs=prompt_logprobs,
            outputs=outputs,
            finished=True,
            num_cached_tokens=result["num_cached_tokens"],
        )


def _close_at_exit(ref: "weakref.ReferenceType[LLM]") -> None:
    llm = ref()
    if llm is not None:
        llm.close()
