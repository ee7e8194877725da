"""``kvarn-cutlass sass``: compile a K-score GEMM config (no GPU) and dump its SASS with a summary."""
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
    p.add_argument("-o", "--output", metavar="FILE", help="write the SASS listing here (default: the summary only)")
    return p


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
    print(json.dumps(dump(config_from_args(args), args.output), indent=1))
    return 0
