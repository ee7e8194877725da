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
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="compile N modules at once in worker processes (default 1; the disk cache is process-safe)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    return p


def _build_one(job: tuple) -> tuple:
    """Worker: build one (spec, arch); returns (compiled, None) or (None, (message, log))."""
    from ..runtime.errors import CompileError
    from ..runtime.spec import build

    spec, arch, backend = job
    try:
        return build(spec, arch, backend), None
    except CompileError as e:
        return None, (str(e).splitlines()[0], e.log)


def _records(args: argparse.Namespace) -> list[dict[str, Any]]:
    from ..runtime import registry
    from ..runtime.arch import device_arch, normalize_arch

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
    jobs = [(family, spec, arch) for family, specs in families.items() if not args.family or family in args.family
            for spec in specs for arch in arches]
    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    work = [(spec, arch, args.backend) for _, spec, arch in jobs]
    if args.jobs == 1:
        results = [_build_one(w) for w in work]
    else:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(_build_one, work))
    records: list[dict[str, Any]] = []
    for (family, spec, arch), (compiled, failure) in zip(jobs, results):
        base = {"family": family, "module": spec.name, "source": spec.source_file, "arch": str(arch)}
        if failure is not None:
            records.append({**base, "error": failure[0], "log": failure[1]})
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
