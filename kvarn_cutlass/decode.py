"""Split-tile decode attention over a KVarN cache: one new query token per sequence, one kernel launch.

Public entry points:

* :func:`decode_attention` ``(q, cache, layer, scale=None) -> out``: the eager API over a
  :class:`~kvarn_cutlass.cache.KVarNCache` (same semantics as ``kvarn_cutlass.reference.attention``
  with n_q = 1: the query is the newest token and sees sink + tiles + window).
* :func:`decode_attention_ragged`: the lower-level entry a serving engine uses, with per-sequence
  lengths in int32 device tensors (``n_tiles``, ``window_len``, ``sink_len``), the tile pool
  ``[B, cap_tiles, Hkv, nbytes]`` read through an int32 tile table ``[B, cap_tiles]`` (entry = record
  slot), window ``[B, Hkv, W, D]`` and sink ``[B, Hkv, SC, D]`` buffers.
* :class:`DecodePlan`: per-cache device state (lengths, partials workspace, prepared launches).
* :class:`DecodeGraph`: capture one decode call in a CUDA graph once, ``replay()`` every step.

Kernel (``csrc/decode.cu``, one launch per layer and step), fixed grid ``(S + E, Hkv, B)``: split
``j < S`` covers ``tps = max(min_tps, ceil(n_tiles[b] / S))`` tiles starting at ``j * tps`` (computed on
the device from the live tile count, so one grid serves every length); split ``S + e`` attends to
tokens ``[e*TE, (e+1)*TE)`` of sink ++ window (original domain), ``E = ceil((W + SC) / TE)``, TE from
the kernel (:func:`kernel_layout`). Scores come from int8 tensor cores on the 4-bit codes (two-level
int8 fold of the query), P' x V from int8 tensor cores on the 2/4-bit V codes. Every block writes a
partial; the last block of each (sequence, KV head) (an atomic ticket per pair in the workspace, reset
by that block) merges them, applies the inverse WHT and writes the output.

Graph strategy: the kernel reads the lengths from device memory: the cache's own int32
``device_lengths() [num_layers, 3, B]`` (n_tiles, window_len, sink_len), which every write of the
cache updates in stream order (the append kernels on the device; truncate and restores with torch
ops), so a decode launched after an append reads that append's lengths with no host work and no
copy. The graph holds only the kernel launch, which stays valid while the sequence grows across tile
boundaries because the pool never moves (``max_seq_len`` preallocates it) and the grid is sized from
the capacity.

Kernel variants (docs/perf-notes.md "Decode occupancy"): :class:`DecodeVariant` sets the ring depth and the
launch-bounds minimum blocks per SM at compile time (``DecodePlan(variant=)`` or ``$KVARN_DECODE_VARIANT``);
:func:`residency` gives the resident blocks per SM of a variant from its CUBIN and :func:`choose_splits` plans
for the residency the variant's kernel has. Plans that name none run :func:`plan_variant`'s choice: the ring-2
kernel for grids of two or more waves of its blocks (large batch x context), the two-level merge for smaller
grids with many splits a (sequence, KV head) (batch 1 from 8k), else the shipped one.
"""

from __future__ import annotations

import functools
import math
import os
import struct
from dataclasses import dataclass
from typing import Any

import torch

from .cache import KVarNCache
from .format import PRESETS, HEAD_DIMS, QUANTIZERS, SCALE_DTYPES, TileSpec
from ._validate import check_query, resolve_scale
from .runtime import KernelSpec, build, cubin_global, get_module, register
from .runtime.arch import arch_target, device_arch, normalize_arch, sm_count

__all__ = [
    "decode_attention",
    "decode_attention_ragged",
    "DecodePlan",
    "DecodeGraph",
    "DecodeWorkspace",
    "DecodeVariant",
    "Residency",
    "decode_spec",
    "decode_variant",
    "plan_variant",
    "occupancy",
    "residency",
    "decode_specs",
    "kernel_layout",
    "identity_tile_table",
]

NUM_THREADS = 128
# Fewest tiles one split block covers (the device computes tps = max(min_tps, ceil(n_tiles / S))).
# Environment override for A/B runs: KVARN_DECODE_MIN_TPS.
MIN_TILES_PER_SPLIT = 2
# Upper bound on the waves of resident blocks the split model may use (see choose_splits).
MAX_WAVES = 4
# Most tiles one split block covers once a grid of such blocks fills the GPU (see plan_splits): at batch 16
# the kernel ran 11% faster in ~4 waves of 15-tile blocks than in the model's one wave of 64-tile blocks
# (docs/perf-notes.md, "Decode (issue 15): occupancy variants falsified, split plan raised"); the waves
# model cannot see it (blocks are dispatched as slots free).
MAX_TILES_PER_SPLIT = 16
# Upper bound on the waves of resident blocks that MAX_TILES_PER_SPLIT may ask for.
MAX_WAVES_SHORT_BLOCKS = 16
Q_DTYPES = (torch.float16, torch.bfloat16)
MAX_GROUP = 8
# Environment override of the kernel variant for A/B runs (DecodeVariant's text form, e.g. "ring=2,min_blocks=5").
VARIANT_ENV = "KVARN_DECODE_VARIANT"

_SIG = (
    "ptr q", "ptr pool", "ptr table", "ptr win_k", "ptr win_v", "ptr sink_k", "ptr sink_v", "ptr n_tiles",
    "ptr win_len", "ptr sink_len", "ptr po", "ptr pm", "ptr pl", "ptr tickets", "ptr out", "i32 Hkv", "i32 G",
    "i32 cap", "i32 nslots", "i32 W", "i32 SC", "i32 S", "i32 E", "i32 min_tps", "i32 flags", "f32 scale",
)
_ARG_Q, _ARG_OUT = _SIG.index("ptr q"), _SIG.index("ptr out")
# Second int8 level of the lloyd_max centroid tables (the kernel's LFOLD): th = rint(s c), tl = rint((s c - th) * 254).
LM_TABLE_LEVEL = 254


