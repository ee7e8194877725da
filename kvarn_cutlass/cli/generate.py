"""``kvarn-cutlass generate``: greedy generation with a KVarN cache, plus agreement with the
unquantized cache (fraction of identical greedy tokens; with --teacher-forced also the fraction of
steps where the quantized model, fed the unquantized continuation, picks the same next token).

On CUDA the quantized run decodes from one CUDA graph per prompt (``kvarn_cutlass.hf.generate.static_greedy``:
the whole model step captured once and replayed per token, no host sync per token; the same tokens as
eager decoding); --no-graph decodes it eagerly, one forward pass per token. On the CPU it is always eager."""

from __future__ import annotations

import argparse
import json
import sys

from ..presets import PRESETS, QUANTIZERS
from .argtypes import (existing_dir, existing_file, non_empty, non_negative_int, positive_int, read_text_file,
                       resolve_device)
from .progress import Progress

NAME = "generate"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help="greedy generation with a KVarN cache and agreement vs unquantized",
                              description=__doc__)
    p.add_argument("--model", required=True, type=existing_dir, metavar="DIR", help="Hugging Face model directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", type=non_empty, help="prompt text")
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
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto (default): cuda if torch sees a CUDA device, else cpu")
    p.add_argument("--dtype", default="auto",
                   help="model dtype: auto (default: float32 on CPU, float16 on CUDA), float32, float16 or bfloat16")
    p.add_argument("--cache-dtype", choices=("float16", "bfloat16"), default="float16",
                   help="dtype of the window and sink tokens (default float16)")
    p.add_argument("--cpu-attention", choices=("reference", "dequant"), default="reference",
                   help="CPU attention: float64 reference (default) or tiles decoded once + float32 SDPA (faster)")
    p.add_argument("--teacher-forced", action="store_true", help="also report teacher-forced agreement")
    p.add_argument("--no-graph", action="store_true",
                   help="on CUDA, decode the quantized run eagerly instead of replaying one CUDA graph per token")
    p.add_argument("--no-progress", action="store_true", help="no progress display on stderr")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def _check_cache_args(args: argparse.Namespace) -> None:
    """Preset, window, sink and quantizer checked by the library cache itself (a tiny CPU probe),
    before the model loads; the head count and head_dim are the model's, checked after."""
    import torch

    from ..cache import KVarNCache

    KVarNCache(1, 1, 1, 128, preset=args.preset, window=args.window, sink_tokens=args.sink,
               dtype=getattr(torch, args.cache_dtype), quantizer=args.quantizer)


def _no_tiles_note(res: dict, args: argparse.Namespace) -> str:
    """What the agreement means when some runs never quantized a token ("" when every run did)."""
    n = res["prompts_without_tiles"]
    if n == 0:
        return ""
    which = "no prompt" if n == res["prompts"] else f"{n} of {res['prompts']} prompts"
    return (f"; {which} reached a quantized tile (prompt + {args.max_new_tokens} new tokens never exceeded the "
            f"window {args.window}{f' + sink {args.sink}' if args.sink else ''}), so the quantized run read only exact "
            "keys/values there and its agreement says nothing about the quantization: use a longer prompt, more "
            "--max-new-tokens or a smaller --window")


def run(args: argparse.Namespace) -> int:
    import torch

    device = resolve_device(args.device)
    _check_cache_args(args)
    text = read_text_file(args.prompts_from, "--prompts-from") if args.prompts_from else None

    from ..hf._compat import load_model
    from ..hf.generate import agreement, kvarn_cache_factory, prompts_from_text

    model, tok = load_model(args.model, device, args.dtype)
    if args.prompt is not None:
        prompts = [tok(args.prompt, return_tensors="pt").input_ids[0]]
        if prompts[0].numel() == 0:
            raise ValueError(f"--prompt {args.prompt!r} gives no tokens")
    else:
        prompts = prompts_from_text(tok, text, args.num_prompts, args.prompt_tokens)
    graph = device == "cuda" and not args.no_graph
    # A graph captures the cache's buffers, so they are allocated for the longest generation up front; eager
    # runs get the same capacity, so that the decode kernel's split grid (sized from it) and the tokens are the same.
    factory = kvarn_cache_factory(model, preset=args.preset, quantizer=args.quantizer, window=args.window,
                                  sink_tokens=args.sink, dtype=getattr(torch, args.cache_dtype),
                                  cpu_attention=args.cpu_attention,
                                  max_seq_len=max(p.numel() for p in prompts) + args.max_new_tokens)
    passes = 3 if args.teacher_forced else 2  # unquantized, quantized (, teacher-forced)
    per_prompt = passes * args.max_new_tokens
    with Progress(len(prompts) * per_prompt, "generate", unit="tok", enabled=not args.no_progress) as progress:
        def step() -> None:
            done = progress.done + 1
            progress.step(note=f"prompt {done // per_prompt}/{len(prompts)} done" if done % per_prompt == 0 else None)

        res = agreement(model, prompts, args.max_new_tokens, factory, args.chunk, teacher_forced=args.teacher_forced,
                        progress=step, graph=graph)
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
    print(f"{args.preset} window={args.window}, {res['decode']} decode: {res['prompts']} prompt(s) x {args.max_new_tokens} tokens, identical "
          f"greedy tokens vs unquantized {100 * res['identical']:.1f}%{tf} ({res['seconds']:.1f}s)"
          f"{_no_tiles_note(res, args)}", file=sys.stderr)
    return 0
