"""The one place where the transformers integration chooses how attention over a KVarNCache is computed.

``attend(q, k, v, cache, layer, scale)`` computes attention of a forward pass's ``n_q`` new queries
over ``layer`` of a :class:`kvarn_cutlass.KVarNCache` plus the new tokens' k, v (not yet in the
cache), appends k, v, and returns the attention in ``q.dtype``, shape [batch, num_q_heads, n_q,
head_dim]. Semantics:

* several new tokens (a prefill chunk): :func:`kvarn_cutlass.reference.attention` with ``k=``, ``v=``
  (the cache's tiles quantized, everything newer, the chunk included, exact; causal), then the append;
* one new token (a decode step): the append first, then the decode form of the reference (the
  token sees the cache after its own append), exactly what the decode kernel computes.

Backends:

* CPU: :func:`kvarn_cutlass.reference.attention` (float64), cast to ``q.dtype`` (default), or with
  ``cpu_attention="dequant"`` the :class:`DequantizedTiles` path: every tile is decoded once (to
  float32) when it is compressed and attention runs as float32 SDPA over [sink | tiles | window
  (| chunk)]; equal to the reference up to float32 rounding and orders of magnitude faster for long
  CPU generation (the reference re-reads every tile in float64 at every step).
* CUDA: the GPU kernels, imported lazily: ``kvarn_cutlass.decode.decode_attention`` for one query
  per sequence, ``kvarn_cutlass.prefill.prefill_attention`` (the fused kernel, which also appends)
  for several; float32 queries are passed in the cache dtype (the kernels take float16/bfloat16).
  While they are not importable, CUDA raises NotImplementedError (never a silent fallback to a
  different numerical path).
"""

from __future__ import annotations

import importlib

import torch

from .. import reference
from .._validate import resolve_scale
from ..cache import KVarNCache as _LibCache
from ..codec import decode_tiles

_GPU_ENTRY_POINTS = {
    "decode": ("kvarn_cutlass.decode", "decode_attention"),
    "prefill": ("kvarn_cutlass.prefill", "prefill_attention"),
}


def gpu_entry_point(kind: str):
    """The GPU attention function for ``kind`` ('decode' or 'prefill'), imported lazily.

    Raises NotImplementedError, naming the missing module, when it cannot be imported.
    """
    module_name, fn_name = _GPU_ENTRY_POINTS[kind]
    try:
        module = importlib.import_module(module_name)
        return getattr(module, fn_name)
    except (ImportError, AttributeError) as exc:
        raise NotImplementedError(
            f"KVarN attention on CUDA needs {module_name}.{fn_name}, which is not available yet ({exc}); "
            "use device='cpu' (reference path) meanwhile"
        ) from exc


class DequantizedTiles:
    """Per-layer float32 copies of a cache's decoded tiles, extended as tiles are compressed."""

    def __init__(self) -> None:
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}

    def get(self, cache: _LibCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [batch, num_kv_heads, n_tiles * T, head_dim] float32 of ``layer``'s tiles."""
        B, H, D, T = cache.batch_size, cache.num_kv_heads, cache.head_dim, cache.spec.tile_tokens
        k = self._k.get(layer, torch.zeros(B, H, 0, D, device=cache.device))
        v = self._v.get(layer, torch.zeros(B, H, 0, D, device=cache.device))
        have, nt = k.shape[2] // T, cache.num_tiles(layer)
        if nt < have:  # the cache was reset or rebuilt
            k, v, have = k[:, :, :0], v[:, :, :0], 0
        if nt > have:
            kt, vt = decode_tiles(cache.tile_bytes(layer)[:, have:nt], cache.spec)  # [B, n, H, T, D]
            flat = lambda x: x.permute(0, 2, 1, 3, 4).reshape(B, H, (nt - have) * T, D).to(cache.device)  # noqa: E731
            k, v = torch.cat((k, flat(kt)), 2), torch.cat((v, flat(vt)), 2)
        self._k[layer], self._v[layer] = k, v
        return k, v

    def attention(self, q: torch.Tensor, cache: _LibCache, layer: int, scale: float | None = None,
                  k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
        """Same semantics as reference.attention (with the chunk k, v when given), in float32; returns q.dtype."""
        if k is not None:
            k, v = reference.chunk_kv(cache, k, v)
        reference.check_query(q, cache, layer, chunk=None if k is None else k.shape[2])
        scale = resolve_scale(scale, q.shape[-1])
        kt, vt = self.get(cache, layer)
        sk, sv = cache.sink_kv(layer)
        wk, wv = cache.window_kv(layer)
        g = q.shape[1] // cache.num_kv_heads
        ks, vs = [sk.float(), kt, wk.float()], [sv.float(), vt, wv.float()]  # keys in position order
        if k is not None:
            ks.append(k.float())
            vs.append(v.float())
        k_all = torch.cat(ks, 2).repeat_interleave(g, 1)
        v_all = torch.cat(vs, 2).repeat_interleave(g, 1)
        L, n_q = k_all.shape[2], q.shape[2]
        q_pos = torch.arange(L - n_q, L, device=q.device)
        mask = torch.arange(L, device=q.device)[None, :] <= q_pos[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(q.float(), k_all, v_all, attn_mask=mask, scale=scale)
        return out.to(q.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: _LibCache, layer: int,
           scale: float | None = None, dequantized: DequantizedTiles | None = None) -> torch.Tensor:
    """Attention of q [batch, num_q_heads, n_q, head_dim] over ``layer`` of ``cache`` and the new tokens
    k, v [batch, num_kv_heads, n_q, head_dim], which are then appended; returns q.dtype.

    ``dequantized``: on CPU, use this :class:`DequantizedTiles` instead of the float64 reference.
    """
    scale = resolve_scale(scale, q.shape[-1])  # before the decode step's append: a bad scale changes nothing
    device = cache.device
    decode_step = q.shape[2] == 1
    if device.type == "cpu":
        if decode_step:
            cache.append(layer, k, v)
            kw = {}
        else:
            kw = {"k": k, "v": v}
        if dequantized is not None:
            out = dequantized.attention(q, cache, layer, scale, **kw)
        else:
            out = reference.attention(q, cache, layer, scale=scale, **kw).to(q.dtype)
        if not decode_step:
            cache.append(layer, k, v)
        return out
    if device.type == "cuda":
        # the kernels take float16/bfloat16 queries: a float32 model's queries go in the cache dtype
        qk = q if q.dtype in (torch.float16, torch.bfloat16) else q.to(cache.dtype)
        if decode_step:
            cache.append(layer, k, v)
            out = gpu_entry_point("decode")(qk, cache, layer, scale=scale)
        else:
            out = gpu_entry_point("prefill")(qk, k, v, cache, layer, scale=scale)  # appends k, v
        return out.to(q.dtype)
    raise NotImplementedError(f"KVarN attention has no implementation for device {device}")
