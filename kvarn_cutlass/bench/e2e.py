"""Bench section ``e2e``: a Qwen3-8B-shaped decoder end to end, KVarN cache against an fp16 cache.

Model: transformers ``Qwen3Config`` with Qwen3-8B's shape (36 layers, hidden 4096, intermediate 12288,
32 q / 8 KV heads, head_dim 128, vocabulary 151936, untied LM head) and seeded random weights (no
download), float16 on the GPU, built once. Both caches run that model object through the same code,
:class:`kvarn_cutlass.hf.static_step.StaticGreedy` (chunked prefill, then the whole decode step captured
once in a CUDA graph and replayed per token), in the same run:

* KVarN: :class:`kvarn_cutlass.hf.KVarNCache` (k4v2_g128, window 256, ``max_seq_len`` = prompt + new
  tokens) with attention ``kvarn``: the fused prefill kernel per chunk and layer; in the graph the device
  append (tile compression included) and the int8 decode kernel;
* fp16: transformers ``StaticCache`` (``max_cache_len`` = prompt + new tokens) with attention ``sdpa``,
  transformers' own path: a decode step attends over the whole static buffer with a mask built on the
  device (SDPA on the KV heads, ``pack_gqa``); prefill chunks after the first attend over the whole
  buffer with a materialized mask and K/V repeated to the query heads. That is what transformers does
  with a StaticCache, not the best fp16 prefill: ``bench --section prefill`` compares the attention
  kernels with flash attention.

``rows``: per batch (1, 16) and prefill chunk (512, 2048), a 16384-token random prompt and 300 new tokens:

* ``ttft_ms_*``: time to first token, the whole chunked prefill (every chunk's forward pass with its
  appends and tile compression, the last position's LM head and argmax) between CUDA events, one
  synchronization at the end; median of ``reps`` runs, each on a fresh cache (samples in ``*_samples``);
  a warm-up generation of every (cache, chunk) precedes all timing;
* ``decode_tok_s_*``: batch / median time of one graph-replayed decode step, per-step CUDA events over
  every replay after the first (eager) step, one synchronization at the end; the context grows from the
  prompt to prompt + new tokens over them;
* ``peak_mem_gib_*``: ``torch.cuda.max_memory_allocated`` over the last run's prefill and decode (weights
  included); ``cache_bytes_*``: the cache's tensors (KVarN ``allocated_nbytes()``, with the window backups
  of the step; fp16 the static K/V buffers); ``est_peak_gib_*``: :func:`estimate_bytes`.

``decode_sweep``: decode tokens/s against the context at batch 1 and 16 (the plot): each cache is filled
with random K/V up to the context (``library.append`` / ``StaticLayer.update``; the decode time does
not depend on the values), then a one-token prompt and the same graph-replayed steps.

``granted_context``: the longest context whose cache fits in 8 and 64 GiB (batch 1, 36 layers, whatever
the model's layer count), KVarN against fp16, computed from the record layout (:func:`kvarn_cache_bytes`:
a pool of ``ceil(L / 128)`` records per KV head and layer, the tile table, the window buffers, the
lengths) and checked by allocating both caches on the GPU (``torch.cuda.memory_allocated`` around it).

Memory (:func:`estimate_bytes`): weights 16.4 GB; at batch 16 and 16384 + 300 tokens the fp16 cache is
39.4 GB and the KVarN cache 9.0 GB (+0.6 GB window backups); the largest prefill transient (chunk 2048,
fp16: MLP activations 2.4 GB, K/V repeated to 32 heads over the whole buffer 4.4 GB, the mask, hidden
states) ~9 GB: peaks ~65 GB (fp16) and ~30 GB (KVarN), within the H200's 139 GiB. The sweep's largest
point (batch 16, 32k, fp16) needs ~94 GB. A run that still runs out of memory is recorded with its error.

Run: ``kvarn-cutlass bench --section e2e`` (estimated ~6 min on an H200: the batch-16 prefills dominate),
``--quick`` (4 layers, a 4096-token prompt, 64 new tokens, a shorter sweep: ~1-2 min, most of it the
kernels' first compile on a cold kernel cache). ``KVARN_E2E_LAYERS=N`` overrides the layer count of
either. The README's headline table and the plot, from the record, without a GPU:
``python3 -m kvarn_cutlass.bench.e2e``.
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

from . import BenchOptions, register_section

__all__ = ["FULL", "QUICK", "QWEN3_8B", "Plan", "estimate_bytes", "fp16_cache_bytes", "granted_context",
           "headline_markdown", "kvarn_cache_bytes", "run", "run_plan", "update_readme", "write_plot"]

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
    ``batches`` x ``chunks`` (``reps`` prefills each), and the decode sweep (``(batch, contexts)`` pairs,
    ``sweep_steps`` timed replays per point)."""

    layers: int
    prompt: int
    new_tokens: int
    batches: tuple[int, ...]
    chunks: tuple[int, ...]
    reps: int
    sweep: tuple[tuple[int, tuple[int, ...]], ...]
    sweep_steps: int


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
    """Bytes of a transformers ``StaticCache`` of ``tokens`` in float16: K and V [batch, kv_heads, tokens, head_dim]
    per layer."""
    return layers * 2 * batch * kv_heads * tokens * head_dim * 2


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
    fp16 = budget_bytes // fp16_cache_bytes(1, layers, batch, kv_heads, head_dim)
    return {"kvarn": int(kvarn), "fp16": int(fp16)}


