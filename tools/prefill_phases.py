"""How fast each phase of the fused prefill kernel runs per query-key pair, against SDPA flash on the same pairs.

The kernel's work is two phases: the cache's tiles (dequantized in shared memory) and the exact tokens (sink,
window and the chunk itself, causal). A whole prompt in 2048-token chunks has ~2.5x the exact pairs of one in
512-token chunks, and KVarN's attention was slower there relative to SDPA (docs/perf-notes.md, "Fused prefill:
the exact phase's rate"). This tool times one chunk's attention (``append=False``) for shapes that weigh the two
phases differently, and SDPA flash (``causal_lower_right``, ``enable_gqa``) over an fp16 cache holding the same
tokens, both timed as the tuner times (``ops.prefill_tune.time_config``: back-to-back calls between CUDA events,
warm-up, median, input sets rotated so that the L2 holds none of them); it fits per-pair times of the two
phases plus a per-launch cost by least squares and prints them beside SDPA's per-pair time, for the shipped
source and its A/B variants (``SOURCE_VARIANTS``; by default the shipped source in both CTA orders and with split
tiles).
GPU only:

    python3 tools/prefill_phases.py [--bucket D128_T128_V2] [--config NAME]
                                    [--variants shipped row_order unsplit exact_serial] [--json PATH]
    (through tools/gpu_check.sh: GPU_PREFILL_PHASES=1)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's package, as the other tools

import kvarn_cutlass as kc  # noqa: E402
from kvarn_cutlass.bench.timing import rotation_count, time_cuda  # noqa: E402
import kvarn_cutlass.ops.prefill as OP  # noqa: E402
from kvarn_cutlass.ops.prefill import FusedConfig, select_config  # noqa: E402
from kvarn_cutlass.ops.prefill_tune import HKV, HQ, parse_bucket, rotated_inputs, time_config  # noqa: E402

# (context, chunk): exact only (an empty cache), mixed (the tuner's shapes and the e2e chunks), tile-heavy (the
# last two: grids of 32 and 8 CTAs, what split tiles are for)
SHAPES = ((0, 512), (0, 2048), (0, 4096), (16384, 512), (16384, 2048), (32768, 512), (32768, 128), (32768, 16))
ROOT = Path(__file__).resolve().parents[1]
SHIPPED_SOURCE = ROOT / "kvarn_cutlass/csrc/prefill_fused.cu"
# Source variants (text substitutions of the shipped kernel, built under their own module names), for an A/B in
# one run. exact_serial: the producers wait for each exact block's copies before issuing the next (one block in
# flight per producer group), as before the exact phase's hand-over was deferred (measured: docs/perf-notes.md).
# row_order: the shipped source launched in the row order ($KVARN_PREFILL_ORDER=rows) instead of heavy-first;
# unsplit: without splitting the tiles of a grid that leaves SMs idle ($KVARN_PREFILL_SPLIT=0) (VARIANT_ENV).
SOURCE_VARIANTS = {
    "shipped": [],
    "exact_serial": [("                if (pend >= 0) hand_over(pend % NSTAGE, true);\n                pend = bi;\n",
                      "                hand_over(s, false);\n")],
    "row_order": [],
    "unsplit": [],
}
VARIANT_ENV = {"row_order": {OP.ORDER_ENV: "rows"}, "unsplit": {OP.SPLIT_ENV: "0"}}
DEFAULT_VARIANTS = ["shipped", "row_order", "unsplit"]
_shipped_spec = OP.fused_spec


def use_source(name: str, subs: list[tuple[str, str]] | None = None) -> None:
    """Build the fused kernel from now on from its source with ``subs`` (pairs of old, new text; default
    ``SOURCE_VARIANTS[name]``) applied, as module ``<shipped name>_<name>``; no substitutions: the shipped source.
    (tools/prefill_variants.py uses it for its variants too.)"""
    subs = SOURCE_VARIANTS[name] if subs is None else subs
    OP._kernels.clear()
    if not subs:
        OP.fused_spec = _shipped_spec
        return
    src = SHIPPED_SOURCE.read_text()
    for a, b in subs:
        if a not in src:
            raise RuntimeError(f"source variant {name}: {a!r} is not in {SHIPPED_SOURCE.name}")
        src = src.replace(a, b)
    path = Path(f"/tmp/prefill_fused_{name}.cu")
    path.write_text(src)

    def spec(*args, **kw):
        base = _shipped_spec(*args, **kw)  # the variant's headers stay in csrc: found through include_dirs
        return replace(base, source_file=str(path), name=f"{base.name}_{name}",
                       include_dirs=(str(SHIPPED_SOURCE.parent), *base.include_dirs))

    OP.fused_spec = spec


def pairs(tile_tokens: int, exact_before: int, chunk: int) -> tuple[int, int]:
    """(tile pairs, exact pairs) per query head of one chunk: every query sees every tile token, the
    ``exact_before`` sink and window tokens, and the chunk causally (query i sees chunk tokens 0..i)."""
    return chunk * tile_tokens, chunk * exact_before + chunk * (chunk + 1) // 2


def fit(rows: list[dict]) -> dict:
    """Least squares of ``kvarn_us = launch_us + tile_ps * tile_pairs + exact_ps * exact_pairs`` (pairs summed
    over the query heads; ps: picoseconds per pair) over ``rows``, and SDPA's picoseconds per pair."""
    a = np.array([[1.0, r["tile_pairs"] * 1e-6, r["exact_pairs"] * 1e-6] for r in rows])
    y = np.array([r["kvarn_us"] for r in rows])
    (launch, tile, exact), *_ = np.linalg.lstsq(a, y, rcond=None)
    sdpa = np.array([r["sdpa_us"] / ((r["tile_pairs"] + r["exact_pairs"]) * 1e-6) for r in rows])
    return {"launch_us": round(float(launch), 2), "tile_ps_per_pair": round(float(tile), 4),
            "exact_ps_per_pair": round(float(exact), 4), "exact_over_tile": round(float(exact / tile), 3),
            "sdpa_ps_per_pair_median": round(float(np.median(sdpa)), 4),
            "residual_us_max": round(float(np.abs(a @ [launch, tile, exact] - y).max()), 2)}


