"""Greedy generation with a KVarN cache and its agreement with the unquantized cache, and
:func:`generate`: ``model.generate`` with a KVarN cache, its decoding strategy checked first.

Two greedy loops: :func:`greedy` (eager, one forward pass per token through ``model(...)``) and
:func:`static_greedy` (:mod:`kvarn_cutlass.hf.static_step`: the decode step on static buffers, replayed
from one CUDA graph on CUDA with no host synchronization per token), equal token for token."""

from __future__ import annotations

import copy
import time
from typing import Callable

import torch

from ._compat import cache_kwarg
from .cache import KVarNCache
from .prefill import prefill
from .static_step import StaticGreedy, static_greedy

__all__ = ["StaticGreedy", "agreement", "check_generation_mode", "generate", "greedy", "kvarn_cache_factory",
           "prompts_from_text", "static_greedy", "teacher_forced_agreement"]

# tokens between readbacks of the graph-decoded run of agreement(graph=True) (its progress reports)
GRAPH_PROGRESS_EVERY = 16


def _baseline_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:
        return DynamicCache()


@torch.no_grad()
def greedy(model, input_ids: torch.Tensor, max_new_tokens: int, cache=None, chunk_size: int = 512,
           on_token: Callable[[], None] | None = None) -> torch.Tensor:
    """Greedy continuation [batch, max_new_tokens] of ``input_ids`` [batch, n] (no early stop at EOS).

    ``cache``: a :class:`KVarNCache` (quantized) or None for transformers' ``DynamicCache``
    (unquantized; the ``kvarn`` attention then runs plain SDPA). The prompt goes through
    :func:`prefill` in chunks of ``chunk_size``. ``on_token()`` is called once per token chosen
    (progress). The last token is chosen but never fed back, so the cache ends holding
    n + max_new_tokens - 1 tokens.
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
        if on_token is not None:
            on_token()
        if i + 1 < max_new_tokens:
            logits = model(input_ids=tok[:, None], use_cache=True, **{kw: cache}).logits[:, -1]
    return torch.stack(out, dim=1)


@torch.no_grad()
def teacher_forced_agreement(model, input_ids: torch.Tensor, reference: torch.Tensor, cache, chunk_size: int = 512,
                             on_token: Callable[[], None] | None = None) -> float:
    """Fraction of steps where greedy decoding with ``cache``, fed the ``reference`` continuation
    [batch, N] token by token, picks the reference's next token. ``on_token()``: once per step."""
    kw = cache_kwarg(model)
    ids = input_ids.to(model.device)
    ref = reference.to(model.device)
    logits = prefill(model, ids, cache, chunk_size).logits[:, -1]
    hits = []
    for i in range(ref.shape[1]):
        hits.append(logits.argmax(-1) == ref[:, i])
        if on_token is not None:
            on_token()
        if i + 1 < ref.shape[1]:
            logits = model(input_ids=ref[:, i : i + 1], use_cache=True, **{kw: cache}).logits[:, -1]
    return torch.stack(hits, 1).float().mean().item()


