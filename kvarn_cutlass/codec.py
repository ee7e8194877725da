"""Reference KVarN codec (torch, CPU or any device): encode and decode tile records.

Every step is written so that its float32 result is fixed bit for bit by IEEE-754, whatever the
machine, so that the GPU compression kernel (``csrc/compress.cu``) can reproduce the bytes exactly:

* only correctly rounded operations (+, -, *, /, sqrt, round-half-even, min, max, frexp/ldexp; the
  float32 sqrt goes through float64 because torch's MKL float32 sqrt is not correctly rounded),
  never exp/log (their last bit differs between libraries) and never a fused multiply-add;
* every sum is a *halving tree*: ``x[i] + x[i + n/2]`` for i < n/2, repeated until one element is
  left (a GPU reproduces it with ``__shfl_xor`` butterflies and shared memory);
* the Walsh-Hadamard transform is the in-place butterfly with strides 1, 2, 4, ..., D/2 (Sylvester
  order), then one multiplication by ``float32(1/sqrt(D))``.

Scheme, per tile [T, D] and per KV head, for K and V separately:

1. ``y = WHT(x)`` along head_dim.
2. Variance normalization: with row factors r[T] and column factors s[D] (start at 1), candidate
   ``z = (y / s) / r``; its imbalance score is max/min of the column RMS plus max/min of the row
   RMS. An iteration multiplies s by the column RMS of z, recomputes z and multiplies r by the
   row RMS. The factors are accumulated as products in float32 rather than in log space, because
   exp/log are not reproducible bit for bit across CPU and GPU; the factors stay in range because
   step 3 keeps them balanced and every input is finite. RMS values under ``TINY_RMS`` count as 1
   (constant-zero rows/columns are left alone). The candidate with the lowest score among the
   identity and the ``sinkhorn_iters`` iterations is kept (the first one on ties).
3. Exact power-of-two exchange between r and s so that max(r) and max(s) have binary exponents
   within one of each other: the stored scales then stay far inside float16 range for any fp16
   input (rotated |y| <= 65504 * 16, so each factor is about sqrt(|y|) <= 1024). Then the factor of
   a *zero line* (a token of the rotated K tile, or a channel of the rotated V tile, whose values
   are all zero) becomes 0, stored as the smallest positive scale (the clamp of ``_positive_scale``):
   u = 0 / scale = 0 whatever the scale, so only the decoded error there changes, from
   ``scale * |level|`` with the level the quantizer gives u = 0 (exactly 0 only when the axis's
   levels happen to include it) to a negligible one. Without this, a tile of tiny values with zero
   lines (a constant f16-subnormal tile rotates to one nonzero channel) decoded its zero lines with
   factor ~1 instead of the tile's ~1e-7, thousands of times its magnitude.
4. K: ``row_scale = r`` (stored), ``u = y / row_scale``, quantized per channel over the tile's
   tokens (4 bits) into ``chan_step``/``chan_min`` and codes. V: ``col_scale = s``, ``u = y /
   col_scale``, quantized per token over the channels (2 or 4 bits) into ``tok_step``/``tok_min``.
   Per axis of n values (``u + 0.0`` first: -0.0 + 0.0 == +0.0, so mixed-sign zeros compare alike),
   by ``spec.quantizer``; codes always come from the *stored* (rounded) step/min values, and a zero
   stored step gives code 0:

   * ``uniform``, asymmetric round-to-nearest-even: ``min = min(u)``, ``step = (max(u) - min(u)) /
     (2^bits - 1)`` (both stored), ``code = clamp(rint((u - min) / step), 0, 2^bits - 1)``.
   * ``lloyd_max``, nearest centroid of the Lloyd-Max codebook of N(0, 1) (``t =
     format.lloyd_max_thresholds(bits)``: ``code = #{j : (u - min) / step > t_j}``, ties go to the
     lower code), with (min, step) from one Lloyd iteration of the affine fit ``u ~ min + step *
     codebook[code]``:

     1. the Gaussian fit: ``mean = tree_sum(u) / n``, ``c = stored(mean)``, ``d = u - c``,
        ``rms = stored(float32(sqrt(float64(tree_sum(d * d) / n))))``, codes ``k0`` from (c, rms);
     2. the least-squares refit for those codes: ``b = codebook[k0]``, ``bm = tree_sum(b) / n``
        (exact: the codebook is in multiples of 2^-12), ``db = b - bm``, ``step =
        stored(tree_sum(db * d) / tree_sum(db * db))``, ``min = stored(mean - step * bm)``, and the
        codes again from (min, step). When every code is the same (``tree_sum(db * db) == 0``:
        a constant axis has rms 0 and code 0) or the refit's stored step is not positive and finite
        or its min not finite, (min, step) = (c, rms) and the codes are ``k0``.

     The Gaussian fit alone clipped an axis with one outlier (a constant tile rotates into tokens
     ``[a, 0, ..., 0]``: z = sqrt(n - 1) for a, the largest centroid 2.73) to a quarter of it; the
     refit puts such an axis's two values on two centroids, and lowers the squared error of a
     Gaussian axis too (a Lloyd step never raises it before the storage rounding). Overflow of
     the stored c or rms raises (the range proof of ``MAX_INPUT_ABS_F16_SCALES`` bounds u by them);
     the refit only replaces them where its own stored values are finite.

   Reconstruction, both quantizers: ``min + step * codebook[code]`` (``format.codebook``; the
   identity for ``uniform``), times row_scale (K) or col_scale (V), then the inverse WHT.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .format import TileSpec, codebook, lloyd_max_thresholds

TINY_RMS = 2.0**-100
# Largest accepted input magnitude: rotated values grow by at most sqrt(256) = 16 and their squares,
# summed over 256 entries, must stay finite in float32 (2^(2*(48+4)+8) = 2^112 < 2^128).
MAX_INPUT_ABS = 2.0**48
# Largest magnitude a token can have and still be stored in a tile with float16 scales (any preset,
# quantizer, head_dim, sinkhorn_iters); KVarNCache rejects larger tokens when they arrive. Proof: every
# stored scale is finite, so at most 65504 (values >= 65520 round to inf). K half: each channel's
# stored min and step bound the normalized values u = y / row_scale: uniform |u| < 65520 * (1 + 15);
# lloyd_max |u| <= |mean| + sqrt(T) * RMS < 65520 * (1 + sqrt(128)) (the Gaussian fit's stored
# mean and RMS, which the codec checks even where the refit replaces them). V half likewise over channels
# (uniform 1 + 3 or 1 + 15, lloyd_max 1 + sqrt(D) <= 17). So |u| < 17 * 65520 < 2^21 and every rotated
# value |y| = |u| * scale < 2^21 * 2^16 = 2^37 (up to float32 rounding). The WHT is orthonormal, so a
# token with some |x_c| = m has ||y||_2 >= m (1 - 2^-20) and hence a rotated value >= m / sqrt(D) -
# above 2^37 once m > sqrt(256) * 2^37 = 2^41. 2^42 leaves a factor of 2 for rounding.
MAX_INPUT_ABS_F16_SCALES = 2.0**42
FLOAT_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# What decode computes in: the reconstruction's products and the inverse WHT's sums would lose bits
# (and overflow above ~4096 for D=256) in a 16-bit dtype; decode in float32 and convert instead.
DECODE_DTYPES = (torch.float32, torch.float64)


# --- deterministic primitives ------------------------------------------------------------------
def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum along ``dim`` (power-of-two length) as a halving tree; see the module docstring."""
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"tree_sum needs a power-of-two length, got {n}")
    while n > 1:
        n //= 2
        x = x[..., :n] + x[..., n:]
    return x[..., 0]


