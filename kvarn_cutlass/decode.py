"""Split-tile decode attention over a KVarN cache: one new query token per sequence.

Public entry points:

* :func:`decode_attention` ``(q, cache, layer, scale=None) -> out``: the eager API over a
  :class:`~kvarn_cutlass.cache.KVarNCache` (same semantics as ``kvarn_cutlass.reference.attention``
  with n_q = 1: the query is the newest token and sees sink + tiles + window).
* :func:`decode_attention_ragged`: the lower-level entry a serving engine uses, with per-sequence
  lengths in int32 device tensors (``n_tiles``, ``window_len``, ``sink_len``), the tile pool
  ``[B, cap_tiles, Hkv, nbytes]``, window ``[B, Hkv, W, D]`` and sink ``[B, Hkv, SC, D]`` buffers.
* :class:`DecodePlan`: per-cache device state (lengths, partials workspace, prepared launches).
* :class:`DecodeGraph`: capture one decode call in a CUDA graph once, ``replay()`` every step.

Kernels (``csrc/decode.cu``): (1) partials, fixed grid ``(S + E, Hkv, B)``: split ``j < S`` covers
``tps = max(min_tps, ceil(n_tiles[b] / S))`` tiles starting at ``j * tps`` (computed on the device from
the live tile count, so one grid serves every length); split ``S + e`` attends to tokens
``[e*TE, (e+1)*TE)`` of sink ++ window (original domain), ``E = ceil((W + SC) / TE)``, TE = 64 or 32
(:func:`kernel_layout`). (2) combine, grid ``(Hq, B)``: LSE merge of the tile splits, one inverse
WHT of the merged rotated output, LSE merge of the exact blocks, merge of the two, normalization.

Graph strategy: the kernels read the lengths from device memory. The plan owns an int32 tensor
``lens [num_layers, 3, B]`` (n_tiles, window_len, sink_len); :meth:`DecodePlan.refresh` copies the
cache's host-side lengths into it with an asynchronous copy from a pinned staging buffer (a ring of
buffers guarded by events, so the CPU never overwrites a buffer a pending copy still reads). The
copy runs *outside* the captured graph, after ``cache.append`` (eager host code, including tile
compression) and before ``replay()``; the graph itself only holds the two kernel launches, which
stay valid while the sequence grows across tile boundaries because the pool never moves
(``max_seq_len`` preallocates it) and the grid is sized from the capacity.
"""

from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from .cache import KVarNCache
from .format import PRESETS, HEAD_DIMS, QUANTIZERS, SCALE_DTYPES, TileSpec
from .runtime import KernelSpec, get_module, register

__all__ = [
    "decode_attention",
    "decode_attention_ragged",
    "DecodePlan",
    "DecodeGraph",
    "DecodeWorkspace",
    "decode_spec",
    "decode_specs",
    "kernel_layout",
]

NUM_THREADS = 128
# Fewest tiles one split block covers (the device computes tps = max(min_tps, ceil(n_tiles / S))).
# Environment override for A/B runs: KVARN_DECODE_MIN_TPS.
MIN_TILES_PER_SPLIT = 2
# Upper bound on the waves of resident blocks the split choice may use (see choose_splits).
MAX_WAVES = 4
Q_DTYPES = (torch.float16, torch.bfloat16)
MAX_GROUP = 8

_PARTIALS_SIG = (
    "ptr q", "ptr tiles", "ptr win_k", "ptr win_v", "ptr sink_k", "ptr sink_v", "ptr n_tiles", "ptr win_len",
    "ptr sink_len", "ptr po", "ptr pm", "ptr pl", "i32 Hkv", "i32 G", "i32 cap", "i32 W", "i32 SC", "i32 S",
    "i32 E", "i32 min_tps", "i32 flags", "f32 scale",
)
_COMBINE_SIG = ("ptr po", "ptr pm", "ptr pl", "ptr out", "i32 Hkv", "i32 G", "i32 S", "i32 E", "i32 out_bf16")


