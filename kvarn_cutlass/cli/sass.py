"""``kvarn-cutlass sass``: compile a K-score GEMM config or the fused prefill kernel (no GPU) and dump its SASS
with a summary."""
from __future__ import annotations

import argparse
import json
from typing import Any

from .emit import add_config_args, config_from_args


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "sass", help="compile a K-score GEMM config and write its SASS + summary",
        description="Compile the K-score GEMM of a shape bucket or config for sm_90a with nvcc (no GPU needed; "
        "the kernel cache keeps the result) and print a JSON summary of its SASS: instruction count, IGMMA "
        "(int8 wgmma) count and shapes, warpgroup barriers, local loads/stores, registers, spills, shared "
        "memory, threads, Params size and compile time. -o writes the whole SASS listing (cuobjdump or "
        "nvdisasm) to a file.")
    add_config_args(p)
    p.add_argument("--kernel", choices=("gemm", "prefill"), default="gemm",
                   help="gemm: the CUTLASS K-score GEMM (--bucket/--config); prefill: the fused prefill kernel, "
                        "NVRTC-built (--prefill-bucket, --prefill-config, --dtype) (default: gemm)")
    p.add_argument("--prefill-bucket", default="D128_T128_V2", metavar="KEY",
                   help="--kernel prefill: bucket D<head_dim>_T<tile>_V<v_bits>[_lm] (default D128_T128_V2)")
    p.add_argument("--prefill-config", default=None, metavar="NAME",
                   help="--kernel prefill: config name, e.g. r32c4n64 (default: the tuned one of the bucket)")
    p.add_argument("--dtype", choices=("f16", "bf16"), default="f16",
                   help="--kernel prefill: cache and query dtype (default f16)")
    p.add_argument("-o", "--output", metavar="FILE", help="write the SASS listing here (default: the summary only)")
    return p


def dump_prefill(bucket: str, config: str | None, dtype: str, output: str | None = None) -> dict:
    """Build the fused prefill kernel of ``bucket`` for sm_90 with NVRTC and summarize its SASS."""
    import warnings

    import torch

    from ..gemm.sass import disassemble, summarize
    from ..ops.prefill import FusedConfig, UntunedPrefillConfigWarning, fused_spec, select_config, smem_bytes
    from ..ops.prefill_tune import parse_bucket
    from ..runtime.spec import build

    spec = parse_bucket(bucket)
    if config is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UntunedPrefillConfigWarning)
            cfg = select_config(spec)
    else:
        cfg = FusedConfig.from_name(config)
    if not cfg.fits(spec.head_dim, spec.tile_tokens):
        raise ValueError(f"--prefill-config {cfg.name} does not fit {bucket}")
    dt = torch.float16 if dtype == "f16" else torch.bfloat16
    ks = fused_spec(spec, dt, dt, cfg)
    m = build(ks, "sm_90")
    sass = disassemble(m.cubin)
    if output:
        with open(output, "w") as f:
            f.write(sass)
    s = summarize(sass, m.log).to_dict()
    res = m.resources["kvarn_prefill_fused"]
    s.update(kernel=ks.name, config=cfg.name, registers=res.registers, spill_store_bytes=res.spill_store_bytes,
             smem_bytes=smem_bytes(m.cubin), threads=cfg.threads, hmma=sass.count(" HMMA."))
    return s


def dump(cfg, output: str | None = None) -> dict:
    from ..gemm.compile import build_gemm
    from ..gemm.sass import disassemble, summarize

    b = build_gemm(cfg, 90)
    sass = disassemble(b.cubin)
    if output:
        with open(output, "w") as f:
            f.write(sass)
    h = b.host()
    s = summarize(sass, b.ptxas_log).to_dict()
    s.update(config=cfg.name, smem_bytes=h.smem_size, threads=h.threads, params_bytes=h.params_size,
             compile_seconds=b.meta.get("seconds"))
    return s


def run(args: argparse.Namespace) -> int:
    if args.kernel == "prefill":
        print(json.dumps(dump_prefill(args.prefill_bucket, args.prefill_config, args.dtype, args.output), indent=1))
        return 0
    print(json.dumps(dump(config_from_args(args), args.output), indent=1))
    return 0
