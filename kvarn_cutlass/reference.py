"""Float64 reference attention over a KVarNCache, the oracle every GPU kernel is checked against.

Semantics (shared by ``prefill_attention`` and ``decode_attention``), in two forms:

* ``attention(q, cache, layer)`` (decode): the n_q queries are the newest n_q tokens of the layer;
  query i sits at position ``seq_len - n_q + i`` and sees every position up to its own (causal). Keys
  and values are what the cache holds now: sink and window tokens exactly, tile tokens as their
  quantized reconstruction.
* ``attention(q, cache, layer, k=k, v=v)`` (chunked prefill): the queries are those of a chunk whose
  keys/values ``k``, ``v`` are *not yet* in the cache. Query i sits at position ``seq_len + i`` and
  sees the cache as it is (tiles quantized, sink and window exact) plus chunk tokens ``j <= i``
  exactly, in the cache dtype. So a chunk never sees its own tokens, or the window tokens that its
  append would compress, in quantized form: the tokens older than the window *before* the chunk are
  the only quantized ones, as in token-by-token decode.

GQA: query head h reads KV head ``h // (num_q_heads // num_kv_heads)``.

Two formulations that must agree to ~1e-9 relative:

* ``dense``: dequantize the tiles to float64 in the original domain, then ordinary attention;
* ``dequant_free``: the form the kernels use. With ``q_rot = WHT(q)``, a tile token's score is
  ``row_scale[t] * (sum_c q_rot[c]*chan_step[c]*kbook[code[c,t]] + sum_c q_rot[c]*chan_min[c])``
  (``kbook``/``vbook``: the codebook of the spec's quantizer, the identity for ``uniform``); the tile
  part of the output is aggregated in the rotated domain from the V codes, with tok_step and
  tok_min folded into the probabilities, and one inverse WHT is applied at the end.
"""

from __future__ import annotations

import torch

from . import codec
from ._validate import check_query as _check_query, resolve_scale
from .cache import KVarNCache

FORMULATIONS = ("dequant_free", "dense")


def check_query(q, cache: KVarNCache, layer: int, name: str = "q", chunk: int | None = None,
                dtypes: tuple[torch.dtype, ...] | None = None) -> None:
    """Validate q [batch, num_q_heads, n_q, head_dim] against ``cache``'s layer
    (:func:`kvarn_cutlass._validate.check_query`).

    ``chunk``: the number of chunk tokens passed beside the cache (prefill form): then n_q must equal
    it; otherwise 1 <= n_q <= seq_len(layer). ``dtypes``: the accepted dtypes (None: any floating).
    """
    if not isinstance(cache, KVarNCache):
        raise TypeError(f"cache must be a KVarNCache, got {type(cache).__name__}")
    if chunk is None:
        held = cache.seq_len(layer)
        n_q, why = (1, held), f"layer {layer} holds {held} tokens"
    else:
        n_q, why = chunk, f"a chunk of {chunk} tokens (k, v)"
    _check_query(q, batch=cache.batch_size, num_kv_heads=cache.num_kv_heads, head_dim=cache.head_dim, n_q=n_q,
                 dtypes=dtypes, n_q_why=why, name=name)


def _expand_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """[B, H, ...] -> [B, H*group, ...], KV head h repeated for its q heads."""
    return x.repeat_interleave(group, dim=1)


def chunk_kv(cache: KVarNCache, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a chunk's k, v [batch, num_kv_heads, n, head_dim] for ``cache`` (as ``append`` would) and
    return them in the cache dtype: the exact values the chunk's own queries attend to."""
    if not isinstance(cache, KVarNCache):
        raise TypeError(f"cache must be a KVarNCache, got {type(cache).__name__}")
    cache.check_kv("k", k)
    cache.check_kv("v", v)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}")
    return k.to(cache.dtype), v.to(cache.dtype)


