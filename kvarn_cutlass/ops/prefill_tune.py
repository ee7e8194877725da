"""Offline tuning of the fused prefill kernel: time every candidate config per bucket, write the table.

``kvarn-cutlass tune --kernel prefill [--buckets KEY ...]`` (or ``python -m kvarn_cutlass.ops.prefill_tune``)
on a GPU: for each bucket
(``ops.prefill.bucket_key``: head_dim, tile tokens, V bits, quantizer) builds a cache of
``--context`` tokens (Qwen3-8B heads: 8 KV heads, 32 q heads) and times ``prefill_attention`` of one
``--chunk``-token chunk over it (attention only, ``append=False``; median of ``--reps`` back-to-back calls
between CUDA events after a warm-up, rotating through copies of the inputs so that L2 holds none of them)
for every :data:`CANDIDATES` config that fits, checks each result against the torch path of the same inputs, and writes the fastest correct one into ``gemm_configs/prefill_sm<arch>.json``
with the measured times and provenance, atomically after each bucket. A bucket whose candidates all
fail keeps its old entry (never written as tuned from failed measurements).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from ..format import PRESETS, TileSpec
from ..bench.record import provenance
from .prefill import CANDIDATES, block_order, bucket_key, split_tiles_enabled, table_path

__all__ = ["tune_bucket", "main"]

DEFAULT_BUCKETS = ("D128_T128_V2", "D128_T128_V4", "D128_T128_V2_lm", "D64_T128_V2", "D256_T128_V2",
                   "D128_T64_V2")
HQ, HKV = 32, 8


def _spec_of(key: str) -> TileSpec:
    parts = key.split("_")
    D, T, V = int(parts[0][1:]), int(parts[1][1:]), int(parts[2][1:])
    preset = next(p for p, (kb, vb, t) in PRESETS.items() if vb == V and t == T)
    return TileSpec(preset, D, quantizer="lloyd_max" if parts[-1] == "lm" else "uniform")


def bucket_inputs(spec: TileSpec, context: int, chunk: int):
    """(cache, q, k, v) of the tuner's shape for ``spec``: one layer of a CUDA cache holding ``context`` random
    tokens (Qwen3-8B heads: HQ query / HKV KV heads, window 256), and a ``chunk``-token chunk's fp16 q, k, v."""
    import kvarn_cutlass as kc

    D = spec.head_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    cache = kc.KVarNCache(1, 1, HKV, D, preset=spec.preset, window=256, quantizer=spec.quantizer, device="cuda",
                          max_seq_len=context + chunk)
    if context:
        k = torch.randn(1, HKV, context, D, device="cuda", dtype=torch.float16, generator=g)
        cache.append(0, k, torch.randn_like(k))
    q = torch.randn(1, HQ, chunk, D, device="cuda", dtype=torch.float16, generator=g) * 0.3
    kn = torch.randn(1, HKV, chunk, D, device="cuda", dtype=torch.float16, generator=g)
    return cache, q, kn, torch.randn_like(kn)


def call_bytes(spec: TileSpec, cache, chunk: int) -> int:
    """Bytes one ``prefill_attention`` call of a ``chunk``-token chunk over layer 0 of ``cache`` reads and
    writes: the layer's records, its sink and window tokens, the chunk's q, k, v and the output."""
    layer = cache._layer(0)
    D, item = spec.head_dim, cache.dtype.itemsize
    exact = 2 * HKV * (layer.window_len + layer.sink_len) * D * item
    return HKV * layer.n_tiles * spec.tile_nbytes + exact + (2 * HQ + 2 * HKV) * chunk * D * 2


def rotated_inputs(spec: TileSpec, context: int, chunk: int) -> list[tuple]:
    """:func:`bucket_inputs` sets, as many as ``bench.timing.rotation_count`` asks for one call's bytes, so that
    a timed call finds none of its operands in L2 (in a model every other layer runs between two uses of a
    layer's records). The sets hold the same values in different memory."""
    from ..bench.timing import rotation_count

    first = bucket_inputs(spec, context, chunk)
    count = rotation_count(call_bytes(spec, first[0], chunk))
    return [first] + [bucket_inputs(spec, context, chunk) for _ in range(count - 1)]


def time_config(sets: list[tuple], cfg, out: torch.Tensor, reps: int) -> float:
    """Median ms per call of the fused kernel in ``cfg`` (attention only, into ``out``) over ``reps`` calls that
    rotate through ``sets`` of (cache, q, k, v) (:func:`rotated_inputs`), back to back between CUDA events
    (``bench.timing.time_cuda``: no synchronization between calls, so the host's launch time is not counted
    while it stays under the kernel's), after 3 warm-up calls."""
    import kvarn_cutlass as kc

    from ..bench.timing import time_cuda

    def call(x):
        cache, q, k, v = x
        return kc.prefill_attention(q, k, v, cache, 0, append=False, config=cfg, out=out)

    return time_cuda(call, sets, warmup=3, runs=reps).median_us / 1000.0


