"""``kvarn-cutlass build``: compile every registered kernel for the given architectures (no GPU needed).

Besides the registered NVRTC families this compiles, for sm_90, every distinct CUTLASS K-score GEMM
config of ``gemm_configs/sm90.json`` (family ``kscore_gemm``, nvcc), so that a GPU run after a build
never compiles a GEMM on first use.

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

from .argtypes import positive_int

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
    p.add_argument("--jobs", type=positive_int, default=1, metavar="N",
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


GEMM_FAMILY = "kscore_gemm"


def _gemm_configs(arch: int) -> list:
    """Distinct configs of ``arch``'s GEMM config table, plus the default config for every output dtype
    (``s32`` is the raw-accumulator check); none below sm_90 (wgmma/TMA)."""
    from ..gemm.config import OUT_DTYPES, GemmConfig
    from ..gemm.configs import load_table

    if arch < 90:
        return []
    table = load_table(arch) or {}
    dicts = [b["config"] for b in table.get("buckets", {}).values()]
    if "default" in table:
        dicts.append(table["default"])
    configs = {GemmConfig.from_dict(d) for d in dicts} | {GemmConfig(out_dtype=o) for o in OUT_DTYPES}
    return sorted(configs, key=lambda c: c.name)


def _build_gemm_one(job: tuple) -> tuple:
    """Worker: build one CUTLASS GEMM config; returns ((cubin resources, ptxas log fields, meta, cached), None)
    or (None, failure)."""
    from ..gemm.compile import build_gemm
    from ..runtime.compiler import cubin_resources, parse_ptxas_log
    from ..runtime.errors import CompileError

    cfg, arch = job
    try:
        binary = build_gemm(cfg, arch)
    except CompileError as e:
        return None, (str(e).splitlines()[0], e.log)
    res = cubin_resources(binary.cubin)
    logged = parse_ptxas_log(binary.ptxas_log)
    return (res, logged, binary.meta, binary.cached), None


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
    unknown = sorted(set(args.family or ()) - set(families) - {GEMM_FAMILY})
    if unknown:
        raise ValueError(f"unknown kernel family {unknown}; registered: {sorted(families)}")
    jobs = [(family, spec, arch) for family, specs in families.items() if not args.family or family in args.family
            for spec in specs for arch in arches]
    work = [(spec, arch, args.backend) for _, spec, arch in jobs]
    gemm_jobs = []
    if not args.family or GEMM_FAMILY in args.family:
        gemm_jobs = [(cfg, normalize_arch(a)) for a in arches for cfg in _gemm_configs(normalize_arch(a))]
    if args.jobs == 1:
        results = [_build_one(w) for w in work]
        gemm_results = [_build_gemm_one(g) for g in gemm_jobs]
    else:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(args.jobs) as pool:
            # the slow nvcc GEMM builds first, so the quick NVRTC modules fill the gaps
            gemm_futures = [pool.submit(_build_gemm_one, g) for g in gemm_jobs]
            results = list(pool.map(_build_one, work))
            gemm_results = [f.result() for f in gemm_futures]
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
    for (cfg, cc), (built, failure) in zip(gemm_jobs, gemm_results):
        base = {"family": GEMM_FAMILY, "module": cfg.name, "source": "cutlass_cppgen", "arch": f"sm{cc}"}
        if failure is not None:
            records.append({**base, "error": failure[0], "log": failure[1]})
            continue
        res, logged, meta, cached = built
        kernel_res = next(iter(res.values()), None)
        extra = next(iter(logged.values()), None)
        fields = dict(vars(kernel_res)) if kernel_res is not None else {}
        if extra is not None:  # spills and ptxas time are only in the nvcc log
            fields.update({k: v for k, v in vars(extra).items() if fields.get(k) is None})
        records.append({
            **base,
            "target": f"sm_{cc}a",
            "kernel": cfg.name,
            **fields,
            "module_compile_s": float(meta.get("seconds", 0.0)),
            "cached": cached,
            "compiler": f"nvcc {meta.get('nvcc', '?')}",
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
            show(r.get("ptxas_ms"), "{:.1f}"), f"{r['module_compile_s']:.3f}",
            "yes" if r["cached"] else "no",
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
