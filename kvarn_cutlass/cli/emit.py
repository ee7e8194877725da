"""``kvarn-cutlass emit``: print the generated C++ of the K-score GEMM for a bucket or config (no GPU)."""
from __future__ import annotations

import argparse
import json
from typing import Any


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", default="sm90", help="target architecture (only sm90)")
    p.add_argument("--bucket", help="shape bucket, e.g. M4096_T128_D128_f16 (config from gemm_configs/)")
    p.add_argument("--config", help="GemmConfig as JSON (overrides --bucket)")


def config_from_args(args: argparse.Namespace):
    import warnings

    from ..runtime import normalize_arch
    from ..gemm.config import GemmConfig
    from ..gemm.configs import UntunedConfigWarning, select_config

    cc = normalize_arch(args.arch)
    if args.config:
        return GemmConfig.from_dict(json.loads(args.config))
    if args.bucket:
        parts = dict((p[0], p[1:]) for p in args.bucket.split("_")[:3])
        out = args.bucket.split("_")[3] if args.bucket.count("_") >= 3 else "f16"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UntunedConfigWarning)
            return select_config(cc, int(parts["M"]), int(parts["T"]), int(parts["D"]), 1, out)
    return GemmConfig()


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("emit", help="print the generated CUTLASS C++ of a K-score GEMM config")
    add_config_args(p)
    p.add_argument("--cppgen", action="store_true", help="print cutlass_cppgen's equivalent emission instead")
    return p


def run(args: argparse.Namespace) -> int:
    from ..gemm.emit import cppgen_reference_source, emit_source

    cfg = config_from_args(args)
    print(cppgen_reference_source(cfg) if args.cppgen else emit_source(cfg))
    return 0