def attention(
    q: torch.Tensor,
    cache: KVarNCache,
    layer: int,
    scale: float | None = None,
    formulation: str = "dequant_free",
    *,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float64 attention of q [batch, num_q_heads, n_q, head_dim] over ``layer`` of ``cache``.

    Without ``k``/``v``: the queries are the newest n_q tokens of the layer (decode form). With them
    (k, v [batch, num_kv_heads, n_q, head_dim], the chunk's tokens, not yet appended): the prefill
    form of the module docstring; the cache is not changed.

    Returns float64 [batch, num_q_heads, n_q, head_dim] on the cache's device. ``scale`` defaults to
    1/sqrt(head_dim).
    """
    if (k is None) != (v is None):
        raise ValueError("pass both k and v (the chunk's keys and values) or neither")
    if k is not None:
        k, v = chunk_kv(cache, k, v)
    check_query(q, cache, layer, chunk=None if k is None else k.shape[2])
    if formulation not in FORMULATIONS:
        raise ValueError(f"formulation must be one of {FORMULATIONS}, got {formulation!r}")
    spec, dev, f64 = cache.spec, cache.device, torch.float64
    B, Hq, n_q, D = q.shape
    group = Hq // cache.num_kv_heads
    scale = resolve_scale(scale, D)
    L = cache.seq_len(layer)
    pos = cache.positions(layer)
    q64 = q.to(dev, f64)
    q_pos = torch.arange(L - n_q, L, device=dev) if k is None else torch.arange(L, L + n_q, device=dev)

    sink_k, sink_v = cache.sink_kv(layer)
    win_k, win_v = cache.window_kv(layer)
    parts_k, parts_v = [sink_k, win_k], [sink_v, win_v]
    parts_pos = [torch.arange(*pos["sink"], device=dev), torch.arange(*pos["window"], device=dev)]
    if k is not None:
        parts_k.append(k)
        parts_v.append(v)
        parts_pos.append(torch.arange(L, L + n_q, device=dev))
    exact_k = _expand_heads(torch.cat(parts_k, 2).to(f64), group)  # [B, Hq, Ne, D]
    exact_v = _expand_heads(torch.cat(parts_v, 2).to(f64), group)
    exact_pos = torch.cat(parts_pos)
    rec = cache.tile_bytes(layer)  # [B, nt, H, nbytes]
    nt, T = rec.shape[1], spec.tile_tokens
    tile_pos = torch.arange(*pos["tiles"], device=dev)

    s_exact = torch.einsum("bhqd,bhkd->bhqk", q64, exact_k) * scale
    if formulation == "dense":
        k_t, v_t = codec.decode_tiles(rec, spec, f64)  # [B, nt, H, T, D]
        k_t = _expand_heads(k_t.permute(0, 2, 1, 3, 4).reshape(B, -1, nt * T, D), group)
        v_t = _expand_heads(v_t.permute(0, 2, 1, 3, 4).reshape(B, -1, nt * T, D), group)
        s_tile = torch.einsum("bhqd,bhkd->bhqk", q64, k_t) * scale
    else:
        f = codec.unpack_fields(rec, spec)
        tofh = lambda x: _expand_heads(x.to(f64).transpose(1, 2), group)  # [B, nt, H, ...] -> [B, Hq, nt, ...]  # noqa: E731
        q_rot = codec.wht(q64)
        codes = tofh(f.k_values)  # [B, Hq, nt, D, T], the codebook value of each code
        qfold = torch.einsum("bhqd,bhnd->bhqnd", q_rot, tofh(f.chan_step))
        bias = torch.einsum("bhqd,bhnd->bhqn", q_rot, tofh(f.chan_min))
        dot = torch.einsum("bhqnd,bhndt->bhqnt", qfold, codes)
        s_tile = (tofh(f.row_scale)[:, :, None] * (dot + bias[..., None]) * scale).reshape(B, Hq, n_q, nt * T)

    scores = torch.cat((s_exact, s_tile), -1)
    key_pos = torch.cat((exact_pos, tile_pos))
    scores = scores.masked_fill(key_pos[None, None, None, :] > q_pos[None, None, :, None], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    p_exact, p_tile = p[..., : exact_pos.numel()], p[..., exact_pos.numel() :]
    out = torch.einsum("bhqk,bhkd->bhqd", p_exact, exact_v)
    if nt == 0:
        return out
    if formulation == "dense":
        return out + torch.einsum("bhqk,bhkd->bhqd", p_tile, v_t)
    p_tile = p_tile.reshape(B, Hq, n_q, nt, T)
    p_step = p_tile * tofh(f.tok_step)[:, :, None]  # tok_step folded into the probabilities
    p_min = (p_tile * tofh(f.tok_min)[:, :, None]).sum(-1)  # [B, Hq, n_q, nt]
    out_rot = torch.einsum("bhqnt,bhntd->bhqnd", p_step, tofh(f.v_values)) + p_min[..., None]
    out_rot = (out_rot * tofh(f.col_scale)[:, :, None]).sum(3)  # [B, Hq, n_q, D]
    return out + codec.wht(out_rot)  # the deferred inverse WHT (the WHT is its own inverse)