def _per_token(progress: Callable[[], None] | None) -> Callable[[torch.Tensor], None] | None:
    """``static_greedy``'s ``on_tokens`` that calls ``progress()`` once per token read back."""
    if progress is None:
        return None

    def on_tokens(tokens: torch.Tensor) -> None:
        for _ in range(tokens.shape[1]):
            progress()

    return on_tokens


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
    progress: Callable[[], None] | None = None,
    graph: bool = False,
) -> dict:
    """Greedy generation per prompt with ``cache_factory()`` (a fresh KVarNCache) and with the
    unquantized cache.

    ``graph``: the quantized free-running generation runs through :func:`static_greedy` with its decode
    step replayed from a CUDA graph (CUDA only; the factory's caches need ``max_seq_len`` >= prompt +
    ``max_new_tokens``), its tokens read back every :data:`GRAPH_PROGRESS_EVERY` tokens; the unquantized
    and teacher-forced runs stay eager.

    Per prompt: ``identical`` (fraction of positions where the two free-running greedy outputs hold
    the same token), ``first_divergence`` (index of the first differing token, None if none),
    ``tokens_in_tiles`` (tokens the quantized run's cache held as tiles at its end, layer 0: 0 means
    every key and value stayed exact, so agreement says nothing about the quantization) and, with
    ``teacher_forced``, ``teacher_forced`` (fraction of steps where the quantized model, fed the
    unquantized continuation, predicts its next token). Means over prompts at the top level, and
    ``prompts_without_tiles``. ``progress()`` is called once per token generated or scored
    (``len(prompts) * max_new_tokens * (3 if teacher_forced else 2)`` calls in all).
    """
    rows, t0 = [], time.time()
    for i, p in enumerate(prompts):
        ids = p.reshape(1, -1)
        base = greedy(model, ids, max_new_tokens, None, chunk_size, on_token=progress)
        cache = cache_factory()
        if graph:
            quant = static_greedy(model, ids, max_new_tokens, cache, chunk_size, graph=True,
                                  sync_every=GRAPH_PROGRESS_EVERY, on_tokens=_per_token(progress))
        else:
            quant = greedy(model, ids, max_new_tokens, cache, chunk_size, on_token=progress)
        same = (base == quant)[0]
        diff = (~same).nonzero()
        lo, hi = cache.library.positions(0)["tiles"]
        row = {
            "prompt": i,
            "prompt_tokens": ids.shape[1],
            "identical": same.float().mean().item(),
            "first_divergence": int(diff[0, 0]) if diff.numel() else None,
            "tokens_in_tiles": hi - lo,
            "baseline_tokens": base[0].tolist(),
            "quantized_tokens": quant[0].tolist(),
        }
        if teacher_forced:
            row["teacher_forced"] = teacher_forced_agreement(model, ids, base, cache_factory(), chunk_size,
                                                             on_token=progress)
        rows.append(row)
    res = {
        "prompts": len(rows),
        "max_new_tokens": max_new_tokens,
        "decode": "graph" if graph else "eager",
        "identical": sum(r["identical"] for r in rows) / len(rows),
        "prompts_without_tiles": sum(1 for r in rows if r["tokens_in_tiles"] == 0),
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


# Strategies that read the cache only forward, appending one token per step (the library cache
# cannot reorder beams or crop tiles back into the window).
SUPPORTED_GENERATION_MODES = ("greedy_search", "sample")


def check_generation_mode(model, generation_config=None, assistant_model=None, **generate_kwargs) -> str:
    """The decoding strategy ``model.generate(..., generation_config, assistant_model, **generate_kwargs)``
    would run, checked against what a KVarN cache supports (greedy search, sampling; with
    ``num_return_sequences`` too). Nothing is run and no cache is touched.

    Raises:
        NotImplementedError: beam search of any kind (it reorders the cache every step), assisted or
            prompt-lookup decoding (they crop rejected draft tokens out of the cache), any other
            strategy (contrastive search, DoLa: not run with it); the message names the strategy
            and the arguments that chose it.
    """
    config = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    config.update(**generate_kwargs)  # keys that are not generation options are left to generate()
    mode = config.get_generation_mode(assistant_model).value
    if mode in SUPPORTED_GENERATION_MODES:
        return mode
    why = ("reorders the cache every step" if "beam" in mode else
           "crops rejected draft tokens out of the cache" if mode == "assisted_generation" else "it does not run")
    given = [f"{k}={v!r}" for k, v in generate_kwargs.items()]
    if assistant_model is not None:
        given.append(f"assistant_model={type(assistant_model).__name__}")
    raise NotImplementedError(
        f"KVarNCache supports greedy search and sampling in generate(); {', '.join(given) or 'the generation config'} "
        f"selects {mode.replace('_', ' ')}, which {why}")


def generate(model, input_ids: torch.Tensor, cache, **generate_kwargs) -> torch.Tensor:
    """``model.generate(input_ids, **generate_kwargs)`` with ``cache`` (a :class:`KVarNCache`) passed
    under the name this transformers version expects (``cache`` or ``past_key_values``), after
    :func:`check_generation_mode`: a strategy the cache cannot serve raises before the prompt is
    prefilled, with ``cache`` unchanged."""
    check_generation_mode(model, **generate_kwargs)
    return model.generate(input_ids, **{cache_kwarg(model): cache}, **generate_kwargs)
