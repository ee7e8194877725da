"""A process pool whose workers are stopped, with the compilers they started, when the command is
interrupted (^C, SIGTERM) or fails.

Each worker leads its own process group, so that ``os.killpg(worker)`` also reaches the nvcc, cicc
and ptxas processes it runs, and a terminal's ^C reaches only the command, which then stops them.
"""

from __future__ import annotations

import contextlib
import os
import signal
from concurrent.futures import ProcessPoolExecutor
from typing import Iterator


def _worker_init() -> None:
    os.setpgrp()
    # the command's SIGTERM handler (raise in the main thread) is inherited through fork; a worker
    # must die on SIGTERM instead of reporting the exception as a task result and taking the next task
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _stop(pool: ProcessPoolExecutor) -> None:
    # concurrent.futures has no public list of its workers before Python 3.14 (terminate_workers)
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):  # already gone
            pass


@contextlib.contextmanager
def worker_pool(workers: int) -> Iterator[ProcessPoolExecutor]:
    """``ProcessPoolExecutor(workers)``; leaving the block by an exception (KeyboardInterrupt included)
    cancels the pending tasks and stops the running ones' process groups instead of waiting for them."""
    pool = ProcessPoolExecutor(workers, initializer=_worker_init)
    try:
        yield pool
    except BaseException:
        _stop(pool)  # before shutdown(), which drops the list of workers
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
