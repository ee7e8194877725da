"""Chunked prefill through a KVarNCache: long prompts in chunks, logits only for the last chunk."""

from __future__ import annotations

import contextlib
import os

import torch

from ._compat import base_model, cache_kwarg


OVERLAP_ENV = "KVARN_OVERLAP_APPENDS"


def overlap_appends_default() -> bool:
    """Whether :func:`prefill` overlaps a KVarN cache's appends with the forward pass when not told:
    ``$KVARN_OVERLAP_APPENDS`` (``0`` or ``1``), on unless set to 0 (docs/perf-notes.md has the A/B)."""
    text = os.environ.get(OVERLAP_ENV, "").strip() or "1"
    if text not in ("0", "1"):
        raise ValueError(f"${OVERLAP_ENV}={text!r}: choose 0 or 1")
    return text == "1"


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, cache, chunk_size: int = 512, logits_to_keep: int = 1,
            overlap_appends: bool | None = None):
    """Feed ``input_ids`` [batch, n] into ``cache`` in chunks of ``chunk_size`` tokens.

    Non-final chunks run the decoder stack only (no LM head); the final chunk runs the full model
    with ``logits_to_keep`` (default 1: logits of the last position). With a KVarN cache the chunks
    run in its ``deferred_checks`` block: the appends of every layer and chunk are validated with one
    device read at the end instead of a host synchronization each (on a failed check the cache is
    back at its state before the call and ValueError is raised). Returns the final chunk's model
    output (``.logits`` [batch, min(logits_to_keep, last chunk), vocab]).

    ``overlap_appends``: run that block with ``overlap_appends`` (the appends, and the compression of
    the tiles each chunk completes, on the cache's second stream, overlapping the following layers'
    work); ``None``: :func:`overlap_appends_default`.

    Each chunk's queries attend to the cache as it was before the chunk plus the chunk itself, exactly
    (the library's prefill semantics, :func:`kvarn_cutlass.prefill_attention`): no query reads its own
    chunk, or window tokens that the chunk's append compresses, in quantized form.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be a [batch, n>=1] tensor, got {getattr(input_ids, 'shape', type(input_ids))}")
    if overlap_appends is None:
        overlap_appends = overlap_appends_default()
    elif not isinstance(overlap_appends, bool):
        raise TypeError(f"overlap_appends must be a bool or None, got {type(overlap_appends).__name__}")
    kw = cache_kwarg(model)
    inner = base_model(model)
    n = input_ids.shape[1]
    starts = list(range(0, n, chunk_size))
    # a KVarN cache checks the whole prompt's appends with one device read at the end
    deferred = (cache.deferred_checks(overlap_appends) if hasattr(cache, "deferred_checks")
                else contextlib.nullcontext())
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
