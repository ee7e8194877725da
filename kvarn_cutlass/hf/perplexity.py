"""Teacher-forced perplexity over a KVarN cache, each position seeing the cache as at decode time.

Methods:

* ``sim`` (default on CPU): one forward pass per text window with the ``kvarn`` attention in
  simulation mode (:mod:`kvarn_cutlass.hf.simulate`); supports ``window=0`` (no window).
* ``decode`` (default on CUDA): the real thing, token by token through :class:`KVarNCache`
  (attention through :func:`kvarn_cutlass.hf.dispatch.attend`: GPU decode kernel on CUDA, the
  float64 reference on CPU). Equal to ``sim`` up to float rounding.
* ``prefill``: chunks of ``chunk`` tokens through :class:`KVarNCache` with all logits kept: the
  library's chunked-prefill semantics (queries of a chunk see the cache as it was before the chunk,
  plus the chunk exactly; the fused kernel on CUDA); a measurement of the prefill path, which
  differs from decode only in when window tokens are compressed.

The unquantized baseline is computed in the same run: the same model with every key and value
exact in the cache dtype (``SimSpec(preset=None)``).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import replace

import torch

from ._compat import cache_kwarg
from .cache import KVarNCache
from .simulate import SimSpec

METHODS = ("sim", "decode", "prefill")


def token_windows(tokenizer, text: str, ctx: int, windows: int | None = None) -> list[torch.Tensor]:
    """Tokenize the whole text; return its first ``windows`` consecutive non-overlapping windows of
    ``ctx`` tokens (all complete windows for None), each a [ctx] int64 tensor."""
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    n = ids.numel() // ctx
    if windows is not None:
        if windows > n:
            raise ValueError(f"the text has {ids.numel()} tokens: only {n} windows of {ctx}, {windows} requested")
        n = windows
    if n < 1:
        raise ValueError(f"the text has {ids.numel()} tokens, fewer than ctx={ctx}")
    return [ids[i * ctx : (i + 1) * ctx] for i in range(n)]


def _nll_from_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    return -lp.gather(-1, targets[:, None]).squeeze(-1)


def _batch_nll(logits: torch.Tensor, batch: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """NLL of batch[:, 1:] under logits [batch, n-1, vocab], shaped like ``shape`` with n-1 last, on CPU."""
    nll = torch.stack([_nll_from_logits(logits[b], batch[b, 1:]) for b in range(batch.shape[0])])
    return nll.reshape(*shape[:-1], shape[-1] - 1).cpu()


@torch.no_grad()
def nll_sim(model, ids: torch.Tensor, spec: SimSpec) -> torch.Tensor:
    """NLL [..., n-1] float64 (on CPU) of ids[..., 1:] given their prefixes, for ids [n] or [batch, n]
    (a batch of independent windows), the cache simulated by ``spec``."""
    batch = ids.to(model.device).reshape(-1, ids.shape[-1])
    logits = model(input_ids=batch, use_cache=False, kvarn_sim=spec).logits
    return _batch_nll(logits[:, :-1], batch, ids.shape)


def _make_cache(model, spec: SimSpec) -> KVarNCache:
    if spec.preset is None:
        raise ValueError("methods decode/prefill need a preset (the baseline always uses the simulation)")
    if spec.window == 0:
        raise ValueError("window=0 (no window) exists only in the simulation; use method 'sim'")
    return KVarNCache(model.config, preset=spec.preset, window=spec.window, sink_tokens=spec.sink_tokens,
                      dtype=spec.dtype, scale_dtype=spec.scale_dtype, sinkhorn_iters=spec.sinkhorn_iters,
                      quantizer=spec.quantizer)


@torch.no_grad()
def nll_decode(model, ids: torch.Tensor, spec: SimSpec, step=None) -> torch.Tensor:
    """NLL [..., n-1] float64 (on CPU): token-by-token decode through a real KVarNCache, for ids [n] or
    [batch, n] (independent windows decoded together as one batch). ``step(k)`` is called per step."""
    cache, kw = _make_cache(model, spec), cache_kwarg(model)
    batch = ids.to(model.device).reshape(-1, ids.shape[-1])
    rows = []
    for t in range(batch.shape[1] - 1):
        out = model(input_ids=batch[:, t : t + 1], use_cache=True, **{kw: cache})
        rows.append(out.logits[:, -1])
        if step is not None:
            step(batch.shape[0])
    return _batch_nll(torch.stack(rows, 1), batch, ids.shape)


@torch.no_grad()
def nll_prefill(model, ids: torch.Tensor, spec: SimSpec, chunk: int) -> torch.Tensor:
    """NLL [n-1]: chunked prefill through a real KVarNCache, every logit kept (prefill semantics)."""
    cache, kw = _make_cache(model, spec), cache_kwarg(model)
    ids = ids.to(model.device)[None]
    logits = [model(input_ids=ids[:, s : s + chunk], use_cache=True, **{kw: cache}).logits[0]
              for s in range(0, ids.shape[1], chunk)]
    return _nll_from_logits(torch.cat(logits)[:-1], ids[0, 1:]).cpu()


def bucket_edges(ctx: int, window: int, tile_tokens: int) -> list[tuple[int, int]]:
    """Position buckets [0, W), [W, 4W), [4W, ctx) over predicting positions 0..ctx-2 (W = window, or
    the tile size when window=0); empty buckets dropped."""
    w = window or tile_tokens
    edges = [(0, w), (w, 4 * w), (4 * w, ctx)]
    return [(a, min(b, ctx - 1)) for a, b in edges if a < min(b, ctx - 1)]


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, file=sys.stderr, leave=False)
    except ImportError:
        return _SimpleBar(total, desc)


class _SimpleBar:
    def __init__(self, total: int, desc: str) -> None:
        self.total, self.n, self.desc, self.t0 = total, 0, desc, time.time()

    def update(self, k: int = 1) -> None:
        self.n += k
        print(f"\r{self.desc}: {self.n}/{self.total} ({time.time() - self.t0:.0f}s)", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        print(file=sys.stderr)


def _summary(nll: torch.Tensor, buckets, base: torch.Tensor | None = None) -> dict:
    """nll: [windows, ctx-1]; base: the baseline's nll of the same shape (adds *_baseline fields)."""
    m = nll.mean().item()
    res = {"nll": m, "ppl": math.exp(m), "buckets": []}
    if base is not None:
        mb = base.mean().item()
        res.update(nll_baseline=mb, ppl_baseline=math.exp(mb), ppl_rel_increase=math.exp(m - mb) - 1)
    for a, b in buckets:
        row = {"positions": [a, b], "tokens": nll[:, a:b].numel(), "nll": nll[:, a:b].mean().item()}
        row["ppl"] = math.exp(row["nll"])
        if base is not None:
            row["nll_baseline"] = base[:, a:b].mean().item()
            row["ppl_baseline"] = math.exp(row["nll_baseline"])
        res["buckets"].append(row)
    return res


