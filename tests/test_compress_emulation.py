"""CPU mirror of the GPU compression kernel (``csrc/compress.cu``), operation for operation.

``emulate_records`` replays the kernel in numpy float32 with its thread layout, for a record half on
one CTA of 16 warps (32 in the A/B variant; the append kernels, sm_80, big launches) or on a cluster of
R = T/16 CTAs of 8 warps (4 and 16 in the variants; the layer kernel on sm_90): rank q, warp w, lane l hold tokens t = q + R*(w + W*k) and
channels c = l + 32*j; arrays are indexed ``[q, w, l, k, j]`` like the registers. Every in-thread
halving tree, ``__shfl_xor`` butterfly (WHT stages h < 32, ``warp_tree``), the tree over the warps
(shared memory) and over the ranks (distributed shared memory), and the K half's per-channel trees
after its transposition (tokens t = l + 32*i in the lanes) are written out in the kernel's order;
``sqrt`` is correctly rounded like ``__fsqrt_rn``; divisions are IEEE (the kernel's
reciprocal-and-correction sequence equals them: ``test_fast_division_is_the_ieee_quotient``).
Min/max reductions are order-free (finite input, canonical +0 after ``+ 0.0``). Both quantizers,
with lloyd_max's Gaussian fit and least-squares refit through the same per-axis sums.

What the tests establish (no GPU needed):

* the kernel's order of operations is the codec's: the mirror (correctly rounded sqrt, as
  ``__fsqrt_rn``) reproduces ``codec.encode_tiles`` byte for byte, for float16 and float32 scales.
  On torch builds with MKL (x86 wheels) ``torch.sqrt`` of float32 is not correctly rounded (MKL VML
  in ``VML_HA`` mode, ATen ``cpu/vml.h``: ``IMPLEMENT_VML_MKL(sqrt, Sqrt)``), so the codec takes its
  sqrt in float64; a codec back on ``torch.sqrt`` fails the float32-scale cases here and
  ``tests/test_codec.py::test_codec_rms_is_the_correctly_rounded_sqrt``;
* for both layouts (one CTA, a cluster of ranks), so the rank-split trees keep the codec's order;
* the lloyd_max path (Gaussian fit, refit) reproduces the codec on random, realistic and degenerate
  tiles (constant axes: stored RMS 0, code 0; zero lines: the smallest scale);
* the fast division is the IEEE quotient on adversarial operands in its admitted ranges.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from kvarn_cutlass import codec
from kvarn_cutlass.format import TileSpec, codebook, lloyd_max_thresholds
from kvarn_cutlass.ops import compress as C
from kvarn_cutlass.ops.compress import _inv_sqrt

from _helpers import realistic_kv

f32 = np.float32
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


def warp_tree(v: np.ndarray, axis: int = 1) -> np.ndarray:
    """kvc::warp_tree over the lane axis: v += shfl_xor(v, h) for h = 16 .. 1 (every lane gets the sum)."""
    v = np.moveaxis(v, axis, 0)
    for h in (16, 8, 4, 2, 1):
        v = v + v[LANES ^ h]
    return np.moveaxis(v, 0, axis)


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


def lloyd_max_fit(u, total, bcast, n: int, bits: int, sd: torch.dtype):
    """The kernel's lloyd_max quantizer of the axes of u: ``total(a)`` is the kernel's halving-tree sum
    of a over each axis, ``bcast(x)`` spreads a per-axis value back over u. Gaussian fit (mean, RMS),
    then the least-squares refit (kvc::lloyd_max_refit). Returns (step, min) per axis and codes."""
    with np.errstate(over="ignore", invalid="ignore"):
        mean = total(u) / f32(n)
        c = store(mean, sd)
        d = u - bcast(c)
        rms = store(sqrt_rn(total(d * d) / f32(n)), sd)
        b = np.array(codebook("lloyd_max", bits), np.float32)[lloyd_max_codes(d, bcast(rms), bits)]
        bm = total(b) / f32(n)
        db = b - bcast(bm)
        den, num = total(db * db), total(db * d)
        step = store(num / np.where(den > 0, den, f32(1.0)), sd)
        low = store(mean - step * bm, sd)
    refit = (den > 0) & (step > 0) & np.isfinite(step) & np.isfinite(low)
    step, low = np.where(refit, step, rms).astype(f32), np.where(refit, low, c).astype(f32)
    return step, low, lloyd_max_codes(u - bcast(low), bcast(step), bits)


# ---- one record half -------------------------------------------------------------------------------
def emulate_half(x: np.ndarray, spec: TileSpec, is_v: bool, ranks: int, trace: dict | None = None,
                 cluster_warps: int = C.DEFAULT_CLUSTER_WARPS, cta_warps: int | None = None) -> dict:
    """The kernel's record half on a float32 tile x [T, D] (the K half if not is_v) when it runs on
    ``ranks`` CTAs (1: one CTA of ``cta_warps`` warps, compress.cu's KVARN_OW; T / 16: the layer kernel's cluster
    on sm_90, ``cluster_warps`` warps per CTA: KVARN_CW). Arrays are indexed [q, w, l, k, j] like the registers: rank q,
    warp w, lane l hold tokens t = q + R*(w + W*k) and channels c = l + 32*j."""
    T, D, sd, iters, R = spec.tile_tokens, spec.head_dim, spec.scale_dtype, spec.sinkhorn_iters, ranks
    # kvc::Shape::W: KVARN_CW warps per CTA of a cluster, KVARN_OW alone
    W = cluster_warps if R > 1 else cta_warps or C.default_cta_warps(T, D)
    NK, NJ = T // (R * W), D // 32
    q_ax, w_ax, k_ax = np.arange(R), np.arange(W), np.arange(NK)
    t_of = q_ax[:, None, None, None, None] + R * (w_ax[None, :, None, None, None] + W * k_ax[None, None, None, :, None])
    c_of = LANES[None, None, :, None, None] + 32 * np.arange(NJ)[None, None, None, None, :]
    lane = LANES[None, None, :, None, None]
    c_idx = c_of[0, 0, :, 0, :]  # [32, NJ]

    # load, WHT: stages h < 32 are shuffles (upper lane: partner - own), then in-thread pairs of j
    y = np.asarray(x, np.float32)[t_of, c_of]  # [R, W, 32, NK, NJ]
    hs = 1
    while hs < 32:
        p = y[:, :, LANES ^ hs]
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

    def row_rms(a):  # tree over j (c, c + D/2), then warp_tree over the lanes: [R, W, 32, NK]
        return rms_of(warp_tree(tree(a, -1), 2), D)

    def col_rms(a):  # tree over k, then tree<W> over the warps, then tree<R> over the ranks: [D]
        part = tree(a, 3)  # [R, W, 32, NJ]
        part = part.transpose(0, 1, 3, 2).reshape(R, W, D)  # part[q, w, c = l + 32 j]
        return rms_of(tree(tree(part, 1), 0), T)

    # variance normalization
    r = np.ones((R, W, 32, NK), f32)  # r[k]: replicated over lanes
    s = np.ones((R, W, 32, NJ), f32)  # s[j]: replicated over ranks and warps
    br, bs, best, ys = r, s, f32(np.inf), None
    it = 0
    while True:
        z = y if it == 0 else ys / r[..., None]
        zz = z * z
        row = row_rms(zz)
        colrms = col_rms(zz)
        score = f32(f32(colrms.max() / colrms.min()) + f32(row.max() / row.min()))
        if trace is not None:
            trace.setdefault("iters", []).append(dict(r=r, s=s, colrms=colrms, row=row, score=score))
        if score < best:
            best, br, bs = score, r, s
        if it >= iters:
            break
        s = s * colrms[c_idx][None, None]
        ys = y / s[..., None, :]
        q = ys / r[..., None]
        r = r * row_rms(q * q)
        it += 1

    # power-of-two balance
    diff = frexp_exponent(br.max()) - frexp_exponent(bs.max())
    shift = diff // 2 if diff >= 0 else -((1 - diff) // 2)

    lloyd_max = spec.quantizer == "lloyd_max"
    if not is_v:
        # zero tokens (codec step 3) store the smallest scale
        zero_row = (y == 0).all(axis=(2, 4))  # [R, W, NK]
        rs = store(np.maximum(np.where(zero_row, f32(0.0), br[:, :, 0, :] * pow2f(-shift)), smallest(sd)), sd)
        u = y / rs[:, :, None, :, None] + f32(0.0)  # [R, W, 32, NK, NJ]
        # transposed: channel c, tokens t = l + 32 i (lane l): ut[c, i, l]
        # transposed (rank c // (D / R) holds channel c for every token): ut[c, i, l], t = l + 32 i
        ut = np.empty((D, T), np.float32)
        ut[np.broadcast_to(c_of, u.shape).reshape(-1), np.broadcast_to(t_of, u.shape).reshape(-1)] = u.reshape(-1)
        ut = ut.reshape(D, T // 32, 32)

        def channel_sum(a):  # in-thread tree over i (t, t + T/2), then warp_tree over the lanes: [D]
            return warp_tree(tree(a, 1))[:, 0]

        if lloyd_max:
            step, low, codes = lloyd_max_fit(ut, channel_sum, lambda v: v[:, None, None], T, spec.k_bits, sd)
        else:
            lo, hi = ut.min(axis=(1, 2)), ut.max(axis=(1, 2))
            step = store((hi - lo) / f32(15.0), sd)
            low = store(lo, sd)
            pos = step > 0
            safe = np.where(pos, step, f32(1.0))
            codes = np.clip(np.rint((ut - low[:, None, None]) / safe[:, None, None]), 0, 15)
            codes = np.where(pos[:, None, None], codes, 0).astype(np.uint8)
        row_scale = np.empty(T, np.float32)
        row_scale[t_of[:, :, 0, :, 0].reshape(-1)] = rs.reshape(-1)
        out = dict(k_codes=codes.reshape(D, T), chan_step=step, chan_min=low, row_scale=row_scale)
    else:
        zero_col = (y == 0).all(axis=(0, 1, 3))  # [32, NJ]
        cs = store(np.maximum(np.where(zero_col, f32(0.0), bs[0, 0] * pow2f(shift)), smallest(sd)), sd)  # [32, NJ]
        u = y / cs[None, None, :, None, :] + f32(0.0)

        def token_sum(a):  # in-thread tree over j (c, c + D/2), then warp_tree over the lanes
            return warp_tree(tree(a, -1), 2)  # [R, W, 32, NK], equal over the lanes

        if lloyd_max:
            step, low, codes = lloyd_max_fit(u, token_sum, lambda v: v[..., None], D, spec.v_bits, sd)
            step, low = step[:, :, 0], low[:, :, 0]  # [R, W, NK]
        else:
            qmax = f32(2**spec.v_bits - 1)
            lo, hi = u.min(axis=(2, 4)), u.max(axis=(2, 4))  # [R, W, NK]: per thread over j, then the warp
            step = store((hi - lo) / qmax, sd)
            low = store(lo, sd)
            pos = step > 0
            safe = np.where(pos, step, f32(1.0))
            codes = np.clip(np.rint((u - low[:, :, None, :, None]) / safe[:, :, None, :, None]), 0, qmax)
            codes = np.where(pos[:, :, None, :, None], codes, 0).astype(np.uint8)
        t_tok = t_of[:, :, 0, :, 0]  # [R, W, NK]
        v_codes = np.empty((T, D), np.uint8)
        v_codes[np.broadcast_to(t_of, codes.shape), np.broadcast_to(c_of, codes.shape)] = codes
        tok_step, tok_min = np.empty(T, np.float32), np.empty(T, np.float32)
        tok_step[t_tok.reshape(-1)], tok_min[t_tok.reshape(-1)] = step.reshape(-1), low.reshape(-1)
        out = dict(v_codes=v_codes, tok_step=tok_step, tok_min=tok_min, col_scale=cs.T.reshape(D))
    if trace is not None:
        trace.update(y=y, br=br, bs=bs, shift=shift, u=u)
    return out


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    per = 8 // bits
    c = codes.reshape(*codes.shape[:-1], -1, per).astype(np.uint32)
    return (c << (np.arange(per, dtype=np.uint32) * bits)).sum(-1).astype(np.uint8).reshape(-1)


def emulate_records(k: torch.Tensor, v: torch.Tensor, spec: TileSpec, ranks: int,
                    cluster_warps: int = C.DEFAULT_CLUSTER_WARPS, cta_warps: int | None = None) -> torch.Tensor:
    """The kernel's records for k, v [n, T, D] (any float dtype; finite, in range) when each record
    half runs on ``ranks`` CTAs (of ``cluster_warps`` warps when ranks > 1, else one of ``cta_warps``)."""
    sd = np.float16 if spec.scale_dtype == torch.float16 else np.float32
    recs = []
    for kt, vt in zip(k.float().numpy(), v.float().numpy()):
        f = (emulate_half(kt, spec, False, ranks, cluster_warps=cluster_warps, cta_warps=cta_warps)
             | emulate_half(vt, spec, True, ranks, cluster_warps=cluster_warps, cta_warps=cta_warps))
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
@pytest.mark.parametrize("cluster", [False, True])
def test_kernel_mirror_matches_codec(preset, D, scale_dtype, in_dtype, kind, cluster):
    spec = TileSpec(preset=preset, head_dim=D, scale_dtype=scale_dtype)
    ranks = spec.tile_tokens // 16 if cluster else 1
    seed = zlib.crc32(repr((preset, D, kind)).encode())
    k, v = _inputs(D, spec.tile_tokens, in_dtype, kind, seed)
    assert not _diff(emulate_records(k, v, spec, ranks), codec.encode_tiles(k, v, spec), spec), f"seed={seed}"


@pytest.mark.parametrize("preset,D,scale_dtype,in_dtype,kind", CASES)
@pytest.mark.parametrize("cluster", [False, True])
def test_kernel_mirror_matches_codec_lloyd_max(preset, D, scale_dtype, in_dtype, kind, cluster):
    spec = TileSpec(preset=preset, head_dim=D, scale_dtype=scale_dtype, quantizer="lloyd_max")
    ranks = spec.tile_tokens // 16 if cluster else 1
    seed = zlib.crc32(repr((preset, D, kind, "lm")).encode())
    k, v = _inputs(D, spec.tile_tokens, in_dtype, kind, seed)
    assert not _diff(emulate_records(k, v, spec, ranks), codec.encode_tiles(k, v, spec), spec), f"seed={seed}"


@pytest.mark.parametrize("preset,D,scale_dtype,in_dtype,kind", CASES[1::2])
@pytest.mark.parametrize("quantizer", ["uniform", "lloyd_max"])
@pytest.mark.parametrize("cluster_warps", [4, 16])
def test_kernel_mirror_of_the_cluster_warps_variants_matches_codec(preset, D, scale_dtype, in_dtype, kind, quantizer,
                                                                  cluster_warps):
    """The A/B variants with 4 or 16 warps per cluster CTA (ops.compress.CLUSTER_WARPS) keep the codec's bytes:
    their warps hold tokens rank + R * (w + W * k), so the halving trees over the tokens keep their order."""
    spec = TileSpec(preset=preset, head_dim=D, scale_dtype=scale_dtype, quantizer=quantizer)
    seed = zlib.crc32(repr((preset, D, kind, quantizer, cluster_warps)).encode())
    k, v = _inputs(D, spec.tile_tokens, in_dtype, kind, seed)
    got = emulate_records(k, v, spec, spec.tile_tokens // 16, cluster_warps)
    assert not _diff(got, codec.encode_tiles(k, v, spec), spec), f"seed={seed}"


@pytest.mark.parametrize("preset,D,scale_dtype,in_dtype,kind", [c for c in CASES if c[1] <= 128])
@pytest.mark.parametrize("quantizer", ["uniform", "lloyd_max"])
@pytest.mark.parametrize("warps", [16, 32])
def test_kernel_mirror_of_each_cta_width_matches_codec(preset, D, scale_dtype, in_dtype, kind, quantizer, warps):
    """The one-CTA forms at both widths where both compile (ops.compress.CTA_WARPS, head_dim <= 128: 32 shipped,
    16 the A/B variant) keep the codec's bytes: tokens w + W k, a tree level more or less over the warps."""
    spec = TileSpec(preset=preset, head_dim=D, scale_dtype=scale_dtype, quantizer=quantizer)
    seed = zlib.crc32(repr((preset, D, kind, quantizer, f"ow{warps}")).encode())
    k, v = _inputs(D, spec.tile_tokens, in_dtype, kind, seed)
    got = emulate_records(k, v, spec, 1, cta_warps=warps)
    assert not _diff(got, codec.encode_tiles(k, v, spec), spec), f"seed={seed}"


