"""Bench section ``e2e``: a Qwen3-8B-shaped decoder end to end, KVarN cache against an fp16 cache.

Model: transformers ``Qwen3Config`` with Qwen3-8B's shape (36 layers, hidden 4096, intermediate 12288,
32 q / 8 KV heads, head_dim 128, vocabulary 151936, untied LM head) and seeded random weights (no
download), float16 on the GPU, built once per command. Both caches run that model object through the same
code, :class:`kvarn_cutlass.hf.static_step.StaticGreedy` (chunked prefill, then the whole decode step
captured once in a CUDA graph and replayed per token), in the same run:

* KVarN: :class:`kvarn_cutlass.hf.KVarNCache` (k4v2_g128, window 256, ``max_seq_len`` = prompt + new
  tokens) with attention ``kvarn``: the fused prefill kernel per chunk and layer; in the graph the device
  append (tile compression included) and the int8 decode kernel;
* fp16: transformers ``StaticCache`` (``max_cache_len`` = prompt + new tokens). Its decode steps attend
  through :func:`fp16_decode_attention` (StaticGreedy's ``decode_attn`` :data:`FP16_DECODE_ATTN`):
  torch's FlashAttention-2 in its varlen form with ``seqused_k``, split-KV over the query heads of each
  KV head, reading only the filled prefix, whose length it computes on the device from the step's
  position, so one graph serves every step (``decode_fp16_baseline`` = ``flash_varlen``). Records
  without that field decoded through transformers' own path (``sdpa`` over the whole static buffer
  with a mask, K/V repeated to the query heads: 204 ms per step at batch 16 / 16k where its bytes take
  ~10 ms). The prefill is transformers' ``sdpa`` path: chunks after the first attend over the whole
  buffer with a materialized mask.
  That is not the strongest fp16 prefill, so TTFT also times :func:`fp16_prefill`: the same model, cache
  and cache writes, with each chunk's attention SDPA flash over the filled prefix only
  (``causal_lower_right``, grouped K/V), as ``bench --section prefill`` times one layer. ``ttft_ms_fp16``
  is the faster of the two and ``ttft_fp16_baseline`` names it (``flash`` / ``static_sdpa``); both are kept
  (``ttft_ms_fp16_flash``, ``ttft_ms_fp16_static_sdpa``).

``rows``: per batch (1, 16) and prefill chunk (512, 2048), a 16384-token random prompt and 300 new tokens:

* ``ttft_ms_*``: time to first token, the whole chunked prefill (every chunk's forward pass with its
  appends and tile compression, the last position's LM head and argmax) between CUDA events, one
  synchronization at the end; median of ``reps`` runs, each on a fresh cache (samples in ``*_samples``),
  the runs of both caches and of the flash baseline alternating round by round (:func:`ttft_rounds`: a
  drifting host moves all three medians alike, and no run always follows the same one); a warm-up
  generation of every (cache, chunk) precedes all timing;
* ``decode_tok_s_*``: batch / median time of one graph-replayed decode step, per-step CUDA events over
  every replay after the first (eager) step, one synchronization at the end; the context grows from the
  prompt to prompt + new tokens over them (``decode_fp16_baseline``: the fp16 decode attention, a key of
  :data:`FP16_DECODE_BASELINES`);
* ``peak_mem_gib_*``: ``torch.cuda.max_memory_allocated`` over the last run's prefill and decode (weights
  included; ``peak_mem_gib_fp16_flash_prefill``: the flash prefills'); ``cache_bytes_*``: the cache's
  tensors (KVarN ``allocated_nbytes()``, with the window backups of the step; fp16 the static K/V
  buffers); ``est_peak_gib_*``: :func:`estimate_bytes`.

``decode_sweep``: decode tokens/s against the context at batch 1 and 16 (the plot): each cache is filled
with random K/V up to the context (``library.append`` / ``StaticLayer.update``; the decode time does
not depend on the values), then a one-token prompt and the same graph-replayed steps.

``granted_context``: the longest context whose cache fits in 8 and 64 GiB (``Plan.budgets_gib``; batch 1,
36 layers, whatever the model's layer count), KVarN against fp16, computed from the record layout
(:func:`kvarn_cache_bytes`: a pool of ``ceil(L / 128)`` records per KV head and layer, the tile table, the
window buffers, the lengths; :func:`fp16_cache_bytes`) and checked by allocating both caches on the GPU:
the bytes they request from this process's caching allocator must be exactly the computed ones (other
processes on the GPU do not change that count; an allocation that fails is recorded, not raised).

Parts: a full run (estimated ~10 min with the first compiles) is more than one 10-minute device command,
so it runs in parts (:func:`plan_parts`): ``gen-b<B>-c<C>`` (one row), ``sweep-b<B>``, ``granted``.
``kvarn-cutlass bench --section e2e --list-parts`` prints each part's estimate (:func:`estimate_part_seconds`,
from H200 rates in :data:`RATES`) and groups them into commands; ``--part NAME`` runs some, and
:func:`merge_results` folds them into the record's e2e entry (rows, sweep points, budgets by key; each part's
measured seconds, date and commit under ``parts``). A run prints its estimates and progress on stderr.

Memory (:func:`estimate_bytes`): weights 16.4 GB; at batch 16 and 16384 + 300 tokens the fp16 cache is
39.4 GB and the KVarN cache 9.0 GB (+0.6 GB window backups); the largest prefill transient (chunk 2048,
fp16: MLP activations 2.4 GB, K/V repeated to 32 heads over the whole buffer 4.4 GB, the mask, hidden
states) ~9 GB: peaks ~65 GB (fp16) and ~30 GB (KVarN), within the H200's 139 GiB. The sweep's largest
point (batch 16, 32k, fp16) needs ~94 GB. A run that still runs out of memory is recorded with its error.

Run: ``kvarn-cutlass bench --section e2e --list-parts`` for the commands, or ``--quick`` (4 layers, a
4096-token prompt, 64 new tokens, a shorter sweep: ~3-4 min, most of it the kernels' first compile on a
cold kernel cache). ``KVARN_E2E_LAYERS=N`` overrides the layer count of either. The README's headline
table and the plot, from the record, without a GPU: ``python3 -m kvarn_cutlass.bench.e2e``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import re
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import BenchOptions, PartsPlan, register_section
from .timing import elapsed_ms, williams_order

__all__ = ["FULL", "QUICK", "QWEN3_8B", "Plan", "estimate_bytes", "estimate_part_seconds", "fp16_cache_bytes",
           "fp16_decode_attention", "fp16_prefill", "fp16_prefill_attention", "granted_context", "headline_markdown",
           "kvarn_cache_bytes", "merge_results", "parts_plan", "plan_parts", "run", "run_plan", "update_readme",
           "write_plot"]

# Qwen3-8B's shape (its config.json), but random weights
QWEN3_8B: dict[str, Any] = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
PRESET, WINDOW = "k4v2_g128", 256
BUDGETS_GIB = (8, 64)
GIB = 2**30
KINDS = ("kvarn", "fp16")


@dataclass(frozen=True)
class Plan:
    """What one run measures: ``layers`` of the model, a ``prompt``-token prompt plus ``new_tokens``, at each of
    ``batches`` x ``chunks`` (``reps`` prefills each), the decode sweep (``(batch, contexts)`` pairs,
    ``sweep_steps`` timed replays per point), and the granted context at each of ``budgets_gib`` (GiB, the
    Qwen3-8B shape's 36 layers whatever ``layers``)."""

    layers: int
    prompt: int
    new_tokens: int
    batches: tuple[int, ...]
    chunks: tuple[int, ...]
    reps: int
    sweep: tuple[tuple[int, tuple[int, ...]], ...]
    sweep_steps: int
    budgets_gib: tuple[float, ...] = BUDGETS_GIB


FULL = Plan(36, 16384, 300, (1, 16), (512, 2048), 3,
            ((1, (1024, 4096, 16384, 32768, 65536, 131072)), (16, (1024, 4096, 16384, 32768))), 32)
QUICK = Plan(4, 4096, 64, (1, 16), (512, 2048), 1, ((1, (1024, 4096)), (16, (1024, 4096))), 16)


# --- memory: the record layout and the model's shape --------------------------------------------------------------
def kvarn_cache_bytes(tokens: int, layers: int, batch: int, kv_heads: int, head_dim: int, preset: str = PRESET,
                      window: int = WINDOW, sink: int = 0) -> int:
    """Bytes of the tensors a :class:`kvarn_cutlass.KVarNCache` (float16 window and sink, float16 scales) with
    ``max_seq_len=tokens`` allocates: per layer the pool of ``ceil((tokens - sink) / T)`` records per sequence
    and KV head (``TileSpec.tile_nbytes`` each), its int32 tile table, the window and sink K/V buffers; the
    int32 lengths [layers, 3, batch], the error flag and the commit counter. Not included: the window
    backups a step graph or ``deferred_checks`` block allocates on first use (:func:`backup_bytes`)."""
    import torch

    from ..format import TileSpec

    spec = TileSpec(preset, head_dim, torch.float16)
    cap = max(0, math.ceil((tokens - sink) / spec.tile_tokens))
    per_layer = batch * cap * (kv_heads * spec.tile_nbytes + 4) + 2 * batch * kv_heads * (window + sink) * head_dim * 2
    return layers * per_layer + layers * 3 * batch * 4 + 4 + 4


def backup_bytes(layers: int, batch: int, kv_heads: int, head_dim: int, window: int = WINDOW, sink: int = 0) -> int:
    """The per-layer window (and sink) backups of a step graph: the K/V buffers once more."""
    return layers * 2 * batch * kv_heads * (window + sink) * head_dim * 2


def fp16_cache_bytes(tokens: int, layers: int, batch: int, kv_heads: int, head_dim: int) -> int:
    """Bytes of a transformers ``StaticCache`` of ``tokens`` in float16: per layer K and V [batch, kv_heads, tokens,
    head_dim] and the int64 ``cumulative_length``."""
    return layers * (2 * batch * kv_heads * tokens * head_dim * 2 + 8)


def weight_bytes(shape: dict[str, Any]) -> int:
    """float16 bytes of a Qwen3 causal LM of ``shape`` (QWEN3_8B's keys): embedding, LM head, per layer the q/k/v/o
    projections, the MLP, two norms and the q/k norms, the final norm."""
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * inter + 2 * h + 2 * shape["head_dim"]
    heads = (1 if shape["tie_word_embeddings"] else 2) * shape["vocab_size"] * h
    return 2 * (heads + layers * per_layer + h)


def estimate_bytes(kind: str, layers: int, batch: int, tokens: int, chunk: int, shape: dict[str, Any] = QWEN3_8B) -> int:
    """Estimated peak device bytes of a run of ``kind`` ('kvarn' or 'fp16') with a ``tokens`` capacity: the
    weights, the cache, and the largest prefill transient: the MLP's three [batch, chunk, intermediate]
    activations and ~6 hidden-state sized ones, plus for fp16 the K/V repeated to the query heads over the whole
    buffer and the [batch, 1, chunk, tokens] mask (what transformers' StaticCache prefill builds)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    s = {**shape, "num_hidden_layers": layers}
    h, inter, D = s["hidden_size"], s["intermediate_size"], s["head_dim"]
    hkv, hq = s["num_key_value_heads"], s["num_attention_heads"]
    transient = 3 * batch * chunk * inter * 2 + 6 * batch * chunk * h * 2
    if kind == "kvarn":
        cache = kvarn_cache_bytes(tokens, layers, batch, hkv, D) + backup_bytes(layers, batch, hkv, D)
    else:
        cache = fp16_cache_bytes(tokens, layers, batch, hkv, D)
        transient += 2 * batch * hq * tokens * D * 2 + batch * chunk * tokens
    return weight_bytes(s) + cache + transient


def granted_context(budget_bytes: int, layers: int, kv_heads: int, head_dim: int, batch: int = 1, preset: str = PRESET,
                    window: int = WINDOW) -> dict[str, int]:
    """The longest context (tokens) whose cache fits in ``budget_bytes``: ``kvarn`` (the largest L with
    :func:`kvarn_cache_bytes` (L) <= budget: a whole number of tiles) and ``fp16`` (:func:`fp16_cache_bytes`)."""
    import torch

    from ..format import TileSpec

    T = TileSpec(preset, head_dim, torch.float16).tile_tokens
    base = kvarn_cache_bytes(0, layers, batch, kv_heads, head_dim, preset, window)
    per_tile = kvarn_cache_bytes(T, layers, batch, kv_heads, head_dim, preset, window) - base
    kvarn = max(0, (budget_bytes - base) // per_tile) * T
    base = fp16_cache_bytes(0, layers, batch, kv_heads, head_dim)
    fp16 = max(0, (budget_bytes - base) // (fp16_cache_bytes(1, layers, batch, kv_heads, head_dim) - base))
    return {"kvarn": int(kvarn), "fp16": int(fp16)}


# --- parts of a run and their estimated durations (no GPU) -------------------------------------------------------------
# H200 rates the estimates assume. Measured in docs/benchmarks/h200.json: an fp16 8192^3 matmul at 765 TFLOPS; one
# layer's chunked prefill of 16384 tokens (32 q / 8 KV heads, batch 1): KVarN 15.3 / 10.5 ms, SDPA flash 8.6 / 7.0 ms
# at chunk 512 / 2048, the appends alone 1.5 ms (chunk 2048); decode's copy ceiling 4250 GB/s. Derated for a whole
# model (GEMMs at 500 TFLOPS, reads at 3 TB/s), transformers' StaticCache prefill (a masked kernel over the whole
# buffer, K/V repeated to the query heads) at 4x flash's time. A decode step: its bytes at that rate plus a fixed
# 3.5 ms (the 36-layer KVarN step measured 9.2 ms at batch 1 / 16k, its bytes 5.7 ms at 3 TB/s; the many small
# kernels of a step). Fixed per command: imports, the model build on the GPU, and the first compiles of the kernels on
# a cold kernel cache (the largest and least certain term).
RATES: dict[str, Any] = {"gemm_flops_s": 500e12, "read_bytes_s": 3.0e12, "kvarn_layer_ms": {512: 15.3, 2048: 10.5},
                         "flash_layer_ms": {512: 8.6, 2048: 7.0}, "static_sdpa_over_flash": 4.0, "append_layer_ms": 1.5,
                         "step_fixed_s": 3.5e-3, "capture_s": 2.0, "imports_s": 20.0, "build_s_per_layer": 1.0,
                         "compile_s": 150.0}
PART_PATTERNS = ("gen-b<batch>-c<chunk>", "sweep-b<batch>", "granted")


def plan_parts(plan: Plan) -> list[str]:
    """The parts of ``plan`` in run order: ``gen-b<B>-c<C>`` (one row: TTFT, decode, peak memory of both caches at batch
    B, chunk C), ``sweep-b<B>`` (the decode sweep's points of batch B), ``granted`` (the granted context)."""
    return ([f"gen-b{b}-c{c}" for b in plan.batches for c in plan.chunks] + [f"sweep-b{b}" for b, _ in plan.sweep]
            + ["granted"])


def _parse_part(plan: Plan, name: str) -> tuple:
    """``("gen", batch, chunk)``, ``("sweep", batch)`` or ``("granted",)``; ValueError naming the part otherwise."""
    if name in plan_parts(plan):
        if name == "granted":
            return ("granted",)
        nums = tuple(int(x) for x in re.findall(r"\d+", name))
        return (name.split("-")[0], *nums)
    raise ValueError(f"part {name!r} is not a part of this e2e plan (patterns {', '.join(PART_PATTERNS)}); "
                     f"its parts: {', '.join(plan_parts(plan))}")


def _nonembedding_params(layers: int, shape: dict[str, Any] = QWEN3_8B) -> int:
    """Weights per layer that every token multiplies (projections and MLP), times ``layers``."""
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    return layers * (2 * h * q + 2 * h * kv + 3 * h * inter)


def _prefill_s(prefill: str, layers: int, batch: int, prompt: int, chunk: int) -> float:
    """Estimated seconds of one chunked prefill; ``prefill``: 'kvarn', 'flash' or 'static_sdpa'."""
    gemm = 2 * batch * prompt * _nonembedding_params(layers) / RATES["gemm_flops_s"]
    table = RATES["kvarn_layer_ms"] if prefill == "kvarn" else RATES["flash_layer_ms"]
    ms = table[min(table, key=lambda c: abs(c - chunk))] * (prompt / 16384) ** 2
    if prefill == "static_sdpa":
        ms *= RATES["static_sdpa_over_flash"]
    return gemm + layers * batch * ms / 1e3


def _step_s(kind: str, layers: int, batch: int, capacity: int) -> float:
    """Estimated seconds of one decode step: the weights and the cache read once (fp16: the flash decode reads the
    filled prefix, within the new tokens of the static buffer's capacity, so the buffer), plus the fixed cost."""
    H, D = QWEN3_8B["num_key_value_heads"], QWEN3_8B["head_dim"]
    cache = (kvarn_cache_bytes(capacity, layers, batch, H, D) if kind == "kvarn"
             else fp16_cache_bytes(capacity, layers, batch, H, D))
    weights = weight_bytes({**QWEN3_8B, "num_hidden_layers": layers})
    return (weights + cache) / RATES["read_bytes_s"] + RATES["step_fixed_s"] * layers / QWEN3_8B["num_hidden_layers"]


def estimate_part_seconds(plan: Plan, part: str) -> float:
    """Estimated seconds of ``part`` of ``plan`` on an H200 (:data:`RATES`), the fixed per-command cost excluded."""
    what = _parse_part(plan, part)
    L = plan.layers
    if what[0] == "gen":
        b, c = what[1:]
        total = plan.prompt + plan.new_tokens
        prefills = sum(_prefill_s(p, L, b, plan.prompt, c) for p in ("kvarn", "static_sdpa", "flash"))
        decode = sum(plan.new_tokens * _step_s(k, L, b, total) + RATES["capture_s"] for k in KINDS)
        return plan.reps * prefills + decode
    if what[0] == "sweep":
        b = what[1]
        t = 0.0
        for context in dict(plan.sweep)[b]:
            fill = L * b * RATES["append_layer_ms"] * context / 16384 / 1e3
            fill += 3 * fp16_cache_bytes(context, L, b, 8, 128) / RATES["read_bytes_s"]  # random K/V, written, copied
            t += fill + sum((plan.sweep_steps + 2) * _step_s(k, L, b, context) + RATES["capture_s"] for k in KINDS)
        return t
    return 2.0 + 2 * sum(b * GIB for b in plan.budgets_gib) / RATES["read_bytes_s"]  # zero-filled allocations


def parts_plan(plan: Plan, parts: list[str] | None = None) -> PartsPlan:
    """The :class:`kvarn_cutlass.bench.PartsPlan` of ``parts`` (default: all) of ``plan``: the fixed seconds (imports;
    with a ``gen`` or ``sweep`` part the model build and the first kernel compiles) and each part's estimate."""
    names = plan_parts(plan) if parts is None else list(dict.fromkeys(parts))
    kinds = {_parse_part(plan, n)[0] for n in names}
    fixed = RATES["imports_s"]
    if kinds - {"granted"}:
        fixed += RATES["build_s_per_layer"] * plan.layers + RATES["compile_s"]
    return PartsPlan(round(fixed), tuple((n, round(estimate_part_seconds(plan, n))) for n in names))


# --- the strongest fp16 prefill: SDPA flash over the filled prefix of a StaticCache ------------------------------------
# the attention implementation of fp16_prefill (no 'flash' in the name: transformers reads such names as flash-attn)
FP16_PREFILL_ATTN = "e2e_fp16_prefill"
FP16_TTFT_BASELINES = {"flash": "SDPA flash (causal_lower_right) over the filled prefix of the static fp16 cache",
                       "static_sdpa": "transformers StaticCache + SDPA (masked, over the whole static buffer)"}


def fp16_prefill_attention(module, query, key, value, attention_mask, scaling: float | None = None,
                           dropout: float = 0.0, kv_end: int | None = None, **kwargs):
    """Attention of one prefill chunk over a transformers StaticCache layer (transformers attention function).

    query float16 [B, Hq, n, D]; key/value: the layer's whole static buffers [B, Hkv, max_cache_len, D] after the
    chunk's update; ``kv_end`` (host int, passed through the model call): the tokens the cache holds with the chunk.
    Attends over ``[:kv_end]`` only with ``causal_lower_right(n, kv_end)``: SDPA's flash backend on CUDA with grouped
    K/V where the build takes it (else K/V expanded to the query heads, as ``bench --section prefill``); on the CPU
    SDPA's default. ``attention_mask`` is None (no mask function is registered) and ``dropout`` 0 (eval). Returns
    (attn_output [B, n, Hq, D], None). Raises ValueError for a missing or out-of-range ``kv_end``.
    """
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    n = query.shape[2]
    if isinstance(kv_end, bool) or not isinstance(kv_end, int) or not n <= kv_end <= key.shape[2]:
        raise ValueError(f"kv_end must be an int in [{n}, {key.shape[2]}] (the tokens the cache holds with this "
                         f"chunk), got {kv_end!r}")
    k, v = key[:, :, :kv_end], value[:, :, :kv_end]
    gqa = query.shape[1] != k.shape[1]
    backend = contextlib.nullcontext()
    if query.is_cuda:
        from .prefill import _gqa_supported

        backend = sdpa_kernel(SDPBackend.FLASH_ATTENTION)
        if gqa and not _gqa_supported(SDPBackend.FLASH_ATTENTION):
            r = query.shape[1] // k.shape[1]
            k, v, gqa = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1), False
    with backend:
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=causal_lower_right(n, kv_end), scale=scaling,
                                             enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def fp16_prefill(model, input_ids, cache, chunk_size: int):
    """Chunked prefill of ``input_ids`` int64 [batch, n] into ``cache``, an empty transformers ``StaticCache`` with
    ``max_cache_len >= n``, through :func:`fp16_prefill_attention` (the model's own projections, RoPE and cache
    update: the cache ends holding what transformers' prefill writes). Non-final chunks run the decoder stack only.
    Returns the last position's logits [batch, vocab]. Raises ValueError for a cache that is not empty or too small,
    or a bad ``chunk_size``."""
    import torch
    from transformers import AttentionInterface

    from ..hf._compat import base_model, cache_kwarg

    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    n = input_ids.shape[1]
    if cache.layers[0].is_initialized:
        raise ValueError("cache must be an empty StaticCache (its chunks' kv_end count from 0)")
    if n > cache.layers[0].max_cache_len:
        raise ValueError(f"cache holds max_cache_len={cache.layers[0].max_cache_len} tokens, fewer than the {n} "
                         "of input_ids")
    AttentionInterface.register(FP16_PREFILL_ATTN, fp16_prefill_attention)
    kw, inner = cache_kwarg(model), base_model(model)
    before = model.config._attn_implementation
    model.set_attn_implementation(FP16_PREFILL_ATTN)
    try:
        with torch.no_grad():
            starts = list(range(0, n, chunk_size))
            for s in starts[:-1]:
                e = min(s + chunk_size, n)
                inner(input_ids=input_ids[:, s:e], use_cache=True, kv_end=e, **{cache_kwarg(inner): cache})
            out = model(input_ids=input_ids[:, starts[-1]:], use_cache=True, logits_to_keep=1, kv_end=n, **{kw: cache})
    finally:
        model.set_attn_implementation(before)
    return out.logits[:, -1]


# --- the strongest fp16 decode: FlashAttention-2 over the filled prefix of a StaticCache ---------------------------
# the attention implementation of the fp16 decode steps (no 'flash' in the name, as FP16_PREFILL_ATTN)
FP16_DECODE_ATTN = "e2e_fp16_decode"
FP16_DECODE_BASELINE = "flash_varlen"  # what the rows' decode_fp16_baseline names
FP16_DECODE_BASELINES = {
    "flash_varlen": "torch's FlashAttention-2 (varlen with seqused_k: the query heads of a KV head in the sequence "
                    "dimension, split-KV) over the filled prefix of the static fp16 cache, its length read on the "
                    "device",
    "static_sdpa": "transformers StaticCache + SDPA (masked, over the whole static buffer, K/V repeated to the query "
                   "heads): the decode of the rows and points recorded before decode_fp16_baseline existed",
}

# (device, sequences, max_cache_len) -> the constant cu_seqlens_q / cu_seqlens_k of _flash_varlen_args
_VARLEN_OFFSETS: dict = {}


def _varlen_offsets(n: int, L: int, device):
    """int32 [n + 1] ``arange(n + 1)`` and ``arange(n + 1) * L`` on ``device``: n sequences of one query each, the
    i-th one's keys at rows [i * L, (i + 1) * L). Kept for reuse, except when made inside a CUDA graph capture (a
    captured kernel has not run yet: a later user outside that graph would read garbage)."""
    import torch

    key = (str(device), n, L)
    got = _VARLEN_OFFSETS.get(key)
    if got is None:
        r = torch.arange(n + 1, dtype=torch.int32, device=device)
        got = (r, r * L)
        if not (got[0].is_cuda and torch.cuda.is_current_stream_capturing()):
            _VARLEN_OFFSETS[key] = got
    return got


def _flash_varlen_args(query, key, value, lengths):
    """The FlashAttention-2 varlen problem of one decode step (:func:`fp16_decode_attention`'s CUDA path).

    query [B, Hq, 1, D]; key/value: contiguous static buffers [B, Hkv, L, D]; lengths int32 [B, Hkv] (contiguous),
    the keys each (sequence, KV head) attends to. Every (b, h) pair is its own varlen sequence with one KV head and
    G = Hq / Hkv query heads (transformers' GQA order: query head h * G + g reads KV head h): q (B * Hkv, G, D),
    K/V viewed as (B * Hkv * L, 1, D) (row stride D; sequence i starts at row i * L), cu_seqlens_q = arange(n + 1),
    cu_seqlens_k = arange(n + 1) * L (n = B * Hkv), seqused_k = lengths (n,), max_q 1, max_k L. Returns
    (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_q, max_k). Raises ValueError for non-contiguous buffers or
    offsets past int32.
    """
    B, Hq, _, D = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    n = B * Hkv
    if not (key.is_contiguous() and value.is_contiguous()):
        raise ValueError("key and value must be the StaticCache layer's contiguous [B, Hkv, max_cache_len, D] buffers "
                         "(the varlen view takes their rows in place)")
    if n * L >= 2**31:
        raise ValueError(f"B * Hkv * max_cache_len = {n * L} keys overflow the int32 cu_seqlens_k")
    cu_q, cu_k = _varlen_offsets(n, L, query.device)
    q = query.reshape(n, Hq // Hkv, D)
    return q, key.view(n * L, 1, D), value.view(n * L, 1, D), cu_q, cu_k, lengths.view(n), 1, L


# _prefix_lengths' one entry: (position_ids, its version, B, Hkv, L, capturing) -> the lengths it computed
_lengths_memo: list = [None, None]


def _prefix_lengths(position_ids, B: int, Hkv: int, L: int):
    """Keys [0, p + 1) per (sequence, KV head), int32 [B, Hkv] on the device, clamped to [1, L]: two small kernels,
    no host read, computed once per step: every layer of a forward pass gets the same ``position_ids`` tensor, so
    later layers (and a captured graph's later nodes) reuse the first layer's result (36 layers: 70 kernels fewer
    per step). The entry is keyed by the tensor (held weakly), its version counter (an in-place update of the
    positions recomputes), the shapes and whether a graph is being captured."""
    import weakref

    import torch

    key = (position_ids._version, B, Hkv, L, position_ids.is_cuda and torch.cuda.is_current_stream_capturing())
    ref, entry = _lengths_memo
    if ref is not None and ref() is position_ids and entry[0] == key:
        return entry[1]
    lengths = torch.empty(B, Hkv, dtype=torch.int32, device=position_ids.device)
    torch.add(position_ids[:, -1:].expand(B, Hkv), 1, out=lengths)
    lengths.clamp_(1, L)
    _lengths_memo[:] = [weakref.ref(position_ids), (key, lengths)]
    return lengths


def fp16_decode_attention(module, query, key, value, attention_mask, scaling: float | None = None,
                          dropout: float = 0.0, position_ids=None, sliding_window: int | None = None, **kwargs):
    """Attention of one decode step over the filled prefix of a transformers StaticCache layer (transformers attention
    function, :data:`FP16_DECODE_ATTN`).

    query [B, Hq, 1, D] (one position per sequence); key/value: the layer's whole static buffers [B, Hkv, L, D]
    (L = max_cache_len, Hq a multiple of Hkv) after the step's update; ``position_ids`` int64 [1, 1] or [B, 1] (the
    model passes its own): the query's position p, which is the slot its K/V were just written to, so the filled
    prefix is keys [0, p + 1) (clamped to [1, L] on the device, so a bad position never reads past the buffer). The
    length stays on the device (no host read): one captured CUDA graph serves every step while it grows.

    On CUDA (float16 / bfloat16, D a multiple of 8 up to 256): ``torch.ops.aten._flash_attention_forward`` in its
    varlen form with ``seqused_k`` (:func:`_flash_varlen_args`): with one query and Hq > Hkv, FlashAttention-2 puts
    the G query heads of a KV head in the sequence dimension and splits the keys over thread blocks (flash-decoding),
    reading each KV head's filled prefix once. Elsewhere: SDPA over the buffer with the unfilled tail zeroed and
    masked on the device (the same attention; the CPU's path, for tests). ``attention_mask`` must be None (no mask
    function is registered), ``dropout`` 0 and ``sliding_window`` None. Returns (attn_output [B, 1, Hq, D] in the
    query's dtype, None). Raises ValueError for other shapes, dtypes on CUDA, position_ids, a mask or dropout.
    """
    import torch

    if not isinstance(query, torch.Tensor) or query.dim() != 4 or query.shape[2] != 1:
        raise ValueError(f"query must be [B, Hq, 1, D] (one position per sequence: a decode step), got "
                         f"{list(getattr(query, 'shape', []))}")
    B, Hq, _, D = query.shape
    if (key.dim() != 4 or value.shape != key.shape or key.shape[0] != B or key.shape[3] != D or key.shape[1] < 1
            or Hq % key.shape[1]):
        raise ValueError(f"key and value must be static buffers [B={B}, Hkv, max_cache_len, D={D}] with Hq={Hq} a "
                         f"multiple of Hkv, got {list(key.shape)} and {list(value.shape)}")
    Hkv, L = key.shape[1], key.shape[2]
    if (not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[0] not in (1, B)
            or position_ids.dtype not in (torch.int32, torch.int64) or position_ids.device != query.device):
        raise ValueError(f"position_ids must be an int [1 or {B}, n] tensor on {query.device} (the query's position: "
                         f"its slot in the static cache), got {getattr(position_ids, 'dtype', position_ids)!r} "
                         f"{list(getattr(position_ids, 'shape', []))}")
    if attention_mask is not None:
        raise ValueError("attention_mask must be None: this attention reads the filled prefix from position_ids")
    if dropout or sliding_window is not None:
        raise ValueError(f"dropout must be 0 and sliding_window None, got {dropout!r} and {sliding_window!r}")
    lengths = _prefix_lengths(position_ids, B, Hkv, L)
    if query.is_cuda:
        if query.dtype not in (torch.float16, torch.bfloat16) or key.dtype != query.dtype or value.dtype != query.dtype:
            raise ValueError(f"query, key and value must share float16 or bfloat16 on CUDA (FlashAttention-2), got "
                             f"{query.dtype}, {key.dtype}, {value.dtype}")
        if D % 8 or D > 256:
            raise ValueError(f"head_dim must be a multiple of 8 up to 256 on CUDA (FlashAttention-2), got {D}")
        q, k, v, cu_q, cu_k, used, max_q, max_k = _flash_varlen_args(query, key, value, lengths)
        out = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, False, False,
                                                      scale=scaling, seqused_k=used)[0]
        return out.reshape(B, 1, Hq, D), None
    import torch.nn.functional as F

    filled = torch.arange(L, device=query.device) < lengths[:, :1].to(torch.int64)  # [B, L]
    # zeroed, not only masked: a masked score gets probability 0, and 0 * NaN in an unfilled V row is NaN
    k = torch.where(filled[:, None, :, None], key, 0)
    v = torch.where(filled[:, None, :, None], value, 0)
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=filled[:, None, None, :], scale=scaling,
                                         enable_gqa=Hq != Hkv)
    return out.transpose(1, 2).contiguous(), None