# --- kernel variants ---------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeVariant:
    """Compile-time knobs of the decode kernel (occupancy, load order) for A/B runs; ``DecodeVariant()`` is shipped.

    Attributes (None: the kernel's own default, which lives in ``csrc/decode.cu`` only):
        ring: cp.async ring slots NS of a tile block, 2..8 (NS - 1 iterations of records in flight; fewer
            slots, less shared memory per block).
        min_blocks: resident blocks per SM the G <= 4 kernel's registers are bounded for, 1..32
            (``__launch_bounds__``' minimum: ptxas fits the registers per thread in 65,536 / (128 x
            min_blocks), rounded down to a multiple of 8: 96 for 5 blocks, 80 for 6).
        min_blocks_g8: the same for the G <= 8 kernel.
        prefetch: records of its first tiles, 1..8, that a tile block asks L2 for (one bulk prefetch each, sm_90)
            before it waits on the previous kernel of the stream (programmatic dependent launch), so that a
            layer's first record copies overlap the previous kernel's tail; the arithmetic is unchanged.
        q_first: 1 to have a tile block read its queries before its first record copies instead of after
            them, so that those loads do not queue behind every block's records at the grid's start; the
            arithmetic is unchanged.
        run_max: 1 to take the exponentials of a tile against the running max itself (<= 2^TAU) instead of the
            tile's head maximum, which is then reduced only when a score exceeds the running max by TAU; the
            outputs differ from the default's by rounding only.
        merge_group: splits per merge group, 2..32: a two-level merge, where the last block of each group of
            splits (tile and exact parts grouped apart) merges the group's partials into one row while other groups
            still run, and the pair's last group merges one row per group; the sums are regrouped, so the outputs
            differ from the default's by rounding only.
        trace: 1 for a diagnostic kernel that writes a timeline of each block (``%globaltimer`` and ``clock64`` at
            its phases) into the module global ``kvarn_decode_trace_<suffix>`` (``tools/decode_trace.py``); the
            arithmetic is unchanged.

    A knob left None passes no define, so the default variant's kernel spec, cache entry and CUBIN are the
    shipped ones. A set knob joins the kernel names and the module name (``_ns2_mb5``), so variants coexist
    in one process and in the kernel cache. Text form (``str``, :meth:`parse`, ``$KVARN_DECODE_VARIANT``):
    ``"default"`` or ``"ring=2,min_blocks=5"``.
    """

    ring: int | None = None
    min_blocks: int | None = None
    min_blocks_g8: int | None = None
    prefetch: int | None = None
    q_first: int | None = None
    run_max: int | None = None
    merge_group: int | None = None
    trace: int | None = None

    # field -> (smallest, largest value, name tag, define)
    _KNOBS = {"ring": (2, 8, "ns", "KVD_NS"), "min_blocks": (1, 32, "mb", "KVD_MINB1"),
              "min_blocks_g8": (1, 32, "mbg", "KVD_MINB2"), "prefetch": (1, 8, "pf", "KVD_PREFETCH"),
              "q_first": (1, 1, "qf", "KVD_Q_FIRST"), "run_max": (1, 1, "rm", "KVD_RUN_MAX"),
              "merge_group": (2, 32, "mg", "KVD_MERGE_GROUP"), "trace": (1, 1, "tr", "KVD_TRACE")}

    def __post_init__(self) -> None:
        for name, (lo, hi, _, _) in self._KNOBS.items():
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi):
                raise ValueError(f"DecodeVariant.{name} must be None or an int in {lo}..{hi}, got {v!r}")

    def _set(self) -> list[tuple[str, int]]:
        return [(name, getattr(self, name)) for name in self._KNOBS if getattr(self, name) is not None]

    def __str__(self) -> str:
        return ",".join(f"{name}={v}" for name, v in self._set()) or "default"

    @classmethod
    def parse(cls, text: str) -> "DecodeVariant":
        """The variant of a text form: ``"default"`` (or empty) or ``knob=int`` items joined by commas."""
        if not isinstance(text, str):
            raise TypeError(f"a decode variant is given as a str, got {type(text).__name__}")
        text = text.strip()
        if text in ("", "default"):
            return cls()
        knobs: dict[str, int] = {}
        for item in text.split(","):
            name, eq, value = (part.strip() for part in item.partition("="))
            if not eq or name not in cls._KNOBS or name in knobs or not value.lstrip("-").isdigit():
                raise ValueError(f"decode variant {text!r}: expected 'default' or knob=int items joined by commas, "
                                 f"each knob once, knobs {sorted(cls._KNOBS)}")
            knobs[name] = int(value)
        return cls(**knobs)

    @property
    def suffix(self) -> str:
        """The part of the kernel and module names this variant adds ("" for the default)."""
        return "".join(f"_{self._KNOBS[name][2]}{v}" for name, v in self._set())

    def defines(self) -> dict[str, int]:
        """The kernel defines of the set knobs."""
        return {self._KNOBS[name][3]: v for name, v in self._set()}


DEFAULT_VARIANT = DecodeVariant()


def decode_variant() -> DecodeVariant:
    """The variant named by ``$KVARN_DECODE_VARIANT`` (A/B runs without code edits); the default when unset.

    Plans, workspaces and split choices made without an explicit variant use this one."""
    return DecodeVariant.parse(os.environ.get(VARIANT_ENV, ""))


# --- kernel specs ------------------------------------------------------------------------------
def _suffix(spec: TileSpec, variant: DecodeVariant = DEFAULT_VARIANT) -> str:
    lm = "_lm" if spec.quantizer == "lloyd_max" else ""
    return f"d{spec.head_dim}_t{spec.tile_tokens}_v{spec.v_bits}_s{spec.scale_bytes}{lm}{variant.suffix}"


def _f32_bits(x: float) -> str:
    return f"0x{struct.unpack('<I', struct.pack('<f', x))[0]:08x}u"


def lm_tables(book) -> tuple[float, tuple[int, ...], tuple[int, ...]]:
    """(s, th, tl): the two int8 levels of the lloyd_max codebook ``book`` used by the decode kernel.

    ``s = float32(127 / max|c|)``, ``th[i] = rint(s c_i)``, ``tl[i] = rint((s c_i - th[i]) * 254)``, so
    ``(th + tl / 254) / s`` is ``c`` within ``1 / (508 s)`` (1.7e-5 for the 4-bit book, in units of the
    axis RMS); the kernel multiplies each level with the query in its own int8 MMA."""
    top = max(abs(c) for c in book)
    sc = struct.unpack("<f", struct.pack("<f", 127.0 / top))[0]
    th = tuple(int(round(c * sc)) for c in book)
    tl = tuple(int(round((c * sc - h) * LM_TABLE_LEVEL)) for c, h in zip(book, th))
    assert max(map(abs, th + tl)) <= 127
    return sc, th, tl


def _byte_words(table) -> list[str]:
    """A 16-entry int8 table as 4 uint32 literals, entry i at byte i % 4 of word i // 4."""
    return [f"0x{sum((v & 0xFF) << (8 * j) for j, v in enumerate(table[4 * w:4 * w + 4])):08x}u" for w in range(4)]