@pytest.mark.parametrize("quantizer", ["uniform", "lloyd_max"])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("ranks,cluster_warps,cta_warps", [(1, 8, 16), (1, 8, 32), (4, 4, 16), (4, 16, 16)])
def test_kernel_mirror_degenerate_tiles(quantizer, scale_dtype, ranks, cluster_warps, cta_warps):
    # constant axes (stored step 0 -> code 0), zero lines (smallest scale), a lone nonzero channel or
    # token, two-valued tiles, tiny and float16-subnormal values (the lloyd_max refit's sparse axes)
    spec = TileSpec(preset="k4v2_g64", head_dim=64, scale_dtype=scale_dtype, quantizer=quantizer)
    T, D = spec.tile_tokens, spec.head_dim
    g = torch.Generator().manual_seed(17)
    tiles = torch.stack([
        torch.zeros(T, D),
        torch.full((T, D), 0.5),
        torch.full((T, D), -3 * 2.0**-24),
        torch.randn(1, D, generator=g).expand(T, D),
        (torch.arange(T, dtype=torch.float32)[:, None] - 20).expand(T, D) / 8,
        torch.zeros(T, D).index_fill_(1, torch.tensor([5]), 1.0),
        torch.zeros(T, D).index_fill_(0, torch.tensor([3]), -2.0),
        torch.randint(0, 2, (T, D), generator=g).float(),
        torch.randn(T, D, generator=g) * 1e-6,
    ])
    k, v = tiles, tiles.flip(0)
    want = codec.encode_tiles(k, v, spec)
    assert not _diff(emulate_records(k, v, spec, ranks, cluster_warps, cta_warps), want, spec)
    fields = codec.unpack_fields(want, spec)
    assert bool((fields.chan_step == 0).any()) and bool((fields.tok_step == 0).any())  # the scale-0 path ran
    smallest = torch.finfo(scale_dtype).smallest_normal * torch.finfo(scale_dtype).eps
    assert bool((fields.row_scale == smallest).any()) and bool((fields.col_scale == smallest).any())  # zero lines