def _decode_attn(kind: str) -> str | None:
    """StaticGreedy's ``decode_attn`` for a cache of ``kind``: None for KVarN (its own 'kvarn_step'), for fp16
    :data:`FP16_DECODE_ATTN` (registered here, lazily: transformers is imported only with a GPU run)."""
    if kind == "kvarn":
        return None
    from transformers import AttentionInterface

    AttentionInterface.register(FP16_DECODE_ATTN, fp16_decode_attention)
    return FP16_DECODE_ATTN


# --- the GPU run ------------------------------------------------------------------------------------------------------
def _build_model(layers: int, device: str = "cuda", shape: dict[str, Any] = QWEN3_8B):
    """A float16 Qwen3 causal LM of ``shape`` with ``layers`` layers and seeded random weights on ``device``, in eval
    mode, attention ``kvarn``."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    import kvarn_cutlass.hf  # noqa: F401  (registers the 'kvarn' attention)

    config = Qwen3Config(**{**shape, "num_hidden_layers": layers})
    torch.manual_seed(0)
    with torch.device(device):  # the weights are created (and initialized) on the device, in float16
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float16, attn_implementation="kvarn")
    return model.eval()


def _release() -> None:
    """Free the previous run's cache and graph pool before the next one allocates."""
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def _cache_for(model, kind: str, capacity: int):
    """A fresh cache of ``kind`` for ``capacity`` tokens, with the model switched to that cache's prefill attention
    (fp16: transformers' ``sdpa``; its decode steps take :func:`_decode_attn`'s)."""
    if kind == "kvarn":
        import kvarn_cutlass.hf as kh

        model.set_attn_implementation("kvarn")
        return kh.KVarNCache(model.config, preset=PRESET, window=WINDOW, max_seq_len=capacity)
    from transformers import StaticCache

    model.set_attn_implementation("sdpa")
    return StaticCache(config=model.config, max_cache_len=capacity)


