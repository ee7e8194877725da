"""``tools/compress_variants.py`` without a GPU: which variants it times and what it refuses (the run itself is one
GPU command: ``GPU_COMPRESS_VARIANTS=1 bash tools/gpu_check.sh``, docs/perf-notes.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvarn_cutlass.ops import compress as C

TOOL = Path(__file__).resolve().parents[1] / "tools" / "compress_variants.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("compress_variants", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_refuses_an_unknown_variant(tool, capsys):
    with pytest.raises(SystemExit) as e:
        tool.main(["--warps", "3"])
    assert e.value.code == 2 and "--warps" in capsys.readouterr().err


def test_set_warps_is_what_the_kernels_read(tool, monkeypatch):
    monkeypatch.delenv(C.CLUSTER_WARPS_ENV, raising=False)
    for w in C.CLUSTER_WARPS:
        tool.set_warps(w)
        assert C.cluster_warps() == w
    monkeypatch.delenv(C.CLUSTER_WARPS_ENV)
    assert C.cluster_warps() == C.DEFAULT_CLUSTER_WARPS
