"""Chunked prefill through a KVarNCache: long prompts in chunks, logits only for the last chunk."""

from __future__ import annotations

import contextlib

import torch

from ._compat import base_model, cache_kwarg


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, cache, chunk_size: int = 512, logits_to_keep: int = 1):
    """Feed ``input_ids`` [batch, n] into ``cache`` in chunks of ``chunk_size`` tokens.

    Non-final chunks run the decoder stack only (no LM head); the final chunk runs the full model
    with ``logits_to_keep`` (default 1: logits of the last position). With a KVarN cache the chunks
    run in its ``deferred_checks`` block: the appends of every layer and chunk are validated with one
    device read at the end instead of a host synchronization each (on a failed check the cache is
    back at its state before the call and ValueError is raised). Returns the final chunk's model
    output (``.logits`` [batch, min(logits_to_keep, last chunk), vocab]).

    Each chunk's queries attend to the cache as it was before the chunk plus the chunk itself, exactly
    (the library's prefill semantics, :func:`kvarn_cutlass.prefill_attention`): no query reads its own
    chunk, or window tokens that the chunk's append compresses, in quantized form.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be a [batch, n>=1] tensor, got {getattr(input_ids, 'shape', type(input_ids))}")
    kw = cache_kwarg(model)
    inner = base_model(model)
    n = input_ids.shape[1]
    starts = list(range(0, n, chunk_size))
    # a KVarN cache checks the whole prompt's appends with one device read at the end
    deferred = cache.deferred_checks() if hasattr(cache, "deferred_checks") else contextlib.nullcontext()
    with deferred:
        for s in starts[:-1]:
            chunk = input_ids[:, s : s + chunk_size]
            if inner is not None:
                inner(input_ids=chunk, use_cache=True, **{cache_kwarg(inner): cache})
            else:
                model(input_ids=chunk, use_cache=True, logits_to_keep=1, **{kw: cache})
        last = input_ids[:, starts[-1] :]
        out = model(input_ids=last, use_cache=True, logits_to_keep=logits_to_keep, **{kw: cache})
    return out
