"""``kvarn-cutlass demo``: the main job on a fresh machine, with no arguments.

Builds a KVarN cache from realistic K/V, prefills it in chunks and decodes a few tokens, then
reports:

* accuracy: the attention outputs against float64 attention over the unquantized fp16 K/V (the
  quantization error), and the kernels against ``kvarn_cutlass.reference`` (float64) over the same
  quantized cache (the kernels' own error), with the share of attention that falls on quantized
  tokens (the rest reads the exact fp16 window);
* memory: the cache's bytes against an fp16 cache of the same tokens;
* speed (CUDA): decode step (CUDA-graph replay, the product path, and eager) and the whole chunked
  prefill against torch SDPA over an fp16 cache; CUDA events, warm-up, median.

K/V/Q come from a built-in generator (post-RoPE keys with outlier channels, a positional component
that RoPE turns into recency bias, queries that retrieve recent and distant keys by content; its
attention statistics are close to those of a trained model's: ~80% of the mass on the newest 256
tokens, top key ~0.3) or, with ``--model DIR``, from every attention layer of a transformers model
run over a text (default: this package's own Python sources).

On CUDA the cache compresses on the GPU, prefill runs ``kvarn_cutlass.prefill_attention`` (the fused
kernel) and decode ``kvarn_cutlass.DecodeGraph`` (split-tile kernels in a CUDA graph).
On a CPU-only machine the same pipeline runs through the CPU paths (prefill's torch path,
float64 reference decode), and the fused prefill kernel that an sm_90 GPU would run for the same
shape is built meanwhile with NVRTC (in a thread: NVRTC releases the GIL, so it overlaps the CPU
pipeline; ~6 s cold on a 2-core machine) or read from the kernel cache, and reported with its
resources. ``--no-compile`` skips it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ..presets import PRESETS
from .argtypes import existing_dir, existing_file, int_at_least, positive_int, read_text_file, resolve_device

NAME = "demo"
CPU_TOKENS, GPU_TOKENS = 2048, 32768
CPU_HEADS, GPU_HEADS = (8, 2), (32, 8)  # (q, KV): kvarn-ref-lm's on CPU (fast), Qwen3-8B's on CUDA
HEAD_DIM = 128
ROPE_THETA = 1e6


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help="end-to-end demo: quantized cache, prefill, decode, accuracy, memory, speed",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto (default): cuda if torch sees a CUDA device, else cpu")
    p.add_argument("--model", type=existing_dir, default=None, metavar="DIR",
                   help="take Q/K/V from every attention layer of this transformers model instead of the generator")
    p.add_argument("--text", type=existing_file, default=None, metavar="FILE",
                   help="with --model: UTF-8 text to run through it (default: this package's Python sources)")
    p.add_argument("--tokens", type=int_at_least(2), default=None,
                   help=f"context length (default {CPU_TOKENS} on CPU, {GPU_TOKENS} on CUDA; with --model at most "
                        "its max_position_embeddings)")
    p.add_argument("--chunk", type=positive_int, default=512, help="prefill chunk size (default 512)")
    p.add_argument("--decode-steps", type=positive_int, default=4, help="tokens decoded after the prefill (default 4)")
    p.add_argument("--preset", choices=tuple(PRESETS), default="k4v2_g128", help="tile preset (default k4v2_g128)")
    p.add_argument("--window", type=positive_int, default=256,
                   help="fp16 window in tokens, a multiple of the tile size (default 256)")
    p.add_argument("--no-compile", action="store_true",
                   help="CPU: skip building the fused prefill kernel for sm_90 (NVRTC)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON document")
    return p


# --- inputs ---------------------------------------------------------------------------------------
def rope(x, positions, theta: float = ROPE_THETA):
    """Rotary embedding of x [..., n, D] (float32) at integer ``positions`` [n], pairs (2i, 2i+1)."""
    import torch

    D = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = positions.to(torch.float64)[:, None] * inv_freq
    cos, sin = torch.cos(ang).float(), torch.sin(ang).float()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)


def realistic_qkv(num_q_heads: int, num_kv_heads: int, n: int, head_dim: int, generator):
    """Post-RoPE q [1, Hq, n, D], k, v [1, Hkv, n, D] float32 with a trained model's attention structure.

    Pre-RoPE keys are a per-head positional vector (in the high- and mid-frequency rotary pairs) plus
    per-token content (with 1/16 of the channels 4x larger: outlier channels). Queries carry the same
    positional vector, which RoPE turns into a score that is largest at distance 0 and decays with
    distance (recency bias), plus the content of a target key in the low-frequency pairs, which RoPE
    hardly rotates over the context (content retrieval): 70% of the targets are among the 63 previous
    tokens, 30% anywhere before. Values: Gaussian with a small per-head offset. Constants chosen so
    that, at n = 2048, the newest 256 tokens get ~0.8 of the attention and the top key ~0.3, |q| and
    |k| ~ 12-15, as in kvarn-ref-lm's layers 1-5 over code (layer 0 is flatter).
    """
    import torch

    g, D, P = generator, head_dim, head_dim // 2
    group = num_q_heads // num_kv_heads
    content_pairs = torch.arange(P) >= int(0.6 * P)  # the 40% lowest-frequency pairs
    content_chan = content_pairs.repeat_interleave(2)
    chan_scale = torch.ones(D)
    chan_scale[torch.randperm(D, generator=g)[: max(1, D // 16)]] = 4.0
    content = 0.5 * torch.randn(1, num_kv_heads, n, D, generator=g) * chan_scale
    positional = 1.2 * torch.randn(1, num_kv_heads, 1, D, generator=g) * ~content_chan
    pos = torch.arange(n)
    recent = (pos - torch.randint(1, 64, (n,), generator=g)).clamp_min(0)
    anywhere = (torch.rand(n, generator=g) * (pos + 1)).long()
    target = torch.where(torch.rand(n, generator=g) < 0.3, anywhere, recent)
    q_pre = (positional + 2.0 * content[:, :, target] * content_chan).repeat_interleave(group, 1)
    q_pre = q_pre + 0.5 * torch.randn(1, num_q_heads, n, D, generator=g)
    k = rope(positional + content, pos)
    q = rope(q_pre, pos)
    v = torch.randn(1, num_kv_heads, n, D, generator=g) + 0.3 * torch.randn(1, num_kv_heads, 1, D, generator=g)
    return q, k, v


def _package_text() -> str:
    """This package's Python sources, concatenated in a fixed order (real code, always installed)."""
    root = Path(__file__).resolve().parents[1]
    return "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(root.rglob("*.py")))


