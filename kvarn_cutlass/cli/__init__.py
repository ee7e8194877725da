"""``kvarn-cutlass`` command line.

Each subcommand lives in its own module of this package, exposing::

    def add_parser(subparsers) -> argparse.ArgumentParser   # subparsers.add_parser(NAME, help=...)
    def run(args: argparse.Namespace) -> int                 # exit status

and is listed in :data:`COMMANDS`; adding one is one line there. ``run`` raises on
errors; :func:`main` prints them as one line on stderr and exits non-zero (``--debug``
shows the traceback). Subcommand modules import heavy dependencies (torch, CUDA)
inside ``run`` so that ``--help`` stays fast.

SIGTERM (``timeout``, a CI runner cancelling a job) is handled like ^C: it raises
:class:`Terminated`, a ``KeyboardInterrupt``, in the command, so that the same cleanup runs (child
processes and their compilers stopped, temporary files removed); the exit status is 143.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import signal
import sys
import threading
from typing import Iterator, NoReturn, Sequence

__all__ = ["COMMANDS", "Terminated", "main"]

PROG = "kvarn-cutlass"

# Subcommand name -> module implementing add_parser(subparsers) and run(args).
COMMANDS: dict[str, str] = {
    "demo": "kvarn_cutlass.cli.demo",
    "info": "kvarn_cutlass.cli.info",
    "build": "kvarn_cutlass.cli.build",
    "sass": "kvarn_cutlass.cli.sass",
    "tune": "kvarn_cutlass.cli.tune",
    "bench": "kvarn_cutlass.cli.bench",
    "perplexity": "kvarn_cutlass.cli.perplexity",
    "generate": "kvarn_cutlass.cli.generate",
}


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose usage errors are one line on stderr (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Attention over a 4-bit KVarN-quantized KV cache on NVIDIA GPUs.")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        cmd = module.add_parser(sub)
        if cmd.prog.split()[-1] != name:
            raise RuntimeError(f"{module_name}.add_parser registered {cmd.prog!r}, expected the subcommand {name!r}")
        cmd.set_defaults(_run=module.run)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: raised in the main thread so that the command unwinds as on ^C."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def _raise_terminated(signum, frame) -> NoReturn:
    raise Terminated(signum)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return its exit status."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        with _sigterm_as_interrupt():
            return int(args._run(args) or 0)
    except BrokenPipeError:  # output piped into e.g. `head`, which stopped reading
        sys.stderr.close()
        return 1
    except Terminated as e:
        print(f"{PROG} {args.command}: terminated (SIGTERM)", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # every error reaches the user as one line; --debug keeps the traceback
        if args.debug:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"{PROG} {args.command}: error: {type(e).__name__}: {first}", file=sys.stderr)
        return 1
