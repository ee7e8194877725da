#!/usr/bin/env python3
"""Warp-instructions the decode kernel's tile loop issues per iteration, counted in its SASS (no GPU).

``python tools/decode_sass_loop.py [--arch sm90] [--variant TEXT ...] [--only LABEL ...]``: builds the
decode variants of docs/perf-notes.md (NVRTC, through the kernel cache), each for every kernel variant
given (``decode.DecodeVariant`` text forms such as ``ring=2,min_blocks=5``; default: the shipped
kernel), finds the tile loop (the back edge whose body holds the most IMMA/HMMA) and walks one
iteration of it per warp role. The walk issues every
instruction a warp meets: a forward conditional branch falls through (a divergent ``if`` issues its
body), except the lazy-rescale branch after VOTE.ANY (taken: the rescale is rare) and, for a warp
without a fold pair, the branch over the fold; an inner back edge (the fold's rounds) is taken
``rounds - 1`` times. Per variant one JSON line: per warp role the count, the registers, and the
iteration's total over the four warps (the warps' fold rounds as ``fold_tiles`` assigns them), the
spills, the shared memory one block takes and the resident blocks per SM of the occupancy arithmetic
(``decode.residency``).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvarn_cutlass import decode  # noqa: E402
from kvarn_cutlass.cli.sass import disassemble  # noqa: E402
from kvarn_cutlass.format import TileSpec  # noqa: E402
from kvarn_cutlass.runtime import build  # noqa: E402

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")
NUM_WARPS = 4

# (label, TileSpec arguments, kernel "n1" (G <= 4) / "n2" (G <= 8), group size G of the count)
VARIANTS = (
    ("d128 k4v2_g128 n1", dict(), "n1", 4),
    ("d128 k4v2_g128 n2", dict(), "n2", 8),
    ("d128 k4v4_g128 n1", dict(preset="k4v4_g128"), "n1", 4),
    ("d128 k4v2_g64 n1", dict(preset="k4v2_g64"), "n1", 4),
    ("d256 k4v2_g128 n1", dict(head_dim=256), "n1", 4),
    ("d64 k4v2_g128 n1", dict(head_dim=64), "n1", 4),
    ("d128 k4v2_g128 lm n1", dict(quantizer="lloyd_max"), "n1", 4),
    ("d128 k4v4_g128 lm n1", dict(preset="k4v4_g128", quantizer="lloyd_max"), "n1", 4),
)


def parse(sass: str, kernel: str) -> list[tuple[int, str, str, int | None]]:
    """(address, predicate, opcode, branch target) of each instruction of ``kernel``."""
    out, on = [], False
    for line in sass.split("\n"):
        if "Function :" in line:
            on = line.split("Function :")[1].strip() == kernel
            continue
        m = _INSTR.search(line) if on else None
        if m:
            op = m.group(3)
            t = re.findall(r"0x([0-9a-f]+)", m.group(4)) if op.startswith("BRA") else []
            out.append((int(m.group(1), 16), (m.group(2) or "").strip(), op, int(t[-1], 16) if t else None))
    return out


def tile_loop(ins) -> tuple[int, int]:
    """(first, last address) of the loop whose body holds the most tensor-core instructions."""
    best = None
    for a, p, o, t in ins:
        if o == "BRA" and p and t is not None and t < a:
            n = sum(1 for x in ins if t <= x[0] <= a and x[2].startswith(("IMMA", "HMMA")))
            if n and (best is None or (n, t - a) > best[0]):
                best = ((n, t - a), t, a)
    return best[1], best[2]


def walk(ins, folds: bool, rounds: int) -> int:
    """Instructions one warp issues in one iteration of the tile loop (see the module docstring)."""
    return len(walk_ops(ins, folds, rounds))


def walk_ops(ins, folds: bool, rounds: int) -> list[str]:
    """The opcodes one warp issues in one iteration of the tile loop, in issue order (see the module docstring)."""
    lo, hi = tile_loop(ins)
    idx = {x[0]: i for i, x in enumerate(ins)}
    body = [x for x in ins if lo <= x[0] <= hi]
    first_bar = next(x[0] for x in body if x[2].startswith("BAR.SYNC"))
    # the branch over the fold: the first forward conditional branch after the loop's first barrier that
    # lands on the next barrier
    fold_skip = next(a for a, p, o, t in body if a > first_bar and o == "BRA" and p and t and t > a
                     and any(ins[k][2].startswith("BAR.SYNC") for k in range(idx[t], idx[t] + 4)))
    lazy = set()
    for a, _, o, _ in body:
        if o.startswith("VOTE.ANY"):
            lazy.add(next(x[0] for x in ins[idx[a]:idx[a] + 16] if x[2] == "BRA" and x[1]))
    taken_back: dict[int, int] = {}
    i, ops = idx[lo], []
    while True:
        a, p, o, t = ins[i]
        ops.append(o)
        if a == hi:
            return ops
        if o == "BRA" and t is not None:
            if not p:
                i = idx[t]
                continue
            if t < a and taken_back.get(a, 0) < rounds - 1:
                taken_back[a] = taken_back.get(a, 0) + 1
                i = idx[t]
                continue
            if t > a and (a in lazy or (not folds and a == fold_skip)):
                i = idx[t]
                continue
        i += 1


def fold_roles(spec: TileSpec, group: int) -> tuple[int, int]:
    """(warps that fold, rounds each of them runs) in one iteration: fold_tiles' pair assignment."""
    d, t = spec.head_dim, spec.tile_tokens
    lanes_per_pair = min(d // 4, 32)
    pairs = (128 // t) * group
    per_round = NUM_WARPS * 32 // lanes_per_pair
    return min(NUM_WARPS, math.ceil(pairs / (32 // lanes_per_pair))), math.ceil(pairs / per_round)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm90")
    ap.add_argument("--variant", action="append", type=decode.DecodeVariant.parse,
                    help="a kernel variant (decode.DecodeVariant text form); repeatable; default: the shipped kernel")
    ap.add_argument("--only", action="append", choices=[v[0] for v in VARIANTS],
                    help="count only this spec label; repeatable")
    args = ap.parse_args(argv)
    for label, kw, which, group in VARIANTS:
        if args.only and label not in args.only:
            continue
        spec = TileSpec(**kw)
        for variant in args.variant or [decode.DecodeVariant()]:
            ks = decode.decode_spec(spec, variant)
            mod = build(ks, args.arch)
            kernel = next(k for k in ks.kernel_names if f"_{which}_" in k)
            ins = parse(disassemble(mod.cubin), kernel)
            fold_warps, rounds = fold_roles(spec, group)
            fold = walk(ins, True, rounds)
            other = walk(ins, False, 1)
            total = fold_warps * fold + (NUM_WARPS - fold_warps) * other
            res = mod.resources[kernel]
            occ = decode.residency(spec, variant, args.arch)[0 if which == "n1" else 1]
            print(json.dumps({"variant": label, "kernel_variant": str(variant), "G": group, "fold_warps": fold_warps,
                              "fold_rounds": rounds, "fold_warp": fold,
                              "other_warp": other if fold_warps < NUM_WARPS else None, "iteration": total,
                              "max_warp": max(fold, other if fold_warps < NUM_WARPS else 0),
                              "registers": res.registers, "spill_stores": res.spill_store_bytes,
                              "smem_per_block": occ.smem_bytes, "blocks_per_sm": occ.blocks}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
