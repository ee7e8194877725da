"""``kvarn-cutlass bench``: run benchmark sections on the current GPU and record their results."""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="run benchmark sections on the GPU and record them",
        description="Run benchmark sections (default: all) and merge each section's results, with provenance, "
        "into docs/benchmarks/<gpu>.json (or DIR/<gpu>.json with --out).",
    )
    p.add_argument("--section", action="append", metavar="NAME", help="section to run (repeatable; default: all)")
    p.add_argument("--list", action="store_true", help="list the registered sections and exit")
    p.add_argument("--out", metavar="DIR", help="directory of the record file (default: docs/benchmarks of the checkout)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    p.add_argument("--no-record", action="store_true", help="print results without writing the record file")
    p.add_argument("--json", action="store_true", help="print results as one JSON document")
    return p


def run(args: argparse.Namespace) -> int:
    from ..bench import BenchOptions, sections

    registered = sections()
    if args.list:
        for name, sec in registered.items():
            print(f"{name:16s} {sec.description}")
        return 0
    names = args.section or list(registered)
    unknown = [n for n in names if n not in registered]
    if unknown:
        raise ValueError(f"unknown bench section {unknown}; registered: {sorted(registered)}")

    import torch

    from ..bench.record import default_record_path, provenance, record_section

    if not torch.cuda.is_available():
        raise RuntimeError("bench needs a CUDA device (torch.cuda.is_available() is False)")
    path = None if args.no_record else default_record_path(args.out)
    prov = provenance()
    opts = BenchOptions(quick=args.quick)
    results: dict[str, Any] = {}
    failed = []
    for name in names:
        print(f"bench {name} ...", file=sys.stderr, flush=True)
        try:
            results[name] = registered[name].run(opts)
        except Exception as e:  # one broken section must not cost the others' numbers on a GPU lease
            traceback.print_exc()
            failed.append(f"{name}: {type(e).__name__}: {e}")
            continue
        if path is not None:
            record_section(name, results[name], path, prov)
    if args.json:
        json.dump({"record": str(path) if path else None, "provenance": prov, "sections": results}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        for name, res in results.items():
            print(f"== {name}\n{json.dumps(res, indent=2)}")
        if path is not None:
            print(f"recorded in {path}")
    if failed:
        print("kvarn-cutlass bench: failed sections: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0
