#!/usr/bin/env python3
"""Compare the decode rows of two benchmark records (no GPU): a kernel change against a baseline.

``python3 tools/decode_compare.py BASELINE.json CHANGED.json [--json PATH]``

For each (batch, context) row of ``kvarn-cutlass bench --section decode`` in both records (e.g. the branch's
record and the ``baseline-<gpu>.json`` that ``GPU_BASELINE_TREE`` in tools/gpu_check.sh writes from the same
call): both graph times, their ratio (changed / baseline), each record's ratio to its own graphed cuDNN (the
issue's bars are these) and each one's fraction of the byte floor; the same for the lloyd_max rows (their time
against uniform's). Each record's provenance (GPU, commit, date) heads the table: a comparison across GPUs is
refused, as the two would not be timed on one card.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def decode_section(path: str) -> tuple[dict, dict]:
    """(provenance, results) of the decode section of the record at ``path``."""
    with open(path) as f:
        record = json.load(f)
    try:
        section = record["sections"]["decode"]
    except (KeyError, TypeError):
        raise SystemExit(f"{path}: no decode section (run `kvarn-cutlass bench --section decode`)") from None
    return section["provenance"], section["results"]


def _rows(results: dict, key: str) -> dict[tuple[int, int], dict]:
    return {(r["batch"], r["context"]): r for r in results.get(key, [])}


def _pairs(base: dict, changed: dict, key: str, extra):
    """The rows of ``key`` in both results, matched by shape: the graph times, changed / baseline, and ``extra(rb,
    rc)``'s fields."""
    b, c = _rows(base, key), _rows(changed, key)
    return [{"batch": shape[0], "context": shape[1],
             "baseline_graph_us": b[shape]["graph_us"], "changed_graph_us": c[shape]["graph_us"],
             "changed_over_baseline": round(c[shape]["graph_us"] / b[shape]["graph_us"], 4),
             **extra(b[shape], c[shape])} for shape in sorted(b.keys() & c.keys())]


def compare(base: dict, changed: dict) -> dict:
    """Per row of both results: the graph times, changed / baseline, and each one's bar ratios."""
    return {
        "rows": _pairs(base, changed, "rows", lambda rb, rc: {
            "baseline_cudnn_ratio": round(rb["sdpa_cudnn_graph_us"] / rb["graph_us"], 3),
            "changed_cudnn_ratio": round(rc["sdpa_cudnn_graph_us"] / rc["graph_us"], 3),
            "baseline_floor_fraction": round(rb["floor_us"] / rb["graph_us"], 3),
            "changed_floor_fraction": round(rc["floor_us"] / rc["graph_us"], 3)}),
        "lloyd_max_rows": _pairs(base, changed, "lloyd_max_rows", lambda rb, rc: {
            "baseline_vs_uniform": rb["time_vs_uniform"], "changed_vs_uniform": rc["time_vs_uniform"]}),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("baseline")
    p.add_argument("changed")
    p.add_argument("--json", help="also write the comparison here")
    args = p.parse_args(argv)
    (pb, rb), (pc, rc) = decode_section(args.baseline), decode_section(args.changed)
    if pb.get("gpu") != pc.get("gpu"):
        raise SystemExit(f"the records are from different GPUs ({pb.get('gpu')!r}, {pc.get('gpu')!r}): "
                         "compare runs of one card")
    for name, prov in (("baseline", pb), ("changed", pc)):
        print(f"{name}: {prov.get('gpu')}, commit {prov.get('git_commit')}, {prov.get('date')}")
    cmp_ = compare(rb, rc)
    print(f"{'batch':>5} {'context':>7} {'base us':>9} {'new us':>9} {'new/base':>8} {'cuDNN x base':>12} "
          f"{'cuDNN x new':>11} {'floor base':>10} {'floor new':>9}")
    for r in cmp_["rows"]:
        print(f"{r['batch']:>5} {r['context']:>7} {r['baseline_graph_us']:>9.2f} {r['changed_graph_us']:>9.2f} "
              f"{r['changed_over_baseline']:>8.3f} {r['baseline_cudnn_ratio']:>12.2f} {r['changed_cudnn_ratio']:>11.2f} "
              f"{r['baseline_floor_fraction']:>10.3f} {r['changed_floor_fraction']:>9.3f}")
    for r in cmp_["lloyd_max_rows"]:
        print(f"lloyd_max {r['batch']}/{r['context']}: {r['baseline_graph_us']:.2f} -> {r['changed_graph_us']:.2f} us "
              f"({r['changed_over_baseline']:.3f}); against uniform {r['baseline_vs_uniform']} -> "
              f"{r['changed_vs_uniform']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"baseline": pb, "changed": pc, **cmp_}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
