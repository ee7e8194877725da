"""``kvarn-cutlass emit``: print the generated C++ of the K-score GEMM for a bucket or config (no GPU)."""
from __future__ import annotations

import argparse
import json
from typing import Any

DESCRIPTION = (
    "Print the CUDA C++ source that kvarn-cutlass generates for the CUTLASS 3.x int8 K-score GEMM (sm_90a: "
    "wgmma, TMA, the K-score epilogue) of a shape bucket (its config from gemm_configs/sm90.json, or the "
    "untuned default) or of an explicit config. No GPU and no compiler needed; `kvarn-cutlass sass` compiles "
    "the same source."
)


def bucket_arg(text: str) -> str:
    """argparse type of --bucket: ``M<rows>_T<tile tokens>_D<head_dim>[_f16|_f32]`` with a supported
    head_dim, tile size and output dtype (any M >= 1: it is rounded to its bucket)."""
    from ..gemm.configs import parse_bucket

    try:
        parse_bucket(text, table_key=False)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
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
    p.add_argument("--arch", default="sm90",
                   help="target architecture; the K-score GEMM exists for sm90 only (default sm90)")
    p.add_argument("--bucket", type=bucket_arg,
                   help="shape bucket, e.g. M4096_T128_D128_f16: its config from gemm_configs/ "
                        "(default: neither --bucket nor --config, the default config)")
    p.add_argument("--config", type=config_arg, help="GemmConfig fields as JSON (overrides --bucket)")


def config_from_args(args: argparse.Namespace):
    """The GemmConfig that --arch/--bucket/--config name. Raises ValueError for an architecture
    other than sm_90 (the GEMM is built from sm_90a wgmma/TMA collectives) or an invalid --config."""
    import warnings

    from ..gemm.config import GemmConfig, validate_config
    from ..gemm.configs import UntunedConfigWarning, parse_bucket, select_config
    from ..runtime.arch import normalize_arch

    cc = normalize_arch(args.arch)
    if cc != 90:
        raise ValueError(f"--arch {args.arch}: the K-score GEMM is an sm_90a kernel (wgmma, TMA); "
                         "only --arch sm90 is supported")
    if args.config:
        cfg = GemmConfig.from_dict(args.config)
        ok, why = validate_config(cfg)
        if not ok:
            raise ValueError(f"--config: {why}")
        return cfg
    if args.bucket:
        M, T, D, out = parse_bucket(args.bucket, table_key=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UntunedConfigWarning)
            return select_config(cc, M, T, D, 1, out)
    return GemmConfig()


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("emit", help="print the generated CUTLASS C++ of a K-score GEMM config",
                              description=DESCRIPTION)
    add_config_args(p)
    p.add_argument("--cppgen", action="store_true", help="print cutlass_cppgen's equivalent emission instead")
    return p


def run(args: argparse.Namespace) -> int:
    from ..gemm.emit import cppgen_reference_source, emit_source

    cfg = config_from_args(args)
    print(cppgen_reference_source(cfg) if args.cppgen else emit_source(cfg))
    return 0
