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

``quantizer="lloyd_max"`` records (``TileOffsets.quantizer``): a K code stands for the Lloyd-Max centroid
``c[code]`` (``format.codebook``, symmetric around 0, so no centering offset). The codes operand comes from
two 16-entry int8 tables (:data:`LM_TABLE_HI`, :data:`LM_TABLE_LO`, scale :data:`LM_SCALE` = S, from
:func:`lm_table`):

* unpack: row ``t`` = ``[LM_TABLE_HI[code] for c] ++ [LM_TABLE_LO[code] for c]``, hi ~= S c (values in
  [-104, 104]) and lo = round(S c / 16) (values in [-7, 7]);
* fold: ``qi8``, ``hi``, ``lo`` as above; ``a = (max|qfold| / 127) * LM_INV_SCALE`` (f32 ``1/S``);
  ``bias = sum_c q * chanMin`` (chanMin holds the axis centre, the codebook has mean 0).

So ``qi8 . codes = sum_c hi * LM_TABLE_HI + lo * LM_TABLE_LO ~= S * sum_c x * c`` (exact in int32:
``|.| <= D * (127 * 104 + 8 * 7) < 2^23``). S = 38.2183, hi = +-(5, 15, 25, 36, 48, 62, 79, 104): the table
and scale with the smallest RMS of ``hi/S - c`` weighted by the N(0, 1) mass of each code's cell,
:data:`LM_TABLE_RMS_ERR` = 0.00316 (max :data:`LM_TABLE_MAX_ERR` = 0.0112, on the outer centroid), in units
of the axis' RMS (the Gaussian's sigma); the Lloyd-Max quantization error itself has RMS 0.0975, so the
table adds ~0.1% to the K noise power. Effect on scores (CPU, realistic K/V and queries with outlier
channels, tests/test_gemm.py::test_lm_kscore_error_within_documented_bound): 1.3e-3..4.0e-3 norm-wise
relative against float64 q . K_dequant (uniform records, same data: 1.3e-4..5.7e-4); on the D=128 case
S = 127/max|c| gives 7.6e-3 and the max-error-optimal S = 44.54 gives 6.1e-3 (this S: 3.9e-3). Prefill
output error (tests/test_prefill.py inputs, torch path): 0.9e-3..1.1e-3 (bf16 case 2.0e-3) for lloyd_max;
with an exact f32 K operand 3.2e-4..3.6e-4 (uniform records: 3.3e-4..3.9e-4). The int8 path cannot carry a second level for the
centroids as it does for the query: a residual of the table needs weight 1/16 against full-range hi, and
the GEMM sums its K = 2D products with equal weights.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import struct
from typing import Any

import torch

from ..format import QUANTIZERS, _f32, codebook, lloyd_max_thresholds

