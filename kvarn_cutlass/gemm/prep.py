"""Prep kernels of the K-score GEMM (``csrc/kscore_prep.cu``, NVRTC) and their torch references.

Batch convention: ``l = head * n_tiles + tile`` for ``l in range(L)``; ``tile_index[l]`` (int32) is
the record index of that (tile, KV head) in the pool, whose record starts at
``pool + tile_index[l] * record_stride`` bytes.

Centered codes, two-level residual fold: the GEMM depth is ``K = 2 * D`` (operands ``[hi ++ lo]``).

* unpack: pool records -> ``codes`` int8 [L, T, 2D] token-major, row ``t`` =
  ``[16 * (code - 8) for c in 0..D-1] ++ [(code - 8) for c in 0..D-1]`` (values in [-128, 112] and
  [-8, 7]) and ``row_scale`` f32 [L, T] (the GEMM's column broadcast, converted from the record's
  scale dtype).
* fold:   ``q`` [H, M, D] (f16/bf16/f32) + each batch's chanStep/chanMin ->
  ``qi8`` int8 [L, M, 2D], ``a`` f32 [L, M], ``bias`` f32 [L, M] with (all f32)
  ``qfold = q * chanStep``, ``x = qfold * (127 / max|qfold|)`` (0 when the row is 0),
  ``hi = rint(x)`` in [-127, 127], ``lo = rint((x - hi) * 16)`` in [-8, 8], row ``[hi ++ lo]``;
  ``a = (max|qfold| / 127) / 16`` (the GEMM's per-row scale: the 1/16 of the residual level is folded
  into ``a``, so the GEMM epilogue is unchanged);
  ``bias = sum_c q * (chanMin + 8 * chanStep)`` (the centering offset of the codes, exact in f32 terms).

Then ``S[l, m, t] = scale * row_scale[l, t] * (a[l, m] * (qi8[l, m] . codes[l, t]) + bias[l, m])`` with
``qi8 . codes = 16 * sum_c (hi + lo / 16) * (code - 8)``, exact in int32 (``|.| <= D * 16320 < 2^23``), and
``|x - (hi + lo / 16)| <= 1/32`` per channel (one int8 level would give 1/2).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

__all__ = [
    "TileOffsets", "unpack_reference", "fold_reference", "kscore_reference",
    "prep_spec", "build_prep", "PrepKernels", "PREP_KERNELS",
]


@dataclasses.dataclass(frozen=True)
class TileOffsets:
    """Byte offsets of the K sections in a tile record, plus record stride and shapes."""

    k_codes: int
    chan_step: int
    chan_min: int
    row_scale: int
    record_stride: int
    tile_tokens: int
    head_dim: int
    scale_dtype: torch.dtype = torch.float16

    @classmethod
    def from_spec(cls, spec: Any, record_stride: int | None = None) -> "TileOffsets":
        """From a :class:`kvarn_cutlass.format.TileSpec` (record stride defaults to ``tile_nbytes``)."""
        return cls(
            k_codes=spec.offset("k_codes"), chan_step=spec.offset("chan_step"), chan_min=spec.offset("chan_min"),
            row_scale=spec.offset("row_scale"),
            record_stride=int(record_stride if record_stride is not None else spec.tile_nbytes),
            tile_tokens=spec.tile_tokens, head_dim=spec.head_dim, scale_dtype=spec.scale_dtype,
        )

    def check(self) -> None:
        T, D = self.tile_tokens, self.head_dim
        if T % 2 or T <= 0 or D % 32 or not (32 <= D <= 256):
            raise ValueError(f"tile_tokens={T} must be even and head_dim={D} a multiple of 32 in [32, 256]")
        if self.scale_dtype not in (torch.float16, torch.float32):
            raise ValueError(f"scale_dtype={self.scale_dtype} must be torch.float16 or torch.float32")
        for nm in ("k_codes", "record_stride"):
            if getattr(self, nm) % 16:
                raise ValueError(f"{nm}={getattr(self, nm)} must be a multiple of 16 (16-byte loads)")

    @property
    def scale_tag(self) -> str:
        return "f16" if self.scale_dtype == torch.float16 else "f32"


# ---------------------------------------------------------------------------------------------
# torch references (CPU or GPU; same arithmetic as the kernels, f32)
def _records(pool: torch.Tensor, tile_index: torch.Tensor, offs: TileOffsets) -> torch.Tensor:
    flat = pool.reshape(-1)
    idx = tile_index.to(torch.int64).reshape(-1, 1) * offs.record_stride
    return flat[idx + torch.arange(offs.record_stride, device=flat.device).reshape(1, -1)]  # [L, stride]


def _scales(recs: torch.Tensor, off: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    nbytes = n * torch.finfo(dtype).bits // 8
    return recs[:, off:off + nbytes].contiguous().view(dtype).to(torch.float32)


def unpack_reference(pool: torch.Tensor, tile_index: torch.Tensor, offs: TileOffsets) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 [L, T, 2D] token-major ``[16*(code-8) ++ (code-8)]``, row_scale f32 [L, T]) for the records."""
    offs.check()
    T, D = offs.tile_tokens, offs.head_dim
    recs = _records(pool, tile_index, offs)
    b = recs[:, offs.k_codes:offs.k_codes + D * T // 2].reshape(-1, D, T // 2).to(torch.int16)
    lo, hi = b & 0xF, (b >> 4) & 0xF
    codes_ct = torch.stack((lo, hi), dim=-1).reshape(-1, D, T)  # [L, D, T]; even token = low nibble
    centered = codes_ct.transpose(1, 2) - 8  # [L, T, D] in [-8, 7]
    codes = torch.cat((centered * 16, centered), dim=-1).contiguous().to(torch.int8)
    rs = _scales(recs, offs.row_scale, T, offs.scale_dtype)
    return codes, rs


def fold_reference(q: torch.Tensor, pool: torch.Tensor, tile_index: torch.Tensor, offs: TileOffsets,
                   n_tiles: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qi8 int8 [L, M, 2D] ``[hi ++ lo]``, a f32 [L, M], bias f32 [L, M]); ``q`` is [H, M, D] (or [M, D] for H=1).

    Same f32 arithmetic as the kernel, so ``qi8`` and ``a`` are bit-exact; ``bias`` is the same sum in
    another order (the kernel: per-lane fma chains + a warp butterfly)."""
    offs.check()
    if q.dim() == 2:
        q = q.unsqueeze(0)
    H, M, D = q.shape
    if D != offs.head_dim:
        raise ValueError(f"q head_dim {D} != tile head_dim {offs.head_dim}")
    L = tile_index.numel()
    if L != H * n_tiles:
        raise ValueError(f"L={L} tile_index entries != H={H} * n_tiles={n_tiles}")
    recs = _records(pool, tile_index, offs)
    step = _scales(recs, offs.chan_step, D, offs.scale_dtype)  # [L, D]
    cmin = _scales(recs, offs.chan_min, D, offs.scale_dtype)
    qf = q.to(torch.float32).repeat_interleave(n_tiles, dim=0)  # [L, M, D], l = h*n_tiles + tile
    qfold = qf * step[:, None, :]
    amax = qfold.abs().amax(dim=-1)
    a = (amax / 127.0) * 0.0625  # the 1/16 of the residual level (exact: a power of two)
    # same f32 arithmetic as the kernel: one division per row, then a multiply (bit-exact qi8)
    # (tensor / tensor is an IEEE division; ``127.0 / tensor`` would be reciprocal() * 127 in torch)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / torch.where(amax > 0, amax, torch.ones_like(amax)),
                      torch.zeros_like(amax))
    x = qfold * inv[..., None]
    hi = torch.round(x).clamp(-127, 127)
    lo = torch.round((x - hi) * 16.0).clamp(-8, 8)  # x - hi is exact (Sterbenz), * 16 exact
    qi8 = torch.cat((hi, lo), dim=-1).to(torch.int8)
    cm8 = cmin + 8.0 * step  # chanMin + 8*chanStep: the centering offset of the codes
    bias = (qf * cm8[:, None, :]).sum(-1)
    return qi8, a, bias


def kscore_reference(qi8: torch.Tensor, codes: torch.Tensor, a: torch.Tensor, bias: torch.Tensor,
                     row_scale: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(acc int64 [L, M, N], S float64 [L, M, N]) of the GEMM + epilogue, exactly (CPU, int64/f64).

    ``qi8`` [L, M, K] and ``codes`` [L, N, K] with K = 2D for the fold/unpack operands (any K works)."""
    acc = torch.matmul(qi8.cpu().to(torch.int64), codes.cpu().to(torch.int64).transpose(1, 2))
    S = scale * row_scale.cpu().double()[:, None, :] * (a.cpu().double()[..., None] * acc.double()
                                                       + bias.cpu().double()[..., None])
    return acc, S


# ---------------------------------------------------------------------------------------------
# build + launch
PREP_KERNELS = (
    "kvarn_kscore_unpack_f16", "kvarn_kscore_unpack_f32",
    *(f"kvarn_kscore_fold_{q}_{s}" for s in ("f16", "f32") for q in ("f16", "bf16", "f32")),
)
_UNPACK_SIG = ("ptr pool", "ptr tile_index", "i64 record_stride", "i32 k_codes_offset", "i32 row_scale_offset",
               "i32 T", "i32 D", "ptr codes_out", "ptr rs_out")
_FOLD_SIG = ("ptr q", "i64 q_row_stride", "i64 q_head_stride", "ptr pool", "ptr tile_index", "i64 record_stride",
             "i32 chan_step_offset", "i32 chan_min_offset", "i32 M", "i32 D", "i32 n_tiles", "ptr qi8", "ptr a_out",
             "ptr bias_out")
_QTAG = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}


