"""Bench section ``compress``: GPU tile compression of one layer, and the row-WHT kernels.

Main case (Qwen3-8B shape): one layer, 8 KV heads, head_dim 128, one 128-token tile per head,
``k4v2_g128`` with float16 scales: 8 records in one launch. Variants: batch 16 (128 records), head_dim
64 and 256. Times are CUDA-event medians over rotating input sets, of the launch alone inside a CUDA
graph (``graph_us``: GPU time) and of the eager call with a deferred error flag (``eager_us``: host
launch overhead included, no sync); ``checked_us`` is the default call, which reads the error flag
back (one sync) as ``KVarNCache`` does. ``kernel`` says which layer kernel ran: ``cluster xR`` (a
thread-block cluster of R = T/16 CTAs of 256 threads per record half, sm_90) or ``one CTA`` (512 threads per
half as shipped; ops.compress picks it for launches of more halves than fit as clusters).

Bytes floor per record: read 2 * T * D * 2 bytes (K and V, fp16) and write ``tile_nbytes``
(13,824 B for k4v2_g128, D=128, f16 scales): 8 records move 0.63 MB, 0.15 us at 4.25 TB/s. The
kernel is latency bound: five Sinkhorn candidates, each a chain of per-element divisions (now 5
instructions each from the divisor's reciprocal), warp-shuffle row sums and one cluster-wide
exchange of the column sums. Prediction (docs/perf-notes.md, "Tile compression on clusters"): ~8 us
per layer at batch 1 (bar 10), ~45 us at batch 16 (one CTA per half, two waves), ~5 us for D=64 and
~11 us for D=256 at batch 1.

``prefill_compress``: the appends of a 16k-token prompt in 512-token chunks (one layer, 8 KV heads,
head_dim 128, k4v2_g128, window 256, fp16; chunks are token-range views of the prompt, made before the
timed region as a model's forward pass hands each chunk's k, v over) inside one ``deferred_checks``
block: ``prefill_compress_ms`` is the wall time on the stream (CUDA events; host launch gaps included),
``prefill_compress_sliced_ms`` the same with the views made inside the timed loop (the harness of the
records before 2026-12-07), ``gpu_ms`` the same work queued behind a sleep kernel (GPU alone),
``host_ms`` the host's time for the 32 calls. Each chunk is two launches (compression of 4 tiles per
head straight from window and chunk; the window rewrite).

Section ``append`` (same module): ``KVarNCache.append`` of one token per layer (the decode step's
write) on the same layer shape at batch 1 and 16: per call ``gpu_us`` (queued behind a sleep
kernel: the GPU alone) and ``host_us`` (wall time of the call, no synchronization: inside
``deferred_checks``) for appends that complete no tile (one launch), and ``amortized_*`` over 128
consecutive appends of which one completes a tile (two launches there, one compression); ``checked_us``
is a no-tile append outside a block (wall time including its read of the error flag, one sync);
``static_fp16_*`` the same token copied into a static fp16 cache (two ``copy_``), for reference.
``step_graph``: the same append as a step graph replays it (``StepAppends`` of the layer captured in a
CUDA graph: the snapshot, append_compress sized for one tile and predicated on the device lengths,
append_commit), per compression form (``cluster xR``, the form ops.append picks at batch 1, and ``one
CTA``, forced): ``step_us`` the median GPU time of a replay that completes no tile (its append_compress
does nothing), ``completing_us`` of the replay that completes one, ``amortized_us`` over the 128.
Targets (issue 16): gpu_us <= 5 and host_us <= 15 at batch 1; prefill_compress_ms <= 1.0.
"""

from __future__ import annotations

from typing import Any

import statistics
import time

from ..presets import DEFAULT_SINKHORN_ITERS
from . import BenchOptions, register_section
from .timing import elapsed_ms, queue_lead_us, rotation_count, time_cuda, time_queued

__all__ = ["run", "run_append"]

_KV_HEADS = 8
_Q_HEADS = 32


