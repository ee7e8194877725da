"""Bench section ``copy``: device-to-device copy bandwidth, the ceiling for memory-bound kernels.

Bandwidth counts bytes read plus bytes written (2 x size) per ``dst.copy_(src)``, over
rotating buffer pairs so that L2 does not serve the reads.
"""

from __future__ import annotations

from typing import Any

from . import BenchOptions, register_section
from .timing import rotation_count, time_cuda

__all__ = ["run"]

_SIZES_MIB = (4, 64, 1024)
_QUICK_SIZES_MIB = (64,)


def run(opts: BenchOptions) -> dict[str, Any]:
    """Results: per size, bytes, timing and GB/s (1e9 bytes/s); ``peak_gb_per_s`` over sizes."""
    import torch

    rows = []
    for mib in _QUICK_SIZES_MIB if opts.quick else _SIZES_MIB:
        nbytes = mib << 20
        pairs = [
            (torch.empty(nbytes, dtype=torch.uint8, device="cuda"), torch.ones(nbytes, dtype=torch.uint8, device="cuda"))
            for _ in range(rotation_count(2 * nbytes))
        ]
        t = time_cuda(lambda p: p[0].copy_(p[1]), pairs, warmup=5, runs=20 if opts.quick else 100)
        rows.append({
            "bytes": nbytes,
            "rotation": len(pairs),
            "gb_per_s": round(2 * nbytes / (t.median_us * 1e-6) / 1e9, 1),
            "timing": t.to_dict(),
        })
        del pairs
    return {"method": "torch copy_ of uint8 buffers, (read + write) bytes / median time", "sizes": rows,
            "peak_gb_per_s": max(r["gb_per_s"] for r in rows)}


register_section("copy", run, "device copy bandwidth (ceiling for memory-bound kernels)")