def _cache_bytes(cache, kind: str) -> int:
    if kind == "kvarn":
        return cache.library.allocated_nbytes()
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def _step_ms(run, steps: int) -> list[float]:
    """GPU ms of each of ``steps`` replayed decode steps of ``run`` (events between replays; one sync at the end)."""
    import torch

    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    events[0].record()
    for i in range(steps):
        run.step()
        events[i + 1].record()
    events[-1].synchronize()
    return [events[i].elapsed_time(events[i + 1]) for i in range(steps)]


# The prefills a row times, in the order of its first round: both caches through StaticGreedy (the fp16 one over
# transformers' StaticCache + SDPA), then SDPA flash over the fp16 cache's filled prefix (fp16_prefill).
TTFT_RUNS = ("kvarn", "fp16", "fp16_flash")
_TTFT_FIELD = {"kvarn": "ttft_ms_kvarn", "fp16": "ttft_ms_fp16_static_sdpa", "fp16_flash": "ttft_ms_fp16_flash"}


def _generation(model, kind: str, ids, chunk: int, new_tokens: int, decode: bool) -> tuple[float, dict[str, Any]]:
    """One fresh prefill of the cache ``kind`` through StaticGreedy: (its TTFT in ms, and with ``decode`` the decode
    tokens/s, peak memory (prefill and decode) and cache bytes as the row's ``*_<kind>`` fields; fp16 decodes
    through :func:`fp16_decode_attention`, named by ``decode_fp16_baseline``)."""
    import torch

    from ..hf.static_step import StaticGreedy

    batch, prompt = ids.shape
    _release()
    torch.cuda.reset_peak_memory_stats()
    run = StaticGreedy(model, ids, new_tokens, _cache_for(model, kind, prompt + new_tokens), chunk, graph=True,
                       decode_attn=_decode_attn(kind))
    ttft = elapsed_ms(run.prefill)
    out: dict[str, Any] = {}
    if decode:
        run.step()  # the eager first step and the capture
        steps = _step_ms(run, new_tokens - 2)
        out = {f"decode_step_ms_{kind}": round(statistics.median(steps), 4),
               f"decode_tok_s_{kind}": round(batch * 1000.0 / statistics.median(steps), 1),
               f"peak_mem_gib_{kind}": round(torch.cuda.max_memory_allocated() / GIB, 2),
               f"cache_bytes_{kind}": _cache_bytes(run.cache, kind)}
        if kind == "fp16":
            out["decode_fp16_baseline"] = FP16_DECODE_BASELINE
    run.finish()
    del run
    _release()
    return ttft, out


