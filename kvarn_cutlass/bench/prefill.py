"""Bench section ``prefill``: chunked prefill of one layer, KVarN vs SDPA on an fp16 cache.

Workload: a P-token prompt prefilled in chunks of C (Qwen3-8B heads: 32 q / 8 KV heads, head_dim 128
or 256, k4v2_g128, window 256, fp16). Every time is a whole prompt with one synchronization at the
end (CUDA events; per point a warm-up prompt of each method, then ``reps`` rounds in which the methods take
turns, and the median of each). Every method gets each chunk's q, k, v as views made before its timed region,
as a model's forward pass hands them over (and the fp16 baselines their cache's views and masks likewise):
the prompts time attention and cache, not the harness's indexing (inside the loop until 2026-12-07):

* ``kvarn_e2e_ms``: ``prefill_attention`` per chunk, which attends and then appends (compression on
  the GPU), inside ``cache.deferred_checks()`` (the append's checks are read back once, after the
  timed region); ``append_ms``: the appends alone, the same way; ``kvarn_plain_append_e2e_ms`` and
  ``kvarn_two_launch_append_e2e_ms``: the same prompt with the compression launched plainly after the
  attention kernel (no programmatic dependent launch) and with the append's two launches (no fused form),
  for the A/B of each (``append_programmatic`` and ``append_fused``: what ``kvarn_e2e_ms`` ran);
  ``kvarn_cta_append_e2e_ms`` and ``kvarn_cluster_append_e2e_ms``: with the compression in one form only
  (the one-CTA form's whole-SM CTAs can take any SM the attention kernel leaves idle, where a cluster needs room
  for its CTAs within one GPC; the cluster form's CTAs are a quarter of an SM each); ``kvarn_control_e2e_ms``:
  ``kvarn_e2e_ms``'s prompt once more in the same rounds, a control: how far apart two identical configurations
  land is the point's resolution (on an H100 the one-CTA variant and the automatic form, which is the one-CTA
  form at 2048-token chunks, differed by 2% in three runs, always in the same direction);
* ``sdpa_flash_e2e_ms`` / ``sdpa_cudnn_e2e_ms``: torch SDPA (flash / cuDNN backend) over a static fp16
  cache: each chunk is copied into the cache, then attends to every earlier token plus causal within
  the chunk (``causal_lower_right``), with ``enable_gqa=True`` where the backend takes it (otherwise
  the cache holds the K/V expanded to the q heads, and the expansion of the chunk is timed);
* ``dequant_sdpa_e2e_ms``: per chunk, ``kc.dequantize_layer`` (one kernel for all tiles of the layer)
  into fp16 buffers, the chunk copied behind them, flash SDPA, and the chunk's append.

Also per point: ``spread_ms``, each method's fastest and slowest round; ``kvarn_over_sdpa`` = kvarn_e2e_ms /
sdpa_flash_e2e_ms, the TFLOPS-equivalent (4 * Hq * D * P^2 / 2 / time) against a fp16 matmul measured in the same
run, and a kernel profile (GPU time per kernel over one prompt, against the prompt's wall time under the profiler).
Peak extra memory of a 32k prompt.
Run: ``kvarn-cutlass bench --section prefill``.
"""

from __future__ import annotations

import re
import statistics
from typing import Any, Callable

from . import BenchOptions, register_section
from .timing import elapsed_ms, interleaved_samples

__all__ = ["run"]

POINTS = ((16384, 512, 128), (16384, 2048, 128), (32768, 2048, 128), (16384, 512, 256))
HQ, HKV = 32, 8


def _kernel_profile(fn, top: int = 8) -> dict[str, Any]:
    """GPU time per kernel (CUPTI via torch.profiler; also sees the driver-API launches) for one call of
    ``fn``, against its wall time: says whether the time is GPU work or host gaps; ``idle``: the gaps
    between the library's kernels (:func:`idle_gaps`)."""
    import time

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            fn()
            wall = time.perf_counter() - t0
    except (RuntimeError, AssertionError) as e:  # no CUPTI: the record says so instead of failing the bench
        return {"error": f"{type(e).__name__}: {e}"}
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if us > 0:
            rows.append((e.key, us, e.count))
    rows.sort(key=lambda r: -r[1])
    busy = sum(r[1] for r in rows) / 1e3
    # the library's kernels only: fn also builds the cache (torch fills) before its timed prompt
    spans = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type == DeviceType.CUDA and e.name.startswith("kvarn_")]
    return {"wall_ms_profiled": round(wall * 1e3, 3), "gpu_kernel_ms": round(busy, 3),
            "top": [{"kernel": k[:120], "ms": round(us / 1e3, 3), "calls": n} for k, us, n in rows[:top]],
            **({"idle": idle_gaps(spans)} if spans else {})}


