"""Row WHT kernels (ops.rotate, csrc/rotate.cu): compile with no GPU; on a GPU bit-identical to codec.wht."""

from __future__ import annotations

import pytest
import torch

from kvarn_cutlass import codec
from kvarn_cutlass.format import HEAD_DIMS
from kvarn_cutlass.ops import rotate as R
from kvarn_cutlass.runtime.spec import build

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _private_cache(kernel_cache_root, monkeypatch):
    monkeypatch.setenv("KVARN_CUTLASS_CACHE", kernel_cache_root)


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
@pytest.mark.parametrize("D", HEAD_DIMS)
def test_rotate_compiles(arch, D):
    spec = R.rotate_spec(D)
    m = build(spec, arch)
    for name in spec.kernel_names:
        assert m.resources[name].spill_store_bytes == 0


def test_rotate_registered_and_validates():
    from kvarn_cutlass.runtime import registry

    assert "rotate" in registry.families()
    with pytest.raises(ValueError, match="needs a CUDA tensor"):
        R.wht(torch.zeros(4, 128))
    with pytest.raises(ValueError, match=r"D in \[64, 128, 256\]"):
        R.wht(torch.zeros(4, 96))
    with pytest.raises(TypeError, match="dtype torch.int32"):
        R.wht(torch.zeros(4, 128, dtype=torch.int32))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        R.wht([1.0] * 128)
    with pytest.raises(ValueError, match="head_dim=96"):
        R.rotate_spec(96)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gpu_wht_matches_codec_and_float64(D, dtype):
    g = torch.Generator().manual_seed(D)
    x = (torch.randn(3, 37, D, generator=g) * 4).to(dtype)
    out = torch.full(x.shape, float("nan"), dtype=torch.float32, device="cuda")  # poisoned
    got = R.rotate_queries(x.cuda(), out=out).cpu()
    want = codec.wht(x.float())
    assert torch.equal(got, want), f"seed={D}"  # bit-identical to the codec's float32 WHT
    ref64 = codec.wht(x.double())
    err = ((got.double() - ref64).abs() / ref64.abs().clamp_min(1e-30)).max().item()
    scale_err = ((got.double() - ref64).abs().max() / ref64.abs().max()).item()
    assert scale_err < 1e-6, f"seed={D}: err={err}, scale_err={scale_err}"
    # input dtype out: the float32 result rounded once
    same = R.unrotate_outputs(x.cuda()).cpu()
    assert same.dtype == dtype and torch.equal(same, want.to(dtype)), f"seed={D}"
    # round trip
    back = R.wht(R.wht(x.cuda()), torch.float32).cpu()
    torch.testing.assert_close(back, x.float(), rtol=1e-5, atol=1e-5, msg=lambda m: f"seed={D}: {m}")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_wht_strided_rows_and_empty():
    S = 72
    x = torch.randn(10, 2, 128, generator=torch.Generator(device="cuda").manual_seed(S), device="cuda")
    view = x[:, 1]  # row stride 256
    assert torch.equal(R.wht(view).cpu(), codec.wht(view.cpu())), f"seed={S}"
    assert R.wht(torch.zeros(0, 64, device="cuda")).shape == (0, 64)
