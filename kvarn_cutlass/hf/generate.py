"""Greedy generation with a KVarN cache and its agreement with the unquantized cache."""

from __future__ import annotations

import time

import torch

from ._compat import cache_kwarg
from .cache import KVarNCache
from .prefill import prefill


def _baseline_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:
        return DynamicCache()


@torch.no_grad()
def greedy(model, input_ids: torch.Tensor, max_new_tokens: int, cache=None, chunk_size: int = 512) -> torch.Tensor:
    """Greedy continuation [batch, max_new_tokens] of ``input_ids`` [batch, n] (no early stop at EOS).

    ``cache``: a :class:`KVarNCache` (quantized) or None for transformers' ``DynamicCache``
    (unquantized; the ``kvarn`` attention then runs plain SDPA). The prompt goes through
    :func:`prefill` in chunks of ``chunk_size``.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    cache = _baseline_cache(model) if cache is None else cache
    kw = cache_kwarg(model)
    ids = input_ids.to(model.device)
    logits = prefill(model, ids, cache, chunk_size).logits[:, -1]
    out = []
    for i in range(max_new_tokens):
        tok = logits.argmax(-1)
        out.append(tok)
        if i + 1 < max_new_tokens:
            logits = model(input_ids=tok[:, None], use_cache=True, **{kw: cache}).logits[:, -1]
    return torch.stack(out, dim=1)


@torch.no_grad()
def teacher_forced_agreement(model, input_ids: torch.Tensor, reference: torch.Tensor, cache, chunk_size: int = 512) -> float:
    """Fraction of steps where greedy decoding with ``cache``, fed the ``reference`` continuation
    [batch, N] token by token, picks the reference's next token."""
    kw = cache_kwarg(model)
    ids = input_ids.to(model.device)
    ref = reference.to(model.device)
    logits = prefill(model, ids, cache, chunk_size).logits[:, -1]
    hits = []
    for i in range(ref.shape[1]):
        hits.append(logits.argmax(-1) == ref[:, i])
        if i + 1 < ref.shape[1]:
            logits = model(input_ids=ref[:, i : i + 1], use_cache=True, **{kw: cache}).logits[:, -1]
    return torch.stack(hits, 1).float().mean().item()


def prompts_from_text(tokenizer, text: str, num_prompts: int, prompt_tokens: int) -> list[torch.Tensor]:
    """``num_prompts`` prompts of ``prompt_tokens`` tokens taken at evenly spaced offsets of the text."""
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    if ids.numel() < prompt_tokens:
        raise ValueError(f"the text has {ids.numel()} tokens, fewer than prompt_tokens={prompt_tokens}")
    stride = max(1, (ids.numel() - prompt_tokens) // max(1, num_prompts))
    return [ids[i * stride : i * stride + prompt_tokens] for i in range(num_prompts)]


def agreement(
    model,
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    cache_factory,
    chunk_size: int = 512,
    teacher_forced: bool = True,
    progress=None,
) -> dict:
    """Greedy generation per prompt with ``cache_factory()`` (a fresh KVarNCache) and with the
    unquantized cache.

    Per prompt: ``identical`` (fraction of positions where the two free-running greedy outputs hold
    the same token), ``first_divergence`` (index of the first differing token, None if none), and,
    with ``teacher_forced``, ``teacher_forced`` (fraction of steps where the quantized model, fed
    the unquantized continuation, predicts its next token). Means over prompts at the top level.
    """
    rows, t0 = [], time.time()
    for i, p in enumerate(prompts):
        ids = p.reshape(1, -1)
        base = greedy(model, ids, max_new_tokens, None, chunk_size)
        quant = greedy(model, ids, max_new_tokens, cache_factory(), chunk_size)
        same = (base == quant)[0]
        diff = (~same).nonzero()
        row = {
            "prompt": i,
            "prompt_tokens": ids.shape[1],
            "identical": same.float().mean().item(),
            "first_divergence": int(diff[0, 0]) if diff.numel() else None,
            "baseline_tokens": base[0].tolist(),
            "quantized_tokens": quant[0].tolist(),
        }
        if teacher_forced:
            row["teacher_forced"] = teacher_forced_agreement(model, ids, base, cache_factory(), chunk_size)
        rows.append(row)
        if progress is not None:
            progress(1)
    res = {
        "prompts": len(rows),
        "max_new_tokens": max_new_tokens,
        "identical": sum(r["identical"] for r in rows) / len(rows),
        "seconds": time.time() - t0,
        "per_prompt": rows,
    }
    if teacher_forced:
        res["teacher_forced"] = sum(r["teacher_forced"] for r in rows) / len(rows)
    return res


def kvarn_cache_factory(model, **cache_kwargs):
    """A callable returning a fresh :class:`KVarNCache` for ``model`` (validated once, now)."""
    KVarNCache(model.config, **cache_kwargs)
    return lambda: KVarNCache(model.config, **cache_kwargs)
