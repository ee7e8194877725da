"""The CUTLASS/CuTe headers of the nvidia-cutlass wheel, found for NVRTC sources (no GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvarn_cutlass.runtime.compiler import compile_cubin, cubin_symbols, cutlass_include_dirs


@pytest.fixture(autouse=True)
def _no_cutlass_path(monkeypatch):
    monkeypatch.delenv("CUTLASS_PATH", raising=False)
    cutlass_include_dirs.cache_clear()
    yield
    cutlass_include_dirs.cache_clear()


def test_the_wheel_provides_the_sm90_gmma_atoms():
    import cutlass_library

    (include,) = cutlass_include_dirs()
    assert Path(include) == Path(cutlass_library.source_path) / "include"
    assert (Path(include) / "cute" / "arch" / "mma_sm90_gmma.hpp").is_file()
    assert (Path(include) / "cutlass" / "cutlass.h").is_file()


def test_nvrtc_compiles_a_source_that_names_a_gmma_atom():
    """The headers are usable as they are by NVRTC for sm_90a, not only present."""
    pytest.importorskip("cuda.bindings")
    src = r"""
#include <cute/arch/mma_sm90_gmma.hpp>
using Atom = cute::SM90::GMMA::MMA_64x64x16_F32F16F16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>;
extern "C" __global__ void kvarn_gmma_probe(int* out) { out[threadIdx.x] = int(sizeof(Atom::CRegisters)); }
"""
    result = compile_cubin(src, "gmma_probe.cu", "sm_90a", (), cutlass_include_dirs(), "nvrtc")
    assert "kvarn_gmma_probe" in cubin_symbols(result.cubin)


def test_cutlass_path_overrides_the_wheel_and_a_tree_without_headers_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("CUTLASS_PATH", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"no CUTLASS/CuTe headers under .*\$CUTLASS_PATH"):
        cutlass_include_dirs()
    (tmp_path / "include" / "cutlass").mkdir(parents=True)
    (tmp_path / "include" / "cute").mkdir()
    (tmp_path / "include" / "cutlass" / "cutlass.h").write_text("")
    (tmp_path / "include" / "cute" / "tensor.hpp").write_text("")
    cutlass_include_dirs.cache_clear()
    assert cutlass_include_dirs() == (str(tmp_path / "include"),)
