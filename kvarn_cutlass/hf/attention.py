"""The ``kvarn`` attention implementation for transformers (``attn_implementation="kvarn"``).

``register()`` (run on ``import kvarn_cutlass.hf``) adds ``kvarn`` to transformers'
``AttentionInterface`` and ``AttentionMaskInterface``. The attention function has three paths:

1. keys tagged by :class:`kvarn_cutlass.hf.KVarNCache` (the cache path): attention of the new
   queries over the library cache plus the new tokens, then their append, through
   :func:`kvarn_cutlass.hf.dispatch.attend`;
2. ``kvarn_sim=SimSpec(...)`` passed to the model's forward (no cache): the teacher-forced
   decode-time simulation of :mod:`kvarn_cutlass.hf.simulate` (perplexity evaluation);
3. anything else (no cache, or transformers' own ``DynamicCache``): plain SDPA, so the same model
   object also gives the unquantized baseline.

On every path, ``kvarn_queries=QueryRecorder(obs)`` passed to the model's forward records the last
``obs`` (post-RoPE) queries of each layer (:mod:`kvarn_cutlass.compact`, SnapKV compaction).

The mask function rejects padding (a 2D attention mask with zeros): the library cache holds one
length for every sequence of the batch.
"""

from __future__ import annotations

import weakref

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .cache import ATTN_IMPLEMENTATION, handle_of
from .dispatch import attend

_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks")


def kvarn_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    """Mask builder for ``kvarn``: raises on padding, otherwise SDPA's mask (used by path 3)."""
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise ValueError(
            "KVarN attention does not support padded batches (the attention mask has zeros); "
            "run sequences of different lengths one at a time or without padding"
        )
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


# The mask last found causal, as (weak reference, n_q, seq_len): transformers builds one mask per forward pass
# and hands it to every layer, and reading the comparison back is a host synchronization, so the layers
# after the first reuse the first one's verdict (36 synchronizations per chunk of a 36-layer model before).
_causal_checked: tuple[weakref.ref, int, int] | None = None


def _mask_is_causal(mask: torch.Tensor, n_q: int, seq_len: int) -> bool:
    """Whether ``mask`` [..., n_q, >= seq_len] (bool: True = attend; float: 0 = attend) allows exactly the
    causal pattern of n_q queries at the last positions of seq_len keys (one device read)."""
    allowed = mask[..., :seq_len] if mask.dtype == torch.bool else mask[..., :seq_len] == 0
    q_pos = torch.arange(seq_len - n_q, seq_len, device=mask.device)
    causal = torch.arange(seq_len, device=mask.device)[None, :] <= q_pos[:, None]
    return bool((allowed == causal).all())


def _check_causal_mask(mask: torch.Tensor | None, n_q: int, seq_len: int) -> None:
    """The cache path implements the plain causal mask; anything else must not be silently ignored."""
    global _causal_checked
    if mask is None:
        return
    if mask.dim() != 4 or mask.shape[-2] != n_q or mask.shape[-1] < seq_len:
        raise ValueError(f"KVarN attention got an attention mask of shape {list(mask.shape)} for {n_q} queries over {seq_len} keys")
    if _causal_checked is not None and _causal_checked[0]() is mask and _causal_checked[1:] == (n_q, seq_len):
        return
    if not _mask_is_causal(mask, n_q, seq_len):
        raise ValueError(
            "KVarN attention supports only the causal mask over the cache (no padding, packed sequences or custom masks)"
        )
    _causal_checked = (weakref.ref(mask), n_q, seq_len)


def kvarn_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
):
    """transformers attention function. query [B, Hq, n_q, D], key/value [B, Hkv, n, D] (post-RoPE).

    Returns (attn_output [B, n_q, Hq, D], None) like transformers' SDPA function.
    """
    sim = kwargs.pop("kvarn_sim", None)
    recorder = kwargs.pop("kvarn_queries", None)  # kvarn_cutlass.compact.QueryRecorder: SnapKV's observation queries
    if recorder is not None:
        recorder.record(module.layer_idx, query)
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"KVarN attention does not support {name!r}")
    if getattr(module, "sinks", None) is not None:
        raise NotImplementedError("KVarN attention does not support attention sinks (module.sinks)")
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError("KVarN attention does not support sliding-window layers")
    if module.training and dropout > 0:
        raise NotImplementedError("KVarN attention is inference-only (dropout > 0 in training mode)")

    handle = handle_of(key)
    if handle is not None:
        lib = handle.cache.library
        n_q = query.shape[2]
        _check_causal_mask(attention_mask, n_q, lib.seq_len(handle.layer) + n_q)
        handle.consumed = True  # even if attend raises: the update was read (its error is the one to report)
        out = attend(query, handle.key, handle.value, lib, handle.layer, scale=scaling,
                     dequantized=handle.cache.dequantized)
        return out.transpose(1, 2).contiguous(), None
    if sim is not None:
        from .simulate import simulated_attention

        out = simulated_attention(query, key, value, sim, scale=scaling)
        return out.to(query.dtype).transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


_registered = False


def register(name: str = ATTN_IMPLEMENTATION) -> None:
    """Register ``kvarn`` with transformers (idempotent)."""
    global _registered
    if _registered and name == ATTN_IMPLEMENTATION:
        return
    AttentionInterface.register(name, kvarn_attention_forward)
    AttentionMaskInterface.register(name, kvarn_mask)
    if name == ATTN_IMPLEMENTATION:
        _registered = True