def _flash_ttft(model, ids, chunk: int, capacity: int) -> tuple[float, dict[str, Any]]:
    """One TTFT of :func:`fp16_prefill` (the chunked prefill and the first argmax, timed as :func:`_generation` times
    StaticGreedy's prefill) on a fresh StaticCache of ``capacity``, and the run's peak memory."""
    import torch
    from transformers import StaticCache

    _release()
    torch.cuda.reset_peak_memory_stats()
    cache = StaticCache(config=model.config, max_cache_len=capacity)
    ttft = elapsed_ms(lambda c=cache: fp16_prefill(model, ids, c, chunk).argmax(-1))
    del cache
    out = {"peak_mem_gib_fp16_flash_prefill": round(torch.cuda.max_memory_allocated() / GIB, 2)}
    _release()
    return ttft, out


def _fp16_ttft(row: dict[str, Any]) -> None:
    """``ttft_ms_fp16``: the faster of the measured fp16 prefills, ``ttft_fp16_baseline`` naming it (a key of
    :data:`FP16_TTFT_BASELINES`)."""
    got = {b: row[f"ttft_ms_fp16_{b}"] for b in FP16_TTFT_BASELINES if f"ttft_ms_fp16_{b}" in row}
    if got:
        best = min(got, key=got.get)
        row["ttft_ms_fp16"], row["ttft_fp16_baseline"] = got[best], best


