"""``tools/prefill_phases.py`` without a GPU: the pairs it counts per phase and the fit it reports (the run itself is
one GPU command: ``GPU_PREFILL_PHASES=1 bash tools/gpu_check.sh``, docs/perf-notes.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvarn_cutlass as kc

from _helpers import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("prefill_phases")


@pytest.mark.parametrize("context,chunk", [(0, 1), (0, 33), (100, 64), (300, 64), (1000, 257)])
def test_pairs_are_the_causal_masks_true_entries(tool, context, chunk):
    from torch.nn.attention.bias import causal_lower_right

    # a CPU cache's split of the context into tile tokens and exact (sink + window) tokens
    cache = kc.KVarNCache(1, 1, 1, 64, window=128, sink_tokens=128, max_seq_len=context + chunk)
    if context:
        g = torch.Generator().manual_seed(context)
        k = torch.randn(1, 1, context, 64, generator=g)
        cache.append(0, k, torch.randn(1, 1, context, 64, generator=g))
    layer = cache._layer(0)
    tile_tokens, exact_before = layer.n_tiles * cache.spec.tile_tokens, layer.window_len + layer.sink_len
    assert tile_tokens + exact_before == context
    tp, ep = tool.pairs(tile_tokens, exact_before, chunk)
    mask = causal_lower_right(chunk, context + chunk)._materialize()
    assert tp + ep == int(mask.sum())
    assert tp == int(mask[:, :tile_tokens].sum()) == chunk * tile_tokens  # every query sees every tile token


def test_fit_recovers_the_per_pair_times(tool):
    rng = np.random.default_rng(7)
    rows = []
    for tile, exact in [(0, 4e6), (0, 6e7), (5e8, 2e7), (5e8, 8e7), (1e9, 1.6e7), (2.6e8, 4.2e6)]:
        kvarn = 12.0 + 0.05 * tile * 1e-6 + 0.11 * exact * 1e-6
        rows.append({"tile_pairs": tile, "exact_pairs": exact, "kvarn_us": kvarn * (1 + 1e-9 * rng.standard_normal()),
                     "sdpa_us": 0.055 * (tile + exact) * 1e-6})
    f = tool.fit(rows)
    assert f["launch_us"] == pytest.approx(12.0, abs=0.01)
    assert f["tile_ps_per_pair"] == pytest.approx(0.05, abs=1e-4)
    assert f["exact_ps_per_pair"] == pytest.approx(0.11, abs=1e-4)
    assert f["exact_over_tile"] == pytest.approx(2.2, abs=0.01)
    assert f["sdpa_ps_per_pair_median"] == pytest.approx(0.055, abs=1e-4) and f["residual_us_max"] < 0.01


def test_every_source_variant_applies_to_the_shipped_source(tool):
    src = tool.SHIPPED_SOURCE.read_text()
    for name, subs in tool.SOURCE_VARIANTS.items():
        for a, b in subs:
            assert src.count(a) == 1 and a != b, name  # exactly one place, and a real change


def test_refuses_an_unknown_variant(tool, capsys):
    with pytest.raises(SystemExit) as e:
        tool.main(["--variants", "nope"])
    assert e.value.code == 2 and "--variants" in capsys.readouterr().err
