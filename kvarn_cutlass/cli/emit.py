"""``kvarn-cutlass emit``: print the generated C++ of the K-score GEMM for a bucket or config (no GPU)."""
from __future__ import annotations

import argparse
import json
import re
from typing import Any

_BUCKET = re.compile(r"M(\d+)_T(\d+)_D(\d+)(?:_(f16|f32))?")


def bucket_arg(text: str) -> str:
    """argparse type of --bucket: ``M<rows>_T<tile tokens>_D<head_dim>[_f16|_f32]``."""
    if not _BUCKET.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected M<rows>_T<tokens>_D<head_dim>[_f16|_f32], e.g. M4096_T128_D128_f16, "
                                         f"got {text!r}")
    return text


def config_arg(text: str) -> dict:
    """argparse type of --config: a JSON object of GemmConfig fields."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object of GemmConfig fields, got {text!r}")
    return value


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", default="sm90", help="target architecture (only sm90)")
    p.add_argument("--bucket", type=bucket_arg, help="shape bucket, e.g. M4096_T128_D128_f16 (config from gemm_configs/)")
    p.add_argument("--config", type=config_arg, help="GemmConfig as JSON (overrides --bucket)")


def config_from_args(args: argparse.Namespace):
    import warnings

    from ..runtime import normalize_arch
    from ..gemm.config import GemmConfig
    from ..gemm.configs import UntunedConfigWarning, select_config

    cc = normalize_arch(args.arch)
    if args.config:
        return GemmConfig.from_dict(args.config)
    if args.bucket:
        m, t, d, out = _BUCKET.fullmatch(args.bucket).groups()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UntunedConfigWarning)
            return select_config(cc, int(m), int(t), int(d), 1, out or "f16")
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
