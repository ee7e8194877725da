#!/usr/bin/env python3
"""Where a decode layer's time goes, block by block: the timeline of ``DecodeVariant(trace=1)`` (GPU).

``python3 tools/decode_trace.py [--shape BxCTX ...] [--variant TEXT ...] [--runs N] [--json PATH]``

The trace kernel is the kernel of ``--variant`` (default: the one the plan picks for the shape) with thread 0 of
every block writing ``%globaltimer`` (ns, one clock for all SMs) and ``clock64`` (its SM's cycles) at each phase
(``csrc/decode.cu``, ``trace_mark``): entry, the programmatic wait passed, the first tile's records landed, the
tile loop done, the partial written, the ticket taken, and, in the block that merges a (sequence, KV head), the
final merge done; and, without clock64, the barrier before the ticket's atomic passed and the merge's steps in
its first head (the ticket reset, the first batch of partial rows visible, the rows added, the output stored). The
layers of the bench's cache shape (``bench.decode``: enough of them that no launch finds
its records in L2) are launched eagerly in turn; ``--runs`` of those launches are traced, each after a warm-up
round and with the buffer cleared before; per run the phases are summarized over the blocks
(median and max, us) and the kernel's span split into: the start (first entry to the median first record),
the tile loops, the spread of the blocks' ends (median end to last end: the wave's tail), and the merge after
the last ticket. Per shape one JSON line (the median over runs of each summary number) and a table.

A diagnostic: its times include the trace's own stores (thread 0, a few a block) and its 7 instructions an
iteration; ``elapsed_us`` (events around one eager launch of the trace kernel) shows the span it ran in.
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
from kvarn_cutlass.bench.timing import elapsed_ms  # noqa: E402

FIELDS = 24  # csrc/decode.cu TRACE_FIELDS
BLOCKS = 8192  # csrc/decode.cu TRACE_BLOCKS
SHAPES = ((1, 131072), (1, 4096), (16, 32768))


def _trace_buffer(plan, spec, variant):
    """(device pointer, bytes) of the trace kernel's module global."""
    from cuda.bindings import driver

    from kvarn_cutlass.runtime.errors import check_driver

    kernel = decode._kernels(spec, plan.device, variant)[0]
    name = f"kvarn_decode_trace_{decode._suffix(spec, variant)}"
    ptr, size = check_driver(driver.cuModuleGetGlobal(kernel.module._handle, name.encode()), "cuModuleGetGlobal", name)
    assert size == BLOCKS * FIELDS * 8, size
    return int(ptr), size