# --- kernel specs ------------------------------------------------------------------------------
def _suffix(spec: TileSpec) -> str:
    lm = "_lm" if spec.quantizer == "lloyd_max" else ""
    return f"d{spec.head_dim}_t{spec.tile_tokens}_v{spec.v_bits}_s{spec.scale_bytes}{lm}"


def codebook_planes(values) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(lo-byte words, hi-byte words) of the f16 codebook ``values``: 4 uint32 each, entry i at byte i % 4
    of word i // 4 (unused entries 0). The f16 values are ``float32 -> float16`` round-to-nearest-even."""
    bits = (torch.tensor(values, dtype=torch.float32).to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF).tolist()
    bits = bits + [0] * (16 - len(bits))
    lo = tuple(sum((bits[4 * w + j] & 0xFF) << (8 * j) for j in range(4)) for w in range(4))
    hi = tuple(sum((bits[4 * w + j] >> 8) << (8 * j) for j in range(4)) for w in range(4))
    return lo, hi


def decode_spec(spec: TileSpec) -> KernelSpec:
    """The :class:`KernelSpec` of the decode kernels for one record layout (quantizer included)."""
    sfx = _suffix(spec)
    defines = {"KVD_D": spec.head_dim, "KVD_T": spec.tile_tokens, "KVD_VB": spec.v_bits, "KVD_SB": spec.scale_bytes}
    if spec.quantizer == "lloyd_max":
        defines["KVD_QZ"] = 1
        for tag, book in (("K", spec.k_codebook), ("V", spec.v_codebook)):
            lo, hi = codebook_planes(book)
            for w in range(4):
                defines[f"KVD_{tag}L{w}"] = f"0x{lo[w]:08x}u"
                defines[f"KVD_{tag}H{w}"] = f"0x{hi[w]:08x}u"
    return KernelSpec(
        "decode.cu",
        (f"kvarn_decode_partials_{sfx}", f"kvarn_decode_combine_{sfx}"),
        defines=defines,
        name=f"decode_{sfx}",
    )


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
    """Compile-time numbers of the partials kernel, mirrored from ``csrc/decode.cu``."""

    record_bytes: int
    stages: int
    smem_bytes: int
    offsets: dict
    exact_tokens: int = 64  # TE: sink/window tokens per exact block


