"""``kvarn-cutlass demo``: the main job on a fresh machine, with no arguments.

Builds a KVarN cache from realistic K/V (outlier channels and RoPE structure, or captured from a
model given with ``--model DIR``), prefills it in chunks, decodes a few tokens, and reports accuracy
against float64 attention over the unquantized K/V, memory against fp16 and, on a CUDA GPU, speed
against torch SDPA on an fp16 cache. On a CPU-only machine the same pipeline runs through the float64
reference path, and the CUTLASS K-score GEMM is emitted and compiled for sm_90 when nvcc is present.
"""

from __future__ import annotations

import argparse
import json
import math
import time

NAME = "demo"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help="end-to-end demo: quantized cache, prefill, decode, accuracy, memory, speed",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda if available")
    p.add_argument("--model", default=None, help="take K/V/Q from this Hugging Face model's first layer instead")
    p.add_argument("--tokens", type=int, default=None, help="context length (default 2048 on CPU, 32768 on CUDA)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk size (default 512)")
    p.add_argument("--preset", default="k4v2_g128", help="tile preset (default k4v2_g128)")
    p.add_argument("--window", type=int, default=256, help="fp16 window in tokens (default 256)")
    p.add_argument("--no-compile", action="store_true", help="CPU: skip compiling the CUTLASS GEMM for sm_90")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def realistic_kv(batch: int, heads: int, n: int, dim: int, generator, device="cpu"):
    """Post-RoPE-like K and V [batch, heads, n, dim] float32: a few outlier channels in K, rotary
    phases along the sequence, and a slowly drifting V."""
    import torch

    pos = torch.arange(n, dtype=torch.float64)[:, None]
    inv_freq = 1e6 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = pos * inv_freq  # [n, dim/2]
    cos, sin = torch.cos(ang).float(), torch.sin(ang).float()
    base = torch.randn(batch, heads, n, dim, generator=generator)
    chan = torch.ones(dim)
    chan[torch.randperm(dim, generator=generator)[: max(1, dim // 16)]] = 6.0  # outlier channels
    k = base * chan + 2.0 * torch.randn(batch, heads, 1, dim, generator=generator)  # per-head offset
    k1, k2 = k[..., 0::2], k[..., 1::2]
    k = torch.stack((k1 * cos - k2 * sin, k1 * sin + k2 * cos), -1).flatten(-2)
    v = torch.randn(batch, heads, n, dim, generator=generator) + torch.linspace(-1, 1, n)[:, None]
    return k.to(device), v.to(device)


def _exact_attention(q, k, v, scale):
    """Float64 causal attention of the newest n_q queries over full K/V [B, H, L, D] (GQA)."""
    import torch

    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    n_q, L = q.shape[2], k.shape[2]
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k) * scale
    mask = torch.arange(L, device=k.device)[None, :] > torch.arange(L - n_q, L, device=k.device)[:, None]
    return torch.softmax(s.masked_fill(mask, -math.inf), -1) @ v


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _model_qkv(model_dir: str, n: int):
    """Post-RoPE q, k, v [1, heads, n, head_dim] of the model's first attention layer, for the first
    n tokens of random ids, captured through a transformers attention function."""
    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    captured = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx == 0:
            captured.update(q=query.detach(), k=key.detach(), v=value.detach())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("kvarn_demo_capture", capture)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="kvarn_demo_capture")
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, use_cache=False, logits_to_keep=1)
    return captured["q"], captured["k"], captured["v"]