def _short_kernel_name(name: str) -> str:
    """A kernel family's name: ``kvarn_append_compress_cluster_t128_d128_f16_s16_v2`` -> ``append_compress_cluster``."""
    m = re.match(r"kvarn_(.*?)(?:_t\d+_d\d+.*)?$", name)
    return m.group(1) if m else name[:40]


def idle_gaps(spans: list[tuple[str, float, float]], top: int = 6) -> dict[str, Any]:
    """Where the GPU sat idle between the device activities ``spans`` [(name, start_us, end_us)] of one
    prompt: ``span_ms`` from the first start to the last end, ``idle_ms`` the part of it that no activity
    covers, and the ``top`` largest sums of the idle gaps by (kernel before, kernel after), each with its
    count and largest gap (us)."""
    spans = sorted(spans, key=lambda s: s[1])
    if not spans:
        raise ValueError("spans must hold at least one activity")
    first, last = spans[0][1], max(s[2] for s in spans)
    idle = 0.0
    by_pair: dict[tuple[str, str], list[float]] = {}
    reach, before = spans[0][2], spans[0][0]
    for name, start, end in spans[1:]:
        if start > reach:
            gap = start - reach
            idle += gap
            by_pair.setdefault((_short_kernel_name(before), _short_kernel_name(name)), []).append(gap)
        if end >= reach:
            reach, before = end, name
    pairs = sorted(by_pair.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"span_ms": round((last - first) / 1e3, 3), "idle_ms": round(idle / 1e3, 3),
            "gaps": [{"after": a, "before": b, "ms": round(sum(g) / 1e3, 3), "count": len(g),
                      "largest_us": round(max(g), 1)} for (a, b), g in pairs]}