def model_qkv(model_dir: str, n: int | None, text: str | None, device: str):
    """Q/K/V of every attention layer of a transformers model over ``text``'s first n tokens.

    Returns (layers, n, info): layers is a list of (q [1, Hq, n, D], k, v [1, Hkv, n, D] float32 on
    the CPU, post-RoPE, softmax scale), captured through a registered attention function.
    """
    import torch
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    body = _package_text() if text is None else read_text_file(text, "--text")  # a bad file fails before loading
    config = AutoConfig.from_pretrained(model_dir)
    max_pos = getattr(config, "max_position_embeddings", None)
    if n is None:
        n = min(CPU_TOKENS if device == "cpu" else GPU_TOKENS, max_pos or GPU_TOKENS)
    elif max_pos and n > max_pos:
        raise ValueError(f"--tokens {n} exceeds the model's max_position_embeddings {max_pos}")
    captured: dict[int, tuple] = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        scale = kwargs.get("scaling") or getattr(module, "scaling", None) or query.shape[-1] ** -0.5
        captured[module.layer_idx] = (query.detach().float().cpu(), key.detach().float().cpu(),
                                      value.detach().float().cpu(), float(scale))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("kvarn_demo_capture", capture)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="kvarn_demo_capture")
    model.to(device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):  # no tokenizer files: random ids still give the model's K/V statistics
        tokenizer = None
    if tokenizer is not None:
        source = "the kvarn_cutlass package's Python sources" if text is None else text
        ids = tokenizer(body, add_special_tokens=False, return_tensors="pt").input_ids[:, :n]
        if ids.shape[1] < n:
            raise ValueError(f"the text gives {ids.shape[1]} tokens, fewer than --tokens {n}")
    else:
        source = "random token ids (the model directory has no tokenizer)"
        ids = torch.randint(0, config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids.to(device), use_cache=False, logits_to_keep=1)
    layers = [captured[i] for i in sorted(captured)]
    return layers, n, {"model": model_dir, "text": source, "layers": len(layers)}


