"""Progress of long subcommands on stderr: a tqdm bar on a terminal, plain lines elsewhere.

On a terminal the bar shows steps done / total, rate and time left, with the latest note beside it.
Where stderr is a file or a pipe (CI logs, ``2> log``) a bar would be carriage-return noise, so each
step that comes with a note prints one line ``<desc> [done/total] <note>`` instead; steps without
a note print nothing there.
"""

from __future__ import annotations

import sys
from typing import TextIO


class Progress:
    """``total`` steps of ``desc`` (e.g. ``"build"``), counted in ``unit``; ``enabled=False`` prints nothing."""

    def __init__(self, total: int, desc: str, unit: str = "it", enabled: bool = True, stream: TextIO | None = None):
        self.total, self.desc, self.done = total, desc, 0
        self.stream = stream if stream is not None else sys.stderr  # looked up now: tests swap sys.stderr
        self.enabled = enabled
        self.bar = None
        if enabled and getattr(self.stream, "isatty", lambda: False)():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream, leave=False, dynamic_ncols=True)

    def step(self, n: int = 1, note: str | None = None) -> None:
        """``n`` more steps done; ``note`` says what was done (a line of its own off a terminal)."""
        self.done += n
        if self.bar is not None:
            if note:
                self.bar.set_postfix_str(note, refresh=False)
            self.bar.update(n)
        elif self.enabled and note:
            print(f"{self.desc} [{self.done}/{self.total}] {note}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