def _compress_case(batch: int, head_dim: int, preset: str, opts: BenchOptions,
                   quantizer: str = "uniform", sinkhorn_iters: int = DEFAULT_SINKHORN_ITERS) -> dict[str, Any]:
    import torch

    from ..format import TileSpec
    from ..ops.compress import compress_layer

    spec = TileSpec(preset=preset, head_dim=head_dim, scale_dtype=torch.float16, quantizer=quantizer,
                    sinkhorn_iters=sinkhorn_iters)
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
        "kernel": _layer_kernel(spec, records),
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


def _layer_kernel(spec, records: int) -> str:
    """Which layer kernel ops.compress launches for ``records`` records (its own rule)."""
    import torch

    from ..ops import compress as C

    index = torch.cuda.current_device()
    kspec = C.compress_spec(spec.tile_tokens, spec.head_dim, torch.float16, spec.scale_dtype, spec.v_bits, spec.quantizer,
                            C.cluster_warps(), C.cta_warps(spec.tile_tokens, spec.head_dim))
    ranks, threads = C._layer_layout(C._kernel(index, kspec))
    if ranks > 1 and 2 * records <= C.cluster_halves(ranks, index, threads):
        return f"cluster x{ranks}"
    return "one CTA"


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


def _prefill_compress(opts: BenchOptions) -> dict[str, Any]:
    import torch

    from ..cache import KVarNCache

    P, C, H, D = 16384, 512, _KV_HEADS, 128
    g = torch.Generator(device="cuda").manual_seed(P + C)
    k = torch.randn(1, H, P, D, device="cuda", dtype=torch.float16, generator=g)
    k[..., :4] *= 6  # outlier channels
    v = torch.randn(1, H, P, D, device="cuda", dtype=torch.float16, generator=g)

    # A model's forward pass hands each chunk's k, v to the cache as tensors of their own: the views are made
    # here, outside the timed region (two slices of the [1, H, P, D] prompt took ~10 us of host time per chunk
    # on the dev CPU, about half of what the loop charged an append). ``sliced`` keeps the previous harness.
    chunks = [(k[:, :, s:s + C], v[:, :, s:s + C]) for s in range(0, P, C)]

    def prompt(cache: KVarNCache) -> None:
        for kc, vc in chunks:
            cache.append(0, kc, vc)

    def prompt_sliced(cache: KVarNCache) -> None:
        for s in range(0, P, C):
            cache.append(0, k[:, :, s:s + C], v[:, :, s:s + C])

    def fresh() -> KVarNCache:
        return KVarNCache(1, 1, H, D, window=256, dtype=torch.float16, device="cuda", max_seq_len=P)

    def wall_ms(run=prompt) -> float:
        cache = fresh()
        with cache.deferred_checks():
            return elapsed_ms(lambda: run(cache))

    def queued() -> tuple[float, float]:
        cache = fresh()
        with cache.deferred_checks():
            return time_queued(lambda: prompt(cache), lead_us=lead)

    wall_ms()  # warm-up: module load, prepared launches
    t0 = time.perf_counter()
    wall_ms()
    lead = queue_lead_us(time.perf_counter() - t0)
    reps = 2 if opts.quick else 7
    walls, sliced = [], []
    for _ in range(reps):  # the two harnesses take turns, so a drift of the host lands on both
        walls.append(wall_ms())
        sliced.append(wall_ms(prompt_sliced))
    q = [queued() for _ in range(reps)]
    return {
        "prompt_tokens": P, "chunk_tokens": C, "kv_heads": H, "head_dim": D, "preset": "k4v2_g128", "window": 256,
        "prefill_compress_ms": round(statistics.median(walls), 3),
        "prefill_compress_sliced_ms": round(statistics.median(sliced), 3),
        "gpu_ms": round(statistics.median(x[0] for x in q) / 1000.0, 3),
        "host_ms": round(statistics.median(x[1] for x in q) / 1000.0, 3),
        "target_ms": 1.0,
    }


