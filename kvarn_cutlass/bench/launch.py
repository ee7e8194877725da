"""Bench section ``launch``: host overhead of a runtime launch, eager and prepared, vs torch.

Host overhead is the wall time per launch call in a loop of launches of a one-block
self-test kernel (no synchronization inside the loop), median over repeats. The GPU
time of that kernel inside a CUDA graph is reported as well: inside a graph, host
overhead disappears and only that remains.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

from . import BenchOptions, register_section
from .timing import time_cuda

__all__ = ["run"]

_N = 256  # elements: one block, so the GPU finishes each kernel faster than the host can launch


def _host_us(fn: Callable[[], Any], calls: int, repeats: int) -> float:
    import torch

    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) * 1e6 / calls)
    torch.cuda.synchronize()
    return round(statistics.median(samples), 3)


def run(opts: BenchOptions) -> dict[str, Any]:
    """Results: microseconds of host time per launch for each launch path, and GPU time in a graph."""
    import torch

    from ..runtime.selftest import AXPY_SIGNATURE, selftest_module

    x, y, out = (torch.randn(_N, device="cuda") for _ in range(3))
    kernel = selftest_module().kernel("kvarn_selftest_axpy", AXPY_SIGNATURE)
    prepared = kernel.prepare(1, _N, (out, x, y, 2.0, _N))
    calls, repeats = (500, 3) if opts.quick else (5000, 7)
    for fn in (prepared.launch, lambda: torch.add(x, y, out=out)):
        fn()  # first-call costs (module load, torch kernel selection) stay out of the numbers
    results = {
        "prepared_launch_us": _host_us(prepared.launch, calls, repeats),
        "kernel_launch_us": _host_us(lambda: kernel.launch(1, _N, (out, x, y, 2.0, _N)), calls, repeats),
        "torch_add_us": _host_us(lambda: torch.add(x, y, out=out), calls, repeats),
        "graph_gpu_us": time_cuda(lambda _: prepared.launch(), range(64), graph=True,
                                  runs=20 if opts.quick else 100).to_dict(),
        "calls": calls,
        "repeats": repeats,
        "target_prepared_launch_us": 10.0,
    }
    torch.testing.assert_close(out, 2.0 * x + y)  # the timed launches did the work
    return results


register_section("launch", run, "host overhead per kernel launch (prepared, eager, torch) and GPU time in a graph")