# --- the GPU run ------------------------------------------------------------------------------------------------------
def _build_model(layers: int):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    import kvarn_cutlass.hf  # noqa: F401  (registers the 'kvarn' attention)

    config = Qwen3Config(**{**QWEN3_8B, "num_hidden_layers": layers})
    torch.manual_seed(0)
    with torch.device("cuda"):  # the weights are created (and initialized) on the GPU, in float16
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float16, attn_implementation="kvarn")
    return model.eval()


def _release() -> None:
    """Free the previous run's cache and graph pool before the next one allocates."""
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def _cache_for(model, kind: str, capacity: int):
    """A fresh cache of ``kind`` for ``capacity`` tokens, with the model switched to that cache's attention."""
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


def _elapsed_ms(fn) -> float:
    import torch

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


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


def _generation(model, kind: str, ids, chunk: int, new_tokens: int, reps: int) -> dict[str, Any]:
    """TTFT (median of ``reps`` fresh prefills), decode tokens/s and peak memory of one (cache, batch, chunk),
    as the row's ``*_<kind>`` fields."""
    import torch

    from ..hf.static_step import StaticGreedy

    batch, prompt = ids.shape
    ttft, run = [], None
    for _ in range(reps):
        run = None
        _release()
        torch.cuda.reset_peak_memory_stats()
        run = StaticGreedy(model, ids, new_tokens, _cache_for(model, kind, prompt + new_tokens), chunk, graph=True)
        ttft.append(_elapsed_ms(run.prefill))
    run.step()  # the eager first step and the capture
    steps = _step_ms(run, new_tokens - 2)
    run.finish()
    out = {f"ttft_ms_{kind}": round(statistics.median(ttft), 2),
           f"ttft_ms_{kind}_samples": [round(t, 2) for t in ttft],
           f"decode_step_ms_{kind}": round(statistics.median(steps), 4),
           f"decode_tok_s_{kind}": round(batch * 1000.0 / statistics.median(steps), 1),
           f"peak_mem_gib_{kind}": round(torch.cuda.max_memory_allocated() / GIB, 2),
           f"cache_bytes_{kind}": _cache_bytes(run.cache, kind)}
    del run
    _release()
    return out


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
    run = StaticGreedy(model, ids[:, 1:], steps + 2, cache, chunk_size=1, graph=True)
    run.prefill()
    run.step()
    ms = statistics.median(_step_ms(run, steps))
    run.finish()
    del run, cache
    _release()
    return round(batch * 1000.0 / ms, 1)


def _check_granted(layers: int, shape: dict[str, Any]) -> list[dict[str, Any]]:
    """:func:`granted_context` for each budget, both caches allocated on the GPU at that length."""
    import torch
    from transformers import Qwen3Config, StaticCache

    from ..cache import KVarNCache

    H, D = shape["num_key_value_heads"], shape["head_dim"]
    out = []
    for gib in BUDGETS_GIB:
        budget = gib * GIB
        g = granted_context(budget, layers, H, D)
        _release()
        before = torch.cuda.memory_allocated()
        cache = KVarNCache(layers, 1, H, D, preset=PRESET, window=WINDOW, device="cuda", max_seq_len=g["kvarn"])
        kv_alloc = torch.cuda.memory_allocated() - before
        del cache
        _release()
        before = torch.cuda.memory_allocated()
        static = StaticCache(config=Qwen3Config(**{**shape, "num_hidden_layers": layers}), max_cache_len=g["fp16"])
        static.early_initialization(1, H, D, torch.float16, torch.device("cuda"))
        fp_alloc = torch.cuda.memory_allocated() - before
        del static
        _release()
        out.append({"budget_gib": gib, "layers": layers, "batch": 1, "kvarn_tokens": g["kvarn"], "fp16_tokens": g["fp16"],
                    "ratio": round(g["kvarn"] / g["fp16"], 3),
                    "kvarn_bytes": kvarn_cache_bytes(g["kvarn"], layers, 1, H, D),
                    "fp16_bytes": fp16_cache_bytes(g["fp16"], layers, 1, H, D),
                    "kvarn_allocated_bytes": int(kv_alloc), "fp16_allocated_bytes": int(fp_alloc),
                    "fits": bool(kv_alloc <= budget and fp_alloc <= budget)})
    return out


