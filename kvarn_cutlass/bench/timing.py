"""CUDA-event timing of GPU work: warm-up, median of many runs, rotating inputs, graph replay.

Each timed run calls ``fn(inputs[i % len(inputs)])`` between two CUDA events on the
current stream, so the time is GPU time as the stream saw it (launch gaps included
when the host is slower than the GPU, which is real for small kernels). Rotating
through input sets whose total size exceeds the L2 cache keeps a run from reading
data the previous run left in L2; :func:`rotation_count` sizes that rotation.

With ``graph=True`` one CUDA graph holding one call per input set is captured, and
each timed run replays it; the reported time is per call, so it shows the kernels'
time without host launch overhead (the decode step's situation inside a graph).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

__all__ = ["Timing", "capture_graph", "elapsed_ms", "interleaved_samples", "l2_cache_bytes", "paired_ratios",
           "queue_lead_us", "rotation_count", "time_cuda", "time_queued", "williams_order"]


@dataclass(frozen=True)
class Timing:
    """Per-call GPU times in microseconds over ``runs`` timed runs."""

    median_us: float
    min_us: float
    p10_us: float
    p90_us: float
    runs: int
    calls_per_run: int
    graph: bool

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def l2_cache_bytes(device: Any = None) -> int:
    """L2 cache size of a CUDA device in bytes."""
    import torch

    return int(torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device()).L2_cache_size)


def rotation_count(bytes_per_set: int, device: Any = None, factor: float = 3.0, max_bytes: int = 8 << 30) -> int:
    """Number of input sets so that together they exceed ``factor`` x the L2 size.

    Args:
        bytes_per_set: bytes one call reads and writes.
        factor: multiple of L2 the rotation must cover; 3 evicts a set before its reuse
            under L2's approximate-LRU replacement.
        max_bytes: cap on the rotation's total memory (large sets need no rotation anyway).

    Returns:
        At least 1; 1 when one set alone exceeds ``factor`` x L2.
    """
    if bytes_per_set <= 0:
        raise ValueError(f"bytes_per_set={bytes_per_set} must be > 0")
    want = math.ceil(factor * l2_cache_bytes(device) / bytes_per_set)
    return max(1, min(want, max_bytes // bytes_per_set))


def _stats(samples_us: list[float], calls: int, graph: bool) -> Timing:
    ordered = sorted(samples_us)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return Timing(statistics.median(ordered), ordered[0], pick(0.1), pick(0.9), len(ordered), calls, graph)


def elapsed_ms(fn: Callable[[], Any], repeats: int = 1) -> float:
    """GPU milliseconds of the work ``fn`` enqueues on the current stream, called ``repeats`` times back to back:
    a CUDA event recorded before the calls and one after them, then one synchronize on the second. ``fn`` must
    only enqueue (no synchronization inside), so that the time is the stream's, with the host's launch gaps where
    the host is slower than the GPU."""
    import torch

    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def capture_graph(call: Callable[[Any], Any], sets: Sequence[Any]) -> Any:
    """A CUDA graph (``torch.cuda.CUDAGraph``) of ``call(s)`` for each input set in turn. Capture needs the
    inputs' work done and the calls warm: each set is run once eagerly on a side stream first."""
    import torch

    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for s in sets:
            call(s)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g):
        for s in sets:
            call(s)
    return g


def time_cuda(
    fn: Callable[..., Any],
    inputs: Sequence[Any] | None = None,
    *,
    warmup: int = 10,
    runs: int = 100,
    graph: bool = False,
) -> Timing:
    """Time ``fn`` on the current CUDA stream.

    Args:
        fn: called as ``fn(inputs[i])`` (or ``fn()`` when ``inputs`` is None); must only
            enqueue GPU work (no synchronization), and for ``graph=True`` be capturable.
        inputs: input sets to rotate through, e.g. ``rotation_count(...)`` of them.
        warmup: untimed runs first (compilation, caches, clocks).
        runs: timed runs; the median is reported.
        graph: time replays of a CUDA graph of one call per input set.

    Returns:
        :class:`Timing`, per call.
    """
    import torch

    if runs < 1 or warmup < 0:
        raise ValueError(f"runs={runs} must be >= 1 and warmup={warmup} >= 0")
    sets = list(inputs) if inputs is not None else [None]
    if not sets:
        raise ValueError("inputs must hold at least one input set")
    call = (lambda s: fn()) if inputs is None else fn
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    if graph:
        g = capture_graph(call, sets)
        for _ in range(warmup):
            g.replay()
        for i in range(runs):
            starts[i].record()
            g.replay()
            ends[i].record()
        calls = len(sets)
    else:
        for i in range(warmup):
            call(sets[i % len(sets)])
        for i in range(runs):
            starts[i].record()
            call(sets[i % len(sets)])
            ends[i].record()
        calls = 1
    torch.cuda.synchronize()
    return _stats([s.elapsed_time(e) * 1000.0 / calls for s, e in zip(starts, ends)], calls, graph)


