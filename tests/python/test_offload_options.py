"""LLM(expert_budget=, expert_cache=, cold_experts=, expert_prefetch=): the expert cache's
options of the command line. On the CPU the budget is simulated with the same cache, prefetch
and cost-model code, so every combination gives the resident logits, and each bad value is
refused by name."""

import numpy as np
import pytest

import moeinfer

from conftest import DEMO

IDS = [1, 7, 42, 3, 99, 5, 12, 8, 17, 4, 250, 6]


@pytest.mark.parametrize("options", [
    dict(expert_budget="25%"),
    dict(expert_budget="25%", expert_prefetch=False),
    dict(expert_budget="25%", expert_prefetch=True, cold_experts="auto"),
    dict(expert_budget="10%", expert_prefetch="auto", expert_cache="lfu"),
    dict(expert_budget="50%", expert_prefetch="off", cold_experts="cpu"),
])
def test_every_budget_and_prefetch_mode_keeps_the_logits(options):
    with moeinfer.LLM(DEMO) as llm:
        resident = llm.logits(IDS)
    with moeinfer.LLM(DEMO, **options) as llm:
        np.testing.assert_array_equal(llm.logits(IDS), resident)


def test_prefetch_refusals_name_the_option():
    with pytest.raises(moeinfer.EngineError, match="--expert-prefetch 'sometimes'"):
        moeinfer.LLM(DEMO, expert_budget="25%", expert_prefetch="sometimes")
    with pytest.raises(moeinfer.EngineError, match="needs --expert-budget"):
        moeinfer.LLM(DEMO, expert_prefetch=False)
    with pytest.raises(TypeError, match="expert_prefetch must be a bool or 'auto'"):
        moeinfer.LLM(DEMO, expert_budget="25%", expert_prefetch=1)
