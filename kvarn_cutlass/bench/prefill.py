"""Bench section ``prefill``: chunked prefill attention of one layer, KVarN vs SDPA on fp16.

Workload: a P-token prompt prefilled in chunks of C (Qwen3-8B heads: 32 q / 8 KV heads, D=128,
k4v2_g128, window 256). Times (CUDA events, summed over the chunks of one prompt):

* ``kvarn``: ``prefill_attention`` per chunk (compression excluded; it runs in ``cache.append``),
  with a per-stage breakdown (rotate, window, fold, unpack, gemm, softmax_v, merge) from a second
  run with events around each stage (that run is slower: it synchronizes nothing but adds events);
* ``compress``: the ``cache.append`` of each chunk (GPU compression), reported separately;
* ``sdpa_fp16``: torch SDPA (flash backend) over an fp16 cache, chunk i attending to every
  earlier token plus causal within the chunk (``causal_lower_right``); the expansion of K/V to 32
  heads is not timed (flash kernels read grouped K/V natively);
* ``dequant_sdpa``: dequantize the tiles to fp16 with a torch dequant, then the same SDPA.

The first point also gets a kernel profile (``kernels``: GPU time per kernel over one prompt against
the wall time), which separates GPU work from host gaps in the stage breakdown.
Also: peak extra memory over a whole 32k prompt (max_memory_allocated above the cache and inputs,
prefill workspaces created from scratch), and head_dim 256. Run: ``python -m kvarn_cutlass.bench.prefill`` or ``kvarn-cutlass bench --section
prefill`` once ``kvarn_cutlass.bench.prefill`` is listed in ``SECTION_MODULES``.
"""

from __future__ import annotations

from typing import Any

from . import BenchOptions, register_section

__all__ = ["run"]

POINTS = ((16384, 512), (16384, 2048), (32768, 512), (32768, 2048))
REF_SDPA_MS = {(16384, 512): 8.75, (16384, 2048): 6.99, (32768, 512): 31.0, (32768, 2048): 26.7}


class _EventTimer:
    def __init__(self):
        import torch

        self.torch = torch
        self.events: list = []

    def stage(self, name):
        timer = self

        class _Ctx:
            def __enter__(self_inner):
                self_inner.a = timer.torch.cuda.Event(enable_timing=True)
                self_inner.a.record()

            def __exit__(self_inner, *exc):
                b = timer.torch.cuda.Event(enable_timing=True)
                b.record()
                timer.events.append((name, self_inner.a, b))
                return False

        return _Ctx()

    def totals_ms(self):
        self.torch.cuda.synchronize()
        out: dict[str, float] = {}
        for name, a, b in self.events:
            out[name] = out.get(name, 0.0) + a.elapsed_time(b)
        return {k: round(v, 3) for k, v in out.items()}


def _dequant_tiles(rec, spec, dtype):
    """Torch GPU dequant of records [B, nt, H, nbytes] -> K, V [B, H, nt*T, D] in dtype (baseline b)."""
    import torch

    from ..codec import dequantize_rotated, unpack_fields, wht

    B, nt, H, _ = rec.shape
    k, v = dequantize_rotated(unpack_fields(rec, spec), torch.float32)
    k, v = wht(k), wht(v)
    T, D = spec.tile_tokens, spec.head_dim
    f = lambda x: x.permute(0, 2, 1, 3, 4).reshape(B, H, nt * T, D).to(dtype)  # noqa: E731
    return f(k), f(v)


def _prefill_prompt(kc, prefill_attention, k, v, q, chunks, Hkv, D, P):
    """One whole prompt: append + prefill_attention per chunk (what the profile covers)."""
    import torch

    cache = kc.KVarNCache(1, 1, Hkv, D, window=256, dtype=torch.float16, device=k.device, max_seq_len=P)
    for s, n in chunks:
        cache.append(0, k[:, :, s:s + n], v[:, :, s:s + n])
        prefill_attention(q[:, :, s:s + n], cache, 0)
    torch.cuda.synchronize()


def _kernel_profile(fn, top: int = 12) -> dict[str, Any]:
    """GPU time per kernel (CUPTI via torch.profiler; also sees the driver-API launches) for one call of
    ``fn``, against its wall time: says whether the stage times are GPU work or host gaps."""
    import time

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
    return {"wall_ms_profiled": round(wall * 1e3, 3), "gpu_kernel_ms": round(busy, 3),
            "top": [{"kernel": k[:120], "ms": round(us / 1e3, 3), "calls": n} for k, us, n in rows[:top]]}


