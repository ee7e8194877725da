"""``kvarn-cutlass sass``: build a kernel module with NVRTC (no GPU) and summarize its SASS.

By default the fused prefill kernel of a bucket (its tuned config, or ``--config``); ``--module NAME``
takes any registered module instead (``--list`` names them: compression, decode, dequantization,
rotation, ...). The summary is one JSON document: the module's source and defines, per-kernel
resources from the CUBIN (registers, spills, stack, static shared memory), and counts from the SASS
listing (instructions, tensor-core instructions by opcode, warpgroup barriers, local loads/stores).

Disassembler: ``cuobjdump -sass`` (else ``nvdisasm``) from ``$CUDA_HOME/bin``, ``/usr/local/cuda/bin``,
PATH, or the pip wheels ``nvidia-cuda-cuobjdump`` / ``nvidia-cuda-nvdisasm``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .argtypes import checked_by
from .tune import bucket_arg

__all__ = ["add_parser", "run", "find_tool", "disassemble", "summarize", "dump_prefill", "dump_module"]

DEFAULT_BUCKET = "D128_T128_V2"


# --- the disassembler --------------------------------------------------------------------------------------
def _candidates(tool: str) -> list[Path]:
    c = [Path(os.environ[v]) / "bin" / tool for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    c.append(Path("/usr/local/cuda/bin") / tool)
    w = shutil.which(tool)
    if w:
        c.append(Path(w))
    for p in map(Path, sys.path):
        for sub in ("nvidia/cu13/bin", "nvidia/cuda_cuobjdump/bin", "nvidia/cuda_nvdisasm/bin"):
            c.append(p / sub / tool)
    return c


def find_tool(tool: str) -> str | None:
    """Path of an executable ``tool`` (``cuobjdump``, ``nvdisasm``) in the places the module docstring lists."""
    for c in _candidates(tool):
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return None


def disassemble(cubin: bytes) -> str:
    """SASS text of ``cubin`` (cuobjdump -sass, else nvdisasm)."""
    tool = find_tool("cuobjdump") or find_tool("nvdisasm")
    if tool is None:
        raise FileNotFoundError("neither cuobjdump nor nvdisasm found; pip install nvidia-cuda-cuobjdump "
                                "(or nvidia-cuda-nvdisasm), or set CUDA_HOME")
    with tempfile.TemporaryDirectory(prefix="kvarn_sass_") as d:
        p = Path(d) / "k.cubin"
        p.write_bytes(cubin)
        cmd = [tool, "-sass", str(p)] if tool.endswith("cuobjdump") else [tool, "-c", str(p)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=d, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


# An instruction line of either disassembler: /*0040*/ [@P0 ]OPCODE...
_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)")
# Tensor-core opcodes: HMMA/IMMA (mma.sync), HGMMA/IGMMA (wgmma, sm_90a).
_MMA = ("HMMA", "IMMA", "HGMMA", "IGMMA")


def kernel_opcodes(sass: str, name: str) -> list[str]:
    """The opcodes of kernel ``name``'s instructions in a SASS listing of its module, in order (predicates
    stripped); KeyError if the listing has no such kernel."""
    parts = re.split(rf"Function : {re.escape(name)}\s", sass, maxsplit=1)  # the whole name, not a prefix
    if len(parts) < 2:
        raise KeyError(f"no kernel {name!r} in the listing")
    return _INSTR.findall(parts[1].split("Function :")[0])


def summarize(sass: str) -> dict[str, Any]:
    """Counts over a SASS listing: instructions, tensor-core instructions by full opcode (shape and types
    included, e.g. ``HMMA.16816.F32``), warpgroup arrive/wait (wgmma), local loads and stores (spills or a
    stack)."""
    ops = _INSTR.findall(sass)
    mma: dict[str, int] = {}
    for o in ops:
        if o.split(".", 1)[0] in _MMA:
            mma[o] = mma.get(o, 0) + 1
    return {
        "instructions": len(ops),
        "mma": dict(sorted(mma.items())),
        "warpgroup_arrive": sum(1 for o in ops if o.startswith("WARPGROUP.ARRIVE")),
        "warpgroup_depbar": sum(1 for o in ops if o.startswith("WARPGROUP.DEPBAR")),
        "ldl": sum(1 for o in ops if o.split(".", 1)[0] == "LDL"),
        "stl": sum(1 for o in ops if o.split(".", 1)[0] == "STL"),
    }


# --- what to dump ------------------------------------------------------------------------------------------
def _dump(spec, arch: str, output: str | None) -> tuple[dict[str, Any], Any]:
    """Build ``spec`` for ``arch`` (through the kernel cache) and summarize it; returns (summary, compiled)."""
    from ..runtime.spec import build

    compiled = build(spec, arch)
    sass = disassemble(compiled.cubin)
    if output:
        Path(output).write_text(sass)
    summary = {
        "module": spec.name, "source": spec.source_file, "target": compiled.target,
        "defines": dict(spec.defines), "options": list(spec.options),
        "kernels": {k: vars(r) for k, r in sorted(compiled.resources.items())},
        "sass": summarize(sass),
    }
    return summary, compiled


def dump_prefill(bucket: str, config: str | None, dtype: str, arch: str = "sm90", output: str | None = None) -> dict:
    """The fused prefill kernel of ``bucket`` (``D128_T128_V2``, ...) in ``config`` (a FusedConfig name; None:
    the bucket's tuned config on ``arch``, else the default) for ``dtype`` (``f16``/``bf16`` cache and queries)."""
    import warnings

    import torch

    from ..ops.prefill import FusedConfig, UntunedPrefillConfigWarning, fused_spec, select_config, smem_bytes
    from ..ops.prefill_tune import parse_bucket
    from ..runtime.arch import normalize_arch

    spec = parse_bucket(bucket)
    if config is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UntunedPrefillConfigWarning)  # the default is what runs: show it
            cfg = select_config(spec, f"sm{normalize_arch(arch)}")
    else:
        cfg = FusedConfig.from_name(config)
    if not cfg.fits(spec.head_dim, spec.tile_tokens):
        raise ValueError(f"--config {cfg.name} does not fit the bucket {bucket}")
    dt = torch.float16 if dtype == "f16" else torch.bfloat16
    summary, compiled = _dump(fused_spec(spec, dt, dt, cfg), arch, output)
    summary.update(config=cfg.name, threads=cfg.threads, dynamic_smem_bytes=smem_bytes(compiled.cubin))
    return summary


