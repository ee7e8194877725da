"""The names a user picks from: tile presets, quantizers, head dims, Sinkhorn iteration bounds.

Plain Python (no torch), so that the command line can offer them as ``choices`` and print ``--help``
without importing torch; :mod:`kvarn_cutlass.format` re-exports them beside the tile layout.
"""

from __future__ import annotations

PRESETS: dict[str, tuple[int, int, int]] = {
    # name: (k_bits, v_bits, tile_tokens)
    "k4v2_g128": (4, 2, 128),
    "k4v4_g128": (4, 4, 128),
    "k4v2_g64": (4, 2, 64),
    "k4v4_g64": (4, 4, 64),
}
DEFAULT_PRESET = "k4v2_g128"
HEAD_DIMS = (64, 128, 256)
QUANTIZERS = ("uniform", "lloyd_max")
DEFAULT_QUANTIZER = "uniform"
# 2: measured on the H200 at 0.76x the compression time of 4 with perplexity within -0.25..+0.13 points
# of it on every row of docs/accuracy.md's iteration study (docs/perf-notes.md, ninth session).
DEFAULT_SINKHORN_ITERS = 2
# Past ~8 iterations the normalization factors no longer change in float32 (realistic tiles,
# 64 x 128 x 128); the bound keeps a typo such as 10**6 from becoming a hang in the codec.
MAX_SINKHORN_ITERS = 64
