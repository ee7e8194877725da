"""CPU tests of the GPU runtime: compile, disk cache, argument packing (no GPU needed)."""

from __future__ import annotations

import pytest

from kvarn_cutlass.runtime import CompileError, arch_target, cache_root, cached_artifact, compile_cubin, normalize_arch
from kvarn_cutlass.runtime.compiler import cubin_sm, cubin_symbols


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Every test gets its own empty cache root."""
    monkeypatch.setenv("KVARN_CUTLASS_CACHE", str(tmp_path / "cache"))
    yield tmp_path / "cache"


@pytest.mark.parametrize("spelling", ["sm90", "sm_90", "sm_90a", "90", 90, "9.0", " SM_90 "])
def test_normalize_arch(spelling):
    assert normalize_arch(spelling) == 90


@pytest.mark.parametrize("bad, exc", [("sm_75", ValueError), ("hopper", ValueError), ("sm_86a", ValueError), (9.0, TypeError), (True, TypeError)])
def test_normalize_arch_rejects(bad, exc):
    with pytest.raises(exc, match="arch"):
        normalize_arch(bad)


def test_arch_target():
    assert arch_target(90) == "sm_90"
    assert arch_target("sm_90a") == "sm_90a"
    assert arch_target(90, arch_specific=True) == "sm_90a"
    assert arch_target(80, arch_specific=True) == "sm_80"


def test_cached_artifact_roundtrip(_private_cache):
    calls = []
    key = {"arch": 90, "source_sha256": "abc"}
    first = cached_artifact("kernels", "demo", key, lambda: calls.append(1) or b"payload")
    second = cached_artifact("kernels", "demo", key, lambda: calls.append(1) or b"other")
    assert first == second == b"payload" and len(calls) == 1
    assert cache_root() == _private_cache


_AXPY = 'extern "C" __global__ void k_axpy(float* y, const float* x, float a, int n) {\n' \
        "  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = a * x[i] + y[i];\n}\n"


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compile_cubin_no_gpu(arch):
    result = compile_cubin(_AXPY, "axpy.cu", arch)
    assert result.cubin[:4] == b"\x7fELF"
    assert "k_axpy" in cubin_symbols(result.cubin)
    assert cubin_sm(result.cubin) == normalize_arch(arch)
    assert result.resources["k_axpy"].registers > 0


def test_compile_error_has_log():
    with pytest.raises(CompileError, match=r"broken\.cu") as info:
        compile_cubin("this is not cuda", "broken.cu", "sm_90")
    assert "error" in info.value.log
