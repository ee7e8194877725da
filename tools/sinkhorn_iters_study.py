#!/usr/bin/env python3
"""What the variance-normalization iteration count (``TileSpec.sinkhorn_iters``) does to accuracy, on the CPU.

``python3 tools/sinkhorn_iters_study.py [--iters N ...] [--json PATH]``

1. Perplexity of ``shared/models/kvarn-ref-lm`` on ``shared/data/code_eval.txt`` (6 x 2048 tokens, ``--method sim``:
   one forward pass per window, the codec's tiles) for each count, on the rows of docs/accuracy.md that quantize
   the most (no window, every position seeing the whole window quantized) and the default decode rows.
2. The codec's relative reconstruction error (Frobenius, K and V of 128 tiles of ``realistic_kv`` data: Gaussian
   with outlier channels and a drift) for each count.

The compression kernels run the iterations as a loop whose trip count is a kernel argument, so the same
counts are timed on a GPU by ``tools/compress_variants.py --iters N ...``. ~15 min on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

ROWS = (  # (preset, quantizer, window, view)
    ("k4v2_g128", "uniform", 0, "prefill"),
    ("k4v4_g128", "uniform", 0, "prefill"),
    ("k4v2_g64", "uniform", 0, "prefill"),
    ("k4v2_g128", "lloyd_max", 0, "prefill"),
    ("k4v2_g128", "uniform", 256, "decode"),
    ("k4v2_g128", "uniform", 128, "decode"),
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, action="append", help="counts to compare (repeatable; default 0 1 2 4 8)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    import torch

    from _helpers import REF_MODEL_DIR, REF_TEXT, realistic_kv
    from kvarn_cutlass import codec
    from kvarn_cutlass.format import MAX_SINKHORN_ITERS, TileSpec
    from kvarn_cutlass.hf import SimSpec
    from kvarn_cutlass.hf._compat import load_model
    from kvarn_cutlass.hf.perplexity import evaluate, token_windows

    counts = list(dict.fromkeys(args.iters or (0, 1, 2, 4, 8)))
    bad = [i for i in counts if not 0 <= i <= MAX_SINKHORN_ITERS]
    if bad:
        raise SystemExit(f"--iters {bad[0]}: choose 0 to {MAX_SINKHORN_ITERS}")
    rows = []

    def emit(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    t0 = time.time()
    g = torch.Generator().manual_seed(0)
    for preset in ("k4v2_g128", "k4v4_g128"):
        T = TileSpec(preset=preset, head_dim=128).tile_tokens
        k = (realistic_kv(128, T, 128, generator=g).float() * 1.5)[None, :, None].half()  # [1, tiles, 1, T, D]
        v = realistic_kv(128, T, 128, generator=g)[None, :, None]
        for it in counts:
            spec = TileSpec(preset=preset, head_dim=128, sinkhorn_iters=it)
            kh, vh = codec.decode_tiles(codec.encode_tiles(k, v, spec), spec)
            rel = lambda a, b: round(((a - b.float()).norm() / b.float().norm()).item(), 5)  # noqa: E731
            emit({"case": "tiles", "preset": preset, "iters": it, "k_rel_err": rel(kh, k), "v_rel_err": rel(vh, v)})
    model, tok = load_model(str(REF_MODEL_DIR), "cpu", None)
    windows = token_windows(tok, REF_TEXT.read_text(encoding="utf-8"), 2048, 6)
    for preset, quantizer, window, view in ROWS:
        specs = [SimSpec(preset, window, 0, view=view, sinkhorn_iters=it, quantizer=quantizer) for it in counts]
        res = evaluate(model, windows, specs, method="sim", progress=False)
        for it, r in zip(counts, res["results"]):
            emit({"case": "perplexity", "preset": preset, "quantizer": quantizer, "window": window, "view": view,
                  "iters": it, "ppl": round(r["ppl"], 4), "ppl_baseline": round(r["ppl_baseline"], 4),
                  "ppl_rel_increase_pct": round(r["ppl_rel_increase"] * 100, 3)})
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "seconds": round(time.time() - t0, 1)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
