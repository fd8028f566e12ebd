"""LLM(active_experts=, renorm=, drop_below=, expert_capacity=, overflow=,
router_temperature=): the routing approximations of the command line, the same logits as
`moeinfer logits` with the same flags, nothing when they keep every expert, and each bad value
refused by name."""

import subprocess

import numpy as np
import pytest

import moeinfer

from conftest import DEMO, FIXTURES

IDS = [1, 7, 42, 3, 99, 5, 12, 8]


def cli_logits(cli, tmp_path, model, *flags):
    out = tmp_path / "logits.npy"
    r = subprocess.run([str(cli), "logits", "--model", str(model), "--ids",
                        ",".join(map(str, IDS)), "--out", str(out), *flags],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return np.load(out)


@pytest.mark.parametrize("options,flags", [
    (dict(active_experts=1), ["--active-experts", "1"]),
    (dict(active_experts=1, renorm="full"), ["--active-experts", "1", "--renorm", "full"]),
    (dict(drop_below=0.3), ["--drop-below", "0.3"]),
    (dict(expert_capacity=1.0, overflow="reroute"),
     ["--expert-capacity", "1", "--overflow", "reroute"]),
    (dict(router_temperature=2.5), ["--router-temperature", "2.5"]),
])
def test_logits_equal_the_cli(cli, tmp_path, options, flags):
    with moeinfer.LLM(DEMO, **options) as llm:
        got = llm.logits(IDS)
    np.testing.assert_array_equal(got, cli_logits(cli, tmp_path, DEMO, *flags))


def test_each_approximation_changes_the_logits_and_keeping_all_does_not():
    with moeinfer.LLM(DEMO) as llm:
        plain = llm.logits(IDS)
    k = 2  # the demo model's experts per token
    with moeinfer.LLM(DEMO, active_experts=k) as llm:
        np.testing.assert_array_equal(llm.logits(IDS), plain)
    for options in [dict(active_experts=1), dict(router_temperature=0.5), dict(drop_below=0.4)]:
        with moeinfer.LLM(DEMO, **options) as llm:
            assert np.abs(llm.logits(IDS) - plain).max() > 1e-3, options


def test_refusals_name_the_option(tmp_path):
    cases = [
        (dict(active_experts=0), "active_experts must be at least 1"),
        (dict(active_experts=9), "--active-experts 9 exceeds the model's 2 experts per token"),
        (dict(renorm="full"), "renorm='full' needs active_experts"),
        (dict(active_experts=1, renorm="some"), "renorm must be 'kept' or 'full'"),
        (dict(overflow="reroute"), "overflow='reroute' needs expert_capacity"),
        (dict(expert_capacity=0.5), "--expert-capacity 0.5 must be at least 1"),
        (dict(drop_below=1.0), "--drop-below 1 must be in [0, 1)"),
        (dict(router_temperature=0.0), "--router-temperature 0 must be a number above 0"),
    ]
    for options, needle in cases:
        with pytest.raises(moeinfer.EngineError) as e:
            moeinfer.LLM(DEMO, **options)
        assert needle in str(e.value), (options, str(e.value))
    with moeinfer.LLM(FIXTURES / "qwen3_moe_f32", active_experts=1) as llm:
        with pytest.raises(moeinfer.EngineError, match="trace_routing records all K experts"):
            llm.trace_routing(tmp_path / "t.bin")
