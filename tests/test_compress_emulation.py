"""CPU mirror of the GPU compression kernel (``csrc/compress.cu``), operation for operation.

``emulate_records`` replays the kernel in numpy float32 with its thread layout: per block (one
record half), thread (warp w, lane l) holds the elements t = w + W*k (k < NK = T/W) and
c = l + 32*j (j < NJ = D/32); arrays below are indexed ``[w, l, k, j]`` like the registers. Every
in-thread halving tree, ``__shfl_xor`` butterfly (WHT stages h < 32, ``warp_tree``) and the
cross-warp shared-memory tree is written out in the kernel's order; ``sqrt`` is correctly rounded
like ``__fsqrt_rn``. Min/max reductions are order-free (finite input, canonical +0 after ``+ 0.0``).
Both quantizers: lloyd_max's per-axis mean and sum of squares go through the kernel's column sum
(in-thread tree over k, then tree<W> over the warps) or row sum (tree over j, then warp_tree).

What the tests establish (no GPU needed):

* the kernel's order of operations is the codec's: the mirror (correctly rounded sqrt, as
  ``__fsqrt_rn``) reproduces ``codec.encode_tiles`` byte for byte, for float16 and float32 scales.
  On torch builds with MKL (x86 wheels) ``torch.sqrt`` of float32 is not correctly rounded (MKL VML
  in ``VML_HA`` mode, ATen ``cpu/vml.h``: ``IMPLEMENT_VML_MKL(sqrt, Sqrt)``), so the codec takes its
  sqrt in float64; a codec back on ``torch.sqrt`` fails the float32-scale cases here and
  ``tests/test_codec.py::test_codec_rms_is_the_correctly_rounded_sqrt``;
* the lloyd_max path (per-axis mean and RMS) reproduces the codec on random, realistic and
  degenerate tiles (constant axes: stored RMS 0, code 0).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from kvarn_cutlass import codec
from kvarn_cutlass.format import TileSpec, lloyd_max_thresholds
from kvarn_cutlass.ops.compress import _inv_sqrt

from _helpers import realistic_kv

f32 = np.float32
W = 16  # KVC_W: warps per block (KVC_NT = 512 threads)
LANES = np.arange(32)


# ---- kernel primitives ---------------------------------------------------------------------------
def sqrt_rn(x: np.ndarray) -> np.ndarray:
    """Correctly rounded float32 sqrt (__fsqrt_rn): float64 sqrt rounded once more is exact for
    float32 inputs (|sqrt(x) - float32 midpoint| >= 2^-51 relative > float64 error)."""
    return np.sqrt(np.asarray(x, np.float32).astype(np.float64)).astype(np.float32)


def tree(x: np.ndarray, axis: int) -> np.ndarray:
    """kvc::tree over an in-thread register array: x[i] + x[i + n/2], repeated."""
    x = np.moveaxis(x, axis, -1)
    n = x.shape[-1]
    while n > 1:
        n //= 2
        x = x[..., :n] + x[..., n:]
    return x[..., 0]


def warp_tree(v: np.ndarray) -> np.ndarray:
    """kvc::warp_tree on [W, 32, ...]: v += shfl_xor(v, h) for h = 16 .. 1 (every lane gets the sum)."""
    for h in (16, 8, 4, 2, 1):
        v = v + v[:, LANES ^ h]
    return v


def rms_of(total: np.ndarray, n: int) -> np.ndarray:
    r = sqrt_rn(total / f32(n))
    return np.where(r < f32(2.0**-100), f32(1.0), r).astype(f32)


def frexp_exponent(x: float) -> int:
    bits = int(np.array(x, f32).view(np.uint32)) & 0x7FFFFFFF
    e = bits >> 23
    if bits == 0 or e == 255:
        return 0
    if e == 0:
        return -126 - (32 - bits.bit_length() - 9)  # __clz(bits) = 32 - bit_length
    return e - 126


def pow2f(e: int) -> np.float32:
    if e > 127:
        return f32(np.inf)
    if e >= -149:
        return f32(np.ldexp(1.0, e))  # exact: normal or subnormal power of two
    return f32(0.0)


def store(x: np.ndarray, sd: torch.dtype) -> np.ndarray:
    """Store<SC>::round: float16 round-to-nearest-even and back, or float32 as is."""
    x = np.asarray(x, np.float32)
    return x.astype(np.float16).astype(np.float32) if sd == torch.float16 else x


def smallest(sd: torch.dtype) -> np.float32:
    return f32(2.0**-24) if sd == torch.float16 else f32(2.0**-149)


def lloyd_max_codes(d: np.ndarray, step: np.ndarray, bits: int) -> np.ndarray:
    """kvc::lloyd_max_code of d / step (step broadcast to d): #{j : z > t_j}; 0 where step == 0."""
    pos = step > 0
    z = d / np.where(pos, step, f32(1.0))
    thr = np.array(lloyd_max_thresholds(bits), np.float32)
    codes = (z[..., None] > thr).sum(-1)
    return np.where(pos, codes, 0).astype(np.uint8)


