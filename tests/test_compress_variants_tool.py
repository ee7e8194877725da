"""``tools/compress_variants.py`` without a GPU: which variants it times and what it refuses (the run itself is one
GPU command: ``GPU_COMPRESS_VARIANTS=1 bash tools/gpu_check.sh``, docs/perf-notes.md)."""

from __future__ import annotations

import pytest

from kvarn_cutlass.ops import compress as C

from _helpers import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("compress_variants")


def test_refuses_an_unknown_variant(tool, capsys):
    with pytest.raises(SystemExit) as e:
        tool.main(["--warps", "3"])
    assert e.value.code == 2 and "--warps" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        tool.main(["--cta-warps", "8"])
    assert e.value.code == 2 and "--cta-warps" in capsys.readouterr().err


def test_set_warps_is_what_the_kernels_read(tool, monkeypatch):
    monkeypatch.delenv(C.CLUSTER_WARPS_ENV, raising=False)
    monkeypatch.delenv(C.CTA_WARPS_ENV, raising=False)
    for w in C.CLUSTER_WARPS:
        for o in C.CTA_WARPS:
            tool.set_warps(w, o)
            assert C.cluster_warps() == w and C.cta_warps(128, 128) == o
    monkeypatch.delenv(C.CLUSTER_WARPS_ENV)
    monkeypatch.delenv(C.CTA_WARPS_ENV)
    assert C.cluster_warps() == C.DEFAULT_CLUSTER_WARPS and C.cta_warps(128, 128) == C.default_cta_warps(128, 128)


def test_refuses_an_iteration_count_out_of_range(tool):
    from kvarn_cutlass.format import MAX_SINKHORN_ITERS

    for bad in (-1, MAX_SINKHORN_ITERS + 1):
        with pytest.raises(SystemExit, match="--iters"):
            tool.main(["--iters", "2", "--iters", str(bad)])
