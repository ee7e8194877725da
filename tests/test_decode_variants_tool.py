"""``tools/decode_variants.py`` without a GPU: its candidates, the resources it prints, the Nsight Compute command,
the table, and one shape's rows from a run whose GPU parts (plan launches, graph timing, driver occupancy) are
stand-ins on a CPU cache (the real run is one GPU command: docs/perf-notes.md, "Decode occupancy")."""

from __future__ import annotations

import pytest
import torch

import kvarn_cutlass as kc
from kvarn_cutlass import decode
from kvarn_cutlass.bench.timing import Timing, williams_order

from _helpers import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("decode_variants")


def test_candidates_and_their_resources(tool):
    """The candidates are distinct non-default variants; the printed resources are the arithmetic's (d128 k4v2:
    4 blocks for the shipped kernel, 5 for ring 2 alone (its 95 registers fit 5 x 128 threads), 5 and 6 with
    min_blocks) with no stack frame."""
    spec = kc.TileSpec(preset="k4v2_g128", head_dim=128)
    variants = [decode.DecodeVariant.parse(t) for t in tool.CANDIDATES]
    assert len(set(variants)) == len(variants) and decode.DecodeVariant() not in variants
    blocks = [tool.resources(spec, v)["blocks_per_sm"] for v in [decode.DecodeVariant()] + variants]
    assert blocks == [4, 5, 5, 6]
    r = tool.resources(spec, variants[-1])
    assert r["stack_bytes"] == 0 and r["registers"] <= 80 and r["exact_tokens"] == 32


def test_ncu_command(tool):
    cmd = tool.ncu_command("ncu")
    metrics = cmd[cmd.index("--metrics") + 1].split(",")
    assert "smsp__inst_executed.max" in metrics and "smsp__issue_active.avg.pct_of_peak_sustained_active" in metrics
    assert "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio" in metrics
    assert cmd[-2:] == [str(tool.ROOT / "tools" / "ncu_targets.py"), "decode"]
    assert cmd[cmd.index("--launch-skip") + 1] == "3" and "regex:kvarn_decode_n" in cmd
    bare = tool.ncu_command("ncu", per_smsp=False)
    assert not set(tool.NCU_METRICS) & set(bare[bare.index("--metrics") + 1].split(","))


def test_one_shape_with_stand_ins_for_the_gpu(tool, monkeypatch):
    """b16/32k on a small CPU cache: the default's plan picks S0 = 4 and a variant S = 6; a launch writes an
    output that depends only on its split count. The rows: every variant equal to the default at S0, different
    at its own S, the sweep timed for every variant, the default timed again; the table and the fastest pick."""
    launched = []

    class Plan:
        def __init__(self, cache, splits=None, variant=None):
            self.variant = variant
            self.splits = splits or (4 if variant == decode.DecodeVariant() else 6)

        def launch(self, q, layer, out):
            launched.append((self.variant, self.splits, layer))
            out.copy_(torch.full_like(out, self.splits + layer))

        def workspace(self, group):
            return self

    def fake_time(fn, inputs, warmup, runs, graph):
        assert graph and runs == 3
        for i in inputs:
            fn(i)
        us = 1000.0 - len(launched) / 1000  # distinct times, shrinking as the run goes on
        return Timing(us, us, us, us, runs, len(inputs), graph)

    cache = kc.KVarNCache(1, 2, 8, 128, window=256)
    cache.append(0, torch.randn(2, 8, 600, 128), torch.randn(2, 8, 600, 128))
    monkeypatch.setattr(tool.decode, "DecodePlan", Plan)
    monkeypatch.setattr(tool.decode, "occupancy", lambda spec, device, v: tool.resources(spec, v)["blocks_per_sm"])
    monkeypatch.setattr(tool, "time_cuda", fake_time)
    monkeypatch.setattr(tool.bench, "rotated_layers", lambda batch, ctx: 2)
    monkeypatch.setattr(tool.bench, "_build_cache", lambda batch, ctx, layers: cache)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    sampled = []

    def fake_sampler(plan, q, layers, replays):  # us per layer: 10 x the plan's split count + the sample's number
        assert replays == tool.INTERLEAVED_REPLAYS and layers == 2
        return lambda: sampled.append(plan.variant) or 10.0 * plan.splits + len(sampled)

    monkeypatch.setattr(tool, "graph_sampler", fake_sampler)
    variants = [decode.DecodeVariant.parse(t) for t in tool.CANDIDATES]
    rows, extra = tool._time_shape(16, 32768, variants, runs=3)
    # the interleaved A/B: every kernel at S0 = 4, warmed once, then rounds in Williams orders
    kinds = [decode.DecodeVariant()] + variants
    rounds = max(tool.INTERLEAVED_ROUNDS, 2 * len(kinds))
    assert sampled[:4] == kinds
    assert sampled[4:] == [kinds[i] for r in range(rounds) for i in williams_order(4, r)]
    assert extra["interleaved_default_us"][1] > 40 and all(0.9 < r["interleaved_vs_default"][0] < 1.1 for r in rows[1:])
    assert "interleaved_vs_default" not in rows[0] and all(
        r["interleaved_vs_default"][1] <= r["interleaved_vs_default"][0] <= r["interleaved_vs_default"][2] for r in rows[1:])
    assert [r["variant"] for r in rows] == ["default", *tool.CANDIDATES]
    assert {r["default_splits"] for r in rows} == {4} and [r["splits"] for r in rows] == [4, 6, 6, 6]
    assert all(r["equal_to_default"] for r in rows)
    assert rows[0]["max_abs_diff_vs_default"] == 0 and all(r["max_abs_diff_vs_default"] == 2 for r in rows[1:])
    assert all(list(r["sweep_us"]) == [str(s) for s in tool.SWEEPS[(16, 32768)]] for r in rows)
    assert [r["blocks_per_sm"] for r in rows] == [4, 5, 5, 6] and rows[0]["exact_blocks"] == 8
    assert extra["default_again_us"] < rows[-1]["own_us"] and rows[0]["layers_rotated"] == 2
    text = tool.table(rows)
    assert len(text.splitlines()) == 1 + len(rows) and "ring=2,min_blocks=6" in text
    assert tool.fastest(rows, (16, 32768)) == "ring=2,min_blocks=6"  # the last one timed at its own plan


def test_shape_argument(tool):
    """``--shape BxT`` parses to (batch, context); malformed or non-positive shapes are argparse errors that quote
    the text."""
    import argparse

    assert tool.parse_shape("1x32768") == (1, 32768) and tool.parse_shape("16X4096") == (16, 4096)
    for bad in ("32768", "1x", "ax2", "0x4096", "1x-5", "1x2x3"):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad)):
            tool.parse_shape(bad)