def _read(ptr: int, size: int):
    import torch
    from cuda.bindings import driver

    from kvarn_cutlass.runtime.errors import check_driver

    torch.cuda.synchronize()
    buf = torch.empty(size // 8, dtype=torch.int64, device="cuda")
    check_driver(driver.cuMemcpyDtoD(buf.data_ptr(), ptr, size), "cuMemcpyDtoD")
    return buf.view(BLOCKS, FIELDS).cpu().tolist()


def _clear(ptr: int, size: int) -> None:
    import torch
    from cuda.bindings import driver

    from kvarn_cutlass.runtime.errors import check_driver

    torch.cuda.synchronize()
    check_driver(driver.cuMemsetD8(ptr, 0, size), "cuMemsetD8")
    torch.cuda.synchronize()


def _med(xs):
    return round(statistics.median(xs), 3) if xs else None


def summarize(rows: list[list[int]], nblocks: int) -> dict:
    """Phase summary (us) of one run's trace rows (the first ``nblocks`` rows: the launch's blocks)."""
    blocks = []
    for r in rows[:nblocks]:
        info = r[7]
        blocks.append({"t": r[:7], "clock": r[8:15], "sub": r[16:21], "sm": info & 0xFFFF,
                       "tiles": (info >> 16) & 0xFFFF, "exact": (info >> 32) & 1, "last": (info >> 33) & 1})
    t0 = min(b["t"][0] for b in blocks)
    us = lambda a, b: (b - a) / 1000.0  # noqa: E731
    tile = [b for b in blocks if not b["exact"] and b["tiles"] > 0]
    ends = [b["t"][6] if b["last"] else b["t"][5] for b in blocks]
    ticket_ends = [b["t"][5] for b in blocks]
    last_ticket = max(ticket_ends)
    merges = [us(b["t"][5], b["t"][6]) for b in blocks if b["last"]]
    merging = [b for b in blocks if b["last"]]
    # the merge's steps in its first head (warp 0): ticket -> reset -> first batch -> rows -> store, over the
    # merging blocks that stamped them (with merge_group, only the final merges stamp 18-20)
    steps = lambda a, b: _med([us(m["sub"][a] if a >= 0 else m["t"][5], m["sub"][b]) for m in merging  # noqa: E731
                               if m["sub"][b] and (a < 0 or m["sub"][a])])
    per_sm: dict[int, int] = {}
    for b in blocks:
        per_sm[b["sm"]] = per_sm.get(b["sm"], 0) + 1
    loop = [us(b["t"][2], b["t"][3]) for b in tile]
    return {
        "blocks": nblocks, "tile_blocks": len(tile), "merging_blocks": len(merges),
        "blocks_per_sm_max": max(per_sm.values()), "sms": len(per_sm),
        "span_us": us(t0, max(ends)),
        "entry_spread_us": us(t0, max(b["t"][0] for b in blocks)),
        "wait_med_us": _med([us(b["t"][0], b["t"][1]) for b in blocks]),
        "first_records_med_us": _med([us(b["t"][1], b["t"][2]) for b in tile]),
        "first_records_max_us": round(max(us(b["t"][1], b["t"][2]) for b in tile), 3) if tile else None,
        "first_records_at_med_us": _med([us(t0, b["t"][2]) for b in tile]),
        "loop_med_us": _med(loop), "loop_max_us": round(max(loop), 3) if loop else None,
        "per_tile_med_us": _med([us(b["t"][2], b["t"][3]) / b["tiles"] for b in tile]),
        "epilogue_med_us": _med([us(b["t"][3], b["t"][4]) for b in tile]),
        "ticket_med_us": _med([us(b["t"][4], b["t"][5]) for b in blocks]),
        "ticket_max_us": round(max(us(b["t"][4], b["t"][5]) for b in blocks), 3),
        "end_med_us": _med([us(t0, e) for e in ticket_ends]),
        "last_ticket_us": us(t0, last_ticket),
        "tail_us": round(us(statistics.median(ticket_ends), last_ticket), 3),
        "ticket_barrier_med_us": _med([us(b["t"][4], b["sub"][0]) for b in blocks]),
        "merge_med_us": _med(merges), "merge_max_us": round(max(merges), 3) if merges else None,
        "merge_reset_med_us": steps(-1, 1), "merge_first_batch_med_us": steps(1, 2),
        "merge_rows_med_us": steps(2, 3), "merge_store_med_us": steps(3, 4),
        "after_last_ticket_us": us(last_ticket, max(ends)),
        "loop_cycles_per_tile_med": _med([(b["clock"][3] - b["clock"][2]) / b["tiles"] for b in tile]),
    }


def trace_shape(batch: int, ctx: int, base: decode.DecodeVariant | None, runs: int) -> dict:
    import torch

    layers = bench.rotated_layers(batch, ctx)  # as the bench: no launch finds its records left in L2
    cache = bench._build_cache(batch, ctx, layers)
    q = torch.randn(batch, bench.HQ, 1, bench.D, device="cuda", dtype=torch.float16)
    if base is None:  # the plan's own kernel, as the bench runs it
        base = decode.DecodePlan(cache).workspace(bench.HQ // bench.HKV).variant
    variant = decode.DecodeVariant.parse(",".join(x for x in (str(base), "trace=1") if x != "default"))
    plan = decode.DecodePlan(cache, variant=variant)
    ws = plan.workspace(bench.HQ // bench.HKV)
    out = torch.full_like(q, float("nan"))
    turn = [0]

    def launch() -> None:  # the layers in turn
        turn[0] = (turn[0] + 1) % layers
        plan.launch(q, turn[0], out)

    launch()
    ptr, size = _trace_buffer(plan, cache.spec, variant)
    nblocks = batch * bench.HKV * (ws.splits + ws.exact)
    summaries, elapsed = [], []
    for _ in range(runs):
        for _ in range(max(3, layers)):
            launch()
        _clear(ptr, size)
        elapsed.append(elapsed_ms(launch) * 1000.0)
        summaries.append(summarize(_read(ptr, size), nblocks))
    keys = summaries[0].keys()
    row = {"batch": batch, "context": ctx, "variant": str(variant), "layers": layers, "splits": ws.splits,
           "exact": ws.exact, "elapsed_us": _med(elapsed)}
    for k in keys:
        vals = [s[k] for s in summaries if s[k] is not None]
        row[k] = _med(vals) if vals else None
    return row


def _variant(text: str) -> decode.DecodeVariant | None:
    """A --variant argument: None for "plan" (the plan's own kernel), else the parsed variant."""
    return None if text.strip() == "plan" else decode.DecodeVariant.parse(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", action="append", help="BATCHxCONTEXT (default: 1x131072, 1x4096, 16x32768)")
    ap.add_argument("--variant", action="append", type=_variant,
                    help="a traced kernel's variant, repeatable; 'plan' (the default) is the one the plan picks for "
                         "each shape")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shape] if args.shape else SHAPES
    rows = []
    for variant in args.variant or [None]:
        for batch, ctx in shapes:
            row = trace_shape(batch, ctx, variant, args.runs)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))
    cols = ("span_us", "elapsed_us", "first_records_at_med_us", "loop_med_us", "loop_max_us", "per_tile_med_us",
            "end_med_us", "last_ticket_us", "tail_us", "merge_max_us", "after_last_ticket_us", "ticket_barrier_med_us",
            "merge_reset_med_us", "merge_first_batch_med_us", "merge_rows_med_us", "merge_store_med_us")
    print("shape | variant | S | " + " | ".join(cols))
    for r in rows:
        print(f"b{r['batch']}/{r['context']} | {r['variant']} | {r['splits']} | "
              + " | ".join(str(r[c]) for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
