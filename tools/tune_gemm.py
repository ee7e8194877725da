#!/usr/bin/env python
"""Thin wrapper: ``python tools/tune_gemm.py [--dry-run] [--buckets ...] [--jobs N]`` (see ``kvarn-cutlass tune``)."""
import sys
from pathlib import Path

# Run from a checkout without installing: the package is the repository root's kvarn_cutlass/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvarn_cutlass.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["tune", *sys.argv[1:]]))
