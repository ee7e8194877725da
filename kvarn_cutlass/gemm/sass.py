"""SASS of a compiled K-score GEMM, with a summary; no GPU needed.

Disassembler: ``cuobjdump -sass`` (else ``nvdisasm``) from ``$CUDA_HOME/bin``, ``/usr/local/cuda/bin``,
PATH, or the pip wheels ``nvidia-cuda-cuobjdump`` / ``nvidia-cuda-nvdisasm`` (``nvidia/cu13/bin``).
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["find_tool", "disassemble", "summarize", "SassSummary"]


def _candidates(tool: str) -> list[Path]:
    c = [Path(os.environ[v]) / "bin" / tool for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    c.append(Path("/usr/local/cuda/bin") / tool)
    w = shutil.which(tool)
    if w:
        c.append(Path(w))
    for p in map(Path, sys.path):
        for sub in ("nvidia/cu13/bin", "nvidia/cuda_cuobjdump/bin", "nvidia/cuda_nvdisasm/bin"):
            c.append(p / sub / tool)
    return c


def find_tool(tool: str) -> str | None:
    for c in _candidates(tool):
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return None


def disassemble(cubin: bytes) -> str:
    """SASS text of ``cubin`` (cuobjdump -sass, else nvdisasm)."""
    tool = find_tool("cuobjdump") or find_tool("nvdisasm")
    if tool is None:
        raise FileNotFoundError("neither cuobjdump nor nvdisasm found; pip install nvidia-cuda-cuobjdump "
                                "(or nvidia-cuda-nvdisasm), or set CUDA_HOME")
    with tempfile.TemporaryDirectory(prefix="kvarn_sass_") as d:
        p = Path(d) / "k.cubin"
        p.write_bytes(cubin)
        cmd = [tool, "-sass", str(p)] if tool.endswith("cuobjdump") else [tool, "-c", str(p)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=d, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


@dataclasses.dataclass(frozen=True)
class SassSummary:
    instructions: int
    igmma: int                # int8 wgmma (SASS IGMMA) instructions
    igmma_shapes: dict        # e.g. {"IGMMA.64x128x32.S8.S8": 8}
    warpgroup_depbar: int     # WARPGROUP.DEPBAR (wgmma waits)
    warpgroup_arrive: int
    ldl: int                  # local loads  (spills / stack)
    stl: int                  # local stores
    registers: int | None     # from the ptxas log, when given
    spill_stores: int | None  # bytes, ptxas
    spill_loads: int | None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)")


def summarize(sass: str, ptxas_log: str = "") -> SassSummary:
    ops = _INSTR.findall(sass)
    shapes: dict[str, int] = {}
    for o in ops:
        if o.startswith("IGMMA"):
            shapes[o] = shapes.get(o, 0) + 1
    regs = spill_st = spill_ld = None
    m = re.search(r"Used (\d+) registers", ptxas_log)
    if m:
        regs = int(m.group(1))
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas_log)
    if m:
        spill_st, spill_ld = int(m.group(1)), int(m.group(2))
    return SassSummary(
        instructions=len(ops),
        igmma=sum(shapes.values()), igmma_shapes=dict(sorted(shapes.items())),
        warpgroup_depbar=sum(1 for o in ops if o.startswith("WARPGROUP.DEPBAR")),
        warpgroup_arrive=sum(1 for o in ops if o.startswith("WARPGROUP.ARRIVE")),
        ldl=sum(1 for o in ops if o == "LDL" or o.startswith("LDL.")),
        stl=sum(1 for o in ops if o == "STL" or o.startswith("STL.")),
        registers=regs, spill_stores=spill_st, spill_loads=spill_ld,
    )
