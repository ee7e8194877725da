"""Chunked prefill through a KVarNCache: long prompts in chunks, logits only for the last chunk."""

from __future__ import annotations

import torch

from ._compat import base_model, cache_kwarg


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, cache, chunk_size: int = 512, logits_to_keep: int = 1):
    """Feed ``input_ids`` [batch, n] into ``cache`` in chunks of ``chunk_size`` tokens.

    Non-final chunks run the decoder stack only (no LM head); the final chunk runs the full model
    with ``logits_to_keep`` (default 1: logits of the last position). Returns the final chunk's model
    output (``.logits`` [batch, min(logits_to_keep, last chunk), vocab]).

    Each chunk's queries attend to the cache as it is after the chunk was appended (the library's
    prefill semantics), so with a window smaller than the chunk the early queries of a chunk can see
    tiles that token-by-token decode would still read unquantized; the last position of the prompt
    always sees exactly the decode-time cache.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be a [batch, n>=1] tensor, got {getattr(input_ids, 'shape', type(input_ids))}")
    kw = cache_kwarg(model)
    inner = base_model(model)
    n = input_ids.shape[1]
    starts = list(range(0, n, chunk_size))
    for s in starts[:-1]:
        chunk = input_ids[:, s : s + chunk_size]
        if inner is not None:
            inner(input_ids=chunk, use_cache=True, **{cache_kwarg(inner): cache})
        else:
            model(input_ids=chunk, use_cache=True, logits_to_keep=1, **{kw: cache})
    last = input_ids[:, starts[-1] :]
    return model(input_ids=last, use_cache=True, logits_to_keep=logits_to_keep, **{kw: cache})