# --- accuracy ---------------------------------------------------------------------------------------
def exact_attention(q, k, v, scale: float):
    """Float64 causal attention of the newest n_q queries q [B, Hq, n_q, D] over k, v [B, Hkv, L, D]
    (GQA), on q's device. Returns (out [B, Hq, n_q, D], probabilities [B, Hq, n_q, L]) in float64."""
    import torch

    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    n_q, L = q.shape[2], k.shape[2]
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k) * scale
    future = torch.arange(L, device=k.device)[None, :] > torch.arange(L - n_q, L, device=k.device)[:, None]
    p = torch.softmax(s.masked_fill(future, -math.inf), -1)
    return p @ v, p


def rel_error(a, b) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.to(a.device).double()
    return float((a - b).norm() / b.norm())


def _quantized_mass(p, cache, layer: int) -> float:
    """Mean share of attention probability p [..., L] on the tokens ``cache`` holds as tiles."""
    lo, hi = cache.positions(layer)["tiles"]
    return float(p[..., lo:hi].sum(-1).mean())


# --- the fused prefill kernel for sm_90, built on CPU machines -------------------------------------------------
def demo_prefill_spec(preset: str, head_dim: int):
    """(KernelSpec, FusedConfig) of the fused prefill kernel that ``prefill_attention`` runs on an sm_90 GPU
    for the demo's cache (``preset``, ``head_dim``, uniform quantizer, float16 scales, cache and queries):
    the config tuned for its bucket in ``gemm_configs/prefill_sm90.json``, else the default."""
    import warnings

    import torch

    from ..format import TileSpec
    from ..ops.prefill import UntunedPrefillConfigWarning, fused_spec, select_config

    spec = TileSpec(preset, head_dim)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UntunedPrefillConfigWarning)  # the default config is what would run
        config = select_config(spec, "sm90")
    return fused_spec(spec, torch.float16, torch.float16, config), config


def build_prefill_kernel(preset: str, head_dim: int) -> dict:
    """Build (or read from the kernel cache) the kernel of :func:`demo_prefill_spec` for sm_90 with NVRTC.

    Returns ``status`` ``compiled`` or ``cached`` with the module, config, wall seconds of this call, the
    seconds of the compile that made the cache entry, registers, spill stores and dynamic shared memory;
    or ``status`` ``failed`` with the error's first line (the demo reports it and goes on)."""
    from ..ops.prefill import KERNEL_SYMBOL, smem_bytes
    from ..runtime import spec as runtime_spec

    t0 = time.perf_counter()
    try:
        kspec, config = demo_prefill_spec(preset, head_dim)
        compiled = runtime_spec.build(kspec, "sm90")
    except Exception as e:  # no NVRTC, a compile error: the CPU demo's figures still stand
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return {"status": "failed", "error": f"{type(e).__name__}: {first}"}
    res = compiled.resources[KERNEL_SYMBOL]
    return {"status": "cached" if compiled.cached else "compiled", "module": kspec.name, "config": config.name,
            "target": compiled.target, "seconds": round(time.perf_counter() - t0, 1),
            "compile_seconds": round(compiled.compile_seconds, 1), "registers": res.registers,
            "spill_store_bytes": res.spill_store_bytes, "dynamic_smem_bytes": smem_bytes(compiled.cubin)}


