#!/usr/bin/env python
"""Thin wrapper: ``python tools/dump_sass.py [--bucket M4096_T128_D128_f16 | --config JSON] [-o out.sass]``."""
import sys

from kvarn_cutlass.cli import main

if __name__ == "__main__":
    sys.exit(main(["sass", *sys.argv[1:]]))