def ttft_rounds(reps: int) -> list[list[str]]:
    """The order of a row's timed prefills: ``reps`` rounds of one prefill of each of :data:`TTFT_RUNS`, in the
    rows of a Williams design (:func:`~kvarn_cutlass.bench.timing.williams_order`), so that a host or clock that
    drifts during the row moves every run's median alike (the samples of one run are never all before or all
    after another's) and no run always follows the same one (a run can inherit its predecessor's clocks and
    allocator state: the prefill bench measured 1-2.5% on an H100 from a fixed predecessor)."""
    return [[TTFT_RUNS[i] for i in williams_order(len(TTFT_RUNS), r)] for r in range(reps)]


def _gen_row(model, plan: Plan, batch: int, chunk: int, device: str = "cuda") -> dict[str, Any]:
    """One row: both caches' generation at ``batch`` and ``chunk``, and the flash fp16 prefill. The TTFT samples of
    the three prefills alternate (:func:`ttft_rounds`); each cache's decode continues its last round's prefill."""
    import torch

    g = torch.Generator(device=device).manual_seed(batch)
    ids = torch.randint(0, QWEN3_8B["vocab_size"], (batch, plan.prompt), generator=g, device=device)
    capacity = plan.prompt + plan.new_tokens
    row: dict[str, Any] = {"batch": batch, "prompt": plan.prompt, "chunk": chunk, "new_tokens": plan.new_tokens}
    for kind in KINDS:
        row[f"est_peak_gib_{kind}"] = round(estimate_bytes(kind, plan.layers, batch, capacity, chunk) / GIB, 2)
    samples: dict[str, list[float]] = {name: [] for name in TTFT_RUNS}
    failed: dict[str, str] = {}
    rounds = ttft_rounds(plan.reps)
    for r, order in enumerate(rounds):
        for name in order:
            if name in failed:
                continue
            try:
                if name == "fp16_flash":
                    t, extra = _flash_ttft(model, ids, chunk, capacity)
                else:
                    t, extra = _generation(model, name, ids, chunk, plan.new_tokens, decode=r == len(rounds) - 1)
            except torch.cuda.OutOfMemoryError as e:  # recorded; the other runs and rows still run
                failed[name] = _oom(e)
                _release()
                continue
            samples[name].append(t)
            row.update(extra)
    for name in TTFT_RUNS:
        if name in failed:
            row[f"error_{name}"] = failed[name]
        elif samples[name]:
            row[_TTFT_FIELD[name]] = round(statistics.median(samples[name]), 2)
            row[f"{_TTFT_FIELD[name]}_samples"] = [round(t, 2) for t in samples[name]]
    _fp16_ttft(row)
    return row


def _fill(cache, kind: str, tokens: int, generator) -> None:
    """``tokens`` random K/V per layer into ``cache`` (already holding a token), in 4096-token pieces."""
    import torch

    if kind == "kvarn":
        lib = cache.library
        B, H, D, L = lib.batch_size, lib.num_kv_heads, lib.head_dim, lib.num_layers
        put, block = lib.append, lib.deferred_checks()
    else:
        layer0 = cache.layers[0]
        B, H, D, L = layer0.keys.shape[0], layer0.keys.shape[1], layer0.keys.shape[3], len(cache.layers)
        put, block = (lambda i, k, v: cache.layers[i].update(k, v)), contextlib.nullcontext()
    with block:
        for i in range(L):
            for s in range(0, tokens, 4096):
                m = min(4096, tokens - s)
                k = torch.randn(B, H, m, D, generator=generator, device="cuda", dtype=torch.float16)
                v = torch.randn(B, H, m, D, generator=generator, device="cuda", dtype=torch.float16)
                put(i, k, v)


