#!/usr/bin/env python
"""Thin wrapper: ``python tools/tune_gemm.py [--dry-run] [--buckets ...] [--jobs N]`` (see ``kvarn-cutlass tune``)."""
import sys

from kvarn_cutlass.cli import main

if __name__ == "__main__":
    sys.exit(main(["tune", *sys.argv[1:]]))