def wht(x: torch.Tensor) -> torch.Tensor:
    """Normalized Walsh-Hadamard transform along the last dim (Sylvester order, its own inverse).

    x: [..., D] float32 or float64, D a power of two. Returns a new tensor of the same dtype.
    """
    D = x.shape[-1]
    if D & (D - 1):
        raise ValueError(f"wht needs a power-of-two last dim, got {D}")
    lead = x.shape[:-1]
    y = x.reshape(-1, D)
    h = 1
    while h < D:
        pairs = y.reshape(-1, D // (2 * h), 2, h)
        a, b = pairs[:, :, 0, :], pairs[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2).reshape(-1, D)
        h *= 2
    return (y * torch.tensor(1.0 / math.sqrt(D), dtype=y.dtype)).reshape(*lead, D)


def _rms(z: torch.Tensor, dim: int) -> torch.Tensor:
    n = z.shape[dim]
    # torch.sqrt on float32 is not correctly rounded on MKL builds (about 0.7% of results are 1 ulp
    # low); a float64 sqrt rounded to float32 is (53 >= 2*24 + 2 bits), as the GPU's __fsqrt_rn.
    rms = torch.sqrt((tree_sum(z * z, dim) / float(n)).double()).to(torch.float32)
    return torch.where(rms < TINY_RMS, torch.ones_like(rms), rms)


def _imbalance(col_rms: torch.Tensor, row_rms: torch.Tensor) -> torch.Tensor:
    return col_rms.amax(-1) / col_rms.amin(-1) + row_rms.amax(-1) / row_rms.amin(-1)


def normalization_factors(y: torch.Tensor, iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row factors r [..., T] and column factors s [..., D] for rotated tiles y [..., T, D] float32."""
    r = torch.ones(y.shape[:-1], dtype=y.dtype)
    s = torch.ones(y.shape[:-2] + y.shape[-1:], dtype=y.dtype)
    best_r, best_s = r, s
    best_score = torch.full(y.shape[:-2], math.inf, dtype=y.dtype)
    for it in range(iters + 1):
        z = y / s[..., None, :] / r[..., :, None]
        col_rms, row_rms = _rms(z, -2), _rms(z, -1)
        score = _imbalance(col_rms, row_rms)
        better = score < best_score
        best_score = torch.where(better, score, best_score)
        best_r = torch.where(better[..., None], r, best_r)
        best_s = torch.where(better[..., None], s, best_s)
        if it == iters:
            break
        s = s * col_rms
        r = r * _rms(y / s[..., None, :] / r[..., :, None], -1)
    return _balance(best_r, best_s)


def _balance(r: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move an exact power of two from r to s so their maxima have close binary exponents."""
    er = torch.frexp(r.amax(-1)).exponent
    es = torch.frexp(s.amax(-1)).exponent
    shift = torch.div(er - es, 2, rounding_mode="floor")  # floor, as an arithmetic shift right
    return torch.ldexp(r, -shift[..., None].to(r.dtype)), torch.ldexp(s, shift[..., None].to(s.dtype))


def _store(x: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    """Round to the storage dtype (round-to-nearest-even) and back to float32."""
    stored = x.to(dtype)
    if not torch.isfinite(stored).all():
        raise ValueError(
            f"{what} overflows {dtype}: the input's magnitude needs scale_dtype=torch.float32"
        )
    return stored.to(torch.float32)


def _positive_scale(x: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    """Stored factor, clamped to the smallest positive value of ``dtype`` (never 0: we divide by it)."""
    smallest = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    return _store(torch.clamp_min(x, smallest), dtype, what)


def _quantize(u: torch.Tensor, bits: int, dim: int, dtype: torch.dtype, what: str, quantizer: str):
    """Quantize u along ``dim`` by ``quantizer``: returns (step, min) as stored float32 and uint8 codes."""
    if quantizer == "lloyd_max":
        return _quantize_lloyd_max(u, bits, dim, dtype, what)
    return _quantize_uniform(u, bits, dim, dtype, what)


def _quantize_uniform(u: torch.Tensor, bits: int, dim: int, dtype: torch.dtype, what: str):
    """Asymmetric RTN of u along ``dim``: returns (step, min) as stored float32 and int codes."""
    qmax = float(2**bits - 1)
    # -0.0 + 0.0 == +0.0: min/max over mixed-sign zeros would otherwise pick either sign.
    u = u + 0.0
    lo, hi = u.amin(dim, keepdim=True), u.amax(dim, keepdim=True)
    # A tensor divisor: some torch builds turn division by a Python scalar into a multiplication
    # by its reciprocal, which is not the correctly rounded quotient the format defines.
    step = _store((hi - lo) / torch.full_like(hi, qmax), dtype, what + " step")
    low = _store(lo, dtype, what + " min")
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = torch.round((u - low) / safe).clamp_(0, qmax)
    codes = torch.where(step > 0, codes, torch.zeros_like(codes))
    return step.squeeze(dim), low.squeeze(dim), codes.to(torch.uint8)


def _quantize_lloyd_max(u: torch.Tensor, bits: int, dim: int, dtype: torch.dtype, what: str):
    """Nearest Lloyd-Max centroid of u along ``dim`` with (min, step) from one Lloyd iteration of the
    affine fit (the module docstring, step 4): returns (step, min) as stored float32 and uint8 codes."""
    n = torch.tensor(float(u.shape[dim]), dtype=torch.float32)  # a tensor divisor, as in _quantize_uniform
    u = u + 0.0  # a sum of zeros of mixed sign is +0.0 whatever the order
    mean = (tree_sum(u, dim) / n).unsqueeze(dim)
    center = _store(mean, dtype, what + " min")
    d = u - center
    # float64 sqrt rounded to float32 is correctly rounded (see _rms)
    rms = torch.sqrt((tree_sum(d * d, dim) / n).double()).to(torch.float32).unsqueeze(dim)
    scale = _store(rms, dtype, what + " step")
    codes = _lloyd_max_codes(d, scale, bits)
    book = torch.tensor(codebook("lloyd_max", bits), dtype=torch.float32, device=u.device)
    b = book[codes]
    b_mean = (tree_sum(b, dim) / n).unsqueeze(dim)
    db = b - b_mean
    den = tree_sum(db * db, dim).unsqueeze(dim)
    num = tree_sum(db * d, dim).unsqueeze(dim)
    step = (num / torch.where(den > 0, den, torch.ones_like(den))).to(dtype).to(torch.float32)
    low = (mean - step * b_mean).to(dtype).to(torch.float32)
    refit = (den > 0) & (step > 0) & torch.isfinite(step) & torch.isfinite(low)
    step = torch.where(refit, step, scale)
    low = torch.where(refit, low, center)
    codes = torch.where(refit, _lloyd_max_codes(u - low, step, bits), codes)
    return step.squeeze(dim), low.squeeze(dim), codes.to(torch.uint8)


def _lloyd_max_codes(d: torch.Tensor, step: torch.Tensor, bits: int) -> torch.Tensor:
    """``#{j : d / step > t_j}`` (ties go to the lower code); code 0 where the stored step is 0."""
    safe = torch.where(step > 0, step, torch.ones_like(step))
    thresholds = torch.tensor(lloyd_max_thresholds(bits), dtype=torch.float32, device=d.device)
    codes = ((d / safe).unsqueeze(-1) > thresholds).sum(-1)
    return torch.where(step > 0, codes, torch.zeros_like(codes))


def _pack_low_first(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., n] uint8 -> bytes [..., n*bits/8], code j of a byte at bit j*bits."""
    per = 8 // bits
    c = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per, per).to(torch.int32)
    shifts = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
    return (c << shifts).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed code bytes uint8 [..., m] -> codes uint8 [..., m * 8 / bits], code j of a byte at bit j*bits
    (the record layout: the even token of a K byte in the low nibble, V codes lowest bits first).

    The one unpacking of the format: :func:`unpack_fields` and every reference path and test that needs
    codes read them through it. ``bits`` is the code width (1, 2, 4 or 8); a TypeError/ValueError names
    the argument that is wrong.
    """
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise TypeError(f"packed must be a uint8 torch.Tensor, got "
                        f"{packed.dtype if isinstance(packed, torch.Tensor) else type(packed).__name__}")
    if isinstance(bits, bool) or bits not in (1, 2, 4, 8):
        raise ValueError(f"bits must be 1, 2, 4 or 8 (codes per byte: 8 / bits), got {bits!r}")
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    c = (packed.to(torch.int32)[..., None] >> shifts) & (2**bits - 1)
    return c.reshape(*packed.shape[:-1], packed.shape[-1] * per).to(torch.uint8)


def _as_bytes(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).contiguous().view(torch.uint8)


# --- validation --------------------------------------------------------------------------------
def check_spec(spec, name: str = "spec") -> None:
    """Raise a TypeError naming ``name`` unless spec is a :class:`~kvarn_cutlass.format.TileSpec`."""
    if not isinstance(spec, TileSpec):
        raise TypeError(f"{name} must be a kvarn_cutlass.TileSpec, got {type(spec).__name__}")


def check_decode_dtype(dtype, name: str = "dtype") -> None:
    """Raise a TypeError naming ``name`` unless dtype is one of ``DECODE_DTYPES``."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype (torch.float32 or torch.float64), got {dtype!r}")
    if dtype not in DECODE_DTYPES:
        raise TypeError(f"{name}={dtype} is not supported; decode computes in {list(DECODE_DTYPES)} "
                        "(decode in float32 and convert the result for another dtype)")


def check_tile_input(name: str, x, spec: TileSpec) -> None:
    """Raise a ValueError/TypeError naming ``name`` unless x is a finite float [..., T, D] tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_INPUT_DTYPES:
        raise TypeError(f"{name} has dtype {x.dtype}; supported: {list(FLOAT_INPUT_DTYPES)}")
    if x.dim() < 2 or tuple(x.shape[-2:]) != (spec.tile_tokens, spec.head_dim):
        raise ValueError(
            f"{name} must have shape [..., {spec.tile_tokens}, {spec.head_dim}] "
            f"(tile_tokens, head_dim), got {list(x.shape)}"
        )
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} contains NaN or Inf")
    if x.numel() and x.abs().max().item() > MAX_INPUT_ABS:
        raise ValueError(f"{name} has values of magnitude > 2^48, outside the codec's float32 range")


# --- encode / decode ---------------------------------------------------------------------------
def encode_tiles(k: torch.Tensor, v: torch.Tensor, spec: TileSpec) -> torch.Tensor:
    """Encode tiles of K and V into records.

    k, v: [..., tile_tokens, head_dim], float16/bfloat16/float32, finite, same shape.
    Returns uint8 [..., spec.tile_nbytes] on the device of k, byte-identical for identical
    inputs on any machine. Raises ValueError/TypeError naming the argument on bad input.
    """
    check_spec(spec)
    check_tile_input("k", k, spec)
    check_tile_input("v", v, spec)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}")
    if k.device != v.device:
        raise ValueError(f"k and v must be on one device, got {k.device} and {v.device}")
    device, lead = k.device, k.shape[:-2]
    T, D, sd = spec.tile_tokens, spec.head_dim, spec.scale_dtype
    # The reference runs on the CPU: its float32 arithmetic is the definition of the format.
    yk = wht(k.detach().to("cpu", torch.float32).reshape(-1, T, D))
    yv = wht(v.detach().to("cpu", torch.float32).reshape(-1, T, D))

    r, _ = normalization_factors(yk, spec.sinkhorn_iters)
    row_scale = _positive_scale(torch.where((yk == 0).all(-1), torch.zeros_like(r), r), sd, "K row_scale")
    chan_step, chan_min, k_codes = _quantize(yk / row_scale[..., :, None], spec.k_bits, -2, sd, "K chan", spec.quantizer)

    _, s = normalization_factors(yv, spec.sinkhorn_iters)
    col_scale = _positive_scale(torch.where((yv == 0).all(-2), torch.zeros_like(s), s), sd, "V col_scale")
    tok_step, tok_min, v_codes = _quantize(yv / col_scale[..., None, :], spec.v_bits, -1, sd, "V tok", spec.quantizer)

    parts = [
        _pack_low_first(k_codes.transpose(-1, -2), spec.k_bits).reshape(-1, D * T * spec.k_bits // 8),
        _as_bytes(chan_step, sd),
        _as_bytes(chan_min, sd),
        _as_bytes(row_scale, sd),
        _pack_low_first(v_codes, spec.v_bits).reshape(-1, T * D * spec.v_bits // 8),
        _as_bytes(tok_step, sd),
        _as_bytes(tok_min, sd),
        _as_bytes(col_scale, sd),
    ]
    rec = torch.cat(parts, dim=-1)
    assert rec.shape[-1] == spec.tile_nbytes
    return rec.reshape(*lead, spec.tile_nbytes).to(device)


@dataclass
class TileFields:
    """The fields of records [...], unpacked (codes as uint8, scales as float32).

    k_codes: [..., D, T] channel-major; v_codes: [..., T, D]; chan_step, chan_min, col_scale: [..., D];
    row_scale, tok_step, tok_min: [..., T]. k_codebook [2^k_bits], v_codebook [2^v_bits]: float32, the
    value of each code (``format.codebook`` of the spec's quantizer).
    """

    k_codes: torch.Tensor
    chan_step: torch.Tensor
    chan_min: torch.Tensor
    row_scale: torch.Tensor
    v_codes: torch.Tensor
    tok_step: torch.Tensor
    tok_min: torch.Tensor
    col_scale: torch.Tensor
    k_codebook: torch.Tensor
    v_codebook: torch.Tensor

    @property
    def k_values(self) -> torch.Tensor:
        """float32 [..., D, T]: the codebook value of each K code."""
        return self.k_codebook[self.k_codes.long()]

    @property
    def v_values(self) -> torch.Tensor:
        """float32 [..., T, D]: the codebook value of each V code."""
        return self.v_codebook[self.v_codes.long()]


def check_records(rec, spec: TileSpec, name: str = "rec") -> None:
    """Raise a TypeError/ValueError naming ``name`` (or ``spec``) unless rec is uint8 [..., spec.tile_nbytes]."""
    check_spec(spec)
    if not isinstance(rec, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(rec).__name__}")
    if rec.dtype != torch.uint8 or rec.dim() < 1 or rec.shape[-1] != spec.tile_nbytes:
        raise ValueError(
            f"{name} must be uint8 [..., {spec.tile_nbytes}] for {spec.preset} head_dim={spec.head_dim} "
            f"scale_dtype={spec.scale_dtype}, got {rec.dtype} {list(rec.shape)}"
        )


def unpack_fields(rec: torch.Tensor, spec: TileSpec) -> TileFields:
    """Split records uint8 [..., tile_nbytes] into their fields (same device as rec)."""
    check_records(rec, spec)
    T, D, sd = spec.tile_tokens, spec.head_dim, spec.scale_dtype
    lead = rec.shape[:-1]
    flat = rec.reshape(-1, spec.tile_nbytes)

    def raw(name):
        off, n = spec.section(name)
        return flat[:, off : off + n]

    def scales(name):
        return raw(name).contiguous().view(sd).to(torch.float32).reshape(*lead, spec.section(name)[1] // spec.scale_bytes)

    n = flat.shape[0]
    k_codes = unpack_codes(raw("k_codes").reshape(n, D, T * spec.k_bits // 8), spec.k_bits)
    v_codes = unpack_codes(raw("v_codes").reshape(n, T, D * spec.v_bits // 8), spec.v_bits)
    return TileFields(
        k_codes=k_codes.reshape(*lead, D, T),
        chan_step=scales("chan_step"),
        chan_min=scales("chan_min"),
        row_scale=scales("row_scale"),
        v_codes=v_codes.reshape(*lead, T, D),
        tok_step=scales("tok_step"),
        tok_min=scales("tok_min"),
        col_scale=scales("col_scale"),
        k_codebook=torch.tensor(spec.k_codebook, dtype=torch.float32, device=rec.device),
        v_codebook=torch.tensor(spec.v_codebook, dtype=torch.float32, device=rec.device),
    )


def dequantize_rotated(f: TileFields, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [..., T, D] in the rotated domain, computed in ``dtype`` (float32 or float64; codes
    through the codebook)."""
    check_decode_dtype(dtype)
    c = lambda t: t.to(dtype)  # noqa: E731
    k = c(f.row_scale)[..., :, None] * (c(f.chan_min)[..., None, :] + c(f.chan_step)[..., None, :] * c(f.k_values).transpose(-1, -2))
    v = c(f.col_scale)[..., None, :] * (c(f.tok_min)[..., :, None] + c(f.tok_step)[..., :, None] * c(f.v_values))
    return k, v


def decode_tiles(rec: torch.Tensor, spec: TileSpec, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Records uint8 [..., tile_nbytes] -> (k, v) [..., T, D] in the original (unrotated) domain.

    Computed in ``dtype``: float32 (default) or float64 (for references); any other dtype raises a
    TypeError naming ``dtype``.
    """
    check_decode_dtype(dtype)
    k, v = dequantize_rotated(unpack_fields(rec, spec), dtype)
    return wht(k), wht(v)