def _sweep_point(model, kind: str, batch: int, context: int, steps: int) -> float:
    """Decode tokens/s at ``context`` tokens: the cache filled to context - 1, a one-token prompt, ``steps`` replays."""
    import torch

    from ..hf._compat import cache_kwarg
    from ..hf.static_step import StaticGreedy

    _release()
    cache = _cache_for(model, kind, context + steps + 2)
    g = torch.Generator(device="cuda").manual_seed(context * 31 + batch)
    ids = torch.randint(0, QWEN3_8B["vocab_size"], (batch, 2), generator=g, device="cuda")
    with torch.no_grad():  # one real token creates the cache's buffers on the model's device
        model(input_ids=ids[:, :1], use_cache=True, **{cache_kwarg(model): cache})
    _fill(cache, kind, context - 2, g)
    run = StaticGreedy(model, ids[:, 1:], steps + 2, cache, chunk_size=1, graph=True, decode_attn=_decode_attn(kind))
    run.prefill()
    run.step()
    ms = statistics.median(_step_ms(run, steps))
    run.finish()
    del run, cache
    _release()
    return round(batch * 1000.0 / ms, 1)


def _sweep(model, plan: Plan, batch: int) -> list[dict[str, Any]]:
    """The decode sweep's points of ``batch``."""
    import torch

    points = []
    for context in dict(plan.sweep)[batch]:
        point: dict[str, Any] = {"batch": batch, "context": context}
        for kind in KINDS:
            try:
                point[f"decode_tok_s_{kind}"] = _sweep_point(model, kind, batch, context, plan.sweep_steps)
                if kind == "fp16":
                    point["decode_fp16_baseline"] = FP16_DECODE_BASELINE
            except torch.cuda.OutOfMemoryError as e:
                point[f"error_{kind}"] = _oom(e)
                _release()
        points.append(point)
    return points


def _allocation(make) -> tuple[int, int]:
    """(requested, allocated) device bytes that the object ``make()`` returns holds: the caching allocator's
    ``requested_bytes`` (what the tensors asked for, exact) and ``allocated_bytes`` (whole blocks) of this process,
    around the call; the object is freed after."""
    import torch

    _release()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    obj = make()
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    del obj
    _release()
    delta = {k: int(after[f"{k}_bytes.all.current"] - before[f"{k}_bytes.all.current"]) for k in ("requested", "allocated")}
    return delta["requested"], delta["allocated"]


def _check_granted(budgets_gib: tuple[float, ...], layers: int, shape: dict[str, Any]) -> list[dict[str, Any]]:
    """:func:`granted_context` for each budget (GiB), checked by allocating both caches at that length on the GPU.

    Per budget: the tokens, their computed bytes (``*_bytes``), and what the allocation of the cache took from this
    process's caching allocator: ``*_requested_bytes`` (exact) and ``*_allocated_bytes`` (in whole blocks; other
    processes on the GPU change neither). ``fits``: both caches allocated, each requesting exactly its computed bytes,
    and those within the budget. An allocation that fails is recorded as ``error_<kind>`` (then ``fits`` is False)."""
    import torch
    from transformers import Qwen3Config, StaticCache

    from ..cache import KVarNCache

    H, D = shape["num_key_value_heads"], shape["head_dim"]
    config = Qwen3Config(**{**shape, "num_hidden_layers": layers})

    def static(tokens: int):
        cache = StaticCache(config=config, max_cache_len=tokens)
        cache.early_initialization(1, H, D, torch.float16, torch.device("cuda"))
        return cache

    makers = {"kvarn": lambda n: KVarNCache(layers, 1, H, D, preset=PRESET, window=WINDOW, device="cuda", max_seq_len=n),
              "fp16": static}
    out = []
    for gib in budgets_gib:
        budget = int(gib * GIB)
        g = granted_context(budget, layers, H, D)
        entry: dict[str, Any] = {"budget_gib": gib, "budget_bytes": budget, "layers": layers, "batch": 1,
                                 "kvarn_tokens": g["kvarn"], "fp16_tokens": g["fp16"],
                                 "ratio": round(g["kvarn"] / g["fp16"], 3) if g["fp16"] else None,
                                 "kvarn_bytes": kvarn_cache_bytes(g["kvarn"], layers, 1, H, D),
                                 "fp16_bytes": fp16_cache_bytes(g["fp16"], layers, 1, H, D)}
        for kind in KINDS:
            try:
                entry[f"{kind}_requested_bytes"], entry[f"{kind}_allocated_bytes"] = _allocation(
                    lambda: makers[kind](g[kind]))
            except torch.cuda.OutOfMemoryError as e:
                entry[f"error_{kind}"] = _oom(e)
                _release()
        entry["fits"] = all(f"error_{k}" not in entry and entry[f"{k}_requested_bytes"] == entry[f"{k}_bytes"] <= budget
                            for k in KINDS)
        out.append(entry)
    return out


def _warm_up(model, chunks: tuple[int, ...]) -> None:
    """A short generation of every (cache, chunk) and the flash fp16 prefill of every chunk: loads and compiles every
    kernel before anything is timed."""
    import torch
    from transformers import StaticCache

    from ..hf.static_step import static_greedy

    ids = torch.randint(0, model.config.vocab_size, (1, 2 * max(chunks) + 8), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))
    for chunk in chunks:
        for kind in KINDS:
            static_greedy(model, ids, 4, _cache_for(model, kind, ids.shape[1] + 4), chunk, graph=True,
                          decode_attn=_decode_attn(kind))
            _release()
        fp16_prefill(model, ids, StaticCache(config=model.config, max_cache_len=ids.shape[1]), chunk)
        _release()