def decode_spec(spec: TileSpec, variant: DecodeVariant = DEFAULT_VARIANT) -> KernelSpec:
    """The :class:`KernelSpec` of the decode kernel for one record layout (quantizer included) and variant.

    The record layout comes from ``spec`` (``KVD_REC``, ``KVD_OFF_<SECTION>``); lloyd_max adds its
    codebook tables (see :func:`lm_tables`; 2-bit V: ``c[0]``, ``a0 = c[1] - c[0]`` and
    ``g1 = c[2] - 2 c[1] + c[0]``, since the symmetric 4-level book is ``c[0] + a0 k + g1 bit1(k)``);
    ``variant`` adds its knobs' defines and name suffix (none for the default: the shipped spec)."""
    if not isinstance(variant, DecodeVariant):
        raise TypeError(f"variant must be a DecodeVariant, got {type(variant).__name__}")
    sfx = _suffix(spec, variant)
    defines = {"KVD_D": spec.head_dim, "KVD_T": spec.tile_tokens, "KVD_VB": spec.v_bits, "KVD_SB": spec.scale_bytes,
               "KVD_QZ": int(spec.quantizer == "lloyd_max"), "KVD_REC": spec.tile_nbytes, "KVD_SFX": sfx,
               **variant.defines()}
    for name in spec.section_names():
        defines[f"KVD_OFF_{name.upper()}"] = spec.offset(name)
    if spec.quantizer == "lloyd_max":
        sc, th, tl = lm_tables(spec.k_codebook)
        for w, (h, lo) in enumerate(zip(_byte_words(th), _byte_words(tl))):
            defines[f"KVD_KTH{w}"], defines[f"KVD_KTL{w}"] = h, lo
        defines["KVD_KSC"] = _f32_bits(1.0 / sc)
        c = spec.v_codebook
        if spec.v_bits == 4:
            sc, th, tl = lm_tables(c)
            for w, (h, lo) in enumerate(zip(_byte_words(th), _byte_words(tl))):
                defines[f"KVD_VTH{w}"], defines[f"KVD_VTL{w}"] = h, lo
            defines["KVD_VSC"] = _f32_bits(1.0 / sc)
        else:
            defines["KVD_VC0"] = _f32_bits(c[0])
            defines["KVD_VA0"] = _f32_bits(c[1] - c[0])
            defines["KVD_VG1"] = _f32_bits(c[2] - 2 * c[1] + c[0])
    return KernelSpec("decode.cu", (f"kvarn_decode_n1_{sfx}", f"kvarn_decode_n2_{sfx}"), defines=defines,
                      name=f"decode_{sfx}")


def decode_specs() -> list[KernelSpec]:
    """Every shipped variant: presets x head dims x scale dtypes x quantizers (48 modules)."""
    out = []
    for quantizer in QUANTIZERS:
        for preset in PRESETS:
            for d in HEAD_DIMS:
                for sd in SCALE_DTYPES:
                    out.append(decode_spec(TileSpec(preset=preset, head_dim=d, scale_dtype=sd, quantizer=quantizer)))
    return out


register("decode", decode_specs)


@dataclass(frozen=True)
class KernelLayout:
    """What the host needs from the compiled kernel (exported by it in ``kvarn_decode_layout_<suffix>``).

    smem_bytes: dynamic shared memory per block. exact_tokens: TE, sink/window tokens per exact block."""

    smem_bytes: int
    exact_tokens: int


@functools.lru_cache(maxsize=None)
def _layout_for(spec: TileSpec, target: str, variant: DecodeVariant) -> KernelLayout:
    ks = decode_spec(spec, variant)
    raw = cubin_global(build(ks, target).cubin, f"kvarn_decode_layout_{_suffix(spec, variant)}")
    smem, te = struct.unpack("<2i", raw)
    return KernelLayout(smem, te)


def _target(device: torch.device | None) -> str:
    """The compiler target of ``device``'s architecture; sm_90, the measured one, without a CUDA device."""
    return arch_target(device_arch(device.index) if device is not None and device.type == "cuda" else "sm_90")


def kernel_layout(spec: TileSpec, device: torch.device | None = None,
                  variant: DecodeVariant = DEFAULT_VARIANT) -> KernelLayout:
    """The layout numbers of the decode kernel for ``spec`` and ``variant``, read from its CUBIN (built for
    ``device``'s architecture, sm_90 without one; the numbers do not depend on the architecture)."""
    return _layout_for(spec, _target(device), variant)


def exact_blocks(spec: TileSpec, window: int, sink: int, device: torch.device | None = None,
                 variant: DecodeVariant | None = None) -> int:
    """E: exact (sink + window) blocks per (sequence, KV head) for buffer capacities W and SC (TE of the
    variant's kernel: a smaller ring can shrink it; None: :func:`decode_variant`)."""
    variant = decode_variant() if variant is None else variant
    return max(1, math.ceil((window + sink) / kernel_layout(spec, device, variant).exact_tokens))


# Per-SM limits of CUDA's occupancy arithmetic (cuda_occupancy.h) for the architectures the kernels are built
# for: registers, shared memory (the largest carveout), warps, blocks. Both allocate registers per warp in
# units of 256 from each of 4 sub-partitions and shared memory in units of 128 bytes, and the driver
# reserves 1 KiB of shared memory per block.
_SM_LIMITS = {80: (65536, 164 * 1024, 64, 32), 90: (65536, 228 * 1024, 64, 32)}
_REG_UNIT, _SUBPARTITIONS, _SMEM_UNIT, _SMEM_RESERVED = 256, 4, 128, 1024


@dataclass(frozen=True)
class Residency:
    """Resident blocks per SM of one decode kernel and the limits that set it (CUDA's occupancy arithmetic).

    blocks: the least of by_registers, by_smem, by_warps and the SM's block limit. registers: per thread, from
    the CUBIN. smem_bytes: shared memory one block takes: the kernel's dynamic layout + its static shared
    memory + the 1 KiB the driver reserves per block, rounded up to 128 bytes.
    """

    blocks: int
    by_registers: int
    by_smem: int
    by_warps: int
    registers: int
    smem_bytes: int