def _warm_up(model, chunks: tuple[int, ...]) -> None:
    """A short generation of every (cache, chunk): loads and compiles every kernel before anything is timed."""
    import torch

    from ..hf.static_step import static_greedy

    ids = torch.randint(0, QWEN3_8B["vocab_size"], (1, 2 * max(chunks) + 8), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))
    for kind in KINDS:
        for chunk in chunks:
            static_greedy(model, ids, 4, _cache_for(model, kind, ids.shape[1] + 4), chunk, graph=True)
            _release()


def _oom(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def run_plan(plan: Plan) -> dict[str, Any]:
    """Measure ``plan`` on the current CUDA GPU (see the module docstring); returns the section's results."""
    import torch

    model = _build_model(plan.layers)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    _warm_up(model, plan.chunks)
    rows = []
    for batch in plan.batches:
        g = torch.Generator(device="cuda").manual_seed(batch)
        ids = torch.randint(0, QWEN3_8B["vocab_size"], (batch, plan.prompt), generator=g, device="cuda")
        for chunk in plan.chunks:
            row: dict[str, Any] = {"batch": batch, "prompt": plan.prompt, "chunk": chunk, "new_tokens": plan.new_tokens}
            for kind in KINDS:
                row[f"est_peak_gib_{kind}"] = round(
                    estimate_bytes(kind, plan.layers, batch, plan.prompt + plan.new_tokens, chunk) / GIB, 2)
                try:
                    row.update(_generation(model, kind, ids, chunk, plan.new_tokens, plan.reps))
                except torch.cuda.OutOfMemoryError as e:  # recorded; the other rows still run
                    row[f"error_{kind}"] = _oom(e)
                    _release()
            rows.append(row)
    sweep = []
    for batch, contexts in plan.sweep:
        for context in contexts:
            point: dict[str, Any] = {"batch": batch, "context": context}
            for kind in KINDS:
                try:
                    point[f"decode_tok_s_{kind}"] = _sweep_point(model, kind, batch, context, plan.sweep_steps)
                except torch.cuda.OutOfMemoryError as e:
                    point[f"error_{kind}"] = _oom(e)
                    _release()
            sweep.append(point)
    del model
    _release()
    results = {
        "shape": {**QWEN3_8B, "num_hidden_layers": plan.layers, "preset": PRESET, "window": WINDOW},
        "plan": asdict(plan),
        "weights_gib": round(weights / GIB, 2),
        "method": "one model, both caches through kvarn_cutlass.hf.static_step.StaticGreedy; TTFT: whole chunked "
                  "prefill + first argmax between CUDA events, one sync, median of reps on fresh caches after a "
                  "warm-up; decode: batch / median per-step time of CUDA-graph replays (per-step events, one sync); "
                  "fp16: transformers StaticCache + sdpa (masked attention over the whole static buffer)",
        "rows": rows,
        "decode_sweep": sweep,
        "granted_context": _check_granted(QWEN3_8B["num_hidden_layers"], QWEN3_8B),
    }
    results["bars"] = _bars(results)
    return results


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
        bars[f"goal_granted_{g['budget_gib']}gib_ge_4.5x"] = g["ratio"] >= 4.5
    return bars


def run(opts: BenchOptions) -> dict[str, Any]:
    plan = QUICK if opts.quick else FULL
    layers = os.environ.get("KVARN_E2E_LAYERS")
    if layers:
        if not layers.isdigit() or int(layers) < 1:
            raise ValueError(f"KVARN_E2E_LAYERS must be a positive int, got {layers!r}")
        plan = Plan(**{**asdict(plan), "layers": int(layers)})
    return {**run_plan(plan), "quick": opts.quick}


register_section("e2e", run, "Qwen3-8B-shaped model end to end: TTFT, decode tok/s, granted context, KVarN vs fp16")


# --- the README's headline table and the plot (no GPU) ------------------------------------------------------------------
README_BEGIN = "<!-- kvarn-e2e:begin (generated by python3 -m kvarn_cutlass.bench.e2e; do not edit) -->"
README_END = "<!-- kvarn-e2e:end -->"
PLOT_NAME = "e2e_decode.png"


def _num(x: Any, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, (int, float)) and not isinstance(x, bool) else "-"


def _ratio(a: Any, b: Any) -> str:
    ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)) and b
    return f"{a / b:.2f}x" if ok else "-"