def _matmul_tflops() -> float:
    """fp16 8192^3 matmul rate in this run (the tensor-core ceiling the TFLOPS-equivalent is compared with)."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    for _ in range(3):
        a @ b
    return round(2 * 8192**3 * 10 / (elapsed_ms(lambda: a @ b, repeats=10) * 1e-3) / 1e12, 1)


def _interleaved(methods: dict[str, Callable[[], float]], reps: int,
                 optional: frozenset[str] = frozenset()
                 ) -> tuple[dict[str, float], dict[str, str], dict[str, list[float]]]:
    """(median ms of each method, errors of the optional ones that could not run, [fastest, slowest] ms of each
    method over the rounds). Each method returns its own event-timed ms; one warm-up call each, then ``reps``
    rounds in which every method runs once, so that a drift of clocks or of host load during the point lands on
    all of them alike (rather than on whichever ran last). The rounds' orders are the rows of a Williams design
    (:func:`~kvarn_cutlass.bench.timing.williams_order`): each method follows a different one in every round. A
    rotated order (round r starting at the r-th method) keeps every method after the same one, and on an H100
    the prompt listed first, always right after the SDPA-over-dequantized-tiles prompt, ran 1-2.5% slower than
    the same configuration listed elsewhere, in four runs. An optional method whose warm-up raises RuntimeError
    (e.g. no cuDNN attention for the shape) is left out, with its error; any other error propagates."""
    errors: dict[str, str] = {}
    live = {}
    for name, fn in methods.items():
        try:
            fn()
        except RuntimeError as e:
            if name not in optional:
                raise
            errors[name] = f"{type(e).__name__}: {str(e)[:200]}"
            continue
        live[name] = fn
    samples = dict(zip(live, interleaved_samples(list(live.values()), reps)))
    return ({name: round(statistics.median(ms), 3) for name, ms in samples.items()}, errors,
            {name: [round(min(ms), 3), round(max(ms), 3)] for name, ms in samples.items()})


def _one_point(P: int, C: int, D: int, reps: int, peak_tflops: float) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    import kvarn_cutlass as kc

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(P + C + D)
    k = torch.randn(1, HKV, P, D, device=dev, dtype=torch.float16, generator=g)
    k[..., :4] *= 6  # outlier channels
    v = torch.randn(1, HKV, P, D, device=dev, dtype=torch.float16, generator=g)
    q = torch.randn(1, HQ, P, D, device=dev, dtype=torch.float16, generator=g) * 0.3
    chunks = [(s, min(C, P - s)) for s in range(0, P, C)]
    # Each chunk's q, k, v as a model's forward pass hands them over (tensors of their own): the views are
    # made here, outside every method's timed region, so the prompts time the attention and its cache, not
    # torch's indexing of the [1, H, P, D] prompt (~5 us of host time a slice on the dev CPU).
    views = [(q[:, :, s:s + n], k[:, :, s:s + n], v[:, :, s:s + n]) for s, n in chunks]

    def static_steps(kbuf, vbuf) -> list:
        """Per chunk, made before a timed region: its q, k, v views, the views of an fp16 cache [1, H, P, D]
        (kbuf, vbuf) that it writes and that it attends to, and its mask."""
        return [(qn, kn, vn, kbuf[:, :, s:s + n], vbuf[:, :, s:s + n], kbuf[:, :, :s + n], vbuf[:, :, :s + n],
                 causal_lower_right(n, s + n)) for (s, n), (qn, kn, vn) in zip(chunks, views)]

    def kvarn_prompt(attend: bool = True, programmatic: bool = True, fused: bool = True,
                     form: str = "auto") -> float:
        cache = kc.KVarNCache(1, 1, HKV, D, window=256, dtype=torch.float16, device=dev, max_seq_len=P)
        cache._writer.programmatic &= programmatic
        cache._fuse_appends &= fused
        if form == "cta":
            cache._writer.cluster_tiles = 0
        elif form == "cluster" and cache._writer.cluster_tiles:
            cache._writer.cluster_tiles = 1 << 30

        def run() -> None:
            for qn, kn, vn in views:
                if attend:
                    kc.prefill_attention(qn, kn, vn, cache, 0)
                else:
                    cache.append(0, kn, vn)

        with cache.deferred_checks():
            return elapsed_ms(run)

    def sdpa_prompt(backend) -> float:
        gqa = _gqa_supported(backend)
        heads = HKV if gqa else HQ
        kc_ = torch.empty(1, heads, P, D, device=dev, dtype=torch.float16)
        vc_ = torch.empty_like(kc_)
        steps = static_steps(kc_, vc_)

        def run() -> None:
            with sdpa_kernel(backend):
                for qn, kn, vn, k_dst, v_dst, k_seen, v_seen, mask in steps:
                    if not gqa:
                        kn, vn = kn.repeat_interleave(HQ // HKV, 1), vn.repeat_interleave(HQ // HKV, 1)
                    k_dst.copy_(kn)
                    v_dst.copy_(vn)
                    F.scaled_dot_product_attention(qn, k_seen, v_seen, attn_mask=mask, enable_gqa=gqa)

        return elapsed_ms(run)

    def dequant_prompt() -> float:
        cache = kc.KVarNCache(1, 1, HKV, D, window=256, dtype=torch.float16, device=dev, max_seq_len=P)
        gqa = _gqa_supported(SDPBackend.FLASH_ATTENTION)
        kb = torch.empty(1, HKV, P, D, device=dev, dtype=torch.float16)
        vb = torch.empty_like(kb)
        steps = static_steps(kb, vb)

        def run() -> None:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                for qn, kn, vn, k_dst, v_dst, kk, vv, mask in steps:
                    kc.dequantize_layer(cache, 0, out=(kb, vb))
                    k_dst.copy_(kn)
                    v_dst.copy_(vn)
                    if not gqa:
                        kk, vv = kk.repeat_interleave(HQ // HKV, 1), vv.repeat_interleave(HQ // HKV, 1)
                    F.scaled_dot_product_attention(qn, kk, vv, attn_mask=mask, enable_gqa=gqa)
                    cache.append(0, kn, vn)

        with cache.deferred_checks():
            return elapsed_ms(run)

    res: dict[str, Any] = {"P": P, "C": C, "head_dim": D, "q_heads": HQ, "kv_heads": HKV}
    times, errors, spreads = _interleaved({
        "kvarn_e2e_ms": kvarn_prompt,
        "append_ms": lambda: kvarn_prompt(attend=False),
        "kvarn_plain_append_e2e_ms": lambda: kvarn_prompt(programmatic=False),
        "kvarn_two_launch_append_e2e_ms": lambda: kvarn_prompt(fused=False),
        "kvarn_cta_append_e2e_ms": lambda: kvarn_prompt(form="cta"),
        "kvarn_cluster_append_e2e_ms": lambda: kvarn_prompt(form="cluster"),
        "kvarn_control_e2e_ms": kvarn_prompt,
        "sdpa_flash_e2e_ms": lambda: sdpa_prompt(SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn_e2e_ms": lambda: sdpa_prompt(SDPBackend.CUDNN_ATTENTION),
        "dequant_sdpa_e2e_ms": dequant_prompt,
    }, reps, optional=frozenset({"sdpa_cudnn_e2e_ms"}))  # no cuDNN attention for some shapes or builds: say so
    res.update(times)
    res["spread_ms"] = spreads
    probe = kc.KVarNCache(1, 1, HKV, D, window=256, dtype=torch.float16, device=dev, max_seq_len=P)
    res["append_programmatic"] = probe._writer.programmatic
    res["append_fused"] = probe._fuse_appends
    res["sdpa_flash_gqa"] = _gqa_supported(SDPBackend.FLASH_ATTENTION)
    if "sdpa_cudnn_e2e_ms" in errors:
        res["sdpa_cudnn_error"] = errors["sdpa_cudnn_e2e_ms"]
    res["kvarn_over_sdpa"] = round(res["kvarn_e2e_ms"] / res["sdpa_flash_e2e_ms"], 3)
    res["kvarn_over_dequant_sdpa"] = round(res["kvarn_e2e_ms"] / res["dequant_sdpa_e2e_ms"], 3)
    flops = 4 * HQ * D * P * P / 2
    res["tflops_eq_kvarn"] = round(flops / (res["kvarn_e2e_ms"] * 1e-3) / 1e12, 1)
    res["tflops_eq_sdpa_flash"] = round(flops / (res["sdpa_flash_e2e_ms"] * 1e-3) / 1e12, 1)
    res["kvarn_fraction_of_matmul_peak"] = round(res["tflops_eq_kvarn"] / peak_tflops, 3)
    res["kernels"] = _kernel_profile(kvarn_prompt)
    return res


_GQA: dict = {}


def _gqa_supported(backend) -> bool:
    """Whether SDPA with ``backend`` takes grouped K/V (enable_gqa=True) on this build, tried once."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    if backend not in _GQA:
        q = torch.randn(1, 4, 8, 128, device="cuda", dtype=torch.float16)
        kv = torch.randn(1, 1, 8, 128, device="cuda", dtype=torch.float16)
        try:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
            _GQA[backend] = True
        except RuntimeError:
            _GQA[backend] = False
    return _GQA[backend]