def _compile_gemm_for_sm90() -> dict:
    from ..gemm.compile import build_gemm, nvcc_path

    try:
        nvcc_path()
    except Exception:
        return {"status": "skipped: nvcc not found (a GPU machine compiles it on first use)"}
    from ..gemm.configs import select_config
    import warnings

    from ..gemm.sass import disassemble, summarize

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an untuned bucket falls back to the default config
        cfg = select_config(90, M=4096, N=128, head_dim=128, L=128, out_dtype="f16")
    t0 = time.perf_counter()
    binary = build_gemm(cfg, 90)
    out = {"status": "compiled", "config": cfg.name, "seconds": round(time.perf_counter() - t0, 1)}
    try:
        out.update(summarize(disassemble(binary.cubin), binary.ptxas_log).to_dict())
    except Exception as e:  # no disassembler here: the compile itself is the check
        out["sass"] = f"not summarized ({type(e).__name__}: {e})"
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    import kvarn_cutlass as kc

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device")
    on_gpu = device == "cuda"
    n = args.tokens or (32768 if on_gpu else 2048)
    if n < 2 or args.chunk < 1:
        raise ValueError(f"--tokens must be >= 2 and --chunk >= 1, got {n} and {args.chunk}")
    spec = kc.TileSpec(args.preset, 128)
    g = torch.Generator().manual_seed(1234)
    t_start = time.perf_counter()
    if args.model:
        q_all, k, v = _model_qkv(args.model, n)
        B, Hkv, D = k.shape[0], k.shape[1], k.shape[3]
        Hq = q_all.shape[1]
    else:
        B, Hkv, Hq, D = 1, (8 if on_gpu else 2), (32 if on_gpu else 8), 128
        k, v = realistic_kv(B, Hkv, n, D, g)
        # Queries that look for earlier keys, so that attention is peaked as in trained models.
        targets = torch.randint(0, n, (n,), generator=g)
        q_all = 0.2 * k.repeat_interleave(Hq // Hkv, 1)[:, :, targets] + 0.5 * torch.randn(B, Hq, n, D, generator=g)
    scale = D**-0.5
    k16, v16, q16 = (x.to(device, torch.float16) for x in (k, v, q_all))
    n_decode = 4
    n_prefill = n - n_decode
    cache = kc.KVarNCache(1, B, Hkv, D, preset=args.preset, window=args.window, device=device, max_seq_len=n)
    result = {"device": device, "tokens": n, "preset": args.preset, "window": args.window,
              "shape": {"batch": B, "q_heads": Hq, "kv_heads": Hkv, "head_dim": D}}

    attend_prefill = kc.prefill_attention if on_gpu else (lambda q, c, l: kc.reference.attention(q, c, l))
    attend_decode = kc.decode_attention if on_gpu else (lambda q, c, l: kc.reference.attention(q, c, l))
    last_chunk = None
    for start in range(0, n_prefill, args.chunk):
        stop = min(start + args.chunk, n_prefill)
        cache.append(0, k16[:, :, start:stop], v16[:, :, start:stop])
        if stop == n_prefill or on_gpu:
            last_chunk = (start, attend_prefill(q16[:, :, start:stop], cache, 0))
    start, out = last_chunk
    ref = _exact_attention(q16[:, :, start:n_prefill].cpu(), k16[:, :, :n_prefill].cpu(), v16[:, :, :n_prefill].cpu(), scale)
    result["prefill_rel_error_vs_fp16_exact"] = _rel(out.cpu(), ref)
    errs = []
    for i in range(n_prefill, n):
        cache.append(0, k16[:, :, i : i + 1], v16[:, :, i : i + 1])
        out = attend_decode(q16[:, :, i : i + 1], cache, 0)
        errs.append(_rel(out.cpu(), _exact_attention(q16[:, :, i : i + 1].cpu(), k16[:, :, : i + 1].cpu(), v16[:, :, : i + 1].cpu(), scale)))
    result["decode_rel_error_vs_fp16_exact"] = max(errs)
    if on_gpu:
        q_last = q16[:, :, n - 1 : n]
        result["decode_rel_error_vs_float64_reference"] = _rel(kc.decode_attention(q_last, cache, 0).cpu(),
                                                               kc.reference.attention(q_last, cache, 0).cpu())
    fp16_bytes = 2 * B * Hkv * n * D * 2
    result["memory"] = {"kvarn_bytes": cache.nbytes(), "fp16_bytes": fp16_bytes,
                        "ratio": round(fp16_bytes / cache.nbytes(), 2),
                        "tiles_ratio": round(spec.compression_vs_fp16, 2)}
    if on_gpu:
        result["speed_us"] = _gpu_speed(kc, cache, q16, k16, v16, n)
        result["gpu_kernels"] = "prefill: CUTLASS int8 K-score GEMM + softmax/V kernel; decode: split-tile + combine"
    else:
        result["gpu_kernels"] = ("not run: no CUDA device. The prefill GEMM, the decode kernels and the GPU "
                                 "compression need an NVIDIA GPU (sm_80+; the CUTLASS GEMM needs sm_90).")
        result["cutlass_gemm_sm90"] = {"status": "skipped (--no-compile)"} if args.no_compile else _compile_gemm_for_sm90()
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    _report(result, args.json)
    return 0


def _gpu_speed(kc, cache, q16, k16, v16, n) -> dict:
    import torch
    import torch.nn.functional as F

    from ..bench.timing import time_cuda

    q1 = q16[:, :, n - 1 : n].contiguous()
    kvarn = time_cuda(lambda: kc.decode_attention(q1, cache, 0), warmup=20, runs=200).median_us
    sdpa = time_cuda(lambda: F.scaled_dot_product_attention(q1, k16, v16, enable_gqa=True), warmup=20, runs=200).median_us
    torch.cuda.synchronize()
    return {"decode_kvarn_eager": round(kvarn, 1), "decode_sdpa_fp16": round(sdpa, 1), "ratio_sdpa_over_kvarn": round(sdpa / kvarn, 2)}


def _report(r: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(r, indent=1))
        return
    s = r["shape"]
    print(f"kvarn-cutlass demo on {r['device']}: {r['tokens']} tokens, {s['q_heads']} q / {s['kv_heads']} KV heads, "
          f"head_dim {s['head_dim']}, preset {r['preset']}, window {r['window']}")
    print("  quantization error of the attention output vs exact attention over the fp16 K/V")
    print("  (synthetic Gaussian V is the worst case for 2-bit V; docs/accuracy.md has perplexity on a real model):")
    print(f"    prefill, last chunk: {r['prefill_rel_error_vs_fp16_exact']:.2e}   decode, max of 4 steps: "
          f"{r['decode_rel_error_vs_fp16_exact']:.2e}")
    if "decode_rel_error_vs_float64_reference" in r:
        print(f"  decode kernel vs float64 reference over the same cache: {r['decode_rel_error_vs_float64_reference']:.2e}")
    m = r["memory"]
    print(f"  memory: {m['kvarn_bytes'] / 2**20:.2f} MiB vs {m['fp16_bytes'] / 2**20:.2f} MiB fp16 ({m['ratio']}x smaller; "
          f"tiles alone {m['tiles_ratio']}x, the rest is the fp16 window)")
    if "speed_us" in r:
        sp = r["speed_us"]
        print(f"  decode step: {sp['decode_kvarn_eager']} us vs SDPA fp16 {sp['decode_sdpa_fp16']} us "
              f"({sp['ratio_sdpa_over_kvarn']}x)")
    else:
        print(f"  GPU: {r['gpu_kernels']}")
        c = r["cutlass_gemm_sm90"]
        print(f"  CUTLASS K-score GEMM for sm_90: {c['status']}"
              + (f" ({c['config']}, {c['seconds']} s" + (f", {c['igmma']} IGMMA" if "igmma" in c else "") + ")"
                 if c["status"] == "compiled" else ""))
    print(f"  done in {r['seconds']} s")
