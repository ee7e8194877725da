#!/usr/bin/env python
"""Thin wrapper: ``python tools/dump_sass.py [--bucket D128_T128_V2] [--config r32c4n64 | --module NAME] [-o out.sass]``
(``kvarn-cutlass sass``)."""
import sys
from pathlib import Path

# Run from a checkout without installing: the package is the repository root's kvarn_cutlass/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvarn_cutlass.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["sass", *sys.argv[1:]]))
