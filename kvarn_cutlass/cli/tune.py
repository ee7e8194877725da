"""``kvarn-cutlass tune``: time the fused prefill kernel's configs per bucket on the GPU and write the fastest
into ``gemm_configs/prefill_sm<arch>.json``.

The measurement itself is :func:`kvarn_cutlass.ops.prefill_tune.run_tune` (one ``--chunk``-token chunk
over a ``--context``-token cache per candidate, checked against the torch path, median of ``--runs``);
this module is its command line: bucket keys are checked at parse time, ``--dry-run`` lists the
candidates without a GPU, and a missing GPU is one line before anything is built.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .argtypes import checked_by, positive_int

__all__ = ["add_parser", "run", "bucket_arg", "require_gpu"]

DEFAULT_RUNS = 10
DEFAULT_CONTEXT, DEFAULT_CHUNK = 16384, 512


def _parse_bucket(text: str) -> object:
    from ..ops.prefill_tune import parse_bucket  # imported when the option is given, not at CLI start-up

    return parse_bucket(text)


# argparse type of --buckets: a fused-prefill bucket key such as ``D128_T128_V2`` or ``D128_T128_V2_lm``
# (head_dim, tile tokens, V bits, Lloyd-Max quantizer)
bucket_arg = checked_by(_parse_bucket, "bucket")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "tune", help="time the fused prefill kernel's configs per bucket (GPU) -> gemm_configs/prefill_sm<arch>.json",
        description="Time every candidate config of the fused prefill kernel (FusedConfig: rows per consumer warp, "
        "consumer warps, tokens per block, producer groups) that fits each bucket, on one --chunk-token chunk "
        "over a --context-token cache with Qwen3-8B heads; check each result against the torch path and write "
        "the fastest correct config per bucket, with its times and provenance, into "
        "gemm_configs/prefill_sm<arch>.json (after every bucket; a bucket whose candidates all fail keeps its "
        "entry). Needs a CUDA GPU; --dry-run lists the candidates without one.")
    p.add_argument("--kernel", choices=("prefill",), default="prefill",
                   help="the kernel to tune: the fused prefill kernel, the only one with tuned configs (default)")
    p.add_argument("--buckets", nargs="+", type=bucket_arg, metavar="BUCKET",
                   help="bucket keys D<head_dim>_T<tile tokens>_V<v bits>[_lm], e.g. D128_T128_V2 "
                        "(default: kvarn_cutlass.ops.prefill_tune.DEFAULT_BUCKETS)")
    p.add_argument("--dry-run", action="store_true", help="list the candidates of each bucket; no compile, no GPU")
    p.add_argument("--runs", type=positive_int, default=DEFAULT_RUNS, metavar="N",
                   help=f"timed runs per candidate, after one warm-up (default {DEFAULT_RUNS})")
    p.add_argument("--context", type=positive_int, default=DEFAULT_CONTEXT, metavar="TOKENS",
                   help=f"tokens in the cache the chunk attends to (default {DEFAULT_CONTEXT})")
    p.add_argument("--chunk", type=positive_int, default=DEFAULT_CHUNK, metavar="TOKENS",
                   help=f"tokens of the timed chunk (default {DEFAULT_CHUNK})")
    p.add_argument("--output", default=None, metavar="FILE",
                   help="table to merge the winners into (default: gemm_configs/prefill_sm<arch>.json of the package)")
    return p


def require_gpu() -> str:
    """The name of the current CUDA device once it has answered an allocation.

    Raises RuntimeError saying what is missing (no CUDA device, or one that fails its first allocation)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("tune measures on a CUDA GPU and torch sees no CUDA device "
                           "(--dry-run lists the candidates without one)")
    name = torch.cuda.get_device_name()
    try:
        torch.zeros(1, device="cuda").add_(1).item()
    except Exception as e:  # a busy or broken device: say it now, not after the first bucket's compiles
        raise RuntimeError(f"the GPU {name} does not answer an allocation: {type(e).__name__}: {e}") from None
    return name


def _dry_run(buckets: list[str]) -> int:
    from ..ops.prefill import CANDIDATES
    from ..ops.prefill_tune import parse_bucket

    for key in buckets:
        spec = parse_bucket(key)
        fitting = [c.name for c in CANDIDATES if c.fits(spec.head_dim, spec.tile_tokens)]
        print(f"{key}: {len(fitting)} configs")
        for name in fitting:
            print(f"  {name}")
    return 0


def run(args: argparse.Namespace) -> int:
    from ..ops.prefill_tune import DEFAULT_BUCKETS

    buckets = args.buckets or list(DEFAULT_BUCKETS)
    if args.dry_run:
        return _dry_run(buckets)
    name = require_gpu()
    print(f"kvarn-cutlass tune: {len(buckets)} bucket(s) on {name}", file=sys.stderr, flush=True)
    from ..ops.prefill_tune import run_tune

    return run_tune(buckets, context=args.context, chunk=args.chunk, reps=args.runs, output=args.output)
