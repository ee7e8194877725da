#!/usr/bin/env python3
"""Regenerate docs/benchmarks.md and its plots (docs/benchmarks/<gpu>-*.png) from a benchmark record.

    python3 tools/benchmarks_doc.py [RECORD]     # default: docs/benchmarks/h200.json

Needs matplotlib (pip install -e ".[plots]"); no GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvarn_cutlass.bench.report import write_docs_page  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("record", nargs="?", default=str(ROOT / "docs" / "benchmarks" / "h200.json"),
                   help="benchmark record (default: docs/benchmarks/h200.json)")
    args = p.parse_args()
    for path in write_docs_page(args.record, ROOT / "docs"):
        print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
