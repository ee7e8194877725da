"""KVarN tile format: presets, sizes and the byte layout of one tile record.

This module is the only place that knows where each field of a record lives. One record holds one
tile of ``tile_tokens`` (T) tokens of one KV head with head_dim D. Sections, in this order, each
starting at a 16-byte aligned offset (every section size is a multiple of 16 for the supported
T and D, so no padding is needed):

====================  =====================================  =======================================
section               shape / dtype                           layout
====================  =====================================  =======================================
``k_codes``           D * T / 2 bytes                         channel-major 4-bit K codes: channel c
                                                              occupies bytes [c*T/2, (c+1)*T/2); token
                                                              2j in the low nibble, 2j+1 in the high
``chan_step``         [D] scale_dtype                         K step per channel (rotated domain)
``chan_min``          [D] scale_dtype                         K minimum per channel
``row_scale``         [T] scale_dtype                         K factor per token
``v_codes``           T * D * v_bits / 8 bytes                token-major V codes: token t occupies
                                                              bytes [t*D*v_bits/8, ...); codes packed
                                                              lowest bits first
``tok_step``          [T] scale_dtype                         V step per token
``tok_min``           [T] scale_dtype                         V minimum per token
``col_scale``         [D] scale_dtype                         V factor per channel
====================  =====================================  =======================================

In the rotated (Walsh-Hadamard) domain::

    K[t, c] = row_scale[t] * (chan_min[c] + chan_step[c] * kbook[k_code[c, t]])
    V[t, c] = col_scale[c] * (tok_min[t] + tok_step[t] * vbook[v_code[t, c]])

with ``kbook = codebook(quantizer, k_bits)`` and ``vbook = codebook(quantizer, v_bits)``. Scales are
little-endian float16 (default) or float32.

Quantizers (``QUANTIZERS``; the record layout and sizes are the same for both):

* ``uniform`` (default): asymmetric round-to-nearest; the codebook is the identity (code c has the
  value c), ``*_min`` is the axis minimum and ``*_step`` the spacing of the 2^bits levels.
* ``lloyd_max``: the code indexes the Lloyd-Max centroids of the unit Gaussian N(0, 1) for 2^bits
  levels; ``*_min`` holds the axis mean and ``*_step`` the axis RMS about that mean (the values are
  normalized to unit variance before the nearest-centroid decision, see ``kvarn_cutlass.codec``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import torch

from .presets import (DEFAULT_PRESET, DEFAULT_QUANTIZER, DEFAULT_SINKHORN_ITERS, HEAD_DIMS, MAX_SINKHORN_ITERS, PRESETS,
                      QUANTIZERS)

SCALE_DTYPES = (torch.float16, torch.float32)
RECORD_ALIGN = 16
CODE_BITS = (2, 4)  # the code widths of the presets

# Lloyd-Max centroids of N(0, 1), ascending, for 4 and 16 levels: the fixed point of the Lloyd
# iteration (thresholds at centroid midpoints, centroids at the conditional means of the Gaussian
# between thresholds) computed in float64 with exact Gaussian integrals (erf/erfc), then rounded to
# float16 (at most 3.2e-4 relative from the fixed point; the MSE on N(0, 1) changes by < 1e-7).
# float16 because the GPU kernels multiply code values in f16 tensor-core MMAs: an f16-exact
# codebook makes those operands exact, as the uniform quantizer's integer codes are (an f32
# codebook rounded to f16 inside the kernel put up to 2.5e-3 relative error into decode outputs
# with peaked attention, logits ~100). The literals are those values written exactly
# (tests/test_format.py recomputes them). The codebooks are symmetric: only the positive half is written.
_LLOYD_MAX_POSITIVE = {
    2: (0.452880859375, 1.5107421875),
    4: (
        0.12841796875, 0.387939453125, 0.65673828125, 0.9423828125,
        1.255859375, 1.6181640625, 2.068359375, 2.732421875,
    ),
}


def _f32(x: float) -> float:
    """x rounded to the nearest float32 (ties to even), as a Python float."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def codebook(quantizer: str, bits: int) -> tuple[float, ...]:
    """The value of each code, ascending: a tuple of 2^bits floats, each exactly a float16.

    ``uniform``: ``(0.0, 1.0, ..., 2^bits - 1)`` (the value of a code is the code). ``lloyd_max``:
    the Lloyd-Max centroids of N(0, 1) for 2^bits levels (bits 2 or 4), rounded to float16.
    """
    _check_choice("quantizer", quantizer, QUANTIZERS)
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"bits must be an int, got {type(bits).__name__}")
    _check_choice("bits", bits, CODE_BITS)
    if quantizer == "uniform":
        return tuple(float(c) for c in range(2**bits))
    half = _LLOYD_MAX_POSITIVE[bits]
    return tuple(-c for c in reversed(half)) + half


def lloyd_max_thresholds(bits: int) -> tuple[float, ...]:
    """The 2^bits - 1 ascending decision thresholds of the ``lloyd_max`` codebook for ``bits``.

    ``t_j = float32((c_j + c_{j+1}) / 2)`` with the centroids ``c = codebook("lloyd_max", bits)``
    (float16-rounded, so exactly representable in float32 too): the sum and the halving are exact in
    float64, then one rounding to float32. A value z
    gets the code ``#{j : z > t_j}`` (ties go to the lower code).
    """
    c = codebook("lloyd_max", bits)
    return tuple(_f32((a + b) / 2) for a, b in zip(c[:-1], c[1:]))