def prep_spec():
    """The runtime KernelSpec of ``csrc/kscore_prep.cu`` (registered, so ``kvarn-cutlass build`` sees it)."""
    from ..runtime import KernelSpec

    return KernelSpec("kscore_prep.cu", PREP_KERNELS, options=("-lineinfo",), name="kscore_prep")


def build_prep(arch: "int | str" = 90):
    """Compile (NVRTC, cached on disk by the runtime) the prep kernels for ``arch``; no GPU needed.
    Returns the runtime's ``CompiledModule`` (cubin and per-kernel resources)."""
    from ..runtime import build

    return build(prep_spec(), arch)


def _register() -> None:
    from ..runtime.registry import register

    register("kscore_prep", lambda: [prep_spec()])


_register()


class PrepKernels:
    """Loaded prep kernels on one device.  ``unpack``/``fold`` allocate nothing when outputs are given."""

    def __init__(self, device: Any = None):
        from .. import runtime as rt

        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        self.device = dev
        self.module = rt.get_module(prep_spec(), dev)
        self._unpack = {s: self.module.kernel(f"kvarn_kscore_unpack_{s}", _UNPACK_SIG) for s in ("f16", "f32")}
        self._fold = {(q, s): self.module.kernel(f"kvarn_kscore_fold_{q}_{s}", _FOLD_SIG)
                      for q in ("f16", "bf16", "f32") for s in ("f16", "f32")}

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def get(device_index: int) -> "PrepKernels":
        return PrepKernels(torch.device("cuda", device_index))

    # -- unpack --------------------------------------------------------------------------------
    def prepare_unpack(self, pool, tile_index, offs: TileOffsets, codes_out, rs_out):
        offs.check()
        L = tile_index.numel()
        T, D = offs.tile_tokens, offs.head_dim
        _expect(codes_out, (L, T, 2 * D), torch.int8, "codes_out")
        _expect(rs_out, (L, T), torch.float32, "rs_out")
        _expect_dtype(tile_index, torch.int32, "tile_index")
        smem = D * (T // 2 + 1)
        return self._unpack[offs.scale_tag].prepare(
            (L, 1, 1), 256,
            (pool, tile_index, offs.record_stride, offs.k_codes, offs.row_scale, T, D, codes_out, rs_out),
            shared_mem=smem)

    def unpack(self, pool, tile_index, offs: TileOffsets, codes_out=None, rs_out=None, stream=None):
        L = tile_index.numel()
        if codes_out is None:
            codes_out = torch.empty((L, offs.tile_tokens, 2 * offs.head_dim), dtype=torch.int8, device=pool.device)
        if rs_out is None:
            rs_out = torch.empty((L, offs.tile_tokens), dtype=torch.float32, device=pool.device)
        self.prepare_unpack(pool, tile_index, offs, codes_out, rs_out).launch(stream)
        return codes_out, rs_out

    # -- fold ----------------------------------------------------------------------------------
    def prepare_fold(self, q, pool, tile_index, offs: TileOffsets, n_tiles: int, qi8, a, bias):
        offs.check()
        q3 = q.unsqueeze(0) if q.dim() == 2 else q
        H, M, D = q3.shape
        if q3.stride(2) != 1:
            raise ValueError(f"q must have unit channel stride, got strides {tuple(q3.stride())}")
        if D != offs.head_dim or D not in (64, 128, 256):
            raise ValueError(f"q head_dim {D} must equal the tile head_dim {offs.head_dim} and be 64, 128 or 256")
        if q3.data_ptr() % 16 or q3.stride(1) * q3.element_size() % 16 or (H > 1 and q3.stride(0) * q3.element_size() % 16):
            raise ValueError(f"q must be 16-byte aligned with 16-byte aligned row/head strides (vector loads), strides {tuple(q3.stride())}")
        qtag = _QTAG.get(q3.dtype)
        if qtag is None:
            raise TypeError(f"q dtype {q3.dtype} not supported (float16, bfloat16, float32)")
        L = tile_index.numel()
        if L != H * n_tiles:
            raise ValueError(f"L={L} != H={H} * n_tiles={n_tiles}")
        _expect(qi8, (L, M, 2 * D), torch.int8, "qi8")
        _expect(a, (L, M), torch.float32, "a")
        _expect(bias, (L, M), torch.float32, "bias")
        _expect_dtype(tile_index, torch.int32, "tile_index")
        return self._fold[(qtag, offs.scale_tag)].prepare(
            ((M + 63) // 64, L, 1), 256,
            (q3, q3.stride(1), q3.stride(0) if H > 1 else 0, pool, tile_index, offs.record_stride, offs.chan_step,
             offs.chan_min, M, D, n_tiles, qi8, a, bias))

    def fold(self, q, pool, tile_index, offs: TileOffsets, n_tiles: int, qi8=None, a=None, bias=None, stream=None):
        q3 = q.unsqueeze(0) if q.dim() == 2 else q
        L, M, D = tile_index.numel(), q3.shape[1], q3.shape[2]
        qi8 = torch.empty((L, M, 2 * D), dtype=torch.int8, device=q.device) if qi8 is None else qi8
        a = torch.empty((L, M), dtype=torch.float32, device=q.device) if a is None else a
        bias = torch.empty((L, M), dtype=torch.float32, device=q.device) if bias is None else bias
        self.prepare_fold(q, pool, tile_index, offs, n_tiles, qi8, a, bias).launch(stream)
        return qi8, a, bias


def _expect_dtype(t: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")


def _expect(t: torch.Tensor, shape: tuple, dtype: torch.dtype, name: str) -> None:
    _expect_dtype(t, dtype, name)
    if tuple(t.shape) != tuple(shape) or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {tuple(shape)} tensor, got {tuple(t.shape)} strides {tuple(t.stride())}")