def residency(spec: TileSpec, variant: DecodeVariant = DEFAULT_VARIANT,
              arch: str | int = "sm_90") -> tuple[Residency, Residency]:
    """(G <= 4 kernel, G <= 8 kernel): resident blocks per SM of the decode kernels of ``spec`` and ``variant``
    built for ``arch`` (sm_80 or sm_90), from the CUBIN's registers and static shared memory and the layout's
    dynamic shared memory; no GPU needed. On a GPU, :func:`occupancy` asks the driver instead (a GPU test
    checks that the two agree)."""
    target = arch_target(arch)
    limits = _SM_LIMITS.get(normalize_arch(target))
    if limits is None:
        raise ValueError(f"no occupancy limits for {target}; known: {sorted(f'sm_{cc}' for cc in _SM_LIMITS)}")
    regs_sm, smem_sm, warps_sm, blocks_sm = limits
    ks = decode_spec(spec, variant)
    mod = build(ks, target)
    dyn = _layout_for(spec, target, variant).smem_bytes
    warps = NUM_THREADS // 32
    out = []
    for name in ks.kernel_names:
        res = mod.resources[name]
        per_warp = -(-res.registers * 32 // _REG_UNIT) * _REG_UNIT
        by_regs = regs_sm // _SUBPARTITIONS // per_warp * _SUBPARTITIONS // warps
        smem = -(-(dyn + res.shared_bytes + _SMEM_RESERVED) // _SMEM_UNIT) * _SMEM_UNIT
        by_smem, by_warps = smem_sm // smem, warps_sm // warps
        out.append(Residency(min(by_regs, by_smem, by_warps, blocks_sm), by_regs, by_smem, by_warps, res.registers,
                             smem))
    return out[0], out[1]


PDL_ENV = "KVARN_DECODE_PDL"


def programmatic_launch(device: torch.device) -> bool:
    """Whether decode launches use programmatic dependent launch (``Kernel.prepare(programmatic=True)``): on sm_90
    and later unless ``$KVARN_DECODE_PDL`` is 0 (graph-replayed b1/4k 10.99 -> 10.65 us on an H200, outputs
    bit-identical; the longer shapes within noise: docs/perf-notes.md, tools/decode_variants.py --pdl). The kernel
    waits for the previous kernel before any read either way."""
    text = os.environ.get(PDL_ENV, "").strip()
    if text not in ("", "0", "1"):
        raise ValueError(f"${PDL_ENV}={text!r}: choose 0 or 1")
    return text != "0" and _arch_of(device.index) >= 90


@functools.lru_cache(maxsize=None)
def _arch_of(index: int) -> int:
    from .runtime.arch import device_arch

    return device_arch(index)


def min_tiles_per_split() -> int:
    """MIN_TILES_PER_SPLIT, or the KVARN_DECODE_MIN_TPS environment override (A/B runs)."""
    v = os.environ.get("KVARN_DECODE_MIN_TPS")
    return max(1, int(v)) if v else MIN_TILES_PER_SPLIT


# --- validation --------------------------------------------------------------------------------
def _check_q(q: Any, batch: int, num_kv_heads: int, head_dim: int, device: torch.device | None) -> None:
    check_query(q, batch=batch, num_kv_heads=num_kv_heads, head_dim=head_dim, n_q=1, dtypes=Q_DTYPES,
                max_group=MAX_GROUP, n_q_why="one query per sequence")
    if q.device.type != "cuda":
        raise ValueError(f"q must be on a CUDA device, got {q.device}")
    if device is not None and q.device != device:
        raise ValueError(f"q is on {q.device} but the KV data is on {device}")


def _check_cache(cache: Any) -> None:
    if not isinstance(cache, KVarNCache):
        raise TypeError(f"cache must be a KVarNCache, got {type(cache).__name__}")




def _check_len_tensor(name: str, x: Any, batch: int, device: torch.device) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.int32 or x.dim() != 1 or x.shape[0] != batch or not x.is_contiguous():
        raise ValueError(f"{name} must be a contiguous int32 tensor [batch={batch}], got {x.dtype} {list(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but the KV data is on {device}")


# --- workspace ---------------------------------------------------------------------------------
def _kernel_key(spec: TileSpec, device: torch.device, variant: DecodeVariant) -> tuple:
    """What a loaded decode kernel depends on: the caches of kernels and of their occupancy are keyed by it."""
    return (spec.preset, spec.head_dim, spec.scale_dtype, spec.quantizer, variant, device.index)


def occupancy(spec: TileSpec, device: torch.device, variant: DecodeVariant = DEFAULT_VARIANT) -> int:
    """Resident blocks per SM of the G <= 4 decode kernel of ``spec`` and ``variant`` on ``device``: the driver's
    occupancy query of the loaded kernel at its dynamic shared memory (:func:`residency`'s arithmetic on the
    same CUBIN if the query fails)."""
    key = _kernel_key(spec, device, variant)
    n = _occupancy_cache.get(key)
    if n is None:
        n = _occupancy_cache[key] = _query_occupancy(spec, device, variant)
    return n


_occupancy_cache: dict = {}  # occupancy's answers: asked per launch set-up (exact_blocks_last), fixed per kernel


def _query_occupancy(spec: TileSpec, device: torch.device, variant: DecodeVariant) -> int:
    kernel = _kernels(spec, device, variant)[0]
    try:
        from cuda.bindings import driver

        status, n = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            kernel._func, NUM_THREADS, kernel_layout(spec, device, variant).smem_bytes)
        if int(status) == 0 and n > 0:
            return int(n)
    except Exception:  # the arithmetic below
        pass
    return residency(spec, variant, _target(device))[0].blocks


class DecodeWorkspace:
    """Partials buffers, tickets and the split counts for one (batch, kv heads, head_dim, group).

    ``S = splits`` tile splits and ``E = exact`` exact (sink + window) blocks per (sequence, KV head):
    ``po`` float32 [B, Hkv, S+E+M, G, D], ``pm`` / ``pl`` float32 [B, Hkv, S+E+M, G]; ``tickets`` int32
    [B, Hkv, 1+M], zero between launches (the merging block resets its ticket); M: :func:`merge_groups` (0 but
    for the ``merge_group`` variant). Reused across layers and
    steps (launches run in stream order; two streams must not share a workspace); graphs capture its
    pointers, so it must stay alive. ``min_tps``: fewest tiles per split block (passed to the kernel).
    ``variant``: the kernel variant the splits and E were planned for, which every launch through this
    workspace runs (default :func:`decode_variant`).
    """

    def __init__(self, device: torch.device, batch: int, num_kv_heads: int, group: int, head_dim: int,
                 splits: int, exact: int = 1, min_tps: int | None = None, variant: DecodeVariant | None = None):
        if variant is not None and not isinstance(variant, DecodeVariant):
            raise TypeError(f"variant must be a DecodeVariant or None, got {type(variant).__name__}")
        self.batch, self.num_kv_heads, self.group, self.head_dim, self.splits = batch, num_kv_heads, group, head_dim, splits
        self.exact = exact
        self.min_tps = min_tps or min_tiles_per_split()
        self.variant = decode_variant() if variant is None else variant
        groups = merge_groups(splits, exact, self.variant)
        n = batch * num_kv_heads * (splits + exact + groups) * group
        self.po = torch.empty(n * head_dim, dtype=torch.float32, device=device)
        self.pm = torch.empty(n, dtype=torch.float32, device=device)
        self.pl = torch.empty(n, dtype=torch.float32, device=device)
        self.tickets = torch.zeros(batch * num_kv_heads * (1 + groups), dtype=torch.int32, device=device)


def merge_groups(splits: int, exact: int, variant: DecodeVariant) -> int:
    """Merge groups per (sequence, KV head) of ``variant`` (0 without ``merge_group``): the tile splits' groups and
    the exact blocks', each a partial row and a ticket of the workspace (``csrc/decode.cu``, ``pair_rows``)."""
    g = variant.merge_group
    return 0 if g is None else -(-splits // g) + -(-exact // g)


# Model constants of choose_splits (unit: the SM time per tile when the SM's issue is saturated).
SATURATING_BLOCKS = 4.0      # resident blocks an SM needs to saturate issue; k < that run at k / 4 (fit: perf-notes)
SPLIT_COST = 0.02            # merge work and partial traffic per extra split


def split_cost(s: int, pairs: int, cap_tiles: int, sms: int, occupancy: int, min_tps: int,
               saturation: float = SATURATING_BLOCKS) -> float:
    """Modelled makespan of ``s`` tile splits: the busiest SM's blocks in waves of resident blocks.

    ``per_sm = ceil(pairs x used splits / SMs)`` blocks of ``tps`` tiles land on the busiest SM and run
    in waves of ``occupancy``; a wave of ``k`` resident blocks takes ``tps x k x max(1, saturation / k)``
    (below saturation each block runs at its own latency-bound speed), so a partial last wave costs as
    much as a full one.
    """
    tps = max(min_tps, math.ceil(cap_tiles / s))
    used = math.ceil(cap_tiles / tps)
    per_sm = math.ceil(pairs * used / sms)
    full, rest = divmod(per_sm, occupancy)
    waves = [occupancy] * full + ([rest] if rest else [])
    return tps * sum(k * max(1.0, saturation / k) for k in waves) + SPLIT_COST * s


def plan_splits(pairs: int, cap_tiles: int, sms: int, occupancy: int, min_tps: int,
                saturation: float = SATURATING_BLOCKS) -> int:
    """The S in 1..s_cap with the least :func:`split_cost` (the smallest on ties), raised to
    ceil(cap_tiles / MAX_TILES_PER_SPLIT) where that fits in MAX_WAVES_SHORT_BLOCKS waves.

    s_cap is MAX_WAVES waves of ``occupancy`` resident blocks on ``sms`` SMs for ``pairs`` (sequence, KV head)
    pairs, and at most ceil(cap_tiles / min_tps). The raise binds only when the modelled choice's blocks
    are long, i.e. at large batch x context: there the model's waves are not what the GPU runs (blocks start as
    slots free, so shorter blocks balance the SMs' memory traffic and shorten the tail)."""
    s_cap = max(1, min(MAX_WAVES * sms * occupancy // pairs, math.ceil(cap_tiles / min_tps)))
    modelled = min(range(1, s_cap + 1),
                   key=lambda s: (split_cost(s, pairs, cap_tiles, sms, occupancy, min_tps, saturation), s))
    short = min(math.ceil(cap_tiles / MAX_TILES_PER_SPLIT), max(1, MAX_WAVES_SHORT_BLOCKS * sms * occupancy // pairs))
    return max(modelled, short)


def split_saturation(variant: DecodeVariant, occupancy: int) -> float:
    """Resident blocks at which the split model has a variant saturate its SM.

    SATURATING_BLOCKS is the fit of the shipped kernel (per-SM throughput grew with the resident blocks up to
    the 4 it can hold: the split sweeps of docs/perf-notes.md), so it only says that saturation needs at least 4.
    An occupancy variant is modelled as saturating at its own residency: the latency-bound hypothesis that its
    A/B run tests (docs/perf-notes.md, "Decode occupancy"); the shipped kernel's plans stay as they were.
    """
    return SATURATING_BLOCKS if variant == DEFAULT_VARIANT else max(SATURATING_BLOCKS, occupancy)


def choose_splits(batch: int, num_kv_heads: int, cap_tiles: int, device: torch.device, spec: TileSpec,
                  min_tps: int | None = None, variant: DecodeVariant | None = None) -> int:
    """Tile splits S per (sequence, KV head), minimizing :func:`split_cost` at the capacity.

    The kernel's tile loop is issue-bound per SM (docs/perf-notes.md, decode), so the makespan is set by
    the busiest SM's tile count, slowed when too few blocks are resident to fill the SM's issue slots
    (a partial last wave). The residency is the one ``variant``'s compiled G <= 4 kernel has on ``device``
    (:func:`occupancy`; None: :func:`decode_variant`), its saturation :func:`split_saturation`.
    S is capped at MAX_WAVES waves of resident blocks and at ceil(cap / min_tps), then raised so that no
    block covers more than MAX_TILES_PER_SPLIT tiles (within MAX_WAVES_SHORT_BLOCKS waves): :func:`plan_splits`.
    """
    min_tps = min_tps or min_tiles_per_split()
    variant = decode_variant() if variant is None else variant
    sms = sm_count(device)
    occ = occupancy(spec, device, variant)
    return plan_splits(batch * num_kv_heads, cap_tiles, sms, occ, min_tps, split_saturation(variant, occ))


# The plans' kernel where no variant is named: the ring-2 kernel (one iteration of records in flight per block
# instead of two, a ring slot less of shared memory: 5 resident blocks at d128 where the shipped kernel holds 4)
# when the launch is at least RING2_MIN_WAVES waves of its resident blocks, so that blocks wait for slots and
# the SMs' extra block is what hides the memory latency. Measured (docs/perf-notes.md, "Decode: the final
# merge's L2 round trips", tools/decode_variants.py): 0.955x the shipped kernel's time at b16/16k and b16/32k
# (2,176 and 3,200 blocks), 1.02x at b1/128k (584 blocks, about one wave) and 1.02x at b1/4k (200).
RING2_VARIANT = DecodeVariant(ring=2)
RING2_MIN_WAVES = 2
# Below that, the two-level merge (merge_group) where a pair has at least MERGE_GROUP_MIN_SPLITS tile splits: in a
# grid of about one wave the pair's last block merges S + E rows after every other block has ended, and with
# groups of 12 splits the groups' merges run while other blocks still stream records. Measured on the
# H100 against the shipped kernel at equal splits (docs/perf-notes.md, "Twenty-sixth session"): b1/4k (S = 17)
# 1.06x, b1/8k (S = 33) 0.973x, b1/12k (49) 0.928x, b1/16k-128k (65) 0.90-0.96x; groups of 12 the fastest of
# 6, 8, 12, 16 and 24 at every one of these; at batch 16 (ring 2's grids) 0.998-1.005x.
MERGE_GROUP_VARIANT = DecodeVariant(merge_group=12)
MERGE_GROUP_MIN_SPLITS = 33


def plan_variant(batch: int, num_kv_heads: int, cap_tiles: int, window: int, sink: int, device: torch.device,
                 spec: TileSpec, min_tps: int | None = None) -> DecodeVariant:
    """The kernel variant a plan of this shape runs when none is named: ``$KVARN_DECODE_VARIANT`` when set
    (A/B runs); else, from the shipped plan (S = :func:`choose_splits`, E = :func:`exact_blocks` for buffer
    capacities ``window`` and ``sink``, a grid of ``batch * num_kv_heads * (S + E)`` blocks on ``device``):
    :data:`RING2_VARIANT` where it holds more resident blocks per SM than the shipped kernel and the grid is at
    least RING2_MIN_WAVES waves of them; else :data:`MERGE_GROUP_VARIANT` where S >= MERGE_GROUP_MIN_SPLITS and
    it holds as many resident blocks as the shipped kernel; else the shipped kernel."""
    if os.environ.get(VARIANT_ENV, "").strip():
        return decode_variant()
    occ = occupancy(spec, device)
    S = choose_splits(batch, num_kv_heads, cap_tiles, device, spec, min_tps, DEFAULT_VARIANT)
    blocks = batch * num_kv_heads * (S + exact_blocks(spec, window, sink, device, DEFAULT_VARIANT))
    occ2 = occupancy(spec, device, RING2_VARIANT)
    if occ2 > occ and blocks >= RING2_MIN_WAVES * sm_count(device) * occ2:
        return RING2_VARIANT
    if S >= MERGE_GROUP_MIN_SPLITS and occupancy(spec, device, MERGE_GROUP_VARIANT) >= occ:
        return MERGE_GROUP_VARIANT
    return DEFAULT_VARIANT


# Grids of at least EXACT_LAST_MIN_WAVES waves of resident blocks take every tile block before the exact blocks
# (kernel flags bit 2), so the short exact blocks fill the last wave's tail; smaller grids take each (sequence,
# KV head)'s blocks in turn. Measured (docs/perf-notes.md, "Exact blocks last"): 0.87-0.95x at b16/4k-32k, while
# at batch 1 (one wave) the exact blocks after the tile blocks put them on the step's path (b1/16k +2.7 us).
EXACT_LAST_MIN_WAVES = 2


def exact_blocks_last(blocks: int, device: torch.device, spec: TileSpec, variant: DecodeVariant) -> bool:
    """Whether a launch of ``blocks`` blocks of ``variant``'s kernel dispatches its exact blocks last: at least
    EXACT_LAST_MIN_WAVES waves of the kernel's resident blocks (:func:`occupancy`) on ``device``."""
    return blocks >= EXACT_LAST_MIN_WAVES * sm_count(device) * occupancy(spec, device, variant)


_kernel_cache: dict = {}


def _kernels(spec: TileSpec, device: torch.device, variant: DecodeVariant = DEFAULT_VARIANT):
    """(kernel for G <= 4, kernel for G <= 8) of ``spec`` and ``variant`` on ``device``."""
    key = _kernel_key(spec, device, variant)
    ks = _kernel_cache.get(key)
    if ks is None:
        ks_spec = decode_spec(spec, variant)
        mod = get_module(ks_spec, device)
        ks = tuple(mod.kernel(name, _SIG) for name in ks_spec.kernel_names)
        # Opt in to the dynamic shared memory now, so that the occupancy query sees it.
        smem = kernel_layout(spec, device, variant).smem_bytes
        for k in ks:
            k.prepare((1, 1, 1), NUM_THREADS, (0,) * 15 + (0,) * 10 + (1.0,), shared_mem=smem)
        _kernel_cache[key] = ks
    return ks


def identity_tile_table(pool: torch.Tensor) -> torch.Tensor:
    """int32 [B, cap] with entry [b, g] = b * cap + g: the record slot of tile g of sequence b in ``pool``
    [B, cap, Hkv, nbytes] (record (b, g, h) is ``pool.view(-1, Hkv, nbytes)[slot, h]``).

    The table of a plain pool (``KVarNCache.tile_table`` is the same for the cache's own pool; a paged pool
    passes its own table instead)."""
    B, cap = pool.shape[:2]
    return torch.arange(B * cap, dtype=torch.int32, device=pool.device).view(B, cap)


# --- low-level entry ---------------------------------------------------------------------------
def decode_attention_ragged(
    q: torch.Tensor,
    tiles: torch.Tensor,
    window_k: torch.Tensor,
    window_v: torch.Tensor,
    sink_k: torch.Tensor,
    sink_v: torch.Tensor,
    n_tiles: torch.Tensor,
    window_len: torch.Tensor,
    sink_len: torch.Tensor,
    spec: TileSpec,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    workspace: DecodeWorkspace | None = None,
    tile_table: torch.Tensor | None = None,
    _prepared: dict | None = None,
) -> torch.Tensor:
    """Decode attention for a ragged batch with per-sequence lengths on the device.

    Args:
        q: [B, Hq, 1, D] float16/bfloat16 CUDA tensor, Hq = Hkv * G with G in 1..8.
        tiles: uint8 [B, cap_tiles, Hkv, spec.tile_nbytes], the record pool: slot s = b * cap_tiles + i
            holds ``tiles[b, i]``.
        window_k, window_v: [B, Hkv, W, D] float16/bfloat16 (the newest tokens, valid prefix window_len[b]).
        sink_k, sink_v: [B, Hkv, SC, D] same dtype (valid prefix sink_len[b]; SC may be 0).
        n_tiles, window_len, sink_len: int32 [B] on the same device; values are clamped to the buffer
            capacities in the kernel. Token order per sequence: sink, tiles, window.
        spec: the record layout.
        scale: softmax scale, default 1/sqrt(D).
        out: optional [B, Hq, 1, D] output in q's dtype.
        workspace: partials buffers and tickets (a :class:`DecodeWorkspace` for this shape), whose kernel
            variant the launch runs; allocated if None, for :func:`decode_variant` (do not let that happen
            during graph capture: pass one).
        tile_table: int32 [B, cap_tiles] contiguous, entry [b, i] = the pool slot of tile i of sequence b
            (slots outside [0, B * cap_tiles) are clamped into it); default :func:`identity_tile_table`.

    Returns ``out`` [B, Hq, 1, D] in q's dtype. One kernel launch on torch's current stream; never syncs.
    A sequence with no token at all gets zeros.
    """
    launch, out = _ragged_launch(q, tiles, window_k, window_v, sink_k, sink_v, n_tiles, window_len, sink_len, spec,
                                 scale, out, workspace, tile_table, _prepared)
    launch.launch()
    return out


def _ragged_launch(q, tiles, window_k, window_v, sink_k, sink_v, n_tiles, window_len, sink_len, spec, scale, out,
                   workspace, tile_table, _prepared) -> tuple[Any, torch.Tensor]:
    """decode_attention_ragged's checks and its prepared launch (from ``_prepared`` when it holds one for these
    arguments, else a new one, stored there): (launch, out), not yet launched."""
    if not isinstance(spec, TileSpec):
        raise TypeError(f"spec must be a TileSpec, got {type(spec).__name__}")
    if not isinstance(tiles, torch.Tensor):
        raise TypeError(f"tiles must be a torch.Tensor, got {type(tiles).__name__}")
    if tiles.dtype != torch.uint8 or tiles.dim() != 4 or tiles.shape[3] != spec.tile_nbytes or not tiles.is_contiguous():
        raise ValueError(
            f"tiles must be a contiguous uint8 [batch, cap_tiles, num_kv_heads, {spec.tile_nbytes}], "
            f"got {tiles.dtype} {list(tiles.shape)}"
        )
    B, cap, Hkv, _ = tiles.shape
    D = spec.head_dim
    device = tiles.device
    if device.type != "cuda":
        raise ValueError(f"tiles must be on a CUDA device, got {device}")
    if cap < 1 or tiles.data_ptr() % 16:
        raise ValueError(f"tiles must hold at least one tile per sequence and be 16-byte aligned, got {list(tiles.shape)}")
    _check_q(q, B, Hkv, D, device)
    for name, x, cap_name in (("window_k", window_k, "W"), ("window_v", window_v, "W"), ("sink_k", sink_k, "SC"),
                              ("sink_v", sink_v, "SC")):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in (torch.float16, torch.bfloat16) or x.dim() != 4 or tuple(x.shape[:2]) != (B, Hkv) or x.shape[3] != D:
            raise ValueError(f"{name} must be float16/bfloat16 [{B}, {Hkv}, {cap_name}, {D}], got {x.dtype} {list(x.shape)}")
        if not x.is_contiguous() or x.data_ptr() % 16:
            raise ValueError(f"{name} must be contiguous and 16-byte aligned")
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but tiles are on {device}")
    if window_k.shape != window_v.shape or sink_k.shape != sink_v.shape:
        raise ValueError("window_k/window_v and sink_k/sink_v must have matching shapes")
    if len({window_k.dtype, window_v.dtype, sink_k.dtype, sink_v.dtype}) != 1:
        raise ValueError("window and sink tensors must share one dtype")
    for name, x in (("n_tiles", n_tiles), ("window_len", window_len), ("sink_len", sink_len)):
        _check_len_tensor(name, x, B, device)
    if tile_table is None:
        tile_table = identity_tile_table(tiles)
    elif (not isinstance(tile_table, torch.Tensor) or tile_table.dtype != torch.int32
          or tuple(tile_table.shape) != (B, cap) or not tile_table.is_contiguous() or tile_table.device != device):
        raise ValueError(f"tile_table must be a contiguous int32 tensor [{B}, {cap}] on {device}, got "
                         f"{getattr(tile_table, 'dtype', type(tile_table).__name__)} {list(getattr(tile_table, 'shape', []))}")
    scale = resolve_scale(scale, D)
    Hq = q.shape[1]
    G = Hq // Hkv
    if out is None:
        out = torch.empty(B, Hq, 1, D, dtype=q.dtype, device=device)
    elif (not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype or out.device != device
          or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {q.dtype} tensor {list(q.shape)} on {device}")
    variant = (plan_variant(B, Hkv, cap, window_k.shape[2], sink_k.shape[2], device, spec) if workspace is None
               else workspace.variant)
    E = exact_blocks(spec, window_k.shape[2], sink_k.shape[2], device, variant)
    if workspace is None:
        workspace = DecodeWorkspace(device, B, Hkv, G, D, choose_splits(B, Hkv, cap, device, spec, variant=variant), E,
                                    variant=variant)
    elif (workspace.batch, workspace.num_kv_heads, workspace.group, workspace.head_dim, workspace.exact) != (B, Hkv, G, D, E):
        raise ValueError(
            f"workspace is for batch={workspace.batch}, kv_heads={workspace.num_kv_heads}, group={workspace.group}, "
            f"head_dim={workspace.head_dim}, exact blocks={workspace.exact}; this call needs {B}, {Hkv}, {G}, {D}, {E}"
        )
    q = q.contiguous()
    S = workspace.splits
    flags = ((1 if q.dtype == torch.bfloat16 else 0) | (2 if window_k.dtype == torch.bfloat16 else 0)
             | (4 if exact_blocks_last(B * Hkv * (S + E), device, spec, variant) else 0))
    args = (q, tiles, tile_table, window_k, window_v, sink_k, sink_v, n_tiles, window_len, sink_len, workspace.po,
            workspace.pm, workspace.pl, workspace.tickets, out, Hkv, G, cap, B * cap, window_k.shape[2],
            sink_k.shape[2], S, E, workspace.min_tps, flags, scale)
    pdl = programmatic_launch(device)
    key = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args) + (spec, variant, pdl)
    launch = None if _prepared is None else _prepared.get(key)
    if launch is None:
        kernel = _kernels(spec, device, variant)[0 if G <= 4 else 1]
        launch = kernel.prepare((S + E, Hkv, B), NUM_THREADS, args,
                                shared_mem=kernel_layout(spec, device, variant).smem_bytes, programmatic=pdl)
        if _prepared is not None:
            if len(_prepared) > 256:
                _prepared.clear()
            _prepared[key] = launch
    return launch, out


# --- per-cache plan ----------------------------------------------------------------------------
class DecodePlan:
    """Device-side decode state of one :class:`KVarNCache`: lengths, workspaces, prepared launches.

    ``lens``: int32 [num_layers, 3, B] on the cache's device, (n_tiles, window_len, sink_len) per layer
    and sequence: the cache's own ``device_lengths()``, current in stream order after every write of
    the cache, so a launch needs no refresh. Two caches have two plans and never share buffers.

    Args:
        cache: a KVarNCache on a CUDA device.
        splits: tile splits per (sequence, KV head); default from :func:`choose_splits`.
        min_tps: fewest tiles per split block; default :func:`min_tiles_per_split`.
        variant: the kernel variant every launch of the plan runs (:class:`DecodeVariant`); default: per
            workspace, :func:`plan_variant` of the cache's shape (``$KVARN_DECODE_VARIANT`` when set).
    """

    def __init__(self, cache: KVarNCache, splits: int | None = None, min_tps: int | None = None,
                 variant: DecodeVariant | None = None):
        _check_cache(cache)
        if cache.device.type != "cuda":
            raise ValueError(f"cache must be on a CUDA device for decode_attention, got {cache.device}")
        if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int) or splits < 1):
            raise ValueError(f"splits must be a positive int, got {splits!r}")
        self.cache = cache
        self.device = cache.device
        self.splits_override = splits
        if min_tps is not None and (isinstance(min_tps, bool) or not isinstance(min_tps, int) or min_tps < 1):
            raise ValueError(f"min_tps must be a positive int, got {min_tps!r}")
        self.min_tps = min_tps
        if variant is not None and not isinstance(variant, DecodeVariant):
            raise TypeError(f"variant must be a DecodeVariant or None, got {type(variant).__name__}")
        self.variant = variant  # None: plan_variant, per workspace
        B = cache.batch_size
        self.lens = cache.device_lengths()
        # Stands in for a pool that has no tiles yet (no max_seq_len): the kernel needs a valid pointer,
        # and allocating it here keeps launch() free of allocations.
        self._empty_pool = torch.zeros(B, 1, cache.num_kv_heads, cache.spec.tile_nbytes, dtype=torch.uint8,
                                       device=self.device)
        self._empty_table = identity_tile_table(self._empty_pool)
        self._workspaces: dict[tuple[int, int], DecodeWorkspace] = {}
        self._prepared: dict = {}
        self._fast: dict[tuple, _LayerLaunch] = {}  # (layer, scale as passed) -> the layer's own launch

    def refresh(self, layer: int | None = None) -> None:
        """Check ``layer`` (an int in range, or None for every layer); nothing to copy.

        Earlier plans held a copy of the lengths that this call updated (an H2D copy per layer and step);
        ``lens`` is now the cache's device lengths, always current, so callers written for that may
        keep calling it at no cost and new code need not."""
        if layer is not None:
            self.cache.num_tiles(layer)  # raises ValueError naming the layer

    def workspace(self, group: int) -> DecodeWorkspace:
        cap = self.cache.tile_pool(0).shape[1]
        key = (group, cap)
        ws = self._workspaces.get(key)
        if ws is None:
            c = self.cache
            buf = c.buffers(0)
            W, SC = buf["window_k"].shape[2], buf["sink_k"].shape[2]
            v = self.variant
            if v is None:
                v = plan_variant(c.batch_size, c.num_kv_heads, max(cap, 1), W, SC, self.device, c.spec, self.min_tps)
            s = self.splits_override or choose_splits(c.batch_size, c.num_kv_heads, max(cap, 1), self.device, c.spec,
                                                      self.min_tps, v)
            e = exact_blocks(c.spec, W, SC, self.device, v)
            ws = self._workspaces[key] = DecodeWorkspace(self.device, c.batch_size, c.num_kv_heads, group, c.head_dim,
                                                         s, e, self.min_tps, v)
        return ws

    def launch(self, q: torch.Tensor, layer: int, out: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Enqueue decode for ``layer``, reading the device lengths when it runs; capturable.

        Plan once, run many: the first call for a (layer, scale) runs every check of
        :func:`decode_attention_ragged` and keeps the prepared launch; a later call whose q and out are
        contiguous tensors of the same shape and dtype on the cache's device, while the layer's pool
        (and layer 0's, which sizes the workspace) has not moved, only writes the two addresses and
        launches. Any other call takes the full path again."""
        c = self.cache
        # (keys are compared by value: only a plain int layer and a float or None scale may match, as True
        # would match 1)
        own = type(layer) is int and (scale is None or type(scale) is float)
        ent = self._fast.get((layer, scale)) if own else None
        if (ent is not None and type(q) is torch.Tensor and type(out) is torch.Tensor
                and q.shape == ent.shape and out.shape == ent.shape and q.dtype is ent.dtype and out.dtype is ent.dtype
                and q.device == self.device and out.device == self.device and q.is_contiguous() and out.is_contiguous()
                and c._layers[layer] is ent.st and ent.st.tiles is ent.pool and c._layers[0].tiles is ent.pool0):
            if c._overlap:  # the layer's appends of a deferred_checks(overlap_appends=True) block first
                c._await_layer(ent.st)
            ent.set_q(q.data_ptr())
            ent.set_out(out.data_ptr())
            ent.launch.launch()
            return out
        pool, table = c.tile_pool(layer), c.tile_table(layer)
        st, pool0 = c._layers[layer], c._layers[0].tiles
        if pool.shape[1] == 0:  # an empty pool (no max_seq_len, nothing compressed yet) has no pointer
            pool, table = self._empty_pool, self._empty_table
        buf = c.buffers(layer)
        G = q.shape[1] // c.num_kv_heads
        # a launch of the layer's own, not one shared through _prepared: its q and out get rewritten
        own = own and type(q) is torch.Tensor and type(out) is torch.Tensor and q.is_contiguous()
        launch, out = _ragged_launch(
            q, pool, buf["window_k"], buf["window_v"], buf["sink_k"], buf["sink_v"], self.lens[layer, 0], self.lens[layer, 1],
            self.lens[layer, 2], c.spec, scale, out, self.workspace(G), table, None if own else self._prepared,
        )
        launch.launch()
        if own:
            self._fast[(layer, scale)] = _LayerLaunch(launch, st, st.tiles, pool0, q.shape, q.dtype)
        return out


class _LayerLaunch:
    """DecodePlan's prepared launch of one layer, and what it was prepared for (the layer state, its pool and
    layer 0's pool, the shape and dtype of q and out); per call only the q and out addresses change."""

    __slots__ = ("launch", "st", "pool", "pool0", "shape", "dtype", "set_q", "set_out")

    def __init__(self, launch, st, pool: torch.Tensor, pool0: torch.Tensor, shape: torch.Size, dtype: torch.dtype):
        self.launch, self.st, self.pool, self.pool0, self.shape, self.dtype = launch, st, pool, pool0, shape, dtype
        self.set_q = launch.writer(_ARG_Q, 1)
        self.set_out = launch.writer(_ARG_OUT, 1)


def get_plan(cache: KVarNCache) -> DecodePlan:
    """The plan attached to ``cache`` (created on first use, freed with the cache: it is an attribute of the
    cache, since a plan holds its cache and a weak-keyed table of plans would keep every cache alive)."""
    _check_cache(cache)
    plan = cache._decode_plan
    if plan is None:
        plan = cache._decode_plan = DecodePlan(cache)
    return plan


def decode_attention(q: torch.Tensor, cache: KVarNCache, layer: int, scale: float | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new token per sequence over ``layer`` of ``cache``.

    Args:
        q: [batch, num_q_heads, 1, head_dim] float16/bfloat16 on the cache's CUDA device; num_q_heads
            is num_kv_heads x G with G in 1..8 (query head h reads KV head h // G).
        cache: a KVarNCache on a CUDA device (any preset, head_dim, scale dtype, quantizer; sink tokens allowed).
        layer: layer index.
        scale: softmax scale, default 1/sqrt(head_dim).
        out: optional output tensor like q.

    Returns [batch, num_q_heads, 1, head_dim] in q's dtype, equal to ``reference.attention`` (within
    ~1e-3 relative). The layer must hold at least one token.
    """
    _check_cache(cache)
    _check_q(q, cache.batch_size, cache.num_kv_heads, cache.head_dim, None)
    if cache.device.type != "cuda":
        raise ValueError(f"cache must be on a CUDA device for decode_attention, got {cache.device}")
    if q.device != cache.device:
        raise ValueError(f"q is on {q.device} but the cache is on {cache.device}")
    if cache.seq_len(layer) < 1:
        raise ValueError(f"layer {layer} of the cache is empty; decode needs at least one token")
    scale = resolve_scale(scale, cache.head_dim)
    plan = get_plan(cache)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return plan.launch(q, layer, out, scale)


class DecodeGraph:
    """One decode call of one layer captured in a CUDA graph; ``replay()`` per step.

    The graph holds only the kernel launch, which reads the cache's device lengths; per step ``replay``
    copies ``q`` into the static input (when given) and replays. ``cache.append`` (with any tile
    compression) runs eagerly between replays, on the same stream.

    Args:
        cache: a KVarNCache on CUDA with ``max_seq_len`` set (preallocated pool: its address is captured).
        layer: the layer to decode.
        num_q_heads: Hq (a multiple of num_kv_heads, group <= 8).
        dtype: query dtype, float16 or bfloat16.
        scale: softmax scale.
        plan: the cache's plan (default: the one attached to the cache).

    Attributes: ``q`` (static input [B, Hq, 1, D]), ``out`` (static output), ``graph`` (torch.cuda.CUDAGraph).
    """

    def __init__(self, cache: KVarNCache, layer: int, num_q_heads: int, dtype: torch.dtype = torch.float16,
                 scale: float | None = None, plan: DecodePlan | None = None):
        _check_cache(cache)
        if cache.max_seq_len is None:
            raise ValueError("cache must be created with max_seq_len (a preallocated tile pool) to capture decode in a CUDA graph")
        if cache.device.type != "cuda":
            raise ValueError(f"cache must be on a CUDA device, got {cache.device}")
        cache.num_tiles(layer)  # validates layer
        if dtype not in Q_DTYPES:
            raise TypeError(f"dtype must be one of {list(Q_DTYPES)}, got {dtype}")
        Hkv = cache.num_kv_heads
        if isinstance(num_q_heads, bool) or not isinstance(num_q_heads, int) or num_q_heads < Hkv or num_q_heads % Hkv \
                or num_q_heads // Hkv > MAX_GROUP:
            raise ValueError(f"num_q_heads must be num_kv_heads={Hkv} x group 1..{MAX_GROUP}, got {num_q_heads!r}")
        self.cache, self.layer = cache, layer
        self.scale = resolve_scale(scale, cache.head_dim)
        self.plan = plan or get_plan(cache)
        dev = cache.device
        self.q = torch.zeros(cache.batch_size, num_q_heads, 1, cache.head_dim, dtype=dtype, device=dev)
        self.out = torch.zeros_like(self.q)
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up: builds the module, workspace and prepared launches
            self.plan.launch(self.q, layer, self.out, self.scale)
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.plan.launch(self.q, layer, self.out, self.scale)

    def replay(self, q: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step: optionally copy ``q`` in, replay. Returns the static ``out``."""
        if q is not None:
            self.q.copy_(q)
        self.graph.replay()
        return self.out