def _check_choice(name: str, value, allowed) -> None:
    # Compared one by one with values of the allowed type rather than by ``in``: an unhashable value
    # (a list) would raise "unhashable type" against a dict and an array would compare elementwise.
    if not any(isinstance(value, type(a)) and value == a for a in allowed):
        raise ValueError(f"{name}={value!r} is not supported; choose one of {list(allowed)}")


@dataclass(frozen=True)
class TileSpec:
    """Everything that fixes the bytes of a tile record.

    Args:
        preset: one of ``PRESETS`` (``k4v2_g128`` default): K bits, V bits and tokens per tile.
        head_dim: D, one of 64, 128, 256.
        scale_dtype: ``torch.float16`` (default) or ``torch.float32`` for the step/min/scale vectors.
        sinkhorn_iters: variance-normalization iterations, 0 to ``MAX_SINKHORN_ITERS`` (64), default 2.
        quantizer: one of ``QUANTIZERS``: ``uniform`` (default) or ``lloyd_max``; what the codes and
            the step/min fields mean (the layout is the same).
    """

    preset: str = DEFAULT_PRESET
    head_dim: int = 128
    scale_dtype: torch.dtype = torch.float16
    sinkhorn_iters: int = DEFAULT_SINKHORN_ITERS
    quantizer: str = DEFAULT_QUANTIZER
    _offsets: dict = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        _check_choice("preset", self.preset, PRESETS)
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int):
            raise TypeError(f"head_dim must be an int, got {type(self.head_dim).__name__}")
        _check_choice("head_dim", self.head_dim, HEAD_DIMS)
        _check_choice("scale_dtype", self.scale_dtype, SCALE_DTYPES)
        iters = self.sinkhorn_iters
        if isinstance(iters, bool) or not isinstance(iters, int) or not 0 <= iters <= MAX_SINKHORN_ITERS:
            raise ValueError(f"sinkhorn_iters must be an int in [0, {MAX_SINKHORN_ITERS}], got {iters!r}")
        _check_choice("quantizer", self.quantizer, QUANTIZERS)
        T, D, sb = self.tile_tokens, self.head_dim, self.scale_bytes
        sizes = [
            ("k_codes", D * T * self.k_bits // 8),
            ("chan_step", D * sb),
            ("chan_min", D * sb),
            ("row_scale", T * sb),
            ("v_codes", T * D * self.v_bits // 8),
            ("tok_step", T * sb),
            ("tok_min", T * sb),
            ("col_scale", D * sb),
        ]
        offsets, pos = {}, 0
        for name, size in sizes:
            assert pos % RECORD_ALIGN == 0, "every section size is a multiple of 16 for supported shapes"
            offsets[name] = (pos, size)
            pos += size
        offsets["_total"] = (0, pos)
        object.__setattr__(self, "_offsets", offsets)

    # --- preset fields -------------------------------------------------------------------------
    @property
    def k_bits(self) -> int:
        return PRESETS[self.preset][0]

    @property
    def v_bits(self) -> int:
        return PRESETS[self.preset][1]

    @property
    def tile_tokens(self) -> int:
        """T, tokens per tile (128 or 64)."""
        return PRESETS[self.preset][2]

    @property
    def k_codebook(self) -> tuple[float, ...]:
        """``codebook(quantizer, k_bits)``: the value of each K code."""
        return codebook(self.quantizer, self.k_bits)

    @property
    def v_codebook(self) -> tuple[float, ...]:
        """``codebook(quantizer, v_bits)``: the value of each V code."""
        return codebook(self.quantizer, self.v_bits)

    @property
    def scale_bytes(self) -> int:
        return 2 if self.scale_dtype == torch.float16 else 4

    # --- sizes ---------------------------------------------------------------------------------
    @property
    def tile_nbytes(self) -> int:
        """Bytes of one record (one tile of one KV head); a multiple of 16."""
        return self._offsets["_total"][1]

    @property
    def bytes_per_token(self) -> float:
        """Bytes per token per KV head for K and V together (fp16 K+V needs 4 * head_dim)."""
        return self.tile_nbytes / self.tile_tokens

    @property
    def compression_vs_fp16(self) -> float:
        return 4 * self.head_dim / self.bytes_per_token

    # --- layout --------------------------------------------------------------------------------
    def section(self, name: str) -> tuple[int, int]:
        """``(offset, nbytes)`` of a section; names as in the module docstring."""
        if name not in self._offsets or name == "_total":
            raise KeyError(f"unknown section {name!r}; sections: {self.section_names()}")
        return self._offsets[name]

    def section_names(self) -> list[str]:
        return [n for n in self._offsets if n != "_total"]

    def offset(self, name: str) -> int:
        return self.section(name)[0]

    def describe(self) -> dict:
        """A JSON-serializable summary (used by the CLI and the docs)."""
        return {
            "preset": self.preset,
            "head_dim": self.head_dim,
            "tile_tokens": self.tile_tokens,
            "k_bits": self.k_bits,
            "v_bits": self.v_bits,
            "scale_dtype": str(self.scale_dtype).replace("torch.", ""),
            "quantizer": self.quantizer,
            "tile_nbytes": self.tile_nbytes,
            "bytes_per_token": self.bytes_per_token,
            "compression_vs_fp16": round(self.compression_vs_fp16, 3),
            "sections": {n: {"offset": o, "nbytes": s} for n, (o, s) in self._offsets.items() if n != "_total"},
        }