def headline_markdown(doc: dict[str, Any], plot: str | None = None) -> str:
    """The README's headline block for a benchmark record ``doc`` (``{"sections": {"e2e": ...}}``): the rows as a
    table with the ratios computed from the stored values, the granted context, the run's provenance and the
    command that reproduces it; a placeholder saying how to produce it when the record has no e2e section.
    ``plot``: path of the decode plot to link, as the README sees it."""
    command = ("kvarn-cutlass bench --section e2e          # on an H200 (--quick: a 4-layer smoke run);\n"
               "                                           # merges into docs/benchmarks/h200.json\n"
               "python3 -m kvarn_cutlass.bench.e2e         # rewrites this block and the plot from that record")
    entry = (doc.get("sections") or {}).get("e2e")
    if not entry:
        return ("Not measured yet. On an H200 run\n\n```bash\n" + command + "\n```\n\nto fill this section with "
                "time to first token, decode tokens/s, peak memory\nand granted context for a Qwen3-8B-shaped model "
                "(36 layers, 16k prompt, 300 new tokens), KVarN k4v2_g128\nagainst an fp16 cache, in one run.")
    res, prov = entry["results"], entry.get("provenance", {})
    shape = res.get("shape", {})
    lines = []
    if res.get("quick") or shape.get("num_hidden_layers") != QWEN3_8B["num_hidden_layers"]:
        lines.append(f"**Smoke-test numbers** (a reduced run: {shape.get('num_hidden_layers')} layers, "
                     f"{res.get('plan', {}).get('prompt')}-token prompt), not the headline configuration.\n")
    lines.append(f"Qwen3-8B-shaped decoder ({shape.get('num_hidden_layers')} layers, hidden {shape.get('hidden_size')}, "
                 f"{shape.get('num_attention_heads')} q / {shape.get('num_key_value_heads')} KV heads, head_dim "
                 f"{shape.get('head_dim')}, random weights, fp16) on an {prov.get('gpu', 'unknown GPU')}, "
                 f"{str(prov.get('date', ''))[:10]}, commit {prov.get('git_commit')}. KVarN {shape.get('preset')} "
                 f"(window {shape.get('window')}) against transformers' StaticCache with SDPA (fp16); both decode from "
                 "one CUDA graph per step. TTFT: the whole chunked prefill; decode: graph-replayed steps.\n")
    lines.append("| batch | prompt + new | chunk | TTFT KVarN (ms) | TTFT fp16 (ms) | fp16 / KVarN | decode KVarN (tok/s) "
                 "| decode fp16 (tok/s) | KVarN / fp16 | peak KVarN / fp16 (GiB) |")
    lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in res.get("rows", []):
        lines.append(
            f"| {r['batch']} | {r['prompt']} + {r.get('new_tokens', '-')} | {r['chunk']} | "
            f"{_num(r.get('ttft_ms_kvarn'), '.1f')} | {_num(r.get('ttft_ms_fp16'), '.1f')} | "
            f"{_ratio(r.get('ttft_ms_fp16'), r.get('ttft_ms_kvarn'))} | {_num(r.get('decode_tok_s_kvarn'), '.1f')} | "
            f"{_num(r.get('decode_tok_s_fp16'), '.1f')} | {_ratio(r.get('decode_tok_s_kvarn'), r.get('decode_tok_s_fp16'))} | "
            f"{_num(r.get('peak_mem_gib_kvarn'), '.1f')} / {_num(r.get('peak_mem_gib_fp16'), '.1f')} |")
    errors = [f"batch {r['batch']} chunk {r['chunk']} {k}: {r[f'error_{k}']}" for r in res.get("rows", [])
              for k in KINDS if f"error_{k}" in r]
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
        for key, label, style in (("decode_tok_s_kvarn", "KVarN k4v2", "o-"), ("decode_tok_s_fp16", "fp16 StaticCache", "s--")):
            xy = [(p["context"], p[key]) for p in pts if isinstance(p.get(key), (int, float))]
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
