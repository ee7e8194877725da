"""Bench section ``compress``: GPU tile compression of one layer, and the row-WHT kernels.

Main case (Qwen3-8B shape): one layer, 8 KV heads, head_dim 128, one 128-token tile per head,
``k4v2_g128`` with float16 scales: 8 records in one launch of 16 blocks (K and V halves).
Variants: batch 16 (128 records), head_dim 64 and 256. Times are CUDA-event medians over rotating
input sets, of the launch alone inside a CUDA graph (``graph_us``: GPU time) and of the eager call
with a deferred error flag (``eager_us``: host launch overhead included, no sync); ``checked_us``
is the default call, which reads the error flag back (one sync) as ``KVarNCache`` does.

Bytes floor per record: read 2 * T * D * 2 bytes (K and V, fp16) and write ``tile_nbytes``
(13,824 B for k4v2_g128, D=128, f16 scales): 8 records move 0.63 MB, 0.15 us at 4.25 TB/s. The
kernel is latency/compute bound instead: per element of each half, 3 * sinkhorn_iters + 2 = 14
correctly rounded float32 divisions (about 10 instructions each) plus the squares, tree sums and
rounding, about 150 instructions: 128 * 128 * 150 / 32 = 77k warp instructions per block, 19k
cycles at 4 per cycle on one SM, about 10 us at 1.98 GHz, plus ~20 block barriers.
Prediction: ~12 us per layer at batch 1 (16 blocks on 16 of 132 SMs; target <= 20 us), ~25 us
at batch 16 (256 blocks, one 512-thread block per SM: two waves), ~4 us for D=64 and ~25 us for
D=256 at batch 1. Splitting a half across a thread-block cluster (sm_90) is the next step if the
batch-1 latency matters.
"""

from __future__ import annotations

from typing import Any

from . import BenchOptions, register_section
from .timing import rotation_count, time_cuda

__all__ = ["run"]

_KV_HEADS = 8
_Q_HEADS = 32


def _compress_case(batch: int, head_dim: int, preset: str, opts: BenchOptions,
                   quantizer: str = "uniform") -> dict[str, Any]:
    import torch

    from ..format import TileSpec
    from ..ops.compress import compress_layer

    spec = TileSpec(preset=preset, head_dim=head_dim, scale_dtype=torch.float16, quantizer=quantizer)
    T = spec.tile_tokens
    shape = (batch, _KV_HEADS, T, head_dim)
    records = batch * _KV_HEADS
    bytes_per_set = records * (2 * T * head_dim * 2 + spec.tile_nbytes)
    n_sets = min(rotation_count(bytes_per_set), 64)
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    sets = []
    for _ in range(n_sets):
        k = torch.randn(shape, device="cuda", dtype=torch.float16)
        v = torch.randn(shape, device="cuda", dtype=torch.float16)
        out = torch.empty(batch, 1, _KV_HEADS, spec.tile_nbytes, dtype=torch.uint8, device="cuda")
        sets.append((k, v, out))
    fn = lambda s: compress_layer(s[0], s[1], spec, out=s[2], error_flag=flag)  # noqa: E731
    runs = 20 if opts.quick else 200
    graph = time_cuda(fn, sets, warmup=5, runs=runs, graph=True)
    eager = time_cuda(fn, sets, warmup=5, runs=runs)
    checked = time_cuda(lambda s: compress_layer(s[0], s[1], spec, out=s[2]), sets, warmup=3, runs=min(runs, 50))
    assert int(flag.item()) == 0
    return {
        "preset": preset,
        "quantizer": quantizer,
        "batch": batch,
        "kv_heads": _KV_HEADS,
        "head_dim": head_dim,
        "records": records,
        "tile_nbytes": spec.tile_nbytes,
        "bytes_moved": bytes_per_set,
        "graph_us": round(graph.median_us, 3),
        "eager_us": round(eager.median_us, 3),
        "checked_us": round(checked.median_us, 3),
        "tiles_per_s": round(records / (graph.median_us * 1e-6)),
        "gb_per_s": round(bytes_per_set / (graph.median_us * 1e-6) / 1e9, 1),
        "graph_timing": graph.to_dict(),
    }


def _rotate_case(rows: int, head_dim: int, out_f32: bool, opts: BenchOptions) -> dict[str, Any]:
    import torch

    from ..ops.rotate import wht

    dtype_out = torch.float32 if out_f32 else torch.float16
    bytes_per_set = rows * head_dim * (2 + (4 if out_f32 else 2))
    n_sets = min(rotation_count(bytes_per_set), 64)
    sets = [
        (torch.randn(rows, head_dim, device="cuda", dtype=torch.float16),
         torch.empty(rows, head_dim, device="cuda", dtype=dtype_out))
        for _ in range(n_sets)
    ]
    t = time_cuda(lambda s: wht(s[0], dtype_out, out=s[1]), sets, warmup=5, runs=20 if opts.quick else 200, graph=True)
    return {
        "rows": rows,
        "head_dim": head_dim,
        "out": "f32" if out_f32 else "f16",
        "graph_us": round(t.median_us, 3),
        "gb_per_s": round(bytes_per_set / (t.median_us * 1e-6) / 1e9, 1),
    }


def run(opts: BenchOptions) -> dict[str, Any]:
    """Results: per compression case microseconds per layer (GPU, eager, checked), tiles/s; rotation cases."""
    cases = [(1, 128, "k4v2_g128")]
    if not opts.quick:
        cases += [(16, 128, "k4v2_g128"), (1, 64, "k4v2_g128"), (1, 256, "k4v2_g128"), (1, 128, "k4v4_g64")]
    compress = [_compress_case(b, d, p, opts) for b, d, p in cases]
    compress += [_compress_case(b, 128, "k4v2_g128", opts, quantizer="lloyd_max") for b in ((1,) if opts.quick else (1, 16))]
    rot_cases = [(_Q_HEADS, 128, True), (512 * _Q_HEADS, 128, True)]
    if not opts.quick:
        rot_cases += [(512 * _Q_HEADS, 128, False), (_Q_HEADS * 16, 64, True), (_Q_HEADS * 16, 256, True)]
    rotate = [_rotate_case(r, d, f, opts) for r, d, f in rot_cases]
    return {
        "method": "CUDA-event medians; graph_us = one launch replayed in a CUDA graph (GPU time); "
                  "eager_us = compress_layer with a deferred error flag; checked_us = default call (flag read back)",
        "compress": compress,
        "rotate": rotate,
        "target_us_per_layer": 20.0,
        "prediction_us_per_layer": {"b1_d128": 12.0, "b16_d128": 25.0, "b1_d64": 4.0, "b1_d256": 25.0},
    }


register_section("compress", run, "GPU tile compression per layer (Qwen3-8B shape and variants) and the row-WHT kernels")