def _registered() -> dict[str, tuple[str, Any]]:
    """Module name -> (family, spec) of every registered kernel module."""
    from ..runtime import registry

    return {s.name: (family, s) for family, specs in registry.families().items() for s in specs}


def dump_module(name: str, arch: str = "sm90", output: str | None = None) -> dict:
    """Any registered module by its name (as ``--list`` and ``kvarn-cutlass build --json`` name it)."""
    modules = _registered()
    if name not in modules:
        families = sorted({f for f, _ in modules.values()})
        raise ValueError(f"--module {name!r} is not a registered kernel module (families: {', '.join(families)}; "
                         "`kvarn-cutlass sass --list` names every module)")
    family, spec = modules[name]
    summary, _ = _dump(spec, arch, output)
    return {"family": family, **summary}


def _parse_config(text: str) -> object:
    from ..ops.prefill import FusedConfig  # imported when the option is given, not at CLI start-up

    return FusedConfig.from_name(text)


# argparse type of --config: a fused prefill config name such as ``r32c4n64`` (``FusedConfig.from_name``)
config_arg = checked_by(_parse_config, "config")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "sass", help="build a kernel (the fused prefill by default) with NVRTC and summarize its SASS",
        description="Build the fused prefill kernel of a bucket, or any registered kernel module (--module), "
        "for --arch with NVRTC (no GPU needed; the kernel cache keeps the result) and print a JSON summary: "
        "source and defines, registers, spills, stack and shared memory per kernel, and from the SASS the "
        "instruction count, tensor-core instructions by opcode (HMMA/IMMA: mma.sync; HGMMA/IGMMA: wgmma), "
        "warpgroup barriers and local loads/stores. -o writes the whole SASS listing (cuobjdump or "
        "nvdisasm) to a file.")
    p.add_argument("--bucket", type=bucket_arg, default=None, metavar="KEY",
                   help=f"fused prefill bucket D<head_dim>_T<tile>_V<v_bits>[_lm] (default {DEFAULT_BUCKET})")
    p.add_argument("--config", type=config_arg, default=None, metavar="NAME",
                   help="fused prefill config name, e.g. r32c4n64 (default: the bucket's tuned config on --arch)")
    p.add_argument("--dtype", choices=("f16", "bf16"), default=None,
                   help="fused prefill cache and query dtype (default f16)")
    p.add_argument("--module", default=None, metavar="NAME",
                   help="a registered kernel module instead of the fused prefill (see --list)")
    p.add_argument("--list", action="store_true", help="print the registered kernel modules (family, module) and exit")
    p.add_argument("--arch", default="sm90", help="target architecture, e.g. sm90, sm80 (default sm90)")
    p.add_argument("-o", "--output", metavar="FILE", help="write the SASS listing here (default: the summary only)")
    return p


def run(args: argparse.Namespace) -> int:
    if args.list:
        for name, (family, _) in sorted(_registered().items(), key=lambda kv: (kv[1][0], kv[0])):
            print(f"{family} {name}")
        return 0
    if args.module is not None:
        given = [flag for flag, value in (("--bucket", args.bucket), ("--config", args.config), ("--dtype", args.dtype))
                 if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: the fused prefill's options; --module builds a module as registered")
        summary = dump_module(args.module, args.arch, args.output)
    else:
        summary = dump_prefill(args.bucket or DEFAULT_BUCKET, args.config, args.dtype or "f16", args.arch, args.output)
    print(json.dumps(summary, indent=1))
    return 0