def run(opts: BenchOptions) -> dict[str, Any]:
    """Results: per compression case microseconds per layer (GPU, eager, checked), tiles/s; rotation cases;
    the appends of a chunked 16k prompt (``prefill_compress``)."""
    cases = [(1, 128, "k4v2_g128")]
    if not opts.quick:
        cases += [(16, 128, "k4v2_g128"), (1, 64, "k4v2_g128"), (1, 256, "k4v2_g128"), (1, 128, "k4v4_g64")]
    compress = [_compress_case(b, d, p, opts) for b, d, p in cases]
    compress += [_compress_case(b, 128, "k4v2_g128", opts, quantizer="lloyd_max") for b in ((1,) if opts.quick else (1, 16))]
    rot_cases = [(_Q_HEADS, 128, True), (512 * _Q_HEADS, 128, True)]
    if not opts.quick:
        rot_cases += [(512 * _Q_HEADS, 128, False), (_Q_HEADS * 16, 64, True), (_Q_HEADS * 16, 256, True)]
    rotate = [_rotate_case(r, d, f, opts) for r, d, f in rot_cases]
    prefill = _prefill_compress(opts)
    return {
        "method": "CUDA-event medians; graph_us = one launch replayed in a CUDA graph (GPU time); "
                  "eager_us = compress_layer with a deferred error flag; checked_us = default call (flag read back)",
        "compress": compress,
        "rotate": rotate,
        "prefill_compress_ms": prefill["prefill_compress_ms"],
        "prefill_compress": prefill,
        "target_us_per_layer": 10.0,
        "prediction_us_per_layer": {"b1_d128": 8.0, "b16_d128": 45.0, "b1_d64": 5.0, "b1_d256": 11.0,
                                    "b1_d128_lloyd_max": 9.0,
                                    # the appends' cluster form (docs/perf-notes.md, branch append-cluster)
                                    "prefill_compress_gpu_ms": 1.0, "prefill_compress_ms": 1.4},
    }


register_section("compress", run, "GPU tile compression per layer (Qwen3-8B shape and variants) and the row-WHT kernels")


def _append_case(batch: int, opts: BenchOptions) -> dict[str, Any]:
    import torch

    from ..cache import KVarNCache

    H, D, T, W = _KV_HEADS, 128, 128, 256
    rounds = 3 if opts.quick else 11
    P = 1000
    cache = KVarNCache(1, batch, H, D, window=W, dtype=torch.float16, device="cuda", max_seq_len=P + (rounds + 4) * T)
    g = torch.Generator(device="cuda").manual_seed(batch)
    kv = lambda n: tuple(torch.randn(batch, H, n, D, device="cuda", dtype=torch.float16, generator=g)  # noqa: E731
                         for _ in range(2))
    cache.append(0, *kv(P))
    while cache.positions(0)["window"][1] - cache.positions(0)["window"][0] != W - T + 1:
        cache.append(0, *kv(1))  # to just after a compression: the next T - 1 appends complete no tile
    toks = [kv(1) for _ in range(T)]

    def no_tile() -> None:
        for i in range(T - 1):
            cache.append(0, *toks[i])

    def completing() -> None:
        cache.append(0, *toks[T - 1])

    with cache.deferred_checks():  # a warm-up round, which also sizes the lead
        t0 = time.perf_counter()
        no_tile()
        completing()
        lead = queue_lead_us(time.perf_counter() - t0)
    plain, amortized = [], []
    for _ in range(rounds):
        with cache.deferred_checks():
            a = time_queued(no_tile, lead)
            b = time_queued(completing, lead)
        plain.append((a[0] / (T - 1), a[1] / (T - 1)))
        amortized.append(((a[0] + b[0]) / T, (a[1] + b[1]) / T))
    n_checked = 16  # outside a block: each call reads the error flag back
    t0 = time.perf_counter()
    for i in range(n_checked):
        cache.append(0, *toks[i])
    checked_us = (time.perf_counter() - t0) * 1e6 / n_checked
    static_k = torch.zeros(batch, H, 2 * T, D, device="cuda", dtype=torch.float16)
    static_v = torch.zeros_like(static_k)

    def static() -> None:
        for i in range(T - 1):
            static_k[:, :, i : i + 1].copy_(toks[i][0])
            static_v[:, :, i : i + 1].copy_(toks[i][1])

    static()
    s = [time_queued(static, lead) for _ in range(rounds)]
    med = lambda xs, j: round(statistics.median(x[j] for x in xs), 3)  # noqa: E731
    return {
        "batch": batch, "kv_heads": H, "head_dim": D, "preset": "k4v2_g128", "window": W,
        "gpu_us": med(plain, 0), "host_us": med(plain, 1),
        "amortized_gpu_us": med(amortized, 0), "amortized_host_us": med(amortized, 1),
        "checked_us": round(checked_us, 3),
        "static_fp16_gpu_us": round(statistics.median(x[0] for x in s) / (T - 1), 3),
        "static_fp16_host_us": round(statistics.median(x[1] for x in s) / (T - 1), 3),
        "rounds": rounds,
    }


