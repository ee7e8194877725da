"""SnapKV compaction of a KVarN cache: keep the compressed tokens the last queries attend to most.

SnapKV (Li et al., 2024) shrinks a prompt's KV cache after prefill: the queries of the last ``obs``
prompt tokens (the observation window) vote for the context tokens they attend to; the votes are
pooled along the tokens (so that a kept token brings its neighbours) and each KV head keeps its
top tokens. Composed with KVarN, per layer:

1. Candidates are the tile tokens (the compressed range). The sink and the fp16 window are always
   kept whole.
2. Score: attention of the observation queries over the layer as the cache holds it (sink and
   window exact, tile tokens dequantized), softmax over the whole layer with the causal mask,
   in ``score_dtype``; the probabilities of each tile token are summed over the ``obs`` queries
   and over the q heads of its KV group: [batch, num_kv_heads, n_tile_tokens].
3. Pool along the tile tokens: 1-D max or average pool, stride 1, odd ``kernel_size`` centred on
   the token (SnapKV's pooling; the average divides by ``kernel_size`` at the ends too, as torch's
   ``avg_pool1d`` with zero padding that SnapKV uses; max pooling ignores the padding).
4. Each (sequence, KV head) keeps the same number of tile tokens: the ``n_keep`` highest pooled
   scores (ties go to the earlier token), in their original order.
5. Re-assembly into whole tiles: ``n_keep`` is rounded *down* to a multiple of the tile size, so
   the layer afterwards holds ``sink + n_keep + window_len <= keep`` tokens (more only when the
   sink and window alone exceed ``keep``), the window is unchanged, and the kept tokens fill
   ``n_keep / T`` new tiles. Their values are decoded from the old tiles in float64, in the
   original (un-rotated) domain, rounded to the cache dtype (saturated at its largest finite
   value) and re-encoded: the layer becomes byte for byte what a fresh cache holds after
   ``append`` of [sink | kept tokens | window] (:meth:`kvarn_cutlass.KVarNCache.replace_layers`).

Positions: the compacted layer is shorter; its tokens keep their order, and attention over it
(``kvarn_cutlass.reference.attention``, the kernels) treats the newest tokens as the queries' own
as before. Keys are stored after RoPE, so kept keys keep their original rotary positions; new
tokens must be given their *absolute* positions (as in SnapKV), which the library cache does not
track: with :class:`kvarn_cutlass.hf.KVarNCache` this function records the dropped tokens per layer
(``layer.evicted``), so ``get_seq_length()`` stays the absolute length, the model's RoPE positions
continue from the original length and the causal mask is offset accordingly.

The observation queries come from the model's prefill: pass ``kvarn_queries=QueryRecorder(obs)``
to the forward of a model loaded with ``attn_implementation="kvarn"`` (it records the post-RoPE
queries the attention function receives, the last ``obs`` per layer, across calls).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from . import codec, reference
from ._validate import check_scale
from .cache import KVarNCache

POOLS = ("avg", "max")
SCORE_DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True)
class Compaction:
    """What :func:`snapkv_compact` did.

    kept: ``{layer: int64 [batch, num_kv_heads, n_keep]}`` for each compacted layer: positions (in
        the layer before compaction, ascending) of the kept tile tokens of each sequence and KV head.
    evicted: ``{layer: tokens dropped}`` for every layer given queries (0 where left alone).
    """

    kept: dict[int, torch.Tensor]
    evicted: dict[int, int]


class QueryRecorder:
    """Collects the last ``obs`` queries of each attention layer during a model's forward passes.

    Pass it as ``kvarn_queries=recorder`` to the forward of a model using the ``kvarn`` attention
    (:mod:`kvarn_cutlass.hf`); each call of the attention function hands it the layer's post-RoPE
    queries [batch, num_q_heads, n, head_dim]. Queries of consecutive calls (prefill chunks) are
    concatenated, so the last ``obs`` are kept even when the last chunk is shorter.
    """

    def __init__(self, obs: int) -> None:
        if isinstance(obs, bool) or not isinstance(obs, int) or obs < 1:
            raise ValueError(f"obs must be a positive int, got {obs!r}")
        self.obs = obs
        self._queries: dict[int, torch.Tensor] = {}

    def record(self, layer: int, query: torch.Tensor) -> None:
        prev = self._queries.get(layer)
        q = query.detach() if prev is None else torch.cat((prev, query.detach()), dim=2)
        self._queries[layer] = q[:, :, -self.obs :].clone()

    def queries(self) -> dict[int, torch.Tensor]:
        """``{layer: [batch, num_q_heads, min(obs, seen), head_dim]}``, in the model's dtype."""
        return dict(self._queries)

    def clear(self) -> None:
        self._queries.clear()