# ---- one block -------------------------------------------------------------------------------------
def emulate_half(x: np.ndarray, spec: TileSpec, is_v: bool, trace: dict | None = None) -> dict:
    """One block of the kernel on a float32 tile x [T, D]: the K (is_v=False) or V half's fields."""
    T, D, sd, iters = spec.tile_tokens, spec.head_dim, spec.scale_dtype, spec.sinkhorn_iters
    NK, NJ = T // W, D // 32
    t_of = np.arange(W)[:, None, None, None] + W * np.arange(NK)[None, None, :, None]  # [W,1,NK,1]
    c_of = LANES[None, :, None, None] + 32 * np.arange(NJ)[None, None, None, :]  # [1,32,1,NJ]
    lane = LANES[None, :, None, None]

    # load, WHT: stages h < 32 are shuffles (upper lane: partner - own), then in-thread pairs of j
    y = np.asarray(x, np.float32)[t_of, c_of]  # [W, 32, NK, NJ]
    hs = 1
    while hs < 32:
        p = y[:, LANES ^ hs]
        y = np.where((lane & hs) != 0, p - y, y + p)
        hs *= 2
    hb = 1
    while hb < NJ:
        y = y.copy()
        for j in range(NJ):
            if not j & hb:
                a, c = y[..., j].copy(), y[..., j | hb].copy()
                y[..., j], y[..., j | hb] = a + c, a - c
        hb *= 2
    y = y * f32(_inv_sqrt(D))

    # variance normalization
    r = np.ones((W, 32, NK), f32)  # r[k]: replicated over lanes
    s = np.ones((W, 32, NJ), f32)  # s[j]: replicated over warps
    br, bs, best, ys = r, s, f32(np.inf), None
    it = 0
    while True:
        z = y if it == 0 else ys / r[..., None]
        zz = z * z
        row = rms_of(warp_tree(tree(zz, -1)), D)  # [W, 32, NK]
        part = tree(zz, -2)  # [W, 32, NJ]: part[w * D + lane + 32 j]
        part_wd = part.transpose(0, 2, 1).reshape(W, D)
        colrms = rms_of(tree(part_wd, 0), T)  # [D]: tree<W> over the warps' partials
        score = f32(f32(colrms.max() / colrms.min()) + f32(row.max() / row.min()))
        if trace is not None:
            trace.setdefault("iters", []).append(dict(r=r, s=s, colrms=colrms, row=row, score=score))
        if score < best:
            best, br, bs = score, r, s
        if it >= iters:
            break
        s = s * colrms[c_of[0, :, 0, :]][None]
        ys = y / s[:, :, None, :]
        q = ys / r[..., None]
        r = r * rms_of(warp_tree(tree(q * q, -1)), D)
        it += 1

    # power-of-two balance
    diff = frexp_exponent(br.max()) - frexp_exponent(bs.max())
    shift = diff // 2 if diff >= 0 else -((1 - diff) // 2)

    lloyd_max = spec.quantizer == "lloyd_max"
    if not is_v and lloyd_max:
        rs = store(np.maximum(br[:, 0, :] * pow2f(-shift), smallest(sd)), sd)  # [W, NK]
        u = y / rs[:, None, :, None] + f32(0.0)
        c_idx = c_of[0, :, 0, :]  # [32, NJ]

        def column_sum(a):  # in-thread tree over k (t, t + T/2), then tree<W> over the warps' partials
            part = tree(a, 2).transpose(0, 2, 1).reshape(W, D)  # part[w, c]
            return tree(part, 0)  # [D]

        mean = store(column_sum(u) / f32(T), sd)
        d = u - mean[c_idx][None, :, None, :]
        step = store(sqrt_rn(column_sum(d * d) / f32(T)), sd)
        codes = lloyd_max_codes(d, step[c_idx][None, :, None, :], spec.k_bits)
        out = dict(
            k_codes=codes.transpose(3, 1, 2, 0).reshape(D, T),
            chan_step=step,
            chan_min=mean,
            row_scale=rs.T.reshape(T),
        )
    elif is_v and lloyd_max:
        cs = store(np.maximum(bs[0] * pow2f(shift), smallest(sd)), sd)  # [32, NJ]
        u = y / cs[None, :, None, :] + f32(0.0)

        def token_sum(a):  # in-thread tree over j (c, c + D/2), then warp_tree over the lanes
            return warp_tree(tree(a, -1))  # [W, 32, NK], equal over the lanes

        mean = store(token_sum(u) / f32(D), sd)
        d = u - mean[..., None]
        step = store(sqrt_rn(token_sum(d * d) / f32(D)), sd)
        codes = lloyd_max_codes(d, step[..., None], spec.v_bits)
        out = dict(
            v_codes=codes.transpose(2, 0, 3, 1).reshape(T, D),
            tok_step=step[:, 0, :].T.reshape(T),
            tok_min=mean[:, 0, :].T.reshape(T),
            col_scale=cs.T.reshape(D),
        )
    elif not is_v:
        rs = store(np.maximum(br[:, 0, :] * pow2f(-shift), smallest(sd)), sd)  # [W, NK]
        u = y / rs[:, None, :, None] + f32(0.0)
        lo, hi = u.min(axis=(0, 2)), u.max(axis=(0, 2))  # [32, NJ]
        step = store((hi - lo) / f32(15.0), sd)
        low = store(lo, sd)
        pos = step > 0
        safe = np.where(pos, step, f32(1.0))
        codes = np.clip(np.rint((u - low[None, :, None, :]) / safe[None, :, None, :]), 0, 15)
        codes = np.where(pos[None, :, None, :], codes, 0).astype(np.uint8)
        out = dict(
            k_codes=codes.transpose(3, 1, 2, 0).reshape(D, T),  # [c, t]: c = l + 32j, t = w + Wk
            chan_step=step.T.reshape(D),
            chan_min=low.T.reshape(D),
            row_scale=rs.T.reshape(T),
        )
    else:
        qmax = f32(2**spec.v_bits - 1)
        cs = store(np.maximum(bs[0] * pow2f(shift), smallest(sd)), sd)  # [32, NJ]
        u = y / cs[None, :, None, :] + f32(0.0)
        lo, hi = u.min(axis=(1, 3)), u.max(axis=(1, 3))  # [W, NK]: per thread over j, then the warp
        step = store((hi - lo) / qmax, sd)
        low = store(lo, sd)
        pos = step > 0
        safe = np.where(pos, step, f32(1.0))
        codes = np.clip(np.rint((u - low[:, None, :, None]) / safe[:, None, :, None]), 0, qmax)
        codes = np.where(pos[:, None, :, None], codes, 0).astype(np.uint8)
        out = dict(
            v_codes=codes.transpose(2, 0, 3, 1).reshape(T, D),
            tok_step=step.T.reshape(T),
            tok_min=low.T.reshape(T),
            col_scale=cs.T.reshape(D),
        )
    if trace is not None:
        trace.update(y=y, br=br, bs=bs, shift=shift, u=u)
    return out


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    per = 8 // bits
    c = codes.reshape(*codes.shape[:-1], -1, per).astype(np.uint32)
    return (c << (np.arange(per, dtype=np.uint32) * bits)).sum(-1).astype(np.uint8).reshape(-1)


