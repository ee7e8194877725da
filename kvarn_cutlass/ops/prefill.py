"""The fused chunked-prefill kernel family (``csrc/prefill_fused.cu``): configs, specs, launch.

One NVRTC module per variant: the record layout (``format.TileSpec``: head_dim, tile tokens, V bits,
scale dtype, quantizer; every section offset is passed as a define), the cache and query dtypes, and
the launch config (:class:`FusedConfig`: rows per consumer warp, consumer warps, tokens per block). Configs are emitted here and chosen from the tuned table
``gemm_configs/prefill_sm<arch>.json`` (written by ``python -m kvarn_cutlass.ops.prefill_tune``), else from
:data:`DEFAULT_CONFIGS`. The kernel reports its own shared-memory size (the module global
``kvarn_prefill_smem_bytes``), so the layout formula exists once, in the .cu file.
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
import warnings
from dataclasses import dataclass

import torch

from ..format import HEAD_DIMS, PRESETS, QUANTIZERS, SCALE_DTYPES, TileSpec
from ..runtime import KernelSpec, register
from ..runtime.compiler import cutlass_include_dirs
from ..runtime.configs import CONFIG_ENV

__all__ = ["FusedConfig", "CANDIDATES", "DEFAULT_CONFIGS", "fused_spec", "fused_specs", "select_config",
           "table_path", "smem_bytes", "FusedPrefillKernel", "MAX_SMEM_PER_BLOCK"]

KERNEL_SYMBOL = "kvarn_prefill_fused"
MERGE_SYMBOL = "kvarn_prefill_merge"
SMEM_SYMBOL = "kvarn_prefill_smem_bytes"
MAX_SMEM_PER_BLOCK = 227 * 1024  # sm_90 / sm_80 opt-in limit per block
LOG2E = 1.4426950408889634
DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16"}
K_OPERANDS = ("f16", "int8")
Q_OPERANDS = ("smem", "regs")

_SIG = (
    "ptr q", "i64 q_sb", "i64 q_sh", "i64 q_sn",
    "ptr out", "i64 o_sb", "i64 o_sh", "i64 o_sn",
    "ptr pool", "ptr tile_table", "i32 table_stride", "i32 n_tiles",
    "ptr sink_k", "ptr sink_v", "i32 sink_cap", "i32 sink_len",
    "ptr win_k", "ptr win_v", "i32 win_cap", "i32 win_len",
    "ptr chunk_k", "ptr chunk_v", "i64 ck_sb", "i64 ck_sh", "i64 ck_st", "i64 cv_sb", "i64 cv_sh", "i64 cv_st",
    "i32 Hkv", "i32 G", "i32 n", "f32 scale_log2", "i32 batch", "i32 heavy_first", "ptr ws", "i32 splits",
    "i32 split_tiles",
)
_MERGE_SIG = ("ptr ws", "ptr out", "i64 o_sh", "i64 o_sn", "i32 Hkv", "i32 G", "i32 n", "i32 splits")

ORDER_ENV = "KVARN_PREFILL_ORDER"
ORDERS = ("rows", "heavy")


def block_order() -> str:
    """The fused kernel's CTA order, read when a kernel is loaded: ``rows`` (blocks of folded rows in order) or
    ``heavy`` (each head's token blocks, the chunk's last tokens first; the kernel's heavy_first), from
    ``$KVARN_PREFILL_ORDER``. ``heavy`` by default: it took exact-only 2048- and 4096-token chunks 0.87 and 0.93x
    the row order's time on an H200, and every other measured shape within 1% (tools/prefill_phases.py,
    docs/perf-notes.md)."""
    text = os.environ.get(ORDER_ENV, "").strip() or "heavy"
    if text not in ORDERS:
        raise ValueError(f"${ORDER_ENV}={text!r}: choose one of {list(ORDERS)}")
    return text


def launch_grid(order: str, n: int, group: int, num_kv_heads: int, batch: int, rows: int) -> tuple[tuple, bool]:
    """(grid, heavy_first) of the fused kernel for ``batch`` sequences of a chunk of ``n`` queries, ``group`` query
    heads per KV head and ``rows`` folded rows per CTA (``cta_rows`` in ``csrc/prefill_fused.cu``). ``heavy``
    applies to one sequence's chunk of at least ``rows`` tokens: a shorter chunk keeps the row order, where one CTA
    holds several heads' rows (one CTA per head would stream every tile for a few rows), and a batch keeps it
    because the heavy map has no grid dimension left for the sequence."""
    if order == "heavy" and batch == 1 and n >= rows:
        return (num_kv_heads, group, math.ceil(n / rows)), True
    return (math.ceil(group * n / rows), num_kv_heads, batch), False


SPLIT_ENV = "KVARN_PREFILL_SPLIT"
# tiles a split takes at least: fewer, and writing and merging its partial rows would cost about as much as its
# tiles (an estimate: the A/B measured 16 splits of 16 tiles, not the bound)
MIN_SPLIT_TILES = 4


def split_tiles_enabled() -> bool:
    """Whether chunks whose grid leaves SMs idle split their tiles over CTAs (``$KVARN_PREFILL_SPLIT``, on by
    default, ``0`` turns it off), read when a kernel is loaded. On an H200 it took a 128-token chunk over 32k
    tokens 816 -> 226 us and a 16-token one 781 -> 90 (tools/prefill_phases.py, docs/perf-notes.md)."""
    text = os.environ.get(SPLIT_ENV, "").strip() or "1"
    if text not in ("0", "1"):
        raise ValueError(f"${SPLIT_ENV}={text!r}: choose 0 or 1")
    return text == "1"


def split_plan(ctas: int, n_tiles: int, batch: int, sms: int) -> tuple[int, int]:
    """(splits, tiles per split) for one launch of ``ctas`` CTAs (the row order's grid) over ``n_tiles`` tiles on
    ``sms`` SMs: (1, n_tiles) unless one sequence's grid fills at most half the SMs; else as many splits as
    fit the idle SMs in one wave, each of at least MIN_SPLIT_TILES tiles, the last of which also takes the
    exact phase (``csrc/prefill_fused.cu``'s split mode; MERGE_NAME combines them)."""
    if batch != 1 or 2 * ctas > sms or n_tiles < 2 * MIN_SPLIT_TILES:
        return 1, n_tiles
    splits = min(sms // ctas, n_tiles // MIN_SPLIT_TILES)
    per = math.ceil(n_tiles / splits)
    return math.ceil(n_tiles / per), per


@dataclass(frozen=True)
class FusedConfig:
    """Launch shape of the fused kernel: consumer warps (the MMAs) and 4 producer warps (record copies and
    dequantization), one CTA per SM.

    rows_per_warp: query rows of one consumer warp (16 or 32: one or two m16 MMA tiles; 32 reuses each
        K/V fragment twice, at twice the accumulator registers).
    consumer_warps: 4 or 8 (8: two consumer warps per scheduler, so one's softmax overlaps the other's
        MMAs; needs 16 rows per warp to fit the 168 registers of 384 threads). A CTA owns
        consumer_warps * rows_per_warp rows of one KV head.
    block_n: tokens per score block (32 or 64; a tile is T / block_n blocks).
    producer_groups: 1 (the 4 producer warps work on every tile together) or 2 (two groups of 2 warps take
        alternate tiles, so one group's per-tile scale reductions overlap the other's dequantization;
        needs at most 2 blocks per tile and shared memory for 2 stages per group).
    mma: ``"sync"`` (mma.sync m16n8k16 per consumer warp, sm_80+) or ``"wgmma"`` (sm_90a only: wgmma per
        consumer warpgroup of 64 rows on CuTe's SM90 GMMA atoms; 16 rows per warp; head_dim 64 or 128 with
        64-token blocks, two producer groups only as two warpgroups; head_dim 256 with 32-token blocks and
        one producer warpgroup, whose 4 or 8 consumer warps hold a 64 x 256 f32 accumulator per warpgroup:
        with 8 the warpgroups trade registers, 200 per consumer thread and 104 per producer thread).
    k_operand: ``"f16"`` (default: the producers dequantize the K codes to f16 in shared memory, f16 MMA)
        or ``"int8"`` (``csrc/prefill_int8.cuh``: the producers write the K codes as centered int8 in the s8
        MMA's B-fragment order, the consumers fold their rotated query rows per tile into two int8 levels and
        run mma.sync m16n8k32 s8 x s8 -> s32, no dequantization; mma.sync with 16 rows per warp and 4 consumer
        warps, uniform quantizer only; selectable, not in the tuned table). Name suffix ``i8``.
    producer_warps: 4, or 8 with wgmma (two producer warpgroups: twice the warps to hide the
        dequantization's latency, sharing every tile or, with two groups, taking alternate tiles; with 8
        consumer warps the warpgroups trade registers by setmaxnreg).
    q_operand: ``"smem"`` (default: the score wgmma reads Q and K from shared memory) or ``"regs"`` (wgmma
        at head_dim 64 or 128: each consumer warpgroup keeps its rotated query rows in registers as wgmma A
        fragments, D / 4 a thread, and the tile phase's score MMAs run RS, reading only K from shared memory;
        the exact phase stays SS). Name suffix ``rq``.
    """

    rows_per_warp: int = 32
    block_n: int = 64
    consumer_warps: int = 4
    producer_groups: int = 1
    mma: str = "sync"
    producer_warps: int = 4
    k_operand: str = "f16"
    q_operand: str = "smem"

    def __post_init__(self) -> None:
        for name, allowed in (("rows_per_warp", (16, 32)), ("block_n", (32, 64)), ("consumer_warps", (4, 8)),
                              ("producer_groups", (1, 2)), ("mma", ("sync", "wgmma")), ("producer_warps", (4, 8)),
                              ("k_operand", K_OPERANDS), ("q_operand", Q_OPERANDS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"FusedConfig.{name}={getattr(self, name)!r}; choose one of {list(allowed)}")

    @property
    def rows(self) -> int:
        """Query rows per CTA."""
        return self.consumer_warps * self.rows_per_warp

    @property
    def threads(self) -> int:
        return 32 * (self.consumer_warps + self.producer_warps)

    @property
    def name(self) -> str:
        return (f"r{self.rows_per_warp}c{self.consumer_warps}n{self.block_n}" + ("g2" if self.producer_groups == 2 else "")
                + ("p8" if self.producer_warps == 8 else "") + ("wg" if self.mma == "wgmma" else "")
                + ("rq" if self.q_operand == "regs" else "") + ("i8" if self.k_operand == "int8" else ""))

    @classmethod
    def from_name(cls, name: str) -> "FusedConfig":
        """The config of a :attr:`name` such as ``r32c4n64``, ``r16c8n64g2``, ``r16c8n64p8wg``, ``r16c8n64p8wgrq``
        or ``r16c4n64i8``; ValueError otherwise."""
        import re

        m = re.fullmatch(r"r(\d+)c(\d+)n(\d+)(g2)?(p8)?(wg)?(rq)?(i8)?", name) if isinstance(name, str) else None
        if m is None:
            raise ValueError(f"{name!r} is not a fused prefill config name (r<rows>c<warps>n<tokens>[g2][p8][wg][rq][i8], "
                             "e.g. r32c4n64)")
        return cls(int(m.group(1)), int(m.group(3)), int(m.group(2)), 2 if m.group(4) else 1,
                   "wgmma" if m.group(6) else "sync", 8 if m.group(5) else 4, "int8" if m.group(8) else "f16",
                   "regs" if m.group(7) else "smem")

    def supported_on(self, arch: int) -> bool:
        """Whether the config runs on a device of compute capability ``arch`` (e.g. 90): wgmma is sm_90a code."""
        return arch >= 80 and (self.mma == "sync" or arch == 90)

    def fits(self, head_dim: int, tile_tokens: int) -> bool:
        """Whether the config is valid for (head_dim, tile_tokens) (registers and shared memory of the
        sm_90 build): D=256 keeps 16 rows per warp (two m16 tiles would need 256 accumulator registers) and
        32-token blocks, with mma.sync 4 consumer warps, or with wgmma and two consumer warpgroups 64-token
        blocks, whose two stages fit shared memory beside most records but not 128-token ones of 4-bit V nor
        float32 scales with Lloyd-Max (the kernel's load refuses those, naming the bytes); 8 consumer warps need
        16 rows per warp."""
        if tile_tokens % self.block_n:
            return False
        if self.k_operand == "int8":
            # mma.sync, one m16 tile per warp, 4 consumer warps: the folded query levels (D / 2 registers) stay
            # in registers; with 8 consumer warps (168 registers each) ptxas spills 10 words
            if self.mma != "sync" or self.rows_per_warp != 16 or self.consumer_warps != 4:
                return False
        if self.q_operand == "regs":
            # wgmma's register A operand; at D=128 the 32 registers of Q fit one producer warpgroup's trade
            # (consumers 184, producers 136 of 384 x 168), not two producer warpgroups' (512 x 128: spills)
            if self.mma != "wgmma" or head_dim == 256 or (head_dim == 128 and self.producer_warps != 4):
                return False
        if self.mma == "wgmma":
            if self.rows_per_warp != 16:
                return False
            if head_dim == 256:
                # one producer warpgroup; 32-token blocks (three 32 KB stages beside 64 KB of Q rows; two consumer
                # warpgroups take 200 registers a thread of the 504 the launch of 384 threads holds), or, with two
                # consumer warpgroups, 64-token blocks (two 64 KB stages; consumers 208, producers 88)
                return (self.producer_warps == 4 and self.producer_groups == 1
                        and (self.block_n == 32 or self.consumer_warps == 8))
            # two producer groups: one warpgroup each
            return self.block_n == 64 and (self.producer_groups == 1 or self.producer_warps == 8)
        if self.producer_warps != 4:
            return False
        if self.consumer_warps == 8 and (self.rows_per_warp != 16 or head_dim == 256):
            return False
        if self.producer_groups == 2 and (tile_tokens // self.block_n > 2 or head_dim == 256):
            return False
        return head_dim != 256 or (self.rows_per_warp == 16 and self.block_n == 32 and self.consumer_warps == 4)


    def supports(self, spec: TileSpec) -> bool:
        """Whether the config runs ``spec``'s records: :meth:`fits`, and the int8 K operand needs integer K code
        values (the uniform quantizer)."""
        return self.fits(spec.head_dim, spec.tile_tokens) and (self.k_operand == "f16" or spec.quantizer == "uniform")


# Tuner candidates (``python -m kvarn_cutlass.ops.prefill_tune``), filtered by FusedConfig.fits per bucket.
CANDIDATES = (tuple(FusedConfig(r, n, c, pg) for c in (4, 8) for r in (16, 32) for n in (32, 64) for pg in (1, 2)
                    if c == 4 or r == 16)
              + tuple(FusedConfig(16, 64, c, g, mma="wgmma", producer_warps=p)
                      for c in (4, 8) for p in (4, 8) for g in (1, 2) if g <= p // 4)
              + tuple(FusedConfig(16, 32, c, mma="wgmma") for c in (4, 8))  # head_dim 256
              # Q in registers, with two consumer warpgroups (one, r16c4n64wg, was the slowest wgmma config in
              # every bucket): D=128 only with one producer warpgroup (FusedConfig.fits)
              + tuple(FusedConfig(16, 64, 8, g, mma="wgmma", producer_warps=p, q_operand="regs")
                      for p in (4, 8) for g in (1, 2) if g <= p // 4))
# Untuned fallback per head_dim (no register spills in the sm_90 build).
DEFAULT_CONFIGS = {
    64: FusedConfig(32, 64),
    128: FusedConfig(32, 64),
    256: FusedConfig(16, 32),
}


def _c_floats(values) -> str:
    return "{" + ", ".join(f"{float(x)!r}f" for x in values) + "}"


def _variant_name(spec: TileSpec, cache_dtype: torch.dtype, q_dtype: torch.dtype, config: FusedConfig) -> str:
    lm = "lm" if spec.quantizer == "lloyd_max" else ""
    return (f"prefill_fused_d{spec.head_dim}_t{spec.tile_tokens}_v{spec.v_bits}{lm}_s{spec.scale_bytes}_"
            f"{DTYPES[cache_dtype]}_{DTYPES[q_dtype]}_{config.name}")


def fused_spec(spec: TileSpec, cache_dtype: torch.dtype, q_dtype: torch.dtype, config: FusedConfig) -> KernelSpec:
    """The KernelSpec of one variant; every record offset comes from ``spec``."""
    if cache_dtype not in DTYPES or q_dtype not in DTYPES:
        raise TypeError(f"cache and query dtypes must be float16 or bfloat16, got {cache_dtype} and {q_dtype}")
    if not config.fits(spec.head_dim, spec.tile_tokens):
        raise ValueError(f"config {config.name} does not fit head_dim={spec.head_dim}, tile_tokens={spec.tile_tokens}")
    if not config.supports(spec):
        raise ValueError(f"config {config.name} (int8 K operand) needs the uniform quantizer, not {spec.quantizer!r}")
    kb, vb = spec.k_codebook, spec.v_codebook
    defines = {
        "KERNEL_NAME": KERNEL_SYMBOL,
        "MERGE_NAME": MERGE_SYMBOL,
        "HEAD_DIM": spec.head_dim,
        "TILE_TOKENS": spec.tile_tokens,
        "V_BITS": spec.v_bits,
        "SCALE_F32": int(spec.scale_bytes == 4),
        "LLOYD_MAX": int(spec.quantizer == "lloyd_max"),
        "K_CODEBOOK": _c_floats(kb),
        "V_CODEBOOK": _c_floats(vb),
        "K_CB_LIMIT": f"{max(abs(x) for x in kb)!r}f",
        "V_CB_LIMIT": f"{max(abs(x) for x in vb)!r}f",
        "RECORD_BYTES": spec.tile_nbytes,
        "CACHE_BF16": int(cache_dtype == torch.bfloat16),
        "Q_BF16": int(q_dtype == torch.bfloat16),
        "ROWS_PER_WARP": config.rows_per_warp,
        "CONSUMER_WARPS": config.consumer_warps,
        "PRODUCER_GROUPS": config.producer_groups,
        "PRODUCER_WARPS": config.producer_warps,
        "BLOCK_N": config.block_n,
        "WGMMA": int(config.mma == "wgmma"),
    }
    if config.k_operand == "int8":
        defines["K_INT8"] = 1
    if config.q_operand == "regs":
        defines["Q_REGS"] = 1
    for section in spec.section_names():
        defines["OFF_" + section.upper()] = spec.offset(section)
    wgmma = config.mma == "wgmma"
    return KernelSpec("prefill_fused.cu", (KERNEL_SYMBOL, MERGE_SYMBOL), defines=defines, options=("-lineinfo",),
                      arch_specific=wgmma, include_dirs=cutlass_include_dirs() if wgmma else (),
                      name=_variant_name(spec, cache_dtype, q_dtype, config))


# --- config table ---------------------------------------------------------------------------------
def bucket_key(spec: TileSpec) -> str:
    """Table key: head_dim, tile tokens, V bits and quantizer (what changes the per-tile work)."""
    lm = "_lm" if spec.quantizer == "lloyd_max" else ""
    return f"D{spec.head_dim}_T{spec.tile_tokens}_V{spec.v_bits}{lm}"


def table_path(arch: str = "sm90"):
    from ..runtime.configs import config_dir

    return config_dir() / f"prefill_{arch}.json"


@functools.lru_cache(maxsize=8)
def _load_table(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f).get("buckets", {})
    except FileNotFoundError:
        return {}


class UntunedPrefillConfigWarning(UserWarning):
    """No tuned fused-prefill config for this bucket: the documented default is used."""


def select_config(spec: TileSpec, arch: str = "sm90") -> FusedConfig:
    """The tuned config of ``spec``'s bucket, else :data:`DEFAULT_CONFIGS` (with a warning once per bucket)."""
    return _select_config(spec, arch, str(table_path(arch)))


@functools.lru_cache(maxsize=None)
def _select_config(spec: TileSpec, arch: str, table: str) -> FusedConfig:
    entry = _load_table(table).get(bucket_key(spec))
    if entry and entry.get("status") == "tuned":
        cfg = FusedConfig(**entry["config"])
        if cfg.fits(spec.head_dim, spec.tile_tokens):
            return cfg
    _warn_untuned(bucket_key(spec), arch)
    return DEFAULT_CONFIGS[spec.head_dim]


@functools.lru_cache(maxsize=None)
def _warn_untuned(key: str, arch: str) -> None:
    warnings.warn(f"no tuned fused-prefill config for {key} on {arch}; using the default "
                  "(run `python -m kvarn_cutlass.ops.prefill_tune` on the GPU)", UntunedPrefillConfigWarning, stacklevel=3)


def fused_specs() -> list[KernelSpec]:
    """Every variant with its selected config (what ``kvarn-cutlass build`` compiles)."""
    out = []
    for preset in PRESETS:
        for d in HEAD_DIMS:
            for sd in SCALE_DTYPES:
                for quantizer in QUANTIZERS:
                    spec = TileSpec(preset, d, sd, quantizer=quantizer)
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", UntunedPrefillConfigWarning)
                        cfg = select_config(spec)
                    for cd in DTYPES:
                        out.append(fused_spec(spec, cd, cd, cfg))
    return out


register("prefill_fused", fused_specs)


def smem_bytes(cubin: bytes) -> int:
    """The kernel's dynamic shared memory, read from the module global ``kvarn_prefill_smem_bytes``."""
    from ..runtime.compiler import cubin_global

    return int.from_bytes(cubin_global(cubin, SMEM_SYMBOL)[:4], "little", signed=True)


# --- launch ---------------------------------------------------------------------------------------
class FusedPrefillKernel:
    """One loaded variant: ``launch(...)`` enqueues the kernel on torch's current stream."""

    def __init__(self, spec: TileSpec, cache_dtype: torch.dtype, q_dtype: torch.dtype, config: FusedConfig,
                 device: torch.device):
        from ..runtime.spec import build, get_module
        from ..runtime.arch import arch_target, device_arch, sm_count

        kspec = fused_spec(spec, cache_dtype, q_dtype, config)
        index = device.index
        self.config = config
        self.spec = spec
        module = get_module(kspec, index)
        self._kernel = module.kernel(KERNEL_SYMBOL, _SIG)
        self._merge = module.kernel(MERGE_SYMBOL, _MERGE_SIG)
        self._device_index = index
        self.smem = smem_bytes(build(kspec, arch_target(device_arch(index), kspec.arch_specific)).cubin)
        if self.smem > MAX_SMEM_PER_BLOCK:
            raise ValueError(f"{kspec.name} needs {self.smem} bytes of shared memory (> {MAX_SMEM_PER_BLOCK})")
        # The first launch is prepared with every argument checked; later ones rewrite its argument slots
        # in one struct.pack_into and its grid: a chunk's launch costs a few microseconds of host time
        # instead of ~150 (the prompt is otherwise host-bound for its short-context chunks).
        self._prepared = None
        self._write_args = None
        self._merge_prepared = None
        self._merge_write = None
        self.order = block_order()
        self.split = split_tiles_enabled()
        self._sms = sm_count(index)
        self._ws = torch.empty(0, dtype=torch.float32, device=device)  # split partials, grown on demand

    def launch(self, q, out, pool, tile_table, n_tiles, sink_k, sink_v, sink_len, win_k, win_v, win_len,
               chunk_k, chunk_v, num_kv_heads, scale):
        """All tensors on this kernel's CUDA device; shapes as in ``csrc/prefill_fused.cu``.
        q, out [B, Hq, n, D]. Not thread-safe, and one stream at a time: one prepared launch per kernel (as
        PreparedLaunch) and, with split tiles, one workspace that the split kernel writes and the merge reads."""
        B, Hq, n, D = q.shape
        G = Hq // num_kv_heads
        grid, heavy_first = launch_grid(self.order, n, G, num_kv_heads, B, self.config.rows)
        row_blocks = math.ceil(G * n / self.config.rows)  # the row order's grid x
        splits, split_tiles = (split_plan(row_blocks * num_kv_heads, n_tiles, B, self._sms) if self.split
                               else (1, n_tiles))
        if splits > 1:
            grid, heavy_first = (row_blocks, num_kv_heads, splits), False
            need = splits * num_kv_heads * G * n * (D + 2)
            if self._ws.numel() < need:
                self._ws = torch.empty(need, dtype=torch.float32, device=q.device)
        ws = self._ws
        if self._prepared is None:
            args = (
                q, *q.stride()[:3], out, *out.stride()[:3],
                pool, tile_table, tile_table.shape[1], n_tiles,
                sink_k, sink_v, sink_k.shape[2], sink_len,
                win_k, win_v, win_k.shape[2], win_len,
                chunk_k, chunk_v, *chunk_k.stride()[:3], *chunk_v.stride()[:3],
                num_kv_heads, G, n, float(scale) * LOG2E, B, int(heavy_first), ws, splits, split_tiles,
            )
            self._prepared = self._kernel.prepare(grid, self.config.threads, args, shared_mem=self.smem)
            self._write_args = self._prepared.writer(0, len(_SIG))
        else:
            for t in (q, out, pool, tile_table, sink_k, sink_v, win_k, win_v, chunk_k, chunk_v):
                if not t.is_cuda or t.device.index != self._device_index:
                    raise ValueError(f"{self._kernel.name}: a tensor is on {t.device}, the kernel on "
                                     f"cuda:{self._device_index}")
            try:
                self._write_args(
                    q.data_ptr(), *q.stride()[:3], out.data_ptr(), *out.stride()[:3],
                    pool.data_ptr(), tile_table.data_ptr(), tile_table.shape[1], n_tiles,
                    sink_k.data_ptr(), sink_v.data_ptr(), sink_k.shape[2], sink_len,
                    win_k.data_ptr(), win_v.data_ptr(), win_k.shape[2], win_len,
                    chunk_k.data_ptr(), chunk_v.data_ptr(), *chunk_k.stride()[:3], *chunk_v.stride()[:3],
                    num_kv_heads, G, n, float(scale) * LOG2E, B, int(heavy_first), ws.data_ptr(), splits,
                    split_tiles,
                )
            except (struct.error, OverflowError):  # a value out of its argument's range: prepare again, which names it
                self._prepared = None
                return self.launch(q, out, pool, tile_table, n_tiles, sink_k, sink_v, sink_len, win_k, win_v,
                                   win_len, chunk_k, chunk_v, num_kv_heads, scale)
            self._prepared.set_grid(*grid)
        self._prepared.launch()
        if splits > 1:
            self._launch_merge(ws, out, num_kv_heads, G, n, splits)

    def _launch_merge(self, ws, out, num_kv_heads, G, n, splits):
        """The split partials in ``ws`` into ``out`` [1, Hq, n, D] (MERGE_NAME: one warp per folded row)."""
        grid = (math.ceil(G * n / 4), num_kv_heads, 1)
        if self._merge_prepared is None:
            args = (ws, out, out.stride(1), out.stride(2), num_kv_heads, G, n, splits)
            self._merge_prepared = self._merge.prepare(grid, 128, args)
            self._merge_write = self._merge_prepared.writer(0, len(_MERGE_SIG))
        else:
            self._merge_write(ws.data_ptr(), out.data_ptr(), out.stride(1), out.stride(2), num_kv_heads, G, n,
                              splits)
            self._merge_prepared.set_grid(*grid)
        self._merge_prepared.launch()


_kernels: dict[tuple, FusedPrefillKernel] = {}
# get_kernel's arguments and the config-table directory's environment override -> the _kernels key they resolve
# to: every chunk of every layer asks, and resolving the device's arch and the tuned config took ~100 us of host
# time per call (cProfile of the e2e prefill, docs/perf-notes.md), as much as the kernel of a short-context chunk.
_resolved: dict[tuple, tuple] = {}


def get_kernel(spec: TileSpec, cache_dtype: torch.dtype, q_dtype: torch.dtype, device: torch.device,
               config: FusedConfig | None = None) -> FusedPrefillKernel:
    """The loaded variant for (spec, dtypes, config) on ``device``; built and loaded once per process. With
    ``config`` None, the tuned config of ``select_config`` (the table of ``$KVARN_CUTLASS_GEMM_CONFIGS`` as set
    at the call)."""
    asked = (spec, cache_dtype, q_dtype, device.index, config, os.environ.get(CONFIG_ENV))
    k = _kernels.get(_resolved.get(asked))
    if k is None:
        key, k = _get_kernel(spec, cache_dtype, q_dtype, device, config)
        _resolved[asked] = key
    return k


def _get_kernel(spec: TileSpec, cache_dtype: torch.dtype, q_dtype: torch.dtype, device: torch.device,
                config: FusedConfig | None) -> tuple[tuple, FusedPrefillKernel]:
    from ..runtime.arch import device_arch

    arch = device_arch(device.index)
    if config is None:
        config = select_config(spec, f"sm{arch}")
    elif not config.supported_on(arch):
        raise ValueError(f"config {config.name} ({config.mma}) does not run on sm_{arch}")
    key = (spec, cache_dtype, q_dtype, device.index, config)
    k = _kernels.get(key)
    if k is None:
        k = _kernels[key] = FusedPrefillKernel(spec, cache_dtype, q_dtype, config, device)
    return key, k
