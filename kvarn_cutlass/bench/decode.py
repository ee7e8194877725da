"""Bench section ``decode``: split-tile KVarN decode vs torch SDPA on an fp16 cache.

Shape: Qwen3-8B attention (32 q heads, 8 KV heads, head_dim 128), ``k4v2_g128`` (13824-byte
records, 108 B per token per KV head), window 256, fp16; time per layer per step at batch 1 and 16
for contexts 4k, 16k, 32k, 128k, graph-replayed and eager; baselines in the same run: SDPA with the
cuDNN and flash backends (``enable_gqa=True``) on an fp16 cache of the same length.

Inputs rotate so that L2 (60 MB on H200) does not serve repeated reads: the KVarN cache gets as
many layers as needed (one decode call per layer, the graph holds all of them, time / layers), the
SDPA baseline gets that many K/V sets.

Bytes floor (KVarN bytes read per layer per step = B x 8 x n_tiles x 13824 + B x 8 x 256 x 512 for
the window) and the time at the 4.25 TB/s copy ceiling:

==========  =========  ========  ============  ==========================  =============
batch, ctx  tiles/seq  MB read   floor (us)    prediction (us, graph)      SDPA cuDNN (us)
==========  =========  ========  ============  ==========================  =============
1, 4k       30         4.4       1.0           8-12 (launch/latency bound)  28.7
1, 32k      254        29        6.9           14-18                        53.8
1, 128k     1022       114       27            40-48 (~60-65% of copy)      142.5
16, 4k      30         70        16.6          28-35                        78.4
16, 32k     254        466       110           155-180 (60-70%)             494
16, 128k    1022       1826      430           600-700                      1896
==========  =========  ========  ============  ==========================  =============

The prediction column is the first kernel's (fp16 MMAs, a second combine kernel); the one-kernel
int8 decode's cost model and predictions are in docs/perf-notes.md (decode). ``split_sweep_graph_us`` records the time at batch 16 / 32k and batch 1 / 4k for several
split counts and ``min_tps_sweep`` (batch 1 / 4k) for the fewest tiles per split, in quick runs too (and
batch 1 / 128k in full runs), so
the split model of ``decode.choose_splits`` can be checked (revised predictions after the first run:
docs/perf-notes.md, decode).
"""

from __future__ import annotations

import math
from typing import Any

from . import BenchOptions, register_section
from .timing import rotation_count, time_cuda

__all__ = ["run"]

HQ, HKV, D, WINDOW, PRESET = 32, 8, 128, 256, "k4v2_g128"
COPY_CEILING_GB_S = 4250.0
CONTEXTS = (4096, 16384, 32768, 131072)
BATCHES = (1, 16)
SDPA_CUDNN_REF_US = {
    (1, 4096): 28.7, (1, 16384): 38.7, (1, 32768): 53.8, (1, 131072): 142.5,
    (16, 4096): 78.4, (16, 16384): 258.0, (16, 32768): 494.0, (16, 131072): 1896.0,
}


def rotated_layers(batch: int, ctx: int) -> int:
    """Layers of a ``batch`` x ``ctx`` cache the timed graphs rotate through (at most 64): enough that their tile
    records together exceed the L2 (``rotation_count``), so no replay reads records the previous one left there."""
    from ..format import TileSpec

    tile_bytes = batch * HKV * math.ceil((ctx - WINDOW) / 128) * TileSpec(preset=PRESET, head_dim=D).tile_nbytes
    return min(64, rotation_count(max(tile_bytes, 1)))


def sdpa_inputs(batch: int, ctx: int):
    """(K/V sets, q) of fp16 SDPA at ``batch`` x ``ctx``: [batch, HKV, ctx, D] K and V per set, as many sets (at
    most 16) as rotate past the L2, and one [batch, HQ, 1, D] query."""
    import torch

    sets = min(16, rotation_count(2 * batch * HKV * ctx * D * 2))
    kv = [(torch.randn(batch, HKV, ctx, D, device="cuda", dtype=torch.float16),
           torch.randn(batch, HKV, ctx, D, device="cuda", dtype=torch.float16)) for _ in range(sets)]
    return kv, torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.float16)