def _oom(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def run_plan(plan: Plan, parts: list[str] | None = None, log=None) -> dict[str, Any]:
    """Measure ``parts`` (default: all; :func:`plan_parts`) of ``plan`` on the current CUDA GPU (see the module
    docstring); returns the section's results (``parts``: per part its seconds, estimate, date and commit).
    ``log``: a text stream for the estimates and the progress (None: quiet). Raises ValueError for an unknown part
    before any GPU work."""
    import time

    from .record import provenance

    pp = parts_plan(plan, parts)
    say = (lambda m: print(f"bench e2e: {m}", file=log, flush=True)) if log is not None else (lambda m: None)
    say(f"{len(pp.parts)} part(s), estimated {pp.fixed_s + sum(s for _, s in pp.parts):.0f} s on an H200 "
        f"({pp.fixed_s:.0f} s of it setup: imports, model build, first kernel compiles)")
    what = {name: _parse_part(plan, name) for name, _ in pp.parts}
    gen_chunks = tuple(sorted({w[2] for w in what.values() if w[0] == "gen"}))
    prov = provenance()
    t0 = time.perf_counter()
    model = weights = None
    if any(w[0] != "granted" for w in what.values()):
        model = _build_model(plan.layers)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if gen_chunks:
        _warm_up(model, gen_chunks)
    say(f"setup done in {time.perf_counter() - t0:.0f} s")
    rows, sweep, granted, timing = [], [], [], {}
    for name, est in pp.parts:
        say(f"{name}: running (estimated {est:.0f} s)")
        t = time.perf_counter()
        w = what[name]
        if w[0] == "gen":
            rows.append(_gen_row(model, plan, w[1], w[2]))
        elif w[0] == "sweep":
            sweep.extend(_sweep(model, plan, w[1]))
        else:
            granted = _check_granted(plan.budgets_gib, QWEN3_8B["num_hidden_layers"], QWEN3_8B)
        timing[name] = {"seconds": round(time.perf_counter() - t, 1), "estimate_s": est, "date": prov["date"],
                        "git_commit": prov["git_commit"]}
        say(f"{name}: done in {timing[name]['seconds']:.0f} s")
    del model
    _release()
    results: dict[str, Any] = {
        "shape": {**QWEN3_8B, "num_hidden_layers": plan.layers, "preset": PRESET, "window": WINDOW},
        "plan": asdict(plan),
        "method": "one model, both caches through kvarn_cutlass.hf.static_step.StaticGreedy; TTFT: whole chunked "
                  "prefill + first argmax between CUDA events, one sync, median of reps on fresh caches after a "
                  "warm-up, the prefills of both caches and the flash baseline alternating round by round; "
                  "ttft_ms_fp16: the faster of SDPA flash (causal_lower_right) over the filled prefix of a "
                  "static fp16 cache and transformers StaticCache + sdpa, named by ttft_fp16_baseline; decode: "
                  "batch / median per-step time of CUDA-graph replays (per-step events, one sync); fp16 decode: "
                  "FlashAttention-2 varlen (seqused_k on the device) over the filled prefix of the StaticCache, "
                  "named by decode_fp16_baseline",
        "rows": rows,
        "decode_sweep": sweep,
        "granted_context": granted,
        "parts": timing,
    }
    if weights is not None:
        results["weights_gib"] = round(weights / GIB, 2)
    results["bars"] = _bars(results)
    return results


def _config(results: dict[str, Any]) -> tuple:
    """What must agree for two runs' results to merge: the shape, the run's sizes, quick."""
    plan = results.get("plan") or {}
    return (results.get("shape"), tuple(plan.get(k) for k in ("layers", "prompt", "new_tokens", "reps", "sweep_steps")),
            bool(results.get("quick")))


def merge_results(recorded: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new`` (a run of some parts) over ``recorded`` (the e2e results in the record): when both measured the same
    configuration (:func:`_config`), the rows by (batch, prompt, chunk), the sweep points by (batch, context), the
    granted contexts by budget and the parts' timings by name, the new replacing the recorded, in order; the bars
    recomputed. Otherwise ``new`` alone (a quick run never mixes with a full one)."""
    if _config(recorded) != _config(new):
        return new

    def union(key, field: str) -> list[dict[str, Any]]:
        merged = {key(x): x for x in recorded.get(field, [])}
        merged.update({key(x): x for x in new.get(field, [])})
        return [merged[k] for k in sorted(merged)]

    out = {**recorded, **new}
    out["rows"] = union(lambda r: (r["batch"], r["prompt"], r["chunk"]), "rows")
    out["decode_sweep"] = union(lambda p: (p["batch"], p["context"]), "decode_sweep")
    out["granted_context"] = union(lambda g: g["budget_gib"], "granted_context")
    out["parts"] = {**recorded.get("parts", {}), **new.get("parts", {})}
    out["bars"] = _bars(out)
    return out


def _measured_text(results: dict[str, Any], provenance: dict[str, Any]) -> str:
    """When and at which commit the record's parts were measured: one date and commit, or, for a record merged from
    runs of several commits, each commit with its parts (``parts``: part -> date, commit)."""
    by_commit: dict[str, list[str]] = {}
    first: dict[str, str] = {}
    for name, part in sorted(results.get("parts", {}).items()):
        commit, date = part.get("git_commit"), str(part.get("date", ""))
        by_commit.setdefault(commit, []).append(name)
        first[commit] = min(first.get(commit, date), date)
    if len(by_commit) <= 1:
        return f"{str(provenance.get('date', ''))[:10]}, commit {provenance.get('git_commit')}"
    days = sorted({d[:10] for d in first.values()})
    span = days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}"
    return f"{span}, commits " + "; ".join(f"{c} ({', '.join(by_commit[c])})" for c in sorted(by_commit, key=first.get))


def _bars(results: dict[str, Any]) -> dict[str, bool]:
    """Issue 17's bars at prompt 16384, and its goals (batch 16 / 32k decode, granted context)."""
    bars: dict[str, bool] = {}
    for r in results["rows"]:
        if r["prompt"] != 16384 or any(f"error_{k}" in r for k in KINDS):
            continue
        tag = f"b{r['batch']}_c{r['chunk']}"
        bars[f"{tag}_ttft_kvarn_le_fp16"] = r["ttft_ms_kvarn"] <= r["ttft_ms_fp16"]
        need = 1.3 if r["batch"] == 16 else 1.0
        bars[f"{tag}_decode_kvarn_ge_{need}x_fp16"] = r["decode_tok_s_kvarn"] >= need * r["decode_tok_s_fp16"]
    for p in results["decode_sweep"]:
        if (p["batch"], p["context"]) == (16, 32768) and "decode_tok_s_fp16" in p and "decode_tok_s_kvarn" in p:
            bars["goal_b16_32k_decode_kvarn_ge_1.5x_fp16"] = p["decode_tok_s_kvarn"] >= 1.5 * p["decode_tok_s_fp16"]
    for g in results["granted_context"]:
        if g.get("ratio") is not None:
            bars[f"goal_granted_{g['budget_gib']}gib_ge_4.5x"] = g["ratio"] >= 4.5
    return bars


def _plan(opts: BenchOptions) -> Plan:
    """FULL (QUICK with ``opts.quick``), with the layer count of ``KVARN_E2E_LAYERS`` if set."""
    plan = QUICK if opts.quick else FULL
    layers = os.environ.get("KVARN_E2E_LAYERS")
    if layers:
        if not layers.isdigit() or int(layers) < 1:
            raise ValueError(f"KVARN_E2E_LAYERS must be a positive int, got {layers!r}")
        plan = Plan(**{**asdict(plan), "layers": int(layers)})
    return plan


def run(opts: BenchOptions) -> dict[str, Any]:
    plan = _plan(opts)
    parts = list(opts.parts) or None
    if parts:
        parts_plan(plan, parts)  # an unknown part fails here, before the GPU is touched
    return {**run_plan(plan, parts, log=sys.stderr), "quick": opts.quick}


def parts_of(opts: BenchOptions) -> PartsPlan:
    """The section's parts under ``opts`` (``kvarn-cutlass bench --section e2e --list-parts``)."""
    return parts_plan(_plan(opts))


register_section("e2e", run, "Qwen3-8B-shaped model end to end: TTFT, decode tok/s, granted context, KVarN vs fp16",
                 parts=parts_of, merge=merge_results)


# --- the README's headline table and the plot (no GPU) ------------------------------------------------------------------
README_BEGIN = "<!-- kvarn-e2e:begin (generated by python3 -m kvarn_cutlass.bench.e2e; do not edit) -->"
README_END = "<!-- kvarn-e2e:end -->"
PLOT_NAME = "e2e_decode.png"


def _num(x: Any, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, (int, float)) and not isinstance(x, bool) else "-"


def _ratio(a: Any, b: Any) -> str:
    ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)) and b
    return f"{a / b:.2f}x" if ok else "-"


def _decode_baseline(x: dict[str, Any]) -> str:
    """The fp16 decode baseline of a row or sweep point: its ``decode_fp16_baseline``, or ``static_sdpa`` for one
    recorded before the field existed (transformers' masked SDPA decode was the only one then)."""
    return x.get("decode_fp16_baseline", "static_sdpa")