# --- the pipeline ---------------------------------------------------------------------------------------
def _run_pipeline(layers, n: int, args, device: str) -> tuple[dict, object, list]:
    """Chunked prefill then ``args.decode_steps`` decode steps of every layer through one KVarNCache.

    layers: [(q [1, Hq, n, D], k [1, Hkv, n, D], v, scale)] float32 on the CPU. Returns (accuracy
    record, the cache, fp16 copies on ``device`` [(q16, k16, v16, scale)]).
    """
    import torch

    import kvarn_cutlass as kc

    on_gpu = device == "cuda"
    n_decode = args.decode_steps
    n_prefill = n - n_decode
    _, Hkv, _, D = layers[0][1].shape
    Hq = layers[0][0].shape[1]
    dev16 = [(q.to(device, torch.float16), k.to(device, torch.float16), v.to(device, torch.float16), s)
             for q, k, v, s in layers]
    cache = kc.KVarNCache(len(layers), 1, Hkv, D, preset=args.preset, window=args.window, device=device,
                          max_seq_len=n)
    acc: dict = {"prefill": [], "decode": []}
    for start in range(0, n_prefill, args.chunk):
        stop = min(start + args.chunk, n_prefill)
        for i, (q16, k16, v16, scale) in enumerate(dev16):
            chunk = (q16[:, :, start:stop], k16[:, :, start:stop], v16[:, :, start:stop])
            if stop < n_prefill:
                if on_gpu:  # attention + append; on the CPU only the checked last chunk runs the torch path
                    kc.prefill_attention(*chunk, cache, i, scale)
                else:
                    cache.append(i, chunk[1], chunk[2])
                continue
            exact, p = exact_attention(chunk[0], k16[:, :, :n_prefill], v16[:, :, :n_prefill], scale)
            ref = kc.reference.attention(chunk[0], cache, i, scale, k=chunk[1], v=chunk[2])
            share = _quantized_mass(p, cache, i)  # before the append: the tiles this chunk reads
            out = kc.prefill_attention(*chunk, cache, i, scale)
            acc["prefill"].append({"vs_exact": rel_error(out, exact), "vs_reference": rel_error(out, ref),
                                   "reference_vs_exact": rel_error(ref, exact), "quantized_attention_share": share})
            del exact, p, ref
    graphs = ([kc.DecodeGraph(cache, i, Hq, torch.float16, scale) for i, (_, _, _, scale) in enumerate(dev16)]
              if on_gpu else None)
    steps = [[] for _ in dev16]
    for t in range(n_prefill, n):
        for i, (q16, k16, v16, scale) in enumerate(dev16):
            cache.append(i, k16[:, :, t : t + 1], v16[:, :, t : t + 1])
            q_tok = q16[:, :, t : t + 1]
            ref = kc.reference.attention(q_tok, cache, i, scale)
            out = graphs[i].replay(q_tok).clone() if on_gpu else ref
            exact, p = exact_attention(q_tok, k16[:, :, : t + 1], v16[:, :, : t + 1], scale)
            steps[i].append({"vs_exact": rel_error(out, exact), "vs_reference": rel_error(out, ref) if on_gpu else None,
                             "quantized_attention_share": _quantized_mass(p, cache, i)})
    for layer_steps in steps:
        acc["decode"].append({
            "vs_exact": max(s["vs_exact"] for s in layer_steps),
            "vs_reference": max(s["vs_reference"] for s in layer_steps) if on_gpu else None,
            "quantized_attention_share": sum(s["quantized_attention_share"] for s in layer_steps) / len(layer_steps),
        })
    return acc, cache, dev16


def _summarize(per_layer: list[dict]) -> dict:
    """Worst layer of each error, mean quantized share; per-layer values kept when several layers."""
    out = {}
    for key in ("vs_exact", "vs_reference", "reference_vs_exact"):
        if key in per_layer[0]:  # None where there is nothing to compare (the CPU decode is the reference)
            vals = [r[key] for r in per_layer if r[key] is not None]
            out[f"{key}_max"] = max(vals) if vals else None
    out["quantized_attention_share"] = sum(r["quantized_attention_share"] for r in per_layer) / len(per_layer)
    if len(per_layer) > 1:
        out["per_layer"] = per_layer
    return out


# --- speed (CUDA) -----------------------------------------------------------------------------------------
def _gpu_speed(args, q16, k16, v16, scale: float) -> dict:
    """Layer-0 timings on CUDA: CUDA events, warm-up, median (see :func:`_time_decode`, :func:`_time_prefill`)."""
    return {"decode": _time_decode(args, q16, k16, v16, scale), "prefill": _time_prefill(args, q16, k16, v16, scale),
            "method": "CUDA events, warm-up, median (decode 200 runs, prefill 3 prompts)"}