def _resolve(cache):
    """(library cache, transformers cache or None) for either kind of cache."""
    if isinstance(cache, KVarNCache):
        return cache, None
    if hasattr(cache, "library") and hasattr(cache, "layers"):  # kvarn_cutlass.hf.KVarNCache
        if cache.library is None:
            raise ValueError("cache holds no tokens yet (its library cache is created by the first forward)")
        return cache.library, cache
    raise TypeError(f"cache must be a kvarn_cutlass.KVarNCache or kvarn_cutlass.hf.KVarNCache, got {type(cache).__name__}")


def _layer_queries(queries, lib: KVarNCache) -> dict[int, torch.Tensor]:
    if isinstance(queries, QueryRecorder):
        queries = queries.queries()
    if isinstance(queries, Mapping):
        items = dict(queries)
    elif isinstance(queries, Sequence) and not isinstance(queries, (str, bytes)):
        if len(queries) != lib.num_layers:
            raise ValueError(f"queries has {len(queries)} entries for a cache of {lib.num_layers} layers")
        items = dict(enumerate(queries))
    else:
        raise TypeError(f"queries must be a sequence (one tensor per layer), a dict {{layer: tensor}} or a QueryRecorder, "
                        f"got {type(queries).__name__}")
    if not items:
        raise ValueError("queries is empty: no layer to compact")
    for layer, q in items.items():
        lib.seq_len(layer)  # validates the layer index
        reference.check_query(q, lib, layer, name=f"queries[{layer}]")
        if not bool(torch.isfinite(q).all()):
            raise ValueError(f"queries[{layer}] contains NaN or Inf")
    return items


def _check_options(pool, kernel_size, scale, score_dtype) -> None:
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
    if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be a positive odd int (1 = no pooling), got {kernel_size!r}")
    if scale is not None:
        check_scale(scale)
    if score_dtype not in SCORE_DTYPES:
        raise ValueError(f"score_dtype must be one of {list(SCORE_DTYPES)}, got {score_dtype}")