def kernel_layout(spec: TileSpec) -> KernelLayout:
    """Record offsets, cp.async ring depth and dynamic shared memory of the partials kernel."""
    D, T, VB, SB = spec.head_dim, spec.tile_tokens, spec.v_bits, spec.scale_bytes
    off = {"k_codes": 0}
    off["chan_step"] = D * T // 2
    off["chan_min"] = off["chan_step"] + D * SB
    off["row_scale"] = off["chan_min"] + D * SB
    off["v_codes"] = off["row_scale"] + T * SB
    off["tok_step"] = off["v_codes"] + T * D * VB // 8
    off["tok_min"] = off["tok_step"] + T * SB
    off["col_scale"] = off["tok_min"] + T * SB
    rec = off["col_scale"] + D * SB
    ns = 4 if rec <= 8192 else (3 if rec <= 20480 else 2)
    tpw = T // 4
    smem_tile = ns * rec + 8 * D * 4 + (D // 16) * 32 * 16 + 4 * 8 * 4 + 4 * 2 * 8 * tpw * 2 + 16

    def exact_smem(te: int) -> int:
        return te * D * 4 + 8 * D * 4 + NUM_THREADS * 32 + 8 * te * 4 + 64 + NUM_THREADS * 64

    te = 64 if exact_smem(64) <= smem_tile else 32
    return KernelLayout(rec, ns, max(smem_tile, exact_smem(te)), off, te)


def exact_blocks(spec: TileSpec, window: int, sink: int) -> int:
    """E: exact (sink + window) blocks per (sequence, KV head) for buffer capacities W and SC."""
    return max(1, math.ceil((window + sink) / kernel_layout(spec).exact_tokens))


def min_tiles_per_split() -> int:
    """MIN_TILES_PER_SPLIT, or the KVARN_DECODE_MIN_TPS environment override (A/B runs)."""
    v = os.environ.get("KVARN_DECODE_MIN_TPS")
    return max(1, int(v)) if v else MIN_TILES_PER_SPLIT


# --- validation --------------------------------------------------------------------------------
def _check_q(q: Any, batch: int, num_kv_heads: int, head_dim: int, device: torch.device | None) -> None:
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype not in Q_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; decode supports {list(Q_DTYPES)}")
    if (
        q.dim() != 4
        or q.shape[0] != batch
        or q.shape[2] != 1
        or q.shape[3] != head_dim
        or q.shape[1] < num_kv_heads
        or q.shape[1] % num_kv_heads
        or q.shape[1] // num_kv_heads > MAX_GROUP
    ):
        raise ValueError(
            f"q must have shape [batch={batch}, num_q_heads (num_kv_heads={num_kv_heads} x group 1..{MAX_GROUP}), "
            f"1, head_dim={head_dim}], got {list(q.shape)}"
        )
    if q.device.type != "cuda":
        raise ValueError(f"q must be on a CUDA device, got {q.device}")
    if device is not None and q.device != device:
        raise ValueError(f"q is on {q.device} but the KV data is on {device}")


def _check_cache(cache: Any) -> None:
    if not isinstance(cache, KVarNCache):
        raise TypeError(f"cache must be a KVarNCache, got {type(cache).__name__}")


def _check_scale(scale: Any, head_dim: int) -> float:
    if scale is None:
        return head_dim**-0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite float, got {scale!r}")
    return float(scale)


def _check_len_tensor(name: str, x: Any, batch: int, device: torch.device) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.int32 or x.dim() != 1 or x.shape[0] != batch or not x.is_contiguous():
        raise ValueError(f"{name} must be a contiguous int32 tensor [batch={batch}], got {x.dtype} {list(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but the KV data is on {device}")


# --- workspace ---------------------------------------------------------------------------------
def _occupancy(kernel, smem: int) -> int:
    """Resident partials blocks per SM (driver occupancy query; a conservative estimate if it fails)."""
    try:
        from cuda.bindings import driver

        status, n = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(kernel._func, NUM_THREADS, smem)
        if int(status) == 0 and n > 0:
            return int(n)
    except Exception:  # estimate below
        pass
    return max(1, min(4, (227 * 1024) // (smem + 1024)))


class DecodeWorkspace:
    """Partials buffers and the split counts for one (batch, kv heads, capacity, head_dim, group).

    ``S = splits`` tile splits and ``E = exact`` exact (sink + window) blocks per (sequence, KV head):
    ``po`` float32 [B, Hkv, S+E, G, D], ``pm`` / ``pl`` float32 [B, Hkv, S+E, G]. Reused across layers
    and steps (kernels run in stream order); graphs capture its pointers, so it must stay alive.
    ``min_tps``: fewest tiles per split block (passed to the kernel).
    """

    def __init__(self, device: torch.device, batch: int, num_kv_heads: int, group: int, head_dim: int,
                 splits: int, exact: int = 1, min_tps: int | None = None):
        self.batch, self.num_kv_heads, self.group, self.head_dim, self.splits = batch, num_kv_heads, group, head_dim, splits
        self.exact = exact
        self.min_tps = min_tps or min_tiles_per_split()
        n = batch * num_kv_heads * (splits + exact) * group
        self.po = torch.empty(n * head_dim, dtype=torch.float32, device=device)
        self.pm = torch.empty(n, dtype=torch.float32, device=device)
        self.pl = torch.empty(n, dtype=torch.float32, device=device)


# Model constants of choose_splits (unit: the SM time per tile when the SM's issue is saturated).
SATURATING_BLOCKS = 4.0      # resident blocks an SM needs to saturate issue; k < that run at k / 4 (fit: perf-notes)
SPLIT_COST = 0.02            # combine work and partial traffic per extra split


def split_cost(s: int, pairs: int, cap_tiles: int, sms: int, occupancy: int, min_tps: int) -> float:
    """Modelled makespan of ``s`` tile splits: the busiest SM's blocks in waves of resident blocks.

    ``per_sm = ceil(pairs x used splits / SMs)`` blocks of ``tps`` tiles land on the busiest SM and run
    in waves of ``occupancy``; a wave of ``k`` resident blocks takes ``tps x k x max(1, SATURATING_BLOCKS
    / k)`` (below saturation each block runs at its own latency-bound speed), so a partial last wave
    costs as much as a full one.
    """
    tps = max(min_tps, math.ceil(cap_tiles / s))
    used = math.ceil(cap_tiles / tps)
    per_sm = math.ceil(pairs * used / sms)
    full, rest = divmod(per_sm, occupancy)
    waves = [occupancy] * full + ([rest] if rest else [])
    return tps * sum(k * max(1.0, SATURATING_BLOCKS / k) for k in waves) + SPLIT_COST * s


def choose_splits(batch: int, num_kv_heads: int, cap_tiles: int, device: torch.device, spec: TileSpec,
                  min_tps: int | None = None) -> int:
    """Tile splits S per (sequence, KV head), minimizing :func:`split_cost` at the capacity.

    The partials kernel is issue-bound per SM (docs/perf-notes.md, decode), so the makespan is set by
    the busiest SM's tile count, slowed when too few blocks are resident to fill the SM's issue slots
    (a partial last wave).
    S is capped at MAX_WAVES waves of resident blocks and at ceil(cap / min_tps).
    """
    min_tps = min_tps or min_tiles_per_split()
    lay = kernel_layout(spec)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    k = _kernels(spec, device)[0]
    occ = _occupancy(k, lay.smem_bytes)
    pairs = batch * num_kv_heads
    s_cap = max(1, min(MAX_WAVES * sms * occ // pairs, math.ceil(cap_tiles / min_tps)))
    return min(range(1, s_cap + 1), key=lambda s: (split_cost(s, pairs, cap_tiles, sms, occ, min_tps), s))


_kernel_cache: dict = {}


def _kernels(spec: TileSpec, device: torch.device):
    key = (spec.preset, spec.head_dim, spec.scale_dtype, spec.quantizer, device.index)
    ks = _kernel_cache.get(key)
    if ks is None:
        ks_spec = decode_spec(spec)
        mod = get_module(ks_spec, device)
        ks = (mod.kernel(ks_spec.kernel_names[0], _PARTIALS_SIG), mod.kernel(ks_spec.kernel_names[1], _COMBINE_SIG))
        # Opt in to the dynamic shared memory now, so that the occupancy query sees it.
        ks[0].prepare((1, 1, 1), NUM_THREADS, (0,) * 12 + (0,) * 9 + (1.0,), shared_mem=kernel_layout(spec).smem_bytes)
        _kernel_cache[key] = ks
    return ks


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
    _prepared: dict | None = None,
) -> torch.Tensor:
    """Decode attention for a ragged batch with per-sequence lengths on the device.

    Args:
        q: [B, Hq, 1, D] float16/bfloat16 CUDA tensor, Hq = Hkv * G with G in 1..8.
        tiles: uint8 [B, cap_tiles, Hkv, spec.tile_nbytes], records of tile i of sequence b at [b, i].
        window_k, window_v: [B, Hkv, W, D] float16/bfloat16 (the newest tokens, valid prefix window_len[b]).
        sink_k, sink_v: [B, Hkv, SC, D] same dtype (valid prefix sink_len[b]; SC may be 0).
        n_tiles, window_len, sink_len: int32 [B] on the same device; values are clamped to the buffer
            capacities in the kernel. Token order per sequence: sink, tiles, window.
        spec: the record layout.
        scale: softmax scale, default 1/sqrt(D).
        out: optional [B, Hq, 1, D] output in q's dtype.
        workspace: partials buffers (a :class:`DecodeWorkspace` for this shape); allocated if None
            (do not let that happen during graph capture: pass one).

    Returns ``out`` [B, Hq, 1, D] in q's dtype. Launches on torch's current stream; never syncs.
    A sequence with no token at all gets zeros.
    """
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
    scale = _check_scale(scale, D)
    Hq = q.shape[1]
    G = Hq // Hkv
    if out is None:
        out = torch.empty(B, Hq, 1, D, dtype=q.dtype, device=device)
    elif (not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype or out.device != device
          or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {q.dtype} tensor {list(q.shape)} on {device}")
    E = exact_blocks(spec, window_k.shape[2], sink_k.shape[2])
    if workspace is None:
        workspace = DecodeWorkspace(device, B, Hkv, G, D, choose_splits(B, Hkv, cap, device, spec), E)
    elif (workspace.batch, workspace.num_kv_heads, workspace.group, workspace.head_dim, workspace.exact) != (B, Hkv, G, D, E):
        raise ValueError(
            f"workspace is for batch={workspace.batch}, kv_heads={workspace.num_kv_heads}, group={workspace.group}, "
            f"head_dim={workspace.head_dim}, exact blocks={workspace.exact}; this call needs {B}, {Hkv}, {G}, {D}, {E}"
        )
    q = q.contiguous()
    S = workspace.splits
    flags = (1 if q.dtype == torch.bfloat16 else 0) | (2 if window_k.dtype == torch.bfloat16 else 0)
    args_p = (q, tiles, window_k, window_v, sink_k, sink_v, n_tiles, window_len, sink_len, workspace.po,
              workspace.pm, workspace.pl, Hkv, G, cap, window_k.shape[2], sink_k.shape[2], S, E,
              workspace.min_tps, flags, scale)
    args_c = (workspace.po, workspace.pm, workspace.pl, out, Hkv, G, S, E, 1 if q.dtype == torch.bfloat16 else 0)
    key = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args_p + args_c) + (spec,)
    launches = None if _prepared is None else _prepared.get(key)
    if launches is None:
        kp, kc = _kernels(spec, device)
        lay = kernel_layout(spec)
        p = kp.prepare((S + E, Hkv, B), NUM_THREADS, args_p, shared_mem=lay.smem_bytes)
        c = kc.prepare((Hq, B), NUM_THREADS, args_c)
        launches = (p, c)
        if _prepared is not None:
            if len(_prepared) > 256:
                _prepared.clear()
            _prepared[key] = launches
    launches[0].launch()
    launches[1].launch()
    return out


# --- per-cache plan ----------------------------------------------------------------------------
class _PinnedRing:
    """Pinned int32 staging buffers for host->device length copies, reused only after their copy ran."""

    def __init__(self, shape: tuple[int, ...], slots: int = 32):
        self.bufs = [torch.zeros(shape, dtype=torch.int32).pin_memory() for _ in range(slots)]
        self.events: list[torch.cuda.Event | None] = [None] * slots
        self.i = 0

    def next(self) -> tuple[torch.Tensor, int]:
        i = self.i
        self.i = (i + 1) % len(self.bufs)
        ev = self.events[i]
        if ev is not None:
            ev.synchronize()  # normally long complete: a slot comes back after `slots` copies
        return self.bufs[i], i

    def record(self, i: int) -> None:
        ev = torch.cuda.Event()
        ev.record()
        self.events[i] = ev


class DecodePlan:
    """Device-side decode state of one :class:`KVarNCache`: lengths, workspaces, prepared launches.

    ``lens``: int32 [num_layers, 3, B] on the cache's device: (n_tiles, window_len, sink_len) per layer
    and sequence. :meth:`refresh` updates it from the cache (async H2D copy, capture-free; call it
    after ``cache.append`` and before launching or replaying). Two caches have two plans and never
    share buffers.

    Args:
        cache: a KVarNCache on a CUDA device.
        splits: tile splits per (sequence, KV head); default from :func:`choose_splits`.
        min_tps: fewest tiles per split block; default :func:`min_tiles_per_split`.
    """

    def __init__(self, cache: KVarNCache, splits: int | None = None, min_tps: int | None = None):
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
        B, L = cache.batch_size, cache.num_layers
        self.lens = torch.zeros(L, 3, B, dtype=torch.int32, device=self.device)
        # Stands in for a pool that has no tiles yet (no max_seq_len): the kernel needs a valid pointer,
        # and allocating it here keeps launch() free of allocations.
        self._empty_pool = torch.zeros(B, 1, cache.num_kv_heads, cache.spec.tile_nbytes, dtype=torch.uint8,
                                       device=self.device)
        self._ring = _PinnedRing((3, B))
        self._workspaces: dict[tuple[int, int], DecodeWorkspace] = {}
        self._prepared: dict = {}

    def refresh(self, layer: int | None = None) -> None:
        """Copy the cache's current lengths of ``layer`` (every layer for None) to ``lens``."""
        layers = range(self.cache.num_layers) if layer is None else [layer]
        with torch.cuda.device(self.device):
            for li in layers:
                pos = self.cache.positions(li)
                buf, slot = self._ring.next()
                buf[0].fill_(self.cache.num_tiles(li))
                buf[1].fill_(pos["window"][1] - pos["window"][0])
                buf[2].fill_(pos["sink"][1])
                self.lens[li].copy_(buf, non_blocking=True)
                self._ring.record(slot)

    def workspace(self, group: int) -> DecodeWorkspace:
        cap = self.cache.tile_pool(0).shape[1]
        key = (group, cap)
        ws = self._workspaces.get(key)
        if ws is None:
            c = self.cache
            s = self.splits_override or choose_splits(c.batch_size, c.num_kv_heads, max(cap, 1), self.device, c.spec,
                                                      self.min_tps)
            buf = c.buffers(0)
            e = exact_blocks(c.spec, buf["window_k"].shape[2], buf["sink_k"].shape[2])
            ws = self._workspaces[key] = DecodeWorkspace(self.device, c.batch_size, c.num_kv_heads, group, c.head_dim,
                                                         s, e, self.min_tps)
        return ws

    def launch(self, q: torch.Tensor, layer: int, out: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Enqueue decode for ``layer`` with the device lengths as they are (no refresh); capturable."""
        c = self.cache
        pool = c.tile_pool(layer)
        if pool.shape[1] == 0:  # an empty pool (no max_seq_len, nothing compressed yet) has no pointer
            pool = self._empty_pool
        buf = c.buffers(layer)
        G = q.shape[1] // c.num_kv_heads
        return decode_attention_ragged(
            q, pool, buf["window_k"], buf["window_v"], buf["sink_k"], buf["sink_v"], self.lens[layer, 0], self.lens[layer, 1],
            self.lens[layer, 2], c.spec, scale=scale, out=out, workspace=self.workspace(G), _prepared=self._prepared,
        )


_plans: "weakref.WeakKeyDictionary[KVarNCache, DecodePlan]" = weakref.WeakKeyDictionary()


def get_plan(cache: KVarNCache) -> DecodePlan:
    """The plan attached to ``cache`` (created on first use)."""
    _check_cache(cache)
    plan = _plans.get(cache)
    if plan is None:
        plan = _plans[cache] = DecodePlan(cache)
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
    scale = _check_scale(scale, cache.head_dim)
    plan = get_plan(cache)
    plan.refresh(layer)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return plan.launch(q, layer, out, scale)


class DecodeGraph:
    """One decode call of one layer captured in a CUDA graph; ``replay()`` per step.

    The graph holds only the two kernels; per step ``replay`` copies ``q`` into the static input
    (when given), refreshes the plan's device lengths from the cache (outside the graph), then
    replays. ``cache.append`` (with any tile compression) runs eagerly between replays.

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
        self.scale = _check_scale(scale, cache.head_dim)
        self.plan = plan or get_plan(cache)
        dev = cache.device
        self.q = torch.zeros(cache.batch_size, num_q_heads, 1, cache.head_dim, dtype=dtype, device=dev)
        self.out = torch.zeros_like(self.q)
        self.plan.refresh(layer)
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up: builds the module, workspace and prepared launches
            self.plan.launch(self.q, layer, self.out, self.scale)
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.plan.launch(self.q, layer, self.out, self.scale)

    def replay(self, q: torch.Tensor | None = None, refresh: bool = True) -> torch.Tensor:
        """Run one step: optionally copy ``q`` in, refresh lengths, replay. Returns the static ``out``."""
        if q is not None:
            self.q.copy_(q)
        if refresh:
            self.plan.refresh(self.layer)
        self.graph.replay()
        return self.out
