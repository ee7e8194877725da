"""``tools/sinkhorn_iters_study.py`` (the CPU study behind docs/accuracy.md's iteration-count table): what it refuses
before it loads anything, and the rows it measures."""

from __future__ import annotations

import pytest

from kvarn_cutlass.format import MAX_SINKHORN_ITERS, PRESETS, QUANTIZERS

from _helpers import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("sinkhorn_iters_study")


def test_refuses_counts_out_of_range(tool):
    for bad in (-1, MAX_SINKHORN_ITERS + 1):
        with pytest.raises(SystemExit, match="--iters"):
            tool.main(["--iters", "1", "--iters", str(bad)])


def test_rows_are_configs_the_library_takes(tool):
    from kvarn_cutlass.hf import SimSpec

    for preset, quantizer, window, view in tool.ROWS:
        assert preset in PRESETS and quantizer in QUANTIZERS
        SimSpec(preset, window, 0, view=view, quantizer=quantizer)  # raises on a config the simulation rejects
