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

    K[t, c] = row_scale[t] * (chan_min[c] + chan_step[c] * k_code[c, t])
    V[t, c] = col_scale[c] * (tok_min[t] + tok_step[t] * v_code[t, c])

Scales are little-endian float16 (default) or float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

PRESETS: dict[str, tuple[int, int, int]] = {
    # name: (k_bits, v_bits, tile_tokens)
    "k4v2_g128": (4, 2, 128),
    "k4v4_g128": (4, 4, 128),
    "k4v2_g64": (4, 2, 64),
    "k4v4_g64": (4, 4, 64),
}
DEFAULT_PRESET = "k4v2_g128"
HEAD_DIMS = (64, 128, 256)
SCALE_DTYPES = (torch.float16, torch.float32)
DEFAULT_SINKHORN_ITERS = 4
RECORD_ALIGN = 16


def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; choose one of {list(allowed)}")


@dataclass(frozen=True)
class TileSpec:
    """Everything that fixes the bytes of a tile record.

    Args:
        preset: one of ``PRESETS`` (``k4v2_g128`` default): K bits, V bits and tokens per tile.
        head_dim: D, one of 64, 128, 256.
        scale_dtype: ``torch.float16`` (default) or ``torch.float32`` for the step/min/scale vectors.
        sinkhorn_iters: variance-normalization iterations (>= 0, default 4).
    """

    preset: str = DEFAULT_PRESET
    head_dim: int = 128
    scale_dtype: torch.dtype = torch.float16
    sinkhorn_iters: int = DEFAULT_SINKHORN_ITERS
    _offsets: dict = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        _check_choice("preset", self.preset, PRESETS)
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int):
            raise TypeError(f"head_dim must be an int, got {type(self.head_dim).__name__}")
        _check_choice("head_dim", self.head_dim, HEAD_DIMS)
        _check_choice("scale_dtype", self.scale_dtype, SCALE_DTYPES)
        if isinstance(self.sinkhorn_iters, bool) or not isinstance(self.sinkhorn_iters, int) or self.sinkhorn_iters < 0:
            raise ValueError(f"sinkhorn_iters must be a non-negative int, got {self.sinkhorn_iters!r}")
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
            "tile_nbytes": self.tile_nbytes,
            "bytes_per_token": self.bytes_per_token,
            "compression_vs_fp16": round(self.compression_vs_fp16, 3),
            "sections": {n: {"offset": o, "nbytes": s} for n, (o, s) in self._offsets.items() if n != "_total"},
        }