def _peak_memory(P: int = 32768, C: int = 2048) -> dict[str, Any]:
    """Peak device memory a whole P-token prompt adds on top of the cache and the inputs (outputs,
    temporaries, the compression in the appends)."""
    import torch

    import kvarn_cutlass as kc

    D = 128
    torch.cuda.empty_cache()
    cache = kc.KVarNCache(1, 1, HKV, D, window=256, dtype=torch.float16, device="cuda", max_seq_len=P)
    k = torch.randn(1, HKV, P, D, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    qs = torch.randn(1, HQ, P, D, device="cuda", dtype=torch.float16) * 0.3
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with cache.deferred_checks():
        for s in range(0, P, C):
            kc.prefill_attention(qs[:, :, s:s + C], k[:, :, s:s + C], v[:, :, s:s + C], cache, 0)
    torch.cuda.synchronize()
    return {"P": P, "C": C, "peak_extra_bytes": int(torch.cuda.max_memory_allocated() - base)}


def run(opts: BenchOptions) -> dict[str, Any]:
    points = POINTS[:1] if opts.quick else POINTS
    reps = 2 if opts.quick else 7
    peak = _matmul_tflops()
    out: dict[str, Any] = {
        "workload": "one layer, 32 q / 8 KV heads, k4v2_g128, window 256, fp16; whole prompt (attention and "
                    "append of every chunk) with one sync at the end",
        "timing": f"CUDA events around each whole prompt; per point one warm-up of each method, then {reps} rounds "
                  "in which the methods take turns, each round's order a row of a Williams design (no method "
                  "always after the same one); medians, and each method's fastest and slowest round",
        "matmul_f16_8192_tflops": peak,
        "points": [_one_point(P, C, D, reps, peak) for P, C, D in points],
        "peak_memory_32k": _peak_memory(),
    }
    out["bar_met"] = all(p["kvarn_over_sdpa"] <= 1.0 for p in out["points"])
    return out


register_section("prefill", run, "chunked prefill (fused kernel, append included) vs SDPA flash on fp16")