def _build_cache(batch: int, ctx: int, layers: int, quantizer: str = "uniform"):
    import torch

    from ..cache import KVarNCache

    c = KVarNCache(layers, batch, HKV, D, preset=PRESET, window=WINDOW, dtype=torch.float16, device="cuda",
                   max_seq_len=ctx + 64, quantizer=quantizer)
    chunk = max(1024, min(ctx, (1 << 28) // (batch * HKV * D * 2)))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for layer in range(layers):
        done = 0
        while done < ctx:
            m = min(chunk, ctx - done)
            k = torch.randn(batch, HKV, m, D, generator=gen, device="cuda", dtype=torch.float16)
            v = torch.randn(batch, HKV, m, D, generator=gen, device="cuda", dtype=torch.float16)
            c.append(layer, k, v)
            done += m
    return c


def _kvarn_bytes(cache, layer: int = 0) -> int:
    n_tiles = cache.num_tiles(layer)
    pos = cache.positions(layer)
    win = pos["window"][1] - pos["window"][0]
    B = cache.batch_size
    return B * HKV * n_tiles * cache.spec.tile_nbytes + B * HKV * win * D * 2 * 2


def _time_kvarn(batch: int, ctx: int, opts: BenchOptions, splits_list=None, min_tps_list=None,
                quantizer: str = "uniform") -> dict[str, Any]:
    import torch

    from ..decode import DecodePlan, decode_attention

    layers = rotated_layers(batch, ctx)
    cache = _build_cache(batch, ctx, layers, quantizer)
    nbytes = _kvarn_bytes(cache)
    q = torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.float16)
    outs = [torch.empty_like(q) for _ in range(layers)]
    runs = 20 if opts.quick else 100
    res: dict[str, Any] = {"batch": batch, "context": ctx, "layers_rotated": layers, "kvarn_bytes": nbytes}

    def graph_time(plan) -> float:
        plan.refresh()
        for i in range(layers):  # warm-up: module, workspace, prepared launches
            plan.launch(q, i, outs[i])
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(layers):
                plan.launch(q, i, outs[i])
        t = time_cuda(lambda: g.replay(), warmup=5, runs=runs)
        return t.median_us / layers

    plan = DecodePlan(cache)
    ws = plan.workspace(HQ // HKV)
    res["splits"], res["exact_blocks"], res["min_tps"] = ws.splits, ws.exact, ws.min_tps
    res["kernel_variant"] = str(ws.variant)  # decode.plan_variant's choice ($KVARN_DECODE_VARIANT in an A/B run)
    res["graph_us"] = round(graph_time(plan), 2)
    i_box = [0]

    def eager():
        i = i_box[0] = (i_box[0] + 1) % layers
        decode_attention(q, cache, i, out=outs[i])

    res["eager_us"] = round(time_cuda(eager, warmup=5, runs=runs).median_us, 2)
    res["gb_per_s_graph"] = round(nbytes / (res["graph_us"] * 1e-6) / 1e9, 1)
    res["fraction_of_copy_ceiling"] = round(res["gb_per_s_graph"] / COPY_CEILING_GB_S, 3)
    res["floor_us"] = round(nbytes / (COPY_CEILING_GB_S * 1e9) * 1e6, 2)
    if splits_list:  # A/B of the split choice (same min_tps as the default plan)
        sweep = {}
        for s in splits_list:
            sweep[str(s)] = round(graph_time(DecodePlan(cache, splits=s)), 2)
        res["split_sweep_graph_us"] = sweep
    if min_tps_list:  # A/B of the fewest tiles per split (splits re-chosen for each)
        sweep = {}
        for m in min_tps_list:
            p2 = DecodePlan(cache, min_tps=m)
            sweep[str(m)] = {"splits": p2.workspace(HQ // HKV).splits, "graph_us": round(graph_time(p2), 2)}
        res["min_tps_sweep"] = sweep
    del cache, outs
    torch.cuda.empty_cache()
    return res


def _time_sdpa(batch: int, ctx: int, opts: BenchOptions) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kv, q = sdpa_inputs(batch, ctx)
    runs = 20 if opts.quick else 100
    out: dict[str, Any] = {"fp16_bytes": 2 * batch * HKV * ctx * D * 2}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        def call(s, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, s[0], s[1], enable_gqa=True)

        try:
            call(kv[0])
            out[f"sdpa_{name}_us"] = round(time_cuda(call, kv, warmup=5, runs=runs).median_us, 2)
            # Eager SDPA at batch 1 is bound by host launch time (~130 us whatever the context); replayed
            # from a CUDA graph, as KVarN's graph_us is, it shows its GPU time.
            out[f"sdpa_{name}_graph_us"] = round(time_cuda(call, kv, warmup=5, runs=runs, graph=True).median_us, 2)
        except Exception as e:  # a backend may reject the shape or the capture: record why
            out[f"sdpa_{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    del kv
    torch.cuda.empty_cache()
    return out


def run(opts: BenchOptions) -> dict[str, Any]:
    """Rows per (batch, context): KVarN graph/eager us, GB/s, fraction of copy ceiling, SDPA us, ratios."""
    rows = []
    cases = [(1, 4096), (16, 32768)] if opts.quick else [(b, c) for b in BATCHES for c in CONTEXTS]
    for batch, ctx in cases:
        sweep = tps_sweep = None
        if (batch, ctx) == (16, 32768):
            sweep = [2, 3, 4, 5, 6, 8] if opts.quick else [1, 2, 3, 4, 5, 6, 8, 12]
        if (batch, ctx) == (1, 4096):
            sweep, tps_sweep = [4, 8, 16, 32], [1, 2, 4]
        if (batch, ctx) == (1, 131072):  # one wave of 16-tile blocks measured 97 us vs ~63 modelled
            sweep, tps_sweep = [33, 65, 130, 260, 512], [2, 4, 8]
        row = _time_kvarn(batch, ctx, opts, sweep, tps_sweep)
        row.update(_time_sdpa(batch, ctx, opts))
        row["sdpa_cudnn_reference_us"] = SDPA_CUDNN_REF_US.get((batch, ctx))
        for name in ("cudnn", "flash"):
            if f"sdpa_{name}_us" in row:
                row[f"speedup_vs_{name}_graph"] = round(row[f"sdpa_{name}_us"] / row["graph_us"], 2)
                row[f"speedup_vs_{name}_eager"] = round(row[f"sdpa_{name}_us"] / row["eager_us"], 2)
            if f"sdpa_{name}_graph_us" in row:  # both replayed from CUDA graphs
                row[f"speedup_vs_{name}_graphed"] = round(row[f"sdpa_{name}_graph_us"] / row["graph_us"], 2)
        rows.append(row)
    get = {(r["batch"], r["context"]): r for r in rows}
    # The Lloyd-Max quantizer changes only the code -> operand lookup (byte permutes instead of the
    # 1024 + c trick): its cost against the uniform kernel at the bar shapes.
    lloyd_rows = []
    for batch, ctx in [(1, 4096), (16, 32768)] + ([] if opts.quick else [(1, 131072)]):
        r = _time_kvarn(batch, ctx, opts, quantizer="lloyd_max")
        r = {k: r[k] for k in ("batch", "context", "splits", "graph_us", "eager_us", "gb_per_s_graph",
                               "fraction_of_copy_ceiling")}
        r["uniform_graph_us"] = get[(batch, ctx)]["graph_us"]
        r["time_vs_uniform"] = round(r["graph_us"] / r["uniform_graph_us"], 3)
        lloyd_rows.append(r)
    # Bars of the one-kernel int8 decode (issue 15), graph against graph in the same run: cuDNN SDPA's time
    # over KVarN's, and the bytes floor over KVarN's time.
    bars = {}
    for key, (b, c), need in (("b1_4k_cudnn_graphed_over_kvarn_ge_1", (1, 4096), 1.0),
                              ("b1_128k_cudnn_graphed_over_kvarn_ge_2.8", (1, 131072), 2.8),
                              ("b16_32k_cudnn_graphed_over_kvarn_ge_3", (16, 32768), 3.0)):
        if "speedup_vs_cudnn_graphed" in get.get((b, c), {}):
            bars[key] = get[(b, c)]["speedup_vs_cudnn_graphed"] >= need
    for key, (b, c) in (("b16_32k_floor_over_kvarn_ge_0.75", (16, 32768)), ("b16_128k_floor_over_kvarn_ge_0.75", (16, 131072))):
        if (b, c) in get:
            bars[key] = get[(b, c)]["floor_us"] / get[(b, c)]["graph_us"] >= 0.75
    return {
        "shape": {"num_q_heads": HQ, "num_kv_heads": HKV, "head_dim": D, "preset": PRESET, "window": WINDOW},
        "copy_ceiling_gb_per_s": COPY_CEILING_GB_S,
        "method": "median of CUDA-event timings; KVarN per layer with rotated layers (graph: all layers in one "
                  "graph / layers); SDPA over rotated fp16 K/V sets",
        "rows": rows,
        "lloyd_max_rows": lloyd_rows,
        "bars": bars,
    }


register_section("decode", run, "split-tile KVarN decode vs SDPA cuDNN/flash, Qwen3-8B heads, batch 1/16, 4k-128k")
