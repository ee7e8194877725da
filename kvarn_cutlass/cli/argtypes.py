"""argparse ``type=`` converters shared by the subcommands, and :func:`resolve_device` for their
``--device {auto,cpu,cuda}`` option.

A bad value becomes argparse's one-line usage error (exit status 2) naming the option, before any
heavy import or work: ``kvarn-cutlass demo: error: argument --tokens: must be an integer >= 2, got '-5'``.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from typing import Callable


def int_at_least(low: int) -> Callable[[str], int]:
    """Converter to an int >= ``low``."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    convert.__name__ = f"int>={low}"  # argparse names the type in some messages
    return convert


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def non_negative_float(text: str) -> float:
    """Converter to a finite float >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def checked_by(check: Callable[[str], object], name: str) -> Callable[[str], str]:
    """Converter that returns the text unchanged when ``check(text)`` accepts it; the ValueError that
    ``check`` raises (a library parser's own message) becomes argparse's error."""

    def convert(text: str) -> str:
        try:
            check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text

    convert.__name__ = name  # argparse names the type in some messages
    return convert


def existing_file(text: str) -> str:
    """A path that names an existing regular file (returned unchanged)."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return text


def existing_dir(text: str) -> str:
    """A path that names an existing directory (returned unchanged)."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"no such directory: {text!r}")
    return text


def regex(text: str) -> re.Pattern:
    """A compiled regular expression (``re.compile``)."""
    try:
        return re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"not a regular expression ({e}): {text!r}") from None


def non_empty(text: str) -> str:
    """A string with at least one character (returned unchanged)."""
    if text == "":
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def read_text_file(path: str, option: str) -> str:
    """The UTF-8 text of ``path``; a file that is not UTF-8 raises ValueError naming ``option``, the
    file and the first offending byte offset."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{option} {path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}: "
                         f"{e.reason})") from None


def resolve_device(choice: str) -> str:
    """``--device`` value -> ``"cuda"`` or ``"cpu"`` (``auto``: cuda when torch sees a CUDA device).

    Raises RuntimeError when ``cuda`` is asked for and torch sees no CUDA device.
    """
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device")
    return choice