def headline_markdown(doc: dict[str, Any], plot: str | None = None) -> str:
    """The README's headline block for a benchmark record ``doc`` (``{"sections": {"e2e": ...}}``): the rows as a
    table with the ratios computed from the stored values, the granted context, the run's provenance and the
    command that reproduces it; a placeholder saying how to produce it when the record has no e2e section.
    ``plot``: path of the decode plot to link, as the README sees it."""
    command = ("kvarn-cutlass bench --section e2e --list-parts  # the parts, their estimates, the commands to run\n"
               "kvarn-cutlass bench --section e2e --part ...   # each on an H200 (--quick: a 4-layer smoke run);\n"
               "                                               # merges into docs/benchmarks/h200.json\n"
               "python3 -m kvarn_cutlass.bench.e2e             # rewrites this block and the plot from that record")
    entry = (doc.get("sections") or {}).get("e2e")
    if not entry:
        return ("Not measured yet. On an H200 run\n\n```bash\n" + command + "\n```\n\nto fill this section with "
                "time to first token, decode tokens/s, peak memory\nand granted context for a Qwen3-8B-shaped model "
                "(36 layers, 16k prompt, 300 new tokens), KVarN k4v2_g128\nagainst an fp16 cache on the same model.")
    res, prov = entry["results"], entry.get("provenance", {})
    shape = res.get("shape", {})
    lines = []
    if res.get("quick") or shape.get("num_hidden_layers") != QWEN3_8B["num_hidden_layers"]:
        lines.append(f"**Smoke-test numbers** (a reduced run: {shape.get('num_hidden_layers')} layers, "
                     f"{res.get('plan', {}).get('prompt')}-token prompt), not the headline configuration.\n")
    lines.append(f"Qwen3-8B-shaped decoder ({shape.get('num_hidden_layers')} layers, hidden {shape.get('hidden_size')}, "
                 f"{shape.get('num_attention_heads')} q / {shape.get('num_key_value_heads')} KV heads, head_dim "
                 f"{shape.get('head_dim')}, random weights, fp16) on an {prov.get('gpu', 'unknown GPU')}, "
                 f"{_measured_text(res, prov)}. KVarN {shape.get('preset')} "
                 f"(window {shape.get('window')}) against an fp16 cache; both decode from one CUDA graph per step. "
                 "TTFT: the whole chunked prefill; fp16 TTFT: the faster of SDPA flash (causal_lower_right) over the "
                 "filled prefix of a static fp16 cache and transformers' StaticCache with SDPA, named beside it; "
                 "decode: graph-replayed steps, the fp16 decode attention named beside it (the names are explained "
                 "below the table).\n")
    lines.append("| batch | prompt + new | chunk | TTFT KVarN (ms) | TTFT fp16 (ms) | fp16 / KVarN | decode KVarN (tok/s) "
                 "| decode fp16 (tok/s) | KVarN / fp16 | peak KVarN / fp16 (GiB) |")
    lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in res.get("rows", []):
        lines.append(
            f"| {r['batch']} | {r['prompt']} + {r.get('new_tokens', '-')} | {r['chunk']} | "
            f"{_num(r.get('ttft_ms_kvarn'), '.1f')} | {_num(r.get('ttft_ms_fp16'), '.1f')}"
            f"{' (' + r['ttft_fp16_baseline'] + ')' if r.get('ttft_fp16_baseline') else ''} | "
            f"{_ratio(r.get('ttft_ms_fp16'), r.get('ttft_ms_kvarn'))} | {_num(r.get('decode_tok_s_kvarn'), '.1f')} | "
            f"{_num(r.get('decode_tok_s_fp16'), '.1f')}"
            f"{' (' + _decode_baseline(r) + ')' if 'decode_tok_s_fp16' in r else ''} | "
            f"{_ratio(r.get('decode_tok_s_kvarn'), r.get('decode_tok_s_fp16'))} | "
            f"{_num(r.get('peak_mem_gib_kvarn'), '.1f')} / {_num(r.get('peak_mem_gib_fp16'), '.1f')} |")
    errors = [f"batch {r['batch']} chunk {r['chunk']} {k}: {r[f'error_{k}']}" for r in res.get("rows", [])
              for k in (*KINDS, "fp16_flash") if f"error_{k}" in r]
    used = sorted({r["ttft_fp16_baseline"] for r in res.get("rows", []) if r.get("ttft_fp16_baseline")})
    if used:
        lines.append("\nfp16 TTFT baseline: " + "; ".join(f"{b}: {FP16_TTFT_BASELINES.get(b, b)}" for b in used) + ".")
    measured = [x for x in (*res.get("rows", []), *res.get("decode_sweep", [])) if "decode_tok_s_fp16" in x]
    decode_used = sorted({_decode_baseline(x) for x in measured})
    if decode_used:
        lines.append("\nfp16 decode baseline: " + "; ".join(f"{b}: {FP16_DECODE_BASELINES.get(b, b)}"
                                                          for b in decode_used) + ".")
    if "static_sdpa" in decode_used:
        lines.append("static_sdpa is not the strongest fp16 decode: the decode ratios against it overstate KVarN's "
                     "advantage.")
    if errors:
        lines.append("\nNot measured: " + "; ".join(errors) + ".")
    granted = res.get("granted_context", [])
    if granted:
        parts = [f"{g['budget_gib']} GiB: KVarN {g['kvarn_tokens']:,} tokens, fp16 {g['fp16_tokens']:,} "
                 f"({_ratio(g['kvarn_tokens'], g['fp16_tokens'])}{'' if g.get('fits') else ', allocation check FAILED'})"
                 for g in granted]
        lines.append(f"\nLongest context whose cache fits (batch 1, {granted[0]['layers']} layers; allocated on the GPU "
                     "to check): " + "; ".join(parts) + ".")
    if plot:
        lines.append(f"\n![decode tokens/s against context]({plot})")
    lines.append("\nReproduce:\n\n```bash\n" + command + "\n```")
    return "\n".join(lines)


def update_readme(readme: str, block: str) -> str:
    """``readme`` with the text between :data:`README_BEGIN` and :data:`README_END` replaced by ``block``.
    Raises ValueError if the markers are not there exactly once each, in order."""
    begin, end = readme.count(README_BEGIN), readme.count(README_END)
    if begin != 1 or end != 1 or readme.index(README_BEGIN) > readme.index(README_END):
        raise ValueError(f"the README must hold the markers {README_BEGIN!r} and {README_END!r} once each, in order")
    pattern = re.compile(re.escape(README_BEGIN) + ".*?" + re.escape(README_END), re.S)
    return pattern.sub(lambda _m: f"{README_BEGIN}\n{block.strip()}\n{README_END}", readme)


def write_plot(results: dict[str, Any], path: str | os.PathLike) -> Path:
    """Decode tokens/s against context (``results["decode_sweep"]``), KVarN and fp16 per batch, log-log, as a PNG.
    Raises :class:`kvarn_cutlass.bench.plots.PlotsUnavailable` without matplotlib."""
    from matplotlib.ticker import FuncFormatter

    from .plots import _context_label, _figure, _plain_log_y, _save

    fig = _figure()
    ax = fig.add_subplot()
    sweep = results.get("decode_sweep", [])
    for i, batch in enumerate(sorted({p["batch"] for p in sweep})):
        pts = sorted((p for p in sweep if p["batch"] == batch), key=lambda p: p["context"])
        lines = [("decode_tok_s_kvarn", "KVarN k4v2", "o-", pts)]
        # one fp16 line per decode baseline: a merged record can hold points of an older one
        for j, b in enumerate(sorted({_decode_baseline(p) for p in pts if "decode_tok_s_fp16" in p})):
            lines.append(("decode_tok_s_fp16", f"fp16 {b}", ("s--", "^:")[min(j, 1)],
                          [p for p in pts if _decode_baseline(p) == b]))
        for key, label, style, sel in lines:
            xy = [(p["context"], p[key]) for p in sel if isinstance(p.get(key), (int, float))]
            if xy:
                ax.plot(*zip(*xy), style, color=f"C{i}", label=f"{label}, batch {batch}")
    layers = results.get("shape", {}).get("num_hidden_layers")
    ax.set_xscale("log", base=2)
    _plain_log_y(ax)
    ax.xaxis.set_major_formatter(FuncFormatter(_context_label))
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tokens/s (CUDA graph per step)")
    ax.set_title(f"Decode, Qwen3-8B shape ({layers} layers), KVarN vs fp16")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    return _save(fig, out)


def main(argv: list[str] | None = None) -> int:
    """``python3 -m kvarn_cutlass.bench.e2e``: the README's headline block and the plot from a record."""
    from .plots import PlotsUnavailable
    from .record import REPO_ROOT
    from .report import load_record

    root = REPO_ROOT or Path.cwd()
    ap = argparse.ArgumentParser(prog="python3 -m kvarn_cutlass.bench.e2e", description=main.__doc__)
    ap.add_argument("--record", default=str(root / "docs" / "benchmarks" / "h200.json"), help="benchmark record")
    ap.add_argument("--readme", default=str(root / "README.md"), help="README holding the headline markers")
    ap.add_argument("--no-plot", action="store_true", help="do not draw the plot")
    args = ap.parse_args(argv)
    record, readme = Path(args.record), Path(args.readme)
    doc = load_record(record)
    plot = None
    entry = doc["sections"].get("e2e")
    if entry and not args.no_plot:
        target = record.parent / f"{record.stem}-{PLOT_NAME}"
        try:
            write_plot(entry["results"], target)
        except PlotsUnavailable as e:
            print(f"{e}; the headline links no plot", file=sys.stderr)
        else:
            plot = os.path.relpath(target, readme.parent).replace(os.sep, "/")
            print(f"wrote {target}")
    readme.write_text(update_readme(readme.read_text(), headline_markdown(doc, plot)))
    print(f"updated {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
