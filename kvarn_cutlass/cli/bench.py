"""``kvarn-cutlass bench``: run the benchmark sections on the GPU and write results, tables and plots.

One run (default: every registered section, in :data:`kvarn_cutlass.bench.report.SECTION_ORDER`) writes
into an output folder (``--out``, default ``bench-results/<UTC date-time>``):

* ``results.json``: every section's results with provenance, in the record layout of
  :mod:`kvarn_cutlass.bench.record` (rewritten after each section, so a killed run keeps what finished);
* ``results.md``: the tables of :mod:`kvarn_cutlass.bench.report`, beside the SDPA baselines;
* PNG plots of :mod:`kvarn_cutlass.bench.plots` (skipped with a notice without matplotlib).

Each section also merges into ``docs/benchmarks/<gpu>.json`` of the checkout (``--record-dir``,
``--no-record``). ``--from-json FILE`` re-renders the tables and plots of an existing ``results.json``
or ``docs/benchmarks/<gpu>.json`` without a GPU.

A section that registers parts (``e2e``) runs in pieces that each fit one device command: ``--list-parts``
prints them with estimated seconds and groups them into commands under ``--command-limit`` (no GPU);
``--part NAME`` (repeatable, with one ``--section``) runs only those, and the section's ``merge`` folds
them into what the record already holds.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, TextIO

from . import argtypes

__all__ = ["add_parser", "run", "default_out_dir"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="run the benchmark sections on the GPU; write results.json, markdown tables and plots",
        description="Run benchmark sections (default: all) on the current CUDA GPU with a progress display, "
        "and write results.json, results.md (tables beside the SDPA baselines) and PNG plots into an output "
        "folder. Each section also merges into docs/benchmarks/<gpu>.json of the checkout. "
        "--from-json re-renders the tables and plots of an existing record without a GPU.",
    )
    p.add_argument("--section", action="append", metavar="NAME", help="section to run (repeatable; default: all)")
    p.add_argument("--list", action="store_true", help="list the registered sections and exit")
    p.add_argument("--out", metavar="DIR",
                   help="output folder for results.json, results.md and the plots (default: bench-results/<UTC date-time>)")
    p.add_argument("--from-json", metavar="FILE",
                   help="re-render results.md and the plots from FILE (a results.json or docs/benchmarks/<gpu>.json); "
                   "no GPU needed")
    p.add_argument("--record-dir", metavar="DIR",
                   help="folder of the merged record <gpu>.json (default: docs/benchmarks of the checkout)")
    p.add_argument("--no-record", action="store_true", help="do not merge into the record <gpu>.json")
    p.add_argument("--no-plots", action="store_true", help="write the tables only")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    p.add_argument("--part", action="append", metavar="NAME",
                   help="run only this part of the one --section (repeatable; --list-parts names them); the record "
                   "merges the parts")
    p.add_argument("--list-parts", action="store_true",
                   help="print the parts of the sections that have them, with estimated seconds, grouped into "
                   "commands under --command-limit; no GPU needed")
    p.add_argument("--command-limit", type=argtypes.positive_int, default=450, metavar="S",
                   help="seconds one command may take, for --list-parts' grouping (default: 450, three quarters "
                   "of a 10-minute device command: the estimates are rough)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON document instead of the tables")
    return p


def default_out_dir(now: _dt.datetime | None = None) -> Path:
    """``bench-results/<YYYY-MM-DDTHHMMSSZ>`` under the working directory (UTC, so runs never collide in a day)."""
    now = now or _dt.datetime.now(_dt.timezone.utc)
    return Path("bench-results") / now.strftime("%Y-%m-%dT%H%M%SZ")


def _elapsed(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}:{s:02d}"


class _Progress:
    """Which section runs, n/N and elapsed time on ``stream``.

    On a terminal a status line refreshes every second while a section runs; otherwise (logs, pipes)
    one plain line at the start and one at the end of each section.
    """

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr  # looked up now: tests and tools swap it
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def _line(self, i: int, name: str, t_section: float) -> str:
        return f"bench [{i}/{self.total}] {name}: {_elapsed(time.perf_counter() - t_section)} (total {_elapsed(time.perf_counter() - self.t0)})"

    def start(self, i: int, name: str) -> float:
        t_section = time.perf_counter()
        if not self.tty:
            print(f"bench [{i}/{self.total}] {name}: running (total {_elapsed(t_section - self.t0)})",
                  file=self.stream, flush=True)
            return t_section
        self._stop.clear()

        def tick() -> None:
            while not self._stop.wait(1.0):
                self.stream.write("\r" + self._line(i, name, t_section) + "\033[K")
                self.stream.flush()

        self.stream.write(self._line(i, name, t_section))
        self.stream.flush()
        self._ticker = threading.Thread(target=tick, daemon=True)
        self._ticker.start()
        return t_section

    def done(self, i: int, name: str, t_section: float, status: str) -> None:
        if self._ticker is not None:
            self._stop.set()
            self._ticker.join()
            self._ticker = None
            self.stream.write("\r\033[K")
        print(f"bench [{i}/{self.total}] {name}: {status} in {_elapsed(time.perf_counter() - t_section)} "
              f"(total {_elapsed(time.perf_counter() - self.t0)})", file=self.stream, flush=True)


def _out_dir(args: argparse.Namespace) -> Path:
    out = Path(args.out) if args.out else default_out_dir()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: {out} exists and is not a folder")
    return out


def _render(doc: dict[str, Any], out: Path, plots: bool) -> list[Path]:
    from ..bench.report import write_report

    written, notice = write_report(doc, out, plots=plots)
    if notice:
        print(f"kvarn-cutlass bench: {notice}", file=sys.stderr)
    return written


# What rendering raises on a record whose fields have other types or shapes than a bench run writes.
_MALFORMED = (AttributeError, TypeError, KeyError, IndexError, ValueError)


def _check_renderable(doc: dict[str, Any], path: str) -> None:
    """Render each section's tables alone (in memory) so that a malformed one is named before any file
    is written. Raises ValueError naming ``path`` and the section."""
    from ..bench.report import render_markdown

    for name, section in doc["sections"].items():
        try:
            render_markdown({**doc, "sections": {name: section}})
        except _MALFORMED as e:
            raise ValueError(f"--from-json {path}: section {name!r} is not a result record this version can read "
                             f"({type(e).__name__}: {e})") from None


def _from_json(args: argparse.Namespace) -> int:
    from ..bench.report import load_record

    try:
        doc = load_record(args.from_json)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"--from-json: {e}") from None
    if args.section:
        missing = [n for n in args.section if n not in doc["sections"]]
        if missing:
            raise ValueError(f"--section: {missing} not in {args.from_json} (it has {sorted(doc['sections'])})")
        doc = {**doc, "sections": {n: doc["sections"][n] for n in args.section}}
    _check_renderable(doc, args.from_json)
    out = _out_dir(args)
    try:
        written = _render(doc, out, plots=not args.no_plots)
    except _MALFORMED as e:  # the plots read fields the tables do not
        raise ValueError(f"--from-json {args.from_json}: cannot plot it ({type(e).__name__}: {e})") from None
    if args.json:
        print(json.dumps({"out": str(out), "files": [str(p) for p in written]}, indent=2))
    else:
        print("\n".join(f"wrote {p}" for p in written))
    return 0


def group_parts(fixed_s: float, parts: list[tuple[str, float]], limit_s: float) -> list[list[str]]:
    """``parts`` ((name, estimated seconds)) in commands of at most ``limit_s`` each, every command paying
    ``fixed_s`` first: first fit over the parts in decreasing estimate, each command listing its parts in run
    order. A part too long for any command gets one of its own. Raises ValueError for a limit <= ``fixed_s``."""
    if limit_s <= fixed_s:
        raise ValueError(f"--command-limit {limit_s:g} s leaves no time after the {fixed_s:g} s every command "
                         "pays first")
    order = {name: i for i, (name, _) in enumerate(parts)}
    bins: list[tuple[float, list[str]]] = []
    for name, est in sorted(parts, key=lambda p: -p[1]):
        for i, (used, names) in enumerate(bins):
            if used + est <= limit_s:
                bins[i] = (used + est, names + [name])
                break
        else:
            bins.append((fixed_s + est, [name]))
    return [sorted(names, key=order.get) for _, names in bins]


def _list_parts(registered: dict, names: list[str], args: argparse.Namespace) -> int:
    from ..bench import BenchOptions

    with_parts = [n for n in names if registered[n].parts is not None]
    if not with_parts:
        raise ValueError(f"--list-parts: none of {names} runs in parts")
    for name in with_parts:
        plan = registered[name].parts(BenchOptions(quick=args.quick))
        est = dict(plan.parts)
        print(f"{name}: {len(plan.parts)} parts, estimated on an H200; every command first pays ~{plan.fixed_s:.0f} s "
              "(imports, model build, first kernel compiles)")
        for part, s in plan.parts:
            print(f"  {part:18s} ~{s:.0f} s")
        quick = " --quick" if args.quick else ""
        print(f"commands of at most {args.command_limit:.0f} s:")
        for group in group_parts(plan.fixed_s, list(plan.parts), args.command_limit):
            total = plan.fixed_s + sum(est[g] for g in group)
            print(f"  kvarn-cutlass bench --section {name}{quick} " + " ".join(f"--part {g}" for g in group)
                  + f"    # ~{total:.0f} s")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.from_json:
        return _from_json(args)
    if args.part and (not args.section or len(set(args.section)) != 1):
        raise ValueError(f"--part needs exactly one --section, got {args.section or 'none'}")

    from ..bench import BenchOptions, sections
    from ..bench.report import ordered_sections

    registered = sections()
    if args.list:
        for name in ordered_sections(registered):
            print(f"{name:16s} {registered[name].description}")
        return 0
    unknown = [n for n in args.section or [] if n not in registered]
    if unknown:
        raise ValueError(f"--section: unknown bench section {unknown}; registered: {ordered_sections(registered)}")
    names = list(dict.fromkeys(args.section)) if args.section else ordered_sections(registered)
    if args.list_parts:
        return _list_parts(registered, names, args)
    opts = BenchOptions(quick=args.quick, parts=tuple(dict.fromkeys(args.part or ())))
    if opts.parts:
        section = registered[names[0]]
        if section.parts is None:
            raise ValueError(f"--part: section {names[0]!r} does not run in parts")
        known = [n for n, _ in section.parts(opts).parts]
        unknown = [p for p in opts.parts if p not in known]
        if unknown:
            raise ValueError(f"--part: {unknown} not among the parts of {names[0]!r}: {', '.join(known)}")
    out = _out_dir(args)

    import torch

    from ..bench.record import REPO_ROOT, default_record_path, provenance, record_section, write_json_atomic

    if not torch.cuda.is_available():
        raise RuntimeError("bench needs a CUDA GPU (torch.cuda.is_available() is False); "
                           "--from-json FILE re-renders existing results without one")
    record = None
    if not args.no_record:
        if args.record_dir is None and REPO_ROOT is None:
            print("kvarn-cutlass bench: not running from a checkout, so no docs/benchmarks record is merged "
                  "(--record-dir DIR to choose one)", file=sys.stderr)
        else:
            record = default_record_path(args.record_dir)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    prov = provenance()
    doc: dict[str, Any] = {"sections": {}, "failed": [],
                           "options": {"quick": bool(args.quick), "parts": list(opts.parts)}}
    progress = _Progress(len(names))
    for i, name in enumerate(names, 1):
        t_section = progress.start(i, name)
        try:
            res = registered[name].run(opts)
        except Exception as e:  # one broken section must not cost the others' numbers on a GPU lease
            progress.done(i, name, t_section, "FAILED")
            traceback.print_exc()
            doc["failed"].append(f"{name}: {type(e).__name__}: {e}")
        else:
            progress.done(i, name, t_section, "done")
            doc["sections"][name] = {"provenance": prov, "results": res}
            if record is not None:
                try:
                    record_section(name, res, record, prov, merge=registered[name].merge)
                except Exception as e:  # likewise: the numbers stay in results.json, the next sections run
                    traceback.print_exc()
                    doc["failed"].append(f"{name}: merging into {record}: {type(e).__name__}: {e}")
        write_json_atomic(results_path, doc)
    written = [results_path] + _render(doc, out, plots=not args.no_plots)
    if args.json:
        json.dump({"out": str(out), "record": str(record) if record else None, "files": [str(p) for p in written],
                   "provenance": prov, "sections": {n: s["results"] for n, s in doc["sections"].items()},
                   "failed": doc["failed"]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print((out / "results.md").read_text())
        print("\n".join(f"wrote {p}" for p in written))
        if record is not None:
            print(f"merged into {record}")
    if doc["failed"]:
        print("kvarn-cutlass bench: failed sections: " + "; ".join(doc["failed"]), file=sys.stderr)
        return 1
    return 0