def _time_decode(args, q16, k16, v16, scale: float) -> dict:
    """One decode step at the full context: CUDA-graph replay (the product path) and eager, against
    ``F.scaled_dot_product_attention(..., enable_gqa=True)`` over the fp16 K/V. Inputs rotate (KVarN:
    layers holding the same K/V; SDPA: copies of the K/V) so that L2 does not serve repeated reads."""
    import torch
    import torch.nn.functional as F

    import kvarn_cutlass as kc

    from ..bench.timing import rotation_count, time_cuda
    from ..decode import get_plan

    n, Hkv, D = k16.shape[2], k16.shape[1], k16.shape[3]
    q1 = q16[:, :, n - 1 : n].contiguous()
    spec = kc.TileSpec(args.preset, D)
    tile_bytes = Hkv * max(1, math.ceil((n - args.window) / spec.tile_tokens)) * spec.tile_nbytes
    rot = min(8, rotation_count(tile_bytes))
    cache = kc.KVarNCache(rot, 1, Hkv, D, preset=args.preset, window=args.window, device="cuda", max_seq_len=n)
    for layer in range(rot):
        for s in range(0, n, 8192):
            cache.append(layer, k16[:, :, s : s + 8192], v16[:, :, s : s + 8192])
    plan = get_plan(cache)
    plan.refresh()
    outs = [torch.empty_like(q1) for _ in range(rot)]
    graph = time_cuda(lambda i: plan.launch(q1, i, outs[i], scale), inputs=range(rot), graph=True, warmup=20, runs=200)
    turn = [0]

    def eager():
        turn[0] = (turn[0] + 1) % rot
        kc.decode_attention(q1, cache, turn[0], scale, out=outs[turn[0]])

    eager_t = time_cuda(eager, warmup=20, runs=200)
    kv_bytes = 2 * k16.numel() * k16.element_size()
    sets = [(k16, v16)] + [(k16.clone(), v16.clone()) for _ in range(min(8, rotation_count(kv_bytes)) - 1)]
    def sdpa_call(kv):
        return F.scaled_dot_product_attention(q1, kv[0], kv[1], scale=scale, enable_gqa=True)

    sdpa = time_cuda(sdpa_call, inputs=sets, warmup=20, runs=200)
    res = {"kvarn_graph_us": round(graph.median_us, 2), "kvarn_eager_us": round(eager_t.median_us, 2),
           "sdpa_fp16_us": round(sdpa.median_us, 2), "sdpa_over_kvarn_graph": round(sdpa.median_us / graph.median_us, 2),
           "rotated_sets": rot}
    # Eager SDPA at batch 1 is bound by host launch time; replayed from a CUDA graph, as KVarN is above,
    # it shows its GPU time (the like-for-like comparison, docs/perf-notes.md).
    try:
        sdpa_graph = time_cuda(sdpa_call, inputs=sets, warmup=20, runs=200, graph=True)
    except Exception as e:  # noqa: BLE001 - a backend that cannot be captured: report why, keep the rest
        res["sdpa_fp16_graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    else:
        res["sdpa_fp16_graph_us"] = round(sdpa_graph.median_us, 2)
        res["sdpa_graph_over_kvarn_graph"] = round(sdpa_graph.median_us / graph.median_us, 2)
    return res


def _time_prefill(args, q16, k16, v16, scale: float) -> dict:
    """The whole prompt's attention (``prefill_attention`` per chunk; the compression, which runs in
    ``cache.append``, timed apart) against flash SDPA over the fp16 K/V with a causal lower-right mask
    per chunk; one warm-up prompt, median of 3."""
    import statistics

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    import kvarn_cutlass as kc
    from kvarn_cutlass.bench.timing import elapsed_ms

    n, Hkv, D = k16.shape[2], k16.shape[1], k16.shape[3]
    group = q16.shape[1] // Hkv
    chunks = [(s, min(args.chunk, n - s)) for s in range(0, n, args.chunk)]

    def kvarn_prompt() -> float:
        """The whole prompt, attention and append (compression) of every chunk, one sync at the end."""
        cache = kc.KVarNCache(1, 1, Hkv, D, preset=args.preset, window=args.window, device="cuda", max_seq_len=n)

        def run() -> None:
            for s, m in chunks:
                kc.prefill_attention(q16[:, :, s : s + m], k16[:, :, s : s + m], v16[:, :, s : s + m], cache, 0, scale)

        with cache.deferred_checks():  # the appends' checks read back once, after the timed region
            return elapsed_ms(run)

    kk = k16.repeat_interleave(group, 1)  # flash SDPA needs equal head counts; the fp16 cache holds all tokens
    vv = v16.repeat_interleave(group, 1)

    def sdpa_prompt() -> float:
        """Flash SDPA over an fp16 cache, each chunk against every earlier token (causal lower right)."""

        def run() -> None:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                for s, m in chunks:
                    F.scaled_dot_product_attention(q16[:, :, s : s + m], kk[:, :, : s + m], vv[:, :, : s + m],
                                                   attn_mask=causal_lower_right(m, s + m), scale=scale)

        return elapsed_ms(run)

    kvarn_prompt(), sdpa_prompt()  # warm-up: kernel builds and loads
    kvarn_ms = statistics.median(kvarn_prompt() for _ in range(3))
    sdpa_ms = statistics.median(sdpa_prompt() for _ in range(3))
    return {"kvarn_prompt_ms": round(kvarn_ms, 3), "sdpa_flash_fp16_ms": round(sdpa_ms, 3),
            "kvarn_over_sdpa": round(kvarn_ms / sdpa_ms, 2), "chunks": len(chunks)}


# --- the command ------------------------------------------------------------------------------------------
def _validate(args, n: int | None) -> None:
    T = PRESETS[args.preset][2]
    if args.window % T:
        raise ValueError(f"--window must be a multiple of the tile size {T} of {args.preset}, got {args.window}")
    if n is not None and n <= args.decode_steps:
        raise ValueError(f"--tokens ({n}) must exceed --decode-steps ({args.decode_steps})")
    if args.text and not args.model:
        raise ValueError("--text needs --model")


def run(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    import torch

    device = resolve_device(args.device)
    on_gpu = device == "cuda"
    _validate(args, args.tokens)
    Hq, Hkv = GPU_HEADS if on_gpu else CPU_HEADS

    if args.model:
        layers, n, source = model_qkv(args.model, args.tokens, args.text, device)
        _validate(args, n)
    else:
        n = args.tokens or (GPU_TOKENS if on_gpu else CPU_TOKENS)
        q, k, v = realistic_qkv(Hq, Hkv, n, HEAD_DIM, torch.Generator().manual_seed(1234))
        layers = [(q, k, v, HEAD_DIM**-0.5)]
        source = {"generator": "built-in (RoPE recency + content retrieval, outlier channels)", "layers": 1}
    q0, k0 = layers[0][0], layers[0][1]
    build_job: Future | None = None
    # Leaving the block (also by ^C or SIGTERM) waits for the build in flight: an NVRTC call cannot be
    # interrupted, and it takes seconds; its cache entry is written atomically, so it is never left half-made.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvarn-demo-build") as pool:
        if not on_gpu and not args.no_compile:  # started now: it runs on the other core while the pipeline runs
            print("  building the fused prefill kernel for sm_90 with NVRTC in the background (~6 s unless the "
                  "kernel cache has it)", file=sys.stderr, flush=True)
            build_job = pool.submit(build_prefill_kernel, args.preset, k0.shape[3])
        result: dict = {"device": device, "tokens": n, "preset": args.preset, "window": args.window, "chunk": args.chunk,
                        "decode_steps": args.decode_steps, "source": source,
                        "shape": {"layers": len(layers), "batch": 1, "q_heads": q0.shape[1], "kv_heads": k0.shape[1],
                                  "head_dim": k0.shape[3]}}
        if on_gpu:
            result["gpu"] = torch.cuda.get_device_name()
        acc, cache, dev16 = _run_pipeline(layers, n, args, device)
        result["accuracy"] = {"prefill_last_chunk": _summarize(acc["prefill"]), "decode": _summarize(acc["decode"])}
        fp16_bytes = 2 * len(layers) * k0.shape[1] * n * k0.shape[3] * 2
        result["memory"] = {"kvarn_bytes": cache.nbytes(), "fp16_bytes": fp16_bytes,
                            "fp16_over_kvarn": round(fp16_bytes / cache.nbytes(), 2),
                            "tiles_fp16_over_kvarn": round(cache.spec.compression_vs_fp16, 2)}
        if on_gpu:
            q16, k16, v16, scale = dev16[0]
            del cache
            result["speed"] = _gpu_speed(args, q16, k16, v16, scale)
            result["gpu_kernels"] = ("prefill: fused attention kernel (wgmma or mma.sync, by the tuned config); decode: one split-tile int8 "
                                     "tensor-core kernel (partials merged by the last block) in a CUDA graph; "
                                     "compression: GPU kernel in cache.append")
        else:
            result["gpu_kernels"] = ("not run: no CUDA device. The GPU compression, the decode kernels and the "
                                     "prefill kernel need an NVIDIA GPU (sm_80+)")
            result["prefill_kernel_sm90"] = (build_job.result() if build_job is not None
                                             else {"status": "skipped (--no-compile)"})
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        _report(result)
    return 0


def _fmt_err(x) -> str:
    return "-" if x is None else f"{x:.1e}"


def _report(r: dict) -> None:
    s, on_gpu = r["shape"], r["device"] == "cuda"
    src = r["source"]
    what = (f"{src['model']} ({src['layers']} layers) over {src['text']}" if "model" in src
            else "built-in generator K/V/Q (RoPE recency + content retrieval, outlier channels)")
    print(f"kvarn-cutlass demo on {r.get('gpu', r['device'])}: {r['tokens']} tokens, {s['q_heads']} q / {s['kv_heads']} "
          f"KV heads, head_dim {s['head_dim']}, preset {r['preset']}, window {r['window']}, chunk {r['chunk']}")
    print(f"  inputs: {what}")
    a = r["accuracy"]
    pf, dc = a["prefill_last_chunk"], a["decode"]
    worst = " (worst layer)" if s["layers"] > 1 else ""
    print(f"  accuracy, relative error of the attention output{worst}:")
    print("    vs exact float64 attention over the unquantized fp16 K/V (quantization error):")
    print(f"      decode, max of {r['decode_steps']} steps: {_fmt_err(dc['vs_exact_max'])}   "
          f"({100 * dc['quantized_attention_share']:.0f}% of the attention on quantized tokens)")
    print(f"      prefill, last chunk:    {_fmt_err(pf['vs_exact_max'])}   "
          f"({100 * pf['quantized_attention_share']:.0f}% on quantized tokens; the chunk itself is exact)")
    kernels = "GPU kernels" if on_gpu else "CPU prefill pipeline"
    decode_vs_ref = _fmt_err(dc.get("vs_reference_max")) if on_gpu else "- (the CPU decode is the reference)"
    print(f"    {kernels} vs the float64 reference over the same quantized cache: "
          f"prefill {_fmt_err(pf.get('vs_reference_max'))}, decode {decode_vs_ref}")
    m = r["memory"]
    print(f"  memory: {m['kvarn_bytes'] / 2**20:.2f} MiB vs {m['fp16_bytes'] / 2**20:.2f} MiB fp16 "
          f"({m['fp16_over_kvarn']}x smaller; tiles alone {m['tiles_fp16_over_kvarn']}x, the rest is the fp16 window)")
    if on_gpu:
        d, p = r["speed"]["decode"], r["speed"]["prefill"]
        graphed = (f"; CUDA graph {d['sdpa_fp16_graph_us']} us ({d['sdpa_graph_over_kvarn_graph']}x)"
                   if "sdpa_fp16_graph_us" in d else "")
        print(f"  decode step at {r['tokens']} tokens: {d['kvarn_graph_us']} us (CUDA graph; eager "
              f"{d['kvarn_eager_us']} us) vs SDPA fp16 eager {d['sdpa_fp16_us']} us ({d['sdpa_over_kvarn_graph']}x)"
              f"{graphed}")
        print(f"  prefill of the whole prompt, {p['chunks']} chunks (attention and append): {p['kvarn_prompt_ms']} ms "
              f"vs SDPA flash fp16 {p['sdpa_flash_fp16_ms']} ms ({p['kvarn_over_sdpa']}x the SDPA time)")
    else:
        print(f"  GPU: {r['gpu_kernels']}")
        c = r["prefill_kernel_sm90"]
        line = f"  fused prefill kernel for sm_90 (NVRTC): {c['status']}"
        if c["status"] in ("compiled", "cached"):
            how = (f"compiled in {c['compile_seconds']} s" if c["status"] == "compiled"
                   else f"from the kernel cache, compiled earlier in {c['compile_seconds']} s")
            spills = "no spills" if c["spill_store_bytes"] == 0 else f"{c['spill_store_bytes']} B of spill stores"
            line += (f" ({c['module']} for {c['target']}, config {c['config']}; {how}; {c['registers']} registers, {spills}, "
                     f"{c['dynamic_smem_bytes']} B of shared memory)")
        elif c["status"] == "failed":
            line += f" ({c['error']})"
        print(line)
    print(f"  done in {r['seconds']} s")
