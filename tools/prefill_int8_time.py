"""Times the int8 K-operand configs of the fused prefill kernel against f16 configs on the tuner's shape
(one --chunk-token chunk over a --context-token cache, Qwen3-8B heads: 32 q / 8 KV; attention only; CUDA
events, median of --reps after a warm-up), each checked against the torch path (its own K operand's mirror
for int8, the f16 path otherwise) and the f16 torch path. GPU only; for docs/perf-notes.md.

    python tools/prefill_int8_time.py [--buckets D128_T128_V2 D256_T128_V2] [--configs NAME ...]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import kvarn_cutlass as kc
from kvarn_cutlass.ops.prefill import FusedConfig, select_config
from kvarn_cutlass.ops.prefill_tune import HKV, HQ, parse_bucket

DEFAULT = {128: ["r16c4n64", "r16c4n64i8", "r32c4n64", "r16c4n32", "r16c4n32i8", "r16c4n64g2i8"],
           64: ["r16c4n64", "r16c4n64i8", "r32c4n64"], 256: ["r16c4n32", "r16c4n32i8"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--buckets", nargs="+", default=["D128_T128_V2", "D256_T128_V2"])
    ap.add_argument("--configs", nargs="*", default=None)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    for key in args.buckets:
        spec = parse_bucket(key)
        D = spec.head_dim
        g = torch.Generator(device="cuda").manual_seed(0)
        cache = kc.KVarNCache(1, 1, HKV, D, preset=spec.preset, window=256, quantizer=spec.quantizer, device="cuda",
                              max_seq_len=args.context + args.chunk)
        k = torch.randn(1, HKV, args.context, D, device="cuda", dtype=torch.float16, generator=g)
        cache.append(0, k, torch.randn_like(k))
        q = torch.randn(1, HQ, args.chunk, D, device="cuda", dtype=torch.float16, generator=g) * 0.3
        kn = torch.randn(1, HKV, args.chunk, D, device="cuda", dtype=torch.float16, generator=g)
        vn = torch.randn_like(kn)
        f16_ref = kc.prefill_attention(q, kn, vn, cache, 0, append=False, impl="torch").float()
        names = list(args.configs or DEFAULT[D])
        tuned = select_config(spec).name
        if tuned not in names:
            names.append(tuned)
        for name in names:
            cfg = FusedConfig.from_name(name)
            row = {"bucket": key, "config": name, "tuned": name == tuned}
            if not cfg.fits(D, spec.tile_tokens):
                row["skipped"] = "does not fit"
                print(json.dumps(row), flush=True)
                continue
            mirror = f16_ref if cfg.k_operand == "f16" else kc.prefill_attention(
                q, kn, vn, cache, 0, append=False, impl="torch", config=cfg).float()
            out = kc.prefill_attention(q, kn, vn, cache, 0, append=False, config=cfg)
            row["err_vs_mirror"] = ((out.float() - mirror).norm() / mirror.norm()).item()
            row["err_vs_f16_torch"] = ((out.float() - f16_ref).norm() / f16_ref.norm()).item()
            times = []
            for _ in range(args.reps + 1):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                kc.prefill_attention(q, kn, vn, cache, 0, append=False, config=cfg, out=out)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            row["time_ms"] = round(statistics.median(times[1:]), 4)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
