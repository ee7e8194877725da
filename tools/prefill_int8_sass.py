"""SASS instruction counts of the fused prefill kernel's tile-block code, per call site (for the int8 K-operand
cost model in docs/perf-notes.md). Builds the f16 and int8 variants (NVRTC, no GPU), disassembles with
``nvdisasm -gi`` and attributes every instruction to the kernel line it is inlined into.

    python tools/prefill_int8_sass.py [--arch sm_90] [--D 128] [--preset k4v2_g128] [--nvdisasm PATH]
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

import kvarn_cutlass as kc
from kvarn_cutlass.ops.prefill import FusedConfig, fused_spec
from kvarn_cutlass.runtime.spec import build

SRC = Path(__file__).resolve().parents[1] / "kvarn_cutlass" / "csrc" / "prefill_fused.cu"
# call sites (a substring of the kernel's source line) -> region name
SITES = {
    "kint8_fold(kf, sQw, stg, lane)": "consumer: fold (once per tile)",
    "attend_block_i8(kf,": "consumer: tile block (scores, softmax, P.V)",
    "attend_block<true>(sQw,": "consumer: tile block (scores, softmax, P.V)",
    "kint8_stage_k(rec, st, t0, gtid)": "producer: K operand of a block",
    "dequant_k(rec, P, sLut, st, t0, gtid)": "producer: K operand of a block",
    "dequant_v(rec, P, cr, sLut, st + ST_KD, t0, gtid)": "producer: V operand of a block",
}
LINE = re.compile(r'//## File "([^"]+)", line (\d+)(?: inlined at "([^"]+)", line (\d+))?')
INSN = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")


def site_lines() -> dict[int, str]:
    out = {}
    for i, line in enumerate(SRC.read_text().splitlines(), 1):
        for key, name in SITES.items():
            if key in line and not line.lstrip().startswith("//"):
                out[i] = name
    return out


def counts(sass: str, lines: dict[int, str]):
    per = collections.defaultdict(collections.Counter)
    cur = None
    pending: list[tuple[str, int]] = []
    for raw in sass.splitlines():
        m = LINE.search(raw)
        if m:
            pending.append((m.group(1), int(m.group(2))))
            continue
        m = INSN.match(raw)
        if not m:
            continue
        if pending:
            f, ln = pending[-1]  # the outermost frame: the kernel's line
            cur = lines.get(ln) if f.endswith("prefill_fused.cu") else None
            pending = []
        if cur is None:
            continue
        op = m.group(2).split()
        op = op[1] if op[0].startswith("@") else op[0]
        per[cur][op.split(".")[0]] += 1
    return per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--preset", default="k4v2_g128")
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "nvdisasm")
    args = ap.parse_args()
    spec = kc.TileSpec(args.preset, args.D)
    bn = 32 if args.D == 256 else 64
    lines = site_lines()
    for cfg in (FusedConfig(16, bn), FusedConfig(16, bn, k_operand="int8")):
        m = build(fused_spec(spec, torch.float16, torch.float16, cfg), args.arch)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(m.cubin)
            f.flush()
            sass = subprocess.run([args.nvdisasm, "-gi", "-c", f.name], check=True, capture_output=True, text=True).stdout
        print(f"== {cfg.name} D={args.D} {args.arch}: {m.resources['kvarn_prefill_fused']}")
        for region, c in sorted(counts(sass, lines).items()):
            top = ", ".join(f"{k} {v}" for k, v in c.most_common(14))
            print(f"  {region}: {sum(c.values())} static  [{top}]")


if __name__ == "__main__":
    main()
