#!/usr/bin/env python3
"""A/B of the compression kernels' widths: warps per cluster CTA (``ops.compress.CLUSTER_WARPS``: 8 shipped, 4, 16)
and per lone CTA (``CTA_WARPS``: 32 shipped up to head_dim 128, 16) (GPU).

``python3 tools/compress_variants.py [--warps N ...] [--cta-warps N ...] [--quick] [--json PATH]``
``python3 tools/compress_variants.py --iters N [--iters N ...] [--quick] [--json PATH]``

Why: Nsight Compute of the shipped cluster kernel (docs/perf-notes.md, "gpu-next on the H200") found one warp per
scheduler issuing once every 6.3 cycles, a dependent chain; the 8- and 16-warp variants give each scheduler two or
four chains with ~0.63x / ~0.44x the instructions per warp (SASS 7,024 -> 4,424 -> 3,104 at D=128), same bytes
(measured 2026-12-02: 8 is the fastest and ships). The one-CTA forms set the throughput of large launches (the
batch-16 prefill's appends): at 32 warps a thread holds half the tokens, within 64 registers (111 at 16), so each
scheduler has eight warps instead of four.

Per variant (``$KVARN_COMPRESS_CLUSTER_WARPS``, set before each case; the append reads it when a cache's writer
is made, so every case builds its own caches):

1. bytes: ``compress_layer`` of random layers (b1 and b2, D=128, both quantizers) equal to the shipped kernel's
   records, bit for bit;
2. ``layer``: the bench's layer case (``bench.compress._compress_case``: graph-replayed ``compress_layer``, 8 KV
   heads, one tile each) at batch 1 for D = 64, 128, 256 and lloyd_max at D = 128, and batch 2 (32 halves);
3. ``prompt``: the appends of a 16k prompt in 512-token chunks (one layer, 8 KV heads, D=128; 64 record halves a
   chunk), the append's cluster form forced and the one-CTA form, each (a) back to back behind a sleep kernel (GPU
   alone, as the bench's ``gpu_ms``) and (b) each append after a [512 x 4096] x [4096 x 4096] fp16 GEMM, as in a
   model's prefill (the e2e profile measured the two forms in opposite order from (a)): ms over the 32 appends,
   the GEMMs' own time subtracted.

4. per one-CTA width (``$KVARN_COMPRESS_CTA_WARPS``): the bytes of batch-16 layers (128 records: the one-CTA
   form) against the shipped width's, the batch-16 layer case at D = 64, 128 and lloyd_max, and the prompt's
   appends in the one-CTA form at batch 1 and 16 (the e2e b16 prefill's chunks: 512 records an append), back to
   back and after GEMMs.

``--iters``: instead of the widths, the shipped kernels at each number of variance-normalization iterations
(``TileSpec.sinkhorn_iters``, a kernel argument: no rebuild; the default first): the layer case at batch 1 and 16
(D = 128, uniform) and the prompt's appends at batch 1 and 16, back to back and after GEMMs. The records differ
by design between counts (the codec's, for each); docs/accuracy.md has what the count does to perplexity.

Prints one JSON line per measurement and a table; ``--json`` writes all. Device time: ~1-2 min with the builds
(each variant compiles its D=64/128/256 modules on first use, ~10-30 s each on the device's CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvarn_cutlass.bench import BenchOptions  # noqa: E402
from kvarn_cutlass.bench import compress as bench  # noqa: E402
from kvarn_cutlass.bench.timing import elapsed_ms, queue_lead_us, time_queued  # noqa: E402
from kvarn_cutlass.ops import compress as C  # noqa: E402
from kvarn_cutlass.presets import DEFAULT_SINKHORN_ITERS  # noqa: E402

P, CHUNK, H, D = 16384, 512, 8, 128


def set_warps(w: int, cta: int | None = None) -> None:
    """The widths the next kernels are built and launched with: ``w`` warps per cluster CTA, ``cta`` per lone CTA
    (None: the shipped width, ops.compress.default_cta_warps)."""
    os.environ[C.CLUSTER_WARPS_ENV] = str(w)
    if cta is None:
        os.environ.pop(C.CTA_WARPS_ENV, None)
    else:
        os.environ[C.CTA_WARPS_ENV] = str(cta)


def layer_records(warps: int, quantizer: str, batch: int, seed: int, cta: int | None = None):
    import torch

    from kvarn_cutlass.format import TileSpec

    set_warps(warps, cta)
    spec = TileSpec(preset="k4v2_g128", head_dim=D, quantizer=quantizer)
    g = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.randn(batch, H, spec.tile_tokens, D, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn(batch, H, spec.tile_tokens, D, device="cuda", dtype=torch.float16, generator=g)
    k[..., :4] *= 6
    return C.compress_layer(k, v, spec).cpu()


def prompt_appends(warps: int, cluster: bool | None, with_gemm: bool, reps: int, batch: int = 1,
                   cta: int | None = None, sinkhorn_iters: int = DEFAULT_SINKHORN_ITERS) -> float:
    """ms of the prompt's 32 appends (``batch`` sequences): back to back behind a sleep kernel, or each after a GEMM
    of the batch's chunk rows (GEMMs subtracted). ``cluster``: force the cluster (True) or one-CTA (False) form,
    None: the append's own choice. ``sinkhorn_iters``: the caches' iteration count."""
    import torch

    from kvarn_cutlass.cache import KVarNCache
    from kvarn_cutlass.ops.append import DeviceAppender

    set_warps(warps, cta)
    g = torch.Generator(device="cuda").manual_seed(P + CHUNK)
    k = torch.randn(batch, H, P, D, device="cuda", dtype=torch.float16, generator=g)
    k[..., :4] *= 6
    v = torch.randn(batch, H, P, D, device="cuda", dtype=torch.float16, generator=g)
    a = torch.randn(batch * CHUNK, 4096, device="cuda", dtype=torch.float16, generator=g)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.float16, generator=g)
    c = torch.empty(batch * CHUNK, 4096, device="cuda", dtype=torch.float16)

    def fresh() -> KVarNCache:
        cache = KVarNCache(1, batch, H, D, window=256, dtype=torch.float16, device="cuda", max_seq_len=P,
                           sinkhorn_iters=sinkhorn_iters)
        cache._writer = DeviceAppender(cache)
        if cluster is None:
            return cache
        if cluster and cache._writer._cluster is None:
            raise SystemExit(f"no cluster form of the append on {torch.cuda.get_device_name()} (sm_90 and later)")
        cache._writer.cluster_tiles = (1 << 30) if cluster else 0
        return cache

    def run(cache, appends: bool, gemms: bool) -> None:
        for s in range(0, P, CHUNK):
            if gemms:
                torch.mm(a, b, out=c)
            if appends:
                cache.append(0, k[:, :, s:s + CHUNK], v[:, :, s:s + CHUNK])

    def timed(appends: bool, gemms: bool) -> float:
        cache = fresh()
        with cache.deferred_checks():
            return elapsed_ms(lambda: run(cache, appends, gemms))

    def queued(appends: bool, gemms: bool, lead: float) -> float:
        cache = fresh()
        with cache.deferred_checks():
            return time_queued(lambda: run(cache, appends, gemms), lead_us=lead)[0] / 1000.0

    timed(True, with_gemm)  # warm-up: modules, prepared launches
    t0 = time.perf_counter()
    timed(True, with_gemm)
    lead = queue_lead_us(time.perf_counter() - t0)
    both = statistics.median(queued(True, with_gemm, lead) for _ in range(reps))
    if not with_gemm:
        return both
    return both - statistics.median(queued(False, True, lead) for _ in range(reps))


def iteration_study(args) -> int:
    """The ``--iters`` mode (module docstring)."""
    from kvarn_cutlass.format import MAX_SINKHORN_ITERS

    bad = [i for i in args.iters if not 0 <= i <= MAX_SINKHORN_ITERS]
    if bad:
        raise SystemExit(f"--iters {bad[0]}: choose 0 to {MAX_SINKHORN_ITERS}")
    counts = [DEFAULT_SINKHORN_ITERS] + [i for i in dict.fromkeys(args.iters) if i != DEFAULT_SINKHORN_ITERS]
    opts = BenchOptions(quick=args.quick)
    reps = 3 if args.quick else 7
    rows = []
    t0 = time.perf_counter()
    for it in counts:
        for batch in (1, 16):
            r = bench._compress_case(batch, D, "k4v2_g128", opts, sinkhorn_iters=it)
            rows.append({"iters": it, "case": "layer", "batch": batch, "kernel": r["kernel"], "graph_us": r["graph_us"]})
            print(json.dumps(rows[-1]), flush=True)
        for batch in (1, 16):
            for with_gemm in (False, True):
                ms = prompt_appends(C.DEFAULT_CLUSTER_WARPS, None, with_gemm, reps, batch, sinkhorn_iters=it)
                rows.append({"iters": it, "case": "prompt", "batch": batch, "after_gemm": with_gemm, "ms": round(ms, 3)})
                print(json.dumps(rows[-1]), flush=True)
    print("iters | layer b1 / b16 (graph us) | prompt appends ms b1, b16: back to back / after GEMMs")
    for it in counts:
        lay = " / ".join(str(r["graph_us"]) for r in rows if r["iters"] == it and r["case"] == "layer")
        pr = ", ".join(" / ".join(str(r["ms"]) for r in rows if r["iters"] == it and r["case"] == "prompt"
                                  and r["batch"] == b) for b in (1, 16))
        print(it, "|", lay, "|", pr)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "seconds": round(time.perf_counter() - t0, 1)}, indent=1))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warps", type=int, action="append", choices=C.CLUSTER_WARPS,
                    help="variants to time (repeatable; default: all); the shipped width is always timed first")
    ap.add_argument("--cta-warps", type=int, action="append", choices=C.CTA_WARPS,
                    help="one-CTA widths to time (repeatable; default: all); the shipped width is always timed first")
    ap.add_argument("--iters", type=int, action="append",
                    help="time the shipped kernels at these variance-normalization iteration counts instead (repeatable; "
                         "the default count is always timed first)")
    ap.add_argument("--quick", action="store_true", help="fewer runs")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.iters:
        return iteration_study(args)
    variants = [C.DEFAULT_CLUSTER_WARPS] + [w for w in (args.warps or C.CLUSTER_WARPS) if w != C.DEFAULT_CLUSTER_WARPS]
    opts = BenchOptions(quick=args.quick)
    reps = 3 if args.quick else 7
    rows = []

    def emit(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    t0 = time.perf_counter()
    for w in variants:
        for quantizer in ("uniform", "lloyd_max"):
            for batch in (1, 2):
                seed = 1000 * batch + len(quantizer)
                got = layer_records(w, quantizer, batch, seed)
                want = got if w == C.DEFAULT_CLUSTER_WARPS else layer_records(C.DEFAULT_CLUSTER_WARPS, quantizer, batch, seed)
                emit({"warps": w, "case": "bytes", "quantizer": quantizer, "batch": batch, "equal": bool((got == want).all())})
        for batch, head_dim, quantizer in ((1, 64, "uniform"), (1, 128, "uniform"), (1, 256, "uniform"),
                                           (1, 128, "lloyd_max"), (2, 128, "uniform")):
            set_warps(w)
            r = bench._compress_case(batch, head_dim, "k4v2_g128", opts, quantizer)
            emit({"warps": w, "case": "layer", "batch": batch, "head_dim": head_dim, "quantizer": quantizer,
                  "kernel": r["kernel"], "graph_us": r["graph_us"]})
        for cluster in (True, False):
            if not cluster and w != C.DEFAULT_CLUSTER_WARPS:
                continue  # the one-CTA form does not depend on the variant
            for with_gemm in (False, True):
                emit({"warps": w, "case": "prompt", "form": "cluster" if cluster else "one CTA",
                      "after_gemm": with_gemm, "ms": round(prompt_appends(w, cluster, with_gemm, reps), 3)})
    shipped_cta = C.default_cta_warps(128, D)  # the tool's k4v2_g128 tiles
    ctas = [shipped_cta] + [w for w in (args.cta_warps or C.CTA_WARPS) if w != shipped_cta]
    for o in ctas:
        # the one-CTA forms: launches of more halves than fit as clusters (batch 16 layers, batch 16 prompt chunks)
        for quantizer in ("uniform", "lloyd_max"):
            seed = 16000 + len(quantizer)
            got = layer_records(C.DEFAULT_CLUSTER_WARPS, quantizer, 16, seed, o)
            want = got if o == shipped_cta else layer_records(C.DEFAULT_CLUSTER_WARPS, quantizer, 16, seed)
            emit({"cta_warps": o, "case": "bytes", "quantizer": quantizer, "batch": 16,
                  "equal": bool((got == want).all())})
        for batch, head_dim, quantizer in ((16, 64, "uniform"), (16, 128, "uniform"), (16, 128, "lloyd_max")):
            set_warps(C.DEFAULT_CLUSTER_WARPS, o)
            r = bench._compress_case(batch, head_dim, "k4v2_g128", opts, quantizer)
            emit({"cta_warps": o, "case": "layer", "batch": batch, "head_dim": head_dim, "quantizer": quantizer,
                  "kernel": r["kernel"], "graph_us": r["graph_us"]})
        for batch in (1, 16):
            for with_gemm in (False, True):
                emit({"cta_warps": o, "case": "prompt", "form": "one CTA", "batch": batch, "after_gemm": with_gemm,
                      "ms": round(prompt_appends(C.DEFAULT_CLUSTER_WARPS, False, with_gemm, reps, batch, o), 3)})
    os.environ.pop(C.CLUSTER_WARPS_ENV, None)
    os.environ.pop(C.CTA_WARPS_ENV, None)
    layer = [r for r in rows if r["case"] == "layer" and "warps" in r]
    print("warps | layer b1 D64 / D128 / D256 / D128 lm / b2 D128 (graph us)")
    for w in variants:
        print(w, "|", " / ".join(str(r["graph_us"]) for r in layer if r["warps"] == w))
    print("warps, form | prompt appends ms: back to back / after GEMMs")
    for r in rows:
        if r["case"] == "prompt" and not r["after_gemm"] and "warps" in r:
            after = next(x["ms"] for x in rows if x["case"] == "prompt" and x["after_gemm"] and x["warps"] == r["warps"]
                         and x["form"] == r["form"])
            print(f"{r['warps']}, {r['form']} | {r['ms']} / {after}")
    print("one-CTA warps | layer b16 D64 / D128 / D128 lm (graph us) | prompt appends ms b1, b16: back to back / after GEMMs")
    for o in ctas:
        lay = " / ".join(str(r["graph_us"]) for r in rows if r["case"] == "layer" and r.get("cta_warps") == o)
        pr = ", ".join(" / ".join(str(r["ms"]) for r in rows if r["case"] == "prompt" and r.get("cta_warps") == o
                                  and r["batch"] == b) for b in (1, 16))
        print(o, "|", lay, "|", pr)
    print("bytes equal to the shipped kernel:", all(r["equal"] for r in rows if r["case"] == "bytes"))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "seconds": round(time.perf_counter() - t0, 1)}, indent=1))
    return 0 if all(r["equal"] for r in rows if r["case"] == "bytes") else 1


if __name__ == "__main__":
    sys.exit(main())