# ---- the kernel's fast division (kvc::div_rn) ------------------------------------------------------
def _fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fma(a, b, c), correctly rounded: a * b is exact in float64, the float64 sum's error is
    recovered exactly (TwoSum), and only a float64 sum that lands on a float32 midpoint needs it."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    s = p + c64
    bp = s - p
    e = (p - (s - bp)) + (c64 - bp)  # s + e == p + c exactly
    f = s.astype(np.float32)
    f64 = f.astype(np.float64)
    g = np.nextafter(f, np.where(s > f64, np.float32(np.inf), np.float32(-np.inf)).astype(np.float32))
    mid = (f64 != s) & (np.abs(s - f64) == np.abs(g.astype(np.float64) - s))
    up = np.where(e > 0, np.maximum(f, g), np.minimum(f, g))
    return np.where(mid & (e != 0), up, f).astype(np.float32)


def _div_rn(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """kvc::div_rn with y = RN(1/b) (__frcp_rn): q0 = a*y, two residual corrections."""
    with np.errstate(all="ignore"):
        y = (np.float32(1.0) / b).astype(np.float32)  # IEEE division: the correctly rounded reciprocal
        q0 = (a * y).astype(np.float32)
        q1 = _fma32(_fma32(-b, q0, a), y, q0)
        return _fma32(_fma32(-b, q1, a), y, q1)


def test_fast_division_is_the_ieee_quotient():
    """div_rn against IEEE float32 division on adversarial and random operands in the ranges the
    kernel admits (divisor in [2^-32, 2^32], dividend 0 or in [2^-92, 2^92]): divisors with all-ones
    significands (where a * RN(1/b) is furthest from a / b), powers of two, quotients on and next to
    integers, half-integers and the lloyd_max thresholds (the code decisions), the range's edges.
    The fma emulation is checked against exact rationals on a sample."""
    from fractions import Fraction

    seed = 16
    rng = np.random.default_rng(seed)
    n = 200_000

    def floats(lo_exp, hi_exp, size, significand=None):
        m = rng.integers(0, 2**23, size) if significand is None else np.full(size, significand)
        e = rng.integers(lo_exp, hi_exp + 1, size)
        x = np.ldexp((1 + m / 2.0**23), e).astype(np.float32)
        return np.where(rng.integers(0, 2, size) == 1, -x, x).astype(np.float32)

    b = np.concatenate([floats(-32, 31, n), floats(-32, 31, n // 4, 2**23 - 1), floats(-32, 31, n // 8, 0),
                        floats(-32, 31, n // 8, 2**23 - 2)])
    a = floats(-92, 91, b.size)
    # quotients near targets: a = b * q rounded, and its float32 neighbours
    targets = np.concatenate([np.arange(16) + 0.0, np.arange(16) + 0.5, np.array(lloyd_max_thresholds(4) + lloyd_max_thresholds(2))])
    k = rng.integers(0, targets.size, b.size)
    near = (b * targets[k]).astype(np.float32)
    near = np.where(rng.integers(0, 3, b.size) == 0, np.nextafter(near, np.float32(np.inf)), near)
    edges = np.array([2.0**-92, 2.0**92, -(2.0**-92), 2.0**91 * 1.9999, 0.0, -0.0], np.float32)
    a = np.concatenate([a, near, np.resize(edges, b.size)])
    b = np.concatenate([b, b, b])
    ok = (np.abs(b) >= 2.0**-32) & (np.abs(b) <= 2.0**32) & ((a == 0) | ((np.abs(a) >= 2.0**-92) & (np.abs(a) <= 2.0**92)))
    a, b = a[ok], b[ok]
    with np.errstate(all="ignore"):
        want = (a / b).astype(np.float32)
    got = _div_rn(a, b)
    bad = (got != want) | ((got == 0) != (want == 0))
    assert not bad.any(), f"seed={seed}: {bad.sum()} quotients differ, first a={a[bad][0]!r} b={b[bad][0]!r}"
    # the fma emulation itself, exactly (a sample)
    x, yv, z = (floats(-40, 40, 2000) for _ in range(3))
    exact = [Fraction(float(p)) * Fraction(float(q)) + Fraction(float(r)) for p, q, r in zip(x, yv, z)]
    got_fma = _fma32(x, yv, z)
    for e, g in zip(exact, got_fma):
        lo, hi = np.nextafter(g, np.float32(-np.inf)), np.nextafter(g, np.float32(np.inf))
        dg, dlo, dhi = abs(Fraction(float(g)) - e), abs(Fraction(float(lo)) - e), abs(Fraction(float(hi)) - e)
        assert dg <= dlo and dg <= dhi, f"seed={seed}: fma emulation not nearest for {e}"