def emulate_records(k: torch.Tensor, v: torch.Tensor, spec: TileSpec) -> torch.Tensor:
    """The kernel's records for k, v [n, T, D] (any float dtype; finite, in range)."""
    sd = np.float16 if spec.scale_dtype == torch.float16 else np.float32
    recs = []
    for kt, vt in zip(k.float().numpy(), v.float().numpy()):
        f = emulate_half(kt, spec, False) | emulate_half(vt, spec, True)
        rec = np.zeros(spec.tile_nbytes, np.uint8)
        for name in spec.section_names():
            off, n = spec.section(name)
            if name == "k_codes":
                data = _pack(f[name], spec.k_bits)
            elif name == "v_codes":
                data = _pack(f[name], spec.v_bits)
            else:
                data = f[name].astype(sd).view(np.uint8)
            rec[off : off + n] = data
        recs.append(rec)
    return torch.from_numpy(np.stack(recs))


# ---- tests -------------------------------------------------------------------------------------------
def _inputs(D: int, T: int, in_dtype: torch.dtype, kind: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if kind == "randn":
        k, v = torch.randn(2, T, D, generator=g), torch.randn(2, T, D, generator=g)
    else:
        k = realistic_kv(2, T, D, generator=g, dtype=torch.float32)
        v = realistic_kv(2, T, D, generator=g, dtype=torch.float32)
    return k.to(in_dtype) + 0.0, v.to(in_dtype) + 0.0


def _diff(got: torch.Tensor, want: torch.Tensor, spec: TileSpec) -> str:
    bad = (got != want).nonzero()
    if not len(bad):
        return ""
    first = bad[0].tolist()
    where = next(n for n in spec.section_names() if spec.offset(n) <= first[-1] < sum(spec.section(n)))
    return f"{len(bad)} bytes differ; first at {first} in {where!r}: got {int(got[tuple(first)])}, want {int(want[tuple(first)])}"


CASES = [
    ("k4v2_g128", 64, torch.float32, torch.float16, "randn"),
    ("k4v2_g128", 64, torch.float32, torch.float32, "realistic"),
    ("k4v2_g128", 128, torch.float32, torch.bfloat16, "randn"),
    ("k4v4_g64", 64, torch.float32, torch.float32, "realistic"),
    ("k4v2_g64", 256, torch.float32, torch.float16, "realistic"),
    ("k4v2_g128", 64, torch.float16, torch.float16, "realistic"),
    ("k4v4_g128", 128, torch.float16, torch.float32, "randn"),
]


@pytest.mark.parametrize("preset,D,scale_dtype,in_dtype,kind", CASES)
def test_kernel_mirror_matches_codec(preset, D, scale_dtype, in_dtype, kind):
    spec = TileSpec(preset=preset, head_dim=D, scale_dtype=scale_dtype)
    seed = zlib.crc32(repr((preset, D, kind)).encode())
    k, v = _inputs(D, spec.tile_tokens, in_dtype, kind, seed)
    assert not _diff(emulate_records(k, v, spec), codec.encode_tiles(k, v, spec), spec), f"seed={seed}"


@pytest.mark.parametrize("preset,D,scale_dtype,in_dtype,kind", CASES)
def test_kernel_mirror_matches_codec_lloyd_max(preset, D, scale_dtype, in_dtype, kind):
    spec = TileSpec(preset=preset, head_dim=D, scale_dtype=scale_dtype, quantizer="lloyd_max")
    seed = zlib.crc32(repr((preset, D, kind, "lm")).encode())
    k, v = _inputs(D, spec.tile_tokens, in_dtype, kind, seed)
    assert not _diff(emulate_records(k, v, spec), codec.encode_tiles(k, v, spec), spec), f"seed={seed}"


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_kernel_mirror_lloyd_max_degenerate_axes(scale_dtype):
    # constant axes (stored RMS 0 -> code 0), a lone nonzero channel, two-valued tiles, tiny values
    spec = TileSpec(preset="k4v2_g64", head_dim=64, scale_dtype=scale_dtype, quantizer="lloyd_max")
    T, D = spec.tile_tokens, spec.head_dim
    g = torch.Generator().manual_seed(17)
    tiles = torch.stack([
        torch.zeros(T, D),
        torch.randn(1, D, generator=g).expand(T, D),
        torch.zeros(T, D).index_fill_(1, torch.tensor([5]), 1.0),
        torch.randint(0, 2, (T, D), generator=g).float(),
        torch.randn(T, D, generator=g) * 1e-6,
    ])
    k, v = tiles, tiles.flip(0)
    want = codec.encode_tiles(k, v, spec)
    assert not _diff(emulate_records(k, v, spec), want, spec)
    fields = codec.unpack_fields(want, spec)
    assert bool((fields.chan_step == 0).any()) and bool((fields.tok_step == 0).any())  # the scale-0 path ran
