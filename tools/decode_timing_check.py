#!/usr/bin/env python3
"""Decode's per-layer time under the bench's two timing methods, on one cache, interleaved (GPU).

``python3 tools/decode_timing_check.py [--shape BxCTX ...] [--caches N] [--rounds N] [--json PATH]``

Why: on 2026-12-07 (H200, tree e8f441d) one device call measured the b16/32k decode layer at 155.84 us with
``kvarn-cutlass bench --section decode`` and at 137.84 us (same kernel, ring 2, same split count) with
``tools/decode_variants.py``, the floor bar's 0.704 against 0.796. The two differ in how a graph replay is
timed:

- ``per_replay``: the bench's ``time_cuda(g.replay)`` - CUDA events around each replay of a graph of one launch
  per rotated layer, median over 100 replays (the host queues them all; one sync at the end);
- ``back_to_back``: ``decode_variants.graph_sampler`` - one event pair around 20 replays, median of the
  samples.

Both are timed here on the same graphs, in interleaved rounds, for the plan's kernel (``DecodePlan(cache)``,
what the bench times), the default kernel and ring 2, and for graphed cuDNN SDPA on an fp16 cache of the same
shape (the bars' baseline), each with its median, p10 and p90. If the per-replay median of one kernel moves
with the method while cuDNN's does not, the difference is the kernel's, not the timer's. The KVarN graphs are
built on ``--caches`` caches of the shape built one after another and held together (their records in
different device memory): a time that moves from cache to cache is the memory's, not the method's. Two more
entries repeat what the bench did that the rounds do not: the plan's eager ``decode_attention`` (the bench's
``eager_us``, 143.28 us at b16/32k in that call, below its own graph time on the same cache), and, per cache,
the plan's graph timed per replay at once after the cache is built (``first_per_replay_us``), as the bench
times it, before anything else has run on that cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvarn_cutlass import decode  # noqa: E402
from kvarn_cutlass.bench import decode as bench  # noqa: E402
from kvarn_cutlass.bench.timing import capture_graph, elapsed_ms, time_cuda  # noqa: E402

REPLAYS_PER_SAMPLE = 20
SAMPLES = 12
PER_REPLAY_RUNS = 100


def _methods(run_once, calls: int) -> dict:
    """Both timings of ``run_once`` (a graph's replay holding ``calls`` layers or input sets, or one eager call),
    us per call."""
    per = time_cuda(run_once, warmup=5, runs=PER_REPLAY_RUNS)
    samples = [elapsed_ms(run_once, repeats=REPLAYS_PER_SAMPLE) * 1000.0 / (REPLAYS_PER_SAMPLE * calls)
               for _ in range(SAMPLES)]
    return {"per_replay_us": round(per.median_us / calls, 2), "per_replay_p10_us": round(per.p10_us / calls, 2),
            "per_replay_p90_us": round(per.p90_us / calls, 2),
            "back_to_back_us": round(statistics.median(samples), 2),
            "back_to_back_min_us": round(min(samples), 2), "back_to_back_max_us": round(max(samples), 2)}


def _kvarn_entries(batch: int, ctx: int, tag: str) -> tuple[dict, dict, object]:
    """The KVarN entries of one freshly built cache (name -> (run_once, calls, what to keep alive)) and the plan
    graph's per-replay time taken at once after the build."""
    import torch

    layers = bench.rotated_layers(batch, ctx)
    cache = bench._build_cache(batch, ctx, layers)
    q = torch.randn(batch, bench.HQ, 1, bench.D, device="cuda", dtype=torch.float16)
    entries, first = {}, {}
    for name, variant in (("plan", None), ("default", decode.DecodeVariant()),
                          ("ring=2", decode.DecodeVariant.parse("ring=2"))):
        plan = decode.DecodePlan(cache, variant=variant)
        ws = plan.workspace(bench.HQ // bench.HKV)
        outs = [torch.full_like(q, float("nan")) for _ in range(layers)]
        g = capture_graph(lambda i, plan=plan, outs=outs: plan.launch(q, i, outs[i]), list(range(layers)))
        label = f"kvarn {tag} {name} ({ws.variant}, S={ws.splits})"
        if not first:
            per = time_cuda(g.replay, warmup=5, runs=PER_REPLAY_RUNS)
            first = {"batch": batch, "context": ctx, "graph": label,
                     "first_per_replay_us": round(per.median_us / layers, 2)}
            print(json.dumps(first), flush=True)
        entries[label] = (g.replay, layers, (g, plan, outs))
    outs = [torch.full_like(q, float("nan")) for _ in range(layers)]
    turn = [0]

    def eager() -> None:  # the bench's eager_us: decode_attention through the cache's plan, layers in turn
        i = turn[0] = (turn[0] + 1) % layers
        decode.decode_attention(q, cache, i, out=outs[i])

    entries[f"kvarn {tag} plan eager"] = (eager, 1, outs)
    return entries, first, (cache, q)


def _cudnn_graph(batch: int, ctx: int) -> tuple:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kv, q = bench.sdpa_inputs(batch, ctx)

    def call(s):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, s[0], s[1], enable_gqa=True)

    g = capture_graph(call, kv)
    return g.replay, len(kv), (g, kv, q)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", action="append", help="BATCHxCONTEXT (default: 16x32768, 16x131072, 1x131072)")
    ap.add_argument("--caches", type=int, default=2, help="caches built per shape (default 2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import torch

    shapes = [tuple(int(x) for x in s.split("x")) for s in (args.shape or ["16x32768", "16x131072", "1x131072"])]
    rows, firsts = [], []
    for batch, ctx in shapes:
        entries, keep = {}, []
        for c in range(args.caches):
            more, first, held = _kvarn_entries(batch, ctx, f"cache{c}")
            entries.update(more)
            firsts.append(first)
            keep.append(held)
        entries["sdpa cudnn"] = _cudnn_graph(batch, ctx)
        for run_once, _, _ in entries.values():  # warm
            run_once()
        torch.cuda.synchronize()
        for r in range(args.rounds):
            order = list(entries) if r % 2 == 0 else list(reversed(entries))
            for name in order:
                run_once, calls, _ = entries[name]
                row = {"batch": batch, "context": ctx, "round": r, "graph": name, "calls": calls,
                       **_methods(run_once, calls)}
                print(json.dumps(row), flush=True)
                rows.append(row)
        del entries, keep, more, held
        torch.cuda.empty_cache()
    print("shape | graph | per_replay us (median of rounds) | back_to_back us | ratio")
    for batch, ctx in shapes:
        names = dict.fromkeys(r["graph"] for r in rows if (r["batch"], r["context"]) == (batch, ctx))
        for name in names:
            sel = [r for r in rows if (r["batch"], r["context"], r["graph"]) == (batch, ctx, name)]
            pr = statistics.median(r["per_replay_us"] for r in sel)
            bb = statistics.median(r["back_to_back_us"] for r in sel)
            print(f"b{batch}/{ctx} | {name} | {pr:.2f} | {bb:.2f} | {pr / bb:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "first_after_build": firsts}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
