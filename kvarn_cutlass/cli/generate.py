"""``kvarn-cutlass generate``: greedy generation with a KVarN cache, plus agreement with the
unquantized cache (fraction of identical greedy tokens; with --teacher-forced also the fraction of
steps where the quantized model, fed the unquantized continuation, picks the same next token)."""

from __future__ import annotations

import argparse
import json
import sys

from ..presets import PRESETS, QUANTIZERS
from .argtypes import existing_dir, existing_file, non_negative_int, positive_int, resolve_device

NAME = "generate"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help="greedy generation with a KVarN cache and agreement vs unquantized",
                              description=__doc__)
    p.add_argument("--model", required=True, type=existing_dir, metavar="DIR", help="Hugging Face model directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompts-from", metavar="FILE", type=existing_file,
                     help="take --num-prompts prompts of --prompt-tokens tokens at evenly spaced offsets of FILE")
    p.add_argument("--num-prompts", type=positive_int, default=8, help="with --prompts-from (default 8)")
    p.add_argument("--prompt-tokens", type=positive_int, default=1024, help="with --prompts-from (default 1024)")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--preset", choices=tuple(PRESETS), default="k4v2_g128", help="tile preset (default k4v2_g128)")
    p.add_argument("--quantizer", choices=QUANTIZERS, default="uniform",
                   help="code values: uniform (asymmetric RTN, default) or lloyd_max (Gaussian codebook)")
    p.add_argument("--window", type=positive_int, default=256, help="fp16 window in tokens (default 256)")
    p.add_argument("--sink", type=non_negative_int, default=0, help="leading tokens kept unquantized (default 0)")
    p.add_argument("--chunk", type=positive_int, default=512, help="prefill chunk size (default 512)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda if available")
    p.add_argument("--dtype", default="auto", help="model dtype: auto (float32 on CPU, float16 on CUDA), float16, ...")
    p.add_argument("--cache-dtype", choices=("float16", "bfloat16"), default="float16", help="window/sink dtype")
    p.add_argument("--cpu-attention", choices=("reference", "dequant"), default="reference",
                   help="CPU attention: float64 reference (default) or tiles decoded once + float32 SDPA (faster)")
    p.add_argument("--teacher-forced", action="store_true", help="also report teacher-forced agreement")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def run(args: argparse.Namespace) -> int:
    import torch

    from ..hf._compat import load_model
    from ..hf.generate import agreement, kvarn_cache_factory, prompts_from_text

    device = resolve_device(args.device)
    model, tok = load_model(args.model, device, args.dtype)
    factory = kvarn_cache_factory(model, preset=args.preset, quantizer=args.quantizer, window=args.window,
                                  sink_tokens=args.sink, dtype=getattr(torch, args.cache_dtype), cpu_attention=args.cpu_attention)
    if args.prompt is not None:
        prompts = [tok(args.prompt, return_tensors="pt").input_ids[0]]
    else:
        with open(args.prompts_from, encoding="utf-8") as f:
            prompts = prompts_from_text(tok, f.read(), args.num_prompts, args.prompt_tokens)
    res = agreement(model, prompts, args.max_new_tokens, factory, args.chunk, teacher_forced=args.teacher_forced)
    res.update(model=args.model, preset=args.preset, quantizer=args.quantizer, window=args.window, sink_tokens=args.sink, device=device)
    if args.json:
        json.dump(res, sys.stdout, indent=2)
        print()
        return 0
    if args.prompt is not None:
        row = res["per_prompt"][0]
        print(args.prompt + tok.decode(row["quantized_tokens"]))
        print("---", file=sys.stderr)
    tf = f", teacher-forced {100 * res['teacher_forced']:.1f}%" if args.teacher_forced else ""
    print(f"{args.preset} window={args.window}: {res['prompts']} prompt(s) x {args.max_new_tokens} tokens, identical "
          f"greedy tokens vs unquantized {100 * res['identical']:.1f}%{tf} ({res['seconds']:.1f}s)", file=sys.stderr)
    return 0