def _tile_tokens(lib: KVarNCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized tile tokens of ``layer``, float64 [batch, num_kv_heads, n_tiles*T, head_dim] (k, v)."""
    B, H, D = lib.batch_size, lib.num_kv_heads, lib.head_dim
    k, v = codec.decode_tiles(lib.tile_bytes(layer), lib.spec, torch.float64)  # [B, nt, H, T, D]
    flat = lambda x: x.permute(0, 2, 1, 3, 4).reshape(B, H, -1, D)  # noqa: E731
    return flat(k), flat(v)


def _pooled_scores(q, lib, layer, tile_k, pool, kernel_size, scale, score_dtype) -> torch.Tensor:
    B, Hq, n_obs, D = q.shape
    H = lib.num_kv_heads
    g = Hq // H
    sink_k, _ = lib.sink_kv(layer)
    win_k, _ = lib.window_kv(layer)
    keys = torch.cat((sink_k.to(score_dtype), tile_k.to(score_dtype), win_k.to(score_dtype)), dim=2)  # [B, H, L, D]
    L = keys.shape[2]
    qg = q.to(lib.device, score_dtype).reshape(B, H, g, n_obs, D)
    logits = torch.einsum("bhgqd,bhkd->bhgqk", qg, keys) * (D**-0.5 if scale is None else float(scale))
    q_pos = torch.arange(L - n_obs, L, device=lib.device)
    future = torch.arange(L, device=lib.device)[None, :] > q_pos[:, None]  # [n_obs, L]
    probs = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)
    t0, t1 = lib.positions(layer)["tiles"]
    votes = probs[..., t0:t1].sum(dim=(2, 3))  # [B, H, n_tile_tokens]
    if kernel_size == 1:
        return votes
    pool_fn = torch.nn.functional.avg_pool1d if pool == "avg" else torch.nn.functional.max_pool1d
    pooled = pool_fn(votes.reshape(B * H, 1, -1), kernel_size, stride=1, padding=kernel_size // 2)
    return pooled.reshape(B, H, -1)


def snapkv_scores(cache, layer: int, queries: torch.Tensor, *, pool: str = "avg", kernel_size: int = 7,
                  scale: float | None = None, score_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Pooled SnapKV scores of ``layer``'s tile tokens (steps 2-3 of the module docstring).

    queries: [batch, num_q_heads, obs, head_dim], the newest ``obs`` tokens' queries (post-RoPE).
    Returns ``score_dtype`` [batch, num_kv_heads, n_tiles * tile_tokens] on the cache's device.
    """
    lib, _ = _resolve(cache)
    _check_options(pool, kernel_size, scale, score_dtype)
    q = _layer_queries({layer: queries}, lib)[layer]
    tile_k, _ = _tile_tokens(lib, layer)
    return _pooled_scores(q, lib, layer, tile_k, pool, kernel_size, scale, score_dtype)


def snapkv_compact(cache, queries, keep: int, *, pool: str = "avg", kernel_size: int = 7,
                   scale: float | None = None, score_dtype: torch.dtype = torch.float32) -> Compaction:
    """SnapKV compaction of the layers of ``cache`` that ``queries`` names (see the module docstring).

    Args:
        cache: a :class:`kvarn_cutlass.KVarNCache` or a :class:`kvarn_cutlass.hf.KVarNCache`
            (then the dropped tokens are recorded so that positions continue; see the module docstring).
        queries: the observation queries, per layer [batch, num_q_heads, obs, head_dim] (any float
            dtype and device; 1 <= obs <= the layer's length; the newest ``obs`` tokens' queries,
            post-RoPE): a sequence of one tensor per layer, a dict ``{layer: tensor}`` (other layers
            are left alone) or a :class:`QueryRecorder`.
        keep: tokens per layer afterwards (positive int): sink + window + the kept tile tokens, the
            latter rounded down to whole tiles. A layer holding ``<= keep`` tokens, or no tiles,
            is left alone.
        pool: ``"avg"`` (SnapKV's default) or ``"max"``; kernel_size: odd pooling width (1: none).
        scale: softmax scale of the scores, a positive finite number; default 1/sqrt(head_dim).
        score_dtype: float32 (default) or float64 for the attention scores.

    Returns a :class:`Compaction`. On bad arguments (ValueError/TypeError naming the argument) or any
    other error, no layer is changed. Not allowed inside a ``deferred_checks`` block.
    """
    lib, hf_cache = _resolve(cache)
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be a positive int (tokens per layer after compaction), got {keep!r}")
    _check_options(pool, kernel_size, scale, score_dtype)
    per_layer = _layer_queries(queries, lib)
    T = lib.spec.tile_tokens
    contents, kept, evicted = {}, {}, {}
    for layer, q in per_layer.items():
        L, n_tiles = lib.seq_len(layer), lib.num_tiles(layer)
        sink_k, sink_v = lib.sink_kv(layer)
        win_k, win_v = lib.window_kv(layer)
        budget = keep - sink_k.shape[2] - win_k.shape[2]
        n_keep = T * (max(budget, 0) // T)
        evicted[layer] = 0
        if keep >= L or n_tiles == 0:
            continue
        tile_k, tile_v = _tile_tokens(lib, layer)
        scores = _pooled_scores(q, lib, layer, tile_k, pool, kernel_size, scale, score_dtype)
        # a stable descending sort: among equal scores (frequent after max pooling) the earlier token wins
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
        chosen = order[..., :n_keep].sort(dim=-1).values  # [B, H, n_keep], tile-token index
        pick = lambda x: _to_cache_dtype(x.gather(2, chosen[..., None].expand(-1, -1, -1, x.shape[-1])), lib.dtype)  # noqa: E731
        contents[layer] = (torch.cat((sink_k, pick(tile_k), win_k), dim=2), torch.cat((sink_v, pick(tile_v), win_v), dim=2))
        kept[layer] = chosen + sink_k.shape[2]
        evicted[layer] = n_tiles * T - n_keep
    if contents:
        lib.replace_layers(contents)
    if hf_cache is not None and contents:
        for layer, n in evicted.items():
            hf_cache.layers[layer].evicted += n
        if hf_cache.dequantized is not None:  # its decoded tiles are the old ones
            from .hf.dispatch import DequantizedTiles

            hf_cache.dequantized = DequantizedTiles()
    return Compaction(kept=kept, evicted=evicted)


def _to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round to the cache dtype; a reconstruction just past its largest finite value saturates."""
    big = torch.finfo(dtype).max
    return x.clamp(-big, big).to(dtype)
