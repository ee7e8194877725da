"""``kvarn-cutlass perplexity``: teacher-forced perplexity with a KVarN cache vs the unquantized cache.

Each scored position sees the cache as it would at decode time (``--view decode``, default): keys
older than the window are read from their quantized tiles. ``--window 0``: no window (every complete
tile quantized, the newest incomplete tile exact). For the usual "quantize the whole KV cache"
number, the one docs/accuracy.md gives as expected values, add ``--view prefill``: every position
then sees the cache holding the whole text window (``--ctx`` tokens). See
``kvarn_cutlass.hf.perplexity`` for the methods and ``docs/accuracy.md`` for measured numbers.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..presets import PRESETS, QUANTIZERS
from .argtypes import (existing_dir, existing_file, int_at_least, non_negative_int, positive_int, read_text_file,
                       resolve_device)

NAME = "perplexity"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help="teacher-forced perplexity of a HF model with a KVarN cache vs unquantized",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=existing_dir, metavar="DIR", help="Hugging Face model directory (Llama/Qwen-style decoder)")
    p.add_argument("--text", required=True, type=existing_file, metavar="FILE", help="UTF-8 text file; tokenized whole, split into ctx-token windows")
    p.add_argument("--ctx", type=int_at_least(2), default=2048, help="tokens per window (default 2048)")
    p.add_argument("--windows", type=positive_int, default=None, help="first K windows (default: all complete windows)")
    p.add_argument("--preset", choices=tuple(PRESETS), default="k4v2_g128", help="tile preset (default k4v2_g128)")
    p.add_argument("--quantizer", choices=QUANTIZERS, default="uniform",
                   help="how tile values are coded: uniform (asymmetric round-to-nearest, default) or lloyd_max "
                        "(nearest Lloyd-Max centroid of N(0,1) after per-axis mean/RMS normalization)")
    p.add_argument("--window", type=non_negative_int, default=256, help="fp16 window in tokens; 0 = no window (default 256)")
    p.add_argument("--sink", type=non_negative_int, default=0, help="leading tokens kept unquantized (default 0)")
    p.add_argument("--view", choices=("decode", "prefill"), default="decode",
                   help="decode (default): position p sees the cache as decode does when it holds p+1 tokens; "
                        "prefill: every position sees the cache holding the whole text window (--ctx tokens), "
                        "the usual quantize-everything evaluation (with --window 0: the expected values of "
                        "docs/accuracy.md)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto (default): cuda if torch sees a CUDA device, else cpu")
    p.add_argument("--method", choices=("auto", "sim", "decode", "prefill"), default="auto",
                   help="auto (default): sim on CPU, with --window 0 or with --view prefill, else decode; "
                        "sim: one-pass simulation; decode: token by token through the cache (GPU decode kernel "
                        "on CUDA); prefill: chunked prefill semantics")
    p.add_argument("--chunk", type=positive_int, default=512,
                   help="chunk size of --method prefill, query block of --method sim (default 512)")
    p.add_argument("--batch", type=positive_int, default=2, help="windows per forward pass (simulation) or per decode batch (default 2)")
    p.add_argument("--dtype", default="auto",
                   help="model dtype: auto (default: float32 on CPU, float16 on CUDA), float32, float16 or bfloat16")
    p.add_argument("--cache-dtype", choices=("float16", "bfloat16"), default="float16",
                   help="dtype of the window and sink tokens (default float16)")
    p.add_argument("--no-baseline", action="store_true", help="skip the unquantized baseline")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def run(args: argparse.Namespace) -> int:
    import torch

    from ..hf import SimSpec
    from ..hf._compat import load_model
    from ..hf.perplexity import evaluate, token_windows

    device = resolve_device(args.device)
    method = args.method
    if method == "auto":
        method = "sim" if device == "cpu" or args.window == 0 or args.view == "prefill" else "decode"
    if args.window == 0 and method != "sim":
        raise ValueError(f"--window 0 (no window) exists only in the simulation, not with --method {method}: "
                         "use --method sim (or auto)")
    cache_dtype = getattr(torch, args.cache_dtype)
    spec = SimSpec(args.preset, args.window, args.sink, dtype=cache_dtype, view=args.view, block=args.chunk,
                   quantizer=args.quantizer)
    text = read_text_file(args.text, "--text")
    model, tok = load_model(args.model, device, args.dtype)
    windows = token_windows(tok, text, args.ctx, args.windows)
    res = evaluate(model, windows, [spec], method=method, chunk=args.chunk, baseline=not args.no_baseline,
                   progress=not args.no_progress, batch_size=args.batch)
    q = res["results"][0]
    report = {
        "model": args.model, "text": args.text, "ctx": args.ctx, "windows": len(windows),
        "tokens_scored": res["tokens_scored"], "device": device, "method": method,
        "model_dtype": str(model.dtype).replace("torch.", ""), "cache_dtype": args.cache_dtype,
        "preset": args.preset, "quantizer": args.quantizer, "window": args.window, "sink_tokens": args.sink, "view": args.view,
        "ppl": q["ppl"], "nll": q["nll"], "buckets": q["buckets"], "seconds": round(res["seconds"], 2),
    }
    if res["baseline"] is not None:
        report.update(ppl_baseline=q["ppl_baseline"], nll_baseline=q["nll_baseline"],
                      ppl_rel_increase=q["ppl_rel_increase"])
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    print(f"{args.model}: {len(windows)} windows x {args.ctx} tokens ({res['tokens_scored']} scored), "
          f"{device}/{method}, {res['seconds']:.1f}s")
    label = f"{args.preset} {args.quantizer} window={args.window or 'none'}" + (f" sink={args.sink}" if args.sink else "")
    heads = ["ppl"] + [f"[{a},{b})" for a, b in (bk["positions"] for bk in q["buckets"])]
    print(f"{'':36s}" + "".join(f"{h:>14s}" for h in heads))
    if res["baseline"] is not None:
        vals = [q["ppl_baseline"]] + [bk["ppl_baseline"] for bk in q["buckets"]]
        print(f"{'unquantized':36s}" + "".join(f"{v:14.4f}" for v in vals))
    vals = [q["ppl"]] + [bk["ppl"] for bk in q["buckets"]]
    extra = f"  ({100 * q['ppl_rel_increase']:+.2f}%)" if res["baseline"] is not None else ""
    print(f"{label:36s}" + "".join(f"{v:14.4f}" for v in vals) + extra)
    return 0
