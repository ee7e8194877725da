"""GPU tests of SnapKV compaction: a CUDA cache compacts to the same bytes as the CPU codec path (the
GPU compression kernel re-encodes the kept tokens), and the decode/prefill kernels over a compacted
cache match the float64 reference."""

from __future__ import annotations

import pytest
import torch

import kvarn_cutlass as kc
from kvarn_cutlass import reference
from kvarn_cutlass.compact import snapkv_compact

from _helpers import realistic_kv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOL = 1e-3  # decode's gate
TOL_PREFILL = 5e-3  # prefill's gate


def _rel(out, ref):
    ref = ref.to(torch.float64)
    rounding = ((ref.to(out.dtype).to(torch.float64) - ref).norm() / ref.norm()).item()
    return ((out.to(torch.float64) - ref).norm() / ref.norm()).item() - rounding


@pytest.mark.parametrize("preset, D, sink, quantizer", [("k4v4_g128", 128, 128, "uniform"), ("k4v2_g64", 64, 0, "uniform"),
                                                         ("k4v2_g128", 128, 0, "lloyd_max")])
def test_cuda_compaction_equals_cpu_and_kernels_match_reference(preset, D, sink, quantizer):
    B, H, G, n, layers = 2, 2, 4, 3000, 2
    g = torch.Generator().manual_seed(D)
    caches = {dev: kc.KVarNCache(layers, B, H, D, preset=preset, window=256, sink_tokens=sink, device=dev,
                                 quantizer=quantizer, max_seq_len=4096 if dev == "cuda" else None)
              for dev in ("cpu", "cuda")}
    for layer in range(layers):
        k, v = realistic_kv(B, H, n, D, generator=g), realistic_kv(B, H, n, D, generator=g)
        for dev, c in caches.items():
            c.append(layer, k.to(dev), v.to(dev))
    queries = [torch.randn(B, H * G, 32, D, generator=g) for _ in range(layers)]
    pool_ptr = caches["cuda"].tile_pool(0).data_ptr()
    res = {dev: snapkv_compact(c, [q.to(dev) for q in queries], n // 4, score_dtype=torch.float64)
           for dev, c in caches.items()}
    cpu, cuda = caches["cpu"], caches["cuda"]
    assert caches["cuda"].tile_pool(0).data_ptr() == pool_ptr
    for layer in range(layers):
        assert torch.equal(res["cpu"].kept[layer], res["cuda"].kept[layer].cpu())
        assert cpu.positions(layer) == cuda.positions(layer)
        assert torch.equal(cpu.tile_bytes(layer), cuda.tile_bytes(layer).cpu())
        assert torch.equal(cpu.window_kv(layer)[0], cuda.window_kv(layer)[0].cpu())

    gq = torch.Generator(device="cuda").manual_seed(3)
    q1 = torch.randn(B, H * G, 1, D, generator=gq, device="cuda", dtype=torch.float16)
    out = kc.decode_attention(q1, cuda, 1)
    assert _rel(out, reference.attention(q1, cuda, 1)) < TOL
    # a prefill chunk appended after compaction
    new = realistic_kv(B, H, 300, D, generator=g).cuda()
    q = torch.randn(B, H * G, 300, D, generator=gq, device="cuda", dtype=torch.float16)
    ref = reference.attention(q, cuda, 0, k=new, v=new.flip(2))
    out = kc.prefill_attention(q, new, new.flip(2), cuda, 0)
    assert _rel(out, ref) < TOL_PREFILL
