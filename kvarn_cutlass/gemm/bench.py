"""Bench section ``gemm``: the prefill K-score path on an sm_90 GPU.

Problem (default): M = 4096 query rows, N = T = 128 tokens per tile, L = 128 tiles (16384 tokens,
one KV head), D = 128 (GEMM depth K = 2*D = 256: the [hi ++ lo] two-level fold, see gemm.prep),
f16 scores.  Reports
  * GEMM incl. EVT epilogue: median time, ``tops_equiv`` = 2*M*N*D*L / time (the issue's
    TOPS-equivalent: the attention problem's depth D), ``tops_issued`` = 2*M*N*K*L / time (K = 2D: the
    int8 ops the two-level fold actually issues), and bytes moved (qi8 + codes read, scores written,
    vectors) / time,
  * unpack and fold kernels: time and achieved bandwidth (bytes read + written / time),
  * host launch overhead of ``KScoreGemm.run`` (wall time per call of 1000 enqueues, no sync).
Inputs rotate over several sets so that L2 (60 MB) does not serve them.

Registered as a section of :mod:`kvarn_cutlass.bench` when that package is importable; callable
directly as :func:`bench_gemm`.
"""
from __future__ import annotations

import time
from typing import Any

__all__ = ["bench_gemm"]


def bench_gemm(opts: Any = None, M: int = 4096, T: int = 128, n_tiles: int = 128, D: int = 128,
               out_dtype: str = "f16", config=None) -> dict[str, Any]:
    import torch

    from ..format import TileSpec
    from .launcher import KScoreGemm
    from .prep import PrepKernels, TileOffsets

    quick = bool(getattr(opts, "quick", False))
    try:
        from ..bench.timing import rotation_count, time_cuda
    except ImportError:  # pragma: no cover
        rotation_count, time_cuda = None, None
    dev = torch.device("cuda", torch.cuda.current_device())
    preset = "k4v2_g128" if T == 128 else "k4v2_g64"
    spec = TileSpec(preset=preset, head_dim=D)
    offs = TileOffsets.from_spec(spec)
    L = n_tiles
    gen = torch.Generator(device=dev).manual_seed(0)
    out_t = {"f16": torch.float16, "f32": torch.float32}[out_dtype]

    def make_set():
        pool = torch.randint(0, 256, (L, spec.tile_nbytes), dtype=torch.uint8, device=dev, generator=gen)
        # sane scale fields (finite f16)
        for name, n in (("chan_step", D), ("chan_min", D), ("row_scale", T)):
            o = spec.offset(name)
            pool[:, o:o + 2 * n] = (torch.rand(L, n, device=dev, generator=gen) + 0.1).half().view(torch.uint8)
        return {
            "pool": pool, "tile_index": torch.arange(L, dtype=torch.int32, device=dev),
            "q": torch.randn(1, M, D, device=dev, generator=gen).half(),
            "qi8": torch.empty(L, M, 2 * D, dtype=torch.int8, device=dev),
            "a": torch.empty(L, M, device=dev), "bias": torch.empty(L, M, device=dev),
            "codes": torch.empty(L, T, 2 * D, dtype=torch.int8, device=dev), "rs": torch.empty(L, T, device=dev),
            "out": torch.empty(L, M, T, dtype=out_t, device=dev),
        }

    K = 2 * D
    per_set = L * (M * K + T * K + M * T * torch.finfo(out_t).bits // 8 + spec.tile_nbytes)
    nsets = min(rotation_count(per_set), 4) if rotation_count else 2
    sets = [make_set() for _ in range(nsets)]
    prep = PrepKernels(dev)
    g = KScoreGemm(M, T, K, L, out_dtype, config=config, device=dev)
    runs = 20 if quick else 100

    # prepare all launches once (what a prefill with stable scratch buffers does)
    for s in sets:
        s["unpack"] = prep.prepare_unpack(s["pool"], s["tile_index"], offs, s["codes"], s["rs"])
        s["fold"] = prep.prepare_fold(s["q"], s["pool"], s["tile_index"], offs, L, s["qi8"], s["a"], s["bias"])
        s["unpack"].launch(); s["fold"].launch()
        g.run(s["qi8"], s["codes"], s["a"], s["bias"], s["rs"], 0.088, s["out"])
    torch.cuda.synchronize()

    t_gemm = time_cuda(lambda s: g.run(s["qi8"], s["codes"], s["a"], s["bias"], s["rs"], 0.088, s["out"]), sets,
                       warmup=10, runs=runs)
    t_unpack = time_cuda(lambda s: s["unpack"].launch(), sets, warmup=10, runs=runs)
    t_fold = time_cuda(lambda s: s["fold"].launch(), sets, warmup=10, runs=runs)

    # host overhead of run(): enqueue-only wall time (GPU may lag; we only time the CPU side)
    s = sets[0]
    n = 200 if quick else 1000
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        g.run(s["qi8"], s["codes"], s["a"], s["bias"], s["rs"], 0.088, s["out"])
    host_us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()

    ob = torch.finfo(out_t).bits // 8
    gemm_bytes = L * (M * K + T * K + M * T * ob + 8 * M + 4 * T)
    unpack_bytes = L * (D * T // 2 + 2 * T + K * T + 4 * T)
    fold_bytes = L * (M * D * 2 + 4 * D + M * K + 8 * M)  # q re-read per tile (L2-resident in practice)
    us = t_gemm.median_us
    return {
        "problem": {"M": M, "N": T, "K": K, "D": D, "L": L, "tokens": T * n_tiles, "out_dtype": out_dtype},
        "config": g.config.to_dict(), "config_name": g.config.name, "grid": list(g.grid or ()),
        "gemm": {"timing": t_gemm.to_dict(), "tops_equiv": round(2 * M * T * D * L / (us * 1e-6) / 1e12, 2),
                 "tops_issued": round(2 * M * T * K * L / (us * 1e-6) / 1e12, 2),
                 "gb_per_s": round(gemm_bytes / (us * 1e-6) / 1e9, 1), "bytes": gemm_bytes},
        "unpack": {"timing": t_unpack.to_dict(), "bytes": unpack_bytes,
                   "gb_per_s": round(unpack_bytes / (t_unpack.median_us * 1e-6) / 1e9, 1)},
        "fold": {"timing": t_fold.to_dict(), "bytes": fold_bytes,
                 "gb_per_s": round(fold_bytes / (t_fold.median_us * 1e-6) / 1e9, 1)},
        "host_overhead_us": {"KScoreGemm.run": round(host_us, 2)},
        "rotation_sets": nsets,
    }


def bench_gemm_buckets(opts: Any = None, arch: int = 90) -> list[dict[str, Any]]:
    """TOPS-equivalent of every tuned bucket of ``gemm_configs/sm<arch>.json`` with its tuned config, measured
    as the tuner measures (:func:`kvarn_cutlass.gemm.tune._measure`: L = 128 batches, inputs rotating past L2).

    Returns rows ``{"bucket", "config_name", "time_us", "tops"}`` (``{"bucket", "error"}`` for a bucket that
    failed, so one bad config does not cost the others), sorted by bucket key.
    """
    from .config import GemmConfig
    from .configs import load_table
    from .tune import _measure

    runs = 20 if getattr(opts, "quick", False) else 100
    rows: list[dict[str, Any]] = []
    for key, entry in sorted((load_table(arch) or {}).get("buckets", {}).items()):
        if entry.get("status") != "tuned":
            continue
        cfg = GemmConfig.from_dict(entry["config"])
        try:
            r = _measure(cfg, key, runs)
        except Exception as e:  # noqa: BLE001 - recorded per bucket
            rows.append({"bucket": key, "error": f"{type(e).__name__}: {e}"})
            continue
        rows.append({"bucket": key, "config_name": cfg.name, "time_us": round(r["time_us"], 2),
                     "tops": round(r["tops"], 2)})
    return rows


def _section(opts: Any) -> dict[str, Any]:
    return {**bench_gemm(opts), "buckets": bench_gemm_buckets(opts)}


try:  # register with the bench registry when present
    from ..bench import register_section

    register_section("gemm", _section, "CUTLASS int8 K-score GEMM (EVT epilogue) + unpack/fold prep kernels; "
                     "TOPS per tuned bucket")
except ImportError:  # pragma: no cover
    pass
