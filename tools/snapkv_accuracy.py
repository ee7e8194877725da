#!/usr/bin/env python
"""Accuracy of SnapKV compaction of a KVarN cache (kvarn_cutlass.compact) on a causal LM.

Protocol, for text windows of ``prompt + continuation + 1`` tokens (consecutive, non-overlapping,
from the start of the tokenized text), all windows run as one batch:

1. Prefill the ``prompt`` tokens into a ``kvarn_cutlass.hf.KVarNCache`` (chunks of ``--chunk``;
   the last chunk runs with ``kvarn_queries=QueryRecorder(obs)``, which records each layer's last
   ``obs`` post-RoPE queries).
2. On a copy of that cache, compact every layer to ``keep = round(frac * prompt)`` tokens with ``snapkv_compact`` (or not, for
   the uncompacted row).
3. Teacher-forced decode, token by token, of the ``continuation`` tokens after the prompt; step i
   feeds token ``prompt + i`` and scores the next one, so every scored logit is computed after
   compaction (continuation positions keep their absolute RoPE positions).

Reported per config: perplexity over all scored tokens, and top-1 agreement (argmax equal) with
the uncompacted KVarN cache of the same preset and with the unquantized baseline (the same model
with every key/value exact in float16: ``SimSpec(preset=None)``, one forward pass per window).

Example (the numbers in docs/accuracy.md, "SnapKV compaction"):

    python tools/snapkv_accuracy.py --model ../shared/models/kvarn-ref-lm \\
        --text ../shared/data/code_eval.txt --windows 8 --prompt 1536 --continuation 256
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _prefill(model, prompt, preset, window, obs, chunk):
    """A KVarN cache holding ``prompt`` [windows, P] (the windows as one batch) and the recorder
    holding each layer's last ``obs`` queries."""
    import kvarn_cutlass.hf as kh
    from kvarn_cutlass.compact import QueryRecorder
    from kvarn_cutlass.hf._compat import cache_kwarg

    cache = kh.KVarNCache(model.config, preset=preset, window=window, cpu_attention="dequant")
    P = prompt.shape[1]
    last = P - ((P - 1) // chunk) * chunk  # the last chunk's length
    if P > last:
        kh.prefill(model, prompt[:, : P - last], cache, chunk_size=chunk)
    rec = QueryRecorder(obs)
    model(input_ids=prompt[:, P - last :], use_cache=True, logits_to_keep=1, kvarn_queries=rec,
          **{cache_kwarg(model): cache})
    return cache, rec


def _keep_recent(cache, keep):
    """Control: keep the most recent tile tokens instead of SnapKV's choice (the same count, the same
    re-quantization into new tiles, the same position bookkeeping; a layer holding ``<= keep``
    tokens, or no tiles, is left alone, as snapkv_compact leaves it)."""
    from kvarn_cutlass.compact import _tile_tokens, _to_cache_dtype

    lib = cache.library
    T, contents, evicted = lib.spec.tile_tokens, {}, {}
    for layer in range(lib.num_layers):
        n_tiles = lib.num_tiles(layer)
        if keep >= lib.seq_len(layer) or n_tiles == 0:
            continue
        (sk, sv), (wk, wv) = lib.sink_kv(layer), lib.window_kv(layer)
        n_keep = T * (max(keep - sk.shape[2] - wk.shape[2], 0) // T)
        k, v = _tile_tokens(lib, layer)  # float64 [B, H, n_tiles*T, D]
        recent = lambda x: _to_cache_dtype(x[:, :, n_tiles * T - n_keep :], lib.dtype)  # noqa: E731
        contents[layer] = (torch.cat((sk, recent(k), wk), 2), torch.cat((sv, recent(v), wv), 2))
        evicted[layer] = n_tiles * T - n_keep
    if not contents:
        return
    lib.replace_layers(contents)
    for layer, n in evicted.items():  # only once the replacement succeeded
        cache.layers[layer].evicted += n
    cache.dequantized = type(cache.dequantized)()


def _continue(model, cache, cont):
    """Teacher-forced decode of cont [windows, n+1], token by token: logits [windows, n, vocab]."""
    from kvarn_cutlass.hf._compat import cache_kwarg

    kw = cache_kwarg(model)
    rows = [model(input_ids=cont[:, i : i + 1], use_cache=True, **{kw: cache}).logits[:, -1]
            for i in range(cont.shape[1] - 1)]
    return torch.stack(rows, 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--text", required=True)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--prompt", type=int, default=1536, help="prompt tokens prefilled before compaction")
    p.add_argument("--continuation", type=int, default=256, help="tokens scored after compaction")
    p.add_argument("--presets", nargs="+", default=["k4v4_g128", "k4v2_g128"])
    p.add_argument("--window", type=int, default=256, help="fp16 window of the cache")
    p.add_argument("--keep", nargs="+", type=float, default=[0.5, 0.25], help="fractions of the prompt kept")
    p.add_argument("--obs", type=int, default=32, help="observation queries (SnapKV window)")
    p.add_argument("--pool", choices=("avg", "max"), default="avg")
    p.add_argument("--kernel-size", type=int, default=7)
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk")
    p.add_argument("--select", choices=("snapkv", "recent"), default="snapkv",
                   help="recent: control that keeps the most recent tile tokens instead")
    p.add_argument("--json", default=None, help="write the results here as JSON")
    args = p.parse_args(argv)

    from kvarn_cutlass.compact import snapkv_compact
    from kvarn_cutlass.hf import SimSpec
    from kvarn_cutlass.hf._compat import load_model
    from kvarn_cutlass.hf.perplexity import token_windows

    torch.manual_seed(0)
    model, tok = load_model(args.model, "cpu", "float32")
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    n = args.prompt + args.continuation + 1
    windows = token_windows(tok, text, n, args.windows)
    t0 = time.time()
    configs = [(preset, None) for preset in args.presets] + [(preset, frac) for preset in args.presets for frac in args.keep]
    batch = torch.stack(windows)  # [W, P + N + 1]: all windows decoded as one batch
    prompt, cont = batch[:, : args.prompt], batch[:, args.prompt :]
    targets = [cont[:, 1:].reshape(-1)]
    logits, info = {}, {}
    with torch.no_grad():
        full = model(input_ids=batch[:, :-1], use_cache=False, logits_to_keep=args.continuation,
                     kvarn_sim=SimSpec(None, 0)).logits  # positions P .. P+N-1
        base = [full.reshape(-1, full.shape[-1])]
        for preset in args.presets:
            prefilled, rec = _prefill(model, prompt, preset, args.window, args.obs, args.chunk)
            for frac in [None, *args.keep]:
                cache = copy.deepcopy(prefilled)
                if frac is not None and args.select == "recent":
                    _keep_recent(cache, round(frac * args.prompt))
                elif frac is not None:
                    snapkv_compact(cache, rec, round(frac * args.prompt), pool=args.pool, kernel_size=args.kernel_size)
                info[(preset, frac)] = cache.library.seq_len(0)
                logits[(preset, frac)] = [_continue(model, cache, cont).reshape(-1, full.shape[-1])]
                print(f"{preset} keep={frac} done ({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)

    tgt = torch.cat(targets)
    base = torch.cat(base)

    def nll(lg):
        return -torch.log_softmax(lg.double(), -1).gather(-1, tgt[:, None]).squeeze(-1)

    base_nll = nll(base).mean().item()
    results = []
    for preset, frac in configs:
        lg = torch.cat(logits[(preset, frac)])
        ref = torch.cat(logits[(preset, None)])
        m = nll(lg).mean().item()
        results.append({
            "preset": preset, "keep_fraction": frac, "keep": None if frac is None else round(frac * args.prompt),
            "tokens_held_after_compaction": info[(preset, frac)], "ppl": math.exp(m),
            "ppl_rel_vs_uncompacted": math.exp(m - nll(ref).mean().item()) - 1,
            "ppl_rel_vs_unquantized": math.exp(m - base_nll) - 1,
            "top1_agree_uncompacted": (lg.argmax(-1) == ref.argmax(-1)).double().mean().item(),
            "top1_agree_unquantized": (lg.argmax(-1) == base.argmax(-1)).double().mean().item(),
            "top1_accuracy": (lg.argmax(-1) == tgt).double().mean().item(),
        })
    report = {
        "model": args.model, "text": args.text, "windows": len(windows), "prompt": args.prompt,
        "continuation": args.continuation, "tokens_scored": int(tgt.numel()), "window": args.window, "obs": args.obs,
        "select": args.select, "pool": args.pool, "kernel_size": args.kernel_size, "chunk": args.chunk,
        "ppl_unquantized": math.exp(base_nll),
        "top1_accuracy_unquantized": (base.argmax(-1) == tgt).double().mean().item(),
        "results": results, "seconds": round(time.time() - t0, 1),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print(f"{len(windows)} windows: prompt {args.prompt}, {report['tokens_scored']} continuation tokens scored; "
          f"{args.select}; window {args.window}, obs {args.obs}, {args.pool} pool {args.kernel_size}; {report['seconds']}s")
    print(f"unquantized: ppl {report['ppl_unquantized']:.4f}, top-1 accuracy {report['top1_accuracy_unquantized']:.4f}")
    print("| preset | kept | tokens held | ppl | vs uncompacted | vs unquantized | top-1 agree (uncompacted) "
          "| top-1 agree (unquantized) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        kept = "all (no compaction)" if r["keep_fraction"] is None else f"{r['keep_fraction']:.0%} ({r['keep']})"
        print(f"| {r['preset']} | {kept} | {r['tokens_held_after_compaction']} | {r['ppl']:.4f} | "
              f"{100 * r['ppl_rel_vs_uncompacted']:+.2f}% | {100 * r['ppl_rel_vs_unquantized']:+.2f}% | "
              f"{100 * r['top1_agree_uncompacted']:.2f}% | {100 * r['top1_agree_unquantized']:.2f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