def tune_bucket(key: str, context: int, chunk: int, reps: int) -> dict:
    import kvarn_cutlass as kc

    spec = _spec_of(key)
    D = spec.head_dim
    sets = rotated_inputs(spec, context, chunk)
    cache, q, kn, vn = sets[0]
    want = kc.prefill_attention(q, kn, vn, cache, 0, append=False, impl="torch").float()
    rows = []
    major, minor = torch.cuda.get_device_capability()
    for cfg in CANDIDATES:
        if not cfg.fits(D, spec.tile_tokens) or not cfg.supported_on(10 * major + minor):
            continue
        row = {"config": cfg.name}
        try:
            out = kc.prefill_attention(q, kn, vn, cache, 0, append=False, config=cfg)
            err = ((out.float() - want).norm() / want.norm()).item()
            if not err < 5e-3:
                raise RuntimeError(f"error {err:.2e} against the torch path")
            row.update(time_ms=round(time_config(sets, cfg, out, reps), 4), error=err,
                       fields=vars(cfg).copy())
        except Exception as e:  # a failing candidate is recorded and skipped, never selected
            row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
    ok = [r for r in rows if "time_ms" in r]
    return {"rows": rows, "best": min(ok, key=lambda r: r["time_ms"]) if ok else None}


def parse_bucket(key: str) -> TileSpec:
    """The TileSpec a bucket key stands for; ValueError naming what is wrong."""
    parts = key.split("_")
    if len(parts) not in (3, 4) or parts[0][:1] != "D" or parts[1][:1] != "T" or parts[2][:1] != "V" or (
            len(parts) == 4 and parts[3] != "lm"):
        raise ValueError(f"{key!r} is not a prefill bucket: expected D<head_dim>_T<tile_tokens>_V<v_bits>[_lm], "
                         f"e.g. {DEFAULT_BUCKETS[0]}")
    try:
        spec = _spec_of(key)
    except StopIteration:
        raise ValueError(f"{key!r}: no preset has that tile size and V width (presets: {list(PRESETS)})") from None
    except ValueError as e:  # the TileSpec's own message (e.g. an unsupported head_dim)
        raise ValueError(f"{key!r}: {e}") from None
    if bucket_key(spec) != key:
        raise ValueError(f"{key!r} is not a prefill bucket (head_dim {spec.head_dim}?)")
    return spec


def run_tune(buckets, context: int = 16384, chunk: int = 512, reps: int = 10, output: str | None = None) -> int:
    """Tune ``buckets`` on the current GPU and merge the winners into the table (``output`` or
    :func:`kvarn_cutlass.ops.prefill.table_path`); returns a process exit status."""
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm{major}{minor}"
    path = Path(output) if output else table_path(arch)
    table = json.loads(path.read_text()) if path.exists() else {"schema": 1, "arch": arch, "buckets": {}}
    prov = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": datetime.date.today().isoformat(), "tool": "kvarn-cutlass tune --kernel prefill",
            "shape": f"context {context}, chunk {chunk}, {HQ} q / {HKV} KV heads",
            "method": "median of back-to-back calls between CUDA events, inputs rotated past L2",
            "launch": f"{block_order()} order, split tiles {'on' if split_tiles_enabled() else 'off'}",
            "git_commit": provenance()["git_commit"]}
    failed = 0
    for key in buckets:
        res = tune_bucket(key, context, chunk, reps)
        print(key, json.dumps(res["rows"]))
        if res["best"] is None:
            print(f"{key}: no candidate ran correctly; the table keeps its entry", file=sys.stderr)
            failed += 1
            continue
        table["buckets"][key] = {"status": "tuned", "config": res["best"]["fields"], "time_ms": res["best"]["time_ms"],
                                 "candidates": res["rows"], "provenance": prov}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)  # after every bucket, atomically: a later failure loses nothing measured
    print(f"wrote {path}")
    return 1 if failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvarn_cutlass.ops.prefill_tune", description=__doc__.split("\n")[0])
    ap.add_argument("--buckets", nargs="+", default=list(DEFAULT_BUCKETS))
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: tuning needs a CUDA GPU", file=sys.stderr)
        return 2
    for key in args.buckets:
        parse_bucket(key)
    return run_tune(args.buckets, args.context, args.chunk, args.reps)


if __name__ == "__main__":
    sys.exit(main())