def _step_graph_case(batch: int, cluster: bool, opts: BenchOptions) -> dict[str, Any] | None:
    """One layer's append of a step graph, replayed for rounds of 128 steps (one completes a tile), in the
    cluster form (None where ops.append would not pick it: no clusters, or too many halves) or forced to
    the one-CTA form."""
    import torch

    from ..cache import KVarNCache
    from ..step_graph import StepAppends

    H, D, T, W = _KV_HEADS, 128, 128, 256
    rounds = 3 if opts.quick else 11
    P = 1000
    cache = KVarNCache(1, batch, H, D, window=W, dtype=torch.float16, device="cuda", max_seq_len=P + (rounds + 2) * T)
    g = torch.Generator(device="cuda").manual_seed(batch)
    k0 = torch.randn(batch, H, P, D, device="cuda", dtype=torch.float16, generator=g)
    cache.append(0, k0, torch.randn_like(k0))
    writer = cache._writer
    if cluster and writer.cluster_tiles < 1:
        return None
    if not cluster:
        writer.cluster_tiles = 0  # the one-CTA form for every launch prepared from here on
    k = torch.empty(1, batch, H, 1, D, device="cuda", dtype=torch.float16)
    v = torch.empty_like(k)
    appends = StepAppends(cache, k, v)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        appends.enqueue_snapshot()
        appends.enqueue(0)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(T)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(T)]

    def steps() -> None:
        for i in range(T):
            k.normal_(generator=g)  # new tokens each step (outside the timed replay)
            v.normal_(generator=g)
            appends.check_capacity()
            starts[i].record()
            graph.replay()
            ends[i].record()
            appends.advance()

    t0 = time.perf_counter()
    steps()  # warm-up round, which also sizes the lead
    torch.cuda.synchronize()
    lead = queue_lead_us(time.perf_counter() - t0)
    plain, completing, amortized = [], [], []
    for _ in range(rounds):
        time_queued(steps, lead)
        per_step = sorted(s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends))
        plain.append(statistics.median(per_step))
        completing.append(per_step[-1])  # the one replay that compresses: the slowest
        amortized.append(sum(per_step) / T)
    appends.check()
    ranks = writer._cluster.ranks if cluster else 1
    return {
        "batch": batch, "kv_heads": H, "head_dim": D, "preset": "k4v2_g128", "window": W,
        "form": f"cluster x{ranks}" if cluster else "one CTA",
        "step_us": round(statistics.median(plain), 3), "completing_us": round(statistics.median(completing), 3),
        "amortized_us": round(statistics.median(amortized), 3), "rounds": rounds,
    }


def run_append(opts: BenchOptions) -> dict[str, Any]:
    """Results: per batch, GPU and host microseconds of a one-token append (no tile completing; amortized
    over 128 appends with one compression), the checked (synchronizing) call, a static fp16 write; the
    step-graph replays of the same append in both compression forms."""
    graphs = [_step_graph_case(b, cluster, opts) for b in ((1,) if opts.quick else (1, 4)) for cluster in (True, False)]
    return {
        "method": "gpu_us: the appends queued behind a sleep kernel, CUDA events (GPU alone); host_us: wall time of "
                  "the calls inside deferred_checks (no sync); amortized_*: over 128 appends including one that "
                  "completes a tile; checked_us: wall time of an append outside a block (its flag read included); "
                  "step_graph: per-replay CUDA events of a captured StepAppends graph, queued behind a sleep kernel",
        "rows": [_append_case(b, opts) for b in ((1,) if opts.quick else (1, 16))],
        "step_graph": [row for row in graphs if row is not None],
        "targets": {"gpu_us": 5.0, "host_us": 15.0},
    }


register_section("append", run_append, "KVarNCache.append of one token per layer: GPU and host time, no tile and amortized")