def _one_point(P: int, C: int, D: int = 128, Hq: int = 32, Hkv: int = 8, reps: int = 3, baselines: bool = True,
               profile: bool = False):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    import kvarn_cutlass as kc
    from kvarn_cutlass.prefill import prefill_attention

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    k = torch.randn(1, Hkv, P, D, device=dev, dtype=torch.float16, generator=g)
    k[..., :4] *= 6  # outlier channels
    v = torch.randn(1, Hkv, P, D, device=dev, dtype=torch.float16, generator=g)
    q = (torch.randn(1, Hq, P, D, device=dev, dtype=torch.float16, generator=g) * 0.3)
    chunks = [(s, min(C, P - s)) for s in range(0, P, C)]

    def ev():
        return torch.cuda.Event(enable_timing=True)

    res: dict[str, Any] = {"P": P, "C": C, "head_dim": D}
    best = None
    for rep in range(reps):
        cache = kc.KVarNCache(1, 1, Hkv, D, window=256, dtype=torch.float16, device=dev, max_seq_len=P)
        t_attn = t_comp = 0.0
        timer = _EventTimer() if rep == reps - 1 else None
        for s, n in chunks:
            a, b, c = ev(), ev(), ev()
            a.record()
            cache.append(0, k[:, :, s:s + n], v[:, :, s:s + n])
            b.record()
            prefill_attention(q[:, :, s:s + n], cache, 0, timer=timer)
            c.record()
            c.synchronize()
            t_comp += a.elapsed_time(b)
            t_attn += b.elapsed_time(c)
        if rep > 0 and timer is None:  # rep 0 warms up (compiles, workspaces, GEMM params)
            best = (t_attn, t_comp) if best is None or t_attn < best[0] else best
        if timer is not None:
            res["kvarn_breakdown_ms_instrumented"] = timer.totals_ms()
    if best is None:
        best = (t_attn, t_comp)
    res["kvarn_ms"], res["compress_ms"] = round(best[0], 3), round(best[1], 3)
    if profile:
        res["kernels"] = _kernel_profile(lambda: _prefill_prompt(kc, prefill_attention, k, v, q, chunks, Hkv, D, P))
    if not baselines:
        return res
    group = Hq // Hkv

    def sdpa_time(deq: bool):
        times = []
        for rep in range(reps):
            cache = kc.KVarNCache(1, 1, Hkv, D, window=256, dtype=torch.float16, device=dev, max_seq_len=P) if deq else None
            tot = 0.0
            for s, n in chunks:
                if deq:
                    cache.append(0, k[:, :, s:s + n], v[:, :, s:s + n])
                a, b, c, d = ev(), ev(), ev(), ev()
                a.record()
                if deq:
                    kt, vt = _dequant_tiles(cache.tile_bytes(0), cache.spec, torch.float16)
                    wk, wv = cache.window_kv(0)
                    kk, vv = torch.cat((kt, wk), 2), torch.cat((vt, wv), 2)
                else:
                    kk, vv = k[:, :, : s + n], v[:, :, : s + n]
                b.record()
                # GQA expansion is not timed: flash kernels read grouped K/V natively
                kk = kk.repeat_interleave(group, 1)
                vv = vv.repeat_interleave(group, 1)
                qc = q[:, :, s:s + n]
                c.record()
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    F.scaled_dot_product_attention(qc, kk, vv, attn_mask=causal_lower_right(n, s + n))
                d.record()
                d.synchronize()
                tot += a.elapsed_time(b) + c.elapsed_time(d)
            if rep > 0:
                times.append(tot)
        return round(min(times), 3)

    res["sdpa_fp16_ms"] = sdpa_time(False)
    res["dequant_sdpa_ms"] = sdpa_time(True)
    res["sdpa_reference_h200_ms"] = REF_SDPA_MS.get((P, C))
    res["kvarn_over_sdpa"] = round(res["kvarn_ms"] / res["sdpa_fp16_ms"], 3)
    return res


def _peak_memory(P: int = 32768, C: int = 2048):
    """Peak device memory a whole P-token prompt adds on top of the cache and the inputs: the prefill
    workspaces (created from scratch: the cached ones are dropped first), per-call state and
    temporaries, and the compression in ``cache.append``."""
    import torch

    import kvarn_cutlass as kc
    from kvarn_cutlass.prefill import DEFAULT_SCRATCH_BYTES, clear_workspaces, prefill_attention, workspace_bytes

    Hq, Hkv, D = 32, 8, 128
    clear_workspaces()
    torch.cuda.empty_cache()
    cache = kc.KVarNCache(1, 1, Hkv, D, window=256, dtype=torch.float16, device="cuda", max_seq_len=P)
    k = torch.randn(1, Hkv, P, D, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    qs = torch.randn(1, Hq, P, D, device="cuda", dtype=torch.float16) * 0.3
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for s in range(0, P, C):
        cache.append(0, k[:, :, s:s + C], v[:, :, s:s + C])
        prefill_attention(qs[:, :, s:s + C], cache, 0)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return {"P": P, "C": C, "peak_extra_bytes": int(peak), "workspace_bytes": workspace_bytes(),
            "scratch_budget_bytes": DEFAULT_SCRATCH_BYTES}


def run(opts: BenchOptions) -> dict[str, Any]:
    points = POINTS[:1] if opts.quick else POINTS
    reps = 2 if opts.quick else 3
    out: dict[str, Any] = {
        "workload": "one layer, Qwen3-8B heads (32 q / 8 KV, D=128), k4v2_g128, window 256, fp16; "
                    "attention summed over the chunks of one prompt; compression reported apart",
        "points": [_one_point(P, C, reps=reps, profile=(i == 0)) for i, (P, C) in enumerate(points)],
        "head_dim_256": _one_point(16384, 512, D=256, reps=reps, baselines=not opts.quick),
        "peak_memory_32k": _peak_memory(),
    }
    p0 = out["points"][0]
    out["bar_met_P16384_C512"] = bool(p0["kvarn_ms"] <= p0["sdpa_fp16_ms"])
    return out


register_section("prefill", run, "chunked prefill attention over KVarN tiles vs SDPA flash on fp16")


if __name__ == "__main__":  # python -m kvarn_cutlass.bench.prefill [--quick]: run and record like the CLI
    import argparse
    import sys

    from .command import add_parser, run as cli_run

    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd")
    add_parser(sub)
    args = ap.parse_args(["bench", "--section", "prefill", *sys.argv[1:]])
    sys.exit(cli_run(args))
