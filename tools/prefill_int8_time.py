"""Times the int8 K-operand configs of the fused prefill kernel against f16 configs on the tuner's shape
(one --chunk-token chunk over a --context-token cache, Qwen3-8B heads: 32 q / 8 KV; attention only; median
of --reps back-to-back calls between CUDA events, inputs rotated past L2), each checked against the torch path (its own K operand's mirror
for int8, the f16 path otherwise) and the f16 torch path. GPU only; for docs/perf-notes.md.

    python tools/prefill_int8_time.py [--buckets D128_T128_V2 D256_T128_V2] [--configs NAME ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's package, as the other tools

import kvarn_cutlass as kc  # noqa: E402
from kvarn_cutlass.ops.prefill import FusedConfig, select_config  # noqa: E402
from kvarn_cutlass.ops.prefill_tune import parse_bucket, rotated_inputs, time_config  # noqa: E402

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
        sets = rotated_inputs(spec, args.context, args.chunk)
        cache, q, kn, vn = sets[0]
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
            row["time_ms"] = round(time_config(sets, cfg, out, args.reps), 4)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
