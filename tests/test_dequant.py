"""``kc.dequantize_layer``: every token of a layer in position order, tiles as the codec's reconstruction."""
from __future__ import annotations

import pytest
import torch

import kvarn_cutlass as kc

HAS_CUDA = torch.cuda.is_available()


def _filled(device, dtype=torch.float16, quantizer="uniform", seed=0, D=64, preset="k4v2_g64"):
    gen = torch.Generator().manual_seed(seed)
    cache = kc.KVarNCache(2, 2, 2, D, preset=preset, window=128, sink_tokens=64, dtype=dtype, device=device,
                          quantizer=quantizer)
    k = torch.randn(2, 2, 700, D, generator=gen)
    v = torch.randn(2, 2, 700, D, generator=gen)
    cache.append(1, k.to(device), v.to(device))
    return cache, k, v


def _expected(cache, layer):
    """float64 [B, H, L, D] K and V built independently: sink and window as stored, tiles decoded by the codec."""
    sk, sv = (x.double().cpu() for x in cache.sink_kv(layer))
    wk, wv = (x.double().cpu() for x in cache.window_kv(layer))
    kt, vt = kc.decode_tiles(cache.tile_bytes(layer).cpu(), cache.spec, torch.float64)  # [B, nt, H, T, D]
    B, nt, H, T, D = kt.shape
    flat = lambda x: x.permute(0, 2, 1, 3, 4).reshape(B, H, nt * T, D)  # noqa: E731
    return torch.cat((sk, flat(kt), wk), 2), torch.cat((sv, flat(vt), wv), 2)


@pytest.mark.parametrize("quantizer", ["uniform", "lloyd_max"])
def test_cpu_matches_the_codec(quantizer):
    cache, k, v = _filled("cpu", quantizer=quantizer)
    K, V = kc.dequantize_layer(cache, 1)
    ek, ev = _expected(cache, 1)
    assert K.shape == ek.shape == (2, 2, 700, 64) and K.dtype == cache.dtype
    # exact parts are the stored tokens; tiles within the float16 rounding of the reconstruction
    assert torch.equal(K[:, :, :64].double(), ek[:, :, :64]) and torch.equal(V[:, :, -cache.window_kv(1)[0].shape[2]:].double(),
                                                                        ev[:, :, -cache.window_kv(1)[0].shape[2]:])
    for got, want in ((K, ek), (V, ev)):  # one float16 rounding, plus float32 arithmetic on O(max) values
        assert ((got.double() - want).abs() <= 2**-10 * want.abs() + 1e-6 * want.abs().max()).all()
    # and the reconstruction is the quantized input, not something else
    assert ((K.double() - k.half().double()).norm() / k.norm()).item() < 0.2


def test_out_buffers_and_errors():
    cache, _, _ = _filled("cpu")
    kb = torch.full((2, 2, 900, 64), float("nan"), dtype=torch.float16)
    vb = kb.clone()
    K, V = kc.dequantize_layer(cache, 1, out=(kb, vb))
    assert K.data_ptr() == kb.data_ptr() and K.shape[2] == 700 and torch.isfinite(K).all() and torch.isnan(kb[:, :, 700:]).all()
    assert kc.dequantize_layer(cache, 0)[0].shape == (2, 2, 0, 64)  # an empty layer
    with pytest.raises(TypeError, match="cache"):
        kc.dequantize_layer("cache", 0)
    with pytest.raises(ValueError, match="layer"):
        kc.dequantize_layer(cache, 2)
    with pytest.raises(ValueError, match=r"out\[0\]"):
        kc.dequantize_layer(cache, 1, out=(torch.empty(2, 2, 100, 64, dtype=torch.float16), vb))
    with pytest.raises(TypeError, match="out"):
        kc.dequantize_layer(cache, 1, out=kb)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,quantizer,D,preset", [(torch.float16, "uniform", 64, "k4v2_g64"),
                                                     (torch.bfloat16, "lloyd_max", 128, "k4v4_g128"),
                                                     (torch.float16, "uniform", 256, "k4v2_g128")])
def test_gpu_kernel_matches_the_codec(dtype, quantizer, D, preset):
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    cache, _, _ = _filled("cuda", dtype=dtype, quantizer=quantizer, D=D, preset=preset, seed=1)
    kb = torch.full((2, 2, 800, D), float("nan"), dtype=dtype, device="cuda")
    vb = kb.clone()
    K, V = kc.dequantize_layer(cache, 1, out=(kb, vb))
    ek, ev = _expected(cache, 1)
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    for got, want in ((K, ek), (V, ev)):
        assert torch.isfinite(got).all()
        assert ((got.double().cpu() - want).abs() <= ulp * want.abs() + 1e-6 * want.abs().max()).all()
