"""No leak over 1,000 generate calls: the process's resident memory stays bounded."""

import os

import moeinfer

from conftest import FIXTURES


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_rss_bounded_over_1000_generate_calls():
    llm = moeinfer.LLM(FIXTURES / "qwen3_moe_f32", max_num_seqs=4)
    params = moeinfer.SamplingParams(temperature=0.7, seed=1, max_tokens=4, logprobs=2,
                                     ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 17, 42, 99, 3]}

    def call(i):
        out = llm.generate([prompt, "the"], params)
        assert len(out[0].outputs[0].token_ids) == 4
        # [32, V] float32: 64 KiB per call, which the engine writes and NumPy frees.
        assert llm.logits(list(range(1, 33))).shape == (32, llm.vocab_size)

    for i in range(100):  # warm-up: allocator pools, the engine's buffers
        call(i)
    before = rss_bytes()
    for i in range(1000):
        call(i)
    grown = rss_bytes() - before
    # Leaking one logits array (64 KiB) per call would add 64 MB, one engine request (its token
    # list and its sampler's [V] buffers) or one result (text, ids, logprob dicts) per call some
    # MB; the bound leaves room for the allocator's own fluctuation.
    assert grown < 16 * 1024 * 1024, f"RSS grew by {grown / 1e6:.1f} MB over 1000 calls"
    stats = llm.stats()
    assert stats["num_running"] == 0 and stats["kv"]["num_used"] == 0


def test_no_python_objects_left_behind_over_1000_generate_calls():
    """What RSS cannot see at this size: a reference the bindings keep per call. tracemalloc
    counts the bytes of live Python objects, which a leaked result (its dicts, lists, ints and
    strings: about 1 KB) would add 1,000 times."""
    import gc
    import tracemalloc

    llm = moeinfer.LLM(FIXTURES / "qwen3_moe_f32", max_num_seqs=4)
    params = moeinfer.SamplingParams(temperature=0.7, seed=1, max_tokens=4, logprobs=2,
                                     ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 17, 42, 99, 3]}
    for _ in range(50):
        llm.generate([prompt, "the"], params)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(1000):
            llm.generate([prompt, "the"], params)
            llm.logits([5, 17, 42])
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 100 * 1024, f"live Python objects grew by {grown} bytes over 1000 calls"