_sleep_cycles_per_us: dict[int, float] = {}


def _cycles_per_us(device: int) -> float:
    """Clock of ``torch.cuda._sleep`` on ``device``, measured once (cycles per microsecond)."""
    import torch

    rate = _sleep_cycles_per_us.get(device)
    if rate is None:
        cycles = 20_000_000
        torch.cuda._sleep(cycles // 10)  # clocks up
        rate = _sleep_cycles_per_us[device] = cycles / (elapsed_ms(lambda: torch.cuda._sleep(cycles)) * 1000.0)
    return rate


def queue_lead_us(host_s: float) -> float:
    """A :func:`time_queued` lead for work whose host side took ``host_s`` seconds in a warm-up: 10x that
    plus 2 ms. (4x plus 0.5-1 ms was too short on a loaded host: an append round took 5.0 ms of host time
    behind a 5.4 ms lead sized from a 1.2 ms warm-up.) A longer lead costs only sleep-kernel time."""
    return 10e6 * host_s + 2000.0


def time_queued(fn: Callable[[], Any], lead_us: float) -> tuple[float, float]:
    """(GPU microseconds, host microseconds) of one call of ``fn``, which must only enqueue work.

    The call is made while a sleep kernel of ``lead_us`` keeps the GPU busy, so the work it enqueues
    runs back to back afterwards: CUDA events around it then time the GPU alone, without the host's
    launch gaps (what the same work costs inside a CUDA graph, less the graph's own per-node cost),
    and the wall time of the call is its host time. Raises RuntimeError if the host took more than
    0.8 x ``lead_us`` (the GPU may then have waited for it): pass a longer lead.
    """
    import time

    import torch

    rate = _cycles_per_us(torch.cuda.current_device())
    torch.cuda.synchronize()
    torch.cuda._sleep(int(lead_us * rate))
    host_s = []

    def call() -> None:
        t0 = time.perf_counter()
        fn()
        host_s.append(time.perf_counter() - t0)

    gpu_ms = elapsed_ms(call)
    host_us = host_s[0] * 1e6
    if host_us > 0.8 * lead_us:
        raise RuntimeError(f"the host took {host_us:.0f} us behind a {lead_us:.0f} us lead: pass a longer lead_us")
    return gpu_ms * 1000.0, host_us


def williams_order(n: int, r: int) -> list[int]:
    """Round ``r``'s order of ``n`` methods, a row of a Williams design: 0, 1, n-1, 2, n-2, ... shifted by r (n
    even: over n rounds every method runs right after each other method once), or for odd n shifted by r // 2 and
    mirrored in odd rounds (over 2n rounds, twice): no method always follows the same one."""
    first = [0]
    lo, hi = 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    if n % 2 == 0:
        return [(x + r) % n for x in first]
    row = [(x + r // 2) % n for x in first]
    return row[::-1] if r % 2 else row


def interleaved_samples(methods: Sequence[Callable[[], float]], rounds: int) -> list[list[float]]:
    """Each method's ``rounds`` samples (what it returns, e.g. its own event-timed ms), taken in rounds in which
    every method runs once, each round's order a row of a Williams design (:func:`williams_order`), so that a drift
    of clocks or of host load lands on every method alike and no method always runs after the same one."""
    samples: list[list[float]] = [[] for _ in methods]
    for r in range(rounds):
        for i in williams_order(len(methods), r):
            samples[i].append(methods[i]())
    return samples


def paired_ratios(samples: Sequence[float], reference: Sequence[float]) -> tuple[float, float, float]:
    """(median, lowest, highest) of ``samples[i] / reference[i]``: each sample against the reference's sample of
    the same round (:func:`interleaved_samples`), so that what drifts between rounds cancels."""
    if not samples or len(samples) != len(reference):
        raise ValueError(f"samples and reference must be non-empty and of one length, got {len(samples)} and "
                         f"{len(reference)}")
    ratios = sorted(a / b for a, b in zip(samples, reference))
    return statistics.median(ratios), ratios[0], ratios[-1]