def measure(spec, cfg, context: int, chunk: int, runs: int, variants: list[str]) -> list[dict]:
    """One row per source variant for the (context, chunk) shape: KVarN's time and SDPA's (timed once)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    sets = rotated_inputs(spec, context, chunk)  # KVarN's caches and chunks, rotated past L2
    cache, q, kn, vn = sets[0]
    layer = cache._layer(0)
    tile_tokens = layer.n_tiles * spec.tile_tokens
    exact_before = layer.window_len + layer.sink_len
    assert tile_tokens + exact_before == context
    want = kc.prefill_attention(q, kn, vn, cache, 0, append=False, impl="torch").float()
    # SDPA over the same tokens as an fp16 cache (its values do not change its time), rotated the same way
    D, s = spec.head_dim, context + chunk
    fp16 = [(torch.randn(1, HQ, chunk, D, device="cuda", dtype=torch.float16),
             torch.randn(1, HKV, s, D, device="cuda", dtype=torch.float16),
             torch.randn(1, HKV, s, D, device="cuda", dtype=torch.float16))
            for _ in range(rotation_count(2 * 2 * HKV * s * D + (2 * HQ + 2 * HKV) * chunk * D * 2))]
    mask = causal_lower_right(chunk, s)
    out = torch.empty_like(q)

    def sdpa(x):
        qq, kk, vv = x
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=True)

    sdpa_us = time_cuda(sdpa, fp16, warmup=3, runs=runs).median_us
    tp, ep = pairs(tile_tokens, exact_before, chunk)
    rows = []
    for variant in variants:
        env = VARIANT_ENV.get(variant, {})
        os.environ.update(env)
        try:
            use_source(variant)  # also drops the loaded kernels, which read the order knob when loaded
            got = kc.prefill_attention(q, kn, vn, cache, 0, append=False, config=cfg).float()
            kvarn_us = 1000 * time_config(sets, cfg, out, runs)
        finally:
            for key in env:
                os.environ.pop(key, None)
        err = ((got - want).norm() / want.norm()).item()
        if not err < 5e-3:
            raise RuntimeError(f"{variant}, context={context} chunk={chunk}: error {err:.2e} against the torch path")
        rows.append({"variant": variant, "context": context, "chunk": chunk, "tile_tokens": tile_tokens,
                     "exact_before": exact_before, "tile_pairs": HQ * tp, "exact_pairs": HQ * ep,
                     "kvarn_us": round(kvarn_us, 2), "sdpa_us": round(sdpa_us, 2),
                     "kvarn_over_sdpa": round(kvarn_us / sdpa_us, 3), "error": err})
    use_source("shipped")
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bucket", default="D128_T128_V2")
    ap.add_argument("--config", default=None, help="a FusedConfig name (default: the tuned one)")
    ap.add_argument("--variants", nargs="+", choices=list(SOURCE_VARIANTS), default=DEFAULT_VARIANTS)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--json", default=None, help="also write the rows and the fits here")
    args = ap.parse_args(argv)
    spec = parse_bucket(args.bucket)
    cfg = FusedConfig.from_name(args.config) if args.config else select_config(spec)
    rows = []
    for context, chunk in SHAPES:
        for row in measure(spec, cfg, context, chunk, args.runs, args.variants):
            row = {"bucket": args.bucket, "config": cfg.name, **row}
            print(json.dumps(row), flush=True)
            rows.append(row)
    fits = {v: fit([r for r in rows if r["variant"] == v]) for v in args.variants}
    print(json.dumps({"fit": fits}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "fit": fits}, indent=1) + "\n")


if __name__ == "__main__":
    main()