__all__ = [
    "TileOffsets", "lm_table", "LM_SCALE", "LM_TABLE_HI", "LM_TABLE_LO", "LM_TABLE_MAX_ERR", "LM_TABLE_RMS_ERR", "unpack_reference", "fold_reference", "kscore_reference",
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
    quantizer: str = "uniform"

    @classmethod
    def from_spec(cls, spec: Any, record_stride: int | None = None) -> "TileOffsets":
        """From a :class:`kvarn_cutlass.format.TileSpec` (record stride defaults to ``tile_nbytes``)."""
        return cls(
            k_codes=spec.offset("k_codes"), chan_step=spec.offset("chan_step"), chan_min=spec.offset("chan_min"),
            row_scale=spec.offset("row_scale"),
            record_stride=int(record_stride if record_stride is not None else spec.tile_nbytes),
            tile_tokens=spec.tile_tokens, head_dim=spec.head_dim, scale_dtype=spec.scale_dtype,
            quantizer=spec.quantizer,
        )

    def check(self) -> None:
        T, D = self.tile_tokens, self.head_dim
        if T % 2 or T <= 0 or D % 32 or not (32 <= D <= 256):
            raise ValueError(f"tile_tokens={T} must be even and head_dim={D} a multiple of 32 in [32, 256]")
        if self.quantizer not in QUANTIZERS:
            raise ValueError(f"quantizer={self.quantizer!r} must be one of {list(QUANTIZERS)}")
        if self.scale_dtype not in (torch.float16, torch.float32):
            raise ValueError(f"scale_dtype={self.scale_dtype} must be torch.float16 or torch.float32")
        for nm in ("k_codes", "record_stride"):
            if getattr(self, nm) % 16:
                raise ValueError(f"{nm}={getattr(self, nm)} must be a multiple of 16 (16-byte loads)")

    @property
    def scale_tag(self) -> str:
        return "f16" if self.scale_dtype == torch.float16 else "f32"

    @property
    def kernel_tag(self) -> str:
        """Name part of the prep kernels for this layout: ``f16`` / ``f32``, ``lm_`` in front for lloyd_max."""
        return ("lm_" if self.quantizer == "lloyd_max" else "") + self.scale_tag


# ---------------------------------------------------------------------------------------------
# lloyd_max: the int8 tables of the 4-bit K centroids
def _cell_probabilities() -> list[float]:
    """N(0, 1) probability of each 4-bit lloyd_max code's decision cell (float64)."""
    edges = (-math.inf, *lloyd_max_thresholds(4), math.inf)
    return [0.5 * (math.erf(b / math.sqrt(2)) - math.erf(a / math.sqrt(2))) for a, b in zip(edges[:-1], edges[1:])]


def lm_table() -> tuple[float, tuple[int, ...], tuple[int, ...], float, float]:
    """(S, hi table, lo table, max error, RMS error) of the 4-bit lloyd_max K codes operand.

    The score error of the int8 path is a sum over channels of (table error of the channel's code) x
    (folded query), so the RMS table error weighted by how often each code occurs (the N(0, 1) mass of its
    decision cell) is what to minimize. For each of 4096 grid scales s in [32, 127 / max|c|], the table
    round(s c) gets its least-squares scale S = sum p h^2 / sum p h c (weights p); the table and scale
    with the smallest weighted RMS of h/S - c win. hi = that table, lo[i] = round(S c_i / 16), S rounded to
    float32. The errors reported are those of hi/S against the codebook's centroids (float16-rounded, so
    exact in float32 and float64 alike).
    """
    c = codebook("lloyd_max", 4)
    prob = _cell_probabilities()
    top = 127.0 / max(abs(x) for x in c)

    def rms(h, scale):
        return math.sqrt(sum(p * (hh / scale - x) ** 2 for p, hh, x in zip(prob, h, c)))

    best = None
    for i in range(4096):
        h = tuple(int(round(x * (32.0 + (top - 32.0) * i / 4095))) for x in c)
        scale = _f32(sum(p * hh * hh for p, hh in zip(prob, h)) / sum(p * hh * x for p, hh, x in zip(prob, h, c)))
        if best is None or rms(h, scale) < rms(*best[::-1]):
            best = (scale, h)
    scale, hi = best
    lo = tuple(int(round(x * scale / 16)) for x in c)
    return scale, hi, lo, max(abs(h / scale - x) for h, x in zip(hi, c)), rms(hi, scale)


LM_SCALE, LM_TABLE_HI, LM_TABLE_LO, LM_TABLE_MAX_ERR, LM_TABLE_RMS_ERR = lm_table()
LM_INV_SCALE = _f32(1.0 / LM_SCALE)  # the f32 factor folded into ``a`` (kernel and reference)


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
    """(codes int8 [L, T, 2D] token-major, row_scale f32 [L, T]) for the records.

    Rows are ``[16*(code-8) ++ (code-8)]`` (uniform) or ``[LM_TABLE_HI[code] ++ LM_TABLE_LO[code]]`` (lloyd_max)."""
    offs.check()
    T, D = offs.tile_tokens, offs.head_dim
    recs = _records(pool, tile_index, offs)
    b = recs[:, offs.k_codes:offs.k_codes + D * T // 2].reshape(-1, D, T // 2).to(torch.int16)
    lo, hi = b & 0xF, (b >> 4) & 0xF
    codes_ct = torch.stack((lo, hi), dim=-1).reshape(-1, D, T)  # [L, D, T]; even token = low nibble
    if offs.quantizer == "lloyd_max":
        idx = codes_ct.transpose(1, 2).to(torch.int64)  # [L, T, D]
        tab_hi = torch.tensor(LM_TABLE_HI, dtype=torch.int16, device=idx.device)
        tab_lo = torch.tensor(LM_TABLE_LO, dtype=torch.int16, device=idx.device)
        codes = torch.cat((tab_hi[idx], tab_lo[idx]), dim=-1).contiguous().to(torch.int8)
    else:
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
    lm = offs.quantizer == "lloyd_max"
    # uniform: the 1/16 of the residual level (exact: a power of two); lloyd_max: 1/S of the int8 table
    a = (amax / 127.0) * (LM_INV_SCALE if lm else 0.0625)
    # same f32 arithmetic as the kernel: one division per row, then a multiply (bit-exact qi8)
    # (tensor / tensor is an IEEE division; ``127.0 / tensor`` would be reciprocal() * 127 in torch)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / torch.where(amax > 0, amax, torch.ones_like(amax)),
                      torch.zeros_like(amax))
    x = qfold * inv[..., None]
    hi = torch.round(x).clamp(-127, 127)
    lo = torch.round((x - hi) * 16.0).clamp(-8, 8)  # x - hi is exact (Sterbenz), * 16 exact
    qi8 = torch.cat((hi, lo), dim=-1).to(torch.int8)
    # uniform: chanMin + 8*chanStep, the centering offset of the codes; lloyd_max: the centroids are centred
    cm8 = cmin if lm else cmin + 8.0 * step
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
_KERNEL_TAGS = ("f16", "f32", "lm_f16", "lm_f32")  # TileOffsets.kernel_tag values
PREP_KERNELS = (
    *(f"kvarn_kscore_unpack_{t}" for t in _KERNEL_TAGS),
    *(f"kvarn_kscore_fold_{q}_{t}" for t in _KERNEL_TAGS for q in ("f16", "bf16", "f32")),
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

    inv_bits = struct.unpack("<I", struct.pack("<f", LM_INV_SCALE))[0]
    defines = {
        "KSP_LM_HI": "{" + ", ".join(map(str, LM_TABLE_HI)) + "}",
        "KSP_LM_LO": "{" + ", ".join(map(str, LM_TABLE_LO)) + "}",
        "KSP_LM_INV_SCALE": f"__int_as_float(0x{inv_bits:08x})",
    }
    return KernelSpec("kscore_prep.cu", PREP_KERNELS, defines=defines, options=("-lineinfo",), name="kscore_prep")


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
        self._unpack = {t: self.module.kernel(f"kvarn_kscore_unpack_{t}", _UNPACK_SIG) for t in _KERNEL_TAGS}
        self._fold = {(q, t): self.module.kernel(f"kvarn_kscore_fold_{q}_{t}", _FOLD_SIG)
                      for q in ("f16", "bf16", "f32") for t in _KERNEL_TAGS}

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
        return self._unpack[offs.kernel_tag].prepare(
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
        return self._fold[(qtag, offs.kernel_tag)].prepare(
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
