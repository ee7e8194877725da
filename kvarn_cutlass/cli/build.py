"""``kvarn-cutlass build``: compile every registered kernel for the given architectures (no GPU needed), so
that a GPU run after a build never compiles a kernel on first use.

While it runs, stderr shows each module as it finishes (which one, how many are left, from the
kernel cache or compiled, and how long it took): a progress bar on a terminal, a line per module
elsewhere. The modules build in ``--jobs`` worker processes, by default one per CPU core. At the
end it prints a short summary; ``--verbose`` adds the table of every kernel: registers, static
shared memory, stack, spills and ptxas time, and per module the whole compile time (also for cache
hits, where it is the time of the compilation that made the entry). Spills and ptxas time come from
the compiler log and show as ``?`` (JSON ``null``) when the log lacked them. ``--json`` prints
every field of every kernel as one document.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from .argtypes import positive_int
from .progress import Progress

__all__ = ["add_parser", "run"]


def default_jobs() -> int:
    """The CPU cores this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    jobs = default_jobs()
    p = subparsers.add_parser(
        "build",
        help="compile every registered kernel (no GPU needed)",
        description="Compile every registered kernel family for each --arch, with progress on stderr, and report "
        "resource usage: a summary, the table of every kernel with --verbose, every field with --json.",
    )
    p.add_argument("--arch", action="append", metavar="ARCH",
                   help="target, e.g. sm90, sm_90a, sm80; repeatable (default: the current GPU's)")
    p.add_argument("--family", action="append", metavar="NAME", help="only these kernel families (repeatable)")
    p.add_argument("--backend", choices=("nvrtc", "nvcc"), help="compiler (default: $KVARN_CUTLASS_COMPILER or nvrtc)")
    p.add_argument("--jobs", type=positive_int, default=jobs, metavar="N",
                   help=f"compile N modules at once in worker processes (default {jobs}: one per CPU core; "
                        "the disk cache is process-safe)")
    p.add_argument("--verbose", action="store_true", help="also print the table of every kernel")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the summary")
    p.add_argument("--no-progress", action="store_true", help="no progress display on stderr")
    return p


def _build_task(job: tuple) -> tuple:
    """Worker: build one (spec, arch); returns (compiled, None) or (None, (message, log))."""
    from ..runtime.errors import CompileError
    from ..runtime.spec import build

    spec, arch, backend = job
    try:
        return build(spec, arch, backend), None
    except CompileError as e:
        return None, (str(e).splitlines()[0], e.log)


def _task_note(job: tuple, result: tuple) -> str:
    """What became of one build, for the progress display."""
    name = f"{job[0].name} {job[1]}"
    built, failure = result
    if failure is not None:
        return f"{name}: FAILED ({failure[0]})"
    return f"{name}: {'from the kernel cache' if built.cached else f'compiled in {built.compile_seconds:.1f} s'}"


def _run_tasks(tasks: list[tuple], workers: int, progress: Progress) -> list[tuple]:
    """Every task's result, in task order, built ``workers`` at a time."""
    results: list = [None] * len(tasks)
    if workers == 1:
        for i, task in enumerate(tasks):
            results[i] = _build_task(task)
            progress.step(note=_task_note(task, results[i]))
        return results
    from concurrent.futures import as_completed

    from .workers import worker_pool

    with worker_pool(workers) as pool:
        futures = {pool.submit(_build_task, task): i for i, task in enumerate(tasks)}
        for future in as_completed(futures):
            i = futures[future]
            results[i] = future.result()
            progress.step(note=_task_note(tasks[i], results[i]))
    return results


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
    tasks = [(spec, arch, args.backend) for _, spec, arch in jobs]
    workers = min(args.jobs, max(1, len(tasks)))
    with Progress(len(tasks), "build", unit="module", enabled=not args.no_progress) as progress:
        results = _run_tasks(tasks, workers, progress)
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
            show(r.get("ptxas_ms"), "{:.1f}"), f"{r['module_compile_s']:.3f}",
            "yes" if r["cached"] else "no",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    for r in records:
        if "error" in r:
            lines.append(f"FAILED {r['family']}/{r['module']} {r['arch']}: {r['error']}\n{r['log'].rstrip()}")
    return "\n".join(lines)


def _summary(records: list[dict[str, Any]], seconds: float) -> str:
    """A few lines: modules and kernels per target, compiled vs from the cache, the heaviest kernels,
    spills, failures (first line of each; the logs are in --verbose and --json)."""
    ok = [r for r in records if "error" not in r]
    failed = [r for r in records if "error" in r]
    modules = {(r["family"], r["module"], r["arch"]): r for r in ok}
    compiled = sum(1 for r in modules.values() if not r["cached"])
    targets = ", ".join(sorted({r["target"] for r in ok})) or "-"
    lines = [f"kvarn-cutlass build: {len(modules)} modules ({len(ok)} kernels) for {targets} in {seconds:.1f} s: "
             f"{compiled} compiled, {len(modules) - compiled} from the kernel cache, {len(failed)} failed"]
    if ok:
        regs = max(ok, key=lambda r: r.get("registers") or 0)
        smem = max(ok, key=lambda r: r.get("shared_bytes") or 0)
        spilling = [r for r in ok if (r.get("spill_store_bytes") or 0) + (r.get("spill_load_bytes") or 0) > 0]
        unknown = sum(1 for r in ok if r.get("spill_store_bytes") is None)
        spills = (f"{len(spilling)} kernel(s) spill registers ({', '.join(r['kernel'] for r in spilling[:3])}"
                  f"{', ...' if len(spilling) > 3 else ''})" if spilling else "no kernel spills registers")
        if unknown:
            spills += f" ({unknown} not reported by the compiler log)"
        smem_note = (f"; most static shared memory: {smem['shared_bytes']} B ({smem['kernel']})"
                     if smem.get("shared_bytes") else "; no static shared memory")
        lines.append(f"  most registers: {regs.get('registers')} ({regs['kernel']}, {regs['target']}){smem_note}")
        lines.append(f"  {spills}")
    for r in failed:
        lines.append(f"  FAILED {r['family']}/{r['module']} {r['arch']}: {r['error']}")
    lines.append("  every kernel: --verbose (table) or --json")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    records = _records(args)
    if args.json:
        json.dump({"kernels": records}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        if args.verbose:
            print(_table(records))
        print(_summary(records, time.perf_counter() - t0))
    failed = [r for r in records if "error" in r]
    if failed:
        print(f"kvarn-cutlass build: {len(failed)} module build(s) failed", file=sys.stderr)
        return 1
    return 0