def evaluate(
    model,
    windows: list[torch.Tensor],
    specs: list[SimSpec],
    method: str = "sim",
    chunk: int = 512,
    baseline: bool = True,
    progress: bool = True,
    batch_size: int = 2,
) -> dict:
    """Perplexity of ``model`` over ``windows`` (each [ctx] token ids) for each cache config in ``specs``.

    Returns ``{"baseline": summary | None, "results": [summary per spec], "seconds", "tokens_scored"}``.
    A summary has ``nll``, ``ppl`` and ``buckets`` (per position bucket: positions, tokens, nll,
    ppl); with the baseline, also ``nll_baseline``, ``ppl_baseline``, ``ppl_rel_increase`` and
    per-bucket baseline values. The baseline is the unquantized cache: every key/value exact in the
    cache dtype (``SimSpec(preset=None)``), computed in the same run. ``batch_size``: windows per
    forward pass in the simulation and per decode batch.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not windows:
        raise ValueError("no text windows to evaluate")
    ctx = windows[0].numel()
    per_token = method == "decode"
    groups = [torch.stack(windows[i : i + batch_size]) for i in range(0, len(windows), batch_size)]
    total = len(windows) * (len(specs) * (ctx - 1 if per_token else 1) + (1 if baseline else 0))
    bar = _progress(total, f"perplexity ({method})", progress)
    tick = bar.update if bar is not None else (lambda k=1: None)
    t0 = time.time()
    out = {"baseline": None, "results": []}
    base = None
    if baseline:
        ref = specs[0] if specs else SimSpec(None, 0)
        base_spec = replace(ref, preset=None, window=0, sink_tokens=0)
        rows = []
        for grp in groups:
            rows.append(nll_sim(model, grp, base_spec))
            tick(grp.shape[0])
        base = torch.cat(rows)
        out["baseline"] = {**_summary(base, bucket_edges(ctx, 0, ctx)), "config": "unquantized"}
    for spec in specs:
        rows = []
        if method == "sim":
            for grp in groups:
                rows.append(nll_sim(model, grp, spec))
                tick(grp.shape[0])
        elif method == "decode":
            for grp in groups:
                rows.append(nll_decode(model, grp, spec, step=tick))
        else:
            for w in windows:
                rows.append(nll_prefill(model, w, spec, chunk)[None])
                tick(1)
        res = _summary(torch.cat(rows), bucket_edges(ctx, spec.window, spec.tile_tokens), base)
        res.update(config=spec.describe(), preset=spec.preset, quantizer=spec.quantizer, window=spec.window,
                   sink_tokens=spec.sink_tokens)
        out["results"].append(res)
    if bar is not None:
        bar.close()
    out["seconds"] = time.time() - t0
    out["tokens_scored"] = len(windows) * (ctx - 1)
    return out
