"""``kvarn-cutlass build``: compile every registered kernel for the given architectures (no GPU needed).

Reports per kernel: registers, static shared memory, stack, spills and ptxas time,
and per module the whole compile time (also for cache hits, where it is the time of
the compilation that made the entry). Spills and ptxas time come from the compiler
log and show as ``?`` (JSON ``null``) when the log lacked them.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "build",
        help="compile every registered kernel (no GPU needed)",
        description="Compile every registered kernel family for each --arch and report resource usage.",
    )
    p.add_argument("--arch", action="append", metavar="ARCH",
                   help="target, e.g. sm90, sm_90a, sm80; repeatable (default: the current GPU's)")
    p.add_argument("--family", action="append", metavar="NAME", help="only these kernel families (repeatable)")
    p.add_argument("--backend", choices=("nvrtc", "nvcc"), help="compiler (default: $KVARN_CUTLASS_COMPILER or nvrtc)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    return p


def _records(args: argparse.Namespace) -> list[dict[str, Any]]:
    from . import registry
    from .arch import device_arch, normalize_arch
    from .errors import CompileError
    from .spec import build

    if not args.arch:
        import torch

        if not torch.cuda.is_available():
            raise ValueError("no CUDA device to take the architecture from; pass --arch, e.g. --arch sm90")
    arches = args.arch or [device_arch()]
    for a in arches:
        normalize_arch(a)  # reject a bad --arch before compiling anything
    families = registry.families()
    unknown = sorted(set(args.family or ()) - set(families))
    if unknown:
        raise ValueError(f"unknown kernel family {unknown}; registered: {sorted(families)}")
    records: list[dict[str, Any]] = []
    for family, specs in families.items():
        if args.family and family not in args.family:
            continue
        for spec in specs:
            for arch in arches:
                base = {"family": family, "module": spec.name, "source": spec.source_file, "arch": str(arch)}
                try:
                    compiled = build(spec, arch, args.backend)
                except CompileError as e:
                    records.append({**base, "error": str(e).splitlines()[0], "log": e.log})
                    continue
                for kernel in spec.kernel_names:
                    res = compiled.resources.get(kernel)
                    records.append({
                        **base,
                        "target": compiled.target,
                        "kernel": kernel,
                        **(vars(res) if res is not None else {}),
                        "module_compile_s": round(compiled.compile_seconds, 4),
                        "cached": compiled.cached,
                        "compiler": compiled.compiler,
                    })
    return records


def _table(records: list[dict[str, Any]]) -> str:
    head = ("family", "kernel", "target", "regs", "smem", "stack", "spill st/ld", "ptxas ms", "module s", "cached")
    rows = [head]

    def show(value: Any, fmt: str = "{}") -> str:
        return "?" if value is None else fmt.format(value)  # None: the compiler log did not say

    for r in records:
        if "error" in r:
            continue
        rows.append((
            r["family"], r["kernel"], r["target"], show(r.get("registers")), show(r.get("shared_bytes")),
            show(r.get("stack_bytes")), f"{show(r.get('spill_store_bytes'))}/{show(r.get('spill_load_bytes'))}",
            show(r.get("ptxas_ms"), "{:.1f}"), f"{r['module_compile_s']:.3f}", "yes" if r["cached"] else "no",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    for r in records:
        if "error" in r:
            lines.append(f"FAILED {r['family']}/{r['module']} {r['arch']}: {r['error']}\n{r['log'].rstrip()}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    records = _records(args)
    if args.json:
        json.dump({"kernels": records}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(_table(records))
    failed = [r for r in records if "error" in r]
    if failed:
        print(f"kvarn-cutlass build: {len(failed)} module build(s) failed", file=sys.stderr)
        return 1
    return 0
