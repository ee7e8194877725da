"""Teacher-forced simulation of decode-time KVarN attention, in one pass per layer.

At decode time, the query at position p runs when the cache holds p+1 tokens; of those, the tiles
already compressed are ``c(p+1)`` with

* ``c(n) = max(0, ceil((n - sink - window) / T))`` for a window (the library's rule), and
* ``c(n) = max(0, floor((n - sink) / T))`` for ``window=0`` ("no window": every complete tile is
  quantized; not a configuration the library cache accepts, simulation only).

So key j is read quantized by query p iff j lies in tile i (``j in [sink + i*T, sink + (i+1)*T)``)
with ``i < c(p+1)``, and exactly (rounded to the cache dtype, as the window stores it) otherwise.
That is ``view="decode"`` (the default). ``view="prefill"`` instead gives every query the cache as
it is after the whole sequence was appended (``c(N)`` tiles for every query, causal): the
library's semantics for a one-chunk prefill, and the classic "quantize the whole KV cache"
evaluation (with ``window=0``: every complete tile quantized for every query, the query's own
recent tokens included).
Tile contents do not depend on when a tile is compressed, so :func:`simulated_attention` encodes
every tile that is ever compressed once with :func:`kvarn_cutlass.encode_tiles` (from the K/V in the
cache dtype, as the cache does), decodes it, and picks exact or quantized keys/values per
(query, key) pair with masks. ``tests/test_hf_simulate.py`` checks this against token-by-token decode
through :class:`kvarn_cutlass.KVarNCache` and :func:`kvarn_cutlass.reference.attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..codec import decode_tiles, encode_tiles
from ..format import DEFAULT_QUANTIZER, DEFAULT_SINKHORN_ITERS, PRESETS, QUANTIZERS, TileSpec

VIEWS = ("decode", "prefill")


@dataclass(frozen=True)
class SimSpec:
    """What the simulated cache does.

    preset: tile preset, or None for an unquantized cache (every key exact, in ``dtype``).
    window: fp16 window in tokens (a multiple of the tile size), or 0 for no window.
    sink_tokens: leading tokens never quantized (0 or a multiple of the tile size).
    dtype: the cache dtype (float16/bfloat16): exact keys/values and codec input are rounded to it.
    compute_dtype: float32 (default, fast) or float64 (for exactness checks).
    view: "decode" (query p sees the cache holding p+1 tokens) or "prefill" (every query sees the
        cache holding the whole sequence); see the module docstring.
    block: query rows per block (bounds memory at O(block * seq_len) per head).
    quantizer: ``uniform`` (default) or ``lloyd_max``: how tile values are coded (``TileSpec``).
    """

    preset: str | None = "k4v2_g128"
    window: int = 256
    sink_tokens: int = 0
    dtype: torch.dtype = torch.float16
    scale_dtype: torch.dtype = torch.float16
    sinkhorn_iters: int = DEFAULT_SINKHORN_ITERS
    compute_dtype: torch.dtype = torch.float32
    view: str = "decode"
    block: int = 512
    quantizer: str = DEFAULT_QUANTIZER

    def __post_init__(self) -> None:
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"preset={self.preset!r} is not supported; choose one of {list(PRESETS)} or None")
        T = self.tile_tokens
        for name, val in (("window", self.window), ("sink_tokens", self.sink_tokens)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 0 or val % T:
                raise ValueError(f"{name} must be 0 or a multiple of the tile size {T}, got {val!r}")
        if self.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"dtype must be float16, bfloat16 or float32, got {self.dtype}")
        if self.compute_dtype not in (torch.float32, torch.float64):
            raise TypeError(f"compute_dtype must be float32 or float64, got {self.compute_dtype}")
        if self.view not in VIEWS:
            raise ValueError(f"view must be one of {VIEWS}, got {self.view!r}")
        if not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"block must be a positive int, got {self.block!r}")
        if self.quantizer not in QUANTIZERS:
            raise ValueError(f"quantizer={self.quantizer!r} is not supported; choose one of {list(QUANTIZERS)}")

    @property
    def tile_tokens(self) -> int:
        return PRESETS[self.preset][2] if self.preset is not None else 1

    def tile_spec(self, head_dim: int) -> TileSpec:
        return TileSpec(self.preset, head_dim, self.scale_dtype, self.sinkhorn_iters, self.quantizer)

    def describe(self) -> str:
        if self.preset is None:
            return "unquantized"
        view = "" if self.view == "decode" else f" view={self.view}"
        quantizer = "" if self.quantizer == DEFAULT_QUANTIZER else f" quantizer={self.quantizer}"
        return f"{self.preset}{quantizer} window={self.window or 'none'} sink={self.sink_tokens}{view}"


def quantized_tiles(n_tokens: torch.Tensor | int, spec: SimSpec) -> torch.Tensor | int:
    """Tiles compressed once the cache holds ``n_tokens`` tokens (elementwise for tensors)."""
    if spec.preset is None:
        return n_tokens * 0
    T, S, W = spec.tile_tokens, spec.sink_tokens, spec.window
    if W > 0:
        c = (n_tokens - S - W + T - 1) // T  # ceil for integers, also below zero
    else:
        c = (n_tokens - S) // T
    return c.clamp(min=0) if isinstance(c, torch.Tensor) else max(0, c)


def quantized_key_mask(n: int, spec: SimSpec, device=None) -> torch.Tensor:
    """bool [n, n]: entry (p, j) is True iff query p reads key j from a compressed tile."""
    pos = torch.arange(n, device=device)
    c = quantized_tiles(pos + 1 if spec.view == "decode" else torch.full_like(pos, n), spec)
    j = pos - spec.sink_tokens
    tile = torch.where(j >= 0, j // spec.tile_tokens, torch.full_like(j, -1))
    return (tile[None, :] >= 0) & (tile[None, :] < c[:, None])


def simulated_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: SimSpec, scale: float | None = None
) -> torch.Tensor:
    """Decode-time attention for every query of a full sequence, in one pass.

    q: [B, Hq, N, D]; k, v: [B, Hkv, N, D] (post-RoPE, positions 0..N-1, Hq a multiple of Hkv).
    Returns [B, Hq, N, D] in ``spec.compute_dtype``: row p equals attention of query p over a
    KVarN cache holding tokens 0..p (see the module docstring).
    """
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"need q [B, Hq, N, D] and k, v [B, Hkv, N, D], got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    B, Hq, N, D = q.shape
    Hkv = k.shape[1]
    if Hq % Hkv:
        raise ValueError(f"num_q_heads={Hq} must be a multiple of num_kv_heads={Hkv}")
    g, cd = Hq // Hkv, spec.compute_dtype
    scale = D**-0.5 if scale is None else float(scale)
    kx, vx = k.to(spec.dtype), v.to(spec.dtype)
    ke, ve = kx.to(cd), vx.to(cd)

    S = spec.sink_tokens
    nt = quantized_tiles(N, spec)
    if nt:
        T = spec.tile_tokens
        ts = spec.tile_spec(D)
        tiles = lambda x: x[:, :, S : S + nt * T].reshape(B, Hkv, nt, T, D)  # noqa: E731
        rec = encode_tiles(tiles(kx), tiles(vx), ts)
        kq, vq = decode_tiles(rec, ts, dtype=cd)
        kq = kq.reshape(B, Hkv, nt * T, D).to(q.device)
        vq = vq.reshape(B, Hkv, nt * T, D).to(q.device)
        qmask_all = quantized_key_mask(N, spec, q.device)[:, S : S + nt * T]  # [N, nt*T]

    if not nt:  # nothing quantized: plain causal attention over the cache-dtype keys/values
        return torch.nn.functional.scaled_dot_product_attention(
            q.to(cd), ke.repeat_interleave(g, 1), ve.repeat_interleave(g, 1), is_causal=True, scale=scale
        )
    qg = q.to(cd).reshape(B, Hkv, g, N, D)
    pos = torch.arange(N, device=q.device)
    out = torch.empty(B, Hkv, g, N, D, dtype=cd, device=q.device)
    for q0 in range(0, N, spec.block):
        q1 = min(N, q0 + spec.block)
        L = q1  # causal: this block sees keys [0, q1)
        qb = qg[:, :, :, q0:q1]
        s = torch.einsum("bhgqd,bhkd->bhgqk", qb, ke[:, :, :L]) * scale
        R = max(0, min(S + nt * T, L) - S) if nt else 0
        qm = qmask_all[q0:q1, :R] if R else None
        use_q = qm is not None and bool(qm.any())
        if use_q:
            sq = torch.einsum("bhgqd,bhkd->bhgqk", qb, kq[:, :, :R]) * scale
            s[..., S : S + R] = torch.where(qm, sq, s[..., S : S + R])
        s.masked_fill_(pos[None, :L] > pos[q0:q1, None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        if use_q:
            pq = p[..., S : S + R] * qm
            p[..., S : S + R] = p[..., S : S + R].masked_fill(qm, 0.0)
            o = torch.einsum("bhgqk,bhkd->bhgqd", p, ve[:, :, :L]) + torch.einsum("bhgqk,bhkd->bhgqd", pq, vq[:, :, :R])
        else:
            o = torch.einsum("bhgqk,bhkd->bhgqd", p, ve[:, :, :L])
        out[:, :, :, q0:q1] = o
    return out.reshape(B, Hq, N, D)
